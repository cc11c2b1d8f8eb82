// Philox4x32-10 and the dropout keep mask on the device: a line-for-line port of
// src/philox.rs (its module docs hold the definition and the Random123 known-answer vectors), so
// that a (seed, offset) pair draws the same mask on the CPU and the GPU, bit for bit.
//
//   key     = (seed mod 2^32, seed >> 32)
//   counter = (j / 4, i, b · hq + h, offset)          all u32, wrapping
//   u       = philox4x32_10(counter, key)[j % 4]
//   keep    = u >= threshold,  threshold = ceil(p · 2^32) (computed on the host in f64)

struct Philox4 { u32 x[4]; };

__device__ __forceinline__ Philox4 philox4x32_10(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    Philox4 r;
    r.x[0] = c0;
    r.x[1] = c1;
    r.x[2] = c2;
    r.x[3] = c3;
    return r;
}

// One dropout call's parameters, as the kernels take them (field for field in launch.rs).
struct DropoutParams {
    u32 seed_lo, seed_hi, offset;
    u32 threshold;   // keep iff u >= threshold; 0 keeps everything
    float scale;     // 1 / (1 - p), computed in f32 on the host
    int enabled;
};

// The four random words of keys 4·(j/4) .. 4·(j/4)+3 of query row i of stream bh = b·hq + h.
__device__ __forceinline__ Philox4 dropout_words(const DropoutParams& d, u32 bh, u32 i, u32 j) {
    return philox4x32_10(j >> 2, i, bh, d.offset, d.seed_lo, d.seed_hi);
}
