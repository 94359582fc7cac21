/* AVX2 dot products of the element formats (one code per value: fp8 block-scaled, int8 W8A8)
 * with M (1..8) prepared activation rows; quant_dot_portable.h's avx2_rows dispatches here.
 *
 *   fp8 x bf16 activations: each e4m3 byte becomes the fp16 with the same bits shifted
 *     (sign << 15 | rest << 7: value / 256, exact, subnormals too; F16C converts it to
 *     float32) and is multiplied with the float32 activations (the ACT_BF16 family keeps a
 *     float32 copy of each row, so no row converts bf16 per weight); products (exact: 4 x 8
 *     significant bits) are summed in float32 per 128-value block, and each block's sum is
 *     multiplied by 256 x its scale once, as the AVX-512 and portable paths do.
 *   int8 x int8: |w| x sign(x, w) with vpmaddubsw (127 x 127 x 2 fits in int16), pairs summed
 *     to int32: the exact integer sum of the AVX-512 kernel, one scale per row and channel.
 *
 * The weight stream is converted once per call and reused for all M rows; M is a compile-time
 * constant in each instance, so the accumulators stay in registers. */
#ifndef DEEPINFER_QUANT_DOT_AVX2_ELEMENT_H
#define DEEPINFER_QUANT_DOT_AVX2_ELEMENT_H
#include "quant_act.h"
#ifdef HAVE_QUANT_AVX2

#define QINLINE2 static inline __attribute__((always_inline))

/* An opaque step: under -ffast-math GCC may reassociate float adds of vector types, and could
 * do so differently in the per-M instances; an add whose result passes through this is summed
 * exactly as written in every instance (a row's result must not depend on M). */
#define QPIN(v) __asm__("" : "+x"(v))

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    QPIN(s);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    QPIN(s);
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 e4m3 bytes -> 16 float32 (value / 256) in natural order; 128-bit integer steps (one
 * uop each where a 256-bit one is two). */
QINLINE2 void e4m3x16_to_f32(const uint8_t *p, __m256 *lo, __m256 *hi) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m128i z = _mm_setzero_si128(), keep = _mm_set1_epi16((short)0xBF80);
    /* b << 8 (b as the high byte), arithmetic >> 1: the sign lands in bits 15 and 14, the rest
     * in 7..13; dropping bit 14 leaves sign << 15 | rest << 7 */
    *lo = _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(z, b), 1), keep));
    *hi = _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(_mm_unpackhi_epi8(z, b), 1), keep));
}

/* Four FMA chains per row (enough to cover the FMA latency at M = 1), for every M: vector i
 * (8 values) of a 128-value block goes to chain i % 4 whatever the number of rows, so each row
 * sums in one order. M = 1 converts and multiplies in registers; more rows convert the block
 * once into a 128-float buffer (L1) that each row then streams with its own four chains. */
#define FP8_CHAINS 4

/* The block's chain sums ((c0 + c1) + (c2 + c3)) times 256 x its scale, into acc. */
QINLINE2 __m256 fp8_block_sum(const __m256 *t, __m256 sj, __m256 acc) {
    __m256 lo = _mm256_add_ps(t[0], t[1]), hi = _mm256_add_ps(t[2], t[3]);
    QPIN(lo);
    QPIN(hi);
    __m256 sum = _mm256_add_ps(lo, hi);
    QPIN(sum);
    return _mm256_fmadd_ps(sum, sj, acc);
}

/* Values [k, k_end) of the row, up to 32, as 32 codes (zeros beyond: x is zero-padded). */
QINLINE2 const uint8_t *fp8_chunk(const uint8_t *b, int k, int k_end, uint8_t *tail) {
    if (k_end - k >= 32) return b + k;
    memset(tail, 0, 32);
    memcpy(tail, b + k, (size_t)(k_end - k));
    return tail;
}

QINLINE2 void fp8_rows_avx2_m(const qweight *w, int64_t n, const qact *a, int m0, float *dots,
                              const int M) {
    const int K = w->cols, kb = (K + FP8_TILE - 1) / FP8_TILE;
    const uint8_t *b = qweight_row(w, n);
    const float *s = w->scale + (n / FP8_TILE) * kb;
    __m256 acc[QACT_MAX_M];
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    uint8_t tail[32];
    float wbuf[FP8_TILE] __attribute__((aligned(32)));
    for (int j = 0; j < kb; j++) {
        const int k0 = j * FP8_TILE, k_end = k0 + FP8_TILE < K ? k0 + FP8_TILE : K;
        const __m256 sj = _mm256_set1_ps(s[j] * 256.f);
        if (M == 1) {
            __m256 t[FP8_CHAINS];
            _Pragma("GCC unroll 4") for (int i = 0; i < FP8_CHAINS; i++) t[i] = _mm256_setzero_ps();
            const float *x = qact_x32(a, m0);
            for (int k = k0; k < k_end; k += 32) {
                const uint8_t *src = fp8_chunk(b, k, k_end, tail);
                __m256 wv[4];
                e4m3x16_to_f32(src, &wv[0], &wv[1]);
                e4m3x16_to_f32(src + 16, &wv[2], &wv[3]);
                _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++)
                    t[i] = _mm256_fmadd_ps(wv[i], _mm256_load_ps(x + k + 8 * i), t[i]);
            }
            acc[0] = fp8_block_sum(t, sj, acc[0]);
            continue;
        }
        const int len = (k_end - k0 + 31) / 32 * 32;
        for (int k = k0; k < k_end; k += 32) {
            const uint8_t *src = fp8_chunk(b, k, k_end, tail);
            __m256 *o = (__m256 *)(wbuf + (k - k0));
            e4m3x16_to_f32(src, &o[0], &o[1]);
            e4m3x16_to_f32(src + 16, &o[2], &o[3]);
        }
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {
            const float *x = qact_x32(a, m0 + m) + k0;
            __m256 t[FP8_CHAINS];
            _Pragma("GCC unroll 4") for (int i = 0; i < FP8_CHAINS; i++) t[i] = _mm256_setzero_ps();
            for (int c = 0; c < len; c += 32)
                _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++)
                    t[i] = _mm256_fmadd_ps(_mm256_load_ps(wbuf + c + 8 * i),
                                           _mm256_load_ps(x + c + 8 * i), t[i]);
            acc[m] = fp8_block_sum(t, sj, acc[m]);
        }
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) dots[m] = hsum8(acc[m]);
}

QINLINE2 void int8_rows_avx2_m(const qweight *w, int64_t n, const qact *a, int m0, float *dots,
                               const int M) {
    const int K = w->cols;
    const uint8_t *b = qweight_row(w, n);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[QACT_MAX_M];
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_si256();
    uint8_t tail[32];
    for (int k = 0; k < K; k += 32) {
        const uint8_t *src = b + k;
        if (K - k < 32) { /* zero weights beyond K (the padded activations are zero too) */
            memset(tail, 0, sizeof tail);
            memcpy(tail, src, (size_t)(K - k));
            src = tail;
        }
        const __m256i wq = _mm256_loadu_si256((const __m256i *)src);
        const __m256i wabs = _mm256_sign_epi8(wq, wq);
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {
            const __m256i x = _mm256_load_si256((const __m256i *)(qact_q(a, m0 + m) + k));
            const __m256i p = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, wq));
            acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(p, ones));
        }
    }
    const float sw = w->scale[n];
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {
        __m128i v = _mm_add_epi32(_mm256_castsi256_si128(acc[m]), _mm256_extracti128_si256(acc[m], 1));
        v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
        v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1));
        dots[m] = (float)_mm_cvtsi128_si32(v) * (sw * a->rs[m0 + m]);
    }
}

#define ELEM_CASES(FN)                                                                        \
    switch (M) {                                                                              \
    case 1: FN(w, n, a, m0, dots, 1); return;                                                 \
    case 2: FN(w, n, a, m0, dots, 2); return;                                                 \
    case 3: FN(w, n, a, m0, dots, 3); return;                                                 \
    case 4: FN(w, n, a, m0, dots, 4); return;                                                 \
    case 5: FN(w, n, a, m0, dots, 5); return;                                                 \
    case 6: FN(w, n, a, m0, dots, 6); return;                                                 \
    case 7: FN(w, n, a, m0, dots, 7); return;                                                 \
    default: FN(w, n, a, m0, dots, 8); return;                                                \
    }

static void fp8_rows_avx2(const qweight *w, int64_t n, const qact *a, int m0, float *dots, int M) {
    ELEM_CASES(fp8_rows_avx2_m)
}

static void int8_rows_avx2(const qweight *w, int64_t n, const qact *a, int m0, float *dots, int M) {
    ELEM_CASES(int8_rows_avx2_m)
}
#undef ELEM_CASES
#endif
#endif
