//! The pattern of generated codes: fixed text, random base-32 symbols, the
//! pool's daily number and a check symbol, e.g. `GX-{random:12}` or
//! `GX-{number}-{random:4}-{random:4}-{random:4}{check}`.
//!
//! Pure: [`CodePattern::render`] takes the random bytes and the daily
//! number from its caller, who draws them from the operating system and
//! the sequence generator.

use crate::crockford::{self, BITS_PER_SYMBOL};
use crate::MAX_CODE_LEN;

/// Fewer random bits than this and generation refuses the pattern.
pub const MIN_RANDOM_BITS: u32 = 40;
/// Fewer random bits than this and codes can be guessed (the docs warn,
/// the CLI warns).
pub const SAFE_RANDOM_BITS: u32 = 60;
/// The pattern when none is given: 80 random bits in four groups.
pub const DEFAULT_PATTERN: &str = "{random:4}-{random:4}-{random:4}-{random:4}";
/// Most symbols one `{random:N}` may ask for.
pub const MAX_RANDOM_SYMBOLS: usize = 64;
/// Characters the daily number takes at most (`yyyyMMdd` and a counter).
const NUMBER_LEN: usize = 16;

/// One piece of a pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Text(String),
    /// `{random:N}`: N random base-32 symbols.
    Random(usize),
    /// `{number}`: the pool's daily number, `yyyyMMdd` and a counter.
    Number,
    /// `{check}`: the check symbol of everything before it (always last).
    Check,
}

/// Why a pattern cannot make codes; each says how to write it instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    #[error("the pattern is empty; give one like 'GX-{{random:12}}'")]
    Empty,
    #[error("the pattern has a '{{' with no '}}'; write tokens as {{random:N}}, {{number}} or {{check}}")]
    Unclosed,
    #[error("{{{0}}} is not a token; use {{random:N}} (N from 1 to 64), {{number}} or {{check}}")]
    UnknownToken(String),
    #[error("the fixed text holds {0:?}; use letters, digits, '-', '_' or '.'")]
    BadText(char),
    #[error("a code with a check symbol holds only base-32 symbols (0-9, A-Z without I, L, O, U) and hyphens, so that the check covers all of it; the fixed text holds {0:?}")]
    NotASymbol(char),
    #[error("{{check}} comes once, at the end of the pattern")]
    CheckNotLast,
    #[error("the pattern has {bits} random bits ({symbols} symbols of 5 bits); at least {MIN_RANDOM_BITS} are needed and {SAFE_RANDOM_BITS} or more keep codes from being guessed: use {{random:12}} or more")]
    TooFewBits { bits: u32, symbols: usize },
    #[error(
        "codes of this pattern could be {0} characters long; at most {MAX_CODE_LEN} are allowed"
    )]
    TooLong(usize),
}

/// A parsed pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodePattern {
    parts: Vec<Part>,
}

impl CodePattern {
    /// Parses `pattern`; `check` appends `{check}` when the pattern has
    /// none. Refuses a pattern under [`MIN_RANDOM_BITS`] random bits.
    pub fn parse(pattern: &str, check: bool) -> Result<Self, PatternError> {
        let mut parts = parse_parts(pattern)?;
        if check && !parts.contains(&Part::Check) {
            parts.push(Part::Check);
        }
        let checks = parts.iter().filter(|p| **p == Part::Check).count();
        if checks > 1 || (checks == 1 && parts.last() != Some(&Part::Check)) {
            return Err(PatternError::CheckNotLast);
        }
        let pattern = Self { parts };
        if pattern.has_check() {
            for p in &pattern.parts {
                if let Part::Text(t) = p {
                    let bad = t.chars().find(|&c| c != '-' && !is_symbol(c));
                    if let Some(c) = bad {
                        return Err(PatternError::NotASymbol(c));
                    }
                }
            }
        }
        let bits = pattern.random_bits();
        if bits < MIN_RANDOM_BITS {
            let symbols = pattern.random_symbols();
            return Err(PatternError::TooFewBits { bits, symbols });
        }
        let longest = pattern.longest();
        if longest > MAX_CODE_LEN {
            return Err(PatternError::TooLong(longest));
        }
        Ok(pattern)
    }

    /// Random base-32 symbols in one code.
    pub fn random_symbols(&self) -> usize {
        (self.parts.iter())
            .map(|p| match p {
                Part::Random(n) => *n,
                _ => 0,
            })
            .sum()
    }

    /// Random bits in one code (5 a symbol).
    pub fn random_bits(&self) -> u32 {
        self.random_symbols() as u32 * BITS_PER_SYMBOL
    }

    pub fn has_number(&self) -> bool {
        self.parts.contains(&Part::Number)
    }

    /// Whether codes end with a check symbol.
    pub fn has_check(&self) -> bool {
        self.parts.contains(&Part::Check)
    }

    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// The longest code this pattern makes (a daily number counted long).
    fn longest(&self) -> usize {
        (self.parts.iter())
            .map(|p| match p {
                Part::Text(t) => t.chars().count(),
                Part::Random(n) => *n,
                Part::Number => NUMBER_LEN,
                Part::Check => 1,
            })
            .sum()
    }

    /// One code: `random` gives a byte per random symbol (at least
    /// [`CodePattern::random_symbols`] of them), `number` the daily number
    /// (needed when the pattern has `{number}`).
    pub fn render(&self, random: &[u8], number: Option<&str>) -> String {
        let mut code = String::with_capacity(self.longest());
        let mut at = 0;
        for p in &self.parts {
            match p {
                Part::Text(t) => code.push_str(t),
                Part::Random(n) => {
                    let end = (at + n).min(random.len());
                    code.push_str(&crockford::encode_random(&random[at..end], *n));
                    at = end;
                }
                Part::Number => code.push_str(number.unwrap_or_default()),
                Part::Check => {
                    let sum = crockford::check_symbol(&code);
                    code.push(sum.unwrap_or('*'));
                }
            }
        }
        code
    }
}

impl std::fmt::Display for CodePattern {
    /// The pattern written back, `{check}` included when asked for.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for p in &self.parts {
            match p {
                Part::Text(t) => f.write_str(t)?,
                Part::Random(n) => write!(f, "{{random:{n}}}")?,
                Part::Number => f.write_str("{number}")?,
                Part::Check => f.write_str("{check}")?,
            }
        }
        Ok(())
    }
}

/// A base-32 symbol as written in fixed text: upper case only.
fn is_symbol(c: char) -> bool {
    c.is_ascii() && crockford::ALPHABET.contains(&(c as u8))
}

fn parse_parts(pattern: &str) -> Result<Vec<Part>, PatternError> {
    if pattern.is_empty() {
        return Err(PatternError::Empty);
    }
    let mut parts = Vec::new();
    let mut rest = pattern;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix('{') {
            let Some(end) = after.find('}') else {
                return Err(PatternError::Unclosed);
            };
            parts.push(token(&after[..end])?);
            rest = &after[end + 1..];
            continue;
        }
        let end = rest.find('{').unwrap_or(rest.len());
        let text = &rest[..end];
        let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        if let Some(bad) = text.chars().find(|&c| !ok(c)) {
            return Err(PatternError::BadText(bad));
        }
        parts.push(Part::Text(text.to_owned()));
        rest = &rest[end..];
    }
    Ok(parts)
}

fn token(inside: &str) -> Result<Part, PatternError> {
    let unknown = || PatternError::UnknownToken(inside.chars().take(40).collect());
    match inside {
        "number" => Ok(Part::Number),
        "check" => Ok(Part::Check),
        _ => {
            let n = inside.strip_prefix("random:").ok_or_else(unknown)?;
            match n.parse::<usize>() {
                Ok(n) if (1..=MAX_RANDOM_SYMBOLS).contains(&n) => Ok(Part::Random(n)),
                _ => Err(unknown()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pattern_renders_text_random_number_and_check() {
        let p = CodePattern::parse("GX-{number}-{random:12}", true).unwrap();
        assert_eq!(p.to_string(), "GX-{number}-{random:12}{check}");
        assert_eq!(p.random_bits(), 60);
        let code = p.render(&[1; 12], Some("202611270001"));
        assert!(code.starts_with("GX-202611270001-111111111111"));
        assert!(crockford::check_ok(&code), "{code}");
    }

    #[test]
    fn under_forty_random_bits_is_refused() {
        assert_eq!(
            CodePattern::parse("GX-{random:7}", false),
            Err(PatternError::TooFewBits {
                bits: 35,
                symbols: 7
            })
        );
        assert!(CodePattern::parse("GX-{random:8}", false).is_ok());
        assert!(CodePattern::parse(DEFAULT_PATTERN, false).is_ok());
    }

    #[test]
    fn bad_patterns_say_why() {
        let bad = |p: &str, check| CodePattern::parse(p, check).unwrap_err();
        assert_eq!(bad("", false), PatternError::Empty);
        assert_eq!(bad("{random:12", false), PatternError::Unclosed);
        assert!(matches!(
            bad("{random:0}{random:12}", false),
            PatternError::UnknownToken(_)
        ));
        assert!(matches!(
            bad("{rand}{random:12}", false),
            PatternError::UnknownToken(_)
        ));
        assert_eq!(bad("a b{random:12}", false), PatternError::BadText(' '));
        assert_eq!(bad("LX-{random:12}", true), PatternError::NotASymbol('L'));
        assert_eq!(bad("{check}{random:12}", false), PatternError::CheckNotLast);
        assert!(matches!(
            bad("{random:64}{random:64}{random:8}", false),
            PatternError::TooLong(_)
        ));
    }
}
