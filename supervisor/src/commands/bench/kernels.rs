//! `dflash-supervise bench kernels`: the GPU kernels' machine code read without a GPU, in
//! a `dflash-worker bench-kernels` process (NVRTC is the worker's: the supervisor loads no
//! CUDA library). Exit 0, or 2 with the worker's one line (a tool missing, a bad --arch).

use std::process::{Command, Stdio};

use crate::error::Error;

pub fn run(json: bool, arch: &[String]) -> Result<i32, Error> {
    let exe = std::env::current_exe().map_err(|e| Error::Bench {
        bench: "kernels",
        what: "finding dflash-supervise".into(),
        source: e.into(),
    })?;
    let worker = exe.with_file_name("dflash-worker");
    let mut cmd = Command::new(&worker);
    cmd.arg("bench-kernels");
    if !arch.is_empty() {
        cmd.arg("--arch").arg(arch.join(","));
    }
    if json {
        cmd.arg("--json");
    }
    let st = cmd
        .stdin(Stdio::null())
        .status()
        .map_err(|e| Error::Bench {
            bench: "kernels",
            what: format!("running {}", worker.display()),
            source: e.into(),
        })?;
    match st.code() {
        Some(0) => Ok(0),
        Some(2) => Ok(2),
        _ => Err(Error::Helper {
            program: format!("{} bench-kernels", worker.display()),
            detail: st.to_string(),
        }),
    }
}
