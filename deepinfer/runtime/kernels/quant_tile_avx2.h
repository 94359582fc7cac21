/* Prefill (more than QACT_MAX_M input rows) over GGUF weights on AVX2: QTILE_N weight rows
 * unpacked once into a tile, then every input row dotted with the tile, 2 input rows x 4
 * weight rows per pass (8 accumulators; each weight block is loaded once for both rows, each
 * activation block once for the four weight rows). The chunked path unpacks every weight row
 * again for each QACT_MAX_M input rows, which kept prefill at decode speed per row.
 *
 * Each dot is gblk_step over its blocks in order and one hsum8, the parts stored exactly as
 * gguf_block_parts built them: the bits of gguf_rows_avx2 (the decode path), whatever M, the
 * rows beside it, or the threads' split of the weight rows.
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

/* Dots of tile rows jr[0..4) with activation rows ma (and mb when R = 2): out[r][c]. */
QINLINE2 void gtile_dots(const gtile *t, const int *jr, const qact *a, int ma, int mb,
                         float out[2][4], const int R, const int is_signed) {
    const int K = t->K, nb = K / 32;
    const uint8_t *cr[4];
    const float *sr[4];
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
        cr[c] = t->codes + (int64_t)jr[c] * K;
        sr[c] = t->scales + (int64_t)jr[c] * nb * 8;
    }
    const int mr[2] = {ma, mb};
    __m256 acc[2][4];
    _Pragma("GCC unroll 2") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
    for (int bi = 0; bi < nb; bi++) {
        gblk g[4];
        __m256i wabs[4];
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
            g[c].q = _mm256_loadu_si256((const __m256i *)(cr[c] + 32 * bi));
            g[c].scale = _mm256_loadu_ps(sr[c] + 8 * bi);
            wabs[c] = is_signed ? _mm256_sign_epi8(g[c].q, g[c].q) : g[c].q;
        }
        _Pragma("GCC unroll 2") for (int r = 0; r < R; r++) {
            const __m256i x = gact_x(a, mr[r], bi);
            const __m256 dxv = gact_dx(a, mr[r], bi);
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
                acc[r][c] = gblk_step(acc[r][c], &g[c], wabs[c], x, dxv, is_signed);
        }
    }
    _Pragma("GCC unroll 2") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
            out[r][c] = gdot_finish(acc[r][c], t->mins + (int64_t)jr[c] * t->nmin,
                                    gact_xs(a, mr[r]), t->nmin, !is_signed);
}

static void gtile_dots_any(const gtile *t, const int *jr, const qact *a, int ma, int mb,
                           float out[2][4], int R, int is_signed) {
    if (R == 2) {
        if (is_signed) gtile_dots(t, jr, a, ma, mb, out, 2, 1);
        else gtile_dots(t, jr, a, ma, mb, out, 2, 0);
    } else {
        if (is_signed) gtile_dots(t, jr, a, ma, ma, out, 1, 1);
        else gtile_dots(t, jr, a, ma, ma, out, 1, 0);
    }
}
#endif
#endif
