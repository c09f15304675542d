//! One launch's kernel: a kernel of one of the op families (`ops/<family>.rs`, each beside
//! its `cuda/<family>.cuh`), with its arguments by name, so a launch cannot name a kernel
//! that does not exist, pass its arguments in the wrong order or of the wrong kind.
//! [`Kernel::args`] lays them out as the kernel's C parameters (in order, each of its C
//! type, buffers marked read, written or both for the stream-order checker); the devices
//! that run the CUDA source (a GPU, the host device) launch the symbol [`Kernel::name`]
//! with them, and the CPU device runs the family's CPU body (`Kernel::run_cpu`). A test
//! checks every kernel against the parameter list that the CUDA source declares.
//!
//! Buffers are f32 unless said otherwise; `act` says whether a kernel takes bf16
//! activations (the `_bf16` symbol). "rows" is the launch's grid: one block per row for
//! the row kernels.

use super::adamw::Optimizer;
use super::attention::AttentionKernel;
use super::convert::Convert;
use super::gemm::GemmKernel;
use super::loss::Loss;
use super::moe::Moe;
use super::norm::Norm;
use super::on_cpu::Widened;
use super::rope::Rope;
use super::swiglu::Swiglu;
pub use super::DType;
use crate::device::{Arg, DSlice, Result};

/// The kernel enum over the families, each variant one family's enum, and what every
/// family answers for its kernels (a new family is one line here).
macro_rules! families {
    ($($(#[$doc:meta])* $variant:ident($ty:ident),)*) => {
        /// One launch's kernel and arguments.
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub enum Kernel {
            $($(#[$doc])* $variant($ty),)*
        }

        $(impl From<$ty> for Kernel {
            fn from(k: $ty) -> Kernel {
                Kernel::$variant(k)
            }
        })*

        impl Kernel {
            /// The kernel's symbol in the CUDA source.
            pub fn name(&self) -> &'static str {
                match self {
                    $(Kernel::$variant(k) => k.name(),)*
                }
            }

            /// The arguments as the kernel's C parameters, in order: each buffer marked as
            /// the kernel reads it, writes it, or both; each scalar of its parameter's C type.
            pub fn args(&self) -> Vec<Arg> {
                match self {
                    $(Kernel::$variant(k) => k.args(),)*
                }
            }

            /// Bytes of dynamic shared memory the kernel is launched with (its
            /// `DYNAMIC_SHARED` array in the CUDA source; 0 for most).
            pub fn dynamic_shared_bytes(&self) -> u32 {
                match self {
                    $(Kernel::$variant(k) => k.dynamic_shared_bytes(),)*
                }
            }

            /// One launch of every kernel (each of its symbols), all buffers `b`: for the
            /// tests that hold the enums to the CUDA source.
            pub fn every(b: DSlice) -> Vec<Kernel> {
                let mut all = Vec::new();
                $(all.extend($ty::every(b).into_iter().map(Kernel::$variant));)*
                all
            }

            /// The f32 kernel a bf16 one runs as on the CPU device, over `w`'s
            /// temporaries; `None` for a kernel that is f32 already.
            ///
            /// # Safety
            /// The kernel's buffers are the CPU device's memory.
            pub(crate) unsafe fn as_f32(&self, w: &mut Widened) -> Option<Kernel> {
                match self {
                    $(Kernel::$variant(k) => k.as_f32(w).map(Kernel::$variant),)*
                }
            }

            /// The kernel on the CPU device (f32: see [`as_f32`](Self::as_f32)) over
            /// `rows` (the launch's grid), with up to `threads` threads.
            ///
            /// # Safety
            /// The buffers are the CPU device's memory, not aliased (but as
            /// [`Norm::in_place`] allows).
            pub(crate) unsafe fn run_cpu(&self, rows: usize, threads: usize) -> Result<()> {
                match self {
                    $(Kernel::$variant(k) => k.run_cpu(rows, threads),)*
                }
            }
        }
    };
}

families! {
    /// Gathers, scatters, casts, element-wise (`ops/convert.rs`).
    Convert(Convert),
    /// SwiGLU (`ops/swiglu.rs`).
    Swiglu(Swiglu),
    /// A mixture of experts' routing (`ops/moe.rs`).
    Moe(Moe),
    /// RMSNorm, forward and backward (`ops/norm.rs`).
    Norm(Norm),
    /// Rotary embedding (`ops/rope.rs`).
    Rope(Rope),
    /// Attention (`ops/attention.rs`).
    Attention(AttentionKernel),
    /// The cross-entropy (`ops/loss.rs`).
    Loss(Loss),
    /// The gradient norm, AdamW, the checksum (`ops/adamw.rs`).
    Optimizer(Optimizer),
    /// The experts' grouped GEMM (`ops/gemm.rs`).
    Gemm(GemmKernel),
}

impl Kernel {
    /// The dynamic shared memory of the kernel named `name` (see
    /// [`dynamic_shared_bytes`](Self::dynamic_shared_bytes)).
    pub fn dynamic_shared_bytes_of(name: &str) -> u32 {
        let b = DSlice { ptr: 0, bytes: 0 };
        Kernel::every(b)
            .iter()
            .find(|k| k.name() == name)
            .map_or(0, Kernel::dynamic_shared_bytes)
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
        let k = Kernel::Convert(super::super::convert::Convert::AddInplace {
            act: DType::F32,
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
