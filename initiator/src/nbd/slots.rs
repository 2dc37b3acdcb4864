//! Who holds the export's connections, and whom a newcomer may push out.
//!
//! The export serves at most `max_clients` connections, at most `max_clients_per_source` of
//! them from one source (a TCP client's IPv4 address or IPv6 /64, a Unix-socket client's user
//! id). A newcomer is never turned away while someone holds a slot without using it: a source
//! at its cap makes room from its own connections, a full export from all of them. The one
//! evicted is the oldest connection that has not sent a request yet (in its handshake or past
//! it), else one stalled on its replies (executing requests, its replies unread for [`STALL`]
//! or more), else one idle (in the transmission phase, no request being executed); in a full
//! export, of those of a kind, one of the source that holds the most; among those that sent
//! requests, the newest first, so that a client established on a source outlives the
//! connections opened after it. Only when every candidate is busy executing requests (and
//! taking its replies) is the newcomer refused.
//! So clients that merely hold slots, from one address or from many, delay a well-behaved
//! client by nothing but its own handshake: a newcomer outlives as many newer connections of
//! its source as the cap allows, and once it has sent a request it goes only after every
//! holder that never did and every one that does not read its replies. What they can still do
//! is push out a client of the source they share (or, when the export is full and they hold
//! no slot that goes first, of the largest sources) by opening connections faster than it
//! sends requests, or, once it sent requests, by being older than it and sending requests of
//! their own (docs/mount.md, "Limits").
//!
//! Each client's thread and the accept loop share a [`Slot`]: the client moves it between
//! handshake, idle, busy and stalled; the accept loop takes an idle, unfinished or stalled one
//! away ([`Slot::evict`]) in one compare-and-swap, so an evicted client never starts a request
//! it read after the eviction, and a busy one is never evicted (a stalled one goes back to
//! busy only if it was not: [`Slot::unstall`]).

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

/// Where a client connection comes from: the unit of the per-source cap and of the log limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    /// A TCP client's IPv4 address (an IPv4 address mapped into IPv6 counts as the IPv4 one).
    Addr(IpAddr),
    /// A TCP client's IPv6 /64 (the address with its last 64 bits cleared): a host is usually
    /// given a whole /64 and may pick any address in it, one per connection.
    Net64(Ipv6Addr),
    /// A Unix-socket client's user id (SO_PEERCRED): processes of one user are one source.
    Uid(u32),
    /// A Unix-socket client whose credentials could not be read.
    Unknown,
}

impl Source {
    /// The source of a TCP client at `ip`.
    pub(crate) fn of_ip(ip: IpAddr) -> Source {
        match ip.to_canonical() {
            IpAddr::V6(a) => Source::Net64(Ipv6Addr::from(u128::from(a) & !u128::from(u64::MAX))),
            v4 => Source::Addr(v4),
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Addr(a) => write!(f, "{a}"),
            Source::Net64(a) => write!(f, "{a}/64"),
            Source::Uid(u) => write!(f, "uid {u}"),
            Source::Unknown => f.write_str("an unknown Unix peer"),
        }
    }
}

const HANDSHAKE: u8 = 0;
const IDLE: u8 = 1;
const BUSY: u8 = 2;
const GONE: u8 = 3;
const STALLED: u8 = 4;

/// How long a client's replies may wait unread before its slot may be taken for a newcomer.
pub(crate) const STALL: Duration = Duration::from_secs(1);

/// One client's place in the export.
#[derive(Debug)]
pub(crate) struct Slot {
    phase: AtomicU8,
    /// It has begun executing requests at least once.
    used: AtomicBool,
    /// When it connected: its age, for the order of eviction.
    born: Instant,
    /// Milliseconds after `epoch` when it connected, last became idle or stalled.
    since_ms: AtomicU64,
    epoch: Instant,
}

impl Slot {
    /// A slot for a connection that is starting its handshake now.
    pub(crate) fn new(epoch: Instant) -> Slot {
        let s = Slot {
            phase: AtomicU8::new(HANDSHAKE),
            used: AtomicBool::new(false),
            born: Instant::now(),
            since_ms: AtomicU64::new(0),
            epoch,
        };
        s.touch();
        s
    }

    fn touch(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.since_ms.store(ms, Ordering::SeqCst);
    }

    /// When it connected or last became idle (finished its handshake or its last requests):
    /// where its idle time-out counts from.
    pub(crate) fn since(&self) -> Instant {
        self.epoch + Duration::from_millis(self.since_ms.load(Ordering::SeqCst))
    }

    /// The handshake is over: idle from now. False if the client was evicted meanwhile.
    pub(crate) fn entered_transmission(&self) -> bool {
        self.touch();
        self.phase
            .compare_exchange(HANDSHAKE, IDLE, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Requests are about to be executed: busy until [`end`](Self::end). False if the client
    /// was evicted (nothing may be executed then).
    pub(crate) fn begin(&self) -> bool {
        let ok = self
            .phase
            .compare_exchange(IDLE, BUSY, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok();
        if ok {
            self.used.store(true, Ordering::SeqCst);
        }
        ok
    }

    /// The requests were answered: idle from now.
    pub(crate) fn end(&self) {
        self.touch();
        let _ = self
            .phase
            .compare_exchange(BUSY, IDLE, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Its replies have waited unread for [`STALL`]: it may be evicted until
    /// [`unstall`](Self::unstall).
    pub(crate) fn stall(&self) {
        self.touch();
        let _ = self
            .phase
            .compare_exchange(BUSY, STALLED, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Its replies were taken: busy again. False if it was evicted while stalled (nothing
    /// more may be executed).
    pub(crate) fn unstall(&self) -> bool {
        match self
            .phase
            .compare_exchange(STALLED, BUSY, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(_) => true,
            Err(now) => now != GONE,
        }
    }

    /// Takes the slot from a client in its handshake, idle or stalled; false if it is busy or
    /// gone.
    pub(crate) fn evict(&self) -> bool {
        [HANDSHAKE, IDLE, STALLED].into_iter().any(|from| {
            self.phase
                .compare_exchange(from, GONE, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        })
    }

    /// Whether the slot was taken away (the connection is being closed).
    pub(crate) fn evicted(&self) -> bool {
        self.phase.load(Ordering::SeqCst) == GONE
    }

    fn state(&self) -> State {
        match self.phase.load(Ordering::SeqCst) {
            HANDSHAKE => State::Handshake,
            IDLE if self.used.load(Ordering::SeqCst) => State::Idle,
            IDLE => State::Unused,
            BUSY => State::Busy,
            STALLED => State::Stalled,
            _ => State::Gone,
        }
    }
}

/// A slot's state as the accept loop sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    /// In its handshake.
    Handshake,
    /// Past its handshake, no request yet.
    Unused,
    /// Executing requests, its replies unread for [`STALL`] or more.
    Stalled,
    /// Waiting for its next request.
    Idle,
    /// Executing requests: never evicted.
    Busy,
    /// Evicted or closed.
    Gone,
}

/// The limits a newcomer is admitted under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Caps {
    pub(crate) total: usize,
    pub(crate) per_source: usize,
}

/// What one held slot looks like to [`decide`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Held {
    pub(crate) source: Source,
    pub(crate) state: State,
    /// When it connected.
    pub(crate) born: Instant,
    /// How long it has been in its state from: when it connected (in its handshake or
    /// unused), last became idle or stalled.
    pub(crate) since: Instant,
}

impl Held {
    /// What `slot` of a client from `source` looks like now.
    pub(crate) fn of(source: Source, slot: &Slot) -> Held {
        let state = slot.state();
        Held {
            source,
            state,
            born: slot.born,
            since: match state {
                State::Idle | State::Stalled => slot.since(),
                _ => slot.born,
            },
        }
    }

    /// Whether a newcomer may take its slot.
    fn evictable(&self) -> bool {
        !matches!(self.state, State::Busy | State::Gone)
    }

    /// Its kind, the first key of the order of eviction: those that sent no request yet go
    /// first, then those stalled on their replies, then the idle ones.
    fn class(&self) -> u8 {
        match self.state {
            State::Handshake | State::Unused => 0,
            State::Stalled => 1,
            _ => 2,
        }
    }
}

/// Which of two evictable slots goes first, by [`Held::class`]: of those that sent no request
/// yet, the oldest (a newcomer, in its handshake, is the youngest of all); of the others, the
/// newest (a client established on its source outlives the connections opened after it).
fn first_to_go(a: &Held, b: &Held) -> std::cmp::Ordering {
    a.class().cmp(&b.class()).then_with(|| match a.class() {
        0 => a.born.cmp(&b.born),
        _ => b.born.cmp(&a.born),
    })
}

/// Why a newcomer was turned away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Its source holds its cap, every one of them executing requests.
    SourceBusy { held: usize, cap: usize },
    /// The export is full and every client is executing requests.
    AllBusy { held: usize },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::SourceBusy { held, cap } => write!(
                f,
                "its source holds {held} connection(s) (at most {cap}), all executing requests"
            ),
            Refusal::AllBusy { held } => write!(
                f,
                "{held} connection(s) held (the most allowed), all executing requests"
            ),
        }
    }
}

/// What to do with a newcomer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// There is room.
    Admit,
    /// Evict the client at this index of `held`, then admit.
    Evict(usize),
    /// Turn the newcomer away.
    Refuse(Refusal),
}

/// Decides on a newcomer from `source`, given the slots `held` (those gone are ignored).
pub(crate) fn decide(held: &[Held], source: Source, caps: Caps) -> Decision {
    let live = || {
        held.iter()
            .enumerate()
            .filter(|(_, h)| h.state != State::Gone)
    };
    let count = |s: Source| live().filter(|(_, h)| h.source == s).count();
    let total = live().count();
    let mine = count(source);
    // The victim: by class (one that sent no request yet, of any source, before a client that
    // did: attackers spread over many sources hold one slot each); within one, the largest
    // source's; then by age (first_to_go).
    let victim = |only: Option<Source>| {
        live()
            .filter(|(_, h)| h.evictable())
            .filter(|(_, h)| only.is_none_or(|s| h.source == s))
            .min_by(|(_, a), (_, b)| {
                a.class()
                    .cmp(&b.class())
                    .then_with(|| count(b.source).cmp(&count(a.source)))
                    .then_with(|| first_to_go(a, b))
            })
            .map(|(i, _)| i)
    };
    if mine >= caps.per_source.max(1) {
        return match victim(Some(source)) {
            Some(i) => Decision::Evict(i),
            None => Decision::Refuse(Refusal::SourceBusy {
                held: mine,
                cap: caps.per_source,
            }),
        };
    }
    if total >= caps.total.max(1) {
        return match victim(None) {
            Some(i) => Decision::Evict(i),
            None => Decision::Refuse(Refusal::AllBusy { held: total }),
        };
    }
    Decision::Admit
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(n: u8) -> Source {
        Source::Addr(IpAddr::from([192, 0, 2, n]))
    }

    /// A slot that connected `at` seconds after `t0`.
    fn held(source: Source, state: State, at: u64, t0: Instant) -> Held {
        Held {
            source,
            state,
            born: t0 + Duration::from_secs(at),
            since: t0 + Duration::from_secs(at),
        }
    }

    const CAPS: Caps = Caps {
        total: 4,
        per_source: 2,
    };

    #[test]
    fn a_newcomer_in_its_handshake_outlives_older_holders_that_sent_nothing() {
        let t0 = Instant::now();
        // The source is at its cap: an older holder past its handshake that never sent a
        // request goes, not the young connection still in its handshake.
        let h = [
            held(addr(1), State::Unused, 1, t0),
            held(addr(1), State::Handshake, 5, t0),
        ];
        assert_eq!(decide(&h, addr(1), CAPS), Decision::Evict(0));
    }

    #[test]
    fn room_admits_and_a_full_source_evicts_its_own_unfinished_first() {
        let t0 = Instant::now();
        assert_eq!(decide(&[], addr(1), CAPS), Decision::Admit);
        let h = [
            held(addr(1), State::Idle, 1, t0),
            held(addr(2), State::Handshake, 0, t0),
            held(addr(1), State::Handshake, 5, t0),
        ];
        // addr(1) is at its cap: its unfinished one goes, though the idle one is older, and
        // addr(2)'s older unfinished one is not touched.
        assert_eq!(decide(&h, addr(1), CAPS), Decision::Evict(2));
        assert_eq!(decide(&h, addr(2), CAPS), Decision::Admit);
    }

    #[test]
    fn idle_clients_go_newest_first_and_busy_ones_never() {
        let t0 = Instant::now();
        // The client established first outlives those opened after it, however long idle
        // (a kernel client under a quiet filesystem, connections opened to push it out).
        let h = [
            held(addr(1), State::Idle, 2, t0),
            held(addr(1), State::Idle, 3, t0),
        ];
        assert_eq!(decide(&h, addr(1), CAPS), Decision::Evict(1));
        // One that never sent a request goes before one that did, however long idle.
        let h = [
            held(addr(1), State::Idle, 0, t0),
            held(addr(1), State::Unused, 9, t0),
        ];
        assert_eq!(decide(&h, addr(1), CAPS), Decision::Evict(1));
        let h = [
            held(addr(1), State::Busy, 0, t0),
            held(addr(1), State::Busy, 1, t0),
        ];
        assert_eq!(
            decide(&h, addr(1), CAPS),
            Decision::Refuse(Refusal::SourceBusy { held: 2, cap: 2 })
        );
        // Gone slots hold nothing.
        let h = [
            held(addr(1), State::Gone, 0, t0),
            held(addr(1), State::Busy, 1, t0),
        ];
        assert_eq!(decide(&h, addr(1), CAPS), Decision::Admit);
    }

    #[test]
    fn stalled_clients_go_after_those_that_sent_nothing_and_before_idle_ones() {
        let t0 = Instant::now();
        let caps = Caps {
            total: 8,
            per_source: 4,
        };
        // An idle client established first; connections opened after it that sent requests
        // and do not read the replies (stalled), the newest first; one in its handshake.
        let mut h = vec![
            held(addr(1), State::Idle, 0, t0),
            held(addr(1), State::Stalled, 1, t0),
            held(addr(1), State::Stalled, 2, t0),
            held(addr(1), State::Handshake, 3, t0),
        ];
        assert_eq!(decide(&h, addr(1), caps), Decision::Evict(3));
        h[3].state = State::Gone;
        h.push(held(addr(1), State::Busy, 4, t0));
        assert_eq!(decide(&h, addr(1), caps), Decision::Evict(2));
        h[2].state = State::Gone;
        h.push(held(addr(1), State::Busy, 5, t0));
        assert_eq!(decide(&h, addr(1), caps), Decision::Evict(1));
        h[1].state = State::Gone;
        h.push(held(addr(1), State::Busy, 6, t0));
        // Only the idle one is left to evict: the others take their replies.
        assert_eq!(decide(&h, addr(1), caps), Decision::Evict(0));
        h[0].state = State::Busy;
        assert_eq!(
            decide(&h, addr(1), caps),
            Decision::Refuse(Refusal::SourceBusy { held: 4, cap: 4 })
        );
    }

    #[test]
    fn a_full_export_evicts_a_connection_that_sent_nothing_before_the_largest_sources_clients() {
        let t0 = Instant::now();
        // addr(1) holds the most, all of them clients that sent requests; addr(2) and addr(3)
        // one connection each that sent none yet (attackers spread over many addresses).
        let h = [
            held(addr(1), State::Idle, 0, t0),
            held(addr(1), State::Idle, 1, t0),
            held(addr(2), State::Unused, 2, t0),
            held(addr(3), State::Handshake, 3, t0),
        ];
        assert_eq!(decide(&h, addr(4), CAPS), Decision::Evict(2));
        // Stalled ones go before idle ones too, whatever their source's size.
        let h = [
            held(addr(1), State::Idle, 0, t0),
            held(addr(1), State::Idle, 1, t0),
            held(addr(2), State::Stalled, 2, t0),
            held(addr(3), State::Busy, 3, t0),
        ];
        assert_eq!(decide(&h, addr(4), CAPS), Decision::Evict(2));
    }

    #[test]
    fn an_ipv6_source_is_its_64_and_a_mapped_ipv4_address_the_ipv4_one() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff:1:2:3".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(Source::of_ip(a), Source::of_ip(b));
        assert_ne!(Source::of_ip(a), Source::of_ip(other));
        assert_eq!(Source::of_ip(a).to_string(), "2001:db8:1:2::/64");
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        assert_eq!(Source::of_ip(mapped), addr(7));
        assert_eq!(addr(7).to_string(), "192.0.2.7");
        // 64 connections from one /64, each from an address of its own, are one source.
        let caps = Caps {
            total: 64,
            per_source: 16,
        };
        let t0 = Instant::now();
        let h: Vec<Held> = (0..16u16)
            .map(|i| {
                let ip = IpAddr::from([0x2001, 0xdb8, 1, 2, 0, 0, 0, i + 1]);
                held(Source::of_ip(ip), State::Unused, u64::from(i), t0)
            })
            .collect();
        let next = Source::of_ip(IpAddr::from([0x2001, 0xdb8, 1, 2, 0, 0, 0, 99]));
        assert_eq!(decide(&h, next, caps), Decision::Evict(0));
    }

    #[test]
    fn a_full_export_evicts_from_the_source_holding_the_most() {
        let t0 = Instant::now();
        // addr(2) holds more slots than the others: its newest goes.
        let h = [
            held(addr(1), State::Idle, 6, t0),
            held(addr(2), State::Idle, 4, t0),
            held(addr(2), State::Idle, 5, t0),
            held(addr(3), State::Busy, 1, t0),
        ];
        assert_eq!(decide(&h, addr(4), CAPS), Decision::Evict(2));
        // Within equally large sources, unfinished before idle, then the oldest.
        let h = [
            held(addr(1), State::Idle, 0, t0),
            held(addr(2), State::Idle, 1, t0),
            held(addr(3), State::Handshake, 3, t0),
            held(addr(4), State::Handshake, 2, t0),
        ];
        assert_eq!(decide(&h, addr(5), CAPS), Decision::Evict(3));
        let all_busy = [
            held(addr(1), State::Busy, 0, t0),
            held(addr(2), State::Busy, 0, t0),
            held(addr(3), State::Busy, 0, t0),
            held(addr(4), State::Busy, 0, t0),
        ];
        assert_eq!(
            decide(&all_busy, addr(5), CAPS),
            Decision::Refuse(Refusal::AllBusy { held: 4 })
        );
    }

    #[test]
    fn a_slot_is_evicted_only_when_unfinished_or_idle() {
        let s = Slot::new(Instant::now());
        assert_eq!(s.state(), State::Handshake);
        assert!(s.evict(), "in its handshake");
        assert!(!s.entered_transmission(), "evicted during the handshake");
        assert!(s.evicted());
        assert_eq!(s.state(), State::Gone);
        let s = Slot::new(Instant::now());
        assert!(s.entered_transmission());
        assert_eq!(s.state(), State::Unused);
        assert!(s.begin());
        assert_eq!(s.state(), State::Busy);
        assert!(!s.evict(), "busy");
        s.end();
        assert_eq!(s.state(), State::Idle);
        assert!(s.evict(), "idle again");
        assert!(!s.begin(), "nothing starts after an eviction");
        assert!(!s.evict(), "once");
        // Stalled on its replies: evictable until it took them.
        let s = Slot::new(Instant::now());
        assert!(s.entered_transmission());
        assert!(s.begin());
        s.stall();
        assert_eq!(s.state(), State::Stalled);
        assert!(s.unstall(), "its replies taken");
        assert_eq!(s.state(), State::Busy);
        assert!(!s.evict(), "busy again");
        s.stall();
        assert!(s.evict(), "stalled");
        assert!(
            !s.unstall(),
            "evicted while stalled: nothing more is executed"
        );
        assert!(s.evicted());
        s.end();
        assert!(s.evicted(), "the end of its requests does not make it idle");
    }
}
