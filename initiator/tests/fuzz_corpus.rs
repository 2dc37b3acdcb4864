//! Replays the committed fuzz corpus of the NBD parsers (fuzz/corpus/nbd_*/) and their seeds
//! through the entry points the cargo-fuzz targets call: on stable Rust, in plain `cargo test`,
//! so that every crash the fuzzer found stays fixed. Each entry asserts the parser's
//! invariants; a panic names the file.

use std::path::{Path, PathBuf};

use rpma_initiator::nbd::fuzz::{entry, seeds, TARGETS};

fn replay(f: fn(&[u8]), what: &str, input: &[u8]) {
    if std::panic::catch_unwind(|| f(input)).is_err() {
        panic!("{what} ({} bytes) broke an invariant", input.len());
    }
}

#[test]
fn every_corpus_file_and_seed_keeps_the_invariants() {
    for t in TARGETS {
        let f = entry(t).expect("a known target");
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fuzz/corpus")
            .join(t);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{}: an empty corpus", dir.display());
        for p in &files {
            replay(f, &p.display().to_string(), &std::fs::read(p).unwrap());
        }
        let seeds = seeds(t);
        assert!(!seeds.is_empty(), "{t}: no seeds");
        for (name, bytes) in &seeds {
            replay(f, &format!("{t} seed {name}"), bytes);
        }
        eprintln!(
            "{t}: {} corpus file(s), {} seed(s)",
            files.len(),
            seeds.len()
        );
    }
}

#[test]
fn empty_and_tiny_inputs_are_fine() {
    for t in TARGETS {
        let f = entry(t).unwrap();
        for input in [
            &[][..],
            &[0],
            &[0xFF],
            &[1, 0],
            &[0xFF, 0xFF, 0xFF, 0xFF, 0xFF],
        ] {
            replay(f, &format!("{t} {input:?}"), input);
        }
    }
}
