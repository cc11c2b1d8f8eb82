//! Per-tile steps shared by the forward and backward loops: loading rows, and turning `Q_i K_jᵀ`
//! into the scores of DESIGN §2 steps 1-4 (natural units).

use std::ops::Range;

use super::gemm::{gemm_b, gemm_bf16, BLayout, Bf16Pair, PANEL_WIDTH};
use super::isa::Isa;
use super::lines::LineVec;
use super::pairs::widen;
use super::transpose::transpose;
use super::vexp::scale_row;
use crate::dtype::Element;
use crate::mask::{TileClass, Visibility};
use crate::spec::{Geometry, RowLayout, Sequence};

/// How raw dot products become scores.
#[derive(Debug, Clone, Copy)]
pub(super) struct ScoreMod {
    /// Multiplies `q · k`: `scale`, or `scale / c` with a softcap.
    pub q_mult: f32,
    /// Softcap `c`: `s = c · tanh(q_mult · q · k)`.
    cap: Option<f32>,
    /// ALiBi slope.
    slope: Option<f32>,
    /// `sk - sq` of the sequence.
    off: i64,
}

impl ScoreMod {
    pub fn new(g: &Geometry<'_>, seq: &Sequence, head: usize) -> Self {
        let q_mult = match g.softcap {
            Some(c) => g.scale / c,
            None => g.scale,
        };
        ScoreMod { q_mult, cap: g.softcap, slope: g.alibi_slope(seq, head), off: seq.offset() }
    }

    /// The scale, when it is the only modifier and positive: the forward pass then leaves the
    /// score tile unscaled and folds the scale into the softmax's exponent (one pass fewer).
    pub fn deferrable_scale(&self) -> Option<f32> {
        (self.cap.is_none() && self.slope.is_none() && self.q_mult > 0.0 && self.q_mult.is_finite())
            .then_some(self.q_mult)
    }

    /// Whether a softcap is applied (the backward pass then needs `tanh` of each score).
    pub fn has_softcap(&self) -> bool {
        self.cap.is_some()
    }
}

/// Copies rows `rows` of head `head` (tokens from `start`) into `dst` (row stride `ld_dst`), widened
/// to `f32` ([`widen`], on `isa`).
#[allow(clippy::too_many_arguments)]
pub(super) fn load_rows<T: Element>(
    isa: Isa,
    dst: &mut [f32],
    ld_dst: usize,
    src: &[T],
    layout: RowLayout,
    seq: &Sequence,
    start: usize,
    rows: Range<usize>,
    head: usize,
    dim: usize,
) {
    for (r, i) in rows.enumerate() {
        let at = layout.row(seq, start, i, head);
        widen(isa, &src[at..at + dim], &mut dst[r * ld_dst..r * ld_dst + dim]);
    }
}

/// Rows per panel when a Partial tile is computed panel by panel (a multiple of the GEMM's
/// register tile).
pub(super) const PANEL: usize = 32;

/// The row panels of a Partial tile `rows × cols`: for each panel, its first row (relative to
/// `rows.start`) and the columns (relative to `cols.start`) that any of its rows can see by the
/// interval rules. Spans are monotone, so the panel's first and last rows bound them; a block mask
/// only removes keys from these, so they stay a superset of the visible ones.
pub(super) fn panels<'v>(
    vis: &'v Visibility<'_>,
    rows: Range<usize>,
    cols: Range<usize>,
) -> impl Iterator<Item = (usize, Range<usize>)> + 'v {
    (0..rows.len()).step_by(PANEL).map(move |p0| {
        let first = rows.start + p0;
        let last = (first + PANEL).min(rows.end) - 1;
        let keys = vis.key_range(first..last + 1);
        let lo = keys.start.clamp(cols.start, cols.end) - cols.start;
        let hi = keys.end.clamp(cols.start, cols.end) - cols.start;
        (p0, lo..hi.max(lo))
    })
}

/// Rows `rows` of head `head` as an `f32` matrix `(data, row stride)`: read in place when the input
/// is `f32` and its rows do not overlap, otherwise widened into `buf` (row stride `dim`), which
/// grows on first use (so `f32` inputs never allocate or zero it).
#[allow(clippy::too_many_arguments)]
pub(super) fn rows_f32<'s, T: Element>(
    isa: Isa,
    buf: &'s mut LineVec<f32>,
    src: &'s [T],
    layout: RowLayout,
    seq: &Sequence,
    start: usize,
    rows: Range<usize>,
    head: usize,
    dim: usize,
) -> (&'s [f32], usize) {
    let ld = layout.token_stride;
    if let (Some(src), false) = (T::as_f32(src), rows.is_empty()) {
        if ld >= dim {
            let at = layout.row(seq, start, rows.start, head);
            return (&src[at..at + (rows.len() - 1) * ld + dim], ld);
        }
    }
    if buf.len() < rows.len() * dim {
        buf.resize(rows.len() * dim, 0.0);
    }
    load_rows(isa, buf, dim, src, layout, seq, start, rows, head, dim);
    (buf, dim)
}

/// The operands of `S = Q Kᵀ` for one tile: `Q` (row stride `ldq`) and the packed `Kᵀ`, in `f32`
/// (`Kᵀ` in [`BLayout::panels`] of `d` rows) or as `bf16` pairs along the head dim (`Kᵀ` at the
/// score tile's row stride).
#[derive(Clone, Copy)]
pub(super) enum QkOperands<'a> {
    F32 { q: &'a [f32], ldq: usize, kt: &'a [f32] },
    Bf16Pairs { q: &'a [Bf16Pair], ldq: usize, kt: &'a [Bf16Pair] },
}

impl QkOperands<'_> {
    /// The first column a product may start at, for keys from `c`: on `f32`, a panel's first
    /// column (the columns before `c` are then computed too), else `c`.
    fn first_column(&self, c: usize) -> usize {
        match *self {
            QkOperands::F32 { .. } => c / PANEL_WIDTH * PANEL_WIDTH,
            QkOperands::Bf16Pairs { .. } => c,
        }
    }

    /// `s[r][c] = q[r0 + r] · k[c0 + c]` for `n` rows and `nc` columns (`c0` from
    /// [`Self::first_column`]); `ld` is the row stride of `s` (and of `Kᵀ` on pairs).
    #[allow(clippy::too_many_arguments)]
    fn product(&self, isa: Isa, s: &mut [f32], ld: usize, r0: usize, c0: usize, (n, nc, d): (usize, usize, usize)) {
        match *self {
            QkOperands::F32 { q, ldq, kt } => {
                let bl = BLayout::panels(d);
                gemm_b(isa, s, ld, &q[r0 * ldq..], ldq, &kt[bl.index(0, c0)..], bl, (n, nc, d), false)
            }
            QkOperands::Bf16Pairs { q, ldq, kt } => {
                gemm_bf16(isa, s, ld, &q[r0 * ldq..], ldq, &kt[c0..], ld, (n, nc, d.div_ceil(2)), false)
            }
        }
    }
}

/// The score tile of `rows × cols` (rows of stride `ld` in `s`): `S = Q Kᵀ` from the operands
/// (`Q` already multiplied by `q_mult` — or the scale left to the caller — when `q_scaled`, else
/// the product is), then softcap (its
/// `tanh` values kept in `tanh` when given), ALiBi, and the mask on Partial tiles.
#[allow(clippy::too_many_arguments)]
pub(super) fn score_tile(
    isa: Isa,
    s: &mut [f32],
    ld: usize,
    (qk, q_scaled): (QkOperands<'_>, bool),
    d: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    m: ScoreMod,
    class: TileClass,
    vis: &Visibility<'_>,
    mut tanh: Option<&mut [f32]>,
) {
    let nc = cols.len();
    // On AMX tiles a Partial tile is multiplied whole: one call instead of one per panel (each
    // call configures the tile registers), and a column's dot product does not depend on which
    // columns share the call.
    let whole = isa.amx() && matches!(qk, QkOperands::Bf16Pairs { .. });
    if class == TileClass::Partial && !whole {
        // Only the columns some row of each panel can see: on a causal diagonal about half.
        for (p0, keys) in panels(vis, rows.clone(), cols.clone()) {
            let n = (p0 + PANEL).min(rows.len()) - p0;
            // Columns outside the panel's keys are invisible (the mask below sets them to -inf)
            // and zeroed after the product, so the score modifiers never see stale values (nor
            // the products an `f32` product computes from its `Kᵀ` panel's first column).
            if !keys.is_empty() {
                let c0 = qk.first_column(keys.start);
                qk.product(isa, &mut s[p0 * ld + c0..], ld, p0, c0, (n, keys.end - c0, d));
            }
            for r in p0..p0 + n {
                s[r * ld..r * ld + keys.start].fill(0.0);
                s[r * ld + keys.end..r * ld + nc].fill(0.0);
            }
        }
    } else {
        qk.product(isa, s, ld, 0, 0, (rows.len(), nc, d));
    }
    for (r, i) in rows.enumerate() {
        let row = &mut s[r * ld..r * ld + nc];
        if !q_scaled {
            scale_row(isa, row, m.q_mult);
        }
        if let Some(cap) = m.cap {
            let t_row = tanh.as_deref_mut().map(|t| &mut t[r * ld..r * ld + nc]);
            match t_row {
                Some(t_row) => {
                    for (x, t) in row.iter_mut().zip(t_row) {
                        *t = x.tanh();
                        *x = cap * *t;
                    }
                }
                None => row.iter_mut().for_each(|x| *x = cap * x.tanh()),
            }
        }
        if let Some(slope) = m.slope {
            for (x, j) in row.iter_mut().zip(cols.clone()) {
                *x -= slope * (i as i64 + m.off - j as i64).unsigned_abs() as f32;
            }
        }
        if class == TileClass::Partial {
            // The row's span is an interval: two fills outside it; a block mask, if any, key by
            // key inside it.
            let span = vis.span(i);
            let lo = span.start.clamp(cols.start, cols.end) - cols.start;
            let hi = (span.end.clamp(cols.start, cols.end) - cols.start).max(lo);
            row[..lo].fill(f32::NEG_INFINITY);
            row[hi..].fill(f32::NEG_INFINITY);
            if vis.has_block_mask() {
                for (x, j) in row[lo..hi].iter_mut().zip(cols.start + lo..) {
                    if !vis.block_visible(i, j) {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
}

/// Copies `n` rows of `width` elements (`src`, row stride `ld`) into `dst` in [`BLayout::panels`]
/// of `rows` rows (a `B` operand of `n ≤ rows` rows and `width` columns).
pub(super) fn pack_panels(dst: &mut [f32], rows: usize, src: &[f32], ld: usize, n: usize, width: usize) {
    let bl = BLayout::panels(rows);
    for r in 0..n {
        for j0 in (0..width).step_by(PANEL_WIDTH) {
            let w = (width - j0).min(PANEL_WIDTH);
            let at = bl.index(r, j0);
            dst[at..at + w].copy_from_slice(&src[r * ld + j0..r * ld + j0 + w]);
        }
    }
}

/// The transpose of `n` rows of `width` elements (`src`, row stride `ld`) into `dst` in
/// [`BLayout::panels`] of `width` rows: a `B` operand of `width` rows and `n` columns (`Kᵀ` from
/// the rows of `K`), each panel the transpose of 16 rows.
pub(super) fn transpose_panels(isa: Isa, dst: &mut [f32], src: &[f32], ld: usize, n: usize, width: usize) {
    for (p, dst) in dst.chunks_mut(PANEL_WIDTH * width).take(n.div_ceil(PANEL_WIDTH)).enumerate() {
        let rows = (n - p * PANEL_WIDTH).min(PANEL_WIDTH);
        transpose(isa, dst, PANEL_WIDTH, &src[p * PANEL_WIDTH * ld..], ld, rows, width);
    }
}
