//! `flash-attn bench`: time, FLOP/s and peak extra memory of the forward pass and, with
//! `--backward`, of one forward plus one backward (BENCH.md).
//!
//! Inputs (and `dout`) are made and outputs and gradients allocated before timing; each time is
//! the median of at least [`MIN_RUNS`] timed calls after a warm-up call, with more runs for short
//! shapes (until about [`TIME_BUDGET`] of timing): `flash_attn::forward_into` alone, then
//! `forward_into` followed by `backward_into`. Peak extra memory is measured on the warm-up calls
//! (the forward's, then the backward's alone) with the counting allocator of [`crate::alloc`].
//!
//! On `--device cuda` (cuda builds; f16/bf16) the inputs, outputs (and with `--backward` `dout` and
//! the gradients) are device buffers made before timing, and each timed call sits between its own pair of CUDA events (see
//! [`crate::gpu`]); the grid is BENCH.md's `gpu` grid. Peak extra memory is the device memory
//! pool's high-water mark over one extra call beyond what was in use before it (`null` where the
//! device has no memory pools); with `--backward`, `bwd_peak_extra_bytes` is that of one forward
//! plus one backward (the forward allocates nothing of its own).
//!
//! `--block-size BQ,BK` (with `--shape`) adds a block-sparse mask `[qb, kb]` with `--density`
//! percent of its blocks on, drawn from a fixed seed; FLOP/s then count the visible pairs only
//! (Algorithm 5's work), and the JSON line gains `block_q`, `block_k`, `density_pct` and
//! `visible_fraction`.
//!
//! `--dtype fp8e4m3` times the FP8 forward (`flash_attn::forward_fp8`; on cuda the device buffers'
//! `Device::forward_fp8`, sm_90a): the inputs are drawn as f32 normals as for the other dtypes and
//! quantized per tensor (`flash_attn::fp8::quantize`) before timing; FLOPs are counted as for the
//! other dtypes. On the CPU each timed call is the library's whole entry point: it dequantizes the
//! inputs to f32 and allocates `out` (bf16) and `lse`, which its peak extra memory includes. There
//! is no FP8 backward, so `--backward` (and `--decode`) with it is an error.
//!
//! `--plot FILE.svg` (implies `--memory`) draws the memory table's measurements as a figure (runtime and peak
//! extra memory vs N, see [`crate::plot`]); nothing is measured twice.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use flash_attn::check::Rng;
use flash_attn::{fp8, AttentionSpec, DType, Element, Fp8Scales, Tensor, TensorMut};
use half::{bf16, f16};

use crate::dtype::{InputDType, DTYPE_VALUES};
use crate::gpu::{self, GpuElement};
use crate::plot::{self, Point, Series};
use crate::progress::Progress;
use crate::run::zeroed;
use crate::{alloc, CliError, Device, Result};

/// Fewest timed runs behind a median.
pub(crate) const MIN_RUNS: usize = 5;
/// Keep timing short shapes until this much time has been spent (or [`MAX_RUNS`] reached).
const TIME_BUDGET: Duration = Duration::from_millis(500);
/// Most timed runs per shape.
const MAX_RUNS: usize = 1000;
/// Fewest timed runs behind a median in the memory table, whose long sequences take seconds per
/// call.
const MEMORY_MIN_RUNS: usize = 3;
/// Head dimension of the memory table.
const MEMORY_D: usize = 64;
/// Sequence lengths of the memory table.
const MEMORY_SEQLENS: [usize; 7] = [1 << 10, 1 << 11, 1 << 12, 1 << 13, 1 << 14, 1 << 15, 1 << 16];

/// Arguments of `flash-attn bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Backend to time (`cuda`: f16 or bf16, forward and with `--backward` forward + backward;
    /// fp8e4m3 forward on sm_90a).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,

    /// Element type of q, k, v and out. `fp8e4m3` (aliases `fp8`, `e4m3`, `float8_e4m3fn`): the
    /// FP8 forward, inputs drawn as f32 normals and quantized per tensor (descale = max|x| / 448),
    /// out in bf16; forward only (no `--backward`, no `--decode`).
    #[arg(long, value_name = DTYPE_VALUES, default_value = "f32")]
    dtype: InputDType,

    /// One problem `batch, query heads, kv heads, query length, key length, head dim`; without
    /// it, the default grid (on cuda BENCH.md's `gpu` grid: b·s = 16k, hq·d = 2048).
    #[arg(long, value_name = "B,HQ,HK,SQ,SK,D", value_parser = parse_shape)]
    shape: Option<Shape>,

    /// Causal (bottom-right) mask for `--shape`; the grid runs both.
    #[arg(long, requires = "shape")]
    causal: bool,

    /// A block-sparse mask for `--shape`: blocks of BQ query rows by BK keys, `--density`
    /// percent of them on (a fixed random draw); FLOP/s count the visible pairs.
    #[arg(long, value_name = "BQ,BK", value_parser = parse_block, requires = "shape")]
    block_size: Option<(usize, usize)>,

    /// Percent of the blocks of `--block-size` that are on.
    #[arg(long, value_name = "PCT", default_value_t = 50, requires = "block_size",
          value_parser = clap::value_parser!(u8).range(0..=100))]
    density: u8,

    /// Also time one forward plus one backward (`fwdbwd_ms`), with FLOPs = 3.5 × forward, and
    /// measure the backward's peak extra memory.
    #[arg(long)]
    backward: bool,

    /// Decode with a KV cache (needs `--shape B,HQ,HK,SQ,SK,D`): SQ query tokens per sequence
    /// attend causally to a cache of SK tokens; prints `fwd_ms` and `gbps` (K+V bytes of the SK
    /// cached tokens read / time) and, on cpu, the machine's read bandwidth (`mem_gbps`).
    #[arg(long, requires = "shape", conflicts_with_all = ["backward", "block_size", "memory", "plot", "fma_peak"])]
    decode: bool,

    /// With `--decode`: a paged cache of P tokens a page (pages in shuffled order).
    #[arg(long, value_name = "P", requires = "decode")]
    page_size: Option<usize>,

    /// With `--decode`: split each sequence's keys into N parts (0: the library's heuristic).
    #[arg(long, value_name = "N", default_value_t = 0, requires = "decode")]
    num_splits: usize,

    /// Print one JSON line per problem instead of a table.
    #[arg(long)]
    json: bool,

    /// The f32 fused multiply-add rate of all threads on the CPU path in use (register-only
    /// loop): the peak to read the CPU's GFLOP/s against.
    #[arg(long, conflicts_with_all = ["shape", "json", "memory", "plot", "backward"])]
    fma_peak: bool,

    /// The memory table: our forward next to Algorithm 0, d = 64, one head, f32, N = 1k..64k.
    #[arg(long, conflicts_with_all = ["shape", "json", "dtype", "causal", "backward"])]
    memory: bool,

    /// Longest sequence Algorithm 0 runs on in the memory table (it needs N² floats).
    #[arg(long, value_name = "N", default_value_t = 8192, requires = "memory")]
    naive_max: usize,

    /// Draw the memory table as an SVG figure: runtime and peak extra memory vs N, log-log,
    /// Algorithm 0 next to flash-attn (implies `--memory`).
    #[arg(long, value_name = "FILE.svg", conflicts_with_all = ["shape", "json", "dtype", "causal", "backward"])]
    plot: Option<PathBuf>,

    /// Longest sequence of the memory table (for tests: a short sweep).
    #[arg(
        long,
        value_name = "N",
        default_value_t = MEMORY_SEQLENS[MEMORY_SEQLENS.len() - 1],
        requires = "memory",
        hide = true
    )]
    max_n: usize,
}

/// The sizes of one benchmark problem (`v` has head dim `d` too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub(crate) b: usize,
    pub(crate) hq: usize,
    pub(crate) hk: usize,
    pub(crate) sq: usize,
    pub(crate) sk: usize,
    pub(crate) d: usize,
}

/// Parses `B,HQ,HK,SQ,SK,D`.
fn parse_shape(s: &str) -> std::result::Result<Shape, String> {
    let dims = s
        .split(',')
        .map(|x| x.trim().parse::<usize>().map_err(|e| format!("`{}`: {e}", x.trim())))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    match dims[..] {
        [b, hq, hk, sq, sk, d] => Ok(Shape { b, hq, hk, sq, sk, d }),
        _ => Err(format!("expected six sizes B,HQ,HK,SQ,SK,D, got {}", dims.len())),
    }
}

/// Parses `BQ,BK` (both positive).
fn parse_block(s: &str) -> std::result::Result<(usize, usize), String> {
    let dims = s
        .split(',')
        .map(|x| x.trim().parse::<usize>().map_err(|e| format!("`{}`: {e}", x.trim())))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    match dims[..] {
        [bq, bk] if bq > 0 && bk > 0 => Ok((bq, bk)),
        _ => Err("expected two positive sizes BQ,BK".to_owned()),
    }
}

/// A block-sparse mask option of a problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BlockOpt {
    block_q: usize,
    block_k: usize,
    /// Percent of the blocks on.
    density: u8,
}

impl BlockOpt {
    /// The mask `[qb, kb]` for `sq × sk`: each block on with probability `density` percent, from a
    /// fixed seed (the same mask on every run and device).
    fn mask(&self, sq: usize, sk: usize) -> (Vec<u8>, [usize; 2]) {
        let (qb, kb) = (sq.div_ceil(self.block_q), sk.div_ceil(self.block_k));
        let mut rng = Rng::new(0xB10C);
        let mask = (0..qb * kb).map(|_| u8::from(rng.uniform() * 100.0 < f64::from(self.density))).collect();
        (mask, [qb, kb])
    }
}

/// A shape, whether it is causal, and its block mask, if any.
#[derive(Debug, Clone, Copy)]
struct Problem {
    shape: Shape,
    causal: bool,
    block: Option<BlockOpt>,
}

impl Problem {
    /// The problem's spec over `mask` (made by [`BlockOpt::mask`] when it has a block mask).
    fn spec<'a>(&self, mask: &'a (Vec<u8>, [usize; 2])) -> AttentionSpec<'a> {
        let spec = if self.causal { AttentionSpec::new().causal() } else { AttentionSpec::new() };
        match self.block {
            Some(b) => spec.block_mask(Tensor::new(&mask.0, &mask.1), b.block_q, b.block_k),
            None => spec,
        }
    }

    /// The mask of [`Problem::spec`] (empty without a block mask).
    fn mask(&self) -> (Vec<u8>, [usize; 2]) {
        match self.block {
            Some(b) => b.mask(self.shape.sq, self.shape.sk),
            None => (Vec::new(), [0, 0]),
        }
    }

    /// Visible (query, key) pairs of one head over all pairs: 1 without a mask, about 1/2 causal;
    /// with a block mask counted exactly (bottom-right causal intersected with the mask).
    fn visible_fraction(&self) -> f64 {
        let Shape { sq, sk, .. } = self.shape;
        let Some(b) = self.block else {
            return if self.causal { 0.5 } else { 1.0 };
        };
        let (mask, [_, kb]) = self.mask();
        let off = sk as i64 - sq as i64;
        let mut visible = 0usize;
        for i in 0..sq {
            // Keys [0, hi) under the causal rule (all keys without it).
            let hi = if self.causal { (i as i64 + off + 1).clamp(0, sk as i64) as usize } else { sk };
            let row = &mask[(i / b.block_q) * kb..][..kb];
            for (bj, &on) in row.iter().enumerate() {
                let (c0, c1) = (bj * b.block_k, ((bj + 1) * b.block_k).min(sk));
                if on != 0 && c0 < hi {
                    visible += c1.min(hi) - c0;
                }
            }
        }
        visible as f64 / (sq * sk).max(1) as f64
    }

    /// FlashAttention's FLOP count, over the visible pairs (`4 · b · hq · sq · sk · d ·
    /// visible fraction`; the causal half as FlashAttention counts it).
    fn flops(&self) -> f64 {
        let Shape { b, hq, sq, sk, d, .. } = self.shape;
        4.0 * b as f64 * hq as f64 * sq as f64 * sk as f64 * d as f64 * self.visible_fraction()
    }
}

impl Problem {
    /// `b×hq×s×d`, with `hq/hk` and `sq/sk` where they differ.
    fn label(&self) -> String {
        let s = self.shape;
        let heads = if s.hq == s.hk { s.hq.to_string() } else { format!("{}/{}", s.hq, s.hk) };
        let len = if s.sq == s.sk { s.sq.to_string() } else { format!("{}/{}", s.sq, s.sk) };
        let block =
            self.block.map_or_else(String::new, |b| format!(" blocks {}×{} {}%", b.block_q, b.block_k, b.density));
        format!("{}×{heads}×{len}×{}{block}", s.b, s.d)
    }
}

/// The BENCH.md `cpu` grid: b 1, 8 heads, s ∈ {128 … 4k}, d ∈ {64, 128}, plus b 4 × 12 heads ×
/// 512 × 64; each non-causal and causal.
fn default_grid() -> Vec<Problem> {
    let mut grid = Vec::new();
    for d in [64, 128] {
        for s in [128, 512, 1024, 2048, 4096] {
            for causal in [false, true] {
                grid.push(Problem { shape: Shape { b: 1, hq: 8, hk: 8, sq: s, sk: s, d }, causal, block: None });
            }
        }
    }
    for causal in [false, true] {
        grid.push(Problem { shape: Shape { b: 4, hq: 12, hk: 12, sq: 512, sk: 512, d: 64 }, causal, block: None });
    }
    grid
}

/// The BENCH.md `gpu` grid (FlashAttention's convention): b·s = 16k tokens, hq·d = 2048,
/// s ∈ {512 … 16k}, d ∈ {64, 128}; each non-causal and causal.
fn gpu_grid() -> Vec<Problem> {
    let mut grid = Vec::new();
    for d in [64, 128] {
        for s in [512, 1024, 2048, 4096, 8192, 16384] {
            for causal in [false, true] {
                let (b, h) = (16384 / s, 2048 / d);
                grid.push(Problem { shape: Shape { b, hq: h, hk: h, sq: s, sk: s, d }, causal, block: None });
            }
        }
    }
    grid
}

impl Shape {
    /// Shapes of `q`, `k`, `v` (DESIGN §2, fixed length).
    fn qkv(&self) -> [[usize; 4]; 3] {
        let Shape { b, hq, hk, sq, sk, d } = *self;
        [[b, sq, hq, d], [b, sk, hk, d], [b, sk, hk, d]]
    }
}

/// What one problem measured.
#[derive(Debug, Clone, Copy)]
struct Measurement {
    /// Median forward time.
    fwd_ms: f64,
    /// Timed runs behind the median.
    runs: usize,
    /// FLOP/s at the median, FlashAttention's count.
    gflops: f64,
    /// Peak heap bytes of one forward call beyond what was live before it (on cuda: device memory,
    /// see [`crate::gpu`]; `None` where it cannot be read).
    peak_extra: Option<usize>,
    /// One forward plus one backward, with `--backward`.
    fwdbwd: Option<FwdBwd>,
}

/// What the forward+backward timing of one problem measured.
#[derive(Debug, Clone, Copy)]
struct FwdBwd {
    /// Median time of one forward plus one backward.
    ms: f64,
    /// Timed runs behind the median.
    runs: usize,
    /// FLOP/s at the median, with FLOPs = 3.5 × forward (BENCH.md).
    gflops: f64,
    /// Peak heap bytes of one backward call beyond what was live before it (its inputs and the
    /// preallocated gradients not counted): the `f32` dQ accumulator, `D` and scratch. On cuda the
    /// device memory pool's high-water mark over a forward plus a backward (see [`crate::gpu`]),
    /// `None` where it cannot be read.
    bwd_peak_extra: Option<usize>,
}

/// Forward+backward FLOPs relative to the forward's (BENCH.md: backward = 2.5 × forward).
const FWDBWD_FLOPS_FACTOR: f64 = 3.5;

/// Runs `flash-attn bench`.
pub fn main(args: &BenchArgs) -> Result<ExitCode> {
    let cuda = args.device == Device::Cuda;
    let fp8 = args.dtype == InputDType::Fp8E4m3;
    if fp8 && args.backward {
        return Err(CliError::new(
            "`--backward` with `--dtype fp8e4m3`: there is no FP8 backward pass (FP8 inputs run forward only)",
        ));
    }
    if fp8 && args.decode {
        return Err(CliError::new("`--decode` with `--dtype fp8e4m3`: the KV cache takes f32, f16 or bf16"));
    }
    let memory = args.memory || args.plot.is_some();
    if cuda && memory {
        return Err(CliError::new("the memory table (`--memory`) runs on cpu only"));
    }
    let gpu_name = args.device.ensure_available()?;
    if cuda && args.fma_peak {
        return Err(CliError::new("the FMA peak (`--fma-peak`) is measured on cpu only"));
    }
    if let (true, Some(shape), InputDType::Float(dtype)) = (args.decode, args.shape, args.dtype) {
        return crate::decode_bench::main(args.device, dtype, shape, args.page_size, args.num_splits, args.json);
    }
    let isa = if cuda { None } else { Some(flash_attn::cpu::Isa::default_for_process()?) };
    if let (Some(isa), true) = (isa, args.fma_peak) {
        let (gflops, threads) = flash_attn::cpu::peak::fma_gflops(isa, 3);
        println!("f32 FMA peak, {isa} path, {threads} threads: {gflops:.1} GFLOP/s");
        return Ok(ExitCode::SUCCESS);
    }
    if !cuda {
        warm_up()?;
    }
    if memory {
        return memory_table(args.naive_max, args.max_n, args.plot.as_deref());
    }

    let problems = match args.shape {
        Some(shape) => {
            let block = args.block_size.map(|(block_q, block_k)| BlockOpt { block_q, block_k, density: args.density });
            vec![Problem { shape, causal: args.causal, block }]
        }
        None if cuda => gpu_grid(),
        None => default_grid(),
    };
    let progress = Progress::bar(problems.len() as u64, "bench");
    let mut rows = Vec::new();
    for p in &problems {
        progress.set_message(p.label());
        let m = if cuda {
            measure_cuda(args.dtype, p, args.backward)?
        } else {
            measure(args.dtype, p, &progress, MIN_RUNS, args.backward)?
        };
        if args.json {
            progress.suspend(|| println!("{}", json_line(args.device, args.dtype, p, &m)));
        }
        let mut row = vec![p.label(), if p.causal { "yes" } else { "no" }.to_owned(), fmt_ms(m.fwd_ms)];
        match m.peak_extra {
            Some(peak) => row.extend([format!("{:.1}", m.gflops), fmt_bytes(peak)]),
            None => row.extend([format!("{:.1}", m.gflops / 1e3), m.runs.to_string()]),
        }
        if let Some(fb) = m.fwdbwd {
            row.extend([
                fmt_ms(fb.ms),
                format!("{:.1}", fb.gflops),
                fb.bwd_peak_extra.map_or_else(|| "-".to_owned(), fmt_bytes),
            ]);
        }
        rows.push(row);
        progress.inc();
    }
    drop(progress);
    if let (false, Some(name)) = (args.json, &gpu_name) {
        println!(
            "forward, cuda {} on {name}; time = median of >= {MIN_RUNS} CUDA-event-timed runs after a warm-up",
            args.dtype
        );
        print_table(&["b×hq×s×d", "causal", "time ms", "TFLOP/s", "runs"], &rows);
    } else if !args.json {
        println!(
            "{}, {} {}, {} path, {} threads available; time = median of >= {MIN_RUNS} runs after a warm-up",
            if args.backward { "forward and forward+backward" } else { "forward" },
            args.device.name(),
            args.dtype,
            isa.map_or("cuda", |isa| isa.name()),
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
        if args.backward {
            print_table(
                &[
                    "b×hq×s×d",
                    "causal",
                    "fwd ms",
                    "fwd GFLOP/s",
                    "fwd peak extra",
                    "fwd+bwd ms",
                    "fwd+bwd GFLOP/s",
                    "bwd peak extra",
                ],
                &rows,
            );
            println!();
            println!(
                "fwd+bwd: one forward_into then one backward_into, FLOPs = {FWDBWD_FLOPS_FACTOR} × forward. \
                 bwd peak extra: heap of one backward call beyond its inputs and preallocated dq/dk/dv \
                 (the f32 dQ accumulator, D = rowsum(dO ∘ O) and per-thread scratch)."
            );
        } else {
            print_table(&["b×hq×s×d", "causal", "time ms", "GFLOP/s", "peak extra"], &rows);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One tiny forward so the library's thread pool exists before anything is measured.
fn warm_up() -> Result<()> {
    let x = [0.5f32; 16];
    let t = Tensor::new(&x, &[1, 2, 1, 8]);
    flash_attn::forward(&AttentionSpec::new(), &t, &t, &t)?;
    Ok(())
}

fn measure(
    dtype: InputDType,
    p: &Problem,
    progress: &Progress,
    min_runs: usize,
    backward: bool,
) -> Result<Measurement> {
    match dtype {
        InputDType::Float(DType::F32) => measure_typed::<f32>(p, progress, min_runs, backward),
        InputDType::Float(DType::F16) => measure_typed::<f16>(p, progress, min_runs, backward),
        InputDType::Float(DType::BF16) => measure_typed::<bf16>(p, progress, min_runs, backward),
        InputDType::Fp8E4m3 => measure_fp8(p, progress, min_runs),
    }
}

/// Standard normal values for a tensor of `shape`.
fn random<T: Element>(name: &str, shape: &[usize], rng: &mut Rng) -> Result<Vec<T>> {
    let mut buf = zeroed::<T>(name, shape)?;
    buf.iter_mut().for_each(|x| *x = T::from_f64(rng.normal()));
    Ok(buf)
}

/// Random q, k, v of `s`.
fn inputs<T: Element>(s: Shape) -> Result<[Vec<T>; 3]> {
    let mut rng = Rng::new(0);
    let [qs, ks, vs] = s.qkv();
    Ok([random("q", &qs, &mut rng)?, random("k", &ks, &mut rng)?, random("v", &vs, &mut rng)?])
}

/// One problem ready to time: its inputs and spec, and the forward's outputs allocated up front.
struct Prepared<'a, T> {
    spec: AttentionSpec<'a>,
    q: Tensor<'a, T>,
    k: Tensor<'a, T>,
    v: Tensor<'a, T>,
    out: Vec<T>,
    out_shape: Vec<usize>,
    lse: Vec<f32>,
}

/// `dout` and the gradient buffers of the backward pass, allocated up front.
struct Grads<T> {
    dout: Vec<T>,
    dq: Vec<T>,
    dk: Vec<T>,
    dv: Vec<T>,
}

impl<T: Element> Prepared<'_, T> {
    /// One forward pass into the preallocated `out` and `lse`.
    fn forward(&mut self) -> Result<()> {
        let mut out = TensorMut::new(&mut self.out, &self.out_shape);
        flash_attn::forward_into(&self.spec, &self.q, &self.k, &self.v, &mut out, &mut self.lse)?;
        Ok(())
    }

    /// One backward pass of the last forward, into the preallocated gradients.
    fn backward(&self, g: &mut Grads<T>) -> Result<()> {
        let (qs, ks, vs) = (self.q.shape(), self.k.shape(), self.v.shape());
        flash_attn::backward_into(
            &self.spec,
            &self.q,
            &self.k,
            &self.v,
            &Tensor::new(&self.out, &self.out_shape),
            &self.lse,
            &Tensor::new(&g.dout, &self.out_shape),
            &mut TensorMut::new(&mut g.dq, qs),
            &mut TensorMut::new(&mut g.dk, ks),
            &mut TensorMut::new(&mut g.dv, vs),
        )?;
        Ok(())
    }
}

/// Median time in ms of `call` and the number of timed runs: at least `min_runs`, more while
/// within [`TIME_BUDGET`] (at most [`MAX_RUNS`]).
pub(crate) fn time_calls(min_runs: usize, mut call: impl FnMut() -> Result<()>) -> Result<(f64, usize)> {
    let mut times = Vec::with_capacity(MAX_RUNS);
    let start = Instant::now();
    while times.len() < min_runs || (start.elapsed() < TIME_BUDGET && times.len() < MAX_RUNS) {
        let t = Instant::now();
        call()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok((median(&mut times), times.len()))
}

fn measure_typed<T: Element>(p: &Problem, progress: &Progress, min_runs: usize, backward: bool) -> Result<Measurement> {
    let s = p.shape;
    let [q, k, v] = inputs::<T>(s)?;
    let [qs, ks, vs] = s.qkv();
    let (q, k, v) = (Tensor::new(&q, &qs), Tensor::new(&k, &ks), Tensor::new(&v, &vs));
    let mask = p.mask();
    let spec = p.spec(&mask);
    let geometry = spec.geometry(&q, &k, &v)?;
    let out_shape = geometry.out_shape();
    let out = zeroed::<T>("out", &out_shape)?;
    let lse = zeroed::<f32>("lse", &geometry.lse_shape())?;
    let mut prepared = Prepared { spec, q, k, v, out, out_shape, lse };

    // The warm-up calls are the memory measurements, with progress redraws held back so that only
    // the library's allocations count.
    let (first, peak_extra) = progress.suspend(|| alloc::measure(|| prepared.forward()));
    first?;
    let (fwd_ms, runs) = time_calls(min_runs, || prepared.forward())?;
    let flops = p.flops();

    let fwdbwd = if backward {
        let mut grads = Grads {
            dout: random("dout", &prepared.out_shape, &mut Rng::new(1))?,
            dq: zeroed("dq", &qs)?,
            dk: zeroed("dk", &ks)?,
            dv: zeroed("dv", &vs)?,
        };
        let (first, bwd_peak_extra) = progress.suspend(|| alloc::measure(|| prepared.backward(&mut grads)));
        first?;
        let (ms, runs) = time_calls(min_runs, || {
            prepared.forward()?;
            prepared.backward(&mut grads)
        })?;
        Some(FwdBwd {
            ms,
            runs,
            gflops: FWDBWD_FLOPS_FACTOR * flops / (ms * 1e6),
            bwd_peak_extra: Some(bwd_peak_extra),
        })
    } else {
        None
    };
    Ok(Measurement { fwd_ms, runs, gflops: flops / (fwd_ms * 1e6), peak_extra: Some(peak_extra), fwdbwd })
}

/// The FP8 forward of one problem on the CPU: the inputs of [`inputs`] quantized per tensor before
/// timing, then `flash_attn::forward_fp8` whole (it dequantizes to f32 and allocates `out` and
/// `lse`, which the peak extra memory counts).
fn measure_fp8(p: &Problem, progress: &Progress, min_runs: usize) -> Result<Measurement> {
    let s = p.shape;
    let [(q, q_scale), (k, k_scale), (v, v_scale)] = inputs::<f32>(s)?.map(|x| fp8::quantize(&x));
    let scales = Fp8Scales { q: q_scale, k: k_scale, v: v_scale };
    let [qs, ks, vs] = s.qkv();
    let (q, k, v) = (Tensor::new(&q, &qs), Tensor::new(&k, &ks), Tensor::new(&v, &vs));
    let mask = p.mask();
    let spec = p.spec(&mask);
    let forward = || -> Result<()> {
        flash_attn::forward_fp8(&spec, &q, &k, &v, scales)?;
        Ok(())
    };
    let (first, peak_extra) = progress.suspend(|| alloc::measure(forward));
    first?;
    let (fwd_ms, runs) = time_calls(min_runs, forward)?;
    Ok(Measurement { fwd_ms, runs, gflops: p.flops() / (fwd_ms * 1e6), peak_extra: Some(peak_extra), fwdbwd: None })
}

/// The forward (and with `backward` the forward+backward) of one problem on the GPU, event-timed
/// (see [`crate::gpu`]).
fn measure_cuda(dtype: InputDType, p: &Problem, backward: bool) -> Result<Measurement> {
    match dtype {
        InputDType::Float(DType::F32) => measure_cuda_typed::<f32>(p, backward),
        InputDType::Float(DType::F16) => measure_cuda_typed::<f16>(p, backward),
        InputDType::Float(DType::BF16) => measure_cuda_typed::<bf16>(p, backward),
        InputDType::Fp8E4m3 => {
            let mask = p.mask();
            let t = gpu::time_forward_fp8(&p.spec(&mask), &p.shape.qkv().map(|s| s.to_vec()), MIN_RUNS)?;
            Ok(Measurement {
                fwd_ms: t.ms,
                runs: t.runs,
                gflops: p.flops() / (t.ms * 1e6),
                peak_extra: t.peak_extra,
                fwdbwd: None,
            })
        }
    }
}

fn measure_cuda_typed<T: GpuElement>(p: &Problem, backward: bool) -> Result<Measurement> {
    let mask = p.mask();
    let spec = p.spec(&mask);
    let shapes = p.shape.qkv().map(|s| s.to_vec());
    let timing = T::time_forward(&spec, &shapes, MIN_RUNS)?;
    let flops = p.flops();
    let fwdbwd = if backward {
        let t = T::time_forward_backward(&spec, &shapes, MIN_RUNS)?;
        Some(FwdBwd {
            ms: t.ms,
            runs: t.runs,
            gflops: FWDBWD_FLOPS_FACTOR * flops / (t.ms * 1e6),
            bwd_peak_extra: t.peak_extra,
        })
    } else {
        None
    };
    Ok(Measurement {
        fwd_ms: timing.ms,
        runs: timing.runs,
        gflops: flops / (timing.ms * 1e6),
        peak_extra: timing.peak_extra,
        fwdbwd,
    })
}

/// Algorithm 0 (`flash_attn::reference::naive`, f32): time of one call and its peak extra bytes
/// beyond its own result buffers.
fn measure_naive(s: Shape, progress: &Progress) -> Result<(f64, usize)> {
    let [q, k, v] = inputs::<f32>(s)?;
    let [qs, ks, vs] = s.qkv();
    let (q, k, v) = (Tensor::new(&q, &qs), Tensor::new(&k, &ks), Tensor::new(&v, &vs));
    let spec = AttentionSpec::new();
    let ((result, ms), extra) = progress.suspend(|| {
        alloc::measure(|| {
            let start = Instant::now();
            let r = flash_attn::reference::naive(&spec, &q, &k, &v);
            (r, start.elapsed().as_secs_f64() * 1e3)
        })
    });
    let result = result?;
    let result_bytes = (result.out.len() + result.lse.len()) * std::mem::size_of::<f64>();
    Ok((ms, extra.saturating_sub(result_bytes)))
}

/// "Memory shown, not claimed": extra peak bytes and time of our forward and of Algorithm 0 for
/// N up to `max_n`; with `plot`, the same measurements drawn as a figure (see [`crate::plot`]).
fn memory_table(naive_max: usize, max_n: usize, plot: Option<&Path>) -> Result<ExitCode> {
    if let Some(dir) = plot.and_then(Path::parent).filter(|d| !d.as_os_str().is_empty() && !d.is_dir()) {
        // Before the sweep, not a minute after it.
        return Err(CliError::new(format!("cannot write the figure: {} is not a directory", dir.display())));
    }
    let seqlens: Vec<usize> = MEMORY_SEQLENS.into_iter().filter(|&n| n <= max_n).collect();
    let progress = Progress::bar(seqlens.len() as u64, "memory");
    let mut rows = Vec::new();
    let mut naive_points = Vec::new();
    let mut ours_points = Vec::new();
    for n in seqlens {
        progress.set_message(format!("N = {n}"));
        let shape = Shape { b: 1, hq: 1, hk: 1, sq: n, sk: n, d: MEMORY_D };
        let ours =
            measure_typed::<f32>(&Problem { shape, causal: false, block: None }, &progress, MEMORY_MIN_RUNS, false)?;
        ours_points.push(Point { n, ms: ours.fwd_ms, peak_extra_bytes: ours.peak_extra });
        let (naive_mem, naive_time) = if n <= naive_max {
            let (ms, bytes) = measure_naive(shape, &progress)?;
            naive_points.push(Point { n, ms, peak_extra_bytes: Some(bytes) });
            (fmt_bytes(bytes), fmt_time(ms))
        } else {
            ("not run".to_owned(), "not run".to_owned())
        };
        rows.push(vec![
            fmt_count(n),
            ours.peak_extra.map_or_else(|| "-".to_owned(), fmt_bytes),
            fmt_time(ours.fwd_ms),
            naive_mem,
            naive_time,
            fmt_bytes(n * n * std::mem::size_of::<f32>()),
        ]);
        progress.inc();
    }
    drop(progress);
    println!(
        "extra peak heap memory of one forward call, b = 1, one head, d = {MEMORY_D}, f32, sq = sk = N, \
         {} threads available",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    print_table(
        &["N", "flash-attn peak extra", "flash-attn time", "Algorithm 0 peak extra", "Algorithm 0 time", "N² f32"],
        &rows,
    );
    println!();
    println!(
        "flash-attn: forward_into into preallocated out/lse, time = median of >= {MEMORY_MIN_RUNS} runs. \
         Algorithm 0: flash_attn::reference::naive::<f32> (materialises S and P), one run, its f64 \
         result buffers not counted; run up to N = {naive_max} (--naive-max)."
    );
    if let Some(path) = plot {
        let series = [
            Series { label: "Algorithm 0 (reference::naive)".to_owned(), points: naive_points },
            Series { label: "FlashAttention (flash-attn)".to_owned(), points: ours_points },
        ];
        let title = format!("forward, cpu f32, one head, d = {MEMORY_D}, sq = sk = N");
        plot::write_svg(path, &title, &series)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Median of `xs` (sorted in place); NaN for an empty slice.
fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => xs[n / 2],
        _ => 0.5 * (xs[n / 2 - 1] + xs[n / 2]),
    }
}

/// One JSON line of the BENCH.md contract; with a forward+backward measurement also
/// `fwdbwd_ms`, `fwdbwd_gflops`, `bwd_peak_extra_bytes` and `fwdbwd_runs`.
fn json_line(device: Device, dtype: InputDType, p: &Problem, m: &Measurement) -> String {
    let s = p.shape;
    let fwdbwd = match m.fwdbwd {
        Some(fb) => format!(
            ",\"fwdbwd_ms\":{},\"fwdbwd_gflops\":{},\"bwd_peak_extra_bytes\":{},\"fwdbwd_runs\":{}",
            json_number(fb.ms),
            json_number(fb.gflops),
            fb.bwd_peak_extra.map_or_else(|| "null".to_owned(), |b| b.to_string()),
            fb.runs
        ),
        None => String::new(),
    };
    let block = match p.block {
        Some(b) => format!(
            ",\"block_q\":{},\"block_k\":{},\"density_pct\":{},\"visible_fraction\":{}",
            b.block_q,
            b.block_k,
            b.density,
            json_number(p.visible_fraction())
        ),
        None => String::new(),
    };
    format!(
        "{{\"device\":\"{}\",\"dtype\":\"{}\",\"b\":{},\"hq\":{},\"hk\":{},\"sq\":{},\"sk\":{},\"d\":{},\
         \"causal\":{},\"fwd_ms\":{},\"gflops\":{},\"peak_extra_bytes\":{},\"runs\":{}{block}{fwdbwd}}}",
        device.name(),
        dtype.name(),
        s.b,
        s.hq,
        s.hk,
        s.sq,
        s.sk,
        s.d,
        p.causal,
        json_number(m.fwd_ms),
        json_number(m.gflops),
        m.peak_extra.map_or_else(|| "null".to_owned(), |b| b.to_string()),
        m.runs
    )
}

/// A JSON number, or `null` for NaN and infinities (which JSON lacks).
pub(crate) fn json_number(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.6}")
    } else {
        "null".to_owned()
    }
}

/// Milliseconds with about four significant digits.
fn fmt_ms(ms: f64) -> String {
    match ms {
        x if x < 1.0 => format!("{x:.4}"),
        x if x < 100.0 => format!("{x:.3}"),
        x => format!("{x:.1}"),
    }
}

/// A duration in ms or s.
fn fmt_time(ms: f64) -> String {
    if ms < 1000.0 {
        format!("{} ms", fmt_ms(ms))
    } else {
        format!("{:.2} s", ms / 1e3)
    }
}

/// `1024` as `1k`, `65536` as `64k`.
pub(crate) fn fmt_count(n: usize) -> String {
    if n >= 1024 && n.is_multiple_of(1024) {
        format!("{}k", n / 1024)
    } else {
        n.to_string()
    }
}

/// Bytes in B, KiB, MiB or GiB.
pub(crate) fn fmt_bytes(n: usize) -> String {
    const K: f64 = 1024.0;
    let x = n as f64;
    if x < K {
        format!("{n} B")
    } else if x < K * K {
        format!("{:.1} KiB", x / K)
    } else if x < K * K * K {
        format!("{:.1} MiB", x / (K * K))
    } else {
        format!("{:.2} GiB", x / (K * K * K))
    }
}

/// A Markdown table, padded to line up in a terminal too; the first column left-aligned, the
/// others right-aligned.
fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let width = |i: usize| {
        rows.iter()
            .filter_map(|r| r.get(i))
            .map(|c| c.chars().count())
            .chain([header[i].chars().count()])
            .max()
            .unwrap_or(0)
    };
    let widths: Vec<usize> = (0..header.len()).map(width).collect();
    let line = |cells: Vec<String>| println!("| {} |", cells.join(" | "));
    let pad = |i: usize, text: &str| {
        let fill = " ".repeat(widths[i].saturating_sub(text.chars().count()));
        if i == 0 {
            format!("{text}{fill}")
        } else {
            format!("{fill}{text}")
        }
    };
    line(header.iter().enumerate().map(|(i, h)| pad(i, h)).collect());
    line(
        widths
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                if i == 0 {
                    format!(":{}", "-".repeat(w.saturating_sub(1)))
                } else {
                    format!("{}:", "-".repeat(w.saturating_sub(1)))
                }
            })
            .collect(),
    );
    for row in rows {
        line(row.iter().enumerate().map(|(i, c)| pad(i, c)).collect());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_parses_six_sizes_and_rejects_others() {
        assert_eq!(parse_shape("1, 8,2,128,256,64"), Ok(Shape { b: 1, hq: 8, hk: 2, sq: 128, sk: 256, d: 64 }));
        assert!(parse_shape("1,8,8,128,128").is_err());
        assert!(parse_shape("1,8,8,128,128,x").is_err());
    }

    #[test]
    fn block_sizes_parse_as_two_positive_sizes() {
        assert_eq!(parse_block("64, 128"), Ok((64, 128)));
        for bad in ["64", "0,64", "64,x", "64,64,64"] {
            assert!(parse_block(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn visible_fraction_counts_the_pairs_the_mask_and_causal_rule_leave() {
        let mut rng = Rng::new(5);
        for _ in 0..20 {
            let (sq, sk) = (rng.range(1, 90), rng.range(1, 90));
            let block = BlockOpt { block_q: rng.range(1, 20), block_k: rng.range(1, 20), density: 40 };
            let p = Problem {
                shape: Shape { b: 1, hq: 1, hk: 1, sq, sk, d: 8 },
                causal: rng.chance(0.5),
                block: Some(block),
            };
            let (mask, [_, kb]) = p.mask();
            let off = sk as i64 - sq as i64;
            let brute = (0..sq)
                .flat_map(|i| (0..sk).map(move |j| (i, j)))
                .filter(|&(i, j)| !p.causal || j as i64 <= i as i64 + off)
                .filter(|&(i, j)| mask[(i / block.block_q) * kb + j / block.block_k] != 0)
                .count();
            assert!((p.visible_fraction() - brute as f64 / (sq * sk) as f64).abs() < 1e-12, "{p:?}");
        }
        let dense = Problem { shape: Shape { b: 1, hq: 1, hk: 1, sq: 8, sk: 8, d: 8 }, causal: false, block: None };
        assert_eq!(dense.visible_fraction(), 1.0);
    }

    #[test]
    fn json_line_with_a_block_mask_names_it() {
        let block = Some(BlockOpt { block_q: 64, block_k: 32, density: 30 });
        let p = Problem { shape: Shape { b: 1, hq: 2, hk: 2, sq: 256, sk: 256, d: 64 }, causal: false, block };
        let m = Measurement { fwd_ms: 1.0, runs: 5, gflops: 1.0, peak_extra: Some(0), fwdbwd: None };
        let line = json_line(Device::Cpu, DType::F32.into(), &p, &m);
        for key in ["\"block_q\":64", "\"block_k\":32", "\"density_pct\":30", "\"visible_fraction\":"] {
            assert!(line.contains(key), "{key} missing in {line}");
        }
    }

    #[test]
    fn bytes_use_binary_units() {
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(1536), "1.5 KiB");
        assert_eq!(fmt_bytes(256 << 20), "256.0 MiB");
        assert_eq!(fmt_bytes(3 << 30), "3.00 GiB");
    }

    #[test]
    fn median_of_even_and_odd_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }

    #[test]
    fn json_line_has_the_contract_keys() {
        let p = Problem { shape: Shape { b: 1, hq: 8, hk: 8, sq: 128, sk: 128, d: 64 }, causal: true, block: None };
        let m = Measurement { fwd_ms: 1.5, runs: 7, gflops: f64::INFINITY, peak_extra: Some(42), fwdbwd: None };
        let line = json_line(Device::Cpu, DType::BF16.into(), &p, &m);
        for key in
            ["device", "dtype", "b", "hq", "hk", "sq", "sk", "d", "causal", "fwd_ms", "gflops", "peak_extra_bytes"]
        {
            assert!(line.contains(&format!("\"{key}\":")), "{key} missing in {line}");
        }
        assert!(line.contains("\"gflops\":null") && line.contains("\"causal\":true"));
        assert!(!line.contains("fwdbwd"), "{line}");
    }

    #[test]
    fn cuda_json_line_has_the_contract_keys_and_a_null_peak() {
        let p =
            Problem { shape: Shape { b: 32, hq: 16, hk: 16, sq: 512, sk: 512, d: 128 }, causal: false, block: None };
        let m = Measurement { fwd_ms: 0.25, runs: 200, gflops: 2.5e5, peak_extra: None, fwdbwd: None };
        let line = json_line(Device::Cuda, DType::BF16.into(), &p, &m);
        assert!(line.starts_with("{\"device\":\"cuda\",\"dtype\":\"bf16\","), "{line}");
        assert!(line.contains("\"fwd_ms\":0.250000,") && line.contains("\"peak_extra_bytes\":null,"), "{line}");
    }

    #[test]
    fn gpu_grid_is_16k_tokens_and_2048_wide() {
        let grid = gpu_grid();
        assert_eq!(grid.len(), 24);
        for p in grid {
            let s = p.shape;
            assert_eq!((s.b * s.sq, s.hq * s.d, s.hq, s.sq), (16384, 2048, s.hk, s.sk));
        }
    }

    #[test]
    fn json_line_with_backward_adds_fwdbwd_and_stays_one_object() {
        let p = Problem { shape: Shape { b: 1, hq: 8, hk: 8, sq: 128, sk: 128, d: 64 }, causal: false, block: None };
        let fwdbwd = Some(FwdBwd { ms: 4.25, runs: 5, gflops: 12.5, bwd_peak_extra: Some(4096) });
        let m = Measurement { fwd_ms: 1.5, runs: 7, gflops: 3.0, peak_extra: Some(42), fwdbwd };
        let line = json_line(Device::Cpu, DType::F32.into(), &p, &m);
        assert!(line.contains("\"fwd_ms\":1.500000,"), "{line}");
        assert!(line.contains("\"fwdbwd_ms\":4.250000,"), "{line}");
        assert!(line.contains("\"bwd_peak_extra_bytes\":4096,"), "{line}");
        assert!(line.starts_with('{') && line.ends_with("\"fwdbwd_runs\":5}") && !line.contains('\n'), "{line}");
    }
}
