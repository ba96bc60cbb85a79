//! # codepool (library part)
//!
//! What the `codepool` binary and the separate benchmark binary
//! (`crates/bench`) share: the typed configuration, how adapters are built
//! from it, telemetry, and the exit codes scripts rely on. The commands
//! themselves live in the binary (`src/commands/`).

pub mod config;
pub mod context;
pub mod telemetry;

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

    /// Runs a command on a multi-threaded runtime and maps its outcome to
    /// the process's exit code; an error is printed with its whole chain.
    pub fn run_to_exit(
        command: impl std::future::Future<Output = anyhow::Result<u8>>,
    ) -> std::process::ExitCode {
        use std::process::ExitCode;
        let runtime = match tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("error: cannot start the async runtime: {e}");
                return ExitCode::from(FAILURE);
            }
        };
        let outcome = runtime.block_on(command);
        runtime.block_on(crate::context::shutdown_clients());
        match outcome {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                let message = format!("{e:#}");
                eprintln!("error: {}", codepool_domain::terminal_text(&message, false));
                ExitCode::from(FAILURE)
            }
        }
    }
}
