//! CUDA tensors: the library's kernels on torch's buffers, launched on torch's current stream.
//!
//! Each GPU is opened once (its primary context, the one torch's runtime uses) and its kernels
//! stay loaded for the process. A call wraps torch's stream handle
//! ([`cudarc::driver::CudaContext::wrap_borrowed_stream`]) and torch's data pointers
//! ([`cudarc::driver::CudaStream::upgrade_device_ptr`], released again without freeing), so the
//! launches are ordered with torch's own work on that stream and nothing is copied. The library's
//! scratch buffers (the backward's `f32` dQ accumulator) are stream-ordered allocations on the
//! same stream from the device's default memory pool.
//!
//! cudarc's per-buffer event tracking is turned off for these contexts: every buffer of a call is
//! used on the one stream torch gave, so stream order alone is the synchronisation (and creating
//! two events per tensor per call would cost more than a small kernel).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{sys, CudaSlice, CudaStream};
use flash_attn::cuda::decode::DeviceKvCache;
use flash_attn::cuda::{CudaElement, Device, DeviceTensor, DeviceTensorMut};
use flash_attn::{Error, Fp8Scales};
use half::{bf16, f16};
use pyo3::exceptions::PyNotImplementedError;
use pyo3::PyResult;

use crate::{host, host_slice, to_py, CacheOpts, Opts, View};

/// Each GPU opened so far, or the error opening it gave.
type Devices = Mutex<HashMap<usize, Result<Arc<Device>, Error>>>;

/// GPU `ordinal`, opened on first use; a failure is returned again to later calls.
pub(crate) fn device(ordinal: usize) -> Result<Arc<Device>, Error> {
    static DEVICES: OnceLock<Devices> = OnceLock::new();
    let mut map = DEVICES.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    map.entry(ordinal)
        .or_insert_with(|| {
            let dev = Device::new(ordinal)?;
            // SAFETY: every buffer this module hands the library lives on the one stream of its
            // call (see the module docs); the library's own scratch buffers are allocated and
            // freed in that stream's order.
            unsafe { dev.context().disable_event_tracking() };
            Ok(Arc::new(dev))
        })
        .clone()
}

/// A torch buffer seen as a cudarc slice for the length of a call; dropping it forgets the slice
/// without freeing the memory (torch owns it).
struct Borrowed<T>(Option<CudaSlice<T>>);

impl<T> Borrowed<T> {
    /// # Safety
    /// `v.0` must point to device memory of the stream's context holding the view's extent of
    /// `T`, alive (and not freed by torch) until the stream's work of this call is done: torch's
    /// caching allocator guarantees that for tensors the Python layer holds during the call.
    unsafe fn new(stream: &Arc<CudaStream>, v: &View, name: &str) -> PyResult<Self> {
        let len = v.extent(name)?;
        // SAFETY: the caller's contract.
        Ok(Self(Some(unsafe { stream.upgrade_device_ptr::<T>(v.0 as sys::CUdeviceptr, len) })))
    }

    fn slice(&self) -> &CudaSlice<T> {
        self.0.as_ref().unwrap_or_else(|| unreachable!("taken only in drop"))
    }

    fn slice_mut(&mut self) -> &mut CudaSlice<T> {
        self.0.as_mut().unwrap_or_else(|| unreachable!("taken only in drop"))
    }

    fn tensor(&self, v: &View, name: &str) -> PyResult<DeviceTensor<'_, T>> {
        Ok(DeviceTensor::with_strides(self.slice().as_view(), &v.1, &v.strides(name)?))
    }

    fn tensor_mut(&mut self, v: &View, name: &str) -> PyResult<DeviceTensorMut<'_, T>> {
        let strides = v.strides(name)?;
        Ok(DeviceTensorMut::with_strides(self.slice_mut().as_view_mut(), &v.1, &strides))
    }
}

impl<T> Drop for Borrowed<T> {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            s.leak();
        }
    }
}

/// GPU `ordinal` with its launches going to torch's stream `stream`.
fn on_stream(ordinal: i64, stream: usize) -> PyResult<Device> {
    let ordinal = usize::try_from(ordinal).map_err(|_| to_py(Error::CudaUnavailable("bad device index".into())))?;
    let dev = device(ordinal).map_err(to_py)?;
    // SAFETY: `stream` is torch's current stream of that device (the Python layer reads it from
    // `torch.cuda.current_stream(device)`), alive for the call; torch uses the primary context.
    let wrapped = unsafe { dev.context().wrap_borrowed_stream(stream as sys::CUstream) };
    dev.with_stream(wrapped).map_err(to_py)
}

fn unsupported_dtype(dtype: &str) -> pyo3::PyErr {
    PyNotImplementedError::new_err(format!(
        "the CUDA kernels take float16 and bfloat16 tensors, not {dtype} (float32 runs on the CPU)"
    ))
}

/// The forward on CUDA tensors `[q, k, v, out, lse]`.
pub(crate) fn fwd(dtype: &str, device: i64, stream: usize, views: [View; 5], opts: &Opts) -> PyResult<()> {
    match dtype {
        "float16" => fwd_typed::<f16>(device, stream, views, opts),
        "bfloat16" => fwd_typed::<bf16>(device, stream, views, opts),
        other => Err(unsupported_dtype(other)),
    }
}

fn fwd_typed<T: CudaElement>(device: i64, stream: usize, views: [View; 5], opts: &Opts) -> PyResult<()> {
    let dev = on_stream(device, stream)?;
    let s = dev.stream().clone();
    let [q, k, v, out, lse] = views;
    // SAFETY: the Python layer passes live CUDA tensors of this device and dtype (lse: float32),
    // held until the call returns and ordered on `stream` (see `Borrowed::new`); host views in
    // `opts` are live CPU tensors.
    unsafe {
        let spec = opts.spec()?;
        let (bq, bk, bv) =
            (Borrowed::<T>::new(&s, &q, "q")?, Borrowed::<T>::new(&s, &k, "k")?, Borrowed::<T>::new(&s, &v, "v")?);
        let mut bo = Borrowed::<T>::new(&s, &out, "out")?;
        let mut bl = Borrowed::<f32>::new(&s, &lse, "lse")?;
        let mut lse_view = bl.slice_mut().as_view_mut();
        dev.forward(
            &spec,
            &bq.tensor(&q, "q")?,
            &bk.tensor(&k, "k")?,
            &bv.tensor(&v, "v")?,
            &mut bo.tensor_mut(&out, "out")?,
            &mut lse_view,
        )
        .map_err(to_py)
    }
}

/// The FP8 forward on CUDA tensors `[q, k, v, out, lse]`: `q`, `k`, `v` are e4m3 bytes
/// (`float8_e4m3fn`), `out` is `bfloat16`, `lse` `float32`.
pub(crate) fn fwd_fp8(device: i64, stream: usize, views: [View; 5], scales: Fp8Scales, opts: &Opts) -> PyResult<()> {
    let dev = on_stream(device, stream)?;
    let s = dev.stream().clone();
    let [q, k, v, out, lse] = views;
    // SAFETY: as in `fwd_typed`: live CUDA tensors of this device (q, k, v: one byte an element;
    // out: bfloat16; lse: float32), held until the call returns and ordered on `stream`.
    unsafe {
        let spec = opts.spec()?;
        let (bq, bk, bv) =
            (Borrowed::<u8>::new(&s, &q, "q")?, Borrowed::<u8>::new(&s, &k, "k")?, Borrowed::<u8>::new(&s, &v, "v")?);
        let mut bo = Borrowed::<bf16>::new(&s, &out, "out")?;
        let mut bl = Borrowed::<f32>::new(&s, &lse, "lse")?;
        let mut lse_view = bl.slice_mut().as_view_mut();
        dev.forward_fp8(
            &spec,
            &bq.tensor(&q, "q")?,
            &bk.tensor(&k, "k")?,
            &bv.tensor(&v, "v")?,
            scales,
            &mut bo.tensor_mut(&out, "out")?,
            &mut lse_view,
        )
        .map_err(to_py)
    }
}

/// Bytes of scratch memory the backward of CUDA tensors `[q, k, v]` needs.
pub(crate) fn bwd_workspace_bytes(dtype: &str, device: i64, views: [View; 3], opts: &Opts) -> PyResult<usize> {
    match dtype {
        "float16" => bwd_workspace_typed::<f16>(device, views, opts),
        "bfloat16" => bwd_workspace_typed::<bf16>(device, views, opts),
        other => Err(unsupported_dtype(other)),
    }
}

fn bwd_workspace_typed<T: CudaElement>(device: i64, views: [View; 3], opts: &Opts) -> PyResult<usize> {
    let dev = on_stream(device, 0)?;
    let s = dev.stream().clone();
    let [q, k, v] = views;
    // SAFETY: as in `fwd_typed`; nothing is launched, the views only size the problem.
    unsafe {
        let spec = opts.spec()?;
        let (bq, bk, bv) =
            (Borrowed::<T>::new(&s, &q, "q")?, Borrowed::<T>::new(&s, &k, "k")?, Borrowed::<T>::new(&s, &v, "v")?);
        dev.backward_workspace_bytes(&spec, &bq.tensor(&q, "q")?, &bk.tensor(&k, "k")?, &bv.tensor(&v, "v")?)
            .map_err(to_py)
    }
}

/// The backward on CUDA tensors `[q, k, v, out, lse, dout, dq, dk, dv]`, its scratch memory in
/// `workspace` (a torch allocation of [`bwd_workspace_bytes`]) when given.
pub(crate) fn bwd(
    dtype: &str,
    device: i64,
    stream: usize,
    views: [View; 9],
    workspace: Option<View>,
    opts: &Opts,
) -> PyResult<()> {
    match dtype {
        "float16" => bwd_typed::<f16>(device, stream, views, workspace, opts),
        "bfloat16" => bwd_typed::<bf16>(device, stream, views, workspace, opts),
        other => Err(unsupported_dtype(other)),
    }
}

fn bwd_typed<T: CudaElement>(
    device: i64,
    stream: usize,
    views: [View; 9],
    workspace: Option<View>,
    opts: &Opts,
) -> PyResult<()> {
    let dev = on_stream(device, stream)?;
    let s = dev.stream().clone();
    let [q, k, v, out, lse, dout, dq, dk, dv] = views;
    // SAFETY: as in `fwd_typed`; the workspace is a live torch allocation of this device.
    unsafe {
        let spec = opts.spec()?;
        let (bq, bk, bv) =
            (Borrowed::<T>::new(&s, &q, "q")?, Borrowed::<T>::new(&s, &k, "k")?, Borrowed::<T>::new(&s, &v, "v")?);
        let (bo, bdo) = (Borrowed::<T>::new(&s, &out, "out")?, Borrowed::<T>::new(&s, &dout, "dout")?);
        let bl = Borrowed::<f32>::new(&s, &lse, "lse")?;
        let mut bdq = Borrowed::<T>::new(&s, &dq, "dq")?;
        let mut bdk = Borrowed::<T>::new(&s, &dk, "dk")?;
        let mut bdv = Borrowed::<T>::new(&s, &dv, "dv")?;
        let mut bws = workspace.as_ref().map(|w| Borrowed::<u8>::new(&s, w, "workspace")).transpose()?;
        let (q_t, k_t, v_t) = (&bq.tensor(&q, "q")?, &bk.tensor(&k, "k")?, &bv.tensor(&v, "v")?);
        let (o_t, do_t, lse_v) = (&bo.tensor(&out, "out")?, &bdo.tensor(&dout, "dout")?, &bl.slice().as_view());
        let (dq_t, dk_t, dv_t) =
            (&mut bdq.tensor_mut(&dq, "dq")?, &mut bdk.tensor_mut(&dk, "dk")?, &mut bdv.tensor_mut(&dv, "dv")?);
        match bws.as_mut() {
            Some(b) => {
                let mut ws = b.slice_mut().as_view_mut();
                dev.backward_with_workspace(&spec, q_t, k_t, v_t, o_t, lse_v, do_t, dq_t, dk_t, dv_t, &mut ws)
            }
            None => dev.backward(&spec, q_t, k_t, v_t, o_t, lse_v, do_t, dq_t, dk_t, dv_t),
        }
        .map_err(to_py)
    }
}

/// Attention over a KV cache of CUDA tensors `[q, k_cache, v_cache, out, lse]` (the caches
/// written in place); the index tensors of `cache` are host tensors.
pub(crate) fn kvcache(
    dtype: &str,
    device: i64,
    stream: usize,
    views: [View; 5],
    cache: &CacheOpts,
    opts: &Opts,
) -> PyResult<()> {
    match dtype {
        "float16" => kvcache_typed::<f16>(device, stream, views, cache, opts),
        "bfloat16" => kvcache_typed::<bf16>(device, stream, views, cache, opts),
        other => Err(unsupported_dtype(other)),
    }
}

fn kvcache_typed<T: CudaElement>(
    device: i64,
    stream: usize,
    views: [View; 5],
    cache: &CacheOpts,
    opts: &Opts,
) -> PyResult<()> {
    let dev = on_stream(device, stream)?;
    let s = dev.stream().clone();
    let [q, kc, vc, out, lse] = views;
    let optional = |v: &Option<View>, name: &str| -> PyResult<Option<Borrowed<T>>> {
        // SAFETY: as in `fwd_typed`.
        v.as_ref().map(|v| unsafe { Borrowed::<T>::new(&s, v, name) }).transpose()
    };
    let (kn, vn) = (cache.new_kv.as_ref().map(|x| x.0.clone()), cache.new_kv.as_ref().map(|x| x.1.clone()));
    let (cos, sin) = (cache.rotary.as_ref().map(|x| x.0.clone()), cache.rotary.as_ref().map(|x| x.1.clone()));
    let (bkn, bvn, bcos, bsin) =
        (optional(&kn, "k")?, optional(&vn, "v")?, optional(&cos, "rotary_cos")?, optional(&sin, "rotary_sin")?);
    // SAFETY: as in `fwd_typed`; the caches are the caller's tensors, written in place, checked
    // by the caller not to share memory with the other buffers of the call; the index views
    // are live host tensors.
    unsafe {
        let spec = opts.spec()?;
        let bq = Borrowed::<T>::new(&s, &q, "q")?;
        let (mut bk, mut bv) = (Borrowed::<T>::new(&s, &kc, "k_cache")?, Borrowed::<T>::new(&s, &vc, "v_cache")?);
        let mut bo = Borrowed::<T>::new(&s, &out, "out")?;
        let mut bl = Borrowed::<f32>::new(&s, &lse, "lse")?;
        let tensor = optional_tensor::<T>;
        let (kn_t, vn_t) = (tensor(&bkn, &kn, "k")?, tensor(&bvn, &vn, "v")?);
        let (cos_t, sin_t) = (tensor(&bcos, &cos, "rotary_cos")?, tensor(&bsin, &sin, "rotary_sin")?);
        let mut meta =
            DeviceKvCache::new(host_slice(&cache.cache_seqlens, "cache_seqlens")?).num_splits(cache.num_splits);
        if let Some(x) = &cache.batch_idx {
            meta = meta.batch_idx(host_slice(x, "cache_batch_idx")?);
        }
        if let Some(x) = &cache.block_table {
            meta = meta.paged(host::<i32>(x, "block_table")?);
        }
        if let Some(x) = &cache.leftpad {
            meta = meta.leftpad(host_slice(x, "cache_leftpad")?);
        }
        if let (Some(k), Some(v)) = (&kn_t, &vn_t) {
            meta = meta.append(k, v);
        }
        if let (Some(c), Some(sn), Some((_, _, inter))) = (&cos_t, &sin_t, &cache.rotary) {
            meta = meta.rotary(c, sn, *inter);
        }
        let mut lse_view = bl.slice_mut().as_view_mut();
        dev.kvcache_forward(
            &spec,
            &bq.tensor(&q, "q")?,
            &mut bk.tensor_mut(&kc, "k_cache")?,
            &mut bv.tensor_mut(&vc, "v_cache")?,
            &meta,
            &mut bo.tensor_mut(&out, "out")?,
            &mut lse_view,
        )
        .map_err(to_py)
    }
}

/// The device view of an optional borrowed buffer.
fn optional_tensor<'b, T>(
    b: &'b Option<Borrowed<T>>,
    v: &Option<View>,
    name: &str,
) -> PyResult<Option<DeviceTensor<'b, T>>> {
    match (b, v) {
        (Some(b), Some(v)) => b.tensor(v, name).map(Some),
        _ => Ok(None),
    }
}
