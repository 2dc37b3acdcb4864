//! The control socket: a Unix stream socket where `rpma-target status` asks for the daemon's
//! state, `rpma-target reload` reloads the configuration and waits for the outcome, and
//! `rpma-target clear-failure` clears a failed namespace. One request line (`status`,
//! `reload`, `clear-failure SUBSYSTEM NSID`), one JSON answer, then the daemon closes the
//! connection (a `reload`'s answer comes once the reload is done).
//!
//! One client cannot hold the socket or the daemon's shutdown: each connection is served on a
//! thread of its own, at most [`MAX_CLIENTS`] at once; the whole request line must arrive
//! within [`REQUEST_DEADLINE`] of the accept (however it trickles) and the answer must leave
//! within [`WRITE_DEADLINE`]. When all places are taken, a newcomer takes the place of the
//! oldest connection still sending its request (closed without an answer); only when every
//! place is being answered is it turned away (`busy`). Dropping the server shuts every
//! connection it serves and waits only for requests already being answered.
//!
//! The socket is mode 0660: the daemon's group may connect, to read `status`. A request that
//! changes the daemon's state (`reload`, `clear-failure`) is taken only from root or the daemon's own
//! user, by the credentials the kernel took at the connect (SO_PEERCRED): the handler gets
//! them as a [`Peer`] and asks [`Peer::may_change_state`].

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Errors of the control socket, server and client side.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// Another daemon answers on the socket.
    #[error("{0} is in use by a running daemon")]
    InUse(PathBuf),
    /// The socket could not be created.
    #[error("cannot bind the control socket {path}")]
    Bind {
        /// The socket's path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The server thread could not start.
    #[error("cannot start the control thread")]
    Thread(#[source] std::io::Error),
    /// The client could not connect, send or receive.
    #[error("cannot talk to the daemon at {path}")]
    Connect {
        /// The socket's path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The daemon's answer is not the JSON expected.
    #[error("the daemon's answer is not valid status JSON")]
    BadAnswer(#[source] serde_json::Error),
    /// The daemon answered with an error.
    #[error("the daemon refused the request: {0}")]
    Refused(String),
}

/// Result of the control socket.
pub type Result<T> = std::result::Result<T, ControlError>;

mod clients;
mod render;
mod status;

use clients::{admit, Clients};
pub use clients::{Handler, Peer, MAX_CLIENTS, REQUEST_DEADLINE, WRITE_DEADLINE};

pub use render::render;
pub use status::*;

/// The control socket server: a thread accepting connections until dropped.
pub struct ControlServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    /// The listening socket, to wake the blocking accept with (a shutdown makes it fail).
    waker: UnixListener,
    clients: Arc<Clients>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ControlServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlServer")
            .field("path", &self.path)
            .finish()
    }
}

impl ControlServer {
    /// Binds `path` (creating its directory; replacing a stale socket, refusing one a live daemon
    /// answers on), mode 0660, and serves `handler`, each connection on a thread of its own.
    /// When this returns, the socket accepts.
    ///
    /// # Errors
    /// [`ControlError::InUse`], [`ControlError::Bind`], [`ControlError::Thread`].
    pub fn bind(path: &Path, handler: Handler) -> Result<Self> {
        let bind_err = |source| ControlError::Bind {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(bind_err)?;
        }
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if meta.file_type().is_socket() {
                if UnixStream::connect(path).is_ok() {
                    return Err(ControlError::InUse(path.to_owned()));
                }
                std::fs::remove_file(path).map_err(bind_err)?;
            }
        }
        let listener = UnixListener::bind(path).map_err(bind_err)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(bind_err)?;
        let waker = listener.try_clone().map_err(bind_err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let clients = Arc::new(Clients::default());
        let clients2 = clients.clone();
        let thread = std::thread::Builder::new()
            .name("rpma-control".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::Acquire) {
                        break;
                    }
                    match conn {
                        Ok(c) => admit(&clients2, c, &handler),
                        Err(e) => {
                            // EMFILE and the like: do not spin on it.
                            log::warn!("control socket: accept failed: {e}");
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                }
            })
            .map_err(ControlError::Thread)?;
        Ok(ControlServer {
            path: path.to_owned(),
            stop,
            waker,
            clients,
            thread: Some(thread),
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the blocking accept: shut down, the listening socket fails it (a connection of
        // our own did, and never came if the socket's file had been removed: the join waited
        // for ever, and so did the daemon's stop).
        let _ =
            nix::sys::socket::shutdown(self.waker.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
        // No new connection comes now.
        self.clients.shut_all();
    }
}

/// How long a `reload` or `clear-failure` request waits for its answer: longer than the
/// daemon's own wait for a reload, 270 s, which it answers within.
const LONG_REQUEST_WAIT: Duration = Duration::from_secs(285);

/// Sends one request and returns the raw answer.
///
/// # Errors
/// [`ControlError::Connect`].
pub fn request(path: &Path, line: &str) -> Result<String> {
    request_within(path, line, Duration::from_secs(10))
}

/// [`request`], waiting up to `within` for the answer.
fn request_within(path: &Path, line: &str, within: Duration) -> Result<String> {
    let err = |source| ControlError::Connect {
        path: path.to_owned(),
        source,
    };
    let mut s = UnixStream::connect(path).map_err(err)?;
    s.set_read_timeout(Some(within)).map_err(err)?;
    s.write_all(format!("{line}\n").as_bytes()).map_err(err)?;
    let mut out = String::new();
    s.read_to_string(&mut out).map_err(err)?;
    Ok(out)
}

/// Asks for the status.
///
/// # Errors
/// [`ControlError::Connect`], [`ControlError::Refused`], [`ControlError::BadAnswer`].
pub fn query_status(path: &Path) -> Result<(Status, String)> {
    let raw = request(path, "status")?;
    let v: serde_json::Value = serde_json::from_str(&raw).map_err(ControlError::BadAnswer)?;
    if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
        return Err(ControlError::Refused(e.to_owned()));
    }
    let s = serde_json::from_value(v).map_err(ControlError::BadAnswer)?;
    Ok((s, raw))
}

/// Asks the daemon to clear the failure of namespace `nsid` of `subsystem` (`rpma-target
/// clear-failure`). Returns what the daemon logged: what may have been lost. Waits as long as
/// [`reload`] does: the daemon reopens the file and maps it ahead of use, which takes a while
/// for a big one (a client that gave up after 10 s said the clear failed while the daemon went
/// on to clear it).
///
/// # Errors
/// [`ControlError::Connect`] (no answer within 285 s included), [`ControlError::Refused`]
/// (not root or the daemon's user, not failed, not configured, the state file could not be
/// updated), [`ControlError::BadAnswer`].
pub fn clear_failure(path: &Path, subsystem: &str, nsid: u32) -> Result<String> {
    let raw = request_within(
        path,
        &format!("clear-failure {subsystem} {nsid}"),
        LONG_REQUEST_WAIT,
    )?;
    let v: serde_json::Value = serde_json::from_str(&raw).map_err(ControlError::BadAnswer)?;
    if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
        return Err(ControlError::Refused(e.to_owned()));
    }
    Ok(v["message"].as_str().unwrap_or_default().to_owned())
}

/// Asks for a reload and waits until it is done (the daemon says READY; a reload that removes
/// or replaces namespace files once every poll loop applied it, or it stopped waiting for
/// them): whether it succeeded, its summary or why it failed (the running configuration is
/// kept then), and how many poll loops had not applied it yet (their sessions still reach the
/// files it removed or replaced).
///
/// # Errors
/// [`ControlError::Connect`] (no answer within 285 s included),
/// [`ControlError::Refused`] (not root or the daemon's user, the daemon stopping),
/// [`ControlError::BadAnswer`].
pub fn reload(path: &Path) -> Result<(bool, String, u64)> {
    let raw = request_within(path, "reload", LONG_REQUEST_WAIT)?;
    let v: serde_json::Value = serde_json::from_str(&raw).map_err(ControlError::BadAnswer)?;
    if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
        return Err(ControlError::Refused(e.to_owned()));
    }
    Ok((
        v["reloaded"].as_bool().unwrap_or(false),
        v["message"].as_str().unwrap_or_default().to_owned(),
        v["loops_not_applied"].as_u64().unwrap_or(0),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{DataCounters, MetricsStatus};
    use crate::namespace::CountersSnapshot;

    fn sample() -> Status {
        Status {
            version: "0.1.0".into(),
            pid: 1,
            uptime_s: 2,
            config: "/etc/rpma/rpma-target.toml".into(),
            reloads: 0,
            last_reload: None,
            listeners: vec![ListenerStatus {
                url: "tcp://127.0.0.1:7420".into(),
                bound: false,
                crc: true,
                direct_write_to_pmem: false,
                note: Some("transport not wired".into()),
            }],
            subsystems: vec![SubsystemStatus {
                nqn: "nqn.2026-11.io.rpma:demo".into(),
                allow_any_host: true,
                hosts: vec![],
                namespaces: vec![NamespaceStatus {
                    nsid: 1,
                    path: "/x".into(),
                    size: 1 << 20,
                    block_size: 4096,
                    read_only: false,
                    domain: "page-cache".into(),
                    durability: vec![TransportMethods {
                        transport: "tcp".into(),
                        methods: vec!["APM".into(), "GPSPM".into()],
                    }],
                    counters: CountersSnapshot::default(),
                    data: DataCounters {
                        writes: 3,
                        write_bytes: 12288,
                        ..DataCounters::default()
                    },
                    failed: Some("fdatasync failed: Input/output error (os error 5)".into()),
                    failed_since: Some("2026-12-01 15:00:00 UTC".into()),
                }],
            }],
            sessions: vec![SessionStatus {
                kind: "discovery".into(),
                controller_id: 0,
                host_nqn: "nqn.2026-11.io.rpma:host1".into(),
                subsystem_nqn: "nqn.2014-08.org.nvmexpress.discovery".into(),
                peer: "127.0.0.1:40000".into(),
                queue_id: 0,
                age_ms: 5,
                messages: 2,
                flushes: 0,
                counted: SESSION_COUNTED.into(),
                keep_alive_ms: 5000,
                last_keep_alive_ms: 1,
                keep_alive_state: "ok".into(),
                data: DataCounters::default(),
                namespaces: vec![SessionNamespaceStatus {
                    nsid: 1,
                    data: DataCounters {
                        reads: 2,
                        read_bytes: 16,
                        ..DataCounters::default()
                    },
                }],
            }],
            admission: Some(AdmissionStatus {
                unadmitted: PoolStatus {
                    held: 3,
                    limit: 64,
                    per_source_limit: 8,
                    sources: 2,
                    evicted: 7,
                },
                discovery: PoolStatus {
                    held: 1,
                    limit: 16,
                    per_source_limit: 4,
                    sources: 1,
                    evicted: 0,
                },
                sessions: PoolStatus {
                    held: 0,
                    limit: 64,
                    per_source_limit: 0,
                    sources: 0,
                    evicted: 0,
                },
                unlisted: PoolStatus {
                    held: 2,
                    limit: 64,
                    per_source_limit: 0,
                    sources: 1,
                    evicted: 5,
                },
            }),
            metrics: Some(MetricsStatus {
                counting: true,
                refusals: [("auth_failed".to_owned(), 2), ("other".to_owned(), 0)].into(),
                latency: vec![crate::metrics::LatencyStatus {
                    kind: "msync".into(),
                    path: "placement".into(),
                    histogram: {
                        let mut h = rpma_common::stats::Histogram::default();
                        h.record(3_000);
                        h
                    },
                }],
                ..MetricsStatus::default()
            }),
            metrics_listener: Some(MetricsListenerStatus {
                configured: "127.0.0.1:0".into(),
                addr: Some("127.0.0.1:9420".into()),
                bound: true,
                note: None,
                serving: 0,
            }),
        }
    }

    #[test]
    fn serves_status_and_errors() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("sub/ctl.sock");
        let st = sample();
        let json = serde_json::to_string(&st).unwrap();
        let handler: Handler = Arc::new(move |req, _| match req {
            "status" => Ok(json.clone()),
            other => Err(format!("unknown request {other:?}")),
        });
        let server = ControlServer::bind(&p, handler.clone()).unwrap();
        let (got, raw) = query_status(&p).unwrap();
        assert_eq!(got, st);
        assert!(raw.contains("nqn.2026-11.io.rpma:demo"));
        // The status of a daemon from before the unlisted pool still reads.
        let mut v = serde_json::to_value(&st).unwrap();
        v["admission"].as_object_mut().unwrap().remove("unlisted");
        let old: Status = serde_json::from_value(v).unwrap();
        assert_eq!(old.admission.unwrap().unlisted, PoolStatus::default());
        let e = request(&p, "frobnicate").unwrap();
        assert!(e.contains("unknown request"), "{e}");
        // A second daemon must not steal the socket.
        assert!(matches!(
            ControlServer::bind(&p, handler.clone()),
            Err(ControlError::InUse(_))
        ));
        drop(server);
        assert!(!p.exists(), "socket removed on drop");
        assert!(matches!(
            query_status(&p),
            Err(ControlError::Connect { .. })
        ));
    }

    /// Dropping the server returns though its socket's file is gone, so that no connection can
    /// reach it (before, it woke its accept thread with a connection of its own, which then
    /// failed, and waited for that thread for ever: so did the daemon's stop).
    #[test]
    fn dropping_the_server_returns_when_its_file_is_gone() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ctl.sock");
        let handler: Handler = Arc::new(|_, _| Err("nothing".into()));
        let server = ControlServer::bind(&p, handler).unwrap();
        std::fs::remove_file(&p).unwrap();
        let (done, dropped) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(server);
            let _ = done.send(());
        });
        assert!(
            dropped.recv_timeout(Duration::from_secs(30)).is_ok(),
            "the drop waited for its accept thread"
        );
    }

    /// Clients that trickle a request a byte at a time (and reconnect when cut off), more of
    /// them than there are places, neither keep `status` from being answered nor the server
    /// from stopping (before, one such client held the only serving thread for hours, and
    /// dropping the server waited for it).
    #[test]
    fn trickling_clients_hold_neither_the_socket_nor_the_shutdown() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ctl.sock");
        let json = serde_json::to_string(&sample()).unwrap();
        let handler: Handler = Arc::new(move |req, _| match req {
            "status" => Ok(json.clone()),
            other => Err(format!("unknown request {other:?}")),
        });
        // Not dropped if the test fails: that would wait for the tricklers (before, for hours).
        let server = std::mem::ManuallyDrop::new(ControlServer::bind(&p, handler).unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let (started, on_air) = std::sync::mpsc::channel();
        let tricklers: Vec<_> = (0..10)
            .map(|_| {
                let (p, stop, started) = (p.clone(), stop.clone(), started.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Acquire) {
                        let Ok(mut s) = UnixStream::connect(&p) else {
                            return;
                        };
                        let mut first = true;
                        // Never a newline: the request never ends.
                        while !stop.load(Ordering::Acquire) && s.write_all(b"s").is_ok() {
                            if std::mem::take(&mut first) {
                                let _ = started.send(());
                            }
                            std::thread::sleep(Duration::from_millis(500));
                        }
                    }
                })
            })
            .collect();
        for _ in 0..10 {
            on_air
                .recv_timeout(Duration::from_secs(30))
                .expect("every trickler connected");
        }
        for i in 0..10 {
            let (got, _) = query_status(&p)
                .unwrap_or_else(|e| panic!("status {i} not answered beside the tricklers: {e}"));
            assert_eq!(got, sample());
        }
        let (dropped, on_drop) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(std::mem::ManuallyDrop::into_inner(server));
            let _ = dropped.send(());
        });
        // Before, it waited for the trickler being served: hours.
        on_drop
            .recv_timeout(Duration::from_secs(20))
            .expect("the server stopped while tricklers were connected");
        assert!(!p.exists(), "socket removed on drop");
        stop.store(true, Ordering::Release);
        for t in tricklers {
            t.join().unwrap();
        }
    }

    /// The handler hears who connected, as the kernel says (the tests run as one user: the
    /// refusal of another is checked on [`Peer::may_change_state`] below).
    #[test]
    fn the_handler_gets_the_peers_credentials() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ctl.sock");
        let handler: Handler = Arc::new(|_, peer| Ok(format!("{{\"uid\": {:?}}}", peer.uid)));
        let _s = ControlServer::bind(&p, handler).unwrap();
        let me = nix::unistd::geteuid().as_raw();
        assert_eq!(
            request(&p, "status").unwrap().trim(),
            format!("{{\"uid\": Some({me})}}")
        );
    }

    #[test]
    fn only_root_or_the_daemons_user_may_change_state() {
        let daemon = 991;
        for uid in [0, daemon] {
            Peer { uid: Some(uid) }
                .may_change_state("clear-failure", daemon)
                .unwrap_or_else(|e| panic!("uid {uid} refused: {e}"));
        }
        let e = Peer { uid: Some(1000) }
            .may_change_state("clear-failure", daemon)
            .unwrap_err();
        assert_eq!(
            e,
            "clear-failure changes the daemon's state: only root or the daemon's user (uid 991) \
             may ask for it, not uid 1000; members of the socket's group may read status only"
        );
        let e = Peer { uid: None }
            .may_change_state("clear-failure", daemon)
            .unwrap_err();
        assert!(e.contains("not a peer of unknown uid"), "{e}");
    }

    #[test]
    fn stale_socket_is_replaced() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ctl.sock");
        drop(UnixListener::bind(&p).unwrap());
        assert!(p.exists());
        let handler: Handler = Arc::new(|_, _| Err("x".into()));
        let _s = ControlServer::bind(&p, handler).unwrap();
        assert!(matches!(query_status(&p), Err(ControlError::Refused(e)) if e == "x"));
    }

    #[test]
    fn bad_answer_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ctl.sock");
        let handler: Handler = Arc::new(|_, _| Ok("{\"not\": \"status\"}".into()));
        let _s = ControlServer::bind(&p, handler).unwrap();
        assert!(matches!(query_status(&p), Err(ControlError::BadAnswer(_))));
    }

    #[test]
    fn table_shows_the_essentials() {
        let t = render(&sample());
        assert!(t.contains("tcp://127.0.0.1:7420") && t.contains("not bound: transport not wired"));
        assert!(t.contains("page-cache") && t.contains("tcp:APM+GPSPM") && t.contains("1 MiB"));
        assert!(
            t.contains(&format!("SESSIONS (counted: {SESSION_COUNTED})")),
            "{t}"
        );
        assert!(t.contains("RDMA Writes, Reads, Atomics and Flushes"), "{t}");
        assert!(
            t.contains("127.0.0.1:0                  metrics   http://127.0.0.1:9420/metrics"),
            "{t}"
        );
        assert!(
            t.contains("writes 3 (12 KiB) reads 0 (0 B) atomics 0 apm 0/0 flush 0/0 gpspm 0/0"),
            "{t}"
        );
        assert!(
            t.contains("      nsid 1: writes 0 (0 B) reads 2 (16 B)"),
            "{t}"
        );
        assert!(t.contains("  refusals: auth_failed 2\n"), "{t}");
        assert!(t.contains("  terminates sent: none\n"), "{t}");
        assert!(
            t.contains("msync          placement  count 1        p50 <= 4.0us"),
            "{t}"
        );
        assert!(
            t.contains(
                "FAILED since 2026-12-01 15:00:00 UTC: fdatasync failed: Input/output error (os \
                 error 5); no durability until an operator runs `rpma-target clear-failure \
                 nqn.2026-11.io.rpma:demo 1`"
            ),
            "{t}"
        );
        assert!(
            t.contains("discovery ctrl 0 ") && t.contains("msgs 2 flushes 0"),
            "{t}"
        );
        assert!(
            t.contains("unadmitted     3 of 64    per source 8     sources 2     evicted 7"),
            "{t}"
        );
        assert!(
            t.contains("unlisted       2 of 64    per source 0     sources 1     evicted 5"),
            "{t}"
        );
        let mut empty = sample();
        empty.sessions.clear();
        assert!(render(&empty).contains("\n  (none)"));
    }
}
