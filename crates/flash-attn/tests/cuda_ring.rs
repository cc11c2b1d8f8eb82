//! Context parallelism on the GPU: the ring's steps on this backend's kernels, every rank
//! simulated on one GPU, and the NCCL ring over every GPU present; both against the f64 oracle of
//! the unsplit problem. `#[ignore]`d without a GPU (see tests/cuda.rs); on a GPU machine run with
//! `--include-ignored`, where a missing device or NCCL fails them.
#![cfg(feature = "cuda-backend")]

mod ring_common;

use flash_attn::check::Rng;
use flash_attn::cuda;
use flash_attn::ring::Layout;
use flash_attn::DType;
use half::{bf16, f16};
use ring_common::Problem;

/// A random problem the GPU kernels take: f16/bf16, head dims the backward has.
fn gpu_problem(rng: &mut Rng) -> Problem {
    let mut p = Problem::random(rng);
    p.dtype = rng.pick(&[DType::F16, DType::BF16]);
    let d = rng.pick(&[32, 64, 128]);
    (p.d, p.dv) = (d, d);
    p
}

fn check_on_gpu<T: cuda::CudaElement>(p: &Problem, rng: &mut Rng) {
    let dev = cuda::default_device().unwrap_or_else(|e| panic!("no GPU: {e}"));
    let (layout, ranks) = (p.layout, p.ranks);
    p.check_with::<T>(
        rng,
        |spec, q, k, v| cuda::ring::simulate_forward(dev, spec, layout, ranks, q, k, v),
        |spec, q, k, v, o, l, d| cuda::ring::simulate_backward(dev, spec, layout, ranks, q, k, v, o, l, d),
    );
}

#[test]
#[ignore = "needs a GPU"]
fn simulated_rings_on_one_gpu_meet_the_contract() {
    let cases: u64 = std::env::var("RING_GPU_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(48);
    for case in 0..cases {
        let mut rng = Rng::new(0x61_0000 + case);
        let p = gpu_problem(&mut rng);
        match p.dtype {
            DType::F16 => check_on_gpu::<f16>(&p, &mut rng),
            _ => check_on_gpu::<bf16>(&p, &mut rng),
        }
    }
    // Larger: zigzag causal over 8 ranks with GQA, and the contiguous layout over 4.
    let p = Problem {
        dtype: DType::BF16,
        layout: Layout::Zigzag,
        ranks: 8,
        causal: true,
        softcap: None,
        lens: vec![16 * 40, 16 * 8, 16 * 24],
        varlen: true,
        hq: 8,
        hk: 2,
        d: 128,
        dv: 128,
    };
    check_on_gpu::<bf16>(&p, &mut Rng::new(7));
    let p = Problem { layout: Layout::Contiguous, ranks: 4, lens: vec![4 * 96; 2], varlen: false, ..p };
    check_on_gpu::<bf16>(&p, &mut Rng::new(8));
}

#[cfg(feature = "nccl")]
mod nccl {
    use super::*;
    use flash_attn::check::{compare_gradients, report};
    use flash_attn::cuda::ring::{NcclRing, RingPass};
    use flash_attn::ring::{RingProblem, Sharding};
    use flash_attn::{reference, Gradients, Tensor};

    /// Every GPU present, as `Device`s.
    fn devices() -> Vec<cuda::Device> {
        (0..).map_while(|i| cuda::Device::new(i).ok()).collect()
    }

    /// The packed global tokens rank `r` holds, in its local order.
    fn local_tokens(sharding: &Sharding, lens: &[usize], r: usize) -> Vec<usize> {
        let mut out = Vec::new();
        let mut start = 0;
        for &len in lens {
            for (s, n) in sharding.ranges(r, len) {
                out.extend(start + s..start + s + n);
            }
            start += len;
        }
        out
    }

    fn gather_rows<T: Copy>(x: &[T], tokens: &[usize], row: usize) -> Vec<T> {
        tokens.iter().flat_map(|&t| x[t * row..(t + 1) * row].iter().copied()).collect()
    }

    fn run<T: cuda::CudaElement + cudarc::nccl::safe::NcclType>(p: &Problem, rng: &mut Rng) {
        let devs = devices();
        assert!(!devs.is_empty(), "no GPU");
        assert_eq!(p.ranks, devs.len());
        let data = p.data::<T>(rng);
        let spec = p.spec(&data);
        let [q, k, v] = data.views();
        let lens = &p.lens;
        let sharding = Sharding::new(p.layout, p.ranks).unwrap();
        let cu: Vec<i32> = std::iter::once(0)
            .chain(lens.iter().scan(0, |s, &l| {
                *s += l as i32;
                Some(*s)
            }))
            .collect();
        let cu_local = sharding.local_cu_seqlens(&cu).unwrap();
        let problem = RingProblem::new(&spec, p.layout, p.ranks, cu_local, (p.hq, p.hk), (p.d, p.dv)).unwrap();
        let total: usize = lens.iter().sum();
        let dout_all: Vec<T> = (0..total * p.hq * p.dv).map(|_| T::from_f64(rng.normal())).collect();
        let rings = NcclRing::for_devices(&devs.iter().collect::<Vec<_>>()).unwrap();
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = rings
                .into_iter()
                .zip(&devs)
                .map(|(mut ring, dev)| {
                    let (problem, sharding, data, dout_all) = (&problem, &sharding, &data, &dout_all);
                    s.spawn(move || {
                        // Timed: the events around each step must not change a result.
                        ring.set_step_timing(true);
                        let r = ring.rank();
                        let toks = local_tokens(sharding, lens, r);
                        let t = toks.len();
                        let up = |x: Vec<T>| dev.stream().clone_htod(&x).unwrap();
                        let lq = up(gather_rows(&data.q, &toks, p.hq * p.d));
                        let lk = up(gather_rows(&data.k, &toks, p.hk * p.d));
                        let lv = up(gather_rows(&data.v, &toks, p.hk * p.dv));
                        let ldo = up(gather_rows(dout_all, &toks, p.hq * p.dv));
                        let mut out = dev.stream().alloc_zeros::<T>(t * p.hq * p.dv).unwrap();
                        let mut lse = dev.stream().alloc_zeros::<f32>(p.hq * t).unwrap();
                        dev.ring_forward(
                            &ring,
                            problem,
                            &lq.slice(..),
                            &lk.slice(..),
                            &lv.slice(..),
                            &mut out,
                            &mut lse,
                        )
                        .unwrap();
                        let mut dq = dev.stream().alloc_zeros::<T>(t * p.hq * p.d).unwrap();
                        let mut dk = dev.stream().alloc_zeros::<T>(t * p.hk * p.d).unwrap();
                        let mut dv = dev.stream().alloc_zeros::<T>(t * p.hk * p.dv).unwrap();
                        dev.ring_backward(
                            &ring,
                            problem,
                            &lq.slice(..),
                            &lk.slice(..),
                            &lv.slice(..),
                            &out.slice(..),
                            &lse.slice(..),
                            &ldo.slice(..),
                            &mut dq,
                            &mut dk,
                            &mut dv,
                        )
                        .unwrap();
                        let down = |x: &cudarc::driver::CudaSlice<T>| dev.stream().clone_dtoh(x).unwrap();
                        let lse_h = dev.stream().clone_dtoh(&lse).unwrap();
                        let steps = ring.take_step_times().unwrap();
                        (toks, down(&out), lse_h, down(&dq), down(&dk), down(&dv), steps)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut out = vec![T::default(); total * p.hq * p.dv];
        let mut lse = vec![0f32; p.hq * total];
        let (mut dq, mut dk, mut dv) = (
            vec![T::default(); total * p.hq * p.d],
            vec![T::default(); total * p.hk * p.d],
            vec![T::default(); total * p.hk * p.dv],
        );
        for (r, (toks, o, l, gq, gk, gv, steps)) in results.iter().enumerate() {
            // One entry per pass and step, in order, each time finite and not negative; a chunk
            // travels at every step but the last.
            let want: Vec<(RingPass, usize)> = [RingPass::Forward, RingPass::Backward]
                .into_iter()
                .flat_map(|pass| (0..p.ranks).map(move |st| (pass, st)))
                .collect();
            let got: Vec<(RingPass, usize)> = steps.iter().map(|x| (x.pass, x.step)).collect();
            assert_eq!(got, want, "rank {r}: step times {steps:?}");
            for x in steps {
                for ms in [x.compute_ms, x.transfer_ms, x.wait_ms] {
                    assert!(ms.is_finite() && ms >= 0.0, "rank {r}: {x:?}");
                }
                let sends = x.pass == RingPass::Backward || x.step + 1 < p.ranks;
                assert_eq!(x.transfer_ms > 0.0, p.ranks > 1 && sends, "rank {r}: {x:?}");
            }
            let t = toks.len();
            for (lt, &g) in toks.iter().enumerate() {
                let put = |dst: &mut [T], src: &[T], row: usize| {
                    dst[g * row..(g + 1) * row].copy_from_slice(&src[lt * row..(lt + 1) * row])
                };
                put(&mut out, o, p.hq * p.dv);
                put(&mut dq, gq, p.hq * p.d);
                put(&mut dk, gk, p.hk * p.d);
                put(&mut dv, gv, p.hk * p.dv);
                for h in 0..p.hq {
                    lse[h * total + g] = l[h * t + lt];
                }
            }
        }
        let oracle = reference::forward(&spec, &q, &k, &v).unwrap();
        let naive = reference::naive(&spec, &q, &k, &v).unwrap();
        let rep = report(&out, &lse, &oracle, &naive, p.dtype);
        assert!(rep.passed(), "NCCL forward {}: {rep}", p.describe());
        let dout = Tensor::new(&dout_all, &[total, p.hq, p.dv]);
        let grads = Gradients {
            dq,
            dq_shape: vec![total, p.hq, p.d],
            dk,
            dk_shape: vec![total, p.hk, p.d],
            dv,
            dv_shape: vec![total, p.hk, p.dv],
        };
        let b = compare_gradients(&spec, &grads, &data, &dout, p.dtype).unwrap();
        assert!(b.passed(), "NCCL backward {}: {b}", p.describe());
    }

    #[test]
    #[ignore = "needs a GPU and NCCL"]
    fn nccl_ring_over_every_gpu_meets_the_contract() {
        let ranks = devices().len();
        assert!(ranks > 0, "no GPU");
        for (i, (layout, causal)) in
            [(Layout::Zigzag, true), (Layout::Contiguous, false), (Layout::Contiguous, true)].into_iter().enumerate()
        {
            let chunks = if layout == Layout::Zigzag { 2 * ranks } else { ranks };
            let p = Problem {
                dtype: DType::BF16,
                layout,
                ranks,
                causal,
                softcap: None,
                lens: vec![chunks * 64, chunks * 8, chunks * 24],
                varlen: true,
                hq: 8,
                hk: 2,
                d: 128,
                dv: 128,
            };
            run::<bf16>(&p, &mut Rng::new(90 + i as u64));
        }
    }
}
