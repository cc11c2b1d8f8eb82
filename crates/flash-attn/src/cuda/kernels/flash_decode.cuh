// Attention over a KV cache (DESIGN §6): Flash-Decoding with GQA packing, on CUDA cores.
//
// At decode shapes the work is reading the cache once: a block owns (sequence, kv head, group of
// packed query rows, split of the keys) and streams its keys and values straight from global
// memory, contiguous or paged (any page size), with every load 8 to 32 bytes wide and NK of them
// in flight per thread before the first use. The packed rows of a kv head are the hq / hk query
// heads that read it times the sq query tokens (row r = i · group + hh), so each key and value is
// read once per kv head. A half-warp owns a key: each of its 16 threads holds D / 16 elements of
// the key's row and of each query row, partial dot products meet by xor-shuffles, and each thread
// accumulates its D / 16 output columns. Per-half-warp softmax states merge at the end of the
// block; splits write normalised partial outputs and their log-sum-exp, which
// `flash_decode_combine` merges in split order.
//
// Compile-time: FD_D (64, 128 or 256: the row width, d padded up), FD_R (packed rows a block:
// 1, 2, 4 or 8), FD_BF16. Elements travel as raw 16-bit words (tile.cuh's helpers convert).

#ifndef FD_D
#define FD_D 128
#endif
#ifndef FD_R
#define FD_R 4
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
static constexpr int FD_HALVES = FD_WARPS * 2;     // half-warps a block
static constexpr int FD_EPT = FD_D / 16;           // elements a thread holds of a row
static constexpr int FD_WORDS = FD_EPT / 2;        // ... as 32-bit words
static constexpr int FD_NK = FD_R <= 4 ? 4 : 2;    // keys a half-warp has in flight
static constexpr int FD_CHUNK = 64;                // split boundaries are multiples of this

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

// FD_EPT elements at `p` as words: zeros where the thread's columns are past `d` (d is a
// multiple of 8, so a 16-byte piece is wholly inside or outside).
__device__ __forceinline__ void fd_load_row(u32 (&w)[FD_WORDS], const u16* p, int col0, int d, bool valid) {
#pragma unroll
    for (int piece = 0; piece < (FD_WORDS + 3) / 4; ++piece) {
        constexpr int PW = FD_WORDS < 4 ? FD_WORDS : 4;  // words a piece
        const int col = col0 + piece * 2 * PW;
        const bool in = valid && col < d;
        if constexpr (PW == 4) {
            uint4 x = make_uint4(0, 0, 0, 0);
            if (in) x = __ldg(reinterpret_cast<const uint4*>(p + piece * 8));
            w[piece * 4 + 0] = x.x;
            w[piece * 4 + 1] = x.y;
            w[piece * 4 + 2] = x.z;
            w[piece * 4 + 3] = x.w;
        } else {
            uint2 x = make_uint2(0, 0);
            if (in) x = __ldg(reinterpret_cast<const uint2*>(p));
            w[0] = x.x;
            w[1] = x.y;
        }
    }
}

// Sum over the 16 threads of a half-warp (xor partners stay inside it).
__device__ __forceinline__ float fd_half_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 8);
    x += __shfl_xor_sync(0xffffffffu, x, 4);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x + __shfl_xor_sync(0xffffffffu, x, 1);
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

extern "C" __global__ void __launch_bounds__(FD_THREADS) flash_decode(const DecodeParams p) {
    const int split = blockIdx.x;
    const int kv = blockIdx.y / p.row_groups, rg = blockIdx.y % p.row_groups;
    const int b = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int half = warp * 2 + lane / 16, l16 = lane % 16;
    const int col0 = l16 * FD_EPT;
    const int r0 = rg * FD_R;
    const int rows = min(FD_R, p.m - r0);
    const int sk = p.sk[b], start = p.start[b];

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

    // This thread's columns of each packed row of q, in f32.
    float qf[FD_R][FD_EPT];
    int tok[FD_R], head[FD_R];
    float slope[FD_R];
#pragma unroll
    for (int r = 0; r < FD_R; ++r) {
        const int rr = min(r0 + r, p.m - 1);
        tok[r] = rr / p.group;
        head[r] = kv * p.group + rr % p.group;
        slope[r] = p.alibi ? p.alibi[b * p.hq + head[r]] : 0.f;
        u32 w[FD_WORDS];
        fd_load_row(w, p.q + b * p.q_batch + tok[r] * p.q_row + head[r] * p.q_head + col0, col0, p.d, true);
#pragma unroll
        for (int e = 0; e < FD_WORDS; ++e) {
            qf[r][2 * e] = to_f32<FD_BF16>(w[e]);
            qf[r][2 * e + 1] = to_f32<FD_BF16>(w[e] >> 16);
        }
    }

    float o[FD_R][FD_EPT], m_run[FD_R], l_run[FD_R];
#pragma unroll
    for (int r = 0; r < FD_R; ++r) {
        m_run[r] = -FA_INF;
        l_run[r] = 0.f;
#pragma unroll
        for (int e = 0; e < FD_EPT; ++e) o[r][e] = 0.f;
    }
    const bool plain = p.softcap <= 0.f && p.alibi == nullptr;
    const int off = sk - p.sq;

    for (int jb = lo; jb < hi; jb += FD_HALVES * FD_NK) {
        u32 kw[FD_NK][FD_WORDS], vw[FD_NK][FD_WORDS];
        int jk[FD_NK];
#pragma unroll
        for (int t = 0; t < FD_NK; ++t) {
            jk[t] = jb + t * FD_HALVES + half;
            const bool valid = jk[t] < hi;
            long long i0 = 0, i1 = 0;
            if (valid) fd_slot(p.block_table, p.bt_batch, p.cache_row, p.page_size, b, start + jk[t], i0, i1);
            fd_load_row(kw[t], p.k + i0 * p.k_page + i1 * p.k_row + kv * p.k_head + col0, col0, p.d, valid);
            fd_load_row(vw[t], p.v + i0 * p.v_page + i1 * p.v_row + kv * p.v_head + col0, col0, p.d, valid);
        }
        float s[FD_NK][FD_R];
#pragma unroll
        for (int t = 0; t < FD_NK; ++t) {
            float kf[FD_EPT];
#pragma unroll
            for (int e = 0; e < FD_WORDS; ++e) {
                kf[2 * e] = to_f32<FD_BF16>(kw[t][e]);
                kf[2 * e + 1] = to_f32<FD_BF16>(kw[t][e] >> 16);
            }
#pragma unroll
            for (int r = 0; r < FD_R; ++r) {
                float acc = 0.f;
#pragma unroll
                for (int e = 0; e < FD_EPT; ++e) acc = fmaf(qf[r][e], kf[e], acc);
                s[t][r] = fd_half_sum(acc);
            }
        }
        // Scores in exp2 units, masked.
#pragma unroll
        for (int r = 0; r < FD_R; ++r) {
            int vlo, vhi;
            fd_span(p, tok[r], sk, vlo, vhi);
            float mx = m_run[r];
#pragma unroll
            for (int t = 0; t < FD_NK; ++t) {
                float x;
                if (plain) {
                    x = s[t][r] * p.scale_log2;
                } else {
                    x = s[t][r] * p.scale;
                    if (p.softcap > 0.f) x = p.softcap * tanhf(x / p.softcap);
                    x -= slope[r] * fabsf((float)(tok[r] + off - jk[t]));
                    x *= FA_LOG2E;
                }
                const bool vis = r < rows && jk[t] >= vlo && jk[t] < vhi;
                s[t][r] = vis ? x : -FA_INF;
                mx = fmaxf(mx, s[t][r]);
            }
            // Rescale what was accumulated under the old maximum (nothing while none is finite).
            const float alpha = mx == -FA_INF ? 1.f : fast_exp2(m_run[r] - mx);
            float sum = 0.f;
            float pk[FD_NK];
#pragma unroll
            for (int t = 0; t < FD_NK; ++t) {
                pk[t] = s[t][r] == -FA_INF ? 0.f : fast_exp2(s[t][r] - mx);
                sum += pk[t];
            }
            m_run[r] = mx;
            l_run[r] = l_run[r] * alpha + sum;
#pragma unroll
            for (int e = 0; e < FD_WORDS; ++e) {
                float a0 = o[r][2 * e] * alpha, a1 = o[r][2 * e + 1] * alpha;
#pragma unroll
                for (int t = 0; t < FD_NK; ++t) {
                    // A masked key (p = 0) must not bring 0 · inf from its values.
                    if (pk[t] != 0.f) {
                        a0 = fmaf(pk[t], to_f32<FD_BF16>(vw[t][e]), a0);
                        a1 = fmaf(pk[t], to_f32<FD_BF16>(vw[t][e] >> 16), a1);
                    }
                }
                o[r][2 * e] = a0;
                o[r][2 * e + 1] = a1;
            }
        }
    }

    // Merge the two half-warps of each warp (lanes l and l ^ 16 hold the same columns), then the
    // warps through shared memory.
#pragma unroll
    for (int r = 0; r < FD_R; ++r) {
        const float m_other = __shfl_xor_sync(0xffffffffu, m_run[r], 16);
        const float l_other = __shfl_xor_sync(0xffffffffu, l_run[r], 16);
        const float mx = fmaxf(m_run[r], m_other);
        const float a = mx == -FA_INF ? 0.f : fast_exp2(m_run[r] - mx);
        const float c = mx == -FA_INF ? 0.f : fast_exp2(m_other - mx);
#pragma unroll
        for (int e = 0; e < FD_EPT; ++e) {
            const float other = __shfl_xor_sync(0xffffffffu, o[r][e], 16);
            o[r][e] = o[r][e] * a + other * c;
        }
        l_run[r] = l_run[r] * a + l_other * c;
        m_run[r] = mx;
    }
    __shared__ float sm_m[FD_WARPS][FD_R], sm_l[FD_WARPS][FD_R];
    __shared__ float sm_o[FD_WARPS][FD_R][FD_D];
    if (lane < 16) {
#pragma unroll
        for (int r = 0; r < FD_R; ++r) {
#pragma unroll
            for (int e = 0; e < FD_EPT; ++e) sm_o[warp][r][col0 + e] = o[r][e];
            if (l16 == 0) {
                sm_m[warp][r] = m_run[r];
                sm_l[warp][r] = l_run[r];
            }
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
extern "C" __global__ void __launch_bounds__(FD_THREADS) flash_decode_combine(const DecodeParams p) {
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
