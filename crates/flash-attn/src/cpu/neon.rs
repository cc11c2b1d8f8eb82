//! aarch64 Advanced SIMD (NEON) micro-kernels: the f32 GEMM of `gemm.rs` (8 rows × 8 columns of
//! accumulators, 16 of the 32 vector registers), the `bf16` pair GEMM on `BFDOT` where the CPU has
//! the BF16 extension (same tile), and the online softmax's row kernels of `vexp.rs` (the AVX-512
//! path's `2^x` polynomial on 4 lanes).
//!
//! Tails run the same operations as the vector body (the f32 GEMM's last `n mod 8` columns as
//! scalar fused multiply-adds, which round exactly as a vector lane's; the `bf16` GEMM's through
//! zero-padded vectors, since `BFDOT`'s rounding has no scalar twin; a row's last `n mod 4` scores
//! through a zero-padded vector), so an element's value never depends on where a tile or row
//! boundary falls.

use std::arch::aarch64::*;

use super::gemm::Bf16Pair;
use super::vexp::{EXP2_FLUSH, EXP2_TAYLOR};

/// Rows of `C` per micro-tile.
const MR: usize = 8;

/// `C[m × n] (+)= A · B` (`A` stored transposed when `TA`), as [`super::gemm::gemm_with`].
///
/// # Safety
/// NEON available; all accesses in bounds (`gemm_with` asserts it).
#[target_feature(enable = "neon")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm<const TA: bool>(
    c: &mut [f32],
    ldc: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: (usize, usize),
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    let n8 = n / 8 * 8;
    let (cp, ap, bp) = (c.as_mut_ptr(), a.as_ptr(), b.as_ptr());
    let mut i = 0;
    while i < m {
        let rows = (m - i).min(MR);
        let mut j = 0;
        while j < n8 {
            // SAFETY: forwarded from the caller; rows <= MR, columns j..j+8 <= n.
            unsafe {
                match rows {
                    8 => tile::<8, TA>(cp, ldc, ap, lda, bp, ldb, i, j, k, accumulate),
                    7 => tile::<7, TA>(cp, ldc, ap, lda, bp, ldb, i, j, k, accumulate),
                    6 => tile::<6, TA>(cp, ldc, ap, lda, bp, ldb, i, j, k, accumulate),
                    5 => tile::<5, TA>(cp, ldc, ap, lda, bp, ldb, i, j, k, accumulate),
                    4 => tile::<4, TA>(cp, ldc, ap, lda, bp, ldb, i, j, k, accumulate),
                    3 => tile::<3, TA>(cp, ldc, ap, lda, bp, ldb, i, j, k, accumulate),
                    2 => tile::<2, TA>(cp, ldc, ap, lda, bp, ldb, i, j, k, accumulate),
                    _ => tile::<1, TA>(cp, ldc, ap, lda, bp, ldb, i, j, k, accumulate),
                }
            }
            j += 8;
        }
        i += rows;
    }
    // Column tail: each element the vector lanes' chain (fused multiply-adds from zero, then C).
    for i in 0..m {
        for jj in n8..n {
            let mut s = 0.0f32;
            for p in 0..k {
                let at = super::gemm::BLayout { ld: ldb.0, panel: ldb.1 }.index(p, jj);
                s = a[super::gemm::a_index::<TA>(i, p, lda)].mul_add(b[at], s);
            }
            let cij = &mut c[i * ldc + jj];
            *cij = if accumulate { s + *cij } else { s };
        }
    }
}

/// One `R × 8` micro-tile at `(i, j)`.
///
/// # Safety
/// NEON available; rows `i..i+R`, columns `j..j+8` and `k` in bounds.
#[target_feature(enable = "neon")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const R: usize, const TA: bool>(
    c: *mut f32,
    ldc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    (ldb, bps): (usize, usize),
    i: usize,
    j: usize,
    k: usize,
    accumulate: bool,
) {
    // SAFETY (whole body): offsets stay within the views the caller bounded.
    unsafe {
        let mut acc = [[vdupq_n_f32(0.0); 2]; R];
        // The 8 columns lie in one panel of 16 (`j` is a multiple of 8).
        let panel = b.add(j / 16 * bps + j % 16);
        for p in 0..k {
            let brow = panel.add(p * ldb);
            let (b0, b1) = (vld1q_f32(brow), vld1q_f32(brow.add(4)));
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let av = *a.add(super::gemm::a_index::<TA>(i + r, p, lda));
                acc_r[0] = vfmaq_n_f32(acc_r[0], b0, av);
                acc_r[1] = vfmaq_n_f32(acc_r[1], b1, av);
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            store_row(c.add((i + r) * ldc + j), *acc_r, accumulate);
        }
    }
}

/// A micro-tile row's 8 accumulators into `C` at `crow` (`C + acc` when `accumulate`).
///
/// # Safety
/// NEON available; `crow..crow + 8` in bounds.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn store_row(crow: *mut f32, acc: [float32x4_t; 2], accumulate: bool) {
    // SAFETY: the caller bounds the 8 floats at `crow`.
    unsafe {
        let (mut c0, mut c1) = (acc[0], acc[1]);
        if accumulate {
            c0 = vaddq_f32(c0, vld1q_f32(crow));
            c1 = vaddq_f32(c1, vld1q_f32(crow.add(4)));
        }
        vst1q_f32(crow, c0);
        vst1q_f32(crow.add(4), c1);
    }
}

/// `C[m × n] (+)= A · B` on `bf16` pairs along `k` (`A` stored transposed when `TA`), as
/// [`super::gemm::gemm_bf16_with`]: each `BFDOT` lane adds the two products of a pair to an `f32`
/// accumulator that starts at zero; `C` is added after the last pair.
///
/// # Safety
/// NEON and the BF16 extension available; all accesses in bounds (`gemm_bf16_with` asserts it).
#[target_feature(enable = "neon,bf16")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_bf16<const TA: bool>(
    c: &mut [f32],
    ldc: usize,
    a: &[Bf16Pair],
    lda: usize,
    b: &[Bf16Pair],
    ldb: usize,
    m: usize,
    n: usize,
    kp: usize,
    accumulate: bool,
) {
    let (cp, ap, bp) = (c.as_mut_ptr(), a.as_ptr(), b.as_ptr());
    let mut i = 0;
    while i < m {
        let rows = (m - i).min(MR);
        let mut j = 0;
        while j < n {
            let cols = (n - j).min(8);
            // SAFETY: forwarded from the caller; rows <= MR, columns j..j+cols <= n.
            unsafe {
                match rows {
                    8 => tile_bf16::<8, TA>(cp, ldc, ap, lda, bp, ldb, (i, j, cols), kp, accumulate),
                    7 => tile_bf16::<7, TA>(cp, ldc, ap, lda, bp, ldb, (i, j, cols), kp, accumulate),
                    6 => tile_bf16::<6, TA>(cp, ldc, ap, lda, bp, ldb, (i, j, cols), kp, accumulate),
                    5 => tile_bf16::<5, TA>(cp, ldc, ap, lda, bp, ldb, (i, j, cols), kp, accumulate),
                    4 => tile_bf16::<4, TA>(cp, ldc, ap, lda, bp, ldb, (i, j, cols), kp, accumulate),
                    3 => tile_bf16::<3, TA>(cp, ldc, ap, lda, bp, ldb, (i, j, cols), kp, accumulate),
                    2 => tile_bf16::<2, TA>(cp, ldc, ap, lda, bp, ldb, (i, j, cols), kp, accumulate),
                    _ => tile_bf16::<1, TA>(cp, ldc, ap, lda, bp, ldb, (i, j, cols), kp, accumulate),
                }
            }
            j += 8;
        }
        i += rows;
    }
}

/// `acc += BFDOT(b, a)`: lane `l` adds `b[2l]·a[2l] + b[2l+1]·a[2l+1]` (`bf16` halves).
///
/// # Safety
/// NEON and the BF16 extension available.
#[target_feature(enable = "neon,bf16")]
#[inline]
unsafe fn bfdot(acc: float32x4_t, b: uint32x4_t, a: uint32x4_t) -> float32x4_t {
    let mut acc = acc;
    // SAFETY: register-only; the caller guarantees the BF16 extension (`BFDOT` needs it).
    unsafe {
        std::arch::asm!(
            "bfdot {acc:v}.4s, {b:v}.8h, {a:v}.8h",
            acc = inout(vreg) acc,
            b = in(vreg) b,
            a = in(vreg) a,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// One `R × 8` micro-tile of [`gemm_bf16`] at `(i, j)`, of which `cols` columns are real: a
/// partial tile reads `B` through a zero-padded copy and stores only its columns.
///
/// # Safety
/// NEON and the BF16 extension available; rows `i..i+R`, columns `j..j+cols` and `kp` in bounds.
#[target_feature(enable = "neon,bf16")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_bf16<const R: usize, const TA: bool>(
    c: *mut f32,
    ldc: usize,
    a: *const Bf16Pair,
    lda: usize,
    b: *const Bf16Pair,
    ldb: usize,
    (i, j, cols): (usize, usize, usize),
    kp: usize,
    accumulate: bool,
) {
    // SAFETY (whole body): offsets stay within the views the caller bounded; the padded copies
    // are local arrays of 8.
    unsafe {
        let mut acc = [[vdupq_n_f32(0.0); 2]; R];
        let mut pad = [0 as Bf16Pair; 8];
        for p in 0..kp {
            let brow = b.add(p * ldb + j);
            let (b0, b1) = if cols == 8 {
                (vld1q_u32(brow), vld1q_u32(brow.add(4)))
            } else {
                std::ptr::copy_nonoverlapping(brow, pad.as_mut_ptr(), cols);
                (vld1q_u32(pad.as_ptr()), vld1q_u32(pad.as_ptr().add(4)))
            };
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let av = vld1q_dup_u32(a.add(super::gemm::a_index::<TA>(i + r, p, lda)));
                acc_r[0] = bfdot(acc_r[0], b0, av);
                acc_r[1] = bfdot(acc_r[1], b1, av);
            }
        }
        let mut out = [0.0f32; 8];
        for (r, acc_r) in acc.iter().enumerate() {
            let crow = c.add((i + r) * ldc + j);
            if cols == 8 {
                store_row(crow, *acc_r, accumulate);
            } else {
                vst1q_f32(out.as_mut_ptr(), acc_r[0]);
                vst1q_f32(out.as_mut_ptr().add(4), acc_r[1]);
                for (x, &o) in out[..cols].iter().enumerate() {
                    let cx = crow.add(x);
                    *cx = if accumulate { o + *cx } else { o };
                }
            }
        }
    }
}

/// `2^x` for 4 lanes: `2^n · 2^f`, `n = round(x)`, the degree-7 polynomial for `2^f`, and `2^n`
/// as two multiplies by powers of two. Below [`EXP2_FLUSH`](super::vexp::EXP2_FLUSH) exactly 0,
/// `-inf` included, with no subnormal or underflowing product on the way (as on x86); NaN
/// propagates (`fmax`/`fmin` return NaN, and its lane is kept).
///
/// # Safety
/// NEON available.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn exp2(x: float32x4_t) -> float32x4_t {
    let flush = vdupq_n_f32(EXP2_FLUSH);
    // Not below the bound (true for NaN): the lanes kept.
    let keep = vmvnq_u32(vcltq_f32(x, flush));
    let x = vminq_f32(vdupq_n_f32(128.0), vmaxq_f32(flush, x));
    let n = vrndnq_f32(x);
    let f = vsubq_f32(x, n);
    let mut p = vdupq_n_f32(EXP2_TAYLOR[7]);
    for &c in EXP2_TAYLOR[..7].iter().rev() {
        p = vfmaq_f32(vdupq_n_f32(c), p, f);
    }
    let ni = vcvtq_s32_f32(n);
    let n1 = vshrq_n_s32::<1>(ni);
    let n2 = vsubq_s32(ni, n1);
    let pow = |e: int32x4_t| vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(e, vdupq_n_s32(127))));
    let r = vmulq_f32(vmulq_f32(p, pow(n1)), pow(n2));
    vreinterpretq_f32_u32(vandq_u32(keep, vreinterpretq_u32_f32(r)))
}

/// `2^((scale · x - m) · log2 e)` for 4 lanes, the difference one fused multiply-subtract.
///
/// # Safety
/// NEON available.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn exp_scaled(x: float32x4_t, sv: float32x4_t, mv: float32x4_t) -> float32x4_t {
    // x · s - m = -(m - x · s), one rounding.
    let diff = vnegq_f32(vfmsq_f32(mv, x, sv));
    exp2(vmulq_f32(diff, vdupq_n_f32(std::f32::consts::LOG2_E)))
}

/// `max_j row[j]`, `-inf` for an empty row, NaN entries ignored (as by `f32::max`).
///
/// # Safety
/// NEON available.
#[target_feature(enable = "neon")]
pub unsafe fn row_max(row: &[f32]) -> f32 {
    let mut acc = vdupq_n_f32(f32::NEG_INFINITY);
    let chunks = row.chunks_exact(4);
    let tail = chunks.remainder();
    for c in chunks {
        // SAFETY: `c` holds 4 floats. `fmaxnm` returns the number when one operand is NaN.
        acc = vmaxnmq_f32(acc, unsafe { vld1q_f32(c.as_ptr()) });
    }
    tail.iter().copied().fold(vmaxnmvq_f32(acc), f32::max)
}

/// `row[j] = 2^((scale · row[j] - m) · log2 e)`; returns the row's sum, added lane-wise in order,
/// then across lanes.
///
/// # Safety
/// NEON available.
#[target_feature(enable = "neon")]
pub unsafe fn exp_scaled_sub_sum(row: &mut [f32], scale: f32, m: f32) -> f32 {
    let (sv, mv) = (vdupq_n_f32(scale), vdupq_n_f32(m));
    let n = row.len();
    let ptr = row.as_mut_ptr();
    let mut sum = vdupq_n_f32(0.0);
    let mut j = 0;
    while j + 4 <= n {
        // SAFETY: `j + 4 <= n`.
        unsafe {
            let p = exp_scaled(vld1q_f32(ptr.add(j)), sv, mv);
            vst1q_f32(ptr.add(j), p);
            sum = vaddq_f32(sum, p);
        }
        j += 4;
    }
    if j < n {
        // The tail through a zero-padded vector; its padding lanes add exact zeros.
        let w = n - j;
        let mut buf = [0.0f32; 4];
        buf[..w].copy_from_slice(&row[j..]);
        // SAFETY: `buf` holds 4 floats.
        unsafe {
            let p = exp_scaled(vld1q_f32(buf.as_ptr()), sv, mv);
            vst1q_f32(buf.as_mut_ptr(), p);
        }
        buf[w..].fill(0.0);
        row[j..].copy_from_slice(&buf[..w]);
        // SAFETY: `buf` holds 4 floats.
        sum = vaddq_f32(sum, unsafe { vld1q_f32(buf.as_ptr()) });
    }
    let lanes =
        [vgetq_lane_f32::<0>(sum), vgetq_lane_f32::<1>(sum), vgetq_lane_f32::<2>(sum), vgetq_lane_f32::<3>(sum)];
    (lanes[0] + lanes[2]) + (lanes[1] + lanes[3])
}
