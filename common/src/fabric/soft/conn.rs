//! Connection set-up of the `tcp` transport: TCP connect/accept and the MPA exchange
//! (revision 2, RFC 6581 IRD/ORD prefix, CRC negotiated, markers refused), with this side's
//! capability block and the application's private data after it.

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};

use super::wire::mpa::{self, MpaConfig, MpaFrame, RtrTypes};
use super::wire::rx::RxConfig;
use super::wire::{self, CapFlags, Caps, WireError};
use crate::fabric::error::{Error, Result};
use crate::fabric::params::{ConnInfo, ConnParams, TcpInfo, TcpParams};
use crate::fabric::url::{Scheme, Url};

/// The largest ULPDU sent when the connection's MSS is unknown: one FPDU per TCP segment of
/// a 1500-byte MTU. (`TcpParams::default()` asks for 65535, which the MSS then cuts.)
pub(crate) const DEFAULT_MAX_ULPDU: usize = wire::DEFAULT_MAX_ULPDU;

// What the neutral parameters promise (`TcpParams`) is what this framing can do.
const _: () = assert!(TcpParams::MAX_ULPDU == wire::MAX_ULPDU_LIMIT);
const _: () = assert!(TcpParams::MAX_PRIVATE_DATA == MAX_PRIVATE_DATA);

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
pub(crate) const MAX_PRIVATE_DATA: usize = mpa::MAX_SENT_PRIVATE_DATA - 4 - wire::caps::BLOCK_LEN;

/// What the engine needs from the handshake.
pub(crate) struct Negotiated {
    pub(crate) info: ConnInfo,
    /// Whether FPDUs carry CRC32c.
    pub(crate) crc: bool,
    pub(crate) peer_max_ulpdu: usize,
    /// The receive side's settings: CRC, our advertised maximum ULPDU, the opcodes both
    /// sides understand.
    pub(crate) rx: RxConfig,
    /// Passive side of a peer-to-peer connection whose RTR is a zero-length Write: the first
    /// FPDU may be that Write, whatever STag it names (RFC 6581).
    pub(crate) rtr_write_expected: bool,
}

pub(crate) fn config(params: &ConnParams, private_data: &[u8], passive: bool) -> Result<MpaConfig> {
    if private_data.len() > MAX_PRIVATE_DATA {
        return Err(Error::InvalidWorkRequest {
            reason: "private data longer than 240 bytes",
        });
    }
    if !(wire::tx::MIN_MAX_ULPDU..=wire::MAX_ULPDU_LIMIT).contains(&params.tcp.max_ulpdu) {
        return Err(Error::InvalidWorkRequest {
            reason: "max_ulpdu must be 128..=65535",
        });
    }
    Ok(MpaConfig {
        crc: params.tcp.crc,
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

pub(crate) fn finish(
    n: mpa::Negotiated,
    params: &ConnParams,
    local_addr: SocketAddr,
    peer_addr: SocketAddr,
) -> Result<Negotiated> {
    let peer_max = n.tx_max_ulpdu(params.tcp.max_ulpdu);
    let rx = RxConfig::from_negotiated(&n, wire::MAX_ULPDU_LIMIT)
        .map_err(|e| handshake_err(peer_addr, e))?;
    Ok(Negotiated {
        info: ConnInfo {
            ird: n.ird,
            ord: n.ord,
            peer_flush: n.shared.contains(CapFlags::FLUSH),
            peer_atomic_write: n.shared.contains(CapFlags::ATOMIC_WRITE),
            peer_atomics: n.shared.contains(CapFlags::RFC7306_ATOMICS),
            peer_private_data: n.caps.app.clone(),
            local_addr,
            peer_addr,
            tcp: Some(TcpInfo { crc: n.crc }),
        },
        crc: n.crc,
        peer_max_ulpdu: peer_max,
        rx,
        rtr_write_expected: false,
    })
}

/// The handshake error for `e`. Its text is said once: an I/O error's OS error becomes the
/// source (not repeated in `reason`), and a read time-out (EAGAIN from `SO_RCVTIMEO`) says
/// "timed out".
fn handshake_err(peer: SocketAddr, e: WireError) -> Error {
    let (reason, source): (String, Option<Box<dyn std::error::Error + Send + Sync>>) = match e {
        WireError::Io { during, source } if timed_out(&source) => {
            (format!("timed out during {during}"), None)
        }
        WireError::Io { during, source } => {
            (format!("I/O error during {during}"), Some(Box::new(source)))
        }
        e => (e.to_string(), None),
    };
    Error::Handshake {
        peer: peer.to_string(),
        reason,
        source,
    }
}

fn timed_out(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
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
                    Err(WireError::BadMpaKey { .. }) => {
                        return Err(Error::NotMpa {
                            peer: addr.to_string(),
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
        judge_request(s, peer, raw)
    }

    /// Accepts a TCP connection without reading from it: its MPA Request is read by
    /// [`Incoming::poll_request`]. `None` when the listener is non-blocking and no connection
    /// is waiting.
    pub(crate) fn accept_incoming(&self) -> Result<Option<Incoming>> {
        let (stream, peer) = match self.listener.accept() {
            Ok(a) => a,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(sock_err("accept", "listener")(e)),
        };
        stream
            .set_nonblocking(true)
            .map_err(sock_err("configure", peer))?;
        Ok(Some(Incoming {
            stream,
            peer,
            kept: Vec::with_capacity(mpa::FRAME_HDR_LEN),
            got: 0,
        }))
    }

    /// Makes [`accept_incoming`](Self::accept_incoming) return at once when no connection waits.
    pub(crate) fn set_nonblocking(&self, on: bool) -> Result<()> {
        self.listener
            .set_nonblocking(on)
            .map_err(sock_err("configure", "listener"))
    }

    pub(crate) fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.listener.as_fd()
    }
}

/// A TCP connection whose MPA Request is read without blocking, as bytes arrive.
pub(crate) struct Incoming {
    /// Non-blocking until the Request is complete.
    stream: TcpStream,
    peer: SocketAddr,
    /// The header and the private data (the latter only if at most
    /// [`mpa::MAX_PRIVATE_DATA`]: oversize private data is read and dropped, as
    /// [`mpa::read_raw_frame`] does).
    kept: Vec<u8>,
    /// Bytes of the frame read so far.
    got: usize,
}

/// Where reading an [`Incoming`] connection's MPA Request stands.
pub(crate) enum Progress {
    /// The Request was read and judged well-formed.
    Complete(Pending),
    /// More bytes are needed; call again when the socket is readable.
    Incomplete(Incoming),
}

impl Incoming {
    pub(crate) fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    pub(crate) fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.stream.as_fd()
    }

    /// The private-data length the header states, once the header is in.
    fn pd_len(&self) -> Option<usize> {
        (self.kept.len() >= mpa::FRAME_HDR_LEN).then(|| {
            usize::from(u16::from_be_bytes([
                self.kept[mpa::FRAME_HDR_LEN - 2],
                self.kept[mpa::FRAME_HDR_LEN - 1],
            ]))
        })
    }

    /// Reads what has arrived, never past the Request's last byte.
    pub(crate) fn poll_request(mut self) -> Result<Progress> {
        use std::io::Read;
        const DURING: &str = "MPA Request";
        let mut tmp = [0u8; 1024];
        loop {
            let total = match self.pd_len() {
                None => mpa::FRAME_HDR_LEN,
                Some(pd) => mpa::FRAME_HDR_LEN + pd,
            };
            if self.got >= total {
                break;
            }
            let want = (total - self.got).min(tmp.len());
            match self.stream.read(&mut tmp[..want]) {
                Ok(0) if self.got == 0 => {
                    return Err(Error::ClosedBeforeRequest {
                        peer: self.peer.to_string(),
                    })
                }
                Ok(0) => {
                    return Err(handshake_err(
                        self.peer,
                        WireError::Closed { during: DURING },
                    ))
                }
                Ok(n) => {
                    let keep_to = match self.pd_len() {
                        Some(pd) if pd > mpa::MAX_PRIVATE_DATA => mpa::FRAME_HDR_LEN,
                        _ => total,
                    };
                    let room = keep_to.saturating_sub(self.kept.len()).min(n);
                    self.kept.extend_from_slice(&tmp[..room]);
                    self.got += n;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    return Ok(Progress::Incomplete(self))
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                // A checker that closes with a reset (SO_LINGER 0) rather than a FIN.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset && self.got == 0 => {
                    return Err(Error::ClosedBeforeRequest {
                        peer: self.peer.to_string(),
                    })
                }
                Err(e) => {
                    return Err(handshake_err(
                        self.peer,
                        WireError::Io {
                            during: DURING,
                            source: e,
                        },
                    ))
                }
            }
        }
        self.stream
            .set_nonblocking(false)
            .map_err(sock_err("configure", self.peer))?;
        let pd_len = self.pd_len().unwrap_or(0);
        let raw = mpa::RawFrame {
            revision: self.kept[mpa::FRAME_HDR_LEN - 3],
            bytes: self.kept,
            pd_len,
        };
        judge_request(self.stream, self.peer, raw).map(Progress::Complete)
    }
}

/// Judges a Request read in full: refuses (with a reject Reply) a malformed one.
fn judge_request(mut s: TcpStream, peer: SocketAddr, raw: mpa::RawFrame) -> Result<Pending> {
    match judge(&raw) {
        Ok((req, app)) => Ok(Pending {
            stream: s,
            peer,
            req,
            app,
        }),
        Err(e) => {
            if let Ok(b) = mpa::reject_reply(raw.revision).encode() {
                let _ = s.write_all(&b);
            }
            Err(handshake_err(peer, e))
        }
    }
}

/// The socket-free part of [`judge_request`]: the Request and its application bytes, or why it
/// is refused.
pub(crate) fn judge(raw: &mpa::RawFrame) -> std::result::Result<(MpaFrame, Vec<u8>), WireError> {
    if raw.oversize() {
        return Err(WireError::PrivateDataTooLong {
            len: raw.pd_len,
            max: mpa::MAX_PRIVATE_DATA,
        });
    }
    let req = match MpaFrame::decode(&raw.bytes)? {
        Some((f, _)) if f.kind == mpa::MpaKind::Request => f,
        _ => {
            return Err(WireError::BadMpaKey {
                expected: Some(mpa::MpaKind::Request),
            })
        }
    };
    let app = Caps::decode(&req.private_data)?.app;
    Ok((req, app))
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
        let rtr_write = n.rtr == Some(mpa::Rtr::Write);
        let mut neg = finish(n, params, local, self.peer)?;
        neg.rtr_write_expected = rtr_write;
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
    use crate::fabric::error::Error;

    fn listen() -> (TcpListen, SocketAddr) {
        let l = TcpListen::bind(&"tcp://127.0.0.1:0".parse().unwrap()).unwrap();
        let port = l.url().unwrap().port;
        (l, SocketAddr::from(([127, 0, 0, 1], port)))
    }

    use crate::error_chain as chain;

    #[test]
    fn incoming_waits_for_a_silent_peer_then_completes_a_real_request() {
        let (l, addr) = listen();
        let _silent = TcpStream::connect(addr).unwrap();
        let inc = l.accept_incoming().unwrap().unwrap();
        // Nothing sent: incomplete, at once.
        let Progress::Incomplete(inc) = inc.poll_request().unwrap() else {
            panic!("a silent peer completed a request");
        };
        drop(inc);

        let url: Url = format!("tcp://{addr}").parse().unwrap();
        let client = std::thread::spawn(move || {
            connect(&url, &ConnParams::default(), b"hi").map(|(_, n)| n.info.peer_private_data)
        });
        let mut inc = loop {
            if let Some(i) = l.accept_incoming().unwrap() {
                break i;
            }
        };
        let pending = loop {
            match inc.poll_request().unwrap() {
                Progress::Complete(p) => break p,
                Progress::Incomplete(i) => {
                    inc = i;
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            }
        };
        assert_eq!(pending.private_data(), b"hi");
        let (_s, neg) = pending.accept(&ConnParams::default(), b"yo").unwrap();
        assert_eq!(neg.info.peer_private_data, b"hi");
        assert_eq!(client.join().unwrap().unwrap(), b"yo");
    }

    #[test]
    fn incoming_reads_a_request_sent_in_pieces_and_refuses_garbage() {
        let (l, addr) = listen();
        l.set_nonblocking(true).unwrap();
        assert!(l.accept_incoming().unwrap().is_none(), "nothing queued");
        let mut c = TcpStream::connect(addr).unwrap();
        let inc = loop {
            if let Some(i) = l.accept_incoming().unwrap() {
                break i;
            }
        };
        // 20 bytes of a header that is not an MPA Request key, in two pieces.
        c.write_all(&[0u8; 10]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let Progress::Incomplete(inc) = inc.poll_request().unwrap() else {
            panic!("half a header completed a request");
        };
        c.write_all(&[0u8; 10]).unwrap();
        // Until the second piece is in (a sleep was a guess at when it arrives).
        let e = match poll_until_done(inc) {
            Err(e) => e,
            Ok(_) => panic!("garbage accepted as a request"),
        };
        assert!(matches!(e, Error::Handshake { .. }), "{e:?}");
        assert!(chain(&e).contains("bad MPA key"), "{}", chain(&e));
    }

    /// Polls `inc` until its peer's Request is whole or the poll fails (the peer's bytes and
    /// its close arrive when they do: no fixed wait).
    fn poll_until_done(mut inc: Incoming) -> Result<Progress> {
        loop {
            match inc.poll_request() {
                Ok(Progress::Incomplete(i)) => {
                    inc = i;
                    std::thread::yield_now();
                }
                done => return done,
            }
        }
    }

    #[test]
    fn a_peer_that_closes_before_sending_anything_is_a_probe() {
        let (l, addr) = listen();
        drop(TcpStream::connect(addr).unwrap());
        let inc = l.accept_incoming().unwrap().unwrap();
        let e = match poll_until_done(inc) {
            Err(e) => e,
            Ok(_) => panic!("a closed peer is not a request"),
        };
        assert!(matches!(e, Error::ClosedBeforeRequest { .. }), "{e:?}");
        assert!(chain(&e).contains("before sending anything"), "{e}");
    }

    #[test]
    fn a_peer_that_resets_before_sending_anything_is_a_probe() {
        let (l, addr) = listen();
        let s = TcpStream::connect(addr).unwrap();
        // SO_LINGER 0: the close sends a reset, as some load balancers' checks do.
        nix::sys::socket::setsockopt(
            &s,
            nix::sys::socket::sockopt::Linger,
            &nix::libc::linger {
                l_onoff: 1,
                l_linger: 0,
            },
        )
        .unwrap();
        drop(s);
        let inc = l.accept_incoming().unwrap().unwrap();
        let e = match poll_until_done(inc) {
            Err(e) => e,
            Ok(_) => panic!("a reset peer is not a request"),
        };
        assert!(matches!(e, Error::ClosedBeforeRequest { .. }), "{e:?}");
    }

    #[test]
    fn a_peer_that_closes_within_its_request_is_a_failed_handshake() {
        let (l, addr) = listen();
        {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"MPA ID Req").unwrap();
        }
        let inc = l.accept_incoming().unwrap().unwrap();
        let e = match poll_until_done(inc) {
            Err(e) => e,
            Ok(_) => panic!("a closed peer is not a request"),
        };
        assert!(matches!(e, Error::Handshake { .. }), "{e:?}");
        assert!(
            chain(&e).contains("connection closed during MPA Request"),
            "{e}"
        );
    }

    #[test]
    fn a_timed_out_request_says_timed_out_once() {
        let (l, addr) = listen();
        let _silent = TcpStream::connect(addr).unwrap();
        let params = ConnParams {
            timeout: std::time::Duration::from_millis(50),
            ..ConnParams::default()
        };
        let e = match l.accept(&params) {
            Err(e) => e,
            Ok(_) => panic!("a silent peer made a request"),
        };
        let text = chain(&e);
        assert!(text.contains("timed out during MPA Request"), "{text}");
        assert!(!text.contains("temporarily unavailable"), "{text}");
    }

    #[test]
    fn socket_errors_say_the_os_error_once() {
        let (l, addr) = listen();
        drop(l);
        let url: Url = format!("tcp://{addr}").parse().unwrap();
        let e = match connect(&url, &ConnParams::default(), b"") {
            Err(e) => e,
            Ok(_) => panic!("connected to a closed port"),
        };
        let text = chain(&e);
        assert_eq!(text.matches("refused").count(), 1, "{text}");
    }

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
