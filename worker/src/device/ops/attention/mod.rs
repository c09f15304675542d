//! Attention over explicit key spans (`cuda/attention.cuh`), forward and backward: the
//! tensor-core kernels and FlashAttention-2's; their arguments, their launches on [`Ops`],
//! and their CPU bodies (`attention/cpu.rs`: tiles of query rows and keys over the CPU's
//! threads).

mod cpu;

use super::on_cpu::Widened;
use super::{i32_of, DType, Ops};
use crate::device::{Arg, DSlice, GpuError, Result};
use cpu::{attention_bwd, attention_fwd, attention_prep};

/// Attention, forward and backward, on tensor cores: query rows of one head per block of
/// one warp (`ATTN_MMA_ROWS` in attention.cuh).
const ATTN_MMA_ROWS: usize = 16;

/// The FlashAttention-2 forward's CTA: 4 warps of 16 query rows of one head
/// (`FA2_ROWS`, `FA2_THREADS` in attention.cuh).
const FA2_ROWS: usize = 64;
const FA2_THREADS: u32 = 128;
/// Keys per CTA of the FlashAttention-2 backward (`FA2B_KEYS` in attention.cuh).
const FA2_BWD_KEYS: usize = 64;

/// Blocks of one warp, ATTN_MMA_ROWS query rows of one head each.
fn attention_grid(tq: usize, qh: usize) -> u32 {
    (tq.div_ceil(ATTN_MMA_ROWS) * qh).max(1) as u32
}

fn check_heads(qh: usize, kvh: usize, hd: usize) -> Result<()> {
    if hd == 0 || hd > 256 || kvh == 0 || qh % kvh != 0 {
        return Err(GpuError::Invalid(format!("attention: {qh} query heads, {kvh} KV heads, head_dim {hd} (head_dim ≤ 256, heads a multiple of KV heads)")));
    }
    Ok(())
}
/// Attention over key spans: `q`/`out` `[tq, qh·hd]`, `k`/`v` `[keys, kvh·hd]`, `spans`
/// four i32 per query row (two key ranges), `lse` one f32 per (row, head).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attention {
    pub out: DSlice,
    pub lse: DSlice,
    pub q: DSlice,
    pub k: DSlice,
    pub v: DSlice,
    pub spans: DSlice,
    pub tq: usize,
    pub qh: usize,
    pub kvh: usize,
    pub hd: usize,
}

/// The head dims the FlashAttention-2 forward is compiled for (a smaller head dim is
/// padded with zeros to its bucket's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fa2Dim {
    D32,
    D64,
    D128,
}

impl Fa2Dim {
    pub const ALL: [Fa2Dim; 3] = [Fa2Dim::D32, Fa2Dim::D64, Fa2Dim::D128];

    /// The largest head dim of the bucket (the kernel's `HD`).
    pub fn head_dim(self) -> u32 {
        match self {
            Fa2Dim::D32 => 32,
            Fa2Dim::D64 => 64,
            Fa2Dim::D128 => 128,
        }
    }

    /// The bucket of an attention call, if the FlashAttention-2 kernel takes it: a head dim
    /// that is a multiple of 8 up to 128, and 16-byte aligned operands (its cp.async copies
    /// 16 bytes at a time), at either activation type.
    pub fn for_call(a: &Attention) -> Option<Fa2Dim> {
        let aligned = [a.q, a.k, a.v, a.out].iter().all(|s| s.ptr % 16 == 0);
        if a.hd == 0 || a.hd % 8 != 0 || !aligned {
            return None;
        }
        match a.hd {
            0..=32 => Some(Fa2Dim::D32),
            33..=64 => Some(Fa2Dim::D64),
            65..=128 => Some(Fa2Dim::D128),
            _ => None,
        }
    }

    /// The bucket of an attention backward, if the FlashAttention-2 backward takes it:
    /// where the forward would, with its dO and key spans 16-byte aligned too (loaded 16
    /// bytes at a time). The backward's activations are f32 at either forward precision.
    pub fn for_backward(g: &AttentionGrad) -> Option<Fa2Dim> {
        let aligned = [g.dout, g.fwd.spans].iter().all(|s| s.ptr % 16 == 0);
        aligned.then(|| Fa2Dim::for_call(&g.fwd)).flatten()
    }
}

impl Attention {
    /// A call's shape alone (no buffers): what picks or names a kernel for a head dim.
    pub fn shape_of(tq: usize, qh: usize, kvh: usize, hd: usize) -> Attention {
        let b = DSlice { ptr: 0, bytes: 0 };
        Attention {
            out: b,
            lse: b,
            q: b,
            k: b,
            v: b,
            spans: b,
            tq,
            qh,
            kvh,
            hd,
        }
    }
}

/// The backward of [`Attention`]: `dq`, `dk`, `dv` accumulate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionGrad {
    pub fwd: Attention,
    pub dout: DSlice,
    pub dq: DSlice,
    pub dk: DSlice,
    pub dv: DSlice,
}

/// The FlashAttention-2 backward's scratch, carved from one buffer ([`BwdScratch::at`]):
/// Q and dO in bf16 (`[tq, qh·hd]` each), the span summaries (8 i32 per 32 query rows)
/// and D (f32 per row and head).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BwdScratch {
    pub q16: DSlice,
    pub do16: DSlice,
    pub tiles: DSlice,
    pub delta: DSlice,
}

impl BwdScratch {
    /// Bytes of scratch for `tq` rows of `qh` heads of `hd` (a multiple of 8): every part
    /// starts 16-byte aligned when the buffer does.
    pub fn bytes(tq: usize, qh: usize, hd: usize) -> usize {
        let (qb, tiles) = (tq * qh * hd * 2, tq.div_ceil(32) * 8 * 4);
        2 * qb + tiles + tq * qh * 4
    }

    /// The parts of `b` (at least [`bytes`](Self::bytes) long; a shorter one gives parts
    /// cut short, which the launch checks refuse).
    pub fn at(b: DSlice, tq: usize, qh: usize, hd: usize) -> BwdScratch {
        let qb = tq * qh * hd * 2;
        let tiles = tq.div_ceil(32) * 8 * 4;
        let part = |off: usize, len: usize| DSlice {
            ptr: b.ptr + off as u64,
            bytes: len.min(b.bytes.saturating_sub(off)),
        };
        BwdScratch {
            q16: part(0, qb),
            do16: part(qb, qb),
            tiles: part(2 * qb, tiles),
            delta: part(2 * qb + tiles, tq * qh * 4),
        }
    }
}

/// The attention kernels, each with its arguments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttentionKernel {
    Fwd {
        act: DType,
        a: Attention,
    },
    /// [`AttentionKernel::Fwd`] in FlashAttention-2's structure (CTAs of 4 warps × 16 rows;
    /// see attention.cuh), compiled for a head-dim bucket: the head dim is at most the
    /// bucket's and a multiple of 8.
    Fa2Fwd {
        act: DType,
        dim: Fa2Dim,
        a: Attention,
    },
    Bwd(AttentionGrad),
    /// The FlashAttention-2 backward's preparation (see attention.cuh): per (row, head) D =
    /// Σ_d dO∘O and Q, dO rounded to bf16 (zeros and 0 where its lse is −inf); per 32 rows
    /// the union and intersection of their key spans. Grid: ceil(tq·qh / 4) blocks of 128.
    BwdPrep {
        g: AttentionGrad,
        s: BwdScratch,
    },
    /// The backward in FlashAttention-2's structure (f32 activations and gradients, see
    /// attention.cuh) for a head-dim bucket, from [`AttentionKernel::BwdPrep`]'s scratch;
    /// `tk` keys. Grid: ceil(tk / 64)·kvh blocks of 128 threads.
    Fa2Bwd {
        dim: Fa2Dim,
        g: AttentionGrad,
        s: BwdScratch,
        tk: usize,
    },
}

impl AttentionKernel {
    /// The kernel's symbol in the CUDA source.
    pub fn name(&self) -> &'static str {
        match *self {
            AttentionKernel::Fwd { act: a, .. } => a.pick("attention_fwd", "attention_fwd_bf16"),
            AttentionKernel::Fa2Fwd { act: a, dim, .. } => match dim {
                Fa2Dim::D32 => a.pick("attention_fa2_fwd_hd32", "attention_fa2_fwd_bf16_hd32"),
                Fa2Dim::D64 => a.pick("attention_fa2_fwd_hd64", "attention_fa2_fwd_bf16_hd64"),
                Fa2Dim::D128 => a.pick("attention_fa2_fwd_hd128", "attention_fa2_fwd_bf16_hd128"),
            },
            AttentionKernel::Bwd(_) => "attention_bwd",
            AttentionKernel::BwdPrep { .. } => "attention_bwd_prep",
            AttentionKernel::Fa2Bwd { dim, .. } => match dim {
                Fa2Dim::D32 => "attention_fa2_bwd_hd32",
                Fa2Dim::D64 => "attention_fa2_bwd_hd64",
                Fa2Dim::D128 => "attention_fa2_bwd_hd128",
            },
        }
    }

    /// The arguments as the kernel's C parameters, in order: each buffer marked as the
    /// kernel reads it, writes it, or both; each scalar of its parameter's C type.
    pub fn args(&self) -> Vec<Arg> {
        use Arg::{R, RW, W};
        match *self {
            AttentionKernel::Fwd { a, .. } | AttentionKernel::Fa2Fwd { a, .. } => vec![
                W(a.out),
                W(a.lse),
                R(a.q),
                R(a.k),
                R(a.v),
                R(a.spans),
                i32_of(a.tq),
                i32_of(a.qh),
                i32_of(a.kvh),
                i32_of(a.hd),
            ],
            AttentionKernel::Bwd(g) => vec![
                RW(g.dq),
                RW(g.dk),
                RW(g.dv),
                R(g.dout),
                R(g.fwd.out),
                R(g.fwd.lse),
                R(g.fwd.q),
                R(g.fwd.k),
                R(g.fwd.v),
                R(g.fwd.spans),
                i32_of(g.fwd.tq),
                i32_of(g.fwd.qh),
                i32_of(g.fwd.kvh),
                i32_of(g.fwd.hd),
            ],
            AttentionKernel::BwdPrep { g, s } => vec![
                W(s.delta),
                W(s.q16),
                W(s.do16),
                W(s.tiles),
                R(g.dout),
                R(g.fwd.out),
                R(g.fwd.lse),
                R(g.fwd.q),
                R(g.fwd.spans),
                i32_of(g.fwd.tq),
                i32_of(g.fwd.qh),
                i32_of(g.fwd.hd),
            ],
            AttentionKernel::Fa2Bwd { g, s, tk, .. } => vec![
                RW(g.dq),
                RW(g.dk),
                RW(g.dv),
                R(s.delta),
                R(s.q16),
                R(s.do16),
                R(s.tiles),
                R(g.fwd.lse),
                R(g.fwd.k),
                R(g.fwd.v),
                R(g.fwd.spans),
                i32_of(g.fwd.tq),
                i32_of(tk),
                i32_of(g.fwd.qh),
                i32_of(g.fwd.kvh),
                i32_of(g.fwd.hd),
            ],
        }
    }

    /// Bytes of dynamic shared memory the kernel is launched with.
    pub fn dynamic_shared_bytes(&self) -> u32 {
        match *self {
            AttentionKernel::Fa2Fwd { dim, .. } => 2 * 2 * 64 * (dim.head_dim() + 8) * 2,
            _ => 0,
        }
    }

    /// One launch of each kernel (each of its symbols), all buffers `b`.
    pub fn every(b: DSlice) -> Vec<AttentionKernel> {
        let a = Attention {
            out: b,
            lse: b,
            q: b,
            k: b,
            v: b,
            spans: b,
            ..Attention::shape_of(1, 1, 1, 1)
        };
        let g = AttentionGrad {
            fwd: a,
            dout: b,
            dq: b,
            dk: b,
            dv: b,
        };
        let s = BwdScratch::at(b, 1, 1, 1);
        let mut all = vec![AttentionKernel::Bwd(g), AttentionKernel::BwdPrep { g, s }];
        for act in [DType::F32, DType::Bf16] {
            all.push(AttentionKernel::Fwd { act, a });
            all.extend(
                Fa2Dim::ALL
                    .into_iter()
                    .map(|dim| AttentionKernel::Fa2Fwd { act, dim, a }),
            );
        }
        all.extend(
            Fa2Dim::ALL
                .into_iter()
                .map(|dim| AttentionKernel::Fa2Bwd { dim, g, s, tk: 1 }),
        );
        all
    }

    /// The kernel on the CPU, over `threads` threads: the FlashAttention-2 kernels compute
    /// what the plain ones do (the backward's delta is the plain one's own rowsum(dO∘O)).
    ///
    /// # Safety
    /// The buffers are the CPU device's memory, not aliased.
    pub(crate) unsafe fn run_cpu(&self, _rows: usize, threads: usize) -> Result<()> {
        match *self {
            AttentionKernel::Fwd { a, .. } | AttentionKernel::Fa2Fwd { a, .. } => {
                attention_fwd(threads, &a)
            }
            AttentionKernel::Bwd(g) | AttentionKernel::Fa2Bwd { g, .. } => {
                attention_bwd(threads, &g)
            }
            AttentionKernel::BwdPrep { g, s } => attention_prep(&g, &s),
        }
    }

    /// The f32 kernel a bf16 one runs as on the CPU, over `w`'s temporaries; `None` for a
    /// kernel that is f32 already.
    ///
    /// # Safety
    /// The kernel's buffers are the CPU device's memory.
    pub(crate) unsafe fn as_f32(&self, w: &mut Widened) -> Option<AttentionKernel> {
        let mut k = *self;
        match &mut k {
            AttentionKernel::Fwd { act, a } if *act == DType::Bf16 => {
                a.out = w.output(a.out);
                (a.q, a.k, a.v) = (w.input(a.q), w.input(a.k), w.input(a.v));
                *act = DType::F32;
            }
            // The FlashAttention-2 forward computes what the plain one does.
            AttentionKernel::Fa2Fwd { act, a, .. } => {
                if *act == DType::Bf16 {
                    a.out = w.output(a.out);
                    (a.q, a.k, a.v) = (w.input(a.q), w.input(a.k), w.input(a.v));
                }
                return Some(AttentionKernel::Fwd {
                    act: DType::F32,
                    a: *a,
                });
            }
            _ => return None,
        }
        Some(k)
    }
}

impl Ops {
    /// Attention of `a.tq` query rows over key spans (`a.spans`: 4 i32 per row, see
    /// attention.cuh); writes `a.out` and the log-sum-exp per (row, head) into `a.lse` for
    /// the backward. The activations are of the ops' type ([`Ops::act`]).
    pub fn attention(&mut self, a: Attention) -> Result<()> {
        check_heads(a.qh, a.kvh, a.hd)?;
        let act = self.act();
        match Fa2Dim::for_call(&a) {
            Some(dim) => self.launch(
                AttentionKernel::Fa2Fwd { act, dim, a },
                (a.tq.div_ceil(FA2_ROWS) * a.qh).max(1) as u32,
                FA2_THREADS,
            ),
            None => self.launch(
                AttentionKernel::Fwd { act, a },
                attention_grid(a.tq, a.qh),
                32,
            ),
        }
    }

    /// Backward of [`attention`](Self::attention) (f32): `g.dq`, `g.dk`, `g.dv`
    /// accumulate. `scratch` (at least
    /// [`attention_backward_scratch`](Self::attention_backward_scratch) f32, 16-byte
    /// aligned) is the FlashAttention-2 backward's.
    pub fn attention_backward(&mut self, g: AttentionGrad, scratch: DSlice) -> Result<()> {
        let Attention {
            k, tq, qh, kvh, hd, ..
        } = g.fwd;
        check_heads(qh, kvh, hd)?;
        let Some(dim) = Fa2Dim::for_backward(&g) else {
            return self.launch(AttentionKernel::Bwd(g), attention_grid(tq, qh), 32);
        };
        let need = BwdScratch::bytes(tq, qh, hd);
        if scratch.bytes < need || scratch.ptr % 16 != 0 {
            return Err(GpuError::Invalid(format!(
                "attention backward: its scratch is {} bytes at {:#x}; {tq} rows × {qh} heads of {hd} need {need}, 16-byte aligned",
                scratch.bytes, scratch.ptr
            )));
        }
        let (s, tk) = (
            BwdScratch::at(scratch, tq, qh, hd),
            k.len_f32() / (kvh * hd),
        );
        self.launch(
            AttentionKernel::BwdPrep { g, s },
            (tq * qh).div_ceil(4).max(1) as u32,
            FA2_THREADS,
        )?;
        self.launch(
            AttentionKernel::Fa2Bwd { dim, g, s, tk },
            (tk.div_ceil(FA2_BWD_KEYS) * kvh).max(1) as u32,
            FA2_THREADS,
        )
    }

    /// The f32 of scratch [`attention_backward`](Self::attention_backward) needs for
    /// `tq` query rows of `qh` heads of `hd`.
    pub fn attention_backward_scratch(tq: usize, qh: usize, hd: usize) -> usize {
        BwdScratch::bytes(tq, qh, hd).div_ceil(4)
    }
}
