/* The whole Llama decoder stack for a decode-only batch of a few rows (1..8), in one call:
 * Python and torch's per-op dispatch (~12 ops x 30 layers per step) are entered once per step
 * instead of once per op. Per layer:
 *
 *   RMSNorm -> QKV GEMV (+bias) -> RoPE on q|k -> K/V into the paged cache at the rows' slots
 *   -> paged decode attention (GQA) -> o_proj GEMV (+bias) + residual -> RMSNorm
 *   -> gate_up GEMV -> SiLU * up -> down GEMV + residual;   then the final RMSNorm.
 *
 * Every step is the same code as the per-op kernels (gemv_bf16.h, elementwise_bf16.h,
 * decode_attention_bf16.h) with the same roundings where torch rounds to bf16, so the result
 * is bit-equal to the per-op path whenever that path runs these kernels too.
 *
 * One OpenMP parallel region for the whole stack (torch's pool: this library links the same
 * libgomp, see cpu_decode_kernel.py): the threads split each GEMV's output rows into contiguous
 * ranges (one weight stream each) and meet at a barrier between dependent steps.
 *
 * Rows are independent queries: each has its own position, slot, block-table row and context
 * length (the new token included), so spec-decode verification rows of one sequence (context
 * lengths p+1, p+2, ...) work too; all K/V of a layer is written before any row attends. */
#include <stdlib.h>
#include <omp.h>
#include "stack_weights.h"
#include "elementwise_bf16.h"
#include "decode_attention_bf16.h"

/* Per layer, in `layer_ptrs` [L, P_COUNT]: norm weights and biases (0 = no bias). */
enum { P_LN1, P_QKV_B, P_O_B, P_LN2, P_COUNT };
/* Per layer, in `weight_descs` [L, W_COUNT, STACK_PARTS, D_DESC_WORDS]: the weight slots
 * (stack_weights.h: any format, through stack_gemv). */
enum { W_QKV, W_O, W_GATE_UP, W_DOWN, W_COUNT };
/* `dims`: layers, hidden, query heads, KV heads, head dim, intermediate size, vocabulary,
 * rotary table rows. */
enum { D_LAYERS, D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_VOCAB, D_MAX_POS, D_COUNT };

#define STACK_MAX_ROWS GEMV_MAX_M

/* 1 when this build can run a model with these head shapes (else the caller keeps torch). */
int decode_stack_supported(int group, int head_dim) {
#ifdef DECODE_ROWS_BF16
    return group >= 1 && group <= DECODE_MAX_G && head_dim % DECODE_ROWS_WIDTH == 0
           && head_dim <= DECODE_MAX_D;
#else
    (void)group; (void)head_dim;
    return 0;
#endif
}

static inline int part(int n, int i, int parts) { return (int)((int64_t)n * i / parts); }

/* Returns 0; 1 for shapes out of range; 2 when scratch memory could not be allocated; 3 for a
 * token id, position, slot or context length outside its table (nothing is read or written).
 *   ids, pos, slots, lens [R] int64; tables [R, W] int64 block ids
 *   embed_desc: the [vocab, hidden] table's descriptor (bf16 or quantized)
 *   cos_sin [max_pos, D] (cos | sin halves per position)
 *   kv [L, 2, num_blocks, BS, KV, D]; out [R, hidden]
 *   scale: the attention scale, as the per-op kernel gets it (head_dim ** -0.5 from Python)
 *   isa: the quantized GEMVs' instruction set (the per-op quantized kernel's) */
int decode_stack_bf16(const int64_t *layer_ptrs, const int64_t *weight_descs,
                      const int32_t *dims, float eps, float scale, const int64_t *embed_desc,
                      const uint16_t *final_norm, const uint16_t *cos_sin,
                      const int64_t *ids, const int64_t *pos, const int64_t *slots,
                      const int64_t *tables, const int64_t *lens, int R, int W, uint16_t *kv,
                      int64_t num_blocks, int BS, uint16_t *out, int num_threads, int isa) {
#ifndef DECODE_ROWS_BF16
    return 1;
#else
    const int L = dims[D_LAYERS], H = dims[D_HIDDEN], NH = dims[D_HEADS];
    const int KV = dims[D_KV_HEADS], D = dims[D_HEAD_DIM], I = dims[D_INTER];
    if (R < 1 || R > STACK_MAX_ROWS || KV < 1 || NH % KV != 0
        || !decode_stack_supported(NH / KV, D))
        return 1;
    const int G = NH / KV, Q = NH * D, NQKV = Q + 2 * KV * D;
    const qweight embed = qweight_from_desc(embed_desc);
    if (!qweight_valid(&embed) || embed.rows != dims[D_VOCAB] || embed.cols != H) return 1;
    isa = qisa_available(isa);
    for (int l = 0; l < L; l++) { /* every slot readable, in the shapes the layer needs */
        const int64_t *d = weight_descs + (int64_t)l * W_COUNT * STACK_PARTS * D_DESC_WORDS;
        const int rows[W_COUNT] = {NQKV, H, 2 * I, H}, cols[W_COUNT] = {H, Q, H, I};
        for (int s = 0; s < W_COUNT; s++) {
            const stack_weight sw = stack_weight_from(d + s * STACK_PARTS * D_DESC_WORDS);
            if (!stack_weight_valid(&sw, cols[s]) || sw.rows != rows[s]) return 1;
        }
    }
    const int max_k = H > Q ? (H > I ? H : I) : (Q > I ? Q : I);
    int64_t max_len = 1;
    for (int r = 0; r < R; r++) {
        if (ids[r] < 0 || ids[r] >= dims[D_VOCAB] || pos[r] < 0 || pos[r] >= dims[D_MAX_POS]
            || slots[r] < 0 || slots[r] >= num_blocks * BS || lens[r] < 1 || lens[r] > (int64_t)W * BS)
            return 3;
        for (int j = 0; j < (lens[r] + BS - 1) / BS; j++)
            if (tables[(int64_t)r * W + j] < 0 || tables[(int64_t)r * W + j] >= num_blocks) return 3;
        if (lens[r] > max_len) max_len = lens[r];
    }
    /* rows of one sequence (a verification's 1 + k) read its K/V once: decode_row_groups */
    int gfirst[STACK_MAX_ROWS], gcount[STACK_MAX_ROWS], grows = 1;
    const int groups = decode_row_groups(tables, W, R, G, num_threads > 1 && KV % num_threads
                                         ? num_threads : 1, gfirst, gcount);
    for (int i = 0; i < groups; i++) if (gcount[i] > grows) grows = gcount[i];
    /* activations, all [R, width] bf16 */
    const size_t widths = (size_t)H + NQKV + Q + 3 * (size_t)I;
    /* 64-byte aligned: the GEMVs' activation loads then stay within one cache line (with
     * malloc's 16-byte alignment the M-row dots ran ~20% slower from M = 4) */
    uint16_t *scratch = (uint16_t *)aligned_alloc(
        64, (sizeof(uint16_t) * widths * (size_t)R + 63) / 64 * 64);
    if (!scratch) return 2;
    uint16_t *hid = scratch, *qkv = hid + (size_t)R * H;
    uint16_t *att = qkv + (size_t)R * NQKV, *gu = att + (size_t)R * Q, *act = gu + (size_t)R * 2 * I;
    const int64_t cache_half = num_blocks * BS * KV * D; /* one layer's K (or V) */
    const int units = (I + CHUNK - 1) / CHUNK;            /* gate_up work units, CHUNK wide */
    /* each thread's own normed rows: every thread norms all rows itself (R x H values, about a
     * microsecond) instead of norming its share and meeting the others at a barrier, twice a
     * layer (8 -> 6 barriers); each copy 64-byte aligned, like the scratch */
    const size_t xn_stride = ((size_t)R * H + 31) / 32 * 32;
    uint16_t *xns = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * (size_t)num_threads * xn_stride);
    if (!xns) {
        free(scratch);
        return 2;
    }
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        uint16_t *const xn = xns + (size_t)tid * xn_stride;
        float *scores = (float *)malloc(sizeof(float) * (size_t)grows * G * (size_t)max_len);
        float *row_tmp = (float *)malloc(sizeof(float) * (size_t)H);
        stack_scratch scratch = {{NULL}, qact_bytes(R, max_k)};
        int err = 0;
        if (!scores || !row_tmp) err = 2;
        for (int r = tid; r < R && row_tmp; r += nth)
            stack_embed_row(&embed, ids[r], hid + (size_t)r * H, row_tmp);
        _Pragma("omp barrier")
        for (int l = 0; l < L; l++) {
            const int64_t *p = layer_ptrs + (int64_t)l * P_COUNT;
            const int64_t *wd = weight_descs + (int64_t)l * W_COUNT * STACK_PARTS * D_DESC_WORDS;
            const stack_weight w_qkv = stack_weight_from(wd + W_QKV * STACK_PARTS * D_DESC_WORDS);
            const stack_weight w_o = stack_weight_from(wd + W_O * STACK_PARTS * D_DESC_WORDS);
            const stack_weight w_gu = stack_weight_from(wd + W_GATE_UP * STACK_PARTS * D_DESC_WORDS);
            const stack_weight w_down = stack_weight_from(wd + W_DOWN * STACK_PARTS * D_DESC_WORDS);
            const uint16_t *qkv_b = (const uint16_t *)p[P_QKV_B], *o_b = (const uint16_t *)p[P_O_B];
            uint16_t *kc = kv + (int64_t)l * 2 * cache_half, *vc = kc + cache_half;
            for (int r = 0; r < R; r++)
                rms_norm_row(hid + (size_t)r * H, (const uint16_t *)p[P_LN1], xn + (size_t)r * H, H, eps);
            {
                stack_input in = stack_input_of(xn, R, H, isa, &scratch);
                err |= stack_gemv(&w_qkv, &in, qkv_b, NULL, qkv, NQKV, part(NQKV, tid, nth),
                                  part(NQKV, tid + 1, nth));
            }
            _Pragma("omp barrier")
            for (int r = tid; r < R; r += nth) { /* RoPE on q|k in place, then K/V to the cache */
                uint16_t *row = qkv + (size_t)r * NQKV;
                const uint16_t *cs = cos_sin + pos[r] * D;
                rotary_row(row, cs, cs + D / 2, row, NH + KV, D);
                memcpy(kc + slots[r] * KV * D, row + Q, sizeof(uint16_t) * (size_t)KV * D);
                memcpy(vc + slots[r] * KV * D, row + Q + KV * D, sizeof(uint16_t) * (size_t)KV * D);
            }
            _Pragma("omp barrier")
            if (scores)
                for (int task = tid; task < groups * KV; task += nth) {
                    const int r = gfirst[task / KV], h = task % KV;
                    DECODE_ROWS_BF16(qkv + (size_t)r * NQKV + (size_t)h * G * D, NQKV,
                                     gcount[task / KV], kc, vc, tables + (int64_t)r * W,
                                     lens + r, att + (size_t)r * Q + (size_t)h * G * D, Q,
                                     KV, G, D, BS, h, scale, scores, max_len);
                }
            _Pragma("omp barrier")
            {
                stack_input in = stack_input_of(att, R, Q, isa, &scratch);
                err |= stack_gemv(&w_o, &in, o_b, hid, hid, H, part(H, tid, nth), part(H, tid + 1, nth));
            }
            _Pragma("omp barrier")
            for (int r = 0; r < R; r++)
                rms_norm_row(hid + (size_t)r * H, (const uint16_t *)p[P_LN2], xn + (size_t)r * H, H, eps);
            { /* gate and up rows of the same columns, then SiLU * up over them: no barrier */
                const int c0 = part(units, tid, nth) * CHUNK;
                const int c1 = part(units, tid + 1, nth) * CHUNK < I ? part(units, tid + 1, nth) * CHUNK : I;
                if (c0 < c1) {
                    stack_input in = stack_input_of(xn, R, H, isa, &scratch);
                    err |= stack_gemv(&w_gu, &in, NULL, NULL, gu, 2 * (int64_t)I, c0, c1);
                    err |= stack_gemv(&w_gu, &in, NULL, NULL, gu, 2 * (int64_t)I, I + c0, I + c1);
                    for (int r = 0; r < R; r++)
                        for (int c = c0; c < c1; c += CHUNK) {
                            const uint16_t *g = gu + (size_t)r * 2 * I + c;
                            silu_mul_chunk(g, g + I, act + (size_t)r * I + c,
                                           I - c < CHUNK ? I - c : CHUNK);
                        }
                }
            }
            _Pragma("omp barrier")
            {
                stack_input in = stack_input_of(act, R, I, isa, &scratch);
                err |= stack_gemv(&w_down, &in, NULL, hid, hid, H, part(H, tid, nth),
                                  part(H, tid + 1, nth));
            }
            _Pragma("omp barrier")
        }
        for (int r = tid; r < R; r += nth)
            rms_norm_row(hid + (size_t)r * H, final_norm, out + (size_t)r * H, H, eps);
        if (err) {
            _Pragma("omp atomic write")
            failed = 2;
        }
        stack_scratch_free(&scratch);
        free(row_tmp);
        free(scores);
    }
    free(xns);
    free(scratch);
    return failed;
#endif
}
