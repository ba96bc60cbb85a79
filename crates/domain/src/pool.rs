//! Pools: a named stock of codes for one product (`game-x`).

use std::fmt;

/// A validated pool name. Pool names end up in Redis keys, metric labels and
/// routing keys, so they are kept to a safe alphabet.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Pool(String);

/// Why a string is not a usable pool name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid pool name {name:?}: use 1 to {max} characters from A-Z a-z 0-9 . _ -, starting with a letter or a digit")]
pub struct InvalidPoolName {
    pub name: String,
    pub max: usize,
}

impl Pool {
    pub const MAX_LEN: usize = 64;

    pub fn new(name: &str) -> Result<Self, InvalidPoolName> {
        let ok = name.len() <= Self::MAX_LEN
            && name
                .bytes()
                .next()
                .is_some_and(|b| b.is_ascii_alphanumeric())
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if ok {
            Ok(Self(name.to_owned()))
        } else {
            Err(InvalidPoolName {
                name: name.chars().take(80).collect(),
                max: Self::MAX_LEN,
            })
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_names_use_a_safe_alphabet() {
        assert!(Pool::new("game-x").is_ok());
        assert!(Pool::new("Game_2.eu").is_ok());
        assert!(Pool::new("").is_err());
        assert!(Pool::new("a b").is_err());
        assert!(Pool::new("x{y}").is_err());
        assert!(Pool::new(&"p".repeat(65)).is_err());
        for leading in [".", "..", "-x", "_x", ".hidden"] {
            assert!(Pool::new(leading).is_err(), "{leading:?}");
        }
        assert!(Pool::new("9lives").is_ok());
    }
}
