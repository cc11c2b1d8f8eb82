//! What results must not depend on, bit for bit: how heads are grouped (GQA/MQA against MHA and
//! against one head at a time), how `out` and the inputs are laid out in memory, the thread count,
//! and the query tile size. (Key tile sizes may change rounding, within the contract: see
//! `conformance.rs`.)

mod common;

use common::{config, explicit_tiles, run_on, Run};
use flash_attn::check::{Case, CaseData};
use flash_attn::cpu::Tiles;
use flash_attn::tensor::contiguous_strides;
use flash_attn::{Element, TensorMut};
use proptest::prelude::*;
use proptest::sample::select;

/// A copy of the `[.., tokens, heads, dim]` view `(data, shape, strides)`, contiguous, whose
/// head `h` is head `from(h)` of the original, for `h < heads`.
fn regather<T: Copy>(
    data: &[T],
    shape: &[usize],
    strides: &[usize],
    heads: usize,
    from: impl Fn(usize) -> usize,
) -> (Vec<T>, Vec<usize>) {
    let r = shape.len();
    let dim = shape[r - 1];
    let mut out = Vec::new();
    for flat in 0..shape[..r - 2].iter().product() {
        let (mut rest, mut base) = (flat, 0);
        for ax in (0..r - 2).rev() {
            base += rest % shape[ax] * strides[ax];
            rest /= shape[ax];
        }
        for h in 0..heads {
            let at = base + from(h) * strides[r - 2];
            out.extend_from_slice(&data[at..at + dim]);
        }
    }
    let mut new_shape = shape.to_vec();
    new_shape[r - 2] = heads;
    (out, new_shape)
}

/// `data` with `q`, `k`, `v` replaced by `(buffer, shape)` triples (contiguous).
fn with_inputs<T: Element>(data: &CaseData<T>, [q, k, v]: [(Vec<T>, Vec<usize>); 3]) -> CaseData<T> {
    let strides = [contiguous_strides(&q.1), contiguous_strides(&k.1), contiguous_strides(&v.1)];
    CaseData { q: q.0, k: k.0, v: v.0, shapes: [q.1, k.1, v.1], strides, ..data.clone() }
}

fn bits_eq(a: &Run, b: &Run) -> bool {
    a.bits() == b.bits()
}

// ---------------------------------------------------------------------------------------------
// Heads
// ---------------------------------------------------------------------------------------------

/// Grouped-query heads against MHA with each kv head repeated `hq / hk` times.
fn gqa_equals_expanded_mha<T: Element>(case: &Case, tiles: Option<Tiles>) -> Result<(), TestCaseError> {
    let data = case.data::<T>();
    let group = case.hq / case.hk;
    let q = regather(&data.q, &data.shapes[0], &data.strides[0], case.hq, |h| h);
    let k = regather(&data.k, &data.shapes[1], &data.strides[1], case.hq, |h| h / group);
    let v = regather(&data.v, &data.shapes[2], &data.strides[2], case.hq, |h| h / group);
    let mha = Case { hk: case.hq, ..case.clone() };
    let expanded = with_inputs(&data, [q, k, v]);
    prop_assert!(bits_eq(&run_on(case, &data, tiles), &run_on(&mha, &expanded, tiles)), "{} {:?}", case, tiles);
    Ok(())
}

/// Each query head run alone (`hq = hk = 1`) against its kv head, with its own ALiBi slope and
/// block-mask plane.
fn gqa_equals_one_head_at_a_time<T: Element>(case: &Case, tiles: Option<Tiles>) -> Result<(), TestCaseError> {
    let data = case.data::<T>();
    let all = run_on(case, &data, tiles);
    let group = case.hq / case.hk;
    let tq: usize = case.seqlens.iter().map(|s| s.0).sum(); // tokens in out, fixed length or packed
    let b = case.batch();
    for h in 0..case.hq {
        let q = regather(&data.q, &data.shapes[0], &data.strides[0], 1, |_| h);
        let k = regather(&data.k, &data.shapes[1], &data.strides[1], 1, |_| h / group);
        let v = regather(&data.v, &data.shapes[2], &data.strides[2], 1, |_| h / group);
        let mut one = with_inputs(&data, [q, k, v]);
        one.alibi = data.alibi.as_ref().map(|(slopes, shape)| match shape.as_slice() {
            [_] => (vec![slopes[h]], vec![1]),
            _ => ((0..b).map(|bi| slopes[bi * case.hq + h]).collect(), vec![b, 1]),
        });
        one.block_mask = data.block_mask.as_ref().map(|(mask, shape)| match *shape.as_slice() {
            [_, hq, qb, kb] => {
                let plane = qb * kb;
                let m = (0..b).flat_map(|bi| mask[(bi * hq + h) * plane..][..plane].to_vec()).collect();
                (m, vec![b, 1, qb, kb])
            }
            _ => (mask.clone(), shape.clone()),
        });
        let single = Case { hq: 1, hk: 1, ..case.clone() };
        let alone = run_on(&single, &one, tiles);
        // out [tokens, hq, dv]: head h of every token; lse [b, hq, sq] or [hq, tq].
        for t in 0..tq {
            let want = &all.out[(t * case.hq + h) * case.dv..][..case.dv];
            let got = &alone.out[t * case.dv..][..case.dv];
            prop_assert!(
                want.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{} head {} token {}",
                case,
                h,
                t
            );
        }
        let per_head = if case.varlen { all.lse.len() / case.hq } else { all.lse.len() / case.hq / b };
        for bi in 0..if case.varlen { 1 } else { b } {
            let want = &all.lse[(bi * case.hq + h) * per_head..][..per_head];
            let got = &alone.lse[bi * per_head..][..per_head];
            prop_assert!(want.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()), "{} head {} lse", case, h);
        }
    }
    Ok(())
}

fn grouped_heads() -> impl Strategy<Value = (usize, usize)> {
    prop_oneof![(1usize..=4).prop_map(|hk| (2 * hk, hk)), (2usize..=8).prop_map(|hq| (hq, 1))]
}

fn gqa_cases() -> impl Strategy<Value = Case> {
    common::cases_with(64, common::head_dims(40), grouped_heads())
}

/// Few query rows over thousands of keys: the forward runs split over the keys (the splits merged
/// by their log-sum-exp), fixed-length or packed, with every option the other cases draw.
fn key_split_cases(heads: impl Strategy<Value = (usize, usize)>) -> impl Strategy<Value = Case> {
    let lens = prop::collection::vec((1usize..=64, 2048usize..=4300), 1..=2);
    (common::cases_with(8, common::head_dims(24), heads), lens, any::<bool>()).prop_map(|(case, lens, varlen)| {
        let seqlens = if varlen { lens } else { vec![lens[0]; lens.len()] };
        Case { seqlens, varlen, ..case }
    })
}

// ---------------------------------------------------------------------------------------------
// Memory layout
// ---------------------------------------------------------------------------------------------

/// `forward_into` a heads-major `out` with padded rows, pre-filled with a sentinel: the values
/// are `forward`'s, the padding is untouched, and every `lse` entry is written.
fn strided_out_equals_contiguous_out<T: Element>(case: &Case, pad: usize) -> Result<(), TestCaseError> {
    let data = case.data::<T>();
    let spec = case.spec(&data);
    let [q, k, v] = data.views();
    let want = flash_attn::forward(&spec, &q, &k, &v).expect("valid case");
    let g = spec.geometry(&q, &k, &v).expect("valid case");
    let shape = g.out_shape();
    let (r, dv) = (shape.len(), g.dv);
    let (tokens, heads, row) = (shape[r - 3], shape[r - 2], dv + pad);
    // Memory [(b,) hq, tokens, dv + pad].
    let mut strides = if case.varlen { vec![] } else { vec![heads * tokens * row] };
    strides.extend([row, tokens * row, 1]);
    let sentinel = T::from_f32(-1234.5);
    let mut buf = vec![sentinel; shape[..r - 3].iter().product::<usize>() * heads * tokens * row];
    let mut lse = vec![f32::NAN; g.lse_len()];
    flash_attn::forward_into(&spec, &q, &k, &v, &mut TensorMut::with_strides(&mut buf, &shape, &strides), &mut lse)
        .expect("valid out");
    prop_assert!(lse.iter().zip(&want.lse).all(|(a, b)| a.to_bits() == b.to_bits()), "{}: lse", case);
    let batches = if case.varlen { 1 } else { shape[0] };
    for b in 0..batches {
        for t in 0..tokens {
            for h in 0..heads {
                let at = b * heads * tokens * row + h * tokens * row + t * row;
                let got = &buf[at..at + row];
                let want = &want.out[((b * tokens + t) * heads + h) * dv..][..dv];
                let same = got[..dv].iter().zip(want).all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits());
                prop_assert!(same, "{}: out token {} head {}", case, t, h);
                prop_assert!(got[dv..].iter().all(|&x| x == sentinel), "{}: padding written", case);
            }
        }
    }
    Ok(())
}

/// Inputs whose strides repeat memory (stride 0: one key/value batch entry shared by every
/// entry, one query head for every head) give what their materialised copies give.
fn broadcast_inputs_equal_copies<T: Element>(case: &Case) -> Result<(), TestCaseError> {
    let data = case.data::<T>();
    let (b, hq) = (case.batch(), case.hq);
    let [qs, ks, vs] = data.shapes.clone();
    // q: one head seen hq times; k, v: batch entry 0 seen b times.
    let q_one = regather(&data.q, &qs, &data.strides[0], 1, |_| 0).0;
    let k_one: Vec<T> = data.k[..data.k.len() / b].to_vec();
    let v_one: Vec<T> = data.v[..data.v.len() / b].to_vec();
    let mut q_st = contiguous_strides(&[qs[0], qs[1], 1, qs[3]]);
    q_st[2] = 0;
    let mut k_st = contiguous_strides(&ks);
    k_st[0] = 0;
    let mut v_st = contiguous_strides(&vs);
    v_st[0] = 0;
    let broadcast =
        CaseData { q: q_one.clone(), k: k_one.clone(), v: v_one.clone(), strides: [q_st, k_st, v_st], ..data.clone() };
    let q_copies = q_one.chunks(qs[3]).flat_map(|row| row.repeat(hq)).collect();
    let copies = with_inputs(&data, [(q_copies, qs), (k_one.repeat(b), ks), (v_one.repeat(b), vs)]);
    // Both views must be accepted: broadcast inputs are valid (docs/semantics.md).
    prop_assert!(bits_eq(&run_on(case, &broadcast, None), &run_on(case, &copies, None)), "{}", case);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Scheduling
// ---------------------------------------------------------------------------------------------

/// Problems for the scheduling tests: any, or with a sliding window whose left side is bounded,
/// so that each query tile starts its key loop at a different key.
fn scheduling_cases() -> impl Strategy<Value = Case> {
    let any = common::cases_with(150, common::head_dims(48), common::heads());
    let windowed = (common::cases_with(150, common::head_dims(32), common::heads()), 1i64..=80, common::window_side())
        .prop_map(|(case, left, right)| Case { window: Some((left, right)), ..case });
    prop_oneof![any, windowed]
}

/// Problems whose backend query tile changes with the thread count (few `(sequence, head)`
/// pairs), with windows wide enough that rows cross key tiles.
fn thread_sensitive_cases() -> impl Strategy<Value = Case> {
    let heads = select(vec![(1usize, 1usize), (2, 1), (2, 2)]);
    let shape = (1usize..=2, 64usize..=200, 129usize..=400);
    let window = prop::option::weighted(0.7, (100i64..=300, common::window_side()));
    (common::cases_with(8, common::head_dims(24), heads), shape, window).prop_map(|(case, (b, sq, sk), window)| Case {
        seqlens: vec![(sq, sk); b],
        varlen: false,
        window,
        ..case
    })
}

fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool").install(f)
}

fn run_with_threads(case: &Case, threads: usize) -> Run {
    in_pool(threads, || common::run_case(case, None))
}

// ---------------------------------------------------------------------------------------------
// The properties, once per instruction-set path (`portable::…`, `avx2::…`, `avx512::…`, `neon::…`)
// ---------------------------------------------------------------------------------------------

for_each_isa! {
proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn grouped_query_heads_equal_mha_with_repeated_kv_heads(case in gqa_cases(), tiles in prop::option::of(explicit_tiles())) {
        let Some(case) = common::on_isa(ISA, case) else { return Ok(()) };
        with_dtype!(case.dtype, T => gqa_equals_expanded_mha::<T>(&case, tiles))?;
    }

    #[test]
    fn each_query_head_equals_a_one_head_problem_on_its_kv_head(case in gqa_cases(), tiles in prop::option::of(explicit_tiles())) {
        let Some(case) = common::on_isa(ISA, case) else { return Ok(()) };
        with_dtype!(case.dtype, T => gqa_equals_one_head_at_a_time::<T>(&case, tiles))?;
    }
}

proptest! {
    #![proptest_config(config(16))]

    /// With the keys split (few query rows, thousands of keys), as without.
    #[test]
    fn key_split_heads_equal_one_head_problems(case in key_split_cases(grouped_heads())) {
        let Some(case) = common::on_isa(ISA, case) else { return Ok(()) };
        with_dtype!(case.dtype, T => gqa_equals_one_head_at_a_time::<T>(&case, None))?;
    }
}

proptest! {
    #![proptest_config(config(48))]

    #[test]
    fn forward_into_a_strided_out_equals_forward(case in common::cases_with(64, common::head_dims(40), common::heads()), pad in 0usize..=3) {
        let Some(case) = common::on_isa(ISA, case) else { return Ok(()) };
        with_dtype!(case.dtype, T => strided_out_equals_contiguous_out::<T>(&case, pad))?;
    }

    #[test]
    fn zero_stride_broadcast_inputs_equal_their_copies(case in common::cases_with(48, common::head_dims(24), common::heads())) {
        let case = Case { varlen: false, seqlens: vec![case.seqlens[0]; case.seqlens.len()], storage: flash_attn::check::Storage::Contiguous, ..case };
        let Some(case) = common::on_isa(ISA, case) else { return Ok(()) };
        prop_assume!(case.seqlens[0].0 > 0 && case.seqlens[0].1 > 0);
        with_dtype!(case.dtype, T => broadcast_inputs_equal_copies::<T>(&case))?;
    }
}

proptest! {
    #![proptest_config(config(48))]

    /// The backend picks its query tile from the thread count; the bits must not move.
    #[test]
    fn results_are_bitwise_identical_across_thread_counts(case in prop_oneof![scheduling_cases(), thread_sensitive_cases(), key_split_cases(common::heads())]) {
        let Some(case) = common::on_isa(ISA, case) else { return Ok(()) };
        let one = run_with_threads(&case, 1);
        for threads in [2, 3] {
            prop_assert!(bits_eq(&one, &run_with_threads(&case, threads)), "{} with {} threads", case, threads);
        }
    }

    #[test]
    fn query_tile_size_does_not_change_results(
        case in prop_oneof![3 => scheduling_cases(), 1 => key_split_cases(common::heads())],
        bc in prop_oneof![1usize..=8, 9usize..=40],
        br in prop::collection::vec(1usize..=70, 2),
    ) {
        let Some(case) = common::on_isa(ISA, case) else { return Ok(()) };
        let runs: Vec<Run> = br.iter().map(|&br| common::run_case(&case, Some(Tiles { br, bc }))).collect();
        prop_assert!(bits_eq(&runs[0], &runs[1]), "{} bc={} br={:?}", case, bc, br);
    }
}

#[test]
fn nan_inputs_give_the_same_results_on_any_thread_count() {
    // One (sequence, head) pair: the backend's query tile is 32 rows on one thread, 16 on two.
    let case = Case {
        causal: flash_attn::Causal::BottomRight,
        ..common::plain(flash_attn::DType::F32, 1, (100, 100), (1, 1), 16)
    };
    let Some(case) = common::on_isa(ISA, case) else { return };
    let mut data = case.data::<f32>();
    data.v[50 * 16 + 3] = f32::NAN; // key 50: seen by rows 50.. only
    data.k[80 * 16 + 5] = f32::NAN; // key 80: seen by rows 80.. only
    let one = in_pool(1, || run_on(&case, &data, None));
    for threads in [2, 3] {
        let other = in_pool(threads, || run_on(&case, &data, None));
        let nan_rows = |r: &Run| -> Vec<usize> {
            (0..100).filter(|&i| r.out[i * 16..(i + 1) * 16].iter().any(|x| x.is_nan())).collect()
        };
        assert_eq!(nan_rows(&one), nan_rows(&other), "rows with NaN on 1 and {threads} threads");
        let same = one
            .out
            .iter()
            .chain(&one.lse)
            .zip(other.out.iter().chain(&other.lse))
            .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
        assert!(same, "{threads} threads");
    }
}
}
