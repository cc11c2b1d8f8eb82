//! `flash-attn check`: random cases through a backend, compared with the f64 oracle under the
//! numerics contract (DESIGN §2), via `flash_attn::check`: the forward pass and, unless
//! `--forward-only`, the backward pass, about a third of the cases with dropout.
//!
//! On `--device cuda` the cases are restricted to what the CUDA backend supports (f16/bf16,
//! `d == dv` a multiple of 8 up to 128, or 256 with `--forward-only`; strides in multiples of 8
//! elements; block masks, softcap, ALiBi and dropout included) and run on GPU 0, forward and
//! backward; the oracle runs on the host.
//!
//! `--dtype` fixes the element type of every case. `fp8e4m3` checks the FP8 forward
//! (`flash_attn::forward_fp8`, on cuda the FP8 kernel): each case's inputs are drawn in f32 and
//! quantized per tensor, and `out` and `lse` are judged by the FP8 contract (`compare_fp8` against
//! the oracle and `naive_fp8`, both on the dequantized inputs). On cuda those cases stay inside what
//! the FP8 kernel supports; a GPU that cannot run it (the library's `Unsupported`: it needs sm_90a)
//! skips them, with one line per distinct reason, rather than failing them.

use std::collections::BTreeSet;
use std::fmt;
use std::process::ExitCode;

use clap::Args;
use flash_attn::check::{report_fp8, Case, CaseData, CaseReport, Rng, Storage};
use flash_attn::{fp8, reference, DType, Dropout, Fp8Scales, Tensor};

use crate::dtype::{InputDType, DTYPE_VALUES};
use crate::progress::Progress;
use crate::{gpu, CliError, Device, Result};

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

    /// Check the forward pass only (no backward, no dropout); implied by `--dtype fp8e4m3`.
    #[arg(long)]
    forward_only: bool,

    /// Element type of every case (default: each case draws f32, f16 or bf16; on cuda f16 or
    /// bf16). `fp8e4m3` (aliases `fp8`, `e4m3`, `float8_e4m3fn`): the FP8 forward on inputs drawn
    /// in f32 and quantized per tensor, judged by the FP8 contract; on cuda only cases the FP8
    /// kernel supports (fixed length, d = dv a multiple of 16 up to 256, no softcap, ALiBi or block
    /// mask), skipped where the GPU cannot run it (it needs sm_90a).
    #[arg(long, value_name = DTYPE_VALUES)]
    dtype: Option<InputDType>,
}

/// Share of the cases whose backward runs with dropout.
const DROPOUT_SHARE: f64 = 1.0 / 3.0;
/// Dropout probabilities drawn for those cases.
const DROPOUT_PS: [f32; 3] = [0.1, 0.3, 0.5];
/// Mixed into a case's seed to draw its dropout, so that the cases themselves (and the data
/// behind them) are the same with and without `--forward-only`.
const DROPOUT_STREAM: u64 = 0x0D60_9047_D60F_F5E7;

/// Runs `flash-attn check`: prints each failing case and a closing `N passed, M failed` (and
/// `, K skipped` where the device cannot run some), where a case passes only if its forward and
/// (unless `--forward-only`) its backward pass both meet the contract; exit code 1 if any case
/// failed.
pub fn main(args: &CheckArgs) -> Result<ExitCode> {
    let cuda = args.device == Device::Cuda;
    if cuda && args.dtype == Some(InputDType::Float(DType::F32)) {
        return Err(CliError::new("`check --device cuda --dtype f32`: the CUDA kernels take f16 or bf16 (or fp8e4m3)"));
    }
    let gpu_name = args.device.ensure_available()?;
    let fp8 = args.dtype == Some(InputDType::Fp8E4m3);
    if !cuda {
        // A bad FLASH_ATTN_CPU_ISA fails every case alike: say so once, as a usage error.
        flash_attn::cpu::Isa::default_for_process()?;
    }
    match (gpu_name, fp8) {
        (Some(name), true) => println!(
            "cuda: {name}; fp8e4m3 cases restricted to what the CUDA FP8 forward supports \
             (fixed length, d = dv a multiple of 16 up to 256, no softcap, ALiBi or block mask)"
        ),
        (Some(name), false) => println!(
            "cuda: {name}; cases restricted to what the CUDA backend supports \
             (f16/bf16, d = dv a multiple of 8 up to {})",
            if args.forward_only { 256 } else { 128 }
        ),
        (None, _) => {}
    }
    let forward_only = args.forward_only || fp8;
    let mut rng = Rng::new(args.seed);
    let progress = Progress::bar(args.cases as u64, "check");
    let (mut passed, mut failed, mut skipped) = (0usize, 0usize, 0usize);
    let mut skip_reasons = BTreeSet::new();
    for n in 0..args.cases {
        let mut case = match (cuda, fp8) {
            (true, true) => random_cuda_fp8_case(&mut rng),
            (true, false) => random_cuda_case(&mut rng, forward_only),
            (false, _) => Case::random(&mut rng),
        };
        match args.dtype {
            Some(InputDType::Float(dtype)) => case.dtype = dtype,
            // FP8 inputs are drawn in f32, then quantized.
            Some(InputDType::Fp8E4m3) => case.dtype = DType::F32,
            None => {}
        }
        let dropout = if forward_only { None } else { random_dropout(&case) };
        let mut failures = Vec::new();
        let forward = if fp8 {
            match run_case_fp8(&case, args.device) {
                Ok(Fp8Forward::Ran(report)) => Ok(report),
                Ok(Fp8Forward::Unsupported(why)) => {
                    skipped += 1;
                    if skip_reasons.insert(why.clone()) {
                        progress.suspend(|| println!("skipped case {n} (and any other for this reason): {why}"));
                    }
                    progress.inc();
                    continue;
                }
                Err(e) => Err(e),
            }
        } else if cuda {
            gpu::run_case(&case)
        } else {
            case.run_cpu().map_err(Into::into)
        };
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
            let fp8 = if fp8 { "fp8e4m3 quantized from " } else { "" };
            progress.suspend(|| println!("FAILED case {n}: {fp8}{case}{dropout}: {}", failures.join("; ")));
        }
        progress.inc();
    }
    drop(progress);
    if skipped == 0 {
        println!("{passed} passed, {failed} failed");
    } else {
        println!("{passed} passed, {failed} failed, {skipped} skipped");
    }
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// What the FP8 forward of a case gave.
enum Fp8Forward {
    /// It ran; its comparison with the oracle.
    Ran(CaseReport),
    /// The device cannot run it (the library's `Unsupported`, on cuda only): the reason.
    Unsupported(String),
}

/// The FP8 forward of `case` on `device`: the case's f32 inputs quantized per tensor (each whole
/// backing buffer, strides kept), and `out` and `lse` compared with the oracle and `naive_fp8` on
/// the dequantized inputs under the FP8 contract.
fn run_case_fp8(case: &Case, device: Device) -> Result<Fp8Forward> {
    let data = case.data::<f32>();
    let spec = case.spec(&data);
    let [(q, q_scale), (k, k_scale), (v, v_scale)] = [&data.q, &data.k, &data.v].map(|x| fp8::quantize(x));
    let scales = Fp8Scales { q: q_scale, k: k_scale, v: v_scale };
    // The case's shapes and strides over another buffer of the same length.
    fn view<'a, T>(data: &'a CaseData<f32>, i: usize, x: &'a [T]) -> Tensor<'a, T> {
        Tensor::with_strides(x, &data.shapes[i], &data.strides[i])
    }
    let ours = match device {
        Device::Cpu => {
            flash_attn::forward_fp8(&spec, &view(&data, 0, &q), &view(&data, 1, &k), &view(&data, 2, &v), scales)
        }
        Device::Cuda => {
            match gpu::forward_fp8(&spec, &view(&data, 0, &q), &view(&data, 1, &k), &view(&data, 2, &v), scales)? {
                Err(e @ flash_attn::Error::Unsupported(_)) => return Ok(Fp8Forward::Unsupported(e.to_string())),
                other => other,
            }
        }
    }?;
    let [q, k, v] = [(&q, q_scale), (&k, k_scale), (&v, v_scale)].map(|(x, scale)| fp8::dequantize(x, scale));
    let (q, k, v) = (view(&data, 0, &q), view(&data, 1, &k), view(&data, 2, &v));
    let oracle = reference::forward(&spec, &q, &k, &v)?;
    let naive = reference::naive_fp8(&spec, &q, &k, &v)?;
    Ok(Fp8Forward::Ran(report_fp8(&ours.out, &ours.lse, &oracle, &naive)))
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

/// A random case inside what the CUDA FP8 forward supports: fixed length (about a third of the
/// cases with sequences up to 400 long), `d == dv` a multiple of 16 up to 256, no softcap, ALiBi
/// or block mask, row strides in multiples of 16 elements (16 bytes of e4m3). GQA, both causal
/// alignments, windows, scale and strided layouts are drawn as for the CPU.
fn random_cuda_fp8_case(rng: &mut Rng) -> Case {
    let mut c = Case::random(rng);
    c.dtype = DType::F32;
    c.d = 16 * rng.range(1, 16);
    c.dv = c.d;
    c.varlen = false;
    c.softcap = None;
    c.alibi = None;
    c.block = None;
    let long = rng.chance(0.3);
    let (sq, sk) = if long {
        (rng.range(1, 400), rng.range(1, 400))
    } else {
        let (sq, sk) = c.seqlens.first().copied().unwrap_or((1, 1));
        (sq.max(1), sk.max(1))
    };
    c.seqlens.iter_mut().for_each(|s| *s = (sq, sk));
    if let Storage::Strided { .. } = c.storage {
        c.storage = Storage::Strided { pad: rng.pick(&[0, 16]) };
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
    fn cuda_fp8_cases_stay_inside_what_the_fp8_kernel_supports() {
        let mut rng = Rng::new(8);
        for _ in 0..500 {
            let c = random_cuda_fp8_case(&mut rng);
            assert!(c.d.is_multiple_of(16) && (16..=256).contains(&c.d) && c.dv == c.d, "{c}");
            assert!(!c.varlen && c.softcap.is_none() && c.alibi.is_none() && c.block.is_none(), "{c}");
            assert!(!c.seqlens.is_empty() && c.seqlens.iter().all(|&s| s == c.seqlens[0] && s.0 > 0 && s.1 > 0), "{c}");
            if let Storage::Strided { pad } = c.storage {
                assert_eq!(pad % 16, 0, "{c}");
            }
        }
    }

    #[test]
    fn fp8_cases_on_the_cpu_meet_the_fp8_contract() {
        let mut rng = Rng::new(9);
        for _ in 0..5 {
            let mut case = Case::random(&mut rng);
            case.dtype = DType::F32;
            match run_case_fp8(&case, Device::Cpu) {
                Ok(Fp8Forward::Ran(report)) => assert!(report.passed(), "{case}: {report}"),
                Ok(Fp8Forward::Unsupported(why)) => panic!("{case}: the CPU skipped it: {why}"),
                Err(e) => panic!("{case}: {e}"),
            }
        }
    }

    #[test]
    fn a_case_always_gets_the_same_dropout() {
        let case = Case::random(&mut Rng::new(5));
        assert_eq!(random_dropout(&case), random_dropout(&case));
    }
}
