/* The bf16 dots of moe_experts.c: one bf16 weight row with 1..MOE_TILE input rows. */
#ifndef DEEPINFER_MOE_EXPERT_DOTS_H
#define DEEPINFER_MOE_EXPERT_DOTS_H
#include "gemv_bf16.h"

#define MOE_TILE 8

/* The dots' input rows (gathered token rows, then h): bf16 for vdpbf16ps; elsewhere float32,
 * widened once per step instead of once per weight row (at 8 rows the per-row widening of the
 * inputs made the AVX2 dots compute-bound). */
#ifdef HAVE_DPBF16
typedef uint16_t moe_act;
static inline moe_act to_act(uint16_t v) { return v; }
#define MOE_DOTS ROW_FN
#define MOE_ISA 2
#else
typedef float moe_act;
static inline moe_act to_act(uint16_t v) { return bf16_to_f32(v); }
typedef void (*moe_dots_fn)(const uint16_t *, const float *, int, float *);
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline __m256 bf16x8(const uint16_t *p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

static inline float moe_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One bf16 weight row with M float32 input rows, C chains of 8 lanes per input row (C * M <= 8
 * accumulators: no spills, and enough chains to hide the FMA latency at small M). */
#define DEFINE_MOE_DOTS(NAME, M, C)                                                           \
static void NAME(const uint16_t *w, const float *x, int K, float *dots) {                    \
    __m256 acc[M][C];                                                                        \
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                      \
        _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) acc[m][c] = _mm256_setzero_ps(); \
    int k = 0;                                                                               \
    for (; k + 8 * C <= K; k += 8 * C)                                                       \
        _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) {                                \
            const __m256 wv = bf16x8(w + k + 8 * c);                                         \
            _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                              \
                acc[m][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (int64_t)m * K + k + 8 * c), \
                                            acc[m][c]);                                      \
        }                                                                                    \
    for (; k + 8 <= K; k += 8) {                                                             \
        const __m256 wv = bf16x8(w + k);                                                     \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                  \
            acc[m][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (int64_t)m * K + k), acc[m][0]); \
    }                                                                                        \
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                                    \
        __m256 s = acc[m][0];                                                                \
        _Pragma("GCC unroll 4") for (int c = 1; c < C; c++) s = _mm256_add_ps(s, acc[m][c]); \
        float d = moe_hsum8(s);                                                              \
        for (int t = k; t < K; t++) d = __builtin_fmaf(bf16_to_f32(w[t]), x[(int64_t)m * K + t], d); \
        dots[m] = d;                                                                         \
    }                                                                                        \
}
#define MOE_ISA 1
#else
#define DEFINE_MOE_DOTS(NAME, M, C)                                                           \
static void NAME(const uint16_t *w, const float *x, int K, float *dots) {                    \
    for (int m = 0; m < M; m++) {                                                            \
        float s = 0.f;                                                                       \
        for (int k = 0; k < K; k++) s += bf16_to_f32(w[k]) * x[(int64_t)m * K + k];          \
        dots[m] = s;                                                                         \
    }                                                                                        \
}
#define MOE_ISA 0
#endif
DEFINE_MOE_DOTS(moe_m1, 1, 4) DEFINE_MOE_DOTS(moe_m2, 2, 4) DEFINE_MOE_DOTS(moe_m3, 3, 2)
DEFINE_MOE_DOTS(moe_m4, 4, 2) DEFINE_MOE_DOTS(moe_m5, 5, 1) DEFINE_MOE_DOTS(moe_m6, 6, 1)
DEFINE_MOE_DOTS(moe_m7, 7, 1) DEFINE_MOE_DOTS(moe_m8, 8, 1)
static const moe_dots_fn MOE_DOTS[MOE_TILE + 1] = {
    0, moe_m1, moe_m2, moe_m3, moe_m4, moe_m5, moe_m6, moe_m7, moe_m8};
#endif
#endif
