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
//! Admitted sessions whose host proved no key are listed in two more pools, which have no
//! limits of their own (`max_connections` bounds every session), by their [`Standing`]: those
//! whose host the subsystem does not list (admitted only because it allows any host: a made-up
//! NQN, anyone on earth) in [`Pool::Unlisted`], the lowest class; those of a host the subsystem
//! lists without a key (every `nvme-tcp://` controller of a listed host too) in
//! [`Pool::Unproven`]. When the target is full a newcomer takes the place of the oldest of the
//! classes below its own ([`Budgets::make_room`]): a host that proved its key that of the oldest
//! unlisted session, else of the oldest unproven one; a listed host without a key that of the
//! oldest unlisted session, never another listed host's; an unlisted host nobody's. So peers
//! that are not listed, from any address, cannot lock listed hosts out, and peers that proved
//! nothing cannot lock keyed hosts out. (A listed host without a key is only as safe as its
//! NQN is secret: whoever claims it is that host here.)

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
    /// Admitted sessions of a host its subsystem lists without a key (it proved none).
    Unproven,
    /// Admitted sessions of a host its subsystem does not list (let in by `allow_any_host`).
    Unlisted,
}

impl Pool {
    /// Who took the place of a session (or a host being registered) evicted from this pool in
    /// the full target, and why that one gave way (for its log line and its Disconnect or
    /// refusal).
    pub(crate) fn evicted_by(self) -> (&'static str, &'static str) {
        match self {
            Pool::Unlisted => (
                "a host its subsystem lists (or one that proved its key)",
                "this host is not listed on its subsystem",
            ),
            _ => ("a host that proved its key", "this host proved none"),
        }
    }

    /// The pool's name in logs and status.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Pool::Unadmitted => "unadmitted",
            Pool::Discovery => "discovery",
            Pool::Unproven => "unproven sessions",
            Pool::Unlisted => "unlisted sessions",
        }
    }

    /// Whether its tickets are held by admitted sessions (given up with the session, not
    /// after the connection's linger: a newcomer evicting one would free nothing).
    pub(crate) fn holds_sessions(self) -> bool {
        matches!(self, Pool::Unproven | Pool::Unlisted)
    }
}

/// What an admitted session's host showed, which decides the pool it is listed in and whose
/// place it may take in a full target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Standing {
    /// It proved the key its subsystem lists it with.
    Proven,
    /// Its subsystem lists it without a key.
    Listed,
    /// Its subsystem does not list it: admitted because the subsystem allows any host.
    Unlisted,
}

impl Standing {
    /// The standing of a host that proved its key (`proven`) or, if not, is listed or not by
    /// the subsystem it connected to.
    pub(crate) fn of(proven: bool, listed: bool) -> Standing {
        match (proven, listed) {
            (true, _) => Standing::Proven,
            (false, true) => Standing::Listed,
            (false, false) => Standing::Unlisted,
        }
    }

    /// The pool its session is listed in (none for a proven host: nobody takes its place).
    pub(crate) fn pool(self) -> Option<Pool> {
        match self {
            Standing::Proven => None,
            Standing::Listed => Some(Pool::Unproven),
            Standing::Unlisted => Some(Pool::Unlisted),
        }
    }

    /// The pools whose oldest session it may take the place of in a full target, lowest first.
    fn displaces(self) -> &'static [Pool] {
        match self {
            Standing::Proven => &[Pool::Unlisted, Pool::Unproven],
            Standing::Listed => &[Pool::Unlisted],
            Standing::Unlisted => &[],
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

/// The pools.
#[derive(Debug, Default)]
pub(crate) struct Budgets {
    unadmitted: Mutex<PoolState>,
    discovery: Mutex<PoolState>,
    unproven: Mutex<PoolState>,
    unlisted: Mutex<PoolState>,
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
            Pool::Unlisted => &self.unlisted,
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

    /// A place in `pool` (one without limits of its own: [`Pool::Unproven`],
    /// [`Pool::Unlisted`]) for a connection
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

    /// Moves `ticket`'s place to `to` (its host's standing rose: a reload listed it), as the
    /// newest holder there; false, and the ticket is left as it is, if its pool took the place
    /// back already (the connection is closed as evicted). Checked and released under the old
    /// pool's lock: a newcomer cannot take the old place after the check and find the session
    /// still there, over the limit.
    pub(crate) fn promote(&self, ticket: &mut Ticket, to: Pool) -> bool {
        let held = {
            let mut st = self.state(ticket.pool);
            if ticket.held.evicted.load(Ordering::SeqCst) {
                return false;
            }
            match st.release(ticket.serial) {
                Some(h) => h,
                None => return false,
            }
        };
        let mut st = self.state(to);
        let serial = st.next;
        st.next += 1;
        *st.per_source.entry(held.source).or_insert(0) += 1;
        st.held.insert(serial, held);
        ticket.pool = to;
        ticket.serial = serial;
        true
    }

    /// Takes the place of `pool`'s oldest holder back (its loop closes its connection).
    /// Returns whether there was one.
    fn evict_oldest(&self, pool: Pool) -> bool {
        let mut st = self.state(pool);
        let Some(&oldest) = st.held.keys().next() else {
            return false;
        };
        st.evict(oldest);
        true
    }

    /// Makes room in the full target for a session of a host of `standing`: takes back the
    /// place of the oldest session of the lowest class below it that holds one (its loop
    /// closes it). Returns the pool it was taken from; None if there was nobody below it.
    pub(crate) fn make_room(&self, standing: Standing) -> Option<Pool> {
        standing
            .displaces()
            .iter()
            .copied()
            .find(|&p| self.evict_oldest(p))
    }

    /// Whether [`make_room`](Self::make_room) would find a session to take the place of now
    /// (the answer may be stale by the time it is acted on; the tests look with it).
    #[cfg(test)]
    pub(crate) fn could_make_room(&self, standing: Standing) -> bool {
        standing
            .displaces()
            .iter()
            .any(|&p| !self.state(p).held.is_empty())
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

    /// A ticket promoted from the unlisted pool holds a place in the unproven one instead (the
    /// newest there): a listed newcomer no longer finds it below; an evicted one is not moved.
    #[test]
    fn a_promoted_ticket_moves_to_the_higher_pool_unless_it_was_evicted() {
        let b = Arc::new(Budgets::default());
        let (tx, _rx) = owner();
        let mut t = b.enlist(Pool::Unlisted, A, tx.clone());
        let older = b.enlist(Pool::Unproven, B, tx.clone());
        assert!(b.promote(&mut t, Pool::Unproven));
        assert_eq!(t.pool(), Pool::Unproven);
        assert_eq!(b.usage(Pool::Unlisted).held, 0);
        assert_eq!(b.usage(Pool::Unproven).held, 2);
        assert!(
            !b.could_make_room(Standing::Listed),
            "nothing below a listed host now"
        );
        // The newest of the unproven: a proven newcomer takes the older one's place first.
        assert_eq!(b.make_room(Standing::Proven), Some(Pool::Unproven));
        assert!(older.evicted() && !t.evicted());
        drop(t);
        assert_eq!(
            b.usage(Pool::Unproven).held,
            0,
            "the moved place is given back once"
        );
        // An evicted ticket stays where it was (its connection is closed as evicted).
        let mut gone = b.enlist(Pool::Unlisted, A, tx.clone());
        assert_eq!(b.make_room(Standing::Listed), Some(Pool::Unlisted));
        assert!(!b.promote(&mut gone, Pool::Unproven));
        assert_eq!(gone.pool(), Pool::Unlisted);
        assert_eq!(b.usage(Pool::Unproven).held, 0);
    }

    /// In a full target a proven host takes the place of the oldest unlisted session first,
    /// then of the oldest unproven one; a listed host only of an unlisted one; an unlisted
    /// host of nobody's. (Before, unlisted sessions were unproven ones like a listed host's,
    /// and a listed host without a key displaced nobody: 64 sessions of made-up NQNs kept it
    /// out.)
    #[test]
    fn each_standing_takes_the_place_of_the_oldest_below_it_lowest_class_first() {
        let b = Arc::new(Budgets::default());
        let (tx, rx) = owner();
        let enlist = |s: Standing, src| b.enlist(s.pool().unwrap(), src, tx.clone());
        let listed = [enlist(Standing::Listed, A), enlist(Standing::Listed, B)];
        let unlisted = [enlist(Standing::Unlisted, A), enlist(Standing::Unlisted, B)];
        assert_eq!(
            Standing::Proven.pool(),
            None,
            "nobody takes a proven host's place"
        );
        assert!(b.could_make_room(Standing::Listed));
        assert!(!b.could_make_room(Standing::Unlisted));
        assert_eq!(b.make_room(Standing::Unlisted), None);
        // A listed host: the oldest unlisted session, although listed ones are older.
        assert_eq!(b.make_room(Standing::Listed), Some(Pool::Unlisted));
        assert!(unlisted[0].evicted() && !unlisted[1].evicted());
        assert!(listed.iter().all(|t| !t.evicted()));
        assert!(matches!(rx.try_recv(), Ok(LoopCmd::Evicted)));
        // A proven host: the other unlisted one first.
        assert_eq!(b.make_room(Standing::Proven), Some(Pool::Unlisted));
        assert!(unlisted[1].evicted() && listed.iter().all(|t| !t.evicted()));
        // No unlisted session left: a listed host finds nobody, a proven host the oldest
        // unproven one.
        assert!(!b.could_make_room(Standing::Listed));
        assert_eq!(b.make_room(Standing::Listed), None);
        assert!(b.could_make_room(Standing::Proven));
        assert_eq!(b.make_room(Standing::Proven), Some(Pool::Unproven));
        assert!(listed[0].evicted() && !listed[1].evicted());
        assert_eq!(b.usage(Pool::Unlisted).evicted, 2);
        assert_eq!(b.usage(Pool::Unproven).evicted, 1);
        assert_eq!(b.usage(Pool::Unlisted).held, 0);
        assert_eq!(b.usage(Pool::Unproven).held, 1);
        // A newer unlisted session goes before the older listed one.
        let newer = enlist(Standing::Unlisted, A);
        assert_eq!(b.make_room(Standing::Proven), Some(Pool::Unlisted));
        assert!(newer.evicted() && !listed[1].evicted());
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
