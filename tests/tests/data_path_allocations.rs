//! The initiator's data path allocates nothing per request once its queue is warm: a durable
//! write from a caller's buffer or from bytes (the Writes, their Flush, the slots, the lists
//! behind one doorbell), a read into a buffer, a started read and its wait. Counted by a
//! global allocator that counts the calls made on the calling thread (the queue has no thread
//! of its own: everything a call does runs in it), against a real `rpma-target` on a dax
//! (forced) namespace over tcp, with each durability method. Before, a durable write made 11
//! allocations and a read 2
//! (docs/benchmarks.md, "Allocation-free requests").

use rpma_initiator::{Completed, Connection, Durability, PersistMethod, QueueOptions, WriteBuf};
use rpma_tests::{four_namespace_target, host, noise, nqn, opts, Subsystem};
#[path = "../../common/tests/counting_alloc/mod.rs"]
mod counting_alloc;

use counting_alloc::allocations;

const SUB: &str = "nqn.2026-11.io.rpma:alloc";
const HOST: &str = "nqn.2026-11.io.rpma:alloc-host";

/// nsid 4 of `four_namespaces`: dax (forced), 2 MiB.
const DAX: u32 = 4;

fn conn(url: &str) -> Connection {
    Connection::new(url, nqn(SUB), host(HOST))
        .with_connect_options(opts())
        .with_queue_options(QueueOptions {
            depth: 8,
            ..QueueOptions::default()
        })
}

#[test]
fn a_warm_queue_allocates_nothing_per_durable_write_or_read() {
    let (_d, _shm, t) = four_namespace_target("alloc", Subsystem::new(SUB).any_host(), 512);
    let c = conn(&t.url());
    let mut q = c.open_queue(0).unwrap();
    let mut ns = q.namespace(DAX).unwrap();
    let bs = 4096usize;
    let mut wbuf = WriteBuf::new(bs).unwrap();
    wbuf.bytes_mut().unwrap().copy_from_slice(&noise(1, bs));
    let bytes = noise(2, bs);
    let mut rbuf = vec![0u8; bs];
    let mut room = WriteBuf::new(bs).unwrap();
    let mut done: Vec<Completed> = Vec::with_capacity(8);
    let blocks = 256u64;
    let mut round = |ns: &mut rpma_initiator::Namespace<'_>, i: u64| {
        let off = (i * 7 % blocks) * bs as u64;
        let d = ns.write_batch_durable_from(&[(off, &wbuf, 0..bs)]).unwrap();
        assert!(matches!(d, Durability::Durable(_)), "{d:?}");
        let d = ns
            .write_batch_durable(&[(off + bs as u64, &bytes)])
            .unwrap();
        assert!(matches!(d, Durability::Durable(_)), "{d:?}");
        ns.read_at(off, &mut rbuf).unwrap();
        let ticket = ns.start_read_into(off, &mut room, 0..bs).unwrap();
        done.clear();
        while done.is_empty() {
            ns.wait_started(&mut done).unwrap();
        }
        assert!(matches!(done[..], [Completed::Read(t)] if t == ticket));
        ns.finish_read(ticket).unwrap();
    };
    let n = 1000;
    // Each durability method the target offers for dax (forced) over tcp: the one chosen
    // (FLUSH), and APM and GPSPM forced.
    for m in [None, Some(PersistMethod::Apm), Some(PersistMethod::Gpspm)] {
        ns.set_method(m).unwrap();
        // Warm: the queue's lists, maps and slots reach their sizes.
        for i in 0..200 {
            round(&mut ns, i);
        }
        let (made, ()) = allocations(|| {
            for i in 0..n {
                round(&mut ns, i);
            }
        });
        assert_eq!(
            made, 0,
            "{m:?}: {made} allocations in {n} rounds of two durable writes, a read and a \
             started read"
        );
    }
    // What it did is what was asked: the last round's bytes are there.
    let off = ((n - 1) * 7 % blocks) * bs as u64;
    ns.read_at(off, &mut rbuf).unwrap();
    assert_eq!(rbuf, wbuf.bytes_mut().unwrap().to_vec());
    ns.read_at(off + bs as u64, &mut rbuf).unwrap();
    assert_eq!(rbuf, bytes);
}
