//! The sm_80 primitives of kernels.cu (`mma_m16n8k16_bf16`, `ldmatrix_*`, `cp_async_*`) as
//! the host device emulates them (cuda/host/cuda_host.h), run through the test kernels of
//! cuda/test_kernels.cu and checked against the PTX ISA's fragment layouts, which this
//! file writes out again on its own, in the ISA's terms (element index i of a fragment,
//! groupID, threadID_in_group), not copied from the emulation.
//!
//! Why a wrong lane map fails: the raw MMA test packs A, B and C into registers by this
//! file's map and unpacks D by it; the emulation unpacks and packs by its own. The product
//! comes out right only where the two maps agree, so an emulation whose map differs from
//! the ISA's computes some other product. `a_wrong_lane_map_gives_a_wrong_product` shows
//! it from the other side: the same kernels fed by deliberately wrong maps (registers
//! swapped, groupID and threadID_in_group swapped, halves swapped, a transposed C) give
//! results that fail the comparison, each of them. Likewise ldmatrix's expected registers
//! are computed from the ISA's statement of which lane supplies which row; the mutants
//! that take a row from the wrong lane or ignore `.trans` do not match what runs.
//! The cp.async tests read a pipeline's shared memory with and without the wait: without,
//! they read the poison (0xFFFFFFFF) the host device leaves until the wait.
//!
//! NVRTC compiles kernels.cu with these test kernels for sm_80, sm_90 and sm_100 (skipped
//! without NVRTC on a laptop, failing under CI).

use dflash_worker::device::host::HostDevice;
use dflash_worker::device::{nvrtc, Arg, DSlice, Device, Stream};

const TEST_KERNELS_CU: &str = include_str!("../cuda/test_kernels.cu");

/// A small deterministic generator (splitmix64).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// A multiple of 1/8 in [-2, 2): exact in bf16, its products and their sums exact in f32.
    fn eighths(&mut self) -> f32 {
        (self.next() % 32) as f32 / 8.0 - 2.0
    }
}

fn bf16_bits(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

fn put<T: Copy>(dev: &mut HostDevice, data: &[T]) -> DSlice {
    let bytes = std::mem::size_of_val(data).max(4);
    let ptr = dev.alloc(bytes).unwrap();
    let s = DSlice { ptr, bytes };
    // SAFETY: plain old data viewed as bytes.
    let raw = unsafe {
        std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data))
    };
    dev.upload(Stream::Compute, s, raw).unwrap();
    s
}

fn get_u32(dev: &mut HostDevice, s: DSlice) -> Vec<u32> {
    let mut raw = vec![0u8; s.bytes];
    dev.download(Stream::Compute, s, &mut raw).unwrap();
    raw.chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn get_f32(dev: &mut HostDevice, s: DSlice) -> Vec<f32> {
    get_u32(dev, s).into_iter().map(f32::from_bits).collect()
}

// ---------------------------------------------------------------------------------------
// The PTX ISA's fragments of mma.m16n8k16 with .bf16 A/B and .f32 C/D, element by element:
// a fragment's element i lives in register i / 2 (A, B; two bf16 per .b32, element i % 2
// in the low half when even) or register i (C, D). groupID = lane >> 2,
// threadID_in_group = lane % 4.

/// A lane map: (lane, element index) → (row, column) of the matrix.
type Map = fn(usize, usize) -> (usize, usize);

/// A (16×16): row groupID for a0, a1, a4, a5, groupID + 8 for a2, a3, a6, a7; column
/// threadID_in_group·2 + (i & 1), plus 8 for a4..a7.
fn isa_a(lane: usize, i: usize) -> (usize, usize) {
    let (group, tig) = (lane >> 2, lane % 4);
    let row = if matches!(i, 0 | 1 | 4 | 5) {
        group
    } else {
        group + 8
    };
    let col = tig * 2 + (i & 1) + if i >= 4 { 8 } else { 0 };
    (row, col)
}

/// B (16×8, k × n): row threadID_in_group·2 + (i & 1), plus 8 for b2, b3; column groupID.
fn isa_b(lane: usize, i: usize) -> (usize, usize) {
    let (group, tig) = (lane >> 2, lane % 4);
    (tig * 2 + (i & 1) + if i >= 2 { 8 } else { 0 }, group)
}

/// C, D (16×8): row groupID for c0, c1, groupID + 8 for c2, c3; column threadID_in_group·2 + (i & 1).
fn isa_c(lane: usize, i: usize) -> (usize, usize) {
    let (group, tig) = (lane >> 2, lane % 4);
    (if i < 2 { group } else { group + 8 }, tig * 2 + (i & 1))
}

/// Registers of a bf16 fragment of `elems` elements per lane, packed by `map` from the
/// row-major matrix `m` of `cols` columns.
fn pack_bf16(m: &[f32], cols: usize, elems: usize, map: Map) -> Vec<u32> {
    let mut regs = vec![0u32; 32 * elems / 2];
    for lane in 0..32 {
        for i in 0..elems {
            let (r, c) = map(lane, i);
            let bits = bf16_bits(m[r * cols + c]) as u32;
            regs[lane * elems / 2 + i / 2] |= bits << (16 * (i % 2));
        }
    }
    regs
}

fn pack_f32(m: &[f32], map: Map) -> Vec<f32> {
    let mut regs = vec![0f32; 128];
    for lane in 0..32 {
        for i in 0..4 {
            let (r, c) = map(lane, i);
            regs[lane * 4 + i] = m[r * 8 + c];
        }
    }
    regs
}

fn unpack_f32(regs: &[f32], map: Map) -> Vec<f32> {
    let mut m = vec![f32::NAN; 128];
    for lane in 0..32 {
        for i in 0..4 {
            let (r, c) = map(lane, i);
            m[r * 8 + c] = regs[lane * 4 + i];
        }
    }
    m
}

/// A·B + C, row-major, in f64 (exact for the inputs used here).
fn reference(a: &[f32], b: &[f32], c: &[f32]) -> Vec<f32> {
    (0..16)
        .flat_map(|r| (0..8).map(move |n| (r, n)))
        .map(|(r, n)| {
            let s: f64 = (0..16)
                .map(|k| a[r * 16 + k] as f64 * b[k * 8 + n] as f64)
                .sum();
            (s + c[r * 8 + n] as f64) as f32
        })
        .collect()
}

struct Problem {
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
}

fn problems(n: usize, seed: u64) -> Vec<Problem> {
    let mut rng = Rng(seed);
    (0..n)
        .map(|_| Problem {
            a: (0..256).map(|_| rng.eighths()).collect(),
            b: (0..128).map(|_| rng.eighths()).collect(),
            c: (0..128).map(|_| rng.eighths()).collect(),
        })
        .collect()
}

/// Runs `hdtest_mma_raw` over 2 blocks of 2 warps (one problem per warp), the fragments
/// packed and D unpacked by the given maps; returns each warp's D, row-major.
fn run_mma_raw(ps: &[Problem], (ma, mb, mc): (Map, Map, Map)) -> Vec<Vec<f32>> {
    assert_eq!(ps.len(), 4);
    let mut dev = HostDevice::new();
    let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    for p in ps {
        a.extend(pack_bf16(&p.a, 16, 8, ma));
        b.extend(pack_bf16(&p.b, 8, 4, mb));
        c.extend(pack_f32(&p.c, mc));
    }
    let (a, b, c) = (put(&mut dev, &a), put(&mut dev, &b), put(&mut dev, &c));
    let d = put(&mut dev, &vec![0f32; 4 * 128]);
    let args = [Arg::W(d), Arg::R(a), Arg::R(b), Arg::R(c)];
    dev.launch_args(Stream::Compute, "hdtest_mma_raw", 2, 64, &args)
        .unwrap();
    let d = get_f32(&mut dev, d);
    d.chunks(128).map(|w| unpack_f32(w, mc)).collect()
}

#[test]
fn mma_m16n8k16_computes_a_times_b_plus_c_in_the_isa_fragment_layout() {
    let ps = problems(4, 1);
    let got = run_mma_raw(&ps, (isa_a, isa_b, isa_c));
    for (w, (p, d)) in ps.iter().zip(&got).enumerate() {
        let want = reference(&p.a, &p.b, &p.c);
        assert_eq!(d, &want, "warp {w}: D differs from A·B + C");
        assert!(want.iter().any(|&x| x != 0.0));
    }
}

// Deliberately wrong maps, each a mistake a hand-written fragment can make.
fn a_regs_1_2_swapped(lane: usize, i: usize) -> (usize, usize) {
    // a2,a3 (rows + 8) and a4,a5 (columns + 8) trade places.
    isa_a(lane, [0, 1, 4, 5, 2, 3, 6, 7][i])
}
fn a_group_tig_swapped(lane: usize, i: usize) -> (usize, usize) {
    let (r, c) = isa_a(lane, i);
    let (group, tig) = (lane >> 2, lane % 4);
    // Row from threadID_in_group, column pair from groupID (only where it stays in range).
    if group < 4 {
        (r - group + tig, c - 2 * tig + 2 * group)
    } else {
        (r, c)
    }
}
fn b_halves_swapped(lane: usize, i: usize) -> (usize, usize) {
    isa_b(lane, i ^ 1)
}
fn b_as_row_major(lane: usize, i: usize) -> (usize, usize) {
    // B's k pairs taken along n (as if B were n-major in the registers): 16×8 does not
    // fit that, so rows stay in range by folding.
    let (k, n) = isa_b(lane, i);
    ((n * 2 + (k & 1)) % 16, (k >> 1) % 8)
}
fn c_rows_8_swapped(lane: usize, i: usize) -> (usize, usize) {
    isa_c(lane, i ^ 2)
}

#[test]
fn a_wrong_lane_map_gives_a_wrong_product() {
    let ps = problems(4, 2);
    let wants: Vec<Vec<f32>> = ps.iter().map(|p| reference(&p.a, &p.b, &p.c)).collect();
    let mutants: [(&str, (Map, Map, Map)); 5] = [
        (
            "A registers 1 and 2 swapped",
            (a_regs_1_2_swapped, isa_b, isa_c),
        ),
        (
            "A's groupID and threadID_in_group swapped",
            (a_group_tig_swapped, isa_b, isa_c),
        ),
        ("B's halves swapped", (isa_a, b_halves_swapped, isa_c)),
        ("B packed along n", (isa_a, b_as_row_major, isa_c)),
        ("C/D rows +8 swapped", (isa_a, isa_b, c_rows_8_swapped)),
    ];
    for (what, maps) in mutants {
        let got = run_mma_raw(&ps, maps);
        assert!(
            got.iter().zip(&wants).any(|(g, w)| g != w),
            "{what}: the product still matches, so the test could not see this map"
        );
    }
}

// ---------------------------------------------------------------------------------------
// ldmatrix

/// What lane `lane` holds in register `i` after ldmatrix of a tile whose row at lane L's
/// address is `rows[L]`, per the ISA: matrix i's row r comes from the address of lane
/// 8i + r; without .trans the lane holds row groupID, columns 2·threadID_in_group + {0, 1};
/// with .trans, rows 2·threadID_in_group + {0, 1} of column groupID.
fn isa_ldmatrix(rows: &[[u16; 8]], lane: usize, i: usize, trans: bool) -> u32 {
    let (group, tig) = (lane >> 2, lane % 4);
    let m = |r: usize, c: usize| rows[8 * i + r][c] as u32;
    let (lo, hi) = if trans {
        (m(2 * tig, group), m(2 * tig + 1, group))
    } else {
        (m(group, 2 * tig), m(group, 2 * tig + 1))
    };
    lo | hi << 16
}

/// Runs `hdtest_ldmatrix` with lane L pointing at tile row `row_of_lane[L]`; returns
/// each lane's 4 registers (those the variant does not load stay 0).
fn run_ldmatrix(tile: &[u16], row_of_lane: &[i32], variant: i32) -> Vec<u32> {
    let mut dev = HostDevice::new();
    let src = put(&mut dev, tile);
    let rows = put(&mut dev, row_of_lane);
    let out = put(&mut dev, &[0u32; 128]);
    let args = [Arg::W(out), Arg::R(src), Arg::R(rows), Arg::I32(variant)];
    dev.launch_args(Stream::Compute, "hdtest_ldmatrix", 1, 32, &args)
        .unwrap();
    get_u32(&mut dev, out)
}

fn ldmatrix_case() -> (Vec<u16>, Vec<i32>, Vec<[u16; 8]>) {
    // Distinct elements (row·16 + column + 1), lanes pointing at rows in a scrambled order.
    let tile: Vec<u16> = (0..256u16).map(|e| (e / 8) * 16 + e % 8 + 1).collect();
    let row_of_lane: Vec<i32> = (0..32).map(|l| (l * 13 + 5) % 32).collect();
    let rows: Vec<[u16; 8]> = row_of_lane
        .iter()
        .map(|&r| tile[r as usize * 8..][..8].try_into().unwrap())
        .collect();
    (tile, row_of_lane, rows)
}

#[test]
fn ldmatrix_x1_x2_x4_with_and_without_trans_distribute_rows_as_the_isa_says() {
    let (tile, row_of_lane, rows) = ldmatrix_case();
    for variant in 0..6 {
        let (x, trans) = ([1, 2, 4][variant as usize % 3], variant >= 3);
        let got = run_ldmatrix(&tile, &row_of_lane, variant);
        for lane in 0..32 {
            for i in 0..4 {
                let want = if i < x {
                    isa_ldmatrix(&rows, lane, i, trans)
                } else {
                    0
                };
                assert_eq!(
                    got[lane * 4 + i],
                    want,
                    "x{x}{} lane {lane} register {i}",
                    if trans { ".trans" } else { "" }
                );
            }
        }
    }
}

#[test]
fn ldmatrix_mutants_do_not_match_what_runs() {
    let (tile, row_of_lane, rows) = ldmatrix_case();
    let x4 = run_ldmatrix(&tile, &row_of_lane, 2);
    let x4t = run_ldmatrix(&tile, &row_of_lane, 5);
    let all = |f: &dyn Fn(usize, usize) -> u32, got: &[u32]| {
        (0..32).all(|l| (0..4).all(|i| got[l * 4 + i] == f(l, i)))
    };
    assert!(all(&|l, i| isa_ldmatrix(&rows, l, i, false), &x4));
    // .trans ignored, or applied where it should not be.
    assert!(!all(&|l, i| isa_ldmatrix(&rows, l, i, false), &x4t));
    assert!(!all(&|l, i| isa_ldmatrix(&rows, l, i, true), &x4));
    // Every matrix's rows from lanes 0..7 (the x1 rule applied to x4).
    assert!(!all(&|l, _| isa_ldmatrix(&rows, l, 0, false), &x4));
    // Rows taken from the tile in order rather than from each lane's address.
    let in_order: Vec<[u16; 8]> = (0..32)
        .map(|r| tile[r * 8..][..8].try_into().unwrap())
        .collect();
    assert!(!all(&|l, i| isa_ldmatrix(&in_order, l, i, false), &x4));
    // groupID and threadID_in_group roles swapped within a matrix.
    let swapped = |l: usize, i: usize| isa_ldmatrix(&rows, (l % 4) * 4 + (l >> 2) % 4, i, false);
    assert!(!all(&swapped, &x4));
}

#[test]
fn ldmatrix_then_mma_multiplies_tiles_staged_as_attention_stages_them() {
    for (seed, b_kn) in [(3, 1), (4, 0)] {
        let p = &problems(1, seed)[0];
        let want = reference(&p.a, &p.b, &p.c);
        let a: Vec<u16> = p.a.iter().map(|&x| bf16_bits(x)).collect();
        // B as [k][n] (V's layout), or as [n][k] (K's layout: the columns of Kᵀ).
        let b: Vec<u16> = if b_kn == 1 {
            p.b.iter().map(|&x| bf16_bits(x)).collect()
        } else {
            (0..128)
                .map(|e| bf16_bits(p.b[(e % 16) * 8 + e / 16]))
                .collect()
        };
        let mut dev = HostDevice::new();
        let (da, db, dc) = (put(&mut dev, &a), put(&mut dev, &b), put(&mut dev, &p.c));
        let d = put(&mut dev, &[0f32; 128]);
        let args = [
            Arg::W(d),
            Arg::R(da),
            Arg::R(db),
            Arg::R(dc),
            Arg::I32(b_kn),
        ];
        dev.launch_args(Stream::Compute, "hdtest_ldmatrix_mma", 1, 32, &args)
            .unwrap();
        assert_eq!(
            get_f32(&mut dev, d),
            want,
            "B stored {}",
            if b_kn == 1 { "[k][n]" } else { "[n][k]" }
        );
    }
}

// ---------------------------------------------------------------------------------------
// cp.async

fn run_cp_async(mode: i32) -> (Vec<u32>, Vec<u32>) {
    let tiles: i32 = 5;
    let input: Vec<f32> = (0..256 * tiles).map(|i| i as f32 * 0.5 + 1.0).collect();
    let mut dev = HostDevice::new();
    let src = put(&mut dev, &input);
    let out = put(&mut dev, &vec![0f32; input.len()]);
    let args = [Arg::W(out), Arg::R(src), Arg::I32(tiles), Arg::I32(mode)];
    dev.launch_args(Stream::Compute, "hdtest_cp_async", 1, 64, &args)
        .unwrap();
    let want = input.iter().map(|x| x.to_bits()).collect();
    (get_u32(&mut dev, out), want)
}

#[test]
fn cp_async_data_arrives_at_the_wait_that_covers_its_group() {
    for mode in [0, 3] {
        let (got, want) = run_cp_async(mode);
        assert_eq!(
            got, want,
            "mode {mode}: a pipeline that waits reads what it copied"
        );
    }
}

#[test]
fn cp_async_read_before_its_wait_reads_poison() {
    // 1: no wait before the barrier; 2: copies never committed, so wait_group 0 does not
    // cover them. Every element read is the poison, none the data.
    for mode in [1, 2] {
        let (got, want) = run_cp_async(mode);
        assert!(
            got.iter().all(|&b| b == 0xFFFF_FFFF),
            "mode {mode}: read data that no wait delivered ({} of {} elements)",
            got.iter().zip(&want).filter(|(g, w)| g == w).count(),
            got.len()
        );
    }
}

// ---------------------------------------------------------------------------------------
// Key-span summaries

/// The FlashAttention-2 forward's summary of rows [first, first + 64) of tq as its thread 0
/// used to compute it, row after row: per span the union's [lo, hi) ([0, 0) where empty),
/// then the intersection of the first spans ([0, 0) where empty).
fn fa2_range_serial(spans: &[i32], first: usize, tq: usize) -> [i32; 6] {
    let (mut ilo, mut ihi, mut out) = (0, i32::MAX, [0; 6]);
    for r in 0..2 {
        let (mut lo, mut hi) = (i32::MAX, 0);
        for i in first..(first + 64).min(tq) {
            let (a, b) = (spans[4 * i + 2 * r], spans[4 * i + 2 * r + 1]);
            if a < b {
                lo = lo.min(a);
                hi = hi.max(b);
            }
            if r == 0 {
                ilo = ilo.max(a);
                ihi = ihi.min(b);
            }
        }
        (out[2 * r], out[2 * r + 1]) = if lo < hi { (lo, hi) } else { (0, 0) };
    }
    (out[4], out[5]) = if ilo < ihi { (ilo, ihi) } else { (0, 0) };
    out
}

/// The one-warp attention kernels' summary of rows [first, first + 16), as their lane 0
/// used to compute it: per span the union's [lo, hi), lo = i32::MAX and hi = 0 where empty.
fn attn_range_serial(spans: &[i32], first: usize, tq: usize) -> [i32; 4] {
    let mut out = [0; 4];
    for r in 0..2 {
        let (mut lo, mut hi) = (i32::MAX, 0);
        for i in first..(first + 16).min(tq) {
            let (a, b) = (spans[4 * i + 2 * r], spans[4 * i + 2 * r + 1]);
            if a < b {
                lo = lo.min(a);
                hi = hi.max(b);
            }
        }
        (out[2 * r], out[2 * r + 1]) = (lo, hi);
    }
    out
}

/// The attention kernels' prologue reduces the rows' key spans across lanes and warps;
/// it gives what the serial scan gave, to the integer, over row blocks of every kind:
/// random spans (empty, reversed, overlapping), a causal prefix, and a partial last block
/// whose rows share a window (the rows past tq must not empty the intersection).
#[test]
fn the_parallel_span_summaries_are_the_serial_scans() {
    let mut rng = Rng(7);
    for tq in [150usize, 64, 1, 130, 191] {
        let blocks = tq.div_ceil(64);
        let mut spans = vec![0i32; 4 * tq];
        for i in 0..tq {
            let mut pick = |m: u64| (rng.next() % m) as i32;
            let s = match (i / 64) % 3 {
                0 => [pick(200), pick(200), pick(200), pick(200)],
                1 => [0, i as i32 + 1, 0, 0],
                _ => [pick(20), 40 + pick(100), 300 + pick(10), 310 + pick(10)],
            };
            spans[4 * i..4 * i + 4].copy_from_slice(&s);
        }
        let mut dev = HostDevice::new();
        let gs = put(&mut dev, &spans);
        let out = put(&mut dev, &vec![-1i32; 22 * blocks]);
        let args = [Arg::W(out), Arg::R(gs), Arg::I32(tq as i32)];
        dev.launch_args(
            Stream::Compute,
            "hdtest_span_ranges",
            blocks as u32,
            128,
            &args,
        )
        .unwrap();
        let got: Vec<i32> = get_u32(&mut dev, out).iter().map(|&v| v as i32).collect();
        for b in 0..blocks {
            let want = fa2_range_serial(&spans, 64 * b, tq);
            assert_eq!(
                got[22 * b..22 * b + 6],
                want,
                "tq {tq}, CTA {b}: FA2 summary"
            );
            for w in 0..4 {
                let at = 22 * b + 6 + 4 * w;
                let want = attn_range_serial(&spans, 64 * b + 16 * w, tq);
                assert_eq!(
                    got[at..at + 4],
                    want,
                    "tq {tq}, rows {}..: one-warp summary",
                    64 * b + 16 * w
                );
            }
        }
        // The partial window block keeps a non-empty intersection.
        if tq == 150 {
            assert!(got[22 * 2 + 5] > got[22 * 2 + 4], "{:?}", &got[44..50]);
        }
    }
}

// ---------------------------------------------------------------------------------------
// NVRTC

#[test]
fn nvrtc_compiles_the_primitives_and_their_test_kernels_for_sm_80_sm_90_and_sm_100() {
    let required = std::env::var_os("CI").is_some()
        || std::env::var("DFLASH_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    if let Err(e) = nvrtc::version() {
        assert!(!required, "NVRTC not found: {e}");
        eprintln!("skipped: NVRTC not found ({e}; pip install nvidia-cuda-nvrtc)");
        return;
    }
    let src = format!("{}\n{}", nvrtc::KERNELS_CU, TEST_KERNELS_CU);
    for arch in ["sm_80", "sm_90", "sm_100"] {
        let out = nvrtc::compile(&src, arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        for k in nvrtc::kernel_names(TEST_KERNELS_CU) {
            assert!(
                out.ptx.contains(&format!(".entry {k}(")),
                "{arch}: {k} missing"
            );
        }
        for insn in [
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
            "ldmatrix.sync.aligned.m8n8.x1.shared.b16",
            "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16",
            "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
            "cp.async.cg.shared.global",
            "cp.async.ca.shared.global",
            "cp.async.commit_group",
            "cp.async.wait_group 1",
            "cp.async.wait_all",
        ] {
            assert!(out.ptx.contains(insn), "{arch}: no {insn} in the PTX");
        }
        assert!(out.cubin.starts_with(b"\x7fELF"), "{arch}: no CUBIN");
    }
}
