use std::os::unix::fs::PermissionsExt;

use super::*;

const GOOD: &str = r#"
listen = ["tcp://127.0.0.1:7420", { url = "rdma://[::1]:7421", direct_write_to_pmem = true }]
control_socket = "ctl.sock"
keep_alive_ms = 2000
poll_loops = 2
max_connections = 8
max_queue_depth = 64
crc = false
discovery = false
max_unadmitted = 32
max_unadmitted_per_source = 4
handshake_timeout_ms = 3000
max_discovery = 8
max_discovery_per_source = 2
discovery_max_keep_alive_ms = 5000
discovery_timeout_ms = 20000
refusal_log_period_ms = 10000

[[subsystem]]
nqn = "nqn.2026-11.io.rpma:demo"
allow_any_host = false
hosts = [{ nqn = "nqn.2014-08.org.nvmexpress:uuid:0f8fad5b-d9cb-469f-a165-70867728950e", psk_file = "host1.psk" }]

[[subsystem.namespace]]
nsid = 2
path = "b.pmem"
size = "8MiB"
block_size = 512

[[subsystem.namespace]]
nsid = 1
path = "a.pmem"
size = 1048576
read_only = true
force_dax = true
prefault = false

[[subsystem]]
nqn = "nqn.2026-11.io.rpma:other"
allow_any_host = true
"#;

fn dir_with_psk() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("host1.psk");
    std::fs::write(&p, "ab".repeat(32)).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    d
}

fn err(text: &str) -> String {
    let d = dir_with_psk();
    Config::from_toml(text, d.path())
        .map(|_| ())
        .map_err(|e| rpma_common::error_chain(&e))
        .unwrap_err()
}

/// GOOD with one line replaced.
fn good_with(from: &str, to: &str) -> String {
    assert!(GOOD.contains(from), "{from}");
    GOOD.replacen(from, to, 1)
}

#[test]
fn good_config_parses_with_values_and_defaults() {
    let d = dir_with_psk();
    let c = Config::from_toml(GOOD, d.path()).unwrap();
    assert_eq!(c.listeners.len(), 2);
    assert_eq!(c.listeners[0].url.to_string(), "tcp://127.0.0.1:7420");
    assert!(!c.listeners[0].direct_write_to_pmem);
    assert_eq!(c.listeners[1].url.to_string(), "rdma://[::1]:7421");
    assert!(c.listeners[1].direct_write_to_pmem);
    assert_eq!(c.control_socket, d.path().join("ctl.sock"));
    assert_eq!(
        (
            c.keep_alive_ms,
            c.poll_loops,
            c.max_connections,
            c.max_queue_depth
        ),
        (2000, 2, 8, 64)
    );
    assert!(!c.crc && !c.discovery);
    assert_eq!(
        c.admission,
        Admission {
            max_unadmitted: 32,
            max_unadmitted_per_source: 4,
            handshake_timeout_ms: 3000,
            max_discovery: 8,
            max_discovery_per_source: 2,
            discovery_max_keep_alive_ms: 5000,
            discovery_timeout_ms: 20000,
            refusal_log_period_ms: 10000,
        }
    );
    let s = &c.subsystems[0];
    assert_eq!(s.hosts[0].psk, Some(Psk::new(&[0xab; 32]).unwrap()));
    assert_eq!(
        s.namespaces.iter().map(|n| n.nsid).collect::<Vec<_>>(),
        [1, 2],
        "sorted"
    );
    assert_eq!(s.namespaces[0].size, Some(1 << 20));
    assert!(s.namespaces[0].read_only && s.namespaces[0].force_dax);
    assert!(
        !s.namespaces[0].prefault && s.namespaces[1].prefault,
        "default: mapped ahead"
    );
    assert_eq!(s.namespaces[1].size, Some(8 << 20));
    assert_eq!(s.namespaces[1].block_size, 512);
    assert_eq!(s.namespaces[1].path, d.path().join("b.pmem"));

    let minimal = Config::from_toml("", d.path()).unwrap();
    assert_eq!(minimal.listeners[0].url.port, DEFAULT_PORT);
    assert_eq!(minimal.control_socket, Path::new(DEFAULT_CONTROL_SOCKET));
    assert_eq!(
        minimal.state_file,
        d.path().join(DEFAULT_STATE_FILE),
        "beside the config"
    );
    let set = Config::from_toml("state_file = \"run/st\"", d.path()).unwrap();
    assert_eq!(set.state_file, d.path().join("run/st"));
    assert!(Config::from_toml("state_file = \"\"", d.path())
        .unwrap_err()
        .to_string()
        .starts_with("state_file: empty path"));
    assert_eq!(minimal.keep_alive_ms, DEFAULT_KEEP_ALIVE_MS);
    assert!(minimal.crc && minimal.discovery);
    assert_eq!(minimal.max_connections, 64);
    assert_eq!(
        minimal.admission,
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
    );
}

#[test]
fn bad_size_names_the_key() {
    let e = err(&good_with(r#"size = "8MiB""#, r#"size = "12X""#));
    assert_eq!(e, r#"subsystem[0].namespace[0].size: "12X" is not a size"#);
    let e = err(&good_with(r#"size = "8MiB""#, "size = -5"));
    assert!(
        e.starts_with("subsystem[0].namespace[0].size: -5 is not a size"),
        "{e}"
    );
}

#[test]
fn size_must_be_a_multiple_of_the_block_size() {
    let e = err(&good_with(r#"size = "8MiB""#, "size = 1000"));
    assert!(
        e.contains("subsystem[0].namespace[0].size: 1000 is not a multiple of the block size 512"),
        "{e}"
    );
}

#[test]
fn block_size_must_be_512_or_4096() {
    let e = err(&good_with("block_size = 512", "block_size = 1024"));
    assert!(
        e.contains("subsystem[0].namespace[0].block_size: 1024 is not a block size"),
        "{e}"
    );
}

#[test]
fn nsid_zero_and_duplicates() {
    let e = err(&good_with("nsid = 2", "nsid = 0"));
    assert!(
        e.contains("subsystem[0].namespace[0].nsid: 0 is not a namespace id"),
        "{e}"
    );
    let e = err(&good_with("nsid = 2", "nsid = 1"));
    assert!(
        e.contains("subsystem[0].namespace[1].nsid: nsid 1 is used twice"),
        "{e}"
    );
}

#[test]
fn duplicate_nqn_and_path_and_host() {
    let e = err(&good_with(
        "nqn.2026-11.io.rpma:other",
        "nqn.2026-11.io.rpma:demo",
    ));
    assert!(
        e.contains("subsystem[1].nqn: nqn.2026-11.io.rpma:demo is defined twice"),
        "{e}"
    );
    let e = err(&good_with(r#"path = "a.pmem""#, r#"path = "b.pmem""#));
    assert!(
        e.contains("subsystem[0].namespace[1].path:") && e.contains("backs another namespace"),
        "{e}"
    );
    let e = err(&good_with(
        r#"psk_file = "host1.psk" }]"#,
        r#"psk_file = "host1.psk" }, { nqn = "nqn.2014-08.org.nvmexpress:uuid:0f8fad5b-d9cb-469f-a165-70867728950e" }]"#,
    ));
    assert!(
        e.contains("subsystem[0].hosts[1].nqn:") && e.contains("listed twice"),
        "{e}"
    );
}

#[test]
fn bad_nqns() {
    let e = err(&good_with(
        "nqn.2026-11.io.rpma:demo",
        "nqn.2026-11.io.rpma",
    ));
    assert!(e.starts_with("subsystem[0].nqn: NQN"), "{e}");
    let e = err(&good_with(
        "nqn.2014-08.org.nvmexpress:uuid:0f8fad5b",
        "nqn.2014-08.org.nvmexpress:uuid:zz8fad5b",
    ));
    assert!(e.starts_with("subsystem[0].hosts[0].nqn: NQN"), "{e}");
    let e = err(&good_with(
        "nqn.2026-11.io.rpma:other",
        "nqn.2014-08.org.nvmexpress.discovery",
    ));
    assert!(
        e.contains("subsystem[1].nqn: the discovery NQN is reserved"),
        "{e}"
    );
}

#[test]
fn unknown_keys_are_refused() {
    for (from, to, word) in [
        ("crc = false", "crc = false\ncrcc = true", "crcc"),
        (
            "allow_any_host = true",
            "allow_any_host = true\nallow = 1",
            "allow",
        ),
        (
            "read_only = true",
            "read_only = true\nreadonly = true",
            "readonly",
        ),
        ("{ url = \"rdma", "{ urll = \"rdma", "urll"),
    ] {
        let e = err(&good_with(from, to));
        assert!(
            e.contains(word) && (e.contains("unknown field") || e.contains("missing field")),
            "{e}"
        );
    }
}

#[test]
fn bad_urls() {
    for (url, needle) in [
        ("http://127.0.0.1:7420", "unknown transport"),
        ("tcp://127.0.0.1:0", "is not a port"),
        ("tcp://127.0.0.1:99999", "is not a port"),
        ("tcp://127.0.0.1:7420/x", "no path"),
        ("127.0.0.1:7420", "is not a URL"),
        ("tcp://[::1", "unterminated"),
        ("tcp://[zz]:1", "not an IPv6"),
        ("tcp://bad_host:1", "not a host"),
        ("tcp://:1", "not a host"),
    ] {
        let e = err(&good_with("tcp://127.0.0.1:7420", url));
        assert!(
            e.starts_with("listen[0]: ") && e.contains(needle),
            "{url}: {e}"
        );
    }
    let e = err(&good_with(
        r#""tcp://127.0.0.1:7420""#,
        r#""tcp://[::1]:7421", "tcp://[::1]:7421""#,
    ));
    assert!(
        e.contains("listen[1]: tcp://[::1]:7421 is listed twice"),
        "{e}"
    );
    let e = err(&good_with(r#""tcp://127.0.0.1:7420""#, "7420"));
    assert!(e.contains("listen[0]: expected a URL string"), "{e}");
    let e = err(&good_with(
        r#""tcp://127.0.0.1:7420""#,
        r#"{ url = "tcp://127.0.0.1", direct_write_to_pmem = true }"#,
    ));
    assert!(
        e.contains("listen[0].direct_write_to_pmem: only meaningful for rdma"),
        "{e}"
    );
    assert_eq!(
        ListenUrl::parse("tcp://example.com").unwrap().port,
        DEFAULT_PORT
    );
}

#[test]
fn psk_file_problems() {
    let e = err(&good_with("host1.psk", "missing.psk"));
    assert!(
        e.starts_with("subsystem[0].hosts[0].psk_file: cannot read key file"),
        "{e}"
    );
    let d = dir_with_psk();
    let p = d.path().join("host1.psk");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = Config::from_toml(GOOD, d.path())
        .map(|_| ())
        .map_err(|e| rpma_common::error_chain(&e))
        .unwrap_err();
    assert!(
        e.contains("psk_file: key file") && e.contains("mode 0644"),
        "{e}"
    );
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(&p, "ab".repeat(4)).unwrap();
    let e = Config::from_toml(GOOD, d.path())
        .map(|_| ())
        .map_err(|e| rpma_common::error_chain(&e))
        .unwrap_err();
    assert!(
        e.contains("psk_file: key") && e.contains("is 4 bytes"),
        "{e}"
    );
}

#[test]
fn out_of_range_numbers() {
    for (from, to, key) in [
        ("poll_loops = 2", "poll_loops = 0", "poll_loops"),
        ("keep_alive_ms = 2000", "keep_alive_ms = 5", "keep_alive_ms"),
        (
            "max_connections = 8",
            "max_connections = 0",
            "max_connections",
        ),
        (
            "max_queue_depth = 64",
            "max_queue_depth = 70000",
            "max_queue_depth",
        ),
        (
            "max_unadmitted = 32",
            "max_unadmitted = 0",
            "max_unadmitted",
        ),
        (
            "handshake_timeout_ms = 3000",
            "handshake_timeout_ms = 99",
            "handshake_timeout_ms",
        ),
        (
            "max_discovery = 8",
            "max_discovery = 70000",
            "max_discovery",
        ),
        (
            "discovery_max_keep_alive_ms = 5000",
            "discovery_max_keep_alive_ms = 3600001",
            "discovery_max_keep_alive_ms",
        ),
        (
            "discovery_timeout_ms = 20000",
            "discovery_timeout_ms = 0",
            "discovery_timeout_ms",
        ),
        (
            "refusal_log_period_ms = 10000",
            "refusal_log_period_ms = 999",
            "refusal_log_period_ms",
        ),
    ] {
        let e = err(&good_with(from, to));
        assert!(
            e.starts_with(&format!("{key}: ")) && e.contains("out of range"),
            "{e}"
        );
    }
}

#[test]
fn a_per_source_cap_above_its_pool_names_the_key() {
    let e = err(&good_with(
        "max_unadmitted_per_source = 4",
        "max_unadmitted_per_source = 33",
    ));
    assert_eq!(
        e,
        "max_unadmitted_per_source: 33 is more than max_unadmitted (32)"
    );
    let e = err(&good_with(
        "max_discovery_per_source = 2",
        "max_discovery_per_source = 9",
    ));
    assert_eq!(
        e,
        "max_discovery_per_source: 9 is more than max_discovery (8)"
    );
}

#[test]
fn no_host_could_connect() {
    let e = err(&good_with(
        r#"hosts = [{ nqn = "nqn.2014-08.org.nvmexpress:uuid:0f8fad5b-d9cb-469f-a165-70867728950e", psk_file = "host1.psk" }]"#,
        "",
    ));
    assert!(e.contains("subsystem[0].hosts: no host may connect"), "{e}");
}

#[test]
fn syntax_and_type_errors() {
    let e = err("listen = [");
    assert!(!e.is_empty());
    let e = err(&good_with("crc = false", "crc = \"no\""));
    assert!(e.contains("crc"), "{e}");
}

#[test]
fn load_reports_the_path() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("nope.toml");
    assert!(matches!(
        Config::load(&missing),
        Err(ConfigError::Read { .. })
    ));
    let p = d.path().join("bad.toml");
    std::fs::write(&p, "bogus = 1").unwrap();
    let e = Config::load(&p)
        .map(|_| ())
        .map_err(|e| rpma_common::error_chain(&e))
        .unwrap_err();
    assert!(e.contains("bad.toml") && e.contains("bogus"), "{e}");
    // A value that breaks a rule names the file too.
    let dp = dir_with_psk();
    let p = dp.path().join("invalid.toml");
    std::fs::write(
        &p,
        good_with("max_queue_depth = 64", "max_queue_depth = 70000"),
    )
    .unwrap();
    let e = Config::load(&p)
        .map(|_| ())
        .map_err(|e| rpma_common::error_chain(&e))
        .unwrap_err();
    assert!(
        e.contains("invalid.toml") && e.contains("max_queue_depth"),
        "{e}"
    );
}

#[test]
fn control_socket_of_reads_only_that_key() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("c.toml");
    // The key file is missing: a full load would fail, this must not.
    std::fs::write(
        &p,
        "control_socket = \"ctl.sock\"\n[[subsystem]]\nnqn = \"x\"\n",
    )
    .unwrap();
    assert_eq!(control_socket_of(&p).unwrap(), d.path().join("ctl.sock"));
    std::fs::write(&p, "").unwrap();
    assert_eq!(
        control_socket_of(&p).unwrap(),
        Path::new(DEFAULT_CONTROL_SOCKET)
    );
    std::fs::write(&p, "control_socket = 5").unwrap();
    assert!(control_socket_of(&p)
        .unwrap_err()
        .to_string()
        .starts_with("control_socket: 5"));
    std::fs::write(&p, "control_socket = ").unwrap();
    assert!(matches!(
        control_socket_of(&p),
        Err(ConfigError::Parse { .. })
    ));
}

#[test]
fn metrics_listen_is_an_address_and_port_and_off_by_default() {
    let d = dir_with_psk();
    let c = Config::from_toml(GOOD, d.path()).unwrap();
    assert_eq!(c.metrics_listen, None, "off by default");
    for (text, want) in [
        ("127.0.0.1:9420", "127.0.0.1:9420"),
        ("0.0.0.0:9420", "0.0.0.0:9420"),
        ("[::1]:9420", "[::1]:9420"),
    ] {
        let cfg = format!("metrics_listen = \"{text}\"\n{GOOD}");
        let c = Config::from_toml(&cfg, d.path()).unwrap();
        assert_eq!(c.metrics_listen.unwrap().to_string(), want);
    }
    for bad in [
        "localhost:9420",
        "127.0.0.1",
        "127.0.0.1:99999",
        "http://127.0.0.1:9420",
        "",
    ] {
        let e = err(&format!("metrics_listen = \"{bad}\"\n{GOOD}"));
        assert!(
            e.starts_with("metrics_listen: ") && e.contains("is not an address and port"),
            "{bad}: {e}"
        );
    }
    let e = err(&format!("metrics_listen = 9420\n{GOOD}"));
    assert!(e.contains("metrics_listen"), "{e}");
}

#[test]
fn nvme_tcp_listeners_parse_beside_the_fabric_ones() {
    let c = Config::from_toml(
        &good_with(
            r#""tcp://127.0.0.1:7420""#,
            r#""tcp://127.0.0.1:7420", "nvme-tcp://127.0.0.1", "nvme-tcp://[::1]:8009""#,
        ),
        dir_with_psk().path(),
    )
    .unwrap();
    let urls: Vec<String> = c.listeners.iter().map(|l| l.url.to_string()).collect();
    assert_eq!(
        urls,
        [
            "tcp://127.0.0.1:7420",
            "nvme-tcp://127.0.0.1:4420",
            "nvme-tcp://[::1]:8009",
            "rdma://[::1]:7421"
        ]
    );
    assert_eq!(c.listeners[1].url.transport, Transport::NvmeTcp);
    assert!(!Transport::NvmeTcp.is_fabric() && Transport::Tcp.is_fabric());
    // The same address on another transport is another listener; twice the same is refused.
    let e = err(&good_with(
        r#""tcp://127.0.0.1:7420""#,
        r#""nvme-tcp://127.0.0.1:4420", "nvme-tcp://127.0.0.1""#,
    ));
    assert!(
        e.contains("listen[1]: nvme-tcp://127.0.0.1:4420 is listed twice"),
        "{e}"
    );
    let e = err(&good_with(
        r#""tcp://127.0.0.1:7420""#,
        r#"{ url = "nvme-tcp://127.0.0.1", direct_write_to_pmem = true }"#,
    ));
    assert!(e.contains("only meaningful for rdma"), "{e}");
    for (url, needle) in [
        ("nvme-tcp://127.0.0.1:0", "is not a port"),
        ("nvme-tcp://127.0.0.1:4420/nqn", "no path"),
        (
            "nvme://127.0.0.1:4420",
            "unknown transport \"nvme\" (tcp, rdma or nvme-tcp)",
        ),
    ] {
        let e = err(&good_with("tcp://127.0.0.1:7420", url));
        assert!(e.contains(needle), "{url}: {e}");
    }
}
