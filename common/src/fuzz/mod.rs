//! Fuzz entry points (feature `wire-testing`; test-only, not part of the API).
//!
//! Each entry takes arbitrary bytes, drives one parser the way the engine or the daemon drives
//! it, and panics only when an invariant breaks: never on the input itself. The cargo-fuzz
//! targets in `fuzz/` call them, and `tests/tests/fuzz_corpus.rs` replays the committed corpus
//! (`fuzz/corpus/<target>/`) and the seeds below through the same functions on stable Rust, so
//! a crash the fuzzer once found stays found.
//!
//! | entry | parser | what the input is |
//! |---|---|---|
//! | [`fpdu_rx`] | `wire::rx` with `ddp`, `rdmap`, `terminate` (the receive state machine) | a settings byte, a read-size byte, then the byte stream |
//! | [`mpa_handshake`] | `wire::mpa`, `wire::caps`, the acceptor's judging of a Request | a role byte, then the peer's MPA frame |
//! | [`control_message`] | `proto` (every control message), `proto::auth` | one message; also read as u16-LE-length-prefixed messages for the auth exchanges |
//!
//! [`seeds`] builds real inputs with the crate's own encoders: the corpus starts from them.
//! The replay test and the seed writer (`cargo run -p rpma-tests --example fuzz_seeds`) live
//! in the tests crate, beside those of the other crates' targets.

mod control;
mod mpa;
mod pipe;
mod rx;
mod seeds;

pub use control::control_message;
pub use mpa::mpa_handshake;
pub use pipe::Pipe;
pub use rx::fpdu_rx;

/// The names of the targets this module serves, as the corpus directories are named.
pub const TARGETS: [&str; 3] = ["fpdu_rx", "mpa_handshake", "control_message"];

/// The entry point of target `name` (one of [`TARGETS`]).
pub fn entry(name: &str) -> Option<fn(&[u8])> {
    match name {
        "fpdu_rx" => Some(fpdu_rx),
        "mpa_handshake" => Some(mpa_handshake),
        "control_message" => Some(control_message),
        _ => None,
    }
}

/// Real inputs of target `name`, each with a file name for the corpus.
pub fn seeds(name: &str) -> Vec<(String, Vec<u8>)> {
    seeds::for_target(name)
}
