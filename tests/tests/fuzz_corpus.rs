//! Replays the committed fuzz corpus (fuzz/corpus/<target>/) and the seeds of every fuzz target
//! through the entry points the cargo-fuzz targets call: on stable Rust, in plain `cargo test`,
//! so that every crash the fuzzer found stays fixed. Each entry asserts its parser's
//! invariants (the crates' `fuzz` modules say which); a panic names the input.

mod fuzz_targets;

use std::path::PathBuf;

use fuzz_targets::{corpus_dir, targets};

fn replay(f: fn(&[u8]), what: &str, input: &[u8]) {
    if std::panic::catch_unwind(|| f(input)).is_err() {
        panic!("{what} ({} bytes) broke an invariant", input.len());
    }
}

#[test]
fn every_corpus_file_and_seed_keeps_the_invariants() {
    let all = targets();
    assert_eq!(all.len(), 6, "the targets in fuzz/Cargo.toml");
    for t in all {
        let dir = corpus_dir(t.name);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{}: an empty corpus", dir.display());
        for p in &files {
            replay(
                t.entry,
                &p.display().to_string(),
                &std::fs::read(p).unwrap(),
            );
        }
        let seeds = &t.seeds;
        assert!(!seeds.is_empty(), "{}: no seeds", t.name);
        for (name, bytes) in seeds {
            assert!(
                dir.join(name).exists(),
                "{}: seed {name} is not in the corpus (cargo run -p rpma-tests --example fuzz_seeds)",
                t.name
            );
            replay(t.entry, &format!("{} seed {name}", t.name), bytes);
        }
        eprintln!(
            "{}: {} corpus file(s), {} seed(s)",
            t.name,
            files.len(),
            seeds.len()
        );
    }
}

#[test]
fn empty_and_tiny_inputs_are_fine() {
    for t in targets() {
        for input in [&[][..], &[0], &[0xFF], &[1, 0], &[0xFF; 5]] {
            replay(t.entry, &format!("{} {input:?}", t.name), input);
        }
    }
}

#[test]
fn every_target_has_its_cargo_fuzz_binary() {
    let manifest = std::fs::read_to_string(rpma_tests::repo_file("fuzz/Cargo.toml")).unwrap();
    for t in targets() {
        assert!(
            manifest.contains(&format!("name = \"{}\"", t.name)),
            "fuzz/Cargo.toml has no target {}",
            t.name
        );
        let src = rpma_tests::repo_file(&format!("fuzz/fuzz_targets/{}.rs", t.name));
        assert!(src.exists(), "{} is missing", src.display());
    }
}
