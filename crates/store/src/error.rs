//! What can go wrong talking to MongoDB, sorted by what the caller should do.

use mongodb::error::{ErrorKind, WriteFailure};

/// Errors from the store. [`StoreError::is_unavailable`] tells a caller
/// whether to wait and retry (the server is away) or to give up on the
/// input (it was wrong).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("MongoDB is unreachable ({0})")]
    Unavailable(String),
    #[error("MongoDB configuration: {0}")]
    Config(String),
    #[error("migration {name} failed: {message}; fix the file in migrations/ or the data it conflicts with, then run `codepool migrate` again")]
    Migration { name: String, message: String },
    #[error("MongoDB rejected the operation: {0}")]
    Rejected(String),
    /// The driver's error for a server that is away or changing: kept as
    /// the `source()`, so its kind and labels are not lost.
    #[error("MongoDB is unreachable ({message})")]
    Unreachable {
        message: String,
        #[source]
        source: Box<mongodb::error::Error>,
    },
    /// The driver's error for an operation the server refused, kept as the
    /// `source()`.
    #[error("MongoDB rejected the operation: {message}")]
    Refused {
        message: String,
        #[source]
        source: Box<mongodb::error::Error>,
    },
    #[error("unexpected document in {collection}: {message}")]
    Corrupt { collection: String, message: String },
    /// The key file is missing, wrong, or lacks a key the data needs.
    #[error(transparent)]
    Keys(#[from] codepool_vault::VaultError),
}

impl StoreError {
    /// True when retrying later may succeed (network, failover, shutdown).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable(_) | Self::Unreachable { .. })
    }

    /// The same error again, for each of several callers one failed batch
    /// answers: the same words, and the same "retry later" or not.
    pub fn for_each(&self) -> StoreError {
        match self {
            Self::Unavailable(m) | Self::Unreachable { message: m, .. } => {
                Self::Unavailable(m.clone())
            }
            Self::Rejected(m) | Self::Refused { message: m, .. } => Self::Rejected(m.clone()),
            Self::Config(m) => Self::Config(m.clone()),
            Self::Migration { name, message } => Self::Migration {
                name: name.clone(),
                message: message.clone(),
            },
            Self::Corrupt {
                collection,
                message,
            } => Self::Corrupt {
                collection: collection.clone(),
                message: message.clone(),
            },
            // A missing key stays one: the doors answer it "come back".
            Self::Keys(codepool_vault::VaultError::UnknownKey(id)) => {
                Self::Keys(codepool_vault::VaultError::UnknownKey(id.clone()))
            }
            Self::Keys(k) => Self::Config(k.to_string()),
        }
    }

    /// What an operator does about it, for the doors that speak to
    /// operators (the CLI, the console, the logs); an HTTP body for a
    /// shop says none of it.
    pub fn operator_hint(&self) -> Option<&'static str> {
        self.is_unavailable().then_some(
            "check that mongod is running and CODEPOOL_MONGODB_URI points at it (`make services` starts a local one)",
        )
    }

    /// A code (or event) is sealed with a key this process's key file
    /// lacks, even after reading the file again.
    pub fn is_unknown_key(&self) -> bool {
        matches!(self, Self::Keys(codepool_vault::VaultError::UnknownKey(_)))
    }

    /// True when the same request later may succeed: a server is away, or
    /// this process lacks a key that the operator restores to its key file
    /// (the process reads it again, without a restart). Doors answer both
    /// as "unavailable, come back", never as an internal error.
    pub fn is_retryable(&self) -> bool {
        self.is_unavailable() || self.is_unknown_key()
    }
}

/// Server error codes that mean "the server is away or changing", not "your
/// request is wrong".
const TRANSIENT_CODES: &[i32] = &[
    6, 7, 89, 91, 189, 262, 9001, 10107, 11600, 11602, 13435, 13436, 64, 50, 202, 134, 133,
];

pub(crate) fn is_transient(e: &mongodb::error::Error) -> bool {
    if e.contains_label("RetryableWriteError")
        || e.contains_label("TransientTransactionError")
        || e.contains_label("NetworkError")
    {
        return true;
    }
    match e.kind.as_ref() {
        ErrorKind::ServerSelection { .. }
        | ErrorKind::Io(_)
        | ErrorKind::ConnectionPoolCleared { .. }
        | ErrorKind::DnsResolve { .. } => true,
        ErrorKind::Command(c) => TRANSIENT_CODES.contains(&c.code),
        ErrorKind::Write(WriteFailure::WriteConcernError(w)) => TRANSIENT_CODES.contains(&w.code),
        ErrorKind::InsertMany(im) => im
            .write_concern_error
            .as_ref()
            .is_some_and(|w| TRANSIENT_CODES.contains(&w.code)),
        _ => false,
    }
}

pub(crate) fn is_transient_code(code: i32) -> bool {
    TRANSIENT_CODES.contains(&code)
}

/// E11000: a unique index said no.
pub(crate) const DUPLICATE_KEY: i32 = 11000;

/// What an unordered `insert_many` that failed refused: `Ok` with the
/// documents a unique index refused (they were there already), an error
/// for anything else (a write concern not met, another refusal).
pub(crate) fn duplicates_only(
    e: mongodb::error::Error,
) -> Result<Vec<mongodb::error::IndexedWriteError>, StoreError> {
    let ErrorKind::InsertMany(failure) = e.kind.as_ref() else {
        return Err(e.into());
    };
    if let Some(wce) = &failure.write_concern_error {
        return Err(StoreError::Unavailable(format!(
            "write concern not satisfied: {}",
            wce.message
        )));
    }
    let errors = failure.write_errors.clone().unwrap_or_default();
    if let Some(other) = errors.iter().find(|w| w.code != DUPLICATE_KEY) {
        return Err(if is_transient_code(other.code) {
            StoreError::Unavailable(other.message.clone())
        } else {
            StoreError::Rejected(other.message.clone())
        });
    }
    Ok(errors)
}

pub(crate) fn is_duplicate_key(e: &mongodb::error::Error) -> bool {
    match e.kind.as_ref() {
        ErrorKind::Write(WriteFailure::WriteError(w)) => w.code == DUPLICATE_KEY,
        ErrorKind::Command(c) => c.code == DUPLICATE_KEY,
        _ => false,
    }
}

/// One line for "no server answered": the addresses tried and the first
/// cause, instead of the driver's whole topology description (servers,
/// labels, nested error structures).
fn server_selection_line(message: &str) -> String {
    let after = |key: &str| {
        message
            .match_indices(key)
            .map(|(i, _)| &message[i + key.len()..])
            .collect::<Vec<_>>()
    };
    let addresses: Vec<&str> = after("Address: ")
        .into_iter()
        .filter_map(|rest| rest.split([',', ' ', '}']).next())
        .collect();
    let cause = after("Error: ")
        .first()
        .map(|rest| rest.split(", labels").next().unwrap_or(rest))
        .map(|c| c.trim_start_matches("Kind: ").trim().to_owned());
    let head = message.split(". Topology").next().unwrap_or(message);
    match (addresses.is_empty(), cause) {
        (false, Some(cause)) => format!("{} at {}: {cause}", head, addresses.join(", ")),
        (false, None) => format!("{} at {}", head, addresses.join(", ")),
        (true, _) => head.to_owned(),
    }
}

impl From<mongodb::error::Error> for StoreError {
    fn from(e: mongodb::error::Error) -> Self {
        let message = match e.kind.as_ref() {
            ErrorKind::ServerSelection { message, .. } => server_selection_line(message),
            _ => e.to_string(),
        };
        let source = Box::new(e);
        if is_transient(&source) {
            StoreError::Unreachable { message, source }
        } else {
            StoreError::Refused { message, source }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_selection_failure_reads_as_one_line() {
        let driver = "Server selection timeout: No available servers. Topology: { Type: Single, Servers: [ { Address: 127.0.0.1:1, Type: Unknown, Error: Kind: I/O error: Connection refused (os error 111), labels: {\"SystemOverloadedError\"} } ] }";
        let line = server_selection_line(driver);
        assert_eq!(
            line,
            "Server selection timeout: No available servers at 127.0.0.1:1: I/O error: Connection refused (os error 111)"
        );
        assert!(!line.contains("Topology") && !line.contains('\n'));
    }
}
