//! `tmsctl`: drive processes running Torch Memory Saver through their control sockets.

use clap::Parser;

/// Drive processes that run Torch Memory Saver (libtms.so).
///
/// The control socket inside libtms.so is not built yet: this release of tmsctl only reports
/// its version and the protocol it will speak.
#[derive(Parser, Debug)]
#[command(name = "tmsctl", version, about, long_about = None)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    println!(
        "tmsctl {} (control protocol v{}): no control socket support yet; see --help",
        env!("CARGO_PKG_VERSION"),
        tms_proto::PROTOCOL_VERSION
    );
    Ok(())
}
