/* The parts of the AVX2 prefill tiles timed on their own, one thread, data in cache (thread CPU
 * time): activation quantization per input row, tile fill per weight row, and the dot pass
 * (2 input rows x 4 weight rows, finish included) per 32-value block and dot. Q4_1, bf16 rows.
 * Prints numbers, asserts nothing; cycles assume --ghz (default 3.15: a dependent-add loop
 * on the Zen 3 box ran at 3.14-3.2 GHz).
 *
 *   gcc -O3 -march=native -ffast-math -fno-strict-aliasing -fopenmp \
 *       -I deepinfer/runtime/kernels benchmarks/quant_tile_parts.c -o /tmp/qtp -lm
 *   /tmp/qtp 576 && /tmp/qtp 1536 */
#include <stdio.h>
#include <time.h>
#include "quant_gemv.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* not inlined, so the loop cannot be folded across calls */
__attribute__((noinline)) static void pass(const gtile *t, const int *jr, const qact *a,
                                           const int *mr, __m128 out[QTILE_R]) {
    gtile_dots(t, jr, a, mr, out, QTILE_R, 0);
}

int main(int argc, char **argv) {
    const int K = argc > 1 ? atoi(argv[1]) : 576, M = 64, N = 256, nb = K / 32;
    const double ghz = argc > 2 ? atof(argv[2]) : 3.15;
    uint8_t *w = malloc((size_t)N * nb * 20);
    for (long i = 0; i < (long)N * nb * 20; i++) w[i] = (uint8_t)rand();
    for (int i = 0; i < N * nb; i++) { /* sane f16 scale and minimum */
        const uint16_t h = 0x211F; /* ~0.01 */
        memcpy(w + 20L * i, &h, 2);
        memcpy(w + 20L * i + 2, &h, 2);
    }
    const int64_t desc[8] = {QF_Q4_1, N, K, (int64_t)(intptr_t)w, 0, 0, 0, 0};
    const qweight qw = qweight_from_desc(desc);
    void *scratch = malloc(gtile_bytes(K));
    const gtile t = gtile_carve(scratch, K);
    uint16_t *x = malloc(2 * (size_t)M * K);
    for (int i = 0; i < M * K; i++) x[i] = f32_to_bf16((float)(rand() % 1000 - 500) / 100.f);
    void *mem = malloc(qact_bytes(M, K));
    qact a;
    qact_carve(&a, ACT_BLK32, M, K, mem);
    const int reps = 2000;
    double t0 = now();
    for (int r = 0; r < reps; r++)
        for (int m = 0; m < M; m++) act_prepare_row(&a, m, x + (size_t)m * K, 0);
    double t1 = now();
    for (int r = 0; r < reps; r++)
        for (int n = 0; n < N; n++) gtile_fill(&qw, n, n & (QTILE_N - 1), &t);
    double t2 = now();
    printf("K=%d quantize %.1f ns per input row, fill %.1f ns per weight row\n", K,
           (t1 - t0) * 1e9 / ((double)reps * M), (t2 - t1) * 1e9 / ((double)reps * N));
    const int mr[QTILE_R] = {0, 1};
    const long iters = 600000000L / (4 * QTILE_R * nb);
    __m128 out[QTILE_R];
    float sink = 0.f;
    t0 = now();
    for (long i = 0; i < iters; i++) {
        const int j = (int)(i & 3) * 4, jr[4] = {j, j + 1, j + 2, j + 3};
        pass(&t, jr, &a, mr, out);
        sink += _mm_cvtss_f32(out[0]);
        __asm__ volatile("" ::: "memory");
    }
    t1 = now();
    const double per = (t1 - t0) / ((double)iters * 4 * QTILE_R * nb);
    printf("K=%d dot pass %.2f ns = %.2f cycles per block and dot (%.1f int8 MAC/cycle, "
           "%.1f GMAC/s) [%g]\n", K, per * 1e9, per * ghz * 1e9, 32 / (per * ghz * 1e9),
           32 / per / 1e9, sink);
    return 0;
}
