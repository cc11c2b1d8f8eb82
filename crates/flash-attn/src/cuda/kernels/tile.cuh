// Tile and fragment helpers for sm_80+ tensor cores (mma.sync m16n8k16, ldmatrix, cp.async).
//
// The host concatenates tile.cuh, mask.cuh, softmax.cuh and flash_fwd.cuh into one program (in
// that order), so these files carry no #include.
//
// Self-contained on purpose: no CUDA headers, so NVRTC compiles it without cuda_fp16.h /
// cuda_bf16.h. Elements of q, k, v, out travel as raw 16-bit words; the dtype only picks the
// mma instruction and the f32 -> 16-bit conversion.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), lane = 4 * g + t:
//   FragA (16x16, row-major A): x[0] = A[g][2t..2t+1],  x[1] = A[g+8][2t..],
//                               x[2] = A[g][2t+8..],    x[3] = A[g+8][2t+8..]
//   FragB (16x8, B[k][n]):      x[0] = B[2t..2t+1][g],  x[1] = B[2t+8..2t+9][g]
//   FragC (16x8, f32):          x[0..1] = C[g][2t..2t+1], x[2..3] = C[g+8][2t..2t+1]
// so a thread owns rows g and g + 8 of every 16-row tile, and the four threads of a quad
// (same g) share a row: row reductions are two xor-shuffles.


typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define FA_INF __int_as_float(0x7f800000)
#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f

struct FragA { u32 x[4]; };
struct FragB { u32 x[2]; };
struct FragC { float x[4]; };

// ---------------------------------------------------------------- shared memory layout
// A tile of ROWS x D 16-bit elements, stored as 16-byte chunks (8 elements). Chunk c of row r
// lives at chunk position r * (D / 8) + (c ^ (r % 8)): the 8 rows an ldmatrix reads at one
// logical chunk land in 8 distinct 16-byte bank groups, so neither ldmatrix nor the cp.async
// writes conflict (needs D / 8 >= 8, i.e. D >= 64).
template <int D>
__device__ __forceinline__ u32 swizzled_offset(int row, int chunk) {
    static_assert(D % 64 == 0, "swizzle needs rows of at least 8 chunks");
    return (u32)((row * (D / 8) + (chunk ^ (row & 7))) * 16);
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// ---------------------------------------------------------------- async global -> shared copy
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
    // src-size 0 zero-fills the 16 bytes: rows past the end of a sequence become zeros.
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// The wgmma layout of a ROWS x D tile (FA_WGMMA): D / 64 column blocks of ROWS rows x 128 bytes,
// each row's eight 16-byte chunks swizzled by row % 8 (the hardware's 128-byte swizzle, which
// XORs address bits 4-6 with bits 7-9, so blocks start 1024-byte aligned). Chunk c of row r:
template <int ROWS>
__device__ __forceinline__ u32 gmma_offset(int row, int chunk) {
    return (u32)((chunk / 8) * ROWS * 128 + row * 128 + ((chunk & 7) ^ (row & 7)) * 16);
}

// Copies rows [0, ROWS) of a tile whose row r starts at g + r * row_stride (elements) into the
// swizzled tile at `tile` (GMMA: in the wgmma layout, else rows of D elements, `swizzled_offset`);
// rows >= rows_valid and the columns >= cols_valid (a multiple of 8: the columns past a head dim
// the tile width pads) are zero-filled. All THREADS threads take part. A thread copies one 16-byte
// chunk column, every ROWS_PER_PASS-th row: one pointer stepping by a fixed stride, so the
// per-thread addresses cost two registers, not one pair per chunk.
template <int ROWS, int D, int THREADS, bool GMMA = false>
__device__ __forceinline__ void load_tile_async(u32 tile, const u16* g, long long row_stride, int rows_valid,
                                                int cols_valid, int tid) {
    constexpr int CHUNKS_PER_ROW = D / 8;
    // Rows one pass of the threads covers: THREADS / CHUNKS_PER_ROW where that divides; else (the
    // Hopper widths 96 and 192: 12 and 24 chunks a row) the largest multiple of 8 rows that fits,
    // and the threads past them copy nothing.
    constexpr int ROWS_PER_PASS =
        THREADS % CHUNKS_PER_ROW == 0 ? THREADS / CHUNKS_PER_ROW : THREADS / CHUNKS_PER_ROW / 8 * 8;
    static_assert(ROWS_PER_PASS > 0 && ROWS % ROWS_PER_PASS == 0, "tile must split evenly over the threads");
    static_assert(ROWS_PER_PASS % 8 == 0, "every pass must keep the swizzle phase (row & 7)");
    if (THREADS % CHUNKS_PER_ROW != 0 && tid >= ROWS_PER_PASS * CHUNKS_PER_ROW) return;
    // Bytes between rows of one chunk column: a whole row, or one 128-byte row of a column block.
    constexpr int ROW_BYTES = GMMA ? 128 : D * 2;
    const int r0 = tid / CHUNKS_PER_ROW, ch = tid % CHUNKS_PER_ROW;
    const u16* src = g + r0 * row_stride + ch * 8;
    const long long step = ROWS_PER_PASS * row_stride;
    u32 dst = tile;
    if constexpr (GMMA) dst += gmma_offset<ROWS>(r0, ch);
    else dst += swizzled_offset<D>(r0, ch);
    const bool col_ok = 8 * ch < cols_valid;
#pragma unroll
    for (int it = 0; it < ROWS / ROWS_PER_PASS; ++it) {
        const int r = r0 + it * ROWS_PER_PASS;
        const bool valid = col_ok && r < rows_valid;
        cp_async_16(dst + (u32)(it * ROWS_PER_PASS * ROW_BYTES), valid ? src : g, valid);
        src += step;
    }
}

// ---------------------------------------------------------------- ldmatrix
__device__ __forceinline__ void ldmatrix_x4(u32 addr, u32& a, u32& b, u32& c, u32& d) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 addr, u32& a, u32& b, u32& c, u32& d) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
                 : "r"(addr));
}

#if __CUDA_ARCH__ >= 900
// Stores four 8x8 16-bit matrices from the mma fragment layout (register i: matrix i; lanes
// 8i..8i+7 give the addresses of its rows, 16 bytes each). sm_90+.
__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b),
                 "r"(c), "r"(d)
                 : "memory");
}

// stmatrix_x4 storing each 8x8 matrix transposed: lane 8i + r addresses row r of matrix i's
// transpose (column r of the fragment's matrix i).
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a),
                 "r"(b), "r"(c), "r"(d)
                 : "memory");
}
#endif

// `x`, opaque to the compiler: it cannot see which low bits of an address are zero, so constant
// offsets added to it stay additions, which fold into the load's immediate, instead of turning into
// an OR per address (ptxas does that where it can prove the bits disjoint).
__device__ __forceinline__ u32 opaque(u32 x) {
    u32 y;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// Fragment addresses. A thread's ldmatrix row r and logical chunk c = 2·kk + h (h: 0 or 1, from
// the lane) sit at tile + r·2D + 16·((c & ~7) | ((c & 7) ^ (r & 7))). With kk = 4a + b that is
//   (tile + r·2D + 16·(h ^ (r & 7))) ^ (32·b)  +  128·a
// because 2b and h occupy different bits and rows start 128-byte aligned. So every address of
// one operand derives from a single per-lane base: one XOR and an immediate offset per load,
// instead of a register held per (kk, lane) pattern.
__device__ __forceinline__ u32 frag_addr(u32 lane_base, int kk) {
    return (lane_base ^ (u32)(32 * (kk & 3))) + (u32)(128 * (kk >> 2));
}

// Per-lane base of A operands (and of B operands stored [n][k] by 16-row pairs, `load_b_pair`
// below): lanes 0-15 address rows lane at chunk h = 0, lanes 16-31 the same rows at h = 1.
template <int D>
__device__ __forceinline__ u32 lane_base_a(u32 tile, int lane) {
    const int r = lane & 15, h = lane >> 4;
    return tile + (u32)(r * D * 2) + (u32)(16 * (h ^ (r & 7)));
}

// A operand: rows [row0, row0 + 16) x cols [16 kk, 16 kk + 16) of a row-major swizzled tile
// (row0 a multiple of 16).
template <int D>
__device__ __forceinline__ FragA load_a(u32 tile, int row0, int kk, int lane) {
    FragA a;
    u32 addr = frag_addr(lane_base_a<D>(tile, lane), kk) + (u32)(row0 * D * 2);
    ldmatrix_x4(addr, a.x[0], a.x[1], a.x[2], a.x[3]);
    return a;
}

// B operands of two n-tiles from a tile stored [n][k] (K in Q·Kᵀ): rows n0..n0+15, k-chunk
// pair kk (n0 a multiple of 16). Matrices: (n0..7, k lo), (n0..7, k hi), (n8..15, k lo),
// (n8..15, k hi): lane row (lane & 7) + 8·(lane >> 4), chunk half (lane >> 3) & 1.
template <int D>
__device__ __forceinline__ void load_b_pair(u32 tile, int n0, int kk, int lane, FragB& b0, FragB& b1) {
    const int r = (lane & 7) + ((lane >> 4) << 3), h = (lane >> 3) & 1;
    const u32 base = tile + (u32)(r * D * 2) + (u32)(16 * (h ^ (r & 7)));
    ldmatrix_x4(frag_addr(base, kk) + (u32)(n0 * D * 2), b0.x[0], b0.x[1], b1.x[0], b1.x[1]);
}

// B operands of two n-tiles from a tile stored [k][n] (V in P·V), transposed on load: keys
// k0..k0+15 (a multiple of 16), columns (head dim) 16 dp .. 16 dp + 15. Matrices: (k lo, n lo),
// (k hi, n lo), (k lo, n hi), (k hi, n hi): lane row (lane & 7) + 8·((lane >> 3) & 1), chunk
// half lane >> 4.
template <int D>
__device__ __forceinline__ void load_b_pair_trans(u32 tile, int k0, int dp, int lane, FragB& b0, FragB& b1) {
    const int r = (lane & 7) + (((lane >> 3) & 1) << 3), h = lane >> 4;
    const u32 base = tile + (u32)(r * D * 2) + (u32)(16 * (h ^ (r & 7)));
    ldmatrix_x4_trans(frag_addr(base, dp) + (u32)(k0 * D * 2), b0.x[0], b0.x[1], b1.x[0], b1.x[1]);
}

// ---------------------------------------------------------------- mma and conversions
template <bool BF16>
__device__ __forceinline__ void mma(FragC& c, const FragA& a, const FragB& b) {
    if (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c.x[0]), "+f"(c.x[1]), "+f"(c.x[2]), "+f"(c.x[3])
            : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[0]), "r"(b.x[1]));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c.x[0]), "+f"(c.x[1]), "+f"(c.x[2]), "+f"(c.x[3])
            : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[0]), "r"(b.x[1]));
    }
}

// Two f32 rounded to nearest even into one 32-bit word, `lo` in the low half (lower column).
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    if (BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

// One 16-bit element (low half of `w`) widened to f32.
template <bool BF16>
__device__ __forceinline__ float to_f32(u32 w) {
    if (BF16) return __uint_as_float((w & 0xffffu) << 16);
    float f;
    unsigned short h = (unsigned short)(w & 0xffffu);
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// tanh(y) = 1 - 2 / (2^(2·log2(e)·y) + 1) on the hardware's ex2 and a fast division: absolute
// error a few 1e-7 over the whole range (softcap scales it by c: ~1e-5 on a score for c = 30,
// far below the inputs' rounding), ±1 for large |y|, NaN for NaN. tanhf takes ~20 instructions
// and a branch per score. The decode kernel's softcap (the others take `tanh_approx`).
__device__ __forceinline__ float fast_tanh(float y) {
    return 1.f - __fdividef(2.f, fast_exp2(y * 2.8853900817779268f) + 1.f);
}

// tanh(y) on the special-function unit's approximation (sm_75 and later): one instruction,
// relative error below 2^-10.98 (PTX ISA), ±1 for large |y|, NaN for NaN. The score modifier's
// softcap (mask.cuh), whose error bound DESIGN §2's contract holds at bf16 and f16.
__device__ __forceinline__ float tanh_approx(float y) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(y));
    return t;
}

// ---------------------------------------------------------------- quad (row) reductions
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The S accumulator of two adjacent n-tiles (16 keys) becomes the A operand of P·V: the C and A
// layouts agree row for row, so P never leaves registers (FlashAttention-2 §3.1).
template <bool BF16>
__device__ __forceinline__ FragA scores_to_a(const FragC& lo, const FragC& hi) {
    FragA a;
    a.x[0] = pack2<BF16>(lo.x[0], lo.x[1]);
    a.x[1] = pack2<BF16>(lo.x[2], lo.x[3]);
    a.x[2] = pack2<BF16>(hi.x[0], hi.x[1]);
    a.x[3] = pack2<BF16>(hi.x[2], hi.x[3]);
    return a;
}
