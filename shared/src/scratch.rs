//! A scratch directory of this process's own: made with `create_dir` under the system's
//! temporary directory (a name nothing held before, so never a user's path), removed when
//! dropped, on every return path.

use std::path::{Path, PathBuf};

#[derive(Debug)]
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// `$TMPDIR/dflash-WHAT-PID-N`, created now.
    pub fn new(what: &str) -> std::io::Result<ScratchDir> {
        let base = std::env::temp_dir();
        for n in 0..10_000u32 {
            let path = base.join(format!("dflash-{what}-{}-{n}", std::process::id()));
            match std::fs::create_dir(&path) {
                Ok(()) => return Ok(ScratchDir { path }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!("no free name for dflash-{what}-* in {}", base.display()),
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scratch_dir_is_new_its_own_and_gone_when_dropped_leaving_others_alone() {
        // A directory already holding the first name is not taken (nor removed).
        let first =
            std::env::temp_dir().join(format!("dflash-scratch-test-{}-0", std::process::id()));
        std::fs::create_dir_all(&first).unwrap();
        std::fs::write(first.join("mine"), b"x").unwrap();
        let s = ScratchDir::new("scratch-test").unwrap();
        assert_ne!(s.path(), first.as_path());
        assert!(s.path().is_dir() && std::fs::read_dir(s.path()).unwrap().next().is_none());
        std::fs::write(s.path().join("f"), b"y").unwrap();
        let p = s.path().to_path_buf();
        drop(s);
        assert!(!p.exists());
        assert!(first.join("mine").is_file());
        std::fs::remove_dir_all(&first).unwrap();
    }
}
