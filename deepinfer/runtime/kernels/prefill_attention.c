/* Causal flash-style attention for one prefill chunk on CPU (bf16, AVX-512 BF16). Built at run
 * time by cpu_prefill_kernel.py with the host's compiler (-O3 -march=native).
 *
 * A chunk of x new tokens follows P cached ones; query token t (0-based in the chunk) sees keys
 * 0 .. P + t. Keys are read in place through a block table: key c of KV head h is at
 *
 *     k + table[c / BS] * block_stride + (c % BS) * token_stride + h * D
 *
 * (V the same with v_token_stride: the chunk's own K and V can be views with different strides)
 * (the paged cache [blocks, BS, KV, D], or the chunk's own K/V rows as one "block").
 *   q    [x, KV * G, D]: token stride q_stride, heads D apart (a view into the QKV output)
 *   out  [x, KV * G, D]: token stride out_stride
 *
 * One task = one KV head x one tile of BQ query tokens; its G query heads are processed
 * together (rows g * BQ + t), so each K/V row is read once for all of them. Per tile of BK keys:
 *   S^T[c][rows] = K Q^T   vdpbf16ps: one K pair (2 bf16 of one key) broadcast against 16 rows
 *                          of Q packed in pairs, so K needs no repacking and each vector of S
 *                          holds one key for 16 query rows;
 *   online softmax in fp32 over those vectors (no horizontal reductions), exp2 by vscalefps;
 *   O^T[d][rows] += V^T P  vdpbf16ps: P rounded to bf16 in key pairs, V repacked per tile as
 *                          (V[c][d], V[c+1][d]) pairs broadcast against 16 rows of P.
 * Padded keys (to a multiple of KC) read a zero row and are masked; padded query rows (past x)
 * are computed on zeros and never stored. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define MAX_D 256
#define MAX_G 16
#define BK 64          /* keys per tile */
#define KC 8           /* keys per register block of S */
#define NR 3           /* 16-row vectors per register block (NR * KC = 24 accumulators) */
#define DC 8           /* head-dim columns per register block of O (NR * DC = 24) */
#define NEG_BIG -1e30f /* "minus infinity" that stays finite under -ffast-math */

int prefill_attention_available(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512BF16__
static const uint16_t zero_row[MAX_D] __attribute__((aligned(64)));

/* 2^x for x <= 0 (scores minus their running max): 2^round(x) * 2^f, f in [-0.5, 0.5],
 * degree-5 Taylor (relative error ~3e-6, far below bf16's 4e-3). */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-200.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

static inline uint32_t load_pair(const uint16_t *p) {
    uint32_t u;
    memcpy(&u, p, sizeof u);
    return u;
}

/* r[i][c] -> r[c][i] for a 16 x 16 block of 32-bit words (bf16 pairs). */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    __m512i u[16]; /* u[4g + e], 128-bit lane k: rows 4g .. 4g+3 at column 4k + e */
    for (int g = 0; g < 16; g += 4) {
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int e = 0; e < 4; e++) { /* a 4 x 4 transpose of 128-bit lanes */
        const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44);
        const __m512i v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
        r[e] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + e] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* S[c][rv0 .. rv0+nr) (unscaled) for KC keys starting at krow[0]: acc = sum over D/2 pairs. nr is a
 * compile-time constant at each call site (the switch below), so the accumulators stay in
 * registers. */
static inline __attribute__((always_inline)) void qk_block(
        const uint32_t *qp, int R, int rv0, const int nr, const uint16_t *const *krow, int D,
        float *S) {
    __m512 acc[NR][KC];
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < KC; c++) acc[i][c] = _mm512_setzero_ps();
    for (int j = 0; j < D / 2; j++) {
        __m512i qv[NR];
        for (int i = 0; i < nr; i++)
            qv[i] = _mm512_loadu_si512((const void *)(qp + (int64_t)j * R + 16 * (rv0 + i)));
        for (int c = 0; c < KC; c++) {
            const __m512i kb = _mm512_set1_epi32((int)load_pair(krow[c] + 2 * j));
            for (int i = 0; i < nr; i++)
                acc[i][c] = _mm512_dpbf16_ps(acc[i][c], as_bh(qv[i]), as_bh(kb));
        }
    }
    for (int c = 0; c < KC; c++)
        for (int i = 0; i < nr; i++)
            _mm512_storeu_ps(S + (int64_t)c * R + 16 * (rv0 + i), acc[i][c]);
}

/* O^T[d0 .. d0+DC)[rv0 .. rv0+nr) = O^T * alpha + sum over key pairs of P2 x Vp. */
static inline __attribute__((always_inline)) void pv_block(
        float *O, int R, int rv0, const int nr, int d0, const uint32_t *p2, const uint32_t *vp,
        int npairs, int D, const __m512 *alpha) {
    __m512 acc[NR][DC];
    for (int i = 0; i < nr; i++)
        for (int d = 0; d < DC; d++)
            acc[i][d] = _mm512_mul_ps(_mm512_loadu_ps(O + (int64_t)(d0 + d) * R + 16 * (rv0 + i)),
                                      alpha[rv0 + i]);
    for (int cp = 0; cp < npairs; cp++) {
        __m512i pv[NR];
        for (int i = 0; i < nr; i++)
            pv[i] = _mm512_loadu_si512((const void *)(p2 + (int64_t)cp * R + 16 * (rv0 + i)));
        for (int d = 0; d < DC; d++) {
            const __m512i vb = _mm512_set1_epi32((int)vp[(int64_t)cp * D + d0 + d]);
            for (int i = 0; i < nr; i++)
                acc[i][d] = _mm512_dpbf16_ps(acc[i][d], as_bh(pv[i]), as_bh(vb));
        }
    }
    for (int i = 0; i < nr; i++)
        for (int d = 0; d < DC; d++)
            _mm512_storeu_ps(O + (int64_t)(d0 + d) * R + 16 * (rv0 + i), acc[i][d]);
}

typedef struct {
    uint32_t *qp;  /* [D/2][R] Q pairs */
    float *S;      /* [BK][R] scores, then probabilities */
    uint32_t *p2;  /* [BK/2][R] probability pairs (bf16) */
    uint32_t *vp;  /* [BK/2][D] V pairs */
    float *O;      /* [D][R] */
} scratch_t;

static int task(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                const int64_t *table, int64_t block_stride, int64_t token_stride,
                int64_t v_token_stride, int BS, uint16_t *out, int64_t out_stride, int x, int P, int G, int D, int BQ, int h,
                int qt, float scale, scratch_t *w) {
    const int R = G * BQ, RV = R / 16, per_g = BQ / 16;
    const int q0 = qt * BQ, nq = x - q0 < BQ ? x - q0 : BQ;
    /* Q pairs of this tile, zeros past x: 16 rows x 16 pairs at a time, transposed in
     * registers (a per-element loop here cost ~9% of a 512 prefill's attention) */
    for (int rv = 0; rv < RV; rv++) {
        const int g = rv / per_g, t0 = (rv % per_g) * 16;
        const int ntok = nq - t0 < 0 ? 0 : (nq - t0 < 16 ? nq - t0 : 16);
        const uint16_t *base = q + (int64_t)(q0 + t0) * q_stride + (int64_t)(h * G + g) * D;
        for (int j0 = 0; j0 < D / 2; j0 += 16) {
            __m512i r[16];
            for (int t = 0; t < 16; t++)
                r[t] = t < ntok ? _mm512_loadu_si512((const void *)(base + (int64_t)t * q_stride + 2 * j0))
                                : _mm512_setzero_si512();
            transpose16(r);
            for (int c = 0; c < 16; c++)
                _mm512_storeu_si512((void *)(w->qp + (int64_t)(j0 + c) * R + 16 * rv), r[c]);
        }
    }
    memset(w->O, 0, sizeof(float) * (size_t)D * (size_t)R);
    __m512 m[MAX_G * 3], l[MAX_G * 3], alpha[MAX_G * 3];
    for (int i = 0; i < RV; i++) {
        m[i] = _mm512_set1_ps(NEG_BIG);
        l[i] = _mm512_setzero_ps();
    }
    /* word 2r <- P[c][r], word 2r+1 <- P[c+1][r] from cvtne2ps(P[c+1], P[c]) */
    uint16_t idx_words[32];
    for (int i = 0; i < 16; i++) {
        idx_words[2 * i] = (uint16_t)i;
        idx_words[2 * i + 1] = (uint16_t)(16 + i);
    }
    const __m512i pair_idx = _mm512_loadu_si512((const void *)idx_words);
    uint16_t lo_words[32], hi_words[32]; /* V pairs of d 0..15 and 16..31 from two rows */
    for (int i = 0; i < 16; i++) {
        lo_words[2 * i] = (uint16_t)i;       lo_words[2 * i + 1] = (uint16_t)(32 + i);
        hi_words[2 * i] = (uint16_t)(16 + i); hi_words[2 * i + 1] = (uint16_t)(48 + i);
    }
    const __m512i lo_idx = _mm512_loadu_si512((const void *)lo_words);
    const __m512i hi_idx = _mm512_loadu_si512((const void *)hi_words);
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int limit = P + q0 + nq; /* keys the tile's last real query sees */
    const __m512 sc = _mm512_set1_ps(scale); /* softmax scale * log2(e) */
    const uint16_t *krow[BK], *vrow[BK];
    for (int c0 = 0; c0 < limit; c0 += BK) {
        const int n = limit - c0 < BK ? limit - c0 : BK;
        const int n8 = (n + KC - 1) / KC * KC;
        for (int c = 0; c < n8; c++) {
            if (c < n) {
                const int key = c0 + c;
                const int64_t blk = table[key / BS] * block_stride + (int64_t)h * D;
                krow[c] = k + blk + (int64_t)(key % BS) * token_stride;
                vrow[c] = v + blk + (int64_t)(key % BS) * v_token_stride;
            } else {
                krow[c] = vrow[c] = zero_row;
            }
        }
        /* S = K Q^T (the softmax scale goes into its exp2) */
        for (int c = 0; c < n8; c += KC) {
            int rv = 0;
            for (; rv + 3 <= RV; rv += 3) qk_block(w->qp, R, rv, 3, krow + c, D, w->S + (int64_t)c * R);
            if (RV - rv == 2) qk_block(w->qp, R, rv, 2, krow + c, D, w->S + (int64_t)c * R);
            else if (RV - rv == 1) qk_block(w->qp, R, rv, 1, krow + c, D, w->S + (int64_t)c * R);
        }
        /* causal mask where the tile reaches past the first query's last key (and padding) */
        if (c0 + n8 - 1 > P + q0) {
            for (int rv = 0; rv < RV; rv++) {
                const __m512i pos = _mm512_add_epi32(
                    _mm512_set1_epi32(P + q0 + (rv % per_g) * 16), iota);
                for (int c = 0; c < n8; c++) {
                    const __mmask16 hide = _mm512_cmplt_epi32_mask(pos, _mm512_set1_epi32(c0 + c));
                    float *s = w->S + (int64_t)c * R + 16 * rv;
                    _mm512_storeu_ps(s, _mm512_mask_mov_ps(_mm512_loadu_ps(s), hide,
                                                          _mm512_set1_ps(NEG_BIG)));
                }
            }
        }
        /* online softmax: running max and sum per row, probabilities as bf16 key pairs */
        for (int rv = 0; rv < RV; rv++) {
            __m512 mx = m[rv];
            for (int c = 0; c < n8; c++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(w->S + (int64_t)c * R + 16 * rv));
            alpha[rv] = exp2_ps(_mm512_mul_ps(_mm512_sub_ps(m[rv], mx), sc));
            m[rv] = mx;
            const __m512 shift = _mm512_mul_ps(mx, _mm512_set1_ps(-scale));
            __m512 sum = _mm512_setzero_ps();
            for (int c = 0; c < n8; c += 2) {
                const __m512 p0 = exp2_ps(_mm512_fmadd_ps(_mm512_loadu_ps(w->S + (int64_t)c * R + 16 * rv), sc, shift));
                const __m512 p1 = exp2_ps(_mm512_fmadd_ps(_mm512_loadu_ps(w->S + (int64_t)(c + 1) * R + 16 * rv), sc, shift));
                sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
                const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
                _mm512_storeu_si512((void *)(w->p2 + (int64_t)(c / 2) * R + 16 * rv),
                                    _mm512_permutexvar_epi16(pair_idx, both));
            }
            l[rv] = _mm512_fmadd_ps(l[rv], alpha[rv], sum);
        }
        /* V pairs (V[c][d], V[c+1][d]) */
        for (int c = 0; c < n8; c += 2) {
            uint32_t *dst = w->vp + (int64_t)(c / 2) * D;
            for (int d = 0; d < D; d += 32) {
                const __m512i a = _mm512_loadu_si512((const void *)(vrow[c] + d));
                const __m512i b = _mm512_loadu_si512((const void *)(vrow[c + 1] + d));
                _mm512_storeu_si512((void *)(dst + d), _mm512_permutex2var_epi16(a, lo_idx, b));
                _mm512_storeu_si512((void *)(dst + d + 16), _mm512_permutex2var_epi16(a, hi_idx, b));
            }
        }
        /* O = O * alpha + V^T P */
        for (int d0 = 0; d0 < D; d0 += DC) {
            int rv = 0;
            for (; rv + 3 <= RV; rv += 3) pv_block(w->O, R, rv, 3, d0, w->p2, w->vp, n8 / 2, D, alpha);
            if (RV - rv == 2) pv_block(w->O, R, rv, 2, d0, w->p2, w->vp, n8 / 2, D, alpha);
            else if (RV - rv == 1) pv_block(w->O, R, rv, 1, d0, w->p2, w->vp, n8 / 2, D, alpha);
        }
    }
    /* out = O / l in bf16 (nearest even): per 16 rows, d pairs packed as the P pairs are, then
     * transposed back to rows 16 pairs at a time */
    for (int rv = 0; rv < RV; rv++) {
        const int g = rv / per_g, t0 = (rv % per_g) * 16;
        const int ntok = nq - t0 < 16 ? nq - t0 : 16;
        if (ntok <= 0) continue;
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l[rv]);
        uint16_t *base = out + (int64_t)(q0 + t0) * out_stride + (int64_t)(h * G + g) * D;
        for (int j0 = 0; j0 < D / 2; j0 += 16) {
            __m512i r[16];
            for (int c = 0; c < 16; c++) {
                const int dp = j0 + c;
                const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(w->O + (int64_t)(2 * dp) * R + 16 * rv), inv);
                const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(w->O + (int64_t)(2 * dp + 1) * R + 16 * rv), inv);
                r[c] = _mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(b, a));
            }
            transpose16(r);
            for (int t = 0; t < ntok; t++)
                _mm512_storeu_si512((void *)(base + (int64_t)t * out_stride + 2 * j0), r[t]);
        }
    }
    return 0;
}
#endif

/* Returns 0 on success, 1 for shapes it does not take (the caller uses SDPA), 2 when built
 * without AVX-512 BF16, 3 when out of memory. */
int prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                           const uint16_t *v, const int64_t *table, int64_t block_stride,
                           int64_t token_stride, int64_t v_token_stride, int BS, uint16_t *out,
                           int64_t out_stride, int x,
                           int P, int KV, int G, int D, float scale, int num_threads) {
#ifdef __AVX512BF16__
    if (D % 32 != 0 || D > MAX_D || G < 1 || G > MAX_G || x < 1 || P < 0 || BS < 1) return 1;
    const int BQ = G <= 2 ? 48 : 16; /* 3 row vectors per KV head at least */
    const int R = G * BQ, nqt = (x + BQ - 1) / BQ;
    const float scale2 = scale * 1.4426950408889634f; /* softmax in base 2 */
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        scratch_t w;
        const size_t bytes = sizeof(uint32_t) * (size_t)(D / 2) * R + sizeof(float) * (size_t)BK * R
                             + sizeof(uint32_t) * (size_t)(BK / 2) * R
                             + sizeof(uint32_t) * (size_t)(BK / 2) * D + sizeof(float) * (size_t)D * R;
        char *mem = (char *)aligned_alloc(64, (bytes + 63) / 64 * 64); /* size: a multiple of 64 */
        if (!mem) failed = 3;
        else {
            w.qp = (uint32_t *)mem;
            w.S = (float *)(w.qp + (size_t)(D / 2) * R);
            w.p2 = (uint32_t *)(w.S + (size_t)BK * R);
            w.vp = w.p2 + (size_t)(BK / 2) * R;
            w.O = (float *)(w.vp + (size_t)(BK / 2) * D);
        }
        /* heaviest tiles (the last queries see the most keys) first */
        _Pragma("omp for schedule(dynamic, 1)")
        for (int i = 0; i < KV * nqt; i++) {
            if (!mem) continue;
            task(q, q_stride, k, v, table, block_stride, token_stride, v_token_stride, BS, out, out_stride, x, P,
                 G, D, BQ, i % KV, nqt - 1 - i / KV, scale2, &w);
        }
        free(mem);
    }
    return failed;
#else
    (void)q; (void)q_stride; (void)k; (void)v; (void)table; (void)block_stride;
    (void)token_stride; (void)v_token_stride; (void)BS; (void)out; (void)out_stride; (void)x; (void)P; (void)KV;
    (void)G; (void)D; (void)scale; (void)num_threads;
    return 2;
#endif
}
