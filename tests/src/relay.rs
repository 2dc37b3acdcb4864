//! A TCP relay that can cut its links or swallow what the client sends.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A TCP relay on 127.0.0.1: every connection to it is forwarded to `upstream`. [`cut`]
/// drops every live link at once (both sides see a reset or close); new connections are
/// relayed as before. Stops on drop.
///
/// [`cut`]: Relay::cut
#[derive(Debug)]
pub struct Relay {
    port: u16,
    stop: Arc<AtomicBool>,
    links: Arc<Mutex<Vec<TcpStream>>>,
    accepted: Arc<AtomicU64>,
    swallow: Arc<AtomicBool>,
}

impl Relay {
    /// Starts relaying to `upstream` (host:port).
    pub fn start(upstream: &str) -> Relay {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind relay");
        l.set_nonblocking(true).expect("nonblocking");
        let port = l.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let links: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let accepted = Arc::new(AtomicU64::new(0));
        let swallow = Arc::new(AtomicBool::new(false));
        let upstream = upstream.to_owned();
        let (s, lk, a, sw) = (
            Arc::clone(&stop),
            Arc::clone(&links),
            Arc::clone(&accepted),
            Arc::clone(&swallow),
        );
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((down, _)) => {
                        let Ok(up) = TcpStream::connect(&upstream) else {
                            continue;
                        };
                        a.fetch_add(1, Ordering::Relaxed);
                        let _ = down.set_nonblocking(false);
                        let _ = down.set_nodelay(true);
                        let _ = up.set_nodelay(true);
                        {
                            let mut v = lk.lock().unwrap();
                            v.push(down.try_clone().unwrap());
                            v.push(up.try_clone().unwrap());
                        }
                        pipe(
                            down.try_clone().unwrap(),
                            up.try_clone().unwrap(),
                            Some(&sw),
                        );
                        pipe(up, down, None);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Relay {
            port,
            stop,
            links,
            accepted,
            swallow,
        }
    }

    /// `tcp://127.0.0.1:PORT` of the relay.
    pub fn url(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Drops every live link (and ends [`swallow`](Self::swallow)).
    pub fn cut(&self) {
        for s in self.links.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        self.swallow.store(false, Ordering::SeqCst);
    }

    /// From now until the next [`cut`](Self::cut), bytes from the client are read and thrown
    /// away instead of forwarded: what the client sent meanwhile never reaches the server
    /// (a link that dies with data in flight).
    pub fn swallow(&self) {
        self.swallow.store(true, Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.cut();
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream, swallow: Option<&Arc<AtomicBool>>) {
    let swallow = swallow.map(Arc::clone);
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) if swallow.as_ref().is_some_and(|s| s.load(Ordering::SeqCst)) => {}
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    });
}
