//! The `sequences` collection: one small document per counter.
//!
//! Every generator keeps its state in a document `{ _id: "<kind>:<name>", value: <int64> }`
//! and changes it only with single-document atomic updates, so any number of
//! processes can share it.

use bson::{Bson, Document};
use mongodb::error::{ErrorKind, WriteFailure};
use mongodb::{Collection, Database};

use crate::SequenceError;

/// Name of the MongoDB collection holding every counter document.
pub const COLLECTION: &str = "sequences";

/// MongoDB's duplicate key error code.
const DUPLICATE_KEY: i32 = 11000;

/// Longest name or prefix accepted, so `_id`s and Redis keys stay short.
pub(crate) const MAX_NAME_LEN: usize = 64;

pub(crate) fn collection(db: &Database) -> Collection<Document> {
    db.collection::<Document>(COLLECTION)
}

/// True when an upsert lost the race to insert the same `_id` first.
///
/// Two callers that upsert a missing document at the same moment can both
/// decide to insert; one of them gets E11000. Retrying once is always enough:
/// the document exists afterwards.
pub(crate) fn is_duplicate_key(err: &mongodb::error::Error) -> bool {
    match err.kind.as_ref() {
        ErrorKind::Command(e) => e.code == DUPLICATE_KEY,
        ErrorKind::Write(WriteFailure::WriteError(e)) => e.code == DUPLICATE_KEY,
        _ => false,
    }
}

/// Reads the integer `value` of a counter document; `None` when the field is absent.
pub(crate) fn value_of(doc: &Document, id: &str) -> Result<Option<i64>, SequenceError> {
    match doc.get("value") {
        None => Ok(None),
        Some(Bson::Int64(v)) => Ok(Some(*v)),
        Some(Bson::Int32(v)) => Ok(Some(i64::from(*v))),
        Some(other) => Err(SequenceError::Corrupt {
            id: id.to_owned(),
            detail: format!("`value` is {other}, expected an integer"),
        }),
    }
}

/// Like [`value_of`], for documents that must have a value.
pub(crate) fn required_value(doc: &Document, id: &str) -> Result<i64, SequenceError> {
    value_of(doc, id)?.ok_or_else(|| SequenceError::Corrupt {
        id: id.to_owned(),
        detail: "`value` is missing".to_owned(),
    })
}

/// Names and prefixes become parts of `_id`s and Redis keys: keep them plain.
pub(crate) fn check_name(what: &'static str, value: &str) -> Result<(), SequenceError> {
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if value.is_empty() || value.len() > MAX_NAME_LEN || !value.chars().all(plain) {
        return Err(SequenceError::InvalidName {
            what,
            value: value.to_owned(),
            max_len: MAX_NAME_LEN,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_are_accepted_and_key_breaking_ones_are_not() {
        assert!(check_name("prefix", "G").is_ok());
        assert!(check_name("prefix", "grant-no_2.x").is_ok());
        for bad in ["", "a b", "G}", "a:b", "ü", &"x".repeat(MAX_NAME_LEN + 1)] {
            assert!(
                check_name("prefix", bad).is_err(),
                "{bad:?} should be rejected"
            );
        }
    }
}
