//! The target's connection set-up under arbitrary messages (fuzz target `target_handshake`;
//! feature `fuzzing`, test-only). The cargo-fuzz target in fuzz/ calls [`connect_sequence`];
//! tests/tests/fuzz_corpus.rs replays the committed corpus and [`seeds`] through it.

use std::sync::OnceLock;

use rpma_common::proto::nqn::{Nqn, DISCOVERY_NQN};
use rpma_common::proto::{
    AuthResponse, Connect, Disconnect, DiscoveryRequest, HostId, KeepAlive, Message, RefusalReason,
};

use super::{Step, TargetHandshake};
use crate::config::Config;

const SUB: &str = "nqn.2026-11.io.rpma:fuzz";
const PLAIN: &str = "nqn.2026-11.io.rpma:plain-host";
const KEYED: &str = "nqn.2026-11.io.rpma:keyed-host";

/// SUB lets PLAIN in without a key and KEYED with one; discovery is on.
fn config() -> &'static Config {
    static CFG: OnceLock<Config> = OnceLock::new();
    CFG.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("rpma-fuzz-handshake-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let key = dir.join("keyed.psk");
        std::fs::write(&key, "5a".repeat(32)).expect("the key file");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let text = format!(
            "[[subsystem]]\nnqn = \"{SUB}\"\nhosts = [{{ nqn = \"{PLAIN}\" }}, \
             {{ nqn = \"{KEYED}\", psk_file = \"keyed.psk\" }}]\n"
        );
        Config::from_toml(&text, &dir).expect("the fuzz configuration")
    })
}

/// Feeds `data`, read as u16-LE-length-prefixed messages, to one connection's
/// [`TargetHandshake`] and checks every answer:
/// - each message gets at least one step, and the handshake is done after a refusal, an
///   admission or a discovery admission, refusing everything after it as a protocol error;
/// - only PLAIN is admitted to SUB without a key, and nobody else: KEYED's challenge-response
///   cannot be passed by input written before the target drew its nonce, a host not on the
///   list and an unknown subsystem are refused;
/// - a discovery admission is for the discovery NQN only; a refusal names the host of the
///   Connect it refuses, when there was one.
pub fn connect_sequence(data: &[u8]) {
    let cfg = config();
    let mut hs = TargetHandshake::new();
    let mut connect: Option<Connect> = None;
    let mut done = false;
    let mut rest = data;
    while let Some((len, tail)) = rest.split_first_chunk::<2>() {
        let n = usize::from(u16::from_le_bytes(*len)).min(tail.len());
        let (m, tail) = tail.split_at(n);
        rest = tail;
        if let Ok(Message::Connect(c)) = Message::decode(m) {
            if connect.is_none() && !done {
                connect = Some(c);
            }
        }
        let steps = hs.on_message(cfg, m);
        assert!(!steps.is_empty(), "a message without an answer");
        if done {
            assert!(
                matches!(&steps[..], [Step::Refuse { refusal, .. }]
                    if refusal.reason == RefusalReason::ProtocolError
                        || refusal.reason == RefusalReason::VersionUnsupported),
                "a finished handshake answered {steps:?}"
            );
            continue;
        }
        for step in &steps {
            match step {
                Step::Admitted { connect: c, .. } => {
                    assert_eq!(c.subsystem_nqn.as_str(), SUB, "{c:?} admitted");
                    assert_eq!(c.host_nqn.as_str(), PLAIN, "{c:?} admitted");
                    assert_eq!(Some(c), connect.as_ref());
                    done = true;
                }
                Step::Discovery { connect: c, key } => {
                    assert!(c.subsystem_nqn.is_discovery(), "{c:?} as discovery");
                    assert!(key.is_none(), "a discovery host proved a key");
                    done = true;
                }
                Step::Refuse { host_nqn, .. } => {
                    if let (Some(h), Some(c)) = (host_nqn, &connect) {
                        assert_eq!(h, &c.host_nqn, "a refusal of another host");
                    }
                    done = true;
                }
                Step::Abandoned { .. } => done = true,
                Step::Send(m) => assert!(
                    matches!(m, Message::AuthChallenge(_)),
                    "the handshake sent {m:?}"
                ),
            }
        }
        assert_eq!(hs.is_done(), done, "after {steps:?}");
    }
}

/// The names of the targets, as the corpus directories are named.
pub const TARGETS: [&str; 1] = ["target_handshake"];

/// The entry point of target `name` (one of [`TARGETS`]).
pub fn entry(name: &str) -> Option<fn(&[u8])> {
    (name == TARGETS[0]).then_some(connect_sequence as fn(&[u8]))
}

/// Real conversations of target `name` (admissions, discovery, refusals, a forged
/// authentication), each with a file name for the corpus.
pub fn seeds(name: &str) -> Vec<(String, Vec<u8>)> {
    if name != TARGETS[0] {
        return Vec::new();
    }
    let nqn = |s: &str| Nqn::new(s).expect("a valid NQN");
    let connect = |host: &str, sub: &str| {
        Message::Connect(Connect {
            host_nqn: nqn(host),
            subsystem_nqn: nqn(sub),
            host_id: HostId([1; 16]),
            queue_id: 0,
            keep_alive_ms: 0,
        })
    };
    let talk = |msgs: &[Message]| {
        let mut v = Vec::new();
        for m in msgs {
            let b = m.encode().expect("a valid message");
            v.extend_from_slice(&(b.len() as u16).to_le_bytes());
            v.extend_from_slice(&b);
        }
        v
    };
    let forged = Message::AuthResponse(AuthResponse {
        host_nonce: [2; 32],
        host_mac: [3; 32],
    });
    let bye = Message::Disconnect(Disconnect {
        reason: "bye".into(),
    });
    let convs = [
        talk(&[
            connect(PLAIN, SUB),
            Message::KeepAlive(KeepAlive { seq: 1 }),
        ]),
        talk(&[connect(KEYED, SUB), forged.clone()]),
        talk(&[connect(KEYED, SUB), bye.clone()]),
        talk(&[
            connect(PLAIN, DISCOVERY_NQN),
            Message::DiscoveryRequest(DiscoveryRequest { start: 0 }),
        ]),
        talk(&[connect(KEYED, DISCOVERY_NQN), forged]),
        talk(&[connect("nqn.2026-11.io.rpma:stranger", SUB)]),
        talk(&[connect(PLAIN, "nqn.2026-11.io.rpma:nope")]),
        talk(&[bye, connect(PLAIN, SUB)]),
    ];
    convs
        .into_iter()
        .enumerate()
        .map(|(i, b)| (format!("seed-handshake-{i:02}"), b))
        .collect()
}
