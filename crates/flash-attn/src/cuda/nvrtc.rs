//! Run-time compilation: embedded CUDA C++ → NVRTC → CUBIN for one exact architecture, with an
//! on-disk cache keyed by everything that changes the binary.

use std::ffi::{c_char, c_int, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nvrtc::sys;

use crate::error::{Error, Result};

/// Whether NVRTC can be used: dlopen by its candidate names (feature `cuda`), or always with the
/// library linked (`cuda-linked`).
fn library_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: only tries to dlopen the library by its candidate names.
        unsafe { cudarc::nvrtc::sys::is_culib_present() }
    }
    #[cfg(not(feature = "cuda"))]
    {
        true
    }
}

/// Whether the NVRTC shared library can be loaded; checked before any NVRTC call, because
/// `cudarc` panics on a missing library.
pub fn available() -> Result<()> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    if *PRESENT.get_or_init(library_present) {
        Ok(())
    } else {
        Err(Error::NvrtcUnavailable(
            "libnvrtc.so.13 was not found; install the CUDA toolkit or `pip install nvidia-cuda-nvrtc`, \
             and put its lib folder on LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

/// NVRTC's `(major, minor)` version.
pub fn version() -> Result<(i32, i32)> {
    available()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: the library is present; the out-pointers are valid.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    check(r, "nvrtcVersion")?;
    Ok((major, minor))
}

fn check(r: sys::nvrtcResult, what: &str) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Error::CudaLaunch(format!("{what} failed: {r:?}")))
    }
}

/// A GPU architecture as NVRTC names it: `sm_80`, `sm_86`, `sm_89`, `sm_90a`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Arch(pub String);

impl Arch {
    /// The exact architecture of a device of compute capability `major.minor`: Hopper gets the
    /// `a` variant so that its own instructions (wgmma, setmaxnreg) are allowed.
    pub fn from_compute_capability(major: i32, minor: i32) -> Self {
        if major == 9 && minor == 0 {
            Arch("sm_90a".into())
        } else {
            Arch(format!("sm_{major}{minor}"))
        }
    }

    /// Whether the target has Hopper's warpgroup MMAs (`wgmma`): sm_90a only (they are not in
    /// plain sm_90, nor in later architectures).
    pub fn has_wgmma(&self) -> bool {
        self.0 == "sm_90a"
    }
}

/// Folders that may hold `cuda_fp16.h`: `$CUDA_HOME/include`, `$CUDA_PATH/include`,
/// `/usr/local/cuda/include`, the `include` beside each `LD_LIBRARY_PATH` entry (pip's
/// `nvidia/cu13/lib`), then Python's `nvidia/cu13/include`. NVRTC 13 bundles neither
/// `cuda_fp16.h` nor `cuda_bf16.h`. Today's kernels include no header, so a missing folder is
/// not an error; it is passed as `-I` when found.
pub fn header_dir() -> Option<PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(find_header_dir).clone()
}

fn find_header_dir() -> Option<PathBuf> {
    let has = |p: &Path| p.join("cuda_fp16.h").is_file();
    let mut candidates: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(var) {
            candidates.push(PathBuf::from(v).join("include"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        for p in std::env::split_paths(&paths) {
            candidates.push(p.join("..").join("include"));
        }
    }
    if let Some(p) = candidates.into_iter().find(|p| has(p)) {
        return Some(p);
    }
    let out = std::process::Command::new("python3")
        .args(["-c", "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'include'))"])
        .output()
        .ok()?;
    let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    has(&p).then_some(p)
}

/// A compiled kernel image plus what ptxas reported.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The CUBIN.
    pub cubin: Vec<u8>,
    /// NVRTC's log (ptxas `-v` lines included).
    pub log: String,
    /// Whether it came from the disk cache (then `log` is the one saved with it).
    pub cached: bool,
}

/// FNV-1a, 64 bits: a stable hash (unlike `DefaultHasher`, fixed across Rust versions).
fn fnv1a(seed: u64, parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for p in parts {
        for &b in *p {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// `$FLASH_ATTN_CACHE`, else `$XDG_CACHE_HOME/flash-attn`, else `~/.cache/flash-attn`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("FLASH_ATTN_CACHE") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("flash-attn"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("flash-attn"))
}

/// Writes `bytes` to `path` atomically: a temporary file in the same folder, then a rename, so a
/// reader never sees half a CUBIN. Failures are ignored (the cache is an optimisation).
fn write_atomic(path: &Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("cubin"),
        std::process::id()
    ));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// The disk cache's key: the source, the options, NVRTC's version and the target. Not the header
/// folder passed as `--include-path`: today's kernels include no header, so where the CUDA headers
/// sit (a toolkit on one machine, pip's wheel on another) changes no CUBIN, and a cache filled on
/// one machine serves another with the same NVRTC.
fn cache_key(source: &str, options: &[String], (major, minor): (i32, i32), arch: &Arch) -> String {
    let ver = format!("nvrtc {major}.{minor}");
    let joined = options.join("\u{1f}");
    let parts: [&[u8]; 4] = [source.as_bytes(), joined.as_bytes(), ver.as_bytes(), arch.0.as_bytes()];
    format!("{:016x}{:016x}", fnv1a(0, &parts), fnv1a(0x5bd1_e995, &parts))
}

/// Compiles `source` (program name `name`) for `arch` with `options`, through the disk cache.
pub fn compile(name: &str, source: &str, options: &[String], arch: &Arch) -> Result<Compiled> {
    let (major, minor) = version()?;
    let mut opts: Vec<String> = options.to_vec();
    opts.push(format!("--gpu-architecture={}", arch.0));
    let key = cache_key(source, &opts, (major, minor), arch);
    if let Some(dir) = header_dir() {
        opts.push(format!("--include-path={}", dir.display()));
    }
    let path = cache_dir().map(|d| d.join(format!("{name}-{}-{key}.cubin", arch.0)));
    if let Some(p) = &path {
        if let Ok(cubin) = std::fs::read(p) {
            let log = std::fs::read_to_string(p.with_extension("log")).unwrap_or_default();
            return Ok(Compiled { cubin, log, cached: true });
        }
    }
    let (cubin, log) = compile_uncached(name, source, &opts)?;
    if let Some(p) = &path {
        write_atomic(&p.with_extension("log"), log.as_bytes());
        write_atomic(p, &cubin);
    }
    Ok(Compiled { cubin, log, cached: false })
}

/// Destroys an NVRTC program when dropped.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the handle came from nvrtcCreateProgram and is destroyed once.
        unsafe {
            sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

fn compile_uncached(name: &str, source: &str, opts: &[String]) -> Result<(Vec<u8>, String)> {
    let nul = |what: &str| Error::KernelCompile { kernel: name.into(), log: format!("{what} contains a NUL byte") };
    let src = CString::new(source).map_err(|_| nul("source"))?;
    let cname = CString::new(format!("{name}.cu")).map_err(|_| nul("name"))?;
    let copts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| nul("options"))?;
    let ptrs: Vec<*const c_char> = copts.iter().map(|o| o.as_ptr()).collect();

    let mut prog = Program(std::ptr::null_mut());
    // SAFETY: the strings are NUL-terminated and outlive the call; no headers are passed.
    check(
        unsafe {
            sys::nvrtcCreateProgram(&mut prog.0, src.as_ptr(), cname.as_ptr(), 0, std::ptr::null(), std::ptr::null())
        },
        "nvrtcCreateProgram",
    )?;
    // SAFETY: `ptrs` holds `ptrs.len()` valid C strings.
    let status = unsafe { sys::nvrtcCompileProgram(prog.0, ptrs.len() as c_int, ptrs.as_ptr()) };
    let log = program_log(&prog)?;
    if status != sys::nvrtcResult::NVRTC_SUCCESS {
        let missing_header = log.contains("cannot open source file") && header_dir().is_none();
        if missing_header {
            return Err(Error::CudaHeaders(format!(
                "kernel `{name}` includes a CUDA header but none was found (set CUDA_HOME, or \
                 `pip install nvidia-cuda-runtime`):\n{log}"
            )));
        }
        return Err(Error::KernelCompile { kernel: name.into(), log });
    }
    let mut size = 0usize;
    // SAFETY: the program compiled; `size` is a valid out-pointer.
    check(unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }, "nvrtcGetCUBINSize")?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has the size NVRTC asked for.
    check(unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) }, "nvrtcGetCUBIN")?;
    Ok((cubin, log))
}

fn program_log(prog: &Program) -> Result<String> {
    let mut size = 0usize;
    // SAFETY: valid program handle and out-pointer.
    check(unsafe { sys::nvrtcGetProgramLogSize(prog.0, &mut size) }, "nvrtcGetProgramLogSize")?;
    let mut buf = vec![0u8; size.max(1)];
    // SAFETY: `buf` has the size NVRTC asked for.
    check(unsafe { sys::nvrtcGetProgramLog(prog.0, buf.as_mut_ptr().cast()) }, "nvrtcGetProgramLog")?;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// Registers and local-memory bytes from ptxas's `-v` report in an NVRTC log: the spill stores, or
/// the stack frame where it exceeds them by more than 8 bytes (an array indexed at run time).
pub fn ptxas_usage(log: &str) -> (Option<u32>, Option<u32>) {
    let number_before = |line: &str, word: &str| -> Option<u32> {
        let i = line.find(word)?;
        line[..i].split_whitespace().last()?.parse().ok()
    };
    let mut regs = None;
    let mut spill = None;
    for line in log.lines() {
        if let Some(r) = number_before(line, "registers") {
            regs = regs.max(Some(r));
        }
        if let Some(s) = number_before(line, "bytes spill stores") {
            // A stack frame larger than the spills (past a few bytes of alignment) is an array
            // the kernel indexes at run time, in local memory as surely as a spill: counted too.
            let frame = number_before(line, "bytes stack frame").unwrap_or(0);
            let local = if frame > s + 8 { frame } else { s };
            spill = spill.max(Some(local));
        }
    }
    (regs, spill)
}

/// Whether ptxas serialised a kernel's warpgroup MMAs (its performance advisory C7511: "wgmma.mma_async
/// instructions are serialized", for want of registers or for an accumulator it could not keep in
/// place, e.g. one array's registers reached through a reinterpreted reference). Such a kernel
/// waits for every product before issuing the next, whatever its source asks.
pub fn wgmma_serialized(log: &str) -> bool {
    log.lines().any(|l| l.contains("C7511") || l.contains("wgmma.mma_async instructions are serialized"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialised_warpgroup_mmas_are_found_in_the_log() {
        let log = "ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized \
                   due to insufficient register resources for the wgmma pipeline in the function 'flash_bwd'\n\
                   ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n";
        assert!(wgmma_serialized(log));
        let log = "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                   ptxas info    : Used 168 registers, used 2 barriers, 128 bytes smem\n";
        assert!(!wgmma_serialized(log));
    }

    #[test]
    fn ptxas_report_is_parsed() {
        let log = "ptxas info    : Compiling entry function 'flash_fwd' for 'sm_90a'\n\
                   ptxas         .     80 bytes stack frame, 112 bytes spill stores, 96 bytes spill loads\n\
                   ptxas info    : Used 255 registers, used 1 barriers, 80 bytes cumulative stack size\n";
        assert_eq!(ptxas_usage(log), (Some(255), Some(112)));
        // A local array (stack frame without spills) counts as local-memory bytes.
        let log = "ptxas         .     64 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                   ptxas info    : Used 168 registers, used 16 barriers, 64 bytes cumulative stack size\n";
        assert_eq!(ptxas_usage(log), (Some(168), Some(64)));
        // A frame a few bytes above the spills is alignment, not an array.
        let log = "ptxas         .     40 bytes stack frame, 36 bytes spill stores, 36 bytes spill loads\n";
        assert_eq!(ptxas_usage(log), (None, Some(36)));
    }

    #[test]
    fn the_cache_key_follows_source_options_version_and_target() {
        let opts = vec!["-DD=128".to_string(), "--gpu-architecture=sm_90a".to_string()];
        let hopper = Arch("sm_90a".into());
        let key = cache_key("k", &opts, (13, 0), &hopper);
        assert_eq!(key.len(), 32);
        assert_eq!(key, cache_key("k", &opts, (13, 0), &hopper));
        assert_ne!(key, cache_key("k2", &opts, (13, 0), &hopper));
        assert_ne!(key, cache_key("k", &opts[..1], (13, 0), &hopper));
        assert_ne!(key, cache_key("k", &opts, (13, 1), &hopper));
        assert_ne!(key, cache_key("k", &opts, (13, 0), &Arch("sm_80".into())));
        // Parts are separated: moving a byte from one part to the next changes the key.
        assert_ne!(cache_key("ab", &["c".into()], (13, 0), &hopper), cache_key("a", &["bc".into()], (13, 0), &hopper));
    }

    #[test]
    fn hopper_gets_the_arch_specific_target() {
        assert_eq!(Arch::from_compute_capability(9, 0).0, "sm_90a");
        assert_eq!(Arch::from_compute_capability(8, 6).0, "sm_86");
    }
}
