//! # codepool-importer
//!
//! Streams a partner's CSV file of codes into a pool.
//!
//! - [`csv_rows`] reads the file row by row (BOM, CRLF, quotes, blank
//!   lines, spaces) and classifies each row as a code or an invalid row with
//!   its line number. It never holds more than one row. The first row is a
//!   header that must name the code column (or, on request, there is no
//!   header and the file has one column): anything else is refused before
//!   a single code is written.
//! - [`import`] batches valid codes into unordered inserts, with a couple of
//!   batches in flight, counts duplicates (codes already in the pool or
//!   repeated in the file), and records the run in `imports`.
//!
//! - [`generate`] makes codes instead of reading them: a pattern's random
//!   symbols from the operating system, inserted the same way, as a run of
//!   its own that finishes by its id.
//!
//! Memory stays flat whatever the file size: the reader and the inserter are
//! connected by a small bounded channel.

pub mod csv_rows;
pub mod generate;
pub mod import;

pub use csv_rows::{CodeRows, Header, HeaderError, Row, RowError};
pub use generate::{
    generate, ByteSource, GenerateError, GenerateOptions, GenerateProgress, GenerateSummary,
    Generation,
};
pub use import::{
    import_file, import_reader, ImportError, ImportOptions, ImportProgress, ImportSummary,
    InvalidRow, LEASE,
};
