//! `dflash-worker`: one worker process of a dflash-supervise run, on one device.
//!
//! The supervisor starts it with `--control NAME` and its identity in the environment
//! (`DFLASH_ROLE`, `DFLASH_RANK`, `DFLASH_GPU`, ...). It connects back over ipc-channel,
//! says hello, and runs its role loop, heartbeating as it makes progress. It exits 0 when
//! the supervisor asks it to shut down (SIGTERM, SIGINT and SIGHUP only count before it is
//! connected: after that, the supervisor's stop order does), and exits when the control
//! channel closes: a worker never outlives its supervisor.
//!
//! Two tools for people come with it: `inspect` (the tapped hidden states of one token
//! sequence, to check parity with a PyTorch stack) and `tiny-target` (writes the built-in
//! demo target).

mod busy;
pub mod collective;
pub mod device;
pub mod error;
pub mod eval;
mod fatal;
pub mod generate;
mod identity;
pub mod init_weights;
pub mod math;
pub mod models;
mod plane;
#[cfg(any(test, feature = "reference"))]
pub mod reference;
mod role;
pub mod tools;
pub mod torch_engine;
mod train;

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use dflash_shared::exit_codes;

pub use identity::Identity;

/// A DFlash worker process. Started by dflash-supervise (with --control); the
/// subcommands are tools for people.
#[derive(Debug, Parser)]
#[command(
    name = "dflash-worker",
    version,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Name of the supervisor's control server to connect to (given by dflash-supervise).
    #[arg(long, value_name = "NAME")]
    control: Option<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write the tapped hidden states of one token sequence to a safetensors file
    /// (tensor "hidden", shape [tokens, taps × hidden], f32), to compare with
    /// transformers' output_hidden_states (hidden_states[tap + 1]).
    Inspect {
        /// A Hugging Face model directory (config.json + safetensors), or "tiny".
        #[arg(long, value_name = "DIR")]
        target: String,
        /// Token ids, comma-separated.
        #[arg(long, value_name = "IDS", value_delimiter = ',', required = true)]
        tokens: Vec<u32>,
        /// Layer ids to tap (default: DFlash's spread over the target's depth).
        #[arg(long, value_name = "IDS", value_delimiter = ',')]
        taps: Option<Vec<usize>>,
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
        /// What computes them: native (this tool's forward on the CPU device, f32) or
        /// torch (the torch engine's Python child, transformers in f32).
        #[arg(long, value_name = "ENGINE", default_value = "native")]
        engine: String,
    },
    /// Baseline of `dflash-supervise bench train`: the target forward and the drafter
    /// step over the batches of a spec file, in this one process.
    #[command(hide = true)]
    BenchCompute {
        #[arg(long, value_name = "FILE")]
        spec: PathBuf,
    },
    /// What `dflash-supervise bench compute` measures: the target forward per op and as a
    /// whole against bare GEMMs of its shapes, and one drafter step.
    #[command(hide = true)]
    BenchOps {
        /// A Hugging Face model directory, a shape `qwen3:HIDDENxLAYERS`, `ops:qwen3-8b` /
        /// `ops:tiny` (single ops on the GPU at those shapes), or `throughput:qwen3-8b` /
        /// `throughput:tiny` (a target's and a drafter's steady tokens/s and MFU on the GPU).
        #[arg(long, value_name = "DIR|SHAPE", default_value = "qwen3:768x5")]
        target: String,
        /// Tokens in the measured sequence.
        #[arg(long, default_value_t = 1024)]
        tokens: usize,
        #[arg(long)]
        json: bool,
    },
    /// What `dflash-supervise bench kernels` prints: the kernels' registers, shared memory,
    /// stack frame and LDL/STL (spills), resident warps and main-loop instruction mix from
    /// NVRTC's CUBIN (read with cuobjdump, no GPU needed), and a roofline model of an H200
    /// at Qwen3-8B's shapes (a model until scripts/gpu_check.sh measures it).
    #[command(hide = true)]
    BenchKernels {
        /// Architectures to compile for (default: sm_80,sm_90,sm_100; the model needs sm_90).
        #[arg(long, value_name = "SM", value_delimiter = ',')]
        arch: Vec<String>,
        #[arg(long)]
        json: bool,
    },
    /// Write the drafter of a checkpoint (checkpoints/step-N of a run) as a Hugging Face
    /// directory, with the parity probe (what `dflash-supervise export` runs).
    Export {
        /// The checkpoint directory (state.safetensors + meta.json); verified first.
        #[arg(long, value_name = "DIR")]
        checkpoint: PathBuf,
        /// The run's target model directory (the frozen embeddings come from it).
        #[arg(long, value_name = "DIR")]
        target: PathBuf,
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// For checkpoints that do not record them: the target layers the drafter reads.
        #[arg(long, value_name = "IDS", value_delimiter = ',')]
        taps: Option<Vec<u32>>,
        #[arg(long, value_name = "N")]
        num_target_layers: Option<usize>,
        /// How the run rendered its data (JSON: the chat template's SHA-256 and the
        /// thinking switch), recorded in config.json as dflash_rendering.
        #[arg(long, value_name = "JSON")]
        rendering: Option<String>,
    },
    /// What `dflash-supervise eval` runs: greedy speculative decoding of each prompt with
    /// an exported drafter against plain greedy decoding, on the CPU or the GPU; prints τ.
    Eval {
        /// The target model directory, or "tiny" (the built-in demo target).
        #[arg(long, value_name = "DIR")]
        target: String,
        /// An exported drafter directory (RUN_DIR/drafter).
        #[arg(long, value_name = "DIR")]
        drafter: PathBuf,
        /// Prompts: one JSON array of token ids (or {"input_ids": [...]}) per line.
        #[arg(long, value_name = "FILE")]
        prompts: PathBuf,
        #[arg(long, value_name = "N", default_value_t = 128)]
        max_new_tokens: usize,
        /// Seed of the bootstrap interval.
        #[arg(long, value_name = "N", default_value_t = 0)]
        seed: u64,
        #[arg(long)]
        json: bool,
        /// Decode on the GPUs CUDA_VISIBLE_DEVICES names (ordinal 0 when it names none;
        /// the target's layers split over several as --gpus-per-target splits them, the
        /// drafter on the first) in bf16, not on the CPU in f32. There a prompt whose speculative output differs from greedy
        /// decoding's is counted, not a failure: bf16 products of 1 and of a block of rows
        /// may round a near tie apart.
        #[arg(long)]
        gpu: bool,
        /// What runs the target: native (this tool's forward), torch (transformers in a
        /// Python child, over its own KV cache) or auto (native for the families it serves).
        #[arg(long, value_name = "ENGINE", default_value = "auto")]
        engine: String,
    },
    /// What `dflash-supervise regenerate` runs: the target alone continues token-id
    /// prompts, one JSON request per stdin line ({"id", "ids", "max_new", "seed"}), one
    /// reply per stdout line ({"id", "tokens", "finish": "stop"|"length"}).
    Generate {
        /// The target model directory, or "tiny" (the built-in demo target).
        #[arg(long, value_name = "DIR")]
        target: String,
        /// Prompt and new tokens together at most (the KV cache's length).
        #[arg(long, value_name = "N")]
        max_len: usize,
        /// 0: greedy; else sample from the softmax of logits ÷ T.
        #[arg(long, value_name = "T", default_value_t = 0.0)]
        temperature: f32,
        /// Sample from the fewest most likely tokens whose probabilities reach P.
        #[arg(long, value_name = "P", default_value_t = 1.0)]
        top_p: f32,
        /// Token ids that end a continuation.
        #[arg(long, value_name = "IDS", value_delimiter = ',')]
        stop: Vec<u32>,
        /// On the GPUs CUDA_VISIBLE_DEVICES names (ordinal 0 when it names none; the
        /// target's layers split over several) in bf16, not the CPU.
        #[arg(long)]
        gpu: bool,
        /// What runs the target: native (this tool's forward), torch (transformers in a
        /// Python child, over its own KV cache) or auto (native for the families it serves).
        #[arg(long, value_name = "ENGINE", default_value = "auto")]
        engine: String,
    },
    /// Write the built-in tiny demo target (config.json + model.safetensors) into DIR, or
    /// with --config a target of random weights for that config.json (tests use it).
    TinyTarget {
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// A Qwen3, Qwen3-MoE or Llama config.json to give random weights.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
}

pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return exit_codes::SUCCESS;
            }
            let text = e.render().to_string();
            let first = text
                .lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("invalid command line");
            eprintln!("dflash-worker: {first} (see --help)");
            return exit_codes::USAGE;
        }
    };
    match cli.command {
        Some(c) => run_tool(c),
        None => serve(cli.control),
    }
}

/// One of the tools for people (and for the supervisor's commands).
fn run_tool(c: Command) -> i32 {
    match c {
        Command::Inspect {
            target,
            tokens,
            taps,
            out,
            engine,
        } => tool(inspect(&target, &tokens, taps, &out, &engine)),
        Command::BenchCompute { spec } => tool(tools::bench::run(&spec)),
        Command::BenchOps {
            target,
            tokens,
            json,
        } => tool(match target.strip_prefix("throughput:") {
            Some(preset) => tools::bench_throughput::run(preset, json),
            None => tools::bench_ops::run(&target, tokens, json),
        }),
        Command::BenchKernels { arch, json } => {
            tool(tools::kernel_bench::run(&arch, json).map_err(error::ToolError::from))
        }
        Command::Export {
            checkpoint,
            target,
            out,
            taps,
            num_target_layers,
            rendering,
        } => tool(
            tools::export::from_checkpoint(
                &checkpoint,
                &target,
                &out,
                taps.as_deref(),
                num_target_layers,
                rendering.and_then(|r| serde_json::from_str(&r).ok()),
            )
            .map(|step| println!("drafter of step {step} written to {}", out.display()))
            .map_err(error::ToolError::from),
        ),
        Command::Eval {
            target,
            drafter,
            prompts,
            max_new_tokens,
            seed,
            json,
            gpu,
            engine,
        } => match eval::tool::run(&eval::tool::Args {
            target,
            drafter,
            prompts,
            max_new_tokens,
            json,
            seed,
            gpu,
            engine,
        }) {
            // Speculative decoding wrote other tokens than greedy decoding: a failed check.
            Ok(false) => exit_codes::RUN_FAILED,
            r => tool(r.map(|_| ())),
        },
        Command::Generate {
            target,
            max_len,
            temperature,
            top_p,
            stop,
            gpu,
            engine,
        } => tool(generate::run(&generate::Args {
            target,
            max_len,
            sampling: generate::Sampling { temperature, top_p },
            stop,
            gpu,
            engine,
        })),
        Command::TinyTarget { out, config: None } => tool(
            models::tiny::write(&out)
                .map_err(error::ToolError::io(format!("--out {}", out.display()))),
        ),
        Command::TinyTarget {
            out,
            config: Some(c),
        } => tool(
            std::fs::read_to_string(&c)
                .map_err(error::ToolError::io(format!("--config {}", c.display())))
                .and_then(|text| {
                    models::tiny::write_random(&out, &text, 1)
                        .map_err(error::ToolError::io(format!("--out {}", out.display())))
                }),
        ),
    }
}

fn tool(r: Result<(), error::ToolError>) -> i32 {
    match r {
        Ok(()) => exit_codes::SUCCESS,
        Err(e) => {
            eprintln!("dflash-worker: error: {e}");
            exit_codes::USAGE
        }
    }
}

fn serve(control: Option<String>) -> i32 {
    let Some(control) = control else {
        eprintln!("dflash-worker: error: --control NAME is missing (dflash-worker is started by dflash-supervise; see --help for its tools)");
        return exit_codes::USAGE;
    };
    let id = match Identity::from_env() {
        Ok(id) => id,
        Err(e) => {
            eprintln!("dflash-worker: error: {e}");
            return exit_codes::USAGE;
        }
    };
    missing_symbol_is_permanent(&id.name.to_string(), &id.gpu);
    match role::run(&control, &id) {
        Ok(code) => code,
        // The one place a failure becomes an exit code (error.rs): permanent ones are marked
        // so in the line the supervisor reads.
        Err(e) => {
            fatal::report(e.fatal_kind(), &e.reason(&id.gpu));
            eprintln!("{}", e.line(&id.name.to_string(), &id.gpu));
            e.exit_code()
        }
    }
}

/// cudarc loads CUDA's libraries at run time and resolves each function on first use,
/// panicking ("Missing symbol cuX: ...") on one the installed library lacks: a driver or
/// CUDA older than the 13.0 this build binds. That is no crash to restart (it repeats on
/// every start), so the worker says so on the line the supervisor reads and exits as a
/// permanent failure. Any other panic goes to the default hook.
fn missing_symbol_is_permanent(name: &str, gpu: &str) {
    let (name, gpu) = (name.to_string(), gpu.to_string());
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let p = info.payload();
        let msg = p
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| p.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if let Some(what) = msg.strip_prefix("Missing symbol ") {
            let why = format!("the installed CUDA library lacks a function this build calls ({what}); it needs an NVIDIA driver and CUDA libraries for CUDA 13.0 or newer");
            let e = error::WorkerError::Permanent(why);
            fatal::report(e.fatal_kind(), &e.reason(&gpu));
            let line = e.line(&name, &gpu);
            let _ =
                std::io::Write::write_fmt(&mut std::io::stderr().lock(), format_args!("{line}\n"));
            std::process::exit(exit_codes::WORKER_PERMANENT);
        }
        default(info);
    }));
}

/// The taps of `tokens` by the torch engine's child, in f32, through a scratch file it
/// writes into as it writes into a hidden-state pool.
fn torch_taps(
    dir: &std::path::Path,
    taps: &[usize],
    tokens: &[u32],
    hidden: usize,
) -> Result<Vec<f32>, error::ToolError> {
    let scratch = dflash_shared::scratch::ScratchDir::new("torch-inspect").map_err(
        error::ToolError::io("creating a scratch directory".to_string()),
    )?;
    let pool = scratch.path().join("pool");
    let n = tokens.len() * taps.len() * hidden;
    std::fs::write(&pool, vec![0u8; n * 4])
        .map_err(error::ToolError::io(format!("writing {}", pool.display())))?;
    let mut child =
        torch_engine::TorchChild::start(dir, taps, torch_engine::Mode::Taps { pool: &pool }, 0)
            .map_err(error::WorkerError::from)?;
    child
        .run(0, &[(tokens, 0)], true)
        .map_err(error::WorkerError::from)?;
    drop(child);
    let bytes = std::fs::read(&pool)
        .map_err(error::ToolError::io(format!("reading {}", pool.display())))?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn inspect(
    target: &str,
    tokens: &[u32],
    taps: Option<Vec<usize>>,
    out: &std::path::Path,
    engine: &str,
) -> Result<(), error::ToolError> {
    use dflash_shared::model_config::{default_draft_layers, target_layer_ids, TargetConfig};
    // The built-in tiny target, written into a scratch directory of ours (removed with it).
    let mut scratch = None;
    let dir = if target == "tiny" {
        let s = scratch.insert(dflash_shared::scratch::ScratchDir::new("tiny").map_err(
            error::ToolError::io("creating a scratch directory".to_string()),
        )?);
        models::tiny::write(s.path()).map_err(error::ToolError::io(format!(
            "writing {}",
            s.path().display()
        )))?;
        s.path()
    } else {
        std::path::Path::new(target)
    };
    let cfg = TargetConfig::load(dir)?;
    let taps = taps.unwrap_or_else(|| {
        target_layer_ids(
            cfg.num_hidden_layers,
            default_draft_layers(cfg.num_hidden_layers),
        )
        .into_iter()
        .map(|t| t as usize)
        .collect()
    });
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        return Err(error::ToolError::TokenOutOfVocab {
            id: bad,
            vocab: cfg.vocab_size,
        });
    }
    let hidden = match engine {
        "native" => {
            // The forward a CPU target worker runs: the device target on the CPU device.
            let t = models::target::Target::load(dir, &taps)?;
            let mut model = models::target::device::DeviceTarget::new(
                Box::new(device::cpu::CpuDevice::new()),
                &t,
                tokens.len(),
            )?;
            model.forward_taps(tokens)?
        }
        "torch" => torch_taps(dir, &taps, tokens, cfg.hidden_size)?,
        other => {
            return Err(error::ToolError::Usage {
                flag: "--engine",
                value: other.into(),
                expected: "native or torch".into(),
            })
        }
    };
    let bytes: Vec<u8> = hidden.iter().flat_map(|v| v.to_le_bytes()).collect();
    let shape = vec![tokens.len(), taps.len() * cfg.hidden_size];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape, &bytes)
        .map_err(|source| error::ToolError::Safetensors {
            what: "the taps".into(),
            source,
        })?;
    let meta = std::collections::HashMap::from([("taps".to_string(), format!("{taps:?}"))]);
    safetensors::serialize_to_file([("hidden", view)], Some(meta), out).map_err(|source| {
        error::ToolError::Safetensors {
            what: format!("--out {}", out.display()),
            source,
        }
    })?;
    drop(scratch);
    println!(
        "wrote {} ({} tokens × {} taps × {} hidden) taps {taps:?}",
        out.display(),
        tokens.len(),
        taps.len(),
        cfg.hidden_size
    );
    Ok(())
}
