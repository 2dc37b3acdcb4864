//! Writes the seeds of the NBD fuzz targets into the corpus, one file each:
//! `cargo run -p rpma-initiator --features fuzzing --example nbd_fuzz_seeds [CORPUS_DIR]`
//! (default: the repository's fuzz/corpus). Existing files are left alone.

use std::path::PathBuf;

use rpma_initiator::nbd::fuzz::{seeds, TARGETS};

fn main() -> std::io::Result<()> {
    let root = std::env::args_os().nth(1).map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus"),
        PathBuf::from,
    );
    for t in TARGETS {
        let dir = root.join(t);
        std::fs::create_dir_all(&dir)?;
        let mut n = 0;
        for (name, bytes) in seeds(t) {
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
