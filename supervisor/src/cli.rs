//! Command line: the run itself (no subcommand), `logs`, `status`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use dflash_shared::{DeviceSpec, DeviceSpecError};

/// Train DFlash speculative-decoding drafters on one machine.
///
/// A CPU-only supervisor spawns one worker process per GPU (targets capture hidden
/// states, drafters train), restarts any worker that crashes or hangs, and keeps a log
/// per worker. With no subcommand it starts a run:
///
///   dflash-supervise --gpus cpu:3 --targets 1 --run-dir runs/a
///   dflash-supervise --gpus 0-7
///   dflash-supervise logs --run-dir runs/a drafter-1 -n 50
///   dflash-supervise logs --all -f
///   dflash-supervise status --json
#[derive(Debug, Parser)]
#[command(
    name = "dflash-supervise",
    version,
    args_conflicts_with_subcommands = true,
    verbatim_doc_comment
)]
#[command(after_help = dflash_shared::exit_codes::help())]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the log of one worker (or of all of them), optionally following it live.
    Logs(LogsArgs),
    /// Show the workers of a run: pid, state, restarts.
    Status(StatusArgs),
    /// Write a run's report: one self-contained XHTML page with inline SVG (summary; loss,
    /// acceptance and per-slot accuracy per step with the learning rate; tokens/s; per-GPU
    /// utilisation, memory, power, temperature and SM clock with throttle reasons and XIDs;
    /// pool fill and the bottleneck hint; phase timings; batch composition; worker
    /// lifelines) that opens anywhere without network. Works on finished, crashed and live
    /// runs; names the series it cannot draw and why. Prints its path.
    Report {
        /// Run directory. Default: the newest run under ./runs.
        run_dir: Option<PathBuf>,
        /// Where to write it. Default: RUN_DIR/report.html.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
        /// Keep the page current: rewrite it at every new metrics window (and worker
        /// event) of a live run, until the run ends or Ctrl-C. On a run that has ended it
        /// writes once.
        #[arg(long)]
        watch: bool,
    },
    /// Audit a run's batch ledger: produced, consumed once, in flight, lost, duplicated.
    /// Exits 1 if any batch was lost or reached an optimizer twice.
    Ledger(LedgerArgs),
    /// Before a job across nodes: every node joins the leader over the authenticated
    /// control link (the secret is in the run directory, which every node must share) and
    /// the leader lists the nodes (host, version, GPUs). Run it as the job will run: `srun
    /// --ntasks-per-node=1 dflash-supervise cluster-check --run-dir D`, or on each node
    /// with --nodes N --node-rank R --leader HOST:PORT. Exits 0 when every node joined
    /// with the leader's version, 1 when one did not, 75 on a follower whose leader is
    /// lost, 2 on a bad flag, address or secret (docs/slurm.md).
    ClusterCheck(ClusterCheckArgs),
    /// How to split the devices between target and drafter workers, before a run: with
    /// the run's own flags, each role's device memory per worker (weights, activations at
    /// the token budget, the drafter's training state, a CUDA allowance) against each
    /// device, every `--targets N` with whether it fits and the tokens/s it would train
    /// (the roofline at the GPU's bf16 peak, or what an earlier run measured: --from), and
    /// the fastest that fits with its command line. Starts no worker; touches no GPU beyond
    /// NVML. Exits 2 when no split fits, saying why.
    Plan(Box<PlanArgs>),
    /// List the GPUs NVML sees (index, name, UUID, memory, driver), or say that there is
    /// no NVIDIA driver.
    Gpus {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Tokenize training data as a run would (chat conversations rendered with the target's
    /// chat template), write it as pre-tokenized JSONL and print the data preflight report.
    /// Exits 2 when no sample would be supervised.
    Prepare(PrepareArgs),
    /// Write the drafter of a checkpoint as the Hugging Face directory a run's end writes
    /// (config.json, model.safetensors, model code, parity probe): a run directory's newest
    /// checkpoint that verifies (into RUN_DIR/drafter), or one checkpoints/step-N. Exits 1
    /// when it cannot be written, 2 when there is no checkpoint that verifies.
    Export(ExportArgs),
    /// Check an exported drafter (RUN_DIR/drafter) the way users load it: transformers'
    /// AutoModel with trust_remote_code, on the CPU in float32, run on the probe batch
    /// stored at export and compared with the Rust drafter's output. Exits 1 over the
    /// tolerance or with missing/unexpected tensors, 2 when DIR is not an export or
    /// Python, torch or transformers is missing.
    ExportCheck(crate::commands::export_check::ExportCheckArgs),
    /// Real acceptance length τ: greedy DFlash speculative decoding of each prompt with an
    /// exported drafter, verified by the target over its KV cache, against plain greedy
    /// decoding of the target in the same run (CPU). Prints τ as mean of per-prompt means
    /// and pooled (tokens ÷ verify steps) with 95% bootstrap intervals over prompts, the
    /// histogram of tokens per verify step, decode tokens/s and the speedup. Exits 1 when
    /// speculative decoding wrote other tokens than greedy decoding on a prompt, 2 on an
    /// input that cannot be used (a missing directory, a drafter trained for another
    /// target, no prompts), 4 when the worker could not run.
    Eval(crate::commands::eval::EvalArgs),
    /// Write the assistant turns of a data set again with the target alone (DFlash's
    /// recipe trains on the target's own responses): chat lines rendered with its chat
    /// template, token-id prompts continued, greedy or sampled, over every GPU or CPU
    /// workers. Resumable: a stopped regeneration is continued by the same command, each
    /// line written once. Exits 0 when written, 1 when a worker kept failing, 2 on an
    /// input that cannot be used, 75 when stopped by a signal.
    Regenerate(crate::commands::regenerate::RegenerateArgs),
    /// Benchmarks that print figures and ratios against baselines measured in the same run.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Internal: one side of `bench ipc`.
    #[command(name = "__bench-peer", hide = true)]
    BenchPeer { server: String },
    /// Internal: one follower node of `bench cluster`.
    #[command(name = "__cluster-peer", hide = true)]
    ClusterPeer {
        #[arg(long)]
        leader: String,
        #[arg(long)]
        node_rank: u32,
        #[arg(long)]
        ranks: u32,
        #[arg(long)]
        run_dir: PathBuf,
    },
    /// Internal: the process that kills every worker group if the supervisor dies.
    #[command(name = "__reap", hide = true)]
    Reap,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// A run directory (its newest checkpoint that verifies) or one checkpoint directory
    /// (RUN_DIR/checkpoints/step-N).
    #[arg(value_name = "RUN_OR_CHECKPOINT")]
    pub source: PathBuf,
    /// Where the drafter goes (default: the run's drafter/ directory).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// The run's target model directory, when it is no longer where run.json says.
    #[arg(long, value_name = "DIR")]
    pub target: Option<PathBuf>,
    /// The worker program (default: dflash-worker beside dflash-supervise).
    #[arg(long, value_name = "PATH")]
    pub worker_bin: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct PrepareArgs {
    /// The target model directory whose tokenizer and chat template are used.
    #[arg(long, value_name = "DIR")]
    pub target: PathBuf,
    /// Input: a JSONL file, a directory of .jsonl files, or - for stdin.
    #[arg(long, value_name = "SOURCE")]
    pub data: String,
    /// Output JSONL file ({"input_ids", "loss_mask"} per kept sample, in input order);
    /// written to a temporary file and renamed, so it is never half-written.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Tokenizer and chat template from this directory instead of --target.
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// As the run's --max-seq-len: the preflight counts truncations, and keeps only
    /// samples a run would keep.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    pub max_seq_len: u32,
    /// As the run's --token-budget, for the steps-per-epoch estimate.
    #[arg(long, value_name = "N", default_value_t = 4096)]
    pub token_budget: u32,
    /// Drafter workers of the planned run, for the steps-per-epoch estimate.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub drafters: u32,
    /// Also write the preflight report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
}

pub use crate::run::engine::TargetEngine;

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// An earlier run's directory: the tokens/s per target and per drafter worker it
    /// measured (metrics.jsonl) replace the roofline estimate, each corrected for the time
    /// its workers waited on the other role.
    #[arg(long, value_name = "RUN_DIR", help_heading = "Plan")]
    pub from: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long, help_heading = "Plan")]
    pub json: bool,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Devices to use: 0-7, 0,2,5-7, all (every GPU NVML reports) or cpu:N (N workers
    /// without a GPU). Default: every GPU, or cpu:2 when there is no NVIDIA driver.
    #[arg(long, value_name = "SPEC", value_parser = parse_spec, help_heading = "Devices")]
    pub gpus: Option<DeviceSpec>,

    /// How many of the devices run target workers (the first N); the rest train drafters.
    /// auto: start where `plan` would (the roles' FLOPs per token), or auto:N from N, and
    /// while the run trains move one device at a time between the roles, toward the split
    /// that trains the most tokens/s as measured (docs/cli-guide.md; each move is an event
    /// in events.jsonl and a line in the log). Default: auto on 3 or more devices (with
    /// one GPU per target), else 1.
    #[arg(long, value_name = "N|auto[:N]", value_parser = parse_targets,
          help_heading = "Devices", conflicts_with_all = ["target_gpus", "drafter_gpus"])]
    pub targets: Option<Targets>,

    /// GPUs each target worker holds, for a target too large for one GPU: its loaded
    /// layers are split into contiguous ranges, one per GPU, and the activations hop
    /// between them. `--gpus 0-7 --targets 1 --gpus-per-target 4`: the target on GPUs 0-3,
    /// drafters on 4-7. Either engine (the torch engine needs python3 with accelerate).
    #[arg(long, value_name = "N", default_value_t = 1, help_heading = "Devices")]
    pub gpus_per_target: u32,

    /// Devices of the target workers, instead of --gpus/--targets. A GPU may appear in both
    /// lists: then two processes share it.
    #[arg(long, value_name = "SPEC", value_parser = parse_spec, help_heading = "Devices",
          requires = "drafter_gpus", conflicts_with = "gpus")]
    pub target_gpus: Option<DeviceSpec>,

    /// Devices of the drafter workers, instead of --gpus/--targets.
    #[arg(long, value_name = "SPEC", value_parser = parse_spec, help_heading = "Devices",
          requires = "target_gpus", conflicts_with = "gpus")]
    pub drafter_gpus: Option<DeviceSpec>,

    /// Run directory for logs, events and state. Default: runs/<UTC timestamp>.
    #[allow(rustdoc::invalid_html_tags)] // --help text, not HTML
    #[arg(long, value_name = "DIR", help_heading = "Run")]
    pub run_dir: Option<PathBuf>,

    /// Worker program. Default: dflash-worker installed beside dflash-supervise.
    #[arg(long, value_name = "PATH", help_heading = "Run")]
    pub worker_bin: Option<PathBuf>,

    /// What the run computes and how it is operated: saved in run.json and restored by
    /// `--resume` (the other fields are this command's own).
    #[command(flatten)]
    pub settings: RunSettings,

    /// A recipe file (TOML) that sets run flags: sections [model], [data], [devices],
    /// [drafter], [schedule], [eval], [checkpoints], [restarts], [pipeline], [run],
    /// [telemetry] and [logs], each key a flag's name with _ for - (`[schedule] lr =
    /// 6e-4`). Flags given here override it; it overrides the defaults. recipes/ holds
    /// published recipes (Qwen3-8B, Llama-3.1-8B-Instruct).
    #[allow(rustdoc::broken_intra_doc_links)] // [model] etc. are TOML sections (--help text)
    #[arg(long, value_name = "FILE", help_heading = "Run")]
    pub config: Option<PathBuf>,

    /// Warm start: the drafter's initial weights come from DIR, a drafter directory in the
    /// export layout (config.json, bf16 model.safetensors; RUN_DIR/drafter of an earlier
    /// run, or a published z-lab DFlash drafter), with a fresh optimizer and schedule (step
    /// 0). Its config must fit the target and the flags (hidden and vocabulary size, layers,
    /// taps, block size, mask token id; every mismatch is named, exit 2); --taps,
    /// --draft-layers, --block-size and --mask-token-id not given are taken from it. Its
    /// path and checksum are recorded in run.json; a resumed run continues its own weights.
    #[arg(
        long,
        value_name = "DIR",
        help_heading = "Training",
        conflicts_with = "resume"
    )]
    pub init_drafter: Option<PathBuf>,

    /// Continue the run in RUN_DIR from its newest checkpoint that verifies and is of its
    /// drafter, with its saved model, data, training and operational settings (--tokenizer,
    /// checkpoints, --time-limit, restarts, timeouts, pools; devices, --worker-bin and the
    /// console, log and Prometheus flags come from this command). --steps, --lr,
    /// --warmup-ratio, --max-bad-lines, --tokenizer and the operational flags given here win
    /// over the saved ones; another saved setting given with a different value is refused,
    /// and so is data, a tokenizer/chat template or a target whose files changed since the
    /// run started (see --allow-changed-data).
    #[arg(
        long,
        value_name = "RUN_DIR",
        help_heading = "Training",
        conflicts_with = "run_dir"
    )]
    pub resume: Option<PathBuf>,

    /// With --run-dir D: resume D when it holds a run, else start a new run there; one
    /// command for a job that may be requeued (Slurm). A finished run exits 0 at once;
    /// one stopped before its end (exit 75) continues from its newest checkpoint.
    #[arg(
        long,
        help_heading = "Training",
        requires = "run_dir",
        conflicts_with = "resume"
    )]
    pub resume_if_exists: bool,

    /// How many nodes (one supervisor each) the job has. Default: srun's task count
    /// under Slurm (srun --ntasks-per-node=1), else 1: this machine alone. A job across
    /// nodes needs GPU drafters (NCCL) and --run-dir on a filesystem every node shares.
    #[arg(long, value_name = "N", help_heading = "Nodes")]
    pub nodes: Option<u32>,

    /// This node's rank, 0 (the leader) to N-1. Default: SLURM_PROCID.
    #[arg(long, value_name = "R", requires = "nodes", help_heading = "Nodes")]
    pub node_rank: Option<u32>,

    /// The leader's address, where it listens (never every interface). Default under
    /// Slurm: the first host of the step's node list, on port 20000 + job id % 20000.
    #[arg(long, value_name = "HOST:PORT", help_heading = "Nodes")]
    pub leader: Option<String>,

    /// Silence on the link between a node and the leader after which the other side
    /// counts as lost: the leader goes on without the node; a follower stops (exit 75).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration, help_heading = "Nodes")]
    pub node_timeout: std::time::Duration,

    /// How long the leader waits at the start for every node to join, and a follower
    /// for the leader.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_duration, help_heading = "Nodes")]
    pub join_timeout: std::time::Duration,

    /// With --resume: continue even though the data, the tokenizer or chat template, or the
    /// target's files changed since the run started (a warning names each change, and the
    /// inputs as they are now are recorded for later resumes).
    #[arg(long, help_heading = "Training", requires = "resume")]
    pub allow_changed_data: bool,

    /// Serve the latest metrics window for Prometheus at http://ADDR/metrics. A bare port
    /// (21400) listens on loopback only; give 0.0.0.0:21400 to listen on every interface.
    #[arg(long, value_name = "ADDR", value_parser = crate::telemetry::prometheus::parse_addr, help_heading = "Telemetry")]
    pub prometheus: Option<std::net::SocketAddr>,

    /// Do not sample GPUs through NVML.
    #[arg(long, help_heading = "Telemetry")]
    pub no_gpu_metrics: bool,

    /// Also print every worker's output on the console, prefixed with [worker-name].
    #[arg(long, help_heading = "Logs")]
    pub tee: bool,
}

/// The settings of a run (see [`RunArgs::settings`]): one field per flag, serialised as
/// run.json's settings by their field names. A new flag goes here when a resumed run
/// keeps it, in [`RunArgs`] when each command gives its own.
#[derive(Debug, Clone, Args, serde::Serialize, serde::Deserialize)]
pub struct RunSettings {
    /// Stop the run gracefully after this long (e.g. 30s, 2h). Default: run until stopped.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, help_heading = "Run")]
    #[serde(with = "saved_duration::option")]
    pub time_limit: Option<Duration>,

    /// A worker that sends no heartbeat for this long is killed and restarted. Heartbeats
    /// come from a thread that never waits for compute: this catches a wedged process,
    /// not a slow step (see --step-timeout).
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration,
          help_heading = "Restarts")]
    #[serde(with = "saved_duration")]
    pub hang_timeout: Duration,

    /// A worker whose unit of work (a drafter's training step, a target's batch, a
    /// checkpoint write) has taken longer than this is declared hung, killed and
    /// restarted. Default: the larger of 10m and 5 × the slowest of that worker's first 3
    /// measured steps (10m until one is measured).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration,
          help_heading = "Restarts")]
    #[serde(with = "saved_duration::option")]
    pub step_timeout: Option<Duration>,

    /// How many times one worker may be restarted in this run before the run gives up.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 10,
        help_heading = "Restarts"
    )]
    pub max_restarts: u32,

    /// A worker that stays up this long is healthy again: its restart backoff resets to
    /// "restart at once".
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_duration,
          help_heading = "Restarts")]
    #[serde(with = "saved_duration")]
    pub stable_after: Duration,

    /// On SIGINT/SIGTERM, how long workers get to finish (and checkpoint) before they are
    /// killed. A second Ctrl-C kills at once. The default fits within Slurm's default
    /// KillWait (30 s, the time between its SIGTERM and its SIGKILL).
    #[arg(long, value_name = "DURATION", default_value = "25s", value_parser = parse_duration,
          help_heading = "Restarts")]
    #[serde(with = "saved_duration")]
    pub stop_timeout: Duration,

    /// The frozen target model: a Hugging Face directory (config.json + model.safetensors
    /// or shards; Qwen3, Qwen3-MoE and Llama natively, any other transformers causal LM on
    /// the torch engine), or tiny (a small built-in model with random weights,
    /// written to RUN_DIR/target).
    #[arg(
        long,
        value_name = "DIR",
        default_value = "tiny",
        help_heading = "Model"
    )]
    pub target: String,

    /// What runs the target: native (this tool's own forward: Qwen3, Qwen3-MoE, Llama),
    /// torch (a Python child per target worker running transformers' implementation, which
    /// needs python3 with torch and transformers), or auto (native where it serves the
    /// target, else torch).
    #[arg(
        long,
        value_name = "ENGINE",
        value_enum,
        default_value = "auto",
        help_heading = "Model"
    )]
    pub target_engine: TargetEngine,

    /// Target layers to tap, distinct, e.g. 1,9,17,25,33 (default: DFlash's spread of
    /// --draft-layers taps over the target's depth). Not the target's last layer: serving
    /// engines pass its output after the final norm, training takes it before.
    #[arg(
        long,
        value_name = "IDS",
        value_delimiter = ',',
        help_heading = "Model"
    )]
    pub taps: Option<Vec<u32>>,

    /// Drafter depth, which is also the number of default taps (default: 5, or 2 for
    /// targets under 12 layers); a target too shallow for that many distinct taps gets
    /// fewer, said in one line.
    #[arg(long, value_name = "N", help_heading = "Model")]
    pub draft_layers: Option<usize>,

    /// Loss decay γ (slot k weighs exp(-(k-1)/γ); default 7 for blocks of 16, 5 for 10,
    /// 4 for 8).
    #[arg(
        long,
        value_name = "G",
        allow_hyphen_values = true,
        help_heading = "Training"
    )]
    pub gamma: Option<f64>,

    /// The token id of the MASK inputs. Default: an id no text uses, by the target's
    /// tokenizer (--tokenizer's, else the target's tokenizer.json): the first embedding row
    /// past its tokens (Qwen3: 151669), else its first reserved special token (Llama 3:
    /// 128002), else the last id. The export records the rule as dflash_training.mask_token.
    #[arg(long, value_name = "ID", help_heading = "Training")]
    pub mask_token_id: Option<u32>,

    /// Stop after this many optimizer steps (default: when the data runs out).
    #[arg(long, value_name = "N", help_heading = "Training")]
    pub steps: Option<u64>,

    /// Peak learning rate (AdamW; linear warmup, then cosine to 0 over --steps).
    /// Default 6e-4 (the public recipe), 3e-3 for the tiny target.
    #[arg(
        long,
        value_name = "LR",
        allow_hyphen_values = true,
        help_heading = "Training"
    )]
    pub lr: Option<f64>,

    /// Share of --steps spent warming the learning rate up (default 0.04).
    #[arg(
        long,
        value_name = "FRACTION",
        allow_hyphen_values = true,
        help_heading = "Training"
    )]
    pub warmup_ratio: Option<f64>,

    /// Tokens per draft block (default 16; 8 for the tiny target).
    #[arg(long, value_name = "N", help_heading = "Training")]
    pub block_size: Option<usize>,

    /// Anchors (blocks) drawn per sample each step (default 512 on GPUs; 32 for the tiny
    /// target and for drafters on CPU workers).
    #[arg(long, value_name = "N", help_heading = "Training")]
    pub max_anchors: Option<usize>,

    /// Write a checkpoint (weights, optimizer state, what was consumed) every N steps;
    /// one is always written when the run stops. 0: only at the stop.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 100,
        help_heading = "Training"
    )]
    pub checkpoint_every: u64,

    /// Checkpoints kept (the newest; checkpoints/best, the best by eval acceptance or by
    /// τ with --eval-prompts, is kept besides, and so is the one whose τ is measured).
    #[arg(long, value_name = "K", default_value_t = 3, help_heading = "Training")]
    pub keep_checkpoints: usize,

    /// Held-out lines (a JSONL file in the formats --data takes: token lines, or chat /
    /// ShareGPT lines rendered with the same tokenizer and template), evaluated whole every
    /// --eval-every steps and at the last step: eval loss and acceptance length in
    /// train.jsonl, the console, Prometheus and the report; checkpoints/best points at the
    /// checkpoint with the best eval acceptance. Steps wait while an eval runs.
    #[arg(long, value_name = "FILE", help_heading = "Training")]
    pub eval_data: Option<PathBuf>,

    /// Evaluate --eval-data and --eval-prompts every N steps (each such step is also
    /// checkpointed). Default: --checkpoint-every (or only at the last step when that is 0).
    #[arg(long, value_name = "N", help_heading = "Training")]
    pub eval_every: Option<u64>,

    /// Prompts (one per line, as `eval --prompts` takes them: token ids, or chat lines
    /// rendered with the target's template) on which the real acceptance length τ is
    /// measured by greedy speculative decoding every --eval-every steps and at the last
    /// step, on that step's checkpoint, in a CPU child process beside training (training
    /// never waits for it; an eval that fails or hangs is logged and dropped). τ goes to
    /// train.jsonl, metrics.jsonl, Prometheus and the report, and checkpoints/best names
    /// the checkpoint with the best pooled τ. Cost: an eval step is passed over while the
    /// evals so far took more than 10% of the run's time (the last step never is).
    #[arg(long, value_name = "FILE", help_heading = "Training")]
    pub eval_prompts: Option<PathBuf>,

    /// Decode the --eval-prompts measurements on this GPU (one of the run's, NVML
    /// numbering) in bf16 instead of on the CPU. It shares the GPU with the workers placed
    /// there: the target's bf16 weights and a KV cache must fit beside them. Without it
    /// the measurement holds an f32 copy of the target in host memory, which suits small
    /// targets only (4 bytes per parameter; about 1 token/s per 8B parameters).
    #[arg(long, value_name = "N", help_heading = "Training")]
    pub eval_gpu: Option<u32>,

    /// New tokens per prompt at most in the --eval-prompts evals.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..), help_heading = "Training")]
    pub eval_max_new_tokens: u64,

    /// An --eval-prompts eval (export and decoding) still running after this long is
    /// killed and logged; training goes on.
    #[arg(long, value_name = "DURATION", default_value = "30min", value_parser = parse_duration, help_heading = "Training")]
    #[serde(with = "saved_duration")]
    pub eval_timeout: std::time::Duration,

    /// Snapshot the training state into supervisor-owned shared memory every N steps (what
    /// the group rolls back to if every drafter dies). Default: as often as keeps the
    /// snapshot under 2% of the step time, measured as the run goes.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..), help_heading = "Training")]
    pub snapshot_every: Option<u64>,

    /// How many times the run rolls back after every drafter died before it gives up
    /// (exit 1 with the drafters' last log lines).
    #[arg(long, value_name = "N", default_value_t = 5, help_heading = "Training")]
    pub max_rollbacks: u32,

    /// How the drafter ranks exchange gradients: nccl (all-reduce on the GPUs; needs
    /// libnccl.so.2, e.g. pip install nvidia-nccl-cu13, or DFLASH_NCCL_LIB), shm (through
    /// the supervisor's shared memory, summed on the host), or auto (nothing to exchange
    /// with one drafter; nccl when two or more drafters are on GPUs; else shm).
    #[arg(long, value_name = "KIND", default_value = "auto", value_parser = ["auto", "shm", "nccl"], help_heading = "Training")]
    pub collective: String,

    /// An all-reduce that every drafter rank has entered and that has not completed after
    /// this long is declared hung: the group aborts it and forms again (three times in a
    /// row for one step stop the run).
    #[arg(long, value_name = "DURATION", default_value = "5min", value_parser = parse_duration, help_heading = "Training")]
    #[serde(with = "saved_duration")]
    pub collective_timeout: std::time::Duration,

    /// This many steps in a row skipped for a non-finite loss or gradient stop the run
    /// (exit 1, naming the likely cause and the newest checkpoint from before them).
    #[arg(long, value_name = "N", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..), help_heading = "Training")]
    pub max_skipped_steps: u64,

    /// Training data: a JSONL file, a directory of .jsonl files, - for stdin, or demo
    /// (built-in synthetic data). Each line is pre-tokenized {"input_ids": [...],
    /// "loss_mask": [...]} (loss_mask optional: all ones), a chat {"messages": [{"role",
    /// "content"}]} or ShareGPT {"conversations": [{"from", "value"}]}; chat lines are
    /// rendered with the target's chat template and only the assistant replies are trained.
    #[arg(
        long,
        value_name = "SOURCE",
        default_value = "demo",
        help_heading = "Data"
    )]
    pub data: String,

    /// Tokenizer and chat template for chat data: a directory with tokenizer.json and
    /// tokenizer_config.json (or chat_template.jinja). Default: the --target directory.
    #[arg(long, value_name = "DIR", help_heading = "Data")]
    pub tokenizer: Option<PathBuf>,

    /// Lines of --data read by the preflight report at start (0: all of them).
    #[arg(long, value_name = "N", default_value_t = 2000, help_heading = "Data")]
    pub preflight_lines: u64,

    /// Tokens per batch, padding included (rows × longest row). Default 4096 on GPUs; 2048
    /// for the tiny target; 1024 for a real target whose drafters train on CPU workers.
    #[arg(long, value_name = "N", help_heading = "Data")]
    pub token_budget: Option<u32>,

    /// Longer samples are truncated to this many tokens. Default 1024, or the target's
    /// max_position_embeddings when that is smaller (said at start).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_SEQ_LEN, help_heading = "Data")]
    pub max_seq_len: u32,

    /// Seed of the shuffle (and of the demo data).
    #[arg(long, value_name = "N", default_value_t = 0, help_heading = "Data")]
    pub seed: u64,

    /// Passes over the data; the run ends when the last batch is consumed. Default: 1, or
    /// as many as --steps needs (the data is cycled, said at start); with both given,
    /// --steps beyond what the epochs give is refused.
    #[arg(long, value_name = "N", help_heading = "Data")]
    pub epochs: Option<u32>,

    /// More bad dataset lines than this stops the run (exit 2); each distinct line
    /// counts once, however many epochs read it.
    #[arg(long, value_name = "N", default_value_t = 10, help_heading = "Data")]
    pub max_bad_lines: u64,

    /// Samples shuffled and length-bucketed together (memory: one window of samples).
    #[arg(long, value_name = "N", default_value_t = 4096, help_heading = "Data")]
    pub shuffle_window: usize,

    /// Samples per epoch of --data demo.
    #[arg(long, value_name = "N", default_value_t = 1024, help_heading = "Data")]
    pub demo_samples: usize,

    /// Token-batch slots in shared memory. Default: 2 per target + 4.
    #[arg(long, value_name = "N", help_heading = "Pipeline")]
    pub token_slots: Option<u32>,

    /// Hidden-state slots in shared memory. Default: 2 per worker + 2.
    #[arg(long, value_name = "N", help_heading = "Pipeline")]
    pub hidden_slots: Option<u32>,

    /// Batches each worker holds ahead (credits), so it never waits a round trip.
    #[arg(long, value_name = "N", default_value_t = 2, help_heading = "Pipeline")]
    pub prefetch: usize,

    /// Log the run to this W&B project: the supervisor runs the W&B bridge (python3 with
    /// the wandb package) beside the run, starts it again if it dies, and keeps the W&B
    /// run's id in RUN_DIR/wandb.json so that --resume continues the same W&B run.
    #[arg(long, value_name = "PROJECT", help_heading = "Telemetry")]
    pub wandb_project: Option<String>,

    /// The W&B run's name (default: the run dir's name).
    #[arg(
        long,
        value_name = "NAME",
        requires = "wandb_project",
        help_heading = "Telemetry"
    )]
    pub wandb_name: Option<String>,

    /// W&B's mode: online, offline (written under ./wandb or WANDB_DIR for a later `wandb
    /// sync`) or disabled (default: W&B's own, from WANDB_MODE or its settings).
    #[arg(long, value_name = "MODE", value_parser = ["online", "offline", "disabled"], requires = "wandb_project", help_heading = "Telemetry")]
    pub wandb_mode: Option<String>,

    /// How often every GPU in use is read.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_duration, help_heading = "Telemetry")]
    #[serde(with = "saved_duration")]
    pub gpu_sample_interval: Duration,

    /// Length of a metrics window: one line of metrics.jsonl per window (mean and max of
    /// the GPU samples in it, and the pipeline's and training's figures).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration, help_heading = "Telemetry")]
    #[serde(with = "saved_duration")]
    pub metrics_interval: Duration,

    /// Rotate a worker's log when it reaches this size (e.g. 64MiB, 500K).
    #[arg(long, value_name = "SIZE", default_value = "64MiB", value_parser = parse_size,
          help_heading = "Logs")]
    pub log_max_size: u64,

    /// Rotated logs kept per worker (worker.log.1 is the newest).
    #[arg(long, value_name = "N", default_value_t = 3, help_heading = "Logs")]
    pub log_backups: u32,
}

/// Durations in run.json as humantime writes them (`30s`, `5m`, `1h 30m`).
mod saved_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        humantime::parse_duration(&String::deserialize(d)?).map_err(serde::de::Error::custom)
    }

    /// The same for an optional duration (`null`: not set).
    pub mod option {
        use std::time::Duration;

        use serde::{Deserialize, Deserializer, Serializer};

        pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
            match d {
                Some(d) => super::serialize(d, s),
                None => s.serialize_none(),
            }
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
            Option::<String>::deserialize(d)?
                .map(|s| humantime::parse_duration(&s).map_err(serde::de::Error::custom))
                .transpose()
        }
    }
}

impl RunArgs {
    /// The split asked for: `--targets`, or 1 until the run has settled the default
    /// (`crate::run`: auto on 3 or more devices).
    pub fn split(&self) -> Targets {
        self.targets.unwrap_or(Targets::Fixed(1))
    }

    /// Whether the split moves while the run trains (`--targets auto`).
    pub fn auto_split(&self) -> bool {
        matches!(self.targets, Some(Targets::Auto { .. }))
    }
}

impl std::ops::Deref for RunArgs {
    type Target = RunSettings;

    fn deref(&self) -> &RunSettings {
        &self.settings
    }
}

impl std::ops::DerefMut for RunArgs {
    fn deref_mut(&mut self) -> &mut RunSettings {
        &mut self.settings
    }
}

#[derive(Debug, Args)]
pub struct LogsArgs {
    /// Worker name, e.g. target-0 or drafter-3.
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    pub worker: Option<String>,
    /// Every worker, each line prefixed with [worker-name].
    #[arg(long)]
    pub all: bool,
    /// Print the last N lines.
    #[arg(short = 'n', long, value_name = "N", default_value_t = 20)]
    pub lines: usize,
    /// Keep printing new lines as they are written, across restarts and log rotation.
    /// Stops once the run has ended and everything is printed.
    #[arg(short = 'f', long)]
    pub follow: bool,
    /// Run directory. Default: the newest run under ./runs.
    #[arg(long, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Moving batches between processes: memcpy, slot pool, ipc-channel bytes, hand-off
    /// latency and a bare futex round trip, all measured in this run.
    Ipc {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Fewer repetitions (a smoke run; the figures are noisier).
        #[arg(long)]
        quick: bool,
    },
    /// What the leader of a job across nodes costs per step: a leader on 127.0.0.2 with
    /// its real control link, lease table and step commit, and --followers follower
    /// processes on loopback stepping as fast as they can (simulated ranks, no model).
    /// Prints steps/s, the leader's CPU and the control bytes per step, the commit
    /// latency, and those scaled to 64 nodes of as many ranks.
    Cluster {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Follower nodes (processes) besides the leader.
        #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=256))]
        followers: u32,
        /// Steps measured (after 5 of warm-up).
        #[arg(long, default_value_t = 200)]
        steps: u64,
        /// Simulated drafter ranks per node (batches each node reports per step).
        #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=64))]
        ranks: u32,
    },
    /// What GPU telemetry costs: the NVML sampler per GPU per sample, and the
    /// supervisor's CPU use with one worker per GPU and 1 s sampling.
    Telemetry {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Length of the measured run.
        #[arg(long, default_value_t = 12)]
        seconds: u64,
    },
    /// Chat-data preparation: conversations/s and tokens/s of rendering and tokenizing, on
    /// all cores and on one, against the goal of 10x what an 8-GPU run consumes.
    Prepare {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Directory holding the tokenizer.json and chat template (tokenizer_config.json)
        /// to measure, e.g. a Qwen3 model directory (scripts/fetch_test_assets.sh fetches
        /// one into target/test-assets/qwen3-tokenizer).
        #[arg(long, value_name = "DIR", required = true)]
        tokenizer: PathBuf,
        /// Conversations to prepare.
        #[arg(long, default_value_t = 4000)]
        conversations: usize,
    },
    /// Compute of one worker: the target forward per op and as a whole (tokens/s,
    /// GFLOP/s) against bare GEMMs of the same shapes, and one drafter step. Runs in a
    /// dflash-worker process; without a GPU it measures the CPU backend and says so.
    Compute {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// A Hugging Face model directory, a built-in shape `qwen3:HIDDENxLAYERS`,
        /// `ops:qwen3-8b` / `ops:tiny`: single ops on the GPU at those shapes, or
        /// `throughput:qwen3-8b` / `throughput:tiny`: a target worker's and a drafter
        /// worker's tokens/s and MFU on the GPU, over 20+ steps after a warm-up, at the
        /// shapes `bench kernels` models (random weights, no download).
        #[arg(long, value_name = "DIR|SHAPE", default_value = "qwen3:768x5")]
        target: String,
        /// Tokens in the measured sequence.
        #[arg(long, default_value_t = 1024)]
        tokens: usize,
    },
    /// The GPU kernels' machine code, without a GPU: per kernel registers, shared memory,
    /// stack frame and local memory with its LDL/STL (spills), resident warps per SM and
    /// the main loop's MMAs and non-MMA instructions per MMA (NVRTC's CUBIN for
    /// sm_80/90/100, read by cuobjdump: pip install nvidia-cuda-cuobjdump
    /// nvidia-cuda-nvdisasm), and a roofline model of an H200 at Qwen3-8B's shapes with its
    /// assumptions and the bound that binds each op: a modelled MFU range (target forward
    /// about 57-59 %, drafter step about 50 %), a model until scripts/gpu_check.sh has
    /// measured it on a GPU. Runs in a dflash-worker process; exit 2 with one line when
    /// NVRTC, cuobjdump or nvdisasm is missing.
    Kernels {
        /// Print one JSON object (`kernels`: one entry per kernel and architecture, with
        /// `stack_bytes`; `model`: the modelled MFU figures, a `bound` on every line).
        #[arg(long)]
        json: bool,
        /// Architectures to compile for, comma-separated (the model needs sm_90).
        #[arg(
            long,
            value_name = "SM",
            value_delimiter = ',',
            default_value = "sm_80,sm_90,sm_100"
        )]
        arch: Vec<String>,
    },
    /// The report page of a long run: its size and write time, and with Chromium on the
    /// machine the time headless Chromium takes to open it, against a 200-step run of the
    /// same shape (synthetic runs: one step a second, a metrics window every 10 steps,
    /// every NVML field per GPU).
    Report {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Steps of the long run.
        #[arg(long, default_value_t = 50_000)]
        steps: u64,
        /// GPUs (a quarter targets, the rest drafters).
        #[arg(long, default_value_t = 8)]
        gpus: u64,
        /// Do not open the pages in Chromium even where it is installed.
        #[arg(long)]
        no_chromium: bool,
    },
    /// Training throughput on CPU: target forward and drafter step alone (in one
    /// dflash-worker process) against the whole pipeline on the same batches.
    Train {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Batches (= steps) measured.
        #[arg(long, default_value_t = 30)]
        steps: u64,
        /// native: the native engine alone. torch: also the torch engine (transformers in
        /// a Python child; needs python3 with torch and transformers) on the same batches,
        /// its target forward alone and its whole pipeline, with the ratios torch/native.
        #[arg(long, value_name = "ENGINE", value_enum, default_value = "native")]
        target_engine: BenchTrainEngine,
        /// Instead: the split between the roles. cpu:4 trains the demo data for
        /// --split-seconds with --targets 1, 2 and 3, then with --targets auto; each run's
        /// tokens/s trained (from its first step to its last, auto's moves included), and
        /// auto's against the best fixed split (goal >= 0.9).
        #[arg(long)]
        splits: bool,
        /// Length of each run of --splits.
        #[arg(
            long,
            value_name = "SECONDS",
            default_value_t = 90,
            requires = "splits"
        )]
        split_seconds: u64,
    },
}

/// `bench train --target-engine`: the engines measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchTrainEngine {
    /// The native engine alone.
    Native,
    /// The native engine and, beside it, the torch engine.
    Torch,
}

#[derive(Debug, Args)]
pub struct ClusterCheckArgs {
    /// The job's run directory, on a filesystem every node shares: the leader writes the
    /// job's secret there (cluster.secret, mode 600) and every follower reads it.
    #[arg(long, value_name = "DIR")]
    pub run_dir: PathBuf,
    /// How many nodes (supervisors) the job has. Default: srun's task count under Slurm,
    /// else 1.
    #[arg(long, value_name = "N")]
    pub nodes: Option<u32>,
    /// This node's rank, 0 (the leader) to N-1. Default: SLURM_PROCID.
    #[arg(long, value_name = "R", requires = "nodes")]
    pub node_rank: Option<u32>,
    /// The leader's address, where it listens (never every interface). Default under
    /// Slurm: the first host of the step's node list, on port 20000 + job id % 20000.
    #[arg(long, value_name = "HOST:PORT")]
    pub leader: Option<String>,
    /// How long the leader waits for every node, and a follower for the leader.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Silence on a link after which the other side counts as lost.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    pub node_timeout: Duration,
    /// The leader prints its list of nodes as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct LedgerArgs {
    /// Run directory. Default: the newest run under ./runs.
    #[arg(long, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
    /// Print the audit as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Run directory. Default: the newest run under ./runs.
    #[arg(long, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
    /// Print the state as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `--max-seq-len`'s default (a shorter target context lowers it: see
/// `run::validate::adapt_max_seq_len`).
pub const DEFAULT_MAX_SEQ_LEN: u32 = 1024;

/// The run options of a command line without its program name (for unit tests).
#[cfg(test)]
pub(crate) fn run_args(extra: &[&str]) -> RunArgs {
    let argv = std::iter::once("dflash-supervise").chain(extra.iter().copied());
    Cli::try_parse_from(argv)
        .expect("a valid test command line")
        .run
}

/// A clap error as one line, without its `error: ` prefix: "the following required
/// arguments were not provided:" and the indented lines naming them are joined.
pub fn error_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let mut lines = text.lines().skip_while(|l| l.trim().is_empty());
    let first = lines.next().unwrap_or("invalid command line");
    let mut line = first.strip_prefix("error: ").unwrap_or(first).to_string();
    if line.ends_with(':') {
        let named: Vec<&str> = lines
            .take_while(|l| l.starts_with(' ') && !l.trim().is_empty())
            .map(str::trim)
            .collect();
        line = format!("{line} {}", named.join(", "));
    }
    line
}

/// `--targets`: a count, or `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Targets {
    Fixed(u32),
    /// The split is measured and moved while the run goes (`crate::run::balance`),
    /// starting from `start` targets (`None` until the run has worked it out: one).
    Auto {
        start: Option<u32>,
    },
}

fn parse_targets(s: &str) -> Result<Targets, String> {
    let bad =
        || format!("'{s}' is not a number of target workers (expected e.g. 1, auto or auto:2)");
    match s.split_once(':') {
        None if s == "auto" => Ok(Targets::Auto { start: None }),
        Some(("auto", n)) => match n.parse() {
            Ok(n) => Ok(Targets::Auto { start: Some(n) }),
            Err(_) => Err(bad()),
        },
        _ => s.parse().map(Targets::Fixed).map_err(|_| bad()),
    }
}

fn parse_spec(s: &str) -> Result<DeviceSpec, DeviceSpecError> {
    s.parse::<DeviceSpec>()
}

/// The longest duration a flag takes: a bound far beyond any run, so that adding one to
/// the clock cannot overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(1000 * 24 * 3600);

/// A duration flag that cannot be read, or is longer than [`MAX_DURATION`].
#[derive(Debug, thiserror::Error)]
pub enum DurationError {
    #[error("{source} (expected a duration such as 500ms, 30s, 5m or 2h)")]
    Unreadable { source: humantime::DurationError },
    #[error("'{given}' is too long (expected at most 1000days)")]
    TooLong { given: String },
}

pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let d = humantime::parse_duration(s.trim())
        .map_err(|source| DurationError::Unreadable { source })?;
    if d > MAX_DURATION {
        return Err(DurationError::TooLong {
            given: s.trim().to_string(),
        });
    }
    Ok(d)
}

/// A size flag that cannot be read: the text given and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("'{given}' is not a size ({SIZE_EXPECTED})")]
    NotASize { given: String },
    #[error("unknown size unit '{unit}' ({SIZE_EXPECTED})")]
    Unit { unit: String },
    #[error("'{given}' is too large")]
    TooLarge { given: String },
    #[error("'{given}': size must be above zero ({SIZE_EXPECTED})")]
    Zero { given: String },
}

const SIZE_EXPECTED: &str = "expected a size such as 4096, 500K or 64MiB";

/// Sizes: plain bytes, or with K/M/G (powers of 1024; "KiB", "MB" and friends also read as
/// powers of 1024 because that is what a log size means to everyone who sets one).
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let given = || s.to_string();
    let n: u64 = num
        .parse()
        .map_err(|_| SizeError::NotASize { given: given() })?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => {
            return Err(SizeError::Unit {
                unit: other.to_string(),
            })
        }
    };
    let v = n
        .checked_mul(mult)
        .ok_or_else(|| SizeError::TooLarge { given: given() })?;
    if v == 0 {
        return Err(SizeError::Zero { given: given() });
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn targets_is_a_count_auto_or_auto_from_a_count() {
        assert_eq!(run_args(&[]).targets, None, "the run settles the default");
        assert_eq!(run_args(&[]).split(), Targets::Fixed(1));
        assert_eq!(
            run_args(&["--targets", "3"]).targets,
            Some(Targets::Fixed(3))
        );
        assert_eq!(
            run_args(&["--targets", "auto"]).targets,
            Some(Targets::Auto { start: None })
        );
        assert_eq!(
            run_args(&["--targets", "auto:2"]).targets,
            Some(Targets::Auto { start: Some(2) })
        );
        for bad in ["many", "auto:", "auto:x", "-1", "manual:2"] {
            let e = parse_targets(bad).unwrap_err();
            assert!(
                e.contains(&format!("'{bad}'")) && e.contains("auto:2"),
                "{e}"
            );
        }
    }

    #[test]
    fn negative_numbers_reach_the_range_checks_instead_of_clap() {
        // `--gamma -1` (with a space) is the flag's value, not an unknown flag `-1`: the
        // range check then names it (issue 20 §9).
        let a = run_args(&["--gamma", "-1", "--lr", "-0.5", "--warmup-ratio", "-1e-3"]);
        assert_eq!(
            (a.gamma, a.lr, a.warmup_ratio),
            (Some(-1.0), Some(-0.5), Some(-1e-3))
        );
        let e = crate::run::validate::check_flags(&run_args(&["--gamma", "-1"])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--gamma -1: expected a positive number (7 for blocks of 16)"
        );
        // A flag that takes no negative value still refuses `-1` as clap does.
        assert!(Cli::try_parse_from(["dflash-supervise", "--max-restarts", "-1"]).is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("500K").unwrap(), 500 * 1024);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("1g").unwrap(), 1 << 30);
        assert!(parse_size("0").is_err());
        assert_eq!(
            parse_size("12parsecs").unwrap_err(),
            SizeError::Unit {
                unit: "parsecs".into()
            }
        );
        assert!(parse_size("12parsecs")
            .unwrap_err()
            .to_string()
            .contains("unknown size unit"));
        assert!(parse_size("lots").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("60s").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("1000days").unwrap(), MAX_DURATION);
        assert!(parse_duration("300000000000y")
            .unwrap_err()
            .to_string()
            .contains("too long"));
        assert!(parse_duration("1001days")
            .unwrap_err()
            .to_string()
            .contains("at most 1000days"));
        assert!(parse_duration("soon")
            .unwrap_err()
            .to_string()
            .contains("expected a duration"));
    }
}
