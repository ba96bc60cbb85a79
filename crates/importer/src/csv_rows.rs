//! Reading codes out of a CSV file, one row at a time.

use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use chrono::{DateTime, NaiveDate, NaiveDateTime, Utc};
use codepool_domain::validate_code;
use sha2::{Digest, Sha256};

/// One row of the file, classified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Row {
    Code {
        line: u64,
        code: String,
        expires_at: Option<DateTime<Utc>>,
    },
    Invalid {
        line: u64,
        reason: String,
    },
}

/// Wraps the file to hash it and count bytes as they stream past, so the
/// audit record gets the file's sha256 without a second read.
///
/// It also hands the CSV parser a normalized stream: a CR before an LF and
/// a leading UTF-8 BOM become spaces (which trimming removes). Lengths stay
/// the same, and the parser's line numbers stay true for CRLF files (its own
/// count is off for CRLF).
pub struct Tap<R> {
    inner: R,
    hasher: Sha256,
    bytes: Arc<AtomicU64>,
    emitted: u64,
    pending_cr: bool,
}

impl<R: Read> Read for Tap<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            let start = usize::from(self.pending_cr);
            if start == 1 {
                buf[0] = b'\r';
            }
            let n = if start < buf.len() {
                self.inner.read(&mut buf[start..])?
            } else {
                0
            };
            self.hasher.update(&buf[start..start + n]);
            self.bytes.fetch_add(n as u64, Ordering::Relaxed);
            self.pending_cr = false;
            let mut total = start + n;
            if total == 0 {
                return Ok(0);
            }
            for i in 0..total - 1 {
                if buf[i] == b'\r' && buf[i + 1] == b'\n' {
                    buf[i] = b' ';
                }
            }
            // A CR at the end may be the first half of a CRLF: hold it back.
            if n > 0 && buf[total - 1] == b'\r' {
                self.pending_cr = true;
                total -= 1;
                if total == 0 {
                    continue;
                }
            }
            if self.emitted == 0 && buf[..total].starts_with(b"\xEF\xBB\xBF") {
                buf[..3].copy_from_slice(b"   ");
            }
            self.emitted += total as u64;
            return Ok(total);
        }
    }
}

/// How the first row of a file is read. There is no guessing: a header that
/// does not name the code column is refused, never imported as a code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Header {
    /// The first row is a header; the column with this name (compared
    /// without case) holds the codes. `code` unless `--column` says otherwise.
    Named(String),
    /// No header: every row is a code, and the file has a single column.
    None,
}

impl Default for Header {
    fn default() -> Self {
        Self::Named(CODE_COLUMN.into())
    }
}

/// The default name of the code column.
pub const CODE_COLUMN: &str = "code";
/// The optional column of expiry times.
pub const EXPIRES_COLUMN: &str = "expires_at";

/// Why the first row of a file cannot start an import. Nothing is imported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("the file is empty; give a CSV file whose first row is a header naming the code column (`code`)")]
    Empty,
    #[error("the file is gzip-compressed (it starts with the bytes 1f 8b), codepool reads a plain CSV; decompress it first, e.g. `gunzip -c FILE.gz | codepool import - --pool POOL`")]
    Gzip,
    #[error("the file is UTF-16, codepool reads UTF-8; convert it first, e.g. `iconv -f UTF-16 -t UTF-8 FILE > FILE.utf8.csv`, and import the converted file")]
    Utf16,
    #[error("the first row {row:?} has no column named {column:?}, and the first row must be a header naming the code column; pass --column NAME if the codes are in another column, or --no-header if the file is a single column of codes without a header")]
    NoCodeColumn { row: String, column: String },
    #[error("the header names {count} columns {column:?}, so it is ambiguous which one to use; rename or remove all but one and import again")]
    Ambiguous { column: String, count: usize },
    #[error("--no-header is for a file with a single column of codes, but the first row has {columns} columns; add a header row naming the code column (`code`, or any name with --column NAME) and drop --no-header")]
    NotSingleColumn { columns: usize },
    #[error(
        "the first row is {row:?}, a header, but --no-header says there is none; drop --no-header"
    )]
    HeaderWithNoHeader { row: String },
    #[error("reading the first row failed: {0}; check the file and import it again")]
    Read(String),
}

/// Why reading the rows stopped before the end of the file.
#[derive(Debug, thiserror::Error)]
pub enum RowError {
    /// The file could not be read.
    #[error(transparent)]
    Csv(#[from] csv::Error),
    /// A quoted field runs over several lines: almost always a stray `"`
    /// that never closes, which swallows the rows after it. The file is
    /// refused rather than those rows silently lost.
    #[error("line {line}: a quote opens a field that runs over the next {swallowed} line(s), to line {end}; a stray \" that never closes swallows the rows after it, so the file is refused there. Fix or remove the quote on line {line} and import the file again (codes already imported count as duplicates)")]
    SpansLines { line: u64, swallowed: u64, end: u64 },
}

/// The rows of a CSV file of codes.
///
/// [`CodeRows::open`] reads the first row and applies the [`Header`] rule
/// before any row is handed out, so a refused file imports nothing.
pub struct CodeRows<R: Read> {
    reader: csv::Reader<Tap<R>>,
    record: csv::ByteRecord,
    code_col: usize,
    expires_col: Option<usize>,
    /// Without a header, the first row read by `open` is a code still to hand out.
    pending_first: bool,
    single_column: bool,
    bytes: Arc<AtomicU64>,
}

impl<R: Read> CodeRows<R> {
    /// Reads the first non-blank row of `input` and checks it against `header`.
    pub fn open(input: R, header: &Header) -> Result<Self, HeaderError> {
        let bytes = Arc::new(AtomicU64::new(0));
        let tap = Tap {
            inner: input,
            hasher: Sha256::new(),
            bytes: bytes.clone(),
            emitted: 0,
            pending_cr: false,
        };
        let reader = csv::ReaderBuilder::new()
            .has_headers(false)
            .flexible(true)
            .trim(csv::Trim::All)
            .from_reader(tap);
        let mut rows = Self {
            reader,
            record: csv::ByteRecord::new(),
            code_col: 0,
            expires_col: None,
            pending_first: false,
            single_column: false,
            bytes,
        };
        rows.read_first_row()?;
        match header {
            Header::Named(column) => rows.apply_header(column)?,
            Header::None => rows.apply_no_header()?,
        }
        Ok(rows)
    }

    fn read_first_row(&mut self) -> Result<(), HeaderError> {
        loop {
            match self.reader.read_byte_record(&mut self.record) {
                Ok(false) => return Err(HeaderError::Empty),
                Ok(true) => {}
                Err(e) => return Err(HeaderError::Read(e.to_string())),
            }
            let first = self.record.get(0).unwrap_or_default();
            if first.starts_with(b"\x1F\x8B") {
                return Err(HeaderError::Gzip);
            }
            if first.starts_with(b"\xFF\xFE")
                || first.starts_with(b"\xFE\xFF")
                || self.record.iter().any(|f| f.contains(&0))
            {
                return Err(HeaderError::Utf16);
            }
            strip_bom(&mut self.record);
            if !self.is_blank() {
                return Ok(());
            }
        }
    }

    fn apply_header(&mut self, column: &str) -> Result<(), HeaderError> {
        let names: Vec<String> = self
            .record
            .iter()
            .map(|f| String::from_utf8_lossy(f).trim().to_lowercase())
            .collect();
        let find = |wanted: &str| -> Result<Option<usize>, HeaderError> {
            let wanted = wanted.trim().to_lowercase();
            let at: Vec<usize> = (0..names.len()).filter(|i| names[*i] == wanted).collect();
            match at.as_slice() {
                [] => Ok(None),
                [i] => Ok(Some(*i)),
                _ => Err(HeaderError::Ambiguous {
                    column: wanted,
                    count: at.len(),
                }),
            }
        };
        self.code_col = find(column)?.ok_or_else(|| HeaderError::NoCodeColumn {
            row: self.first_row_text(),
            column: column.to_owned(),
        })?;
        self.expires_col = find(EXPIRES_COLUMN)?.filter(|i| *i != self.code_col);
        Ok(())
    }

    fn apply_no_header(&mut self) -> Result<(), HeaderError> {
        if self.record.len() > 1 {
            return Err(HeaderError::NotSingleColumn {
                columns: self.record.len(),
            });
        }
        let first = String::from_utf8_lossy(self.record.get(0).unwrap_or_default());
        if first.trim().eq_ignore_ascii_case(CODE_COLUMN) {
            return Err(HeaderError::HeaderWithNoHeader {
                row: first.trim().to_owned(),
            });
        }
        self.single_column = true;
        self.pending_first = true;
        Ok(())
    }

    /// The first row as text for a message, shortened and without controls.
    fn first_row_text(&self) -> String {
        let fields: Vec<String> = self
            .record
            .iter()
            .map(|f| String::from_utf8_lossy(f).into_owned())
            .collect();
        fields
            .join(",")
            .chars()
            .filter(|c| !c.is_control())
            .take(80)
            .collect()
    }

    /// Bytes read so far (for progress).
    pub fn bytes_counter(&self) -> Arc<AtomicU64> {
        self.bytes.clone()
    }

    /// The sha256 of everything read; meaningful once all rows are read.
    pub fn finish_sha256(self) -> String {
        let tap = self.reader.into_inner();
        hex::encode(tap.hasher.finalize())
    }

    fn field(&self, i: usize) -> Result<&str, String> {
        let raw = self.record.get(i).unwrap_or_default();
        std::str::from_utf8(raw).map_err(|_| "the row is not valid UTF-8".to_owned())
    }

    fn classify(&self, line: u64) -> Row {
        if self.single_column && self.record.len() > 1 {
            return Row::Invalid {
                line,
                reason: format!(
                    "the row has {} columns, but --no-header is for a single column of codes",
                    self.record.len()
                ),
            };
        }
        let code = match self.field(self.code_col) {
            Ok(c) => c,
            Err(reason) => return Row::Invalid { line, reason },
        };
        let code = match validate_code(code) {
            Ok(c) => c.to_owned(),
            Err(e) => {
                return Row::Invalid {
                    line,
                    reason: e.to_string(),
                }
            }
        };
        let expires_at = match self.expires_col {
            None => None,
            Some(i) => match self.field(i).map(str::trim) {
                Ok("") => None,
                Ok(text) => match parse_time(text) {
                    Some(t) => Some(t),
                    None => {
                        return Row::Invalid {
                            line,
                            reason: format!(
                                "expires_at {:?} is not a date (use 2027-01-31 or 2027-01-31T00:00:00Z)",
                                text.chars().take(40).collect::<String>()
                            ),
                        }
                    }
                },
                Err(reason) => return Row::Invalid { line, reason },
            },
        };
        Row::Code {
            line,
            code,
            expires_at,
        }
    }

    fn is_blank(&self) -> bool {
        self.record
            .iter()
            .all(|f| f.iter().all(u8::is_ascii_whitespace))
    }
}

/// Reads a time as RFC 3339, `YYYY-MM-DD HH:MM:SS` (UTC) or a bare date
/// (midnight UTC at its start).
pub fn parse_time(text: &str) -> Option<DateTime<Utc>> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Some(t.with_timezone(&Utc));
    }
    if let Ok(t) = NaiveDateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S") {
        return Some(t.and_utc());
    }
    NaiveDate::parse_from_str(text, "%Y-%m-%d")
        .ok()
        .and_then(|d| d.and_hms_opt(0, 0, 0))
        .map(|t| t.and_utc())
}

impl<R: Read> CodeRows<R> {
    /// The lines a field of the current record swallowed: a quoted field
    /// holding line breaks (none in a valid row of codes).
    fn swallowed_lines(&self) -> u64 {
        (self.record.iter())
            .map(|f| f.iter().filter(|b| **b == b'\n').count() as u64)
            .max()
            .unwrap_or(0)
    }
}

impl<R: Read> Iterator for CodeRows<R> {
    type Item = Result<Row, RowError>;

    fn next(&mut self) -> Option<Self::Item> {
        if std::mem::take(&mut self.pending_first) {
            let line = self.record.position().map(|p| p.line()).unwrap_or(0);
            return Some(Ok(self.classify(line)));
        }
        loop {
            match self.reader.read_byte_record(&mut self.record) {
                Ok(false) => return None,
                Ok(true) => {}
                Err(e) => {
                    // An I/O error ends the file; a malformed row does not.
                    if e.is_io_error() {
                        return Some(Err(e.into()));
                    }
                    let line = e.position().map(|p| p.line()).unwrap_or(0);
                    return Some(Ok(Row::Invalid {
                        line,
                        reason: format!("malformed CSV: {e}"),
                    }));
                }
            }
            if self.is_blank() {
                continue;
            }
            let line = self.record.position().map(|p| p.line()).unwrap_or(0);
            let swallowed = self.swallowed_lines();
            if swallowed > 0 {
                return Some(Err(RowError::SpansLines {
                    line,
                    swallowed,
                    end: line + swallowed,
                }));
            }
            return Some(Ok(self.classify(line)));
        }
    }
}

fn strip_bom(record: &mut csv::ByteRecord) {
    const BOM: &[u8] = b"\xEF\xBB\xBF";
    if record.get(0).is_some_and(|f| f.starts_with(BOM)) {
        let mut fixed = csv::ByteRecord::new();
        for (i, f) in record.iter().enumerate() {
            let f = if i == 0 { &f[BOM.len()..] } else { f };
            let trimmed = std::str::from_utf8(f)
                .map(str::trim)
                .map(str::as_bytes)
                .unwrap_or(f);
            fixed.push_field(trimmed);
        }
        fixed.set_position(record.position().cloned());
        *record = fixed;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rows(input: &[u8]) -> Vec<Row> {
        rows_with(input, &Header::default())
    }

    fn rows_with(input: &[u8], header: &Header) -> Vec<Row> {
        CodeRows::open(input, header)
            .unwrap()
            .map(|r| r.unwrap())
            .collect()
    }

    fn refusal(input: &[u8], header: &Header) -> HeaderError {
        match CodeRows::open(input, header) {
            Ok(rows) => panic!(
                "accepted: {:?}",
                rows.map(|r| r.unwrap()).collect::<Vec<_>>()
            ),
            Err(e) => e,
        }
    }

    fn named(column: &str) -> Header {
        Header::Named(column.into())
    }

    fn code(line: u64, c: &str) -> Row {
        Row::Code {
            line,
            code: c.into(),
            expires_at: None,
        }
    }

    #[test]
    fn a_single_column_without_header_is_all_codes_with_no_header() {
        assert_eq!(
            rows_with(b"AAA-1\nBBB-2\n", &Header::None),
            vec![code(1, "AAA-1"), code(2, "BBB-2")]
        );
    }

    #[test]
    fn a_first_row_not_naming_the_code_column_is_refused() {
        let e = refusal(b"codes\nHDR-01\n", &Header::default());
        assert!(matches!(&e, HeaderError::NoCodeColumn { row, .. } if row == "codes"));
        assert!(e.to_string().contains("--column") && e.to_string().contains("--no-header"));
        let e = refusal(
            b"serial,expires_at\nSER-01,2030-01-01\n",
            &Header::default(),
        );
        assert!(matches!(e, HeaderError::NoCodeColumn { .. }), "{e}");
        // A headerless file is refused too: its first code is not a header.
        let e = refusal(b"AAA-1\nBBB-2\n", &Header::default());
        assert!(matches!(e, HeaderError::NoCodeColumn { .. }), "{e}");
    }

    #[test]
    fn column_picks_another_code_column_and_keeps_expires_at() {
        let r = rows_with(b"serial,expires_at\nSER-01,2030-01-01\n", &named("Serial"));
        assert_eq!(
            r,
            vec![Row::Code {
                line: 2,
                code: "SER-01".into(),
                expires_at: parse_time("2030-01-01"),
            }]
        );
    }

    #[test]
    fn an_ambiguous_header_is_refused() {
        let e = refusal(b"code,code\nA,B\n", &Header::default());
        assert_eq!(
            e,
            HeaderError::Ambiguous {
                column: "code".into(),
                count: 2
            }
        );
        let e = refusal(b"code,expires_at,EXPIRES_AT\nA,,\n", &Header::default());
        assert!(matches!(e, HeaderError::Ambiguous { .. }), "{e}");
    }

    #[test]
    fn no_header_is_for_one_column_without_a_header() {
        let e = refusal(b"serial,expires_at\nSER-01,2030-01-01\n", &Header::None);
        assert_eq!(e, HeaderError::NotSingleColumn { columns: 2 });
        let e = refusal(b"Code\nAAA-1\n", &Header::None);
        assert!(matches!(e, HeaderError::HeaderWithNoHeader { .. }), "{e}");
        let r = rows_with(b"AAA-1\n\"B,1\"\nC,2\n", &Header::None);
        assert_eq!(r[0], code(1, "AAA-1"));
        assert_eq!(r[1], code(2, "B,1"));
        assert!(
            matches!(&r[2], Row::Invalid { line: 3, reason } if reason.contains("single column"))
        );
    }

    #[test]
    fn empty_and_utf16_files_are_refused() {
        assert_eq!(refusal(b"", &Header::default()), HeaderError::Empty);
        assert_eq!(refusal(b"\n \r\n", &Header::None), HeaderError::Empty);
        let utf16: Vec<u8> = "\u{feff}code\nA-1\n"
            .encode_utf16()
            .flat_map(u16::to_le_bytes)
            .collect();
        assert_eq!(refusal(&utf16, &Header::default()), HeaderError::Utf16);
        assert_eq!(refusal(&utf16, &Header::None), HeaderError::Utf16);
        let no_bom: Vec<u8> = "A-1\n".encode_utf16().flat_map(u16::to_be_bytes).collect();
        assert_eq!(refusal(&no_bom, &Header::None), HeaderError::Utf16);
    }

    #[test]
    fn a_gzip_file_is_named_gzip_not_utf16() {
        let gz = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\x4b\xce\x4f\x49\xe5\x02\x00";
        assert_eq!(refusal(gz, &Header::default()), HeaderError::Gzip);
        assert_eq!(refusal(gz, &Header::None), HeaderError::Gzip);
    }

    #[test]
    fn a_header_names_the_code_column() {
        let r = rows(b"batch,code,expires_at\nx,AAA-1,2027-01-31\ny,BBB-2,\n");
        assert_eq!(
            r,
            vec![
                Row::Code {
                    line: 2,
                    code: "AAA-1".into(),
                    expires_at: parse_time("2027-01-31T00:00:00Z"),
                },
                code(3, "BBB-2"),
            ]
        );
    }

    #[test]
    fn bom_crlf_quotes_blank_lines_and_spaces_are_handled() {
        let r = rows(b"\xEF\xBB\xBFcode\r\n  AAA-1 \r\n\r\n\"BB,B-2\"\r\n   \r\n\" CCC \"\r\n");
        assert_eq!(r, vec![code(2, "AAA-1"), code(4, "BB,B-2"), code(6, "CCC")]);
    }

    /// A reader that hands out one byte per read, to split every CRLF.
    struct OneByte<'a>(&'a [u8]);

    impl Read for OneByte<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            match self.0.split_first() {
                Some((b, rest)) if !buf.is_empty() => {
                    buf[0] = *b;
                    self.0 = rest;
                    Ok(1)
                }
                _ => Ok(0),
            }
        }
    }

    #[test]
    fn crlf_split_across_reads_keeps_lines_and_hash() {
        let input = b"\xEF\xBB\xBFcode\r\nA-1\r\n\r\nB-2\r\nC\r3\r";
        let mut reader = CodeRows::open(OneByte(input), &Header::default()).unwrap();
        let rows: Vec<Row> = reader.by_ref().map(|r| r.unwrap()).collect();
        assert_eq!(rows[0], code(2, "A-1"));
        assert_eq!(rows[1], code(4, "B-2"));
        assert_eq!(reader.finish_sha256(), hex::encode(Sha256::digest(input)));
    }

    #[test]
    fn a_bom_before_a_headerless_code_is_not_part_of_the_code() {
        assert_eq!(
            rows_with(b"\xEF\xBB\xBFAAA-1\n", &Header::None),
            vec![code(1, "AAA-1")]
        );
    }

    #[test]
    fn invalid_rows_are_reported_with_their_line() {
        let long = "x".repeat(129);
        let input = format!("code,note\nGOOD-1,a\n,b\n{long},c\n\"A\tB\",d\nGOOD-2,e\n");
        let r = rows(input.as_bytes());
        assert_eq!(r[0], code(2, "GOOD-1"));
        assert!(
            matches!(&r[1], Row::Invalid { line: 3, reason } if reason.contains("empty")),
            "{:?}",
            r[1]
        );
        assert!(matches!(&r[2], Row::Invalid { line: 4, reason } if reason.contains("129")));
        assert!(matches!(&r[3], Row::Invalid { line: 5, reason } if reason.contains("control")));
        assert_eq!(r[4], code(6, "GOOD-2"));
    }

    #[test]
    fn invalid_utf8_and_bad_dates_are_invalid_rows() {
        let r = rows(b"code,expires_at\n\xff\xfe,\nOK-1,someday\n");
        assert!(matches!(&r[0], Row::Invalid { line: 2, reason } if reason.contains("UTF-8")));
        assert!(matches!(&r[1], Row::Invalid { line: 3, reason } if reason.contains("expires_at")));
    }

    #[test]
    fn a_quote_that_never_closes_stops_the_rows_naming_its_line_and_the_lines_it_took() {
        let mut input = String::from("code\nOK-1\n\"STRAY-2\n");
        for i in 3..=2000 {
            input.push_str(&format!("CODE-{i}\n"));
        }
        let mut rows = CodeRows::open(input.as_bytes(), &Header::default()).unwrap();
        assert_eq!(rows.next().unwrap().unwrap(), code(2, "OK-1"));
        let e = rows.next().unwrap().unwrap_err();
        assert!(
            matches!(
                e,
                RowError::SpansLines {
                    line: 3,
                    swallowed: 1998,
                    end: 2001
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("line 3"), "{e}");
    }

    #[test]
    fn the_hash_covers_the_whole_file() {
        let mut reader = CodeRows::open(&b"A\nB\n"[..], &Header::None).unwrap();
        while reader.next().is_some() {}
        assert_eq!(
            reader.finish_sha256(),
            hex::encode(Sha256::digest(b"A\nB\n"))
        );
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(input in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let Ok(rows) = CodeRows::open(&input[..], &Header::None) else {
                return Ok(());
            };
            for row in rows {
                if let Ok(Row::Code { code, .. }) = row {
                    prop_assert!(!code.is_empty() && code.chars().count() <= 128);
                    prop_assert!(!code.chars().any(char::is_control));
                }
            }
        }

        #[test]
        fn huge_fields_are_invalid_not_fatal(len in 129usize..20_000) {
            let input = format!("{}\nOK\n", "z".repeat(len));
            let r = rows_with(input.as_bytes(), &Header::None);
            let first_is_invalid = matches!(r[0], Row::Invalid { line: 1, .. });
            prop_assert!(first_is_invalid);
            prop_assert_eq!(&r[1], &code(2, "OK"));
        }
    }
}
