//! `bf16` operands in the pair layout of [`gemm_bf16`](super::gemm::gemm_bf16): two consecutive
//! elements along the product's `k` dimension in one word, low half first.
//!
//! For `S = Q Kᵀ` the pairs run along the head dim, so a row of `Q` or `K` is already a sequence
//! of pairs and `Kᵀ` is a transpose of words. For `O += P V` they run along the keys: `P` is
//! rounded to `bf16` (as FlashAttention-2 does before its second product) and each word of `V`
//! interleaves two consecutive keys.

use std::any::TypeId;
use std::ops::Range;

use super::gemm::Bf16Pair;
use super::isa::Isa;
use super::transpose::transpose;
use crate::dtype::Element;
use crate::spec::{RowLayout, Sequence};

/// The raw bits of a `bf16` slice; `None` for the other element types.
pub(super) fn bf16_bits<T: Element>(src: &[T]) -> Option<&[u16]> {
    if TypeId::of::<T>() != TypeId::of::<half::bf16>() {
        return None;
    }
    // SAFETY: `T` is `half::bf16` (checked above), a `#[repr(transparent)]` wrapper of `u16`:
    // same size, alignment and validity, so the slice may be viewed as its bits.
    Some(unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u16>(), src.len()) })
}

/// `dst = src` widened to `f32` (exact); lengths equal. `bf16` by a shift, compiled for the
/// instruction set `isa` holds (through `half` it ran element by element on the baseline target:
/// about a tenth of the AVX2 `bf16` forward's time at 1 × 8 × 1024², d 128, session 51); other
/// types by [`Element::widen_slice`].
#[inline]
pub(super) fn widen<T: Element>(isa: Isa, src: &[T], dst: &mut [f32]) {
    match bf16_bits(src) {
        Some(bits) => {
            widen_bf16::<false>(isa, bits, dst);
        }
        None => T::widen_slice(src, dst),
    }
}

/// `bf16` bits widened to `f32` as [`widen`] does; with `FINITE`, also whether every value is
/// finite (in the same pass: the decode's check), else `true`.
#[inline]
pub(super) fn widen_bf16<const FINITE: bool>(isa: Isa, bits: &[u16], dst: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if isa.avx512() {
            // SAFETY: the CPU has AVX-512F and BW (`Isa::avx512` checked them).
            return unsafe { shift_bf16_avx512::<FINITE>(bits, dst) };
        }
        if isa == Isa::Avx2 && std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { shift_bf16_avx2::<FINITE>(bits, dst) };
        }
    }
    let _ = isa;
    shift_bf16::<FINITE>(bits, dst)
}

/// `bf16` bits to `f32`: a shift the compiler vectorises (and with `FINITE` an exponent test).
#[inline(always)]
fn shift_bf16<const FINITE: bool>(src: &[u16], dst: &mut [f32]) -> bool {
    let mut bad = 0u32;
    for (d, &x) in dst.iter_mut().zip(src) {
        let bits = (x as u32) << 16;
        if FINITE {
            bad |= u32::from(bits & 0x7f80_0000 == 0x7f80_0000);
        }
        *d = f32::from_bits(bits);
    }
    bad == 0
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn shift_bf16_avx512<const FINITE: bool>(src: &[u16], dst: &mut [f32]) -> bool {
    shift_bf16::<FINITE>(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn shift_bf16_avx2<const FINITE: bool>(src: &[u16], dst: &mut [f32]) -> bool {
    shift_bf16::<FINITE>(src, dst)
}

#[inline(always)]
fn pair(lo: u16, hi: u16) -> Bf16Pair {
    lo as u32 | (hi as u32) << 16
}

/// The words of a row: elements `2p` and `2p + 1` in word `p`, an odd last element paired with
/// zero. (For an even length these are the row's bytes read as little-endian `u32`.)
#[inline(always)]
fn row_words(row: &[u16]) -> impl Iterator<Item = Bf16Pair> + '_ {
    let pairs = row.chunks_exact(2);
    let last = pairs.remainder().first().map(|&lo| pair(lo, 0));
    pairs.map(|two| pair(two[0], two[1])).chain(last)
}

/// Rows `rows` of head `head` as pairs along the row: `dst[r · ld + p]` = elements `2p, 2p + 1`
/// of row `r` (the `A` operand of `S = Q Kᵀ`).
#[allow(clippy::too_many_arguments)]
pub(super) fn pack_rows(
    dst: &mut [Bf16Pair],
    ld: usize,
    src: &[u16],
    layout: RowLayout,
    seq: &Sequence,
    start: usize,
    rows: Range<usize>,
    head: usize,
    dim: usize,
) {
    for (r, i) in rows.enumerate() {
        let at = layout.row(seq, start, i, head);
        let row = &src[at..at + dim];
        for (w, x) in dst[r * ld..r * ld + dim.div_ceil(2)].iter_mut().zip(row_words(row)) {
            *w = x;
        }
    }
}

/// Rows `rows` of head `head`, transposed into pairs along the row: `dst[p · ld + c]` = elements
/// `2p, 2p + 1` of row `c` (the `B` operand `Kᵀ` of `S = Q Kᵀ`).
#[allow(clippy::too_many_arguments)]
pub(super) fn pack_rows_transposed(
    isa: Isa,
    dst: &mut [Bf16Pair],
    ld: usize,
    src: &[u16],
    layout: RowLayout,
    seq: &Sequence,
    start: usize,
    rows: Range<usize>,
    head: usize,
    dim: usize,
) {
    let words = dim / 2;
    if let Some(src_words) = word_rows(src, layout, seq, start, rows.clone(), head, words) {
        // The common case: rows start on 4-byte boundaries, so `Kᵀ` pairs are a transpose of
        // words (16 × 16 blocks through registers); an odd last element is paired with zero.
        transpose(isa, dst, ld, src_words, layout.token_stride / 2, rows.len(), words);
        if dim % 2 == 1 {
            for (c, i) in rows.enumerate() {
                dst[words * ld + c] = pair(src[layout.row(seq, start, i, head) + dim - 1], 0);
            }
        }
        return;
    }
    // Sixteen rows at a time, so each word of the result is written as part of a 64-byte run
    // (row by row, every word lands on a different line of `dst`).
    const GROUP: usize = 16;
    for c0 in (0..rows.len()).step_by(GROUP) {
        let n = GROUP.min(rows.len() - c0);
        let mut group = [&src[..0]; GROUP];
        for (g, row) in group.iter_mut().zip(rows.start + c0..).take(n) {
            let at = layout.row(seq, start, row, head);
            *g = &src[at..at + dim];
        }
        for p in 0..words {
            for (w, row) in dst[p * ld + c0..p * ld + c0 + n].iter_mut().zip(&group) {
                *w = pair(row[2 * p], row[2 * p + 1]);
            }
        }
        if dim % 2 == 1 {
            for (w, row) in dst[words * ld + c0..words * ld + c0 + n].iter_mut().zip(&group) {
                *w = pair(row[dim - 1], 0);
            }
        }
    }
}

/// The first `words` words of rows `rows` of head `head`, as one `u32` view of row stride
/// `token_stride / 2`; `None` unless every row starts on a 4-byte boundary.
#[allow(clippy::too_many_arguments)]
fn word_rows<'s>(
    src: &'s [u16],
    layout: RowLayout,
    seq: &Sequence,
    start: usize,
    rows: Range<usize>,
    head: usize,
    words: usize,
) -> Option<&'s [u32]> {
    // A little-endian word of two `bf16` is `pair(lo, hi)`.
    if cfg!(target_endian = "big") || rows.is_empty() || words == 0 || layout.token_stride % 2 == 1 {
        return None;
    }
    let at = layout.row(seq, start, rows.start, head);
    let len = ((rows.len() - 1) * layout.token_stride + 2 * words) / 2;
    let first = src.get(at..at + 2 * len)?;
    if first.as_ptr().align_offset(std::mem::align_of::<u32>()) != 0 {
        return None;
    }
    // SAFETY: `first` is `2 · len` initialised `u16`s starting on a 4-byte boundary (checked
    // above): the same bytes are `len` valid `u32`s, borrowed for as long as `src`.
    Some(unsafe { std::slice::from_raw_parts(first.as_ptr().cast::<u32>(), len) })
}

/// Rows `rows` of head `head` interleaved two by two: `dst[q · ld + x]` = element `x` of rows
/// `2q` and `2q + 1` (zero for a missing last row) — the `B` operand `V` of `O += P V`.
#[allow(clippy::too_many_arguments)]
pub(super) fn pack_row_pairs(
    dst: &mut [Bf16Pair],
    ld: usize,
    src: &[u16],
    layout: RowLayout,
    seq: &Sequence,
    start: usize,
    rows: Range<usize>,
    head: usize,
    dim: usize,
) {
    let mut i = rows.start;
    let mut q = 0;
    while i < rows.end {
        let at0 = layout.row(seq, start, i, head);
        let lo = &src[at0..at0 + dim];
        let out = &mut dst[q * ld..q * ld + dim];
        if i + 1 < rows.end {
            let at1 = layout.row(seq, start, i + 1, head);
            let hi = &src[at1..at1 + dim];
            for ((w, &l), &h) in out.iter_mut().zip(lo).zip(hi) {
                *w = pair(l, h);
            }
        } else {
            for (w, &l) in out.iter_mut().zip(lo) {
                *w = pair(l, 0);
            }
        }
        i += 2;
        q += 1;
    }
}

/// `src` rounded to `bf16` (nearest even) in pairs: `dst[p]` = `src[2p], src[2p + 1]`, an odd
/// length padded with zero. `dst` holds at least `src.len().div_ceil(2)` words.
pub(super) fn narrow_to_pairs(isa: Isa, dst: &mut [Bf16Pair], src: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa.bf16_pairs() {
        assert!(dst.len() >= src.len().div_ceil(2), "narrow_to_pairs: destination too short");
        // SAFETY: AVX-512F and AVX-512 BF16 are available (checked above); lengths checked.
        return unsafe { x86::narrow_to_pairs(dst, src) };
    }
    let _ = isa;
    for (p, w) in dst[..src.len().div_ceil(2)].iter_mut().enumerate() {
        let lo = half::bf16::from_f32(src[2 * p]).to_bits();
        let hi = src.get(2 * p + 1).map_or(0, |&x| half::bf16::from_f32(x).to_bits());
        *w = pair(lo, hi);
    }
}

/// Two rows rounded to `bf16` (nearest even) and interleaved: `dst[c]` = `lo[c], hi[c]` (zero
/// when `hi` is `None`) — a row of `P` or `dS` paired along the query rows.
pub(super) fn narrow_row_pairs(isa: Isa, dst: &mut [Bf16Pair], lo: &[f32], hi: Option<&[f32]>) {
    let n = lo.len();
    assert!(dst.len() >= n && hi.is_none_or(|h| h.len() >= n), "narrow_row_pairs: lengths");
    #[cfg(target_arch = "x86_64")]
    if isa.bf16_pairs() {
        // SAFETY: AVX-512F and AVX-512 BF16 are available (checked above); lengths checked.
        return unsafe { x86::narrow_row_pairs(dst, lo, hi) };
    }
    let _ = isa;
    let round = |x: f32| half::bf16::from_f32(x).to_bits();
    for (c, w) in dst[..n].iter_mut().enumerate() {
        *w = pair(round(lo[c]), hi.map_or(0, |h| round(h[c])));
    }
}

/// One query row of the backward pass's `dS = P ∘ (dP - D)`: `(P row, dP row, D)`.
pub(super) type DsRow<'a> = (&'a [f32], &'a [f32], f32);

/// `dS` of two query rows rounded to `bf16` once and written in both layouts its products need,
/// in one pass over `P` and `dP`: pairs along the rows into `rows_dst` (`rows_dst[c]` = `lo[c],
/// hi[c]`, zero for a missing `hi`; the `A` operand of `dK += dSᵀ Q`) and each row as pairs along
/// the keys into `keys_lo` / `keys_hi` (an odd length padded with zero; the `A` operand of
/// `dQ += dS K`). Bitwise [`narrow_row_pairs`] and [`narrow_to_pairs`] of `p · (dp - d)`.
pub(super) fn ds_to_pairs(
    isa: Isa,
    lo: DsRow<'_>,
    hi: Option<DsRow<'_>>,
    rows_dst: &mut [Bf16Pair],
    keys_lo: &mut [Bf16Pair],
    keys_hi: Option<&mut [Bf16Pair]>,
) {
    let n = lo.0.len();
    let kp = n.div_ceil(2);
    assert!(
        lo.1.len() >= n
            && rows_dst.len() >= n
            && keys_lo.len() >= kp
            && hi.is_none_or(|h| h.0.len() >= n && h.1.len() >= n)
            && hi.is_some() == keys_hi.is_some()
            && keys_hi.as_ref().is_none_or(|k| k.len() >= kp),
        "ds_to_pairs: lengths"
    );
    #[cfg(target_arch = "x86_64")]
    if isa.bf16_pairs() {
        // SAFETY: AVX-512F and AVX-512 BF16 are available (checked above); lengths checked.
        return unsafe { x86::ds_to_pairs(lo, hi, rows_dst, keys_lo, keys_hi) };
    }
    let ds = |(p, dp, d): DsRow<'_>| -> Vec<f32> { p[..n].iter().zip(dp).map(|(&p, &dp)| p * (dp - d)).collect() };
    let ds_lo = ds(lo);
    let ds_hi = hi.map(ds);
    narrow_row_pairs(isa, rows_dst, &ds_lo, ds_hi.as_deref());
    narrow_to_pairs(isa, keys_lo, &ds_lo);
    if let (Some(k), Some(h)) = (keys_hi, &ds_hi) {
        narrow_to_pairs(isa, k, h);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::lanes::{interleave_rows, load_ps, store_epi32};

    /// The first `k` of 16 lanes.
    fn mask(k: usize) -> __mmask16 {
        if k >= 16 {
            0xFFFF
        } else {
            ((1u32 << k) - 1) as u16
        }
    }

    /// # Safety
    /// AVX-512F and AVX-512 BF16 available; the lengths checked by `super::ds_to_pairs`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn ds_to_pairs(
        lo: super::DsRow<'_>,
        hi: Option<super::DsRow<'_>>,
        rows_dst: &mut [u32],
        keys_lo: &mut [u32],
        keys_hi: Option<&mut [u32]>,
    ) {
        let n = lo.0.len();
        // A missing `hi` reads the `lo` row with every lane masked off (zeros) and stores nothing.
        let (hi_rows, hi_live) = match hi {
            Some(h) => (h, 0xFFFF),
            None => (lo, 0),
        };
        let (klo, khi) = (keys_lo.as_mut_ptr(), keys_hi.map_or(std::ptr::null_mut(), |k| k.as_mut_ptr()));
        let rp = rows_dst.as_mut_ptr();
        let mut j = 0;
        while j < n {
            let w = (n - j).min(32);
            let (k0, k1) = (mask(w), mask(w.saturating_sub(16)));
            // SAFETY: loads masked to the `w` valid columns from `j` (the second half's address
            // may lie past the row when `k1 = 0`, and is then never read); stores masked to the
            // `w` row words from `j` and the `w.div_ceil(2)` key words from `j / 2`, in bounds by
            // the caller's contract. Masked-off lanes are exact zeros, which pad an odd tail.
            unsafe {
                let ds = |(p, dp, d): super::DsRow<'_>, k: __mmask16, off: usize| {
                    let pv = load_ps(k, p.as_ptr().wrapping_add(j + off));
                    let dpv = load_ps(k, dp.as_ptr().wrapping_add(j + off));
                    _mm512_maskz_mul_ps(k, pv, _mm512_sub_ps(dpv, _mm512_set1_ps(d)))
                };
                let (l0, l1) = (ds(lo, k0, 0), ds(lo, k1, 16));
                let (h0, h1) = (ds(hi_rows, k0 & hi_live, 0), ds(hi_rows, k1 & hi_live, 16));
                // Each row's 32 values as bf16 in key order: 16 words of key pairs.
                let bl: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(l1, l0));
                let bh: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(h1, h0));
                let kw = mask(w.div_ceil(2));
                store_epi32(klo.add(j / 2), kw, bl);
                if hi_live != 0 {
                    store_epi32(khi.add(j / 2), kw, bh);
                }
                // And interleaved across the two rows: word c = lo[c] | hi[c] << 16.
                let (w0, w1) = interleave_rows(bl, bh);
                store_epi32(rp.add(j), k0, w0);
                store_epi32(rp.wrapping_add(j + 16), k1, w1);
            }
            j += w;
        }
    }

    /// # Safety
    /// AVX-512F and AVX-512 BF16 available; `dst` and `hi` at least as long as `lo`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn narrow_row_pairs(dst: &mut [u32], lo: &[f32], hi: Option<&[f32]>) {
        let n = lo.len();
        let dp = dst.as_mut_ptr();
        let mut j = 0;
        while j < n {
            let k = mask((n - j).min(16));
            // SAFETY: loads and the store masked to the valid lanes from `j`, in bounds by the
            // caller's contract. Each row becomes 16 bf16 in a 256-bit half, zero-extended to
            // 32-bit lanes; the second row is shifted into the high halves.
            unsafe {
                let bits = |row: &[f32]| {
                    let b: __m256i =
                        std::mem::transmute(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, row.as_ptr().add(j))));
                    _mm512_cvtepu16_epi32(b)
                };
                let mut w = bits(lo);
                if let Some(hi) = hi {
                    w = _mm512_or_si512(w, _mm512_slli_epi32::<16>(bits(hi)));
                }
                _mm512_mask_storeu_epi32(dp.add(j).cast(), k, w);
            }
            j += 16;
        }
    }

    /// # Safety
    /// AVX-512F and AVX-512 BF16 available; `dst.len() >= src.len().div_ceil(2)`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn narrow_to_pairs(dst: &mut [u32], src: &[f32]) {
        let n = src.len();
        let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
        let mut j = 0;
        while j < n {
            let w = (n - j).min(32);
            // SAFETY: loads masked to the `w` valid floats from `j`, the store to the
            // `w.div_ceil(2)` words from `j / 2` (in bounds by the caller's contract); masked-off
            // lanes load as 0, so an odd tail is padded with a zero.
            unsafe {
                let lo = _mm512_maskz_loadu_ps(mask(w), sp.add(j));
                let hi = _mm512_maskz_loadu_ps(mask(w.saturating_sub(16)), sp.wrapping_add(j + 16));
                let bf: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_mask_storeu_epi32(dp.add(j / 2).cast(), mask(w.div_ceil(2)), bf);
            }
            j += w;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widening_is_exact_on_every_path_and_for_every_type() {
        // Every class of bf16: zeros, subnormals, normals of both signs, infinities, NaNs; a
        // length that is no multiple of any vector width.
        let mut bits: Vec<u16> = vec![0x0000, 0x8000, 0x0001, 0x807f, 0x3f80, 0xc2f7, 0x7f7f, 0x7f80, 0xff80, 0x7fc0];
        let mut state = 0x2545_f491u32;
        bits.extend((0..45).map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state as u16
        }));
        let src: Vec<half::bf16> = bits.iter().map(|&b| half::bf16::from_bits(b)).collect();
        let wide: Vec<f32> = src.iter().map(|x| x.to_f32()).collect();
        let f16s: Vec<half::f16> = wide.iter().map(|&x| half::f16::from_f32(x)).collect();
        for isa in Isa::available() {
            let mut dst = vec![f32::NAN; src.len() + 1];
            widen(isa, &src, &mut dst[..src.len()]);
            for (i, (&got, &want)) in dst.iter().zip(&wide).enumerate() {
                // (half quiets a signalling NaN; the shift keeps its bits: both are NaN.)
                assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{isa:?} element {i}");
            }
            assert!(dst[src.len()].is_nan(), "nothing written past the row");
            // With the decode's finiteness check: false here (infinities, NaNs), true without them.
            let mut again = vec![0.0; src.len()];
            assert!(!widen_bf16::<true>(isa, &bits, &mut again));
            assert!(again.iter().zip(&dst).all(|(a, b)| a.to_bits() == b.to_bits()));
            let finite: Vec<u16> = bits.iter().copied().filter(|b| b & 0x7f80 != 0x7f80).collect();
            assert!(widen_bf16::<true>(isa, &finite, &mut again[..finite.len()]));
            let mut dst = vec![0.0; src.len()];
            widen(isa, &f16s, &mut dst);
            for (i, (&got, x)) in dst.iter().zip(&f16s).enumerate() {
                assert!(got.to_bits() == x.to_f32().to_bits() || (got.is_nan() && x.is_nan()), "f16 element {i}");
            }
            widen(isa, &wide, &mut dst);
            assert!(dst.iter().zip(&wide).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn narrowing_rounds_to_nearest_even_and_pads_odd_lengths() {
        let src: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 1.001_23 + 1.0 / 3.0).collect();
        for isa in Isa::available() {
            let mut dst = vec![u32::MAX; 20];
            narrow_to_pairs(isa, &mut dst, &src);
            for (i, &x) in src.iter().enumerate() {
                let half = if i % 2 == 0 { dst[i / 2] & 0xFFFF } else { dst[i / 2] >> 16 };
                assert_eq!(half as u16, half::bf16::from_f32(x).to_bits(), "element {i}");
            }
            assert_eq!(dst[18] >> 16, 0, "odd tail padded with zero");
            assert_eq!(dst[19], u32::MAX, "nothing written past the pairs");
        }
    }

    #[test]
    fn row_pairs_interleave_two_rounded_rows() {
        let lo: Vec<f32> = (0..21).map(|i| i as f32 * 0.377 - 3.1).collect();
        let hi: Vec<f32> = (0..21).map(|i| 1.0 / (i as f32 + 0.7)).collect();
        let round = |x: f32| half::bf16::from_f32(x).to_bits() as u32;
        for (isa, hi_row) in Isa::available().into_iter().flat_map(|isa| [(isa, Some(&hi[..])), (isa, None)]) {
            let mut dst = vec![u32::MAX; 22];
            narrow_row_pairs(isa, &mut dst, &lo, hi_row);
            for c in 0..21 {
                assert_eq!(dst[c], round(lo[c]) | hi_row.map_or(0, |h| round(h[c])) << 16, "column {c}");
            }
            assert_eq!(dst[21], u32::MAX, "nothing written past the row");
        }
    }

    #[test]
    fn fused_ds_pairs_equal_the_two_narrowings() {
        for n in [1usize, 2, 15, 16, 17, 31, 32, 33, 77, 128] {
            let p: Vec<f32> = (0..n).map(|i| ((i as f32 * 0.31).sin() + 1.0) * 0.4).collect();
            let dp: Vec<f32> = (0..n).map(|i| (i as f32 * 0.77).cos() * 3.0).collect();
            let p2: Vec<f32> = (0..n).map(|i| 1.0 / (i as f32 + 1.3)).collect();
            let dp2: Vec<f32> = (0..n).map(|i| i as f32 * 0.1 - 2.0).collect();
            let ds =
                |p: &[f32], dp: &[f32], d: f32| -> Vec<f32> { p.iter().zip(dp).map(|(&p, &x)| p * (x - d)).collect() };
            let (ds_lo, ds_hi) = (ds(&p, &dp, 0.3), ds(&p2, &dp2, -1.1));
            for (isa, with_hi) in Isa::available().into_iter().flat_map(|isa| [(isa, true), (isa, false)]) {
                let mut rows_want = vec![0u32; n];
                narrow_row_pairs(isa, &mut rows_want, &ds_lo, with_hi.then_some(&ds_hi[..]));
                let (mut lo_want, mut hi_want) = (vec![0u32; n.div_ceil(2)], vec![0u32; n.div_ceil(2)]);
                narrow_to_pairs(isa, &mut lo_want, &ds_lo);
                narrow_to_pairs(isa, &mut hi_want, &ds_hi);
                let mut rows = vec![u32::MAX; n + 1];
                let (mut keys_lo, mut keys_hi) = (vec![u32::MAX; n.div_ceil(2) + 1], vec![u32::MAX; n.div_ceil(2) + 1]);
                let hi = with_hi.then_some((&p2[..], &dp2[..], -1.1f32));
                let keys_hi_dst = with_hi.then_some(&mut keys_hi[..]);
                ds_to_pairs(isa, (&p, &dp, 0.3), hi, &mut rows, &mut keys_lo, keys_hi_dst);
                assert_eq!(&rows[..n], &rows_want[..], "rows, n = {n}");
                assert_eq!(rows[n], u32::MAX, "wrote past the row pairs, n = {n}");
                assert_eq!(&keys_lo[..n.div_ceil(2)], &lo_want[..], "keys of lo, n = {n}");
                assert_eq!(keys_lo[n.div_ceil(2)], u32::MAX, "wrote past the key pairs, n = {n}");
                if with_hi {
                    assert_eq!(&keys_hi[..n.div_ceil(2)], &hi_want[..], "keys of hi, n = {n}");
                } else {
                    assert!(keys_hi.iter().all(|&w| w == u32::MAX), "no hi row, nothing written");
                }
            }
        }
    }
}
