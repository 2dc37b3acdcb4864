//! Tests of MPA frames, negotiation, and the handshake over loopback TCP.

use super::*;

fn caps_bytes() -> Vec<u8> {
    let mut v = Vec::new();
    Caps::new(CapFlags::ALL, Some(1454), Vec::new()).encode_into(&mut v);
    v
}

#[test]
fn request_golden() {
    let cfg = MpaConfig::default();
    let b = cfg.request().encode().unwrap();
    let mut want = b"MPA ID Req Frame".to_vec();
    want.extend_from_slice(&[0x50, 0x02, 0x00, 16]); // C | enhanced, rev 2, 16 bytes
    want.extend_from_slice(&[0x00, 0x10, 0x00, 0x10]); // IRD 16, ORD 16
    want.extend_from_slice(&[0x72, 0x50, 0x4D, 0x41, 1, 12, 0, 7, 0x05, 0xAE, 0, 0]);
    assert_eq!(b, want);
    let (f, used) = MpaFrame::decode(&b).unwrap().unwrap();
    assert_eq!(used, b.len());
    assert_eq!(f, cfg.request());
}

#[test]
fn reject_reply_golden() {
    let b = reject_reply(2).encode().unwrap();
    let mut want = b"MPA ID Rep Frame".to_vec();
    want.extend_from_slice(&[0x30, 0x02, 0x00, 0x04, 0, 0, 0, 0]);
    assert_eq!(b, want);
    let b = reject_reply(1).encode().unwrap();
    assert_eq!(&b[16..], &[0x20, 0x01, 0x00, 0x00]);
}

#[test]
fn ird_ord_prefix_golden() {
    let io = IrdOrd {
        ird: 0x3FFF,
        ord: 0x0001,
        peer_to_peer: true,
        zero_len_send_rtr: false,
        zero_len_write_rtr: true,
        zero_len_read_rtr: true,
    };
    assert_eq!(io.encode(), [0xBF, 0xFF, 0xC0, 0x01]);
    assert_eq!(IrdOrd::decode(io.encode()), io);
    let io = IrdOrd {
        zero_len_send_rtr: true,
        ird: 2,
        ord: 3,
        ..Default::default()
    };
    assert_eq!(io.encode(), [0x40, 0x02, 0x00, 0x03]);
    assert_eq!(IrdOrd::decode(io.encode()), io);
}

#[test]
fn incremental_decode_waits_for_whole_frame() {
    let b = MpaConfig::default().request().encode().unwrap();
    for n in 0..b.len() {
        assert_eq!(MpaFrame::decode(&b[..n]).unwrap(), None, "prefix {n}");
    }
    let mut more = b.clone();
    more.extend_from_slice(&[1, 2, 3]);
    assert_eq!(MpaFrame::decode(&more).unwrap().unwrap().1, b.len());
}

#[test]
fn bad_frames_are_rejected() {
    assert!(matches!(
        MpaFrame::decode(b"MPA ID Xq"),
        Err(WireError::BadMpaKey { expected: None })
    ));
    let mut b = MpaConfig::default().request().encode().unwrap();
    b[4] = b'x';
    assert!(matches!(
        MpaFrame::decode(&b),
        Err(WireError::BadMpaKey { .. })
    ));
    let mut b = b"MPA ID Rep Frame".to_vec();
    b.extend_from_slice(&[0, 2, 0x02, 0x01]); // 513 bytes of private data
    assert!(matches!(
        MpaFrame::decode(&b),
        Err(WireError::PrivateDataTooLong { len: 513, max: 512 })
    ));
    let mut b = b"MPA ID Rep Frame".to_vec();
    b.extend_from_slice(&[0x10, 2, 0, 2, 0, 0]); // enhanced but a 2-byte prefix
    assert!(matches!(
        MpaFrame::decode(&b),
        Err(WireError::MissingIrdOrd)
    ));
    let big = MpaFrame {
        private_data: vec![0; 509],
        ..MpaConfig::default().request()
    };
    assert!(matches!(
        big.encode(),
        Err(WireError::PrivateDataTooLong { len: 513, .. })
    ));
}

fn peer_request(f: impl FnOnce(&mut MpaFrame)) -> MpaFrame {
    let mut r = MpaConfig::default().request();
    f(&mut r);
    r
}

#[test]
fn negotiation_rules() {
    let mut local = MpaConfig {
        crc: false,
        ird: 8,
        ord: 4,
        ..Default::default()
    };
    let peer = peer_request(|r| {
        r.crc = false;
        r.ird_ord = Some(IrdOrd {
            ird: 2,
            ord: 32,
            ..Default::default()
        });
    });
    let n = negotiate(&local, &peer).unwrap();
    assert!(!n.crc);
    assert_eq!((n.ird, n.ord), (8, 2));
    assert_eq!(n.shared, CapFlags::ALL);
    assert_eq!(n.rtr, None);
    assert_eq!(n.tx_max_ulpdu(65535), 1454);
    // CRC when either asks.
    let peer_crc = peer_request(|r| r.crc = true);
    assert!(negotiate(&local, &peer_crc).unwrap().crc);
    local.crc = true;
    assert!(negotiate(&local, &peer).unwrap().crc);
    // Shared caps are the intersection; a foreign peer shares nothing.
    local.caps.flags = CapFlags::FLUSH | CapFlags::ATOMIC_WRITE;
    let siw = peer_request(|r| r.private_data = b"foreign".to_vec());
    let n = negotiate(&local, &siw).unwrap();
    assert_eq!(n.shared, CapFlags::NONE);
    assert_eq!(n.caps.app, b"foreign");
    let n = negotiate(&local, &peer).unwrap();
    assert_eq!(n.shared, CapFlags::FLUSH | CapFlags::ATOMIC_WRITE);
}

#[test]
fn negotiation_refusals() {
    let local = MpaConfig::default();
    type Check = fn(&WireError) -> bool;
    let cases: Vec<(MpaFrame, Check)> = vec![
        (peer_request(|r| r.markers = true), |e| {
            matches!(e, WireError::MarkersRequested)
        }),
        (peer_request(|r| r.revision = 1), |e| {
            matches!(e, WireError::BadMpaRevision { revision: 1 })
        }),
        (peer_request(|r| r.revision = 3), |e| {
            matches!(e, WireError::BadMpaRevision { revision: 3 })
        }),
        (peer_request(|r| r.ird_ord = None), |e| {
            matches!(e, WireError::MissingIrdOrd)
        }),
        (
            peer_request(|r| r.private_data = b"rPMA\x01\x02".to_vec()),
            |e| matches!(e, WireError::BadCaps { .. }),
        ),
        (
            MpaFrame {
                kind: MpaKind::Reply,
                ..reject_reply(2)
            },
            |e| matches!(e, WireError::Rejected),
        ),
    ];
    for (frame, check) in cases {
        let err = negotiate(&local, &frame).unwrap_err();
        assert!(check(&err), "{frame:?}: {err}");
        assert_eq!(err.terminate_cause().layer, super::super::Layer::Mpa);
    }
    let bad = MpaConfig {
        ird: 0x4000,
        ..Default::default()
    };
    assert!(matches!(
        negotiate(&bad, &peer_request(|_| {})),
        Err(WireError::InvalidConfig { .. })
    ));
    let bad = MpaConfig {
        caps: Caps::new(CapFlags::ALL, None, vec![0; 241]),
        ..Default::default()
    };
    assert!(matches!(
        bad.validate(),
        Err(WireError::InvalidConfig { .. })
    ));
}

#[test]
fn peer_to_peer_rtr_choice() {
    let passive = MpaConfig::default();
    let req = peer_request(|r| {
        r.ird_ord = Some(IrdOrd {
            ird: 1,
            ord: 1,
            peer_to_peer: true,
            zero_len_send_rtr: true,
            zero_len_read_rtr: true,
            ..Default::default()
        })
    });
    let n = negotiate(&passive, &req).unwrap();
    assert_eq!(n.rtr, Some(Rtr::Read));
    let reply = passive.reply(&n);
    let io = reply.ird_ord.unwrap();
    assert!(io.peer_to_peer && io.zero_len_read_rtr && !io.zero_len_send_rtr);
    // The active side reads the same choice out of the Reply.
    let active = MpaConfig {
        peer_to_peer: Some(RtrTypes::ALL),
        ..Default::default()
    };
    assert_eq!(negotiate(&active, &reply).unwrap().rtr, Some(Rtr::Read));
    // No common type.
    let picky = MpaConfig {
        peer_to_peer: Some(RtrTypes {
            write: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    assert!(matches!(
        negotiate(&picky, &req),
        Err(WireError::NoMatchingRtr)
    ));
    // A Reply turning on peer-to-peer we did not ask for.
    assert!(matches!(
        negotiate(&passive, &reply),
        Err(WireError::NoMatchingRtr)
    ));
}

#[test]
fn caps_default_fits_siw_limit() {
    assert!(4 + caps_bytes().len() <= MAX_SENT_PRIVATE_DATA);
}

mod loopback {
    use super::super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::thread;
    use std::time::Duration;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (p, _) = l.accept().unwrap();
        for s in [&a, &p] {
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        }
        (a, p)
    }

    fn handshake(
        active: MpaConfig,
        passive: MpaConfig,
    ) -> (Result<Negotiated>, Result<Negotiated>) {
        let (mut a, mut p) = pair();
        let t = thread::spawn(move || accept_handshake(&mut p, &passive));
        let ra = connect_handshake(&mut a, &active);
        (ra, t.join().unwrap())
    }

    #[test]
    fn crc_is_on_when_either_side_asks() {
        for (ca, cp) in [(false, false), (true, false), (false, true), (true, true)] {
            let active = MpaConfig {
                crc: ca,
                ird: 4,
                ord: 64,
                ..Default::default()
            };
            let passive = MpaConfig {
                crc: cp,
                ird: 32,
                ord: 2,
                ..Default::default()
            };
            let (a, p) = handshake(active, passive);
            let (a, p) = (a.unwrap(), p.unwrap());
            assert_eq!(a.crc, ca || cp);
            assert_eq!(p.crc, ca || cp);
            // Our ORD never exceeds the peer's IRD.
            assert_eq!((a.ird, a.ord), (2, 32));
            assert_eq!((p.ird, p.ord), (32, 2));
            assert_eq!(a.shared, CapFlags::ALL);
            assert_eq!(p.shared, CapFlags::ALL);
            assert_eq!(a.rtr, None);
        }
    }

    #[test]
    fn application_bytes_and_caps_travel() {
        let active = MpaConfig {
            caps: Caps::new(CapFlags::FLUSH, Some(9000), b"host".to_vec()),
            ..Default::default()
        };
        let passive = MpaConfig {
            caps: Caps::new(
                CapFlags::FLUSH | CapFlags::ATOMIC_WRITE,
                None,
                b"target".to_vec(),
            ),
            peer_to_peer: Some(RtrTypes {
                write: true,
                ..Default::default()
            }),
            ..Default::default()
        };
        let active = MpaConfig {
            peer_to_peer: Some(RtrTypes::ALL),
            ..active
        };
        let (a, p) = handshake(active, passive);
        let (a, p) = (a.unwrap(), p.unwrap());
        assert_eq!(a.caps.app, b"target");
        assert_eq!(p.caps.app, b"host");
        assert_eq!(p.caps.max_ulpdu, Some(9000));
        assert_eq!(p.tx_max_ulpdu(65535), 9000);
        assert_eq!(a.shared, CapFlags::FLUSH);
        assert_eq!(p.shared, CapFlags::FLUSH);
        assert_eq!((a.rtr, p.rtr), (Some(Rtr::Write), Some(Rtr::Write)));
    }

    #[test]
    fn refused_request_gets_a_reject_reply() {
        let active = MpaConfig {
            peer_to_peer: Some(RtrTypes {
                send: true,
                ..Default::default()
            }),
            ..Default::default()
        };
        let passive = MpaConfig {
            peer_to_peer: Some(RtrTypes {
                read: true,
                ..Default::default()
            }),
            ..Default::default()
        };
        let (a, p) = handshake(active, passive);
        assert!(matches!(p, Err(WireError::NoMatchingRtr)), "{p:?}");
        assert!(matches!(a, Err(WireError::Rejected)), "{a:?}");
    }

    /// Sends raw Request bytes to a passive side and returns its error and the reply bytes.
    fn raw_request(bytes: Vec<u8>) -> (WireError, Vec<u8>) {
        let (mut a, mut p) = pair();
        let t = thread::spawn(move || accept_handshake(&mut p, &MpaConfig::default()));
        a.write_all(&bytes).unwrap();
        let err = t.join().unwrap().unwrap_err();
        let mut reply = Vec::new();
        a.read_to_end(&mut reply).unwrap();
        (err, reply)
    }

    fn assert_reject(reply: &[u8]) {
        let (f, used) = MpaFrame::decode(reply).unwrap().unwrap();
        assert_eq!(used, reply.len());
        assert_eq!(f.kind, MpaKind::Reply);
        assert!(f.reject);
        assert!(matches!(
            negotiate(&MpaConfig::default(), &f),
            Err(WireError::Rejected)
        ));
    }

    #[test]
    fn markers_request_is_rejected() {
        let mut req = MpaConfig::default().request().encode().unwrap();
        req[16] |= FLAG_MARKERS;
        let (err, reply) = raw_request(req);
        assert!(matches!(err, WireError::MarkersRequested));
        assert_eq!(
            err.terminate_cause(),
            super::super::super::TermCause::MPA_INVALID_REQ_REP
        );
        assert_reject(&reply);
    }

    #[test]
    fn bad_key_revision_and_oversize_are_rejected() {
        let mut bad_key = MpaConfig::default().request().encode().unwrap();
        bad_key[7] = b'Q';
        let (err, reply) = raw_request(bad_key);
        assert!(matches!(
            err,
            WireError::BadMpaKey {
                expected: Some(MpaKind::Request)
            }
        ));
        assert_reject(&reply);

        let rev1 = MpaFrame {
            revision: 1,
            ird_ord: None,
            enhanced: false,
            ..MpaConfig::default().request()
        };
        let (err, reply) = raw_request(rev1.encode().unwrap());
        assert!(matches!(err, WireError::BadMpaRevision { revision: 1 }));
        assert_reject(&reply);
        assert_eq!(reply[17], 1, "a revision-1 peer is answered in revision 1");

        let mut big = b"MPA ID Req Frame".to_vec();
        big.extend_from_slice(&[FLAG_ENHANCED, 2, 0x02, 0x01]);
        big.extend_from_slice(&[0; 513]);
        let (err, reply) = raw_request(big);
        assert!(matches!(
            err,
            WireError::PrivateDataTooLong { len: 513, .. }
        ));
        assert_reject(&reply);
    }

    #[test]
    fn peer_closing_mid_handshake_is_closed() {
        let (mut a, p) = pair();
        let t = thread::spawn(move || {
            let mut p = p;
            let mut buf = [0u8; 20];
            p.read_exact(&mut buf).unwrap();
            // Drop without replying.
        });
        let err = connect_handshake(&mut a, &MpaConfig::default()).unwrap_err();
        t.join().unwrap();
        assert!(
            matches!(err, WireError::Closed { .. } | WireError::Io { .. }),
            "{err:?}"
        );
        assert_eq!(
            err.terminate_cause(),
            super::super::super::TermCause::MPA_TCP_LOST
        );
    }
}
