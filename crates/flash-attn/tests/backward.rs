//! The CPU backward pass against the f64 oracle's backward, and its determinism.

mod common;

use flash_attn::check::{Case, Rng};
use flash_attn::{reference, AttentionSpec, DType, Dropout, Element, Tensor};

/// `Σ out ∘ dout` of the f64 oracle: the scalar whose gradient the backward pass computes.
fn loss(case: &Case, q: &[f32], k: &[f32], v: &[f32], dout: &[f32], dropout: Option<Dropout>) -> f64 {
    let data = case.data::<f32>();
    let mut spec = case.spec(&data);
    if let Some(d) = dropout {
        spec = spec.dropout(d.p, d.seed, d.offset);
    }
    let (qt, kt, vt) = (
        Tensor::with_strides(q, &data.shapes[0], &data.strides[0]),
        Tensor::with_strides(k, &data.shapes[1], &data.strides[1]),
        Tensor::with_strides(v, &data.shapes[2], &data.strides[2]),
    );
    let r = reference::forward(&spec, &qt, &kt, &vt).unwrap();
    r.out.iter().zip(dout).map(|(o, &g)| o * g as f64).sum()
}

#[test]
fn oracle_backward_matches_central_finite_differences() {
    let mut rng = Rng::new(2024);
    for n in 0..24 {
        let mut case = Case::random(&mut rng);
        case.dtype = flash_attn::DType::F32;
        case.storage = flash_attn::check::Storage::Contiguous;
        case.seqlens.iter_mut().for_each(|s| *s = (s.0.min(9), s.1.min(11)));
        case.d = case.d.min(12);
        case.dv = case.dv.min(12);
        if n % 3 == 0 {
            case.softcap = Some(0.5 + n as f32 / 10.0); // small caps: tanh well away from linear
        }
        let dropout = (n % 2 == 0).then_some(Dropout { p: 0.25, seed: n, offset: 3 });
        let data = case.data::<f32>();
        let mut spec = case.spec(&data);
        if let Some(d) = dropout {
            spec = spec.dropout(d.p, d.seed, d.offset);
        }
        let (dout, dshape) = case.dout(&data).unwrap();
        let [q, k, v] = data.views();
        let grads = reference::backward(&spec, &q, &k, &v, &Tensor::new(&dout, &dshape)).unwrap();
        // Perturbations of 2^-10 are exact in f32 for inputs of magnitude < 2^13.
        let h = 1.0f32 / 1024.0;
        for (which, grad) in [(0, &grads.dq), (1, &grads.dk), (2, &grads.dv)] {
            let base = [&data.q, &data.k, &data.v][which];
            if base.is_empty() {
                continue;
            }
            let scale = grad.iter().fold(1.0f64, |m, g| m.max(g.abs()));
            for _ in 0..6 {
                let idx = rng.range(0, base.len() - 1);
                let mut inputs = [data.q.clone(), data.k.clone(), data.v.clone()];
                inputs[which][idx] = base[idx] + h;
                let plus = loss(&case, &inputs[0], &inputs[1], &inputs[2], &dout, dropout);
                inputs[which][idx] = base[idx] - h;
                let minus = loss(&case, &inputs[0], &inputs[1], &inputs[2], &dout, dropout);
                let fd = (plus - minus) / (2.0 * h as f64);
                assert!(
                    (fd - grad[idx]).abs() <= 1e-6 * scale,
                    "case {n} {case}: {} [{idx}]: finite difference {fd}, oracle {}",
                    ["dq", "dk", "dv"][which],
                    grad[idx]
                );
            }
        }
    }
}

#[test]
fn backward_with_a_different_dropout_than_the_forward_is_an_error() {
    let x = [0.5f32; 16];
    let t = Tensor::new(&x, &[1, 2, 2, 4]);
    let spec = AttentionSpec::new().dropout(0.1, 1, 0);
    let saved = flash_attn::forward_train(&spec, &t, &t, &t).unwrap();
    let other = AttentionSpec::new().dropout(0.1, 2, 0);
    assert!(matches!(saved.backward(&other, &t, &t, &t, &t), Err(flash_attn::Error::Mismatch(_))));
}

// The backend's gradients, once per instruction-set path (`portable::…`, `avx2::…`, …).
for_each_isa! {
#[test]
fn random_cases_meet_the_contract_for_every_gradient() {
    let mut rng = Rng::new(77);
    let mut failed = 0;
    // 150 cases, or `$PROPTEST_CASES` (the emulated aarch64 run uses fewer).
    for n in 0..common::config(150).cases {
        let Some(case) = common::on_isa(ISA, Case::random(&mut rng)) else { return };
        let dropout = (n % 3 == 0).then(|| Dropout { p: rng.pick(&[0.1, 0.3, 0.5]), seed: rng.next_u64(), offset: n });
        let rep = case.run_cpu_backward(dropout).unwrap();
        if !rep.passed() {
            failed += 1;
            eprintln!("case {n}: {case} dropout={dropout:?}: {rep}");
        }
    }
    assert_eq!(failed, 0);
}

/// Gradient bits of `case` (its dtype) with dropout `(0.2, 99, n)` on `threads` threads.
fn gradient_bits<T: Element>(case: &Case, n: u32, threads: usize) -> [Vec<u32>; 3] {
    let data = case.data::<T>();
    let spec = case.spec(&data).dropout(0.2, 99, n);
    let [q, k, v] = data.views();
    let (dout, dshape) = case.dout(&data).unwrap();
    let dout = Tensor::new(&dout, &dshape);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    let g = pool.install(|| {
        let saved = flash_attn::forward_train(&spec, &q, &k, &v).unwrap();
        saved.backward(&spec, &q, &k, &v, &dout).unwrap()
    });
    [&g.dq, &g.dk, &g.dv].map(|x| x.iter().map(|v| v.to_f32().to_bits()).collect())
}

#[test]
fn gradients_are_bitwise_identical_across_thread_counts_and_runs() {
    let mut rng = Rng::new(5);
    for n in 0..12 {
        let mut case = Case::random(&mut rng);
        // f32 mostly; bf16 (pair products on AVX-512 BF16) and f16 too.
        case.dtype = [DType::F32, DType::BF16, DType::F32, DType::F16][n as usize % 4];
        let Some(case) = common::on_isa(ISA, case) else { return };
        let bits = |threads| with_dtype!(case.dtype, T => gradient_bits::<T>(&case, n, threads));
        let one = bits(1);
        for threads in [2, 3, 4] {
            assert!(one == bits(threads), "case {n}: {case} with {threads} threads");
        }
        assert!(one == bits(1), "case {n}: {case}, second run");
    }
}

#[test]
fn gqa_gradients_equal_the_sum_over_expanded_heads() {
    let mut rng = Rng::new(11);
    let mut case = Case::random(&mut rng);
    case.dtype = flash_attn::DType::F32;
    case.storage = flash_attn::check::Storage::Contiguous;
    case.varlen = false;
    case.seqlens = vec![(37, 53); 2];
    case.hq = 6;
    case.hk = 2;
    case.alibi = None;
    case.block = None;
    let Some(case) = common::on_isa(ISA, case) else { return };
    let data = case.data::<f32>();
    let spec = case.spec(&data);
    let [q, k, v] = data.views();
    let (dout, dshape) = case.dout(&data).unwrap();
    let dout = Tensor::new(&dout, &dshape);
    let saved = flash_attn::forward_train(&spec, &q, &k, &v).unwrap();
    let grads = saved.backward(&spec, &q, &k, &v, &dout).unwrap();
    // Expand k and v to hq heads: head h reads kv head h / 3.
    let expand = |x: &[f32], dim: usize| -> Vec<f32> {
        let (b, s) = (2, 53);
        let mut e = vec![0.0; b * s * 6 * dim];
        for t in 0..b * s {
            for h in 0..6 {
                let src = (t * 2 + h / 3) * dim;
                e[(t * 6 + h) * dim..(t * 6 + h + 1) * dim].copy_from_slice(&x[src..src + dim]);
            }
        }
        e
    };
    let (ke, ve) = (expand(&data.k, case.d), expand(&data.v, case.dv));
    let (kt, vt) = (Tensor::new(&ke, &[2, 53, 6, case.d]), Tensor::new(&ve, &[2, 53, 6, case.dv]));
    let saved_e = flash_attn::forward_train(&spec, &q, &kt, &vt).unwrap();
    let ge = saved_e.backward(&spec, &q, &kt, &vt, &dout).unwrap();
    assert_eq!(grads.dq, ge.dq);
    for (dim, ours, expanded) in [(case.d, &grads.dk, &ge.dk), (case.dv, &grads.dv, &ge.dv)] {
        for t in 0..2 * 53 {
            for hk in 0..2 {
                for x in 0..dim {
                    let sum: f64 = (0..3).map(|r| expanded[(t * 6 + hk * 3 + r) * dim + x] as f64).sum();
                    let got = ours[(t * 2 + hk) * dim + x] as f64;
                    assert!((got - sum).abs() <= 1e-5 * (1.0 + sum.abs()), "t {t} hk {hk} x {x}: {got} vs {sum}");
                }
            }
        }
    }
}

#[test]
fn fully_masked_rows_get_zero_gradient_and_no_nan() {
    // Bottom-right causal with sq > sk: the first sq - sk query rows see no key.
    let (sq, sk, h, d) = (9, 4, 2, 8);
    let mut rng = Rng::new(3);
    let mut normal = |n: usize| (0..n).map(|_| rng.normal() as f32).collect::<Vec<_>>();
    let (q, k, v, dout) = (normal(sq * h * d), normal(sk * h * d), normal(sk * h * d), normal(sq * h * d));
    if common::on_isa(ISA, common::plain(DType::F32, 1, (1, 1), (1, 1), 1)).is_none() {
        return;
    }
    let spec = AttentionSpec::new().causal().cpu_isa(ISA);
    let (qt, kt, vt) =
        (Tensor::new(&q, &[1, sq, h, d]), Tensor::new(&k, &[1, sk, h, d]), Tensor::new(&v, &[1, sk, h, d]));
    let saved = flash_attn::forward_train(&spec, &qt, &kt, &vt).unwrap();
    let g = saved.backward(&spec, &qt, &kt, &vt, &Tensor::new(&dout, &[1, sq, h, d])).unwrap();
    assert!(g.dq.iter().chain(&g.dk).chain(&g.dv).all(|x| x.is_finite()));
    for i in 0..sq - sk {
        assert!(g.dq[i * h * d..(i + 1) * h * d].iter().all(|&x| x == 0.0), "row {i}");
    }
}
}
