use clap::Parser;

/// rpma-initiator connects to an rpma target and reads, writes and flushes remote persistent memory.
#[derive(Debug, Parser)]
#[command(name = "rpma-initiator", version, about, long_about = None)]
struct Cli {}

fn main() {
    let _cli = Cli::parse();
}
