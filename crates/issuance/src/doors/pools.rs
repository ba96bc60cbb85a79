//! Pools as the doors read and change them: pages of pools and their
//! stock, one pool, its stock chart's numbers, its import runs; create,
//! settings, pause and resume, recall, uploads and generation runs,
//! statements, dead letters replayed.

use std::ops::ControlFlow;

use crate::audit::Actor;
use crate::controls::{self, PauseError, Recall, RecallError, ReplayError};
use crate::generations::{self, GenerateError, Generation};
use crate::imports::{self, ImportError, ImportOptions, Uploaded};
use crate::model::{ImportRecord, ObjectId, PoolDoc, PoolSettings, PoolStats};
use crate::statements::{self, Asked, Statement, StatementError, StatementLine};
use crate::{Core, StoreError};

impl Core {
    /// Up to `limit` pools by name, after `after`.
    pub async fn pools_page(
        &self,
        after: Option<&str>,
        limit: i64,
    ) -> Result<Vec<PoolDoc>, StoreError> {
        self.store().pools_page(after, limit).await
    }

    /// Up to `limit` pools by name, after `after`, among `only` when given.
    pub async fn pools_page_of(
        &self,
        after: Option<&str>,
        limit: i64,
        only: Option<&[String]>,
    ) -> Result<Vec<PoolDoc>, StoreError> {
        self.store().pools_page_of(after, limit, only).await
    }

    /// One pool.
    pub async fn pool(&self, name: &str) -> Result<Option<PoolDoc>, StoreError> {
        self.store().pool(name).await
    }

    /// The stock of each pool named, as `codepool stats` counts it.
    pub async fn stats_of(&self, pools: &[&str]) -> Result<Vec<PoolStats>, StoreError> {
        self.store().stats_of(pools).await
    }

    /// The codes of `pool` in stock now.
    pub async fn unissued_stock(&self, pool: &str) -> Result<u64, StoreError> {
        self.store().unissued_stock(pool).await
    }

    /// The codes of `pool` granted each hour since `since`.
    pub async fn grants_by_hour(
        &self,
        pool: &str,
        since: bson::DateTime,
    ) -> Result<Vec<(bson::DateTime, u64)>, StoreError> {
        self.store().grants_by_hour(pool, since).await
    }

    /// The latest `limit` import runs of `pool`, newest first.
    pub async fn imports_of(
        &self,
        pool: &str,
        limit: i64,
    ) -> Result<Vec<ImportRecord>, StoreError> {
        self.store().imports_of(pool, limit).await
    }

    /// One import or generation run.
    pub async fn import_record(&self, id: ObjectId) -> Result<Option<ImportRecord>, StoreError> {
        self.store().import_record(id).await
    }

    /// Creates a pool ([`controls::create_pool`]); whether it is new.
    pub async fn create_pool(&self, pool: &str, actor: &Actor) -> Result<bool, StoreError> {
        controls::create_pool(self.store(), pool, actor).await
    }

    /// Changes a pool's settings ([`controls::set_pool_settings`]).
    pub async fn set_pool_settings(
        &self,
        pool: &str,
        settings: &PoolSettings,
        what: &str,
        actor: &Actor,
    ) -> Result<(), PauseError> {
        controls::set_pool_settings(self.store(), pool, settings, what, actor).await
    }

    /// Pauses or resumes a pool, announced on the broker in use
    /// ([`controls::set_paused`]); whether it changed.
    pub async fn set_paused(
        &self,
        pool: &str,
        paused: bool,
        actor: &Actor,
    ) -> Result<bool, PauseError> {
        let broker = self.broker();
        controls::set_paused(self.store(), &broker.publisher, pool, paused, actor).await
    }

    /// Recalls an import's unissued codes ([`controls::recall_import`]);
    /// they leave the hot pool too.
    pub async fn recall_import(
        &self,
        import_id: &str,
        reason: &str,
        actor: &Actor,
    ) -> Result<Recall, RecallError> {
        controls::recall_import(self.store(), self.hot().as_ref(), import_id, reason, actor).await
    }

    /// Imports an uploaded CSV into `pool` ([`imports::upload`]), announced
    /// on the broker in use.
    pub async fn upload<R: std::io::Read + Send + 'static>(
        &self,
        input: R,
        name: &str,
        pool: &str,
        options: &ImportOptions,
        actor: &Actor,
    ) -> Result<Uploaded, ImportError> {
        let broker = self.broker();
        imports::upload(
            self.store(),
            &broker.publisher,
            input,
            name,
            pool,
            options,
            actor,
        )
        .await
    }

    /// Starts generation run `g` ([`generations::start`]); its id, and
    /// whether an unfinished run was taken up.
    pub async fn start_generation(
        &self,
        g: Generation,
        actor: Actor,
    ) -> Result<(ObjectId, bool), GenerateError> {
        let publisher = self.broker().publisher;
        generations::start(self.store(), publisher, g, actor).await
    }

    /// The statement `a` asks for ([`statements::statement`]).
    pub async fn statement(&self, a: &Asked) -> Result<Statement, StatementError> {
        statements::statement(self.store(), a).await
    }

    /// Every move of the period `a` asks for, to `each` until it breaks
    /// ([`statements::lines`]); how many it got.
    pub async fn statement_lines(
        &self,
        a: &Asked,
        each: &mut (dyn FnMut(StatementLine) -> ControlFlow<()> + Send),
    ) -> Result<u64, StatementError> {
        statements::lines(self.store(), a, each).await
    }

    /// Sends dead letters back to the purchases queue on the broker in use
    /// ([`controls::replay_dead_letters`]).
    pub async fn replay_dead_letters(
        &self,
        reason: Option<&str>,
        limit: usize,
        actor: &Actor,
    ) -> Result<codepool_broker::dead_letters::Replayed, ReplayError> {
        let broker = self.broker();
        controls::replay_dead_letters(
            self.store(),
            &broker.conn,
            &broker.publisher,
            reason,
            limit,
            &self.parts().operator_broker_users,
            actor,
        )
        .await
    }
}
