//! `flash-attn check`: random cases through a backend, compared with the f64 oracle under the
//! numerics contract (DESIGN §2), via `flash_attn::check`.

use std::process::ExitCode;

use clap::Args;
use flash_attn::check::{Case, Rng};

use crate::progress::Progress;
use crate::{Device, Result};

/// Arguments of `flash-attn check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Number of random cases.
    #[arg(long, default_value_t = 200)]
    cases: usize,

    /// Seed of the case generator; the same seed gives the same cases.
    #[arg(long, default_value_t = 0)]
    seed: u64,

    /// Backend to check.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
}

/// Runs `flash-attn check`: prints each failing case and a closing `N passed, M failed`; exit
/// code 1 if any case failed.
pub fn main(args: &CheckArgs) -> Result<ExitCode> {
    args.device.ensure_available()?;
    let mut rng = Rng::new(args.seed);
    let progress = Progress::bar(args.cases as u64, "check");
    let (mut passed, mut failed) = (0usize, 0usize);
    for n in 0..args.cases {
        let case = Case::random(&mut rng);
        let failure = match case.run_cpu() {
            Ok(report) if report.passed() => None,
            Ok(report) => Some(report.to_string()),
            Err(e) => Some(format!("error: {e}")),
        };
        match failure {
            None => passed += 1,
            Some(why) => {
                failed += 1;
                progress.suspend(|| println!("FAILED case {n}: {case}: {why}"));
            }
        }
        progress.inc();
    }
    drop(progress);
    println!("{passed} passed, {failed} failed");
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
