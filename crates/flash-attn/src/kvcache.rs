//! Inference with a KV cache (DESIGN §6): FlashAttention's `flash_attn_with_kvcache` semantics.
//!
//! A batch of `sq ≥ 1` new query tokens per sequence (decode, speculative decoding, chunked
//! prefill) attends to the keys and values already in a cache, after the call has written the new
//! tokens' keys and values into it:
//! - the cache is contiguous, `k_cache [b_cache, s_cache, hk, d]` (sequence `b` in row
//!   `cache_batch_idx[b]`, default `b`), or **paged**, `k_cache [num_pages, page_size, hk, d]`
//!   with `block_table [b, max_pages]`: cache position `t` of sequence `b` is row `t % page_size`
//!   of page `block_table[b][t / page_size]`, for any `page_size ≥ 1`;
//! - `cache_seqlens[b]` tokens are in the cache; the optional new `k, v [b, sn, hk, d|dv]` are
//!   written at positions `cache_seqlens[b] ..` (rotated first when rotary embedding is on);
//! - the sequence's keys are cache positions `cache_leftpad[b] .. cache_seqlens[b] + sn`, so it
//!   has `sk_b = cache_seqlens[b] + sn - cache_leftpad[b]` keys; masks and ALiBi align with
//!   `off = sk_b - sq` as in DESIGN §2.
//!
//! Every input is checked before anything is written: a block table entry past the pages,
//! `cache_seqlens` past the cache, new tokens that do not fit, two sequences writing one cache
//! slot — each is a typed [`Error`] with the cache and the outputs untouched.
//!
//! The new keys and values of every sequence are written before any sequence attends, so a
//! sequence reading a page another sequence appends to (a shared prefix page) sees the appended
//! rows; the result never depends on scheduling.
//!
//! ```
//! use flash_attn::{kvcache::KvCache, AttentionSpec, Tensor, TensorMut};
//!
//! // Two sequences, 4 query heads over 2 kv heads, d = 8; a paged cache of 6 pages of 4 tokens.
//! let (b, hq, hk, d, page, pages) = (2, 4, 2, 8, 4, 6);
//! let q: Vec<f32> = (0..b * hq * d).map(|i| (i as f32 * 0.3).sin()).collect();
//! let mut k_cache: Vec<f32> = (0..pages * page * hk * d).map(|i| (i as f32 * 0.7).cos()).collect();
//! let mut v_cache: Vec<f32> = (0..pages * page * hk * d).map(|i| (i as f32 * 0.2).sin()).collect();
//! let k_new: Vec<f32> = (0..b * hk * d).map(|i| (i as f32 * 0.9).sin()).collect();
//! let v_new: Vec<f32> = (0..b * hk * d).map(|i| (i as f32 * 0.4).cos()).collect();
//! let seqlens = [5, 2]; // tokens already cached
//! let block_table = [0, 3, 5, 1, 2, 4]; // [b, max_pages = 3]
//!
//! let cache = KvCache::new(&seqlens)
//!     .paged(Tensor::new(&block_table, &[b, 3]))
//!     .append(Tensor::new(&k_new, &[b, 1, hk, d]), Tensor::new(&v_new, &[b, 1, hk, d]));
//! let res = flash_attn::kvcache::forward(
//!     &AttentionSpec::new().causal(),
//!     &Tensor::new(&q, &[b, 1, hq, d]),
//!     &mut TensorMut::new(&mut k_cache, &[pages, page, hk, d]),
//!     &mut TensorMut::new(&mut v_cache, &[pages, page, hk, d]),
//!     &cache,
//! )?;
//! assert_eq!(res.out_shape, vec![b, 1, hq, d]);
//! // Sequence 0's new key went to position 5: page block_table[0][1] = 3, row 1.
//! let at = ((3 * page + 1) * hk) * d;
//! assert_eq!(&k_cache[at..at + hk * d], &k_new[..hk * d]);
//! # Ok::<(), flash_attn::Error>(())
//! ```

use crate::cpu::Isa;
use crate::dtype::Element;
use crate::error::{numel, try_vec, Error, Result};
use crate::spec::{check_alibi, AlibiRef, AttentionSpec, Causal, RowLayout, Sequence};
use crate::tensor::{Tensor, TensorMut};
use crate::Output;

/// Rotary embedding tables and layout (see [`KvCache::rotary`]).
#[derive(Debug, Clone)]
pub struct Rotary<'a, T> {
    /// `[max_pos, rd / 2]`: `cos` of the angle of each position and frequency.
    pub cos: Tensor<'a, T>,
    /// `[max_pos, rd / 2]`: `sin` of the same angles.
    pub sin: Tensor<'a, T>,
    /// GPT-J pairs `(2i, 2i + 1)` when true, GPT-NeoX pairs `(i, i + rd / 2)` when false.
    pub interleaved: bool,
}

/// The cache-side inputs of a KV-cache call: everything besides `q`, the cache tensors and the
/// [`AttentionSpec`]. Built with chained setters; checked when the call runs.
#[derive(Debug, Clone)]
pub struct KvCache<'a, T> {
    seqlens: &'a [i32],
    batch_idx: Option<&'a [i32]>,
    block_table: Option<Tensor<'a, i32>>,
    leftpad: Option<&'a [i32]>,
    new_kv: Option<(Tensor<'a, T>, Tensor<'a, T>)>,
    rotary: Option<Rotary<'a, T>>,
    num_splits: usize,
}

impl<'a, T> KvCache<'a, T> {
    /// A contiguous cache holding `cache_seqlens[b]` tokens of sequence `b` (one entry per
    /// sequence of `q`), nothing appended, no rotary embedding, splits chosen by the heuristic.
    pub fn new(cache_seqlens: &'a [i32]) -> Self {
        Self {
            seqlens: cache_seqlens,
            batch_idx: None,
            block_table: None,
            leftpad: None,
            new_kv: None,
            rotary: None,
            num_splits: 0,
        }
    }

    /// Contiguous cache only: sequence `b` lives in cache row `idx[b]` (default `b`, with
    /// `b_cache = b`). Sequences that append must use distinct rows.
    #[must_use]
    pub fn batch_idx(mut self, idx: &'a [i32]) -> Self {
        self.batch_idx = Some(idx);
        self
    }

    /// A paged cache: `k_cache [num_pages, page_size, hk, d]`, and `block_table [b, max_pages]`
    /// lists each sequence's pages in order. Any `page_size ≥ 1`.
    #[must_use]
    pub fn paged(mut self, block_table: Tensor<'a, i32>) -> Self {
        self.block_table = Some(block_table);
        self
    }

    /// Sequence `b`'s tokens start at cache position `leftpad[b]` (`≤ cache_seqlens[b]`); earlier
    /// positions are ignored.
    #[must_use]
    pub fn leftpad(mut self, leftpad: &'a [i32]) -> Self {
        self.leftpad = Some(leftpad);
        self
    }

    /// New keys `k [b, sn, hk, d]` and values `v [b, sn, hk, dv]`, written into the cache at
    /// positions `cache_seqlens[b] .. cache_seqlens[b] + sn` before attending.
    #[must_use]
    pub fn append(mut self, k: Tensor<'a, T>, v: Tensor<'a, T>) -> Self {
        self.new_kv = Some((k, v));
        self
    }

    /// Rotary embedding with tables `cos, sin [max_pos, rd / 2]` (`rd ≤ d`, the first `rd`
    /// dimensions rotate): the new keys rotate at their cache positions before they are written;
    /// query row `i` rotates at position `cache_seqlens[b] + i` when the spec is causal or
    /// windowed, else every query row at `cache_seqlens[b]` (FlashAttention's rule). Positions are
    /// cache positions, `cache_leftpad` included. Computed in `f32`, rounded to the dtype.
    #[must_use]
    pub fn rotary(mut self, cos: Tensor<'a, T>, sin: Tensor<'a, T>, interleaved: bool) -> Self {
        self.rotary = Some(Rotary { cos, sin, interleaved });
        self
    }

    /// The split count asked for with [`KvCache::num_splits`] (0: the heuristic's).
    pub fn split_count(&self) -> usize {
        self.num_splits
    }

    /// Splits each sequence's key range into `n` parts computed in parallel and merged by their
    /// log-sum-exp (Flash-Decoding); `0` (the default) lets [`splits_heuristic`] choose. Results
    /// are bitwise the same for a given `n` whatever the thread count.
    #[must_use]
    pub fn num_splits(mut self, n: usize) -> Self {
        self.num_splits = n;
        self
    }
}

/// Keys per split at least (below it, the merge and the per-split setup cost more than the
/// parallelism buys).
pub const MIN_KEYS_PER_SPLIT: usize = 512;

/// Work units the CPU's heuristic aims for: enough to keep a 128-core CPU busy (the GPU's own
/// heuristic is `cuda::decode::splits_for`).
pub const TARGET_UNITS: usize = 128;

/// Largest number of splits the heuristic picks.
pub const MAX_SPLITS: usize = 64;

/// The number of splits the heuristic gives a problem with `units` independent work units without
/// splitting (sequences × kv heads × query-row blocks) and `max_sk` keys in its longest sequence:
/// enough splits to reach [`TARGET_UNITS`] units, no split shorter than [`MIN_KEYS_PER_SPLIT`]
/// keys, at most [`MAX_SPLITS`].
///
/// It depends on the problem only, never on the thread count, so the CPU's results stay bitwise
/// the same on every thread count (DESIGN §2).
pub fn splits_heuristic(units: usize, max_sk: usize) -> usize {
    let wanted = TARGET_UNITS.div_ceil(units.max(1));
    let by_length = (max_sk / MIN_KEYS_PER_SPLIT).max(1);
    wanted.min(by_length).clamp(1, MAX_SPLITS)
}

/// Where a sequence's tokens live in the cache.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Slots<'a> {
    /// Sequence `b` is cache row `KvSeq::row`; position `t` is index `t` of dimension 1.
    Contiguous,
    /// Position `t` is row `t % page_size` of page `table[b · s0 + (t / page_size) · s1]`.
    Paged { table: &'a [i32], strides: (usize, usize), page_size: usize },
}

/// One sequence of a KV-cache call, after validation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvSeq {
    /// `cache_seqlens[b]`: where the new tokens go.
    pub cached: usize,
    /// `cache_leftpad[b]`: the cache position of key 0.
    pub start: usize,
    /// Keys the sequence attends to: `cached + sn - start`.
    pub sk: usize,
    /// Cache row of a contiguous cache (`cache_batch_idx[b]`).
    pub row: usize,
}

/// Rotary tables after validation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RotaryRef<'a, T> {
    pub cos: &'a [T],
    pub sin: &'a [T],
    /// Row strides of `cos` and `sin`.
    pub strides: (usize, usize),
    /// Rotated dimensions (even, ≤ d).
    pub rd: usize,
    pub interleaved: bool,
}

impl<T: Element> RotaryRef<'_, T> {
    /// Rotates the first `rd` elements of `x` to position `pos` (`pos < max_pos`, checked when
    /// the call was validated), in `f32`.
    pub fn rotate(&self, x: &mut [f32], pos: usize) {
        let half = self.rd / 2;
        let (c, s) = (&self.cos[pos * self.strides.0..], &self.sin[pos * self.strides.1..]);
        for f in 0..half {
            let (a, b) = if self.interleaved { (2 * f, 2 * f + 1) } else { (f, f + half) };
            let (cf, sf) = (c[f].to_f32(), s[f].to_f32());
            let (xa, xb) = (x[a], x[b]);
            x[a] = xa * cf - xb * sf;
            x[b] = xa * sf + xb * cf;
        }
    }
}

/// A validated KV-cache problem: what the backends read.
#[derive(Debug, Clone)]
pub(crate) struct KvProblem<'a, T> {
    pub batch: usize,
    pub sq: usize,
    pub hq: usize,
    pub hk: usize,
    pub d: usize,
    pub dv: usize,
    /// New tokens per sequence (0 without `append`).
    pub sn: usize,
    pub scale: f32,
    pub softcap: Option<f32>,
    pub causal: Causal,
    pub window: Option<(i64, i64)>,
    pub alibi: Option<AlibiRef<'a>>,
    pub seqs: Vec<KvSeq>,
    pub slots: Slots<'a>,
    /// Strides of dimensions 0 (cache row or page), 1 (position or row in page) and 2 (head).
    pub k_strides: [usize; 3],
    pub v_strides: [usize; 3],
    /// Layout of `q`: batch, token and head strides.
    pub q: RowLayout,
    /// Layout of `out`.
    pub out: RowLayout,
    pub new_k: Option<(&'a [T], RowLayout)>,
    pub new_v: Option<(&'a [T], RowLayout)>,
    pub rotary: Option<RotaryRef<'a, T>>,
    /// Splits asked for (0: heuristic).
    pub num_splits: usize,
    pub cpu_isa: Option<Isa>,
}

fn cache_err(msg: String) -> Error {
    Error::KvCache(msg)
}

fn index(name: &str, b: usize, x: i32) -> Result<usize> {
    usize::try_from(x).map_err(|_| cache_err(format!("`{name}[{b}]` is {x}; it must not be negative")))
}

fn check_len(name: &str, xs: &[i32], batch: usize) -> Result<()> {
    if xs.len() != batch {
        return Err(cache_err(format!("`{name}` has {} entries, expected one per sequence ({batch})", xs.len())));
    }
    Ok(())
}

/// What validation reads of a cache tensor: its layout, checked as an output (no overlapping
/// elements) when the call writes it, as an input when it only reads it.
pub(crate) trait CacheView {
    fn check_cache(&self, name: &'static str, layout: &'static str) -> Result<()>;
    fn shape(&self) -> &[usize];
    fn strides(&self) -> &[usize];
}

impl<T> CacheView for TensorMut<'_, T> {
    fn check_cache(&self, name: &'static str, layout: &'static str) -> Result<()> {
        self.check(name, layout, 4)
    }
    fn shape(&self) -> &[usize] {
        TensorMut::shape(self)
    }
    fn strides(&self) -> &[usize] {
        TensorMut::strides(self)
    }
}

impl<T> CacheView for Tensor<'_, T> {
    fn check_cache(&self, name: &'static str, layout: &'static str) -> Result<()> {
        self.check(name, layout, 4)
    }
    fn shape(&self) -> &[usize] {
        Tensor::shape(self)
    }
    fn strides(&self) -> &[usize] {
        Tensor::strides(self)
    }
}

fn layout4(strides: &[usize]) -> RowLayout {
    RowLayout { batch_stride: strides[0], token_stride: strides[1], head_stride: strides[2] }
}

impl<'a, T> KvProblem<'a, T> {
    /// Validates everything a KV-cache call reads and writes, before anything is written.
    #[allow(clippy::too_many_arguments)]
    pub fn new<U>(
        spec: &AttentionSpec<'a>,
        q: &Tensor<'a, T>,
        k_cache: &impl CacheView,
        v_cache: &impl CacheView,
        cache: &KvCache<'a, T>,
        out: &TensorMut<'_, U>,
        lse_len: usize,
    ) -> Result<Self> {
        if spec.varlen.is_some() || spec.block_mask.is_some() || spec.dropout.is_some_and(|d| d.p != 0.0) {
            return Err(Error::Unsupported(
                "a KV-cache call takes no varlen batch, block mask or dropout (use the cache's \
                 seqlens for lengths)"
                    .into(),
            ));
        }
        q.check("q", "[b, sq, hq, d]", 4)?;
        let paged = cache.block_table.is_some();
        let (lk, lv) = if paged {
            ("[num_pages, page_size, hk, d]", "[num_pages, page_size, hk, dv]")
        } else {
            ("[b_cache, s_cache, hk, d]", "[b_cache, s_cache, hk, dv]")
        };
        k_cache.check_cache("k_cache", lk)?;
        v_cache.check_cache("v_cache", lv)?;
        let (qs, ks, vs) = (q.shape(), k_cache.shape(), v_cache.shape());
        let (batch, sq, hq, d) = (qs[0], qs[1], qs[2], qs[3]);
        let (hk, dv) = (ks[2], vs[3]);
        if ks[3] != d {
            return Err(Error::Shape(format!("`q` has head dim {d} but `k_cache` has {}; they must match", ks[3])));
        }
        if ks[..3] != vs[..3] {
            return Err(Error::Shape(format!(
                "`k_cache` {ks:?} and `v_cache` {vs:?} must agree in all but the last dimension"
            )));
        }
        if hq == 0 || hk == 0 {
            return Err(Error::Shape(format!("head counts must be positive, got hq = {hq}, hk = {hk}")));
        }
        if hq % hk != 0 {
            return Err(Error::HeadRatio { hq, hk });
        }
        if d == 0 || dv == 0 {
            return Err(Error::Shape(format!("head dims must be positive, got d = {d}, dv = {dv}")));
        }
        let scale = spec.scale.unwrap_or(1.0 / (d as f32).sqrt());
        if !scale.is_finite() {
            return Err(Error::Scale(scale));
        }
        if let Some(c) = spec.softcap {
            if !(c.is_finite() && c > 0.0) {
                return Err(Error::Softcap(c));
            }
        }
        if let Some((left, right)) = spec.window {
            if left < -1 || right < -1 {
                return Err(Error::Window { left, right });
            }
        }
        let alibi = spec.alibi.as_ref().map(|t| check_alibi(t, batch, hq)).transpose()?;

        // New tokens.
        let mut sn = 0;
        let (mut new_k, mut new_v) = (None, None);
        if let Some((k, v)) = &cache.new_kv {
            k.check("k", "[b, sn, hk, d]", 4)?;
            v.check("v", "[b, sn, hk, dv]", 4)?;
            sn = k.shape()[1];
            if k.shape() != [batch, sn, hk, d] || v.shape() != [batch, sn, hk, dv] {
                return Err(Error::Shape(format!(
                    "new `k` {:?} and `v` {:?} must be [b, sn, hk, d] = [{batch}, sn, {hk}, {d}] and \
                     [b, sn, hk, dv] = [{batch}, sn, {hk}, {dv}] with one sn",
                    k.shape(),
                    v.shape()
                )));
            }
            new_k = Some((k.data(), layout4(k.strides())));
            new_v = Some((v.data(), layout4(v.strides())));
        }

        // Sequences.
        check_len("cache_seqlens", cache.seqlens, batch)?;
        if let Some(lp) = cache.leftpad {
            check_len("cache_leftpad", lp, batch)?;
        }
        let (capacity, slots) = match &cache.block_table {
            None => (ks[1], Slots::Contiguous),
            Some(table) => {
                if cache.batch_idx.is_some() {
                    return Err(cache_err("`cache_batch_idx` applies to a contiguous cache, not a paged one".into()));
                }
                table.check("block_table", "[b, max_pages]", 2)?;
                let (rows, max_pages) = (table.shape()[0], table.shape()[1]);
                if rows != batch {
                    return Err(cache_err(format!(
                        "`block_table` has {rows} rows, expected one per sequence ({batch})"
                    )));
                }
                let page_size = ks[1];
                if page_size == 0 {
                    return Err(cache_err("the page size (dimension 1 of `k_cache`) must be at least 1".into()));
                }
                let s = table.strides();
                (
                    max_pages.saturating_mul(page_size),
                    Slots::Paged { table: table.data(), strides: (s[0], s[1]), page_size },
                )
            }
        };
        let mut seqs = Vec::with_capacity(batch);
        for b in 0..batch {
            let cached = index("cache_seqlens", b, cache.seqlens[b])?;
            let start = match cache.leftpad {
                Some(lp) => index("cache_leftpad", b, lp[b])?,
                None => 0,
            };
            if start > cached {
                return Err(cache_err(format!(
                    "`cache_leftpad[{b}]` = {start} is past `cache_seqlens[{b}]` = {cached}"
                )));
            }
            let end = cached + sn;
            if end > capacity {
                return Err(cache_err(format!(
                    "sequence {b} needs cache positions up to {end} (`cache_seqlens[{b}]` = {cached} + {sn} new \
                     tokens) but the cache holds {capacity} per sequence"
                )));
            }
            let row = match (&slots, cache.batch_idx) {
                (Slots::Paged { .. }, _) => 0,
                (Slots::Contiguous, Some(idx)) => {
                    check_len("cache_batch_idx", idx, batch)?;
                    let r = index("cache_batch_idx", b, idx[b])?;
                    if r >= ks[0] {
                        return Err(cache_err(format!(
                            "`cache_batch_idx[{b}]` = {r} is past the cache's {} rows",
                            ks[0]
                        )));
                    }
                    r
                }
                (Slots::Contiguous, None) => {
                    if ks[0] != batch {
                        return Err(cache_err(format!(
                            "the cache has {} rows but `q` has {batch} sequences; pass `cache_batch_idx` to map them",
                            ks[0]
                        )));
                    }
                    b
                }
            };
            if let Slots::Paged { table, strides, page_size } = slots {
                // Every page the sequence reads or writes must exist.
                for p in 0..end.div_ceil(page_size) {
                    let page = table[b * strides.0 + p * strides.1];
                    if page < 0 || page as usize >= ks[0] {
                        return Err(cache_err(format!(
                            "`block_table[{b}][{p}]` = {page} is not a page of the cache (0..{})",
                            ks[0]
                        )));
                    }
                }
            }
            seqs.push(KvSeq { cached, start, sk: end - start, row });
        }

        let mut problem = KvProblem {
            batch,
            sq,
            hq,
            hk,
            d,
            dv,
            sn,
            scale,
            softcap: spec.softcap,
            causal: spec.causal,
            window: spec.window,
            alibi,
            seqs,
            slots,
            k_strides: [k_cache.strides()[0], k_cache.strides()[1], k_cache.strides()[2]],
            v_strides: [v_cache.strides()[0], v_cache.strides()[1], v_cache.strides()[2]],
            q: layout4(q.strides()),
            out: RowLayout { batch_stride: 0, token_stride: 0, head_stride: 0 },
            new_k,
            new_v,
            rotary: None,
            num_splits: cache.num_splits,
            cpu_isa: spec.cpu_isa,
        };
        problem.check_writes()?;
        problem.rotary = cache.rotary.as_ref().map(|r| problem.check_rotary(r)).transpose()?;

        // Outputs.
        out.check("out", "[b, sq, hq, dv]", 4)?;
        if out.shape() != [batch, sq, hq, dv] {
            return Err(Error::Shape(format!(
                "`out` has shape {:?}, expected [b, sq, hq, dv] = {:?}",
                out.shape(),
                [batch, sq, hq, dv]
            )));
        }
        problem.out = layout4(out.strides());
        if lse_len != batch * hq * sq {
            return Err(Error::BufferLength { tensor: "lse", expected: batch * hq * sq, got: lse_len });
        }
        Ok(problem)
    }

    /// No two new tokens may land in one cache slot (two sequences on one cache row or page).
    fn check_writes(&self) -> Result<()> {
        if self.sn == 0 {
            return Ok(());
        }
        let mut slots: Vec<(usize, usize, usize)> = Vec::new();
        slots.try_reserve_exact(self.batch.saturating_mul(self.sn)).map_err(|_| Error::OutOfMemory {
            what: "append slots",
            elements: self.batch.saturating_mul(self.sn),
            element_bytes: 24,
        })?;
        for (b, s) in self.seqs.iter().enumerate() {
            slots.extend((s.cached..s.cached + self.sn).map(|t| {
                let (i0, i1) = self.slot(b, t);
                (i0, i1, b)
            }));
        }
        slots.sort_unstable();
        if let Some(w) = slots.windows(2).find(|w| (w[0].0, w[0].1) == (w[1].0, w[1].1)) {
            let what = match self.slots {
                Slots::Contiguous => format!("cache row {}, position {}", w[0].0, w[0].1),
                Slots::Paged { .. } => format!("page {}, row {}", w[0].0, w[0].1),
            };
            return Err(cache_err(format!(
                "sequences {} and {} would both write new tokens to {what}",
                w[0].2, w[1].2
            )));
        }
        Ok(())
    }

    fn check_rotary(&self, r: &Rotary<'a, T>) -> Result<RotaryRef<'a, T>> {
        r.cos.check("rotary_cos", "[max_pos, rd / 2]", 2)?;
        r.sin.check("rotary_sin", "[max_pos, rd / 2]", 2)?;
        if r.cos.shape() != r.sin.shape() {
            return Err(cache_err(format!(
                "`rotary_cos` {:?} and `rotary_sin` {:?} must have one shape",
                r.cos.shape(),
                r.sin.shape()
            )));
        }
        let (max_pos, half) = (r.cos.shape()[0], r.cos.shape()[1]);
        let rd = 2 * half;
        if rd == 0 || rd > self.d {
            return Err(cache_err(format!(
                "rotary tables rotate {rd} dimensions (2 × {half}); it must be between 2 and d = {}",
                self.d
            )));
        }
        let rot = RotaryRef {
            cos: r.cos.data(),
            sin: r.sin.data(),
            strides: (r.cos.strides()[0], r.sin.strides()[0]),
            rd,
            interleaved: r.interleaved,
        };
        for (b, s) in self.seqs.iter().enumerate() {
            let last_q = self.q_position(s, self.sq.saturating_sub(1));
            let last = if self.sn > 0 { last_q.max(s.cached + self.sn - 1) } else { last_q };
            if last >= max_pos {
                return Err(cache_err(format!(
                    "sequence {b} needs rotary position {last} but the tables have {max_pos} positions"
                )));
            }
        }
        Ok(rot)
    }

    /// Rotary position of query row `i` (FlashAttention's rule).
    pub fn q_position(&self, s: &KvSeq, i: usize) -> usize {
        if self.causal != Causal::None || self.window.is_some() {
            s.cached + i
        } else {
            s.cached
        }
    }

    /// `(dimension 0, dimension 1)` indices of cache position `t` of sequence `b`.
    #[inline]
    pub fn slot(&self, b: usize, t: usize) -> (usize, usize) {
        match self.slots {
            Slots::Contiguous => (self.seqs[b].row, t),
            Slots::Paged { table, strides, page_size } => {
                // Entries were checked to be pages of the cache.
                (table[b * strides.0 + (t / page_size) * strides.1] as usize, t % page_size)
            }
        }
    }

    /// Offset in `k_cache` of key `j` (cache position `start + j`) of sequence `b`, head `h`.
    #[inline]
    pub fn k_offset(&self, b: usize, j: usize, h: usize) -> usize {
        let (i0, i1) = self.slot(b, self.seqs[b].start + j);
        i0 * self.k_strides[0] + i1 * self.k_strides[1] + h * self.k_strides[2]
    }

    /// Offset in `v_cache` of value `j` of sequence `b`, head `h`.
    #[inline]
    pub fn v_offset(&self, b: usize, j: usize, h: usize) -> usize {
        let (i0, i1) = self.slot(b, self.seqs[b].start + j);
        i0 * self.v_strides[0] + i1 * self.v_strides[1] + h * self.v_strides[2]
    }

    /// Sequence `b` as a [`Sequence`] of `sq` queries and `sk_b` keys (for masks and ALiBi).
    pub fn sequence(&self, b: usize) -> Sequence {
        Sequence { batch: b, q_start: 0, sq: self.sq, k_start: 0, sk: self.seqs[b].sk }
    }

    /// ALiBi slope of `(b, h)`.
    #[inline]
    pub fn alibi_slope(&self, b: usize, h: usize) -> Option<f32> {
        self.alibi.map(|a| a.data[b * a.strides.0 + h * a.strides.1])
    }
}

impl<T: Element> KvProblem<'_, T> {
    /// Writes the new keys (rotated when rotary is on) and values into the cache.
    pub fn append(&self, k_cache: &mut [T], v_cache: &mut [T]) {
        let (Some((k, kl)), Some((v, vl))) = (self.new_k, self.new_v) else { return };
        let mut row = vec![0.0f32; self.d];
        for (b, s) in self.seqs.iter().enumerate() {
            for t in 0..self.sn {
                let (i0, i1) = self.slot(b, s.cached + t);
                for h in 0..self.hk {
                    let src = b * kl.batch_stride + t * kl.token_stride + h * kl.head_stride;
                    let dst = i0 * self.k_strides[0] + i1 * self.k_strides[1] + h * self.k_strides[2];
                    let (src, dst) = (&k[src..src + self.d], &mut k_cache[dst..dst + self.d]);
                    match &self.rotary {
                        Some(rot) => {
                            T::widen_slice(src, &mut row);
                            rot.rotate(&mut row, s.cached + t);
                            T::narrow_slice(&row, dst);
                        }
                        None => dst.copy_from_slice(src),
                    }
                    let src = b * vl.batch_stride + t * vl.token_stride + h * vl.head_stride;
                    let dst = i0 * self.v_strides[0] + i1 * self.v_strides[1] + h * self.v_strides[2];
                    v_cache[dst..dst + self.dv].copy_from_slice(&v[src..src + self.dv]);
                }
            }
        }
    }
}

/// The cache-side shapes of a call, for a caller that allocates the outputs: `out [b, sq, hq,
/// dv]` and `lse [b, hq, sq]`.
fn output_shapes<T>(q: &Tensor<'_, T>, v_cache: &impl CacheView) -> Result<(Vec<usize>, Vec<usize>)> {
    q.check("q", "[b, sq, hq, d]", 4)?;
    if v_cache.shape().len() != 4 {
        return Err(Error::Rank {
            tensor: "v_cache",
            expected: 4,
            got: v_cache.shape().len(),
            layout: "[b_cache, s_cache, hk, dv]",
            shape: v_cache.shape().to_vec(),
        });
    }
    let (b, sq, hq) = (q.shape()[0], q.shape()[1], q.shape()[2]);
    Ok((vec![b, sq, hq, v_cache.shape()[3]], vec![b, hq, sq]))
}

/// Attention with a KV cache on the CPU, allocating `out [b, sq, hq, dv]` and `lse [b, hq, sq]`:
/// appends the new tokens (if any) to `k_cache` / `v_cache` in place, then attends. See the
/// module docs for the semantics; any invalid input is an [`Error`] with nothing written.
pub fn forward<T: Element>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k_cache: &mut TensorMut<'_, T>,
    v_cache: &mut TensorMut<'_, T>,
    cache: &KvCache<'_, T>,
) -> Result<Output<T>> {
    let (out_shape, lse_shape) = output_shapes(q, v_cache)?;
    let mut out = try_vec("out", numel("out", &out_shape)?, T::default())?;
    let mut lse = try_vec("lse", numel("lse", &lse_shape)?, 0.0f32)?;
    forward_into(spec, q, k_cache, v_cache, cache, &mut TensorMut::new(&mut out, &out_shape), &mut lse)?;
    Ok(Output { out, out_shape, lse, lse_shape })
}

/// [`forward`] into caller-provided `out` (possibly strided) and contiguous `lse [b, hq, sq]`.
pub fn forward_into<T: Element>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k_cache: &mut TensorMut<'_, T>,
    v_cache: &mut TensorMut<'_, T>,
    cache: &KvCache<'_, T>,
    out: &mut TensorMut<'_, T>,
    lse: &mut [f32],
) -> Result<()> {
    let p = KvProblem::new(spec, q, k_cache, v_cache, cache, out, lse.len())?;
    crate::cpu::decode::check_head_dims(p.d, p.dv)?;
    let isa = Isa::resolve(p.cpu_isa)?;
    p.append(k_cache.data_mut(), v_cache.data_mut());
    crate::cpu::decode::forward(&p, isa, q.data(), k_cache.data_mut(), v_cache.data_mut(), out.data_mut(), lse)
}

/// Attention over a KV cache that the call only reads, allocating `out [b, sq, hq, dv]` and
/// `lse [b, hq, sq]`: for frameworks whose tensors are immutable (candle). The caches are plain
/// views (they may even overlap); `cache` must not [`append`](KvCache::append) (an
/// [`Error::KvCache`]: there is nowhere to write).
pub fn forward_readonly<T: Element>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k_cache: &Tensor<'_, T>,
    v_cache: &Tensor<'_, T>,
    cache: &KvCache<'_, T>,
) -> Result<Output<T>> {
    let (out_shape, lse_shape) = output_shapes(q, v_cache)?;
    let mut out = try_vec("out", numel("out", &out_shape)?, T::default())?;
    let mut lse = try_vec("lse", numel("lse", &lse_shape)?, 0.0f32)?;
    forward_readonly_into(spec, q, k_cache, v_cache, cache, &mut TensorMut::new(&mut out, &out_shape), &mut lse)?;
    Ok(Output { out, out_shape, lse, lse_shape })
}

/// [`forward_readonly`] into caller-provided `out` (possibly strided) and contiguous `lse`.
pub fn forward_readonly_into<T: Element>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k_cache: &Tensor<'_, T>,
    v_cache: &Tensor<'_, T>,
    cache: &KvCache<'_, T>,
    out: &mut TensorMut<'_, T>,
    lse: &mut [f32],
) -> Result<()> {
    if cache.new_kv.is_some() {
        return Err(cache_err("a read-only KV-cache call cannot append new tokens".into()));
    }
    let p = KvProblem::new(spec, q, k_cache, v_cache, cache, out, lse.len())?;
    crate::cpu::decode::check_head_dims(p.d, p.dv)?;
    let isa = Isa::resolve(p.cpu_isa)?;
    crate::cpu::decode::forward(&p, isa, q.data(), k_cache.data(), v_cache.data(), out.data_mut(), lse)
}

/// The rotated queries FlashAttention attends with: `q [b, sq, hq, d]` with the first `rd`
/// dimensions of row `i` of sequence `b` rotated to its position (see [`KvCache::rotary`]), in
/// `f32` and rounded to the dtype; contiguous. For callers (and tests) that need the exact query
/// a KV-cache call used; `cache_seqlens` are the values before the call.
pub fn rotate_queries<T: Element>(
    q: &Tensor<'_, T>,
    cache_seqlens: &[i32],
    rotary: &Rotary<'_, T>,
    causal_or_window: bool,
) -> Result<Vec<T>> {
    q.check("q", "[b, sq, hq, d]", 4)?;
    let (b, sq, hq, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    check_len("cache_seqlens", cache_seqlens, b)?;
    rotary.cos.check("rotary_cos", "[max_pos, rd / 2]", 2)?;
    rotary.sin.check("rotary_sin", "[max_pos, rd / 2]", 2)?;
    let (max_pos, half) = (rotary.cos.shape()[0], rotary.cos.shape()[1]);
    if rotary.sin.shape() != rotary.cos.shape() || 2 * half > d || half == 0 {
        return Err(cache_err(format!(
            "rotary tables {:?} / {:?} do not fit head dim {d}",
            rotary.cos.shape(),
            rotary.sin.shape()
        )));
    }
    let rot = RotaryRef {
        cos: rotary.cos.data(),
        sin: rotary.sin.data(),
        strides: (rotary.cos.strides()[0], rotary.sin.strides()[0]),
        rd: 2 * half,
        interleaved: rotary.interleaved,
    };
    let ql = layout4(q.strides());
    let mut outv = try_vec("q_rotated", b * sq * hq * d, T::default())?;
    let mut row = vec![0.0f32; d];
    for (bi, &seqlen) in cache_seqlens.iter().enumerate() {
        let cached = index("cache_seqlens", bi, seqlen)?;
        for i in 0..sq {
            let pos = if causal_or_window { cached + i } else { cached };
            if pos >= max_pos {
                return Err(cache_err(format!("rotary position {pos} is past the tables' {max_pos}")));
            }
            for h in 0..hq {
                let at = bi * ql.batch_stride + i * ql.token_stride + h * ql.head_stride;
                T::widen_slice(&q.data()[at..at + d], &mut row);
                rot.rotate(&mut row, pos);
                let dst = ((bi * sq + i) * hq + h) * d;
                T::narrow_slice(&row, &mut outv[dst..dst + d]);
            }
        }
    }
    Ok(outv)
}
