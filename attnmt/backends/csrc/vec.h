/* Vector helpers shared by the compiled kernels: eight fp32 lanes (GCC/Clang vector extensions; the compiler
 * maps them onto AVX2, AVX-512 or SSE registers, as the flags allow). */
#ifndef ATTNMT_VEC_H
#define ATTNMT_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));
typedef uint32_t u8v __attribute__((vector_size(32)));
typedef uint16_t h8v __attribute__((vector_size(16)));

#define SPLAT(x) ((f8){x, x, x, x, x, x, x, x})

static inline f8 select8(i8v m, f8 a, f8 b) /* m ? a : b per lane (m: all ones or zero) */
{
    i8v ai, bi, ri;
    f8 r;
    memcpy(&ai, &a, sizeof a);
    memcpy(&bi, &b, sizeof b);
    ri = (m & ai) | (~m & bi);
    memcpy(&r, &ri, sizeof r);
    return r;
}

static inline f8 max8(f8 a, f8 b) { return select8(a > b, a, b); }

static inline float hmax8(f8 a)
{
    float m = a[0];
    for (int i = 1; i < 8; i++)
        m = a[i] > m ? a[i] : m;
    return m;
}

static inline float hsum8(f8 a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

/* exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' degree-5 polynomial (about 1 ulp),
   2^n through the exponent bits; below -87 (where 2^n leaves the normal range) 0 */
static inline f8 exp8(f8 x)
{
    const i8v under = x < SPLAT(-87.0f);
    x = select8(under, SPLAT(-87.0f), x);
    const f8 n = (x * SPLAT(1.44269504088896341f) + SPLAT(12582912.0f)) - SPLAT(12582912.0f); /* round */
    const f8 r = (x - n * SPLAT(0.693359375f)) - n * SPLAT(-2.12194440e-4f);
    f8 p = SPLAT(1.9875691500e-4f);
    p = p * r + SPLAT(1.3981999507e-3f);
    p = p * r + SPLAT(8.3334519073e-3f);
    p = p * r + SPLAT(4.1665795894e-2f);
    p = p * r + SPLAT(1.6666665459e-1f);
    p = p * r + SPLAT(5.0000001201e-1f);
    p = p * r * r + r + SPLAT(1.0f);
    const i8v bits = (__builtin_convertvector(n, i8v) + 127) << 23;
    f8 scale;
    memcpy(&scale, &bits, sizeof scale);
    return select8(under, SPLAT(0.0f), p * scale);
}

/* eight values from p + i: fp32, or bf16 (whose bits are the top half of an fp32's) */
static inline f8 load8(const void *p, int64_t i, int bf16)
{
    f8 x;
    if (bf16) {
        h8v h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        u8v w = __builtin_convertvector(h, u8v) << 16;
        memcpy(&x, &w, sizeof x);
    } else {
        memcpy(&x, (const float *)p + i, sizeof x);
    }
    return x;
}

/* one value from p + i, as load8 */
static inline float load1(const void *p, int64_t i, int bf16)
{
    if (!bf16)
        return ((const float *)p)[i];
    uint32_t w = (uint32_t)((const uint16_t *)p)[i] << 16;
    float x;
    memcpy(&x, &w, sizeof x);
    return x;
}

/* fp32 bits rounded to the nearest bf16, ties to even (as PyTorch converts) */
static inline uint32_t round_bf16(uint32_t w) { return (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16; }

/* eight values to p + i, as load8 reads them (bf16 rounded) */
static inline void store8(void *p, int64_t i, f8 x, int bf16)
{
    if (bf16) {
        u8v w;
        memcpy(&w, &x, sizeof w);
        w = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
        const h8v h = __builtin_convertvector(w, h8v);
        memcpy((uint16_t *)p + i, &h, sizeof h);
    } else {
        memcpy((float *)p + i, &x, sizeof x);
    }
}

/* one value to p + i, as store8 */
static inline void store1(void *p, int64_t i, float x, int bf16)
{
    if (bf16) {
        uint32_t w;
        memcpy(&w, &x, sizeof w);
        ((uint16_t *)p)[i] = (uint16_t)round_bf16(w);
    } else {
        ((float *)p)[i] = x;
    }
}

/* void NAME(ARGS): ROW(PASS, r, BF16) for r in [0, rows), the rows split over `threads` OpenMP threads. ARGS and
   PASS are the including file's macros, naming `rows` and `threads` among the arguments. One function per dtype,
   each with its own parallel loop, so that the compiler specializes each body (a loop in a shared inline
   function would be outlined once, with the dtype a run-time flag). */
#define DEFINE_ROW_LOOP(NAME, ROW, BF16)                                                                         \
    void NAME(ARGS)                                                                                              \
    {                                                                                                            \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")                      \
        for (int64_t r = 0; r < rows; r++)                                                                       \
            ROW(PASS, r, BF16);                                                                                  \
    }

#endif
