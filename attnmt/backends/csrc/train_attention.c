/* Scaled dot-product attention for training, fp32: softmax(Q K^T / sqrt(d)) V for each (sentence, head) pair,
 * forward and backward, each in one call, reading Q, K and V where the projections wrote them and writing the
 * heads side by side (Concat, 3.2.2).
 *
 * For sentence-length sequences PyTorch's form is two batched products of tiny matrices (a few dozen rows of
 * 64) with copies of Q, K and V into contiguous blocks, a scale, a mask and a softmax between them, each a pass
 * of its own, and copies back into the projections' layout; here one task per (sentence, head) reads its rows of
 * Q, K, V where they lie, keeps a query's scores in a small buffer and writes its probabilities (which the
 * backward pass needs, as PyTorch's softmax saves its output) and its output row.
 *
 * Layout. Every operand is a matrix of rows, one row per position, heads side by side in a row (head h at
 * columns h*dh .. h*dh + dh - 1, from the pointer given for that operand): a projection's output. Sentence b's
 * queries are rows q_start[b] .. q_start[b] + q_len[b] - 1 and its keys rows k_start[b] .. + k_len[b] - 1 (a
 * padded (B, T) grid has start b*T and length T; packed rows start where the previous sentence ends). Q rows are
 * q_stride floats apart, K and V rows kv_stride apart; the output has the queries' rows, H*dh floats each.
 *
 * Forward, for query i: s_j = q_i . k_j * scale for the keys j it may see (j <= i with `causal`; keep[b, j]
 * where a key padding mask is given), p = softmax(s), o_i = sum_j p_j v_j. A query that may see no key gets
 * zero probabilities and output.
 * Backward, with dO: dP_ij = dO_i . v_j, D_i = sum_j P_ij dP_ij, dS_ij = P_ij (dP_ij - D_i) scale;
 * dQ_i = sum_j dS_ij k_j, dK_j = sum_i dS_ij q_i, dV_j = sum_i P_ij dO_i.
 *
 * Head sizes: multiples of 8 up to MAX_DH; keys: up to MAX_KEYS (longer sequences keep PyTorch's kernels). */
#include "vec.h"

#define MAX_DH 128
#define MAX_KEYS 256

int train_attention_max_dh(void) { return MAX_DH; }
int train_attention_max_keys(void) { return MAX_KEYS; }

/* lanes of two vectors picked by index (0-7: a's, 8-15: b's), in GCC's spelling or Clang's */
#if defined(__clang__)
#define SHUFFLE(a, b, i0, i1, i2, i3, i4, i5, i6, i7) __builtin_shufflevector(a, b, i0, i1, i2, i3, i4, i5, i6, i7)
#else
#define SHUFFLE(a, b, i0, i1, i2, i3, i4, i5, i6, i7) __builtin_shuffle(a, b, (i8v){i0, i1, i2, i3, i4, i5, i6, i7})
#endif

/* a . b over dh (a multiple of 8) */
static inline float dot(const float *a, const float *b, int dh)
{
    f8 acc = SPLAT(0.0f), acc2 = SPLAT(0.0f);
    int d = 0;
    for (; d + 16 <= dh; d += 16) {
        acc += load8(a, d, 0) * load8(b, d, 0);
        acc2 += load8(a, d + 8, 0) * load8(b, d + 8, 0);
    }
    for (; d < dh; d += 8)
        acc += load8(a, d, 0) * load8(b, d, 0);
    return hsum8(acc + acc2);
}

/* the sums of the lanes of a, b, c, d */
static inline void hsum4(f8 a, f8 b, f8 c, f8 d, float *out)
{
    /* u = (a0+a1, b0+b1, a2+a3, b2+b3, ...), w the same of c and d, y = (a0..3, b0..3, c0..3, d0..3, a4..7, ...) */
    const f8 u = SHUFFLE(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
    const f8 w = SHUFFLE(c, d, 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE(c, d, 1, 9, 3, 11, 5, 13, 7, 15);
    const f8 y = SHUFFLE(u, w, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE(u, w, 2, 3, 10, 11, 6, 7, 14, 15);
    out[0] = y[0] + y[4];
    out[1] = y[1] + y[5];
    out[2] = y[2] + y[6];
    out[3] = y[3] + y[7];
}

/* s[j] = a . rows j of x (row stride `stride`), j < n */
static inline void dots(const float *a, const float *x, int64_t stride, int64_t n, int dh, float *s)
{
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *x0 = x + j * stride, *x1 = x0 + stride, *x2 = x1 + stride, *x3 = x2 + stride;
        f8 a0 = SPLAT(0.0f), a1 = SPLAT(0.0f), a2 = SPLAT(0.0f), a3 = SPLAT(0.0f);
        for (int d = 0; d < dh; d += 8) {
            const f8 ad = load8(a, d, 0);
            a0 += ad * load8(x0, d, 0);
            a1 += ad * load8(x1, d, 0);
            a2 += ad * load8(x2, d, 0);
            a3 += ad * load8(x3, d, 0);
        }
        hsum4(a0, a1, a2, a3, s + j);
    }
    for (; j < n; j++)
        s[j] = dot(a, x + j * stride, dh);
}

/* y += a x over dh */
static inline void axpy(float *y, float a, const float *x, int dh)
{
    const f8 av = SPLAT(a);
    for (int d = 0; d < dh; d += 8) {
        f8 t = load8(y, d, 0) + av * load8(x, d, 0);
        memcpy(y + d, &t, sizeof t);
    }
}

/* query i sees keys [0, key_limit) (less the masked ones) */
static inline int64_t key_limit(int64_t i, int64_t S, int causal) { return causal ? (i + 1 < S ? i + 1 : S) : S; }

/* out (rows like q's, H*dh floats each) and probs (B, H, T, S) from q, k, v (see the layout above); T and S
   bound q_len and k_len; keep (B, S) bytes, 0 = masked key, or NULL. A query's probabilities past its keys are 0. */
#define FORWARD_ARGS                                                                                             \
    const float *q, int64_t q_stride, const int64_t *q_start, const int64_t *q_len, const float *k, const float *v, \
        int64_t kv_stride, const int64_t *k_start, const int64_t *k_len, const uint8_t *keep, int64_t B,           \
        int64_t H, int64_t T, int64_t S, int dh, int causal, float scale, float *out, float *probs
#define FORWARD_PASS q, q_stride, q_start, q_len, k, v, kv_stride, k_start, k_len, keep, B, H, T, S
#define BACKWARD_ARGS                                                                                            \
    const float *q, int64_t q_stride, const int64_t *q_start, const int64_t *q_len, const float *k, const float *v, \
        int64_t kv_stride, const int64_t *k_start, const int64_t *k_len, int64_t B, int64_t H, int64_t T,          \
        int64_t S, int dh, int causal, float scale, const float *probs, const float *dout, float *dq,              \
        int64_t dq_stride, float *dk, float *dv, int64_t dkv_stride
#define BACKWARD_PASS q, q_stride, q_start, q_len, k, v, kv_stride, k_start, k_len, B, H, T, S

/* one (sentence, head) task; inlined with dh a constant for the common head size, so that the loops over a
   row unroll and a row's sums stay in registers */
static inline __attribute__((always_inline)) void forward_task(FORWARD_ARGS, int64_t bh)
{
    const int64_t D = H * dh;
    const int64_t b = bh / H, h = bh % H, Tb = q_len[b], Sb = k_len[b];
    const float *qb = q + q_start[b] * q_stride + h * dh;
    const float *kb = k + k_start[b] * kv_stride + h * dh, *vb = v + k_start[b] * kv_stride + h * dh;
    float *ob = out + q_start[b] * D + h * dh;
    const uint8_t *kp = keep ? keep + b * S : 0;
    float sc[MAX_KEYS];
    for (int64_t i = 0; i < Tb; i++) {
        float *p = probs + (bh * T + i) * S;
        const int64_t lim = key_limit(i, Sb, causal);
        dots(qb + i * q_stride, kb, kv_stride, lim, dh, sc);
        float m = -INFINITY;
        for (int64_t j = 0; j < lim; j++) {
            sc[j] = (kp && !kp[j]) ? -INFINITY : sc[j] * scale;
            m = sc[j] > m ? sc[j] : m;
        }
        float l = 0.0f;
        if (m > -INFINITY) { /* exp(s - max) eight keys at a time (a masked key's -inf gives 0) */
            const int64_t lim8 = (lim + 7) / 8 * 8;
            for (int64_t j = lim; j < lim8; j++)
                sc[j] = -INFINITY;
            f8 sum = SPLAT(0.0f);
            for (int64_t j = 0; j < lim8; j += 8) {
                const f8 e = exp8(load8(sc, j, 0) - SPLAT(m));
                memcpy(sc + j, &e, sizeof e);
                sum += e;
            }
            l = hsum8(sum);
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int64_t j = 0; j < lim; j++)
            p[j] = l > 0.0f ? sc[j] : 0.0f;
        f8 acc[MAX_DH / 8];
        for (int d = 0; d < dh / 8; d++)
            acc[d] = SPLAT(0.0f);
        for (int64_t j = 0; j < lim; j++) {
            p[j] *= inv;
            if (p[j] == 0.0f)
                continue;
            const f8 pj = SPLAT(p[j]);
            const float *vj = vb + j * kv_stride;
            for (int d = 0; d < dh / 8; d++)
                acc[d] += pj * load8(vj, d * 8, 0);
        }
        for (int64_t j = lim; j < S; j++)
            p[j] = 0.0f;
        memcpy(ob + i * D, acc, dh * sizeof(float));
    }
}

void train_attention_forward_f32(FORWARD_ARGS, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t bh = 0; bh < B * H; bh++) {
        if (dh == 64)
            forward_task(FORWARD_PASS, 64, causal, scale, out, probs, bh);
        else
            forward_task(FORWARD_PASS, dh, causal, scale, out, probs, bh);
    }
}

/* dq (rows like q's, dq_stride floats apart), dk and dv (rows like k's, dkv_stride apart), every row of them
   written, from the forward's inputs, its probs and the output's gradient dout (rows like out); masked keys
   have zero probabilities, so they need no mask here */
static inline __attribute__((always_inline)) void backward_task(BACKWARD_ARGS, int64_t bh)
{
    const int64_t D = H * dh;
    const int64_t b = bh / H, h = bh % H, Tb = q_len[b], Sb = k_len[b];
    const float *qb = q + q_start[b] * q_stride + h * dh;
    const float *kb = k + k_start[b] * kv_stride + h * dh, *vb = v + k_start[b] * kv_stride + h * dh;
    const float *gb = dout + q_start[b] * D + h * dh;
    float *dqb = dq + q_start[b] * dq_stride + h * dh;
    float *dkb = dk + k_start[b] * dkv_stride + h * dh, *dvb = dv + k_start[b] * dkv_stride + h * dh;
    for (int64_t j = 0; j < Sb; j++) {
        memset(dkb + j * dkv_stride, 0, dh * sizeof(float));
        memset(dvb + j * dkv_stride, 0, dh * sizeof(float));
    }
    float ds[MAX_KEYS];
    for (int64_t i = 0; i < Tb; i++) {
        const float *p = probs + (bh * T + i) * S, *go = gb + i * D, *qi = qb + i * q_stride;
        const int64_t lim = key_limit(i, Sb, causal);
        dots(go, vb, kv_stride, lim, dh, ds);
        float Dsum = 0.0f;
        for (int64_t j = 0; j < lim; j++) {
            if (p[j] == 0.0f)
                continue;
            Dsum += p[j] * ds[j];
            axpy(dvb + j * dkv_stride, p[j], go, dh);
        }
        f8 acc[MAX_DH / 8];
        for (int d = 0; d < dh / 8; d++)
            acc[d] = SPLAT(0.0f);
        for (int64_t j = 0; j < lim; j++) {
            if (p[j] == 0.0f)
                continue;
            const float g = p[j] * (ds[j] - Dsum) * scale;
            const f8 gv = SPLAT(g);
            const float *kj = kb + j * kv_stride;
            for (int d = 0; d < dh / 8; d++)
                acc[d] += gv * load8(kj, d * 8, 0);
            axpy(dkb + j * dkv_stride, g, qi, dh);
        }
        memcpy(dqb + i * dq_stride, acc, dh * sizeof(float));
    }
}

void train_attention_backward_f32(BACKWARD_ARGS, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t bh = 0; bh < B * H; bh++) {
        if (dh == 64)
            backward_task(BACKWARD_PASS, 64, causal, scale, probs, dout, dq, dq_stride, dk, dv, dkv_stride, bh);
        else
            backward_task(BACKWARD_PASS, dh, causal, scale, probs, dout, dq, dq_stride, dk, dv, dkv_stride, bh);
    }
}
