//! Context parallelism over every GPU present (NCCL): one long sequence split over R GPUs against
//! the same sequence on one GPU, forward and forward + backward, and the ring with its transfers
//! switched off (compute alone) to show how much of the transfer is hidden.
//!
//! ```text
//! ring_bench [--seqs 32768,65536,131072] [--ranks R[,R...]] [--hq 32] [--hk 8] [--d 128]
//!            [--causal both|true|false] [--reps 5] [--steps] [--no-nocomm]
//! ```
//! Causal runs use the zigzag layout, the others the contiguous one; bf16, one sequence (b = 1).
//! `--ranks 2,4` runs the ring over the first 2 GPUs, then the first 4, against one one-GPU
//! baseline per length; the default is every GPU present. `efficiency` is the speedup over one
//! GPU divided by the rank count (1.0 is ideal scaling).
//! Every timed configuration is first checked: the ring's `out`, `dq`, `dk`, `dv` against the
//! one-GPU result, within the contract's floor `eps_T · max(1, magnitude)` (the f64 oracle is out
//! of reach at these lengths); a violation exits 1. Times: wall clock between barriers after a
//! stream synchronisation on every rank, medians over `--reps`; the first configuration of each
//! mask warms up first (longer ones reuse the same kernels). `--no-nocomm` skips the runs with
//! the transfers switched off (the `hidden` columns), which halves the time of the longest runs.
//!
//! With `--steps`, one more forward + backward call per configuration, with and without its
//! transfers, records CUDA events around every step ([`NcclRing::set_step_timing`]) and prints,
//! per rank, pass and step: the step's compute, its transfers (on their own stream) and how long
//! the compute stream stood waiting for a transfer. A transfer is hidden when that wait is
//! (near) 0 and no larger than without transfers.

use std::collections::HashSet;
use std::sync::Barrier;
use std::time::Instant;

use cudarc::driver::CudaSlice;
use flash_attn::check::Rng;
use flash_attn::cuda::ring::{NcclRing, RingPass, StepTime};
use flash_attn::cuda::{self, DeviceTensor, DeviceTensorMut};
use flash_attn::ring::{Layout, RingProblem, Sharding};
use flash_attn::{AttentionSpec, Result};
use half::bf16;
use rayon::prelude::*;

struct Args {
    seqs: Vec<usize>,
    ranks: Vec<usize>,
    hq: usize,
    hk: usize,
    d: usize,
    causal: Vec<bool>,
    reps: usize,
    steps: bool,
    nocomm: bool,
}

fn parse() -> Args {
    let mut a = Args {
        seqs: vec![32768, 65536, 131072],
        ranks: Vec::new(),
        hq: 32,
        hk: 8,
        d: 128,
        causal: vec![false, true],
        reps: 5,
        steps: false,
        nocomm: true,
    };
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(at) = args.iter().position(|x| x == "--steps") {
        a.steps = true;
        args.remove(at);
    }
    if let Some(at) = args.iter().position(|x| x == "--no-nocomm") {
        a.nocomm = false;
        args.remove(at);
    }
    let mut i = 0;
    while i + 1 < args.len() {
        let v = &args[i + 1];
        match args[i].as_str() {
            "--seqs" => a.seqs = v.split(',').filter_map(|x| x.parse().ok()).collect(),
            "--ranks" => a.ranks = v.split(',').filter_map(|x| x.parse().ok()).collect(),
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

/// `n` standard normals in bf16, drawn in parallel: chunk `i` from its own generator seeded by
/// `seed` and `i`, so the values do not depend on the thread count.
fn random(n: usize, seed: u64) -> Vec<bf16> {
    const CHUNK: usize = 1 << 20;
    let mut x = vec![bf16::ZERO; n];
    x.par_chunks_mut(CHUNK).enumerate().for_each(|(i, c)| {
        let mut rng = Rng::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64);
        c.iter_mut().for_each(|y| *y = bf16::from_f64(rng.normal()));
    });
    x
}

/// `max |a - b|` and the contract's floor for `b`'s magnitude.
fn within(a: &[bf16], b: &[bf16], eps: f64) -> (f64, f64) {
    let (err, mag) = a
        .par_iter()
        .zip(b)
        .map(|(x, y)| ((x.to_f64() - y.to_f64()).abs(), y.to_f64().abs()))
        .reduce(|| (0.0, 0.0), |p, q| (p.0.max(q.0), p.1.max(q.1)));
    (err, eps * mag.max(1.0))
}

fn cuda_err(e: cudarc::driver::DriverError) -> flash_attn::Error {
    flash_attn::Error::CudaLaunch(format!("{e:?}"))
}

/// One problem's inputs and its one-GPU outputs (`out`, `dq`, `dk`, `dv`) and times.
struct Baseline {
    q: Vec<bf16>,
    k: Vec<bf16>,
    v: Vec<bf16>,
    dout: Vec<bf16>,
    outputs: [Vec<bf16>; 4],
    fwd_ms: f64,
    fb_ms: f64,
}

/// The problem on one GPU: a warm-up when `warm`, then medians of `reps` forward and forward +
/// backward calls, and the outputs to check the ring against.
fn one_gpu(a: &Args, dev: &cuda::Device, spec: &AttentionSpec, s: usize, seed: u64, warm: bool) -> Result<Baseline> {
    let (hq, hk, d) = (a.hq, a.hk, a.d);
    let (q, k, v, dout) = (
        random(s * hq * d, seed),
        random(s * hk * d, seed + 1),
        random(s * hk * d, seed + 2),
        random(s * hq * d, seed + 3),
    );
    let st = dev.stream();
    let (gq, gk, gv, gdo) = (
        st.clone_htod(&q).map_err(cuda_err)?,
        st.clone_htod(&k).map_err(cuda_err)?,
        st.clone_htod(&v).map_err(cuda_err)?,
        st.clone_htod(&dout).map_err(cuda_err)?,
    );
    let mut out: CudaSlice<bf16> = st.alloc_zeros(s * hq * d).map_err(cuda_err)?;
    let mut lse: CudaSlice<f32> = st.alloc_zeros(hq * s).map_err(cuda_err)?;
    let mut dq: CudaSlice<bf16> = st.alloc_zeros(s * hq * d).map_err(cuda_err)?;
    let mut dk: CudaSlice<bf16> = st.alloc_zeros(s * hk * d).map_err(cuda_err)?;
    let mut dv: CudaSlice<bf16> = st.alloc_zeros(s * hk * d).map_err(cuda_err)?;
    let (qs, ks) = ([s, hq, d], [s, hk, d]);
    let mut one = |with_bwd: bool| -> Result<f64> {
        let t0 = Instant::now();
        dev.forward(
            spec,
            &DeviceTensor::new(gq.slice(..), &qs),
            &DeviceTensor::new(gk.slice(..), &ks),
            &DeviceTensor::new(gv.slice(..), &ks),
            &mut DeviceTensorMut::new(out.slice_mut(..), &qs),
            &mut lse.slice_mut(..),
        )?;
        if with_bwd {
            dev.backward(
                spec,
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
        st.synchronize().map_err(cuda_err)?;
        Ok(t0.elapsed().as_secs_f64() * 1e3)
    };
    if warm {
        one(true)?;
    }
    let fwd_ms = median((0..a.reps).map(|_| one(false)).collect::<Result<_>>()?);
    let fb_ms = median((0..a.reps).map(|_| one(true)).collect::<Result<_>>()?);
    let outputs = [
        st.clone_dtoh(&out).map_err(cuda_err)?,
        st.clone_dtoh(&dq).map_err(cuda_err)?,
        st.clone_dtoh(&dk).map_err(cuda_err)?,
        st.clone_dtoh(&dv).map_err(cuda_err)?,
    ];
    Ok(Baseline { q, k, v, dout, outputs, fwd_ms, fb_ms })
}

fn run(a: Args) -> Result<()> {
    let devs: Vec<cuda::Device> = (0..).map_while(|i| cuda::Device::new(i).ok()).collect();
    if devs.is_empty() {
        return Err(flash_attn::Error::CudaUnavailable("no GPU".into()));
    }
    let mut rank_counts: Vec<usize> = a.ranks.iter().map(|&r| r.clamp(1, devs.len())).collect();
    if rank_counts.is_empty() {
        rank_counts.push(devs.len());
    }
    rank_counts.dedup();
    let (hq, hk, d) = (a.hq, a.hk, a.d);
    println!(
        "GPUs {}, ranks {rank_counts:?}, bf16, b 1, hq {hq}, hk {hk}, d {d}; ms are medians of {} runs",
        devs.len(),
        a.reps
    );
    println!(
        "{:>7} {:>6} {:>8} {:>5} | {:>9} {:>9} {:>7} {:>6} {:>9} {:>7} | {:>9} {:>9} {:>7} {:>6} {:>9} {:>7}",
        "s",
        "causal",
        "layout",
        "ranks",
        "fwd_1gpu",
        "fwd_ring",
        "speedup",
        "effic",
        "fwd_nocomm",
        "hidden",
        "fb_1gpu",
        "fb_ring",
        "speedup",
        "effic",
        "fb_nocomm",
        "hidden"
    );
    let mut warmed = HashSet::new();
    for &s in &a.seqs {
        for &causal in &a.causal {
            let layout = if causal { Layout::Zigzag } else { Layout::Contiguous };
            let splits: Vec<usize> = rank_counts
                .iter()
                .copied()
                .filter(|&r| Sharding::new(layout, r).and_then(|sh| sh.local_len(s)).is_ok())
                .collect();
            if splits.is_empty() {
                println!("{s:>7} {causal:>6} skipped: does not split over {rank_counts:?} ranks");
                continue;
            }
            let cu = [0, s as i32];
            let mut spec = AttentionSpec::new().varlen(&cu, &cu);
            if causal {
                spec = spec.causal();
            }
            let warm = warmed.insert(causal);
            let base = one_gpu(&a, &devs[0], &spec, s, (s as u64) << 4 | u64::from(causal) << 2, warm)?;
            for &ranks in &splits {
                ring(&a, &devs[..ranks], &spec, layout, s, &base, warm)?;
            }
        }
    }
    Ok(())
}

/// The problem over `devs.len()` ranks: checked against the one-GPU outputs, then timed.
fn ring(
    a: &Args,
    devs: &[cuda::Device],
    spec: &AttentionSpec,
    layout: Layout,
    s: usize,
    base: &Baseline,
    warm: bool,
) -> Result<()> {
    let (hq, hk, d, ranks) = (a.hq, a.hk, a.d, devs.len());
    let sharding = Sharding::new(layout, ranks)?;
    let cu = [0, s as i32];
    let cu_local = sharding.local_cu_seqlens(&cu)?;
    let problem = RingProblem::new(spec, layout, ranks, cu_local, (hq, hk), (d, d))?;
    let tokens: Vec<Vec<usize>> =
        (0..ranks).map(|r| sharding.ranges(r, s).into_iter().flat_map(|(st, n)| st..st + n).collect()).collect();
    let rings = NcclRing::for_devices(&devs.iter().collect::<Vec<_>>())?;
    let barrier = Barrier::new(ranks);
    let modes: Vec<(bool, bool)> = if a.nocomm {
        vec![(true, false), (true, true), (false, false), (false, true)]
    } else {
        vec![(true, false), (true, true)]
    };
    let per_rank: Vec<Result<RankResult>> = std::thread::scope(|sc| {
        let handles: Vec<_> = rings
            .into_iter()
            .zip(devs)
            .map(|(mut ring, dev)| {
                let (problem, tokens, barrier, modes) = (&problem, &tokens, &barrier, &modes);
                sc.spawn(move || -> Result<RankResult> {
                    let toks = &tokens[ring.rank()];
                    let t = toks.len();
                    let rows = |x: &[bf16], row: usize| -> Vec<bf16> {
                        toks.iter().flat_map(|&i| x[i * row..(i + 1) * row].iter().copied()).collect()
                    };
                    let st = dev.stream();
                    let lq = st.clone_htod(&rows(&base.q, hq * d)).map_err(cuda_err)?;
                    let lk = st.clone_htod(&rows(&base.k, hk * d)).map_err(cuda_err)?;
                    let lv = st.clone_htod(&rows(&base.v, hk * d)).map_err(cuda_err)?;
                    let ldo = st.clone_htod(&rows(&base.dout, hq * d)).map_err(cuda_err)?;
                    let mut b = Bufs {
                        out: st.alloc_zeros(t * hq * d).map_err(cuda_err)?,
                        lse: st.alloc_zeros(hq * t).map_err(cuda_err)?,
                        dq: st.alloc_zeros(t * hq * d).map_err(cuda_err)?,
                        dk: st.alloc_zeros(t * hk * d).map_err(cuda_err)?,
                        dv: st.alloc_zeros(t * hk * d).map_err(cuda_err)?,
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
                        st.synchronize().map_err(cuda_err)?;
                        barrier.wait();
                        Ok(t0.elapsed().as_secs_f64() * 1e3)
                    };
                    // The checked run; it is also the warm-up of the NCCL communicator.
                    step(&ring, &mut b, true)?;
                    let results = vec![
                        st.clone_dtoh(&b.out).map_err(cuda_err)?,
                        st.clone_dtoh(&b.dq).map_err(cuda_err)?,
                        st.clone_dtoh(&b.dk).map_err(cuda_err)?,
                        st.clone_dtoh(&b.dv).map_err(cuda_err)?,
                    ];
                    let mut times = vec![f64::NAN; 4];
                    for (j, &(transfers, with_bwd)) in modes.iter().enumerate() {
                        ring.set_transfers(transfers);
                        if warm {
                            step(&ring, &mut b, with_bwd)?;
                        }
                        times[j] = median((0..a.reps).map(|_| step(&ring, &mut b, with_bwd)).collect::<Result<_>>()?);
                    }
                    let mut steps = [Vec::new(), Vec::new()];
                    if a.steps {
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
    let causal = layout == Layout::Zigzag;
    for (i, name) in names.iter().enumerate() {
        let row = rows_of[i];
        let reference = &base.outputs[i];
        let mut ours = vec![bf16::ZERO; reference.len()];
        for (r, (_, res, _)) in per_rank.iter().enumerate() {
            for (lt, &g) in tokens[r].iter().enumerate() {
                ours[g * row..(g + 1) * row].copy_from_slice(&res[i][lt * row..(lt + 1) * row]);
            }
        }
        let (err, bound) = within(&ours, reference, eps[i]);
        if err.is_nan() || err > bound {
            return Err(flash_attn::Error::Mismatch(format!(
                "s {s} causal {causal} ranks {ranks}: ring {name} differs from one GPU's by {err:.3e} > {bound:.3e}"
            )));
        }
    }
    // The slowest rank's time; `-` for the runs `--no-nocomm` skipped.
    let t = |j: usize| per_rank.iter().map(|(ts, _, _)| ts[j]).fold(f64::NEG_INFINITY, f64::max);
    let (fwd_r, fb_r, fwd_nc, fb_nc) = (t(0), t(1), t(2), t(3));
    let (fwd_1, fb_1, r) = (base.fwd_ms, base.fb_ms, ranks as f64);
    let shown = |x: f64, p: usize| if x.is_finite() { format!("{x:.p$}") } else { "-".into() };
    println!(
        "{s:>7} {causal:>6} {:>8} {ranks:>5} | {fwd_1:>9.2} {fwd_r:>9.2} {:>7.2} {:>6.3} {:>9} {:>7} | {fb_1:>9.2} {fb_r:>9.2} {:>7.2} {:>6.3} {:>9} {:>7}",
        format!("{layout:?}").to_lowercase(),
        fwd_1 / fwd_r,
        fwd_1 / fwd_r / r,
        shown(fwd_nc, 2),
        shown(fwd_nc / fwd_r, 2),
        fb_1 / fb_r,
        fb_1 / fb_r / r,
        shown(fb_nc, 2),
        shown(fb_nc / fb_r, 2),
    );
    if a.steps {
        print_steps(&per_rank);
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
