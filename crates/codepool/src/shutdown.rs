//! Graceful stop: the first SIGINT/SIGTERM cancels the token (drain and
//! exit 0); a second one exits at once (redelivery keeps the invariants).

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

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut term) = signal(SignalKind::terminate()) else {
            let _ = tokio::signal::ctrl_c().await;
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
