/* What every bf16 CPU kernel here shares: the instruction-set switches and the bf16 <-> float32
 * conversions. Conversions go by value (memcpy), never through a pointer of the other type:
 * that breaks strict aliasing, and GCC's AVX-512 code once read stale data because of it
 * (see paged_decode_attention.c). cpu_kernel_build hashes this header into each build key. */
#ifndef DEEPINFER_BF16_CPU_H
#define DEEPINFER_BF16_CPU_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef __AVX512F__
#define HAVE_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2_FMA 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_DPBF16 1
#endif

/* For the row-level functions of the shared headers, which two libraries (a per-op kernel and
 * decode_stack.c) must compute bit for bit alike: compiled on their own in each library (never
 * inlined, cloned or specialised for a caller), the same source and flags give the same code.
 * Inlined into their callers, the two copies compiled differently: one decode step of the
 * default model in ~60 came out a bf16 step apart somewhere in the stack. */
#define SHARED_ROW_FN __attribute__((noipa)) static

static inline float bf16_to_f32(uint16_t x) {
    const uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#endif
