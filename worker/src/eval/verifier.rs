//! The target's side of decoding, whichever engine runs it: a KV cache that takes rows
//! after its positions and answers each row's greedy token and taps, is cut back to the
//! committed positions, and applies the target's lm_head to a drafter's hidden states.
//! The native engine's [`Decoder`] is one; [`TorchVerifier`] runs transformers'
//! implementation in the torch engine's Python child (decode mode).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde_json::json;

use crate::error::ToolError;
use crate::models::target::device::decode::{argmax, Decoder};
use crate::torch_engine::{Mode, TorchChild, TorchError};

/// What one forward answers for its rows.
#[derive(Debug, Clone, PartialEq)]
pub struct Verified {
    /// Each row's greedy token.
    pub argmax: Vec<u32>,
    /// `[rows, taps × hidden]`: each row's tapped hidden states.
    pub taps: Vec<f32>,
    /// The last row's largest logit minus the runner-up's ([`top2_margin`]).
    pub margin: f32,
    /// The last row's largest |logit|.
    pub max_abs: f32,
}

/// A target that decodes over a KV cache.
pub trait Verifier {
    /// Floats of one row's taps (taps × hidden).
    fn taps_width(&self) -> usize;
    /// Positions the cache holds.
    fn cached(&self) -> usize;
    /// Forget every position from `len` on.
    fn keep(&mut self, len: usize) -> Result<(), ToolError>;
    /// `tokens` (one or more) at the positions after the cache's; they join it.
    fn verify(&mut self, tokens: &[u32]) -> Result<Verified, ToolError>;
    /// The greedy token of each row of final-normed hidden states `[rows, hidden]` (a
    /// drafter's output: it shares the target's lm_head).
    fn head_argmax(&mut self, hidden: &[f32]) -> Result<Vec<u32>, ToolError>;
    /// `tokens` after the cache's positions, as [`verify`](Self::verify): the last row's
    /// logits (what sampling the next token needs).
    fn last_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ToolError>;
}

/// Whether `engine` (native, torch or auto) runs `cfg` on the torch engine: auto picks it
/// for the families the native engine does not serve.
pub fn wants_torch(
    engine: &str,
    cfg: &dflash_shared::model_config::TargetConfig,
) -> Result<bool, ToolError> {
    let native = cfg.arch != dflash_shared::model_config::Arch::Transformers;
    match engine {
        "torch" => Ok(true),
        "auto" => Ok(!native),
        "native" if native => Ok(false),
        "native" => Err(ToolError::Usage {
            flag: "--engine",
            value: engine.to_string(),
            expected: format!(
                "the native engine serves Qwen3, Qwen3-MoE and Llama, not {}: torch or auto",
                cfg.model_type
            ),
        }),
        _ => Err(ToolError::Usage {
            flag: "--engine",
            value: engine.to_string(),
            expected: "native, torch or auto".into(),
        }),
    }
}

/// The largest value of `row` minus the second largest (0 for fewer than two values,
/// or a tie), and the largest |value|.
pub fn top2_margin(row: &[f32]) -> (f32, f32) {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in row {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    let scale = row.iter().fold(0f32, |m, x| m.max(x.abs()));
    let margin = if b.is_finite() { a - b } else { 0.0 };
    (margin, scale)
}

impl Verifier for Decoder {
    fn taps_width(&self) -> usize {
        Decoder::taps_width(self)
    }

    fn cached(&self) -> usize {
        self.len()
    }

    fn keep(&mut self, len: usize) -> Result<(), ToolError> {
        Ok(self.crop(len)?)
    }

    fn verify(&mut self, tokens: &[u32]) -> Result<Verified, ToolError> {
        let (f, last) = rows(self, tokens)?;
        let vocab = self.vocab();
        let (margin, max_abs) = top2_margin(&f.logits[last..]);
        Ok(Verified {
            argmax: f.logits.chunks_exact(vocab).map(argmax).collect(),
            taps: f.taps,
            margin,
            max_abs,
        })
    }

    fn head_argmax(&mut self, hidden: &[f32]) -> Result<Vec<u32>, ToolError> {
        Ok(self.lm_head_argmax(hidden)?)
    }

    fn last_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ToolError> {
        let (f, last) = rows(self, tokens)?;
        Ok(f.logits[last..].to_vec())
    }
}

/// `tokens` after `dec`'s cache (in forwards of up to a block each: `prefill`), and where
/// the last row's logits start.
fn rows(
    dec: &mut Decoder,
    tokens: &[u32],
) -> Result<(crate::models::target::device::decode::Forward, usize), ToolError> {
    let f = dec.prefill(tokens)?;
    let last =
        f.logits.len().checked_sub(dec.vocab()).ok_or_else(|| {
            crate::device::GpuError::Invalid("a forward returned no logits".into())
        })?;
    Ok((f, last))
}

/// The torch engine's target: transformers' implementation in a Python child, the whole
/// model over its own KV cache; floats go both ways through a scratch file.
pub struct TorchVerifier {
    child: TorchChild,
    exchange: File,
    /// Holds the exchange file; removed with this.
    _scratch: dflash_shared::scratch::ScratchDir,
    len: usize,
    width: usize,
    hidden: usize,
}

impl TorchVerifier {
    /// Load `target` (hidden size `hidden`) in a child tapping `taps`, on the GPU
    /// (bf16) or the CPU (f32).
    pub fn start(
        target: &Path,
        taps: &[usize],
        hidden: usize,
        gpus: usize,
    ) -> Result<TorchVerifier, ToolError> {
        let scratch = dflash_shared::scratch::ScratchDir::new("torch-eval")
            .map_err(ToolError::io("creating a scratch directory".to_string()))?;
        let path = scratch.path().join("exchange.f32");
        let exchange = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(ToolError::io(format!("creating {}", path.display())))?;
        let child = TorchChild::start(target, taps, Mode::Decode { exchange: &path }, gpus)?;
        Ok(TorchVerifier {
            child,
            exchange,
            _scratch: scratch,
            len: 0,
            width: taps.len() * hidden,
            hidden,
        })
    }

    /// The child's ready line (versions, device).
    pub fn ready(&self) -> &serde_json::Value {
        &self.child.ready
    }

    fn tokens(v: &serde_json::Value, rows: usize) -> Result<Vec<u32>, ToolError> {
        let t: Vec<u32> = v["argmax"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect();
        if t.len() != rows {
            return Err(
                TorchError::Protocol(format!("the child answered {v} for {rows} rows")).into(),
            );
        }
        Ok(t)
    }
}

impl Verifier for TorchVerifier {
    fn taps_width(&self) -> usize {
        self.width
    }

    fn cached(&self) -> usize {
        self.len
    }

    /// Said to the child with the next forward (it crops or rebuilds its cache then).
    fn keep(&mut self, len: usize) -> Result<(), ToolError> {
        if len > self.len {
            return Err(crate::device::GpuError::Invalid(format!(
                "cropping a cache of {} positions to {len}",
                self.len
            ))
            .into());
        }
        self.len = len;
        Ok(())
    }

    fn verify(&mut self, tokens: &[u32]) -> Result<Verified, ToolError> {
        let rows = tokens.len();
        let r = self
            .child
            .call(&json!({"op": "forward", "past": self.len, "ids": tokens}))?;
        self.verified(&r, rows)
    }

    fn last_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ToolError> {
        let rows = tokens.len();
        let r = self
            .child
            .call(&json!({"op": "forward", "past": self.len, "ids": tokens, "logits": "last"}))?;
        self.verified(&r, rows)?;
        let vocab = r["vocab"].as_u64().unwrap_or(0) as usize;
        let mut bytes = vec![0u8; vocab * 4];
        self.exchange
            .read_exact_at(&mut bytes, (rows * self.width * 4) as u64)
            .map_err(ToolError::io(
                "reading the torch engine's logits".to_string(),
            ))?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    fn head_argmax(&mut self, hidden: &[f32]) -> Result<Vec<u32>, ToolError> {
        let rows = hidden.len() / self.hidden.max(1);
        if rows == 0 || rows * self.hidden != hidden.len() {
            return Err(crate::device::GpuError::Invalid(format!(
                "{} hidden values: not rows of {}",
                hidden.len(),
                self.hidden
            ))
            .into());
        }
        let bytes: Vec<u8> = hidden.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.exchange
            .write_all_at(&bytes, 0)
            .map_err(ToolError::io(
                "writing hidden states for the torch engine".to_string(),
            ))?;
        let r = self.child.call(&json!({"op": "head", "rows": rows}))?;
        Self::tokens(&r, rows)
    }
}

impl TorchVerifier {
    /// A forward's answer `r` for `rows` rows: the taps read from the exchange file.
    fn verified(&mut self, r: &serde_json::Value, rows: usize) -> Result<Verified, ToolError> {
        let argmax = Self::tokens(r, rows)?;
        let mut bytes = vec![0u8; rows * self.width * 4];
        self.exchange
            .read_exact_at(&mut bytes, 0)
            .map_err(ToolError::io("reading the torch engine's taps".to_string()))?;
        self.len += rows;
        Ok(Verified {
            argmax,
            taps: bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            margin: r["margin"].as_f64().unwrap_or(0.0) as f32,
            max_abs: r["max_abs"].as_f64().unwrap_or(0.0) as f32,
        })
    }
}

/// How many GPUs decoding holds the target over: none on the CPU (`gpu` false, or
/// DFLASH_DEVICE=cpu, as for training); else every GPU CUDA_VISIBLE_DEVICES names, the
/// target's layers split over them as a training target's are (`--gpus-per-target`),
/// and one when it names none.
pub fn decode_gpus(gpu: bool) -> usize {
    if !gpu || std::env::var("DFLASH_DEVICE").is_ok_and(|d| d == "cpu") {
        return 0;
    }
    crate::torch_engine::visible_gpus().max(1)
}

/// The devices to decode on: the CPU, or `gpus` GPUs (each said on stderr: a tool's
/// stdout is its report).
pub fn devices(gpus: usize) -> Result<Vec<Box<dyn crate::device::Device>>, ToolError> {
    if gpus == 0 {
        return Ok(vec![Box::new(crate::device::cpu::CpuDevice::new())]);
    }
    let mut out: Vec<Box<dyn crate::device::Device>> = Vec::with_capacity(gpus);
    for i in 0..gpus {
        let dev = crate::device::cuda::CudaDevice::open_ordinal(i)?;
        eprintln!("GPU: {}", crate::device::Device::describe(&dev));
        if i == 0 {
            for l in &dev.libraries {
                eprintln!("  {l}");
            }
        }
        out.push(Box::new(dev));
    }
    Ok(out)
}

/// What decoding a target needs to be opened.
pub struct Open<'a> {
    pub dir: &'a Path,
    pub taps: &'a [usize],
    /// On the torch engine, not the native one.
    pub torch: bool,
    /// [`decode_gpus`].
    pub gpus: usize,
    /// The native decoder's cache length and rows per forward.
    pub max_len: usize,
    pub block: usize,
}

/// The target to decode with (the torch child, or the native decoder on the CPU or over
/// [`Open::gpus`] GPUs), and with `frozen` its embedding and lm_head for a drafter.
pub fn open(
    o: &Open,
    frozen: bool,
) -> Result<(Box<dyn Verifier>, Option<crate::models::drafter::Frozen>), ToolError> {
    use crate::models::drafter::Frozen;
    use crate::models::target::Target;
    let cfg = dflash_shared::model_config::TargetConfig::load_any(o.dir)?;
    if o.torch {
        let frozen = match frozen {
            true => {
                let w = crate::models::weights::Weights::open(o.dir)?;
                Some(Frozen::load(&w, cfg.vocab_size, cfg.hidden_size)?)
            }
            false => None,
        };
        let t = TorchVerifier::start(o.dir, o.taps, cfg.hidden_size, o.gpus)?;
        eprintln!("target engine: torch ({})", t.ready());
        return Ok((Box::new(t), frozen));
    }
    let (target, head) = Target::load_decoder(o.dir, o.taps)?;
    let frozen = frozen.then(|| Frozen {
        embed: target.embed.clone(),
        lm_head: head.lm_head.clone(),
    });
    let devs = devices(o.gpus)?;
    let dec = match devs.len() {
        1 => {
            let dev = devs.into_iter().next().expect("one device");
            Decoder::new(dev, &target, &head, o.max_len, o.block)?
        }
        _ => {
            let dec = Decoder::new_split(devs, target, &head, o.max_len, o.block)?;
            let r: Vec<String> = dec
                .layer_ranges()
                .iter()
                .enumerate()
                .map(|(i, r)| format!("GPU {i}: layers {}-{}", r.start, r.end - 1))
                .collect();
            eprintln!("target split over {} GPUs: {}", r.len(), r.join(", "));
            dec
        }
    };
    Ok((Box::new(dec), frozen))
}
