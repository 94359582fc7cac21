/* Dot products of one bf16 weight row with 5..8 input rows (a speculative verification's
 * 1 + k rows), bit for bit in the 1-row summation order of gemv_bf16.h's DEFINE_ROW_DOTS.
 * Included by gemv_bf16.h after sum_chains and before its ROW_FN table.
 *
 * Why not DEFINE_ROW_DOTS(1, M) for these M (measured on the default model's four GEMV
 * shapes x 30 layers, 212 MB of weights from memory, 1 thread, Zen 4, min CPU ms per pass on
 * a box shared with other jobs; benchmarks/verify_step_bench.py has the in-engine numbers):
 *
 *   M                          1     4     5     6     7     8
 *   DEFINE_ROW_DOTS(1, M)    8.3   9.0  11.6  15.9  20.9  20.6
 *   this file                  -     -  10.2  11.4  12.6  14.6
 *   same, weights in cache   2.5   6.2   8.0   9.5  10.5  17.1
 *
 * From memory the M-row dots cost about (weights in cache) + (the 1-row stream): the compute
 * and the weight stream did not overlap, the hardware prefetcher did not run far enough ahead
 * of a loop this slow. A software prefetch to L2 of the weights 8 KB ahead (a few rows) makes
 * them overlap; it cost at M <= 4 (no gain there, a few % slower at M = 1, 2), so only M >= 5
 * use it. The 4 x M accumulators of DEFINE_ROW_DOTS spill from M = 5; here two passes over
 * the weight row (the second from L1) each keep two chains, 2 x M accumulators. */
#ifndef DEEPINFER_GEMV_WIDE_BF16_H
#define DEEPINFER_GEMV_WIDE_BF16_H

/* Bytes ahead of the current weight row; 4..32 KB measured alike, 2 KB too close. Beyond the
 * matrix's end it touches the next allocation at worst (a prefetch never faults). */
#define WIDE_PREFETCH_BYTES 8192

#ifdef HAVE_DPBF16
static inline void wide_prefetch_row(const uint16_t *w, int K) {
    const char *p = (const char *)w + WIDE_PREFETCH_BYTES;
    for (int b = 0; b < 2 * K; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

/* Pass 0 runs chains 0 and 1, pass 1 chains 2 and 3. Each chain still sums chunk j of every
 * 128-wide block in block order (chain 0 then the tail chunks), so the four chains, and
 * sum_chains over them, are the 1-row ones. */
#define DEFINE_WIDE_ROW_DOTS(NAME, M)                                                           \
static void NAME(const uint16_t *w, const uint16_t *x, int K, float *dots) {                    \
    const int full = K / 128 * 128;                                                             \
    __m512 c[4][M];                                                                             \
    wide_prefetch_row(w, K);                                                                    \
    _Pragma("GCC unroll 2") for (int pass = 0; pass < 2; pass++) {                              \
        const int j0 = 2 * pass;                                                                \
        __m512 a0[M], a1[M];                                                                    \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                                   \
            a0[m] = _mm512_setzero_ps();                                                        \
            a1[m] = _mm512_setzero_ps();                                                        \
        }                                                                                       \
        for (int k = 0; k < full; k += 128) {                                                   \
            const __m512i w0 = _mm512_loadu_si512((const void *)(w + k + 32 * j0));             \
            const __m512i w1 = _mm512_loadu_si512((const void *)(w + k + 32 * j0 + 32));        \
            _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                               \
                const uint16_t *xm = x + (int64_t)m * K + k + 32 * j0;                          \
                a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)w0,                                   \
                                         (__m512bh)_mm512_loadu_si512((const void *)xm));       \
                a1[m] = _mm512_dpbf16_ps(a1[m], (__m512bh)w1,                                   \
                                         (__m512bh)_mm512_loadu_si512((const void *)(xm + 32))); \
            }                                                                                   \
        }                                                                                       \
        if (pass == 0)                                                                          \
            for (int k = full; k < K; k += 32) {                                                \
                const __mmask32 mask = K - k >= 32 ? (__mmask32)0xFFFFFFFFu                     \
                                                   : (__mmask32)((1u << (K - k)) - 1);          \
                const __m512i wv = _mm512_maskz_loadu_epi16(mask, (const void *)(w + k));       \
                _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                           \
                    const __m512i xv = _mm512_maskz_loadu_epi16(                                \
                        mask, (const void *)(x + (int64_t)m * K + k));                          \
                    a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)wv, (__m512bh)xv);                \
                }                                                                               \
            }                                                                                   \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                                   \
            c[j0][m] = a0[m];                                                                   \
            c[j0 + 1][m] = a1[m];                                                               \
        }                                                                                       \
    }                                                                                           \
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                         \
        dots[m] = sum_chains(c[0][m], c[1][m], c[2][m], c[3][m]);                               \
}
#else
/* The AVX2 dots and the plain float loop are one order for every M already. */
#define DEFINE_WIDE_ROW_DOTS(NAME, M) DEFINE_ROW_DOTS(NAME, 1, M)
#endif

DEFINE_WIDE_ROW_DOTS(wide_dots_m5, 5) DEFINE_WIDE_ROW_DOTS(wide_dots_m6, 6)
DEFINE_WIDE_ROW_DOTS(wide_dots_m7, 7) DEFINE_WIDE_ROW_DOTS(wide_dots_m8, 8)
#endif
