/* Paged decode attention for CPU: one query token per sequence, reading K/V straight from the
 * block table (no gather copy). Built at run time by cpu_decode_kernel.py with the host's
 * compiler (-O3 -march=native); inputs are raw pointers to contiguous tensors.
 *
 *   q, out     [B, KV * G, D]          (G query heads share one KV head)
 *   k/v cache  [num_blocks, BS, KV, D]
 *   tables     [B, W] int64 block ids; lens [B] int64 context lengths (new token included)
 *
 * One task per (sequence, KV head): scores for its G query rows, softmax, weighted V sum,
 * all in float32. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_G 32
#define MAX_D 256

/* bf16 -> float32 by value (memcpy), never by storing integers through a float buffer: that
 * breaks C's strict-aliasing rule, and GCC's AVX-512 code then hoisted the float reads of the
 * K row out of the token loop (every score used one stale row) on Zen 4. This still
 * vectorizes to a widen and a shift. */
static inline float bf16_to_f32(uint16_t x) {
    const uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void bf16_row(float *restrict dst, const uint16_t *restrict src, int n) {
    for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                     \
int NAME(const T *q, const T *kc, const T *vc, const int64_t *tables, const int64_t *lens,      \
         T *out, int B, int KV, int G, int D, int BS, int W, float scale, int num_threads) {    \
    if (G > MAX_G || D > MAX_D) return 1;                                                       \
    int64_t max_len = 1;                                                                        \
    for (int b = 0; b < B; b++) if (lens[b] > max_len) max_len = lens[b];                       \
    int failed = 0;                                                                             \
    _Pragma("omp parallel num_threads(num_threads)")                                            \
    {                                                                                           \
        float *scores = (float *)malloc(sizeof(float) * (size_t)G * (size_t)max_len);           \
        if (!scores) failed = 1;                                                                \
        _Pragma("omp for schedule(dynamic, 1)")                                                 \
        for (int task = 0; task < B * KV; task++) {                                             \
            if (!scores) continue;                                                              \
            const int b = task / KV, h = task % KV;                                             \
            const int64_t len = lens[b];                                                        \
            float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], kf[MAX_D], mx[MAX_G], sum[MAX_G];        \
            for (int g = 0; g < G; g++) {                                                       \
                const T *qp = q + ((int64_t)b * KV * G + (int64_t)h * G + g) * D;               \
                LOAD(qf[g], qp, D);                                                             \
                for (int d = 0; d < D; d++) qf[g][d] *= scale;                                  \
                mx[g] = -FLT_MAX; sum[g] = 0.f; /* finite: built with -ffast-math */            \
                for (int d = 0; d < D; d++) acc[g][d] = 0.f;                                    \
            }                                                                                   \
            for (int64_t t = 0; t < len; t++) {                                                 \
                const int64_t blk = tables[(int64_t)b * W + t / BS];                            \
                const T *kp = kc + ((blk * BS + t % BS) * KV + h) * D;                          \
                LOAD(kf, kp, D);                                                                \
                for (int g = 0; g < G; g++) {                                                   \
                    float s = 0.f;                                                              \
                    for (int d = 0; d < D; d++) s += qf[g][d] * kf[d];                          \
                    scores[g * max_len + t] = s;                                                \
                    if (s > mx[g]) mx[g] = s;                                                   \
                }                                                                               \
            }                                                                                   \
            for (int g = 0; g < G; g++)                                                         \
                for (int64_t t = 0; t < len; t++) {                                             \
                    float e = expf(scores[g * max_len + t] - mx[g]);                            \
                    scores[g * max_len + t] = e;                                                \
                    sum[g] += e;                                                                \
                }                                                                               \
            for (int64_t t = 0; t < len; t++) {                                                 \
                const int64_t blk = tables[(int64_t)b * W + t / BS];                            \
                const T *vp = vc + ((blk * BS + t % BS) * KV + h) * D;                          \
                LOAD(kf, vp, D);                                                                \
                for (int g = 0; g < G; g++) {                                                   \
                    const float p = scores[g * max_len + t];                                    \
                    for (int d = 0; d < D; d++) acc[g][d] += p * kf[d];                         \
                }                                                                               \
            }                                                                                   \
            for (int g = 0; g < G; g++) {                                                       \
                T *op = out + ((int64_t)b * KV * G + (int64_t)h * G + g) * D;                   \
                const float inv = 1.f / sum[g];                                                 \
                for (int d = 0; d < D; d++) op[d] = STORE(acc[g][d] * inv);                     \
            }                                                                                   \
        }                                                                                       \
        free(scores);                                                                           \
    }                                                                                           \
    return failed;                                                                              \
}

static inline void f32_row(float *restrict dst, const float *restrict src, int n) {
    memcpy(dst, src, sizeof(float) * (size_t)n);
}
static inline float f32_store(float f) { return f; }

DEFINE_KERNEL(paged_decode_attention_bf16_generic, uint16_t, bf16_row, bf16_store)
DEFINE_KERNEL(paged_decode_attention_f32, float, f32_row, f32_store)

/* bf16 with AVX-512 and D a multiple of 16: the same two passes with each K/V row widened once
 * into registers, the G query rows and accumulators held as 16-wide vectors, and the tokens
 * walked block by block (no division per token). The generic loops above ran at ~160 cycles
 * per (token, KV head) on Zen 4 (B=64, ctx=321: 7.2 ms per layer, one thread). */
#ifdef __AVX512F__
static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static int decode_bf16_avx512(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                              const int64_t *tables, const int64_t *lens, uint16_t *out, int B,
                              int KV, int G, int D, int BS, int W, float scale, int num_threads) {
    int64_t max_len = 1;
    for (int b = 0; b < B; b++) if (lens[b] > max_len) max_len = lens[b];
    const int NV = D / 16;
    const int64_t row = (int64_t)KV * D; /* elements from one token's K row to the next */
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)G * (size_t)max_len);
        if (!scores) failed = 1;
        _Pragma("omp for schedule(dynamic, 1)")
        for (int task = 0; task < B * KV; task++) {
            if (!scores) continue;
            const int b = task / KV, h = task % KV;
            const int64_t len = lens[b];
            const int64_t *tab = tables + (int64_t)b * W;
            __m512 qv[MAX_G][MAX_D / 16], acc[MAX_G][MAX_D / 16], kv[MAX_D / 16];
            float mx[MAX_G], sum[MAX_G];
            const __m512 sc = _mm512_set1_ps(scale);
            for (int g = 0; g < G; g++) {
                const uint16_t *qp = q + ((int64_t)b * KV * G + (int64_t)h * G + g) * D;
                for (int i = 0; i < NV; i++) {
                    qv[g][i] = _mm512_mul_ps(widen16(qp + 16 * i), sc);
                    acc[g][i] = _mm512_setzero_ps();
                }
                mx[g] = -FLT_MAX; sum[g] = 0.f;
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
                        scores[g * max_len + t0 + j] = f;
                        if (f > mx[g]) mx[g] = f;
                    }
                }
            }
            for (int g = 0; g < G; g++)
                for (int64_t t = 0; t < len; t++) {
                    const float e = expf(scores[g * max_len + t] - mx[g]);
                    scores[g * max_len + t] = e;
                    sum[g] += e;
                }
            for (int64_t t0 = 0; t0 < len; t0 += BS) {
                const uint16_t *vp = vc + (tab[t0 / BS] * BS * KV + h) * D;
                const int n = len - t0 < BS ? (int)(len - t0) : BS;
                for (int j = 0; j < n; j++, vp += row) {
                    for (int i = 0; i < NV; i++) kv[i] = widen16(vp + 16 * i);
                    for (int g = 0; g < G; g++) {
                        const __m512 p = _mm512_set1_ps(scores[g * max_len + t0 + j]);
                        for (int i = 0; i < NV; i++) acc[g][i] = _mm512_fmadd_ps(p, kv[i], acc[g][i]);
                    }
                }
            }
            for (int g = 0; g < G; g++) {
                uint16_t *op = out + ((int64_t)b * KV * G + (int64_t)h * G + g) * D;
                const __m512 inv = _mm512_set1_ps(1.f / sum[g]);
                float tmp[16];
                for (int i = 0; i < NV; i++) {
                    _mm512_storeu_ps(tmp, _mm512_mul_ps(acc[g][i], inv));
                    for (int e = 0; e < 16; e++) op[16 * i + e] = bf16_store(tmp[e]);
                }
            }
        }
        free(scores);
    }
    return failed;
}
#endif

int paged_decode_attention_bf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                                const int64_t *tables, const int64_t *lens, uint16_t *out, int B,
                                int KV, int G, int D, int BS, int W, float scale, int num_threads) {
#ifdef __AVX512F__
    if (D % 16 == 0 && G <= MAX_G && D <= MAX_D)
        return decode_bf16_avx512(q, kc, vc, tables, lens, out, B, KV, G, D, BS, W, scale,
                                  num_threads);
#endif
    return paged_decode_attention_bf16_generic(q, kc, vc, tables, lens, out, B, KV, G, D, BS, W,
                                               scale, num_threads);
}
