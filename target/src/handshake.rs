//! The target's side of connection set-up as a sans-I/O state machine: feed it each received
//! message, send what it returns. It decides admission ([`crate::subsystem::admit`]) and runs the
//! challenge-response; building the ConnectResponse (which needs this connection's rkeys) is the
//! session's job once [`Step::Admitted`] comes out.

use rpma_common::proto::auth::{Psk, TargetAuth, TargetAwaitingResponse};
use rpma_common::proto::nqn::Nqn;
use rpma_common::proto::{self, AuthConfirm, Connect, Message, Refusal, RefusalReason};

use crate::config::Config;
use crate::serve::peer_log::peer_text;
use crate::subsystem::{admit, Admission};

/// What the session must do next.
#[derive(Debug)]
#[non_exhaustive]
pub enum Step {
    /// Send this message.
    Send(Message),
    /// Send this refusal, log it once (with the host NQN if known, and the peer), then close.
    Refuse {
        /// The refusal to send.
        refusal: Refusal,
        /// The host, if the Connect could be read.
        host_nqn: Option<Nqn>,
    },
    /// The host is admitted to a subsystem: send the ConnectResponse.
    Admitted {
        /// The Connect.
        connect: Connect,
        /// Whether the host proved its key (else it was admitted by its NQN alone, or as any
        /// host): a proven host may take the place of an unproven session when the target
        /// is full.
        proven: bool,
    },
    /// A discovery connection: answer DiscoveryRequests with [`crate::subsystem::discovery`].
    Discovery {
        /// The Connect.
        connect: Connect,
        /// The key the host proved (a host that has one must), which shows it the subsystems
        /// that need it.
        key: Option<Psk>,
    },
    /// The host gave up (sent a Disconnect) before it was admitted: log `why` once (with the
    /// host NQN if known, and the peer) and close; there is nobody to send a refusal to.
    Abandoned {
        /// What happened, for the log.
        why: String,
        /// The host, if its Connect was read.
        host_nqn: Option<Nqn>,
    },
}

enum State {
    AwaitConnect,
    /// The key is kept for a discovery connection, whose listing depends on it.
    AwaitAuth(Box<(TargetAwaitingResponse, Connect, Psk)>),
    Done,
}

/// Whether the configuration `cfg` asks the host of `c` to prove `psk` (it may have been
/// reloaded since the challenge was sent).
/// What a host that proved `psk` (the key the configuration of its Connect asked) gets under
/// `cfg`, the configuration in force now: admitted as proven where it still asks that key;
/// admitted as any host it would admit without one where it asks none now (a reload removed
/// the key); refused as it would refuse the Connect now (the host removed, the subsystem
/// gone); refused AuthFailed where it asks another key (rotated: the host needs the new one).
fn after_proof(cfg: &Config, c: Connect, psk: Psk, confirm: AuthConfirm) -> Vec<Step> {
    let next = match admit(cfg, &c) {
        Admission::Authenticate { psk: now, .. } if now == psk => Step::Admitted {
            connect: c,
            proven: true,
        },
        Admission::DiscoveryAuthenticate { psk: now, .. } if now == psk => Step::Discovery {
            connect: c,
            key: Some(psk),
        },
        Admission::Accept { .. } => Step::Admitted {
            connect: c,
            proven: false,
        },
        Admission::Discovery => Step::Discovery {
            connect: c,
            key: None,
        },
        Admission::Refuse(r) => {
            return vec![Step::Refuse {
                refusal: r,
                host_nqn: Some(c.host_nqn),
            }]
        }
        Admission::Authenticate { .. } | Admission::DiscoveryAuthenticate { .. } => {
            return vec![refuse(
                RefusalReason::AuthFailed,
                "the host's key was changed while it authenticated: it needs the new one",
                Some(c.host_nqn),
            )]
        }
    };
    vec![Step::Send(Message::AuthConfirm(confirm)), next]
}

/// The target's handshake for one connection.
pub struct TargetHandshake {
    state: State,
}

impl std::fmt::Debug for TargetHandshake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self.state {
            State::AwaitConnect => "awaiting Connect",
            State::AwaitAuth(_) => "awaiting AuthResponse",
            State::Done => "done",
        };
        write!(f, "TargetHandshake({s})")
    }
}

impl Default for TargetHandshake {
    fn default() -> Self {
        Self::new()
    }
}

fn refuse(reason: RefusalReason, message: impl Into<String>, host_nqn: Option<Nqn>) -> Step {
    Step::Refuse {
        refusal: Refusal {
            reason,
            message: message.into(),
        },
        host_nqn,
    }
}

impl TargetHandshake {
    /// A handshake awaiting the Connect.
    pub fn new() -> Self {
        TargetHandshake {
            state: State::AwaitConnect,
        }
    }

    /// Whether the handshake has finished (admitted or refused).
    pub fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// Handles one received message. After a [`Step::Refuse`], [`Step::Admitted`] or
    /// [`Step::Discovery`] the handshake is done and further input is refused.
    pub fn on_message(&mut self, cfg: &Config, buf: &[u8]) -> Vec<Step> {
        let msg = match Message::decode(buf) {
            Ok(m) => m,
            Err(e @ proto::Error::UnsupportedVersion { .. }) => {
                self.state = State::Done;
                return vec![refuse(
                    RefusalReason::VersionUnsupported,
                    e.to_string(),
                    None,
                )];
            }
            Err(e) => {
                let host = self.host();
                self.state = State::Done;
                return vec![refuse(RefusalReason::ProtocolError, e.to_string(), host)];
            }
        };
        match (std::mem::replace(&mut self.state, State::Done), msg) {
            (State::AwaitConnect, Message::Connect(c)) => match admit(cfg, &c) {
                Admission::Refuse(r) => vec![Step::Refuse {
                    refusal: r,
                    host_nqn: Some(c.host_nqn),
                }],
                Admission::Discovery => vec![Step::Discovery {
                    connect: c,
                    key: None,
                }],
                Admission::Accept { .. } => vec![Step::Admitted {
                    connect: c,
                    proven: false,
                }],
                Admission::Authenticate { psk, ctx, .. }
                | Admission::DiscoveryAuthenticate { psk, ctx } => {
                    match TargetAuth::start(psk.clone(), ctx) {
                        Ok((auth, ch)) => {
                            self.state = State::AwaitAuth(Box::new((auth, c, psk)));
                            vec![Step::Send(Message::AuthChallenge(ch))]
                        }
                        Err(e) => vec![refuse(
                            RefusalReason::AuthFailed,
                            e.to_string(),
                            Some(c.host_nqn),
                        )],
                    }
                }
            },
            (State::AwaitAuth(b), Message::AuthResponse(r)) => {
                let (auth, c, psk) = *b;
                match auth.on_response(&r) {
                    // Proved with the key of the configuration of its Connect: the one in
                    // force now decides (a reload that removed the host or changed its key
                    // while it answered let it in with the old one, as proven).
                    Ok(confirm) => after_proof(cfg, c, psk, confirm),
                    Err(e) => vec![refuse(
                        RefusalReason::AuthFailed,
                        e.to_string(),
                        Some(c.host_nqn),
                    )],
                }
            }
            // The initiator library answers a challenge it has no key for with a Disconnect.
            // The reason is the peer's text: quoted and cut, as every peer text in the log.
            (State::AwaitAuth(b), Message::Disconnect(d)) => vec![Step::Abandoned {
                why: format!(
                    "authentication required: the host has no key for {} (it disconnected at \
                     the challenge: {})",
                    b.1.subsystem_nqn,
                    peer_text(&d.reason)
                ),
                host_nqn: Some(b.1.host_nqn),
            }],
            (State::AwaitConnect, Message::Disconnect(d)) => vec![Step::Abandoned {
                why: format!("disconnected before its Connect: {}", peer_text(&d.reason)),
                host_nqn: None,
            }],
            (State::AwaitAuth(b), other) => vec![refuse(
                RefusalReason::ProtocolError,
                format!("expected AuthResponse, got {:?}", other.message_type()),
                Some(b.1.host_nqn),
            )],
            (State::AwaitConnect, other) => vec![refuse(
                RefusalReason::ProtocolError,
                format!("expected Connect, got {:?}", other.message_type()),
                None,
            )],
            (State::Done, other) => vec![refuse(
                RefusalReason::ProtocolError,
                format!("handshake already finished, got {:?}", other.message_type()),
                None,
            )],
        }
    }

    fn host(&self) -> Option<Nqn> {
        match &self.state {
            State::AwaitAuth(b) => Some(b.1.host_nqn.clone()),
            _ => None,
        }
    }
}

// Test-only: the fuzz target's entry point (fuzz/, tests/tests/fuzz_corpus.rs).
#[cfg(feature = "fuzzing")]
pub mod fuzz;

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use rpma_common::proto::auth::{AuthContext, HostAuth, Psk};
    use rpma_common::proto::{AuthConfirm, HostId, KeepAlive};

    use super::*;

    const SUB: &str = "nqn.2026-11.io.rpma:demo";
    const KEYED: &str = "nqn.2026-11.io.rpma:keyed";

    fn cfg(dir: &std::path::Path) -> Config {
        let k = dir.join("k.psk");
        std::fs::write(&k, "42".repeat(32)).unwrap();
        std::fs::set_permissions(&k, std::fs::Permissions::from_mode(0o600)).unwrap();
        Config::from_toml(
            &format!(
                "[[subsystem]]\nnqn = \"{SUB}\"\nhosts = [{{ nqn = \"nqn.2026-11.io.rpma:plain\" }}, \
                 {{ nqn = \"{KEYED}\", psk_file = \"k.psk\" }}]\n"
            ),
            dir,
        )
        .unwrap()
    }

    fn connect(host: &str, sub: &str) -> Connect {
        Connect {
            host_nqn: Nqn::new(host).unwrap(),
            subsystem_nqn: Nqn::new(sub).unwrap(),
            host_id: HostId([5; 16]),
            queue_id: 0,
            keep_alive_ms: 0,
        }
    }

    fn bytes(m: Message) -> Vec<u8> {
        m.encode().unwrap()
    }

    fn refusal(steps: &[Step]) -> Option<RefusalReason> {
        match steps {
            [Step::Refuse { refusal, .. }] => Some(refusal.reason),
            _ => None,
        }
    }

    #[test]
    fn plain_host_is_admitted() {
        let d = tempfile::tempdir().unwrap();
        let c = cfg(d.path());
        let mut h = TargetHandshake::new();
        let steps = h.on_message(
            &c,
            &bytes(Message::Connect(connect("nqn.2026-11.io.rpma:plain", SUB))),
        );
        assert!(matches!(
            &steps[..],
            [Step::Admitted { connect: c, proven: false }] if c.subsystem_nqn.as_str() == SUB
        ));
        assert!(h.is_done());
        // Anything after the handshake is a protocol error, not a second admission.
        let steps = h.on_message(
            &c,
            &bytes(Message::Connect(connect("nqn.2026-11.io.rpma:plain", SUB))),
        );
        assert_eq!(refusal(&steps), Some(RefusalReason::ProtocolError));
    }

    #[test]
    fn a_host_without_a_key_disconnecting_at_the_challenge_is_named_as_such() {
        let d = tempfile::tempdir().unwrap();
        let c = cfg(d.path());
        let mut h = TargetHandshake::new();
        let steps = h.on_message(&c, &bytes(Message::Connect(connect(KEYED, SUB))));
        assert!(matches!(
            &steps[..],
            [Step::Send(Message::AuthChallenge(_))]
        ));
        let bye = Message::Disconnect(rpma_common::proto::Disconnect {
            reason: "no key".into(),
        });
        let steps = h.on_message(&c, &bytes(bye.clone()));
        match &steps[..] {
            [Step::Abandoned { why, host_nqn }] => {
                assert!(
                    why.starts_with("authentication required: the host has no key"),
                    "{why}"
                );
                assert!(why.contains(SUB) && why.contains("no key"), "{why}");
                assert_eq!(host_nqn.as_ref().map(|n| n.as_str()), Some(KEYED));
            }
            other => panic!("{other:?}"),
        }
        assert!(h.is_done());
        // A Disconnect instead of a Connect: abandoned, host unknown.
        let mut h = TargetHandshake::new();
        let steps = h.on_message(&c, &bytes(bye));
        assert!(matches!(
            &steps[..],
            [Step::Abandoned { host_nqn: None, .. }]
        ));
    }

    /// A keyed host's Connect under `at_connect`, its answer (proving `key`) under
    /// `at_answer`: what the target did with the answer, its confirmation, the host's side.
    fn auth_between(
        at_connect: &Config,
        at_answer: &Config,
        key: u8,
    ) -> (
        Vec<Step>,
        Option<AuthConfirm>,
        rpma_common::proto::auth::HostAwaitingConfirm,
    ) {
        let mut h = TargetHandshake::new();
        let conn = connect(KEYED, SUB);
        let steps = h.on_message(at_connect, &bytes(Message::Connect(conn.clone())));
        let [Step::Send(Message::AuthChallenge(ch))] = &steps[..] else {
            panic!("{steps:?}")
        };
        let ctx = AuthContext {
            host_nqn: conn.host_nqn,
            subsystem_nqn: conn.subsystem_nqn,
            host_id: conn.host_id,
        };
        let (host, resp) = HostAuth::new(Psk::new(&[key; 32]).unwrap(), ctx)
            .on_challenge(ch)
            .unwrap();
        let steps = h.on_message(at_answer, &bytes(Message::AuthResponse(resp)));
        assert!(h.is_done());
        let confirm = match steps.first() {
            Some(Step::Send(Message::AuthConfirm(cf))) => Some(cf.clone()),
            _ => None,
        };
        (steps, confirm, host)
    }

    fn run_auth(
        key: u8,
    ) -> (
        Vec<Step>,
        Option<AuthConfirm>,
        rpma_common::proto::auth::HostAwaitingConfirm,
    ) {
        let d = tempfile::tempdir().unwrap();
        let c = cfg(d.path());
        auth_between(&c, &c, key)
    }

    #[test]
    fn keyed_host_authenticates_mutually() {
        let (steps, confirm, host) = run_auth(0x42);
        assert!(
            matches!(
                &steps[..],
                [Step::Send(_), Step::Admitted { proven: true, .. }]
            ),
            "{steps:?}"
        );
        host.on_confirm(&confirm.unwrap()).unwrap();
    }

    /// A reload while the host answers the challenge: the configuration in force when the
    /// proof arrives decides, not the one of its Connect. A rotated key refuses it
    /// (AuthFailed), a removed host is refused as not allowed, a key taken off the host admits
    /// it as a host without one (not proven); the same key admits it proven. (Before, any
    /// proof of the old key was admitted as proven, and never checked again.)
    #[test]
    fn the_configuration_in_force_when_the_proof_arrives_decides() {
        let d = tempfile::tempdir().unwrap();
        let old = cfg(d.path());
        let rotated = tempfile::tempdir().unwrap();
        let k = rotated.path().join("k.psk");
        std::fs::write(&k, "43".repeat(32)).unwrap();
        std::fs::set_permissions(&k, std::fs::Permissions::from_mode(0o600)).unwrap();
        let with_hosts = |hosts: &str| {
            Config::from_toml(
                &format!("[[subsystem]]\nnqn = \"{SUB}\"\nhosts = [{hosts}]\n"),
                rotated.path(),
            )
            .unwrap()
        };
        let new_key = with_hosts(&format!("{{ nqn = \"{KEYED}\", psk_file = \"k.psk\" }}"));
        let removed = with_hosts("{ nqn = \"nqn.2026-11.io.rpma:plain\" }");
        let keyless = with_hosts(&format!("{{ nqn = \"{KEYED}\" }}"));
        let answer = |now: &Config| auth_between(&old, now, 0x42).0;
        assert_eq!(refusal(&answer(&new_key)), Some(RefusalReason::AuthFailed));
        assert_eq!(
            refusal(&answer(&removed)),
            Some(RefusalReason::HostNotAllowed)
        );
        let steps = answer(&keyless);
        assert!(
            matches!(
                &steps[..],
                [Step::Send(_), Step::Admitted { proven: false, .. }]
            ),
            "{steps:?}"
        );
        let steps = answer(&old);
        assert!(
            matches!(
                &steps[..],
                [Step::Send(_), Step::Admitted { proven: true, .. }]
            ),
            "{steps:?}"
        );
    }

    /// What a peer says when it disconnects before it is admitted is its own text: quoted and
    /// cut like every peer text in the log (it went in whole, 8 KiB lines that could pass for
    /// the target's own words).
    #[test]
    fn a_disconnect_reason_before_admission_is_quoted_and_cut() {
        let d = tempfile::tempdir().unwrap();
        let c = cfg(d.path());
        let long = format!("\") accepted: host {KEYED} proven {}", "x".repeat(7000));
        for connect_first in [false, true] {
            let mut h = TargetHandshake::new();
            if connect_first {
                h.on_message(&c, &bytes(Message::Connect(connect(KEYED, SUB))));
            }
            let bye = Message::Disconnect(rpma_common::proto::Disconnect {
                reason: long.clone(),
            });
            let steps = h.on_message(&c, &bytes(bye));
            let [Step::Abandoned { why, .. }] = &steps[..] else {
                panic!("{steps:?}")
            };
            assert!(why.len() < 500, "{} bytes", why.len());
            assert!(why.contains("\"\\\") accepted"), "{why}");
        }
    }

    #[test]
    fn wrong_key_is_refused_auth_failed() {
        let (steps, confirm, _) = run_auth(0x43);
        assert_eq!(refusal(&steps), Some(RefusalReason::AuthFailed));
        assert!(
            confirm.is_none(),
            "the target must not prove itself to a host that failed"
        );
    }

    #[test]
    fn refusals() {
        let d = tempfile::tempdir().unwrap();
        let c = cfg(d.path());
        let r = |m: Vec<u8>| refusal(&TargetHandshake::new().on_message(&c, &m));
        assert_eq!(
            r(bytes(Message::Connect(connect(
                "nqn.2026-11.io.rpma:plain",
                "nqn.2026-11.io.rpma:x"
            )))),
            Some(RefusalReason::UnknownSubsystem)
        );
        assert_eq!(
            r(bytes(Message::Connect(connect(
                "nqn.2026-11.io.rpma:other",
                SUB
            )))),
            Some(RefusalReason::HostNotAllowed)
        );
        for v in [1, proto::PROTO_VERSION + 1] {
            let mut other = bytes(Message::Connect(connect("nqn.2026-11.io.rpma:plain", SUB)));
            other[0] = v;
            assert_eq!(r(other), Some(RefusalReason::VersionUnsupported), "{v}");
        }
        assert_eq!(r(vec![1, 2, 3]), Some(RefusalReason::ProtocolError));
        assert_eq!(
            r(KeepAlive { seq: 1 }.encode().to_vec()),
            Some(RefusalReason::ProtocolError)
        );
    }

    #[test]
    fn wrong_message_during_auth() {
        let d = tempfile::tempdir().unwrap();
        let c = cfg(d.path());
        let mut h = TargetHandshake::new();
        h.on_message(&c, &bytes(Message::Connect(connect(KEYED, SUB))));
        let steps = h.on_message(&c, &KeepAlive { seq: 1 }.encode());
        assert!(
            matches!(&steps[..], [Step::Refuse { host_nqn: Some(n), .. }] if n.as_str() == KEYED)
        );
        assert!(h.is_done());
    }
}
