//! The configuration file as TOML gives it, before validation: every key optional where the
//! file may leave it out, integers wide enough to report an out-of-range value as such.

use std::path::PathBuf;

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) listen: Vec<toml::Value>,
    pub(super) control_socket: Option<PathBuf>,
    pub(super) state_file: Option<PathBuf>,
    pub(super) keep_alive_ms: Option<i64>,
    pub(super) poll_loops: Option<i64>,
    pub(super) max_connections: Option<i64>,
    pub(super) max_queue_depth: Option<i64>,
    pub(super) crc: Option<bool>,
    pub(super) direct_write_to_pmem: Option<bool>,
    pub(super) discovery: Option<bool>,
    pub(super) max_unadmitted: Option<i64>,
    pub(super) max_unadmitted_per_source: Option<i64>,
    pub(super) handshake_timeout_ms: Option<i64>,
    pub(super) max_discovery: Option<i64>,
    pub(super) max_discovery_per_source: Option<i64>,
    pub(super) discovery_max_keep_alive_ms: Option<i64>,
    pub(super) discovery_timeout_ms: Option<i64>,
    pub(super) refusal_log_period_ms: Option<i64>,
    pub(super) metrics_listen: Option<String>,
    #[serde(default)]
    pub(super) subsystem: Vec<RawSubsystem>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawListener {
    pub(super) url: String,
    pub(super) direct_write_to_pmem: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSubsystem {
    pub(super) nqn: String,
    #[serde(default)]
    pub(super) allow_any_host: bool,
    #[serde(default)]
    pub(super) hosts: Vec<RawHost>,
    #[serde(default)]
    pub(super) namespace: Vec<RawNamespace>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHost {
    pub(super) nqn: String,
    pub(super) psk_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawNamespace {
    pub(super) nsid: i64,
    pub(super) path: PathBuf,
    pub(super) size: Option<toml::Value>,
    pub(super) block_size: Option<i64>,
    #[serde(default)]
    pub(super) read_only: bool,
    #[serde(default)]
    pub(super) force_dax: bool,
    #[serde(default)]
    pub(super) grow: bool,
    pub(super) prefault: Option<bool>,
    pub(super) power_loss_simulation: Option<toml::Value>,
}
