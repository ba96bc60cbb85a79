//! Crockford base32, the symbols of generated codes, and its mod-37 check
//! symbol (<https://www.crockford.com/base32.html>).
//!
//! The 32 symbols are `0123456789ABCDEFGHJKMNPQRSTVWXYZ`: no I, L, O or U,
//! so a code read aloud or typed from paper has no look-alike letters. The
//! check symbol is the value of the code's symbols, read as one base-32
//! number, modulo 37; the values 32 to 36 are written `*`, `~`, `$`, `=`,
//! `U`. Because 37 is a prime above 32, a wrong symbol or two neighbours
//! swapped always change it.
//!
//! **What the check covers.** A code that carries a check symbol ends with
//! it, and it covers every other character of the code, fixed text and the
//! daily number included, with hyphens ignored (they are for reading only):
//! `GX-7K3P-M9QD-Z` is checked as the number `GX7K3PM9QD` and the symbol
//! `Z`. So a pattern with a check symbol holds only base-32 symbols and
//! hyphens, and any reader can verify a code without knowing its pattern,
//! as the `base32-crockford` Python package's `decode(code, checksum=True)`
//! does. Reading, like that package, is case-insensitive and takes `I` and
//! `L` for `1` and `O` for `0`: the check never refuses a code that a pool
//! folding look-alikes would find.

/// The 32 symbols, by value.
pub const ALPHABET: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
/// The check symbols of the values 32 to 36.
pub const CHECK_EXTRA: &[u8; 5] = b"*~$=U";
/// Random bits in one symbol.
pub const BITS_PER_SYMBOL: u32 = 5;

/// The value of a symbol (0..32), read the forgiving way: any case, `I`
/// and `L` as `1`, `O` as `0`. `None` for anything else (hyphens included).
pub fn value_of(c: char) -> Option<u8> {
    let c = match c.to_ascii_uppercase() {
        'I' | 'L' => '1',
        'O' => '0',
        c => c,
    };
    ALPHABET
        .iter()
        .position(|&s| char::from(s) == c)
        .map(|v| v as u8)
}

/// The symbol of a value; the value is taken modulo 32.
pub fn symbol(value: u8) -> char {
    char::from(ALPHABET[usize::from(value % 32)])
}

/// `n` random symbols from `bytes` (one byte a symbol, its low five bits:
/// every symbol equally likely). Pure: the caller brings the randomness,
/// from the operating system's CSPRNG.
pub fn encode_random(bytes: &[u8], n: usize) -> String {
    bytes.iter().take(n).map(|b| symbol(b & 31)).collect()
}

/// The check symbol of `symbols` (hyphens ignored), or `None` when one of
/// them is not a base-32 symbol.
pub fn check_symbol(symbols: &str) -> Option<char> {
    let mut rest = 0u32;
    for c in symbols.chars().filter(|&c| c != '-') {
        rest = (rest * 32 + u32::from(value_of(c)?)) % 37;
    }
    Some(check_char_of(rest))
}

/// The symbol written for a check value (0..37).
fn check_char_of(value: u32) -> char {
    match value {
        v @ 0..=31 => symbol(v as u8),
        v => char::from(CHECK_EXTRA[(v - 32) as usize % 5]),
    }
}

/// Whether `code` ends with the right check symbol for the rest of it
/// (hyphens ignored). False for a code with a character that is neither a
/// symbol nor a hyphen, or with nothing before its check symbol.
pub fn check_ok(code: &str) -> bool {
    let body = code.trim_end_matches('-');
    let Some(last) = body.chars().last() else {
        return false;
    };
    let head = &body[..body.len() - last.len_utf8()];
    if !head.chars().any(|c| c != '-') {
        return false;
    }
    let written = last.to_ascii_uppercase();
    let written = match written {
        'I' | 'L' => '1',
        'O' => '0',
        c => c,
    };
    check_symbol(head) == Some(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alphabet_has_no_i_l_o_or_u() {
        for c in ['I', 'L', 'O', 'U'] {
            assert!(!ALPHABET.contains(&(c as u8)));
        }
        assert_eq!(encode_random(&[0, 31, 32, 255, 10], 5), "0Z0ZA");
    }

    #[test]
    fn check_symbols_match_crockfords_examples() {
        // base32_crockford.encode(1234, checksum=True) == "16JD"
        assert_eq!(check_symbol("16J"), Some('D'));
        assert!(check_ok("16JD"));
        assert!(check_ok("16-j-d"));
        assert_eq!(check_symbol("0"), Some('0'));
        // 32 % 37 = 32 → '*'; 36 → 'U'
        assert_eq!(check_symbol("10"), Some('*'));
        assert_eq!(check_symbol("14"), Some('U'));
        assert!(check_ok("14U"));
        assert!(!check_ok("14V"));
        assert!(!check_ok("U"));
        assert!(!check_ok(""));
        assert!(!check_ok("A_B"));
    }

    #[test]
    fn every_single_change_and_every_swap_of_neighbours_is_caught() {
        let code = "GX7K3PM9QDZ2";
        let full = format!("{code}{}", check_symbol(code).unwrap());
        assert!(check_ok(&full));
        let chars: Vec<char> = full.chars().collect();
        for i in 0..chars.len() {
            for s in ALPHABET.iter().chain(CHECK_EXTRA).map(|&b| char::from(b)) {
                if s == chars[i] {
                    continue;
                }
                let mut changed = chars.clone();
                changed[i] = s;
                let changed: String = changed.into_iter().collect();
                assert!(!check_ok(&changed), "{changed} passes");
            }
            if i + 1 < chars.len() && chars[i] != chars[i + 1] {
                let mut swapped = chars.clone();
                swapped.swap(i, i + 1);
                let swapped: String = swapped.into_iter().collect();
                assert!(!check_ok(&swapped), "{swapped} passes");
            }
        }
    }
}
