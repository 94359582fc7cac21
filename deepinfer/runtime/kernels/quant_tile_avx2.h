/* Prefill (more than QACT_MAX_M input rows) over GGUF weights on AVX2: QTILE_N weight rows
 * unpacked once into a tile, then every input row dotted with the tile, 2 input rows x 4
 * weight rows per pass (8 accumulators; each weight block is loaded once for both rows, each
 * activation block once for the four weight rows). The chunked path unpacks every weight row
 * again for each QACT_MAX_M input rows, which kept prefill at decode speed per row.
 *
 * Each dot is gblk_step over its blocks in order and one hsum8, the parts stored exactly as
 * gguf_block_parts built them: the bits of gguf_rows_avx2 (the decode path), whatever M, the
 * rows beside it, or the threads' split of the weight rows. The four hsum8 of an input row
 * run as one transposed sum (hsum8x4: the same adds) and its four outputs are stored at once
 * (qstore4) where each took the scalar qstore: together ~15% of a K = 576 linear, most of it
 * the stores (the sum alone is ~2-3% of the dot pass, benchmarks/quant_tile_parts.c).
 *
 * Measured on Zen 3 (benchmarks/quant_tile_bench.py): the block step's five vector ops
 * (maddubs, madd, cvt, mul, fma) bound the loop; 3 input rows x 4 weight rows ran the same as
 * 2 x 4, and a product of scale and step broadcast from memory in place of the mul was no
 * faster (the broadcast costs what the mul did), so both stayed out.
 *
 * Tile (gtile_bytes(K) of scratch, any alignment; the loop is quant_gemv.h's):
 *   codes  [QTILE_N][K]               bytes, block part b of row j at j * K + 32 b
 *   scales [QTILE_N][K / 32][8]       floats, the parts' scale lanes
 *   mins   [QTILE_N][gmins_len(K)]    floats, a minimum per 16 values, zero-padded */
#ifndef DEEPINFER_QUANT_TILE_AVX2_H
#define DEEPINFER_QUANT_TILE_AVX2_H
#include "quant_block_avx2.h"

#define QTILE_N 16
#define QTILE_M 64 /* input rows per pass over the tile */
#ifndef QTILE_R
#define QTILE_R 2  /* input rows per dot pass (x 4 weight rows: the accumulators) */
#endif

/* Scratch the tile needs; at most QTILE_N * K floats (the float32 path's), K >= 32. */
static inline size_t gtile_bytes(int K) {
    return (size_t)QTILE_N * ((size_t)K + (size_t)(K / 32) * 32 + 4 * (size_t)((K / 16 + 7) / 8 * 8)) + 64;
}

/* The tile's pieces in `scratch`. */
typedef struct { uint8_t *codes; float *scales, *mins; int K, nmin; } gtile;

static inline gtile gtile_carve(void *scratch, int K) {
    gtile t;
    t.K = K;
    t.nmin = (K / 16 + 7) / 8 * 8;
    t.codes = (uint8_t *)align64(scratch);
    t.scales = (float *)(t.codes + (size_t)QTILE_N * K);
    t.mins = t.scales + (size_t)QTILE_N * (K / 32) * 8;
    return t;
}

#ifdef HAVE_QUANT_AVX2
/* Weight row n unpacked into tile row j. */
static void gtile_fill(const qweight *w, int64_t n, int j, const gtile *t) {
    const int fmt = w->format, K = w->cols, bv = QF_BLOCK_VALUES[fmt], bs = QF_BLOCK_BYTES[fmt];
    const uint8_t *b = qweight_row(w, n);
    uint8_t *cj = t->codes + (int64_t)j * K;
    float *sj = t->scales + (int64_t)j * (K / 32) * 8, *mj = t->mins + (int64_t)j * t->nmin;
    for (int v = K / 16; v < t->nmin; v++) mj[v] = 0.f;
    for (int i = 0; i < K / bv; i++) {
        gblk parts[8];
        const int np = gguf_block_parts(fmt, b + (int64_t)i * bs, parts, mj + i * 2 * (bv / 32));
        for (int p = 0; p < np; p++) {
            const int bi = i * np + p;
            _mm256_storeu_si256((__m256i *)(cj + 32 * bi), parts[p].q);
            _mm256_storeu_ps(sj + 8 * bi, parts[p].scale);
        }
    }
}

/* hsum8 of four vectors: [hsum8(a), hsum8(b), hsum8(c), hsum8(d)], each the same additions of
 * the same lanes in the same order (lo + hi, then lanes 0 + 2 and 1 + 3, then 0 + 1), four
 * dots to a vector op where hsum8 takes one per dot. */
QINLINE2 __m128 hsum8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
    QPIN(ab);
    QPIN(cd);
    /* per 128-bit half: [ab0 + ab2, ab1 + ab3, cd0 + cd2, cd1 + cd3] */
    __m256 u = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
    QPIN(u);
    /* low half [a, c, a, c], high half [b, d, b, d] */
    __m256 v = _mm256_add_ps(_mm256_shuffle_ps(u, u, 0x88), _mm256_shuffle_ps(u, u, 0xDD));
    QPIN(v);
    return _mm_unpacklo_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}

/* Dots of tile rows jr[0..4) with activation rows mr[0..R): out[r] = its 4 dots. R <= QTILE_R. */
QINLINE2 void gtile_dots(const gtile *t, const int *jr, const qact *a, const int *mr,
                         __m128 out[QTILE_R], const int R, const int is_signed) {
    const int K = t->K, nb = K / 32;
    const uint8_t *cr[4];
    const float *sr[4];
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
        cr[c] = t->codes + (int64_t)jr[c] * K;
        sr[c] = t->scales + (int64_t)jr[c] * nb * 8;
    }
    __m256 acc[QTILE_R][4];
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
    for (int bi = 0; bi < nb; bi++) {
        gblk g[4];
        __m256i wabs[4];
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
            g[c].q = _mm256_loadu_si256((const __m256i *)(cr[c] + 32 * bi));
            g[c].scale = _mm256_loadu_ps(sr[c] + 8 * bi);
            wabs[c] = is_signed ? _mm256_sign_epi8(g[c].q, g[c].q) : g[c].q;
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
            const __m256i x = gact_x(a, mr[r], bi);
            const __m256 dxv = gact_dx(a, mr[r], bi);
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
                acc[r][c] = gblk_step(acc[r][c], &g[c], wabs[c], x, dxv, is_signed);
        }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
        if (!is_signed)
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
                acc[r][c] = gdot_add_mins(acc[r][c], t->mins + (int64_t)jr[c] * t->nmin,
                                          gact_xs(a, mr[r]), t->nmin);
        out[r] = hsum8x4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    }
}

static void gtile_dots_any(const gtile *t, const int *jr, const qact *a, const int *mr,
                           __m128 out[QTILE_R], int R, int is_signed) {
#define GTILE_DOTS(RR)                                                                       \
    if (R == RR) {                                                                           \
        if (is_signed) gtile_dots(t, jr, a, mr, out, RR, 1);                                 \
        else gtile_dots(t, jr, a, mr, out, RR, 0);                                           \
        return;                                                                              \
    }
    GTILE_DOTS(QTILE_R)
#if QTILE_R > 2
    GTILE_DOTS(2)
#endif
    GTILE_DOTS(1)
#undef GTILE_DOTS
}
#endif
#endif
