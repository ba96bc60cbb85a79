//! `codepool-bench`: side-by-side benchmarks, kept out of the product
//! binary. `make bench` (scripts/bench.sh) runs every one of them.

use std::process::ExitCode;

use clap::Parser;
use codepool::config::Config;
use codepool::exit;

const EXAMPLES: &str = "\
Examples:
  codepool-bench claim --concurrency 1,8,32 --codes 20000
  codepool-bench dispatch --purchases 20000
  codepool-bench dispatch --pools 1000 --spread zipf
  codepool-bench dispatch --pool-size 10000000
  codepool-bench dispatch --compare-partitions 2 --purchases 20000
  codepool-bench latency --rate 100,1000 --seconds 10
  codepool-bench import --codes 200000
  codepool-bench generate --codes 1000000
  codepool-bench seq --ids 4000
  codepool-bench api --orders 20000 --clients 64 --rate 1000 --seconds 10
  codepool-bench channels --rate 200 --http-rate 100 --seconds 10

Each benchmark compares approaches in one run and writes JSON under
target/bench/ (or --out-dir). `make bench` runs them all.";

/// Side-by-side benchmarks of codepool against its baselines.
#[derive(Debug, Parser)]
#[command(name = "codepool-bench", version, about, after_help = EXAMPLES)]
struct Cli {
    #[command(flatten)]
    config: Config,
    #[command(flatten)]
    bench: codepool_bench::BenchArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    codepool::telemetry::init(cli.config.log_format);
    exit::run_to_exit(codepool_bench::run(&cli.config, cli.bench))
}
