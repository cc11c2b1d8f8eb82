//! The one mask module: which keys a query sees, and which tiles of the score matrix need work.
//!
//! Causal (both alignments), sliding windows, block-sparse masks and varlen boundaries are one
//! mechanism (DESIGN §3): a visibility predicate per `(sequence, head)` plus a classification of
//! each `rows × cols` tile as [`TileClass::Skip`] (nothing visible: the tile costs nothing),
//! [`TileClass::Full`] (everything visible: the predicate is never evaluated) or
//! [`TileClass::Partial`]. The oracle, the CPU kernels, and later the GPU launchers and the IO
//! model all ask this module.
//!
//! Varlen needs no rule here: a sequence's queries and keys are sliced out before any tile is
//! formed, so `i` and `j` are always positions inside one sequence.

use std::ops::Range;

use crate::spec::{Causal, Geometry, Sequence};

/// What a tile of the score matrix needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileClass {
    /// No visible `(i, j)`: skip the tile entirely.
    Skip,
    /// Some visible, some not: evaluate the predicate per element.
    Partial,
    /// Every `(i, j)` visible: no predicate needed.
    Full,
}

/// One `(batch, head)` plane of a block-sparse mask.
#[derive(Debug, Clone, Copy)]
struct BlockPlane<'a> {
    data: &'a [u8],
    base: usize,
    row_stride: usize,
    col_stride: usize,
    block_q: usize,
    block_k: usize,
}

impl BlockPlane<'_> {
    #[inline]
    fn block(&self, bi: usize, bj: usize) -> bool {
        self.data[self.base + bi * self.row_stride + bj * self.col_stride] != 0
    }
}

/// The visibility rule of one `(sequence, head)`.
#[derive(Debug, Clone, Copy)]
pub struct Visibility<'a> {
    sq: usize,
    sk: usize,
    off: i64,
    causal: Causal,
    window: Option<(i64, i64)>,
    block: Option<BlockPlane<'a>>,
}

impl<'a> Geometry<'a> {
    /// The visibility rule of query head `h` of `seq`.
    pub fn visibility(&self, seq: &Sequence, h: usize) -> Visibility<'a> {
        let block = self.block.map(|b| BlockPlane {
            data: b.data,
            base: seq.batch * b.strides[0] + h * b.strides[1],
            row_stride: b.strides[2],
            col_stride: b.strides[3],
            block_q: b.block_q,
            block_k: b.block_k,
        });
        Visibility { sq: seq.sq, sk: seq.sk, off: seq.offset(), causal: self.causal, window: self.window, block }
    }
}

impl Visibility<'_> {
    /// A rule with only interval constraints (no block mask), for a `sq × sk` score matrix.
    pub fn new(sq: usize, sk: usize, causal: Causal, window: Option<(i64, i64)>) -> Self {
        Self { sq, sk, off: sk as i64 - sq as i64, causal, window, block: None }
    }

    /// Keys that the causal and window rules leave visible to query `i`: a half-open range
    /// inside `0..sk`, possibly empty. Both ends are non-decreasing in `i`.
    #[inline]
    pub fn span(&self, i: usize) -> Range<usize> {
        let i = i as i64;
        let pos = i + self.off;
        let sk = self.sk as i64;
        let (mut lo, mut hi) = (0i64, sk);
        match self.causal {
            Causal::None => {}
            Causal::BottomRight => hi = hi.min(pos + 1),
            Causal::TopLeft => hi = hi.min(i + 1),
        }
        if let Some((left, right)) = self.window {
            if left >= 0 {
                lo = lo.max(pos.saturating_sub(left));
            }
            if right >= 0 {
                hi = hi.min(pos.saturating_add(right).saturating_add(1));
            }
        }
        let lo = lo.clamp(0, sk);
        let hi = hi.clamp(lo, sk);
        lo as usize..hi as usize
    }

    /// Whether the block-sparse mask (if any) shows key `j` to query `i`.
    #[inline]
    pub fn block_visible(&self, i: usize, j: usize) -> bool {
        self.block.is_none_or(|b| b.block(i / b.block_q, j / b.block_k))
    }

    /// Whether a block mask is present (Partial tiles then check it per element).
    #[inline]
    pub fn has_block_mask(&self) -> bool {
        self.block.is_some()
    }

    /// The full predicate: does query `i` see key `j`?
    #[inline]
    pub fn visible(&self, i: usize, j: usize) -> bool {
        self.span(i).contains(&j) && self.block_visible(i, j)
    }

    /// Keys that any of `rows` may see: the loop bound of a query tile's key/value loop, so that
    /// tiles outside it are never even visited.
    pub fn key_range(&self, rows: Range<usize>) -> Range<usize> {
        if rows.is_empty() {
            return 0..0;
        }
        let first = self.span(rows.start);
        let last = self.span(rows.end - 1);
        first.start..last.end.max(first.start)
    }

    /// Classifies the tile `rows × cols`.
    ///
    /// Exact for the interval rules; for the block mask it is exact when the tile's blocks are all
    /// on or all off, and says `Partial` otherwise (always safe: `Partial` applies the predicate).
    pub fn classify(&self, rows: Range<usize>, cols: Range<usize>) -> TileClass {
        let rows = rows.start..rows.end.min(self.sq);
        let cols = cols.start..cols.end.min(self.sk);
        if rows.is_empty() || cols.is_empty() {
            return TileClass::Skip;
        }
        let (mut any, mut full) = (false, true);
        for i in rows.clone() {
            let s = self.span(i);
            any |= s.start.max(cols.start) < s.end.min(cols.end);
            full &= s.start <= cols.start && s.end >= cols.end;
        }
        if !any {
            return TileClass::Skip;
        }
        if let Some(b) = &self.block {
            let (mut any_on, mut all_on) = (false, true);
            for bi in rows.start / b.block_q..=(rows.end - 1) / b.block_q {
                for bj in cols.start / b.block_k..=(cols.end - 1) / b.block_k {
                    let on = b.block(bi, bj);
                    any_on |= on;
                    all_on &= on;
                }
            }
            if !any_on {
                return TileClass::Skip;
            }
            full &= all_on;
        }
        if full {
            TileClass::Full
        } else {
            TileClass::Partial
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn brute(v: &Visibility<'_>, rows: Range<usize>, cols: Range<usize>) -> (bool, bool) {
        let mut any = false;
        let mut all = true;
        for i in rows {
            for j in cols.clone() {
                let vis = v.visible(i, j);
                any |= vis;
                all &= vis;
            }
        }
        (any, all)
    }

    #[test]
    fn classification_agrees_with_the_predicate_for_interval_rules() {
        let causals = [Causal::None, Causal::BottomRight, Causal::TopLeft];
        let windows = [None, Some((3, 0)), Some((-1, 2)), Some((0, -1)), Some((5, 5))];
        for (sq, sk) in [(1, 1), (7, 13), (13, 7), (16, 16), (5, 40)] {
            for causal in causals {
                for window in windows {
                    let v = Visibility::new(sq, sk, causal, window);
                    for r0 in (0..sq).step_by(3) {
                        for c0 in (0..sk).step_by(4) {
                            let rows = r0..(r0 + 3).min(sq);
                            let cols = c0..(c0 + 4).min(sk);
                            let (any, all) = brute(&v, rows.clone(), cols.clone());
                            let want = if !any {
                                TileClass::Skip
                            } else if all {
                                TileClass::Full
                            } else {
                                TileClass::Partial
                            };
                            assert_eq!(v.classify(rows, cols), want, "{sq}x{sk} {causal:?} {window:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn key_range_covers_every_visible_key() {
        for (sq, sk) in [(9, 30), (30, 9), (12, 12)] {
            for window in [None, Some((2, 1)), Some((-1, 0))] {
                let v = Visibility::new(sq, sk, Causal::BottomRight, window);
                for r0 in (0..sq).step_by(4) {
                    let rows = r0..(r0 + 4).min(sq);
                    let kr = v.key_range(rows.clone());
                    for i in rows {
                        for j in 0..sk {
                            if v.visible(i, j) {
                                assert!(kr.contains(&j));
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bottom_right_causal_hides_leading_rows_when_queries_outnumber_keys() {
        let v = Visibility::new(5, 2, Causal::BottomRight, None);
        assert!(v.span(0).is_empty());
        assert!(v.span(2).is_empty());
        assert_eq!(v.span(3), 0..1);
        assert_eq!(v.span(4), 0..2);
    }
}
