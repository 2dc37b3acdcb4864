//! The SIGHUP reload's diff: what changed between two validated configurations. Pure, so the
//! daemon's reload is "diff, then apply" and only what the diff names is touched.

use std::collections::BTreeMap;

use rpma_common::proto::nqn::Nqn;

use crate::config::{Config, Host, Namespace, NsKey, Subsystem};

/// The difference between an old and a new configuration.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ConfigDiff {
    /// Subsystems only in the new configuration.
    pub subsystems_added: Vec<Nqn>,
    /// Subsystems only in the old one.
    pub subsystems_removed: Vec<Nqn>,
    /// Subsystems in both whose `allow_any_host` changed.
    pub subsystems_changed: Vec<Nqn>,
    /// Namespaces only in the new configuration (including those of added subsystems).
    pub namespaces_added: Vec<NsKey>,
    /// Namespaces only in the old one (including those of removed subsystems).
    pub namespaces_removed: Vec<NsKey>,
    /// Namespaces in both with a different path, size, block size, read-only or force_dax,
    /// and failed namespaces the reload reopens
    /// ([`NamespaceTable::reopen_failed`](crate::namespace::NamespaceTable::reopen_failed)).
    pub namespaces_changed: Vec<NsKey>,
    /// Failed namespaces an operator cleared (`rpma-target clear-failure`, never a reload):
    /// reopened healthy, their sessions closed so that the hosts see the new descriptor.
    pub namespaces_cleared: Vec<NsKey>,
    /// Namespaces a page of which the daemon found it could not read back since (never a
    /// reload: docs/persistence.md): their sessions are closed, so that their hosts see them
    /// unavailable and no NIC reaches their memory any more (on rdma, with on-demand paging, it
    /// would reach the zeros put in the page's place).
    pub namespaces_unreadable: Vec<NsKey>,
    /// Allowed hosts added: (subsystem, host).
    pub hosts_added: Vec<(Nqn, Nqn)>,
    /// Of the hosts added to a subsystem that was there before, those listed with a key: they
    /// must authenticate from now on, even under `allow_any_host`, which may have admitted them
    /// without one.
    pub hosts_added_with_key: Vec<(Nqn, Nqn)>,
    /// Allowed hosts removed: (subsystem, host).
    pub hosts_removed: Vec<(Nqn, Nqn)>,
    /// Hosts whose key (file or contents) changed: (subsystem, host).
    pub hosts_changed: Vec<(Nqn, Nqn)>,
    /// Settings a reload cannot change (they need a restart): their key names.
    pub needs_restart: Vec<&'static str>,
    /// Settings that take effect for new connections: their key names.
    pub settings_changed: Vec<&'static str>,
}

impl ConfigDiff {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        *self == ConfigDiff::default()
    }

    /// Whether anything but [`namespaces_unreadable`](Self::namespaces_unreadable) changed:
    /// what a discovery log shows (subsystems and their listeners) can have changed.
    pub fn changes_configuration(&self) -> bool {
        let mut d = self.clone();
        d.namespaces_unreadable.clear();
        !d.is_empty()
    }

    /// Whether a session of `host` on `subsystem` is affected (its subsystem or host entry was
    /// removed or changed, or an entry with a key was added for it: a session `allow_any_host`
    /// admitted without a key would keep rights its host must now prove). Namespace changes are
    /// handled per namespace by the caller.
    pub fn touches_session(&self, subsystem: &Nqn, host: &Nqn) -> bool {
        let pair = (subsystem.clone(), host.clone());
        self.subsystems_removed.contains(subsystem)
            || self.subsystems_changed.contains(subsystem)
            || self.hosts_removed.contains(&pair)
            || self.hosts_changed.contains(&pair)
            || self.hosts_added_with_key.contains(&pair)
    }

    /// Whether this reload added an entry for `host` on `subsystem` (a session of it let in by
    /// `allow_any_host` is a listed host's from now on; an entry with a key closes the session
    /// instead: [`touches_session`](Self::touches_session)).
    pub fn lists_now(&self, subsystem: &Nqn, host: &Nqn) -> bool {
        self.hosts_added
            .iter()
            .any(|(s, h)| s == subsystem && h == host)
    }

    /// A one-line summary for the log.
    pub fn summary(&self) -> String {
        if self.is_empty() {
            return "no changes".into();
        }
        let parts = [
            ("subsystems added", self.subsystems_added.len()),
            ("subsystems removed", self.subsystems_removed.len()),
            ("subsystems changed", self.subsystems_changed.len()),
            ("namespaces added", self.namespaces_added.len()),
            ("namespaces removed", self.namespaces_removed.len()),
            ("namespaces changed", self.namespaces_changed.len()),
            ("namespace failures cleared", self.namespaces_cleared.len()),
            ("hosts added", self.hosts_added.len()),
            ("hosts removed", self.hosts_removed.len()),
            ("hosts changed", self.hosts_changed.len()),
        ];
        let mut s: Vec<String> = parts
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(what, n)| format!("{n} {what}"))
            .collect();
        if !self.settings_changed.is_empty() {
            s.push(format!("changed: {}", self.settings_changed.join(", ")));
        }
        if !self.needs_restart.is_empty() {
            s.push(format!(
                "ignored until restart: {}",
                self.needs_restart.join(", ")
            ));
        }
        s.join("; ")
    }
}

fn by_nqn(c: &Config) -> BTreeMap<&Nqn, &Subsystem> {
    c.subsystems.iter().map(|s| (&s.nqn, s)).collect()
}

fn namespaces(s: &Subsystem) -> BTreeMap<u32, &Namespace> {
    s.namespaces.iter().map(|n| (n.nsid, n)).collect()
}

/// Whether two namespace entries describe the same namespace. `grow` alone is no change: it
/// only says what to do when the size changes; nor is `prefault`: it only says how the next
/// open maps it.
fn same_namespace(a: &Namespace, b: &Namespace) -> bool {
    let b = Namespace {
        grow: a.grow,
        prefault: a.prefault,
        ..b.clone()
    };
    *a == b
}

fn hosts(s: &Subsystem) -> BTreeMap<&Nqn, &Host> {
    s.hosts.iter().map(|h| (&h.nqn, h)).collect()
}

/// Computes what changed from `old` to `new`.
pub fn diff(old: &Config, new: &Config) -> ConfigDiff {
    let mut d = ConfigDiff::default();
    let (o, n) = (by_nqn(old), by_nqn(new));
    for (nqn, ns) in &n {
        match o.get(nqn) {
            None => {
                d.subsystems_added.push((*nqn).clone());
                d.namespaces_added
                    .extend(ns.namespaces.iter().map(|x| ((*nqn).clone(), x.nsid)));
                d.hosts_added
                    .extend(ns.hosts.iter().map(|h| ((*nqn).clone(), h.nqn.clone())));
            }
            Some(os) => {
                if os.allow_any_host != ns.allow_any_host {
                    d.subsystems_changed.push((*nqn).clone());
                }
                let (on, nn) = (namespaces(os), namespaces(ns));
                for (id, x) in &nn {
                    match on.get(id) {
                        None => d.namespaces_added.push(((*nqn).clone(), *id)),
                        Some(y) if !same_namespace(y, x) => {
                            d.namespaces_changed.push(((*nqn).clone(), *id))
                        }
                        Some(_) => {}
                    }
                }
                for id in on.keys().filter(|id| !nn.contains_key(id)) {
                    d.namespaces_removed.push(((*nqn).clone(), *id));
                }
                let (oh, nh) = (hosts(os), hosts(ns));
                for (h, x) in &nh {
                    match oh.get(h) {
                        None => {
                            let pair = ((*nqn).clone(), (*h).clone());
                            if x.psk_file.is_some() || x.psk.is_some() {
                                d.hosts_added_with_key.push(pair.clone());
                            }
                            d.hosts_added.push(pair);
                        }
                        Some(y) if y != x => d.hosts_changed.push(((*nqn).clone(), (*h).clone())),
                        Some(_) => {}
                    }
                }
                for h in oh.keys().filter(|h| !nh.contains_key(*h)) {
                    d.hosts_removed.push(((*nqn).clone(), (*h).clone()));
                }
            }
        }
    }
    for (nqn, os) in &o {
        if !n.contains_key(nqn) {
            d.subsystems_removed.push((*nqn).clone());
            d.namespaces_removed
                .extend(os.namespaces.iter().map(|x| ((*nqn).clone(), x.nsid)));
            d.hosts_removed
                .extend(os.hosts.iter().map(|h| ((*nqn).clone(), h.nqn.clone())));
        }
    }
    let restart = [
        ("listen", old.listeners != new.listeners),
        ("control_socket", old.control_socket != new.control_socket),
        ("state_file", old.state_file != new.state_file),
        ("poll_loops", old.poll_loops != new.poll_loops),
    ];
    d.needs_restart = restart
        .iter()
        .filter(|(_, c)| *c)
        .map(|(k, _)| *k)
        .collect();
    let settings = [
        ("keep_alive_ms", old.keep_alive_ms != new.keep_alive_ms),
        (
            "max_connections",
            old.max_connections != new.max_connections,
        ),
        (
            "max_queue_depth",
            old.max_queue_depth != new.max_queue_depth,
        ),
        ("crc", old.crc != new.crc),
        ("discovery", old.discovery != new.discovery),
        ("metrics_listen", old.metrics_listen != new.metrics_listen),
    ];
    d.settings_changed = settings
        .iter()
        .filter(|(_, c)| *c)
        .map(|(k, _)| *k)
        .collect();
    d.settings_changed.extend(crate::config::admission_changes(
        &old.admission,
        &new.admission,
    ));
    d
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const BASE: &str = r#"
listen = ["tcp://127.0.0.1:7420"]
[[subsystem]]
nqn = "nqn.2026-11.io.rpma:a"
hosts = [{ nqn = "nqn.2026-11.io.rpma:h1" }, { nqn = "nqn.2026-11.io.rpma:h2" }]
[[subsystem.namespace]]
nsid = 1
path = "a1"
size = "1MiB"
[[subsystem.namespace]]
nsid = 2
path = "a2"
size = "1MiB"
[[subsystem]]
nqn = "nqn.2026-11.io.rpma:b"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
path = "b1"
size = "1MiB"
"#;

    fn cfg(text: &str) -> Config {
        Config::from_toml(text, Path::new("/srv")).unwrap()
    }

    fn nqn(s: &str) -> Nqn {
        Nqn::new(format!("nqn.2026-11.io.rpma:{s}")).unwrap()
    }

    #[test]
    fn a_namespace_found_unreadable_changes_no_configuration() {
        let key = (Nqn::new("nqn.2026-12.io.rpma:x").unwrap(), 1);
        let d = ConfigDiff {
            namespaces_unreadable: vec![key.clone()],
            ..ConfigDiff::default()
        };
        assert!(!d.is_empty() && !d.changes_configuration());
        let d = ConfigDiff {
            namespaces_unreadable: vec![key.clone()],
            namespaces_cleared: vec![key],
            ..ConfigDiff::default()
        };
        assert!(d.changes_configuration());
    }

    #[test]
    fn identical_is_empty() {
        let d = diff(&cfg(BASE), &cfg(BASE));
        assert!(d.is_empty());
        assert_eq!(d.summary(), "no changes");
    }

    #[test]
    fn namespace_added_removed_changed() {
        let new = BASE
            .replace(
                "nsid = 2\npath = \"a2\"\nsize = \"1MiB\"",
                "nsid = 3\npath = \"a3\"\nsize = \"1MiB\"",
            )
            .replace(
                "path = \"b1\"\nsize = \"1MiB\"",
                "path = \"b1\"\nsize = \"2MiB\"",
            );
        let d = diff(&cfg(BASE), &cfg(&new));
        assert_eq!(d.namespaces_added, [(nqn("a"), 3)]);
        assert_eq!(d.namespaces_removed, [(nqn("a"), 2)]);
        assert_eq!(d.namespaces_changed, [(nqn("b"), 1)]);
        assert!(d.subsystems_added.is_empty() && d.hosts_added.is_empty());
        assert!(
            !d.touches_session(&nqn("a"), &nqn("h1")),
            "namespace changes are per namespace"
        );
        assert!(d.summary().contains("1 namespaces added"));
    }

    #[test]
    fn grow_alone_is_no_change() {
        let new = BASE.replace(
            "path = \"a1\"\nsize = \"1MiB\"",
            "path = \"a1\"\nsize = \"1MiB\"\ngrow = true",
        );
        assert!(new.contains("grow = true"));
        assert!(diff(&cfg(BASE), &cfg(&new)).is_empty());
        let grown = new.replace("size = \"1MiB\"\ngrow", "size = \"2MiB\"\ngrow");
        assert_eq!(
            diff(&cfg(BASE), &cfg(&grown)).namespaces_changed,
            [(nqn("a"), 1)]
        );
    }

    #[test]
    fn subsystem_added_and_removed_carry_their_namespaces_and_hosts() {
        let new = BASE.replace("nqn.2026-11.io.rpma:b", "nqn.2026-11.io.rpma:c");
        let d = diff(&cfg(BASE), &cfg(&new));
        assert_eq!(d.subsystems_added, [nqn("c")]);
        assert_eq!(d.subsystems_removed, [nqn("b")]);
        assert_eq!(d.namespaces_added, [(nqn("c"), 1)]);
        assert_eq!(d.namespaces_removed, [(nqn("b"), 1)]);
        assert!(d.touches_session(&nqn("b"), &nqn("anyone")));
        assert!(!d.touches_session(&nqn("a"), &nqn("h1")));
    }

    #[test]
    fn hosts_added_removed_changed() {
        let new = BASE.replace(
            r#"hosts = [{ nqn = "nqn.2026-11.io.rpma:h1" }, { nqn = "nqn.2026-11.io.rpma:h2" }]"#,
            r#"hosts = [{ nqn = "nqn.2026-11.io.rpma:h2" }, { nqn = "nqn.2026-11.io.rpma:h3" }]"#,
        );
        let d = diff(&cfg(BASE), &cfg(&new));
        assert_eq!(d.hosts_added, [(nqn("a"), nqn("h3"))]);
        assert_eq!(d.hosts_removed, [(nqn("a"), nqn("h1"))]);
        assert!(d.hosts_changed.is_empty());
        assert!(d.touches_session(&nqn("a"), &nqn("h1")));
        assert!(!d.touches_session(&nqn("a"), &nqn("h2")));
    }

    #[test]
    fn a_host_added_with_a_key_touches_its_sessions_one_without_does_not() {
        let open = BASE.replace(
            "allow_any_host = true",
            "allow_any_host = true\nhosts = [{ nqn = \"nqn.2026-11.io.rpma:h8\" }]",
        );
        let old = cfg(&open);
        // h9, admitted by allow_any_host without a key, is listed with one: it must now
        // authenticate, so its session is closed.
        let mut new = old.clone();
        let mut h9 = new.subsystems[1].hosts[0].clone();
        h9.nqn = nqn("h9");
        h9.psk_file = Some("/etc/rpma/h9.psk".into());
        new.subsystems[1].hosts.push(h9);
        let d = diff(&old, &new);
        assert_eq!(d.hosts_added, [(nqn("b"), nqn("h9"))]);
        assert_eq!(d.hosts_added_with_key, [(nqn("b"), nqn("h9"))]);
        assert!(d.touches_session(&nqn("b"), &nqn("h9")));
        assert!(!d.touches_session(&nqn("b"), &nqn("h8")));
        assert!(!d.touches_session(&nqn("a"), &nqn("h9")));
        // Listed without a key, it has the rights allow_any_host gave it: untouched.
        let mut new = old.clone();
        let mut h9 = new.subsystems[1].hosts[0].clone();
        h9.nqn = nqn("h9");
        new.subsystems[1].hosts.push(h9);
        let d = diff(&old, &new);
        assert_eq!(d.hosts_added, [(nqn("b"), nqn("h9"))]);
        assert!(d.hosts_added_with_key.is_empty());
        assert!(!d.touches_session(&nqn("b"), &nqn("h9")));
    }

    #[test]
    fn host_key_change_is_a_change() {
        let old = cfg(BASE);
        let mut new = old.clone();
        new.subsystems[0].hosts[0].psk_file = Some("/etc/rpma/h1.psk".into());
        let d = diff(&old, &new);
        assert_eq!(d.hosts_changed, [(nqn("a"), nqn("h1"))]);
        assert!(d.touches_session(&nqn("a"), &nqn("h1")));
    }

    #[test]
    fn allow_any_host_and_settings() {
        let new = BASE
            .replace(
                "allow_any_host = true",
                "allow_any_host = true\nhosts = [{ nqn = \"nqn.2026-11.io.rpma:h9\" }]",
            )
            .replacen("allow_any_host = true", "allow_any_host = false", 1);
        let new = format!("keep_alive_ms = 900\ncontrol_socket = \"/x.sock\"\n{new}");
        let d = diff(&cfg(BASE), &cfg(&new));
        assert_eq!(d.subsystems_changed, [nqn("b")]);
        assert_eq!(d.hosts_added, [(nqn("b"), nqn("h9"))]);
        assert_eq!(d.settings_changed, ["keep_alive_ms"]);
        assert_eq!(d.needs_restart, ["control_socket"]);
        assert!(d
            .summary()
            .contains("ignored until restart: control_socket"));
    }

    #[test]
    fn metrics_listen_is_reloaded_not_restarted() {
        let on = format!("metrics_listen = \"127.0.0.1:9420\"\n{BASE}");
        let d = diff(&cfg(BASE), &cfg(&on));
        assert_eq!(d.settings_changed, ["metrics_listen"]);
        assert!(d.needs_restart.is_empty());
        assert!(
            d.summary().contains("changed: metrics_listen"),
            "{}",
            d.summary()
        );
        assert!(diff(&cfg(&on), &cfg(&on)).is_empty());
    }
}
