//! The `--dtype` of the command line: the library's float types, or FP8 (e4m3).
//!
//! The library has two entry points with different element types: `forward` over `f32`, `f16` or
//! `bf16` ([`DType`]), and `forward_fp8` over e4m3 inputs with per-tensor descale factors and a
//! `bf16` output (forward only; docs/semantics.md, "FP8 inputs"). This type names either, so a
//! subcommand can dispatch on one flag.

use std::fmt;
use std::str::FromStr;

use flash_attn::DType;

/// The element type a command runs attention in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputDType {
    /// `f32`, `f16` or `bf16`: `out` in the same type, forward and backward.
    Float(DType),
    /// FP8 e4m3 (`float8_e4m3fn`) inputs with per-tensor descale factors, `out` in `bf16`; forward
    /// only.
    Fp8E4m3,
}

/// Names `--dtype` takes for [`InputDType::Fp8E4m3`]; the first is the one printed.
const FP8_NAMES: [&str; 4] = ["fp8e4m3", "fp8", "e4m3", "float8_e4m3fn"];

/// What the help texts list.
pub const DTYPE_VALUES: &str = "f32|f16|bf16|fp8e4m3";

impl InputDType {
    /// The name used on the command line and in JSON (`f32`, `f16`, `bf16`, `fp8e4m3`).
    pub fn name(self) -> &'static str {
        match self {
            InputDType::Float(d) => d.name(),
            InputDType::Fp8E4m3 => FP8_NAMES[0],
        }
    }
}

impl From<DType> for InputDType {
    fn from(d: DType) -> Self {
        InputDType::Float(d)
    }
}

impl fmt::Display for InputDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for InputDType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if FP8_NAMES.contains(&s) {
            return Ok(InputDType::Fp8E4m3);
        }
        s.parse::<DType>()
            .map(InputDType::Float)
            .map_err(|_| format!("unknown dtype `{s}` (expected f32, f16, bf16 or fp8e4m3)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_aliases_parse_to_one_name() {
        for alias in ["fp8e4m3", "fp8", "e4m3", "float8_e4m3fn"] {
            assert_eq!(alias.parse(), Ok(InputDType::Fp8E4m3), "{alias}");
        }
        assert_eq!(InputDType::Fp8E4m3.to_string(), "fp8e4m3");
    }

    #[test]
    fn float_names_parse_as_the_library_does() {
        assert_eq!("bfloat16".parse(), Ok(InputDType::Float(DType::BF16)));
        assert_eq!(InputDType::Float(DType::F16).name(), "f16");
        let err = "fp4".parse::<InputDType>().unwrap_err();
        assert!(err.contains("fp8e4m3"), "{err}");
    }
}
