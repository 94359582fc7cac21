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
#include <stdlib.h>
#include "decode_attention_bf16.h"

#define MAX_G DECODE_MAX_G
#define MAX_D DECODE_MAX_D

static inline void bf16_row(float *restrict dst, const uint16_t *restrict src, int n) {
    for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

static inline uint16_t bf16_store(float f) { return f32_to_bf16(f); }

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

#ifdef DECODE_ROWS_BF16
static int decode_bf16_vector(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                              const int64_t *tables, const int64_t *lens, uint16_t *out, int B,
                              int KV, int G, int D, int BS, int W, float scale, int num_threads) {
    int64_t max_len = 1;
    for (int b = 0; b < B; b++) if (lens[b] > max_len) max_len = lens[b];
    /* rows of one sequence (a verification's 1 + k) read its K/V once: decode_row_groups */
    int *first = (int *)malloc(sizeof(int) * 2 * (size_t)B);
    if (!first) return 1;
    int *count = first + B;
    const int groups = decode_row_groups(tables, W, B, G, num_threads > 1 && KV % num_threads ? num_threads : 1,
                                         first, count);
    int max_rows = 1;
    for (int i = 0; i < groups; i++) if (count[i] > max_rows) max_rows = count[i];
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)max_rows * G * (size_t)max_len);
        if (!scores) failed = 1;
        _Pragma("omp for schedule(dynamic, 1)")
        for (int task = 0; task < groups * KV; task++) {
            if (!scores) continue;
            const int b = first[task / KV], h = task % KV;
            const int64_t at = ((int64_t)b * KV * G + (int64_t)h * G) * D; /* first query row */
            DECODE_ROWS_BF16(q + at, (int64_t)KV * G * D, count[task / KV], kc, vc,
                                    tables + (int64_t)b * W, lens + b, out + at,
                                    (int64_t)KV * G * D, KV, G, D, BS, h,
                                    scale, scores, max_len);
        }
        free(scores);
    }
    free(first);
    return failed;
}
#endif

int paged_decode_attention_bf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                                const int64_t *tables, const int64_t *lens, uint16_t *out, int B,
                                int KV, int G, int D, int BS, int W, float scale, int num_threads) {
#ifdef DECODE_ROWS_BF16
    if (D % DECODE_ROWS_WIDTH == 0 && G <= MAX_G && D <= MAX_D)
        return decode_bf16_vector(q, kc, vc, tables, lens, out, B, KV, G, D, BS, W, scale,
                                  num_threads);
#endif
    return paged_decode_attention_bf16_generic(q, kc, vc, tables, lens, out, B, KV, G, D, BS, W,
                                               scale, num_threads);
}
