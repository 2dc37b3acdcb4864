//! The daemon's process figures, from /proc/self: open file descriptors (and the limit),
//! resident and virtual memory, CPU seconds, start time. The names of the exposition are the
//! ones Prometheus client libraries use (`process_*`), so existing dashboards work.

use std::path::Path;

/// What /proc/self says now. A figure that cannot be read is None (and left out).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Process {
    /// Open file descriptors.
    pub open_fds: Option<u64>,
    /// The soft limit on them (RLIMIT_NOFILE).
    pub max_fds: Option<u64>,
    /// Resident memory, bytes.
    pub resident_bytes: Option<u64>,
    /// Virtual memory, bytes.
    pub virtual_bytes: Option<u64>,
    /// User and system CPU time, seconds.
    pub cpu_seconds: Option<f64>,
    /// When the process started, seconds since the Unix epoch.
    pub start_time_seconds: Option<f64>,
}

impl Process {
    /// The figures of this process.
    pub fn current() -> Process {
        Self::read(Path::new("/proc/self"), Path::new("/proc/stat"))
    }

    /// The figures of the process whose /proc directory is `proc_dir`; `proc_stat` gives the
    /// boot time the start time is counted from.
    pub fn read(proc_dir: &Path, proc_stat: &Path) -> Process {
        let ticks = clock_ticks();
        let page = page_size();
        let stat = std::fs::read_to_string(proc_dir.join("stat")).ok();
        let fields = stat.as_deref().and_then(stat_fields);
        let field = |i: usize| fields.as_ref().and_then(|f| f.get(i)?.parse::<u64>().ok());
        // After the command: 0 state ... 11 utime, 12 stime, 19 starttime, 20 vsize, 21 rss.
        let cpu = match (field(11), field(12), ticks) {
            (Some(u), Some(s), Some(t)) => Some((u + s) as f64 / t as f64),
            _ => None,
        };
        let boot = std::fs::read_to_string(proc_stat).ok().and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("btime ")?.trim().parse::<u64>().ok())
        });
        let start = match (field(19), ticks, boot) {
            (Some(st), Some(t), Some(b)) => Some(b as f64 + st as f64 / t as f64),
            _ => None,
        };
        Process {
            open_fds: std::fs::read_dir(proc_dir.join("fd"))
                .ok()
                .map(|d| d.count() as u64),
            max_fds: std::fs::read_to_string(proc_dir.join("limits"))
                .ok()
                .and_then(|l| max_open_files(&l)),
            resident_bytes: field(21).zip(page).map(|(p, sz)| p * sz),
            virtual_bytes: field(20),
            cpu_seconds: cpu,
            start_time_seconds: start,
        }
    }
}

/// The fields of /proc/PID/stat after the command (which may hold spaces and parentheses:
/// it ends at the last ')').
fn stat_fields(s: &str) -> Option<Vec<&str>> {
    let after = &s[s.rfind(')')? + 1..];
    Some(after.split_whitespace().collect())
}

/// The soft "Max open files" of /proc/PID/limits.
fn max_open_files(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn clock_ticks() -> Option<u64> {
    // SAFETY: sysconf reads a configuration value; no memory is passed.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (t > 0).then_some(t as u64)
}

fn page_size() -> Option<u64> {
    // SAFETY: as above.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    (p > 0).then_some(p as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_figures() {
        let p = Process::current();
        let fds = p.open_fds.expect("open fds");
        assert!(fds >= 3, "{p:?}");
        assert!(p.max_fds.expect("limit") >= fds);
        let rss = p.resident_bytes.expect("rss");
        assert!(rss > 1 << 20, "{p:?}");
        assert!(p.virtual_bytes.expect("vsize") >= rss);
        assert!(p.cpu_seconds.expect("cpu") >= 0.0);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let start = p.start_time_seconds.expect("start");
        assert!(
            start <= now + 1.0 && start > now - 86400.0 * 365.0,
            "{start} {now}"
        );
    }

    #[test]
    fn stat_and_limits_parse_and_bad_files_give_none() {
        let d = tempfile::tempdir().unwrap();
        // A command with spaces and a parenthesis, as comm allows.
        let mut stat = String::from("42 (rpma (x) y) S");
        for i in 1..=19 {
            stat.push_str(&format!(" {}", if i == 19 { 500 } else { i }));
        }
        stat.push_str(" 8192000 300 0\n"); // vsize, rss (pages), ...
        let fields = stat_fields(&stat).unwrap();
        assert_eq!(fields[0], "S");
        assert_eq!(fields[11], "11");
        assert_eq!(fields[19], "500");
        assert_eq!(fields[20], "8192000");
        assert_eq!(fields[21], "300");
        std::fs::write(d.path().join("stat"), &stat).unwrap();
        std::fs::write(
            d.path().join("limits"),
            "Limit                     Soft Limit           Hard Limit           Units\n\
             Max open files            1024                 524288               files\n",
        )
        .unwrap();
        std::fs::create_dir(d.path().join("fd")).unwrap();
        std::fs::write(d.path().join("fd/0"), "").unwrap();
        std::fs::write(d.path().join("pstat"), "cpu 1 2 3\nbtime 1000\n").unwrap();
        let p = Process::read(d.path(), &d.path().join("pstat"));
        let t = clock_ticks().unwrap() as f64;
        assert_eq!(p.open_fds, Some(1));
        assert_eq!(p.max_fds, Some(1024));
        assert_eq!(p.virtual_bytes, Some(8_192_000));
        assert_eq!(p.resident_bytes, Some(300 * page_size().unwrap()));
        assert_eq!(p.cpu_seconds, Some(23.0 / t));
        assert_eq!(p.start_time_seconds, Some(1000.0 + 500.0 / t));
        let none = Process::read(&d.path().join("missing"), &d.path().join("missing"));
        assert_eq!(none, Process::default());
        assert_eq!(stat_fields("no parenthesis"), None);
        assert_eq!(max_open_files("Max cpu time unlimited"), None);
    }
}
