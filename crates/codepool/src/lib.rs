//! # codepool (library part)
//!
//! What the `codepool` binary and the separate benchmark binary
//! (`crates/bench`) share: the typed configuration, how adapters are built
//! from it, telemetry, and the exit codes scripts rely on. The commands
//! themselves live in the binary (`src/commands/`).

pub mod config;
pub mod context;
pub mod scratch;
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
                let message = chain_text(&e);
                eprintln!("error: {}", codepool_domain::terminal_text(&message, false));
                ExitCode::from(FAILURE)
            }
        }
    }

    /// An error and its causes in one line, `outer: cause: …`, leaving out
    /// a cause whose words the line already says, and MongoDB's driver
    /// errors: the store error above one says its cause in one line, and
    /// keeps it as its `source()` for code, not for people.
    pub fn chain_text(e: &anyhow::Error) -> String {
        let mut line = String::new();
        let mut hint = None;
        for cause in e.chain() {
            if cause.is::<mongodb::error::Error>() || cause.is::<Box<mongodb::error::Error>>() {
                break;
            }
            if let Some(h) = (cause.downcast_ref::<codepool_store::StoreError>())
                .and_then(codepool_store::StoreError::operator_hint)
            {
                hint = Some(h);
            }
            let text = cause.to_string();
            if !line.contains(&text) {
                if !line.is_empty() {
                    line.push_str(": ");
                }
                line.push_str(&text);
            }
        }
        if let Some(hint) = hint {
            line.push_str("; ");
            line.push_str(hint);
        }
        line
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn a_cause_the_message_quotes_is_said_once() {
            let inner = std::io::Error::other("connection refused");
            let quoted = anyhow::Error::new(Outer(inner));
            assert_eq!(super::chain_text(&quoted), "outer (connection refused)");
            let added = anyhow::anyhow!("disk full").context("cannot write the export");
            assert_eq!(
                super::chain_text(&added),
                "cannot write the export: disk full"
            );
        }

        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "outer ({})", self.0)
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
    }
}
