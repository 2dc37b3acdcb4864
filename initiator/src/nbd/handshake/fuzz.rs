//! The option haggling under arbitrary client bytes (fuzz target `nbd_handshake`).

use std::io;
use std::time::Duration;

use rpma_common::fuzz::Pipe;

use super::{negotiate, ClientStream, ExportInfo, Outcome};
use crate::nbd::proto::{
    self, BlockSizes, Cursor, FLAG_C_FIXED_NEWSTYLE, FLAG_C_NO_ZEROES, IHAVEOPT, INFO_BLOCK_SIZE,
    INFO_DESCRIPTION, INFO_EXPORT, INFO_NAME, OPT_ABORT, OPT_EXPORT_NAME, OPT_GO, OPT_INFO,
    OPT_LIST, OPT_REPLY_MAGIC, REP_ACK, REP_ERR_INVALID, REP_ERR_UNKNOWN, REP_ERR_UNSUP, REP_INFO,
    REP_SERVER, TF_HAS_FLAGS, TF_SEND_FLUSH, TF_SEND_FUA,
};

/// The export the fuzzed server offers.
fn export() -> ExportInfo {
    ExportInfo {
        name: "disk".into(),
        description: "fuzz".into(),
        size: 1 << 20,
        flags: TF_HAS_FLAGS | TF_SEND_FLUSH | TF_SEND_FUA,
        sizes: BlockSizes::for_block(512, crate::nbd::MAX_PAYLOAD),
    }
}

/// Runs the server's handshake on `data` as everything the client sends (then EOF) and checks
/// what the server wrote: the greeting, then only well-formed option replies (known reply and
/// information types, the export's true size), ending as the outcome says: an ACK to GO or
/// ABORT, or the export fields after EXPORT_NAME, with or without the zeroes as the client
/// asked.
pub fn handshake(data: &[u8]) {
    let mut s = Pipe::new(data);
    let ex = export();
    let outcome = negotiate(&mut s, &ex, Duration::from_secs(60));
    let out = s.out;
    assert_eq!(out[..18], proto::greeting(), "no greeting first");
    let fields = proto::export_fields(ex.size, ex.flags);
    let mut rest = &out[18..];
    let mut last = None;
    // The export fields start with the size, never with the reply magic.
    while rest.first_chunk::<8>() == Some(&OPT_REPLY_MAGIC.to_be_bytes()) {
        let mut c = Cursor::new(rest);
        c.u64("magic").unwrap();
        let option = c.u32("option").expect("a whole reply header");
        let ty = c.u32("reply type").expect("a whole reply header");
        let len = c.u32("reply length").expect("a whole reply header") as usize;
        let body = c.bytes(len, "reply data").expect("the reply's data");
        assert!(
            matches!(
                ty,
                REP_ACK | REP_SERVER | REP_INFO | REP_ERR_UNSUP | REP_ERR_INVALID | REP_ERR_UNKNOWN
            ),
            "reply type {ty:#x}"
        );
        if ty == REP_INFO {
            assert!(matches!(option, OPT_INFO | OPT_GO));
            let info = u16::from_be_bytes([body[0], body[1]]);
            assert!(matches!(
                info,
                INFO_EXPORT | INFO_NAME | INFO_DESCRIPTION | INFO_BLOCK_SIZE
            ));
            if info == INFO_EXPORT {
                assert_eq!(body[2..], fields, "the export's size and flags");
            }
        }
        if ty == REP_SERVER {
            assert_eq!(option, OPT_LIST);
        }
        last = Some((option, ty));
        rest = &rest[rest.len() - c.remaining()..];
    }
    match outcome {
        Ok(Outcome::Aborted) => assert_eq!((last, rest.len()), (Some((OPT_ABORT, REP_ACK)), 0)),
        // Only a client that sent nothing is a probe.
        Ok(Outcome::Probe) => assert!(data.is_empty() && last.is_none()),
        Ok(Outcome::Transmission { .. }) if rest.is_empty() => {
            assert_eq!(last, Some((OPT_GO, REP_ACK)));
        }
        Ok(Outcome::Transmission { strict }) => {
            // NBD_OPT_EXPORT_NAME: the fields, then 124 zeroes unless the client said not to.
            let no_zeroes = u32::from_be_bytes(*data.first_chunk().unwrap()) & FLAG_C_NO_ZEROES;
            assert!(!strict);
            assert_eq!(rest[..10], fields);
            assert_eq!(rest.len(), if no_zeroes != 0 { 10 } else { 134 });
            assert!(rest[10..].iter().all(|&b| b == 0));
        }
        Err(e) => {
            let _ = e.to_string();
            assert!(
                rest.is_empty(),
                "{} stray bytes after the replies",
                rest.len()
            );
        }
    }
}

/// Seeds: real client conversations.
pub(crate) fn seeds() -> Vec<Vec<u8>> {
    let opt = |o: u32, d: &[u8]| {
        let mut v = IHAVEOPT.to_be_bytes().to_vec();
        v.extend_from_slice(&o.to_be_bytes());
        v.extend_from_slice(&(d.len() as u32).to_be_bytes());
        v.extend_from_slice(d);
        v
    };
    let go = |name: &str, reqs: &[u16]| {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(reqs.len() as u16).to_be_bytes());
        for r in reqs {
            d.extend_from_slice(&r.to_be_bytes());
        }
        d
    };
    let flags = |f: u32| f.to_be_bytes().to_vec();
    let both = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;
    let conv = |f: u32, opts: &[Vec<u8>]| {
        let mut v = flags(f);
        for o in opts {
            v.extend_from_slice(o);
        }
        v
    };
    vec![
        // qemu / nbdinfo: GO with the block sizes.
        conv(
            both,
            &[opt(OPT_GO, &go("disk", &[INFO_BLOCK_SIZE, INFO_NAME]))],
        ),
        // nbd-client: LIST, INFO, then EXPORT_NAME.
        conv(
            FLAG_C_FIXED_NEWSTYLE,
            &[
                opt(OPT_LIST, &[]),
                opt(OPT_INFO, &go("", &[INFO_DESCRIPTION])),
                opt(OPT_EXPORT_NAME, b"disk"),
            ],
        ),
        conv(both, &[opt(OPT_EXPORT_NAME, b"")]),
        conv(
            both,
            &[
                opt(8, &[]),
                opt(OPT_GO, &go("nope", &[])),
                opt(OPT_ABORT, &[]),
            ],
        ),
        conv(both, &[opt(OPT_GO, &[0, 0, 0, 9])]),
        conv(both, &[opt(OPT_LIST, b"x")]),
        conv(4, &[]),
    ]
}

// The in-memory stream of rpma-common's fuzz entries, with no time-out to set.
impl ClientStream for Pipe<'_> {
    fn set_read_timeout(&mut self, _: Option<Duration>) -> io::Result<()> {
        Ok(())
    }

    fn set_write_timeout(&mut self, _: Option<Duration>) -> io::Result<()> {
        Ok(())
    }
}
