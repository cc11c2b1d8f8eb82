//! Context parallelism over every GPU present (NCCL): one long sequence split over R GPUs against
//! the same sequence on one GPU, forward and forward + backward, and the ring with its transfers
//! switched off (compute alone) to show how much of the transfer is hidden.
//!
//! ```text
//! ring_bench [--seqs 32768,65536,131072] [--ranks R] [--hq 32] [--hk 8] [--d 128]
//!            [--causal both|true|false] [--reps 5] [--steps]
//! ```
//! Causal runs use the zigzag layout, the others the contiguous one; bf16, one sequence (b = 1).
//! Every timed configuration is first checked: the ring's `out`, `dq`, `dk`, `dv` against the
//! one-GPU result, within the contract's floor `eps_T · max(1, magnitude)` (the f64 oracle is out
//! of reach at these lengths); a violation exits 1. Times: wall clock between barriers after a
//! stream synchronisation on every rank, medians over `--reps` after a warm-up.
//!
//! With `--steps`, one more forward + backward call per configuration, with and without its
//! transfers, records CUDA events around every step ([`NcclRing::set_step_timing`]) and prints,
//! per rank, pass and step: the step's compute, its transfers (on their own stream) and how long
//! the compute stream stood waiting for a transfer. A transfer is hidden when that wait is
//! (near) 0 and no larger than without transfers.

use std::sync::Barrier;
use std::time::Instant;

use cudarc::driver::CudaSlice;
use flash_attn::check::Rng;
use flash_attn::cuda::ring::{NcclRing, RingPass, StepTime};
use flash_attn::cuda::{self, DeviceTensor, DeviceTensorMut};
use flash_attn::ring::{Layout, RingProblem, Sharding};
use flash_attn::{AttentionSpec, Result};
use half::bf16;

struct Args {
    seqs: Vec<usize>,
    ranks: Option<usize>,
    hq: usize,
    hk: usize,
    d: usize,
    causal: Vec<bool>,
    reps: usize,
    steps: bool,
}

fn parse() -> Args {
    let mut a = Args {
        seqs: vec![32768, 65536, 131072],
        ranks: None,
        hq: 32,
        hk: 8,
        d: 128,
        causal: vec![false, true],
        reps: 5,
        steps: false,
    };
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(at) = args.iter().position(|x| x == "--steps") {
        a.steps = true;
        args.remove(at);
    }
    let mut i = 0;
    while i + 1 < args.len() {
        let v = &args[i + 1];
        match args[i].as_str() {
            "--seqs" => a.seqs = v.split(',').filter_map(|x| x.parse().ok()).collect(),
            "--ranks" => a.ranks = v.parse().ok(),
            "--hq" => a.hq = v.parse().unwrap_or(a.hq),
            "--hk" => a.hk = v.parse().unwrap_or(a.hk),
            "--d" => a.d = v.parse().unwrap_or(a.d),
            "--reps" => a.reps = v.parse().unwrap_or(a.reps),
            "--causal" => {
                a.causal = match v.as_str() {
                    "true" => vec![true],
                    "false" => vec![false],
                    _ => vec![false, true],
                }
            }
            other => {
                eprintln!("unknown option {other}");
                std::process::exit(2);
            }
        }
        i += 2;
    }
    a
}

/// A rank's median times (ring fwd, fwd+bwd; without transfers fwd, fwd+bwd), its `out`, `dq`,
/// `dk`, `dv`, and with `--steps` its step times with and without transfers.
type RankResult = (Vec<f64>, Vec<Vec<bf16>>, [Vec<StepTime>; 2]);

/// One rank's outputs.
struct Bufs {
    out: CudaSlice<bf16>,
    lse: CudaSlice<f32>,
    dq: CudaSlice<bf16>,
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

fn main() {
    if let Err(e) = run(parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn random(n: usize, rng: &mut Rng) -> Vec<bf16> {
    (0..n).map(|_| bf16::from_f64(rng.normal())).collect()
}

/// `max |a - b|` and the contract's floor for `b`'s magnitude.
fn within(a: &[bf16], b: &[bf16], eps: f64) -> (f64, f64) {
    let err = a.iter().zip(b).map(|(x, y)| (x.to_f64() - y.to_f64()).abs()).fold(0.0, f64::max);
    let mag = b.iter().map(|y| y.to_f64().abs()).fold(0.0, f64::max);
    (err, eps * mag.max(1.0))
}

fn run(a: Args) -> Result<()> {
    let devs: Vec<cuda::Device> = (0..).map_while(|i| cuda::Device::new(i).ok()).collect();
    if devs.is_empty() {
        return Err(flash_attn::Error::CudaUnavailable("no GPU".into()));
    }
    let ranks = a.ranks.unwrap_or(devs.len()).min(devs.len());
    let devs = &devs[..ranks];
    let (hq, hk, d) = (a.hq, a.hk, a.d);
    println!("ranks {ranks}, bf16, b 1, hq {hq}, hk {hk}, d {d}; ms are medians of {} runs", a.reps);
    println!(
        "{:>7} {:>6} {:>8} | {:>9} {:>9} {:>7} {:>9} {:>7} | {:>9} {:>9} {:>7} {:>9} {:>7}",
        "s",
        "causal",
        "layout",
        "fwd_1gpu",
        "fwd_ring",
        "speedup",
        "fwd_nocomm",
        "hidden",
        "fb_1gpu",
        "fb_ring",
        "speedup",
        "fb_nocomm",
        "hidden"
    );
    for &s in &a.seqs {
        for &causal in &a.causal {
            let layout = if causal { Layout::Zigzag } else { Layout::Contiguous };
            let sharding = Sharding::new(layout, ranks)?;
            if sharding.local_len(s).is_err() {
                println!("{s:>7} {causal:>6} skipped: does not split over {} chunks", sharding.chunks());
                continue;
            }
            let mut rng = Rng::new(s as u64 ^ u64::from(causal));
            let (q, k, v, dout) = (
                random(s * hq * d, &mut rng),
                random(s * hk * d, &mut rng),
                random(s * hk * d, &mut rng),
                random(s * hq * d, &mut rng),
            );
            let cu = [0, s as i32];
            let mut spec = AttentionSpec::new().varlen(&cu, &cu);
            if causal {
                spec = spec.causal();
            }
            // One GPU.
            let dev = &devs[0];
            let up =
                |x: &[bf16]| dev.stream().clone_htod(x).map_err(|e| flash_attn::Error::CudaLaunch(format!("{e:?}")));
            let (gq, gk, gv, gdo) = (up(&q)?, up(&k)?, up(&v)?, up(&dout)?);
            let mut out: CudaSlice<bf16> =
                dev.stream().alloc_zeros(s * hq * d).map_err(|e| flash_attn::Error::CudaLaunch(format!("{e:?}")))?;
            let mut lse: CudaSlice<f32> =
                dev.stream().alloc_zeros(hq * s).map_err(|e| flash_attn::Error::CudaLaunch(format!("{e:?}")))?;
            let mut grads: Vec<CudaSlice<bf16>> = [s * hq * d, s * hk * d, s * hk * d]
                .iter()
                .map(|&n| dev.stream().alloc_zeros(n).map_err(|e| flash_attn::Error::CudaLaunch(format!("{e:?}"))))
                .collect::<Result<_>>()?;
            let (qs, ks) = ([s, hq, d], [s, hk, d]);
            let mut one = |with_bwd: bool| -> Result<f64> {
                let t0 = Instant::now();
                dev.forward(
                    &spec,
                    &DeviceTensor::new(gq.slice(..), &qs),
                    &DeviceTensor::new(gk.slice(..), &ks),
                    &DeviceTensor::new(gv.slice(..), &ks),
                    &mut DeviceTensorMut::new(out.slice_mut(..), &qs),
                    &mut lse.slice_mut(..),
                )?;
                if with_bwd {
                    let [dq, dk, dv] = &mut grads[..] else { unreachable!() };
                    dev.backward(
                        &spec,
                        &DeviceTensor::new(gq.slice(..), &qs),
                        &DeviceTensor::new(gk.slice(..), &ks),
                        &DeviceTensor::new(gv.slice(..), &ks),
                        &DeviceTensor::new(out.slice(..), &qs),
                        &lse.slice(..),
                        &DeviceTensor::new(gdo.slice(..), &qs),
                        &mut DeviceTensorMut::new(dq.slice_mut(..), &qs),
                        &mut DeviceTensorMut::new(dk.slice_mut(..), &ks),
                        &mut DeviceTensorMut::new(dv.slice_mut(..), &ks),
                    )?;
                }
                dev.stream().synchronize().map_err(|e| flash_attn::Error::CudaLaunch(format!("{e:?}")))?;
                Ok(t0.elapsed().as_secs_f64() * 1e3)
            };
            one(true)?;
            let fwd_1 = median((0..a.reps).map(|_| one(false)).collect::<Result<_>>()?);
            let fb_1 = median((0..a.reps).map(|_| one(true)).collect::<Result<_>>()?);
            let down = |x: &CudaSlice<bf16>| {
                dev.stream().clone_dtoh(x).map_err(|e| flash_attn::Error::CudaLaunch(format!("{e:?}")))
            };
            let ref_out = down(&out)?;
            let ref_grads: Vec<Vec<bf16>> = grads.iter().map(down).collect::<Result<_>>()?;
            drop((gq, gk, gv, gdo, out, lse, grads));

            // The ring.
            let cu_local = sharding.local_cu_seqlens(&cu)?;
            let problem = RingProblem::new(&spec, layout, ranks, cu_local, (hq, hk), (d, d))?;
            let tokens: Vec<Vec<usize>> = (0..ranks)
                .map(|r| sharding.ranges(r, s).into_iter().flat_map(|(st, n)| st..st + n).collect())
                .collect();
            let rings = NcclRing::for_devices(&devs.iter().collect::<Vec<_>>())?;
            let barrier = Barrier::new(ranks);
            let per_rank: Vec<Result<RankResult>> = std::thread::scope(|sc| {
                let handles: Vec<_> = rings
                    .into_iter()
                    .zip(devs)
                    .map(|(mut ring, dev)| {
                        let (problem, tokens, barrier, reps, steps_too) =
                            (&problem, &tokens, &barrier, a.reps, a.steps);
                        let (q, k, v, dout) = (&q, &k, &v, &dout);
                        sc.spawn(move || -> Result<RankResult> {
                            let err = |e: cudarc::driver::DriverError| flash_attn::Error::CudaLaunch(format!("{e:?}"));
                            let toks = &tokens[ring.rank()];
                            let t = toks.len();
                            let rows = |x: &[bf16], row: usize| -> Vec<bf16> {
                                toks.iter().flat_map(|&i| x[i * row..(i + 1) * row].iter().copied()).collect()
                            };
                            let st = dev.stream();
                            let lq = st.clone_htod(&rows(q, hq * d)).map_err(err)?;
                            let lk = st.clone_htod(&rows(k, hk * d)).map_err(err)?;
                            let lv = st.clone_htod(&rows(v, hk * d)).map_err(err)?;
                            let ldo = st.clone_htod(&rows(dout, hq * d)).map_err(err)?;
                            let mut b = Bufs {
                                out: st.alloc_zeros(t * hq * d).map_err(err)?,
                                lse: st.alloc_zeros(hq * t).map_err(err)?,
                                dq: st.alloc_zeros(t * hq * d).map_err(err)?,
                                dk: st.alloc_zeros(t * hk * d).map_err(err)?,
                                dv: st.alloc_zeros(t * hk * d).map_err(err)?,
                            };
                            let step = |ring: &NcclRing, b: &mut Bufs, with_bwd: bool| -> Result<f64> {
                                barrier.wait();
                                let t0 = Instant::now();
                                dev.ring_forward(
                                    ring,
                                    problem,
                                    &lq.slice(..),
                                    &lk.slice(..),
                                    &lv.slice(..),
                                    &mut b.out,
                                    &mut b.lse,
                                )?;
                                if with_bwd {
                                    dev.ring_backward(
                                        ring,
                                        problem,
                                        &lq.slice(..),
                                        &lk.slice(..),
                                        &lv.slice(..),
                                        &b.out.slice(..),
                                        &b.lse.slice(..),
                                        &ldo.slice(..),
                                        &mut b.dq,
                                        &mut b.dk,
                                        &mut b.dv,
                                    )?;
                                }
                                st.synchronize().map_err(err)?;
                                barrier.wait();
                                Ok(t0.elapsed().as_secs_f64() * 1e3)
                            };
                            step(&ring, &mut b, true)?;
                            let results = vec![
                                st.clone_dtoh(&b.out).map_err(err)?,
                                st.clone_dtoh(&b.dq).map_err(err)?,
                                st.clone_dtoh(&b.dk).map_err(err)?,
                                st.clone_dtoh(&b.dv).map_err(err)?,
                            ];
                            let mut times = Vec::new();
                            for (transfers, with_bwd) in [(true, false), (true, true), (false, false), (false, true)] {
                                ring.set_transfers(transfers);
                                step(&ring, &mut b, with_bwd)?;
                                times.push(median(
                                    (0..reps).map(|_| step(&ring, &mut b, with_bwd)).collect::<Result<_>>()?,
                                ));
                            }
                            let mut steps = [Vec::new(), Vec::new()];
                            if steps_too {
                                for (i, transfers) in [true, false].into_iter().enumerate() {
                                    ring.set_transfers(transfers);
                                    ring.set_step_timing(true);
                                    step(&ring, &mut b, true)?;
                                    steps[i] = ring.take_step_times()?;
                                    ring.set_step_timing(false);
                                }
                            }
                            Ok((times, results, steps))
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| Err(flash_attn::Error::CudaLaunch("a rank panicked".into()))))
                    .collect()
            });
            let per_rank: Vec<RankResult> = per_rank.into_iter().collect::<Result<_>>()?;
            // Check against the one-GPU result.
            let rows_of = [hq * d, hq * d, hk * d, hk * d];
            let eps = [4.0 * 2f64.powi(-7), 8.0 * 2f64.powi(-7), 8.0 * 2f64.powi(-7), 8.0 * 2f64.powi(-7)];
            let names = ["out", "dq", "dk", "dv"];
            for (i, name) in names.iter().enumerate() {
                let row = rows_of[i];
                let reference: &[bf16] = if i == 0 { &ref_out } else { &ref_grads[i - 1] };
                let mut ours = vec![bf16::ZERO; reference.len()];
                for (r, (_, res, _)) in per_rank.iter().enumerate() {
                    for (lt, &g) in tokens[r].iter().enumerate() {
                        ours[g * row..(g + 1) * row].copy_from_slice(&res[i][lt * row..(lt + 1) * row]);
                    }
                }
                let (err, bound) = within(&ours, reference, eps[i]);
                if err.is_nan() || err > bound {
                    return Err(flash_attn::Error::Mismatch(format!(
                        "s {s} causal {causal}: ring {name} differs from one GPU's by {err:.3e} > {bound:.3e}"
                    )));
                }
            }
            let t = |j: usize| per_rank.iter().map(|(ts, _, _)| ts[j]).fold(0.0, f64::max);
            let (fwd_r, fb_r, fwd_nc, fb_nc) = (t(0), t(1), t(2), t(3));
            println!(
                "{s:>7} {causal:>6} {:>8} | {fwd_1:>9.2} {fwd_r:>9.2} {:>7.2} {fwd_nc:>9.2} {:>7.2} | {fb_1:>9.2} {fb_r:>9.2} {:>7.2} {fb_nc:>9.2} {:>7.2}",
                format!("{layout:?}").to_lowercase(),
                fwd_1 / fwd_r,
                fwd_nc / fwd_r,
                fb_1 / fb_r,
                fb_nc / fb_r,
            );
            if a.steps {
                print_steps(&per_rank);
            }
        }
    }
    Ok(())
}

/// Per rank, pass and step: compute, transfer and wait (ms), with the transfers and without.
fn print_steps(per_rank: &[RankResult]) {
    println!(
        "    {:>4} {:>4} {:>4} | {:>9} {:>9} {:>8} | {:>9} {:>8}   (ms; without transfers on the right)",
        "rank", "pass", "step", "compute", "transfer", "wait", "compute", "wait"
    );
    for (r, (_, _, [with, without])) in per_rank.iter().enumerate() {
        for (i, s) in with.iter().enumerate() {
            let pass = if s.pass == RingPass::Forward { "fwd" } else { "bwd" };
            let (c0, w0) = without.get(i).map_or((f32::NAN, f32::NAN), |x| (x.compute_ms, x.wait_ms));
            println!(
                "    {r:>4} {pass:>4} {:>4} | {:>9.3} {:>9.3} {:>8.3} | {c0:>9.3} {w0:>8.3}",
                s.step, s.compute_ms, s.transfer_ms, s.wait_ms
            );
        }
    }
}
