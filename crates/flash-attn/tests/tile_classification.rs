//! The mask module against brute force: `Visibility::visible` is DESIGN §2's rule, and
//! `Visibility::classify` never calls a tile `Skip` when a query in it sees a key, nor `Full`
//! when one does not; `key_range` covers every visible key. Block masks (`[qb, kb]` and
//! `[b, hq, qb, kb]`, any block size) and varlen sequences included; `mask.rs`'s own unit tests
//! cover the interval rules alone.

mod common;

use std::ops::Range;

use common::{config, design_visible};
use flash_attn::check::Case;
use flash_attn::mask::{TileClass, Visibility};
use flash_attn::{DType, Geometry};
use proptest::prelude::*;

/// Problems for the mask only: tiny head dims, every visibility option.
fn mask_cases() -> impl Strategy<Value = Case> {
    common::cases_with(80, Just((1, 1)), common::heads()).prop_map(|c| Case { dtype: DType::F32, ..c })
}

/// `(any visible, all visible)` over `rows × cols`.
fn brute(vis: &Visibility<'_>, rows: Range<usize>, cols: Range<usize>) -> (bool, bool) {
    let (mut any, mut all) = (false, true);
    for i in rows {
        for j in cols.clone() {
            let v = vis.visible(i, j);
            any |= v;
            all &= v;
        }
    }
    (any, all)
}

/// Calls `check(b, h, sq, sk, vis)` for every (sequence, head) of `case`.
fn for_each_plane(
    case: &Case,
    mut check: impl FnMut(usize, usize, (usize, usize), &Visibility<'_>) -> Result<(), TestCaseError>,
) -> Result<(), TestCaseError> {
    let data = case.data::<f32>();
    let spec = case.spec(&data);
    let [q, k, v] = data.views();
    let g: Geometry<'_> = spec.geometry(&q, &k, &v).expect("valid case");
    for seq in &g.seqs {
        for h in 0..g.hq {
            check(seq.batch, h, (seq.sq, seq.sk), &g.visibility(seq, h))?;
        }
    }
    Ok(())
}

/// The tiles of an `sq × sk` score matrix in `br × bc` tiles, the last ones ragged (and, as the
/// kernels may ask, reaching past the end).
fn tiles(sq: usize, sk: usize, br: usize, bc: usize) -> impl Iterator<Item = (Range<usize>, Range<usize>)> {
    (0..sq).step_by(br).flat_map(move |r0| (0..sk).step_by(bc).map(move |c0| (r0..r0 + br, c0..c0 + bc)))
}

fn clamp(r: &Range<usize>, n: usize) -> Range<usize> {
    r.start.min(n)..r.end.min(n)
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn visibility_follows_design_section_2(case in mask_cases()) {
        let data = case.data::<f32>();
        for_each_plane(&case, |b, h, (sq, sk), vis| {
            for i in 0..sq {
                for j in 0..sk {
                    let want = design_visible(&case, data.block_mask.as_ref(), b, h, (sq, sk), i, j);
                    prop_assert_eq!(vis.visible(i, j), want, "{} batch {} head {} ({}, {})", case, b, h, i, j);
                }
            }
            Ok(())
        })?;
    }

    #[test]
    fn classification_never_skips_a_visible_key_nor_calls_a_masked_tile_full(
        case in mask_cases(), br in 1usize..=40, bc in 1usize..=40,
    ) {
        for_each_plane(&case, |b, h, (sq, sk), vis| {
            for (rows, cols) in tiles(sq, sk, br, bc) {
                let (any, all) = brute(vis, clamp(&rows, sq), clamp(&cols, sk));
                let class = vis.classify(rows.clone(), cols.clone());
                let at = format!("{case} batch {b} head {h} tile {rows:?} x {cols:?}: {class:?}");
                prop_assert!(class != TileClass::Skip || !any, "{}, but a key is visible", at);
                prop_assert_eq!(class == TileClass::Full, all, "{}, all visible: {}", at, all);
            }
            Ok(())
        })?;
    }

    #[test]
    fn classification_is_exact_without_a_block_mask(case in mask_cases(), br in 1usize..=40, bc in 1usize..=40) {
        let case = Case { block: None, ..case };
        for_each_plane(&case, |b, h, (sq, sk), vis| {
            for (rows, cols) in tiles(sq, sk, br, bc) {
                let want = match brute(vis, clamp(&rows, sq), clamp(&cols, sk)) {
                    (false, _) => TileClass::Skip,
                    (true, true) => TileClass::Full,
                    (true, false) => TileClass::Partial,
                };
                prop_assert_eq!(vis.classify(rows.clone(), cols.clone()), want, "{} batch {} head {} tile {:?} x {:?}", case, b, h, rows, cols);
            }
            Ok(())
        })?;
    }

    /// Tiles that lie inside one mask block see the block as all on or all off.
    #[test]
    fn classification_is_exact_for_tiles_inside_one_mask_block(
        case in mask_cases(), block in common::block_case(), br in 1usize..=40, bc in 1usize..=40,
    ) {
        let case = Case { block: Some(block), ..case };
        let (br, bc) = (br.min(block.block_q), bc.min(block.block_k));
        for_each_plane(&case, |b, h, (sq, sk), vis| {
            for (rows, cols) in tiles(sq, sk, br, bc) {
                let (rows, cols) = (clamp(&rows, sq), clamp(&cols, sk));
                let one_block = rows.start / block.block_q == (rows.end - 1) / block.block_q
                    && cols.start / block.block_k == (cols.end - 1) / block.block_k;
                if !one_block {
                    continue;
                }
                let want = match brute(vis, rows.clone(), cols.clone()) {
                    (false, _) => TileClass::Skip,
                    (true, true) => TileClass::Full,
                    (true, false) => TileClass::Partial,
                };
                prop_assert_eq!(vis.classify(rows.clone(), cols.clone()), want, "{} batch {} head {} tile {:?} x {:?}", case, b, h, rows, cols);
            }
            Ok(())
        })?;
    }

    #[test]
    fn key_range_covers_every_visible_key(case in mask_cases(), br in 1usize..=40) {
        for_each_plane(&case, |b, h, (sq, sk), vis| {
            for r0 in (0..sq).step_by(br) {
                let rows = r0..(r0 + br).min(sq);
                let keys = vis.key_range(rows.clone());
                for i in rows.clone() {
                    for j in (0..sk).filter(|&j| vis.visible(i, j)) {
                        prop_assert!(keys.contains(&j), "{} batch {} head {} rows {:?}: key {} outside {:?}", case, b, h, rows, j, keys);
                    }
                }
            }
            Ok(())
        })?;
    }
}
