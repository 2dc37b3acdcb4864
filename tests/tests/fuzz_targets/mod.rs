#![allow(dead_code)] // the seed writer uses only part of it
//! The fuzz targets of every crate (fuzz/), by the corpus directory's name: their entry points
//! and seeds, for the corpus replay test (tests/tests/fuzz_corpus.rs) and the seed writer
//! (tests/examples/fuzz_seeds.rs). Each crate owns its parsers' entry points
//! behind a test-only feature: rpma-common's `wire-testing`, rpma-initiator's and
//! rpma-target's `fuzzing`.

use std::path::PathBuf;

/// A corpus file: its name and bytes.
pub type Input = (String, Vec<u8>);

/// A fuzz target: its name, entry point and seeds.
#[derive(Debug, Clone)]
pub struct FuzzTarget {
    /// The name (its corpus directory and cargo-fuzz binary).
    pub name: &'static str,
    /// What the cargo-fuzz target calls with each input.
    pub entry: fn(&[u8]),
    /// Real inputs built with the crates' encoders, each with a file name.
    pub seeds: Vec<Input>,
}

/// Every target.
pub fn targets() -> Vec<FuzzTarget> {
    use rpma_common::fuzz as common;
    use rpma_initiator::nbd::fuzz as nbd;
    use rpma_target::handshake::fuzz as handshake;
    let target = |name, entry: Option<fn(&[u8])>, seeds| FuzzTarget {
        name,
        entry: entry.expect("every listed target has an entry point"),
        seeds,
    };
    let mut v = Vec::new();
    for name in common::TARGETS {
        v.push(target(name, common::entry(name), common::seeds(name)));
    }
    for name in nbd::TARGETS {
        v.push(target(name, nbd::entry(name), nbd::seeds(name)));
    }
    for name in handshake::TARGETS {
        v.push(target(name, handshake::entry(name), handshake::seeds(name)));
    }
    v
}

/// The committed corpus of `target`: fuzz/corpus/NAME.
pub fn corpus_dir(target: &str) -> PathBuf {
    rpma_tests::repo_file("fuzz/corpus").join(target)
}
