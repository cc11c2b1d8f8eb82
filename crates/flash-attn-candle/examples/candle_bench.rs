//! The op's overhead on the GPU: `flash_attn` (and with `--backward`, `flash_attn(..)?.backward()`)
//! through candle, against the library's `Device::forward` / `backward_with_workspace` on the same
//! candle buffers and stream (`direct`), and against that plus the bookkeeping candle's autograd
//! does for any op (`direct+ag`: the ones seed, and per input gradient a zeros tensor it is added
//! to), which isolates the op's own cost. Each side is timed as the CLI's `bench` times: CUDA events made up
//! front, calls queued back to back each between its own pair, one synchronisation, the median;
//! the sides alternate per round.
//!
//!     cargo run --release -p flash-attn-candle --features cuda --example candle_bench -- [--backward]

use std::time::Instant;

use candle::{DType, Device, Tensor};
use cudarc::driver::CudaSlice;
use flash_attn::cuda::{DeviceTensor, DeviceTensorMut};
use flash_attn::AttentionSpec;
use half::bf16;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        0.5 * (xs[n / 2 - 1] + xs[n / 2])
    }
}

/// Median ms of `call` between CUDA events on `stream`, `runs` calls after a warm-up.
fn time(stream: &std::sync::Arc<cudarc::driver::CudaStream>, runs: usize, call: &mut dyn FnMut()) -> f64 {
    call();
    stream.synchronize().expect("sync");
    let ctx = stream.context();
    let event = || ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).expect("event");
    let pairs: Vec<_> = (0..runs).map(|_| (event(), event())).collect();
    for (a, b) in &pairs {
        a.record(stream).expect("record");
        call();
        b.record(stream).expect("record");
    }
    stream.synchronize().expect("sync");
    median(pairs.iter().map(|(a, b)| f64::from(a.elapsed_ms(b).expect("elapsed"))).collect())
}

fn main() -> candle::Result<()> {
    let backward = std::env::args().any(|a| a == "--backward");
    let gpu = Device::new_cuda(0)?;
    let Device::Cuda(cd) = &gpu else { unreachable!("a CUDA device") };
    let stream = cd.cuda_stream();
    let dev = flash_attn::cuda::Device::new(stream.context().ordinal())
        .and_then(|d| d.with_stream(stream.clone()))
        .map_err(candle::Error::wrap)?;
    println!("mode     b,h,s,d               causal   candle_ms   direct_ms direct+ag_ms  vs_direct vs_direct+ag");
    let started = Instant::now();
    let (mut overheads, mut own) = (Vec::new(), Vec::new());
    for (b, h, s, d) in [
        (16usize, 16usize, 1024usize, 128usize),
        (4, 16, 4096, 128),
        (1, 16, 16384, 128),
        (16, 32, 1024, 64),
        (4, 32, 4096, 64),
    ] {
        for causal in [false, true] {
            let shape = [b, s, h, d];
            let q = Tensor::randn(0f32, 1.0, (b, s, h, d), &gpu)?.to_dtype(DType::BF16)?;
            let k = Tensor::randn(0f32, 1.0, (b, s, h, d), &gpu)?.to_dtype(DType::BF16)?;
            let v = Tensor::randn(0f32, 1.0, (b, s, h, d), &gpu)?.to_dtype(DType::BF16)?;
            let scale = 1.0 / (d as f32).sqrt();
            let (qv, kv, vv) =
                (candle::Var::from_tensor(&q)?, candle::Var::from_tensor(&k)?, candle::Var::from_tensor(&v)?);
            let mut through_candle = || {
                let out = flash_attn_candle::flash_attn(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), scale, causal)
                    .expect("op");
                if backward {
                    out.backward().expect("backward");
                }
            };
            // The library on the same buffers.
            let slice = |t: &Tensor| -> CudaSlice<bf16> {
                let (st, _) = t.storage_and_layout();
                match &*st {
                    candle::Storage::Cuda(c) => c.as_cuda_slice::<bf16>().expect("bf16").clone(),
                    _ => unreachable!("on the GPU"),
                }
            };
            let (sq, sk, sv) = (slice(&q), slice(&k), slice(&v));
            let n = b * s * h * d;
            let mut out = stream.alloc_zeros::<bf16>(n).expect("alloc");
            let mut lse = stream.alloc_zeros::<f32>(b * h * s).expect("alloc");
            let ones = stream.clone_htod(&vec![bf16::ONE; n]).expect("upload");
            let spec =
                if causal { AttentionSpec::new().scale(scale).causal() } else { AttentionSpec::new().scale(scale) };
            let mut direct = |with_autograd_bookkeeping: bool| {
                let (qt, kt, vt) = (
                    DeviceTensor::new(sq.as_view(), &shape),
                    DeviceTensor::new(sk.as_view(), &shape),
                    DeviceTensor::new(sv.as_view(), &shape),
                );
                dev.forward(
                    &spec,
                    &qt,
                    &kt,
                    &vt,
                    &mut DeviceTensorMut::new(out.as_view_mut(), &shape),
                    &mut lse.as_view_mut(),
                )
                .expect("forward");
                if backward {
                    let mut g = [stream.alloc_zeros::<bf16>(n), stream.alloc_zeros(n), stream.alloc_zeros(n)]
                        .map(|x| x.expect("alloc"));
                    let bytes = dev.backward_workspace_bytes(&spec, &qt, &kt, &vt).expect("workspace");
                    let mut ws = stream.alloc_zeros::<u8>(bytes).expect("alloc");
                    let [gq, gk, gv] = &mut g;
                    dev.backward_with_workspace(
                        &spec,
                        &qt,
                        &kt,
                        &vt,
                        &DeviceTensor::new(out.as_view(), &shape),
                        &lse.as_view(),
                        &DeviceTensor::new(ones.as_view(), &shape),
                        &mut DeviceTensorMut::new(gq.as_view_mut(), &shape),
                        &mut DeviceTensorMut::new(gk.as_view_mut(), &shape),
                        &mut DeviceTensorMut::new(gv.as_view_mut(), &shape),
                        &mut ws.as_view_mut(),
                    )
                    .expect("backward");
                    if with_autograd_bookkeeping {
                        let cd = match &gpu {
                            Device::Cuda(cd) => cd.clone(),
                            _ => unreachable!("on the GPU"),
                        };
                        let wrapped = |s: CudaSlice<bf16>| {
                            Tensor::from_storage(
                                candle::Storage::Cuda(candle::CudaStorage::wrap_cuda_slice(s, cd.clone())),
                                shape.to_vec(),
                                candle::op::BackpropOp::none(),
                                false,
                            )
                        };
                        let seed = q.ones_like().expect("ones");
                        for g in g {
                            let sum = q.zeros_like().and_then(|z| z.add(&wrapped(g))).expect("add");
                            drop(sum);
                        }
                        drop(seed);
                    }
                }
            };
            let runs = if s >= 4096 { 20 } else { 50 };
            let (mut a, mut c, mut e) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..3 {
                a.push(time(&stream, runs, &mut through_candle));
                c.push(time(&stream, runs, &mut || direct(false)));
                if backward {
                    e.push(time(&stream, runs, &mut || direct(true)));
                }
            }
            let (ta, tc) = (median(a), median(c));
            let te = if backward { median(e) } else { tc };
            overheads.push(ta / tc - 1.0);
            own.push(ta / te - 1.0);
            println!(
                "{:8} {:21} {:6} {:11.3} {:11.3} {:11.3} {:+8.1}% {:+8.1}%",
                if backward { "fwdbwd" } else { "fwd" },
                format!("{b},{h},{s},{d}"),
                causal,
                ta,
                tc,
                te,
                100.0 * (ta / tc - 1.0),
                100.0 * (ta / te - 1.0)
            );
        }
    }
    let max = |xs: &[f64]| xs.iter().copied().fold(f64::MIN, f64::max);
    println!(
        "overhead vs direct: median {:+.1}%, max {:+.1}%; vs direct + autograd bookkeeping: median {:+.1}%, max {:+.1}% ({:.0} s)",
        100.0 * median(overheads.clone()),
        100.0 * max(&overheads),
        100.0 * median(own.clone()),
        100.0 * max(&own),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
