// FP8 (e4m3) forward for sm_90a: FlashFwdSm90's structure (flash_fwd.cuh) with both products on
// e4m3 warpgroup MMAs (wgmma_fp8.cuh, m64nNk32: twice the 16-bit rate), f32 accumulation, the
// output in bf16 (FlashAttention-3's FP8 forward).
//
// Inputs: q and k as e4m3 bytes in their own layouts (strides in bytes); V transposed and
// permuted by `fp8_transpose_v` below into Vᵀ planes of [FA_D rows][sk_pad keys], because an
// 8-bit wgmma reads B K-major only (no transposing form) and P·V's K is the key. The descale
// factors fold into two scalars: `scale_log2` = softmax scale · descale_q · descale_k · log2(e)
// (so the scores, the softmax and the lse are those of the dequantized inputs), and
// `v_descale`, applied with the final 1 / rowsum.
//
// P goes from the score registers to an e4m3 A operand without a shuffle: a thread holds keys
// {2t, 2t+1, 8+2t, 9+2t} of every 16 of a row in the accumulator, and the 8-bit A fragment wants
// four consecutive k positions {4t .. 4t+3}. P·V is a sum over keys, so the keys may be taken in
// any order that P and V share: the transpose stores key 16a + 8(j / 2) + 2t + j % 2 at position
// 16a + 4t + j of Vᵀ, and the thread's four accumulator values become one A register as they are.
// The probabilities are rounded to e4m3 after the row sum took them unrounded (their rounding is
// what the FP8 contract bounds: docs/semantics.md, "FP8 inputs").
//
// Not in this kernel (the launcher refuses them with a typed error): varlen batches, dropout,
// softcap, ALiBi, block masks.

#ifndef FA_E4M3
#define FA_E4M3 1  // 1: e4m3 inputs (bf16 out); 0: the warp-specialised kernel on FA_BF16's 16-bit type
#endif

#if !FA_FWD_ENTRY && FA_WGMMA

// `FwdParams` with q, k: e4m3 bytes, strides in bytes; v: the Vᵀ planes (v_batch, v_head: bytes
// between planes; v_row: bytes between its rows, sk_pad); o: bf16, strides in elements. Field for
// field `Fp8FwdParams` in src/cuda/launch.rs.
struct Fp8FwdParams {
    FwdParams base;
    float v_descale;
};

// Four probabilities to e4m3 (round to nearest even, saturating), `b0` in the lowest byte.
__device__ __forceinline__ u32 pack4_e4m3(float b0, float b1, float b2, float b3) {
    u32 r;
    asm("{\n"
        ".reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
        "mov.b32 %0, {lo, hi};\n"
        "}\n"
        : "=r"(r)
        : "f"(b0), "f"(b1), "f"(b2), "f"(b3));
    return r;
}

// Probabilities of a raw score tile (unscaled q·k, one 16-row tile a warp) in place, with the
// online-softmax state of its two rows (`row_max` in raw units, `row_sum` this thread's partial
// sums) and `correction` for O: the scale folded into the exponent's FMA, the row max and sum as
// trees rather than chains (one FMNMX or FADD after another is a chain of latencies). Needs
// scale_log2 > 0 (the max of the raw scores is the max of the scaled ones, and a hidden -inf stays
// -inf): the launchers send other scales to kernels that scale first.
template <int NT>
__device__ __forceinline__ void ws_softmax_tile(FragC (&s)[1][NT], float (&row_max)[2], float (&row_sum)[2],
                                                 float scale_log2, float (&correction)[2]) {
    static_assert((NT & (NT - 1)) == 0, "the trees halve: a power-of-two count of n-tiles");
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float v[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) v[nt] = fmaxf(s[0][nt].x[2 * r], s[0][nt].x[2 * r + 1]);
#pragma unroll
        for (int level = 1; level < NT; level *= 2)  // indices known at compile time: registers
#pragma unroll
            for (int i = 0; i < NT; i += 2 * level) v[i] = fmaxf(v[i], v[i + level]);
        const float m = quad_max(fmaxf(v[0], row_max[r]));  // raw units; scale_log2 > 0
        const float base = (m == -FA_INF) ? 0.f : m * scale_log2;
        const float corr = fast_exp2(row_max[r] * scale_log2 - base);
        row_max[r] = m;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const float p0 = fast_exp2(fmaf(s[0][nt].x[2 * r], scale_log2, -base));
            const float p1 = fast_exp2(fmaf(s[0][nt].x[2 * r + 1], scale_log2, -base));
            s[0][nt].x[2 * r] = p0;
            s[0][nt].x[2 * r + 1] = p1;
            v[nt] = p0 + p1;
        }
#pragma unroll
        for (int level = 1; level < NT; level *= 2)
#pragma unroll
            for (int i = 0; i < NT; i += 2 * level) v[i] += v[i + level];
        row_sum[r] = row_sum[r] * corr + v[0];
        correction[r] = corr;
    }
}

// The end of a warp's rows: O *= v_descale / rowsum, and each row's natural-log lse of the
// scaled scores (rows that saw no key: O = 0, lse = -inf, DESIGN §2 rule 5).
template <int DT>
__device__ __forceinline__ void ws_finish(FragC (&o)[1][DT], const float (&row_max)[2], const float (&row_sum)[2],
                                           float scale_log2, float v_descale, float (&lse)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float sum = quad_sum(row_sum[r]);
        // No visible key: sum 0. A NaN sum (a NaN score in the row) reaches o and lse, as in the
        // oracle.
        const bool empty = sum == 0.f;
        const float inv = empty ? 0.f : v_descale / sum;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            o[0][dt].x[2 * r] *= inv;
            o[0][dt].x[2 * r + 1] *= inv;
        }
        lse[r] = empty ? -FA_INF : (row_max[r] * scale_log2 + __log2f(sum)) * FA_LN2;
    }
}

template <int D, int BC, int WARPS>
struct FlashFwdFp8Sm90 {
    using Base = FlashFwd<D, 1, BC, WARPS, true>;  // masks and the bf16 output store
    static_assert(WARPS % 4 == 0, "whole warpgroups");
    static_assert(D % 128 == 0, "Q and K rows are whole 128-byte swizzle rows");
    static_assert(BC == 128, "a Vᵀ tile row is one 128-byte swizzle row: 128 keys");
    static constexpr int BR = WARPS * 16;
    static constexpr int THREADS = WARPS * 32;
    static constexpr int NT = BC / 8;
    static constexpr int DT = D / 8;
    static constexpr int Q_BYTES = BR * D;
    static constexpr int K_BYTES = BC * D;
    static constexpr int V_BYTES = D * BC;
    // Q, two K and two Vᵀ buffers; the bf16 output is staged over Q and the K buffers at the end.
    static constexpr int SMEM_BYTES = Q_BYTES + 2 * K_BYTES + 2 * V_BYTES;
    static_assert(SMEM_BYTES >= BR * D * 2, "room to stage the output");
    // S of the next tile and P·V of the previous one in flight together, as FlashFwdSm90; at
    // D = 256 the output alone takes 128 registers a thread, and the products run in turn.
    static constexpr bool OVERLAP = D <= 128;

    // S = Q Kᵀ for this warpgroup's 64 rows as one wgmma group (unscaled).
    static __device__ __forceinline__ void issue_scores(FragC (&s)[1][NT], u32 sQw, u32 sK) {
        fence_operands(s[0]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 32; ++kk) {
            const u64 da = gmma_desc(sQw + (u32)((kk / 4) * BR * 128 + (kk % 4) * 32), 16, 1024);
            const u64 db = gmma_desc(sK + (u32)((kk / 4) * BC * 128 + (kk % 4) * 32), 16, 1024);
            wgmma_fp8_ss<BC>(s[0], da, db, kk > 0);
        }
        wgmma_commit();
    }

    // O += P V as one wgmma group, P from registers (e4m3, 32 keys a FragA), Vᵀ from shared memory.
    static __device__ __forceinline__ void issue_pv(FragC (&o)[1][DT], FragA (&pa)[BC / 32], u32 sV) {
#pragma unroll
        for (int kk = 0; kk < BC / 32; ++kk) fence_operands(pa[kk]);
        fence_operands(o[0]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 32; ++kk) wgmma_fp8_rs<D>(o[0], pa[kk], gmma_desc(sV + (u32)(kk * 32), 16, 1024));
        wgmma_commit();
    }

    static __device__ __forceinline__ void pv_done(FragC (&o)[1][DT], FragA (&pa)[BC / 32]) {
        fence_operands(o[0]);
#pragma unroll
        for (int kk = 0; kk < BC / 32; ++kk) fence_operands(pa[kk]);
    }

    // The probabilities of a score tile as e4m3 A operands, in the key order of the Vᵀ planes.
    static __device__ __forceinline__ void pack_p(FragA (&pa)[BC / 32], const FragC (&s)[1][NT]) {
#pragma unroll
        for (int kk = 0; kk < BC / 32; ++kk) {
            const FragC &a = s[0][4 * kk], &b = s[0][4 * kk + 1], &c = s[0][4 * kk + 2], &d = s[0][4 * kk + 3];
            pa[kk].x[0] = pack4_e4m3(a.x[0], a.x[1], b.x[0], b.x[1]);
            pa[kk].x[1] = pack4_e4m3(a.x[2], a.x[3], b.x[2], b.x[3]);
            pa[kk].x[2] = pack4_e4m3(c.x[0], c.x[1], d.x[0], d.x[1]);
            pa[kk].x[3] = pack4_e4m3(c.x[2], c.x[3], d.x[2], d.x[3]);
        }
    }

    static __device__ __forceinline__ void run(const Fp8FwdParams& pp, char* smem) {
        const FwdParams& p = pp.base;
        const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
        int m_block, bh;
        fwd_item(p, (int)blockIdx.x, m_block, bh);
        const int b = bh / p.hq, h = bh % p.hq, hk = h / p.group;
        const int sq = p.sq, sk = p.sk;
        const int row0 = m_block * BR;
        if (row0 >= sq) return;
        const int rows_valid = min(BR, sq - row0);
        const Visibility vis{sq, sk, sk - sq, p.causal, p.window_left, p.window_right};

        const unsigned char* gQ =
            reinterpret_cast<const unsigned char*>(p.q) + b * p.q_batch + (long long)row0 * p.q_row + h * p.q_head;
        const unsigned char* gK = reinterpret_cast<const unsigned char*>(p.k) + b * p.k_batch + hk * p.k_head;
        const unsigned char* gV = reinterpret_cast<const unsigned char*>(p.v) + b * p.v_batch + hk * p.v_head;
        u16* gO = p.o + b * p.o_batch + (long long)row0 * p.o_row + h * p.o_head;
        float* gL = p.lse + b * p.lse_batch + h * p.lse_head + row0;

        // `smem` is 1024-byte aligned (the 128-byte swizzle's period).
        const u32 sQ = smem_addr(smem), sK0 = sQ + Q_BYTES, sV0 = sK0 + 2 * K_BYTES;
        const int warp_row = warp * 16;
        const u32 sQw = sQ + (u32)((warp / 4) * 64 * 128);

        FragC o[1][DT];
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[0][dt].x[e] = 0.f;
        float row_max[2] = {-FA_INF, -FA_INF}, row_sum[2] = {0.f, 0.f};

        int key_lo, key_hi;
        vis.key_range(row0, row0 + rows_valid, key_lo, key_hi);
        const int n_begin = key_lo / BC, n_end = (key_hi + BC - 1) / BC;

        // Tiles move as 16-bit words (two e4m3 a word): a row of D bytes is D / 2 words. K's rows
        // past the sequence and its columns past d are zero-filled; Vᵀ planes are whole tiles.
        auto load_k = [&](int n, u32 tile) {
            const int c = n * BC;
            load_tile_async<BC, D / 2, THREADS, true>(tile, reinterpret_cast<const u16*>(gK + (long long)c * p.k_row),
                                                      p.k_row / 2, sk - c, p.d / 2, tid);
        };
        auto load_v = [&](int n, u32 tile) {
            load_tile_async<D, BC / 2, THREADS, true>(tile, reinterpret_cast<const u16*>(gV + n * BC), p.v_row / 2,
                                                      D, BC / 2, tid);
        };
        auto probabilities = [&](FragC (&s)[1][NT], int col0, float (&correction)[1][2]) {
            if (!vis.tile_full(row0, row0 + rows_valid, col0, col0 + BC))
                Base::apply_mask(s, vis, nullptr, p.block, row0 + warp_row, col0, lane);
            ws_softmax_tile(s, row_max, row_sum, p.scale_log2, correction[0]);
        };
        // As FlashFwdSm90::run's `advance`: K of the next tile and (with OVERLAP) V of this one.
        auto advance = [&](int n, int j) {
            cp_async_wait<0>();
            fence_proxy_async();
            __syncthreads();
            if (n - 1 >= n_begin) {
                load_k(n - 1, sK0 + (u32)(((j + 1) & 1) * K_BYTES));
                if (!OVERLAP) load_v(n - 1, sV0 + (u32)(((j + 1) & 1) * V_BYTES));
            }
            if (OVERLAP) load_v(n, sV0 + (u32)((j & 1) * V_BYTES));
            cp_async_commit();
        };

        int n = n_end - 1;
        if (n >= n_begin) {
            load_tile_async<BR, D / 2, THREADS, true>(sQ, reinterpret_cast<const u16*>(gQ), p.q_row / 2, rows_valid,
                                                      p.d / 2, tid);
            load_k(n, sK0);
            if (!OVERLAP) load_v(n, sV0);
            cp_async_commit();
            FragA pa[BC / 32];
            if constexpr (OVERLAP) {
                {
                    advance(n, 0);
                    FragC s[1][NT];
                    issue_scores(s, sQw, sK0);
                    wgmma_wait<0>();
                    fence_operands(s[0]);
                    float correction[1][2];
                    probabilities(s, n * BC, correction);
                    pack_p(pa, s);
                    --n;
                }
                int j = 1;
                while (n >= n_begin) {
                    advance(n, j);
                    FragC s[1][NT];
                    issue_scores(s, sQw, sK0 + (u32)((j & 1) * K_BYTES));
                    issue_pv(o, pa, sV0 + (u32)(((j - 1) & 1) * V_BYTES));
                    wgmma_wait<1>();
                    fence_operands(s[0]);
                    float correction[1][2];
                    probabilities(s, n * BC, correction);
                    wgmma_wait<0>();
                    pv_done(o, pa);
                    OnlineSoftmax<1>::rescale(o, correction);
                    pack_p(pa, s);
                    --n;
                    ++j;
                }
                cp_async_wait<0>();
                fence_proxy_async();
                __syncthreads();
                issue_pv(o, pa, sV0 + (u32)(((j - 1) & 1) * V_BYTES));
                wgmma_wait<0>();
                pv_done(o, pa);
            } else {
                for (int j = 0; n >= n_begin; ++j, --n) {
                    advance(n, j);
                    FragC s[1][NT];
                    issue_scores(s, sQw, sK0 + (u32)((j & 1) * K_BYTES));
                    wgmma_wait<0>();
                    fence_operands(s[0]);
                    float correction[1][2];
                    probabilities(s, n * BC, correction);
                    OnlineSoftmax<1>::rescale(o, correction);
                    pack_p(pa, s);
                    issue_pv(o, pa, sV0 + (u32)((j & 1) * V_BYTES));
                    wgmma_wait<0>();
                    pv_done(o, pa);
                }
            }
        }

        float lse[1][2];
        ws_finish(o, row_max, row_sum, p.scale_log2, pp.v_descale, lse[0]);
        __syncthreads();  // Q's and the K buffers' memory is reused for the output
        Base::template store<D>(o, lse, sQ, gO, p.o_row, gL, rows_valid, p.d, warp_row, lane, tid);
    }
};

#ifndef FA_WS
#define FA_WS 0  // 1: the warp-specialised kernel (flash_fwd_ws.cuh); 0: FlashFwdFp8Sm90 (e4m3 only)
#endif
#ifndef FA_FP8_SCHED
#define FA_FP8_SCHED 0  // 1: the warp-specialised e4m3 kernel takes items from the tile scheduler
#endif

#if !FA_WS
extern "C" __global__ void __launch_bounds__(FA_WARPS * 32, 1) flash_fwd_fp8(const Fp8FwdParams p) {
    extern __shared__ __align__(128) char smem[];
    // The launcher adds 1 KiB so that the tiles can start on the swizzle's 1024-byte period.
    const u32 base = smem_addr(smem);
    FlashFwdFp8Sm90<FA_D, FA_BC, FA_WARPS>::run(p, smem + (((base + 1023u) & ~1023u) - base));
}
#endif

// V [b, sk, hk, d] (e4m3, strides that are multiples of 16 bytes) to the Vᵀ planes
// flash_fwd_fp8 reads: plane b·hk + h holds FA_D rows (the head dim; zero past d) of sk_pad bytes,
// position 16a + 4t + j holding key 16a + 8(j / 2) + 2t + j % 2 (zero past sk). Every byte of the
// planes is written, so their buffer needs no clearing. Without shared memory: lane
// t + 4·g + 8·c of a warp reads the four keys 16g + {2t, 2t + 1, 8 + 2t, 9 + 2t} of a 32-key
// block at 8 columns (c: which 8 of the warp's 32), transposes the 4 x 8 bytes in registers
// (byte permutes), and writes one 4-byte word to each of the 8 rows: 32-byte pieces both ways.
// A block of 128 threads moves 32 keys x 128 columns; the grid is (sk_pad / 32, FA_D / 128, planes).
struct Fp8TransposeParams {
    const unsigned char* v;
    unsigned char* vt;
    long long v_batch, v_row, v_head;  // bytes
    long long vt_plane;                // bytes between planes
    int hk, sk, d, sk_pad;
};

// Bytes j of x0..x3 as word j's bytes 0..3 (a 4 x 4 byte transpose).
__device__ __forceinline__ void transpose4(u32 x0, u32 x1, u32 x2, u32 x3, u32 (&o)[4]) {
    const u32 t0 = __byte_perm(x0, x1, 0x5140), t1 = __byte_perm(x0, x1, 0x7362);
    const u32 t2 = __byte_perm(x2, x3, 0x5140), t3 = __byte_perm(x2, x3, 0x7362);
    o[0] = __byte_perm(t0, t2, 0x5410);
    o[1] = __byte_perm(t0, t2, 0x7632);
    o[2] = __byte_perm(t1, t3, 0x5410);
    o[3] = __byte_perm(t1, t3, 0x7632);
}

extern "C" __global__ void __launch_bounds__(128) fp8_transpose_v(const Fp8TransposeParams p) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int t = lane & 3, g = (lane >> 2) & 1, c = lane >> 3;
    const int plane = blockIdx.z, b = plane / p.hk, h = plane % p.hk;
    const int key0 = blockIdx.x * 32 + 16 * g;             // this lane's 16-key group
    const int col = blockIdx.y * 128 + 32 * warp + 8 * c;  // its 8 columns
    const unsigned char* src = p.v + b * p.v_batch + h * p.v_head + col;
    uint2 w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int key = key0 + 8 * (j >> 1) + 2 * t + (j & 1);
        w[j] = make_uint2(0u, 0u);
        if (key < p.sk && col < p.d) w[j] = *reinterpret_cast<const uint2*>(src + (long long)key * p.v_row);
    }
    u32 lo[4], hi[4];
    transpose4(w[0].x, w[1].x, w[2].x, w[3].x, lo);  // columns col .. col + 3
    transpose4(w[0].y, w[1].y, w[2].y, w[3].y, hi);  // columns col + 4 .. col + 7
    unsigned char* dst = p.vt + plane * p.vt_plane + (long long)col * p.sk_pad + key0 + 4 * t;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        *reinterpret_cast<u32*>(dst + (long long)e * p.sk_pad) = lo[e];
        *reinterpret_cast<u32*>(dst + (long long)(e + 4) * p.sk_pad) = hi[e];
    }
}

#endif  // !FA_FWD_ENTRY && FA_WGMMA
