//! The one harness of rpma's end-to-end tests, shared by every test file in tests/:
//! - [`bins`]: the workspace's binaries, free ports, key files, /dev/shm namespace files;
//! - [`config`]: a target configuration built in code ([`Config`], [`Subsystem`],
//!   [`Namespace`]);
//! - [`target`]: the real `rpma-target` ([`Target`] on a config of the test's own, or the bare
//!   [`Daemon`] process), READY on the test's NOTIFY_SOCKET, killed on drop;
//! - [`fragile_fs`]: ext4 on a loop device over a small tmpfs, whose write-back fails on demand;
//! - [`fuse`]: what the FUSE mount tests share: a running `rpma-initiator mount`, cleanup guards;
//! - [`initiator`](mod@initiator): running `rpma-initiator` (or any command) with a deadline;
//! - [`metrics`]: HTTP to the target's metrics listener, promtool, a real Prometheus server;
//! - [`nbd`]: what the NBD tests share: an `rpma-initiator nbd` export and a raw NBD client;
//! - [`nvme`]: an NVMe/TCP host of its own for the `nvme-tcp://` listener's tests;
//! - [`relay`]: a TCP relay that injects link faults (cut, reset, stall, swallow, a reset after
//!   N bytes);
//! - [`sessions`]: the session tests' fixture and what they do over a session;
//! - [`cachestat`]: what the page cache holds unsynced;
//! - [`stress`]: what the link-fault and load tests share: short/long runs, a seeded random
//!   source, the target's footprint (sessions, regions, pools, fds, memory), self-describing
//!   blocks;
//! - [`crash`]: the crash-consistency harness behind the `rpma-crash` binary;
//! - [`transport`]: which transport a test runs over (`tcp`, or `rdma` in the
//!   [`rdma_runs!`] twins of the tests that mean the same on both).
//!
//! Every wait has a deadline (polling, never a fixed sleep for bytes to arrive); ports are
//! ephemeral; every tcp run listens on 127.0.0.1 only.

pub mod bins;
pub mod cachestat;
pub mod config;
pub mod crash;
pub mod fragile_fs;
pub mod fuse;
pub mod initiator;
pub mod metrics;
pub mod nbd;
pub mod nvme;
pub mod relay;
pub mod sessions;
pub mod stress;
pub mod target;
pub mod transport;

pub use bins::{bin, bin_dir, built, free_port, repo_file, tcp_from, write_psk, Shm};
pub use cachestat::{sees_unsynced_pages, unsynced_pages};
pub use config::{four_namespaces, without_namespace, Config, Namespace, Subsystem};
pub use initiator::{
    cli_read_with, cli_with, cli_write_with, conn_args, initiator, run_tool, run_with_deadline,
    text,
};
pub use relay::{Fault, Relay};
pub use target::{
    check_config, status, status_json, target_bin, Daemon, FdStore, Target, READY_WITHIN,
};
pub use transport::Transport;

/// Names the directory scratch files go under instead of the build directory: the VM lab sets
/// it to a filesystem of the guest's own (its view of the checkout is read-only).
pub const SCRATCH_VAR: &str = "RPMA_TEST_SCRATCH";

/// Where [`scratch`] directories go: `RPMA_TEST_RDMA_SCRATCH` in an rdma run whose device
/// cannot register file pages ([`Transport::file_pages_pinned`]), else `RPMA_TEST_SCRATCH`,
/// else the build directory (on a disk: namespaces there are page-cache, durable).
pub fn scratch_root() -> std::path::PathBuf {
    if Transport::current().file_pages_pinned() {
        if let Some(p) = std::env::var_os(transport::RDMA_SCRATCH_VAR) {
            return std::path::PathBuf::from(p);
        }
    }
    match std::env::var_os(SCRATCH_VAR) {
        Some(p) if !p.is_empty() => std::path::PathBuf::from(p),
        _ => bin_dir(),
    }
}

/// A temporary directory under [`scratch_root`], removed on drop.
pub fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("rpma-e2e-")
        .tempdir_in(scratch_root())
        .expect("scratch dir")
}

/// A target in a scratch directory of its own serving `subsystem` with [`four_namespaces`]
/// (nsid 2 of `ns2_block_size` blocks, nsid 3 on `/dev/shm/rpma-test-PID-N-TAG`): the directory,
/// the /dev/shm file and the target, each removed or killed on drop.
pub fn four_namespace_target(
    tag: &str,
    subsystem: Subsystem,
    ns2_block_size: u32,
) -> (tempfile::TempDir, Shm, Target) {
    let d = scratch();
    let shm = Shm::new(tag);
    let config =
        Config::new().subsystem(subsystem.namespaces(four_namespaces(&shm, ns2_block_size)));
    let t = Target::start(d.path(), &config.to_string());
    (d, shm, t)
}

/// `len` bytes that differ from one offset to the next (xorshift from `seed`): data no fill
/// pattern or stale content matches.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A host NQN or subsystem NQN that must parse.
pub fn nqn(s: &str) -> rpma_common::proto::nqn::Nqn {
    rpma_common::proto::nqn::Nqn::new(s).expect("a valid NQN")
}

/// The identity of host `nqn` (no key).
pub fn host(nqn: &str) -> rpma_initiator::HostIdentity {
    rpma_initiator::HostIdentity::new(crate::nqn(nqn))
}

/// A log's rate-limit summary lines ("N ... suppressed in the last ...").
pub fn summary_lines(log: &str) -> impl Iterator<Item = &str> {
    log.lines().filter(|l| l.contains("suppressed in the last"))
}

/// The lines a log's rate-limit summaries say were held back, summed (env_logger lines).
pub fn counted_in_summaries(log: &str) -> u64 {
    summary_lines(log)
        .map(|l| {
            let (_, tail) = l.split_once("] ").expect("an env_logger line");
            tail.split_whitespace()
                .next()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        })
        .sum()
}

/// The initiator library's options with a 10 s deadline on every wait.
pub fn opts() -> rpma_initiator::ConnectOptions {
    rpma_initiator::ConnectOptions {
        timeout: std::time::Duration::from_secs(10),
        ..rpma_initiator::ConnectOptions::default()
    }
}
