// FlashAttention-2 forward for sm_80+ (mma.sync m16n8k16, f32 accumulation).
//
// One thread block computes BR = WARPS · 16 · MT query rows of one (sequence, head); each warp
// owns 16 · MT rows, so the warps never exchange softmax state (FlashAttention-2 §3.2: split Q
// across warps, share K and V). Key/value tiles of BC keys stream through shared memory with
// cp.async, K of the next tile loading while this tile's softmax and P·V run, V of this tile
// loading while Q·Kᵀ runs.
//
// Compile-time parameters (NVRTC -D options): FA_D (tile width: the head dim of q, k and v, or
// the next of 64, 128, 256 above it; the columns past the runtime `d` load as zeros and are
// never stored, so they change no score and no output), FA_MT (16-row
// tiles per warp), FA_BC (keys per tile), FA_WARPS, FA_BF16 (1: bf16, 0: fp16), FA_EXTRAS (the
// dropout, score-modifier and block-mask paths compiled in, a set of bits: below), FA_WGMMA (1: the sm_90a kernel,
// FlashFwdSm90, below).

#ifndef FA_D
#define FA_D 128
#endif
#ifndef FA_MT
#define FA_MT 2
#endif
#ifndef FA_BC
#define FA_BC 64
#endif
#ifndef FA_WARPS
#define FA_WARPS 4
#endif
#ifndef FA_EXTRAS
#define FA_EXTRAS 0  // the optional paths compiled in, a set (variants `..._x<letters>`): see below
#endif
// FA_EXTRAS's bits: 1 dropout (`d`), 2 softcap (`s`), 4 block-sparse masks (`b`), 8 ALiBi (`a`).
// A variant holds only what its problem uses, so that one feature's registers and instructions
// are not paid by a problem that uses another.
#define FA_DROPOUT ((FA_EXTRAS & 1) != 0)
#define FA_SOFTCAP ((FA_EXTRAS & 2) != 0)
#define FA_BLOCKS ((FA_EXTRAS & 4) != 0)
#define FA_ALIBI ((FA_EXTRAS & 8) != 0)
#define FA_MODS (FA_SOFTCAP || FA_ALIBI)  // a score modifier
#ifndef FA_BF16
#define FA_BF16 1
#endif
#ifndef FA_WGMMA
#define FA_WGMMA 0  // 1: the sm_90a warpgroup-MMA kernel (FlashFwdSm90)
#endif

// The launch parameters; mirrored field for field by `FwdParams` in src/cuda/launch.rs.
struct FwdParams {
    const u16* q;
    const u16* k;
    const u16* v;
    u16* o;
    float* lse;
    const int* cu_seqlens_q;  // null for fixed-length batches
    const int* cu_seqlens_k;
    // Strides in elements: batch (0 for varlen), token, head.
    long long q_batch, q_row, q_head;
    long long k_batch, k_row, k_head;
    long long v_batch, v_row, v_head;
    long long o_batch, o_row, o_head;
    long long lse_batch, lse_head;  // lse[b, h, i] at b·lse_batch + h·lse_head + q_start + i
    int batch, hq, group;           // group = hq / hk (GQA)
    int d;                          // head dim of q, k, v (a multiple of 8, <= FA_D)
    int sq, sk;                     // fixed-length sizes (varlen: from cu_seqlens)
    int num_m_blocks;               // ceil(longest sq / BR)
    int causal, window_left, window_right;
    float scale_log2;               // softmax scale · log2(e)
    int longest_first;              // 0: head-major; n > 0: causal, chunks of n heads (fwd_item)
    DropoutParams dropout;
    ScoreMod mod;
    BlockMask block;
};

// The query block and (sequence, head) of work item i of the warp-specialised and FP8 kernels
// (the others take longest_first as a flag, all heads at once). Without a causal rule
// (longest_first = 0) the order is head-major: consecutive items share a head, whose K and V
// stay in L2. Under one, later query blocks see more keys: the heads go in chunks of
// longest_first (as many as the host counted K and V bytes to fit L2 together), and within a
// chunk the query blocks that see the most keys come first, across the chunk's heads, so that a
// launch ends on short items and its working set stays in L2 (all heads at once would stream
// each key tile from memory once per query block).
__device__ __forceinline__ void fwd_item(const FwdParams& p, int i, int& m_block, int& bh) {
    if (p.longest_first > 0) {
        const int heads = p.batch * p.hq;
        const int per_chunk = p.longest_first * p.num_m_blocks;
        const int chunk = i / per_chunk, r = i - chunk * per_chunk;
        const int h0 = chunk * p.longest_first;
        const int n = min(p.longest_first, heads - h0);  // the last chunk may be short
        m_block = p.num_m_blocks - 1 - r / n;
        bh = h0 + r % n;
    } else {
        m_block = i % p.num_m_blocks;
        bh = i / p.num_m_blocks;
    }
}

template <int D, int MT, int BC, int WARPS, bool BF16>
struct FlashFwd {
    static constexpr int BR = WARPS * 16 * MT;  // query rows per block
    static constexpr int THREADS = WARPS * 32;
    static constexpr int NT = BC / 8;           // n-tiles of the score tile
    static constexpr int DT = D / 8;            // n-tiles of the output tile
    static constexpr int Q_BYTES = BR * D * 2;
    static constexpr int KV_BYTES = BC * D * 2;
    static constexpr int SMEM_BYTES = Q_BYTES + 2 * KV_BYTES;

    // S = Q Kᵀ for this warp's rows, already in exp2 units: s · scale · log2(e).
    static __device__ __forceinline__ void scores(FragC (&s)[MT][NT], u32 sQ, u32 sK, int warp_row, int lane,
                                                  float scale_log2) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt].x[e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            FragA qa[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) qa[mt] = load_a<D>(sQ, warp_row + 16 * mt, kk, lane);
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                FragB b0, b1;
                load_b_pair<D>(sK, 16 * np, kk, lane, b0, b1);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma<BF16>(s[mt][2 * np], qa[mt], b0);
                    mma<BF16>(s[mt][2 * np + 1], qa[mt], b1);
                }
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt].x[e] *= scale_log2;
    }

    // Softcap and ALiBi on scores that arrive as the raw q·k, leaving them in exp2 units like
    // `scores` does without modifiers.
    static __device__ __forceinline__ void apply_mod(FragC (&s)[MT][NT], const ScoreMod& mod, float slope, int off,
                                                     int row0, int col0, int lane) {
        if (FA_SOFTCAP && (!FA_ALIBI || mod.alibi == nullptr) && mod.softcap > 0.f) {
            // Softcap alone (the common case): the branches out of the element loop.
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][nt].x[e] = mod.softcap_log2(s[mt][nt].x[e]);
            return;
        }
        int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = row0 + 16 * mt + g + 8 * r;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int j = col0 + 8 * nt + 2 * t + c;
                        float& x = s[mt][nt].x[2 * r + c];
                        x = mod.apply_log2<FA_SOFTCAP, FA_ALIBI>(x, slope, i + off - j);
                    }
            }
    }

    // Hides invisible (query, key) pairs of a Partial tile: s = -inf. `plane`: the block mask's
    // plane of this (sequence, head), or null; rows past the sequence end are hidden with it (their
    // mask row does not exist, and their output is never stored).
    // A block mask whose blocks hold whole 16-row and 8-key groups (`BlockMask::aligned`: every
    // power of two from 16 x 8 up, for one) is read one byte an n-tile and 16 rows, with the
    // block index counted along the tile; others element by element.
    static __device__ __forceinline__ void apply_mask(FragC (&s)[MT][NT], const Visibility& vis,
                                                      const unsigned char* plane, const BlockMask& bm, int row0,
                                                      int col0, int lane) {
        int g = lane >> 2, t = lane & 3;
        if (FA_BLOCKS && plane && bm.aligned(16, 8)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                // Rows row0 + 16·mt .. + 15 share one mask row (the group starts inside the
                // sequence whenever any of its rows does; rows past the end are hidden below).
                // Bit nt of `on`: the block of keys col0 + 8·nt .. + 7 (keys past the end read no
                // byte: the span hides them).
                const int r16 = row0 + 16 * mt;
                const unsigned char* kb = plane + (long long)(min(r16, vis.sq - 1) / bm.bq) * bm.s_i;
                u32 on = 0;
                {
                    BlockMask::Walk w(col0, 8, bm.bk);
                    kb += (long long)w.block * bm.s_j;
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        if (col0 + 8 * nt < vis.sk && *kb != 0) on |= 1u << nt;
                        if (w.next()) kb += bm.s_j;
                    }
                }
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int i = r16 + g + 8 * r;
                    int lo, hi;
                    vis.span(i, lo, hi);
                    if (i >= vis.sq) hi = lo;  // a row past the end: nothing visible
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int c = 0; c < 2; ++c) {
                            const int j = col0 + 8 * nt + 2 * t + c;
                            if (!((on >> nt) & 1u) || j < lo || j >= hi) s[mt][nt].x[2 * r + c] = -FA_INF;
                        }
                }
            }
            return;
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = row0 + 16 * mt + g + 8 * r;
                int lo, hi;
                vis.span(i, lo, hi);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        int j = col0 + 8 * nt + 2 * t + c;
                        bool hidden = j < lo || j >= hi;
                        if (FA_BLOCKS && plane && !hidden) hidden = i >= vis.sq || !bm.visible(plane, i, j);
                        if (hidden) s[mt][nt].x[2 * r + c] = -FA_INF;
                    }
            }
    }

    // Dropout on the probabilities of keys col0 .. col0 + 31 of the tile (col0 a multiple of 32;
    // rows g and g + 8 of the 16 from `row0`) packed as two A operands of P·V (`pa[0]`: keys
    // col0 .. col0 + 15, `pa[1]`: the next 16): P ∘ keep, after the row sums took the undropped
    // P; the factor 1 / (1 - p) is applied to O in `finish`. The 32 keys are one Philox call's 16
    // bytes for this thread (philox.cuh): one call per 16 elements, a few integer operations per four.
    static __device__ __forceinline__ void drop_block(FragA* pa, const DropoutParams& dp, u32 bh, int row0, int col0,
                                                      int lane) {
        const u32 g = (u32)lane >> 2, t = (u32)lane & 3u;
        const u32 c1 = 8u * ((u32)row0 >> 4) + g, k_add = (0x8000u - dp.threshold) * 0x10001u;
        const Philox4 w = dropout_call(dp, bh, 4u * ((u32)col0 >> 5) + t, c1);
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                // Word 2r + m: row g + 8r, keys 16m + {2t, 2t + 1} (pair 0: the low n-tile of
                // pa[m]) and 16m + 8 + {2t, 2t + 1} (pair 1: its high n-tile).
                u32 m0, m1;
                dropout_pair_masks(w.x[2 * r + m], k_add, m0, m1);
                pa[m].x[r] &= m0;
                pa[m].x[2 + r] &= m1;
            }
    }

    // O += P V for this warp's rows; P comes straight from the score registers, 32 keys at a
    // time, with dropout (`drop`: the keep mask of stream bh, tile rows from row0, keys from col0)
    // applied to the packed probabilities.
    static __device__ __forceinline__ void accumulate_pv(FragC (&o)[MT][DT], const FragC (&p)[MT][NT], u32 sV,
                                                         int lane, bool drop, const DropoutParams& dropout, u32 bh,
                                                         int row0, int col0) {
        static_assert(BC % 32 == 0, "whole 32-key blocks");
#pragma unroll
        for (int kb = 0; kb < BC / 32; ++kb) {
            FragA pa[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int x = 0; x < 2; ++x) pa[mt][x] = scores_to_a<BF16>(p[mt][4 * kb + 2 * x], p[mt][4 * kb + 2 * x + 1]);
                if (FA_DROPOUT && drop) drop_block(pa[mt], dropout, bh, row0 + 16 * mt, col0 + 32 * kb, lane);
            }
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const int kk = 2 * kb + x;
#pragma unroll
                for (int dp = 0; dp < D / 16; ++dp) {
                    FragB b0, b1;
                    load_b_pair_trans<D>(sV, 16 * kk, dp, lane, b0, b1);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma<BF16>(o[mt][2 * dp], pa[mt][x], b0);
                        mma<BF16>(o[mt][2 * dp + 1], pa[mt][x], b1);
                    }
                }
            }
        }
    }

    // Writes this warp's normalised output rows to shared memory (swizzled, in the dtype, rows of
    // W elements: D, or the Hopper kernel's D rounded up to whole 64-column blocks), then the whole
    // block copies the tile out with 16-byte stores; and the lse of each row.
    template <int W = D>
    static __device__ __forceinline__ void store(const FragC (&o)[MT][DT], const float (&lse)[MT][2], u32 sO,
                                                 u16* gO, long long o_row, float* gL, int rows_valid,
                                                 int cols_valid, int warp_row, int lane, int tid) {
        int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                int row = warp_row + 16 * mt + g + 8 * r;
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    u32 w = pack2<BF16>(o[mt][dt].x[2 * r], o[mt][dt].x[2 * r + 1]);
                    u32 addr = sO + swizzled_offset<W>(row, dt) + 4 * t;
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(w));
                }
                if (t == 0 && row < rows_valid) gL[row] = lse[mt][r];
            }
        __syncthreads();
        constexpr int CHUNKS = BR * D / 8;
        static_assert(CHUNKS % THREADS == 0, "the copy-out covers every chunk");
#pragma unroll
        for (int it = 0; it < CHUNKS / THREADS; ++it) {
            int c = it * THREADS + tid;
            int row = c / (D / 8), ch = c % (D / 8);
            if (row < rows_valid && 8 * ch < cols_valid) {
                uint4 w;
                u32 addr = sO + swizzled_offset<W>(row, ch);
                asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                             : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                             : "r"(addr));
                *reinterpret_cast<uint4*>(gO + row * o_row + ch * 8) = w;
            }
        }
    }

    static __device__ __forceinline__ void run(const FwdParams& p, char* smem) {
        const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
        const int heads = p.batch * p.hq;
        int m_block, bh;
        if (p.longest_first) {
            // Later query tiles see more keys under a causal rule: start them first, across all
            // heads, so the tail of the launch is short tiles (the launchers pass longest_first =
            // all heads for this kernel: `fwd_item`'s chunked order, measured on the
            // warp-specialised kernel, made this one spill).
            m_block = p.num_m_blocks - 1 - (int)(blockIdx.x / heads);
            bh = blockIdx.x % heads;
        } else {
            // Consecutive blocks share a head: its K and V stay in L2.
            m_block = blockIdx.x % p.num_m_blocks;
            bh = blockIdx.x / p.num_m_blocks;
        }
        const int b = bh / p.hq, h = bh % p.hq, hk = h / p.group;

        int q_start = 0, k_start = 0, sq = p.sq, sk = p.sk;
        if (p.cu_seqlens_q) {
            q_start = p.cu_seqlens_q[b];
            sq = p.cu_seqlens_q[b + 1] - q_start;
            k_start = p.cu_seqlens_k[b];
            sk = p.cu_seqlens_k[b + 1] - k_start;
        }
        const int row0 = m_block * BR;
        if (row0 >= sq) return;
        const int rows_valid = min(BR, sq - row0);
        const Visibility vis{sq, sk, sk - sq, p.causal, p.window_left, p.window_right};
        const bool modded = FA_MODS && p.mod.active();
        const float slope = p.mod.slope(b, h, p.hq);

        const u16* gQ = p.q + b * p.q_batch + (long long)(q_start + row0) * p.q_row + h * p.q_head;
        const u16* gK = p.k + b * p.k_batch + (long long)k_start * p.k_row + hk * p.k_head;
        const u16* gV = p.v + b * p.v_batch + (long long)k_start * p.v_row + hk * p.v_head;
        u16* gO = p.o + b * p.o_batch + (long long)(q_start + row0) * p.o_row + h * p.o_head;
        float* gL = p.lse + b * p.lse_batch + h * p.lse_head + q_start + row0;

        const u32 sQ = smem_addr(smem), sK = sQ + Q_BYTES, sV = sK + KV_BYTES;
        const int warp_row = warp * 16 * MT;

        FragC o[MT][DT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[mt][dt].x[e] = 0.f;
        OnlineSoftmax<MT> softmax;
        softmax.init();

        int key_lo, key_hi;
        vis.key_range(row0, row0 + rows_valid, key_lo, key_hi);
        const int n_begin = key_lo / BC, n_end = (key_hi + BC - 1) / BC;

        // With a block-sparse mask (extras variants), key tiles whose mask blocks are all off are
        // skipped and only tiles with every block on may be Full. `next_tile(n, all_on)`: the first
        // tile at or below n that the mask leaves visible (n_begin - 1: none); every thread calls it.
        const bool blocky = FA_BLOCKS && p.block.active();
        const unsigned char* plane = blocky ? p.block.plane(b, h) : nullptr;
        auto next_tile = [&](int n, bool& all_on) {
            all_on = true;
            if (blocky) {
                for (; n >= n_begin; --n) {
                    bool any;
                    p.block.classify(plane, row0, row0 + rows_valid, n * BC, min(sk, (n + 1) * BC), tid, THREADS,
                                     any, all_on);
                    if (any) break;
                }
            }
            return n;
        };

        bool all_on;
        int n = next_tile(n_end - 1, all_on);
        if (n >= n_begin) {
            load_tile_async<BR, D, THREADS>(sQ, gQ, p.q_row, rows_valid, p.d, tid);
            load_tile_async<BC, D, THREADS>(sK, gK + (long long)n * BC * p.k_row, p.k_row, sk - n * BC, p.d, tid);
            cp_async_commit();
            // Key tiles last to first: the Partial tiles of a causal mask come first, while the
            // row max is still forming (as FlashAttention-2).
            while (n >= n_begin) {
                const int col0 = n * BC;
                cp_async_wait<0>();
                __syncthreads();  // K[n] landed; every warp is done reading V of the tile before
                load_tile_async<BC, D, THREADS>(sV, gV + (long long)col0 * p.v_row, p.v_row, sk - col0, p.d, tid);
                cp_async_commit();

                FragC s[MT][NT];
                if (modded) {
                    scores(s, sQ, sK, warp_row, lane, 1.f);
                    apply_mod(s, p.mod, slope, sk - sq, row0 + warp_row, col0, lane);
                } else {
                    scores(s, sQ, sK, warp_row, lane, p.scale_log2);
                }
                if (!all_on || !vis.tile_full(row0, row0 + rows_valid, col0, col0 + BC))
                    apply_mask(s, vis, plane, p.block, row0 + warp_row, col0, lane);

                __syncthreads();  // every warp is done reading K[n]
                bool next_all_on;
                const int next = next_tile(n - 1, next_all_on);
                if (next >= n_begin) {
                    int c = next * BC;
                    load_tile_async<BC, D, THREADS>(sK, gK + (long long)c * p.k_row, p.k_row, sk - c, p.d, tid);
                }
                cp_async_commit();

                softmax.update(s, o);
                cp_async_wait<1>();
                __syncthreads();  // V[n] landed
                accumulate_pv(o, s, sV, lane, p.dropout.enabled != 0, p.dropout, (u32)(b * p.hq + h), row0 + warp_row,
                              col0);
                n = next;
                all_on = next_all_on;
            }
        }

        float lse[MT][2];
        softmax.finish(o, lse, FA_DROPOUT && p.dropout.enabled ? p.dropout.scale : 1.f);
        __syncthreads();  // the Q tile's memory is reused for the output
        store(o, lse, sQ, gO, p.o_row, gL, rows_valid, p.d, warp_row, lane, tid);
    }
};

#if FA_WGMMA
// The Hopper forward (sm_90a, FA_WGMMA = 1): the same algorithm, block order, masks, softmax and
// store as FlashFwd, with both products on warpgroup MMAs (wgmma.cuh). A block is WARPS / 4
// warpgroups of 64 query rows each (a warp keeps its 16 rows: FA_MT must be 1); Q, K and V sit
// in shared memory in the wgmma's 128-byte-swizzled layout (load_tile_async<..., true>), K and V in two
// buffers each, filled one iteration before they are read. S = Q·Kᵀ reads both operands from
// shared memory; O += P·V takes P from the registers and V transposed by the instruction. With
// OVERLAP, S of tile j and P·V of tile j - 1 are in flight together and the softmax of tile j runs
// under P·V (FlashAttention-3's intra-warpgroup pipelining).
template <int D, int BC, int WARPS, bool BF16>
struct FlashFwdSm90 {
    using Base = FlashFwd<D, 1, BC, WARPS, BF16>;
    static_assert(WARPS % 4 == 0, "whole warpgroups");
    static constexpr int BR = WARPS * 16;
    static constexpr int THREADS = WARPS * 32;
    static constexpr int NT = BC / 8;
    static constexpr int DT = D / 8;
    // Tiles are whole 64-column blocks: a 96 tile takes two (its last 32 columns of each 128-byte
    // row never written nor read), a 192 tile three.
    static constexpr int DP = (D + 63) / 64 * 64;
    static constexpr int Q_BYTES = BR * DP * 2;
    static constexpr int KV_BYTES = BC * DP * 2;
    static constexpr int SMEM_BYTES = Q_BYTES + 4 * KV_BYTES;  // Q, two K and two V buffers
    // O += P V as one wgmma per 16 keys at the power-of-two widths; at 96 and 192 as two, N_HEAD
    // columns over whole blocks and the N_TAIL after them from the next block's start, so that
    // every B descriptor starts on a block as at the other widths.
    static constexpr int N_HEAD = D == 96 ? 64 : D == 192 ? 128 : D;
    static constexpr int N_TAIL = D - N_HEAD;
    static_assert(N_HEAD % 64 == 0 || N_HEAD == D, "the first part over whole blocks");
    // S of the next tile and P·V of the previous one in flight together (and the softmax under
    // P·V) needs the score, probability and output registers at once. With optional paths that
    // spills except with one path at d = 64 and dropout or softcap alone at d = 128 (ptxas,
    // sm_90a): the other variants run the two products one after the other.
    static constexpr int PATHS = (int)FA_DROPOUT + (int)FA_SOFTCAP + (int)FA_BLOCKS + (int)FA_ALIBI;
    static constexpr bool OVERLAP =
        PATHS == 0 || (PATHS == 1 && (D < 128 || (D == 128 && (FA_DROPOUT || FA_SOFTCAP))));

    // Issues S = Q Kᵀ for this warpgroup's 64 rows (`sQw`: its first row), unscaled, as one
    // wgmma group; the registers of s are not to be touched before the group is waited for.
    static __device__ __forceinline__ void issue_scores(FragC (&s)[1][NT], u32 sQw, u32 sK) {
        fence_operands(s[0]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const u64 da = gmma_desc(sQw + (u32)((kk / 4) * BR * 128 + (kk % 4) * 32), 16, 1024);
            const u64 db = gmma_desc(sK + (u32)((kk / 4) * BC * 128 + (kk % 4) * 32), 16, 1024);
            wgmma_ss<BC>(s[0], da, db, kk > 0);
        }
        wgmma_commit();
    }

    // Issues O += P V for this warpgroup's rows as one wgmma group, P from registers (`pa`, the
    // probabilities in the A layout) and V transposed by the instruction.
    static __device__ __forceinline__ void issue_pv(FragC (&o)[1][DT], FragA (&pa)[BC / 16], u32 sV) {
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) fence_operands(pa[kk]);
        fence_operands(o[0]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            const u32 rows = sV + (u32)(kk * 16 * 128);
            wgmma_rs<N_HEAD>(*reinterpret_cast<FragC(*)[N_HEAD / 8]>(&o[0][0]), pa[kk], gmma_desc(rows, BC * 128, 1024));
            if constexpr (N_TAIL > 0)
                wgmma_rs<N_TAIL>(*reinterpret_cast<FragC(*)[N_TAIL / 8]>(&o[0][N_HEAD / 8]), pa[kk],
                                 gmma_desc(rows + (u32)(N_HEAD / 64 * BC * 128), BC * 128, 1024));
        }
        wgmma_commit();
    }

    // After the P·V group completed: its registers are free again.
    static __device__ __forceinline__ void pv_done(FragC (&o)[1][DT], FragA (&pa)[BC / 16]) {
        fence_operands(o[0]);
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) fence_operands(pa[kk]);
    }

    static __device__ __forceinline__ void run(const FwdParams& p, char* smem) {
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

        int q_start = 0, k_start = 0, sq = p.sq, sk = p.sk;
        if (p.cu_seqlens_q) {
            q_start = p.cu_seqlens_q[b];
            sq = p.cu_seqlens_q[b + 1] - q_start;
            k_start = p.cu_seqlens_k[b];
            sk = p.cu_seqlens_k[b + 1] - k_start;
        }
        const int row0 = m_block * BR;
        if (row0 >= sq) return;
        const int rows_valid = min(BR, sq - row0);
        const Visibility vis{sq, sk, sk - sq, p.causal, p.window_left, p.window_right};
        const bool modded = FA_MODS && p.mod.active();
        const float slope = p.mod.slope(b, h, p.hq);

        const u16* gQ = p.q + b * p.q_batch + (long long)(q_start + row0) * p.q_row + h * p.q_head;
        const u16* gK = p.k + b * p.k_batch + (long long)k_start * p.k_row + hk * p.k_head;
        const u16* gV = p.v + b * p.v_batch + (long long)k_start * p.v_row + hk * p.v_head;
        u16* gO = p.o + b * p.o_batch + (long long)(q_start + row0) * p.o_row + h * p.o_head;
        float* gL = p.lse + b * p.lse_batch + h * p.lse_head + q_start + row0;

        // `smem` is 1024-byte aligned (the 128-byte swizzle's period).
        const u32 sQ = smem_addr(smem), sKV = sQ + Q_BYTES;
        const int warp_row = warp * 16;
        const u32 sQw = sQ + (u32)((warp / 4) * 64 * 128);

        FragC o[1][DT];
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[0][dt].x[e] = 0.f;
        OnlineSoftmax<1> softmax;
        softmax.init();

        int key_lo, key_hi;
        vis.key_range(row0, row0 + rows_valid, key_lo, key_hi);
        const int n_begin = key_lo / BC, n_end = (key_hi + BC - 1) / BC;

        const bool blocky = FA_BLOCKS && p.block.active();
        const unsigned char* plane = blocky ? p.block.plane(b, h) : nullptr;
        auto next_tile = [&](int n, bool& all_on) {
            all_on = true;
            if (blocky) {
                for (; n >= n_begin; --n) {
                    bool any;
                    p.block.classify(plane, row0, row0 + rows_valid, n * BC, min(sk, (n + 1) * BC), tid, THREADS,
                                     any, all_on);
                    if (any) break;
                }
            }
            return n;
        };
        auto load_tile = [&](int n, u32 tile, const u16* g, long long row_stride) {
            const int c = n * BC;
            load_tile_async<BC, D, THREADS, true>(tile, g + (long long)c * row_stride, row_stride, sk - c, p.d, tid);
        };
        // K and V have two buffers each. Tile t_j's K goes to buffer j & 1 one iteration ahead
        // (S_j needs it first); its V to buffer j & 1 in iteration j itself, since P_j·V_j is
        // issued in iteration j + 1, under S_{j+1} (FlashAttention-3's intra-warpgroup overlap:
        // the softmax of tile j + 1 runs while the tensor cores do P_j·V_j).
        const u32 sK0 = sKV, sV0 = sKV + 2 * KV_BYTES;

        // Scores of tile n (columns col0..) to probabilities, in the registers they arrived in;
        // `correction` for O as OnlineSoftmax::update_p.
        auto probabilities = [&](FragC (&s)[1][NT], int col0, bool full_blocks, float (&correction)[1][2]) {
            if (modded) {
                Base::apply_mod(s, p.mod, slope, sk - sq, row0 + warp_row, col0, lane);
            } else {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[0][nt].x[e] *= p.scale_log2;
            }
            if (!full_blocks || !vis.tile_full(row0, row0 + rows_valid, col0, col0 + BC))
                Base::apply_mask(s, vis, plane, p.block, row0 + warp_row, col0, lane);
            softmax.update_p(s, correction);
        };
        // P packed for P·V, with dropout on (the tile at col0).
        // One 32-key block at a time, so that the scores die as the draws are made.
        auto pack_p = [&](FragA (&pa)[BC / 16], FragC (&s)[1][NT], int col0) {
#pragma unroll
            for (int kb = 0; kb < BC / 32; ++kb) {
#pragma unroll
                for (int x = 0; x < 2; ++x)
                    pa[2 * kb + x] = scores_to_a<BF16>(s[0][4 * kb + 2 * x], s[0][4 * kb + 2 * x + 1]);
                if (FA_DROPOUT && p.dropout.enabled)
                    Base::drop_block(pa + 2 * kb, p.dropout, (u32)(b * p.hq + h), row0 + warp_row, col0 + 32 * kb,
                                     lane);
            }
        };
        // Waits for the copies in flight, then starts the next ones; `j` counts processed tiles.
        // With OVERLAP: K of the next tile and V of this one (P_j·V_j is issued in iteration
        // j + 1); without: K and V of the next tile (as FlashFwd).
        auto advance = [&](int n, int j, int& next, bool& next_all_on) {
            cp_async_wait<0>();
            fence_proxy_async();
            __syncthreads();  // this iteration's tiles landed; every warpgroup is done with the
                              // buffers refilled now (read two iterations ago, or one for K)
            next = next_tile(n - 1, next_all_on);
            const u32 ahead = (u32)(((j + 1) & 1) * KV_BYTES);
            if (next >= n_begin) {
                load_tile(next, sK0 + ahead, gK, p.k_row);
                if (!OVERLAP) load_tile(next, sV0 + ahead, gV, p.v_row);
            }
            if (OVERLAP) load_tile(n, sV0 + (u32)((j & 1) * KV_BYTES), gV, p.v_row);
            cp_async_commit();
        };

        bool all_on;
        int n = next_tile(n_end - 1, all_on);
        if (n >= n_begin) {
            load_tile_async<BR, D, THREADS, true>(sQ, gQ, p.q_row, rows_valid, p.d, tid);
            load_tile(n, sK0, gK, p.k_row);
            if (!OVERLAP) load_tile(n, sV0, gV, p.v_row);
            cp_async_commit();
            FragA pa[BC / 16];
            // Key tiles last to first, as FlashFwd.
            if constexpr (OVERLAP) {
                // The first tile alone: no P·V to overlap yet.
                {
                    int next;
                    bool next_all_on;
                    advance(n, 0, next, next_all_on);
                    FragC s[1][NT];
                    issue_scores(s, sQw, sK0);
                    wgmma_wait<0>();
                    fence_operands(s[0]);
                    float correction[1][2];
                    probabilities(s, n * BC, all_on, correction);  // O is still 0: no rescale
                    pack_p(pa, s, n * BC);
                    n = next;
                    all_on = next_all_on;
                }
                int j = 1;
                // Then S_j and P_{j-1}·V_{j-1} in flight together; the softmax of tile j waits for
                // S_j only, O's rescale for both. Straight-line code between issue and wait, so
                // that ptxas sees which registers are in flight and keeps the wgmmas pipelined.
                while (n >= n_begin) {
                    int next;
                    bool next_all_on;
                    advance(n, j, next, next_all_on);
                    FragC s[1][NT];
                    issue_scores(s, sQw, sK0 + (u32)((j & 1) * KV_BYTES));
                    issue_pv(o, pa, sV0 + (u32)(((j - 1) & 1) * KV_BYTES));
                    wgmma_wait<1>();
                    fence_operands(s[0]);
                    float correction[1][2];
                    probabilities(s, n * BC, all_on, correction);
                    wgmma_wait<0>();
                    pv_done(o, pa);
                    OnlineSoftmax<1>::rescale(o, correction);
                    pack_p(pa, s, n * BC);
                    n = next;
                    all_on = next_all_on;
                    ++j;
                }
                // The last tile's P·V.
                cp_async_wait<0>();
                fence_proxy_async();
                __syncthreads();
                issue_pv(o, pa, sV0 + (u32)(((j - 1) & 1) * KV_BYTES));
                wgmma_wait<0>();
                pv_done(o, pa);
            } else {
                for (int j = 0; n >= n_begin; ++j) {
                    int next;
                    bool next_all_on;
                    advance(n, j, next, next_all_on);
                    FragC s[1][NT];
                    issue_scores(s, sQw, sK0 + (u32)((j & 1) * KV_BYTES));
                    wgmma_wait<0>();
                    fence_operands(s[0]);
                    float correction[1][2];
                    probabilities(s, n * BC, all_on, correction);
                    OnlineSoftmax<1>::rescale(o, correction);
                    pack_p(pa, s, n * BC);
                    issue_pv(o, pa, sV0 + (u32)((j & 1) * KV_BYTES));
                    wgmma_wait<0>();
                    pv_done(o, pa);
                    n = next;
                    all_on = next_all_on;
                }
            }
        }

        float lse[1][2];
        softmax.finish(o, lse, FA_DROPOUT && p.dropout.enabled ? p.dropout.scale : 1.f);
        __syncthreads();  // the Q tile's memory is reused for the output
        Base::template store<DP>(o, lse, sQ, gO, p.o_row, gL, rows_valid, p.d, warp_row, lane, tid);
    }
};
#endif  // FA_WGMMA

#ifndef FA_FWD_ENTRY
#define FA_FWD_ENTRY 1  // 0: the program of the FP8 and warp-specialised kernels (flash_fwd_fp8.cuh, flash_fwd_ws.cuh)
#endif
#if !FA_FWD_ENTRY
#elif FA_WGMMA
// Two blocks per multiprocessor where a block's tiles are small enough (d 64 with 64 keys per
// tile: 122 registers a thread, 49 KiB of shared memory), else one with up to 255 registers.
#define FA_MIN_BLOCKS ((FA_D * FA_BC <= 64 * 64) ? 2 : 1)
extern "C" __global__ void __launch_bounds__(FA_WARPS * 32, FA_MIN_BLOCKS) flash_fwd(const FwdParams p) {
    extern __shared__ __align__(128) char smem[];
    // The launcher adds 1 KiB so that the tiles can start on the swizzle's 1024-byte period.
    const u32 base = smem_addr(smem);
    FlashFwdSm90<FA_D, FA_BC, FA_WARPS, FA_BF16 != 0>::run(p, smem + (((base + 1023u) & ~1023u) - base));
}
#else
extern "C" __global__ void __launch_bounds__(FA_WARPS * 32) flash_fwd(const FwdParams p) {
    extern __shared__ __align__(128) char smem[];
    FlashFwd<FA_D, FA_MT, FA_BC, FA_WARPS, FA_BF16 != 0>::run(p, smem);
}
#endif

