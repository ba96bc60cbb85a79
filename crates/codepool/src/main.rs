//! `codepool`: import pre-issued activation codes and hand exactly one to
//! every purchase. `main` only wires things: parse the command line, start
//! telemetry, run the command, map the outcome to an exit code.

mod cli;
mod commands;
mod http;
mod shutdown;

use codepool::{config, context, exit, telemetry};

use std::process::ExitCode;

use clap::Parser;

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
    exit::run_to_exit(cli::run(cli))
}
