/* MLA (DeepSeek-V2/V3) decode attention in the absorbed form, read straight from the paged
 * latent cache through the block table (no gather copy, no mask). Built at run time by
 * cpu_mla_kernel.py with the host's compiler (-O3 -march=native).
 *
 *   q       [B, H, D]            absorbed queries (absorb_query), D = r + rope
 *   cache   [num_blocks, BS, D]  one layer's latent entries [latent | k_pe]
 *   tables  [B, W] int64 block ids; lens [B] int64 context lengths (new token included)
 *   out     [B, H, R]            softmax(q . entry * scale) @ entry[:R]  (R = r)
 *
 * Every head attends to the same entries, so a task (one sequence, a group of heads) walks the
 * context in chunks of at most CHUNK tokens of one block, widens each chunk to float32 once and
 * runs it against all its heads: scores as a [heads x chunk] tile product, then an online
 * softmax update (rescale by exp(old max - new max) once per chunk, not per token) and the
 * weighted sum of the chunk's first R columns. Each entry is read from memory once per task,
 * and the chunk stays in L1/L2 between its two uses. All accumulation is float32. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include "bf16_cpu.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_FMA 1
#endif

#define CHUNK 32
/* Heads per task: a group's float32 queries and accumulators (32 x 576 + 32 x 512 floats,
 * ~140 KB at DeepSeek's shape) stay in L2 while the chunk streams past them. */
#define MAX_GROUP 32

/* 0 portable, 1 AVX2 + FMA: the tile code this build uses (for logs and tests). */
int mla_decode_isa(void) {
#ifdef HAVE_AVX2_FMA
    return 1;
#else
    return 0;
#endif
}

#ifdef HAVE_AVX2_FMA
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* s[a * CHUNK + j] = q_a . k_j for a < NQ query rows, j < NK entry rows (NQ <= 4, NK <= 2:
 * literal at every call, so the accumulators are registers). */
static inline __attribute__((always_inline)) void score_tile(
        const float *q, const float *k, int D, float *s, const int NQ, const int NK) {
    __m256 acc[4][2];
    for (int a = 0; a < NQ; a++)
        for (int j = 0; j < NK; j++) acc[a][j] = _mm256_setzero_ps();
    const int D8 = D & ~7;
    for (int d = 0; d < D8; d += 8) {
        __m256 kv[2];
        for (int j = 0; j < NK; j++) kv[j] = _mm256_loadu_ps(k + (size_t)j * D + d);
        for (int a = 0; a < NQ; a++) {
            const __m256 qv = _mm256_loadu_ps(q + (size_t)a * D + d);
            for (int j = 0; j < NK; j++) acc[a][j] = _mm256_fmadd_ps(qv, kv[j], acc[a][j]);
        }
    }
    for (int a = 0; a < NQ; a++)
        for (int j = 0; j < NK; j++) {
            float f = hsum8(acc[a][j]);
            for (int d = D8; d < D; d++) f += q[(size_t)a * D + d] * k[(size_t)j * D + d];
            s[a * CHUNK + j] = f;
        }
}

/* acc_a[d .. d + 8 NV) = alpha_a acc_a + sum_j p[a * CHUNK + j] k_j[d ..] for NH heads. */
static inline __attribute__((always_inline)) void value_tile(
        float *acc, int R, const float *alpha, const float *p, const float *k, int D, int n,
        int d, const int NH, const int NV) {
    __m256 o[4][2];
    for (int a = 0; a < NH; a++) {
        const __m256 al = _mm256_set1_ps(alpha[a]);
        for (int v = 0; v < NV; v++)
            o[a][v] = _mm256_mul_ps(al, _mm256_loadu_ps(acc + (size_t)a * R + d + 8 * v));
    }
    for (int j = 0; j < n; j++) {
        __m256 kv[2];
        for (int v = 0; v < NV; v++) kv[v] = _mm256_loadu_ps(k + (size_t)j * D + d + 8 * v);
        for (int a = 0; a < NH; a++) {
            const __m256 pv = _mm256_broadcast_ss(p + a * CHUNK + j);
            for (int v = 0; v < NV; v++) o[a][v] = _mm256_fmadd_ps(pv, kv[v], o[a][v]);
        }
    }
    for (int a = 0; a < NH; a++)
        for (int v = 0; v < NV; v++) _mm256_storeu_ps(acc + (size_t)a * R + d + 8 * v, o[a][v]);
}
#endif

/* s[a * CHUNK + j] = q_a . k_j for every head a < nh and chunk row j < n. */
static void chunk_scores(const float *q, int nh, int D, const float *k, int n, float *s) {
    int a = 0;
#ifdef HAVE_AVX2_FMA
    for (; a + 4 <= nh; a += 4) {
        int j = 0;
        for (; j + 2 <= n; j += 2)
            score_tile(q + (size_t)a * D, k + (size_t)j * D, D, s + a * CHUNK + j, 4, 2);
        if (j < n) score_tile(q + (size_t)a * D, k + (size_t)j * D, D, s + a * CHUNK + j, 4, 1);
    }
    for (; a < nh; a++) {
        int j = 0;
        for (; j + 2 <= n; j += 2)
            score_tile(q + (size_t)a * D, k + (size_t)j * D, D, s + a * CHUNK + j, 1, 2);
        if (j < n) score_tile(q + (size_t)a * D, k + (size_t)j * D, D, s + a * CHUNK + j, 1, 1);
    }
#endif
    for (; a < nh; a++)
        for (int j = 0; j < n; j++) {
            float f = 0.f;
            for (int d = 0; d < D; d++) f += q[(size_t)a * D + d] * k[(size_t)j * D + d];
            s[a * CHUNK + j] = f;
        }
}

/* acc_a = alpha_a acc_a + sum_j p[a * CHUNK + j] k_j[:R] for every head a < nh. */
static void chunk_values(float *acc, int R, const float *alpha, const float *p, int nh,
                         const float *k, int D, int n) {
    int a = 0;
#ifdef HAVE_AVX2_FMA
    const int R16 = R & ~15, R8 = R & ~7;
    for (; a + 4 <= nh; a += 4) {
        for (int d = 0; d < R16; d += 16)
            value_tile(acc + (size_t)a * R, R, alpha + a, p + a * CHUNK, k, D, n, d, 4, 2);
        if (R8 > R16)
            value_tile(acc + (size_t)a * R, R, alpha + a, p + a * CHUNK, k, D, n, R16, 4, 1);
    }
    for (; a < nh; a++) {
        for (int d = 0; d < R16; d += 16)
            value_tile(acc + (size_t)a * R, R, alpha + a, p + a * CHUNK, k, D, n, d, 1, 2);
        if (R8 > R16)
            value_tile(acc + (size_t)a * R, R, alpha + a, p + a * CHUNK, k, D, n, R16, 1, 1);
    }
    for (int b = 0; b < nh; b++) /* the columns past the last multiple of 8 */
        for (int d = R8; d < R; d++) {
            float o = alpha[b] * acc[(size_t)b * R + d];
            for (int j = 0; j < n; j++) o += p[b * CHUNK + j] * k[(size_t)j * D + d];
            acc[(size_t)b * R + d] = o;
        }
#endif
    for (; a < nh; a++)
        for (int d = 0; d < R; d++) {
            float o = alpha[a] * acc[(size_t)a * R + d];
            for (int j = 0; j < n; j++) o += p[a * CHUNK + j] * k[(size_t)j * D + d];
            acc[(size_t)a * R + d] = o;
        }
}

/* How many head groups each sequence is cut into: groups of at most MAX_GROUP heads, and
 * enough groups that B * groups tasks give every thread work (batch 1 uses all threads). */
static int head_groups(int B, int H, int num_threads) {
    int groups = (H + MAX_GROUP - 1) / MAX_GROUP;
    const int want = (num_threads + B - 1) / B;
    if (groups < want) groups = want;
    if (groups > H) groups = H;
    return groups;
}

static inline void widen_bf16(float *restrict dst, const uint16_t *restrict src, int64_t n) {
    int64_t i = 0;
#ifdef HAVE_AVX2_FMA
    for (; i + 8 <= n; i += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
#endif
    for (; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* float32 rows as they are (no copy: a chunk lies inside one block, so its rows are
 * contiguous); bf16 rows widened into the task's scratch. */
static inline const float *chunk_f32(float *scratch, const float *src, int64_t n) {
    (void)scratch; (void)n;
    return src;
}
static inline const float *chunk_bf16(float *scratch, const uint16_t *src, int64_t n) {
    widen_bf16(scratch, src, n);
    return scratch;
}
static inline void query_f32(float *dst, const float *src, int64_t n) {
    memcpy(dst, src, sizeof(float) * (size_t)n);
}
static inline float store_f32(float f) { return f; }

#define DEFINE_KERNEL(NAME, T, CHUNK_ROWS, QUERY_ROWS, STORE)                                   \
int NAME(const T *q, const T *cache, const int64_t *tables, const int64_t *lens, T *out,        \
         int B, int H, int D, int R, int BS, int W, float scale, int num_threads) {             \
    if (R > D || B < 1 || H < 1 || BS < 1) return 2;                                            \
    const int groups = head_groups(B, H, num_threads);                                          \
    const int per = (H + groups - 1) / groups;                                                  \
    int failed = 0;                                                                             \
    _Pragma("omp parallel num_threads(num_threads)")                                            \
    {                                                                                           \
        float *buf = (float *)malloc(sizeof(float) * ((size_t)CHUNK * D + (size_t)per * D       \
                                     + (size_t)per * R + (size_t)per * CHUNK + 4 * (size_t)per)); \
        if (!buf) failed = 1;                                                                   \
        _Pragma("omp for schedule(dynamic, 1)")                                                 \
        for (int task = 0; task < B * groups; task++) {                                         \
            if (!buf) continue;                                                                 \
            const int b = task / groups, h0 = (task % groups) * per;                            \
            const int nh = H - h0 < per ? H - h0 : per;                                         \
            if (nh <= 0) continue;                                                              \
            float *kf = buf, *qf = kf + (size_t)CHUNK * D, *acc = qf + (size_t)per * D;         \
            float *s = acc + (size_t)per * R, *mx = s + (size_t)per * CHUNK, *sum = mx + per;   \
            float *alpha = sum + per;                                                           \
            const int64_t len = lens[b];                                                        \
            const int64_t *tab = tables + (int64_t)b * W;                                       \
            QUERY_ROWS(qf, q + ((int64_t)b * H + h0) * D, (int64_t)nh * D);                     \
            for (int64_t i = 0; i < (int64_t)nh * D; i++) qf[i] *= scale;                       \
            memset(acc, 0, sizeof(float) * (size_t)nh * R);                                     \
            for (int a = 0; a < nh; a++) { mx[a] = -FLT_MAX; sum[a] = 0.f; }                    \
            for (int64_t t0 = 0; t0 < len;) {                                                   \
                const int64_t off = t0 % BS;                                                    \
                int n = CHUNK;                                                                  \
                if (BS - off < n) n = (int)(BS - off);                                          \
                if (len - t0 < n) n = (int)(len - t0);                                          \
                const T *src = cache + (tab[t0 / BS] * BS + off) * D;                           \
                const float *k = CHUNK_ROWS(kf, src, (int64_t)n * D);                           \
                chunk_scores(qf, nh, D, k, n, s);                                               \
                for (int a = 0; a < nh; a++) {                                                  \
                    float *sa = s + a * CHUNK, m = mx[a];                                       \
                    for (int j = 0; j < n; j++) if (sa[j] > m) m = sa[j];                       \
                    /* the first chunk starts from nothing: no exp of -FLT_MAX - m */           \
                    alpha[a] = t0 == 0 ? 0.f : expf(mx[a] - m);                                 \
                    float total = 0.f;                                                          \
                    for (int j = 0; j < n; j++) { sa[j] = expf(sa[j] - m); total += sa[j]; }    \
                    sum[a] = sum[a] * alpha[a] + total;                                         \
                    mx[a] = m;                                                                  \
                }                                                                               \
                chunk_values(acc, R, alpha, s, nh, k, D, n);                                    \
                t0 += n;                                                                        \
            }                                                                                   \
            for (int a = 0; a < nh; a++) {                                                      \
                T *op = out + ((int64_t)b * H + h0 + a) * R;                                    \
                const float inv = sum[a] > 0.f ? 1.f / sum[a] : 0.f;                            \
                for (int d = 0; d < R; d++) op[d] = STORE(acc[(size_t)a * R + d] * inv);        \
            }                                                                                   \
        }                                                                                       \
        free(buf);                                                                              \
    }                                                                                           \
    return failed;                                                                              \
}

DEFINE_KERNEL(mla_decode_bf16, uint16_t, chunk_bf16, widen_bf16, f32_to_bf16)
DEFINE_KERNEL(mla_decode_f32, float, chunk_f32, query_f32, store_f32)
