//! GPU code paths on a machine without a GPU, through a fake NVML library: `gpus`, device
//! selection, and each worker's CUDA_VISIBLE_DEVICES.

mod common;

use std::fs;
use std::process::Command;
use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;

fn script(dir: &std::path::Path, extra: &str) -> std::path::PathBuf {
    let p = dir.join("nvml.json");
    fs::write(
        &p,
        format!(
            r#"{{"driver": "550.54.15", "devices": [
                {{"name": "Fake H200", "uuid": "GPU-aaaa", "memory_total": 150323855360, "memory_used": 4096}},
                {{"name": "Fake H200", "uuid": "GPU-bbbb", "memory_total": 150323855360}}] {extra}}}"#
        ),
    )
    .unwrap();
    p
}

fn supervise_env(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut c = Command::new(bin("dflash-supervise"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

#[test]
fn gpus_lists_what_nvml_reports_and_survives_a_failing_call() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = fake_nvml();
    let s = script(tmp.path(), "");
    let env = [("DFLASH_NVML_LIBRARY", lib.to_str().unwrap()), ("DFLASH_FAKE_NVML", s.to_str().unwrap())];
    let out = supervise_env(&["gpus"], &env);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0));
    assert!(text.contains("NVIDIA driver 550.54.15, 2 GPU(s)") && text.contains("1  Fake H200  GPU-bbbb  140.0 GiB"), "{text}");
    let out = supervise_env(&["gpus", "--json"], &env);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["gpus"][0]["uuid"], "GPU-aaaa");
    assert_eq!(v["gpus"][1]["memory_total_bytes"], 150323855360u64);

    let s = script(tmp.path(), r#", "fail": {"nvmlDeviceGetMemoryInfo_v2": 999}"#);
    let env = [("DFLASH_NVML_LIBRARY", lib.to_str().unwrap()), ("DFLASH_FAKE_NVML", s.to_str().unwrap())];
    let text = String::from_utf8_lossy(&supervise_env(&["gpus"], &env).stdout).into_owned();
    assert!(text.contains("GPU-aaaa  memory unknown"), "{text}");

    let out = supervise_env(&["gpus"], &[("DFLASH_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1")]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("no NVIDIA driver found"));
}

#[test]
fn gpu_workers_get_their_gpu_and_bad_indices_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = fake_nvml();
    let s = script(tmp.path(), "");
    let env = [("DFLASH_NVML_LIBRARY", lib.to_str().unwrap()), ("DFLASH_FAKE_NVML", s.to_str().unwrap())];
    let out = supervise_env(&["--gpus", "0-7"], &env);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("GPU 2 does not exist (NVML reports 2 GPU(s), 0-1)"));

    // Default devices with GPUs present: all of them. A target and a drafter sharing GPU 1.
    for args in [vec![], vec!["--target-gpus", "1", "--drafter-gpus", "1"]] {
        let mut sup = Sup::start_real_env(&args, &env);
        let st = sup.wait_running(2);
        let expect = if args.is_empty() { ["0", "1"] } else { ["1", "1"] };
        for (name, gpu) in ["target-0", "drafter-0"].iter().zip(expect) {
            let pid = pid_of(&st, name);
            let environ = fs::read(format!("/proc/{pid}/environ")).unwrap();
            let vars: Vec<String> = environ.split(|&b| b == 0).map(|v| String::from_utf8_lossy(v).into_owned()).collect();
            assert!(vars.contains(&format!("CUDA_VISIBLE_DEVICES={gpu}")), "{name}: {vars:?}");
            assert!(vars.contains(&format!("DFLASH_GPU={gpu}")) && vars.contains(&"CUDA_DEVICE_ORDER=PCI_BUS_ID".to_string()));
        }
        assert!(sup.stderr().contains("the CUDA backend is not implemented yet"));
        sup.signal(Signal::SIGTERM);
        assert_eq!(sup.wait_exit(Duration::from_secs(20)).code(), Some(0));
    }
}
