//! Tests of the receive state machine: reassembly under arbitrary splits, malformed frames.

use super::super::caps::CapFlags;
use super::super::codes::{Opcode, TermCause};
use super::super::ddp::HeaderKind;
use super::super::mpa::Negotiated;
use super::super::rdmap::{AtomicRequest, ReadRequest};
use super::super::terminate::Terminate;
use super::super::tx::{encode_fpdu, segment, TxConfig};
use super::*;
use crate::fabric::soft::placer::write_payload;
use proptest::prelude::*;

/// A source that hands out the stream in planned chunks, WouldBlock for `None`, and
/// WouldBlock (or EOF when `eof`) at the end.
struct Chunky<'a> {
    data: &'a [u8],
    pos: usize,
    plan: Vec<Option<usize>>,
    step: usize,
    eof: bool,
    blocked: bool,
}

impl<'a> Chunky<'a> {
    fn new(data: &'a [u8], plan: Vec<Option<usize>>) -> Self {
        Chunky {
            data,
            pos: 0,
            plan,
            step: 0,
            eof: false,
            blocked: false,
        }
    }
}

impl Read for Chunky<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pos == self.data.len() {
            return if self.eof {
                Ok(0)
            } else {
                Err(io::ErrorKind::WouldBlock.into())
            };
        }
        let p = if self.plan.is_empty() {
            Some(usize::MAX)
        } else {
            self.plan[self.step % self.plan.len()]
        };
        self.step += 1;
        // Never two WouldBlocks in a row: the stream always makes progress.
        match p {
            None if !self.blocked => {
                self.blocked = true;
                Err(io::ErrorKind::WouldBlock.into())
            }
            p => {
                self.blocked = false;
                let n = p.unwrap_or(1);
                let n = n.max(1).min(buf.len()).min(self.data.len() - self.pos);
                buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
                self.pos += n;
                Ok(n)
            }
        }
    }
}

impl ReadVolatile for Chunky<'_> {
    /// Without a plan, a readv fills every buffer in turn (one step); with one, it reads into
    /// the first non-empty buffer, as `Read::read_vectored`'s default does.
    fn read_volatile(&mut self, bufs: &[VolatileSlice<'_>]) -> io::Result<usize> {
        // Reads one chunk into `b`, through a buffer of our own: no reference over `b`.
        let read_one = |me: &mut Self, b: &VolatileSlice<'_>| {
            let mut tmp = vec![0u8; b.len()];
            let n = me.read(&mut tmp)?;
            b.write_at(0, &tmp[..n]).expect("n <= b.len()");
            Ok::<usize, io::Error>(n)
        };
        let mut bufs = bufs.iter().filter(|b| !b.is_empty());
        if !self.plan.is_empty() {
            return bufs.next().map_or(Ok(0), |b| read_one(self, b));
        }
        let step = self.step;
        let mut total = 0;
        for b in bufs {
            match read_one(self, b) {
                Ok(n) => {
                    total += n;
                    if n < b.len() {
                        break;
                    }
                }
                Err(e) if total == 0 => return Err(e),
                Err(_) => break,
            }
        }
        self.step = step + 1;
        Ok(total)
    }
}

/// Places tagged segments of STag 1 into `base[..len]`; buffers untagged ones.
struct MemPlacer {
    base: *mut u8,
    len: usize,
    calls: usize,
    refuse: Option<TermCause>,
}

impl MemPlacer {
    fn new(mem: &mut [u8]) -> Self {
        MemPlacer {
            base: mem.as_mut_ptr(),
            len: mem.len(),
            calls: 0,
            refuse: None,
        }
    }
}

impl Placer for MemPlacer {
    fn place(
        &mut self,
        header: &Header,
        payload_len: usize,
    ) -> std::result::Result<Placement, TermCause> {
        self.calls += 1;
        if let Some(c) = self.refuse {
            return Err(c);
        }
        match header.kind {
            HeaderKind::Tagged { stag: 1, to } => {
                let to = to as usize;
                if to.checked_add(payload_len).is_none_or(|e| e > self.len) {
                    return Err(TermCause::DDP_TAGGED_BASE_BOUNDS);
                }
                // SAFETY: to + payload_len <= len, inside the test's memory, which nothing
                // else touches while the receiver runs.
                Ok(Placement::Direct(unsafe {
                    DirectTarget::new(self.base.add(to), payload_len)
                }))
            }
            HeaderKind::Tagged { .. } => Err(TermCause::DDP_TAGGED_INVALID_STAG),
            HeaderKind::Untagged { .. } => Ok(Placement::Buffer),
        }
    }

    fn write(&mut self, target: DirectTarget, payload: &[u8]) -> Result<bool> {
        write_payload(target, payload)
    }
}

#[derive(Debug, PartialEq, Eq, Clone)]
enum Got {
    Placed(Header),
    Buffered(Header, Vec<u8>),
    Control(Header, Body),
}

fn drain<P: Placer>(
    rx: &mut FpduReceiver,
    src: &mut Chunky<'_>,
    placer: &mut P,
) -> Result<Vec<Got>> {
    let mut out = Vec::new();
    loop {
        match rx.poll(src, placer)? {
            None if src.pos == src.data.len() => break,
            None => {}
            Some(r) => {
                assert_eq!(r.payload_len, r.ulpdu_len - r.header.len());
                out.push(match r.data {
                    Delivered::Placed => Got::Placed(r.header),
                    Delivered::Buffered(b) => Got::Buffered(r.header, b.to_vec()),
                    Delivered::Control(body) => Got::Control(r.header, body),
                    Delivered::Discarded => panic!("nothing is discarded here"),
                });
            }
        }
    }
    // Whatever the source's last read completed is out by now.
    if let Some(r) = rx.poll(src, placer)? {
        panic!("late FPDU {r:?}");
    }
    Ok(out)
}

fn all_caps(crc: bool, max: usize) -> RxConfig {
    RxConfig::new(crc, max, CapFlags::ALL).unwrap()
}

#[derive(Debug, Clone)]
enum Msg {
    Write { to: usize, data: Vec<u8> },
    Send { data: Vec<u8> },
    Read(ReadRequest),
    Atomic(AtomicRequest),
}

fn msg() -> impl Strategy<Value = Msg> {
    prop_oneof![
        (
            0usize..4096,
            proptest::collection::vec(any::<u8>(), 0..3000)
        )
            .prop_map(|(to, data)| Msg::Write { to, data }),
        proptest::collection::vec(any::<u8>(), 0..600).prop_map(|data| Msg::Send { data }),
        (any::<u32>(), any::<u64>(), any::<u32>()).prop_map(|(s, t, n)| Msg::Read(ReadRequest {
            sink_stag: s,
            sink_to: t,
            size: n,
            src_stag: 1,
            src_to: 8
        })),
        (any::<u32>(), any::<u64>())
            .prop_map(|(id, add)| Msg::Atomic(AtomicRequest::fetch_add(id, 1, 16, add))),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Random messages, segmented by the tx code, fed in random chunks with WouldBlocks:
    /// every FPDU comes out, in order, and the memory holds exactly what was written.
    #[test]
    fn reassembles_any_split(
        msgs in proptest::collection::vec(msg(), 1..12),
        crc in any::<bool>(),
        max_ulpdu in 128usize..2048,
        plan in proptest::collection::vec(proptest::option::weighted(0.8, 1usize..700), 1..16),
    ) {
        let tx = TxConfig::new(crc, max_ulpdu).unwrap();
        let mut stream = Vec::new();
        let mut expect_mem = vec![0u8; 8192];
        let mut expect = Vec::new();
        let mut msn = 0u32;
        let mut rmsn = 0u32;
        for m in &msgs {
            match m {
                Msg::Write { to, data } => {
                    expect_mem[*to..*to + data.len()].copy_from_slice(data);
                    let sg = [&data[..]];
                    for f in segment(Header::tagged(Opcode::Write, 1, *to as u64, false), &sg, &tx) {
                        f.append_to(&mut stream);
                        expect.push(Got::Placed(*f.header()));
                    }
                }
                Msg::Send { data } => {
                    msn += 1;
                    let sg = [&data[..]];
                    for f in segment(Header::untagged(Opcode::Send, msn, false), &sg, &tx) {
                        f.append_to(&mut stream);
                        let p: Vec<u8> = f.payload().flatten().copied().collect();
                        expect.push(Got::Buffered(*f.header(), p));
                    }
                }
                Msg::Read(rr) => {
                    rmsn += 1;
                    let h = Header::untagged(Opcode::ReadRequest, rmsn, true);
                    encode_fpdu(&h, &rr.encode(), crc, &mut stream).unwrap();
                    expect.push(Got::Control(h, Body::ReadRequest(*rr)));
                }
                Msg::Atomic(a) => {
                    rmsn += 1;
                    let h = Header::untagged(Opcode::AtomicRequest, rmsn, true);
                    encode_fpdu(&h, &a.encode(), crc, &mut stream).unwrap();
                    expect.push(Got::Control(h, Body::AtomicRequest(*a)));
                }
            }
        }
        let mut mem = vec![0u8; 8192];
        let mut placer = MemPlacer::new(&mut mem);
        let mut rx = FpduReceiver::new(all_caps(crc, max_ulpdu));
        let mut src = Chunky::new(&stream, plan);
        let got = drain(&mut rx, &mut src, &mut placer).unwrap();
        prop_assert_eq!(src.pos, stream.len());
        prop_assert!(rx.is_idle());
        prop_assert_eq!(got, expect);
        prop_assert!(mem == expect_mem);
    }
}

/// A stream many times longer than the receiver's ring, in chunks that put FPDUs across its
/// end over and over: every FPDU comes out whole, every byte lands where it belongs.
#[test]
fn a_long_stream_wraps_the_ring_without_losing_a_byte() {
    for crc in [true, false] {
        let tx = TxConfig::new(crc, 1000).unwrap();
        let mut stream = Vec::new();
        let mut expect_mem = vec![0u8; 8192];
        let mut fpdus = 0;
        for i in 0..400usize {
            let to = (i * 37) % 4096;
            let data: Vec<u8> = (0..(i * 53) % 3000).map(|j| (i + j) as u8).collect();
            expect_mem[to..to + data.len()].copy_from_slice(&data);
            let sg = [&data[..]];
            for f in segment(Header::tagged(Opcode::Write, 1, to as u64, true), &sg, &tx) {
                f.append_to(&mut stream);
                fpdus += 1;
            }
        }
        let mut mem = vec![0u8; 8192];
        let mut placer = MemPlacer::new(&mut mem);
        let mut rx = FpduReceiver::new(all_caps(crc, 1000));
        let cap = rx.inbox.ring.cap();
        assert!(stream.len() > 20 * cap, "{} vs {cap}", stream.len());
        let plan = vec![Some(4093), None, Some(777), Some(cap - 5), Some(1)];
        let mut src = Chunky::new(&stream, plan);
        let got = drain(&mut rx, &mut src, &mut placer).unwrap();
        assert_eq!(got.len(), fpdus, "crc {crc}");
        assert!(rx.is_idle());
        drop(rx);
        assert!(mem == expect_mem, "crc {crc}");
    }
}

/// A placer that asks for the cache write-back on every tagged payload.
struct WritebackPlacer<'a>(MemPlacer, std::marker::PhantomData<&'a mut [u8]>);

impl Placer for WritebackPlacer<'_> {
    fn place(&mut self, h: &Header, n: usize) -> std::result::Result<Placement, TermCause> {
        match self.0.place(h, n)? {
            Placement::Direct(d) => Ok(Placement::Direct(d.with_cache_writeback())),
            p => Ok(p),
        }
    }

    fn write(&mut self, target: DirectTarget, payload: &[u8]) -> Result<bool> {
        self.0.write(target, payload)
    }
}

#[test]
fn a_writeback_placement_is_reported_where_the_payload_was_copied() {
    let wb = crate::pmem::flush_instruction() != crate::pmem::FlushInstruction::None;
    // (crc, payload length): staged and copied with CRC on; gathered and copied with CRC off
    // when small; read straight into place (not written back) with CRC off when large.
    for (crc, len, copied) in [
        (true, 3001, true),
        (false, 3001, true),
        (false, 40000, false),
    ] {
        let data: Vec<u8> = (0..len as u32).map(|i| (i % 241) as u8).collect();
        let mut stream = Vec::new();
        let h = Header::tagged(Opcode::Write, 1, 3, true);
        encode_fpdu(&h, &data, crc, &mut stream).unwrap();
        let mut mem = vec![0u8; 65536];
        let mut placer = WritebackPlacer(MemPlacer::new(&mut mem), std::marker::PhantomData);
        let mut rx = FpduReceiver::new(all_caps(crc, 65535));
        let mut src = Chunky::new(&stream, vec![]);
        let r = loop {
            if let Some(r) = rx.poll(&mut src, &mut placer).unwrap() {
                break r;
            }
        };
        assert_eq!(r.data, Delivered::Placed);
        assert_eq!(r.written_back, copied && wb, "crc {crc} len {len}");
        drop(rx);
        assert_eq!(&mem[3..3 + len], &data[..]);
    }
}

#[test]
fn packed_fpdus_in_one_read_and_eof() {
    let mut stream = Vec::new();
    for i in 0..5u32 {
        let h = Header::untagged(Opcode::Send, i + 1, true);
        encode_fpdu(&h, &[i as u8; 3], true, &mut stream).unwrap();
    }
    let mut mem = vec![0u8; 16];
    let mut placer = MemPlacer::new(&mut mem);
    let mut rx = FpduReceiver::new(all_caps(true, 1454));
    let mut src = Chunky::new(&stream, vec![]);
    src.eof = true;
    for i in 0..5u32 {
        let r = rx.poll(&mut src, &mut placer).unwrap().unwrap();
        assert_eq!(r.data, Delivered::Buffered(&[i as u8; 3]));
        if i == 0 {
            assert_eq!(src.step, 1, "all five arrive in one read");
        }
    }
    assert!(matches!(
        rx.poll(&mut src, &mut placer),
        Err(WireError::Closed { .. })
    ));
    // Poisoned from now on.
    assert!(matches!(
        rx.poll(&mut src, &mut placer),
        Err(WireError::Closed { .. })
    ));
}

#[test]
fn eof_inside_a_direct_payload_is_closed() {
    // Longer than read-ahead, so that it streams into place.
    let data = vec![9u8; 3 * READ_AHEAD];
    let mut stream = Vec::new();
    encode_fpdu(
        &Header::tagged(Opcode::Write, 1, 0, true),
        &data,
        false,
        &mut stream,
    )
    .unwrap();
    stream.truncate(2 * READ_AHEAD);
    let mut mem = vec![0u8; 4 * READ_AHEAD];
    let mut placer = MemPlacer::new(&mut mem);
    let mut rx = FpduReceiver::new(all_caps(false, 65535));
    let mut src = Chunky::new(&stream, vec![Some(100)]);
    src.eof = true;
    let err = loop {
        match rx.poll(&mut src, &mut placer) {
            Ok(None) => continue,
            Ok(Some(r)) => panic!("{r:?}"),
            Err(e) => break e,
        }
    };
    assert!(matches!(
        err,
        WireError::Closed {
            during: "FPDU payload"
        }
    ));
    assert_eq!(err.terminate_cause(), TermCause::MPA_TCP_LOST);
}

#[test]
fn large_direct_payload_mostly_bypasses_the_buffer() {
    // CRC off, 60000-byte Write: the receiver reads the header with little read-ahead and
    // the rest straight into place.
    let data: Vec<u8> = (0..60000u32).map(|i| (i % 251) as u8).collect();
    let mut stream = Vec::new();
    encode_fpdu(
        &Header::tagged(Opcode::Write, 1, 100, true),
        &data,
        false,
        &mut stream,
    )
    .unwrap();
    let mut mem = vec![0u8; 65536];
    let mut placer = MemPlacer::new(&mut mem);
    let mut rx = FpduReceiver::new(all_caps(false, 65535));
    let mut src = Chunky::new(&stream, vec![]);
    let r = rx.poll(&mut src, &mut placer).unwrap().unwrap();
    assert_eq!(r.data, Delivered::Placed);
    assert_eq!(r.payload_len, 60000);
    // Header read with read-ahead, then one readv: the payload into place, the trailer into
    // the buffer.
    assert_eq!(src.step, 2, "{} reads", src.step);
    drop(rx);
    assert_eq!(&mem[100..60100], &data[..]);
}

#[test]
fn short_ulpdu_is_judged_on_its_own_bytes() {
    // ULPDU length 2: only the control bytes; the FPDU is 8 bytes, followed by a good Send.
    for crc in [true, false] {
        let mut v = vec![0x00, 0x02, 0x41, 0x43, 0, 0, 0, 0];
        if crc {
            let c = crc32c(&v[..4]).to_le_bytes();
            v[4..].copy_from_slice(&c);
        }
        encode_fpdu(
            &Header::untagged(Opcode::Send, 1, true),
            b"next",
            crc,
            &mut v,
        )
        .unwrap();
        let mut mem = vec![0u8; 16];
        let mut placer = MemPlacer::new(&mut mem);
        let mut rx = FpduReceiver::new(all_caps(crc, 1454));
        let err = rx
            .poll(&mut Chunky::new(&v, vec![]), &mut placer)
            .unwrap_err();
        assert!(
            matches!(
                err,
                WireError::UlpduTooShort {
                    opcode: Some(Opcode::Send),
                    ulpdu_len: 2,
                    need: 18
                }
            ),
            "crc {crc}: {err:?}"
        );
        assert_eq!(rx.offending_segment().unwrap(), (2, &[0x41u8, 0x43][..]));
        // A bad version in those two bytes is blamed first.
        v[2] = 0x42;
        if crc {
            let c = crc32c(&v[..4]).to_le_bytes();
            v[4..8].copy_from_slice(&c);
        }
        let mut rx = FpduReceiver::new(all_caps(crc, 1454));
        let err = rx
            .poll(&mut Chunky::new(&v, vec![]), &mut placer)
            .unwrap_err();
        assert_eq!(err.terminate_cause(), TermCause::DDP_UNTAGGED_VERSION);
    }
}

#[test]
fn small_fpdus_without_crc_need_no_read_for_a_trailer_alone() {
    // CRC off, a stream of 1454-byte Writes arriving whole: each payload is within read-ahead,
    // so it is gathered and copied rather than read into place (which would take a second read
    // for its trailer).
    let mut stream = Vec::new();
    let seg = 1454 - 14;
    let data: Vec<u8> = (0..20 * seg).map(|i| (i % 249) as u8).collect();
    for (i, chunk) in data.chunks(seg).enumerate() {
        let h = Header::tagged(Opcode::Write, 1, (i * seg) as u64, true);
        encode_fpdu(&h, chunk, false, &mut stream).unwrap();
    }
    let mut mem = vec![0u8; data.len()];
    let mut placer = MemPlacer::new(&mut mem);
    let mut rx = FpduReceiver::new(all_caps(false, 1454));
    let mut src = Chunky::new(&stream, vec![]);
    for _ in 0..20 {
        let r = rx.poll(&mut src, &mut placer).unwrap().unwrap();
        assert_eq!(r.data, Delivered::Placed);
    }
    // Each read brings what is needed plus read-ahead: no read for a trailer alone.
    let bound = stream.len().div_ceil(READ_AHEAD) + 1;
    assert!(
        src.step <= bound,
        "{} reads for 20 FPDUs (bound {bound})",
        src.step
    );
    drop(rx);
    assert_eq!(mem, data);
}

mod hostile;
