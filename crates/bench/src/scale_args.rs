//! The flags of the scale variants of `dispatch` (`--pools`, `--pool-size`,
//! `--cold`), apart from the runs themselves so that `dispatch` and `scale`
//! do not import each other.

/// How purchases are spread over the pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Spread {
    Uniform,
    /// Zipf with exponent 1.1: pool k gets demand ∝ 1 / k^1.1.
    Zipf,
}

/// The scale variants of `dispatch`.
#[derive(Debug, Clone, clap::Args)]
pub struct ScaleArgs {
    /// Spread the purchases over this many pools and compare with one pool.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub pools: Option<u32>,
    /// How demand is spread over `--pools`.
    #[arg(long, value_enum, default_value_t = Spread::Uniform)]
    pub spread: Spread,
    /// Compare a pool of this many codes with a pool just large enough.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1_000..=100_000_000))]
    pub pool_size: Option<u64>,
    /// The cold many-pool case of issue 47: pools of `--codes-per-pool`
    /// codes, one pool of as many in all, clock stopped at the last code
    /// issued.
    #[arg(long, requires = "pools")]
    pub cold: bool,
    /// Codes in each pool with `--cold`.
    #[arg(long, default_value_t = 125, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub codes_per_pool: u64,
    /// Compare orders of no shop with the same orders of a shop whose
    /// this many webhook endpoints are subscribed to every event (issue
    /// 45: webhooks must not slow grants).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_000))]
    pub webhook_endpoints: Option<u32>,
    /// Compare this many purchase partitions with the one queue, two
    /// dispatchers on each side, purchases over eight pools
    /// (`partitions.rs`).
    #[arg(long, value_parser = clap::value_parser!(u16).range(2..=64))]
    pub compare_partitions: Option<u16>,
    /// Alternate the two sides this many times and judge the median ratio.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=9))]
    pub rounds: u32,
}

impl ScaleArgs {
    pub fn is_scale_run(&self) -> bool {
        self.pools.is_some_and(|p| p > 1)
            || self.pool_size.is_some()
            || self.webhook_endpoints.is_some()
    }
}
