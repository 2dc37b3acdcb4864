//! `rpma-initiator discover` and `identify` as real processes against a real `rpma-target`:
//! output (text and JSON) and the documented exit codes. Needs both binaries built (`cargo build
//! --workspace`, as `make test` does).

use rpma_tests::{free_port, initiator, text, write_psk, Config, Namespace, Subsystem, Target};

const SUB: &str = "nqn.2026-11.io.rpma:cli";
const HIDDEN: &str = "nqn.2026-11.io.rpma:hidden";
const HOST: &str = "nqn.2026-11.io.rpma:cli-host";
const KEYED: &str = "nqn.2026-11.io.rpma:cli-keyed";

/// Subsystem SUB (hosts HOST, and KEYED with the key `k.psk`; nsid 1 read-write 2 MiB, nsid 2
/// read-only 1 MiB of 512-byte blocks) and HIDDEN, which HOST may not reach.
fn start(dir: &std::path::Path) -> Target {
    write_psk(&dir.join("k.psk"), "3c");
    let config = Config::new()
        .subsystem(
            Subsystem::new(SUB)
                .host(HOST)
                .keyed_host(KEYED, "k.psk")
                .namespace(Namespace::new(1, "ns1", "2MiB"))
                .namespace(Namespace::new(2, "ns2", "1MiB").block_size(512).read_only()),
        )
        .subsystem(Subsystem::new(HIDDEN).host("nqn.2026-11.io.rpma:someone-else"));
    Target::start(dir, &config.to_string())
}

/// `identify` of `nqn` on the target at `url` as `host`, then `extra`.
fn identify<'a>(url: &'a str, nqn: &'a str, host: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["identify", "--target", url, "--nqn", nqn, "--hostnqn", host];
    a.extend_from_slice(extra);
    a
}

#[test]
fn discover_and_identify() {
    let d = rpma_tests::scratch();
    let t = start(d.path());
    let url = t.url();

    let o = initiator(&["discover", "--target", &url, "--hostnqn", HOST]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains(SUB) && out.contains(&url), "{out}");
    assert!(
        !out.contains(HIDDEN),
        "discovery lists only what the host may reach: {out}"
    );

    // Global options after the subcommand, JSON.
    let o = initiator(&["discover", "--json", "--hostnqn", HOST, "--target", &url]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["subsystems"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["subsystems"][0]["nqn"], SUB);
    assert_eq!(v["subsystems"][0]["listen"][0], url.as_str());

    let o = initiator(&identify(&url, SUB, HOST, &[]));
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("2 namespace(s)"), "{out}");
    let tr = rpma_tests::Transport::current();
    let line = format!(
        "nsid 1: 2097152 bytes, block 4096, domain {}, durability {}, read-write",
        tr.file_domain(),
        tr.offered(tr.file_domain()).names().join(" ")
    );
    assert!(out.contains(&line), "{out}");
    assert!(out.contains("nsid 2: 1048576 bytes, block 512"), "{out}");
    assert!(out.contains("read-only"), "{out}");

    let o = initiator(&[
        "--json",
        "--target",
        &url,
        "identify",
        "--nqn",
        SUB,
        "--hostnqn",
        HOST,
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["subsystem"], SUB);
    assert_eq!(v["namespaces"][0]["nsid"], 1);
    assert_eq!(v["namespaces"][0]["size"], 2 << 20);
    let files = rpma_tests::Transport::current().file_domain().to_string();
    assert_eq!(v["namespaces"][0]["domain"], files.as_str());
    assert_eq!(
        v["namespaces"][0]["durability"],
        serde_json::json!(tr.offered(tr.file_domain()).names())
    );
    assert_eq!(v["namespaces"][1]["read_only"], true);

    // With the key.
    let key = d.path().join("k.psk");
    let o = initiator(&identify(
        &url,
        SUB,
        KEYED,
        &["--psk-file", key.to_str().unwrap()],
    ));
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn errors_have_their_exit_codes() {
    let d = rpma_tests::scratch();
    let t = start(d.path());
    let url = t.url();
    let code = |args: &[&str]| {
        let o = initiator(args);
        (o.status.code(), text(&o))
    };

    let (c, out) = code(&identify(&url, "nqn.2026-11.io.rpma:no", HOST, &[]));
    assert_eq!(c, Some(4), "{out}");
    assert!(out.contains("no such subsystem"), "{out}");

    let (c, out) = code(&identify(&url, HIDDEN, HOST, &[]));
    assert_eq!(c, Some(4), "{out}");
    assert!(out.contains("not allowed"), "{out}");

    let wrong = d.path().join("wrong.psk");
    write_psk(&wrong, "3d");
    let (c, out) = code(&identify(
        &url,
        SUB,
        KEYED,
        &["--psk-file", wrong.to_str().unwrap()],
    ));
    assert_eq!(c, Some(5), "{out}");
    assert!(out.contains("authentication failed"), "{out}");

    let (c, out) = code(&identify(&url, SUB, KEYED, &[]));
    assert_eq!(c, Some(5), "{out}");
    assert!(out.contains("pre-shared key"), "{out}");

    // Nobody listens there (one attempt; first_connection.rs tests the retries).
    let port = free_port();
    let (c, out) = code(&[
        "discover",
        "--target",
        &rpma_tests::Transport::current().url(port),
        "--timeout",
        "2",
        "--reconnect-timeout",
        "0",
    ]);
    assert_eq!(c, Some(3), "{out}");
    assert!(out.contains("cannot connect"), "{out}");

    // Usage errors.
    let (c, out) = code(&["identify", "--nqn", SUB]);
    assert_eq!(c, Some(2), "{out}");
    assert!(out.contains("--target URL is required"), "{out}");
    let (c, out) = code(&identify("udp://x:1", SUB, HOST, &[]));
    assert_eq!(c, Some(2), "{out}");
    let (c, _) = code(&["identify", "--target", &url]);
    assert_eq!(c, Some(2), "missing --nqn");
}

rpma_tests::rdma_runs!(discover_and_identify, errors_have_their_exit_codes,);
