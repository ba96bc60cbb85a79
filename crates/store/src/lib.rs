//! # codepool-store
//!
//! The MongoDB adapter, and MongoDB is codepool's only source of truth: every
//! code with its status and owner, every backorder, every import run. Each
//! module holds one collection's operations:
//!
//! - [`codes`]: inserting imported codes, the conditional claim writes, and
//!   reading grants back;
//! - [`backorders`]: purchases that arrived while a pool was empty;
//! - [`pools`]: which pools exist and their settings;
//! - [`moves`]: the one writer of a code's status, for every move of the gate;
//! - [`lifecycle`]: redeem, void and expire codes; SMS receipts;
//! - [`policies`]: per-user quotas and refused orders;
//! - [`recall`]: withdrawing an import's unissued codes;
//! - [`replacements`]: one code of an order replaced by a fresh one;
//! - [`pool_settings`]: a pool's thresholds and its low-stock alert state;
//! - [`imports`]: the audit record of each import run;
//! - [`ledger`]: how many codes each pool holds, without counting them;
//! - [`crypto`]: codes sealed at rest (AEAD + key id) and found by HMAC;
//! - [`rekey`]: sealing plaintext codes, rotating keys, checking the key file;
//! - [`audit`]: who revealed which codes, when;
//! - [`operators`] and [`api_keys`]: the console's operators and sessions,
//!   and the API's keys (their rules are the core's);
//! - [`sharding`]: the shard key of every collection that grows with traffic;
//! - [`migrate`]: the ordered index/validator files in `migrations/`.
//!
//! Writes that decide ownership use journaled, majority write concern, so a
//! grant that was acknowledged survives a crash of the database.

mod across;
pub mod api_keys;
pub mod audit;
pub mod backorders;
pub mod channel_outcomes;
pub mod channels;
pub mod claims;
pub mod codes;
pub mod collections;
pub mod crypto;
pub mod error;
pub mod export;
pub mod holds;
pub mod imports;
pub mod kinguin;
pub mod ledger;
pub mod lifecycle;
pub mod lookalikes;
pub mod migrate;
pub mod moves;
pub mod operators;
pub mod order_ids;
pub mod policies;
pub mod pool_settings;
pub mod pools;
pub mod recall;
pub mod redemptions;
pub mod rekey;
pub mod replacements;
pub mod sharding;
pub mod shops;
pub mod statements;
pub mod stats;
pub mod webhooks;

use std::sync::Arc;
use std::time::Duration;

use mongodb::options::{Acknowledgment, ClientOptions, WriteConcern};
use mongodb::{Client, Collection, Database};

pub use bson::oid::ObjectId;
pub use codepool_domain::CodeId;
pub use codes::{
    code_id, object_id, CandidateAsk, ClaimAssignment, ClaimWay, ClaimWrite, CodeDoc, CodeQuery,
    NewCode, Resend, Slot, StoredStatus, Stray,
};
pub use crypto::CodeKeys;
pub use error::StoreError;

/// A handle on codepool's database. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Store {
    client: Client,
    db: Database,
    /// The keyring codes are sealed and opened with ([`Store::with_keys`]).
    keys: Arc<CodeKeys>,
    /// The look-alike rule of each pool whose rule is fixed
    /// ([`Store::fix_lookalike_rule`]): fixed means it never changes again,
    /// so an import asks the server once, not once per batch.
    fixed_rules:
        Arc<std::sync::Mutex<std::collections::HashMap<String, codepool_domain::LookAlikeRule>>>,
}

impl Store {
    /// Connects to MongoDB and checks that it answers, so a wrong URI fails
    /// here with a clear message rather than at the first purchase.
    pub async fn connect(uri: &str, db_name: &str) -> Result<Self, StoreError> {
        let store = Self::connect_lazy(uri, db_name).await?;
        store.ping().await?;
        Ok(store)
    }

    /// Like [`Store::connect`] but without waiting for the server: the
    /// daemon starts, and reports unreadiness, while MongoDB is down.
    pub async fn connect_lazy(uri: &str, db_name: &str) -> Result<Self, StoreError> {
        let mut options = ClientOptions::parse(uri)
            .await
            .map_err(|e| StoreError::Config(format!("cannot parse MongoDB URI: {e}; set CODEPOOL_MONGODB_URI to something like mongodb://127.0.0.1:27017/?directConnection=true")))?;
        options.app_name.get_or_insert_with(|| "codepool".into());
        options
            .server_selection_timeout
            .get_or_insert(Duration::from_secs(5));
        options
            .connect_timeout
            .get_or_insert(Duration::from_secs(3));
        options.max_pool_size.get_or_insert(64);
        let client = Client::with_options(options)
            .map_err(|e| StoreError::Config(format!("invalid MongoDB options: {e}")))?;
        let db = client.database(db_name);
        Ok(Self {
            client,
            db,
            keys: Arc::new(CodeKeys::none(None)),
            fixed_rules: Arc::default(),
        })
    }

    /// Round trip to the server; `Err` means MongoDB is unreachable now.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.db
            .run_command(bson::doc! {"ping": 1})
            .await
            .map(|_| ())
            .map_err(StoreError::from)
    }

    pub fn database(&self) -> &Database {
        &self.db
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// True when the database holds codepool's data: `codepool migrate`
    /// (or an import, or a daemon) has run on it.
    pub async fn holds_codepool_data(&self) -> Result<bool, StoreError> {
        let names = self
            .db
            .list_collection_names()
            .filter(bson::doc! {"name": "_migrations"})
            .await?;
        Ok(!names.is_empty())
    }

    /// The names of the server's databases (empty when the user may not
    /// list them).
    pub async fn database_names(&self) -> Vec<String> {
        self.client.list_database_names().await.unwrap_or_default()
    }

    /// Drops the whole database. For tests and benchmarks only.
    pub async fn drop_database(&self) -> Result<(), StoreError> {
        self.db.drop().await.map_err(StoreError::from)
    }

    pub(crate) fn collection(&self, name: &str) -> Collection<bson::Document> {
        self.db.collection(name)
    }

    pub(crate) fn typed<T: Send + Sync>(&self, name: &str) -> Collection<T> {
        self.db.collection(name)
    }

    /// The documents of `collection` whose `field` is one of `values`, in
    /// one query and one reply (every caller's `field` is unique); none
    /// (and no query) for an empty list.
    pub(crate) async fn find_in<T>(
        &self,
        collection: &str,
        field: &str,
        values: &[&str],
    ) -> Result<Vec<T>, StoreError>
    where
        T: serde::de::DeserializeOwned + Send + Sync + Unpin,
    {
        if values.is_empty() {
            return Ok(Vec::new());
        }
        use futures::TryStreamExt;
        Ok(self
            .typed::<T>(collection)
            .find(bson::doc! {field: {"$in": values}})
            .batch_size(one_batch_for(values.len()))
            .await?
            .try_collect()
            .await?)
    }
}

/// The write concern for every write that decides or records ownership: a
/// majority of the replica set, journaled. An acknowledged grant survives a
/// crash of any single server.
pub fn durable() -> WriteConcern {
    WriteConcern::builder()
        .w(Acknowledgment::Majority)
        .journal(true)
        .build()
}

/// The write concern for bookkeeping that a crash may lose without harm
/// (a mark that stops a re-send, a copy of what a journaled write already
/// says): acknowledged by the primary alone, not waiting for the journal,
/// which the next journaled write or group commit flushes.
pub(crate) fn bookkeeping() -> WriteConcern {
    WriteConcern::builder()
        .w(Acknowledgment::Nodes(1))
        .journal(false)
        .build()
}

/// `durable()` as the document form used inside raw commands.
pub(crate) fn durable_doc() -> bson::Document {
    bson::doc! {"w": "majority", "j": true}
}

/// A first batch that holds every one of at most `most` replies, and one
/// more, so the server ends the cursor in its first reply. A find's default
/// first batch is 101 documents, and a batch filled exactly leaves the
/// cursor open: either way the caller pays a getMore round trip (on the
/// claim path, once per full batch of 256).
pub(crate) fn one_batch_for(most: usize) -> u32 {
    u32::try_from(most.saturating_add(1)).unwrap_or(u32::MAX)
}
