//! Writes the seeds of every fuzz target into its corpus, one file each:
//! `cargo run -p rpma-tests --example fuzz_seeds [CORPUS_DIR]` (default: the repository's
//! fuzz/corpus). Existing files are left alone; the fuzzer grows the corpus from there.

#[path = "../tests/fuzz_targets/mod.rs"]
mod fuzz_targets;

use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let root = std::env::args_os().nth(1).map(PathBuf::from);
    for t in fuzz_targets::targets() {
        let dir = root
            .as_ref()
            .map_or_else(|| fuzz_targets::corpus_dir(t.name), |r| r.join(t.name));
        std::fs::create_dir_all(&dir)?;
        let mut n = 0;
        for (name, bytes) in t.seeds {
            let p = dir.join(name);
            if !p.exists() {
                std::fs::write(&p, bytes)?;
                n += 1;
            }
        }
        println!("{}: {n} new seed(s)", dir.display());
    }
    Ok(())
}
