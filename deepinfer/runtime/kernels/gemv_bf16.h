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
