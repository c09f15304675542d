//! `dflash-supervise status`: the workers of a run, from its state.json, with their
//! restarts counted over every session of the run from events.jsonl.
//!
//! state.json is the current supervisor's: after a `--resume` its restart counts and batch
//! counts start again from zero, while events.jsonl holds every session. Restarts are
//! counted over the whole run; the batch counts are labelled as this session's.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::SystemTime;

use dflash_shared::exit_codes;

use crate::cli::StatusArgs;
use crate::error::Error;
use crate::run::rundir::{ExistingRun, EVENTS_FILE};
use crate::state::RunState;

/// What events.jsonl says of the whole run, over every session.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct History {
    /// Supervisor sessions: one `run_start` each (the first run and every `--resume`).
    pub sessions: u64,
    /// Restarts per worker over every session (one `restart` event each).
    pub restarts: BTreeMap<String, u64>,
}

impl History {
    /// Read from the text of events.jsonl; lines that are not JSON (a last line a crash
    /// cut short) are skipped.
    pub(crate) fn of(events: &str) -> History {
        let mut h = History::default();
        for v in events
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        {
            match v["event"].as_str() {
                Some("run_start") => h.sessions += 1,
                Some("restart") => {
                    if let Some(w) = v["worker"].as_str() {
                        *h.restarts.entry(w.to_string()).or_default() += 1;
                    }
                }
                _ => {}
            }
        }
        h
    }

    /// A worker's restarts over the run: the events', or the state's when events.jsonl
    /// holds fewer (missing or cut short).
    fn restarts(&self, name: &str, this_session: u32) -> u64 {
        self.restarts
            .get(name)
            .copied()
            .unwrap_or(0)
            .max(this_session as u64)
    }
}

pub fn run(args: StatusArgs) -> Result<i32, Error> {
    let run = ExistingRun::open(args.run_dir.as_deref())?;
    let state = run.state()?;
    let alive = run.supervisor_alive();
    let history =
        History::of(&std::fs::read_to_string(run.path.join(EVENTS_FILE)).unwrap_or_default());
    if args.json {
        let mut v = serde_json::to_value(&state).map_err(|e| Error::json("the run state", e))?;
        v["supervisor_alive"] = alive.into();
        v["sessions"] = history.sessions.max(1).into();
        if let Some(ws) = v["workers"].as_array_mut() {
            for (w, s) in ws.iter_mut().zip(&state.workers) {
                w["restarts"] = history.restarts(&s.name, s.restarts).into();
                w["restarts_this_session"] = s.restarts.into();
            }
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| Error::json("the run state", e))?
        );
        return Ok(exit_codes::SUCCESS);
    }
    print!("{}", text(&state, alive, &history));
    Ok(exit_codes::SUCCESS)
}

/// The status as printed.
fn text(state: &RunState, alive: bool, history: &History) -> String {
    let mut out = String::new();
    macro_rules! put {
        ($($t:tt)*) => {
            let _ = writeln!(out, $($t)*);
        };
    }
    let resumed = history.sessions > 1;
    put!("run:        {}", state.run_dir.display());
    let sup = match (alive, state.exit_code) {
        (true, _) => format!(
            "pid {}, {} (up {})",
            state.supervisor_pid,
            state.phase,
            since(&state.started_at)
        ),
        (false, Some(code)) => format!("ended: {} with exit code {code}", state.phase),
        (false, None) => format!(
            "pid {} is gone without recording an exit (killed?); the pids below are stale",
            state.supervisor_pid
        ),
    };
    put!("supervisor: {sup}");
    put!(
        "batches:    {} consumed of {} loaded{}",
        state.batches_consumed,
        state.batches_produced,
        if resumed {
            format!(
                " in this session (session {} of the run, resumed with --resume)",
                history.sessions
            )
        } else {
            String::new()
        }
    );
    if let Some(t) = state.train.as_ref().filter(|t| t.step > 0) {
        let exported = t
            .exported
            .as_deref()
            .map(|d| format!("; drafter written to {d}"))
            .unwrap_or_default();
        put!(
            "training:   step {}, loss {:.4}, acceptance {:.2}, {} drafter rank(s){exported}",
            t.step,
            t.loss,
            t.acceptance,
            t.members
        );
        for line in quality_lines(t) {
            put!("{line}");
        }
    }
    if resumed {
        put!(
            "restarts:   over all {} sessions of the run (this session's in parentheses)",
            history.sessions
        );
    }
    put!();
    put!(
        "{:<12} {:<8} {:<4} {:>8}  {:<9} {:>8}  {:<8} LAST EXIT",
        "WORKER",
        "ROLE",
        "GPU",
        "PID",
        "STATE",
        "RESTARTS",
        "UP"
    );
    for w in &state.workers {
        let pid = w.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into());
        let up = if alive {
            w.started_at
                .as_deref()
                .map(since)
                .unwrap_or_else(|| "-".into())
        } else {
            "-".into()
        };
        let total = history.restarts(&w.name, w.restarts);
        let restarts = if resumed {
            format!("{total} ({})", w.restarts)
        } else {
            total.to_string()
        };
        put!(
            "{:<12} {:<8} {:<4} {:>8}  {:<9} {:>8}  {:<8} {}",
            w.name,
            w.role,
            w.gpu,
            pid,
            w.state,
            restarts,
            up,
            w.last_exit.as_deref().unwrap_or("-")
        );
    }
    out
}

/// "5m 12s" since an RFC 3339 time.
fn since(t: &str) -> String {
    let Ok(then) = humantime::parse_rfc3339(t) else {
        return "-".into();
    };
    let secs = SystemTime::now()
        .duration_since(then)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    humantime::format_duration(std::time::Duration::from_secs(secs)).to_string()
}

/// What the drafter is worth so far: its last τ (`--eval-prompts`), its last eval
/// (`--eval-data`), and the best checkpoint, one line each when known.
fn quality_lines(t: &crate::state::TrainProgress) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(tau) = &t.tau {
        let ci = tau["pooled_ci95"]
            .as_array()
            .filter(|a| a.len() == 2)
            .map(|a| {
                format!(
                    " (95% CI [{:.2}, {:.2}])",
                    a[0].as_f64().unwrap_or(0.0),
                    a[1].as_f64().unwrap_or(0.0)
                )
            })
            .unwrap_or_default();
        out.push(format!(
            "τ:          {:.3}{ci} at step {}, over {} prompts",
            tau["pooled"].as_f64().unwrap_or(0.0),
            tau["step"].as_u64().unwrap_or(0),
            tau["prompts"].as_u64().unwrap_or(0)
        ));
    }
    if let (Some(step), Some(loss), Some(acc)) = (t.eval_step, t.eval_loss, t.eval_acceptance) {
        out.push(format!(
            "eval:       loss {loss:.4}, acceptance {acc:.2} at step {step}"
        ));
    }
    if let Some(b) = t.best_step {
        out.push(format!(
            "best:       the checkpoint of step {b} (checkpoints/best)"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::WorkerState;

    /// Two sessions: drafter-0 restarted twice before the stop, once after the --resume.
    const EVENTS: &str = r#"{"time":"t","event":"run_start","workers":["target-0 on cpu","drafter-0 on cpu"]}
{"time":"t","event":"restart","worker":"drafter-0","restarts":1}
{"time":"t","event":"restart","worker":"drafter-0","restarts":2}
{"time":"t","event":"restart","worker":"target-0","restarts":1}
{"time":"t","event":"run_end"}
{"time":"t","event":"run_start","workers":["target-0 on cpu","drafter-0 on cpu"]}
{"time":"t","event":"restart","worker":"drafter-0","restarts":1}
{"time":"t","event":"rest"#;

    fn state(restarts: &[(&str, u32)]) -> RunState {
        RunState {
            run_dir: "/runs/a".into(),
            supervisor_pid: 1,
            started_at: "2026-01-01T00:00:00Z".into(),
            started_at_unix_ms: 0,
            phase: "stopped".into(),
            exit_code: Some(0),
            batches_produced: 5,
            batches_consumed: 4,
            bad_lines: None,
            train: None,
            metrics: None,
            workers: restarts
                .iter()
                .map(|(name, r)| WorkerState {
                    name: name.to_string(),
                    role: name.split('-').next().unwrap().into(),
                    rank: 0,
                    gpu: "cpu".into(),
                    pid: None,
                    state: "exited".into(),
                    restarts: *r,
                    started_at: None,
                    last_exit: None,
                    log: "/runs/a/logs/x.log".into(),
                })
                .collect(),
        }
    }

    #[test]
    fn restarts_count_every_session_and_batches_say_whose_they_are() {
        let h = History::of(EVENTS);
        assert_eq!(h.sessions, 2);
        assert_eq!(
            h.restarts.into_iter().collect::<Vec<_>>(),
            [("drafter-0".to_string(), 3), ("target-0".to_string(), 1)],
            "the cut last line is skipped"
        );
        let h = History::of(EVENTS);
        // state.json is the resumed session's: one restart of drafter-0, none of target-0.
        let t = text(&state(&[("target-0", 0), ("drafter-0", 1)]), false, &h);
        assert_eq!(row_of(&t, "drafter-0")[5..7], ["3", "(1)"], "{t}");
        assert_eq!(row_of(&t, "target-0")[5..7], ["1", "(0)"], "{t}");
        assert!(
            t.contains("4 consumed of 5 loaded in this session (session 2 of the run"),
            "{t}"
        );
        // A run never resumed reads as before.
        let one = History::of(
            EVENTS
                .split("{\"time\":\"t\",\"event\":\"run_end\"}")
                .next()
                .unwrap(),
        );
        let t = text(&state(&[("target-0", 1), ("drafter-0", 2)]), false, &one);
        assert!(t.contains("batches:    4 consumed of 5 loaded\n"), "{t}");
        assert_eq!(row_of(&t, "drafter-0")[5], "2");
        // Without events.jsonl, the state's counts.
        let t = text(&state(&[("drafter-0", 2)]), false, &History::default());
        assert_eq!(row_of(&t, "drafter-0")[5], "2");
    }

    #[test]
    fn tau_eval_and_the_best_checkpoint_are_shown_when_known() {
        let mut st = state(&[("drafter-0", 0)]);
        st.train = Some(crate::state::TrainProgress {
            step: 40,
            loss: 2.5,
            members: 1,
            eval_step: Some(40),
            eval_loss: Some(2.75),
            eval_acceptance: Some(1.5),
            best_step: Some(30),
            tau: Some(
                serde_json::json!({"step": 40, "prompts": 8, "pooled": 2.345,
                "pooled_ci95": [2.0, 2.7]}),
            ),
            ..Default::default()
        });
        let t = text(&st, false, &History::default());
        assert!(
            t.contains("τ:          2.345 (95% CI [2.00, 2.70]) at step 40, over 8 prompts"),
            "{t}"
        );
        assert!(
            t.contains("eval:       loss 2.7500, acceptance 1.50 at step 40"),
            "{t}"
        );
        assert!(t.contains("best:       the checkpoint of step 30"), "{t}");
    }

    fn row_of<'a>(t: &'a str, name: &str) -> Vec<&'a str> {
        t.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name}: {t}"))
            .split_whitespace()
            .collect()
    }
}
