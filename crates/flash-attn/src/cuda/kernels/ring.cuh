// Helpers of context parallelism (DESIGN §8, src/cuda/ring.rs): the log-sum-exp merge of a
// step's partial result into a rank's running one, float32 accumulation of a step's gradients,
// the row gathers of zigzag's half steps, and the final narrowing. Rows are tokens of a rank's
// packed local tensors ([t, heads, dim], contiguous); a `map` (nullable: identity) sends row i of a
// half-chunk buffer to local row map[i].
//
// Compile-time: RING_BF16 (1: bfloat16 elements, 0: float16). Self-contained (no CUDA headers):
// elements travel as raw 16-bit words, as in tile.cuh.

#ifndef RING_BF16
#define RING_BF16 1
#endif

#define RING_NEG_INF __int_as_float(0xff800000)

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float ring_to_f32(u16 w) {
#if RING_BF16
    return __uint_as_float(((u32)w) << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(w));
    return f;
#endif
}

__device__ __forceinline__ u16 ring_from_f32(float x) {
    u16 w;
#if RING_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(w) : "f"(x));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(w) : "f"(x));
#endif
    return w;
}

// Field for field `MergeParams` in src/cuda/ring.rs.
struct MergeParams {
    float* acc;           // [t, h, dv] f32
    float* acc_lse;       // [h, t]
    const u16* part;      // [tp, h, dv]
    const float* part_lse;// [h, tp]
    const int* map;       // [tp] or null
    long long t, tp, h, dv;
};

// One warp per (part row, head), grid-striding over them: the same formula as
// `ring::merge_row` on the CPU.
extern "C" __global__ void ring_merge(const MergeParams p) {
    const int lane = threadIdx.x & 31;
    const long long warps = p.tp * p.h, stride = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; warp < warps; warp += stride) {
        long long pt = warp / p.h, hh = warp % p.h;
        long long lt = p.map ? (long long)p.map[pt] : pt;
        float b = p.part_lse[hh * p.tp + pt];
        float a = p.acc_lse[hh * p.t + lt];
        if (b == RING_NEG_INF) continue;
        float* acc = p.acc + (lt * p.h + hh) * p.dv;
        const u16* part = p.part + (pt * p.h + hh) * p.dv;
        if (a == RING_NEG_INF) {
            for (long long e = lane; e < p.dv; e += 32) acc[e] = ring_to_f32(part[e]);
        } else {
            float m = fmaxf(a, b);
            float wa = expf(a - m), wb = expf(b - m);
            float sum = wa + wb;
            wa = wa / sum;
            wb = wb / sum;
            for (long long e = lane; e < p.dv; e += 32) acc[e] = acc[e] * wa + ring_to_f32(part[e]) * wb;
            b = m + logf(sum);
        }
        __syncwarp();
        if (lane == 0) p.acc_lse[hh * p.t + lt] = b;
    }
}

// Field for field `RowsParams` in src/cuda/ring.rs.
struct RowsParams {
    void* dst;
    const void* src;
    const int* map;       // [rows] or null
    long long rows, row;  // rows of the part buffer, elements a row
    long long t;          // rows of the local buffer (gather_lse: tokens a head row)
};

// acc[map[i]] += part[i] (f32 += element).
extern "C" __global__ void ring_add(const RowsParams p) {
    long long n = p.rows * p.row;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / p.row, e = i % p.row;
        long long lr = p.map ? (long long)p.map[r] : r;
        ((float*)p.dst)[lr * p.row + e] += ring_to_f32(((const u16*)p.src)[i]);
    }
}

// part[i] = local[map[i]] (elements).
extern "C" __global__ void ring_gather(const RowsParams p) {
    long long n = p.rows * p.row;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / p.row, e = i % p.row;
        ((u16*)p.dst)[i] = ((const u16*)p.src)[(long long)p.map[r] * p.row + e];
    }
}

// lse rows: dst[h][i] = src[h][map[i]] for `row` heads, src rows of `t` tokens, dst of `rows`.
extern "C" __global__ void ring_gather_lse(const RowsParams p) {
    long long n = p.rows * p.row;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long hh = i / p.rows, r = i % p.rows;
        ((float*)p.dst)[i] = ((const float*)p.src)[hh * p.t + p.map[r]];
    }
}

// dst = element(src) for `rows · row` values.
extern "C" __global__ void ring_narrow(const RowsParams p) {
    long long n = p.rows * p.row;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        ((u16*)p.dst)[i] = ring_from_f32(((const float*)p.src)[i]);
    }
}

// dst = -inf for `rows · row` floats (a merge's empty start).
extern "C" __global__ void ring_fill_neg_inf(const RowsParams p) {
    long long n = p.rows * p.row;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        ((float*)p.dst)[i] = RING_NEG_INF;
    }
}
