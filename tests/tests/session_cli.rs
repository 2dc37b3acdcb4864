//! `rpma-initiator discover` and `identify` as real processes against a real `rpma-target`:
//! output (text and JSON) and the documented exit codes. Needs both binaries built (`cargo build
//! --workspace`, as `make test` does).

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const SUB: &str = "nqn.2026-11.io.rpma:cli";
const HIDDEN: &str = "nqn.2026-11.io.rpma:hidden";
const HOST: &str = "nqn.2026-11.io.rpma:cli-host";
const KEYED: &str = "nqn.2026-11.io.rpma:cli-keyed";

fn binary(name: &str) -> PathBuf {
    let p = rpma_tests::bin(name);
    assert!(
        p.exists(),
        "{} is not built: run `cargo build --workspace` first",
        p.display()
    );
    p
}

struct Target {
    child: Child,
    url: String,
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(dir: &Path) -> Target {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let key = dir.join("k.psk");
    std::fs::write(&key, "3c".repeat(32)).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(
        dir.join("c.toml"),
        format!(
            r#"listen = ["tcp://127.0.0.1:{port}"]
control_socket = "ctl.sock"
[[subsystem]]
nqn = "{SUB}"
hosts = [{{ nqn = "{HOST}" }}, {{ nqn = "{KEYED}", psk_file = "k.psk" }}]
[[subsystem.namespace]]
nsid = 1
path = "ns1"
size = "2MiB"
[[subsystem.namespace]]
nsid = 2
path = "ns2"
size = "1MiB"
block_size = 512
read_only = true
[[subsystem]]
nqn = "{HIDDEN}"
hosts = [{{ nqn = "nqn.2026-11.io.rpma:someone-else" }}]
"#
        ),
    )
    .unwrap();
    let sock = dir.join("notify.sock");
    let notify = UnixDatagram::bind(&sock).unwrap();
    let child = Command::new(binary("rpma-target"))
        .arg("--config")
        .arg(dir.join("c.toml"))
        .env("NOTIFY_SOCKET", &sock)
        .env_remove("WATCHDOG_USEC")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Target {
        child,
        url: format!("tcp://127.0.0.1:{port}"),
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no READY=1 within 20 s");
        notify.set_read_timeout(Some(left)).unwrap();
        if let Ok(n) = notify.recv(&mut buf) {
            if buf[..n].starts_with(b"READY=1") {
                return t;
            }
        }
    }
}

fn initiator(args: &[&str]) -> Output {
    Command::new(binary("rpma-initiator"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn discover_and_identify() {
    let d = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let t = start(d.path());

    let o = initiator(&["discover", "--target", &t.url, "--hostnqn", HOST]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains(SUB) && out.contains(&t.url), "{out}");
    assert!(
        !out.contains(HIDDEN),
        "discovery lists only what the host may reach: {out}"
    );

    // Global options after the subcommand, JSON.
    let o = initiator(&["discover", "--json", "--hostnqn", HOST, "--target", &t.url]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["subsystems"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["subsystems"][0]["nqn"], SUB);
    assert_eq!(v["subsystems"][0]["listen"][0], t.url.as_str());

    let o = initiator(&[
        "identify",
        "--target",
        &t.url,
        "--nqn",
        SUB,
        "--hostnqn",
        HOST,
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("2 namespace(s)"), "{out}");
    assert!(
        out.contains("nsid 1: 2097152 bytes, block 4096, domain page-cache, durability APM GPSPM FLUSH, read-write"),
        "{out}"
    );
    assert!(out.contains("nsid 2: 1048576 bytes, block 512"), "{out}");
    assert!(out.contains("read-only"), "{out}");

    let o = initiator(&[
        "--json",
        "--target",
        &t.url,
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
    assert_eq!(v["namespaces"][0]["domain"], "page-cache");
    assert_eq!(v["namespaces"][0]["durability"][1], "GPSPM");
    assert_eq!(v["namespaces"][1]["read_only"], true);

    // With the key.
    let key = d.path().join("k.psk");
    let o = initiator(&[
        "identify",
        "--target",
        &t.url,
        "--nqn",
        SUB,
        "--hostnqn",
        KEYED,
        "--psk-file",
        key.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn errors_have_their_exit_codes() {
    let d = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let t = start(d.path());
    let code = |args: &[&str]| {
        let o = initiator(args);
        (o.status.code(), text(&o))
    };

    let (c, out) = code(&[
        "identify",
        "--target",
        &t.url,
        "--nqn",
        "nqn.2026-11.io.rpma:no",
        "--hostnqn",
        HOST,
    ]);
    assert_eq!(c, Some(4), "{out}");
    assert!(out.contains("no such subsystem"), "{out}");

    let (c, out) = code(&[
        "identify",
        "--target",
        &t.url,
        "--nqn",
        HIDDEN,
        "--hostnqn",
        HOST,
    ]);
    assert_eq!(c, Some(4), "{out}");
    assert!(out.contains("not allowed"), "{out}");

    let wrong = d.path().join("wrong.psk");
    std::fs::write(&wrong, "3d".repeat(32)).unwrap();
    std::fs::set_permissions(&wrong, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (c, out) = code(&[
        "identify",
        "--target",
        &t.url,
        "--nqn",
        SUB,
        "--hostnqn",
        KEYED,
        "--psk-file",
        wrong.to_str().unwrap(),
    ]);
    assert_eq!(c, Some(5), "{out}");
    assert!(out.contains("authentication failed"), "{out}");

    let (c, out) = code(&[
        "identify",
        "--target",
        &t.url,
        "--nqn",
        SUB,
        "--hostnqn",
        KEYED,
    ]);
    assert_eq!(c, Some(5), "{out}");
    assert!(out.contains("pre-shared key"), "{out}");

    // Nobody listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (c, out) = code(&[
        "discover",
        "--target",
        &format!("tcp://127.0.0.1:{port}"),
        "--timeout",
        "2",
    ]);
    assert_eq!(c, Some(3), "{out}");
    assert!(out.contains("cannot connect"), "{out}");

    // Usage errors.
    let (c, out) = code(&["identify", "--nqn", SUB]);
    assert_eq!(c, Some(2), "{out}");
    assert!(out.contains("--target URL is required"), "{out}");
    let (c, out) = code(&[
        "identify",
        "--target",
        "udp://x:1",
        "--nqn",
        SUB,
        "--hostnqn",
        HOST,
    ]);
    assert_eq!(c, Some(2), "{out}");
    let (c, _) = code(&["identify", "--target", &t.url]);
    assert_eq!(c, Some(2), "missing --nqn");
}
