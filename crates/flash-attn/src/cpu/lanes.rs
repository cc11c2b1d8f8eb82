//! Loads and stores of 16 lanes under a mask, plain when the mask selects all of them: Zen 4
//! runs the masked forms measurably slower (step 21 of `docs/cpu-performance.md`), and the
//! row kernels meet a partial mask only at a row's end.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

/// All 16 lanes.
const ALL: __mmask16 = 0xFFFF;

/// The lanes of `k` loaded from `p`, the others zero.
///
/// # Safety
/// AVX-512F available; the selected lanes readable at `p`.
#[target_feature(enable = "avx512f")]
#[inline]
pub unsafe fn load_ps(k: __mmask16, p: *const f32) -> __m512 {
    // SAFETY: the caller's contract; with all lanes selected the whole vector is readable.
    unsafe {
        if k == ALL {
            _mm512_loadu_ps(p)
        } else {
            _mm512_maskz_loadu_ps(k, p)
        }
    }
}

/// The lanes of `k` of `v` stored at `p`.
///
/// # Safety
/// AVX-512F available; the selected lanes writable at `p`.
#[target_feature(enable = "avx512f")]
#[inline]
pub unsafe fn store_ps(p: *mut f32, k: __mmask16, v: __m512) {
    // SAFETY: as above.
    unsafe {
        if k == ALL {
            _mm512_storeu_ps(p, v)
        } else {
            _mm512_mask_storeu_ps(p, k, v)
        }
    }
}

/// The 32-bit lanes of `k` of `v` stored at `p`.
///
/// # Safety
/// AVX-512F available; the selected lanes writable at `p`.
#[target_feature(enable = "avx512f")]
#[inline]
pub unsafe fn store_epi32(p: *mut u32, k: __mmask16, v: __m512i) {
    // SAFETY: as above.
    unsafe {
        if k == ALL {
            _mm512_storeu_si512(p.cast(), v)
        } else {
            _mm512_mask_storeu_epi32(p.cast(), k, v)
        }
    }
}

/// Two rows of 32 bf16 (`lo`, `hi`, each with its first 16 values in the low 256 bits, as
/// `_mm512_cvtne2ps_pbh` packs them) interleaved into the 32-bit words `lo[c] | hi[c] << 16` of
/// columns 0..16 and 16..32: the row-pair layout of the bf16 products.
///
/// # Safety
/// AVX-512F available.
#[target_feature(enable = "avx512f")]
#[inline]
pub unsafe fn interleave_rows(lo: __m512i, hi: __m512i) -> (__m512i, __m512i) {
    let word = |half_l: __m256i, half_h: __m256i| {
        _mm512_or_si512(_mm512_cvtepu16_epi32(half_l), _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(half_h)))
    };
    (
        word(_mm512_castsi512_si256(lo), _mm512_castsi512_si256(hi)),
        word(_mm512_extracti64x4_epi64::<1>(lo), _mm512_extracti64x4_epi64::<1>(hi)),
    )
}
