//! `flash-attn kernels --compile-all`: every CUDA kernel variant compiled by NVRTC for the given
//! architectures, one line each with its registers and spill bytes (cuda builds only; no GPU
//! needed, only NVRTC).

use std::process::ExitCode;

use clap::Args;

use crate::gpu;
use crate::{CliError, Result};

/// Arguments of `flash-attn kernels`.
#[derive(Debug, Args)]
pub struct KernelsArgs {
    /// Compile every kernel variant and print registers and spill bytes per variant; exit code 1
    /// if any variant fails to compile, leaves no ptxas report, or spills to local memory beyond
    /// its budget (zero, but for the mma.sync backward variants at d >= 128: 80 bytes; 256 for
    /// the d 256 one with every optional path).
    #[arg(long)]
    compile_all: bool,

    /// Target architectures, as NVRTC names them (`sm_80`, `sm_86`, `sm_89`, `sm_90a`, ...).
    #[arg(long, value_name = "sm_XY,...", value_delimiter = ',', default_value = "sm_80,sm_90a")]
    arch: Vec<String>,

    /// Only the variants whose name contains this text (e.g. `_h_x`, `flash_bwd_bf16_d128`).
    #[arg(long, value_name = "TEXT", default_value = "")]
    only: String,
}

/// Checks the form `sm_<digits>[a|f]`, so that a typo is a usage error rather than an NVRTC log.
fn check_arch(arch: &str) -> Result<()> {
    let digits = arch.strip_prefix("sm_").map(|rest| rest.strip_suffix(['a', 'f']).unwrap_or(rest));
    match digits {
        Some(d) if d.len() >= 2 && d.bytes().all(|b| b.is_ascii_digit()) => Ok(()),
        _ => Err(CliError::new(format!("`--arch {arch}`: expected an architecture such as sm_80 or sm_90a"))),
    }
}

/// Runs `flash-attn kernels`.
pub fn main(args: &KernelsArgs) -> Result<ExitCode> {
    if !cfg!(feature = "cuda") {
        return Err(gpu::not_built());
    }
    if !args.compile_all {
        return Err(CliError::new("`flash-attn kernels` needs `--compile-all` (the only action so far)"));
    }
    if args.arch.is_empty() {
        return Err(CliError::new("`--arch` names no architecture"));
    }
    for a in &args.arch {
        check_arch(a.trim())?;
    }
    let archs: Vec<String> = args.arch.iter().map(|a| a.trim().to_owned()).collect();
    let reports = gpu::compile_all(&archs, &args.only)?;
    if reports.is_empty() {
        return Err(CliError::new(format!("no kernel variant's name contains `{}`", args.only)));
    }
    let (mut failed, mut spilled, mut budgeted) = (0usize, 0usize, 0usize);
    let number = |x: Option<u32>| x.map_or_else(|| "?".to_owned(), |x| x.to_string());
    for r in &reports {
        let status = match (&r.error, r.spill_bytes) {
            (Some(_), _) => {
                failed += 1;
                "FAILED".to_owned()
            }
            // Compiled, but each warpgroup MMA waits for the one before (ptxas's C7511).
            (None, _) if r.wgmma_serialized => {
                failed += 1;
                "FAILED (ptxas serialised its warpgroup MMAs, C7511)".to_owned()
            }
            (None, Some(s)) if s > r.spill_budget => {
                spilled += 1;
                format!("SPILLS (budget {} B)", r.spill_budget)
            }
            (None, Some(s)) if s > 0 => {
                budgeted += 1;
                format!("spills within its budget of {} B", r.spill_budget)
            }
            (None, Some(_)) => "ok".to_owned(),
            // No spill figure in the log: the gate cannot vouch for the variant.
            (None, None) => {
                failed += 1;
                "FAILED (no ptxas report in the log)".to_owned()
            }
        };
        println!(
            "{:<32} {:<7} registers {:>4} spill {:>4} B  {status}",
            r.name,
            r.arch,
            number(r.registers),
            number(r.spill_bytes)
        );
        if let Some(e) = &r.error {
            for line in e.lines() {
                println!("    {line}");
            }
        }
    }
    println!(
        "{} variants: {} ok, {budgeted} spill within their budget, {failed} failed, {spilled} spill beyond their \
         budget",
        reports.len(),
        reports.len() - failed - spilled - budgeted
    );
    Ok(if failed + spilled == 0 { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures_are_checked_for_their_form() {
        for ok in ["sm_80", "sm_86", "sm_90a", "sm_100f", "sm_120"] {
            assert!(check_arch(ok).is_ok(), "{ok}");
        }
        for bad in ["", "80", "sm_", "sm_8", "sm_90b", "compute_90", "sm_9x"] {
            assert!(check_arch(bad).is_err(), "{bad}");
        }
    }
}
