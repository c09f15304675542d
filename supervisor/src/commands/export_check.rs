//! `dflash-supervise export-check DIR`: the parity gate of an exported drafter. Loads DIR
//! with transformers (`AutoModel.from_pretrained(DIR, trust_remote_code=True)`, CPU,
//! float32) through the model code the export carries, runs the probe batch stored at
//! export and compares with the Rust drafter's output for it. The check itself is Python
//! ([`CHECK_SCRIPT`], embedded), run with `$DFLASH_PYTHON` or `python3`.
//!
//! Exit 0: the export computes what was trained, within [`DEFAULT_TOLERANCE`]; 1: it does
//! not (over the tolerance, missing or unexpected tensors, a model that fails to load or
//! run); 2: DIR is not an export, or Python, torch or transformers is missing.

use dflash_shared::env::python;
use std::path::{Path, PathBuf};
use std::process::Command;

use dflash_shared::exit_codes;

use crate::error::Error;

pub const CHECK_SCRIPT: &str = include_str!("../../python/export_check.py");

/// Max relative error (max |diff| / max |ref|) allowed. Both sides run f32 math on the
/// same bf16 weights, so only summation order differs (~1e-7 on the tiny target); 1e-3
/// leaves room for wide layers while any real difference (a rope setting, a mask rule, a
/// changed tensor) shows as 1e-2 or more.
pub const DEFAULT_TOLERANCE: f64 = 1e-3;

/// Files every export holds (its parity probe lies beside it:
/// [`dflash_shared::checkpoint::probe_path`]).
const EXPORT_FILES: [&str; 3] = ["config.json", "model.safetensors", "dflash_drafter.py"];

#[derive(Debug, clap::Args)]
pub struct ExportCheckArgs {
    /// The export directory (RUN_DIR/drafter).
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
    /// Largest max relative error (max |diff| / max |ref|) that passes.
    #[arg(long, default_value_t = DEFAULT_TOLERANCE, value_name = "X")]
    pub tolerance: f64,
}

/// Why `dir` is not an export, if it is not one.
fn not_an_export(dir: &Path) -> Option<String> {
    if !dir.is_dir() {
        return Some(format!(
            "{}: no such directory (expected an export, e.g. RUN_DIR/drafter)",
            dir.display()
        ));
    }
    let absent: Vec<&str> = EXPORT_FILES
        .iter()
        .copied()
        .filter(|f| !dir.join(f).is_file())
        .collect();
    if !absent.is_empty() {
        return Some(format!(
            "{}: not a dflash-supervise export (no {}; exports written by this version hold {})",
            dir.display(),
            absent.join(", "),
            EXPORT_FILES.join(", ")
        ));
    }
    let probe = dflash_shared::checkpoint::probe_path(dir);
    if !probe.is_file() {
        return Some(format!(
            "{}: no parity probe beside it (expected {}, which `dflash-supervise export` writes next to the drafter directory)",
            dir.display(),
            probe.display()
        ));
    }
    None
}

pub fn run(a: ExportCheckArgs) -> Result<i32, Error> {
    if !(a.tolerance.is_finite() && a.tolerance > 0.0) {
        return Err(Error::Flag(format!(
            "--tolerance {} must be a positive number",
            a.tolerance
        )));
    }
    if let Some(why) = not_an_export(&a.dir) {
        return Err(Error::input(a.dir.display().to_string(), why));
    }
    let py = python();
    let status = Command::new(&py)
        .arg("-c")
        .arg(CHECK_SCRIPT)
        .arg(&a.dir)
        .arg(dflash_shared::checkpoint::probe_path(&a.dir))
        .arg(format!("{:e}", a.tolerance))
        .status();
    match status {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::Flag(format!(
            "{py} not found: export-check runs Python with torch and transformers (install Python 3, then `python3 -m pip install torch transformers`; or set DFLASH_PYTHON)"
        ))),
        Err(e) => Err(Error::input(format!("cannot run {py}"), e)),
        Ok(s) => match s.code() {
            Some(c @ (exit_codes::SUCCESS | exit_codes::RUN_FAILED | exit_codes::USAGE)) => Ok(c),
            Some(c) => {
                eprintln!("dflash-supervise: error: the check script exited {c} (see above)");
                Ok(exit_codes::RUN_FAILED)
            }
            None => {
                eprintln!("dflash-supervise: error: the check script was killed by a signal");
                Ok(exit_codes::RUN_FAILED)
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_without_the_export_files_is_refused_with_one_line() {
        let tmp = tempfile::tempdir().unwrap();
        let why = not_an_export(&tmp.path().join("nope")).unwrap();
        assert!(why.contains("no such directory"), "{why}");
        std::fs::write(tmp.path().join("config.json"), "{}").unwrap();
        let why = not_an_export(tmp.path()).unwrap();
        assert!(
            why.contains("no model.safetensors, dflash_drafter.py") && !why.contains('\n'),
            "{why}"
        );
        for f in EXPORT_FILES {
            std::fs::write(tmp.path().join(f), "").unwrap();
        }
        // The probe lies beside the directory, and is needed.
        let why = not_an_export(tmp.path()).unwrap();
        assert!(why.contains(".probe.safetensors"), "{why}");
        std::fs::write(dflash_shared::checkpoint::probe_path(tmp.path()), "").unwrap();
        assert!(not_an_export(tmp.path()).is_none());
        let e = run(ExportCheckArgs {
            dir: tmp.path().to_path_buf(),
            tolerance: -1.0,
        })
        .unwrap_err();
        assert_eq!(e.exit_code(), exit_codes::USAGE);
    }
}
