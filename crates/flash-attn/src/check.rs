//! Conformance checking: random problems run through a backend and compared with the oracle
//! under the numerics contract of DESIGN §2.
//!
//! `max|ours - oracle_f64| <= 2 · max|naive_T - oracle_f64| + eps_T · max(1, max|oracle_f64|)`,
//! where `naive_T` is Algorithm 0 in the input dtype ([`reference::naive`]) and `eps_T` is
//! [`DType::contract_eps`]. Non-finite oracle values (`lse = -inf` for rows that see no key, NaN
//! from NaN inputs) must be matched exactly.
//!
//! Used by the test suite and by `flash-attn check`.

use std::fmt;

use half::{bf16, f16};

use crate::cpu::{self, Tiles};
use crate::dtype::{DType, Element};
use crate::error::Result;
use crate::reference::{self, Reference};
use crate::spec::{AttentionSpec, Causal, Dropout};
use crate::tensor::{Tensor, TensorMut};

/// A small, fast, seedable generator (xoshiro256++ seeded through SplitMix64), so that every
/// random case is reproducible from its seed without an extra dependency.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Self { s: [next(), next(), next(), next()] }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    /// `true` with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.uniform() < p
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// One element of `items`.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.range(0, items.len() - 1)]
    }
}

/// How the inputs of a [`Case`] are laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// Row-major in the DESIGN §2 shape.
    Contiguous,
    /// Heads-major with padded rows (`[b, h, s, d + pad]` in memory), seen through strides.
    Strided {
        /// Extra elements after each row.
        pad: usize,
    },
}

/// A block-sparse mask option of a [`Case`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCase {
    /// Query rows per block.
    pub block_q: usize,
    /// Key columns per block.
    pub block_k: usize,
    /// `[b, hq, qb, kb]` instead of `[qb, kb]`.
    pub per_head: bool,
    /// Fraction of visible blocks, in percent.
    pub density_pct: u8,
}

/// A fully described random problem; its data is generated from `seed`.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    /// Element type.
    pub dtype: DType,
    /// Query heads.
    pub hq: usize,
    /// Key/value heads (divides `hq`).
    pub hk: usize,
    /// Head dim of q and k.
    pub d: usize,
    /// Head dim of v.
    pub dv: usize,
    /// `(sq, sk)` per sequence; all equal unless `varlen`.
    pub seqlens: Vec<(usize, usize)>,
    /// Packed layout with `cu_seqlens`.
    pub varlen: bool,
    /// Causal rule.
    pub causal: Causal,
    /// Sliding window.
    pub window: Option<(i64, i64)>,
    /// Softcap.
    pub softcap: Option<f32>,
    /// Explicit scale.
    pub scale: Option<f32>,
    /// ALiBi, `Some(per_batch)`.
    pub alibi: Option<bool>,
    /// Block-sparse mask.
    pub block: Option<BlockCase>,
    /// Memory layout of q, k, v.
    pub storage: Storage,
    /// Seed of the data.
    pub seed: u64,
    /// The CPU instruction-set path to run on (`None`: the process default); see
    /// [`AttentionSpec::cpu_isa`].
    pub isa: Option<crate::cpu::Isa>,
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} hq={} hk={} d={} dv={}", self.dtype, self.hq, self.hk, self.d, self.dv)?;
        if self.varlen {
            write!(f, " varlen{:?}", self.seqlens)?;
        } else {
            let (sq, sk) = self.seqlens.first().copied().unwrap_or((0, 0));
            write!(f, " b={} sq={sq} sk={sk}", self.seqlens.len())?;
        }
        match self.causal {
            Causal::None => {}
            Causal::BottomRight => write!(f, " causal")?,
            Causal::TopLeft => write!(f, " causal-top-left")?,
        }
        if let Some((l, r)) = self.window {
            write!(f, " window=({l},{r})")?;
        }
        if let Some(c) = self.softcap {
            write!(f, " softcap={c}")?;
        }
        if let Some(isa) = self.isa {
            write!(f, " isa={isa}")?;
        }
        if let Some(s) = self.scale {
            write!(f, " scale={s}")?;
        }
        if let Some(pb) = self.alibi {
            write!(f, " alibi{}", if pb { "[b,hq]" } else { "[hq]" })?;
        }
        if let Some(b) = self.block {
            write!(
                f,
                " block=({},{}){}@{}%",
                b.block_q,
                b.block_k,
                if b.per_head { "[b,hq]" } else { "" },
                b.density_pct
            )?;
        }
        if let Storage::Strided { pad } = self.storage {
            write!(f, " strided(pad={pad})")?;
        }
        write!(f, " seed={}", self.seed)
    }
}

/// The outcome of one contract comparison.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Comparison {
    /// `max|ours - oracle|` over finite oracle values.
    pub max_err: f64,
    /// `max|naive_T - oracle|` over the same values.
    pub naive_err: f64,
    /// The contract's bound.
    pub bound: f64,
    /// `max|oracle|` over finite values.
    pub max_ref: f64,
    /// Elements where ours and the oracle differ in finiteness (or NaN-ness, or infinity sign).
    pub nonfinite_mismatches: usize,
}

impl Comparison {
    /// Whether the contract holds.
    pub fn passed(&self) -> bool {
        self.nonfinite_mismatches == 0 && self.max_err <= self.bound
    }
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "err {:.3e} <= bound {:.3e} (naive {:.3e}, max|ref| {:.3e})",
            self.max_err, self.bound, self.naive_err, self.max_ref
        )?;
        if self.nonfinite_mismatches > 0 {
            write!(f, ", {} non-finite mismatches", self.nonfinite_mismatches)?;
        }
        Ok(())
    }
}

/// Compares `ours` with `oracle` under the numerics contract for `dtype`, using `naive` (Algorithm 0
/// in the dtype) for the tolerance and the oracle's own magnitude for the floor.
pub fn compare(ours: &[f64], oracle: &[f64], naive: &[f64], dtype: DType) -> Comparison {
    compare_with_magnitude(ours, oracle, naive, dtype, 0.0)
}

/// The numerics contract for FP8 inputs (docs/semantics.md, "FP8 inputs"):
/// `max|ours - oracle| <= 2 · max|naive_fp8 - oracle| + eps_bf16 · max(1, max|oracle|)`.
///
/// `oracle` is [`reference::forward`] on the dequantized inputs (`f64` arithmetic), `naive_fp8`
/// is [`reference::naive_fp8`] on the same inputs, and `eps_bf16` is [`DType::BF16`]'s
/// [`DType::contract_eps`], since the output is `bf16`. The tolerance is set by the rounding of
/// the probabilities to e4m3 for `P·V`, which `naive_fp8` models and which dwarfs the other
/// roundings. Non-finite oracle values must be matched exactly, as in [`compare`].
pub fn compare_fp8(ours: &[f64], oracle: &[f64], naive_fp8: &[f64]) -> Comparison {
    compare(ours, oracle, naive_fp8, DType::BF16)
}

/// [`compare_fp8`] for the `out` (`bf16`) and `lse` of an FP8 forward, against the oracle and
/// [`reference::naive_fp8`] on the dequantized inputs.
pub fn report_fp8(out: &[bf16], lse: &[f32], oracle: &Reference, naive_fp8: &Reference) -> CaseReport {
    let out: Vec<f64> = out.iter().map(|x| x.to_f64()).collect();
    let lse: Vec<f64> = lse.iter().map(|&x| x as f64).collect();
    CaseReport {
        out: compare_fp8(&out, &oracle.out, &naive_fp8.out),
        lse: compare_fp8(&lse, &oracle.lse, &naive_fp8.lse),
    }
}

/// Largest finite `|x|`.
pub fn max_abs(xs: &[f64]) -> f64 {
    xs.iter().filter(|x| x.is_finite()).fold(0.0, |m, x| m.max(x.abs()))
}

/// [`compare`] with the floor `eps_T · max(1, magnitude, max|oracle|)`. Gradients use the largest
/// magnitude of the three gradients of the call: they are computed from shared intermediates
/// (`dP`, `D`), whose rounding lands on all of them.
pub fn compare_with_magnitude(ours: &[f64], oracle: &[f64], naive: &[f64], dtype: DType, magnitude: f64) -> Comparison {
    compare_with_floor(ours, oracle, naive, dtype.contract_eps(), magnitude)
}

/// The contract for gradients: [`compare_with_magnitude`] with [`DType::contract_eps_grad`].
pub fn compare_gradient(ours: &[f64], oracle: &[f64], naive: &[f64], dtype: DType, magnitude: f64) -> Comparison {
    compare_with_floor(ours, oracle, naive, dtype.contract_eps_grad(), magnitude)
}

fn compare_with_floor(ours: &[f64], oracle: &[f64], naive: &[f64], eps: f64, magnitude: f64) -> Comparison {
    let (mut max_err, mut naive_err, mut max_ref, mut mismatches) = (0.0f64, 0.0f64, 0.0f64, 0usize);
    if ours.len() != oracle.len() {
        mismatches += ours.len().abs_diff(oracle.len());
    }
    for ((&o, &r), &n) in ours.iter().zip(oracle).zip(naive) {
        if !r.is_finite() {
            let same = (r.is_nan() && o.is_nan()) || r == o;
            mismatches += usize::from(!same);
            continue;
        }
        if !o.is_finite() {
            mismatches += 1;
            continue;
        }
        max_err = max_err.max((o - r).abs());
        if n.is_finite() {
            naive_err = naive_err.max((n - r).abs());
        }
        max_ref = max_ref.max(r.abs());
    }
    let bound = 2.0 * naive_err + eps * max_ref.max(magnitude).max(1.0);
    Comparison { max_err, naive_err, bound, max_ref, nonfinite_mismatches: mismatches }
}

/// The result of running one [`Case`].
#[derive(Debug, Clone)]
pub struct CaseReport {
    /// `out` against the oracle.
    pub out: Comparison,
    /// `lse` against the oracle.
    pub lse: Comparison,
}

impl CaseReport {
    /// Whether every output met the contract.
    pub fn passed(&self) -> bool {
        self.out.passed() && self.lse.passed()
    }
}

impl fmt::Display for CaseReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "out: {}; lse: {}", self.out, self.lse)
    }
}

/// Owned inputs of a case, in one dtype, with the views' shapes and strides.
#[derive(Debug, Clone)]
pub struct CaseData<T> {
    /// `q` buffer.
    pub q: Vec<T>,
    /// `k` buffer.
    pub k: Vec<T>,
    /// `v` buffer.
    pub v: Vec<T>,
    /// Shapes of q, k, v (DESIGN §2).
    pub shapes: [Vec<usize>; 3],
    /// Strides of q, k, v.
    pub strides: [Vec<usize>; 3],
    /// `cu_seqlens_q`, `cu_seqlens_k` when varlen.
    pub cu_seqlens: Option<(Vec<i32>, Vec<i32>)>,
    /// ALiBi slopes and their shape.
    pub alibi: Option<(Vec<f32>, Vec<usize>)>,
    /// Block mask and its shape.
    pub block_mask: Option<(Vec<u8>, Vec<usize>)>,
}

impl<T: Element> CaseData<T> {
    /// Views of q, k, v.
    pub fn views(&self) -> [Tensor<'_, T>; 3] {
        [
            Tensor::with_strides(&self.q, &self.shapes[0], &self.strides[0]),
            Tensor::with_strides(&self.k, &self.shapes[1], &self.strides[1]),
            Tensor::with_strides(&self.v, &self.shapes[2], &self.strides[2]),
        ]
    }
}

impl Case {
    /// A random case: shapes, options and layout all drawn from `rng`.
    pub fn random(rng: &mut Rng) -> Case {
        let dtype = rng.pick(&[DType::F32, DType::F16, DType::BF16]);
        let hk = rng.pick(&[1, 1, 2, 3, 4]);
        let hq = hk * rng.pick(&[1, 1, 2, 3, 4]).min(8 / hk).max(1);
        let d = if rng.chance(0.3) { rng.range(1, 160) } else { rng.pick(&[16, 32, 64, 128]) };
        let dv = if rng.chance(0.3) { rng.range(1, 96) } else { d };
        let varlen = rng.chance(0.3);
        let batch = rng.range(1, 3);
        let len = |rng: &mut Rng| if rng.chance(0.15) { rng.range(0, 2) } else { rng.range(1, 150) };
        let seqlens = if varlen {
            (0..batch).map(|_| (len(rng), len(rng))).collect()
        } else {
            let (sq, sk) = (len(rng).max(1), len(rng).max(1));
            vec![(sq, sk); batch]
        };
        let causal = rng.pick(&[Causal::None, Causal::None, Causal::BottomRight, Causal::TopLeft]);
        let side = |rng: &mut Rng| if rng.chance(0.3) { -1 } else { rng.range(0, 40) as i64 };
        let window = rng.chance(0.25).then(|| (side(rng), side(rng)));
        let softcap = rng.chance(0.2).then(|| rng.range(5, 50) as f32);
        let scale = rng.chance(0.2).then(|| (0.05 + rng.uniform() * 0.5) as f32);
        let alibi = rng.chance(0.2).then(|| rng.chance(0.5));
        let block = rng.chance(0.2).then(|| BlockCase {
            block_q: rng.pick(&[1, 3, 16, 64, 128]),
            block_k: rng.pick(&[1, 5, 16, 64, 128]),
            per_head: rng.chance(0.5),
            density_pct: rng.pick(&[30, 70, 100]),
        });
        let storage = if rng.chance(0.2) { Storage::Strided { pad: rng.range(0, 3) } } else { Storage::Contiguous };
        let seed = rng.next_u64();
        Case {
            dtype,
            hq,
            hk,
            d,
            dv,
            seqlens,
            varlen,
            causal,
            window,
            softcap,
            scale,
            alibi,
            block,
            storage,
            seed,
            isa: None,
        }
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.seqlens.len()
    }

    /// Generates the inputs in dtype `T` (standard normal q, k, v; slopes in `(0, 0.5]`).
    pub fn data<T: Element>(&self) -> CaseData<T> {
        let mut rng = Rng::new(self.seed);
        let b = self.batch();
        let (tq, tk): (usize, usize) = if self.varlen {
            (self.seqlens.iter().map(|s| s.0).sum(), self.seqlens.iter().map(|s| s.1).sum())
        } else {
            // Fixed length: every entry has the first one's lengths; an empty batch has none.
            self.seqlens.first().copied().unwrap_or((0, 0))
        };
        let lead: &[usize] = if self.varlen { &[] } else { std::slice::from_ref(&b) };
        let layout = |s: usize, h: usize, dim: usize| -> (Vec<usize>, Vec<usize>, usize) {
            let mut shape = lead.to_vec();
            shape.extend([s, h, dim]);
            let (strides, len) = match self.storage {
                Storage::Contiguous => {
                    let st = crate::tensor::contiguous_strides(&shape);
                    (st, shape.iter().product())
                }
                Storage::Strided { pad } => {
                    // Memory is [b, h, s, dim + pad].
                    let row = dim + pad;
                    let (ts, hs) = (row, s * row);
                    let mut st = if self.varlen { vec![] } else { vec![h * s * row] };
                    st.extend([ts, hs, 1]);
                    (st, lead.iter().product::<usize>() * h * s * row)
                }
            };
            (shape, strides, len)
        };
        let mut fill = |n: usize| -> Vec<T> { (0..n).map(|_| T::from_f64(rng.normal())).collect() };
        let (qs, qst, ql) = layout(tq, self.hq, self.d);
        let (ks, kst, kl) = layout(tk, self.hk, self.d);
        let (vs, vst, vl) = layout(tk, self.hk, self.dv);
        let (q, k, v) = (fill(ql), fill(kl), fill(vl));
        let cu_seqlens = self.varlen.then(|| {
            let mut cq = vec![0i32];
            let mut ck = vec![0i32];
            for &(sq, sk) in &self.seqlens {
                cq.push(cq[cq.len() - 1] + sq as i32);
                ck.push(ck[ck.len() - 1] + sk as i32);
            }
            (cq, ck)
        });
        let alibi = self.alibi.map(|per_batch| {
            let shape = if per_batch { vec![b, self.hq] } else { vec![self.hq] };
            let n = shape.iter().product();
            ((0..n).map(|_| (0.01 + 0.49 * rng.uniform()) as f32).collect(), shape)
        });
        let block_mask = self.block.map(|bc| {
            let max_sq = self.seqlens.iter().map(|s| s.0).max().unwrap_or(0);
            let max_sk = self.seqlens.iter().map(|s| s.1).max().unwrap_or(0);
            let (qb, kb) = (max_sq.div_ceil(bc.block_q), max_sk.div_ceil(bc.block_k));
            let shape = if bc.per_head { vec![b, self.hq, qb, kb] } else { vec![qb, kb] };
            let n = shape.iter().product();
            let p = f64::from(bc.density_pct) / 100.0;
            ((0..n).map(|_| u8::from(rng.chance(p))).collect(), shape)
        });
        CaseData { q, k, v, shapes: [qs, ks, vs], strides: [qst, kst, vst], cu_seqlens, alibi, block_mask }
    }

    /// The spec of this case over `data`.
    pub fn spec<'a, T>(&self, data: &'a CaseData<T>) -> AttentionSpec<'a> {
        let mut spec = AttentionSpec::new().causal_mode(self.causal);
        if let Some((l, r)) = self.window {
            spec = spec.window(l, r);
        }
        if let Some(c) = self.softcap {
            spec = spec.softcap(c);
        }
        if let Some(s) = self.scale {
            spec = spec.scale(s);
        }
        if let Some((slopes, shape)) = &data.alibi {
            spec = spec.alibi_slopes(Tensor::new(slopes, shape));
        }
        if let (Some(bc), Some((mask, shape))) = (self.block, &data.block_mask) {
            spec = spec.block_mask(Tensor::new(mask, shape), bc.block_q, bc.block_k);
        }
        if let Some((cq, ck)) = &data.cu_seqlens {
            spec = spec.varlen(cq, ck);
        }
        if let Some(isa) = self.isa {
            spec = spec.cpu_isa(isa);
        }
        spec
    }

    /// Runs the case on the CPU backend and compares with the oracle.
    pub fn run_cpu(&self) -> Result<CaseReport> {
        self.run_cpu_tiled(None)
    }

    /// [`Case::run_cpu`] with explicit tile sizes (`None`: the backend's choice).
    pub fn run_cpu_tiled(&self, tiles: Option<Tiles>) -> Result<CaseReport> {
        match self.dtype {
            DType::F32 => self.run_cpu_typed::<f32>(tiles),
            DType::F16 => self.run_cpu_typed::<f16>(tiles),
            DType::BF16 => self.run_cpu_typed::<bf16>(tiles),
        }
    }

    fn run_cpu_typed<T: Element>(&self, tiles: Option<Tiles>) -> Result<CaseReport> {
        let data = self.data::<T>();
        let spec = self.spec(&data);
        let [q, k, v] = data.views();
        let g = spec.geometry(&q, &k, &v)?;
        let out_shape = g.out_shape();
        let mut out = vec![T::default(); out_shape.iter().product()];
        let mut lse = vec![0.0f32; g.lse_len()];
        let mut out_view = TensorMut::new(&mut out, &out_shape);
        match tiles {
            Some(t) => cpu::forward_into_tiled(&g, &q, &k, &v, &mut out_view, &mut lse, t)?,
            None => cpu::forward_into(&g, &q, &k, &v, &mut out_view, &mut lse)?,
        }
        let oracle = reference::forward(&spec, &q, &k, &v)?;
        let naive = reference::naive(&spec, &q, &k, &v)?;
        Ok(report(&out, &lse, &oracle, &naive, self.dtype))
    }
}

/// The result of running the backward pass of one [`Case`].
#[derive(Debug, Clone)]
pub struct BackwardReport {
    /// `dq` against the oracle.
    pub dq: Comparison,
    /// `dk` against the oracle.
    pub dk: Comparison,
    /// `dv` against the oracle.
    pub dv: Comparison,
}

impl BackwardReport {
    /// Whether every gradient met the contract.
    pub fn passed(&self) -> bool {
        self.dq.passed() && self.dk.passed() && self.dv.passed()
    }
}

impl fmt::Display for BackwardReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dq: {}; dk: {}; dv: {}", self.dq, self.dk, self.dv)
    }
}

impl Case {
    /// Drops the softcap unless `softcap`, ALiBi unless `alibi` and the block mask unless
    /// `blocks`: what a kernel variant without those paths can run of this case.
    pub fn retain_paths(&mut self, softcap: bool, alibi: bool, blocks: bool) {
        if !softcap {
            self.softcap = None;
        }
        if !alibi {
            self.alibi = None;
        }
        if !blocks {
            self.block = None;
        }
    }

    /// Runs forward and backward on the CPU (with `dropout` if given) for a random `dout`, and
    /// compares `dq, dk, dv` with the oracle's backward.
    pub fn run_cpu_backward(&self, dropout: Option<Dropout>) -> Result<BackwardReport> {
        match self.dtype {
            DType::F32 => self.run_cpu_backward_typed::<f32>(dropout),
            DType::F16 => self.run_cpu_backward_typed::<f16>(dropout),
            DType::BF16 => self.run_cpu_backward_typed::<bf16>(dropout),
        }
    }

    /// A random `dout` for this case, shaped like `out` (contiguous).
    pub fn dout<T: Element>(&self, data: &CaseData<T>) -> Result<(Vec<T>, Vec<usize>)> {
        let [q, k, v] = data.views();
        let shape = self.spec(data).geometry(&q, &k, &v)?.out_shape();
        let mut rng = Rng::new(self.seed ^ 0xD0D0_D0D0);
        Ok(((0..shape.iter().product()).map(|_| T::from_f64(rng.normal())).collect(), shape))
    }

    fn run_cpu_backward_typed<T: Element>(&self, dropout: Option<Dropout>) -> Result<BackwardReport> {
        let data = self.data::<T>();
        let mut spec = self.spec(&data);
        if let Some(dr) = dropout {
            spec = spec.dropout(dr.p, dr.seed, dr.offset);
        }
        let [q, k, v] = data.views();
        let (dout, dout_shape) = self.dout(&data)?;
        let dout = Tensor::new(&dout, &dout_shape);
        let saved = crate::forward_train(&spec, &q, &k, &v)?;
        let grads = saved.backward(&spec, &q, &k, &v, &dout)?;
        compare_gradients(&spec, &grads, &data, &dout, self.dtype)
    }
}

/// Compares a backend's gradients for `spec` on `data` and `dout` with the oracle's under the
/// numerics contract (the gradient floor scaled by the largest oracle gradient of the three).
pub fn compare_gradients<T: Element>(
    spec: &AttentionSpec<'_>,
    grads: &crate::Gradients<T>,
    data: &CaseData<T>,
    dout: &Tensor<'_, T>,
    dtype: DType,
) -> Result<BackwardReport> {
    let [q, k, v] = data.views();
    let oracle = reference::backward(spec, &q, &k, &v, dout)?;
    let naive = reference::naive_backward(spec, &q, &k, &v, dout)?;
    let widen = |x: &[T]| x.iter().map(|v| v.to_f64()).collect::<Vec<_>>();
    let m = max_abs(&oracle.dq).max(max_abs(&oracle.dk)).max(max_abs(&oracle.dv));
    Ok(BackwardReport {
        dq: compare_gradient(&widen(&grads.dq), &oracle.dq, &naive.dq, dtype, m),
        dk: compare_gradient(&widen(&grads.dk), &oracle.dk, &naive.dk, dtype, m),
        dv: compare_gradient(&widen(&grads.dv), &oracle.dv, &naive.dv, dtype, m),
    })
}

/// Compares a backend's `out` and `lse` with the oracle and `naive_T`.
pub fn report<T: Element>(out: &[T], lse: &[f32], oracle: &Reference, naive: &Reference, dtype: DType) -> CaseReport {
    let out: Vec<f64> = out.iter().map(|x| x.to_f64()).collect();
    let lse: Vec<f64> = lse.iter().map(|&x| x as f64).collect();
    CaseReport {
        out: compare(&out, &oracle.out, &naive.out, dtype),
        lse: compare(&lse, &oracle.lse, &naive.lse, dtype),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_reproducible_and_roughly_normal() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        assert_eq!(a.next_u64(), b.next_u64());
        let xs: Vec<f64> = (0..20000).map(|_| a.normal()).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(mean.abs() < 0.05 && (var - 1.0).abs() < 0.05, "mean {mean} var {var}");
    }

    #[test]
    fn retain_paths_drops_only_what_it_is_told() {
        let mut rng = Rng::new(5);
        let mut c = Case::random(&mut rng);
        (c.softcap, c.alibi) = (Some(20.0), Some(true));
        c.block = Some(BlockCase { block_q: 16, block_k: 16, per_head: false, density_pct: 70 });
        let (window, causal) = (c.window, c.causal);
        let mut mods_only = c.clone();
        mods_only.retain_paths(true, true, false);
        assert!(mods_only.softcap.is_some() && mods_only.alibi.is_some() && mods_only.block.is_none());
        let mut cap_only = c.clone();
        cap_only.retain_paths(true, false, false);
        assert!(cap_only.softcap.is_some() && cap_only.alibi.is_none() && cap_only.block.is_none());
        let mut alibi_only = c.clone();
        alibi_only.retain_paths(false, true, false);
        assert!(alibi_only.softcap.is_none() && alibi_only.alibi.is_some() && alibi_only.block.is_none());
        c.retain_paths(false, false, true);
        assert!(c.softcap.is_none() && c.alibi.is_none() && c.block.is_some());
        assert_eq!((c.window, c.causal), (window, causal));
    }

    #[test]
    fn compare_flags_an_error_beyond_the_bound() {
        let oracle = [1.0, 2.0, f64::NEG_INFINITY];
        let naive = [1.001, 2.0, f64::NEG_INFINITY];
        let good = compare(&[1.0015, 2.0, f64::NEG_INFINITY], &oracle, &naive, DType::F32);
        assert!(good.passed(), "{good}");
        let bad = compare(&[1.01, 2.0, f64::NEG_INFINITY], &oracle, &naive, DType::F32);
        assert!(!bad.passed());
        let inf = compare(&[1.0, 2.0, 0.0], &oracle, &naive, DType::F32);
        assert_eq!(inf.nonfinite_mismatches, 1);
    }
}
