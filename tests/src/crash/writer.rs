//! The crash harness's writers: one thread per (namespace, method), each writing the blocks of
//! its own range with durable writes and logging every acknowledgement, until it is told to
//! stop or its connection dies with the target.
//!
//! - APM, GPSPM, FLUSH: the initiator library with the method forced (`write_durable`, and
//!   for FLUSH also `write_batch_durable` of two blocks), never reconnecting: a write in
//!   flight at the kill fails, unacknowledged.
//! - NBD FUA, NBD FLUSH: a small NBD client of its own (errors are values here, never
//!   panics) against `rpma-initiator nbd` (run with `--reconnect-timeout 0`): a write with
//!   NBD_CMD_FLAG_FUA, or one to three writes then NBD_CMD_FLUSH.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rpma_initiator::{
    ConnectOptions, Connection, Durability, PersistMethod, QueueOptions, ReconnectPolicy,
};

use super::block::{encode, Ledger, BLOCK};
use crate::nbd::{CMD_FLUSH, CMD_WRITE, FUA, HOST, IHAVEOPT, OPT_GO, REQUEST_MAGIC, SUB};

/// How a writer makes its writes durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Method {
    /// Library, APM.
    Apm,
    /// Library, GPSPM.
    Gpspm,
    /// Library, FLUSH.
    Flush,
    /// NBD export, writes with FUA.
    NbdFua,
    /// NBD export, writes then NBD_CMD_FLUSH.
    NbdFlush,
}

impl Method {
    /// Every method, in report order.
    pub const ALL: [Method; 5] = [
        Method::Apm,
        Method::Gpspm,
        Method::Flush,
        Method::NbdFua,
        Method::NbdFlush,
    ];

    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Method::Apm => "apm",
            Method::Gpspm => "gpspm",
            Method::Flush => "flush",
            Method::NbdFua => "nbd-fua",
            Method::NbdFlush => "nbd-flush",
        }
    }

    /// The method named `s`.
    pub fn parse(s: &str) -> Option<Method> {
        Method::ALL.into_iter().find(|m| m.name() == s)
    }

    /// Whether it goes through the NBD export.
    pub fn is_nbd(self) -> bool {
        matches!(self, Method::NbdFua | Method::NbdFlush)
    }

    fn library(self) -> Option<PersistMethod> {
        match self {
            Method::Apm => Some(PersistMethod::Apm),
            Method::Gpspm => Some(PersistMethod::Gpspm),
            Method::Flush => Some(PersistMethod::Flush),
            _ => None,
        }
    }
}

/// What one writer does.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Its id (in every block it writes).
    pub id: u32,
    /// The method.
    pub method: Method,
    /// The namespace.
    pub nsid: u32,
    /// Its blocks: `first..first + count`.
    pub first: usize,
    /// How many.
    pub count: usize,
    /// Seeds its choice of blocks.
    pub seed: u64,
    /// The target's URL (library methods).
    pub url: String,
    /// The export's socket (NBD methods).
    pub socket: Option<PathBuf>,
}

/// What one writer did.
#[derive(Debug, Default)]
pub struct Outcome {
    /// (block, generation) acknowledged durable, in order.
    pub acks: Vec<(usize, u64)>,
    /// Why it stopped, when not told to: expected once the target is killed.
    pub error: Option<String>,
    /// Whether that error came before the kill (a harness or product failure).
    pub error_before_kill: bool,
}

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// What a writer shares with the harness: its ledger, when to stop, whether the kill has
/// begun, and a count of writers connected and writing.
#[derive(Debug, Clone)]
pub struct Shared {
    /// The namespace's ledger.
    pub ledger: Arc<Mutex<Ledger>>,
    /// Set after the kill: stop.
    pub stop: Arc<AtomicBool>,
    /// Set just before the kill.
    pub killed: Arc<AtomicBool>,
    /// Incremented by each writer once it has its first write acknowledged, or has ended
    /// without one: the kill's moment counts from then, so that every method has written
    /// something durable in every cycle however slow the machine (an emulated guest).
    pub ready: Arc<AtomicUsize>,
}

/// Runs a writer until told to stop, or until a call fails (`killed` says whether the target
/// was being killed by then).
pub fn run(spec: &Spec, sh: &Shared) -> Outcome {
    let mut out = Outcome::default();
    let result = match spec.method.library() {
        Some(m) => library(spec, m, sh, &mut out),
        None => nbd(spec, sh, &mut out),
    };
    if let Err(e) = result {
        // Read the flag after the failure: a call that failed before the kill began is one.
        out.error_before_kill = !sh.killed.load(Ordering::SeqCst);
        out.error = Some(e);
    }
    out
}

/// Issues the next generation of `n` distinct blocks of the writer's range.
fn issue(spec: &Spec, rng: &mut Rng, ledger: &Mutex<Ledger>, n: usize) -> Vec<(usize, u64)> {
    let mut l = ledger.lock().unwrap_or_else(|e| e.into_inner());
    let mut picked: Vec<(usize, u64)> = Vec::with_capacity(n);
    while picked.len() < n.min(spec.count) {
        let b = spec.first + rng.below(spec.count);
        if picked.iter().all(|&(p, _)| p != b) {
            picked.push((b, l.issue(b)));
        }
    }
    picked
}

fn acked(sh: &Shared, ledger: &Mutex<Ledger>, out: &mut Outcome, blocks: &[(usize, u64)]) {
    let first = out.acks.is_empty();
    let mut l = ledger.lock().unwrap_or_else(|e| e.into_inner());
    for &(b, g) in blocks {
        l.ack(b, g);
        out.acks.push((b, g));
    }
    if first && !blocks.is_empty() {
        sh.ready.fetch_add(1, Ordering::SeqCst);
    }
}

fn library(spec: &Spec, m: PersistMethod, sh: &Shared, out: &mut Outcome) -> Result<(), String> {
    let (ledger, stop) = (&*sh.ledger, &*sh.stop);
    let mut q = Connection::new(&spec.url, crate::nqn(SUB), crate::host(HOST))
        .with_connect_options(ConnectOptions {
            timeout: Duration::from_secs(10),
            ..ConnectOptions::default()
        })
        .with_queue_options(QueueOptions {
            depth: 4,
            chunk: BLOCK,
            persist: Some(m),
            reconnect: ReconnectPolicy::never(),
            ..QueueOptions::default()
        })
        .open_queue(0)
        .map_err(|e| format!("connect: {e}"))?;
    let mut ns = q
        .namespace(spec.nsid)
        .map_err(|e| format!("namespace: {e}"))?;
    let mut rng = Rng::new(spec.seed);
    let mut turn = 0u64;
    while !stop.load(Ordering::Relaxed) {
        turn += 1;
        let n = if m == PersistMethod::Flush && turn.is_multiple_of(3) {
            2
        } else {
            1
        };
        let blocks = issue(spec, &mut rng, ledger, n);
        let data: Vec<Vec<u8>> = blocks
            .iter()
            .map(|&(b, g)| encode(b as u64, g, spec.id))
            .collect();
        let items: Vec<(u64, &[u8])> = blocks
            .iter()
            .zip(&data)
            .map(|(&(b, _), d)| ((b * BLOCK) as u64, d.as_slice()))
            .collect();
        match ns.write_batch_durable(&items) {
            Ok(Durability::Durable(got)) if got == m => acked(sh, ledger, out, &blocks),
            Ok(d) => return Err(format!("asked for {m}, got {d:?}")),
            Err(e) => return Err(format!("{e}")),
        }
    }
    Ok(())
}

/// A small NBD client whose errors are values.
#[derive(Debug)]
pub struct NbdClient(UnixStream);

impl NbdClient {
    /// Connected to the export at `sock`, through the handshake (NBD_OPT_GO).
    ///
    /// # Errors
    /// An I/O error, or `InvalidData` for a reply that is not the protocol's.
    pub fn connect(sock: &Path) -> io::Result<NbdClient> {
        let s = UnixStream::connect(sock)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut c = NbdClient(s);
        let mut greeting = [0u8; 18];
        c.0.read_exact(&mut greeting)?;
        if &greeting[..16] != b"NBDMAGICIHAVEOPT" {
            return Err(bad("not an NBD server"));
        }
        // Fixed newstyle, no zeroes; then GO for the default export, no info asked for.
        c.0.write_all(&3u32.to_be_bytes())?;
        let mut opt = IHAVEOPT.to_be_bytes().to_vec();
        opt.extend_from_slice(&OPT_GO.to_be_bytes());
        opt.extend_from_slice(&6u32.to_be_bytes());
        opt.extend_from_slice(&[0; 6]);
        c.0.write_all(&opt)?;
        loop {
            let mut h = [0u8; 20];
            c.0.read_exact(&mut h)?;
            let ty = u32::from_be_bytes(h[12..16].try_into().unwrap());
            let n = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
            let mut skip = vec![0u8; n];
            c.0.read_exact(&mut skip)?;
            match ty {
                1 => return Ok(c), // NBD_REP_ACK
                3 => continue,     // NBD_REP_INFO
                _ => return Err(bad("the export refused NBD_OPT_GO")),
            }
        }
    }

    fn request(&mut self, kind: u16, flags: u16, offset: u64, data: &[u8]) -> io::Result<u32> {
        let mut b = REQUEST_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&u64::from(kind).to_be_bytes()); // the handle
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.0.write_all(&b)?;
        let mut r = [0u8; 16];
        self.0.read_exact(&mut r)?;
        if r[..4] != 0x6744_6698u32.to_be_bytes() || r[8..16] != u64::from(kind).to_be_bytes() {
            return Err(bad("not a simple reply to this request"));
        }
        Ok(u32::from_be_bytes(r[4..8].try_into().unwrap()))
    }

    /// NBD_CMD_WRITE (with FUA when `fua`): the reply's error (0: done; with FUA, durable).
    ///
    /// # Errors
    /// An I/O or protocol error.
    pub fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> io::Result<u32> {
        self.request(CMD_WRITE, if fua { FUA } else { 0 }, offset, data)
    }

    /// NBD_CMD_FLUSH: the reply's error (0: every write answered before it is durable).
    ///
    /// # Errors
    /// An I/O or protocol error.
    pub fn flush(&mut self) -> io::Result<u32> {
        self.request(CMD_FLUSH, 0, 0, &[])
    }
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_owned())
}

fn nbd(spec: &Spec, sh: &Shared, out: &mut Outcome) -> Result<(), String> {
    let (ledger, stop) = (&*sh.ledger, &*sh.stop);
    let sock = spec.socket.as_deref().ok_or("no export socket")?;
    let mut c = NbdClient::connect(sock).map_err(|e| format!("connect: {e}"))?;
    let mut rng = Rng::new(spec.seed);
    let fua = spec.method == Method::NbdFua;
    while !stop.load(Ordering::Relaxed) {
        let n = if fua { 1 } else { 1 + rng.below(3) };
        let blocks = issue(spec, &mut rng, ledger, n);
        for &(b, g) in &blocks {
            let e = c
                .write((b * BLOCK) as u64, &encode(b as u64, g, spec.id), fua)
                .map_err(|e| format!("write: {e}"))?;
            if e != 0 {
                return Err(format!("write: NBD error {e}"));
            }
        }
        if !fua {
            match c.flush().map_err(|e| format!("flush: {e}"))? {
                0 => {}
                e => return Err(format!("flush: NBD error {e}")),
            }
        }
        acked(sh, ledger, out, &blocks);
    }
    Ok(())
}

/// Starts a writer thread.
pub fn spawn(spec: Spec, sh: Shared) -> std::thread::JoinHandle<(Spec, Outcome)> {
    std::thread::Builder::new()
        .name(format!("writer-{}-{}", spec.nsid, spec.method.name()))
        .spawn(move || {
            let o = run(&spec, &sh);
            if o.acks.is_empty() {
                // Ended without an acknowledgement: the kill need not wait for it.
                sh.ready.fetch_add(1, Ordering::SeqCst);
            }
            (spec, o)
        })
        .expect("spawn a writer thread")
}
