//! The console's state: what every console handler shares and the
//! console's settings. Handlers take it from here, not from the file that
//! mounts them.

use std::sync::Arc;
use std::time::Duration;

use codepool_issuance::Core;

use crate::throttle;

/// How the console runs.
#[derive(Debug, Clone)]
pub struct ConsoleConfig {
    /// How long a session lasts after sign-in.
    pub session_ttl: Duration,
    /// Mark the session cookie `Secure` (the server speaks TLS).
    pub secure_cookie: bool,
    /// How often the pages poll for fresh stock numbers (with JavaScript).
    pub live_every: Duration,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        Self {
            session_ttl: Duration::from_secs(8 * 3600),
            secure_cookie: false,
            live_every: Duration::from_secs(3),
        }
    }
}

/// What every console handler shares: the core's services and the console's
/// own settings and sign-in throttle.
pub struct Console {
    pub(crate) core: Arc<Core>,
    pub(crate) cfg: ConsoleConfig,
    pub(crate) throttle: throttle::Throttle,
}
