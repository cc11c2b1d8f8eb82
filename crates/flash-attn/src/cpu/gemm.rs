//! The one matrix micro-kernel every tile product goes through: `C (+)= A · B` on `f32` tiles,
//! with `B` row-major (packed so its rows are contiguous).
//!
//! `B` may also lie in panels of [`PANEL_WIDTH`] columns ([`BLayout::panels`], [`gemm_b`]): each
//! panel's rows contiguous, one panel after another, so a micro-tile reads its slice of `B` as one
//! sequential stream (the forward's packed `Kᵀ` and `V` tiles).
//!
//! `A` may be given transposed (stored `k × m`, [`gemm_ta`]). Attention's products all take one
//! of these forms once the right operand is packed: `S = Q · Kᵀ` (B = Kᵀ, packed `d × Bc`),
//! `O += P · V` (B = V), and in the backward pass `dP = dO · Vᵀ`, `dV += Pᵀ · dO` (A = P,
//! transposed), `dK += dSᵀ · Q` (A = dS, transposed), `dQ += dS · K`.
//!
//! Paths, chosen at run time (faer/gemm style): AVX-512F (8 rows × 32 columns of accumulators
//! in registers, masked tails), AVX2+FMA (6 × 16), and a portable fallback that LLVM vectorises
//! for the baseline target. A test checks that all available paths agree with an f64 product.
//!
//! [`gemm_bf16`] is the same product on `bf16` operands stored as pairs along `k` (the operand
//! layout of AVX-512 BF16's `vdpbf16ps`, which does 32 products per instruction where an f32 FMA
//! does 16, at the same rate on Zen 4): products of two `bf16` are exact in `f32`, sums are `f32`.

pub use super::isa::Isa;

/// `C[m × n] = A[m × k] · B[k × n]` (or `+=` when `accumulate`), leading dimensions in elements.
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn gemm(
    isa: Isa,
    c: &mut [f32],
    ldc: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    gemm_with(isa, c, ldc, a, lda, false, b, BLayout::rows(ldb), (m, n, k), accumulate)
}

/// `C[m × n] (+)= Aᵀ · B` where `a` holds `A` transposed: `k × m`, row stride `lda`.
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn gemm_ta(
    isa: Isa,
    c: &mut [f32],
    ldc: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    gemm_with(isa, c, ldc, a, lda, true, b, BLayout::rows(ldb), (m, n, k), accumulate)
}

/// Columns per panel of a `B` in [`BLayout::panels`]: the AVX2 micro-tile's width, and half the
/// AVX-512 one's.
pub const PANEL_WIDTH: usize = 16;

/// Where the elements of a `B` operand lie: row `p`, column `j` at
/// `(j / PANEL_WIDTH) · panel + p · ld + j % PANEL_WIDTH`. Row-major ([`BLayout::rows`]) is the
/// case `panel = PANEL_WIDTH`; in panels ([`BLayout::panels`]) each group of `PANEL_WIDTH` columns
/// is a block of its own, rows `PANEL_WIDTH` apart. The kernels read whole panels' rows, so the
/// columns of a product on panels start at a panel's first column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BLayout {
    /// Distance between consecutive rows of a panel.
    pub ld: usize,
    /// Distance between consecutive panels.
    pub panel: usize,
}

impl BLayout {
    /// Row-major at row stride `ld`.
    pub const fn rows(ld: usize) -> Self {
        BLayout { ld, panel: PANEL_WIDTH }
    }

    /// Panels of [`PANEL_WIDTH`] columns by `k` rows, one after another.
    pub const fn panels(k: usize) -> Self {
        BLayout { ld: PANEL_WIDTH, panel: PANEL_WIDTH * k }
    }

    /// Index of row `p`, column `j`.
    #[inline(always)]
    pub const fn index(&self, p: usize, j: usize) -> usize {
        (j / PANEL_WIDTH) * self.panel + p * self.ld + j % PANEL_WIDTH
    }

    /// Elements a `k × n` operand spans (`0` when empty).
    const fn span(&self, k: usize, n: usize) -> usize {
        if k == 0 || n == 0 {
            0
        } else {
            self.index(k - 1, n - 1) + 1
        }
    }
}

/// [`gemm`] with `B` in `bl`'s layout.
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn gemm_b(
    isa: Isa,
    c: &mut [f32],
    ldc: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    bl: BLayout,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    gemm_with(isa, c, ldc, a, lda, false, b, bl, (m, n, k), accumulate)
}

/// [`gemm`] (`trans_a = false`) or [`gemm_ta`]. A path the CPU lacks falls back to the portable
/// one.
#[allow(clippy::too_many_arguments)]
pub fn gemm_with(
    isa: Isa,
    c: &mut [f32],
    ldc: usize,
    a: &[f32],
    lda: usize,
    trans_a: bool,
    b: &[f32],
    bl: BLayout,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    // The intrinsic paths index without bounds checks: establish every access is in bounds. The
    // last panel's last row ends the operand whenever panels are at least a panel row apart.
    let (a_rows, a_cols) = if trans_a { (k, m) } else { (m, k) };
    assert!(
        c.len() >= (m - 1) * ldc + n
            && (k == 0 || (a.len() >= (a_rows - 1) * lda + a_cols && b.len() >= bl.span(k, n)))
            && ldc >= n
            && bl.panel >= PANEL_WIDTH
            && (k == 0 || (lda >= a_cols && bl.ld >= n.min(PANEL_WIDTH))),
        "gemm: tile views out of bounds"
    );
    let (ldb, bps) = (bl.ld, bl.panel);
    #[cfg(target_arch = "x86_64")]
    {
        match isa {
            _ if isa.avx512() => {
                // SAFETY: the CPU supports AVX-512F (checked just above) and the assert above
                // bounds every access the kernel makes.
                return unsafe {
                    if trans_a {
                        x86::gemm_avx512::<true>(c, ldc, a, lda, b, (ldb, bps), m, n, k, accumulate)
                    } else {
                        x86::gemm_avx512::<false>(c, ldc, a, lda, b, (ldb, bps), m, n, k, accumulate)
                    }
                };
            }
            Isa::Avx2 if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") => {
                // SAFETY: as above, for AVX2 and FMA.
                return unsafe {
                    if trans_a {
                        x86::gemm_avx2::<true>(c, ldc, a, lda, b, (ldb, bps), m, n, k, accumulate)
                    } else {
                        x86::gemm_avx2::<false>(c, ldc, a, lda, b, (ldb, bps), m, n, k, accumulate)
                    }
                };
            }
            _ => {}
        }
    }
    #[cfg(target_arch = "aarch64")]
    if isa == Isa::Neon && std::arch::is_aarch64_feature_detected!("neon") {
        // SAFETY: the CPU supports NEON (checked just above) and the assert above bounds every
        // access the kernel makes.
        return unsafe {
            if trans_a {
                super::neon::gemm::<true>(c, ldc, a, lda, b, (ldb, bps), m, n, k, accumulate)
            } else {
                super::neon::gemm::<false>(c, ldc, a, lda, b, (ldb, bps), m, n, k, accumulate)
            }
        };
    }
    let _ = isa;
    gemm_portable(c, ldc, a, lda, trans_a, b, bl, m, n, k, accumulate)
}

/// Two `bf16` values (raw bits) in one word: element `2p` in the low half, `2p + 1` in the high
/// half. Rows of `A` and columns of `B` in [`gemm_bf16`] are sequences of such pairs along `k`.
pub type Bf16Pair = u32;

/// `C[m × n] (+)= A · B` on `bf16` pairs: `a[i · lda + p]` holds `A[i][2p], A[i][2p + 1]`,
/// `b[p · ldb + j]` holds `B[2p][j], B[2p + 1][j]`, `kp` pairs (an odd `k` is padded with a zero).
/// Leading dimensions in words; `C` in `f32`.
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn gemm_bf16(
    isa: Isa,
    c: &mut [f32],
    ldc: usize,
    a: &[Bf16Pair],
    lda: usize,
    b: &[Bf16Pair],
    ldb: usize,
    (m, n, kp): (usize, usize, usize),
    accumulate: bool,
) {
    gemm_bf16_with(isa, c, ldc, a, lda, false, b, ldb, (m, n, kp), accumulate)
}

/// [`gemm_bf16`] with `A` stored transposed: `a[p · lda + i]` holds `A[i][2p], A[i][2p + 1]`
/// (the backward pass's `Pᵀ · dO` and `dSᵀ · Q`, with the pairs along the query rows).
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn gemm_bf16_ta(
    isa: Isa,
    c: &mut [f32],
    ldc: usize,
    a: &[Bf16Pair],
    lda: usize,
    b: &[Bf16Pair],
    ldb: usize,
    (m, n, kp): (usize, usize, usize),
    accumulate: bool,
) {
    gemm_bf16_with(isa, c, ldc, a, lda, true, b, ldb, (m, n, kp), accumulate)
}

/// [`gemm_bf16`] (`trans_a = false`) or [`gemm_bf16_ta`]: on AMX tiles for [`Isa::Amx`], on
/// AVX-512 BF16 or NEON's `BFDOT` where [`Isa::bf16_pairs`] holds, otherwise (or on a CPU
/// without them) the portable loop.
#[allow(clippy::too_many_arguments)]
pub fn gemm_bf16_with(
    isa: Isa,
    c: &mut [f32],
    ldc: usize,
    a: &[Bf16Pair],
    lda: usize,
    trans_a: bool,
    b: &[Bf16Pair],
    ldb: usize,
    (m, n, kp): (usize, usize, usize),
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    let (a_rows, a_cols) = if trans_a { (kp, m) } else { (m, kp) };
    assert!(
        c.len() >= (m - 1) * ldc + n
            && (kp == 0 || (a.len() >= (a_rows - 1) * lda + a_cols && b.len() >= (kp - 1) * ldb + n))
            && ldc >= n
            && (kp == 0 || (lda >= a_cols && ldb >= n)),
        "gemm_bf16: tile views out of bounds"
    );
    #[cfg(target_arch = "x86_64")]
    if isa.amx() {
        // SAFETY: AMX is available and permitted, with AVX-512F (`Isa::amx` checked both), and
        // the assert above bounds every access the kernel makes.
        return unsafe {
            if trans_a {
                super::amx::gemm_bf16::<true>(c, ldc, a, lda, b, ldb, m, n, kp, accumulate)
            } else {
                super::amx::gemm_bf16::<false>(c, ldc, a, lda, b, ldb, m, n, kp, accumulate)
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    if isa.bf16_pairs() {
        // SAFETY: the CPU supports AVX-512F and AVX-512 BF16 (checked just above) and the assert
        // above bounds every access the kernel makes.
        return unsafe {
            if trans_a {
                x86::gemm_avx512_bf16::<true>(c, ldc, a, lda, b, ldb, m, n, kp, accumulate)
            } else {
                x86::gemm_avx512_bf16::<false>(c, ldc, a, lda, b, ldb, m, n, kp, accumulate)
            }
        };
    }
    #[cfg(target_arch = "aarch64")]
    if isa.bf16_pairs() {
        // SAFETY: the CPU supports NEON and the BF16 extension (`Isa::bf16_pairs` checked both)
        // and the assert above bounds every access the kernel makes.
        return unsafe {
            if trans_a {
                super::neon::gemm_bf16::<true>(c, ldc, a, lda, b, ldb, m, n, kp, accumulate)
            } else {
                super::neon::gemm_bf16::<false>(c, ldc, a, lda, b, ldb, m, n, kp, accumulate)
            }
        };
    }
    let _ = isa;
    let widen = |w: Bf16Pair| (f32::from_bits(w << 16), f32::from_bits(w & 0xFFFF_0000));
    for i in 0..m {
        let ci = &mut c[i * ldc..i * ldc + n];
        if !accumulate {
            ci.fill(0.0);
        }
        for p in 0..kp {
            let (a0, a1) = widen(if trans_a { a[a_index::<true>(i, p, lda)] } else { a[a_index::<false>(i, p, lda)] });
            for (cij, &bw) in ci.iter_mut().zip(&b[p * ldb..p * ldb + n]) {
                let (b0, b1) = widen(bw);
                *cij += a0 * b0 + a1 * b1;
            }
        }
    }
}

/// `C += A · B` skipping the zero entries of `A`, so that `0 · x` is never formed: for products
/// whose zeros are masked probabilities and whose `B` may hold NaN or infinities, which must not
/// reach rows that cannot see them. Portable and slower; used only on such inputs. `B` in `bl`'s
/// layout.
#[allow(clippy::too_many_arguments)]
pub fn gemm_acc_skipping_zeros(
    c: &mut [f32],
    ldc: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    bl: BLayout,
    (m, n, k): (usize, usize, usize),
) {
    for i in 0..m {
        let ci = &mut c[i * ldc..i * ldc + n];
        for p in 0..k {
            let aip = a[i * lda + p];
            if aip != 0.0 {
                add_scaled_row(ci, aip, b, bl, p);
            }
        }
    }
}

/// `c[j] += a · B[p][j]` for the columns of `c`, panel by panel (within one, the row's columns
/// are contiguous): a separate multiply and add per element, as the portable paths do.
fn add_scaled_row(c: &mut [f32], a: f32, b: &[f32], bl: BLayout, p: usize) {
    for (q, cs) in c.chunks_mut(PANEL_WIDTH).enumerate() {
        let at = bl.index(p, q * PANEL_WIDTH);
        for (cij, &bpj) in cs.iter_mut().zip(&b[at..]) {
            *cij += a * bpj;
        }
    }
}

/// Element `(i, p)` of `A` (stored transposed when `TA`).
#[inline(always)]
pub(super) fn a_index<const TA: bool>(i: usize, p: usize, lda: usize) -> usize {
    if TA {
        p * lda + i
    } else {
        i * lda + p
    }
}

#[allow(clippy::too_many_arguments)]
fn gemm_portable(
    c: &mut [f32],
    ldc: usize,
    a: &[f32],
    lda: usize,
    trans_a: bool,
    b: &[f32],
    bl: BLayout,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    for i in 0..m {
        let ci = &mut c[i * ldc..i * ldc + n];
        if !accumulate {
            ci.fill(0.0);
        }
        for p in 0..k {
            let aip = if trans_a { a[a_index::<true>(i, p, lda)] } else { a[a_index::<false>(i, p, lda)] };
            add_scaled_row(ci, aip, b, bl, p);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Rows of `C` held in registers per AVX-512 micro-tile (2 × 16 columns each).
    const MR512: usize = 8;

    /// # Safety
    /// AVX-512F available; all accesses in bounds (`gemm_with` asserts it).
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_avx512<const TA: bool>(
        c: &mut [f32],
        ldc: usize,
        a: &[f32],
        lda: usize,
        b: &[f32],
        ldb: (usize, usize),
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) {
        let (cp, ap, bp) = (c.as_mut_ptr(), a.as_ptr(), b.as_ptr());
        let mut j = 0;
        while j < n {
            let w = (n - j).min(32);
            let m0: __mmask16 = if w >= 16 { 0xFFFF } else { ((1u32 << w) - 1) as u16 };
            let m1: __mmask16 = if w >= 32 {
                0xFFFF
            } else if w > 16 {
                ((1u32 << (w - 16)) - 1) as u16
            } else {
                0
            };
            let mut i = 0;
            while i < m {
                let rows = (m - i).min(MR512);
                // SAFETY: forwarded from the caller; rows <= MR512, columns masked to n.
                unsafe {
                    match rows {
                        8 if w == 32 => tile512::<8, TA, true>(cp, ldc, ap, lda, bp, ldb, i, j, k, m0, m1, accumulate),
                        8 => tile512::<8, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, k, m0, m1, accumulate),
                        7 => tile512::<7, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, k, m0, m1, accumulate),
                        6 => tile512::<6, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, k, m0, m1, accumulate),
                        5 => tile512::<5, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, k, m0, m1, accumulate),
                        4 => tile512::<4, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, k, m0, m1, accumulate),
                        3 => tile512::<3, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, k, m0, m1, accumulate),
                        2 => tile512::<2, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, k, m0, m1, accumulate),
                        _ => tile512::<1, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, k, m0, m1, accumulate),
                    }
                }
                i += rows;
            }
            j += w;
        }
    }

    /// One row of a micro-tile's accumulators written to `crow` (added to what is there when
    /// `accumulate`): masked to the columns of `m0`, `m1`, or, when `FULL`, all 32 with plain
    /// loads and stores.
    ///
    /// # Safety
    /// AVX-512F available; the columns written (all 32 when `FULL`) in bounds.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn store_c<const FULL: bool>(
        crow: *mut f32,
        acc: &[__m512; 2],
        (m0, m1): (__mmask16, __mmask16),
        accumulate: bool,
    ) {
        let (mut c0, mut c1) = (acc[0], acc[1]);
        // SAFETY: in bounds by the caller's contract; with m1 = 0 (not FULL) the second half's
        // address may lie past the view and is never touched (wrapping_add).
        unsafe {
            let hi = crow.wrapping_add(16);
            if FULL {
                if accumulate {
                    c0 = _mm512_add_ps(c0, _mm512_loadu_ps(crow));
                    c1 = _mm512_add_ps(c1, _mm512_loadu_ps(hi));
                }
                _mm512_storeu_ps(crow, c0);
                _mm512_storeu_ps(hi, c1);
            } else {
                if accumulate {
                    c0 = _mm512_add_ps(c0, _mm512_maskz_loadu_ps(m0, crow));
                    c1 = _mm512_add_ps(c1, _mm512_maskz_loadu_ps(m1, hi));
                }
                _mm512_mask_storeu_ps(crow, m0, c0);
                _mm512_mask_storeu_ps(hi, m1, c1);
            }
        }
    }

    /// One `R × 32` micro-tile at `(i, j)`; `m0`, `m1` mask the two 16-column halves. `FULL`:
    /// all 32 columns are in bounds, and `B` and `C` are read and written with plain loads and
    /// stores (on Zen 4 the masked ones cost a few percent of the product, measured).
    ///
    /// # Safety
    /// AVX-512F available; rows `i..i+R`, masked columns and `k` in bounds.
    #[target_feature(enable = "avx512f")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile512<const R: usize, const TA: bool, const FULL: bool>(
        c: *mut f32,
        ldc: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        (ldb, bps): (usize, usize),
        i: usize,
        j: usize,
        k: usize,
        m0: __mmask16,
        m1: __mmask16,
        accumulate: bool,
    ) {
        // SAFETY (whole body): every pointer offset stays within the views the caller bounded;
        // masked loads and stores touch only the columns selected by m0/m1.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            // The two 16-column halves are two panels (`j` is a multiple of 32); a fully masked
            // second half's address may lie past the view (wrapping_add, never dereferenced).
            let (lo, hi) = (b.add(j / 16 * bps), b.wrapping_add((j / 16 + 1) * bps));
            for p in 0..k {
                let (brow, brow_hi) = (lo.add(p * ldb), hi.wrapping_add(p * ldb));
                let (b0, b1) = if FULL {
                    (_mm512_loadu_ps(brow), _mm512_loadu_ps(brow_hi))
                } else {
                    (_mm512_maskz_loadu_ps(m0, brow), _mm512_maskz_loadu_ps(m1, brow_hi))
                };
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let av = _mm512_set1_ps(*a.add(super::a_index::<TA>(i + r, p, lda)));
                    acc_r[0] = _mm512_fmadd_ps(av, b0, acc_r[0]);
                    acc_r[1] = _mm512_fmadd_ps(av, b1, acc_r[1]);
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                store_c::<FULL>(c.add((i + r) * ldc + j), acc_r, (m0, m1), accumulate);
            }
        }
    }

    /// [`super::gemm_bf16`] on AVX-512 BF16: the blocking of [`gemm_avx512`], with `vdpbf16ps`.
    ///
    /// # Safety
    /// AVX-512F and AVX-512 BF16 available; all accesses in bounds (`gemm_bf16_with` asserts it).
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_avx512_bf16<const TA: bool>(
        c: &mut [f32],
        ldc: usize,
        a: &[u32],
        lda: usize,
        b: &[u32],
        ldb: usize,
        m: usize,
        n: usize,
        kp: usize,
        accumulate: bool,
    ) {
        let (cp, ap, bp) = (c.as_mut_ptr(), a.as_ptr(), b.as_ptr());
        let mut j = 0;
        while j < n {
            let w = (n - j).min(32);
            let m0: __mmask16 = if w >= 16 { 0xFFFF } else { ((1u32 << w) - 1) as u16 };
            let m1: __mmask16 = if w >= 32 {
                0xFFFF
            } else if w > 16 {
                ((1u32 << (w - 16)) - 1) as u16
            } else {
                0
            };
            let mut i = 0;
            while i < m {
                let rows = (m - i).min(MR512);
                // SAFETY: forwarded from the caller; rows <= MR512, columns masked to n.
                unsafe {
                    match rows {
                        8 if w == 32 => {
                            tile512_bf16::<8, TA, true>(cp, ldc, ap, lda, bp, ldb, i, j, kp, m0, m1, accumulate)
                        }
                        8 => tile512_bf16::<8, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, kp, m0, m1, accumulate),
                        7 => tile512_bf16::<7, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, kp, m0, m1, accumulate),
                        6 => tile512_bf16::<6, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, kp, m0, m1, accumulate),
                        5 => tile512_bf16::<5, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, kp, m0, m1, accumulate),
                        4 => tile512_bf16::<4, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, kp, m0, m1, accumulate),
                        3 => tile512_bf16::<3, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, kp, m0, m1, accumulate),
                        2 => tile512_bf16::<2, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, kp, m0, m1, accumulate),
                        _ => tile512_bf16::<1, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, kp, m0, m1, accumulate),
                    }
                }
                i += rows;
            }
            j += w;
        }
    }

    /// One `R × 32` micro-tile of [`gemm_avx512_bf16`]: per pair of `k`, one broadcast word of
    /// `A` per row against two 16-column words of `B`. `FULL` as in [`tile512`].
    ///
    /// # Safety
    /// AVX-512F and AVX-512 BF16 available; rows `i..i+R`, masked columns and `kp` in bounds.
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile512_bf16<const R: usize, const TA: bool, const FULL: bool>(
        c: *mut f32,
        ldc: usize,
        a: *const u32,
        lda: usize,
        b: *const u32,
        ldb: usize,
        i: usize,
        j: usize,
        kp: usize,
        m0: __mmask16,
        m1: __mmask16,
        accumulate: bool,
    ) {
        // SAFETY (whole body): every pointer offset stays within the views the caller bounded;
        // masked loads and stores touch only the columns selected by m0/m1. The transmutes
        // reinterpret 512 bits of packed bf16 pairs as the intrinsic's `__m512bh`.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            for p in 0..kp {
                let brow = b.add(p * ldb + j);
                // wrapping_add: with m1 = 0 the address may lie past the view and is never read.
                let (b0, b1) = if FULL {
                    (_mm512_loadu_si512(brow.cast()), _mm512_loadu_si512(brow.add(16).cast()))
                } else {
                    (
                        _mm512_maskz_loadu_epi32(m0, brow.cast()),
                        _mm512_maskz_loadu_epi32(m1, brow.wrapping_add(16).cast()),
                    )
                };
                let (b0, b1) =
                    (std::mem::transmute::<__m512i, __m512bh>(b0), std::mem::transmute::<__m512i, __m512bh>(b1));
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let av: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(*a.add(super::a_index::<TA>(i + r, p, lda)) as i32));
                    acc_r[0] = _mm512_dpbf16_ps(acc_r[0], av, b0);
                    acc_r[1] = _mm512_dpbf16_ps(acc_r[1], av, b1);
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                store_c::<FULL>(c.add((i + r) * ldc + j), acc_r, (m0, m1), accumulate);
            }
        }
    }

    /// Rows per AVX2 micro-tile (2 × 8 columns each: 12 accumulators, 2 of `B`, 1 broadcast of
    /// the 16 ymm registers).
    const MR256: usize = 6;

    /// # Safety
    /// AVX2 and FMA available; all accesses in bounds (`gemm_with` asserts it).
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_avx2<const TA: bool>(
        c: &mut [f32],
        ldc: usize,
        a: &[f32],
        lda: usize,
        b: &[f32],
        ldb: (usize, usize),
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) {
        let (cp, ap, bp) = (c.as_mut_ptr(), a.as_ptr(), b.as_ptr());
        let mut j = 0;
        while j < n {
            // A column tail runs the same FMA chain under lane masks: every element of C is the
            // same sequence of operations wherever a tile boundary falls (a scalar tail with
            // separate multiplies and adds made results depend on the panel's first column).
            let w = (n - j).min(16);
            let masks = (lane_mask(w), lane_mask(w.saturating_sub(8)));
            let mut i = 0;
            while i < m {
                let rows = (m - i).min(MR256);
                // SAFETY: forwarded from the caller; rows <= MR256, columns masked to n.
                unsafe {
                    match (rows, w == 16) {
                        (6, true) => tile256::<6, TA, true>(cp, ldc, ap, lda, bp, ldb, i, j, k, masks, accumulate),
                        (6, false) => tile256::<6, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, k, masks, accumulate),
                        (5, _) => tile256::<5, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, k, masks, accumulate),
                        (4, _) => tile256::<4, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, k, masks, accumulate),
                        (3, _) => tile256::<3, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, k, masks, accumulate),
                        (2, _) => tile256::<2, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, k, masks, accumulate),
                        _ => tile256::<1, TA, false>(cp, ldc, ap, lda, bp, ldb, i, j, k, masks, accumulate),
                    }
                }
                i += rows;
            }
            j += w;
        }
    }

    /// Lanes `0..w` of 8 selected (all ones), the rest not: an AVX2 load/store mask.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn lane_mask(w: usize) -> __m256i {
        let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_cmpgt_epi32(_mm256_set1_epi32(w.min(8) as i32), idx)
    }

    /// One `R × 16` micro-tile at `(i, j)`: `masks` select the valid columns of each 8-column
    /// half; `FULL`: all 16 are valid and `B` and `C` move with plain loads and stores.
    ///
    /// # Safety
    /// AVX2 and FMA available; rows `i..i+R`, the masked columns from `j`, and `k` in bounds.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile256<const R: usize, const TA: bool, const FULL: bool>(
        c: *mut f32,
        ldc: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        (ldb, bps): (usize, usize),
        i: usize,
        j: usize,
        k: usize,
        (m0, m1): (__m256i, __m256i),
        accumulate: bool,
    ) {
        // SAFETY (whole body): offsets stay within the views the caller bounded; masked loads
        // and stores touch only the selected columns (a fully masked half's address may lie past
        // the view: wrapping_add, never dereferenced).
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            // The 16 columns are one panel (`j` is a multiple of 16).
            let panel = b.add(j / 16 * bps);
            for p in 0..k {
                let brow = panel.add(p * ldb);
                let (b0, b1) = if FULL {
                    (_mm256_loadu_ps(brow), _mm256_loadu_ps(brow.add(8)))
                } else {
                    (_mm256_maskload_ps(brow, m0), _mm256_maskload_ps(brow.wrapping_add(8), m1))
                };
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let av = _mm256_set1_ps(*a.add(super::a_index::<TA>(i + r, p, lda)));
                    acc_r[0] = _mm256_fmadd_ps(av, b0, acc_r[0]);
                    acc_r[1] = _mm256_fmadd_ps(av, b1, acc_r[1]);
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                let crow = c.add((i + r) * ldc + j);
                let (mut c0, mut c1) = (acc_r[0], acc_r[1]);
                if FULL {
                    if accumulate {
                        c0 = _mm256_add_ps(c0, _mm256_loadu_ps(crow));
                        c1 = _mm256_add_ps(c1, _mm256_loadu_ps(crow.add(8)));
                    }
                    _mm256_storeu_ps(crow, c0);
                    _mm256_storeu_ps(crow.add(8), c1);
                } else {
                    let crow1 = crow.wrapping_add(8);
                    if accumulate {
                        c0 = _mm256_add_ps(c0, _mm256_maskload_ps(crow, m0));
                        c1 = _mm256_add_ps(c1, _mm256_maskload_ps(crow1, m1));
                    }
                    _mm256_maskstore_ps(crow, m0, c0);
                    _mm256_maskstore_ps(crow1, m1, c1);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
        let mut c = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] as f64 * b[p * n + j] as f64).sum();
            }
        }
        c
    }

    #[test]
    fn every_path_agrees_with_an_f64_product_on_odd_shapes() {
        let mut rng = crate::check::Rng::new(9);
        for &(m, n, k) in &[(1, 1, 1), (3, 5, 7), (8, 32, 16), (9, 33, 17), (13, 47, 64), (64, 64, 128), (2, 100, 3)] {
            let a: Vec<f32> = (0..m * k).map(|_| rng.normal() as f32).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.normal() as f32).collect();
            let want = reference(&a, &b, m, n, k);
            let at: Vec<f32> = (0..k * m).map(|idx| a[(idx % m) * k + idx / m]).collect();
            for path in Isa::available() {
                for (accumulate, trans_a) in [(false, false), (true, false), (false, true), (true, true)] {
                    let init: Vec<f32> = (0..m * n).map(|x| x as f32 * 0.25).collect();
                    let mut c = init.clone();
                    let (a_op, lda) = if trans_a { (&at, m) } else { (&a, k) };
                    gemm_with(path, &mut c, n, a_op, lda, trans_a, &b, BLayout::rows(n), (m, n, k), accumulate);
                    for (idx, (&got, &w)) in c.iter().zip(&want).enumerate() {
                        let w = if accumulate { w + init[idx] as f64 } else { w };
                        assert!(
                            (got as f64 - w).abs() <= 1e-5 * (k as f64).sqrt() * (1.0 + w.abs()),
                            "{path:?} {m}x{n}x{k} acc={accumulate} [{idx}]: {got} vs {w}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn bf16_pair_paths_agree_with_an_f64_product_on_odd_shapes() {
        let mut rng = crate::check::Rng::new(11);
        let bf16 = |rng: &mut crate::check::Rng| half::bf16::from_f64(rng.normal()).to_bits() as u32;
        let widen = |w: u32, hi: bool| f32::from_bits(if hi { w & 0xFFFF_0000 } else { w << 16 }) as f64;
        for &(m, n, kp) in &[(1, 1, 1), (3, 5, 7), (8, 32, 16), (9, 33, 17), (13, 47, 32), (2, 100, 3)] {
            let a: Vec<u32> = (0..m * kp).map(|_| bf16(&mut rng) | bf16(&mut rng) << 16).collect();
            let b: Vec<u32> = (0..kp * n).map(|_| bf16(&mut rng) | bf16(&mut rng) << 16).collect();
            let init: Vec<f32> = (0..m * n).map(|x| x as f32 * 0.25).collect();
            let at: Vec<u32> = (0..kp * m).map(|idx| a[(idx % m) * kp + idx / m]).collect();
            for (fast, accumulate, trans_a) in
                Isa::available().into_iter().flat_map(|isa| (0..4).map(move |x| (isa, x & 1 != 0, x & 2 != 0)))
            {
                let mut c = init.clone();
                let (a_op, lda) = if trans_a { (&at, m) } else { (&a, kp) };
                gemm_bf16_with(fast, &mut c, n, a_op, lda, trans_a, &b, n, (m, n, kp), accumulate);
                for i in 0..m {
                    for j in 0..n {
                        let dot: f64 = (0..kp)
                            .map(|p| {
                                let (aw, bw) = (a[i * kp + p], b[p * n + j]);
                                widen(aw, false) * widen(bw, false) + widen(aw, true) * widen(bw, true)
                            })
                            .sum();
                        let want = if accumulate { dot + init[i * n + j] as f64 } else { dot };
                        let got = c[i * n + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * (2.0 * kp as f64).sqrt() * (1.0 + want.abs()),
                            "fast={fast} ta={trans_a} {m}x{n}x{kp} acc={accumulate} [{i},{j}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// What the bitwise invariances rest on: an element of `C` is the same sequence of operations
    /// whichever rows and columns share its call (attention's Partial tiles multiply column
    /// ranges that start wherever a panel's keys start).
    #[test]
    fn an_element_gets_the_same_bits_wherever_its_tile_starts() {
        let mut rng = crate::check::Rng::new(13);
        let (m, n, k) = (19, 53, 37);
        let a: Vec<f32> = (0..m * k).map(|_| rng.normal() as f32).collect();
        let at: Vec<f32> = (0..k * m).map(|idx| a[(idx % m) * k + idx / m]).collect();
        let b: Vec<f32> = (0..k * n).map(|_| rng.normal() as f32).collect();
        let init: Vec<f32> = (0..m * n).map(|_| rng.normal() as f32).collect();
        for isa in Isa::available() {
            for (accumulate, trans_a) in [(false, false), (true, false), (false, true), (true, true)] {
                let (a_op, lda) = if trans_a { (&at, m) } else { (&a, k) };
                let mut whole = init.clone();
                gemm_with(isa, &mut whole, n, a_op, lda, trans_a, &b, BLayout::rows(n), (m, n, k), accumulate);
                for (r0, c0) in [(0, 1), (3, 5), (7, 17), (1, 31), (11, 40), (0, 52)] {
                    for (rows, cols) in [(1, 1), (5, 9), (8, 13)] {
                        let (rows, cols) = (rows.min(m - r0), cols.min(n - c0));
                        let mut part = init.clone();
                        let a_view = if trans_a { &at[r0..] } else { &a[r0 * k..] };
                        gemm_with(
                            isa,
                            &mut part[r0 * n + c0..],
                            n,
                            a_view,
                            lda,
                            trans_a,
                            &b[c0..],
                            BLayout::rows(n),
                            (rows, cols, k),
                            accumulate,
                        );
                        for i in r0..r0 + rows {
                            for j in c0..c0 + cols {
                                assert_eq!(
                                    part[i * n + j].to_bits(),
                                    whole[i * n + j].to_bits(),
                                    "{isa} acc={accumulate} ta={trans_a} tile at ({r0}, {c0}): [{i}, {j}]"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// `B` packed in panels ([`BLayout::panels`]) gives every element the bits of the row-major
    /// product, on every path: whole, from any panel's first column, and from any row of `B`
    /// (with `A`'s columns from the same index: a product over a later range of keys).
    #[test]
    fn b_in_panels_gives_the_row_major_bits() {
        let mut rng = crate::check::Rng::new(19);
        for &(m, n, k) in &[(1, 1, 1), (7, 53, 37), (19, 16, 5), (3, 33, 128), (13, 64, 20)] {
            let a: Vec<f32> = (0..m * k).map(|_| rng.normal() as f32).collect();
            let at: Vec<f32> = (0..k * m).map(|idx| a[(idx % m) * k + idx / m]).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.normal() as f32).collect();
            let init: Vec<f32> = (0..m * n).map(|_| rng.normal() as f32).collect();
            let bl = BLayout::panels(k);
            // Unused columns of the last panel hold NaN: a kernel that read them would show it.
            let mut packed = vec![f32::NAN; n.div_ceil(PANEL_WIDTH) * bl.panel];
            for p in 0..k {
                for j in 0..n {
                    packed[bl.index(p, j)] = b[p * n + j];
                }
            }
            for isa in Isa::available() {
                for (accumulate, trans_a) in [(false, false), (true, false), (false, true), (true, true)] {
                    let lda = if trans_a { m } else { k };
                    for c0 in (0..n).step_by(PANEL_WIDTH) {
                        for p0 in [0, k / 3, k - 1] {
                            let (cols, depth) = (n - c0, k - p0);
                            let a_view = if trans_a { &at[p0 * lda..] } else { &a[p0..] };
                            let mut want = init.clone();
                            let b_rows = &b[p0 * n + c0..];
                            gemm_with(
                                isa,
                                &mut want[c0..],
                                n,
                                a_view,
                                lda,
                                trans_a,
                                b_rows,
                                BLayout::rows(n),
                                (m, cols, depth),
                                accumulate,
                            );
                            let mut got = init.clone();
                            let b_panels = &packed[bl.index(p0, c0)..];
                            gemm_with(
                                isa,
                                &mut got[c0..],
                                n,
                                a_view,
                                lda,
                                trans_a,
                                b_panels,
                                bl,
                                (m, cols, depth),
                                accumulate,
                            );
                            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(
                                bits(&got),
                                bits(&want),
                                "{isa} {m}x{n}x{k} acc={accumulate} ta={trans_a} from ({p0}, {c0})"
                            );
                        }
                    }
                }
            }
        }
    }

    /// [`an_element_gets_the_same_bits_wherever_its_tile_starts`] for the `bf16` pair products
    /// (AVX-512 BF16 and AMX tiles, whose edge blocks are zero-padded).
    #[test]
    fn a_bf16_element_gets_the_same_bits_wherever_its_tile_starts() {
        let mut rng = crate::check::Rng::new(17);
        let bf16 = |rng: &mut crate::check::Rng| half::bf16::from_f64(rng.normal()).to_bits() as u32;
        let (m, n, kp) = (37, 45, 40);
        let a: Vec<u32> = (0..m * kp).map(|_| bf16(&mut rng) | bf16(&mut rng) << 16).collect();
        let at: Vec<u32> = (0..kp * m).map(|idx| a[(idx % m) * kp + idx / m]).collect();
        let b: Vec<u32> = (0..kp * n).map(|_| bf16(&mut rng) | bf16(&mut rng) << 16).collect();
        let init: Vec<f32> = (0..m * n).map(|_| rng.normal() as f32).collect();
        for isa in Isa::available() {
            for (accumulate, trans_a) in [(false, false), (true, false), (false, true), (true, true)] {
                let (a_op, lda) = if trans_a { (&at, m) } else { (&a, kp) };
                let mut whole = init.clone();
                gemm_bf16_with(isa, &mut whole, n, a_op, lda, trans_a, &b, n, (m, n, kp), accumulate);
                for (r0, c0) in [(0, 1), (3, 5), (16, 17), (1, 31), (20, 40), (36, 0)] {
                    for (rows, cols) in [(1, 1), (5, 9), (17, 16), (32, 33)] {
                        let (rows, cols) = (rows.min(m - r0), cols.min(n - c0));
                        let mut part = init.clone();
                        let a_view = if trans_a { &at[r0..] } else { &a[r0 * kp..] };
                        let dst = &mut part[r0 * n + c0..];
                        gemm_bf16_with(isa, dst, n, a_view, lda, trans_a, &b[c0..], n, (rows, cols, kp), accumulate);
                        for i in r0..r0 + rows {
                            for j in c0..c0 + cols {
                                assert_eq!(
                                    part[i * n + j].to_bits(),
                                    whole[i * n + j].to_bits(),
                                    "{isa} acc={accumulate} ta={trans_a} tile at ({r0}, {c0}): [{i}, {j}]"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn leading_dimensions_larger_than_the_tile_leave_the_rest_untouched() {
        let (m, n, k, ld) = (5, 19, 6, 40);
        let a: Vec<f32> = (0..m * ld).map(|x| (x % 7) as f32 - 3.0).collect();
        let b: Vec<f32> = (0..k * ld).map(|x| (x % 5) as f32 - 2.0).collect();
        for path in Isa::available() {
            let mut c = vec![7.0f32; m * ld];
            gemm_with(path, &mut c, ld, &a, ld, false, &b, BLayout::rows(ld), (m, n, k), false);
            for i in 0..m {
                assert!(c[i * ld + n..(i + 1) * ld].iter().all(|&x| x == 7.0), "{path:?}");
            }
        }
    }
}
