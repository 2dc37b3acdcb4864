//! What a namespace offers each transport: the durability methods (DESIGN.md, Persistence),
//! the rights of its registrations, its domain as the wire names it.

use rpma_common::fabric::Access;
use rpma_common::pmem::Domain;
use rpma_common::proto::{DurabilityMethods, PersistenceDomain};

use super::OpenNamespace;
use crate::config::Transport;

/// The wire's name for a pmem domain.
pub fn wire_domain(d: Domain) -> PersistenceDomain {
    match d {
        Domain::Dax => PersistenceDomain::Dax,
        Domain::DaxForced => PersistenceDomain::DaxForced,
        Domain::PageCache => PersistenceDomain::PageCache,
        _ => PersistenceDomain::Volatile,
    }
}

/// The durability methods a namespace in `domain` offers on `transport` (DESIGN.md, Persistence).
///
/// - volatile: none (acknowledgements mean "visible only").
/// - tcp: APM, GPSPM and FLUSH on dax and dax (forced): the placement engine makes every
///   earlier Write durable before it answers a Read, Atomic or Flush on that QP. GPSPM and
///   FLUSH on page-cache: there a Read or Atomic response only orders the earlier Writes (an
///   msync before every Read response after a Write, in the poll loop, cost a mixed load nine
///   tenths of its rate), so APM is not offered.
/// - rdma: GPSPM always; APM only on dax with the operator's `direct_write_to_pmem` declaration
///   (DDIO off or eADR), never on page-cache where the NIC's writes land in DRAM; FLUSH is left
///   to the transport, which knows whether the provider implements it.
/// - nvme-tcp: FLUSH, meaning NVMe's Flush command and Write with FUA (docs/nvme-tcp.md): there
///   is no other way to ask an NVMe controller for durability.
pub fn durability_methods(
    domain: Domain,
    transport: Transport,
    direct_write_to_pmem: bool,
) -> DurabilityMethods {
    if !domain.is_durable() {
        return DurabilityMethods::NONE;
    }
    match transport {
        Transport::Tcp if domain.is_dax() => {
            DurabilityMethods::APM | DurabilityMethods::GPSPM | DurabilityMethods::FLUSH
        }
        Transport::Tcp => DurabilityMethods::GPSPM | DurabilityMethods::FLUSH,
        Transport::Rdma if domain.is_dax() && direct_write_to_pmem => {
            DurabilityMethods::APM | DurabilityMethods::GPSPM
        }
        Transport::Rdma => DurabilityMethods::GPSPM,
        Transport::NvmeTcp => DurabilityMethods::FLUSH,
    }
}

impl OpenNamespace {
    /// The durability methods this namespace offers on `transport` ([`durability_methods`]),
    /// with no `direct_write_to_pmem` under the power-loss simulation: its media learns of a
    /// byte only when the target's CPU persists it, and an APM Read never involves the
    /// target's CPU (the simulation would report as lost what real hardware kept).
    pub fn methods(&self, transport: Transport, direct_write_to_pmem: bool) -> DurabilityMethods {
        let simulated = self.mapping.simulation().is_some();
        offered_methods(self.domain(), transport, direct_write_to_pmem, simulated)
    }
}

/// [`durability_methods`] for a namespace that runs under the power-loss simulation or not
/// ([`OpenNamespace::methods`]; `check-config` plans with it).
pub fn offered_methods(
    domain: Domain,
    transport: Transport,
    direct_write_to_pmem: bool,
    simulated: bool,
) -> DurabilityMethods {
    durability_methods(domain, transport, direct_write_to_pmem && !simulated)
}

/// The rights a connection's registration of a namespace carries: reads and visibility
/// flushes always, writes and atomics unless it is read-only, persistent flushes where its
/// domain is durable.
pub fn access_for(read_only: bool, domain: Domain) -> Access {
    let mut access = Access::REMOTE_READ | Access::FLUSH_VISIBILITY;
    if !read_only {
        access |= Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    }
    if domain.is_durable() {
        access |= Access::FLUSH_PERSISTENT;
    }
    access
}
