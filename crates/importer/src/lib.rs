//! # codepool-importer
//!
//! Streams a partner's CSV file of codes into a pool.
//!
//! - [`csv_rows`] reads the file row by row (header or not, BOM, CRLF,
//!   quotes, blank lines, spaces) and classifies each row as a code or an
//!   invalid row with its line number. It never holds more than one row.
//! - [`import`] batches valid codes into unordered inserts, with a couple of
//!   batches in flight, counts duplicates (codes already in the pool or
//!   repeated in the file), and records the run in `imports`.
//!
//! Memory stays flat whatever the file size: the reader and the inserter are
//! connected by a small bounded channel.

pub mod csv_rows;
pub mod import;

pub use csv_rows::{CodeRows, Row};
pub use import::{
    import_file, ImportError, ImportOptions, ImportProgress, ImportSummary, InvalidRow,
};
