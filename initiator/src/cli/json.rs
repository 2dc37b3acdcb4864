//! JSON output (`--json`): the printer and the namespace record every listing shares.

use rpma_common::proto::NamespaceDescriptor;
use serde::Serialize;

use super::failure::Failure;

#[derive(Serialize)]
pub(crate) struct NamespaceJson {
    pub(crate) nsid: u32,
    pub(crate) size: u64,
    pub(crate) block_size: u32,
    /// The domain as shown, with the power-loss simulation's label when it is on.
    pub(crate) domain: String,
    /// The power-loss simulation's label (tests only), or null.
    pub(crate) simulation: Option<String>,
    pub(crate) durability: Vec<&'static str>,
    pub(crate) read_only: bool,
    pub(crate) atomic_write_unit: u32,
    /// Why the target cannot serve it on this transport, or null.
    pub(crate) unavailable: Option<String>,
}

impl From<&NamespaceDescriptor> for NamespaceJson {
    fn from(n: &NamespaceDescriptor) -> Self {
        NamespaceJson {
            nsid: n.nsid,
            size: n.size,
            block_size: n.block_size,
            domain: n.domain_label(),
            simulation: n.simulation.clone(),
            durability: n.durability.names(),
            read_only: n.read_only,
            atomic_write_unit: n.atomic_write_unit,
            unavailable: n.unavailable.clone(),
        }
    }
}

pub(crate) fn print_json(v: &impl Serialize) -> Result<(), Failure> {
    let s = serde_json::to_string_pretty(v).map_err(|e| Failure {
        code: 1,
        err: e.into(),
    })?;
    println!("{s}");
    Ok(())
}
