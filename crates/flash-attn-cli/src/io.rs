//! `flash-attn io`: the HBM-access model of `flash_attn::io_model` for one `N`, `d`, `M`
//! (DESIGN §5): Algorithm 0 next to FlashAttention (Algorithm 1, FlashAttention-2's loop order,
//! block-sparse Algorithm 5), backward and forward+backward, and Proposition 3's lower bound.
//!
//! Prediction only for now; what a GPU measured will sit beside it.

use std::process::ExitCode;

use clap::Args;
use flash_attn::io_model::{IoProblem, IoReport};
use flash_attn::DType;

use crate::Result;

/// Arguments of `flash-attn io`.
#[derive(Debug, Args)]
pub struct IoArgs {
    /// Sequence length N (queries and keys).
    #[arg(long, value_name = "N")]
    n: usize,

    /// Head dimension d.
    #[arg(long, value_name = "D")]
    d: usize,

    /// On-chip SRAM size M in elements, as Algorithm 1 uses it (at least 4·d). An A100's 192 KiB
    /// per SM holds 49152 f32 or 98304 f16 elements; the seeds' GPT-2 example uses 196608.
    #[arg(long, value_name = "M")]
    sram: usize,

    /// Element type of q, k, v and out (sets the bytes; statistics are f32).
    #[arg(long, value_name = "f32|f16|bf16", default_value = "f32")]
    dtype: DType,

    /// Fraction s in (0, 1] of nonzero blocks of a block-sparse mask: adds Algorithm 5.
    #[arg(long, value_name = "S", allow_hyphen_values = true)]
    density: Option<f64>,

    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// Runs `flash-attn io`: validates the sizes through the library (a bad one is the usual
/// one-line error, exit code 2) and prints the report.
pub fn main(args: &IoArgs) -> Result<ExitCode> {
    let mut problem = IoProblem::new(args.n, args.d, args.sram, args.dtype)?;
    if let Some(s) = args.density {
        problem = problem.with_density(s)?;
    }
    let report = IoReport::new(&problem)?;
    if args.json {
        println!("{}", report.to_json());
    } else {
        print!("{report}");
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(n: usize, d: usize, sram: usize, density: Option<f64>) -> IoArgs {
        IoArgs { n, d, sram, dtype: DType::F32, density, json: true }
    }

    #[test]
    fn valid_sizes_succeed() {
        assert_eq!(main(&args(1024, 64, 196_608, None)), Ok(ExitCode::SUCCESS));
        assert_eq!(main(&args(1024, 64, 196_608, Some(0.5))), Ok(ExitCode::SUCCESS));
    }

    #[test]
    fn invalid_sizes_are_errors_naming_the_quantity() {
        let msg = |a: IoArgs| main(&a).expect_err("rejected").to_string();
        assert!(msg(args(0, 64, 196_608, None)).contains("sequence length"));
        assert!(msg(args(1024, 64, 100, None)).contains("4d = 256"));
        assert!(msg(args(1024, 64, 196_608, Some(1.5))).contains("density"));
    }
}
