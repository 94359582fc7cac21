/* The AVX2 and portable dot products of a quantized weight row with M prepared activation
 * rows (ACT_BLK32 for GGUF: natural-order int8, a scale per 32 values, sums per 16; ACT_ROW
 * for int8; ACT_BF16 for fp8). The same sums as quant_dot_avx512.h, one 32-value block at a
 * time. AVX2 multiplies unsigned x signed bytes with vpmaddubsw (pairs summed into int16: weight
 * codes <= 63 cannot saturate; signed weights go through the sign trick |w| x sign(x, w)) and
 * adds block offsets and minimums per block in float; fp8 and int8 weights take
 * quant_dot_avx2_element.h. The portable code multiplies each block's reference float weights
 * (dequant_row_f32) with the int8 activations. */
#ifndef DEEPINFER_QUANT_DOT_PORTABLE_H
#define DEEPINFER_QUANT_DOT_PORTABLE_H
#include "quant_act.h"
#include "quant_dot_avx2_element.h"

typedef void (*qrows_fn)(const qweight *, int64_t, const qact *, int, float *);

static inline const float *blk_dx(const qact *a, int m) { return qact_dxv(a, m); }
static inline const int32_t *blk_s16(const qact *a, int m) { return qact_lsum(a, m); }

/* Per block b of row m: a block's weight scale / offset / minimum applied to the int sum. */
static void scalar_rows(const qweight *w, int64_t n, const qact *a, int m0, float *dots, int M) {
    const uint8_t *b = qweight_row(w, n);
    const int K = w->cols, fmt = w->format;
    for (int m = 0; m < M; m++) {
        const int8_t *x = qact_q(a, m0 + m);
        const float *dx = blk_dx(a, m0 + m);
        float acc = 0.f;
        if (fmt == QF_INT8) {
            int32_t s = 0;
            const int8_t *wq = (const int8_t *)b; /* GCC 12 -O3 mis-vectorised (int8_t)b[k] * x[k] */
            for (int k = 0; k < K; k++) s += wq[k] * x[k];
            dots[m] = (float)s * (w->scale[n] * a->rs[m0 + m]);
            continue;
        }
        if (fmt == QF_FP8) {
            const uint16_t *xb = qact_x16(a, m0 + m);
            const int kb = (K + FP8_TILE - 1) / FP8_TILE;
            const float *s = w->scale + (n / FP8_TILE) * kb;
            for (int j = 0; j < kb; j++) {
                float t = 0.f;
                for (int k = j * FP8_TILE; k < K && k < (j + 1) * FP8_TILE; k++)
                    t += e4m3_to_f32(b[k]) * bf16_to_f32(xb[k]);
                acc += t * s[j];
            }
            dots[m] = acc;
            continue;
        }
        /* a block's float weights (the reference values) times the int8 activations */
        float wv[256];
        const int bv = QF_BLOCK_VALUES[fmt], bs = QF_BLOCK_BYTES[fmt];
        for (int i = 0; i < K / bv; i++) {
            const qweight one = {fmt, 1, bv, b + (int64_t)i * bs, NULL};
            dequant_row_f32(&one, 0, wv);
            for (int j = 0; j < bv / 32; j++) {
                const int blk = i * (bv / 32) + j;
                float f = 0.f;
                for (int l = 0; l < 32; l++) f += wv[32 * j + l] * (float)x[32 * blk + l];
                acc += f * dx[blk];
            }
        }
        dots[m] = acc;
    }
}

#ifdef HAVE_QUANT_AVX2
static inline __m256i dot_u8s8_avx2(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* One 32-value block's codes as unsigned bytes (or, `is_signed`, signed), its per-lane scale
 * (8 lanes: two 16-value halves for q6_k) and its additive float term per activation sum. */
typedef struct { __m256i q; __m256 scale; float off_a, off_b; int is_signed; } blk32;

/* GGUF formats; M is a compile-time constant in each instance (avx2_rows), so the per-row
 * accumulators stay in registers instead of a stack array updated every block. */
QINLINE2 void gguf_rows_avx2_m(const qweight *w, int64_t n, const qact *a, int m0, float *dots,
                               const int M) {
    const int fmt = w->format, K = w->cols;
    const uint8_t *b = qweight_row(w, n);
    __m256 acc[QACT_MAX_M];
    float off[QACT_MAX_M];
    for (int m = 0; m < M; m++) { acc[m] = _mm256_setzero_ps(); off[m] = 0.f; }
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int bv = QF_BLOCK_VALUES[fmt], bs = QF_BLOCK_BYTES[fmt];
    for (int i = 0; i < K / bv; i++) {
        const uint8_t *blk = b + (int64_t)i * bs;
        blk32 parts[8];
        int np = 0;
        if (fmt == QF_Q4_0 || fmt == QF_Q4_1) {
            const int off_q = fmt == QF_Q4_1 ? 4 : 2;
            const __m128i q = _mm_loadu_si128((const __m128i *)(blk + off_q));
            const float d = f16_to_f32(blk);
            parts[np++] = (blk32){_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4),
                                  _mm256_set1_ps(d), fmt == QF_Q4_1 ? f16_to_f32(blk + 2) : -8.f * d,
                                  0.f, 0};
            parts[0].off_b = parts[0].off_a;
        } else if (fmt == QF_Q8_0) {
            parts[np++] = (blk32){_mm256_loadu_si256((const __m256i *)(blk + 2)),
                                  _mm256_set1_ps(f16_to_f32(blk)), 0.f, 0.f, 1};
        } else if (fmt == QF_Q4_K || fmt == QF_Q5_K) {
            uint8_t sc[8], mn[8];
            k_scales_mins(blk + 4, sc, mn);
            const float d = f16_to_f32(blk), dmin = f16_to_f32(blk + 2);
            const int q5 = fmt == QF_Q5_K;
            const uint8_t *qs = blk + (q5 ? 48 : 16);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
            for (int c = 0; c < 4; c++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                for (int h = 0; h < 2; h++) {
                    const int j = 2 * c + h;
                    __m256i v = _mm256_and_si256(h ? _mm256_srli_epi16(q, 4) : q, m4);
                    if (q5) {
                        const __m256i bit = _mm256_and_si256(
                            _mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
                        v = _mm256_or_si256(v, _mm256_slli_epi16(bit, 4));
                    }
                    const float mo = -dmin * (float)mn[j];
                    parts[np++] = (blk32){v, _mm256_set1_ps(d * (float)sc[j]), mo, mo, 0};
                }
            }
        } else { /* q6_k */
            const float d = f16_to_f32(blk + 208);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = blk + 64 * h, *qhp = blk + 128 + 32 * h;
                const int8_t *sc = (const int8_t *)(blk + 192 + 8 * h);
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)qhp);
                const __m256i lows[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                                         _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                         _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
                for (int g = 0; g < 4; g++) {
                    const __m256i hb = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)),
                                                        _mm256_set1_epi8(3));
                    const float sa = d * (float)sc[2 * g], sb = d * (float)sc[2 * g + 1];
                    parts[np++] = (blk32){_mm256_or_si256(lows[g], _mm256_slli_epi16(hb, 4)),
                                          _mm256_set_m128(_mm_set1_ps(sb), _mm_set1_ps(sa)),
                                          -32.f * sa, -32.f * sb, 0};
                }
            }
        }
        for (int p = 0; p < np; p++) {
            const int bi = i * (bv / 32) + p; /* the 32-value activation block */
            for (int m = 0; m < M; m++) {
                const __m256i x = _mm256_load_si256((const __m256i *)(qact_q(a, m0 + m) + 32 * bi));
                const __m256i prod = parts[p].is_signed
                    ? dot_u8s8_avx2(_mm256_sign_epi8(parts[p].q, parts[p].q), _mm256_sign_epi8(x, parts[p].q))
                    : dot_u8s8_avx2(parts[p].q, x);
                const float dx = blk_dx(a, m0 + m)[bi];
                const int32_t *s16 = blk_s16(a, m0 + m) + 2 * bi;
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod),
                                         _mm256_mul_ps(parts[p].scale, _mm256_set1_ps(dx)), acc[m]);
                off[m] += dx * (parts[p].off_a * (float)s16[0] + parts[p].off_b * (float)s16[1]);
            }
        }
    }
    for (int m = 0; m < M; m++) dots[m] = hsum8(acc[m]) + off[m];
}

static void avx2_rows(const qweight *w, int64_t n, const qact *a, int m0, float *dots, int M) {
    if (w->format == QF_FP8) {
        fp8_rows_avx2(w, n, a, m0, dots, M);
        return;
    }
    if (w->format == QF_INT8) {
        int8_rows_avx2(w, n, a, m0, dots, M);
        return;
    }
    switch (M) {
    case 1: gguf_rows_avx2_m(w, n, a, m0, dots, 1); return;
    case 2: gguf_rows_avx2_m(w, n, a, m0, dots, 2); return;
    case 3: gguf_rows_avx2_m(w, n, a, m0, dots, 3); return;
    case 4: gguf_rows_avx2_m(w, n, a, m0, dots, 4); return;
    case 5: gguf_rows_avx2_m(w, n, a, m0, dots, 5); return;
    case 6: gguf_rows_avx2_m(w, n, a, m0, dots, 6); return;
    case 7: gguf_rows_avx2_m(w, n, a, m0, dots, 7); return;
    default: gguf_rows_avx2_m(w, n, a, m0, dots, 8); return;
    }
}
#endif
#endif
