//! # flash-attn-candle
//!
//! [candle-flash-attn]'s public functions, same names and signatures, as candle custom ops over
//! this workspace's `flash-attn` library, with a backward pass: `loss.backward()` through them
//! gives `dq`, `dk`, `dv` by FlashAttention's recomputation (nothing `N × N` is stored; the
//! forward's log-sum-exp is kept by the op for its backward, so no second forward runs).
//!
//! Switching is one dependency line:
//!
//! ```toml
//! candle-flash-attn = { package = "flash-attn-candle", path = "..." }
//! ```
//!
//! CPU tensors (f32, f16, bf16) run on the library's CPU backend, with no build step beyond
//! `cargo`. CUDA tensors (f16, bf16) need this crate's `cuda` feature, which turns on candle's
//! CUDA storage: candle compiles its own kernels with `nvcc` at build time and links the CUDA
//! libraries, so that build needs a CUDA toolkit; this library's kernels need neither (NVRTC
//! compiles them at run time). Without the feature, a CUDA tensor gets candle's "no cuda
//! implementation" error.
//!
//! ```
//! use candle::{Device, Tensor};
//! let (b, s, h, d) = (1, 16, 2, 32);
//! let q = Tensor::randn(0f32, 1.0, (b, s, h, d), &Device::Cpu)?;
//! let out = flash_attn_candle::flash_attn(&q, &q, &q, 1.0 / (d as f32).sqrt(), true)?;
//! assert_eq!(out.dims(), &[b, s, h, d]);
//! let grads = out.sum_all()?.backward()?; // dq, dk, dv: recomputed, nothing N × N stored
//! # Ok::<(), candle::Error>(())
//! ```
//!
//! Semantics are candle-flash-attn's (and FlashAttention's): `q [b, sq, hq, d]`,
//! `k, v [b, sk, hk, d]` (`hq` a multiple of `hk`); `causal` is aligned to the bottom-right corner;
//! a window `(left, right)` of `None` sides is unbounded and `(None, Some(0))` is causal; ALiBi
//! slopes are f32 `[hq]` or `[b, hq]`; varlen calls take `u32` cumulative lengths `[b + 1]`.
//! Beyond candle-flash-attn: any `d` and `dv` on the CPU, f32 on the CPU, and the backward.
//!
//! [candle-flash-attn]: https://crates.io/crates/candle-flash-attn

use std::sync::Mutex;

use candle::backend::BackendStorage;
use candle::{CpuStorage, CustomOp3, DType, Layout, Shape, Storage, Tensor, WithDType};
use flash_attn::kvcache::KvCache;
use flash_attn::{AttentionSpec, Element};

pub use candle::{Error, Result};

#[cfg(feature = "cuda")]
mod gpu;

/// A library error as a candle error (its message kept).
pub(crate) fn wrap(e: flash_attn::Error) -> Error {
    Error::wrap(e)
}

/// What one call computes, besides its tensors.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    softmax_scale: f32,
    window_left: Option<usize>,
    window_right: Option<usize>,
    softcap: Option<f32>,
    /// Host copy of the ALiBi slopes and their shape.
    alibi: Option<(Vec<f32>, Vec<usize>)>,
    /// Host copies of the cumulative lengths, as `i32`.
    pub(crate) varlen: Option<(Vec<i32>, Vec<i32>)>,
}

/// A window side as the library takes it: `-1` unbounded.
fn side(x: Option<usize>) -> i64 {
    x.and_then(|x| i64::try_from(x).ok()).unwrap_or(-1)
}

impl Options {
    fn new(softmax_scale: f32, window_left: Option<usize>, window_right: Option<usize>) -> Self {
        Self { softmax_scale, window_left, window_right, softcap: None, alibi: None, varlen: None }
    }

    fn causal(softmax_scale: f32, causal: bool) -> Self {
        Self::new(softmax_scale, None, causal.then_some(0))
    }

    fn with_alibi(mut self, slopes: Option<&Tensor>) -> Result<Self> {
        if let Some(t) = slopes {
            if t.dtype() != DType::F32 {
                candle::bail!("alibi_slopes must be f32, got {:?}", t.dtype());
            }
            self.alibi = Some((t.flatten_all()?.to_vec1::<f32>()?, t.dims().to_vec()));
        }
        Ok(self)
    }

    fn with_softcap(mut self, softcap: f32) -> Self {
        self.softcap = (softcap != 0.0).then_some(softcap);
        self
    }

    fn with_varlen(mut self, seqlens_q: &Tensor, seqlens_k: &Tensor) -> Result<Self> {
        self.varlen = Some((cumulative("seqlens_q", seqlens_q)?, cumulative("seqlens_k", seqlens_k)?));
        Ok(self)
    }

    /// The library's spec (borrowing the host copies).
    pub(crate) fn spec(&self) -> AttentionSpec<'_> {
        let mut spec = AttentionSpec::new().scale(self.softmax_scale);
        match (self.window_left, self.window_right) {
            (None, None) => {}
            (None, Some(0)) => spec = spec.causal(),
            (l, r) => spec = spec.window(side(l), side(r)),
        }
        if let Some(c) = self.softcap {
            spec = spec.softcap(c);
        }
        if let Some((slopes, shape)) = &self.alibi {
            spec = spec.alibi_slopes(flash_attn::Tensor::new(slopes, shape));
        }
        if let Some((cq, ck)) = &self.varlen {
            spec = spec.varlen(cq, ck);
        }
        spec
    }
}

/// `u32` cumulative lengths `[b + 1]` (candle-flash-attn's type) as the library's `i32`.
fn cumulative(name: &str, t: &Tensor) -> Result<Vec<i32>> {
    if t.dtype() != DType::U32 || t.rank() != 1 {
        candle::bail!("{name} must be a 1-d u32 tensor of cumulative lengths, got {:?} {:?}", t.dtype(), t.dims());
    }
    t.to_vec1::<u32>()?
        .into_iter()
        .map(|x| i32::try_from(x).map_err(|_| Error::Msg(format!("{name} holds {x}, past i32"))))
        .collect()
}

/// The log-sum-exp a forward keeps for its backward.
#[derive(Debug, Clone)]
enum Saved {
    Cpu(Vec<f32>),
    #[cfg(feature = "cuda")]
    Cuda(cudarc::driver::CudaSlice<f32>),
}

/// The attention op: forward on the CPU (and CUDA with the `cuda` feature), backward by
/// recomputation from the log-sum-exp the forward left in `saved`.
struct FlashAttnOp {
    opts: Options,
    saved: Mutex<Option<Saved>>,
}

impl FlashAttnOp {
    fn new(opts: Options) -> Self {
        Self { opts, saved: Mutex::new(None) }
    }

    fn save(&self, s: Saved) {
        *self.saved.lock().unwrap_or_else(|p| p.into_inner()) = Some(s);
    }

    fn saved(&self) -> Result<Saved> {
        self.saved
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| Error::Msg("flash-attn backward before its forward".into()))
    }
}

/// A candle CPU buffer and layout as the library's strided view.
fn view<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<flash_attn::Tensor<'a, T>> {
    let data = s.as_slice::<T>()?;
    let data = data.get(l.start_offset()..).ok_or_else(|| Error::Msg("layout past its storage".into()))?;
    Ok(flash_attn::Tensor::with_strides(data, l.dims(), l.stride()))
}

pub(crate) fn check_dtypes(q: DType, k: DType, v: DType) -> Result<()> {
    if q != k || q != v {
        candle::bail!("q, k and v must share one dtype, got {q:?}, {k:?}, {v:?}");
    }
    Ok(())
}

impl FlashAttnOp {
    fn cpu_fwd_t<T: WithDType + Element>(
        &self,
        (q, ql): (&CpuStorage, &Layout),
        (k, kl): (&CpuStorage, &Layout),
        (v, vl): (&CpuStorage, &Layout),
    ) -> Result<(CpuStorage, Shape)> {
        let res =
            flash_attn::forward(&self.opts.spec(), &view::<T>(q, ql)?, &view(k, kl)?, &view(v, vl)?).map_err(wrap)?;
        self.save(Saved::Cpu(res.lse));
        Ok((T::to_cpu_storage_owned(res.out), Shape::from(res.out_shape)))
    }

    fn cpu_bwd_t<T: WithDType + Element>(&self, t: [&Tensor; 5], lse: &[f32]) -> Result<[Tensor; 3]> {
        let [q, k, v, out, dout] = t;
        let guards = [q, k, v, out, dout].map(|x| x.storage_and_layout());
        let mut views = Vec::with_capacity(5);
        for (g, l) in &guards {
            match &**g {
                Storage::Cpu(s) => views.push(view::<T>(s, l)?),
                _ => candle::bail!("flash-attn backward: all tensors must be on the CPU"),
            }
        }
        let g = flash_attn::backward(&self.opts.spec(), &views[0], &views[1], &views[2], &views[3], lse, &views[4])
            .map_err(wrap)?;
        let dev = q.device();
        Ok([
            Tensor::from_vec(g.dq, g.dq_shape, dev)?,
            Tensor::from_vec(g.dk, g.dk_shape, dev)?,
            Tensor::from_vec(g.dv, g.dv_shape, dev)?,
        ])
    }
}

impl CustomOp3 for FlashAttnOp {
    fn name(&self) -> &'static str {
        "flash-attn-rs"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        check_dtypes(q.dtype(), k.dtype(), v.dtype())?;
        match q.dtype() {
            DType::F32 => self.cpu_fwd_t::<f32>((q, ql), (k, kl), (v, vl)),
            DType::F16 => self.cpu_fwd_t::<half::f16>((q, ql), (k, kl), (v, vl)),
            DType::BF16 => self.cpu_fwd_t::<half::bf16>((q, ql), (k, kl), (v, vl)),
            dt => candle::bail!("flash-attn takes f32, f16 and bf16 on the CPU, got {dt:?}"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle::CudaStorage,
        ql: &Layout,
        k: &candle::CudaStorage,
        kl: &Layout,
        v: &candle::CudaStorage,
        vl: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        let (out, shape, lse) = gpu::fwd(&self.opts, (q, ql), (k, kl), (v, vl))?;
        self.save(Saved::Cuda(lse));
        Ok((out, shape))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The gradient may arrive in any layout; the kernels want a unit last stride.
        let dout = if dout.stride().last() == Some(&1) { dout.clone() } else { dout.contiguous()? };
        let t = [q, k, v, out, &dout];
        let grads = match self.saved()? {
            Saved::Cpu(lse) => match q.dtype() {
                DType::F32 => self.cpu_bwd_t::<f32>(t, &lse)?,
                DType::F16 => self.cpu_bwd_t::<half::f16>(t, &lse)?,
                DType::BF16 => self.cpu_bwd_t::<half::bf16>(t, &lse)?,
                dt => candle::bail!("flash-attn takes f32, f16 and bf16 on the CPU, got {dt:?}"),
            },
            #[cfg(feature = "cuda")]
            Saved::Cuda(lse) => gpu::bwd(&self.opts, t, &lse)?,
        };
        let [dq, dk, dv] = grads;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

fn apply(q: &Tensor, k: &Tensor, v: &Tensor, opts: Options) -> Result<Tensor> {
    q.apply_op3(k, v, FlashAttnOp::new(opts))
}

/// Attention `softmax(Q Kᵀ · softmax_scale) V` over `q [b, sq, hq, d]`, `k`, `v [b, sk, hk, d]`
/// (GQA/MQA when `hk < hq`), causal (bottom-right) if asked; returns `[b, sq, hq, d]`.
/// Differentiable.
pub fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, softmax_scale: f32, causal: bool) -> Result<Tensor> {
    apply(q, k, v, Options::causal(softmax_scale, causal))
}

/// [`flash_attn`] with a sliding window: query `i` sees keys `i + sk - sq - left ..= i + sk - sq +
/// right`, a `None` side unbounded; `(None, Some(0))` is the causal mask.
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    apply(q, k, v, Options::new(softmax_scale, window_size_left, window_size_right))
}

/// [`flash_attn`] with ALiBi: `-slope_h · |i + sk - sq - j|` added to the scores; `alibi_slopes`
/// f32 `[hq]` or `[b, hq]`.
pub fn flash_attn_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    apply(q, k, v, Options::causal(softmax_scale, causal).with_alibi(Some(alibi_slopes))?)
}

/// [`flash_attn_windowed`] with ALiBi.
pub fn flash_attn_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    apply(q, k, v, Options::new(softmax_scale, window_size_left, window_size_right).with_alibi(Some(alibi_slopes))?)
}

/// [`flash_attn_alibi_windowed`] with optional slopes and a softcap (`0.0`: none): scores become
/// `softcap · tanh(s / softcap)`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    let opts = Options::new(softmax_scale, window_size_left, window_size_right)
        .with_alibi(alibi_slopes)?
        .with_softcap(softcap);
    apply(q, k, v, opts)
}

/// Attention over a packed batch: `q [total_q, hq, d]`, `k`, `v [total_k, hk, d]`; sequence `i`
/// is rows `seqlens_q[i]..seqlens_q[i + 1]` (u32 cumulative lengths, `[b + 1]`). `max_seqlen_*`
/// are accepted for compatibility (the lengths come from `seqlens_*`). Differentiable.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let _ = (max_seqlen_q, max_seqlen_k);
    apply(q, k, v, Options::causal(softmax_scale, causal).with_varlen(seqlens_q, seqlens_k)?)
}

/// [`flash_attn_varlen`] with a sliding window (see [`flash_attn_windowed`]).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let _ = (max_seqlen_q, max_seqlen_k);
    let opts = Options::new(softmax_scale, window_size_left, window_size_right).with_varlen(seqlens_q, seqlens_k)?;
    apply(q, k, v, opts)
}

/// [`flash_attn_varlen`] with ALiBi slopes (f32 `[hq]` or `[b, hq]`).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let _ = (max_seqlen_q, max_seqlen_k);
    let opts =
        Options::causal(softmax_scale, causal).with_alibi(Some(alibi_slopes))?.with_varlen(seqlens_q, seqlens_k)?;
    apply(q, k, v, opts)
}

/// [`flash_attn_varlen_windowed`] with ALiBi slopes.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let _ = (max_seqlen_q, max_seqlen_k);
    let opts = Options::new(softmax_scale, window_size_left, window_size_right)
        .with_alibi(Some(alibi_slopes))?
        .with_varlen(seqlens_q, seqlens_k)?;
    apply(q, k, v, opts)
}

/// [`flash_attn_varlen_alibi_windowed`] with optional slopes and a softcap (`0.0`: none).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    let _ = (max_seqlen_q, max_seqlen_k);
    let opts = Options::new(softmax_scale, window_size_left, window_size_right)
        .with_alibi(alibi_slopes)?
        .with_softcap(softcap)
        .with_varlen(seqlens_q, seqlens_k)?;
    apply(q, k, v, opts)
}

/// Attention of a packed batch of queries over a **paged** KV cache, for inference engines:
/// `q [total_q, hq, d]` (sequence `i` is rows `seqlens_q[i]..seqlens_q[i + 1]`), `k`, `v
/// [num_blocks, page_block_size, hk, d]` with sequence `i`'s
/// `seqlens_k[i + 1] - seqlens_k[i]` keys in the pages `block_table[i]` lists (`[b, max_blocks]`,
/// u32 or i32), causal bottom-right when `window_size_right` is `Some(0)` (and no left bound).
/// Any page size. The cache is only read. `mm_prefix_ranges` (candle-flash-attn's mask bypass) is
/// not supported: `Some` is an error. No backward (an inference op). CPU and CUDA tensors; when
/// every sequence has the same number of queries (decoding) the batch is one call, else one call a
/// sequence.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_paged_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    block_table: &Tensor,
    mm_prefix_ranges: Option<&Tensor>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    page_block_size: usize,
    softcap: Option<f32>,
) -> Result<Tensor> {
    let _ = (max_seqlen_q, max_seqlen_k);
    if mm_prefix_ranges.is_some() {
        candle::bail!("flash-attn-candle does not support mm_prefix_ranges");
    }
    if k.dims().get(1) != Some(&page_block_size) {
        candle::bail!("k is {:?}; its dimension 1 must be page_block_size {page_block_size}", k.dims());
    }
    let (cq, ck) = (cumulative("seqlens_q", seqlens_q)?, cumulative("seqlens_k", seqlens_k)?);
    if cq.len() != ck.len() || cq.is_empty() {
        candle::bail!("seqlens_q and seqlens_k must both hold b + 1 entries");
    }
    let table = match block_table.dtype() {
        DType::U32 | DType::I64 | DType::U8 => block_table.to_dtype(DType::I64)?,
        DType::I32 => block_table.to_dtype(DType::I64)?,
        dt => candle::bail!("block_table must hold integers, got {dt:?}"),
    };
    let table: Vec<Vec<i64>> = table.to_vec2::<i64>()?;
    let opts = Options::new(softmax_scale, window_size_left, window_size_right).with_softcap(softcap.unwrap_or(0.0));
    let b = cq.len() - 1;
    let width = table.first().map_or(0, Vec::len);
    let mut flat = Vec::with_capacity(b * width);
    for i in 0..b {
        let row = table.get(i).ok_or_else(|| Error::Msg(format!("block_table has no row {i}")))?;
        for &x in row {
            flat.push(i32::try_from(x).map_err(|_| Error::Msg(format!("block_table entry {x} is out of range")))?);
        }
    }
    let lens_q: Vec<usize> = cq.windows(2).map(|w| (w[1] - w[0]).max(0) as usize).collect();
    let seqlens: Vec<i32> = ck.windows(2).map(|w| w[1] - w[0]).collect();
    if cq.windows(2).any(|w| w[1] < w[0]) || cq[b] as usize > q.dim(0)? {
        candle::bail!("seqlens_q is not a valid cumulative length list for q {:?}", q.dims());
    }
    let (hq, d) = (q.dim(1)?, q.dim(2)?);
    // Decoding (every sequence the same number of queries): one call over the whole batch.
    if lens_q.iter().all(|&l| l == lens_q[0]) && cq[b] as usize == q.dim(0)? {
        let sq = lens_q[0];
        let q4 = q.reshape((b, sq, hq, d))?;
        return paged_call(&q4, k, v, &seqlens, (&flat, width), &opts)?.reshape((b * sq, hq, ()));
    }
    let mut outs = Vec::with_capacity(b);
    for i in 0..b {
        let qi = q.narrow(0, cq[i] as usize, lens_q[i])?.unsqueeze(0)?;
        let row = &flat[i * width..(i + 1) * width];
        outs.push(paged_call(&qi, k, v, &seqlens[i..i + 1], (row, width), &opts)?.squeeze(0)?);
    }
    Tensor::cat(&outs, 0)
}

/// `q [b, sq, hq, d]` over the paged cache: sequence `i` has `seqlens[i]` keys in the pages of
/// row `i` of `table` (`[b, width]`, flattened). CPU or CUDA.
fn paged_call(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens: &[i32],
    table: (&[i32], usize),
    opts: &Options,
) -> Result<Tensor> {
    match q.device() {
        candle::Device::Cpu => paged_cpu(q, k, v, seqlens, table, opts),
        #[cfg(feature = "cuda")]
        candle::Device::Cuda(_) => gpu::paged(q, k, v, seqlens, table, opts),
        other => candle::bail!("flash_attn_varlen_paged_windowed does not run on {other:?}"),
    }
}

/// [`paged_call`] on the CPU.
fn paged_cpu(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens: &[i32],
    table: (&[i32], usize),
    opts: &Options,
) -> Result<Tensor> {
    let q = q.contiguous()?;
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (Storage::Cpu(qs), Storage::Cpu(ks), Storage::Cpu(vs)) = (&*qs, &*ks, &*vs) else {
        candle::bail!("flash_attn_varlen_paged_windowed: q, k and v must share one device");
    };
    check_dtypes(qs.dtype(), ks.dtype(), vs.dtype())?;
    let spec = opts.spec();
    macro_rules! go {
        ($t:ty) => {{
            let block_table = flash_attn::Tensor::new(table.0, &[seqlens.len(), table.1]);
            let cache = KvCache::<$t>::new(seqlens).paged(block_table);
            let res = flash_attn::kvcache::forward_readonly(
                &spec,
                &view::<$t>(qs, ql)?,
                &view(ks, kl)?,
                &view(vs, vl)?,
                &cache,
            )
            .map_err(wrap)?;
            Tensor::from_vec(res.out, res.out_shape, q.device())
        }};
    }
    match qs.dtype() {
        DType::F32 => go!(f32),
        DType::F16 => go!(half::f16),
        DType::BF16 => go!(half::bf16),
        dt => candle::bail!("flash-attn takes f32, f16 and bf16 on the CPU, got {dt:?}"),
    }
}
