//! What can go wrong in a claim, apart from the claim itself, so that the
//! ports the claim engine uses and the plan built from its outcomes can
//! name these errors without importing the engine (no circle of imports).

use codepool_sequence::SequenceError;
use codepool_store::StoreError;

/// The claim engine answered a different number of outcomes than there
/// were purchases to claim for: a bug, never guessed around.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the claim returned {got} outcomes for {expected} purchases; the batch stays unacked")]
pub struct OutcomeMismatch {
    pub expected: usize,
    pub got: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("grant numbers unavailable")]
    GrantNumbers(#[from] SequenceError),
    /// The store answered something the claim cannot be built on (a grant
    /// read back without its fields). Never turned into "exhausted".
    #[error(transparent)]
    Plan(#[from] OutcomeMismatch),
    #[error("inconsistent claim result for order {order_id:?}: {detail}; the purchase stays unacked and is retried")]
    Inconsistent { order_id: String, detail: String },
    /// The key file lacks a key codes are sealed with: nothing was claimed.
    #[error(transparent)]
    KeysMissing(#[from] crate::keywatch::KeysMissing),
}

impl ClaimError {
    /// Worth retrying later (a server is away), as opposed to a bug or bad data.
    pub fn is_unavailable(&self) -> bool {
        match self {
            ClaimError::Store(e) => e.is_unavailable(),
            ClaimError::GrantNumbers(_) => true,
            ClaimError::Inconsistent { .. } | ClaimError::Plan(_) | ClaimError::KeysMissing(_) => {
                false
            }
        }
    }

    /// Worth answering "come back later": a server is away, or this
    /// process lacks a key (it claims nothing until its key file has it).
    pub fn is_retryable(&self) -> bool {
        self.is_unavailable() || self.is_unknown_key() || matches!(self, ClaimError::KeysMissing(_))
    }

    /// A code the claim read is sealed with a key the key file lacks.
    pub fn is_unknown_key(&self) -> bool {
        matches!(self, ClaimError::Store(e) if e.is_unknown_key())
    }

    pub(crate) fn inconsistent(order_id: &str, detail: impl Into<String>) -> Self {
        metrics::counter!("codepool_internal_errors_total", "kind" => "inconsistent_claim")
            .increment(1);
        ClaimError::Inconsistent {
            order_id: order_id.to_owned(),
            detail: detail.into(),
        }
    }
}
