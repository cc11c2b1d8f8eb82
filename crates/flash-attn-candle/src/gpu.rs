//! CUDA tensors: the library's kernels on candle's buffers, launched on candle's stream.
//!
//! candle and this library share one `cudarc` (0.19), so candle's `CudaSlice`s are handed to the
//! kernels as they are: no copies, no raw pointers. Each GPU is opened once (its primary context,
//! the one candle uses) and its kernels stay loaded; a call runs on a handle of it bound to the
//! stream of the candle device ([`flash_attn::cuda::Device::with_stream`]). Outputs, the
//! log-sum-exp and the backward's scratch memory are allocated by candle's device.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle::backend::BackendStorage;
use candle::cuda::{CudaDType, CudaDevice};
use candle::op::BackpropOp;
use candle::{CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};
use cudarc::driver::CudaSlice;
use flash_attn::cuda::{CudaElement, Device, DeviceTensor, DeviceTensorMut};
use half::{bf16, f16};

use crate::{wrap, Options};

/// Each GPU opened so far, or the error opening it gave.
type Devices = Mutex<HashMap<usize, std::result::Result<Arc<Device>, flash_attn::Error>>>;

/// The library's handle of candle device `cd`'s GPU, launching on `cd`'s stream.
fn on_stream(cd: &CudaDevice) -> Result<Device> {
    static DEVICES: OnceLock<Devices> = OnceLock::new();
    let stream = cd.cuda_stream();
    let ordinal = stream.context().ordinal();
    let dev = {
        let mut map = DEVICES.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        map.entry(ordinal).or_insert_with(|| Device::new(ordinal).map(Arc::new)).clone().map_err(wrap)?
    };
    dev.with_stream(stream).map_err(wrap)
}

/// A candle buffer and layout as the library's strided device view.
fn view<'a, T>(s: &'a CudaSlice<T>, l: &Layout) -> Result<DeviceTensor<'a, T>> {
    let data = s.try_slice(l.start_offset()..).ok_or_else(|| candle::Error::Msg("layout past its storage".into()))?;
    Ok(DeviceTensor::with_strides(data, l.dims(), l.stride()))
}

/// `out` and `lse` shapes of a call: `[b, sq, hq, dv]` / `[b, hq, sq]`, or varlen `[tq, hq, dv]` /
/// `[hq, tq]`.
fn shapes(q: &[usize], v: &[usize], varlen: bool) -> Result<(Vec<usize>, Vec<usize>)> {
    let dv = *v.last().ok_or_else(|| candle::Error::Msg("v has no dimensions".into()))?;
    match (varlen, q) {
        (true, &[tq, hq, _]) => Ok((vec![tq, hq, dv], vec![hq, tq])),
        (false, &[b, sq, hq, _]) => Ok((vec![b, sq, hq, dv], vec![b, hq, sq])),
        _ => candle::bail!("q has shape {q:?}: [b, sq, hq, d] expected ([total_q, hq, d] for varlen)"),
    }
}

/// The forward on CUDA storage: `(out, its shape, lse)`.
pub(crate) fn fwd(
    opts: &Options,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape, CudaSlice<f32>)> {
    crate::check_dtypes(q.0.dtype(), k.0.dtype(), v.0.dtype())?;
    match q.0.dtype() {
        DType::F16 => fwd_t::<f16>(opts, q, k, v),
        DType::BF16 => fwd_t::<bf16>(opts, q, k, v),
        dt => candle::bail!("the CUDA kernels take f16 and bf16, got {dt:?}"),
    }
}

fn fwd_t<T: CudaElement + CudaDType>(
    opts: &Options,
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape, CudaSlice<f32>)> {
    let cd = &q.device;
    let dev = on_stream(cd)?;
    let (out_shape, lse_shape) = shapes(ql.dims(), vl.dims(), opts.varlen.is_some())?;
    // SAFETY: uninitialised device memory the forward writes whole (every row of every sequence,
    // and varlen rows past the last sequence as 0 / -inf) before anyone reads it.
    let (mut out, mut lse) = unsafe {
        (
            cd.alloc::<T>(out_shape.iter().product::<usize>().max(1))?,
            cd.alloc::<f32>(lse_shape.iter().product::<usize>().max(1))?,
        )
    };
    let n_out = out_shape.iter().product::<usize>();
    let n_lse = lse_shape.iter().product::<usize>();
    dev.forward(
        &opts.spec(),
        &view(q.as_cuda_slice::<T>()?, ql)?,
        &view(k.as_cuda_slice::<T>()?, kl)?,
        &view(v.as_cuda_slice::<T>()?, vl)?,
        &mut DeviceTensorMut::new(out.slice_mut(..n_out), &out_shape),
        &mut lse.slice_mut(..n_lse),
    )
    .map_err(wrap)?;
    Ok((CudaStorage::wrap_cuda_slice(out, cd.clone()), Shape::from(out_shape), lse))
}

/// The backward on CUDA tensors `[q, k, v, out, dout]` and the forward's `lse`: `[dq, dk, dv]`.
pub(crate) fn bwd(opts: &Options, t: [&Tensor; 5], lse: &CudaSlice<f32>) -> Result<[Tensor; 3]> {
    match t[0].dtype() {
        DType::F16 => bwd_t::<f16>(opts, t, lse),
        DType::BF16 => bwd_t::<bf16>(opts, t, lse),
        dt => candle::bail!("the CUDA kernels take f16 and bf16, got {dt:?}"),
    }
}

fn bwd_t<T: CudaElement + CudaDType>(opts: &Options, t: [&Tensor; 5], lse: &CudaSlice<f32>) -> Result<[Tensor; 3]> {
    let guards = t.map(|x| x.storage_and_layout());
    let mut st = Vec::with_capacity(5);
    for (g, l) in &guards {
        match &**g {
            Storage::Cuda(s) => st.push((s, *l)),
            _ => candle::bail!("flash-attn backward: all tensors must be on one CUDA device"),
        }
    }
    let cd = &st[0].0.device;
    let dev = on_stream(cd)?;
    let spec = opts.spec();
    let views: Vec<DeviceTensor<'_, T>> =
        st.iter().map(|(s, l)| view(s.as_cuda_slice::<T>()?, l)).collect::<Result<_>>()?;
    let dims = |i: usize| st[i].1.dims().to_vec();
    let n = |d: &[usize]| d.iter().product::<usize>();
    let (qd, kd, vd) = (dims(0), dims(1), dims(2));
    // SAFETY: uninitialised device memory, never read before written: the backward writes every
    // element of dq, dk and dv (dk/dv rows of varlen tokens past the last sequence included), and
    // writes every byte of the workspace it reads before reading it.
    let (mut dq, mut dk, mut dv, mut workspace) = unsafe {
        let bytes = dev.backward_workspace_bytes(&spec, &views[0], &views[1], &views[2]).map_err(wrap)?;
        (
            cd.alloc::<T>(n(&qd).max(1))?,
            cd.alloc::<T>(n(&kd).max(1))?,
            cd.alloc::<T>(n(&vd).max(1))?,
            cd.alloc::<u8>(bytes.max(1))?,
        )
    };
    dev.backward_with_workspace(
        &spec,
        &views[0],
        &views[1],
        &views[2],
        &views[3],
        &lse.as_view(),
        &views[4],
        &mut DeviceTensorMut::new(dq.slice_mut(..n(&qd)), &qd),
        &mut DeviceTensorMut::new(dk.slice_mut(..n(&kd)), &kd),
        &mut DeviceTensorMut::new(dv.slice_mut(..n(&vd)), &vd),
        &mut workspace.as_view_mut(),
    )
    .map_err(wrap)?;
    let tensor = |s: CudaSlice<T>, d: Vec<usize>| {
        Tensor::from_storage(Storage::Cuda(CudaStorage::wrap_cuda_slice(s, cd.clone())), d, BackpropOp::none(), false)
    };
    Ok([tensor(dq, qd), tensor(dk, kd), tensor(dv, vd)])
}

/// `q [b, sq, hq, d]` over a paged cache on the GPU (see `paged_call` in the crate root): the
/// library's decode kernels, reading the cache in place.
pub(crate) fn paged(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens: &[i32],
    table: (&[i32], usize),
    opts: &Options,
) -> Result<Tensor> {
    crate::check_dtypes(q.dtype(), k.dtype(), v.dtype())?;
    match q.dtype() {
        DType::F16 => paged_t::<f16>(q, k, v, seqlens, table, opts),
        DType::BF16 => paged_t::<bf16>(q, k, v, seqlens, table, opts),
        dt => candle::bail!("the CUDA kernels take f16 and bf16, got {dt:?}"),
    }
}

fn paged_t<T: CudaElement + CudaDType>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens: &[i32],
    (table, width): (&[i32], usize),
    opts: &Options,
) -> Result<Tensor> {
    let guards = [q, k, v].map(|x| x.storage_and_layout());
    let mut st = Vec::with_capacity(3);
    for (g, l) in &guards {
        match &**g {
            Storage::Cuda(s) => st.push((s, *l)),
            _ => candle::bail!("flash_attn_varlen_paged_windowed: q, k and v must share one device"),
        }
    }
    let cd = &st[0].0.device;
    let dev = on_stream(cd)?;
    let views: Vec<DeviceTensor<'_, T>> =
        st.iter().map(|(s, l)| view(s.as_cuda_slice::<T>()?, l)).collect::<Result<_>>()?;
    let (qd, vd) = (st[0].1.dims(), st[2].1.dims());
    let (b, sq, hq) = match qd {
        &[b, sq, hq, _] => (b, sq, hq),
        _ => candle::bail!("q must be [b, sq, hq, d], got {qd:?}"),
    };
    let out_shape = vec![b, sq, hq, *vd.last().unwrap_or(&0)];
    let n_out = out_shape.iter().product::<usize>();
    let mut out = cd.alloc_zeros::<T>(n_out.max(1))?;
    let mut lse = cd.alloc_zeros::<f32>((b * hq * sq).max(1))?;
    let block_table = flash_attn::Tensor::new(table, &[seqlens.len(), width]);
    let meta = flash_attn::cuda::decode::DeviceKvCache::new(seqlens).paged(block_table);
    dev.kvcache_forward_readonly(
        &opts.spec(),
        &views[0],
        &views[1],
        &views[2],
        &meta,
        &mut DeviceTensorMut::new(out.slice_mut(..n_out), &out_shape),
        &mut lse.slice_mut(..b * hq * sq),
    )
    .map_err(wrap)?;
    Ok(Tensor::from_storage(
        Storage::Cuda(CudaStorage::wrap_cuda_slice(out, cd.clone())),
        out_shape,
        BackpropOp::none(),
        false,
    ))
}
