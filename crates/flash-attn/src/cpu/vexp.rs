//! Row kernels of the online softmax: the row maximum, and `p = e^(s - m)` with the row sum.
//!
//! Scores stay in natural units; `e^(s - m)` is evaluated as `2^((s - m) · log2 e)`, so the
//! `log2 e` multiplies a small difference rather than each large score (whose rounding would
//! otherwise grow by the factor 1.44 and show in the backward pass's recomputed `P`).
//!
//! The AVX-512 path evaluates `2^x` as `2^n · 2^f` with `n = round(x)`, `f = x - n ∈ [-½, ½]`,
//! and `2^f` by its degree-7 Taylor polynomial in `f · ln 2` (truncation error below 4.4e-9
//! relative), then `vscalefps` for `2^n`, which also gives exact 0 for `x = -inf` (masked keys)
//! and propagates NaN. Measured maximum relative error of the polynomial against `f64` over
//! `[-126, 126]` (in base 2): see the test `avx512_exp2_is_within_two_ulps` (below 2.4e-7, two ulps
//! of f32). The portable path uses
//! the C library's `exp2f`.

use super::gemm::{detect, Path};

/// `max_j row[j]` (`-inf` for an empty row; NaN entries are ignored, as by `f32::max`).
#[inline]
pub fn row_max(row: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if detect() == Path::Avx512 {
        // SAFETY: AVX-512F is available (detected).
        return unsafe { x86::row_max(row) };
    }
    row.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `row[j] = e^(row[j] - m)` for every `j`; returns `Σ_j row[j]`.
#[inline]
pub fn exp_sub_sum(row: &mut [f32], m: f32) -> f32 {
    exp_scaled_sub_sum(row, 1.0, m)
}

/// `row[j] = e^(scale · row[j] - m)` for every `j`; returns `Σ_j row[j]`. On the AVX-512 path
/// `scale · row[j] - m` is one fused multiply-subtract (one rounding; with `scale = 1` exactly
/// the `row[j] - m` of [`exp_sub_sum`]), so the softmax scale can wait until here instead of
/// taking its own pass over the score tile.
#[inline]
pub fn exp_scaled_sub_sum(row: &mut [f32], scale: f32, m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if detect() == Path::Avx512 {
        // SAFETY: AVX-512F is available (detected).
        return unsafe { x86::exp_scaled_sub_sum(row, scale, m) };
    }
    let mut sum = 0.0f32;
    for p in row.iter_mut() {
        *p = ((*p * scale - m) * std::f32::consts::LOG2_E).exp2();
        sum += *p;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `(ln 2)^k / k!` for k = 0..=7: Taylor coefficients of `2^f = e^(f ln 2)`.
    const C: [f32; 8] = [
        1.0,
        std::f32::consts::LN_2,
        0.240_226_5,
        0.055_504_11,
        0.009_618_129,
        0.001_333_355_8,
        0.000_154_035_3,
        0.000_015_252_73,
    ];

    /// `2^x` for 16 lanes.
    ///
    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn exp2(x: __m512) -> __m512 {
        // max(lo, x) and min(hi, x) return x when x is NaN (the second operand wins), so NaN
        // propagates; -inf and anything below -150 become -150, whose 2^n underflows to exactly 0.
        let x = _mm512_min_ps(_mm512_set1_ps(128.0), _mm512_max_ps(_mm512_set1_ps(-150.0), x));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let f = _mm512_sub_ps(x, n);
        let mut p = _mm512_set1_ps(C[7]);
        for &c in C[..7].iter().rev() {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, n)
    }

    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn row_max(row: &[f32]) -> f32 {
        let mut acc = _mm512_set1_ps(f32::NEG_INFINITY);
        let chunks = row.chunks_exact(16);
        let tail = chunks.remainder();
        for c in chunks {
            // SAFETY: `c` holds 16 floats.
            // max(x, acc) returns acc when x is NaN: NaN entries are ignored, as by f32::max.
            acc = _mm512_max_ps(unsafe { _mm512_loadu_ps(c.as_ptr()) }, acc);
        }
        let mask: __mmask16 = ((1u32 << tail.len()) - 1) as u16;
        // SAFETY: the mask selects only the `tail.len()` valid floats.
        let t = unsafe { _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), mask, tail.as_ptr()) };
        acc = _mm512_max_ps(t, acc);
        _mm512_reduce_max_ps(acc)
    }

    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_scaled_sub_sum(row: &mut [f32], scale: f32, m: f32) -> f32 {
        let (mv, sv) = (_mm512_set1_ps(m), _mm512_set1_ps(scale));
        let log2e = _mm512_set1_ps(std::f32::consts::LOG2_E);
        let mut sum = _mm512_setzero_ps();
        let n = row.len();
        let mut j = 0;
        let ptr = row.as_mut_ptr();
        while j < n {
            let w = (n - j).min(16);
            let mask: __mmask16 = if w == 16 { 0xFFFF } else { ((1u32 << w) - 1) as u16 };
            // SAFETY: lanes beyond `w` are masked off; `j + w <= n`.
            unsafe {
                let x = _mm512_maskz_loadu_ps(mask, ptr.add(j));
                let p = exp2(_mm512_mul_ps(_mm512_fmsub_ps(x, sv, mv), log2e));
                _mm512_mask_storeu_ps(ptr.add(j), mask, p);
                sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, p));
            }
            j += w;
        }
        _mm512_reduce_add_ps(sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn avx512_exp2_is_within_two_ulps() {
        if detect() != Path::Avx512 {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        let xs: Vec<f32> = (0..200_000).map(|i| -87.0 + 175.0 * i as f32 / 200_000.0).collect();
        let mut got = xs.clone();
        exp_sub_sum(&mut got, 0.0);
        let worst = xs
            .iter()
            .zip(&got)
            .map(|(&x, &g)| {
                // The reference includes the f32 rounding of x · log2 e, which is part of the
                // kernel's contract; the polynomial's own error is what is measured.
                let want = ((x * std::f32::consts::LOG2_E) as f64).exp2();
                (g as f64 - want).abs() / want
            })
            .fold(0.0f64, f64::max);
        assert!(worst < 2.4e-7, "max relative error {worst:e}");
    }

    #[test]
    fn exp2_of_minus_infinity_is_zero_and_nan_propagates() {
        let mut row = [f32::NEG_INFINITY, 0.0, f32::NAN, -1.0, f32::NEG_INFINITY];
        let sum = exp_sub_sum(&mut row, 0.0);
        assert_eq!(row[0], 0.0);
        assert_eq!(row[4], 0.0);
        assert!(row[2].is_nan() && sum.is_nan());
        assert!((row[1] - 1.0).abs() < 1e-7 && (row[3] - (-1.0f32).exp()).abs() < 1e-7);
    }

    #[test]
    fn row_max_matches_the_scalar_fold_on_every_length() {
        for n in 0..40 {
            let row: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.7).collect();
            assert_eq!(row_max(&row), row.iter().copied().fold(f32::NEG_INFINITY, f32::max));
        }
    }
}
