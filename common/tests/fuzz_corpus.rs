//! Replays the committed fuzz corpus (fuzz/corpus/<target>/) and the seeds of rpma-common's fuzz
//! targets through the entry points the cargo-fuzz targets call: on stable Rust, in plain
//! `cargo test`, so that every crash the fuzzer found stays fixed. Each entry asserts the
//! parser's invariants; a panic names the file.

use std::path::{Path, PathBuf};

use rpma_common::fuzz::{entry, seeds, TARGETS};

fn corpus(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target)
}

/// Runs `f` on `input`, naming `what` if it panics.
fn replay(f: fn(&[u8]), what: &str, input: &[u8]) {
    if std::panic::catch_unwind(|| f(input)).is_err() {
        panic!("{what} ({} bytes) broke an invariant", input.len());
    }
}

#[test]
fn every_corpus_file_and_seed_keeps_the_invariants() {
    for t in TARGETS {
        let f = entry(t).expect("a known target");
        let dir = corpus(t);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{}: an empty corpus", dir.display());
        for p in &files {
            replay(f, &p.display().to_string(), &std::fs::read(p).unwrap());
        }
        let seeds = seeds::for_target(t);
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
        for input in [&[][..], &[0], &[0xFF], &[1, 0], &[0xFF, 0xFF, 0xFF]] {
            replay(f, &format!("{t} {input:?}"), input);
        }
    }
}
