//! The schema: numbered SQL files from `migrations/` (tables and data), then
//! `migrations/functions.sql` (every SQL function, each defined once), embedded in the binary
//! and applied in one transaction under an advisory lock, so that instances starting at once
//! apply them once. The functions are re-applied whenever their digest differs from the one
//! the database last applied. A schema newer than the binary is refused.

use super::rows::db;
use super::PostgresStore;
use crate::budget::StoreError;

/// The schema's migrations, in order, embedded in the binary.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "budgets",
        include_str!("../../../migrations/0001_budgets.sql"),
    ),
    (
        2,
        "instances",
        include_str!("../../../migrations/0002_instances.sql"),
    ),
    (
        3,
        "classes",
        include_str!("../../../migrations/0003_classes.sql"),
    ),
    (
        4,
        "vendor",
        include_str!("../../../migrations/0004_vendor.sql"),
    ),
    (
        5,
        "shares",
        include_str!("../../../migrations/0005_shares.sql"),
    ),
    (
        6,
        "claims",
        include_str!("../../../migrations/0006_claims.sql"),
    ),
    (
        7,
        "rules",
        include_str!("../../../migrations/0007_rules.sql"),
    ),
    (
        8,
        "batches",
        include_str!("../../../migrations/0008_batches.sql"),
    ),
    (
        9,
        "functions",
        include_str!("../../../migrations/0009_functions.sql"),
    ),
    (
        10,
        "waiting_lease",
        include_str!("../../../migrations/0010_waiting_lease.sql"),
    ),
    (
        11,
        "key_secret",
        include_str!("../../../migrations/0011_key_secret.sql"),
    ),
    (
        12,
        "instance_lease",
        include_str!("../../../migrations/0012_instance_lease.sql"),
    ),
    (
        13,
        "last_slot",
        include_str!("../../../migrations/0013_last_slot.sql"),
    ),
];

/// Every SQL function of the store, each defined once, re-applied by every migration whose
/// database holds another digest of them.
const FUNCTIONS: &str = include_str!("../../../migrations/functions.sql");

/// The digest of [`FUNCTIONS`] as `pacegate_schema_functions` keeps it: the SHA-256, in hex.
fn functions_digest() -> String {
    hex::encode(ring::digest::digest(
        &ring::digest::SHA256,
        FUNCTIONS.as_bytes(),
    ))
}

const FUNCTIONS_DIGEST: &str = "SELECT digest FROM pacegate_schema_functions";

/// Serialises migrations of every instance that starts at once (`pg_advisory_xact_lock` key).
const MIGRATION_LOCK: i64 = 0x7061_6365_6761_7465; // "pacegate"

const CREATE_MIGRATIONS_TABLE: &str = "CREATE TABLE IF NOT EXISTS pacegate_schema_migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now())";
impl PostgresStore {
    /// Applies the embedded migrations that the database lacks, under an advisory lock, in
    /// one transaction. Refuses a database whose schema is newer than this binary. Returns
    /// the versions applied.
    pub async fn migrate(&self) -> Result<Vec<i32>, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(db)?;
        tx.batch_execute(CREATE_MIGRATIONS_TABLE)
            .await
            .map_err(db)?;
        let applied: Vec<i32> = tx
            .query("SELECT version FROM pacegate_schema_migrations", &[])
            .await
            .map_err(db)?
            .iter()
            .map(|r| r.get(0))
            .collect();
        check_not_newer(&applied)?;
        let mut done = Vec::new();
        for (version, name, sql) in MIGRATIONS {
            if applied.contains(version) {
                continue;
            }
            tx.batch_execute(sql).await.map_err(|e| {
                StoreError::Schema(format!("migration {version} ({name}) failed: {}", db(e)))
            })?;
            tx.execute(
                "INSERT INTO pacegate_schema_migrations (version, name) VALUES ($1, $2)",
                &[version, name],
            )
            .await
            .map_err(db)?;
            done.push(*version);
        }
        let digest = functions_digest();
        let current = tx
            .query_opt(FUNCTIONS_DIGEST, &[])
            .await
            .map_err(db)?
            .map(|r| r.get::<_, String>(0));
        if current.as_deref() != Some(digest.as_str()) {
            tx.batch_execute(FUNCTIONS).await.map_err(|e| {
                StoreError::Schema(format!("the store's functions failed: {}", db(e)))
            })?;
            tx.batch_execute("DELETE FROM pacegate_schema_functions")
                .await
                .map_err(db)?;
            tx.execute(
                "INSERT INTO pacegate_schema_functions (digest) VALUES ($1)",
                &[&digest],
            )
            .await
            .map_err(db)?;
        }
        tx.commit().await.map_err(db)?;
        Ok(done)
    }

    /// Checks that the schema is exactly the one this binary knows (for `migrate = false`).
    pub async fn check_schema(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        let applied: Vec<i32> = match client
            .rows("SELECT version FROM pacegate_schema_migrations", &[])
            .await
        {
            Ok(rows) => rows.iter().map(|r| r.get(0)).collect(),
            Err(_) => Vec::new(),
        };
        check_not_newer(&applied)?;
        if let Some((missing, _, _)) = MIGRATIONS.iter().find(|(v, _, _)| !applied.contains(v)) {
            return Err(StoreError::Schema(format!(
                "the store's schema lacks migration {missing}: run `pacegate migrate --store URL` or set [store] migrate = true"
            )));
        }
        let current = client
            .opt(FUNCTIONS_DIGEST, &[])
            .await?
            .map(|r| r.get::<_, String>(0));
        if current != Some(functions_digest()) {
            return Err(StoreError::Schema(
                "the store's SQL functions are not this binary's: run `pacegate migrate --store URL` or set [store] migrate = true".into(),
            ));
        }
        Ok(())
    }
}

fn check_not_newer(applied: &[i32]) -> Result<(), StoreError> {
    let known = MIGRATIONS.last().map_or(0, |m| m.0);
    match applied.iter().max() {
        Some(newest) if *newest > known => Err(StoreError::Schema(format!(
            "the store's schema is at version {newest}, newer than this pacegate binary knows ({known}); upgrade pacegate"
        ))),
        _ => Ok(()),
    }
}
