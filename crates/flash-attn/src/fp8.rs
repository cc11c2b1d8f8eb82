//! FP8 inputs: the e4m3 format, per-tensor descale factors, and the CPU forward over them.
//!
//! FlashAttention-3 runs its FP8 forward on `e4m3` inputs (PyTorch's `float8_e4m3fn`) with one
//! descale factor per tensor: the real value of an element is its e4m3 value times the tensor's
//! factor. Here [`Fp8E4m3`] is the element, [`Fp8Scales`] the factors, [`quantize`] /
//! [`dequantize`] convert per tensor, and [`forward_fp8`] is attention over the dequantized inputs
//! with the output rounded to `bf16` (docs/semantics.md, "FP8 inputs").
//!
//! ```
//! use flash_attn::{fp8, AttentionSpec, Fp8Scales, Tensor};
//!
//! let (sq, sk, h, d) = (3, 5, 1, 16);
//! let q: Vec<f32> = (0..sq * h * d).map(|i| (i as f32 * 0.37).sin()).collect();
//! let k: Vec<f32> = (0..sk * h * d).map(|i| (i as f32 * 0.11).cos()).collect();
//! let v: Vec<f32> = (0..sk * h * d).map(|i| (i as f32 * 0.05).sin() * 10.0).collect();
//! let ((q8, dq), (k8, dk), (v8, dv)) = (fp8::quantize(&q), fp8::quantize(&k), fp8::quantize(&v));
//!
//! let res = flash_attn::forward_fp8(
//!     &AttentionSpec::new().causal(),
//!     &Tensor::new(&q8, &[1, sq, h, d]),
//!     &Tensor::new(&k8, &[1, sk, h, d]),
//!     &Tensor::new(&v8, &[1, sk, h, d]),
//!     Fp8Scales { q: dq, k: dk, v: dv },
//! )?;
//! assert_eq!(res.out_shape, vec![1, sq, h, d]); // bf16
//! # Ok::<(), flash_attn::Error>(())
//! ```

use half::bf16;

use crate::error::{try_vec, Error, Result};
use crate::spec::{AttentionSpec, Geometry};
use crate::tensor::Tensor;
use crate::Output;

/// An 8-bit float in the e4m3 "fn" format of FlashAttention-3 and PyTorch's `float8_e4m3fn`:
/// 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, `0x7F` and `0xFF` are
/// NaN; largest finite value ±448, smallest normal `2^-6`, subnormals down to `2^-9`.
///
/// Equality and hashing are on the bits: `+0 != -0`, and a NaN equals itself.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Fp8E4m3(pub u8);

/// Mantissa bits of e4m3.
const MANT_BITS: u32 = 3;
/// f32 exponent field of `2^-6`, the smallest e4m3 normal.
const MIN_NORMAL_F32_EXP: u32 = 127 - 6;
/// f32 bits of `2^-6`.
const MIN_NORMAL_F32_BITS: u32 = MIN_NORMAL_F32_EXP << 23;
/// The bits of ±448 without the sign.
const MAX_BITS: u8 = 0x7E;
/// The canonical NaN (what `cvt.rn.satfinite.e4m3x2.f32` gives for NaN).
const NAN_BITS: u8 = 0x7F;

impl Fp8E4m3 {
    /// The largest finite value, `1.75 · 2^8`.
    pub const MAX: f32 = 448.0;

    /// The raw bits.
    pub fn to_bits(self) -> u8 {
        self.0
    }

    /// The value with these raw bits.
    pub fn from_bits(bits: u8) -> Self {
        Fp8E4m3(bits)
    }

    /// Whether this is NaN (`0x7F` or `0xFF`).
    pub fn is_nan(self) -> bool {
        self.0 & 0x7F == NAN_BITS
    }

    /// Widens to `f32` exactly; NaN for `0x7F` and `0xFF`.
    pub fn to_f32(self) -> f32 {
        if self.is_nan() {
            return f32::NAN;
        }
        let sign = u32::from(self.0 & 0x80) << 24;
        let exp = u32::from(self.0 >> MANT_BITS) & 0xF;
        let mant = u32::from(self.0) & 0x7;
        let magnitude = if exp == 0 {
            // Subnormal: mant · 2^-9, exact in f32.
            mant as f32 * (1.0 / 512.0)
        } else {
            // Rebias the exponent (7 → 127) and move the mantissa to the top of f32's 23 bits.
            f32::from_bits(((exp + 127 - 7) << 23) | (mant << (23 - MANT_BITS)))
        };
        f32::from_bits(magnitude.to_bits() | sign)
    }

    /// Rounds an `f32` to the nearest e4m3, ties to even, saturating as PTX
    /// `cvt.rn.satfinite.e4m3x2.f32` does: a finite value beyond ±448 after rounding, and ±inf,
    /// give ±448; NaN gives `0x7F`; the sign of zero (and of values that round to zero) is kept.
    pub fn from_f32(x: f32) -> Self {
        let bits = x.to_bits();
        let sign = ((bits >> 24) & 0x80) as u8;
        let abs = bits & 0x7FFF_FFFF;
        if abs > 0x7F80_0000 {
            return Fp8E4m3(NAN_BITS);
        }
        let magnitude = if abs >= MIN_NORMAL_F32_BITS {
            // Normal: rebias the exponent (127 → 7) in place, then drop 20 of the 23 mantissa
            // bits; a carry out of the mantissa moves into the exponent, as it should.
            let rebiased = abs - ((127 - 7) << 23);
            round_shift(rebiased, 23 - MANT_BITS).min(u32::from(MAX_BITS))
        } else if abs >= 1 << 23 {
            // Below 2^-6 (an f32 normal): count units of 2^-9. The value is
            // (2^23 + frac) · 2^(e - 150), that is (2^23 + frac) >> (141 - e) units, with
            // 141 - e >= 21 here. Rounding up to 8 units gives 0x08 = 2^-6, the smallest normal.
            let e = abs >> 23;
            let shift = 141 - e;
            if shift >= 25 {
                0 // below 2^-10: less than half a unit
            } else {
                round_shift((1 << 23) | (abs & 0x7F_FFFF), shift)
            }
        } else {
            0 // zero, or an f32 subnormal: far below half of 2^-9
        };
        Fp8E4m3(sign | magnitude as u8)
    }
}

/// `x >> shift` rounded to nearest, ties to even (`1 <= shift <= 31`).
fn round_shift(x: u32, shift: u32) -> u32 {
    let half = 1u32 << (shift - 1);
    let rem = x & ((1u32 << shift) - 1);
    let q = x >> shift;
    if rem > half || (rem == half && q & 1 == 1) {
        q + 1
    } else {
        q
    }
}

impl From<Fp8E4m3> for f32 {
    fn from(x: Fp8E4m3) -> f32 {
        x.to_f32()
    }
}

/// Per-tensor descale factors of FP8 `q`, `k`, `v` (FlashAttention-3's `descale_q/k/v`): the real
/// value of an element is its e4m3 value times its tensor's factor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8Scales {
    /// Descale factor of `q`.
    pub q: f32,
    /// Descale factor of `k`.
    pub k: f32,
    /// Descale factor of `v`.
    pub v: f32,
}

impl Default for Fp8Scales {
    /// All factors 1: the e4m3 values are the real values.
    fn default() -> Self {
        Fp8Scales { q: 1.0, k: 1.0, v: 1.0 }
    }
}

impl Fp8Scales {
    /// [`Error::Fp8Scale`] unless every factor is a positive finite number.
    pub fn validate(&self) -> Result<()> {
        for (tensor, value) in [("q", self.q), ("k", self.k), ("v", self.v)] {
            if !(value.is_finite() && value > 0.0) {
                return Err(Error::Fp8Scale { tensor, value });
            }
        }
        Ok(())
    }
}

/// Per-tensor symmetric quantization: returns the e4m3 elements and the descale factor `scale`
/// such that `x[i] ≈ q[i] · scale`.
///
/// `scale = max|x| / 448` over the finite elements, so the largest one maps to ±448; it is at
/// least `f32::MIN_POSITIVE` (so always a valid [`Fp8Scales`] factor), and 1 when there is no
/// non-zero finite element (an empty, all-zero or all-non-finite input). Each element is
/// `Fp8E4m3::from_f32(x / scale)`: rounded to nearest even; NaN becomes NaN (`0x7F`) and ±inf
/// saturates to ±448.
pub fn quantize(x: &[f32]) -> (Vec<Fp8E4m3>, f32) {
    let max = x.iter().filter(|v| v.is_finite()).fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = if max > 0.0 { (max / Fp8E4m3::MAX).max(f32::MIN_POSITIVE) } else { 1.0 };
    (x.iter().map(|&v| Fp8E4m3::from_f32(v / scale)).collect(), scale)
}

/// The real values of e4m3 elements with descale factor `scale`: `x[i].to_f32() · scale` in `f32`.
pub fn dequantize(x: &[Fp8E4m3], scale: f32) -> Vec<f32> {
    x.iter().map(|v| v.to_f32() * scale).collect()
}

/// [`dequantize`] into a fallibly allocated buffer (for inputs of any size).
fn try_dequantize(what: &'static str, x: &[Fp8E4m3], scale: f32) -> Result<Vec<f32>> {
    let mut out = try_vec(what, x.len(), 0.0f32)?;
    for (o, v) in out.iter_mut().zip(x) {
        *o = v.to_f32() * scale;
    }
    Ok(out)
}

/// Attention forward on the CPU over FP8 inputs, allocating the outputs.
///
/// Semantics (docs/semantics.md, "FP8 inputs"): attention (DESIGN §2, every option of `spec`)
/// over the dequantized inputs `q · scales.q`, `k · scales.k`, `v · scales.v`; `out` rounded to
/// `bf16`, `lse` in `f32` as for the other dtypes. `spec`'s softmax scale applies to the
/// dequantized scores (default `1/sqrt(d)`).
///
/// The CPU dequantizes each input's whole backing buffer to `f32` (keeping shapes and strides) and
/// runs the `f32` forward, so its error is that of `f32` plus the final rounding; a GPU kernel
/// that multiplies e4m3 tiles is held to the FP8 contract ([`crate::check::compare_fp8`]).
///
/// Errors: [`Error::Fp8Scale`] for a factor that is not positive and finite, then the shape and
/// option errors of [`crate::forward`] (checked before anything is allocated), or
/// [`Error::OutOfMemory`].
pub fn forward_fp8(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, Fp8E4m3>,
    k: &Tensor<'_, Fp8E4m3>,
    v: &Tensor<'_, Fp8E4m3>,
    scales: Fp8Scales,
) -> Result<Output<bf16>> {
    scales.validate()?;
    Geometry::new(spec, q, k, v)?;
    let qf = try_dequantize("q (dequantized)", q.data(), scales.q)?;
    let kf = try_dequantize("k (dequantized)", k.data(), scales.k)?;
    let vf = try_dequantize("v (dequantized)", v.data(), scales.v)?;
    let view = |data, t: &Tensor<'_, Fp8E4m3>| Tensor::with_strides(data, t.shape(), t.strides());
    let res = crate::forward::<f32>(spec, &view(&qf, q), &view(&kf, k), &view(&vf, v))?;
    let mut out = try_vec("out", res.out.len(), bf16::ZERO)?;
    for (o, &x) in out.iter_mut().zip(&res.out) {
        *o = bf16::from_f32(x);
    }
    Ok(Output { out, out_shape: res.out_shape, lse: res.lse, lse_shape: res.lse_shape })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::Rng;

    /// The 254 finite e4m3 values with their bits, ascending (`-0` and `+0` both present).
    fn finite_values() -> Vec<(f32, u8)> {
        let mut v: Vec<(f32, u8)> =
            (0..=255u8).map(Fp8E4m3).filter(|x| !x.is_nan()).map(|x| (x.to_f32(), x.0)).collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    }

    /// The e4m3 nearest to `x` by brute force over every finite value, ties to the even mantissa,
    /// saturating at ±448 (`cvt.rn.satfinite`): the expected result of `from_f32`.
    fn nearest(x: f32) -> u8 {
        if x.is_nan() {
            return NAN_BITS;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        if x.abs() >= Fp8E4m3::MAX {
            return sign | MAX_BITS; // the nearest finite value (also for inf)
        }
        let a = x.abs() as f64;
        let mut best: Option<(f64, u8)> = None;
        for (val, bits) in finite_values() {
            if val < 0.0 || val.is_sign_negative() {
                continue;
            }
            let dist = (val as f64 - a).abs();
            best = match best {
                Some((bd, bb)) if bd < dist || (bd == dist && bb & 1 == 0) => Some((bd, bb)),
                _ => Some((dist, bits)),
            };
        }
        let (_, bits) = best.unwrap_or((0.0, 0));
        sign | bits
    }

    #[test]
    fn every_bit_pattern_round_trips() {
        for bits in 0..=255u8 {
            let x = Fp8E4m3(bits);
            let back = Fp8E4m3::from_f32(x.to_f32());
            if x.is_nan() {
                assert!(x.to_f32().is_nan(), "{bits:#04x}");
                assert_eq!(back.0, NAN_BITS, "{bits:#04x}");
            } else {
                assert_eq!(back.0, bits, "{bits:#04x} -> {} -> {:#04x}", x.to_f32(), back.0);
            }
        }
    }

    #[test]
    fn known_values_decode_exactly() {
        let cases = [
            (0x00, 0.0),
            (0x01, 1.0 / 512.0),
            (0x07, 7.0 / 512.0),
            (0x08, 1.0 / 64.0),
            (0x38, 1.0),
            (0x39, 1.125),
            (0x7E, 448.0),
            (0xFE, -448.0),
            (0xB8, -1.0),
        ];
        for (bits, val) in cases {
            assert_eq!(Fp8E4m3(bits).to_f32(), val, "{bits:#04x}");
        }
        assert!(Fp8E4m3(0x80).to_f32() == 0.0 && Fp8E4m3(0x80).to_f32().is_sign_negative());
        assert!(Fp8E4m3(0x7F).to_f32().is_nan() && Fp8E4m3(0xFF).to_f32().is_nan());
    }

    #[test]
    fn special_values_convert_as_ptx_satfinite() {
        assert_eq!(Fp8E4m3::from_f32(-0.0).0, 0x80);
        assert_eq!(Fp8E4m3::from_f32(0.0).0, 0x00);
        assert_eq!(Fp8E4m3::from_f32(f32::NAN).0, 0x7F);
        assert_eq!(Fp8E4m3::from_f32(-f32::NAN).0, 0x7F);
        assert_eq!(Fp8E4m3::from_f32(f32::INFINITY).0, 0x7E);
        assert_eq!(Fp8E4m3::from_f32(f32::NEG_INFINITY).0, 0xFE);
        assert_eq!(Fp8E4m3::from_f32(f32::MAX).0, 0x7E);
        assert_eq!(Fp8E4m3::from_f32(464.0).0, 0x7E); // the tie between 448 and 480 goes to even
        assert_eq!(Fp8E4m3::from_f32(463.99997).0, 0x7E);
        assert_eq!(Fp8E4m3::from_f32(464.00003).0, 0x7E); // would be 480: saturated
        assert_eq!(Fp8E4m3::from_f32(-1e-30).0, 0x80);
        assert_eq!(Fp8E4m3::from_f32(f32::from_bits(1)).0, 0x00);
        assert_eq!(Fp8E4m3::from_f32(1.0 / 1024.0).0, 0x00); // half of 2^-9: tie to even 0
        assert_eq!(Fp8E4m3::from_f32(1.0 / 1024.0 + 1e-7).0, 0x01);
        assert_eq!(Fp8E4m3::from_f32(3.0 / 1024.0).0, 0x02); // 1.5 units: tie to even 2
        assert_eq!(Fp8E4m3::from_f32(15.0 / 1024.0).0, 0x08); // 7.5 units: up to 2^-6
    }

    /// Every midpoint between consecutive finite values, and the values just around it and around
    /// each value, in the subnormal range, the normal range and at the 448/464 saturation edge.
    #[test]
    fn boundaries_and_midpoints_round_to_nearest_even() {
        let vals: Vec<f32> = finite_values().into_iter().map(|(v, _)| v).collect();
        let mut xs = Vec::new();
        let around = |x: f32, xs: &mut Vec<f32>| {
            let b = x.to_bits();
            xs.extend([x, f32::from_bits(b.wrapping_add(1)), f32::from_bits(b.wrapping_sub(1))]);
        };
        for w in vals.windows(2) {
            let mid = ((w[0] as f64 + w[1] as f64) / 2.0) as f32; // exact: few significant bits
            around(mid, &mut xs);
            around(w[0], &mut xs);
        }
        for x in [448.0f32, 456.0, 464.0, 472.0, 480.0, 1e6, 1.0 / 1024.0, 1.0 / 64.0, 1.0 / 128.0] {
            around(x, &mut xs);
            around(-x, &mut xs);
        }
        for x in xs.into_iter().filter(|x| x.is_finite() && *x != 0.0) {
            assert_eq!(Fp8E4m3::from_f32(x).0, nearest(x), "x = {x:e} ({:#010x})", x.to_bits());
        }
    }

    #[test]
    fn random_floats_round_to_the_nearest_value() {
        let mut rng = Rng::new(0xF8);
        for _ in 0..20000 {
            // Random bits over every exponent, and values spread over e4m3's range.
            let x = if rng.chance(0.5) {
                f32::from_bits(rng.next_u64() as u32)
            } else {
                let e = rng.range(0, 24) as i32 - 14;
                ((rng.uniform() * 2.0 - 1.0) * 2f64.powi(e)) as f32
            };
            let got = Fp8E4m3::from_f32(x).0;
            if x.is_nan() {
                assert_eq!(got, NAN_BITS);
            } else {
                assert_eq!(got, nearest(x), "x = {x:e} ({:#010x})", x.to_bits());
            }
        }
    }

    #[test]
    fn quantize_then_dequantize_is_within_two_to_the_minus_four() {
        let mut rng = Rng::new(11);
        let x: Vec<f32> = (0..4096).map(|_| (rng.normal() * 3.0) as f32).collect();
        let (q, scale) = quantize(&x);
        assert_ne!(scale, 1.0);
        let max = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_eq!(q.iter().map(|v| v.to_f32().abs()).fold(0.0, f32::max), 448.0);
        let back = dequantize(&q, scale);
        let mut checked = 0;
        for (&a, &b) in x.iter().zip(&back) {
            // The e4m3 normal range: |x / scale| >= 2^-6.
            if a.abs() >= max * (1.0 / 64.0) / 448.0 {
                assert!(((a - b) / a).abs() <= 1.0 / 16.0, "{a} -> {b}");
                checked += 1;
            }
        }
        assert!(checked > 4000);
    }

    #[test]
    fn quantize_handles_zero_empty_and_non_finite_inputs() {
        assert_eq!(quantize(&[]), (vec![], 1.0));
        assert_eq!(quantize(&[0.0, -0.0]), (vec![Fp8E4m3(0), Fp8E4m3(0x80)], 1.0));
        let (q, scale) = quantize(&[2.0, f32::NAN, f32::NEG_INFINITY, -1.0]);
        assert_eq!(scale, 2.0 / 448.0);
        assert_eq!(q, vec![Fp8E4m3(0x7E), Fp8E4m3(0x7F), Fp8E4m3(0xFE), Fp8E4m3::from_f32(-224.0)]);
        let (q, scale) = quantize(&[1e-44]); // an f32 subnormal: the scale stays a normal float
        assert_eq!(scale, f32::MIN_POSITIVE);
        assert_eq!(q, vec![Fp8E4m3(0)]);
        assert!(Fp8Scales { q: scale, k: 1.0, v: 1.0 }.validate().is_ok());
    }

    #[test]
    fn scales_must_be_positive_and_finite() {
        assert!(Fp8Scales::default().validate().is_ok());
        for bad in [0.0, -0.0, -1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for s in [Fp8Scales { q: bad, ..Default::default() }, Fp8Scales { v: bad, ..Default::default() }] {
                assert!(matches!(s.validate(), Err(Error::Fp8Scale { .. })), "{s:?}");
            }
        }
    }
}
