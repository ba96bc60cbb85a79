//! The key file: JSON, mode 0600, never overwritten by `init`.
//!
//! ```json
//! {"version":1,"active":"k2","hmac":"<64 hex>","keys":{"k1":"<64 hex>","k2":"<64 hex>"}}
//! ```
//!
//! Losing this file loses every code encrypted under it: back it up.
//! Changes (`keys add`) are written to a temporary file beside it and
//! renamed over it, so a crash never leaves half a key file.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use crate::{Keyring, Secret, VaultError, KEY_LEN};

const VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyFile {
    version: u32,
    active: String,
    hmac: String,
    keys: BTreeMap<String, String>,
}

/// `$XDG_CONFIG_HOME/codepool/keys.json`, else `~/.config/codepool/keys.json`.
pub fn default_path() -> PathBuf {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
        .unwrap_or_else(|| PathBuf::from("."));
    base.join("codepool").join("keys.json")
}

fn shown(path: &Path) -> String {
    path.display().to_string()
}

fn io(path: &Path, e: std::io::Error) -> VaultError {
    VaultError::Io {
        path: shown(path),
        message: e.to_string(),
    }
}

fn secret(path: &Path, name: &str, text: &str) -> Result<Secret, VaultError> {
    let mut out = Zeroizing::new([0u8; KEY_LEN]);
    hex::decode_to_slice(text, out.as_mut()).map_err(|e| VaultError::Invalid {
        path: shown(path),
        message: format!("key {name:?} is not {KEY_LEN} bytes of hex: {e}"),
    })?;
    Ok(out)
}

/// Reads the key file at `path`. Refuses a file other users can read.
pub fn load(path: &Path) -> Result<Keyring, VaultError> {
    let meta = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(VaultError::Missing { path: shown(path) })
        }
        Err(e) => return Err(io(path, e)),
    };
    if meta.is_dir() {
        return Err(VaultError::Io {
            path: shown(path),
            message: "it is a directory, not a key file; point CODEPOOL_KEY_FILE (or --key-file) at the key file itself, e.g. a keys.json created by `codepool keys init`".into(),
        });
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(VaultError::Permissions {
            path: shown(path),
            mode,
        });
    }
    let text = Zeroizing::new(fs::read_to_string(path).map_err(|e| io(path, e))?);
    let invalid = |message: String| VaultError::Invalid {
        path: shown(path),
        message,
    };
    let file: KeyFile = serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
    if file.version != VERSION {
        return Err(invalid(format!("unknown version {}", file.version)));
    }
    let mut keys = BTreeMap::new();
    for (id, hex_key) in &file.keys {
        keys.insert(id.clone(), secret(path, id, hex_key)?);
    }
    let hmac = secret(path, "hmac", &file.hmac)?;
    Keyring::from_parts(file.active, keys, hmac).map_err(invalid)
}

fn encode(ring: &Keyring) -> Zeroizing<String> {
    let file = KeyFile {
        version: VERSION,
        active: ring.active_id().to_owned(),
        hmac: hex::encode(ring.hmac_key().as_ref()),
        keys: ring
            .key_ids()
            .filter_map(|id| Some((id.to_owned(), hex::encode(ring.key(id)?.as_ref()))))
            .collect(),
    };
    let text = serde_json::to_string_pretty(&file).expect("a key file always serializes");
    Zeroizing::new(text + "\n")
}

/// Creates the file with mode 0600 (its folder 0700 when new); fails when
/// anything exists at `path`.
fn write_new(path: &Path, text: &str) -> Result<(), VaultError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| io(dir, e))?;
    }
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => VaultError::Exists { path: shown(path) },
            _ => io(path, e),
        })?;
    f.write_all(text.as_bytes()).map_err(|e| io(path, e))?;
    f.sync_all().map_err(|e| io(path, e))
}

/// `codepool keys init`: a new key file with a fresh ring. Never
/// overwrites an existing file.
pub fn init(path: &Path) -> Result<Keyring, VaultError> {
    let ring = Keyring::generate();
    write_new(path, &encode(&ring))?;
    Ok(ring)
}

/// `codepool keys add`: a new random key, made active, written back
/// atomically. Returns the ring and the new key's id.
pub fn add_key(path: &Path) -> Result<(Keyring, String), VaultError> {
    let mut ring = load(path)?;
    let id = ring.add_key();
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    write_new(&tmp, &encode(&ring))?;
    fs::rename(&tmp, path).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        io(path, e)
    })?;
    Ok((ring, id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_writes_a_private_file_and_never_overwrites_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/keys.json");
        let ring = init(&path).unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(matches!(init(&path), Err(VaultError::Exists { .. })));
        let again = load(&path).unwrap();
        assert_eq!(again.code_hmac("p", "c"), ring.code_hmac("p", "c"));
        let s = ring.seal(b"x", "CODE");
        assert_eq!(again.open("k1", b"x", &s.bytes).unwrap(), "CODE");
    }

    #[test]
    fn add_makes_a_new_active_key_and_keeps_the_old_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let ring = init(&path).unwrap();
        let old = ring.seal(b"x", "CODE");
        let (_, id) = add_key(&path).unwrap();
        assert_eq!(id, "k2");
        let loaded = load(&path).unwrap();
        assert_eq!(loaded.active_id(), "k2");
        assert_eq!(loaded.open("k1", b"x", &old.bytes).unwrap(), "CODE");
        assert_eq!(loaded.code_hmac("p", "c"), ring.code_hmac("p", "c"));
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn a_missing_or_readable_file_is_refused_with_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let e = load(&path).unwrap_err();
        assert!(e.to_string().contains("codepool keys init"), "{e}");
        init(&path).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let e = load(&path).unwrap_err();
        assert!(e.to_string().contains("chmod 600"), "{e}");
        let e = load(dir.path()).unwrap_err().to_string();
        assert!(e.contains("is a directory") && !e.contains("chmod"), "{e}");
    }
}
