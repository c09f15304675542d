//! The supervisor never links a CUDA library and the worker never links NVML: checked on
//! the dependency graph cargo resolves for each binary's crate.

use std::process::Command;

fn deps(package: &str) -> Vec<String> {
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--locked", "--offline", "-e", "normal,build", "--prefix", "none", "-p", package])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run cargo tree");
    assert!(out.status.success(), "cargo tree failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.split_whitespace().next()).map(str::to_string).collect()
}

#[test]
fn the_supervisor_links_no_cuda_library() {
    let d = deps("dflash-supervisor");
    assert!(d.iter().any(|n| n == "nvml-wrapper"), "the supervisor is the one that loads NVML: {d:?}");
    let cuda: Vec<&String> = d.iter().filter(|n| n.contains("cuda") || n.contains("cudarc") || n.contains("cublas") || n.contains("nvrtc") || n.contains("nccl")).collect();
    assert!(cuda.is_empty(), "CUDA crates in the supervisor's dependency graph: {cuda:?}");
    assert!(!d.iter().any(|n| n == "dflash-worker"), "the supervisor must not link the worker's compute");
}

#[test]
fn the_worker_links_no_nvml() {
    let d = deps("dflash-worker");
    let nvml: Vec<&String> = d.iter().filter(|n| n.contains("nvml")).collect();
    assert!(nvml.is_empty(), "NVML crates in the worker's dependency graph: {nvml:?}");
    assert!(d.iter().any(|n| n == "dflash-shared"), "sanity: the graph was read: {d:?}");
}

/// The same rule on the running processes, through scripts/gpu_check.sh (the check to run
/// on a GPU machine), here with the fake NVML: the supervisor maps NVML and no CUDA
/// library, no worker maps NVML.
#[test]
fn running_processes_map_only_their_own_libraries() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = std::env::current_exe().unwrap().parent().and_then(|p| p.parent()).unwrap().to_path_buf();
    let tmp = tempfile::tempdir().unwrap();
    let script = tmp.path().join("nvml.json");
    std::fs::write(&script, r#"{"driver": "550", "devices": [{"name": "Fake", "uuid": "GPU-a", "memory_total": 1000, "util_gpu": 1, "util_mem": 1},
                                                               {"name": "Fake", "uuid": "GPU-b", "memory_total": 1000, "util_gpu": 1, "util_mem": 1}]}"#).unwrap();
    let out = Command::new("bash")
        .arg(root.join("scripts/gpu_check.sh"))
        .arg(target.join("dflash-supervise"))
        .env("DFLASH_NVML_LIBRARY", target.join("libdflash_fake_nvml.so"))
        .env("DFLASH_FAKE_NVML", &script)
        // No CUDA here: the targets compute on the host device (the same kernels, on the CPU).
        .env("DFLASH_DEVICE", "host")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("ok   supervisor maps NVML") && text.matches("maps no NVML").count() == 2, "{text}");
}
