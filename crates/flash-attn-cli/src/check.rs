//! `flash-attn check`: random cases through a backend, compared with the f64 oracle under the
//! numerics contract (DESIGN §2), via `flash_attn::check`: the forward pass and, unless
//! `--forward-only`, the backward pass, about a third of the cases with dropout.
//!
//! On `--device cuda` the cases are restricted to what the CUDA backend supports (f16/bf16,
//! `d == dv` a multiple of 8 up to 128, or 256 with `--forward-only`; strides in multiples of 8
//! elements; block masks, softcap, ALiBi and dropout included) and run on GPU 0, forward and
//! backward; the oracle runs on the host.

use std::fmt;
use std::process::ExitCode;

use clap::Args;
use flash_attn::check::{Case, Rng, Storage};
use flash_attn::{DType, Dropout};

use crate::progress::Progress;
use crate::{gpu, Device, Result};

/// Arguments of `flash-attn check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Number of random cases.
    #[arg(long, default_value_t = 200)]
    cases: usize,

    /// Seed of the case generator; the same seed gives the same cases.
    #[arg(long, default_value_t = 0)]
    seed: u64,

    /// Backend to check. `cuda` checks its forward pass on the cases it supports.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,

    /// Check the forward pass only (no backward, no dropout); implied by `--device cuda`.
    #[arg(long)]
    forward_only: bool,
}

/// Share of the cases whose backward runs with dropout.
const DROPOUT_SHARE: f64 = 1.0 / 3.0;
/// Dropout probabilities drawn for those cases.
const DROPOUT_PS: [f32; 3] = [0.1, 0.3, 0.5];
/// Mixed into a case's seed to draw its dropout, so that the cases themselves (and the data
/// behind them) are the same with and without `--forward-only`.
const DROPOUT_STREAM: u64 = 0x0D60_9047_D60F_F5E7;

/// Runs `flash-attn check`: prints each failing case and a closing `N passed, M failed`, where a
/// case passes only if its forward and (unless `--forward-only`) its backward pass both meet the
/// contract; exit code 1 if any case failed.
pub fn main(args: &CheckArgs) -> Result<ExitCode> {
    let gpu_name = args.device.ensure_available()?;
    let cuda = args.device == Device::Cuda;
    if !cuda {
        // A bad FLASH_ATTN_CPU_ISA fails every case alike: say so once, as a usage error.
        flash_attn::cpu::Isa::default_for_process()?;
    }
    if let Some(name) = gpu_name {
        println!(
            "cuda: {name}; cases restricted to what the CUDA backend supports \
             (f16/bf16, d = dv a multiple of 8 up to {})",
            if args.forward_only { 256 } else { 128 }
        );
    }
    let forward_only = args.forward_only;
    let mut rng = Rng::new(args.seed);
    let progress = Progress::bar(args.cases as u64, "check");
    let (mut passed, mut failed) = (0usize, 0usize);
    for n in 0..args.cases {
        let case = if cuda { random_cuda_case(&mut rng, forward_only) } else { Case::random(&mut rng) };
        let dropout = if forward_only { None } else { random_dropout(&case) };
        let mut failures = Vec::new();
        let forward = if cuda { gpu::run_case(&case) } else { case.run_cpu().map_err(Into::into) };
        match forward {
            Ok(report) if report.passed() => {}
            Ok(report) => failures.push(format!("forward: {report}")),
            Err(e) => failures.push(format!("forward: error: {e}")),
        }
        if !forward_only {
            let backward = if cuda {
                gpu::run_case_backward(&case, dropout)
            } else {
                case.run_cpu_backward(dropout).map_err(Into::into)
            };
            match backward {
                Ok(report) if report.passed() => {}
                Ok(report) => failures.push(format!("backward: {report}")),
                Err(e) => failures.push(format!("backward: error: {e}")),
            }
        }
        if failures.is_empty() {
            passed += 1;
        } else {
            failed += 1;
            let dropout = DropoutLabel(dropout);
            progress.suspend(|| println!("FAILED case {n}: {case}{dropout}: {}", failures.join("; ")));
        }
        progress.inc();
    }
    drop(progress);
    println!("{passed} passed, {failed} failed");
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// Dropout for the backward pass of `case`: on for about [`DROPOUT_SHARE`] of the cases, with `p`
/// from [`DROPOUT_PS`] and a random seed and offset, all drawn from the case's own seed.
fn random_dropout(case: &Case) -> Option<Dropout> {
    let mut rng = Rng::new(case.seed ^ DROPOUT_STREAM);
    if !rng.chance(DROPOUT_SHARE) {
        return None;
    }
    let p = rng.pick(&DROPOUT_PS);
    let seed = rng.next_u64();
    // The offset is 32 bits: keep the high half of a draw.
    let offset = (rng.next_u64() >> 32) as u32;
    Some(Dropout { p, seed, offset })
}

/// A random case inside what the CUDA kernels support: f16 or bf16, `d == dv` a multiple of 8 (half
/// the cases 64 or 128, the compiled tile widths; the others any multiple of 8 up to 128, or 256
/// when only the forward runs, padded by the kernels), row strides in multiples of
/// 8 elements; about a third of the cases get sequences up to 400 long (several query and key
/// tiles, ragged tails). The other options (GQA, varlen with empty sequences, both causal
/// alignments, windows, softcap, ALiBi, scale, strided layouts) are drawn as for the CPU.
fn random_cuda_case(rng: &mut Rng, forward_only: bool) -> Case {
    let mut c = Case::random(rng);
    c.dtype = rng.pick(&[DType::BF16, DType::F16]);
    let widest = if forward_only { 256 } else { 128 };
    c.d = if rng.chance(0.5) { rng.pick(&[64, 128]) } else { 8 * rng.range(1, widest / 8) };
    c.dv = c.d;
    if rng.chance(0.3) {
        for s in c.seqlens.iter_mut() {
            *s = (rng.range(1, 400), rng.range(1, 400));
        }
        if !c.varlen {
            if let Some(&first) = c.seqlens.first() {
                c.seqlens.iter_mut().for_each(|s| *s = first);
            }
        }
    }
    if let Storage::Strided { .. } = c.storage {
        c.storage = Storage::Strided { pad: rng.pick(&[0, 8]) };
    }
    c
}

/// ` dropout(p=…, seed=…, offset=…)` after a case's description, or nothing.
struct DropoutLabel(Option<Dropout>);

impl fmt::Display for DropoutLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(d) => write!(f, " dropout(p={}, seed={}, offset={})", d.p, d.seed, d.offset),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn about_a_third_of_the_cases_get_dropout_with_the_listed_probabilities() {
        let mut rng = Rng::new(1);
        let drawn: Vec<Option<Dropout>> = (0..600).map(|_| random_dropout(&Case::random(&mut rng))).collect();
        let on = drawn.iter().flatten().count();
        assert!((150..250).contains(&on), "{on} of 600");
        assert!(drawn.iter().flatten().all(|d| DROPOUT_PS.contains(&d.p)));
    }

    #[test]
    fn cuda_cases_stay_inside_what_the_cuda_kernels_support() {
        let mut rng = Rng::new(3);
        for _ in 0..500 {
            let forward_only = rng.chance(0.5);
            let c = random_cuda_case(&mut rng, forward_only);
            assert!(matches!(c.dtype, DType::BF16 | DType::F16), "{c}");
            let widest = if forward_only { 256 } else { 128 };
            assert!(c.d.is_multiple_of(8) && (8..=widest).contains(&c.d) && c.dv == c.d, "{c}");
            if let Storage::Strided { pad } = c.storage {
                assert_eq!(pad % 8, 0, "{c}");
            }
            if !c.varlen {
                assert!(c.seqlens.windows(2).all(|w| w[0] == w[1]), "{c}");
            }
        }
    }

    #[test]
    fn a_case_always_gets_the_same_dropout() {
        let case = Case::random(&mut Rng::new(5));
        assert_eq!(random_dropout(&case), random_dropout(&case));
    }
}
