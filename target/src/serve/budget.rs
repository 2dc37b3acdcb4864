//! The admission budgets: connections that have not been admitted yet (past MPA, before the end
//! of their Connect and auth) and discovery sessions each draw a [`Ticket`] from a pool of their
//! own, bounded in total and per source address (admitted sessions are counted against
//! `max_connections` at admission, see [`Shared::register_session`](super::Shared)).
//!
//! A newcomer always gets a place, the way a full pool makes room: if its source address holds
//! its cap already, that source's own oldest ticket is evicted; if the pool is full, the pool's
//! oldest is (the evicted connection is closed by its poll loop). So an attacker who fills a
//! pool, from as many addresses as he likes or from the allowed host's own address, can delay
//! an allowed host by nothing but the time of its own exchange: the host's new connection is
//! always taken in, and it finishes its Connect long before as many newer connections have
//! pushed it out. The per-source cap keeps one address from taking more than its share of the
//! pool: the others' places are evicted only when the pool is full.
//!
//! Before admission a connection holds only what the control exchange needs (a few receive
//! slots, see the poll loop), so the pool bounds the memory of unadmitted connections too.
//!
//! Admitted sessions whose host proved no key (a subsystem open to any host, a host listed
//! without a key, every `nvme-tcp://` controller) are listed in a third pool, [`Pool::Unproven`],
//! which has no limits of its own (`max_connections` bounds every session): when the target is
//! full, a host that proved its key takes the place of the oldest of them
//! ([`Budgets::evict_oldest`]), so that peers who proved nothing cannot lock keyed hosts out.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Whoever owns a ticket's connection, told when its pool takes the place back (a poll loop,
/// through its [`LoopTx`](super::LoopTx)): the pools name no poll loop.
pub(crate) trait Owner: std::fmt::Debug + Send + Sync {
    /// The pool took the place back for a newer connection: wake the owner to close it.
    fn evicted(&self);
}

/// Which pool a ticket is from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pool {
    /// Past MPA, Connect (and auth) not finished.
    Unadmitted,
    /// Discovery sessions.
    Discovery,
    /// Admitted sessions whose host proved no key.
    Unproven,
}

impl Pool {
    /// The pool's name in logs and status.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Pool::Unadmitted => "unadmitted",
            Pool::Discovery => "discovery",
            Pool::Unproven => "unproven sessions",
        }
    }
}

/// A pool's limits.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub(crate) total: usize,
    pub(crate) per_source: usize,
}

/// What the holder of a ticket and the pool share.
#[derive(Debug)]
struct Held {
    source: IpAddr,
    evicted: AtomicBool,
    /// The poll loop that owns the connection, woken when it is evicted.
    owner: Box<dyn Owner>,
}

#[derive(Debug, Default)]
struct PoolState {
    per_source: HashMap<IpAddr, usize>,
    /// By serial: the first is the oldest.
    held: BTreeMap<u64, Arc<Held>>,
    next: u64,
    evicted: u64,
}

impl PoolState {
    /// Takes `serial`'s place back for a newer connection and wakes its loop to close it.
    fn evict(&mut self, serial: u64) {
        if let Some(h) = self.release(serial) {
            self.evicted += 1;
            h.evicted.store(true, Ordering::SeqCst);
            h.owner.evicted();
        }
    }

    fn release(&mut self, serial: u64) -> Option<Arc<Held>> {
        let h = self.held.remove(&serial)?;
        if let Some(n) = self.per_source.get_mut(&h.source) {
            *n -= 1;
            if *n == 0 {
                self.per_source.remove(&h.source);
            }
        }
        Some(h)
    }
}

/// The two pools.
#[derive(Debug, Default)]
pub(crate) struct Budgets {
    unadmitted: Mutex<PoolState>,
    discovery: Mutex<PoolState>,
    unproven: Mutex<PoolState>,
}

/// A connection's place in a pool, given back on drop.
#[derive(Debug)]
pub(crate) struct Ticket {
    budgets: Arc<Budgets>,
    pool: Pool,
    serial: u64,
    held: Arc<Held>,
}

impl Ticket {
    /// Whether the pool took the place back for a newer connection: close the connection.
    pub(crate) fn evicted(&self) -> bool {
        self.held.evicted.load(Ordering::SeqCst)
    }

    /// The pool.
    pub(crate) fn pool(&self) -> Pool {
        self.pool
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.budgets.state(self.pool).release(self.serial);
    }
}

/// A pool's use, for `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Use {
    pub(crate) held: usize,
    pub(crate) sources: usize,
    pub(crate) evicted: u64,
}

impl Budgets {
    fn state(&self, pool: Pool) -> std::sync::MutexGuard<'_, PoolState> {
        let m = match pool {
            Pool::Unadmitted => &self.unadmitted,
            Pool::Discovery => &self.discovery,
            Pool::Unproven => &self.unproven,
        };
        m.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place in `pool` for a connection from `source` owned by the loop `owner`. Always
    /// given: if the source holds its cap already, its own oldest holder is evicted; if the
    /// pool is full, the pool's oldest is.
    pub(crate) fn take(
        self: &Arc<Self>,
        pool: Pool,
        source: IpAddr,
        limits: Limits,
        owner: impl Owner + 'static,
    ) -> Ticket {
        // An IPv4 peer on a dual-stack socket (::ffff:a.b.c.d) is the source a.b.c.d.
        let source = source.to_canonical();
        let mut st = self.state(pool);
        // A reload may have lowered the limits: evict down to them.
        while st.per_source.get(&source).copied().unwrap_or(0) >= limits.per_source.max(1) {
            let Some(oldest) = st
                .held
                .iter()
                .find(|(_, h)| h.source == source)
                .map(|(&k, _)| k)
            else {
                break;
            };
            st.evict(oldest);
        }
        while st.held.len() >= limits.total.max(1) {
            let Some(&oldest) = st.held.keys().next() else {
                break;
            };
            st.evict(oldest);
        }
        self.insert(&mut st, pool, source, Box::new(owner))
    }

    /// A place in `pool` (one without limits of its own: [`Pool::Unproven`]) for a connection
    /// from `source` owned by the loop `owner`, evicting nobody.
    pub(crate) fn enlist(
        self: &Arc<Self>,
        pool: Pool,
        source: IpAddr,
        owner: impl Owner + 'static,
    ) -> Ticket {
        let mut st = self.state(pool);
        self.insert(&mut st, pool, source.to_canonical(), Box::new(owner))
    }

    fn insert(
        self: &Arc<Self>,
        st: &mut PoolState,
        pool: Pool,
        source: IpAddr,
        owner: Box<dyn Owner>,
    ) -> Ticket {
        let serial = st.next;
        st.next += 1;
        let held = Arc::new(Held {
            source,
            evicted: AtomicBool::new(false),
            owner,
        });
        st.held.insert(serial, Arc::clone(&held));
        *st.per_source.entry(source).or_insert(0) += 1;
        Ticket {
            budgets: Arc::clone(self),
            pool,
            serial,
            held,
        }
    }

    /// Takes the place of `pool`'s oldest holder back (its loop closes its connection).
    /// Returns whether there was one.
    pub(crate) fn evict_oldest(&self, pool: Pool) -> bool {
        let mut st = self.state(pool);
        let Some(&oldest) = st.held.keys().next() else {
            return false;
        };
        st.evict(oldest);
        true
    }

    /// What `pool` holds now.
    pub(crate) fn usage(&self, pool: Pool) -> Use {
        let st = self.state(pool);
        Use {
            held: st.held.len(),
            sources: st.per_source.len(),
            evicted: st.evicted,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;
    use crate::eventfd::EventFd;
    use crate::serve::{LoopCmd, LoopTx};

    fn owner() -> (LoopTx, mpsc::Receiver<LoopCmd>) {
        let (tx, rx) = mpsc::channel();
        (LoopTx::new(tx, Arc::new(EventFd::new().unwrap())), rx)
    }

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 2));

    #[test]
    fn a_source_at_its_cap_and_a_full_pool_evict_their_oldest() {
        let b = Arc::new(Budgets::default());
        let (tx, rx) = owner();
        let lim = Limits {
            total: 3,
            per_source: 2,
        };
        let a1 = b.take(Pool::Unadmitted, A, lim, tx.clone());
        let b1 = b.take(Pool::Unadmitted, B, lim, tx.clone());
        let a2 = b.take(Pool::Unadmitted, A, lim, tx.clone());
        assert!(rx.try_recv().is_err(), "nobody evicted yet");
        // A at its cap: A's own oldest (a1) makes room, not B's older place.
        let a3 = b.take(Pool::Unadmitted, A, lim, tx.clone());
        assert!(a1.evicted() && !b1.evicted() && !a2.evicted() && !a3.evicted());
        assert!(matches!(rx.try_recv(), Ok(LoopCmd::Evicted)));
        // Discovery is another pool.
        let _d = b.take(Pool::Discovery, A, lim, tx.clone());
        // Full (b1, a2, a3): B's newcomer evicts the pool's oldest, b1.
        let b2 = b.take(Pool::Unadmitted, B, lim, tx.clone());
        assert!(b1.evicted() && !a2.evicted() && !a3.evicted() && !b2.evicted());
        assert_eq!(
            b.usage(Pool::Unadmitted),
            Use {
                held: 3,
                sources: 2,
                evicted: 2
            }
        );
        // Dropping an evicted ticket gives nothing back twice.
        drop((a1, b1));
        assert_eq!(b.usage(Pool::Unadmitted).held, 3);
        drop((a2, a3, b2));
        assert_eq!(b.usage(Pool::Unadmitted).held, 0);
        assert_eq!(b.usage(Pool::Unadmitted).sources, 0);
        assert_eq!(b.usage(Pool::Discovery).held, 1);
    }

    #[test]
    fn a_lowered_cap_evicts_down_to_it() {
        let b = Arc::new(Budgets::default());
        let (tx, _rx) = owner();
        let wide = Limits {
            total: 8,
            per_source: 4,
        };
        let held: Vec<Ticket> = (0..4)
            .map(|_| b.take(Pool::Discovery, A, wide, tx.clone()))
            .collect();
        let narrow = Limits {
            total: 8,
            per_source: 2,
        };
        let new = b.take(Pool::Discovery, A, narrow, tx.clone());
        let evicted: Vec<bool> = held.iter().map(Ticket::evicted).collect();
        assert_eq!(evicted, [true, true, true, false]);
        assert!(!new.evicted());
        assert_eq!(b.usage(Pool::Discovery).held, 2);
    }

    #[test]
    fn mapped_ipv4_is_the_same_source() {
        let b = Arc::new(Budgets::default());
        let (tx, _rx) = owner();
        let lim = Limits {
            total: 8,
            per_source: 1,
        };
        let t = b.take(Pool::Discovery, A, lim, tx.clone());
        let mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
        let _m = b.take(Pool::Discovery, mapped, lim, tx);
        assert!(t.evicted(), "the same source: its oldest made room");
    }
}
