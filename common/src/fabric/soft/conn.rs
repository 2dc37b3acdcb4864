//! Connection set-up of the `tcp` transport: TCP connect/accept and the MPA exchange
//! (revision 2, RFC 6581 IRD/ORD prefix, CRC negotiated, markers refused), with this side's
//! capability block and the application's private data after it.

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};

use crate::fabric::error::{Error, Result};
use crate::fabric::qp::{ConnInfo, ConnParams};
use crate::fabric::soft::wire::mpa::{self, MpaConfig, MpaFrame, RtrTypes};
use crate::fabric::soft::wire::rx::RxConfig;
use crate::fabric::soft::wire::{self, CapFlags, Caps, WireError};
use crate::fabric::url::{Scheme, Url};

/// The largest ULPDU sent when the connection's MSS is unknown: one FPDU per TCP segment of
/// a 1500-byte MTU. (`ConnParams::default()` asks for 65535, which the MSS then cuts.)
pub const DEFAULT_MAX_ULPDU: usize = wire::DEFAULT_MAX_ULPDU;

/// The largest ULPDU whose FPDU fits one TCP segment of `sock` (RFC 5044's MULPDU without
/// markers: the MSS less the 2-byte length, the pad and the CRC), at least
/// [`wire::tx::MIN_MAX_ULPDU`]. None if the socket does not say its MSS.
pub(crate) fn mulpdu(sock: &TcpStream) -> Option<usize> {
    use nix::sys::socket::{getsockopt, sockopt::TcpMaxSeg};
    let mss = getsockopt(sock, TcpMaxSeg).ok()? as usize;
    let m = (mss.saturating_sub(4) & !3).saturating_sub(2);
    Some(m.clamp(wire::tx::MIN_MAX_ULPDU, wire::MAX_ULPDU_LIMIT))
}

/// The most application private data a connect or accept may carry: 256 bytes of MPA private
/// data (what Linux siw accepts) less the 4-byte IRD/ORD prefix and the 12-byte capability block.
pub const MAX_PRIVATE_DATA: usize = mpa::MAX_SENT_PRIVATE_DATA - 4 - wire::caps::BLOCK_LEN;

/// What the engine needs from the handshake.
pub(crate) struct Negotiated {
    pub(crate) info: ConnInfo,
    pub(crate) peer_max_ulpdu: usize,
    /// The receive side's settings: CRC, our advertised maximum ULPDU, the opcodes both
    /// sides understand.
    pub(crate) rx: RxConfig,
}

fn config(params: &ConnParams, private_data: &[u8], passive: bool) -> Result<MpaConfig> {
    if private_data.len() > MAX_PRIVATE_DATA {
        return Err(Error::InvalidWorkRequest {
            reason: "private data longer than 240 bytes",
        });
    }
    if !(wire::tx::MIN_MAX_ULPDU..=wire::MAX_ULPDU_LIMIT).contains(&params.max_ulpdu) {
        return Err(Error::InvalidWorkRequest {
            reason: "max_ulpdu must be 128..=65535",
        });
    }
    Ok(MpaConfig {
        crc: params.crc,
        ird: params.ird.min(mpa::IRD_ORD_MAX),
        ord: params.ord.min(mpa::IRD_ORD_MAX),
        caps: Caps::new(
            CapFlags::ALL,
            Some(wire::MAX_ULPDU_LIMIT as u16),
            private_data.to_vec(),
        ),
        // Passive: a peer-to-peer initiator may open with a zero-length Write, which places
        // nothing; the other RTR kinds are refused.
        peer_to_peer: passive.then_some(RtrTypes {
            send: false,
            write: true,
            read: false,
        }),
    })
}

fn finish(
    n: mpa::Negotiated,
    params: &ConnParams,
    local_addr: SocketAddr,
    peer_addr: SocketAddr,
) -> Result<Negotiated> {
    let peer_max = n.tx_max_ulpdu(params.max_ulpdu);
    let rx = RxConfig::from_negotiated(&n, wire::MAX_ULPDU_LIMIT)
        .map_err(|e| handshake_err(peer_addr, e))?;
    Ok(Negotiated {
        info: ConnInfo {
            crc: n.crc,
            ird: n.ird,
            ord: n.ord,
            peer_flush: n.shared.contains(CapFlags::FLUSH),
            peer_atomic_write: n.shared.contains(CapFlags::ATOMIC_WRITE),
            peer_atomics: n.shared.contains(CapFlags::RFC7306_ATOMICS),
            peer_private_data: n.caps.app.clone(),
            local_addr,
            peer_addr,
        },
        peer_max_ulpdu: peer_max,
        rx,
    })
}

fn handshake_err(peer: SocketAddr, e: WireError) -> Error {
    Error::Handshake {
        peer: peer.to_string(),
        reason: e.to_string(),
        source: Some(Box::new(e)),
    }
}

fn sock_err(op: &'static str, addr: impl ToString) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Socket {
        op,
        addr: addr.to_string(),
        source,
    }
}

/// Active side: TCP connect and the MPA Request/Reply. Returns a blocking stream.
pub(crate) fn connect(
    url: &Url,
    params: &ConnParams,
    private_data: &[u8],
) -> Result<(TcpStream, Negotiated)> {
    let cfg = config(params, private_data, false)?;
    let mut last = None;
    for addr in url.socket_addrs()? {
        match TcpStream::connect_timeout(&addr, params.timeout) {
            Ok(mut s) => {
                s.set_read_timeout(Some(params.timeout))
                    .map_err(sock_err("configure", addr))?;
                s.set_nodelay(true).map_err(sock_err("configure", addr))?;
                let n = match mpa::connect_exchange(&mut s, &cfg) {
                    Ok(mpa::Answer::Accepted(n)) => n,
                    Ok(mpa::Answer::Rejected { private_data }) => {
                        return Err(Error::Rejected {
                            peer: addr.to_string(),
                            private_data,
                        })
                    }
                    Err(e) => return Err(handshake_err(addr, e)),
                };
                s.set_read_timeout(None)
                    .map_err(sock_err("configure", addr))?;
                let local = s.local_addr().map_err(sock_err("configure", addr))?;
                return Ok((s, finish(n, params, local, addr)?));
            }
            Err(e) => last = Some((addr, e)),
        }
    }
    let (addr, e) = last.expect("socket_addrs is never empty");
    Err(Error::Socket {
        op: "connect",
        addr: addr.to_string(),
        source: e,
    })
}

/// A bound TCP listener.
pub(crate) struct TcpListen {
    listener: TcpListener,
}

impl TcpListen {
    pub(crate) fn bind(url: &Url) -> Result<TcpListen> {
        let addrs = url.socket_addrs()?;
        let listener = TcpListener::bind(&addrs[..]).map_err(sock_err("bind", url))?;
        Ok(TcpListen { listener })
    }

    pub(crate) fn url(&self) -> Result<Url> {
        let a = self
            .listener
            .local_addr()
            .map_err(sock_err("local_addr", "listener"))?;
        Ok(Url {
            scheme: Scheme::Tcp,
            host: a.ip().to_string(),
            port: a.port(),
        })
    }

    /// Accepts a TCP connection and reads its MPA Request.
    pub(crate) fn accept(&self, params: &ConnParams) -> Result<Pending> {
        let (mut s, peer) = self
            .listener
            .accept()
            .map_err(sock_err("accept", "listener"))?;
        s.set_read_timeout(Some(params.timeout))
            .map_err(sock_err("configure", peer))?;
        let raw = mpa::read_raw_frame(&mut s, "MPA Request").map_err(|e| handshake_err(peer, e))?;
        let revision = raw.revision;
        let refuse = |s: &mut TcpStream, e: WireError| {
            if let Ok(b) = mpa::reject_reply(revision).encode() {
                let _ = s.write_all(&b);
            }
            handshake_err(peer, e)
        };
        if raw.oversize() {
            let e = WireError::PrivateDataTooLong {
                len: raw.pd_len,
                max: mpa::MAX_PRIVATE_DATA,
            };
            return Err(refuse(&mut s, e));
        }
        let buf = raw.bytes;
        let req = match MpaFrame::decode(&buf) {
            Ok(Some((f, _))) if f.kind == mpa::MpaKind::Request => f,
            Ok(_) => {
                let e = WireError::BadMpaKey {
                    expected: Some(mpa::MpaKind::Request),
                };
                return Err(refuse(&mut s, e));
            }
            Err(e) => return Err(refuse(&mut s, e)),
        };
        let app = match Caps::decode(&req.private_data) {
            Ok(c) => c.app,
            Err(e) => return Err(refuse(&mut s, e)),
        };
        Ok(Pending {
            stream: s,
            peer,
            req,
            app,
        })
    }
}

/// A connection whose MPA Request was read and awaits an answer.
pub(crate) struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    req: MpaFrame,
    app: Vec<u8>,
}

impl Pending {
    pub(crate) fn private_data(&self) -> &[u8] {
        &self.app
    }

    pub(crate) fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    pub(crate) fn accept(
        mut self,
        params: &ConnParams,
        private_data: &[u8],
    ) -> Result<(TcpStream, Negotiated)> {
        let cfg = config(params, private_data, true)?;
        let n = match mpa::negotiate(&cfg, &self.req) {
            Ok(n) => n,
            Err(e) => {
                if let Ok(b) = mpa::reject_reply(self.req.revision).encode() {
                    let _ = self.stream.write_all(&b);
                }
                return Err(handshake_err(self.peer, e));
            }
        };
        let reply = cfg
            .reply(&n)
            .encode()
            .map_err(|e| handshake_err(self.peer, e))?;
        self.stream
            .write_all(&reply)
            .map_err(sock_err("MPA Reply", self.peer))?;
        self.stream
            .set_read_timeout(None)
            .map_err(sock_err("configure", self.peer))?;
        let local = self
            .stream
            .local_addr()
            .map_err(sock_err("configure", self.peer))?;
        let neg = finish(n, params, local, self.peer)?;
        Ok((self.stream, neg))
    }

    pub(crate) fn reject(mut self, private_data: &[u8]) {
        let mut f = mpa::reject_reply(self.req.revision);
        f.private_data = private_data[..private_data.len().min(MAX_PRIVATE_DATA)].to_vec();
        if let Ok(b) = f.encode() {
            // Best effort: the connection closes either way.
            let _ = self.stream.write_all(&b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mulpdu_fits_one_segment_of_a_loopback_connection() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        for sock in [&c, &s] {
            use nix::sys::socket::{getsockopt, sockopt::TcpMaxSeg};
            let mss = getsockopt(sock, TcpMaxSeg).unwrap() as usize;
            let m = mulpdu(sock).unwrap();
            assert!(wire::fpdu_len(m) <= mss, "{m} for MSS {mss}");
            assert!(
                wire::fpdu_len(m + 4) > mss.min(wire::fpdu_len(65535)),
                "{m} for MSS {mss}"
            );
        }
    }
}
