//! The one error type of the crate. Every message says what to do next.

/// Why a sequence could not hand out a value.
#[derive(Debug, thiserror::Error)]
pub enum SequenceError {
    /// The segment step is outside `1..=MAX_STEP`.
    #[error("segment step {step} is out of range: choose a step between 1 and {max}")]
    InvalidStep { step: u32, max: u32 },

    /// A sequence name or prefix is empty or has characters that would break a key.
    #[error(
        "{what} {value:?} is not allowed: use 1 to {max_len} ASCII letters, digits, '-', '_' or '.'"
    )]
    InvalidName {
        what: &'static str,
        value: String,
        max_len: usize,
    },

    /// A caller asked for zero values, or for more than one batch may hold.
    #[error("count {count} is out of range: ask for between 1 and {max} values at a time")]
    InvalidCount { count: u64, max: u64 },

    /// The cyclic counter maximum cannot be stored as a MongoDB 64-bit integer.
    #[error(
        "cyclic max {max} is out of range: choose a max between 0 and {}",
        i64::MAX
    )]
    InvalidMax { max: u64 },

    /// The next segment would pass `i64::MAX`; numbers never wrap.
    #[error(
        "sequence {name:?} is exhausted: its next range would pass {}; \
         start a new sequence name instead of reusing this one",
        i64::MAX
    )]
    Exhausted { name: String },

    /// A document in the `sequences` collection does not hold what this crate wrote.
    #[error(
        "sequence document {id:?} in collection `sequences` is malformed ({detail}); \
         fix or delete that document, then retry"
    )]
    Corrupt { id: String, detail: String },

    /// The Redis URL could not be parsed.
    #[error("invalid Redis URL {url:?} ({source}); use the form redis://host:port/db")]
    RedisUrl {
        url: String,
        #[source]
        source: redis::RedisError,
    },

    /// MongoDB failed or could not be reached.
    #[error(
        "MongoDB failed while {action} ({source}); check that MongoDB is running and \
         reachable at the configured URI, then retry"
    )]
    Mongo {
        action: &'static str,
        #[source]
        source: mongodb::error::Error,
    },
}

impl SequenceError {
    pub(crate) fn mongo(action: &'static str) -> impl FnOnce(mongodb::error::Error) -> Self {
        move |source| SequenceError::Mongo { action, source }
    }
}
