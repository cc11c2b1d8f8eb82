// The warp-specialised forward for sm_90a (`flash_fwd_ws`, FA_WS = 1), FlashAttention-3's
// structure (§3.1): a producer warpgroup moves tiles with TMA (cp.async.bulk.tensor, 128-byte
// swizzle: the layout wgmma reads; tma.cuh) into rings of K and V buffers with "full" and "empty"
// mbarriers; it gives up registers (setmaxnreg) to the consumer warpgroups (two, or three at
// d = 64: FA_WARPS 8 or 12), which run the overlapped loop of FlashFwdSm90 without a block-wide
// barrier per tile and take turns issuing their products (named barriers passed round a ring:
// ping-pong with two), so that one's softmax runs under the others' MMAs.
// For e4m3 inputs (FA_E4M3 = 1: the FP8 forward, with FlashFwdFp8Sm90's products and P packing
// and V from the Vᵀ planes of flash_fwd_fp8.cuh's transpose) and for bf16/f16 (FA_E4M3 = 0:
// FlashFwdSm90's products, V as stored).

#if !FA_FWD_ENTRY && FA_WGMMA && FA_WS

// Field for field `WsParams` in src/cuda/launch.rs.
struct alignas(128) WsParams {
    TmaDesc q;  // [b][sq][hq][d]: boxes of 128 bytes x BR rows
    TmaDesc k;  // [b][sk][hk][d]: boxes of 128 bytes x BC rows
    TmaDesc v;  // e4m3: the Vᵀ planes [planes][FA_D][sk_pad], boxes of BC keys x FA_D rows;
                // 16-bit: V [b][sk][hk][d], boxes of 128 bytes x BC rows
    Fp8FwdParams f;
    int* next_item;  // the tile scheduler's counter, zero at launch (16-bit kernels); null: the stride
    // FA_BLOCKS with a block mask: each work item's key tiles with a visible mask block, written by
    // flash_fwd_ws_tiles (below); null otherwise. Row bh · num_m_blocks + m_block, tile_stride ints:
    // the count, then the tiles in the order the item visits them (the key loop's, last first),
    // each a tile index with WS_TILE_FULL set where every block under it is on.
    int* tile_list;
    long long tile_stride;
};

// The flag of a tile list entry (WsParams::tile_list) whose tile needs no mask: every mask block
// under it is on and the interval rules hide nothing there.
#define WS_TILE_FULL (1 << 30)

// The products of the warp-specialised kernel, by input type: e4m3 (FlashFwdFp8Sm90's: V read
// transposed from the Vᵀ planes, P as 8-bit A operands of 32 keys) or 16-bit (FlashFwdSm90's: V
// read as stored, transposed by the instruction, P as A operands of 16 keys). The operands are
// buffers' shared-memory addresses (u32: the descriptors built from them every k-step), or for
// the 16-bit products also descriptors of a buffer's start (u64: `qk_desc`, `v_desc`), advanced per
// k-step by `desc_plus` (FlashFwdWs::DESC_PLUS).
template <int D, int BC, int W, bool E4M3, bool BF16>
struct WsProducts;
template <int D, int BC, int W, bool BF16>
struct WsProducts<D, BC, W, true, BF16> {
    using M = FlashFwdFp8Sm90<D, BC, W>;
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
template <int D, int BC, int W, bool BF16>
struct WsProducts<D, BC, W, false, BF16> {
    using M = FlashFwdSm90<D, BC, W, BF16>;
    static constexpr int PA = BC / 16;
    static __device__ __forceinline__ void issue_scores(FragC (&s)[1][BC / 8], u32 sQw, u32 sK) {
        M::issue_scores(s, sQw, sK);
    }
    static __device__ __forceinline__ void issue_pv(FragC (&o)[1][D / 8], FragA (&pa)[PA], u32 sV) {
        M::issue_pv(o, pa, sV);
    }
    // Q and K tiles: K-major, 128-byte rows. V: MN-major (transposed by the instruction), 64
    // columns a block, the blocks BC rows of 128 bytes apart.
    static __device__ __forceinline__ u64 qk_desc(u32 addr) { return gmma_desc(addr, 16, 1024); }
    static __device__ __forceinline__ u64 v_desc(u32 addr) { return gmma_desc(addr, BC * 128, 1024); }
    // M::issue_scores and M::issue_pv on descriptors.
    static __device__ __forceinline__ void issue_scores(FragC (&s)[1][BC / 8], u64 dq, u64 dk) {
        fence_operands(s[0]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const u32 q_off = (u32)((kk / 4) * M::BR * 128 + (kk % 4) * 32);
            const u32 k_off = (u32)((kk / 4) * BC * 128 + (kk % 4) * 32);
            wgmma_ss<BC>(s[0], desc_plus(dq, q_off), desc_plus(dk, k_off), kk > 0);
        }
        wgmma_commit();
    }
    static __device__ __forceinline__ void issue_pv(FragC (&o)[1][D / 8], FragA (&pa)[PA], u64 dv) {
        constexpr int N_HEAD = M::N_HEAD, N_TAIL = M::N_TAIL;
#pragma unroll
        for (int kk = 0; kk < PA; ++kk) fence_operands(pa[kk]);
        fence_operands(o[0]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < PA; ++kk) {
            const u32 rows = (u32)(kk * 16 * 128);
            wgmma_rs<N_HEAD>(*reinterpret_cast<FragC(*)[N_HEAD / 8]>(&o[0][0]), pa[kk], desc_plus(dv, rows));
            if constexpr (N_TAIL > 0)
                wgmma_rs<N_TAIL>(*reinterpret_cast<FragC(*)[N_TAIL / 8]>(&o[0][N_HEAD / 8]), pa[kk],
                                 desc_plus(dv, rows + (u32)(N_HEAD / 64 * BC * 128)));
        }
        wgmma_commit();
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
// landed) and an "empty" one (every consumer warp is done with it): K of tile j is freed as
// soon as S_j completed, V of tile j after P_j·V_j, a tile later. Its column blocks are 128 bytes
// wide (64 16-bit or 128 8-bit columns), the 128-byte swizzle the products read.
template <int D, int BC, int W, bool E4M3, bool BF16>
struct FlashFwdWs {
    static_assert(FA_MT == 1 && (W == 8 || (W == 12 && !E4M3)),
                  "two consumer warpgroups of 64 rows, or three for 16-bit inputs (the launchers check it)");
    using Mma = WsProducts<D, BC, W, E4M3, BF16>;
    using Base = FlashFwd<D, 1, BC, 8, true>;  // the masks
    static constexpr int ESIZE = E4M3 ? 1 : 2;  // bytes an element
    static constexpr int GROUPS = W / 4;        // consumer warpgroups, 64 rows each
    static constexpr int BR = 64 * GROUPS;
    static constexpr int CONSUMERS = 32 * W;
    static constexpr int THREADS = CONSUMERS + 128;  // + the producer warpgroup
    static constexpr int NT = BC / 8;
    static constexpr int DT = D / 8;
    static constexpr int PA = Mma::PA;
    // 128-byte column blocks of a row: whole blocks, so a 96-column 16-bit tile takes two (its
    // rows' last 32 columns are the TMA's zero fill past d, and no product reads them: QKᵀ runs
    // D / 16 k-steps, P·V FlashFwdSm90's 64 + 32 columns), as in FlashFwdSm90.
    static constexpr int ROW_BLOCKS = (D * ESIZE + 127) / 128;
    static constexpr int BLOCK_COLS = 128 / ESIZE;  // elements a column block holds
    static constexpr int DP = ROW_BLOCKS * BLOCK_COLS;  // D padded to whole blocks
    static_assert(D * ESIZE % 128 == 0 || (!E4M3 && D == 96), "rows of whole 128-byte blocks, or the 96 tile");
    static_assert(BC == 128 || !E4M3, "a Vᵀ tile row is one 128-byte swizzle row: 128 keys");
    static constexpr int Q_BYTES = BR * DP * ESIZE;
    static constexpr int K_BYTES = BC * DP * ESIZE;
    static constexpr int V_BYTES = BC * DP * ESIZE;
    static constexpr int STAGES = K_BYTES <= 16384 ? 4 : 2;  // per ring
    // Two Q buffers, the K ring, the V ring, then the mbarriers (8 bytes each: Q full and empty,
    // two each; K full and empty, V full and empty, STAGES each), then each Q buffer's item slot
    // (ITEM_SLOT bytes: its index, then its sequence, head, first row and rows, for the epilogue).
    static constexpr int K_RING = 2 * Q_BYTES, V_RING = K_RING + STAGES * K_BYTES;
    static constexpr int BAR_OFFSET = V_RING + STAGES * V_BYTES;
    static constexpr int ITEM_OFFSET = BAR_OFFSET + 8 * (4 + 4 * STAGES);
    static constexpr int ITEM_SLOT = 32;
    static constexpr int SMEM_BYTES = ITEM_OFFSET + 2 * ITEM_SLOT;
    static_assert(SMEM_BYTES + 1024 <= 232448, "shared memory of one block a multiprocessor");
    // S of the next tile and P·V of the previous one in flight together needs the score,
    // probability and output registers at once: at D = 256 the output alone takes 128.
    static constexpr bool OVERLAP = D <= 128;
    // Whether blocks take items from the tile scheduler (an atomic counter) rather than every
    // gridDim.x-th: the 16-bit kernels, and the FP8 kernel's FA_FP8_SCHED build, which the
    // launcher runs where items differ in length (causal: 1.01-1.10x the fixed stride, with the
    // causal head chunks, at 1k-16k). Built with the scheduler, the FP8 kernel's stride path ran
    // 0.89x at 4k without a causal rule, so items of one length keep the build without it
    // (H100, session 44; docs/cuda-notes.md).
    static constexpr bool SCHEDULED = !E4M3 || FA_FP8_SCHED;
    // Registers a thread after setmaxnreg. The block holds THREADS · LAUNCH_REGS (ptxas's count
    // under __launch_bounds__(THREADS, 1): 168 for 384 threads, 128 for 512); the consumers'
    // increase waits for registers the producer gave back, so the two must add up to no more (or
    // the increase waits forever). The producer's scheduler loop spills a few bytes in 24, the
    // consumers' loop with softcap at D = 128 32 bytes in 232: a producer's spill (one thread,
    // once an item) is the cheaper. The FP8 kernel's scheduler build keeps 24 and 240 as its
    // stride build (ptxas: no spill at D = 128 or 256; with 40 the D = 256 build spilled 28
    // bytes). Three consumer warpgroups get 160 each, the producer 32.
    static constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;
    static constexpr int PRODUCER_REGS = GROUPS == 3 ? 32 : SCHEDULED && !(FA_SOFTCAP && D == 128) && !E4M3 ? 40 : 24;
    static constexpr int CONSUMER_REGS = (THREADS * LAUNCH_REGS - 128 * PRODUCER_REGS) / CONSUMERS / 8 * 8;
    static_assert(PRODUCER_REGS % 8 == 0 && CONSUMER_REGS % 8 == 0 && CONSUMER_REGS <= 256, "setmaxnreg's steps");
    static_assert(128 * PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= THREADS * LAUNCH_REGS, "the block's registers");
    // Operands as descriptors built once and advanced (`desc_plus`: one add a k-step where a
    // descriptor built from an address takes four), and (UNIFORM) kept in uniform registers (the
    // warp index and each tile's ring count read through shuffles, the latter before the waits
    // for the tile and the turn). Both at D = 128: there they took the loop's descriptor work
    // from ~110 instructions a tile, mostly R2UR and integer ones, to uniform ones, 1.03-1.04x
    // faster from s = 4k; at D = 64 the same code measured 0.91-0.93x from s = 4k, the FP8 kernel
    // 0.95-0.99x (H100, session 40). Descriptors advanced without the shuffles, at D = 64
    // (session 43): with softcap or dropout on two consumer warpgroups 0.97-1.04x (1-3% faster
    // without a causal rule, level under one); plain, 0.92-0.97x on two and 0.98-1.06x on three,
    // and with dropout on three it spills 68 bytes: those keep descriptors built from addresses.
    static constexpr bool DESC_PLUS = !E4M3 && (D == 128 || (D == 64 && GROUPS == 2 && (FA_SOFTCAP || FA_DROPOUT)));
    // Whether the warp index and the ring counts go through shuffles (uniform registers) too.
    static constexpr bool UNIFORM = DESC_PLUS && D == 128;
    // Named barriers 1 .. GROUPS pass the turn to issue products from one consumer warpgroup to
    // the next, round the ring: each is taken by the warpgroup whose turn it is and the one before
    // it (TURN_THREADS).
    static constexpr int BAR_TURN = 1;
    // Whether an item's first S is issued in the previous item's last turn, beside its last P·V
    // (the items fused): with three consumer warpgroups only. There it measured 1.05-1.08x faster
    // at s >= 1k without a causal rule (also at 16k, where an item has 128 tiles: the loop's code
    // changed with it); with two, 0.84-0.96x, also at 16k, and the same with the next item's Q
    // issued earlier by the producer (H100, session 42; docs/cuda-notes.md).
    static constexpr bool FUSE = GROUPS == 3;
    static_assert(!(FUSE && FA_BLOCKS), "the fused turn masks the next item's first tile with this item's plane");
    static constexpr int TURN_THREADS = 256;

    // One work item: a block of BR query rows of one (sequence, head) and its key tiles; `live`:
    // its row of the tile list (FA_BLOCKS with a block mask), else null.
    struct Item {
        int b, h, hk, row0, rows_valid, n_end, tiles;
        const int* live;
    };
    static __device__ __forceinline__ Item item_at(const FwdParams& p, const Visibility& vis0, int i) {
        int m_block, bh;
        fwd_item(p, i, m_block, bh);
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
        it.live = nullptr;
        return it;
    }
    // item_at, with the tile list's count where there is one (FA_BLOCKS: only the key tiles with a
    // visible mask block are visited, by producer and consumers alike).
    static __device__ __forceinline__ Item item_of(const WsParams& pp, const Visibility& vis0, int i) {
        Item it = item_at(pp.f.base, vis0, i);
        if constexpr (FA_BLOCKS && !E4M3) {
            if (pp.tile_list != nullptr) {
                int m_block, bh;
                fwd_item(pp.f.base, i, m_block, bh);
                it.live = pp.tile_list + (long long)(bh * pp.f.base.num_m_blocks + m_block) * pp.tile_stride;
                it.tiles = it.live[0];
            }
        }
        return it;
    }
    // The item's j-th key tile in visiting order: a tile list entry (a tile index, WS_TILE_FULL
    // where it needs no mask), or without a list n_end - 1 - j.
    static __device__ __forceinline__ int tile_entry(const int* live, int n_end, int j) {
        if constexpr (FA_BLOCKS && !E4M3) {
            if (live != nullptr) return live[1 + j];
        }
        return n_end - 1 - j;
    }
    // The tile index of a tile_entry, and its first key.
    static __device__ __forceinline__ int entry_tile(int e) {
        if constexpr (FA_BLOCKS && !E4M3)
            return e & (WS_TILE_FULL - 1);
        else
            return e;
    }
    static __device__ __forceinline__ int entry_col(int e) { return entry_tile(e) * BC; }

    // A persistent grid (one block a multiprocessor) takes the items in order: block x first item
    // x, then (SCHEDULED, given a counter) whichever comes next when it asks, from an atomic
    // counter (the tile scheduler), so that a block which drew short items takes more of them and
    // the grid ends together; else item x + gridDim.x, and so on. The producer loads the next item's Q (two Q
    // buffers, each with a "full" and an "empty" mbarrier) and first tiles while the consumers
    // finish the current one. With the scheduler it leaves the item's index beside its Q buffer,
    // written before the "full" arrival, which releases it to the consumers' wait (they read it
    // before their "empty" arrivals, which the producer waits for before it writes there again);
    // an index past the last item, with a bare arrival, tells the consumers to stop.
    static __device__ __forceinline__ void run(const WsParams& pp, char* smem) {
        const FwdParams& p = pp.f.base;
        const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
        const int items = p.num_m_blocks * p.batch * p.hq;
        const Visibility vis{p.sq, p.sk, p.sk - p.sq, p.causal, p.window_left, p.window_right};

        const u32 sQ = smem_addr(smem), sK = sQ + K_RING, sV = sQ + V_RING;
        const u32 bar_q_full = sQ + BAR_OFFSET, bar_q_empty = bar_q_full + 16;
        const u32 bar_k_full = bar_q_empty + 16, bar_k_empty = bar_k_full + 8 * STAGES;
        const u32 bar_v_full = bar_k_empty + 8 * STAGES, bar_v_empty = bar_v_full + 8 * STAGES;
        const u32 item_of_q = sQ + ITEM_OFFSET;  // each Q buffer's item slot (ITEM_SLOT bytes)
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
            asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS) : "memory");
            if (tid == CONSUMERS) {
                int it = 0;  // tiles so far: the rings' phases
                for (int i = blockIdx.x, qi = 0;; ++qi) {  // qi: items so far, the Q buffers' phases
                    const int qb = qi & 1;
                    if constexpr (!SCHEDULED)
                        if (i >= items) break;
                    if (qi >= 2) mbar_wait(bar_q_empty + 8 * qb, (u32)((qi / 2 - 1) & 1));
                    const u32 q_full = bar_q_full + 8 * qb, sQb = sQ + (u32)(qb * Q_BYTES);
                    if constexpr (SCHEDULED) {
                        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(item_of_q + ITEM_SLOT * qb), "r"(i) : "memory");
                        if (i >= items) {
                            mbar_arrive(q_full);
                            break;
                        }
                    }
                    const Item w = item_of(pp, vis, i);
                    // The item's place, for the consumers' epilogue (released by the arrival below).
                    {
                        const u32 slot = item_of_q + (u32)(ITEM_SLOT * qb);
                        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(slot + 4), "r"(w.b) : "memory");
                        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(slot + 8), "r"(w.h) : "memory");
                        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(slot + 12), "r"(w.row0) : "memory");
                        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(slot + 16), "r"(w.rows_valid) : "memory");
                    }
                    mbar_expect_tx(q_full, Q_BYTES);
#pragma unroll
                    for (int c = 0; c < ROW_BLOCKS; ++c)
                        tma_load_4d(sQb + (u32)(c * BR * 128), &pp.q, BLOCK_COLS * c, w.row0, w.h, w.b, q_full);
                    const int plane = w.b * (p.hq / p.group) + w.hk;
                    // One thread issuing copies gains nothing from an unrolled loop, which would
                    // cost it registers (the softcap variant at D = 128 has 24).
#pragma unroll 1
                    for (int j = 0; j < w.tiles; ++j, ++it) {
                        const int st = it % STAGES, n = entry_tile(tile_entry(w.live, w.n_end, j));
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
                    // The next item, asked for once this one's loads are issued (the producer runs
                    // a ring ahead of the consumers, so the atomic's round trip is hidden; asked
                    // earlier, its result would be one register more than the producer's 24).
                    i = (SCHEDULED && pp.next_item != nullptr ? atomicAdd(pp.next_item, 1) : i) + (int)gridDim.x;
                }
            }
            return;
        }
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS) : "memory");

        // Consumers: warpgroup wg owns rows 64·wg .. 64·wg + 63 of each item. (UNIFORM: the warp
        // index through a shuffle, so that ptxas knows it is the same in every lane and keeps what
        // derives from it, the operand descriptors, in uniform registers.)
        const int uwarp = UNIFORM ? __shfl_sync(0xffffffffu, warp, 0) : warp;
        const int wg = uwarp / 4, warp_row = uwarp * 16;
        // Optional paths of the 16-bit kernels (FA_EXTRAS: dropout, softcap). With softcap the
        // softmax takes tanh(scale · qk / c) (ScoreMod::softcap_log2 without its last multiply),
        // with c · log2 e as its scale: its FMA holds the multiply (c > 0: the row maxima are
        // those of the capped scores).
        const bool capped = FA_SOFTCAP && !E4M3 && p.mod.softcap > 0.f;
        const bool drop = FA_DROPOUT && !E4M3 && p.dropout.enabled;
        const float scale_log2 = capped ? p.mod.cap_log2 : p.scale_log2;
        // Turns: warpgroup 0 issues first; each passes the turn to the next after issuing its
        // products (the last one's arrival starts the ring).
        const int my_turn = BAR_TURN + wg, their_turn = BAR_TURN + (wg + 1) % GROUPS;
        if (wg == GROUPS - 1) named_arrive(BAR_TURN, TURN_THREADS);
        // The ring buffers' operands for tile `it`, in steps: `ring` and `*_early` before the waits
        // for the tile and the turn, `*_late` in the turn. DESC_PLUS: the tile count read through
        // a shuffle (uniform; its latency passes under the waits), the descriptor (each buffer's
        // start built once), then nothing; else the tile count, twice, then the buffer's address.
        const u64 dq0 = [&]() -> u64 {  // this warpgroup's rows of the first Q buffer
            if constexpr (DESC_PLUS)
                return Mma::qk_desc(sQ + (u32)(wg * 64 * 128));
            else
                return 0;
        }();
        const u64 dk0 = [&]() -> u64 {
            if constexpr (DESC_PLUS)
                return Mma::qk_desc(sK);
            else
                return 0;
        }();
        const u64 dv0 = [&]() -> u64 {
            if constexpr (DESC_PLUS)
                return Mma::v_desc(sV);
            else
                return 0;
        }();
        auto ring = [&](int it) { return UNIFORM ? __shfl_sync(0xffffffffu, it, 0) : it; };
        auto k_early = [&](int u) {
            if constexpr (DESC_PLUS)
                return desc_plus(dk0, ((u32)u % (u32)STAGES) * (u32)K_BYTES);
            else
                return u;
        };
        auto v_early = [&](int u) {
            if constexpr (DESC_PLUS)
                return desc_plus(dv0, ((u32)u % (u32)STAGES) * (u32)V_BYTES);
            else
                return u;
        };
        using RingOp = decltype(k_early(0));  // u64 (DESC_PLUS) or int
        auto k_late = [&](RingOp x) {
            if constexpr (DESC_PLUS)
                return x;
            else
                return sK + (u32)((x % STAGES) * K_BYTES);
        };
        auto v_late = [&](RingOp x) {
            if constexpr (DESC_PLUS)
                return x;
            else
                return sV + (u32)((x % STAGES) * V_BYTES);
        };
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

        // The items, in one of two loops: with the scheduler (S: each index read from shared
        // memory after the wait for its Q), or by the stride, whose index and item are known
        // before that wait, as before the scheduler. (The stride's loop with the wait first, as
        // the scheduler's must be, ran 8% slower at d = 64 without a causal rule, its per-tile
        // bookkeeping off the uniform datapath; docs/cuda-notes.md.) The host passes a counter
        // only where items differ in length.
        auto consume = [&](const bool S) {
            int it = 0;
            // Whether this item's first tile was issued in the previous item's last turn (with its
            // last P·V): then its P is in `pa`, its softmax state in row_max and row_sum, and `o`
            // is zero. Across items, as within one, a turn issues one tile's S with the previous
            // tile's P·V, so a block's tensor cores do not idle at an item's start (S alone, then
            // its softmax) and end (P·V alone, then the output's stores).
            bool primed = false;
            FragA pa[PA];
            FragC o[1][DT];
            float row_max[2] = {-FA_INF, -FA_INF}, row_sum[2] = {0.f, 0.f};
            for (int qi = 0, stride_i = (int)blockIdx.x; S || stride_i < items; ++qi, stride_i += (int)gridDim.x) {
                const int qb = qi & 1;
                // The item's index: from the scheduler, beside its Q buffer until the buffer goes
                // back to the producer (read again where needed rather than kept live through the
                // loop), after the wait for Q; else the stride's, before it.
                auto item_index = [&]() {
                    int i = stride_i;
                    if (S)
                        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(i) : "r"(item_of_q + ITEM_SLOT * qb) : "memory");
                    return i;
                };
                if (S) {
                    mbar_wait(bar_q_full + 8 * qb, (u32)((qi / 2) & 1));
                    if (item_index() >= items) break;
                }
                const u32 sQb = sQ + (u32)(qb * Q_BYTES);
                // A Q buffer's rows of this warpgroup: their address, or (DESC_PLUS) descriptor.
                const auto q_operand = [&](int b) {
                    if constexpr (DESC_PLUS)
                        return desc_plus(dq0, (u32)(b * Q_BYTES));
                    else
                        return sQ + (u32)(b * Q_BYTES) + (u32)(wg * 64 * 128);
                };
                const auto q_op = q_operand(qb);
                if (!primed) {
#pragma unroll
                    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) o[0][dt].x[e] = 0.f;
                    row_max[0] = row_max[1] = -FA_INF;
                    row_sum[0] = row_sum[1] = 0.f;
                }
                int tiles, n_end, row0, rows_valid, bh;
                const int* live;                   // the item's tile list row (FA_BLOCKS), or null
                const unsigned char* plane = nullptr;  // its block mask plane, where it has a list
                {
                    const Item w = item_of(pp, vis, item_index());
                    tiles = w.tiles;
                    n_end = w.n_end;
                    row0 = w.row0;
                    rows_valid = w.rows_valid;
                    bh = w.b * p.hq + w.h;  // dropout's stream
                    live = w.live;
                    if constexpr (FA_BLOCKS && !E4M3)
                        if (live != nullptr) plane = p.block.plane(w.b, w.h);
                }
                if (!S) mbar_wait(bar_q_full + 8 * qb, (u32)((qi / 2) & 1));
                // Scores of the tile of entry e (tile_entry) of the item at rows r0 .. r0 + valid - 1
                // to probabilities (softcap first, then the mask: a hidden score must end -inf), with
                // `correction` for O; `rmax` and `rsum` the item's softmax state. With a tile list
                // (FA_BLOCKS), the entry says whether the tile needs the mask, which then reads the
                // block mask's bytes (`plane`); else the interval rules decide.
                auto probabilities = [&](FragC (&s)[1][NT], int e, float (&correction)[2], int r0, int valid,
                                         float (&rmax)[2], float (&rsum)[2]) {
                    const int col0 = entry_col(e);
                    if constexpr (FA_SOFTCAP && !E4M3) {
                        if (capped) {
#pragma unroll
                            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                                for (int e = 0; e < 4; ++e) s[0][nt].x[e] = tanh_approx(s[0][nt].x[e] * p.mod.tanh_scale);
                        }
                    }
                    if constexpr (FA_BLOCKS && !E4M3) {
                        const bool full = live != nullptr ? (e & WS_TILE_FULL) != 0 : vis.tile_full(r0, r0 + valid, col0, col0 + BC);
                        if (!full) Base::apply_mask(s, vis, plane, p.block, r0 + warp_row, col0, lane);
                    } else if (!vis.tile_full(r0, r0 + valid, col0, col0 + BC)) {
                        Base::apply_mask(s, vis, nullptr, p.block, r0 + warp_row, col0, lane);
                    }
                    ws_softmax_tile(s, rmax, rsum, scale_log2, correction);
                };
                // P of the tile at col0 as A operands of P·V, with dropout's keep mask on (after the
                // row sums took the undropped P; 1 / (1 - p) is applied to O at the end).
                auto pack = [&](FragA (&pa)[PA], const FragC (&s)[1][NT], int col0, int r0, int stream) {
                    Mma::pack_p(pa, s);
                    if constexpr (FA_DROPOUT && !E4M3) {
                        if (drop) {
#pragma unroll
                            for (int kb = 0; kb < BC / 32; ++kb)
                                Base::drop_block(pa + 2 * kb, p.dropout, (u32)stream, r0 + warp_row, col0 + 32 * kb, lane);
                        }
                    }
                };

                // S of tile `it`, issued in this warpgroup's turn, complete; its K buffer freed.
                auto scores_in_turn = [&](FragC (&s)[1][NT], int it) {
                    const auto k_op = k_early(ring(it));
                    wait_k(it);
                    named_sync(my_turn, TURN_THREADS);
                    Mma::issue_scores(s, q_op, k_late(k_op));
                    named_arrive(their_turn, TURN_THREADS);
                    wgmma_wait<0>();
                    fence_operands(s[0]);
                    free_k(it);
                };

                // The next item's softmax state, when its first tile ran in this item's last turn.
                bool next_primed = false;
                float next_max[2] = {-FA_INF, -FA_INF}, next_sum[2] = {0.f, 0.f};
                if (tiles > 0 && !OVERLAP) {
                    // S, then P·V, one after the other (S issued in this warpgroup's turn).
                    for (int j = 0; j < tiles; ++j, ++it) {
                        FragC s[1][NT];
                        scores_in_turn(s, it);
                        float correction[2];
                        const int e = tile_entry(live, n_end, j);
                        probabilities(s, e, correction, row0, rows_valid, row_max, row_sum);
                        float corr[1][2] = {{correction[0], correction[1]}};
                        OnlineSoftmax<1>::rescale(o, corr);
                        pack(pa, s, entry_col(e), row0, bh);
                        const auto v_op = v_early(ring(it));
                        wait_v(it);
                        Mma::issue_pv(o, pa, v_late(v_op));
                        wgmma_wait<0>();
                        Mma::pv_done(o, pa);
                        free_v(it);
                    }
                    // One more turn, as the overlapped loop takes (its last P·V): every item takes
                    // tiles + 1 turns in both loops.
                    named_sync(my_turn, TURN_THREADS);
                    named_arrive(their_turn, TURN_THREADS);
                } else if (tiles > 0) {
                    if (!primed) {
                        FragC s[1][NT];
                        scores_in_turn(s, it);
                        float correction[2];
                        const int e = tile_entry(live, n_end, 0);
                        probabilities(s, e, correction, row0, rows_valid, row_max, row_sum);
                        pack(pa, s, entry_col(e), row0, bh);
                        ++it;
                    }
                    for (int j = 1; j < tiles; ++j, ++it) {
                        const int u = ring(it);
                        const auto k_op = k_early(u), v_op = v_early(u - 1);
                        wait_k(it);
                        wait_v(it - 1);
                        FragC s[1][NT];
                        named_sync(my_turn, TURN_THREADS);
                        Mma::issue_scores(s, q_op, k_late(k_op));
                        Mma::issue_pv(o, pa, v_late(v_op));
                        named_arrive(their_turn, TURN_THREADS);
                        wgmma_wait<1>();
                        fence_operands(s[0]);
                        free_k(it);
                        float correction[2];
                        const int e = tile_entry(live, n_end, j);
                        probabilities(s, e, correction, row0, rows_valid, row_max, row_sum);
                        wgmma_wait<0>();
                        Mma::pv_done(o, pa);
                        free_v(it - 1);
                        float corr[1][2] = {{correction[0], correction[1]}};
                        OnlineSoftmax<1>::rescale(o, corr);
                        pack(pa, s, entry_col(e), row0, bh);
                    }
                    // The next item, if any, and whether it sees a key tile: its Q is loaded while
                    // this item runs (two Q buffers), so its wait is usually already over.
                    const int nb = qb ^ 1;
                    int next = !FUSE ? items : S ? items : stride_i + (int)gridDim.x;
                    if (FUSE && S) {
                        mbar_wait(bar_q_full + 8 * nb, (u32)(((qi + 1) / 2) & 1));
                        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(next) : "r"(item_of_q + ITEM_SLOT * nb) : "memory");
                    }
                    Item nx{};
                    if (FUSE && next < items) {
                        nx = item_of(pp, vis, next);
                        if (!S) mbar_wait(bar_q_full + 8 * nb, (u32)(((qi + 1) / 2) & 1));
                    }
                    const auto v_op = v_early(ring(it - 1));
                    if (FUSE && next < items && nx.tiles > 0) {
                        // This item's last P·V with the next item's first S, in one turn: the loop's
                        // turn above but for the rescale (the next item's O starts at zero). (One
                        // lambda for both turns changed the three-group kernel's machine code
                        // throughout, nvdisasm; the measured code is this one.)
                        const auto k_op = k_early(ring(it));
                        wait_k(it);
                        wait_v(it - 1);
                        FragC s[1][NT];
                        named_sync(my_turn, TURN_THREADS);
                        Mma::issue_scores(s, q_operand(nb), k_late(k_op));
                        Mma::issue_pv(o, pa, v_late(v_op));
                        named_arrive(their_turn, TURN_THREADS);
                        wgmma_wait<1>();
                        fence_operands(s[0]);
                        free_k(it);
                        float correction[2];  // (O of the next item starts at zero)
                        probabilities(s, tile_entry(nx.live, nx.n_end, 0), correction, nx.row0, nx.rows_valid, next_max,
                                      next_sum);
                        wgmma_wait<0>();
                        Mma::pv_done(o, pa);
                        free_v(it - 1);
                        pack(pa, s, entry_col(tile_entry(nx.live, nx.n_end, 0)), nx.row0, nx.b * p.hq + nx.h);
                        ++it;
                        next_primed = true;
                    } else {
                        wait_v(it - 1);
                        named_sync(my_turn, TURN_THREADS);
                        Mma::issue_pv(o, pa, v_late(v_op));
                        named_arrive(their_turn, TURN_THREADS);
                        wgmma_wait<0>();
                        Mma::pv_done(o, pa);
                        free_v(it - 1);
                    }
                }

                // Normalise (v_descale with 1 / rowsum); each warp then writes its own 16 rows through
                // its own 16 rows of this item's Q buffer (2 KiB a column block, free once its
                // warpgroup's products completed), 64 columns at a time: no other warp reads or writes
                // them, so no block-wide barrier; then the buffer goes back to the producer.
                float lse[2];
                ws_finish(o, row_max, row_sum, scale_log2, drop ? pp.f.v_descale * p.dropout.scale : pp.f.v_descale, lse);
                // The item's place, as the producer left it in the Q buffer's slot (which it rewrites
                // only after this buffer's "empty" arrival below): recomputing it here (integer
                // divisions, the visibility rule's key range) took ~500-780 cycles of a 512-row
                // item's ~10 000 with the tensor cores idle, and keeping it in registers through the
                // loop cost the d = 64 loop up to 8% (H200, session 58).
                Item w{};
                {
                    const u32 slot = item_of_q + (u32)(ITEM_SLOT * qb);
                    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(w.b) : "r"(slot + 4) : "memory");
                    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(w.h) : "r"(slot + 8) : "memory");
                    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(w.row0) : "r"(slot + 12) : "memory");
                    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(w.rows_valid) : "r"(slot + 16) : "memory");
                }
                const int g = lane >> 2, t = lane & 3;
                u16* gO = p.o + w.b * p.o_batch + (long long)(w.row0 + warp_row) * p.o_row + w.h * p.o_head;
                float* gL = p.lse + w.b * p.lse_batch + w.h * p.lse_head + w.row0 + warp_row;
                const int rows_here = w.rows_valid - warp_row;  // rows of this warp inside the sequence
#pragma unroll
                for (int r = 0; r < 2; ++r)
                    if (t == 0 && g + 8 * r < rows_here) gL[g + 8 * r] = lse[r];
#pragma unroll
                for (int pass = 0; pass < (D + 63) / 64; ++pass) {
                    const u32 sW = sQb + (u32)((pass % ROW_BLOCKS) * BR * 128 + warp_row * 128);  // 16 rows
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int row = g + 8 * r;
#pragma unroll
                        for (int c = 0; c < 8; ++c) {
                            const int dt = 8 * pass + c;
                            if (dt >= DT) break;  // the 96 tile's second pass: 32 columns
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
                primed = next_primed;
                if (primed) {
#pragma unroll
                    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) o[0][dt].x[e] = 0.f;
                    row_max[0] = next_max[0];
                    row_max[1] = next_max[1];
                    row_sum[0] = next_sum[0];
                    row_sum[1] = next_sum[1];
                }
            }
        };
        // Two call sites, each with its constant (the lambda is inlined at each).
        if (SCHEDULED && pp.next_item != nullptr)
            consume(true);
        else
            consume(false);
        // The turn the last warpgroup passed last is never taken: absorb it (it started one turn
        // ahead).
        if (wg == 0) named_sync(my_turn, TURN_THREADS);
    }
};

extern "C" __global__ void __launch_bounds__(FA_WARPS * 32 + 128, 1) flash_fwd_ws(const __grid_constant__ WsParams p) {
    extern __shared__ __align__(128) char smem[];
    const u32 base = smem_addr(smem);
    FlashFwdWs<FA_D, FA_BC, FA_WARPS, FA_E4M3 != 0, FA_BF16 != 0>::run(p, smem + (((base + 1023u) & ~1023u) - base));
}

#if FA_BLOCKS && !FA_E4M3
// The tile list of the warp-specialised forward under a block-sparse mask (WsParams::tile_list):
// a warp per work item (rows row0 .. row0 + BR - 1 of one (sequence, head)), launched before the
// forward on its stream. Of the key tiles the item's interval rules reach (item_at's), in the
// order the forward visits them, the ones with at least one mask block on under the item's rows,
// flagged WS_TILE_FULL where every block is on and the interval rules hide nothing either: the
// forward's producer loads only those, and its consumers mask only the unflagged ones. Each lane
// reads a share of a tile's mask bytes; the warp votes.
extern "C" __global__ void __launch_bounds__(128) flash_fwd_ws_tiles(const __grid_constant__ WsParams pp) {
    constexpr int BR = FlashFwdWs<FA_D, FA_BC, FA_WARPS, false, FA_BF16 != 0>::BR, BC = FA_BC;
    const FwdParams& p = pp.f.base;
    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * 4 + threadIdx.x / 32;  // bh · num_m_blocks + m_block
    if (row >= (long long)p.num_m_blocks * p.batch * p.hq) return;
    const int m_block = (int)(row % p.num_m_blocks), bh = (int)(row / p.num_m_blocks);
    const Visibility vis{p.sq, p.sk, p.sk - p.sq, p.causal, p.window_left, p.window_right};
    const BlockMask& bm = p.block;
    const unsigned char* pl = bm.plane(bh / p.hq, bh % p.hq);
    const int row0 = m_block * BR, rows = max(min(BR, p.sq - row0), 0);
    int* out = pp.tile_list + row * pp.tile_stride;
    int count = 0;
    if (rows > 0) {
        int lo, hi;
        vis.key_range(row0, row0 + rows, lo, hi);
        const int bi0 = row0 / bm.bq, nbi = (row0 + rows - 1) / bm.bq - bi0 + 1;
        for (int n = (hi + BC - 1) / BC - 1; n >= lo / BC; --n) {
            const int c0 = n * BC, c1 = min(p.sk, c0 + BC);
            const int bj0 = c0 / bm.bk, nbj = (c1 - 1) / bm.bk - bj0 + 1;
            const auto on = [&](int x) { return pl[(bi0 + x / nbj) * bm.s_i + (bj0 + x % nbj) * bm.s_j] != 0; };
            bool all;
            if (warp_vote_any(nbi * nbj, lane, on, all)) {
                const bool full = all && vis.tile_full(row0, row0 + rows, c0, c0 + BC);
                if (lane == 0) out[1 + count] = n | (full ? WS_TILE_FULL : 0);
                ++count;
            }
        }
    }
    if (lane == 0) out[0] = count;
}
#endif

#endif  // !FA_FWD_ENTRY && FA_WGMMA && FA_WS
