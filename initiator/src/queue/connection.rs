//! Where and who: a [`Connection`] (target URL, subsystem, host, options) opens queues; the
//! queue options and the reconnect policy that decide how a queue behaves, from its first
//! connection on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rpma_common::fabric;
use rpma_common::proto::nqn::Nqn;
use rpma_common::proto::RefusalReason;

use crate::connect::{connect, ConnectOptions, HostIdentity};
use crate::durability::PersistMethod;
use crate::error::{Error, Result};
use crate::replay::ReplayOrder;
use crate::session::Session;

/// How a queue retries a lost connection, and a failed first one: attempts spaced by a backoff
/// that doubles from `initial_backoff` up to `max_backoff`, for at most `timeout` after the
/// loss (or the first attempt's failure) was seen and at most `max_attempts` attempts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReconnectPolicy {
    /// Attempts before giving up (0: never reconnect; `u32::MAX`, the default: only
    /// `timeout` limits them).
    pub max_attempts: u32,
    /// No attempt starts later than this after the loss was seen, and each attempt's connect
    /// deadline is cut to what is left of it (60 s by default: a target restart that
    /// allocates large namespaces takes seconds).
    pub timeout: Duration,
    /// The wait before the first attempt; doubled after each failure.
    pub initial_backoff: Duration,
    /// The longest wait between attempts.
    pub max_backoff: Duration,
}

impl Default for ReconnectPolicy {
    fn default() -> Self {
        ReconnectPolicy {
            max_attempts: u32::MAX,
            timeout: Duration::from_secs(60),
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
        }
    }
}

impl ReconnectPolicy {
    /// The default backoff, trying for `timeout` (zero: never reconnect).
    pub fn within(timeout: Duration) -> ReconnectPolicy {
        ReconnectPolicy {
            timeout,
            ..ReconnectPolicy::default()
        }
    }

    /// Never reconnect: a lost connection fails the call at once.
    pub fn never() -> ReconnectPolicy {
        ReconnectPolicy {
            max_attempts: 0,
            timeout: Duration::ZERO,
            ..ReconnectPolicy::default()
        }
    }

    /// The wait before attempt `n` (1-based).
    pub fn backoff(&self, n: u32) -> Duration {
        let exp = n.saturating_sub(1).min(20);
        self.initial_backoff
            .saturating_mul(1u32 << exp)
            .min(self.max_backoff)
    }

    /// Makes a first connection, retrying within this policy while it fails in a way that may
    /// pass (`may_pass`): a target that is not there yet (refused, unreachable, reset, timed
    /// out), or that refuses for lack of room or because it is shutting down. A refusal of
    /// the host, the subsystem, the key or the version, a bad URL, a peer that does not speak
    /// MPA (another service on that port) or a missing device fails at once. `attempt` gets each attempt's connect deadline: `timeout`, cut to what is left of
    /// the policy's time after the first. The first failure that is retried is logged
    /// (WARN), with how long the policy keeps trying.
    ///
    /// [`Connection::open_queue`] connects this way (with the queue's policy); the CLI's
    /// `identify` and `discover` too (`--reconnect-timeout`).
    ///
    /// # Errors
    /// The last attempt's error, when it may not pass or the policy allows no more attempts.
    pub fn first_connection<T>(
        &self,
        url: &str,
        timeout: Duration,
        mut attempt: impl FnMut(Duration) -> Result<T>,
    ) -> Result<T> {
        let deadline = crate::deadline::after(self.timeout);
        let mut retries = 0;
        let mut each = timeout;
        loop {
            let e = match attempt(each) {
                Err(e) if may_pass(&e) => e,
                r => return r,
            };
            retries += 1;
            let wait = self.backoff(retries);
            if retries > self.max_attempts || crate::deadline::after(wait) > deadline {
                return Err(e);
            }
            if retries == 1 {
                // A Connect error names the URL itself.
                let why = match &e {
                    Error::Connect { .. } => rpma_common::error_chain(&e),
                    e => format!("cannot connect to {url}: {}", rpma_common::error_chain(e)),
                };
                log::warn!(
                    "{why}; retrying with backoff for up to {:.0?}",
                    self.timeout
                );
            } else {
                log::debug!("connect attempt {retries} to {url} failed: {e}");
            }
            std::thread::sleep(wait);
            each = timeout.min(
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(100)),
            );
        }
    }

    /// The waits before each attempt this policy allows when every attempt fails at once
    /// (attempts start while their wait ends within `timeout`).
    pub fn schedule(&self) -> Vec<Duration> {
        let mut at = Duration::ZERO;
        let mut out = Vec::new();
        for n in 1..=self.max_attempts {
            at = at.saturating_add(self.backoff(n));
            if at > self.timeout {
                break;
            }
            out.push(self.backoff(n));
        }
        out
    }
}

/// Whether a failed first connection may succeed if made again: the target not there (yet),
/// the exchange lost or timed out, or a refusal for lack of room or during a shutdown.
pub(crate) fn may_pass(e: &Error) -> bool {
    match e {
        Error::Connect { source, .. } => !matches!(
            source,
            fabric::Error::BadUrl { .. }
                | fabric::Error::NotMpa { .. }
                | fabric::Error::TransportUnavailable { .. }
                | fabric::Error::NoDevice
                | fabric::Error::NoSuchDevice { .. }
        ),
        Error::Refused {
            reason: RefusalReason::TooManyConnections | RefusalReason::ShuttingDown,
            ..
        } => true,
        Error::Completion { .. } => true,
        e => e.is_connection_loss(),
    }
}

/// Sizes and policies of a queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueOptions {
    /// The most requests in flight at once, and the fewest registered bounce slots. 1..=128.
    pub depth: usize,
    /// Bytes per slot: transfers are split into requests of at most this size. 4 KiB..=16 MiB,
    /// a multiple of 4096.
    pub chunk: usize,
    /// Registered memory for written chunks kept until a durability acknowledgement covers
    /// them (what a replay after a lost connection re-issues), like a disk's write cache: the
    /// queue has `max(depth, replay_bytes / chunk)` slots, at most `depth` of them in flight.
    /// When every slot holds such a write the queue makes them durable before it goes on, so
    /// more slots make that rarer; a write that covers a held one at the same offset frees it.
    /// 0 (the default): `depth` slots. At most 1 GiB.
    pub replay_bytes: usize,
    /// The most bytes of started Reads ([`Namespace::start_read`](crate::Namespace::start_read),
    /// [`start_read_into`](crate::Namespace::start_read_into)) in flight at once: a Read that
    /// would take them beyond this is held back, with what was started after it, until
    /// completions make room (a Read alone always goes; anything else the queue posts goes
    /// behind them). The start itself never waits for this. Over `tcp` with CRC the receiving
    /// end is the slower one, and what the target sends beyond what it keeps up with piles up
    /// in the kernel's socket buffers: 1 MiB reads at depth 16 ran 1.31x faster with the
    /// default (docs/benchmarks.md, "A bound on a queue's Read bytes in flight"). 0: no bound.
    /// Default 8 MiB.
    pub read_bytes_in_flight: usize,
    /// Force a durability method on every namespace (None: the best one offered).
    pub persist: Option<PersistMethod>,
    /// Reconnect behaviour.
    pub reconnect: ReconnectPolicy,
}

impl Default for QueueOptions {
    fn default() -> Self {
        QueueOptions {
            depth: 32,
            chunk: 256 << 10,
            replay_bytes: 0,
            read_bytes_in_flight: 8 << 20,
            persist: None,
            reconnect: ReconnectPolicy::default(),
        }
    }
}

impl QueueOptions {
    /// The most [`replay_bytes`](Self::replay_bytes) a queue takes: 1 GiB.
    pub const MAX_REPLAY_BYTES: usize = 1 << 30;

    pub(super) fn check(&self) -> Result<()> {
        if !(1..=128).contains(&self.depth) {
            return Err(Error::InvalidArgument(format!(
                "queue depth {} is not in 1..=128",
                self.depth
            )));
        }
        if !(4096..=16 << 20).contains(&self.chunk) || !self.chunk.is_multiple_of(4096) {
            return Err(Error::InvalidArgument(format!(
                "chunk {} is not a multiple of 4096 in 4 KiB..=16 MiB",
                self.chunk
            )));
        }
        if self.replay_bytes > Self::MAX_REPLAY_BYTES {
            return Err(Error::InvalidArgument(format!(
                "replay_bytes {} is more than 1 GiB",
                self.replay_bytes
            )));
        }
        Ok(())
    }

    /// The bounce slots of a queue with these options.
    pub(crate) fn slots(&self) -> usize {
        self.depth.max(self.replay_bytes / self.chunk)
    }
}

/// Where and who: a target URL, a subsystem, a host identity and options. Cheap to clone:
/// hand one to each thread and open a queue there.
///
/// The queues opened from one connection and its clones share a replay order: when one of them
/// re-issues its held writes after a lost connection, it replays only the bytes no newer write
/// of any of them has written since (docs/initiator.md, "Reconnect"). Queues of two
/// connections made apart (two [`Connection::new`]) know nothing of each other's writes.
#[derive(Debug, Clone)]
pub struct Connection {
    pub(super) url: String,
    pub(super) subsystem: Nqn,
    pub(super) host: HostIdentity,
    pub(super) options: ConnectOptions,
    pub(super) queue: QueueOptions,
    pub(super) replay: Arc<ReplayOrder>,
}

impl Connection {
    /// Whether registering memory for it pins nothing (`tcp://`; `rdma://` pins against
    /// RLIMIT_MEMLOCK).
    pub(crate) fn registers_freely(&self) -> bool {
        fabric::Url::parse(&self.url).is_ok_and(|u| u.scheme == fabric::Scheme::Tcp)
    }

    /// A connection to `subsystem` at `url` as `host`, with default options.
    pub fn new(url: &str, subsystem: Nqn, host: HostIdentity) -> Connection {
        Connection {
            url: url.to_owned(),
            subsystem,
            host,
            options: ConnectOptions::default(),
            queue: QueueOptions::default(),
            replay: Arc::default(),
        }
    }

    /// The same with these connect options (time-out, keep-alive, CRC).
    pub fn with_connect_options(mut self, o: ConnectOptions) -> Connection {
        self.options = o;
        self
    }

    /// The same with these queue options.
    pub fn with_queue_options(mut self, q: QueueOptions) -> Connection {
        self.queue = q;
        self
    }

    pub(super) fn connect_session_within(
        &self,
        queue_id: u16,
        timeout: Duration,
    ) -> Result<Session> {
        let opts = ConnectOptions {
            queue_id,
            timeout,
            ..self.options.clone()
        };
        connect(&self.url, &self.subsystem, &self.host, &opts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        let p = ReconnectPolicy {
            max_attempts: 5,
            timeout: Duration::from_secs(60),
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(50),
        };
        let waits: Vec<u128> = (1..=5).map(|n| p.backoff(n).as_millis()).collect();
        assert_eq!(waits, vec![10, 20, 40, 50, 50]);
        assert_eq!(p.backoff(200), Duration::from_millis(50), "no overflow");
        assert_eq!(p.schedule().len(), 5, "the attempt limit");
        let p = ReconnectPolicy {
            max_attempts: u32::MAX,
            timeout: Duration::from_millis(200),
            ..p
        };
        // 10 + 20 + 40 + 50 + 50 = 170; the next would start at 220.
        assert_eq!(p.schedule().len(), 5, "the time limit");
        assert!(ReconnectPolicy::never().schedule().is_empty());
        assert!(ReconnectPolicy::within(Duration::ZERO)
            .schedule()
            .is_empty());
    }

    #[test]
    fn a_first_connection_is_retried_only_while_it_may_pass() {
        let p = ReconnectPolicy {
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(1),
            ..ReconnectPolicy::within(Duration::from_secs(3600))
        };
        let refused = || Error::Connect {
            url: "tcp://x:1".into(),
            source: fabric::Error::Socket {
                op: "connect",
                addr: "x:1".into(),
                source: std::io::ErrorKind::ConnectionRefused.into(),
            },
        };
        let full = || Error::Refused {
            reason: RefusalReason::TooManyConnections,
            message: "too many connections from this address".into(),
        };
        // Refused twice, no room once, then in.
        let mut n = 0;
        let r = p.first_connection("tcp://x:1", Duration::from_secs(10), |t| {
            n += 1;
            assert_eq!(t, Duration::from_secs(10), "the connect deadline");
            match n {
                1 | 2 => Err(refused()),
                3 => Err(full()),
                _ => Ok(n),
            }
        });
        assert_eq!(r.unwrap(), 4);
        // What would fail the same way again fails at once.
        for e in [
            Error::HostNotAllowed {
                message: "no".into(),
            },
            Error::UnknownSubsystem {
                message: "no".into(),
            },
            Error::AuthFailed {
                message: "no".into(),
            },
            Error::KeyRequired,
            Error::Connect {
                url: "rdma://x:1".into(),
                source: fabric::Error::NoDevice,
            },
            Error::Refused {
                reason: RefusalReason::ProtocolError,
                message: "no".into(),
            },
        ] {
            assert!(!may_pass(&e), "{e}");
            let mut n = 0;
            let r: Result<()> = p.first_connection("u", Duration::from_secs(1), |_| {
                n += 1;
                Err(Error::KeyRequired)
            });
            assert!(r.is_err());
            assert_eq!(n, 1, "{e}: one attempt");
        }
        // Never: one attempt, its error.
        let mut n = 0;
        let r: Result<()> = ReconnectPolicy::never().first_connection("u", Duration::ZERO, |_| {
            n += 1;
            Err(refused())
        });
        assert!(matches!(r, Err(Error::Connect { .. })));
        assert_eq!(n, 1);
        // The attempt limit, then the last error as it was.
        let p = ReconnectPolicy {
            max_attempts: 3,
            ..p
        };
        let mut n = 0;
        let r: Result<()> = p.first_connection("u", Duration::ZERO, |_| {
            n += 1;
            Err(full())
        });
        assert!(matches!(r, Err(Error::Refused { .. })));
        assert_eq!(n, 4, "the first attempt and three retries");
    }

    #[test]
    fn default_reconnect_covers_a_minute_with_capped_backoff() {
        let p = ReconnectPolicy::default();
        let waits = p.schedule();
        let total: Duration = waits.iter().sum();
        assert!(
            total > Duration::from_secs(55) && total <= Duration::from_secs(60),
            "{total:?}"
        );
        assert!(waits.iter().all(|w| *w <= Duration::from_secs(2)), "capped");
        assert_eq!(waits[0], Duration::from_millis(50));
        assert_eq!(
            ReconnectPolicy::within(Duration::from_secs(5)).timeout,
            Duration::from_secs(5)
        );
    }

    #[test]
    fn queue_options_are_checked() {
        let ok = QueueOptions::default();
        assert!(ok.check().is_ok());
        for bad in [
            QueueOptions {
                depth: 0,
                ..ok.clone()
            },
            QueueOptions {
                depth: 129,
                ..ok.clone()
            },
            QueueOptions {
                chunk: 1000,
                ..ok.clone()
            },
            QueueOptions {
                chunk: 32 << 20,
                ..ok.clone()
            },
        ] {
            assert!(
                matches!(bad.check(), Err(Error::InvalidArgument(_))),
                "{bad:?}"
            );
        }
        // And open_queue checks before connecting anywhere.
        let c = Connection::new(
            "tcp://127.0.0.1:9",
            "nqn.2026-11.io.rpma:x".parse().unwrap(),
            HostIdentity::new("nqn.2026-11.io.rpma:h".parse().unwrap()),
        )
        .with_queue_options(QueueOptions { depth: 0, ..ok });
        assert!(matches!(c.open_queue(1), Err(Error::InvalidArgument(_))));
        assert!(matches!(
            c.open_queue_once(1),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn only_tcp_registers_memory_without_pinning_it() {
        let conn = |url: &str| {
            Connection::new(
                url,
                "nqn.2026-11.io.rpma:x".parse().unwrap(),
                HostIdentity::new("nqn.2026-11.io.rpma:h".parse().unwrap()),
            )
        };
        assert!(conn("tcp://127.0.0.1:9").registers_freely());
        assert!(!conn("rdma://127.0.0.1:9").registers_freely());
        assert!(!conn("rdma://[::1]:9").registers_freely());
        assert!(
            !conn("tcp:/nowhere").registers_freely(),
            "a URL that does not parse"
        );
    }
}
