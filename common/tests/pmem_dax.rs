//! The real `dax` domain, on hardware only: a file on a DAX filesystem (`mount -o dax`, named by
//! RPMA_TEST_DAX_DIR) and a devdax character device (named by RPMA_TEST_DEVDAX). Without them
//! these tests are ignored; run them with
//!
//! ```sh
//! RPMA_TEST_DAX_DIR=/mnt/pmem0 cargo test -p rpma-common --test pmem_dax -- --ignored dax_filesystem
//! RPMA_TEST_DEVDAX=/dev/dax0.0 cargo test -p rpma-common --test pmem_dax -- --ignored devdax
//! ```
//!
//! The devdax test writes 4 KiB at the start of the device and puts the old bytes back.

use std::path::PathBuf;

use rpma_common::pmem::{Domain, Durability, OpenOptions, Persist};

/// The path an environment variable names; a missing variable fails the (ignored) test with
/// what to set, rather than passing without having tested anything.
fn env_path(var: &str) -> PathBuf {
    match std::env::var_os(var) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => panic!("set {var} to run this test (it needs real DAX hardware)"),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

/// The checks every real dax mapping passes: the domain, MAP_SYNC, durable persists on
/// unaligned ranges, and flush + drain.
fn check_real_dax(m: &rpma_common::pmem::Mapping, at: usize) {
    assert_eq!(m.domain(), Domain::Dax, "not probed as dax");
    assert_eq!(m.probed_domain(), Domain::Dax);
    assert_eq!(m.domain().to_string(), "dax", "never 'dax (forced)' here");
    assert!(m.map_sync(), "the kernel refused MAP_SYNC on a dax mapping");
    let data = pattern(4096, 5);
    m.write_at(at, &data).unwrap();
    assert_eq!(m.persist(at + 1, 4094).unwrap(), Durability::Durable);
    assert_eq!(Persist::domain(m), Domain::Dax);
    m.flush(at, 64).unwrap();
    assert_eq!(m.drain().unwrap(), Durability::Durable);
    let mut back = vec![0u8; data.len()];
    m.read_at(at, &mut back).unwrap();
    assert!(back == data);
}

#[test]
#[ignore = "requires a DAX filesystem (RPMA_TEST_DAX_DIR)"]
fn file_on_a_dax_filesystem_is_dax_with_map_sync() {
    let dir = env_path("RPMA_TEST_DAX_DIR");
    let tmp = tempfile::Builder::new()
        .prefix("rpma-pmem-dax-")
        .tempdir_in(&dir)
        .unwrap();
    let path = tmp.path().join("ns.pmem");
    let m = OpenOptions::new(&path)
        .size(2 << 20)
        .create(true)
        .open()
        .unwrap();
    check_real_dax(&m, 12_345);
    drop(m);
    // And after a reopen the bytes are in the file.
    let m = OpenOptions::new(&path).open().unwrap();
    let mut back = vec![0u8; 4096];
    m.read_at(12_345, &mut back).unwrap();
    assert!(back == pattern(4096, 5));
}

#[test]
#[ignore = "requires a devdax device (RPMA_TEST_DEVDAX)"]
fn devdax_device_is_dax_with_map_sync() {
    let dev = env_path("RPMA_TEST_DEVDAX");
    let m = OpenOptions::new(&dev).open().unwrap();
    assert!(m.len() >= 4096, "{} bytes", m.len());
    let mut old = vec![0u8; 4096];
    m.read_at(0, &mut old).unwrap();
    check_real_dax(&m, 0);
    m.write_at(0, &old).unwrap();
    assert_eq!(m.persist(0, old.len()).unwrap(), Durability::Durable);
}
