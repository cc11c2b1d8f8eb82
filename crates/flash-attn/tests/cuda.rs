//! The CUDA backend's contract. On machines without a GPU (CI), tests that need one pass after
//! checking that the absence is reported as an error, not a panic.
#![cfg(feature = "cuda")]

use flash_attn::check::{report, Case, Rng, Storage};
use flash_attn::cuda::{self, Arch};
use flash_attn::{reference, AttentionSpec, Causal, DType, Error, Tensor};
use half::bf16;

fn no_gpu(e: &Error) -> bool {
    matches!(e, Error::CudaUnavailable(_) | Error::NvrtcUnavailable(_))
}

#[test]
fn missing_driver_or_nvrtc_is_an_error_not_a_panic() {
    if let Err(e) = cuda::default_device() {
        assert!(no_gpu(&e), "unexpected error: {e}");
    }
}

#[test]
fn unsupported_options_are_typed_errors() {
    let x = vec![bf16::from_f32(0.5); 2 * 8 * 2 * 64];
    let t = Tensor::new(&x, &[2, 8, 2, 64]);
    let r = cuda::forward_host(&AttentionSpec::new().softcap(30.0), &t, &t, &t);
    assert!(matches!(r, Err(Error::Unsupported(_))), "{r:?}");
    let y = vec![bf16::from_f32(0.5); 2 * 8 * 2 * 96];
    let t = Tensor::new(&y, &[2, 8, 2, 96]);
    let r = cuda::forward_host(&AttentionSpec::new(), &t, &t, &t);
    assert!(matches!(r, Err(Error::HeadDim { .. })), "{r:?}");
}

#[test]
fn every_variant_compiles_for_sm80_and_sm90a() {
    let archs = [Arch("sm_80".into()), Arch("sm_90a".into())];
    match cuda::compile_all(&archs) {
        Err(e) => assert!(no_gpu(&e), "unexpected error: {e}"),
        Ok(reports) => {
            for r in reports {
                assert!(r.ok(), "{} for {}: {:?}", r.name, r.arch, r.result);
            }
        }
    }
}

#[test]
fn forward_meets_the_numerics_contract_on_random_cases() {
    if cuda::default_device().is_err() {
        return;
    }
    let mut rng = Rng::new(11);
    for _ in 0..40 {
        let mut c = Case::random(&mut rng);
        c.dtype = DType::BF16;
        c.d = rng.pick(&[64, 128]);
        c.dv = c.d;
        (c.softcap, c.alibi, c.block) = (None, None, None);
        if let Storage::Strided { .. } = c.storage {
            c.storage = Storage::Strided { pad: 8 };
        }
        let data = c.data::<bf16>();
        let spec = c.spec(&data);
        let [q, k, v] = data.views();
        let ours = cuda::forward_host(&spec, &q, &k, &v).expect("cuda forward");
        let oracle = reference::forward(&spec, &q, &k, &v).expect("oracle");
        let naive = reference::naive(&spec, &q, &k, &v).expect("naive");
        let rep = report(&ours.out, &ours.lse, &oracle, &naive, c.dtype);
        assert!(rep.passed(), "{c}: {rep}");
    }
}

#[test]
fn fully_masked_rows_give_zero_output_and_neg_inf_lse() {
    if cuda::default_device().is_err() {
        return;
    }
    // Bottom-right causal with sq > sk: the first sq - sk rows see no key.
    let (sq, sk, h, d) = (70, 20, 2, 64);
    let mut rng = Rng::new(3);
    let mut r = |n: usize| (0..n).map(|_| bf16::from_f64(rng.normal())).collect::<Vec<_>>();
    let (q, k, v) = (r(sq * h * d), r(sk * h * d), r(sk * h * d));
    let spec = AttentionSpec::new().causal_mode(Causal::BottomRight);
    let res = cuda::forward_host(
        &spec,
        &Tensor::new(&q, &[1, sq, h, d]),
        &Tensor::new(&k, &[1, sk, h, d]),
        &Tensor::new(&v, &[1, sk, h, d]),
    )
    .expect("cuda forward");
    for i in 0..sq - sk {
        for hh in 0..h {
            assert_eq!(res.lse[hh * sq + i], f32::NEG_INFINITY);
            assert!(res.out[(i * h + hh) * d..][..d].iter().all(|x| x.to_f32() == 0.0));
        }
    }
}
