//! The CLI's side of the CUDA backend (cargo feature `cuda`): opening the GPU, the forward and
//! backward passes of `run` and `check` (and the FP8 forward), the event-timed forward (and
//! forward+backward) of `bench`, and compiling every kernel variant for `kernels --compile-all`.
//!
//! Without the feature every entry point returns [`not_built`], so the subcommands need no `cfg` of
//! their own. Everything about attention stays in the library (`flash_attn::cuda`); this module only
//! moves buffers and reads the clock.

use flash_attn::check::{BackwardReport, Case, CaseReport};
use flash_attn::{AttentionSpec, Dropout, Element, Fp8E4m3, Fp8Scales, Gradients, Output, Tensor};
use half::bf16;

use crate::{CliError, Result};

/// The error of `--device cuda` and `kernels` in a build without the feature.
pub fn not_built() -> CliError {
    CliError::new("the cuda backend is not available in this build (feature `cuda`)")
}

/// The median of event-timed calls on the GPU.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Median time of one call (a forward, or a forward plus a backward), in ms.
    pub ms: f64,
    /// Timed runs behind the median.
    pub runs: usize,
    /// Peak device memory one call allocated beyond what was in use before it (the inputs and
    /// outputs made beforehand not counted), from the memory pool's high-water mark; `None`
    /// where the device has no memory pools.
    pub peak_extra: Option<usize>,
}

/// What compiling one kernel variant for one architecture gave.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The variant's name, e.g. `flash_fwd_bf16_d128_m1_n128_w8`.
    pub name: String,
    /// The target, e.g. `sm_90a`.
    pub arch: String,
    /// Registers per thread, if ptxas reported them.
    pub registers: Option<u32>,
    /// Bytes spilled to local memory, if ptxas reported them.
    pub spill_bytes: Option<u32>,
    /// Spill bytes tolerated for this variant (0 but for the mma.sync backward at d >= 128).
    pub spill_budget: u32,
    /// Whether ptxas serialised its warpgroup MMAs (advisory C7511): the gate fails it.
    pub wgmma_serialized: bool,
    /// `None` when it compiled, else NVRTC's error (its log included).
    pub error: Option<String>,
}

/// Element types the CLI hands to the CUDA backend: f16 and bf16 reach the kernels, f32 gets the
/// library's [`flash_attn::Error::Unsupported`].
pub trait GpuElement: Element {
    /// The forward pass on GPU 0 for host tensors (`flash_attn::cuda::forward_host`).
    fn forward(
        spec: &AttentionSpec<'_>,
        q: &Tensor<'_, Self>,
        k: &Tensor<'_, Self>,
        v: &Tensor<'_, Self>,
    ) -> Result<Output<Self>>;

    /// Times the forward pass of a fixed-length problem with q, k, v of `shapes` on GPU 0: inputs
    /// and outputs on the device before timing, a warm-up, then at least `min_runs` calls each
    /// between a pair of CUDA events.
    fn time_forward(spec: &AttentionSpec<'_>, shapes: &[Vec<usize>; 3], min_runs: usize) -> Result<Timing>;

    /// The backward pass on GPU 0 for host tensors (`flash_attn::cuda::backward_host`).
    #[allow(clippy::too_many_arguments)]
    fn backward(
        spec: &AttentionSpec<'_>,
        q: &Tensor<'_, Self>,
        k: &Tensor<'_, Self>,
        v: &Tensor<'_, Self>,
        out: &Tensor<'_, Self>,
        lse: &[f32],
        dout: &Tensor<'_, Self>,
    ) -> Result<Gradients<Self>>;

    /// As [`GpuElement::time_forward`], each timed call one forward followed by one backward.
    fn time_forward_backward(spec: &AttentionSpec<'_>, shapes: &[Vec<usize>; 3], min_runs: usize) -> Result<Timing>;

    /// A KV-cache call on GPU 0 for host buffers (`flash_attn::cuda::decode::forward_host`): the
    /// caches are updated in place.
    fn kvcache(
        spec: &AttentionSpec<'_>,
        q: &Tensor<'_, Self>,
        k_cache: &mut flash_attn::TensorMut<'_, Self>,
        v_cache: &mut flash_attn::TensorMut<'_, Self>,
        cache: &flash_attn::kvcache::KvCache<'_, Self>,
    ) -> Result<Output<Self>>;
}

/// The FP8 forward on GPU 0 for host tensors (`flash_attn::cuda::forward_fp8_host`): `out` in
/// bf16. The outer error is the CLI's (no cuda in this build); the inner one is the library's
/// answer, kept typed so that `check` can tell an [`flash_attn::Error::Unsupported`] (the FP8
/// kernel needs sm_90a) from a failure.
pub fn forward_fp8(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, Fp8E4m3>,
    k: &Tensor<'_, Fp8E4m3>,
    v: &Tensor<'_, Fp8E4m3>,
    scales: Fp8Scales,
) -> Result<flash_attn::Result<Output<bf16>>> {
    imp::forward_fp8(spec, q, k, v, scales)
}

/// Times the FP8 forward of a fixed-length problem with q, k, v of `shapes` on GPU 0, as
/// [`GpuElement::time_forward`] does: inputs drawn as f32 normals and quantized per tensor
/// (`flash_attn::fp8::quantize`), on the device with `out` (bf16) and `lse` before timing.
pub fn time_forward_fp8(spec: &AttentionSpec<'_>, shapes: &[Vec<usize>; 3], min_runs: usize) -> Result<Timing> {
    imp::time_forward_fp8(spec, shapes, min_runs)
}

/// The event-timed median of `bench --decode` on the GPU.
pub fn decode(
    dtype: flash_attn::DType,
    shape: crate::bench::Shape,
    page_size: Option<usize>,
    num_splits: usize,
) -> Result<crate::decode_bench::DecodeMeasurement> {
    imp::decode(dtype, shape, page_size, num_splits)
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    pub fn open() -> Result<String> {
        Err(not_built())
    }

    pub fn run_case(_case: &Case) -> Result<CaseReport> {
        Err(not_built())
    }

    pub fn run_case_backward(_case: &Case, _dropout: Option<Dropout>) -> Result<BackwardReport> {
        Err(not_built())
    }

    pub fn compile_all(_archs: &[String], _pattern: &str) -> Result<Vec<Compiled>> {
        Err(not_built())
    }

    pub fn forward_fp8(
        _: &AttentionSpec<'_>,
        _: &Tensor<'_, Fp8E4m3>,
        _: &Tensor<'_, Fp8E4m3>,
        _: &Tensor<'_, Fp8E4m3>,
        _: Fp8Scales,
    ) -> Result<flash_attn::Result<Output<bf16>>> {
        Err(not_built())
    }

    pub fn time_forward_fp8(_: &AttentionSpec<'_>, _: &[Vec<usize>; 3], _: usize) -> Result<Timing> {
        Err(not_built())
    }

    pub fn decode(
        _: flash_attn::DType,
        _: crate::bench::Shape,
        _: Option<usize>,
        _: usize,
    ) -> Result<crate::decode_bench::DecodeMeasurement> {
        Err(not_built())
    }

    macro_rules! not_built_element {
        ($($t:ty),*) => {$(
            impl GpuElement for $t {
                fn forward(_: &AttentionSpec<'_>, _: &Tensor<'_, Self>, _: &Tensor<'_, Self>, _: &Tensor<'_, Self>)
                    -> Result<Output<Self>> {
                    Err(not_built())
                }

                fn time_forward(_: &AttentionSpec<'_>, _: &[Vec<usize>; 3], _: usize) -> Result<Timing> {
                    Err(not_built())
                }

                fn backward(
                    _: &AttentionSpec<'_>,
                    _: &Tensor<'_, Self>,
                    _: &Tensor<'_, Self>,
                    _: &Tensor<'_, Self>,
                    _: &Tensor<'_, Self>,
                    _: &[f32],
                    _: &Tensor<'_, Self>,
                ) -> Result<Gradients<Self>> {
                    Err(not_built())
                }

                fn time_forward_backward(_: &AttentionSpec<'_>, _: &[Vec<usize>; 3], _: usize) -> Result<Timing> {
                    Err(not_built())
                }

                fn kvcache(
                    _: &AttentionSpec<'_>,
                    _: &Tensor<'_, Self>,
                    _: &mut flash_attn::TensorMut<'_, Self>,
                    _: &mut flash_attn::TensorMut<'_, Self>,
                    _: &flash_attn::kvcache::KvCache<'_, Self>,
                ) -> Result<Output<Self>> {
                    Err(not_built())
                }
            }
        )*};
    }
    not_built_element!(f32, half::f16, bf16);
}

#[cfg(feature = "cuda")]
mod imp {
    use cudarc::driver::sys::{CUevent_flags, CUresult};
    use cudarc::driver::CudaSlice;
    use cudarc::driver::DriverError;
    use flash_attn::check::{compare_gradients, report, Rng};
    use flash_attn::cuda::{self, Arch, CudaElement, DeviceTensor, DeviceTensorMut};
    use flash_attn::{fp8, reference, DType};

    pub fn decode(
        dtype: DType,
        shape: crate::bench::Shape,
        page_size: Option<usize>,
        num_splits: usize,
    ) -> Result<crate::decode_bench::DecodeMeasurement> {
        match dtype {
            DType::BF16 => decode_typed::<bf16>(shape, page_size, num_splits),
            DType::F16 => decode_typed::<f16>(shape, page_size, num_splits),
            DType::F32 => Err(CliError::new("bench --decode on cuda takes f16 or bf16")),
        }
    }

    /// Event-timed median of the attention launches of a decode step (the cache already holds
    /// the tokens; the launches read it whole).
    fn decode_typed<T: CudaElement>(
        shape: crate::bench::Shape,
        page_size: Option<usize>,
        num_splits: usize,
    ) -> Result<crate::decode_bench::DecodeMeasurement> {
        use flash_attn::kvcache::KvCache;
        use flash_attn::{Tensor, TensorMut};
        let s = shape;
        let mut inp = crate::decode_bench::decode_inputs::<T>(s, page_size)?;
        let spec = AttentionSpec::new().causal();
        let mut cache = KvCache::new(&inp.seqlens).num_splits(num_splits);
        if let Some((table, shp)) = &inp.block_table {
            cache = cache.paged(Tensor::new(table, shp));
        }
        let cs = inp.cache_shape;
        let q = Tensor::new(&inp.q, &[s.b, s.sq, s.hq, s.d]);
        let mut run = cuda::decode::DecodeRun::new(
            &spec,
            &q,
            &TensorMut::new(&mut inp.k_cache, &cs),
            &TensorMut::new(&mut inp.v_cache, &cs),
            &cache,
        )?;
        let dev = run.device();
        for _ in 0..WARM_UP {
            run.launch_attention()?;
        }
        dev.stream().synchronize().map_err(driver("synchronize"))?;
        let (fwd_ms, n) = event_median(dev, crate::bench::MIN_RUNS, &mut || Ok(run.launch_attention()?))?;
        Ok(crate::decode_bench::DecodeMeasurement {
            fwd_ms,
            gbps: crate::decode_bench::kv_bytes(s, T::DTYPE) / (fwd_ms * 1e6),
            runs: n,
            num_splits: run.splits,
        })
    }
    use half::f16;

    use super::*;
    use crate::run::zeroed;

    /// Keep timing until about this much GPU time has been spent (or [`MAX_RUNS`] reached).
    const BUDGET_MS: f64 = 200.0;
    /// Most timed runs per problem.
    const MAX_RUNS: usize = 200;
    /// Untimed calls before timing (the first loads the kernel, compiling it if not cached).
    const WARM_UP: usize = 3;
    /// Distinct random values behind each input tensor (a prime, so rows and heads differ).
    const POOL: usize = 65_537;

    /// A driver error as one line; out-of-memory says so.
    fn driver(what: &'static str) -> impl Fn(DriverError) -> CliError {
        move |e| {
            if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                CliError::new(format!("out of device memory: {what}"))
            } else {
                CliError::new(format!("CUDA {what} failed: {e:?}"))
            }
        }
    }

    /// Opens GPU 0 (once per process) and names it: `NVIDIA H100 80GB HBM3 (sm_90a)`.
    pub fn open() -> Result<String> {
        let dev = cuda::default_device()?;
        let name = dev.context().name().unwrap_or_else(|_| "GPU 0".to_owned());
        Ok(format!("{name} ({})", dev.arch().0))
    }

    /// One random case on the GPU, compared with the f64 oracle under the numerics contract.
    pub fn run_case(case: &Case) -> Result<CaseReport> {
        match case.dtype {
            DType::BF16 => run_case_typed::<bf16>(case),
            DType::F16 => run_case_typed::<f16>(case),
            DType::F32 => Err(f32_unsupported()),
        }
    }

    fn run_case_typed<T: CudaElement>(case: &Case) -> Result<CaseReport> {
        let data = case.data::<T>();
        let spec = case.spec(&data);
        let [q, k, v] = data.views();
        let ours = cuda::forward_host(&spec, &q, &k, &v)?;
        let oracle = reference::forward(&spec, &q, &k, &v)?;
        let naive = reference::naive(&spec, &q, &k, &v)?;
        Ok(report(&ours.out, &ours.lse, &oracle, &naive, case.dtype))
    }

    /// The backward pass of one random case on the GPU (after its forward there, with `dropout`
    /// if given), compared with the f64 oracle under the numerics contract.
    pub fn run_case_backward(case: &Case, dropout: Option<Dropout>) -> Result<BackwardReport> {
        match case.dtype {
            DType::BF16 => run_case_backward_typed::<bf16>(case, dropout),
            DType::F16 => run_case_backward_typed::<f16>(case, dropout),
            DType::F32 => Err(f32_unsupported()),
        }
    }

    fn run_case_backward_typed<T: CudaElement>(case: &Case, dropout: Option<Dropout>) -> Result<BackwardReport> {
        let data = case.data::<T>();
        let mut spec = case.spec(&data);
        if let Some(d) = dropout {
            spec = spec.dropout(d.p, d.seed, d.offset);
        }
        let [q, k, v] = data.views();
        let (dout, dout_shape) = case.dout(&data)?;
        let dout = Tensor::new(&dout, &dout_shape);
        let fwd = cuda::forward_host(&spec, &q, &k, &v)?;
        let out = Tensor::new(&fwd.out, &fwd.out_shape);
        let grads = cuda::backward_host(&spec, &q, &k, &v, &out, &fwd.lse, &dout)?;
        Ok(compare_gradients(&spec, &grads, &data, &dout, case.dtype)?)
    }

    /// Compiles the kernel variants whose name contains `pattern` (every one for `""`) for each
    /// of `archs` with NVRTC (no GPU needed).
    pub fn compile_all(archs: &[String], pattern: &str) -> Result<Vec<Compiled>> {
        let archs: Vec<Arch> = archs.iter().map(|a| Arch(a.clone())).collect();
        Ok(cuda::compile_matching(&archs, pattern)?
            .into_iter()
            .map(|r| Compiled {
                error: r.result.as_ref().err().map(ToString::to_string),
                name: r.name,
                arch: r.arch,
                registers: r.registers,
                spill_bytes: r.spill_bytes,
                spill_budget: r.spill_budget,
                wgmma_serialized: r.wgmma_serialized,
            })
            .collect())
    }

    /// The library's answer to f32 on the GPU (f32 is no [`CudaElement`], so the CLI says it).
    fn f32_unsupported() -> CliError {
        flash_attn::Error::Unsupported("the CUDA kernels do not support f32 inputs (use f16 or bf16) yet".into()).into()
    }

    /// `n` values cycling through [`POOL`] standard normal ones: random data (never zeros) made
    /// fast enough for GPU-sized tensors.
    fn filled<T: Element>(name: &str, n: usize, rng: &mut Rng) -> Result<Vec<T>> {
        let pool: Vec<T> = (0..POOL.min(n)).map(|_| T::from_f64(rng.normal())).collect();
        let mut buf = zeroed::<T>(name, &[n])?;
        for chunk in buf.chunks_mut(POOL) {
            chunk.copy_from_slice(&pool[..chunk.len()]);
        }
        Ok(buf)
    }

    /// Median time in ms of `call` between CUDA events on the device's stream, and the number of
    /// timed runs: one call sizes the count (about [`BUDGET_MS`] of GPU time, at least
    /// `min_runs`, at most [`MAX_RUNS`]); every event is made before the first timed call, the
    /// calls queue back to back, each between its own pair, and one synchronisation ends them.
    /// The caller warms up first.
    fn event_median(dev: &cuda::Device, min_runs: usize, call: &mut dyn FnMut() -> Result<()>) -> Result<(f64, usize)> {
        let stream = dev.stream();
        let ctx = dev.context();
        let event = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(driver("event creation"));
        let (start, end) = (event()?, event()?);
        start.record(stream).map_err(driver("event record"))?;
        call()?;
        end.record(stream).map_err(driver("event record"))?;
        let estimate = f64::from(start.elapsed_ms(&end).map_err(driver("event timing"))?);
        let runs = if estimate > 0.0 { (BUDGET_MS / estimate) as usize } else { MAX_RUNS };
        let runs = runs.clamp(min_runs.max(1), MAX_RUNS.max(min_runs));
        let pairs: Vec<_> = (0..runs).map(|_| Ok((event()?, event()?))).collect::<Result<_>>()?;
        for (a, b) in &pairs {
            a.record(stream).map_err(driver("event record"))?;
            call()?;
            b.record(stream).map_err(driver("event record"))?;
        }
        stream.synchronize().map_err(driver("synchronize"))?;
        let mut times = pairs
            .iter()
            .map(|(a, b)| a.elapsed_ms(b).map(f64::from).map_err(driver("event timing")))
            .collect::<Result<Vec<f64>>>()?;
        times.sort_by(f64::total_cmp);
        let n = times.len();
        Ok((if n % 2 == 1 { times[n / 2] } else { 0.5 * (times[n / 2 - 1] + times[n / 2]) }, n))
    }

    /// Times forward calls, or with `backward` forward+backward calls (gradients into buffers
    /// made before timing, `dout` random).
    fn time_typed<T: CudaElement>(
        spec: &AttentionSpec<'_>,
        shapes: &[Vec<usize>; 3],
        min_runs: usize,
        backward: bool,
    ) -> Result<Timing> {
        let Sizes { lens, out_shape, out_len, lse_len } = sizes(spec, shapes)?;
        let dev = cuda::default_device()?;
        let stream = dev.stream();
        let mut rng = Rng::new(0);
        let q = dev.upload(&filled::<T>("q", lens[0], &mut rng)?)?;
        let k = dev.upload(&filled::<T>("k", lens[1], &mut rng)?)?;
        let v = dev.upload(&filled::<T>("v", lens[2], &mut rng)?)?;
        let mut out = stream.alloc_zeros::<T>(out_len.max(1)).map_err(driver("allocation of `out`"))?;
        let mut lse = stream.alloc_zeros::<f32>(lse_len.max(1)).map_err(driver("allocation of `lse`"))?;
        let (dout, mut grads) = if backward {
            let dout = dev.upload(&filled::<T>("dout", out_len, &mut rng)?)?;
            let alloc = |n: usize| stream.alloc_zeros::<T>(n.max(1)).map_err(driver("allocation of a gradient"));
            (Some(dout), Some([alloc(lens[0])?, alloc(lens[1])?, alloc(lens[2])?]))
        } else {
            (None, None)
        };
        let mut call = || -> Result<()> {
            let (qt, kt, vt) = (
                DeviceTensor::new(q.as_view(), &shapes[0]),
                DeviceTensor::new(k.as_view(), &shapes[1]),
                DeviceTensor::new(v.as_view(), &shapes[2]),
            );
            {
                let mut ot = DeviceTensorMut::new(out.slice_mut(0..out_len), &out_shape);
                let mut lt = lse.slice_mut(0..lse_len);
                dev.forward(spec, &qt, &kt, &vt, &mut ot, &mut lt)?;
            }
            if let (Some(dout), Some([gq, gk, gv])) = (&dout, &mut grads) {
                let ot = DeviceTensor::new(out.slice(0..out_len), &out_shape);
                let dot = DeviceTensor::new(dout.slice(0..out_len), &out_shape);
                let mut dq = DeviceTensorMut::new(gq.slice_mut(0..lens[0]), &shapes[0]);
                let mut dk = DeviceTensorMut::new(gk.slice_mut(0..lens[1]), &shapes[1]);
                let mut dv = DeviceTensorMut::new(gv.slice_mut(0..lens[2]), &shapes[2]);
                dev.backward(spec, &qt, &kt, &vt, &ot, &lse.slice(0..lse_len), &dot, &mut dq, &mut dk, &mut dv)?;
            }
            Ok(())
        };

        warm_up_and_time(dev, min_runs, &mut call)
    }

    /// Element counts of q, k, v, the shape and length of `out` and the length of `lse` of a
    /// problem.
    struct Sizes {
        lens: Vec<usize>,
        out_shape: Vec<usize>,
        out_len: usize,
        lse_len: usize,
    }

    /// The [`Sizes`] of q, k, v of `shapes` under `spec`: shapes and options are checked on the
    /// host first, with zero-sized stand-ins, before anything is allocated on the device.
    fn sizes(spec: &AttentionSpec<'_>, shapes: &[Vec<usize>; 3]) -> Result<Sizes> {
        let numel = |s: &[usize]| s.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        let lens: Vec<usize> = shapes
            .iter()
            .map(|s| numel(s).ok_or_else(|| CliError::new(format!("shape {s:?} is too large"))))
            .collect::<Result<_>>()?;
        let units: Vec<Vec<()>> = lens.iter().map(|&n| vec![(); n]).collect();
        let geometry = flash_attn::Geometry::new(
            spec,
            &Tensor::new(&units[0], &shapes[0]),
            &Tensor::new(&units[1], &shapes[1]),
            &Tensor::new(&units[2], &shapes[2]),
        )?;
        let out_shape = geometry.out_shape();
        let out_len = numel(&out_shape).ok_or_else(|| CliError::new("`out` is too large"))?;
        Ok(Sizes { lens, out_shape, out_len, lse_len: geometry.lse_len() })
    }

    /// [`WARM_UP`] calls, one more between two readings of the memory pool (its peak extra device
    /// memory), then the event-timed median of [`event_median`].
    fn warm_up_and_time(dev: &cuda::Device, min_runs: usize, call: &mut dyn FnMut() -> Result<()>) -> Result<Timing> {
        let stream = dev.stream();
        for _ in 0..WARM_UP {
            call()?;
        }
        stream.synchronize().map_err(driver("synchronize"))?;
        let before = dev.memory_in_use()?;
        dev.reset_memory_peak()?;
        call()?;
        stream.synchronize().map_err(driver("synchronize"))?;
        let peak_extra = match (before, dev.memory_in_use()?) {
            (Some((current, _)), Some((_, high))) => Some(high.saturating_sub(current) as usize),
            _ => None,
        };
        let (ms, n) = event_median(dev, min_runs, call)?;
        Ok(Timing { ms, runs: n, peak_extra })
    }

    pub fn forward_fp8(
        spec: &AttentionSpec<'_>,
        q: &Tensor<'_, Fp8E4m3>,
        k: &Tensor<'_, Fp8E4m3>,
        v: &Tensor<'_, Fp8E4m3>,
        scales: Fp8Scales,
    ) -> Result<flash_attn::Result<Output<bf16>>> {
        Ok(cuda::forward_fp8_host(spec, q, k, v, scales))
    }

    /// `n` e4m3 bytes cycling through [`POOL`] standard normal values quantized together (as
    /// [`filled`]), and the descale factor: the pool's maximum is the tensor's, so this is the
    /// per-tensor quantization of the cycled f32 values.
    fn filled_fp8(name: &str, n: usize, rng: &mut Rng) -> Result<(Vec<u8>, f32)> {
        let pool: Vec<f32> = (0..POOL.min(n)).map(|_| rng.normal() as f32).collect();
        let (pool, scale) = fp8::quantize(&pool);
        let pool: Vec<u8> = pool.iter().map(|x| x.to_bits()).collect();
        let mut buf = zeroed::<u8>(name, &[n])?;
        for chunk in buf.chunks_mut(POOL) {
            chunk.copy_from_slice(&pool[..chunk.len()]);
        }
        Ok((buf, scale))
    }

    pub fn time_forward_fp8(spec: &AttentionSpec<'_>, shapes: &[Vec<usize>; 3], min_runs: usize) -> Result<Timing> {
        let Sizes { lens, out_shape, out_len, lse_len } = sizes(spec, shapes)?;
        let dev = cuda::default_device()?;
        let stream = dev.stream();
        let mut rng = Rng::new(0);
        let mut upload = |name: &str, n: usize| -> Result<(CudaSlice<u8>, f32)> {
            let (bits, scale) = filled_fp8(name, n, &mut rng)?;
            Ok((stream.clone_htod(&bits).map_err(driver("upload"))?, scale))
        };
        let (q, q_scale) = upload("q", lens[0])?;
        let (k, k_scale) = upload("k", lens[1])?;
        let (v, v_scale) = upload("v", lens[2])?;
        let scales = Fp8Scales { q: q_scale, k: k_scale, v: v_scale };
        let mut out = stream.alloc_zeros::<bf16>(out_len.max(1)).map_err(driver("allocation of `out`"))?;
        let mut lse = stream.alloc_zeros::<f32>(lse_len.max(1)).map_err(driver("allocation of `lse`"))?;
        let mut call = || -> Result<()> {
            let (qt, kt, vt) = (
                DeviceTensor::new(q.as_view(), &shapes[0]),
                DeviceTensor::new(k.as_view(), &shapes[1]),
                DeviceTensor::new(v.as_view(), &shapes[2]),
            );
            let mut ot = DeviceTensorMut::new(out.slice_mut(0..out_len), &out_shape);
            let mut lt = lse.slice_mut(0..lse_len);
            dev.forward_fp8(spec, &qt, &kt, &vt, scales, &mut ot, &mut lt)?;
            Ok(())
        };
        warm_up_and_time(dev, min_runs, &mut call)
    }

    macro_rules! cuda_element {
        ($($t:ty),*) => {$(
            impl GpuElement for $t {
                fn forward(spec: &AttentionSpec<'_>, q: &Tensor<'_, Self>, k: &Tensor<'_, Self>, v: &Tensor<'_, Self>)
                    -> Result<Output<Self>> {
                    Ok(cuda::forward_host(spec, q, k, v)?)
                }

                fn time_forward(spec: &AttentionSpec<'_>, shapes: &[Vec<usize>; 3], min_runs: usize) -> Result<Timing> {
                    time_typed::<$t>(spec, shapes, min_runs, false)
                }

                fn backward(
                    spec: &AttentionSpec<'_>,
                    q: &Tensor<'_, Self>,
                    k: &Tensor<'_, Self>,
                    v: &Tensor<'_, Self>,
                    out: &Tensor<'_, Self>,
                    lse: &[f32],
                    dout: &Tensor<'_, Self>,
                ) -> Result<Gradients<Self>> {
                    Ok(cuda::backward_host(spec, q, k, v, out, lse, dout)?)
                }

                fn time_forward_backward(
                    spec: &AttentionSpec<'_>,
                    shapes: &[Vec<usize>; 3],
                    min_runs: usize,
                ) -> Result<Timing> {
                    time_typed::<$t>(spec, shapes, min_runs, true)
                }

                fn kvcache(
                    spec: &AttentionSpec<'_>,
                    q: &Tensor<'_, Self>,
                    k_cache: &mut flash_attn::TensorMut<'_, Self>,
                    v_cache: &mut flash_attn::TensorMut<'_, Self>,
                    cache: &flash_attn::kvcache::KvCache<'_, Self>,
                ) -> Result<Output<Self>> {
                    Ok(cuda::decode::forward_host(spec, q, k_cache, v_cache, cache)?)
                }
            }
        )*};
    }
    cuda_element!(f16, bf16);

    impl GpuElement for f32 {
        fn forward(
            _: &AttentionSpec<'_>,
            _: &Tensor<'_, Self>,
            _: &Tensor<'_, Self>,
            _: &Tensor<'_, Self>,
        ) -> Result<Output<Self>> {
            Err(f32_unsupported())
        }

        fn time_forward(_: &AttentionSpec<'_>, _: &[Vec<usize>; 3], _: usize) -> Result<Timing> {
            Err(f32_unsupported())
        }

        fn backward(
            _: &AttentionSpec<'_>,
            _: &Tensor<'_, Self>,
            _: &Tensor<'_, Self>,
            _: &Tensor<'_, Self>,
            _: &Tensor<'_, Self>,
            _: &[f32],
            _: &Tensor<'_, Self>,
        ) -> Result<Gradients<Self>> {
            Err(f32_unsupported())
        }

        fn time_forward_backward(_: &AttentionSpec<'_>, _: &[Vec<usize>; 3], _: usize) -> Result<Timing> {
            Err(f32_unsupported())
        }

        fn kvcache(
            _: &AttentionSpec<'_>,
            _: &Tensor<'_, Self>,
            _: &mut flash_attn::TensorMut<'_, Self>,
            _: &mut flash_attn::TensorMut<'_, Self>,
            _: &flash_attn::kvcache::KvCache<'_, Self>,
        ) -> Result<Output<Self>> {
            Err(f32_unsupported())
        }
    }
}

pub use imp::{compile_all, open, run_case, run_case_backward};
