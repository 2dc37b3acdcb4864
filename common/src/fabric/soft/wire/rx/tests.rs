//! Tests of the receive state machine: reassembly under arbitrary splits, malformed frames.

use super::super::ddp::HeaderKind;
use super::super::rdmap::{AtomicRequest, ReadRequest};
use super::super::terminate::Terminate;
use super::super::tx::{encode_fpdu, segment, TxConfig};
use super::*;
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
        let cap = rx.ring.cap();
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

/// A well-formed FPDU mutated by `f`, with its CRC recomputed when `crc`.
fn mutated(h: Header, body: &[u8], crc: bool, f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut v = Vec::new();
    encode_fpdu(&h, body, crc, &mut v).unwrap();
    f(&mut v);
    if crc {
        let n = v.len() - 4;
        let c = crc32c(&v[..n]).to_le_bytes();
        v[n..].copy_from_slice(&c);
    }
    v
}

fn reject(
    frame: &[u8],
    crc: bool,
    allowed: CapFlags,
    refuse: Option<TermCause>,
) -> (WireError, usize, Vec<u8>) {
    let mut mem = vec![0u8; 256];
    let mut placer = MemPlacer::new(&mut mem);
    placer.refuse = refuse;
    let mut rx = FpduReceiver::new(RxConfig::new(crc, 1454, allowed).unwrap());
    let mut src = Chunky::new(frame, vec![Some(7)]);
    let err = loop {
        match rx.poll(&mut src, &mut placer) {
            Ok(None) if src.pos == frame.len() => panic!("frame accepted as incomplete"),
            Ok(None) => continue,
            Ok(Some(r)) => panic!("accepted {r:?}"),
            Err(e) => break e,
        }
    };
    let calls = placer.calls;
    assert!(rx.offending_segment().is_some());
    drop(rx);
    (err, calls, mem)
}

#[test]
fn malformed_frames_rejected_with_the_right_cause_and_nothing_placed() {
    let write = Header::tagged(Opcode::Write, 1, 0, true);
    let payload = [0xEEu8; 40];
    let rr = ReadRequest {
        sink_stag: 1,
        sink_to: 0,
        size: 8,
        src_stag: 1,
        src_to: 0,
    }
    .encode();
    let rreq = Header::untagged(Opcode::ReadRequest, 1, true);
    type Case = (
        &'static str,
        Vec<u8>,
        CapFlags,
        Option<TermCause>,
        TermCause,
    );
    for crc in [true, false] {
        let m = |h, body: &[u8], f: fn(&mut Vec<u8>)| mutated(h, body, crc, f);
        let mut cases: Vec<Case> = vec![
            (
                "DDP version",
                m(write, &payload, |v| v[2] = 0xC2),
                CapFlags::ALL,
                None,
                TermCause::DDP_TAGGED_VERSION,
            ),
            (
                "DDP version untagged",
                m(rreq, &rr, |v| v[2] = 0x40),
                CapFlags::ALL,
                None,
                TermCause::DDP_UNTAGGED_VERSION,
            ),
            (
                "RDMAP version",
                m(write, &payload, |v| v[3] = 0x80),
                CapFlags::ALL,
                None,
                TermCause::RDMAP_VERSION,
            ),
            (
                "opcode 0xF",
                m(rreq, &rr, |v| v[3] = 0x4F),
                CapFlags::ALL,
                None,
                TermCause::RDMAP_UNEXPECTED_OPCODE,
            ),
            (
                "untagged Write",
                m(write, &payload, |v| v[2] = 0x41),
                CapFlags::ALL,
                None,
                TermCause::RDMAP_UNEXPECTED_OPCODE,
            ),
            (
                "too long",
                m(write, &payload, |v| {
                    v[..2].copy_from_slice(&1455u16.to_be_bytes())
                }),
                CapFlags::ALL,
                None,
                TermCause::MPA_LENGTH_MISMATCH,
            ),
            (
                "wrong QN",
                m(rreq, &rr, |v| v[11] = 0),
                CapFlags::ALL,
                None,
                TermCause::DDP_UNTAGGED_INVALID_QN,
            ),
            (
                "not negotiated",
                mutated(
                    Header::untagged(Opcode::FlushRequest, 1, true),
                    &[0; 28],
                    crc,
                    |_| {},
                ),
                CapFlags::RFC7306_ATOMICS,
                None,
                TermCause::RDMAP_UNEXPECTED_OPCODE,
            ),
            (
                "atomics not negotiated",
                mutated(
                    Header::untagged(Opcode::AtomicRequest, 1, true),
                    &[0; 52],
                    crc,
                    |_| {},
                ),
                CapFlags::FLUSH,
                None,
                TermCause::RDMAP_UNEXPECTED_OPCODE,
            ),
            (
                "short read request",
                mutated(rreq, &rr[..27], crc, |_| {}),
                CapFlags::ALL,
                None,
                TermCause::RDMAP_OPERATION_UNSPECIFIED,
            ),
            (
                "bounds",
                mutated(
                    Header::tagged(Opcode::Write, 1, 250, true),
                    &payload,
                    crc,
                    |_| {},
                ),
                CapFlags::ALL,
                None,
                TermCause::DDP_TAGGED_BASE_BOUNDS,
            ),
            (
                "stag",
                mutated(
                    Header::tagged(Opcode::Write, 2, 0, true),
                    &payload,
                    crc,
                    |_| {},
                ),
                CapFlags::ALL,
                None,
                TermCause::DDP_TAGGED_INVALID_STAG,
            ),
            (
                "no recv",
                mutated(
                    Header::untagged(Opcode::Send, 1, true),
                    &payload,
                    crc,
                    |_| {},
                ),
                CapFlags::ALL,
                Some(TermCause::DDP_UNTAGGED_NO_BUFFER),
                TermCause::DDP_UNTAGGED_NO_BUFFER,
            ),
        ];
        // ULPDU length 10: shorter than a tagged header; the FPDU is 16 bytes.
        let mut short = vec![0, 10, 0xC1, 0x40, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0];
        if crc {
            let c = crc32c(&short[..12]).to_le_bytes();
            short[12..].copy_from_slice(&c);
        }
        cases.push((
            "too short",
            short,
            CapFlags::ALL,
            None,
            TermCause::MPA_LENGTH_MISMATCH,
        ));
        if crc {
            cases.push((
                "bad CRC",
                mutated(write, &payload, false, |v| v[20] ^= 1),
                CapFlags::ALL,
                None,
                TermCause::MPA_CRC,
            ));
        }
        for (name, frame, allowed, refuse, cause) in cases {
            let (err, calls, mem) = reject(&frame, crc, allowed, refuse);
            assert_eq!(err.terminate_cause(), cause, "{name} (crc {crc}): {err}");
            assert!(mem.iter().all(|&b| b == 0), "{name}: memory touched");
            if refuse.is_none() && !matches!(err, WireError::Refused { .. }) {
                assert_eq!(calls, 0, "{name}: placer consulted");
            }
        }
    }
}

#[test]
fn bad_crc_quotes_the_offending_header() {
    let h = Header::tagged(Opcode::Write, 1, 0x20, true);
    let mut v = Vec::new();
    encode_fpdu(&h, &[1, 2, 3, 4], true, &mut v).unwrap();
    v[18] ^= 0xFF; // a payload byte
    let mut mem = vec![0u8; 64];
    let mut placer = MemPlacer::new(&mut mem);
    let mut rx = FpduReceiver::new(all_caps(true, 1454));
    let err = rx
        .poll(&mut Chunky::new(&v, vec![]), &mut placer)
        .unwrap_err();
    assert!(matches!(err, WireError::BadCrc { .. }));
    let (seg_len, hdr) = rx.offending_segment().unwrap();
    assert_eq!(seg_len, 18);
    assert_eq!(hdr, h.encode().as_slice());
    let t = Terminate::new(err.terminate_cause()).with_ddp(seg_len, hdr);
    assert_eq!(&t.encode()[..6], &[0x20, 0x02, 0xC0, 0x00, 0x00, 18]);
    drop(rx);
    assert!(mem.iter().all(|&b| b == 0));
}

#[test]
fn discard_and_control_bodies() {
    struct Drop1;
    impl Placer for Drop1 {
        fn place(&mut self, _: &Header, _: usize) -> std::result::Result<Placement, TermCause> {
            Ok(Placement::Discard)
        }
    }
    let mut v = Vec::new();
    encode_fpdu(
        &Header::tagged(Opcode::Write, 1, 0, true),
        &[5; 10],
        true,
        &mut v,
    )
    .unwrap();
    let t = Terminate::new(TermCause::RDMAP_ACCESS_RIGHTS);
    encode_fpdu(
        &Header::untagged(Opcode::Terminate, 1, true),
        &t.encode(),
        true,
        &mut v,
    )
    .unwrap();
    let mut rx = FpduReceiver::new(all_caps(true, 1454));
    let mut src = Chunky::new(&v, vec![]);
    let r = rx.poll(&mut src, &mut Drop1).unwrap().unwrap();
    assert_eq!(r.data, Delivered::Discarded);
    let r = rx.poll(&mut src, &mut Drop1).unwrap().unwrap();
    assert_eq!(r.data, Delivered::Control(Body::Terminate(t)));
    assert!(rx.poll(&mut src, &mut Drop1).unwrap().is_none());
}

#[test]
fn placement_shorter_than_payload_is_an_error() {
    struct Short(Vec<u8>);
    impl Placer for Short {
        fn place(&mut self, _: &Header, _: usize) -> std::result::Result<Placement, TermCause> {
            // SAFETY: the vector outlives the receiver's use of it in this test.
            Ok(Placement::Direct(unsafe {
                DirectTarget::new(self.0.as_mut_ptr(), self.0.len())
            }))
        }
    }
    let mut v = Vec::new();
    encode_fpdu(
        &Header::tagged(Opcode::Write, 1, 0, true),
        &[5; 10],
        false,
        &mut v,
    )
    .unwrap();
    let mut rx = FpduReceiver::new(all_caps(false, 1454));
    let mut p = Short(vec![0; 4]);
    let err = rx.poll(&mut Chunky::new(&v, vec![]), &mut p).unwrap_err();
    assert!(matches!(
        err,
        WireError::PlacementTooShort { need: 10, given: 4 }
    ));
    assert_eq!(p.0, [0; 4]);
}

#[test]
fn config_limits() {
    assert!(RxConfig::new(true, 127, CapFlags::ALL).is_err());
    assert!(RxConfig::new(true, 65536, CapFlags::ALL).is_err());
    let n = Negotiated {
        crc: true,
        ird: 1,
        ord: 1,
        caps: super::super::Caps::foreign(vec![]),
        shared: CapFlags::FLUSH,
        rtr: None,
    };
    let c = RxConfig::from_negotiated(&n, 9000).unwrap();
    assert!(c.check_allowed(Opcode::FlushRequest).is_ok());
    assert!(c.check_allowed(Opcode::PrivateResponse).is_ok());
    assert!(c.check_allowed(Opcode::AtomicWriteRequest).is_err());
    assert!(c.check_allowed(Opcode::ImmediateData).is_err());
    assert!(c.check_allowed(Opcode::Send).is_ok());
}

fn run_to_end(rx: &mut FpduReceiver, src: &mut Chunky<'_>, placer: &mut MemPlacer) {
    // EOF at the end: every run ends in an error (Closed at worst), never a panic.
    for _ in 0..100_000 {
        if rx.poll(src, placer).is_err() {
            return;
        }
    }
    panic!("the receiver neither finished nor failed");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(
        data in proptest::collection::vec(any::<u8>(), 0..3000),
        crc in any::<bool>(),
        plan in proptest::collection::vec(proptest::option::weighted(0.8, 1usize..500), 1..8),
    ) {
        let mut mem = vec![0u8; 8192];
        let mut placer = MemPlacer::new(&mut mem);
        let mut rx = FpduReceiver::new(all_caps(crc, 1454));
        let mut src = Chunky::new(&data, plan);
        src.eof = true;
        run_to_end(&mut rx, &mut src, &mut placer);
    }

    /// A valid stream with one byte flipped: an error or a (CRC off) misplaced-but-in-bounds
    /// delivery, never a panic; with CRC on, the flipped FPDU places nothing.
    #[test]
    fn one_flipped_byte_never_panics(
        sizes in proptest::collection::vec(0usize..2000, 1..5),
        at in any::<proptest::sample::Index>(),
        flip in 1u8..=255,
        crc in any::<bool>(),
    ) {
        let tx = TxConfig::new(crc, 1454).unwrap();
        let mut stream = Vec::new();
        for (i, n) in sizes.iter().enumerate() {
            let data = vec![0x5Au8; *n];
            let sg = [&data[..]];
            let h = if i % 2 == 0 {
                Header::tagged(Opcode::Write, 1, 0, false)
            } else {
                Header::untagged(Opcode::Send, i as u32, false)
            };
            for f in segment(h, &sg, &tx) {
                f.append_to(&mut stream);
            }
        }
        let i = at.index(stream.len());
        stream[i] ^= flip;
        let mut mem = vec![0u8; 8192];
        let mut placer = MemPlacer::new(&mut mem);
        let mut rx = FpduReceiver::new(all_caps(crc, 1454));
        let mut src = Chunky::new(&stream, vec![Some(333), None]);
        src.eof = true;
        run_to_end(&mut rx, &mut src, &mut placer);
        drop(rx);
        // Only 0x5A payload bytes can ever land, and only inside the memory.
        prop_assert!(mem.iter().all(|&b| b == 0 || b == 0x5A || !crc));
    }

    #[test]
    fn decoders_never_panic(data in proptest::collection::vec(any::<u8>(), 0..700)) {
        let _ = Header::decode(&data);
        let _ = super::super::MpaFrame::decode(&data);
        let _ = Terminate::decode(&data);
        let _ = super::super::Caps::decode(&data);
        for op in 0u8..=0xE {
            let _ = Body::decode(Opcode::from_u8(op).unwrap(), &data);
        }
    }
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
