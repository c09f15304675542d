//! What the tests that compare against transformers share: whether python3 has torch and
//! transformers (a skip on a laptop, a failure under CI), and one python run of a script
//! over a JSON job file.

#![allow(dead_code)] // each test binary uses what it needs

use std::process::Command;

/// Whether `python3` imports torch and transformers (and `extra` modules). Without them a
/// test skips, except under CI (`CI` set), where it fails: `.ci/run` installs them.
pub fn python_ok(extra: &[&str]) -> bool {
    let imports = ["torch", "transformers"]
        .iter()
        .chain(extra)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    let ok = Command::new("python3")
        .args(["-c", &format!("import {imports}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(std::env::var_os("CI").is_none(), "python3 with {imports} is missing: under CI this test may not skip (.ci/run installs them)");
        eprintln!("skipping: python3 with {imports} is not installed");
    }
    ok
}

/// `script` run by python3 with the path of a file holding `job` (JSON) as its argument;
/// its standard output, parsed as JSON. A failed run fails the test with its stderr.
pub fn run_python<T: serde::de::DeserializeOwned>(
    what: &str,
    script: &str,
    job: &serde_json::Value,
) -> T {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), serde_json::to_vec(job).unwrap()).unwrap();
    let o = Command::new("python3")
        .args(["-c", script])
        .arg(file.path())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "{what} printed no JSON ({e}): {}",
            String::from_utf8_lossy(&o.stdout)
        )
    })
}
