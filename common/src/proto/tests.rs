use super::*;
use proptest::prelude::*;

fn nqn(s: &str) -> Nqn {
    Nqn::new(s).unwrap()
}

fn samples() -> Vec<Message> {
    vec![
        Message::Connect(Connect {
            host_nqn: nqn("nqn.2026-11.io.rpma:host1"),
            subsystem_nqn: nqn("nqn.2026-11.io.rpma:demo"),
            host_id: HostId([9; 16]),
            queue_id: 3,
            keep_alive_ms: 5000,
        }),
        Message::AuthChallenge(AuthChallenge {
            target_nonce: [1; 32],
        }),
        Message::AuthResponse(AuthResponse {
            host_nonce: [2; 32],
            host_mac: [3; 32],
        }),
        Message::AuthConfirm(AuthConfirm {
            target_mac: [4; 32],
        }),
        Message::ConnectResponse(ConnectResponse {
            controller_id: 17,
            keep_alive_ms: 5000,
            namespaces: vec![
                NamespaceDescriptor {
                    nsid: 1,
                    size: 1 << 30,
                    block_size: 4096,
                    remote_addr: 0x7f00_0000_0000,
                    rkey: 0xdead_beef,
                    domain: PersistenceDomain::PageCache,
                    durability: DurabilityMethods::APM | DurabilityMethods::GPSPM,
                    atomic_write_unit: 8,
                    read_only: false,
                    failure: None,
                    simulation: None,
                    unavailable: None,
                    identity: 0x5eed_0000_0000_0001,
                },
                NamespaceDescriptor {
                    nsid: 2,
                    size: 1 << 20,
                    block_size: 512,
                    remote_addr: 0x7f00_1000_0000,
                    rkey: 7,
                    domain: PersistenceDomain::Dax,
                    durability: DurabilityMethods::FLUSH,
                    atomic_write_unit: 8,
                    read_only: true,
                    failure: Some("fdatasync failed: Input/output error (os error 5)".into()),
                    simulation: Some(crate::pmem::SIMULATION_LABEL.into()),
                    unavailable: Some("cannot register 1048576 bytes: no ODP".into()),
                    identity: u64::MAX,
                },
            ],
            queue_depth: 128,
            namespace_count: 9,
        }),
        Message::NamespacesRequest(NamespacesRequest { start: 2 }),
        Message::NamespacesResponse(NamespacesResponse {
            namespaces: Vec::new(),
            total: 9,
        }),
        Message::Refusal(Refusal {
            reason: RefusalReason::HostNotAllowed,
            message: "host nqn.x is not allowed".into(),
        }),
        Message::DiscoveryRequest(DiscoveryRequest { start: 300 }),
        Message::DiscoveryResponse(DiscoveryResponse {
            entries: vec![DiscoveryEntry {
                subsystem_nqn: nqn("nqn.2026-11.io.rpma:demo"),
                listen: vec!["tcp://127.0.0.1:7420".into()],
            }],
            total: 301,
            generation: u64::MAX - 5,
        }),
        Message::Disconnect(Disconnect {
            reason: "bye".into(),
        }),
        Message::FlushRequest(FlushRequest {
            nsid: 2,
            offset: 4096,
            length: 1 << 20,
            token: u64::MAX,
        }),
        Message::FlushResponse(FlushResponse {
            token: 42,
            status: FlushStatus::VisibleOnly,
        }),
        Message::KeepAlive(KeepAlive { seq: 5 }),
    ]
}

#[test]
fn every_message_round_trips() {
    for m in samples() {
        let bytes = m.encode().unwrap();
        assert_eq!(bytes[0], PROTO_VERSION);
        assert_eq!(bytes[1], m.message_type() as u8);
        assert_eq!(peek_type(&bytes).unwrap(), m.message_type());
        assert_eq!(Message::decode(&bytes).unwrap(), m);
    }
}

#[test]
fn fixed_layouts_are_exact() {
    let r = FlushRequest {
        nsid: 0x0403_0201,
        offset: 0x1122_3344_5566_7788,
        length: 0x10,
        token: 0xAA,
    };
    let b = r.encode();
    assert_eq!(b.len(), 32);
    assert_eq!(&b[..4], &[7, 0x10, 0, 0]);
    assert_eq!(&b[4..8], &[1, 2, 3, 4]);
    assert_eq!(&b[8..16], &0x1122_3344_5566_7788u64.to_le_bytes());
    assert_eq!(&b[16..24], &0x10u64.to_le_bytes());
    assert_eq!(&b[24..32], &0xAAu64.to_le_bytes());

    let s = FlushResponse {
        token: 0x0102,
        status: FlushStatus::IoError,
    }
    .encode();
    assert_eq!(s, [7, 0x11, 0, 0, 4, 0, 0, 0, 2, 1, 0, 0, 0, 0, 0, 0]);
    let f = FlushResponse {
        token: 1,
        status: FlushStatus::NamespaceFailed,
    }
    .encode();
    assert_eq!(&f[4..8], &[6, 0, 0, 0]);
    assert_eq!(
        FlushResponse::decode(&f).unwrap().status,
        FlushStatus::NamespaceFailed
    );
    assert_eq!(
        KeepAlive { seq: 1 }.encode(),
        [7, 0x12, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    );
}

#[test]
fn unknown_version_is_a_clear_error() {
    let mut b = KeepAlive { seq: 1 }.encode();
    b[0] = PROTO_VERSION + 1;
    let e = Message::decode(&b).unwrap_err();
    assert!(matches!(
        e,
        Error::UnsupportedVersion {
            got,
            supported: PROTO_VERSION
        } if got == PROTO_VERSION + 1
    ));
    assert!(e.to_string().contains(&format!(
        "unsupported control-plane version {}",
        PROTO_VERSION + 1
    )));
}

#[test]
fn a_version_1_connect_response_is_refused_not_misread() {
    // Version 1's ConnectResponse had no queue_depth: read as version 2 its body would be
    // short. The version byte stops it first.
    let mut b = Message::ConnectResponse(ConnectResponse {
        controller_id: 1,
        keep_alive_ms: 5000,
        namespaces: Vec::new(),
        queue_depth: 0,
        namespace_count: 0,
    })
    .encode()
    .unwrap();
    b.pop(); // the queue_depth varint (0 is one byte): what a version 1 target sent
    b[0] = 1;
    assert!(matches!(
        Message::decode(&b),
        Err(Error::UnsupportedVersion {
            got: 1,
            supported: PROTO_VERSION
        })
    ));
    // And this version's header on a version 1 body is a decode error, not a guess.
    b[0] = PROTO_VERSION;
    assert!(matches!(
        Message::decode(&b),
        Err(Error::Body {
            ty: MessageType::ConnectResponse,
            ..
        })
    ));
}

#[test]
fn unknown_type_and_flags_are_errors() {
    let mut b = KeepAlive { seq: 1 }.encode();
    b[1] = 0x7f;
    assert!(matches!(Message::decode(&b), Err(Error::UnknownType(0x7f))));
    let mut b = KeepAlive { seq: 1 }.encode();
    b[2] = 1;
    assert!(matches!(
        Message::decode(&b),
        Err(Error::UnknownFlags(1, MessageType::KeepAlive))
    ));
}

#[test]
fn every_truncation_is_an_error() {
    for m in samples() {
        let bytes = m.encode().unwrap();
        for n in 0..bytes.len() {
            // Some postcard bodies are valid prefixes of themselves only if empty.
            if let Ok(d) = Message::decode(&bytes[..n]) {
                panic!("{n}-byte prefix of {m:?} decoded as {d:?}");
            }
        }
    }
    assert!(matches!(
        FlushRequest::decode(&FlushRequest::default_for_test().encode()[..20]),
        Err(Error::Truncated {
            field: "length",
            ..
        })
    ));
}

impl FlushRequest {
    fn default_for_test() -> Self {
        FlushRequest {
            nsid: 1,
            offset: 0,
            length: 0,
            token: 0,
        }
    }
}

#[test]
fn trailing_bytes_are_errors() {
    for m in samples() {
        let mut bytes = m.encode().unwrap();
        bytes.push(0);
        assert!(
            matches!(Message::decode(&bytes), Err(Error::TrailingBytes { .. })),
            "{m:?}"
        );
    }
}

#[test]
fn wrong_type_for_a_fixed_decoder() {
    let b = KeepAlive { seq: 1 }.encode();
    assert!(matches!(
        FlushRequest::decode(&b),
        Err(Error::InvalidField { field: "type", .. })
    ));
}

#[test]
fn unknown_flush_status_is_an_error() {
    let mut b = FlushResponse {
        token: 1,
        status: FlushStatus::Durable,
    }
    .encode();
    b[4] = 99;
    assert!(matches!(
        Message::decode(&b),
        Err(Error::InvalidField {
            field: "status",
            value: 99,
            ..
        })
    ));
}

#[test]
fn invalid_nqn_in_body_is_an_error() {
    let mut b = samples()[0].encode().unwrap();
    // The host NQN starts after the header and its one-byte length: break "nqn." into "nqX.".
    b[HEADER_LEN + 3] = b'X';
    assert!(matches!(
        Message::decode(&b),
        Err(Error::Body {
            ty: MessageType::Connect,
            ..
        })
    ));
}

#[test]
fn oversize_is_refused_both_ways() {
    let big = Message::DiscoveryResponse(DiscoveryResponse {
        entries: listing(200),
        ..Default::default()
    });
    assert!(matches!(big.encode(), Err(Error::TooLarge { .. })));
    let mut b = vec![0u8; MAX_MESSAGE_SIZE + 1];
    b[..4].copy_from_slice(&[PROTO_VERSION, MessageType::Disconnect as u8, 0, 0]);
    assert!(matches!(Message::decode(&b), Err(Error::TooLarge { .. })));
}

#[test]
fn unknown_refusal_codes_survive() {
    let m = Message::Refusal(Refusal {
        reason: RefusalReason::Other(999),
        message: String::new(),
    });
    let d = Message::decode(&m.encode().unwrap()).unwrap();
    assert_eq!(d, m);
    assert_eq!(RefusalReason::from(3), RefusalReason::AuthFailed);
    assert_eq!(u16::from(RefusalReason::VersionUnsupported), 4);
}

#[test]
fn durability_names() {
    let m = DurabilityMethods::APM | DurabilityMethods::FLUSH;
    assert_eq!(m.names(), ["APM", "FLUSH"]);
    assert!(m.contains(DurabilityMethods::APM));
    assert!(!m.contains(DurabilityMethods::GPSPM));
    assert!(DurabilityMethods::NONE.is_empty());
}

proptest! {
    #[test]
    fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let _ = Message::decode(&bytes);
    }

    #[test]
    fn decoding_arbitrary_bodies_never_panics(ty in 1u8..=0x12, body in proptest::collection::vec(any::<u8>(), 0..300)) {
        let mut b = vec![PROTO_VERSION, ty, 0, 0];
        b.extend_from_slice(&body);
        let _ = Message::decode(&b);
    }

    #[test]
    fn mutated_valid_messages_never_panic(idx in 0usize..12, pos in any::<usize>(), val in any::<u8>()) {
        let mut b = samples()[idx].encode().unwrap();
        let p = pos % b.len();
        b[p] = val;
        let _ = Message::decode(&b);
    }
}

/// A descriptor with a failure and an unavailability text `text` long.
fn failed_descriptor(nsid: u32, text: &str) -> NamespaceDescriptor {
    NamespaceDescriptor {
        nsid,
        size: 1 << 30,
        block_size: 4096,
        remote_addr: 0x7f00_0000_0000,
        rkey: 9,
        domain: PersistenceDomain::PageCache,
        durability: DurabilityMethods::GPSPM,
        atomic_write_unit: 8,
        read_only: false,
        failure: Some(text.to_owned()),
        simulation: None,
        unavailable: Some(text.to_owned()),
        identity: 3,
    }
}

fn response_of(namespaces: Vec<NamespaceDescriptor>) -> ConnectResponse {
    ConnectResponse {
        controller_id: 1,
        keep_alive_ms: 5000,
        namespaces,
        queue_depth: 128,
        namespace_count: 0,
    }
}

#[test]
fn a_connect_response_that_fits_is_left_as_it_is_but_for_its_count() {
    // Texts longer than a page's cut, on namespaces that all fit: kept whole.
    let text = "x".repeat(1000);
    let mut r = response_of((1..=3).map(|n| failed_descriptor(n, &text)).collect());
    let before = r.clone();
    assert_eq!(r.paged(), None);
    assert_eq!(r.namespace_count, 3);
    assert_eq!(r.namespaces, before.namespaces);
    assert!(Message::ConnectResponse(r).encode().is_ok());
}

/// Long failure texts (a path and an errno each) are cut to 256 bytes, each still there; the
/// namespaces that do not fit in the ConnectResponse beside the others come in pages, each
/// page a message, together the whole listing.
#[test]
fn long_texts_are_cut_and_namespaces_past_one_message_come_in_pages() {
    // "é" is two bytes: cuts land on character boundaries.
    let long = "é".repeat(3000);
    let cut = |r: &[NamespaceDescriptor]| {
        for d in r {
            for t in [&d.failure, &d.unavailable] {
                let t = t.as_deref().expect("still failed and unavailable");
                assert!(t.len() <= 256 && t.ends_with("..."), "{t}");
                assert!(t.starts_with("éé"), "{t}");
            }
        }
    };
    let mut r = response_of((1..=4).map(|n| failed_descriptor(n, &long)).collect());
    assert!(matches!(
        Message::ConnectResponse(r.clone()).encode(),
        Err(Error::TooLarge { .. })
    ));
    assert_eq!(r.paged(), None);
    cut(&r.namespaces);
    assert_eq!((r.namespaces.len(), r.namespace_count), (4, 4));
    let bytes = Message::ConnectResponse(r.clone()).encode().unwrap();
    assert_eq!(
        Message::decode(&bytes).unwrap(),
        Message::ConnectResponse(r)
    );

    // 150 of them: the first that fit, then pages.
    let mut r = response_of((1..=150).map(|n| failed_descriptor(n, &long)).collect());
    // The largest values the other fields take.
    (r.controller_id, r.keep_alive_ms, r.queue_depth) = (u16::MAX, u32::MAX, u32::MAX);
    let all = r.paged().expect("not all fit");
    assert_eq!((all.len(), r.namespace_count), (150, 150));
    cut(&all);
    let n = r.namespaces.len();
    assert!(n > 0 && n < 150, "{n}");
    assert_eq!(r.namespaces[..], all[..n]);
    assert!(Message::ConnectResponse(r).encode().is_ok());
    let mut got = all[..n].to_vec();
    while got.len() < all.len() {
        let page = NamespacesResponse::page(&all, got.len() as u32);
        assert_eq!(page.total, 150);
        assert!(!page.namespaces.is_empty());
        let bytes = Message::NamespacesResponse(page.clone()).encode().unwrap();
        assert_eq!(
            Message::decode(&bytes).unwrap(),
            Message::NamespacesResponse(page.clone())
        );
        got.extend(page.namespaces);
    }
    assert_eq!(got, all);
    // Past the end: empty, with the total.
    let end = NamespacesResponse::page(&all, u32::MAX);
    assert_eq!((end.namespaces.len(), end.total), (0, 150));
}

/// `n` discovery entries with NQNs of growing length.
fn listing(n: usize) -> Vec<DiscoveryEntry> {
    (0..n)
        .map(|i| DiscoveryEntry {
            subsystem_nqn: nqn(&format!("nqn.2026-11.io.rpma:subsystem-number-{i}")),
            listen: vec!["tcp://127.0.0.1:7420".into()],
        })
        .collect()
}

#[test]
fn a_discovery_listing_is_paged_into_messages_that_fit() {
    let all = listing(1000);
    // The largest total and generation a page can carry: every page still fits.
    let (mut got, mut start) = (Vec::new(), 0u32);
    while (start as usize) < all.len() {
        let mut page = DiscoveryResponse::page(&all, start, u64::MAX).unwrap();
        assert_eq!(page.total, 1000);
        page.total = u32::MAX;
        let n = page.entries.len();
        assert!(n > 0);
        let bytes = Message::DiscoveryResponse(page.clone()).encode().unwrap();
        assert!(bytes.len() <= MAX_MESSAGE_SIZE);
        // Full: one more entry would not have fitted in the room a page keeps.
        if (start as usize) + n < all.len() {
            let mut more = page.clone();
            more.entries.push(all[start as usize + n].clone());
            let len = Message::DiscoveryResponse(more)
                .encode()
                .map_or(usize::MAX, |b| b.len());
            assert!(len > MAX_MESSAGE_SIZE - 20, "{len}");
        }
        got.extend(page.entries);
        start += n as u32;
    }
    assert_eq!(got, all);
    // At and past the end: empty pages that still say the total.
    for start in [1000, 1001, u32::MAX] {
        let p = DiscoveryResponse::page(&all, start, 7).unwrap();
        assert_eq!((p.entries.len(), p.total, p.generation), (0, 1000, 7));
    }
    // An entry longer than a message: no page can hold it.
    let mut long = listing(3);
    long[1].listen = (0..600).map(|i| format!("tcp://127.0.0.1:{i}")).collect();
    assert!(DiscoveryResponse::page(&long, 0, 0).unwrap().entries.len() == 1);
    assert_eq!(DiscoveryResponse::page(&long, 1, 0), None);
    // The generation follows the listing.
    let g = DiscoveryResponse::generation_of(&all);
    assert_eq!(g, DiscoveryResponse::generation_of(&listing(1000)));
    assert_ne!(g, DiscoveryResponse::generation_of(&all[..999]));
    assert_ne!(g, DiscoveryResponse::generation_of(&long));
}
