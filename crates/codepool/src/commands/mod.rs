//! One module per subcommand.

pub mod dispatch;
pub mod import;
pub mod lookup;
pub mod migrate;
pub mod publish;
pub mod seq;
pub mod stats;
