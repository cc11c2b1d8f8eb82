//! The machine's measured f32 FMA rate on a path: the peak the CPU backend's GFLOP/s are read
//! against (`flash-attn bench --fma-peak`). Each thread of the current rayon pool runs a loop of
//! 12 independent register-only fused multiply-adds (enough chains to cover the FMA latency on
//! two pipes) for a fixed count, all threads at once; the rate counts 2 flops per lane.

use std::time::Instant;

use super::isa::Isa;

/// Independent accumulator chains per thread.
const CHAINS: usize = 12;

/// f32 GFLOP/s of fused multiply-adds on all threads of the current rayon pool on path `isa`
/// (the portable path counts plain multiply-adds of 8 lanes), the best of `rounds` timed runs,
/// and the number of threads that ran.
pub fn fma_gflops(isa: Isa, rounds: usize) -> (f64, usize) {
    let threads = rayon::current_num_threads();
    let iters: u64 = 100_000_000;
    let mut best = 0.0f64;
    for _ in 0..rounds.max(1) {
        let start = Instant::now();
        // One loop on every thread of the pool, all at once.
        let flops: f64 = rayon::broadcast(|ctx| run(isa, iters, ctx.index() as f32)).into_iter().sum();
        let secs = start.elapsed().as_secs_f64();
        best = best.max(flops / secs / 1e9);
    }
    (best, threads)
}

/// One thread's loop: returns the flops it did (a result depending on every chain, so that the
/// loop is not optimised away, is folded into a black box).
fn run(isa: Isa, iters: u64, seed: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if isa.avx512() {
            // SAFETY: AVX-512F is available (checked).
            let r = unsafe { x86::fma512(iters, seed) };
            std::hint::black_box(r);
            return iters as f64 * (CHAINS * 16 * 2) as f64;
        }
        if isa == Isa::Avx2 && isa.is_supported() {
            // SAFETY: AVX2 and FMA are available (checked).
            let r = unsafe { x86::fma256(iters, seed) };
            std::hint::black_box(r);
            return iters as f64 * (CHAINS * 8 * 2) as f64;
        }
    }
    #[cfg(target_arch = "aarch64")]
    if isa == Isa::Neon && isa.is_supported() {
        // SAFETY: NEON is available (checked).
        let r = unsafe { arm::fma128(iters, seed) };
        std::hint::black_box(r);
        return iters as f64 * (CHAINS * 4 * 2) as f64;
    }
    let _ = isa;
    let mut acc = [[seed; 8]; CHAINS];
    let iters = iters / 8;
    for _ in 0..iters {
        for a in acc.iter_mut() {
            for x in a.iter_mut() {
                *x = *x * 0.999_999 + 1e-7;
            }
        }
    }
    std::hint::black_box(acc);
    iters as f64 * (CHAINS * 8 * 2) as f64
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::CHAINS;

    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma512(iters: u64, seed: f32) -> f32 {
        let (m, a) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        let mut acc = [_mm512_set1_ps(seed); CHAINS];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(*x, m, a);
            }
        }
        acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
    }

    /// # Safety
    /// AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma256(iters: u64, seed: f32) -> f32 {
        let (m, a) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        let mut acc = [_mm256_set1_ps(seed); CHAINS];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(*x, m, a);
            }
        }
        let mut lanes = [0.0f32; 8];
        acc.iter().fold(0.0, |s, &x| {
            // SAFETY: `lanes` holds 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), x) };
            s + lanes.iter().sum::<f32>()
        })
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use std::arch::aarch64::*;

    use super::CHAINS;

    /// # Safety
    /// NEON available.
    #[target_feature(enable = "neon")]
    pub unsafe fn fma128(iters: u64, seed: f32) -> f32 {
        let (m, a) = (vdupq_n_f32(0.999_999), vdupq_n_f32(1e-7));
        let mut acc = [vdupq_n_f32(seed); CHAINS];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = vfmaq_f32(a, *x, m);
            }
        }
        acc.iter().map(|&x| vaddvq_f32(x)).sum()
    }
}
