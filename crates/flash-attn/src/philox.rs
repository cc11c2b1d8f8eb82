//! The counter-based RNG behind attention dropout (DESIGN §2, step 6): Philox4x32-10 and the
//! keep mask built on it, defined bit for bit so that the CPU backend, the backward pass and the
//! CUDA kernels (`kernels/*.cuh`, a direct port of this file) draw the same mask without storing
//! it.
//!
//! ```
//! use flash_attn::philox::DropoutRng;
//!
//! // p = 0.1, seed 42, offset 0; sequence 0, query head 3 of 8, query row 5, keys 0..64.
//! let rng = DropoutRng::new(0.1, 42, 0);
//! let mut keep = [false; 64];
//! rng.keep_row(0, 3, 8, 5, 0, &mut keep);
//! assert_eq!(keep[17], rng.keep(0, 3, 8, 5, 17));
//! ```
//!
//! # Philox4x32-10
//!
//! [`philox4x32_10`] is the generator of Salmon, Moraes, Dror and Shaw, "Parallel Random Numbers:
//! As Easy as 1, 2, 3" (SC'11), exactly as in the Random123 library (`philox4x32_R(10, ..)`):
//! 10 rounds of
//!
//! ```text
//! (hi0, lo0) = mulhilo(0xD2511F53, c0)        // 32x32 -> 64-bit product, high and low halves
//! (hi1, lo1) = mulhilo(0xCD9E8D57, c2)
//! c = [hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0]
//! ```
//!
//! with the key bumped by the Weyl increments `k0 += 0x9E3779B9`, `k1 += 0xBB67AE85` (wrapping)
//! between consecutive rounds: 10 rounds, 9 bumps. Only `u32` operations and 32x32 -> 64-bit
//! multiplies, no branches; in CUDA `hi = __umulhi(m, c)`, `lo = m * c`.
//!
//! # The dropout keep mask
//!
//! A dropout call has `p` in `[0, 1)` (checked by the caller), a 64-bit `seed` and a 32-bit
//! `offset` (a fresh one per dropout call made with the same seed). In score element
//! `(b, h, i, j)`, `b` is the sequence index in the batch (the varlen sequence index for packed
//! batches), `h` the query head, `hq` the number of query heads, `i` the query position and `j`
//! the key position, both counted from the start of that sequence. Every index is a `u32` (wider
//! indices are reduced mod 2^32) and all arithmetic wraps mod 2^32. Each element takes **8 random
//! bits**, so one Philox call (128 bits) serves 16 elements, as in FlashAttention-2. The 16 are
//! the ones one GPU thread holds of a 16 x 32 block of scores in the tensor-core fragment layout
//! (rows `g` and `g + 8` of the block, columns `8n + 2t` and `8n + 2t + 1` for `n = 0..4`), so the
//! forward kernels draw each call once and use all of it:
//!
//! ```text
//! key       = [seed as u32, (seed >> 32) as u32]                  // low word, high word
//! counter   = [4·(j / 32) + (j % 8) / 2,  8·(i / 16) + i % 8,  b·hq + h,  offset]
//! byte      = 8·((i % 16) / 8) + 2·((j % 32) / 8) + j % 2          // 0 .. 15
//! u         = (philox4x32_10(counter, key)[byte / 4] >> 8·(byte % 4)) & 0xff
//! threshold = min(round(p · 256), 255)                            // in f64, half away from 0
//! keep      = u >= threshold
//! ```
//!
//! The element is dropped with probability `threshold / 256`: `p` rounded to the nearest multiple
//! of 1/256 (at most 255/256, so some element is always kept, and `p < 1/512` drops nothing).
//! `p · 256` is exact in f64 (p is an f32), so the threshold is the same integer on every machine.
//!
//! A kept probability is scaled by `1 / (1 - p)` (DESIGN §2 step 6): [`DropoutRng::scale`] is that
//! factor computed in f32 as `1.0f / (1.0f - p)`, and [`DropoutRng::apply_row`] multiplies a row of
//! probabilities by it or by 0.

/// Philox4x32 round multipliers (Salmon et al., SC'11; Random123 `PHILOX_M4x32_0/1`).
const PHILOX_M4X32: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];

/// Philox4x32 key increments (a Weyl sequence: the fractional parts of the golden ratio and of
/// `sqrt(3)` in 0.32 fixed point; Random123 `PHILOX_W32_0/1`).
const PHILOX_W32: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];

/// Rounds of Philox4x32-10.
const ROUNDS: usize = 10;

/// Random bits per element: one byte, compared with an 8-bit threshold.
const LEVELS: f64 = 256.0;

/// High and low 32 bits of the 64-bit product `a * b`.
#[inline(always)]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let product = u64::from(a) * u64::from(b);
    ((product >> 32) as u32, product as u32)
}

/// One Philox4x32 round (Random123 `_philox4x32round`).
#[inline(always)]
fn round(c: [u32; 4], k: [u32; 2]) -> [u32; 4] {
    let (hi0, lo0) = mulhilo(PHILOX_M4X32[0], c[0]);
    let (hi1, lo1) = mulhilo(PHILOX_M4X32[1], c[2]);
    [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0]
}

/// The key schedule between rounds (Random123 `_philox4x32bumpkey`).
#[inline(always)]
fn bump_key(k: [u32; 2]) -> [u32; 2] {
    [k[0].wrapping_add(PHILOX_W32[0]), k[1].wrapping_add(PHILOX_W32[1])]
}

/// Philox4x32-10: maps a 128-bit `counter` under a 64-bit `key` to 128 random bits.
///
/// Bit-identical to Random123's `philox4x32(ctr, key)` (10 rounds); see the
/// [module docs](self) for the round function and the known-answer tests for the vectors.
#[inline]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = round(counter, key);
    let mut k = key;
    for _ in 1..ROUNDS {
        k = bump_key(k);
        c = round(c, k);
    }
    c
}

/// The dropout keep mask of one dropout call: Philox4x32-10 keyed by `(seed, offset)`, 8 random
/// bits per element `(b, h, i, j)`, as defined bit for bit in the [module docs](self).
///
/// [`keep`](Self::keep) is the definition, one element per Philox call, in the `u32` words of the
/// counter. The row methods are the fast path for the CPU kernels: they take the kernels' `usize`
/// indices, reduce each mod 2^32 (`as u32`) and draw eight keys of a row per Philox call,
/// bit-identical to `keep` on the reduced indices.
///
/// Cheap to copy; the same value regenerates the same mask in the backward pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutRng {
    /// `[low 32 bits of seed, high 32 bits of seed]`.
    key: [u32; 2],
    /// Counter word 3.
    offset: u32,
    /// An element is kept iff its random byte `u` satisfies `u >= threshold` (0 ..= 255).
    threshold: u32,
    /// `1 / (1 - p)` in f32: the factor applied to kept probabilities.
    scale: f32,
}

impl DropoutRng {
    /// The keep mask for drop probability `p`, `seed` and `offset`.
    ///
    /// `p` must be in `[0, 1)`; the caller validates it (the spec rejects anything else). Out of
    /// range it still never panics: a negative or NaN `p` keeps everything, `p >= 1` keeps one
    /// element in 256 (and its scale is infinite).
    pub fn new(p: f32, seed: u64, offset: u32) -> Self {
        // Exact in f64: p has a 24-bit mantissa. The `as` cast saturates (NaN -> 0), so no input
        // panics; `min` keeps the byte comparison able to keep something.
        let threshold = ((f64::from(p) * LEVELS).round() as u32).min(255);
        Self { key: [seed as u32, (seed >> 32) as u32], offset, threshold, scale: 1.0 / (1.0 - p) }
    }

    /// The Philox key `[low 32 bits of seed, high 32 bits of seed]` (a kernel argument).
    pub fn key(&self) -> [u32; 2] {
        self.key
    }

    /// The offset, counter word 3 (a kernel argument).
    pub fn offset(&self) -> u32 {
        self.offset
    }

    /// `min(round(p · 256), 255)`: an element is kept iff its random byte `u` has
    /// `u >= threshold` (a kernel argument). The drop rate is `threshold / 256`.
    pub fn threshold(&self) -> u32 {
        self.threshold
    }

    /// `1 / (1 - p)` computed in f32: the factor a kept probability is multiplied by.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Whether element `(b, h, i, j)` is kept: sequence `b`, query head `h` of `hq`, query
    /// position `i`, key position `j`. One Philox call; use the row methods for runs of keys.
    #[inline]
    pub fn keep(&self, b: u32, h: u32, hq: u32, i: u32, j: u32) -> bool {
        let counter =
            [4 * (j / 32) + (j % 8) / 2, 8 * (i / 16) + i % 8, b.wrapping_mul(hq).wrapping_add(h), self.offset];
        let byte = 8 * ((i % 16) / 8) + 2 * ((j % 32) / 8) + j % 2;
        let words = philox4x32_10(counter, self.key);
        self.keeps(words[(byte / 4) as usize] >> (8 * (byte % 4)))
    }

    /// Keep bits of keys `j0 .. j0 + out.len()` of query row `(b, h, i)` into `out`:
    /// `out[t] == self.keep(b, h, hq, i, j0 + t)` (indices mod 2^32), eight keys per Philox call,
    /// for any `j0` and length.
    pub fn keep_row(&self, b: usize, h: usize, hq: usize, i: usize, j0: usize, out: &mut [bool]) {
        self.for_each_in_row(b, h, hq, i, j0, out, |x, keep| *x = keep);
    }

    /// Applies dropout to probabilities `row` of keys `j0 .. j0 + row.len()` of query row
    /// `(b, h, i)` in place: each is multiplied by `kept` (normally [`scale`](Self::scale),
    /// `1 / (1 - p)`) where the element is kept and by `0.0` where it is dropped. Multiplying
    /// rather than overwriting lets NaN and infinities propagate as in the oracle's `P · keep`.
    #[allow(clippy::too_many_arguments)] // the element's five indices, the factor and the row
    pub fn apply_row(&self, b: usize, h: usize, hq: usize, i: usize, j0: usize, kept: f32, row: &mut [f32]) {
        self.for_each_in_row(b, h, hq, i, j0, row, |x, keep| *x *= if keep { kept } else { 0.0 });
    }

    /// Whether the random byte in the low 8 bits of `u` keeps its element.
    #[inline(always)]
    fn keeps(&self, u: u32) -> bool {
        (u & 0xff) >= self.threshold
    }

    /// The random bytes of keys `jb .. jb + 32` (`jb` a multiple of 32) of query row `(bh, i)`:
    /// four Philox calls, each giving the row eight bytes (two of its four words).
    #[inline]
    fn block_bytes(&self, bh: u32, i: u32, jb: u32) -> [u8; 32] {
        let mut bytes = [0u8; 32];
        let half = 2 * ((i % 16) / 8) as usize;
        for t in 0..4u32 {
            let words = philox4x32_10([4 * (jb / 32) + t, 8 * (i / 16) + i % 8, bh, self.offset], self.key);
            for n in 0..4u32 {
                let word = words[half + (n / 2) as usize];
                for e in 0..2u32 {
                    bytes[(8 * n + 2 * t + e) as usize] = (word >> (8 * (2 * (n % 2) + e))) as u8;
                }
            }
        }
        bytes
    }

    /// Calls `f(&mut out[t], keep(b, h, hq, i, j0 + t))` for every `t`: four Philox calls per
    /// block of 32 keys, the first block entered at key `j0 % 32`.
    #[allow(clippy::too_many_arguments)] // the element's five indices, the row and the action
    #[inline]
    fn for_each_in_row<T>(
        &self,
        b: usize,
        h: usize,
        hq: usize,
        i: usize,
        j0: usize,
        out: &mut [T],
        mut f: impl FnMut(&mut T, bool),
    ) {
        let (b, h, hq, i) = (b as u32, h as u32, hq as u32, i as u32);
        let bh = b.wrapping_mul(hq).wrapping_add(h);
        // The next key to draw, mod 2^32 like `keep`'s `j`, so both wrap at the same place.
        let mut j = j0 as u32;
        let mut rest = out;
        while !rest.is_empty() {
            let bytes = self.block_bytes(bh, i, j & !31);
            let first = (j % 32) as usize;
            let n = rest.len().min(32 - first);
            let (block, tail) = rest.split_at_mut(n);
            for (x, &u) in block.iter_mut().zip(&bytes[first..]) {
                f(x, self.keeps(u32::from(u)));
            }
            rest = tail;
            j = j.wrapping_add(n as u32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known answers for Philox4x32-10: the three `philox4x32 10` lines of Random123's
    /// `kat_vectors` file (format: counter[4] key[2] -> expected[4]), as cut and pasted into
    /// D. E. Shaw Research's `Random123-Boost`, `libs/random/test/test_philox.cpp`, test case
    /// `test_kat_philox4x32` (github.com/DEShawResearch/Random123-Boost, commit 916db91a):
    ///
    /// ```text
    /// 00000000 00000000 00000000 00000000 00000000 00000000   6627e8d5 e169c58d bc57ac4c 9b00dbd8
    /// ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   408f276d 41c83b0e a20bc7c6 6d5451fd
    /// 243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   d16cfe09 94fdcceb 5001e420 24126ea1
    /// ```
    const RANDOM123_KAT: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
        ([0, 0, 0, 0], [0, 0], [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]),
        ([u32::MAX; 4], [u32::MAX; 2], [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]),
        (
            [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
            [0xa409_3822, 0x299f_31d0],
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
        ),
    ];

    /// More known answers, one key word set at a time so a swapped key or counter word shows:
    /// `philox4x32 10` lines of the Random123 distribution's `examples/kat_vectors` (generated by
    /// its `gentests.py`), as mirrored in github.com/girving/random123-manual, commit 61e84792.
    const RANDOM123_EXAMPLE_KAT: [([u32; 4], [u32; 2], [u32; 4]); 4] = [
        ([1, 0, 0, 0], [1, 0], [0xac08_141b, 0xdfc5_ccbe, 0x79c0_7a47, 0xa7f6_6093]),
        ([0, 0, 0, 1], [0, 1], [0x96b2_7e8c, 0x2882_6d0f, 0x66d9_58ef, 0x0815_09dc]),
        ([0, 0, 0, u32::MAX], [0, u32::MAX], [0x9f18_bb20, 0x6216_1056, 0x7ea8_c028, 0x4c01_fc6e]),
        (
            [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
            [0, 0x8000_0000],
            [0x6367_5d2c, 0x422d_7c4d, 0x3145_d30d, 0x3bce_33a4],
        ),
    ];

    fn agreement(a: &[bool], b: &[bool]) -> f64 {
        a.iter().zip(b).filter(|(x, y)| x == y).count() as f64 / a.len() as f64
    }

    fn row(rng: &DropoutRng, b: usize, h: usize, hq: usize, i: usize, n: usize) -> Vec<bool> {
        let mut out = vec![false; n];
        rng.keep_row(b, h, hq, i, 0, &mut out);
        out
    }

    #[test]
    fn philox4x32_10_matches_random123_known_answers() {
        for (counter, key, expected) in RANDOM123_KAT.iter().chain(&RANDOM123_EXAMPLE_KAT) {
            assert_eq!(philox4x32_10(*counter, *key), *expected, "counter {counter:08x?} key {key:08x?}");
        }
    }

    #[test]
    fn keep_is_the_documented_philox_byte_against_the_threshold() {
        let (seed, offset) = (0x0123_4567_89ab_cdef_u64, 7);
        let rng = DropoutRng::new(0.3, seed, offset);
        assert_eq!(rng.key(), [0x89ab_cdef, 0x0123_4567]);
        assert_eq!(rng.offset(), 7);
        assert_eq!(rng.threshold(), 77); // round(0.3 · 256) = round(76.8)
        let (b, h, hq) = (2u32, 3, 8);
        for i in [0u32, 5, 8, 13, 16, 29, 47] {
            for j in 0..96u32 {
                let counter = [4 * (j / 32) + (j % 8) / 2, 8 * (i / 16) + i % 8, b * hq + h, offset];
                let byte = 8 * ((i % 16) / 8) + 2 * ((j % 32) / 8) + j % 2;
                let words = philox4x32_10(counter, [0x89ab_cdef, 0x0123_4567]);
                let u = (words[(byte / 4) as usize] >> (8 * (byte % 4))) & 0xff;
                assert_eq!(rng.keep(b, h, hq, i, j), u >= 77, "i = {i}, j = {j}");
            }
        }
    }

    #[test]
    fn one_call_serves_a_threads_sixteen_fragment_elements() {
        // Rows g and g + 8 of a 16 x 32 block, columns 8n + 2t + {0, 1}: the 16 bytes of one
        // call, each used once; the GPU kernels rely on this to draw each call once.
        let rng = DropoutRng::new(0.5, 99, 1);
        let (b, h, hq) = (1u32, 2, 4);
        for (i0, j0) in [(0u32, 0u32), (16, 32), (48, 96)] {
            for g in 0..8 {
                for t in 0..4 {
                    let words = philox4x32_10([4 * (j0 / 32) + t, 8 * (i0 / 16) + g, b * hq + h, 1], rng.key());
                    let mut bytes: Vec<u32> =
                        words.iter().flat_map(|w| (0..4).map(move |k| (w >> (8 * k)) & 0xff)).collect();
                    for r in 0..2 {
                        for n in 0..4 {
                            for e in 0..2 {
                                let (i, j) = (i0 + g + 8 * r, j0 + 8 * n + 2 * t + e);
                                let byte = (8 * r + 2 * n + e) as usize;
                                assert_eq!(rng.keep(b, h, hq, i, j), bytes[byte] >= rng.threshold(), "({i}, {j})");
                                bytes[byte] = u32::MAX; // each byte once
                            }
                        }
                    }
                    assert!(bytes.iter().all(|&x| x == u32::MAX));
                }
            }
        }
    }

    #[test]
    fn sequence_and_head_index_wraps_mod_two_pow_32() {
        let rng = DropoutRng::new(0.5, 9, 0);
        let (b, h, hq) = (u32::MAX, 5, 3); // b * hq + h = 2 (mod 2^32)
        for j in 0..40 {
            assert_eq!(rng.keep(b, h, hq, 1, j), rng.keep(0, 2, 1, 1, j), "j = {j}");
        }
    }

    #[test]
    fn threshold_is_p_times_256_rounded_to_the_nearest_and_at_most_255() {
        assert_eq!(DropoutRng::new(0.0, 0, 0).threshold(), 0);
        assert_eq!(DropoutRng::new(0.5, 0, 0).threshold(), 128);
        assert_eq!(DropoutRng::new(0.1, 0, 0).threshold(), 26); // 25.6
        assert_eq!(DropoutRng::new(0.15, 0, 0).threshold(), 38); // 38.4
        assert_eq!(DropoutRng::new(1.0 / 512.0, 0, 0).threshold(), 1); // 0.5, half away from zero
        assert_eq!(DropoutRng::new(0.0019, 0, 0).threshold(), 0); // 0.486: drops nothing
        assert_eq!(DropoutRng::new(0.999, 0, 0).threshold(), 255); // 255.74, capped
    }

    #[test]
    fn out_of_range_p_does_not_panic() {
        assert_eq!(DropoutRng::new(f32::NAN, 0, 0).threshold(), 0);
        assert_eq!(DropoutRng::new(-0.5, 0, 0).threshold(), 0);
        assert_eq!(DropoutRng::new(f32::INFINITY, 0, 0).threshold(), 255);
        // p >= 1 keeps only the elements whose byte is 255: about one in 256.
        let kept = row(&DropoutRng::new(1.0, 0, 0), 0, 0, 1, 0, 4096).iter().filter(|&&k| k).count();
        assert!((1..64).contains(&kept), "{kept} of 4096 kept");
    }

    #[test]
    fn scale_is_reciprocal_of_keep_probability() {
        assert_eq!(DropoutRng::new(0.0, 1, 2).scale(), 1.0);
        assert_eq!(DropoutRng::new(0.5, 1, 2).scale(), 2.0);
        assert_eq!(DropoutRng::new(0.1, 1, 2).scale(), 1.0 / (1.0 - 0.1f32));
    }

    #[test]
    fn keep_row_agrees_with_keep_for_any_start_and_length() {
        let rng = DropoutRng::new(0.4, 0xdead_beef_cafe_f00d, 11);
        let (b, h, hq) = (1, 6, 7);
        for i in [33, 42] {
            for j0 in (0..70u32).step_by(3) {
                for len in [0, 1, 5, 22, 31, 32, 33, 64, 97] {
                    let mut out = vec![false; len];
                    rng.keep_row(b, h, hq, i, j0 as usize, &mut out);
                    for (t, &k) in (j0..).zip(&out) {
                        let expected = rng.keep(b as u32, h as u32, hq as u32, i as u32, t);
                        assert_eq!(k, expected, "i = {i}, j0 = {j0}, len = {len}, j = {t}");
                    }
                }
            }
        }
    }

    #[test]
    fn keep_row_wraps_the_key_index_like_keep() {
        let rng = DropoutRng::new(0.5, 3, 1);
        let j0 = u32::MAX - 5; // keys 2^32 - 6 ..= 2^32 - 1, then 0 .. 6
        let mut out = [false; 13];
        rng.keep_row(0, 0, 1, 0, j0 as usize, &mut out);
        for (t, &k) in out.iter().enumerate() {
            assert_eq!(k, rng.keep(0, 0, 1, 0, j0.wrapping_add(t as u32)), "t = {t}");
        }
    }

    #[test]
    fn apply_row_scales_kept_and_zeroes_dropped_probabilities() {
        let rng = DropoutRng::new(0.25, 5, 6);
        let probs: Vec<f32> = (0..37).map(|t| 0.01 * (t + 1) as f32).collect();
        let mut row = probs.clone();
        rng.apply_row(3, 1, 4, 2, 5, rng.scale(), &mut row);
        for (t, (&got, &p)) in row.iter().zip(&probs).enumerate() {
            let expected = if rng.keep(3, 1, 4, 2, 5 + t as u32) { p * rng.scale() } else { 0.0 };
            assert_eq!(got, expected, "t = {t}");
        }
    }

    #[test]
    fn apply_row_propagates_nan_like_the_oracle() {
        let rng = DropoutRng::new(0.5, 5, 6);
        let mut row = [f32::NAN; 64];
        rng.apply_row(0, 0, 1, 0, 0, rng.scale(), &mut row);
        assert!(row.iter().all(|x| x.is_nan()));
    }

    #[test]
    fn keep_rate_is_one_minus_the_rounded_p_within_five_sigma() {
        let (rows, cols) = (1000usize, 1000usize);
        let n = (rows * cols) as f64;
        for p in [0.1f32, 0.5, 0.9] {
            let rng = DropoutRng::new(p, 0x5eed, 3);
            let mut out = vec![false; cols];
            let mut kept = 0usize;
            for i in 0..rows {
                rng.keep_row(i % 3, i % 5, 5, i, 0, &mut out);
                kept += out.iter().filter(|&&k| k).count();
            }
            // The drop rate is p rounded to a multiple of 1/256.
            let q = 1.0 - f64::from(rng.threshold()) / 256.0;
            let sigma = (q * (1.0 - q) / n).sqrt();
            let rate = kept as f64 / n;
            assert!((rate - q).abs() <= 5.0 * sigma, "p = {p}: keep rate {rate}, expected {q} ± {}", 5.0 * sigma);
        }
    }

    #[test]
    fn zero_p_keeps_everything() {
        let rng = DropoutRng::new(0.0, 123, 4);
        for i in 0..64 {
            assert!(row(&rng, i % 2, i % 4, 4, i, 1000).iter().all(|&k| k));
        }
        // Even the all-zero random word is kept.
        assert!(rng.keeps(0));
    }

    #[test]
    fn masks_are_deterministic() {
        let a = DropoutRng::new(0.5, 77, 8);
        let b = DropoutRng::new(0.5, 77, 8);
        assert_eq!(row(&a, 1, 2, 4, 3, 4096), row(&b, 1, 2, 4, 3, 4096));
        assert_eq!(row(&a, 1, 2, 4, 3, 4096), row(&a, 1, 2, 4, 3, 4096));
    }

    #[test]
    fn seeds_offsets_batches_heads_and_rows_give_different_masks() {
        let n = 4096;
        let base = DropoutRng::new(0.5, 1, 0);
        let reference = row(&base, 1, 2, 4, 3, n);
        let mut shifted = vec![false; n];
        base.keep_row(1, 2, 4, 3, 4, &mut shifted);
        let others = [
            ("seed's low word", row(&DropoutRng::new(0.5, 2, 0), 1, 2, 4, 3, n)),
            ("seed's high word", row(&DropoutRng::new(0.5, 1 | (1 << 32), 0), 1, 2, 4, 3, n)),
            ("offset", row(&DropoutRng::new(0.5, 1, 1), 1, 2, 4, 3, n)),
            ("batch", row(&base, 2, 2, 4, 3, n)),
            ("head", row(&base, 1, 3, 4, 3, n)),
            ("query row", row(&base, 1, 2, 4, 4, n)),
            ("first key", shifted),
        ];
        for (what, other) in &others {
            // Independent fair masks agree on about half the keys (sigma ≈ 0.008 here).
            let a = agreement(&reference, other);
            assert!((0.4..0.6).contains(&a), "changing the {what} left the masks {a} alike");
        }
    }
}
