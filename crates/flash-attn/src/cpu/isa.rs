//! The one dispatch point of the CPU backend: which instruction-set path runs a call.
//!
//! A call resolves its [`Isa`] once, at the top of [`forward_into`](super::forward_into) /
//! [`backward_into`](super::backward_into), from the spec's request
//! ([`AttentionSpec::cpu_isa`](crate::AttentionSpec::cpu_isa)) or else the process default, and
//! hands it down to every micro-kernel (faer/pulp style): the schedule and blocking code is
//! shared, and each kernel file holds one ISA's micro-kernels next to the portable loop that is
//! the reference every SIMD path is tested against.
//!
//! The process default is the best path the CPU supports, capped by the environment variable
//! `FLASH_ATTN_CPU_ISA` (`portable`, `avx2`, `avx512`, `amx`, `neon`). The variable is a cap, never a
//! request for an instruction set the CPU lacks: naming one the CPU cannot run (or an unknown
//! name) makes every CPU call fail with [`Error::CpuIsa`], rather than silently running
//! something else.
//!
//! Every path computes the same results bit for bit across thread counts, query tile sizes (`Br`) and head
//! groupings (each element's sums are formed in one order whatever the tiling), but different
//! paths may round differently (fused or separate multiply-adds, `exp` polynomials): each meets
//! the numerics contract on its own.

use std::sync::OnceLock;

use crate::error::{Error, Result};

/// The environment variable that caps the CPU backend's instruction-set path.
pub const ENV_VAR: &str = "FLASH_ATTN_CPU_ISA";

/// An instruction-set path of the CPU backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust, vectorised by the compiler for the baseline target: the reference path.
    Portable,
    /// x86-64 AVX2 + FMA (8 lanes, 16 ymm registers).
    Avx2,
    /// x86-64 AVX-512F (16 lanes, 32 zmm registers), with AVX-512 BF16 products where the CPU
    /// has them.
    Avx512,
    /// The AVX-512 path with the `bf16` products on AMX tiles (`tdpbf16ps`, Sapphire Rapids and
    /// later; the Linux permission to use tile data is requested once per process).
    Amx,
    /// aarch64 Advanced SIMD (NEON; 4 lanes, 32 registers).
    Neon,
}

impl Isa {
    /// Every path, portable first.
    pub const ALL: [Isa; 5] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Amx, Isa::Neon];

    /// The name `FLASH_ATTN_CPU_ISA` uses for this path.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Amx => "amx",
            Isa::Neon => "neon",
        }
    }

    /// The path named `name` (as [`Isa::name`] spells it, case-insensitive).
    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|isa| isa.name().eq_ignore_ascii_case(name.trim()))
    }

    /// Whether this CPU can run the path.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Isa::Amx => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bf16")
                    && super::amx::available()
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Whether `self` is `cap` or a path below it (`portable` < `avx2` < `avx512` < `amx`;
    /// `portable` < `neon`).
    pub fn is_within(self, cap: Isa) -> bool {
        let x86 = |isa: Isa| match isa {
            Isa::Avx2 => Some(1),
            Isa::Avx512 => Some(2),
            Isa::Amx => Some(3),
            Isa::Portable | Isa::Neon => None,
        };
        self == cap || self == Isa::Portable || matches!((x86(self), x86(cap)), (Some(a), Some(b)) if a <= b)
    }

    /// The best path this CPU supports, ignoring `FLASH_ATTN_CPU_ISA`.
    pub fn best() -> Isa {
        [Isa::Amx, Isa::Avx512, Isa::Avx2, Isa::Neon]
            .into_iter()
            .find(|isa| isa.is_supported())
            .unwrap_or(Isa::Portable)
    }

    /// The process default: [`Isa::best`] capped by `FLASH_ATTN_CPU_ISA` (read once per process).
    /// An unknown name, or a path this CPU cannot run, is an [`Error::CpuIsa`].
    pub fn default_for_process() -> Result<Isa> {
        static DEFAULT: OnceLock<Result<Isa>> = OnceLock::new();
        DEFAULT.get_or_init(|| Isa::from_cap(std::env::var(ENV_VAR).ok().as_deref())).clone()
    }

    /// The default for a cap given as `FLASH_ATTN_CPU_ISA`'s value (`None`: unset).
    fn from_cap(cap: Option<&str>) -> Result<Isa> {
        let Some(value) = cap.filter(|v| !v.trim().is_empty()) else { return Ok(Isa::best()) };
        let isa = Isa::from_name(value).ok_or_else(|| {
            Error::CpuIsa(format!(
                "{ENV_VAR}={value:?} names no CPU path; use one of portable, avx2, avx512, amx, neon (this CPU supports {})",
                Isa::names(&Isa::supported())
            ))
        })?;
        if !isa.is_supported() {
            return Err(Error::CpuIsa(format!(
                "{ENV_VAR}={value} asks for {} but this CPU lacks it; it supports {}",
                isa.name(),
                Isa::names(&Isa::supported())
            )));
        }
        Ok(isa)
    }

    /// The paths this CPU supports, best first.
    pub fn supported() -> Vec<Isa> {
        [Isa::Amx, Isa::Avx512, Isa::Avx2, Isa::Neon, Isa::Portable]
            .into_iter()
            .filter(|isa| isa.is_supported())
            .collect()
    }

    /// The paths a call may request here: supported by the CPU and within the process cap, best
    /// first (tests run once per entry). Empty when `FLASH_ATTN_CPU_ISA` is invalid.
    pub fn available() -> Vec<Isa> {
        match Isa::default_for_process() {
            Ok(cap) => Isa::supported().into_iter().filter(|isa| isa.is_within(cap)).collect(),
            Err(_) => Vec::new(),
        }
    }

    /// The path a call runs on: `requested` if given (it must be supported and within the
    /// process cap), else the process default.
    pub fn resolve(requested: Option<Isa>) -> Result<Isa> {
        let default = Isa::default_for_process()?;
        let Some(isa) = requested else { return Ok(default) };
        if !isa.is_supported() {
            return Err(Error::CpuIsa(format!(
                "the {} path was requested but this CPU lacks it; it supports {}",
                isa.name(),
                Isa::names(&Isa::supported())
            )));
        }
        if !isa.is_within(default) {
            return Err(Error::CpuIsa(format!(
                "the {} path was requested but {ENV_VAR} caps the CPU paths at {}",
                isa.name(),
                default.name()
            )));
        }
        Ok(isa)
    }

    /// Whether the `bf16` products run on `bf16` pairs on this path (AVX-512 BF16's
    /// `vdpbf16ps`, AMX tiles, or on aarch64 the BF16 extension's `BFDOT`); otherwise `bf16`
    /// inputs are widened to `f32`.
    pub fn bf16_pairs(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self.avx512() {
            return std::arch::is_x86_feature_detected!("avx512bf16");
        }
        #[cfg(target_arch = "aarch64")]
        if self == Isa::Neon {
            return std::arch::is_aarch64_feature_detected!("neon") && std::arch::is_aarch64_feature_detected!("bf16");
        }
        false
    }

    /// Whether this path runs the AVX-512 kernels (`avx512`, or `amx` for all but the `bf16`
    /// products) and the CPU has AVX-512F.
    pub fn avx512(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if matches!(self, Isa::Avx512 | Isa::Amx) {
            return std::arch::is_x86_feature_detected!("avx512f");
        }
        false
    }

    /// Whether the `bf16` products run on AMX tiles on this path.
    pub fn amx(self) -> bool {
        self == Isa::Amx && self.is_supported()
    }

    fn names(list: &[Isa]) -> String {
        list.iter().map(|isa| isa.name()).collect::<Vec<_>>().join(", ")
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for isa in Isa::ALL {
            assert_eq!(Isa::from_name(isa.name()), Some(isa));
            assert_eq!(Isa::from_name(&isa.name().to_uppercase()), Some(isa));
        }
        assert_eq!(Isa::from_name("sse2"), None);
        assert!(matches!(Isa::from_cap(Some("sse2")), Err(Error::CpuIsa(_))));
    }

    #[test]
    fn the_cap_is_never_a_request_for_a_missing_path() {
        assert_eq!(Isa::from_cap(None).ok(), Some(Isa::best()));
        assert_eq!(Isa::from_cap(Some("")).ok(), Some(Isa::best()));
        for isa in Isa::ALL {
            match Isa::from_cap(Some(isa.name())) {
                Ok(got) => assert!(isa.is_supported() && got == isa),
                Err(e) => {
                    assert!(!isa.is_supported());
                    assert!(e.to_string().contains("lacks"), "{e}");
                }
            }
        }
        // Whatever the cap, the portable path is always there.
        assert!(Isa::available().contains(&Isa::Portable) || Isa::default_for_process().is_err());
    }

    #[test]
    fn requests_beyond_the_cpu_are_typed_errors() {
        for isa in Isa::ALL {
            let got = Isa::resolve(Some(isa));
            let allowed = Isa::available().contains(&isa);
            assert_eq!(got.is_ok(), allowed, "{isa}: {got:?}");
            if let Err(e) = got {
                assert!(matches!(e, Error::CpuIsa(_)), "{e:?}");
            }
        }
    }

    #[test]
    fn the_order_of_paths_is_a_cap() {
        assert!(Isa::Avx2.is_within(Isa::Avx512));
        assert!(Isa::Portable.is_within(Isa::Neon));
        assert!(!Isa::Avx512.is_within(Isa::Avx2));
        assert!(!Isa::Neon.is_within(Isa::Avx512));
        assert!(!Isa::Avx2.is_within(Isa::Portable));
        assert!(Isa::Avx512.is_within(Isa::Amx) && Isa::Avx2.is_within(Isa::Amx));
        assert!(!Isa::Amx.is_within(Isa::Avx512) && !Isa::Neon.is_within(Isa::Amx));
    }
}
