//! Codes: the secrets codepool hands out, their lifecycle and their masking.

use std::fmt;

/// Longest code the importer accepts. Partner codes are short; anything
/// longer is a broken row, not a code.
pub const MAX_CODE_LEN: usize = 128;

/// Where a code is in its life. Stored as a small integer in MongoDB
/// (`status`), because the claim's conditional update matches on it.
///
/// Allowed moves: 0→1 claim, 1→2 redeem, 0→3 and 1→3 void. An issued code
/// never returns to 0: the buyer has already seen it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CodeStatus {
    Unissued = 0,
    Issued = 1,
    Used = 2,
    Void = 3,
}

impl CodeStatus {
    pub fn as_i32(self) -> i32 {
        self as i32
    }

    pub fn from_i32(v: i32) -> Option<Self> {
        match v {
            0 => Some(Self::Unissued),
            1 => Some(Self::Issued),
            2 => Some(Self::Used),
            3 => Some(Self::Void),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Unissued => "unissued",
            Self::Issued => "issued",
            Self::Used => "used",
            Self::Void => "void",
        }
    }

    /// Whether the lifecycle allows moving from `self` to `to`.
    pub fn can_become(self, to: CodeStatus) -> bool {
        use CodeStatus::*;
        matches!(
            (self, to),
            (Unissued, Issued) | (Issued, Used) | (Unissued, Void) | (Issued, Void)
        )
    }
}

impl fmt::Display for CodeStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a CSV field is not a usable code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidCode {
    #[error("the code is empty")]
    Empty,
    #[error("the code is {0} characters long; at most {MAX_CODE_LEN} are allowed")]
    TooLong(usize),
    #[error("the code contains a control character (position {0})")]
    ControlCharacter(usize),
}

/// Trims a raw field and checks it is a code codepool can store and send:
/// not empty, at most [`MAX_CODE_LEN`] characters, no control characters.
pub fn validate_code(raw: &str) -> Result<&str, InvalidCode> {
    let code = raw.trim();
    if code.is_empty() {
        return Err(InvalidCode::Empty);
    }
    let len = code.chars().count();
    if len > MAX_CODE_LEN {
        return Err(InvalidCode::TooLong(len));
    }
    if let Some(pos) = code.chars().position(char::is_control) {
        return Err(InvalidCode::ControlCharacter(pos + 1));
    }
    Ok(code)
}

/// Masks a code for logs and metrics: the first two and last two characters
/// stay, the rest become `*` (`QWER-1234` → `QW*****34`). Codes of four
/// characters or fewer are fully masked, since showing four of them would
/// show them all.
pub fn mask(code: &str) -> String {
    let chars: Vec<char> = code.chars().collect();
    if chars.len() <= 4 {
        return "*".repeat(chars.len().max(4));
    }
    let mut out = String::with_capacity(chars.len());
    out.extend(&chars[..2]);
    out.extend(std::iter::repeat_n('*', chars.len() - 4));
    out.extend(&chars[chars.len() - 2..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masking_keeps_two_characters_at_each_end() {
        assert_eq!(mask("QWER-1234"), "QW*****34");
        assert_eq!(mask("QWERTY34"), "QW****34");
    }

    #[test]
    fn short_codes_are_fully_masked() {
        assert_eq!(mask("AB"), "****");
        assert_eq!(mask("ABCD"), "****");
        assert_eq!(mask("ABCDE"), "AB*DE");
    }

    #[test]
    fn masking_counts_characters_not_bytes() {
        assert_eq!(mask("ÄÖÜßéè"), "ÄÖ**éè");
    }

    #[test]
    fn codes_are_trimmed_and_checked() {
        assert_eq!(validate_code("  AB-12 "), Ok("AB-12"));
        assert_eq!(validate_code("   "), Err(InvalidCode::Empty));
        assert_eq!(
            validate_code(&"x".repeat(129)),
            Err(InvalidCode::TooLong(129))
        );
        assert!(validate_code(&"x".repeat(128)).is_ok());
        assert_eq!(
            validate_code("AB\u{7}C"),
            Err(InvalidCode::ControlCharacter(3))
        );
    }

    #[test]
    fn lifecycle_allows_only_forward_moves() {
        use CodeStatus::*;
        assert!(Unissued.can_become(Issued));
        assert!(Issued.can_become(Used));
        assert!(Issued.can_become(Void));
        assert!(Unissued.can_become(Void));
        assert!(!Issued.can_become(Unissued));
        assert!(!Void.can_become(Unissued));
        assert!(!Used.can_become(Issued));
        assert!(!Unissued.can_become(Used));
        for s in [Unissued, Issued, Used, Void] {
            assert_eq!(CodeStatus::from_i32(s.as_i32()), Some(s));
        }
        assert_eq!(CodeStatus::from_i32(7), None);
    }
}
