//! The data-path subcommands: list, read, write, verify, flush, cas, faa (and bench in its own
//! module). Each opens one queue, checks the whole request against the namespace before it
//! touches anything, does its work in pieces of [`PIECE`] bytes (so a progress bar can move
//! and memory stays bounded), and disconnects; on an error path dropping the queue sends the
//! Disconnect.

mod args;
pub(crate) mod bench;
pub(crate) mod control;
mod failure;
pub(crate) mod fio;
mod json;
pub(crate) mod nbd;
mod progress;

use std::io::{IsTerminal, Write as _};
use std::os::unix::fs::FileExt as _;
use std::path::Path;

use rpma_initiator::namespace::check_range;
use rpma_initiator::{Choice, Durability, Queue};
use serde::Serialize;

pub(crate) use args::{Cli, Command, Global, JobArgs, Source};
pub(crate) use failure::{usage, Failure};
pub(crate) use json::print_json;
use json::NamespaceJson;
use progress::Progress;

/// Bytes moved per library call.
const PIECE: u64 = 4 << 20;

fn failure(code: u8, msg: String) -> Failure {
    Failure {
        code,
        err: anyhow::anyhow!(msg),
    }
}

pub(crate) fn io_failure(what: String, e: std::io::Error) -> Failure {
    Failure {
        code: 1,
        err: anyhow::Error::new(e).context(what),
    }
}

fn open(g: &Global, depth: usize) -> Result<Queue, Failure> {
    Ok(g.connection(depth)?.open_queue(0)?)
}

fn close(q: Queue) {
    let _ = q.close();
}

/// The exit code of a durable request that got only "visible" (a volatile namespace): a
/// script that checks `$?` must not take it for durable.
pub(crate) const EXIT_NOT_DURABLE: u8 = 7;

/// The state and method of an outcome (JSON), and a warning on stderr when it is not durable.
fn outcome(g: &Global, d: Durability) -> (&'static str, Option<String>) {
    match d {
        Durability::Durable(m) => ("durable", Some(m.to_string())),
        Durability::VisibleOnly => {
            if g.visible_ok {
                eprintln!(
                    "rpma-initiator: warning: namespace {} is volatile: the bytes are visible, NOT durable",
                    g.nsid
                );
            }
            ("visible-only", None)
        }
    }
}

/// After the outcome was printed: exit 7 for "visible only" unless `--visible-ok`.
pub(crate) fn require_durable(g: &Global, d: Durability) -> Result<(), Failure> {
    if d == Durability::VisibleOnly && !g.visible_ok {
        return Err(failure(
            EXIT_NOT_DURABLE,
            format!(
                "namespace {} is volatile: the bytes are visible, NOT durable (--visible-ok \
                 accepts that)",
                g.nsid
            ),
        ));
    }
    Ok(())
}

/// An outcome in words, with the namespace's domain as shown (its label): "durable (FLUSH, dax
/// (forced))".
fn describe(d: Durability, domain: &str) -> String {
    match d {
        Durability::Durable(m) => format!("durable ({m}, {domain})"),
        Durability::VisibleOnly => format!("visible only ({domain}): NOT durable"),
    }
}

/// The bytes of `--in FILE` (read piece by piece), or `--pattern B --length L`.
enum Bytes {
    File(std::fs::File, u64, std::path::PathBuf),
    Pattern(u8, u64),
}

impl Bytes {
    fn of(source: &Source, length: Option<u64>) -> Result<Bytes, Failure> {
        match (&source.input, source.pattern) {
            (Some(path), None) => {
                if length.is_some() {
                    return Err(usage("--length goes with --pattern, not --in".into()));
                }
                use std::io::{Seek, SeekFrom};
                use std::os::unix::fs::FileTypeExt;
                let failed = |e| io_failure(format!("reading {}", path.display()), e);
                let mut f = std::fs::File::open(path).map_err(failed)?;
                let kind = f.metadata().map_err(failed)?.file_type();
                // The length first, so that the whole range is checked before anything is
                // written: a regular file's, or a block device's (its end). A pipe, FIFO or
                // character device has none (its metadata said 0: it wrote 0 bytes and
                // succeeded).
                let len = if kind.is_file() {
                    f.metadata().map_err(failed)?.len()
                } else if kind.is_block_device() {
                    let len = f.seek(SeekFrom::End(0)).map_err(failed)?;
                    f.seek(SeekFrom::Start(0)).map_err(failed)?;
                    len
                } else {
                    return Err(usage(format!(
                        "--in {}: not a regular file or a block device (a pipe or a FIFO has \
                         no length to check against the namespace before writing); write it to \
                         a file first",
                        path.display()
                    )));
                };
                Ok(Bytes::File(f, len, path.clone()))
            }
            (None, Some(b)) => Ok(Bytes::Pattern(
                b,
                length.ok_or_else(|| usage("--pattern needs --length".into()))?,
            )),
            _ => Err(usage("give one of --in FILE or --pattern BYTE".into())),
        }
    }

    fn len(&self) -> u64 {
        match self {
            Bytes::File(_, n, _) => *n,
            Bytes::Pattern(_, n) => *n,
        }
    }

    /// The bytes of `[at, at + n)` into `out` (resized).
    fn piece(&self, at: u64, n: usize, out: &mut Vec<u8>) -> Result<(), Failure> {
        out.clear();
        match self {
            Bytes::File(f, _, path) => {
                out.resize(n, 0);
                f.read_exact_at(out, at)
                    .map_err(|e| io_failure(format!("reading {}", path.display()), e))
            }
            Bytes::Pattern(b, _) => {
                out.resize(n, *b);
                Ok(())
            }
        }
    }
}

pub(crate) fn list(g: &Global) -> Result<(), Failure> {
    let mut q = open(g, 1)?;
    #[derive(Serialize)]
    struct Ns {
        #[serde(flatten)]
        ns: NamespaceJson,
        method: Option<String>,
        method_error: Option<String>,
    }
    let mut rows = Vec::new();
    for d in q.namespaces() {
        if d.unavailable.is_some() {
            rows.push(Ns {
                ns: NamespaceJson::from(&d),
                method: None,
                method_error: None,
            });
            continue;
        }
        let ns = q.namespace(d.nsid)?;
        // A read-only namespace takes no writes, so it has no durability method to use.
        let (method, method_error) = match ns.method() {
            _ if d.read_only => (None, None),
            Ok(Choice::Method(m)) => (Some(m.to_string()), None),
            Ok(Choice::VisibleOnly) => (None, None),
            Err(e) => (None, Some(e.to_string())),
        };
        rows.push(Ns {
            ns: NamespaceJson::from(&d),
            method,
            method_error,
        });
    }
    close(q);
    if g.json {
        return print_json(&rows);
    }
    for r in &rows {
        let how = match (&r.method, &r.method_error) {
            _ if r.ns.unavailable.is_some() => {
                format!("UNAVAILABLE: {}", r.ns.unavailable.as_deref().unwrap_or(""))
            }
            _ if r.ns.read_only => "no writes, so no durability method".to_owned(),
            (Some(m), _) => format!("durable with {m}"),
            (None, Some(e)) => format!("NOT durable: {e}"),
            (None, None) => "visible only (volatile)".into(),
        };
        println!(
            "nsid {}: {}, block {}, {}, {}, {} (offered: {})",
            r.ns.nsid,
            rpma_common::units::format_size(r.ns.size),
            r.ns.block_size,
            r.ns.domain,
            if r.ns.read_only {
                "read-only"
            } else {
                "read-write"
            },
            how,
            if r.ns.durability.is_empty() {
                "none".to_owned()
            } else {
                r.ns.durability.join(" ")
            }
        );
    }
    Ok(())
}

/// Where `read` puts the bytes.
enum ReadSink<'a> {
    /// `--out FILE`, opened once the range was checked; whether this read created it (then
    /// removed again if the read fails; a file or device that was there is left).
    File(std::fs::File, &'a Path, bool),
    /// Raw bytes on stdout (a pipe or file).
    Raw,
    /// A hex dump on stdout (a terminal).
    Hexdump,
    /// `--json` without `--out`: the hex digits inside the JSON object, streamed.
    JsonHex,
}

fn stdout_failure(e: std::io::Error) -> Failure {
    io_failure("writing stdout".into(), e)
}

/// Opens `--out PATH` for a read: created if missing (whether it was: the read removes only
/// what it created), an existing regular file truncated, anything else (a block device, a
/// FIFO, /dev/null) written as it is. (A failed read removed whatever PATH named, a device
/// node included.)
fn open_out(p: &Path) -> Result<(std::fs::File, bool), Failure> {
    let failed = |e| io_failure(format!("creating {}", p.display()), e);
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(p)
    {
        Ok(f) => Ok((f, true)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            // A symbolic link to nothing yet: its target is made, as creating the path would.
            let regular = match std::fs::metadata(p) {
                Ok(m) => m.is_file(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
                Err(e) => return Err(failed(e)),
            };
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(regular)
                .open(p)
                .map_err(failed)?;
            Ok((f, false))
        }
        Err(e) => Err(failed(e)),
    }
}

pub(crate) fn read(
    g: &Global,
    offset: u64,
    length: u64,
    out: Option<&Path>,
) -> Result<(), Failure> {
    let mut q = open(g, 32)?;
    // The whole range first: nothing is created or printed for a request that cannot fit.
    check_range(q.namespace(g.nsid)?.descriptor(), offset, length)?;
    let mut sink = match out {
        Some(p) => {
            let (f, created) = open_out(p)?;
            ReadSink::File(f, p, created)
        }
        None if g.json => ReadSink::JsonHex,
        None if std::io::stdout().is_terminal() => ReadSink::Hexdump,
        None => ReadSink::Raw,
    };
    let r = read_into(g, &mut q, offset, length, &mut sink);
    close(q);
    if let (Err(_), ReadSink::File(_, p, true)) = (&r, &sink) {
        let _ = std::fs::remove_file(p);
    }
    r?;
    match (out, g.json) {
        (Some(p), true) => {
            #[derive(Serialize)]
            struct Out {
                nsid: u32,
                offset: u64,
                length: u64,
                out: String,
                hex: Option<()>,
            }
            print_json(&Out {
                nsid: g.nsid,
                offset,
                length,
                out: p.display().to_string(),
                hex: None,
            })
        }
        (Some(p), false) => {
            println!(
                "read {length} bytes at offset {offset} of nsid {} into {}",
                g.nsid,
                p.display()
            );
            Ok(())
        }
        (None, _) => Ok(()),
    }
}

/// Reads the range piece by piece into `sink`.
fn read_into(
    g: &Global,
    q: &mut Queue,
    offset: u64,
    length: u64,
    sink: &mut ReadSink<'_>,
) -> Result<(), Failure> {
    let stdout = std::io::stdout();
    let mut w = stdout.lock();
    if let ReadSink::JsonHex = sink {
        // The same shape print_json gives the other outputs; the hex is streamed.
        write!(
            w,
            "{{\n  \"nsid\": {},\n  \"offset\": {offset},\n  \"length\": {length},\n  \"out\": null,\n  \"hex\": \"",
            g.nsid
        )
        .map_err(stdout_failure)?;
    }
    let mut bar = Progress::new("read", length, g.json);
    let mut buf = Vec::new();
    let mut at = 0;
    while at < length {
        let n = (length - at).min(PIECE) as usize;
        buf.resize(n, 0);
        q.namespace(g.nsid)?.read_at(offset + at, &mut buf)?;
        match sink {
            ReadSink::File(f, p, _) => f
                .write_all(&buf)
                .map_err(|e| io_failure(format!("writing {}", p.display()), e))?,
            ReadSink::Raw => w.write_all(&buf).map_err(stdout_failure)?,
            ReadSink::Hexdump => w
                .write_all(hexdump(offset + at, &buf).as_bytes())
                .map_err(stdout_failure)?,
            ReadSink::JsonHex => {
                let hex: String = buf.iter().map(|b| format!("{b:02x}")).collect();
                w.write_all(hex.as_bytes()).map_err(stdout_failure)?;
            }
        }
        bar.add(n as u64);
        at += n as u64;
    }
    bar.finish();
    if let ReadSink::JsonHex = sink {
        w.write_all(b"\"\n}\n").map_err(stdout_failure)?;
    }
    w.flush().map_err(stdout_failure)
}

/// `00001000  5a 5a ... 5a  |ZZZZZZZZZZZZZZZZ|` lines, 16 bytes each.
fn hexdump(base: u64, data: &[u8]) -> String {
    let mut s = String::new();
    for (i, row) in data.chunks(16).enumerate() {
        let hex: Vec<String> = row.iter().map(|b| format!("{b:02x}")).collect();
        let asc: String = row
            .iter()
            .map(|&b| {
                if b.is_ascii_graphic() || b == b' ' {
                    b as char
                } else {
                    '.'
                }
            })
            .collect();
        s += &format!(
            "{:08x}  {:<47}  |{asc}|\n",
            base + 16 * i as u64,
            hex.join(" ")
        );
    }
    s
}

pub(crate) fn write(
    g: &Global,
    offset: u64,
    source: &Source,
    length: Option<u64>,
    durable: bool,
) -> Result<(), Failure> {
    let bytes = Bytes::of(source, length)?;
    let total = bytes.len();
    let mut q = open(g, 32)?;
    let domain = {
        // Check everything before the first byte goes out.
        let ns = q.namespace(g.nsid)?;
        let d = ns.descriptor().clone();
        rpma_initiator::namespace::check_writable(&d)?;
        check_range(&d, offset, total)?;
        if durable {
            ns.method()?;
        }
        d.domain_label()
    };
    let start = std::time::Instant::now();
    let mut bar = Progress::new("write", total, g.json);
    let mut buf = Vec::new();
    let mut at = 0;
    let mut result = None;
    while at < total {
        let n = (total - at).min(PIECE) as usize;
        bytes.piece(at, n, &mut buf)?;
        let mut ns = q.namespace(g.nsid)?;
        if durable && n as u64 == total {
            // One piece: the Writes and the request that makes them durable go out together.
            result = Some(ns.write_durable(offset, &buf)?);
        } else {
            ns.write_at(offset + at, &buf)?;
        }
        bar.add(n as u64);
        at += n as u64;
    }
    if durable && result.is_none() {
        // Several pieces: one more round trip for the whole range (this queue wrote it
        // itself: APM's Read covers it), small beside moving more than a piece.
        result = Some(q.namespace(g.nsid)?.persist_written(offset, total)?);
    }
    bar.finish();
    let secs = start.elapsed().as_secs_f64();
    close(q);
    // Without --durable the Writes were handed to the transport: the target does not
    // acknowledge a Write (docs/initiator.md, "What a return means").
    let (state, method) = match result {
        Some(d) => outcome(g, d),
        None => ("sent", None),
    };
    if g.json {
        #[derive(Serialize)]
        struct Out {
            nsid: u32,
            offset: u64,
            length: u64,
            state: &'static str,
            method: Option<String>,
            domain: String,
            seconds: f64,
        }
        print_json(&Out {
            nsid: g.nsid,
            offset,
            length: total,
            state,
            method,
            domain: domain.clone(),
            seconds: secs,
        })?;
    } else {
        let how = match result {
            Some(d) => describe(d, &domain),
            None => "sent, not acknowledged by the target and not yet durable (use --durable or \
                     flush)"
                .to_owned(),
        };
        println!(
            "wrote {total} bytes at offset {offset} of nsid {}: {how}",
            g.nsid
        );
    }
    result.map_or(Ok(()), |d| require_durable(g, d))
}

pub(crate) fn verify(
    g: &Global,
    offset: u64,
    source: &Source,
    length: Option<u64>,
) -> Result<(), Failure> {
    let bytes = Bytes::of(source, length)?;
    let total = bytes.len();
    let mut q = open(g, 32)?;
    check_range(q.namespace(g.nsid)?.descriptor(), offset, total)?;
    let mut bar = Progress::new("verify", total, g.json);
    let (mut want, mut got) = (Vec::new(), Vec::new());
    let mut at = 0;
    let mut mismatch = None;
    while at < total && mismatch.is_none() {
        let n = (total - at).min(PIECE) as usize;
        bytes.piece(at, n, &mut want)?;
        got.resize(n, 0);
        q.namespace(g.nsid)?.read_at(offset + at, &mut got)?;
        if let Some(i) = want.iter().zip(&got).position(|(a, b)| a != b) {
            mismatch = Some((offset + at + i as u64, want[i], got[i]));
        }
        bar.add(n as u64);
        at += n as u64;
    }
    bar.finish();
    close(q);
    if g.json {
        #[derive(Serialize)]
        struct Out {
            nsid: u32,
            offset: u64,
            length: u64,
            matches: bool,
            first_mismatch: Option<u64>,
            expected: Option<u8>,
            found: Option<u8>,
        }
        print_json(&Out {
            nsid: g.nsid,
            offset,
            length: total,
            matches: mismatch.is_none(),
            first_mismatch: mismatch.map(|m| m.0),
            expected: mismatch.map(|m| m.1),
            found: mismatch.map(|m| m.2),
        })?;
    } else if mismatch.is_none() {
        println!("{total} bytes at offset {offset} of nsid {} match", g.nsid);
    }
    match mismatch {
        None => Ok(()),
        Some((at, e, f)) => Err(failure(
            1,
            format!("mismatch at offset {at}: expected {e:#04x}, found {f:#04x}"),
        )),
    }
}

pub(crate) fn flush(g: &Global, offset: u64, length: u64) -> Result<(), Failure> {
    let mut q = open(g, 1)?;
    let mut ns = q.namespace(g.nsid)?;
    let domain = ns.descriptor().domain_label();
    let d = ns.persist(offset, length)?;
    close(q);
    let (state, method) = outcome(g, d);
    if g.json {
        #[derive(Serialize)]
        struct Out {
            nsid: u32,
            offset: u64,
            length: u64,
            state: &'static str,
            method: Option<String>,
            domain: String,
        }
        print_json(&Out {
            nsid: g.nsid,
            offset,
            length,
            state,
            method,
            domain: domain.clone(),
        })?;
    } else {
        println!(
            "{length} bytes at offset {offset} of nsid {}: {}",
            g.nsid,
            describe(d, &domain)
        );
    }
    require_durable(g, d)
}

#[derive(Serialize)]
struct AtomicOut {
    nsid: u32,
    offset: u64,
    old: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    swapped: Option<bool>,
}

pub(crate) fn cas(g: &Global, offset: u64, expected: u64, new: u64) -> Result<(), Failure> {
    let mut q = open(g, 1)?;
    let old = q
        .namespace(g.nsid)?
        .compare_and_swap(offset, expected, new)?;
    close(q);
    let swapped = old == expected;
    if g.json {
        return print_json(&AtomicOut {
            nsid: g.nsid,
            offset,
            old,
            swapped: Some(swapped),
        });
    }
    println!(
        "old {old} ({old:#x}): {}",
        if swapped { "swapped" } else { "not swapped" }
    );
    Ok(())
}

pub(crate) fn faa(g: &Global, offset: u64, add: u64) -> Result<(), Failure> {
    let mut q = open(g, 1)?;
    let old = q.namespace(g.nsid)?.fetch_add(offset, add)?;
    close(q);
    if g.json {
        return print_json(&AtomicOut {
            nsid: g.nsid,
            offset,
            old,
            swapped: None,
        });
    }
    println!("old {old} ({old:#x}), new {}", old.wrapping_add(add));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rpma_common::proto::PersistenceDomain;

    #[test]
    fn hexdump_lines() {
        let d = hexdump(0x1000, b"ZZZZZZZZZZZZZZZZ\x00a");
        let lines: Vec<&str> = d.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with("00001000  5a 5a"), "{d}");
        assert!(lines[0].ends_with("|ZZZZZZZZZZZZZZZZ|"), "{d}");
        assert!(lines[1].starts_with("00001010  00 61"), "{d}");
        assert!(lines[1].ends_with("|.a|"), "{d}");
    }

    #[test]
    fn pattern_and_file_pieces() {
        let p = Bytes::Pattern(0x5a, 10);
        let mut v = Vec::new();
        assert!(p.piece(4, 3, &mut v).is_ok());
        assert_eq!(v, vec![0x5a; 3]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in");
        std::fs::write(&path, b"0123456789").unwrap();
        let f = Bytes::File(std::fs::File::open(&path).unwrap(), 10, path.clone());
        assert!(f.piece(4, 3, &mut v).is_ok());
        assert_eq!(v, b"456");
        assert_eq!(f.len(), 10);
        // Past the end (the file shrank meanwhile): an error naming the file.
        let e = f.piece(8, 4, &mut v).err().unwrap();
        assert!(format!("{:#}", e.err).contains("reading"), "{:#}", e.err);
    }

    #[test]
    fn outcomes_name_method_and_domain() {
        assert_eq!(
            describe(
                Durability::Durable(rpma_initiator::PersistMethod::Flush),
                &PersistenceDomain::DaxForced.to_string()
            ),
            "durable (FLUSH, dax (forced))"
        );
        assert_eq!(
            describe(
                Durability::VisibleOnly,
                &PersistenceDomain::Volatile.to_string()
            ),
            "visible only (volatile): NOT durable"
        );
        assert_eq!(
            describe(
                Durability::Durable(rpma_initiator::PersistMethod::Gpspm),
                "page-cache, power-loss simulation (test only)"
            ),
            "durable (GPSPM, page-cache, power-loss simulation (test only))"
        );
    }
}
