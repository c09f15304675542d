//! A benchmark that runs in a `dflash-worker` tool process (the supervisor links no compute
//! and no CUDA): the worker's exit 0, or 2 with its one line, passed on.

use std::process::{Command, Stdio};

use crate::error::Error;

/// Run `dflash-worker <tool> <args>` beside this program for `bench <bench>`, its output
/// straight to ours.
pub fn run(bench: &'static str, tool: &str, args: &[String]) -> Result<i32, Error> {
    let exe = std::env::current_exe().map_err(|e| Error::Bench {
        bench,
        what: "finding dflash-supervise".into(),
        source: e.into(),
    })?;
    let worker = exe.with_file_name("dflash-worker");
    let st = Command::new(&worker)
        .arg(tool)
        .args(args)
        .stdin(Stdio::null())
        .status()
        .map_err(|e| Error::Bench {
            bench,
            what: format!("running {}", worker.display()),
            source: e.into(),
        })?;
    match st.code() {
        Some(0) => Ok(0),
        Some(2) => Ok(2),
        _ => Err(Error::Helper {
            program: format!("{} {tool}", worker.display()),
            detail: st.to_string(),
        }),
    }
}
