//! The admission budgets: the [`Admission`] settings, their defaults, parsing and validation.

use super::error::{int_in, invalid, Result};
use super::raw::RawConfig;

/// The budgets that keep unauthenticated peers from crowding out allowed hosts: connections
/// that have not finished their Connect (and auth) and discovery sessions each draw on a pool
/// of their own, capped per source address, with deadlines of their own. When a pool is full,
/// a new connection takes the place of its oldest one (so an allowed host always gets its
/// turn); past its source's cap a new connection is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    /// Connections past MPA that have not been admitted or refused yet, all sources together.
    pub max_unadmitted: u32,
    /// The same, per source address.
    pub max_unadmitted_per_source: u32,
    /// How long a connection has from its MPA Request to the end of its Connect (and auth).
    pub handshake_timeout_ms: u32,
    /// Discovery sessions at once, all sources together.
    pub max_discovery: u32,
    /// The same, per source address.
    pub max_discovery_per_source: u32,
    /// Longest keep-alive period a discovery session may ask for.
    pub discovery_max_keep_alive_ms: u32,
    /// How long a discovery session lasts at most (then it is closed).
    pub discovery_timeout_ms: u32,
    /// At most one WARN per peer address in this period about refused or failed connections;
    /// one line per period counts the rest.
    pub refusal_log_period_ms: u32,
}

impl Default for Admission {
    fn default() -> Self {
        Admission {
            max_unadmitted: 64,
            max_unadmitted_per_source: 8,
            handshake_timeout_ms: 5000,
            max_discovery: 16,
            max_discovery_per_source: 4,
            discovery_max_keep_alive_ms: 10_000,
            discovery_timeout_ms: 60_000,
            refusal_log_period_ms: 60_000,
        }
    }
}

/// The admission keys whose values differ between `old` and `new` (for a reload's diff).
pub fn admission_changes(old: &Admission, new: &Admission) -> Vec<&'static str> {
    [
        ("max_unadmitted", old.max_unadmitted != new.max_unadmitted),
        (
            "max_unadmitted_per_source",
            old.max_unadmitted_per_source != new.max_unadmitted_per_source,
        ),
        (
            "handshake_timeout_ms",
            old.handshake_timeout_ms != new.handshake_timeout_ms,
        ),
        ("max_discovery", old.max_discovery != new.max_discovery),
        (
            "max_discovery_per_source",
            old.max_discovery_per_source != new.max_discovery_per_source,
        ),
        (
            "discovery_max_keep_alive_ms",
            old.discovery_max_keep_alive_ms != new.discovery_max_keep_alive_ms,
        ),
        (
            "discovery_timeout_ms",
            old.discovery_timeout_ms != new.discovery_timeout_ms,
        ),
        (
            "refusal_log_period_ms",
            old.refusal_log_period_ms != new.refusal_log_period_ms,
        ),
    ]
    .into_iter()
    .filter_map(|(k, changed)| changed.then_some(k))
    .collect()
}

/// The admission budgets of `raw`, each per-source cap at most its pool.
pub(super) fn admission(raw: &RawConfig) -> Result<Admission> {
    let d = Admission::default();
    let a = Admission {
        max_unadmitted: int_in(
            "max_unadmitted",
            raw.max_unadmitted,
            d.max_unadmitted,
            1,
            65_535,
        )?,
        max_unadmitted_per_source: int_in(
            "max_unadmitted_per_source",
            raw.max_unadmitted_per_source,
            d.max_unadmitted_per_source,
            1,
            65_535,
        )?,
        handshake_timeout_ms: int_in(
            "handshake_timeout_ms",
            raw.handshake_timeout_ms,
            d.handshake_timeout_ms,
            100,
            60_000,
        )?,
        max_discovery: int_in(
            "max_discovery",
            raw.max_discovery,
            d.max_discovery,
            1,
            65_535,
        )?,
        max_discovery_per_source: int_in(
            "max_discovery_per_source",
            raw.max_discovery_per_source,
            d.max_discovery_per_source,
            1,
            65_535,
        )?,
        discovery_max_keep_alive_ms: int_in(
            "discovery_max_keep_alive_ms",
            raw.discovery_max_keep_alive_ms,
            d.discovery_max_keep_alive_ms,
            100,
            3_600_000,
        )?,
        discovery_timeout_ms: int_in(
            "discovery_timeout_ms",
            raw.discovery_timeout_ms,
            d.discovery_timeout_ms,
            100,
            3_600_000,
        )?,
        refusal_log_period_ms: int_in(
            "refusal_log_period_ms",
            raw.refusal_log_period_ms,
            d.refusal_log_period_ms,
            1000,
            3_600_000,
        )?,
    };
    for (key, cap, pool, pool_key) in [
        (
            "max_unadmitted_per_source",
            a.max_unadmitted_per_source,
            a.max_unadmitted,
            "max_unadmitted",
        ),
        (
            "max_discovery_per_source",
            a.max_discovery_per_source,
            a.max_discovery,
            "max_discovery",
        ),
    ] {
        if cap > pool {
            return Err(invalid(
                key,
                format!("{cap} is more than {pool_key} ({pool})"),
            ));
        }
    }
    Ok(a)
}
