//! Runs one job section: `numjobs` threads, each with its own queue pair, each keeping
//! `iodepth` requests in flight. Without per-write durability (`fsync=0`) and with blocks of
//! at most a chunk, the queue is kept full as fio's engines keep theirs: a request is started
//! as soon as one completes (the library's started requests), and each request's latency is
//! its own, from its start to the wait that saw it complete. Otherwise (`fsync`/`sync`, or
//! blocks larger than a chunk) through the batch calls: a batch of `iodepth` reads or writes is
//! posted together, and every request in it is charged the batch's time. Sections run one
//! after another.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rpma_initiator::{Completed, Connection, Durability, Namespace, Ticket, WriteBuf};
use smallvec::SmallVec;

use super::job::Job;
use crate::cli::Failure;

/// Live counters every worker adds to, read by the progress line.
#[derive(Debug, Default)]
pub(crate) struct Live {
    pub(crate) read_bytes: AtomicU64,
    pub(crate) write_bytes: AtomicU64,
    pub(crate) read_ios: AtomicU64,
    pub(crate) write_ios: AtomicU64,
    pub(crate) stop: AtomicBool,
}

/// One direction's totals.
#[derive(Debug, Clone)]
pub(crate) struct Dir {
    pub(crate) bytes: u64,
    pub(crate) ios: u64,
    /// Completion latency in nanoseconds.
    pub(crate) clat: Histogram<u64>,
}

impl Dir {
    fn new() -> Dir {
        Dir {
            bytes: 0,
            ios: 0,
            // 1 ns .. 100 s, 3 significant digits (0.1% relative error).
            clat: Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid bounds"),
        }
    }

    fn record(&mut self, n: u64, bytes_each: u64, took: Duration) {
        self.bytes += n * bytes_each;
        self.ios += n;
        let ns = (took.as_nanos() as u64).clamp(1, 100_000_000_000);
        self.clat.saturating_record_n(ns, n);
    }

    fn merge(&mut self, o: &Dir) {
        self.bytes += o.bytes;
        self.ios += o.ios;
        self.clat.add(&o.clat).expect("same bounds");
    }
}

/// A section's outcome, its threads merged.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    pub(crate) read: Dir,
    pub(crate) write: Dir,
    /// The measured phase (after ramp_time), longest thread.
    pub(crate) runtime: Duration,
    /// Process CPU time over the section, user and system.
    pub(crate) usr: Duration,
    pub(crate) sys: Duration,
    /// Some write was acknowledged only "visible" (a volatile namespace).
    pub(crate) visible_only: bool,
    /// Blocks read back and compared (verify).
    pub(crate) verified: u64,
    /// Bytes the job's requests (ramp included, verify pass not) copied through the queues'
    /// bounce buffers: writes' in, reads' out (none for writes from a registered buffer,
    /// reads into one).
    pub(crate) copied: (u64, u64),
}

impl Outcome {
    pub(crate) fn empty() -> Outcome {
        Outcome {
            read: Dir::new(),
            write: Dir::new(),
            runtime: Duration::ZERO,
            usr: Duration::ZERO,
            sys: Duration::ZERO,
            visible_only: false,
            verified: 0,
            copied: (0, 0),
        }
    }
}

fn fail(msg: String) -> Failure {
    Failure {
        code: 1,
        err: anyhow::anyhow!(msg),
    }
}

/// Process CPU time so far (user, system).
pub(crate) fn cpu_times() -> (Duration, Duration) {
    // SAFETY: getrusage writes one plain struct, which is zero-initialisable and outlives the call.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    (tv(ru.ru_utime), tv(ru.ru_stime))
}

/// Runs `job` against namespace `nsid`; `live` is shared with the progress line.
pub(crate) fn run(
    conn: &Connection,
    nsid: u32,
    job: &Job,
    index: usize,
    live: &Arc<Live>,
) -> Result<Outcome, Failure> {
    let (u0, s0) = cpu_times();
    let mut handles = Vec::new();
    for t in 0..job.numjobs {
        let (conn, job, live) = (conn.clone(), job.clone(), Arc::clone(live));
        let seed = 0x9E37_79B9_7F4A_7C15u64 ^ ((index as u64) << 32 | t as u64);
        handles.push(
            std::thread::Builder::new()
                .name(format!("bench-{t}"))
                .spawn(move || worker(&conn, nsid, &job, seed, &live))
                .map_err(|e| fail(format!("starting a job thread: {e}")))?,
        );
    }
    let mut total = Outcome::empty();
    let mut first_err = None;
    for h in handles {
        match h.join() {
            Ok(Ok(o)) => {
                total.read.merge(&o.read);
                total.write.merge(&o.write);
                total.runtime = total.runtime.max(o.runtime);
                total.visible_only |= o.visible_only;
                total.verified += o.verified;
                total.copied.0 += o.copied.0;
                total.copied.1 += o.copied.1;
            }
            Ok(Err(e)) => {
                live.stop.store(true, Ordering::Relaxed);
                first_err.get_or_insert(e);
            }
            Err(_) => {
                live.stop.store(true, Ordering::Relaxed);
                first_err.get_or_insert(fail("a job thread panicked".into()));
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    let (u1, s1) = cpu_times();
    total.usr = u1.saturating_sub(u0);
    total.sys = s1.saturating_sub(s0);
    Ok(total)
}

/// Picks the next request of a job: its block and whether it reads.
struct Picker {
    rng: Rng,
    seq: u64,
    blocks: u64,
    random: bool,
    read_pct: u64,
}

impl Picker {
    fn new(job: &Job, blocks: u64, seed: u64) -> Picker {
        Picker {
            rng: Rng(seed | 1),
            seq: 0,
            blocks,
            random: job.rw.random(),
            read_pct: u64::from(job.rw.read_percent(job.rwmixread)),
        }
    }

    /// (block, is a read).
    fn next(&mut self) -> (u64, bool) {
        let block = if self.random {
            self.rng.next() % self.blocks
        } else {
            let b = self.seq % self.blocks;
            self.seq += 1;
            b
        };
        let pct = self.read_pct;
        (
            block,
            pct == 100 || (pct > 0 && self.rng.next() % 100 < pct),
        )
    }
}

/// The registered buffer a job writes from without a copy (every write the same bytes,
/// `bytes`): None for a verifying job (each block's bytes differ) or with --copy-writes.
fn in_place(job: &Job, bytes: &[u8]) -> Result<Option<WriteBuf>, Failure> {
    if job.verify || job.copy_writes {
        return Ok(None);
    }
    let mut b = WriteBuf::new(bytes.len())?;
    b.fill(0, bytes)?;
    Ok(Some(b))
}

/// xorshift64*: cheap, and the same sequence for the same seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// The bytes a verifying job writes at `off`: a function of the offset only, so every thread
/// and every pass writes the same bytes there and a read can be checked whoever wrote last.
pub(crate) fn fill(off: u64, buf: &mut [u8]) {
    let mut x = off.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// One thread: its own queue, `iodepth` requests per batch, until the runtime or size is done.
fn worker(
    conn: &Connection,
    nsid: u32,
    job: &Job,
    seed: u64,
    live: &Live,
) -> Result<Outcome, Failure> {
    let mut q = conn.open_queue(0)?;
    let chunk = q.options().chunk as u64;
    let mut ns = q.namespace(nsid)?;
    let d = ns.descriptor().clone();
    let room = d.size.saturating_sub(job.offset);
    let size = job.size.unwrap_or(room);
    if job.offset >= d.size || size > room {
        return Err(crate::cli::usage(format!(
            "job `{}`: offset {} + size {} does not fit nsid {nsid} ({} bytes)",
            job.name, job.offset, size, d.size
        )));
    }
    if size < job.bs {
        return Err(crate::cli::usage(format!(
            "job `{}`: size {size} is smaller than bs {}",
            job.name, job.bs
        )));
    }
    let blocks = size / job.bs;
    if job.fsync == 0 && job.bs <= chunk {
        let out = worker_started(&mut ns, job, blocks, seed, live)?;
        let _ = q.close();
        return Ok(out);
    }
    let bs = job.bs as usize;
    let depth = job.iodepth;
    let mut wbufs = vec![vec![0xA5u8; bs]; depth];
    let zbuf = in_place(job, &wbufs[0])?;
    let mut rbufs = vec![vec![0u8; bs]; depth];
    let mut want = vec![0u8; bs];
    let mut written = vec![0u64; (blocks as usize).div_ceil(64)];
    let mut pick = Picker::new(job, blocks, seed);
    let read_pct = pick.read_pct;
    let mut out = Outcome::empty();
    // Writes since the last persist (fsync > 1).
    let mut since_sync = 0u32;
    let start = Instant::now();
    let measured_from = start + job.ramp;
    let end = job.runtime.map(|r| measured_from + r);
    let mut measured_bytes = 0u64;
    let mut wr: Vec<u64> = Vec::with_capacity(depth);
    let mut rd: Vec<u64> = Vec::with_capacity(depth);
    loop {
        let now = Instant::now();
        if live.stop.load(Ordering::Relaxed) || end.is_some_and(|e| now >= e) {
            break;
        }
        if !job.time_based && now >= measured_from && measured_bytes >= size {
            break;
        }
        let measuring = now >= measured_from;
        wr.clear();
        rd.clear();
        for _ in 0..depth {
            let (block, is_read) = pick.next();
            if is_read {
                rd.push(block);
            } else {
                wr.push(block);
            }
        }
        let at = |b: u64| job.offset + b * job.bs;
        if !wr.is_empty() {
            for (i, &b) in wr.iter().enumerate() {
                if job.verify {
                    fill(at(b), &mut wbufs[i]);
                    written[(b / 64) as usize] |= 1 << (b % 64);
                }
            }
            let t = Instant::now();
            rpma_common::steps::step("caller starts the next write");
            let durable = write(&mut ns, job, &wr, &wbufs, zbuf.as_ref(), &mut since_sync)?;
            let took = t.elapsed();
            rpma_common::steps::step("caller has the write's result");
            if durable == Some(Durability::VisibleOnly) {
                out.visible_only = true;
            }
            let n = wr.len() as u64;
            live.write_bytes.fetch_add(n * job.bs, Ordering::Relaxed);
            live.write_ios.fetch_add(n, Ordering::Relaxed);
            if measuring {
                out.write.record(n, job.bs, took);
                measured_bytes += n * job.bs;
            }
        }
        if !rd.is_empty() {
            let t = Instant::now();
            {
                let mut items: Vec<(u64, &mut [u8])> = rd
                    .iter()
                    .zip(rbufs.iter_mut())
                    .map(|(&b, buf)| (at(b), buf.as_mut_slice()))
                    .collect();
                ns.read_batch(&mut items)?;
            }
            let took = t.elapsed();
            let n = rd.len() as u64;
            live.read_bytes.fetch_add(n * job.bs, Ordering::Relaxed);
            live.read_ios.fetch_add(n, Ordering::Relaxed);
            if measuring {
                out.read.record(n, job.bs, took);
                measured_bytes += n * job.bs;
            }
            if job.verify {
                for (i, &b) in rd.iter().enumerate() {
                    // A job that only reads checks every block (an earlier job wrote them
                    // with verify on); a mixed one the blocks it wrote itself.
                    if read_pct == 100 || written[(b / 64) as usize] & (1 << (b % 64)) != 0 {
                        fill(at(b), &mut want);
                        compare(job, at(b), &want, &rbufs[i])?;
                        out.verified += 1;
                    }
                }
            }
        }
    }
    out.runtime = Instant::now().saturating_duration_since(measured_from);
    out.copied = copied(&ns);
    if since_sync > 0 && ns.persist_own_writes()? == Durability::VisibleOnly {
        out.visible_only = true;
    }
    // fio's verify after a writing job: every block written is read back and checked.
    if job.verify {
        let todo: Vec<u64> = (0..blocks)
            .filter(|b| written[(b / 64) as usize] & (1 << (b % 64)) != 0)
            .collect();
        for batch in todo.chunks(depth) {
            {
                let mut items: Vec<(u64, &mut [u8])> = batch
                    .iter()
                    .zip(rbufs.iter_mut())
                    .map(|(&b, buf)| (job.offset + b * job.bs, buf.as_mut_slice()))
                    .collect();
                ns.read_batch(&mut items)?;
            }
            for (i, &b) in batch.iter().enumerate() {
                fill(job.offset + b * job.bs, &mut want);
                compare(job, job.offset + b * job.bs, &want, &rbufs[i])?;
                out.verified += 1;
            }
        }
    }
    let _ = q.close();
    Ok(out)
}

/// A started request of [`worker_started`].
struct InFlight {
    ticket: Ticket,
    since: Instant,
    block: u64,
    measured: bool,
    /// A read to check against what was written (decided when it starts: a write started
    /// after it may not have landed before it).
    check: bool,
    /// The registered buffer of [`Rooms`] a read goes into (None: a bounce slot).
    room: Option<usize>,
}

/// The registered buffers a job's started reads go into without a copy, one per request in
/// flight (so that a finished read's bytes can be checked while others are in flight): None
/// with --copy-reads, or for a job that does not read.
struct Rooms {
    bufs: Vec<WriteBuf>,
    free: Vec<usize>,
}

impl Rooms {
    fn new(job: &Job, reads: bool) -> Result<Option<Rooms>, Failure> {
        if job.copy_reads || !reads {
            return Ok(None);
        }
        let bufs = (0..job.iodepth)
            .map(|_| WriteBuf::new(job.bs as usize))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Some(Rooms {
            free: (0..bufs.len()).collect(),
            bufs,
        }))
    }
}

/// One thread's queue kept full: `iodepth` started requests, a new one as each completes.
fn worker_started(
    ns: &mut Namespace<'_>,
    job: &Job,
    blocks: u64,
    seed: u64,
    live: &Live,
) -> Result<Outcome, Failure> {
    let bs = job.bs as usize;
    let depth = job.iodepth;
    let at = |b: u64| job.offset + b * job.bs;
    let mut pick = Picker::new(job, blocks, seed);
    let read_pct = pick.read_pct;
    let (mut wbuf, mut rbuf, mut want) = (vec![0xA5u8; bs], vec![0u8; bs], vec![0u8; bs]);
    let zbuf = in_place(job, &wbuf)?;
    let mut rooms = Rooms::new(job, read_pct > 0)?;
    let mut written = vec![0u64; (blocks as usize).div_ceil(64)];
    let mut out = Outcome::empty();
    let start = Instant::now();
    let measured_from = start + job.ramp;
    let end = job.runtime.map(|r| measured_from + r);
    let size = blocks * job.bs;
    let mut measured_bytes = 0u64;
    let mut reads: Vec<InFlight> = Vec::with_capacity(depth);
    let mut writes: Vec<InFlight> = Vec::with_capacity(depth);
    let mut done: Vec<Completed> = Vec::with_capacity(depth);
    let mut stopping = false;
    // The clock is read twice per request: when it is started and when its completion is seen;
    // the stop checks use the latter (or the start, before the first).
    let mut now = start;
    loop {
        stopping |= live.stop.load(Ordering::Relaxed)
            || end.is_some_and(|e| now >= e)
            || (!job.time_based && now >= measured_from && measured_bytes >= size);
        while !stopping && reads.len() + writes.len() < depth {
            let (block, is_read) = pick.next();
            let since = Instant::now();
            let measured = since >= measured_from;
            if is_read {
                // A job that only reads checks every block (an earlier job wrote them with
                // verify on); a mixed one the blocks it wrote itself.
                let mine = written[(block / 64) as usize] & (1 << (block % 64)) != 0;
                let (ticket, room) = match &mut rooms {
                    Some(r) => {
                        let i = r.free.pop().expect("a buffer per request in flight");
                        (
                            ns.start_read_into(at(block), &mut r.bufs[i], 0..bs)?,
                            Some(i),
                        )
                    }
                    None => (ns.start_read(at(block), bs)?, None),
                };
                reads.push(InFlight {
                    ticket,
                    since,
                    block,
                    measured,
                    check: job.verify && (read_pct == 100 || mine),
                    room,
                });
            } else {
                if job.verify {
                    fill(at(block), &mut wbuf);
                    written[(block / 64) as usize] |= 1 << (block % 64);
                }
                let ticket = match &zbuf {
                    Some(b) => ns.start_write_from(at(block), b, 0..bs)?,
                    None => ns.start_write(at(block), &wbuf)?,
                };
                writes.push(InFlight {
                    ticket,
                    since,
                    block,
                    measured,
                    check: false,
                    room: None,
                });
            }
        }
        if reads.is_empty() && writes.is_empty() {
            break;
        }
        done.clear();
        ns.wait_started(&mut done)?;
        now = Instant::now();
        for c in &done {
            let (list, ticket) = match c {
                Completed::Read(t) => (&mut reads, *t),
                Completed::Write(t) => (&mut writes, *t),
            };
            let Some(i) = list.iter().position(|r| r.ticket == ticket) else {
                continue;
            };
            let r = list.swap_remove(i);
            let took = now.saturating_duration_since(r.since);
            if matches!(c, Completed::Read(_)) {
                let got: &[u8] = match (r.room, &mut rooms) {
                    (Some(i), Some(rs)) => {
                        ns.finish_read(ticket)?;
                        rs.free.push(i);
                        rs.bufs[i].bytes_mut().expect("its one read is finished")
                    }
                    _ => {
                        ns.take_read(ticket, &mut rbuf)?;
                        &rbuf
                    }
                };
                live.read_bytes.fetch_add(job.bs, Ordering::Relaxed);
                live.read_ios.fetch_add(1, Ordering::Relaxed);
                if r.measured {
                    out.read.record(1, job.bs, took);
                    measured_bytes += job.bs;
                }
                if r.check {
                    fill(at(r.block), &mut want);
                    compare(job, at(r.block), &want, got)?;
                    out.verified += 1;
                }
            } else {
                live.write_bytes.fetch_add(job.bs, Ordering::Relaxed);
                live.write_ios.fetch_add(1, Ordering::Relaxed);
                if r.measured {
                    out.write.record(1, job.bs, took);
                    measured_bytes += job.bs;
                }
            }
        }
    }
    out.runtime = Instant::now().saturating_duration_since(measured_from);
    out.copied = copied(ns);
    if job.verify {
        // fio's verify after a writing job: every block written is read back and checked.
        for b in (0..blocks).filter(|b| written[(b / 64) as usize] & (1 << (b % 64)) != 0) {
            ns.read_at(at(b), &mut rbuf)?;
            fill(at(b), &mut want);
            compare(job, at(b), &want, &rbuf)?;
            out.verified += 1;
        }
    }
    Ok(out)
}

/// The bytes a job's queue copied through its bounce buffers so far ([`Outcome::copied`]).
fn copied(ns: &Namespace<'_>) -> (u64, u64) {
    let s = ns.queue_stats();
    (s.bytes_copied, s.read_bytes_copied)
}

fn compare(job: &Job, off: u64, want: &[u8], got: &[u8]) -> Result<(), Failure> {
    match want.iter().zip(got).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(fail(format!(
            "job `{}`: verify failed at offset {}: expected {:#04x}, found {:#04x}",
            job.name,
            off + i as u64,
            want[i],
            got[i]
        ))),
    }
}

/// Posts one batch of writes. fsync=1 (or sync): each write acknowledged durable (one
/// write_batch_durable: the Writes and the requests that make them durable behind one
/// doorbell with APM and FLUSH). fsync=N: after every N writes, a persist of this queue's
/// writes not durable yet (`persist_own_writes`: their own ranges, never the span between).
fn write(
    ns: &mut Namespace<'_>,
    job: &Job,
    blocks: &[u64],
    bufs: &[Vec<u8>],
    zbuf: Option<&WriteBuf>,
    since_sync: &mut u32,
) -> Result<Option<Durability>, Failure> {
    let at = |b: u64| job.offset + b * job.bs;
    if let Some(z) = zbuf {
        // Inline for a few, as the library's own lists: the bench's loop allocates nothing.
        let items: SmallVec<[(u64, &WriteBuf, Range<usize>); 4]> =
            blocks.iter().map(|&b| (at(b), z, 0..z.len())).collect();
        if job.fsync == 1 {
            return Ok(Some(ns.write_batch_durable_from(&items)?));
        }
        ns.write_batch_from(&items)?;
    } else {
        let items: SmallVec<[(u64, &[u8]); 4]> = blocks
            .iter()
            .zip(bufs)
            .map(|(&b, buf)| (at(b), buf.as_slice()))
            .collect();
        if job.fsync == 1 {
            return Ok(Some(ns.write_batch_durable(&items)?));
        }
        ns.write_batch(&items)?;
    }
    if job.fsync > 1 {
        *since_sync += blocks.len() as u32;
        if *since_sync >= job.fsync {
            *since_sync = 0;
            return Ok(Some(ns.persist_own_writes()?));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_depends_on_the_offset_only() {
        let (mut a, mut b, mut c) = (vec![0u8; 515], vec![0u8; 515], vec![0u8; 515]);
        fill(4096, &mut a);
        fill(4096, &mut b);
        fill(8192, &mut c);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().any(|&x| x != a[0]));
    }

    #[test]
    fn histogram_merge_and_record() {
        let mut d = Dir::new();
        d.record(4, 4096, Duration::from_micros(10));
        let mut e = Dir::new();
        e.record(1, 4096, Duration::from_micros(1000));
        d.merge(&e);
        assert_eq!((d.ios, d.bytes), (5, 5 * 4096));
        assert_eq!(d.clat.len(), 5);
        let p50 = d.clat.value_at_quantile(0.5);
        assert!((9_990..=10_010).contains(&p50), "{p50}");
        assert!(d.clat.max() >= 999_000);
    }
}
