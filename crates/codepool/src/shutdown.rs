//! Graceful stop: the first SIGINT/SIGTERM cancels the token (drain and
//! exit 0); a second one exits at once (redelivery keeps the invariants).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub fn on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        info!("stop requested; finishing in-flight purchases (signal again to exit now)");
        t.cancel();
        wait_for_signal().await;
        warn!("second stop signal; exiting now, unacked purchases will be redelivered");
        std::process::exit(130);
    });
    token
}

/// A stop request for a command that runs to completion (import): the
/// first SIGINT/SIGTERM cancels the token and is remembered, so the command
/// can record what it did and exit with the conventional 128 + signal
/// number; a second one exits at once.
pub struct Interrupt {
    pub token: CancellationToken,
    signal: Arc<AtomicU8>,
}

impl Interrupt {
    pub fn on_signals() -> Self {
        let token = CancellationToken::new();
        let signal = Arc::new(AtomicU8::new(0));
        let (t, s) = (token.clone(), signal.clone());
        tokio::spawn(async move {
            let first = wait_for_signal().await;
            s.store(first, Ordering::SeqCst);
            warn!(
                signal = first,
                "stop requested; finishing the batches in flight (signal again to exit now)"
            );
            t.cancel();
            let second = wait_for_signal().await;
            std::process::exit(128 + i32::from(second));
        });
        Self { token, signal }
    }

    /// 130 after SIGINT, 143 after SIGTERM; None when no signal came.
    pub fn exit_code(&self) -> Option<u8> {
        match self.signal.load(Ordering::SeqCst) {
            0 => None,
            n => Some(128 + n),
        }
    }

    /// The signal's name, for messages.
    pub fn name(&self) -> &'static str {
        match self.signal.load(Ordering::SeqCst) {
            SIGINT => "SIGINT",
            SIGTERM => "SIGTERM",
            _ => "a signal",
        }
    }
}

const SIGINT: u8 = 2;
const SIGTERM: u8 = 15;

/// Waits for SIGINT or SIGTERM and says which one came.
async fn wait_for_signal() -> u8 {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut term) = signal(SignalKind::terminate()) else {
            let _ = tokio::signal::ctrl_c().await;
            return SIGINT;
        };
        tokio::select! {
            _ = term.recv() => SIGTERM,
            _ = tokio::signal::ctrl_c() => SIGINT,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        SIGINT
    }
}
