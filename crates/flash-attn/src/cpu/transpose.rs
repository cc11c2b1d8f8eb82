//! `Kᵀ` from `K`: the transpose of a tile of 4-byte elements (`f32`, or `bf16` pairs read as
//! words), with an AVX-512 path that moves 16 × 16 blocks through registers, an AVX2 path that
//! moves 8 × 8 blocks, and a portable loop.
//!
//! Row by row, every element of a source row lands on a different line of the result, and at
//! d = 128 the result (64 KB) does not fit L1: each store went to L2. A 16 × 16 block is read as
//! 16 row vectors and written as 16 whole 64-byte lines.

use super::isa::Isa;

/// A 4-byte element the transpose moves as raw bits.
pub(super) trait Word: Copy {}
impl Word for f32 {}
impl Word for u32 {}

/// `dst[c][r] = src[r][c]` for a `rows × cols` tile (`src` rows of stride `ld_src`, `dst` rows of
/// stride `ld_dst`), on the AVX-512 or AVX2 path when `isa` is one (pure data movement: every path
/// gives the same bits); other paths run the portable loop.
pub(super) fn transpose<E: Word>(
    isa: Isa,
    dst: &mut [E],
    ld_dst: usize,
    src: &[E],
    ld_src: usize,
    rows: usize,
    cols: usize,
) {
    if rows == 0 || cols == 0 {
        return;
    }
    // The intrinsic path indexes without bounds checks: establish every access is in bounds.
    assert!(
        src.len() >= (rows - 1) * ld_src + cols && dst.len() >= (cols - 1) * ld_dst + rows,
        "transpose: tile views out of bounds"
    );
    #[cfg(target_arch = "x86_64")]
    if isa.avx512() {
        // SAFETY: AVX-512F is available (checked just above), `E` is 4 bytes (`Word` is only
        // implemented for f32 and u32) and the assert above bounds every access.
        unsafe { x86::transpose(dst.as_mut_ptr().cast(), ld_dst, src.as_ptr().cast(), ld_src, rows, cols) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && isa.is_supported() {
        // SAFETY: AVX2 is available (is_supported), `E` is 4 bytes and the assert above bounds
        // every access.
        unsafe { x86::transpose_avx2(dst.as_mut_ptr().cast(), ld_dst, src.as_ptr().cast(), ld_src, rows, cols) };
        return;
    }
    let _ = isa;
    for r in 0..rows {
        for (c, &x) in src[r * ld_src..r * ld_src + cols].iter().enumerate() {
            dst[c * ld_dst + r] = x;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::lanes::{load_ps, store_ps};

    fn mask(n: usize) -> __mmask16 {
        if n >= 16 {
            0xFFFF
        } else {
            ((1u32 << n) - 1) as u16
        }
    }

    /// # Safety
    /// AVX-512F available; `src` holds `rows` rows of `cols` elements at stride `ld_src`, `dst`
    /// holds `cols` rows of `rows` elements at stride `ld_dst`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn transpose(dst: *mut f32, ld_dst: usize, src: *const f32, ld_src: usize, rows: usize, cols: usize) {
        for r0 in (0..rows).step_by(16) {
            let nr = (rows - r0).min(16);
            for c0 in (0..cols).step_by(16) {
                let nc = (cols - c0).min(16);
                // SAFETY: rows r0..r0 + nr of src and rows c0..c0 + nc of dst are in bounds; the
                // masks select columns c0..c0 + nc of src and lanes r0..r0 + nr of dst.
                unsafe { block(dst.add(c0 * ld_dst + r0), ld_dst, src.add(r0 * ld_src + c0), ld_src, nr, nc) };
            }
        }
    }

    /// [`transpose`] in 8 × 8 blocks on AVX2: whole blocks through registers (eight row loads,
    /// eight 32-byte stores); the ragged edges (fewer than 8 rows or columns left) element by
    /// element. (The scalar loop's strided stores were 13% of an `f32` forward at 128², d 128, on
    /// this path.)
    ///
    /// # Safety
    /// AVX2 available; as [`transpose`].
    #[target_feature(enable = "avx2")]
    pub unsafe fn transpose_avx2(
        dst: *mut f32,
        ld_dst: usize,
        src: *const f32,
        ld_src: usize,
        rows: usize,
        cols: usize,
    ) {
        let (full_r, full_c) = (rows / 8 * 8, cols / 8 * 8);
        for r0 in (0..full_r).step_by(8) {
            for c0 in (0..full_c).step_by(8) {
                // SAFETY: rows r0..r0 + 8 of src hold columns c0..c0 + 8, rows c0..c0 + 8 of dst
                // hold columns r0..r0 + 8 (all within the tile).
                unsafe { block8(dst.add(c0 * ld_dst + r0), ld_dst, src.add(r0 * ld_src + c0), ld_src) };
            }
        }
        // The edges: columns past full_c of every row, and rows past full_r of the others.
        for r in 0..rows {
            let c_from = if r < full_r { full_c } else { 0 };
            for c in c_from..cols {
                // SAFETY: r < rows, c < cols: inside both tiles.
                unsafe { *dst.add(c * ld_dst + r) = *src.add(r * ld_src + c) };
            }
        }
    }

    /// One 8 × 8 block: rows interleaved in pairs, then quadruples, then 128-bit halves swapped.
    ///
    /// # Safety
    /// AVX available; 8 rows of 8 elements readable at `src` (stride `ld_src`) and writable at
    /// `dst` (stride `ld_dst`).
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn block8(dst: *mut f32, ld_dst: usize, src: *const f32, ld_src: usize) {
        let mut r = [_mm256_setzero_ps(); 8];
        for (i, ri) in r.iter_mut().enumerate() {
            // SAFETY: row i of the block is readable (the caller's contract).
            *ri = unsafe { _mm256_loadu_ps(src.add(i * ld_src)) };
        }
        let mut t = [_mm256_setzero_ps(); 8];
        for i in 0..4 {
            t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        for i in 0..2 {
            let (a, b, c, d) = (t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
            r[4 * i] = _mm256_shuffle_ps::<0x44>(a, c);
            r[4 * i + 1] = _mm256_shuffle_ps::<0xEE>(a, c);
            r[4 * i + 2] = _mm256_shuffle_ps::<0x44>(b, d);
            r[4 * i + 3] = _mm256_shuffle_ps::<0xEE>(b, d);
        }
        for i in 0..4 {
            // Lanes 0-3 of rows i and 4 + i give column i; lanes 4-7 give column 4 + i.
            t[i] = _mm256_permute2f128_ps::<0x20>(r[i], r[4 + i]);
            t[4 + i] = _mm256_permute2f128_ps::<0x31>(r[i], r[4 + i]);
        }
        for (c, tc) in t.iter().enumerate() {
            // SAFETY: row c of the block is writable (the caller's contract).
            unsafe { _mm256_storeu_ps(dst.add(c * ld_dst), *tc) };
        }
    }

    /// One block of `nr ≤ 16` rows and `nc ≤ 16` columns.
    ///
    /// # Safety
    /// AVX-512F available; `nr` rows of `nc` elements readable at `src`, `nc` rows of `nr`
    /// elements writable at `dst`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn block(dst: *mut f32, ld_dst: usize, src: *const f32, ld_src: usize, nr: usize, nc: usize) {
        let (load, store) = (mask(nc), mask(nr));
        let mut r = [_mm512_setzero_ps(); 16];
        for (i, ri) in r.iter_mut().enumerate().take(nr) {
            // SAFETY: row i < nr is readable for the nc columns the mask selects.
            *ri = unsafe { load_ps(load, src.add(i * ld_src)) };
        }
        // Pairs of rows interleaved, then quadruples, then 128-bit lanes: after the three steps,
        // vector c holds column c.
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        for i in 0..4 {
            let (a, b, c, d) = (t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
            r[4 * i] = _mm512_shuffle_ps::<0x44>(a, c);
            r[4 * i + 1] = _mm512_shuffle_ps::<0xEE>(a, c);
            r[4 * i + 2] = _mm512_shuffle_ps::<0x44>(b, d);
            r[4 * i + 3] = _mm512_shuffle_ps::<0xEE>(b, d);
        }
        for half in 0..2 {
            let b = 8 * half;
            for i in 0..4 {
                t[b + i] = _mm512_shuffle_f32x4::<0x88>(r[b + i], r[b + 4 + i]);
                t[b + 4 + i] = _mm512_shuffle_f32x4::<0xDD>(r[b + i], r[b + 4 + i]);
            }
        }
        for i in 0..8 {
            r[i] = _mm512_shuffle_f32x4::<0x88>(t[i], t[8 + i]);
            r[8 + i] = _mm512_shuffle_f32x4::<0xDD>(t[i], t[8 + i]);
        }
        for (c, rc) in r.iter().enumerate().take(nc) {
            // SAFETY: row c < nc of dst is writable for the nr lanes the mask selects.
            unsafe { store_ps(dst.add(c * ld_dst), store, *rc) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_transposes_every_shape() {
        for (rows, cols) in [(1, 1), (8, 8), (16, 16), (17, 5), (128, 64), (33, 128), (100, 40), (3, 31), (9, 23)] {
            let (ld_src, ld_dst) = (cols + 3, rows + 5);
            let src: Vec<f32> = (0..rows * ld_src).map(|i| i as f32 * 0.5 - 7.0).collect();
            for path in Isa::available() {
                let mut dst = vec![f32::NAN; cols * ld_dst];
                transpose(path, &mut dst, ld_dst, &src, ld_src, rows, cols);
                for c in 0..cols {
                    for r in 0..rows {
                        assert_eq!(
                            dst[c * ld_dst + r].to_bits(),
                            src[r * ld_src + c].to_bits(),
                            "{path:?} {rows}x{cols}"
                        );
                    }
                    assert!(dst[c * ld_dst + rows..(c + 1) * ld_dst].iter().all(|x| x.is_nan()), "wrote past a row");
                }
            }
        }
    }
}
