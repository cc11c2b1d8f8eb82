// Philox4x32-10 and the dropout keep mask on the device: a line-for-line port of
// src/philox.rs (its module docs hold the definition and the Random123 known-answer vectors), so
// that a (seed, offset) pair draws the same mask on the CPU and the GPU, bit for bit.
//
//   key       = (seed mod 2^32, seed >> 32)
//   counter   = (4·(j / 32) + (j % 8) / 2,  8·(i / 16) + i % 8,  b·hq + h,  offset)   u32, wrapping
//   byte      = 8·((i % 16) / 8) + 2·((j % 32) / 8) + j % 2
//   u         = (philox4x32_10(counter, key)[byte / 4] >> 8·(byte % 4)) & 0xff
//   keep      = u >= threshold,  threshold = min(round(p · 256), 255) (on the host)
//
// One call's 16 bytes are the 16 elements one thread holds of a 16 x 32 score block in the
// mma / wgmma accumulator layout (rows g, g + 8; columns 8n + 2t + {0, 1}, n = 0..3), so the
// forward draws each call once and uses all of it.

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
    u32 threshold;   // keep iff the element's byte u >= threshold (0 ..= 255); 0 keeps everything
    float scale;     // 1 / (1 - p), computed in f32 on the host
    int enabled;
};

// The call of stream bh = b·hq + h whose counter starts (c0, c1) = (4·(j / 32) + (j % 8) / 2,
// 8·(i / 16) + i % 8): the 16 random bytes of its elements.
__device__ __forceinline__ Philox4 dropout_call(const DropoutParams& d, u32 bh, u32 c0, u32 c1) {
    return philox4x32_10(c0, c1, bh, d.offset, d.seed_lo, d.seed_hi);
}

// `prmt.b32` in its default mode: a selector nibble with bit 3 set replicates the sign bit of
// the byte it selects.
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 selector) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
    return r;
}

// The keep masks of the four elements whose bytes are `word` (bytes 0, 1: pair 0, bytes 2, 3:
// pair 1) for probabilities packed two to a 32-bit word (16-bit halves, the lower byte's element
// in the low half): 0xffff in each half whose element is kept. `k_add` is
// (0x8000 - threshold) · 0x10001: added to a byte in a 16-bit lane, it sets the lane's bit 15 iff
// the byte is >= the threshold; prmt replicates those bits.
__device__ __forceinline__ void dropout_pair_masks(u32 word, u32 k_add, u32& m0, u32& m1) {
    const u32 even = (word & 0x00ff00ffu) + k_add;     // bytes 0 and 2, one per 16-bit lane
    const u32 odd = prmt(word, 0u, 0x4341u) + k_add;   // bytes 1 and 3
    m0 = prmt(even, odd, 0xdd99u);  // sign of byte 1 of even (byte 0's test) twice, of odd twice
    m1 = prmt(even, odd, 0xffbbu);  // the same for bytes 2 and 3 (byte 3 of each)
}
