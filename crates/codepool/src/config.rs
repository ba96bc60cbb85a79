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
        global = true
    )]
    pub mongodb_uri: String,

    /// MongoDB database name.
    #[arg(long, env = "CODEPOOL_DB", default_value = "codepool", global = true)]
    pub db: String,

    /// Redis URL (hot pool, grant-number counters; never the truth).
    #[arg(
        long,
        env = "CODEPOOL_REDIS_URL",
        hide_env_values = true,
        default_value = "redis://127.0.0.1:6379",
        global = true
    )]
    pub redis_url: String,

    /// Prefix of every Redis key, so several deployments can share a Redis.
    #[arg(
        long,
        env = "CODEPOOL_REDIS_PREFIX",
        default_value = "codepool",
        global = true
    )]
    pub redis_prefix: String,

    /// AMQP URL of RabbitMQ; the vhost is the URL's path (%2f is "/").
    #[arg(
        long,
        env = "CODEPOOL_AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        global = true
    )]
    pub amqp_url: String,

    /// Prefix of every queue and exchange name (empty in production; tests
    /// use it so that runs never share queues).
    #[arg(long, env = "CODEPOOL_AMQP_PREFIX", default_value = "", global = true)]
    pub amqp_prefix: String,

    /// Key file that encrypts codes at rest [default: ~/.config/codepool/keys.json].
    /// Back it up: losing it loses the codes.
    #[arg(long, env = "CODEPOOL_KEY_FILE", value_name = "FILE", global = true)]
    pub key_file: Option<PathBuf>,

    /// Log format on stderr.
    #[arg(
        long,
        env = "CODEPOOL_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

impl Config {
    /// The key file: `--key-file`, `CODEPOOL_KEY_FILE`, or the default
    /// under the user's configuration directory.
    pub fn key_path(&self) -> PathBuf {
        self.key_file
            .clone()
            .unwrap_or_else(codepool_vault::keyfile::default_path)
    }

    pub fn topology(&self) -> codepool_broker::Topology {
        codepool_broker::Topology::with_prefix(&self.amqp_prefix)
    }
}
