/* Fused bf16 element-wise ops for CPU (RMSNorm, SiLU-and-mul, rotary). PyTorch runs each of
 * these as several passes with a bf16<->fp32 conversion per pass; one pass in float32 with a
 * single rounding is several times cheaper. The row math is in elementwise_bf16.h (shared with
 * decode_stack.c). Built and loaded like paged_decode_attention.c. */
#include "elementwise_bf16.h"

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, rows of H; x and out may alias. */
void rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t T, int H,
                   float eps, int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) if(T >= 64) schedule(static)")
    for (int64_t t = 0; t < T; t++) rms_norm_row(x + t * H, w, out + t * H, H, eps);
}

/* gate_up [T, 2I] = [gate | up]; out [T, I] = silu(gate) * up. */
void silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t T, int I,
                       int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) if(T >= 16) schedule(static)")
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gate_up + t * 2 * (int64_t)I;
        uint16_t *o = out + t * (int64_t)I;
        for (int i0 = 0; i0 < I; i0 += CHUNK)
            silu_mul_chunk(g + i0, g + I + i0, o + i0, I - i0 < CHUNK ? I - i0 : CHUNK);
    }
}

/* Rotary embedding of `heads` heads of D per token (see rotary_row).
 *   x: token t's head j at x + t * x_stride + j * D (heads adjacent, rows strided)
 *   cos/sin: token t's D/2 values at cos + t * cs_stride (sin likewise)
 *   out [T, heads, D] contiguous */
void rotary_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *cos, const uint16_t *sin,
                 int64_t cs_stride, uint16_t *out, int64_t T, int heads, int D, int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) if(T >= 64) schedule(static)")
    for (int64_t t = 0; t < T; t++)
        rotary_row(x + t * x_stride, cos + t * cs_stride, sin + t * cs_stride,
                   out + t * (int64_t)heads * D, heads, D);
}
