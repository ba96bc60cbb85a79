//! One module per subcommand.

pub mod api;
pub mod api_keys;
pub mod dead_letters;
pub mod dispatch;
pub mod expire;
pub mod export;
pub mod import;
pub mod keys;
pub mod lookup;
pub mod migrate;
pub mod operators;
pub mod pool;
pub mod publish;
pub mod redeem;
pub mod resend;
pub mod reveal;
pub mod seq;
pub mod sms_pending;
pub mod stats;
pub mod target;
pub mod void;

/// The operating-system user running `command`, as the core audits it.
pub fn actor(command: &str) -> codepool_dispatcher::audit::Actor {
    codepool_dispatcher::audit::Actor::os_user(&reveal::os_user(), &reveal::host(), command)
}
