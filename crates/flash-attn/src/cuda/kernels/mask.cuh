// The visibility rule of DESIGN §2 on the device: a transcription of `mask::Visibility::span`,
// `key_range` and `classify` (interval rules only: causal both ways and the sliding window).
// Varlen needs no rule: a block only ever sees one sequence's rows and keys.

enum CausalRule { CAUSAL_NONE = 0, CAUSAL_BOTTOM_RIGHT = 1, CAUSAL_TOP_LEFT = 2 };

struct Visibility {
    int sq, sk, off;   // off = sk - sq aligns bottom-right causal and windows
    int causal;        // CausalRule
    int left, right;   // window sides, -1 = unbounded

    // Keys [lo, hi) visible to query i; both ends non-decreasing in i, lo <= hi.
    __device__ __forceinline__ void span(int i, int& lo, int& hi) const {
        int pos = i + off;
        lo = 0;
        hi = sk;
        if (causal == CAUSAL_BOTTOM_RIGHT) hi = min(hi, pos + 1);
        if (causal == CAUSAL_TOP_LEFT) hi = min(hi, i + 1);
        if (left >= 0) lo = max(lo, pos - left);
        if (right >= 0) hi = min(hi, pos + right + 1);
        lo = min(max(lo, 0), sk);
        hi = min(max(hi, lo), sk);
    }

    // Keys any of rows [r0, r1) may see: the bound of a query tile's key loop.
    __device__ __forceinline__ void key_range(int r0, int r1, int& lo, int& hi) const {
        int lo0, hi0, lo1, hi1;
        span(r0, lo0, hi0);
        span(r1 - 1, lo1, hi1);
        lo = lo0;
        hi = max(hi1, lo0);
    }

    // Whether every (i, j) of rows [r0, r1) x cols [c0, c1) is visible (TileClass::Full): the
    // predicate is then skipped. Monotone spans make the two corner rows decide.
    __device__ __forceinline__ bool tile_full(int r0, int r1, int c0, int c1) const {
        int lo_first, hi_first, lo_last, hi_last;
        span(r0, lo_first, hi_first);
        span(r1 - 1, lo_last, hi_last);
        return lo_last <= c0 && hi_first >= c1;
    }
};

// A block-sparse mask (DESIGN §2 rule 4) on the device: key j is visible to query i of (b, h) iff
// data[b·s_b + h·s_h + (i / bq)·s_i + (j / bk)·s_j] != 0. Field for field `BlockMaskParams` in
// src/cuda/launch.rs; compiled into the `_x` variants only.
struct BlockMask {
    const unsigned char* data;  // null: no block mask
    long long s_b, s_h, s_i, s_j;  // element strides of [b, h, qb, kb] (0 where broadcast)
    int bq, bk;                    // block size

    __device__ __forceinline__ bool active() const { return data != nullptr; }

    // The mask plane of sequence b, query head h.
    __device__ __forceinline__ const unsigned char* plane(int b, int h) const { return data + b * s_b + h * s_h; }

    __device__ __forceinline__ bool visible(const unsigned char* pl, int i, int j) const {
        return pl[(i / bq) * s_i + (j / bk) * s_j] != 0;
    }

    // Whether every run of `rows` consecutive query rows starting at a multiple of `rows`, and
    // every run of `cols` keys starting at a multiple of `cols`, lies in one mask block: then a
    // whole fragment group (a warp's 16 rows, a thread's 8-key n-tile) shares one mask byte, and
    // the kernels read one byte a group instead of dividing and reading for every element.
    __device__ __forceinline__ bool aligned(int rows, int cols) const { return bq % rows == 0 && bk % cols == 0; }

    // The mask blocks along a run of groups of `step` positions from `first` (a multiple of
    // `step`, which divides the block size: a group never straddles two blocks), one group at a
    // time: the block index advances by a counter, not a division (one division at the start).
    struct Walk {
        int block, rem, per_block;  // current block, groups already in it, groups a block
        __device__ __forceinline__ Walk(int first, int step, int block_size) {
            const int start = first / step;
            per_block = block_size / step;
            block = start / per_block;
            rem = start - block * per_block;
        }
        // To the next group; true when it starts the next block.
        __device__ __forceinline__ bool next() {
            if (++rem < per_block) return false;
            rem = 0;
            ++block;
            return true;
        }
    };

    // Whether any / every mask block under rows [r0, r1) x cols [c0, c1) (both non-empty) is on:
    // the tile is Skip when none is, and may be Full only when all are. Every thread of the block
    // calls it (two block-wide reductions), each reading a share of the mask blocks.
    __device__ __forceinline__ void classify(const unsigned char* pl, int r0, int r1, int c0, int c1, int tid,
                                             int threads, bool& any_on, bool& all_on) const {
        const int bi0 = r0 / bq, nbi = (r1 - 1) / bq - bi0 + 1;
        const int bj0 = c0 / bk, nbj = (c1 - 1) / bk - bj0 + 1;
        bool any = false, all = true;
        for (int x = tid; x < nbi * nbj; x += threads) {
            const bool on = pl[(bi0 + x / nbj) * s_i + (bj0 + x % nbj) * s_j] != 0;
            any |= on;
            all &= on;
        }
        any_on = __syncthreads_or(any) != 0;
        all_on = __syncthreads_and(all) != 0;
    }
};

// A warp's vote over n block-mask bytes, each lane reading every 32nd (`on(x)`: whether byte x is
// on): whether any is on, the same in every lane; where one is, `all_on` says whether every one is.
// (The warp-specialised kernels' tile lists: `flash_fwd_ws_tiles`, `flash_bwd_ws_tiles`.)
template <class On>
__device__ __forceinline__ bool warp_vote_any(int n, int lane, On on, bool& all_on) {
    bool any = false, all = true;
    for (int x = lane; x < n; x += 32) {
        const bool v = on(x);
        any |= v;
        all &= v;
    }
    if (!__any_sync(0xffffffffu, any)) return false;
    all_on = __all_sync(0xffffffffu, all);
    return true;
}

// The score modifiers of DESIGN §2 steps 2-3 on a score x = scale · q·k (natural units):
// softcap c > 0: x = c · tanh(x / c); ALiBi: x -= slope · |i + off - j|. Field for field
// `ScoreMod` in src/cuda/launch.rs, which also computes the derived constants (in f64).
struct ScoreMod {
    const float* alibi;  // [batch][hq] slopes, or null
    float softcap;       // 0: none
    float scale;         // the softmax scale (scores are scale · q·k before the modifiers)
    float scale_log2;    // scale · log2 e
    float tanh_scale;    // scale / softcap (0 without softcap)
    float cap_log2;      // softcap · log2 e
    float inv_cap_log2;  // 1 / (softcap · log2 e) (0 without softcap): tanh from a score in exp2 units

    __device__ __forceinline__ bool active() const { return softcap > 0.f || alibi != nullptr; }

    __device__ __forceinline__ float slope(int b, int h, int hq) const { return alibi ? alibi[b * hq + h] : 0.f; }

    // Softcap alone on the raw product qk = q·k, in exp2 units: c · log2 e · tanh(scale · qk / c),
    // on the special-function unit's tanh (`tanh_approx`: one instruction, relative error below
    // 2^-10.98, ±1 at the extremes, NaN kept). Measured on an H100 against the five instructions
    // of 1 - 2 / (2^x + 1) on ex2 and rcp: softcap's forward cost 1.6-1.9x -> 1.2-1.6x the plain
    // forward's (docs/cuda-notes.md, session 37); the contract's tests pass on it.
    __device__ __forceinline__ float softcap_log2(float qk) const { return cap_log2 * tanh_approx(qk * tanh_scale); }

    // The modified score of the raw product qk = q·k, in exp2 units (times log2 e), as the
    // softmax takes it. Softcap: c · tanh(scale · qk / c) (`softcap_log2`). ALiBi (slope of this
    // (b, h), distance i + off - j) after it. SOFTCAP, ALIBI: whether the kernel variant holds
    // that path (its code is left out otherwise).
    template <bool SOFTCAP, bool ALIBI>
    __device__ __forceinline__ float apply_log2(float qk, float slope_bh, int dist) const {
        float x;
        if (SOFTCAP && softcap > 0.f) {
            x = softcap_log2(qk);
        } else {
            x = qk * scale_log2;
        }
        if (ALIBI && alibi) x = fmaf(-slope_bh * FA_LOG2E, fabsf((float)dist), x);
        return x;
    }
};
