//! The job's secret: 32 random bytes the leader writes into the run directory (which every
//! node shares), readable by the job's user only. A follower proves it read it by a MAC
//! of the leader's challenge, and the leader proves it by a MAC of the follower's, so
//! neither a stranger on the network nor a stale leader can take part.

use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The file in the run directory.
pub const FILE: &str = "cluster.secret";

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a secret this version wrote (expected 64 hex digits)", path.display())]
    Malformed { path: PathBuf },
    #[error("{}: readable by others (mode {mode:o}; expected 600, the job's user only)", path.display())]
    Exposed { path: PathBuf, mode: u32 },
    #[error("{}: exists and is not a secret this program wrote (not replaced; expected the run directory of a job across nodes, or a new one)", path.display())]
    NotOurs { path: PathBuf },
}

#[derive(Clone)]
pub struct Secret([u8; 32]);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// `n` bytes from the kernel's random source.
pub fn random<const N: usize>() -> Result<[u8; N], std::io::Error> {
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b)
}

impl Secret {
    /// A new secret for this session of the job, in `dir/cluster.secret` (mode 600,
    /// written aside and renamed over an earlier session's).
    pub fn create(dir: &Path) -> Result<Secret, SecretError> {
        let path = dir.join(FILE);
        let io = |source| SecretError::Io {
            path: path.clone(),
            source,
        };
        // Only an earlier session's secret is replaced: a plain file of 64 hex digits, the
        // user's alone (never a link, nor anything else of that name).
        match std::fs::symlink_metadata(&path) {
            Ok(m) if !m.file_type().is_file() => return Err(SecretError::NotOurs { path }),
            Ok(_) => {
                Secret::read(dir).map_err(|_| SecretError::NotOurs { path: path.clone() })?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(e)),
        }
        let secret = Secret(random().map_err(io)?);
        let tmp = dir.join(format!(".{FILE}.{}", std::process::id()));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io)?;
        let written = f
            .write_all(hex(&secret.0).as_bytes())
            .and_then(|_| f.sync_all())
            .and_then(|_| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(e));
        }
        Ok(secret)
    }

    /// The secret a leader wrote into `dir`.
    pub fn read(dir: &Path) -> Result<Secret, SecretError> {
        let path = dir.join(FILE);
        let io = |source| SecretError::Io {
            path: path.clone(),
            source,
        };
        let meta = std::fs::metadata(&path).map_err(io)?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(SecretError::Exposed { path, mode });
        }
        let text = std::fs::read_to_string(&path).map_err(io)?;
        let bytes =
            unhex(text.trim()).ok_or_else(|| SecretError::Malformed { path: path.clone() })?;
        let b: [u8; 32] = bytes
            .try_into()
            .map_err(|_| SecretError::Malformed { path })?;
        Ok(Secret(b))
    }

    fn mac(&self, parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("any key length");
        for p in parts {
            // Length-prefixed, so that no two different part lists MAC alike.
            m.update(&(p.len() as u64).to_le_bytes());
            m.update(p);
        }
        m
    }

    /// The MAC of `parts` under this secret, in hex.
    pub fn sign(&self, parts: &[&[u8]]) -> String {
        hex(&self.mac(parts).finalize().into_bytes())
    }

    /// Whether `tag` (hex) is the MAC of `parts`, compared in constant time.
    pub fn verify(&self, parts: &[&[u8]], tag: &str) -> bool {
        unhex(tag).is_some_and(|t| self.mac(parts).verify_slice(&t).is_ok())
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 || s.len() > 1024 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_secret_is_the_users_alone_and_macs_check_in_both_directions() {
        let d = tempfile::tempdir().unwrap();
        let s = Secret::create(d.path()).unwrap();
        let mode = std::fs::metadata(d.path().join(FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let r = Secret::read(d.path()).unwrap();
        let tag = s.sign(&[b"join", b"nonce", b"1"]);
        assert!(r.verify(&[b"join", b"nonce", b"1"], &tag));
        assert!(!r.verify(&[b"join", b"nonce", b"2"], &tag));
        assert!(
            !r.verify(&[b"join", b"nonc", b"e1"], &tag),
            "parts are delimited"
        );
        assert!(!r.verify(&[b"join", b"nonce", b"1"], "zz"));
        // A new session's secret replaces the old: the old one's MACs no longer pass.
        let s2 = Secret::create(d.path()).unwrap();
        assert!(!s2.verify(&[b"join", b"nonce", b"1"], &tag));
        assert_eq!(
            std::fs::read_dir(d.path()).unwrap().count(),
            1,
            "no temporary left"
        );
        // Readable by others: refused, naming the mode.
        std::fs::set_permissions(d.path().join(FILE), std::fs::Permissions::from_mode(0o644))
            .unwrap();
        let e = Secret::read(d.path()).unwrap_err().to_string();
        assert!(e.contains("mode 644") && e.contains("expected 600"), "{e}");
        std::fs::write(d.path().join(FILE), "xyz").unwrap();
        std::fs::set_permissions(d.path().join(FILE), std::fs::Permissions::from_mode(0o600))
            .unwrap();
        assert!(matches!(
            Secret::read(d.path()),
            Err(SecretError::Malformed { .. })
        ));
    }
}
