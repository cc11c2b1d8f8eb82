//! Every bad input is a typed `flash_attn::Error` whose message names the tensor or option at
//! fault; none panics.

mod common;

use flash_attn::cpu::Tiles;
use flash_attn::{AttentionSpec, Error, Output, Tensor, TensorMut};
use proptest::prelude::*;
use proptest::sample::select;

// A valid problem: q [2, 5, 4, 8], k [2, 7, 2, 8], v [2, 7, 2, 6]; every test breaks one thing.
const B: usize = 2;
const SQ: usize = 5;
const SK: usize = 7;
const HQ: usize = 4;
const HK: usize = 2;
const D: usize = 8;
const DV: usize = 6;

const Q: [usize; 4] = [B, SQ, HQ, D];
const K: [usize; 4] = [B, SK, HK, D];
const V: [usize; 4] = [B, SK, HK, DV];

/// `n` non-zero values.
fn buf(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7919 % 113) as f32 - 56.5) / 40.0).collect()
}

/// `forward` on contiguous inputs of the given shapes, which must fail.
fn forward_err(spec: &AttentionSpec<'_>, q: &[usize], k: &[usize], v: &[usize]) -> Error {
    let (qb, kb, vb) = (buf(q.iter().product()), buf(k.iter().product()), buf(v.iter().product()));
    let res: flash_attn::Result<Output<f32>> =
        flash_attn::forward(spec, &Tensor::new(&qb, q), &Tensor::new(&kb, k), &Tensor::new(&vb, v));
    res.expect_err("invalid input accepted")
}

/// `forward` on the valid shapes with the given spec, which must fail.
fn spec_err(spec: &AttentionSpec<'_>) -> Error {
    forward_err(spec, &Q, &K, &V)
}

/// `forward` where one of q, k, v (`which` = 0, 1, 2) is the given view.
fn view_err(which: usize, data: &[f32], shape: &[usize], strides: &[usize]) -> Error {
    let (qb, kb, vb) = (buf(Q.iter().product()), buf(K.iter().product()), buf(V.iter().product()));
    let mut views = [Tensor::new(&qb, &Q), Tensor::new(&kb, &K), Tensor::new(&vb, &V)];
    views[which] = Tensor::with_strides(data, shape, strides);
    let [q, k, v] = views;
    flash_attn::forward(&AttentionSpec::new(), &q, &k, &v).expect_err("invalid view accepted")
}

/// `forward_into` the valid problem with the given `out` view and `lse` length, which must fail.
fn out_err(out: &mut [f32], shape: &[usize], strides: &[usize], lse_len: usize) -> Error {
    let (qb, kb, vb) = (buf(Q.iter().product()), buf(K.iter().product()), buf(V.iter().product()));
    let mut lse = vec![0.0f32; lse_len];
    flash_attn::forward_into(
        &AttentionSpec::new(),
        &Tensor::new(&qb, &Q),
        &Tensor::new(&kb, &K),
        &Tensor::new(&vb, &V),
        &mut TensorMut::with_strides(out, shape, strides),
        &mut lse,
    )
    .expect_err("invalid output accepted")
}

fn contiguous(shape: &[usize]) -> Vec<usize> {
    flash_attn::tensor::contiguous_strides(shape)
}

/// The message must name what is wrong.
fn assert_mentions(e: &Error, words: &[&str]) {
    let msg = e.to_string();
    for w in words {
        assert!(msg.contains(w), "message {msg:?} does not mention {w:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Ranks
// ---------------------------------------------------------------------------------------------

#[test]
fn q_of_the_wrong_rank_is_a_rank_error() {
    let e = forward_err(&AttentionSpec::new(), &[B, SQ, HQ], &K, &V);
    assert!(matches!(e, Error::Rank { tensor: "q", expected: 4, got: 3, .. }), "{e:?}");
    assert_mentions(&e, &["`q`", "[b, sq, hq, d]"]);
}

#[test]
fn k_of_the_wrong_rank_is_a_rank_error() {
    let e = forward_err(&AttentionSpec::new(), &Q, &[1, B, SK, HK, D], &V);
    assert!(matches!(e, Error::Rank { tensor: "k", expected: 4, got: 5, .. }), "{e:?}");
    assert_mentions(&e, &["`k`", "[b, sk, hk, d]"]);
}

#[test]
fn v_of_the_wrong_rank_is_a_rank_error() {
    let e = forward_err(&AttentionSpec::new(), &Q, &K, &[B * SK, HK, DV]);
    assert!(matches!(e, Error::Rank { tensor: "v", expected: 4, got: 3, .. }), "{e:?}");
    assert_mentions(&e, &["`v`", "[b, sk, hk, dv]"]);
}

#[test]
fn out_of_the_wrong_rank_is_a_rank_error() {
    let shape = [B * SQ, HQ, DV];
    let e = out_err(&mut buf(B * SQ * HQ * DV), &shape, &contiguous(&shape), B * HQ * SQ);
    assert!(matches!(e, Error::Rank { tensor: "out", expected: 4, got: 3, .. }), "{e:?}");
    assert_mentions(&e, &["`out`", "4 dimensions", "[b, sq, hq, d"]);
}

#[test]
fn varlen_inputs_of_rank_four_are_a_rank_error() {
    let (cu_q, cu_k) = ([0, 3, 10], [0, 7, 14]);
    let e = forward_err(
        &AttentionSpec::new().varlen(&cu_q, &cu_k),
        &[1, B * SQ, HQ, D],
        &[B * SK, HK, D],
        &[B * SK, HK, DV],
    );
    assert!(matches!(e, Error::Rank { tensor: "q", expected: 3, got: 4, .. }), "{e:?}");
    assert_mentions(&e, &["`q`", "[tq, hq, d]"]);
}

// ---------------------------------------------------------------------------------------------
// Shapes that disagree
// ---------------------------------------------------------------------------------------------

#[test]
fn batch_of_k_different_from_q_is_a_shape_error() {
    let e = forward_err(&AttentionSpec::new(), &Q, &[B + 1, SK, HK, D], &[B + 1, SK, HK, DV]);
    assert!(matches!(e, Error::Shape(_)), "{e:?}");
    assert_mentions(&e, &["batch", "k 3"]);
}

#[test]
fn batch_of_v_different_from_q_is_a_shape_error() {
    let e = forward_err(&AttentionSpec::new(), &Q, &K, &[1, SK, HK, DV]);
    assert!(matches!(e, Error::Shape(_)), "{e:?}");
    assert_mentions(&e, &["batch", "v 1"]);
}

#[test]
fn key_count_of_v_different_from_k_is_a_shape_error() {
    let e = forward_err(&AttentionSpec::new(), &Q, &K, &[B, SK - 1, HK, DV]);
    assert!(matches!(e, Error::Shape(_)), "{e:?}");
    assert_mentions(&e, &["`k`", "`v`", "keys"]);
}

#[test]
fn head_count_of_v_different_from_k_is_a_shape_error() {
    let e = forward_err(&AttentionSpec::new(), &Q, &K, &[B, SK, 1, DV]);
    assert!(matches!(e, Error::Shape(_)), "{e:?}");
    assert_mentions(&e, &["`k`", "`v`", "heads"]);
}

#[test]
fn head_dim_of_k_different_from_q_is_a_shape_error() {
    let e = forward_err(&AttentionSpec::new(), &Q, &[B, SK, HK, D + 1], &V);
    assert!(matches!(e, Error::Shape(_)), "{e:?}");
    assert_mentions(&e, &["`q`", "`k`", "head dim"]);
}

#[test]
fn query_heads_not_a_multiple_of_kv_heads_is_a_head_ratio_error() {
    let e = forward_err(&AttentionSpec::new(), &Q, &[B, SK, 3, D], &[B, SK, 3, DV]);
    assert_eq!(e, Error::HeadRatio { hq: 4, hk: 3 });
    assert_mentions(&e, &["query heads (4)", "key/value heads (3)"]);
}

#[test]
fn zero_query_heads_is_a_shape_error() {
    let e = forward_err(&AttentionSpec::new(), &[B, SQ, 0, D], &K, &V);
    assert!(matches!(e, Error::Shape(_)), "{e:?}");
    assert_mentions(&e, &["hq = 0"]);
}

#[test]
fn zero_kv_heads_is_a_shape_error() {
    let e = forward_err(&AttentionSpec::new(), &Q, &[B, SK, 0, D], &[B, SK, 0, DV]);
    assert!(matches!(e, Error::Shape(_)), "{e:?}");
    assert_mentions(&e, &["hk = 0"]);
}

#[test]
fn zero_head_dim_is_a_shape_error() {
    let e = forward_err(&AttentionSpec::new(), &[B, SQ, HQ, 0], &[B, SK, HK, 0], &V);
    assert!(matches!(e, Error::Shape(_)), "{e:?}");
    assert_mentions(&e, &["d = 0"]);
}

#[test]
fn zero_value_head_dim_is_a_shape_error() {
    let e = forward_err(&AttentionSpec::new(), &Q, &K, &[B, SK, HK, 0]);
    assert!(matches!(e, Error::Shape(_)), "{e:?}");
    assert_mentions(&e, &["dv = 0"]);
}

// ---------------------------------------------------------------------------------------------
// Views: strides and buffers
// ---------------------------------------------------------------------------------------------

#[test]
fn stride_count_different_from_rank_is_an_error() {
    let data = buf(Q.iter().product());
    let e = view_err(0, &data, &Q, &[SQ * HQ * D, HQ * D, 1]);
    assert_eq!(e, Error::StrideCount { tensor: "q", dims: 4, strides: 3 });
    assert_mentions(&e, &["`q`"]);
}

#[test]
fn non_unit_last_stride_is_an_error() {
    let data = buf(2 * K.iter().product::<usize>());
    let e = view_err(1, &data, &K, &[2 * SK * HK * D, 2 * HK * D, 2 * D, 2]);
    assert_eq!(e, Error::InnerStride { tensor: "k", stride: 2 });
    assert_mentions(&e, &["`k`", "unit stride"]);
}

#[test]
fn strides_reaching_outside_the_buffer_are_out_of_bounds() {
    let data = buf(V.iter().product());
    // Padded rows need more memory than a contiguous buffer has.
    let e = view_err(2, &data, &V, &[SK * HK * (DV + 1), HK * (DV + 1), DV + 1, 1]);
    assert!(matches!(e, Error::OutOfBounds { tensor: "v", len: 168, .. }), "{e:?}");
    assert_mentions(&e, &["`v`", "168"]);
}

#[test]
fn buffer_smaller_than_its_shape_is_out_of_bounds() {
    let data = buf(Q.iter().product::<usize>() - 1);
    let e = view_err(0, &data, &Q, &contiguous(&Q));
    assert!(matches!(e, Error::OutOfBounds { tensor: "q", needed: 320, len: 319, .. }), "{e:?}");
    assert_mentions(&e, &["`q`", "320", "319"]);
}

#[test]
fn strides_whose_extent_overflows_are_out_of_bounds() {
    let data = buf(K.iter().product());
    let e = view_err(1, &data, &K, &[usize::MAX, HK * D, D, 1]);
    assert!(matches!(e, Error::OutOfBounds { tensor: "k", .. }), "{e:?}");
    assert_mentions(&e, &["`k`"]);
}

// ---------------------------------------------------------------------------------------------
// Outputs
// ---------------------------------------------------------------------------------------------

#[test]
fn out_of_the_wrong_shape_is_a_shape_error() {
    let shape = [B, SQ, HQ, D]; // dv is 6, not 8
    let e = out_err(&mut buf(B * SQ * HQ * D), &shape, &contiguous(&shape), B * HQ * SQ);
    assert!(matches!(e, Error::Shape(_)), "{e:?}");
    assert_mentions(&e, &["`out`", "[2, 5, 4, 6]"]);
}

#[test]
fn out_buffer_too_small_is_out_of_bounds() {
    let shape = [B, SQ, HQ, DV];
    let e = out_err(&mut buf(B * SQ * HQ * DV - 1), &shape, &contiguous(&shape), B * HQ * SQ);
    assert!(matches!(e, Error::OutOfBounds { tensor: "out", .. }), "{e:?}");
    assert_mentions(&e, &["`out`"]);
}

#[test]
fn out_with_overlapping_strides_is_an_overlap_error() {
    let shape = [B, SQ, HQ, DV];
    // Heads 6 apart but tokens only 6 apart too: token 1 head 0 is token 0 head 1.
    let strides = [SQ * HQ * DV, DV, DV, 1];
    let e = out_err(&mut buf(B * SQ * HQ * DV), &shape, &strides, B * HQ * SQ);
    assert!(matches!(e, Error::Overlap { tensor: "out", .. }), "{e:?}");
    assert_mentions(&e, &["`out`", "overlap"]);
}

#[test]
fn out_with_a_zero_stride_is_an_overlap_error() {
    let shape = [B, SQ, HQ, DV];
    let e = out_err(&mut buf(B * SQ * HQ * DV), &shape, &[0, HQ * DV, DV, 1], B * HQ * SQ);
    assert!(matches!(e, Error::Overlap { tensor: "out", .. }), "{e:?}");
}

#[test]
fn out_with_a_non_unit_last_stride_is_an_error() {
    let shape = [B, SQ, HQ, DV];
    let e = out_err(&mut buf(2 * B * SQ * HQ * DV), &shape, &[2 * SQ * HQ * DV, 2 * HQ * DV, 2 * DV, 2], B * HQ * SQ);
    assert_eq!(e, Error::InnerStride { tensor: "out", stride: 2 });
}

#[test]
fn out_with_too_few_strides_is_an_error() {
    let shape = [B, SQ, HQ, DV];
    let e = out_err(&mut buf(B * SQ * HQ * DV), &shape, &[HQ * DV, DV, 1], B * HQ * SQ);
    assert_eq!(e, Error::StrideCount { tensor: "out", dims: 4, strides: 3 });
}

#[test]
fn lse_of_the_wrong_length_is_a_buffer_length_error() {
    let shape = [B, SQ, HQ, DV];
    for len in [0, B * HQ * SQ - 1, B * HQ * SQ + 1] {
        let e = out_err(&mut buf(B * SQ * HQ * DV), &shape, &contiguous(&shape), len);
        assert_eq!(e, Error::BufferLength { tensor: "lse", expected: B * HQ * SQ, got: len });
        assert_mentions(&e, &["`lse`"]);
    }
}

// ---------------------------------------------------------------------------------------------
// cu_seqlens
// ---------------------------------------------------------------------------------------------

/// `forward` on a packed batch of 10 query and 14 key tokens.
fn varlen_err(cu_q: &[i32], cu_k: &[i32]) -> Error {
    forward_err(&AttentionSpec::new().varlen(cu_q, cu_k), &[10, HQ, D], &[14, HK, D], &[14, HK, DV])
}

fn assert_cu_seqlens_error(e: &Error, which: &str, words: &[&str]) {
    assert!(matches!(e, Error::CuSeqlens { which: w, .. } if *w == which), "{e:?}");
    assert_mentions(e, &[which]);
    assert_mentions(e, words);
}

#[test]
fn cu_seqlens_not_starting_at_zero_is_an_error() {
    assert_cu_seqlens_error(&varlen_err(&[1, 4, 10], &[0, 7, 14]), "cu_seqlens_q", &["start at 0"]);
    assert_cu_seqlens_error(&varlen_err(&[0, 4, 10], &[2, 7, 14]), "cu_seqlens_k", &["start at 0"]);
}

#[test]
fn decreasing_cu_seqlens_is_an_error() {
    assert_cu_seqlens_error(&varlen_err(&[0, 6, 4], &[0, 7, 14]), "cu_seqlens_q", &["decreases"]);
    assert_cu_seqlens_error(&varlen_err(&[0, 4, 10], &[0, 9, 3]), "cu_seqlens_k", &["decreases"]);
}

#[test]
fn cu_seqlens_past_the_packed_tokens_is_an_error() {
    assert_cu_seqlens_error(&varlen_err(&[0, 4, 11], &[0, 7, 14]), "cu_seqlens_q", &["11", "10"]);
    assert_cu_seqlens_error(&varlen_err(&[0, 4, 10], &[0, 7, 15]), "cu_seqlens_k", &["15", "14"]);
}

#[test]
fn cu_seqlens_of_different_lengths_is_an_error() {
    assert_cu_seqlens_error(&varlen_err(&[0, 4, 10], &[0, 14]), "cu_seqlens_k", &["entries"]);
    assert_cu_seqlens_error(&varlen_err(&[0, 10], &[0, 7, 14]), "cu_seqlens_k", &["entries"]);
}

#[test]
fn negative_cu_seqlens_is_an_error() {
    assert_cu_seqlens_error(&varlen_err(&[0, -3, 10], &[0, 7, 14]), "cu_seqlens_q", &[]);
    assert_cu_seqlens_error(&varlen_err(&[0, 4, 10], &[0, 7, i32::MIN]), "cu_seqlens_k", &[]);
}

#[test]
fn empty_cu_seqlens_is_an_error() {
    assert_cu_seqlens_error(&varlen_err(&[], &[]), "cu_seqlens_q", &["empty"]);
    assert_cu_seqlens_error(&varlen_err(&[0, 4, 10], &[]), "cu_seqlens_k", &["entries"]);
}

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------

#[test]
fn window_left_below_minus_one_is_an_error() {
    let e = spec_err(&AttentionSpec::new().window(-2, 3));
    assert_eq!(e, Error::Window { left: -2, right: 3 });
    assert_mentions(&e, &["window (-2, 3)"]);
}

#[test]
fn window_right_below_minus_one_is_an_error() {
    let e = spec_err(&AttentionSpec::new().causal().window(0, i64::MIN));
    assert_eq!(e, Error::Window { left: 0, right: i64::MIN });
    assert_mentions(&e, &["window"]);
}

#[test]
fn non_finite_scale_is_an_error() {
    for scale in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let e = spec_err(&AttentionSpec::new().scale(scale));
        assert!(matches!(e, Error::Scale(s) if s.to_bits() == scale.to_bits()), "{e:?}");
        assert_mentions(&e, &["scale"]);
    }
}

#[test]
fn softcap_not_positive_and_finite_is_an_error() {
    for cap in [0.0, -0.0, -1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let e = spec_err(&AttentionSpec::new().softcap(cap));
        assert!(matches!(e, Error::Softcap(c) if c.to_bits() == cap.to_bits()), "{cap}: {e:?}");
        assert_mentions(&e, &["softcap"]);
    }
}

/// `forward` on the valid shapes with a block mask of `shape` and block size `(bq, bk)`.
fn block_err(shape: &[usize], bq: usize, bk: usize) -> Error {
    let mask = vec![1u8; shape.iter().product()];
    spec_err(&AttentionSpec::new().block_mask(Tensor::new(&mask, shape), bq, bk))
}

#[test]
fn block_mask_of_the_wrong_2d_shape_is_an_error() {
    // sq = 5, sk = 7 in blocks of (2, 3): [3, 3].
    for shape in [[3, 2], [2, 3], [5, 7]] {
        let e = block_err(&shape, 2, 3);
        assert!(matches!(e, Error::BlockMask(_)), "{e:?}");
        assert_mentions(&e, &["block mask", "[qb, kb] = [3, 3]"]);
    }
}

#[test]
fn block_mask_of_the_wrong_4d_shape_is_an_error() {
    for shape in [[B, HK, 3, 3], [1, HQ, 3, 3], [B, HQ, 3, 4]] {
        let e = block_err(&shape, 2, 3);
        assert!(matches!(e, Error::BlockMask(_)), "{e:?}");
        assert_mentions(&e, &["block mask", "[b, hq, qb, kb] = [2, 4, 3, 3]"]);
    }
}

#[test]
fn block_mask_of_rank_three_is_an_error() {
    let e = block_err(&[HQ, 3, 3], 2, 3);
    assert!(matches!(e, Error::BlockMask(_)), "{e:?}");
    assert_mentions(&e, &["block mask", "[3, 3]"]);
}

#[test]
fn zero_query_block_size_is_an_error() {
    let e = block_err(&[3, 3], 0, 3);
    assert!(matches!(e, Error::BlockMask(_)), "{e:?}");
    assert_mentions(&e, &["block mask", "(0, 3)"]);
}

#[test]
fn zero_key_block_size_is_an_error() {
    let e = block_err(&[3, 3], 2, 0);
    assert!(matches!(e, Error::BlockMask(_)), "{e:?}");
    assert_mentions(&e, &["block mask", "(2, 0)"]);
}

#[test]
fn block_mask_buffer_too_small_is_out_of_bounds() {
    let mask = vec![1u8; 8];
    let e = spec_err(&AttentionSpec::new().block_mask(Tensor::new(&mask, &[3, 3]), 2, 3));
    assert!(matches!(e, Error::OutOfBounds { tensor: "block_mask", .. }), "{e:?}");
}

fn alibi_err(shape: &[usize]) -> Error {
    let slopes = vec![0.25f32; shape.iter().product()];
    spec_err(&AttentionSpec::new().alibi_slopes(Tensor::new(&slopes, shape)))
}

#[test]
fn alibi_slopes_of_the_wrong_length_are_an_error() {
    for shape in [[HQ - 1], [HQ + 1], [HK]] {
        let e = alibi_err(&shape);
        assert!(matches!(e, Error::Alibi(_)), "{e:?}");
        assert_mentions(&e, &["ALiBi", "[hq] = [4]"]);
    }
}

#[test]
fn alibi_slopes_of_the_wrong_2d_shape_are_an_error() {
    for shape in [[B, HK], [1, HQ], [HQ, B]] {
        let e = alibi_err(&shape);
        assert!(matches!(e, Error::Alibi(_)), "{e:?}");
        assert_mentions(&e, &["ALiBi", "[b, hq] = [2, 4]"]);
    }
}

#[test]
fn alibi_slopes_of_rank_three_are_an_error() {
    let e = alibi_err(&[B, HQ, 1]);
    assert!(matches!(e, Error::Alibi(_)), "{e:?}");
    assert_mentions(&e, &["ALiBi", "[2, 4, 1]"]);
}

#[test]
fn alibi_slopes_buffer_too_small_is_out_of_bounds() {
    let slopes = [0.5f32; HQ - 1];
    let e = spec_err(&AttentionSpec::new().alibi_slopes(Tensor::new(&slopes, &[HQ])));
    assert!(matches!(e, Error::OutOfBounds { tensor: "alibi_slopes", .. }), "{e:?}");
}

// ---------------------------------------------------------------------------------------------
// Backend limits
// ---------------------------------------------------------------------------------------------

#[test]
fn head_dim_above_512_is_unsupported_on_cpu() {
    let e = forward_err(&AttentionSpec::new(), &[1, 2, 1, 513], &[1, 3, 1, 513], &[1, 3, 1, 4]);
    assert!(matches!(e, Error::HeadDim { tensor: "q", dim: 513, backend: "cpu", max: 512, .. }), "{e:?}");
    assert_mentions(&e, &["`q`", "513", "cpu", "512"]);
}

#[test]
fn value_head_dim_above_512_is_unsupported_on_cpu() {
    let e = forward_err(&AttentionSpec::new(), &[1, 2, 1, 4], &[1, 3, 1, 4], &[1, 3, 1, 600]);
    assert!(matches!(e, Error::HeadDim { tensor: "v", dim: 600, backend: "cpu", .. }), "{e:?}");
    assert_mentions(&e, &["`v`", "600"]);
}

#[test]
fn zero_explicit_tile_size_is_unsupported() {
    let (qb, kb, vb) = (buf(Q.iter().product()), buf(K.iter().product()), buf(V.iter().product()));
    let (q, k, v) = (Tensor::new(&qb, &Q), Tensor::new(&kb, &K), Tensor::new(&vb, &V));
    let g = AttentionSpec::new().geometry(&q, &k, &v).unwrap();
    for tiles in [Tiles { br: 0, bc: 16 }, Tiles { br: 16, bc: 0 }] {
        let mut out = vec![0.0f32; B * SQ * HQ * DV];
        let mut lse = vec![0.0f32; B * HQ * SQ];
        let mut out = TensorMut::new(&mut out, &[B, SQ, HQ, DV]);
        let e = flash_attn::cpu::forward_into_tiled(&g, &q, &k, &v, &mut out, &mut lse, tiles).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e:?}");
        assert_mentions(&e, &["tile"]);
    }
}

// ---------------------------------------------------------------------------------------------
// Anything at all: an error or a result, never a panic
// ---------------------------------------------------------------------------------------------

/// A view: a shape, its strides and the length of its buffer.
type View = (Vec<usize>, Vec<usize>, usize);

/// One past the last element a view reaches (saturating), as a buffer length.
fn extent(shape: &[usize], strides: &[usize]) -> usize {
    if shape.contains(&0) {
        return 0;
    }
    shape.iter().zip(strides).fold(1usize, |acc, (&n, &s)| acc.saturating_add((n - 1).saturating_mul(s)))
}

/// A view of `shape`, usually valid (contiguous, padded rows, or broadcast), sometimes broken:
/// another shape, any strides, a buffer one element short.
fn view_of(shape: Vec<usize>) -> impl Strategy<Value = View> {
    let n = shape.len();
    let valid = prop_oneof![
        Just(flash_attn::tensor::contiguous_strides(&shape)),
        (1usize..=3).prop_map({
            let shape = shape.clone();
            move |pad| {
                let mut padded = shape.clone();
                padded[n - 1] += pad;
                let mut st = flash_attn::tensor::contiguous_strides(&padded);
                st[n - 1] = 1;
                st
            }
        }),
        (0..n - 1).prop_map({
            let shape = shape.clone();
            move |axis| {
                let mut st = flash_attn::tensor::contiguous_strides(&shape);
                st[axis] = 0;
                st
            }
        }),
    ];
    let shape2 = shape.clone();
    let good = valid.prop_map(move |st| {
        let len = extent(&shape2, &st);
        (shape2.clone(), st, len)
    });
    let broken = (prop::collection::vec(0usize..=4, 2..=5), prop::collection::vec(0usize..=40, 1..=5), 0usize..=300);
    let short = good.clone().prop_map(|(sh, st, len)| (sh, st, len.saturating_sub(1)));
    prop_oneof![12 => good, 1 => broken, 1 => short]
}

/// Everything a call can be given, usually valid, sometimes not.
#[derive(Debug, Clone)]
struct Call {
    q: View,
    k: View,
    v: View,
    out: View,
    lse_len: usize,
    varlen: Option<(Vec<i32>, Vec<i32>)>,
    causal: u8,
    window: Option<(i64, i64)>,
    softcap: Option<f32>,
    scale: Option<f32>,
    alibi: Option<(Vec<usize>, usize)>,
    block: Option<(Vec<usize>, usize, usize, usize)>,
}

fn any_f32() -> impl Strategy<Value = f32> {
    prop_oneof![4 => 0.01f32..4.0, 1 => -2.0f32..0.0, 1 => select(vec![0.0f32, -0.0, f32::NAN, f32::INFINITY, 1e-30, f32::MAX])]
}

fn window_side() -> impl Strategy<Value = i64> {
    prop_oneof![4 => -1i64..=6, 1 => select(vec![-2i64, i64::MIN, i64::MAX / 2])]
}

fn calls() -> impl Strategy<Value = Call> {
    // (b, sq, sk, hk, group, d, dv), each possibly 0.
    let dims = (0usize..=3, 0usize..=5, 0usize..=5, 0usize..=3, 1usize..=3, 0usize..=5, 0usize..=5);
    (dims, any::<bool>())
        .prop_flat_map(|((b, sq, sk, hk, group, d, dv), varlen)| {
            let hq = hk * group;
            let lens = prop::collection::vec((0usize..=sq, 0usize..=sk), b);
            (lens, prop::collection::vec(-1i32..=8, 0..=4), 0u8..4).prop_flat_map(move |(lens, junk, how)| {
                let (tq, tk) =
                    if varlen { (lens.iter().map(|l| l.0).sum(), lens.iter().map(|l| l.1).sum()) } else { (0, 0) };
                let cu = |f: fn(&(usize, usize)) -> usize| {
                    let mut c = vec![0i32];
                    for l in &lens {
                        c.push(c[c.len() - 1] + f(l) as i32);
                    }
                    c
                };
                let cu_seqlens = match how {
                    _ if !varlen => None,
                    0 => Some((junk.clone(), cu(|l| l.1))),
                    _ => Some((cu(|l| l.0), cu(|l| l.1))),
                };
                let lead = |s: usize| if varlen { vec![] } else { vec![b, s] };
                let shape = |mut lead: Vec<usize>, t: usize, h: usize, x: usize| {
                    if lead.is_empty() {
                        lead.push(t);
                    }
                    lead.extend([h, x]);
                    lead
                };
                let (qs, ks, vs, os) = (
                    shape(lead(sq), tq, hq, d),
                    shape(lead(sk), tk, hk, d),
                    shape(lead(sk), tk, hk, dv),
                    shape(lead(sq), tq, hq, dv),
                );
                let lse_len = hq * if varlen { tq } else { b * sq };
                let (qb, kb) = (sq.max(tq), sk.max(tk));
                (
                    (view_of(qs), view_of(ks), view_of(vs), view_of(os)),
                    prop_oneof![8 => Just(lse_len), 1 => 0usize..=40],
                    Just(cu_seqlens),
                    (0u8..3, prop::option::weighted(0.3, (window_side(), window_side()))),
                    (prop::option::weighted(0.2, any_f32()), prop::option::weighted(0.2, any_f32())),
                    prop::option::weighted(
                        0.2,
                        prop_oneof![
                            Just((vec![hq], hq)),
                            Just((vec![b, hq], b * hq)),
                            (prop::collection::vec(0usize..=4, 0..=3), 0usize..=20)
                        ],
                    ),
                    prop::option::weighted(
                        0.2,
                        (1usize..=4, 1usize..=4, 0usize..=2).prop_flat_map(move |(bq, bk, kind)| {
                            let (qn, kn) = (qb.div_ceil(bq), kb.div_ceil(bk));
                            let shape = match kind {
                                0 => vec![qn, kn],
                                1 => vec![b, hq, qn, kn],
                                _ => vec![qn + 1, kn],
                            };
                            let len = shape.iter().product::<usize>();
                            (
                                Just(shape),
                                prop_oneof![4 => Just(len), 1 => 0..=len],
                                prop_oneof![6 => Just(bq), 1 => Just(0)],
                                Just(bk),
                            )
                        }),
                    ),
                )
            })
        })
        .prop_map(|((q, k, v, out), lse_len, varlen, (causal, window), (softcap, scale), alibi, block)| Call {
            q,
            k,
            v,
            out,
            lse_len,
            varlen,
            causal,
            window,
            softcap,
            scale,
            alibi,
            block,
        })
}

proptest! {
    #![proptest_config(common::config(4096))]

    #[test]
    fn any_call_gives_a_result_or_an_error_never_a_panic(c in calls()) {
        let (qd, kd, vd) = (buf(c.q.2), buf(c.k.2), buf(c.v.2));
        let (q, k, v) = (
            Tensor::with_strides(&qd, &c.q.0, &c.q.1),
            Tensor::with_strides(&kd, &c.k.0, &c.k.1),
            Tensor::with_strides(&vd, &c.v.0, &c.v.1),
        );
        let slopes = c.alibi.as_ref().map(|(_, len)| vec![0.125f32; *len]).unwrap_or_default();
        let mask: Vec<u8> = c.block.as_ref().map(|b| (0..b.1).map(|i| (i % 3 != 0) as u8).collect()).unwrap_or_default();
        let mut spec = match c.causal {
            0 => AttentionSpec::new(),
            1 => AttentionSpec::new().causal(),
            _ => AttentionSpec::new().causal_top_left(),
        };
        if let Some((l, r)) = c.window {
            spec = spec.window(l, r);
        }
        if let Some(cap) = c.softcap {
            spec = spec.softcap(cap);
        }
        if let Some(s) = c.scale {
            spec = spec.scale(s);
        }
        if let Some((shape, _)) = &c.alibi {
            spec = spec.alibi_slopes(Tensor::new(&slopes, shape));
        }
        if let Some((shape, _, bq, bk)) = &c.block {
            spec = spec.block_mask(Tensor::new(&mask, shape), *bq, *bk);
        }
        if let Some((cq, ck)) = &c.varlen {
            spec = spec.varlen(cq, ck);
        }
        let res = flash_attn::forward(&spec, &q, &k, &v);
        let oracle = flash_attn::reference::forward(&spec, &q, &k, &v);
        prop_assert_eq!(res.is_ok(), oracle.is_ok(), "backend and oracle disagree on validity: {:?} vs {:?}", res.err(), oracle.err());
        let mut out = buf(c.out.2);
        let mut lse = vec![0.0f32; c.lse_len];
        let _ = flash_attn::forward_into(&spec, &q, &k, &v, &mut TensorMut::with_strides(&mut out, &c.out.0, &c.out.1), &mut lse);
    }
}

#[test]
fn a_cpu_path_this_machine_lacks_is_a_typed_error() {
    let available = flash_attn::cpu::Isa::available();
    // On every machine some path is missing: x86-64 has no NEON, aarch64 no AVX.
    let missing = flash_attn::cpu::Isa::ALL.into_iter().find(|isa| !available.contains(isa)).expect("a missing path");
    let err = spec_err(&AttentionSpec::new().cpu_isa(missing));
    assert!(matches!(err, Error::CpuIsa(_)), "{err:?}");
    assert!(err.to_string().contains(missing.name()), "{err}");
    // The paths that are there all run.
    for isa in available {
        let (q, k, v) = (buf(Q.iter().product()), buf(K.iter().product()), buf(V.iter().product()));
        let spec = AttentionSpec::new().cpu_isa(isa);
        let res = flash_attn::forward(&spec, &Tensor::new(&q, &Q), &Tensor::new(&k, &K), &Tensor::new(&v, &V));
        assert!(res.is_ok(), "{isa}: {res:?}");
    }
}
