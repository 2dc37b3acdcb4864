//! Mutual challenge-response authentication with a pre-shared key (HMAC-SHA256), as a sans-I/O
//! state machine pair: the caller moves messages, these types decide.
//!
//! ```text
//! host                                   target
//!  |-- Connect {host NQN, subsys NQN, host id} -->|
//!  |<-- AuthChallenge {Nt} -----------------------|  Nt: 32 fresh random bytes
//!  |-- AuthResponse {Nh, MACh} ------------------>|  Nh: 32 fresh random bytes
//!  |<-- AuthConfirm {MACt} -----------------------|  only if MACh verified
//!
//! MACh = HMAC-SHA256(psk, "rpma-auth-v1 host"   || T)
//! MACt = HMAC-SHA256(psk, "rpma-auth-v1 target" || T)
//! T    = len(host NQN) u16 LE || host NQN || len(subsys NQN) u16 LE || subsys NQN || host id (16)
//!        || Nt || Nh
//! ```
//!
//! Why this resists what it must:
//! - Replay: `MACh` covers the target's fresh `Nt`, `MACt` the host's fresh `Nh`; a recorded
//!   response or confirmation fails against new nonces.
//! - Reflection: the two proofs carry different labels, so a target's proof is never a valid host
//!   proof (or vice versa), and a side refuses a peer nonce equal to its own.
//! - Mix-and-match: both proofs bind both NQNs and the host id, so a proof for one subsystem or
//!   host is no proof for another.
//! - Timing: proofs are compared in constant time (`hmac`'s `verify_slice`).
//!
//! The target proves itself only after the host did, so a party without the key learns no proof
//! of the target's from a failed attempt. Relay (a man in the middle forwarding both ways) is not
//! prevented by any challenge-response without channel binding; the transport is where that
//! belongs.

use std::fmt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::messages::{AuthChallenge, AuthConfirm, AuthResponse, HostId};
use super::nqn::Nqn;

type HmacSha256 = Hmac<Sha256>;

const HOST_LABEL: &[u8] = b"rpma-auth-v1 host";
const TARGET_LABEL: &[u8] = b"rpma-auth-v1 target";

/// Shortest key, in bytes.
pub const MIN_PSK_LEN: usize = 32;
/// Longest key, in bytes.
pub const MAX_PSK_LEN: usize = 64;

/// Errors of authentication and of loading keys.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// The system's random source failed.
    #[error("cannot draw a random nonce")]
    Random(#[source] getrandom::Error),
    /// The host's proof did not verify: wrong key, replayed or reflected response.
    #[error("the host's proof of the pre-shared key did not verify")]
    HostProofInvalid,
    /// The target's proof did not verify: wrong key, replayed or reflected confirmation.
    #[error("the target's proof of the pre-shared key did not verify")]
    TargetProofInvalid,
    /// The peer sent back our own nonce.
    #[error("the peer echoed our nonce (reflection)")]
    NonceReflected,
    /// A key file could not be read.
    #[error("cannot read key file {path}")]
    ReadKey {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A key file that group or others may access.
    #[error("key file {path} has mode {mode:04o}: it must not be accessible by group or others (chmod 600)")]
    KeyPermissions {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A key that is not hex.
    #[error("key {origin} is not hexadecimal")]
    KeyNotHex {
        /// Where it came from.
        origin: String,
    },
    /// A key of the wrong length.
    #[error("key {origin} is {len} bytes; it must be {MIN_PSK_LEN} to {MAX_PSK_LEN} bytes ({} to {} hex digits)", MIN_PSK_LEN * 2, MAX_PSK_LEN * 2)]
    KeyLength {
        /// Where it came from.
        origin: String,
        /// Its length in bytes.
        len: usize,
    },
}

/// Result of authentication.
pub type Result<T> = std::result::Result<T, AuthError>;

/// The most bytes a key file may hold: a key's hex digits and room for whitespace.
const KEY_FILE_MAX: usize = 4 * MAX_PSK_LEN;

/// A pre-shared key. Its bytes are never printed and are zeroed on drop.
#[derive(Clone)]
pub struct Psk(Vec<u8>);

impl Psk {
    /// A key from raw bytes.
    ///
    /// # Errors
    /// [`AuthError::KeyLength`] outside [`MIN_PSK_LEN`]..=[`MAX_PSK_LEN`].
    pub fn new(bytes: &[u8]) -> Result<Self> {
        if !(MIN_PSK_LEN..=MAX_PSK_LEN).contains(&bytes.len()) {
            return Err(AuthError::KeyLength {
                origin: "given".into(),
                len: bytes.len(),
            });
        }
        Ok(Psk(bytes.to_vec()))
    }

    /// A key from hex digits (surrounding whitespace ignored), as `openssl rand -hex 32` prints.
    ///
    /// # Errors
    /// [`AuthError::KeyNotHex`], [`AuthError::KeyLength`].
    pub fn from_hex(s: &str) -> Result<Self> {
        Self::parse_hex(s, "given")
    }

    fn parse_hex(s: &str, origin: &str) -> Result<Self> {
        let s = s.trim();
        let not_hex = || AuthError::KeyNotHex {
            origin: origin.to_owned(),
        };
        if !s.len().is_multiple_of(2) || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(not_hex());
        }
        let bytes: Vec<u8> = (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|_| not_hex()))
            .collect::<Result<_>>()?;
        let mut bytes = bytes;
        let key = Psk::new(&bytes).map_err(|_| AuthError::KeyLength {
            origin: origin.to_owned(),
            len: bytes.len(),
        });
        bytes.iter_mut().for_each(|b| *b = 0);
        std::hint::black_box(&bytes);
        key
    }

    /// Loads a key file: hex digits, readable by its owner only (no group or other bits).
    ///
    /// # Errors
    /// [`AuthError::ReadKey`], [`AuthError::KeyPermissions`], [`AuthError::KeyNotHex`],
    /// [`AuthError::KeyLength`].
    pub fn from_file(path: &Path) -> Result<Self> {
        let read_err = |source| AuthError::ReadKey {
            path: path.to_owned(),
            source,
        };
        // One opening, checked and read: the file whose mode was checked is the file read
        // (a path checked, then read again, could name another file by then).
        let mut f = std::fs::File::open(path).map_err(read_err)?;
        let mode = f.metadata().map_err(read_err)?.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(AuthError::KeyPermissions {
                path: path.to_owned(),
                mode,
            });
        }
        // A key is at most 2 * MAX_PSK_LEN hex digits and some whitespace: more is not a key
        // (and is not read whole).
        let mut text = Vec::with_capacity(KEY_FILE_MAX + 1);
        std::io::Read::read_to_end(
            &mut std::io::Read::take(&mut f, KEY_FILE_MAX as u64 + 1),
            &mut text,
        )
        .map_err(read_err)?;
        let origin = path.display().to_string();
        let parsed = if text.len() > KEY_FILE_MAX {
            Err(AuthError::KeyLength {
                origin,
                len: text.len() / 2,
            })
        } else {
            match std::str::from_utf8(&text) {
                Ok(t) => Self::parse_hex(t, &origin),
                Err(_) => Err(AuthError::KeyNotHex { origin }),
            }
        };
        // The key's text is not left in freed memory.
        text.iter_mut().for_each(|b| *b = 0);
        std::hint::black_box(&text);
        parsed
    }

    fn mac(&self, label: &[u8], t: &Transcript<'_>) -> HmacSha256 {
        // HMAC takes keys of any length; the length was checked at construction.
        let mut m = <HmacSha256 as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
        m.update(label);
        for nqn in [t.ctx.host_nqn.as_str(), t.ctx.subsystem_nqn.as_str()] {
            // NQNs are at most 223 bytes, so the length always fits a u16.
            m.update(&(nqn.len() as u16).to_le_bytes());
            m.update(nqn.as_bytes());
        }
        m.update(&t.ctx.host_id.0);
        m.update(t.target_nonce);
        m.update(t.host_nonce);
        m
    }
}

impl Drop for Psk {
    fn drop(&mut self) {
        for b in self.0.iter_mut() {
            // SAFETY: `b` is a valid, aligned, exclusive reference into our own buffer; a volatile
            // write keeps the compiler from eliding the zeroing of memory about to be freed.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
    }
}

impl fmt::Debug for Psk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Psk({} bytes, redacted)", self.0.len())
    }
}

impl PartialEq for Psk {
    /// Constant-time in the key bytes (a reload compares keys to tell a changed host).
    fn eq(&self, other: &Self) -> bool {
        self.0.len() == other.0.len()
            && self
                .0
                .iter()
                .zip(&other.0)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl Eq for Psk {}

/// What both proofs are bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthContext {
    /// The host's NQN from Connect.
    pub host_nqn: Nqn,
    /// The subsystem's NQN from Connect.
    pub subsystem_nqn: Nqn,
    /// The host id from Connect.
    pub host_id: HostId,
}

struct Transcript<'a> {
    ctx: &'a AuthContext,
    target_nonce: &'a [u8; 32],
    host_nonce: &'a [u8; 32],
}

fn nonce() -> Result<[u8; 32]> {
    let mut n = [0u8; 32];
    getrandom::fill(&mut n).map_err(AuthError::Random)?;
    Ok(n)
}

/// Target side, before the challenge is sent.
#[derive(Debug)]
pub struct TargetAuth;

impl TargetAuth {
    /// Starts an exchange: returns the state awaiting the host's response and the challenge to
    /// send.
    ///
    /// # Errors
    /// [`AuthError::Random`].
    pub fn start(psk: Psk, ctx: AuthContext) -> Result<(TargetAwaitingResponse, AuthChallenge)> {
        let target_nonce = nonce()?;
        Ok((
            TargetAwaitingResponse {
                psk,
                ctx,
                target_nonce,
            },
            AuthChallenge { target_nonce },
        ))
    }
}

/// Target side, challenge sent.
#[derive(Debug)]
pub struct TargetAwaitingResponse {
    psk: Psk,
    ctx: AuthContext,
    target_nonce: [u8; 32],
}

impl TargetAwaitingResponse {
    /// Checks the host's response; on success the host is authenticated and the returned
    /// confirmation proves the target to the host.
    ///
    /// # Errors
    /// [`AuthError::NonceReflected`], [`AuthError::HostProofInvalid`].
    pub fn on_response(self, resp: &AuthResponse) -> Result<AuthConfirm> {
        if resp.host_nonce == self.target_nonce {
            return Err(AuthError::NonceReflected);
        }
        let t = Transcript {
            ctx: &self.ctx,
            target_nonce: &self.target_nonce,
            host_nonce: &resp.host_nonce,
        };
        self.psk
            .mac(HOST_LABEL, &t)
            .verify_slice(&resp.host_mac)
            .map_err(|_| AuthError::HostProofInvalid)?;
        let target_mac = self
            .psk
            .mac(TARGET_LABEL, &t)
            .finalize()
            .into_bytes()
            .into();
        Ok(AuthConfirm { target_mac })
    }
}

/// Host side, Connect sent, awaiting the challenge.
#[derive(Debug)]
pub struct HostAuth {
    psk: Psk,
    ctx: AuthContext,
}

impl HostAuth {
    /// A host that holds `psk` and sent a Connect matching `ctx`.
    pub fn new(psk: Psk, ctx: AuthContext) -> Self {
        HostAuth { psk, ctx }
    }

    /// Answers the target's challenge.
    ///
    /// # Errors
    /// [`AuthError::Random`]; [`AuthError::NonceReflected`] if the challenge repeats the nonce just
    /// drawn (only a broken random source could cause it).
    pub fn on_challenge(self, ch: &AuthChallenge) -> Result<(HostAwaitingConfirm, AuthResponse)> {
        let host_nonce = nonce()?;
        if host_nonce == ch.target_nonce {
            return Err(AuthError::NonceReflected);
        }
        let t = Transcript {
            ctx: &self.ctx,
            target_nonce: &ch.target_nonce,
            host_nonce: &host_nonce,
        };
        let host_mac = self.psk.mac(HOST_LABEL, &t).finalize().into_bytes().into();
        Ok((
            HostAwaitingConfirm {
                psk: self.psk,
                ctx: self.ctx,
                target_nonce: ch.target_nonce,
                host_nonce,
            },
            AuthResponse {
                host_nonce,
                host_mac,
            },
        ))
    }
}

/// Host side, response sent, awaiting the target's proof.
#[derive(Debug)]
pub struct HostAwaitingConfirm {
    psk: Psk,
    ctx: AuthContext,
    target_nonce: [u8; 32],
    host_nonce: [u8; 32],
}

impl HostAwaitingConfirm {
    /// Checks the target's proof. Only after `Ok` may the host trust the ConnectResponse.
    ///
    /// # Errors
    /// [`AuthError::TargetProofInvalid`].
    pub fn on_confirm(self, c: &AuthConfirm) -> Result<()> {
        let t = Transcript {
            ctx: &self.ctx,
            target_nonce: &self.target_nonce,
            host_nonce: &self.host_nonce,
        };
        self.psk
            .mac(TARGET_LABEL, &t)
            .verify_slice(&c.target_mac)
            .map_err(|_| AuthError::TargetProofInvalid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn psk(b: u8) -> Psk {
        Psk::new(&[b; 32]).unwrap()
    }

    fn ctx() -> AuthContext {
        AuthContext {
            host_nqn: Nqn::new("nqn.2026-11.io.rpma:host1").unwrap(),
            subsystem_nqn: Nqn::new("nqn.2026-11.io.rpma:demo").unwrap(),
            host_id: HostId([7; 16]),
        }
    }

    #[test]
    fn mutual_success() {
        let (t, ch) = TargetAuth::start(psk(1), ctx()).unwrap();
        let (h, resp) = HostAuth::new(psk(1), ctx()).on_challenge(&ch).unwrap();
        let conf = t.on_response(&resp).unwrap();
        h.on_confirm(&conf).unwrap();
    }

    #[test]
    fn wrong_key_fails_both_ways() {
        let (t, ch) = TargetAuth::start(psk(1), ctx()).unwrap();
        let (_, resp) = HostAuth::new(psk(2), ctx()).on_challenge(&ch).unwrap();
        assert!(matches!(
            t.on_response(&resp),
            Err(AuthError::HostProofInvalid)
        ));

        // A target with the wrong key cannot prove itself to a host, even given a valid-looking
        // exchange: a rogue target can only guess the confirmation.
        let (_, ch) = TargetAuth::start(psk(9), ctx()).unwrap();
        let (h, _) = HostAuth::new(psk(1), ctx()).on_challenge(&ch).unwrap();
        assert!(matches!(
            h.on_confirm(&AuthConfirm {
                target_mac: [0; 32]
            }),
            Err(AuthError::TargetProofInvalid)
        ));
    }

    #[test]
    fn proof_is_bound_to_the_subsystem() {
        let (t, ch) = TargetAuth::start(psk(1), ctx()).unwrap();
        let mut other = ctx();
        other.subsystem_nqn = Nqn::new("nqn.2026-11.io.rpma:other").unwrap();
        let (_, resp) = HostAuth::new(psk(1), other).on_challenge(&ch).unwrap();
        assert!(matches!(
            t.on_response(&resp),
            Err(AuthError::HostProofInvalid)
        ));
    }

    #[test]
    fn replayed_response_fails() {
        let (t1, ch1) = TargetAuth::start(psk(1), ctx()).unwrap();
        let (_, resp1) = HostAuth::new(psk(1), ctx()).on_challenge(&ch1).unwrap();
        t1.on_response(&resp1).unwrap();
        // An eavesdropper replays the recorded response to a new session.
        let (t2, ch2) = TargetAuth::start(psk(1), ctx()).unwrap();
        assert_ne!(ch1.target_nonce, ch2.target_nonce, "nonces must be fresh");
        assert!(matches!(
            t2.on_response(&resp1),
            Err(AuthError::HostProofInvalid)
        ));
    }

    #[test]
    fn replayed_confirm_fails() {
        let (t1, ch1) = TargetAuth::start(psk(1), ctx()).unwrap();
        let (h1, resp1) = HostAuth::new(psk(1), ctx()).on_challenge(&ch1).unwrap();
        let conf1 = t1.on_response(&resp1).unwrap();
        h1.on_confirm(&conf1).unwrap();
        // A rogue target replays the old challenge and confirmation to the host: the host's fresh
        // nonce makes the old confirmation worthless.
        let (h2, resp2) = HostAuth::new(psk(1), ctx()).on_challenge(&ch1).unwrap();
        assert_ne!(resp1.host_nonce, resp2.host_nonce, "nonces must be fresh");
        assert!(matches!(
            h2.on_confirm(&conf1),
            Err(AuthError::TargetProofInvalid)
        ));
    }

    #[test]
    fn reflected_proofs_fail() {
        // Same nonces on both sides: the target's proof offered as the host's proof must fail
        // because of the labels, not merely because of fresh nonces.
        let target_nonce = [3u8; 32];
        let host_nonce = [4u8; 32];
        let c = ctx();
        let t = Transcript {
            ctx: &c,
            target_nonce: &target_nonce,
            host_nonce: &host_nonce,
        };
        let target_mac: [u8; 32] = psk(1).mac(TARGET_LABEL, &t).finalize().into_bytes().into();
        let host_mac: [u8; 32] = psk(1).mac(HOST_LABEL, &t).finalize().into_bytes().into();
        assert_ne!(target_mac, host_mac);

        let target = TargetAwaitingResponse {
            psk: psk(1),
            ctx: ctx(),
            target_nonce,
        };
        let reflected = AuthResponse {
            host_nonce,
            host_mac: target_mac,
        };
        assert!(matches!(
            target.on_response(&reflected),
            Err(AuthError::HostProofInvalid)
        ));

        let host = HostAwaitingConfirm {
            psk: psk(1),
            ctx: ctx(),
            target_nonce,
            host_nonce,
        };
        assert!(matches!(
            host.on_confirm(&AuthConfirm {
                target_mac: host_mac
            }),
            Err(AuthError::TargetProofInvalid)
        ));
    }

    #[test]
    fn echoed_nonce_is_refused() {
        let (t, ch) = TargetAuth::start(psk(1), ctx()).unwrap();
        let resp = AuthResponse {
            host_nonce: ch.target_nonce,
            host_mac: [0; 32],
        };
        assert!(matches!(
            t.on_response(&resp),
            Err(AuthError::NonceReflected)
        ));
    }

    #[test]
    fn nonces_are_fresh_each_time() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..64 {
            let (_, ch) = TargetAuth::start(psk(1), ctx()).unwrap();
            assert!(seen.insert(ch.target_nonce));
        }
    }

    #[test]
    fn psk_parsing() {
        let hex = "ab".repeat(32);
        assert_eq!(Psk::from_hex(&format!("{hex}\n")).unwrap(), psk(0xab));
        assert!(matches!(
            Psk::from_hex("zz"),
            Err(AuthError::KeyNotHex { .. })
        ));
        assert!(matches!(
            Psk::from_hex("abc"),
            Err(AuthError::KeyNotHex { .. })
        ));
        assert!(matches!(
            Psk::from_hex(&"ab".repeat(31)),
            Err(AuthError::KeyLength { len: 31, .. })
        ));
        assert!(matches!(
            Psk::from_hex(&"ab".repeat(65)),
            Err(AuthError::KeyLength { len: 65, .. })
        ));
        assert!(matches!(
            Psk::new(&[0; 16]),
            Err(AuthError::KeyLength { len: 16, .. })
        ));
        assert_ne!(psk(1), psk(2));
        assert!(!format!("{:?}", psk(0xab)).contains("ab, "));
    }

    #[test]
    fn psk_file_checks() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("k.psk");
        std::fs::write(&p, "cd".repeat(32)).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(Psk::from_file(&p).unwrap(), psk(0xcd));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert!(matches!(
            Psk::from_file(&p),
            Err(AuthError::KeyPermissions { mode: 0o640, .. })
        ));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&p, "cd".repeat(8)).unwrap();
        assert!(matches!(
            Psk::from_file(&p),
            Err(AuthError::KeyLength { len: 8, .. })
        ));
        assert!(matches!(
            Psk::from_file(&d.path().join("missing")),
            Err(AuthError::ReadKey { .. })
        ));
        // A file far longer than any key is not read whole: refused by its length, not by
        // what it holds (it was read to its end, then found not to be hex).
        std::fs::write(&p, "x".repeat(64 << 10)).unwrap();
        assert!(matches!(
            Psk::from_file(&p),
            Err(AuthError::KeyLength { len, .. }) if len > MAX_PSK_LEN
        ));
        // Whitespace around the longest key is fine.
        std::fs::write(&p, format!("  {}\n\n", "cd".repeat(MAX_PSK_LEN))).unwrap();
        assert!(Psk::from_file(&p).is_ok());
    }
}
