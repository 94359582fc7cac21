/* Linear layers over quantized weights (quant_gemv.h) for any number of rows, and row
 * dequantization (embedding lookups), loaded by runtime/cpu_quant_linear.py.
 *
 *   quant_linear: out [M, N] = x [M, K] @ W.T + bias; x bf16 (int8-quantized per step) or
 *   float32 (exact path); out bf16 or float32 (the LM head's logits: float32 from bf16 rows);
 *   `chunked` turns the prefill tiles off (the same bits: for benchmarks).
 *
 * Threads split the weight rows into contiguous ranges (one weight stream each); the inputs
 * are quantized first, their rows shared out among the same threads. Small layers stay on one
 * thread, where a fork/join costs more than the work. */
#include <omp.h>
#include <stdlib.h>
#include "quant_gemv.h"

static inline int part(int n, int i, int parts) { return (int)((int64_t)n * i / parts); }

/* The best instruction set this build computes with (ISA_* of quant_act.h). */
int quant_isa_compiled(void) { return qisa_available(ISA_AVX512); }

/* Returns 0; 1 for a bad descriptor or shapes; 2 when scratch memory could not be allocated. */
int quant_linear(const int64_t *desc, int isa, const void *x, int x_f32, int64_t ldx, int M,
                 const void *bias, void *out, int out_f32, int num_threads, int chunked) {
    const qweight w = qweight_from_desc(desc);
    if (!qweight_valid(&w) || w.format == QF_BF16 || M < 1 || ldx < w.cols) return 1;
    if (!x_f32 && out_f32 && bias) return 1; /* float32 logits from bf16 rows carry no bias */
    const int N = w.rows, K = w.cols;
    qinput in = {M, K, qisa_available(isa), {NULL}, x_f32 ? (const float *)x : NULL, ldx,
                 chunked};
    qact act;
    void *mem = NULL;
    const int64_t work = (int64_t)N * K * M;
    const int threads = work >= 65536 ? num_threads : 1;
    if (!x_f32) {
        mem = malloc(qact_bytes(M, K));
        if (!mem) return 2;
        qact_carve(&act, qact_family(in.isa, w.format), M, K, mem);
        in.act[act.family] = &act;
    }
    const qoutput o = {out, out_f32, N, bias, NULL};
    int failed = 0;
    _Pragma("omp parallel num_threads(threads)")
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        if (!x_f32) {
            for (int m = tid; m < M; m += nth)
                act_prepare_row(&act, m, (const uint16_t *)x + (int64_t)m * ldx, 0);
            _Pragma("omp barrier")
        }
        const int tiled = x_f32 || qgemv_tiles(&w, &in);
        float *wrow = tiled ? (float *)malloc(sizeof(float) * (size_t)K * QTILE_N) : NULL;
        if (x_f32 && !wrow) { /* bf16 rows without the scratch: qgemv_rows finds its own */
            _Pragma("omp atomic write")
            failed = 2;
        } else {
            qgemv_rows(&w, &in, &o, part(N, tid, nth), part(N, tid + 1, nth), wrow);
        }
        free(wrow);
    }
    free(mem);
    return failed;
}

/* out [num, K] = rows row_ids of W dequantized (float32, or bf16 when out_bf16). Returns 0, 1
 * for a bad descriptor or a row id out of range (nothing written), 2 for no memory. */
int quant_dequant_rows(const int64_t *desc, const int64_t *row_ids, int num, void *out,
                       int out_bf16, int num_threads) {
    const qweight w = qweight_from_desc(desc);
    if (!qweight_valid(&w) || num < 0) return 1;
    for (int i = 0; i < num; i++)
        if (row_ids[i] < 0 || row_ids[i] >= w.rows) return 1;
    const int K = w.cols;
    int failed = 0;
    const int threads = (int64_t)num * K >= 65536 ? num_threads : 1;
    _Pragma("omp parallel num_threads(threads)")
    {
        float *tmp = out_bf16 ? (float *)malloc(sizeof(float) * (size_t)K) : NULL;
        _Pragma("omp for schedule(static)")
        for (int i = 0; i < num; i++) {
            if (!out_bf16) {
                dequant_row_f32(&w, row_ids[i], (float *)out + (int64_t)i * K);
            } else if (!tmp) {
                _Pragma("omp atomic write")
                failed = 2;
            } else {
                dequant_row_f32(&w, row_ids[i], tmp);
                uint16_t *o = (uint16_t *)out + (int64_t)i * K;
                for (int k = 0; k < K; k++) o[k] = f32_to_bf16(tmp[k]);
            }
        }
        free(tmp);
    }
    return failed;
}
