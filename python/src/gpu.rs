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
use flash_attn::cuda::{CudaElement, Device, DeviceTensor, DeviceTensorMut};
use flash_attn::Error;
use half::{bf16, f16};
use pyo3::exceptions::PyNotImplementedError;
use pyo3::PyResult;

use crate::{to_py, Opts, View};

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

/// The backward on CUDA tensors `[q, k, v, out, lse, dout, dq, dk, dv]`.
pub(crate) fn bwd(dtype: &str, device: i64, stream: usize, views: [View; 9], opts: &Opts) -> PyResult<()> {
    match dtype {
        "float16" => bwd_typed::<f16>(device, stream, views, opts),
        "bfloat16" => bwd_typed::<bf16>(device, stream, views, opts),
        other => Err(unsupported_dtype(other)),
    }
}

fn bwd_typed<T: CudaElement>(device: i64, stream: usize, views: [View; 9], opts: &Opts) -> PyResult<()> {
    let dev = on_stream(device, stream)?;
    let s = dev.stream().clone();
    let [q, k, v, out, lse, dout, dq, dk, dv] = views;
    // SAFETY: as in `fwd_typed`.
    unsafe {
        let spec = opts.spec()?;
        let (bq, bk, bv) =
            (Borrowed::<T>::new(&s, &q, "q")?, Borrowed::<T>::new(&s, &k, "k")?, Borrowed::<T>::new(&s, &v, "v")?);
        let (bo, bdo) = (Borrowed::<T>::new(&s, &out, "out")?, Borrowed::<T>::new(&s, &dout, "dout")?);
        let bl = Borrowed::<f32>::new(&s, &lse, "lse")?;
        let mut bdq = Borrowed::<T>::new(&s, &dq, "dq")?;
        let mut bdk = Borrowed::<T>::new(&s, &dk, "dk")?;
        let mut bdv = Borrowed::<T>::new(&s, &dv, "dv")?;
        dev.backward(
            &spec,
            &bq.tensor(&q, "q")?,
            &bk.tensor(&k, "k")?,
            &bv.tensor(&v, "v")?,
            &bo.tensor(&out, "out")?,
            &bl.slice().as_view(),
            &bdo.tensor(&dout, "dout")?,
            &mut bdq.tensor_mut(&dq, "dq")?,
            &mut bdk.tensor_mut(&dk, "dk")?,
            &mut bdv.tensor_mut(&dv, "dv")?,
        )
        .map_err(to_py)
    }
}
