//! RDMA Writes and Reads into each kind of memory a namespace can be, over an RDMA device
//! (`RPMA_TEST_RDMA_DEVICE`/`RPMA_TEST_RDMA_ADDR`; the VM lab's Soft-RoCE): a page-cache file
//! and an anonymous simulated working copy (both registered with on-demand paging), and
//! /dev/shm (pinned). What the NIC placed must be what the CPU, the file and a Read see, or
//! the registration is refused with the reason: on Soft-RoCE, whose on-demand paging places
//! data at the wrong offset within a page, file pages are refused (docs/rdma.md, "Soft-RoCE
//! and ODP"); `diagnose_where_a_small_write_lands` with `RPMA_TRUST_RXE_ODP=trust` shows the
//! defect on a kernel, or that it is fixed.

#![cfg(feature = "rdma")]

mod fabric_util;

use std::sync::Arc;

use fabric_util::*;
use rpma_common::fabric::*;
use rpma_common::pmem::{Mapping, OpenOptions, Simulation};

fn addr() -> String {
    std::env::var("RPMA_TEST_RDMA_ADDR").expect("RPMA_TEST_RDMA_ADDR (the VM lab sets it)")
}

/// An initiator/target pair over the RDMA device of the environment.
fn rdma_pair() -> Pair {
    let url: Url = format!("rdma://{}:0", addr()).parse().unwrap();
    let ctx = Context::for_url(&url).unwrap();
    let listener = Listener::bind(&ctx, &url).unwrap();
    Pair::on(
        ctx,
        listener,
        ConnParams::default(),
        ConnParams::default(),
        |_| {},
    )
}

/// Writes a pattern at an odd offset into `m` through the NIC, reads it back through the NIC,
/// and checks what the CPU sees in the mapping; None (and the reason checked) where the
/// device refuses to register `m` because its on-demand paging misplaces data.
fn write_read_into(what: &str, m: Arc<Mapping>) -> Option<Vec<u8>> {
    let p = rdma_pair();
    let len = 300_000;
    let at = 12_345u64;
    let mr = match p.pd.register(Arc::clone(&m), rw()) {
        Ok(mr) => mr,
        Err(e) if m.backing() != MemoryBacking::Ram => {
            let e = e.to_string();
            assert!(e.contains("wrong offset"), "{what}: {e}");
            return None;
        }
        Err(e) => panic!("{what}: {e}"),
    };
    let (imem, imr) = p.init_buf(2 * len, Access::LOCAL_WRITE);
    let data: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
    imem.write_at(0, &data).unwrap();
    p.qp.post_send(SendWr::new(
        1,
        SendOp::Write {
            local: Sge::new(&imr, 0, len),
            remote: mr.remote(at),
        },
    ))
    .unwrap();
    let c = p.next_init();
    assert_eq!((c.wr_id, c.status), (1, WcStatus::Success), "{what}");
    post_read(&p.qp, 2, Sge::new(&imr, len, len), mr.remote(at));
    let c = p.next_init();
    assert_eq!((c.wr_id, c.status), (2, WcStatus::Success), "{what}");
    let mut back = vec![0u8; len];
    imem.read_at(len, &mut back).unwrap();
    let mut cpu = vec![0u8; len];
    m.read_at(at as usize, &mut cpu).unwrap();
    let diff = |a: &[u8]| {
        let first = a.iter().zip(&data).position(|(x, y)| x != y);
        let n = a.iter().zip(&data).filter(|(x, y)| x != y).count();
        let zeros = a.iter().filter(|&&x| x == 0).count();
        format!("first difference at {first:?}, {n} bytes differ, {zeros} zero bytes")
    };
    assert!(
        back == data,
        "{what}: a Read gives back what the Write placed: {}; the CPU: {}",
        diff(&back),
        diff(&cpu)
    );
    assert!(
        cpu == data,
        "{what}: the CPU sees what the NIC placed: {}",
        diff(&cpu)
    );
    Some(data)
}

/// One small Write (one packet) at byte 2048 of a page of `m`: the offsets of the page it
/// landed at, or why the device refused to register `m`.
fn small_write(m: Arc<Mapping>) -> std::result::Result<Vec<usize>, String> {
    let p = rdma_pair();
    let mr =
        p.pd.register(Arc::clone(&m), rw())
            .map_err(|e| e.to_string())?;
    let (imem, imr) = p.init_buf(4096, Access::LOCAL_WRITE);
    imem.write_at(0, &[0xAB; 64]).unwrap();
    p.qp.post_send(SendWr::new(
        1,
        SendOp::Write {
            local: Sge::new(&imr, 0, 64),
            remote: mr.remote(8192 + 2048),
        },
    ))
    .unwrap();
    let c = p.next_init();
    assert_eq!(c.status, WcStatus::Success);
    let mut page = vec![0u8; 4096];
    m.read_at(8192, &mut page).unwrap();
    Ok((0..4096).step_by(64).filter(|&i| page[i] == 0xAB).collect())
}

/// Where a 64-byte Write at byte 2048 of a page lands, on a page-cache file (on-demand
/// paging) and on /dev/shm (pinned). With `RPMA_TRUST_RXE_ODP=trust` on Soft-RoCE it shows
/// whether the kernel's rxe ODP copy is fixed (it prints `[2048]`) or not (`[0]`); without it,
/// the refusal. docs/rdma.md quotes it.
#[test]
#[ignore = "requires an RDMA device (RPMA_TEST_RDMA_DEVICE, RPMA_TEST_RDMA_ADDR)"]
fn where_a_small_write_lands() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns");
    let m = Arc::new(
        OpenOptions::new(&path)
            .size(4 << 20)
            .create(true)
            .open()
            .unwrap(),
    );
    match small_write(m) {
        Ok(at) => eprintln!("page-cache (on-demand paging): landed at page offsets {at:?}"),
        Err(e) => eprintln!("page-cache: refused: {e}"),
    }
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let m = Arc::new(
        OpenOptions::new(dir.path().join("ns"))
            .size(4 << 20)
            .create(true)
            .open()
            .unwrap(),
    );
    let at = small_write(m).expect("pinned memory registers");
    assert_eq!(at, vec![2048], "/dev/shm (pinned): where the Write landed");
}

fn file_at(path: &std::path::Path, at: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut b = vec![0u8; len];
    std::fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut b, at)
        .unwrap();
    b
}

#[test]
#[ignore = "requires an RDMA device (RPMA_TEST_RDMA_DEVICE, RPMA_TEST_RDMA_ADDR)"]
fn a_page_cache_file_registered_on_demand() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns");
    let m = Arc::new(
        OpenOptions::new(&path)
            .size(4 << 20)
            .create(true)
            .open()
            .unwrap(),
    );
    assert_eq!(m.backing(), MemoryBacking::PageCache, "{}", path.display());
    if let Some(data) = write_read_into("page-cache", Arc::clone(&m)) {
        assert!(
            file_at(&path, 12_345, data.len()) == data,
            "the file has it"
        );
    }
}

#[test]
#[ignore = "requires an RDMA device (RPMA_TEST_RDMA_DEVICE, RPMA_TEST_RDMA_ADDR)"]
fn an_anonymous_working_copy_registered_on_demand() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns");
    let m = Arc::new(
        OpenOptions::new(&path)
            .size(4 << 20)
            .create(true)
            .power_loss_simulation(Some(Simulation::default()))
            .open()
            .unwrap(),
    );
    write_read_into("simulated page-cache", m);
}

#[test]
#[ignore = "requires an RDMA device (RPMA_TEST_RDMA_DEVICE, RPMA_TEST_RDMA_ADDR)"]
fn dev_shm_pinned() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let path = dir.path().join("ns");
    let m = Arc::new(
        OpenOptions::new(&path)
            .size(4 << 20)
            .create(true)
            .open()
            .unwrap(),
    );
    assert_eq!(m.backing(), MemoryBacking::Ram);
    let data = write_read_into("/dev/shm", Arc::clone(&m)).expect("pinned memory registers");
    assert!(
        file_at(&path, 12_345, data.len()) == data,
        "the file has it"
    );
}
