//! Context parallelism on GPUs (DESIGN §8): the ring / zigzag schedule of [`crate::ring`] with
//! this backend's kernels for every step and `kernels/ring.cuh` for the merge, the `f32`
//! gradient accumulators and zigzag's half-chunk gathers.
//!
//! A rank's tensors are packed and contiguous: `q [t, hq, d]`, `k [t, hk, d]`, `v [t, hk, dv]`,
//! `out [t, hq, dv]`, `lse [hq, t]`, with the local `cu_seqlens` of its [`RingProblem`] (a
//! fixed-length batch is the varlen batch of equal lengths; [`crate::ring::Sharding`] cuts global
//! tensors into local ones).
//!
//! Two ways to run a ring:
//! - [`simulate_forward`] / [`simulate_backward`]: every rank on one GPU, in lockstep, each step
//!   reading the chunk of the rank it would have received (no transfers). The same step code as
//!   the real ring, tested on one GPU.
//! - With the `nccl` feature, [`NcclRing`] and [`Device::ring_forward`] /
//!   [`Device::ring_backward`]: one GPU a rank, chunks sent to the next rank by NCCL on a second
//!   stream while the current step computes.

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::{driver_error, CudaElement, Device, DeviceTensor, DeviceTensorMut};
use crate::dtype::DType;
use crate::error::Result;
use crate::ring::{schedule, RingProblem, Step};
use crate::{AttentionSpec, Gradients, Output, Tensor};

/// Field for field `MergeParams` in `kernels/ring.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct MergeParams {
    acc: u64,
    acc_lse: u64,
    part: u64,
    part_lse: u64,
    map: u64,
    t: i64,
    tp: i64,
    h: i64,
    dv: i64,
}

/// Field for field `RowsParams` in `kernels/ring.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct RowsParams {
    dst: u64,
    src: u64,
    map: u64,
    rows: i64,
    row: i64,
    t: i64,
}

// SAFETY: plain `repr(C)` structs of integers, laid out as the kernels' structs.
unsafe impl DeviceRepr for MergeParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for RowsParams {}

/// The loaded ring kernels of one dtype.
#[derive(Debug, Clone)]
pub(crate) struct RingFunctions {
    merge: CudaFunction,
    add: CudaFunction,
    gather: CudaFunction,
    gather_lse: CudaFunction,
    narrow: CudaFunction,
    fill: CudaFunction,
}

/// The ring kernels' program.
pub(crate) fn ring_source() -> &'static str {
    include_str!("kernels/ring.cuh")
}

/// NVRTC options for `dtype`.
pub(crate) fn ring_options(dtype: DType) -> Vec<String> {
    vec!["--std=c++17".into(), format!("-DRING_BF16={}", u8::from(dtype == DType::BF16))]
}

impl Device {
    /// The ring kernels for `dtype`, compiling (or reading the cache) on first use.
    pub(crate) fn ring_functions(&self, dtype: DType) -> Result<RingFunctions> {
        let mut map = self.ring_functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = map.get(&dtype) {
            return Ok(f.clone());
        }
        let module = self.load_module(&format!("ring_{}", dtype.name()), ring_source(), &ring_options(dtype))?;
        let load = |name: &str| module.load_function(name).map_err(|e| driver_error("cuModuleGetFunction", e));
        let f = RingFunctions {
            merge: load("ring_merge")?,
            add: load("ring_add")?,
            gather: load("ring_gather")?,
            gather_lse: load("ring_gather_lse")?,
            narrow: load("ring_narrow")?,
            fill: load("ring_fill_neg_inf")?,
        };
        map.insert(dtype, f.clone());
        Ok(f)
    }
}

fn launch<P: DeviceRepr>(dev: &Device, f: &CudaFunction, threads: usize, params: &P, what: &str) -> Result<()> {
    if threads == 0 {
        return Ok(());
    }
    // Every ring kernel grid-strides, so any grid covers the work.
    let blocks = threads.div_ceil(256).min(1 << 24) as u32;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let mut builder = dev.stream().launch_builder(f);
    builder.arg(params);
    // SAFETY: the parameter block matches the kernel's struct; its pointers are live device
    // buffers of the sizes the callers below compute from the validated problem, and the kernels
    // index only below `rows · row` (or `tp · h · dv`) and through maps of valid local rows.
    unsafe { builder.launch(cfg) }.map(|_| ()).map_err(|e| driver_error(what, e))
}

fn i64_of(x: usize) -> i64 {
    x as i64
}

fn alloc<T: CudaElement>(dev: &Device, n: usize) -> Result<CudaSlice<T>> {
    dev.stream().alloc_zeros::<T>(n.max(1)).map_err(|e| driver_error("ring scratch", e))
}

/// A buffer whose elements every user writes before reading them (each use below says why).
fn scratch<X: DeviceRepr>(dev: &Device, n: usize) -> Result<CudaSlice<X>> {
    // SAFETY: the memory is left unset; the callers write every element they later read.
    unsafe { dev.stream().alloc::<X>(n.max(1)) }.map_err(|e| driver_error("ring scratch", e))
}

fn alloc_f32(dev: &Device, n: usize) -> Result<CudaSlice<f32>> {
    dev.stream().alloc_zeros::<f32>(n.max(1)).map_err(|e| driver_error("ring scratch", e))
}

/// One rank's step machinery: the problem, its kernels, and the half-chunk row maps.
struct Rank<'a> {
    dev: &'a Device,
    f: RingFunctions,
    p: &'a RingProblem,
    rank: usize,
    half_cu: Vec<i32>,
    first: CudaSlice<i32>,
    second: CudaSlice<i32>,
}

/// Forward scratch of a rank: the running `f32` result and one step's partial one.
struct FwdState<T> {
    acc: CudaSlice<f32>,
    acc_lse: CudaSlice<f32>,
    part: CudaSlice<T>,
    part_lse: CudaSlice<f32>,
    qh: CudaSlice<T>,
    kh: CudaSlice<T>,
    vh: CudaSlice<T>,
}

/// Backward scratch of a rank: the `f32` `dq` accumulator, a step's gradients, half buffers.
struct BwdState<T> {
    dq: CudaSlice<f32>,
    part_dq: CudaSlice<T>,
    part_dk: CudaSlice<T>,
    part_dv: CudaSlice<T>,
    qh: CudaSlice<T>,
    kh: CudaSlice<T>,
    vh: CudaSlice<T>,
    oh: CudaSlice<T>,
    doh: CudaSlice<T>,
    lh: CudaSlice<f32>,
}

/// A rank's local inputs of the backward.
struct BwdInputs<'v, T> {
    q: CudaView<'v, T>,
    out: CudaView<'v, T>,
    lse: CudaView<'v, f32>,
    dout: CudaView<'v, T>,
}

impl<'a> Rank<'a> {
    fn new<T: CudaElement>(dev: &'a Device, p: &'a RingProblem, rank: usize) -> Result<Self> {
        let f = dev.ring_functions(T::DTYPE)?;
        let map = |second: bool| -> Result<CudaSlice<i32>> {
            let mut rows = Vec::with_capacity(p.tokens() / 2);
            for (local, _, len) in p.half_runs(second) {
                rows.extend((local..local + len).map(|r| r as i32));
            }
            if rows.is_empty() {
                rows.push(0);
            }
            dev.stream().clone_htod(&rows).map_err(|e| driver_error("ring row map", e))
        };
        Ok(Rank { dev, f, p, rank, half_cu: p.half_cu(), first: map(false)?, second: map(true)? })
    }

    fn tokens(&self) -> usize {
        self.p.tokens()
    }

    fn gather<T: CudaElement>(
        &self,
        dst: &mut CudaSlice<T>,
        src: &CudaView<'_, T>,
        second: bool,
        row: usize,
    ) -> Result<()> {
        let s = self.dev.stream();
        let map = if second { &self.second } else { &self.first };
        let rows = self.tokens() / 2;
        let params = RowsParams {
            dst: dst.device_ptr_mut(s).0,
            src: src.device_ptr(s).0,
            map: map.device_ptr(s).0,
            rows: i64_of(rows),
            row: i64_of(row),
            t: i64_of(self.tokens()),
        };
        launch(self.dev, &self.f.gather, rows * row, &params, "ring_gather")
    }

    /// `acc (+)= part` over `rows` part rows of `row` elements, through a half map or not.
    fn add<T: CudaElement>(
        &self,
        acc: &mut CudaSlice<f32>,
        part: &CudaSlice<T>,
        map: Option<bool>,
        row: usize,
    ) -> Result<()> {
        let s = self.dev.stream();
        let rows = if map.is_some() { self.tokens() / 2 } else { self.tokens() };
        let params = RowsParams {
            dst: acc.device_ptr_mut(s).0,
            src: part.device_ptr(s).0,
            map: match map {
                None => 0,
                Some(second) => (if second { &self.second } else { &self.first }).device_ptr(s).0,
            },
            rows: i64_of(rows),
            row: i64_of(row),
            t: i64_of(self.tokens()),
        };
        launch(self.dev, &self.f.add, rows * row, &params, "ring_add")
    }

    /// Forward scratch for this rank's problem: `acc` is written by the first merge of every row
    /// (every row sees at least its own key at step 0, and a merge into `acc_lse = -inf` copies),
    /// the part buffers by each step's forward, the halves by their gathers.
    fn fwd_state<T: CudaElement>(&self) -> Result<FwdState<T>> {
        let (t, p) = (self.tokens(), self.p);
        let zig = p.layout == crate::ring::Layout::Zigzag && p.causal;
        let h = if zig { t / 2 } else { 0 };
        let mut st = FwdState {
            acc: scratch(self.dev, t * p.hq * p.dv)?,
            acc_lse: scratch(self.dev, p.hq * t)?,
            part: scratch(self.dev, t * p.hq * p.dv)?,
            part_lse: scratch(self.dev, p.hq * t)?,
            qh: scratch(self.dev, h * p.hq * p.d)?,
            kh: scratch(self.dev, h * p.hk * p.d)?,
            vh: scratch(self.dev, h * p.hk * p.dv)?,
        };
        self.fwd_reset(&mut st)?;
        Ok(st)
    }

    /// Empties the running result (`acc_lse = -inf`: no key seen).
    fn fwd_reset<T: CudaElement>(&self, st: &mut FwdState<T>) -> Result<()> {
        let (t, p) = (self.tokens(), self.p);
        let s = self.dev.stream();
        let fill = RowsParams {
            dst: st.acc_lse.device_ptr_mut(s).0,
            rows: i64_of(t),
            row: i64_of(p.hq),
            ..Default::default()
        };
        launch(self.dev, &self.f.fill, t * p.hq, &fill, "ring_fill_neg_inf")
    }

    fn merge<T: CudaElement>(&self, st: &mut FwdState<T>, second: Option<bool>) -> Result<()> {
        let s = self.dev.stream();
        let (t, p) = (self.tokens(), self.p);
        let tp = if second.is_some() { t / 2 } else { t };
        let params = MergeParams {
            acc: st.acc.device_ptr_mut(s).0,
            acc_lse: st.acc_lse.device_ptr_mut(s).0,
            part: st.part.device_ptr(s).0,
            part_lse: st.part_lse.device_ptr(s).0,
            map: if second.is_some() { self.second.device_ptr(s).0 } else { 0 },
            t: i64_of(t),
            tp: i64_of(tp),
            h: i64_of(p.hq),
            dv: i64_of(p.dv),
        };
        launch(self.dev, &self.f.merge, tp * p.hq * 32, &params, "ring_merge")
    }

    /// Enqueues step `step` of the forward with the chunk `k`, `v` held then.
    fn forward_step<T: CudaElement>(
        &self,
        step: usize,
        q: &CudaView<'_, T>,
        k: &CudaView<'_, T>,
        v: &CudaView<'_, T>,
        st: &mut FwdState<T>,
    ) -> Result<()> {
        let (t, p) = (self.tokens(), self.p);
        let t2 = t / 2;
        let work = schedule(p.layout, p.causal, p.ranks, self.rank, step);
        let (qs, ks, vs, os) = ([t, p.hq, p.d], [t, p.hk, p.d], [t, p.hk, p.dv], [t, p.hq, p.dv]);
        match work {
            Step::Skip => Ok(()),
            Step::Full | Step::Diagonal => {
                let spec = p.step_spec(work, &p.cu, &p.cu);
                self.dev.forward(
                    &spec,
                    &DeviceTensor::new(q.slice(..), &qs),
                    &DeviceTensor::new(k.slice(..), &ks),
                    &DeviceTensor::new(v.slice(..), &vs),
                    &mut DeviceTensorMut::new(st.part.slice_mut(..t * p.hq * p.dv), &os),
                    &mut st.part_lse.slice_mut(..p.hq * t),
                )?;
                self.merge(st, None)
            }
            Step::KeysFirstHalf => {
                self.gather(&mut st.kh, k, false, p.hk * p.d)?;
                self.gather(&mut st.vh, v, false, p.hk * p.dv)?;
                let spec = p.step_spec(work, &p.cu, &self.half_cu);
                self.dev.forward(
                    &spec,
                    &DeviceTensor::new(q.slice(..), &qs),
                    &DeviceTensor::new(st.kh.slice(..t2 * p.hk * p.d), &[t2, p.hk, p.d]),
                    &DeviceTensor::new(st.vh.slice(..t2 * p.hk * p.dv), &[t2, p.hk, p.dv]),
                    &mut DeviceTensorMut::new(st.part.slice_mut(..t * p.hq * p.dv), &os),
                    &mut st.part_lse.slice_mut(..p.hq * t),
                )?;
                self.merge(st, None)
            }
            Step::QueriesSecondHalf => {
                self.gather(&mut st.qh, q, true, p.hq * p.d)?;
                let spec = p.step_spec(work, &self.half_cu, &p.cu);
                self.dev.forward(
                    &spec,
                    &DeviceTensor::new(st.qh.slice(..t2 * p.hq * p.d), &[t2, p.hq, p.d]),
                    &DeviceTensor::new(k.slice(..), &ks),
                    &DeviceTensor::new(v.slice(..), &vs),
                    &mut DeviceTensorMut::new(st.part.slice_mut(..t2 * p.hq * p.dv), &[t2, p.hq, p.dv]),
                    &mut st.part_lse.slice_mut(..p.hq * t2),
                )?;
                self.merge(st, Some(true))
            }
        }
    }

    /// Writes the running result into `out` (narrowed) and `lse`.
    fn forward_finish<T: CudaElement>(
        &self,
        st: &FwdState<T>,
        out: &mut CudaSlice<T>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let s = self.dev.stream();
        let (t, p) = (self.tokens(), self.p);
        let n = t * p.hq * p.dv;
        let params = RowsParams {
            dst: out.device_ptr_mut(s).0,
            src: st.acc.device_ptr(s).0,
            rows: i64_of(t),
            row: i64_of(p.hq * p.dv),
            ..Default::default()
        };
        launch(self.dev, &self.f.narrow, n, &params, "ring_narrow")?;
        s.memcpy_dtod(&st.acc_lse.slice(..p.hq * t), &mut lse.slice_mut(..p.hq * t))
            .map_err(|e| driver_error("ring lse copy", e))
    }

    /// Backward scratch: `dq` is zeroed here (and by [`Rank::bwd_reset`]); the part buffers are
    /// written by each step's backward, the halves by their gathers.
    fn bwd_state<T: CudaElement>(&self) -> Result<BwdState<T>> {
        let (t, p) = (self.tokens(), self.p);
        let zig = p.layout == crate::ring::Layout::Zigzag && p.causal;
        let h = if zig { t / 2 } else { 0 };
        Ok(BwdState {
            dq: alloc_f32(self.dev, t * p.hq * p.d)?,
            part_dq: scratch(self.dev, t * p.hq * p.d)?,
            part_dk: scratch(self.dev, t * p.hk * p.d)?,
            part_dv: scratch(self.dev, t * p.hk * p.dv)?,
            qh: scratch(self.dev, h * p.hq * p.d)?,
            kh: scratch(self.dev, h * p.hk * p.d)?,
            vh: scratch(self.dev, h * p.hk * p.dv)?,
            oh: scratch(self.dev, h * p.hq * p.dv)?,
            doh: scratch(self.dev, h * p.hq * p.dv)?,
            lh: scratch(self.dev, h * p.hq)?,
        })
    }

    /// Zeroes the `dq` accumulator for another call.
    fn bwd_reset<T: CudaElement>(&self, st: &mut BwdState<T>) -> Result<()> {
        self.dev.stream().memset_zeros(&mut st.dq).map_err(|e| driver_error("cuMemsetD8", e))
    }

    /// Enqueues step `step` of the backward with the chunk `k`, `v` held then: the step's
    /// gradients into `st`'s part buffers. Returns which rows [`Rank::backward_add`] adds them to
    /// (`None`: nothing computed).
    fn backward_compute<T: CudaElement>(
        &self,
        step: usize,
        ins: &BwdInputs<'_, T>,
        k: &CudaView<'_, T>,
        v: &CudaView<'_, T>,
        st: &mut BwdState<T>,
    ) -> Result<Option<Step>> {
        let (t, p) = (self.tokens(), self.p);
        let t2 = t / 2;
        let work = schedule(p.layout, p.causal, p.ranks, self.rank, step);
        let (qs, ks, vs, os) = ([t, p.hq, p.d], [t, p.hk, p.d], [t, p.hk, p.dv], [t, p.hq, p.dv]);
        let (rq, rk, rv, ro) = (p.hq * p.d, p.hk * p.d, p.hk * p.dv, p.hq * p.dv);
        match work {
            Step::Skip => return Ok(None),
            Step::Full | Step::Diagonal => {
                let spec = p.step_spec(work, &p.cu, &p.cu);
                self.dev.backward(
                    &spec,
                    &DeviceTensor::new(ins.q.slice(..), &qs),
                    &DeviceTensor::new(k.slice(..), &ks),
                    &DeviceTensor::new(v.slice(..), &vs),
                    &DeviceTensor::new(ins.out.slice(..), &os),
                    &ins.lse.slice(..),
                    &DeviceTensor::new(ins.dout.slice(..), &os),
                    &mut DeviceTensorMut::new(st.part_dq.slice_mut(..t * rq), &qs),
                    &mut DeviceTensorMut::new(st.part_dk.slice_mut(..t * rk), &ks),
                    &mut DeviceTensorMut::new(st.part_dv.slice_mut(..t * rv), &vs),
                )?;
            }
            Step::KeysFirstHalf => {
                self.gather(&mut st.kh, k, false, rk)?;
                self.gather(&mut st.vh, v, false, rv)?;
                let spec = p.step_spec(work, &p.cu, &self.half_cu);
                self.dev.backward(
                    &spec,
                    &DeviceTensor::new(ins.q.slice(..), &qs),
                    &DeviceTensor::new(st.kh.slice(..t2 * rk), &[t2, p.hk, p.d]),
                    &DeviceTensor::new(st.vh.slice(..t2 * rv), &[t2, p.hk, p.dv]),
                    &DeviceTensor::new(ins.out.slice(..), &os),
                    &ins.lse.slice(..),
                    &DeviceTensor::new(ins.dout.slice(..), &os),
                    &mut DeviceTensorMut::new(st.part_dq.slice_mut(..t * rq), &qs),
                    &mut DeviceTensorMut::new(st.part_dk.slice_mut(..t2 * rk), &[t2, p.hk, p.d]),
                    &mut DeviceTensorMut::new(st.part_dv.slice_mut(..t2 * rv), &[t2, p.hk, p.dv]),
                )?;
            }
            Step::QueriesSecondHalf => {
                self.gather(&mut st.qh, &ins.q, true, rq)?;
                self.gather(&mut st.oh, &ins.out, true, ro)?;
                self.gather(&mut st.doh, &ins.dout, true, ro)?;
                let s = self.dev.stream();
                let params = RowsParams {
                    dst: st.lh.device_ptr_mut(s).0,
                    src: ins.lse.device_ptr(s).0,
                    map: self.second.device_ptr(s).0,
                    rows: i64_of(t2),
                    row: i64_of(p.hq),
                    t: i64_of(t),
                };
                launch(self.dev, &self.f.gather_lse, t2 * p.hq, &params, "ring_gather_lse")?;
                let spec = p.step_spec(work, &self.half_cu, &p.cu);
                let hs_o = [t2, p.hq, p.dv];
                self.dev.backward(
                    &spec,
                    &DeviceTensor::new(st.qh.slice(..t2 * rq), &[t2, p.hq, p.d]),
                    &DeviceTensor::new(k.slice(..), &ks),
                    &DeviceTensor::new(v.slice(..), &vs),
                    &DeviceTensor::new(st.oh.slice(..t2 * ro), &hs_o),
                    &st.lh.slice(..t2 * p.hq),
                    &DeviceTensor::new(st.doh.slice(..t2 * ro), &hs_o),
                    &mut DeviceTensorMut::new(st.part_dq.slice_mut(..t2 * rq), &[t2, p.hq, p.d]),
                    &mut DeviceTensorMut::new(st.part_dk.slice_mut(..t * rk), &ks),
                    &mut DeviceTensorMut::new(st.part_dv.slice_mut(..t * rv), &vs),
                )?;
            }
        }
        Ok(Some(work))
    }

    /// Adds the gradients of a step that [`Rank::backward_compute`] ran (`work`) into `st.dq`
    /// and the chunk's travelling accumulators `dk`, `dv`.
    fn backward_add<T: CudaElement>(
        &self,
        work: Option<Step>,
        st: &mut BwdState<T>,
        dk: &mut CudaSlice<f32>,
        dv: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let p = self.p;
        let (rq, rk, rv) = (p.hq * p.d, p.hk * p.d, p.hk * p.dv);
        let (dq_map, kv_map) = match work {
            None | Some(Step::Skip) => return Ok(()),
            Some(Step::Full | Step::Diagonal) => (None, None),
            Some(Step::KeysFirstHalf) => (None, Some(false)),
            Some(Step::QueriesSecondHalf) => (Some(true), None),
        };
        self.add(&mut st.dq, &st.part_dq, dq_map, rq)?;
        self.add(dk, &st.part_dk, kv_map, rk)?;
        self.add(dv, &st.part_dv, kv_map, rv)
    }

    fn narrow<T: CudaElement>(&self, dst: &mut CudaSlice<T>, src: &CudaSlice<f32>, n: usize) -> Result<()> {
        let s = self.dev.stream();
        let params = RowsParams {
            dst: dst.device_ptr_mut(s).0,
            src: src.device_ptr(s).0,
            rows: i64_of(n),
            row: 1,
            ..Default::default()
        };
        launch(self.dev, &self.f.narrow, n, &params, "ring_narrow")
    }
}

/// Ring attention forward with `ranks` ranks simulated on one GPU (see the [module docs](self)):
/// global host tensors in, as [`crate::forward`] takes them, global `out` and `lse` back.
pub fn simulate_forward<T: CudaElement>(
    dev: &Device,
    spec: &AttentionSpec<'_>,
    layout: crate::ring::Layout,
    ranks: usize,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
) -> Result<Output<T>> {
    let split = crate::ring::sim::Split::new(spec, layout, ranks, q, k, v)?;
    let g = &split.g;
    let p = &split.problems[0];
    let t_of = |r: usize| split.tokens[r].len();
    let upload = |x: Vec<T>| dev.stream().clone_htod(&x).map_err(|e| driver_error("upload", e));
    let mut qs = Vec::with_capacity(ranks);
    let mut ks = Vec::with_capacity(ranks);
    let mut vs = Vec::with_capacity(ranks);
    for r in 0..ranks {
        qs.push(upload(split.shard(r, q.data(), &g.q, g.hq, g.d, false))?);
        ks.push(upload(split.shard(r, k.data(), &g.k, g.hk, g.d, true))?);
        vs.push(upload(split.shard(r, v.data(), &g.v, g.hk, g.dv, true))?);
    }
    let rank_of: Vec<Rank<'_>> = (0..ranks).map(|r| Rank::new::<T>(dev, p, r)).collect::<Result<_>>()?;
    let mut states: Vec<FwdState<T>> = rank_of.iter().map(|r| r.fwd_state()).collect::<Result<_>>()?;
    if p.tokens() > 0 {
        for step in 0..ranks {
            for (r, rk) in rank_of.iter().enumerate() {
                let src = crate::ring::kv_source(ranks, r, step);
                rk.forward_step(step, &qs[r].slice(..), &ks[src].slice(..), &vs[src].slice(..), &mut states[r])?;
            }
        }
    }
    let mut out = vec![T::default(); g.total_q * g.hq * g.dv];
    let mut lse = vec![f32::NEG_INFINITY; g.lse_len()];
    for (r, (rk, st)) in rank_of.iter().zip(&states).enumerate() {
        let t = t_of(r);
        if t == 0 {
            continue;
        }
        let mut o = alloc::<T>(dev, t * g.hq * g.dv)?;
        let mut l = alloc_f32(dev, g.hq * t)?;
        rk.forward_finish(st, &mut o, &mut l)?;
        let ho = dev.stream().clone_dtoh(&o.slice(..t * g.hq * g.dv)).map_err(|e| driver_error("download", e))?;
        let hl = dev.stream().clone_dtoh(&l.slice(..g.hq * t)).map_err(|e| driver_error("download", e))?;
        split.unshard(r, &ho, &mut out, g.hq, g.dv, false);
        split.unshard_lse(r, &hl, &mut lse);
    }
    Ok(Output { out, out_shape: g.out_shape(), lse, lse_shape: g.lse_shape() })
}

/// Ring attention backward with `ranks` ranks simulated on one GPU: global host tensors in, as
/// [`crate::backward`] takes them, global gradients back.
#[allow(clippy::too_many_arguments)]
pub fn simulate_backward<T: CudaElement>(
    dev: &Device,
    spec: &AttentionSpec<'_>,
    layout: crate::ring::Layout,
    ranks: usize,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    out: &Tensor<'_, T>,
    lse: &[f32],
    dout: &Tensor<'_, T>,
) -> Result<Gradients<T>> {
    let split = crate::ring::sim::Split::new(spec, layout, ranks, q, k, v)?;
    let g = &split.g;
    let out_layout = g.check_input_like("out", out, &g.out_shape(), true)?;
    let (_, dout_layout) = g.check_grad_input(dout)?;
    g.check_lse_len(lse.len())?;
    let p = &split.problems[0];
    let upload = |x: &[T]| dev.stream().clone_htod(x).map_err(|e| driver_error("upload", e));
    let upload_f32 = |x: &[f32]| dev.stream().clone_htod(x).map_err(|e| driver_error("upload", e));
    let mut ins = Vec::with_capacity(ranks);
    for r in 0..ranks {
        let shard = |data: &[T], layout, heads, dim, keys| split.shard(r, data, layout, heads, dim, keys);
        let one = |x: Vec<T>| if x.is_empty() { upload(&[T::default()]) } else { upload(&x) };
        ins.push((
            one(shard(q.data(), &g.q, g.hq, g.d, false))?,
            one(shard(k.data(), &g.k, g.hk, g.d, true))?,
            one(shard(v.data(), &g.v, g.hk, g.dv, true))?,
            one(shard(out.data(), &out_layout, g.hq, g.dv, false))?,
            upload_f32(&{
                let l = split.shard_lse(r, lse);
                if l.is_empty() {
                    vec![0.0]
                } else {
                    l
                }
            })?,
            one(shard(dout.data(), &dout_layout, g.hq, g.dv, false))?,
        ));
    }
    let rank_of: Vec<Rank<'_>> = (0..ranks).map(|r| Rank::new::<T>(dev, p, r)).collect::<Result<_>>()?;
    let mut states: Vec<BwdState<T>> = rank_of.iter().map(|r| r.bwd_state()).collect::<Result<_>>()?;
    let t = p.tokens();
    // The chunk accumulators: in the real ring they travel; here rank r adds into its source's.
    let mut dks: Vec<CudaSlice<f32>> = (0..ranks).map(|_| alloc_f32(dev, t * g.hk * g.d)).collect::<Result<_>>()?;
    let mut dvs: Vec<CudaSlice<f32>> = (0..ranks).map(|_| alloc_f32(dev, t * g.hk * g.dv)).collect::<Result<_>>()?;
    if t > 0 {
        for step in 0..ranks {
            for (r, rk) in rank_of.iter().enumerate() {
                let src = crate::ring::kv_source(ranks, r, step);
                let (qd, _, _, od, ld, dod) = &ins[r];
                let inputs = BwdInputs {
                    q: qd.slice(..t * g.hq * g.d),
                    out: od.slice(..t * g.hq * g.dv),
                    lse: ld.slice(..g.hq * t),
                    dout: dod.slice(..t * g.hq * g.dv),
                };
                let (kd, vd) = (&ins[src].1, &ins[src].2);
                let work = rk.backward_compute(
                    step,
                    &inputs,
                    &kd.slice(..t * g.hk * g.d),
                    &vd.slice(..t * g.hk * g.dv),
                    &mut states[r],
                )?;
                rk.backward_add(work, &mut states[r], &mut dks[src], &mut dvs[src])?;
            }
        }
    }
    let mut dq = vec![T::default(); g.total_q * g.hq * g.d];
    let mut dk = vec![T::default(); g.total_k * g.hk * g.d];
    let mut dv = vec![T::default(); g.total_k * g.hk * g.dv];
    if t > 0 {
        for (r, rk) in rank_of.iter().enumerate() {
            let down = |src: &CudaSlice<f32>, n: usize| -> Result<Vec<T>> {
                let mut o = alloc::<T>(dev, n)?;
                rk.narrow(&mut o, src, n)?;
                dev.stream().clone_dtoh(&o.slice(..n)).map_err(|e| driver_error("download", e))
            };
            let ldq = down(&states[r].dq, t * g.hq * g.d)?;
            let ldk = down(&dks[r], t * g.hk * g.d)?;
            let ldv = down(&dvs[r], t * g.hk * g.dv)?;
            split.unshard(r, &ldq, &mut dq, g.hq, g.d, false);
            split.unshard(r, &ldk, &mut dk, g.hk, g.d, true);
            split.unshard(r, &ldv, &mut dv, g.hk, g.dv, true);
        }
    }
    Ok(Gradients { dq, dq_shape: g.q_shape(g.d), dk, dk_shape: g.k_shape(g.d), dv, dv_shape: g.k_shape(g.dv) })
}

#[cfg(feature = "nccl")]
pub use nccl::{NcclRing, RingPass, StepTime};

#[cfg(feature = "nccl")]
mod nccl {
    //! The ring over NCCL: a rank a GPU.

    use std::any::Any;
    use std::sync::{Arc, Mutex};

    use cudarc::driver::sys::CUevent_flags;
    use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut};
    use cudarc::nccl::safe::{group_end, group_start, Comm, Id, NcclType};

    use super::{alloc_f32, driver_error, scratch, BwdInputs, BwdState, CudaElement, Device, FwdState, Rank};
    use crate::error::{Error, Result};
    use crate::ring::RingProblem;

    fn nccl_error(what: &str, e: impl std::fmt::Debug) -> Error {
        Error::CudaLaunch(format!("NCCL {what}: {e:?}"))
    }

    /// Whether the NCCL library (`libnccl.so`, or a versioned name cudarc looks for) can be
    /// loaded. NCCL's PyPI wheel ships `libnccl.so.2` only: link `libnccl.so` to it in a folder on
    /// `LD_LIBRARY_PATH`.
    pub fn nccl_available() -> Result<()> {
        // SAFETY: only tries to dlopen the library by its candidate names.
        if unsafe { cudarc::nccl::sys::is_culib_present() } {
            Ok(())
        } else {
            Err(Error::CudaUnavailable("the NCCL library (libnccl.so) was not found on the library path".into()))
        }
    }

    /// One rank's end of a ring: an NCCL communicator and the stream its transfers run on.
    #[derive(Debug)]
    pub struct NcclRing {
        comm: Comm,
        comm_stream: Arc<CudaStream>,
        rank: usize,
        ranks: usize,
        transfers: bool,
        /// With step timing on ([`NcclRing::set_step_timing`]), the intervals recorded so far.
        timing: Option<Mutex<TimingLog>>,
        /// Buffers of the last forward and backward call, reused by the next call of the same
        /// problem on the same stream (a `FwdCache<T>` / `BwdCache<T>`).
        fwd_cache: Mutex<Option<Box<dyn Any + Send>>>,
        bwd_cache: Mutex<Option<Box<dyn Any + Send>>>,
    }

    /// What a cache entry was built for: the problem and the compute stream.
    type CacheKey = (RingProblem, usize);

    /// A chunk's key and value buffers.
    type Chunk<T> = (CudaSlice<T>, CudaSlice<T>);

    /// Which pass of a ring call a [`StepTime`] belongs to.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum RingPass {
        /// [`Device::ring_forward`].
        Forward,
        /// [`Device::ring_backward`].
        Backward,
    }

    /// Where one step of one rank's ring call spent its time, measured with CUDA events (with
    /// [`NcclRing::set_step_timing`] on).
    ///
    /// A step's transfer is hidden when `wait_ms` is (close to) 0 while `transfer_ms` is not:
    /// the transfer ran on its own stream during the step's compute, and the compute stream
    /// never stood waiting for it.
    #[derive(Clone, Copy, Debug, PartialEq)]
    pub struct StepTime {
        /// The pass.
        pub pass: RingPass,
        /// The step, `0..ranks`.
        pub step: usize,
        /// On the compute stream: the step's attention kernels and merge (forward), or its
        /// gradient kernels and the adding into the visiting chunk's dK/dV (backward).
        pub compute_ms: f32,
        /// On the transfer stream: the sends and receives this step issued (the next chunk; in
        /// the backward also the dK/dV accumulators), from when they could start to when they
        /// ended. It includes any time NCCL waited for the neighbouring ranks.
        pub transfer_ms: f32,
        /// On the compute stream: the time it stood still waiting for a transfer.
        pub wait_ms: f32,
    }

    /// What a timed interval measured.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Phase {
        Compute,
        Transfer,
        Wait,
    }

    /// The intervals recorded with step timing on, and how many ring calls have begun.
    #[derive(Debug, Default)]
    struct TimingLog {
        calls: usize,
        intervals: Vec<Interval>,
    }

    /// A timed interval of a ring call: two events on one stream.
    #[derive(Debug)]
    struct Interval {
        call: usize,
        pass: RingPass,
        step: usize,
        phase: Phase,
        start: CudaEvent,
        end: CudaEvent,
    }

    struct FwdCache<T> {
        key: CacheKey,
        st: FwdState<T>,
        /// The two receive buffers, alternating; received into before they are read.
        bufs: [Chunk<T>; 2],
    }

    struct BwdCache<T> {
        key: CacheKey,
        st: BwdState<T>,
        bufs: [Chunk<T>; 2],
        /// dK/dV accumulators: the pair being added to and the pair arriving (zeroed per call).
        acc: [(CudaSlice<f32>, CudaSlice<f32>); 2],
    }

    /// The cached entry of type `X` for `key`, if the slot holds one.
    fn take_cached<X: 'static>(
        slot: &Mutex<Option<Box<dyn Any + Send>>>,
        key: &CacheKey,
        key_of: impl Fn(&X) -> &CacheKey,
    ) -> Option<X> {
        let entry = slot.lock().unwrap_or_else(|p| p.into_inner()).take()?;
        let x = entry.downcast::<X>().ok()?;
        (key_of(&x) == key).then_some(*x)
    }

    // SAFETY: an NCCL communicator is not bound to the thread that created it; an `NcclRing` is
    // used through `&self` by whichever one thread owns it (it is not `Sync`), so moving it to
    // another thread (a thread per GPU after `for_devices`) is sound.
    unsafe impl Send for NcclRing {}

    impl NcclRing {
        /// A new NCCL unique id (on one rank; pass its 128 bytes to the others, e.g. through a
        /// file or an environment variable).
        pub fn unique_id() -> Result<[u8; 128]> {
            nccl_available()?;
            let id = Id::new().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
            // `c_char` is `i8` or `u8` by target: the bytes as they are.
            #[allow(clippy::unnecessary_cast)]
            Ok(id.internal().map(|c| c as u8))
        }

        /// Joins the ring as `rank` of `ranks` (one process, or one thread, per GPU), with the id
        /// of [`NcclRing::unique_id`].
        pub fn new(dev: &Device, rank: usize, ranks: usize, id: [u8; 128]) -> Result<Self> {
            nccl_available()?;
            if rank >= ranks {
                return Err(Error::Unsupported(format!("rank {rank} of a ring of {ranks}")));
            }
            let comm_stream = dev.stream().fork().map_err(|e| driver_error("cuStreamCreate", e))?;
            let comm = Comm::from_rank(comm_stream.clone(), rank, ranks, Id::uninit(id.map(|c| c as std::ffi::c_char)))
                .map_err(|e| nccl_error("ncclCommInitRank", e))?;
            Ok(NcclRing {
                comm,
                comm_stream,
                rank,
                ranks,
                transfers: true,
                timing: None,
                fwd_cache: Mutex::default(),
                bwd_cache: Mutex::default(),
            })
        }

        /// One communicator per device, all in this process (`ncclCommInitAll`): rank `i` is
        /// `devices[i]`. Drive each rank from its own thread.
        pub fn for_devices(devices: &[&Device]) -> Result<Vec<NcclRing>> {
            nccl_available()?;
            let streams: Vec<Arc<CudaStream>> = devices
                .iter()
                .map(|d| d.stream().fork().map_err(|e| driver_error("cuStreamCreate", e)))
                .collect::<Result<_>>()?;
            let comms = Comm::from_devices(streams.clone()).map_err(|e| nccl_error("ncclCommInitAll", e))?;
            let ranks = comms.len();
            Ok(comms
                .into_iter()
                .zip(streams)
                .enumerate()
                .map(|(rank, (comm, comm_stream))| NcclRing {
                    comm,
                    comm_stream,
                    rank,
                    ranks,
                    transfers: true,
                    timing: None,
                    fwd_cache: Mutex::default(),
                    bwd_cache: Mutex::default(),
                })
                .collect())
        }

        /// This rank.
        pub fn rank(&self) -> usize {
            self.rank
        }

        /// Ranks in the ring.
        pub fn ranks(&self) -> usize {
            self.ranks
        }

        /// For measurement only: with transfers off, nothing is sent or received, so every step
        /// attends to whatever the receive buffers hold and the results are wrong; a benchmark
        /// then sees the ring's compute alone, to compare with the ring with its transfers.
        pub fn set_transfers(&mut self, on: bool) {
            self.transfers = on;
        }

        /// Turns per-step timing on or off (off by default). While on, every ring call records
        /// CUDA events around each step's compute, transfers and waits (a few microseconds a
        /// step); [`NcclRing::take_step_times`] reads them. Turning it off drops what was recorded.
        pub fn set_step_timing(&mut self, on: bool) {
            self.timing = on.then(Mutex::default);
        }

        /// The step times recorded since step timing was turned on or last taken, in the order
        /// of the calls and steps (one [`StepTime`] per pass and step of each call), and clears
        /// them. Waits for the recorded work to finish. Empty when step timing is off.
        pub fn take_step_times(&self) -> Result<Vec<StepTime>> {
            let Some(log) = &self.timing else { return Ok(Vec::new()) };
            let intervals = std::mem::take(&mut log.lock().unwrap_or_else(|p| p.into_inner()).intervals);
            let mut out: Vec<StepTime> = Vec::new();
            let mut last = None;
            for iv in intervals {
                let ms = iv.start.elapsed_ms(&iv.end).map_err(|e| driver_error("cuEventElapsedTime", e))?;
                // A new entry when the call or step changes; a call's steps come in order.
                if last != Some((iv.call, iv.step)) {
                    last = Some((iv.call, iv.step));
                    out.push(StepTime {
                        pass: iv.pass,
                        step: iv.step,
                        compute_ms: 0.0,
                        transfer_ms: 0.0,
                        wait_ms: 0.0,
                    });
                }
                if let Some(t) = out.last_mut() {
                    match iv.phase {
                        Phase::Compute => t.compute_ms += ms,
                        Phase::Transfer => t.transfer_ms += ms,
                        Phase::Wait => t.wait_ms += ms,
                    }
                }
            }
            Ok(out)
        }

        /// With step timing on, counts a new ring call: its intervals are its own steps.
        fn begin_call(&self) {
            if let Some(log) = &self.timing {
                log.lock().unwrap_or_else(|p| p.into_inner()).calls += 1;
            }
        }

        /// With step timing on, an event recorded on `stream` now: the start of an interval.
        fn mark(&self, stream: &CudaStream) -> Result<Option<CudaEvent>> {
            if self.timing.is_none() {
                return Ok(None);
            }
            let ev = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
            ev.map(Some).map_err(|e| driver_error("cuEventRecord", e))
        }

        /// Ends the interval `start` (from [`NcclRing::mark`] on the same stream) now and keeps it.
        fn close(
            &self,
            start: Option<CudaEvent>,
            stream: &CudaStream,
            (pass, step, phase): (RingPass, usize, Phase),
        ) -> Result<()> {
            let (Some(start), Some(log)) = (start, &self.timing) else { return Ok(()) };
            let end = stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| driver_error("cuEventRecord", e))?;
            let mut log = log.lock().unwrap_or_else(|p| p.into_inner());
            let call = log.calls;
            log.intervals.push(Interval { call, pass, step, phase, start, end });
            Ok(())
        }

        /// Makes `compute` wait for `what` (an event on the transfer stream, or the transfer
        /// stream's work so far), timed as this step's wait.
        fn wait_for(&self, compute: &CudaStream, what: Await<'_>, at: (RingPass, usize)) -> Result<()> {
            let start = self.mark(compute)?;
            match what {
                Await::Event(ev) => compute.wait(ev),
                Await::Stream(s) => compute.join(s),
            }
            .map_err(|e| driver_error("cuStreamWaitEvent", e))?;
            self.close(start, compute, (at.0, at.1, Phase::Wait))
        }

        /// Enqueues on the transfer stream: each of `send` to the next rank, each of `recv` from
        /// the previous one, as one NCCL group.
        fn exchange<T: NcclType + cudarc::driver::DeviceRepr>(
            &self,
            send: &[&CudaView<'_, T>],
            recv: &mut [&mut CudaViewMut<'_, T>],
        ) -> Result<()> {
            if !self.transfers {
                return Ok(());
            }
            let next = ((self.rank + 1) % self.ranks) as i32;
            let prev = ((self.rank + self.ranks - 1) % self.ranks) as i32;
            group_start().map_err(|e| nccl_error("ncclGroupStart", e))?;
            let mut result = Ok(());
            for (s, r) in send.iter().zip(recv.iter_mut()) {
                if let Err(e) = self.comm.send(*s, next) {
                    result = Err(nccl_error("ncclSend", e));
                }
                if let Err(e) = self.comm.recv(*r, prev) {
                    result = Err(nccl_error("ncclRecv", e));
                }
            }
            group_end().map_err(|e| nccl_error("ncclGroupEnd", e))?;
            result
        }
    }

    /// Makes the compute stream wait for the transfer stream when dropped: declared after a
    /// call's buffers, it runs before they are freed (on the compute stream) on every return,
    /// an early error included, so no buffer is freed while NCCL may still write it.
    struct JoinOnDrop<'s> {
        compute: &'s Arc<CudaStream>,
        comm: &'s Arc<CudaStream>,
    }

    impl Drop for JoinOnDrop<'_> {
        fn drop(&mut self) {
            // An error here has nowhere to go; the stream is then broken for every later call.
            let _ = self.compute.join(self.comm);
        }
    }

    /// What the compute stream waits for in [`NcclRing::wait_for`].
    enum Await<'a> {
        Event(&'a CudaEvent),
        Stream(&'a CudaStream),
    }

    /// `(&pair[i], &mut pair[1 - i])`.
    fn split_pair<X>(pair: &mut [X; 2], i: usize) -> (&X, &mut X) {
        let [a, b] = pair;
        if i == 0 {
            (a, b)
        } else {
            (b, a)
        }
    }

    impl NcclRing {
        /// Enqueues on the transfer stream, after the compute stream's work so far (sends read
        /// what it produced or received; the receive buffer was last read by step − 1's compute):
        /// the chunk held at `step` (the caller's `k`, `v` at step 0, else `bufs[step % 2]`) to
        /// the next rank, and the next one from the previous rank into `bufs[(step + 1) % 2]`.
        fn pass_chunk<T: CudaElement + NcclType>(
            &self,
            dev: &Device,
            (pass, step): (RingPass, usize),
            (k, v): (&CudaView<'_, T>, &CudaView<'_, T>),
            bufs: &mut [Chunk<T>; 2],
            (kn, vn): (usize, usize),
        ) -> Result<()> {
            self.comm_stream.join(dev.stream()).map_err(|e| driver_error("cuStreamWaitEvent", e))?;
            let start = self.mark(&self.comm_stream)?;
            let (held_now, (nk, nv)) = split_pair(bufs, step % 2);
            let (mut nk, mut nv) = (nk.slice_mut(..kn), nv.slice_mut(..vn));
            if step == 0 {
                self.exchange(&[k, v], &mut [&mut nk, &mut nv])?;
            } else {
                let (ck, cv) = (held_now.0.slice(..kn), held_now.1.slice(..vn));
                self.exchange(&[&ck, &cv], &mut [&mut nk, &mut nv])?;
            }
            self.close(start, &self.comm_stream, (pass, step, Phase::Transfer))
        }
    }

    fn check_len(what: &'static str, got: usize, want: usize) -> Result<()> {
        if got != want {
            return Err(Error::BufferLength { tensor: what, expected: want, got });
        }
        Ok(())
    }

    impl Device {
        /// This rank's part of a ring forward over `ring` (NCCL): `q`, `k`, `v` packed and
        /// contiguous as the [module docs](super) say, `out [t, hq, dv]` and `lse [hq, t]`
        /// written. The chunk of step `s + 1` travels on the ring's stream while step `s`
        /// computes on this device's; all ranks must call it with the same problem.
        #[allow(clippy::too_many_arguments)]
        pub fn ring_forward<T: CudaElement + NcclType>(
            &self,
            ring: &NcclRing,
            p: &RingProblem,
            q: &CudaView<'_, T>,
            k: &CudaView<'_, T>,
            v: &CudaView<'_, T>,
            out: &mut CudaSlice<T>,
            lse: &mut CudaSlice<f32>,
        ) -> Result<()> {
            let t = p.tokens();
            if ring.ranks != p.ranks {
                return Err(Error::Unsupported(format!("a problem of {} ranks on a ring of {}", p.ranks, ring.ranks)));
            }
            check_len("q", q.len(), t * p.hq * p.d)?;
            check_len("k", k.len(), t * p.hk * p.d)?;
            check_len("v", v.len(), t * p.hk * p.dv)?;
            check_len("out", out.len(), t * p.hq * p.dv)?;
            check_len("lse", lse.len(), p.hq * t)?;
            let rank = Rank::new::<T>(self, p, ring.rank)?;
            let key: CacheKey = (p.clone(), self.stream().cu_stream() as usize);
            let mut cache = match take_cached::<FwdCache<T>>(&ring.fwd_cache, &key, |c| &c.key) {
                Some(mut c) => {
                    rank.fwd_reset(&mut c.st)?;
                    c
                }
                None => FwdCache {
                    key,
                    st: rank.fwd_state::<T>()?,
                    bufs: [
                        (scratch(self, t * p.hk * p.d)?, scratch(self, t * p.hk * p.dv)?),
                        (scratch(self, t * p.hk * p.d)?, scratch(self, t * p.hk * p.dv)?),
                    ],
                },
            };
            let FwdCache { st, bufs, .. } = &mut cache;
            ring.begin_call();
            let _in_flight = JoinOnDrop { compute: self.stream(), comm: &ring.comm_stream };
            let (kn, vn) = (t * p.hk * p.d, t * p.hk * p.dv);
            let cs = &ring.comm_stream;
            for step in 0..p.ranks {
                let last = step + 1 == p.ranks;
                // The chunk held now: the caller's at step 0, else the buffer received into.
                let cur = step % 2;
                let at = (RingPass::Forward, step);
                if !last && t > 0 {
                    ring.pass_chunk(self, at, (k, v), bufs, (kn, vn))?;
                }
                if t > 0 {
                    let start = ring.mark(self.stream())?;
                    if step == 0 {
                        rank.forward_step(step, q, k, v, st)?;
                    } else {
                        let (ck, cv) = (bufs[cur].0.slice(..kn), bufs[cur].1.slice(..vn));
                        rank.forward_step(step, q, &ck, &cv, st)?;
                    }
                    ring.close(start, self.stream(), (at.0, at.1, Phase::Compute))?;
                }
                if !last && t > 0 {
                    ring.wait_for(self.stream(), Await::Stream(cs), at)?;
                }
            }
            if t > 0 {
                rank.forward_finish(st, out, lse)?;
            }
            *ring.fwd_cache.lock().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(cache));
            Ok(())
        }

        /// This rank's part of a ring backward over `ring`: `dq`, `dk`, `dv` (packed, contiguous)
        /// from the inputs, the ring forward's `out` and `lse`, and `dout`. Each chunk's `f32`
        /// `dK`/`dV` accumulators travel with it one step behind; after the last step they come
        /// home narrowed to the dtype, at half the bytes.
        #[allow(clippy::too_many_arguments)]
        pub fn ring_backward<T: CudaElement + NcclType>(
            &self,
            ring: &NcclRing,
            p: &RingProblem,
            q: &CudaView<'_, T>,
            k: &CudaView<'_, T>,
            v: &CudaView<'_, T>,
            out: &CudaView<'_, T>,
            lse: &CudaView<'_, f32>,
            dout: &CudaView<'_, T>,
            dq: &mut CudaSlice<T>,
            dk: &mut CudaSlice<T>,
            dv: &mut CudaSlice<T>,
        ) -> Result<()> {
            let t = p.tokens();
            if ring.ranks != p.ranks {
                return Err(Error::Unsupported(format!("a problem of {} ranks on a ring of {}", p.ranks, ring.ranks)));
            }
            let (qn, kn, vn, on) = (t * p.hq * p.d, t * p.hk * p.d, t * p.hk * p.dv, t * p.hq * p.dv);
            for (what, got, want) in [
                ("q", q.len(), qn),
                ("k", k.len(), kn),
                ("v", v.len(), vn),
                ("out", out.len(), on),
                ("lse", lse.len(), p.hq * t),
                ("dout", dout.len(), on),
                ("dq", dq.len(), qn),
                ("dk", dk.len(), kn),
                ("dv", dv.len(), vn),
            ] {
                check_len(what, got, want)?;
            }
            if t == 0 {
                return Ok(());
            }
            let rank = Rank::new::<T>(self, p, ring.rank)?;
            let key: CacheKey = (p.clone(), self.stream().cu_stream() as usize);
            let mut cache = match take_cached::<BwdCache<T>>(&ring.bwd_cache, &key, |c| &c.key) {
                Some(mut c) => {
                    rank.bwd_reset(&mut c.st)?;
                    for (a, b) in &mut c.acc {
                        self.stream().memset_zeros(a).map_err(|e| driver_error("cuMemsetD8", e))?;
                        self.stream().memset_zeros(b).map_err(|e| driver_error("cuMemsetD8", e))?;
                    }
                    c
                }
                None => BwdCache {
                    key,
                    st: rank.bwd_state::<T>()?,
                    bufs: [(scratch(self, kn)?, scratch(self, vn)?), (scratch(self, kn)?, scratch(self, vn)?)],
                    acc: [(alloc_f32(self, kn)?, alloc_f32(self, vn)?), (alloc_f32(self, kn)?, alloc_f32(self, vn)?)],
                },
            };
            let BwdCache { st, bufs, acc, .. } = &mut cache;
            ring.begin_call();
            let _in_flight = JoinOnDrop { compute: self.stream(), comm: &ring.comm_stream };
            let ins = BwdInputs { q: q.slice(..), out: out.slice(..), lse: lse.slice(..), dout: dout.slice(..) };
            let cs = &ring.comm_stream;
            let event = |what: &str| cs.record_event(None).map_err(|e| driver_error(what, e));
            let mut held = 0usize; // which accumulator holds the current chunk's dK/dV
            let mut dkv_arrived = None; // the event after the previous step's dK/dV exchange
            for step in 0..p.ranks {
                let last = step + 1 == p.ranks;
                let cur = step % 2;
                let at = (RingPass::Backward, step);
                let mut kv_arrived = None;
                if !last {
                    ring.pass_chunk(self, at, (k, v), bufs, (kn, vn))?;
                    kv_arrived = Some(event("cuEventRecord")?);
                }
                let start = ring.mark(self.stream())?;
                let work = if step == 0 {
                    rank.backward_compute(step, &ins, k, v, st)?
                } else {
                    let (ck, cv) = (bufs[cur].0.slice(..kn), bufs[cur].1.slice(..vn));
                    rank.backward_compute(step, &ins, &ck, &cv, st)?
                };
                ring.close(start, self.stream(), (at.0, at.1, Phase::Compute))?;
                // The chunk's dK/dV from the previous rank must be here before adding to them;
                // the step's gradients above did not wait for them.
                if let Some(ev) = dkv_arrived.take() {
                    ring.wait_for(self.stream(), Await::Event(&ev), at)?;
                }
                {
                    let start = ring.mark(self.stream())?;
                    let (dka, dva) = &mut acc[held];
                    rank.backward_add(work, st, dka, dva)?;
                    ring.close(start, self.stream(), (at.0, at.1, Phase::Compute))?;
                }
                // Pass the accumulators on (the next rank holds this chunk next) and take the
                // previous rank's into the other pair, which the exchange overwrites whole. After
                // the last step the chunk's dK/dV are complete: narrowed to the dtype here (the
                // rounding the owner would do), they travel at half the bytes of `f32` straight
                // into the owner's `dk`, `dv`. The free receive buffers hold them: the last step
                // receives no chunk, and the send that read them finished before this step
                // (the compute stream waited for it).
                if p.ranks > 1 && last {
                    let (free_k, free_v) = &mut bufs[1 - cur];
                    rank.narrow(free_k, &acc[held].0, kn)?;
                    rank.narrow(free_v, &acc[held].1, vn)?;
                    cs.join(self.stream()).map_err(|e| driver_error("cuStreamWaitEvent", e))?;
                    let start = ring.mark(cs)?;
                    let (sk, sv) = (free_k.slice(..kn), free_v.slice(..vn));
                    let (mut rk, mut rv) = (dk.slice_mut(..), dv.slice_mut(..));
                    ring.exchange(&[&sk, &sv], &mut [&mut rk, &mut rv])?;
                    ring.close(start, cs, (at.0, at.1, Phase::Transfer))?;
                    dkv_arrived = Some(event("cuEventRecord")?);
                } else if p.ranks > 1 {
                    cs.join(self.stream()).map_err(|e| driver_error("cuStreamWaitEvent", e))?;
                    let start = ring.mark(cs)?;
                    let [a0, a1] = acc;
                    let (send, recv) = if held == 0 { (a0, a1) } else { (a1, a0) };
                    let (sk, sv) = (send.0.slice(..kn), send.1.slice(..vn));
                    let (mut rk, mut rv) = (recv.0.slice_mut(..kn), recv.1.slice_mut(..vn));
                    ring.exchange(&[&sk, &sv], &mut [&mut rk, &mut rv])?;
                    ring.close(start, cs, (at.0, at.1, Phase::Transfer))?;
                    held = 1 - held;
                    dkv_arrived = Some(event("cuEventRecord")?);
                }
                if let Some(ev) = kv_arrived {
                    ring.wait_for(self.stream(), Await::Event(&ev), at)?;
                }
            }
            if let Some(ev) = dkv_arrived {
                ring.wait_for(self.stream(), Await::Event(&ev), (RingPass::Backward, p.ranks - 1))?;
            }
            rank.narrow(dq, &st.dq, qn)?;
            if p.ranks == 1 {
                rank.narrow(dk, &acc[held].0, kn)?;
                rank.narrow(dv, &acc[held].1, vn)?;
            }
            *ring.bwd_cache.lock().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(cache));
            Ok(())
        }
    }
}
