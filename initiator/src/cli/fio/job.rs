//! fio job files: the ini syntax (`[section]`, `key=value`, a bare `key` for a flag, `;` and `#`
//! comments, `[global]` options inherited by every later section) and the options the bench
//! matrix uses. Anything else is refused by name, so a job file never silently means less than
//! it says.

use std::time::Duration;

/// What a job file line got wrong. Every variant names the line (1-based).
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub(crate) enum JobError {
    #[error("line {line}: unknown job option `{name}`")]
    UnknownOption { line: usize, name: String },
    #[error("line {line}: bad value `{value}` for `{name}`: {why}")]
    BadValue {
        line: usize,
        name: String,
        value: String,
        why: String,
    },
    #[error("line {line}: `{text}` is outside any [section]")]
    OutsideSection { line: usize, text: String },
    #[error("line {line}: malformed section header `{text}`")]
    BadSection { line: usize, text: String },
    #[error("job `{job}`: {why}")]
    Invalid { job: String, why: String },
    #[error("the job file has no job section (only [global] or nothing)")]
    NoJobs,
}

/// The I/O pattern (`rw=`), named as fio names it.
#[allow(clippy::enum_variant_names)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rw {
    Read,
    Write,
    RandRead,
    RandWrite,
    /// Sequential, mixed by `rwmixread`.
    ReadWrite,
    /// Random, mixed by `rwmixread`.
    RandRw,
}

impl Rw {
    pub(crate) fn random(self) -> bool {
        matches!(self, Rw::RandRead | Rw::RandWrite | Rw::RandRw)
    }
    /// The share of reads in percent.
    pub(crate) fn read_percent(self, rwmixread: u8) -> u8 {
        match self {
            Rw::Read | Rw::RandRead => 100,
            Rw::Write | Rw::RandWrite => 0,
            Rw::ReadWrite | Rw::RandRw => rwmixread,
        }
    }
}

/// One job section with `[global]` applied.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Job {
    pub(crate) name: String,
    pub(crate) rw: Rw,
    pub(crate) bs: u64,
    pub(crate) iodepth: usize,
    pub(crate) numjobs: usize,
    /// Bytes of the region from `offset` on; None: to the end of the namespace.
    pub(crate) size: Option<u64>,
    pub(crate) offset: u64,
    pub(crate) runtime: Option<Duration>,
    pub(crate) time_based: bool,
    pub(crate) ramp: Duration,
    pub(crate) rwmixread: u8,
    /// Make the writes durable after every this many (0: never; 1: every write).
    pub(crate) fsync: u32,
    pub(crate) verify: bool,
    /// Copy each write into the queue's bounce buffers (`bench --copy-writes`) rather than write
    /// from a registered buffer; a verifying job always copies (its bytes differ per block).
    pub(crate) copy_writes: bool,
    /// Copy each read out of the queue's bounce buffers (`bench --copy-reads`) rather than
    /// read into registered buffers.
    pub(crate) copy_reads: bool,
    /// The options as written (global first), for the report's "job options".
    pub(crate) options: Vec<(String, String)>,
}

impl Job {
    fn new(name: &str) -> Job {
        Job {
            name: name.to_owned(),
            rw: Rw::Read,
            bs: 4096,
            iodepth: 1,
            numjobs: 1,
            size: None,
            offset: 0,
            runtime: None,
            time_based: false,
            ramp: Duration::ZERO,
            rwmixread: 50,
            fsync: 0,
            verify: false,
            copy_writes: false,
            copy_reads: false,
            options: Vec::new(),
        }
    }
}

/// Largest iodepth: the queue's bounce-buffer slots (the quick bench's --depth limit).
pub(crate) const MAX_IODEPTH: usize = 128;
/// Largest numjobs: threads, each with its own queue pair.
pub(crate) const MAX_NUMJOBS: usize = 64;

/// Options accepted for portability with fio job files and without effect here: where the I/O
/// goes comes from the command line (--target, --nqn, --nsid), sections always run one after
/// another (as with `stonewall`), and there is no page cache on the initiator.
const IGNORED: &[&str] = &[
    "ioengine",
    "uri",
    "filename",
    "direct",
    "group_reporting",
    "stonewall",
    "wait_for_previous",
    "thread",
    "description",
];

/// Parses a whole job file.
pub(crate) fn parse(text: &str) -> Result<Vec<Job>, JobError> {
    let mut global = Job::new("global");
    let mut jobs: Vec<Job> = Vec::new();
    // Which section the lines go to: None before the first header.
    let mut current: Option<bool> = None; // Some(true): [global]
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let s = raw.trim();
        if s.is_empty() || s.starts_with(';') || s.starts_with('#') {
            continue;
        }
        if let Some(rest) = s.strip_prefix('[') {
            let name = rest
                .strip_suffix(']')
                .map(str::trim)
                .filter(|n| !n.is_empty() && !n.contains(['[', ']']))
                .ok_or_else(|| JobError::BadSection {
                    line,
                    text: s.to_owned(),
                })?;
            if name == "global" {
                current = Some(true);
            } else {
                let mut j = global.clone();
                j.name = name.to_owned();
                jobs.push(j);
                current = Some(false);
            }
            continue;
        }
        let (key, value) = match s.split_once('=') {
            Some((k, v)) => (k.trim(), Some(v.trim())),
            None => (s, None),
        };
        let job = match current {
            None => {
                return Err(JobError::OutsideSection {
                    line,
                    text: s.to_owned(),
                })
            }
            Some(true) => &mut global,
            Some(false) => jobs.last_mut().expect("a job section was pushed"),
        };
        set(job, line, key, value)?;
        job.options
            .push((key.to_owned(), value.unwrap_or_default().to_owned()));
    }
    if jobs.is_empty() {
        return Err(JobError::NoJobs);
    }
    for j in &jobs {
        check(j)?;
    }
    Ok(jobs)
}

/// Checks a job as a whole (after every option was read).
fn check(j: &Job) -> Result<(), JobError> {
    let bad = |why: String| {
        Err(JobError::Invalid {
            job: j.name.clone(),
            why,
        })
    };
    if j.size.is_some_and(|s| s < j.bs) {
        return bad(format!("size is smaller than bs ({})", j.bs));
    }
    if j.time_based && j.runtime.is_none() {
        return bad("time_based needs a runtime".into());
    }
    Ok(())
}

fn set(job: &mut Job, line: usize, key: &str, value: Option<&str>) -> Result<(), JobError> {
    let bad = |why: &str| JobError::BadValue {
        line,
        name: key.to_owned(),
        value: value.unwrap_or_default().to_owned(),
        why: why.to_owned(),
    };
    let need = || {
        value
            .filter(|v| !v.is_empty())
            .ok_or_else(|| bad("a value is needed"))
    };
    let size = || -> Result<u64, JobError> {
        rpma_common::units::parse_size(need()?).map_err(|e| bad(&e.to_string()))
    };
    let int = |lo: u64, hi: u64| -> Result<u64, JobError> {
        let n: u64 = need()?.parse().map_err(|_| bad("not a whole number"))?;
        if !(lo..=hi).contains(&n) {
            return Err(bad(&format!("not in {lo}..={hi}")));
        }
        Ok(n)
    };
    // A bare flag is on; `=1`/`=0` and true/false as fio takes them.
    let flag = || -> Result<bool, JobError> {
        match value.map(str::to_ascii_lowercase).as_deref() {
            None | Some("1") | Some("true") | Some("yes") | Some("on") => Ok(true),
            Some("0") | Some("false") | Some("no") | Some("off") => Ok(false),
            _ => Err(bad("give 0 or 1")),
        }
    };
    match key {
        "rw" | "readwrite" => {
            job.rw = match need()? {
                "read" => Rw::Read,
                "write" => Rw::Write,
                "randread" => Rw::RandRead,
                "randwrite" => Rw::RandWrite,
                "rw" | "readwrite" => Rw::ReadWrite,
                "randrw" => Rw::RandRw,
                _ => return Err(bad("one of read, write, randread, randwrite, rw, randrw")),
            }
        }
        "bs" | "blocksize" => {
            job.bs = size()?;
            if job.bs == 0 || job.bs > 64 << 20 {
                return Err(bad("from 1 byte to 64 MiB"));
            }
        }
        "iodepth" => job.iodepth = int(1, MAX_IODEPTH as u64)? as usize,
        "numjobs" => job.numjobs = int(1, MAX_NUMJOBS as u64)? as usize,
        "size" => {
            let s = size()?;
            if s == 0 {
                return Err(bad("must be above 0"));
            }
            job.size = Some(s);
        }
        "offset" => job.offset = size()?,
        "runtime" => job.runtime = Some(time(need()?).map_err(&bad)?),
        "ramp_time" => job.ramp = time(need()?).map_err(&bad)?,
        "time_based" => job.time_based = flag()?,
        "rwmixread" => job.rwmixread = int(0, 100)? as u8,
        "rwmixwrite" => job.rwmixread = 100 - int(0, 100)? as u8,
        "fsync" => job.fsync = int(0, u64::from(u32::MAX))? as u32,
        "sync" => {
            let on = match value.map(str::to_ascii_lowercase).as_deref() {
                Some("sync") | Some("dsync") => true,
                Some("none") => false,
                _ => flag()?,
            };
            // Every write acknowledged durable, as O_SYNC makes each write(2).
            job.fsync = u32::from(on);
        }
        "verify" => {
            job.verify = match need()? {
                "0" | "none" => false,
                "1" | "crc32c" | "crc32c-intel" | "md5" | "sha256" | "pattern" | "meta" => true,
                _ => return Err(bad("0, none, or a checksum (crc32c, md5, sha256, pattern)")),
            }
        }
        "name" => job.name = need()?.to_owned(),
        k if IGNORED.contains(&k) => {}
        _ => {
            return Err(JobError::UnknownOption {
                line,
                name: key.to_owned(),
            })
        }
    }
    Ok(())
}

/// fio's time values: a number with an optional unit (us, ms, s, m, h; default seconds).
fn time(s: &str) -> Result<Duration, &'static str> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err("not a time (10, 500ms, 2m)");
    }
    let n: u64 = s[..digits].parse().map_err(|_| "too large")?;
    let d = match s[digits..].to_ascii_lowercase().as_str() {
        "us" | "usec" => Duration::from_micros(n),
        "ms" | "msec" => Duration::from_millis(n),
        "" | "s" | "sec" => Duration::from_secs(n),
        "m" | "min" => Duration::from_secs(n.saturating_mul(60)),
        "h" => Duration::from_secs(n.saturating_mul(3600)),
        _ => return Err("unknown time unit (us, ms, s, m, h)"),
    };
    if d > Duration::from_secs(86400) {
        return Err("more than a day");
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: &str = "\
; every option the matrix uses
[global]
size=64m
offset=1m
time_based
runtime=2
ramp_time=500ms
ioengine=nbd
stonewall

[a]
rw=randrw
rwmixread=70
bs=4k
iodepth=16
numjobs=2
verify=crc32c
# a comment
[b]
readwrite=write
blocksize=1m
fsync=1
time_based=0
runtime=1m
[c]
rw=randwrite
bs=512
sync=1
rwmixwrite=20
";

    #[test]
    fn every_option_and_global_inheritance() {
        let jobs = parse(ALL).unwrap();
        assert_eq!(jobs.len(), 3);
        let a = &jobs[0];
        assert_eq!(a.name, "a");
        assert_eq!(a.rw, Rw::RandRw);
        assert_eq!(a.rwmixread, 70);
        assert_eq!(a.bs, 4096);
        assert_eq!(a.iodepth, 16);
        assert_eq!(a.numjobs, 2);
        assert_eq!(a.size, Some(64 << 20));
        assert_eq!(a.offset, 1 << 20);
        assert!(a.time_based);
        assert_eq!(a.runtime, Some(Duration::from_secs(2)));
        assert_eq!(a.ramp, Duration::from_millis(500));
        assert!(a.verify);
        assert_eq!(a.fsync, 0);
        assert_eq!(a.options[0], ("size".to_owned(), "64m".to_owned()));
        assert!(a
            .options
            .contains(&("time_based".to_owned(), String::new())));
        let b = &jobs[1];
        assert_eq!(b.rw, Rw::Write);
        assert_eq!(b.bs, 1 << 20);
        assert_eq!(b.fsync, 1);
        assert!(!b.time_based);
        assert_eq!(b.runtime, Some(Duration::from_secs(60)));
        assert!(!b.verify, "verify was set in [a], not [global]");
        assert_eq!(b.iodepth, 1);
        let c = &jobs[2];
        assert_eq!(
            (c.rw, c.bs, c.fsync, c.rwmixread),
            (Rw::RandWrite, 512, 1, 80)
        );
        assert_eq!(c.rw.read_percent(c.rwmixread), 0);
        assert_eq!(Rw::RandRw.read_percent(70), 70);
        assert!(Rw::RandRw.random() && !Rw::Write.random() && !Rw::ReadWrite.random());
        assert_eq!(Rw::Read.read_percent(30), 100);
    }

    #[test]
    fn an_unknown_option_is_named() {
        let e = parse("[j]\nrw=read\nbogus_opt=3\n").unwrap_err();
        assert_eq!(
            e,
            JobError::UnknownOption {
                line: 3,
                name: "bogus_opt".into()
            }
        );
        assert!(e.to_string().contains("`bogus_opt`"), "{e}");
        assert!(matches!(
            parse("[global]\nzonemode=zbd\n[j]\n"),
            Err(JobError::UnknownOption { line: 2, .. })
        ));
    }

    #[test]
    fn bad_values_are_refused() {
        for (text, name) in [
            ("rw=trim", "rw"),
            ("bs=0", "bs"),
            ("bs=4q", "bs"),
            ("bs=", "bs"),
            ("iodepth=0", "iodepth"),
            ("iodepth=129", "iodepth"),
            ("iodepth=x", "iodepth"),
            ("numjobs=65", "numjobs"),
            ("size=0", "size"),
            ("offset=-1", "offset"),
            ("runtime=5d", "runtime"),
            ("runtime=ms", "runtime"),
            ("runtime=100000", "runtime"),
            ("ramp_time=", "ramp_time"),
            ("time_based=2", "time_based"),
            ("rwmixread=101", "rwmixread"),
            ("fsync=-1", "fsync"),
            ("sync=maybe", "sync"),
            ("verify=crc7", "verify"),
        ] {
            match parse(&format!("[j]\n{text}\n")) {
                Err(JobError::BadValue {
                    line: 2, name: n, ..
                }) => assert_eq!(n, name, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
        assert!(matches!(
            parse("rw=read\n"),
            Err(JobError::OutsideSection { line: 1, .. })
        ));
        assert!(matches!(
            parse("[j\n"),
            Err(JobError::BadSection { line: 1, .. })
        ));
        assert_eq!(parse("[global]\nbs=4k\n"), Err(JobError::NoJobs));
        assert!(matches!(
            parse("[j]\nsize=1k\nbs=4k\n"),
            Err(JobError::Invalid { .. })
        ));
        assert!(matches!(
            parse("[j]\ntime_based\n"),
            Err(JobError::Invalid { .. })
        ));
    }

    #[test]
    fn the_matrix_job_files_parse() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/jobs");
        for f in ["lat.fio", "iops.fio", "bw.fio", "mixed.fio"] {
            let text = std::fs::read_to_string(format!("{dir}/{f}")).unwrap();
            let jobs = parse(&text).unwrap_or_else(|e| panic!("{f}: {e}"));
            assert!(jobs.iter().all(|j| j.time_based && j.size.is_some()), "{f}");
        }
    }
}
