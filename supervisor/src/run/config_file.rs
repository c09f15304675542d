//! `--config FILE`: a recipe file. A TOML file of sections ([`SECTIONS`]) whose keys are
//! run flags, each named as its flag with `_` for `-` (`[schedule] warmup_ratio = 0.04` is
//! `--warmup-ratio 0.04`). Flags on the command line win over the file; the file wins over
//! the defaults.
//!
//! The file's settings become flags placed before the command line's, and the whole is
//! parsed by clap again: a value is read by the flag's own parser (durations, sizes,
//! device lists, ranges), and a flag given on the command line (or one it conflicts
//! with: `--target-gpus` over the file's `gpus`) leaves the file's value out (clap's
//! `ArgMatches::value_source` tells typed flags from defaults). What the file sets counts
//! as given, as a typed flag does, for `--resume` (which compares the given settings with
//! the run's): a flag with a default that the file sets joins the typed ones in
//! [`CommandLine::given`]; an optional one counts by having a value.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Command, CommandFactory, FromArgMatches};
use toml::de::{DeTable, DeValue};

use crate::cli::Cli;
use crate::error::Error;

/// The sections of a recipe file and their keys, grouped as the docs group the flags.
/// Every key is a run flag's name with `_` for `-`, except the aliases in `ALIASES`.
pub const SECTIONS: &[(&str, &[&str])] = &[
    ("model", &["target", "target_engine"]),
    (
        "data",
        &[
            "data",
            "tokenizer",
            "max_seq_len",
            "token_budget",
            "seed",
            "max_bad_lines",
            "shuffle_window",
            "demo_samples",
            "preflight_lines",
        ],
    ),
    (
        "devices",
        &[
            "gpus",
            "targets",
            "gpus_per_target",
            "target_gpus",
            "drafter_gpus",
        ],
    ),
    (
        "drafter",
        &[
            "draft_layers",
            "layers",
            "taps",
            "block_size",
            "max_anchors",
            "gamma",
            "mask_token_id",
            "init_drafter",
            // Also in [schedule]; kept here as the first format of the file had them.
            "lr",
            "warmup_ratio",
            "steps",
        ],
    ),
    ("schedule", &["lr", "warmup_ratio", "steps", "epochs"]),
    (
        "eval",
        &[
            "eval_data",
            "eval_prompts",
            "eval_every",
            "eval_gpu",
            "eval_max_new_tokens",
            "eval_timeout",
        ],
    ),
    (
        "checkpoints",
        &["checkpoint_every", "keep_checkpoints", "snapshot_every"],
    ),
    (
        "restarts",
        &[
            "hang_timeout",
            "step_timeout",
            "max_restarts",
            "stable_after",
            "stop_timeout",
            "max_rollbacks",
            "max_skipped_steps",
        ],
    ),
    (
        "pipeline",
        &[
            "token_slots",
            "hidden_slots",
            "prefetch",
            "collective",
            "collective_timeout",
        ],
    ),
    (
        "run",
        &["run_dir", "worker_bin", "time_limit", "resume_if_exists"],
    ),
    (
        "telemetry",
        &[
            "wandb_project",
            "wandb_name",
            "wandb_mode",
            "prometheus",
            "no_gpu_metrics",
            "gpu_sample_interval",
            "metrics_interval",
        ],
    ),
    ("logs", &["tee", "log_max_size", "log_backups"]),
    (
        "nodes",
        &["nodes", "leader", "node_timeout", "join_timeout"],
    ),
];

/// `(section, key, flag id)`: keys named otherwise than their flag, kept from the first
/// format of the file (`[drafter] layers` is `--draft-layers`).
const ALIASES: &[(&str, &str, &str)] = &[("drafter", "layers", "draft_layers")];

/// Run flags a file does not set: the file itself, and the choices of one command
/// (`--resume DIR`, `--allow-changed-data`), which a recipe would make for every run, and
/// the node's own rank in a job across nodes (each node's differs).
pub const COMMAND_LINE_ONLY: [&str; 4] = ["config", "resume", "allow_changed_data", "node_rank"];

/// A recipe file that cannot be used: where in it, and why (one line; the caller names
/// the file).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{0}")]
    Read(std::io::Error),
    #[error("{}{message}", at(*line))]
    Syntax {
        line: Option<usize>,
        message: String,
    },
    #[error(
        "line {line}: unknown section [{section}] (valid sections: {})",
        section_names()
    )]
    UnknownSection { line: usize, section: String },
    #[error(
        "line {line}: unknown key '{key}' in [{section}] (valid keys of [{section}]: {valid}){}",
        elsewhere(key)
    )]
    UnknownKey {
        line: usize,
        section: String,
        key: String,
        valid: String,
    },
    #[error("line {line}: '{key}' is outside a section (expected it under a [section] header{}; valid sections: {})", elsewhere(key), section_names())]
    OutsideSection { line: usize, key: String },
    #[error("line {line}: [{section}] is not a table of keys (expected a [{section}] header)")]
    NotATable { line: usize, section: String },
    #[error("line {line}: [{section}] {key} is {shown}: expected {expected}")]
    Value {
        line: usize,
        section: String,
        key: String,
        shown: String,
        expected: &'static str,
    },
    #[error("line {line}: [{section}] {key} sets --{flag}, which line {first} already sets")]
    Twice {
        line: usize,
        section: String,
        key: String,
        flag: String,
        first: usize,
    },
    /// The file's settings with the command line's, as clap reads them (a value its flag
    /// cannot take, flags that conflict or need another): clap's line, and the line of the
    /// file's setting it names.
    #[error("{}{message}", at(*line))]
    Flags {
        line: Option<usize>,
        message: String,
    },
}

fn at(line: Option<usize>) -> String {
    line.map(|l| format!("line {l}: ")).unwrap_or_default()
}

fn section_names() -> String {
    SECTIONS
        .iter()
        .map(|(s, _)| *s)
        .collect::<Vec<_>>()
        .join(", ")
}

/// "; epochs is a key of [schedule]" where a section has the key (the last such: `lr` is
/// a key of [schedule], and of [drafter] only as the file's first format had it).
fn elsewhere(key: &str) -> String {
    SECTIONS
        .iter()
        .rev()
        .find(|(_, keys)| keys.contains(&key))
        .map(|(s, _)| format!("; {key} is a key of [{s}]"))
        .unwrap_or_default()
}

/// One setting of the file: the flag it sets and its value as that flag takes it.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    pub section: String,
    pub key: String,
    /// The flag's id (its name with `_`).
    pub flag: &'static str,
    /// The value as typed after `--flag=` (arrays comma-joined); a switch's `true`/`false`.
    pub value: String,
    pub line: usize,
}

/// The flag a key of `section` sets, if it is one of its keys.
fn flag_of(section: &str, key: &str) -> Option<&'static str> {
    if let Some((_, _, flag)) = ALIASES.iter().find(|(s, k, _)| *s == section && *k == key) {
        return Some(flag);
    }
    let (_, keys) = SECTIONS.iter().find(|(s, _)| *s == section)?;
    keys.iter().find(|k| **k == key).copied()
}

/// A TOML value as a flag's text: strings as they are, numbers as written (integers in
/// decimal), arrays comma-joined (`taps = [1, 9, 17]` is `--taps=1,9,17`).
fn flag_text(v: &DeValue) -> Option<String> {
    match v {
        DeValue::String(s) => Some(s.to_string()),
        DeValue::Integer(i) => i128::from_str_radix(i.as_str(), i.radix())
            .ok()
            .map(|n| n.to_string()),
        DeValue::Float(f) => Some(f.as_str().to_string()),
        DeValue::Boolean(b) => Some(b.to_string()),
        DeValue::Array(a) => a
            .iter()
            .map(|x| match x.get_ref() {
                DeValue::Array(_) | DeValue::Table(_) => None,
                other => flag_text(other),
            })
            .collect::<Option<Vec<_>>>()
            .map(|v| v.join(",")),
        DeValue::Datetime(_) | DeValue::Table(_) => None,
    }
}

fn line_at(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// The settings of a recipe file's text, in the file's order: every section and key
/// known, every value a flag's text, no flag set twice.
pub fn settings(text: &str) -> Result<Vec<Setting>, ConfigError> {
    let table = DeTable::parse(text).map_err(|e| ConfigError::Syntax {
        line: e.span().map(|s| line_at(text, s.start)),
        message: e.message().trim().replace('\n', " "),
    })?;
    let mut entries = Vec::new();
    for (name, value) in table.get_ref() {
        let (section, line) = (name.get_ref().to_string(), line_at(text, name.span().start));
        let known = SECTIONS.iter().any(|(s, _)| *s == section);
        match value.get_ref() {
            DeValue::Table(keys) if known => {
                for (k, v) in keys {
                    entries.push((k.span().start, section.clone(), k.get_ref().to_string(), v));
                }
            }
            DeValue::Table(_) => return Err(ConfigError::UnknownSection { line, section }),
            _ if known => return Err(ConfigError::NotATable { line, section }),
            _ => return Err(ConfigError::OutsideSection { line, key: section }),
        }
    }
    entries.sort_by_key(|(offset, ..)| *offset);
    let mut out: Vec<Setting> = Vec::new();
    for (offset, section, key, value) in entries {
        let line = line_at(text, offset);
        let Some(flag) = flag_of(&section, &key) else {
            let valid = SECTIONS
                .iter()
                .find(|(s, _)| *s == section)
                .map(|(_, k)| k.join(", "));
            return Err(ConfigError::UnknownKey {
                line,
                section,
                key,
                valid: valid.unwrap_or_default(),
            });
        };
        let Some(text_value) = flag_text(value.get_ref()) else {
            return Err(ConfigError::Value {
                line,
                section,
                key,
                shown: "a table or a date".into(),
                expected: "a string, a number, true or false, or an array of them",
            });
        };
        if let Some(first) = out.iter().find(|s| s.flag == flag) {
            return Err(ConfigError::Twice {
                line,
                section,
                key,
                flag: flag.replace('_', "-"),
                first: first.line,
            });
        }
        out.push(Setting {
            section,
            key,
            flag,
            value: text_value,
            line,
        });
    }
    Ok(out)
}

/// Why the command line cannot be used: clap's own error (help and version included,
/// which `main` prints as clap does), or a `--config` file's (exit 2, one line).
#[derive(Debug)]
pub enum CommandLineError {
    Clap(clap::Error),
    Config(Error),
}

/// The command line as the program uses it, `--config` applied.
#[derive(Debug)]
pub struct CommandLine {
    pub cli: Cli,
    /// The ids of the run flags given: typed on the command line, or set by the file
    /// where the flag has a default (an optional flag with a value counts as given
    /// wherever it is compared, see `training::resume::merge`).
    pub given: Vec<String>,
}

/// Parse `argv` (program name first) and apply its `--config FILE`.
pub fn parse(argv: &[OsString]) -> Result<CommandLine, CommandLineError> {
    let matches = match Cli::command().try_get_matches_from(argv) {
        Ok(m) => m,
        // A flag that needs another (--resume-if-exists needs --run-dir) may have it from
        // the file: read the file, then parse the whole again.
        Err(e) => match lenient_with_config(argv, &e) {
            Some(m) => m,
            None => return Err(CommandLineError::Clap(e)),
        },
    };
    let mut given: Vec<String> = matches
        .ids()
        .filter(|id| matches.value_source(id.as_str()) == Some(ValueSource::CommandLine))
        .map(|id| id.as_str().to_string())
        .collect();
    let config = config_path(&matches);
    let Some(path) = config else {
        let cli = Cli::from_arg_matches(&matches).map_err(CommandLineError::Clap)?;
        return Ok(CommandLine { cli, given });
    };
    let bad = |e: ConfigError| {
        CommandLineError::Config(Error::input(format!("--config {}", path.display()), e))
    };
    let text = std::fs::read_to_string(&path).map_err(|e| bad(ConfigError::Read(e)))?;
    let file = settings(&text).map_err(bad)?;
    let cmd = Cli::command();
    let (flags, from_file) = file_flags(&cmd, &file, &given).map_err(bad)?;
    let (program, typed) = argv.split_first().unzip();
    let mut all = vec![program
        .cloned()
        .unwrap_or_else(|| "dflash-supervise".into())];
    all.extend(flags.into_iter().map(OsString::from));
    all.extend(typed.into_iter().flatten().cloned());
    let matches = cmd.try_get_matches_from(all).map_err(|e| match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => CommandLineError::Clap(e),
        _ => bad(ConfigError::Flags {
            line: line_of(&e, &file),
            message: crate::cli::error_line(&e),
        }),
    })?;
    let cli = Cli::from_arg_matches(&matches).map_err(CommandLineError::Clap)?;
    given.extend(from_file);
    Ok(CommandLine { cli, given })
}

/// The matches of a run's command line that misses a flag another one requires, when it
/// names a `--config` (which may give it); `None` otherwise.
fn lenient_with_config(argv: &[OsString], e: &clap::Error) -> Option<ArgMatches> {
    if e.kind() != ErrorKind::MissingRequiredArgument {
        return None;
    }
    let m = Cli::command()
        .ignore_errors(true)
        .try_get_matches_from(argv)
        .ok()?;
    config_path(&m).map(|_| m)
}

/// A run's `--config` (none with a subcommand).
fn config_path(m: &ArgMatches) -> Option<PathBuf> {
    if m.subcommand().is_some() {
        return None;
    }
    m.try_get_one::<PathBuf>("config").ok().flatten().cloned()
}

/// The file's settings as flags (`--lr=6e-4`, a switch `--tee`), leaving out those the
/// command line gives or contradicts (a flag that conflicts with a typed one), and the
/// ids of the flags with a default that the file sets.
fn file_flags(
    cmd: &Command,
    file: &[Setting],
    typed: &[String],
) -> Result<(Vec<String>, Vec<String>), ConfigError> {
    let (mut flags, mut set) = (Vec::new(), Vec::new());
    for s in file {
        let Some(arg) = cmd.get_arguments().find(|a| a.get_id() == s.flag) else {
            continue;
        };
        let contradicted = typed.iter().any(|t| {
            t == s.flag
                || cmd
                    .get_arg_conflicts_with(arg)
                    .iter()
                    .any(|c| c.get_id() == t)
                || cmd
                    .get_arguments()
                    .find(|a| a.get_id() == t.as_str())
                    .is_some_and(|a| {
                        cmd.get_arg_conflicts_with(a)
                            .iter()
                            .any(|c| c.get_id() == s.flag)
                    })
        });
        if contradicted {
            continue;
        }
        let long = s.flag.replace('_', "-");
        if matches!(arg.get_action(), ArgAction::SetTrue) {
            match s.value.as_str() {
                "true" => flags.push(format!("--{long}")),
                "false" => {}
                other => {
                    return Err(ConfigError::Value {
                        line: s.line,
                        section: s.section.clone(),
                        key: s.key.clone(),
                        shown: other.to_string(),
                        expected: "true or false",
                    })
                }
            }
        } else {
            flags.push(format!("--{long}={}", s.value));
        }
        if !arg.get_default_values().is_empty() {
            set.push(s.flag.to_string());
        }
    }
    Ok((flags, set))
}

/// The line of the file's setting that clap's error names (`--steps <N>`), if any.
fn line_of(e: &clap::Error, file: &[Setting]) -> Option<usize> {
    let named: Vec<&str> = match e.get(ContextKind::InvalidArg)? {
        ContextValue::String(s) => vec![s.as_str()],
        ContextValue::Strings(v) => v.iter().map(String::as_str).collect(),
        _ => return None,
    };
    named.iter().find_map(|n| {
        let long = n.trim_start_matches("--").split([' ', '=']).next()?;
        file.iter()
            .find(|s| s.flag.replace('_', "-") == long)
            .map(|s| s.line)
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn argv(args: &[&str]) -> Vec<OsString> {
        std::iter::once("dflash-supervise")
            .chain(args.iter().copied())
            .map(OsString::from)
            .collect()
    }

    /// The command line with a recipe file of `text`.
    fn with_file(text: &str, args: &[&str]) -> Result<CommandLine, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("recipe.toml");
        std::fs::write(&path, text).unwrap();
        let p = path.to_str().unwrap();
        let mut all = vec!["--config", p];
        all.extend_from_slice(args);
        parse(&argv(&all)).map_err(|e| match e {
            CommandLineError::Config(e) => {
                assert_eq!(e.exit_code(), 2, "{e}");
                e.to_string().replace(p, "recipe.toml")
            }
            CommandLineError::Clap(e) => format!("clap: {e}"),
        })
    }

    fn recipe(name: &str) -> crate::cli::RunArgs {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../recipes")
            .join(name);
        let p = path.to_str().unwrap();
        parse(&argv(&["--config", p]))
            .unwrap_or_else(|e| panic!("{name}: {e:?}"))
            .cli
            .run
    }

    #[test]
    fn the_shipped_recipes_parse_and_hold_the_published_settings() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../recipes");
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".toml"))
            .collect();
        names.sort();
        assert_eq!(names, ["llama-3.1-8b-instruct.toml", "qwen3-8b.toml"]);
        for n in &names {
            let s = settings(&std::fs::read_to_string(dir.join(n)).unwrap()).unwrap();
            assert!(s.len() >= 10, "{n}: {s:?}");
            crate::run::validate::check_flags(&recipe(n)).unwrap_or_else(|e| panic!("{n}: {e}"));
        }
        let q = recipe("qwen3-8b.toml");
        assert_eq!(
            (q.draft_layers, q.block_size, q.taps.as_deref()),
            (Some(5), Some(16), Some(&[1, 9, 17, 25, 33][..]))
        );
        assert_eq!(
            (q.max_anchors, q.gamma, q.mask_token_id),
            (Some(512), Some(7.0), Some(151669))
        );
        assert_eq!(
            (q.lr, q.warmup_ratio, q.epochs, q.max_seq_len),
            (Some(6e-4), Some(0.04), Some(6), 3072)
        );
        assert_eq!(
            q.steps, None,
            "the published recipe is 6 epochs, not a step count"
        );
        let l = recipe("llama-3.1-8b-instruct.toml");
        assert_eq!(l.taps.as_deref(), Some(&[1, 8, 15, 22, 29][..]));
        assert_eq!(
            (l.draft_layers, l.block_size, l.mask_token_id, l.epochs),
            (Some(5), Some(16), Some(128002), Some(6))
        );
    }

    #[test]
    fn the_command_line_wins_over_the_file_and_the_file_over_the_defaults() {
        let text = "[drafter]\nlayers = 1\nblock_size = 4\ntaps = [1, 3]\n\
                    [schedule]\nlr = 2e-3\nepochs = 2\n\
                    [data]\nmax_seq_len = 256\nseed = 9\n\
                    [restarts]\nhang_timeout = \"90s\"\n\
                    [devices]\ngpus = \"cpu:3\"\ntargets = 2\n\
                    [logs]\ntee = true\nlog_max_size = \"1MiB\"\n";
        let c = with_file(text, &["--seed", "4", "--lr", "1e-3"]).unwrap();
        let a = &c.cli.run;
        assert_eq!((a.draft_layers, a.block_size), (Some(1), Some(4)));
        assert_eq!(a.taps.as_deref(), Some(&[1, 3][..]));
        assert_eq!((a.lr, a.epochs), (Some(1e-3), Some(2)), "--lr typed wins");
        assert_eq!((a.max_seq_len, a.seed), (256, 4), "--seed typed wins");
        assert_eq!(a.hang_timeout, std::time::Duration::from_secs(90));
        assert_eq!(
            (a.targets, a.tee, a.log_max_size),
            (Some(crate::cli::Targets::Fixed(2)), true, 1 << 20)
        );
        assert_eq!(a.gpus, Some(dflash_shared::DeviceSpec::Cpu(3)));
        // Typed, and the file's flags that have a default: what a --resume compares.
        for id in ["seed", "lr", "max_seq_len", "hang_timeout", "config"] {
            assert!(c.given.iter().any(|g| g == id), "{id} in {:?}", c.given);
        }
        assert!(!c.given.iter().any(|g| g == "epochs"), "{:?}", c.given);
        // A typed flag that conflicts with the file's leaves the file's out.
        let c = with_file(text, &["--target-gpus", "cpu:1", "--drafter-gpus", "cpu:1"]).unwrap();
        assert!(c.cli.run.gpus.is_none() && c.cli.run.target_gpus.is_some());
        assert_eq!(
            c.cli.run.targets, None,
            "--targets conflicts with --target-gpus"
        );
        // A flag that needs another may have it from the file.
        let c = with_file("[run]\nrun_dir = \"runs/x\"\n", &["--resume-if-exists"]).unwrap();
        assert_eq!(c.cli.run.run_dir, Some(PathBuf::from("runs/x")));
        assert!(c.cli.run.resume_if_exists);
    }

    #[test]
    fn the_first_format_of_the_file_still_works() {
        let text = "[drafter]\nlayers = 2\nblock_size = 8\nmax_anchors = 16\nlr = 1e-3\n\
                    warmup_ratio = 0.1\nsteps = 5\ngamma = 3.0\nmask_token_id = 7\n";
        let a = with_file(text, &[]).unwrap().cli.run;
        assert_eq!(
            (
                a.draft_layers,
                a.block_size,
                a.max_anchors,
                a.steps,
                a.mask_token_id
            ),
            (Some(2), Some(8), Some(16), Some(5), Some(7))
        );
        assert_eq!(
            (a.lr, a.warmup_ratio, a.gamma),
            (Some(1e-3), Some(0.1), Some(3.0))
        );
    }

    #[test]
    fn an_unknown_key_or_section_is_refused_naming_the_line_and_the_valid_keys() {
        let e = with_file("[schedule]\nlr = 1e-3\nepoch = 3\n", &[]).unwrap_err();
        assert_eq!(
            e,
            "--config recipe.toml: line 3: unknown key 'epoch' in [schedule] \
             (valid keys of [schedule]: lr, warmup_ratio, steps, epochs)"
        );
        let e = with_file("[data]\nepochs = 3\n", &[]).unwrap_err();
        assert!(e.ends_with("; epochs is a key of [schedule]"), "{e}");
        let e = with_file("[model]\ntarget = \"tiny\"\n\n[optimizer]\nlr = 1\n", &[]).unwrap_err();
        assert!(
            e.starts_with("--config recipe.toml: line 4: unknown section [optimizer] (valid sections: model, data, devices,"),
            "{e}"
        );
        let e = with_file("lr = 1e-3\n", &[]).unwrap_err();
        assert!(
            e.contains("line 1: 'lr' is outside a section")
                && e.contains("lr is a key of [schedule]"),
            "{e}"
        );
        let e = with_file("[drafter]\nresume = \"runs/a\"\n", &[]).unwrap_err();
        assert!(e.contains("unknown key 'resume'"), "{e}");
    }

    #[test]
    fn a_bad_value_names_its_line_and_the_flag() {
        let e = with_file("[schedule]\nlr = 1e-3\n\nsteps = \"many\"\n", &[]).unwrap_err();
        assert!(
            e.starts_with("--config recipe.toml: line 4: invalid value 'many' for '--steps <N>'"),
            "{e}"
        );
        let e = with_file("[logs]\ntee = 1\n", &[]).unwrap_err();
        assert_eq!(
            e,
            "--config recipe.toml: line 2: [logs] tee is 1: expected true or false"
        );
        let e = with_file("[drafter]\ntaps = { a = 1 }\n", &[]).unwrap_err();
        assert!(
            e.starts_with("--config recipe.toml: line 2: [drafter] taps is a table"),
            "{e}"
        );
        let e = with_file("[drafter]\nlayers = 2\ndraft_layers = 3\n", &[]).unwrap_err();
        assert_eq!(
            e,
            "--config recipe.toml: line 3: [drafter] draft_layers sets --draft-layers, which line 2 already sets"
        );
        let e = with_file("[schedule]\nlr = \n", &[]).unwrap_err();
        assert!(e.starts_with("--config recipe.toml: line 2: "), "{e}");
        let e = with_file(
            "[devices]\ngpus = \"cpu:2\"\ntarget_gpus = \"cpu:1\"\n",
            &[],
        )
        .unwrap_err();
        assert!(e.contains("cannot be used with"), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
    }

    #[test]
    fn every_run_flag_but_the_command_lines_own_has_a_key() {
        let keys: Vec<&str> = SECTIONS
            .iter()
            .flat_map(|(_, k)| k.iter().copied())
            .collect();
        let cmd = Cli::command();
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if ["help", "version"].contains(&id) || COMMAND_LINE_ONLY.contains(&id) {
                continue;
            }
            assert!(keys.contains(&id), "--{id} has no key in a recipe file");
        }
        for (section, ks) in SECTIONS {
            for k in *ks {
                let flag = flag_of(section, k).unwrap();
                assert!(
                    cmd.get_arguments().any(|a| a.get_id() == flag),
                    "[{section}] {k}: no flag --{flag}"
                );
            }
        }
    }
}
