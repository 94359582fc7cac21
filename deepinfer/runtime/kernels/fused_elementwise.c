/* Fused bf16 element-wise ops for CPU (RMSNorm, SiLU-and-mul). PyTorch runs each of these as
 * several passes with a bf16<->fp32 conversion per pass; one pass in float32 with a single
 * rounding is several times cheaper. Built and loaded like paged_decode_attention.c. */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, rows of H; x and out may alias. */
void rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t T, int H,
                   float eps, int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) if(T >= 64) schedule(static)")
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *row = x + t * H;
        float ss = 0.f;
        for (int i = 0; i < H; i++) {
            const float v = bf16_to_f32(row[i]);
            ss += v * v;
        }
        const float inv = 1.f / sqrtf(ss / (float)H + eps);
        uint16_t *o = out + t * H;
        for (int i = 0; i < H; i++) o[i] = f32_to_bf16(bf16_to_f32(row[i]) * inv * bf16_to_f32(w[i]));
    }
}

/* Row chunks go through float buffers with simple widen/narrow loops, so every inner loop
 * vectorizes (expf included, via libmvec). The conversions go by value (memcpy), never by
 * accessing a float buffer through a uint32_t pointer: that breaks strict aliasing, and the
 * same pattern made GCC's AVX-512 code read stale data in paged_decode_attention.c. */
#define CHUNK 256

static inline void widen(float *restrict dst, const uint16_t *restrict src, int n) {
    for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

static inline void narrow(uint16_t *restrict dst, const float *restrict src, int n) {
    for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

/* gate_up [T, 2I] = [gate | up]; out [T, I] = silu(gate) * up. */
void silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t T, int I,
                       int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) if(T >= 16) schedule(static)")
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gate_up + t * 2 * (int64_t)I;
        const uint16_t *u = g + I;
        uint16_t *o = out + t * (int64_t)I;
        float gf[CHUNK], uf[CHUNK];
        for (int i0 = 0; i0 < I; i0 += CHUNK) {
            const int n = I - i0 < CHUNK ? I - i0 : CHUNK;
            widen(gf, g + i0, n);
            widen(uf, u + i0, n);
            _Pragma("omp simd")
            /* exp clamped below FLT_MAX: -ffast-math assumes finite values, and an
             * overflowed expf (gate < -88) came out as NaN instead of -0. */
            for (int i = 0; i < n; i++) gf[i] = gf[i] / (1.f + expf(fminf(-gf[i], 88.f))) * uf[i];
            narrow(o + i0, gf, n);
        }
    }
}

/* Rotary embedding (rotate_half layout) of `heads` heads of D per token, bit-equal to
 * layers/rotary.apply_rotary in bf16: torch rounds each product and each sum to bf16
 * (x1*cos - x2*sin is three bf16 ops), so this does the same roundings instead of one fused
 * float expression. The products of two bf16 values are exact in float32, so only the
 * explicit roundings matter (and -ffast-math cannot contract across them: they go through
 * integer bits).
 *   x: token t's head j at x + t * x_stride + j * D (heads adjacent, rows strided)
 *   cos/sin: token t's D/2 values at cos + t * cs_stride (sin likewise)
 *   out [T, heads, D] contiguous */
void rotary_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *cos, const uint16_t *sin,
                 int64_t cs_stride, uint16_t *out, int64_t T, int heads, int D, int num_threads) {
    const int half = D / 2;
    _Pragma("omp parallel for num_threads(num_threads) if(T >= 64) schedule(static)")
    for (int64_t t = 0; t < T; t++) {
        float c[CHUNK], s[CHUNK], x1[CHUNK], x2[CHUNK];
        const uint16_t *xr = x + t * x_stride;
        uint16_t *o = out + t * (int64_t)heads * D;
        for (int i0 = 0; i0 < half; i0 += CHUNK) {
            const int n = half - i0 < CHUNK ? half - i0 : CHUNK;
            widen(c, cos + t * cs_stride + i0, n);
            widen(s, sin + t * cs_stride + i0, n);
            for (int j = 0; j < heads; j++) {
                const uint16_t *xh = xr + (int64_t)j * D;
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
}
