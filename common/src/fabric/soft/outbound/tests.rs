use super::*;
use crate::fabric::soft::wire::tx::segment;
use crate::fabric::soft::wire::Opcode;
use crate::fabric::{Access, AlignedBuf, Context};
use std::io::Read;
use std::net::TcpListener;

fn socket_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

#[test]
fn queued_messages_go_out_as_the_wire_segmenter_cuts_them() {
    for crc in [true, false] {
        let ctx = Context::soft();
        let pd = ctx.alloc_pd().unwrap();
        let mem = AlignedBuf::new(4096).unwrap();
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        mem.write_at(100, &data).unwrap();
        let mr = pd.register(mem, Access::LOCAL_WRITE).unwrap();

        let mut tx = Tx::new(crc, 128);
        let write = Header::tagged(Opcode::Write, 9, 0x4000, true);
        tx.push(TxMsg {
            hdr: write,
            src: Src::Mem {
                region: Arc::clone(mr.region()),
                offset: 100,
                revocable: false,
            },
            len: 1000,
            on_sent: OnSent::Complete(1),
        });
        let send = Header::untagged(Opcode::Send, 1, true);
        tx.push_inline(send, b"hello", OnSent::Complete(2));
        let (mut a, mut b) = socket_pair();
        let mut done = Vec::new();
        assert!(tx.flush(&mut a, usize::MAX, |o| done.push(o)).unwrap());
        assert_eq!(done, [OnSent::Complete(1), OnSent::Complete(2)]);
        assert!(!tx.pending());
        drop(a);
        let mut got = Vec::new();
        b.read_to_end(&mut got).unwrap();

        let cfg = TxConfig::new(crc, 128).unwrap();
        let mut want = Vec::new();
        let sg = [&data[..]];
        let fpdus: Vec<_> = segment(write, &sg, &cfg).collect();
        assert_eq!(fpdus.len(), 1000usize.div_ceil(128 - 14));
        for f in fpdus {
            f.append_to(&mut want);
        }
        for f in segment(send, &[&b"hello"[..]], &cfg) {
            f.append_to(&mut want);
        }
        assert_eq!(got, want, "crc {crc}");
    }
}

#[test]
fn abort_keeps_a_partly_written_fpdu_and_drops_the_rest() {
    let mut tx = Tx::new(true, 128);
    for i in 0..3 {
        let h = Header::untagged(Opcode::Send, i + 1, true);
        tx.push_inline(h, &[i as u8; 40], OnSent::Complete(i as u64));
    }
    tx.cut();
    assert_eq!(tx.ready.len(), 3);
    tx.written = 5;
    tx.abort_queued();
    assert_eq!(tx.ready.len(), 1);
    assert_eq!(tx.ready[0].on_sent, OnSent::Nothing);
    tx.written = 0;
    tx.abort_queued();
    assert!(!tx.pending());
}

#[test]
fn a_read_response_from_a_revoked_region_is_not_sent_and_a_partial_fpdu_cuts_the_stream() {
    let ctx = Context::soft();
    let pd = ctx.alloc_pd().unwrap();
    let region = || {
        let mem = AlignedBuf::new(4096).unwrap();
        mem.write_at(0, &[0xAA; 4096]).unwrap();
        pd.register(mem, Access::LOCAL_WRITE).unwrap()
    };
    let msg = |mr: &Arc<crate::fabric::MemoryRegion>, revocable| TxMsg {
        hdr: Header::tagged(Opcode::ReadResponse, 9, 0, true),
        src: Src::Mem {
            region: Arc::clone(mr.region()),
            offset: 0,
            revocable,
        },
        len: 1000,
        on_sent: OnSent::ResponseDone,
    };
    let sent = |mut tx: Tx| {
        let (mut a, mut b) = socket_pair();
        assert!(tx.flush(&mut a, usize::MAX, |_| {}).unwrap());
        drop(a);
        let mut got = Vec::new();
        b.read_to_end(&mut got).unwrap();
        got
    };
    // A local Write's source goes out whatever became of its registration.
    let mr = region();
    mr.region().revoke();
    let mut tx = Tx::new(false, 128);
    tx.push(msg(&mr, false));
    assert!(sent(tx).contains(&0xAA));
    // A Read Response's does not, not even framed.
    let mut tx = Tx::new(false, 128);
    tx.push(msg(&mr, true));
    let (mut a, _b) = socket_pair();
    assert!(!tx.flush(&mut a, usize::MAX, |_| {}).unwrap());
    assert!(tx.revoked() && tx.ready.is_empty());
    tx.abort_queued();
    assert!(!tx.revoked() && !tx.pending());
    // Revoked after it was framed and part of an FPDU left, with CRC off or on: nothing of it
    // or after it goes out, not even a Terminate pushed after (zeros for its rest would end a
    // Read with the L bit as a success at the peer, with CRC off); the engine ends the
    // connection there.
    for crc in [false, true] {
        let mr = region();
        let mut tx = Tx::new(crc, 128);
        tx.push(msg(&mr, true));
        tx.cut();
        assert!(tx.ready.len() > 1);
        tx.written = 20;
        mr.region().revoke();
        assert!(!tx.flush(&mut a, usize::MAX, |_| {}).unwrap());
        assert!(tx.revoked() && tx.partial_revoked());
        tx.abort_queued();
        assert!(tx.cut_short() && !tx.pending());
        tx.push_inline(
            Header::untagged(Opcode::Terminate, 1, true),
            &[0; 28],
            OnSent::Nothing,
        );
        assert!(!tx.pending(), "crc {crc}");
        assert!(sent(tx).is_empty(), "crc {crc}");
    }
}

#[test]
fn framing_stops_at_about_ready_bytes_and_counts_what_is_ready() {
    let ctx = Context::soft();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd
        .register(AlignedBuf::new(1 << 20).unwrap(), Access::LOCAL_WRITE)
        .unwrap();
    // Three 1 MiB Writes cut into 32 KiB-ish FPDUs: the framing stops once 1 MiB is ready,
    // well before BATCH FPDUs.
    let mut tx = Tx::new(true, 32_000);
    for i in 0..3 {
        tx.push(TxMsg {
            hdr: Header::tagged(Opcode::Write, 9, 0, true),
            src: Src::Mem {
                region: Arc::clone(mr.region()),
                offset: 0,
                revocable: false,
            },
            len: 1 << 20,
            on_sent: OnSent::Complete(i),
        });
    }
    tx.cut();
    let sum: usize = tx.ready.iter().map(Fpdu::total).sum();
    assert_eq!(tx.ready_bytes, sum);
    assert!(tx.ready.len() < BATCH, "{} FPDUs", tx.ready.len());
    assert!(
        (READY_BYTES..READY_BYTES + 32_100).contains(&sum),
        "{sum} bytes ready"
    );
    // Everything still goes out, in order, and the count returns to zero.
    let (mut a, mut b) = socket_pair();
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        b.read_to_end(&mut got).unwrap();
        got.len()
    });
    let mut done = Vec::new();
    a.set_nonblocking(true).unwrap();
    while tx.pending() {
        tx.flush(&mut a, usize::MAX, |o| done.push(o)).unwrap();
    }
    drop(a);
    assert_eq!(
        done,
        [
            OnSent::Complete(0),
            OnSent::Complete(1),
            OnSent::Complete(2)
        ]
    );
    assert_eq!(tx.ready_bytes, 0);
    // Per message: 32 full FPDUs (ULPDU 32000: 14 header + 31986 payload) and the rest.
    use crate::fabric::soft::wire::fpdu_len;
    let rest = (1 << 20) - 32 * 31_986;
    let per_message = 32 * fpdu_len(32_000) + fpdu_len(14 + rest);
    assert_eq!(reader.join().unwrap(), 3 * per_message);
}

#[test]
fn a_flush_stops_after_its_budget_and_the_next_goes_on() {
    let ctx = Context::soft();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd
        .register(AlignedBuf::new(1 << 20).unwrap(), Access::LOCAL_WRITE)
        .unwrap();
    let mut tx = Tx::new(false, 16 * 1024);
    tx.push(TxMsg {
        hdr: Header::tagged(Opcode::Write, 9, 0, true),
        src: Src::Mem {
            region: Arc::clone(mr.region()),
            offset: 0,
            revocable: false,
        },
        len: 1 << 20,
        on_sent: OnSent::Complete(1),
    });
    let (mut a, mut b) = socket_pair();
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        b.read_to_end(&mut got).unwrap();
        got.len()
    });
    // Each call writes at most its budget, then returns with the rest still queued.
    let mut done = Vec::new();
    let mut calls = 0;
    a.set_nonblocking(true).unwrap();
    while tx.pending() {
        tx.flush(&mut a, 64 * 1024, |o| done.push(o)).unwrap();
        calls += 1;
    }
    drop(a);
    assert!(calls >= 16, "a 1 MiB message in {calls} calls of 64 KiB");
    assert_eq!(done, [OnSent::Complete(1)]);
    assert!(reader.join().unwrap() > 1 << 20);
}

#[test]
fn a_pass_is_split_between_the_busy() {
    assert_eq!(quantum(0), TURN_BYTES);
    assert_eq!(quantum(1), TURN_BYTES);
    assert_eq!(quantum(4), TURN_BYTES / 4);
    assert_eq!(quantum(8), TURN_BYTES / 8);
    assert_eq!(quantum(48), MIN_QUANTUM.max(TURN_BYTES / 48));
    assert_eq!(quantum(10_000), MIN_QUANTUM);
}
