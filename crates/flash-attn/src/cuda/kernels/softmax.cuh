// The online-softmax state of one warp's rows (FlashAttention-2, Algorithm 1 lines 8-10):
// a running row max and a running, per-thread partial row sum; the output accumulator is
// rescaled when the max grows and normalised once at the end.
//
// Scores arrive already multiplied by scale·log2(e), so probabilities are exp2(s - max) and the
// lse is (max + log2(sum)) · ln 2.

template <int MT>
struct OnlineSoftmax {
    float row_max[MT][2];  // rows g and g + 8 of each 16-row tile, log2 units
    float row_sum[MT][2];  // this thread's partial sums; quad-reduced in finish()

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                row_max[mt][r] = -FA_INF;
                row_sum[mt][r] = 0.f;
            }
    }

    // Turns the score tile s into probabilities in place; `correction` receives the factor the
    // output accumulator must be multiplied by (exp2(old max - new max)) before P·V is added.
    template <int NT>
    __device__ __forceinline__ void update_p(FragC (&s)[MT][NT], float (&correction)[MT][2]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float m = row_max[mt][r];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) m = fmaxf(m, fmaxf(s[mt][nt].x[2 * r], s[mt][nt].x[2 * r + 1]));
                m = quad_max(m);
                // A row with nothing visible yet keeps max = -inf; subtracting 0 instead keeps
                // exp2(-inf) = 0 rather than NaN.
                float base = (m == -FA_INF) ? 0.f : m;
                float corr = fast_exp2(row_max[mt][r] - base);
                row_max[mt][r] = m;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    float p0 = fast_exp2(s[mt][nt].x[2 * r] - base);
                    float p1 = fast_exp2(s[mt][nt].x[2 * r + 1] - base);
                    s[mt][nt].x[2 * r] = p0;
                    s[mt][nt].x[2 * r + 1] = p1;
                    sum += p0 + p1;
                }
                row_sum[mt][r] = row_sum[mt][r] * corr + sum;
                correction[mt][r] = corr;
            }
    }

    // o *= correction, row by row.
    template <int DT>
    static __device__ __forceinline__ void rescale(FragC (&o)[MT][DT], const float (&correction)[MT][2]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    o[mt][dt].x[2 * r] *= correction[mt][r];
                    o[mt][dt].x[2 * r + 1] *= correction[mt][r];
                }
    }

    // Turns the score tile s into probabilities in place and rescales the output accumulator o.
    template <int NT, int DT>
    __device__ __forceinline__ void update(FragC (&s)[MT][NT], FragC (&o)[MT][DT]) {
        float correction[MT][2];
        update_p(s, correction);
        rescale(o, correction);
    }

    // Final normalisation (Algorithm 1 line 12): o *= out_scale / sum (out_scale: dropout's
    // 1 / (1 - p), else 1), and each row's natural-log lse of the undropped softmax.
    // Rows that saw no key get o = 0 and lse = -inf (DESIGN §2, rule 5).
    template <int DT>
    __device__ __forceinline__ void finish(FragC (&o)[MT][DT], float (&lse)[MT][2], float out_scale = 1.f) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float sum = quad_sum(row_sum[mt][r]);
                // Empty: no visible key (sum 0). A NaN sum (a NaN score in the row) is not: it
                // reaches o and lse, as in the oracle (DESIGN §2).
                bool empty = sum == 0.f;
                float inv = empty ? 0.f : out_scale / sum;
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    o[mt][dt].x[2 * r] *= inv;
                    o[mt][dt].x[2 * r + 1] *= inv;
                }
                lse[mt][r] = empty ? -FA_INF : (row_max[mt][r] + __log2f(sum)) * FA_LN2;
            }
    }
};
