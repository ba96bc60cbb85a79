//! Applies the ordered files in `migrations/`: index and validator
//! definitions (and the odd idempotent data update) as MongoDB commands. Each file is applied once and recorded
//! in `_migrations`; applying again is harmless because every command in
//! them is idempotent, so several processes may migrate at the same time.

use bson::{doc, Bson, Document};
use tracing::info;

use crate::{Store, StoreError};

/// The migration files, compiled into the binary so `codepool` runs from
/// any directory. Order is the order of application.
pub const MIGRATIONS: &[(&str, &str)] = &[
    (
        "0001_codes_indexes",
        include_str!("../../../migrations/0001_codes_indexes.json"),
    ),
    (
        "0002_backorders_indexes",
        include_str!("../../../migrations/0002_backorders_indexes.json"),
    ),
    (
        "0003_codes_validator",
        include_str!("../../../migrations/0003_codes_validator.json"),
    ),
    (
        "0004_codes_expiry_index",
        include_str!("../../../migrations/0004_codes_expiry_index.json"),
    ),
    (
        "0005_backorders_fifo_index",
        include_str!("../../../migrations/0005_backorders_fifo_index.json"),
    ),
    (
        "0006_policies_indexes",
        include_str!("../../../migrations/0006_policies_indexes.json"),
    ),
    (
        "0007_codes_encrypted",
        include_str!("../../../migrations/0007_codes_encrypted.json"),
    ),
    (
        "0008_code_ranges",
        include_str!("../../../migrations/0008_code_ranges.json"),
    ),
    (
        "0009_codes_grant_time_index",
        include_str!("../../../migrations/0009_codes_grant_time_index.json"),
    ),
    (
        "0010_codes_batch_index",
        include_str!("../../../migrations/0010_codes_batch_index.json"),
    ),
    (
        "0011_codes_lookalike_index",
        include_str!("../../../migrations/0011_codes_lookalike_index.json"),
    ),
    (
        "0012_codes_order_lines",
        include_str!("../../../migrations/0012_codes_order_lines.json"),
    ),
    (
        "0013_console",
        include_str!("../../../migrations/0013_console.json"),
    ),
    (
        "0014_codes_any_pool_index",
        include_str!("../../../migrations/0014_codes_any_pool_index.json"),
    ),
    (
        "0015_webhooks",
        include_str!("../../../migrations/0015_webhooks.json"),
    ),
    (
        "0016_holds",
        include_str!("../../../migrations/0016_holds.json"),
    ),
    (
        "0017_hold_caps",
        include_str!("../../../migrations/0017_hold_caps.json"),
    ),
    (
        "0018_shop_names",
        include_str!("../../../migrations/0018_shop_names.json"),
    ),
    (
        "0019_codes_grants_by_status",
        include_str!("../../../migrations/0019_codes_grants_by_status.json"),
    ),
    (
        "0020_holds_by_owner",
        include_str!("../../../migrations/0020_holds_by_owner.json"),
    ),
    (
        "0021_webhook_tasks_by_endpoint",
        include_str!("../../../migrations/0021_webhook_tasks_by_endpoint.json"),
    ),
    (
        "0022_replacements",
        include_str!("../../../migrations/0022_replacements.json"),
    ),
    (
        "0023_redemptions",
        include_str!("../../../migrations/0023_redemptions.json"),
    ),
    (
        "0024_sms_owed",
        include_str!("../../../migrations/0024_sms_owed.json"),
    ),
    (
        "0025_code_claims",
        include_str!("../../../migrations/0025_code_claims.json"),
    ),
    (
        "0026_channels",
        include_str!("../../../migrations/0026_channels.json"),
    ),
    (
        "0027_holds_voided_codes",
        include_str!("../../../migrations/0027_holds_voided_codes.json"),
    ),
    (
        "0028_replacement_ids_per_owner",
        include_str!("../../../migrations/0028_replacement_ids_per_owner.json"),
    ),
    (
        "0029_shard_ready",
        include_str!("../../../migrations/0029_shard_ready.json"),
    ),
    (
        "0030_kinguin_uploads",
        include_str!("../../../migrations/0030_kinguin_uploads.json"),
    ),
    // 0029 made the order-line guard start with the pool (a shard key
    // prefix), which left reads of an order's codes by its id (the
    // redelivery read-back, the relay, the order views) with no index.
    (
        "0031_codes_by_order",
        include_str!("../../../migrations/0031_codes_by_order.json"),
    ),
    (
        "0032_channel_outcomes",
        include_str!("../../../migrations/0032_channel_outcomes.json"),
    ),
];

/// What a migration run did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    pub applied: Vec<String>,
    pub already_applied: Vec<String>,
}

/// Where the database's schema stands against this binary's migrations.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SchemaState {
    /// Migrations this binary knows that the database has not had.
    pub pending: Vec<String>,
    /// Migrations the database has had that this binary does not know: a
    /// newer codepool migrated it.
    pub unknown: Vec<String>,
}

/// Reads where the schema stands, changing nothing (for commands that only
/// read, or change data, but never migrate).
pub async fn schema_state(store: &Store) -> Result<SchemaState, StoreError> {
    let applied: Vec<String> = store
        .collection("_migrations")
        .distinct("_id", doc! {})
        .await?
        .into_iter()
        .filter_map(|b| b.as_str().map(str::to_owned))
        .collect();
    let steps: Vec<&str> = MIGRATIONS.iter().map(|(n, _)| *n).collect();
    // Records of data steps this binary runs itself (not files of
    // migrations/), such as the look-alike backfill, are known too.
    let known: Vec<&str> = (steps.iter().copied())
        .chain([
            crate::lookalikes::BACKFILL_DONE,
            crate::claims::CLAIMS_BACKFILL,
        ])
        .collect();
    Ok(SchemaState {
        pending: (steps.iter())
            .filter(|n| !applied.iter().any(|a| a == *n))
            .map(|n| (*n).to_owned())
            .collect(),
        unknown: (applied.into_iter())
            .filter(|a| !known.contains(&a.as_str()))
            .collect(),
    })
}

/// Applies every migration not yet recorded. Safe to call at every start.
/// Refuses a database a newer codepool migrated: this binary does not know
/// its schema.
pub async fn migrate(store: &Store) -> Result<MigrationReport, StoreError> {
    let newer = schema_state(store).await?.unknown;
    if let Some(first) = newer.first() {
        return Err(StoreError::Migration {
            name: first.clone(),
            message: format!(
                "the database was migrated by a newer codepool ({} migration(s) this binary does not know: {}); run the codepool binary that applied them, or a newer one",
                newer.len(),
                newer.join(", ")
            ),
        });
    }
    let log = store.collection("_migrations");
    let mut report = MigrationReport::default();
    for (name, text) in MIGRATIONS {
        if log.find_one(doc! {"_id": *name}).await?.is_some() {
            report.already_applied.push((*name).to_owned());
            continue;
        }
        for command in parse(name, text)? {
            if let Err(e) = store.database().run_command(command).await {
                if already_done(&e) {
                    // Another process applied this step a moment ago.
                    continue;
                }
                let err = StoreError::from(e);
                if err.is_unavailable() {
                    return Err(err);
                }
                return Err(StoreError::Migration {
                    name: (*name).to_owned(),
                    message: err.to_string(),
                });
            }
        }
        let record = doc! {"_id": *name, "applied_at": bson::DateTime::now()};
        match log.insert_one(record).await {
            Ok(_) => {}
            Err(e) if crate::error::is_duplicate_key(&e) => {}
            Err(e) => return Err(e.into()),
        }
        info!(migration = name, "applied migration");
        report.applied.push((*name).to_owned());
    }
    store.settle_claims_backfill().await?;
    Ok(report)
}

/// Errors that mean the step's effect is already in place: an index that
/// was already dropped (27) or a collection that already exists (48).
fn already_done(e: &mongodb::error::Error) -> bool {
    matches!(e.kind.as_ref(), mongodb::error::ErrorKind::Command(c) if c.code == 27 || c.code == 48)
}

fn parse(name: &str, text: &str) -> Result<Vec<Document>, StoreError> {
    let bad = |message: String| StoreError::Migration {
        name: name.to_owned(),
        message,
    };
    let json: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let bson = Bson::try_from(json).map_err(|e| bad(format!("not extended JSON: {e}")))?;
    let Bson::Array(items) = bson else {
        return Err(bad("must be a JSON array of commands".into()));
    };
    items
        .into_iter()
        .map(|item| match item {
            Bson::Document(d) => Ok(d),
            other => Err(bad(format!(
                "each command must be an object, found {other}"
            ))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_migration_file_parses_into_commands() {
        for (name, text) in MIGRATIONS {
            let commands = parse(name, text).unwrap();
            assert!(!commands.is_empty(), "{name} has no commands");
        }
    }

    #[test]
    fn small_integers_stay_32_bit_so_validators_match_int_fields() {
        let cmds = parse("t", r#"[{"collMod":"codes","x":1}]"#).unwrap();
        assert_eq!(cmds[0].get("x"), Some(&Bson::Int32(1)));
    }
}
