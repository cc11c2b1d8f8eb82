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

use super::gemm::{gemm, gemm_acc_skipping_zeros};
use super::isa::Isa;
use super::softmax::OnlineSoftmax;
use super::transpose::transpose;
use super::{for_each_dynamic, Sink};
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

/// One unit of work.
#[derive(Debug, Clone)]
struct Unit {
    b: usize,
    kv: usize,
    /// Packed rows.
    rows: Range<usize>,
    split: usize,
    /// Visible (row, key) pairs, for the schedule.
    cost: usize,
}

/// Per-thread buffers.
struct Scratch {
    q: Vec<f32>,
    k: Vec<f32>,
    kt: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
    o: Vec<f32>,
    softmax: OnlineSoftmax,
}

impl Scratch {
    fn new(d: usize, dv: usize) -> Self {
        Self {
            q: vec![0.0; MR * d],
            k: vec![0.0; BC * d],
            kt: vec![0.0; d * BC],
            v: vec![0.0; BC * dv],
            s: vec![0.0; MR * BC],
            o: vec![0.0; MR * dv],
            softmax: OnlineSoftmax::default(),
        }
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
fn split_count<T: Element>(p: &KvProblem<'_, T>) -> usize {
    let max_sk = p.seqs.iter().map(|s| s.sk).max().unwrap_or(0);
    let chunks = max_sk.div_ceil(BC).max(1);
    let row_blocks = (p.sq * (p.hq / p.hk)).div_ceil(MR);
    let n = match p.num_splits {
        0 => splits_heuristic(p.batch * p.hk * row_blocks, max_sk),
        n => n,
    };
    n.min(chunks)
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
    let splits = split_count(p);
    let mut units = Vec::new();
    for b in 0..p.batch {
        let seq = p.sequence(b);
        let vis = Visibility::new(seq.sq, seq.sk, p.causal, p.window);
        for kv in 0..p.hk {
            for r0 in (0..m).step_by(MR) {
                let rows = r0..(r0 + MR).min(m);
                let keys = vis.key_range(rows.start / group..(rows.end - 1) / group + 1);
                for split in 0..splits {
                    let range = split_range(seq.sk, split, splits);
                    let cost =
                        rows.len() * range.start.max(keys.start).abs_diff(range.end.min(keys.end).max(keys.start));
                    units.push(Unit { b, kv, rows: rows.clone(), split, cost });
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
        for_each_dynamic(&units, || Scratch::new(p.d, p.dv), |sc, u| unit(p, isa, q, k_cache, v_cache, &target, sc, u));
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
    let head = |r: usize| u.kv * group + r % group;

    // Q rows, rotated (and rounded to the dtype, as the GPU keeps them) and scaled.
    for (lr, r) in u.rows.clone().enumerate() {
        let (i, h) = (token(r), head(r));
        let at = u.b * p.q.batch_stride + i * p.q.token_stride + h * p.q.head_stride;
        let dst = &mut sc.q[lr * d..(lr + 1) * d];
        T::widen_slice(&q[at..at + d], dst);
        if let Some(rot) = &p.rotary {
            rot.rotate(dst, p.q_position(&kvs, i));
            dst.iter_mut().for_each(|x| *x = T::from_f32(*x).to_f32());
        }
        dst.iter_mut().for_each(|x| *x *= q_mult);
    }

    let keys = {
        let vis_keys = vis.key_range(token(u.rows.start)..token(u.rows.end - 1) + 1);
        let split = split_range(seq.sk, u.split, target.splits);
        let lo = vis_keys.start.max(split.start);
        lo..vis_keys.end.min(split.end).max(lo)
    };
    sc.o[..n * dv].fill(0.0);
    sc.softmax.reset(n);
    for c0 in keys.clone().step_by(BC) {
        let nc = BC.min(keys.end - c0);
        // Gather and widen the chunk's keys, then Kᵀ for the product.
        for c in 0..nc {
            let at = p.k_offset(u.b, c0 + c, u.kv);
            T::widen_slice(&k_cache[at..at + d], &mut sc.k[c * d..(c + 1) * d]);
        }
        transpose(isa, &mut sc.kt, BC, &sc.k, d, nc, d);
        gemm(isa, &mut sc.s, BC, &sc.q, d, &sc.kt, BC, (n, nc, d), false);
        for (lr, r) in u.rows.clone().enumerate() {
            let i = token(r);
            let row = &mut sc.s[lr * BC..lr * BC + nc];
            if let Some(cap) = p.softcap {
                row.iter_mut().for_each(|x| *x = cap * x.tanh());
            }
            if let Some(slope) = p.alibi_slope(u.b, head(r)) {
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
        sc.softmax.update(isa, &mut sc.s, BC, nc, &mut sc.o, dv, 1.0, None);
        let mut finite = true;
        for c in 0..nc {
            let at = p.v_offset(u.b, c0 + c, u.kv);
            let dst = &mut sc.v[c * dv..(c + 1) * dv];
            T::widen_slice(&v_cache[at..at + dv], dst);
            finite &= dst.iter().all(|x| x.is_finite());
        }
        if finite {
            gemm(isa, &mut sc.o, dv, &sc.s, BC, &sc.v, dv, (n, dv, nc), true);
        } else {
            // Masked probabilities are exact zeros: 0 · inf must not reach rows that cannot see it.
            gemm_acc_skipping_zeros(&mut sc.o, dv, &sc.s, BC, &sc.v, dv, (n, dv, nc));
        }
    }

    for (lr, r) in u.rows.clone().enumerate() {
        let (i, h) = (token(r), head(r));
        let fin = sc.softmax.finish(lr);
        let o = &mut sc.o[lr * dv..(lr + 1) * dv];
        let l = match fin {
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
            // exactly one unit (one kv head, one row block, one split), and the output view was
            // checked to be in bounds with no overlapping elements.
            unsafe {
                T::narrow_slice(o, target.out.slice_mut(at, dv));
                target.lse.write((u.b * p.hq + h) * p.sq + i, l);
            }
        } else {
            let at = ((u.b * p.hk + u.kv) * target.splits + u.split) * (p.sq * group) + r;
            // SAFETY: the partial buffers hold one row per (sequence, kv head, split, packed row),
            // written by exactly one unit; `at` is below their length by construction.
            unsafe {
                target.part_o.slice_mut(at * dv, dv).copy_from_slice(o);
                target.part_lse.write(at, l);
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
    for b in 0..p.batch {
        for kv in 0..p.hk {
            for r in 0..m {
                let (i, h) = (r / group, kv * group + r % group);
                let idx = |s: usize| ((b * p.hk + kv) * splits + s) * m + r;
                let ls: Vec<f32> = (0..splits).map(|s| part_lse[idx(s)]).collect();
                let max = ls.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
                let total;
                if ls.iter().any(|x| x.is_nan()) {
                    acc.fill(f32::NAN);
                    total = f32::NAN;
                } else if max == f32::NEG_INFINITY {
                    acc.fill(0.0);
                    total = f32::NEG_INFINITY;
                } else {
                    let ws: Vec<f32> = ls.iter().map(|&l| (l - max).exp()).collect();
                    let sum: f32 = ws.iter().sum();
                    acc.fill(0.0);
                    for (s, &w) in ws.iter().enumerate() {
                        if w == 0.0 {
                            continue;
                        }
                        let w = w / sum;
                        let o = &part_o[idx(s) * p.dv..(idx(s) + 1) * p.dv];
                        acc.iter_mut().zip(o).for_each(|(a, &x)| *a += w * x);
                    }
                    total = max + sum.ln();
                }
                let at = b * p.out.batch_stride + i * p.out.token_stride + h * p.out.head_stride;
                T::narrow_slice(&acc, &mut out[at..at + p.dv]);
                lse[(b * p.hq + h) * p.sq + i] = total;
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
                    assert!(r.start % BC == 0 || r.is_empty());
                    next = r.end.max(next);
                }
                assert_eq!(next, sk);
            }
        }
    }
}
