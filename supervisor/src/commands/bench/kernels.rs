//! `dflash-supervise bench kernels`: the GPU kernels' machine code read without a GPU, in
//! a `dflash-worker bench-kernels` process (NVRTC is the worker's: the supervisor loads no
//! CUDA library). Exit 0, or 2 with the worker's one line (a tool missing, a bad --arch).

use crate::error::Error;

pub fn run(json: bool, arch: &[String]) -> Result<i32, Error> {
    let mut args = Vec::new();
    if !arch.is_empty() {
        args.extend(["--arch".to_string(), arch.join(",")]);
    }
    if json {
        args.push("--json".into());
    }
    super::worker_tool::run("kernels", "bench-kernels", &args)
}
