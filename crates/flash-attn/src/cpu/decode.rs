//! Attention over a KV cache on the CPU (DESIGN §6): Flash-Decoding with GQA packing.
//!
//! A work unit is `(sequence, kv head, block of packed query rows, split)`. The packed rows of a
//! kv head are the `hq / hk` query heads that read it times the `sq` query tokens (row
//! `r = i · group + hh` is token `i` of head `kv · group + hh`), so each key and value row is read
//! from the cache once per kv head, not once per query head. Key chunks are gathered from the
//! cache (contiguous or paged, any page size) into `f32` tiles, then go through the same GEMM,
//! online softmax and `exp` kernels as the forward pass.
//!
//! When the sequences × kv heads × row blocks are too few to fill the machine, each sequence's key
//! range is split ([`crate::kvcache::splits_heuristic`], or the caller's count); every split
//! writes a normalised partial output and its log-sum-exp, and a second pass merges them by LSE
//! weights, in split order. The number of splits depends on the problem, never on the thread
//! count, so results are bitwise the same on every thread count.

use std::ops::Range;

use super::gemm::{gemm, gemm_acc_skipping_zeros, BLayout};
use super::isa::Isa;
use super::softmax::{merge_row, OnlineSoftmax};
use super::transpose::transpose;
use super::{finite_f32, for_each_dynamic, Sink};
use crate::dtype::Element;
use crate::error::{try_vec, Error, Result};
use crate::kvcache::{splits_heuristic, KvProblem};
use crate::mask::Visibility;

/// Packed query rows per unit at most.
const MR: usize = 64;
/// Keys per chunk.
const BC: usize = 64;

/// Checks the head dims against what the CPU backend accepts.
pub(crate) fn check_head_dims(d: usize, dv: usize) -> Result<()> {
    for (tensor, dim) in [("q", d), ("v_cache", dv)] {
        if dim > super::MAX_HEAD_DIM {
            return Err(Error::HeadDim { tensor, dim, backend: "cpu", min: 1, max: super::MAX_HEAD_DIM });
        }
    }
    Ok(())
}

/// One unit of work: packed rows `rows` of kv heads `heads` of sequence `b`, keys of `split`.
#[derive(Debug, Clone)]
struct Unit {
    b: usize,
    heads: Range<usize>,
    /// Packed rows of each head.
    rows: Range<usize>,
    split: usize,
    /// Splits of the problem.
    splits: usize,
    /// Visible (row, key) pairs, for the schedule.
    cost: usize,
}

/// Per-thread buffers: the query rows, output accumulators and softmax state of each kv head of
/// a unit, and one key/value chunk.
struct Scratch {
    q: Vec<f32>,
    o: Vec<f32>,
    softmax: Vec<OnlineSoftmax>,
    k: Vec<f32>,
    kt: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
    /// Row pointers of one chunk, for the direct kernels.
    ptrs: Vec<*const u8>,
    /// The query rows' bf16 bits (bf16 scores).
    qbits: Vec<u16>,
    /// Token-major scores of the direct kernels, `[BC, heads × rows]`.
    st: Vec<f32>,
    /// Probabilities as bf16 pairs along the keys, `[rows, BC / 2]`.
    pp: Vec<u32>,
    /// The values' run pointers of one chunk (prefetched by the direct score kernel).
    vptrs: Vec<*const u8>,
}

impl Scratch {
    fn new(d: usize, dv: usize, heads: usize, rows: usize) -> Self {
        Self {
            q: vec![0.0; heads * rows * d],
            o: vec![0.0; heads * rows * dv],
            softmax: (0..heads).map(|_| OnlineSoftmax::default()).collect(),
            k: vec![0.0; BC * d],
            kt: vec![0.0; d * BC],
            v: vec![0.0; BC * dv],
            s: vec![0.0; heads * rows * BC],
            ptrs: vec![std::ptr::null(); BC],
            qbits: vec![0; heads * rows * d],
            st: vec![0.0; BC * heads * rows],
            pp: vec![0; rows * BC / 2],
            vptrs: vec![std::ptr::null(); BC],
        }
    }
}

/// How a problem's rows and heads are cut into units: `rows_per_unit` packed rows of each of
/// `heads_per_unit` kv heads. A unit walks its keys in address order across its kv heads (the
/// cache is token-major, `[.., token, head, d]`), so when few rows share a kv head (decoding)
/// several heads go in one unit: each token's rows of those heads are one contiguous read.
#[derive(Debug, Clone, Copy)]
struct Blocking {
    rows_per_unit: usize,
    heads_per_unit: usize,
}

impl Blocking {
    fn new<T: Element>(p: &KvProblem<'_, T>) -> Self {
        let m = p.sq * (p.hq / p.hk);
        let rows_per_unit = m.clamp(1, MR);
        Self { rows_per_unit, heads_per_unit: (MR / rows_per_unit).clamp(1, p.hk) }
    }

    /// Units of a problem before splitting.
    fn units<T: Element>(&self, p: &KvProblem<'_, T>) -> usize {
        let m = p.sq * (p.hq / p.hk);
        p.batch * p.hk.div_ceil(self.heads_per_unit) * m.div_ceil(self.rows_per_unit)
    }
}

/// The key range `[lo, hi)` of split `s` of `n` over `sk` keys, in whole chunks of [`BC`] keys.
fn split_range(sk: usize, s: usize, n: usize) -> Range<usize> {
    let chunks = sk.div_ceil(BC);
    let lo = (s * chunks / n) * BC;
    let hi = ((s + 1) * chunks / n * BC).min(sk);
    lo.min(sk)..hi.max(lo.min(sk))
}

/// The problem's split count: the caller's, or the heuristic's; never more than the longest
/// sequence has key chunks.
fn split_count<T: Element>(p: &KvProblem<'_, T>, blocking: Blocking) -> usize {
    let max_sk = p.seqs.iter().map(|s| s.sk).max().unwrap_or(0);
    let chunks = max_sk.div_ceil(BC).max(1);
    let n = match p.num_splits {
        0 => splits_heuristic(blocking.units(p), max_sk),
        n => n,
    };
    n.min(chunks)
}

/// `dst = src` widened to `f32` ([`super::pairs::widen_bf16`] for `bf16`, on `isa`); returns
/// whether every element is finite.
#[inline]
fn load_row<T: Element>(isa: Isa, src: &[T], dst: &mut [f32]) -> bool {
    if let Some(bits) = super::pairs::bf16_bits(src) {
        return super::pairs::widen_bf16::<true>(isa, bits, dst);
    }
    match T::as_f32(src) {
        Some(f) => dst.copy_from_slice(f),
        None => T::widen_slice(src, dst),
    }
    finite_f32(dst)
}

/// Asks the cache hierarchy for the lines of `row` (a hint; nothing on targets without one).
#[inline]
fn prefetch_row<T>(row: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let bytes = std::mem::size_of_val(row);
        let base = row.as_ptr().cast::<i8>();
        for off in (0..bytes).step_by(64) {
            // SAFETY: a prefetch is a hint that never faults; `base + off` is inside `row`.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(base.add(off)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// Attention of the validated problem `p` over the (already appended) cache into `out` (layout
/// `p.out`) and `lse [b, hq, sq]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<T: Element>(
    p: &KvProblem<'_, T>,
    isa: Isa,
    q: &[T],
    k_cache: &[T],
    v_cache: &[T],
    out: &mut [T],
    lse: &mut [f32],
) -> Result<()> {
    let group = p.hq / p.hk;
    let m = p.sq * group;
    let blocking = Blocking::new(p);
    let splits = split_count(p, blocking);
    let mut units = Vec::new();
    for b in 0..p.batch {
        let seq = p.sequence(b);
        let vis = Visibility::new(seq.sq, seq.sk, p.causal, p.window);
        for g0 in (0..p.hk).step_by(blocking.heads_per_unit) {
            let heads = g0..(g0 + blocking.heads_per_unit).min(p.hk);
            for r0 in (0..m).step_by(blocking.rows_per_unit) {
                let rows = r0..(r0 + blocking.rows_per_unit).min(m);
                let keys = vis.key_range(rows.start / group..(rows.end - 1) / group + 1);
                for split in 0..splits {
                    let range = split_range(seq.sk, split, splits);
                    let lo = range.start.max(keys.start);
                    let cost = rows.len() * heads.len() * range.end.min(keys.end).saturating_sub(lo);
                    units.push(Unit { b, heads: heads.clone(), rows: rows.clone(), split, splits, cost });
                }
            }
        }
    }
    units.sort_by_key(|u| std::cmp::Reverse(u.cost));

    // Partial outputs of split units: `[b, hk, split, m, dv]` and `[b, hk, split, m]`.
    let partial_len = if splits > 1 { p.batch * p.hk * splits * m } else { 0 };
    let mut part_o = try_vec("split outputs", partial_len * p.dv, 0.0f32)?;
    let mut part_lse = try_vec("split lse", partial_len, 0.0f32)?;
    {
        let out_sink = Sink::new(out);
        let lse_sink = Sink::new(lse);
        let po_sink = Sink::new(&mut part_o);
        let pl_sink = Sink::new(&mut part_lse);
        let target = Target { out: &out_sink, lse: &lse_sink, part_o: &po_sink, part_lse: &pl_sink, splits };
        for_each_dynamic(
            &units,
            || Scratch::new(p.d, p.dv, blocking.heads_per_unit, blocking.rows_per_unit),
            |sc, u| unit(p, isa, q, k_cache, v_cache, &target, sc, u),
        );
    }
    if splits > 1 {
        merge(p, &part_o, &part_lse, splits, out, lse);
    }
    Ok(())
}

/// Where units write: the final outputs (one split) or the partials.
struct Target<'s, T> {
    out: &'s Sink<T>,
    lse: &'s Sink<f32>,
    part_o: &'s Sink<f32>,
    part_lse: &'s Sink<f32>,
    splits: usize,
}

/// Whether the direct kernels can run: AVX-512 with BW, and few rows per head.
fn direct_kernels(isa: Isa, rows: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if isa.avx512()
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
    {
        return rows <= DIRECT_ROWS;
    }
    let _ = (isa, rows);
    false
}

/// One unit: on the direct kernels where they apply; if that leaves a non-finite output (NaN or
/// infinite inputs, where `0 · inf` from a masked key must not reach a row), again on the gather
/// path, whose products skip masked keys.
#[allow(clippy::too_many_arguments)]
fn unit<T: Element>(
    p: &KvProblem<'_, T>,
    isa: Isa,
    q: &[T],
    k_cache: &[T],
    v_cache: &[T],
    target: &Target<'_, T>,
    sc: &mut Scratch,
    u: &Unit,
) {
    if direct_kernels(isa, u.rows.len()) {
        unit_pass(p, isa, true, q, k_cache, v_cache, sc, u);
        let n = u.heads.len() * u.rows.len() * p.dv;
        if finite_f32(&sc.o[..n]) {
            return finish(p, target, sc, u);
        }
    }
    unit_pass(p, isa, false, q, k_cache, v_cache, sc, u);
    finish(p, target, sc, u)
}

/// Accumulates the unit's unnormalised outputs and softmax state in `sc`.
#[allow(clippy::too_many_arguments)]
fn unit_pass<T: Element>(
    p: &KvProblem<'_, T>,
    isa: Isa,
    direct: bool,
    q: &[T],
    k_cache: &[T],
    v_cache: &[T],
    sc: &mut Scratch,
    u: &Unit,
) {
    let (d, dv) = (p.d, p.dv);
    let group = p.hq / p.hk;
    let n = u.rows.len();
    let seq = p.sequence(u.b);
    let kvs = p.seqs[u.b];
    let vis = Visibility::new(seq.sq, seq.sk, p.causal, p.window);
    let q_mult = match p.softcap {
        Some(c) => p.scale / c,
        None => p.scale,
    };
    let token = |r: usize| r / group;
    let head = |kv: usize, r: usize| kv * group + r % group;

    // bf16 keys on AVX-512 BF16: the scores multiply pairs of bf16 directly.
    let bf16_scores = direct && Elem::of::<T>() == Elem::Bf16 && isa.bf16_pairs();
    // Q rows of each head, rotated (and rounded to the dtype, as the GPU keeps them) and scaled.
    for (hi, kv) in u.heads.clone().enumerate() {
        for (lr, r) in u.rows.clone().enumerate() {
            let (i, h) = (token(r), head(kv, r));
            let at = u.b * p.q.batch_stride + i * p.q.token_stride + h * p.q.head_stride;
            let dst = &mut sc.q[(hi * n + lr) * d..(hi * n + lr + 1) * d];
            T::widen_slice(&q[at..at + d], dst);
            if let Some(rot) = &p.rotary {
                rot.rotate(dst, p.q_position(&kvs, i));
                dst.iter_mut().for_each(|x| *x = T::from_f32(*x).to_f32());
            }
            if bf16_scores {
                for (w, &x) in sc.qbits[(hi * n + lr) * d..(hi * n + lr + 1) * d].iter_mut().zip(dst.iter()) {
                    // Exact: `x` is a bf16 value widened (rounded to the dtype above if rotated).
                    *w = (x.to_bits() >> 16) as u16;
                }
            }
            dst.iter_mut().for_each(|x| *x *= q_mult);
        }
        sc.softmax[hi].reset(n);
    }
    sc.o[..u.heads.len() * n * dv].fill(0.0);

    let keys = {
        let vis_keys = vis.key_range(token(u.rows.start)..token(u.rows.end - 1) + 1);
        let split = split_range(seq.sk, u.split, u.splits);
        let lo = vis_keys.start.max(split.start);
        lo..vis_keys.end.min(split.end).max(lo)
    };
    // The unit's heads of one token are contiguous in the cache (unit head stride): one run.
    // The direct kernels (x86-64 only) read a token's values of the unit's heads as one run.
    #[cfg(target_arch = "x86_64")]
    let (v_run, size) = ((u.heads.len() - 1) * p.v_strides[2] + dv, std::mem::size_of::<T>());
    let prefetch_head = |c0: usize, kv: usize| {
        for j in c0..(c0 + BC).min(keys.end) {
            prefetch_row(&k_cache[p.k_offset(u.b, j, kv)..][..d]);
            prefetch_row(&v_cache[p.v_offset(u.b, j, kv)..][..dv]);
        }
    };
    for c0 in keys.clone().step_by(BC) {
        let nc = BC.min(keys.end - c0);
        if direct {
            // All heads' scores of the chunk, reading the keys in address order (a token's heads
            // are one run) and asking for each token's values on the way.
            for (c, (kp, vp)) in sc.ptrs[..nc].iter_mut().zip(&mut sc.vptrs[..nc]).enumerate() {
                *kp = k_cache[p.k_offset(u.b, c0 + c, u.heads.start)..].as_ptr().cast();
                *vp = v_cache[p.v_offset(u.b, c0 + c, u.heads.start)..].as_ptr().cast();
            }
            let ldt = u.heads.len() * n;
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `direct` implies AVX-512F, BW and VL (`direct_kernels`), and BF16 where
            // `bf16_scores`; n ≤ DIRECT_ROWS; `sc.q` / `sc.qbits` hold heads × n rows of d
            // elements and `sc.st` BC rows of stride ldt; each key pointer starts the run of the
            // unit's heads of one token (a head's row at `h · head stride` from it, d elements,
            // inside `k_cache` by the validated offsets), and each value pointer starts that
            // token's run of `v_run` elements in `v_cache`.
            unsafe {
                let args = x86::Scores {
                    elem: Elem::of::<T>(),
                    q: &sc.q,
                    q_bits: if bf16_scores { &sc.qbits } else { &[] },
                    q_mult,
                    rows: n,
                    heads: u.heads.len(),
                    d,
                    keys: &sc.ptrs[..nc],
                    head_bytes: p.k_strides[2] * size,
                    values: &sc.vptrs[..nc],
                    value_bytes: v_run * size,
                };
                x86::scores(&args, &mut sc.st, ldt);
            }

            // Row-major scores for the masks and the softmax.
            transpose(isa, &mut sc.s, BC, &sc.st, ldt, nc, ldt);
        }
        for (hi, kv) in u.heads.clone().enumerate() {
            let (qh, oh) = (&sc.q[hi * n * d..(hi + 1) * n * d], &mut sc.o[hi * n * dv..(hi + 1) * n * dv]);
            let sh = &mut sc.s[hi * n * BC..(hi + 1) * n * BC];
            if !direct {
                // The next chunk's rows of this head may be scattered (pages): ask for them now,
                // so their misses overlap this chunk's work instead of stalling the loads.
                prefetch_head(c0 + BC, kv);
                // Gather and widen the chunk's keys, then Kᵀ for the product.
                for c in 0..nc {
                    let at = p.k_offset(u.b, c0 + c, kv);
                    load_row(isa, &k_cache[at..at + d], &mut sc.k[c * d..(c + 1) * d]);
                }
                transpose(isa, &mut sc.kt, BC, &sc.k, d, nc, d);
                gemm(isa, sh, BC, qh, d, &sc.kt, BC, (n, nc, d), false);
            }
            for (lr, r) in u.rows.clone().enumerate() {
                let i = token(r);
                let row = &mut sh[lr * BC..lr * BC + nc];
                if let Some(cap) = p.softcap {
                    row.iter_mut().for_each(|x| *x = cap * x.tanh());
                }
                if let Some(slope) = p.alibi_slope(u.b, head(kv, r)) {
                    let off = seq.offset();
                    for (x, j) in row.iter_mut().zip(c0..) {
                        *x -= slope * (i as i64 + off - j as i64).unsigned_abs() as f32;
                    }
                }
                let span = vis.span(i);
                let lo = span.start.clamp(c0, c0 + nc) - c0;
                let hi = (span.end.clamp(c0, c0 + nc) - c0).max(lo);
                row[..lo].fill(f32::NEG_INFINITY);
                row[hi..].fill(f32::NEG_INFINITY);
            }
            if bf16_scores {
                // Probabilities rounded to bf16 pairs (as FlashAttention-2 rounds P before its
                // second product), two keys per instruction.
                sc.softmax[hi].update(isa, sh, BC, nc, oh, dv, 1.0, Some((&mut sc.pp, BC / 2)));
                for (c, ptr) in sc.ptrs[..nc].iter_mut().enumerate() {
                    *ptr = v_cache[p.v_offset(u.b, c0 + c, kv)..].as_ptr().cast();
                }
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX-512F, BW, VL and BF16 (`bf16_scores`), n ≤ DIRECT_ROWS, `sc.pp`
                // holds the n probability rows as pairs (stride BC / 2 words), `oh` n rows of dv
                // floats, and every value pointer starts a row of dv bf16 inside `v_cache`.
                unsafe {
                    x86::accumulate_bf16(&sc.pp, BC / 2, n, dv, &sc.ptrs[..nc], oh)
                };
                continue;
            }
            sc.softmax[hi].update(isa, sh, BC, nc, oh, dv, 1.0, None);
            if direct {
                for (c, ptr) in sc.ptrs[..nc].iter_mut().enumerate() {
                    *ptr = v_cache[p.v_offset(u.b, c0 + c, kv)..].as_ptr().cast();
                }
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX-512F, BW and VL, n ≤ DIRECT_ROWS, `sh` holds the n probability rows
                // (stride BC), `oh` n rows of dv floats, and every value pointer starts a row of
                // dv elements inside `v_cache`.
                unsafe {
                    x86::accumulate(Elem::of::<T>(), sh, BC, n, dv, &sc.ptrs[..nc], oh)
                };
                continue;
            }
            let mut finite = true;
            for c in 0..nc {
                let at = p.v_offset(u.b, c0 + c, kv);
                let dst = &mut sc.v[c * dv..(c + 1) * dv];
                finite &= load_row(isa, &v_cache[at..at + dv], dst);
            }
            if finite {
                gemm(isa, oh, dv, sh, BC, &sc.v, dv, (n, dv, nc), true);
            } else {
                // Masked probabilities are exact zeros: 0 · inf must not reach rows that cannot
                // see it.
                gemm_acc_skipping_zeros(oh, dv, sh, BC, &sc.v, BLayout::rows(dv), (n, dv, nc));
            }
        }
    }
}

/// Normalises the unit's outputs and writes them (one split) or its partials.
fn finish<T: Element>(p: &KvProblem<'_, T>, target: &Target<'_, T>, sc: &mut Scratch, u: &Unit) {
    let (group, n, dv) = (p.hq / p.hk, u.rows.len(), p.dv);
    for (hi, kv) in u.heads.clone().enumerate() {
        for (lr, r) in u.rows.clone().enumerate() {
            let (i, h) = (r / group, kv * group + r % group);
            let o = &mut sc.o[(hi * n + lr) * dv..(hi * n + lr + 1) * dv];
            let l = match sc.softmax[hi].finish(lr) {
                Some((inv, l)) => {
                    o.iter_mut().for_each(|x| *x *= inv);
                    l
                }
                None => {
                    o.fill(0.0);
                    f32::NEG_INFINITY
                }
            };
            if target.splits == 1 {
                let at = u.b * p.out.batch_stride + i * p.out.token_stride + h * p.out.head_stride;
                // SAFETY: each (sequence, token, head) row of `out` and its `lse` entry belong to
                // exactly one unit (one kv head, one row block, one split), and the output view
                // was checked to be in bounds with no overlapping elements.
                unsafe {
                    T::narrow_slice(o, target.out.slice_mut(at, dv));
                    target.lse.write((u.b * p.hq + h) * p.sq + i, l);
                }
            } else {
                let at = ((u.b * p.hk + kv) * target.splits + u.split) * (p.sq * group) + r;
                // SAFETY: the partial buffers hold one row per (sequence, kv head, split, packed
                // row), written by exactly one unit; `at` is below their length by construction.
                unsafe {
                    target.part_o.slice_mut(at * dv, dv).copy_from_slice(o);
                    target.part_lse.write(at, l);
                }
            }
        }
    }
}

/// Merges the splits' partial outputs by their log-sum-exp, in split order.
fn merge<T: Element>(
    p: &KvProblem<'_, T>,
    part_o: &[f32],
    part_lse: &[f32],
    splits: usize,
    out: &mut [T],
    lse: &mut [f32],
) {
    let group = p.hq / p.hk;
    let m = p.sq * group;
    let mut acc = vec![0.0f32; p.dv];
    // Each row's split weights, reused across rows.
    let mut ws = vec![0.0f32; splits];
    for b in 0..p.batch {
        for kv in 0..p.hk {
            for r in 0..m {
                let (i, h) = (r / group, kv * group + r % group);
                let idx = |s: usize| ((b * p.hk + kv) * splits + s) * m + r;
                let ls = (0..splits).map(|s| part_lse[idx(s)]);
                let part = |s: usize| &part_o[idx(s) * p.dv..(idx(s) + 1) * p.dv];
                let total = merge_row(ls, part, &mut ws, &mut acc);
                let at = b * p.out.batch_stride + i * p.out.token_stride + h * p.out.head_stride;
                T::narrow_slice(&acc, &mut out[at..at + p.dv]);
                lse[(b * p.hq + h) * p.sq + i] = total;
            }
        }
    }
}

/// The element layouts the direct kernels read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elem {
    F32,
    F16,
    Bf16,
}

impl Elem {
    fn of<T: Element>() -> Self {
        match T::DTYPE {
            crate::DType::F32 => Elem::F32,
            crate::DType::F16 => Elem::F16,
            crate::DType::BF16 => Elem::Bf16,
        }
    }
}

/// Most packed rows per head the direct kernels take (their accumulators live in registers).
#[cfg(target_arch = "x86_64")]
const DIRECT_ROWS: usize = 16;

/// AVX-512 kernels that read key and value rows straight from the cache (no gather, no
/// transpose): for decoding, where each head has a few query rows and every cache byte is used
/// once, so the work is reading memory and the kernels must keep up with it.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Elem;

    /// Tokens ahead whose keys the score kernel asks for.
    const KEY_AHEAD: usize = 8;

    /// 16 elements of a row from `p` (the first `mask` lanes), widened to `f32`.
    ///
    /// # Safety
    /// AVX-512F, BW and VL available; the masked lanes of `p` readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16(e: Elem, p: *const u8, mask: __mmask16) -> __m512 {
        // SAFETY: masked loads touch only the selected lanes, which the caller made readable.
        unsafe {
            match e {
                Elem::F32 => _mm512_maskz_loadu_ps(mask, p.cast()),
                Elem::Bf16 => {
                    let h = _mm256_maskz_loadu_epi16(mask, p.cast());
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
                }
                Elem::F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p.cast())),
            }
        }
    }

    /// `out[i] = Σ v[i]` for 16 vectors: a transposing reduction (45 instructions where 16
    /// horizontal sums take about 150).
    ///
    /// # Safety
    /// AVX-512F available.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn reduce16(v: &[__m512; 16]) -> __m512 {
        // Within each 128-bit lane: pairs, then quadruples of vectors.
        let mut t = [_mm512_setzero_ps(); 8];
        for (k, tk) in t.iter_mut().enumerate() {
            let (a, b) = (v[2 * k], v[2 * k + 1]);
            *tk = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        }
        let mut u = [_mm512_setzero_ps(); 4];
        for (k, uk) in u.iter_mut().enumerate() {
            let (a, b) = (_mm512_castps_pd(t[2 * k]), _mm512_castps_pd(t[2 * k + 1]));
            *uk = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
        }
        // Across the four 128-bit lanes.
        let w0 = _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(u[0], u[1]), _mm512_shuffle_f32x4::<0xDD>(u[0], u[1]));
        let w1 = _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(u[2], u[3]), _mm512_shuffle_f32x4::<0xDD>(u[2], u[3]));
        _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(w0, w1), _mm512_shuffle_f32x4::<0xDD>(w0, w1))
    }

    /// The inputs of [`scores`].
    pub struct Scores<'a> {
        /// The element type of the keys.
        pub elem: Elem,
        /// Query rows, `heads × rows` of `d` floats, already multiplied by `q_mult` (`f32`
        /// products).
        pub q: &'a [f32],
        /// The same rows' `bf16` bits, unscaled (`bf16` products); empty otherwise.
        pub q_bits: &'a [u16],
        /// Multiplies the `bf16` products.
        pub q_mult: f32,
        pub rows: usize,
        pub heads: usize,
        pub d: usize,
        /// Per token, the start of its run of the unit's heads; head `h` at `h · head_bytes`.
        pub keys: &'a [*const u8],
        pub head_bytes: usize,
        /// Per token, the start of its run of values (`value_bytes`), asked for on the way.
        pub values: &'a [*const u8],
        pub value_bytes: usize,
    }

    /// Scores of every (head, row) and token of a chunk, token-major: `st[c · ldt + h · rows +
    /// r] = q_{h,r} · k_{c,h}`, reading each token's keys in address order.
    ///
    /// # Safety
    /// AVX-512F, BW and VL available (and BF16 when `q_bits` is given); `rows ≤ 8`; `q` (or
    /// `q_bits`) holds `heads · rows · d` elements; each key pointer has `heads` rows of `d`
    /// elements at `head_bytes` from each other, each value pointer `value_bytes` readable bytes;
    /// `st` holds `keys.len()` rows of stride `ldt ≥ heads · rows`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn scores(a: &Scores<'_>, st: &mut [f32], ldt: usize) {
        let bf16 = !a.q_bits.is_empty();
        macro_rules! go {
            ($r:literal, $g:literal) => {
                if bf16 {
                    match a.d {
                        // The usual head dims, unrolled: no lane masks, loop bounds known.
                        64 => scores_bf16::<$r, $g, 64>(a, st, ldt),
                        128 => scores_bf16::<$r, $g, 128>(a, st, ldt),
                        _ => scores_bf16::<$r, $g, 0>(a, st, ldt),
                    }
                } else {
                    scores_f32::<$r, $g>(a, st, ldt)
                }
            };
        }
        // SAFETY: forwarded; `G · R ≤ 16` in every arm.
        unsafe {
            match a.rows {
                1 => go!(1, 16),
                2 => go!(2, 8),
                3 => go!(3, 5),
                4 => go!(4, 4),
                5 => go!(5, 3),
                6 => go!(6, 2),
                7 => go!(7, 2),
                8 => go!(8, 2),
                9 => go!(9, 1),
                10 => go!(10, 1),
                11 => go!(11, 1),
                12 => go!(12, 1),
                13 => go!(13, 1),
                14 => go!(14, 1),
                15 => go!(15, 1),
                _ => go!(16, 1),
            }
        }
    }

    /// Asks for token `c`'s values and token `c + KEY_AHEAD`'s keys.
    ///
    /// # Safety
    /// AVX-512F available; `c < a.values.len()`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn prefetch(a: &Scores<'_>, c: usize) {
        // Prefetches are hints that never fault, whatever the address.
        let vp = a.values[c];
        for off in (0..a.value_bytes).step_by(64) {
            _mm_prefetch::<_MM_HINT_T1>(vp.wrapping_add(off).cast());
        }
        if let Some(&next) = a.keys.get(c + KEY_AHEAD) {
            for off in (0..a.heads * a.head_bytes).step_by(64) {
                _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(off).cast());
            }
        }
    }

    /// [`scores`] with `f32` products, `R` rows a head, `G` heads a reduction.
    ///
    /// # Safety
    /// As [`scores`], with `rows = R` and `G · R ≤ 16`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn scores_f32<const R: usize, const G: usize>(a: &Scores<'_>, st: &mut [f32], ldt: usize) {
        let size = if a.elem == Elem::F32 { 4 } else { 2 };
        // SAFETY (whole body): the bounds are the caller's contract; lane masks limit the tail.
        unsafe {
            for (c, &kp) in a.keys.iter().enumerate() {
                prefetch(a, c);
                for h0 in (0..a.heads).step_by(G) {
                    let mut acc = [_mm512_setzero_ps(); 16];
                    for g in 0..G {
                        let h = h0 + g;
                        if h >= a.heads {
                            break;
                        }
                        let (kh, qh) = (kp.add(h * a.head_bytes), a.q.as_ptr().add(h * R * a.d));
                        let mut x = 0;
                        while x < a.d {
                            let w = (a.d - x).min(16);
                            let mask: __mmask16 = if w == 16 { 0xFFFF } else { ((1u32 << w) - 1) as u16 };
                            let kb = load16(a.elem, kh.add(x * size), mask);
                            for r in 0..R {
                                let qb = _mm512_maskz_loadu_ps(mask, qh.add(r * a.d + x));
                                acc[g * R + r] = _mm512_fmadd_ps(qb, kb, acc[g * R + r]);
                            }
                            x += 16;
                        }
                    }
                    let lanes = (a.heads - h0).min(G) * R;
                    let out = st.as_mut_ptr().add(c * ldt + h0 * R);
                    _mm512_mask_storeu_ps(out, ((1u32 << lanes) - 1) as u16, reduce16(&acc));
                }
            }
        }
    }

    /// [`scores`] with `bf16` pair products (`vdpbf16ps`: each pair's products exact, added in
    /// `f32`), `R` rows a head, `G` heads a reduction.
    ///
    /// # Safety
    /// As [`scores`], with `rows = R`, `G · R ≤ 16` and AVX-512 BF16 available.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn scores_bf16<const R: usize, const G: usize, const D: usize>(a: &Scores<'_>, st: &mut [f32], ldt: usize) {
        let mult = _mm512_set1_ps(a.q_mult);
        // D > 0: the head dim, a compile-time multiple of 32 (`a.d == D`); 0: run time.
        let d = if D > 0 { D } else { a.d };
        // SAFETY (whole body): the bounds are the caller's contract; lane masks limit the tail
        // (both operands zero past `d`, so padded pairs add nothing); `__m512i` and `__m512bh`
        // are both 512 bits of plain data.
        unsafe {
            for (c, &kp) in a.keys.iter().enumerate() {
                prefetch(a, c);
                for h0 in (0..a.heads).step_by(G) {
                    let mut acc = [_mm512_setzero_ps(); 16];
                    for g in 0..G {
                        let h = h0 + g;
                        if h >= a.heads {
                            break;
                        }
                        let (kh, qh) = (kp.add(h * a.head_bytes), a.q_bits.as_ptr().add(h * R * d));
                        let mut x = 0;
                        while x < d {
                            let w = (d - x).min(32);
                            let mask: __mmask32 = if D > 0 || w == 32 { u32::MAX } else { (1u32 << w) - 1 };
                            let kb: __m512bh = if D > 0 {
                                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(kh.add(2 * x).cast()))
                            } else {
                                std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(
                                    mask,
                                    kh.add(2 * x).cast(),
                                ))
                            };
                            for r in 0..R {
                                let qp = qh.add(r * d + x);
                                let qb: __m512bh = if D > 0 {
                                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(qp.cast()))
                                } else {
                                    std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(mask, qp.cast()))
                                };
                                acc[g * R + r] = _mm512_dpbf16_ps(acc[g * R + r], qb, kb);
                            }
                            x += 32;
                        }
                    }
                    let lanes = (a.heads - h0).min(G) * R;
                    let out = st.as_mut_ptr().add(c * ldt + h0 * R);
                    _mm512_mask_storeu_ps(out, ((1u32 << lanes) - 1) as u16, _mm512_mul_ps(reduce16(&acc), mult));
                }
            }
        }
    }

    /// `o[r · dv ..] += Σ_c p[r · ld + c] · v_c` for the `n ≤ 8` rows and the values at byte
    /// pointers `values` (`dv` elements each).
    ///
    /// # Safety
    /// AVX-512F, BW and VL available; `o` holds `n · dv` floats, `p` `(n - 1) · ld +
    /// values.len()`; every value pointer has `dv` readable elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn accumulate(e: Elem, p: &[f32], ld: usize, n: usize, dv: usize, values: &[*const u8], o: &mut [f32]) {
        // SAFETY: forwarded.
        unsafe {
            match n {
                1 => accumulate_r::<1, 2>(e, p, ld, dv, values, o),
                2 => accumulate_r::<2, 2>(e, p, ld, dv, values, o),
                3 => accumulate_r::<3, 2>(e, p, ld, dv, values, o),
                4 => accumulate_r::<4, 2>(e, p, ld, dv, values, o),
                5 => accumulate_r::<5, 2>(e, p, ld, dv, values, o),
                6 => accumulate_r::<6, 2>(e, p, ld, dv, values, o),
                7 => accumulate_r::<7, 2>(e, p, ld, dv, values, o),
                8 => accumulate_r::<8, 2>(e, p, ld, dv, values, o),
                9 => accumulate_r::<9, 1>(e, p, ld, dv, values, o),
                10 => accumulate_r::<10, 1>(e, p, ld, dv, values, o),
                11 => accumulate_r::<11, 1>(e, p, ld, dv, values, o),
                12 => accumulate_r::<12, 1>(e, p, ld, dv, values, o),
                13 => accumulate_r::<13, 1>(e, p, ld, dv, values, o),
                14 => accumulate_r::<14, 1>(e, p, ld, dv, values, o),
                15 => accumulate_r::<15, 1>(e, p, ld, dv, values, o),
                _ => accumulate_r::<16, 1>(e, p, ld, dv, values, o),
            }
        }
    }

    /// [`accumulate`] for `R` rows, 32 columns a pass (two independent chains a row, so the
    /// multiply-adds do not wait on each other).
    ///
    /// # Safety
    /// As [`accumulate`] with `n = R`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn accumulate_r<const R: usize, const C: usize>(
        e: Elem,
        p: &[f32],
        ld: usize,
        dv: usize,
        values: &[*const u8],
        o: &mut [f32],
    ) {
        let size = if e == Elem::F32 { 4 } else { 2 };
        let lane_mask = |x: usize| -> __mmask16 {
            let w = dv.saturating_sub(x).min(16);
            if w == 16 {
                0xFFFF
            } else {
                ((1u32 << w) - 1) as u16
            }
        };
        // SAFETY (whole body): the bounds are the caller's contract; lane masks limit the tail
        // (a zero mask touches nothing).
        unsafe {
            let mut x = 0;
            while x < dv {
                let masks: [__mmask16; C] = std::array::from_fn(|k| lane_mask(x + 16 * k));
                let mut acc = [[_mm512_setzero_ps(); C]; R];
                for (r, a) in acc.iter_mut().enumerate() {
                    let row = o.as_mut_ptr().add(r * dv + x);
                    for k in 0..C {
                        a[k] = _mm512_maskz_loadu_ps(masks[k], row.wrapping_add(16 * k));
                    }
                }
                for (c, &vp) in values.iter().enumerate() {
                    let v: [__m512; C] =
                        std::array::from_fn(|k| load16(e, vp.wrapping_add((x + 16 * k) * size), masks[k]));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let pr = _mm512_set1_ps(*p.get_unchecked(r * ld + c));
                        for k in 0..C {
                            a[k] = _mm512_fmadd_ps(pr, v[k], a[k]);
                        }
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    let row = o.as_mut_ptr().add(r * dv + x);
                    for k in 0..C {
                        _mm512_mask_storeu_ps(row.wrapping_add(16 * k), masks[k], a[k]);
                    }
                }
                x += 16 * C;
            }
        }
    }

    /// `o[r · dv ..] += Σ_c P[r][c] · v_c` on AVX-512 BF16 for `bf16` values: `pp` holds each
    /// row's probabilities as `bf16` pairs along the keys (row stride `ldp` words; an odd count
    /// padded with zero), and each instruction adds two keys' products for 16 columns.
    ///
    /// # Safety
    /// AVX-512F, BW, VL and BF16 available; `n ≤ 8`; `o` holds `n · dv` floats, `pp` `(n - 1) ·
    /// ldp + values.len().div_ceil(2)` words; every value pointer has `dv` readable `bf16`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub unsafe fn accumulate_bf16(pp: &[u32], ldp: usize, n: usize, dv: usize, values: &[*const u8], o: &mut [f32]) {
        macro_rules! go {
            ($r:literal, $c:literal) => {
                accumulate_bf16_r::<$r, $c>(pp, ldp, dv, values, o)
            };
        }
        // SAFETY: forwarded.
        unsafe {
            match n {
                1 => go!(1, 2),
                2 => go!(2, 2),
                3 => go!(3, 2),
                4 => go!(4, 2),
                5 => go!(5, 2),
                6 => go!(6, 2),
                7 => go!(7, 2),
                8 => go!(8, 2),
                9 => go!(9, 1),
                10 => go!(10, 1),
                11 => go!(11, 1),
                12 => go!(12, 1),
                13 => go!(13, 1),
                14 => go!(14, 1),
                15 => go!(15, 1),
                _ => go!(16, 1),
            }
        }
    }

    /// [`accumulate_bf16`] for `R` rows, 32 columns a pass.
    ///
    /// # Safety
    /// As [`accumulate_bf16`] with `n = R`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn accumulate_bf16_r<const R: usize, const C: usize>(
        pp: &[u32],
        ldp: usize,
        dv: usize,
        values: &[*const u8],
        o: &mut [f32],
    ) {
        let lane_mask = |x: usize| -> __mmask16 {
            let w = dv.saturating_sub(x).min(16);
            if w == 16 {
                0xFFFF
            } else {
                ((1u32 << w) - 1) as u16
            }
        };
        // Interleaves two rows' 16 elements: word i of the result is (a[i], b[i]).
        let idx: [i16; 32] = std::array::from_fn(|j| (j / 2 + if j % 2 == 1 { 32 } else { 0 }) as i16);
        // SAFETY (whole body): the bounds are the caller's contract; lane masks limit the tail
        // (a zero mask touches nothing); `__m512i` and `__m512bh` are both 512 bits of plain
        // data.
        unsafe {
            let idx = _mm512_loadu_si512(idx.as_ptr().cast());
            let nc = values.len();
            let mut x = 0;
            while x < dv {
                let masks: [__mmask16; C] = std::array::from_fn(|k| lane_mask(x + 16 * k));
                let mut acc = [[_mm512_setzero_ps(); C]; R];
                for (r, a) in acc.iter_mut().enumerate() {
                    let row = o.as_mut_ptr().add(r * dv + x);
                    for k in 0..C {
                        a[k] = _mm512_maskz_loadu_ps(masks[k], row.wrapping_add(16 * k));
                    }
                }
                let mut c = 0;
                while c < nc {
                    let (va, vb) = (values[c].cast::<u16>(), values.get(c + 1).map(|p| p.cast::<u16>()));
                    let load = |p: Option<*const u16>, off: usize, m: __mmask16| match p {
                        Some(p) => _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(m, p.wrapping_add(off).cast())),
                        None => _mm512_setzero_si512(),
                    };
                    let v: [__m512bh; C] = std::array::from_fn(|k| {
                        let off = x + 16 * k;
                        std::mem::transmute(_mm512_permutex2var_epi16(
                            load(Some(va), off, masks[k]),
                            idx,
                            load(vb, off, masks[k]),
                        ))
                    });
                    for (r, a) in acc.iter_mut().enumerate() {
                        let pr: __m512bh =
                            std::mem::transmute(_mm512_set1_epi32(*pp.get_unchecked(r * ldp + c / 2) as i32));
                        for k in 0..C {
                            a[k] = _mm512_dpbf16_ps(a[k], pr, v[k]);
                        }
                    }
                    c += 2;
                }
                for (r, a) in acc.iter().enumerate() {
                    let row = o.as_mut_ptr().add(r * dv + x);
                    for k in 0..C {
                        _mm512_mask_storeu_ps(row.wrapping_add(16 * k), masks[k], a[k]);
                    }
                }
                x += 16 * C;
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn reduce16_sums_each_vector_into_its_lane() {
            if !std::arch::is_x86_feature_detected!("avx512f") {
                return;
            }
            let vals: Vec<f32> = (0..256).map(|i| ((i * 37 % 101) as f32) - 50.0).collect();
            // SAFETY: AVX-512F checked above; loads read 16 floats of `vals` each.
            let got = unsafe {
                let mut v = [_mm512_setzero_ps(); 16];
                for (i, vi) in v.iter_mut().enumerate() {
                    *vi = _mm512_loadu_ps(vals.as_ptr().add(16 * i));
                }
                let mut out = [0.0f32; 16];
                _mm512_storeu_ps(out.as_mut_ptr(), reduce16(&v));
                out
            };
            for (i, g) in got.iter().enumerate() {
                let want: f32 = vals[16 * i..16 * i + 16].iter().sum();
                assert_eq!(*g, want, "lane {i}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_the_keys_in_whole_chunks() {
        for sk in [0, 1, 63, 64, 65, 1000, 4096] {
            for n in 1..9 {
                let mut next = 0;
                for s in 0..n {
                    let r = split_range(sk, s, n);
                    assert_eq!(r.start, next, "sk {sk} n {n} s {s}");
                    assert!(r.start.is_multiple_of(BC) || r.is_empty());
                    next = r.end.max(next);
                }
                assert_eq!(next, sk);
            }
        }
    }
}
