//! The online-softmax state of one query tile (Algorithm 1, lines 9-13; FA2's deferred
//! normalisation).
//!
//! For each row the state keeps the running maximum `m` and the running sum `l` of `e^(s - m)`; the unnormalised output accumulator is rescaled only when `m` grows, and divided
//! by `l` once, at the end.

use std::f32::consts::LOG2_E;

use super::gemm::Bf16Pair;
use super::isa::Isa;
use super::vexp::{exp_scaled_sub_sum, exp_scaled_sum_to_pairs, row_max, scale_row};

/// Running row maxima and sums of one query tile.
#[derive(Debug, Default)]
pub struct OnlineSoftmax {
    row_max: Vec<f32>,
    row_sum: Vec<f32>,
}

impl OnlineSoftmax {
    /// Resets the state for `rows` rows: `m = -inf`, `l = 0`.
    pub fn reset(&mut self, rows: usize) {
        self.row_max.clear();
        self.row_max.resize(rows, f32::NEG_INFINITY);
        self.row_sum.clear();
        self.row_sum.resize(rows, 0.0);
    }

    /// Folds one score tile into the state: turns `scale · s` (rows of stride `ld_s`, `cols`
    /// valid) into probabilities `e^(scale · s - m_new)` in place and rescales the output rows `o`
    /// (stride `dv`) by `e^(m_old - m_new)` where the maximum grew. `scale > 0` (so the maximum of
    /// `scale · s` is `scale` times that of `s`, rounding included); 1 for a tile already scaled.
    /// With `pairs = Some((p, ld))`, the probabilities go to `p` as `bf16` pairs (rows of stride
    /// `ld` words) instead, and `s` is left undefined.
    #[allow(clippy::too_many_arguments)]
    pub fn update(
        &mut self,
        isa: Isa,
        s: &mut [f32],
        ld_s: usize,
        cols: usize,
        o: &mut [f32],
        dv: usize,
        scale: f32,
        mut pairs: Option<(&mut [Bf16Pair], usize)>,
    ) {
        debug_assert!(scale > 0.0);
        for (r, (m, l)) in self.row_max.iter_mut().zip(&mut self.row_sum).enumerate() {
            let row = &mut s[r * ld_s..r * ld_s + cols];
            let tile_max = row_max(isa, row) * scale;
            let m_new = m.max(tile_max);
            if m_new == f32::NEG_INFINITY {
                // Nothing finite visible yet in this row: every probability is 0 — unless a score
                // is NaN (from NaN inputs), which must reach the output as the oracle's does.
                if row.iter().any(|x| x.is_nan()) {
                    *l = f32::NAN;
                }
                row.fill(0.0);
                if let Some((p, ld)) = pairs.as_mut() {
                    p[r * *ld..r * *ld + cols.div_ceil(2)].fill(0);
                }
                continue;
            }
            if m_new > *m {
                // Algorithm 1, line 12: rescale what was accumulated under the old maximum.
                let alpha = ((*m - m_new) * LOG2_E).exp2();
                *l *= alpha;
                scale_row(isa, &mut o[r * dv..(r + 1) * dv], alpha);
                *m = m_new;
            }
            *l += match pairs.as_mut() {
                Some((p, ld)) => exp_scaled_sum_to_pairs(isa, row, scale, m_new, &mut p[r * *ld..]),
                None => exp_scaled_sub_sum(isa, row, scale, m_new),
            };
        }
    }

    /// Final normalisation of row `r`: returns `(1 / l, lse)` with `lse` in natural log, or
    /// `None` for a row that saw no key (its output is 0 and its `lse` is `-inf`).
    pub fn finish(&self, r: usize) -> Option<(f32, f32)> {
        let (m, l) = (self.row_max[r], self.row_sum[r]);
        if l.is_nan() {
            return Some((f32::NAN, f32::NAN));
        }
        if m == f32::NEG_INFINITY || l == 0.0 {
            return None;
        }
        Some((1.0 / l, m + l.ln()))
    }
}

/// One row of a split-KV merge (Flash-Decoding's second pass): the splits' normalised outputs
/// (`part(s)`, `acc.len()` floats each) weighted by `exp(lse_s - lse)`, in split order, into
/// `acc`; returns the row's `lse`, the log of the summed exponentials. A NaN `lse_s` makes the row
/// NaN; a row no split sees gives zeros and `-inf`, as unsplit; splits of weight 0 are skipped
/// (their outputs may hold what `0 · x` would turn into NaN). `ws`: scratch of one float per split.
pub(super) fn merge_row<'a>(
    lses: impl Iterator<Item = f32> + Clone,
    part: impl Fn(usize) -> &'a [f32],
    ws: &mut [f32],
    acc: &mut [f32],
) -> f32 {
    if lses.clone().any(|x| x.is_nan()) {
        acc.fill(f32::NAN);
        return f32::NAN;
    }
    acc.fill(0.0);
    let max = lses.clone().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    ws.iter_mut().zip(lses).for_each(|(w, l)| *w = (l - max).exp());
    let sum: f32 = ws.iter().sum();
    for (s, &w) in ws.iter().enumerate() {
        if w == 0.0 {
            continue;
        }
        let w = w / sum;
        acc.iter_mut().zip(part(s)).for_each(|(a, &x)| *a += w * x);
    }
    max + sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_tiles_give_the_softmax_of_their_union() {
        let scores = [0.5f32, -1.0, 3.0, 2.0, -0.25, 1.5];
        let values = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut st = OnlineSoftmax::default();
        st.reset(1);
        let mut o = [0.0f32];
        for tile in [0..2, 2..6] {
            let mut s: Vec<f32> = scores[tile.clone()].to_vec();
            let n = s.len();
            st.update(Isa::Portable, &mut s, n, n, &mut o, 1, 1.0, None);
            for (p, vi) in s.iter().zip(&values[tile]) {
                o[0] += p * vi;
            }
        }
        let (inv, lse) = st.finish(0).unwrap();
        let z: f64 = scores.iter().map(|&s| (s as f64).exp()).sum();
        let want: f64 = scores.iter().zip(&values).map(|(&s, &v)| (s as f64).exp() * v as f64).sum::<f64>() / z;
        assert!(((o[0] * inv) as f64 - want).abs() < 1e-5);
        assert!((lse as f64 - z.ln()).abs() < 1e-5);
    }

    #[test]
    fn row_without_visible_keys_has_no_lse() {
        let mut st = OnlineSoftmax::default();
        st.reset(1);
        let mut s = [f32::NEG_INFINITY; 3];
        let mut o = [0.0f32; 2];
        st.update(Isa::Portable, &mut s, 3, 3, &mut o, 2, 1.0, None);
        assert_eq!(s, [0.0; 3]);
        assert!(st.finish(0).is_none());
    }

    #[test]
    fn merging_splits_equals_the_softmax_of_the_whole_row() {
        // A row of 13 scores and 3-wide values cut into splits of 5, 0 and 8 keys.
        let mut rng = crate::check::Rng::new(5);
        let s: Vec<f32> = (0..13).map(|_| 4.0 * rng.normal() as f32).collect();
        let v: Vec<f32> = (0..13 * 3).map(|_| rng.normal() as f32).collect();
        let whole = |keys: std::ops::Range<usize>| -> (Vec<f32>, f32) {
            if keys.is_empty() {
                return (vec![0.0; 3], f32::NEG_INFINITY);
            }
            let m = keys.clone().map(|j| f64::from(s[j])).fold(f64::NEG_INFINITY, f64::max);
            let l: f64 = keys.clone().map(|j| (f64::from(s[j]) - m).exp()).sum();
            let o = (0..3)
                .map(|c| {
                    (keys.clone().map(|j| (f64::from(s[j]) - m).exp() * f64::from(v[j * 3 + c])).sum::<f64>() / l)
                        as f32
                })
                .collect();
            (o, (m + l.ln()) as f32)
        };
        let parts: Vec<(Vec<f32>, f32)> = [0..5, 5..5, 5..13].into_iter().map(whole).collect();
        let (want, want_lse) = whole(0..13);
        let (mut ws, mut acc) = (vec![0.0; 3], vec![0.0; 3]);
        let lse = merge_row(parts.iter().map(|p| p.1), |i| &parts[i].0, &mut ws, &mut acc);
        assert!((lse - want_lse).abs() <= 1e-5 * want_lse.abs().max(1.0), "{lse} vs {want_lse}");
        for (a, b) in acc.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5, "{acc:?} vs {want:?}");
        }
        // No split sees a key: zeros and -inf; a NaN lse: a NaN row.
        let none = [f32::NEG_INFINITY; 2];
        assert_eq!(merge_row(none.into_iter(), |i| &parts[i].0, &mut ws, &mut acc), f32::NEG_INFINITY);
        assert_eq!(acc, vec![0.0; 3]);
        assert!(merge_row([0.5, f32::NAN].into_iter(), |i| &parts[i].0, &mut ws, &mut acc).is_nan());
        assert!(acc.iter().all(|x| x.is_nan()));
    }
}
