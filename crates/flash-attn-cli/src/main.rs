//! `flash-attn`: run, check and benchmark FlashAttention from the command line.
//!
//! A thin layer over the `flash_attn` library (DESIGN §5): this binary parses arguments, moves
//! tensors in and out of safetensors files, times calls and prints tables. Every piece of
//! attention logic lives in the library.
//!
//! Errors follow the CLI contract: one line `error: ...` on stderr and exit code 2; outputs are
//! written only on success.

mod alloc;
mod bench;
mod check;
mod decode_bench;
mod dtype;
mod gpu;
mod io;
mod kernels;
mod plot;
mod progress;
mod run;
mod safetensors_io;

use std::fmt;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

/// Counts heap bytes so that `bench` can report peak extra memory (see [`alloc`]).
#[global_allocator]
static ALLOCATOR: alloc::CountingAlloc = alloc::CountingAlloc;

/// FlashAttention in Rust: exact tiled attention with an online softmax.
#[derive(Debug, Parser)]
#[command(name = "flash-attn", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Run attention on the tensors of a safetensors file and write `out` and `lse` (in KV-cache
    /// mode also the updated `k_cache` and `v_cache`).
    Run(run::RunArgs),
    /// Compare the backend with the f64 oracle on random cases (the numerics contract).
    Check(check::CheckArgs),
    /// Time the forward pass (and with `--backward` forward+backward): one shape, the default
    /// grid, or the memory table.
    Bench(bench::BenchArgs),
    /// Print the HBM-access model: Algorithm 0 vs FlashAttention for N, d and SRAM size M.
    Io(io::IoArgs),
    /// The CUDA kernels (cuda builds): `--compile-all` compiles every variant with NVRTC and
    /// reports registers and spills (failing on spills past a budget and on serialised wgmma).
    Kernels(kernels::KernelsArgs),
    /// Draw saved bench JSON lines (`sq`, `fwd_ms`, optional `peak_extra_bytes`, `label`) as an
    /// SVG figure: runtime vs N, log-log, one series per label.
    Plot(plot::PlotArgs),
}

/// Where attention runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// The multithreaded CPU backend (always built).
    Cpu,
    /// The CUDA backend (cargo feature `cuda`).
    Cuda,
}

impl Device {
    /// The name used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }

    /// Succeeds for the backends this build provides and this machine can run: for `cuda`, opens
    /// GPU 0 (driver, NVRTC, compute capability 8.0+) and returns its name.
    pub fn ensure_available(self) -> Result<Option<String>> {
        match self {
            Device::Cpu => Ok(None),
            Device::Cuda => gpu::open().map(Some),
        }
    }
}

/// A failure reported to the user as one line on stderr, with exit code 2.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CliError(String);

impl CliError {
    /// An error with the given message (without the `error: ` prefix).
    pub fn new(msg: impl Into<String>) -> Self {
        Self(msg.into())
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CliError {}

impl From<flash_attn::Error> for CliError {
    fn from(e: flash_attn::Error) -> Self {
        Self(e.to_string())
    }
}

/// Result of a subcommand.
pub type Result<T, E = CliError> = std::result::Result<T, E>;

/// Exit code for bad input or a failed command (DESIGN §5).
const EXIT_ERROR: u8 = 2;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    let result = guarded(move || match cli.command {
        Command::Run(args) => run::main(&args),
        Command::Check(args) => check::main(&args),
        Command::Bench(args) => bench::main(&args),
        Command::Io(args) => io::main(&args),
        Command::Kernels(args) => kernels::main(&args),
        Command::Plot(args) => plot::main(&args),
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", one_line(&e.0));
            ExitCode::from(EXIT_ERROR)
        }
    }
}

/// Runs a subcommand. In cuda builds a panic below it (a dynamically loaded CUDA library that lacks
/// a symbol panics inside `cudarc`) becomes the one-line error of the contract rather than a
/// backtrace; default builds have no such path and keep Rust's own panic report.
#[cfg(feature = "cuda")]
fn guarded(f: impl FnOnce() -> Result<ExitCode>) -> Result<ExitCode> {
    use std::sync::{Arc, Mutex};
    let message = Arc::new(Mutex::new(String::new()));
    let slot = Arc::clone(&message);
    std::panic::set_hook(Box::new(move |info| {
        let what = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_owned());
        let at = info.location().map(|l| format!(" (at {}:{})", l.file(), l.line())).unwrap_or_default();
        if let Ok(mut m) = slot.lock() {
            *m = format!("{what}{at}");
        }
    }));
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        let m = message.lock().map(|m| m.clone()).unwrap_or_default();
        Err(CliError::new(format!("internal error: {m}")))
    })
}

/// Runs a subcommand (default builds: nothing to guard).
#[cfg(not(feature = "cuda"))]
fn guarded(f: impl FnOnce() -> Result<ExitCode>) -> Result<ExitCode> {
    f()
}

/// `--help` and `--version` print as usual; an argument error becomes the one-line contract
/// error: the first paragraph of clap's message (which names the argument at fault), joined.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            ExitCode::SUCCESS
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            ExitCode::from(EXIT_ERROR)
        }
        _ => {
            let text = e.render().to_string();
            let paragraph: Vec<&str> =
                text.lines().skip_while(|l| l.trim().is_empty()).take_while(|l| !l.trim().is_empty()).collect();
            let msg = one_line(&paragraph.join(" "));
            let msg = msg.strip_prefix("error: ").unwrap_or(&msg);
            eprintln!("error: {msg} (see `flash-attn --help`)");
            ExitCode::from(EXIT_ERROR)
        }
    }
}

/// Collapses a message to one line so the contract holds whatever a dependency prints.
fn one_line(msg: &str) -> String {
    msg.split_whitespace().collect::<Vec<_>>().join(" ")
}
