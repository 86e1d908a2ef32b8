/* The label-smoothed cross-entropy of a block of logits and its gradient, in one call (the training loss).
 *
 * For every row r of logits x (rows, v) with target y = target[r] and lse = log sum_i exp x_i:
 *   lp_y[r] = x_y - lse                      (the target's log-probability),
 *   lp_sum[r] = sum_i (x_i - lse)            (the sum of the row's log-probabilities, which label smoothing needs),
 * and where g is given, the gradient of the smoothed loss with respect to x,
 *   g_i = exp(x_i - lse) - eps / v - (1 - eps) [i == y]   (softmax minus the smoothed target).
 * g may be x itself: each element is read before it is written. x and g are fp32 or bf16 (g rounded to nearest
 * even, as PyTorch converts); sums are fp32. Three passes over the row while it sits in the L1/L2 cache (its
 * maximum; the sums of exponentials and of x; the gradient) replace PyTorch's log_softmax, gather, sum, exp and
 * subtraction, each a pass that reads and writes the logits (attnmt/criterions.py has that form).
 */
#include "vec.h"

#define ARGS                                                                                                     \
    const void *x, int64_t rows, int64_t v, const int64_t *target, float epsilon, float *lp_y, float *lp_sum,  \
        void *g, int threads
#define PASS x, rows, v, target, epsilon, lp_y, lp_sum, g, threads

static inline __attribute__((always_inline)) void loss_row(ARGS, int64_t r, int bf16)
{
    (void)rows, (void)threads;
    const int64_t size = bf16 ? 2 : 4, vec = v & ~(int64_t)7;
    const char *xr = (const char *)x + r * v * size;
    /* the maximum */
    f8 m = SPLAT(-INFINITY);
    int64_t i;
    for (i = 0; i < vec; i += 8)
        m = max8(m, load8(xr, i, bf16));
    float top = hmax8(m);
    for (; i < v; i++)
        top = fmaxf(top, load1(xr, i, bf16));
    const int64_t y = target[r];
    const float xy = load1(xr, y, bf16); /* before g, which may be x, overwrites it */
    /* the sums of exp(x - top) and of x - top, two of each: the exponentials of neighbours overlap */
    char *gr = g ? (char *)g + r * v * size : NULL;
    const int keep = gr && !bf16; /* fp32: keep exp(x - top) in g for the gradient, in place of x after its use */
    f8 e0 = SPLAT(0.0f), e1 = SPLAT(0.0f), d0 = SPLAT(0.0f), d1 = SPLAT(0.0f);
    for (i = 0; i + 16 <= vec; i += 16) {
        const f8 a = load8(xr, i, bf16) - SPLAT(top), b = load8(xr, i + 8, bf16) - SPLAT(top);
        const f8 ea = exp8(a), eb = exp8(b);
        e0 += ea, e1 += eb, d0 += a, d1 += b;
        if (keep)
            store8(gr, i, ea, 0), store8(gr, i + 8, eb, 0);
    }
    for (; i < vec; i += 8) {
        const f8 a = load8(xr, i, bf16) - SPLAT(top), ea = exp8(a);
        e0 += ea, d0 += a;
        if (keep)
            store8(gr, i, ea, 0);
    }
    float sum = hsum8(e0 + e1), shifted = hsum8(d0 + d1);
    for (; i < v; i++) {
        const float a = load1(xr, i, bf16) - top;
        sum += expf(a), shifted += a;
    }
    const float log_sum = logf(sum), lse = top + log_sum;
    lp_y[r] = xy - lse;
    lp_sum[r] = shifted - (float)v * log_sum;
    if (!gr)
        return;
    /* the gradient */
    const float floor = epsilon / (float)v;
    if (keep) { /* fp32: the exponentials kept from the second pass, scaled by 1 / sum */
        const f8 inv = SPLAT(1.0f / sum);
        for (i = 0; i < vec; i += 8)
            store8(gr, i, load8(gr, i, 0) * inv - SPLAT(floor), 0);
    } else {
        for (i = 0; i < vec; i += 8)
            store8(gr, i, exp8(load8(xr, i, bf16) - SPLAT(lse)) - SPLAT(floor), bf16);
    }
    for (; i < v; i++)
        store1(gr, i, expf(load1(xr, i, bf16) - lse) - floor, bf16);
    store1(gr, y, expf(xy - lse) - floor - (1.0f - epsilon), bf16);
}

DEFINE_ROW_LOOP(smoothed_loss_f32, loss_row, 0)
DEFINE_ROW_LOOP(smoothed_loss_bf16, loss_row, 1)
