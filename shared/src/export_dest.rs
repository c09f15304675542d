//! Where an export may write: `dflash-supervise export --out DIR` and a run's own end
//! (`RUN_DIR/drafter`) replace a destination only when it is itself an export of this tool
//! (recognised by its files) or an empty directory; anything else is refused with one line,
//! and nothing that the export did not create is ever removed.
//!
//! An export is written into a fresh directory of its own beside the destination (a unique
//! name made with `create_dir`, never derived from the destination by replacing an
//! extension), then renamed into place; a replaced export is first renamed aside under a
//! unique name, and removed only once the new one is in place.

use std::path::{Path, PathBuf};

/// The files of an exported drafter directory (config, weights, the model code that
/// transformers loads with `trust_remote_code`).
pub const EXPORT_FILES: [&str; 3] = ["config.json", "model.safetensors", "dflash_drafter.py"];

/// What is at an export's destination now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// Nothing: the export is renamed to it.
    Fresh,
    /// An empty directory, which the finished export replaces.
    Empty,
    /// An earlier export of this tool, renamed aside and removed once the new one is in place.
    Export,
}

/// Why a destination is refused (the one line the user sees).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused(pub String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// Whether `dir` holds exactly an export of this tool: only [`EXPORT_FILES`] (all of them),
/// its config naming the DFlash fields this tool writes.
pub fn is_export(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    let mut names: Vec<String> = Vec::new();
    for e in entries {
        let Ok(e) = e else { return false };
        names.push(e.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    let mut want: Vec<String> = EXPORT_FILES.iter().map(|s| s.to_string()).collect();
    want.sort();
    if names != want {
        return false;
    }
    let Ok(text) = std::fs::read_to_string(dir.join("config.json")) else {
        return false;
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return false;
    };
    v.get("dflash_config").is_some() && v.get("block_size").is_some()
}

/// Check an export's destination before anything is written.
pub fn check(dir: &Path) -> Result<Destination, Refused> {
    let shown = dir.display();
    if dir.file_name().is_none() {
        return Err(Refused(format!(
            "--out {shown}: expected a path that names a new directory (not `.`, `..` or `/`)"
        )));
    }
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Destination::Fresh),
        Err(e) => return Err(Refused(format!("--out {shown}: cannot be read ({e})"))),
    };
    if !meta.is_dir() {
        return Err(Refused(format!(
            "--out {shown}: exists and is not a directory (expected a new directory, or an earlier export to replace)"
        )));
    }
    // The current directory or one above it (a path such as `a/..`), even an export.
    if let (Ok(canon), Ok(cwd)) = (std::fs::canonicalize(dir), std::env::current_dir()) {
        if cwd.starts_with(&canon) {
            return Err(Refused(format!(
                "--out {shown}: is the current directory or one above it (expected a new directory)"
            )));
        }
    }
    let empty = std::fs::read_dir(dir)
        .map(|mut d| d.next().is_none())
        .unwrap_or(false);
    if empty {
        return Ok(Destination::Empty);
    }
    if is_export(dir) {
        return Ok(Destination::Export);
    }
    Err(Refused(format!(
        "--out {shown}: exists and is not an export of dflash-supervise (it holds files other than {}), so it is not replaced: give a new directory, or move this one away yourself",
        EXPORT_FILES.join(", ")
    )))
}

/// A new directory beside `dir` that this process created (`create_dir`, so it was not
/// there before): `.NAME.WHAT-PID-N`.
pub fn fresh_dir_beside(dir: &Path, what: &str) -> std::io::Result<PathBuf> {
    let name = dir
        .file_name()
        .map_or("export".into(), |n| n.to_string_lossy().into_owned());
    for n in 0..10_000u32 {
        let p = dir.with_file_name(format!(".{name}.{what}-{}-{n}", std::process::id()));
        match std::fs::create_dir(&p) {
            Ok(()) => return Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AlreadyExists,
        format!("no free name beside {}", dir.display()),
    ))
}

/// A path beside `dir` that nothing holds now (`.NAME.WHAT-PID-N`), for a rename.
pub fn free_name_beside(dir: &Path, what: &str) -> std::io::Result<PathBuf> {
    let name = dir
        .file_name()
        .map_or("export".into(), |n| n.to_string_lossy().into_owned());
    for n in 0..10_000u32 {
        let p = dir.with_file_name(format!(".{name}.{what}-{}-{n}", std::process::id()));
        if std::fs::symlink_metadata(&p).is_err() {
            return Ok(p);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AlreadyExists,
        format!("no free name beside {}", dir.display()),
    ))
}

/// The name of a file or directory an export process `pid` leaves beside `dir`:
/// `.NAME.WHAT-PID-N` (see [`fresh_dir_beside`], [`free_name_beside`]).
fn left_by(name: &str, what: &str, file: &str) -> Option<u32> {
    let rest = file.strip_prefix(&format!(".{name}.{what}-"))?;
    let (pid, n) = rest.split_once('-')?;
    if pid.is_empty() || n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

/// What [`recover`] did, one line each (for the log).
pub type Recovered = Vec<String>;

/// Put right what export processes that died mid-way (killed: a second Ctrl-C, a timeout,
/// a SIGKILLed supervisor) left beside the destination `dir`, for each process `gone`
/// says is no longer running. Only names that an export writes (`.NAME.export-PID-N`,
/// `.NAME.replaced-PID-N`, `.PROBE.tmp-PID-N`) are touched, so the destination ends as one
/// whole export, the previous one or the new one, or none, and never anything else:
/// - its unfinished directory (`export`) is removed, with its probe file (`tmp`);
/// - an earlier export it had renamed aside (`replaced`) is put back when the
///   destination is gone (killed between the two renames), and removed when the new
///   export is in place;
/// - a probe file of an export that is in place (killed between the directory's rename and
///   its probe's) is renamed to its place.
pub fn recover(dir: &Path, gone: impl Fn(u32) -> bool) -> Recovered {
    let mut done = Vec::new();
    let (Some(name), Some(parent)) = (dir.file_name(), dir.parent()) else {
        return done;
    };
    let name = name.to_string_lossy().into_owned();
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let probe = crate::checkpoint::probe_path(dir);
    let probe_name = probe
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let Ok(entries) = std::fs::read_dir(parent) else {
        return done;
    };
    // Per dead process: its unfinished directories, earlier exports set aside, probe files.
    type Left = (Vec<PathBuf>, Vec<PathBuf>, Vec<PathBuf>);
    let mut by_pid: std::collections::BTreeMap<u32, Left> = Default::default();
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let path = parent.join(&file);
        let hit = [
            (left_by(&name, "export", &file), 0),
            (left_by(&name, "replaced", &file), 1),
            (left_by(&probe_name, "tmp", &file), 2),
        ];
        for (pid, kind) in hit {
            let Some(pid) = pid.filter(|&p| gone(p)) else {
                continue;
            };
            let left = by_pid.entry(pid).or_default();
            match kind {
                0 => left.0.push(path.clone()),
                1 => left.1.push(path.clone()),
                _ => left.2.push(path.clone()),
            }
        }
    }
    let mut say = |what: String| done.push(what);
    for (_, (unfinished, aside, probes)) in by_pid {
        let landed = unfinished.is_empty();
        for u in unfinished {
            if std::fs::remove_dir_all(&u).is_ok() {
                say(format!("removed the unfinished export {}", u.display()));
            }
        }
        for a in aside {
            let present = std::fs::symlink_metadata(dir).is_ok();
            if !present && std::fs::rename(&a, dir).is_ok() {
                say(format!("put the earlier export back at {}", dir.display()));
            } else if present && is_export(dir) && std::fs::remove_dir_all(&a).is_ok() {
                say(format!("removed the replaced export {}", a.display()));
            }
        }
        for p in probes {
            if landed && is_export(dir) && std::fs::rename(&p, &probe).is_ok() {
                say(format!("put the export's probe at {}", probe.display()));
            } else if !landed && std::fs::remove_file(&p).is_ok() {
                say(format!("removed the unfinished probe {}", p.display()));
            }
        }
    }
    done
}

/// Whether no process `pid` runs on this machine now (for [`recover`]): none, or only its
/// zombie (a process that died is not always reaped at once).
pub fn pid_gone(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next());
    matches!(state, Some('Z' | 'X') | None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export_in(dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(
            dir.join("config.json"),
            r#"{"block_size": 16, "dflash_config": {"target_layer_ids": [1]}}"#,
        )
        .unwrap();
        std::fs::write(dir.join("model.safetensors"), b"x").unwrap();
        std::fs::write(dir.join("dflash_drafter.py"), b"x").unwrap();
    }

    #[test]
    fn only_a_new_path_an_empty_directory_or_an_earlier_export_is_taken() {
        let t = tempfile::tempdir().unwrap();
        assert_eq!(check(&t.path().join("new")), Ok(Destination::Fresh));
        std::fs::create_dir(t.path().join("empty")).unwrap();
        assert_eq!(check(&t.path().join("empty")), Ok(Destination::Empty));
        export_in(&t.path().join("old"));
        assert_eq!(check(&t.path().join("old")), Ok(Destination::Export));
        // A user's file in an export, or a run directory: not ours to replace.
        std::fs::write(t.path().join("old/notes.txt"), b"mine").unwrap();
        assert!(check(&t.path().join("old")).is_err());
        let run = t.path().join("run");
        std::fs::create_dir(&run).unwrap();
        std::fs::write(run.join("run.json"), b"{}").unwrap();
        let e = check(&run).unwrap_err().to_string();
        assert!(e.contains("not an export of dflash-supervise"), "{e}");
        // A config that is not ours, with the right file names.
        export_in(&t.path().join("other"));
        std::fs::write(t.path().join("other/config.json"), b"{}").unwrap();
        assert!(check(&t.path().join("other")).is_err());
        // `..` and a file.
        assert!(check(&t.path().join("run/..")).is_err());
        std::fs::write(t.path().join("file"), b"x").unwrap();
        assert!(check(&t.path().join("file")).is_err());
    }

    #[test]
    fn names_beside_are_new_and_never_derived_from_an_extension() {
        let t = tempfile::tempdir().unwrap();
        let dest = t.path().join("qwen.new");
        let a = fresh_dir_beside(&dest, "export").unwrap();
        let b = fresh_dir_beside(&dest, "export").unwrap();
        assert_ne!(a, b);
        assert!(a
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(".qwen.new.export-"));
        let free = free_name_beside(&dest, "replaced").unwrap();
        assert!(!free.exists() && free.parent() == dest.parent());
    }

    #[test]
    fn what_a_killed_export_left_is_put_right_and_nothing_else_is_touched() {
        let t = tempfile::tempdir().unwrap();
        let dest = t.path().join("drafter");
        let probe = crate::checkpoint::probe_path(&dest);
        let dead = |p: u32| p == 4242;
        // Killed while writing: its directory and probe go, the earlier export stays.
        export_in(&dest);
        export_in(&t.path().join(".drafter.export-4242-0"));
        std::fs::write(t.path().join(".drafter.probe.safetensors.tmp-4242-0"), b"p").unwrap();
        // A live process's, a user's look-alike and a sibling are not touched.
        export_in(&t.path().join(".drafter.export-77-0"));
        std::fs::create_dir(t.path().join(".drafter.export-4242-x")).unwrap();
        std::fs::create_dir(t.path().join("drafter.old")).unwrap();
        let done = recover(&dest, dead);
        assert_eq!(done.len(), 2, "{done:?}");
        assert!(is_export(&dest));
        assert!(!t.path().join(".drafter.export-4242-0").exists());
        assert!(!t
            .path()
            .join(".drafter.probe.safetensors.tmp-4242-0")
            .exists());
        assert!(t.path().join(".drafter.export-77-0").exists());
        assert!(t.path().join(".drafter.export-4242-x").exists());
        assert!(t.path().join("drafter.old").exists());
        assert!(!probe.exists());

        // Killed between its two renames: the earlier export is put back.
        std::fs::rename(&dest, t.path().join(".drafter.replaced-4242-0")).unwrap();
        export_in(&t.path().join(".drafter.export-4242-1"));
        recover(&dest, dead);
        assert!(is_export(&dest));
        assert!(!t.path().join(".drafter.replaced-4242-0").exists());
        assert!(!t.path().join(".drafter.export-4242-1").exists());

        // Killed once the new export was in place: the old one goes, the probe is placed.
        export_in(&t.path().join(".drafter.replaced-4242-2"));
        std::fs::write(
            t.path().join(".drafter.probe.safetensors.tmp-4242-2"),
            b"new",
        )
        .unwrap();
        recover(&dest, dead);
        assert!(is_export(&dest));
        assert!(!t.path().join(".drafter.replaced-4242-2").exists());
        assert_eq!(std::fs::read(&probe).unwrap(), b"new");

        // Nothing to do for a process still running.
        assert!(recover(&dest, |_| false).is_empty());
        assert!(t.path().join(".drafter.export-77-0").exists());
    }
}
