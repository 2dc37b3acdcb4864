//! `rpma-target probe`: open a namespace backing store the way the daemon would, and report its
//! persistence domain and what makes a byte durable there.

use std::path::PathBuf;

use anyhow::Context;
use rpma_common::pmem::{flush_instruction, Domain, Mapping, OpenOptions, Resize};
use rpma_common::units::{format_size, parse_size};

/// Arguments of `rpma-target probe`.
#[derive(Debug, Clone)]
pub struct ProbeArgs {
    /// Backing store: a regular file (created if missing) or a devdax character device.
    pub path: PathBuf,
    /// Size string for a new file (`64MiB`, `4k`, ...); None keeps an existing file's size.
    pub size: Option<String>,
    /// Block size, 512 or 4096.
    pub block_size: u64,
    /// Treat the mapping as dax (`dax (forced)`).
    pub force_dax: bool,
    /// Allow growing an existing file to the size.
    pub grow: bool,
    /// Print JSON instead of text.
    pub json: bool,
}

/// What the probe found, ready to print.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The backing store.
    pub path: PathBuf,
    /// Namespace size in bytes.
    pub size: u64,
    /// Block size in bytes.
    pub block_size: u64,
    /// The domain reported everywhere (`dax (forced)` when forced).
    pub domain: Domain,
    /// The domain the probe found before any override.
    pub probed_domain: Domain,
    /// Whether the kernel accepted MAP_SYNC.
    pub map_sync: bool,
    /// What makes a byte durable there, in words.
    pub durable_by: String,
    /// What an acknowledgement from this namespace means: "durable" or "visible only".
    pub acknowledgement: &'static str,
}

impl Report {
    /// Describes an open mapping.
    pub fn new(m: &Mapping, block_size: u64) -> Report {
        let instr = flush_instruction();
        let durable_by = match m.domain() {
            Domain::Dax => format!(
                "CPU cache write-back ({instr}) + sfence: the stores reach the persistent memory's \
                 power-fail-protected domain (ADR)"
            ),
            Domain::DaxForced => format!(
                "CPU cache write-back ({instr}) + sfence, as on real pmem, because force_dax was \
                 given; the media was probed as {}, so these bytes are durable only if that media \
                 is (for testing and benchmarking)",
                m.probed_domain()
            ),
            Domain::PageCache => "msync(MS_SYNC) of the written page-aligned range (or fdatasync \
                 of the file): the kernel writes it from the page cache to the storage device"
                .to_owned(),
            _ => "nothing: this is RAM (tmpfs, ramfs, an overlay over one, or anonymous memory) and every byte is lost \
                  on reboot or power loss; acknowledgements mean \"visible only\", never durable"
                .to_owned(),
        };
        Report {
            path: m.path().map(|p| p.to_owned()).unwrap_or_default(),
            size: m.len() as u64,
            block_size,
            domain: m.domain(),
            probed_domain: m.probed_domain(),
            map_sync: m.map_sync(),
            durable_by,
            acknowledgement: if m.domain().is_durable() {
                "durable"
            } else {
                "visible only"
            },
        }
    }

    /// The human-readable report.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let mut line = |k: &str, v: &str| s.push_str(&format!("{k:<12} {v}\n"));
        line("path:", &self.path.display().to_string());
        line(
            "size:",
            &format!("{} bytes ({})", self.size, format_size(self.size)),
        );
        line("block size:", &self.block_size.to_string());
        line("domain:", self.domain.as_str());
        if self.domain != self.probed_domain {
            line(
                "probed:",
                &format!("{} (overridden by --force-dax)", self.probed_domain),
            );
        }
        line(
            "mapping:",
            if self.map_sync {
                "MAP_SHARED_VALIDATE | MAP_SYNC"
            } else {
                "MAP_SHARED (MAP_SYNC not accepted here)"
            },
        );
        line("durable by:", &self.durable_by);
        if self.domain == Domain::DaxForced {
            line(
                "acks mean:",
                &format!(
                    "{} (as forced: only as durable as the {} media underneath)",
                    self.acknowledgement, self.probed_domain
                ),
            );
        } else {
            line("acks mean:", self.acknowledgement);
        }
        s
    }

    /// The report as one JSON object.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "path": self.path.to_string_lossy(),
            "size": self.size,
            "block_size": self.block_size,
            "domain": self.domain.as_str(),
            "probed_domain": self.probed_domain.as_str(),
            "durable": self.domain.is_durable(),
            "map_sync": self.map_sync,
            "flush_instruction": flush_instruction().as_str(),
            "durable_by": self.durable_by,
            "acknowledgement": self.acknowledgement,
        })
    }
}

/// Opens the store as the arguments say and builds its report.
///
/// Errors: a size string that does not parse, and every [`rpma_common::pmem::Error`] of
/// [`OpenOptions::open`].
pub fn probe(args: &ProbeArgs) -> anyhow::Result<Report> {
    // Held until the probe is done: a daemon starting meanwhile finds the file locked.
    let _lock = if args.grow {
        refuse_if_served(&args.path)?
    } else {
        None
    };
    let mut opts = OpenOptions::new(&args.path)
        .block_size(args.block_size)
        .force_dax(args.force_dax)
        .create(true)
        .resize(if args.grow {
            Resize::Grow
        } else {
            Resize::Refuse
        });
    if let Some(size) = &args.size {
        opts = opts.size(parse_size(size).with_context(|| format!("--size {size}"))?);
    }
    let mapping = opts.open().map_err(|e| {
        let hint = match e.resize_needed() {
            Some(Resize::Grow) => Some("add --grow to grow the file"),
            Some(_) => Some("probe never shrinks a file: give its current size, or no --size"),
            None => None,
        };
        match hint {
            // The refusal has no source: the hint follows its text.
            Some(h) => anyhow::anyhow!("{e}: {h}"),
            None => anyhow::Error::new(e),
        }
    })?;
    Ok(Report::new(&mapping, args.block_size))
}

/// Refuses to grow a file a running daemon serves: the daemon holds an exclusive `flock` on
/// every namespace file it maps (namespace/claim.rs), and a file grown under it changes the
/// size its hosts were told, and its next start refuses the file. (`probe --grow` grew it.)
/// Returns the descriptor holding the lock it took (the grow happens under it).
fn refuse_if_served(path: &std::path::Path) -> anyhow::Result<Option<std::fs::File>> {
    use std::os::fd::AsRawFd;
    // Only a regular file (nothing there, or not readable: open reports what it finds).
    let Some(f) = crate::namespace::open_regular(path) else {
        return Ok(None);
    };
    // SAFETY: flock only takes the descriptor, open for the call, and the flags.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EWOULDBLOCK) {
        anyhow::bail!(
            "{}: in use by another process (a running rpma-target serves it): growing it \
             under the daemon would change the size its hosts were told; grow it through the \
             daemon's configuration instead (its `size`, with `grow = true`, then a reload)",
            path.display()
        );
    }
    // The lock (if taken) goes with the descriptor.
    Ok(Some(f))
}

/// Runs `rpma-target probe`: prints the report (text or JSON) on stdout.
pub fn run(args: &ProbeArgs) -> anyhow::Result<()> {
    let report = probe(args)?;
    if args.json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.to_text());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(path: PathBuf) -> ProbeArgs {
        ProbeArgs {
            path,
            size: Some("64k".into()),
            block_size: 4096,
            force_dax: false,
            grow: false,
            json: false,
        }
    }

    #[test]
    fn volatile_report_says_visible_only() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let r = probe(&args(dir.path().join("ns"))).unwrap();
        assert_eq!(r.domain, Domain::Volatile);
        assert_eq!(r.acknowledgement, "visible only");
        let text = r.to_text();
        assert!(text.contains("domain:      volatile\n"), "{text}");
        assert!(text.contains("\"visible only\""), "{text}");
        assert!(!text.contains("probed:"), "{text}");
        assert_eq!(r.to_json()["durable"], false);
        assert_eq!(r.to_json()["size"], 65536);
    }

    #[test]
    fn forced_report_names_the_probed_domain() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let mut a = args(dir.path().join("ns"));
        a.force_dax = true;
        let r = probe(&a).unwrap();
        let text = r.to_text();
        assert!(text.contains("domain:      dax (forced)\n"), "{text}");
        assert!(text.contains("probed:      volatile"), "{text}");
        assert!(
            text.contains("only as durable as the volatile media"),
            "{text}"
        );
        assert_eq!(r.to_json()["domain"], "dax (forced)");
        assert_eq!(r.to_json()["probed_domain"], "volatile");
    }

    #[test]
    fn bad_size_string_is_an_error_naming_the_flag() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let mut a = args(dir.path().join("ns"));
        a.size = Some("64 furlongs".into());
        let err = probe(&a).unwrap_err();
        assert!(format!("{err:#}").contains("--size 64 furlongs"), "{err:#}");
        assert!(!dir.path().join("ns").exists());
    }
}
