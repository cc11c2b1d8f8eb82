//! Micro-kernels: the inner loops over one tile, on `f32` scratch.
//!
//! Portable Rust written so that LLVM vectorises it: independent accumulators for reductions
//! (float addition is not associative, so a single accumulator would stay scalar) and plain
//! element-wise loops elsewhere. No `mul_add`: without the `fma` target feature it is a libm call
//! per element, a hundred times slower than a multiply and an add. Architecture-specific paths will sit beside these, chosen at run
//! time, with these as the fallback they are tested against.

/// Lanes of independent partial sums in [`dot`]; 16 f32 = one AVX-512 register.
const LANES: usize = 16;

/// `Σ a[x] · b[x]` over the common length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; LANES];
    let chunks = n / LANES;
    for c in 0..chunks {
        let (xa, xb) = (&a[c * LANES..(c + 1) * LANES], &b[c * LANES..(c + 1) * LANES]);
        for l in 0..LANES {
            acc[l] += xa[l] * xb[l];
        }
    }
    let mut tail = 0.0f32;
    for x in chunks * LANES..n {
        tail += a[x] * b[x];
    }
    // Pairwise reduction of the lanes.
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0] + tail
}

/// `y += alpha · x`.
#[inline]
pub fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// `y *= alpha`.
#[inline]
pub fn scale(y: &mut [f32], alpha: f32) {
    for yi in y {
        *yi *= alpha;
    }
}

/// `S[r][c] = q_r · k_c` for a `rows × cols` tile; `q` rows have stride `d`, `k` rows stride `d`,
/// `s` rows stride `ld_s`.
pub fn scores(q: &[f32], k: &[f32], s: &mut [f32], rows: usize, cols: usize, d: usize, ld_s: usize) {
    for r in 0..rows {
        let qr = &q[r * d..(r + 1) * d];
        let sr = &mut s[r * ld_s..r * ld_s + cols];
        for (c, sc) in sr.iter_mut().enumerate() {
            *sc = dot(qr, &k[c * d..(c + 1) * d]);
        }
    }
}

/// `O[r] += Σ_c P[r][c] · v_c` for a `rows × cols` tile; `p` rows stride `ld_p`, `v` and `o` rows
/// stride `dv`. Zero probabilities (masked keys) are skipped.
pub fn accumulate_pv(p: &[f32], v: &[f32], o: &mut [f32], rows: usize, cols: usize, dv: usize, ld_p: usize) {
    for r in 0..rows {
        let or = &mut o[r * dv..(r + 1) * dv];
        for (c, &pc) in p[r * ld_p..r * ld_p + cols].iter().enumerate() {
            if pc != 0.0 {
                axpy(or, pc, &v[c * dv..(c + 1) * dv]);
            }
        }
    }
}

/// `C[c] += Σ_r A[r][c] · B[r]` (`C += Aᵀ B`) for a `rows × cols` tile `A` (rows stride `ld_a`);
/// `b` and `c` rows have stride `n`. Rows are folded in ascending order, so the result for a key
/// does not depend on how queries are grouped into tiles. Zero entries of `A` are skipped.
pub fn accumulate_atb(a: &[f32], b: &[f32], c: &mut [f32], rows: usize, cols: usize, n: usize, ld_a: usize) {
    for r in 0..rows {
        let br = &b[r * n..(r + 1) * n];
        for (col, &arc) in a[r * ld_a..r * ld_a + cols].iter().enumerate() {
            if arc != 0.0 {
                axpy(&mut c[col * n..(col + 1) * n], arc, br);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_f64_sum_on_every_length() {
        for n in 0..70 {
            let a: Vec<f32> = (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) / 3.0).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0).collect();
            let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()), "n = {n}");
        }
    }
}
