//! Fuzz entry points of the NBD server's parsers (feature `fuzzing`; test-only, not part of
//! the API): [`handshake`] (the option haggling, fuzz target `nbd_handshake`) and [`requests`]
//! (splitting and judging transmission requests, `nbd_requests`). Each takes arbitrary bytes,
//! drives the server's own code, and panics only when an invariant breaks. The cargo-fuzz
//! targets in `fuzz/` call them; `tests/tests/fuzz_corpus.rs` replays the committed corpus
//! and the [`seeds`] through them on stable Rust.

pub use super::handshake::fuzz::handshake;
pub use super::transmission::fuzz::requests;

/// The names of the targets, as the corpus directories are named.
pub const TARGETS: [&str; 2] = ["nbd_handshake", "nbd_requests"];

/// The entry point of target `name` (one of [`TARGETS`]).
pub fn entry(name: &str) -> Option<fn(&[u8])> {
    match name {
        "nbd_handshake" => Some(handshake),
        "nbd_requests" => Some(requests),
        _ => None,
    }
}

/// Real inputs of target `name` (client conversations and request streams built with the
/// protocol's encoders), each with a file name for the corpus.
pub fn seeds(name: &str) -> Vec<(String, Vec<u8>)> {
    let v = match name {
        "nbd_handshake" => super::handshake::fuzz::seeds(),
        "nbd_requests" => super::transmission::fuzz::seeds(),
        _ => Vec::new(),
    };
    v.into_iter()
        .enumerate()
        .map(|(i, b)| (format!("seed-{name}-{i:02}"), b))
        .collect()
}
