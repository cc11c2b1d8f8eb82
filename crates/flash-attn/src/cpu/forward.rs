//! The forward loop over one query tile: Algorithm 1 with FlashAttention-2's loop order (the
//! query tile stays put, key/value tiles stream past it).

use std::f32::consts::LOG2_E;

use super::blocking::Tiles;
use super::kernels;
use super::softmax::OnlineSoftmax;
use super::Sink;
use crate::dtype::Element;
use crate::mask::{TileClass, Visibility};
use crate::spec::{Geometry, RowLayout, Sequence};

/// Per-thread scratch: one query tile, one key/value tile, one score tile, one output
/// accumulator. `O(Br·d + Bc·(d + dv) + Br·Bc + Br·dv)`, independent of sequence length.
pub(super) struct Scratch {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
    o: Vec<f32>,
    softmax: OnlineSoftmax,
}

impl Scratch {
    pub(super) fn new(g: &Geometry<'_>, t: Tiles) -> Self {
        Self {
            q: vec![0.0; t.br * g.d],
            k: vec![0.0; t.bc * g.d],
            v: vec![0.0; t.bc * g.dv],
            s: vec![0.0; t.br * t.bc],
            o: vec![0.0; t.br * g.dv],
            softmax: OnlineSoftmax::default(),
        }
    }
}

/// Everything the query tiles of one call share.
pub(super) struct Context<'a, T> {
    pub g: &'a Geometry<'a>,
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub out: &'a Sink<T>,
    pub out_layout: RowLayout,
    pub lse: &'a Sink<f32>,
    pub tiles: Tiles,
}

/// How raw dot products become base-2 scores (DESIGN §2 steps 1-3, with `log2 e` folded in).
#[derive(Clone, Copy)]
struct ScoreMod {
    /// Multiplies `q` when it is loaded.
    q_mult: f32,
    /// Softcap: `s = cap2 · tanh(dot)` with `cap2 = c · log2 e` (the `scale / c` is in `q_mult`).
    cap2: Option<f32>,
    /// ALiBi slope in base-2 units.
    slope2: Option<f32>,
}

impl<T: Element> Context<'_, T> {
    /// Computes rows `tile·Br ..` of query head `head` of sequence `seq` and writes them out.
    pub(super) fn query_tile(&self, sc: &mut Scratch, seq: usize, head: usize, tile: usize) {
        let g = self.g;
        let seq = &g.seqs[seq];
        let Tiles { br, bc } = self.tiles;
        let (d, dv) = (g.d, g.dv);
        let r0 = tile * br;
        let rows = r0..(r0 + br).min(seq.sq);
        let nr = rows.len();
        let kv_head = g.kv_head(head);
        let vis = g.visibility(seq, head);
        let smod = match g.softcap {
            Some(c) => ScoreMod { q_mult: g.scale / c, cap2: Some(c * LOG2_E), slope2: None },
            None => ScoreMod { q_mult: g.scale * LOG2_E, cap2: None, slope2: None },
        };
        let smod = ScoreMod { slope2: g.alibi_slope(seq, head).map(|m| m * LOG2_E), ..smod };

        // Load Q_i (Algorithm 1, line 8), scaled; zero O_i, m_i = -inf, l_i = 0.
        for r in 0..nr {
            let src = g.q.row(seq, seq.q_start, r0 + r, head);
            for (dst, x) in sc.q[r * d..(r + 1) * d].iter_mut().zip(&self.q[src..src + d]) {
                *dst = x.to_f32() * smod.q_mult;
            }
        }
        sc.o[..nr * dv].fill(0.0);
        sc.softmax.reset(nr);

        // Loop over the key/value tiles this query tile can see (line 5, FA2 order). Tiles are
        // aligned to multiples of Bc, so a row's result does not depend on which rows share its
        // query tile (hence not on Br, nor on the thread count).
        let keys = vis.key_range(rows.clone());
        let mut c0 = keys.start / bc * bc;
        while c0 < keys.end {
            let cols = c0..(c0 + bc).min(keys.end);
            c0 = cols.end;
            let class = vis.classify(rows.clone(), cols.clone());
            if class == TileClass::Skip {
                continue;
            }
            let nc = cols.len();
            self.load_kv(sc, seq, kv_head, cols.start, nc);
            // S_ij = Q_i K_jᵀ (line 9), score modifiers, mask on Partial tiles only.
            kernels::scores(&sc.q, &sc.k, &mut sc.s, nr, nc, d, bc);
            apply_score_mods(&mut sc.s, bc, rows.clone(), cols.clone(), seq, smod);
            if class == TileClass::Partial {
                apply_mask(&mut sc.s, bc, rows.clone(), cols, &vis);
            }
            // m, l, P and the rescale of O (lines 10-12), then O_i += P_ij V_j.
            sc.softmax.update(&mut sc.s, bc, nc, &mut sc.o, dv);
            kernels::accumulate_pv(&sc.s, &sc.v, &mut sc.o, nr, nc, dv, bc);
        }

        // One final normalisation (FA2), then write O_i and L_i (lines 12-13).
        for r in 0..nr {
            let i = r0 + r;
            let dst = self.out_layout.row(seq, seq.q_start, i, head);
            let (inv, lse) = sc.softmax.finish(r).unwrap_or((0.0, f32::NEG_INFINITY));
            for (x, &o) in sc.o[r * dv..(r + 1) * dv].iter().enumerate() {
                // SAFETY: (seq, head, i) is owned by this work item alone; `dst + x` lies inside
                // the validated, non-overlapping `out` view.
                unsafe { self.out.write(dst + x, T::from_f32(o * inv)) };
            }
            // SAFETY: as above, for the lse entry of (seq, head, i).
            unsafe { self.lse.write(g.lse_index(seq, head, i), lse) };
        }
    }

    /// Copies (and widens) K_j and V_j, keys `c0 .. c0 + n` of `kv_head`, into scratch.
    fn load_kv(&self, sc: &mut Scratch, seq: &Sequence, kv_head: usize, c0: usize, n: usize) {
        let g = self.g;
        let (d, dv) = (g.d, g.dv);
        for c in 0..n {
            let ks = g.k.row(seq, seq.k_start, c0 + c, kv_head);
            for (dst, x) in sc.k[c * d..(c + 1) * d].iter_mut().zip(&self.k[ks..ks + d]) {
                *dst = x.to_f32();
            }
            let vs = g.v.row(seq, seq.k_start, c0 + c, kv_head);
            for (dst, x) in sc.v[c * dv..(c + 1) * dv].iter_mut().zip(&self.v[vs..vs + dv]) {
                *dst = x.to_f32();
            }
        }
    }
}

/// Softcap and ALiBi on a score tile (rows of stride `ld`).
fn apply_score_mods(
    s: &mut [f32],
    ld: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    seq: &Sequence,
    m: ScoreMod,
) {
    if m.cap2.is_none() && m.slope2.is_none() {
        return;
    }
    let off = seq.offset();
    for (r, i) in rows.enumerate() {
        let row = &mut s[r * ld..r * ld + cols.len()];
        if let Some(cap2) = m.cap2 {
            for x in row.iter_mut() {
                *x = cap2 * x.tanh();
            }
        }
        if let Some(slope2) = m.slope2 {
            for (x, j) in row.iter_mut().zip(cols.clone()) {
                *x -= slope2 * (i as i64 + off - j as i64).unsigned_abs() as f32;
            }
        }
    }
}

/// Sets invisible scores of a Partial tile to `-inf`.
fn apply_mask(
    s: &mut [f32],
    ld: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    vis: &Visibility<'_>,
) {
    for (r, i) in rows.enumerate() {
        let span = vis.span(i);
        let row = &mut s[r * ld..r * ld + cols.len()];
        for (x, j) in row.iter_mut().zip(cols.clone()) {
            if !span.contains(&j) || !vis.block_visible(i, j) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}
