//! The documentation that is generated, checked against its source: `docs/cli.md` from the
//! program's clap definitions (every flag of every command has its row, and a row names
//! nothing the program lacks), and the exit-code table of `docs/run-directory.md` from
//! `shared/src/exit_codes.rs`. `DFLASH_UPDATE_DOCS=1 cargo test -p dflash-supervisor
//! --test docs` writes them.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::CommandFactory;
use dflash_supervisor::cli::Cli;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// One line of a table cell: newlines become spaces, `|` is escaped.
fn cell(s: &str) -> String {
    let one: Vec<&str> = s.split_whitespace().collect();
    one.join(" ").replace('|', "\\|")
}

/// How a flag is written: `--name VALUE` (`-s, --name`), or `<NAME>` for a positional.
fn spelling(a: &clap::Arg) -> String {
    let values: Vec<String> = a
        .get_value_names()
        .map(|v| v.iter().map(|s| s.to_string()).collect())
        .unwrap_or_default();
    let takes = a.get_num_args().is_some_and(|n| n.takes_values())
        || matches!(
            a.get_action(),
            clap::ArgAction::Set | clap::ArgAction::Append
        );
    let value = if takes {
        let v = if values.is_empty() {
            a.get_id().as_str().to_uppercase()
        } else {
            values.join(" ")
        };
        format!(" {v}")
    } else {
        String::new()
    };
    match (a.get_long(), a.get_short()) {
        (Some(l), Some(s)) => format!("`-{s}, --{l}{value}`"),
        (Some(l), None) => format!("`--{l}{value}`"),
        (None, Some(s)) => format!("`-{s}{value}`"),
        (None, None) => format!("`<{}>`", a.get_id().as_str().to_uppercase()),
    }
}

/// The rows of one command's arguments, grouped under their help headings.
fn arguments(out: &mut String, cmd: &clap::Command) {
    let args: Vec<&clap::Arg> = cmd
        .get_arguments()
        .filter(|a| !a.is_hide_set())
        .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
        .collect();
    if args.is_empty() {
        return;
    }
    let mut headings: Vec<Option<&str>> = Vec::new();
    for a in &args {
        if !headings.contains(&a.get_help_heading()) {
            headings.push(a.get_help_heading());
        }
    }
    for h in headings {
        if let Some(h) = h {
            let _ = writeln!(out, "\n**{h}**\n");
        } else {
            out.push('\n');
        }
        out.push_str("| flag | default | what it does |\n|---|---|---|\n");
        for a in args.iter().filter(|a| a.get_help_heading() == h) {
            let default: Vec<String> = a
                .get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect();
            let default = match default.join(",") {
                d if d.is_empty() || d == "false" => String::new(),
                d => format!("`{d}`"),
            };
            let help = a
                .get_long_help()
                .or(a.get_help())
                .map(|s| s.to_string())
                .unwrap_or_default();
            let _ = writeln!(out, "| {} | {default} | {} |", spelling(a), cell(&help));
        }
    }
}

fn command(out: &mut String, cmd: &clap::Command, path: &str) {
    let about = cmd
        .get_long_about()
        .or(cmd.get_about())
        .map(|s| s.to_string())
        .unwrap_or_default();
    let _ = writeln!(out, "\n## `{path}`\n");
    if !about.trim().is_empty() {
        let _ = writeln!(out, "{}", about.trim());
    }
    arguments(out, cmd);
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        if sub.get_name() == "help" {
            continue;
        }
        command(out, sub, &format!("{path} {}", sub.get_name()));
    }
}

/// docs/cli.md as the program defines it.
fn cli_md() -> String {
    let mut cmd = Cli::command();
    cmd.build();
    let mut out = String::from(
        "# Command line\n\nEvery command and flag of `dflash-supervise`, generated from its own \
         definitions (`supervisor/src/cli.rs`) by `supervisor/tests/docs.rs`; do not edit by \
         hand: `DFLASH_UPDATE_DOCS=1 cargo test -p dflash-supervisor --test docs` writes it. \
         `dflash-supervise --help` (and `COMMAND --help`) print the same.\n",
    );
    command(&mut out, &cmd, "dflash-supervise");
    out
}

/// The exit-code table from the constants of `shared/src/exit_codes.rs` and the doc
/// comment above each.
fn exit_code_table() -> String {
    let src = std::fs::read_to_string(root().join("shared/src/exit_codes.rs")).unwrap();
    let mut doc: Vec<String> = Vec::new();
    let head = "| code | name | meaning |\n|---|---|---|\n";
    let (mut sup, mut worker) = (String::from(head), String::from(head));
    for line in src.lines().map(str::trim) {
        if let Some(d) = line.strip_prefix("///") {
            doc.push(d.trim().to_string());
        } else if let Some(rest) = line.strip_prefix("pub const ") {
            let (name, value) = rest
                .split_once(": i32 = ")
                .expect("pub const NAME: i32 = N;");
            let value = value.trim_end_matches(';');
            let text = doc.join(" ");
            let (table, text) = match text.strip_prefix("Worker: ") {
                Some(t) => (&mut worker, t.to_string()),
                None => (&mut sup, text),
            };
            let _ = writeln!(table, "| {value} | `{name}` | {} |", cell(&text));
            doc.clear();
        } else {
            doc.clear();
        }
    }
    format!(
        "`dflash-supervise` ends with:\n\n{sup}\nA worker process (`dflash-worker`) ends with these, which the supervisor reads:\n\n{worker}"
    )
}

const BEGIN: &str =
    "<!-- BEGIN exit-codes: generated from shared/src/exit_codes.rs by supervisor/tests/docs.rs -->";
const END: &str = "<!-- END exit-codes -->";

/// `file` as it is, and as it must be; written when `DFLASH_UPDATE_DOCS` is set.
fn check(file: &Path, want: &str) {
    let have = std::fs::read_to_string(file).unwrap_or_default();
    if have == want {
        return;
    }
    if std::env::var_os("DFLASH_UPDATE_DOCS").is_some() {
        std::fs::write(file, want).unwrap();
        return;
    }
    let first = have
        .lines()
        .zip(want.lines())
        .position(|(a, b)| a != b)
        .unwrap_or(have.lines().count().min(want.lines().count()));
    panic!(
        "{} is not what the program defines (first difference at line {}: {:?} should be {:?}); regenerate it with DFLASH_UPDATE_DOCS=1 cargo test -p dflash-supervisor --test docs",
        file.display(),
        first + 1,
        have.lines().nth(first).unwrap_or(""),
        want.lines().nth(first).unwrap_or("")
    );
}

#[test]
fn docs_cli_md_is_what_the_program_defines() {
    check(&root().join("docs/cli.md"), &cli_md());
}

#[test]
fn every_flag_has_its_row_and_every_row_names_a_flag() {
    let md = cli_md();
    let mut cmd = Cli::command();
    cmd.build();
    fn each(cmd: &clap::Command, f: &mut dyn FnMut(&clap::Arg)) {
        cmd.get_arguments().for_each(&mut *f);
        cmd.get_subcommands().for_each(|s| each(s, f));
    }
    let mut longs = std::collections::BTreeSet::new();
    each(&cmd, &mut |a| {
        if let (Some(l), false) = (a.get_long(), a.is_hide_set()) {
            longs.insert(l.to_string());
        }
    });
    // The flag each row names (its first cell: `--name VALUE` or `-s, --name`).
    let rows: std::collections::BTreeSet<String> = md
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| {
            let first = l.split('`').next()?;
            let at = first.find("--")?;
            Some(first[at + 2..].split(' ').next()?.to_string())
        })
        .collect();
    for l in longs
        .iter()
        .filter(|l| !matches!(l.as_str(), "help" | "version"))
    {
        assert!(rows.contains(l), "--{l} has no row");
    }
    for flag in &rows {
        assert!(
            longs.contains(flag),
            "a row names --{flag}, which no command has"
        );
    }
}

#[test]
fn the_exit_code_table_is_the_one_in_code() {
    let path = root().join("docs/run-directory.md");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let (Some(b), Some(e)) = (text.find(BEGIN), text.find(END)) else {
        panic!("{} has no {BEGIN} … {END} block", path.display());
    };
    let want = format!("{}{BEGIN}\n{}{}", &text[..b], exit_code_table(), &text[e..]);
    check(&path, &want);
}

/// `--help`'s exit-code line names every code of the supervisor's table, once.
#[test]
fn help_names_every_exit_code_of_the_supervisor() {
    let src = std::fs::read_to_string(root().join("shared/src/exit_codes.rs")).unwrap();
    let help = dflash_shared::exit_codes::help();
    // The codes the line names: the number leading each of its comma-separated parts.
    let named: Vec<&str> = help
        .trim_start_matches("Exit codes: ")
        .split(", ")
        .filter_map(|part| part.split(' ').next())
        .collect();
    let mut doc = String::new();
    let mut seen = 0;
    for line in src.lines().map(str::trim) {
        if let Some(d) = line.strip_prefix("///") {
            doc.push_str(d);
        } else if let Some(rest) = line.strip_prefix("pub const ") {
            let value = rest.split_once(": i32 = ").unwrap().1.trim_end_matches(';');
            if !doc.trim_start().starts_with("Worker: ") {
                let times = named.iter().filter(|n| **n == value).count();
                assert_eq!(times, 1, "{value} in {help}");
                seen += 1;
            }
            doc.clear();
        } else {
            doc.clear();
        }
    }
    assert_eq!(seen, named.len(), "{help} names a code the table has not");
}
