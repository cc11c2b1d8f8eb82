//! The backward pass by recomputation (FlashAttention-2, Algorithm 2): `S` and `P` are rebuilt
//! tile by tile from `Q`, `K` and the saved LSE, never stored.
//!
//! Work is split by `(sequence, kv head, chunk of key/value tiles)`. A unit keeps `K_j, V_j` and
//! their gradients `dK_j, dV_j` hot while every query tile of every query head of its group
//! streams past, so GQA gradients are summed straight into the `hk` heads. `dQ` gets contributions
//! from every key/value tile: each chunk accumulates its own `f32` partial `dQ`, and the partials
//! are summed in chunk order at the end. The number of chunks depends on the problem only, and
//! every accumulation runs in a fixed order, so results are bitwise identical across runs and
//! thread counts.

use super::blocking::{Strides, Tiles};
use super::gemm::{gemm, gemm_bf16, gemm_bf16_ta, gemm_ta, Bf16Pair, PANEL_WIDTH};
use super::isa::Isa;
use super::lines::{LineVec, Word, LINE_WORDS};
use super::pairs::{ds_to_pairs, narrow_row_pairs, pack_row_pairs, pack_rows, pack_rows_transposed};
use super::tile::{load_rows, score_tile, transpose_panels, QkOperands, ScoreMod};
use super::transpose::transpose;
use super::vexp::{exp_scaled_row_pairs, exp_scaled_sub_sum, scale_row};
use super::Sink;
use crate::dtype::Element;
use crate::error::{try_vec, Result};
use crate::mask::TileClass;
use crate::philox::DropoutRng;
use crate::spec::{Geometry, RowLayout, Sequence};

/// Units of work we aim for, independent of the thread count (so is the result).
pub(super) const MIN_UNITS: usize = 16;

/// Chunks of key/value tiles per `(sequence, kv head)`: enough units to occupy a machine when
/// `batch · hk` is small, and one otherwise.
pub(super) fn chunks(g: &Geometry<'_>, bc: usize) -> usize {
    let pairs = (g.seqs.len() * g.hk).max(1);
    let max_tiles = g.max_sk.div_ceil(bc).max(1);
    MIN_UNITS.div_ceil(pairs).clamp(1, max_tiles)
}

/// Per-thread scratch of the backward loop: `O(Br·(d + dv) + Br·Bc + Bc·(d + dv))` floats, and on
/// the bf16 path the packed query tiles of a unit (at most
/// [`ROW_CACHE_BUDGET`](super::blocking::ROW_CACHE_BUDGET) bytes).
pub(super) struct Scratch {
    /// `Q_i` and `dO_i` in `f32` (rows at the strides of `ld`), copied once per unit: `[Q | dO]`.
    rows: RowSlots<f32>,
    lse: Vec<f32>,
    delta: Vec<f32>,
    s: LineVec<f32>,
    dp: LineVec<f32>,
    tanh: LineVec<f32>,
    keep: LineVec<f32>,
    p_dropped: LineVec<f32>,
    k: LineVec<f32>,
    /// `K_jᵀ` in [`BLayout::panels`](super::gemm::BLayout::panels), as `score_tile` takes it (the
    /// other `B` operands stay row-major: in the backward, whose tiles stay in L1 and L2, panels
    /// of them measured level).
    kt: LineVec<f32>,
    v: LineVec<f32>,
    vt: LineVec<f32>,
    dk: LineVec<f32>,
    dv: LineVec<f32>,
    /// The operands as `bf16` pairs, when the products run on them (then `rows`, `k`, `kt`, `v`,
    /// `vt` stay empty).
    pairs: Option<PairTiles>,
    /// Row strides of the tiles above (`Q_i` and `dO_i` are copied at them rather than read in
    /// place at a token stride, which put every row of a GEMM panel in one L1 set).
    ld: Strides,
}

/// The five products' operands in the pair layout of [`gemm_bf16`]: pairs along the head dims
/// for `S = Q Kᵀ` and `dP = dO Vᵀ`, along the query rows for `dV += Pᵀ dO` and `dK += dSᵀ Q`,
/// along the keys for `dQ += dS K`.
struct PairTiles {
    kt: LineVec<Bf16Pair>,
    vt: LineVec<Bf16Pair>,
    k_keys: LineVec<Bf16Pair>,
    /// `Q_i` and `dO_i`, packed once per unit: `[Q | dO | Q row pairs | dO row pairs]`.
    rows: RowSlots<Bf16Pair>,
    p_rows: LineVec<Bf16Pair>,
    ds_rows: LineVec<Bf16Pair>,
    ds_keys: LineVec<Bf16Pair>,
}

/// `Q_i` and `dO_i` of the query tiles of a unit as the products take them, packed the first
/// time a unit meets the tile and reused for its other key tiles (a unit's loop runs over key
/// tiles outside query tiles, so without it each query tile was packed once per key tile). On
/// `bf16` pairs four arrays a slot — pairs along the head dims (`S = Q Kᵀ`, `dP = dO Vᵀ`) and
/// along the rows (`dK += dSᵀ Q`, `dV += Pᵀ dO`); in `f32` two, `Q_i` and `dO_i` at the padded
/// strides (copied from rows a token stride apart, 6-7% of the `f32` backward when it was done
/// for every key tile). One slot per (query head of the unit, query tile), up to a budget
/// ([`ROW_CACHE_BUDGET`](super::blocking::ROW_CACHE_BUDGET) by default); tiles past it share a
/// spare slot and are packed per key tile as before.
struct RowSlots<E> {
    words: LineVec<E>,
    /// Whether cached slot `i` holds its tile for the current unit.
    filled: Vec<bool>,
    /// Elements per slot, the arrays one after another.
    slot_len: usize,
    offsets: Vec<usize>,
}

impl<E: Word> RowSlots<E> {
    /// Slots of arrays of `lens` elements each for the query tiles of a unit.
    fn new(g: &Geometry<'_>, t: Tiles, lens: &[usize], budget: usize) -> Self {
        // Each array starts a line.
        let lens: Vec<usize> = lens.iter().map(|n| n.next_multiple_of(LINE_WORDS)).collect();
        let offsets = lens.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect();
        let slot_len = lens.iter().sum::<usize>();
        let wanted = (g.hq / g.hk.max(1)) * g.max_sq.div_ceil(t.br.max(1));
        let cached = wanted.min(budget / (std::mem::size_of::<E>() * slot_len).max(1));
        RowSlots { words: LineVec::zeroed((cached + 1) * slot_len), filled: vec![false; cached], slot_len, offsets }
    }

    /// The slot of tile `index` of the unit (its query head in the unit's group, then its query
    /// tile) and whether it must be packed now.
    fn claim(&mut self, index: usize) -> (usize, bool) {
        match self.filled.get_mut(index) {
            Some(filled) => (index, !std::mem::replace(filled, true)),
            None => (self.filled.len(), true),
        }
    }

    /// Array `which` of slot `slot`.
    fn part(&self, slot: usize, which: usize) -> &[E] {
        &self.words[slot * self.slot_len + self.offsets[which]..]
    }

    fn part_mut(&mut self, slot: usize, which: usize) -> &mut [E] {
        &mut self.words[slot * self.slot_len + self.offsets[which]..]
    }
}

impl Scratch {
    pub(super) fn new(g: &Geometry<'_>, t: Tiles, pairs: bool, row_budget: usize) -> Self {
        let (d, dv) = (g.d, g.dv);
        let f32_tile = |n: usize| LineVec::zeroed(if pairs { 0 } else { n });
        let (dp, dvp, brp, bcp) = (d.div_ceil(2), dv.div_ceil(2), t.br.div_ceil(2), t.bc.div_ceil(2));
        let ld = Strides::new(d, dv, t.bc, pairs);
        let score = t.br * ld.s;
        let f32_rows = [t.br * ld.d, t.br * ld.dv];
        Self {
            pairs: pairs.then(|| PairTiles {
                kt: LineVec::zeroed(dp * t.bc),
                vt: LineVec::zeroed(dvp * t.bc),
                k_keys: LineVec::zeroed(bcp * d),
                rows: RowSlots::new(g, t, &[t.br * dp, t.br * dvp, brp * d, brp * dv], row_budget),
                p_rows: LineVec::zeroed(brp * t.bc),
                ds_rows: LineVec::zeroed(brp * t.bc),
                ds_keys: LineVec::zeroed(t.br * bcp),
            }),
            rows: RowSlots::new(g, t, if pairs { &[] } else { &f32_rows }, row_budget),
            lse: vec![0.0; t.br],
            delta: vec![0.0; t.br],
            s: LineVec::zeroed(score),
            dp: LineVec::zeroed(score),
            tanh: LineVec::zeroed(if g.softcap.is_some() { score } else { 0 }),
            keep: LineVec::zeroed(if g.dropout.is_some() { score } else { 0 }),
            p_dropped: LineVec::zeroed(if g.dropout.is_some() { score } else { 0 }),
            k: f32_tile(t.bc * ld.d),
            kt: f32_tile(d * t.bc.div_ceil(PANEL_WIDTH) * PANEL_WIDTH),
            v: f32_tile(t.bc * ld.dv),
            vt: f32_tile(dv * ld.s),
            dk: LineVec::zeroed(t.bc * d),
            dv: LineVec::zeroed(t.bc * dv),
            ld,
        }
    }
}

/// Everything the units of one backward call share.
pub(super) struct Context<'a, T> {
    pub g: &'a Geometry<'a>,
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub dout: &'a [T],
    pub dout_layout: RowLayout,
    /// Saved log-sum-exp, natural log, `[b, hq, sq]` / `[hq, tq]`.
    pub lse: &'a [f32],
    /// `D = rowsum(dO ∘ O)`, laid out like `lse`.
    pub delta: &'a [f32],
    /// `f32` partial `dQ` per chunk: `[chunks, hq, total_q, d]`.
    pub dq_acc: &'a Sink<f32>,
    pub dk: &'a Sink<T>,
    pub dk_layout: RowLayout,
    pub dv: &'a Sink<T>,
    pub dv_layout: RowLayout,
    pub tiles: Tiles,
    pub chunks: usize,
    /// `Some` when the inputs are `bf16` and the CPU multiplies `bf16` pairs: the five products
    /// then run on `bf16` operands, `P` and `dS` rounded to `bf16` (as FlashAttention-2 does).
    pub bf16: Option<Bf16Inputs<'a>>,
    /// The instruction-set path every kernel of the call runs on (resolved once, at the top).
    pub isa: Isa,
}

/// The raw bits of `bf16` inputs, for the products on `bf16` pairs.
#[derive(Clone, Copy)]
pub(super) struct Bf16Inputs<'a> {
    pub q: &'a [u16],
    pub k: &'a [u16],
    pub v: &'a [u16],
    pub dout: &'a [u16],
}

impl<T: Element> Context<'_, T> {
    /// Index of `(chunk, head, token, 0)` in the partial-`dQ` buffer.
    fn dq_index(&self, chunk: usize, head: usize, token: usize) -> usize {
        ((chunk * self.g.hq + head) * self.g.total_q + token) * self.g.d
    }

    /// All key/value tiles of chunk `chunk` of kv head `kv_head` of sequence `seq`.
    pub(super) fn kv_unit(&self, sc: &mut Scratch, seq: usize, kv_head: usize, chunk: usize) {
        let g = self.g;
        let seq = &g.seqs[seq];
        let Tiles { br, bc } = self.tiles;
        let (d, dv) = (g.d, g.dv);
        let n_tiles = seq.sk.div_ceil(bc);
        let per_chunk = n_tiles.div_ceil(self.chunks).max(1);
        let group = g.hq / g.hk;
        let n_qt = seq.sq.div_ceil(br);
        sc.rows.filled.fill(false);
        if let Some(pt) = sc.pairs.as_mut() {
            pt.rows.filled.fill(false);
        }
        for jt in (chunk * per_chunk)..((chunk + 1) * per_chunk).min(n_tiles) {
            let cols = jt * bc..((jt + 1) * bc).min(seq.sk);
            let nc = cols.len();
            if let (Some(bits), Some(pt)) = (self.bf16, sc.pairs.as_mut()) {
                let (k_start, c) = (seq.k_start, cols.clone());
                pack_rows_transposed(self.isa, &mut pt.kt, bc, bits.k, g.k, seq, k_start, c.clone(), kv_head, d);
                pack_rows_transposed(self.isa, &mut pt.vt, bc, bits.v, g.v, seq, k_start, c.clone(), kv_head, dv);
                pack_row_pairs(&mut pt.k_keys, d, bits.k, g.k, seq, k_start, c, kv_head, d);
            } else {
                let ld = sc.ld;
                load_rows(self.isa, &mut sc.k, ld.d, self.k, g.k, seq, seq.k_start, cols.clone(), kv_head, d);
                transpose_panels(self.isa, &mut sc.kt, &sc.k, ld.d, nc, d);
                load_rows(self.isa, &mut sc.v, ld.dv, self.v, g.v, seq, seq.k_start, cols.clone(), kv_head, dv);
                transpose(self.isa, &mut sc.vt, ld.s, &sc.v, ld.dv, nc, dv);
            }
            sc.dk[..nc * d].fill(0.0);
            sc.dv[..nc * dv].fill(0.0);
            for (h, head) in (kv_head * group..(kv_head + 1) * group).enumerate() {
                for it in 0..n_qt {
                    let rows = it * br..((it + 1) * br).min(seq.sq);
                    self.tile(sc, seq, head, rows, cols.clone(), (chunk, h * n_qt + it));
                }
            }
            // dK_j = scale · Σ dSᵀ Q; dV_j = Σ P'ᵀ dO: write this tile's rows.
            scale_row(self.isa, &mut sc.dk[..nc * d], g.scale);
            for (c, j) in cols.enumerate() {
                let at = self.dk_layout.row(seq, seq.k_start, j, kv_head);
                // SAFETY: key j of (seq, kv_head) belongs to this unit's chunk alone; its row is
                // contiguous inside the validated, non-overlapping `dk` view.
                T::narrow_slice(&sc.dk[c * d..(c + 1) * d], unsafe { self.dk.slice_mut(at, d) });
                let at = self.dv_layout.row(seq, seq.k_start, j, kv_head);
                // SAFETY: as above, for `dv`.
                T::narrow_slice(&sc.dv[c * dv..(c + 1) * dv], unsafe { self.dv.slice_mut(at, dv) });
            }
        }
    }

    /// One `(query tile, key/value tile)` pair of query head `head` (FA2 Algorithm 2, inner loop).
    fn tile(
        &self,
        sc: &mut Scratch,
        seq: &Sequence,
        head: usize,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
        (chunk, tile_index): (usize, usize),
    ) {
        let g = self.g;
        let vis = g.visibility(seq, head);
        let class = vis.classify(rows.clone(), cols.clone());
        if class == TileClass::Skip {
            return;
        }
        let bc = self.tiles.bc;
        let ld = sc.ld;
        // The stride of the score-shaped tiles (`bc` on pairs).
        let lds = ld.s;
        let (d, dv) = (g.d, g.dv);
        let (nr, nc) = (rows.len(), cols.len());
        let smod = ScoreMod::new(g, seq, head);

        // Q_i and dO_i as the products want them: f32 rows (read in place or widened), or bf16
        // pairs along the head dims and along the rows.
        let mut ops = match (self.bf16, sc.pairs.take()) {
            (Some(bits), Some(mut pt)) => {
                let (slot, fresh) = pt.rows.claim(tile_index);
                if fresh {
                    let (q0, dl, r) = (seq.q_start, self.dout_layout, rows.clone());
                    let rs = &mut pt.rows;
                    pack_rows(rs.part_mut(slot, 0), d.div_ceil(2), bits.q, g.q, seq, q0, r.clone(), head, d);
                    pack_rows(rs.part_mut(slot, 1), dv.div_ceil(2), bits.dout, dl, seq, q0, r.clone(), head, dv);
                    pack_row_pairs(rs.part_mut(slot, 2), d, bits.q, g.q, seq, q0, r.clone(), head, d);
                    pack_row_pairs(rs.part_mut(slot, 3), dv, bits.dout, dl, seq, q0, r, head, dv);
                }
                RowOperands::Pairs(pt, slot)
            }
            (_, pairs) => {
                sc.pairs = pairs;
                let (slot, fresh) = sc.rows.claim(tile_index);
                if fresh {
                    let (q0, dl, r) = (seq.q_start, self.dout_layout, rows.clone());
                    let rs = &mut sc.rows;
                    load_rows(self.isa, rs.part_mut(slot, 0), ld.d, self.q, g.q, seq, q0, r.clone(), head, d);
                    load_rows(self.isa, rs.part_mut(slot, 1), ld.dv, self.dout, dl, seq, q0, r, head, dv);
                }
                RowOperands::F32 { q: sc.rows.part(slot, 0), ldq: ld.d, dout: sc.rows.part(slot, 1), ldo: ld.dv }
            }
        };
        for (r, i) in rows.clone().enumerate() {
            let li = g.lse_index(seq, head, i);
            sc.lse[r] = self.lse[li];
            sc.delta[r] = self.delta[li];
        }

        // Recompute S_ij and P_ij = exp(S_ij - L_i) from the saved LSE; the softmax scale, when
        // it is the only score modifier, is folded into the exponent (one pass fewer).
        let tanh = smod.has_softcap().then_some(&mut sc.tanh[..]);
        let qk = match &ops {
            RowOperands::F32 { q, ldq, .. } => QkOperands::F32 { q, ldq: *ldq, kt: &sc.kt },
            RowOperands::Pairs(pt, slot) => {
                QkOperands::Bf16Pairs { q: pt.rows.part(*slot, 0), ldq: d.div_ceil(2), kt: &pt.kt }
            }
        };
        let exp_scale = smod.deferrable_scale();
        score_tile(
            self.isa,
            &mut sc.s,
            lds,
            (qk, exp_scale.is_some()),
            d,
            rows.clone(),
            cols.clone(),
            smod,
            class,
            &vis,
            tanh,
        );
        let exp_scale = exp_scale.unwrap_or(1.0);
        match &mut ops {
            // bf16 without dropout: P rounded to pairs along the rows (dV's operand) in the same
            // pass, two rows at a time.
            RowOperands::Pairs(pt, _) if g.dropout.is_none() => {
                for q in 0..nr.div_ceil(2) {
                    let (lo, hi) = sc.s[2 * q * lds..].split_at_mut(lds);
                    let lo = (&mut lo[..nc], sc.lse[2 * q]);
                    let hi = (2 * q + 1 < nr).then(|| (&mut hi[..nc], sc.lse[2 * q + 1]));
                    exp_scaled_row_pairs(self.isa, lo, hi, exp_scale, &mut pt.p_rows[q * bc..]);
                }
            }
            _ => {
                for r in 0..nr {
                    let lse = sc.lse[r];
                    let row = &mut sc.s[r * lds..r * lds + nc];
                    if lse == f32::NEG_INFINITY {
                        row.fill(0.0); // a row that sees no key has no gradient
                    } else {
                        exp_scaled_sub_sum(self.isa, row, exp_scale, lse);
                    }
                }
            }
        }
        // dP_ij = dO_i V_jᵀ.
        match &ops {
            RowOperands::F32 { dout, ldo, .. } => {
                gemm(self.isa, &mut sc.dp, lds, dout, *ldo, &sc.vt, lds, (nr, nc, dv), false)
            }
            RowOperands::Pairs(pt, slot) => {
                let dvp = dv.div_ceil(2);
                gemm_bf16(self.isa, &mut sc.dp, lds, pt.rows.part(*slot, 1), dvp, &pt.vt, bc, (nr, nc, dvp), false)
            }
        }

        // Dropout: dV uses P' = P ∘ keep/(1-p), and dP = dP' ∘ keep/(1-p).
        if let Some(dr) = g.dropout {
            let rng = DropoutRng::new(dr.p, dr.seed, dr.offset);
            for (r, i) in rows.clone().enumerate() {
                let row = r * lds..r * lds + nc;
                let keep = &mut sc.keep[row.clone()];
                keep.fill(1.0);
                rng.apply_row(seq.batch, head, g.hq, i, cols.start, rng.scale(), keep);
                for ((pd, &p), &f) in sc.p_dropped[row.clone()].iter_mut().zip(&sc.s[row.clone()]).zip(&*keep) {
                    *pd = p * f;
                }
                sc.dp[row].iter_mut().zip(&*keep).for_each(|(dp, &f)| *dp *= f);
            }
        }
        // dV_j += P'ᵀ dO_i.
        let p = if g.dropout.is_some() { &sc.p_dropped } else { &sc.s };
        match &mut ops {
            RowOperands::F32 { dout, ldo, .. } => {
                gemm_ta(self.isa, &mut sc.dv, dv, p, lds, dout, *ldo, (nc, dv, nr), true)
            }
            RowOperands::Pairs(pt, slot) => {
                if g.dropout.is_some() {
                    pair_rows(self.isa, &mut pt.p_rows, bc, p, lds, nr, nc);
                }
                let dout_rows = pt.rows.part(*slot, 3);
                gemm_bf16_ta(self.isa, &mut sc.dv, dv, &pt.p_rows, bc, dout_rows, dv, (nc, dv, nr.div_ceil(2)), true);
            }
        }

        // Through the softcap, dS carries the factor (1 - tanh²): folded into P here, which
        // nothing else reads from now on.
        if smod.has_softcap() {
            for r in 0..nr {
                let p = &mut sc.s[r * lds..r * lds + nc];
                for (pi, &t) in p.iter_mut().zip(&sc.tanh[r * lds..r * lds + nc]) {
                    *pi *= 1.0 - t * t;
                }
            }
        }
        // dS_ij = P_ij ∘ (dP_ij - D_i); dK_j += dSᵀ Q_i (scaled when written); dQ_i += dS K_j
        // into this chunk's partial (scaled when the partials are summed).
        let at = self.dq_index(chunk, head, g.q_token(seq, rows.start));
        // SAFETY: the partial rows of (chunk, head, tokens of `rows`) are touched only by the unit
        // of (sequence, kv_head(head), chunk), which runs on one thread; tokens of one sequence
        // are consecutive, and the buffer holds chunks · hq · total_q · d floats.
        let dq = unsafe { self.dq_acc.slice_mut(at, nr * d) };
        match ops {
            RowOperands::F32 { q, ldq, .. } => {
                for r in 0..nr {
                    let delta = sc.delta[r];
                    let (p, dp) = (&mut sc.s[r * lds..r * lds + nc], &sc.dp[r * lds..r * lds + nc]);
                    for (pi, &dpi) in p.iter_mut().zip(dp) {
                        *pi *= dpi - delta;
                    }
                }
                gemm_ta(self.isa, &mut sc.dk, d, &sc.s, lds, q, ldq, (nc, d, nr), true);
                gemm(self.isa, dq, d, &sc.s, lds, &sc.k, ld.d, (nr, d, nc), true);
            }
            RowOperands::Pairs(mut pt, slot) => {
                // dS rounded to bf16 once, in both layouts, in one pass over P and dP.
                let bcp = bc.div_ceil(2);
                for q in 0..nr.div_ceil(2) {
                    let (r0, r1) = (2 * q, 2 * q + 1);
                    let lo = (&sc.s[r0 * lds..r0 * lds + nc], &sc.dp[r0 * lds..r0 * lds + nc], sc.delta[r0]);
                    let hi = (r1 < nr)
                        .then(|| (&sc.s[r1 * lds..r1 * lds + nc], &sc.dp[r1 * lds..r1 * lds + nc], sc.delta[r1]));
                    let (keys_lo, keys_hi) = pt.ds_keys[r0 * bcp..].split_at_mut(bcp);
                    let keys_hi = (r1 < nr).then_some(keys_hi);
                    ds_to_pairs(self.isa, lo, hi, &mut pt.ds_rows[q * bc..], keys_lo, keys_hi);
                }
                let q_rows = pt.rows.part(slot, 2);
                gemm_bf16_ta(self.isa, &mut sc.dk, d, &pt.ds_rows, bc, q_rows, d, (nc, d, nr.div_ceil(2)), true);
                gemm_bf16(self.isa, dq, d, &pt.ds_keys, bcp, &pt.k_keys, d, (nr, d, nc.div_ceil(2)), true);
                sc.pairs = Some(pt);
            }
        }
    }
}

/// The row operands of one backward tile.
// The pair tiles are moved out of the scratch and back once a tile, never stored here.
#[allow(clippy::large_enum_variant)]
enum RowOperands<'a> {
    /// `Q_i` and `dO_i` as `f32` matrices `(data, row stride)`.
    F32 { q: &'a [f32], ldq: usize, dout: &'a [f32], ldo: usize },
    /// The thread's pair tiles (taken out of the scratch for the tile), `Q_i` and `dO_i` packed
    /// in the given slot of its [`RowSlots`].
    Pairs(PairTiles, usize),
}

/// Rows `2q, 2q + 1` of the `nr × nc` tile `src` (row stride `ld_src`) rounded to `bf16` and
/// interleaved into row `q` of `dst` (row stride `ld_dst`): `P` or `dS` paired along the rows.
fn pair_rows(isa: Isa, dst: &mut [Bf16Pair], ld_dst: usize, src: &[f32], ld_src: usize, nr: usize, nc: usize) {
    for q in 0..nr.div_ceil(2) {
        let lo = &src[2 * q * ld_src..2 * q * ld_src + nc];
        let hi = (2 * q + 1 < nr).then(|| &src[(2 * q + 1) * ld_src..(2 * q + 1) * ld_src + nc]);
        narrow_row_pairs(isa, &mut dst[q * ld_dst..], lo, hi);
    }
}

/// `D_i = Σ_x dO_ix · O_ix` for every row, laid out like `lse`.
pub(super) fn row_deltas<T: Element>(
    g: &Geometry<'_>,
    out: (&[T], RowLayout),
    dout: (&[T], RowLayout),
) -> Result<Vec<f32>> {
    let mut delta = try_vec("D", g.lse_len(), 0.0f32)?;
    let sink = Sink::new(&mut delta);
    let pairs: Vec<(usize, usize)> = (0..g.seqs.len()).flat_map(|s| (0..g.hq).map(move |h| (s, h))).collect();
    super::for_each_dynamic(
        &pairs,
        || (),
        |_, &(s, h)| {
            let seq = &g.seqs[s];
            for i in 0..seq.sq {
                let (o, d_o) = (out.1.row(seq, seq.q_start, i, h), dout.1.row(seq, seq.q_start, i, h));
                let sum = dot_f64(&out.0[o..o + g.dv], &dout.0[d_o..d_o + g.dv]) as f32;
                // SAFETY: (seq, h, i) is visited by this pair alone; lse_index is in bounds.
                unsafe { sink.write(g.lse_index(seq, h, i), sum) };
            }
        },
    );
    Ok(delta)
}

/// `Σ a_x · b_x` accumulated in `f64` (D is subtracted from dP, and its rounding lands on every
/// dS): eight lane sums, which vectorise, combined in a fixed order, then the tail.
fn dot_f64<T: Element>(a: &[T], b: &[T]) -> f64 {
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f64 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x.to_f64() * y.to_f64()).sum();
    let mut lanes = [0.0f64; 8];
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            lanes[i] += x[i].to_f64() * y[i].to_f64();
        }
    }
    lanes.iter().sum::<f64>() + tail
}
