//! The `idemhost` binary: parse the command line, run it on a tokio runtime, report errors.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = idemhost::cli::Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: failed to start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(idemhost::cli::execute(cli));
    idemhost::cli::shutdown_tracing();
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
