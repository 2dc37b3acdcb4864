//! The RLIMIT_MEMLOCK check for `rdma://` listeners.
//!
//! On an RDMA NIC every session registers each namespace it may reach (a region per
//! connection, docs/architecture.md "Rkeys"), and a registration of memory that is pinned
//! (tmpfs, anonymous memory, devdax) counts against the process's RLIMIT_MEMLOCK once per
//! registration, unless the process has CAP_IPC_LOCK. fsdax and page-cache namespaces are
//! registered with on-demand paging, which pins nothing. The default limit (8 MiB) is far too
//! small for a namespace, and the failure would come at the first admission as a refusal the
//! host cannot explain, so the daemon checks at start and says what to change.

use rpma_common::fabric::{MemoryBacking, RegisteredMemory};
use rpma_common::units::format_size;

use crate::config::{Config, Transport};
use crate::namespace::NamespaceTable;

/// Pinned memory beside the namespaces: message slots (registered, so pinned on `rdma://`),
/// as the serving side sizes them (`crate::serve::slots`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slots {
    /// What a session registers: a receive slot per request of `max_queue_depth` and a few
    /// more, and its send slots (1.16 MiB at the default depth: the 1 MiB counted before was
    /// short of it).
    pub session: u64,
    /// What the connections that are not sessions register at most: the unadmitted and
    /// discovery pools full, each connection with its handshake's slots.
    pub pools: u64,
}

/// The limit the process runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// RLIM_INFINITY, or CAP_IPC_LOCK (pinning is then not limited).
    Unlimited,
    /// The soft limit in bytes.
    Bytes(u64),
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Limit::Unlimited => f.write_str("unlimited (RLIMIT_MEMLOCK infinity, or CAP_IPC_LOCK)"),
            Limit::Bytes(b) => write!(f, "RLIMIT_MEMLOCK {}", format_size(*b)),
        }
    }
}

/// What the check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Enough for `max_connections` sessions (or no rdma listener, or nothing pinned).
    Fine,
    /// Enough for some sessions only: the message says how many.
    Short(String),
    /// Not enough for one session: registrations would fail.
    TooLow(String),
}

/// The advice every message ends with.
pub const ADVICE: &str = "set LimitMEMLOCK=infinity in the service (systemd/rpma-target.service \
                          has it), run under `ulimit -l unlimited`, or grant CAP_IPC_LOCK";

/// The check, from the limit, what one session pins, how many sessions may be admitted and
/// what the connections that are not sessions pin at most (`pools`).
pub fn judge(limit: Limit, per_session: u64, max_connections: u32, pools: u64) -> Verdict {
    let Limit::Bytes(bytes) = limit else {
        return Verdict::Fine;
    };
    if per_session == 0 {
        return Verdict::Fine;
    }
    let fits = bytes.saturating_sub(pools) / per_session;
    if fits == 0 {
        return Verdict::TooLow(format!(
            "RLIMIT_MEMLOCK is {} and one rdma session pins up to {} (its namespaces' \
             registrations): every admission would fail; {ADVICE}",
            format_size(bytes),
            format_size(per_session)
        ));
    }
    if fits < u64::from(max_connections) {
        return Verdict::Short(format!(
            "RLIMIT_MEMLOCK is {}: enough for {fits} rdma session(s) of {} each, not for \
             max_connections {max_connections}; later admissions will be refused; {ADVICE}",
            format_size(bytes),
            format_size(per_session)
        ));
    }
    Verdict::Fine
}

/// What the process may pin: its soft RLIMIT_MEMLOCK, or unlimited with CAP_IPC_LOCK.
pub fn current_limit() -> Limit {
    if has_cap_ipc_lock() {
        return Limit::Unlimited;
    }
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the valid struct given.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return Limit::Unlimited; // cannot tell: do not block the start on a guess
    }
    if r.rlim_cur == libc::RLIM_INFINITY {
        Limit::Unlimited
    } else {
        Limit::Bytes(r.rlim_cur)
    }
}

/// CAP_IPC_LOCK's number (linux/capability.h).
const CAP_IPC_LOCK: u32 = 14;

/// Whether the effective capabilities include CAP_IPC_LOCK (a bit of CapEff).
fn has_cap_ipc_lock() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| cap_eff(&s))
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

fn cap_eff(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
}

/// What one session pins at most: the largest subsystem's pinned namespaces, and its slots.
pub fn per_session(cfg: &Config, namespaces: &NamespaceTable, slots: Slots) -> u64 {
    let pinned = cfg
        .subsystems
        .iter()
        .map(|s| {
            namespaces
                .of_subsystem(&s.nqn)
                .filter(|ns| {
                    matches!(
                        ns.mapping.backing(),
                        MemoryBacking::Ram | MemoryBacking::DevDax
                    )
                })
                .map(|ns| ns.size())
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    pinned + slots.session
}

/// The check at start: only when a listener is `rdma://`.
pub fn check(cfg: &Config, namespaces: &NamespaceTable, slots: Slots) -> Verdict {
    if !cfg
        .listeners
        .iter()
        .any(|l| l.url.transport == Transport::Rdma)
    {
        return Verdict::Fine;
    }
    judge(
        current_limit(),
        per_session(cfg, namespaces, slots),
        cfg.max_connections,
        slots.pools,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn unlimited_or_nothing_pinned_is_fine() {
        assert_eq!(judge(Limit::Unlimited, 64 * MIB, 128, MIB), Verdict::Fine);
        assert_eq!(judge(Limit::Bytes(8 * MIB), 0, 128, MIB), Verdict::Fine);
        assert_eq!(
            judge(Limit::Bytes(1024 * MIB), 8 * MIB, 128, 0),
            Verdict::Fine
        );
    }

    #[test]
    fn the_default_limit_is_too_low_for_a_namespace() {
        let Verdict::TooLow(m) = judge(Limit::Bytes(8 * MIB), 65 * MIB, 128, 0) else {
            panic!("8 MiB cannot hold a 64 MiB namespace")
        };
        assert!(m.contains("RLIMIT_MEMLOCK is 8 MiB"), "{m}");
        assert!(m.contains("65 MiB"), "{m}");
        assert!(m.contains("LimitMEMLOCK=infinity"), "{m}");
        assert!(m.contains("CAP_IPC_LOCK"), "{m}");
    }

    #[test]
    fn a_limit_for_some_sessions_says_how_many() {
        let Verdict::Short(m) = judge(Limit::Bytes(100 * MIB), 33 * MIB, 128, 0) else {
            panic!("100 MiB holds 3 sessions of 33 MiB, not 128")
        };
        assert!(m.contains("enough for 3 rdma session(s)"), "{m}");
        assert!(m.contains("max_connections 128"), "{m}");
        // What the pools pin comes first: 100 MiB less 4 MiB holds 2 sessions of 33 MiB.
        let Verdict::Short(m) = judge(Limit::Bytes(100 * MIB), 33 * MIB, 128, 4 * MIB) else {
            panic!("96 MiB holds 2 sessions of 33 MiB")
        };
        assert!(m.contains("enough for 2 rdma session(s)"), "{m}");
    }

    #[test]
    fn limits_say_what_they_are() {
        assert_eq!(Limit::Bytes(8 * MIB).to_string(), "RLIMIT_MEMLOCK 8 MiB");
        assert!(Limit::Unlimited.to_string().contains("CAP_IPC_LOCK"));
    }

    #[test]
    fn cap_eff_is_read_from_proc_status() {
        let status = "Name:\trpma\nCapInh:\t0000000000000000\nCapEff:\t0000000000004000\n";
        assert_eq!(cap_eff(status), Some(1 << CAP_IPC_LOCK));
        assert_eq!(cap_eff("Name:\tx\n"), None);
        assert_eq!(cap_eff("CapEff:\tzz\n"), None);
    }
}
