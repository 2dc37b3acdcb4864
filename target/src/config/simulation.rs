//! The namespace key `power_loss_simulation` (tests and debugging only): `true`, or a table of
//! the simulation's settings. docs/reliability.md says what it simulates.

use rpma_common::pmem::Simulation;
use serde::Deserialize;

use super::error::{invalid, Result};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSimulation {
    seed: Option<i64>,
    eviction_percent: Option<i64>,
    eviction_interval_ms: Option<i64>,
    broken_persist: Option<bool>,
}

/// `power_loss_simulation` at `key`: absent or `false` is off, `true` the defaults
/// ([`Simulation::default`]), `{ seed, eviction_percent, eviction_interval_ms,
/// broken_persist }` each of them.
///
/// # Errors
/// [`ConfigError::Invalid`](super::ConfigError::Invalid) for another type, an unknown key, a
/// negative seed or a percentage past 100.
pub(super) fn simulation(key: &str, v: Option<toml::Value>) -> Result<Option<Simulation>> {
    let t = match v {
        None | Some(toml::Value::Boolean(false)) => return Ok(None),
        Some(toml::Value::Boolean(true)) => return Ok(Some(Simulation::default())),
        Some(toml::Value::Table(t)) => t,
        Some(other) => {
            return Err(invalid(
                key,
                format!(
                    "expected true, false or {{ seed, eviction_percent, eviction_interval_ms, \
                     broken_persist }}, found {}",
                    other.type_str()
                ),
            ))
        }
    };
    let r: RawSimulation = toml::Value::Table(t)
        .try_into()
        .map_err(|e: toml::de::Error| invalid(key, e.message().to_owned()))?;
    let d = Simulation::default();
    let seed = match r.seed {
        None => d.seed,
        Some(s) if s >= 0 => s as u64,
        Some(s) => return Err(invalid(format!("{key}.seed"), format!("{s} is negative"))),
    };
    let eviction_percent = match r.eviction_percent {
        None => d.eviction_percent,
        Some(p @ 0..=100) => p as u8,
        Some(p) => {
            return Err(invalid(
                format!("{key}.eviction_percent"),
                format!("{p} is not a percentage (0..=100)"),
            ))
        }
    };
    let eviction_interval_ms = match r.eviction_interval_ms {
        None => d.eviction_interval_ms,
        Some(ms @ 0..=60_000) => ms as u32,
        Some(ms) => {
            return Err(invalid(
                format!("{key}.eviction_interval_ms"),
                format!("{ms} is out of range (0..=60000)"),
            ))
        }
    };
    Ok(Some(Simulation {
        seed,
        eviction_percent,
        eviction_interval_ms,
        broken_persist: r.broken_persist.unwrap_or(d.broken_persist),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Option<Simulation>> {
        let t: toml::Table = toml::from_str(text).unwrap();
        simulation("ns.power_loss_simulation", t.get("v").cloned())
    }

    #[test]
    fn off_on_and_each_setting() {
        assert_eq!(parse("").unwrap(), None);
        assert_eq!(parse("v = false").unwrap(), None);
        assert_eq!(parse("v = true").unwrap(), Some(Simulation::default()));
        assert_eq!(
            parse(
                "v = { seed = 9, eviction_percent = 0, eviction_interval_ms = 5, \
                 broken_persist = true }"
            )
            .unwrap(),
            Some(Simulation {
                seed: 9,
                eviction_percent: 0,
                eviction_interval_ms: 5,
                broken_persist: true
            })
        );
        assert_eq!(
            parse("v = { seed = 3 }").unwrap(),
            Some(Simulation {
                seed: 3,
                ..Simulation::default()
            })
        );
    }

    #[test]
    fn bad_values_name_their_key() {
        let e = |t| parse(t).unwrap_err().to_string();
        assert_eq!(
            e("v = { eviction_percent = 101 }"),
            "ns.power_loss_simulation.eviction_percent: 101 is not a percentage (0..=100)"
        );
        assert_eq!(
            e("v = { eviction_interval_ms = 60001 }"),
            "ns.power_loss_simulation.eviction_interval_ms: 60001 is out of range (0..=60000)"
        );
        assert_eq!(
            e("v = { seed = -1 }"),
            "ns.power_loss_simulation.seed: -1 is negative"
        );
        assert!(
            e("v = 1").contains("expected true, false or"),
            "{}",
            e("v = 1")
        );
        let unknown = e("v = { evict = 3 }");
        assert!(
            unknown.starts_with("ns.power_loss_simulation: unknown field `evict`"),
            "{unknown}"
        );
    }
}
