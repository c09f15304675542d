//! The checkpoints directory (`RUN_DIR/checkpoints/`): writing a checkpoint atomically,
//! verifying, pruning, setting aside an abandoned lineage, the `best` link, and the check
//! that the disk has room for the next one. The drafter group decides; this does.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use dflash_shared::checkpoint::{checksum_hex, finish_meta, step_of_dir, META_FILE, STATE_FILE};
use dflash_shared::drafter::DrafterConfig;

use crate::run::rundir::unix_ms;
use crate::training::group::CheckpointView;

/// Where the checkpoints of an abandoned lineage go, beside `checkpoints/`.
pub const ABANDONED_DIR: &str = "abandoned-checkpoints";

/// Why a checkpoint could not be written.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the checkpoint metadata: {0}")]
    Meta(#[from] serde_json::Error),
    #[error("writing {}: {source}", dir.display())]
    Write {
        dir: PathBuf,
        source: std::io::Error,
    },
}

/// Whether a filesystem has room for a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Room {
    /// Room for at least three more.
    Plenty,
    /// Room for this one, but fewer than three more.
    Low,
    /// Less free space than a checkpoint and a tenth.
    NoSpace,
    /// Fewer than 16 free inodes (a checkpoint makes a directory and three files).
    NoInodes,
}

impl Room {
    /// The verdict for `need` bytes with `free` bytes and `inodes` free inodes, on a
    /// filesystem that counts inodes (`counts_inodes`: some report none at all).
    pub fn of(need: u64, free: u64, inodes: u64, counts_inodes: bool) -> Room {
        if counts_inodes && inodes < 16 {
            Room::NoInodes
        } else if free < need + need / 10 {
            Room::NoSpace
        } else if free < 3 * need {
            Room::Low
        } else {
            Room::Plenty
        }
    }
}

/// The checkpoints directory of a run.
#[derive(Debug, Clone)]
pub struct CheckpointStore {
    dir: PathBuf,
    keep: usize,
}

impl CheckpointStore {
    /// The store in `dir`, keeping the newest `keep` checkpoints (at least one).
    pub fn new(dir: PathBuf, keep: usize) -> CheckpointStore {
        CheckpointStore {
            dir,
            keep: keep.max(1),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Remove the temporary directories of checkpoints (and, in `also`, of exports) that a
    /// crash interrupted: they are never complete.
    pub fn remove_unfinished(&self, also: &Path) {
        for dir in [self.dir.as_path(), also] {
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().contains(".tmp-") {
                    log::info!(
                        "removing {}, a checkpoint a crash left unfinished",
                        e.path().display()
                    );
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }

    /// The complete checkpoints (a `step-N` directory with its meta.json), by step.
    pub fn complete(&self) -> Vec<(u64, PathBuf)> {
        let mut done: Vec<(u64, PathBuf)> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let step = step_of_dir(&e.file_name().to_string_lossy())?;
                e.path().join(META_FILE).is_file().then(|| (step, e.path()))
            })
            .collect();
        done.sort();
        done
    }

    /// Write a checkpoint of `step` into `dir` (a directory of this store): `state` (the
    /// bytes of state.safetensors) and meta.json (`meta` with the state's checksum, then
    /// finished by [`finish_meta`]). Atomically: into a temporary directory, each file
    /// fsynced, renamed, the parent fsynced.
    pub fn write(
        &self,
        dir: &Path,
        state: &[u8],
        meta: &serde_json::Value,
    ) -> Result<(), StoreError> {
        let mut meta = meta.clone();
        meta["checksums"] = serde_json::json!({ STATE_FILE: checksum_hex(state) });
        let meta = finish_meta(&meta)?;
        let tmp = dir.with_extension(format!("tmp-{}", std::process::id()));
        let write = || -> std::io::Result<()> {
            let _ = std::fs::remove_dir_all(&tmp);
            std::fs::create_dir(&tmp)?;
            for (name, data) in [(STATE_FILE, state), (META_FILE, meta.as_bytes())] {
                let mut f = File::create(tmp.join(name))?;
                f.write_all(data)?;
                f.sync_all()?;
            }
            std::fs::rename(&tmp, dir)?;
            if let Some(parent) = dir.parent() {
                File::open(parent)?.sync_all()?;
            }
            Ok(())
        };
        write().map_err(|source| {
            let _ = std::fs::remove_dir_all(&tmp);
            StoreError::Write {
                dir: dir.to_path_buf(),
                source,
            }
        })
    }

    /// Keep the newest `keep` complete checkpoints, besides `protect` (the best one and the
    /// one whose τ is measured now: never pruned nor counted); remove the older ones.
    /// Returns what was removed.
    pub fn prune(&self, protect: &[u64]) -> Vec<PathBuf> {
        let mut done = self.complete();
        done.retain(|(s, _)| !protect.contains(s));
        let n = done.len().saturating_sub(self.keep);
        let old: Vec<PathBuf> = done.into_iter().take(n).map(|(_, p)| p).collect();
        for p in &old {
            let _ = std::fs::remove_dir_all(p);
        }
        old
    }

    /// Move the checkpoints of steps after `to` (complete or not) to
    /// `abandoned-checkpoints/NAME-MS` beside this directory. Returns where they went.
    pub fn set_aside_after(&self, to: u64) -> Vec<PathBuf> {
        let aside = self.dir.with_file_name(ABANDONED_DIR);
        let mut moved = Vec::new();
        for e in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if step_of_dir(&name).is_none_or(|s| s <= to) {
                continue;
            }
            let _ = std::fs::create_dir_all(&aside);
            let dst = aside.join(format!("{name}-{}", unix_ms()));
            match std::fs::rename(e.path(), &dst) {
                Ok(()) => {
                    log::info!(
                        "{} belongs to the abandoned lineage: moved to {}",
                        e.path().display(),
                        dst.display()
                    );
                    moved.push(dst);
                }
                Err(err) => log::warn!("cannot move {} aside: {err}", e.path().display()),
            }
        }
        moved
    }

    /// Point `checkpoints/best` at the checkpoint of `step`.
    pub fn link_best(&self, step: u64) -> std::io::Result<()> {
        crate::training::eval::link_best(&self.dir, step)
    }

    /// Remove `checkpoints/best`.
    pub fn unlink_best(&self) {
        let _ = std::fs::remove_file(self.dir.join(crate::training::eval::BEST_LINK));
    }

    /// The free space (bytes) and inodes of this directory's filesystem, and whether it
    /// counts inodes at all; `None` when it cannot be asked.
    fn free(&self) -> Option<(u64, u64, bool)> {
        let st = nix::sys::statvfs::statvfs(&self.dir).ok()?;
        // The field types differ between platforms (u64 here).
        #[allow(clippy::unnecessary_cast)]
        let free = st.blocks_available() as u64 * st.fragment_size() as u64;
        #[allow(clippy::unnecessary_cast)]
        let inodes = st.files_available() as u64;
        Some((free, inodes, st.files() > 0))
    }
}

impl CheckpointView for CheckpointStore {
    fn verify(
        &self,
        dir: &Path,
        drafter: &DrafterConfig,
    ) -> Result<u64, dflash_shared::checkpoint::Refused> {
        dflash_shared::checkpoint::verify(dir, serde_json::to_value(drafter).ok().as_ref())
    }

    fn is_complete(&self, step: u64) -> bool {
        self.dir_of(step).join(META_FILE).is_file()
    }

    fn newest_complete(&self, at_most: u64) -> Option<(u64, PathBuf)> {
        self.complete().into_iter().rfind(|(s, _)| *s <= at_most)
    }

    /// Why not (with what to free), and warns while there is room for fewer than three more.
    fn room_for(&self, step: u64, need: u64) -> Result<(), String> {
        let Some((free, inodes, counts_inodes)) = self.free() else {
            return Ok(());
        };
        let human = crate::data::pipeline::human;
        let dir = self.dir.display();
        match Room::of(need, free, inodes, counts_inodes) {
            Room::NoInodes => Err(format!(
                "no free inodes left on the filesystem of {dir} ({inodes} free) for the checkpoint of step {step}: delete files there (df -i)"
            )),
            Room::NoSpace => Err(format!(
                "not enough free space in {dir} for the checkpoint of step {step} (needs {}, {} free): free at least {} there (df -h)",
                human(need + need / 10),
                human(free),
                human((need + need / 10).saturating_sub(free))
            )),
            Room::Low => {
                log::warn!(
                    "the disk of {dir} has room for fewer than 3 more checkpoints ({} free, {} each)",
                    human(free),
                    human(need)
                );
                Ok(())
            }
            Room::Plenty => Ok(()),
        }
    }

    fn dir_of(&self, step: u64) -> PathBuf {
        self.dir.join(format!("step-{step:08}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(keep: usize) -> (tempfile::TempDir, CheckpointStore) {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("checkpoints");
        std::fs::create_dir_all(&dir).unwrap();
        (d, CheckpointStore::new(dir, keep))
    }

    fn state(values: &[f32]) -> Vec<u8> {
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(
            safetensors::Dtype::F32,
            vec![values.len()],
            &data,
        )
        .unwrap();
        safetensors::serialize([("params", view)], None).unwrap()
    }

    fn write(s: &CheckpointStore, step: u64) -> PathBuf {
        let dir = s.dir_of(step);
        s.write(
            &dir,
            &state(&[1.0, 2.0]),
            &serde_json::json!({"step": step}),
        )
        .unwrap();
        dir
    }

    #[test]
    fn a_written_checkpoint_is_complete_and_verifies_and_leaves_no_temporary() {
        let (_d, s) = store(3);
        let dir = write(&s, 4);
        assert!(s.is_complete(4) && !s.is_complete(5));
        assert_eq!(dflash_shared::checkpoint::verify(&dir, None), Ok(4));
        let names: Vec<String> = std::fs::read_dir(s.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["step-00000004"]);
        // A write into a directory that cannot be made fails, naming it.
        let e = s
            .write(
                Path::new("/nonexistent/x/step-1"),
                &state(&[1.0]),
                &serde_json::json!({"step": 1}),
            )
            .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/x/step-1"), "{e}");
    }

    #[test]
    fn pruning_keeps_the_newest_and_the_protected_one() {
        let (_d, s) = store(2);
        for step in [1, 2, 3, 4, 5] {
            write(&s, step);
        }
        // Unfinished (no meta.json): neither counted nor removed.
        std::fs::create_dir_all(s.dir_of(9)).unwrap();
        let removed = s.prune(&[2]);
        assert_eq!(removed, [s.dir_of(1), s.dir_of(3)]);
        let left: Vec<u64> = s.complete().into_iter().map(|(st, _)| st).collect();
        assert_eq!(left, [2, 4, 5]);
        assert!(s.dir_of(9).is_dir());
    }

    #[test]
    fn setting_aside_moves_the_newer_steps_and_the_newest_left_is_found() {
        let (d, s) = store(5);
        for step in [2, 4, 6] {
            write(&s, step);
        }
        assert_eq!(s.newest_complete(5), Some((4, s.dir_of(4))));
        let moved = s.set_aside_after(4);
        assert_eq!(moved.len(), 1);
        assert!(moved[0].starts_with(d.path().join(ABANDONED_DIR)));
        assert!(moved[0].join(META_FILE).is_file(), "moved whole");
        assert_eq!(s.newest_complete(u64::MAX), Some((4, s.dir_of(4))));
        assert_eq!(s.newest_complete(1), None);
    }

    #[test]
    fn unfinished_temporaries_are_removed_at_the_start() {
        let (d, s) = store(5);
        let kept = write(&s, 2);
        std::fs::create_dir_all(s.dir().join("step-00000003.tmp-77")).unwrap();
        std::fs::create_dir_all(d.path().join("drafter.tmp-12")).unwrap();
        s.remove_unfinished(d.path());
        assert!(kept.is_dir());
        assert!(!s.dir().join("step-00000003.tmp-77").exists());
        assert!(!d.path().join("drafter.tmp-12").exists());
    }

    #[test]
    fn room_needs_a_tenth_over_the_checkpoint_and_warns_under_three() {
        assert_eq!(Room::of(100, 109, 1000, true), Room::NoSpace);
        assert_eq!(Room::of(100, 110, 1000, true), Room::Low);
        assert_eq!(Room::of(100, 299, 1000, true), Room::Low);
        assert_eq!(Room::of(100, 300, 1000, true), Room::Plenty);
        assert_eq!(Room::of(100, 300, 15, true), Room::NoInodes);
        assert_eq!(
            Room::of(100, 300, 0, false),
            Room::Plenty,
            "no inode counts"
        );
    }

    #[test]
    fn the_best_link_points_at_its_step_and_goes() {
        let (_d, s) = store(5);
        write(&s, 3);
        s.link_best(3).unwrap();
        let best = s.dir().join(crate::training::eval::BEST_LINK);
        assert!(best.join(META_FILE).is_file());
        s.unlink_best();
        assert!(std::fs::symlink_metadata(&best).is_err());
    }
}
