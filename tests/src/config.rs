//! A target configuration built in code: top-level settings, subsystems, their hosts and
//! namespaces, rendered as the TOML `rpma-target` reads ([`Target::start`](crate::Target::start)
//! adds the listener and the control socket).

use std::fmt;

use crate::Shm;

/// Top-level settings and subsystems; its `Display` is the configuration's text.
#[derive(Debug, Clone, Default)]
pub struct Config {
    top: Vec<String>,
    subsystems: Vec<Subsystem>,
}

impl Config {
    /// No settings, no subsystem.
    pub fn new() -> Config {
        Config::default()
    }

    /// A top-level line, e.g. `keep_alive_ms = 500` (before every subsystem).
    pub fn set(mut self, line: &str) -> Config {
        self.top.push(line.to_owned());
        self
    }

    /// Adds a subsystem.
    pub fn subsystem(mut self, s: Subsystem) -> Config {
        self.subsystems.push(s);
        self
    }
}

impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for l in &self.top {
            writeln!(f, "{l}")?;
        }
        for s in &self.subsystems {
            write!(f, "\n{s}")?;
        }
        Ok(())
    }
}

/// A `[[subsystem]]` table with its hosts and namespaces.
#[derive(Debug, Clone)]
pub struct Subsystem {
    nqn: String,
    any_host: bool,
    hosts: Vec<(String, Option<String>)>,
    namespaces: Vec<Namespace>,
}

impl Subsystem {
    /// Subsystem `nqn`, no host, no namespace.
    pub fn new(nqn: &str) -> Subsystem {
        Subsystem {
            nqn: nqn.to_owned(),
            any_host: false,
            hosts: Vec::new(),
            namespaces: Vec::new(),
        }
    }

    /// `allow_any_host = true`.
    pub fn any_host(mut self) -> Subsystem {
        self.any_host = true;
        self
    }

    /// Allows host `nqn` without a key.
    pub fn host(mut self, nqn: &str) -> Subsystem {
        self.hosts.push((nqn.to_owned(), None));
        self
    }

    /// Allows host `nqn` with the key in `psk_file` (relative to the config's directory).
    pub fn keyed_host(mut self, nqn: &str, psk_file: &str) -> Subsystem {
        self.hosts.push((nqn.to_owned(), Some(psk_file.to_owned())));
        self
    }

    /// Adds a namespace.
    pub fn namespace(mut self, ns: Namespace) -> Subsystem {
        self.namespaces.push(ns);
        self
    }

    /// Adds namespaces.
    pub fn namespaces(mut self, ns: impl IntoIterator<Item = Namespace>) -> Subsystem {
        self.namespaces.extend(ns);
        self
    }
}

impl fmt::Display for Subsystem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "[[subsystem]]\nnqn = \"{}\"", self.nqn)?;
        if self.any_host {
            writeln!(f, "allow_any_host = true")?;
        }
        if !self.hosts.is_empty() {
            let hosts: Vec<String> = self
                .hosts
                .iter()
                .map(|(nqn, psk)| match psk {
                    Some(p) => format!("{{ nqn = \"{nqn}\", psk_file = \"{p}\" }}"),
                    None => format!("{{ nqn = \"{nqn}\" }}"),
                })
                .collect();
            writeln!(f, "hosts = [{}]", hosts.join(", "))?;
        }
        for ns in &self.namespaces {
            write!(f, "{ns}")?;
        }
        Ok(())
    }
}

/// A `[[subsystem.namespace]]` table.
#[derive(Debug, Clone)]
pub struct Namespace {
    lines: Vec<String>,
}

impl Namespace {
    /// Namespace `nsid` on `path` (relative to the config's directory, or absolute) of `size`
    /// (e.g. `"1MiB"`).
    pub fn new(nsid: u32, path: &str, size: &str) -> Namespace {
        Namespace {
            lines: vec![
                format!("nsid = {nsid}"),
                format!("path = \"{path}\""),
                format!("size = \"{size}\""),
            ],
        }
    }

    /// Namespace `nsid` on an existing `path` taken at its size (a devdax device, a file
    /// made beforehand).
    pub fn existing(nsid: u32, path: &str) -> Namespace {
        Namespace {
            lines: vec![format!("nsid = {nsid}"), format!("path = \"{path}\"")],
        }
    }

    /// `read_only = true`.
    pub fn read_only(self) -> Namespace {
        self.set("read_only = true")
    }

    /// `block_size = N`.
    pub fn block_size(self, n: u32) -> Namespace {
        self.set(&format!("block_size = {n}"))
    }

    /// `force_dax = true`.
    pub fn force_dax(self) -> Namespace {
        self.set("force_dax = true")
    }

    /// `power_loss_simulation = { SETTINGS }` (tests only: docs/reliability.md), e.g.
    /// `"eviction_percent = 0"`; `""` for the defaults.
    pub fn power_loss_simulation(self, settings: &str) -> Namespace {
        self.set(&format!("power_loss_simulation = {{ {settings} }}"))
    }

    /// Any other `key = value` line.
    pub fn set(mut self, line: &str) -> Namespace {
        self.lines.push(line.to_owned());
        self
    }
}

impl Namespace {
    /// Whether the namespace is a file beside the configuration (a relative path), which the
    /// rdma runs on a device that cannot register file pages declare `force_dax` on a tmpfs
    /// scratch ([`Transport::file_pages_pinned`](crate::Transport::file_pages_pinned)).
    fn pinned_on_rdma(&self) -> bool {
        let relative = self.lines.iter().any(|l| {
            l.strip_prefix("path = \"")
                .is_some_and(|p| !p.starts_with('/'))
        });
        relative
            && !self.lines.iter().any(|l| l.starts_with("force_dax"))
            && crate::Transport::current().file_pages_pinned()
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "[[subsystem.namespace]]")?;
        for l in &self.lines {
            writeln!(f, "{l}")?;
        }
        if self.pinned_on_rdma() {
            writeln!(f, "force_dax = true")?;
        }
        Ok(())
    }
}

/// The four namespaces the initiator tests use: nsid 1 page-cache 8 MiB (`ns1`); 2 read-only
/// 1 MiB of `ns2_block_size` blocks (`ns2`); 3 volatile 1 MiB on `shm`; 4 dax (forced) 2 MiB
/// on a file (`ns4`).
pub fn four_namespaces(shm: &Shm, ns2_block_size: u32) -> [Namespace; 4] {
    [
        Namespace::new(1, "ns1", "8MiB"),
        Namespace::new(2, "ns2", "1MiB")
            .block_size(ns2_block_size)
            .read_only(),
        Namespace::new(3, shm.path(), "1MiB"),
        Namespace::new(4, "ns4", "2MiB").force_dax(),
    ]
}

/// `config` without the `[[subsystem.namespace]]` table of `nsid` (the first one), for a
/// reload that removes it.
pub fn without_namespace(config: &str, nsid: u32) -> String {
    let mut out = String::new();
    let mut table = String::new();
    let mut dropped = false;
    let flush = |table: &mut String, out: &mut String, dropped: &mut bool| {
        let is_it = table.starts_with("[[subsystem.namespace]]")
            && table.lines().any(|l| l.trim() == format!("nsid = {nsid}"));
        if is_it && !*dropped {
            *dropped = true;
        } else {
            out.push_str(table);
        }
        table.clear();
    };
    for line in config.lines() {
        if line.starts_with('[') {
            flush(&mut table, &mut out, &mut dropped);
        }
        table.push_str(line);
        table.push('\n');
    }
    flush(&mut table, &mut out, &mut dropped);
    out
}
