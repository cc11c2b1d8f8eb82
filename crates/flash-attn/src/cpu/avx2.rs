//! AVX2 + FMA row kernels of the online softmax (8 lanes): the row maximum and
//! `p = 2^((scale · s - m) · log2 e)` with the row sum, the AVX-512 path's polynomial on 8 lanes.
//! The GEMM micro-kernel of this path is in `gemm.rs`.
//!
//! A row's tail (its last `n mod 8` elements) goes through the same operations under a lane mask,
//! so an element's value never depends on where the row's 8-lane blocks start.

use std::arch::x86_64::*;

use super::vexp::{EXP2_FLUSH, EXP2_TAYLOR};

/// Lanes `0..w` of 8 selected.
#[target_feature(enable = "avx2")]
#[inline]
fn mask(w: usize) -> __m256i {
    _mm256_cmpgt_epi32(_mm256_set1_epi32(w.min(8) as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
}

/// `2^x` for 8 lanes: `2^n · 2^f` with `n = round(x)`, `f ∈ [-½, ½]`, `2^f` by the degree-7
/// polynomial, and `2^n` as two multiplies by powers of two built in the exponent field (each
/// half of `n` a normal float, so `2^f · 2^n` up to `x = 128`). Below
/// [`EXP2_FLUSH`](super::vexp::EXP2_FLUSH) exactly 0, `-inf` included, with no subnormal or
/// underflowing product on the way (the vexp module's notes say why). NaN propagates.
///
/// # Safety
/// AVX2 and FMA available.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub unsafe fn exp2(x: __m256) -> __m256 {
    // Lanes below the flush bound give exactly 0 ("not less than" is true for NaN, which
    // stays); max(lo, x) and min(hi, x) return x when x is NaN (the second operand wins).
    let flush = _mm256_set1_ps(EXP2_FLUSH);
    let keep = _mm256_cmp_ps::<_CMP_NLT_UQ>(x, flush);
    let x = _mm256_min_ps(_mm256_set1_ps(128.0), _mm256_max_ps(flush, x));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
    let f = _mm256_sub_ps(x, n);
    let mut p = _mm256_set1_ps(EXP2_TAYLOR[7]);
    for &c in EXP2_TAYLOR[..7].iter().rev() {
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
    }
    let ni = _mm256_cvtps_epi32(n);
    let n1 = _mm256_srai_epi32::<1>(ni);
    let n2 = _mm256_sub_epi32(ni, n1);
    let pow = |e: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(e, _mm256_set1_epi32(127))));
    _mm256_and_ps(keep, _mm256_mul_ps(_mm256_mul_ps(p, pow(n1)), pow(n2)))
}

/// `max_j row[j]`, `-inf` for an empty row, NaN entries ignored (as by `f32::max`).
///
/// # Safety
/// AVX2 available.
#[target_feature(enable = "avx2")]
pub unsafe fn row_max(row: &[f32]) -> f32 {
    let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut acc = neg_inf;
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        // SAFETY: `c` holds 8 floats. max(x, acc) returns acc when x is NaN.
        acc = _mm256_max_ps(unsafe { _mm256_loadu_ps(c.as_ptr()) }, acc);
    }
    if !tail.is_empty() {
        let k = mask(tail.len());
        // SAFETY: the mask selects only the `tail.len()` valid floats.
        let t = unsafe { _mm256_maskload_ps(tail.as_ptr(), k) };
        acc = _mm256_max_ps(_mm256_blendv_ps(neg_inf, t, _mm256_castsi256_ps(k)), acc);
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    lanes.into_iter().fold(f32::NEG_INFINITY, f32::max)
}

/// `row[j] = 2^((scale · row[j] - m) · log2 e)` (the difference one fused multiply-subtract);
/// returns the sum of the row, added lane-wise in order, then across lanes.
///
/// # Safety
/// AVX2 and FMA available.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp_scaled_sub_sum(row: &mut [f32], scale: f32, m: f32) -> f32 {
    let (mv, sv) = (_mm256_set1_ps(m), _mm256_set1_ps(scale));
    let log2e = _mm256_set1_ps(std::f32::consts::LOG2_E);
    let n = row.len();
    let ptr = row.as_mut_ptr();
    let mut sum = _mm256_setzero_ps();
    let mut j = 0;
    // Four vectors per step (independent exp chains keep both FMA pipes busy); the sum adds
    // them in the order of the one-vector loop below.
    while j + 32 <= n {
        // SAFETY: `j + 32 <= n`: four whole vectors in bounds.
        unsafe {
            let x = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(ptr.add(j + o)));
            let p = x.map(|x| exp2(_mm256_mul_ps(_mm256_fmsub_ps(x, sv, mv), log2e)));
            for (o, p) in [0, 8, 16, 24].into_iter().zip(p) {
                _mm256_storeu_ps(ptr.add(j + o), p);
                sum = _mm256_add_ps(sum, p);
            }
        }
        j += 32;
    }
    while j < n {
        let w = (n - j).min(8);
        let k = mask(w);
        // SAFETY: lanes beyond `w` are masked off; `j + w <= n`. Masked-off lanes add exact zeros.
        unsafe {
            let x = _mm256_maskload_ps(ptr.add(j), k);
            let p = exp2(_mm256_mul_ps(_mm256_fmsub_ps(x, sv, mv), log2e));
            let p = _mm256_and_ps(p, _mm256_castsi256_ps(k));
            _mm256_maskstore_ps(ptr.add(j), k, p);
            sum = _mm256_add_ps(sum, p);
        }
        j += w;
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
    // A fixed tree over the lanes, as `_mm512_reduce_add_ps` adds its own.
    let [a, b, c, d, e, f, g, h] = lanes;
    ((a + e) + (c + g)) + ((b + f) + (d + h))
}
