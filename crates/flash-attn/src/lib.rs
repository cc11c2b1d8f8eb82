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
//! every backend and by the [`reference`] oracle:
//! - [`AttentionSpec`] says what to compute: scale, causal (bottom-right or top-left), sliding
//!   window, softcap, ALiBi, block-sparse mask, variable-length batches;
//! - [`Tensor`] / [`TensorMut`] are strided views over your buffers (`q [b, sq, hq, d]`, ...);
//! - [`forward`] / [`forward_into`] run on the CPU and return `out` and `lse`;
//! - [`mask`] is the one module deciding visibility and which tiles run;
//! - [`check`] runs random cases against the oracle under the numerics contract.

#![warn(missing_docs)]

pub mod check;
pub mod cpu;
pub mod dtype;
pub mod error;
pub mod mask;
pub mod reference;
pub mod spec;
pub mod tensor;

pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use spec::{AttentionSpec, BlockMask, Causal, Geometry, Sequence};
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
    let mut out = vec![T::default(); out_shape.iter().product()];
    let mut lse = vec![0.0f32; g.lse_len()];
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
