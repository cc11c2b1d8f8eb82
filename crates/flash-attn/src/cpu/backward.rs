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

use rayon::prelude::*;

use super::blocking::Tiles;
use super::gemm::{gemm, gemm_ta};
use super::tile::{load_rows, rows_f32, score_tile, transpose, QkOperands, ScoreMod};
use super::vexp::exp_sub_sum;
use super::Sink;
use crate::dtype::Element;
use crate::error::{try_vec, Result};
use crate::mask::TileClass;
use crate::philox::DropoutRng;
use crate::spec::{Geometry, RowLayout, Sequence};

/// Units of work we aim for, independent of the thread count (so is the result).
const MIN_UNITS: usize = 16;

/// Chunks of key/value tiles per `(sequence, kv head)`: enough units to occupy a machine when
/// `batch · hk` is small, and one otherwise.
pub(super) fn chunks(g: &Geometry<'_>, bc: usize) -> usize {
    let pairs = (g.seqs.len() * g.hk).max(1);
    let max_tiles = g.max_sk.div_ceil(bc).max(1);
    MIN_UNITS.div_ceil(pairs).clamp(1, max_tiles)
}

/// Per-thread scratch of the backward loop: `O(Br·(d + dv) + Br·Bc + Bc·(d + dv))` floats.
pub(super) struct Scratch {
    q: Vec<f32>,
    dout: Vec<f32>,
    lse: Vec<f32>,
    delta: Vec<f32>,
    s: Vec<f32>,
    dp: Vec<f32>,
    tanh: Vec<f32>,
    keep: Vec<f32>,
    p_dropped: Vec<f32>,
    k: Vec<f32>,
    kt: Vec<f32>,
    v: Vec<f32>,
    vt: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

impl Scratch {
    pub(super) fn new(g: &Geometry<'_>, t: Tiles) -> Self {
        let (d, dv) = (g.d, g.dv);
        Self {
            q: vec![0.0; t.br * d],
            dout: vec![0.0; t.br * dv],
            lse: vec![0.0; t.br],
            delta: vec![0.0; t.br],
            s: vec![0.0; t.br * t.bc],
            dp: vec![0.0; t.br * t.bc],
            tanh: if g.softcap.is_some() { vec![0.0; t.br * t.bc] } else { Vec::new() },
            keep: if g.dropout.is_some() { vec![0.0; t.br * t.bc] } else { Vec::new() },
            p_dropped: if g.dropout.is_some() { vec![0.0; t.br * t.bc] } else { Vec::new() },
            k: vec![0.0; t.bc * d],
            kt: vec![0.0; d * t.bc],
            v: vec![0.0; t.bc * dv],
            vt: vec![0.0; dv * t.bc],
            dk: vec![0.0; t.bc * d],
            dv: vec![0.0; t.bc * dv],
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
        for jt in (chunk * per_chunk)..((chunk + 1) * per_chunk).min(n_tiles) {
            let cols = jt * bc..((jt + 1) * bc).min(seq.sk);
            let nc = cols.len();
            load_rows(&mut sc.k, self.k, g.k, seq, seq.k_start, cols.clone(), kv_head, d, 1.0);
            transpose(&mut sc.kt, bc, &sc.k, d, nc, d);
            load_rows(&mut sc.v, self.v, g.v, seq, seq.k_start, cols.clone(), kv_head, dv, 1.0);
            transpose(&mut sc.vt, bc, &sc.v, dv, nc, dv);
            sc.dk[..nc * d].fill(0.0);
            sc.dv[..nc * dv].fill(0.0);
            for head in kv_head * group..(kv_head + 1) * group {
                for it in 0..seq.sq.div_ceil(br) {
                    let rows = it * br..((it + 1) * br).min(seq.sq);
                    self.tile(sc, seq, head, rows, cols.clone(), chunk);
                }
            }
            // dK_j = scale · Σ dSᵀ Q; dV_j = Σ P'ᵀ dO: write this tile's rows.
            sc.dk[..nc * d].iter_mut().for_each(|x| *x *= g.scale);
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
        chunk: usize,
    ) {
        let g = self.g;
        let vis = g.visibility(seq, head);
        let class = vis.classify(rows.clone(), cols.clone());
        if class == TileClass::Skip {
            return;
        }
        let bc = self.tiles.bc;
        let (d, dv) = (g.d, g.dv);
        let (nr, nc) = (rows.len(), cols.len());
        let smod = ScoreMod::new(g, seq, head);

        let (q, ldq) = rows_f32(&mut sc.q, self.q, g.q, seq, seq.q_start, rows.clone(), head, d);
        let (dout, ldo) = rows_f32(&mut sc.dout, self.dout, self.dout_layout, seq, seq.q_start, rows.clone(), head, dv);
        for (r, i) in rows.clone().enumerate() {
            let li = g.lse_index(seq, head, i);
            sc.lse[r] = self.lse[li];
            sc.delta[r] = self.delta[li];
        }

        // Recompute S_ij and P_ij = exp(S_ij - L_i) from the saved LSE.
        let tanh = smod.has_softcap().then_some(&mut sc.tanh[..]);
        let qk = QkOperands::F32 { q, ldq, kt: &sc.kt };
        score_tile(&mut sc.s, bc, (qk, false), d, rows.clone(), cols.clone(), smod, class, &vis, tanh);
        for r in 0..nr {
            let lse = sc.lse[r];
            let row = &mut sc.s[r * bc..r * bc + nc];
            if lse == f32::NEG_INFINITY {
                row.fill(0.0); // a row that sees no key has no gradient
            } else {
                exp_sub_sum(row, lse);
            }
        }
        // dP_ij = dO_i V_jᵀ.
        gemm(&mut sc.dp, bc, dout, ldo, &sc.vt, bc, (nr, nc, dv), false);

        // Dropout: dV uses P' = P ∘ keep/(1-p), and dP = dP' ∘ keep/(1-p).
        if let Some(dr) = g.dropout {
            let rng = DropoutRng::new(dr.p, dr.seed, dr.offset);
            for (r, i) in rows.clone().enumerate() {
                let row = r * bc..r * bc + nc;
                let keep = &mut sc.keep[row.clone()];
                keep.fill(1.0);
                rng.apply_row(seq.batch, head, g.hq, i, cols.start, rng.scale(), keep);
                for ((pd, &p), &f) in sc.p_dropped[row.clone()].iter_mut().zip(&sc.s[row.clone()]).zip(&*keep) {
                    *pd = p * f;
                }
                sc.dp[row].iter_mut().zip(&*keep).for_each(|(dp, &f)| *dp *= f);
            }
        }
        let p = if g.dropout.is_some() { &sc.p_dropped } else { &sc.s };
        gemm_ta(&mut sc.dv, dv, p, bc, dout, ldo, (nc, dv, nr), true);

        // dS_ij = P_ij ∘ (dP_ij - D_i), through the softcap: ∘ (1 - tanh²).
        for r in 0..nr {
            let delta = sc.delta[r];
            let (p, dp) = (&mut sc.s[r * bc..r * bc + nc], &sc.dp[r * bc..r * bc + nc]);
            for (pi, &dpi) in p.iter_mut().zip(dp) {
                *pi *= dpi - delta;
            }
            if smod.has_softcap() {
                for (pi, &t) in p.iter_mut().zip(&sc.tanh[r * bc..r * bc + nc]) {
                    *pi *= 1.0 - t * t;
                }
            }
        }
        // dK_j += dSᵀ Q_i (scaled when written); dQ_i += scale · dS K_j into this chunk's partial.
        gemm_ta(&mut sc.dk, d, &sc.s, bc, q, ldq, (nc, d, nr), true);
        for r in 0..nr {
            sc.s[r * bc..r * bc + nc].iter_mut().for_each(|x| *x *= g.scale);
        }
        let at = self.dq_index(chunk, head, g.q_token(seq, rows.start));
        // SAFETY: the partial rows of (chunk, head, tokens of `rows`) are touched only by the unit
        // of (sequence, kv_head(head), chunk), which runs on one thread; tokens of one sequence
        // are consecutive, and the buffer holds chunks · hq · total_q · d floats.
        let dq = unsafe { self.dq_acc.slice_mut(at, nr * d) };
        gemm(dq, d, &sc.s, bc, &sc.k, d, (nr, d, nc), true);
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
    pairs.par_iter().for_each(|&(s, h)| {
        let seq = &g.seqs[s];
        for i in 0..seq.sq {
            let (o, d_o) = (out.1.row(seq, seq.q_start, i, h), dout.1.row(seq, seq.q_start, i, h));
            // Accumulated in f64: D is subtracted from dP, and its rounding lands on every dS.
            let sum: f64 = (0..g.dv).map(|x| out.0[o + x].to_f64() * dout.0[d_o + x].to_f64()).sum();
            let sum = sum as f32;
            // SAFETY: (seq, h, i) is visited by this pair alone; lse_index is in bounds.
            unsafe { sink.write(g.lse_index(seq, h, i), sum) };
        }
    });
    Ok(delta)
}
