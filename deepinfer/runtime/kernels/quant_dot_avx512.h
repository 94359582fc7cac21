/* AVX-512 dot products of one quantized weight row with M (1..8) prepared activation rows
 * (quant_act.h): int8 activations x weight codes with VNNI (vpdpbusd: unsigned weight bytes
 * times signed activation bytes, four products summed into each int32 lane), one float
 * multiply-add per lane group with the weight scale x the activation scale.
 *
 * Signed codes become unsigned for vpdpbusd by an offset folded into the lane sums:
 *   q4_0 (q - 8), q6_k (q - 32):  dot = sum(q * x) - offset * sum(x)
 *   q8_0, int8 (w ^ 0x80 = w + 128):  dot = sum((w + 128) * x) - 128 * sum(x)
 *   q4_1, q4_k, q5_k (d * q + min): + min * dx * sum(x) per block (the activation's xsv)
 * Every row runs the same instruction sequence whatever M is, so a row's result does not
 * depend on how many rows share the call. fp8 weights meet bf16 activations in vdpbf16ps:
 * each e4m3 byte becomes an fp16 with the same bits shifted (value / 256, exact, subnormals
 * too), then bf16 (exact: 4 significant bits), and 256 x the block scale applies per 128. */
#ifndef DEEPINFER_QUANT_DOT_AVX512_H
#define DEEPINFER_QUANT_DOT_AVX512_H
#include "quant_act.h"
#ifdef HAVE_QUANT_AVX512

#define QINLINE static inline __attribute__((always_inline))

/* Sum of 16 lanes in a fixed order (rounded adds: -ffast-math may not reassociate them). */
QINLINE float reduce16(__m512 v) {
#define RADD(a, b) _mm512_add_round_ps((a), (b), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
    v = RADD(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    v = RADD(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = RADD(v, _mm512_permute_ps(v, 0x4E));
    v = RADD(v, _mm512_permute_ps(v, 0xB1));
#undef RADD
    return _mm512_cvtss_f32(v);
}

QINLINE void finish_rows(const __m512 *acc, float *dots, const int M) {
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) dots[m] = reduce16(acc[m]);
}

/* ---- q4_0 / q4_1: groups of 4 blocks, nibbles in SPLIT4 order ---------------------------- */
QINLINE void q4_rows_avx512(const qweight *w, int64_t n, const qact *a, int m0, float *dots,
                            const int M, const int q41) {
    const int bs = q41 ? 20 : 18, off = q41 ? 4 : 2, nb = w->cols / 32;
    const uint8_t *b = qweight_row(w, n);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    /* words of a group's first bytes: d of blocks 0..3, then their m (q4_1) */
    const __m512i hdr_idx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                             0, 0, 0, 0, 0, 0, 0, 0, 3 * bs / 2 + 1, bs + 1,
                                             bs / 2 + 1, 1, 3 * bs / 2, bs, bs / 2, 0);
    const __m512i lane_d = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i lane_m = _mm512_add_epi32(lane_d, _mm512_set1_epi32(4));
    const __mmask64 hdr_mask = 3 * bs + 4 >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (3 * bs + 4)) - 1;
    __m512 acc[QACT_MAX_M];
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    uint8_t tail[4 * 20];
    for (int g = 0; 4 * g < nb; g++) {
        const uint8_t *gb = b + (int64_t)4 * g * bs;
        if (nb - 4 * g < 4) { /* a partial last group: the missing blocks read as zeros */
            memset(tail, 0, sizeof tail);
            memcpy(tail, gb, (size_t)(nb - 4 * g) * bs);
            gb = tail;
        }
        __m512i qv = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(gb + off)));
        qv = _mm512_inserti32x4(qv, _mm_loadu_si128((const __m128i *)(gb + bs + off)), 1);
        qv = _mm512_inserti32x4(qv, _mm_loadu_si128((const __m128i *)(gb + 2 * bs + off)), 2);
        qv = _mm512_inserti32x4(qv, _mm_loadu_si128((const __m128i *)(gb + 3 * bs + off)), 3);
        const __m512i lo = _mm512_and_si512(qv, m4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(qv, 4), m4);
        const __m512i hdr = _mm512_permutexvar_epi16(hdr_idx, _mm512_maskz_loadu_epi8(hdr_mask, gb));
        const __m512 dm = _mm512_cvtph_ps(_mm512_castsi512_si256(hdr));
        const __m512 dv = _mm512_permutexvar_ps(lane_d, dm);
        const __m512 mv = _mm512_permutexvar_ps(lane_m, dm);
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {
            const int8_t *xq = qact_q(a, m0 + m) + (int64_t)g * 128;
            const int64_t at = (int64_t)g * 16;
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_load_si512(xq));
            p = _mm512_dpbusd_epi32(p, hi, _mm512_load_si512(xq + 64));
            if (!q41) p = _mm512_sub_epi32(p, _mm512_slli_epi32(_mm512_load_si512(qact_lsum(a, m0 + m) + at), 3));
            const __m512 s = _mm512_mul_ps(dv, _mm512_load_ps(qact_dxv(a, m0 + m) + at));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc[m]);
            if (q41) acc[m] = _mm512_fmadd_ps(mv, _mm512_load_ps(qact_xsv(a, m0 + m) + at), acc[m]);
        }
    }
    finish_rows(acc, dots, M);
}

/* One NAT64 group's products for every row: p = dpbusd(w, x) - (lsum << shift) (shift < 0:
 * none), acc += p * (scale x dx) [- min x xsv]. */
QINLINE void nat64_group(__m512 *acc, const qact *a, int m0, int g, __m512i wv, __m512 sv,
                         __m512 minv, const int M, const int shift, const int has_min) {
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {
        const int64_t at = (int64_t)g * 16;
        __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv,
                                        _mm512_load_si512(qact_q(a, m0 + m) + (int64_t)g * 64));
        if (shift >= 0)
            p = _mm512_sub_epi32(p, _mm512_slli_epi32(_mm512_load_si512(qact_lsum(a, m0 + m) + at), shift));
        const __m512 s = _mm512_mul_ps(sv, _mm512_load_ps(qact_dxv(a, m0 + m) + at));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc[m]);
        if (has_min) acc[m] = _mm512_fnmadd_ps(minv, _mm512_load_ps(qact_xsv(a, m0 + m) + at), acc[m]);
    }
}

/* ---- q8_0: two blocks a group -------------------------------------------------------------- */
QINLINE void q8_0_rows_avx512(const qweight *w, int64_t n, const qact *a, int m0, float *dots,
                              const int M) {
    const int nb = w->cols / 32;
    const uint8_t *b = qweight_row(w, n);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[QACT_MAX_M];
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int g = 0; 2 * g < nb; g++) {
        const uint8_t *b0 = b + (int64_t)2 * g * 34;
        const int two = 2 * g + 1 < nb;
        __m512i wv = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2)));
        wv = _mm512_inserti64x4(wv, two ? _mm256_loadu_si256((const __m256i *)(b0 + 36))
                                        : _mm256_set1_epi8((char)0x80), 1);
        const float d1 = two ? f16_to_f32(b0 + 34) : 0.f;
        const __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(f16_to_f32(b0)), _mm256_set1_ps(d1), 1);
        nat64_group(acc, a, m0, g, _mm512_xor_si512(wv, flip), sv, sv, M, 7, 0);
    }
    finish_rows(acc, dots, M);
}

/* ---- q4_k / q5_k: 8 sub-blocks of 32 per 256, 4 groups of 64 ---------------------------- */
QINLINE void qk45_rows_avx512(const qweight *w, int64_t n, const qact *a, int m0, float *dots,
                              const int M, const int q5) {
    const int bs = q5 ? 176 : 144;
    const uint8_t *b = qweight_row(w, n);
    const __m512i m4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
    __m512 acc[QACT_MAX_M];
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int i = 0; i < w->cols / 256; i++, b += bs) {
        uint8_t sc[8], mn[8];
        k_scales_mins(b + 4, sc, mn);
        float sm[16];
        const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
        for (int j = 0; j < 8; j++) {
            sm[j] = d * (float)sc[j];
            sm[8 + j] = dmin * (float)mn[j];
        }
        const __m512 smv = _mm512_loadu_ps(sm);
        const uint8_t *qs = b + (q5 ? 48 : 16);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
            wv = _mm512_and_si512(wv, m4);
            if (q5) { /* fifth bit: bit 2c of qh for the low nibbles, 2c + 1 for the high */
                const __m512i cnt = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c)),
                                                       _mm256_set1_epi16((short)(2 * c + 1)), 1);
                const __m512i bit = _mm512_and_si512(_mm512_srlv_epi16(qh, cnt), one);
                wv = _mm512_or_si512(wv, _mm512_slli_epi16(bit, 4));
            }
            const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi32(2 * c),
                                                   _mm256_set1_epi32(2 * c + 1), 1);
            const __m512 sv = _mm512_permutexvar_ps(idx, smv);
            const __m512 minv = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(8)), smv);
            nat64_group(acc, a, m0, 4 * i + c, wv, sv, minv, M, -1, 1);
        }
    }
    finish_rows(acc, dots, M);
}

/* ---- q6_k: 16 sub-blocks of 16 per 256; per 128-value half two groups of 64 ------------- */
QINLINE void q6_k_rows_avx512(const qweight *w, int64_t n, const qact *a, int m0, float *dots,
                              const int M) {
    const uint8_t *b = qweight_row(w, n);
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(3);
    const __m512i cnt_a = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i cnt_b = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    const __m512i quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[QACT_MAX_M];
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int i = 0; i < w->cols / 256; i++, b += 210) {
        const __m512 s16 = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))),
            _mm512_set1_ps(f16_to_f32(b + 208)));
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
            const __m512i L = _mm512_loadu_si512(b + 64 * h);
            const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
            const __m512i wa = _mm512_or_si512(_mm512_and_si512(L, m4), _mm512_slli_epi16(
                _mm512_and_si512(_mm512_srlv_epi16(H, cnt_a), m2), 4));
            const __m512i wb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, cnt_b), m2), 4));
            const __m512i base = _mm512_set1_epi32(8 * h);
            const __m512 sa = _mm512_permutexvar_ps(_mm512_add_epi32(quarter, base), s16);
            const __m512 sb = _mm512_permutexvar_ps(
                _mm512_add_epi32(quarter, _mm512_add_epi32(base, _mm512_set1_epi32(4))), s16);
            nat64_group(acc, a, m0, 4 * i + 2 * h, wa, sa, sa, M, 5, 0);
            nat64_group(acc, a, m0, 4 * i + 2 * h + 1, wb, sb, sb, M, 5, 0);
        }
    }
    finish_rows(acc, dots, M);
}

/* ---- int8 (W8A8): exact int32 sums over the whole row, one scale per row and channel ---- */
QINLINE void int8_rows_avx512(const qweight *w, int64_t n, const qact *a, int m0, float *dots,
                              const int M) {
    const int K = w->cols;
    const uint8_t *b = qweight_row(w, n);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc[QACT_MAX_M];
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_si512();
    for (int k = 0; k < K; k += 64) {
        const __mmask64 mask = K - k >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (K - k)) - 1;
        const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, b + k), flip);
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)
            acc[m] = _mm512_dpbusd_epi32(acc[m], wv, _mm512_load_si512(qact_q(a, m0 + m) + k));
    }
    const float sw = w->scale[n];
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {
        /* padded columns: w ^ 0x80 = 0x80 there but x = 0 */
        const int32_t dot = _mm512_reduce_add_epi32(acc[m]) - 128 * a->rsum[m0 + m];
        dots[m] = (float)dot * (sw * a->rs[m0 + m]);
    }
}

/* ---- fp8 block-scaled x bf16 activations --------------------------------------------------- */
QINLINE __m512bh e4m3x32_to_bf16(__m256i bytes) {
    const __m512i u = _mm512_cvtepu8_epi16(bytes);
    const __m512i h = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(u, _mm512_set1_epi16(0x7F)), 7),
                                      _mm512_slli_epi16(_mm512_and_si512(u, _mm512_set1_epi16(0x80)), 8));
    const __m512 f0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    const __m512 f1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    return _mm512_cvtne2ps_pbh(f1, f0);
}

QINLINE void fp8_rows_avx512(const qweight *w, int64_t n, const qact *a, int m0, float *dots,
                             const int M) {
    const int K = w->cols, kb = (K + FP8_TILE - 1) / FP8_TILE;
    const uint8_t *b = qweight_row(w, n);
    const float *s = w->scale + (n / FP8_TILE) * kb;
    __m512 acc[QACT_MAX_M];
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int j = 0; j < kb; j++) {
        __m512 t[QACT_MAX_M];
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) t[m] = _mm512_setzero_ps();
        const int k_end = (j + 1) * FP8_TILE < K ? (j + 1) * FP8_TILE : K;
        for (int k = j * FP8_TILE; k < k_end; k += 32) {
            const __mmask32 mask = k_end - k >= 32 ? ~(__mmask32)0 : ((__mmask32)1 << (k_end - k)) - 1;
            const __m512bh wv = e4m3x32_to_bf16(_mm256_maskz_loadu_epi8(mask, b + k));
            _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)
                t[m] = _mm512_dpbf16_ps(t[m], wv, (__m512bh)_mm512_load_si512(qact_x16(a, m0 + m) + k));
        }
        const __m512 sj = _mm512_set1_ps(s[j] * 256.f);
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(t[m], sj, acc[m]);
    }
    finish_rows(acc, dots, M);
}

/* One function per (format, M): the dispatch table of quant_gemv.h. */
typedef void (*qrows_fn)(const qweight *, int64_t, const qact *, int, float *);
#define QDEF_M(NAME, CALL)                                                                     \
    static void NAME##_1(const qweight *w, int64_t n, const qact *a, int m0, float *d) { CALL(1); } \
    static void NAME##_2(const qweight *w, int64_t n, const qact *a, int m0, float *d) { CALL(2); } \
    static void NAME##_3(const qweight *w, int64_t n, const qact *a, int m0, float *d) { CALL(3); } \
    static void NAME##_4(const qweight *w, int64_t n, const qact *a, int m0, float *d) { CALL(4); } \
    static void NAME##_5(const qweight *w, int64_t n, const qact *a, int m0, float *d) { CALL(5); } \
    static void NAME##_6(const qweight *w, int64_t n, const qact *a, int m0, float *d) { CALL(6); } \
    static void NAME##_7(const qweight *w, int64_t n, const qact *a, int m0, float *d) { CALL(7); } \
    static void NAME##_8(const qweight *w, int64_t n, const qact *a, int m0, float *d) { CALL(8); }
#define QFNS(NAME) {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, NAME##_7, NAME##_8}

#define C_Q40(M) q4_rows_avx512(w, n, a, m0, d, M, 0)
#define C_Q41(M) q4_rows_avx512(w, n, a, m0, d, M, 1)
#define C_Q80(M) q8_0_rows_avx512(w, n, a, m0, d, M)
#define C_Q4K(M) qk45_rows_avx512(w, n, a, m0, d, M, 0)
#define C_Q5K(M) qk45_rows_avx512(w, n, a, m0, d, M, 1)
#define C_Q6K(M) q6_k_rows_avx512(w, n, a, m0, d, M)
#define C_I8(M) int8_rows_avx512(w, n, a, m0, d, M)
#define C_FP8(M) fp8_rows_avx512(w, n, a, m0, d, M)
QDEF_M(q40_x512, C_Q40) QDEF_M(q41_x512, C_Q41) QDEF_M(q80_x512, C_Q80)
QDEF_M(q4k_x512, C_Q4K) QDEF_M(q5k_x512, C_Q5K) QDEF_M(q6k_x512, C_Q6K)
QDEF_M(i8_x512, C_I8) QDEF_M(fp8_x512, C_FP8)

static const qrows_fn QROWS_AVX512[QF_COUNT][QACT_MAX_M + 1] = {
    {0}, QFNS(q40_x512), QFNS(q41_x512), QFNS(q80_x512), QFNS(q4k_x512), QFNS(q5k_x512),
    QFNS(q6k_x512), QFNS(fp8_x512), QFNS(i8_x512)};
#endif
#endif
