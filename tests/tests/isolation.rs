//! The supervisor never links a CUDA library and the worker never links NVML: checked on
//! the dependency graph cargo resolves for each binary's crate.

use std::process::Command;

fn deps(package: &str) -> Vec<String> {
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "--locked",
            "--offline",
            "-e",
            "normal,build",
            "--prefix",
            "none",
            "-p",
            package,
        ])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

#[test]
fn the_supervisor_links_no_cuda_library() {
    let d = deps("dflash-supervisor");
    assert!(
        d.iter().any(|n| n == "nvml-wrapper"),
        "the supervisor is the one that loads NVML: {d:?}"
    );
    let cuda: Vec<&String> = d
        .iter()
        .filter(|n| {
            n.contains("cuda")
                || n.contains("cudarc")
                || n.contains("cublas")
                || n.contains("nvrtc")
                || n.contains("nccl")
        })
        .collect();
    assert!(
        cuda.is_empty(),
        "CUDA crates in the supervisor's dependency graph: {cuda:?}"
    );
    assert!(
        !d.iter().any(|n| n == "dflash-worker"),
        "the supervisor must not link the worker's compute"
    );
}

#[test]
fn the_worker_links_no_nvml() {
    let d = deps("dflash-worker");
    let nvml: Vec<&String> = d.iter().filter(|n| n.contains("nvml")).collect();
    assert!(
        nvml.is_empty(),
        "NVML crates in the worker's dependency graph: {nvml:?}"
    );
    assert!(
        d.iter().any(|n| n == "dflash-shared"),
        "sanity: the graph was read: {d:?}"
    );
}

// The same rule on the running processes is checked by tests/tests/emulated_gpus.rs (a
// four-GPU run's /proc/<pid>/maps) and by scripts/gpu_check.sh's isolation step
// (tests/tests/gpu_check.rs runs it over the emulated stack).
