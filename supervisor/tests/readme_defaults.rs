//! The run-options table of docs/cli-guide.md (once the README's) agrees with the command line: every flag it names exists,
//! and every default it gives for a flag that has one in the command line (clap's, which
//! `--help` prints as `[default: ...]`) is that default. Without this check the table said
//! `--stop-timeout` defaults to 120s long after the program changed it to 25s.
//!
//! Flags whose default clap does not hold (it depends on the target, the devices or the
//! data: `--token-budget`, `--lr`, `--gpus`, ...) and on/off switches are checked only for
//! existence: their cells describe, they cannot drift from a value.

use std::time::Duration;

use clap::{ArgAction, CommandFactory};
use dflash_supervisor::cli::Cli;

/// The cells of one table row, `\|` read as a `|` inside a cell.
fn cells(row: &str) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut chars = row.trim().trim_matches('|').chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                out.last_mut().unwrap().push('|');
                chars.next();
            }
            '|' => out.push(String::new()),
            c => out.last_mut().unwrap().push(c),
        }
    }
    out.iter().map(|c| c.trim().to_string()).collect()
}

/// `text` split at " / " outside parentheses: "16 / 512 (tiny: 8 / 32)" is two parts.
fn parts(text: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth) = (Vec::new(), String::new(), 0i32);
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if depth == 0 && rest.starts_with(" / ") {
            out.push(std::mem::take(&mut cur));
            rest = &rest[3..];
            continue;
        }
        depth += match c {
            '(' => 1,
            ')' => -1,
            _ => 0,
        };
        cur.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out.push(cur);
    out.iter().map(|p| p.trim().to_string()).collect()
}

/// The long flags a cell names (`--eval-every N` -> `eval-every`).
fn flags(cell: &str) -> Vec<String> {
    cell.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter_map(|w| w.strip_prefix("--"))
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect()
}

/// The value a default cell's part gives: backticks off, a note in parentheses dropped
/// ("5 (2 for targets under 12 layers)" gives 5).
fn value(part: &str) -> String {
    let v = part.replace('`', "");
    v.split(" (").next().unwrap_or("").trim().to_string()
}

/// The same default: equal text, or the same duration however it is written.
fn same(readme: &str, clap: &str) -> bool {
    let d = |s: &str| humantime::parse_duration(s).ok();
    readme == clap
        || matches!((d(readme), d(clap)), (Some(a), Some(b)) if a == b && a > Duration::ZERO)
}

/// (option cell, default cell) of each row of the run-options table.
fn readme_rows() -> Vec<(String, String)> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/cli-guide.md"))
            .expect("docs/cli-guide.md");
    let table = readme
        .split("\n| option | default | meaning |\n")
        .nth(1)
        .expect("docs/cli-guide.md has the run-options table (| option | default | meaning |)");
    table
        .lines()
        .skip(1) // |---|---|---|
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let c = cells(l);
            assert_eq!(c.len(), 3, "a row of three cells: {l}");
            (c[0].clone(), c[1].clone())
        })
        .collect()
}

/// Every mismatch between the table's defaults and clap's, in words; and how many defaults
/// were compared.
fn mismatches(rows: &[(String, String)]) -> (Vec<String>, usize) {
    let cmd = Cli::command();
    let (mut bad, mut compared) = (Vec::new(), 0);
    for (option, default) in rows {
        let names: Vec<Vec<String>> = parts(option).iter().map(|p| flags(p)).collect();
        let defaults = parts(default);
        for (i, group) in names.iter().enumerate() {
            for name in group {
                let Some(arg) = cmd.get_arguments().find(|a| a.get_long() == Some(name)) else {
                    bad.push(format!(
                        "--{name}: in the README's table, not a flag of dflash-supervise"
                    ));
                    continue;
                };
                let switch = matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse);
                let Some(clap) = arg.get_default_values().first().filter(|_| !switch) else {
                    continue;
                };
                let clap = clap.to_string_lossy();
                let readme = match (group.len(), defaults.len() == names.len()) {
                    (1, true) => value(&defaults[i]),
                    _ => {
                        bad.push(format!("--{name}: the README's row \"{option}\" does not give one default per flag (\"{default}\"); --help says {clap}"));
                        continue;
                    }
                };
                compared += 1;
                if !same(&readme, &clap) {
                    bad.push(format!(
                        "--{name}: the README says its default is \"{readme}\", dflash-supervise --help says {clap}"
                    ));
                }
            }
        }
    }
    (bad, compared)
}

#[test]
fn every_default_in_the_readme_flag_table_is_the_programs() {
    let rows = readme_rows();
    assert!(rows.len() >= 30, "the table has {} rows", rows.len());
    let (bad, compared) = mismatches(&rows);
    assert!(
        bad.is_empty(),
        "docs/cli-guide.md's run options:\n{}",
        bad.join("\n")
    );
    assert!(compared >= 20, "only {compared} defaults compared");
}

#[test]
fn the_check_reads_rows_as_a_reader_does_and_catches_a_drift() {
    assert_eq!(
        cells("| `--collective auto\\|shm\\|nccl` | auto | how |"),
        ["`--collective auto|shm|nccl`", "auto", "how"]
    );
    assert_eq!(
        parts("16 / 512 (tiny: 8 / 32)"),
        ["16", "512 (tiny: 8 / 32)"]
    );
    assert_eq!(
        flags("`--target-gpus SPEC --drafter-gpus SPEC`"),
        ["target-gpus", "drafter-gpus"]
    );
    assert_eq!(value("5 (2 for targets under 12 layers)"), "5");
    assert!(same("5m", "300s") && same("25s", "25s") && !same("120s", "25s"));
    let row = |o: &str, d: &str| vec![(o.to_string(), d.to_string())];
    // The row as it was: caught, naming both values.
    let (bad, n) = mismatches(&row("`--stop-timeout DURATION`", "120s"));
    assert_eq!(n, 1);
    assert_eq!(
        bad,
        ["--stop-timeout: the README says its default is \"120s\", dflash-supervise --help says 25s"]
    );
    // One default per flag of a shared row; a flag that does not exist.
    let (bad, _) = mismatches(&row(
        "`--log-max-size SIZE` / `--log-backups N`",
        "64MiB / 4",
    ));
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(bad[0].starts_with("--log-backups: the README says its default is \"4\""));
    let (bad, _) = mismatches(&row("`--no-such-flag N`", "1"));
    assert_eq!(
        bad,
        ["--no-such-flag: in the README's table, not a flag of dflash-supervise"]
    );
}
