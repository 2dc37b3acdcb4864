//! One accept thread per listener: reads each new connection's MPA Request and hands it to the
//! least-loaded poll loop, which accepts it into a queue pair of its own.
//!
//! [`Listener::accept`] blocks and has no way to be interrupted; to stop, the thread's flag is
//! set and a plain TCP connection to the listener wakes it (its missing MPA Request fails the
//! accept at once).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use rpma_common::fabric::{self, ConnParams, Listener, Url};

use super::{Error, LoopCmd, LoopTx, Result, Shared};

/// How long a new connection may take to send its MPA Request. The accept thread waits that
/// long at most for one slow peer.
const MPA_TIMEOUT: Duration = Duration::from_secs(5);

/// A running accept thread.
pub(crate) struct Acceptor {
    url: Url,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Acceptor {
    /// Binds `url` and starts accepting into `loops`. When this returns the socket is listening:
    /// a connect succeeds (the kernel queues it until the thread takes it).
    pub(crate) fn start(
        shared: &Arc<Shared>,
        url: &Url,
        crc: bool,
        loops: Vec<(LoopTx, Arc<AtomicUsize>)>,
    ) -> Result<Acceptor> {
        let listener = Listener::bind(&shared.ctx, url).map_err(|source| Error::Listen {
            url: url.to_string(),
            source,
        })?;
        let bound = listener.url().map_err(|source| Error::Listen {
            url: url.to_string(),
            source,
        })?;
        let stop = Arc::new(AtomicBool::new(false));
        let params = ConnParams {
            crc,
            timeout: MPA_TIMEOUT,
            ..ConnParams::default()
        };
        let name = format!("rpma-accept-{}", bound.port);
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || accept_loop(&listener, &params, &flag, &loops))
            .map_err(|source| Error::Thread { name, source })?;
        Ok(Acceptor {
            url: bound,
            stop,
            thread: Some(thread),
        })
    }

    /// The bound URL (with the real port).
    pub(crate) fn url(&self) -> &Url {
        &self.url
    }

    /// Stops accepting and joins the thread.
    pub(crate) fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(addr) = wake_addr(&self.url) {
            // Best effort: if it fails the thread is not blocked in accept (or the socket is
            // gone), and it sees the flag on its next turn.
            let _ = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Where to connect to wake the accept thread: the bound address, with a wildcard replaced by
/// the loopback of its family.
fn wake_addr(url: &Url) -> Option<SocketAddr> {
    let ip: IpAddr = url.host.parse().ok()?;
    let ip = match ip {
        IpAddr::V4(v) if v.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(v) if v.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    Some(SocketAddr::new(ip, url.port))
}

fn accept_loop(
    listener: &Listener,
    params: &ConnParams,
    stop: &AtomicBool,
    loops: &[(LoopTx, Arc<AtomicUsize>)],
) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept(params) {
            Ok(req) => {
                if stop.load(Ordering::SeqCst) {
                    req.reject(b"");
                    break;
                }
                let Some((tx, load)) = loops.iter().min_by_key(|(_, l)| l.load(Ordering::Relaxed))
                else {
                    req.reject(b"");
                    continue;
                };
                // Counted here so that a burst spreads over the loops; the loop takes it back
                // when the connection ends.
                load.fetch_add(1, Ordering::Relaxed);
                if let Err(LoopCmd::Accept(req)) = tx.send(LoopCmd::Accept(req)) {
                    load.fetch_sub(1, Ordering::Relaxed);
                    req.reject(b"");
                }
            }
            Err(_) if stop.load(Ordering::SeqCst) => break,
            Err(e @ fabric::Error::Handshake { .. }) => {
                // A peer that does not speak MPA (a port scan, a wrong client): its problem.
                log::debug!("{e}");
            }
            Err(e) => {
                // EMFILE and the like: say so, and do not spin on it.
                log::warn!("accepting a connection failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}
