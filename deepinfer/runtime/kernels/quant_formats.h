/* Quantized weight formats as the C kernels see them: the weight descriptor the Python side
 * writes (one per matrix or fused part), block layouts (deepinfer/quant/quantized_weight.py has
 * the same table), and each format's rows dequantized to float32 (the exact path for float32
 * activations, and the reference every faster path is checked against).
 *
 *   desc (8 x int64): format | rows | cols | data pointer | scale pointer | 0 | 0 | 0
 *   GGUF: data = rows x (cols / block values x block bytes), llama.cpp's block bytes
 *   fp8:  data = rows x cols e4m3 bytes, scale = float32 [ceil(rows/128), ceil(cols/128)]
 *   int8: data = rows x cols int8, scale = float32 [rows]
 *   bf16: data = rows x cols bf16 (the plain weights, for the same entry point) */
#ifndef DEEPINFER_QUANT_FORMATS_H
#define DEEPINFER_QUANT_FORMATS_H
#include <stdint.h>
#include <string.h>
#include "bf16_cpu.h"
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { QF_BF16 = 0, QF_Q4_0 = 1, QF_Q4_1 = 2, QF_Q8_0 = 3, QF_Q4_K = 4, QF_Q5_K = 5,
       QF_Q6_K = 6, QF_FP8 = 7, QF_INT8 = 8, QF_COUNT = 9 };
enum { D_FORMAT, D_ROWS, D_COLS, D_DATA, D_SCALE, D_DESC_WORDS = 8 };
#define FP8_TILE 128

/* values per block, bytes per block (0 for the element formats) */
static const int QF_BLOCK_VALUES[QF_COUNT] = {1, 32, 32, 32, 256, 256, 256, 1, 1};
static const int QF_BLOCK_BYTES[QF_COUNT] = {2, 18, 20, 34, 144, 176, 210, 1, 1};

typedef struct {
    int format, rows, cols;
    const uint8_t *data;
    const float *scale;
} qweight;

static inline qweight qweight_from_desc(const int64_t *d) {
    qweight w = {(int)d[D_FORMAT], (int)d[D_ROWS], (int)d[D_COLS],
                 (const uint8_t *)(intptr_t)d[D_DATA], (const float *)(intptr_t)d[D_SCALE]};
    return w;
}

static inline int64_t qweight_row_bytes(const qweight *w) {
    return (int64_t)w->cols / QF_BLOCK_VALUES[w->format] * QF_BLOCK_BYTES[w->format];
}

static inline const uint8_t *qweight_row(const qweight *w, int64_t n) {
    return w->data + n * qweight_row_bytes(w);
}

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t u;
    if (exp == 0x1F) u = sign | 0x7F800000u | (man << 13);
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) u = sign;
    else { /* subnormal half: normalise */
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* The 12 packed bytes of a q4_k / q5_k block -> 8 six-bit scales and 8 mins. */
static inline void k_scales_mins(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        mn[j] = q[j + 4] & 63;
        sc[j + 4] = (q[j + 8] & 0xF) | ((q[j] >> 6) << 4);
        mn[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
    }
}

/* e4m3 byte -> float32, exactly (subnormals included; no infinities in e4m3fn). */
static inline float e4m3_to_f32(uint8_t b) {
    const int e = (b >> 3) & 0xF, m = b & 7;
    const float mag = e ? (1.f + m / 8.f) * (float)(1 << e) / 128.f : m / 512.f;
    return (b & 0x80) ? -mag : mag;
}

/* Row n of w as float32 [cols], the values quantized_weight.py's reference gives. */
static void dequant_row_f32(const qweight *w, int64_t n, float *restrict y) {
    const uint8_t *b = qweight_row(w, n);
    const int K = w->cols;
    switch (w->format) {
    case QF_BF16:
        for (int k = 0; k < K; k++) {
            uint16_t v;
            memcpy(&v, b + 2 * k, 2);
            y[k] = bf16_to_f32(v);
        }
        return;
    case QF_Q4_0: case QF_Q4_1: {
        const int bs = QF_BLOCK_BYTES[w->format], off = w->format == QF_Q4_1 ? 4 : 2;
        for (int i = 0; i < K / 32; i++, b += bs, y += 32) {
            const float d = f16_to_f32(b), m = w->format == QF_Q4_1 ? f16_to_f32(b + 2) : 0.f;
            const int zero = w->format == QF_Q4_1 ? 0 : 8;
            for (int j = 0; j < 16; j++) {
                y[j] = d * (float)((b[off + j] & 0xF) - zero) + m;
                y[j + 16] = d * (float)((b[off + j] >> 4) - zero) + m;
            }
        }
        return;
    }
    case QF_Q8_0:
        for (int i = 0; i < K / 32; i++, b += 34, y += 32) {
            const float d = f16_to_f32(b);
            for (int j = 0; j < 32; j++) y[j] = d * (float)(int8_t)b[2 + j];
        }
        return;
    case QF_Q4_K: case QF_Q5_K: {
        const int q5 = w->format == QF_Q5_K, bs = q5 ? 176 : 144;
        for (int i = 0; i < K / 256; i++, b += bs, y += 256) {
            uint8_t sc[8], mn[8];
            k_scales_mins(b + 4, sc, mn);
            const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
            const uint8_t *qh = b + 16, *qs = b + (q5 ? 48 : 16);
            for (int c = 0; c < 4; c++)
                for (int h = 0; h < 2; h++) {
                    const int j = 2 * c + h;
                    const float ds = d * (float)sc[j], dm = dmin * (float)mn[j];
                    for (int l = 0; l < 32; l++) {
                        int q = h ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 0xF;
                        if (q5) q += ((qh[l] >> j) & 1) << 4;
                        y[64 * c + 32 * h + l] = ds * (float)q - dm;
                    }
                }
        }
        return;
    }
    case QF_Q6_K:
        for (int i = 0; i < K / 256; i++, b += 210, y += 256) {
            const float d = f16_to_f32(b + 208);
            for (int half = 0; half < 2; half++) {
                const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
                const int8_t *sc = (const int8_t *)(b + 192 + 8 * half);
                float *o = y + 128 * half;
                for (int l = 0; l < 32; l++) {
                    const int q[4] = {(ql[l] & 0xF) | ((qh[l] & 3) << 4),
                                      (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                                      (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                                      (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)};
                    for (int g = 0; g < 4; g++)
                        o[32 * g + l] = d * (float)sc[(32 * g + l) / 16] * (float)(q[g] - 32);
                }
            }
        }
        return;
    case QF_FP8: {
        const int kb = (K + FP8_TILE - 1) / FP8_TILE;
        const float *s = w->scale + (n / FP8_TILE) * kb;
        for (int k = 0; k < K; k++) y[k] = e4m3_to_f32(b[k]) * s[k / FP8_TILE];
        return;
    }
    case QF_INT8: {
        const float s = w->scale[n];
        for (int k = 0; k < K; k++) y[k] = (float)(int8_t)b[k] * s;
        return;
    }
    }
}

/* 1 when `w`'s shape fits its format (whole blocks), so a kernel may read it. */
static inline int qweight_valid(const qweight *w) {
    if (w->format < 0 || w->format >= QF_COUNT || w->rows < 0 || w->cols < 1 || !w->data)
        return 0;
    if (w->cols % QF_BLOCK_VALUES[w->format]) return 0;
    return (w->format != QF_FP8 && w->format != QF_INT8) || w->scale;
}
#endif
