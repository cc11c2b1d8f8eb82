//! One-thread speed of the CPU GEMM micro-kernel at the forward's tile shapes, with the operands'
//! row strides as packed (a power of two lines) and padded to an odd number of 64-byte lines
//! (`cpu::blocking`'s padded stride). Each case runs in short bursts, interleaved with the others,
//! and prints its best burst and the median: on a shared virtual machine the speed moves by tens
//! of percent within seconds, and interference only ever slows a burst down. Also with `B` in
//! 16-column panels, as the forward packs `Kᵀ` and `V`.
//!
//! `cargo run --release -p flash-attn --example cpu_gemm [portable|avx2|avx512|neon]` (default:
//! the best path this CPU has). A benchmark, not a test: it asserts nothing.

use flash_attn::cpu::gemm::{gemm, gemm_b, BLayout, Isa};
use std::time::Instant;

/// One product `C (m × n) += A (m × k) · B (k × n)` at row strides `lda`, `ldb`.
struct Case {
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
    /// `B` in panels of 16 columns (`BLayout::panels`), as the forward packs `Kᵀ` and `V`.
    panels: bool,
    /// Each burst's rate, GFLOP/s.
    rates: Vec<f64>,
}

impl Case {
    fn new(name: &'static str, (m, n, k): (usize, usize, usize), lda: usize, ldb: usize) -> Self {
        // Small exact values: the sums stay finite however many bursts accumulate into C.
        let a = (0..m * lda).map(|i| (i * 7 % 13) as f32 * 0.01).collect();
        let b = (0..k * ldb).map(|i| (i * 5 % 11) as f32 * 0.01).collect();
        Case { name, m, n, k, lda, ldb, a, b, c: vec![0.0; m * n], panels: false, rates: Vec::new() }
    }

    /// The same product with `B` in panels.
    fn in_panels(mut self) -> Self {
        self.panels = true;
        self
    }

    /// One burst of about 40 MFLOP; keeps its rate in GFLOP/s.
    fn burst(&mut self, isa: Isa) {
        let flops = 2.0 * (self.m * self.n * self.k) as f64;
        let reps = (4e7 / flops).max(1.0) as usize;
        let start = Instant::now();
        for _ in 0..reps {
            let (a, b) = (&self.a, &self.b);
            let shape = (self.m, self.n, self.k);
            if self.panels {
                gemm_b(isa, &mut self.c, self.n, a, self.lda, b, BLayout::panels(self.k), shape, true);
            } else {
                gemm(isa, &mut self.c, self.n, a, self.lda, b, self.ldb, shape, true);
            }
        }
        let rate = flops * reps as f64 / start.elapsed().as_secs_f64() / 1e9;
        self.rates.push(rate);
    }
}

fn main() {
    let isa = match std::env::args().nth(1) {
        Some(name) => match Isa::ALL.into_iter().find(|i| i.name() == name) {
            Some(isa) if isa.is_supported() => isa,
            Some(_) => {
                eprintln!("this CPU has no `{name}` path");
                std::process::exit(2);
            }
            None => {
                eprintln!("unknown path `{name}` (portable, avx2, avx512, neon)");
                std::process::exit(2);
            }
        },
        None => Isa::best(),
    };
    // S = Q·Kᵀ: 258 query rows (43 micro-tiles of 6) by 128 keys, k = d; O += P·V: k = 128 keys.
    let mut cases = vec![
        Case::new("QK d128, strides 128/128", (258, 128, 128), 128, 128),
        Case::new("QK d128, strides 136/128", (258, 128, 128), 136, 128),
        Case::new("QK d128, strides 128/144", (258, 128, 128), 128, 144),
        Case::new("QK d128, strides 144/144", (258, 128, 128), 144, 144),
        Case::new("QK d64, strides 64/128", (258, 128, 64), 64, 128),
        Case::new("QK d64, strides 80/144", (258, 128, 64), 80, 144),
        Case::new("PV d128, strides 128/128", (258, 128, 128), 128, 128),
        Case::new("PV d128, strides 144/144", (258, 128, 128), 144, 144),
        Case::new("PV d64, strides 128/64", (258, 64, 128), 128, 64),
        Case::new("PV d64, strides 144/80", (258, 64, 128), 144, 80),
        Case::new("in L1: 48 x 32 x 128", (48, 32, 128), 128, 32),
        Case::new("QK d128, B in panels", (258, 128, 128), 144, 128).in_panels(),
        Case::new("QK d64, B in panels", (258, 128, 64), 80, 128).in_panels(),
        Case::new("PV d128, B in panels", (258, 128, 128), 144, 128).in_panels(),
        Case::new("PV d64, B in panels", (258, 64, 128), 144, 64).in_panels(),
    ];
    println!("path {}", isa.name());
    for _ in 0..25 {
        for case in cases.iter_mut() {
            case.burst(isa);
        }
    }
    for c in &cases {
        let mut r = c.rates.clone();
        r.sort_by(f64::total_cmp);
        let (median, best) = (r[r.len() / 2], r[r.len() - 1]);
        println!("{:26} m {:4} n {:4} k {:4}: best {:6.1}, median {:6.1} GFLOP/s", c.name, c.m, c.n, c.k, best, median);
    }
}
