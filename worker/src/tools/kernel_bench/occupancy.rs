//! Resident warps per SM from a kernel's registers, shared memory (static, as cuobjdump
//! says, plus the dynamic shared memory it is launched with) and block size, as CUDA's
//! occupancy calculator computes them.
//!
//! Assumptions, per architecture (CUDA C Programming Guide, "Compute capabilities"):
//! 65,536 32-bit registers per SM, allocated per warp in units of 256 (a thread's count
//! rounded up to a multiple of 8), at most 255 per thread; 1 KB of shared memory reserved
//! by the system per block (cuobjdump's SHARED already includes it for a kernel with
//! shared memory; one without still takes it); at most 64 resident warps and 32 resident
//! blocks per SM; shared memory per SM: 164 KB on sm_80 (A100), 228 KB on sm_90
//! (H100/H200) and sm_100 (B200), all of it given to shared memory (the carveout at its
//! maximum, as the driver picks for a kernel that needs it).

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SmLimits {
    pub registers: u32,
    pub shared_bytes: u32,
    pub reserved_per_block: u32,
    pub max_warps: u32,
    pub max_blocks: u32,
}

pub fn sm_limits(arch: &str) -> Option<SmLimits> {
    let shared_kb = match arch {
        "sm_80" => 164,
        "sm_90" | "sm_100" => 228,
        _ => return None,
    };
    Some(SmLimits {
        registers: 65_536,
        shared_bytes: shared_kb * 1024,
        reserved_per_block: 1024,
        max_warps: 64,
        max_blocks: 32,
    })
}

/// What limits a kernel's residency.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Limiter {
    Registers,
    SharedMemory,
    Warps,
    Blocks,
}

/// Resident warps per SM of blocks of `threads` threads, each thread `registers`
/// registers, each block `shared` bytes of shared memory (static, as cuobjdump says, and
/// dynamic).
pub fn warps_per_sm(l: &SmLimits, registers: u32, shared: u32, threads: u32) -> (u32, Limiter) {
    let warps_per_block = threads.div_ceil(32).max(1);
    let regs_per_warp = (registers.max(1) * 32).div_ceil(256) * 256;
    let by_regs = (l.registers / regs_per_warp) / warps_per_block;
    let per_block = shared.max(l.reserved_per_block);
    let by_shared = l.shared_bytes / per_block;
    let by_warps = l.max_warps / warps_per_block;
    // Ties name the hardware's limits first (no kernel change lifts them).
    let candidates = [
        (by_warps, Limiter::Warps),
        (l.max_blocks, Limiter::Blocks),
        (by_regs, Limiter::Registers),
        (by_shared, Limiter::SharedMemory),
    ];
    let (blocks, limiter) = candidates
        .into_iter()
        .min_by_key(|&(b, _)| b)
        .unwrap_or((0, Limiter::Warps));
    (blocks * warps_per_block, limiter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn residency_follows_the_tightest_limit() {
        let h = sm_limits("sm_90").unwrap();
        // The current attention forward: one warp, 48 registers, 44,688 bytes: 5 blocks.
        assert_eq!(warps_per_sm(&h, 48, 44_688, 32), (5, Limiter::SharedMemory));
        // A100 has less shared memory: 3 blocks.
        assert_eq!(
            warps_per_sm(&sm_limits("sm_80").unwrap(), 48, 44_688, 32).0,
            3
        );
        // A one-warp kernel with nothing else in the way: 32 blocks, not 64 warps.
        assert_eq!(warps_per_sm(&h, 16, 0, 32), (32, Limiter::Blocks));
        // 256 threads of 128 registers: 32 KB registers a block, 2 blocks.
        assert_eq!(warps_per_sm(&h, 128, 0, 256), (16, Limiter::Registers));
        // 255 registers round to 256: 8 warps' worth per SM, 2 blocks of 4 warps.
        assert_eq!(warps_per_sm(&h, 255, 0, 128), (8, Limiter::Registers));
        // 36 registers round to 40: 51 warps' worth; in blocks of 8 warps, 6 blocks.
        assert_eq!(warps_per_sm(&h, 36, 1152, 256), (48, Limiter::Registers));
        assert_eq!(warps_per_sm(&h, 32, 1152, 256), (64, Limiter::Warps));
        assert!(sm_limits("sm_75").is_none());
    }
}
