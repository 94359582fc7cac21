/* bf16 linear layer for a few rows (decode batches of 1..8 tokens): out = x @ w.T + bias.
 * oneDNN's GEMM is built for many rows; at M=1 it ran the default model's gate_up at ~14 GB/s
 * of weights from cache on Zen 4, where a plain dot product per output row streams the weight
 * once at memory speed. Every weight row is read once and applied to all M input rows.
 *
 *   x [M, K], w [N, K] (nn.Linear layout), bias [N] or NULL, out [M, N]; all bf16, contiguous.
 *
 * Accumulates in float32 and rounds once (like oneDNN); with AVX512-BF16 (Zen 4, Sapphire
 * Rapids) the products come from vdpbf16ps, elsewhere from a plain float loop. Built and loaded
 * like paged_decode_attention.c (cpu_kernel_build.py). */
#include "gemv_bf16.h"

#define MAX_M GEMV_MAX_M

/* Returns 0, or 1 when M is out of range. Threads split the output rows; small layers (under
 * ~64K weights) stay on one thread, where a fork/join costs more than the work. Writes the dots
 * + bias rounded to bf16 into out16, or (out16 NULL) the raw fp32 dots into out32. */
static int linear_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                       uint16_t *out16, float *out32, int M, int N, int K, int num_threads) {
    if (M < 1 || M > MAX_M) return 1;
    const int64_t work = (int64_t)N * K;
    const row_dots_fn row_fn = ROW_FN[M];
    _Pragma("omp parallel for num_threads(num_threads) if(work >= 65536) schedule(static)")
    for (int n = 0; n < N; n++) {
        float dots[MAX_M];
        row_fn(w + (int64_t)n * K, x, K, dots);
        const float b = bias ? bf16_to_f32(bias[n]) : 0.f;
        for (int m = 0; m < M; m++) {
            if (out16) out16[(int64_t)m * N + n] = f32_to_bf16(dots[m] + b);
            else out32[(int64_t)m * N + n] = dots[m];
        }
    }
    return 0;
}

int small_batch_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                            uint16_t *out, int M, int N, int K, int num_threads) {
    return linear_rows(x, w, bias, out, NULL, M, N, K, num_threads);
}

/* The same dots left in float32, no bias: out [M, N] float. For the LM head, whose logits
 * torch would round to bf16 (ties among the top tokens) and then recompute in fp32: the dots
 * are fp32 already. A row's values do not depend on M (every M sums in the 1-row order). */
int small_batch_dots_f32(const uint16_t *x, const uint16_t *w, float *out, int M, int N, int K,
                         int num_threads) {
    return linear_rows(x, w, NULL, NULL, out, M, N, K, num_threads);
}

/* 1 when this build uses vdpbf16ps (for logs and tests). */
int small_batch_linear_uses_dpbf16(void) {
#ifdef HAVE_DPBF16
    return 1;
#else
    return 0;
#endif
}
