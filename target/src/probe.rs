//! `rpma-target probe`: open a namespace backing store and report its persistence domain.

use std::path::PathBuf;

/// Arguments of `rpma-target probe`.
#[derive(Debug, Clone)]
pub struct ProbeArgs {
    pub path: PathBuf,
    pub size: Option<String>,
    pub block_size: u64,
    pub force_dax: bool,
    pub grow: bool,
    pub json: bool,
}

/// Runs `rpma-target probe`.
pub fn run(args: &ProbeArgs) -> anyhow::Result<()> {
    anyhow::bail!(
        "probe of {} is not available in this build yet",
        args.path.display()
    )
}
