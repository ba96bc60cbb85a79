//! The names the store's modules share without importing each other: the
//! `codes` collection, and reading a count out of a server reply. Kept
//! apart so that `codes`, `crypto`, `across` and `stats` each depend on
//! this module, never on one another in a circle.

use bson::Bson;

/// The collection of codes: one document per code, its status and holder.
pub const CODES: &str = "codes";

/// A count in a reply (`n`, `count`, a `$sum`), whatever its numeric type;
/// 0 when absent.
pub(crate) fn as_u64(v: Option<&Bson>) -> u64 {
    match v {
        Some(Bson::Int32(n)) => *n as u64,
        Some(Bson::Int64(n)) => *n as u64,
        Some(Bson::Double(n)) => *n as u64,
        _ => 0,
    }
}
