//! The `channel_outcomes` collection: how each channel's reservations and
//! provisions came out, one document per channel and minute, counted by
//! every process that serves channels (added up in memory, written a few
//! times a minute). The console reads the last hour of it, as a
//! marketplace judges a seller by its last hour. Documents expire two
//! hours after their minute, so the collection holds about 120 documents
//! a channel, whatever the traffic.
//!
//! Documents and queries only; the counting is
//! `codepool_issuance::channels::outcomes`.

use std::collections::HashMap;

use bson::{doc, DateTime};
use futures::TryStreamExt;

use crate::collections::as_u64;
use crate::{Store, StoreError};

pub const CHANNEL_OUTCOMES: &str = "channel_outcomes";

/// How long a minute's counts are kept after it.
const KEPT_MS: i64 = 2 * 3600 * 1000;

/// A channel's calls by outcome, over some minutes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Outcomes {
    pub reservations_completed: u64,
    pub reservations_failed: u64,
    pub provisions_completed: u64,
    pub provisions_failed: u64,
}

impl Outcomes {
    /// The fields of a document, in the order of the struct.
    pub const FIELDS: [&'static str; 4] = [
        "reservations_completed",
        "reservations_failed",
        "provisions_completed",
        "provisions_failed",
    ];

    fn values(&self) -> [u64; 4] {
        [
            self.reservations_completed,
            self.reservations_failed,
            self.provisions_completed,
            self.provisions_failed,
        ]
    }

    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &Outcomes) {
        self.reservations_completed += other.reservations_completed;
        self.reservations_failed += other.reservations_failed;
        self.provisions_completed += other.provisions_completed;
        self.provisions_failed += other.provisions_failed;
    }

    pub fn is_empty(&self) -> bool {
        self.values().iter().all(|n| *n == 0)
    }
}

impl Store {
    /// Adds `counts` to `channel`'s minute starting at `minute` (an upsert
    /// of one document).
    pub async fn add_channel_outcomes(
        &self,
        channel: &str,
        minute: DateTime,
        counts: &Outcomes,
    ) -> Result<(), StoreError> {
        let mut inc = doc! {};
        for (f, n) in Outcomes::FIELDS.iter().zip(counts.values()) {
            if n > 0 {
                inc.insert(*f, n.min(i64::MAX as u64) as i64);
            }
        }
        if inc.is_empty() {
            return Ok(());
        }
        let minute_ms = minute.timestamp_millis();
        self.collection(CHANNEL_OUTCOMES)
            .update_one(
                doc! {"_id": format!("{channel}\u{1f}{minute_ms}")},
                doc! {
                    "$inc": inc,
                    "$setOnInsert": {
                        "channel": channel,
                        "minute": minute,
                        "expires_at": DateTime::from_millis(minute_ms + KEPT_MS),
                    },
                },
            )
            .upsert(true)
            .await?;
        Ok(())
    }

    /// The calls of `channels` since `since`, summed by the server, by
    /// channel (a channel with none is absent).
    pub async fn channel_outcomes_since(
        &self,
        channels: &[&str],
        since: DateTime,
    ) -> Result<HashMap<String, Outcomes>, StoreError> {
        let mut group = doc! {"_id": "$channel"};
        for f in Outcomes::FIELDS {
            group.insert(f, doc! {"$sum": format!("${f}")});
        }
        let pipeline = vec![
            doc! {"$match": {"channel": {"$in": channels}, "minute": {"$gte": since}}},
            doc! {"$group": group},
        ];
        let mut out = HashMap::new();
        let mut cursor = self
            .collection(CHANNEL_OUTCOMES)
            .aggregate(pipeline)
            .await?;
        while let Some(d) = cursor.try_next().await? {
            let Ok(channel) = d.get_str("_id") else {
                continue;
            };
            let n = |f: &str| as_u64(d.get(f));
            out.insert(
                channel.to_owned(),
                Outcomes {
                    reservations_completed: n(Outcomes::FIELDS[0]),
                    reservations_failed: n(Outcomes::FIELDS[1]),
                    provisions_completed: n(Outcomes::FIELDS[2]),
                    provisions_failed: n(Outcomes::FIELDS[3]),
                },
            );
        }
        Ok(out)
    }
}
