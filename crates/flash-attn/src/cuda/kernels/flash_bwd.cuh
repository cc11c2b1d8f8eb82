// FlashAttention-2 backward for sm_80+ (mma.sync m16n8k16, f32 accumulation): three kernels.
//
//   flash_bwd_prep     D_i = rowsum(dO_i ∘ O_i) in f32, one warp per (token, head).
//   flash_bwd          one block per (key tile, sequence, kv head): K_j, V_j stay in shared
//                      memory and dK_j, dV_j in registers while the block walks every query tile
//                      of every query head of its GQA group that can see the tile (FlashAttention-2
//                      Algorithm 2 with the loops swapped); dQ is accumulated in f32 in global
//                      memory with `red.add` (or, deterministic, in key-tile order).
//   flash_bwd_convert  dq = scale · dQaccum in the dtype; zero dk/dv rows of varlen tokens that
//                      belong to no sequence.
//
// In the main kernel each warp owns 16 keys, so scores are computed transposed, Sᵀ = K Qᵀ
// (keys × queries): Pᵀ and dSᵀ land in registers exactly as the A operands of dV += Pᵀ dO and
// dK += dSᵀ Q need them. dQ = dS K needs a sum over the keys of all warps, so dSᵀ goes through
// shared memory once and is read back transposed (ldmatrix.trans).
//
// Compile-time parameters (NVRTC -D options): FA_D (tile width: the head dim, or the next of 64
// and 128 above it; columns past the runtime `d` load as zeros and are never stored), FA_BR
// (queries per tile),
// FA_WARPS (keys per tile = 16 · FA_WARPS), FA_BF16, FA_EXTRAS (the dropout, score-modifier and
// block-mask paths compiled in, a set of bits: below),
// FA_PARTS (query slices of the dP phase; an experiment knob, 1 in every shipped variant),
// FA_WGMMA (1: sm_90a; the products on warpgroup MMAs, a warpgroup's 64 keys per product, tiles
// in the wgmma layout; the element-wise code is shared, since a warpgroup's accumulator gives each
// of its warps the 16 rows and the fragment layout the mma.sync path has).

#ifndef FA_D
#define FA_D 128
#endif
#ifndef FA_BR
#define FA_BR 64
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
#ifndef FA_PARTS
#define FA_PARTS 1
#endif
#ifndef FA_WGMMA
#define FA_WGMMA 0  // 1: the four products and dQ on sm_90a warpgroup MMAs (wgmma.cuh)
#endif
#ifndef FA_BWD_WS
#define FA_BWD_WS 0  // 1: the warp-specialised sm_90a kernel (a producer warpgroup, TMA, mbarriers)
#endif
#ifndef FA_BWD_STAGES
#define FA_BWD_STAGES 2  // FA_BWD_WS: buffers of the Q / dO / lse / D ring
#endif

// The launch parameters; mirrored field for field by `BwdParams` in src/cuda/launch.rs.
struct BwdParams {
    const u16* q;
    const u16* k;
    const u16* v;
    const u16* o;
    const u16* dout;
    const float* lse;
    float* dpsum;      // D, laid out as lse
    float* dq_accum;   // [total_q tokens][hq][D] f32
    int* dq_sem;       // [batch][hq][num_m_blocks] (deterministic mode)
    u16* dq;
    u16* dk;
    u16* dv;
    const int* cu_seqlens_q;  // null for fixed-length batches
    const int* cu_seqlens_k;
    // Strides in elements: batch (0 for varlen), token, head.
    long long q_batch, q_row, q_head;
    long long k_batch, k_row, k_head;
    long long v_batch, v_row, v_head;
    long long o_batch, o_row, o_head;
    long long do_batch, do_row, do_head;
    long long dq_batch, dq_row, dq_head;
    long long dk_batch, dk_row, dk_head;
    long long dv_batch, dv_row, dv_head;
    long long lse_batch, lse_head;  // lse[b, h, i] at b·lse_batch + h·lse_head + q_start + i
    int batch, hq, hk, group;       // group = hq / hk
    int d;                          // head dim (a multiple of 8, <= FA_D)
    int sq, sk;                     // fixed-length sizes (varlen: the longest)
    int total_q, total_k;           // tokens: b·sq (fixed) or the packed count (varlen)
    int k_covered;                  // varlen: tokens of k in some sequence (cu_seqlens_k[batch])
    int num_m_blocks, num_n_blocks;
    int causal, window_left, window_right;
    float scale_log2;               // softmax scale · log2(e)
    float scale;                    // softmax scale
    int deterministic;
    DropoutParams dropout;
    ScoreMod mod;
    BlockMask block;
};

#if FA_BWD_WS
// The warp-specialised kernel's parameters: TMA descriptors of q, k, v and dout (tma.cuh; 4-d,
// [b][s][h][d], boxes of 64 columns by a tile's rows, 128-byte swizzle), then the rest. Field for
// field `BwdWsParams` in src/cuda/launch.rs.
struct alignas(128) BwdWsParams {
    TmaDesc q, k, v, dout;
    TmaDesc dq;  // dQaccum (f32) [b][sq][hq][FA_D]: boxes of 32 columns by a tile's rows, 128-byte swizzle
    BwdParams base;
    int* next_tile;  // the tile scheduler's counter, zero at launch
    // FA_BLOCKS with a block mask, outside deterministic mode: each key tile's query tiles with a
    // visible mask block for some query head of its group, written by flash_bwd_ws_tiles (below);
    // null otherwise. Row `tile` (ws_key_tile_coords' order), tile_stride ints: the count, then the
    // query tiles in order, each with BWD_TILE_FULL set where every block under it is on for
    // every head of the group, the interval rules hide nothing and every row is a real query.
    int* tile_list;
    long long tile_stride;
    // 0: key tiles in key_tile_coords' order; n > 0 (a causal rule): in chunks of n kv heads, each
    // chunk's first key tiles (the ones the most query tiles see) first (ws_key_tile_coords).
    int longest_first;
};
#define BWD_TILE_FULL (1 << 30)
#endif

// Position of flattened query token `tok` (b·sq + i for fixed length, the packed index for
// varlen): its batch entry and row, for the strided layouts and the lse index.
__device__ __forceinline__ void token_position(const BwdParams& p, int tok, int& b, int& i) {
    if (p.cu_seqlens_q) {
        b = 0;
        i = tok;
    } else {
        b = tok / p.sq;
        i = tok % p.sq;
    }
}

// The auxiliary kernels give each (token, head) row PREP_G threads, each on 8 columns (16 bytes
// of a 16-bit row, two float4 of a dQaccum row) at a time: PREP_G is the power of two at or above
// FA_D / 8, at most 32 (= `aux_row_threads` in src/cuda/launch.rs, which sizes their grids).
// (One warp a row, 4 bytes a lane: at d 64 the two ran at 1.2 and 2.0 TB/s on an H200, and dQaccum
// had a memset of its own; so, 3.8 TB/s with the zeroing and 4.0: docs/cuda-notes.md, session 53.)
#define PREP_G (FA_D > 128 ? 32 : FA_D > 64 ? 16 : 8)
static_assert(8 * PREP_G >= FA_D || PREP_G == 32, "a row's columns in one pass (below 256)");

// Sum over a row's PREP_G threads (aligned groups of a warp; every lane of the warp takes part).
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
    for (int s = PREP_G / 2; s > 0; s >>= 1) x += __shfl_xor_sync(0xffffffffu, x, s);
    return x;
}

// D_i = Σ_c dO[i, c] · O[i, c] (f32 sums of the dtype's products), and the row's dQaccum zeroed
// (the main kernel adds into it), PREP_G threads per (token, head).
extern "C" __global__ void __launch_bounds__(256) flash_bwd_prep(const BwdParams p) {
    const long long row = ((long long)blockIdx.x * 256 + threadIdx.x) / PREP_G;
    const int sub = threadIdx.x % PREP_G;
    // No early return: the shuffles below take every lane of the warp.
    const bool live = row < (long long)p.total_q * p.hq;
    float sum = 0.f;
    int b = 0, i = 0, h = 0;
    if (live) {
        const int tok = (int)(row / p.hq);
        h = (int)(row % p.hq);
        token_position(p, tok, b, i);
        const u16* o = p.o + b * p.o_batch + (long long)i * p.o_row + h * p.o_head;
        const u16* d = p.dout + b * p.do_batch + (long long)i * p.do_row + h * p.do_head;
        // 16-byte loads: rows and strides are 16-byte aligned (checked on the host), d % 8 == 0.
        for (int c = 8 * sub; c < p.d; c += 8 * PREP_G) {
            const uint4 ow = *reinterpret_cast<const uint4*>(o + c), dw = *reinterpret_cast<const uint4*>(d + c);
            const u32 ov[4] = {ow.x, ow.y, ow.z, ow.w}, dv[4] = {dw.x, dw.y, dw.z, dw.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                sum += to_f32<FA_BF16 != 0>(ov[k] & 0xffffu) * to_f32<FA_BF16 != 0>(dv[k] & 0xffffu);
                sum += to_f32<FA_BF16 != 0>(ov[k] >> 16) * to_f32<FA_BF16 != 0>(dv[k] >> 16);
            }
        }
        float* acc = p.dq_accum + row * FA_D;
        for (int c = 8 * sub; c < FA_D; c += 8 * PREP_G) {
            *reinterpret_cast<float4*>(acc + c) = make_float4(0.f, 0.f, 0.f, 0.f);
            *reinterpret_cast<float4*>(acc + c + 4) = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    sum = row_sum(sum);
    if (live && sub == 0) p.dpsum[b * p.lse_batch + h * p.lse_head + i] = sum;
}

// dq = scale · dQaccum in the dtype, PREP_G threads per (token, head); for varlen, the dk and dv
// rows of key tokens past the last sequence (no query sees them) are zeroed.
extern "C" __global__ void __launch_bounds__(256) flash_bwd_convert(const BwdParams p) {
    const long long row = ((long long)blockIdx.x * 256 + threadIdx.x) / PREP_G;
    const int sub = threadIdx.x % PREP_G;
    if (row < (long long)p.total_q * p.hq) {
        const int tok = (int)(row / p.hq), h = (int)(row % p.hq);
        int b, i;
        token_position(p, tok, b, i);
        const float* acc = p.dq_accum + row * FA_D;
        u16* dq = p.dq + b * p.dq_batch + (long long)i * p.dq_row + h * p.dq_head;
        for (int c = 8 * sub; c < p.d; c += 8 * PREP_G) {
            const float4 a = *reinterpret_cast<const float4*>(acc + c), e = *reinterpret_cast<const float4*>(acc + c + 4);
            const float s = p.scale;
            *reinterpret_cast<uint4*>(dq + c) = make_uint4(pack2<FA_BF16 != 0>(a.x * s, a.y * s), pack2<FA_BF16 != 0>(a.z * s, a.w * s),
                                                           pack2<FA_BF16 != 0>(e.x * s, e.y * s), pack2<FA_BF16 != 0>(e.z * s, e.w * s));
        }
    }
    if (p.cu_seqlens_q) {
        const long long tail = (long long)(p.total_k - p.k_covered) * p.hk;
        if (row < tail) {
            const int tok = p.k_covered + (int)(row / p.hk), h = (int)(row % p.hk);
            u16* dk = p.dk + (long long)tok * p.dk_row + h * p.dk_head;
            u16* dv = p.dv + (long long)tok * p.dv_row + h * p.dv_head;
            for (int c = 8 * sub; c < p.d; c += 8 * PREP_G) {
                *reinterpret_cast<uint4*>(dk + c) = make_uint4(0u, 0u, 0u, 0u);
                *reinterpret_cast<uint4*>(dv + c) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
    }
}

// dst[0] += a, dst[1] += b in global memory, without a return value; one vector reduction on
// sm_90 (8-byte aligned: dst is an even column of an f32 row), two scalar ones before.
__device__ __forceinline__ void red_add2(float* dst, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(dst), "f"(a) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(dst + 1), "f"(b) : "memory");
#endif
}

// What a main-kernel block works on: key tile n_block of kv head hkv of sequence b, and where that
// sequence's queries and keys start (varlen) with their counts.
struct BlockCoords {
    int n_block, b, hkv, q_start, k_start, sq, sk;
};

// Key tile `tile` in the grid's order: its index among its sequence's key tiles, the sequence,
// the kv head. Key tiles of one (sequence, kv head) are consecutive, in order: the deterministic
// mode's waits only ever point at earlier tiles (`run`: earlier blocks; `run_ws`: tiles taken
// earlier from its scheduler).
__device__ __forceinline__ void key_tile_coords(const BwdParams& p, int tile, int& n_block, int& b, int& hkv) {
    n_block = tile % p.num_n_blocks;
    const int bhk = tile / p.num_n_blocks;
    b = bhk / p.hk;
    hkv = bhk % p.hk;
}

#if FA_BWD_WS
// The warp-specialised kernel's scheduler order (`tile`: the counter's value, also the row of the
// tile list): key_tile_coords' without a chunk size; with one (`longest_first` = n, under a causal
// rule) the (sequence, kv head)s go in chunks of n, each chunk's key tiles n_block-major, so that
// the tiles the most query tiles see (the first) are taken first and the grid ends on its shortest
// ones, while a chunk's heads keep their queries' tiles in L2 together. A (sequence, kv head)'s
// tiles are still taken in order, the deterministic mode's waits still point at earlier tiles.
__device__ __forceinline__ void ws_key_tile_coords(const BwdParams& p, int chunk, int tile, int& n_block, int& b,
                                                   int& hkv) {
    if (chunk <= 0) {
        key_tile_coords(p, tile, n_block, b, hkv);
        return;
    }
    const int heads = p.batch * p.hk, per_chunk = chunk * p.num_n_blocks;
    const int c = tile / per_chunk, r = tile - c * per_chunk, h0 = c * chunk;
    const int n = min(chunk, heads - h0);  // the last chunk may be short
    n_block = r / n;
    const int bhk = h0 + (r - n_block * n);
    b = bhk / p.hk;
    hkv = bhk % p.hk;
}
#endif

// The block's coordinates, from a fresh read of the block index each call: the kernel re-derives
// them where it needs them (each work item, the epilogue) instead of holding them in registers
// across the work loop, where they are what spills.
__device__ __forceinline__ BlockCoords block_coords(const BwdParams& p) {
    int bid;
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(bid));
    BlockCoords c;
    key_tile_coords(p, bid, c.n_block, c.b, c.hkv);
    c.q_start = 0;
    c.k_start = 0;
    c.sq = p.sq;
    c.sk = p.sk;
    if (p.cu_seqlens_q) {
        c.q_start = p.cu_seqlens_q[c.b];
        c.sq = p.cu_seqlens_q[c.b + 1] - c.q_start;
        c.k_start = p.cu_seqlens_k[c.b];
        c.sk = p.cu_seqlens_k[c.b + 1] - c.k_start;
    }
    return c;
}


// A compile-time bool as a type, to instantiate a generic lambda for each value.
template <bool B>
struct BoolC {
    static constexpr bool value = B;
};

template <int D, int BR, int WARPS, bool BF16>
struct FlashBwd {
    // Tiles wider than 128 (d 136-256): a warp's dK and dV rows over the whole width would take
    // 256 registers. There two warps (Hopper: two warpgroups) share the same keys (SPLIT = 2):
    // each computes Sᵀ and dPᵀ for one half of the query tile over the whole width, and holds dK
    // and dV for one half of the columns; Pᵀ' and dSᵀ meet in shared memory, the A operands of dV
    // and dK after a barrier. (FlashAttention-2 splits its d 256 backward over 8 warps alike.)
    static constexpr int SPLIT = D > 128 ? 2 : 1;  // = BwdVariant::split (kernels.rs)
    static constexpr int KEY_WARPS = WARPS / SPLIT;  // warps with distinct keys
    static constexpr int BC = 16 * KEY_WARPS;  // keys per block, 16 per warp
    static constexpr int THREADS = WARPS * 32;
    static constexpr int NT = BR / 8;      // n-tiles of the query tile
    static constexpr int NTW = NT / SPLIT;  // n-tiles of a warp's Sᵀ (queries)
    static constexpr int DA = D / SPLIT;    // columns of a warp's dK, dV
    static constexpr int DT = DA / 8;       // n-tiles of a warp's dK, dV (head dim)
    static_assert(WARPS % SPLIT == 0 && NTW % 2 == 0 && DA % 16 == 0, "whole halves");
    static constexpr int KV_BYTES = BC * D * 2;
    static constexpr int Q_BYTES = BR * D * 2;
    static constexpr int DS_BYTES = BC * BR * 2;
    static constexpr int ROW_BYTES = BR * 4;
    static constexpr int P_BYTES = SPLIT > 1 ? BC * BR * 2 : 0;  // Pᵀ (SPLIT), a buffer
    // Query slices of the dPᵀ / dSᵀ / dK phase: more slices, fewer live dPᵀ registers, more
    // reads of V. An experiment knob (FA_PARTS, default 1): 2 measured no faster (v3 notes).
    static constexpr int PARTS = FA_PARTS;
    static_assert(NTW % (2 * PARTS) == 0, "parts of whole 16-query pairs");
    // Hopper with two warpgroups: dQ = dS K of an item is issued and left in flight; the next
    // item waits for it (and adds it to dQaccum) after issuing its own Sᵀ. dSᵀ is then
    // double-buffered. (One warpgroup a block runs two blocks per multiprocessor, whose shared
    // memory leaves no room for the second buffer.)
    // (Not with SPLIT, whose dQ piece of 128 columns would hold 64 more registers across the item.)
    // (Not in the warp-specialised kernel, whose consumers have 240 registers: holding dQ across
    // the item spills there.)
    static constexpr bool DEFER_DQ =
        FA_WGMMA != 0 && WARPS == 8 && SPLIT == 1 && FA_BWD_WS == 0;  // = BwdVariant::defers_dq
    // The warp-specialised kernel (FA_BWD_WS, run_ws): the WARPS consumer warps run the items as
    // `run` does; a producer warpgroup more loads K, V and each item's Q, dO by TMA and its lse, D
    // rows into a ring of STAGES buffers (2 in `run`), each with a "full" and an "empty" mbarrier.
    static constexpr bool WS = FA_BWD_WS != 0;
    static_assert(!WS || (FA_WGMMA != 0 && WARPS == 8 && D % 64 == 0 && (SPLIT == 1 || !FA_BLOCKS)),
                  "the warp-specialised kernel: two consumer warpgroups, tiles of whole 64-column TMA boxes "
                  "(split: no block-sparse mask)");
    static constexpr int STAGES = WS ? FA_BWD_STAGES : 2;
    // Each product's operand descriptors built once and advanced by a 32-bit add per k-step
    // (`desc_plus`), not rebuilt from the address each step, in the warp-specialised kernel
    // (with the consumers' warp index made uniform, `uwarp`, they stay in uniform registers).
    // The split kernels (d > 128) always build them so; the non-warp-specialised kernels measured
    // slower with it in session 33 (docs/cuda-notes.md).
    static constexpr bool DESC_PLUS = WS;
    static_assert(STAGES >= 2, "a ring of at least two buffers");
    static constexpr int CONSUMERS = THREADS;  // the threads that run the items
    // K, V | Q[STAGES], dO[STAGES] | dSᵀ[DS_BUFS] | Pᵀ[P_BUFS] (SPLIT) | lse[STAGES], D[STAGES]
    // | WS: the f32 dQ tile (D / 32 column blocks of BR rows of 128 bytes, the 128-byte swizzle:
    // the TMA's boxes), the mbarriers (K and V full and empty; each stage's full and empty; dQ
    // full and empty).
    // The warp-specialised split kernel (d > 128) has no room for a dQ tile (64 KiB at d 256 next
    // to 192 KiB of K, V and the ring): its consumers add their dQ pieces with `red`, as `run`
    // does, and its Pᵀ alternates between two buffers like dSᵀ (no barrier ends an item).
    // With the dQ tile (outside deterministic mode) `item` itself ends with the barrier around
    // dSᵀ and the dQ product, issued before the wait for dV's and dK's so that it queues behind
    // dK's on the tensor cores (1.01-1.08x the backward with dQ issued after that wait, H200,
    // session 56), and stores the piece to the tile.
    static constexpr bool DQ_TILE = WS && SPLIT == 1;
    // 80 queries a tile (FlashAttention-3's shape for d 128 without a causal rule): a quarter more
    // work an item for the same per-item costs (turns, waits, barriers, the dQ hand-off). dQ = dS K
    // then has 80 rows, which no warpgroup product's M takes: it is computed transposed, dQᵀ = Kᵀ
    // dSᵀ (M: the warpgroup's 64 columns of the head dim; N: the 80 queries), with dS stored
    // [query][key] (`store_ds_t`: each warpgroup's 64 keys one 128-byte column block of 80 rows,
    // the K-major B operand of an n80 product), and stored transposed to the dQ tile
    // (`issue_dq_t`, `store_dq_t`). The warp-specialised kernel at d 128 without optional paths
    // only.
    static constexpr bool SWAP_DQ = BR % 64 != 0;
    static_assert(!SWAP_DQ || (WS && BR == 80 && D == 128 && SPLIT == 1 && FA_EXTRAS == 0),
                  "80 queries a tile: the warp-specialised d 128 kernel without optional paths");
    // Where the lse and D rows sit: after the dQ tile where the tile would not start on the
    // swizzle's 1024-byte period behind them (SWAP_DQ: 2 · 2 · 320 bytes), else before it.
    static constexpr bool ROWS_LAST = SWAP_DQ;
    // The warp-specialised kernel at D = 128 on 64 queries writes dK and dV through shared memory
    // (`store_rows_staged`): 1.03-1.12x the backward with store_rows at 512-2k, H200, session 57
    // (the short items of a tile that few query tiles see are where the epilogue shows). Not at 80
    // queries (long problems): 0.99x there from 4k. At D = 64 (2 KiB a warp): 1.02-1.07x at
    // 512-2k, 1.01-1.02x at 4k, level at 16k (session 57).
    static constexpr bool STAGED_DKV = WS && SPLIT == 1 && (D == 64 || D == 128) && !SWAP_DQ;
    static constexpr int DQ_BYTES = DQ_TILE ? BR * D * 4 : 0;
    static constexpr int P_BUFS = WS ? 2 : 1;
    static constexpr int BAR_BYTES = WS ? 8 * (4 + 2 * STAGES) : 0;
    // dSᵀ buffers: two where an item's dSᵀ is written before every consumer is past the previous
    // item's dQ product (DEFER_DQ, and the warp-specialised kernel, with no barrier between them).
    static constexpr int DS_BUFS = DEFER_DQ || WS ? 2 : 1;
    static_assert(!DQ_TILE ||
                      (2 * KV_BYTES + 2 * STAGES * Q_BYTES + DS_BUFS * DS_BYTES + (ROWS_LAST ? 0 : 2 * STAGES * ROW_BYTES)) % 1024 == 0,
                  "the dQ tile (after K, V, the ring, dSᵀ and the rows) starts on the swizzle's 1024-byte period");
    static constexpr int SMEM_BYTES = 2 * KV_BYTES + 2 * STAGES * Q_BYTES + DS_BUFS * DS_BYTES + P_BUFS * P_BYTES +
                                      2 * STAGES * ROW_BYTES + DQ_BYTES + BAR_BYTES;  // = BwdVariant::smem_bytes
    static_assert(!WS || SMEM_BYTES + 1024 <= 232448 - 128, "one block a multiprocessor, with the static slots");
    static_assert(BR % 64 == 0 || SWAP_DQ, "dSᵀ rows are swizzled 16-byte chunks: BR >= 64");
    // Hopper: Sᵀ and dPᵀ issued together, dV left in flight under dSᵀ, at 64 queries per tile.
    // With 128 (or with the extras at d 128, or at 80 queries: 48-96 bytes), that many live
    // registers spill, so dPᵀ is issued once dV (waited for) has freed Pᵀ's registers. (At 64
    // queries, d 128, the warp-specialised kernel measured level either way, H200, session 57.)
    static constexpr bool SDP_TOGETHER = FA_WGMMA != 0 && BR == 64 && !(FA_EXTRAS != 0 && D >= 128);
    // Tiles in the layout the products read: wgmma's, or ldmatrix's swizzle.
    static constexpr bool GMMA = FA_WGMMA != 0;
#if FA_WGMMA
    // A warpgroup (4 warps, 64 keys) issues each product for its keys: Sᵀ and dPᵀ as
    // m64 x BR / PARTS, dV and dK as m64 x D. Tiles in the wgmma layout (GMMA).
    static_assert(WARPS % 4 == 0, "whole warpgroups");
    static_assert(SPLIT == 1 || WARPS == 8, "SPLIT: two warpgroups on the same 64 keys");
    static constexpr int WGS = WARPS / 4;
    // dQ = dS K (BR x D over the BC keys): warpgroup w takes 64 query rows and NQ columns.
    static constexpr int NSPLIT = WGS / (BR / 64);
    static_assert(NSPLIT >= 1 && WGS % (BR / 64) == 0, "every warpgroup one dQ piece");
    static constexpr int NQ = D / NSPLIT;
    // A piece narrower than a 64-column block starts its B descriptor inside the 128-byte rows:
    // the swizzle is a function of the address, so the start moves by 2 bytes a column.
    static_assert(NQ % 32 == 0 && (NQ % 64 == 0 || NSPLIT == 2), "dQ pieces of 32-column halves or whole blocks");
#endif

    // Where chunk `chunk` of row `row` of the dSᵀ tile ([key][query]) lives.
    static __device__ __forceinline__ u32 ds_offset(int row, int chunk) {
#if FA_WGMMA
        return gmma_offset<BC>(row, chunk);
#else
        return swizzled_offset<BR>(row, chunk);
#endif
    }

    // A barrier of the threads that run the items: the block (`run`) or the consumer warpgroups
    // (`run_ws`: named barrier 1; the producer warpgroup never takes part).
    static __device__ __forceinline__ void consumers_sync() {
#if FA_BWD_WS
        named_sync(1, CONSUMERS);
#else
        __syncthreads();
#endif
    }

    // Copies BR floats starting at g (rows >= rows_valid zero-filled) with 4-byte cp.async.
    static __device__ __forceinline__ void load_row_floats(u32 dst, const float* g, int rows_valid, int tid) {
        for (int r = tid; r < BR; r += THREADS) {
            bool valid = r < rows_valid;
            const float* src = valid ? g + r : g;
            int n = valid ? 4 : 0;
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst + 4 * r), "l"(src), "r"(n));
        }
    }

    static __device__ __forceinline__ float ld_shared_f32(u32 addr) {
        float x;
        asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x) : "r"(addr));
        return x;
    }

    // Sᵀ = K Qᵀ for this warp's 16 keys and the N · 8 queries from query q0 (raw dot products);
    // q0 is a multiple of 16 (a compile-time constant once the callers' loops unroll).
    // (wgmma: WAIT false leaves the product in flight; the caller waits and fences s.)
    template <int N, bool WAIT = true>
    static __device__ __forceinline__ void scores_t(FragC (&s)[N], u32 sK, u32 sQ, int q0, int warp_key, int lane) {
        static_assert(N % 2 == 0 && N <= NT, "whole 16-query pairs inside the tile");
#if FA_WGMMA
        // The warpgroup's 64 keys start at row warp_key & ~63 of the key tile.
        const u32 a0 = sK + (u32)((warp_key & ~63) * 128), b0 = sQ + (u32)(q0 * 128);
        fence_operands(s);
        wgmma_fence();
        if constexpr (SPLIT > 1 || DESC_PLUS) {
            const u64 da0 = gmma_desc(a0, 16, 1024), db0 = gmma_desc(b0, 16, 1024);
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk)
                wgmma_ss<8 * N>(s, desc_plus(da0, (u32)((kk / 4) * BC * 128 + (kk % 4) * 32)),
                                desc_plus(db0, (u32)((kk / 4) * BR * 128 + (kk % 4) * 32)), kk > 0);
        } else {
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u64 da = gmma_desc(a0 + (u32)((kk / 4) * BC * 128 + (kk % 4) * 32), 16, 1024);
                const u64 db = gmma_desc(b0 + (u32)((kk / 4) * BR * 128 + (kk % 4) * 32), 16, 1024);
                wgmma_ss<8 * N>(s, da, db, kk > 0);
            }
        }
        wgmma_commit();
        if (WAIT) {
            wgmma_wait<0>();
            fence_operands(s);
        }
#else
#pragma unroll
        for (int nt = 0; nt < N; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt].x[e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            FragA ka = load_a<D>(sK, warp_key, kk, lane);
#pragma unroll
            for (int np = 0; np < N / 2; ++np) {
                FragB b0, b1;
                load_b_pair<D>(sQ, q0 + 16 * np, kk, lane, b0, b1);
                mma<BF16>(s[2 * np], ka, b0);
                mma<BF16>(s[2 * np + 1], ka, b1);
            }
        }
#endif
    }

    // acc += A · X over the 16 · K queries from query q0, where the warp's 16-key fragment tiles
    // `a` (keys × queries) are the A operand and X (BR × D, row-major in shared memory) the B
    // operand: dV += Pᵀ dO, dK += dSᵀ Q.
    // (wgmma: WAIT false leaves the product in flight; the caller waits and fences acc and a.)
    template <int K, bool WAIT = true>
    static __device__ __forceinline__ void accumulate_t(FragC (&acc)[DT], const FragA (&a)[K], u32 sX, int q0,
                                                        int lane) {
        static_assert(K <= BR / 16, "inside the tile");
#if FA_WGMMA
        // X ([query][d], rows q0..) is the MN-major B operand: transposed by the instruction.
#pragma unroll
        for (int kk = 0; kk < K; ++kk) fence_operands(const_cast<FragA&>(a[kk]));
        fence_operands(acc);
        wgmma_fence();
        if constexpr (DESC_PLUS) {
            const u64 db0 = gmma_desc(sX + (u32)(q0 * 128), BR * 128, 1024);
#pragma unroll
            for (int kk = 0; kk < K; ++kk) wgmma_rs<D>(acc, a[kk], desc_plus(db0, (u32)(16 * kk * 128)));
        } else {
#pragma unroll
            for (int kk = 0; kk < K; ++kk)
                wgmma_rs<D>(acc, a[kk], gmma_desc(sX + (u32)((q0 + 16 * kk) * 128), BR * 128, 1024));
        }
        wgmma_commit();
        if (WAIT) {
            wgmma_wait<0>();
            fence_operands(acc);
#pragma unroll
            for (int kk = 0; kk < K; ++kk) fence_operands(const_cast<FragA&>(a[kk]));
        }
#else
#pragma unroll
        for (int kk = 0; kk < K; ++kk) {
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                FragB b0, b1;
                load_b_pair_trans<D>(sX, q0 + 16 * kk, dp, lane, b0, b1);
                mma<BF16>(acc[2 * dp], a[kk], b0);
                mma<BF16>(acc[2 * dp + 1], a[kk], b1);
            }
        }
#endif
    }

    // SPLIT: acc += A · X[:, c_off .. c_off + DA), where A is this warp's 16 keys x BR queries of
    // a [key][query] tile in shared memory (Pᵀ' or dSᵀ, written by both warps of the pair before a
    // barrier) and X (BR x D, row-major) the B operand: dV += Pᵀ' dO, dK += dSᵀ Q. The columns
    // past the head dim are zeros in X; their products are wasted, never stored.
    // (wgmma: one m64 x DA product per 16 queries, both operands from shared memory, committed and
    // left in flight: the caller waits, then fences acc.)
    static __device__ __forceinline__ void accumulate_split(FragC (&acc)[DT], u32 sA, u32 sX, int warp_key, int c_off,
                                                            int lane) {
        static_assert(SPLIT > 1, "the split kernels'");
#if FA_WGMMA
        // A = the [key][query] tile (K-major; the warpgroup's 64 keys are the tile's), B = X's
        // column blocks c_off / 64 .. ([query][d]: MN-major, transposed by the instruction).
        const u64 da0 = gmma_desc(sA, 16, 1024), db0 = gmma_desc(sX + (u32)((c_off / 64) * BR * 128), BR * 128, 1024);
        fence_operands(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BR / 16; ++kk)
            wgmma_ss<DA, 0, 1>(acc, desc_plus(da0, (u32)(kk * 32)), desc_plus(db0, (u32)(kk * 16 * 128)), 1);
        wgmma_commit();
#else
        // c_off is a multiple of 64 columns (eight chunks): the half starts on the swizzle's phase.
        const u32 sXh = sX + (u32)(2 * c_off);
#pragma unroll
        for (int kk = 0; kk < BR / 16; ++kk) {
            const FragA a = load_a<BR>(sA, warp_key, kk, lane);
#pragma unroll
            for (int dp = 0; dp < DA / 16; ++dp) {
                FragB b0, b1;
                load_b_pair_trans<D>(sXh, 16 * kk, dp, lane, b0, b1);
                mma<BF16>(acc[2 * dp], a, b0);
                mma<BF16>(acc[2 * dp + 1], a, b1);
            }
        }
#endif
    }

    // This warp's 16 keys x 16·K queries of A fragments (Pᵀ' or dSᵀ, n-tiles of 8 queries from
    // query column q0 of the tile) into a [key][query] tile in shared memory, swizzled (`ds_offset`).
    // (g and t are the caller's: derived from the opaque lane here they cost registers.)
    template <int K>
    static __device__ __forceinline__ void store_t(u32 sA, const FragA (&a)[K], int q0, int warp_key, int lane, int g,
                                                   int t) {
#if FA_WGMMA
        // One stmatrix per 16 x 16 fragment: matrix i is rows 8·(i & 1) of the warp's
        // 16 keys at query chunk 2·kk + (i >> 1); lanes 8i .. 8i + 7 address its rows.
        const int i = lane >> 3, row = warp_key + (lane & 7) + 8 * (i & 1);
#pragma unroll
        for (int kk = 0; kk < K; ++kk) {
            const int chunk = q0 / 8 + 2 * kk + (i >> 1);
            stmatrix_x4(sA + ds_offset(row, chunk), a[kk].x[0], a[kk].x[1], a[kk].x[2], a[kk].x[3]);
        }
#else
#pragma unroll
        for (int kk = 0; kk < K; ++kk)
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = warp_key + g + 8 * r, chunk = q0 / 8 + 2 * kk + h2;
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sA + ds_offset(row, chunk) + 4 * t),
                                 "r"(a[kk].x[2 * h2 + r]));
                }
#endif
    }

#if FA_WGMMA
    // SWAP_DQ: this warp's 16 keys x 16·K queries of dSᵀ fragments (from query q0) into the dS
    // tile stored [query][key]: the warpgroup's 64 keys are column block warp_key / 64 (BR rows of
    // 128 bytes), key chunk c of query row q at (c ^ (q % 8)) · 16. One transposing stmatrix per
    // 16 x 16 fragment: matrix i (keys 8·(i & 1) of the warp's 16, queries 8·(i >> 1) of the
    // fragment's 16) lands as 8 query rows of one 16-byte key chunk, lanes 8i .. 8i + 7 addressing
    // them.
    template <int K>
    static __device__ __forceinline__ void store_ds_t(u32 sDS, const FragA (&a)[K], int q0, int warp_key, int lane) {
        const int i = lane >> 3, r = lane & 7;
        const int chunk = (warp_key % 64) / 8 + (i & 1);
        const u32 base = sDS + (u32)((warp_key / 64) * BR * 128 + ((chunk ^ r) * 16));
#pragma unroll
        for (int kk = 0; kk < K; ++kk) {
            const int q = q0 + 16 * kk + 8 * (i >> 1) + r;  // (q % 8 = r)
            stmatrix_x4_trans(base + (u32)(q * 128), a[kk].x[0], a[kk].x[1], a[kk].x[2], a[kk].x[3]);
        }
    }
#endif

    // Keep bits of this thread's Sᵀ elements for query head stream bh: bit (4·nt + 2·r + c) is
    // key row g + 8r, query column 8·nt + 2t + c (q0 a multiple of 16, k0 of 16). In philox.cuh's
    // layout the call of queries {16a + 2t + c, + 8} and keys with (k % 8) / 2 = g / 2 in this
    // 32-key block holds four bytes of this thread (its two keys, the two queries) and four of
    // lane g ^ 1 (the same queries, keys one apart): lane e = g & 1 draws the calls of c = e, keeps
    // its own bits and packs its partner's, and the pair swaps those in one shuffle per 32 bits:
    // one call per eight elements. Every lane of the warp must call it.
    static __device__ __forceinline__ void keep_bits(u32 (&bits)[(NTW + 7) / 8], const DropoutParams& dp, u32 bh,
                                                     int q0, int k0, int lane) {
        static_assert(NTW % 2 == 0, "whole 16-query blocks");
        constexpr int NW = (NTW + 7) / 8;
        const int g = lane >> 2, t = lane & 3, e = g & 1;
        const u32 c0 = 4u * ((u32)k0 >> 5) + (u32)(g >> 1);
        const bool upper = (k0 & 16) != 0;  // keys 16 .. 31 of the block: words 1 and 3
        u32 mine[NW], theirs[NW];
#pragma unroll
        for (int k = 0; k < NW; ++k) mine[k] = theirs[k] = 0u;
#pragma unroll
        for (int a = 0; a < NTW / 2; ++a) {
            const Philox4 w = dropout_call(dp, bh, c0, 8u * (((u32)q0 >> 4) + (u32)a) + 2u * (u32)t + (u32)e);
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {  // query row 16a + 2t + e + 8·hf: n-tile 2a + hf
                const u32 word = upper ? w.x[2 * hf + 1] : w.x[2 * hf];
#pragma unroll
                for (int r = 0; r < 2; ++r) {  // key g + 8r: byte 2r + (g & 1) of the word
                    // Bit 4·nt + 2r + c with c = e: `base` (even, known at compile time) + e.
                    const int base = 4 * (2 * a + hf) + 2 * r;
                    const u32 mine_u = (word >> (16 * r + 8 * e)) & 0xffu;
                    const u32 theirs_u = (word >> (16 * r + 8 * (e ^ 1))) & 0xffu;
                    mine[base / 32] |= (u32)(mine_u >= dp.threshold) << (base % 32 + e);
                    theirs[base / 32] |= (u32)(theirs_u >= dp.threshold) << (base % 32 + e);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < NW; ++k) bits[k] = mine[k] | __shfl_xor_sync(0xffffffffu, theirs[k], 4);
    }

    static __device__ __forceinline__ bool kept(const u32 (&bits)[(NTW + 7) / 8], int nt, int r, int c) {
        int bit = 4 * nt + 2 * r + c;
        return (bits[bit / 32] >> (bit % 32)) & 1u;
    }

    // Adds the dQ of query tile m of head h (batch entry b, whose sequence starts at token
    // q_start in varlen) to dQaccum by `add(acc, acc_row, rows_valid)`: in deterministic mode in
    // key-tile order, after waiting for this key tile's turn on (b, h, m). Every thread of the
    // block calls it.
    template <class Add>
    static __device__ __forceinline__ void add_dq_in_order(const BwdParams& p, const Visibility& vis, int b, int h,
                                                           int m, int q_start, int n_block, int tid, Add add) {
        const int row0 = m * BR, rows_valid = min(BR, vis.sq - row0);
        // dQaccum rows are flattened tokens: b·sq + i (fixed length) or the packed index (varlen).
        const long long acc_tok = p.cu_seqlens_q ? (long long)q_start + row0 : (long long)b * p.sq + row0;
        float* acc = p.dq_accum + (acc_tok * p.hq + h) * D;
        if (p.deterministic) {
            int lo, hi;
            vis.key_range(row0, row0 + rows_valid, lo, hi);
            const int rank = n_block - lo / BC;
            int* sem = p.dq_sem + ((long long)b * p.hq + h) * p.num_m_blocks + m;
            if (tid == 0) {
                int seen;
                do {
                    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(sem) : "memory");
                } while (seen != rank);
            }
            consumers_sync();
            add(acc, (long long)p.hq * D, rows_valid);
            __threadfence();
            consumers_sync();
            if (tid == 0) asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(sem), "r"(rank + 1) : "memory");
        } else {
            add(acc, (long long)p.hq * D, rows_valid);
        }
    }

#if FA_WGMMA
    // Issues dQ = dS K for this warpgroup's piece as one wgmma group: query rows m0 .. m0 + 63,
    // columns n0 .. n0 + NQ - 1. A = dS read from dSᵀ ([key][query], MN-major: transposed), B = K
    // ([key][d], MN-major: transposed).
    static __device__ __forceinline__ void issue_dq(FragC (&d)[NQ / 8], u32 sDS, u32 sK, int warp) {
        const int wg = warp / 4, m0 = 64 * (wg / NSPLIT), n0 = NQ * (wg % NSPLIT);
        fence_operands(d);
        wgmma_fence();
        if constexpr (SPLIT > 1 || DESC_PLUS) {
            const u64 da0 = gmma_desc(sDS + (u32)((m0 / 64) * BC * 128), BC * 128, 1024);
            const u64 db0 = gmma_desc(sK + (u32)((n0 / 64) * BC * 128 + (n0 % 64) * 2), BC * 128, 1024);
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk)
                wgmma_ss<NQ, 1, 1>(d, desc_plus(da0, (u32)(kk * 16 * 128)), desc_plus(db0, (u32)(kk * 16 * 128)), kk > 0);
        } else {
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) {
                const u64 da = gmma_desc(sDS + (u32)((m0 / 64) * BC * 128 + kk * 16 * 128), BC * 128, 1024);
                const u64 db =
                    gmma_desc(sK + (u32)((n0 / 64) * BC * 128 + (n0 % 64) * 2 + kk * 16 * 128), BC * 128, 1024);
                wgmma_ss<NQ, 1, 1>(d, da, db, kk > 0);
            }
        }
        wgmma_commit();
    }

    // Adds this warp's rows of a completed dQ piece to the f32 accumulator (rows past the
    // sequence end and padding columns skipped).
    static __device__ __forceinline__ void add_dq(const FragC (&d)[NQ / 8], float* acc, long long acc_row,
                                                  int rows_valid, int head_dim, int warp, int lane) {
        const int g = lane >> 2, t = lane & 3;
        const int wg = warp / 4, m0 = 64 * (wg / NSPLIT), n0 = NQ * (wg % NSPLIT);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = m0 + 16 * (warp % 4) + g + 8 * r;
            if (row < rows_valid) {
                float* dst = acc + row * acc_row + n0 + 2 * t;
                if (n0 + NQ <= head_dim) {  // every column real: straight-line adds
#pragma unroll
                    for (int n = 0; n < NQ / 8; ++n) red_add2(dst + 8 * n, d[n].x[2 * r], d[n].x[2 * r + 1]);
                } else {
#pragma unroll
                    for (int n = 0; n < NQ / 8; ++n)
                        if (n0 + 8 * n < head_dim) red_add2(dst + 8 * n, d[n].x[2 * r], d[n].x[2 * r + 1]);
                }
            }
        }
    }
    static constexpr int DQ_FRAGS = NQ / 8;

    // SWAP_DQ: issues dQᵀ = Kᵀ dSᵀ for this warpgroup's piece as one wgmma group: head-dim
    // columns 64·wg .. + 63 (M) by the tile's BR queries (N), over the BC keys (K). A = Kᵀ (K
    // [key][d]: MN-major, its column block wg), B = dSᵀ from the dS tile ([query][key], `store_ds_t`:
    // K-major, as Q is to Sᵀ's product).
    static __device__ __forceinline__ void issue_dq_t(FragC (&d)[BR / 8], u32 sDS, u32 sK, int warp) {
        static_assert(SWAP_DQ, "the transposed piece");
        const int wg = warp / 4;
        fence_operands(d);
        wgmma_fence();
        const u64 da0 = gmma_desc(sK + (u32)(wg * BC * 128), BC * 128, 1024), db0 = gmma_desc(sDS, 16, 1024);
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
            wgmma_ss<BR, 1, 0>(d, desc_plus(da0, (u32)(kk * 16 * 128)),
                               desc_plus(db0, (u32)((kk / 4) * BR * 128 + (kk % 4) * 32)), kk > 0);
        wgmma_commit();
    }

    // SWAP_DQ: adds this warp's part of a completed dQᵀ piece to the f32 accumulator, one `red` an
    // element (queries past the sequence end and padding columns skipped): deterministic mode's
    // path.
    static __device__ __forceinline__ void add_dq_t(const FragC (&d)[BR / 8], float* acc, long long acc_row,
                                                    int rows_valid, int head_dim, int warp, int lane) {
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int col = 64 * (warp / 4) + 16 * (warp % 4) + g + 8 * r;
            if (col >= head_dim) continue;
#pragma unroll
            for (int n = 0; n < BR / 8; ++n)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int q = 8 * n + 2 * t + c;
                    if (q < rows_valid)
                        asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(acc + q * acc_row + col), "f"(d[n].x[2 * r + c])
                                     : "memory");
                }
        }
    }

    // The previous item's dQ piece, complete (the caller waited for it): added to dQaccum, in
    // key-tile order in deterministic mode. The previous item's (head, tile) are in shared memory
    // at `info` + 20 and + 24 (tile -1: there is none). Every thread of the block calls it.
    static __device__ __forceinline__ void flush_dq(const BwdParams& p, const FragC (&dq)[NQ / 8], u32 info,
                                                    const Visibility& vis, int n_block, int tid, int warp, int lane) {
        const int m = ld_shared_s32(info + 24);
        if (m < 0) return;
        const int h = ld_shared_s32(info + 20), b = ld_shared_s32(info), q_start = ld_shared_s32(info + 4);
        add_dq_in_order(p, vis, b, h, m, q_start, n_block, tid, [&](float* acc, long long acc_row, int rows_valid) {
            add_dq(dq, acc, acc_row, rows_valid, p.d, warp, lane);
        });
    }
#else
    static constexpr int DQ_FRAGS = 1;  // no dQ held across items
#endif

    // dQ_tile += dS K for every 16-query × 32-column unit this warp takes, added to the f32
    // accumulator in global memory (rows past the sequence end skipped).
    static __device__ __forceinline__ void accumulate_dq(u32 sDS, u32 sK, float* acc, long long acc_row,
                                                         int rows_valid, int head_dim, int warp, int lane) {
#if FA_WGMMA
        if constexpr (SWAP_DQ) {
            FragC d[BR / 8];
            issue_dq_t(d, sDS, sK, warp);
            wgmma_wait<0>();
            fence_operands(d);
            add_dq_t(d, acc, acc_row, rows_valid, head_dim, warp, lane);
            return;
        }
        const int wg = warp / 4, n0 = NQ * (wg % NSPLIT);
        if (n0 >= head_dim) return;  // padding columns only: dQ there is never read
        FragC d[NQ / 8];
        issue_dq(d, sDS, sK, warp);
        wgmma_wait<0>();
        fence_operands(d);
        add_dq(d, acc, acc_row, rows_valid, head_dim, warp, lane);
#else
        const int g = lane >> 2, t = lane & 3;
        constexpr int UNITS = (BR / 16) * (D / 32);
        for (int u = warp; u < UNITS; u += WARPS) {
            const int m0 = 16 * (u / (D / 32)), c0 = 32 * (u % (D / 32));
            if (c0 >= head_dim) continue;  // padding columns: dQ there is never read
            FragC d[4];
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) d[n].x[e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) {
                // A = dS[m0.., 16 kk..] from dSᵀ stored [key][query]: transposed ldmatrix.
                FragA a;
                int q = lane >> 3;
                int key = 16 * kk + (lane & 7) + ((q >> 1) << 3);
                int chunk = m0 / 8 + (q & 1);
                ldmatrix_x4_trans(sDS + swizzled_offset<BR>(key, chunk), a.x[0], a.x[1], a.x[2], a.x[3]);
#pragma unroll
                for (int dp = 0; dp < 2; ++dp) {
                    FragB b0, b1;
                    load_b_pair_trans<D>(sK, 16 * kk, c0 / 16 + dp, lane, b0, b1);
                    mma<BF16>(d[2 * dp], a, b0);
                    mma<BF16>(d[2 * dp + 1], a, b1);
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                int row = m0 + g + 8 * r;
                if (row < rows_valid) {
                    float* dst = acc + row * acc_row + c0 + 2 * t;
                    if (c0 + 32 <= head_dim) {  // every column real: straight-line adds
#pragma unroll
                        for (int n = 0; n < 4; ++n) red_add2(dst + 8 * n, d[n].x[2 * r], d[n].x[2 * r + 1]);
                    } else {
#pragma unroll
                        for (int n = 0; n < 4; ++n)
                            if (c0 + 8 * n < head_dim) red_add2(dst + 8 * n, d[n].x[2 * r], d[n].x[2 * r + 1]);
                    }
                }
            }
        }
#endif
    }

#if FA_WGMMA
    // The bytes of a warp's 16 rows of dK or dV as 16-bit values (store_rows_staged's stage).
    static constexpr int STAGE_BYTES = 16 * D * 2;
    // store_rows through `stage`, STAGE_BYTES of shared memory no other warp touches meanwhile
    // (SPLIT == 1, D = 64 or 128): the warp's 16 rows as 16-bit values by stmatrix (rows of 2·D
    // bytes, 16-byte chunk c of row r at (c ^ (r % 8)) · 16: an 8-row matrix's rows in distinct
    // banks), then read back a chunk a lane and stored 16 bytes at a time, D / 8 lanes a row:
    // whole 128-byte lines where store_rows's 4-byte stores leave each line to eight instructions.
    static __device__ __forceinline__ void store_rows_staged(const FragC (&acc)[DT], float mul, u16* g,
                                                             long long row_stride, u32 stage, int warp_key,
                                                             int keys_valid, int head_dim, int lane) {
        static_assert(SPLIT == 1 && (D == 64 || D == 128), "a warp's 16 rows of 64 or 128 columns");
        constexpr int ROWB = 2 * D, CHUNKS = D / 8;
        const int i = lane >> 3, row = (lane & 7) + 8 * (i & 1);
#pragma unroll
        for (int j = 0; j < DT / 2; ++j) {
            const int chunk = 2 * j + (i >> 1);
            const u32 a0 = pack2<BF16>(acc[2 * j].x[0] * mul, acc[2 * j].x[1] * mul);
            const u32 a1 = pack2<BF16>(acc[2 * j].x[2] * mul, acc[2 * j].x[3] * mul);
            const u32 a2 = pack2<BF16>(acc[2 * j + 1].x[0] * mul, acc[2 * j + 1].x[1] * mul);
            const u32 a3 = pack2<BF16>(acc[2 * j + 1].x[2] * mul, acc[2 * j + 1].x[3] * mul);
            stmatrix_x4(stage + (u32)(row * ROWB + ((chunk ^ (row & 7)) * 16)), a0, a1, a2, a3);
        }
        __syncwarp();
        const int chunk = lane % CHUNKS;
#pragma unroll
        for (int k = 0; k < 16 * CHUNKS / 32; ++k) {
            const int r = (32 / CHUNKS) * k + lane / CHUNKS;
            uint4 v;
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(stage + (u32)(r * ROWB + ((chunk ^ (r & 7)) * 16)))
                         : "memory");
            if (warp_key + r < keys_valid && 8 * chunk < head_dim)
                *reinterpret_cast<uint4*>(g + (warp_key + r) * row_stride + 8 * chunk) = v;
        }
        __syncwarp();  // the stage's reads, before the warp writes it again
    }
#endif

    // Writes this warp's 16 rows of a dK or dV accumulator (times `mul`) for keys < keys_valid:
    // columns c_off .. c_off + DA - 1 (SPLIT: the warp's half), those < head_dim.
    static __device__ __forceinline__ void store_rows(const FragC (&acc)[DT], float mul, u16* g, long long row_stride,
                                                      int warp_key, int c_off, int keys_valid, int head_dim,
                                                      int lane) {
        const int gi = lane >> 2, t = lane & 3;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            int row = warp_key + gi + 8 * r;
            if (row < keys_valid) {
                u16* dst = g + row * row_stride + c_off + 2 * t;
#pragma unroll
                for (int dt = 0; dt < DT; ++dt)
                    if (c_off + 8 * dt < head_dim)
                        *reinterpret_cast<u32*>(dst + 8 * dt) =
                            pack2<BF16>(acc[dt].x[2 * r] * mul, acc[dt].x[2 * r + 1] * mul);
            }
        }
    }

    // lse·log2(e) in place for the rows of a landed item that this thread copied (the rows of
    // `load_row_floats`, after this thread's own wait; the barrier that follows publishes them).
    // A row that sees no key (lse = -inf) gets +inf, so that its P = exp2(score - inf) = 0.
    static __device__ __forceinline__ void scale_lse_rows(u32 sL, int tid) {
        for (int r = tid; r < BR; r += THREADS) {
            float l = ld_shared_f32(sL + 4 * r);
            l = (l == -FA_INF) ? FA_INF : l * FA_LOG2E;
            asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(sL + 4 * r), "f"(l) : "memory");
        }
    }

    static __device__ __forceinline__ float2 ld_shared_f32x2(u32 addr) {
        float2 x;
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(x.x), "=f"(x.y) : "r"(addr));
        return x;
    }

    static __device__ __forceinline__ int ld_shared_s32(u32 addr) {
        int x;
        asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(x) : "r"(addr));
        return x;
    }

    // What one work item's products and element-wise code read: the tiles of its buffer and its
    // coordinates.
    struct ItemCtx {
        const BwdParams* p;
        u32 sK, sV, sQ, sDO, sDS, l_base, d_base;
        Visibility vis;
        int row0, rows_valid, col0, off, warp_key, lane, g, t, b, h, tid, warp;
        u32 info;
        bool modded, drop;
        float slope;
        const unsigned char* plane;
        // SPLIT: Pᵀ' in shared memory, and the warp's first query column of the tile (0 or BR / 2).
        u32 sP;
        int q_off;
        // WS: the "dQ full" mbarrier when the previous item's dQ tile is in shared memory but not
        // yet handed to the dQ warp (its proxy fence and arrival, done here once this item's first
        // products are issued, so that the fence's wait for the stores runs under them); 0: none.
        u32 dq_full;
        // WS with the dQ tile (DQ_TILE): the tile, its slot for the item's coordinates, the "dQ
        // empty" mbarrier and the phase to wait for there before the tile is written (< 0: none).
        u32 sDQ, dq_slot, bar_dq_empty;
        int dq_parity;
    };

    // The products and element-wise work of one item up to dSᵀ in shared memory and dK, dV
    // accumulated (SPLIT: up to Pᵀ' and dSᵀ in shared memory; the caller accumulates dK and dV
    // after the barrier), compiled for each case: FULL (every pair visible, every row a real query)
    // without any predicate, or the masked case; PLAIN (no score modification, no dropout: what
    // the variants without the extras always run) without the extras' code, which, predicated
    // off element by element, would still take the issue slots; CAP (in the variants of softcap
    // alone) with the softcap's code and no branch an element. Nothing is in flight on the tensor
    // cores where the paths part or meet.
    template <bool FULL, bool PLAIN, bool CAP = false>
    static __device__ __forceinline__ void item(const ItemCtx& ctx, FragC (&dk)[DT], FragC (&dv)[DT],
                                                FragC (&dq)[DQ_FRAGS]) {
        static_assert(!(PLAIN && CAP), "CAP is a modified case");
        const BwdParams& p = *ctx.p;
        const u32 sK = ctx.sK, sV = ctx.sV, sQ = ctx.sQ, sDO = ctx.sDO, sDS = ctx.sDS, l_base = ctx.l_base, d_base = ctx.d_base;
        const Visibility vis = ctx.vis;
        const int row0 = ctx.row0, rows_valid = ctx.rows_valid, col0 = ctx.col0, off = ctx.off, warp_key = ctx.warp_key;
        const int q_off = SPLIT > 1 ? ctx.q_off : 0;
        const int lane = ctx.lane, g = ctx.g, t = ctx.t, b = ctx.b, h = ctx.h;
        const bool modded = !PLAIN && ctx.modded, drop = !PLAIN && ctx.drop;
        const bool softcapped = FA_SOFTCAP && !PLAIN && (CAP || p.mod.softcap > 0.f);
        const float slope = ctx.slope;
        const unsigned char* plane = ctx.plane;
        // Pᵀ = exp2(Sᵀ · scale·log2 e - lse · log2 e); hidden pairs 0. (The warp's queries q_off ..
        // q_off + 8·NTW - 1 of the tile; l_base and d_base point at q_off's row.)
        FragC s[NTW];
#if FA_WGMMA
        // Sᵀ and (SDP_TOGETHER) dPᵀ = V dOᵀ back to back; dK, and dV where SDP_TOGETHER,
        // stay in flight under the element-wise work until the wait at the end.
        static_assert(PARTS == 1, "the Hopper kernel computes dPᵀ whole");
        FragC dp[NTW];
        FragA pa[NTW / 2], da[NTW / 2];
        scores_t<NTW, false>(s, sK, sQ, q_off, warp_key, lane);
        if (SDP_TOGETHER) scores_t<NTW, false>(dp, sV, sDO, q_off, warp_key, lane);
        if (WS && ctx.dq_full != 0u) {
            fence_proxy_async();  // the previous item's dQ stores, to the bulk reductions' async proxy
            mbar_arrive(ctx.dq_full);
        }
        if constexpr (DEFER_DQ) {
            // The previous item's dQ ran under this item's start (its copies, its barrier, the
            // issue of these products); added now. (Waiting for it alone, wait<1>, leaves ptxas
            // unable to tell which group completed across the loop: it serialises every wgmma.)
            wgmma_wait<0>();
            fence_operands(dq);
            flush_dq(p, dq, ctx.info, vis, col0 / BC, ctx.tid, ctx.warp, lane);
        }
        if constexpr (SPLIT > 1) {
            // Sᵀ alone: Pᵀ is computed (and stored) while dPᵀ runs.
            wgmma_wait<SDP_TOGETHER ? 1 : 0>();
            fence_operands(s);
        } else {
            wgmma_wait<0>();
            fence_operands(s);
            if (SDP_TOGETHER) fence_operands(dp);
        }
#else
        scores_t(s, sK, sQ, q_off, warp_key, lane);
#endif
        // A block mask whose blocks hold whole 8-query and 16-key groups (`BlockMask::aligned`) is
        // read one byte an n-tile (8 queries) for the warp's 16 keys, the query block counted along
        // the tile; others element by element. (Keys or queries past the end read no byte: the
        // spans hide them.)
        const bool aligned_blocks = FA_BLOCKS && !FULL && plane && p.block.aligned(8, 16);
        u32 on_bits = ~0u;  // bit nt: the mask block of n-tile nt is on
        if (FA_BLOCKS && aligned_blocks) {
            on_bits = 0;
            BlockMask::Walk w(row0 + q_off, 8, p.block.bq);
            const unsigned char* qb = plane + (long long)((col0 + warp_key) / p.block.bk) * p.block.s_j +
                                      (long long)w.block * p.block.s_i;
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) {
                if (q_off + 8 * nt < rows_valid && col0 + warp_key < vis.sk && *qb != 0) on_bits |= 1u << nt;
                if (w.next()) qb += p.block.s_i;
            }
        }
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt) {
            const float2 lv = ld_shared_f32x2(l_base + 32 * nt);
            const bool on = (on_bits >> nt) & 1u;
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int col = q_off + 8 * nt + 2 * t + c;
                const float l = c ? lv.y : lv.x;
                int lo = 0, hi = 0;
                if (!FULL && col < rows_valid) vis.span(row0 + col, lo, hi);
                if (!on) hi = lo;  // the pair's mask block is off
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int key = col0 + warp_key + g + 8 * r;
                    float e;
                    if (CAP) {
                        e = p.mod.softcap_log2(s[nt].x[2 * r + c]) - l;
                    } else if (modded) {
                        const float x = s[nt].x[2 * r + c];
                        e = p.mod.apply_log2<FA_SOFTCAP, FA_ALIBI>(x, slope, row0 + col + off - key) - l;
                    } else {
                        e = fmaf(s[nt].x[2 * r + c], p.scale_log2, -l);
                    }
                    float x = fast_exp2(e);
                    if (!FULL && (key < lo || key >= hi ||
                                  (FA_BLOCKS && plane && !aligned_blocks &&
                                   !p.block.visible(plane, row0 + col, key))))
                        x = 0.f;
                    s[nt].x[2 * r + c] = x;
                }
            }
        }

        u32 bits[(NTW + 7) / 8];
        if (drop) keep_bits(bits, p.dropout, (u32)(b * p.hq + h), row0 + q_off, col0 + warp_key, lane);

        // dV += P'ᵀ dO, P' = P ∘ keep / (1 - p) (SPLIT: P'ᵀ to shared memory; dV after the
        // barrier).
        {
#if !FA_WGMMA
            FragA pa[NTW / 2];
#endif
#pragma unroll
            for (int kk = 0; kk < NTW / 2; ++kk) {
                if (drop) {
                    float x[8];
#pragma unroll
                    for (int h2 = 0; h2 < 2; ++h2)
#pragma unroll
                        for (int r = 0; r < 2; ++r)
#pragma unroll
                            for (int c = 0; c < 2; ++c) {
                                const int nt = 2 * kk + h2;
                                x[4 * h2 + 2 * r + c] =
                                    s[nt].x[2 * r + c] * (kept(bits, nt, r, c) ? p.dropout.scale : 0.f);
                            }
                    pa[kk].x[0] = pack2<BF16>(x[0], x[1]);
                    pa[kk].x[1] = pack2<BF16>(x[2], x[3]);
                    pa[kk].x[2] = pack2<BF16>(x[4], x[5]);
                    pa[kk].x[3] = pack2<BF16>(x[6], x[7]);
                } else {
                    pa[kk] = scores_to_a<BF16>(s[2 * kk], s[2 * kk + 1]);
                }
            }
            if constexpr (SPLIT == 1)
                accumulate_t<BR / 16, FA_WGMMA == 0 || !SDP_TOGETHER>(dv, pa, sDO, 0, lane);
            else
                store_t(ctx.sP, pa, q_off, warp_key, lane, g, t);
        }
#if FA_WGMMA
        if (!SDP_TOGETHER) {
            scores_t<NTW, false>(dp, sV, sDO, q_off, warp_key, lane);
            wgmma_wait<0>();
            fence_operands(dp);
        } else if (SPLIT > 1) {
            wgmma_wait<0>();
            fence_operands(dp);
        }
#endif

        // dPᵀ = V dOᵀ; dSᵀ = Pᵀ ∘ (dPᵀ ∘ keep / (1 - p) - D); dK += dSᵀ Q. In PARTS slices of
        // the queries, so only a slice of dPᵀ is live next to Pᵀ, dK and dV (registers are
        // full).
#pragma unroll
        for (int part = 0; part < PARTS; ++part) {
            constexpr int PN = NTW / PARTS;  // n-tiles (8 queries) per part
#if !FA_WGMMA
            FragC dp[PN];
            scores_t(dp, sV, sDO, q_off + 8 * PN * part, warp_key, lane);
            FragA da[PN / 2];
#endif
#pragma unroll
            for (int i = 0; i < PN; ++i) {
                const int nt = part * PN + i;
                const float2 dv2 = ld_shared_f32x2(d_base + 32 * nt);
                // Softcap: dS is also multiplied by d(c·tanh(x/c))/dx = 1 - tanh². tanh is
                // recovered from P: the modified score is (log2 P + lse·log2 e)·ln 2 (plus
                // the ALiBi bias taken off it), so no register holds it across the products.
                float2 l2 = make_float2(0.f, 0.f);
                if (softcapped) l2 = ld_shared_f32x2(l_base + 32 * nt);
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int col = q_off + 8 * nt + 2 * t + c;
                    const float dd = c ? dv2.y : dv2.x;
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        float x = dp[i].x[2 * r + c];
                        if (drop) x *= kept(bits, nt, r, c) ? p.dropout.scale : 0.f;
                        const float pr = s[nt].x[2 * r + c];
                        // A hidden pair's dS is 0 even where dPᵀ is not finite.
                        float ds = (!FULL && pr == 0.f) ? 0.f : pr * (x - dd);
                        if (CAP) {
                            // tanh = the score in exp2 units over c · log2 e: no ALiBi to take off.
                            const float th = (__log2f(pr) + (c ? l2.y : l2.x)) * p.mod.inv_cap_log2;
                            const float dt = fmaf(-th, th, 1.f);
                            ds = pr == 0.f ? 0.f : ds * dt;  // log2 0 = -inf: its dS is 0
                        } else if (softcapped && pr != 0.f) {
                            const int key = col0 + warp_key + g + 8 * r;
                            float sm = (__log2f(pr) + (c ? l2.y : l2.x)) * FA_LN2;
                            if (FA_ALIBI && p.mod.alibi) sm += slope * fabsf((float)(row0 + col + off - key));
                            const float th = sm / p.mod.softcap;  // IEEE: its slow path keeps ptxas from spilling here
                            ds *= 1.f - th * th;
                        }
                        dp[i].x[2 * r + c] = ds;
                    }
                }
            }
#pragma unroll
            for (int kk = 0; kk < PN / 2; ++kk) da[kk] = scores_to_a<BF16>(dp[2 * kk], dp[2 * kk + 1]);

            // dSᵀ to shared memory ([key][query], swizzled; SWAP_DQ: dS, [query][key]) for dQ (and
            // SPLIT: dK), before the barrier.
            if constexpr (SWAP_DQ)
                store_ds_t(sDS, da, 8 * PN * part, warp_key, lane);
            else
                store_t(sDS, da, q_off + 8 * PN * part, warp_key, lane, g, t);

            // dK += dSᵀ Q (the scale is applied once at the end); SPLIT: after the barrier.
            if constexpr (SPLIT == 1) accumulate_t<PN / 2, FA_WGMMA == 0>(dk, da, sQ, 8 * PN * part, lane);
        }
#if FA_WGMMA
        fence_proxy_async();  // dSᵀ was written by the generic proxy; the dQ wgmma reads it
        // dV and dK complete: their registers (and pa, da) are free again after this.
        auto complete = [&]() {
            wgmma_wait<0>();
            fence_operands(dv);
            fence_operands(dk);
#pragma unroll
            for (int kk = 0; kk < NTW / 2; ++kk) fence_operands(pa[kk]);
#pragma unroll
            for (int kk = 0; kk < NTW / 2; ++kk) fence_operands(da[kk]);
        };
#if FA_BWD_WS
        if (DQ_TILE && !p.deterministic) {
            // Every warpgroup's dSᵀ stored: dQ's product issued behind dK's, all three waited for
            // together; the piece then to the dQ tile, once the dQ warp has read the previous one
            // (its hand-off, ItemCtx::dq_full, is the next item's, or the caller's after the last).
            FragC dqf[SWAP_DQ ? BR / 8 : NQ / 8];
            consumers_sync();
            if constexpr (SWAP_DQ)
                issue_dq_t(dqf, sDS, sK, ctx.warp);
            else
                issue_dq(dqf, sDS, sK, ctx.warp);
            complete();
            fence_operands(dqf);
            if (ctx.dq_parity >= 0) mbar_wait(ctx.bar_dq_empty, (u32)ctx.dq_parity);
            // (Padding columns: stored, never reduced.)
            if constexpr (SWAP_DQ)
                store_dq_t(dqf, ctx.sDQ, ctx.warp, lane);
            else
                store_dq(dqf, ctx.sDQ, ctx.warp, lane);
            if (ctx.tid == 0) {
                asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(ctx.dq_slot), "r"(h), "r"(row0 / BR) : "memory");
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ctx.dq_slot + 8), "r"(b) : "memory");
            }
            return;
        }
#endif
        complete();
#endif
    }

    // dK, dV and the dQ piece held across items, zeroed.
    static __device__ __forceinline__ void zero_accumulators(FragC (&dk)[DT], FragC (&dv)[DT], FragC (&dq)[DQ_FRAGS]) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk[dt].x[e] = dv[dt].x[e] = 0.f;
#pragma unroll
        for (int i = 0; i < DQ_FRAGS; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) dq[i].x[e] = 0.f;
    }

    // Work item w of the block: query head s_info[2] + w / s_info[4], query tile s_info[3] +
    // w % s_info[4] (the group's first query head, the first tile that sees the key tile, the
    // tiles per head; `info` is s_info's address).
    static __device__ __forceinline__ void item_at(u32 info, int w, int& h, int& m) {
        const int n = ld_shared_s32(info + 16);
        const unsigned q = (unsigned)w / (unsigned)n;
        h = ld_shared_s32(info + 8) + (int)q;
        m = ld_shared_s32(info + 12) + (w - (int)q * n);
    }

#if FA_BWD_WS
    // item_at for the warp-specialised kernel: with a tile list (FA_BLOCKS), the item's query tile
    // is the list's entry (row info[0], the key tile), which it returns (with BWD_TILE_FULL);
    // else m as item_at's, and 0.
    static __device__ __forceinline__ int item_at_ws(const BwdWsParams& pp, u32 info, int w, int& h, int& m) {
        item_at(info, w, h, m);
        if constexpr (FA_BLOCKS) {
            if (pp.tile_list != nullptr) {
                const int i = m - ld_shared_s32(info + 12);  // the item's place in its head's tiles
                const int e = pp.tile_list[ld_shared_s32(info) * pp.tile_stride + 1 + i];
                m = e & (BWD_TILE_FULL - 1);
                return e;
            }
        }
        return 0;
    }
#endif

    // The query tiles m_lo .. m_hi - 1 that see key tile n_block: those whose key range (as the
    // forward and the deterministic ordering compute it) covers it. Monotone spans make them
    // contiguous; none: m_lo >= m_hi.
    static __device__ __forceinline__ void query_tiles(const Visibility& vis, int n_block, int& m_lo, int& m_hi) {
        const int m_count = (vis.sq + BR - 1) / BR;
        m_lo = m_count;
        m_hi = 0;
        for (int m = 0; m < m_count; ++m) {
            int lo, hi;
            vis.key_range(m * BR, min(vis.sq, (m + 1) * BR), lo, hi);
            if (lo / BC <= n_block && n_block < (hi + BC - 1) / BC) {
                m_lo = min(m_lo, m);
                m_hi = m + 1;
            }
        }
    }

    // One item, on the copy of `item` compiled for its case.
    static __device__ __forceinline__ void dispatch_item(const ItemCtx& ctx, bool full, FragC (&dk)[DT],
                                                         FragC (&dv)[DT], FragC (&dq)[DQ_FRAGS]) {
        const BwdParams& p = *ctx.p;
        if (FA_EXTRAS == 0 || !(ctx.modded || ctx.drop)) {
            if (full)
                item<true, true>(ctx, dk, dv, dq);
            else
                item<false, true>(ctx, dk, dv, dq);
        } else if (FA_EXTRAS == 2 && p.mod.softcap > 0.f) {
            // (In the variants of softcap alone: where other paths are compiled in too, a
            // third copy of the item costs the registers they need.)
            if (full)
                item<true, false, true>(ctx, dk, dv, dq);
            else
                item<false, false, true>(ctx, dk, dv, dq);
        } else {
            if (full)
                item<true, false>(ctx, dk, dv, dq);
            else
                item<false, false>(ctx, dk, dv, dq);
        }
    }

    static __device__ __forceinline__ void run(const BwdParams& p, char* smem) {
        const int tid = threadIdx.x, warp = tid / 32, lane_id = tid % 32;
        const int g = lane_id >> 2, t = lane_id & 3;
        const BlockCoords bc = block_coords(p);
        const int n_block = bc.n_block, b = bc.b, hkv = bc.hkv, q_start = bc.q_start, sq = bc.sq, sk = bc.sk;
        const int col0 = n_block * BC;
        if (col0 >= sk) return;
        const int keys_valid = min(BC, sk - col0);
        const Visibility vis{sq, sk, sk - sq, p.causal, p.window_left, p.window_right};
        const int off = sk - sq;

        int m_lo, m_hi;
        query_tiles(vis, n_block, m_lo, m_hi);

        const u32 sK = smem_addr(smem), sV = sK + KV_BYTES, sQ0 = sV + KV_BYTES, sDO0 = sQ0 + STAGES * Q_BYTES,
                  sDS0 = sDO0 + STAGES * Q_BYTES, sP = sDS0 + DS_BUFS * DS_BYTES, sL0 = sP + P_BYTES,
                  sD0 = sL0 + STAGES * ROW_BYTES;
        // The warp's 16 keys of the tile; SPLIT: its half of the queries (Sᵀ, dPᵀ) and of the
        // columns (dK, dV).
        // (Compile-time zeros without SPLIT: the warp index is not known to be below WARPS.)
        const int warp_key = 16 * (SPLIT > 1 ? warp % KEY_WARPS : warp), half = SPLIT > 1 ? warp / KEY_WARPS : 0;
        const int q_off = half * (BR / SPLIT), c_off = half * DA;

        const int per_head = max(m_hi - m_lo, 0);
        const int work = per_head * p.group;

        // What the copies and the (head, tile) of each item need, in shared memory: the batch entry
        // and first query token of the block's sequence, the first query head of the group, the
        // first query tile and the tiles per head. Held in registers across the loop they are what
        // spills; re-derived from the block index they cost integer divisions per item.
        __shared__ int s_info[7];
        if (tid == 0) {
            s_info[0] = b;
            s_info[1] = q_start;
            s_info[2] = hkv * p.group;
            s_info[3] = m_lo;
            s_info[4] = per_head;
            s_info[5] = 0;   // DEFER_DQ: the (head, tile) of the dQ piece in flight;
            s_info[6] = -1;  // none yet
        }
        const u32 info = smem_addr(s_info);

        const u16* gK = p.k + b * p.k_batch + (long long)(bc.k_start + col0) * p.k_row + hkv * p.k_head;
        const u16* gV = p.v + b * p.v_batch + (long long)(bc.k_start + col0) * p.v_row + hkv * p.v_head;

        FragC dk[DT], dv[DT], dq[DQ_FRAGS];
        zero_accumulators(dk, dv, dq);

        auto item_of = [&](int w, int& h, int& m) { item_at(info, w, h, m); };

        // Starts the copies of query tile m of query head h into buffer `buf`.
        auto prefetch = [&](int h, int m, int buf) {
            const int row0 = m * BR;
            const int rows_valid = min(BR, sq - row0);
            const int cb = ld_shared_s32(info);
            const long long tok = ld_shared_s32(info + 4) + row0;
            load_tile_async<BR, D, THREADS, GMMA>(sQ0 + buf * Q_BYTES,
                                                  p.q + cb * p.q_batch + tok * p.q_row + h * p.q_head, p.q_row,
                                                  rows_valid, p.d, tid);
            load_tile_async<BR, D, THREADS, GMMA>(sDO0 + buf * Q_BYTES,
                                                  p.dout + cb * p.do_batch + tok * p.do_row + h * p.do_head,
                                                  p.do_row, rows_valid, p.d, tid);
            const long long li = cb * p.lse_batch + h * p.lse_head + tok;
            load_row_floats(sL0 + buf * ROW_BYTES, p.lse + li, rows_valid, tid);
            load_row_floats(sD0 + buf * ROW_BYTES, p.dpsum + li, rows_valid, tid);
        };

        // With a block-sparse mask (extras variants), items whose tile the mask hides entirely are
        // skipped — except in deterministic mode, where every key tile takes its turn on a query
        // tile's semaphore — and only items with every mask block on may be Full.
        // `next_item(w, all_on)`: the first item at or after w to run; every thread calls it.
        const bool blocky = FA_BLOCKS && p.block.active();
        auto next_item = [&](int w, bool& all_on) {
            all_on = true;
            if (blocky) {
                for (; w < work; ++w) {
                    int h, m;
                    item_of(w, h, m);
                    const int row0 = m * BR;
                    bool any;
                    p.block.classify(p.block.plane(b, h), row0, min(sq, row0 + BR), col0, col0 + keys_valid, tid,
                                     THREADS, any, all_on);
                    if (any || p.deterministic) break;
                }
            }
            return w;
        };

        __syncthreads();  // s_info
        bool all_on;
        int w = next_item(0, all_on), buf = 0, h = 0, m = 0;
        load_tile_async<BC, D, THREADS, GMMA>(sK, gK, p.k_row, keys_valid, p.d, tid);
        load_tile_async<BC, D, THREADS, GMMA>(sV, gV, p.v_row, keys_valid, p.d, tid);
        if (w < work) {
            item_of(w, h, m);
            prefetch(h, m, buf);
        }
        cp_async_commit();

        while (w < work) {
            cp_async_wait<0>();
            scale_lse_rows(sL0 + buf * ROW_BYTES, tid);
#if FA_WGMMA
            fence_proxy_async();
#endif
            // Item w (and K, V) landed, and every thread is done with item w - 1: its dQ product
            // read dSᵀ, and its tiles in buffer buf ^ 1 are free for the next item's copies.
            __syncthreads();
            {
                bool next_all_on;
                const int next = next_item(w + 1, next_all_on);
                if (next < work) {
                    int next_h, next_m;
                    item_of(next, next_h, next_m);
                    prefetch(next_h, next_m, buf ^ 1);
                }
            }
            cp_async_commit();

            const int row0 = m * BR;
            const int rows_valid = min(BR, sq - row0);
            const unsigned char* plane = blocky ? p.block.plane(b, h) : nullptr;
            const float slope = p.mod.slope(b, h, p.hq);
            // The lane id, opaque to the compiler for this iteration: otherwise ptxas hoists every
            // swizzled fragment address out of the loop into its own register and spills.
            const int lane = (int)opaque((u32)lane_id);
            const u32 sQ = sQ0 + buf * Q_BYTES, sDO = sDO0 + buf * Q_BYTES;
            const u32 sL = sL0 + buf * ROW_BYTES, sD = sD0 + buf * ROW_BYTES;
            const u32 sDS = sDS0 + (DEFER_DQ ? buf * DS_BYTES : 0);
            // This thread's columns 8·nt + 2t, +1 of the lse·log2(e) and D rows: one 8-byte load
            // each per n-tile, at an immediate offset from these bases.
            const u32 l_base = opaque(sL + 4 * q_off + 8 * t), d_base = opaque(sD + 4 * q_off + 8 * t);
            // (Read from the parameters at each item: held across the loop they take registers.)
            const bool modded = FA_MODS && p.mod.active(), drop = FA_DROPOUT && p.dropout.enabled;

            const ItemCtx ctx{&p,   sK,  sV,   sQ,    sDO,  sDS,   l_base, d_base, vis,  row0,  rows_valid,
                              col0, off, warp_key, lane, g, t, b, h, tid, warp, info, modded, drop, slope, plane, sP, q_off,
                              0u};
            // Every pair visible and every row a real query: no predicate. (Rows past the end hold
            // zeros; masking them too keeps a non-finite V out of dK through them.)
            const bool full = all_on && rows_valid == BR && vis.tile_full(row0, row0 + rows_valid, col0, col0 + BC);
            dispatch_item(ctx, full, dk, dv, dq);
            __syncthreads();  // dSᵀ (and SPLIT: Pᵀ') complete

            if constexpr (SPLIT > 1 && GMMA) {
#if FA_WGMMA
                // dQ's product first, then dV's and dK's: dQ's sums go out to global memory while
                // dV and dK run (wait<2>: the first of the three groups complete).
                FragC dqs[NQ / 8];
                issue_dq(dqs, sDS, sK, warp);
                accumulate_split(dv, sP, sDO, warp_key, c_off, lane);
                accumulate_split(dk, sDS, sQ, warp_key, c_off, lane);
                wgmma_wait<2>();
                fence_operands(dqs);
                add_dq_in_order(p, vis, b, h, m, q_start, n_block, tid,
                                [&](float* acc, long long acc_row, int rows_valid) {
                                    add_dq(dqs, acc, acc_row, rows_valid, p.d, warp, lane);
                                });
                wgmma_wait<0>();
                fence_operands(dv);
                fence_operands(dk);
#endif
            } else if constexpr (DEFER_DQ) {
#if FA_WGMMA
                // dQ of this item: issued now, added by the next item (or after the loop).
                issue_dq(dq, sDS, sK, warp);
                if (tid == 0) {
                    s_info[5] = h;
                    s_info[6] = m;
                }
#endif
            } else {
                if constexpr (SPLIT > 1) {
                    accumulate_split(dv, sP, sDO, warp_key, c_off, lane);
                    accumulate_split(dk, sDS, sQ, warp_key, c_off, lane);
                }
                add_dq_in_order(p, vis, b, h, m, q_start, n_block, tid,
                                [&](float* acc, long long acc_row, int rows_valid) {
                                    accumulate_dq(sDS, sK, acc, acc_row, rows_valid, p.d, warp, lane);
                                });
            }
            // The next item again (the same answer as above), rather than held in registers across
            // this one.
            w = next_item(w + 1, all_on);
            if (w < work) item_of(w, h, m);
            buf ^= 1;
        }

#if FA_WGMMA
        if constexpr (DEFER_DQ) {
            __syncthreads();  // the last item's (head, tile), written by thread 0 after its dSᵀ barrier
            wgmma_wait<0>();
            fence_operands(dq);
            flush_dq(p, dq, info, vis, n_block, tid, warp, lane_id);
        }
#endif
        const BlockCoords e = block_coords(p);
        const long long k0 = e.k_start + e.n_block * BC;
        const int kv = min(BC, e.sk - e.n_block * BC);
        u16* gdK = p.dk + e.b * p.dk_batch + k0 * p.dk_row + e.hkv * p.dk_head;
        u16* gdV = p.dv + e.b * p.dv_batch + k0 * p.dv_row + e.hkv * p.dv_head;
        store_rows(dk, p.scale, gdK, p.dk_row, warp_key, c_off, kv, p.d, lane_id);
        store_rows(dv, 1.f, gdV, p.dv_row, warp_key, c_off, kv, p.d, lane_id);
    }

#if FA_BWD_WS
    // This warp's rows of a completed dQ piece (issue_dq) into the dQ tile in shared memory:
    // column c of row r in block c / 32, 16-byte chunk (c % 32) / 4 of the row swizzled by r % 8.
    static __device__ __forceinline__ void store_dq(const FragC (&d)[NQ / 8], u32 sDQ, int warp, int lane) {
        const int g = lane >> 2, t = lane & 3;
        const int wg = warp / 4, m0 = 64 * (wg / NSPLIT), n0 = NQ * (wg % NSPLIT);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = m0 + 16 * (warp % 4) + g + 8 * r;
            const u32 base = sDQ + (u32)(row * 128 + (t & 1) * 8);
#pragma unroll
            for (int n = 0; n < NQ / 8; ++n) {
                const int col = n0 + 8 * n + 2 * t;
                const u32 dst = base + (u32)((col / 32) * BR * 128 + ((((col % 32) / 4) ^ (row & 7)) * 16));
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(dst), "f"(d[n].x[2 * r]), "f"(d[n].x[2 * r + 1])
                             : "memory");
            }
        }
    }

    // SWAP_DQ: this warp's part of a completed dQᵀ piece (issue_dq_t) into the dQ tile, as
    // store_dq lays it out: element (column c, query q) at row q, block c / 32, 16-byte chunk
    // (c % 32) / 4 swizzled by q % 8, one 4-byte store each (a warp's store covers 8 columns by 4
    // queries: 32 distinct banks).
    static __device__ __forceinline__ void store_dq_t(const FragC (&d)[BR / 8], u32 sDQ, int warp, int lane) {
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int col = 64 * (warp / 4) + 16 * (warp % 4) + g + 8 * r;
            const int ch = (col % 32) / 4;
            const u32 base = sDQ + (u32)((col / 32) * BR * 128 + (col % 4) * 4);
#pragma unroll
            for (int n = 0; n < BR / 8; ++n)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int q = 8 * n + 2 * t + c;
                    const u32 dst = base + (u32)(q * 128 + ((ch ^ (q & 7)) * 16));
                    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(dst), "f"(d[n].x[2 * r + c]) : "memory");
                }
        }
    }

    // Registers a thread after setmaxnreg: the block holds 384 · 168 (ptxas's count under
    // __launch_bounds__(384, 1)); the consumers' increase waits for the registers the producer
    // gave back, so the two must add up to no more.
    static constexpr int PRODUCER_REGS = 24;
    static constexpr int CONSUMER_REGS = (384 * 168 - 128 * PRODUCER_REGS) / 256;
    static_assert(CONSUMER_REGS % 8 == 0 && CONSUMER_REGS <= 256, "setmaxnreg's steps");

    // The warp-specialised kernel (fixed-length batches), persistent: a grid of at most one block
    // a multiprocessor, whose producer takes key tiles from a counter (the tile scheduler: tiles
    // in `ws_key_tile_coords`' order, each to whichever block asks next, so that the blocks drawing
    // short tiles take more and the grid ends together, and the tiles running at once are
    // neighbours that read the same query tiles out of L2; under a causal rule the longest tiles
    // of a chunk of heads first, so that the grid ends on short ones).
    // Warps 0-7 (the consumers) run the items as `run` does, but without a block-wide barrier:
    // each item's Q, dO, lse·log2(e) and D arrive in a ring of STAGES buffers whose "full"
    // mbarrier they wait for, and whose "empty" one each consumer thread arrives on once its
    // products are complete; the barrier around dSᵀ is named barrier 1 of the 256 consumers.
    // Warp 8 (the producer; warps 10-11 leave) loads each tile's K and V (once the consumers
    // have arrived on "K/V empty" after the previous tile's last product, and after the tile's
    // first item, so that it lands under the previous tile's last item and epilogue) and,
    // STAGES items ahead of the consumers, each item's tiles by TMA (lane 0) and its lse and D
    // rows (every lane, through registers: lse scaled as `scale_lse_rows` does), then arrives on
    // the stage's "full" mbarrier (33 arrivals: lane 0's with the TMA's byte count, and one a lane
    // after its stores). The tile of each K/V load is left in `s_tile` before the "K/V full"
    // arrival that publishes it (-1 and a bare arrival: no more tiles).
    // Each item's dQ product is issued after the dSᵀ barrier, behind dK's, and waited for with dV's
    // and dK's (`item`), and its piece stored to a dQ tile in shared memory, which warp 9 (the dQ
    // warp) adds to dQaccum with TMA reductions (the "dQ full" and "dQ empty" mbarriers hand the
    // tile over and back, with the item's coordinates in `s_dq`): the consumers issue no `red` and
    // hold no global address for dQ. In deterministic mode the consumers add it with `red` in
    // key-tile order, as `run` does (the tiles are taken in order by running blocks, so a wait for
    // the tile before always ends). dSᵀ alternates between two buffers, since no barrier separates
    // the dQ product from the next item's stores.
    static __device__ __forceinline__ void run_ws(const BwdWsParams& pp, char* smem) {
        const BwdParams& p = pp.base;
        const int tid = threadIdx.x, warp = tid / 32, lane_id = tid % 32;
        const int g = lane_id >> 2, t = lane_id & 3;
        // Fixed-length batches: every sequence has sq queries and sk keys, and a tile holds keys
        // (num_n_blocks = ceil(sk / BC)).
        const int tiles = p.num_n_blocks * p.batch * p.hk;
        const Visibility vis{p.sq, p.sk, p.sk - p.sq, p.causal, p.window_left, p.window_right};
        // (ROWS_LAST: the lse and D rows after the dQ tile rather than before it.)
        const u32 sK = smem_addr(smem), sV = sK + KV_BYTES, sQ0 = sV + KV_BYTES, sDO0 = sQ0 + STAGES * Q_BYTES,
                  sDS0 = sDO0 + STAGES * Q_BYTES, sP0 = sDS0 + 2 * DS_BYTES,
                  sL0 = sP0 + P_BUFS * P_BYTES + (ROWS_LAST ? DQ_BYTES : 0), sD0 = sL0 + STAGES * ROW_BYTES;
        const u32 sDQ = ROWS_LAST ? sP0 + P_BUFS * P_BYTES : sD0 + STAGES * ROW_BYTES;
        const u32 bar_kv = sD0 + STAGES * ROW_BYTES + (ROWS_LAST ? 0 : DQ_BYTES), bar_kv_empty = bar_kv + 8,
                  bar_full = bar_kv_empty + 8,
                  bar_empty = bar_full + 8 * STAGES;
        const u32 bar_dq_full = bar_empty + 8 * STAGES, bar_dq_empty = bar_dq_full + 8;

        // Each K/V load's tile, at [load % 2]: the tile's index (-1: no more), its sequence, its
        // first query head (kv head · group), first query tile and query tiles a head (item_at's
        // layout), its index among the sequence's key tiles and its kv head. The producer writes
        // them before the load's "K/V full" arrival; the consumers read them there (every item:
        // in registers across the item loop they would cost the item's code registers).
        __shared__ __align__(16) int s_tile[2][8];
        __shared__ int s_dq[3];  // the item whose dQ is in the tile: h, m, b; h = -1: no more
        const u32 tile_slot = smem_addr(&s_tile[0][0]), dq_slot = smem_addr(s_dq);
        if (tid == 0) {
            mbar_init(bar_kv, 1);
            mbar_init(bar_kv_empty, CONSUMERS);
            for (int st = 0; st < STAGES; ++st) {
                mbar_init(bar_full + 8 * st, 33);
                mbar_init(bar_empty + 8 * st, CONSUMERS);  // one arrival per consumer thread
            }
            mbar_init(bar_dq_full, CONSUMERS);
            mbar_init(bar_dq_empty, 1);  // the dQ warp's issuing thread
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();  // the mbarriers

        if (warp >= CONSUMERS / 32) {
            asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS) : "memory");
            if (warp == CONSUMERS / 32 + 1 && DQ_TILE && !p.deterministic) {
                // The dQ warp: each item's dQ tile, once the consumers stored it, added to dQaccum
                // by TMA reductions (one a 32-column block; rows past the sequence and columns
                // past d fall outside the tensor map and are not written, and blocks wholly past
                // d are not issued), read out of shared memory before the tile is handed back.
                // (Deterministic mode: the consumers add it in key-tile order themselves.)
                if (lane_id != 0) return;
#pragma unroll 1
                for (int n = 0;; ++n) {
                    mbar_wait(bar_dq_full, (u32)(n & 1));
                    const int h = ld_shared_s32(dq_slot), m = ld_shared_s32(dq_slot + 4), b = ld_shared_s32(dq_slot + 8);
                    if (h < 0) break;
#pragma unroll
                    for (int c = 0; c < D / 32; ++c)
                        if (32 * c < p.d)
                            asm volatile(
                                "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, "
                                "%4}], [%5];\n" ::"l"(&pp.dq),
                                "r"(32 * c), "r"(h), "r"(m * BR), "r"(b), "r"(sDQ + (u32)(c * BR * 128))
                                : "memory");
                    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
                    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
                    mbar_arrive(bar_dq_empty);
                }
                asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
                return;
            }
            if (warp != CONSUMERS / 32) return;
            // The producer warp.
            auto claim = [&]() {
                int x = 0;
                if (lane_id == 0) x = atomicAdd(pp.next_tile, 1);
                return __shfl_sync(0xffffffffu, x, 0);
            };
            int loads = 0;  // K/V loads so far: "K/V full" and "K/V empty"'s phases
            int wg = 0;     // items so far: the ring's phases
#pragma unroll 1
            for (int tile = claim();; tile = claim()) {
                // The tile's items (none: its dK and dV are written zero), into the slot of its K/V load. (The
                // consumers read that slot last for load `loads` - 2, whose tile they finished
                // before the producer's wait on "K/V empty" for load `loads` - 1.)
                const u32 info = tile_slot + (u32)(32 * (loads & 1));
                int per_head = 0;
                if (tile < tiles) {
                    int n_block, b, hkv, m_lo, m_hi;
                    ws_key_tile_coords(p, pp.longest_first, tile, n_block, b, hkv);
                    query_tiles(vis, n_block, m_lo, m_hi);
                    per_head = max(m_hi - m_lo, 0);
                    if constexpr (FA_BLOCKS) {
                        // The tile list's count (its entries replace m_lo + i in item_at_ws).
                        if (pp.tile_list != nullptr) per_head = pp.tile_list[tile * pp.tile_stride];
                    }
                    if (lane_id == 0) {
                        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(info), "r"(tile), "r"(b),
                                     "r"(hkv * p.group), "r"(m_lo)
                                     : "memory");
                        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(info + 16), "r"(per_head),
                                     "r"(n_block), "r"(hkv), "r"(0)
                                     : "memory");
                    }
                } else if (lane_id == 0) {
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(info), "r"(-1) : "memory");
                }
                __syncwarp();
                // K and V of the tile (or the word that there are none: a bare arrival), once the
                // consumers are done with the previous tile's, issued after the first item's
                // copies, which land under the previous tile's last item.
                auto load_kv = [&]() {
                    if (loads > 0) mbar_wait(bar_kv_empty, (u32)((loads - 1) & 1));
                    if (lane_id == 0) {
                        if (tile < tiles && per_head > 0) {
                            const int b = ld_shared_s32(info + 4), col0 = ld_shared_s32(info + 20) * BC,
                                      hkv = ld_shared_s32(info + 24);
                            mbar_expect_tx(bar_kv, 2 * KV_BYTES);
#pragma unroll
                            for (int c = 0; c < D / 64; ++c) {
                                tma_load_4d(sK + (u32)(c * BC * 128), &pp.k, 64 * c, col0, hkv, b, bar_kv);
                                tma_load_4d(sV + (u32)(c * BC * 128), &pp.v, 64 * c, col0, hkv, b, bar_kv);
                            }
                        } else {
                            mbar_arrive(bar_kv);
                        }
                    }
                    ++loads;
                };
                if (tile >= tiles) {
                    load_kv();
                    break;
                }
                if (per_head == 0) {
                    // No query sees the tile (its keys are past every query's span, or every mask
                    // block over it is off): no K or V, a bare arrival; the consumers write its dK
                    // and dV rows, zero (the caller's buffers may hold anything).
                    load_kv();
                    continue;
                }
#pragma unroll 1
                for (int w = 0; w < per_head * p.group; ++w, ++wg) {
                    const int st = wg % STAGES;
                    if (wg >= STAGES) mbar_wait(bar_empty + 8 * st, (u32)((wg / STAGES - 1) & 1));
                    int h, m;
                    item_at_ws(pp, info, w, h, m);
                    const int b = ld_shared_s32(info + 4);
                    const int row0 = m * BR, rows_valid = min(BR, p.sq - row0);
                    const u32 full = bar_full + 8 * st;
                    if (lane_id == 0) {
                        mbar_expect_tx(full, 2 * Q_BYTES);
#pragma unroll
                        for (int c = 0; c < D / 64; ++c) {
                            tma_load_4d(sQ0 + (u32)(st * Q_BYTES + c * BR * 128), &pp.q, 64 * c, row0, h, b, full);
                            tma_load_4d(sDO0 + (u32)(st * Q_BYTES + c * BR * 128), &pp.dout, 64 * c, row0, h, b, full);
                        }
                    }
                    const long long li = b * p.lse_batch + h * p.lse_head + row0;
#pragma unroll
                    for (int r = lane_id; r < BR; r += 32) {
                        float l = 0.f, dd = 0.f;
                        if (r < rows_valid) {
                            l = p.lse[li + r];
                            dd = p.dpsum[li + r];
                        }
                        l = (l == -FA_INF) ? FA_INF : l * FA_LOG2E;
                        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(sL0 + (u32)(st * ROW_BYTES + 4 * r)), "f"(l)
                                     : "memory");
                        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(sD0 + (u32)(st * ROW_BYTES + 4 * r)), "f"(dd)
                                     : "memory");
                    }
                    mbar_arrive(full);
                    if (w == 0) load_kv();
                }
            }
            return;
        }
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS) : "memory");

        // The warp index through a shuffle: ptxas then knows it is the same in every lane and
        // keeps what derives from it (the operand descriptors) in uniform registers.
        const int uwarp = __shfl_sync(0xffffffffu, warp, 0);
        FragC dk[DT], dv[DT], dq[DQ_FRAGS];
        // The warp's 16 keys; SPLIT: its half of the queries (Sᵀ, dPᵀ) and of the columns (dK, dV).
        const int warp_key = 16 * (SPLIT > 1 ? uwarp % KEY_WARPS : uwarp), half = SPLIT > 1 ? uwarp / KEY_WARPS : 0;
        const int q_off = half * (BR / SPLIT), c_off = half * DA;
        int wg = 0;  // items so far
        bool dq_pending = false;  // the last item's dQ tile stored, not yet handed over (ItemCtx::dq_full)
#pragma unroll 1
        for (int j = 0;; ++j) {
            mbar_wait(bar_kv, (u32)(j & 1));
            const u32 info = tile_slot + (u32)(32 * (j & 1));
            if (ld_shared_s32(info) < 0) break;
            const int work = ld_shared_s32(info + 16) * p.group;  // 0: a tile no query sees (dK, dV zero)
            zero_accumulators(dk, dv, dq);
#pragma unroll 1
            for (int w = 0; w < work; ++w, ++wg) {
                const int st = wg % STAGES;
                int h, m;
                const int entry = item_at_ws(pp, info, w, h, m);
                const int b = ld_shared_s32(info + 4), col0 = ld_shared_s32(info + 20) * BC;
                const int sq = p.sq, off = p.sk - p.sq;
                const int row0 = m * BR;
                const int rows_valid = min(BR, sq - row0);
                const float slope = p.mod.slope(b, h, p.hq);
                const int lane = (int)opaque((u32)lane_id);
                const u32 sQ = sQ0 + (u32)(st * Q_BYTES), sDO = sDO0 + (u32)(st * Q_BYTES);
                const u32 sL = sL0 + (u32)(st * ROW_BYTES), sD = sD0 + (u32)(st * ROW_BYTES);
                const u32 sDS = sDS0 + (u32)((wg & 1) * DS_BYTES), sP = sP0 + (u32)((wg & 1) * P_BYTES);
                const u32 l_base = opaque(sL + 4 * q_off + 8 * t), d_base = opaque(sD + 4 * q_off + 8 * t);
                const bool modded = FA_MODS && p.mod.active(), drop = FA_DROPOUT && p.dropout.enabled;
                // A block mask: its plane, and the tile list's word on whether the item needs it
                // (without a list, deterministic mode, every item is masked).
                const bool blocky = FA_BLOCKS && p.block.active();
                const unsigned char* plane = blocky ? p.block.plane(b, h) : nullptr;
                const ItemCtx ctx{&p,   sK,  sV,       sQ,   sDO, sDS, l_base, d_base, vis,  row0,  rows_valid,
                                  col0, off, warp_key, lane, g,   t,   b,      h,      tid,  uwarp,  0u,
                                  modded, drop, slope, plane, sP, q_off, dq_pending ? bar_dq_full : 0u,
                                  sDQ, dq_slot, bar_dq_empty, wg > 0 ? (int)((wg - 1) & 1) : -1};
                bool full;
                if constexpr (FA_BLOCKS)
                    full = blocky ? pp.tile_list != nullptr && (entry & BWD_TILE_FULL) != 0
                                  : rows_valid == BR && vis.tile_full(row0, row0 + rows_valid, col0, col0 + BC);
                else
                    full = rows_valid == BR && vis.tile_full(row0, row0 + rows_valid, col0, col0 + BC);
                mbar_wait(bar_full + 8 * st, (u32)((wg / STAGES) & 1));
                dispatch_item(ctx, full, dk, dv, dq);
                dq_pending = false;  // handed over in the item
                // This thread's products and reads of the item are complete: once every consumer
                // thread says so, its stage may be refilled. (Every thread arrives, rather than one a
                // warp after __syncwarp: the producer rewrites the lse and D rows with plain stores,
                // and racecheck orders each read before them only through that thread's own release.)
                // SPLIT: dV's and dK's products read dO and Q after the barrier: the arrival follows them.
                if constexpr (SPLIT == 1) mbar_arrive(bar_empty + 8 * st);
                // dSᵀ (SPLIT: and Pᵀ') complete (with the dQ tile: the item's own barrier).
                if (!DQ_TILE || p.deterministic) consumers_sync();
                if constexpr (SPLIT > 1) {
                    // As `run`'s split kernel: dQ's product first, its sums sent to dQaccum with
                    // `red` while dV's and dK's products run.
                    FragC dqs[NQ / 8];
                    issue_dq(dqs, sDS, sK, uwarp);
                    accumulate_split(dv, sP, sDO, warp_key, c_off, lane);
                    accumulate_split(dk, sDS, sQ, warp_key, c_off, lane);
                    wgmma_wait<2>();
                    fence_operands(dqs);
                    add_dq_in_order(p, vis, b, h, m, 0, col0 / BC, tid,
                                    [&](float* acc, long long acc_row, int rows_valid) {
                                        add_dq(dqs, acc, acc_row, rows_valid, p.d, uwarp, lane);
                                    });
                    wgmma_wait<0>();
                    fence_operands(dv);
                    fence_operands(dk);
                    mbar_arrive(bar_empty + 8 * st);
                } else if (p.deterministic) {
                    add_dq_in_order(p, vis, b, h, m, 0, col0 / BC, tid, [&](float* acc, long long acc_row, int rows_valid) {
                        accumulate_dq(sDS, sK, acc, acc_row, rows_valid, p.d, uwarp, lane);
                    });
                } else {
                    // The item's dQ piece is in the dQ tile (`item` put it there, and its
                    // coordinates in the slot, once the dQ warp had read the previous item's).
                    // Handed to the dQ warp (proxy fence, "dQ full") under the next item's first
                    // products, or below after the last item.
                    dq_pending = true;
                }
            }
            // K and V are read no more (the last item's products, dQ's among them, are complete).
            // (The tile's slot is read before the arrival: the producer may rewrite it after.)
            const int b = ld_shared_s32(info + 4), col0 = ld_shared_s32(info + 20) * BC, hkv = ld_shared_s32(info + 24);
            mbar_arrive(bar_kv_empty);
            const long long k0 = col0;
            const int kv = min(BC, p.sk - col0);
            u16* gdK = p.dk + b * p.dk_batch + k0 * p.dk_row + hkv * p.dk_head;
            u16* gdV = p.dv + b * p.dv_batch + k0 * p.dv_row + hkv * p.dv_head;
            if constexpr (STAGED_DKV) {
                // Staged through the warp's STAGE_BYTES of the dS buffers: its warpgroup's 64 keys'
                // rows of their first 64-query block (8 KiB a buffer, which the next item's dS
                // stores of the other warpgroup never touch), once every consumer's dQ product of
                // the tile's last item has read them.
                consumers_sync();
                constexpr int PER_BUFFER = 64 * 128 / STAGE_BYTES;  // warps' stages a buffer holds
                const int wgi = uwarp / 4, k = uwarp % 4;
                const u32 stage = sK + (u32)(2 * KV_BYTES + 2 * STAGES * Q_BYTES + (k / PER_BUFFER) * DS_BYTES +
                                             wgi * 64 * 128 + (k % PER_BUFFER) * STAGE_BYTES);
                // (The lane opaque: otherwise ptxas keeps each row's stage address from one tile to the
                // next, and spills them.)
                const int ln = (int)opaque((u32)lane_id);
                store_rows_staged(dk, p.scale, gdK, p.dk_row, stage, warp_key, kv, p.d, ln);
                store_rows_staged(dv, 1.f, gdV, p.dv_row, stage, warp_key, kv, p.d, ln);
            } else {
                store_rows(dk, p.scale, gdK, p.dk_row, warp_key, c_off, kv, p.d, lane_id);
                store_rows(dv, 1.f, gdV, p.dv_row, warp_key, c_off, kv, p.d, lane_id);
            }
        }
        if (DQ_TILE && !p.deterministic) {
            if (dq_pending) {
                fence_proxy_async();  // the last item's dQ tile
                mbar_arrive(bar_dq_full);
            }
            // The dQ warp's last word, once it has read the last tile.
            if (wg > 0) mbar_wait(bar_dq_empty, (u32)((wg - 1) & 1));
            if (tid == 0) asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(dq_slot), "r"(-1) : "memory");
            mbar_arrive(bar_dq_full);
        }
    }
#endif
};

#if FA_BWD_WS && FA_BLOCKS
// The tile list of the warp-specialised backward under a block-sparse mask (BwdWsParams::tile_list):
// a warp per key tile (ws_key_tile_coords' order), launched before the backward on its stream. Of
// the query tiles the interval rules let see the key tile (query_tiles'), in order, the ones with
// a mask block on under them for at least one query head of the kv head's group, flagged
// BWD_TILE_FULL where every block is on for every head, every row is a real query and the
// interval rules hide nothing: the producer loads only those items, the consumers mask only the
// unflagged ones. Each lane reads a share of the mask bytes; the warp votes.
extern "C" __global__ void __launch_bounds__(128) flash_bwd_ws_tiles(const __grid_constant__ BwdWsParams pp) {
    using K = FlashBwd<FA_D, FA_BR, FA_WARPS, FA_BF16 != 0>;
    constexpr int BR = FA_BR, BC = K::BC;
    const BwdParams& p = pp.base;
    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * 4 + threadIdx.x / 32;
    if (row >= (long long)p.num_n_blocks * p.batch * p.hk) return;
    int n_block, b, hkv;
    ws_key_tile_coords(p, pp.longest_first, (int)row, n_block, b, hkv);
    const Visibility vis{p.sq, p.sk, p.sk - p.sq, p.causal, p.window_left, p.window_right};
    int m_lo, m_hi;
    K::query_tiles(vis, n_block, m_lo, m_hi);
    const BlockMask& bm = p.block;
    const int c0 = n_block * BC, c1 = min(p.sk, c0 + BC);
    int* out = pp.tile_list + row * pp.tile_stride;
    int count = 0;
    if (c0 < c1) {
        const int bj0 = c0 / bm.bk, nbj = (c1 - 1) / bm.bk - bj0 + 1;
        for (int m = m_lo; m < m_hi; ++m) {
            const int r0 = m * BR, r1 = min(p.sq, r0 + BR);
            const int bi0 = r0 / bm.bq, nbi = (r1 - 1) / bm.bq - bi0 + 1, per_head = nbi * nbj;
            // Every query head of the kv head's group: per_head bytes of each one's plane.
            const auto on = [&](int x) {
                const int hh = x / per_head, y = x - hh * per_head;
                const unsigned char* pl = bm.plane(b, hkv * p.group + hh);
                return pl[(bi0 + y / nbj) * bm.s_i + (bj0 + y % nbj) * bm.s_j] != 0;
            };
            bool all;
            if (warp_vote_any(p.group * per_head, lane, on, all)) {
                const bool full = all && r1 - r0 == BR && vis.tile_full(r0, r1, c0, c0 + BC);
                if (lane == 0) out[1 + count] = m | (full ? BWD_TILE_FULL : 0);
                ++count;
            }
        }
    }
    if (lane == 0) out[0] = count;
}
#endif

#if FA_BWD_WS
// The consumer warpgroups and the producer warpgroup: one block per multiprocessor.
extern "C" __global__ void __launch_bounds__(FA_WARPS * 32 + 128, 1) flash_bwd(const __grid_constant__ BwdWsParams p) {
    extern __shared__ __align__(128) char smem[];
    const u32 base = smem_addr(smem);
    FlashBwd<FA_D, FA_BR, FA_WARPS, FA_BF16 != 0>::run_ws(p, smem + (((base + 1023u) & ~1023u) - base));
}
#elif FA_WGMMA
// One warpgroup per block (64 keys): two blocks per multiprocessor; two warpgroups: one.
#define FA_MIN_BLOCKS (FA_WARPS == 4 ? 2 : 1)
extern "C" __global__ void __launch_bounds__(FA_WARPS * 32, FA_MIN_BLOCKS) flash_bwd(const BwdParams p) {
    extern __shared__ __align__(128) char smem[];
    // The launcher adds 1 KiB so that the tiles can start on the swizzle's 1024-byte period.
    const u32 base = smem_addr(smem);
    FlashBwd<FA_D, FA_BR, FA_WARPS, FA_BF16 != 0>::run(p, smem + (((base + 1023u) & ~1023u) - base));
}
#else
extern "C" __global__ void __launch_bounds__(FA_WARPS * 32) flash_bwd(const BwdParams p) {
    extern __shared__ __align__(128) char smem[];
    FlashBwd<FA_D, FA_BR, FA_WARPS, FA_BF16 != 0>::run(p, smem);
}
#endif
