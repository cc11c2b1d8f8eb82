//! AMX `bf16` tile products (Sapphire Rapids and later): [`super::gemm::gemm_bf16`] on the tile
//! unit's `tdpbf16ps`, 16 × 16 `f32` tiles of `C`, each `A` tile 16 rows × 16 pairs and each `B`
//! tile 16 pair rows × 16 columns.
//!
//! The pair layout of the AVX-512 BF16 products is already AMX's: a row of `A` as pairs along
//! `k` is a row of an `A` tile, and `B` stored as pairs along `k` (`b[p · ldb + j]` = `B[2p][j],
//! B[2p + 1][j]`) is the "VNNI" layout of a `B` tile, so whole in-bounds blocks load straight
//! from the operands with their row strides. Blocks at an edge (rows, columns or pairs past the
//! end) and blocks of a transposed `A` are copied into zero-padded 16 × 16 scratch blocks first.
//!
//! Each element of `C` is one chain: from `C` when accumulating (else from zero), the pair
//! products added in `k` order, 16 pairs an instruction. Whole 16 × 16 blocks of `C` are loaded
//! into and stored from the tiles in place, edge blocks through scratch; either way the chain is
//! the same, so its bits do not depend on which rows and columns share the call, and zero padding
//! adds exact zeros. `tdpbf16ps` flushes
//! denormal inputs and results to zero, within the numerics contract.
//!
//! The tile registers are used only inside one call: the configuration is loaded at its start
//! and released at its end. Instructions are written with `asm!` (the AMX intrinsics are not
//! stable Rust).

use std::arch::asm;
use std::sync::OnceLock;

/// Whether this CPU and OS run AMX `bf16` for this process: CPUID's AMX-TILE and AMX-BF16, tile
/// state enabled in XCR0, and Linux's permission to use tile data (requested once).
pub fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| cpu_and_os_support() && request_tile_permission())
}

fn cpu_and_os_support() -> bool {
    let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
    let (amx_bf16, amx_tile) = ((leaf7.edx >> 22) & 1 == 1, (leaf7.edx >> 24) & 1 == 1);
    let osxsave = (std::arch::x86_64::__cpuid(1).ecx >> 27) & 1 == 1;
    if !(amx_bf16 && amx_tile && osxsave) {
        return false;
    }
    let xcr0_lo: u32;
    // SAFETY: `xgetbv` with ecx = 0 reads XCR0; it is valid when CPUID reports OSXSAVE (checked).
    unsafe {
        asm!("xgetbv", in("ecx") 0u32, out("eax") xcr0_lo, out("edx") _, options(nomem, nostack, preserves_flags));
    }
    // Bits 17 (XTILECFG) and 18 (XTILEDATA): the OS saves and restores tile state.
    (xcr0_lo >> 17) & 3 == 3
}

#[cfg(target_os = "linux")]
fn request_tile_permission() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) asks the kernel for permission
    // to use the tile data state in this process; it reads and writes no user memory. `syscall`
    // clobbers rcx and r11, declared here.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack)
        );
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_permission() -> bool {
    false
}

/// The 64-byte tile configuration of `ldtilecfg` (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// Words (pairs) per tile row, rows per tile.
const T: usize = 16;

/// A 16 × 16 block of words, 64-byte aligned (one tile).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Block([u32; T * T]);

/// A thread's scratch blocks, kept across calls (a call per tile product must not allocate or
/// clear kilobytes of them): a zero block, the edge blocks of `B` and `C`, and the `A` blocks of
/// one 32-row strip with where each is read from.
struct Scratch {
    zero: Block,
    b_pad: [Block; 2],
    c_out: [[f32; T * T]; 4],
    a_strip: Vec<Block>,
    a_src: Vec<(*const u32, usize)>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = const {
        std::cell::RefCell::new(Scratch {
            zero: Block([0; T * T]),
            b_pad: [Block([0; T * T]); 2],
            c_out: [[0.0; T * T]; 4],
            a_strip: Vec::new(),
            a_src: Vec::new(),
        })
    };
}

/// `C[m × n] (+)= A · B` on `bf16` pairs (as [`super::gemm::gemm_bf16`]; `A` stored transposed
/// when `TA`, as [`super::gemm::gemm_bf16_ta`]).
///
/// # Safety
/// [`available`] is true and the CPU has AVX-512F; every access in bounds (`gemm_bf16_with`
/// asserts it).
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_bf16<const TA: bool>(
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
    SCRATCH.with_borrow_mut(|sc| {
        let k_blocks = kp.div_ceil(T);
        if sc.a_strip.len() < 2 * k_blocks {
            sc.a_strip.resize(2 * k_blocks, Block([0; T * T]));
            sc.a_src.resize(2 * k_blocks, (std::ptr::null(), 0));
        }
        // SAFETY: the caller's contract, forwarded.
        unsafe { run::<TA>(sc, c, ldc, a, lda, b, ldb, m, n, kp, accumulate) }
    })
}

/// [`gemm_bf16`] with the thread's scratch (`a_strip` and `a_src` at least `2 · ceil(kp / 16)`
/// long).
///
/// # Safety
/// As [`gemm_bf16`].
#[allow(clippy::too_many_arguments)]
unsafe fn run<const TA: bool>(
    sc: &mut Scratch,
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
    // Tiles 0-3: the 2 × 2 blocks of C; 4, 5: A of the two row blocks; 6, 7: B of the two
    // column blocks. All 16 rows × 64 bytes.
    let cfg = TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
        rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
    };
    let Scratch { zero, b_pad, c_out, a_strip, a_src } = sc;
    let k_blocks = kp.div_ceil(T);
    let (a_strip, a_src) = (&mut a_strip[..2 * k_blocks], &mut a_src[..2 * k_blocks]);
    // C only through this pointer from here on: the tiles read and write whole blocks of it in
    // place, and the edge blocks are copied in and out through it.
    let cp = c.as_mut_ptr();
    // The A blocks of one 32-row strip, packed once per strip where they cannot be loaded in
    // place (edges, transposed A) and reused by every column block.
    // SAFETY: AMX is available and permitted (caller's contract); `cfg` is a valid palette-1
    // configuration.
    unsafe { asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly)) };
    for i0 in (0..m).step_by(2 * T) {
        for (idx, (src, blk)) in a_src.iter_mut().zip(a_strip.iter_mut()).enumerate() {
            let (r, kb) = (idx / k_blocks, idx % k_blocks);
            let (i, k0) = (i0 + r * T, kb * T);
            if i >= m {
                *src = (zero.0.as_ptr(), 64); // a row block wholly past the end
                continue;
            }
            let (rows, kw) = ((m - i).min(T), (kp - k0).min(T));
            if !TA && rows == T && kw == T {
                *src = (a[i * lda + k0..].as_ptr(), lda * 4);
                continue;
            }
            blk.0.fill(0);
            if TA {
                // Rows k0.. of the stored Aᵀ, columns i..: a transpose of words.
                super::transpose::transpose(super::isa::Isa::Avx512, &mut blk.0, T, &a[k0 * lda + i..], lda, kw, rows);
            } else {
                for (rr, row) in blk.0.chunks_exact_mut(T).take(rows).enumerate() {
                    row[..kw].copy_from_slice(&a[(i + rr) * lda + k0..][..kw]);
                }
            }
            *src = (blk.0.as_ptr(), 64);
        }
        for j0 in (0..n).step_by(2 * T) {
            // Each C block lives in place when whole (loaded when accumulating, stored back with
            // C's row stride), else in its scratch block holding the valid part of C (or zeros);
            // a block wholly past the end is computed on zeros and dropped.
            let mut c_at = [(std::ptr::null_mut::<f32>(), 0usize, false); 4];
            for (q, (at, out)) in c_at.iter_mut().zip(c_out.iter_mut()).enumerate() {
                let (i, j) = (i0 + (q / 2) * T, j0 + (q % 2) * T);
                let (rows, cols) = (m.saturating_sub(i).min(T), n.saturating_sub(j).min(T));
                if rows == T && cols == T {
                    // SAFETY: rows i..i+16 and columns j..j+16 lie in C (rows < m, columns < n,
                    // and the caller's bounds), so the block's first element does.
                    *at = (unsafe { cp.add(i * ldc + j) }, ldc * 4, true);
                } else {
                    out.fill(0.0);
                    // (A block past the last column has no part of C: its rows may end past C.)
                    if accumulate && cols > 0 {
                        for (r, row) in out.chunks_exact_mut(T).take(rows).enumerate() {
                            // SAFETY: row i + r < m and columns j..j+cols <= n lie in C.
                            let src = unsafe { std::slice::from_raw_parts(cp.add((i + r) * ldc + j), cols) };
                            row[..cols].copy_from_slice(src);
                        }
                    }
                    *at = (out.as_mut_ptr(), 64, false);
                }
                let (ptr, stride) = (at.0, at.1);
                // SAFETY: `ptr` is a whole in-bounds 16 × 16 block of C (rows `stride` bytes
                // apart) or a 1 KiB scratch block; tiles configured.
                unsafe {
                    match (q, accumulate || !at.2) {
                        (0, true) => {
                            asm!("tileloadd tmm0, [{} + {}*1]", in(reg) ptr, in(reg) stride, options(nostack, readonly))
                        }
                        (1, true) => {
                            asm!("tileloadd tmm1, [{} + {}*1]", in(reg) ptr, in(reg) stride, options(nostack, readonly))
                        }
                        (2, true) => {
                            asm!("tileloadd tmm2, [{} + {}*1]", in(reg) ptr, in(reg) stride, options(nostack, readonly))
                        }
                        (3, true) => {
                            asm!("tileloadd tmm3, [{} + {}*1]", in(reg) ptr, in(reg) stride, options(nostack, readonly))
                        }
                        (0, false) => asm!("tilezero tmm0", options(nomem, nostack)),
                        (1, false) => asm!("tilezero tmm1", options(nomem, nostack)),
                        (2, false) => asm!("tilezero tmm2", options(nomem, nostack)),
                        _ => asm!("tilezero tmm3", options(nomem, nostack)),
                    }
                }
            }
            for kb in 0..k_blocks {
                let k0 = kb * T;
                let kw = (kp - k0).min(T);
                let a_src = [a_src[kb], a_src[k_blocks + kb]];
                let mut b_src = [(zero.0.as_ptr(), 64usize); 2];
                for (s, src) in b_src.iter_mut().enumerate() {
                    let j = j0 + s * T;
                    if j >= n {
                        continue;
                    }
                    let cols = (n - j).min(T);
                    if cols == T && kw == T {
                        *src = (b[k0 * ldb + j..].as_ptr(), ldb * 4);
                    } else {
                        let blk = &mut b_pad[s].0;
                        blk.fill(0);
                        for (p, row) in blk.chunks_exact_mut(T).take(kw).enumerate() {
                            row[..cols].copy_from_slice(&b[(k0 + p) * ldb + j..][..cols]);
                        }
                        *src = (blk.as_ptr(), 64);
                    }
                }
                // SAFETY: each source is a whole in-bounds 16 × 16 block of the operand (rows
                // `stride` bytes apart, checked above) or a 1 KiB scratch block; tiles configured.
                unsafe {
                    asm!(
                        "tileloadd tmm4, [{a0} + {sa0}*1]",
                        "tileloadd tmm5, [{a1} + {sa1}*1]",
                        "tileloadd tmm6, [{b0} + {sb0}*1]",
                        "tileloadd tmm7, [{b1} + {sb1}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        a0 = in(reg) a_src[0].0,
                        sa0 = in(reg) a_src[0].1,
                        a1 = in(reg) a_src[1].0,
                        sa1 = in(reg) a_src[1].1,
                        b0 = in(reg) b_src[0].0,
                        sb0 = in(reg) b_src[0].1,
                        b1 = in(reg) b_src[1].0,
                        sb1 = in(reg) b_src[1].1,
                        options(nostack, readonly),
                    );
                }
            }
            // SAFETY: each destination is a whole in-bounds 16 × 16 block of C or a 1 KiB
            // scratch block (as loaded above); tiles configured.
            unsafe {
                asm!(
                    "tilestored [{c0} + {s0}*1], tmm0",
                    "tilestored [{c1} + {s1}*1], tmm1",
                    "tilestored [{c2} + {s2}*1], tmm2",
                    "tilestored [{c3} + {s3}*1], tmm3",
                    c0 = in(reg) c_at[0].0,
                    s0 = in(reg) c_at[0].1,
                    c1 = in(reg) c_at[1].0,
                    s1 = in(reg) c_at[1].1,
                    c2 = in(reg) c_at[2].0,
                    s2 = in(reg) c_at[2].1,
                    c3 = in(reg) c_at[3].0,
                    s3 = in(reg) c_at[3].1,
                    options(nostack),
                );
            }
            for (q, out) in c_out.iter().enumerate() {
                let (i, j) = (i0 + (q / 2) * T, j0 + (q % 2) * T);
                if i >= m || j >= n || c_at[q].2 {
                    continue;
                }
                let cols = (n - j).min(T);
                for (r, row) in out.chunks_exact(T).take((m - i).min(T)).enumerate() {
                    // SAFETY: row i + r < m and columns j..j+cols <= n lie in C; no other
                    // reference to C is alive.
                    let dst = unsafe { std::slice::from_raw_parts_mut(cp.add((i + r) * ldc + j), cols) };
                    dst.copy_from_slice(&row[..cols]);
                }
            }
        }
    }
    // SAFETY: releases the tile state configured above.
    unsafe { asm!("tilerelease", options(nomem, nostack)) };
}
