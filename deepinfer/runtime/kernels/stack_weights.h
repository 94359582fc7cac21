/* The decode stack's weight interface: every weight slot of a layer (qkv, o, gate_up, down,
 * and whatever MoE / MLA slots a stack adds) is a `stack_weight` of up to STACK_PARTS parts
 * stacked by rows, each part a quant_formats.h descriptor in any format (bf16 included), and
 * `stack_gemv` is the one GEMV entry: it computes rows [n0, n1) of the slot, dispatching each
 * part on its format. bf16 parts run gemv_rows_bf16 (the per-op bf16 kernel's code); the
 * quantized formats run quant_gemv.h (the per-op quantized kernel's code), so the stack
 * computes the same bits as the per-op path.
 *
 *   descriptors, as Python writes them: [slots][STACK_PARTS][D_DESC_WORDS] int64; a part with
 *   rows = 0 is absent. An MoE expert's [out, in] slice is a descriptor whose data pointer
 *   starts at the expert's first row.
 *
 * A `stack_input` is one GEMV input (R rows of bf16) and the int8 forms its weights need,
 * prepared on first use by each thread for itself (R <= 8 rows of a few thousand values: a
 * microsecond or so; cheaper than a barrier). */
#ifndef DEEPINFER_STACK_WEIGHTS_H
#define DEEPINFER_STACK_WEIGHTS_H
#include <stdlib.h>
#include "gemv_bf16.h"
#include "quant_gemv.h"

#define STACK_PARTS 3

typedef struct {
    qweight part[STACK_PARTS];
    int num_parts, rows;
} stack_weight;

static inline stack_weight stack_weight_from(const int64_t *descs) {
    stack_weight w;
    w.num_parts = 0;
    w.rows = 0;
    for (int p = 0; p < STACK_PARTS; p++) {
        const qweight q = qweight_from_desc(descs + p * D_DESC_WORDS);
        if (q.rows <= 0) break;
        w.part[w.num_parts++] = q;
        w.rows += q.rows;
    }
    return w;
}

/* 1 when every part is readable and shares `cols` input columns. */
static inline int stack_weight_valid(const stack_weight *w, int cols) {
    if (w->num_parts < 1) return 0;
    for (int p = 0; p < w->num_parts; p++)
        if (!qweight_valid(&w->part[p]) || w->part[p].cols != cols) return 0;
    return 1;
}

/* Per-thread scratch for the quantized forms of one input; reused across layers. */
typedef struct {
    void *mem[ACT_FAMILIES];
    size_t bytes;
} stack_scratch;

static inline void stack_scratch_free(stack_scratch *s) {
    for (int f = 0; f < ACT_FAMILIES; f++) free(s->mem[f]);
}

typedef struct {
    const uint16_t *x; /* [M, K] bf16 */
    int M, K, isa;
    qact act[ACT_FAMILIES];
    int ready[ACT_FAMILIES];
    stack_scratch *scratch;
} stack_input;

static inline stack_input stack_input_of(const uint16_t *x, int M, int K, int isa, stack_scratch *s) {
    stack_input in;
    memset(&in, 0, sizeof in);
    in.x = x; in.M = M; in.K = K; in.isa = isa; in.scratch = s;
    return in;
}

/* Quantize the input for every family `w`'s parts need; 0, or 2 when out of memory. */
static int stack_input_prepare(stack_input *in, const stack_weight *w) {
    for (int p = 0; p < w->num_parts; p++) {
        if (w->part[p].format == QF_BF16) continue;
        const int f = qact_family(in->isa, w->part[p].format);
        if (in->ready[f]) continue;
        stack_scratch *s = in->scratch;
        if (!s->mem[f]) {
            s->mem[f] = malloc(s->bytes);
            if (!s->mem[f]) return 2;
        }
        qact_carve(&in->act[f], f, in->M, in->K, s->mem[f]);
        for (int m = 0; m < in->M; m++) act_prepare_row(&in->act[f], m, in->x + (int64_t)m * in->K, 0);
        in->ready[f] = 1;
    }
    return 0;
}

/* out[m * out_stride + n] for n in [n0, n1) of slot `w` (bias and residual as gemv_rows_bf16;
 * residual may alias out). Returns 0, or 2 when out of memory. */
static int stack_gemv(const stack_weight *w, stack_input *in, const uint16_t *bias,
                      const uint16_t *residual, uint16_t *out, int64_t out_stride, int n0, int n1) {
    if (n0 >= n1) return 0;
    if (stack_input_prepare(in, w)) return 2;
    int r0 = 0;
    for (int p = 0; p < w->num_parts; p++) {
        const qweight *q = &w->part[p];
        const int r1 = r0 + q->rows, lo = n0 > r0 ? n0 - r0 : 0, hi = (n1 < r1 ? n1 : r1) - r0;
        if (lo < hi) {
            const uint16_t *b = bias ? bias + r0 : NULL, *res = residual ? residual + r0 : NULL;
            if (q->format == QF_BF16) {
                gemv_rows_bf16(in->x, (const uint16_t *)q->data, b, res, out + r0, in->M, in->K,
                               out_stride, lo, hi);
            } else {
                qinput qin = {in->M, in->K, in->isa, {NULL}, NULL, 0};
                for (int f = 0; f < ACT_FAMILIES; f++) qin.act[f] = in->ready[f] ? &in->act[f] : NULL;
                const qoutput o = {out + r0, 0, out_stride, b, res};
                qgemv_rows(q, &qin, &o, lo, hi, NULL);
            }
        }
        r0 = r1;
    }
    return 0;
}

/* The embedding row of token `id` as bf16 (a bf16 table is copied; a quantized one is
 * dequantized as quant_linear.c's row lookup does). `tmp`: cols floats. */
static inline void stack_embed_row(const qweight *e, int64_t id, uint16_t *out, float *tmp) {
    if (e->format == QF_BF16) {
        memcpy(out, e->data + id * e->cols * 2, sizeof(uint16_t) * (size_t)e->cols);
        return;
    }
    dequant_row_f32(e, id, tmp);
    for (int k = 0; k < e->cols; k++) out[k] = f32_to_bf16(tmp[k]);
}
#endif
