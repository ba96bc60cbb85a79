//! Configuration, by flag or environment, loaded once into one typed struct.

use std::path::PathBuf;

use clap::Args;

/// Where codepool's servers are and how its names are scoped.
#[derive(Debug, Clone, Args)]
pub struct Config {
    /// MongoDB connection string (the source of truth).
    #[arg(
        long,
        env = "CODEPOOL_MONGODB_URI",
        hide_env_values = true,
        default_value = "mongodb://127.0.0.1:27017/?directConnection=true",
        global = true,
        help_heading = "Connection"
    )]
    pub mongodb_uri: String,

    /// MongoDB database name.
    #[arg(
        long,
        env = "CODEPOOL_DB",
        default_value = "codepool",
        global = true,
        help_heading = "Connection"
    )]
    pub db: String,

    /// Redis URL (hot pool, grant-number counters; never the truth). A
    /// comma-separated list of URLs means a Redis Cluster reached through
    /// any of them.
    #[arg(
        long,
        env = "CODEPOOL_REDIS_URL",
        hide_env_values = true,
        default_value = "redis://127.0.0.1:6379",
        global = true,
        help_heading = "Connection"
    )]
    pub redis_url: String,

    /// Prefix of every Redis key, so several deployments can share a Redis.
    #[arg(
        long,
        env = "CODEPOOL_REDIS_PREFIX",
        default_value = "codepool",
        global = true,
        help_heading = "Connection"
    )]
    pub redis_prefix: String,

    /// AMQP URL of RabbitMQ; the vhost is the URL's path (%2f is "/"). A
    /// comma-separated list names the nodes of a cluster: codepool connects
    /// to the first that answers and fails over to the others.
    #[arg(
        long,
        env = "CODEPOOL_AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        global = true,
        help_heading = "Connection"
    )]
    pub amqp_url: String,

    /// Prefix of every queue and exchange name (empty in production; tests
    /// use it so that runs never share queues).
    #[arg(
        long,
        env = "CODEPOOL_AMQP_PREFIX",
        default_value = "",
        global = true,
        help_heading = "Connection"
    )]
    pub amqp_prefix: String,

    /// Broker users of the operator, besides codepool's own (the user of
    /// CODEPOOL_AMQP_URL), comma separated: only they publish purchases
    /// that name no shop, and only their messages may carry a replay's
    /// record of who first published a purchase. Never a shop's broker
    /// user (a shop's purchases name their shop).
    #[arg(
        long,
        env = "CODEPOOL_OPERATOR_BROKER_USERS",
        value_delimiter = ',',
        value_name = "USERS",
        global = true,
        help_heading = "Connection"
    )]
    pub operator_broker_users: Vec<String>,

    /// Webhook hosts let through whatever their address or scheme (a
    /// comma-separated list, for development: a receiver on 127.0.0.1 or
    /// over plain http). Read once, here.
    #[arg(
        long,
        env = "CODEPOOL_WEBHOOK_ALLOW_HOSTS",
        default_value = "",
        hide_default_value = true,
        global = true,
        help_heading = "Webhooks"
    )]
    pub webhook_allow_hosts: String,

    /// Type of the queues codepool declares: quorum (replicated, with a
    /// delivery limit) or classic (single node, as before). A queue keeps
    /// the type it was created with.
    #[arg(
        long,
        env = "CODEPOOL_QUEUE_TYPE",
        default_value = "quorum",
        value_parser = ["quorum", "classic"],
        global = true,
        help_heading = "Connection"
    )]
    pub queue_type: String,

    /// Quorum queues: deliveries of one purchase without an ack before it
    /// goes to purchases.dead with reason delivery_limit.
    #[arg(
        long,
        env = "CODEPOOL_DELIVERY_LIMIT",
        default_value_t = codepool_broker::DEFAULT_DELIVERY_LIMIT,
        value_parser = clap::value_parser!(u32).range(1..),
        global = true,
        help_heading = "Connection"
    )]
    pub delivery_limit: u32,
    /// Queues purchases are spread over by pool: 1 is the one queue
    /// `purchases`; N > 1 the queues purchases.0 … purchases.{N-1}, each
    /// taken by one dispatcher at a time. The same on every codepool
    /// process of a deployment; see docs/scaling.md (Partitions) to change it.
    #[arg(
        long,
        env = "CODEPOOL_PARTITIONS",
        default_value_t = 1,
        value_parser = clap::value_parser!(u16).range(1..=i64::from(codepool_broker::MAX_PARTITIONS)),
        global = true,
        help_heading = "Connection"
    )]
    pub partitions: u16,
    /// Key file that encrypts codes at rest [default: ~/.config/codepool/keys.json].
    /// Back it up: losing it loses the codes.
    #[arg(
        long,
        env = "CODEPOOL_KEY_FILE",
        value_name = "FILE",
        global = true,
        help_heading = "Connection"
    )]
    pub key_file: Option<PathBuf>,

    /// Log format on stderr.
    #[arg(
        long,
        env = "CODEPOOL_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true,
        help_heading = "Connection"
    )]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

impl Config {
    /// The webhook hosts let through whatever their address.
    pub fn allow_hosts(&self) -> codepool_issuance::webhooks::guard::AllowHosts {
        codepool_issuance::webhooks::guard::AllowHosts::parse(&self.webhook_allow_hosts)
    }

    /// The key file: `--key-file`, `CODEPOOL_KEY_FILE`, or the default
    /// under the user's configuration directory.
    pub fn key_path(&self) -> PathBuf {
        self.key_file
            .clone()
            .unwrap_or_else(codepool_vault::keyfile::default_path)
    }

    /// The operator's broker users: codepool's own (the user of
    /// `--amqp-url`) and `--operator-broker-users`.
    pub fn operator_users(&self) -> Vec<String> {
        codepool_broker::operator_users(&self.amqp_url, &self.operator_broker_users)
    }

    pub fn topology(&self) -> codepool_broker::Topology {
        let mut topology = codepool_broker::Topology::with_prefix(&self.amqp_prefix);
        topology.queues = codepool_broker::QueueSettings {
            // the value parser admits only the two names
            queue_type: self.queue_type.parse().unwrap_or_default(),
            delivery_limit: self.delivery_limit,
        };
        topology.with_partitions(self.partitions)
    }
}
