//! `dflash-supervise bench compute`: one worker's compute, measured in a `dflash-worker`
//! process (the supervisor links no compute and no CUDA): `dflash-worker bench-ops`.

use std::process::{Command, Stdio};

use crate::error::Error;

pub fn run(json: bool, target: &str, tokens: usize) -> Result<i32, Error> {
    let exe = std::env::current_exe().map_err(|e| Error::Bench {
        bench: "compute",
        what: "finding dflash-supervise".into(),
        source: e.into(),
    })?;
    let worker = exe.with_file_name("dflash-worker");
    let mut cmd = Command::new(&worker);
    cmd.arg("bench-ops")
        .arg("--target")
        .arg(target)
        .arg("--tokens")
        .arg(tokens.to_string());
    if json {
        cmd.arg("--json");
    }
    let st = cmd
        .stdin(Stdio::null())
        .status()
        .map_err(|e| Error::Bench {
            bench: "compute",
            what: format!("running {}", worker.display()),
            source: e.into(),
        })?;
    match st.code() {
        Some(0) => Ok(0),
        Some(2) => Ok(2),
        _ => Err(Error::Helper {
            program: format!("{} bench-ops", worker.display()),
            detail: st.to_string(),
        }),
    }
}
