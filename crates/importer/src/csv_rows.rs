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

/// The rows of a CSV file of codes.
///
/// Accepted shapes: a header row naming a `code` column (and optionally
/// `expires_at`), or a headerless file whose first column is the code.
pub struct CodeRows<R: Read> {
    reader: csv::Reader<Tap<R>>,
    record: csv::ByteRecord,
    code_col: usize,
    expires_col: Option<usize>,
    started: bool,
    bytes: Arc<AtomicU64>,
}

impl<R: Read> CodeRows<R> {
    pub fn new(input: R) -> Self {
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
        Self {
            reader,
            record: csv::ByteRecord::new(),
            code_col: 0,
            expires_col: None,
            started: false,
            bytes,
        }
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

impl<R: Read> Iterator for CodeRows<R> {
    type Item = Result<Row, csv::Error>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match self.reader.read_byte_record(&mut self.record) {
                Ok(false) => return None,
                Ok(true) => {}
                Err(e) => {
                    // An I/O error ends the file; a malformed row does not.
                    if e.is_io_error() {
                        return Some(Err(e));
                    }
                    let line = e.position().map(|p| p.line()).unwrap_or(0);
                    return Some(Ok(Row::Invalid {
                        line,
                        reason: format!("malformed CSV: {e}"),
                    }));
                }
            }
            let line = self.record.position().map(|p| p.line()).unwrap_or(0);
            if !self.started {
                self.started = true;
                strip_bom(&mut self.record);
                if self.is_blank() {
                    self.started = false;
                    continue;
                }
                let names: Vec<String> = self
                    .record
                    .iter()
                    .map(|f| String::from_utf8_lossy(f).trim().to_ascii_lowercase())
                    .collect();
                if let Some(i) = names.iter().position(|n| n == "code") {
                    self.code_col = i;
                    self.expires_col = names.iter().position(|n| n == "expires_at");
                    continue;
                }
            }
            if self.is_blank() {
                continue;
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
        CodeRows::new(input).map(|r| r.unwrap()).collect()
    }

    fn code(line: u64, c: &str) -> Row {
        Row::Code {
            line,
            code: c.into(),
            expires_at: None,
        }
    }

    #[test]
    fn a_single_column_without_header_is_all_codes() {
        assert_eq!(
            rows(b"AAA-1\nBBB-2\n"),
            vec![code(1, "AAA-1"), code(2, "BBB-2")]
        );
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
        let mut reader = CodeRows::new(OneByte(input));
        let rows: Vec<Row> = reader.by_ref().map(|r| r.unwrap()).collect();
        assert_eq!(rows[0], code(2, "A-1"));
        assert_eq!(rows[1], code(4, "B-2"));
        assert_eq!(reader.finish_sha256(), hex::encode(Sha256::digest(input)));
    }

    #[test]
    fn a_bom_before_a_headerless_code_is_not_part_of_the_code() {
        assert_eq!(rows(b"\xEF\xBB\xBFAAA-1\n"), vec![code(1, "AAA-1")]);
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
    fn the_hash_covers_the_whole_file() {
        let mut reader = CodeRows::new(&b"A\nB\n"[..]);
        while reader.next().is_some() {}
        assert_eq!(
            reader.finish_sha256(),
            hex::encode(Sha256::digest(b"A\nB\n"))
        );
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(input in proptest::collection::vec(any::<u8>(), 0..2048)) {
            for row in CodeRows::new(&input[..]) {
                if let Ok(Row::Code { code, .. }) = row {
                    prop_assert!(!code.is_empty() && code.chars().count() <= 128);
                    prop_assert!(!code.chars().any(char::is_control));
                }
            }
        }

        #[test]
        fn huge_fields_are_invalid_not_fatal(len in 129usize..20_000) {
            let input = format!("{}\nOK\n", "z".repeat(len));
            let r = rows(input.as_bytes());
            let first_is_invalid = matches!(r[0], Row::Invalid { line: 1, .. });
            prop_assert!(first_is_invalid);
            prop_assert_eq!(&r[1], &code(2, "OK"));
        }
    }
}
