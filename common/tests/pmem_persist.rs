//! Persist, flush and drain: unaligned ranges, range checks, the trait as an object. That a
//! persisted page-cache range leaves no dirty page behind (cachestat(2)) is tested in
//! tests/tests/pmem_durability.rs.

use std::fs;
use std::path::Path;
use std::sync::Arc;

use rpma_common::pmem::{Domain, Durability, Error, Mapping, OpenOptions, Persist};

fn scratch() -> tempfile::TempDir {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scratch");
    fs::create_dir_all(&dir).unwrap();
    tempfile::Builder::new()
        .prefix("pmem-persist-")
        .tempdir_in(dir)
        .unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Every kind of mapping the tests can make on this machine.
fn mappings(dir: &Path) -> Vec<Mapping> {
    let shm = tempfile::Builder::new()
        .prefix("rpma-pmem-persist-")
        .tempfile_in("/dev/shm")
        .unwrap();
    vec![
        OpenOptions::new(dir.join("pc.pmem"))
            .size(64 << 10)
            .create(true)
            .open()
            .unwrap(),
        OpenOptions::new(dir.join("forced.pmem"))
            .size(64 << 10)
            .create(true)
            .force_dax(true)
            .open()
            .unwrap(),
        OpenOptions::new(shm.path())
            .size(64 << 10)
            .force_dax(true)
            .open()
            .unwrap(),
        OpenOptions::new(shm.path()).size(64 << 10).open().unwrap(),
        Mapping::anonymous(64 << 10).unwrap(),
    ]
}

fn expected(m: &Mapping) -> Durability {
    if m.domain() == Domain::Volatile {
        Durability::VisibleOnly
    } else {
        Durability::Durable
    }
}

#[test]
fn unaligned_ranges_persist_on_every_domain() {
    let dir = scratch();
    // (offset, len): inside a line, across a line, across a page, the last byte, the whole map.
    let ranges = [
        (1, 1),
        (61, 7),
        (4093, 10),
        (4096 * 3 - 1, 4096 + 2),
        ((64 << 10) - 1, 1),
        (0, 64 << 10),
        (777, 0),
    ];
    for m in mappings(dir.path()) {
        for (i, &(off, len)) in ranges.iter().enumerate() {
            let data = pattern(len, i as u8);
            m.write_at(off, &data).unwrap();
            assert_eq!(
                m.persist(off, len).unwrap(),
                expected(&m),
                "{m:?} {off}+{len}"
            );
            let mut back = vec![0u8; len];
            m.read_at(off, &mut back).unwrap();
            assert_eq!(back, data, "{m:?} {off}+{len}");
        }
        // flush several unaligned ranges, then one drain.
        for &(off, len) in &ranges {
            m.flush(off, len).unwrap();
        }
        assert_eq!(m.drain().unwrap(), expected(&m), "{m:?}");
        // A drain with nothing flushed is fine too.
        assert_eq!(m.drain().unwrap(), expected(&m), "{m:?}");
    }
}

#[test]
fn page_cache_persist_reaches_the_file() {
    let dir = scratch();
    let path = dir.path().join("ns.pmem");
    let m = OpenOptions::new(&path)
        .size(16384)
        .create(true)
        .open()
        .unwrap();
    let data = pattern(5000, 9);
    m.write_at(4000, &data).unwrap();
    assert_eq!(m.persist(4000, 5000).unwrap(), Durability::Durable);
    m.write_at(10, b"flushed").unwrap();
    m.flush(10, 7).unwrap();
    assert_eq!(m.drain().unwrap(), Durability::Durable);
    // Read through the file, not the mapping.
    let file = fs::read(&path).unwrap();
    assert_eq!(&file[4000..9000], &data[..]);
    assert_eq!(&file[10..17], b"flushed");
}

#[test]
fn out_of_range_is_an_error_and_touches_nothing() {
    let dir = scratch();
    for m in mappings(dir.path()) {
        let len = m.len();
        for (off, n) in [(len, 1), (len - 1, 2), (usize::MAX, 2), (1, usize::MAX)] {
            let err = m.persist(off, n).unwrap_err();
            assert!(
                matches!(err, Error::OutOfRange { mapping_len, .. } if mapping_len == len),
                "{err:?}"
            );
            assert!(m.flush(off, n).is_err());
        }
        for (off, n) in [(len, 1), (len - 1, 2), (usize::MAX, 2)] {
            let err = m.write_at(off, &[1, 2][..n]).unwrap_err();
            assert!(matches!(err, Error::OutOfRange { .. }), "{err:?}");
            let mut buf = [0u8; 2];
            let err = m.read_at(off, &mut buf[..n]).unwrap_err();
            assert!(matches!(err, Error::OutOfRange { .. }), "{err:?}");
        }
        let mut last = [9u8; 1];
        m.read_at(len - 1, &mut last).unwrap();
        assert_ne!(last, [1], "a refused write landed");
        assert!(err_text(&m).contains("outside"));
        // The range [len, len) is empty and allowed.
        assert!(m.persist(len, 0).is_ok());
    }
}

fn err_text(m: &Mapping) -> String {
    m.persist(m.len(), 1).unwrap_err().to_string()
}

#[test]
fn persist_works_through_a_shared_trait_object() {
    let dir = scratch();
    let m = OpenOptions::new(dir.path().join("ns.pmem"))
        .size(8192)
        .create(true)
        .open()
        .unwrap();
    m.write_at(0, &pattern(8192, 1)).unwrap();
    let p: Arc<dyn Persist> = Arc::new(m);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let p = Arc::clone(&p);
            std::thread::spawn(move || {
                p.flush(t * 2048, 2048).unwrap();
                p.persist(t * 2048 + 3, 100).unwrap()
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), Durability::Durable);
    }
    assert_eq!(p.drain().unwrap(), Durability::Durable);
    assert_eq!(p.domain(), Domain::PageCache);
}
