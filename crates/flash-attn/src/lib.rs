//! # flash-attn
//!
//! FlashAttention in Rust: exact attention `O = softmax(scale · Q Kᵀ + bias) V`, computed tile by
//! tile with an online softmax so that the `N × N` score matrix never exists in memory.
//!
//! ```
//! use flash_attn::{AttentionSpec, Tensor};
//!
//! // q: [b, sq, hq, d], k: [b, sk, hk, d], v: [b, sk, hk, dv], row-major.
//! let (b, sq, sk, hq, hk, d) = (1, 3, 5, 4, 2, 8);
//! let q: Vec<f32> = (0..b * sq * hq * d).map(|i| (i as f32 * 0.37).sin()).collect();
//! let k: Vec<f32> = (0..b * sk * hk * d).map(|i| (i as f32 * 0.11).cos()).collect();
//! let v: Vec<f32> = (0..b * sk * hk * d).map(|i| (i as f32 * 0.05).sin()).collect();
//!
//! let spec = AttentionSpec::new().causal(); // bottom-right aligned, grouped-query heads
//! let res = flash_attn::forward(
//!     &spec,
//!     &Tensor::new(&q, &[b, sq, hq, d]),
//!     &Tensor::new(&k, &[b, sk, hk, d]),
//!     &Tensor::new(&v, &[b, sk, hk, d]),
//! )?;
//! assert_eq!(res.out_shape, vec![b, sq, hq, d]);
//! assert_eq!(res.lse.len(), b * hq * sq); // [b, hq, sq], natural log
//!
//! // The same problem through the oracle (Algorithm 0 in f64).
//! let oracle = flash_attn::reference::forward(
//!     &spec,
//!     &Tensor::new(&q, &[b, sq, hq, d]),
//!     &Tensor::new(&k, &[b, sk, hk, d]),
//!     &Tensor::new(&v, &[b, sk, hk, d]),
//! )?;
//! for (o, r) in res.out.iter().zip(&oracle.out) {
//!     assert!((*o as f64 - r).abs() < 1e-5);
//! }
//! # Ok::<(), flash_attn::Error>(())
//! ```
//!
//! The semantics (shapes, masks, score modifiers, numerics) are those of DESIGN §2, shared by
//! every backend and by the oracle in [`mod@reference`]:
//! - [`AttentionSpec`] says what to compute: scale, causal (bottom-right or top-left), sliding
//!   window, softcap, ALiBi, block-sparse mask, variable-length batches;
//! - [`Tensor`] / [`TensorMut`] are strided views over your buffers (`q [b, sq, hq, d]`, ...);
//! - [`forward`] / [`forward_into`] run on the CPU and return `out` and `lse`;
//! - [`backward`] / [`forward_train`] + [`Saved::backward`] give the gradients by recomputation,
//!   with dropout from [`philox`] regenerated rather than stored;
//! - [`forward_fp8`] runs the forward on FP8 (e4m3) inputs with per-tensor descale factors
//!   ([`mod@fp8`]), output in bf16;
//! - [`mask`] is the one module deciding visibility and which tiles run;
//! - [`check`] runs random cases against the oracle under the numerics contract;
//! - [`kvcache`] is inference over a KV cache (contiguous or paged, in-place append, rotary,
//!   split-KV / Flash-Decoding with GQA packing);
//! - [`io_model`] predicts HBM traffic of standard attention and FlashAttention (Theorem 2).

#![warn(missing_docs)]

pub mod check;
pub mod cpu;
#[cfg(feature = "cuda-backend")]
pub mod cuda;
pub mod dtype;
pub mod error;
pub mod fp8;
pub mod io_model;
pub mod kvcache;
pub mod mask;
pub mod philox;
pub mod reference;
pub mod ring;
pub mod spec;
pub mod tensor;

pub use dtype::{DType, Element};
use error::{numel, try_vec};
pub use error::{Error, Result};
pub use fp8::{forward_fp8, Fp8E4m3, Fp8Scales};
pub use spec::{AttentionSpec, BlockMask, Causal, Dropout, Geometry, Sequence};
pub use tensor::{Tensor, TensorMut};

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;

/// The result of a forward pass.
#[derive(Debug, Clone, PartialEq)]
pub struct Output<T> {
    /// `[b, sq, hq, dv]` (or `[tq, hq, dv]` for varlen), contiguous, in the input dtype.
    pub out: Vec<T>,
    /// Shape of `out`.
    pub out_shape: Vec<usize>,
    /// Log-sum-exp of each row's scores (natural log), `[b, hq, sq]` (or `[hq, tq]`); `-inf` for
    /// rows that see no key. The backward pass recomputes probabilities from it.
    pub lse: Vec<f32>,
    /// Shape of `lse`.
    pub lse_shape: Vec<usize>,
}

/// Attention forward on the CPU, allocating the outputs.
///
/// Returns a typed [`Error`] for any invalid shape, stride or option; never panics on input.
pub fn forward<T: Element>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
) -> Result<Output<T>> {
    let g = Geometry::new(spec, q, k, v)?;
    let out_shape = g.out_shape();
    let lse_shape = g.lse_shape();
    let mut out = try_vec("out", numel("out", &out_shape)?, T::default())?;
    let mut lse = try_vec("lse", g.lse_len(), 0.0f32)?;
    cpu::forward_into(&g, q, k, v, &mut TensorMut::new(&mut out, &out_shape), &mut lse)?;
    Ok(Output { out, out_shape, lse, lse_shape })
}

/// Attention forward on the CPU into caller-provided buffers: `out` may be strided (unit stride in
/// the last dimension, no overlapping elements); `lse` is contiguous `[b, hq, sq]` or `[hq, tq]`.
pub fn forward_into<T: Element>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    out: &mut TensorMut<'_, T>,
    lse: &mut [f32],
) -> Result<()> {
    let g = Geometry::new(spec, q, k, v)?;
    cpu::forward_into(&g, q, k, v, out, lse)
}

/// Gradients of a backward pass, in the input dtype and the contiguous layouts of `q`, `k`, `v`.
#[derive(Debug, Clone, PartialEq)]
pub struct Gradients<T> {
    /// `dq`, shaped like `q`.
    pub dq: Vec<T>,
    /// Shape of `dq`.
    pub dq_shape: Vec<usize>,
    /// `dk`, shaped like `k`: GQA gradients already summed into the `hk` heads.
    pub dk: Vec<T>,
    /// Shape of `dk`.
    pub dk_shape: Vec<usize>,
    /// `dv`, shaped like `v`.
    pub dv: Vec<T>,
    /// Shape of `dv`.
    pub dv_shape: Vec<usize>,
}

/// Attention backward on the CPU, allocating the gradients: `dq, dk, dv` from the inputs, the
/// forward's `out` and `lse`, and `dout` (shaped like `out`).
///
/// Scores and probabilities are recomputed tile by tile from `lse` (nothing `N × N` is stored);
/// extra memory is an `f32` `dQ` accumulator, one float per query row, and per thread its tiles
/// (for bf16, a cache of packed query tiles of at most 4 MiB per thread). Results are bitwise
/// identical across runs and thread counts. With dropout, the keep mask is regenerated from the
/// spec's `(seed, offset)`, which must be those of the forward pass.
pub fn backward<T: Element>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    out: &Tensor<'_, T>,
    lse: &[f32],
    dout: &Tensor<'_, T>,
) -> Result<Gradients<T>> {
    let g = Geometry::new(spec, q, k, v)?;
    let (dq_shape, dk_shape, dv_shape) = (g.q_shape(g.d), g.k_shape(g.d), g.k_shape(g.dv));
    let mut dq = try_vec("dq", numel("dq", &dq_shape)?, T::default())?;
    let mut dk = try_vec("dk", numel("dk", &dk_shape)?, T::default())?;
    let mut dv = try_vec("dv", numel("dv", &dv_shape)?, T::default())?;
    cpu::backward_into(
        &g,
        q,
        k,
        v,
        out,
        lse,
        dout,
        &mut TensorMut::new(&mut dq, &dq_shape),
        &mut TensorMut::new(&mut dk, &dk_shape),
        &mut TensorMut::new(&mut dv, &dv_shape),
    )?;
    Ok(Gradients { dq, dq_shape, dk, dk_shape, dv, dv_shape })
}

/// Attention backward on the CPU into caller-provided (possibly strided) `dq`, `dk`, `dv`.
#[allow(clippy::too_many_arguments)]
pub fn backward_into<T: Element>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    out: &Tensor<'_, T>,
    lse: &[f32],
    dout: &Tensor<'_, T>,
    dq: &mut TensorMut<'_, T>,
    dk: &mut TensorMut<'_, T>,
    dv: &mut TensorMut<'_, T>,
) -> Result<()> {
    let g = Geometry::new(spec, q, k, v)?;
    cpu::backward_into(&g, q, k, v, out, lse, dout, dq, dk, dv)
}

/// What the backward pass needs from a training forward: `out`, `lse` and the dropout setting
/// (seed and offset) that generated the keep mask.
#[derive(Debug, Clone, PartialEq)]
pub struct Saved<T> {
    /// The forward's output and log-sum-exp.
    pub output: Output<T>,
    /// The dropout the forward applied, if any.
    pub dropout: Option<Dropout>,
}

/// A training forward on the CPU: [`forward`], keeping what [`Saved::backward`] needs.
pub fn forward_train<T: Element>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
) -> Result<Saved<T>> {
    Ok(Saved { output: forward(spec, q, k, v)?, dropout: spec.dropout_setting() })
}

impl<T: Element> Saved<T> {
    /// The backward pass of the forward that produced `self`, for the same `spec`, `q`, `k`, `v`.
    ///
    /// A spec whose dropout differs from the forward's is an error: the keep mask could not be
    /// regenerated.
    pub fn backward(
        &self,
        spec: &AttentionSpec<'_>,
        q: &Tensor<'_, T>,
        k: &Tensor<'_, T>,
        v: &Tensor<'_, T>,
        dout: &Tensor<'_, T>,
    ) -> Result<Gradients<T>> {
        if spec.dropout_setting() != self.dropout {
            return Err(Error::Mismatch(format!(
                "the spec's dropout {:?} differs from the {:?} the forward pass used",
                spec.dropout_setting(),
                self.dropout
            )));
        }
        let out = Tensor::new(&self.output.out, &self.output.out_shape);
        backward(spec, q, k, v, &out, &self.output.lse, dout)
    }
}
