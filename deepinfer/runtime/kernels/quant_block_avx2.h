/* AVX2 dot products of GGUF weights with ACT_BLK32 activations, one 32-value block at a time.
 * Two paths use these pieces and so compute the same bits for every (input row, weight row):
 *   gguf_rows_avx2: a weight row's blocks unpacked in registers and dotted with up to
 *                   QACT_MAX_M input rows (decode; prefill in chunks when tiles are off)
 *   quant_tile_avx2.h: weight rows unpacked once into a tile, then every input row (prefill)
 *
 * A block part (gblk) is 32 codes (unsigned; signed for q8_0) and an 8-lane scale, lane l
 * covering values 4l..4l+3 (q6_k: lanes 0-3 and 4-7 are its two 16-value sub-blocks), plus a
 * minimum per 16 values: w = scale * code + min. Per input row and block the activations give
 * dx (the int8 step) and per 16 values xs = dx x the sum of their codes (quant_act.h), so
 *     dot = sum over blocks, lanes of (codes . x)_l * (scale_l * dx)  +  sum_h min_h * xs_h
 * with exact integer products (vpmaddubsw pairs: codes <= 63 cannot saturate int16; q8_0 goes
 * through |w| x sign(x, w)). The minimums' term is a dot of its own, 8 sub-blocks per FMA
 * (a lane per block would cost a third FMA per block and dot). The q4_0 / q6_k code offsets
 * (-8, -32) are minimums -8 x scale, -32 x scale (exact). */
#ifndef DEEPINFER_QUANT_BLOCK_AVX2_H
#define DEEPINFER_QUANT_BLOCK_AVX2_H
#include "quant_dot_avx2_element.h"
#ifdef HAVE_QUANT_AVX2

typedef struct { __m256i q; __m256 scale; } gblk;

static inline int gguf_signed(int fmt) { return fmt == QF_Q8_0; }

/* Minimums per row of K values, padded to whole vectors (zeros: the activations' padding is 0). */
static inline int gmins_len(int K) { return (K / 16 + 7) / 8 * 8; }

/* The parts of GGUF block `blk` (1 for the 32-value formats, 8 for the K-quants); returns how
 * many. Values of part p are the block's values [32p, 32p + 32); mins[2p], mins[2p + 1] its
 * two 16-value minimums (q8_0: none). */
QINLINE2 int gguf_block_parts(int fmt, const uint8_t *blk, gblk *parts, float *mins) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (fmt == QF_Q4_0 || fmt == QF_Q4_1) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + (fmt == QF_Q4_1 ? 4 : 2)));
        const float d = f16_to_f32(blk);
        parts[0].q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
        parts[0].scale = _mm256_set1_ps(d);
        mins[0] = mins[1] = fmt == QF_Q4_1 ? f16_to_f32(blk + 2) : -8.f * d;
        return 1;
    }
    if (fmt == QF_Q8_0) {
        parts[0].q = _mm256_loadu_si256((const __m256i *)(blk + 2));
        parts[0].scale = _mm256_set1_ps(f16_to_f32(blk));
        return 1;
    }
    if (fmt == QF_Q4_K || fmt == QF_Q5_K) {
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
                parts[j].q = v;
                parts[j].scale = _mm256_set1_ps(d * (float)sc[j]);
                mins[2 * j] = mins[2 * j + 1] = -dmin * (float)mn[j];
            }
        }
        return 8;
    }
    /* q6_k */
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
            gblk *p = &parts[4 * h + g];
            p->q = _mm256_or_si256(lows[g], _mm256_slli_epi16(hb, 4));
            p->scale = _mm256_set_m128(_mm_set1_ps(sb), _mm_set1_ps(sa));
            mins[2 * (4 * h + g)] = -32.f * sa;
            mins[2 * (4 * h + g) + 1] = -32.f * sb;
        }
    }
    return 8;
}

/* One block of one (input row, weight row) dot: x = the row's 32 codes of the block, dxv its
 * step broadcast; wabs = |codes| (signed formats only). */
QINLINE2 __m256 gblk_step(__m256 acc, const gblk *g, __m256i wabs, __m256i x, __m256 dxv,
                          const int is_signed) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i p = is_signed
        ? _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, g->q)), ones)
        : _mm256_madd_epi16(_mm256_maddubs_epi16(g->q, x), ones);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(g->scale, dxv), acc);
}

/* The blocks' lanes plus the minimums' term (its vectors: `len` floats of mins and the row's
 * xs), in one fixed order. */
QINLINE2 __m256 gdot_add_mins(__m256 acc, const float *mins, const float *xs, int len) {
    __m256 t = _mm256_setzero_ps();
    for (int v = 0; v < len; v += 8)
        t = _mm256_fmadd_ps(_mm256_loadu_ps(mins + v), _mm256_loadu_ps(xs + v), t);
    acc = _mm256_add_ps(acc, t);
    QPIN(acc);
    return acc;
}

/* The dot's value: gdot_add_mins (formats with a minimum), then hsum8. */
QINLINE2 float gdot_finish(__m256 acc, const float *mins, const float *xs, int len,
                           const int has_min) {
    if (has_min) acc = gdot_add_mins(acc, mins, xs, len);
    return hsum8(acc);
}

/* Block bi of activation row m: its codes and step; the row's xs per 16 values. */
QINLINE2 __m256i gact_x(const qact *a, int m, int bi) {
    return _mm256_load_si256((const __m256i *)(qact_q(a, m) + 32 * (int64_t)bi));
}
QINLINE2 __m256 gact_dx(const qact *a, int m, int bi) { return _mm256_set1_ps(qact_dxv(a, m)[bi]); }
QINLINE2 const float *gact_xs(const qact *a, int m) { return qact_xsv(a, m); }

/* Weight row n with input rows [m0, m0 + M); M is a compile-time constant per instance, so
 * the accumulators stay in registers. */
QINLINE2 void gguf_rows_avx2_m(const qweight *w, int64_t n, const qact *a, int m0, float *dots,
                               const int M, const int is_signed, const int FMT) {
    /* FMT: the format as a compile-time constant (0: read it at run time). A constant one folds
     * the block unpacking to its own branch and keeps the parts in registers. */
    const int fmt = FMT ? FMT : w->format, bv = QF_BLOCK_VALUES[fmt], bs = QF_BLOCK_BYTES[fmt];
    const uint8_t *b = qweight_row(w, n);
    const int len = gmins_len(w->cols);
    float mins[len];
    for (int v = w->cols / 16; v < len; v++) mins[v] = 0.f;
    __m256 acc[QACT_MAX_M];
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int i = 0; i < w->cols / bv; i++) {
        gblk parts[8];
        const int np = gguf_block_parts(fmt, b + (int64_t)i * bs, parts, mins + i * 2 * (bv / 32));
        for (int p = 0; p < np; p++) {
            const int bi = i * np + p;
            const __m256i wabs = is_signed ? _mm256_sign_epi8(parts[p].q, parts[p].q) : parts[p].q;
            _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)
                acc[m] = gblk_step(acc[m], &parts[p], wabs, gact_x(a, m0 + m, bi),
                                   gact_dx(a, m0 + m, bi), is_signed);
        }
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)
        dots[m] = gdot_finish(acc[m], mins, gact_xs(a, m0 + m), len, !is_signed);
}

/* Four weight rows n .. n + 3 of a 32-value format (FMT: q4_0, q4_1, q8_0) with M <= 2 input
 * rows: each input block is loaded once for the four rows and their 4 x M FMA chains overlap
 * (one row at a time waits on its chain's latency). Every (row, input) dot is the sequence of
 * operations of gguf_rows_avx2_m, so the same bits. */
QINLINE2 void gguf_rows4_avx2_m(const qweight *w, int64_t n, const qact *a, int m0,
                                float dots[4][2], const int M, const int is_signed,
                                const int FMT) {
    const int bs = QF_BLOCK_BYTES[FMT], len = gmins_len(w->cols);
    float mins[4][len];
    const uint8_t *b[4];
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++) {
        for (int v = w->cols / 16; v < len; v++) mins[r][v] = 0.f;
        b[r] = qweight_row(w, n + r);
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
    /* the next four rows into cache meanwhile, spread over this group's blocks: the four rows'
     * interleaved reads are streams the hardware prefetcher does not keep ahead of */
    const int64_t group_bytes = 4 * qweight_row_bytes(w);
    const char *next = (const char *)b[0] + group_bytes;
    const int nb = w->cols / 32, lines = (int)((group_bytes + 63) / 64);
    const int per_block = (lines + nb - 1) / nb;
    for (int i = 0; i < nb; i++) {
        __m256i x[2];
        __m256 dxv[2];
        for (int l = i * per_block; l < (i + 1) * per_block && l < lines; l++)
            __builtin_prefetch(next + 64 * (int64_t)l, 0, 3);
        _Pragma("GCC unroll 2") for (int m = 0; m < M; m++) {
            x[m] = gact_x(a, m0 + m, i);
            dxv[m] = gact_dx(a, m0 + m, i);
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
            gblk part;
            gguf_block_parts(FMT, b[r] + (int64_t)i * bs, &part, mins[r] + 2 * i);
            const __m256i wabs = is_signed ? _mm256_sign_epi8(part.q, part.q) : part.q;
            _Pragma("GCC unroll 2") for (int m = 0; m < M; m++)
                acc[r][m] = gblk_step(acc[r][m], &part, wabs, x[m], dxv[m], is_signed);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < M; m++)
            dots[r][m] = gdot_finish(acc[r][m], mins[r], gact_xs(a, m0 + m), len, !is_signed);
}

/* 1 when gguf_rows4_avx2 takes this format. */
static inline int gguf_rows4_format(int fmt) {
    return fmt == QF_Q4_0 || fmt == QF_Q4_1 || fmt == QF_Q8_0;
}

static void gguf_rows4_avx2(const qweight *w, int64_t n, const qact *a, int m0,
                            float dots[4][2], int M) {
#define GGUF_ROWS4(FMT, SIGNED)                                                              \
    if (M == 1) gguf_rows4_avx2_m(w, n, a, m0, dots, 1, SIGNED, FMT);                        \
    else gguf_rows4_avx2_m(w, n, a, m0, dots, 2, SIGNED, FMT);                               \
    return;
    if (w->format == QF_Q4_1) { GGUF_ROWS4(QF_Q4_1, 0) }
    if (w->format == QF_Q4_0) { GGUF_ROWS4(QF_Q4_0, 0) }
    GGUF_ROWS4(QF_Q8_0, 1)
#undef GGUF_ROWS4
}

#define GGUF_ROWS_CASE(MM)                                                                   \
    case MM:                                                                                 \
        if (w->format == QF_Q4_1) gguf_rows_avx2_m(w, n, a, m0, dots, MM, 0, QF_Q4_1);       \
        else if (w->format == QF_Q4_0) gguf_rows_avx2_m(w, n, a, m0, dots, MM, 0, QF_Q4_0);  \
        else if (is_signed) gguf_rows_avx2_m(w, n, a, m0, dots, MM, 1, QF_Q8_0);             \
        else gguf_rows_avx2_m(w, n, a, m0, dots, MM, 0, 0);                                  \
        return;

static void gguf_rows_avx2(const qweight *w, int64_t n, const qact *a, int m0, float *dots, int M) {
    const int is_signed = gguf_signed(w->format);
    switch (M) {
    GGUF_ROWS_CASE(1) GGUF_ROWS_CASE(2) GGUF_ROWS_CASE(3) GGUF_ROWS_CASE(4)
    GGUF_ROWS_CASE(5) GGUF_ROWS_CASE(6) GGUF_ROWS_CASE(7)
    default: GGUF_ROWS_CASE(8)
    }
}
#undef GGUF_ROWS_CASE
#endif
#endif
