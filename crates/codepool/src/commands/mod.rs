//! One module per subcommand.
//!
//! Every line a command prints goes through [`say!`] (or [`say_json!`]):
//! ids, reasons, file names and message bodies come from buyers, partners
//! and operators, so control and bidi characters are escaped as in the
//! logs, never handed to the terminal.

/// `println!` with control and bidi characters escaped (`\u{1b}`).
macro_rules! say {
    () => {
        println!()
    };
    ($($arg:tt)*) => {
        println!("{}", codepool_domain::terminal_text(&format!($($arg)*), false))
    };
}

/// Prints JSON text with control and bidi characters escaped as JSON
/// escapes (`\u202e`), so it stays valid JSON.
macro_rules! say_json {
    ($json:expr) => {
        println!("{}", codepool_domain::terminal_text(&$json, true))
    };
}

pub mod api;
pub mod api_keys;
pub mod channels;
pub mod dead_letters;
pub mod dispatch;
pub mod expire;
pub mod export;
pub mod generate;
pub mod import;
pub mod keys;
pub mod lookalikes;
pub mod lookup;
pub mod migrate;
pub mod operators;
pub mod pool;
pub mod publish;
pub mod redeem;
pub mod replace;
pub mod resend;
pub mod reveal;
pub mod seq;
pub mod shops;
pub mod sms_pending;
pub mod statement;
pub mod stats;
pub mod target;
pub mod void;
pub mod webhooks;

/// The operating-system user running `command`, as the core audits it.
pub fn actor(command: &str) -> codepool_issuance::audit::Actor {
    codepool_issuance::audit::Actor::os_user(&reveal::os_user(), &reveal::host(), command)
}
