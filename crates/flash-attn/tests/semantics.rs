//! What attention computes (DESIGN §2, docs/semantics.md), behaviour by behaviour: the oracle
//! against an independent reading of §2, rows that see no key, empty batches, the equivalences
//! between options, and NaN/Inf inputs.

mod common;

use common::{config, design_visible, lse_index, packed, plain, report_on, rows, run_case, run_on, Run};
use flash_attn::check::{BlockCase, Case, CaseData, Storage};
use flash_attn::cpu::Tiles;
use flash_attn::{AttentionSpec, Causal, DType, Element, Tensor, TensorMut};
use proptest::prelude::*;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Tilings every dedicated test runs under: the backend's, one-element tiles, and odd sizes.
const TILINGS: [Option<Tiles>; 3] = [None, Some(Tiles { br: 1, bc: 1 }), Some(Tiles { br: 7, bc: 5 })];

/// Output row `(token t, head h)` of a run.
fn out_row<'a>(case: &Case, run: &'a Run, t: usize, h: usize) -> &'a [f32] {
    let at = (t * case.hq + h) * case.dv;
    &run.out[at..at + case.dv]
}

/// Asserts that exactly the rows `masked(b, h, i)` give `out = 0` and `lse = -inf`, every other
/// row a finite `lse`, and that the whole run meets the contract.
fn assert_masked_rows<T: Element>(case: &Case, data: &CaseData<T>, masked: impl Fn(usize, usize, usize) -> bool) {
    for tiles in TILINGS {
        let run = run_on(case, data, tiles);
        let mut seen = 0;
        for (b, t, i, _, _) in rows(case) {
            for h in 0..case.hq {
                let lse = run.lse[lse_index(case, b, t, i, h)];
                if masked(b, h, i) {
                    seen += 1;
                    assert!(out_row(case, &run, t, h).iter().all(|&x| x == 0.0), "{case}: row {t} head {h}");
                    assert_eq!(lse, f32::NEG_INFINITY, "{case}: row {t} head {h}");
                } else {
                    assert!(lse.is_finite(), "{case}: row {t} head {h} sees keys but has lse {lse}");
                }
            }
        }
        assert!(seen > 0, "{case}: the test must mask some row");
        let report = report_on(case, data, tiles);
        assert!(report.passed(), "{case} {tiles:?}: {report}");
    }
}

// ---------------------------------------------------------------------------------------------
// The oracle is DESIGN §2
// ---------------------------------------------------------------------------------------------

/// DESIGN §2 steps 1-7 (no dropout) in f64, written without `flash_attn::mask` or the oracle:
/// `(out [tokens, hq, dv], lse [b, hq, sq] | [hq, tq])`.
fn design_forward(case: &Case, data: &CaseData<f32>) -> (Vec<f64>, Vec<f64>) {
    let (hq, hk, d, dv) = (case.hq, case.hk, case.d, case.dv);
    let tq: usize = case.seqlens.iter().map(|s| s.0).sum();
    let lse_len = if case.varlen { hq * tq } else { case.seqlens.len() * hq * case.seqlens[0].0 };
    let mut out = vec![0.0f64; tq * hq * dv];
    let mut lse = vec![f64::NEG_INFINITY; lse_len];
    // Element `x` of token `t` (within batch entry `b`, or packed), head `h`.
    let at = |buf: &[f32], st: &[usize], b: usize, t: usize, h: usize, x: usize| -> f64 {
        let o = if case.varlen { t * st[0] + h * st[1] } else { b * st[0] + t * st[1] + h * st[2] };
        f64::from(buf[o + x])
    };
    let [qs, ks, vs] = &data.strides;
    let scale = f64::from(case.scale.unwrap_or(1.0 / (d as f32).sqrt()));
    let (mut q0, mut k0) = (0, 0);
    for (b, &(sq, sk)) in case.seqlens.iter().enumerate() {
        let off = sk as f64 - sq as f64;
        let (qb, kb) = if case.varlen { (q0, k0) } else { (0, 0) };
        for h in 0..hq {
            let kvh = h / (hq / hk);
            let slope =
                data.alibi.as_ref().map(|(m, shape)| f64::from(if shape.len() == 1 { m[h] } else { m[b * hq + h] }));
            for i in 0..sq {
                let scores: Vec<Option<f64>> = (0..sk)
                    .map(|j| {
                        if !design_visible(case, data.block_mask.as_ref(), b, h, (sq, sk), i, j) {
                            return None;
                        }
                        let dot: f64 =
                            (0..d).map(|x| at(&data.q, qs, b, qb + i, h, x) * at(&data.k, ks, b, kb + j, kvh, x)).sum();
                        let mut s = scale * dot;
                        if let Some(c) = case.softcap.map(f64::from) {
                            s = c * (s / c).tanh();
                        }
                        if let Some(m) = slope {
                            s -= m * (i as f64 + off - j as f64).abs();
                        }
                        Some(s)
                    })
                    .collect();
                let max = scores.iter().flatten().fold(f64::NEG_INFINITY, |a, &s| a.max(s));
                if max == f64::NEG_INFINITY {
                    continue;
                }
                let sum: f64 = scores.iter().flatten().map(|s| (s - max).exp()).sum();
                let row_lse = max + sum.ln();
                let li = if case.varlen { h * tq + q0 + i } else { (b * hq + h) * sq + i };
                lse[li] = row_lse;
                let token = if case.varlen { q0 + i } else { b * sq + i };
                for x in 0..dv {
                    out[(token * hq + h) * dv + x] = scores
                        .iter()
                        .enumerate()
                        .filter_map(|(j, s)| s.map(|s| (s - row_lse).exp() * at(&data.v, vs, b, kb + j, kvh, x)))
                        .sum();
                }
            }
        }
        q0 += sq;
        k0 += sk;
    }
    (out, lse)
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn oracle_follows_design_section_2(case in common::cases_with(40, common::head_dims(24), common::heads())) {
        let case = Case { dtype: DType::F32, ..case };
        let data = case.data::<f32>();
        let spec = case.spec(&data);
        let [q, k, v] = data.views();
        let oracle = flash_attn::reference::forward(&spec, &q, &k, &v).expect("valid case");
        let (out, lse) = design_forward(&case, &data);
        for (what, ours, want) in [("out", &oracle.out, &out), ("lse", &oracle.lse, &lse)] {
            prop_assert_eq!(ours.len(), want.len(), "{}: {} length", case, what);
            for (n, (&o, &w)) in ours.iter().zip(want).enumerate() {
                let close = if w.is_finite() { (o - w).abs() <= 1e-9 * w.abs().max(1.0) } else { o == w };
                prop_assert!(close, "{}: {}[{}] = {} but DESIGN §2 gives {}", case, what, n, o, w);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Rows that see no key: out = 0, lse = -inf
// ---------------------------------------------------------------------------------------------

#[test]
fn bottom_right_causal_rows_before_the_first_key_give_zero_output_and_neg_inf_lse() {
    for dtype in DTYPES {
        let case = Case { causal: Causal::BottomRight, dv: 19, ..plain(dtype, 2, (37, 11), (4, 2), 24) };
        // off = 11 - 37: row i sees keys j <= i - 26.
        with_dtype!(dtype, T => assert_masked_rows(&case, &case.data::<T>(), |_, _, i| i < 26));
    }
}

#[test]
fn all_zero_block_mask_row_gives_zero_output_and_neg_inf_lse() {
    for dtype in DTYPES {
        let block = BlockCase { block_q: 5, block_k: 7, per_head: true, density_pct: 100 };
        let case = Case { block: Some(block), ..plain(dtype, 2, (23, 30), (3, 1), 16) };
        with_dtype!(dtype, T => {
            let mut data = case.data::<T>();
            // Block row 1 of (batch 1, head 2) hides every key: queries 5..10 of that head.
            let (mask, shape) = data.block_mask.as_mut().expect("block mask");
            assert_eq!(shape, &vec![2, 3, 5, 5]);
            let row = ((3 + 2) * 5 + 1) * 5;
            mask[row..row + 5].fill(0);
            assert_masked_rows(&case, &data, |b, h, i| b == 1 && h == 2 && (5..10).contains(&i));
        });
    }
}

#[test]
fn window_that_excludes_every_key_gives_zero_output_and_neg_inf_lse() {
    for dtype in DTYPES {
        // The window is aligned bottom-right (j >= i + 30 - 3), the causal rule top-left (j <= i).
        let case = Case { causal: Causal::TopLeft, window: Some((3, 0)), ..plain(dtype, 1, (20, 50), (2, 2), 8) };
        with_dtype!(dtype, T => assert_masked_rows(&case, &case.data::<T>(), |_, _, _| true));
    }
}

#[test]
fn narrow_window_with_more_queries_than_keys_masks_the_leading_rows() {
    for dtype in DTYPES {
        // off = 9 - 21: row i sees j in [i - 12 - 1, i - 12 + 2], empty for i < 10.
        let case = Case { window: Some((1, 2)), ..plain(dtype, 2, (21, 9), (2, 1), 12) };
        with_dtype!(dtype, T => assert_masked_rows(&case, &case.data::<T>(), |_, _, i| i < 10));
    }
}

#[test]
fn missing_keys_give_zero_output_and_neg_inf_lse() {
    for dtype in DTYPES {
        let case = plain(dtype, 2, (6, 0), (2, 2), 8);
        with_dtype!(dtype, T => assert_masked_rows(&case, &case.data::<T>(), |_, _, _| true));
        let case = packed(dtype, &[(3, 4), (5, 0), (2, 1)], (2, 1), 8);
        with_dtype!(dtype, T => assert_masked_rows(&case, &case.data::<T>(), |b, _, _| b == 1));
    }
}

#[test]
fn varlen_tokens_after_the_last_sequence_give_zero_output_and_neg_inf_lse() {
    let (hq, d, tq, tk) = (2, 4, 7, 5);
    let cu_q = [0, 2, 4]; // tokens 4..7 belong to no sequence
    let cu_k = [0, 3, 5];
    let q: Vec<f32> = (0..tq * hq * d).map(|x| (x as f32 * 0.37).sin()).collect();
    let k: Vec<f32> = (0..tk * hq * d).map(|x| (x as f32 * 0.11).cos()).collect();
    let v: Vec<f32> = (0..tk * hq * d).map(|x| (x as f32 * 0.05).sin()).collect();
    let spec = AttentionSpec::new().varlen(&cu_q, &cu_k);
    let (q, k, v) = (Tensor::new(&q, &[tq, hq, d]), Tensor::new(&k, &[tk, hq, d]), Tensor::new(&v, &[tk, hq, d]));
    // Outputs start as garbage: every element must be written.
    let mut out = vec![f32::NAN; tq * hq * d];
    let mut lse = vec![f32::NAN; hq * tq];
    flash_attn::forward_into(&spec, &q, &k, &v, &mut TensorMut::new(&mut out, &[tq, hq, d]), &mut lse).unwrap();
    let oracle = flash_attn::reference::forward(&spec, &q, &k, &v).unwrap();
    for t in 0..tq {
        for h in 0..hq {
            let row = &out[(t * hq + h) * d..(t * hq + h + 1) * d];
            if t >= 4 {
                assert!(row.iter().all(|&x| x == 0.0), "token {t} head {h}: {row:?}");
                assert_eq!(lse[h * tq + t], f32::NEG_INFINITY, "token {t} head {h}");
                assert_eq!(oracle.lse[h * tq + t], f64::NEG_INFINITY, "oracle, token {t} head {h}");
            } else {
                assert!(row.iter().all(|x| x.is_finite()) && lse[h * tq + t].is_finite(), "token {t} head {h}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Empty problems
// ---------------------------------------------------------------------------------------------

#[test]
fn empty_batch_gives_empty_outputs() {
    let (q, k, v) =
        (Tensor::new(&[] as &[f32], &[0, 5, 4, 8]), Tensor::new(&[], &[0, 3, 2, 8]), Tensor::new(&[], &[0, 3, 2, 6]));
    let spec = AttentionSpec::new().causal();
    let res = flash_attn::forward(&spec, &q, &k, &v).unwrap();
    assert_eq!((res.out_shape, res.lse_shape), (vec![0, 5, 4, 6], vec![0, 4, 5]));
    assert!(res.out.is_empty() && res.lse.is_empty());
    let mut out: Vec<f32> = vec![];
    flash_attn::forward_into(&spec, &q, &k, &v, &mut TensorMut::new(&mut out, &[0, 5, 4, 6]), &mut []).unwrap();
}

#[test]
fn no_queries_give_empty_outputs() {
    let k: Vec<f32> = (0..2 * 3 * 2 * 8).map(|x| x as f32).collect();
    let (q, k, v) =
        (Tensor::new(&[] as &[f32], &[2, 0, 4, 8]), Tensor::new(&k, &[2, 3, 2, 8]), Tensor::new(&k, &[2, 3, 2, 8]));
    let res = flash_attn::forward(&AttentionSpec::new().causal(), &q, &k, &v).unwrap();
    assert_eq!((res.out_shape, res.lse_shape), (vec![2, 0, 4, 8], vec![2, 4, 0]));
    assert!(res.out.is_empty() && res.lse.is_empty());
}

#[test]
fn varlen_batch_of_empty_sequences_gives_empty_outputs() {
    for (cu_q, cu_k) in [(vec![0, 0, 0], vec![0, 0, 0]), (vec![0], vec![0])] {
        let spec = AttentionSpec::new().causal().varlen(&cu_q, &cu_k);
        let (q, k, v) =
            (Tensor::new(&[] as &[f32], &[0, 4, 8]), Tensor::new(&[], &[0, 2, 8]), Tensor::new(&[], &[0, 2, 8]));
        let res = flash_attn::forward(&spec, &q, &k, &v).unwrap();
        assert_eq!((res.out_shape, res.lse_shape), (vec![0, 4, 8], vec![4, 0]));
        assert!(res.out.is_empty() && res.lse.is_empty());
    }
}

// ---------------------------------------------------------------------------------------------
// Options that mean the same thing give the same bits
// ---------------------------------------------------------------------------------------------

/// Asserts that every variant of `base` runs to the same bits as `base`, under every tiling.
fn assert_same_bits(base: &Case, variants: &[Case]) {
    for tiles in TILINGS {
        let want = run_case(base, tiles).bits();
        for case in variants {
            assert!(run_case(case, tiles).bits() == want, "{case} differs from {base} with {tiles:?}");
        }
    }
}

#[test]
fn unbounded_window_equals_no_window() {
    for (b, lens) in [(2, (33, 33)), (1, (40, 9)), (3, (7, 61))] {
        let base = plain(DType::F32, b, lens, (4, 2), 16);
        assert_same_bits(&base, &[Case { window: Some((-1, -1)), ..base.clone() }]);
    }
}

#[test]
fn window_wider_than_any_sequence_equals_no_window() {
    for (b, lens) in [(2, (33, 33)), (1, (40, 9)), (3, (7, 61))] {
        let base = Case { causal: Causal::TopLeft, ..plain(DType::BF16, b, lens, (2, 2), 8) };
        let variants: Vec<Case> = [200, 1 << 40, i64::MAX - 1, i64::MAX]
            .into_iter()
            .flat_map(|w| [(w, w), (w, -1), (-1, w)])
            .map(|window| Case { window: Some(window), ..base.clone() })
            .collect();
        assert_same_bits(&base, &variants);
    }
}

#[test]
fn window_unbounded_left_closed_right_equals_bottom_right_causal() {
    for (b, lens) in [(2, (33, 33)), (1, (40, 9)), (3, (7, 61))] {
        let base = Case { causal: Causal::BottomRight, ..plain(DType::F16, b, lens, (3, 1), 16) };
        let window = Case { causal: Causal::None, window: Some((-1, 0)), ..base.clone() };
        let both = Case { window: Some((-1, 0)), ..base.clone() };
        assert_same_bits(&base, &[window, both]);
    }
}

#[test]
fn causal_alignments_agree_when_queries_and_keys_are_equally_many() {
    let base = Case { causal: Causal::BottomRight, ..plain(DType::F32, 2, (45, 45), (2, 1), 32) };
    assert_same_bits(&base, &[Case { causal: Causal::TopLeft, ..base.clone() }]);
    let packed_base =
        Case { causal: Causal::BottomRight, ..packed(DType::F32, &[(5, 5), (0, 0), (31, 31)], (2, 2), 8) };
    assert_same_bits(&packed_base, &[Case { causal: Causal::TopLeft, ..packed_base.clone() }]);
}

#[test]
fn dense_block_mask_equals_no_block_mask() {
    let base = Case { causal: Causal::BottomRight, ..plain(DType::F32, 2, (29, 40), (4, 4), 16) };
    let variants: Vec<Case> = [(1, 1), (3, 5), (16, 16), (64, 7), (100, 100)]
        .into_iter()
        .flat_map(|(block_q, block_k)| {
            [false, true].map(|per_head| BlockCase { block_q, block_k, per_head, density_pct: 100 })
        })
        .map(|block| Case { block: Some(block), ..base.clone() })
        .collect();
    assert_same_bits(&base, &variants);
}

#[test]
fn per_batch_alibi_slopes_that_repeat_equal_per_head_slopes() {
    let case = Case { alibi: Some(false), causal: Causal::BottomRight, ..plain(DType::F32, 3, (20, 26), (4, 2), 16) };
    let per_head = case.data::<f32>();
    let mut per_batch = per_head.clone();
    let (slopes, _) = per_head.alibi.clone().expect("slopes");
    per_batch.alibi = Some((slopes.repeat(3), vec![3, 4]));
    for tiles in TILINGS {
        assert!(run_on(&case, &per_head, tiles).bits() == run_on(&case, &per_batch, tiles).bits(), "{tiles:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Score modifiers at the edges of their range
// ---------------------------------------------------------------------------------------------

#[test]
fn softcap_near_the_largest_f32_meets_the_contract() {
    for dtype in DTYPES {
        for cap in [1e30, 1e38, f32::MAX] {
            let case = Case { softcap: Some(cap), ..plain(dtype, 1, (9, 13), (2, 1), 16) };
            let report = with_dtype!(dtype, T => report_on(&case, &case.data::<T>(), None));
            assert!(report.passed(), "{case}: {report}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// NaN and infinite inputs propagate like the oracle, never panic
// ---------------------------------------------------------------------------------------------

/// A problem where every query sees every key (no mask), with `(hq, hk) = (2, 1)`.
fn dense_case() -> Case {
    plain(DType::F32, 2, (6, 9), (2, 1), 8)
}

#[test]
fn nan_in_a_query_gives_nan_output_and_lse_in_its_row_only() {
    let case = dense_case();
    let mut data = case.data::<f32>();
    // q[b = 1, i = 3, h = 0, x = 5]
    data.q[((6 + 3) * 2) * 8 + 5] = f32::NAN;
    for tiles in TILINGS {
        let run = run_on(&case, &data, tiles);
        for (b, t, i, _, _) in rows(&case) {
            for h in 0..case.hq {
                let (row, lse) = (out_row(&case, &run, t, h), run.lse[lse_index(&case, b, t, i, h)]);
                if (b, i, h) == (1, 3, 0) {
                    assert!(row.iter().all(|x| x.is_nan()) && lse.is_nan(), "{tiles:?}: {row:?}, lse {lse}");
                } else {
                    assert!(row.iter().all(|x| x.is_finite()) && lse.is_finite(), "{tiles:?}: row {t} head {h}");
                }
            }
        }
        let report = report_on(&case, &data, tiles);
        assert!(report.passed(), "{tiles:?}: {report}");
    }
}

#[test]
fn nan_in_a_key_reaches_every_row_that_sees_it_whatever_the_tiles() {
    let case = Case { causal: Causal::BottomRight, ..dense_case() };
    let mut data = case.data::<f32>();
    // k[b = 0, j = 0, kv head 0, x = 2]: the first key of every row of batch entry 0.
    data.k[2] = f32::NAN;
    for tiles in TILINGS.into_iter().chain([Some(Tiles { br: 2, bc: 4 }), Some(Tiles { br: 3, bc: 1 })]) {
        let run = run_on(&case, &data, tiles);
        for (b, t, i, _, _) in rows(&case) {
            for h in 0..case.hq {
                let (row, lse) = (out_row(&case, &run, t, h), run.lse[lse_index(&case, b, t, i, h)]);
                let sees_it = b == 0;
                assert_eq!(row.iter().all(|x| x.is_nan()), sees_it, "{tiles:?}: row {t} head {h}: {row:?}");
                assert_eq!(lse.is_nan(), sees_it, "{tiles:?}: row {t} head {h}: lse {lse}");
            }
        }
        let report = report_on(&case, &data, tiles);
        assert!(report.passed(), "{tiles:?}: {report}");
    }
}

/// `dense_case` under bottom-right causal with `v[b = 1, j = 6, kv head 0, x = 7]` NaN: rows
/// `i >= 3` of batch entry 1 see key 6 (off = 3), rows 0..3 do not.
fn nan_value_case() -> (Case, CaseData<f32>) {
    let case = Case { causal: Causal::BottomRight, ..dense_case() };
    let mut data = case.data::<f32>();
    data.v[(9 + 6) * 8 + 7] = f32::NAN;
    (case, data)
}

#[test]
fn nan_in_a_value_reaches_every_row_that_sees_its_key() {
    let (case, data) = nan_value_case();
    for tiles in TILINGS {
        let run = run_on(&case, &data, tiles);
        for (b, t, i, _, _) in rows(&case) {
            for h in 0..case.hq {
                let row = out_row(&case, &run, t, h);
                if b == 1 && i >= 3 {
                    assert!(row[7].is_nan(), "{tiles:?}: row {t} head {h}: {row:?}");
                }
                assert!(row[..7].iter().all(|x| x.is_finite()), "{tiles:?}: row {t} head {h}: {row:?}");
                assert!(run.lse[lse_index(&case, b, t, i, h)].is_finite());
            }
        }
    }
}

#[test]
fn nan_in_a_value_does_not_reach_rows_that_cannot_see_its_key() {
    let (case, data) = nan_value_case();
    for tiles in TILINGS {
        let run = run_on(&case, &data, tiles);
        for (b, t, i, _, _) in rows(&case) {
            for h in 0..case.hq {
                let row = out_row(&case, &run, t, h);
                if !(b == 1 && i >= 3) {
                    assert!(row.iter().all(|x| x.is_finite()), "{tiles:?}: row {t} (i = {i}) head {h}: {row:?}");
                }
            }
        }
        let report = report_on(&case, &data, tiles);
        assert!(report.passed(), "{tiles:?}: the oracle must agree: {report}");
    }
}

#[test]
fn nan_in_a_masked_key_or_value_does_not_reach_the_output() {
    // Causal top-left on 6 × 9: no query sees keys 6..9.
    let case = Case { causal: Causal::TopLeft, ..dense_case() };
    let mut data = case.data::<f32>();
    for j in 6..9 {
        data.k[j * 8] = f32::NAN;
        data.v[j * 8 + 1] = f32::NAN;
    }
    for tiles in TILINGS {
        let run = run_on(&case, &data, tiles);
        assert!(run.out.iter().chain(&run.lse).all(|x| x.is_finite()), "{tiles:?}");
        let report = report_on(&case, &data, tiles);
        assert!(report.passed(), "{tiles:?}: the oracle must agree: {report}");
    }
}

#[test]
fn infinite_inputs_propagate_like_the_oracle() {
    let case = Case { causal: Causal::BottomRight, ..dense_case() };
    for (tensor, at, value) in
        [(0, 13, f32::INFINITY), (0, 100, f32::NEG_INFINITY), (1, 40, f32::INFINITY), (2, 17, f32::NEG_INFINITY)]
    {
        let mut data = case.data::<f32>();
        [&mut data.q, &mut data.k, &mut data.v][tensor][at] = value;
        for tiles in TILINGS {
            let report = report_on(&case, &data, tiles);
            assert!(report.passed(), "tensor {tensor}[{at}] = {value}, {tiles:?}: {report}");
        }
    }
}

#[test]
fn nan_and_infinite_inputs_never_panic() {
    for dtype in DTYPES {
        for poison in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let case = Case {
                softcap: Some(20.0),
                alibi: Some(true),
                window: Some((5, 3)),
                storage: Storage::Strided { pad: 1 },
                ..packed(dtype, &[(4, 7), (0, 3), (9, 2)], (4, 2), 12)
            };
            with_dtype!(dtype, T => {
                let mut data = case.data::<T>();
                for (n, x) in data.q.iter_mut().chain(&mut data.k).chain(&mut data.v).enumerate() {
                    if n % 7 == 0 {
                        *x = T::from_f32(poison);
                    }
                }
                for tiles in TILINGS {
                    let _ = run_on(&case, &data, tiles);
                }
            });
        }
    }
}
