//! `dflash-supervise bench compute`: one worker's compute, measured in a `dflash-worker`
//! process (the supervisor links no compute and no CUDA): `dflash-worker bench-ops`.

use std::process::{Command, Stdio};

use crate::error::Error;

pub fn run(json: bool, target: &str, tokens: usize) -> Result<i32, Error> {
    let exe = std::env::current_exe().map_err(|e| Error::Internal(format!("bench compute: finding dflash-supervise: {e}")))?;
    let worker = exe.with_file_name("dflash-worker");
    let mut cmd = Command::new(&worker);
    cmd.arg("bench-ops").arg("--target").arg(target).arg("--tokens").arg(tokens.to_string());
    if json {
        cmd.arg("--json");
    }
    let st = cmd.stdin(Stdio::null()).status().map_err(|e| Error::Internal(format!("bench compute: running {}: {e}", worker.display())))?;
    match st.code() {
        Some(0) => Ok(0),
        Some(2) => Ok(2),
        _ => Err(Error::Internal(format!("bench compute: {} bench-ops failed ({st})", worker.display()))),
    }
}
