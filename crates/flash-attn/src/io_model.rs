//! The HBM-access model: how many elements (and bytes) each attention algorithm moves between HBM
//! and on-chip SRAM for one `(batch, head)`, predicted from `N`, `d`, `M` and the dtype.
//!
//! "IO-awareness made visible": FlashAttention does not save FLOPs, it saves HBM traffic. This
//! module counts that traffic the way the seeds do, so that `flash-attn io` can print it and a GPU
//! run can later be compared with it. Everything here is arithmetic: pure functions over a
//! validated [`IoProblem`], no allocation of attention-sized buffers.
//!
//! ```
//! use flash_attn::io_model::{IoProblem, IoReport};
//! use flash_attn::DType;
//!
//! // The seeds' GPT-2 example: N = 1024, d = 64, M = 196608.
//! let report = IoReport::new(&IoProblem::new(1024, 64, 196_608, DType::F32)?)?;
//! assert_eq!((report.blocks.bc, report.blocks.br, report.blocks.tc, report.blocks.tr), (768, 64, 2, 16));
//! assert_eq!(report.algorithm0.total(), 4 * 1024 * 64 + 4 * 1024 * 1024); // 4Nd + 4N²
//! assert!(report.algorithm1.total() < report.algorithm0.total());
//! # Ok::<(), flash_attn::Error>(())
//! ```
//!
//! # Sources
//!
//! The seeds live in `shared/seeds/`; citations below name them by their number:
//! - **seed 000** `000_efbf81c2780296a2.txt` (Zhihu, "FlashAttention图解"): Algorithm 0, Algorithm 1,
//!   the GPT-2 worked example (`N = 1024, d = 64, M = 196608 → Bc = 768, Br = 64, Tc = 2,
//!   Tr = 16`), Theorem 2's proof sketch.
//! - **seed 003** `003_e26ce819672e42db.txt` (paper walkthrough): §"逐步拆解 HBM 访问量" (Algorithm 0's
//!   table, `3Nd + 2N²` reads, `Nd + 2N²` writes, `4Nd + 4N²` in all); §"分析：FlashAttention 的 IO
//!   复杂度" (Theorem 2's per-loop accounting `Tc · (2·Bc·d + Tr · (3·Br·d + 4·Br))`, its two cases
//!   with leading term `12 N²d²/M`, the loop simulation `simulate_flash_hbm`, Proposition 3);
//!   §"扩展：块稀疏 FlashAttention" (Algorithm 5, density `s`, Proposition 4).
//! - **seed 004** `004_9c8d93a49d23dece.txt` (English article): §4.4 the `N = 4096, d = 64,
//!   M = 192 × 512` example; §8 FlashAttention-2's loop order (Q blocks outer).
//!
//! # The counts
//!
//! With `n = N`, `d`, `M` in elements, and `Bc, Br, Tc, Tr` from [`Blocks`]:
//!
//! | algorithm | reads | writes | source |
//! |---|---|---|---|
//! | Algorithm 0 (standard) | `3Nd + 2N²` | `Nd + 2N²` | seed 003 table; total `4Nd + 4N²` |
//! | Algorithm 1 (FlashAttention) | `2Nd + Tc·(2Nd + 2N)` | `Tc·(Nd + 2N)` | seed 003 Theorem 2, clipped blocks |
//! | FlashAttention-2 order | `Nd + Tr'·2Nd` | `Nd + N` | seed 004 §8 loop order; counts ours |
//! | Algorithm 5 (block-sparse) | `2Nd + s·Tc·(2Nd + 2N)` | `s·Tc·(Nd + 2N)` | seed 003 Proposition 4 |
//! | standard backward | `5Nd + 5N²` | `3Nd + 2N²` | paper Algorithm 3 (not in the seeds; ours) |
//! | FlashAttention-2 backward | `4Nd + Tc·(3Nd + 2N) + Nd` | `N + 2Nd + Tc·Nd + Nd` | ours, see [`fa2_backward`] |
//!
//! `Tr'` is FlashAttention-2's number of (outer) `Q` blocks, from [`Blocks::fa2`].
//!
//! Orders, not counts: Proposition 3's lower bound `Θ(N²d²/M)` ([`lower_bound_order`]) and
//! Proposition 4's `Θ(Nd + N²d²s/M)` ([`block_sparse_order`]).
//!
//! Conventions, following the seeds where they speak and stated here where they do not:
//! - **M counts elements**, as Algorithm 1 line 1 uses it (seed 003 Theorem 2: "M 为 SRAM 大小（以元素
//!   计）"). Seed 000 plugs in A100's `192 KB = 196608 B` as if it were elements; 192 KiB holds 49152
//!   `f32` or 98304 `f16`/`bf16` elements (seed 004 §4.4 uses `192 × 512 = 98304`).
//! - **Last blocks are clipped.** When `Bc` or `Br` does not divide `N`, the last block has fewer
//!   rows and moves fewer elements, as in seed 003's `simulate_flash_hbm`. Seed 003's closed form
//!   `Tc · (2·Bc·d + Tr · (3·Br·d + 4·Br))` counts every block as full; it is reported beside the
//!   count ([`algorithm1_seed_formula`]) and equals it when both block sizes divide `N`.
//! - **Initialisation is not counted**: Algorithm 1 line 2 writes `O = 0, ℓ = 0, m = -∞` to HBM
//!   and the seeds' accounting leaves that out; so do we (here and for FlashAttention-2's zeroed
//!   `dQ` accumulator).
//! - **Bytes**: matrices (`Q, K, V, O, S, P, dO, dK, dV, dP, dS`) are in the problem's dtype;
//!   softmax statistics (`ℓ, m`, LSE, `D`) and FlashAttention-2's `dQ` accumulator are `f32`
//!   ([`STAT_BYTES`]), as in FlashAttention's kernels and ours (DESIGN §2: `lse` is f32).

use std::fmt;

use crate::{DType, Error, Result};

/// Bytes of one softmax statistic (`ℓ`, `m`, LSE, `D`) and of one element of FlashAttention-2's
/// `dQ` accumulator: `f32` whatever the dtype of `Q, K, V`.
pub const STAT_BYTES: usize = 4;

/// Largest `N`, `d` or `M` the model accepts: with all three below `2^32`, every intermediate
/// count fits in `u128`, so the arithmetic never overflows before the final `u64` check.
pub const MAX_SIZE: usize = u32::MAX as usize;

/// A validated problem: one `(batch, head)` of attention with `N` queries and keys of head
/// dimension `d`, on a chip whose SRAM holds `M` elements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IoProblem {
    n: usize,
    d: usize,
    sram: usize,
    dtype: DType,
    density: Option<f64>,
}

impl IoProblem {
    /// A dense problem.
    ///
    /// Errors: `N` or `d` of 0 is [`Error::Shape`]; `M < 4d` is [`Error::Unsupported`], because
    /// Algorithm 1 line 1 then gives `Bc = Br = 1` and even one row each of `K_j, V_j, Q_i, O_i`
    /// (`4d` elements) does not fit in SRAM, so the algorithm as written cannot run (Theorem 2's
    /// range `d ≤ M` is an asymptotic statement; `d ≤ M < 4d` has no block size that fits).
    /// Sizes above [`MAX_SIZE`] are [`Error::Unsupported`]. `M > Nd` is accepted: the counts
    /// still hold, but it is outside Theorem 2 / Proposition 3's range (see
    /// [`IoProblem::in_theorem_range`]).
    pub fn new(n: usize, d: usize, sram: usize, dtype: DType) -> Result<Self> {
        if n == 0 || d == 0 {
            return Err(Error::Shape(format!(
                "the IO model needs a sequence length N >= 1 and a head dimension d >= 1, got N = {n}, d = {d}"
            )));
        }
        for (name, value) in [("sequence length N", n), ("head dimension d", d), ("SRAM size M", sram)] {
            if value > MAX_SIZE {
                return Err(Error::Unsupported(format!(
                    "the IO model counts sizes up to {MAX_SIZE}; {name} = {value} is larger"
                )));
            }
        }
        if sram < d.saturating_mul(4) {
            return Err(Error::Unsupported(format!(
                "SRAM of M = {sram} elements is below 4d = {}: Algorithm 1 keeps one row each of K_j, V_j, Q_i \
                 and O_i on chip, so M must be at least 4·d (M counts elements, not bytes)",
                d.saturating_mul(4)
            )));
        }
        Ok(Self { n, d, sram, dtype, density: None })
    }

    /// The same problem with a block-sparse mask whose fraction of nonzero blocks is `s`
    /// (seed 003 Proposition 4: `0 < s ≤ 1`). Anything else, NaN included, is [`Error::BlockMask`].
    pub fn with_density(self, s: f64) -> Result<Self> {
        if !(s > 0.0 && s <= 1.0) {
            return Err(Error::BlockMask(format!(
                "density s (the fraction of nonzero blocks) must be in (0, 1], got {s}"
            )));
        }
        Ok(Self { density: Some(s), ..self })
    }

    /// Sequence length `N`.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Head dimension `d`.
    pub fn d(&self) -> usize {
        self.d
    }

    /// SRAM size `M`, in elements.
    pub fn sram(&self) -> usize {
        self.sram
    }

    /// Element type of `Q, K, V, O` (and of `S, P` in Algorithm 0).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Block-sparse density `s`, if any.
    pub fn density(&self) -> Option<f64> {
        self.density
    }

    /// Whether `d ≤ M ≤ Nd`, the range of Theorem 2 and Proposition 3 (seed 003, seed 000). Above it,
    /// `N²d²/M < Nd`: the order falls below the `Θ(Nd)` any algorithm needs to read its inputs.
    pub fn in_theorem_range(&self) -> bool {
        self.d <= self.sram && self.sram as u128 <= self.n as u128 * self.d as u128
    }
}

/// Block sizes and block counts of a tiled loop: `Q` in `Tr` blocks of `Br` rows, `K` and `V` in
/// `Tc` blocks of `Bc` rows (seed 000/seed 003 Algorithm 1 line 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blocks {
    /// Rows of a `K_j`/`V_j` block.
    pub bc: usize,
    /// Rows of a `Q_i`/`O_i` block.
    pub br: usize,
    /// Number of `K`/`V` blocks, `⌈N / Bc⌉`.
    pub tc: usize,
    /// Number of `Q` blocks, `⌈N / Br⌉`.
    pub tr: usize,
}

impl Blocks {
    /// Algorithm 1 line 1 and 3 (seed 000, seed 003): `Bc = ⌈M / 4d⌉`, `Br = min(⌈M / 4d⌉, d)`,
    /// `Tc = ⌈N / Bc⌉`, `Tr = ⌈N / Br⌉`. `K_j, V_j` (the outer loop's blocks) get the large size.
    pub fn algorithm1(p: &IoProblem) -> Self {
        let big = p.sram.div_ceil(4 * p.d);
        Self::sized(p.n, big.min(p.d), big)
    }

    /// Block sizes for FlashAttention-2's loop order (our choice; the FlashAttention-2 paper sets
    /// tile sizes by hand, not from `M`): Algorithm 1's rule with the roles swapped, so that the
    /// block held on chip across the inner loop — `Q_i` here, `K_j, V_j` there — gets
    /// `⌈M / 4d⌉` rows: `Br = ⌈M / 4d⌉`, `Bc = min(⌈M / 4d⌉, d)`.
    pub fn fa2(p: &IoProblem) -> Self {
        let big = p.sram.div_ceil(4 * p.d);
        Self::sized(p.n, big, big.min(p.d))
    }

    /// Explicit block sizes for a sequence of length `n` (e.g. a kernel's tile shape, or seed 003's
    /// `Br = Bc = 2` example). Zero sizes are [`Error::Shape`], sizes above [`MAX_SIZE`]
    /// [`Error::Unsupported`].
    pub fn new(n: usize, br: usize, bc: usize) -> Result<Self> {
        if n == 0 || br == 0 || bc == 0 {
            return Err(Error::Shape(format!("blocks need N, Br and Bc >= 1, got N = {n}, Br = {br}, Bc = {bc}")));
        }
        if n.max(br).max(bc) > MAX_SIZE {
            return Err(Error::Unsupported(format!(
                "the IO model counts sizes up to {MAX_SIZE}; got N = {n}, Br = {br}, Bc = {bc}"
            )));
        }
        Ok(Self::sized(n, br, bc))
    }

    fn sized(n: usize, br: usize, bc: usize) -> Self {
        Self { bc, br, tc: n.div_ceil(bc), tr: n.div_ceil(br) }
    }

    /// Elements on chip during one inner step, `2·Bc·d + 2·Br·d + Br·Bc` (seed 003 §"块大小的选择":
    /// `K_j, V_j, Q_i, O_i` and `S_ij`).
    pub fn sram_footprint(&self, d: usize) -> u128 {
        let (bc, br, d) = (self.bc as u128, self.br as u128, d as u128);
        2 * bc * d + 2 * br * d + br * bc
    }

    /// Whether these blocks tile a sequence of `p.n`: sizes nonzero, counts `⌈N / B⌉`.
    fn check(&self, p: &IoProblem) -> Result<()> {
        let sized = |b: usize| (1..=MAX_SIZE).contains(&b);
        if !sized(self.bc) || !sized(self.br) || self.tc != p.n.div_ceil(self.bc) || self.tr != p.n.div_ceil(self.br) {
            return Err(Error::Shape(format!(
                "blocks {self:?} do not tile N = {}: need 1 <= Bc, Br <= {MAX_SIZE}, Tc = ⌈N/Bc⌉, Tr = ⌈N/Br⌉",
                p.n
            )));
        }
        Ok(())
    }
}

/// Predicted HBM traffic of one algorithm for one `(batch, head)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Traffic {
    /// Elements read from HBM.
    pub reads: u64,
    /// Elements written to HBM.
    pub writes: u64,
    /// Bytes read from HBM.
    pub read_bytes: u64,
    /// Bytes written to HBM.
    pub write_bytes: u64,
}

impl Traffic {
    /// Elements read plus written (the seeds' "HBM accesses").
    pub fn total(&self) -> u64 {
        // Cannot overflow: `Tally::traffic` checked the sum.
        self.reads + self.writes
    }

    /// Bytes read plus written.
    pub fn total_bytes(&self) -> u64 {
        self.read_bytes + self.write_bytes
    }

    fn json(&self) -> String {
        format!(
            "{{\"reads\":{},\"writes\":{},\"total\":{},\"read_bytes\":{},\"write_bytes\":{},\"total_bytes\":{}}}",
            self.reads,
            self.writes,
            self.total(),
            self.read_bytes,
            self.write_bytes,
            self.total_bytes()
        )
    }
}

/// Element counts split by their size: `mat` elements are in the problem's dtype, `stat` elements
/// in `f32` ([`STAT_BYTES`]). `u128` so that no formula overflows for sizes up to [`MAX_SIZE`].
#[derive(Debug, Clone, Copy, Default)]
struct Tally {
    mat_reads: u128,
    stat_reads: u128,
    mat_writes: u128,
    stat_writes: u128,
}

impl Tally {
    fn read(self, mat: u128, stat: u128) -> Self {
        Self { mat_reads: self.mat_reads + mat, stat_reads: self.stat_reads + stat, ..self }
    }

    fn write(self, mat: u128, stat: u128) -> Self {
        Self { mat_writes: self.mat_writes + mat, stat_writes: self.stat_writes + stat, ..self }
    }

    fn plus(self, o: Self) -> Self {
        self.read(o.mat_reads, o.stat_reads).write(o.mat_writes, o.stat_writes)
    }

    /// Every count times `s`, rounded to the nearest element.
    fn times(self, s: f64) -> Self {
        let f = |x: u128| (x as f64 * s).round() as u128;
        Self {
            mat_reads: f(self.mat_reads),
            stat_reads: f(self.stat_reads),
            mat_writes: f(self.mat_writes),
            stat_writes: f(self.stat_writes),
        }
    }

    fn traffic(self, p: &IoProblem, what: &str) -> Result<Traffic> {
        let (mat, stat) = (p.dtype.size() as u128, STAT_BYTES as u128);
        let reads = self.mat_reads + self.stat_reads;
        let writes = self.mat_writes + self.stat_writes;
        let read_bytes = self.mat_reads * mat + self.stat_reads * stat;
        let write_bytes = self.mat_writes * mat + self.stat_writes * stat;
        let fits = |x: u128| u64::try_from(x).ok();
        match (fits(reads + writes), fits(read_bytes + write_bytes)) {
            // The totals fit, so each part does too.
            (Some(_), Some(_)) => Ok(Traffic {
                reads: reads as u64,
                writes: writes as u64,
                read_bytes: read_bytes as u64,
                write_bytes: write_bytes as u64,
            }),
            _ => Err(Error::Unsupported(format!(
                "{what}: the HBM traffic of N = {}, d = {} does not fit in 64-bit counters",
                p.n, p.d
            ))),
        }
    }
}

/// `(N, d, Nd, N²)` as `u128`.
fn sizes(p: &IoProblem) -> (u128, u128, u128, u128) {
    let (n, d) = (p.n as u128, p.d as u128);
    (n, d, n * d, n * n)
}

/// Algorithm 0, the standard implementation (seed 000/seed 003 Algorithm 0; counts from seed 003's table):
/// line 1 reads `Q, K` (`2Nd`) and writes `S` (`N²`); line 2 reads `S` and writes `P` (`N²`
/// each); line 3 reads `P, V` (`N² + Nd`) and writes `O` (`Nd`). Reads `3Nd + 2N²`, writes
/// `Nd + 2N²`, in all `4Nd + 4N²`.
pub fn algorithm0_forward(p: &IoProblem) -> Result<Traffic> {
    algorithm0_tally(p).traffic(p, "Algorithm 0")
}

fn algorithm0_tally(p: &IoProblem) -> Tally {
    let (_, _, nd, nn) = sizes(p);
    Tally::default()
        .read(2 * nd, 0) // line 1: Q, K
        .write(nn, 0) // line 1: S
        .read(nn, 0) // line 2: S
        .write(nn, 0) // line 2: P
        .read(nn + nd, 0) // line 3: P, V
        .write(nd, 0) // line 3: O
}

/// Algorithm 1, FlashAttention's forward pass, with seed 003's Theorem 2 accounting: the outer loop
/// (line 5, `Tc` times) reads `K_j, V_j` once (line 6); every inner step (line 7, `Tr` per outer
/// step) reads `Q_i, O_i, ℓ_i, m_i` (line 8) and writes `O_i` (line 12) and `ℓ_i, m_i` (line 13).
///
/// Summed with clipped last blocks (seed 003 `simulate_flash_hbm`): the `K_j, V_j` reads cover `K`
/// and `V` once (`2Nd`), and each outer step's inner loop covers all `N` rows, so reads are
/// `2Nd + Tc·(2Nd + 2N)` and writes `Tc·(Nd + 2N)`. Theorem 2: `Θ(N²d²/M)`, leading term
/// `Tc·3Nd ≈ 12N²d²/M` (seed 003 cases 1 and 2).
pub fn algorithm1_forward(p: &IoProblem, blocks: &Blocks) -> Result<Traffic> {
    blocks.check(p)?;
    algorithm1_tally(p, blocks).traffic(p, "Algorithm 1")
}

fn algorithm1_tally(p: &IoProblem, blocks: &Blocks) -> Tally {
    let (n, _, nd, _) = sizes(p);
    let tc = blocks.tc as u128;
    Tally::default().read(2 * nd, 0).plus(algorithm1_inner(n, nd, tc))
}

/// The inner steps of Algorithm 1 over the whole run: `Tc` passes over `Q_i, O_i, ℓ_i, m_i`.
fn algorithm1_inner(n: u128, nd: u128, tc: u128) -> Tally {
    Tally::default()
        .read(tc * 2 * nd, tc * 2 * n) // line 8: Q_i, O_i; ℓ_i, m_i
        .write(tc * nd, tc * 2 * n) // lines 12-13: O_i; ℓ_i, m_i
}

/// seed 003's closed form of Theorem 2's accounting, `Tc · (2·Bc·d + Tr · (3·Br·d + 4·Br))`
/// elements: every block counted as full. Equal to [`algorithm1_forward`]'s total when `Bc` and
/// `Br` divide `N`, larger otherwise.
pub fn algorithm1_seed_formula(p: &IoProblem, blocks: &Blocks) -> Result<u64> {
    blocks.check(p)?;
    let d = p.d as u128;
    let (bc, br, tc, tr) = (blocks.bc as u128, blocks.br as u128, blocks.tc as u128, blocks.tr as u128);
    let total = tc * (2 * bc * d + tr * (3 * br * d + 4 * br));
    u64::try_from(total).map_err(|_| Error::Unsupported(format!("Algorithm 1's closed form {total} exceeds u64")))
}

/// FlashAttention-2's loop order (seed 004 §8: the outer loop runs over `Q` blocks, each an
/// independent thread block), counted by us: each outer step reads `Q_i` once and all of
/// `K` and `V` (`2Nd`), keeps `O_i` and the softmax statistics on chip, and writes `O_i` and
/// `LSE_i` once at the end. Reads `Nd + Tr·2Nd`, writes `Nd + N` (LSE in `f32`). `blocks.tr`
/// is the number of outer (`Q`) blocks; see [`Blocks::fa2`].
pub fn fa2_forward(p: &IoProblem, blocks: &Blocks) -> Result<Traffic> {
    blocks.check(p)?;
    fa2_forward_tally(p, blocks).traffic(p, "FlashAttention-2 forward")
}

fn fa2_forward_tally(p: &IoProblem, blocks: &Blocks) -> Tally {
    let (n, _, nd, _) = sizes(p);
    let tr = blocks.tr as u128;
    Tally::default()
        .read(nd, 0) // Q_i, once per outer step
        .read(tr * 2 * nd, 0) // K_j, V_j for every outer step
        .write(nd, n) // O_i; LSE_i
}

/// Algorithm 5, block-sparse FlashAttention (seed 003 §"扩展：块稀疏 FlashAttention"): Algorithm 1
/// that skips the inner step when the mask block `M̃_ij` is zero. With a fraction `s` of nonzero
/// blocks, the inner loop's traffic is `s` times Algorithm 1's (seed 003 Proposition 4's proof
/// sketch); `K_j, V_j` are still read once each (`2Nd`, the `Θ(Nd)` of Proposition 4: line 6
/// loads them before the mask is consulted, and a density alone cannot say which columns are
/// empty). Reads `2Nd + s·Tc·(2Nd + 2N)`, writes `s·Tc·(Nd + 2N)`, rounded to whole elements:
/// the expected traffic of a mask of that density.
pub fn block_sparse_forward(p: &IoProblem, blocks: &Blocks, s: f64) -> Result<Traffic> {
    blocks.check(p)?;
    let p = p.with_density(s)?;
    block_sparse_tally(&p, blocks, s).traffic(&p, "Algorithm 5")
}

fn block_sparse_tally(p: &IoProblem, blocks: &Blocks, s: f64) -> Tally {
    let (n, _, nd, _) = sizes(p);
    Tally::default().read(2 * nd, 0).plus(algorithm1_inner(n, nd, blocks.tc as u128).times(s))
}

/// The standard backward pass, FlashAttention paper Algorithm 3 (Appendix B; the seeds give only
/// the recomputation idea, so this reading is ours): (1) read `P, dO`, write `dV = PᵀdO`;
/// (2) read `dO, V`, write `dP = dO Vᵀ`; (3) read `P, dP`, write `dS = P ∘ (dP − rowsum(P ∘ dP))`;
/// (4) read `dS, K`, write `dQ = dS K`; (5) read `dS, Q`, write `dK = dSᵀQ`.
/// Reads `5Nd + 5N²`, writes `3Nd + 2N²`.
pub fn standard_backward(p: &IoProblem) -> Result<Traffic> {
    standard_backward_tally(p).traffic(p, "standard backward")
}

fn standard_backward_tally(p: &IoProblem) -> Tally {
    let (_, _, nd, nn) = sizes(p);
    Tally::default()
        .read(nn + nd, 0)
        .write(nd, 0) // (1) P, dO -> dV
        .read(2 * nd, 0)
        .write(nn, 0) // (2) dO, V -> dP
        .read(2 * nn, 0)
        .write(nn, 0) // (3) P, dP -> dS
        .read(nn + nd, 0)
        .write(nd, 0) // (4) dS, K -> dQ
        .read(nn + nd, 0)
        .write(nd, 0) // (5) dS, Q -> dK
}

/// FlashAttention-2's backward loop, our accounting (the seeds give only its order,
/// `Θ(N²d²/M)` like the forward): `K/V` blocks outer, `Q` blocks inner, with Algorithm 1's blocks.
/// - preprocessing: read `O, dO` (`2Nd`), write `D = rowsum(dO ∘ O)` (`N`, `f32`);
/// - outer step `j`: read `K_j, V_j` once (`2Nd` in all); write `dK_j, dV_j` once (`2Nd`);
/// - inner step `(j, i)`: read `Q_i, dO_i` (`Tc·2Nd`), the `f32` accumulator `dQ_i` (`Tc·Nd`),
///   `LSE_i, D_i` (`Tc·2N`, `f32`); write `dQ_i` (`Tc·Nd`, `f32`);
/// - postprocessing: read the `dQ` accumulator (`Nd`, `f32`), write `dQ` in the dtype (`Nd`).
///
/// Reads `2Nd + 2Nd + Tc·(3Nd + 2N) + Nd`, writes `N + 2Nd + Tc·Nd + Nd`.
pub fn fa2_backward(p: &IoProblem, blocks: &Blocks) -> Result<Traffic> {
    blocks.check(p)?;
    fa2_backward_tally(p, blocks).traffic(p, "FlashAttention-2 backward")
}

fn fa2_backward_tally(p: &IoProblem, blocks: &Blocks) -> Tally {
    let (n, _, nd, _) = sizes(p);
    let tc = blocks.tc as u128;
    Tally::default()
        .read(2 * nd, 0)
        .write(0, n) // preprocessing: O, dO -> D
        .read(2 * nd, 0)
        .write(2 * nd, 0) // outer: K_j, V_j in; dK_j, dV_j out
        .read(tc * 2 * nd, tc * (nd + 2 * n))
        .write(0, tc * nd) // inner: Q_i, dO_i; dQ_i, LSE_i, D_i in; dQ_i out
        .read(0, nd)
        .write(nd, 0) // postprocessing: dQ accumulator -> dQ
}

/// Proposition 3's lower bound (seed 003, seed 004 §4.3), as an order: `N²d²/M`. Any exact attention
/// algorithm needs `Ω(N²d²/M)` HBM accesses for `d ≤ M ≤ Nd`; the constant is unknown, so this
/// is a scale to compare counts with, not a count.
pub fn lower_bound_order(p: &IoProblem) -> f64 {
    let (n, d, m) = (p.n as f64, p.d as f64, p.sram as f64);
    n * n * d * d / m
}

/// Proposition 4's order for block-sparse FlashAttention with density `s`: `Nd + N²d²s/M`
/// (the paper's `Θ(Nd + N²d²M⁻¹s)`; seed 003 states the `O(N²d²s/M)` part).
pub fn block_sparse_order(p: &IoProblem, s: f64) -> f64 {
    p.n as f64 * p.d as f64 + lower_bound_order(p) * s
}

/// Everything the model predicts for one problem; [`fmt::Display`] prints it as a table,
/// [`IoReport::to_json`] as one JSON object.
#[derive(Debug, Clone, PartialEq)]
pub struct IoReport {
    /// The problem.
    pub problem: IoProblem,
    /// Algorithm 1's blocks (also used by Algorithm 5 and the FlashAttention-2 backward).
    pub blocks: Blocks,
    /// FlashAttention-2 forward's blocks ([`Blocks::fa2`]).
    pub fa2_blocks: Blocks,
    /// Algorithm 0, forward.
    pub algorithm0: Traffic,
    /// Algorithm 1, forward (clipped last blocks).
    pub algorithm1: Traffic,
    /// seed 003's closed form of Algorithm 1's count (every block full).
    pub algorithm1_seed_formula: u64,
    /// FlashAttention-2 loop order, forward.
    pub fa2_forward: Traffic,
    /// Algorithm 5 with the problem's density, if it has one.
    pub block_sparse: Option<Traffic>,
    /// Standard backward (paper Algorithm 3).
    pub standard_backward: Traffic,
    /// FlashAttention-2 backward (our accounting).
    pub fa2_backward: Traffic,
    /// Algorithm 0 forward plus the standard backward.
    pub standard_training: Traffic,
    /// FlashAttention-2 forward plus backward.
    pub fa2_training: Traffic,
    /// Proposition 3's `N²d²/M` (an order).
    pub lower_bound_order: f64,
    /// Proposition 4's `Nd + N²d²s/M` (an order), with a density.
    pub block_sparse_order: Option<f64>,
}

impl IoReport {
    /// Runs every formula of this module on `p`.
    pub fn new(p: &IoProblem) -> Result<Self> {
        let blocks = Blocks::algorithm1(p);
        let fa2_blocks = Blocks::fa2(p);
        let training = |fwd: Tally, bwd: Tally, what: &str| fwd.plus(bwd).traffic(p, what);
        Ok(Self {
            problem: *p,
            blocks,
            fa2_blocks,
            algorithm0: algorithm0_forward(p)?,
            algorithm1: algorithm1_forward(p, &blocks)?,
            algorithm1_seed_formula: algorithm1_seed_formula(p, &blocks)?,
            fa2_forward: fa2_forward(p, &fa2_blocks)?,
            block_sparse: p.density.map(|s| block_sparse_forward(p, &blocks, s)).transpose()?,
            standard_backward: standard_backward(p)?,
            fa2_backward: fa2_backward(p, &blocks)?,
            standard_training: training(algorithm0_tally(p), standard_backward_tally(p), "standard fwd+bwd")?,
            fa2_training: training(
                fa2_forward_tally(p, &fa2_blocks),
                fa2_backward_tally(p, &blocks),
                "FlashAttention-2 fwd+bwd",
            )?,
            lower_bound_order: lower_bound_order(p),
            block_sparse_order: p.density.map(|s| block_sparse_order(p, s)),
        })
    }

    /// The report as one JSON object (element counts, bytes, block sizes, orders); `null` for
    /// what a dense problem does not have.
    pub fn to_json(&self) -> String {
        let p = &self.problem;
        let blocks = |b: &Blocks| {
            format!(
                "{{\"bc\":{},\"br\":{},\"tc\":{},\"tr\":{},\"sram_footprint\":{}}}",
                b.bc,
                b.br,
                b.tc,
                b.tr,
                b.sram_footprint(p.d)
            )
        };
        let opt_traffic = |t: &Option<Traffic>| t.as_ref().map_or("null".to_owned(), Traffic::json);
        format!(
            "{{\"n\":{},\"d\":{},\"sram_elements\":{},\"dtype\":\"{}\",\"element_bytes\":{},\"stat_bytes\":{},\
             \"density\":{},\"in_theorem_range\":{},\"blocks\":{},\"fa2_blocks\":{},\
             \"algorithm0\":{},\"algorithm1\":{},\"algorithm1_seed_formula\":{},\"fa2_forward\":{},\
             \"block_sparse\":{},\"standard_backward\":{},\"fa2_backward\":{},\"standard_training\":{},\
             \"fa2_training\":{},\"lower_bound_order\":{},\"block_sparse_order\":{}}}",
            p.n,
            p.d,
            p.sram,
            p.dtype.name(),
            p.dtype.size(),
            STAT_BYTES,
            json_f64(p.density),
            p.in_theorem_range(),
            blocks(&self.blocks),
            blocks(&self.fa2_blocks),
            self.algorithm0.json(),
            self.algorithm1.json(),
            self.algorithm1_seed_formula,
            self.fa2_forward.json(),
            opt_traffic(&self.block_sparse),
            self.standard_backward.json(),
            self.fa2_backward.json(),
            self.standard_training.json(),
            self.fa2_training.json(),
            json_f64(Some(self.lower_bound_order)),
            json_f64(self.block_sparse_order),
        )
    }
}

/// A JSON number, or `null` for `None` and non-finite values.
fn json_f64(x: Option<f64>) -> String {
    match x {
        Some(x) if x.is_finite() => format!("{x}"),
        _ => "null".to_owned(),
    }
}

/// Bytes in B, KiB, MiB or GiB.
fn fmt_bytes(n: u64) -> String {
    const K: f64 = 1024.0;
    let x = n as f64;
    match x {
        x if x < K => format!("{n} B"),
        x if x < K * K => format!("{:.1} KiB", x / K),
        x if x < K * K * K => format!("{:.1} MiB", x / (K * K)),
        x => format!("{:.2} GiB", x / (K * K * K)),
    }
}

/// A Markdown table padded to line up in a terminal: the first two columns left-aligned, the
/// others right-aligned.
fn write_table(f: &mut fmt::Formatter<'_>, header: &[&str], rows: &[Vec<String>]) -> fmt::Result {
    let widths: Vec<usize> = (0..header.len())
        .map(|i| rows.iter().map(|r| r[i].chars().count()).chain([header[i].chars().count()]).max().unwrap_or(0))
        .collect();
    let left = |i: usize| i < 2;
    let line = |f: &mut fmt::Formatter<'_>, cells: &[String]| {
        let padded: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let fill = " ".repeat(widths[i].saturating_sub(c.chars().count()));
                if left(i) {
                    format!("{c}{fill}")
                } else {
                    format!("{fill}{c}")
                }
            })
            .collect();
        writeln!(f, "| {} |", padded.join(" | "))
    };
    line(f, &header.iter().map(|h| h.to_string()).collect::<Vec<_>>())?;
    let rule: Vec<String> = widths
        .iter()
        .enumerate()
        .map(|(i, &w)| {
            let dashes = "-".repeat(w.saturating_sub(1));
            if left(i) {
                format!(":{dashes}")
            } else {
                format!("{dashes}:")
            }
        })
        .collect();
    writeln!(f, "| {} |", rule.join(" | "))?;
    for row in rows {
        line(f, row)?;
    }
    Ok(())
}

impl fmt::Display for IoReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.problem;
        let (b, b2) = (&self.blocks, &self.fa2_blocks);
        writeln!(
            f,
            "HBM accesses of one (batch, head): N = {}, d = {}, M = {} elements of SRAM ({} in {}); \
             {} matrices ({} B per element), ℓ, m, LSE, D and the dQ accumulator in f32",
            p.n,
            p.d,
            p.sram,
            fmt_bytes(p.sram as u64 * p.dtype.size() as u64),
            p.dtype,
            p.dtype,
            p.dtype.size()
        )?;
        writeln!(
            f,
            "Algorithm 1 blocks: Bc = ⌈M/4d⌉ = {}, Br = min(⌈M/4d⌉, d) = {}, Tc = ⌈N/Bc⌉ = {}, Tr = ⌈N/Br⌉ = {}; \
             on chip per step 2·Bc·d + 2·Br·d + Br·Bc = {} elements{}",
            b.bc,
            b.br,
            b.tc,
            b.tr,
            b.sram_footprint(p.d),
            if b.sram_footprint(p.d) > p.sram as u128 { " (more than M)" } else { "" }
        )?;
        writeln!(
            f,
            "FlashAttention-2 blocks (Q outer, Algorithm 1's rule mirrored): Br = {}, Bc = {}, Tr = {}, Tc = {}",
            b2.br, b2.bc, b2.tr, b2.tc
        )?;
        writeln!(f)?;

        let row = |pass: &str, name: String, t: &Traffic, base: &Traffic| {
            vec![
                pass.to_owned(),
                name,
                t.reads.to_string(),
                t.writes.to_string(),
                t.total().to_string(),
                fmt_bytes(t.total_bytes()),
                format!("{:.3}", t.total() as f64 / base.total() as f64),
            ]
        };
        let mut rows = vec![
            row("forward", "Algorithm 0 (standard: S, P in HBM)".into(), &self.algorithm0, &self.algorithm0),
            row("forward", "Algorithm 1 (FlashAttention, K/V outer)".into(), &self.algorithm1, &self.algorithm0),
            row("forward", "FlashAttention-2 order (Q outer)".into(), &self.fa2_forward, &self.algorithm0),
        ];
        if let (Some(t), Some(s)) = (&self.block_sparse, p.density) {
            rows.push(row("forward", format!("Algorithm 5 (block-sparse, s = {s})"), t, &self.algorithm0));
        }
        rows.extend([
            row("backward", "standard (paper Algorithm 3)".into(), &self.standard_backward, &self.standard_backward),
            row("backward", "FlashAttention-2 (ours)".into(), &self.fa2_backward, &self.standard_backward),
            row("fwd+bwd", "standard".into(), &self.standard_training, &self.standard_training),
            row("fwd+bwd", "FlashAttention-2".into(), &self.fa2_training, &self.standard_training),
        ]);
        write_table(f, &["pass", "algorithm", "reads", "writes", "total", "bytes", "vs standard"], &rows)?;
        writeln!(f)?;

        let ragged = !p.n.is_multiple_of(b.bc) || !p.n.is_multiple_of(b.br);
        writeln!(
            f,
            "Algorithm 1, seed closed form Tc·(2·Bc·d + Tr·(3·Br·d + 4·Br)) = {}{}",
            self.algorithm1_seed_formula,
            if ragged { " (counts the last, partial blocks as full; the table clips them)" } else { "" }
        )?;
        writeln!(
            f,
            "Proposition 3 lower bound: Θ(N²d²/M), N²d²/M ≈ {:.4e} (an order, not a count; Algorithm 1 is {:.1}× it)",
            self.lower_bound_order,
            self.algorithm1.total() as f64 / self.lower_bound_order
        )?;
        if let (Some(order), Some(s)) = (self.block_sparse_order, p.density) {
            writeln!(f, "Proposition 4 (s = {s}): Θ(Nd + N²d²s/M), Nd + N²d²s/M ≈ {order:.4e} (an order)")?;
        }
        if !p.in_theorem_range() {
            writeln!(
                f,
                "note: M > N·d = {}: outside Theorem 2 / Proposition 3's range d ≤ M ≤ N·d; there N²d²/M < N·d, \
                 below the Θ(Nd) any algorithm needs to read Q, K, V and write O",
                p.n as u128 * p.d as u128
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(n: usize, d: usize, m: usize) -> IoProblem {
        IoProblem::new(n, d, m, DType::F32).expect("valid problem")
    }

    fn report(n: usize, d: usize, m: usize) -> IoReport {
        IoReport::new(&problem(n, d, m)).expect("report")
    }

    fn rw(t: &Traffic) -> (u64, u64) {
        (t.reads, t.writes)
    }

    /// seed 003's `simulate_flash_hbm`, transcribed: Algorithm 1's loops with clipped last blocks.
    fn seed_simulation(n: usize, d: usize, br: usize, bc: usize) -> u64 {
        let (tc, tr) = (n.div_ceil(bc), n.div_ceil(br));
        let mut total = 0u64;
        for j in 0..tc {
            let kv_len = bc.min(n - j * bc) as u64;
            total += 2 * kv_len * d as u64; // K_j, V_j
            for i in 0..tr {
                let q_len = br.min(n - i * br) as u64;
                total += 2 * q_len * d as u64 + 2 * q_len; // read Q_i, O_i; ℓ_i, m_i
                total += q_len * d as u64 + 2 * q_len; // write O_i; ℓ_i, m_i
            }
        }
        total
    }

    // --- The seeds' worked examples --------------------------------------------------------

    #[test]
    fn gpt2_example_gives_the_seeds_block_sizes() {
        // seed 000: Bc = ⌈196608/4/64⌉ = 768; Br = min(768, 64) = 64; Tc = ⌈1024/768⌉ = 2; Tr = 16.
        let b = Blocks::algorithm1(&problem(1024, 64, 196_608));
        assert_eq!(b, Blocks { bc: 768, br: 64, tc: 2, tr: 16 });
    }

    #[test]
    fn gpt2_example_algorithm0_is_4nd_plus_4n_squared() {
        // seed 003 table: reads 3Nd + 2N², writes Nd + 2N², total 4Nd + 4N².
        let r = report(1024, 64, 196_608);
        assert_eq!(rw(&r.algorithm0), (3 * 65_536 + 2 * 1_048_576, 65_536 + 2 * 1_048_576));
        assert_eq!(rw(&r.algorithm0), (2_293_760, 2_162_688));
        assert_eq!(r.algorithm0.total(), 4_456_448);
        assert_eq!(r.algorithm0.total_bytes(), 4 * 4_456_448);
    }

    #[test]
    fn gpt2_example_algorithm1_counts() {
        // Reads 2Nd + Tc(2Nd + 2N) = 131072 + 2·133120; writes Tc(Nd + 2N) = 2·67584.
        let r = report(1024, 64, 196_608);
        assert_eq!(rw(&r.algorithm1), (397_312, 135_168));
        assert_eq!(r.algorithm1.total(), 532_480);
        assert_eq!(r.algorithm1.total(), seed_simulation(1024, 64, 64, 768));
        // seed 003's closed form counts the second K/V block (256 rows) as 768 rows:
        // 2·(2·768·64 + 16·(3·64·64 + 4·64)) = 2·(98304 + 200704).
        assert_eq!(r.algorithm1_seed_formula, 598_016);
        // Out of Theorem 2's range: M = 196608 > Nd = 65536.
        assert!(!r.problem.in_theorem_range());
        assert!((r.lower_bound_order - 1024.0 * 1024.0 * 64.0 * 64.0 / 196_608.0).abs() < 1e-9);
    }

    #[test]
    fn n4096_example_of_seed_004() {
        // seed 004 §4.4: N = 4096, d = 64, M ≈ 192 KB = 192 × 512 (f16 elements).
        let p = problem(4096, 64, 192 * 512);
        let r = IoReport::new(&p).expect("report");
        // "Standard attention IO: Θ(Nd + N²) ≈ 4096 × 64 + 4096² ≈ 17M": 17,039,360; the exact
        // count of Algorithm 0 is 4(Nd + N²).
        assert_eq!(r.algorithm0.total(), 4 * (4096 * 64 + 4096 * 4096));
        assert_eq!(4096 * 64 + 4096 * 4096, 17_039_360);
        // "FlashAttention IO: Θ(N²d²/M) ≈ 4096² × 64² / (192 × 512) ≈ 7M": the expression is
        // 699,050.67 ≈ 0.7M — the seed's "7M" is off by ten.
        assert!((r.lower_bound_order - 699_050.666_666).abs() < 1e-3);
        // Algorithm 1's count: Bc = 384, Br = 64, Tc = 11, Tr = 64; 2Nd + 11·(2Nd + 2N) reads,
        // 11·(Nd + 2N) writes.
        assert_eq!(r.blocks, Blocks { bc: 384, br: 64, tc: 11, tr: 64 });
        assert_eq!(rw(&r.algorithm1), (524_288 + 11 * (524_288 + 8192), 11 * (262_144 + 8192)));
        assert_eq!(r.algorithm1.total(), 9_355_264);
        assert_eq!(r.algorithm1.total(), seed_simulation(4096, 64, 64, 384));
        assert_eq!(r.algorithm1_seed_formula, 11 * (2 * 384 * 64 + 64 * (3 * 64 * 64 + 4 * 64)));
        assert!(r.problem.in_theorem_range());
    }

    #[test]
    fn algorithm0_traced_example_of_seed_003() {
        // seed 003 "Algorithm 0 ... 逐步追踪": N = 8, d = 4 → 4Nd + 4N² = 128 + 256 = 384.
        let a = algorithm0_forward(&problem(8, 4, 16)).expect("count");
        assert_eq!(rw(&a), (3 * 32 + 2 * 64, 32 + 2 * 64));
        assert_eq!(a.total(), 384);
        // Its growth table (d = 4), last row N = 4096: 4Nd = 65536, 4N² = 67108864.
        assert_eq!(algorithm0_forward(&problem(4096, 4, 16)).expect("count").total(), 65_536 + 67_108_864);
    }

    #[test]
    fn algorithm1_traced_example_of_seed_003_with_2x2_blocks() {
        // seed 003's C++ Algorithm 1: N = 8, d = 4, Br = Bc = 2, tracked per block.
        let p = problem(8, 4, 16);
        let b = Blocks::new(8, 2, 2).expect("blocks");
        let a1 = algorithm1_forward(&p, &b).expect("count");
        // Reads 2Nd + 4·(2Nd + 2N) = 64 + 320; writes 4·(Nd + 2N) = 192.
        assert_eq!(rw(&a1), (384, 192));
        assert_eq!(a1.total(), seed_simulation(8, 4, 2, 2));
        assert_eq!(algorithm1_seed_formula(&p, &b).expect("formula"), a1.total());
        // At this toy size FlashAttention moves 1.5× what Algorithm 0 does (576 vs 384).
        assert_eq!(a1.total() * 2, algorithm0_forward(&p).expect("count").total() * 3);
    }

    #[test]
    fn theorem2_leading_term_is_12_n2d2_over_m_in_both_cases() {
        // seed 003 Theorem 2: case 1 (M ≤ 4d²: Br = Bc = M/4d) and case 2 (M > 4d²: Br = d), both
        // with leading term Tc·Tr·3·Br·d = 12N²d²/M; the rest is 2Nd (K, V) + Tc·4N (ℓ, m).
        for (n, d, m, case_br) in [(4096, 64, 16_384, 64), (4096, 64, 4096, 16), (4096, 64, 65_536, 64)] {
            let r = report(n, d, m);
            assert_eq!(r.blocks.br, case_br);
            let (n, d, m, tc) = (n as u64, d as u64, m as u64, r.blocks.tc as u64);
            let leading = r.algorithm1.total() - 2 * n * d - tc * 4 * n;
            assert_eq!(leading, 12 * n * n * d * d / m, "N = {n}, d = {d}, M = {m}");
        }
    }

    #[test]
    fn block_sizes_across_the_case_boundary_m_equals_4d_squared() {
        // seed 003 experiment 3: N = 512, d = 64, boundary M = 4d² = 16384.
        let b = |m| Blocks::algorithm1(&problem(512, 64, m));
        assert_eq!(b(1024), Blocks { bc: 4, br: 4, tc: 128, tr: 128 });
        assert_eq!(b(16_384), Blocks { bc: 64, br: 64, tc: 8, tr: 8 });
        assert_eq!(b(32_768), Blocks { bc: 128, br: 64, tc: 4, tr: 8 });
    }

    // --- Hand-worked small case: N = 8, d = 2, M = 32 -------------------------------------------

    fn small() -> IoProblem {
        problem(8, 2, 32)
    }

    #[test]
    fn small_case_blocks() {
        // Bc = ⌈32/8⌉ = 4, Br = min(4, 2) = 2, Tc = 2, Tr = 4; footprint 16 + 8 + 8 = 32 = M.
        let b = Blocks::algorithm1(&small());
        assert_eq!(b, Blocks { bc: 4, br: 2, tc: 2, tr: 4 });
        assert_eq!(b.sram_footprint(2), 32);
        assert_eq!(Blocks::fa2(&small()), Blocks { bc: 2, br: 4, tc: 4, tr: 2 });
    }

    #[test]
    fn small_case_algorithm0() {
        // Nd = 16, N² = 64: reads 48 + 128, writes 16 + 128.
        assert_eq!(rw(&algorithm0_forward(&small()).expect("count")), (176, 144));
    }

    #[test]
    fn small_case_algorithm1() {
        let p = small();
        let b = Blocks::algorithm1(&p);
        // Reads 2Nd + Tc(2Nd + 2N) = 32 + 2·48; writes Tc(Nd + 2N) = 2·32.
        assert_eq!(rw(&algorithm1_forward(&p, &b).expect("count")), (128, 64));
        // Closed form, all blocks full: 2·(2·4·2 + 4·(3·2·2 + 4·2)) = 192 = 128 + 64.
        assert_eq!(algorithm1_seed_formula(&p, &b).expect("formula"), 192);
    }

    #[test]
    fn small_case_fa2_forward_reads_q_once_and_kv_tr_times() {
        let p = small();
        // Tr = 2 outer Q blocks: reads Nd + 2·2Nd = 16 + 64; writes O and LSE once: 16 + 8.
        assert_eq!(rw(&fa2_forward(&p, &Blocks::fa2(&p)).expect("count")), (80, 24));
        // With Algorithm 1's blocks as they are (Tr = 4): K and V are read 4 times.
        assert_eq!(rw(&fa2_forward(&p, &Blocks::algorithm1(&p)).expect("count")), (16 + 4 * 32, 24));
    }

    #[test]
    fn small_case_block_sparse_halves_the_inner_loop() {
        let p = small();
        let b = Blocks::algorithm1(&p);
        // Reads 2Nd + 0.5·96 = 32 + 48; writes 0.5·64.
        assert_eq!(rw(&block_sparse_forward(&p, &b, 0.5).expect("count")), (80, 32));
        assert_eq!(block_sparse_forward(&p, &b, 1.0), algorithm1_forward(&p, &b));
        // Proposition 4's order: Nd + N²d²s/M = 16 + 256·0.5/32.
        assert_eq!(block_sparse_order(&p, 0.5), 20.0);
    }

    #[test]
    fn small_case_backward_passes() {
        let p = small();
        // Standard: reads 5N² + 5Nd = 320 + 80; writes 2N² + 3Nd = 128 + 48.
        assert_eq!(rw(&standard_backward(&p).expect("count")), (400, 176));
        // FlashAttention-2 (Tc = 2): reads 2Nd (O, dO) + 2Nd (K, V) + 2·(2Nd + Nd + 2N) + Nd
        // = 32 + 32 + 128 + 16; writes N (D) + 2Nd (dK, dV) + 2·Nd (dQ acc) + Nd (dQ)
        // = 8 + 32 + 32 + 16.
        assert_eq!(rw(&fa2_backward(&p, &Blocks::algorithm1(&p)).expect("count")), (208, 88));
        let r = IoReport::new(&p).expect("report");
        assert_eq!(rw(&r.standard_training), (176 + 400, 144 + 176));
        assert_eq!(rw(&r.fa2_training), (80 + 208, 24 + 88));
    }

    #[test]
    fn small_case_lower_bound_order() {
        // N²d²/M = 64·4/32.
        assert_eq!(lower_bound_order(&small()), 8.0);
    }

    #[test]
    fn bytes_count_matrices_in_the_dtype_and_statistics_in_f32() {
        let p = IoProblem::new(8, 2, 32, DType::F16).expect("valid");
        let a1 = algorithm1_forward(&p, &Blocks::algorithm1(&p)).expect("count");
        // Reads: 96 matrix elements (K, V, Q_i, O_i) × 2 B + 32 statistics (ℓ, m) × 4 B.
        // Writes: 32 (O_i) × 2 B + 32 (ℓ, m) × 4 B.
        assert_eq!((a1.read_bytes, a1.write_bytes), (96 * 2 + 32 * 4, 32 * 2 + 32 * 4));
        let a0 = algorithm0_forward(&p).expect("count");
        assert_eq!(a0.total_bytes(), 2 * a0.total());
        let bf = IoProblem::new(8, 2, 32, DType::BF16).expect("valid");
        assert_eq!(algorithm1_forward(&bf, &Blocks::algorithm1(&bf)), Ok(a1));
    }

    // --- General properties -------------------------------------------------------------------

    #[test]
    fn algorithm1_matches_the_seed_loop_simulation_with_ragged_blocks() {
        for n in [1, 7, 64, 100, 1000, 1024, 1025] {
            for d in [1, 3, 16, 64, 128] {
                for m in [4 * d, 4 * d + 1, 1000, 4096, 65_536, 196_608] {
                    if m < 4 * d {
                        continue;
                    }
                    let p = problem(n, d, m);
                    let b = Blocks::algorithm1(&p);
                    let count = algorithm1_forward(&p, &b).expect("count").total();
                    assert_eq!(count, seed_simulation(n, d, b.br, b.bc), "N = {n}, d = {d}, M = {m}");
                    let formula = algorithm1_seed_formula(&p, &b).expect("formula");
                    if n % b.bc == 0 && n % b.br == 0 {
                        assert_eq!(formula, count);
                    } else {
                        assert!(formula > count);
                    }
                }
            }
        }
    }

    #[test]
    fn flash_attention_moves_less_than_algorithm0_at_the_seeds_settings() {
        // GPT-2 (seed 000), the N = 4096 example (seed 004), and seed 003 experiment 2 (M = 16384, d = 64).
        let mut settings = vec![(1024, 64, 196_608), (4096, 64, 98_304)];
        settings.extend([128, 256, 512, 1024, 2048, 4096].map(|n| (n, 64, 16_384)));
        for (n, d, m) in settings {
            let r = report(n, d, m);
            assert!(r.algorithm1.total() < r.algorithm0.total(), "Algorithm 1, N = {n}, M = {m}");
            assert!(r.fa2_forward.total() < r.algorithm0.total(), "FA2 forward, N = {n}, M = {m}");
            assert!(r.fa2_training.total() < r.standard_training.total(), "fwd+bwd, N = {n}, M = {m}");
            assert!(r.algorithm1.total_bytes() < r.algorithm0.total_bytes());
        }
    }

    #[test]
    fn algorithm1_exceeds_algorithm0_when_sram_is_only_d_squared() {
        // seed 003's boundary check "M = d²": Algorithm 1 is of Algorithm 0's order, here 2.55×.
        let r = report(256, 64, 64 * 64);
        assert_eq!(r.algorithm1.total(), 835_584);
        assert_eq!(r.algorithm0.total(), 327_680);
    }

    #[test]
    fn fa2_forward_writes_o_and_lse_once_whatever_the_sram() {
        for m in [256, 4096, 65_536, 1 << 20] {
            let r = report(1000, 64, m);
            assert_eq!(r.fa2_forward.writes, 1000 * 64 + 1000);
            assert_eq!(r.fa2_forward.reads, 1000 * 64 * (1 + 2 * r.fa2_blocks.tr as u64));
        }
    }

    #[test]
    fn block_sparse_traffic_grows_linearly_with_density() {
        let p = problem(4096, 64, 98_304);
        let b = Blocks::algorithm1(&p);
        let kv = 2 * 4096 * 64;
        let dense = algorithm1_forward(&p, &b).expect("count").total() - kv;
        for s in [0.125, 0.25, 0.5, 0.75] {
            let t = block_sparse_forward(&p, &b, s).expect("count").total() - kv;
            assert_eq!(t as f64, dense as f64 * s);
        }
    }

    // --- Validation -------------------------------------------------------------------------------

    #[test]
    fn zero_sequence_length_or_head_dim_is_a_shape_error() {
        assert!(matches!(IoProblem::new(0, 64, 1 << 16, DType::F32), Err(Error::Shape(_))));
        assert!(matches!(IoProblem::new(1024, 0, 1 << 16, DType::F32), Err(Error::Shape(_))));
    }

    #[test]
    fn sram_below_4d_is_unsupported() {
        let err = IoProblem::new(1024, 64, 255, DType::F32).expect_err("M < 4d");
        assert!(matches!(&err, Error::Unsupported(msg) if msg.contains("4d = 256")), "{err}");
        assert!(IoProblem::new(1024, 64, 256, DType::F32).is_ok());
        assert!(matches!(IoProblem::new(1024, 64, 0, DType::F32), Err(Error::Unsupported(_))));
    }

    #[test]
    fn sizes_beyond_the_model_are_unsupported_not_overflowed() {
        assert!(matches!(IoProblem::new(MAX_SIZE + 1, 64, 1 << 16, DType::F32), Err(Error::Unsupported(_))));
        // Within the limits, a count that does not fit in u64 is an error, not a wrap-around.
        let p = IoProblem::new(MAX_SIZE, 64, 1 << 16, DType::F32).expect("valid");
        assert!(matches!(IoReport::new(&p), Err(Error::Unsupported(_))));
    }

    #[test]
    fn density_outside_zero_to_one_is_a_block_mask_error() {
        let p = small();
        for s in [0.0, -0.5, 1.5, f64::NAN, f64::INFINITY] {
            assert!(matches!(p.with_density(s), Err(Error::BlockMask(_))), "s = {s}");
            assert!(block_sparse_forward(&p, &Blocks::algorithm1(&p), s).is_err());
        }
        assert_eq!(p.with_density(1.0).map(|p| p.density()), Ok(Some(1.0)));
    }

    #[test]
    fn blocks_that_do_not_tile_n_are_a_shape_error() {
        let p = small();
        assert!(matches!(Blocks::new(8, 0, 2), Err(Error::Shape(_))));
        let other = Blocks::new(16, 2, 2).expect("blocks");
        assert!(matches!(algorithm1_forward(&p, &other), Err(Error::Shape(_))));
        let forged = Blocks { bc: 0, br: 2, tc: 0, tr: 4 };
        assert!(matches!(fa2_backward(&p, &forged), Err(Error::Shape(_))));
    }

    // --- Output ---------------------------------------------------------------------------------

    #[test]
    fn json_has_every_field_and_null_without_density() {
        let json = report(1024, 64, 196_608).to_json();
        assert!(json.starts_with('{') && json.ends_with('}') && !json.contains('\n'));
        for key in [
            "n",
            "d",
            "sram_elements",
            "dtype",
            "density",
            "in_theorem_range",
            "blocks",
            "fa2_blocks",
            "algorithm0",
            "algorithm1",
            "algorithm1_seed_formula",
            "fa2_forward",
            "block_sparse",
            "standard_backward",
            "fa2_backward",
            "standard_training",
            "fa2_training",
            "lower_bound_order",
            "block_sparse_order",
        ] {
            assert!(json.contains(&format!("\"{key}\":")), "{key} missing in {json}");
        }
        assert!(json.contains("\"algorithm0\":{\"reads\":2293760,\"writes\":2162688,\"total\":4456448,"));
        assert!(json.contains("\"blocks\":{\"bc\":768,\"br\":64,\"tc\":2,\"tr\":16,"));
        assert!(json.contains("\"block_sparse\":null") && json.contains("\"density\":null"));
        assert_eq!(json.matches('{').count(), json.matches('}').count());
    }

    #[test]
    fn json_with_density_has_the_block_sparse_numbers() {
        let r = IoReport::new(&small().with_density(0.5).expect("density")).expect("report");
        let json = r.to_json();
        assert!(json.contains("\"density\":0.5"));
        assert!(json.contains("\"block_sparse\":{\"reads\":80,\"writes\":32,"));
        assert!(json.contains("\"block_sparse_order\":20"));
    }

    #[test]
    fn table_shows_every_algorithm_and_the_seed_numbers() {
        let text = report(1024, 64, 196_608).to_string();
        for needle in [
            "Bc = ⌈M/4d⌉ = 768",
            "Tr = ⌈N/Br⌉ = 16",
            "| Algorithm 0",
            "4456448",
            "532480",
            "598016",
            "FlashAttention-2",
            "Θ(N²d²/M)",
            "outside Theorem 2",
        ] {
            assert!(text.contains(needle), "{needle} missing in\n{text}");
        }
        assert!(!text.contains("Algorithm 5"));
        let sparse = IoReport::new(&small().with_density(0.25).expect("density")).expect("report").to_string();
        assert!(sparse.contains("Algorithm 5 (block-sparse, s = 0.25)") && sparse.contains("Proposition 4"));
    }
}
