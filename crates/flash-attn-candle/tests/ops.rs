//! Every function against the library's f64 oracle under the numerics contract (DESIGN §2), on
//! random inputs seeded per case, forward and (through candle's autograd) backward; strided
//! inputs; errors.

use candle::{DType, Device, Tensor, Var};
use flash_attn::check::{compare, compare_gradient, max_abs, Rng};
use flash_attn::{reference, AttentionSpec, Element};
use half::{bf16, f16};

/// One random problem: sizes, options, and the host data of each input.
#[derive(Debug, Clone)]
struct Problem {
    /// `Some(cu)`: varlen with these cumulative lengths (q and k alike).
    varlen: Option<Vec<i32>>,
    b: usize,
    sq: usize,
    sk: usize,
    hq: usize,
    hk: usize,
    d: usize,
    scale: f32,
    window: (Option<usize>, Option<usize>),
    softcap: f32,
    alibi: Option<Vec<f32>>,
}

impl Problem {
    fn random(rng: &mut Rng, varlen: bool) -> Self {
        let hk = rng.pick(&[1usize, 2, 4]);
        let hq = hk * rng.pick(&[1usize, 2, 3]);
        let b = rng.range(1, 4);
        let sq = rng.range(1, 70);
        let sk = if varlen { sq } else { rng.range(1, 90) };
        let window = match rng.range(0, 4) {
            0 => (None, None),
            1 => (None, Some(0)),
            2 => (Some(rng.range(0, 40)), Some(rng.range(0, 10))),
            _ => (Some(rng.range(0, 30)), Some(0)),
        };
        let cu = varlen.then(|| {
            let mut cu = vec![0i32];
            for _ in 0..b {
                let last = *cu.last().unwrap_or(&0);
                cu.push(last + rng.range(1, 50) as i32);
            }
            cu
        });
        Self {
            varlen: cu,
            b,
            sq,
            sk,
            hq,
            hk,
            d: rng.pick(&[8usize, 16, 40, 64]),
            scale: (0.5 + rng.uniform()) as f32 / 8.0,
            window,
            softcap: if rng.chance(0.3) { 5.0 } else { 0.0 },
            alibi: rng.chance(0.3).then(|| (0..hq).map(|_| rng.uniform() as f32 * 0.5).collect()),
        }
    }

    fn q_shape(&self) -> Vec<usize> {
        match &self.varlen {
            Some(cu) => vec![*cu.last().unwrap_or(&0) as usize, self.hq, self.d],
            None => vec![self.b, self.sq, self.hq, self.d],
        }
    }

    fn k_shape(&self) -> Vec<usize> {
        match &self.varlen {
            Some(cu) => vec![*cu.last().unwrap_or(&0) as usize, self.hk, self.d],
            None => vec![self.b, self.sk, self.hk, self.d],
        }
    }

    /// The library spec of this problem (what the candle call must compute).
    fn spec(&self) -> AttentionSpec<'_> {
        let mut spec = AttentionSpec::new().scale(self.scale);
        let side = |x: Option<usize>| x.map_or(-1, |x| x as i64);
        match self.window {
            (None, None) => {}
            (None, Some(0)) => spec = spec.causal(),
            (l, r) => spec = spec.window(side(l), side(r)),
        }
        if self.softcap != 0.0 {
            spec = spec.softcap(self.softcap);
        }
        if let Some(a) = &self.alibi {
            spec = spec.alibi_slopes(flash_attn::Tensor::new(a, &[self.hq]));
        }
        if let Some(cu) = &self.varlen {
            spec = spec.varlen(cu, cu);
        }
        spec
    }

    /// Fits the options to function `f` of [`Problem::call`] (`f % 5`: plain, windowed, alibi,
    /// alibi + window, alibi + window + softcap).
    fn for_function(mut self, f: usize, rng: &mut Rng) -> Self {
        let f = f % 5;
        if f == 0 || f == 2 {
            self.window = if rng.chance(0.5) { (None, Some(0)) } else { (None, None) };
        }
        if (2..4).contains(&f) && self.alibi.is_none() {
            self.alibi = Some((0..self.hq).map(|_| rng.uniform() as f32 * 0.5).collect());
        }
        if f < 2 {
            self.alibi = None;
        }
        self.softcap = if f == 4 { 5.0 } else { 0.0 };
        self
    }

    /// Our call through function `f` (`f % 5` as in [`Problem::for_function`], the varlen form
    /// when the problem is varlen).
    fn call(&self, q: &Tensor, k: &Tensor, v: &Tensor, f: usize) -> candle::Result<Tensor> {
        let alibi = match &self.alibi {
            Some(a) => Some(Tensor::from_vec(a.clone(), self.hq, q.device())?),
            None => None,
        };
        let (l, r) = self.window;
        let causal = l.is_none() && r == Some(0);
        let (sc, cap) = (self.scale, self.softcap);
        let a = alibi.as_ref();
        let slopes = || a.ok_or_else(|| candle::Error::Msg("no slopes".into()));
        match &self.varlen {
            None => match f % 5 {
                0 => flash_attn_candle::flash_attn(q, k, v, sc, causal),
                1 => flash_attn_candle::flash_attn_windowed(q, k, v, sc, l, r),
                2 => flash_attn_candle::flash_attn_alibi(q, k, v, slopes()?, sc, causal),
                3 => flash_attn_candle::flash_attn_alibi_windowed(q, k, v, slopes()?, sc, l, r),
                _ => flash_attn_candle::flash_attn_alibi_windowed_softcap(q, k, v, a, sc, l, r, cap),
            },
            Some(cu) => {
                let cu: Vec<u32> = cu.iter().map(|&x| x as u32).collect();
                let n = cu.len();
                let s = &Tensor::from_vec(cu, n, q.device())?;
                let m = self.sq;
                match f % 5 {
                    0 => flash_attn_candle::flash_attn_varlen(q, k, v, s, s, m, m, sc, causal),
                    1 => flash_attn_candle::flash_attn_varlen_windowed(q, k, v, s, s, m, m, sc, l, r),
                    2 => flash_attn_candle::flash_attn_varlen_alibi(q, k, v, slopes()?, s, s, m, m, sc, causal),
                    3 => flash_attn_candle::flash_attn_varlen_alibi_windowed(q, k, v, slopes()?, s, s, m, m, sc, l, r),
                    _ => flash_attn_candle::flash_attn_varlen_alibi_windowed_softcap(
                        q, k, v, a, s, s, m, m, sc, l, r, cap,
                    ),
                }
            }
        }
    }
}

fn random<T: Element>(rng: &mut Rng, shape: &[usize]) -> Vec<T> {
    (0..shape.iter().product::<usize>()).map(|_| T::from_f64(rng.normal())).collect()
}

fn host<T: Element + candle::WithDType>(t: &Tensor) -> Vec<T> {
    t.flatten_all().and_then(|t| t.to_device(&Device::Cpu)).and_then(|t| t.to_vec1::<T>()).expect("to host")
}

/// Forward and backward of one problem in dtype `T` on `dev` against the oracle.
fn check_problem<T: Element + candle::WithDType>(p: &Problem, rng: &mut Rng, f: usize, dev: &Device) {
    let (qs, ks) = (p.q_shape(), p.k_shape());
    let (q, k, v, dout) = (random::<T>(rng, &qs), random::<T>(rng, &ks), random::<T>(rng, &ks), random::<T>(rng, &qs));
    let dev = dev.clone();
    let var =
        |x: &[T], s: &[usize]| Var::from_tensor(&Tensor::from_vec(x.to_vec(), s, &dev).expect("tensor")).expect("var");
    let (qv, kv, vv) = (var(&q, &qs), var(&k, &ks), var(&v, &ks));
    let out = p.call(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), f).expect("our call");
    assert_eq!(out.dims(), qs.as_slice());
    assert!(out.device().same_device(&dev));
    let dout_t = Tensor::from_vec(dout.clone(), qs.as_slice(), &dev).expect("tensor");
    let loss = (&out * &dout_t).and_then(|x| x.to_dtype(DType::F32)).and_then(|x| x.sum_all()).expect("loss");
    let grads = loss.backward().expect("backward");

    let spec = p.spec();
    let (tq, tk) = (flash_attn::Tensor::new(&q, &qs), flash_attn::Tensor::new(&k, &ks));
    let (tv, tdo) = (flash_attn::Tensor::new(&v, &ks), flash_attn::Tensor::new(&dout, &qs));
    let oracle = reference::forward(&spec, &tq, &tk, &tv).expect("oracle");
    let naive = reference::naive(&spec, &tq, &tk, &tv).expect("naive");
    let widen = |x: &[T]| x.iter().map(|v| Element::to_f64(*v)).collect::<Vec<_>>();
    let cmp = compare(&widen(&host::<T>(&out)), &oracle.out, &naive.out, <T as Element>::DTYPE);
    assert!(cmp.passed(), "out: {cmp}\n{p:?}");

    let og = reference::backward(&spec, &tq, &tk, &tv, &tdo).expect("oracle backward");
    let ng = reference::naive_backward(&spec, &tq, &tk, &tv, &tdo).expect("naive backward");
    let m = max_abs(&og.dq).max(max_abs(&og.dk)).max(max_abs(&og.dv));
    for (name, v, o, n) in [("dq", &qv, &og.dq, &ng.dq), ("dk", &kv, &og.dk, &ng.dk), ("dv", &vv, &og.dv, &ng.dv)] {
        let g = grads.get(v.as_tensor()).unwrap_or_else(|| panic!("no gradient for {name}"));
        assert_eq!(g.dims(), v.as_tensor().dims());
        let cmp = compare_gradient(&widen(&host::<T>(g)), o, n, <T as Element>::DTYPE, m);
        assert!(cmp.passed(), "{name}: {cmp}\n{p:?}");
    }
}

#[test]
fn every_function_meets_the_contract_forward_and_backward() {
    // Each of the ten functions (5 dense, 5 varlen) in each dtype, twice.
    let mut rng = Rng::new(0x5eed_ca9d1e);
    for case in 0..60 {
        let (f, varlen, dtype) = (case % 5, (case / 5) % 2 == 1, (case / 10) % 3);
        let p = Problem::random(&mut rng, varlen).for_function(f, &mut rng);
        match dtype {
            0 => check_problem::<f32>(&p, &mut rng, f, &Device::Cpu),
            1 => check_problem::<bf16>(&p, &mut rng, f, &Device::Cpu),
            _ => check_problem::<f16>(&p, &mut rng, f, &Device::Cpu),
        }
    }
}

/// The same on CUDA tensors (f16, bf16): the library's kernels on candle's buffers and stream.
#[cfg(feature = "cuda")]
#[test]
fn cuda_every_function_meets_the_contract_forward_and_backward() {
    let dev = Device::new_cuda(0).expect("a CUDA device (this test needs the GPU it was built for)");
    let mut rng = Rng::new(0xc0da);
    for case in 0..40 {
        let (f, varlen, half) = (case % 5, (case / 5) % 2 == 1, (case / 10) % 2);
        let p = Problem::random(&mut rng, varlen).for_function(f, &mut rng);
        if half == 0 {
            check_problem::<bf16>(&p, &mut rng, f, &dev);
        } else {
            check_problem::<f16>(&p, &mut rng, f, &dev);
        }
    }
}

#[test]
fn strided_and_offset_inputs_give_the_contiguous_result() {
    let dev = Device::Cpu;
    let (b, s, h, d) = (2, 33, 4, 32);
    // [b, h, s, d] storage seen as [b, s, h, d] (what a model's transpose hands over), and a
    // narrowed tensor with a start offset.
    let base = Tensor::randn(0f32, 1.0, (b, h, s + 5, d), &dev).expect("randn");
    let q = base.narrow(2, 5, s).and_then(|t| t.transpose(1, 2)).expect("view");
    assert!(!q.is_contiguous());
    let k = Tensor::randn(0f32, 1.0, (b, s, 2, d), &dev).expect("randn");
    let ours = flash_attn_candle::flash_attn(&q, &k, &k, 0.2, true).expect("strided");
    let want = flash_attn_candle::flash_attn(&q.contiguous().expect("copy"), &k, &k, 0.2, true).expect("contiguous");
    let diff = (ours - want).and_then(|x| x.abs()).and_then(|x| x.max_all()).and_then(|x| x.to_scalar::<f32>());
    assert_eq!(diff.expect("diff"), 0.0);
}

/// The paged call against the dense varlen call on the same keys gathered (both ours; the
/// dense one is checked against the oracle above): per-sequence calls (`lens_q` unequal) and the
/// one batched call of decoding (equal).
fn check_paged(dev: &Device, dtype: DType, lens_q: &[usize], tol: f32) {
    let mut rng = Rng::new(77);
    let (hq, hk, d, page) = (4, 2, 32, 7);
    let lens_k = [20usize, 3, 41];
    let pages_per = lens_k.iter().map(|l| l.div_ceil(page)).max().unwrap_or(1);
    let num_pages = lens_k.len() * pages_per + 2;
    let kc: Vec<f32> = random(&mut rng, &[num_pages, page, hk, d]);
    let vc: Vec<f32> = random(&mut rng, &[num_pages, page, hk, d]);
    // Sequence i owns pages in a shuffled order.
    let mut order: Vec<u32> = (0..num_pages as u32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.range(0, i));
    }
    let table: Vec<u32> = order[..lens_k.len() * pages_per].to_vec();
    let total_q: usize = lens_q.iter().sum();
    let q: Vec<f32> = random(&mut rng, &[total_q, hq, d]);
    let t = |x: Vec<f32>, s: &[usize]| Tensor::from_vec(x, s, dev).and_then(|t| t.to_dtype(dtype)).expect("tensor");
    let cu = |lens: &[usize]| {
        let mut c = vec![0u32];
        for l in lens {
            c.push(c[c.len() - 1] + *l as u32);
        }
        Tensor::from_vec(c, lens.len() + 1, dev).expect("tensor")
    };
    let (kt, vt) = (t(kc.clone(), &[num_pages, page, hk, d]), t(vc.clone(), &[num_pages, page, hk, d]));
    let qt = t(q.clone(), &[total_q, hq, d]);
    let table_t = Tensor::from_vec(table.clone(), (lens_k.len(), pages_per), dev).expect("tensor");
    let out = flash_attn_candle::flash_attn_varlen_paged_windowed(
        &qt,
        &kt,
        &vt,
        &cu(lens_q),
        &cu(&lens_k),
        &table_t,
        None,
        3,
        41,
        0.25,
        None,
        Some(0),
        page,
        None,
    )
    .expect("paged call");
    assert!(out.device().same_device(dev));
    // The same keys gathered into a dense varlen batch, attended causally.
    let gather = |cache: &[f32]| {
        let mut dense = Vec::new();
        for (i, &len) in lens_k.iter().enumerate() {
            for j in 0..len {
                let p = table[i * pages_per + j / page] as usize;
                let at = (p * page + j % page) * hk * d;
                dense.extend_from_slice(&cache[at..at + hk * d]);
            }
        }
        dense
    };
    let tk: usize = lens_k.iter().sum();
    let (dk, dv) = (t(gather(&kc), &[tk, hk, d]), t(gather(&vc), &[tk, hk, d]));
    let want = flash_attn_candle::flash_attn_varlen(&qt, &dk, &dv, &cu(lens_q), &cu(&lens_k), 3, 41, 0.25, true)
        .expect("dense call");
    let diff = (out.to_dtype(DType::F32).expect("f32") - want.to_dtype(DType::F32).expect("f32"))
        .and_then(|x| x.abs())
        .and_then(|x| x.max_all())
        .and_then(|x| x.to_scalar::<f32>());
    let diff = diff.expect("diff");
    assert!(diff < tol, "{lens_q:?}: max difference {diff}");
}

#[test]
fn paged_kv_cache_matches_the_dense_call() {
    check_paged(&Device::Cpu, DType::F32, &[1, 3, 2], 1e-5);
    check_paged(&Device::Cpu, DType::F32, &[1, 1, 1], 1e-5);
    check_paged(&Device::Cpu, DType::BF16, &[2, 2, 2], 2e-2);
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_paged_kv_cache_matches_the_dense_call() {
    let dev = Device::new_cuda(0).expect("a CUDA device");
    check_paged(&dev, DType::BF16, &[1, 3, 2], 2e-2);
    check_paged(&dev, DType::BF16, &[1, 1, 1], 2e-2);
    check_paged(&dev, DType::F16, &[2, 2, 2], 4e-3);
}

#[test]
fn bad_inputs_are_errors() {
    let dev = Device::Cpu;
    let q = Tensor::zeros((1, 8, 4, 16), DType::F32, &dev).expect("zeros");
    let k3 = Tensor::zeros((1, 8, 3, 16), DType::F32, &dev).expect("zeros");
    assert!(flash_attn_candle::flash_attn(&q, &k3, &k3, 1.0, false).is_err(), "4 query heads over 3 kv heads");
    let kb = q.to_dtype(DType::BF16).expect("bf16");
    assert!(flash_attn_candle::flash_attn(&q, &kb, &kb, 1.0, false).is_err(), "mixed dtypes");
    let qd = q.to_dtype(DType::F64).expect("f64");
    assert!(flash_attn_candle::flash_attn(&qd, &qd, &qd, 1.0, false).is_err(), "f64");
    let half = Tensor::zeros(4, DType::F16, &dev).expect("zeros");
    assert!(flash_attn_candle::flash_attn_alibi(&q, &q, &q, &half, 1.0, false).is_err(), "f16 slopes");
    let flat = Tensor::zeros((8, 4, 16), DType::F32, &dev).expect("zeros");
    let bad = Tensor::from_vec(vec![0u32, 5, 3], 3, &dev).expect("tensor");
    assert!(flash_attn_candle::flash_attn_varlen(&flat, &flat, &flat, &bad, &bad, 5, 5, 1.0, false).is_err());
    let signed = Tensor::from_vec(vec![0i64, 8], 2, &dev).expect("tensor");
    assert!(flash_attn_candle::flash_attn_varlen(&flat, &flat, &flat, &signed, &signed, 8, 8, 1.0, false).is_err());
    let rank3 = Tensor::zeros((8, 4, 16), DType::F32, &dev).expect("zeros");
    assert!(flash_attn_candle::flash_attn(&rank3, &rank3, &rank3, 1.0, false).is_err(), "rank 3");
}
