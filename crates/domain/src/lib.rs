//! # codepool-domain
//!
//! The words codepool speaks, with no I/O: a [`Pool`] of pre-issued codes,
//! a [`Code`] and its [`CodeStatus`], a [`Purchase`] that arrives over the
//! wire, the [`Grant`] that binds one code to one order, and the events the
//! system emits about them ([`SmsPending`], [`PoolEvent`]).
//!
//! Everything here is pure and deterministic, so the rules (what a valid
//! purchase is, what a valid code is, how a code is masked in logs) are
//! tested without any server, and every adapter (MongoDB, Redis, RabbitMQ)
//! speaks the same vocabulary.

pub mod code;
pub mod crockford;
pub mod events;
pub mod gate;
pub mod grant;
pub mod pattern;
pub mod policy;
pub mod pool;
pub mod purchase;
pub mod record;
pub mod redemption;
pub mod text;

pub use code::{
    mask, validate_code, CodeId, CodeStatus, InvalidCode, InvalidCodeId, Transition, MAX_CODE_LEN,
};
/// How a shop's owner tag begins (`shop:NAME`), on its orders, holds and
/// backorders.
pub const SHOP_OWNER_PREFIX: &str = "shop:";

pub use events::{PoolEvent, PoolEventKind, SmsCode, SmsPending, SmsReceipt};
pub use grant::{sms_events, Grant};
pub use pattern::{CodePattern, PatternError};
pub use policy::{PoolPolicy, PurchaseRefused, Refusal, RefusalReason, PURCHASE_REFUSED_KEY};
pub use pool::{InvalidPoolName, Pool};
pub use purchase::{
    Item, Purchase, PurchaseError, RejectReason, MAX_ITEMS, MAX_MESSAGE_BYTES, MAX_QUANTITY,
};
pub use record::{
    when, Code, Holder, NotSendable, SetAside, SmsEvent, SmsRecord, SmsState, BUNDLE_KEY_PREFIX,
    HOLD_KEY_PREFIX,
};
pub use redemption::{InvalidRedemption, Redemption};
pub use text::{
    buyer_key, checked_file_name, cross_pool_keys, first_unreadable, fold, fold_by,
    hidden_on_terminal, spreadsheet_cell, terminal_text, CrossPoolKeys, FileNameError,
    LookAlikeRule, Unreadable, UnreadableChar,
};
