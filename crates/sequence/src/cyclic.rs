//! A counter that runs `0..=max` and starts again at 0.
//!
//! One `findOneAndUpdate` with an update pipeline reads and writes the value
//! in a single atomic step on the server:
//!
//! ```text
//! value := if (value ?? -1) >= max { 0 } else { (value ?? -1) + 1 }
//! ```
//!
//! so concurrent callers in any number of processes each get their own step
//! of the cycle, without a read-then-write retry loop and without server-side
//! JavaScript. The missing document counts as `-1`, so the first value is 0.

use bson::{doc, Document};
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};

use crate::counters::{self, check_name, is_duplicate_key};
use crate::SequenceError;

/// Hands out `0, 1, …, max, 0, 1, …` shared by every process using the same name.
#[derive(Clone)]
pub struct CyclicCounter {
    counters: Collection<Document>,
    name: String,
    id: String,
    max: u64,
}

impl CyclicCounter {
    /// A counter named `name` over `0..=max`. Does no I/O.
    pub fn new(db: Database, name: &str, max: u64) -> Result<Self, SequenceError> {
        check_name("counter name", name)?;
        if i64::try_from(max).is_err() {
            return Err(SequenceError::InvalidMax { max });
        }
        Ok(CyclicCounter {
            counters: counters::collection(&db),
            name: name.to_owned(),
            id: format!("cyclic:{name}"),
            max,
        })
    }

    /// The counter name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The largest value before the counter wraps to 0.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// The next value of the cycle.
    pub async fn next(&self) -> Result<u64, SequenceError> {
        // Checked in `new`.
        let max = self.max as i64;
        let current = doc! { "$ifNull": ["$value", -1_i64] };
        let pipeline = vec![doc! {
            "$set": {
                "value": {
                    "$cond": [
                        { "$gte": [current.clone(), max] },
                        0_i64,
                        { "$add": [current, 1_i64] },
                    ]
                }
            }
        }];
        // Two first callers may both try to insert the document; the loser
        // gets E11000 and one retry finds the document in place.
        let mut retried = false;
        let doc = loop {
            let result = self
                .counters
                .find_one_and_update(doc! { "_id": &self.id }, pipeline.clone())
                .upsert(true)
                .return_document(ReturnDocument::After)
                .await;
            match result {
                Ok(Some(doc)) => break doc,
                Ok(None) => {
                    return Err(SequenceError::Corrupt {
                        id: self.id.clone(),
                        detail: "the upsert returned no document".to_owned(),
                    })
                }
                Err(err) if is_duplicate_key(&err) && !retried => retried = true,
                Err(err) => return Err(SequenceError::mongo("advancing a cyclic counter")(err)),
            }
        };
        let value = counters::required_value(&doc, &self.id)?;
        u64::try_from(value)
            .ok()
            .filter(|v| *v <= self.max)
            .ok_or_else(|| SequenceError::Corrupt {
                id: self.id.clone(),
                detail: format!("`value` {value} is outside 0..={}", self.max),
            })
    }
}
