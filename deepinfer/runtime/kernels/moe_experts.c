/* Routed MoE experts for a decode step (1..MOE_MAX_TOKENS tokens) in one call, loaded by
 * runtime/cpu_moe_kernel.py. The torch path (moe/layer.py) runs one gate_up and one down
 * F.linear per active expert, 16..128 small ops per layer plus index ops: at decode, per-op
 * overhead rather than the weight stream set its speed.
 *
 *   for each active expert e, over the tokens routed to it (rows gathered by expert):
 *     [gate | up] = x_e @ gate_up_e.T       (bf16 rounded, as F.linear)
 *     h           = silu(gate) * up         (each op rounded to bf16, as torch in bf16)
 *     y           = h @ down_e.T            (bf16 rounded)
 *   out[t] = sum over t's experts, ascending expert id, of bf16(y * weight), summed in
 *            float32 and rounded to bf16 once (what the torch path's bf16 index_add_ into
 *            zeros computes on CPU)
 *
 * Every rounding of the torch path is reproduced, so the two differ only where a float32
 * dot product summed in another order rounds to another bf16 value.
 *
 * Threads: phase 1 splits the (active expert, intermediate row) pairs evenly, each thread
 * computing gate row j and up row j together and writing h; phase 2 gives each thread a
 * range of output columns, over which it runs every active expert in ascending order, so
 * each output value is summed in one fixed order whatever the thread count.
 *
 * bf16 weights: AVX-512 BF16 dots from gemv_bf16.h where the build has them, AVX2 FMA dots
 * (below) on AVX2 hosts, a plain loop elsewhere. Quantized weights: qgemv_rows
 * (quant_gemv.h) over per-expert descriptors, activations prepared as quant_linear.c does. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include "gemv_bf16.h"
#include "quant_gemv.h"

#define MOE_MAX_TOKENS 8
#define MOE_MAX_PAIRS (MOE_MAX_TOKENS * 32)

static inline int part(int64_t n, int i, int parts) { return (int)(n * i / parts); }

/* The dots' input rows (gathered token rows, then h): bf16 for vdpbf16ps; elsewhere float32,
 * widened once per step instead of once per weight row (at 8 rows the per-row widening of the
 * inputs made the AVX2 dots compute-bound). */
#ifdef HAVE_DPBF16
typedef uint16_t moe_act;
static inline moe_act to_act(uint16_t v) { return v; }
#define MOE_DOTS ROW_FN
#define MOE_ISA 2
#else
typedef float moe_act;
static inline moe_act to_act(uint16_t v) { return bf16_to_f32(v); }
typedef void (*moe_dots_fn)(const uint16_t *, const float *, int, float *);
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline __m256 bf16x8(const uint16_t *p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

static inline float moe_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One bf16 weight row with M float32 input rows, C chains of 8 lanes per input row (C * M <= 8
 * accumulators: no spills, and enough chains to hide the FMA latency at small M). */
#define DEFINE_MOE_DOTS(NAME, M, C)                                                           \
static void NAME(const uint16_t *w, const float *x, int K, float *dots) {                    \
    __m256 acc[M][C];                                                                        \
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                      \
        _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) acc[m][c] = _mm256_setzero_ps(); \
    int k = 0;                                                                               \
    for (; k + 8 * C <= K; k += 8 * C)                                                       \
        _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) {                                \
            const __m256 wv = bf16x8(w + k + 8 * c);                                         \
            _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                              \
                acc[m][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (int64_t)m * K + k + 8 * c), \
                                            acc[m][c]);                                      \
        }                                                                                    \
    for (; k + 8 <= K; k += 8) {                                                             \
        const __m256 wv = bf16x8(w + k);                                                     \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                  \
            acc[m][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (int64_t)m * K + k), acc[m][0]); \
    }                                                                                        \
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                                    \
        __m256 s = acc[m][0];                                                                \
        _Pragma("GCC unroll 4") for (int c = 1; c < C; c++) s = _mm256_add_ps(s, acc[m][c]); \
        float d = moe_hsum8(s);                                                              \
        for (int t = k; t < K; t++) d = __builtin_fmaf(bf16_to_f32(w[t]), x[(int64_t)m * K + t], d); \
        dots[m] = d;                                                                         \
    }                                                                                        \
}
#define MOE_ISA 1
#else
#define DEFINE_MOE_DOTS(NAME, M, C)                                                           \
static void NAME(const uint16_t *w, const float *x, int K, float *dots) {                    \
    for (int m = 0; m < M; m++) {                                                            \
        float s = 0.f;                                                                       \
        for (int k = 0; k < K; k++) s += bf16_to_f32(w[k]) * x[(int64_t)m * K + k];          \
        dots[m] = s;                                                                         \
    }                                                                                        \
}
#define MOE_ISA 0
#endif
DEFINE_MOE_DOTS(moe_m1, 1, 4) DEFINE_MOE_DOTS(moe_m2, 2, 4) DEFINE_MOE_DOTS(moe_m3, 3, 2)
DEFINE_MOE_DOTS(moe_m4, 4, 2) DEFINE_MOE_DOTS(moe_m5, 5, 1) DEFINE_MOE_DOTS(moe_m6, 6, 1)
DEFINE_MOE_DOTS(moe_m7, 7, 1) DEFINE_MOE_DOTS(moe_m8, 8, 1)
static const moe_dots_fn MOE_DOTS[MOE_MAX_TOKENS + 1] = {
    0, moe_m1, moe_m2, moe_m3, moe_m4, moe_m5, moe_m6, moe_m7, moe_m8};
#endif

/* 0 portable, 1 AVX2, 2 AVX-512 BF16: the bf16 dots this build uses (for logs and tests). */
int moe_experts_isa(void) { return MOE_ISA; }
int moe_experts_max_tokens(void) { return MOE_MAX_TOKENS; }

/* The (token, expert) pairs grouped by expert: active expert a owns pairs
 * [start[a], start[a + 1]), tokens ascending (a stable sort of the flat top-k ids). */
typedef struct {
    int num_active, num_pairs;
    int expert[MOE_MAX_PAIRS], start[MOE_MAX_PAIRS + 1], token[MOE_MAX_PAIRS];
    float weight[MOE_MAX_PAIRS];
} moe_groups;

/* Returns 0, or 1 for an expert id out of [0, E) or too many pairs. */
static int group_pairs(const int64_t *ids, const float *weights, int T, int k, int E,
                       moe_groups *g) {
    if (T < 1 || T > MOE_MAX_TOKENS || k < 1 || T * k > MOE_MAX_PAIRS) return 1;
    for (int p = 0; p < T * k; p++)
        if (ids[p] < 0 || ids[p] >= E) return 1;
    g->num_active = 0;
    g->num_pairs = T * k;
    int at = 0;
    for (int e = 0; e < E && at < T * k; e++) { /* E <= a few hundred: a scan per step is cheap */
        const int first = at;
        for (int p = 0; p < T * k; p++)
            if (ids[p] == e) {
                g->token[at] = p / k;
                g->weight[at++] = weights[p];
            }
        if (at > first) {
            g->expert[g->num_active] = e;
            g->start[g->num_active++] = first;
        }
    }
    g->start[g->num_active] = at;
    return 0;
}

static inline uint16_t silu_mul_bf16(uint16_t gate, uint16_t up) {
    const float g = bf16_to_f32(gate);
    const uint16_t s = f32_to_bf16(g / (1.f + expf(-g)));
    return f32_to_bf16(bf16_to_f32(s) * bf16_to_f32(up));
}

/* acc[t, n] += bf16(y * weight) (the torch path's weighting, then index_add_'s float sum). */
static inline void accumulate(float *acc, int64_t at, uint16_t y, float weight) {
    acc[at] += bf16_to_f32(f32_to_bf16(bf16_to_f32(y) * weight));
}

/* out[t, n] = bf16(acc[t, n]) for columns [n0, n1). */
static void store_columns(const float *acc, uint16_t *out, int T, int H, int n0, int n1) {
    for (int t = 0; t < T; t++)
        for (int n = n0; n < n1; n++) out[(int64_t)t * H + n] = f32_to_bf16(acc[(int64_t)t * H + n]);
}

/* bf16 experts: x [T, H], gate_up [E, 2I, H], down [E, H, I], ids / weights [T, k] ->
 * out [T, H], all contiguous. Returns 0; 1 for bad shapes or ids; 2 for no memory. */
int moe_experts_bf16(const uint16_t *x, const uint16_t *gate_up, const uint16_t *down,
                     const int64_t *ids, const float *weights, uint16_t *out, int T, int k,
                     int E, int H, int I, int num_threads) {
    moe_groups g;
    if (H < 1 || I < 1 || group_pairs(ids, weights, T, k, E, &g)) return 1;
    float *acc = calloc((size_t)T * H, sizeof(float)); /* [T, H] the weighted sums */
    moe_act *xg = malloc(sizeof(moe_act) * (size_t)g.num_pairs * ((size_t)H + I));
    if (!xg || !acc) {
        free(xg);
        free(acc);
        return 2;
    }
    moe_act *h = xg + (size_t)g.num_pairs * H; /* [pairs, I] */
    for (int p = 0; p < g.num_pairs; p++)
        for (int c = 0; c < H; c++) xg[(size_t)p * H + c] = to_act(x[(size_t)g.token[p] * H + c]);
    const int64_t rows1 = (int64_t)g.num_active * I;
    const int threads = rows1 * 2 * H >= 65536 ? num_threads : 1;
    _Pragma("omp parallel num_threads(threads)")
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        for (int64_t r = part(rows1, tid, nth), end = part(rows1, tid + 1, nth); r < end; r++) {
            const int a = (int)(r / I), j = (int)(r % I), p0 = g.start[a];
            const int M = g.start[a + 1] - p0;
            const uint16_t *w = gate_up + (size_t)g.expert[a] * 2 * I * H;
            float gd[MOE_MAX_TOKENS], ud[MOE_MAX_TOKENS];
            MOE_DOTS[M](w + (size_t)j * H, xg + (size_t)p0 * H, H, gd);
            MOE_DOTS[M](w + (size_t)(I + j) * H, xg + (size_t)p0 * H, H, ud);
            for (int m = 0; m < M; m++)
                h[(size_t)(p0 + m) * I + j] = to_act(silu_mul_bf16(f32_to_bf16(gd[m]),
                                                                   f32_to_bf16(ud[m])));
        }
        _Pragma("omp barrier")
        const int n0 = part(H, tid, nth), n1 = part(H, tid + 1, nth);
        for (int a = 0; a < g.num_active; a++) {
            const int p0 = g.start[a], M = g.start[a + 1] - p0;
            const uint16_t *w = down + (size_t)g.expert[a] * H * I;
            for (int n = n0; n < n1; n++) {
                float d[MOE_MAX_TOKENS];
                MOE_DOTS[M](w + (size_t)n * I, h + (size_t)p0 * I, I, d);
                for (int m = 0; m < M; m++)
                    accumulate(acc, (int64_t)g.token[p0 + m] * H + n, f32_to_bf16(d[m]),
                               g.weight[p0 + m]);
            }
        }
        store_columns(acc, out, T, H, n0, n1);
    }
    free(xg);
    free(acc);
    return 0;
}

/* One expert's quantized projections: gate_up [2I, H] (up NULL) or gate [I, H] and up [I, H];
 * down [H, I]. Returns 0 when they fit these shapes. */
typedef struct { qweight gate, up, down; int split; } qexpert;

static int qexpert_load(const int64_t *desc, int H, int I, qexpert *q) {
    q->gate = qweight_from_desc(desc);
    q->up = qweight_from_desc(desc + D_DESC_WORDS);
    q->down = qweight_from_desc(desc + 2 * D_DESC_WORDS);
    q->split = q->up.rows > 0;
    if (!qweight_valid(&q->gate) || !qweight_valid(&q->down) || q->gate.format == QF_BF16
        || q->down.format == QF_BF16) return 1;
    if (q->split && (!qweight_valid(&q->up) || q->up.format != q->gate.format
                     || q->up.rows != I || q->up.cols != H)) return 1;
    if (q->gate.rows != (q->split ? I : 2 * I) || q->gate.cols != H) return 1;
    return q->down.rows != H || q->down.cols != I;
}

/* Quantized experts: descs [E, 3, 8] (gate_up or gate | up or zeros | down, quant_formats.h),
 * x [T, H] bf16 -> out [T, H] bf16. The gate/up formats and the down formats must each be
 * one format over the active experts (one activation family per phase). Returns 0; 1 for bad
 * shapes, ids or descriptors; 2 for no memory. */
int moe_experts_quant(const int64_t *descs, int isa, const uint16_t *x, const int64_t *ids,
                      const float *weights, uint16_t *out, int T, int k, int E, int H, int I,
                      int num_threads) {
    moe_groups g;
    if (H < 1 || I < 1 || group_pairs(ids, weights, T, k, E, &g) || g.num_active < 1) return 1;
    isa = qisa_available(isa);
    qexpert qe[MOE_MAX_PAIRS];
    size_t bytes = sizeof(uint16_t) * (size_t)g.num_pairs * (2 * (size_t)I + I + H)
                   + sizeof(float) * (size_t)T * H;
    for (int a = 0; a < g.num_active; a++) {
        if (qexpert_load(descs + (int64_t)g.expert[a] * 3 * D_DESC_WORDS, H, I, &qe[a])) return 1;
        if (qe[a].gate.format != qe[0].gate.format || qe[a].down.format != qe[0].down.format)
            return 1;
        const int M = g.start[a + 1] - g.start[a];
        bytes += qact_bytes(M, H) + qact_bytes(M, I);
    }
    const int fam1 = qact_family(isa, qe[0].gate.format), fam2 = qact_family(isa, qe[0].down.format);
    char *mem = malloc(bytes);
    if (!mem) return 2;
    uint16_t *gu = (uint16_t *)mem;                    /* [pairs, 2I] gate | up */
    uint16_t *h = gu + (size_t)g.num_pairs * 2 * I;    /* [pairs, I] */
    uint16_t *y = h + (size_t)g.num_pairs * I;         /* [pairs, H] */
    float *acc = (float *)(y + (size_t)g.num_pairs * H); /* [T, H] */
    memset(acc, 0, sizeof(float) * (size_t)T * H);
    char *at = (char *)(acc + (size_t)T * H);
    qact act1[MOE_MAX_PAIRS], act2[MOE_MAX_PAIRS];
    for (int a = 0; a < g.num_active; a++) {
        const int M = g.start[a + 1] - g.start[a];
        qact_carve(&act1[a], fam1, M, H, at);
        at += qact_bytes(M, H);
        qact_carve(&act2[a], fam2, M, I, at);
        at += qact_bytes(M, I);
    }
    const int64_t rows1 = (int64_t)g.num_active * I;
    const int threads = rows1 * 2 * H >= 65536 ? num_threads : 1;
    _Pragma("omp parallel num_threads(threads)")
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        for (int a = 0; a < g.num_active; a++) /* pair p is row p - start[a] of its expert */
            for (int p = g.start[a]; p < g.start[a + 1]; p++)
                if (p % nth == tid)
                    act_prepare_row(&act1[a], p - g.start[a], x + (size_t)g.token[p] * H, 0);
        _Pragma("omp barrier")
        int64_t r = part(rows1, tid, nth);
        const int64_t end = part(rows1, tid + 1, nth);
        while (r < end) { /* runs of rows within one expert */
            const int a = (int)(r / I), j0 = (int)(r % I);
            const int j1 = end - (int64_t)a * I < I ? (int)(end - (int64_t)a * I) : I;
            const int p0 = g.start[a], M = g.start[a + 1] - p0;
            qinput in = {M, H, isa, {NULL}, NULL, 0};
            in.act[fam1] = &act1[a];
            const qoutput o = {gu + (size_t)p0 * 2 * I, 0, 2 * I, NULL, NULL};
            if (qe[a].split) {
                const qoutput ou = {gu + (size_t)p0 * 2 * I + I, 0, 2 * I, NULL, NULL};
                qgemv_rows(&qe[a].gate, &in, &o, j0, j1, NULL);
                qgemv_rows(&qe[a].up, &in, &ou, j0, j1, NULL);
            } else {
                qgemv_rows(&qe[a].gate, &in, &o, j0, j1, NULL);
                qgemv_rows(&qe[a].gate, &in, &o, I + j0, I + j1, NULL);
            }
            for (int m = 0; m < M; m++) {
                const uint16_t *row = gu + (size_t)(p0 + m) * 2 * I;
                for (int j = j0; j < j1; j++)
                    h[(size_t)(p0 + m) * I + j] = silu_mul_bf16(row[j], row[I + j]);
            }
            r += j1 - j0;
        }
        _Pragma("omp barrier")
        for (int a = 0; a < g.num_active; a++)
            for (int p = g.start[a]; p < g.start[a + 1]; p++)
                if (p % nth == tid) act_prepare_row(&act2[a], p - g.start[a], h + (size_t)p * I, 0);
        _Pragma("omp barrier")
        const int n0 = part(H, tid, nth), n1 = part(H, tid + 1, nth);
        for (int a = 0; a < g.num_active; a++) {
            const int p0 = g.start[a], M = g.start[a + 1] - p0;
            qinput in = {M, I, isa, {NULL}, NULL, 0};
            in.act[fam2] = &act2[a];
            const qoutput o = {y + (size_t)p0 * H, 0, H, NULL, NULL};
            qgemv_rows(&qe[a].down, &in, &o, n0, n1, NULL);
            for (int m = 0; m < M; m++)
                for (int n = n0; n < n1; n++)
                    accumulate(acc, (int64_t)g.token[p0 + m] * H + n, y[(size_t)(p0 + m) * H + n],
                               g.weight[p0 + m]);
        }
        store_columns(acc, out, T, H, n0, n1);
    }
    free(mem);
    return 0;
}
