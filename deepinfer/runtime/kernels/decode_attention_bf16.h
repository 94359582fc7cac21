/* One decode-attention task in bf16 with AVX-512 (D a multiple of 16) or AVX2 + FMA (D a
 * multiple of 8), DECODE_ROWS_BF16 whichever this build has: the G query heads that
 * share KV head h attend over one sequence's `len` tokens, read through its block table. The
 * body of paged_decode_attention.c's bf16 kernel and the attention step of decode_stack.c, one
 * copy so both give the same bits.
 *
 * Each K/V row is widened once into registers, the G query rows and accumulators are held as
 * 16-wide vectors, and the tokens are walked block by block (no division per token). The
 * generic loops of paged_decode_attention.c ran at ~160 cycles per (token, KV head) on Zen 4
 * (B=64, ctx=321: 7.2 ms per layer, one thread). */
#ifndef DEEPINFER_DECODE_ATTENTION_BF16_H
#define DEEPINFER_DECODE_ATTENTION_BF16_H
#include <float.h>
#include <math.h>
#include "bf16_cpu.h"

#define DECODE_MAX_G 32
#define DECODE_MAX_D 256

/* Head h's K (or V) rows of block b (tokens [b BS, ...)) into cache ahead of their use: the
 * rows sit KV x D apart and each block elsewhere, which the hardware prefetcher does not follow
 * (without it the loads of these rows were ~85% of the attention's time on an AVX2 EPYC). Always
 * inlined: as a function of its own GCC finds it "pure" (prefetches have no effect it models)
 * and deletes the call. */
static inline __attribute__((always_inline)) void decode_prefetch_block(
        const uint16_t *cache, const int64_t *tab, int64_t b, int64_t len, int KV, int D, int BS,
        int h) {
    const int64_t t0 = b * BS;
    if (t0 >= len) return;
    const char *p = (const char *)(cache + (tab[b] * BS * KV + h) * D);
    const int64_t row = (int64_t)KV * D * 2, n = len - t0 < BS ? len - t0 : BS;
    for (int64_t j = 0; j < n; j++, p += row)
        for (int c = 0; c < 2 * D; c += 64) __builtin_prefetch(p + c, 0, 3);
}
#define DECODE_PREFETCH_AHEAD 2 /* blocks */

#ifdef HAVE_AVX512
static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Query rows that read the same K/V: `nrows` decode rows of one sequence (a speculative
 * verification's 1 + k positions share the block table), each with its G heads of KV head h
 * and its own context length lens[r] (causal: row r attends to tokens [0, lens[r])). Every
 * K/V row is loaded and widened once for all nrows * G query rows; at ~1000 tokens of context
 * the 6 rows of a k = 5 verification read ~23 MB of K/V per row otherwise. Each query row's
 * arithmetic (score, max, exp and sum, weighted sum, all in token order) is the one-row
 * computation, so a row's result does not depend on the rows grouped with it (a row alone
 * is nrows = 1: the same function).
 *
 *   q, out     row r's G query rows at q + r * q_stride, [G, D] (adjacent heads); its output
 *              at out + r * out_stride
 *   kc, vc     one layer's cache [num_blocks, BS, KV, D]; tab: the sequence's block ids
 *   scores     scratch of nrows * G * score_stride floats, score_stride >= every lens[r]
 *   nrows * G <= DECODE_MAX_G */
SHARED_ROW_FN void decode_rows_bf16_avx512(const uint16_t *q, int64_t q_stride, int nrows,
                                           const uint16_t *kc, const uint16_t *vc,
                                           const int64_t *tab, const int64_t *lens, uint16_t *out,
                                           int64_t out_stride, int KV, int G, int D, int BS, int h, float scale,
                                           float *scores, int64_t score_stride) {
    const int NV = D / 16, NQ = nrows * G;
    const int64_t row = (int64_t)KV * D; /* elements from one token's K row to the next */
    __m512 qv[DECODE_MAX_G][DECODE_MAX_D / 16], acc[DECODE_MAX_G][DECODE_MAX_D / 16];
    __m512 kv[DECODE_MAX_D / 16];
    float mx[DECODE_MAX_G], sum[DECODE_MAX_G];
    int64_t qlen[DECODE_MAX_G], len = 0;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int a = 0; a < NQ; a++) {
        const uint16_t *qp = q + (int64_t)(a / G) * q_stride + (int64_t)(a % G) * D;
        for (int i = 0; i < NV; i++) {
            qv[a][i] = _mm512_mul_ps(widen16(qp + 16 * i), sc);
            acc[a][i] = _mm512_setzero_ps();
        }
        mx[a] = -FLT_MAX; sum[a] = 0.f; /* finite: built with -ffast-math */
        qlen[a] = lens[a / G];
        if (qlen[a] > len) len = qlen[a];
    }
    for (int b = 0; b < DECODE_PREFETCH_AHEAD; b++)
        decode_prefetch_block(kc, tab, b, len, KV, D, BS, h);
    for (int64_t t0 = 0; t0 < len; t0 += BS) {
        const uint16_t *kp = kc + (tab[t0 / BS] * BS * KV + h) * D;
        const int n = len - t0 < BS ? (int)(len - t0) : BS;
        decode_prefetch_block(kc, tab, t0 / BS + DECODE_PREFETCH_AHEAD, len, KV, D, BS, h);
        for (int j = 0; j < n; j++, kp += row) {
            for (int i = 0; i < NV; i++) kv[i] = widen16(kp + 16 * i);
            for (int a = 0; a < NQ; a++) {
                if (t0 + j >= qlen[a]) continue;
                __m512 s = _mm512_mul_ps(qv[a][0], kv[0]);
                for (int i = 1; i < NV; i++) s = _mm512_fmadd_ps(qv[a][i], kv[i], s);
                const float f = _mm512_reduce_add_ps(s);
                scores[a * score_stride + t0 + j] = f;
                if (f > mx[a]) mx[a] = f;
            }
        }
    }
    for (int b = 0; b < DECODE_PREFETCH_AHEAD; b++)
        decode_prefetch_block(vc, tab, b, len, KV, D, BS, h);
    for (int a = 0; a < NQ; a++)
        for (int64_t t = 0; t < qlen[a]; t++) {
            const float e = expf(scores[a * score_stride + t] - mx[a]);
            scores[a * score_stride + t] = e;
            sum[a] += e;
        }
    for (int64_t t0 = 0; t0 < len; t0 += BS) {
        const uint16_t *vp = vc + (tab[t0 / BS] * BS * KV + h) * D;
        const int n = len - t0 < BS ? (int)(len - t0) : BS;
        decode_prefetch_block(vc, tab, t0 / BS + DECODE_PREFETCH_AHEAD, len, KV, D, BS, h);
        for (int j = 0; j < n; j++, vp += row) {
            for (int i = 0; i < NV; i++) kv[i] = widen16(vp + 16 * i);
            for (int a = 0; a < NQ; a++) {
                if (t0 + j >= qlen[a]) continue;
                const __m512 p = _mm512_set1_ps(scores[a * score_stride + t0 + j]);
                for (int i = 0; i < NV; i++) acc[a][i] = _mm512_fmadd_ps(p, kv[i], acc[a][i]);
            }
        }
    }
    for (int a = 0; a < NQ; a++) {
        uint16_t *op = out + (int64_t)(a / G) * out_stride + (int64_t)(a % G) * D;
        const __m512 inv = _mm512_set1_ps(1.f / sum[a]);
        float tmp[16];
        for (int i = 0; i < NV; i++) {
            _mm512_storeu_ps(tmp, _mm512_mul_ps(acc[a][i], inv));
            for (int e = 0; e < 16; e++) op[16 * i + e] = f32_to_bf16(tmp[e]);
        }
    }
}
#define DECODE_ROWS_BF16 decode_rows_bf16_avx512
#define DECODE_ROWS_WIDTH 16
#elif defined(HAVE_AVX2_FMA)
static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float attn_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* decode_rows_bf16_avx512 on AVX2 + FMA machines (Zen 1-3, Haswell on): the same contract,
 * walk and softmax with 8-wide vectors, D a multiple of 8. Only the lane count differs, so a
 * score is summed in another order than there (AVX-512 and AVX2 hosts may differ in the last
 * bit; each host's per-op kernel and stack agree). */
SHARED_ROW_FN void decode_rows_bf16_avx2(const uint16_t *q, int64_t q_stride, int nrows,
                                         const uint16_t *kc, const uint16_t *vc,
                                         const int64_t *tab, const int64_t *lens, uint16_t *out,
                                         int64_t out_stride, int KV, int G, int D, int BS, int h,
                                         float scale, float *scores, int64_t score_stride) {
    const int NV = D / 8, NQ = nrows * G;
    const int64_t row = (int64_t)KV * D;
    __m256 qv[DECODE_MAX_G][DECODE_MAX_D / 8], acc[DECODE_MAX_G][DECODE_MAX_D / 8];
    __m256 kv[DECODE_MAX_D / 8];
    float mx[DECODE_MAX_G], sum[DECODE_MAX_G];
    int64_t qlen[DECODE_MAX_G], len = 0;
    const __m256 sc = _mm256_set1_ps(scale);
    for (int a = 0; a < NQ; a++) {
        const uint16_t *qp = q + (int64_t)(a / G) * q_stride + (int64_t)(a % G) * D;
        for (int i = 0; i < NV; i++) {
            qv[a][i] = _mm256_mul_ps(widen8(qp + 8 * i), sc);
            acc[a][i] = _mm256_setzero_ps();
        }
        mx[a] = -FLT_MAX; sum[a] = 0.f; /* finite: built with -ffast-math */
        qlen[a] = lens[a / G];
        if (qlen[a] > len) len = qlen[a];
    }
    for (int b = 0; b < DECODE_PREFETCH_AHEAD; b++)
        decode_prefetch_block(kc, tab, b, len, KV, D, BS, h);
    for (int64_t t0 = 0; t0 < len; t0 += BS) {
        const uint16_t *kp = kc + (tab[t0 / BS] * BS * KV + h) * D;
        const int n = len - t0 < BS ? (int)(len - t0) : BS;
        decode_prefetch_block(kc, tab, t0 / BS + DECODE_PREFETCH_AHEAD, len, KV, D, BS, h);
        for (int j = 0; j < n; j++, kp += row) {
            for (int i = 0; i < NV; i++) kv[i] = widen8(kp + 8 * i);
            for (int a = 0; a < NQ; a++) {
                if (t0 + j >= qlen[a]) continue;
                __m256 s = _mm256_mul_ps(qv[a][0], kv[0]);
                for (int i = 1; i < NV; i++) s = _mm256_fmadd_ps(qv[a][i], kv[i], s);
                const float f = attn_hsum8(s);
                scores[a * score_stride + t0 + j] = f;
                if (f > mx[a]) mx[a] = f;
            }
        }
    }
    for (int b = 0; b < DECODE_PREFETCH_AHEAD; b++)
        decode_prefetch_block(vc, tab, b, len, KV, D, BS, h);
    for (int a = 0; a < NQ; a++)
        for (int64_t t = 0; t < qlen[a]; t++) {
            const float e = expf(scores[a * score_stride + t] - mx[a]);
            scores[a * score_stride + t] = e;
            sum[a] += e;
        }
    for (int64_t t0 = 0; t0 < len; t0 += BS) {
        const uint16_t *vp = vc + (tab[t0 / BS] * BS * KV + h) * D;
        const int n = len - t0 < BS ? (int)(len - t0) : BS;
        decode_prefetch_block(vc, tab, t0 / BS + DECODE_PREFETCH_AHEAD, len, KV, D, BS, h);
        for (int j = 0; j < n; j++, vp += row) {
            for (int i = 0; i < NV; i++) kv[i] = widen8(vp + 8 * i);
            for (int a = 0; a < NQ; a++) {
                if (t0 + j >= qlen[a]) continue;
                const __m256 p = _mm256_set1_ps(scores[a * score_stride + t0 + j]);
                for (int i = 0; i < NV; i++) acc[a][i] = _mm256_fmadd_ps(p, kv[i], acc[a][i]);
            }
        }
    }
    for (int a = 0; a < NQ; a++) {
        uint16_t *op = out + (int64_t)(a / G) * out_stride + (int64_t)(a % G) * D;
        const __m256 inv = _mm256_set1_ps(1.f / sum[a]);
        float tmp[8];
        for (int i = 0; i < NV; i++) {
            _mm256_storeu_ps(tmp, _mm256_mul_ps(acc[a][i], inv));
            for (int e = 0; e < 8; e++) op[8 * i + e] = f32_to_bf16(tmp[e]);
        }
    }
}
#define DECODE_ROWS_BF16 decode_rows_bf16_avx2
#define DECODE_ROWS_WIDTH 8
#endif

/* Groups of consecutive rows that share one sequence's K/V (the same block-table row), at most
 * DECODE_MAX_G / G rows each: first[i], count[i] for i < the returned number of groups. With
 * `parts` > 1 each run of rows is cut into up to `parts` groups, so that a step of one
 * verification still gives every thread work when the KV heads alone do not divide evenly. */
static inline int decode_row_groups(const int64_t *tables, int W, int R, int G, int parts,
                                    int *first, int *count) {
    const int cap = G >= 1 && G <= DECODE_MAX_G ? DECODE_MAX_G / G : 1;
    int n = 0;
    for (int r = 0; r < R;) {
        int e = r + 1;
        while (e < R && memcmp(tables + (int64_t)e * W, tables + (int64_t)r * W,
                               sizeof(int64_t) * (size_t)W) == 0)
            e++;
        const int run = e - r, pieces = parts < run ? parts : run;
        for (int i = 0; i < pieces; i++) {
            const int a = r + run * i / pieces, b = r + run * (i + 1) / pieces;
            for (int c = a; c < b; c += cap) {
                first[n] = c;
                count[n] = b - c < cap ? b - c : cap;
                n++;
            }
        }
        r = e;
    }
    return n;
}
#endif
