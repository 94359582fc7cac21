/* Activations prepared for the quantized GEMVs: each input row quantized once per step to int8
 * (bf16 activations; float32 activations take the exact path of quant_gemv.h instead), laid
 * out the way the weight format's dot product consumes it. Rows are quantized one at a time,
 * so a row's int8 values never depend on how many rows share the step.
 *
 * Families (which one a format uses: qact_family):
 *   ACT_SPLIT4  (AVX-512; q4_0, q4_1) groups of 4 blocks = 128 values, the weight nibbles'
 *               order: [b0[0:16] b1[0:16] b2[0:16] b3[0:16] | b0[16:32] ... b3[16:32]]
 *   ACT_NAT64   (AVX-512; q8_0, K-quants) natural order, groups of 64 values
 *     both: per group 16 int32 lanes (4 bytes each; in SPLIT4 a lane also covers the same 4
 *     bytes of the second half): dxv = the lane's block scale, lsum = the lane's sum of q,
 *     xsv = dxv * lsum (for the formats with a per-block minimum)
 *   ACT_BLK32   (AVX2, portable; GGUF) natural order, dx per 32 values and xsv per 16 values
 *               (dx x the sum of their q: the weight minimums' term, quant_block_avx2.h)
 *   ACT_ROW     (int8 weights: W8A8) one scale per row (max|x| / 127) and the row's sum of q
 *   ACT_BF16    (fp8 weights) the bf16 row itself and its float32 copy (the AVX2 path's
 *               operand), both zero-padded to 128 values
 * Per 32-value block: d = max|x| / 127, q = round(x * (127 / max|x|)), ties to even (llama.cpp's
 * q8_0 rule). Rows are zero-padded to whole groups (q = 0, scales 0), so a partial last group
 * adds nothing. This file is compiled without -ffast-math: bf16 inputs often sit exactly at
 * max|x| / 2, where 127 / max|x| computed as 127 * (1 / max|x|) (two roundings) moves x * id
 * across the tie and the code by one; with IEEE steps the codes are well defined (the torch
 * reference computes them the same way). */
#ifndef DEEPINFER_QUANT_ACT_H
#define DEEPINFER_QUANT_ACT_H
#include <math.h>
#include <stdlib.h>
#include "quant_formats.h"

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
enum { ACT_SPLIT4, ACT_NAT64, ACT_BLK32, ACT_ROW, ACT_BF16, ACT_FAMILIES };
#define QACT_MAX_M 8
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
#define QACT_PAD 128

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) \
    && defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__F16C__)
#define HAVE_QUANT_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_QUANT_AVX2 1
#endif

typedef struct {
    int family, M, K, Kp;  /* rows, columns, columns padded to QACT_PAD */
    int groups;            /* lane groups (SPLIT4, NAT64) or 32-blocks (BLK32) per row */
    int8_t *q;             /* [M, Kp] */
    float *dxv, *xsv;      /* SPLIT4 / NAT64: [M, groups, 16]; BLK32: dx [M, Kp / 32], xsv [M, Kp / 16] */
    int32_t *lsum;         /* SPLIT4 / NAT64: [M, groups, 16] */
    float *rs;             /* ROW: [M] scales */
    int32_t *rsum;         /* ROW: [M] sums of q */
    uint16_t *x16;         /* BF16: [M, Kp] */
    float *x32;            /* BF16: [M, Kp], the same values as float32 */
} qact;

static inline int qact_family(int isa, int fmt) {
    if (fmt == QF_INT8) return ACT_ROW;
    if (fmt == QF_FP8 || fmt == QF_BF16) return ACT_BF16;
    if (isa == ISA_AVX512) return fmt == QF_Q4_0 || fmt == QF_Q4_1 ? ACT_SPLIT4 : ACT_NAT64;
    return ACT_BLK32;
}

static inline int qact_padded(int K) { return (K + QACT_PAD - 1) / QACT_PAD * QACT_PAD; }

/* Bytes of scratch qact_carve needs for M rows of K values. */
static inline size_t qact_bytes(int M, int K) {
    const size_t Kp = (size_t)qact_padded(K);
    /* q + bf16 and float32 copies + (dxv, xsv, lsum) at 16 lanes per 64 values, or dx and
     * sums per block */
    return (size_t)M * (Kp + 2 * Kp + 4 * Kp + 3 * 4 * (Kp / 4) + 8) + 4 * 64;
}

static inline void *align64(void *p) { return (void *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

static inline float act_value(const void *x, int is_f32, int64_t i) {
    if (is_f32) return ((const float *)x)[i];
    return bf16_to_f32(((const uint16_t *)x)[i]);
}

/* q[0..n) = round(v / d) with d = max|v| / 127; returns d (0 for an all-zero block). */
static inline float quantize_block(const float *v, int n, int8_t *q) {
    float amax = 0.f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(v[i]));
    const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    for (int i = 0; i < n; i++) q[i] = (int8_t)lrintf(v[i] * id);
    return d;
}

#ifdef HAVE_QUANT_AVX2
static inline __m256 load8_ps(const void *x, int is_f32, int64_t i) {
    if (is_f32) return _mm256_loadu_ps((const float *)x + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 32 values at x + i -> q (32 bytes) and the block scale, as quantize_block (max is exact in
 * any order; vcvtps2dq rounds to nearest even, as lrintf does in the default mode). */
static inline float quantize_block32_avx2(const void *x, int is_f32, int64_t i, int8_t *q) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = load8_ps(x, is_f32, i + 8 * j);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i c[4];
    for (int j = 0; j < 4; j++) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
    /* the in-lane packs leave 4-byte groups in the order v0 v1 v2 v3 (low halves), then the
     * high halves; the permute restores natural order */
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return amax / 127.f;
}
#endif

/* The (exact) sum of 16 int8 values. */
static inline int sum16_i8(const int8_t *q) {
#ifdef HAVE_QUANT_AVX2
    /* biased to unsigned (+128 each), summed per 8 bytes by psadbw */
    const __m128i u = _mm_xor_si128(_mm_loadu_si128((const __m128i *)q), _mm_set1_epi8((char)0x80));
    const __m128i s = _mm_sad_epu8(u, _mm_setzero_si128());
    return _mm_cvtsi128_si32(s) + _mm_extract_epi16(s, 4) - 16 * 128;
#else
    int s = 0;
    for (int i = 0; i < 16; i++) s += q[i];
    return s;
#endif
}

/* One row of GGUF-family activations: natural-order q and per-32 scales. */
static void act_row_blocks(const void *x, int is_f32, int K, int Kp, int8_t *q, float *d) {
    float v[32];
    for (int b = 0; b < Kp / 32; b++) {
#ifdef HAVE_QUANT_AVX2
        if (b * 32 + 32 <= K) {
            d[b] = quantize_block32_avx2(x, is_f32, (int64_t)b * 32, q + 32 * b);
            continue;
        }
#endif
        if (b * 32 >= K) { /* padding: what quantize_block gives for zeros */
            memset(q + 32 * b, 0, 32);
            d[b] = 0.f;
            continue;
        }
        for (int i = 0; i < 32; i++) v[i] = b * 32 + i < K ? act_value(x, is_f32, b * 32 + i) : 0.f;
        d[b] = quantize_block(v, 32, q + 32 * b);
    }
}

#ifdef HAVE_QUANT_AVX512
/* 32 values -> q (32 bytes) and the block scale, as quantize_block. */
static inline float quantize_block32_avx512(__m512 v0, __m512 v1, int8_t *q) {
    const __m512 amax_v = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
    const float amax = _mm512_reduce_max_ps(amax_v);
    const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, id))));
    _mm_storeu_si128((__m128i *)(q + 16),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, id))));
    return amax / 127.f;
}

static inline __m512 load16_ps(const void *x, int is_f32, int64_t i, int valid) {
    const __mmask16 k = valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (valid > 0 ? valid : 0)) - 1);
    if (is_f32) return _mm512_maskz_loadu_ps(k, (const float *)x + i);
    const __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)x + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* A SPLIT4 / NAT64 row: q per 32-value block (SPLIT4 reordered), then the lane vectors. */
static void act_row_lanes_avx512(int family, const void *x, int is_f32, int K, int Kp,
                                 int8_t *q, float *dxv, float *xsv, int32_t *lsum) {
    float d[QACT_PAD / 32] = {0.f, 0.f, 0.f, 0.f};
    const int span = family == ACT_SPLIT4 ? 128 : 64, per = span / 32;
    const __m512i ones = _mm512_set1_epi8(1);
    for (int g = 0; g < Kp / span; g++) {
        int8_t *gq = q + (int64_t)g * span;
        for (int j = 0; j < per; j++) {
            const int64_t k = (int64_t)g * span + 32 * j;
            const __m512 v0 = load16_ps(x, is_f32, k, K - (int)k);
            const __m512 v1 = load16_ps(x, is_f32, k + 16, K - (int)k - 16);
            int8_t blk[32];
            d[j] = quantize_block32_avx512(v0, v1, blk);
            if (family == ACT_SPLIT4) {
                memcpy(gq + 16 * j, blk, 16);
                memcpy(gq + 64 + 16 * j, blk + 16, 16);
            } else {
                memcpy(gq + 32 * j, blk, 32);
            }
        }
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(gq));
        if (family == ACT_SPLIT4) s = _mm512_dpbusd_epi32(s, ones, _mm512_loadu_si512(gq + 64));
        const __m512i lane_blk = family == ACT_SPLIT4
            ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
            : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m512 dv = _mm512_permutexvar_ps(lane_blk, _mm512_castps128_ps512(_mm_loadu_ps(d)));
        _mm512_storeu_ps(dxv + 16 * g, dv);
        _mm512_storeu_si512(lsum + 16 * g, s);
        _mm512_storeu_ps(xsv + 16 * g, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(s)));
    }
}
#endif

/* Row m of a carved qact from its input row xm. */
static void act_prepare_row(qact *a, int m, const void *xm, int is_f32) {
    const int K = a->K, Kp = a->Kp, family = a->family;
    int8_t *q = a->q + (size_t)m * Kp;
    float *dxv = a->dxv + (size_t)m * (Kp / 4), *xsv = a->xsv + (size_t)m * (Kp / 4);
    int32_t *lsum = a->lsum + (size_t)m * (Kp / 4);
    if (family == ACT_BF16) {
        uint16_t *o = a->x16 + (size_t)m * Kp;
        float *o32 = a->x32 + (size_t)m * Kp;
        for (int k = 0; k < Kp; k++) {
            o[k] = k >= K ? 0 : is_f32 ? f32_to_bf16(((const float *)xm)[k])
                                       : ((const uint16_t *)xm)[k];
            o32[k] = bf16_to_f32(o[k]);
        }
    } else if (family == ACT_ROW) {
        float amax = 0.f;
        for (int k = 0; k < K; k++) amax = fmaxf(amax, fabsf(act_value(xm, is_f32, k)));
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        int32_t s = 0;
        for (int k = 0; k < Kp; k++) {
            q[k] = k < K ? (int8_t)lrintf(act_value(xm, is_f32, k) * id) : 0;
            s += q[k];
        }
        a->rs[m] = amax / 127.f;
        a->rsum[m] = s;
    } else if (family == ACT_BLK32) {
        act_row_blocks(xm, is_f32, K, Kp, q, dxv);
        for (int h = 0; h < Kp / 16; h++) /* values 16h..16h+15, of block h / 2 */
            xsv[h] = dxv[h / 2] * (float)sum16_i8(q + 16 * h);
    } else {
#ifdef HAVE_QUANT_AVX512
        act_row_lanes_avx512(family, xm, is_f32, K, Kp, q, dxv, xsv, lsum);
#else
        (void)lsum;
#endif
    }
}

/* Carve `mem` (qact_bytes(M, K), any alignment) into a qact for M rows of K values; fill
 * its rows with act_prepare_row (each row on its own: threads may share them out). */
static void qact_carve(qact *a, int family, int M, int K, void *mem) {
    const int Kp = qact_padded(K);
    char *p = (char *)align64(mem);
    a->family = family; a->M = M; a->K = K; a->Kp = Kp;
    a->groups = family == ACT_SPLIT4 ? Kp / 128 : family == ACT_NAT64 ? Kp / 64 : Kp / 32;
    a->q = (int8_t *)p; p += (size_t)M * Kp;
    a->x16 = (uint16_t *)p; p += (size_t)M * Kp * 2;
    a->dxv = (float *)p; p += (size_t)M * (Kp / 4) * 4;
    a->xsv = (float *)p; p += (size_t)M * (Kp / 4) * 4;
    a->lsum = (int32_t *)p; p += (size_t)M * (Kp / 4) * 4;
    a->x32 = (float *)p; p += (size_t)M * Kp * 4;
    a->rs = (float *)p; p += (size_t)M * 4;
    a->rsum = (int32_t *)p;
}

#pragma GCC pop_options

/* Row m's pieces (the strides of qact_carve). */
static inline const int8_t *qact_q(const qact *a, int m) { return a->q + (size_t)m * a->Kp; }
static inline const float *qact_dxv(const qact *a, int m) { return a->dxv + (size_t)m * (a->Kp / 4); }
static inline const float *qact_xsv(const qact *a, int m) { return a->xsv + (size_t)m * (a->Kp / 4); }
static inline const int32_t *qact_lsum(const qact *a, int m) { return a->lsum + (size_t)m * (a->Kp / 4); }
static inline const uint16_t *qact_x16(const qact *a, int m) { return a->x16 + (size_t)m * a->Kp; }
static inline const float *qact_x32(const qact *a, int m) { return a->x32 + (size_t)m * a->Kp; }
#endif
