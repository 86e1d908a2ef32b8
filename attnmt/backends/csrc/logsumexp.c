/* What a beam search step needs of its logits, in one call per block of rows, without writing log-probabilities.
 *
 * For every row of logits x (rows, v): lse = log sum exp x, and maxima[b] = max(x + bias) over the tokens of
 * block b (block tokens each, a multiple of 8; nblocks blocks from the start, within v). bias is a per-token
 * adjustment of the log-probabilities (-inf for tokens the search never emits; NULL: none). The search's
 * candidate selection (attnmt/generation/search.py, best_extensions) bounds each block by its maximum and reads
 * the log-probabilities x - lse + bias of a few blocks only, so the (rows, v) log-probabilities that PyTorch's
 * log_softmax writes, and the pass over them that finds the maxima, are never needed. x is fp32 or bf16; sums
 * and maxima are fp32.
 */
#include "vec.h"

#define ARGS                                                                                                     \
    const void *x, int64_t rows, int64_t v, const float *bias, float *maxima, float *lse, int64_t block,        \
        int64_t nblocks, int threads
#define PASS x, rows, v, bias, maxima, lse, block, nblocks, threads

/* row r */
static inline __attribute__((always_inline)) void logsumexp_row(ARGS, int64_t r, int bf16)
{
    (void)rows, (void)threads;
    const int64_t vec = v & ~(int64_t)7;
    const char *xr = (const char *)x + r * v * (bf16 ? 2 : 4);
    float *mr = maxima + r * nblocks;
    /* one pass: the row's maximum, and its blocks' maxima after the bias */
    f8 m = SPLAT(-INFINITY);
    int64_t i = 0;
    for (int64_t b = 0; b < nblocks; b++) {
        f8 bm = SPLAT(-INFINITY);
        for (const int64_t end = i + block; i < end; i += 8) {
            const f8 y = load8(xr, i, bf16);
            m = max8(m, y);
            bm = max8(bm, bias ? y + load8(bias, i, 0) : y);
        }
        mr[b] = hmax8(bm);
    }
    for (; i < vec; i += 8)
        m = max8(m, load8(xr, i, bf16));
    float top = hmax8(m);
    for (; i < v; i++)
        top = fmaxf(top, load1(xr, i, bf16));
    /* the second: the sum of exponentials */
    f8 s0 = SPLAT(0.0f), s1 = SPLAT(0.0f);
    for (i = 0; i + 16 <= vec; i += 16) { /* two sums: the exponentials of neighbours overlap */
        s0 += exp8(load8(xr, i, bf16) - SPLAT(top));
        s1 += exp8(load8(xr, i + 8, bf16) - SPLAT(top));
    }
    for (; i < vec; i += 8)
        s0 += exp8(load8(xr, i, bf16) - SPLAT(top));
    float sum = hsum8(s0 + s1);
    for (i = vec; i < v; i++)
        sum += expf(load1(xr, i, bf16) - top);
    lse[r] = top + logf(sum);
}

DEFINE_ROW_LOOP(logsumexp_blocks_f32, logsumexp_row, 0)
DEFINE_ROW_LOOP(logsumexp_blocks_bf16, logsumexp_row, 1)
