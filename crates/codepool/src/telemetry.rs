//! Logging through `tracing`: text for people, JSON for log shippers.
//! `RUST_LOG` filters (default `info`). Codes never reach a log unmasked:
//! every log site passes `codepool_domain::mask`ed values.
//!
//! Order ids, message ids and other fields come from untrusted producers. A
//! bidi control such as U+202E would make a log line read differently from
//! what it says, so every line passes through [`SafeStderr`], which escapes
//! such characters wherever they appear.

use std::io::{IsTerminal, Write};

use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

pub fn init(format: LogFormat) {
    // lapin's I/O thread logs every lost connection at error level, and
    // the redis cluster client warns on every retry to a node that is
    // down; both failures reach codepool as results and are logged once
    // per outage, with what to do. RUST_LOG brings them back.
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,lapin=off,redis=error,mongodb=warn"));
    let ansi = std::io::stderr().is_terminal() && format == LogFormat::Text;
    let writer = SafeStderr {
        json: format == LogFormat::Json,
        ansi,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(ansi)
        .with_target(false);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        // Each line carries the span it was logged in (`span`) and every
        // span around it, outermost first (`spans`): the door's request or
        // batch, the core's step, the order or hold. Their fields name the
        // door, the order, the hold, the pool and the shop, so one grep
        // for an order id follows it through either door.
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(true)
            .try_init(),
    };
}

/// Tells scripts and tests where a server listens: `codepool: WHAT
/// listening on ADDR` on stderr. With JSON logs those words are the
/// `message` of a JSON line (with `addr`), so every line stays JSON.
pub fn announce_listening(format: LogFormat, what: &str, addr: std::net::SocketAddr) {
    let line = format!("codepool: {what} listening on {addr}");
    match format {
        LogFormat::Text => eprintln!("{line}"),
        LogFormat::Json => {
            let timestamp = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
            let event = serde_json::json!({
                "timestamp": timestamp,
                "level": "INFO",
                "message": line,
                "addr": addr.to_string(),
            });
            eprintln!("{event}");
        }
    }
}

/// Standard error, with characters that could disguise a log line escaped.
#[derive(Debug, Clone, Copy)]
pub struct SafeStderr {
    /// Escape as `\u202e` (valid inside JSON strings) instead of `\u{202e}`.
    pub json: bool,
    /// Colours are on: the ANSI escape character is the formatter's own.
    pub ansi: bool,
}

impl<'a> MakeWriter<'a> for SafeStderr {
    type Writer = SafeWriter;

    fn make_writer(&'a self) -> SafeWriter {
        SafeWriter {
            style: *self,
            out: std::io::stderr(),
        }
    }
}

/// One log line's writer (the formatter writes a whole event at once).
pub struct SafeWriter {
    style: SafeStderr,
    out: std::io::Stderr,
}

impl Write for SafeWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match std::str::from_utf8(buf) {
            Ok(text) if self.style.needs_escape(text) => {
                self.out.write_all(self.style.escape(text).as_bytes())?;
            }
            _ => self.out.write_all(buf)?,
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

impl SafeStderr {
    /// Whether `text` (one whole event) holds a character to escape: a
    /// newline or carriage return anywhere but at its very end, where the
    /// formatter ends the line, could start a forged line of its own.
    fn needs_escape(self, text: &str) -> bool {
        let body = text.strip_suffix('\n').unwrap_or(text);
        body.contains('\n') || body.chars().any(|c| self.must_escape(c))
    }

    /// Bidi controls, invisible format characters, line separators and
    /// control characters other than tab (a newline is judged by
    /// [`Self::escape`], by where it stands).
    fn must_escape(self, c: char) -> bool {
        match c {
            '\u{1b}' => !self.ansi,
            c => codepool_domain::hidden_on_terminal(c),
        }
    }

    pub fn escape(self, text: &str) -> String {
        let (body, end) = match text.strip_suffix('\n') {
            Some(body) => (body, "\n"),
            None => (text, ""),
        };
        let mut out = String::with_capacity(text.len() + 16);
        for c in body.chars() {
            if c != '\n' && !self.must_escape(c) {
                out.push(c);
            } else if self.json {
                out.push_str(&format!("\\u{:04x}", u32::from(c)));
            } else {
                out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
            }
        }
        out.push_str(end);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: SafeStderr = SafeStderr {
        json: false,
        ansi: false,
    };

    #[test]
    fn bidi_and_control_characters_are_escaped_in_text_logs() {
        let line = "granted order_id=O-\u{202e}1001 pool=x\u{7}\n";
        assert_eq!(
            TEXT.escape(line),
            "granted order_id=O-\\u{202e}1001 pool=x\\u{7}\n"
        );
    }

    #[test]
    fn a_newline_inside_a_field_cannot_start_a_forged_line() {
        let line = "INFO sign-in failed name=x\n2026-11-25T00:00:00Z  INFO console sign-in operator=admin1\r\n";
        let escaped = TEXT.escape(line);
        assert_eq!(escaped.matches('\n').count(), 1, "{escaped}");
        assert!(
            escaped.ends_with("\\u{d}\n") && escaped.contains("x\\u{a}2026"),
            "{escaped}"
        );
        assert!(TEXT.needs_escape(line) && !TEXT.needs_escape("INFO fine\n"));
    }

    #[test]
    fn json_logs_get_json_escapes_and_stay_valid_json() {
        let json = SafeStderr {
            json: true,
            ansi: false,
        };
        let line = "{\"order_id\":\"O-\u{202e}1\u{2066}\"}\n";
        let escaped = json.escape(line);
        assert_eq!(escaped, "{\"order_id\":\"O-\\u202e1\\u2066\"}\n");
        let v: serde_json::Value = serde_json::from_str(&escaped).unwrap();
        assert_eq!(v["order_id"], "O-\u{202e}1\u{2066}");
    }

    #[test]
    fn colours_survive_only_when_they_are_ours() {
        let ansi = SafeStderr {
            json: false,
            ansi: true,
        };
        assert_eq!(ansi.escape("\u{1b}[32mINFO"), "\u{1b}[32mINFO");
        assert_eq!(TEXT.escape("\u{1b}[32mINFO"), "\\u{1b}[32mINFO");
    }
}
