//! Codes: the secrets codepool hands out, their lifecycle and their masking.

use std::fmt;

/// Longest code the importer accepts. Partner codes are short; anything
/// longer is a broken row, not a code.
pub const MAX_CODE_LEN: usize = 128;

/// Where a code is in its life. Stored as a small integer in MongoDB
/// (`status`), because the claim's conditional update matches on it.
///
/// The allowed moves are the [`Transition`]s: 0→1 claim, 1→2 redeem, 0→3
/// and 1→3 void, 0→3 expire, 0→4 hold, 4→0 release, 4→1 commit. An issued
/// code never returns to 0: the buyer has already seen it. A held code
/// (claimed for a checkout hold or a bundle that is not whole yet) was
/// shown to no one, so it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CodeStatus {
    Unissued = 0,
    Issued = 1,
    Used = 2,
    Void = 3,
    /// Claimed for a checkout hold (or a bundle being put together): no
    /// one else gets it, and no one sees it until it is committed.
    Held = 4,
}

impl CodeStatus {
    pub const ALL: [CodeStatus; 5] = [
        Self::Unissued,
        Self::Issued,
        Self::Used,
        Self::Void,
        Self::Held,
    ];

    pub fn as_i32(self) -> i32 {
        self as i32
    }

    pub fn from_i32(v: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_i32() == v)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Unissued => "unissued",
            Self::Issued => "issued",
            Self::Used => "used",
            Self::Void => "void",
            Self::Held => "held",
        }
    }

    /// Parses a status name as operators type it (`issued`, `used`, …).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name.trim())
    }

    /// Whether some [`Transition`] moves a code from `self` to `to`.
    pub fn can_become(self, to: CodeStatus) -> bool {
        Transition::ALL
            .iter()
            .any(|t| t.to() == to && t.from().contains(&self))
    }
}

impl fmt::Display for CodeStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The moves of a code's lifecycle, defined once, in the gate
/// ([`crate::gate::Move`]). The store builds its conditional updates from
/// [`Transition::from`] and [`Transition::to`], so what MongoDB enforces
/// and what the domain says are the same rule.
pub type Transition = crate::gate::Move;

/// The identity of a code document: MongoDB's 12-byte ObjectId, kept as
/// bytes so the domain needs no database types. Parsing is strict: a
/// malformed id is an error, never skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CodeId([u8; 12]);

/// A string that is not a code id (24 hex digits).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a code id (24 hexadecimal digits)")]
pub struct InvalidCodeId(pub String);

impl CodeId {
    pub const fn from_bytes(bytes: [u8; 12]) -> Self {
        Self(bytes)
    }

    pub fn bytes(&self) -> [u8; 12] {
        self.0
    }

    pub fn parse(hex: &str) -> Result<Self, InvalidCodeId> {
        let bad = || InvalidCodeId(hex.chars().take(40).collect());
        if hex.len() != 24 || !hex.is_ascii() {
            return Err(bad());
        }
        let mut out = [0u8; 12];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self(out))
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Display for CodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Why a CSV field is not a usable code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidCode {
    #[error("the code is empty")]
    Empty,
    #[error("the code is {0} characters long; at most {MAX_CODE_LEN} are allowed")]
    TooLong(usize),
    /// A character a buyer cannot see or type ([`crate::text`]).
    #[error("the code contains {0}; a buyer can neither see nor type it, so ask the partner for a clean file")]
    Unreadable(crate::text::UnreadableChar),
}

/// Trims a raw field (ASCII whitespace at its ends) and checks it is a code
/// codepool can store and send: not empty, at most [`MAX_CODE_LEN`]
/// characters, and no character a buyer cannot read or type: controls,
/// format characters, private-use or unassigned code points, or whitespace
/// other than an inner ASCII space.
pub fn validate_code(raw: &str) -> Result<&str, InvalidCode> {
    let code = raw.trim_ascii();
    if code.is_empty() {
        return Err(InvalidCode::Empty);
    }
    let len = code.chars().count();
    if len > MAX_CODE_LEN {
        return Err(InvalidCode::TooLong(len));
    }
    if let Some(bad) = crate::text::first_unreadable(code) {
        return Err(InvalidCode::Unreadable(bad));
    }
    Ok(code)
}

/// Masks a code for logs, listings and metrics. At most a quarter of its
/// characters stay visible, split between the two ends (`QWER-1234` →
/// `Q*******4`, `83917` → `8****`); codes under four characters are fully
/// masked, and never shown shorter than four stars.
pub fn mask(code: &str) -> String {
    let chars: Vec<char> = code.chars().collect();
    let shown = chars.len() / 4;
    if shown == 0 {
        return "*".repeat(chars.len().max(4));
    }
    let (head, tail) = (shown.div_ceil(2), shown / 2);
    let mut out = String::with_capacity(chars.len());
    out.extend(&chars[..head]);
    out.extend(std::iter::repeat_n('*', chars.len() - shown));
    out.extend(&chars[chars.len() - tail..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masking_shows_at_most_a_quarter_split_between_the_ends() {
        assert_eq!(mask("QWER-1234"), "Q*******4");
        assert_eq!(mask("QWERTY34"), "Q******4");
        assert_eq!(mask("83917"), "8****");
        assert_eq!(mask("ABCDEFGHIJKL"), "AB*********L");
    }

    #[test]
    fn short_codes_are_fully_masked() {
        assert_eq!(mask("AB"), "****");
        assert_eq!(mask("ABC"), "****");
        assert_eq!(mask("ABCD"), "A***");
    }

    #[test]
    fn masking_counts_characters_not_bytes() {
        assert_eq!(mask("ÄÖÜßéè"), "Ä*****");
    }

    proptest::proptest! {
        #[test]
        fn a_mask_never_shows_more_than_a_quarter(code in "\\PC{0,40}") {
            let shown = mask(&code).chars().filter(|c| *c != '*').count();
            proptest::prop_assert!(shown <= code.chars().count() / 4);
        }
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
        let Err(InvalidCode::Unreadable(bad)) = validate_code("AB\u{7}C") else {
            panic!("a control character passed");
        };
        assert_eq!((bad.position, bad.ch), (3, '\u{7}'));
        for hidden in [
            "LOOK\u{200b}123",
            "LO\u{ad}OK123",
            "\u{202e}LOOK123",
            "LOOK123\u{a0}",
        ] {
            assert!(
                matches!(validate_code(hidden), Err(InvalidCode::Unreadable(_))),
                "{hidden:?}"
            );
        }
        let reason = validate_code("LOOK\u{200b}123").unwrap_err().to_string();
        assert!(reason.contains("U+200B"), "{reason}");
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

    #[test]
    fn every_transition_is_an_allowed_move_and_only_a_held_code_returns_to_unissued() {
        for t in Transition::ALL {
            for from in t.from() {
                assert!(from.can_become(t.to()), "{t:?} from {from}");
            }
        }
        for s in CodeStatus::ALL {
            assert_eq!(
                s.can_become(CodeStatus::Unissued),
                s == CodeStatus::Held,
                "{s}"
            );
        }
        assert!(CodeStatus::Held.can_become(CodeStatus::Issued));
        // Expiry and recall take a code out of a live hold.
        assert!(CodeStatus::Held.can_become(CodeStatus::Void));
    }

    #[test]
    fn transitions_start_where_the_lifecycle_says() {
        assert_eq!(Transition::Claim.from_codes(), vec![0]);
        assert_eq!(Transition::Redeem.from_codes(), vec![1]);
        assert_eq!(Transition::Void.from_codes(), vec![0, 1]);
        assert_eq!(Transition::Expire.from_codes(), vec![0, 4]);
        assert_eq!(Transition::Recall.from_codes(), vec![0, 4]);
        assert_eq!(Transition::Expire.to(), CodeStatus::Void);
    }

    #[test]
    fn status_names_round_trip() {
        for s in CodeStatus::ALL {
            assert_eq!(CodeStatus::from_name(s.name()), Some(s));
        }
        assert_eq!(CodeStatus::from_name("sold"), None);
    }

    #[test]
    fn code_ids_parse_strictly() {
        let id = CodeId::parse("65a1b2c3d4e5f60718293a4b").unwrap();
        assert_eq!(id.to_hex(), "65a1b2c3d4e5f60718293a4b");
        assert_eq!(CodeId::from_bytes(id.bytes()), id);
        for bad in [
            "",
            "65a1",
            "65a1b2c3d4e5f60718293a4g",
            "65a1b2c3d4e5f60718293a4b00",
            "é5a1b2c3d4e5f60718293a4",
        ] {
            assert!(CodeId::parse(bad).is_err(), "{bad}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_code_id_survives_hex(bytes in proptest::array::uniform12(proptest::num::u8::ANY)) {
            let id = CodeId::from_bytes(bytes);
            proptest::prop_assert_eq!(CodeId::parse(&id.to_hex()), Ok(id));
        }
    }
}
