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
 * Threads: phase 1 splits the (active expert, intermediate row) pairs by cost (see
 * phase1_row_at), each thread computing gate row j and up row j together and writing h; phase 2 gives each thread a
 * range of output columns, over which it runs every active expert in ascending order, so
 * each output value is summed in one fixed order whatever the thread count.
 *
 * bf16 weights: AVX-512 BF16 dots from gemv_bf16.h where the build has them, AVX2 FMA dots
 * (moe_expert_dots.h) on AVX2 hosts, a plain loop elsewhere. Quantized weights: qgemv_rows
 * (quant_gemv.h) over per-expert descriptors, activations prepared as quant_linear.c does. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include "moe_expert_dots.h"
#include "quant_gemv.h"

/* Decode and verify steps up to MOE_MAX_TOKENS tokens (beyond, prefill-sized inputs take the
 * torch path, whose GEMMs then win). An expert's tokens run in tiles of MOE_TILE rows per dot
 * call: the weight row, read from memory once, stays in L1 for the other tiles. */
#define MOE_MAX_TOKENS 128
#define MOE_MAX_PAIRS (MOE_MAX_TOKENS * 32)

static inline int64_t part(int64_t n, int i, int parts) { return n * i / parts; }

/* 0 portable, 1 AVX2, 2 AVX-512 BF16: the bf16 dots this build uses (for logs and tests). */
int moe_experts_isa(void) { return MOE_ISA; }
int moe_experts_max_tokens(void) { return MOE_MAX_TOKENS; }

/* The (token, expert) pairs grouped by expert: active expert a owns pairs
 * [start[a], start[a + 1]), tokens ascending (a stable counting sort of the flat top-k ids,
 * the torch path's stable argsort). One heap block holds every array. */
typedef struct {
    int num_active, num_pairs;
    int *expert, *start, *token; /* [E], [E + 1], [pairs] */
    float *weight;               /* [pairs] */
    void *mem;
} moe_groups;

/* Returns 0; 1 for an expert id out of [0, E), too many tokens or pairs; 2 for no memory. */
static int group_pairs(const int64_t *ids, const float *weights, int T, int k, int E,
                       moe_groups *g) {
    g->mem = NULL;
    if (T < 1 || T > MOE_MAX_TOKENS || k < 1 || T * k > MOE_MAX_PAIRS || E < 1) return 1;
    const int P = T * k;
    for (int p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= E) return 1;
    int *mem = malloc(sizeof(int) * (3 * (size_t)E + 2 + P) + sizeof(float) * (size_t)P);
    if (!mem) return 2;
    g->mem = mem;
    int *next = mem; /* [E + 1] counts, then each expert's next slot */
    g->expert = next + E + 1;
    g->start = g->expert + E;
    g->token = g->start + E + 1;
    g->weight = (float *)(g->token + P);
    g->num_pairs = P;
    for (int e = 0; e <= E; e++) next[e] = 0;
    for (int p = 0; p < P; p++) next[ids[p] + 1]++;
    g->num_active = 0;
    for (int e = 0; e < E; e++) {
        if (next[e + 1] > 0) {
            g->expert[g->num_active] = e;
            g->start[g->num_active++] = next[e];
        }
        next[e + 1] += next[e]; /* next[e]: expert e's first slot */
    }
    g->start[g->num_active] = P;
    for (int p = 0; p < P; p++) {
        const int at = next[ids[p]]++;
        g->token[at] = p / k;
        g->weight[at] = weights[p];
    }
    return 0;
}

/* Phase 1 gives each thread a share of the (active expert, intermediate row) pairs by cost,
 * not by count: a row of an expert with M tokens costs M dots plus its weight stream (about
 * MOE_ROW_COST dots), so a hot expert's rows are spread over more threads. Row index at cost
 * position `pos` of [0, total): monotone in pos, so consecutive shares partition the rows. */
#define MOE_ROW_COST 2
static int64_t phase1_cost(const moe_groups *g, int I) {
    return ((int64_t)g->num_pairs + (int64_t)MOE_ROW_COST * g->num_active) * I;
}

static int64_t phase1_row_at(const moe_groups *g, int I, int64_t pos) {
    int64_t before = 0;
    for (int a = 0; a < g->num_active; a++) {
        const int64_t per_row = g->start[a + 1] - g->start[a] + MOE_ROW_COST;
        if (pos < before + per_row * I) return (int64_t)a * I + (pos - before) / per_row;
        before += per_row * I;
    }
    return (int64_t)g->num_active * I;
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

/* Dots of weight row w with the M (any number) input rows x [M, K]: tiles of MOE_TILE rows. */
static inline void dots_tiled(const uint16_t *w, const moe_act *x, int K, int M, float *dots) {
    for (int m0 = 0; m0 < M; m0 += MOE_TILE) {
        const int mm = M - m0 < MOE_TILE ? M - m0 : MOE_TILE;
        MOE_DOTS[mm](w, x + (size_t)m0 * K, K, dots + m0);
    }
}

/* bf16 experts: x [T, H], gate_up [E, 2I, H], down [E, H, I], ids / weights [T, k] ->
 * out [T, H], all contiguous. Returns 0; 1 for bad shapes or ids; 2 for no memory. */
int moe_experts_bf16(const uint16_t *x, const uint16_t *gate_up, const uint16_t *down,
                     const int64_t *ids, const float *weights, uint16_t *out, int T, int k,
                     int E, int H, int I, int num_threads) {
    moe_groups g;
    if (H < 1 || I < 1) return 1;
    const int rc = group_pairs(ids, weights, T, k, E, &g);
    if (rc) return rc;
    const int P = g.num_pairs;
    float *acc = calloc((size_t)T * H, sizeof(float)); /* [T, H] the weighted sums */
    moe_act *xg = malloc(sizeof(moe_act) * (size_t)P * ((size_t)H + I));
    /* per thread: the gate and up dots [2, P] of one row, the down dots [P] of one column */
    float *dots = malloc(sizeof(float) * 3 * (size_t)P * (num_threads > 0 ? num_threads : 1));
    if (!xg || !acc || !dots) {
        free(xg);
        free(acc);
        free(dots);
        free(g.mem);
        return 2;
    }
    moe_act *h = xg + (size_t)P * H; /* [pairs, I] */
    for (int p = 0; p < P; p++)
        for (int c = 0; c < H; c++) xg[(size_t)p * H + c] = to_act(x[(size_t)g.token[p] * H + c]);
    const int64_t rows1 = (int64_t)g.num_active * I, cost1 = phase1_cost(&g, I);
    const int threads = rows1 * 2 * H >= 65536 && num_threads > 0 ? num_threads : 1;
    _Pragma("omp parallel num_threads(threads)")
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        float *gd = dots + (size_t)tid * 3 * P, *ud = gd + P, *d = ud + P;
        const int64_t end = nth == 1 ? rows1 : phase1_row_at(&g, I, part(cost1, tid + 1, nth));
        for (int64_t r = nth == 1 ? 0 : phase1_row_at(&g, I, part(cost1, tid, nth)); r < end; r++) {
            const int a = (int)(r / I), j = (int)(r % I), p0 = g.start[a];
            const int M = g.start[a + 1] - p0;
            const uint16_t *w = gate_up + (size_t)g.expert[a] * 2 * I * H;
            dots_tiled(w + (size_t)j * H, xg + (size_t)p0 * H, H, M, gd);
            dots_tiled(w + (size_t)(I + j) * H, xg + (size_t)p0 * H, H, M, ud);
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
                dots_tiled(w + (size_t)n * I, h + (size_t)p0 * I, I, M, d);
                for (int m = 0; m < M; m++)
                    accumulate(acc, (int64_t)g.token[p0 + m] * H + n, f32_to_bf16(d[m]),
                               g.weight[p0 + m]);
            }
        }
        store_columns(acc, out, T, H, n0, n1);
    }
    free(dots);
    free(xg);
    free(acc);
    free(g.mem);
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
    if (H < 1 || I < 1) return 1;
    const int rc = group_pairs(ids, weights, T, k, E, &g);
    if (rc) return rc;
    isa = qisa_available(isa);
    const int A = g.num_active, P = g.num_pairs;
    size_t bytes = sizeof(uint16_t) * (size_t)P * (2 * (size_t)I + I + H)
                   + sizeof(float) * (size_t)T * H + (sizeof(qexpert) + 2 * sizeof(qact)) * A;
    for (int a = 0; a < A; a++) {
        const int M = g.start[a + 1] - g.start[a];
        bytes += qact_bytes(M, H) + qact_bytes(M, I);
    }
    char *mem = malloc(bytes);
    if (!mem) {
        free(g.mem);
        return 2;
    }
    qexpert *qe = (qexpert *)mem;                      /* [active] */
    qact *act1 = (qact *)(qe + A), *act2 = act1 + A;   /* [active] each */
    float *acc = (float *)(act2 + A);                  /* [T, H] */
    uint16_t *gu = (uint16_t *)(acc + (size_t)T * H);  /* [pairs, 2I] gate | up */
    uint16_t *h = gu + (size_t)P * 2 * I;              /* [pairs, I] */
    uint16_t *y = h + (size_t)P * I;                   /* [pairs, H] */
    for (int a = 0; a < A; a++)
        if (qexpert_load(descs + (int64_t)g.expert[a] * 3 * D_DESC_WORDS, H, I, &qe[a])
            || qe[a].gate.format != qe[0].gate.format || qe[a].down.format != qe[0].down.format) {
            free(mem);
            free(g.mem);
            return 1;
        }
    const int fam1 = qact_family(isa, qe[0].gate.format), fam2 = qact_family(isa, qe[0].down.format);
    memset(acc, 0, sizeof(float) * (size_t)T * H);
    char *at = (char *)(y + (size_t)P * H);
    for (int a = 0; a < A; a++) {
        const int M = g.start[a + 1] - g.start[a];
        qact_carve(&act1[a], fam1, M, H, at);
        at += qact_bytes(M, H);
        qact_carve(&act2[a], fam2, M, I, at);
        at += qact_bytes(M, I);
    }
    const int64_t rows1 = (int64_t)A * I, cost1 = phase1_cost(&g, I);
    const int threads = rows1 * 2 * H >= 65536 && num_threads > 0 ? num_threads : 1;
    _Pragma("omp parallel num_threads(threads)")
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        for (int a = 0; a < g.num_active; a++) /* pair p is row p - start[a] of its expert */
            for (int p = g.start[a]; p < g.start[a + 1]; p++)
                if (p % nth == tid)
                    act_prepare_row(&act1[a], p - g.start[a], x + (size_t)g.token[p] * H, 0);
        _Pragma("omp barrier")
        int64_t r = nth == 1 ? 0 : phase1_row_at(&g, I, part(cost1, tid, nth));
        const int64_t end = nth == 1 ? rows1 : phase1_row_at(&g, I, part(cost1, tid + 1, nth));
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
    free(g.mem);
    return 0;
}
