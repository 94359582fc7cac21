/* One decode-attention task in bf16 with AVX-512 (D a multiple of 16): the G query heads that
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

#ifdef HAVE_AVX512
static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/*   q, out     the G query rows [G, D] of this task (adjacent heads)
 *   kc, vc     one layer's cache [num_blocks, BS, KV, D]; tab: the sequence's block ids
 *   scores     scratch of G * score_stride floats, score_stride >= len */
SHARED_ROW_FN void decode_task_bf16_avx512(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                                    const int64_t *tab, int64_t len, uint16_t *out, int KV,
                                    int G, int D, int BS, int h, float scale, float *scores,
                                    int64_t score_stride) {
    const int NV = D / 16;
    const int64_t row = (int64_t)KV * D; /* elements from one token's K row to the next */
    __m512 qv[DECODE_MAX_G][DECODE_MAX_D / 16], acc[DECODE_MAX_G][DECODE_MAX_D / 16];
    __m512 kv[DECODE_MAX_D / 16];
    float mx[DECODE_MAX_G], sum[DECODE_MAX_G];
    const __m512 sc = _mm512_set1_ps(scale);
    for (int g = 0; g < G; g++) {
        const uint16_t *qp = q + (int64_t)g * D;
        for (int i = 0; i < NV; i++) {
            qv[g][i] = _mm512_mul_ps(widen16(qp + 16 * i), sc);
            acc[g][i] = _mm512_setzero_ps();
        }
        mx[g] = -FLT_MAX; sum[g] = 0.f; /* finite: built with -ffast-math */
    }
    for (int64_t t0 = 0; t0 < len; t0 += BS) {
        const uint16_t *kp = kc + (tab[t0 / BS] * BS * KV + h) * D;
        const int n = len - t0 < BS ? (int)(len - t0) : BS;
        for (int j = 0; j < n; j++, kp += row) {
            for (int i = 0; i < NV; i++) kv[i] = widen16(kp + 16 * i);
            for (int g = 0; g < G; g++) {
                __m512 s = _mm512_mul_ps(qv[g][0], kv[0]);
                for (int i = 1; i < NV; i++) s = _mm512_fmadd_ps(qv[g][i], kv[i], s);
                const float f = _mm512_reduce_add_ps(s);
                scores[g * score_stride + t0 + j] = f;
                if (f > mx[g]) mx[g] = f;
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int64_t t = 0; t < len; t++) {
            const float e = expf(scores[g * score_stride + t] - mx[g]);
            scores[g * score_stride + t] = e;
            sum[g] += e;
        }
    for (int64_t t0 = 0; t0 < len; t0 += BS) {
        const uint16_t *vp = vc + (tab[t0 / BS] * BS * KV + h) * D;
        const int n = len - t0 < BS ? (int)(len - t0) : BS;
        for (int j = 0; j < n; j++, vp += row) {
            for (int i = 0; i < NV; i++) kv[i] = widen16(vp + 16 * i);
            for (int g = 0; g < G; g++) {
                const __m512 p = _mm512_set1_ps(scores[g * score_stride + t0 + j]);
                for (int i = 0; i < NV; i++) acc[g][i] = _mm512_fmadd_ps(p, kv[i], acc[g][i]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        uint16_t *op = out + (int64_t)g * D;
        const __m512 inv = _mm512_set1_ps(1.f / sum[g]);
        float tmp[16];
        for (int i = 0; i < NV; i++) {
            _mm512_storeu_ps(tmp, _mm512_mul_ps(acc[g][i], inv));
            for (int e = 0; e < 16; e++) op[16 * i + e] = f32_to_bf16(tmp[e]);
        }
    }
}
#endif
#endif
