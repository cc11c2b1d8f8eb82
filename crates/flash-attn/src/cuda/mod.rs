//! The CUDA backend (cargo feature `cuda`): FlashAttention-2-class forward and backward kernels
//! for sm_80+, written in CUDA C++ (`kernels/*.cuh`), compiled at first use by NVRTC into a CUBIN
//! for the device's exact architecture and cached on disk (DESIGN §4).
//!
//! The driver and NVRTC are loaded dynamically: a machine without them gets
//! [`Error::CudaUnavailable`] / [`Error::NvrtcUnavailable`], never a panic.
//!
//! ```no_run
//! # use flash_attn::{AttentionSpec, Tensor};
//! # use half::bf16;
//! let (b, s, h, d) = (1, 256, 4, 64);
//! let x: Vec<bf16> = (0..b * s * h * d).map(|i| bf16::from_f32((i as f32 * 0.1).sin())).collect();
//! let t = Tensor::new(&x, &[b, s, h, d]);
//! let spec = AttentionSpec::new().causal().dropout(0.1, 42, 0);
//! let res = flash_attn::cuda::forward_host(&spec, &t, &t, &t)?;
//! let out = Tensor::new(&res.out, &res.out_shape);
//! let grads = flash_attn::cuda::backward_host(&spec, &t, &t, &t, &out, &res.lse, &t)?;
//! # Ok::<(), flash_attn::Error>(())
//! ```
//!
//! Supported today, forward and backward: `f16`/`bf16`, `d == dv` a multiple of 8 up to 256,
//! run on kernels compiled for 64, 128 and 256 columns (the Hopper forward also 96 and 192) with the columns past `d` zero-filled on load and never stored
//! ([`padded_head_dim`], [`tile_width`]), causal
//! (bottom-right and top-left), sliding windows, softcap, ALiBi, GQA/MQA (gradients summed into
//! the `hk` heads on chip), fixed-length and varlen batches, dropout (the CPU's Philox keep mask,
//! bit for bit), strided inputs whose strides are multiples of 8 elements; a deterministic
//! backward ([`AttentionSpec::deterministic`]); block-sparse masks. Dropout, softcap, ALiBi and
//! block masks run on kernel variants with those paths compiled in (`..._x`), so plain attention
//! keeps its registers. With a block mask, key tiles whose mask blocks are all off are skipped (in
//! the backward, query tiles; not in deterministic mode), tiles with every block on and inside
//! the interval rules run without a predicate, the rest check the mask per element (slow for
//! blocks smaller than the tiles: docs/cuda-notes.md).

pub mod decode;
mod kernels;
mod launch;
pub mod nvrtc;
pub mod ring;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DriverError};
use rayon::prelude::*;

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::spec::{AttentionSpec, Geometry};
use crate::tensor::{Tensor, TensorMut};
use crate::{Gradients, Output};

pub use kernels::{
    padded_head_dim, tile_width, BwdVariant, ExtraPaths, Fp8Variant, Variant, BWD_HEAD_DIMS, FP8_HEAD_DIMS, HEAD_DIMS,
    HOPPER_HEAD_DIMS, WS_BLOCKS, WS_EXTRAS, WS_HEAD_DIMS,
};
pub use nvrtc::Arch;

/// Whether a caller's kernel variant `(dtype, tile width, optional paths)` can run a problem that
/// needs `need` (the problem's dtype, tile width and the optional paths it uses) on a device where it
/// `runs` (see [`Variant::runs_on`]) or not, `arch`; `d` is the problem's head dim.
fn check_fit(
    name: &str,
    (runs, arch): (bool, &Arch),
    have: (DType, usize, ExtraPaths),
    need: (DType, usize, ExtraPaths),
    d: usize,
) -> Result<()> {
    if !runs {
        return Err(Error::Unsupported(format!("variant {name} does not run on {}", arch.0)));
    }
    if have.0 != need.0 || have.1 != need.1 || !have.2.covers(need.2) {
        return Err(Error::Unsupported(format!(
            "variant {name} does not fit {} d = {d} (tile width {}{})",
            need.0,
            need.1,
            if need.2.any() { format!(", optional paths {}", need.2.suffix()) } else { String::new() }
        )));
    }
    Ok(())
}

/// Element types the CUDA kernels take: [`half::f16`] and [`half::bf16`].
pub trait CudaElement: Element + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits {}
impl CudaElement for half::f16 {}
impl CudaElement for half::bf16 {}

/// A CUDA driver error as a library error: out-of-memory gets its own variant.
pub(crate) fn driver_error(what: &str, e: DriverError) -> Error {
    if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        Error::DeviceOutOfMemory(format!("{what}: {e:?}"))
    } else {
        Error::CudaLaunch(format!("{what}: {e:?}"))
    }
}

/// Whether the driver library can be loaded: dlopen by its candidate names (feature `cuda`), or
/// always with the library linked (`cuda-linked`: the process would not have started without it).
fn library_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: only tries to dlopen the library by its candidate names.
        unsafe { sys::is_culib_present() }
    }
    #[cfg(not(feature = "cuda"))]
    {
        true
    }
}

/// Whether the CUDA driver library can be loaded (checked before any driver call).
pub fn driver_available() -> Result<()> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    if *PRESENT.get_or_init(library_present) {
        Ok(())
    } else {
        Err(Error::CudaUnavailable("the CUDA driver library (libcuda.so.1) was not found".into()))
    }
}

/// The geometry of a forward on device buffers (the shapes and strides of `q`, `k`, `v`, checked
/// as for host tensors), the layout of `out`, and `lse`'s length checked.
fn forward_geometry<'a, T, O>(
    spec: &AttentionSpec<'a>,
    [q, k, v]: [&DeviceTensor<'_, T>; 3],
    out: &DeviceTensorMut<'_, O>,
    lse_len: usize,
) -> Result<(Geometry<'a>, crate::spec::RowLayout)> {
    let units = |n: usize| vec![(); n];
    let (units_q, units_k, units_v) = (units(q.data.len()), units(k.data.len()), units(v.data.len()));
    let mut units_o = units(out.data.len());
    let g = Geometry::new(
        spec,
        &Tensor::with_strides(&units_q, &q.shape, &q.strides),
        &Tensor::with_strides(&units_k, &k.shape, &k.strides),
        &Tensor::with_strides(&units_v, &v.shape, &v.strides),
    )?;
    let o_layout = g.check_output_like(
        "out",
        &TensorMut::with_strides(&mut units_o, &out.shape, &out.strides),
        &g.out_shape(),
        true,
    )?;
    g.check_lse_len(lse_len)?;
    Ok((g, o_layout))
}

/// A GPU, its stream, and the kernels loaded on it so far.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: Arch,
    /// Loaded kernels, shared with every [`Device::with_stream`] handle of this device.
    functions: Arc<Mutex<HashMap<Variant, CudaFunction>>>,
    bwd_functions: Arc<Mutex<HashMap<BwdVariant, launch::BwdFunctions>>>,
    decode_functions: Arc<Mutex<HashMap<decode::DecodeVariant, decode::DecodeFunctions>>>,
    ring_functions: Arc<Mutex<HashMap<DType, ring::RingFunctions>>>,
    fp8_functions: Arc<Mutex<HashMap<Fp8Variant, launch::Fp8Functions>>>,
    /// The tile-list pass of the warp-specialised forward's block-mask variants, by variant.
    ws_tiles_functions: Arc<Mutex<HashMap<Variant, CudaFunction>>>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("ordinal", &self.ctx.ordinal()).field("arch", &self.arch).finish()
    }
}

impl Device {
    /// Opens GPU `ordinal` (its primary context and a new stream). Needs compute capability 8.0+.
    ///
    /// Sets the device's default memory pool, which this backend's scratch buffers come from, to
    /// keep its unused memory across synchronisations ([`Device::set_pool_release_threshold`]
    /// `u64::MAX`, as caching allocators do): with CUDA's default of 0, a caller that
    /// synchronises between calls has the scratch unmapped and mapped again every call, which an
    /// H200 measured at a quarter of a 512² backward's time (docs/cuda-notes.md, session 55).
    /// `set_pool_release_threshold(0)` restores CUDA's behaviour.
    pub fn new(ordinal: usize) -> Result<Self> {
        driver_available()?;
        nvrtc::available()?;
        let count = CudaContext::device_count()
            .map_err(|e| Error::CudaUnavailable(format!("cuInit/cuDeviceGetCount: {e:?}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::CudaUnavailable(format!("GPU {ordinal} requested, {count} present")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::CudaUnavailable(format!("GPU {ordinal}: {e:?}")))?;
        let (major, minor) = ctx.compute_capability().map_err(|e| driver_error("compute capability", e))?;
        if major < 8 {
            return Err(Error::CudaUnavailable(format!(
                "GPU {ordinal} has compute capability {major}.{minor}; the kernels need 8.0 or newer"
            )));
        }
        let stream = ctx.new_stream().map_err(|e| driver_error("cuStreamCreate", e))?;
        let device = Self {
            ctx,
            stream,
            arch: Arch::from_compute_capability(major, minor),
            functions: Arc::default(),
            bwd_functions: Arc::default(),
            decode_functions: Arc::default(),
            ring_functions: Arc::default(),
            fp8_functions: Arc::default(),
            ws_tiles_functions: Arc::default(),
        };
        device.set_pool_release_threshold(u64::MAX)?;
        Ok(device)
    }

    /// A handle to this GPU whose launches go to `stream` instead of the device's own: the same
    /// context, and the kernels loaded so far (and later) shared with `self`. For frameworks that
    /// own their streams (PyTorch's current stream, candle's): wrap theirs with
    /// [`CudaContext::wrap_borrowed_stream`] on [`Device::context`].
    ///
    /// Work enqueued through the handle is ordered by that stream alone: buffers passed in must be
    /// ready on it, and results are ready when its work is. A stream of another context is an
    /// error.
    pub fn with_stream(&self, stream: Arc<CudaStream>) -> Result<Device> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(Error::Unsupported(format!(
                "the stream belongs to another CUDA context than GPU {}'s",
                self.ctx.ordinal()
            )));
        }
        Ok(Device {
            ctx: self.ctx.clone(),
            stream,
            arch: self.arch.clone(),
            functions: self.functions.clone(),
            bwd_functions: self.bwd_functions.clone(),
            decode_functions: self.decode_functions.clone(),
            ring_functions: self.ring_functions.clone(),
            fp8_functions: self.fp8_functions.clone(),
            ws_tiles_functions: self.ws_tiles_functions.clone(),
        })
    }

    /// The stream every launch of this device goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The architecture kernels are compiled for.
    pub fn arch(&self) -> &Arch {
        &self.arch
    }

    /// The loaded function of `variant`, compiling (or reading the cache) on first use.
    pub(crate) fn function(&self, variant: &Variant) -> Result<CudaFunction> {
        let mut map = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = map.get(variant) {
            return Ok(f.clone());
        }
        let source = if variant.ws { kernels::ws_forward_source() } else { kernels::forward_source() };
        let module = self.load_module(&variant.name(), &source, &variant.options())?;
        let f = module.load_function(variant.entry()).map_err(|e| driver_error("cuModuleGetFunction", e))?;
        allow_dynamic_smem(&f, variant.smem_bytes())?;
        if variant.ws {
            check_ws_registers(&f, &variant.name(), variant.threads())?;
            if variant.extras.blocks {
                let tiles =
                    module.load_function("flash_fwd_ws_tiles").map_err(|e| driver_error("cuModuleGetFunction", e))?;
                self.ws_tiles_functions.lock().unwrap_or_else(|p| p.into_inner()).insert(*variant, tiles);
            }
        }
        map.insert(*variant, f.clone());
        Ok(f)
    }

    /// The tile-list pass (`flash_fwd_ws_tiles`) of a warp-specialised block-mask `variant`,
    /// loaded with the variant's forward.
    pub(crate) fn ws_tiles_function(&self, variant: &Variant) -> Result<CudaFunction> {
        let get = || self.ws_tiles_functions.lock().unwrap_or_else(|p| p.into_inner()).get(variant).cloned();
        if let Some(f) = get() {
            return Ok(f);
        }
        self.function(variant)?;
        get().ok_or_else(|| Error::Unsupported(format!("variant {} has no tile-list pass", variant.name())))
    }

    /// The loaded FP8 forward kernels of `variant` (the forward and the V transpose it reads),
    /// compiling (or reading the cache) on first use.
    pub(crate) fn fp8_functions(&self, variant: &Fp8Variant) -> Result<launch::Fp8Functions> {
        let mut map = self.fp8_functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = map.get(variant) {
            return Ok(f.clone());
        }
        let module = self.load_module(&variant.name(), &kernels::ws_forward_source(), &variant.options())?;
        let load = |name: &str| module.load_function(name).map_err(|e| driver_error("cuModuleGetFunction", e));
        let f = launch::Fp8Functions { forward: load(variant.entry())?, transpose_v: load("fp8_transpose_v")? };
        allow_dynamic_smem(&f.forward, variant.smem_bytes())?;
        if variant.ws {
            check_ws_registers(&f.forward, &variant.name(), variant.threads())?;
        }
        map.insert(*variant, f.clone());
        Ok(f)
    }

    /// Compiles `source` with `options` for this device (or reads the disk cache) and loads it.
    fn load_module(&self, name: &str, source: &str, options: &[String]) -> Result<Arc<cudarc::driver::CudaModule>> {
        let compiled = nvrtc::compile(name, source, options, &self.arch)?;
        self.ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin))
            .map_err(|e| driver_error("cuModuleLoadData", e))
    }

    /// The loaded backward kernels of `variant`, compiling (or reading the cache) on first use.
    pub(crate) fn bwd_functions(&self, variant: &BwdVariant) -> Result<launch::BwdFunctions> {
        let mut map = self.bwd_functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = map.get(variant) {
            return Ok(f.clone());
        }
        let module = self.load_module(&variant.name(), &kernels::backward_source(), &variant.options())?;
        let load = |name: &str| module.load_function(name).map_err(|e| driver_error("cuModuleGetFunction", e));
        let f = launch::BwdFunctions {
            prep: load("flash_bwd_prep")?,
            main: load("flash_bwd")?,
            convert: load("flash_bwd_convert")?,
            ws_tiles: if variant.ws && variant.extras.blocks { Some(load("flash_bwd_ws_tiles")?) } else { None },
        };
        allow_dynamic_smem(&f.main, variant.smem_bytes())?;
        if variant.ws {
            // Its setmaxnreg split assumes 168 registers a thread (384 threads), as the forward's does.
            check_ws_registers(&f.main, &variant.name(), variant.threads())?;
        }
        map.insert(*variant, f.clone());
        Ok(f)
    }

    /// The device's default stream-ordered memory pool, which every allocation of this backend
    /// (and of [`Device::upload`]) draws from; `None` where the device has no memory pools.
    fn pool(&self) -> Result<Option<sys::CUmemoryPool>> {
        if !self.ctx.has_async_alloc() {
            return Ok(None);
        }
        self.ctx.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        // SAFETY: the context is current and its device ordinal valid.
        let pool = unsafe { cudarc::driver::result::device::get_default_mem_pool(self.ctx.cu_device()) }
            .map_err(|e| driver_error("cuDeviceGetDefaultMemPool", e))?;
        Ok(Some(pool))
    }

    /// Bytes of the default memory pool in use now and the most in use since the last
    /// [`Device::reset_memory_peak`] (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT` / `_HIGH`), or `None`
    /// where the device has no memory pools. Synchronise the stream first for a settled count.
    pub fn memory_in_use(&self) -> Result<Option<(u64, u64)>> {
        let current = self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
        let high = self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?;
        Ok(current.zip(high))
    }

    /// Sets how many unused bytes the default memory pool keeps reserved across a
    /// synchronisation (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`; CUDA's default is 0: every
    /// synchronisation hands the pool's unused memory back to the driver, and the next allocation
    /// maps it again; [`Device::new`] sets `u64::MAX`). No-op where the device has no memory pools.
    /// The pool is the device's, shared with every user of it in the process.
    pub fn set_pool_release_threshold(&self, bytes: u64) -> Result<()> {
        self.set_pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, bytes)
    }

    /// The default memory pool's release threshold ([`Device::set_pool_release_threshold`]), or
    /// `None` where the device has no memory pools.
    pub fn pool_release_threshold(&self) -> Result<Option<u64>> {
        self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
    }

    /// Bytes the default memory pool holds mapped now, in use or not
    /// (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`), or `None` where the device has no memory pools.
    pub fn pool_reserved(&self) -> Result<Option<u64>> {
        self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
    }

    /// Resets the pool's high-water mark to the bytes in use now (see [`Device::memory_in_use`]).
    pub fn reset_memory_peak(&self) -> Result<()> {
        // 0 is the only value the attribute accepts.
        self.set_pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)
    }

    /// A `cuuint64_t` attribute of the default memory pool, or `None` where the device has none.
    fn pool_attribute(&self, attr: sys::CUmemPool_attribute) -> Result<Option<u64>> {
        let Some(pool) = self.pool()? else { return Ok(None) };
        let mut value = 0u64;
        // SAFETY: valid pool; the callers pass attributes of type cuuint64_t.
        unsafe { cudarc::driver::result::mem_pool::get_attribute(pool, attr, (&mut value as *mut u64).cast()) }
            .map_err(|e| driver_error("cuMemPoolGetAttribute", e))?;
        Ok(Some(value))
    }

    /// Sets a `cuuint64_t` attribute of the default memory pool; no-op where the device has none.
    fn set_pool_attribute(&self, attr: sys::CUmemPool_attribute, value: u64) -> Result<()> {
        let Some(pool) = self.pool()? else { return Ok(()) };
        let mut value = value;
        // SAFETY: valid pool; the callers pass attributes of type cuuint64_t.
        unsafe { cudarc::driver::result::mem_pool::set_attribute(pool, attr, (&mut value as *mut u64).cast()) }
            .map_err(|e| driver_error("cuMemPoolSetAttribute", e))
    }

    /// Copies a host slice to a new device buffer.
    pub fn upload<T: CudaElement>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(host).map_err(|e| driver_error("upload", e))
    }

    /// Attention forward on device buffers, enqueued on [`Device::stream`] (asynchronous).
    ///
    /// `q`, `k`, `v`, `out` are strided views in the shapes of DESIGN §2; `lse` is contiguous
    /// `[b, hq, sq]` (or `[hq, tq]`). Varlen `cu_seqlens` stay host slices in the spec (they are
    /// copied to the device for the launch).
    pub fn forward<T: CudaElement>(
        &self,
        spec: &AttentionSpec<'_>,
        q: &DeviceTensor<'_, T>,
        k: &DeviceTensor<'_, T>,
        v: &DeviceTensor<'_, T>,
        out: &mut DeviceTensorMut<'_, T>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        self.forward_variant(spec, q, k, v, out, lse, None)
    }

    /// [`Device::forward`] with an explicit kernel variant (`None`: the default for the dtype and
    /// head dim). For benchmarks and tests of every tile shape.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_variant<T: CudaElement>(
        &self,
        spec: &AttentionSpec<'_>,
        q: &DeviceTensor<'_, T>,
        k: &DeviceTensor<'_, T>,
        v: &DeviceTensor<'_, T>,
        out: &mut DeviceTensorMut<'_, T>,
        lse: &mut CudaViewMut<'_, f32>,
        variant: Option<Variant>,
    ) -> Result<()> {
        let (g, o_layout) = forward_geometry(spec, [q, k, v], out, lse.len())?;
        // What the problem needs (and whether the kernels support it at all), then the caller's
        // variant if it asked for one that fits.
        let default = launch::supported(&g, T::DTYPE, &self.arch)?;
        let variant = variant.unwrap_or(default);
        let three_ok = variant.three_groups() == Some(variant);
        let narrow_ok = Variant::hopper_ws_narrow_blocks_for(variant.dtype, variant.d) == Some(variant);
        let shape = (variant.warps, variant.mt, variant.bc);
        launch::check_ws_shape(&variant.name(), variant.ws, shape, three_ok, narrow_ok)?;
        // The tile width this head dim runs on in the caller's kernel family (the Hopper forward
        // has widths the mma.sync one lacks).
        let width = tile_width(g.d, false, variant.wgmma).unwrap_or(default.d);
        check_fit(
            &variant.name(),
            (variant.runs_on(&self.arch), &self.arch),
            (variant.dtype, variant.d, variant.extras),
            (T::DTYPE, width, default.extras),
            g.d,
        )?;
        let f = self.function(&variant)?;
        launch::forward(self, &f, &variant, &g, q, k, v, out, o_layout, lse)
    }

    /// Attention forward with FP8 inputs on device buffers, enqueued on [`Device::stream`]
    /// (asynchronous): `q`, `k`, `v` hold e4m3 bytes ([`crate::Fp8E4m3`]'s bits) whose real values
    /// are the elements times `scales` (per-tensor descale factors, FlashAttention-3's
    /// `descale_q/k/v`); `out` is bf16, `lse` as for [`Device::forward`]. The semantics and the
    /// numerics contract are those of [`crate::forward_fp8`] (docs/semantics.md, "FP8 inputs").
    ///
    /// Runs on sm_90a (Hopper's 8-bit warpgroup MMAs; elsewhere a typed error): fixed-length
    /// batches, causal and sliding windows, GQA/MQA, `d == dv` a multiple of 16 up to 256 (on
    /// tiles of 128 and 256), strides that are multiples of 16 bytes. Not yet: varlen, dropout,
    /// softcap, ALiBi, block masks (each a typed error). Extra device memory for the call: V
    /// transposed, `batch · hk · width · sk` bytes with `sk` rounded up to 128.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_fp8(
        &self,
        spec: &AttentionSpec<'_>,
        q: &DeviceTensor<'_, u8>,
        k: &DeviceTensor<'_, u8>,
        v: &DeviceTensor<'_, u8>,
        scales: crate::Fp8Scales,
        out: &mut DeviceTensorMut<'_, half::bf16>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        self.forward_fp8_variant(spec, q, k, v, scales, out, lse, None)
    }

    /// [`Device::forward_fp8`] with an explicit kernel variant (`None`: the default for the head
    /// dim). For benchmarks and tests of both FP8 kernels.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_fp8_variant(
        &self,
        spec: &AttentionSpec<'_>,
        q: &DeviceTensor<'_, u8>,
        k: &DeviceTensor<'_, u8>,
        v: &DeviceTensor<'_, u8>,
        scales: crate::Fp8Scales,
        out: &mut DeviceTensorMut<'_, half::bf16>,
        lse: &mut CudaViewMut<'_, f32>,
        variant: Option<Fp8Variant>,
    ) -> Result<()> {
        scales.validate()?;
        let (g, o_layout) = forward_geometry(spec, [q, k, v], out, lse.len())?;
        let default = launch::fp8_supported(&g, &self.arch, scales)?;
        let variant = variant.unwrap_or(default);
        launch::check_ws_shape(&variant.name(), variant.ws, (variant.warps, 1, variant.bc), false, false)?;
        if variant.d != default.d {
            return Err(Error::Unsupported(format!(
                "variant {} does not fit d = {} (tile width {})",
                variant.name(),
                g.d,
                default.d
            )));
        }
        let f = self.fp8_functions(&variant)?;
        launch::forward_fp8(self, &f, &variant, &g, (q, k, v), scales, out, o_layout, lse)
    }

    /// Attention backward on device buffers, enqueued on [`Device::stream`] (asynchronous): `dq`,
    /// `dk`, `dv` from the inputs, the forward's `out` and `lse`, and `dout` (shaped like `out`).
    ///
    /// Extra device memory: an f32 dQ accumulator (`total_q · hq · d` floats) and `D` (one f32 per
    /// query row and head), allocated for the call. GQA gradients are summed into the `hk` heads
    /// on chip. With [`AttentionSpec::deterministic`] the dQ contributions are added in a fixed
    /// order and the result is bitwise reproducible; by default they are added with atomics.
    /// With dropout, the spec's `(seed, offset)` must be the forward's: the keep mask is
    /// regenerated, bit-identical to the CPU's.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<T: CudaElement>(
        &self,
        spec: &AttentionSpec<'_>,
        q: &DeviceTensor<'_, T>,
        k: &DeviceTensor<'_, T>,
        v: &DeviceTensor<'_, T>,
        out: &DeviceTensor<'_, T>,
        lse: &CudaView<'_, f32>,
        dout: &DeviceTensor<'_, T>,
        dq: &mut DeviceTensorMut<'_, T>,
        dk: &mut DeviceTensorMut<'_, T>,
        dv: &mut DeviceTensorMut<'_, T>,
    ) -> Result<()> {
        self.backward_variant(spec, q, k, v, out, lse, dout, dq, dk, dv, None)
    }

    /// [`Device::backward`] with an explicit kernel variant (`None`: the default).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_variant<T: CudaElement>(
        &self,
        spec: &AttentionSpec<'_>,
        q: &DeviceTensor<'_, T>,
        k: &DeviceTensor<'_, T>,
        v: &DeviceTensor<'_, T>,
        out: &DeviceTensor<'_, T>,
        lse: &CudaView<'_, f32>,
        dout: &DeviceTensor<'_, T>,
        dq: &mut DeviceTensorMut<'_, T>,
        dk: &mut DeviceTensorMut<'_, T>,
        dv: &mut DeviceTensorMut<'_, T>,
        variant: Option<BwdVariant>,
    ) -> Result<()> {
        self.backward_impl(spec, q, k, v, out, lse, dout, dq, dk, dv, variant, None)
    }

    /// Bytes of device scratch memory [`Device::backward`] needs for this problem: the `f32` dQ
    /// accumulator, `D` (one `f32` per query row and head) and, deterministic, one `i32` per
    /// (sequence, head, query tile). For callers that allocate it themselves, from their own
    /// allocator, and pass it to [`Device::backward_with_workspace`].
    pub fn backward_workspace_bytes<T: CudaElement>(
        &self,
        spec: &AttentionSpec<'_>,
        q: &DeviceTensor<'_, T>,
        k: &DeviceTensor<'_, T>,
        v: &DeviceTensor<'_, T>,
    ) -> Result<usize> {
        let units = |n: usize| vec![(); n];
        let (uq, uk, uv) = (units(q.data.len()), units(k.data.len()), units(v.data.len()));
        let g = Geometry::new(
            spec,
            &Tensor::with_strides(&uq, &q.shape, &q.strides),
            &Tensor::with_strides(&uk, &k.shape, &k.strides),
            &Tensor::with_strides(&uv, &v.shape, &v.strides),
        )?;
        let variant = launch::supported_backward(&g, T::DTYPE, &self.arch)?;
        Ok(launch::BwdScratch::of(&g, &variant, spec.is_deterministic()).bytes)
    }

    /// [`Device::backward`] with its scratch memory in `workspace` (at least
    /// [`Device::backward_workspace_bytes`], 256-byte aligned; any contents: the call writes
    /// every byte it reads, on the stream, and the workspace is in use until the stream's work
    /// of this call is done) instead of a stream-ordered
    /// allocation of the device's memory pool.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_with_workspace<T: CudaElement>(
        &self,
        spec: &AttentionSpec<'_>,
        q: &DeviceTensor<'_, T>,
        k: &DeviceTensor<'_, T>,
        v: &DeviceTensor<'_, T>,
        out: &DeviceTensor<'_, T>,
        lse: &CudaView<'_, f32>,
        dout: &DeviceTensor<'_, T>,
        dq: &mut DeviceTensorMut<'_, T>,
        dk: &mut DeviceTensorMut<'_, T>,
        dv: &mut DeviceTensorMut<'_, T>,
        workspace: &mut CudaViewMut<'_, u8>,
    ) -> Result<()> {
        self.backward_impl(spec, q, k, v, out, lse, dout, dq, dk, dv, None, Some(workspace))
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_impl<T: CudaElement>(
        &self,
        spec: &AttentionSpec<'_>,
        q: &DeviceTensor<'_, T>,
        k: &DeviceTensor<'_, T>,
        v: &DeviceTensor<'_, T>,
        out: &DeviceTensor<'_, T>,
        lse: &CudaView<'_, f32>,
        dout: &DeviceTensor<'_, T>,
        dq: &mut DeviceTensorMut<'_, T>,
        dk: &mut DeviceTensorMut<'_, T>,
        dv: &mut DeviceTensorMut<'_, T>,
        variant: Option<BwdVariant>,
        workspace: Option<&mut CudaViewMut<'_, u8>>,
    ) -> Result<()> {
        let units = |n: usize| vec![(); n];
        let (uq, uk, uv) = (units(q.data.len()), units(k.data.len()), units(v.data.len()));
        let (uo, udo) = (units(out.data.len()), units(dout.data.len()));
        let (mut udq, mut udk, mut udv) = (units(dq.data.len()), units(dk.data.len()), units(dv.data.len()));
        let g = Geometry::new(
            spec,
            &Tensor::with_strides(&uq, &q.shape, &q.strides),
            &Tensor::with_strides(&uk, &k.shape, &k.strides),
            &Tensor::with_strides(&uv, &v.shape, &v.strides),
        )?;
        let out_shape = g.q_shape(g.dv);
        let out_layout =
            g.check_input_like("out", &Tensor::with_strides(&uo, &out.shape, &out.strides), &out_shape, true)?;
        let dout_layout =
            g.check_input_like("dout", &Tensor::with_strides(&udo, &dout.shape, &dout.strides), &out_shape, true)?;
        g.check_lse_len(lse.len())?;
        let dq_layout = g.check_output_like(
            "dq",
            &TensorMut::with_strides(&mut udq, &dq.shape, &dq.strides),
            &g.q_shape(g.d),
            true,
        )?;
        let dk_layout = g.check_output_like(
            "dk",
            &TensorMut::with_strides(&mut udk, &dk.shape, &dk.strides),
            &g.k_shape(g.d),
            false,
        )?;
        let dv_layout = g.check_output_like(
            "dv",
            &TensorMut::with_strides(&mut udv, &dv.shape, &dv.strides),
            &g.k_shape(g.dv),
            false,
        )?;
        let default = launch::supported_backward(&g, T::DTYPE, &self.arch)?;
        let variant = variant.unwrap_or(default);
        check_fit(
            &variant.name(),
            (variant.runs_on(&self.arch), &self.arch),
            (variant.dtype, variant.d, variant.extras),
            (T::DTYPE, default.d, default.extras),
            g.d,
        )?;
        let f = self.bwd_functions(&variant)?;
        let buffers = launch::BwdBuffers {
            q,
            k,
            v,
            out,
            out_layout,
            lse,
            dout,
            dout_layout,
            dq,
            dq_layout,
            dk,
            dk_layout,
            dv,
            dv_layout,
        };
        launch::backward(self, &f, &variant, &g, spec.is_deterministic(), buffers, workspace)
    }
}

/// The registers a thread of a warp-specialised kernel of `threads` threads a block starts
/// with: a multiprocessor's 65536 over the block, in steps of 8 (168 for 384 threads, 128 for
/// 512). Its setmaxnreg split (`PRODUCER_REGS`, `CONSUMER_REGS` in `flash_fwd_ws.cuh`) hands out
/// that many, and the consumers' increase waits for registers the producer returned, so a build
/// with fewer would hang, not fail.
fn ws_registers(threads: usize) -> i32 {
    (65536 / threads.max(1) / 8 * 8) as i32
}

/// Refuses a warp-specialised kernel of `threads` threads a block that ptxas gave other than
/// [`ws_registers`] registers.
fn check_ws_registers(f: &CudaFunction, name: &str, threads: usize) -> Result<()> {
    let regs = f.num_regs().map_err(|e| driver_error("cuFuncGetAttribute(registers)", e))?;
    let want = ws_registers(threads);
    if regs != want {
        return Err(Error::CudaLaunch(format!(
            "{name} was compiled to {regs} registers a thread; its register split needs {want}"
        )));
    }
    Ok(())
}

/// Lets `f` launch with `bytes` of dynamic shared memory (above the 48 KiB default).
fn allow_dynamic_smem(f: &CudaFunction, bytes: usize) -> Result<()> {
    f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
        .map_err(|e| driver_error("cuFuncSetAttribute(max dynamic shared memory)", e))
}

/// A read-only strided view of a device buffer (shape and strides in elements, as [`Tensor`]).
#[derive(Debug)]
pub struct DeviceTensor<'a, T> {
    pub(crate) data: CudaView<'a, T>,
    pub(crate) shape: Vec<usize>,
    pub(crate) strides: Vec<usize>,
}

impl<'a, T> DeviceTensor<'a, T> {
    /// A row-major contiguous view.
    pub fn new(data: CudaView<'a, T>, shape: &[usize]) -> Self {
        Self { data, shape: shape.to_vec(), strides: crate::tensor::contiguous_strides(shape) }
    }

    /// A view with explicit strides (last stride 1).
    pub fn with_strides(data: CudaView<'a, T>, shape: &[usize], strides: &[usize]) -> Self {
        Self { data, shape: shape.to_vec(), strides: strides.to_vec() }
    }
}

/// A writable strided view of a device buffer.
#[derive(Debug)]
pub struct DeviceTensorMut<'a, T> {
    pub(crate) data: CudaViewMut<'a, T>,
    pub(crate) shape: Vec<usize>,
    pub(crate) strides: Vec<usize>,
}

impl<'a, T> DeviceTensorMut<'a, T> {
    /// A row-major contiguous view.
    pub fn new(data: CudaViewMut<'a, T>, shape: &[usize]) -> Self {
        Self { data, shape: shape.to_vec(), strides: crate::tensor::contiguous_strides(shape) }
    }

    /// A view with explicit strides (last stride 1).
    pub fn with_strides(data: CudaViewMut<'a, T>, shape: &[usize], strides: &[usize]) -> Self {
        Self { data, shape: shape.to_vec(), strides: strides.to_vec() }
    }
}

/// The process-wide device 0, opened on first use (the error, if any, is kept and returned to
/// every later call).
pub fn default_device() -> Result<&'static Device> {
    static DEVICE: OnceLock<Result<Device>> = OnceLock::new();
    DEVICE.get_or_init(|| Device::new(0)).as_ref().map_err(Clone::clone)
}

/// Attention forward on GPU 0 for host inputs: copies `q`, `k`, `v` (their whole buffers, strides
/// kept) to the device, runs the kernel, and copies `out` (contiguous) and `lse` back.
pub fn forward_host<T: CudaElement>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
) -> Result<Output<T>> {
    forward_host_variant(spec, q, k, v, None)
}

/// [`forward_host`] with an explicit kernel variant.
pub fn forward_host_variant<T: CudaElement>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    variant: Option<Variant>,
) -> Result<Output<T>> {
    let g = Geometry::new(spec, q, k, v)?;
    // What the kernels cannot do is said before whether a device is there.
    launch::check_supported(&g, T::DTYPE, false)?;
    let dev = default_device()?;
    let variant = match variant {
        Some(v) => v,
        None => launch::supported(&g, T::DTYPE, dev.arch())?,
    };
    let (dq, dk, dv) = (dev.upload(q.data())?, dev.upload(k.data())?, dev.upload(v.data())?);
    let out_shape = g.out_shape();
    let lse_shape = g.lse_shape();
    let out_len: usize = out_shape.iter().product();
    let alloc = |what: &str, e| driver_error(what, e);
    let mut dout = dev.stream.alloc_zeros::<T>(out_len.max(1)).map_err(|e| alloc("alloc out", e))?;
    let mut dlse = dev.stream.alloc_zeros::<f32>(g.lse_len().max(1)).map_err(|e| alloc("alloc lse", e))?;
    {
        let qt = DeviceTensor::with_strides(dq.as_view(), q.shape(), q.strides());
        let kt = DeviceTensor::with_strides(dk.as_view(), k.shape(), k.strides());
        let vt = DeviceTensor::with_strides(dv.as_view(), v.shape(), v.strides());
        let mut ot = DeviceTensorMut::new(dout.slice_mut(0..out_len), &out_shape);
        let mut lt = dlse.slice_mut(0..g.lse_len());
        dev.forward_variant(spec, &qt, &kt, &vt, &mut ot, &mut lt, Some(variant))?;
    }
    let mut out = dev.stream.clone_dtoh(&dout).map_err(|e| driver_error("download out", e))?;
    let mut lse = dev.stream.clone_dtoh(&dlse).map_err(|e| driver_error("download lse", e))?;
    dev.stream.synchronize().map_err(|e| driver_error("synchronize", e))?;
    out.truncate(out_len);
    lse.truncate(g.lse_len());
    Ok(Output { out, out_shape, lse, lse_shape })
}

/// Attention forward with FP8 inputs on GPU 0 for host tensors: copies `q`, `k`, `v` (e4m3,
/// their whole buffers, strides kept) to the device, runs [`Device::forward_fp8`], and copies
/// `out` (bf16, contiguous) and `lse` back. What the FP8 kernel does not support is a typed
/// error before a device is opened.
pub fn forward_fp8_host(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, crate::Fp8E4m3>,
    k: &Tensor<'_, crate::Fp8E4m3>,
    v: &Tensor<'_, crate::Fp8E4m3>,
    scales: crate::Fp8Scales,
) -> Result<Output<half::bf16>> {
    forward_fp8_host_variant(spec, q, k, v, scales, None)
}

/// [`forward_fp8_host`] with an explicit kernel variant (`None`: the default).
pub fn forward_fp8_host_variant(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, crate::Fp8E4m3>,
    k: &Tensor<'_, crate::Fp8E4m3>,
    v: &Tensor<'_, crate::Fp8E4m3>,
    scales: crate::Fp8Scales,
    variant: Option<Fp8Variant>,
) -> Result<Output<half::bf16>> {
    scales.validate()?;
    let g = Geometry::new(spec, q, k, v)?;
    launch::check_fp8_supported(&g, scales)?;
    let dev = default_device()?;
    let bytes = |t: &Tensor<'_, crate::Fp8E4m3>| t.data().iter().map(|x| x.to_bits()).collect::<Vec<u8>>();
    let upload = |t| dev.stream.clone_htod(&bytes(t)).map_err(|e| driver_error("upload", e));
    let (dq, dk, dv) = (upload(q)?, upload(k)?, upload(v)?);
    let out_shape = g.out_shape();
    let lse_shape = g.lse_shape();
    let out_len: usize = out_shape.iter().product();
    let alloc = |what: &str, e| driver_error(what, e);
    let mut dout = dev.stream.alloc_zeros::<half::bf16>(out_len.max(1)).map_err(|e| alloc("alloc out", e))?;
    let mut dlse = dev.stream.alloc_zeros::<f32>(g.lse_len().max(1)).map_err(|e| alloc("alloc lse", e))?;
    {
        let qt = DeviceTensor::with_strides(dq.as_view(), q.shape(), q.strides());
        let kt = DeviceTensor::with_strides(dk.as_view(), k.shape(), k.strides());
        let vt = DeviceTensor::with_strides(dv.as_view(), v.shape(), v.strides());
        let mut ot = DeviceTensorMut::new(dout.slice_mut(0..out_len), &out_shape);
        let mut lt = dlse.slice_mut(0..g.lse_len());
        dev.forward_fp8_variant(spec, &qt, &kt, &vt, scales, &mut ot, &mut lt, variant)?;
    }
    let mut out = dev.stream.clone_dtoh(&dout).map_err(|e| driver_error("download out", e))?;
    let mut lse = dev.stream.clone_dtoh(&dlse).map_err(|e| driver_error("download lse", e))?;
    dev.stream.synchronize().map_err(|e| driver_error("synchronize", e))?;
    out.truncate(out_len);
    lse.truncate(g.lse_len());
    Ok(Output { out, out_shape, lse, lse_shape })
}

/// Attention backward on GPU 0 for host inputs: copies the inputs, `out`, `lse` and `dout` to the
/// device, runs the backward kernels, and copies `dq`, `dk`, `dv` (contiguous) back.
#[allow(clippy::too_many_arguments)]
pub fn backward_host<T: CudaElement>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    out: &Tensor<'_, T>,
    lse: &[f32],
    dout: &Tensor<'_, T>,
) -> Result<Gradients<T>> {
    backward_host_variant(spec, q, k, v, out, lse, dout, None)
}

/// [`backward_host`] with an explicit kernel variant.
#[allow(clippy::too_many_arguments)]
pub fn backward_host_variant<T: CudaElement>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    out: &Tensor<'_, T>,
    lse: &[f32],
    dout: &Tensor<'_, T>,
    variant: Option<BwdVariant>,
) -> Result<Gradients<T>> {
    let g = Geometry::new(spec, q, k, v)?;
    launch::check_supported(&g, T::DTYPE, true)?;
    let dev = default_device()?;
    let variant = match variant {
        Some(v) => v,
        None => launch::supported_backward(&g, T::DTYPE, dev.arch())?,
    };
    let up = |x: &Tensor<'_, T>| dev.upload(x.data());
    let (dq_in, dk_in, dv_in, dout_in, out_in) = (up(q)?, up(k)?, up(v)?, up(dout)?, up(out)?);
    let lse_in = dev.stream.clone_htod(lse).map_err(|e| driver_error("upload lse", e))?;
    let (dq_shape, dk_shape, dv_shape) = (g.q_shape(g.d), g.k_shape(g.d), g.k_shape(g.dv));
    let len = |s: &[usize]| s.iter().product::<usize>();
    let alloc = |what: &str, n: usize| dev.stream.alloc_zeros::<T>(n.max(1)).map_err(|e| driver_error(what, e));
    let (mut gq, mut gk, mut gv) =
        (alloc("alloc dq", len(&dq_shape))?, alloc("alloc dk", len(&dk_shape))?, alloc("alloc dv", len(&dv_shape))?);
    {
        let qt = DeviceTensor::with_strides(dq_in.as_view(), q.shape(), q.strides());
        let kt = DeviceTensor::with_strides(dk_in.as_view(), k.shape(), k.strides());
        let vt = DeviceTensor::with_strides(dv_in.as_view(), v.shape(), v.strides());
        let ot = DeviceTensor::with_strides(out_in.as_view(), out.shape(), out.strides());
        let dot = DeviceTensor::with_strides(dout_in.as_view(), dout.shape(), dout.strides());
        let mut dqt = DeviceTensorMut::new(gq.slice_mut(0..len(&dq_shape)), &dq_shape);
        let mut dkt = DeviceTensorMut::new(gk.slice_mut(0..len(&dk_shape)), &dk_shape);
        let mut dvt = DeviceTensorMut::new(gv.slice_mut(0..len(&dv_shape)), &dv_shape);
        dev.backward_variant(
            spec,
            &qt,
            &kt,
            &vt,
            &ot,
            &lse_in.as_view(),
            &dot,
            &mut dqt,
            &mut dkt,
            &mut dvt,
            Some(variant),
        )?;
    }
    let down = |x: &CudaSlice<T>, n: usize, what: &str| -> Result<Vec<T>> {
        let mut h = dev.stream.clone_dtoh(x).map_err(|e| driver_error(what, e))?;
        h.truncate(n);
        Ok(h)
    };
    let dq = down(&gq, len(&dq_shape), "download dq")?;
    let dk = down(&gk, len(&dk_shape), "download dk")?;
    let dv = down(&gv, len(&dv_shape), "download dv")?;
    dev.stream.synchronize().map_err(|e| driver_error("synchronize", e))?;
    Ok(Gradients { dq, dq_shape, dk, dk_shape, dv, dv_shape })
}

/// What compiling one variant for one architecture gave.
#[derive(Debug, Clone)]
pub struct VariantReport {
    /// The variant's name.
    pub name: String,
    /// The target (`sm_80`, `sm_90a`, ...).
    pub arch: String,
    /// Registers per thread (from ptxas's report, or the driver when a device is present).
    pub registers: Option<u32>,
    /// Bytes spilled to local memory (ptxas's `spill stores`).
    pub spill_bytes: Option<u32>,
    /// Spill bytes tolerated for this variant ([`BwdVariant::spill_budget`]; 0 for the forward).
    pub spill_budget: u32,
    /// Whether ptxas serialised the variant's warpgroup MMAs (its advisory C7511,
    /// [`nvrtc::wgmma_serialized`]): a Hopper kernel that compiled but runs each product alone.
    pub wgmma_serialized: bool,
    /// `Ok(())`, or the compile error (with NVRTC's log).
    pub result: std::result::Result<(), Error>,
    /// NVRTC's log.
    pub log: String,
}

impl VariantReport {
    /// Whether the variant compiled.
    pub fn ok(&self) -> bool {
        self.result.is_ok()
    }
}

/// Compiles every kernel variant for each architecture in `archs` (no GPU needed: NVRTC only),
/// reporting registers and spills from ptxas. Fails only when NVRTC itself is missing.
pub fn compile_all(archs: &[Arch]) -> Result<Vec<VariantReport>> {
    compile_matching(archs, "")
}

/// As [`compile_all`], for the variants whose name contains `pattern` (all for `""`).
pub fn compile_matching(archs: &[Arch], pattern: &str) -> Result<Vec<VariantReport>> {
    nvrtc::available()?;
    let (fwd_source, bwd_source) = (kernels::forward_source(), kernels::backward_source());
    let decode_source = decode::decode_source();
    let ws_source = kernels::ws_forward_source();
    // (name, program, options, spill budget, Hopper-only) of every variant; a backward program
    // holds three kernels and ptxas_usage reports the largest, the main kernel's.
    let programs: Vec<(String, &str, Vec<String>, u32, bool)> = Variant::all()
        .into_iter()
        .map(|v| {
            let source = if v.ws { ws_source.as_str() } else { fwd_source.as_str() };
            (v.name(), source, v.options(), v.spill_budget(), v.wgmma)
        })
        .chain(
            BwdVariant::all()
                .into_iter()
                .map(|v| (v.name(), bwd_source.as_str(), v.options(), v.spill_budget(), v.wgmma)),
        )
        .chain(
            decode::DecodeVariant::all().into_iter().map(|v| (v.name(), decode_source.as_str(), v.options(), 0, false)),
        )
        .chain(Fp8Variant::all().into_iter().map(|v| (v.name(), ws_source.as_str(), v.options(), 0, true)))
        .chain([DType::F16, DType::BF16].into_iter().map(|dt| {
            let mut options = ring::ring_options(dt);
            options.extend(["-Xptxas".to_string(), "-v".to_string()]);
            (format!("ring_{}", dt.name()), ring::ring_source(), options, 0, false)
        }))
        .collect();
    let jobs: Vec<_> = archs
        .iter()
        .flat_map(|arch| programs.iter().map(move |p| (arch, p)))
        .filter(|(arch, (name, _, _, _, wgmma))| (!*wgmma || arch.has_wgmma()) && name.contains(pattern))
        .collect();
    // One program a thread (rayon's): NVRTC compiles distinct programs concurrently, and each
    // cache entry has a file name of its own. The reports keep the order of `jobs`.
    jobs.par_iter()
        .map(|&(arch, (name, source, options, spill_budget, _))| {
            let (log, result) = match nvrtc::compile(name, source, options, arch) {
                Ok(c) => (c.log, Ok(())),
                Err(Error::KernelCompile { kernel, log }) => (log.clone(), Err(Error::KernelCompile { kernel, log })),
                Err(e) => return Err(e),
            };
            let (registers, spill_bytes) = nvrtc::ptxas_usage(&log);
            Ok(VariantReport {
                name: name.clone(),
                arch: arch.0.clone(),
                registers,
                spill_bytes,
                spill_budget: *spill_budget,
                wgmma_serialized: nvrtc::wgmma_serialized(&log),
                result,
                log,
            })
        })
        .collect()
}
