//! `codepool`: import pre-issued activation codes and hand exactly one to
//! every purchase. `main` only wires things: parse the command line, start
//! telemetry, run the command, map the outcome to an exit code.

mod bench;
mod cli;
mod commands;
mod config;
mod context;
mod http;
mod shutdown;
mod telemetry;

use std::process::ExitCode;

use clap::Parser;

/// Exit codes that mean something to scripts (documented in the README and
/// in `codepool --help`).
pub mod exit {
    /// Everything worked.
    pub const OK: u8 = 0;
    /// The command failed (a server unreachable, a file unreadable or
    /// refused, …); the message says what to do next.
    pub const FAILURE: u8 = 1;
    /// The command line was wrong (clap's code, as POSIX tools use it).
    pub const USAGE: u8 = 2;
    /// It worked, but some input was invalid and skipped (import).
    pub const PARTIAL: u8 = 3;
}

fn main() -> ExitCode {
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version print to stdout and succeed; anything
            // else is a usage error.
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() {
                exit::USAGE
            } else {
                exit::OK
            });
        }
    };
    telemetry::init(cli.config.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(exit::FAILURE);
        }
    };
    match runtime.block_on(cli::run(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(exit::FAILURE)
        }
    }
}
