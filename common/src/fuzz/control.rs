//! The control-plane messages and the challenge-response under arbitrary bytes.

use crate::proto::auth::{
    AuthContext, HostAuth, HostAwaitingConfirm, Psk, TargetAuth, TargetAwaitingResponse,
};
use crate::proto::nqn::Nqn;
use crate::proto::{
    peek_type, AuthChallenge, AuthResponse, HostId, Message, MessageType, MAX_MESSAGE_SIZE,
};

/// The key both fuzzed exchanges hold (the fuzzer may well find it: a proof must still fail,
/// because it is bound to a nonce drawn after the input was written).
const PSK: [u8; 32] = [0x42; 32];

/// Checks `data` as one message (what a receive slot hands the daemon), then as a conversation
/// of u16-LE-length-prefixed messages:
/// - a decoded message encodes, decodes back to itself, and (hot-path messages, whose layouts are
///   fixed) encodes to exactly the input; its header agrees with it; an oversize input is
///   refused; errors display;
/// - in the conversation, the target's side of the challenge-response (started at each
///   Connect, with a fresh nonce) refuses every AuthResponse, and the host's side (answering
///   each AuthChallenge) refuses every AuthConfirm: no input forges, replays or reflects a
///   proof.
pub fn control_message(data: &[u8]) {
    // The whole input is one message; then the same bytes as a conversation.
    let _ = check_message(data);
    let psk = || Psk::new(&PSK).expect("a 32-byte key");
    let mut target = None;
    let mut host = None;
    for m in messages(data) {
        let Some(msg) = check_message(m) else {
            continue;
        };
        match msg {
            Message::Connect(c) => {
                let ctx = AuthContext {
                    host_nqn: c.host_nqn,
                    subsystem_nqn: c.subsystem_nqn,
                    host_id: c.host_id,
                };
                let (state, _challenge) = TargetAuth::start(psk(), ctx).expect("a nonce");
                target = Some(state);
            }
            Message::AuthResponse(r) => {
                if let Some(t) = target.take() {
                    refuse_response(t, &r);
                }
            }
            Message::AuthChallenge(ch) => host = Some(answer(psk(), &ch)),
            Message::AuthConfirm(c) => {
                if let Some(h) = host.take() {
                    let r = h.on_confirm(&c);
                    assert!(r.is_err(), "a forged AuthConfirm verified: {c:?}");
                }
            }
            _ => {}
        }
    }
}

fn refuse_response(t: TargetAwaitingResponse, r: &AuthResponse) {
    let out = t.on_response(r);
    assert!(out.is_err(), "a forged AuthResponse verified: {r:?}");
}

fn answer(psk: Psk, ch: &AuthChallenge) -> HostAwaitingConfirm {
    let ctx = AuthContext {
        host_nqn: Nqn::new("nqn.2026-11.io.rpma:fuzz-host").expect("a valid NQN"),
        subsystem_nqn: Nqn::new("nqn.2026-11.io.rpma:fuzz").expect("a valid NQN"),
        host_id: HostId([7; 16]),
    };
    let (state, _response) = HostAuth::new(psk, ctx)
        .on_challenge(ch)
        .expect("a fresh nonce");
    state
}

/// The u16-LE-length-prefixed pieces of `data` (the last one may be cut short).
fn messages(mut data: &[u8]) -> impl Iterator<Item = &[u8]> {
    std::iter::from_fn(move || {
        let (len, rest) = data.split_first_chunk::<2>()?;
        let n = usize::from(u16::from_le_bytes(*len)).min(rest.len());
        let (m, rest) = rest.split_at(n);
        data = rest;
        Some(m)
    })
}

/// The message `buf` holds, if any, after checking it.
fn check_message(buf: &[u8]) -> Option<Message> {
    let decoded = Message::decode(buf);
    if buf.len() > MAX_MESSAGE_SIZE {
        assert!(
            decoded.is_err(),
            "a message of {} bytes was accepted",
            buf.len()
        );
    }
    let m = match decoded {
        Ok(m) => m,
        Err(e) => {
            let _ = e.to_string();
            return None;
        }
    };
    assert_eq!(peek_type(buf).ok(), Some(m.message_type()));
    let bytes = m.encode().expect("a decoded message encodes");
    assert!(bytes.len() <= MAX_MESSAGE_SIZE);
    assert_eq!(
        Message::decode(&bytes).expect("an encoded message decodes"),
        m,
        "the message does not encode back"
    );
    if matches!(
        m.message_type(),
        MessageType::FlushRequest | MessageType::FlushResponse | MessageType::KeepAlive
    ) {
        assert_eq!(bytes, buf, "a fixed layout decoded from other bytes");
    }
    Some(m)
}
