/* The one GEMV entry over a weight descriptor (quant_formats.h) that dispatches on the format:
 * rows [n0, n1) of W times M input rows, written with the bias (and a residual) the way the
 * bf16 kernels write theirs. Shared by quant_linear.c (the per-op layers) and decode_stack.c
 * (the fused stack), so both compute the same bits.
 *
 *   bf16 activations: quantized once per step (quant_act.h), int8 dot products per ISA
 *                     (AVX-512 VNNI, AVX2, portable); fp8 weights take bf16 dot products
 *   float32 activations: the exact path: each weight row dequantized to float32
 *                     (dequant_row_f32) and dotted in float32, no activation rounding
 *
 * Rows of more than QACT_MAX_M bf16 inputs over GGUF weights on AVX2 (prefill) unpack QTILE_N
 * weight rows once into a tile and dot every input row with it (quant_tile_avx2.h), the same
 * bits as the row-at-a-time path; other ISAs and formats run chunks of QACT_MAX_M rows over
 * QTILE_N weight rows, so a tile is read from memory once and from cache for the other chunks. */
#ifndef DEEPINFER_QUANT_GEMV_H
#define DEEPINFER_QUANT_GEMV_H
#include "quant_dot_avx512.h"
#include "quant_dot_portable.h"
#include "quant_tile_avx2.h"

/* The ISA a request may use on this build: the best compiled one at or below `isa`. */
static inline int qisa_available(int isa) {
#ifdef HAVE_QUANT_AVX512
    if (isa >= ISA_AVX512) return ISA_AVX512;
#endif
#ifdef HAVE_QUANT_AVX2
    if (isa >= ISA_AVX2) return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

/* A GEMV's input rows: bf16 rows prepared per activation family, or float32 rows as they are. */
typedef struct {
    int M, K, isa;
    const qact *act[ACT_FAMILIES]; /* bf16 input: the families its weights need, else NULL */
    const float *x32;              /* float32 input [M, ldx], else NULL */
    int64_t ldx;
    int chunked;                   /* 1: no prefill tiles (the same bits, slower: benchmarks) */
} qinput;

/* Where a GEMV writes: out[m * ldo + n] = dot + bias[n], as bf16 (rounded once; with
 * `residual` (may alias out) the rounded product is added to it and rounded again, as torch's
 * `hidden + linear(x)` in bf16) or float32. bias is bf16 for bf16 outputs, else float32. */
typedef struct {
    void *out;
    int out_f32;
    int64_t ldo;
    const void *bias;
    const uint16_t *residual;
} qoutput;

static inline void qstore(const qoutput *o, int m, int n, float v) {
    const int64_t at = (int64_t)m * o->ldo + n;
    if (o->out_f32) {
        ((float *)o->out)[at] = v + (o->bias ? ((const float *)o->bias)[n] : 0.f);
        return;
    }
    const uint16_t y = f32_to_bf16(v + (o->bias ? bf16_to_f32(((const uint16_t *)o->bias)[n]) : 0.f));
    ((uint16_t *)o->out)[at] = o->residual ? f32_to_bf16(bf16_to_f32(o->residual[at]) + bf16_to_f32(y)) : y;
}

#ifdef HAVE_QUANT_AVX2
/* qstore of the first `count` lanes of v to columns n, n + 1, ...: four at once (the same
 * adds and bf16 rounding per lane) where the output has no residual. */
static inline void qstore4(const qoutput *o, int m, int n, __m128 v, int count) {
    if (count < 4 || o->residual) {
        float f[4];
        _mm_storeu_ps(f, v);
        for (int t = 0; t < 4 && t < count; t++) qstore(o, m, n + t, f[t]);
        return;
    }
    const int64_t at = (int64_t)m * o->ldo + n;
    if (o->out_f32) {
        const __m128 b = o->bias ? _mm_loadu_ps((const float *)o->bias + n) : _mm_setzero_ps();
        _mm_storeu_ps((float *)o->out + at, _mm_add_ps(v, b));
        return;
    }
    __m128 b = _mm_setzero_ps();
    if (o->bias) {
        const __m128i h = _mm_loadl_epi64((const __m128i *)((const uint16_t *)o->bias + n));
        b = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
    }
    /* f32_to_bf16: u + 0x7FFF + ((u >> 16) & 1), the high half */
    const __m128i u = _mm_castps_si128(_mm_add_ps(v, b));
    const __m128i odd = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    const __m128i r = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7FFF)), odd), 16);
    _mm_storel_epi64((__m128i *)((uint16_t *)o->out + at), _mm_packus_epi32(r, r));
}
#endif

/* float32 dot of a weight row with one input row; one summation order for every M. */
static inline float f32_dot(const float *restrict w, const float *restrict x, int K) {
#ifdef HAVE_QUANT_AVX512
    __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        c0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), c0);
        c1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), c1);
    }
    for (; k < K; k += 16) {
        const __mmask16 mask = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
        c0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, w + k), _mm512_maskz_loadu_ps(mask, x + k), c0);
    }
    return reduce16(_mm512_add_round_ps(c0, c1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    float s = 0.f;
    for (int k = 0; k < K; k++) s += w[k] * x[k];
    return s;
#endif
}

#if defined(HAVE_QUANT_AVX2) && !defined(HAVE_QUANT_AVX512)
/* AVX2: dots of 4 weight rows with 2 input rows at once (8 FMA chains hide the FMA latency; one
 * chain per dot stalls on it). Each dot is one 8-lane chain over whole vectors, summed by hsum8,
 * then its tail in order: the same bits whichever rows are computed beside it. */
static inline void f32_dots_4x2(const float *const wr[4], const float *x0, const float *x1,
                                int K, float out[2][4]) {
    __m256 a[2][4];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) a[i][j] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k);
        for (int j = 0; j < 4; j++) {
            const __m256 wv = _mm256_loadu_ps(wr[j] + k);
            a[0][j] = _mm256_fmadd_ps(wv, v0, a[0][j]);
            a[1][j] = _mm256_fmadd_ps(wv, v1, a[1][j]);
        }
    }
    const float *xs[2] = {x0, x1};
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            float s = hsum8(a[i][j]);
            for (int t = k; t < K; t++) s = __builtin_fmaf(wr[j][t], xs[i][t], s);
            out[i][j] = s;
        }
}
#endif

/* Float32 inputs: weight rows [n0, n1) dequantized QTILE_N at a time into `wtile`
 * (QTILE_N * K floats), each tile dotted with every input row, so an input row is read from
 * memory once per tile rather than once per weight row. */
static void qgemv_rows_f32(const qweight *w, const qinput *in, const qoutput *o, int n0, int n1,
                           float *wtile) {
    const int M = in->M, K = in->K;
    for (int nt = n0; nt < n1; nt += QTILE_N) {
        const int nn = n1 - nt < QTILE_N ? n1 - nt : QTILE_N;
        for (int j = 0; j < nn; j++) dequant_row_f32(w, nt + j, wtile + (int64_t)j * K);
#if defined(HAVE_QUANT_AVX2) && !defined(HAVE_QUANT_AVX512)
        for (int m = 0; m < M; m += 2) {
            const float *x0 = in->x32 + m * in->ldx, *x1 = m + 1 < M ? x0 + in->ldx : x0;
            for (int j = 0; j < nn; j += 4) {
                const float *wr[4];
                for (int t = 0; t < 4; t++)
                    wr[t] = wtile + (int64_t)(j + t < nn ? j + t : nn - 1) * K;
                float d[2][4];
                f32_dots_4x2(wr, x0, x1, K, d);
                for (int t = 0; t < 4 && j + t < nn; t++) {
                    qstore(o, m, nt + j + t, d[0][t]);
                    if (m + 1 < M) qstore(o, m + 1, nt + j + t, d[1][t]);
                }
            }
        }
#else
        for (int m = 0; m < M; m++)
            for (int j = 0; j < nn; j++)
                qstore(o, m, nt + j, f32_dot(wtile + (int64_t)j * K, in->x32 + m * in->ldx, K));
#endif
    }
}

/* Dots of weight row n with input rows [m0, m0 + mm), mm <= QACT_MAX_M (bf16 inputs). */
static inline void qrow_dots(const qweight *w, int64_t n, const qinput *in, int m0, int mm,
                             float *dots) {
    const qact *a = in->act[qact_family(in->isa, w->format)];
#ifdef HAVE_QUANT_AVX512
    if (in->isa == ISA_AVX512) {
        QROWS_AVX512[w->format][mm](w, n, a, m0, dots);
        return;
    }
#endif
#ifdef HAVE_QUANT_AVX2
    if (in->isa == ISA_AVX2) {
        avx2_rows(w, n, a, m0, dots, mm);
        return;
    }
#endif
    scalar_rows(w, n, a, m0, dots, mm);
}

#ifdef HAVE_QUANT_AVX2
/* Rows [n0, n1) of GGUF weights `w` for every prepared (ACT_BLK32) input row of `a`. */
static void qgemv_rows_tiled_avx2(const qweight *w, const qact *a, int M, const qoutput *o,
                                  int n0, int n1, void *scratch) {
    const int K = w->cols, is_signed = gguf_signed(w->format);
    const gtile t = gtile_carve(scratch, K);
    for (int nt = n0; nt < n1; nt += QTILE_N) {
        const int nn = n1 - nt < QTILE_N ? n1 - nt : QTILE_N;
        for (int j = 0; j < nn; j++) gtile_fill(w, nt + j, j, &t);
        /* 4 tile rows stay in L1 while a chunk of input rows (in L2) streams past them */
        for (int mc = 0; mc < M; mc += QTILE_M) {
            const int mend = mc + QTILE_M < M ? mc + QTILE_M : M;
            for (int j = 0; j < nn; j += 4) {
                int jr[4];
                for (int t = 0; t < 4; t++) jr[t] = j + t < nn ? j + t : nn - 1;
                for (int m = mc; m < mend; m += QTILE_R) {
                    const int R = mend - m < QTILE_R ? mend - m : QTILE_R;
                    int mr[QTILE_R];
                    for (int r = 0; r < QTILE_R; r++) mr[r] = r < R ? m + r : m;
                    __m128 d[QTILE_R];
                    gtile_dots_any(&t, jr, a, mr, d, R, is_signed);
                    for (int r = 0; r < R; r++) qstore4(o, m + r, nt + j, d[r], nn - j);
                }
            }
        }
    }
}
#endif

/* 1 when the bf16 rows of `in` take the prefill tiles over `w` (else the chunked rows). */
static inline int qgemv_tiles(const qweight *w, const qinput *in) {
    const int gguf = w->format >= QF_Q4_0 && w->format <= QF_Q6_K;
    return gguf && in->isa == ISA_AVX2 && in->M > QACT_MAX_M && !in->chunked;
}

/* Rows [n0, n1) of `w` for every input row. `wtile`: QTILE_N * K floats of scratch for the
 * float32 path and the prefill tiles, or NULL (bf16 inputs: the tiles allocate their own, and
 * without memory the chunked rows give the same bits). */
static void qgemv_rows(const qweight *w, const qinput *in, const qoutput *o, int n0, int n1,
                       float *wtile) {
    const int M = in->M;
    if (in->x32) {
        qgemv_rows_f32(w, in, o, n0, n1, wtile);
        return;
    }
#ifdef HAVE_QUANT_AVX2
    if (qgemv_tiles(w, in)) {
        void *tile = wtile ? (void *)wtile : malloc(gtile_bytes(in->K));
        if (tile) {
            qgemv_rows_tiled_avx2(w, in->act[ACT_BLK32], M, o, n0, n1, tile);
            if (!wtile) free(tile);
            return;
        }
    }
    if (in->isa == ISA_AVX2 && M <= 2 && gguf_rows4_format(w->format)) {
        /* decode rows: four weight rows at a time, the rest one at a time (the same bits) */
        const qact *a = in->act[qact_family(in->isa, w->format)];
        int n = n0;
        for (; n + 4 <= n1; n += 4) {
            float d[4][2];
            gguf_rows4_avx2(w, n, a, 0, d, M);
            for (int r = 0; r < 4; r++)
                for (int m = 0; m < M; m++) qstore(o, m, n + r, d[r][m]);
        }
        for (; n < n1; n++) {
            float dots[2];
            gguf_rows_avx2(w, n, a, 0, dots, M);
            for (int m = 0; m < M; m++) qstore(o, m, n, dots[m]);
        }
        return;
    }
#endif
    for (int nt = n0; nt < n1; nt += QTILE_N) {
        const int nend = nt + QTILE_N < n1 ? nt + QTILE_N : n1;
        for (int m0 = 0; m0 < M; m0 += QACT_MAX_M) {
            const int mm = M - m0 < QACT_MAX_M ? M - m0 : QACT_MAX_M;
            for (int n = nt; n < nend; n++) {
                float dots[QACT_MAX_M];
                qrow_dots(w, n, in, m0, mm, dots);
                for (int m = 0; m < mm; m++) qstore(o, m0 + m, n, dots[m]);
            }
        }
    }
}
#endif
