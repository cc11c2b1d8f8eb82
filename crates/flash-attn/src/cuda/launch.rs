//! From a validated [`Geometry`] to one kernel launch: what the kernels support, the parameter
//! block, the grid.

use cudarc::driver::{CudaFunction, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};

use super::{driver_error, CudaElement, Device, DeviceTensor, DeviceTensorMut, Variant};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::spec::{AttentionSpec, Causal, Geometry, RowLayout};

/// The kernel parameters; field for field `FwdParams` in `kernels/flash_fwd.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct FwdParams {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    cu_seqlens_q: u64,
    cu_seqlens_k: u64,
    q_batch: i64,
    q_row: i64,
    q_head: i64,
    k_batch: i64,
    k_row: i64,
    k_head: i64,
    v_batch: i64,
    v_row: i64,
    v_head: i64,
    o_batch: i64,
    o_row: i64,
    o_head: i64,
    lse_batch: i64,
    lse_head: i64,
    batch: i32,
    hq: i32,
    group: i32,
    sq: i32,
    sk: i32,
    num_m_blocks: i32,
    causal: i32,
    window_left: i32,
    window_right: i32,
    scale_log2: f32,
    longest_first: i32,
}

// SAFETY: plain old data with the C layout of the kernel's `FwdParams` (pointers as u64).
unsafe impl DeviceRepr for FwdParams {}

/// The variant for this problem, or why the CUDA forward cannot run it.
pub(crate) fn supported(spec: &AttentionSpec<'_>, g: &Geometry<'_>, dtype: DType) -> Result<Variant> {
    let unsupported = |what: &str| Err(Error::Unsupported(format!("the CUDA forward does not support {what} yet")));
    if dtype == DType::F32 {
        return unsupported("f32 inputs (use f16 or bf16)");
    }
    if g.d != g.dv {
        return unsupported(&format!("d = {} with dv = {}", g.d, g.dv));
    }
    if g.softcap.is_some() {
        return unsupported("softcap");
    }
    if g.alibi.is_some() {
        return unsupported("ALiBi");
    }
    if g.block.is_some() {
        return unsupported("block-sparse masks");
    }
    if spec.dropout_setting().is_some_and(|d| d.p > 0.0) {
        return unsupported("dropout");
    }
    Variant::default_for(dtype, g.d).ok_or(Error::HeadDim {
        tensor: "q",
        dim: g.d,
        backend: "cuda (64 or 128)",
        min: 64,
        max: 128,
    })
}

fn i32_of(what: &str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| Error::Unsupported(format!("{what} = {x} exceeds the CUDA kernel's 32-bit range")))
}

/// A window side as the kernel takes it: -1 unbounded; sides past any sequence clamp to -1
/// (they hide nothing).
fn window_side(x: i64) -> i32 {
    if x < 0 || x > i64::from(i32::MAX / 4) {
        -1
    } else {
        x as i32
    }
}

/// cp.async moves 16-byte rows: every row start must be 16-byte aligned.
fn check_alignment(name: &str, ptr: u64, layout: &RowLayout, elem: usize) -> Result<()> {
    let strides = [layout.batch_stride, layout.token_stride, layout.head_stride];
    if !ptr.is_multiple_of(16) || strides.iter().any(|s| !(s * elem).is_multiple_of(16)) {
        return Err(Error::Unsupported(format!(
            "`{name}` must be 16-byte aligned with strides that are multiples of {} elements for the CUDA forward \
             (strides {strides:?})",
            16 / elem
        )));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<T: CudaElement>(
    dev: &Device,
    f: &CudaFunction,
    variant: &Variant,
    g: &Geometry<'_>,
    q: &DeviceTensor<'_, T>,
    k: &DeviceTensor<'_, T>,
    v: &DeviceTensor<'_, T>,
    out: &mut DeviceTensorMut<'_, T>,
    o_layout: RowLayout,
    lse: &mut cudarc::driver::CudaViewMut<'_, f32>,
) -> Result<()> {
    let stream = dev.stream();
    if g.seqs.is_empty() || g.total_q == 0 {
        return Ok(());
    }
    let br = variant.block_rows();
    let num_m_blocks = g.max_sq.div_ceil(br);
    let heads = g.seqs.len() * g.hq;
    let blocks = num_m_blocks.checked_mul(heads).filter(|&b| b <= i32::MAX as usize);
    let Some(blocks) = blocks else {
        return Err(Error::Unsupported(format!("{num_m_blocks} query tiles x {heads} heads is too large a grid")));
    };

    let cu = if g.varlen {
        let mut cq = Vec::with_capacity(g.seqs.len() + 1);
        let mut ck = Vec::with_capacity(g.seqs.len() + 1);
        cq.push(0i32);
        ck.push(0i32);
        for s in &g.seqs {
            cq.push(i32_of("cu_seqlens_q", s.q_start + s.sq)?);
            ck.push(i32_of("cu_seqlens_k", s.k_start + s.sk)?);
        }
        cq.extend(ck);
        Some(stream.clone_htod(&cq).map_err(|e| driver_error("upload cu_seqlens", e))?)
    } else {
        None
    };

    let elem = std::mem::size_of::<T>();
    let (qp, _q_sync) = q.data.device_ptr(stream);
    let (kp, _k_sync) = k.data.device_ptr(stream);
    let (vp, _v_sync) = v.data.device_ptr(stream);
    let (op, _o_sync) = out.data.device_ptr_mut(stream);
    let (lp, _l_sync) = lse.device_ptr_mut(stream);
    check_alignment("q", qp, &g.q, elem)?;
    check_alignment("k", kp, &g.k, elem)?;
    check_alignment("v", vp, &g.v, elem)?;
    check_alignment("out", op, &o_layout, elem)?;
    let (cq, ck, _cu_sync) = match &cu {
        Some(c) => {
            let (p, s) = c.device_ptr(stream);
            (p, p + 4 * (g.seqs.len() as u64 + 1), Some(s))
        }
        None => (0, 0, None),
    };

    let (lse_batch, lse_head) = if g.varlen { (0, g.total_q) } else { (g.hq * g.max_sq, g.max_sq) };
    let (window_left, window_right) = g.window.map_or((-1, -1), |(l, r)| (window_side(l), window_side(r)));
    let params = FwdParams {
        q: qp,
        k: kp,
        v: vp,
        o: op,
        lse: lp,
        cu_seqlens_q: cq,
        cu_seqlens_k: ck,
        q_batch: g.q.batch_stride as i64,
        q_row: g.q.token_stride as i64,
        q_head: g.q.head_stride as i64,
        k_batch: g.k.batch_stride as i64,
        k_row: g.k.token_stride as i64,
        k_head: g.k.head_stride as i64,
        v_batch: g.v.batch_stride as i64,
        v_row: g.v.token_stride as i64,
        v_head: g.v.head_stride as i64,
        o_batch: o_layout.batch_stride as i64,
        o_row: o_layout.token_stride as i64,
        o_head: o_layout.head_stride as i64,
        lse_batch: lse_batch as i64,
        lse_head: lse_head as i64,
        batch: i32_of("batch", g.seqs.len())?,
        hq: i32_of("hq", g.hq)?,
        group: i32_of("hq / hk", g.hq / g.hk)?,
        sq: i32_of("sq", g.max_sq)?,
        sk: i32_of("sk", g.max_sk)?,
        num_m_blocks: num_m_blocks as i32,
        causal: match g.causal {
            Causal::None => 0,
            Causal::BottomRight => 1,
            Causal::TopLeft => 2,
        },
        window_left,
        window_right,
        scale_log2: g.scale * std::f32::consts::LOG2_E,
        longest_first: i32::from(g.causal != Causal::None),
    };
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (variant.threads() as u32, 1, 1),
        shared_mem_bytes: variant.smem_bytes() as u32,
    };
    let mut builder = stream.launch_builder(f);
    builder.arg(&params);
    // SAFETY: the parameter block matches the kernel's `FwdParams`; every pointer in it is a live
    // device buffer checked (through `Geometry`) to hold every element the kernel touches, and
    // the sync guards above keep them ordered on this stream until the launch is enqueued.
    unsafe { builder.launch(cfg) }.map_err(|e| driver_error("launch flash_fwd", e))?;
    Ok(())
}
