//! FP8 (e4m3) inputs with per-tensor descale factors (docs/semantics.md, "FP8 inputs"): the CPU
//! forward meets the FP8 contract
//! `max|ours - oracle| <= 2 · max|naive_fp8 - oracle| + eps_bf16 · max(1, max|oracle|)`
//! on random problems, the `naive_fp8` reference really rounds `P` to e4m3, and bad descale
//! factors or shapes are typed errors.

use flash_attn::check::{self, Rng};
use flash_attn::fp8::{self, Fp8E4m3, Fp8Scales};
use flash_attn::reference::{self, Reference};
use flash_attn::{AttentionSpec, Causal, Error, Tensor};
use half::bf16;

/// One random FP8 problem, fixed length.
#[derive(Debug, Clone)]
struct Fp8Case {
    b: usize,
    sq: usize,
    sk: usize,
    hq: usize,
    hk: usize,
    d: usize,
    causal: Causal,
    window: Option<(i64, i64)>,
    scale: f32,
    /// Extra elements after each `d`-row in memory (a strided view when non-zero).
    pad: usize,
    seed: u64,
}

impl Fp8Case {
    /// A case with head dim `d` and the mask `mask` (0: none, 1: causal bottom-right, 2: causal
    /// top-left, 3: window); everything else drawn from `seed`.
    fn random(seed: u64, d: usize, mask: usize) -> Fp8Case {
        let mut rng = Rng::new(seed);
        let hk = rng.pick(&[1, 2]);
        let hq = hk * rng.pick(&[1, 2, 4]);
        let len = |rng: &mut Rng| if rng.chance(0.2) { rng.range(1, 64) } else { rng.range(1, 300) };
        let (sq, sk) = (len(&mut rng), len(&mut rng));
        let causal = [Causal::None, Causal::BottomRight, Causal::TopLeft, Causal::None][mask];
        let side = |rng: &mut Rng| if rng.chance(0.3) { -1 } else { rng.range(0, 80) as i64 };
        let window = (mask == 3).then(|| (side(&mut rng), side(&mut rng)));
        let scale = ((0.5 + rng.uniform()) / (d as f64).sqrt()) as f32;
        let pad = if rng.chance(0.25) { rng.range(1, 8) } else { 0 };
        Fp8Case { b: rng.range(1, 2), sq, sk, hq, hk, d, causal, window, scale, pad, seed: rng.next_u64() }
    }

    fn spec(&self) -> AttentionSpec<'static> {
        let spec = AttentionSpec::new().causal_mode(self.causal).scale(self.scale);
        match self.window {
            Some((l, r)) => spec.window(l, r),
            None => spec,
        }
    }

    /// Shape and strides of a `[b, s, h, d]` tensor whose rows are `d + pad` apart, and the buffer
    /// length.
    fn layout(&self, s: usize, h: usize) -> (Vec<usize>, Vec<usize>, usize) {
        let row = self.d + self.pad;
        (vec![self.b, s, h, self.d], vec![s * h * row, h * row, row, 1], self.b * s * h * row)
    }

    /// Standard normal q, k, v (v times 4, so that no factor is 1) quantized per tensor.
    fn inputs(&self) -> Inputs {
        let mut rng = Rng::new(self.seed);
        let mut fill = |n: usize, sigma: f64| -> Vec<f32> { (0..n).map(|_| (rng.normal() * sigma) as f32).collect() };
        let (qs, qst, ql) = self.layout(self.sq, self.hq);
        let (ks, kst, kl) = self.layout(self.sk, self.hk);
        let (q, k, v) = (fill(ql, 1.0), fill(kl, 1.0), fill(kl, 4.0));
        let ((q, sq), (k, sk), (v, sv)) = (fp8::quantize(&q), fp8::quantize(&k), fp8::quantize(&v));
        Inputs { q, k, v, scales: Fp8Scales { q: sq, k: sk, v: sv }, shapes: [qs, ks], strides: [qst, kst] }
    }
}

/// Quantized inputs of a case; `v` has the layout of `k`.
struct Inputs {
    q: Vec<Fp8E4m3>,
    k: Vec<Fp8E4m3>,
    v: Vec<Fp8E4m3>,
    scales: Fp8Scales,
    /// Shapes of q and k (= v).
    shapes: [Vec<usize>; 2],
    strides: [Vec<usize>; 2],
}

impl Inputs {
    fn views(&self) -> [Tensor<'_, Fp8E4m3>; 3] {
        let [(qs, qst), (ks, kst)] = [(&self.shapes[0], &self.strides[0]), (&self.shapes[1], &self.strides[1])];
        [
            Tensor::with_strides(&self.q, qs, qst),
            Tensor::with_strides(&self.k, ks, kst),
            Tensor::with_strides(&self.v, ks, kst),
        ]
    }

    /// The real values of q, k, v: the whole buffers dequantized.
    fn dequantized(&self) -> [Vec<f32>; 3] {
        [
            fp8::dequantize(&self.q, self.scales.q),
            fp8::dequantize(&self.k, self.scales.k),
            fp8::dequantize(&self.v, self.scales.v),
        ]
    }

    /// `f` applied to views of `bufs` in the inputs' shapes and strides.
    fn with_views<T, R>(
        &self,
        bufs: &[Vec<T>; 3],
        f: impl FnOnce(&Tensor<'_, T>, &Tensor<'_, T>, &Tensor<'_, T>) -> R,
    ) -> R {
        let q = Tensor::with_strides(&bufs[0], &self.shapes[0], &self.strides[0]);
        let k = Tensor::with_strides(&bufs[1], &self.shapes[1], &self.strides[1]);
        let v = Tensor::with_strides(&bufs[2], &self.shapes[1], &self.strides[1]);
        f(&q, &k, &v)
    }
}

/// The oracle and `naive_fp8` on the dequantized inputs.
fn references(spec: &AttentionSpec<'_>, inputs: &Inputs) -> (Reference, Reference) {
    inputs.with_views(&inputs.dequantized(), |q, k, v| {
        let oracle = reference::forward(spec, q, k, v).expect("valid case");
        let naive = reference::naive_fp8(spec, q, k, v).expect("valid case");
        (oracle, naive)
    })
}

/// The random cases: every head dim with every mask kind, three shapes each.
fn cases() -> Vec<Fp8Case> {
    let mut cases = Vec::new();
    for (i, d) in [16, 32, 64, 80, 128, 256].into_iter().enumerate() {
        for mask in 0..4 {
            for rep in 0..3 {
                let seed = 0xF8_0000 + (i * 100 + mask * 10 + rep) as u64;
                let mut case = Fp8Case::random(seed, d, mask);
                if d == 256 {
                    // Keep the f64 oracle quick at the largest head dim.
                    (case.sq, case.sk, case.hq) = (case.sq.min(160), case.sk.min(160), case.hk);
                }
                cases.push(case);
            }
        }
    }
    // Shapes the draws may miss: sq != sk both ways, around one 128-key tile.
    let fixed = [(1, 300), (300, 1), (200, 127), (64, 129), (130, 260)];
    for (i, (sq, sk)) in fixed.into_iter().enumerate() {
        let case = Fp8Case::random(0xF8_1000 + i as u64, [64, 128, 80, 32, 16][i], i % 4);
        cases.push(Fp8Case { sq, sk, ..case });
    }
    cases
}

#[test]
fn random_fp8_problems_meet_the_fp8_contract() {
    let all = cases();
    assert!(all.iter().any(|c| c.sq != c.sk && c.sk < 128) && all.iter().any(|c| c.sk > 128));
    assert!(all.iter().any(|c| c.hq != c.hk) && all.iter().any(|c| c.pad > 0));
    for case in all {
        let spec = case.spec();
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        let res = flash_attn::forward_fp8(&spec, &q, &k, &v, inputs.scales).expect("valid case");
        assert_eq!(res.out_shape, vec![case.b, case.sq, case.hq, case.d]);
        let (oracle, naive) = references(&spec, &inputs);
        let report = check::report_fp8(&res.out, &res.lse, &oracle, &naive);
        assert!(report.passed(), "{case:?}: {report}");
    }
}

/// `naive_fp8` rounds the probabilities to e4m3 before `P·V`: its error is larger than that of
/// Algorithm 0 in bf16 (which rounds `P` to 8 significant bits instead of 4) once a row sums many
/// keys. This fails if `P` is left unrounded.
#[test]
fn naive_fp8_rounds_p_to_e4m3_and_errs_more_than_naive_bf16() {
    for seed in 0..6 {
        let base = Fp8Case::random(0xF8_2000 + seed, [64, 128][seed as usize % 2], seed as usize % 4);
        let case = Fp8Case { sk: base.sk.max(64), window: None, ..base };
        let spec = case.spec();
        let inputs = case.inputs();
        let (oracle, naive) = references(&spec, &inputs);
        let fp8_err = check::compare_fp8(&naive.out, &oracle.out, &naive.out).max_err;

        // The same real inputs in bf16, against the oracle on exactly those inputs.
        let deq = inputs.dequantized();
        let to_bf16 = |x: &Vec<f32>| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
        let bf = [to_bf16(&deq[0]), to_bf16(&deq[1]), to_bf16(&deq[2])];
        let bf16_err = inputs.with_views(&bf, |q, k, v| {
            let oracle = reference::forward(&spec, q, k, v).expect("valid case");
            let naive = reference::naive(&spec, q, k, v).expect("valid case");
            check::max_abs(&naive.out.iter().zip(&oracle.out).map(|(a, b)| a - b).collect::<Vec<_>>())
        });
        assert!(fp8_err > bf16_err, "{case:?}: naive_fp8 err {fp8_err:.3e} <= naive_bf16 err {bf16_err:.3e}");
    }
}

/// The FP8 contract is not vacuous: a kernel that forgets a descale factor in the softmax scale,
/// or errs by a tenth of the output's magnitude, fails it.
#[test]
fn the_fp8_contract_rejects_a_forgotten_descale_and_a_ten_percent_error() {
    let case = Fp8Case { pad: 0, ..Fp8Case::random(0xF8_3000, 64, 0) };
    let case = Fp8Case { sq: 100, sk: 150, ..case };
    let spec = case.spec();
    let inputs = case.inputs();
    let (oracle, naive) = references(&spec, &inputs);
    let [q, k, v] = inputs.views();

    let forgot = Fp8Scales { q: 1.0, ..inputs.scales };
    let res = flash_attn::forward_fp8(&spec, &q, &k, &v, forgot).expect("valid case");
    assert!(!check::report_fp8(&res.out, &res.lse, &oracle, &naive).passed());

    let res = flash_attn::forward_fp8(&spec, &q, &k, &v, inputs.scales).expect("valid case");
    let ours: Vec<f64> = res.out.iter().map(|x| x.to_f64()).collect();
    assert!(check::compare_fp8(&ours, &oracle.out, &naive.out).passed());
    let mut off = ours.clone();
    let m = check::max_abs(&oracle.out);
    off[7] += 0.1 * m.max(1.0) + 2.0 * check::compare_fp8(&ours, &oracle.out, &naive.out).naive_err;
    assert!(!check::compare_fp8(&off, &oracle.out, &naive.out).passed());
}

/// Every option works through the `f32` path: with varlen, GQA, softcap, ALiBi and dropout, the
/// FP8 forward is the `f32` forward on the dequantized inputs, rounded to bf16, bit for bit.
#[test]
fn forward_fp8_is_the_f32_forward_of_the_dequantized_inputs_rounded_to_bf16() {
    let mut rng = Rng::new(0xF8_4000);
    let (tq, tk, hq, hk, d) = (70, 90, 4, 2, 32);
    let mut fill = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.normal() as f32).collect() };
    let ((q, dq), (k, dk), (v, dv)) =
        (fp8::quantize(&fill(tq * hq * d)), fp8::quantize(&fill(tk * hk * d)), fp8::quantize(&fill(tk * hk * d)));
    let scales = Fp8Scales { q: dq, k: dk, v: dv };
    let (cu_q, cu_k) = ([0, 30, 30, 70], [0, 50, 60, 90]);
    let slopes: Vec<f32> = (0..hq).map(|h| 0.05 * (h + 1) as f32).collect();
    let spec = AttentionSpec::new()
        .varlen(&cu_q, &cu_k)
        .causal()
        .softcap(20.0)
        .alibi_slopes(Tensor::new(&slopes, &[hq]))
        .dropout(0.2, 42, 7);
    let (qsh, ksh) = ([tq, hq, d], [tk, hk, d]);
    let res =
        flash_attn::forward_fp8(&spec, &Tensor::new(&q, &qsh), &Tensor::new(&k, &ksh), &Tensor::new(&v, &ksh), scales)
            .expect("valid case");
    let (qf, kf, vf) = (fp8::dequantize(&q, dq), fp8::dequantize(&k, dk), fp8::dequantize(&v, dv));
    let f32_res =
        flash_attn::forward::<f32>(&spec, &Tensor::new(&qf, &qsh), &Tensor::new(&kf, &ksh), &Tensor::new(&vf, &ksh))
            .expect("valid case");
    let rounded: Vec<bf16> = f32_res.out.iter().map(|&x| bf16::from_f32(x)).collect();
    assert_eq!(res.out, rounded);
    assert_eq!((res.lse, res.lse_shape, res.out_shape), (f32_res.lse, f32_res.lse_shape, f32_res.out_shape));
}

#[test]
fn non_finite_or_non_positive_descale_factors_are_errors() {
    let buf = vec![Fp8E4m3::from_f32(1.0); 2 * 3 * 2 * 16];
    let t = Tensor::new(&buf, &[2, 3, 2, 16]);
    for bad in [0.0, -0.0, -2.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for scales in [
            Fp8Scales { q: bad, ..Fp8Scales::default() },
            Fp8Scales { k: bad, ..Fp8Scales::default() },
            Fp8Scales { v: bad, ..Fp8Scales::default() },
        ] {
            let err = flash_attn::forward_fp8(&AttentionSpec::new(), &t, &t, &t, scales).expect_err("bad scale");
            assert!(matches!(err, Error::Fp8Scale { .. }), "{scales:?}: {err:?}");
        }
    }
    assert!(flash_attn::forward_fp8(&AttentionSpec::new(), &t, &t, &t, Fp8Scales::default()).is_ok());
}

#[test]
fn mismatched_shapes_are_errors_before_anything_is_allocated() {
    let buf = vec![Fp8E4m3::from_f32(0.5); 2 * 5 * 4 * 16];
    let q = Tensor::new(&buf, &[2, 5, 4, 16]);
    let k = Tensor::new(&buf[..2 * 5 * 2 * 8], &[2, 5, 2, 8]); // head dim 8 against q's 16
    let err = flash_attn::forward_fp8(&AttentionSpec::new(), &q, &k, &k, Fp8Scales::default()).expect_err("bad");
    assert!(matches!(err, Error::Shape(_)), "{err:?}");
    let k3 = Tensor::new(&buf[..5 * 3 * 16], &[1, 5, 3, 16]); // 3 kv heads for 4 query heads, batch 1
    let err = flash_attn::forward_fp8(&AttentionSpec::new(), &q, &k3, &k3, Fp8Scales::default()).expect_err("bad");
    assert!(matches!(err, Error::Shape(_) | Error::HeadRatio { .. }), "{err:?}");
    // A view claiming far more than its buffer: refused by the shape check, not by an allocation.
    let huge = Tensor::with_strides(&buf, &[1 << 20, 1 << 20, 4, 16], &[1 << 30, 64, 16, 1]);
    let err =
        flash_attn::forward_fp8(&AttentionSpec::new(), &huge, &huge, &huge, Fp8Scales::default()).expect_err("bad");
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err:?}");
    // A bad descale factor is reported before a bad shape.
    let bad = Fp8Scales { k: f32::NAN, ..Fp8Scales::default() };
    let err = flash_attn::forward_fp8(&AttentionSpec::new(), &q, &k, &k, bad).expect_err("bad");
    assert!(matches!(err, Error::Fp8Scale { tensor: "k", .. }), "{err:?}");
}

/// Empty and NaN inputs: no panic; a NaN element makes the rows that see it NaN, like the oracle.
#[test]
fn empty_and_nan_inputs_follow_the_oracle() {
    let empty: Vec<Fp8E4m3> = Vec::new();
    let t = Tensor::new(&empty, &[0, 3, 2, 16]);
    let res = flash_attn::forward_fp8(&AttentionSpec::new(), &t, &t, &t, Fp8Scales::default()).expect("empty batch");
    assert!(res.out.is_empty() && res.lse.is_empty());

    let mut buf = vec![Fp8E4m3::from_f32(0.25); 4 * 16];
    buf[16] = Fp8E4m3::from_bits(0x7F); // q row 1 (query 1) is NaN
    let t = Tensor::new(&buf, &[1, 4, 1, 16]);
    let res = flash_attn::forward_fp8(&AttentionSpec::new().causal(), &t, &t, &t, Fp8Scales::default()).expect("ok");
    let deq = fp8::dequantize(&buf, 1.0);
    let td = Tensor::new(&deq, &[1, 4, 1, 16]);
    let spec = AttentionSpec::new().causal();
    let (oracle, naive) = (
        reference::forward(&spec, &td, &td, &td).expect("ok"),
        reference::naive_fp8(&spec, &td, &td, &td).expect("ok"),
    );
    let report = check::report_fp8(&res.out, &res.lse, &oracle, &naive);
    assert!(report.passed(), "{report}");
    assert!(res.lse[0].is_finite() && res.lse[1].is_nan());
}
