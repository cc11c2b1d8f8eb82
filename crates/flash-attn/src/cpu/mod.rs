//! The CPU backend: tiled FlashAttention with an online softmax, parallel over
//! `(sequence, head, query tile)` on the backend's workers (`pool`; rayon's thread count).
//!
//! Layers (STYLE.md): the schedule decides who computes which tile (this file), `blocking`
//! decides the tile sizes, `forward` / `backward` are the per-tile loops of FlashAttention-2's
//! Algorithms 1 and 2, and [`gemm`] / `softmax` are the inner loops they call.

mod backward;
pub(crate) mod blocking;
pub(crate) mod decode;
mod forward;
pub mod gemm;
pub mod isa;
mod lanes;
mod lines;
mod pairs;
pub mod peak;
mod pool;
mod softmax;
mod tile;
mod transpose;
mod vexp;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "aarch64")]
mod neon;

pub use isa::Isa;

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::dtype::Element;
use crate::error::{numel, try_vec, Error, Result};
use crate::spec::{Geometry, RowLayout};
use crate::tensor::{Tensor, TensorMut};

/// Largest head dimension the CPU backend accepts.
pub const MAX_HEAD_DIM: usize = 512;

/// A shared write target for the output: every work item writes a disjoint set of elements.
pub(crate) struct Sink<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: `Sink` is only used to write disjoint elements from different threads (each query tile
// of each (sequence, head) owns its output rows and lse entries; `Geometry::check_out` rejected
// overlapping output strides), and the buffer outlives the parallel loop that uses it.
unsafe impl<T: Send> Sync for Sink<T> {}
// SAFETY: as above; the pointer is only dereferenced inside the scope that borrows the buffer.
unsafe impl<T: Send> Send for Sink<T> {}

impl<T> Sink<T> {
    fn new(buf: &mut [T]) -> Self {
        Self { ptr: buf.as_mut_ptr(), len: buf.len() }
    }

    /// The `len` elements from `start`, as a slice.
    ///
    /// # Safety
    /// `start + len <= self.len`, and no other thread touches these elements while the slice lives.
    #[inline]
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, start: usize, len: usize) -> &mut [T] {
        debug_assert!(start + len <= self.len);
        // SAFETY: in bounds and exclusively owned by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }

    /// Writes `value` at `idx`.
    ///
    /// # Safety
    /// `idx < len`, and no other thread reads or writes `idx` during the parallel loop.
    #[inline]
    pub unsafe fn write(&self, idx: usize, value: T) {
        debug_assert!(idx < self.len);
        // SAFETY: in bounds and unaliased by the caller's contract.
        unsafe { self.ptr.add(idx).write(value) }
    }
}

/// Runs `work` on every item, in order of first availability, on as many tasks as the current
/// rayon pool has threads (`RAYON_NUM_THREADS`, or a pool the caller installed), run by the
/// calling thread and the backend's own workers ([`pool::broadcast`], which stay awake a short
/// while between calls); each task builds its scratch once with `init` and reuses it for every
/// item it takes (items are claimed from a shared counter, so long items listed first finish
/// early).
///
/// (Session 45 tried the calling thread as one task of a rayon scope: 0.92-0.95x on the 128²
/// causal shapes, probably a rayon thread left spinning on a busy core. Session 47's workers,
/// caller included, replaced the scope: 1.03-1.41x on the Xeon, `docs/cpu-performance.md`.)
fn for_each_dynamic<I: Sync, S>(items: &[I], init: impl Fn() -> S + Sync, work: impl Fn(&mut S, &I) + Sync) {
    let next = AtomicUsize::new(0);
    let tasks = rayon::current_num_threads().min(items.len());
    pool::broadcast(tasks, &|_| {
        let mut scratch = init();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = items.get(i) else { break };
            work(&mut scratch, item);
        }
    });
}

/// Query rows a work item of the backward's final dQ reduction covers.
const DQ_ROWS: usize = 16;

/// One unit of forward work: query tiles `tiles` of every query head that reads kv head
/// `kv_head` of sequence `seq` (over key split `split` where the sequence is split). The heads
/// and tiles of a unit share its packed key/value tiles.
#[derive(Debug, Clone)]
struct ForwardUnit {
    seq: usize,
    kv_head: usize,
    tiles: std::ops::Range<usize>,
    split: Option<usize>,
    /// Visible (query, key) pairs by the interval rules: the unit's cost, for the schedule.
    cost: usize,
}

/// The forward pass's work units, costliest first. A (sequence, kv head) is one unit unless
/// there are too few of them to keep `threads` busy; then its query tiles are split into runs.
/// A sequence with key splits (`splits[seq]` not empty) has a unit per split as well.
/// Costliest first (causal: the units with the late query tiles) so the last units to finish
/// are short ones.
fn forward_units(
    g: &Geometry<'_>,
    br: usize,
    threads: usize,
    splits: &[(Vec<Range<usize>>, usize)],
) -> Vec<ForwardUnit> {
    let groups = g.seqs.iter().filter(|seq| seq.sq > 0).count() * g.hk;
    let parts_wanted = (4 * threads).div_ceil(groups.max(1));
    let group = g.hq / g.hk;
    let mut units = Vec::new();
    for (s, seq) in g.seqs.iter().enumerate().filter(|(_, seq)| seq.sq > 0) {
        let n_tiles = seq.sq.div_ceil(br);
        let per_part = n_tiles.div_ceil(parts_wanted.clamp(1, n_tiles));
        let ranges = &splits[s].0;
        let parts: Vec<(Option<usize>, Range<usize>)> = if ranges.is_empty() {
            vec![(None, 0..usize::MAX)]
        } else {
            ranges.iter().cloned().enumerate().map(|(i, r)| (Some(i), r)).collect()
        };
        for kv_head in 0..g.hk {
            let vis = g.visibility(seq, kv_head * group);
            for t0 in (0..n_tiles).step_by(per_part) {
                let tiles = t0..(t0 + per_part).min(n_tiles);
                for (split, keys) in &parts {
                    let cost = tiles
                        .clone()
                        .map(|t| {
                            let rows = t * br..((t + 1) * br).min(seq.sq);
                            let seen = vis.key_range(rows.clone());
                            rows.len() * (seen.start.max(keys.start)..seen.end.min(keys.end)).len()
                        })
                        .sum::<usize>()
                        * group;
                    units.push(ForwardUnit { seq: s, kv_head, tiles: tiles.clone(), split: *split, cost });
                }
            }
        }
    }
    units.sort_by_key(|u| std::cmp::Reverse(u.cost));
    units
}

/// Fewest work units of a (sequence, kv head) for its key/value tiles to be shared between them,
/// and fewest key tiles it must see ([`forward::SharedTiles`]). Measured on the Xeon (16 threads,
/// session 39, tiles packed by the units themselves), with 2 units and 1 tile instead: 1 × 8 × 128²
/// (one key tile, eight units a head: seven wait for the one that packs it) 0.67-0.73× the speed,
/// 4 × 12 × 512², d 64 (two units a head) 0.92×; with 4 and 4, 1.07-1.11× at 512²-1024², 8 heads,
/// and 1.21-1.32× with one or two heads.
const SHARE_MIN_UNITS: usize = 4;
/// See [`SHARE_MIN_UNITS`].
const SHARE_MIN_TILES: usize = 4;

/// Tallest query tile for which `f32` `V` is read in place, not packed, where every work unit is
/// one query tile of one head (each key tile's `V` is then read once by its unit: packing it
/// first only adds a copy). Measured on the Xeon (16 threads, session 44, two calls, 6 rounds
/// each), 1 × 8 heads: 128² (16-row tiles) 1.11-1.28× faster in place, d 64 and 128, causal or
/// not; 512² (64-row tiles) 1.02× in one call, 0.94× (d 128) and 0.98× (d 64) in the other; 1024²,
/// d 128 (128 rows) 0.98× and 4 × 12 × 512², d 64 (256 rows) 0.94×: a taller tile's `P·V` walks
/// `V`'s rows, a page apart in place, once per block of its rows.
const IN_PLACE_V_MAX_ROWS: usize = 16;

/// Most query rows a sequence may have for its forward to be split over its keys (taller
/// sequences share their threads by query tiles).
const SPLIT_MAX_ROWS: usize = 64;
/// Fewest keys a key split takes.
const SPLIT_KEYS: usize = 1024;
/// Most key splits of a sequence.
const MAX_SPLITS: usize = 16;

/// The key ranges a sequence's forward is split into (Flash-Decoding on the plain forward), or
/// none: a sequence of at most [`SPLIT_MAX_ROWS`] query rows gives its threads too few query tiles
/// to share, so its visible keys are cut into up to [`MAX_SPLITS`] ranges of at least
/// [`SPLIT_KEYS`] keys, whole key tiles of `bc` each; each range is its own work unit, and the
/// ranges' partial results merge by their log-sum-exp in range order ([`merge_splits`]). The
/// ranges depend on the sequence's lengths, mask rule and `bc` only (not on the heads, the batch,
/// the query tile height or the thread count), so every bitwise invariance of the forward holds.
fn key_splits(g: &Geometry<'_>, seq: &crate::spec::Sequence, bc: usize) -> Vec<Range<usize>> {
    if seq.sq == 0 || seq.sq > SPLIT_MAX_ROWS || bc == 0 {
        return Vec::new();
    }
    let keys = g.visibility(seq, 0).key_range(0..seq.sq);
    let lo = keys.start / bc * bc;
    let n = (keys.end.saturating_sub(lo) / SPLIT_KEYS).min(MAX_SPLITS);
    if n < 2 {
        return Vec::new();
    }
    let chunk = (keys.end - lo).div_ceil(n).div_ceil(bc) * bc;
    let ranges: Vec<Range<usize>> =
        (0..n).map(|s| lo + s * chunk..(lo + (s + 1) * chunk).min(keys.end)).filter(|r| !r.is_empty()).collect();
    // Key tiles as wide as the keys leave one range: nothing to split.
    if ranges.len() < 2 {
        return Vec::new();
    }
    ranges
}

/// Merges the key splits' partial results of every split sequence into `out` and `lse`, row by
/// row as the KV-cache decode merges its splits ([`softmax::merge_row`]).
fn merge_splits<T: Element>(
    g: &Geometry<'_>,
    splits: &[(Vec<Range<usize>>, usize)],
    part_o: &[f32],
    part_lse: &[f32],
    out: &Sink<T>,
    out_layout: RowLayout,
    lse: &Sink<f32>,
) {
    let dv = g.dv;
    let jobs: Vec<(usize, usize)> =
        (0..g.seqs.len()).filter(|&s| !splits[s].0.is_empty()).flat_map(|s| (0..g.hq).map(move |h| (s, h))).collect();
    for_each_dynamic(
        &jobs,
        || (vec![0f32; dv], Vec::new()),
        |(o, ws), &(s, head)| {
            let seq = &g.seqs[s];
            let (ranges, first) = &splits[s];
            let n = ranges.len();
            ws.resize(n, 0f32);
            for i in 0..seq.sq {
                let at = first + (head * seq.sq + i) * n;
                let part = |sp: usize| &part_o[(at + sp) * dv..(at + sp + 1) * dv];
                let row_lse = softmax::merge_row(part_lse[at..at + n].iter().copied(), part, &mut ws[..n], o);
                let dst = out_layout.row(seq, seq.q_start, i, head);
                // SAFETY: row (sequence, head, i) is written by this job alone (jobs are distinct
                // (sequence, head) pairs of split sequences, whose rows no forward unit wrote); its
                // `dv` elements are contiguous inside the validated `out` view.
                T::narrow_slice(o, unsafe { out.slice_mut(dst, dv) });
                // SAFETY: as above, for the lse entry of (sequence, head, i).
                unsafe { lse.write(g.lse_index(seq, head, i), row_lse) };
            }
        },
    );
}

pub use blocking::Tiles;

/// Forward pass into caller-provided `out` and `lse` (see [`crate::forward_into`]), with tile
/// sizes from the cache model in `blocking`.
pub fn forward_into<T: Element>(
    g: &Geometry<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    out: &mut TensorMut<'_, T>,
    lse: &mut [f32],
) -> Result<()> {
    let pairs = g.seqs.len() * g.hq;
    let masked = g.causal != crate::spec::Causal::None || g.window.is_some();
    let threads = rayon::current_num_threads();
    let amx = Isa::resolve(g.cpu_isa).is_ok_and(Isa::amx) && pairs::bf16_bits(k.data()).is_some();
    let mut tiles = if amx {
        blocking::amx_tiles(g.d, g.dv, g.max_sq, pairs, threads)
    } else {
        blocking::tiles(g.d, g.dv, g.max_sq, pairs, threads)
    };
    if masked {
        // Query tiles no taller than key tiles: a causal or windowed query tile visits the key
        // tiles its rows' spans reach, and a tall one drags its first rows over its last rows'
        // keys (at 512², 256-row tiles visit 6 of 8 tiles where 128-row tiles visit 10 of 16).
        tiles.br = tiles.br.min(tiles.bc);
    }
    forward_into_tiled(g, q, k, v, out, lse, tiles)
}

/// [`forward_into`] with explicit tile sizes: for tests (results must not depend on the tiling
/// beyond rounding) and tuning. Zero sizes are an error.
pub fn forward_into_tiled<T: Element>(
    g: &Geometry<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    out: &mut TensorMut<'_, T>,
    lse: &mut [f32],
    tiles: Tiles,
) -> Result<()> {
    forward_with_cache_budget(g, q, k, v, out, lse, tiles, blocking::KV_CACHE_BUDGET, true).map(|_| ())
}

/// [`forward_into_tiled`] with the bytes of packed key/value tiles each thread may keep, and
/// whether the key/value tiles of a (sequence, kv head) split over several work units are packed
/// once for all of them (`share`; tests run both, and cache budgets of none, a few tiles and
/// plenty: the results must be bitwise the same). Returns the number of key tiles packed into
/// shared slots.
#[allow(clippy::too_many_arguments)]
fn forward_with_cache_budget<T: Element>(
    g: &Geometry<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    out: &mut TensorMut<'_, T>,
    lse: &mut [f32],
    tiles: Tiles,
    cache_budget: usize,
    share: bool,
) -> Result<usize> {
    check_head_dims(g)?;
    if tiles.br == 0 || tiles.bc == 0 {
        return Err(Error::Unsupported(format!("tile sizes must be positive, got {tiles:?}")));
    }
    // Tiles larger than the problem buy nothing; clamping keeps scratch sizes bounded.
    let tiles = Tiles { br: tiles.br.min(g.max_sq.max(1)), bc: tiles.bc.min(g.max_sk.max(1)) };
    let out_layout: RowLayout = g.check_out(out, lse)?;
    let isa = Isa::resolve(g.cpu_isa)?;

    // Short query sequences over many keys run split over their keys (partial rows: heads ×
    // rows × splits of each split sequence).
    let mut partial_rows = 0;
    let splits: Vec<(Vec<Range<usize>>, usize)> = g
        .seqs
        .iter()
        .map(|seq| {
            let ranges = key_splits(g, seq, tiles.bc);
            let first = partial_rows;
            partial_rows += g.hq * seq.sq * ranges.len();
            (ranges, first)
        })
        .collect();
    let mut part_o = try_vec("forward key-split outputs", partial_rows * g.dv, 0f32)?;
    let mut part_lse = try_vec("forward key-split lse", partial_rows, f32::NEG_INFINITY)?;
    let units = forward_units(g, tiles.br, rayon::current_num_threads(), &splits);

    fill_uncovered_rows(g, out, out_layout, lse);
    let out_sink = Sink::new(out.data_mut());
    let lse_sink = Sink::new(lse);
    // `V`'s finiteness matters only where probabilities hidden by a mask (exact zeros) would
    // multiply it: without a mask rule every tile is Full, and the pass over `V` is skipped.
    let v_finite = !hides_keys(g) || all_finite(g, v, isa);
    let bf16 = match (pairs::bf16_bits(q.data()), pairs::bf16_bits(k.data()), pairs::bf16_bits(v.data())) {
        (Some(q), Some(k), Some(v)) if v_finite && isa.bf16_pairs() => Some(forward::Bf16Inputs { q, k, v }),
        _ => None,
    };
    let partials = forward::Partials { seqs: splits, o: Sink::new(&mut part_o), lse: Sink::new(&mut part_lse) };
    let pack_v = packs_v(g, v, tiles, &units);
    // The (sequence, kv head) pairs whose query tiles several units share (not key splits: those
    // see disjoint keys) get their key/value tiles packed once, by whichever unit needs one first.
    let mut units_of = vec![0usize; g.seqs.len() * g.hk];
    for u in units.iter().filter(|u| u.split.is_none()) {
        units_of[u.seq * g.hk + u.kv_head] += 1;
    }
    let shared_groups: Vec<bool> = units_of.iter().map(|&n| share && n >= SHARE_MIN_UNITS).collect();
    let shared = if shared_groups.contains(&true) {
        forward::SharedTiles::new(g, tiles, &shared_groups, SHARE_MIN_TILES, bf16.is_some(), pack_v)?
    } else {
        forward::SharedTiles::none()
    };
    let ctx = forward::Context {
        g,
        q: q.data(),
        k: k.data(),
        v: v.data(),
        out: &out_sink,
        out_layout,
        lse: &lse_sink,
        tiles,
        v_finite,
        bf16,
        isa,
        partials: &partials,
        shared: &shared,
    };
    // Units whose tiles are all shared need no cache of their own.
    let cache_budget = if units.iter().all(|u| shared.shares(g.hk, u.seq, u.kv_head)) { 0 } else { cache_budget };
    for_each_dynamic(
        &units,
        || forward::Pooled::new(g, tiles, bf16.is_some(), pack_v, cache_budget),
        |scratch, u| ctx.unit(scratch.get(), u.seq, u.kv_head, u.tiles.clone(), u.split),
    );
    let shared_tiles = shared.packed();
    shared.keep();
    let forward::Partials { seqs: splits, .. } = partials;
    merge_splits(g, &splits, &part_o, &part_lse, &out_sink, out_layout, &lse_sink);
    Ok(shared_tiles)
}

/// Whether the forward packs `V` once per work unit (else the products read its rows in place):
/// yes unless `V` is `f32` and either its rows lie at the packed stride already or every unit is
/// one short query tile of one head ([`IN_PLACE_V_MAX_ROWS`]).
fn packs_v<T: Element>(g: &Geometry<'_>, v: &Tensor<'_, T>, tiles: Tiles, units: &[ForwardUnit]) -> bool {
    let short_units = tiles.br <= IN_PLACE_V_MAX_ROWS && g.hq == g.hk && units.iter().all(|u| u.tiles.len() == 1);
    T::as_f32(v.data()).is_none() || (g.v.token_stride != blocking::padded_stride(g.dv) && !short_units)
}

fn check_head_dims(g: &Geometry<'_>) -> Result<()> {
    for (tensor, dim) in [("q", g.d), ("v", g.dv)] {
        if dim > MAX_HEAD_DIM {
            return Err(Error::HeadDim { tensor, dim, backend: "cpu", min: 1, max: MAX_HEAD_DIM });
        }
    }
    Ok(())
}

/// Backward pass into caller-provided gradients (see [`crate::backward_into`]): `dq`, `dk`, `dv`
/// from `q, k, v`, the forward's `out` and `lse`, and `dout`.
#[allow(clippy::too_many_arguments)]
pub fn backward_into<T: Element>(
    g: &Geometry<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    out: &Tensor<'_, T>,
    lse: &[f32],
    dout: &Tensor<'_, T>,
    dq: &mut TensorMut<'_, T>,
    dk: &mut TensorMut<'_, T>,
    dv: &mut TensorMut<'_, T>,
) -> Result<()> {
    let tiles = blocking::backward_tiles(g.d, g.dv, g.seqs.len() * g.hk, g.max_sk, backward::MIN_UNITS);
    backward_tiled(g, q, k, v, out, lse, dout, (dq, dk, dv), tiles, blocking::ROW_CACHE_BUDGET)
}

/// [`backward_into`] with explicit tiles and a budget for the packed query tiles each thread keeps
/// (tests compare budgets).
#[allow(clippy::too_many_arguments)]
fn backward_tiled<T: Element>(
    g: &Geometry<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    out: &Tensor<'_, T>,
    lse: &[f32],
    dout: &Tensor<'_, T>,
    (dq, dk, dv): (&mut TensorMut<'_, T>, &mut TensorMut<'_, T>, &mut TensorMut<'_, T>),
    tiles: Tiles,
    row_budget: usize,
) -> Result<()> {
    check_head_dims(g)?;
    let isa = Isa::resolve(g.cpu_isa)?;
    let out_layout = g.check_input_like("out", out, &g.q_shape(g.dv), true)?;
    let dout_layout = g.check_input_like("dout", dout, &g.q_shape(g.dv), true)?;
    g.check_lse_len(lse.len())?;
    let dq_layout = g.check_output_like("dq", dq, &g.q_shape(g.d), true)?;
    let dk_layout = g.check_output_like("dk", dk, &g.k_shape(g.d), false)?;
    let dv_layout = g.check_output_like("dv", dv, &g.k_shape(g.dv), false)?;

    let chunks = backward::chunks(g, tiles.bc);
    // D = rowsum(dO ∘ O): one pass before the main loop (FA2 Algorithm 2, line 4).
    let delta = backward::row_deltas(g, (out.data(), out_layout), (dout.data(), dout_layout))?;
    // The f32 dQ accumulator (one partial per chunk) and D: the only extra memory that grows with
    // the sequence length.
    let mut dq_acc = try_vec("dQ accumulator", numel("dQ accumulator", &[chunks, g.hq, g.total_q, g.d])?, 0.0f32)?;

    fill_uncovered_keys(g, dk, dk_layout, dv, dv_layout);
    let dq_acc_sink = Sink::new(&mut dq_acc);
    let (dk_sink, dv_sink) = (Sink::new(dk.data_mut()), Sink::new(dv.data_mut()));
    let bf16 = match (
        pairs::bf16_bits(q.data()),
        pairs::bf16_bits(k.data()),
        pairs::bf16_bits(v.data()),
        pairs::bf16_bits(dout.data()),
    ) {
        (Some(q), Some(k), Some(v), Some(dout)) if isa.bf16_pairs() => Some(backward::Bf16Inputs { q, k, v, dout }),
        _ => None,
    };
    let ctx = backward::Context {
        g,
        q: q.data(),
        k: k.data(),
        v: v.data(),
        dout: dout.data(),
        dout_layout,
        lse,
        delta: &delta,
        dq_acc: &dq_acc_sink,
        dk: &dk_sink,
        dk_layout,
        dv: &dv_sink,
        dv_layout,
        tiles,
        chunks,
        bf16,
        isa,
    };
    let mut units = Vec::new();
    for s in 0..g.seqs.len() {
        for kv_head in 0..g.hk {
            for chunk in 0..chunks {
                units.push((s, kv_head, chunk));
            }
        }
    }
    for_each_dynamic(
        &units,
        || backward::Scratch::new(g, tiles, bf16.is_some(), row_budget),
        |sc, &(s, kv_head, chunk)| ctx.kv_unit(sc, s, kv_head, chunk),
    );

    // dQ = scale · Σ over chunks, in chunk order, rounded once (the units accumulate dS K
    // unscaled: one pass over each dS tile fewer).
    let dq_sink = Sink::new(dq.data_mut());
    let (hq, d, total_q) = (g.hq, g.d, g.total_q);
    let rows: Vec<Range<usize>> = (0..total_q).step_by(DQ_ROWS).map(|t| t..(t + DQ_ROWS).min(total_q)).collect();
    for_each_dynamic(
        &rows,
        || vec![0.0f32; d],
        |sum, rows| {
            for (t, h) in rows.clone().flat_map(|t| (0..hq).map(move |h| (t, h))) {
                // Row by row, so the additions vectorise; each element still sums 0 + chunk 0 +
                // chunk 1 + … in that order.
                sum.fill(0.0);
                for c in 0..chunks {
                    let at = ((c * hq + h) * total_q + t) * d;
                    sum.iter_mut().zip(&dq_acc[at..at + d]).for_each(|(s, &x)| *s += x);
                }
                sum.iter_mut().for_each(|s| *s *= g.scale);
                let at = t * dq_layout.token_stride + h * dq_layout.head_stride;
                // SAFETY: token t is written by this item alone (items are disjoint row ranges);
                // its row of `d` elements is contiguous inside the validated, non-overlapping `dq`
                // view.
                T::narrow_slice(sum, unsafe { dq_sink.slice_mut(at, d) });
            }
        },
    );
    Ok(())
}

/// Whether every value row that a sequence can read is finite (one pass over `v`, `O(tk · dv)`).
/// On the calling thread: vectorised, the pass costs less than handing it to the pool (at
/// 1×8×128², d 64, the early-exit version was 5% of the forward). Where a sequence's rows lie in
/// one stretch of `v` with no gaps (the dense layouts), the stretch is checked as one slice, on
/// the path's vectors for `f32` and `bf16`.
fn all_finite<T: Element>(g: &Geometry<'_>, v: &Tensor<'_, T>, isa: Isa) -> bool {
    let data = v.data();
    g.seqs.iter().all(|seq| {
        if seq.sk == 0 || g.hk == 0 {
            return true;
        }
        let first = g.v.row(seq, seq.k_start, 0, 0);
        let last = g.v.row(seq, seq.k_start, seq.sk - 1, g.hk - 1);
        if last >= first && last - first + g.dv <= seq.sk * g.hk * g.dv {
            // Every row starts in `first..=last` (strides are not negative), so the stretch holds
            // them all (and whatever lies between, which only makes the answer stricter).
            return finite_slice(isa, &data[first..last + g.dv]);
        }
        (0..seq.sk).all(|j| {
            (0..g.hk).all(|h| {
                let at = g.v.row(seq, seq.k_start, j, h);
                finite_slice(isa, &data[at..at + g.dv])
            })
        })
    })
}

/// Whether every element of `xs` is finite: `f32` and `bf16` by their exponent bits on the path's
/// vectors, other types one by one.
fn finite_slice<T: Element>(isa: Isa, xs: &[T]) -> bool {
    if let Some(f) = T::as_f32(xs) {
        #[cfg(target_arch = "x86_64")]
        {
            if isa.avx512() {
                // SAFETY: AVX-512F is available (checked).
                return unsafe { finite_f32_avx512(f) };
            }
            if isa == Isa::Avx2 && Isa::Avx2.is_supported() {
                // SAFETY: AVX2 is available (checked).
                return unsafe { finite_f32_avx2(f) };
            }
        }
        return finite_f32(f);
    }
    if let Some(b) = pairs::bf16_bits(xs) {
        #[cfg(target_arch = "x86_64")]
        if isa.avx512() {
            // SAFETY: AVX-512F is available (checked).
            return unsafe { finite_bf16_avx512(b) };
        }
        return finite_bf16(b);
    }
    let _ = isa;
    // No early exit inside a chunk, so that the loop vectorises.
    xs.chunks(64).all(|c| c.iter().fold(true, |ok, x| ok & x.is_finite()))
}

/// No element of `xs` has an all-ones exponent (infinite or NaN). Early exit by chunks only, so
/// that each chunk's loop vectorises.
#[inline(always)]
pub(super) fn finite_f32(xs: &[f32]) -> bool {
    xs.chunks(256).all(|c| c.iter().fold(0u32, |acc, x| acc | u32::from(x.to_bits() & 0x7f80_0000 == 0x7f80_0000)) == 0)
}

/// [`finite_f32`] on `bf16` bits.
#[inline(always)]
fn finite_bf16(xs: &[u16]) -> bool {
    xs.chunks(512).all(|c| c.iter().fold(0u16, |acc, &x| acc | u16::from(x & 0x7f80 == 0x7f80)) == 0)
}

/// [`finite_f32`] compiled for AVX-512.
///
/// # Safety
/// AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn finite_f32_avx512(xs: &[f32]) -> bool {
    finite_f32(xs)
}

/// [`finite_f32`] compiled for AVX2.
///
/// # Safety
/// AVX2 available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn finite_f32_avx2(xs: &[f32]) -> bool {
    finite_f32(xs)
}

/// [`finite_bf16`] compiled for AVX-512F (its 16-bit lanes on the AVX2 instructions it implies).
///
/// # Safety
/// AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn finite_bf16_avx512(xs: &[u16]) -> bool {
    finite_bf16(xs)
}

/// Whether a mask rule (causal, window or block mask) hides any key from any query: otherwise
/// every tile is [`TileClass::Full`](crate::mask::TileClass::Full).
fn hides_keys(g: &Geometry<'_>) -> bool {
    g.causal != crate::spec::Causal::None || g.window.is_some() || g.block.is_some()
}

/// Varlen keys after the last sequence are seen by no query: their gradients are zero.
fn fill_uncovered_keys<T: Element>(
    g: &Geometry<'_>,
    dk: &mut TensorMut<'_, T>,
    dk_layout: RowLayout,
    dv: &mut TensorMut<'_, T>,
    dv_layout: RowLayout,
) {
    let covered = g.seqs.last().map_or(0, |s| s.k_start + s.sk);
    if !g.varlen || covered >= g.total_k {
        return;
    }
    for (data, layout, dim) in [(dk.data_mut(), dk_layout, g.d), (dv.data_mut(), dv_layout, g.dv)] {
        for t in covered..g.total_k {
            for h in 0..g.hk {
                let row = t * layout.token_stride + h * layout.head_stride;
                data[row..row + dim].fill(T::default());
            }
        }
    }
}

/// Varlen tokens after the last sequence belong to no sequence: they see no key, so `out = 0`
/// and `lse = -inf`, as for any fully masked row.
fn fill_uncovered_rows<T: Element>(g: &Geometry<'_>, out: &mut TensorMut<'_, T>, layout: RowLayout, lse: &mut [f32]) {
    let covered = g.seqs.last().map_or(0, |s| s.q_start + s.sq);
    if !g.varlen || covered >= g.total_q {
        return;
    }
    let data = out.data_mut();
    for t in covered..g.total_q {
        for h in 0..g.hq {
            let row = t * layout.token_stride + h * layout.head_stride;
            data[row..row + g.dv].fill(T::default());
            lse[h * g.total_q + t] = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;
    use crate::check::{report, Case, Storage};
    use crate::spec::Causal;
    use crate::{reference, DType};

    /// GQA (3 query heads per kv head), varlen with an empty and a short sequence, `d != dv`.
    fn gqa_varlen_case(dtype: DType, causal: Causal, window: Option<(i64, i64)>) -> Case {
        Case {
            dtype,
            hq: 6,
            hk: 2,
            d: 40,
            dv: 24,
            seqlens: vec![(70, 90), (0, 5), (33, 20), (100, 100), (9, 61)],
            varlen: true,
            causal,
            window,
            softcap: None,
            scale: None,
            alibi: None,
            block: None,
            storage: Storage::Contiguous,
            seed: 0xcac4e,
            isa: None,
        }
    }

    /// Zeroed `out` and `lse` buffers for the problem `g`, and `out`'s shape.
    fn out_buffers<T: Element>(g: &Geometry<'_>) -> (Vec<T>, Vec<f32>, Vec<usize>) {
        let shape = g.out_shape();
        (vec![T::default(); shape.iter().product()], vec![0.0; g.lse_len()], shape)
    }

    /// Output bits of `case` with tiles `tiles`, a key/value cache of `budget` bytes per thread
    /// and shared key/value tiles or not (`share`), after checking the contract against the
    /// oracle; and the number of key tiles packed into shared slots.
    fn run_checked<T: Element>(case: &Case, tiles: Tiles, budget: usize, share: bool) -> (Vec<u32>, usize) {
        let data = case.data::<T>();
        let spec = case.spec(&data);
        let [q, k, v] = data.views();
        let g = spec.geometry(&q, &k, &v).expect("valid case");
        let (mut out, mut lse, shape) = out_buffers::<T>(&g);
        let shared = forward_with_cache_budget(
            &g,
            &q,
            &k,
            &v,
            &mut TensorMut::new(&mut out, &shape),
            &mut lse,
            tiles,
            budget,
            share,
        )
        .expect("valid case");
        let oracle = reference::forward(&spec, &q, &k, &v).expect("valid case");
        let naive = reference::naive(&spec, &q, &k, &v).expect("valid case");
        let rep = report(&out, &lse, &oracle, &naive, case.dtype);
        assert!(rep.passed(), "{case} tiles={tiles:?} budget={budget} share={share}: {rep}");
        (out.iter().map(|x| x.to_f32().to_bits()).chain(lse.iter().map(|x| x.to_bits())).collect(), shared)
    }

    #[test]
    fn finite_slices_find_every_infinity_and_nan_on_every_path() {
        for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
            for n in [1usize, 15, 16, 17, 255, 256, 257, 700] {
                let mut rng = crate::check::Rng::new(n as u64);
                let wide: Vec<f32> = (0..n).map(|_| 1e30 * rng.normal() as f32).collect();
                let narrow: Vec<bf16> = wide.iter().map(|&x| bf16::from_f32(x * 1e-30)).collect();
                let halves: Vec<f16> = wide.iter().map(|&x| f16::from_f32(x * 1e-30)).collect();
                assert!(finite_slice(isa, &wide) && finite_slice(isa, &narrow) && finite_slice(isa, &halves));
                for at in [0, n / 2, n - 1] {
                    for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                        let (mut w, mut b, mut h) = (wide.clone(), narrow.clone(), halves.clone());
                        (w[at], b[at], h[at]) = (bad, bf16::from_f32(bad), f16::from_f32(bad));
                        let name = isa.name();
                        assert!(!finite_slice(isa, &w), "{name} f32 n {n} at {at} {bad}");
                        assert!(!finite_slice(isa, &b), "{name} bf16 n {n} at {at} {bad}");
                        assert!(!finite_slice(isa, &h), "{name} f16 n {n} at {at} {bad}");
                    }
                }
            }
        }
    }

    /// Without a mask rule the forward does not look at `V`'s finiteness (every tile is Full): a
    /// NaN and an infinity in `V` reach exactly the outputs the oracle's do, on every path, in
    /// `f32` and `bf16` (the `bf16` products then run on pairs).
    #[test]
    fn non_finite_values_without_a_mask_reach_the_oracles_outputs() {
        fn check<T: Element>(case: &Case) {
            let mut data = case.data::<T>();
            let (dv, hk) = (case.dv, case.hk);
            data.v[(7 * hk) * dv + 3] = T::from_f32(f32::NAN); // key 7, kv head 0, column 3
            data.v[(20 * hk + 1) * dv + 5] = T::from_f32(f32::INFINITY); // key 20, kv head 1, column 5
            let spec = case.spec(&data);
            let [q, k, v] = data.views();
            let g = spec.geometry(&q, &k, &v).expect("valid case");
            let (mut out, mut lse, shape) = out_buffers::<T>(&g);
            crate::forward_into(&spec, &q, &k, &v, &mut TensorMut::new(&mut out, &shape), &mut lse).expect("valid");
            let oracle = reference::forward(&spec, &q, &k, &v).expect("valid case");
            for (i, (o, r)) in out.iter().zip(&oracle.out).enumerate() {
                let o = o.to_f32();
                assert_eq!(
                    (o.is_nan(), o.is_infinite()),
                    (r.is_nan(), r.is_infinite()),
                    "{case}: element {i}: {o} vs {r}"
                );
            }
            assert!(oracle.out.iter().any(|x| x.is_nan()) && oracle.out.iter().any(|x| x.is_infinite()));
        }
        for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
            let case = Case {
                isa: Some(isa),
                seqlens: vec![(40, 50), (33, 64)],
                varlen: false,
                hq: 4,
                d: 32,
                dv: 32,
                ..gqa_varlen_case(DType::F32, Causal::None, None)
            };
            check::<f32>(&case);
            check::<bf16>(&Case { dtype: DType::BF16, ..case });
        }
    }

    fn cached_tiles_give_the_uncached_results<T: Element>(dtype: DType) {
        let tiles = Tiles { br: 16, bc: 16 };
        // 16 threads split every (sequence, kv head) of the case over several work units, whose
        // key/value tiles are then packed once, into shared slots.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(16).build().expect("a thread pool");
        for causal in [Causal::None, Causal::BottomRight, Causal::TopLeft] {
            for window in [None, Some((20, 5))] {
                let case = gqa_varlen_case(dtype, causal, window);
                // No cache; room for some of the 7 key tiles (bf16 pairs: 4 of Kᵀ + V; f32: 3 of
                // Kᵀ, 5 of V; the rest packed per query tile, f32 V read in place); plenty.
                let (none, _) = run_checked::<T>(&case, tiles, 0, false);
                let (some, _) = run_checked::<T>(&case, tiles, 2 * 4 * (40 + 24) * 16, false);
                let (all, _) = run_checked::<T>(&case, tiles, 1 << 24, false);
                assert!(none == some && some == all, "{case}: the cache changed the results");
                for budget in [0, 1 << 24] {
                    let (shared, packed) = pool.install(|| run_checked::<T>(&case, tiles, budget, true));
                    assert!(packed > 0, "{case}: no key tile was shared on 16 threads");
                    assert!(shared == none, "{case}: shared key/value tiles changed the results");
                }
            }
        }
    }

    #[test]
    fn shared_slots_left_dirty_give_the_clean_results() {
        // Whole key tiles are packed into their shared slots without zeroing them first (partial
        // ones are zeroed): no product may read an element of a slot that its packing did not
        // write. Every slot starts as NaN here (`POISON_SHARED`, set on the thread that sets up
        // the call); the results must stay those of unshared tiles. A guard for every kernel that
        // reads slots: on this Zen 4, with no slot zeroed at all, the products still read only
        // written elements.
        let tiles = Tiles { br: 16, bc: 16 };
        let pool = rayon::ThreadPoolBuilder::new().num_threads(16).build().expect("a thread pool");
        for dtype in [DType::F32, DType::BF16] {
            for causal in [Causal::None, Causal::BottomRight] {
                let mut case = gqa_varlen_case(dtype, causal, None);
                for dv in [24, 32] {
                    case.dv = dv;
                    let run = |share: bool| {
                        pool.install(|| {
                            forward::POISON_SHARED.set(share);
                            let bits = match dtype {
                                DType::BF16 => run_checked::<bf16>(&case, tiles, 0, share),
                                _ => run_checked::<f32>(&case, tiles, 0, share),
                            };
                            forward::POISON_SHARED.set(false);
                            bits
                        })
                    };
                    let (clean, _) = run(false);
                    let (dirty, packed) = run(true);
                    assert!(packed > 0, "{case}: no key tile was shared on 16 threads");
                    assert!(dirty == clean, "{case}: a dirty shared slot changed the results");
                }
            }
        }
    }

    #[test]
    fn f32_v_read_in_place_by_short_units_gives_the_packed_results() {
        // No GQA, fixed lengths, 16-row query tiles: on 16 threads every work unit is one query
        // tile of one head, which reads f32 V in place; on one thread a unit holds a head's seven
        // query tiles and packs V. The bits must not change, and both meet the contract.
        let tiles = Tiles { br: 16, bc: 16 };
        let pools = [16, 1].map(|n| rayon::ThreadPoolBuilder::new().num_threads(n).build().expect("a thread pool"));
        for isa in Isa::available() {
            for causal in [Causal::None, Causal::BottomRight, Causal::TopLeft] {
                let case = Case {
                    hq: 4,
                    hk: 4,
                    seqlens: vec![(100, 150); 2],
                    varlen: false,
                    seed: 0x5107,
                    isa: Some(isa),
                    ..gqa_varlen_case(DType::F32, causal, None)
                };
                let data = case.data::<f32>();
                let spec = case.spec(&data);
                let [q, k, v] = data.views();
                let g = spec.geometry(&q, &k, &v).expect("valid case");
                let no_splits = vec![(Vec::new(), 0); g.seqs.len()];
                let packs = [16, 1].map(|n| packs_v(&g, &v, tiles, &forward_units(&g, tiles.br, n, &no_splits)));
                assert_eq!(packs, [false, true], "{case}: V in place on 16 threads only");
                let [in_place, packed] =
                    pools.each_ref().map(|p| p.install(|| run_checked::<f32>(&case, tiles, 1 << 24, true).0));
                assert!(in_place == packed, "{case}: V read in place changed the results");
            }
        }
    }

    /// Gradient bits of `case` (forward by the library, `dout` from the case's data) with the
    /// backward's packed query tiles given `budget` bytes per thread.
    fn backward_bits<T: Element>(case: &Case, tiles: Tiles, budget: usize) -> Vec<u32> {
        let data = case.data::<T>();
        let spec = case.spec(&data);
        let [q, k, v] = data.views();
        let g = spec.geometry(&q, &k, &v).expect("valid case");
        let fwd = crate::forward(&spec, &q, &k, &v).expect("valid case");
        let dout_data: Vec<T> =
            (0..fwd.out.len()).map(|i| T::from_f64(((i * 7919 % 1000) as f64 - 500.0) / 250.0)).collect();
        let out = Tensor::new(&fwd.out, &fwd.out_shape);
        let dout = Tensor::new(&dout_data, &fwd.out_shape);
        let (qs, ks, vs) = (g.q_shape(g.d), g.k_shape(g.d), g.k_shape(g.dv));
        let (mut dq, mut dk, mut dv) = (
            vec![T::default(); qs.iter().product()],
            vec![T::default(); ks.iter().product()],
            vec![T::default(); vs.iter().product()],
        );
        let grads =
            (&mut TensorMut::new(&mut dq, &qs), &mut TensorMut::new(&mut dk, &ks), &mut TensorMut::new(&mut dv, &vs));
        backward_tiled(&g, &q, &k, &v, &out, &fwd.lse, &dout, grads, tiles, budget).expect("valid case");
        dq.iter().chain(&dk).chain(&dv).map(|x| x.to_f32().to_bits()).collect()
    }

    #[test]
    fn cached_query_tiles_give_the_uncached_gradients_in_bf16() {
        cached_query_tiles_give_the_uncached_gradients::<bf16>(DType::BF16);
    }

    #[test]
    fn cached_query_tiles_give_the_uncached_gradients_in_f32() {
        cached_query_tiles_give_the_uncached_gradients::<f32>(DType::F32);
    }

    #[test]
    fn cached_query_tiles_give_the_uncached_gradients_in_f16() {
        cached_query_tiles_give_the_uncached_gradients::<f16>(DType::F16);
    }

    fn cached_query_tiles_give_the_uncached_gradients<T: Element>(dtype: DType) {
        let tiles = Tiles { br: 16, bc: 16 };
        for causal in [Causal::None, Causal::BottomRight] {
            for window in [None, Some((20, 5))] {
                let case = gqa_varlen_case(dtype, causal, window);
                // No cache (every tile in the spare slot), three slots (bf16: 4 · 16 · (40 + 24)
                // bytes a slot; f32, f16: 4 · 16 · (48 + 48), `Q` and `dO` at padded strides),
                // plenty.
                let slot = if dtype == DType::BF16 { 4 * 16 * (40 + 24) } else { 4 * 16 * (48 + 48) };
                let none = backward_bits::<T>(&case, tiles, 0);
                let some = backward_bits::<T>(&case, tiles, 3 * slot);
                let all = backward_bits::<T>(&case, tiles, 1 << 24);
                assert!(none == some && some == all, "{case}: the cache changed the gradients");
            }
        }
    }

    /// The gradients of `case` with tiles `tiles`, against the oracle, after checking that the
    /// keys are split into several chunks (so `dQ` is summed over per-chunk partials).
    fn chunked_backward_report<T: Element>(case: &Case, tiles: Tiles) -> crate::check::BackwardReport {
        let data = case.data::<T>();
        let spec = case.spec(&data);
        let [q, k, v] = data.views();
        let g = spec.geometry(&q, &k, &v).expect("valid case");
        assert!(backward::chunks(&g, tiles.bc) > 1, "{case}: a single chunk");
        let fwd = crate::forward(&spec, &q, &k, &v).expect("valid case");
        let (out, (dout, dout_shape)) = (Tensor::new(&fwd.out, &fwd.out_shape), case.dout(&data).expect("valid"));
        let dout_t = Tensor::new(&dout, &dout_shape);
        let (qs, ks, vs) = (g.q_shape(g.d), g.k_shape(g.d), g.k_shape(g.dv));
        let zeros = |shape: &[usize]| vec![T::default(); shape.iter().product()];
        let mut grads = crate::Gradients {
            dq: zeros(&qs),
            dk: zeros(&ks),
            dv: zeros(&vs),
            dq_shape: qs,
            dk_shape: ks,
            dv_shape: vs,
        };
        let views = (
            &mut TensorMut::new(&mut grads.dq, &grads.dq_shape),
            &mut TensorMut::new(&mut grads.dk, &grads.dk_shape),
            &mut TensorMut::new(&mut grads.dv, &grads.dv_shape),
        );
        backward_tiled(&g, &q, &k, &v, &out, &fwd.lse, &dout_t, views, tiles, blocking::ROW_CACHE_BUDGET)
            .expect("valid case");
        crate::check::compare_gradients(&spec, &grads, &data, &dout_t, case.dtype).expect("valid case")
    }

    #[test]
    fn gradients_summed_over_several_key_chunks_meet_the_contract() {
        let tiles = Tiles { br: 16, bc: 16 };
        for (dtype, causal) in
            [(DType::F32, Causal::None), (DType::BF16, Causal::BottomRight), (DType::F16, Causal::TopLeft)]
        {
            // One (sequence, kv head) and 44 key tiles: 16 chunks of at most 3.
            let case = Case {
                hq: 2,
                hk: 1,
                d: 24,
                dv: 16,
                seqlens: vec![(40, 700)],
                varlen: false,
                seed: 0xc4,
                ..gqa_varlen_case(dtype, causal, None)
            };
            let rep = match dtype {
                DType::F32 => chunked_backward_report::<f32>(&case, tiles),
                DType::F16 => chunked_backward_report::<f16>(&case, tiles),
                DType::BF16 => chunked_backward_report::<bf16>(&case, tiles),
            };
            assert!(rep.passed(), "{case}: {rep}");
        }
    }

    #[test]
    fn cached_key_and_value_tiles_give_the_uncached_results_in_f32() {
        cached_tiles_give_the_uncached_results::<f32>(DType::F32);
    }

    #[test]
    fn cached_key_and_value_tiles_give_the_uncached_results_in_f16() {
        cached_tiles_give_the_uncached_results::<f16>(DType::F16);
    }

    #[test]
    fn cached_key_pairs_give_the_uncached_results_in_bf16() {
        cached_tiles_give_the_uncached_results::<bf16>(DType::BF16);
    }
}
