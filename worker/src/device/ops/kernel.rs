//! The kernels of `cuda/kernels.cu` as one typed enum: each variant is one kernel with its
//! arguments by name, so a launch cannot name a kernel that does not exist, pass its
//! arguments in the wrong order or of the wrong kind. [`Kernel::args`] lays them out as
//! the kernel's C parameters (in order, each of its C type, buffers marked read, written
//! or both for the stream-order checker); the devices that run the CUDA source (a GPU, the
//! host device) launch the symbol [`Kernel::name`] with them, and the CPU device matches
//! on the variant (`device/cpu.rs`). A test checks every variant against the parameter
//! list that kernels.cu declares.
//!
//! Buffers are f32 unless said otherwise; `act` says whether a forward activation kernel
//! takes bf16 activations, or the cross-entropy's kernels bf16 logits and GEMM inputs (the
//! `_bf16` symbol). "rows" is the launch's grid: one block
//! per row for the row kernels.

use super::norm::Norm;
use super::gemm::GemmKernel;
use super::moe::Moe;
use super::loss::Loss;
use super::adamw::Optimizer;
use super::convert::Convert;
use super::swiglu::Swiglu;
use super::rope::Rope;
pub use super::Act;
use super::i32_of;
use crate::device::{Arg, DSlice};

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

/// One launch's kernel and arguments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kernel {
    /// RMSNorm, forward and backward (`ops/norm.rs`).
    Norm(Norm),
    /// The experts' grouped GEMM (`ops/gemm.rs`).
    GemmKernel(GemmKernel),
    /// A mixture of experts' routing (`ops/moe.rs`).
    Moe(Moe),
    /// The cross-entropy (`ops/loss.rs`).
    Loss(Loss),
    /// The gradient norm, AdamW, the checksum (`ops/adamw.rs`).
    Optimizer(Optimizer),
    /// Gathers, scatters, casts, element-wise (`ops/convert.rs`).
    Convert(Convert),
    /// SwiGLU (`ops/swiglu.rs`).
    Swiglu(Swiglu),
    /// Rotary embedding (`ops/rope.rs`).
    Rope(Rope),
    AttentionFwd {
        act: Act,
        a: Attention,
    },
    /// [`Kernel::AttentionFwd`] in FlashAttention-2's structure (CTAs of 4 warps × 16 rows;
    /// see kernels.cu), compiled for a head-dim bucket: the head dim is at most the
    /// bucket's and a multiple of 8.
    AttentionFa2Fwd {
        act: Act,
        dim: Fa2Dim,
        a: Attention,
    },
    AttentionBwd(AttentionGrad),
    /// The FlashAttention-2 backward's preparation (see kernels.cu): per (row, head) D =
    /// Σ_d dO∘O and Q, dO rounded to bf16 (zeros and 0 where its lse is −inf); per 32 rows
    /// the union and intersection of their key spans. Grid: ceil(tq·qh / 4) blocks of 128.
    AttentionBwdPrep {
        g: AttentionGrad,
        s: BwdScratch,
    },
    /// The backward in FlashAttention-2's structure (f32 activations and gradients, see
    /// kernels.cu) for a head-dim bucket, from [`Kernel::AttentionBwdPrep`]'s scratch;
    /// `tk` keys. Grid: ceil(tk / 64)·kvh blocks of 128 threads.
    AttentionFa2Bwd {
        dim: Fa2Dim,
        g: AttentionGrad,
        s: BwdScratch,
        tk: usize,
    },
}

impl From<Norm> for Kernel {
    fn from(k: Norm) -> Kernel {
        Kernel::Norm(k)
    }
}

impl From<Rope> for Kernel {
    fn from(k: Rope) -> Kernel {
        Kernel::Rope(k)
    }
}

impl From<Swiglu> for Kernel {
    fn from(k: Swiglu) -> Kernel {
        Kernel::Swiglu(k)
    }
}

impl From<Convert> for Kernel {
    fn from(k: Convert) -> Kernel {
        Kernel::Convert(k)
    }
}

impl From<Optimizer> for Kernel {
    fn from(k: Optimizer) -> Kernel {
        Kernel::Optimizer(k)
    }
}

impl From<Loss> for Kernel {
    fn from(k: Loss) -> Kernel {
        Kernel::Loss(k)
    }
}

impl From<Moe> for Kernel {
    fn from(k: Moe) -> Kernel {
        Kernel::Moe(k)
    }
}

impl From<GemmKernel> for Kernel {
    fn from(k: GemmKernel) -> Kernel {
        Kernel::GemmKernel(k)
    }
}

impl Kernel {
    /// The kernel's symbol in kernels.cu.
    pub fn name(&self) -> &'static str {
        let act = |a: Act, f32: &'static str, bf16: &'static str| match a {
            Act::F32 => f32,
            Act::Bf16 => bf16,
        };
        match *self {
            Kernel::Norm(k) => k.name(),
            Kernel::Convert(k) => k.name(),
            Kernel::Moe(k) => k.name(),
            Kernel::GemmKernel(k) => k.name(),
            Kernel::Swiglu(k) => k.name(),
            Kernel::Rope(k) => k.name(),
            Kernel::AttentionFwd { act: a, .. } => act(a, "attention_fwd", "attention_fwd_bf16"),
            Kernel::AttentionFa2Fwd { act: a, dim, .. } => match dim {
                Fa2Dim::D32 => act(a, "attention_fa2_fwd_hd32", "attention_fa2_fwd_bf16_hd32"),
                Fa2Dim::D64 => act(a, "attention_fa2_fwd_hd64", "attention_fa2_fwd_bf16_hd64"),
                Fa2Dim::D128 => act(a, "attention_fa2_fwd_hd128", "attention_fa2_fwd_bf16_hd128"),
            },
            Kernel::AttentionBwd(_) => "attention_bwd",
            Kernel::AttentionBwdPrep { .. } => "attention_bwd_prep",
            Kernel::AttentionFa2Bwd { dim, .. } => match dim {
                Fa2Dim::D32 => "attention_fa2_bwd_hd32",
                Fa2Dim::D64 => "attention_fa2_bwd_hd64",
                Fa2Dim::D128 => "attention_fa2_bwd_hd128",
            },
            Kernel::Loss(k) => k.name(),
            Kernel::Optimizer(k) => k.name(),
        }
    }

    /// Bytes of dynamic shared memory the kernel is launched with (its `DYNAMIC_SHARED`
    /// array in kernels.cu): the FlashAttention-2 forward's double-buffered K and V tiles
    /// (2 × 2 × 64 keys × (HD + 8) bf16), the bf16 grouped GEMM's tiles, the RMSNorm
    /// backward's row of weight-gradient shares (d f32); 0 for the others.
    pub fn dynamic_shared_bytes(&self) -> u32 {
        match *self {
            Kernel::AttentionFa2Fwd { dim, .. } => 2 * 2 * 64 * (dim.head_dim() + 8) * 2,
            Kernel::GemmKernel(k) => k.dynamic_shared_bytes(),
            Kernel::Norm(k) => k.dynamic_shared_bytes(),
            _ => 0,
        }
    }

    /// The dynamic shared memory of the kernel named `name` (see
    /// [`dynamic_shared_bytes`](Self::dynamic_shared_bytes)).
    pub fn dynamic_shared_bytes_of(name: &str) -> u32 {
        let b = DSlice { ptr: 0, bytes: 0 };
        Kernel::every(b)
            .iter()
            .find(|k| k.name() == name)
            .map_or(0, Kernel::dynamic_shared_bytes)
    }

    /// The arguments as the kernel's C parameters, in order: each buffer marked as the
    /// kernel reads it, writes it, or both; each scalar of its parameter's C type.
    pub fn args(&self) -> Vec<Arg> {
        self.row_args()
            .or_else(|| self.norm_args())
            .or_else(|| self.moe_args())
            .or_else(|| self.swiglu_args())
            .or_else(|| self.attention_args())
            .or_else(|| self.loss_and_optimizer_args())
            .expect("every kernel is of one of the six families (tested)")
    }

    /// The mixture-of-experts kernels' arguments.
    fn moe_args(&self) -> Option<Vec<Arg>> {
        use Arg::{R, RW, W};
        Some(match *self {
            _ => return None,
        })
    }

    /// The element-wise and row kernels' arguments.
    fn row_args(&self) -> Option<Vec<Arg>> {
        use Arg::{F32, R, RW, W};
        Some(match *self {
            _ => return None,
        })
    }

    /// The families' kernels' arguments.
    fn norm_args(&self) -> Option<Vec<Arg>> {
        match self {
            Kernel::Norm(k) => Some(k.args()),
            Kernel::GemmKernel(k) => Some(k.args()),
            Kernel::Moe(k) => Some(k.args()),
            Kernel::Loss(k) => Some(k.args()),
            Kernel::Optimizer(k) => Some(k.args()),
            Kernel::Convert(k) => Some(k.args()),
            Kernel::Swiglu(k) => Some(k.args()),
            Kernel::Rope(k) => Some(k.args()),
            _ => None,
        }
    }

    /// The SwiGLU kernels' arguments.
    fn swiglu_args(&self) -> Option<Vec<Arg>> {
        use Arg::{R, W};
        Some(match *self {
            _ => return None,
        })
    }

    fn attention_args(&self) -> Option<Vec<Arg>> {
        use Arg::{R, RW, W};
        Some(match *self {
            Kernel::AttentionFwd { a, .. } | Kernel::AttentionFa2Fwd { a, .. } => vec![
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
            Kernel::AttentionBwd(g) => vec![
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
            Kernel::AttentionBwdPrep { g, s } => vec![
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
            Kernel::AttentionFa2Bwd { g, s, tk, .. } => vec![
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
            _ => return None,
        })
    }

    /// The cross-entropy's, the gradient norm's and the optimizer's arguments.
    fn loss_and_optimizer_args(&self) -> Option<Vec<Arg>> {
        use Arg::{F32, R, RW, W};
        Some(match *self {
            _ => return None,
        })
    }

    /// One launch of every kernel (each of its symbols), all buffers `b`: for the tests
    /// that hold the enum to kernels.cu.
    pub fn every(b: DSlice) -> Vec<Kernel> {
        let attention = Attention {
            out: b,
            lse: b,
            q: b,
            k: b,
            v: b,
            spans: b,
            ..Attention::shape_of(1, 1, 1, 1)
        };
        let mut all = Vec::new();
        for act in [Act::F32, Act::Bf16] {
            all.extend(Kernel::every_activation(b, act, attention));
            all.extend(Kernel::every_moe(b, act));
        }
        for act in [Act::F32, Act::Bf16] {
            all.extend(Fa2Dim::ALL.into_iter().map(|dim| Kernel::AttentionFa2Fwd {
                act,
                dim,
                a: attention,
            }));
        }
        let grad = AttentionGrad {
            fwd: attention,
            dout: b,
            dq: b,
            dk: b,
            dv: b,
        };
        let s = BwdScratch::at(b, 1, 1, 1);
        all.push(Kernel::AttentionBwdPrep { g: grad, s });
        all.extend(Fa2Dim::ALL.into_iter().map(|dim| Kernel::AttentionFa2Bwd {
            dim,
            g: grad,
            s,
            tk: 1,
        }));
        all.extend(Norm::every(b).into_iter().map(Kernel::Norm));
        all.extend(GemmKernel::every(b).into_iter().map(Kernel::GemmKernel));
        all.extend(Moe::every(b).into_iter().map(Kernel::Moe));
        all.extend(Loss::every(b).into_iter().map(Kernel::Loss));
        all.extend(Optimizer::every(b).into_iter().map(Kernel::Optimizer));
        all.extend(Convert::every(b).into_iter().map(Kernel::Convert));
        all.extend(Swiglu::every(b).into_iter().map(Kernel::Swiglu));
        all.extend(Rope::every(b).into_iter().map(Kernel::Rope));
        all.extend(Kernel::every_permute(b));
        all.extend(Kernel::every_other(b, attention));
        all
    }

    /// The three launches of the permutation into expert order.
    fn every_permute(b: DSlice) -> Vec<Kernel> {
        vec![
        ]
    }

    /// The mixture-of-experts kernels with an f32 and a bf16 symbol, at `act`.
    fn every_moe(b: DSlice, act: Act) -> Vec<Kernel> {
        vec![
        ]
    }

    /// The kernels with an f32 and a bf16 symbol, at `act`.
    fn every_activation(b: DSlice, act: Act, attention: Attention) -> Vec<Kernel> {
        vec![
            Kernel::AttentionFwd { act, a: attention },
        ]
    }

    fn every_other(b: DSlice, attention: Attention) -> Vec<Kernel> {
        vec![
            Kernel::AttentionBwd(AttentionGrad {
                fwd: attention,
                dout: b,
                dq: b,
                dk: b,
                dv: b,
            }),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::nvrtc::{kernel_names, KERNELS_CU};

    /// A kernel's parameters as kernels.cu declares them: `R` a const pointer (read), `W`
    /// a pointer it may write, `i` int, `l` long, `f` float.
    fn declared(name: &str) -> String {
        let head = format!("extern \"C\" __global__ void {name}(");
        let at = KERNELS_CU.find(&head).expect("declared") + head.len();
        let params = &KERNELS_CU[at..at + KERNELS_CU[at..].find(')').expect("closed")];
        params
            .split(',')
            .map(|p| {
                let p = p.trim();
                match () {
                    _ if p.contains('*') && p.starts_with("const ") => 'R',
                    _ if p.contains('*') => 'W',
                    _ if p.starts_with("long ") => 'l',
                    _ if p.starts_with("int ") || p.starts_with("unsigned ") => 'i',
                    _ if p.starts_with("float ") => 'f',
                    _ => panic!("{name}: parameter {p:?} of a kind the test does not know"),
                }
            })
            .collect()
    }

    fn passed(k: &Kernel) -> String {
        k.args()
            .iter()
            .map(|a| match a {
                Arg::R(_) => 'R',
                Arg::W(_) | Arg::RW(_) | Arg::Null => 'W',
                Arg::I32(_) | Arg::U32(_) => 'i',
                Arg::I64(_) => 'l',
                Arg::F32(_) => 'f',
            })
            .collect()
    }

    #[test]
    fn every_kernel_of_kernels_cu_is_one_variant_with_its_parameters_in_order() {
        let b = DSlice { ptr: 0, bytes: 0 };
        let all = Kernel::every(b);
        let mut ours: Vec<&str> = all.iter().map(|k| k.name()).collect();
        ours.sort_unstable();
        let mut cu = kernel_names(KERNELS_CU);
        cu.sort_unstable();
        assert_eq!(ours, cu, "the enum's symbols are kernels.cu's, each once");
        for k in &all {
            assert_eq!(passed(k), declared(k.name()), "{}", k.name());
        }
    }

    #[test]
    fn the_parameter_check_sees_a_swapped_or_misread_argument() {
        // What the test above would catch: a read buffer passed where the kernel writes,
        // and a long passed as an int.
        assert_eq!(declared("add_inplace"), "WRl");
        let b = DSlice { ptr: 0, bytes: 0 };
        let k = Kernel::Convert(Convert::AddInplace {
            act: Act::F32,
            x: b,
            y: b,
            n: 1,
        });
        assert_eq!(passed(&k), "WRl");
        let swapped = [Arg::R(b), Arg::RW(b), Arg::I32(1)];
        let kinds: String = swapped
            .iter()
            .map(|a| match a {
                Arg::R(_) => 'R',
                Arg::I32(_) => 'i',
                _ => 'W',
            })
            .collect();
        assert_ne!(kinds, declared("add_inplace"));
    }
}
