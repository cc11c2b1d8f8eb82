//! Element types the kernels accept: `f32`, `f16` and `bf16`.
//!
//! Every backend computes in `f32` (scores, softmax statistics and the output accumulator) and
//! converts at the edges: inputs are widened when a tile is loaded, outputs rounded once when
//! the final normalisation is written.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// The data types attention runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
}

impl DType {
    /// Lower-case name as used on the command line (`f32`, `f16`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The additive tolerance `eps_T` of the numerics contract (DESIGN §2), relative to the
    /// magnitude of the reference: `max|ours - oracle| <= 2 * max|naive_T - oracle| + eps_T *
    /// max(1, magnitude)` (see `docs/semantics.md`).
    ///
    /// Four units in the last place near 1 for the half types. For `f32`, `2^-18` (32 ulps): in
    /// f32 the naive error is itself a few ulps, so a floor of a few ulps would fail on the
    /// rounding FlashAttention adds by design — `lse` rounded and subtracted from large scores
    /// when recomputing `P`, `D = rowsum(dO ∘ O)` from the rounded `O` — while still catching
    /// any algorithmic error, which shows at 1e-4 and above.
    pub fn contract_eps(self) -> f64 {
        match self {
            DType::F32 => 1.0 / (1u32 << 18) as f64,
            DType::F16 => 4.0 * f16::EPSILON.to_f64(),
            DType::BF16 => 4.0 * bf16::EPSILON.to_f64(),
        }
    }
}

impl DType {
    /// `eps_T` for gradients: `2^-16` for `f32`, eight units in the last place near 1 for the half
    /// types (twice the output floor). FlashAttention's backward pass adds two roundings of its
    /// own by design: `P` is recomputed from the f32 LSE, whose rounding (`ulp(|lse|)`) becomes a
    /// relative error of `P` (several f32 ulps with a large scale or ALiBi); and
    /// `D = rowsum(dO ∘ O)` comes from `O` rounded to the dtype, which leaves a residue of about
    /// `eps_T · |D|` where the exact gradient is 0 (one visible key per row) — where the naive
    /// error is exactly 0 too.
    pub fn contract_eps_grad(self) -> f64 {
        match self {
            DType::F32 => 1.0 / (1u32 << 16) as f64,
            other => 2.0 * other.contract_eps(),
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" | "fp32" | "float32" => Ok(DType::F32),
            "f16" | "fp16" | "float16" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            other => Err(format!("unknown dtype `{other}` (expected f32, f16 or bf16)")),
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// An element type of `q`, `k`, `v` and `out`: one of `f32`, [`half::f16`], [`half::bf16`].
///
/// Sealed: the kernels are written for exactly these three.
pub trait Element: Copy + Send + Sync + Default + PartialEq + std::fmt::Debug + sealed::Sealed + 'static {
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// Widen to `f32` (exact).
    fn to_f32(self) -> f32;
    /// Round from `f32` to nearest even.
    fn from_f32(x: f32) -> Self;
    /// Round from `f64` to nearest (through `f32` for the half types).
    fn from_f64(x: f64) -> Self;
    /// Widen to `f64` (exact).
    fn to_f64(self) -> f64 {
        self.to_f32() as f64
    }
    /// Neither infinite nor NaN (a bit test, no conversion).
    fn is_finite(self) -> bool;
    /// Widen a slice to `f32` (vectorised, with run-time F16C detection for `f16`); lengths equal.
    fn widen_slice(src: &[Self], dst: &mut [f32]);
    /// The slice itself when the type is `f32`, so kernels can read it in place.
    fn as_f32(src: &[Self]) -> Option<&[f32]> {
        let _ = src;
        None
    }
    /// Round a slice from `f32` (vectorised where the CPU allows); lengths equal.
    fn narrow_slice(src: &[f32], dst: &mut [Self]);
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        f32::is_finite(self)
    }
    #[inline]
    fn widen_slice(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[inline]
    fn as_f32(src: &[Self]) -> Option<&[f32]> {
        Some(src)
    }
    #[inline]
    fn narrow_slice(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

/// `f16` and `bf16`: the same conversions through `half`.
macro_rules! impl_half_element {
    ($t:ty, $tag:expr) => {
        impl Element for $t {
            const DTYPE: DType = $tag;
            #[inline(always)]
            fn to_f32(self) -> f32 {
                <$t>::to_f32(self)
            }
            #[inline(always)]
            fn from_f32(x: f32) -> Self {
                <$t>::from_f32(x)
            }
            #[inline(always)]
            fn from_f64(x: f64) -> Self {
                <$t>::from_f64(x)
            }
            #[inline(always)]
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }
            #[inline]
            fn widen_slice(src: &[Self], dst: &mut [f32]) {
                src.convert_to_f32_slice(dst);
            }
            #[inline]
            fn narrow_slice(src: &[f32], dst: &mut [Self]) {
                dst.convert_from_f32_slice(src);
            }
        }
    };
}
impl_half_element!(f16, DType::F16);
impl_half_element!(bf16, DType::BF16);
