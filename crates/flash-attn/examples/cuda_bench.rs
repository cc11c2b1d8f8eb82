//! Device-side check and benchmark of the CUDA forward and backward.
//!
//! ```text
//! cuda_bench compile [sm_80,sm_90a] [NAME] compile every variant (whose name contains NAME), print
//!                                          registers / spills
//! cuda_bench check [CASES] [SEED]          random cases vs the f64 oracle (numerics contract)
//! cuda_bench bench [--variants all|hopper] [--only NAME] [--dtypes bf16,f16] [--causal both] [--d 64,128]
//!                  [--reps N]                (NAME: a part of the variants' names; `NAME$`: their end)
//!                  [--pass fwd|bwd] [--deterministic] [--dropout P] [--softcap C] [--release-pool]
//!                                          BENCH.md's `gpu` grid: b·s = 16k, hq·d = 2048; `bwd`
//!                                          times the backward pass alone (FLOPs 2.5 × forward)
//! cuda_bench sanitize [fp8|NAME]           a few small forward and backward launches (dropout,
//!                                          deterministic), for compute-sanitizer (`fp8`: the FP8
//!                                          forward's alone; NAME: the variants whose name has it, or
//!                                          each part of `A+B`, after the FP8 cases unless NAME
//!                                          names backward variants: `flash_bwd…`)
//! cuda_bench bench-fp8 [--d 128] [--seqs ..] [--causal both] [--reps N] [--release-pool]
//!                                          the FP8 (e4m3) forward (both kernels) and the bf16
//!                                          forward on the same shapes, one after another per rep
//! cuda_bench racecheck-probe               three hand-offs of a value through shared memory
//!                                          (an mbarrier, none, __syncthreads), for
//!                                          `compute-sanitizer --tool racecheck` (sm_90)
//! ```
//! Benchmark lines are JSON in BENCH.md's contract (`device, dtype, b, hq, hk, sq, sk, d, causal,
//! fwd_ms`) plus `tflops`, `variant`, `dropout` and `softcap` (null when off); times are medians
//! of CUDA-event-timed runs after a warm-up, on inputs drawn from a normal distribution.

use flash_attn::check::{compare_gradients, report, BackwardReport, BlockCase, Case, CaseData, Rng, Storage};
use flash_attn::cuda::{self, Arch, BwdVariant, DeviceTensor, DeviceTensorMut, ExtraPaths, Variant};
use flash_attn::{reference, AttentionSpec, Causal, DType, Result};
use half::{bf16, f16};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cmd = args.first().map(String::as_str).unwrap_or("check");
    let r = match cmd {
        "compile" => compile(
            args.get(1).map(String::as_str).unwrap_or("sm_80,sm_90a"),
            args.get(2).map(String::as_str).unwrap_or(""),
        ),
        "check" => check(
            args.get(1).and_then(|s| s.parse().ok()).unwrap_or(200),
            args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1),
        ),
        "bench" => bench(&args[1..]),
        "sanitize" => sanitize(args.get(1).map(String::as_str)),
        "bench-fp8" => bench_fp8(&args[1..]),
        "racecheck-probe" => racecheck_probe(),
        other => {
            eprintln!("unknown command `{other}`");
            std::process::exit(2);
        }
    };
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn compile(archs: &str, pattern: &str) -> Result<()> {
    let archs: Vec<Arch> = archs.split(',').map(|a| Arch(a.to_string())).collect();
    let mut failed = 0;
    for r in cuda::compile_matching(&archs, pattern)? {
        println!(
            "{:<34} {:<7} regs {:>4} spill {:>4} {}",
            r.name,
            r.arch,
            r.registers.map_or("?".into(), |x| x.to_string()),
            r.spill_bytes.map_or("?".into(), |x| x.to_string()),
            match (r.ok(), r.wgmma_serialized) {
                (false, _) => "FAILED",
                (true, true) => "ok, but wgmma SERIALISED (C7511)",
                (true, false) => "ok",
            }
        );
        if let Err(e) = &r.result {
            failed += 1;
            println!("{e}");
        }
    }
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}

/// A random case inside what the CUDA forward supports (dtype, head dims, masks, layouts).
fn random_case(rng: &mut Rng) -> Case {
    let mut c = Case::random(rng);
    c.dtype = rng.pick(&[DType::BF16, DType::F16]);
    c.d = rng.pick(&[64, 128]);
    c.dv = c.d;
    if rng.chance(0.3) {
        // Longer sequences: several key tiles, several query tiles, odd tails.
        let n = c.seqlens.len();
        for s in c.seqlens.iter_mut().take(n) {
            *s = (rng.range(1, 400), rng.range(1, 400));
        }
        if !c.varlen {
            let first = c.seqlens[0];
            c.seqlens.iter_mut().for_each(|s| *s = first);
        }
    }
    if let Storage::Strided { .. } = c.storage {
        c.storage = Storage::Strided { pad: rng.pick(&[0, 8]) };
    }
    c
}

fn check(cases: usize, seed: u64) -> Result<()> {
    let mut rng = Rng::new(seed);
    let (mut failed, mut worst_out, mut worst_lse) = (0, 0.0f64, 0.0f64);
    // The f64 oracle runs on the host: stop after a time budget and say how many cases ran.
    let budget: f64 = std::env::var("FA_CHECK_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(70.0);
    let start = std::time::Instant::now();
    let mut done = 0;
    for i in 0..cases {
        if start.elapsed().as_secs_f64() > budget {
            break;
        }
        done += 1;
        let case = random_case(&mut rng);
        let rep = match case.dtype {
            DType::BF16 => run_case::<bf16>(&case, None)?,
            _ => run_case::<f16>(&case, None)?,
        };
        let ratio = |c: &flash_attn::check::Comparison| c.max_err / c.bound.max(f64::MIN_POSITIVE);
        worst_out = worst_out.max(ratio(&rep.out));
        worst_lse = worst_lse.max(ratio(&rep.lse));
        if !rep.passed() {
            failed += 1;
            println!("FAIL case {i}: {case}\n  {rep}");
        } else {
            println!("ok case {i}: {case}: out err/bound {:.3}, lse err/bound {:.3}", ratio(&rep.out), ratio(&rep.lse));
        }
    }
    println!(
        "{{\"check\":\"cuda_forward\",\"cases\":{done},\"failed\":{failed},\"worst_err_over_bound_out\":{worst_out:.4},\"worst_err_over_bound_lse\":{worst_lse:.4}}}"
    );
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}

/// One forward case against the oracle on `variant` (`None`: the default).
fn run_case<T: cuda::CudaElement>(case: &Case, variant: Option<Variant>) -> Result<flash_attn::check::CaseReport> {
    run_case_with_dropout::<T>(case, None, variant)
}

/// [`run_case`] with dropout `(p, seed, offset)` if given.
fn run_case_with_dropout<T: cuda::CudaElement>(
    case: &Case,
    dropout: Option<(f32, u64, u32)>,
    variant: Option<Variant>,
) -> Result<flash_attn::check::CaseReport> {
    let data: CaseData<T> = case.data::<T>();
    let mut spec = case.spec(&data);
    if let Some((p, seed, offset)) = dropout {
        spec = spec.dropout(p, seed, offset);
    }
    let [q, k, v] = data.views();
    let ours = cuda::forward_host_variant(&spec, &q, &k, &v, variant)?;
    let oracle = reference::forward(&spec, &q, &k, &v)?;
    let naive = reference::naive(&spec, &q, &k, &v)?;
    Ok(report(&ours.out, &ours.lse, &oracle, &naive, case.dtype))
}

/// One forward + backward case against the oracle: dropout `(p, seed, offset)` or none, backward
/// `variant` (`None`: the default), deterministic or not.
fn bwd_case<T: cuda::CudaElement>(
    case: &Case,
    dropout: Option<(f32, u64, u32)>,
    variant: Option<BwdVariant>,
    deterministic: bool,
) -> Result<BackwardReport> {
    let data: CaseData<T> = case.data::<T>();
    let mut spec = case.spec(&data);
    if let Some((p, seed, offset)) = dropout {
        spec = spec.dropout(p, seed, offset);
    }
    if deterministic {
        spec = spec.deterministic();
    }
    let [q, k, v] = data.views();
    let (dout, dout_shape) = case.dout(&data)?;
    let dout = flash_attn::Tensor::new(&dout, &dout_shape);
    let fwd = cuda::forward_host(&spec, &q, &k, &v)?;
    let out = flash_attn::Tensor::new(&fwd.out, &fwd.out_shape);
    let grads = cuda::backward_host_variant(&spec, &q, &k, &v, &out, &fwd.lse, &dout, variant)?;
    compare_gradients(&spec, &grads, &data, &dout, case.dtype)
}

/// Fits case `c` to a variant holding the optional paths `extras`: the score modifiers and block
/// mask it lacks dropped, its softcap and ALiBi on where it holds them.
fn use_paths(c: &mut Case, extras: ExtraPaths) {
    c.retain_paths(extras.softcap, extras.alibi, extras.blocks);
    // A block mask in every case of a variant holding that path: blocks of whole 16-row and
    // 8-key groups (the kernels' one-byte-a-group path), unless the case drew one already.
    if extras.blocks {
        c.block.get_or_insert(BlockCase { block_q: 16, block_k: 32, per_head: true, density_pct: 50 });
    }
    if extras.softcap {
        c.softcap.get_or_insert(12.0);
    }
    if extras.alibi {
        c.alibi.get_or_insert(true);
    }
}

/// `only`: `fp8` runs the FP8 cases alone; another word runs only the forward and backward
/// variants whose name contains it (one launch each); none runs everything.
fn sanitize(only: Option<&str>) -> Result<()> {
    let mut rng = Rng::new(7);
    let arch = cuda::default_device()?.arch().clone();
    // The FP8 forward (sm_90a): both tile widths, causal and not, GQA, lengths past a tile's end.
    // (Not when NAME picks backward variants alone.)
    if arch.has_wgmma() && !only.is_some_and(|o| o.starts_with("flash_bwd")) {
        for (i, (d, causal)) in
            [(128, Causal::BottomRight), (80, Causal::None), (256, Causal::TopLeft)].into_iter().enumerate()
        {
            for (ws, scheduled) in [(true, false), (true, true), (false, false)] {
                let variant = cuda::Fp8Variant::for_head_dim(d).map(|v| cuda::Fp8Variant { ws, scheduled, ..v });
                let passed = fp8_case(&mut rng, [2, 131, 4, d], [2, 200, 2, d], causal, variant)?;
                let name = variant.map(|v| v.name()).unwrap_or_default();
                println!("sanitize fp8 case {i} d {d} {causal:?} {name}: {}", if passed { "pass" } else { "FAIL" });
            }
        }
        // More query blocks than multiprocessors: the persistent kernel's blocks take several (the
        // default under a causal rule: from the tile scheduler; then on the fixed stride).
        for scheduled in [true, false] {
            let variant = cuda::Fp8Variant::for_head_dim(128).map(|v| cuda::Fp8Variant { scheduled, ..v });
            let passed = fp8_case(&mut rng, [4, 257, 16, 128], [4, 300, 4, 128], Causal::BottomRight, variant)?;
            let name = variant.map(|v| v.name()).unwrap_or_default();
            println!("sanitize fp8 persistent case (192 items) {name}: {}", if passed { "pass" } else { "FAIL" });
        }
    }
    if only == Some("fp8") {
        return Ok(());
    }
    if let Some(pattern) = only {
        return sanitize_variants(&mut rng, &arch, pattern);
    }
    for (i, (d, causal, varlen)) in [
        (64, Causal::None, false),
        (128, Causal::BottomRight, false),
        (64, Causal::TopLeft, true),
        (128, Causal::None, true),
        // Head dims between the tile widths: zero-filled columns, stores cut at d.
        (40, Causal::None, false),
        (96, Causal::BottomRight, true),
        // Past 128: the backward's split kernel (two warps to each 16 keys).
        (160, Causal::BottomRight, true),
        (256, Causal::None, false),
    ]
    .into_iter()
    .enumerate()
    {
        let mut c = random_case(&mut rng);
        c.d = d;
        c.dv = d;
        c.causal = causal;
        c.varlen = varlen;
        c.seqlens = if varlen { vec![(37, 150), (130, 61), (0, 5)] } else { vec![(131, 77); 2] };
        c.window = None;
        let rep = run_case::<bf16>(&c, None)?;
        println!("sanitize case {i}: {c}: {}", if rep.passed() { "pass" } else { "FAIL" });
        // Softcap, ALiBi and a block mask whose blocks do not divide the tiles in one run; the
        // deterministic run with a tile-aligned mask (hidden tiles still take their turn).
        for (dropout, deterministic, mods) in
            [(None, false, false), (Some((0.3f32, 99u64, 5u32)), true, false), (Some((0.2, 7, 1)), false, true)]
        {
            let mut c = c.clone();
            if mods {
                (c.softcap, c.alibi) = (Some(12.0), Some(true));
                c.block = Some(BlockCase { block_q: 3, block_k: 40, per_head: true, density_pct: 50 });
            }
            if deterministic {
                c.block = Some(BlockCase { block_q: 64, block_k: 64, per_head: false, density_pct: 50 });
            }
            let rep = bwd_case::<bf16>(&c, dropout, None, deterministic)?;
            println!(
                "sanitize case {i} backward (dropout {dropout:?}, deterministic {deterministic}, softcap+ALiBi+block \
                 mask {mods}): {}",
                if rep.passed() { "pass".to_string() } else { format!("FAIL {rep}") }
            );
        }
    }
    // Every variant the device runs, forward and backward (the defaults above are the Hopper
    // kernels on sm_90a: this keeps the mma.sync ones under the sanitizer too).
    sanitize_variants(&mut rng, &arch, "")?;
    // Forward-only head dims past the backward's widest tile.
    for (i, (d, varlen)) in [(200, false), (256, true)].into_iter().enumerate() {
        let mut c = random_case(&mut rng);
        (c.d, c.dv, c.varlen, c.window) = (d, d, varlen, None);
        c.seqlens = if varlen { vec![(37, 150), (130, 61), (0, 5)] } else { vec![(131, 77); 2] };
        let rep = run_case::<bf16>(&c, None)?;
        println!("sanitize forward-only case {i}: {c}: {}", if rep.passed() { "pass" } else { "FAIL" });
    }
    Ok(())
}

/// One launch of every forward variant, and one forward + backward of every backward variant, the
/// device runs and whose name contains `pattern` (deterministic every other one), each checked
/// against the oracle.
fn sanitize_variants(rng: &mut Rng, arch: &Arch, pattern: &str) -> Result<()> {
    // `a+b`: names holding every part.
    let matches = |v: &Variant| pattern.split('+').all(|part| v.name().contains(part));
    for (i, variant) in Variant::all().into_iter().filter(|v| v.runs_on(arch) && matches(v)).enumerate() {
        let mut c = random_case(rng);
        (c.dtype, c.d, c.dv, c.varlen, c.causal) = (variant.dtype, variant.d, variant.d, true, Causal::BottomRight);
        c.seqlens = vec![(37, 150), (130, 61), (0, 5)];
        if variant.ws {
            // Fixed-length batches only: 4 x 600 queries of 16 heads, 320 work items of 128 rows
            // (256 of 192), more than one a block on up to 255 multiprocessors (the tile scheduler
            // hands out the rest): a block runs items back to back.
            c.varlen = false;
            c.seqlens = vec![(600, 257); 4];
            (c.hq, c.hk) = (16, 4);
        }
        use_paths(&mut c, variant.extras);
        // Dropout on where the variant holds it.
        let dropout = variant.extras.dropout.then_some((0.2, 0x5eed + i as u64, 3));
        let rep = match variant.dtype {
            DType::F16 => run_case_with_dropout::<f16>(&c, dropout, Some(variant))?,
            _ => run_case_with_dropout::<bf16>(&c, dropout, Some(variant))?,
        };
        println!("sanitize variant {i} {}: {c}: {}", variant.name(), if rep.passed() { "pass" } else { "FAIL" });
    }
    // One forward + backward of every backward variant the device runs (deterministic every
    // other one).
    for (i, variant) in
        BwdVariant::all().into_iter().filter(|v| v.runs_on(arch) && v.name().contains(pattern)).enumerate()
    {
        let mut c = random_case(rng);
        (c.dtype, c.d, c.dv, c.varlen, c.causal) =
            (variant.dtype, variant.d, variant.d, !variant.ws, Causal::BottomRight);
        // (The warp-specialised kernel takes fixed-length batches; it is persistent: 2 x 48 heads
        // x 3 key tiles = 288 tiles, so that an H100's blocks walk two or three each.)
        c.seqlens = if variant.ws { vec![(130, 300); 2] } else { vec![(37, 150), (130, 61), (0, 5)] };
        if variant.ws {
            (c.hq, c.hk) = (48, 48);
        }
        use_paths(&mut c, variant.extras);
        let dropout = variant.extras.dropout.then_some((0.2f32, 11u64, i as u32));
        let passed = match variant.dtype {
            DType::F16 => bwd_case::<f16>(&c, dropout, Some(variant), i % 2 == 1)?,
            _ => bwd_case::<bf16>(&c, dropout, Some(variant), i % 2 == 1)?,
        }
        .passed();
        println!("sanitize backward variant {i} {}: {c}: {}", variant.name(), if passed { "pass" } else { "FAIL" });
    }
    Ok(())
}

fn arg<'a>(args: &'a [String], name: &str, default: &'a str) -> &'a str {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map_or(default, String::as_str)
}

fn bench(args: &[String]) -> Result<()> {
    release_pool(args)?;
    let dtypes = arg(args, "--dtypes", "bf16,f16");
    let causals = match arg(args, "--causal", "both") {
        "yes" => vec![true],
        "no" => vec![false],
        _ => vec![false, true],
    };
    let dims: Vec<usize> = arg(args, "--d", "64,128").split(',').filter_map(|s| s.parse().ok()).collect();
    let seqs: Vec<usize> =
        arg(args, "--seqs", "512,1024,2048,4096,8192,16384").split(',').filter_map(|s| s.parse().ok()).collect();
    let reps: usize = arg(args, "--reps", "20").parse().unwrap_or(20);
    let which = arg(args, "--variants", "default");
    // With --variants: only those whose name contains this (or with a trailing `$`, ends with it).
    let only = arg(args, "--only", "");
    let picked = |name: &str| only.strip_suffix('$').map_or(name.contains(only), |end| name.ends_with(end));
    let all_variants = which == "all" || which == "hopper";
    let bwd = arg(args, "--pass", "fwd") == "bwd";
    let deterministic = args.iter().any(|a| a == "--deterministic");
    let number = |name: &str| -> Result<Option<f32>> {
        match args.iter().position(|a| a == name) {
            None => Ok(None),
            Some(i) => match args.get(i + 1).and_then(|v| v.parse().ok()) {
                Some(x) => Ok(Some(x)),
                None => Err(flash_attn::Error::Unsupported(format!("{name} needs a number"))),
            },
        }
    };
    let extras = Extras { dropout: number("--dropout")?, softcap: number("--softcap")? };
    for dt in dtypes.split(',') {
        let dtype: DType = dt.parse().map_err(flash_attn::Error::Unsupported)?;
        for &d in &dims {
            let variants: Vec<Option<Variant>> = if all_variants {
                let arch = cuda::default_device()?.arch().clone();
                Variant::all()
                    .into_iter()
                    .filter(|v| v.dtype == dtype && v.d == d && v.runs_on(&arch) && (which == "all" || v.wgmma))
                    .filter(|v| picked(&v.name()))
                    // Only the variants holding the paths the options use (--dropout, --softcap).
                    .filter(|v| v.extras.covers(extras.paths()))
                    .map(Some)
                    .collect()
            } else {
                vec![None]
            };
            let bwd_variants: Vec<Option<BwdVariant>> = if all_variants {
                let arch = cuda::default_device()?.arch().clone();
                BwdVariant::all()
                    .into_iter()
                    .filter(|v| v.dtype == dtype && v.d == d && v.runs_on(&arch) && (which == "all" || v.wgmma))
                    .filter(|v| picked(&v.name()))
                    .map(Some)
                    .collect()
            } else {
                vec![None]
            };
            for &s in &seqs {
                for &causal in &causals {
                    if bwd {
                        for &variant in &bwd_variants {
                            match dtype {
                                DType::BF16 => bench_bwd::<bf16>(s, d, causal, variant, reps, deterministic, extras)?,
                                _ => bench_bwd::<f16>(s, d, causal, variant, reps, deterministic, extras)?,
                            }
                        }
                        continue;
                    }
                    for &variant in &variants {
                        match dtype {
                            DType::BF16 => bench_one::<bf16>(s, d, causal, variant, reps, extras)?,
                            _ => bench_one::<f16>(s, d, causal, variant, reps, extras)?,
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Options of the benchmark that need the extras variants: dropout probability, softcap.
#[derive(Clone, Copy)]
struct Extras {
    dropout: Option<f32>,
    softcap: Option<f32>,
}

impl Extras {
    /// The optional kernel paths these options use.
    fn paths(self) -> ExtraPaths {
        ExtraPaths {
            dropout: self.dropout.is_some_and(|p| p > 0.0),
            softcap: self.softcap.is_some(),
            ..ExtraPaths::NONE
        }
    }

    fn apply<'a>(self, mut spec: AttentionSpec<'a>) -> AttentionSpec<'a> {
        if let Some(p) = self.dropout {
            spec = spec.dropout(p, 0x5eed, 0);
        }
        if let Some(c) = self.softcap {
            spec = spec.softcap(c);
        }
        spec
    }

    /// `,"dropout":…,"softcap":…` for a JSON line.
    fn json(self) -> String {
        let f = |x: Option<f32>| x.map_or("null".to_string(), |x| x.to_string());
        format!(",\"dropout\":{},\"softcap\":{}", f(self.dropout), f(self.softcap))
    }
}

fn bench_one<T: cuda::CudaElement>(
    s: usize,
    d: usize,
    causal: bool,
    variant: Option<Variant>,
    reps: usize,
    extras: Extras,
) -> Result<()> {
    let dev = cuda::default_device()?;
    let (b, hq) = (16384 / s, 2048 / d);
    let hk = hq;
    let n = b * s * hq * d;
    let mut rng = Rng::new(s as u64 * 31 + d as u64);
    let host: Vec<T> = (0..n).map(|_| T::from_f64(rng.normal())).collect();
    let de = |e| flash_attn::Error::CudaLaunch(format!("{e:?}"));
    let q = dev.upload(&host)?;
    let k = dev.upload(&host[n / 3..].iter().chain(&host[..n / 3]).copied().collect::<Vec<_>>())?;
    let v = dev.upload(&host[n / 2..].iter().chain(&host[..n / 2]).copied().collect::<Vec<_>>())?;
    let stream = dev.stream();
    let mut out = stream.alloc_zeros::<T>(n).map_err(de)?;
    let mut lse = stream.alloc_zeros::<f32>(b * hq * s).map_err(de)?;
    let shape = [b, s, hq, d];
    let spec = extras.apply(if causal { AttentionSpec::new().causal() } else { AttentionSpec::new() });
    let run = |out: &mut cudarc::driver::CudaSlice<T>, lse: &mut cudarc::driver::CudaSlice<f32>| -> Result<()> {
        let (qt, kt, vt) = (
            DeviceTensor::new(q.as_view(), &shape),
            DeviceTensor::new(k.as_view(), &shape),
            DeviceTensor::new(v.as_view(), &shape),
        );
        let mut ot = DeviceTensorMut::new(out.as_view_mut(), &shape);
        let mut lv = lse.as_view_mut();
        dev.forward_variant(&spec, &qt, &kt, &vt, &mut ot, &mut lv, variant)
    };
    for _ in 0..3 {
        run(&mut out, &mut lse)?;
    }
    stream.synchronize().map_err(de)?;
    let ctx = dev.context();
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(de)?;
        let end = ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(de)?;
        start.record(stream).map_err(de)?;
        run(&mut out, &mut lse)?;
        end.record(stream).map_err(de)?;
        end.synchronize().map_err(de)?;
        times.push(start.elapsed_ms(&end).map_err(de)? as f64);
    }
    times.sort_by(f64::total_cmp);
    let ms = times[times.len() / 2];
    let flops = 4.0 * (b * hq * s * s * d) as f64 / if causal { 2.0 } else { 1.0 };
    let name = variant
        .or_else(|| Variant::for_problem(dev.arch(), T::DTYPE, d, extras.paths(), true))
        .map(|v| v.name())
        .unwrap_or_default();
    println!(
        "{{\"device\":\"cuda\",\"dtype\":\"{}\",\"b\":{b},\"hq\":{hq},\"hk\":{hk},\"sq\":{s},\"sk\":{s},\"d\":{d},\"causal\":{causal},\"fwd_ms\":{ms:.5},\"tflops\":{:.1},\"variant\":\"{name}\"{}}}",
        T::DTYPE,
        flops / ms / 1e9,
        extras.json()
    );
    Ok(())
}

/// The backward pass alone (after one forward), timed like `bench_one`.
fn bench_bwd<T: cuda::CudaElement>(
    s: usize,
    d: usize,
    causal: bool,
    variant: Option<BwdVariant>,
    reps: usize,
    deterministic: bool,
    extras: Extras,
) -> Result<()> {
    let dev = cuda::default_device()?;
    let (b, hq) = (16384 / s, 2048 / d);
    let n = b * s * hq * d;
    let mut rng = Rng::new(s as u64 * 37 + d as u64);
    let host: Vec<T> = (0..n).map(|_| T::from_f64(rng.normal())).collect();
    let de = |e| flash_attn::Error::CudaLaunch(format!("{e:?}"));
    let rot = |by: usize| host[by..].iter().chain(&host[..by]).copied().collect::<Vec<_>>();
    let q = dev.upload(&host)?;
    let k = dev.upload(&rot(n / 3))?;
    let v = dev.upload(&rot(n / 2))?;
    let dout = dev.upload(&rot(n / 5))?;
    let stream = dev.stream();
    let mut out = stream.alloc_zeros::<T>(n).map_err(de)?;
    let mut lse = stream.alloc_zeros::<f32>(b * hq * s).map_err(de)?;
    let (mut dq, mut dk, mut dv) = (
        stream.alloc_zeros::<T>(n).map_err(de)?,
        stream.alloc_zeros::<T>(n).map_err(de)?,
        stream.alloc_zeros::<T>(n).map_err(de)?,
    );
    let shape = [b, s, hq, d];
    let mut spec = extras.apply(if causal { AttentionSpec::new().causal() } else { AttentionSpec::new() });
    if deterministic {
        spec = spec.deterministic();
    }
    {
        let (qt, kt, vt) = (
            DeviceTensor::new(q.as_view(), &shape),
            DeviceTensor::new(k.as_view(), &shape),
            DeviceTensor::new(v.as_view(), &shape),
        );
        let mut ot = DeviceTensorMut::new(out.as_view_mut(), &shape);
        let mut lv = lse.as_view_mut();
        dev.forward(&spec, &qt, &kt, &vt, &mut ot, &mut lv)?;
    }
    let mut run = || -> Result<()> {
        let (qt, kt, vt) = (
            DeviceTensor::new(q.as_view(), &shape),
            DeviceTensor::new(k.as_view(), &shape),
            DeviceTensor::new(v.as_view(), &shape),
        );
        let (ot, dot) = (DeviceTensor::new(out.as_view(), &shape), DeviceTensor::new(dout.as_view(), &shape));
        let mut gq = DeviceTensorMut::new(dq.as_view_mut(), &shape);
        let mut gk = DeviceTensorMut::new(dk.as_view_mut(), &shape);
        let mut gv = DeviceTensorMut::new(dv.as_view_mut(), &shape);
        dev.backward_variant(&spec, &qt, &kt, &vt, &ot, &lse.as_view(), &dot, &mut gq, &mut gk, &mut gv, variant)
    };
    for _ in 0..3 {
        run()?;
    }
    stream.synchronize().map_err(de)?;
    let ctx = dev.context();
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(de)?;
        let end = ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(de)?;
        start.record(stream).map_err(de)?;
        run()?;
        end.record(stream).map_err(de)?;
        end.synchronize().map_err(de)?;
        times.push(start.elapsed_ms(&end).map_err(de)? as f64);
    }
    times.sort_by(f64::total_cmp);
    let ms = times[times.len() / 2];
    let flops = 2.5 * 4.0 * (b * hq * s * s * d) as f64 / if causal { 2.0 } else { 1.0 };
    let name = variant
        .or_else(|| BwdVariant::for_problem(dev.arch(), T::DTYPE, d, extras.paths(), true))
        .map(|v| v.name())
        .unwrap_or_default();
    println!(
        "{{\"device\":\"cuda\",\"dtype\":\"{}\",\"b\":{b},\"hq\":{hq},\"sq\":{s},\"d\":{d},\"causal\":{causal},\"deterministic\":{deterministic},\"bwd_ms\":{ms:.5},\"tflops\":{:.1},\"variant\":\"{name}\"{}}}",
        T::DTYPE,
        flops / ms / 1e9,
        extras.json()
    );
    Ok(())
}

/// One FP8 forward on random inputs of these shapes against the oracle (the FP8 contract).
fn fp8_case(
    rng: &mut Rng,
    shape_q: [usize; 4],
    shape_kv: [usize; 4],
    causal: Causal,
    variant: Option<cuda::Fp8Variant>,
) -> Result<bool> {
    let mut tensor = |n: usize| {
        let x: Vec<f32> = (0..n).map(|_| (2.0 * rng.normal()) as f32).collect();
        flash_attn::fp8::quantize(&x)
    };
    let (q, k, v) =
        (tensor(shape_q.iter().product()), tensor(shape_kv.iter().product()), tensor(shape_kv.iter().product()));
    let spec = AttentionSpec::new().causal_mode(causal);
    let scales = flash_attn::Fp8Scales { q: q.1, k: k.1, v: v.1 };
    let ours = cuda::forward_fp8_host_variant(
        &spec,
        &flash_attn::Tensor::new(&q.0, &shape_q),
        &flash_attn::Tensor::new(&k.0, &shape_kv),
        &flash_attn::Tensor::new(&v.0, &shape_kv),
        scales,
        variant,
    )?;
    let deq = |x: &(Vec<flash_attn::Fp8E4m3>, f32)| flash_attn::fp8::dequantize(&x.0, x.1);
    let (dq, dk, dv) = (deq(&q), deq(&k), deq(&v));
    let (tq, tk, tv) = (
        flash_attn::Tensor::new(&dq, &shape_q),
        flash_attn::Tensor::new(&dk, &shape_kv),
        flash_attn::Tensor::new(&dv, &shape_kv),
    );
    let oracle = reference::forward(&spec, &tq, &tk, &tv)?;
    let naive = reference::naive_fp8(&spec, &tq, &tk, &tv)?;
    Ok(flash_attn::check::report_fp8(&ours.out, &ours.lse, &oracle, &naive).passed())
}

/// `--release-pool`: the default memory pool back at CUDA's release threshold of 0 (the library
/// sets `u64::MAX`, [`cuda::Device::new`]), so that every synchronisation unmaps its unused memory:
/// what a synchronising caller paid before (the benchmarks synchronise after every timed call).
fn release_pool(args: &[String]) -> Result<()> {
    if args.iter().any(|a| a == "--release-pool") {
        cuda::default_device()?.set_pool_release_threshold(0)?;
    }
    Ok(())
}

/// The FP8 forward (the whole call: V's transpose and the kernel) and the bf16 forward on BENCH.md's
/// `gpu` shapes (b·s = 16k, hq·d = 2048), one run of each after the other per rep; medians.
fn bench_fp8(args: &[String]) -> Result<()> {
    release_pool(args)?;
    let causals = match arg(args, "--causal", "both") {
        "yes" => vec![true],
        "no" => vec![false],
        _ => vec![false, true],
    };
    let dims: Vec<usize> = arg(args, "--d", "128").split(',').filter_map(|s| s.parse().ok()).collect();
    let seqs: Vec<usize> = arg(args, "--seqs", "1024,4096,16384").split(',').filter_map(|s| s.parse().ok()).collect();
    let reps: usize = arg(args, "--reps", "20").parse().unwrap_or(20);
    let dev = cuda::default_device()?;
    let de = |e| flash_attn::Error::CudaLaunch(format!("{e:?}"));
    for &d in &dims {
        for &s in &seqs {
            for &causal in &causals {
                let (b, hq) = (16384 / s, 2048 / d);
                let n = b * s * hq * d;
                let shape = [b, s, hq, d];
                let mut rng = Rng::new(s as u64 * 37 + d as u64);
                let x: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
                let (x8, scale) = flash_attn::fp8::quantize(&x);
                let bytes: Vec<u8> = x8.iter().map(|e| e.to_bits()).collect();
                let halves: Vec<bf16> = x.iter().map(|&e| bf16::from_f32(e)).collect();
                let stream = dev.stream();
                let q8 = stream.clone_htod(&bytes).map_err(de)?;
                let k8 = stream.clone_htod(&[&bytes[n / 3..], &bytes[..n / 3]].concat()).map_err(de)?;
                let v8 = stream.clone_htod(&[&bytes[n / 2..], &bytes[..n / 2]].concat()).map_err(de)?;
                let q = dev.upload(&halves)?;
                let k = dev.upload(&[&halves[n / 3..], &halves[..n / 3]].concat())?;
                let v = dev.upload(&[&halves[n / 2..], &halves[..n / 2]].concat())?;
                let mut out = stream.alloc_zeros::<bf16>(n).map_err(de)?;
                let mut lse = stream.alloc_zeros::<f32>(b * hq * s).map_err(de)?;
                let spec = if causal { AttentionSpec::new().causal() } else { AttentionSpec::new() };
                let scales = flash_attn::Fp8Scales { q: scale, k: scale, v: scale };
                let fp8_variants =
                    [None, cuda::Fp8Variant::for_head_dim(d).map(|v| cuda::Fp8Variant { ws: false, ..v })];
                let mut run = |which: usize| -> Result<()> {
                    let mut ot = DeviceTensorMut::new(out.as_view_mut(), &shape);
                    let mut lv = lse.as_view_mut();
                    if which > 0 {
                        let (qt, kt, vt) = (
                            DeviceTensor::new(q8.as_view(), &shape),
                            DeviceTensor::new(k8.as_view(), &shape),
                            DeviceTensor::new(v8.as_view(), &shape),
                        );
                        dev.forward_fp8_variant(&spec, &qt, &kt, &vt, scales, &mut ot, &mut lv, fp8_variants[which - 1])
                    } else {
                        let (qt, kt, vt) = (
                            DeviceTensor::new(q.as_view(), &shape),
                            DeviceTensor::new(k.as_view(), &shape),
                            DeviceTensor::new(v.as_view(), &shape),
                        );
                        dev.forward(&spec, &qt, &kt, &vt, &mut ot, &mut lv)
                    }
                };
                // `--ws-only`: the bf16 forward and the default FP8 kernel (no `_h` comparison).
                let kernels = if args.iter().any(|a| a == "--ws-only") { 2 } else { 3 };
                for _ in 0..3 {
                    for which in 0..kernels {
                        run(which)?;
                    }
                }
                stream.synchronize().map_err(de)?;
                let ctx = dev.context();
                let mut times = [Vec::with_capacity(reps), Vec::with_capacity(reps), Vec::with_capacity(reps)];
                for _ in 0..reps {
                    for (which, times) in times.iter_mut().enumerate().take(kernels) {
                        let ev = || ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT));
                        let (start, end) = (ev().map_err(de)?, ev().map_err(de)?);
                        start.record(stream).map_err(de)?;
                        run(which)?;
                        end.record(stream).map_err(de)?;
                        end.synchronize().map_err(de)?;
                        times.push(start.elapsed_ms(&end).map_err(de)? as f64);
                    }
                }
                let flops = 4.0 * (b * hq * s * s * d) as f64 / if causal { 2.0 } else { 1.0 };
                let mut med = [0.0; 3];
                let names = fp8_variants.map(|v| v.or_else(|| cuda::Fp8Variant::for_head_dim(d)).map(|v| v.name()));
                for (which, dtype) in [(0, "bf16"), (1, "fp8e4m3"), (2, "fp8e4m3")].into_iter().take(kernels) {
                    let variant = if which == 0 { None } else { names[which - 1].clone() };
                    times[which].sort_by(f64::total_cmp);
                    let ms = times[which][times[which].len() / 2];
                    med[which] = ms;
                    println!(
                        "{{\"device\":\"cuda\",\"dtype\":\"{dtype}\",\"b\":{b},\"hq\":{hq},\"hk\":{hq},\"sq\":{s},\"sk\":{s},\"d\":{d},\"causal\":{causal},\"fwd_ms\":{ms:.5},\"tflops\":{:.1},\"variant\":\"{}\"}}",
                        flops / ms / 1e9,
                        variant.unwrap_or_default()
                    );
                }
                println!(
                    "fp8 / bf16 speed d {d} s {s} causal {causal}: {:.3} (not warp-specialised: {:.3})",
                    med[0] / med[1],
                    if kernels > 2 { med[0] / med[2] } else { f64::NAN }
                );
            }
        }
    }
    Ok(())
}

/// The probe of `racecheck-probe`: thread 0 hands four values to thread 32 through one shared
/// word, each ordered by `mode`: 0, an mbarrier pair ("full": st.shared then arrive with release
/// semantics, try_wait.parity with acquire; "empty" back), as the warp-specialised forward hands
/// its item index; 1, nothing (a race racecheck must report); 2, __syncthreads (a control it must
/// not). The consumer writes what it read to `out[4 · mode + round]`.
const RACECHECK_PROBE: &str = r#"
typedef unsigned int u32;
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n.reg .pred done;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
extern "C" __global__ void racecheck_probe(int mode, int* out) {
    __shared__ __align__(8) unsigned long long bars[2];
    __shared__ int slot;
    const int t = threadIdx.x;
    const u32 full = smem_addr(&bars[0]), empty = smem_addr(&bars[1]);
    if (t == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(full));
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(empty));
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        slot = -1;
    }
    __syncthreads();
    for (int r = 0; r < 4; ++r) {
        if (mode == 2) __syncthreads();
        if (t == 0) {
            if (mode == 0 && r > 0) mbar_wait(empty, (u32)((r - 1) & 1));
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(smem_addr(&slot)), "r"(100 + r) : "memory");
            if (mode == 0) mbar_arrive(full);
        }
        if (mode == 2) __syncthreads();
        if (t == 32) {
            if (mode == 0) mbar_wait(full, (u32)(r & 1));
            int v;
            asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(smem_addr(&slot)) : "memory");
            out[4 * mode + r] = v;
            if (mode == 0) mbar_arrive(empty);
        }
    }
}
"#;

/// Runs the racecheck probe's three modes and prints what the consumer read (mode 0 and 2 must
/// read 100..103 in order; mode 1 may read anything).
fn racecheck_probe() -> Result<()> {
    use cudarc::driver::PushKernelArg;
    let dev = cuda::default_device()?;
    let de = |e| flash_attn::Error::CudaLaunch(format!("{e:?}"));
    let compiled = cuda::nvrtc::compile("racecheck_probe", RACECHECK_PROBE, &["--std=c++17".into()], dev.arch())?;
    let module = dev.context().load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin)).map_err(de)?;
    let f = module.load_function("racecheck_probe").map_err(de)?;
    let stream = dev.stream();
    let mut out = stream.alloc_zeros::<i32>(12).map_err(de)?;
    for mode in 0..3i32 {
        let cfg = cudarc::driver::LaunchConfig { grid_dim: (1, 1, 1), block_dim: (64, 1, 1), shared_mem_bytes: 0 };
        let mut builder = stream.launch_builder(&f);
        builder.arg(&mode);
        builder.arg(&mut out);
        // SAFETY: the kernel takes (int, int*) and writes out[4 · mode .. 4 · mode + 4], inside
        // the 12 allocated above.
        unsafe { builder.launch(cfg) }.map_err(de)?;
    }
    let host = stream.clone_dtoh(&out).map_err(de)?;
    for (mode, name) in ["mbarrier", "none", "__syncthreads"].iter().enumerate() {
        println!("racecheck-probe mode {mode} ({name}): read {:?}", &host[4 * mode..4 * mode + 4]);
    }
    Ok(())
}
