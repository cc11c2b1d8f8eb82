// Attention over a KV cache (DESIGN §6): Flash-Decoding with GQA packing, on tensor cores.
//
// A block (4 warps) owns (sequence, kv head, group of up to 16 packed query rows, split of the
// keys). The packed rows of a kv head are the hq / hk query heads that read it times the sq query
// tokens (row r = i · group + hh): one m16 tile, so each key and value is read once per kv head.
// Tiles of 64 keys, K and V, stream from the cache (contiguous, or paged with any page size: a
// row's address comes from the block table, fetched a tile ahead) into shared memory by cp.async,
// several stages deep; each warp multiplies its 16 keys of a tile with mma.sync m16n8k16
// (S = Q Kᵀ, then O += P V with P rounded to the dtype, as FlashAttention-2), keeping its own
// online-softmax state. The warps merge at the end of the block; with several splits the block
// writes its normalised output and log-sum-exp, which `flash_decode_combine` merges in split
// order. `flash_decode_append` writes new keys (rotated) and values into the cache first and
// `flash_decode_rotary_q` rotates the queries.
//
// Compile-time: FD_D (64, 128 or 256: the row width, d padded up), FD_BF16. Elements travel as
// raw 16-bit words (tile.cuh's helpers convert).

#ifndef FD_D
#define FD_D 128
#endif
#ifndef FD_BF16
#define FD_BF16 1
#endif

// Field for field `DecodeParams` in src/cuda/decode.rs.
struct DecodeParams {
    const u16* q;             // [b, sq, hq, d] (strided)
    const u16* k;             // cache: [rows|pages, positions|page_size, hk, d]
    const u16* v;
    u16* o;                   // [b, sq, hq, d] (strided)
    float* lse;               // [b, hq, sq]
    float* part_o;            // [b, hk, splits, m, d] when splits > 1
    float* part_lse;          // [b, hk, splits, m]
    const int* sk;            // [b] keys each sequence attends to
    const int* start;         // [b] cache position of key 0 (leftpad)
    const int* cache_row;     // [b] contiguous: cache row of each sequence
    const int* block_table;   // [b, max_pages] paged, else null
    const float* alibi;       // [b, hq] slopes, or null
    long long bt_batch;       // block table row stride
    long long q_batch, q_row, q_head;
    long long k_page, k_row, k_head;
    long long v_page, v_row, v_head;
    long long o_batch, o_row, o_head;
    int page_size;            // paged: tokens a page
    int page_shift;           // log2(page_size) when a power of two, else -1
    int batch, hq, hk, group, sq, d, m, splits, row_groups;
    int causal, window_left, window_right;
    float scale, scale_log2, softcap;
};

// Field for field `AppendParams` in src/cuda/decode.rs.
struct AppendParams {
    const u16* k_new;          // [b, sn, hk, d]
    const u16* v_new;
    u16* k;                    // the caches, as in DecodeParams
    u16* v;
    const u16* q;              // [b, sq, hq, d]
    u16* q_rot;                // [b, sq, hq, d] contiguous: the rotated queries
    const u16* cos;            // [max_pos, rd / 2]
    const u16* sin;
    const int* seqlens;        // [b] cache_seqlens before the call
    const int* cache_row;
    const int* block_table;
    long long bt_batch;
    long long kn_batch, kn_row, kn_head;
    long long vn_batch, vn_row, vn_head;
    long long q_batch, q_row, q_head;
    long long k_page, k_row, k_head;
    long long v_page, v_row, v_head;
    long long cos_row, sin_row;
    int page_size;
    int batch, sn, sq, hq, hk, d, rd, interleaved, q_positions_advance;
};

static constexpr int FD_WARPS = 4;
static constexpr int FD_THREADS = FD_WARPS * 32;
static constexpr int FD_ROWS = 16;                 // packed rows a block: one m16 tile
static constexpr int FD_KEYS = FD_WARPS * 16;      // keys a tile: 16 a warp
static constexpr int FD_STAGES = FD_D == 256 ? 2 : (FD_D == 128 ? 3 : 4);
static constexpr int FD_CPR = FD_D / 8;            // 16-byte chunks a row
static constexpr int FD_TILE_BYTES = FD_KEYS * FD_D * 2;
static constexpr int FD_Q_BYTES = FD_ROWS * FD_D * 2;
static constexpr int FD_CHUNK = 64;                // split boundaries are multiples of this
// Dynamic shared memory: Q, then FD_STAGES tiles of K and of V (the merge reuses the tiles).
static constexpr int FD_SMEM_BYTES = FD_Q_BYTES + FD_STAGES * 2 * FD_TILE_BYTES;
static_assert(FD_THREADS % FD_CPR == 0, "tile loads must split evenly");
static_assert(FD_WARPS * FD_ROWS * (FD_D + 2) * 4 <= FD_STAGES * 2 * FD_TILE_BYTES, "the merge must fit the tiles");

// The cache slot (dimension 0, dimension 1) of cache position `pos` of sequence `b`.
__device__ __forceinline__ void fd_slot(const int* block_table, long long bt_batch, const int* cache_row, int page_size,
                                        int b, int pos, long long& i0, long long& i1) {
    if (block_table) {
        i0 = block_table[(long long)b * bt_batch + pos / page_size];
        i1 = pos % page_size;
    } else {
        i0 = cache_row[b];
        i1 = pos;
    }
}

// Keys [lo, hi) of split `s` of `n` over `sk` keys, in whole chunks of FD_CHUNK keys (the CPU's
// rule, so a split count means the same ranges on both backends).
__device__ __forceinline__ void fd_split_range(int sk, int s, int n, int& lo, int& hi) {
    const long long chunks = (sk + FD_CHUNK - 1) / FD_CHUNK;
    lo = (int)min((long long)sk, (s * chunks / n) * FD_CHUNK);
    hi = (int)min((long long)sk, ((s + 1) * chunks / n) * FD_CHUNK);
    if (hi < lo) hi = lo;
}

// Visible keys of query token i: [lo, hi) (DESIGN §2; off = sk - sq).
__device__ __forceinline__ void fd_span(const DecodeParams& p, int i, int sk, int& lo, int& hi) {
    const int pos = i + sk - p.sq;
    lo = 0;
    hi = sk;
    if (p.causal == 1) hi = min(hi, pos + 1);
    if (p.causal == 2) hi = min(hi, i + 1);
    if (p.window_left >= 0) lo = max(lo, pos - p.window_left);
    if (p.window_right >= 0) hi = min(hi, pos + p.window_right + 1);
    lo = max(lo, 0);
    hi = max(min(hi, sk), lo);
}

// One score in exp2 units after the modifiers, or -inf where key j is hidden from packed row r.
__device__ __forceinline__ float fd_score(const DecodeParams& p, float dot, int r, int rows, int tok, float slope, int j,
                                          int hi, int vlo, int vhi, int off, bool plain) {
    if (r >= rows || j >= hi || j < vlo || j >= vhi) return -FA_INF;
    if (plain) return dot * p.scale_log2;
    float x = dot * p.scale;
    if (p.softcap > 0.f) x = p.softcap * fast_tanh(__fdividef(x, p.softcap));
    x -= slope * fabsf((float)(tok + off - j));
    return x * FA_LOG2E;
}

extern "C" __global__ void __launch_bounds__(FD_THREADS) flash_decode(const DecodeParams p) {
    const int split = blockIdx.x;
    const int kv = blockIdx.y / p.row_groups, rg = blockIdx.y % p.row_groups;
    const int b = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t4 = lane % 4;
    const int r0 = rg * FD_ROWS;
    const int rows = min(FD_ROWS, p.m - r0);
    const int sk = p.sk[b], start = p.start[b];
    const int off = sk - p.sq;

    // The block's keys: its split, cut to what its rows can see.
    int lo, hi;
    fd_split_range(sk, split, p.splits, lo, hi);
    {
        int vlo0, vhi0, vlo1, vhi1;
        fd_span(p, r0 / p.group, sk, vlo0, vhi0);
        fd_span(p, (r0 + rows - 1) / p.group, sk, vlo1, vhi1);
        lo = max(lo, vlo0);
        hi = min(hi, max(vhi1, vlo0));
        if (hi < lo) hi = lo;
    }

    extern __shared__ __align__(128) unsigned char fd_smem[];
    const u32 sQ = smem_addr(fd_smem);
    const u32 sK = sQ + FD_Q_BYTES;
    const u32 sV = sK + FD_STAGES * FD_TILE_BYTES;
    const int ch = threadIdx.x % FD_CPR, row0 = threadIdx.x / FD_CPR;
    constexpr int ROW_STEP = FD_THREADS / FD_CPR;
    const bool col_in = ch * 8 < p.d;

    // Q: the block's packed rows (zero past `rows` and past d), swizzled for ldmatrix.
    for (int r = row0; r < FD_ROWS; r += ROW_STEP) {
        const int rr = min(r0 + r, p.m - 1);
        const u16* src = p.q + b * p.q_batch + (rr / p.group) * p.q_row + (kv * p.group + rr % p.group) * p.q_head + ch * 8;
        const bool valid = r < rows && col_in;
        cp_async_16(sQ + swizzled_offset<FD_D>(r, ch), valid ? src : p.q, valid);
    }
    cp_async_commit();

    // K and V tiles of FD_KEYS keys stream through FD_STAGES shared-memory stages by cp.async.
    // A thread copies chunk `ch` of rows row0, row0 + ROW_STEP, ... of each tile. The cache rows
    // (pages) of the next tile's keys are fetched one tile ahead, so the block table's latency
    // never stands between a tile and its copy.
    constexpr int RPT = FD_KEYS / ROW_STEP;
    int pg[RPT];
    // A thread's rows of a tile are ROW_STEP positions apart: one division a tile gives the page
    // and row of the first, and the rest follow by steps (a shift where the page size is a power
    // of two).
    auto fetch_pages = [&](int tile) {
        const int jt = lo + tile * FD_KEYS;
        const int pos0 = start + jt + row0;
        int q = p.page_shift >= 0 ? pos0 >> p.page_shift : pos0 / p.page_size;
        int r = pos0 - q * p.page_size;
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int j = jt + row0 + i * ROW_STEP;
            if (p.block_table == nullptr) {
                pg[i] = p.cache_row[b];
            } else if (j < hi) {
                const int page = p.page_shift >= 0 ? (pos0 + i * ROW_STEP) >> p.page_shift : q;
                pg[i] = p.block_table[(long long)b * p.bt_batch + page];
            } else {
                pg[i] = 0;
            }
            if (p.page_shift < 0) {
                r += ROW_STEP;
                while (r >= p.page_size) {
                    r -= p.page_size;
                    ++q;
                }
            }
        }
    };
    auto load_tile = [&](int tile, int stage) {
        const int jt = lo + tile * FD_KEYS;
        const int pos0 = start + jt + row0;
        int r = p.page_shift >= 0 ? pos0 & (p.page_size - 1) : pos0 % p.page_size;
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int kk = row0 + i * ROW_STEP;
            const int j = jt + kk;
            const bool valid = j < hi && col_in;
            long long i1;
            if (p.block_table == nullptr) {
                i1 = start + j;
            } else if (p.page_shift >= 0) {
                i1 = (pos0 + i * ROW_STEP) & (p.page_size - 1);
            } else {
                i1 = r;
                r += ROW_STEP;
                while (r >= p.page_size) r -= p.page_size;
            }
            const u16* kg = p.k + (long long)pg[i] * p.k_page + i1 * p.k_row + kv * p.k_head + ch * 8;
            const u16* vg = p.v + (long long)pg[i] * p.v_page + i1 * p.v_row + kv * p.v_head + ch * 8;
            const u32 at = stage * FD_TILE_BYTES + swizzled_offset<FD_D>(kk, ch);
            cp_async_16(sK + at, valid ? kg : p.k, valid);
            cp_async_16(sV + at, valid ? vg : p.v, valid);
        }
    };
    const int tiles = (hi - lo + FD_KEYS - 1) / FD_KEYS;
#pragma unroll
    for (int st = 0; st < FD_STAGES - 1; ++st) {
        if (st < tiles) {
            fetch_pages(st);
            load_tile(st, st);
        }
        cp_async_commit();
    }
    // 256-wide rows leave no registers for the pages of a tile ahead: they are fetched in place.
    constexpr bool AHEAD = FD_D < 256;
    if (AHEAD && FD_STAGES - 1 < tiles) fetch_pages(FD_STAGES - 1);

    // Rows g and g + 8 of the m16 tile are this thread's: their tokens, heads and spans.
    int tok[2], vlo[2], vhi[2];
    float slope[2];
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
        const int rr = min(r0 + g + 8 * h2, p.m - 1);
        tok[h2] = rr / p.group;
        slope[h2] = p.alibi ? p.alibi[b * p.hq + kv * p.group + rr % p.group] : 0.f;
        fd_span(p, tok[h2], sk, vlo[h2], vhi[h2]);
    }
    const bool plain = p.softcap <= 0.f && p.alibi == nullptr;

    FragA qa[FD_D / 16];
    FragC o[FD_D / 8];
#pragma unroll
    for (int nt = 0; nt < FD_D / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[nt].x[e] = 0.f;
    float m_run[2] = {-FA_INF, -FA_INF}, l_run[2] = {0.f, 0.f};
    bool q_loaded = false;

    for (int tile = 0; tile < tiles; ++tile) {
        cp_async_wait<FD_STAGES - 2>();
        __syncthreads();
        if (!q_loaded) {
#pragma unroll
            for (int kk = 0; kk < FD_D / 16; ++kk) qa[kk] = load_a<FD_D>(sQ, 0, kk, lane);
            q_loaded = true;
        }
        // The stage refilled now was read in the previous iteration, which every thread left
        // before the barrier above.
        if (tile + FD_STAGES - 1 < tiles) {
            if (!AHEAD) fetch_pages(tile + FD_STAGES - 1);
            load_tile(tile + FD_STAGES - 1, (tile + FD_STAGES - 1) % FD_STAGES);
        }
        cp_async_commit();
        if (AHEAD && tile + FD_STAGES < tiles) fetch_pages(tile + FD_STAGES);
        const int stage = tile % FD_STAGES;
        const u32 tK = sK + stage * FD_TILE_BYTES, tV = sV + stage * FD_TILE_BYTES;

        // S = Q Kᵀ for this warp's 16 keys.
        FragC s[2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt].x[e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < FD_D / 16; ++kk) {
            FragB b0, b1;
            load_b_pair<FD_D>(tK, 16 * warp, kk, lane, b0, b1);
            mma<FD_BF16>(s[0], qa[kk], b0);
            mma<FD_BF16>(s[1], qa[kk], b1);
        }
        // Scores in exp2 units, masked; the online softmax of rows g and g + 8.
        const int jw = lo + tile * FD_KEYS + 16 * warp;
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
            const int r = g + 8 * h2;
            float mx = -FA_INF;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = jw + 8 * nt + 2 * t4 + e;
                    float& x = s[nt].x[2 * h2 + e];
                    x = fd_score(p, x, r, rows, tok[h2], slope[h2], j, hi, vlo[h2], vhi[h2], off, plain);
                    mx = fmaxf(mx, x);
                }
            mx = fmaxf(quad_max(mx), m_run[h2]);
            const float alpha = mx == -FA_INF ? 1.f : fast_exp2(m_run[h2] - mx);
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = s[nt].x[2 * h2 + e];
                    x = x == -FA_INF ? 0.f : fast_exp2(x - mx);
                    sum += x;
                }
            m_run[h2] = mx;
            l_run[h2] = l_run[h2] * alpha + sum;
#pragma unroll
            for (int nt = 0; nt < FD_D / 8; ++nt) {
                o[nt].x[2 * h2] *= alpha;
                o[nt].x[2 * h2 + 1] *= alpha;
            }
        }
        // O += P V: P rounded to the dtype (as FlashAttention-2), V transposed on load.
        const FragA pa = scores_to_a<FD_BF16>(s[0], s[1]);
#pragma unroll
        for (int dp = 0; dp < FD_D / 16; ++dp) {
            FragB b0, b1;
            load_b_pair_trans<FD_D>(tV, 16 * warp, dp, lane, b0, b1);
            mma<FD_BF16>(o[2 * dp], pa, b0);
            mma<FD_BF16>(o[2 * dp + 1], pa, b1);
        }
    }

    // Each warp's rows: sums over its quads; then the warps merge through shared memory.
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) l_run[h2] = quad_sum(l_run[h2]);
    cp_async_wait<0>();
    __syncthreads();
    float* sm = reinterpret_cast<float*>(fd_smem + FD_Q_BYTES);
    float (*sm_o)[FD_ROWS][FD_D] = reinterpret_cast<float (*)[FD_ROWS][FD_D]>(sm);
    float (*sm_m)[FD_ROWS] = reinterpret_cast<float (*)[FD_ROWS]>(sm + FD_WARPS * FD_ROWS * FD_D);
    float (*sm_l)[FD_ROWS] = reinterpret_cast<float (*)[FD_ROWS]>(sm + FD_WARPS * FD_ROWS * (FD_D + 1));
#pragma unroll
    for (int nt = 0; nt < FD_D / 8; ++nt)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
            sm_o[warp][g + 8 * h2][8 * nt + 2 * t4] = o[nt].x[2 * h2];
            sm_o[warp][g + 8 * h2][8 * nt + 2 * t4 + 1] = o[nt].x[2 * h2 + 1];
        }
    if (t4 == 0) {
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
            sm_m[warp][g + 8 * h2] = m_run[h2];
            sm_l[warp][g + 8 * h2] = l_run[h2];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < rows * p.d; idx += FD_THREADS) {
        const int r = idx / p.d, e = idx % p.d;
        float mx = -FA_INF;
#pragma unroll
        for (int w = 0; w < FD_WARPS; ++w) mx = fmaxf(mx, sm_m[w][r]);
        float l = 0.f, acc = 0.f;
        if (mx != -FA_INF) {
#pragma unroll
            for (int w = 0; w < FD_WARPS; ++w) {
                const float f = fast_exp2(sm_m[w][r] - mx);
                l += sm_l[w][r] * f;
                acc += sm_o[w][r][e] * f;
            }
        }
        const bool none = mx == -FA_INF || l == 0.f;
        const float out = none ? 0.f : acc / l;
        const float lse = none ? -FA_INF : (mx + __log2f(l)) * FA_LN2;
        const int rr = r0 + r;
        const int i = rr / p.group, h = kv * p.group + rr % p.group;
        if (p.splits == 1) {
            u16* dst = p.o + b * p.o_batch + i * p.o_row + h * p.o_head + e;
            *dst = (u16)(pack2<FD_BF16>(out, 0.f) & 0xffffu);
            if (e == 0) p.lse[((long long)b * p.hq + h) * p.sq + i] = lse;
        } else {
            const long long at = (((long long)b * p.hk + kv) * p.splits + split) * p.m + rr;
            p.part_o[at * p.d + e] = out;
            if (e == 0) p.part_lse[at] = lse;
        }
    }
}

// Merges the splits' partial outputs of one packed row by their log-sum-exp, in split order.
// Grid (m, hk, b); FD_THREADS threads over the row's columns.
extern "C" __global__ void __launch_bounds__(FD_THREADS, 1) flash_decode_combine(const DecodeParams p) {
    const int rr = blockIdx.x, kv = blockIdx.y, b = blockIdx.z;
    const long long base = (((long long)b * p.hk + kv) * p.splits) * p.m + rr;
    float mx = -FA_INF;
    bool nan = false;
    for (int s = 0; s < p.splits; ++s) {
        const float l = p.part_lse[base + (long long)s * p.m];
        nan |= l != l;
        mx = fmaxf(mx, l);
    }
    float sum = 0.f;
    if (mx != -FA_INF)
        for (int s = 0; s < p.splits; ++s) sum += __expf(p.part_lse[base + (long long)s * p.m] - mx);
    const int i = rr / p.group, h = kv * p.group + rr % p.group;
    for (int e = threadIdx.x; e < p.d; e += FD_THREADS) {
        float acc = 0.f;
        if (mx != -FA_INF) {
            for (int s = 0; s < p.splits; ++s) {
                const long long at = base + (long long)s * p.m;
                const float w = __expf(p.part_lse[at] - mx);
                if (w != 0.f) acc = fmaf(w / sum, p.part_o[at * p.d + e], acc);
            }
        }
        if (nan) acc = __int_as_float(0x7fc00000);
        u16* dst = p.o + b * p.o_batch + i * p.o_row + h * p.o_head + e;
        *dst = (u16)(pack2<FD_BF16>(acc, 0.f) & 0xffffu);
    }
    if (threadIdx.x == 0) {
        const float lse = nan ? __int_as_float(0x7fc00000) : (mx == -FA_INF ? -FA_INF : mx + __logf(sum));
        p.lse[((long long)b * p.hq + h) * p.sq + i] = lse;
    }
}

// Rotates elements [0, rd) of a row held at `src` (f32 arithmetic, rounded once) into `dst`,
// copies the rest: element e pairs with e ^ 1 (interleaved) or e ± rd / 2.
__device__ __forceinline__ void fd_rotate_row(u16* dst, const u16* src, const u16* cos, const u16* sin, int d, int rd,
                                              bool interleaved) {
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        const float x = to_f32<FD_BF16>(src[e]);
        float y = x;
        if (e < rd) {
            const int half = rd / 2;
            const bool first = interleaved ? (e % 2 == 0) : (e < half);
            const int partner = interleaved ? (e ^ 1) : (first ? e + half : e - half);
            const int f = interleaved ? e / 2 : (first ? e : e - half);
            const float c = to_f32<FD_BF16>(cos[f]), s = to_f32<FD_BF16>(sin[f]);
            const float xp = to_f32<FD_BF16>(src[partner]);
            // (a, b) -> (a c - b s, a s + b c), in the CPU's operation order.
            y = first ? __fsub_rn(__fmul_rn(x, c), __fmul_rn(xp, s)) : __fadd_rn(__fmul_rn(xp, s), __fmul_rn(x, c));
        }
        dst[e] = (u16)(pack2<FD_BF16>(y, 0.f) & 0xffffu);
    }
}

// Writes the new keys (rotated when rotary is on) and values into the cache. Grid (sn, hk, b).
extern "C" __global__ void flash_decode_append(const AppendParams p) {
    const int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int pos = p.seqlens[b] + t;
    long long i0, i1;
    fd_slot(p.block_table, p.bt_batch, p.cache_row, p.page_size, b, pos, i0, i1);
    const u16* ks = p.k_new + b * p.kn_batch + t * p.kn_row + h * p.kn_head;
    u16* kd = p.k + i0 * p.k_page + i1 * p.k_row + h * p.k_head;
    if (p.rd > 0) {
        fd_rotate_row(kd, ks, p.cos + pos * p.cos_row, p.sin + pos * p.sin_row, p.d, p.rd, p.interleaved);
    } else {
        for (int e = threadIdx.x; e < p.d; e += blockDim.x) kd[e] = ks[e];
    }
    const u16* vs = p.v_new + b * p.vn_batch + t * p.vn_row + h * p.vn_head;
    u16* vd = p.v + i0 * p.v_page + i1 * p.v_row + h * p.v_head;
    for (int e = threadIdx.x; e < p.d; e += blockDim.x) vd[e] = vs[e];
}

// Rotates the queries into `q_rot` ([b, sq, hq, d], contiguous). Grid (sq, hq, b).
extern "C" __global__ void flash_decode_rotary_q(const AppendParams p) {
    const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int pos = p.seqlens[b] + (p.q_positions_advance ? i : 0);
    const u16* src = p.q + b * p.q_batch + i * p.q_row + h * p.q_head;
    u16* dst = p.q_rot + (((long long)b * p.sq + i) * p.hq + h) * p.d;
    fd_rotate_row(dst, src, p.cos + pos * p.cos_row, p.sin + pos * p.sin_row, p.d, p.rd, p.interleaved);
}
