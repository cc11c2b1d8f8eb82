//! The oracle: Algorithm 0 (standard attention), boring on purpose.
//!
//! It materialises `S` and `P` for each `(sequence, head)` and follows DESIGN §2 line by line. Two
//! instances exist, from one generic body:
//! - [`forward`]: everything in `f64` — the truth every backend is compared with;
//! - [`naive`]: Algorithm 0 "in the input dtype with f32 accumulation" — scores rounded to the
//!   dtype, softmax in `f32`, probabilities rounded to the dtype, `P·V` accumulated in `f32` and
//!   rounded. Its error against [`forward`] sets the tolerance of the numerics contract.
//!
//! Used by tests, `flash-attn check` and debugging; never on a hot path.

use crate::dtype::Element;
use crate::error::Result;
use crate::spec::{AttentionSpec, Geometry};
use crate::tensor::Tensor;

/// Outputs of the oracle in the contiguous layouts of DESIGN §2, widened to `f64`.
#[derive(Debug, Clone)]
pub struct Reference {
    /// `[b, sq, hq, dv]` or `[tq, hq, dv]`, contiguous.
    pub out: Vec<f64>,
    /// `[b, hq, sq]` or `[hq, tq]`, natural log; `-inf` for rows that see no key.
    pub lse: Vec<f64>,
}

/// The arithmetic Algorithm 0 runs in.
trait Real:
    Copy
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Div<Output = Self>
{
    const ZERO: Self;
    const NEG_INF: Self;
    fn from_f32(x: f32) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn tanh(self) -> Self;
    fn max(self, other: Self) -> Self;
}

macro_rules! impl_real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const NEG_INF: Self = <$t>::NEG_INFINITY;
            fn from_f32(x: f32) -> Self {
                x as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
        }
    };
}
impl_real!(f32);
impl_real!(f64);

/// Algorithm 0 in `f64`: the truth.
pub fn forward<T: Element>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
) -> Result<Reference> {
    let g = Geometry::new(spec, q, k, v)?;
    Ok(algorithm0::<f64, T>(&g, q.data(), k.data(), v.data(), |x| x))
}

/// Algorithm 0 in the input dtype with `f32` accumulation (`naive_T` of the numerics contract).
pub fn naive<T: Element>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
) -> Result<Reference> {
    let g = Geometry::new(spec, q, k, v)?;
    Ok(algorithm0::<f32, T>(&g, q.data(), k.data(), v.data(), |x| T::from_f32(x).to_f32()))
}

/// Algorithm 0, materialising `S` and `P` per `(sequence, head)`. `round` models storing an
/// intermediate in the input dtype (identity for the `f64` oracle).
fn algorithm0<R: Real, T: Element>(g: &Geometry<'_>, q: &[T], k: &[T], v: &[T], round: impl Fn(R) -> R) -> Reference {
    let mut out = vec![0.0f64; g.total_q * g.hq * g.dv];
    // Rows that meet no key (fully masked, or varlen tokens after the last sequence) keep these.
    let mut lse = vec![f64::NEG_INFINITY; g.lse_len()];
    let scale = R::from_f32(g.scale);
    let cap = g.softcap.map(R::from_f32);
    for seq in &g.seqs {
        let (sq, sk) = (seq.sq, seq.sk);
        let off = seq.offset();
        let mut s = vec![R::ZERO; sq * sk];
        for h in 0..g.hq {
            let hk = g.kv_head(h);
            let vis = g.visibility(seq, h);
            let slope = g.alibi_slope(seq, h).map(R::from_f32);
            // S = scale · Q Kᵀ, softcap, ALiBi, mask (DESIGN §2, steps 1-4).
            for i in 0..sq {
                let qi = g.q.row(seq, seq.q_start, i, h);
                for j in 0..sk {
                    let kj = g.k.row(seq, seq.k_start, j, hk);
                    let mut dot = R::ZERO;
                    for x in 0..g.d {
                        dot = dot + R::from_f32(q[qi + x].to_f32()) * R::from_f32(k[kj + x].to_f32());
                    }
                    let mut sij = round(scale * dot);
                    if let Some(c) = cap {
                        sij = c * (sij / c).tanh();
                    }
                    if let Some(m) = slope {
                        let dist = R::from_f32((i as i64 + off - j as i64).unsigned_abs() as f32);
                        sij = sij - m * dist;
                    }
                    s[i * sk + j] = if vis.visible(i, j) { sij } else { R::NEG_INF };
                }
            }
            // P = softmax(S) row by row (step 5), then O = P V (step 7); P overwrites S.
            for i in 0..sq {
                let row = &mut s[i * sk..(i + 1) * sk];
                let m = row.iter().fold(R::NEG_INF, |a, &b| a.max(b));
                let li = g.lse_index(seq, h, i);
                let oi = (g.q_token(seq, i) * g.hq + h) * g.dv;
                if m == R::NEG_INF {
                    continue; // no visible key: out = 0, lse = -inf
                }
                let mut sum = R::ZERO;
                for p in row.iter_mut() {
                    *p = (*p - m).exp();
                    sum = sum + *p;
                }
                lse[li] = (m + sum.ln()).to_f64();
                for p in row.iter_mut() {
                    *p = round(*p / sum);
                }
                for x in 0..g.dv {
                    let mut acc = R::ZERO;
                    for (j, &p) in row.iter().enumerate() {
                        let vj = g.v.row(seq, seq.k_start, j, hk);
                        acc = acc + p * R::from_f32(v[vj + x].to_f32());
                    }
                    out[oi + x] = round(acc).to_f64();
                }
            }
        }
    }
    Reference { out, lse }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_key_returns_its_value_and_lse_equals_the_score() {
        let q = [0.5f32, -1.0];
        let k = [2.0f32, 1.0];
        let v = [3.0f32, -4.0, 5.0];
        let (qt, kt, vt) =
            (Tensor::new(&q, &[1, 1, 1, 2]), Tensor::new(&k, &[1, 1, 1, 2]), Tensor::new(&v, &[1, 1, 1, 3]));
        let r = forward(&AttentionSpec::new().scale(0.25), &qt, &kt, &vt).unwrap();
        assert_eq!(r.out, vec![3.0, -4.0, 5.0]);
        assert_eq!(r.lse, vec![0.0]); // 0.25 · (1 - 1) = 0
    }

    #[test]
    fn two_equal_scores_average_the_values() {
        let q = [1.0f32];
        let k = [2.0f32, 2.0];
        let v = [1.0f32, 3.0];
        let (qt, kt, vt) =
            (Tensor::new(&q, &[1, 1, 1, 1]), Tensor::new(&k, &[1, 2, 1, 1]), Tensor::new(&v, &[1, 2, 1, 1]));
        let r = forward(&AttentionSpec::new(), &qt, &kt, &vt).unwrap();
        assert!((r.out[0] - 2.0).abs() < 1e-15);
        assert!((r.lse[0] - (2.0 + 2f64.ln())).abs() < 1e-15);
    }
}
