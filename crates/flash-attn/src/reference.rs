//! The oracle: Algorithm 0 (standard attention), boring on purpose.
//!
//! It materialises `S` and `P` for each `(sequence, head)` and follows DESIGN §2 line by line. Two
//! instances exist, from one generic body:
//! - [`forward`]: everything in `f64` — the truth every backend is compared with;
//! - [`naive`]: Algorithm 0 "in the input dtype with f32 accumulation" — scores rounded to the
//!   dtype, softmax in `f32`, probabilities rounded to the dtype, `P·V` accumulated in `f32` and
//!   rounded. Its error against [`forward`] sets the tolerance of the numerics contract.
//!
//! A third, [`naive_fp8`], is Algorithm 0 as an FP8 tensor-core kernel computes it (unnormalised
//! `P` rounded to e4m3 for `P·V`, output in bf16): the `naive_T` of the FP8 contract.
//!
//! Used by tests, `flash-attn check` and debugging; never on a hot path.

use rayon::prelude::*;

use crate::dtype::Element;
use crate::error::Result;
use crate::fp8::Fp8E4m3;
use crate::philox::DropoutRng;
use crate::spec::{AttentionSpec, Geometry, RowLayout, Sequence};
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
    + Send
    + Sync
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
        }
    };
}
impl_real!(f32);
impl_real!(f64);

/// Gradients from the oracle, in the contiguous layouts of `q`, `k`, `v` (DESIGN §2), widened to
/// `f64`.
#[derive(Debug, Clone)]
pub struct ReferenceGrads {
    /// Like `q`: `[b, sq, hq, d]` or `[tq, hq, d]`.
    pub dq: Vec<f64>,
    /// Like `k`: `[b, sk, hk, d]` or `[tk, hk, d]`.
    pub dk: Vec<f64>,
    /// Like `v`: `[b, sk, hk, dv]` or `[tk, hk, dv]`.
    pub dv: Vec<f64>,
}

/// Algorithm 0 in `f64`: the truth.
pub fn forward<T: Element>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
) -> Result<Reference> {
    let g = Geometry::new(spec, q, k, v)?;
    Ok(Oracle::<f64, T>::new(&g, q, k, v, Rounding::exact()).forward())
}

/// Algorithm 0 in the input dtype with `f32` accumulation (`naive_T` of the numerics contract).
pub fn naive<T: Element>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
) -> Result<Reference> {
    let g = Geometry::new(spec, q, k, v)?;
    Ok(Oracle::<f32, T>::new(&g, q, k, v, Rounding::dtype::<T>()).forward())
}

/// Algorithm 0 as an FP8 tensor-core kernel computes it (`naive_fp8` of the FP8 numerics
/// contract, docs/semantics.md "FP8 inputs"), on the dequantized inputs (`q · descale_q`, ...):
/// scores in `f32`, not rounded; softmax in `f32` with the row max subtracted; the row sum `l`
/// from the unrounded `exp(s - max)`; those same probabilities rounded to e4m3 for `P·V` (as the
/// kernel feeds them to an FP8 matrix multiply), `P·V` accumulated in `f32`, divided by `l` and
/// rounded to `bf16`. `lse` is that of the unrounded scores.
pub fn naive_fp8(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, f32>,
    k: &Tensor<'_, f32>,
    v: &Tensor<'_, f32>,
) -> Result<Reference> {
    let g = Geometry::new(spec, q, k, v)?;
    Ok(Oracle::<f32, f32>::new(&g, q, k, v, Rounding::fp8()).forward())
}

/// The backward pass of Algorithm 0 in `f64`: explicit chain rule through `S` and `P`.
/// `dout` has the shape of `out` (any strides).
pub fn backward<T: Element>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    dout: &Tensor<'_, T>,
) -> Result<ReferenceGrads> {
    let g = Geometry::new(spec, q, k, v)?;
    let dout = g.check_grad_input(dout)?;
    Ok(Oracle::<f64, T>::new(&g, q, k, v, Rounding::exact()).backward(dout))
}

/// The backward pass of Algorithm 0 in the input dtype with `f32` accumulation (`naive_T`).
pub fn naive_backward<T: Element>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    dout: &Tensor<'_, T>,
) -> Result<ReferenceGrads> {
    let g = Geometry::new(spec, q, k, v)?;
    let dout = g.check_grad_input(dout)?;
    Ok(Oracle::<f32, T>::new(&g, q, k, v, Rounding::dtype::<T>()).backward(dout))
}

fn round_to<T: Element>(x: f32) -> f32 {
    T::from_f32(x).to_f32()
}

fn round_to_fp8(x: f32) -> f32 {
    Fp8E4m3::from_f32(x).to_f32()
}

/// How an instance of Algorithm 0 stores its intermediates: each function models one rounding
/// (the identity for the `f64` oracle).
#[derive(Clone, Copy)]
struct Rounding<R> {
    /// The scaled score `scale · q·k`, before softcap and ALiBi.
    score: fn(R) -> R,
    /// The probabilities (after dropout) as they enter `P·V`.
    p: fn(R) -> R,
    /// `true`: `P·V` takes `exp(s - max)` (rounded by `p`) and is divided by the row sum of the
    /// unrounded values afterwards, as a tiled kernel does. `false`: Algorithm 0's
    /// `P = exp(s - max) / sum` is rounded and multiplied with `V`.
    normalize_after_pv: bool,
    /// `out`; in the backward pass also `dP`, `dS` and the gradients.
    out: fn(R) -> R,
}

impl<R> Rounding<R> {
    /// Nothing rounded: the `f64` oracle.
    fn exact() -> Self {
        Rounding { score: |x| x, p: |x| x, normalize_after_pv: false, out: |x| x }
    }
}

impl Rounding<f32> {
    /// Every intermediate stored in dtype `T` (`naive_T`).
    fn dtype<T: Element>() -> Self {
        let r = round_to::<T>;
        Rounding { score: r, p: r, normalize_after_pv: false, out: r }
    }

    /// An FP8 kernel (`naive_fp8`): scores in `f32`, unnormalised `P` in e4m3, `out` in bf16.
    fn fp8() -> Self {
        Rounding { score: |x| x, p: round_to_fp8, normalize_after_pv: true, out: round_to::<half::bf16> }
    }
}

/// One instance of Algorithm 0: arithmetic `R`, inputs `T`, and the roundings `round` modelling
/// intermediates stored in a narrower type.
struct Oracle<'g, 'a, R, T> {
    g: &'g Geometry<'a>,
    q: &'g [T],
    k: &'g [T],
    v: &'g [T],
    round: Rounding<R>,
}

/// `S` and `P` of one `(sequence, head)`, materialised.
struct Probs<R> {
    /// `P = softmax(S)`, `sq × sk`, before dropout; with `normalize_after_pv`, the unnormalised
    /// `exp(s - max)`, unrounded.
    p: Vec<R>,
    /// Row sums of the unrounded `exp(s - max)` (0 for rows that see no key).
    sum: Vec<R>,
    /// Dropout factor `keep / (1 - p)` per element (empty without dropout).
    keep: Vec<R>,
    /// `tanh(s / c)` per element, for the softcap derivative (empty without softcap).
    tanh: Vec<R>,
    /// Row log-sum-exps; `-inf` for rows that see no key.
    lse: Vec<f64>,
}

impl<'g, 'a, R: Real, T: Element> Oracle<'g, 'a, R, T> {
    fn new(
        g: &'g Geometry<'a>,
        q: &'g Tensor<'_, T>,
        k: &'g Tensor<'_, T>,
        v: &'g Tensor<'_, T>,
        round: Rounding<R>,
    ) -> Self {
        Oracle { g, q: q.data(), k: k.data(), v: v.data(), round }
    }

    fn x(data: &[T], i: usize) -> R {
        R::from_f32(data[i].to_f32())
    }

    /// Rows `0..n` of one head of `data` (first element of row `r` at `row(r)`), `w` values each,
    /// in `R`, one after another.
    fn widen(data: &[T], n: usize, w: usize, row: impl Fn(usize) -> usize) -> Vec<R> {
        (0..n).flat_map(|r| (row(r)..row(r) + w).map(|e| Self::x(data, e))).collect()
    }

    /// `out[r] = Σ_c a[c] · b[r·d + c]` (d = `a.len()`), each sum in order over c from zero; four
    /// rows at a time, so that their chains of additions overlap (the same bits as one at a time).
    fn dots(a: &[R], b: &[R], out: &mut [R]) {
        let d = a.len();
        for (blk, o) in out.chunks_mut(4).enumerate() {
            let rows = &b[4 * blk * d..];
            if let [o0, o1, o2, o3] = o {
                let (mut s0, mut s1, mut s2, mut s3) = (R::ZERO, R::ZERO, R::ZERO, R::ZERO);
                for (c, &x) in a.iter().enumerate() {
                    s0 = s0 + x * rows[c];
                    s1 = s1 + x * rows[d + c];
                    s2 = s2 + x * rows[2 * d + c];
                    s3 = s3 + x * rows[3 * d + c];
                }
                (*o0, *o1, *o2, *o3) = (s0, s1, s2, s3);
            } else {
                for (r, or) in o.iter_mut().enumerate() {
                    let mut s = R::ZERO;
                    for (c, &x) in a.iter().enumerate() {
                        s = s + x * rows[r * d + c];
                    }
                    *or = s;
                }
            }
        }
    }

    /// The keys of kv head `hk` of `seq`, widened ([`Oracle::widen`]).
    fn keys(&self, seq: &Sequence, hk: usize) -> Vec<R> {
        Self::widen(self.k, seq.sk, self.g.d, |j| self.g.k.row(seq, seq.k_start, j, hk))
    }

    /// DESIGN §2 steps 1-5 for query head `h` of `seq`, its rows on rayon's threads (each row's
    /// arithmetic that of one thread); `kw`: its kv head's [`Oracle::keys`].
    fn probs(&self, seq: &Sequence, h: usize, kw: &[R]) -> Probs<R> {
        let g = self.g;
        let (sq, sk) = (seq.sq, seq.sk);
        let mut p = vec![R::ZERO; sq * sk];
        let mut tanh = if g.softcap.is_some() { vec![R::ZERO; sq * sk] } else { Vec::new() };
        let mut lse = vec![f64::NEG_INFINITY; sq];
        let mut sums = vec![R::ZERO; sq];
        if sk > 0 {
            let rows: Vec<(R, f64)> = if tanh.is_empty() {
                p.par_chunks_mut(sk).enumerate().map(|(i, row)| self.probs_row(seq, h, i, kw, row, None)).collect()
            } else {
                p.par_chunks_mut(sk)
                    .zip(tanh.par_chunks_mut(sk))
                    .enumerate()
                    .map(|(i, (row, t))| self.probs_row(seq, h, i, kw, row, Some(t)))
                    .collect()
            };
            for (i, (sum, l)) in rows.into_iter().enumerate() {
                sums[i] = sum;
                lse[i] = l;
            }
        }
        // Dropout factors (step 6), from the same Philox stream as every backend.
        let keep = match g.dropout {
            None => Vec::new(),
            Some(dr) => {
                let rng = DropoutRng::new(dr.p, dr.seed, dr.offset);
                let kept = R::from_f32(rng.scale());
                let mut keep = vec![R::ZERO; sq * sk];
                if sk > 0 {
                    keep.par_chunks_mut(sk).enumerate().for_each(|(i, row)| {
                        for (j, f) in row.iter_mut().enumerate() {
                            let on = rng.keep(seq.batch as u32, h as u32, g.hq as u32, i as u32, j as u32);
                            *f = if on { kept } else { R::ZERO };
                        }
                    });
                }
                keep
            }
        };
        Probs { p, sum: sums, keep, tanh, lse }
    }

    /// Row `i` of [`Oracle::probs`]: `S` (steps 1-4) into `row`, then `P = softmax(S)` over it
    /// (step 5), and `tanh(s / c)` into `tanh` with a softcap; returns the row's sum of the
    /// unrounded `exp(s - max)` and its lse (0 and `-inf` for a row that sees no key). `kw`: the
    /// head's keys, widened.
    fn probs_row(
        &self,
        seq: &Sequence,
        h: usize,
        i: usize,
        kw: &[R],
        row: &mut [R],
        mut tanh: Option<&mut [R]>,
    ) -> (R, f64) {
        let (g, round) = (self.g, self.round);
        let off = seq.offset();
        let vis = g.visibility(seq, h);
        let scale = R::from_f32(g.scale);
        let cap = g.softcap.map(R::from_f32);
        let slope = g.alibi_slope(seq, h).map(R::from_f32);
        // S = scale · Q Kᵀ, softcap, ALiBi, mask (steps 1-4).
        let qi = Self::widen(self.q, 1, g.d, |_| g.q.row(seq, seq.q_start, i, h));
        Self::dots(&qi, kw, row);
        for (j, x) in row.iter_mut().enumerate() {
            let mut sij = (round.score)(scale * *x);
            if let Some(c) = cap {
                let t = (sij / c).tanh();
                if let Some(tr) = tanh.as_deref_mut() {
                    tr[j] = t;
                }
                sij = c * t;
            }
            if let Some(m) = slope {
                let dist = R::from_f32((i as i64 + off - j as i64).unsigned_abs() as f32);
                sij = sij - m * dist;
            }
            *x = if vis.visible(i, j) { sij } else { R::NEG_INF };
        }
        // P = softmax(S) (step 5); P overwrites S. The row maximum is NaN if any score is NaN
        // (so NaN inputs propagate).
        #[allow(clippy::eq_op)]
        let m = row.iter().fold(R::NEG_INF, |a, &b| if b > a || b != b { b } else { a });
        if m == R::NEG_INF {
            row.fill(R::ZERO); // no visible key: P = 0, lse = -inf
            return (R::ZERO, f64::NEG_INFINITY);
        }
        let mut sum = R::ZERO;
        for x in row.iter_mut() {
            *x = (*x - m).exp();
            sum = sum + *x;
        }
        if !round.normalize_after_pv {
            for x in row.iter_mut() {
                *x = (round.p)(*x / sum);
            }
        }
        (sum, (m + sum.ln()).to_f64())
    }

    /// `P'` of element `e`: the probability after dropout, as `P·V` reads it.
    fn dropped(&self, pr: &Probs<R>, e: usize) -> R {
        match pr.keep.get(e) {
            Some(&f) => (self.round.p)(pr.p[e] * f),
            // Algorithm 0's `P` was rounded when it was normalised.
            None if !self.round.normalize_after_pv => pr.p[e],
            None => (self.round.p)(pr.p[e]),
        }
    }

    /// Every `(sequence, head)` on its own thread (rayon): each writes rows no other writes, so
    /// the results are those of one thread, bit for bit.
    fn forward(&self) -> Reference {
        let g = self.g;
        let heads: Vec<(usize, usize)> = (0..g.seqs.len()).flat_map(|s| (0..g.hq).map(move |h| (s, h))).collect();
        let rows: Vec<(Vec<f64>, Vec<f64>)> =
            heads.par_iter().map(|&(s, h)| self.forward_head(&g.seqs[s], h)).collect();
        let mut out = vec![0.0f64; g.total_q * g.hq * g.dv];
        // Rows that meet no key (fully masked, or varlen tokens after the last sequence) keep -inf.
        let mut lse = vec![f64::NEG_INFINITY; g.lse_len()];
        for (&(s, h), (o, l)) in heads.iter().zip(rows) {
            let seq = &g.seqs[s];
            for i in 0..seq.sq {
                lse[g.lse_index(seq, h, i)] = l[i];
                let oi = (g.q_token(seq, i) * g.hq + h) * g.dv;
                out[oi..oi + g.dv].copy_from_slice(&o[i * g.dv..(i + 1) * g.dv]);
            }
        }
        Reference { out, lse }
    }

    /// `out` (`sq × dv`) and `lse` of query head `h` of `seq`.
    fn forward_head(&self, seq: &Sequence, h: usize) -> (Vec<f64>, Vec<f64>) {
        let g = self.g;
        let hk = g.kv_head(h);
        let pr = self.probs(seq, h, &self.keys(seq, hk));
        let vis = g.visibility(seq, h);
        let mut out = vec![0.0f64; seq.sq * g.dv];
        // Rows on rayon's threads (dv > 0: Geometry checks it), each one's sums in the order of
        // one thread.
        let vw = Self::widen(self.v, seq.sk, g.dv, |j| g.v.row(seq, seq.k_start, j, hk));
        out.par_chunks_mut(g.dv).enumerate().for_each(|(i, o)| {
            // O = P' V over the keys row i sees (step 7): an invisible key contributes
            // nothing, not 0 · v_j (which would let a NaN value reach rows that cannot see it).
            // Each column's sum in key order; the columns side by side.
            let mut acc = vec![R::ZERO; g.dv];
            for j in (0..seq.sk).filter(|&j| vis.visible(i, j)) {
                let pj = self.dropped(&pr, i * seq.sk + j);
                for (a, &vx) in acc.iter_mut().zip(&vw[j * g.dv..(j + 1) * g.dv]) {
                    *a = *a + pj * vx;
                }
            }
            for (ox, mut a) in o.iter_mut().zip(acc) {
                // (A row whose sum is 0 saw no key with a finite score: its P is 0.)
                if self.round.normalize_after_pv && pr.sum[i] > R::ZERO {
                    a = a / pr.sum[i];
                }
                *ox = (self.round.out)(a).to_f64();
            }
        });
        (out, pr.lse)
    }

    /// Every `(sequence, kv head)` on its own thread (rayon), its query heads in order: `dK` and
    /// `dV` of a kv head sum over its query heads in the order one thread would, so the results
    /// are those of one thread, bit for bit.
    fn backward(&self, dout: (&[T], RowLayout)) -> ReferenceGrads {
        // The chain rule below reads the normalised `P` that Algorithm 0 stores.
        debug_assert!(!self.round.normalize_after_pv, "no backward for a deferred-normalisation oracle");
        let g = self.g;
        let (d, dv) = (g.d, g.dv);
        let groups: Vec<(usize, usize)> = (0..g.seqs.len()).flat_map(|s| (0..g.hk).map(move |hk| (s, hk))).collect();
        let parts: Vec<GroupGrads<R>> =
            groups.par_iter().map(|&(s, hk)| self.group_backward(&g.seqs[s], hk, dout)).collect();
        let mut dq = vec![R::ZERO; g.total_q * g.hq * d];
        let mut dk = vec![R::ZERO; g.total_k * g.hk * d];
        let mut dvv = vec![R::ZERO; g.total_k * g.hk * dv];
        for (&(s, hk), part) in groups.iter().zip(parts) {
            let seq = &g.seqs[s];
            for (h, rows) in part.dq {
                for i in 0..seq.sq {
                    let a = (g.q_token(seq, i) * g.hq + h) * d;
                    dq[a..a + d].copy_from_slice(&rows[i * d..(i + 1) * d]);
                }
            }
            for j in 0..seq.sk {
                let kt = g.k_token(seq, j);
                dk[(kt * g.hk + hk) * d..][..d].copy_from_slice(&part.dk[j * d..(j + 1) * d]);
                dvv[(kt * g.hk + hk) * dv..][..dv].copy_from_slice(&part.dv[j * dv..(j + 1) * dv]);
            }
        }
        let widen = |v: Vec<R>| v.into_iter().map(|x| (self.round.out)(x).to_f64()).collect();
        ReferenceGrads { dq: widen(dq), dk: widen(dk), dv: widen(dvv) }
    }

    /// The gradients of kv head `hk` of `seq` and of its query heads, taken in order. Each head
    /// in two steps on rayon's threads: its rows (`dP`, `dS`, `P'` and `dQ` of a query row, summed
    /// over the keys in order), then its keys (`dK` and `dV` of a key, summed over the rows in
    /// order, on top of the earlier heads'): every sum in the order of one thread's loop over
    /// heads, rows and keys.
    fn group_backward(&self, seq: &Sequence, hk: usize, (dout, dl): (&[T], RowLayout)) -> GroupGrads<R> {
        let g = self.g;
        let (d, dv) = (g.d, g.dv);
        let (sq, sk) = (seq.sq, seq.sk);
        let scale = R::from_f32(g.scale);
        let mut grads = GroupGrads { dq: Vec::new(), dk: vec![R::ZERO; sk * d], dv: vec![R::ZERO; sk * dv] };
        let kw = self.keys(seq, hk);
        let vw = Self::widen(self.v, sk, dv, |j| g.v.row(seq, seq.k_start, j, hk));
        for h in (0..g.hq).filter(|&h| g.kv_head(h) == hk) {
            let pr = self.probs(seq, h, &kw);
            let qw = Self::widen(self.q, sq, d, |i| g.q.row(seq, seq.q_start, i, h));
            let ow = Self::widen(dout, sq, dv, |i| dl.row(seq, seq.q_start, i, h));
            let mut dq = vec![R::ZERO; sq * d];
            // dS (scaled) and P' of every pair, row-major.
            let (mut ds, mut pd) = (vec![R::ZERO; sq * sk], vec![R::ZERO; sq * sk]);
            if sk > 0 {
                let rows = ds.par_chunks_mut(sk).zip(pd.par_chunks_mut(sk));
                let rows = rows.zip(dq.par_chunks_mut(d)).enumerate();
                rows.for_each(|(i, ((ds, pd), dq))| {
                    // dP' = dO Vᵀ, dP = dP' ∘ keep / (1 - p)
                    let mut dp = vec![R::ZERO; sk];
                    Self::dots(&ow[i * dv..(i + 1) * dv], &vw, &mut dp);
                    for (j, dpj) in dp.iter_mut().enumerate() {
                        *dpj = (self.round.out)(*dpj);
                        if let Some(&f) = pr.keep.get(i * sk + j) {
                            *dpj = *dpj * f;
                        }
                    }
                    // Softmax Jacobian: dS = P ∘ (dP - Σ_j P dP).
                    let row = &pr.p[i * sk..(i + 1) * sk];
                    let dsum = row.iter().zip(&dp).fold(R::ZERO, |a, (&p, &dpj)| a + p * dpj);
                    for j in 0..sk {
                        let e = i * sk + j;
                        pd[j] = self.dropped(&pr, e);
                        let mut s = (self.round.out)(row[j] * (dp[j] - dsum));
                        if let Some(&t) = pr.tanh.get(e) {
                            s = s * (R::from_f32(1.0) - t * t); // d(c·tanh(x/c))/dx
                        }
                        let s = s * scale;
                        ds[j] = s;
                        // dQ_i += dS_ij K_j
                        for (t, &kx) in dq.iter_mut().zip(&kw[j * d..(j + 1) * d]) {
                            *t = *t + s * kx;
                        }
                    }
                });
                // dV_j += P'_ij dO_i, dK_j += dS_ij Q_i, over the rows in order.
                let keys = grads.dv.par_chunks_mut(dv).zip(grads.dk.par_chunks_mut(d)).enumerate();
                keys.for_each(|(j, (dvj, dkj))| {
                    for i in 0..sq {
                        let e = i * sk + j;
                        for (t, &ox) in dvj.iter_mut().zip(&ow[i * dv..(i + 1) * dv]) {
                            *t = *t + pd[e] * ox;
                        }
                        for (t, &qx) in dkj.iter_mut().zip(&qw[i * d..(i + 1) * d]) {
                            *t = *t + ds[e] * qx;
                        }
                    }
                });
            }
            grads.dq.push((h, dq));
        }
        grads
    }
}

/// The backward's results for one `(sequence, kv head)`: `dQ` (`sq × d`) of each of its query
/// heads, and its `dK` (`sk × d`) and `dV` (`sk × dv`), all unrounded.
struct GroupGrads<R> {
    dq: Vec<(usize, Vec<R>)>,
    dk: Vec<R>,
    dv: Vec<R>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The oracle runs its heads on rayon's threads; how many there are changes no bit.
    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut draw = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
                })
                .collect()
        };
        // 2 sequences, 4 query heads on 2 kv heads, 5 queries, 7 keys, d 3, dv 2.
        let (q, k, v, dout) = (draw(2 * 5 * 4 * 3), draw(2 * 7 * 2 * 3), draw(2 * 7 * 2 * 2), draw(2 * 5 * 4 * 2));
        let (qt, kt, vt) =
            (Tensor::new(&q, &[2, 5, 4, 3]), Tensor::new(&k, &[2, 7, 2, 3]), Tensor::new(&v, &[2, 7, 2, 2]));
        let dot = Tensor::new(&dout, &[2, 5, 4, 2]);
        let spec = AttentionSpec::new().causal().dropout(0.2, 7, 3);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let f = forward(&spec, &qt, &kt, &vt).unwrap();
                let b = backward(&spec, &qt, &kt, &vt, &dot).unwrap();
                let n = naive_backward(&spec, &qt, &kt, &vt, &dot).unwrap();
                [f.out, f.lse, b.dq, b.dk, b.dv, n.dq, n.dk, n.dv]
                    .map(|x| x.iter().map(|y| y.to_bits()).collect::<Vec<_>>())
            })
        };
        let one = run(1);
        assert!(one[2].iter().any(|&x| x != 0), "a gradient that is all zeros tests nothing");
        assert_eq!(one, run(3));
    }

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

    #[test]
    fn naive_fp8_rounds_the_unnormalised_probabilities_and_divides_by_their_unrounded_sum() {
        // Scores 0 and ln 0.3: P·V sees e4m3(1) = 1 and e4m3(0.3) = 0.3125; the sum stays 1.3.
        let q = [1.0f32];
        let k = [0.0f32, 0.3f32.ln()];
        let v = [0.0f32, 1.0];
        let (qt, kt, vt) =
            (Tensor::new(&q, &[1, 1, 1, 1]), Tensor::new(&k, &[1, 2, 1, 1]), Tensor::new(&v, &[1, 2, 1, 1]));
        let spec = AttentionSpec::new().scale(1.0);
        let r = naive_fp8(&spec, &qt, &kt, &vt).unwrap();
        let sum = 1.0 + k[1].exp();
        assert_eq!(Fp8E4m3::from_f32(k[1].exp()).to_f32(), 0.3125);
        assert_eq!(r.out, vec![half::bf16::from_f32(0.3125 / sum).to_f64()]);
        assert_eq!(r.lse, vec![sum.ln() as f64]);
        // The oracle has 0.3 / 1.3 exactly; rounding the normalised P instead would give 0.234375.
        let exact = forward(&spec, &qt, &kt, &vt).unwrap();
        assert!((exact.out[0] - 0.3 / 1.3).abs() < 1e-7);
    }

    #[test]
    fn naive_fp8_gives_zero_output_for_a_row_that_sees_no_key() {
        let (q, k, v) = ([1.0f32; 2], [1.0f32; 3], [2.0f32; 3]);
        let (qt, kt, vt) =
            (Tensor::new(&q, &[1, 2, 1, 1]), Tensor::new(&k, &[1, 3, 1, 1]), Tensor::new(&v, &[1, 3, 1, 1]));
        // Blocks of one query row and three keys: row 0 sees no key, row 1 all three.
        let mask = [0u8, 1];
        let spec = AttentionSpec::new().block_mask(Tensor::new(&mask, &[2, 1]), 1, 3);
        let r = naive_fp8(&spec, &qt, &kt, &vt).unwrap();
        assert_eq!(r.out, vec![0.0, 2.0]);
        assert_eq!(r.lse[0], f64::NEG_INFINITY);
    }
}
