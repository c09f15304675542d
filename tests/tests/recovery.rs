//! Losing every drafter is survivable: the group rolls back to the supervisor's snapshot
//! (or a checkpoint, or the start), the batches committed since go through again, and the
//! ledger's lineage audit proves every batch reached the final weights exactly once. With
//! one target and one drafter the batches reach the drafter in the same order as in an
//! undisturbed run, so the final weights are bit-identical to it.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;
use serde_json::Value;

const T: Duration = Duration::from_secs(240);

/// Deterministic "random" numbers for kill timing (a test must be repeatable).
struct Lcg(u64);
impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

fn step_of(s: &Value) -> u64 {
    s["train"]["step"].as_u64().unwrap_or(0)
}

/// The committed-step lines of train.jsonl (rollback lines have no "step").
fn steps(run: &Path) -> Vec<Value> {
    read_jsonl(&run.join("train.jsonl"))
        .into_iter()
        .filter(|l| l.get("step").is_some())
        .collect()
}

fn rollbacks(run: &Path) -> Vec<Value> {
    read_jsonl(&run.join("train.jsonl"))
        .into_iter()
        .filter_map(|l| l.get("rollback").cloned())
        .collect()
}

/// Exit 0 at step `n`, and the lineage audit is clean.
fn assert_completed_clean(sup: &mut Sup, n: u64) -> Value {
    let status = sup.wait_exit(T);
    assert_eq!(status.code(), Some(0), "stderr:\n{}", sup.stderr());
    let s = steps(&sup.run_dir);
    assert_eq!(s.last().unwrap()["step"], n, "the run ends at --steps");
    let (code, a) = sup.ledger();
    assert_eq!(code, 0, "ledger audit: {a}");
    assert_eq!(
        (a["duplicated"].as_u64(), a["lost"].as_u64()),
        (Some(0), Some(0)),
        "{a}"
    );
    a
}

/// Kill every drafter of the run (their pids from state.json) at once.
fn kill_drafters(sup: &Sup) {
    let st = sup.state().unwrap();
    for w in st["workers"].as_array().unwrap() {
        if w["role"] == "drafter" {
            if let Some(pid) = w["pid"].as_u64() {
                signal(pid as u32, Signal::SIGKILL);
            }
        }
    }
}

#[test]
fn losing_both_drafters_rolls_back_and_the_run_completes_with_a_clean_lineage() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:3",
        "--targets",
        "1",
        "--data",
        "demo",
        "--epochs",
        "50",
        "--steps",
        "30",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
    ]);
    sup.wait_state("training to reach step 6", T, |s| step_of(s) >= 6);
    kill_drafters(&sup);
    let a = assert_completed_clean(&mut sup, 30);
    assert!(a["rollbacks"].as_u64().unwrap() >= 1, "{a}");
    let rb = rollbacks(&sup.run_dir);
    assert!(!rb.is_empty(), "train.jsonl records the rollback");
    let r = &rb[0];
    assert!(
        r["to"].as_u64().unwrap() <= r["from"].as_u64().unwrap(),
        "{r}"
    );
    assert!(
        sup.stderr().contains("rolling back to step"),
        "{}",
        sup.stderr()
    );
    assert!(
        !sup.stderr().contains("every drafter died after step")
            || sup.stderr().contains("rolling back")
    );
    // Every step of the final lineage appears; steps after a rollback's target repeat.
    let numbers: Vec<u64> = steps(&sup.run_dir)
        .iter()
        .map(|s| s["step"].as_u64().unwrap())
        .collect();
    let distinct: std::collections::BTreeSet<u64> = numbers.iter().copied().collect();
    assert_eq!(distinct, (1..=30).collect(), "{numbers:?}");
}

fn params_of(run: &Path, step: u64) -> Vec<u8> {
    let p = run
        .join("checkpoints")
        .join(format!("step-{step:08}"))
        .join("state.safetensors");
    let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensor("params").unwrap().data().to_vec()
}

#[test]
fn one_drafter_killed_ten_times_ends_bit_identical_to_an_undisturbed_run() {
    let args = [
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--epochs",
        "50",
        "--steps",
        "40",
        "--checkpoint-every",
        "0",
        "--seed",
        "3",
        "--max-seq-len",
        "48",
        "--token-budget",
        "384",
        // The kills are deliberate: restart at once rather than back off.
        "--stable-after",
        "200ms",
        "--max-rollbacks",
        "20",
    ];
    let mut calm = Sup::start_real(&args);
    assert_completed_clean(&mut calm, 40);
    let want = params_of(&calm.run_dir, 40);

    let mut sup = Sup::start_real(&args);
    let mut rng = Lcg(7);
    let mut last = 0;
    for kill in 0..10 {
        // At a random step past the last kill (bounded by progress, not time).
        let at = last + 1 + rng.below(3);
        if at >= 38 {
            break;
        }
        let s = sup.wait_state(&format!("step {at} before kill {kill}"), T, |s| {
            step_of(s) >= at
        });
        last = step_of(&s);
        kill_drafters(&sup);
        // Its replacement is up before the next kill.
        sup.wait_state("the drafter to be restarted", T, |s| {
            s["workers"].as_array().unwrap().iter().any(|w| {
                w["role"] == "drafter"
                    && w["state"] == "running"
                    && w["restarts"].as_u64().unwrap_or(0) > kill
            })
        });
    }
    let a = assert_completed_clean(&mut sup, 40);
    assert!(a["rollbacks"].as_u64().unwrap() >= 5, "{a}");
    assert!(
        params_of(&sup.run_dir, 40) == want,
        "the final weights differ from the undisturbed run's"
    );
}

#[test]
fn rollbacks_are_bounded_by_max_rollbacks() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--epochs",
        "50",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
        "--max-rollbacks",
        "1",
    ]);
    sup.wait_state("step 3", T, |s| step_of(s) >= 3);
    kill_drafters(&sup);
    sup.wait_state("the first rollback, then step 4", T, |s| {
        s["train"]["rollbacks"] == 1 && step_of(s) >= 4
    });
    kill_drafters(&sup);
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("more than --max-rollbacks 1"), "{err}");
}

#[test]
fn both_drafters_killed_again_and_again_at_random_instants_lose_nothing() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:3",
        "--targets",
        "1",
        "--data",
        "demo",
        "--epochs",
        "50",
        "--steps",
        "40",
        "--max-seq-len",
        "48",
        "--token-budget",
        "384",
        // A snapshot after every step: kills land during snapshots too.
        "--snapshot-every",
        "1",
        "--stable-after",
        "200ms",
        "--max-rollbacks",
        "20",
    ]);
    let mut rng = Lcg(11);
    let mut last = 0;
    for kill in 0..6 {
        let at = last + 1 + rng.below(4);
        if at >= 36 {
            break;
        }
        let s = sup.wait_state(&format!("step {at} before kill {kill}"), T, |s| {
            step_of(s) >= at
        });
        last = step_of(&s);
        // Sometimes one first, then the other a moment later (a cascading failure).
        let st = sup.state().unwrap();
        let restarts = |s: &Value| -> u64 {
            s["workers"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|w| w["role"] == "drafter")
                .map(|w| w["restarts"].as_u64().unwrap_or(0))
                .sum()
        };
        let before = restarts(&st);
        let drafters: Vec<u32> = st["workers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|w| w["role"] == "drafter")
            .filter_map(|w| w["pid"].as_u64())
            .map(|p| p as u32)
            .collect();
        for (i, pid) in drafters.iter().enumerate() {
            signal(*pid, Signal::SIGKILL);
            if i == 0 && rng.below(2) == 0 {
                std::thread::yield_now();
            }
        }
        sup.wait_state("both drafters restarted", T, |s| {
            restarts(s) >= before + 2
                && s["workers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|w| w["role"] == "drafter" && w["state"] == "running")
                    .count()
                    == 2
        });
    }
    let a = assert_completed_clean(&mut sup, 40);
    assert!(a["rollbacks"].as_u64().unwrap() >= 1, "{a}");
}

#[test]
fn a_stop_that_cannot_save_exits_non_zero_and_says_which_steps_were_lost() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--epochs",
        "50",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
        "--checkpoint-every",
        "1000",
        // No snapshot either (the first would be due at step 1000).
        "--snapshot-every",
        "1000",
    ]);
    let st = sup.wait_state("step 5", T, |s| step_of(s) >= 5);
    // The only drafter dies once the stop has begun: nothing can write the stop checkpoint.
    // Frozen first, so that it neither writes it nor dies before the stop (a death seen
    // first would roll the group back to its start, and then there is nothing to save).
    let drafter = pid_of(&st, "drafter-0");
    signal(drafter, Signal::SIGSTOP);
    sup.signal(Signal::SIGTERM);
    sup.wait_state("the stop to begin", T, |s| s["phase"] == "stopping");
    signal(drafter, Signal::SIGKILL);
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(1), "{err}");
    let line = err
        .lines()
        .find(|l| l.contains("were not saved in a checkpoint"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        line.contains("steps 1..") && line.contains("no checkpoint was written"),
        "{line}"
    );
}

/// A target whose embedding holds NaN: every step's loss is NaN and skipped.
#[test]
fn steps_skipped_again_and_again_stop_the_run_and_name_the_cause() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    let st = std::process::Command::new(bin("dflash-worker"))
        .arg("tiny-target")
        .arg("--out")
        .arg(&target)
        .status()
        .unwrap();
    assert!(st.success());
    let path = target.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    for (n, _, _, data) in tensors.iter_mut() {
        if n.contains("embed_tokens") {
            // bf16 NaN in every element.
            for c in data.chunks_exact_mut(2) {
                c.copy_from_slice(&0x7FC0u16.to_le_bytes());
            }
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let t = target.display().to_string();
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--target",
        &t,
        "--data",
        "demo",
        "--epochs",
        "50",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
        "--max-skipped-steps",
        "4",
    ]);
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("4 steps in a row had a non-finite loss or gradient")
            && err.contains("not finite"),
        "{err}"
    );
    let s = steps(&sup.run_dir);
    assert_eq!(s.len(), 4, "it stops at the 4th skipped step");
    assert!(s.iter().all(|l| l["skipped"] == true));
}

#[test]
fn a_damaged_newest_checkpoint_is_passed_over_for_the_one_before_it() {
    let args = [
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--epochs",
        "50",
        "--steps",
        "24",
        "--checkpoint-every",
        "4",
        "--keep-checkpoints",
        "3",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
    ];
    let mut sup = Sup::start_real(&args);
    sup.wait_state("step 9", T, |s| step_of(s) >= 9);
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(T).code(), Some(75), "{}", sup.stderr());
    let mut ckpts: Vec<u64> = std::fs::read_dir(sup.run_dir.join("checkpoints"))
        .unwrap()
        .filter_map(|e| {
            e.unwrap()
                .file_name()
                .to_string_lossy()
                .strip_prefix("step-")
                .and_then(|n| n.parse().ok())
        })
        .collect();
    ckpts.sort();
    let (newest, before) = (ckpts[ckpts.len() - 1], ckpts[ckpts.len() - 2]);
    // Truncate the newest checkpoint's tensors.
    let f = sup
        .run_dir
        .join("checkpoints")
        .join(format!("step-{newest:08}"))
        .join("state.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let out = supervise(
        &["--gpus", "cpu:2", "--resume", sup.run_dir.to_str().unwrap()],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains(&format!(
            "not resuming from {}",
            f.parent().unwrap().display()
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!("from the checkpoint of step {before}")),
        "{err}"
    );
    assert_eq!(steps(&sup.run_dir).last().unwrap()["step"], 24);
    let (code, a) = sup.ledger();
    assert_eq!(code, 0, "{a}");
    assert_eq!(
        (a["duplicated"].as_u64(), a["lost"].as_u64()),
        (Some(0), Some(0)),
        "{a}"
    );
}

/// The newest checkpoint is damaged on disk when every drafter dies: the group goes back
/// further (here to its start, since no snapshot is due yet), sets the abandoned lineage's
/// checkpoints aside, trains every batch again, and writes the same step numbers anew.
#[test]
fn a_checkpoint_damaged_before_a_rollback_sends_the_group_further_back_and_loses_nothing() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--epochs",
        "50",
        "--steps",
        "24",
        "--checkpoint-every",
        "10",
        "--keep-checkpoints",
        "5",
        "--snapshot-every",
        "1000",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
    ]);
    let ck = sup.run_dir.join("checkpoints").join("step-00000010");
    // Complete on disk and known to the supervisor (a drafter killed between its rename and
    // its report leaves a checkpoint the supervisor never heard of, and never rolls back to).
    wait_for("the checkpoint of step 10", T, || {
        sup.events()
            .iter()
            .any(|e| e["event"] == "checkpoint" && e["step"] == 10)
            .then_some(())
    });
    let f = ck.join("state.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len - 7)
        .unwrap();
    kill_drafters(&sup);
    let a = assert_completed_clean(&mut sup, 24);
    assert!(a["rollbacks"].as_u64().unwrap() >= 1, "{a}");
    let err = sup.stderr();
    assert!(
        err.contains("not rolling back to the checkpoint of step 10"),
        "{err}"
    );
    let rb = rollbacks(&sup.run_dir);
    assert_eq!(rb[0]["to"], 0, "back to the start: {rb:?}");
    // Set aside, then written again by the new lineage.
    assert!(
        std::fs::read_dir(sup.run_dir.join("abandoned-checkpoints"))
            .unwrap()
            .count()
            >= 1
    );
    assert_eq!(
        dflash_shared_verify(&ck),
        Some(10),
        "step 10 written anew and valid"
    );
}

/// The step of a checkpoint whose meta.json and tensors are intact.
fn dflash_shared_verify(dir: &Path) -> Option<u64> {
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).ok()?).ok()?;
    let bytes = std::fs::read(dir.join("state.safetensors")).ok()?;
    safetensors::SafeTensors::deserialize(&bytes).ok()?;
    meta["step"].as_u64()
}

/// No drafter is left at the stop (its restart budget is spent), but the supervisor's
/// snapshot holds the last committed step: the stop checkpoint is written from it, and the
/// run resumes from there.
#[test]
fn with_no_drafter_left_the_stop_checkpoint_is_written_from_the_snapshot() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--epochs",
        "50",
        "--steps",
        "20",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
        "--checkpoint-every",
        "1000",
        "--max-restarts",
        "0",
    ]);
    sup.wait_state("step 5", T, |s| step_of(s) >= 5);
    kill_drafters(&sup);
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(1), "the restart budget is spent: {err}");
    assert!(!err.contains("were not saved"), "{err}");
    let last = steps(&sup.run_dir).last().unwrap()["step"]
        .as_u64()
        .unwrap();
    let rb = rollbacks(&sup.run_dir);
    let at = rb.last().map_or(last, |r| r["to"].as_u64().unwrap());
    let dir = sup
        .run_dir
        .join("checkpoints")
        .join(format!("step-{at:08}"));
    let meta: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("meta.json"))
            .unwrap_or_else(|e| panic!("{}: {e}\n{err}", dir.display())),
    )
    .unwrap();
    assert_eq!(meta["written_from"], "the supervisor's snapshot");
    let out = supervise(
        &["--gpus", "cpu:2", "--resume", sup.run_dir.to_str().unwrap()],
        None,
    );
    let e2 = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{e2}");
    assert!(
        e2.contains(&format!("from the checkpoint of step {at}")),
        "{e2}"
    );
    let (code, a) = sup.ledger();
    assert_eq!(code, 0, "{a}");
}

/// A full disk: the ledger cannot be appended to, so the run stops taking batches and
/// stops, saying so and which steps were not saved; once there is room again, the ledger
/// (with the line the full disk cut short) still audits. Needs a small tmpfs: mounted
/// here when the test runs as root (skips otherwise on a laptop, fails under CI).
#[test]
fn a_full_disk_stops_the_run_cleanly_and_the_ledger_still_audits() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("m");
    std::fs::create_dir_all(&m).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
        .arg(&m)
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        assert!(
            std::env::var_os("CI").is_none(),
            "cannot mount a tmpfs (needs root): under CI this test may not skip"
        );
        eprintln!("skipping: cannot mount a tmpfs here (needs root)");
        return;
    }
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _guard = Unmount(m.clone());
    let target = tmp.path().join("target");
    assert!(std::process::Command::new(bin("dflash-worker"))
        .arg("tiny-target")
        .arg("--out")
        .arg(&target)
        .status()
        .unwrap()
        .success());
    let run = m.join("run");
    let out = std::process::Command::new(bin("dflash-supervise"))
        .args([
            "--gpus",
            "cpu:2",
            "--data",
            "demo",
            "--epochs",
            "100",
            "--steps",
            "5000",
            "--checkpoint-every",
            "1000",
            "--max-seq-len",
            "64",
            "--token-budget",
            "512",
        ])
        .arg("--target")
        .arg(&target)
        .arg("--run-dir")
        .arg(&run)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot append to ledger.jsonl")
            && err.contains("the run stops taking batches"),
        "{err}"
    );
    assert!(err.contains("were not saved in a checkpoint"), "{err}");
    // Room again: the audit sets the torn line aside, and nothing was lost or doubled.
    assert!(std::process::Command::new("mount")
        .args(["-o", "remount,size=8m"])
        .arg(&m)
        .status()
        .unwrap()
        .success());
    let out = std::process::Command::new(bin("dflash-supervise"))
        .args(["ledger", "--json", "--run-dir"])
        .arg(&run)
        .output()
        .unwrap();
    let a: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(out.status.code(), Some(0), "{a}");
    assert_eq!(
        (a["lost"].as_u64(), a["duplicated"].as_u64()),
        (Some(0), Some(0)),
        "{a}"
    );
    assert!(a["consumed_once"].as_u64().unwrap() > 0, "{a}");
}

/// The group's epoch changes (events.jsonl), in order.
fn epochs(sup: &Sup) -> Vec<Value> {
    sup.events()
        .into_iter()
        .filter(|e| e["event"] == "group_epoch")
        .collect()
}

#[test]
fn a_rank_killed_in_the_middle_of_an_all_reduce_leaves_the_step_to_the_survivors_in_the_next_epoch()
{
    // Rank 1 dies in step 5's all-reduce once both other ranks have posted their gradient
    // and wait for it: the step is not committed with it, its batch goes back to the
    // queue, and the survivors reduce their own again in a new epoch.
    let mut sup = Sup::start_real_env(
        &[
            "--gpus",
            "cpu:4",
            "--targets",
            "1",
            "--data",
            "demo",
            "--epochs",
            "50",
            "--steps",
            "20",
            "--max-seq-len",
            "48",
            "--token-budget",
            "384",
            "--stable-after",
            "200ms",
        ],
        &[("DFLASH_TEST_DIE_IN_ALLREDUCE", "1:5")],
    );
    let a = assert_completed_clean(&mut sup, 20);
    let log = sup.log("drafter-1") + &sup.log("drafter-2") + &sup.log("drafter-0");
    assert!(
        log.contains("test fault: dying in the all-reduce of step 5"),
        "{log}"
    );
    let ep = epochs(&sup);
    let abort = ep
        .iter()
        .find(|e| e["why"] == "rank 1 left")
        .unwrap_or_else(|| panic!("no epoch after rank 1 left: {ep:?}"));
    assert_eq!(abort["step"], 5, "{abort}");
    let mut waiting: Vec<u64> = abort["in_flight"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_u64().unwrap())
        .collect();
    waiting.sort();
    assert_eq!(
        waiting,
        [0, 2],
        "both survivors were in the middle of the all-reduce: {abort}"
    );
    assert_eq!(abort["ranks"], serde_json::json!([0, 2]), "{abort}");
    let s5 = steps(&sup.run_dir)
        .into_iter()
        .find(|s| s["step"] == 5)
        .unwrap();
    assert!(
        s5["group_epoch"].as_u64().unwrap() >= abort["epoch"].as_u64().unwrap(),
        "{s5}"
    );
    // Step 5 commits in a later epoch than the abort. It holds the survivors' two
    // batches, unless the restarted rank 1 joined in time to train on a batch of its
    // own for it (a new life with a new batch, in an epoch after the abort): on a loaded
    // machine either may come first.
    let rejoined = ep.iter().any(|e| {
        e["why"].as_str().unwrap_or("").starts_with("rank 1 joined")
            && e["step"] == 5
            && e["epoch"].as_u64() > abort["epoch"].as_u64()
            && e["epoch"].as_u64() <= s5["group_epoch"].as_u64()
    });
    let expect = if rejoined { 3 } else { 2 };
    assert_eq!(s5["contributors"], expect, "step 5 holds the batches of the members of its epoch (rank 1 rejoined in time: {rejoined}): {s5} {ep:?}");
    assert!(
        a["requeued"].as_u64().unwrap() >= 1,
        "the dead rank's batch went back: {a}"
    );
    let contributions: u64 = steps(&sup.run_dir)
        .iter()
        .map(|s| s["contributors"].as_u64().unwrap())
        .sum();
    assert_eq!(
        a["consumed_once"].as_u64().unwrap(),
        contributions,
        "a batch is consumed exactly when its gradient is in a committed step: {a}"
    );
    assert_eq!(
        steps(&sup.run_dir).last().unwrap()["members"],
        3,
        "rank 1 is back by the end (15 steps after its death)"
    );
}

#[test]
fn ranks_killed_one_at_a_time_at_random_instants_while_the_others_reduce_lose_nothing() {
    // Three ranks; one of them killed at random instants, eight times. Most kills land
    // while the other two wait in an all-reduce for it, or have reduced and wait for the
    // commit; the epochs abort those, and the ledger audit proves every batch reached the
    // weights exactly once.
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:4",
        "--targets",
        "1",
        "--data",
        "demo",
        "--epochs",
        "50",
        "--steps",
        "40",
        "--max-seq-len",
        "48",
        "--token-budget",
        "384",
        "--stable-after",
        "200ms",
        "--max-rollbacks",
        "20",
    ]);
    let mut rng = Lcg(5);
    let mut last = 0;
    let restarts = |s: &Value| -> u64 {
        s["workers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|w| w["role"] == "drafter")
            .map(|w| w["restarts"].as_u64().unwrap_or(0))
            .sum()
    };
    for kill in 0..8 {
        let at = last + 1 + rng.below(3);
        if at >= 37 {
            break;
        }
        let s = sup.wait_state(&format!("step {at} before kill {kill}"), T, |s| {
            step_of(s) >= at
        });
        last = step_of(&s);
        let before = restarts(&s);
        let victim = format!("drafter-{}", rng.below(3));
        signal(pid_of(&s, &victim), Signal::SIGKILL);
        sup.wait_state(&format!("{victim} restarted"), T, |s| {
            restarts(s) > before
                && s["workers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|w| w["role"] == "drafter" && w["state"] == "running")
                    .count()
                    == 3
        });
    }
    let a = assert_completed_clean(&mut sup, 40);
    let st = steps(&sup.run_dir);
    let numbers: std::collections::BTreeSet<u64> =
        st.iter().map(|s| s["step"].as_u64().unwrap()).collect();
    assert_eq!(
        numbers,
        (1..=40).collect(),
        "every step committed once in the final lineage"
    );
    let contributions: u64 = st.iter().map(|s| s["contributors"].as_u64().unwrap()).sum();
    assert_eq!(a["consumed_once"].as_u64().unwrap(), contributions, "{a}");
    let left = epochs(&sup)
        .iter()
        .filter(|e| e["why"].as_str().is_some_and(|w| w.ends_with(" left")))
        .count();
    assert!(left >= 4, "the kills changed the group's epoch: {left}");
    assert!(!sup.stderr().contains("diverged"));
}

/// The largest batch id each session of a run loaded (sessions end with an `end` record).
fn max_load_per_session(run: &Path) -> Vec<u64> {
    let mut out = vec![0];
    for r in read_jsonl(&run.join("ledger.jsonl")) {
        match r["ev"].as_str() {
            Some("load") => {
                let last = out.last_mut().unwrap();
                *last = (*last).max(r["batch"].as_u64().unwrap());
            }
            Some("end") => out.push(0),
            _ => {}
        }
    }
    out.pop();
    out
}

#[test]
fn a_short_resumed_session_loses_nothing_and_a_finished_run_has_nothing_in_flight() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--epochs",
        "50",
        "--steps",
        "40",
        "--prefetch",
        "8",
        "--checkpoint-every",
        "0",
    ]);
    sup.wait_state("step 6", T, |s| step_of(s) >= 6);
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(T).code(), Some(75), "{}", sup.stderr());
    let stopped_at = steps(&sup.run_dir).last().unwrap()["step"]
        .as_u64()
        .unwrap();
    let run = sup.run_dir.to_str().unwrap().to_string();
    // A short session that loads ahead less (--prefetch 1), stopped as soon as it loads:
    // it loads again fewer of the batches that the first one held.
    let second = std::process::Command::new(bin("dflash-supervise"))
        .args(["--gpus", "cpu:2", "--resume", &run, "--prefetch", "1"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the second session's first load", T, || {
        (max_load_per_session(&sup.run_dir).len() == 1
            && read_jsonl(&sup.run_dir.join("ledger.jsonl"))
                .iter()
                .rev()
                .take_while(|r| r["ev"] != "end")
                .any(|r| r["ev"] == "load"))
        .then_some(())
    });
    signal(second.id(), Signal::SIGTERM);
    let out = second.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(matches!(out.status.code(), Some(0 | 75)), "{err}");
    let loads = max_load_per_session(&sup.run_dir);
    assert!(loads.len() == 2 && loads[1] < loads[0], "{loads:?}");
    let (code, a) = sup.ledger();
    assert_eq!(code, 0, "{a}");
    assert_eq!(
        (a["lost"].as_u64(), a["duplicated"].as_u64()),
        (Some(0), Some(0)),
        "{a}"
    );
    assert!(
        a["in_flight"].as_u64() > Some(loads[1] - loads[0].min(loads[1])),
        "{a}"
    );
    // Finished at its --steps: what it loaded ahead is not "in flight".
    let last = steps(&sup.run_dir).last().unwrap()["step"]
        .as_u64()
        .unwrap();
    let until = (last.max(stopped_at) + 2).to_string();
    let out = supervise(
        &["--gpus", "cpu:2", "--resume", &run, "--steps", &until],
        None,
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (code, a) = sup.ledger();
    assert_eq!(code, 0, "{a}");
    assert_eq!(
        (a["lost"].as_u64(), a["in_flight"].as_u64()),
        (Some(0), Some(0)),
        "{a}"
    );
    assert!(a["loaded_ahead"].as_u64() > Some(0), "{a}");
    let text = supervise(&["ledger", "--run-dir", &run], None);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("in flight        0") && text.contains("loaded ahead"),
        "{text}"
    );
}

#[test]
fn a_resume_stopped_before_its_first_step_reports_the_checkpoints_step_and_loss() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--epochs",
        "50",
        "--steps",
        "40",
        "--checkpoint-every",
        "0",
    ]);
    sup.wait_state("step 3", T, |s| step_of(s) >= 3);
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(T).code(), Some(75), "{}", sup.stderr());
    let last = steps(&sup.run_dir).last().unwrap().clone();
    let (step, loss) = (
        last["step"].as_u64().unwrap(),
        last["loss"].as_f64().unwrap(),
    );
    assert!(loss > 0.0, "{last}");
    // The drafter of the resumed session waits 10 min before it connects: no step comes.
    let run = sup.run_dir.to_str().unwrap().to_string();
    let second = std::process::Command::new(bin("dflash-supervise"))
        .args(["--gpus", "cpu:2", "--resume", &run, "--worker-bin"])
        .arg(test_worker())
        .env("DFLASH_TEST_BEHAVIOR", "drafter-0@0=hello-delay:600000")
        .env("DFLASH_TEST_REAL_WORKER", bin("dflash-worker"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let says = |s: &Value| {
        (
            s["train"]["step"].as_u64(),
            s["train"]["loss"].as_f64(),
            s["train"]["acceptance"].as_f64(),
        )
    };
    let pid = second.id();
    let st = sup.wait_state("the resumed session running", T, |s| {
        s["supervisor_pid"].as_u64() == Some(pid as u64)
            && worker(s, "target-0")["state"] == "running"
    });
    let want = (Some(step), Some(loss), last["acceptance"].as_f64());
    assert_eq!(says(&st), want, "{st}");
    signal(pid, Signal::SIGINT);
    let out = second.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(75),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let st = sup.state().unwrap();
    assert_eq!(says(&st), want, "{st}");
    let status = supervise(&["status", "--run-dir", &run, "--json"], None);
    let v: Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(says(&v), want, "{v}");
}

// ---------------------------------------------------------------------------------------
// Requeues and resumes (issue 39): what a job requeued by Slurm meets, with the same
// command line each time.

/// Run `dflash-supervise ARGS` (with `env` added) to its end, within `T`: its exit code
/// and stderr.
fn run_to_end(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let tmp = tempfile::tempdir().unwrap();
    let err = tmp.path().join("stderr");
    let mut cmd = std::process::Command::new(bin("dflash-supervise"));
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let deadline = std::time::Instant::now() + T;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "dflash-supervise {} did not end within {T:?}:\n{}",
                args.join(" "),
                std::fs::read_to_string(&err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = std::fs::read_to_string(&err).unwrap_or_default();
    (status.code().unwrap_or(-1), text)
}

/// The names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The `RUN.attempt-*` directories beside `run`.
fn attempts(run: &Path) -> Vec<std::path::PathBuf> {
    let prefix = format!("{}.attempt-", run.file_name().unwrap().to_string_lossy());
    let parent = run.parent().unwrap();
    listing(parent)
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .map(|n| parent.join(n))
        .collect()
}

/// The step of the drafter exported in `run/drafter` (its config.json).
fn drafter_step(run: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(run.join("drafter/config.json")).ok()?;
    serde_json::from_str::<Value>(&text).ok()?["dflash_training"]["step"].as_u64()
}

fn finished_step(run: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(run.join("finished.json")).ok()?;
    serde_json::from_str::<Value>(&text).ok()?["step"].as_u64()
}

#[test]
fn a_requeue_refused_for_a_bad_flag_moves_no_run_aside_and_one_that_starts_does() {
    // A run stopped before its first step: no checkpoint, nothing to resume.
    let mut sup = Sup::start_real(&["--gpus", "cpu:2"]);
    sup.wait_running(2);
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(T).code(), Some(75), "{}", sup.stderr());
    assert!(sup.run_dir.join("run.json").is_file());
    let before = listing(&sup.run_dir);
    let run = sup.run_dir.to_str().unwrap().to_string();
    let cmd = |extra: &[&'static str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "--gpus",
            "cpu:2",
            "--data",
            "demo",
            "--demo-samples",
            "64",
            "--steps",
            "2",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
        v.extend(["--run-dir".into(), run.clone(), "--resume-if-exists".into()]);
        v
    };
    // Refused flags, one checked with the others and one only once the target is read:
    // every retry leaves the run where it is.
    for (bad, names) in [
        (&["--eval-every", "5"][..], "--eval-every 5"),
        (
            &["--target", "/nonexistent/model"][..],
            "/nonexistent/model",
        ),
    ] {
        let args = cmd(bad);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, err) = run_to_end(&args, &[]);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains(names), "{err}");
        assert_eq!(
            attempts(&sup.run_dir),
            Vec::<std::path::PathBuf>::new(),
            "{err}"
        );
        assert_eq!(listing(&sup.run_dir), before, "{err}");
    }
    // The command that starts: the old run goes aside once, the new one takes its place.
    let args = cmd(&[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, err) = run_to_end(&args, &[]);
    assert_eq!(code, 0, "{err}");
    let moved = attempts(&sup.run_dir);
    assert_eq!(moved.len(), 1, "{moved:?}");
    assert_eq!(listing(&moved[0]), before);
    assert_eq!(finished_step(&sup.run_dir), Some(2), "{err}");
}

#[test]
fn a_requeue_of_a_run_that_trained_its_steps_but_did_not_finish_finishes_it_and_exits_0() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let cmd = [
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--demo-samples",
        "64",
        "--steps",
        "4",
        "--run-dir",
        run.to_str().unwrap(),
        "--resume-if-exists",
    ];
    // The export at the run's end fails: ENOSPC on its new directory only (the
    // fault-injection preload library, as in faults.rs).
    let lib = cdylib("libdflash_fault_inject.so").display().to_string();
    let full_disk = [
        ("LD_PRELOAD", lib.as_str()),
        ("DFLASH_FAULT_CALL", "mkdir"),
        ("DFLASH_FAULT_PATH", ".drafter.export-"),
        ("DFLASH_FAULT_ACTION", "errno:28"),
    ];
    let (code, err) = run_to_end(&cmd, &full_disk);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("the drafter (step 4) could not be written"),
        "{err}"
    );
    assert!(!run.join("drafter").exists() && !run.join("finished.json").exists());
    let events = read_jsonl(&run.join("events.jsonl")).len();
    // The requeue: no worker started, the drafter written, the end recorded, exit 0.
    let (code, err) = run_to_end(&cmd, &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("had trained its --steps 4 but its last session ended before finishing")
            && err.contains("drafter (step 4) written to")
            && err.contains("finished now"),
        "{err}"
    );
    assert_eq!(drafter_step(&run), Some(4));
    assert_eq!(finished_step(&run), Some(4));
    assert_eq!(read_jsonl(&run.join("events.jsonl")).len(), events, "{err}");
    // Requeued again: finished.
    let (code, err) = run_to_end(&cmd, &[]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("already finished at step 4"), "{err}");
    // A session whose export was written but whose stop was unclean (exit 3) leaves the
    // drafter and no record: the record is written, the drafter not again.
    std::fs::remove_file(run.join("finished.json")).unwrap();
    let weights = run.join("drafter/model.safetensors");
    let written = std::fs::metadata(&weights).unwrap().modified().unwrap();
    let (code, err) = run_to_end(&["--gpus", "cpu:2", "--resume", run.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("its drafter (step 4) is in"), "{err}");
    assert_eq!(
        std::fs::metadata(&weights).unwrap().modified().unwrap(),
        written
    );
    assert_eq!(finished_step(&run), Some(4));
}

#[test]
fn a_corrupt_finished_record_is_named_in_a_warning_and_the_run_taken_as_not_finished() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let run_s = run.to_str().unwrap();
    let cmd = ["--gpus", "cpu:2", "--data", "demo", "--demo-samples", "64"];
    let (code, err) = run_to_end(
        &[&cmd[..], &["--steps", "2", "--run-dir", run_s]].concat(),
        &[],
    );
    assert_eq!(code, 0, "{err}");
    std::fs::write(run.join("finished.json"), "{\"step\": 2,").unwrap();
    let (code, err) = run_to_end(&["--gpus", "cpu:2", "--resume", run_s], &[]);
    assert_eq!(code, 0, "{err}");
    let warning = format!(
        "warning: {} is not a record of a run's end",
        run.join("finished.json").display()
    );
    assert!(
        err.contains(&warning) && err.contains("the run is taken as not finished"),
        "{err}"
    );
    assert!(err.contains("had trained its --steps 2"), "{err}");
    assert_eq!(finished_step(&run), Some(2), "written again");
}

#[test]
fn a_checkpoint_of_a_newer_dflash_supervise_refuses_the_resume_and_nothing_is_moved() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let run_s = run.to_str().unwrap();
    let (code, err) = run_to_end(
        &[
            "--gpus",
            "cpu:2",
            "--data",
            "demo",
            "--demo-samples",
            "64",
            "--steps",
            "4",
            "--checkpoint-every",
            "2",
            "--run-dir",
            run_s,
        ],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    // The newest checkpoint as a newer version would write it: a larger format.
    let newest = run.join("checkpoints/step-00000004");
    let meta = newest.join("meta.json");
    let text = std::fs::read_to_string(&meta).unwrap();
    assert!(text.contains("\"format\": 1"), "{text}");
    std::fs::write(&meta, text.replace("\"format\": 1", "\"format\": 2")).unwrap();
    let (run_before, checkpoints_before) = (listing(&run), listing(&run.join("checkpoints")));
    let steps_before = steps(&run).len();
    let (code, err) = run_to_end(&["--gpus", "cpu:2", "--resume", run_s, "--steps", "6"], &[]);
    assert_eq!(code, 2, "{err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "one line: {err}");
    let err = errors[0];
    assert!(
        err.contains(&format!(
            "{} was written by a newer dflash-supervise (checkpoint format 2; this one",
            newest.display()
        )) && err.contains("reads format 1)")
            && err.contains("use the newer dflash-supervise"),
        "{err}"
    );
    assert_eq!(listing(&run), run_before, "nothing set aside");
    assert_eq!(listing(&run.join("checkpoints")), checkpoints_before);
    assert_eq!(steps(&run).len(), steps_before, "nothing trained");
    // export does not pass it over for the older step's either.
    let out = supervise(
        &[
            "export",
            run_s,
            "--out",
            tmp.path().join("x").to_str().unwrap(),
        ],
        None,
    );
    let e = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{e}");
    assert!(
        e.contains("use the newer dflash-supervise to export it"),
        "{e}"
    );
    assert!(!tmp.path().join("x").exists());
}

#[test]
fn a_data_file_copied_again_with_a_new_time_resumes_and_one_with_a_byte_changed_does_not() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data.jsonl");
    let mut text = String::new();
    for i in 0..64 {
        let ids: Vec<String> = (0..48)
            .map(|j| ((i * 7 + j * 3) % 500 + 1).to_string())
            .collect();
        text.push_str(&format!("{{\"input_ids\": [{}]}}\n", ids.join(",")));
    }
    std::fs::write(&data, &text).unwrap();
    let run = tmp.path().join("run");
    let run_s = run.to_str().unwrap();
    let (code, err) = run_to_end(
        &[
            "--gpus",
            "cpu:2",
            "--data",
            data.to_str().unwrap(),
            "--max-seq-len",
            "64",
            "--token-budget",
            "128",
            "--epochs",
            "10",
            "--steps",
            "3",
            "--run-dir",
            run_s,
        ],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let set_time = |secs: u64| {
        std::fs::File::options()
            .write(true)
            .open(&data)
            .unwrap()
            .set_modified(std::time::UNIX_EPOCH + Duration::from_secs(secs))
            .unwrap()
    };
    // One byte changed, the size and time as they were: refused.
    let modified = std::fs::metadata(&data).unwrap().modified().unwrap();
    let at = text.rfind("500").unwrap();
    let mut other = text.clone().into_bytes();
    other[at] = b'4';
    std::fs::write(&data, &other).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&data)
        .unwrap()
        .set_modified(modified)
        .unwrap();
    let resume = ["--gpus", "cpu:2", "--resume", run_s, "--steps", "5"];
    let (code, err) = run_to_end(&resume, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("the data file") && err.contains("changed since the run started"),
        "{err}"
    );
    // The same bytes, copied again (a new modification time): the same data.
    std::fs::write(&data, &text).unwrap();
    set_time(2_000_000_000);
    let (code, err) = run_to_end(&resume, &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(steps(&run).last().unwrap()["step"], 5, "{err}");
}

#[test]
fn a_best_link_left_dangling_by_a_resume_is_pointed_at_the_best_checkpoint_left() {
    let tmp = tempfile::tempdir().unwrap();
    let eval = tmp.path().join("eval.jsonl");
    let mut text = String::new();
    for i in 0..8 {
        let ids: Vec<String> = (0..24)
            .map(|t| ((t * 7 + i * 13 + 3) % 500 + 1).to_string())
            .collect();
        text.push_str(&format!("{{\"input_ids\": [{}]}}\n", ids.join(", ")));
    }
    std::fs::write(&eval, text).unwrap();
    let run = tmp.path().join("run");
    let run_s = run.to_str().unwrap();
    let (code, err) = run_to_end(
        &[
            "--gpus",
            "cpu:2",
            "--data",
            "demo",
            "--demo-samples",
            "64",
            "--steps",
            "4",
            "--checkpoint-every",
            "2",
            "--eval-data",
            eval.to_str().unwrap(),
            "--eval-every",
            "2",
            "--run-dir",
            run_s,
        ],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let checkpoints = run.join("checkpoints");
    let best = checkpoints.join("best");
    // The best is the newest checkpoint, whose state is then damaged: the resume sets
    // it aside.
    std::fs::remove_file(&best).unwrap();
    std::os::unix::fs::symlink("step-00000004", &best).unwrap();
    let state = checkpoints.join("step-00000004/state.safetensors");
    let mut bytes = std::fs::read(&state).unwrap();
    *bytes.last_mut().unwrap() ^= 1;
    std::fs::write(&state, bytes).unwrap();
    let (code, err) = run_to_end(&["--gpus", "cpu:2", "--resume", run_s, "--steps", "6"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(&format!(
            "warning: {} pointed at step-00000004, which is no longer there: now at step-00000002, the best checkpoint left",
            best.display()
        )),
        "{err}"
    );
    let target = std::fs::read_link(&best).unwrap();
    assert!(
        checkpoints.join(&target).join("meta.json").is_file(),
        "{}",
        target.display()
    );
}
