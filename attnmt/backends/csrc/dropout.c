/* Dropout with a counter-based mask: out = x + keep(e) * y * scale (x NULL: out = keep(e) * y * scale), one pass.
 *
 * Element e is kept when the low 15 bits of hash(seed, e) are >= threshold: P(drop) = threshold / 2^15, and kept
 * elements are scaled by scale = 2^15 / (2^15 - threshold), as ``models/dropout.py`` draws its masks. The mask is
 * a function of the seed and the element's index, so it is never stored: the backward pass computes the same
 * mask again (the gradient of y is this same call on the output's gradient, with x NULL). The hash is
 * MurmurHash3's 32-bit finalizer, applied twice to mix in the index's two halves and the seed's.
 * x, y and out are fp32 or bf16 (out rounded to nearest even, as PyTorch converts), contiguous, n elements; the
 * work is split into blocks of DROPOUT_BLOCK elements over `threads` OpenMP threads.
 */
#include "vec.h"

#define DROPOUT_BLOCK 16384

static inline u8v fmix8(u8v h)
{
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

/* the 15 random bits of elements idx (their low halves; hi: the high half they share) */
static inline u8v bits8(u8v idx, uint32_t hi, uint64_t seed)
{
    return fmix8(fmix8(idx ^ (uint32_t)seed) ^ hi ^ (uint32_t)(seed >> 32)) & 0x7FFFu;
}

#define ARGS                                                                                                     \
    const void *x, const void *y, void *out, int64_t n, int threshold, float scale, uint64_t seed, int64_t rows, \
        int threads
#define PASS x, y, out, n, threshold, scale, seed, rows, threads

static inline __attribute__((always_inline)) void dropout_block(ARGS, int64_t r, int bf16)
{
    (void)rows, (void)threads;
    const int64_t start = r * DROPOUT_BLOCK, end = start + DROPOUT_BLOCK < n ? start + DROPOUT_BLOCK : n;
    const u8v lanes = {0, 1, 2, 3, 4, 5, 6, 7};
    const u8v limit = (u8v){0} + (uint32_t)threshold;
    const f8 s = SPLAT(scale);
    int64_t e = start;
    for (; e + 8 <= end; e += 8) { /* e % 8 == 0: e..e+7 share the high half of their index */
        const u8v bits = bits8(lanes + (uint32_t)e, (uint32_t)((uint64_t)e >> 32), seed);
        f8 v = select8((i8v)(bits >= limit), load8(y, e, bf16) * s, SPLAT(0.0f));
        if (x)
            v += load8(x, e, bf16);
        store8(out, e, v, bf16);
    }
    for (; e < end; e++) {
        const uint32_t bits = bits8((u8v){0} + (uint32_t)e, (uint32_t)((uint64_t)e >> 32), seed)[0];
        float v = bits >= (uint32_t)threshold ? load1(y, e, bf16) * scale : 0.0f;
        if (x)
            v += load1(x, e, bf16);
        store1(out, e, v, bf16);
    }
}

int dropout_block_elements(void) { return DROPOUT_BLOCK; }

DEFINE_ROW_LOOP(dropout_add_f32, dropout_block, 0)
DEFINE_ROW_LOOP(dropout_add_bf16, dropout_block, 1)
