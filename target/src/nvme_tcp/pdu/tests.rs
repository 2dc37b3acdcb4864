use super::*;

/// A connected queue's limits.
fn limits(hdgst: bool, ddgst: bool) -> Limits {
    Limits {
        await_icreq: false,
        hdgst,
        ddgst,
        max_capsule_data: 8192,
        maxh2cdata: 65536,
    }
}

/// A PDU as a host would frame it: `hdr` (HLEN bytes, the common header's type/flags filled in
/// here), the digests when `l` has them, and `data`.
fn build(pdu_type: u8, mut flags: u8, hdr_rest: &[u8], data: &[u8], l: &Limits) -> Vec<u8> {
    let hlen = CH_LEN + hdr_rest.len();
    let hd = if l.hdgst { DIGEST_LEN } else { 0 };
    let dd = if l.ddgst && !data.is_empty() {
        DIGEST_LEN
    } else {
        0
    };
    if l.hdgst {
        flags |= flag::HDGSTF;
    }
    if dd > 0 {
        flags |= flag::DDGSTF;
    }
    let pdo = if data.is_empty() { 0 } else { hlen + hd };
    let plen = hlen + hd + data.len() + dd;
    let mut b = vec![pdu_type, flags, hlen as u8, pdo as u8];
    b.extend_from_slice(&(plen as u32).to_le_bytes());
    b.extend_from_slice(hdr_rest);
    if l.hdgst {
        let d = crc32c(&b[..hlen]);
        b.extend_from_slice(&d.to_le_bytes());
    }
    b.extend_from_slice(data);
    if dd > 0 {
        b.extend_from_slice(&crc32c(data).to_le_bytes());
    }
    b
}

fn command(cid: u16) -> [u8; 64] {
    let mut sqe = [0u8; 64];
    sqe[0] = 0x02;
    sqe[2..4].copy_from_slice(&cid.to_le_bytes());
    sqe
}

fn h2c(cccid: u16, ttag: u16, datao: u32, datal: u32) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&cccid.to_le_bytes());
    h.extend_from_slice(&ttag.to_le_bytes());
    h.extend_from_slice(&datao.to_le_bytes());
    h.extend_from_slice(&datal.to_le_bytes());
    h.extend_from_slice(&[0; 4]);
    h
}

fn icreq(pfv: u16, hpda: u8, digest: u8) -> Vec<u8> {
    let mut b = vec![kind::IC_REQ, 0, 128, 0];
    b.extend_from_slice(&128u32.to_le_bytes());
    b.extend_from_slice(&pfv.to_le_bytes());
    b.push(hpda);
    b.push(digest);
    b.extend_from_slice(&3u32.to_le_bytes());
    b.resize(128, 0);
    b
}

fn fatal(f: Framed<'_>) -> (Fes, u32) {
    match f {
        Framed::Fatal(f) => (f.fes, f.fei),
        other => panic!("expected a fatal error, got {other:?}"),
    }
}

#[test]
fn crc32c_is_the_castagnoli_check_value() {
    assert_eq!(crc32c(b"123456789"), 0xe306_9283);
}

#[test]
fn an_icreq_is_the_only_pdu_accepted_first() {
    let b = icreq(0, 2, 3);
    assert_eq!(
        frame(&b, &Limits::ICREQ),
        Framed::Pdu(
            Pdu::IcReq(IcReq {
                pfv: 0,
                hpda: 2,
                digest: 3,
                maxr2t: 3
            }),
            128
        )
    );
    assert_eq!(frame(&b[..5], &Limits::ICREQ), Framed::NeedMore(8));
    assert_eq!(frame(&b[..100], &Limits::ICREQ), Framed::NeedMore(128));
    let cmd = build(
        kind::CAPSULE_CMD,
        0,
        &command(1),
        &[],
        &limits(false, false),
    );
    assert_eq!(fatal(frame(&cmd, &Limits::ICREQ)).0, Fes::PduSequenceError);
    // A second ICReq once connected.
    assert_eq!(
        fatal(frame(&b, &limits(false, false))).0,
        Fes::PduSequenceError
    );
    let mut bad = b.clone();
    bad[2] = 64;
    assert_eq!(
        fatal(frame(&bad, &Limits::ICREQ)),
        (Fes::InvalidHeaderField, 2)
    );
    let mut bad = b.clone();
    bad[4] = 200;
    assert_eq!(
        fatal(frame(&bad, &Limits::ICREQ)),
        (Fes::InvalidHeaderField, 4)
    );
    assert_eq!(Limits::ICREQ.max_plen(), 128);
}

#[test]
fn capsules_with_and_without_data_and_digests() {
    for (hd, dd) in [(false, false), (true, false), (false, true), (true, true)] {
        let l = limits(hd, dd);
        let data = [7u8; 100];
        let mut two = build(kind::CAPSULE_CMD, 0, &command(9), &data, &l);
        let first = two.len();
        two.extend(build(kind::CAPSULE_CMD, 0, &command(10), &[], &l));
        match frame(&two, &l) {
            Framed::Pdu(
                Pdu::CapsuleCmd {
                    sqe,
                    data: d,
                    data_ok,
                },
                used,
            ) => {
                assert_eq!(used, first, "{hd} {dd}");
                assert_eq!(u16::from_le_bytes([sqe[2], sqe[3]]), 9);
                assert_eq!(d, &data[..]);
                assert!(data_ok);
            }
            other => panic!("{other:?}"),
        }
        match frame(&two[first..], &l) {
            Framed::Pdu(Pdu::CapsuleCmd { data, .. }, used) => {
                assert!(data.is_empty());
                assert_eq!(used, two.len() - first);
            }
            other => panic!("{other:?}"),
        }
        // Partial: it says how long the whole PDU is.
        assert_eq!(frame(&two[..first - 1], &l), Framed::NeedMore(first));
    }
}

#[test]
fn a_bad_header_digest_is_fatal_a_bad_data_digest_is_not() {
    let l = limits(true, true);
    let mut b = build(kind::CAPSULE_CMD, 0, &command(1), &[1, 2, 3, 4], &l);
    b[20] ^= 1; // in the command: the header digest no longer matches
    assert_eq!(fatal(frame(&b, &l)).0, Fes::HeaderDigestError);
    let mut b = build(kind::CAPSULE_CMD, 0, &command(1), &[1, 2, 3, 4], &l);
    let last = b.len() - 1;
    b[last] ^= 1; // the data digest
    match frame(&b, &l) {
        Framed::Pdu(Pdu::CapsuleCmd { data_ok, .. }, _) => assert!(!data_ok),
        other => panic!("{other:?}"),
    }
    let mut b = build(
        kind::H2C_DATA,
        flag::LAST_PDU,
        &h2c(1, 1, 0, 4),
        &[9; 4],
        &l,
    );
    let at = b.len() - 5;
    b[at] ^= 0x80; // the data itself
    match frame(&b, &l) {
        Framed::Pdu(Pdu::H2cData { data_ok, hdr, .. }, _) => {
            assert!(!data_ok);
            assert!(hdr.last);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn digest_flags_must_say_what_was_negotiated() {
    let with = build(kind::CAPSULE_CMD, 0, &command(1), &[], &limits(true, false));
    assert_eq!(
        fatal(frame(&with, &limits(false, false))),
        (Fes::InvalidHeaderField, 1),
        "HDGSTF without a header digest negotiated"
    );
    let without = build(
        kind::CAPSULE_CMD,
        0,
        &command(1),
        &[],
        &limits(false, false),
    );
    assert_eq!(
        fatal(frame(&without, &limits(true, false))),
        (Fes::InvalidHeaderField, 1),
        "no HDGSTF where one was negotiated"
    );
    let dd = build(
        kind::CAPSULE_CMD,
        0,
        &command(1),
        &[5; 8],
        &limits(false, true),
    );
    assert_eq!(
        fatal(frame(&dd, &limits(false, false))),
        (Fes::InvalidHeaderField, 1)
    );
    let no_dd = build(
        kind::CAPSULE_CMD,
        0,
        &command(1),
        &[5; 8],
        &limits(false, false),
    );
    assert_eq!(
        fatal(frame(&no_dd, &limits(false, true))),
        (Fes::InvalidHeaderField, 1)
    );
}

#[test]
fn lengths_and_offsets() {
    let l = limits(false, false);
    let mut b = build(kind::CAPSULE_CMD, 0, &command(1), &[1; 16], &l);
    b[3] = 76; // PDO past the header
    assert_eq!(fatal(frame(&b, &l)), (Fes::InvalidHeaderField, 3));
    let mut b = build(kind::CAPSULE_CMD, 0, &command(1), &[], &l);
    b[3] = 72; // PDO without data
    assert_eq!(fatal(frame(&b, &l)), (Fes::InvalidHeaderField, 3));
    let mut b = build(kind::CAPSULE_CMD, 0, &command(1), &[], &l);
    b[4] = 40; // PLEN shorter than the header
    assert_eq!(fatal(frame(&b, &l)), (Fes::InvalidHeaderField, 4));
    let mut b = build(kind::CAPSULE_CMD, 0, &command(1), &[], &l);
    b[2] = 24; // HLEN
    assert_eq!(fatal(frame(&b, &l)), (Fes::InvalidHeaderField, 2));
    // More in-capsule data than allowed: refused from the common header alone.
    let mut head = build(kind::CAPSULE_CMD, 0, &command(1), &[0; 16], &l);
    head[4..8].copy_from_slice(&(72u32 + 8193).to_le_bytes());
    assert_eq!(fatal(frame(&head[..8], &l)).0, Fes::DataLimitExceeded);
    // An H2CData PDU longer than MAXH2CDATA, likewise.
    let mut head = build(kind::H2C_DATA, 0, &h2c(1, 1, 0, 65537), &[0; 4], &l);
    head[4..8].copy_from_slice(&(24u32 + 65537).to_le_bytes());
    assert_eq!(fatal(frame(&head[..8], &l)).0, Fes::DataLimitExceeded);
    // DATAL must be what the PDU carries.
    let b = build(kind::H2C_DATA, 0, &h2c(1, 1, 0, 8), &[0; 4], &l);
    assert_eq!(
        fatal(frame(&b, &l)),
        (Fes::InvalidHeaderField, h2c_off::DATAL)
    );
    assert!(l.max_plen() >= 24 + 65536 && l.max_plen() < 24 + 65536 + 64);
}

#[test]
fn controller_to_host_and_unknown_pdus_are_refused_by_type() {
    let l = limits(false, false);
    for t in [
        kind::IC_RESP,
        kind::C2H_TERM_REQ,
        kind::CAPSULE_RESP,
        kind::C2H_DATA,
        kind::R2T,
        0x08,
        0x0a,
        0xff,
    ] {
        let b = build(t, 0, &[0; 16], &[], &l);
        assert_eq!(
            fatal(frame(&b, &l)),
            (Fes::InvalidHeaderField, 0),
            "type {t:#x}"
        );
    }
}

#[test]
fn a_host_terminate_request_is_read() {
    let l = limits(true, true);
    let mut b = vec![kind::H2C_TERM_REQ, 0, 24, 0];
    b.extend_from_slice(&30u32.to_le_bytes());
    b.extend_from_slice(&2u16.to_le_bytes());
    b.extend_from_slice(&0x0102_0304u32.to_le_bytes());
    b.resize(30, 0);
    assert_eq!(
        frame(&b, &l),
        Framed::Pdu(
            Pdu::H2cTermReq {
                fes: 2,
                fei: 0x0102_0304
            },
            30
        )
    );
    let mut long = b.clone();
    long[4..8].copy_from_slice(&153u32.to_le_bytes());
    assert_eq!(fatal(frame(&long, &l)), (Fes::InvalidHeaderField, 4));
}

#[test]
fn what_the_controller_sends_is_laid_out_as_the_host_reads_it() {
    let mut b = Vec::new();
    ic_resp(&mut b, 0, 3, 65536);
    assert_eq!(b.len(), 128);
    assert_eq!(&b[..8], &[1, 0, 128, 0, 128, 0, 0, 0]);
    assert_eq!((b[8], b[9], b[10], b[11]), (0, 0, 0, 3));
    assert_eq!(u32::from_le_bytes(b[12..16].try_into().unwrap()), 65536);

    let mut b = Vec::new();
    capsule_resp(&mut b, true, &[0xaa; 16]);
    assert_eq!(b.len(), 28);
    assert_eq!(&b[..8], &[5, flag::HDGSTF, 24, 0, 28, 0, 0, 0]);
    assert_eq!(
        u32::from_le_bytes(b[24..28].try_into().unwrap()),
        crc32c(&b[..24])
    );

    let mut b = Vec::new();
    r2t(&mut b, false, 7, 9, 0, 4096);
    assert_eq!(b.len(), 24);
    assert_eq!(&b[..8], &[9, 0, 24, 0, 24, 0, 0, 0]);
    assert_eq!(&b[8..12], &[7, 0, 9, 0]);
    assert_eq!(u32::from_le_bytes(b[16..20].try_into().unwrap()), 4096);

    // C2HData with both digests and an alignment the host asked for (HPDA 3: 16 bytes).
    let f = C2hFraming {
        hdgst: true,
        ddgst: true,
        hpda: 3,
    };
    let d = C2hData {
        cccid: 4,
        offset: 0,
        len: 5,
        last: true,
        success: true,
    };
    let mut b = Vec::new();
    c2h_data(&mut b, f, d, |buf| {
        buf.copy_from_slice(b"hello");
        Ok::<(), ()>(())
    })
    .unwrap();
    let pdo = b[3] as usize;
    assert_eq!(pdo, 32, "24 + 4 rounded up to 16");
    assert_eq!(
        b[1],
        flag::HDGSTF | flag::DDGSTF | flag::LAST_PDU | flag::SUCCESS
    );
    assert_eq!(
        u32::from_le_bytes(b[4..8].try_into().unwrap()) as usize,
        b.len()
    );
    assert_eq!(&b[pdo..pdo + 5], b"hello");
    assert_eq!(
        u32::from_le_bytes(b[pdo + 5..].try_into().unwrap()),
        crc32c(b"hello")
    );
    assert_eq!(u16::from_le_bytes([b[8], b[9]]), 4);
    assert_eq!(u32::from_le_bytes(b[16..20].try_into().unwrap()), 5);
    // A fill that fails leaves nothing behind.
    let before = b.len();
    assert!(c2h_data(&mut b, f, d, |_| Err(())).is_err());
    assert_eq!(b.len(), before);

    let mut b = Vec::new();
    let offending = [0x55u8; 200];
    c2h_term_req(
        &mut b,
        &Fatal::new(Fes::InvalidHeaderField, 10, "ttag"),
        &offending,
    );
    assert_eq!(b.len(), 24 + 128, "at most 128 bytes of the offending PDU");
    assert_eq!(&b[..4], &[3, 0, 24, 0]);
    assert_eq!(u32::from_le_bytes(b[4..8].try_into().unwrap()), 152);
    assert_eq!(u16::from_le_bytes([b[8], b[9]]), 1, "FES");
    assert_eq!(
        u32::from_le_bytes(b[10..14].try_into().unwrap()),
        10,
        "FEI at byte 10"
    );
    assert_eq!(&b[24..], &offending[..128]);
    // FEI is only an offset for the statuses that have one.
    assert_eq!(Fatal::new(Fes::DataLimitExceeded, 10, "x").fei, 0);
}

#[test]
fn garbage_never_panics_and_never_asks_for_more_than_the_limit() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for l in [
        Limits::ICREQ,
        limits(false, false),
        limits(true, true),
        limits(true, false),
    ] {
        for _ in 0..20_000 {
            let n = (next() % 200) as usize;
            let mut b: Vec<u8> = (0..n).map(|_| next() as u8).collect();
            if n > 0 && next() % 2 == 0 {
                b[0] = [0u8, 2, 4, 6][(next() % 4) as usize];
            }
            match frame(&b, &l) {
                Framed::NeedMore(need) => assert!(need <= l.max_plen(), "{need}"),
                Framed::Pdu(_, used) => assert!(used <= b.len()),
                Framed::Fatal(_) => {}
            }
        }
    }
}
