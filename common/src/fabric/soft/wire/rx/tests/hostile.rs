//! Malformed and hostile input: every bad frame is refused with the cause the RFCs prescribe,
//! nothing of it is placed, and no input makes the receiver panic.

use super::*;

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

        fn write(&mut self, target: DirectTarget, payload: &[u8]) -> Result<bool> {
            write_payload(target, payload)
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

        fn write(&mut self, target: DirectTarget, payload: &[u8]) -> Result<bool> {
            write_payload(target, payload)
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
        caps: crate::fabric::soft::wire::Caps::foreign(vec![]),
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
        let _ = crate::fabric::soft::wire::MpaFrame::decode(&data);
        let _ = Terminate::decode(&data);
        let _ = crate::fabric::soft::wire::Caps::decode(&data);
        for op in 0u8..=0xE {
            let _ = Body::decode(Opcode::from_u8(op).unwrap(), &data);
        }
    }
}
