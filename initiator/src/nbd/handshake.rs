//! Option haggling of the fixed newstyle handshake, up to the transmission phase.

use std::io::{ErrorKind, Read, Write};
use std::time::{Duration, Instant};

use super::proto::{
    self, greeting, option_reply, BlockSizes, InfoRequest, OptionHeader, FLAG_C_FIXED_NEWSTYLE,
    FLAG_C_NO_ZEROES, INFO_BLOCK_SIZE, INFO_DESCRIPTION, INFO_EXPORT, INFO_NAME, OPTION_LEN,
    OPT_ABORT, OPT_EXPORT_NAME, OPT_GO, OPT_INFO, OPT_LIST, REP_ACK, REP_ERR_INVALID,
    REP_ERR_UNKNOWN, REP_ERR_UNSUP, REP_INFO, REP_SERVER,
};
use super::ratelog::Escaped;
use super::stream::Stream;
use super::ConnError;

/// Option data larger than this ends the connection (a name is at most 4096 bytes).
const MAX_OPTION_DATA: u32 = 16 << 10;
/// Options one connection may send before it must choose an export.
const MAX_OPTIONS: usize = 128;

/// What the handshake tells clients about the export.
#[derive(Debug, Clone)]
pub(crate) struct ExportInfo {
    /// The export's name (the empty name selects it too: the default export).
    pub(crate) name: String,
    /// One line for humans (NBD_OPT_LIST, NBD_INFO_DESCRIPTION).
    pub(crate) description: String,
    /// Bytes.
    pub(crate) size: u64,
    /// Transmission flags.
    pub(crate) flags: u16,
    /// Block size constraints.
    pub(crate) sizes: BlockSizes,
}

impl ExportInfo {
    fn matches(&self, name: &str) -> bool {
        name.is_empty() || name == self.name
    }
}

/// What the handshake needs of a client's stream: bytes both ways and a read time-out (a
/// socket; an in-memory pipe in the fuzz tests).
pub(crate) trait ClientStream: Read + Write {
    /// As `UnixStream::set_read_timeout`.
    fn set_read_timeout(&mut self, t: Option<Duration>) -> std::io::Result<()>;
    /// As `UnixStream::set_write_timeout`.
    fn set_write_timeout(&mut self, t: Option<Duration>) -> std::io::Result<()>;
}

impl ClientStream for Stream {
    fn set_read_timeout(&mut self, t: Option<Duration>) -> std::io::Result<()> {
        Stream::set_read_timeout(self, t)
    }

    fn set_write_timeout(&mut self, t: Option<Duration>) -> std::io::Result<()> {
        Stream::set_write_timeout(self, t)
    }
}

/// How the handshake ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// In the transmission phase; `strict`: the client asked for the block sizes, so
    /// requests not aligned to the minimum are refused (EINVAL). A client that was not told
    /// gets byte granularity (the protocol's default minimum of 1).
    Transmission { strict: bool },
    /// The client aborted.
    Aborted,
    /// The client closed before sending a byte (its greeting may not even have been
    /// delivered): a TCP port probe or health check, not a failed handshake.
    Probe,
}

/// Greets the client and answers its options until it enters the transmission phase, which
/// must happen `within` that time (a client that dribbles its handshake holds a connection
/// slot no longer).
///
/// # Errors
/// [`ConnError`]: a socket error, the deadline, a bad magic, unknown client flags, an unknown
/// export in `NBD_OPT_EXPORT_NAME` (which cannot return an error), oversized option data.
pub(crate) fn negotiate<S: ClientStream>(
    s: &mut S,
    ex: &ExportInfo,
    within: Duration,
) -> Result<Outcome, ConnError> {
    let deadline = Instant::now() + within;
    let gone = |e: &std::io::Error| {
        matches!(
            e.kind(),
            ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::UnexpectedEof
        )
    };
    let mut f = [0u8; 4];
    // A peer gone before its first byte (the greeting refused, or its flags never begun).
    match s.write_all(&greeting()) {
        Err(e) if gone(&e) => return Ok(Outcome::Probe),
        r => r?,
    }
    match read_by(s, &mut f[..1], deadline, within) {
        Err(ConnError::Io(e)) if gone(&e) => return Ok(Outcome::Probe),
        r => r?,
    }
    read_by(s, &mut f[1..], deadline, within)?;
    let client = u32::from_be_bytes(f);
    if client & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(ConnError::Protocol(format!(
            "unknown client flags {client:#x}"
        )));
    }
    let no_zeroes = client & FLAG_C_NO_ZEROES != 0;
    let mut out = Vec::new();
    for _ in 0..MAX_OPTIONS {
        let mut h = [0u8; OPTION_LEN];
        read_by(s, &mut h, deadline, within)?;
        let h = OptionHeader::parse(&h)?;
        if h.len > MAX_OPTION_DATA {
            return Err(ConnError::Protocol(format!(
                "{} with {} bytes of data (at most {MAX_OPTION_DATA})",
                proto::option_name(h.option),
                h.len
            )));
        }
        let mut data = vec![0u8; h.len as usize];
        read_by(s, &mut data, deadline, within)?;
        out.clear();
        let done = answer(h.option, &data, ex, no_zeroes, &mut out)?;
        write_by(s, &out, deadline, within)?;
        if let Some(o) = done {
            return Ok(o);
        }
    }
    Err(ConnError::Protocol(format!(
        "{MAX_OPTIONS} options without choosing an export"
    )))
}

/// Writes `buf` before `deadline` (a client that does not read its option replies is closed
/// at the handshake's deadline, as one that does not send).
fn write_by<S: ClientStream>(
    s: &mut S,
    buf: &[u8],
    deadline: Instant,
    within: Duration,
) -> Result<(), ConnError> {
    let left = deadline.saturating_duration_since(Instant::now());
    let late = || ConnError::Protocol(format!("the handshake did not finish within {within:?}"));
    if left.is_zero() {
        return Err(late());
    }
    s.set_write_timeout(Some(left))?;
    match s.write_all(buf) {
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Err(late()),
        r => Ok(r?),
    }
}

/// Fills `buf` before `deadline`.
fn read_by<S: ClientStream>(
    s: &mut S,
    buf: &mut [u8],
    deadline: Instant,
    within: Duration,
) -> Result<(), ConnError> {
    let late = || ConnError::Protocol(format!("the handshake did not finish within {within:?}"));
    let mut at = 0;
    while at < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(late());
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[at..]) {
            Ok(0) => return Err(std::io::Error::from(ErrorKind::UnexpectedEof).into()),
            Ok(n) => at += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(late())
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The reply to one option, into `out`; Some when the handshake is over.
fn answer(
    option: u32,
    data: &[u8],
    ex: &ExportInfo,
    no_zeroes: bool,
    out: &mut Vec<u8>,
) -> Result<Option<Outcome>, ConnError> {
    let err =
        |out: &mut Vec<u8>, code, msg: String| option_reply(out, option, code, msg.as_bytes());
    match option {
        OPT_EXPORT_NAME => {
            let name = std::str::from_utf8(data)
                .map_err(|_| ConnError::Protocol("export name is not UTF-8".into()))?;
            if !ex.matches(name) {
                // This option has no error reply: the protocol says to close.
                return Err(ConnError::Protocol(format!(
                    "no export named {}",
                    Escaped(name)
                )));
            }
            out.extend_from_slice(&proto::export_fields(ex.size, ex.flags));
            if !no_zeroes {
                out.extend_from_slice(&[0u8; 124]);
            }
            Ok(Some(Outcome::Transmission { strict: false }))
        }
        OPT_ABORT => {
            option_reply(out, option, REP_ACK, &[]);
            Ok(Some(Outcome::Aborted))
        }
        OPT_LIST if !data.is_empty() => {
            err(out, REP_ERR_INVALID, "NBD_OPT_LIST takes no data".into());
            Ok(None)
        }
        OPT_LIST => {
            let mut d = (ex.name.len() as u32).to_be_bytes().to_vec();
            d.extend_from_slice(ex.name.as_bytes());
            d.extend_from_slice(ex.description.as_bytes());
            option_reply(out, option, REP_SERVER, &d);
            option_reply(out, option, REP_ACK, &[]);
            Ok(None)
        }
        OPT_INFO | OPT_GO => {
            let req = match InfoRequest::parse(data) {
                Ok(r) => r,
                Err(e) => {
                    err(out, REP_ERR_INVALID, e.to_string());
                    return Ok(None);
                }
            };
            if !ex.matches(&req.name) {
                // The name cut to 64 characters (it may be 16 KiB, and escaping grows it).
                let name: String = req.name.chars().take(64).collect();
                err(out, REP_ERR_UNKNOWN, format!("no export named {name:?}"));
                return Ok(None);
            }
            let mut info = INFO_EXPORT.to_be_bytes().to_vec();
            info.extend_from_slice(&proto::export_fields(ex.size, ex.flags));
            option_reply(out, option, REP_INFO, &info);
            // Each kind known is answered once, however often it is asked for (a list of
            // every request seen, searched for each, was quadratic: 0.2 s of CPU for a
            // connection's 128 options of 16 KiB).
            let mut sent = Vec::new();
            for r in &req.requests {
                if !matches!(*r, INFO_NAME | INFO_DESCRIPTION | INFO_BLOCK_SIZE) || sent.contains(r)
                {
                    continue;
                }
                sent.push(*r);
                let (ty, text) = match *r {
                    INFO_NAME => (INFO_NAME, ex.name.as_str()),
                    INFO_DESCRIPTION => (INFO_DESCRIPTION, ex.description.as_str()),
                    INFO_BLOCK_SIZE => {
                        option_reply(out, option, REP_INFO, &ex.sizes.info());
                        continue;
                    }
                    _ => continue,
                };
                let mut d = ty.to_be_bytes().to_vec();
                d.extend_from_slice(text.as_bytes());
                option_reply(out, option, REP_INFO, &d);
            }
            option_reply(out, option, REP_ACK, &[]);
            Ok((option == OPT_GO).then_some(Outcome::Transmission {
                strict: req.requests.contains(&INFO_BLOCK_SIZE),
            }))
        }
        _ => {
            err(
                out,
                REP_ERR_UNSUP,
                format!("{} ({option}) is not supported", proto::option_name(option)),
            );
            Ok(None)
        }
    }
}

#[cfg(feature = "fuzzing")]
pub(crate) mod fuzz;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nbd::proto::{Cursor, IHAVEOPT, OPT_REPLY_MAGIC, TF_HAS_FLAGS};

    fn export() -> ExportInfo {
        ExportInfo {
            name: "disk".into(),
            description: "test".into(),
            size: 1 << 20,
            flags: TF_HAS_FLAGS,
            sizes: BlockSizes::for_block(512, 1 << 20),
        }
    }

    /// (option, reply type, data) of each option reply in `b`.
    fn replies(b: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
        let mut c = Cursor::new(b);
        let mut v = Vec::new();
        while c.remaining() > 0 {
            assert_eq!(c.u64("magic").unwrap(), OPT_REPLY_MAGIC);
            let o = c.u32("o").unwrap();
            let t = c.u32("t").unwrap();
            let n = c.u32("n").unwrap() as usize;
            v.push((o, t, c.bytes(n, "d").unwrap().to_vec()));
        }
        v
    }

    fn go(name: &str, reqs: &[u16]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(reqs.len() as u16).to_be_bytes());
        for r in reqs {
            d.extend_from_slice(&r.to_be_bytes());
        }
        d
    }

    #[test]
    fn go_answers_export_block_sizes_and_ack() {
        let mut out = Vec::new();
        let o = answer(
            OPT_GO,
            &go("", &[INFO_BLOCK_SIZE, INFO_BLOCK_SIZE]),
            &export(),
            true,
            &mut out,
        )
        .unwrap();
        assert_eq!(o, Some(Outcome::Transmission { strict: true }));
        let r = replies(&out);
        assert_eq!(r.len(), 3, "{r:?}");
        assert_eq!(r[0].1, REP_INFO);
        assert_eq!(r[0].2[..2], [0, 0]);
        assert_eq!(r[0].2[2..10], (1u64 << 20).to_be_bytes());
        assert_eq!(r[1].2, export().sizes.info());
        assert_eq!(r[2].1, REP_ACK);
        // INFO: the same answers, and the handshake goes on.
        out.clear();
        let o = answer(
            OPT_INFO,
            &go("disk", &[INFO_NAME]),
            &export(),
            true,
            &mut out,
        )
        .unwrap();
        assert_eq!(o, None);
        let r = replies(&out);
        assert_eq!(r[1].2[2..], *b"disk");
        // Not telling the block sizes: no alignment is enforced.
        out.clear();
        let o = answer(OPT_GO, &go("disk", &[]), &export(), true, &mut out).unwrap();
        assert_eq!(o, Some(Outcome::Transmission { strict: false }));
    }

    #[test]
    fn errors_unknown_exports_and_unknown_options() {
        let mut out = Vec::new();
        assert_eq!(
            answer(OPT_GO, &go("nope", &[]), &export(), true, &mut out).unwrap(),
            None
        );
        assert_eq!(replies(&out)[0].1, REP_ERR_UNKNOWN);
        out.clear();
        assert_eq!(
            answer(OPT_GO, &[0, 0, 0, 9], &export(), true, &mut out).unwrap(),
            None
        );
        assert_eq!(replies(&out)[0].1, REP_ERR_INVALID);
        out.clear();
        assert_eq!(answer(8, &[], &export(), true, &mut out).unwrap(), None);
        let r = replies(&out);
        assert_eq!((r[0].0, r[0].1), (8, REP_ERR_UNSUP));
        out.clear();
        assert_eq!(
            answer(OPT_LIST, &[1], &export(), true, &mut out).unwrap(),
            None
        );
        assert_eq!(replies(&out)[0].1, REP_ERR_INVALID);
        out.clear();
        answer(OPT_LIST, &[], &export(), true, &mut out).unwrap();
        let r = replies(&out);
        assert_eq!(r[0].1, REP_SERVER);
        assert_eq!(r[0].2[..8], [0, 0, 0, 4, b'd', b'i', b's', b'k']);
        assert_eq!(r[1].1, REP_ACK);
        assert!(answer(OPT_EXPORT_NAME, b"nope", &export(), true, &mut out).is_err());
    }

    /// The error for an unknown export names it cut to 64 characters: a name of up to 16 KiB,
    /// escaped into up to 5 times its size, made each reply as large (a client that did not
    /// read them filled its socket with them). And a GO asking for thousands of information
    /// kinds, known or not, over and over, gets each known one once.
    #[test]
    fn replies_stay_small_whatever_the_option_asks() {
        let mut out = Vec::new();
        let name = "\u{1}".repeat(4000);
        answer(OPT_GO, &go(&name, &[]), &export(), true, &mut out).unwrap();
        let r = replies(&out);
        assert_eq!(r[0].1, REP_ERR_UNKNOWN);
        assert!(r[0].2.len() < 64 * 6 + 32, "{} bytes", r[0].2.len());
        out.clear();
        let mut reqs: Vec<u16> = (0..4000).map(|i| 7 + (i % 4000) as u16).collect();
        reqs.extend([INFO_NAME, INFO_BLOCK_SIZE].repeat(1000));
        let o = answer(OPT_GO, &go("disk", &reqs), &export(), true, &mut out).unwrap();
        assert_eq!(o, Some(Outcome::Transmission { strict: true }));
        // The export's own, the name, the block sizes, the ACK.
        assert_eq!(replies(&out).len(), 4);
    }

    #[test]
    fn export_name_ends_with_or_without_zeroes() {
        for (nz, len) in [(true, 10), (false, 134)] {
            let mut out = Vec::new();
            let o = answer(OPT_EXPORT_NAME, b"disk", &export(), nz, &mut out).unwrap();
            assert_eq!(o, Some(Outcome::Transmission { strict: false }));
            assert_eq!(out.len(), len);
        }
    }

    #[test]
    fn negotiate_over_a_socket_pair() {
        let pair = || {
            let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
            (a, Stream::Unix(b))
        };
        let within = Duration::from_secs(10);
        let (mut a, mut b) = pair();
        let t = std::thread::spawn(move || negotiate(&mut b, &export(), within));
        let mut g = [0u8; 18];
        a.read_exact(&mut g).unwrap();
        a.write_all(&3u32.to_be_bytes()).unwrap();
        let mut o = IHAVEOPT.to_be_bytes().to_vec();
        o.extend_from_slice(&OPT_ABORT.to_be_bytes());
        o.extend_from_slice(&0u32.to_be_bytes());
        a.write_all(&o).unwrap();
        assert_eq!(t.join().unwrap().unwrap(), Outcome::Aborted);
        // Unknown client flags: the connection is dropped.
        let (mut a, mut b) = pair();
        let t = std::thread::spawn(move || negotiate(&mut b, &export(), within));
        a.read_exact(&mut g).unwrap();
        a.write_all(&4u32.to_be_bytes()).unwrap();
        assert!(matches!(t.join().unwrap(), Err(ConnError::Protocol(_))));
        // A client gone before its first byte (a port probe), whether or not the greeting
        // reached it: no failed handshake.
        let (a, mut b) = pair();
        drop(a);
        assert_eq!(
            negotiate(&mut b, &export(), within).unwrap(),
            Outcome::Probe
        );
        let (mut a, mut b) = pair();
        let t = std::thread::spawn(move || negotiate(&mut b, &export(), within));
        a.read_exact(&mut g).unwrap();
        drop(a);
        assert_eq!(t.join().unwrap().unwrap(), Outcome::Probe);
        // One that closes within its flags broke the handshake.
        let (mut a, mut b) = pair();
        let t = std::thread::spawn(move || negotiate(&mut b, &export(), within));
        a.read_exact(&mut g).unwrap();
        a.write_all(&[0, 0]).unwrap();
        drop(a);
        let r = t.join().unwrap();
        assert!(matches!(&r, Err(ConnError::Io(_))), "{r:?}");
        // A client that dribbles (its flags, then an option of 1,000 bytes, a byte every 40 ms:
        // every read gets a byte well within 300 ms, the handshake would take 40 s): the whole
        // handshake has a deadline, not each read. The server gives up while bytes still come;
        // a write after that may find it gone.
        let (mut a, mut b) = pair();
        let t =
            std::thread::spawn(move || negotiate(&mut b, &export(), Duration::from_millis(300)));
        a.read_exact(&mut g).unwrap();
        let mut dribble = 3u32.to_be_bytes().to_vec();
        dribble.extend_from_slice(&IHAVEOPT.to_be_bytes());
        dribble.extend_from_slice(&OPT_GO.to_be_bytes());
        dribble.extend_from_slice(&1000u32.to_be_bytes());
        dribble.resize(dribble.len() + 1000, 0);
        for byte in dribble {
            if t.is_finished() {
                break;
            }
            let _ = a.write_all(&[byte]);
            std::thread::sleep(Duration::from_millis(40));
        }
        assert!(
            t.is_finished(),
            "the dribbler outlasted the handshake's deadline"
        );
        let r = t.join().unwrap();
        assert!(
            matches!(&r, Err(ConnError::Protocol(m)) if m.contains("within")),
            "{r:?}"
        );
    }
}
