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
        const bool empty = !(sum > 0.f);
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
        const int heads = p.batch * p.hq;
        int m_block, bh;
        if (p.longest_first) {
            m_block = p.num_m_blocks - 1 - (int)(blockIdx.x / heads);
            bh = blockIdx.x % heads;
        } else {
            m_block = blockIdx.x % p.num_m_blocks;
            bh = blockIdx.x / p.num_m_blocks;
        }
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
#define FA_WS 0  // 1: the warp-specialised kernel below (FlashFwdWs); 0: FlashFwdFp8Sm90 (e4m3 only)
#endif

#if !FA_WS
extern "C" __global__ void __launch_bounds__(FA_WARPS * 32, 1) flash_fwd_fp8(const Fp8FwdParams p) {
    extern __shared__ __align__(128) char smem[];
    // The launcher adds 1 KiB so that the tiles can start on the swizzle's 1024-byte period.
    const u32 base = smem_addr(smem);
    FlashFwdFp8Sm90<FA_D, FA_BC, FA_WARPS>::run(p, smem + (((base + 1023u) & ~1023u) - base));
}
#else
// ---------------------------------------------------------------- warp-specialised forward
// FlashAttention-3's structure (§3.1): a producer warpgroup moves tiles with TMA
// (cp.async.bulk.tensor, 128-byte swizzle: the layout wgmma reads) into rings of K and V buffers
// with "full" and "empty" mbarriers; it gives up registers (setmaxnreg) to the two consumer
// warpgroups, which run the overlapped loop of FlashFwdSm90 without a block-wide barrier per tile,
// and take turns issuing their products (named barriers: ping-pong), so that one's softmax runs
// under the other's MMAs. For e4m3 inputs (the FP8 forward) and for bf16/f16 (FA_E4M3 = 0).

// A CUtensorMap (the driver's opaque 128-byte TMA descriptor, built on the host per call).
struct alignas(128) TmaDesc {
    u64 x[16];
};

// Field for field `Fp8WsParams` in src/cuda/launch.rs.
struct alignas(128) Fp8WsParams {
    TmaDesc q;  // [b][sq][hq][d]: boxes of 128 bytes x BR rows
    TmaDesc k;  // [b][sk][hk][d]: boxes of 128 bytes x BC rows
    TmaDesc v;  // e4m3: the Vᵀ planes [planes][FA_D][sk_pad], boxes of BC keys x FA_D rows;
                // 16-bit: V [b][sk][hk][d], boxes of 128 bytes x BC rows
    Fp8FwdParams f;
};

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// A TMA tile load into shared memory, completing `bytes` on `bar`.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaDesc* desc, int c0, int c1, int c2, int c3, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5}], [%6];\n" ::"r"(dst),
        "l"(desc), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_load_3d(u32 dst, const TmaDesc* desc, int c0, int c1, int c2, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"(desc), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
// Barrier `id` (1-15) over `threads` threads: wait for all, or arrive without waiting.
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The products of the warp-specialised kernel, by input type: e4m3 (FlashFwdFp8Sm90's: V read
// transposed from the Vᵀ planes, P as 8-bit A operands of 32 keys) or 16-bit (FlashFwdSm90's: V
// read as stored, transposed by the instruction, P as A operands of 16 keys).
template <int D, int BC, bool E4M3, bool BF16>
struct WsProducts;
template <int D, int BC, bool BF16>
struct WsProducts<D, BC, true, BF16> {
    using M = FlashFwdFp8Sm90<D, BC, 8>;
    static constexpr int PA = BC / 32;
    static __device__ __forceinline__ void issue_scores(FragC (&s)[1][BC / 8], u32 sQw, u32 sK) {
        M::issue_scores(s, sQw, sK);
    }
    static __device__ __forceinline__ void issue_pv(FragC (&o)[1][D / 8], FragA (&pa)[PA], u32 sV) {
        M::issue_pv(o, pa, sV);
    }
    static __device__ __forceinline__ void pv_done(FragC (&o)[1][D / 8], FragA (&pa)[PA]) { M::pv_done(o, pa); }
    static __device__ __forceinline__ void pack_p(FragA (&pa)[PA], const FragC (&s)[1][BC / 8]) { M::pack_p(pa, s); }
};
template <int D, int BC, bool BF16>
struct WsProducts<D, BC, false, BF16> {
    using M = FlashFwdSm90<D, BC, 8, BF16>;
    static constexpr int PA = BC / 16;
    static __device__ __forceinline__ void issue_scores(FragC (&s)[1][BC / 8], u32 sQw, u32 sK) {
        M::issue_scores(s, sQw, sK);
    }
    static __device__ __forceinline__ void issue_pv(FragC (&o)[1][D / 8], FragA (&pa)[PA], u32 sV) {
        M::issue_pv(o, pa, sV);
    }
    static __device__ __forceinline__ void pv_done(FragC (&o)[1][D / 8], FragA (&pa)[PA]) { M::pv_done(o, pa); }
    static __device__ __forceinline__ void pack_p(FragA (&pa)[PA], const FragC (&s)[1][BC / 8]) {
#pragma unroll
        for (int x = 0; x < PA; ++x) pa[x] = scores_to_a<BF16>(s[0][2 * x], s[0][2 * x + 1]);
    }
};

// The warp-specialised forward (FA_WS), for e4m3 inputs (E4M3; the Vᵀ planes of
// fp8_transpose_v) or bf16/f16 ones (V as stored). A producer warpgroup moves tiles with TMA into
// two rings, K and V, of STAGES buffers each, every buffer with a "full" mbarrier (the TMA's bytes
// landed) and an "empty" one (all eight consumer warps are done with it): K of tile j is freed as
// soon as S_j completed, V of tile j after P_j·V_j, a tile later. Its column blocks are 128 bytes
// wide (64 16-bit or 128 8-bit columns), the 128-byte swizzle the products read.
template <int D, int BC, bool E4M3, bool BF16>
struct FlashFwdWs {
    static_assert(FA_WARPS == 8 && FA_MT == 1, "two consumer warpgroups of 64 rows (the launchers check it)");
    using Mma = WsProducts<D, BC, E4M3, BF16>;
    using Base = FlashFwd<D, 1, BC, 8, true>;  // the masks
    static constexpr int ESIZE = E4M3 ? 1 : 2;  // bytes an element
    static constexpr int BR = 128;              // two consumer warpgroups of 64 rows
    static constexpr int CONSUMERS = 256;
    static constexpr int THREADS = 384;  // + the producer warpgroup
    static constexpr int NT = BC / 8;
    static constexpr int DT = D / 8;
    static constexpr int PA = Mma::PA;
    static constexpr int ROW_BLOCKS = D * ESIZE / 128;  // 128-byte column blocks of a row
    static constexpr int BLOCK_COLS = 128 / ESIZE;      // elements a column block holds
    static_assert(D * ESIZE % 128 == 0, "rows of whole 128-byte blocks");
    static_assert(BC == 128 || !E4M3, "a Vᵀ tile row is one 128-byte swizzle row: 128 keys");
    static constexpr int Q_BYTES = BR * D * ESIZE;
    static constexpr int K_BYTES = BC * D * ESIZE;
    static constexpr int V_BYTES = BC * D * ESIZE;
    static constexpr int STAGES = K_BYTES <= 16384 ? 4 : 2;  // per ring
    // Two Q buffers, the K ring, the V ring, then the mbarriers (8 bytes each: Q full and empty,
    // two each; K full and empty, V full and empty, STAGES each).
    static constexpr int K_RING = 2 * Q_BYTES, V_RING = K_RING + STAGES * K_BYTES;
    static constexpr int BAR_OFFSET = V_RING + STAGES * V_BYTES;
    static constexpr int SMEM_BYTES = BAR_OFFSET + 8 * (4 + 4 * STAGES);
    static_assert(SMEM_BYTES + 1024 <= 232448, "shared memory of one block a multiprocessor");
    // S of the next tile and P·V of the previous one in flight together needs the score,
    // probability and output registers at once: at D = 256 the output alone takes 128.
    static constexpr bool OVERLAP = D <= 128;
    // Named barriers 1 and 2 pass the turn to issue products between the consumer warpgroups.
    static constexpr int BAR_TURN = 1;

    // One work item: a block of BR query rows of one (sequence, head) and its key tiles.
    struct Item {
        int b, h, hk, row0, rows_valid, n_end, tiles;
    };
    static __device__ __forceinline__ Item item_at(const FwdParams& p, const Visibility& vis0, int i) {
        const int heads = p.batch * p.hq;
        int m_block, bh;
        if (p.longest_first) {
            // Later query blocks see more keys under a causal rule: all heads' longest first, so
            // the grid's last items are short.
            m_block = p.num_m_blocks - 1 - i / heads;
            bh = i % heads;
        } else {
            m_block = i % p.num_m_blocks;  // consecutive items share a head: its K and V stay in L2
            bh = i / p.num_m_blocks;
        }
        Item it;
        it.b = bh / p.hq;
        it.h = bh % p.hq;
        it.hk = it.h / p.group;
        it.row0 = m_block * BR;
        it.rows_valid = max(min(BR, p.sq - it.row0), 0);
        int key_lo = 0, key_hi = 0;
        if (it.rows_valid > 0) vis0.key_range(it.row0, it.row0 + it.rows_valid, key_lo, key_hi);
        const int n_begin = key_lo / BC;
        it.n_end = (key_hi + BC - 1) / BC;
        it.tiles = max(it.n_end - n_begin, 0);
        return it;
    }

    // A persistent grid (one block a multiprocessor) walks the items blockIdx.x, + gridDim.x, ...:
    // the producer loads the next item's Q (two Q buffers, each with a "full" and an "empty"
    // mbarrier) and first tiles while the consumers finish the current one.
    static __device__ __forceinline__ void run(const Fp8WsParams& pp, char* smem) {
        const FwdParams& p = pp.f.base;
        const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
        const int items = p.num_m_blocks * p.batch * p.hq;
        const Visibility vis{p.sq, p.sk, p.sk - p.sq, p.causal, p.window_left, p.window_right};

        const u32 sQ = smem_addr(smem), sK = sQ + K_RING, sV = sQ + V_RING;
        const u32 bar_q_full = sQ + BAR_OFFSET, bar_q_empty = bar_q_full + 16;
        const u32 bar_k_full = bar_q_empty + 16, bar_k_empty = bar_k_full + 8 * STAGES;
        const u32 bar_v_full = bar_k_empty + 8 * STAGES, bar_v_empty = bar_v_full + 8 * STAGES;
        if (tid == 0) {
            for (int qb = 0; qb < 2; ++qb) {
                mbar_init(bar_q_full + 8 * qb, 1);
                mbar_init(bar_q_empty + 8 * qb, CONSUMERS / 32);
            }
            for (int st = 0; st < STAGES; ++st) {
                mbar_init(bar_k_full + 8 * st, 1);
                mbar_init(bar_k_empty + 8 * st, CONSUMERS / 32);  // one arrival per consumer warp
                mbar_init(bar_v_full + 8 * st, 1);
                mbar_init(bar_v_empty + 8 * st, CONSUMERS / 32);
            }
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();

        if (warp >= CONSUMERS / 32) {
            // The producer warpgroup: one thread issues every copy, the rest leave.
            asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
            if (tid == CONSUMERS) {
                int it = 0, qi = 0;  // tiles and items so far: ring and Q-buffer phases
                for (int i = blockIdx.x; i < items; i += gridDim.x, ++qi) {
                    const Item w = item_at(p, vis, i);
                    const int qb = qi & 1;
                    if (qi >= 2) mbar_wait(bar_q_empty + 8 * qb, (u32)((qi / 2 - 1) & 1));
                    const u32 q_full = bar_q_full + 8 * qb, sQb = sQ + (u32)(qb * Q_BYTES);
                    mbar_expect_tx(q_full, Q_BYTES);
#pragma unroll
                    for (int c = 0; c < ROW_BLOCKS; ++c)
                        tma_load_4d(sQb + (u32)(c * BR * 128), &pp.q, BLOCK_COLS * c, w.row0, w.h, w.b, q_full);
                    const int plane = w.b * (p.hq / p.group) + w.hk;
                    for (int j = 0; j < w.tiles; ++j, ++it) {
                        const int st = it % STAGES, n = w.n_end - 1 - j;
                        const u32 round = (u32)((it / STAGES - 1) & 1);
                        const u32 k_full = bar_k_full + 8 * st, v_full = bar_v_full + 8 * st;
                        const u32 sKs = sK + (u32)(st * K_BYTES), sVs = sV + (u32)(st * V_BYTES);
                        if (it >= STAGES) mbar_wait(bar_k_empty + 8 * st, round);
                        mbar_expect_tx(k_full, K_BYTES);
#pragma unroll
                        for (int c = 0; c < ROW_BLOCKS; ++c)
                            tma_load_4d(sKs + (u32)(c * BC * 128), &pp.k, BLOCK_COLS * c, n * BC, w.hk, w.b, k_full);
                        if (it >= STAGES) mbar_wait(bar_v_empty + 8 * st, round);
                        mbar_expect_tx(v_full, V_BYTES);
                        if constexpr (E4M3) {
                            tma_load_3d(sVs, &pp.v, n * BC, 0, plane, v_full);
                        } else {
#pragma unroll
                            for (int c = 0; c < ROW_BLOCKS; ++c)
                                tma_load_4d(sVs + (u32)(c * BC * 128), &pp.v, BLOCK_COLS * c, n * BC, w.hk, w.b,
                                            v_full);
                        }
                    }
                }
            }
            return;
        }
        asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");

        // Consumers: warpgroup wg owns rows 64·wg .. 64·wg + 63 of each item.
        const int wg = warp / 4, warp_row = warp * 16;
        const float scale_log2 = p.scale_log2;
        // Turns: warpgroup 0 issues first; each passes the turn after issuing its products.
        const int my_turn = BAR_TURN + wg, their_turn = BAR_TURN + (1 - wg);
        if (wg == 1) named_arrive(BAR_TURN, CONSUMERS);
        auto k_at = [&](int it) { return sK + (u32)((it % STAGES) * K_BYTES); };
        auto v_at = [&](int it) { return sV + (u32)((it % STAGES) * V_BYTES); };
        auto wait_k = [&](int it) { mbar_wait(bar_k_full + 8 * (it % STAGES), (u32)((it / STAGES) & 1)); };
        auto wait_v = [&](int it) { mbar_wait(bar_v_full + 8 * (it % STAGES), (u32)((it / STAGES) & 1)); };
        auto free_k = [&](int it) {
            __syncwarp();
            if (lane == 0) mbar_arrive(bar_k_empty + 8 * (it % STAGES));
        };
        auto free_v = [&](int it) {
            __syncwarp();
            if (lane == 0) mbar_arrive(bar_v_empty + 8 * (it % STAGES));
        };

        int it = 0, qi = 0;
        for (int i = blockIdx.x; i < items; i += gridDim.x, ++qi) {
            const int qb = qi & 1;
            const u32 sQb = sQ + (u32)(qb * Q_BYTES), sQw = sQb + (u32)(wg * 64 * 128);
            FragC o[1][DT];
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[0][dt].x[e] = 0.f;
            float row_max[2] = {-FA_INF, -FA_INF}, row_sum[2] = {0.f, 0.f};
            int tiles, n_end, row0, rows_valid;
            {
                const Item w = item_at(p, vis, i);
                tiles = w.tiles;
                n_end = w.n_end;
                row0 = w.row0;
                rows_valid = w.rows_valid;
            }
            auto probabilities = [&](FragC (&s)[1][NT], int col0, float (&correction)[2]) {
                if (!vis.tile_full(row0, row0 + rows_valid, col0, col0 + BC))
                    Base::apply_mask(s, vis, nullptr, p.block, row0 + warp_row, col0, lane);
                ws_softmax_tile(s, row_max, row_sum, scale_log2, correction);
            };
            mbar_wait(bar_q_full + 8 * qb, (u32)((qi / 2) & 1));

            if (tiles > 0 && !OVERLAP) {
                // S, then P·V, one after the other (S issued in this warpgroup's turn).
                FragA pa[PA];
                for (int j = 0; j < tiles; ++j, ++it) {
                    wait_k(it);
                    FragC s[1][NT];
                    named_sync(my_turn, CONSUMERS);
                    Mma::issue_scores(s, sQw, k_at(it));
                    named_arrive(their_turn, CONSUMERS);
                    wgmma_wait<0>();
                    fence_operands(s[0]);
                    free_k(it);
                    float correction[2];
                    probabilities(s, (n_end - 1 - j) * BC, correction);
                    float corr[1][2] = {{correction[0], correction[1]}};
                    OnlineSoftmax<1>::rescale(o, corr);
                    Mma::pack_p(pa, s);
                    wait_v(it);
                    Mma::issue_pv(o, pa, v_at(it));
                    wgmma_wait<0>();
                    Mma::pv_done(o, pa);
                    free_v(it);
                }
                // One more turn, as the overlapped loop takes (its last P·V): every item takes
                // tiles + 1 turns in both loops.
                named_sync(my_turn, CONSUMERS);
                named_arrive(their_turn, CONSUMERS);
            } else if (tiles > 0) {
                FragA pa[PA];
                {
                    wait_k(it);
                    FragC s[1][NT];
                    named_sync(my_turn, CONSUMERS);
                    Mma::issue_scores(s, sQw, k_at(it));
                    named_arrive(their_turn, CONSUMERS);
                    wgmma_wait<0>();
                    fence_operands(s[0]);
                    free_k(it);
                    float correction[2];
                    probabilities(s, (n_end - 1) * BC, correction);
                    Mma::pack_p(pa, s);
                    ++it;
                }
                for (int j = 1; j < tiles; ++j, ++it) {
                    wait_k(it);
                    wait_v(it - 1);
                    FragC s[1][NT];
                    named_sync(my_turn, CONSUMERS);
                    Mma::issue_scores(s, sQw, k_at(it));
                    Mma::issue_pv(o, pa, v_at(it - 1));
                    named_arrive(their_turn, CONSUMERS);
                    wgmma_wait<1>();
                    fence_operands(s[0]);
                    free_k(it);
                    float correction[2];
                    probabilities(s, (n_end - 1 - j) * BC, correction);
                    wgmma_wait<0>();
                    Mma::pv_done(o, pa);
                    free_v(it - 1);
                    float corr[1][2] = {{correction[0], correction[1]}};
                    OnlineSoftmax<1>::rescale(o, corr);
                    Mma::pack_p(pa, s);
                }
                wait_v(it - 1);
                named_sync(my_turn, CONSUMERS);
                Mma::issue_pv(o, pa, v_at(it - 1));
                named_arrive(their_turn, CONSUMERS);
                wgmma_wait<0>();
                Mma::pv_done(o, pa);
                free_v(it - 1);
            }

            // Normalise (v_descale with 1 / rowsum); each warp then writes its own 16 rows through
            // its own 16 rows of this item's Q buffer (2 KiB a column block, free once its
            // warpgroup's products completed), 64 columns at a time: no other warp reads or writes
            // them, so no block-wide barrier; then the buffer goes back to the producer.
            float lse[2];
            ws_finish(o, row_max, row_sum, scale_log2, pp.f.v_descale, lse);
            // The item's place, recomputed rather than kept live through the loop (at D = 256 the
            // registers are all taken by then).
            const Item w = item_at(p, vis, (int)opaque((u32)i));
            const int g = lane >> 2, t = lane & 3;
            u16* gO = p.o + w.b * p.o_batch + (long long)(w.row0 + warp_row) * p.o_row + w.h * p.o_head;
            float* gL = p.lse + w.b * p.lse_batch + w.h * p.lse_head + w.row0 + warp_row;
            const int rows_here = w.rows_valid - warp_row;  // rows of this warp inside the sequence
#pragma unroll
            for (int r = 0; r < 2; ++r)
                if (t == 0 && g + 8 * r < rows_here) gL[g + 8 * r] = lse[r];
#pragma unroll
            for (int pass = 0; pass < D / 64; ++pass) {
                const u32 sW = sQb + (u32)((pass % ROW_BLOCKS) * BR * 128 + warp_row * 128);  // 16 rows
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = g + 8 * r;
#pragma unroll
                    for (int c = 0; c < 8; ++c) {
                        const int dt = 8 * pass + c;
                        const u32 v = pack2<BF16 || E4M3>(o[0][dt].x[2 * r], o[0][dt].x[2 * r + 1]);
                        const u32 addr = sW + (u32)(row * 128 + ((c ^ (row & 7)) * 16) + 4 * t);
                        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
                    }
                }
                __syncwarp();
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const int c = 32 * k + lane, row = c / 8, ch = c % 8;
                    if (row < rows_here && 8 * (8 * pass + ch) < p.d) {
                        uint4 v;
                        const u32 addr = sW + (u32)(row * 128 + ((ch ^ (row & 7)) * 16));
                        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                                     : "r"(addr)
                                     : "memory");
                        *reinterpret_cast<uint4*>(gO + row * p.o_row + (8 * pass + ch) * 8) = v;
                    }
                }
                __syncwarp();
            }
            // The buffer was last written through the generic proxy (st.shared above); the
            // producer's next TMA into it writes through the async proxy: order the two.
            fence_proxy_async();
            __syncwarp();
            if (lane == 0) mbar_arrive(bar_q_empty + 8 * qb);
        }
        // The turn warpgroup 1 passed last is never taken: absorb it (warpgroup 1 started one
        // turn ahead).
        if (wg == 0) named_sync(my_turn, CONSUMERS);
    }
};

extern "C" __global__ void __launch_bounds__(384, 1) flash_fwd_ws(const __grid_constant__ Fp8WsParams p) {
    extern __shared__ __align__(128) char smem[];
    const u32 base = smem_addr(smem);
    FlashFwdWs<FA_D, FA_BC, FA_E4M3 != 0, FA_BF16 != 0>::run(p, smem + (((base + 1023u) & ~1023u) - base));
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
