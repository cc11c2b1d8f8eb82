//! Row kernels of the online softmax: the row maximum, and `p = e^(s - m)` with the row sum.
//!
//! Scores stay in natural units; `e^(s - m)` is evaluated as `2^((s - m) · log2 e)`, so the
//! `log2 e` multiplies a small difference rather than each large score (whose rounding would
//! otherwise grow by the factor 1.44 and show in the backward pass's recomputed `P`).
//!
//! The AVX-512 path evaluates `2^x` as `2^n · 2^f` with `n = round(x)`, `f = x - n ∈ [-½, ½]`,
//! and `2^f` by its degree-7 Taylor polynomial in `f · ln 2` (truncation error below 4.4e-9
//! relative), then `vscalefps` for `2^n`; NaN propagates. The AVX2 and NEON paths (`avx2.rs`,
//! `neon.rs`) evaluate the same polynomial on 8 and 4 lanes, with `2^n` as two exponent-field
//! multiplies (no `vscalefps`); their tails run the same operations under lane masks, so every
//! element's value is the same wherever a tile boundary falls. Measured maximum relative error
//! against `f64` over `[-125, 126]` (in base 2): see the test `simd_exp2_is_within_two_ulps`
//! (below 2.4e-7, two ulps of f32). The portable path uses the C library's `exp2f`.
//!
//! **Below [`EXP2_FLUSH`] every SIMD path returns exactly 0** (`x = -inf`, a masked key,
//! included), and it never forms a subnormal or an underflowing result: the argument is clamped
//! to `EXP2_FLUSH` first, and the lanes below it are zeroed by a compare mask. On Intel cores
//! an underflowing or subnormal result of a vector instruction, with the default `MXCSR` (no
//! flush-to-zero), takes a microcode assist of about a hundred cycles: the masked half of every
//! causal diagonal tile took them, and on the Sapphire Rapids Xeon the exponentials of a causal
//! forward ran 3× slower per element than a forward's without a mask
//! (docs/cpu-performance.md, session 46). A probability below `2^-125` is less than `2^-125` of
//! its row's sum (whose largest term is 1), far below every rounding of the result.

use super::gemm::Bf16Pair;
use super::isa::Isa;
use super::pairs::narrow_to_pairs;

/// The least argument of every SIMD path's `2^x` with a nonzero result; below it the result is
/// exactly 0 (see the module's notes). `2^-125 · 2^f`, `f ∈ [-½, ½]`, is still a normal float.
pub(super) const EXP2_FLUSH: f32 = -125.0;

/// `(ln 2)^k / k!` for k = 0..=7: Taylor coefficients of `2^f = e^(f ln 2)`, the polynomial of
/// every SIMD path's `2^x` (AVX-512, AVX2, NEON).
pub(super) const EXP2_TAYLOR: [f32; 8] = [
    1.0,
    std::f32::consts::LN_2,
    0.240_226_5,
    0.055_504_11,
    0.009_618_129,
    0.001_333_355_8,
    0.000_154_035_3,
    0.000_015_252_73,
];

/// `max_j row[j]` (`-inf` for an empty row; NaN entries are ignored, as by `f32::max`).
#[inline]
pub fn row_max(isa: Isa, row: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: AVX-512F is available (checked).
        _ if isa.avx512() => return unsafe { x86::row_max(row) },
        // SAFETY: AVX2 and FMA are available (checked).
        Isa::Avx2 if Isa::Avx2.is_supported() => return unsafe { super::avx2::row_max(row) },
        _ => {}
    }
    #[cfg(target_arch = "aarch64")]
    if isa == Isa::Neon && Isa::Neon.is_supported() {
        // SAFETY: NEON is available (checked).
        return unsafe { super::neon::row_max(row) };
    }
    let _ = isa;
    row.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `row[j] *= alpha` for every `j` (the online softmax's rescale of an output row, the final
/// `1 / l`, a score scale not fused into the exponent, the backward's `dK` scale): one rounded
/// product an element on every path, so the same bits at any width.
#[inline]
pub fn scale_row(isa: Isa, row: &mut [f32], alpha: f32) {
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: AVX-512F is available (checked).
        _ if isa.avx512() => return unsafe { x86::scale_row(row, alpha) },
        // SAFETY: AVX2 is available (checked).
        Isa::Avx2 if Isa::Avx2.is_supported() => return unsafe { scale_row_avx2(row, alpha) },
        _ => {}
    }
    let _ = isa;
    row.iter_mut().for_each(|x| *x *= alpha);
}

/// [`scale_row`] compiled for AVX2 (the loop vectorises to 8 lanes).
///
/// # Safety
/// AVX2 available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn scale_row_avx2(row: &mut [f32], alpha: f32) {
    row.iter_mut().for_each(|x| *x *= alpha);
}

/// `row[j] = e^(scale · row[j] - m)` for every `j`; returns `Σ_j row[j]`. On the AVX-512 path
/// `scale · row[j] - m` is one fused multiply-subtract (one rounding; with `scale = 1` exactly
/// `row[j] - m`), so the softmax scale can wait until here instead of
/// taking its own pass over the score tile.
#[inline]
pub fn exp_scaled_sub_sum(isa: Isa, row: &mut [f32], scale: f32, m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: AVX-512F is available (checked).
        _ if isa.avx512() => return unsafe { x86::exp_scaled_sub_sum(row, scale, m) },
        // SAFETY: AVX2 and FMA are available (checked).
        Isa::Avx2 if Isa::Avx2.is_supported() => return unsafe { super::avx2::exp_scaled_sub_sum(row, scale, m) },
        _ => {}
    }
    #[cfg(target_arch = "aarch64")]
    if isa == Isa::Neon && Isa::Neon.is_supported() {
        // SAFETY: NEON is available (checked).
        return unsafe { super::neon::exp_scaled_sub_sum(row, scale, m) };
    }
    let _ = isa;
    let mut sum = 0.0f32;
    for p in row.iter_mut() {
        *p = ((*p * scale - m) * std::f32::consts::LOG2_E).exp2();
        sum += *p;
    }
    sum
}

/// [`exp_scaled_sub_sum`] with the probabilities rounded to `bf16` pairs into `dst` (the `A`
/// operand of `O += P V` on pairs; an odd length padded with zero) instead of written back:
/// on AVX-512 BF16 the `f32` probabilities never leave the registers, which saves the pass of
/// [`narrow_to_pairs`](super::pairs::narrow_to_pairs) over them. `row` may be clobbered. The sum
/// and the pairs are bitwise those of the two passes.
pub fn exp_scaled_sum_to_pairs(isa: Isa, row: &mut [f32], scale: f32, m: f32, dst: &mut [Bf16Pair]) -> f32 {
    assert!(dst.len() >= row.len().div_ceil(2), "exp_scaled_sum_to_pairs: destination too short");
    #[cfg(target_arch = "x86_64")]
    if isa.bf16_pairs() {
        // SAFETY: AVX-512F and AVX-512 BF16 are available (checked); `dst` is long enough.
        return unsafe { x86::exp_scaled_sum_to_pairs(row, scale, m, dst) };
    }
    let sum = exp_scaled_sub_sum(isa, row, scale, m);
    narrow_to_pairs(isa, dst, row);
    sum
}

/// The backward pass's `P` for two query rows: `row[j] = e^(scale · row[j] - m)` for `lo` and
/// `hi` (a row whose `m` is `-inf` sees no key and becomes zeros), kept in `f32` for `dS`, and
/// rounded to `bf16` pairs along the rows into `dst` (`dst[c]` = `lo[c], hi[c]`, zero for a
/// missing `hi`): the `A` operand of `dV += Pᵀ dO`, without a second pass over `P`. Bitwise the
/// values of [`exp_scaled_sub_sum`] on each row followed by
/// [`narrow_row_pairs`](super::pairs::narrow_row_pairs).
pub fn exp_scaled_row_pairs(
    isa: Isa,
    lo: (&mut [f32], f32),
    hi: Option<(&mut [f32], f32)>,
    scale: f32,
    dst: &mut [Bf16Pair],
) {
    let n = lo.0.len();
    assert!(dst.len() >= n && hi.as_ref().is_none_or(|h| h.0.len() == n), "exp_scaled_row_pairs: lengths");
    #[cfg(target_arch = "x86_64")]
    if isa.bf16_pairs() {
        // SAFETY: AVX-512F and AVX-512 BF16 are available (checked); lengths checked above.
        return unsafe { x86::exp_scaled_row_pairs(lo, hi, scale, dst) };
    }
    let exp_row = |(row, m): (&mut [f32], f32)| {
        if m == f32::NEG_INFINITY {
            row.fill(0.0);
        } else {
            exp_scaled_sub_sum(isa, row, scale, m);
        }
    };
    let (lo_row, lo_m) = lo;
    exp_row((&mut *lo_row, lo_m));
    match hi {
        Some((hi_row, hi_m)) => {
            exp_row((&mut *hi_row, hi_m));
            super::pairs::narrow_row_pairs(isa, dst, lo_row, Some(hi_row));
        }
        None => super::pairs::narrow_row_pairs(isa, dst, lo_row, None),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::lanes::{interleave_rows, load_ps, store_epi32, store_ps};
    use super::{EXP2_FLUSH, EXP2_TAYLOR};

    /// `2^x` for 16 lanes.
    ///
    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn exp2(x: __m512) -> __m512 {
        // Lanes below the flush bound (`-inf` included) give exactly 0; "not less than" is true
        // for NaN, which stays. max(lo, x) and min(hi, x) return x when x is NaN (the second
        // operand wins), so NaN propagates; the clamp keeps every product normal.
        let flush = _mm512_set1_ps(EXP2_FLUSH);
        let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, flush);
        let x = _mm512_min_ps(_mm512_set1_ps(128.0), _mm512_max_ps(flush, x));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let f = _mm512_sub_ps(x, n);
        let mut p = _mm512_set1_ps(EXP2_TAYLOR[7]);
        for &c in EXP2_TAYLOR[..7].iter().rev() {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
        }
        _mm512_maskz_scalef_ps(keep, p, n)
    }

    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn scale_row(row: &mut [f32], alpha: f32) {
        let a = _mm512_set1_ps(alpha);
        let mut chunks = row.chunks_exact_mut(16);
        for c in &mut chunks {
            // SAFETY: `c` holds 16 floats.
            unsafe { _mm512_storeu_ps(c.as_mut_ptr(), _mm512_mul_ps(_mm512_loadu_ps(c.as_ptr()), a)) };
        }
        let tail = chunks.into_remainder();
        let mask: __mmask16 = ((1u32 << tail.len()) - 1) as u16;
        // SAFETY: the mask selects only the `tail.len()` valid floats.
        unsafe {
            let t = _mm512_maskz_loadu_ps(mask, tail.as_ptr());
            _mm512_mask_storeu_ps(tail.as_mut_ptr(), mask, _mm512_mul_ps(t, a));
        }
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
        // Four vectors per step: each 2^x is a chain of a dozen dependent operations, and four
        // independent chains in one block keep the FMA pipes busy. The sum adds them in the order
        // of the one-vector loop below, so the result does not depend on the unrolling.
        while j + 64 <= n {
            // SAFETY: `j + 64 <= n`: four whole vectors in bounds.
            unsafe {
                let x = [0, 16, 32, 48].map(|o| _mm512_loadu_ps(ptr.add(j + o)));
                let p = x.map(|x| exp2(_mm512_mul_ps(_mm512_fmsub_ps(x, sv, mv), log2e)));
                for (o, p) in [0, 16, 32, 48].into_iter().zip(p) {
                    _mm512_storeu_ps(ptr.add(j + o), p);
                    sum = _mm512_add_ps(sum, p);
                }
            }
            j += 64;
        }
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

    /// # Safety
    /// AVX-512F and AVX-512 BF16 available; `dst` at least as long as the rows, `hi` as long as
    /// `lo`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn exp_scaled_row_pairs(
        lo: (&mut [f32], f32),
        hi: Option<(&mut [f32], f32)>,
        scale: f32,
        dst: &mut [u32],
    ) {
        let n = lo.0.len();
        let sv = _mm512_set1_ps(scale);
        let log2e = _mm512_set1_ps(std::f32::consts::LOG2_E);
        // A row that sees no key (m = -inf) is all zeros: its lanes are masked off. A missing
        // `hi` reads and writes the `lo` row's memory with every lane masked off.
        let live = |m: f32| if m == f32::NEG_INFINITY { 0 } else { 0xFFFF };
        let (lp, lm, lo_live) = (lo.0.as_mut_ptr(), _mm512_set1_ps(lo.1), live(lo.1));
        let (hp, hm, hi_live, hi_store) = match hi {
            Some((row, m)) => (row.as_mut_ptr(), _mm512_set1_ps(m), live(m), 0xFFFF),
            None => (lp, _mm512_setzero_ps(), 0, 0),
        };
        let dp = dst.as_mut_ptr();
        let mut j = 0;
        while j < n {
            let w = (n - j).min(32);
            let (k0, k1) = (lanes(w), lanes(w.saturating_sub(16)));
            // SAFETY: loads and stores masked to the `w` valid columns from `j` of rows as long
            // as `n` (the second half's address may lie past the row when `k1 = 0`, and is then
            // never touched); `dst` holds `n` words. Masked-off lanes are exact zeros.
            unsafe {
                let p = |ptr: *mut f32, m: __m512, k: __mmask16, off: usize| {
                    let x = load_ps(k, ptr.wrapping_add(j + off));
                    _mm512_maskz_mov_ps(k, exp2(_mm512_mul_ps(_mm512_fmsub_ps(x, sv, m), log2e)))
                };
                let (l0, l1) = (p(lp, lm, k0 & lo_live, 0), p(lp, lm, k1 & lo_live, 16));
                let (h0, h1) = (p(hp, hm, k0 & hi_live, 0), p(hp, hm, k1 & hi_live, 16));
                store_ps(lp.add(j), k0, l0);
                store_ps(lp.wrapping_add(j + 16), k1, l1);
                store_ps(hp.add(j), k0 & hi_store, h0);
                store_ps(hp.wrapping_add(j + 16), k1 & hi_store, h1);
                // Each row's 32 values as bf16 (low 16 in the low 256 bits), then word c =
                // lo[c] | hi[c] << 16.
                let bl: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(l1, l0));
                let bh: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(h1, h0));
                let (w0, w1) = interleave_rows(bl, bh);
                store_epi32(dp.add(j), k0, w0);
                store_epi32(dp.wrapping_add(j + 16), k1, w1);
            }
            j += w;
        }
    }

    /// The lanes `0..k` of 16.
    fn lanes(k: usize) -> __mmask16 {
        if k >= 16 {
            0xFFFF
        } else {
            ((1u32 << k) - 1) as u16
        }
    }

    /// # Safety
    /// AVX-512F and AVX-512 BF16 available; `dst.len() >= row.len().div_ceil(2)`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn exp_scaled_sum_to_pairs(row: &mut [f32], scale: f32, m: f32, dst: &mut [u32]) -> f32 {
        let (mv, sv) = (_mm512_set1_ps(m), _mm512_set1_ps(scale));
        let log2e = _mm512_set1_ps(std::f32::consts::LOG2_E);
        let mut sum = _mm512_setzero_ps();
        let n = row.len();
        let (sp, dp) = (row.as_ptr(), dst.as_mut_ptr());
        let mut j = 0;
        // Four vectors per step, as in `exp_scaled_sub_sum`.
        while j + 64 <= n {
            // SAFETY: `j + 64 <= n`: four whole vectors of `row` and 32 words of `dst` (at least
            // `n / 2` long) in bounds.
            unsafe {
                let x = [0, 16, 32, 48].map(|o| _mm512_loadu_ps(sp.add(j + o)));
                let p = x.map(|x| exp2(_mm512_mul_ps(_mm512_fmsub_ps(x, sv, mv), log2e)));
                for p in p {
                    sum = _mm512_add_ps(sum, p);
                }
                let lo: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(p[1], p[0]));
                let hi: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(p[3], p[2]));
                _mm512_storeu_si512(dp.add(j / 2).cast(), lo);
                _mm512_storeu_si512(dp.add(j / 2 + 16).cast(), hi);
            }
            j += 64;
        }
        while j < n {
            let w = (n - j).min(32);
            let (k_lo, k_hi) = (lanes(w), lanes(w.saturating_sub(16)));
            // SAFETY: loads masked to the `w` valid floats from `j` (the high half's address may
            // lie past the row when `k_hi = 0`, and is then never read), the store to the
            // `w.div_ceil(2)` words from `j / 2`, in bounds by the caller's contract. Masked-off
            // lanes become exact zeros: they pad an odd tail and add nothing to the sum, which
            // adds the two halves in the order of `exp_scaled_sub_sum`.
            unsafe {
                let lo = _mm512_maskz_loadu_ps(k_lo, sp.add(j));
                let hi = _mm512_maskz_loadu_ps(k_hi, sp.wrapping_add(j + 16));
                let p_lo = _mm512_maskz_mov_ps(k_lo, exp2(_mm512_mul_ps(_mm512_fmsub_ps(lo, sv, mv), log2e)));
                let p_hi = _mm512_maskz_mov_ps(k_hi, exp2(_mm512_mul_ps(_mm512_fmsub_ps(hi, sv, mv), log2e)));
                sum = _mm512_add_ps(sum, p_lo);
                if w > 16 {
                    sum = _mm512_add_ps(sum, p_hi);
                }
                let bf: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(p_hi, p_lo));
                _mm512_mask_storeu_epi32(dp.add(j / 2).cast(), lanes(w.div_ceil(2)), bf);
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
    fn simd_exp2_is_within_two_ulps() {
        let xs: Vec<f32> = (0..200_000).map(|i| -86.5 + 174.5 * i as f32 / 200_000.0).collect();
        for isa in Isa::available().into_iter().filter(|&isa| isa != Isa::Portable) {
            let mut got = xs.clone();
            exp_scaled_sub_sum(isa, &mut got, 1.0, 0.0);
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
            assert!(worst < 2.4e-7, "{isa}: max relative error {worst:e}");
        }
    }

    #[test]
    fn simd_exp2_flushes_below_the_bound_and_never_returns_a_subnormal() {
        // Arguments (in base 2) from -190 to -100, dense around the bound: below EXP2_FLUSH
        // exactly 0, from it a normal float within two ulps of `f64`.
        let xs: Vec<f32> = (0..20_000).map(|i| -131.7 + 63.0 * i as f32 / 20_000.0).collect();
        for isa in Isa::available().into_iter().filter(|&isa| isa != Isa::Portable) {
            for len in [xs.len(), 13] {
                let mut got = xs[..len].to_vec();
                exp_scaled_sub_sum(isa, &mut got, 1.0, 0.0);
                let (mut zeros, mut normals) = (0, 0);
                for (&x, &g) in xs.iter().zip(&got) {
                    let b = x * std::f32::consts::LOG2_E;
                    if b < EXP2_FLUSH {
                        assert_eq!(g.to_bits(), 0, "{isa}: 2^{b} gave {g:e}");
                        zeros += 1;
                    } else {
                        assert!(g.is_normal(), "{isa}: 2^{b} gave {g:e}, not a normal float");
                        let want = (b as f64).exp2();
                        assert!((g as f64 - want).abs() / want < 2.4e-7, "{isa}: 2^{b} gave {g:e}");
                        normals += 1;
                    }
                }
                assert!(zeros > 0 && (len < 20 || normals > 0), "{isa}: the sweep missed a side of the bound");
            }
        }
    }

    #[test]
    fn exp2_of_minus_infinity_is_zero_and_nan_propagates() {
        for isa in Isa::available() {
            for n in [5usize, 13, 40] {
                let mut row: Vec<f32> = (0..n)
                    .map(|i| match i % 5 {
                        0 | 4 => f32::NEG_INFINITY,
                        2 => f32::NAN,
                        1 => 0.0,
                        _ => -1.0,
                    })
                    .collect();
                // Far below the range of f32: exactly zero as well.
                row[n - 1] = -200.0;
                let sum = exp_scaled_sub_sum(isa, &mut row, 1.0, 0.0);
                for (i, &x) in row.iter().enumerate() {
                    match i % 5 {
                        _ if i == n - 1 => assert_eq!(x.to_bits(), 0, "{isa} [{i}]"),
                        0 | 4 => assert_eq!(x.to_bits(), 0, "{isa} [{i}]"),
                        2 => assert!(x.is_nan(), "{isa} [{i}]"),
                        1 => assert!((x - 1.0).abs() < 1e-7, "{isa} [{i}]"),
                        _ => assert!((x - (-1.0f32).exp()).abs() < 1e-7, "{isa} [{i}]"),
                    }
                }
                assert!(sum.is_nan(), "{isa}");
            }
        }
    }

    #[test]
    fn scale_row_gives_the_scalar_products_on_every_path_and_length() {
        let mut rng = crate::check::Rng::new(45);
        for n in [0, 1, 7, 15, 16, 17, 33, 128, 131] {
            let row: Vec<f32> = (0..n).map(|_| 3.0 * rng.normal() as f32).collect();
            let alpha = rng.normal() as f32;
            let want: Vec<u32> = row.iter().map(|&x| (x * alpha).to_bits()).collect();
            for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
                let mut got = row.clone();
                scale_row(isa, &mut got, alpha);
                assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want, "{} n {n}", isa.name());
            }
        }
    }

    #[test]
    fn row_max_matches_the_scalar_fold_on_every_length() {
        for isa in Isa::available() {
            for n in 0..40 {
                let mut row: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.7).collect();
                assert_eq!(row_max(isa, &row), row.iter().copied().fold(f32::NEG_INFINITY, f32::max), "{isa} {n}");
                if n > 3 {
                    // NaN entries are ignored, wherever they fall.
                    row[n - 2] = f32::NAN;
                    row[1] = f32::NAN;
                    assert_eq!(row_max(isa, &row), row.iter().copied().fold(f32::NEG_INFINITY, f32::max), "{isa} {n}");
                }
            }
        }
    }

    #[test]
    fn an_element_gets_the_same_bits_wherever_its_row_starts() {
        // The same values at every offset within a row: the value of each (not the sum) must not
        // depend on which lanes of a vector, or which tail, it falls in.
        let vals: Vec<f32> = (0..70).map(|i| (i as f32 * 0.613).sin() * 11.0).collect();
        for isa in Isa::available() {
            let mut whole = vals.clone();
            exp_scaled_sub_sum(isa, &mut whole, 0.37, 1.5);
            for start in 1..20 {
                for len in [1usize, 3, 7, 8, 9, 17, 33] {
                    let end = (start + len).min(vals.len());
                    let mut part = vals[start..end].to_vec();
                    exp_scaled_sub_sum(isa, &mut part, 0.37, 1.5);
                    for (k, (&a, &b)) in part.iter().zip(&whole[start..end]).enumerate() {
                        assert_eq!(a.to_bits(), b.to_bits(), "{isa} start {start} len {len} [{k}]");
                    }
                }
            }
        }
    }

    #[test]
    fn fused_pairs_equal_exp_then_narrow() {
        for isa in Isa::available() {
            for n in [1usize, 2, 15, 16, 17, 31, 32, 33, 77, 128] {
                let row: Vec<f32> = (0..n)
                    .map(|i| if i % 7 == 3 { f32::NEG_INFINITY } else { (i as f32 * 0.37).sin() * 9.0 })
                    .collect();
                let (scale, m) = (0.125f32, 1.0f32);
                let mut two = row.clone();
                let sum_two = exp_scaled_sub_sum(isa, &mut two, scale, m);
                let mut want = vec![0u32; n.div_ceil(2)];
                narrow_to_pairs(isa, &mut want, &two);
                let mut got = vec![u32::MAX; n.div_ceil(2) + 1];
                let sum = exp_scaled_sum_to_pairs(isa, &mut row.clone(), scale, m, &mut got);
                assert_eq!(sum.to_bits(), sum_two.to_bits(), "{isa} n = {n}");
                assert_eq!(&got[..n.div_ceil(2)], &want[..], "{isa} n = {n}");
                assert_eq!(got[n.div_ceil(2)], u32::MAX, "{isa}: wrote past the pairs, n = {n}");
            }
        }
    }

    #[test]
    fn fused_row_pairs_equal_exp_then_narrow_rows() {
        for isa in Isa::available() {
            for n in [1usize, 15, 16, 17, 32, 33, 77, 128] {
                let make = |k: f32| -> Vec<f32> {
                    (0..n).map(|i| if i % 5 == 2 { f32::NEG_INFINITY } else { (i as f32 * k).sin() * 7.0 }).collect()
                };
                let (scale, m_lo) = (0.17f32, 0.5f32);
                for m_hi in [Some(-0.25f32), Some(f32::NEG_INFINITY), None] {
                    let (mut lo_want, mut hi_want) = (make(0.37), make(0.71));
                    exp_scaled_sub_sum(isa, &mut lo_want, scale, m_lo);
                    match m_hi {
                        Some(m) if m == f32::NEG_INFINITY => hi_want.fill(0.0),
                        Some(m) => {
                            exp_scaled_sub_sum(isa, &mut hi_want, scale, m);
                        }
                        None => {}
                    }
                    let mut want = vec![0u32; n];
                    super::super::pairs::narrow_row_pairs(isa, &mut want, &lo_want, m_hi.map(|_| &hi_want[..]));
                    let (mut lo, mut hi) = (make(0.37), make(0.71));
                    let mut got = vec![u32::MAX; n + 1];
                    exp_scaled_row_pairs(isa, (&mut lo, m_lo), m_hi.map(|m| (&mut hi[..], m)), scale, &mut got);
                    assert_eq!(&got[..n], &want[..], "{isa} n = {n}, m_hi = {m_hi:?}");
                    assert_eq!(got[n], u32::MAX, "{isa}: wrote past the row, n = {n}");
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&lo), bits(&lo_want), "{isa} n = {n}");
                    if m_hi.is_some() {
                        assert_eq!(bits(&hi), bits(&hi_want), "{isa} n = {n}");
                    }
                }
            }
        }
    }
}
