//! # codepool-redis
//!
//! codepool reaches Redis through one setting, `CODEPOOL_REDIS_URL`, which
//! holds one URL (one server) or a comma-separated list (the seed nodes of a
//! Redis Cluster). This crate turns that setting into a [`RedisTarget`] and
//! hands out a [`RedisConnection`] that runs commands, pipelines and scripts
//! the same way on both, so the hot pool and the daily counters are written
//! once.
//!
//! On a cluster every multi-key command, pipeline and script must stay in one
//! hash slot: codepool's keys of one pool (or one number prefix) share a hash
//! tag, `codepool:{game-x}:hot`, for that reason.

use std::time::Duration;

use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{AsyncConnectionConfig, Cmd, Pipeline, RedisFuture, RedisResult, Value};

/// Retries of one command inside the cluster client (redirects after a slot
/// moved, a reconnect after a node failed over). Kept low: codepool's callers
/// have their own deadline and a MongoDB fallback.
const CLUSTER_RETRIES: u32 = 2;

/// Where Redis is: one server, or the seed nodes of a Redis Cluster.
#[derive(Clone)]
pub enum RedisTarget {
    Server(redis::Client),
    Cluster(ClusterClient),
}

impl std::fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RedisTarget::Server(_) => f.write_str("RedisTarget::Server"),
            RedisTarget::Cluster(_) => f.write_str("RedisTarget::Cluster"),
        }
    }
}

/// The URLs in a comma-separated setting, trimmed, empty entries dropped.
pub fn split_urls(urls: &str) -> Vec<&str> {
    urls.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

impl RedisTarget {
    /// One URL: one server. Several (comma-separated): a Redis Cluster
    /// reached through any of them. `timeout` bounds a cluster connect and
    /// every cluster reply; a single server takes its timeouts per connection.
    pub fn open(urls: &str, timeout: Duration) -> RedisResult<Self> {
        match split_urls(urls).as_slice() {
            [] => Err((redis::ErrorKind::InvalidClientConfig, "no Redis URL given").into()),
            [one] => Ok(RedisTarget::Server(redis::Client::open(*one)?)),
            seeds => Ok(RedisTarget::Cluster(
                ClusterClient::builder(seeds.to_vec())
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    .retries(CLUSTER_RETRIES)
                    .min_retry_wait(10)
                    .max_retry_wait(100)
                    .build()?,
            )),
        }
    }

    /// True for a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisTarget::Cluster(_))
    }

    /// A self-reconnecting connection: a [`ConnectionManager`] with `config`
    /// on one server, the cluster connection (which reconnects by itself) on
    /// a cluster.
    pub async fn connection_manager(
        &self,
        config: ConnectionManagerConfig,
    ) -> RedisResult<RedisConnection> {
        match self {
            RedisTarget::Server(client) => Ok(RedisConnection::Managed(
                client.get_connection_manager_with_config(config).await?,
            )),
            RedisTarget::Cluster(client) => Ok(RedisConnection::Cluster(
                client.get_async_connection().await?,
            )),
        }
    }

    /// A plain multiplexed connection with `config` on one server (it does
    /// not reconnect: the caller drops it on error), the cluster connection
    /// on a cluster.
    pub async fn multiplexed(
        &self,
        config: &AsyncConnectionConfig,
    ) -> RedisResult<RedisConnection> {
        match self {
            RedisTarget::Server(client) => Ok(RedisConnection::Multiplexed(
                client
                    .get_multiplexed_async_connection_with_config(config)
                    .await?,
            )),
            RedisTarget::Cluster(client) => Ok(RedisConnection::Cluster(
                client.get_async_connection().await?,
            )),
        }
    }
}

/// A connection to one server or to a cluster; cheap to clone (all
/// variants multiplex over shared sockets).
#[derive(Clone)]
pub enum RedisConnection {
    Managed(ConnectionManager),
    Multiplexed(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConnection::Managed(c) => c.req_packed_command(cmd),
            RedisConnection::Multiplexed(c) => c.req_packed_command(cmd),
            RedisConnection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConnection::Managed(c) => c.req_packed_commands(cmd, offset, count),
            RedisConnection::Multiplexed(c) => c.req_packed_commands(cmd, offset, count),
            RedisConnection::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConnection::Managed(c) => c.get_db(),
            RedisConnection::Multiplexed(c) => c.get_db(),
            RedisConnection::Cluster(c) => c.get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_url_is_a_server_and_several_are_a_cluster() {
        let t = Duration::from_millis(500);
        assert!(!RedisTarget::open("redis://127.0.0.1:6379", t)
            .unwrap()
            .is_cluster());
        assert!(!RedisTarget::open(" redis://127.0.0.1:6379 ,", t)
            .unwrap()
            .is_cluster());
        let cluster = "redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003";
        assert!(RedisTarget::open(cluster, t).unwrap().is_cluster());
        assert!(RedisTarget::open("", t).is_err());
        assert!(RedisTarget::open("not a url", t).is_err());
    }
}
