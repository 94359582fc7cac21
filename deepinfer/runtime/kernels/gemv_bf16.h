/* Dot products of bf16 weight rows with a few (1..GEMV_MAX_M) bf16 input rows, float32
 * accumulation: the inner loop of small_batch_linear.c and of decode_stack.c's GEMVs, one
 * copy so both give the same bits. */
#ifndef DEEPINFER_GEMV_BF16_H
#define DEEPINFER_GEMV_BF16_H
#include "bf16_cpu.h"

#define GEMV_MAX_M 8
/* Each weight row is read front to back, one row after the other: one prefetch stream (reading
 * 8 rows side by side ran ~2x slower from memory on Zen 4). DEFINE_ROW_DOTS dots R rows with
 * the M input rows, dots[r * M + m]; R and M are compile-time constants and the loops fully
 * unrolled so the accumulators stay in registers (GCC otherwise kept them on the stack; from
 * M = 5 the 4 x M chains spill, ~20% slower at M = 8). The tail (K not a multiple of 32) uses a
 * zero-filling masked load. */
#ifdef HAVE_DPBF16
/* (c0 + c1) + (c2 + c3), then the 16 lanes summed in a fixed tree. The adds are the rounding
 * builtins, not `+` on vector types: under -ffast-math GCC may reassociate the latter, and did so
 * differently in different functions (the 1-row and the M-row dots then disagreed in the last
 * bit). */
static inline float sum_chains(__m512 c0, __m512 c1, __m512 c2, __m512 c3) {
#define GEMV_ADD(a, b) _mm512_add_round_ps((a), (b), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
    __m512 v = GEMV_ADD(GEMV_ADD(c0, c1), GEMV_ADD(c2, c3));
    v = GEMV_ADD(v, _mm512_shuffle_f32x4(v, v, 0x4E));  /* 256-bit halves */
    v = GEMV_ADD(v, _mm512_shuffle_f32x4(v, v, 0xB1));  /* 128-bit lanes */
    v = GEMV_ADD(v, _mm512_permute_ps(v, 0x4E));         /* pairs */
    v = GEMV_ADD(v, _mm512_permute_ps(v, 0xB1));         /* neighbours */
#undef GEMV_ADD
    return _mm512_cvtss_f32(v);
}
/* Every M, 1 included, sums its products in one order — four chains over the 32-wide chunks of
 * each 128-wide block (chunk j of a block into chain j; four independent chains while the
 * weight row is still read front to back), the tail chunks into chain 0, then (c0 + c1) +
 * (c2 + c3) — so a row's result does not depend on how many rows share the step (a
 * speculative verification row equals the same position decoded alone). */
#define DEFINE_ROW_DOTS(NAME, R, M)                                                             \
static void NAME(const uint16_t *w, const uint16_t *x, int K, float *dots) {                    \
    const int full = K / 128 * 128;                                                             \
    __m512 acc[4][R][M];                                                                        \
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++)                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                     \
            _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) acc[j][r][m] = _mm512_setzero_ps(); \
    for (int k = 0; k < full; k += 128) {                                                       \
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {                                   \
            __m512i xv[M];                                                                      \
            _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                 \
                xv[m] = _mm512_loadu_si512((const void *)(x + (int64_t)m * K + k + 32 * j));    \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                               \
                const __m512i wv = _mm512_loadu_si512((const void *)(w + (int64_t)r * K + k + 32 * j)); \
                _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                             \
                    acc[j][r][m] = _mm512_dpbf16_ps(acc[j][r][m], (__m512bh)wv, (__m512bh)xv[m]); \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int k = full; k < K; k += 32) {                                                        \
        const __mmask32 mask = K - k >= 32 ? (__mmask32)0xFFFFFFFFu                             \
                                           : (__mmask32)((1u << (K - k)) - 1);                  \
        __m512i xv[M];                                                                          \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                     \
            xv[m] = _mm512_maskz_loadu_epi16(mask, (const void *)(x + (int64_t)m * K + k));     \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
            const __m512i wv = _mm512_maskz_loadu_epi16(mask,                                   \
                                                        (const void *)(w + (int64_t)r * K + k)); \
            _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                 \
                acc[0][r][m] = _mm512_dpbf16_ps(acc[0][r][m], (__m512bh)wv, (__m512bh)xv[m]);   \
        }                                                                                       \
    }                                                                                           \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                         \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                     \
            dots[r * M + m] = sum_chains(acc[0][r][m], acc[1][r][m], acc[2][r][m], acc[3][r][m]); \
}
#elif defined(HAVE_AVX2_FMA)
/* AVX2 + FMA, no bf16 dot instruction. A 256-bit load holds 16 bf16 values; as 32-bit lanes,
 * lane << 16 is the even value as a float32 and lane & 0xFFFF0000 the odd one (both exact, one
 * op each for 8 values; the pairing of weight and input values is the same on both sides). */
static inline __m256 bf16_even8(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256 bf16_odd8(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}
/* An empty asm the compiler cannot see through: under -ffast-math it would otherwise be free
 * to reassociate the adds below (AVX2 has no rounding-mode add to pin them as sum_chains does),
 * and might do so differently in the functions for different M. */
static inline __m256 pinned8(__m256 v) { __asm__("" : "+x"(v)); return v; }
static inline __m128 pinned4(__m128 v) { __asm__("" : "+x"(v)); return v; }
static inline float sum_chains8(__m256 c0, __m256 c1, __m256 c2, __m256 c3) {
    const __m256 v = pinned8(_mm256_add_ps(pinned8(_mm256_add_ps(c0, c1)),
                                           pinned8(_mm256_add_ps(c2, c3))));
    __m128 s = pinned4(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
    s = pinned4(_mm_add_ps(s, _mm_movehl_ps(s, s)));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
/* One 32-value chunk of the weight row into MB input rows' four chains each: even and odd
 * values of the chunk's two 16-value halves. */
#define ROW_DOTS_CHUNK8(MB, wp, xp, xstride, acc)                                               \
    do {                                                                                        \
        const __m256i w0_ = _mm256_loadu_si256((const __m256i *)(wp));                          \
        const __m256i w1_ = _mm256_loadu_si256((const __m256i *)((wp) + 16));                   \
        const __m256 we0_ = bf16_even8(w0_), wo0_ = bf16_odd8(w0_);                             \
        const __m256 we1_ = bf16_even8(w1_), wo1_ = bf16_odd8(w1_);                             \
        _Pragma("GCC unroll 2") for (int m_ = 0; m_ < MB; m_++) {                               \
            const uint16_t *xm_ = (xp) + (int64_t)m_ * (xstride);                               \
            const __m256i x0_ = _mm256_loadu_si256((const __m256i *)xm_);                       \
            const __m256i x1_ = _mm256_loadu_si256((const __m256i *)(xm_ + 16));                \
            acc[m_][0] = _mm256_fmadd_ps(we0_, bf16_even8(x0_), acc[m_][0]);                    \
            acc[m_][1] = _mm256_fmadd_ps(wo0_, bf16_odd8(x0_), acc[m_][1]);                     \
            acc[m_][2] = _mm256_fmadd_ps(we1_, bf16_even8(x1_), acc[m_][2]);                    \
            acc[m_][3] = _mm256_fmadd_ps(wo1_, bf16_odd8(x1_), acc[m_][3]);                     \
        }                                                                                       \
    } while (0)
/* MB = 1 or 2 input rows against one weight row (4 x MB accumulators and the 4 widened weight
 * vectors fit the 16 registers); the tail (K not a multiple of 32) as one zero-padded chunk.
 * Each input row's arithmetic is the same in both, so a row's result does not depend on M. */
#define DEFINE_DOTS_GROUP8(NAME, MB)                                                            \
static inline __attribute__((always_inline)) void NAME(const uint16_t *w, const uint16_t *x,    \
                                                       int K, float *dots) {                    \
    const int full = K / 32 * 32;                                                               \
    __m256 acc[MB][4];                                                                          \
    for (int m = 0; m < MB; m++)                                                                \
        for (int j = 0; j < 4; j++) acc[m][j] = _mm256_setzero_ps();                            \
    for (int k = 0; k < full; k += 32) ROW_DOTS_CHUNK8(MB, w + k, x + k, K, acc);               \
    if (full < K) {                                                                             \
        uint16_t wt[32] = {0}, xt[MB][32] = {{0}};                                              \
        memcpy(wt, w + full, sizeof(uint16_t) * (size_t)(K - full));                            \
        for (int m = 0; m < MB; m++)                                                            \
            memcpy(xt[m], x + (int64_t)m * K + full, sizeof(uint16_t) * (size_t)(K - full));    \
        ROW_DOTS_CHUNK8(MB, wt, &xt[0][0], 32, acc);                                            \
    }                                                                                           \
    for (int m = 0; m < MB; m++) dots[m] = sum_chains8(acc[m][0], acc[m][1], acc[m][2], acc[m][3]); \
}
DEFINE_DOTS_GROUP8(dots_group8_1, 1)
DEFINE_DOTS_GROUP8(dots_group8_2, 2)
/* M input rows two at a time; the weight row is read again for each pair, from L1 while a row
 * (2 K bytes) fits there. */
#define DEFINE_ROW_DOTS(NAME, R, M)                                                             \
static void NAME(const uint16_t *w, const uint16_t *x, int K, float *dots) {                    \
    for (int r = 0; r < R; r++) {                                                               \
        const uint16_t *wr = w + (int64_t)r * K;                                                \
        int m = 0;                                                                              \
        for (; m + 2 <= M; m += 2) dots_group8_2(wr, x + (int64_t)m * K, K, dots + r * M + m);  \
        if (m < M) dots_group8_1(wr, x + (int64_t)m * K, K, dots + r * M + m);                  \
    }                                                                                           \
}
#else
#define DEFINE_ROW_DOTS(NAME, R, M)                                                             \
static void NAME(const uint16_t *w, const uint16_t *x, int K, float *dots) {                    \
    for (int r = 0; r < R; r++)                                                                 \
        for (int m = 0; m < M; m++) {                                                           \
            const uint16_t *wr = w + (int64_t)r * K, *xr = x + (int64_t)m * K;                  \
            float s = 0.f;                                                                      \
            for (int k = 0; k < K; k++) s += bf16_to_f32(wr[k]) * bf16_to_f32(xr[k]);           \
            dots[r * M + m] = s;                                                                \
        }                                                                                       \
}
#endif

typedef void (*row_dots_fn)(const uint16_t *, const uint16_t *, int, float *);
DEFINE_ROW_DOTS(dots_m1, 1, 1)
DEFINE_ROW_DOTS(dots_m2, 1, 2) DEFINE_ROW_DOTS(dots_m3, 1, 3) DEFINE_ROW_DOTS(dots_m4, 1, 4)
#include "gemv_wide_bf16.h" /* M = 5..8: no spills, weights prefetched (see there) */
static const row_dots_fn ROW_FN[GEMV_MAX_M + 1] = {0, dots_m1, dots_m2, dots_m3, dots_m4,
                                              wide_dots_m5, wide_dots_m6, wide_dots_m7, wide_dots_m8};


/* out[m * out_stride + n] = round(x[m] . w[n] + bias[n]) for n in [n0, n1); with `residual`
 * (may alias out) the rounded product is then added to it and rounded again, as torch's
 * `hidden + linear(x)` in bf16 does. */
static inline void gemv_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                                  const uint16_t *residual, uint16_t *out, int M, int K,
                                  int64_t out_stride, int n0, int n1) {
    const row_dots_fn row_fn = ROW_FN[M];
    for (int n = n0; n < n1; n++) {
        float dots[GEMV_MAX_M];
        row_fn(w + (int64_t)n * K, x, K, dots);
        const float b = bias ? bf16_to_f32(bias[n]) : 0.f;
        for (int m = 0; m < M; m++) {
            const int64_t at = (int64_t)m * out_stride + n;
            const uint16_t y = f32_to_bf16(dots[m] + b);
            out[at] = residual ? f32_to_bf16(bf16_to_f32(residual[at]) + bf16_to_f32(y)) : y;
        }
    }
}
#endif
