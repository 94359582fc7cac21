/* The AVX2 and portable dot products of a quantized weight row with M prepared activation
 * rows (ACT_BLK32 for GGUF: natural-order int8, a scale per 32 values; ACT_ROW for int8;
 * ACT_BF16 for fp8). The same sums as quant_dot_avx512.h, one 32-value block at a time. AVX2
 * GGUF weights take quant_block_avx2.h, fp8 and int8 weights quant_dot_avx2_element.h. The
 * portable code multiplies each block's reference float weights (dequant_row_f32) with the
 * int8 activations. */
#ifndef DEEPINFER_QUANT_DOT_PORTABLE_H
#define DEEPINFER_QUANT_DOT_PORTABLE_H
#include "quant_act.h"
#include "quant_block_avx2.h"

typedef void (*qrows_fn)(const qweight *, int64_t, const qact *, int, float *);

static inline const float *blk_dx(const qact *a, int m) { return qact_dxv(a, m); }

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
static void avx2_rows(const qweight *w, int64_t n, const qact *a, int m0, float *dots, int M) {
    if (w->format == QF_FP8) {
        fp8_rows_avx2(w, n, a, m0, dots, M);
        return;
    }
    if (w->format == QF_INT8) {
        int8_rows_avx2(w, n, a, m0, dots, M);
        return;
    }
    gguf_rows_avx2(w, n, a, m0, dots, M);
}
#endif
#endif
