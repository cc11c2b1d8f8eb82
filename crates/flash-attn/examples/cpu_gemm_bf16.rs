//! One-thread rate of `gemm_bf16` (AMX tiles and AVX-512 `vdpbf16ps`, where the CPU has them)
//! and of the `f32` AVX-512 GEMM at the forward's tile shapes, with the operands starting on a
//! 64-byte line or 16 bytes past one (where glibc's `malloc` starts a `Vec`). Each case runs 15
//! bursts and prints the best and the median GFLOP/s. On the Xeon of session 45 AMX ran 2.0-2.2×
//! faster on a line (docs/cpu-performance.md, "Tiles on cache lines").
//!
//! `cargo run --release -p flash-attn --example cpu_gemm_bf16`. A benchmark, not a test: it
//! asserts nothing.
use flash_attn::cpu::gemm::{gemm, gemm_bf16, Isa};
use std::time::Instant;

/// A product `C (m × n) (+)= A · B` on `bf16` pairs: name, `m`, `n`, pairs of `k`, row strides of
/// `A`, `B` and `C` (in words or floats), whether it accumulates into `C`.
struct Shape(&'static str, usize, usize, usize, usize, usize, usize, bool);

/// A slice of `n` elements starting `off` bytes past a 64-byte boundary.
fn buf<T: Copy + Default>(n: usize, off: usize) -> (Vec<T>, usize) {
    let sz = std::mem::size_of::<T>();
    let v = vec![T::default(); n + 64];
    let mis = (v.as_ptr() as usize) % 64;
    let start = ((64 - mis) % 64 + off) / sz;
    (v, start)
}

fn rate(flops: f64, mut f: impl FnMut()) -> (f64, f64) {
    let mut rates = Vec::new();
    for _ in 0..15 {
        let reps = (2e8 / flops).max(1.0) as usize;
        let t = Instant::now();
        for _ in 0..reps {
            f();
        }
        rates.push(flops * reps as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    rates.sort_by(f64::total_cmp);
    (rates[14], rates[7])
}

fn main() {
    let isas: Vec<Isa> = [Isa::Amx, Isa::Avx512].into_iter().filter(|i| i.is_supported()).collect();
    let cases = [
        Shape("qk 128x128 d128", 128, 128, 64, 64, 128, 144, false),
        Shape("pv 128x128 k128", 128, 128, 64, 64, 128, 128, true),
        Shape("qk 64x128 d128", 64, 128, 64, 64, 128, 144, false),
        Shape("qk 32x32 k1024", 32, 32, 512, 512, 32, 48, false),
        Shape("pv 256x128 k128", 256, 128, 64, 64, 128, 128, true),
    ];
    for off in [0usize, 16] {
        for &Shape(name, m, n, kp, lda, ldb, ldc, acc) in &cases {
            let (mut a, ao) = buf::<u32>(m * lda, off);
            let (mut b, bo) = buf::<u32>(kp * ldb, off);
            a[ao..].iter_mut().enumerate().for_each(|(i, x)| *x = 0x3c003c00 ^ ((i as u32 * 2654435761) & 0x007f007f));
            b[bo..].iter_mut().enumerate().for_each(|(i, x)| *x = 0x3c003c00 ^ ((i as u32 * 40503) & 0x007f007f));
            let (mut c, co) = buf::<f32>(m * ldc, off);
            let flops = 2.0 * (m * n * 2 * kp) as f64;
            for &isa in &isas {
                let (best, med) =
                    rate(flops, || gemm_bf16(isa, &mut c[co..], ldc, &a[ao..], lda, &b[bo..], ldb, (m, n, kp), acc));
                println!("off {off:2} {name:18} {:7} best {best:7.1} median {med:7.1} GFLOP/s", isa.name());
            }
        }
        // f32: Q·Kᵀ-like 128 × 128 × 128 and P·V with padded strides.
        for (name, m, n, k, lda, ldb) in
            [("f32 128x128x128", 128, 128, 128, 144, 144), ("f32 256x128x128", 256, 128, 128, 144, 144)]
        {
            let (mut a, ao) = buf::<f32>(m * lda, off);
            let (mut b, bo) = buf::<f32>(k * ldb, off);
            a[ao..].iter_mut().enumerate().for_each(|(i, x)| *x = (i * 7 % 13) as f32 * 0.01);
            b[bo..].iter_mut().enumerate().for_each(|(i, x)| *x = (i * 5 % 11) as f32 * 0.01);
            let (mut c, co) = buf::<f32>(m * n, off);
            let flops = 2.0 * (m * n * k) as f64;
            let (best, med) =
                rate(flops, || gemm(Isa::Avx512, &mut c[co..], n, &a[ao..], lda, &b[bo..], ldb, (m, n, k), false));
            println!("off {off:2} {name:18} avx512  best {best:7.1} median {med:7.1} GFLOP/s");
        }
    }
}
