/* Row-level bf16 element-wise ops (RMSNorm, SiLU-and-mul, rotary embedding), float32 inside,
 * one rounding where torch rounds: the bodies of fused_elementwise.c's kernels and the same
 * steps of decode_stack.c, one copy so both give the same bits. */
#ifndef DEEPINFER_ELEMENTWISE_BF16_H
#define DEEPINFER_ELEMENTWISE_BF16_H
#include <math.h>
#include "bf16_cpu.h"

/* Row chunks go through float buffers with simple widen/narrow loops, so every inner loop
 * vectorizes (expf included, via libmvec). */
#define CHUNK 256

static inline void widen(float *restrict dst, const uint16_t *restrict src, int n) {
    for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

static inline void narrow(uint16_t *restrict dst, const float *restrict src, int n) {
    for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

/* o = row / sqrt(mean(row^2) + eps) * w over H values; row and o may alias. */
SHARED_ROW_FN void rms_norm_row(const uint16_t *row, const uint16_t *w, uint16_t *o, int H,
                                float eps) {
    float ss = 0.f;
    for (int i = 0; i < H; i++) {
        const float v = bf16_to_f32(row[i]);
        ss += v * v;
    }
    const float inv = 1.f / sqrtf(ss / (float)H + eps);
    for (int i = 0; i < H; i++) o[i] = f32_to_bf16(bf16_to_f32(row[i]) * inv * bf16_to_f32(w[i]));
}

/* o[i] = silu(g[i]) * u[i] for n <= CHUNK values. Callers cut rows at CHUNK boundaries, so
 * every caller vectorizes the same element the same way (same expf lanes, same bits). */
SHARED_ROW_FN void silu_mul_chunk(const uint16_t *g, const uint16_t *u, uint16_t *o, int n) {
    float gf[CHUNK], uf[CHUNK];
    widen(gf, g, n);
    widen(uf, u, n);
    _Pragma("omp simd")
    /* exp clamped below FLT_MAX: -ffast-math assumes finite values, and an
     * overflowed expf (gate < -88) came out as NaN instead of -0. */
    for (int i = 0; i < n; i++) gf[i] = gf[i] / (1.f + expf(fminf(-gf[i], 88.f))) * uf[i];
    narrow(o, gf, n);
}

/* Rotary embedding (rotate_half layout) of `heads` adjacent heads of D at x into o (may
 * alias x), bit-equal to layers/rotary.apply_rotary in bf16: torch rounds each product and
 * each sum to bf16 (x1*cos - x2*sin is three bf16 ops), so this does the same roundings
 * instead of one fused float expression. The products of two bf16 values are exact in
 * float32, so only the explicit roundings matter (and -ffast-math cannot contract across
 * them: they go through integer bits). cos/sin: the token's D/2 values. */
SHARED_ROW_FN void rotary_row(const uint16_t *x, const uint16_t *cos, const uint16_t *sin,
                              uint16_t *o, int heads, int D) {
    const int half = D / 2;
    float c[CHUNK], s[CHUNK], x1[CHUNK], x2[CHUNK];
    for (int i0 = 0; i0 < half; i0 += CHUNK) {
        const int n = half - i0 < CHUNK ? half - i0 : CHUNK;
        widen(c, cos + i0, n);
        widen(s, sin + i0, n);
        for (int j = 0; j < heads; j++) {
            const uint16_t *xh = x + (int64_t)j * D;
            uint16_t *oh = o + (int64_t)j * D;
            widen(x1, xh + i0, n);
            widen(x2, xh + half + i0, n);
            for (int i = 0; i < n; i++) {
                const float a = bf16_to_f32(f32_to_bf16(x1[i] * c[i]));
                const float b = bf16_to_f32(f32_to_bf16(x2[i] * s[i]));
                const float e = bf16_to_f32(f32_to_bf16(x2[i] * c[i]));
                const float f = bf16_to_f32(f32_to_bf16(x1[i] * s[i]));
                oh[i0 + i] = f32_to_bf16(a - b);
                oh[half + i0 + i] = f32_to_bf16(e + f);
            }
        }
    }
}
#endif
