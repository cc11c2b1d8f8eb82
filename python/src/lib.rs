//! The native half of `flash_attn_rs`: this library's forward (FP8 included), backward and
//! KV-cache calls on buffers that PyTorch owns.
//!
//! Python hands over each tensor as `(data_ptr, shape, strides)` (strides in elements) with its
//! dtype, device and stream; nothing is copied. The Python layer (`flash_attn_rs/_ops.py`)
//! allocates every output with torch's allocator, keeps the tensors alive for the call, and passes
//! host tensors for the small host-side inputs (`cu_seqlens`, ALiBi slopes, cache lengths).
//! Errors come back as Python exceptions carrying the library's message: `ValueError` for an
//! invalid input, `NotImplementedError` for what a backend does not support, `MemoryError` when
//! memory runs out, `RuntimeError` for a CUDA failure.
//!
//! The CPU work runs with the GIL released, on the library's rayon pool.

use flash_attn::kvcache::KvCache;
use flash_attn::{AttentionSpec, Error, Fp8E4m3, Fp8Scales, Tensor, TensorMut};
use half::{bf16, f16};
use pyo3::exceptions::{PyMemoryError, PyNotImplementedError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

#[cfg(feature = "cuda")]
mod gpu;

/// A tensor as Python passes it: data pointer, shape, strides in elements.
#[derive(Debug, Clone, FromPyObject)]
pub(crate) struct View(usize, Vec<usize>, Vec<i64>);

impl View {
    /// The strides as `usize`; negative strides are refused (torch has none, but a caller could
    /// pass any integers).
    fn strides(&self, name: &str) -> PyResult<Vec<usize>> {
        if self.1.len() != self.2.len() {
            return Err(PyValueError::new_err(format!(
                "`{name}`: {} dimensions but {} strides",
                self.1.len(),
                self.2.len()
            )));
        }
        self.2
            .iter()
            .map(|&s| usize::try_from(s).map_err(|_| PyValueError::new_err(format!("`{name}` has a negative stride"))))
            .collect()
    }

    /// Elements from the first to one past the last the view reaches (0 for an empty view).
    fn extent(&self, name: &str) -> PyResult<usize> {
        let strides = self.strides(name)?;
        if self.1.contains(&0) {
            return Ok(0);
        }
        self.1
            .iter()
            .zip(&strides)
            .try_fold(1usize, |acc, (&n, &s)| acc.checked_add((n - 1).checked_mul(s)?))
            .ok_or_else(|| PyValueError::new_err(format!("`{name}`: its extent overflows")))
    }

    /// Byte range `[start, end)` the view covers, for the aliasing check.
    fn bytes(&self, name: &str, elem: usize) -> PyResult<(usize, usize)> {
        let n = self.extent(name)?;
        let len = n.checked_mul(elem).ok_or_else(|| PyValueError::new_err(format!("`{name}` is too large")))?;
        let end =
            self.0.checked_add(len).ok_or_else(|| PyValueError::new_err(format!("`{name}`: address overflow")))?;
        Ok((self.0, end))
    }
}

/// Refuses calls where a buffer written by the call shares memory with any other buffer of the
/// call: Rust slices may not alias, and the kernels would read half-written data.
fn check_disjoint(written: &[(&str, &View, usize)], read: &[(&str, &View, usize)]) -> PyResult<()> {
    let mut ranges = Vec::new();
    for (i, &(name, v, elem)) in written.iter().chain(read).enumerate() {
        let (a, b) = v.bytes(name, elem)?;
        if a < b {
            ranges.push((name, a, b, i < written.len()));
        }
    }
    for (i, &(n1, a1, b1, w1)) in ranges.iter().enumerate() {
        for &(n2, a2, b2, w2) in &ranges[i + 1..] {
            if (w1 || w2) && a1 < b2 && a2 < b1 {
                return Err(PyValueError::new_err(format!(
                    "`{n1}` and `{n2}` share memory, and the call writes {}",
                    if w1 { n1 } else { n2 }
                )));
            }
        }
    }
    Ok(())
}

/// A library error as the Python exception a torch user expects.
fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::DeviceOutOfMemory(_) | Error::OutOfMemory { .. } => PyMemoryError::new_err(msg),
        Error::Unsupported(_) | Error::CpuIsa(_) | Error::HeadDim { .. } => PyNotImplementedError::new_err(msg),
        Error::CudaUnavailable(_)
        | Error::NvrtcUnavailable(_)
        | Error::CudaHeaders(_)
        | Error::KernelCompile { .. }
        | Error::CudaLaunch(_) => PyRuntimeError::new_err(msg),
        _ => PyValueError::new_err(msg),
    }
}

/// # Safety
/// `v` must describe memory valid for reads of `extent` elements of `T` for `'a`, not written by
/// anyone during `'a`.
pub(crate) unsafe fn host<'a, T>(v: &View, name: &str) -> PyResult<Tensor<'a, T>> {
    let n = v.extent(name)?;
    let data: &[T] = if n == 0 {
        &[]
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(v.0 as *const T, n) }
    };
    Ok(Tensor::with_strides(data, &v.1, &v.strides(name)?))
}

/// # Safety
/// As [`host`], for reads and writes, and no other live reference to that memory.
unsafe fn host_mut<'a, T>(v: &View, name: &str) -> PyResult<TensorMut<'a, T>> {
    let n = v.extent(name)?;
    let data: &mut [T] = if n == 0 {
        &mut []
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(v.0 as *mut T, n) }
    };
    Ok(TensorMut::with_strides(data, &v.1, &v.strides(name)?))
}

/// Refuses a view that is not row-major contiguous.
fn check_contiguous(v: &View, name: &str) -> PyResult<()> {
    let contiguous = flash_attn::tensor::contiguous_strides(&v.1);
    let strided = v.strides(name)?.iter().zip(&v.1).zip(&contiguous).any(|((&s, &n), &c)| n > 1 && s != c);
    if strided {
        return Err(PyValueError::new_err(format!("`{name}` must be contiguous, got strides {:?}", v.2)));
    }
    Ok(())
}

/// A contiguous host tensor's elements, read-only.
///
/// # Safety
/// As [`host`].
unsafe fn host_contiguous<'a, T>(v: &View, name: &str) -> PyResult<&'a [T]> {
    check_contiguous(v, name)?;
    // SAFETY: the caller's contract.
    Ok(unsafe { host::<T>(v, name)? }.data())
}

/// A contiguous host 1-d `int32` tensor's elements (`cu_seqlens`, cache lengths, ...).
///
/// # Safety
/// As [`host`].
pub(crate) unsafe fn host_slice<'a, T>(v: &View, name: &str) -> PyResult<&'a [T]> {
    if v.1.len() != 1 {
        return Err(PyValueError::new_err(format!("`{name}` must be a 1-d tensor, got shape {:?}", v.1)));
    }
    // SAFETY: the caller's contract.
    unsafe { host_contiguous(v, name) }
}

/// A contiguous host vector's elements, writable (the `lse` outputs).
///
/// # Safety
/// As [`host_mut`].
unsafe fn host_slice_mut<'a, T>(v: &View, name: &str) -> PyResult<&'a mut [T]> {
    check_contiguous(v, name)?;
    // SAFETY: the caller's contract.
    let t = unsafe { host_mut::<T>(v, name)? };
    Ok(t.into_data())
}

/// The options every attention call shares, as the Python layer passes them (a dict).
#[derive(Debug, Clone, FromPyObject)]
#[pyo3(from_item_all)]
struct Opts {
    /// Softmax scale.
    scale: f32,
    /// Bottom-right causal mask.
    causal: bool,
    /// `(left, right)`, `-1` unbounded; `(-1, -1)` is no window.
    window: (i64, i64),
    /// `0.0`: no softcap.
    softcap: f32,
    /// ALiBi slopes, host `f32 [hq]` or `[b, hq]`.
    alibi: Option<View>,
    /// Host `int32 [b + 1]` each.
    cu_seqlens: Option<(View, View)>,
    /// `(p, seed, offset)`.
    dropout: Option<(f32, u64, u32)>,
    /// Deterministic CUDA backward.
    deterministic: bool,
}

impl Opts {
    /// The library's spec.
    ///
    /// # Safety
    /// The host views in `self` must be valid for `'a` as [`host`] requires.
    unsafe fn spec<'a>(&self) -> PyResult<AttentionSpec<'a>> {
        let mut spec = AttentionSpec::new().scale(self.scale);
        if self.causal {
            spec = spec.causal();
        }
        if self.window != (-1, -1) {
            spec = spec.window(self.window.0, self.window.1);
        }
        if self.softcap != 0.0 {
            spec = spec.softcap(self.softcap);
        }
        if let Some(a) = &self.alibi {
            // SAFETY: the caller's contract.
            spec = spec.alibi_slopes(unsafe { host::<f32>(a, "alibi_slopes")? });
        }
        if let Some((cq, ck)) = &self.cu_seqlens {
            // SAFETY: the caller's contract.
            let (cq, ck) = unsafe { (host_slice::<i32>(cq, "cu_seqlens_q")?, host_slice::<i32>(ck, "cu_seqlens_k")?) };
            spec = spec.varlen(cq, ck);
        }
        if let Some((p, seed, offset)) = self.dropout {
            if p > 0.0 {
                spec = spec.dropout(p, seed, offset);
            }
        }
        if self.deterministic {
            spec = spec.deterministic();
        }
        Ok(spec)
    }
}

/// Runs `$body` with `$t` bound to the element type named by `$dtype`.
macro_rules! dispatch {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            "float32" => {
                type $t = f32;
                $body
            }
            "float16" => {
                type $t = f16;
                $body
            }
            "bfloat16" => {
                type $t = bf16;
                $body
            }
            other => Err(PyValueError::new_err(format!(
                "dtype {other} is not supported (float32, float16 and bfloat16 are)"
            ))),
        }
    };
}

fn elem_size(dtype: &str) -> usize {
    if dtype == "float32" {
        4
    } else {
        2
    }
}

/// Attention forward: writes `out` and `lse` (`float32`, contiguous).
///
/// `device` is `-1` for the CPU or a CUDA ordinal; `stream` the CUDA stream handle to launch on.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn fwd(
    py: Python<'_>,
    dtype: &str,
    device: i64,
    stream: usize,
    q: View,
    k: View,
    v: View,
    out: View,
    lse: View,
    opts: Opts,
) -> PyResult<()> {
    let es = elem_size(dtype);
    check_disjoint(&[("out", &out, es), ("lse", &lse, 4)], &[("q", &q, es), ("k", &k, es), ("v", &v, es)])?;
    if device >= 0 {
        return cuda_fwd(py, dtype, device, stream, q, k, v, out, lse, opts);
    }
    py.detach(move || {
        dispatch!(dtype, T => {
            // SAFETY: the Python layer passes live tensors of `dtype` whose views it describes;
            // outputs are fresh allocations, checked above not to alias the inputs.
            unsafe {
                let spec = opts.spec()?;
                let mut o = host_mut::<T>(&out, "out")?;
                let lse_s = host_slice_mut::<f32>(&lse, "lse")?;
                flash_attn::forward_into(&spec, &host(&q, "q")?, &host(&k, "k")?, &host(&v, "v")?, &mut o, lse_s)
                    .map_err(to_py)
            }
        })
    })
}

/// FP8 forward: `q`, `k`, `v` are `float8_e4m3fn` (the bit layout of [`Fp8E4m3`]) with the
/// per-tensor descale factors `descale = (q, k, v)`; writes `out` (`bfloat16`) and `lse`
/// (`float32`), both contiguous (docs/semantics.md, "FP8 inputs").
///
/// The CPU runs `flash_attn::forward_fp8` (every option) and copies its result into the torch
/// buffers; CUDA tensors go to `Device::forward_fp8` (sm_90a, fixed-length batches, no dropout,
/// softcap or ALiBi; anything else is the library's `NotImplementedError`).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn fwd_fp8(
    py: Python<'_>,
    device: i64,
    stream: usize,
    q: View,
    k: View,
    v: View,
    out: View,
    lse: View,
    descale: (f32, f32, f32),
    opts: Opts,
) -> PyResult<()> {
    check_disjoint(&[("out", &out, 2), ("lse", &lse, 4)], &[("q", &q, 1), ("k", &k, 1), ("v", &v, 1)])?;
    let scales = Fp8Scales { q: descale.0, k: descale.1, v: descale.2 };
    if device >= 0 {
        return cuda_fwd_fp8(py, device, stream, [q, k, v, out, lse], scales, opts);
    }
    py.detach(move || {
        // SAFETY: the Python layer passes live float8_e4m3fn tensors (one byte an element, the
        // layout of `Fp8E4m3`) whose views it describes, and fresh contiguous outputs, checked
        // above not to alias the inputs.
        unsafe {
            let spec = opts.spec()?;
            let (qt, kt, vt) = (host::<Fp8E4m3>(&q, "q")?, host(&k, "k")?, host(&v, "v")?);
            let res = flash_attn::forward_fp8(&spec, &qt, &kt, &vt, scales).map_err(to_py)?;
            let (o, l) = (host_slice_mut::<bf16>(&out, "out")?, host_slice_mut::<f32>(&lse, "lse")?);
            if out.1 != res.out_shape || o.len() != res.out.len() || l.len() != res.lse.len() {
                return Err(PyValueError::new_err(format!(
                    "`out` {:?} / `lse` {:?} do not fit the result ({:?}, {:?})",
                    out.1, lse.1, res.out_shape, res.lse_shape
                )));
            }
            o.copy_from_slice(&res.out);
            l.copy_from_slice(&res.lse);
            Ok(())
        }
    })
}

/// Attention backward: writes `dq`, `dk`, `dv` from the inputs, the forward's `out` and `lse`,
/// and `dout`. CUDA tensors: the scratch memory is `workspace` (`uint8`, at least
/// [`bwd_workspace_bytes`]) when given, else the driver's memory pool; the CPU takes none.
#[pyfunction]
#[pyo3(signature = (dtype, device, stream, q, k, v, out, lse, dout, dq, dk, dv, opts, workspace=None))]
#[allow(clippy::too_many_arguments)]
fn bwd(
    py: Python<'_>,
    dtype: &str,
    device: i64,
    stream: usize,
    q: View,
    k: View,
    v: View,
    out: View,
    lse: View,
    dout: View,
    dq: View,
    dk: View,
    dv: View,
    opts: Opts,
    workspace: Option<View>,
) -> PyResult<()> {
    let es = elem_size(dtype);
    check_disjoint(
        &[("dq", &dq, es), ("dk", &dk, es), ("dv", &dv, es)],
        &[("q", &q, es), ("k", &k, es), ("v", &v, es), ("out", &out, es), ("lse", &lse, 4), ("dout", &dout, es)],
    )?;
    if device >= 0 {
        if let Some(w) = &workspace {
            let all = [("q", &q, es), ("k", &k, es), ("v", &v, es), ("out", &out, es), ("dout", &dout, es)];
            let mut read = all.to_vec();
            read.extend([("lse", &lse, 4), ("dq", &dq, es), ("dk", &dk, es), ("dv", &dv, es)]);
            check_disjoint(&[("workspace", w, 1)], &read)?;
        }
        return cuda_bwd(py, dtype, device, stream, [q, k, v, out, lse, dout, dq, dk, dv], workspace, opts);
    }
    py.detach(move || {
        dispatch!(dtype, T => {
            // SAFETY: as in `fwd`; the gradients are fresh allocations checked not to alias.
            unsafe {
                let spec = opts.spec()?;
                let lse_s = host_contiguous::<f32>(&lse, "lse")?;
                flash_attn::backward_into(
                    &spec,
                    &host::<T>(&q, "q")?,
                    &host(&k, "k")?,
                    &host(&v, "v")?,
                    &host(&out, "out")?,
                    lse_s,
                    &host(&dout, "dout")?,
                    &mut host_mut(&dq, "dq")?,
                    &mut host_mut(&dk, "dk")?,
                    &mut host_mut(&dv, "dv")?,
                )
                .map_err(to_py)
            }
        })
    })
}

/// The cache-side options of [`kvcache_fwd`] (a dict).
#[derive(Debug, Clone, FromPyObject)]
#[pyo3(from_item_all)]
pub(crate) struct CacheOpts {
    /// Host `int32 [b]`.
    pub(crate) cache_seqlens: View,
    /// Host `int32 [b]`.
    pub(crate) batch_idx: Option<View>,
    /// Host `int32 [b, max_pages]`.
    pub(crate) block_table: Option<View>,
    /// Host `int32 [b]`.
    pub(crate) leftpad: Option<View>,
    /// New keys and values to append.
    pub(crate) new_kv: Option<(View, View)>,
    /// `(cos, sin, interleaved)`.
    pub(crate) rotary: Option<(View, View, bool)>,
    /// 0: the heuristic.
    pub(crate) num_splits: usize,
}

/// Attention over a KV cache: appends `new_kv` into `k_cache`/`v_cache` in place, then writes
/// `out` and `lse`. The index tensors of `cache` are host tensors on both devices.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn kvcache_fwd(
    py: Python<'_>,
    dtype: &str,
    device: i64,
    stream: usize,
    q: View,
    k_cache: View,
    v_cache: View,
    out: View,
    lse: View,
    cache: CacheOpts,
    opts: Opts,
) -> PyResult<()> {
    let es = elem_size(dtype);
    let mut read = vec![("q", &q, es)];
    if let Some((kn, vn)) = &cache.new_kv {
        read.push(("k", kn, es));
        read.push(("v", vn, es));
    }
    if let Some((c, s, _)) = &cache.rotary {
        read.push(("rotary_cos", c, es));
        read.push(("rotary_sin", s, es));
    }
    check_disjoint(
        &[("k_cache", &k_cache, es), ("v_cache", &v_cache, es), ("out", &out, es), ("lse", &lse, 4)],
        &read,
    )?;
    if device >= 0 {
        return cuda_kvcache(py, dtype, device, stream, [q, k_cache, v_cache, out, lse], cache, opts);
    }
    py.detach(move || {
        dispatch!(dtype, T => {
            // SAFETY: as in `fwd`; the caches are the caller's tensors, written in place, and
            // checked above to share memory with nothing else of the call.
            unsafe {
                let spec = opts.spec()?;
                let mut kv = KvCache::<T>::new(host_slice(&cache.cache_seqlens, "cache_seqlens")?)
                    .num_splits(cache.num_splits);
                if let Some(x) = &cache.batch_idx {
                    kv = kv.batch_idx(host_slice(x, "cache_batch_idx")?);
                }
                if let Some(x) = &cache.block_table {
                    kv = kv.paged(host::<i32>(x, "block_table")?);
                }
                if let Some(x) = &cache.leftpad {
                    kv = kv.leftpad(host_slice(x, "cache_leftpad")?);
                }
                if let Some((kn, vn)) = &cache.new_kv {
                    kv = kv.append(host(kn, "k")?, host(vn, "v")?);
                }
                if let Some((c, s, interleaved)) = &cache.rotary {
                    kv = kv.rotary(host(c, "rotary_cos")?, host(s, "rotary_sin")?, *interleaved);
                }
                let mut o = host_mut::<T>(&out, "out")?;
                let lse_s = host_slice_mut::<f32>(&lse, "lse")?;
                flash_attn::kvcache::forward_into(
                    &spec,
                    &host(&q, "q")?,
                    &mut host_mut(&k_cache, "k_cache")?,
                    &mut host_mut(&v_cache, "v_cache")?,
                    &kv,
                    &mut o,
                    lse_s,
                )
                .map_err(to_py)
            }
        })
    })
}

/// The dropout keep mask of a call, `uint8 [b, hq, sq, sk]` (1 = kept): element `(b, h, i, j)`
/// is the bit the kernels draw for query `i` and key `j` of sequence `b` (positions within the
/// sequence), head `h`. For `return_attn_probs`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn dropout_keep(p: f32, seed: u64, offset: u32, b: usize, hq: usize, sq: usize, sk: usize, out: View) -> PyResult<()> {
    let n = b.checked_mul(hq).and_then(|x| x.checked_mul(sq)).and_then(|x| x.checked_mul(sk));
    if n != Some(out.extent("keep")?) || out.1 != [b, hq, sq, sk] {
        return Err(PyValueError::new_err(format!("keep mask must be a contiguous uint8 [{b}, {hq}, {sq}, {sk}]")));
    }
    if !(0.0..1.0).contains(&p) {
        return Err(PyValueError::new_err(format!("dropout_p must be in [0, 1), got {p}")));
    }
    // SAFETY: the Python layer passes a fresh contiguous uint8 tensor of that shape.
    let mut t = unsafe { host_mut::<u8>(&out, "keep")? };
    let rng = flash_attn::philox::DropoutRng::new(p, seed, offset);
    let mut row = vec![false; sk];
    for (r, chunk) in t.data_mut().chunks_mut(sk.max(1)).enumerate().take(b * hq * sq) {
        let (i, bh) = (r % sq, r / sq);
        rng.keep_row(bh / hq, bh % hq, hq, i, 0, &mut row);
        for (x, &keep) in chunk.iter_mut().zip(&row) {
            *x = u8::from(keep);
        }
    }
    Ok(())
}

/// Whether the CUDA backend was built in and a driver, NVRTC and a GPU of compute capability
/// 8.0+ can be used; `(ok, reason)`.
#[pyfunction]
fn cuda_status() -> (bool, String) {
    #[cfg(feature = "cuda")]
    {
        match gpu::device(0) {
            Ok(d) => (true, format!("{:?}", d.arch())),
            Err(e) => (false, e.to_string()),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        (false, "built without the `cuda` feature".to_string())
    }
}

/// The CPU instruction-set path calls take on this machine (`FLASH_ATTN_CPU_ISA` caps it).
#[pyfunction]
fn cpu_isa() -> PyResult<String> {
    flash_attn::cpu::Isa::resolve(None).map(|i| format!("{i:?}").to_lowercase()).map_err(to_py)
}

#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
fn cuda_fwd(
    py: Python<'_>,
    dtype: &str,
    device: i64,
    stream: usize,
    q: View,
    k: View,
    v: View,
    out: View,
    lse: View,
    opts: Opts,
) -> PyResult<()> {
    py.detach(move || gpu::fwd(dtype, device, stream, [q, k, v, out, lse], &opts))
}

#[cfg(not(feature = "cuda"))]
#[allow(clippy::too_many_arguments)]
fn cuda_fwd(
    _: Python<'_>,
    _: &str,
    _: i64,
    _: usize,
    _: View,
    _: View,
    _: View,
    _: View,
    _: View,
    _: Opts,
) -> PyResult<()> {
    Err(PyRuntimeError::new_err("flash_attn_rs was built without the `cuda` feature"))
}

#[cfg(feature = "cuda")]
fn cuda_fwd_fp8(
    py: Python<'_>,
    device: i64,
    stream: usize,
    views: [View; 5],
    scales: Fp8Scales,
    opts: Opts,
) -> PyResult<()> {
    py.detach(move || gpu::fwd_fp8(device, stream, views, scales, &opts))
}

#[cfg(not(feature = "cuda"))]
fn cuda_fwd_fp8(_: Python<'_>, _: i64, _: usize, _: [View; 5], _: Fp8Scales, _: Opts) -> PyResult<()> {
    Err(PyRuntimeError::new_err("flash_attn_rs was built without the `cuda` feature"))
}

#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
fn cuda_bwd(
    py: Python<'_>,
    dtype: &str,
    device: i64,
    stream: usize,
    views: [View; 9],
    workspace: Option<View>,
    opts: Opts,
) -> PyResult<()> {
    py.detach(move || gpu::bwd(dtype, device, stream, views, workspace, &opts))
}

#[cfg(not(feature = "cuda"))]
#[allow(clippy::too_many_arguments)]
fn cuda_bwd(_: Python<'_>, _: &str, _: i64, _: usize, _: [View; 9], _: Option<View>, _: Opts) -> PyResult<()> {
    Err(PyRuntimeError::new_err("flash_attn_rs was built without the `cuda` feature"))
}

#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
fn cuda_kvcache(
    py: Python<'_>,
    dtype: &str,
    device: i64,
    stream: usize,
    views: [View; 5],
    cache: CacheOpts,
    opts: Opts,
) -> PyResult<()> {
    py.detach(move || gpu::kvcache(dtype, device, stream, views, &cache, &opts))
}

#[cfg(not(feature = "cuda"))]
#[allow(clippy::too_many_arguments)]
fn cuda_kvcache(_: Python<'_>, _: &str, _: i64, _: usize, _: [View; 5], _: CacheOpts, _: Opts) -> PyResult<()> {
    Err(PyRuntimeError::new_err("flash_attn_rs was built without the `cuda` feature"))
}

/// Bytes of scratch memory the CUDA backward of `q`, `k`, `v` needs (for the caller to
/// allocate, with torch's allocator, and pass to [`bwd`] as `workspace`).
#[pyfunction]
fn bwd_workspace_bytes(dtype: &str, device: i64, q: View, k: View, v: View, opts: Opts) -> PyResult<usize> {
    #[cfg(feature = "cuda")]
    {
        gpu::bwd_workspace_bytes(dtype, device, [q, k, v], &opts)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (dtype, device, q, k, v, opts);
        Err(PyRuntimeError::new_err("flash_attn_rs was built without the `cuda` feature"))
    }
}

/// The module `flash_attn_rs._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(fwd, m)?)?;
    m.add_function(wrap_pyfunction!(fwd_fp8, m)?)?;
    m.add_function(wrap_pyfunction!(bwd, m)?)?;
    m.add_function(wrap_pyfunction!(bwd_workspace_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(kvcache_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(dropout_keep, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_isa, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
