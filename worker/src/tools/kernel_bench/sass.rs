//! Reading `cuobjdump -sass` and `cuobjdump -res-usage` output: each kernel's
//! instructions (address, opcode, branch target) and its resources, and the instruction
//! mix of its main loop.
//!
//! A loop is the address range of a backward branch: `BRA` at address b to a target
//! t ≤ b covers [t, b]. The **main loop** is the loop holding the most tensor-core MMAs
//! (`HMMA`), the innermost of those that tie: in a FlashAttention-2 kernel the loop over
//! K/V tiles (its head-dim products unrolled), in the current attention kernels the same
//! tile loop, around the short head-dim loops that hold 8 of its MMAs. Counts are static
//! (each instruction of the range once; a nested loop's body counts once however often it
//! runs), without `NOP`s (padding). The innermost loop holding an HMMA is reported beside
//! it ([`LoopMix`] `innermost`), which for the current attention is that head-dim loop
//! alone, no softmax and no staging, so it says little about the kernel's speed.

use std::collections::BTreeMap;

/// One SASS instruction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insn {
    pub addr: u64,
    /// The opcode without its modifiers (`HMMA` of `HMMA.16816.F32.BF16`).
    pub op: String,
    /// A `BRA`'s target address.
    pub target: Option<u64>,
    /// Under a predicate (`@P0 ...`).
    pub guarded: bool,
}

/// A loop's static instruction mix.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct LoopMix {
    pub start: u64,
    pub end: u64,
    /// Instructions in [start, end], NOPs not counted.
    pub instructions: usize,
    pub mma: usize,
    /// `MUFU` (exp2, rcp, ...: the special-function unit, a quarter of the issue rate).
    pub mufu: usize,
    /// `LDL` and `STL`: loads from and stores to local memory (the stack frame). In a main
    /// loop they are register spills (or a local array) paid on every iteration.
    pub local_loads: usize,
    pub local_stores: usize,
    /// Backward branches strictly inside it (nested loops).
    pub nested_loops: usize,
}

impl LoopMix {
    pub fn non_mma_per_mma(&self) -> f64 {
        if self.mma == 0 {
            return f64::NAN;
        }
        (self.instructions - self.mma) as f64 / self.mma as f64
    }
}

/// The kernels of one `cuobjdump -sass` listing, by name, each its instructions in order.
pub fn parse_sass(text: &str) -> BTreeMap<String, Vec<Insn>> {
    let mut out: BTreeMap<String, Vec<Insn>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        if let Some((_, name)) = line.split_once("Function : ") {
            let name = name.trim().to_string();
            out.entry(name.clone()).or_default();
            current = Some(name);
            continue;
        }
        let (Some(name), Some(insn)) = (&current, parse_insn(line)) else {
            continue;
        };
        out.entry(name.clone()).or_default().push(insn);
    }
    out
}

/// `/*01d0*/  @P0 HMMA.16816.F32.BF16 R4, R4, R2, R16 ;  /* 0x... */` → the instruction.
/// Encoding-only lines (`/* 0x000fe2... */`) and anything else give None.
fn parse_insn(line: &str) -> Option<Insn> {
    let rest = line.trim_start().strip_prefix("/*")?;
    let (addr, rest) = rest.split_once("*/")?;
    if addr.is_empty() || !addr.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let addr = u64::from_str_radix(addr, 16).ok()?;
    let body = rest.split_once(';')?.0.trim();
    let mut tokens = body.split_whitespace().peekable();
    let guarded = tokens.peek()?.starts_with('@');
    if guarded {
        tokens.next();
    }
    let opcode = tokens.next()?;
    let op = opcode.split('.').next()?.to_string();
    let target = if op == "BRA" {
        body.split([' ', ','])
            .rev()
            .find_map(|t| t.strip_prefix("0x"))
            .and_then(|h| u64::from_str_radix(h, 16).ok())
    } else {
        None
    };
    Some(Insn {
        addr,
        op,
        target,
        guarded,
    })
}

/// Every loop of a kernel (see the module docs), in address order of their branches. A
/// backward branch over an unguarded `EXIT` is no loop: it is out-of-line code (a
/// `BRA.DIV` fallback placed after the exit) jumping back into the kernel.
pub fn loops(insns: &[Insn]) -> Vec<LoopMix> {
    let exits: Vec<u64> = insns
        .iter()
        .filter(|i| i.op == "EXIT" && !i.guarded)
        .map(|i| i.addr)
        .collect();
    let backward: Vec<(u64, u64)> = insns
        .iter()
        .filter_map(|i| i.target.filter(|&t| t <= i.addr).map(|t| (t, i.addr)))
        .filter(|&(t, b)| !exits.iter().any(|&x| x >= t && x <= b))
        .collect();
    backward
        .iter()
        .map(|&(start, end)| {
            let body = insns
                .iter()
                .filter(|i| i.addr >= start && i.addr <= end && i.op != "NOP");
            let (mut instructions, mut mma, mut mufu) = (0, 0, 0);
            let (mut local_loads, mut local_stores) = (0, 0);
            for i in body {
                instructions += 1;
                mma += (i.op == "HMMA") as usize;
                mufu += (i.op == "MUFU") as usize;
                local_loads += (i.op == "LDL") as usize;
                local_stores += (i.op == "STL") as usize;
            }
            let nested_loops = backward
                .iter()
                .filter(|&&(s, e)| (s, e) != (start, end) && s >= start && e < end)
                .count();
            LoopMix {
                start,
                end,
                instructions,
                mma,
                mufu,
                local_loads,
                local_stores,
                nested_loops,
            }
        })
        .collect()
}

/// `LDL` and `STL` in a whole kernel: its accesses to local memory (the stack frame).
/// Registers spilled under pressure, a local array indexed at run time, or registers
/// saved around a call: none is free, and in a loop each costs every iteration.
pub fn local_accesses(insns: &[Insn]) -> (usize, usize) {
    insns.iter().fold((0, 0), |(l, s), i| {
        (l + (i.op == "LDL") as usize, s + (i.op == "STL") as usize)
    })
}

/// `LDL` and `STL` inside any loop that holds an HMMA (each instruction once however many
/// such loops hold it): local memory paid on the tensor-core loops' iterations, as a
/// spilling masked loop beside an unmasked main loop pays it.
pub fn local_accesses_in_mma_loops(insns: &[Insn]) -> (usize, usize) {
    let spans: Vec<(u64, u64)> = loops(insns)
        .iter()
        .filter(|l| l.mma > 0)
        .map(|l| (l.start, l.end))
        .collect();
    let inside = |i: &&Insn| spans.iter().any(|&(s, e)| i.addr >= s && i.addr <= e);
    let held: Vec<Insn> = insns.iter().filter(inside).cloned().collect();
    local_accesses(&held)
}

/// The main loop (most HMMAs, innermost among ties) and the innermost loop holding an
/// HMMA; None for a kernel without a loop around an MMA.
pub fn mma_loops(insns: &[Insn]) -> Option<(LoopMix, LoopMix)> {
    let with_mma: Vec<LoopMix> = loops(insns).into_iter().filter(|l| l.mma > 0).collect();
    let span = |l: &LoopMix| l.end - l.start;
    let main = with_mma
        .iter()
        .copied()
        .max_by(|a, b| a.mma.cmp(&b.mma).then(span(b).cmp(&span(a))))?;
    let innermost = with_mma.iter().copied().min_by_key(span)?;
    Some((main, innermost))
}

/// One kernel's resources, from `cuobjdump -res-usage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Resources {
    pub registers: u32,
    /// Static shared memory of a block as the CUBIN lays it out (on sm_80 and later it
    /// includes the 1 KB the system reserves per block, when the kernel has any).
    pub shared: u32,
    /// `LOCAL:`: local memory per thread outside the ABI stack frame (0 in NVRTC's
    /// CUBINs, which keep spills and local arrays in the frame).
    pub local: u32,
    /// `STACK:`: the ABI stack frame per thread, where NVRTC puts register spills, local
    /// arrays and registers saved around calls.
    pub stack: u32,
}

/// `Function NAME:` then `REG:48 STACK:0 SHARED:44688 LOCAL:0 ...`, per kernel.
pub fn parse_res_usage(text: &str) -> BTreeMap<String, Resources> {
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let l = line.trim();
        if let Some(name) = l
            .strip_prefix("Function ")
            .and_then(|n| n.strip_suffix(':'))
        {
            current = Some(name.trim().to_string());
            continue;
        }
        let Some(name) = current.take() else { continue };
        let mut r = Resources::default();
        for field in l.split_whitespace() {
            let Some((k, v)) = field.split_once(':') else {
                continue;
            };
            let Ok(v) = v.parse::<u32>() else { continue };
            match k {
                "REG" => r.registers = v,
                "SHARED" => r.shared = v,
                "LOCAL" => r.local = v,
                "STACK" => r.stack = v,
                _ => {}
            }
        }
        out.insert(name, r);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cut of NVRTC 13.2's sm_90 SASS of attention_fwd (addresses as printed; bodies
    /// shortened): a tile loop 0x4000..0x4900 around a head-dim loop 0x41b0..0x44d0.
    const EXCERPT: &str = "
	code for sm_90
		Function : attention_fwd
	.headerflags	@\"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)\"
        /*4000*/                   LDS R16, [R3] ;                                  /* 0x0000000003107984 */
                                                                                    /* 0x000fe20000000800 */
        /*41b0*/                   LDSM.16.M88.4 R16, [R4] ;                        /* 0x000000000410783b */
        /*4270*/                   HMMA.16816.F32.BF16 R8, R16.reuse, R24, R8 ;     /* 0x000000181008723c */
        /*42a0*/                   HMMA.16816.F32.BF16 R12, R16, R24, R12 ;         /* 0x00000018100c723c */
        /*42b0*/                   NOP ;                                            /* 0x0000000000007918 */
        /*44d0*/               @P0 BRA 0x41b0 ;                                     /* 0xfffffffc00340947 */
        /*4500*/                   MUFU.EX2 R5, R5 ;                                /* 0x0000000500057308 */
        /*4600*/                   STL [R1+0x8], R5 ;                               /* 0x0000080501007387 */
        /*4700*/                   LDL.LU R7, [R1+0x8] ;                            /* 0x0000080001077983 */
        /*4810*/               @P1 HMMA.16816.F32.BF16 R12, R16, R26, R12 ;         /* 0x0000001a100c723c */
        /*4900*/              @!P0 BRA 0x4000 ;                                     /* 0xfffffff400208947 */
        /*4910*/                   EXIT ;                                           /* 0x000000000000794d */
        /*4920*/                   LDL R2, [R1] ;                                   /* 0x0000000001027983 */
        /*4930*/                   BRA 0x4000 ;                                     /* 0xfffffff400207947 */
		Function : rope
        /*0000*/                   BRA 0x0 ;                                        /* 0xfffffffc00fc7947 */
";

    #[test]
    fn the_main_loop_is_the_one_with_the_most_mma_and_the_innermost_is_reported_beside_it() {
        let k = parse_sass(EXCERPT);
        assert_eq!(k.keys().collect::<Vec<_>>(), ["attention_fwd", "rope"]);
        let insns = &k["attention_fwd"];
        assert_eq!(insns.len(), 14, "{insns:?}");
        assert!(!insns[1].guarded && insns[5].guarded);
        assert_eq!(insns[2].op, "HMMA");
        assert_eq!(insns[5].target, Some(0x41b0));
        let (main, inner) = mma_loops(insns).unwrap();
        // 0x4000..0x4900: LDS, LDSM, 2 HMMA, BRA, MUFU, STL, LDL, HMMA, BRA (the NOP not
        // counted); the LDL after the EXIT is the kernel's, not the loop's, and the branch
        // back over the EXIT (out-of-line code) is no loop.
        assert_eq!(
            (
                main.start,
                main.end,
                main.instructions,
                main.mma,
                main.mufu,
                main.nested_loops
            ),
            (0x4000, 0x4900, 10, 3, 1, 1)
        );
        assert_eq!((main.local_loads, main.local_stores), (1, 1));
        assert_eq!(local_accesses(insns), (2, 1));
        assert_eq!(local_accesses_in_mma_loops(insns), (1, 1));
        assert_eq!(loops(insns).len(), 2);
        assert_eq!((inner.local_loads, inner.local_stores), (0, 0));
        assert!((main.non_mma_per_mma() - 7.0 / 3.0).abs() < 1e-12);
        assert_eq!(
            (inner.start, inner.end, inner.instructions, inner.mma),
            (0x41b0, 0x44d0, 4, 2)
        );
        // The idle loop of `rope` has no MMA: no main loop.
        assert_eq!(mma_loops(&k["rope"]), None);
        assert_eq!(loops(&k["rope"]).len(), 1);
        assert_eq!(local_accesses(&k["rope"]), (0, 0));
    }

    #[test]
    fn resources_are_read_per_function() {
        let text = "
Resource usage:
 Common:
  GLOBAL:25 CONSTANT[4]:16
 Function attention_bwd:
  REG:56 STACK:0 SHARED:38992 LOCAL:0 CONSTANT[0]:624 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function rope:
  REG:30 STACK:16 SHARED:0 LOCAL:8 CONSTANT[2]:24 CONSTANT[0]:556 TEXTURE:0 SURFACE:0 SAMPLER:0
";
        let r = parse_res_usage(text);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r["attention_bwd"],
            Resources {
                registers: 56,
                shared: 38992,
                local: 0,
                stack: 0
            }
        );
        assert_eq!((r["rope"].local, r["rope"].stack), (8, 16));
    }
}
