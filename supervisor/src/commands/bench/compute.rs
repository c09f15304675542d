//! `dflash-supervise bench compute`: one worker's compute, measured in a `dflash-worker`
//! process (the supervisor links no compute and no CUDA): `dflash-worker bench-ops`.

use crate::error::Error;

pub fn run(json: bool, target: &str, tokens: usize) -> Result<i32, Error> {
    let mut args = vec![
        "--target".to_string(),
        target.to_string(),
        "--tokens".to_string(),
        tokens.to_string(),
    ];
    if json {
        args.push("--json".into());
    }
    super::worker_tool::run("compute", "bench-ops", &args)
}
