//! Which transport the end-to-end tests run over: `tcp` always, `rdma` wherever a device is
//! named.
//!
//! Every [`Target::start`](crate::Target::start) (and what is built on it: the session, NBD,
//! FUSE and initiator fixtures) listens on the transport of the test's thread, and every
//! initiator follows the target's URL. A test file lists the tests that mean the same thing on
//! both transports with [`rdma_runs!`](crate::rdma_runs): each gets a twin in a module `rdma`,
//! `#[ignore = "requires an RDMA device"]`, that runs the same body with the thread's transport
//! set to [`Transport::rdma`]. Those twins need `RPMA_TEST_RDMA_DEVICE` (the device, e.g.
//! `rxe0`) and `RPMA_TEST_RDMA_ADDR` (an address of its netdev): docs/rdma.md.
//!
//! The tests left out of the lists are about TCP itself (raw MPA/DDP frames, the fault-injecting
//! TCP relay, per-source admission of TCP connections, the userspace engine's own limits).

use std::cell::RefCell;

use rpma_common::proto::{DurabilityMethods, PersistenceDomain};
use rpma_initiator::PersistMethod;

/// Names the RDMA device of the `rdma` runs.
pub const DEVICE_VAR: &str = "RPMA_TEST_RDMA_DEVICE";
/// An address of that device's netdev, to listen on and connect to.
pub const ADDR_VAR: &str = "RPMA_TEST_RDMA_ADDR";
/// A tmpfs directory for the scratch of the rdma runs, where the device cannot register
/// file pages ([`Transport::file_pages_pinned`]).
pub const RDMA_SCRATCH_VAR: &str = "RPMA_TEST_RDMA_SCRATCH";

/// A transport to run a test over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    /// The userspace iWARP engine over TCP on 127.0.0.1.
    Tcp,
    /// An RDMA device, through the address of its netdev.
    Rdma {
        /// The device's name (`rxe0`, `mlx5_0`).
        device: String,
        /// An address of the device's netdev.
        addr: String,
    },
}

thread_local! {
    static CURRENT: RefCell<Transport> = const { RefCell::new(Transport::Tcp) };
}

impl Transport {
    /// The RDMA device the environment names, checked to exist and to own the address; panics
    /// with [`Transport::rdma_from_env`]'s error (the tests that call this are ignored unless
    /// asked for).
    pub fn rdma() -> Transport {
        Transport::rdma_from_env().unwrap_or_else(|e| panic!("{e}"))
    }

    /// The RDMA device `RPMA_TEST_RDMA_DEVICE` names with the address `RPMA_TEST_RDMA_ADDR`,
    /// checked to exist and to own the address; or what to set, or what is wrong.
    pub fn rdma_from_env() -> Result<Transport, String> {
        let need = |var: &str| {
            std::env::var(var).map_err(|_| {
                format!(
                    "{var} is not set: the rdma runs need {DEVICE_VAR} (e.g. rxe0) and \
                     {ADDR_VAR} (an address of its netdev); see docs/rdma.md"
                )
            })
        };
        let device = need(DEVICE_VAR)?;
        let addr = need(ADDR_VAR)?;
        let t = Transport::Rdma { device, addr };
        t.check_device()?;
        Ok(t)
    }

    #[cfg(feature = "rdma")]
    fn check_device(&self) -> Result<(), String> {
        use rpma_common::fabric::{rdma_devices, Context, Url};
        let Transport::Rdma { device, addr } = self else {
            return Ok(());
        };
        let names: Vec<String> = rdma_devices()
            .map_err(|e| format!("listing RDMA devices: {e}"))?
            .into_iter()
            .map(|d| d.name)
            .collect();
        if !names.contains(device) {
            return Err(format!("no RDMA device {device:?} here: {names:?}"));
        }
        let url = Url::parse(&format!("{}:1", self.listen())).map_err(|e| e.to_string())?;
        let ctx = Context::for_url(&url).map_err(|e| format!("{addr}: {e}"))?;
        if ctx.device_name() != device {
            return Err(format!(
                "{addr} is {}'s address, not {device}'s",
                ctx.device_name()
            ));
        }
        Ok(())
    }

    #[cfg(not(feature = "rdma"))]
    fn check_device(&self) -> Result<(), String> {
        Err("this build has no rdma transport: build the tests with --features rdma".into())
    }

    /// Whether this run puts its namespace files on pinned memory: over an RDMA device that
    /// cannot register file pages (page cache, fsdax) at all, such as Soft-RoCE, whose
    /// on-demand paging misplaces data (docs/rdma.md), the environment says so with
    /// `RPMA_TEST_RDMA_SCRATCH` (a tmpfs): the scratch directories of the rdma runs go there
    /// ([`scratch_root`](crate::scratch_root)) and the namespace files beside a configuration
    /// are declared `force_dax` ([`Namespace`](crate::Namespace)), so the tests exercise the
    /// transport on memory it can register. Page cache over such a device is refused
    /// (transport_rdma.rs tests that).
    pub fn file_pages_pinned(&self) -> bool {
        matches!(self, Transport::Rdma { .. }) && std::env::var_os(RDMA_SCRATCH_VAR).is_some()
    }

    /// The domain of the suite's namespace files beside a configuration (a relative path,
    /// no `force_dax`) in this run: `page-cache`, or `dax (forced)` where the run pins them
    /// ([`Transport::file_pages_pinned`]).
    pub fn file_domain(&self) -> PersistenceDomain {
        if self.file_pages_pinned() {
            PersistenceDomain::DaxForced
        } else {
            PersistenceDomain::PageCache
        }
    }

    /// The durability methods the suite's target offers on `domain` over this transport, best
    /// first (the initiator's choice): on tcp FLUSH, APM and GPSPM on dax, GPSPM (its fdatasync
    /// off the poll loop) and FLUSH on page cache, where a Read response makes nothing durable
    /// and APM is not offered; over rdma,
    /// with the suite's `direct_write_to_pmem` declaration, APM and GPSPM on dax and GPSPM
    /// on page cache (a NIC places without the target's CPU, and rdma-core 44 has no Flush
    /// verb: docs/rdma.md).
    pub fn methods(&self, domain: PersistenceDomain) -> Vec<PersistMethod> {
        use PersistMethod::{Apm, Flush, Gpspm};
        let dax = matches!(
            domain,
            PersistenceDomain::Dax | PersistenceDomain::DaxForced
        );
        match (self, domain) {
            (_, PersistenceDomain::Volatile) => vec![],
            (Transport::Tcp, _) if dax => vec![Flush, Apm, Gpspm],
            (Transport::Tcp, _) => vec![Gpspm, Flush],
            (Transport::Rdma { .. }, _) if dax => vec![Apm, Gpspm],
            (Transport::Rdma { .. }, _) => vec![Gpspm],
        }
    }

    /// [`Transport::methods`] as the descriptor's bitset (whose `names()` are in the wire's
    /// order: APM, GPSPM, FLUSH).
    pub fn offered(&self, domain: PersistenceDomain) -> DurabilityMethods {
        self.methods(domain)
            .into_iter()
            .map(|m| match m {
                PersistMethod::Apm => DurabilityMethods::APM,
                PersistMethod::Gpspm => DurabilityMethods::GPSPM,
                PersistMethod::Flush => DurabilityMethods::FLUSH,
            })
            .fold(DurabilityMethods::NONE, |a, b| a | b)
    }

    /// The durability methods a target without the `direct_write_to_pmem` declaration
    /// ([`Target::start_on`](crate::Target::start_on)) offers on `domain`, best first: as
    /// [`Transport::methods`] on tcp; over rdma GPSPM only (APM needs the declaration; the
    /// power-loss simulation, which loses the CPU caches as an ADR platform does, would find
    /// an APM write of a NIC lost).
    pub fn methods_undeclared(&self, domain: PersistenceDomain) -> Vec<PersistMethod> {
        match self {
            Transport::Tcp => self.methods(domain),
            Transport::Rdma { .. } if domain == PersistenceDomain::Volatile => vec![],
            Transport::Rdma { .. } => vec![PersistMethod::Gpspm],
        }
    }

    /// The transport of this thread's test ([`Transport::Tcp`] unless [`on`] set another).
    pub fn current() -> Transport {
        CURRENT.with(|c| c.borrow().clone())
    }

    /// The listener's scheme and host: `tcp://127.0.0.1`, `rdma://ADDR`, `rdma://[ADDR6]`.
    pub fn listen(&self) -> String {
        match self {
            Transport::Tcp => "tcp://127.0.0.1".into(),
            Transport::Rdma { addr, .. } if addr.contains(':') => format!("rdma://[{addr}]"),
            Transport::Rdma { addr, .. } => format!("rdma://{addr}"),
        }
    }

    /// The configuration's `listen = [...]` line for `port`. On rdma the listener declares
    /// `direct_write_to_pmem`, so that the target offers the durability methods it offers on
    /// tcp and the same tests hold (the namespaces of the tests are /dev/shm or page cache, and
    /// Soft-RoCE places by CPU stores; docs/rdma.md says when the declaration is true of a
    /// real NIC).
    pub fn listen_line(&self, port: u16) -> String {
        match self {
            Transport::Tcp => format!("listen = [\"{}:{port}\"]", self.listen()),
            Transport::Rdma { .. } => format!(
                "listen = [{{ url = \"{}:{port}\", direct_write_to_pmem = true }}]",
                self.listen()
            ),
        }
    }

    /// The address peers connect from and to over this transport: `127.0.0.1`, or the RDMA
    /// device's address (both ends use it).
    pub fn host(&self) -> &str {
        match self {
            Transport::Tcp => "127.0.0.1",
            Transport::Rdma { addr, .. } => addr,
        }
    }

    /// A target URL on `port` of this transport.
    pub fn url(&self, port: u16) -> String {
        format!("{}:{port}", self.listen())
    }
}

/// Runs `test` with this thread's transport set to `transport` (back to tcp after, also when
/// it panics).
pub fn on(transport: Transport, test: impl FnOnce()) {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            CURRENT.with(|c| *c.borrow_mut() = Transport::Tcp);
        }
    }
    CURRENT.with(|c| *c.borrow_mut() = transport);
    let _reset = Reset;
    test();
}

/// Runs `test` over the RDMA device the environment names ([`Transport::rdma`]).
pub fn on_rdma(test: fn()) {
    on(Transport::rdma(), test);
}

/// `rdma_runs!(a, b, ...)`: for each named `#[test]` function of the file, a twin
/// `rdma::a` that runs it over the RDMA device the environment names, ignored unless asked for
/// (`cargo test -p rpma-tests --all-features -- --ignored rdma::`; docs/rdma.md).
#[macro_export]
macro_rules! rdma_runs {
    ($($name:ident),+ $(,)?) => {
        /// The tests above that mean the same on both transports, over `rdma`.
        mod rdma {
            $(
                #[test]
                #[ignore = "requires an RDMA device (RPMA_TEST_RDMA_DEVICE, RPMA_TEST_RDMA_ADDR)"]
                fn $name() {
                    $crate::transport::on_rdma(super::$name);
                }
            )+
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rdma(addr: &str) -> Transport {
        Transport::Rdma {
            device: "rxe0".into(),
            addr: addr.into(),
        }
    }

    #[test]
    fn listeners_and_urls_of_each_transport() {
        assert_eq!(Transport::Tcp.url(7420), "tcp://127.0.0.1:7420");
        assert_eq!(rdma("192.0.2.1").url(7420), "rdma://192.0.2.1:7420");
        assert_eq!(rdma("fd00::1").url(7420), "rdma://[fd00::1]:7420");
        assert_eq!(
            Transport::Tcp.listen_line(9),
            "listen = [\"tcp://127.0.0.1:9\"]"
        );
        assert_eq!(
            rdma("192.0.2.1").listen_line(9),
            "listen = [{ url = \"rdma://192.0.2.1:9\", direct_write_to_pmem = true }]"
        );
    }

    #[test]
    fn the_thread_transport_is_set_for_the_test_only() {
        assert_eq!(Transport::current(), Transport::Tcp);
        on(rdma("192.0.2.1"), || {
            assert_eq!(Transport::current(), rdma("192.0.2.1"));
            // Another thread keeps its own.
            std::thread::spawn(|| assert_eq!(Transport::current(), Transport::Tcp))
                .join()
                .unwrap();
        });
        assert_eq!(Transport::current(), Transport::Tcp);
        let r = std::panic::catch_unwind(|| on(rdma("192.0.2.1"), || panic!("a failing test")));
        assert!(r.is_err());
        assert_eq!(Transport::current(), Transport::Tcp, "reset after a panic");
    }

    #[test]
    fn an_rdma_run_without_the_environment_says_what_to_set() {
        if std::env::var_os(DEVICE_VAR).is_some() {
            return;
        }
        let msg = Transport::rdma_from_env().expect_err("no device named");
        assert!(
            msg.contains(DEVICE_VAR) && msg.contains("docs/rdma.md"),
            "{msg}"
        );
        let r = std::panic::catch_unwind(Transport::rdma);
        let said = r.expect_err("a twin without the environment fails");
        assert_eq!(said.downcast_ref::<String>(), Some(&msg));
    }
}
