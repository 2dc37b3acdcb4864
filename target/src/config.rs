//! The daemon's TOML configuration, parsed and validated into a [`Config`] that is always usable.
//!
//! Every problem is reported with the key it is about, e.g.
//! `subsystem[1].namespace[0].size: "12X" is not a size`. Relative paths (namespace backing
//! files, key files) are taken relative to the configuration file's directory.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};

use rpma_common::proto::auth::Psk;
use rpma_common::proto::nqn::Nqn;
use rpma_common::units::parse_size;

mod admission;
mod error;
mod raw;
mod simulation;

use admission::admission;
pub use admission::{admission_changes, Admission};
use error::{int_in, invalid};
pub use error::{ConfigError, Result};
use raw::{RawConfig, RawListener};

/// rpma's own default port (NVMe-oF's 4420 belongs to real NVMe-oF targets).
pub const DEFAULT_PORT: u16 = 7420;
/// The default port of an `nvme-tcp://` listener: NVMe/TCP's by convention (8009 is the
/// discovery convention; any port serves both here).
pub const NVME_TCP_DEFAULT_PORT: u16 = 4420;
/// Where the control socket lives unless the configuration says otherwise.
pub const DEFAULT_CONTROL_SOCKET: &str = "/run/rpma-target/control.sock";
/// The state file's name beside the configuration file unless `state_file` says otherwise.
pub const DEFAULT_STATE_FILE: &str = "rpma-target.state";
/// Keep-alive period when the configuration does not set one (as Linux NVMe-oF's default KATO).
pub const DEFAULT_KEEP_ALIVE_MS: u32 = 5000;

/// A transport, as named by a URL's scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Userspace iWARP over TCP.
    Tcp,
    /// libibverbs/librdmacm.
    Rdma,
    /// NVMe over TCP: the stock host (`nvme connect -t tcp`) for the same subsystems
    /// ([`crate::nvme_tcp`]).
    #[serde(rename = "nvme-tcp")]
    NvmeTcp,
}

impl Transport {
    /// The URL scheme.
    pub fn scheme(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Rdma => "rdma",
            Transport::NvmeTcp => "nvme-tcp",
        }
    }

    /// Whether the transport is one of rpma's own fabrics (served by `rpma-initiator`), not
    /// NVMe/TCP.
    pub fn is_fabric(self) -> bool {
        self != Transport::NvmeTcp
    }
}

/// A listen address: `tcp://host:port`, `rdma://host:port` (port defaults to [`DEFAULT_PORT`]) or
/// `nvme-tcp://host:port` (port defaults to [`NVME_TCP_DEFAULT_PORT`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ListenUrl {
    /// The transport.
    pub transport: Transport,
    /// Host name or address (IPv6 without brackets).
    pub host: String,
    /// Port.
    pub port: u16,
}

impl ListenUrl {
    /// Parses a listen URL.
    ///
    /// # Errors
    /// A description of the problem (the caller adds the key).
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        let (scheme, rest) = s
            .split_once("://")
            .ok_or_else(|| format!("{s:?} is not a URL (expected tcp://host:port)"))?;
        let transport = match scheme {
            "tcp" => Transport::Tcp,
            "rdma" => Transport::Rdma,
            "nvme-tcp" => Transport::NvmeTcp,
            other => {
                return Err(format!(
                    "{s:?}: unknown transport {other:?} (tcp, rdma or nvme-tcp)"
                ))
            }
        };
        if rest.contains(['/', '?', '#', '@']) {
            return Err(format!(
                "{s:?}: a listen URL has no path, query or user part"
            ));
        }
        let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
            let (h, after) = v6
                .split_once(']')
                .ok_or_else(|| format!("{s:?}: unterminated [IPv6] address"))?;
            if h.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(format!("{s:?}: {h:?} is not an IPv6 address"));
            }
            let port = match after {
                "" => None,
                p => Some(
                    p.strip_prefix(':')
                        .ok_or_else(|| format!("{s:?}: junk after the IPv6 address"))?,
                ),
            };
            (h, port)
        } else {
            match rest.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (rest, None),
            }
        };
        let host_ok = !host.is_empty()
            && (host.contains(':')
                || host.split('.').all(|l| {
                    !l.is_empty() && l.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
                }));
        if !host_ok {
            return Err(format!("{s:?}: {host:?} is not a host name or address"));
        }
        let port = match port {
            None if transport == Transport::NvmeTcp => NVME_TCP_DEFAULT_PORT,
            None => DEFAULT_PORT,
            Some(p) => match p.parse::<u16>() {
                Ok(p) if p != 0 => p,
                _ => return Err(format!("{s:?}: {p:?} is not a port (1-65535)")),
            },
        };
        Ok(ListenUrl {
            transport,
            host: host.to_owned(),
            port,
        })
    }
}

impl fmt::Display for ListenUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = self.transport.scheme();
        if self.host.contains(':') {
            write!(f, "{scheme}://[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{scheme}://{}:{}", self.host, self.port)
        }
    }
}

/// A listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listener {
    /// Where.
    pub url: ListenUrl,
    /// The operator declares that RDMA Writes reach persistence without a cache write-back on the
    /// target (DDIO off, or eADR): APM is then offered on `rdma`. Meaningless on `tcp`, where the
    /// placement engine itself makes APM valid.
    pub direct_write_to_pmem: bool,
}

/// An allowed host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// Its NQN.
    pub nqn: Nqn,
    /// Its key file, if it must authenticate.
    pub psk_file: Option<PathBuf>,
    /// The key loaded from that file.
    pub psk: Option<Psk>,
}

/// A namespace's key: its subsystem and namespace id.
pub type NsKey = (Nqn, u32);

/// A namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    /// 1..0xFFFFFFFE.
    pub nsid: u32,
    /// Backing store.
    pub path: PathBuf,
    /// Size; `None` for an existing file or a devdax device whose size is taken as it is.
    pub size: Option<u64>,
    /// 512 or 4096.
    pub block_size: u32,
    /// Remote writes refused.
    pub read_only: bool,
    /// Treat as DAX though it is not (testing/benchmarking on DRAM).
    pub force_dax: bool,
    /// An existing file smaller than `size` is grown to it (at start-up and on reload alike);
    /// without it such a file is refused. Never shrunk either way.
    pub grow: bool,
    /// A dax namespace is mapped in ahead of use when it is opened (default true): no page
    /// fault on the first Write to each page, for page tables and start-up time.
    pub prefault: bool,
    /// Tests and debugging only: run the namespace under the power-loss simulation
    /// (docs/reliability.md); its domain is labelled so everywhere it is shown.
    pub power_loss_simulation: Option<rpma_common::pmem::Simulation>,
}

/// A subsystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subsystem {
    /// Its NQN.
    pub nqn: Nqn,
    /// Any host may connect (hosts listed with a key must still authenticate).
    pub allow_any_host: bool,
    /// Allowed hosts.
    pub hosts: Vec<Host>,
    /// Its namespaces, by ascending nsid.
    pub namespaces: Vec<Namespace>,
}

/// A validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Listeners.
    pub listeners: Vec<Listener>,
    /// The control socket's path.
    pub control_socket: PathBuf,
    /// Where failed namespaces are remembered across restarts ([`crate::failures`]); beside
    /// the configuration file by default. Changing it needs a restart.
    pub state_file: PathBuf,
    /// Keep-alive period (ms).
    pub keep_alive_ms: u32,
    /// Number of poll loops.
    pub poll_loops: u32,
    /// Most admitted I/O sessions at once (discovery sessions and connections still in their
    /// handshake have budgets of their own: [`Admission`]).
    pub max_connections: u32,
    /// Largest queue depth a host may ask for.
    pub max_queue_depth: u32,
    /// Offer MPA CRC32c on `tcp`.
    pub crc: bool,
    /// Serve the discovery subsystem.
    pub discovery: bool,
    /// The budgets of connections that are not admitted sessions.
    pub admission: Admission,
    /// Where the Prometheus metrics endpoint listens (`metrics_listen = "127.0.0.1:9420"`);
    /// None: no endpoint (the default). A reload applies a change.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Subsystems.
    pub subsystems: Vec<Subsystem>,
}

/// The control socket a configuration file names, without validating the rest (so that
/// `rpma-target status --config` works for a user who may not read the key files).
///
/// # Errors
/// [`ConfigError::Read`], [`ConfigError::Parse`], [`ConfigError::Invalid`] if the key is not a
/// string.
pub fn control_socket_of(path: &Path) -> Result<PathBuf> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    let table: toml::Table = toml::from_str(&text).map_err(|source| ConfigError::Parse {
        path: path.to_owned(),
        source,
    })?;
    let base = path.parent().unwrap_or(Path::new("."));
    match table.get("control_socket") {
        None => Ok(PathBuf::from(DEFAULT_CONTROL_SOCKET)),
        Some(toml::Value::String(s)) => Ok(base.join(s)),
        Some(v) => Err(invalid("control_socket", format!("{v} is not a path"))),
    }
}

impl Config {
    /// The poll loops of the native listeners (`tcp://`, `rdma://`): `poll_loops`, started
    /// whatever the listeners.
    pub fn native_loops(&self) -> usize {
        self.poll_loops.max(1) as usize
    }

    /// The poll loops of the `nvme-tcp://` listeners: `poll_loops` more when there is one.
    pub fn nvme_loops(&self) -> usize {
        match self.listeners.iter().any(|l| !l.url.transport.is_fabric()) {
            true => self.native_loops(),
            false => 0,
        }
    }

    /// The flush services of the native loops: one each with a native listener, none
    /// without (the loops start, and never sync).
    pub fn native_flush_services(&self) -> usize {
        match self.listeners.iter().any(|l| l.url.transport.is_fabric()) {
            true => self.native_loops(),
            false => 0,
        }
    }

    /// The daemon's flush services, one per poll loop that may sync, numbered native loops
    /// first: a page-cache namespace opens its file once for each (target/src/flusher.rs).
    /// Both counts need a restart to change, so the namespaces a reload opens use the start's
    /// number.
    pub fn flush_services(&self) -> usize {
        self.native_flush_services() + self.nvme_loops()
    }

    /// Reads and validates a configuration file.
    ///
    /// # Errors
    /// [`ConfigError::Read`], [`ConfigError::Parse`], and those of [`Config::from_toml`].
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        Self::parse(&text, base).map_err(|e| match e {
            ConfigError::Parse { source, .. } => ConfigError::Parse {
                path: path.to_owned(),
                source,
            },
            // An operator with several configurations (a check-config of another file, a
            // reload) is told which file says it.
            e => ConfigError::InFile {
                path: path.to_owned(),
                source: Box::new(e),
            },
        })
    }

    /// Validates configuration text; relative paths are taken relative to `base`.
    ///
    /// # Errors
    /// [`ConfigError::Parse`] (syntax, types, unknown keys), [`ConfigError::Invalid`] (ranges,
    /// sizes, block sizes, duplicates, URLs, an unreachable subsystem), [`ConfigError::Nqn`],
    /// [`ConfigError::Psk`].
    pub fn from_toml(text: &str, base: &Path) -> Result<Config> {
        Self::parse(text, base)
    }

    fn parse(text: &str, base: &Path) -> Result<Config> {
        let raw: RawConfig = toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: PathBuf::from("<config>"),
            source,
        })?;
        let global_dwp = raw.direct_write_to_pmem.unwrap_or(false);
        let admission = admission(&raw)?;
        let metrics_listen = raw
            .metrics_listen
            .as_deref()
            .map(|a| {
                a.parse::<std::net::SocketAddr>().map_err(|_| {
                    invalid(
                        "metrics_listen",
                        format!("{a:?} is not an address and port (e.g. \"127.0.0.1:9420\")"),
                    )
                })
            })
            .transpose()?;
        let mut listeners = Vec::new();
        let mut seen_urls = HashSet::new();
        for (i, v) in raw.listen.into_iter().enumerate() {
            let key = format!("listen[{i}]");
            let (url, dwp) = match v {
                toml::Value::String(s) => (s, None),
                toml::Value::Table(t) => {
                    let l: RawListener = toml::Value::Table(t)
                        .try_into()
                        .map_err(|e: toml::de::Error| invalid(&key, e.message().to_owned()))?;
                    (l.url, l.direct_write_to_pmem)
                }
                other => {
                    return Err(invalid(
                        key,
                        format!(
                            "expected a URL string or {{ url = ... }}, found {}",
                            other.type_str()
                        ),
                    ))
                }
            };
            let url = ListenUrl::parse(&url).map_err(|p| invalid(&key, p))?;
            if dwp.is_some() && url.transport != Transport::Rdma {
                return Err(invalid(
                    format!("{key}.direct_write_to_pmem"),
                    "only meaningful for rdma:// listeners (on tcp APM is always valid where durable)",
                ));
            }
            if !seen_urls.insert(url.clone()) {
                return Err(invalid(key, format!("{url} is listed twice")));
            }
            listeners.push(Listener {
                direct_write_to_pmem: dwp.unwrap_or(global_dwp && url.transport == Transport::Rdma),
                url,
            });
        }
        if listeners.is_empty() {
            listeners.push(Listener {
                url: ListenUrl {
                    transport: Transport::Tcp,
                    host: "127.0.0.1".into(),
                    port: DEFAULT_PORT,
                },
                direct_write_to_pmem: false,
            });
        }

        let mut subsystems = Vec::new();
        let mut seen_nqns = HashSet::new();
        let mut seen_paths = HashSet::new();
        for (si, rs) in raw.subsystem.into_iter().enumerate() {
            let skey = format!("subsystem[{si}]");
            let nqn = Nqn::new(rs.nqn).map_err(|source| ConfigError::Nqn {
                key: format!("{skey}.nqn"),
                source,
            })?;
            if nqn.is_discovery() {
                return Err(invalid(
                    format!("{skey}.nqn"),
                    "the discovery NQN is reserved (use discovery = true)",
                ));
            }
            if !seen_nqns.insert(nqn.clone()) {
                return Err(invalid(
                    format!("{skey}.nqn"),
                    format!("{nqn} is defined twice"),
                ));
            }
            let mut hosts = Vec::new();
            let mut seen_hosts = HashSet::new();
            for (hi, rh) in rs.hosts.into_iter().enumerate() {
                let hkey = format!("{skey}.hosts[{hi}]");
                let hnqn = Nqn::new(rh.nqn).map_err(|source| ConfigError::Nqn {
                    key: format!("{hkey}.nqn"),
                    source,
                })?;
                if !seen_hosts.insert(hnqn.clone()) {
                    return Err(invalid(
                        format!("{hkey}.nqn"),
                        format!("{hnqn} is listed twice"),
                    ));
                }
                let psk_file = rh.psk_file.map(|p| base.join(p));
                let psk = psk_file
                    .as_deref()
                    .map(Psk::from_file)
                    .transpose()
                    .map_err(|source| ConfigError::Psk {
                        key: format!("{hkey}.psk_file"),
                        source,
                    })?;
                hosts.push(Host {
                    nqn: hnqn,
                    psk_file,
                    psk,
                });
            }
            if !rs.allow_any_host && hosts.is_empty() {
                return Err(invalid(
                    format!("{skey}.hosts"),
                    "no host may connect: list hosts or set allow_any_host = true",
                ));
            }
            let mut namespaces = Vec::new();
            let mut seen_nsids = HashSet::new();
            for (ni, rn) in rs.namespace.into_iter().enumerate() {
                let nkey = format!("{skey}.namespace[{ni}]");
                if rn.nsid < 1 || rn.nsid > 0xFFFF_FFFE {
                    return Err(invalid(
                        format!("{nkey}.nsid"),
                        format!("{} is not a namespace id (1..=4294967294)", rn.nsid),
                    ));
                }
                let nsid = rn.nsid as u32;
                if !seen_nsids.insert(nsid) {
                    return Err(invalid(
                        format!("{nkey}.nsid"),
                        format!("nsid {nsid} is used twice"),
                    ));
                }
                let block_size = match rn.block_size.unwrap_or(4096) {
                    b @ (512 | 4096) => b as u32,
                    b => {
                        return Err(invalid(
                            format!("{nkey}.block_size"),
                            format!("{b} is not a block size (512 or 4096)"),
                        ))
                    }
                };
                let size = match rn.size {
                    None => None,
                    Some(toml::Value::Integer(n)) if n > 0 => Some(n as u64),
                    Some(toml::Value::String(s)) => match parse_size(&s) {
                        Ok(n) if n > 0 => Some(n),
                        _ => {
                            return Err(invalid(
                                format!("{nkey}.size"),
                                format!("{s:?} is not a size"),
                            ))
                        }
                    },
                    Some(v) => {
                        return Err(invalid(
                            format!("{nkey}.size"),
                            format!("{v} is not a size"),
                        ))
                    }
                };
                if let Some(size) = size {
                    if size % u64::from(block_size) != 0 {
                        return Err(invalid(
                            format!("{nkey}.size"),
                            format!("{size} is not a multiple of the block size {block_size}"),
                        ));
                    }
                }
                if rn.path.as_os_str().is_empty() {
                    return Err(invalid(format!("{nkey}.path"), "empty path"));
                }
                let path = base.join(&rn.path);
                let canonical = path.canonicalize().unwrap_or_else(|_| path.clone());
                if !seen_paths.insert(canonical) {
                    return Err(invalid(
                        format!("{nkey}.path"),
                        format!("{} backs another namespace already", path.display()),
                    ));
                }
                namespaces.push(Namespace {
                    nsid,
                    path,
                    size,
                    block_size,
                    read_only: rn.read_only,
                    force_dax: rn.force_dax,
                    grow: rn.grow,
                    prefault: rn.prefault.unwrap_or(true),
                    power_loss_simulation: simulation::simulation(
                        &format!("{nkey}.power_loss_simulation"),
                        rn.power_loss_simulation,
                    )?,
                });
            }
            namespaces.sort_by_key(|n| n.nsid);
            subsystems.push(Subsystem {
                nqn,
                allow_any_host: rs.allow_any_host,
                hosts,
                namespaces,
            });
        }

        let config = Config {
            listeners,
            control_socket: raw
                .control_socket
                .map(|p| base.join(p))
                .unwrap_or_else(|| PathBuf::from(DEFAULT_CONTROL_SOCKET)),
            state_file: match raw.state_file {
                Some(p) if p.as_os_str().is_empty() => {
                    return Err(invalid("state_file", "empty path"))
                }
                Some(p) => base.join(p),
                None => base.join(DEFAULT_STATE_FILE),
            },
            keep_alive_ms: int_in(
                "keep_alive_ms",
                raw.keep_alive_ms,
                DEFAULT_KEEP_ALIVE_MS,
                100,
                3_600_000,
            )?,
            poll_loops: int_in("poll_loops", raw.poll_loops, 1, 1, 64)?,
            max_connections: int_in("max_connections", raw.max_connections, 64, 1, 65_535)?,
            max_queue_depth: int_in("max_queue_depth", raw.max_queue_depth, 128, 1, 65_535)?,
            crc: raw.crc.unwrap_or(true),
            discovery: raw.discovery.unwrap_or(true),
            admission,
            metrics_listen,
            subsystems,
        };
        Ok(config)
    }
}

#[cfg(test)]
mod tests;
