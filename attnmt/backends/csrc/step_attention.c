/* One decoding step's attention over the beam search's slot cache (attnmt/models/incremental.py), in one call.
 *
 * Every query row attends to the keys/values of its own sentence: in self-attention the slots of the row's own
 * history (position s of row r lies in slot s * beam + ancestors[r][s]), in encoder-decoder attention the
 * sentence's source positions that are not padding. The batched matmul-softmax-matmul this replaces multiplies
 * every query of a sentence with every slot of the sentence (beam times the work, under a mask) in thousands of
 * tiny products; here each (row, head) pair reads only what it attends to, once, and its scores stay in a small
 * buffer. Scores, softmax and sums are fp32 for fp32 and bf16 inputs alike.
 *
 * Layouts (row-major; the head size dh a multiple of 8, at most MAX_DH):
 *   q            rows of queries, row stride q_rs; head h at column h * dh
 *   keys, values (N, H, slots, dh), contiguous: N buffered sentences
 *   sentence of row r: live[r / per] when live is given, else r / per
 *   self-attention: ancestors int32, row r uses ancestor row r * anc_mult (stride anc_stride); the row attends
 *     positions 0..pos, pos = positions[sentence] when positions (int64, one per buffered sentence: sentences
 *     at different steps) is given, else the call's pos (n = pos + 1). With new_k/new_v (row stride new_rs,
 *     head h at h * dh), the row's key/value of position pos is first written to slot pos * beam + r % per,
 *     which no other row reads.
 *   encoder-decoder attention: ancestors NULL, n = slots; keep (N, n) bytes, 0 = padding (NULL: none).
 *   out          (rows, H * dh), contiguous.
 */
#include "vec.h"

#define MAX_DH 256

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#include <immintrin.h>
/* the CPU's bf16 dot products (AVX-512 BF16): sixteen bf16 products per instruction, summed in fp32 */
#define BF16_DOT 1
static inline f8 dot16_bf16(f8 acc, const char *a, const char *b, int i)
{
    const __m256bh x = (__m256bh)_mm256_loadu_si256((const __m256i *)((const uint16_t *)a + i));
    const __m256bh y = (__m256bh)_mm256_loadu_si256((const __m256i *)((const uint16_t *)b + i));
    return (f8)_mm256_dpbf16_ps((__m256)acc, x, y);
}
#endif

static inline uint16_t to_bf16(float f) /* round to nearest even; NaN stays NaN */
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline int64_t slot(const int32_t *anc, int64_t beam, int s) { return anc ? s * beam + anc[s] : s; }

/* one (row, head): out = softmax(q . k_s * scale) . v over its n positions; nv = dh / 8; w: room for n + 8 */
static inline __attribute__((always_inline)) void attend_one(
    const void *q, const char *k, const char *v, const int32_t *anc, int64_t beam, const uint8_t *keep, int n,
    const int nv, float scale, void *out, float *w, int bf16)
{
    const int64_t row_bytes = (int64_t)nv * 8 * (bf16 ? 2 : 4);
    f8 qv[MAX_DH / 8], acc[MAX_DH / 8];
    for (int i = 0; i < nv; i++)
        qv[i] = load8(q, 8 * i, bf16) * SPLAT(scale);
    int s = 0;
#ifdef BF16_DOT
    if (bf16 && nv % 2 == 0) { /* bf16 queries and keys straight into the dot-product instruction */
        const int dh = nv * 8;
        for (; s + 4 <= n; s += 4) {
            const char *k0 = k + slot(anc, beam, s) * row_bytes, *k1 = k + slot(anc, beam, s + 1) * row_bytes;
            const char *k2 = k + slot(anc, beam, s + 2) * row_bytes, *k3 = k + slot(anc, beam, s + 3) * row_bytes;
            f8 a0 = SPLAT(0.0f), a1 = SPLAT(0.0f), a2 = SPLAT(0.0f), a3 = SPLAT(0.0f);
            for (int i = 0; i < dh; i += 16) {
                a0 = dot16_bf16(a0, q, k0, i);
                a1 = dot16_bf16(a1, q, k1, i);
                a2 = dot16_bf16(a2, q, k2, i);
                a3 = dot16_bf16(a3, q, k3, i);
            }
            w[s] = hsum8(a0) * scale, w[s + 1] = hsum8(a1) * scale;
            w[s + 2] = hsum8(a2) * scale, w[s + 3] = hsum8(a3) * scale;
        }
        for (; s < n; s++) {
            const char *ks = k + slot(anc, beam, s) * row_bytes;
            f8 a = SPLAT(0.0f);
            for (int i = 0; i < dh; i += 16)
                a = dot16_bf16(a, q, ks, i);
            w[s] = hsum8(a) * scale;
        }
    }
#endif
    /* the scores, four positions at a time: four independent sums */
    for (; s + 4 <= n; s += 4) {
        const char *k0 = k + slot(anc, beam, s) * row_bytes, *k1 = k + slot(anc, beam, s + 1) * row_bytes;
        const char *k2 = k + slot(anc, beam, s + 2) * row_bytes, *k3 = k + slot(anc, beam, s + 3) * row_bytes;
        f8 a0 = qv[0] * load8(k0, 0, bf16), a1 = qv[0] * load8(k1, 0, bf16);
        f8 a2 = qv[0] * load8(k2, 0, bf16), a3 = qv[0] * load8(k3, 0, bf16);
        for (int i = 1; i < nv; i++) {
            a0 += qv[i] * load8(k0, 8 * i, bf16);
            a1 += qv[i] * load8(k1, 8 * i, bf16);
            a2 += qv[i] * load8(k2, 8 * i, bf16);
            a3 += qv[i] * load8(k3, 8 * i, bf16);
        }
        w[s] = hsum8(a0), w[s + 1] = hsum8(a1), w[s + 2] = hsum8(a2), w[s + 3] = hsum8(a3);
    }
    for (; s < n; s++) {
        const char *ks = k + slot(anc, beam, s) * row_bytes;
        f8 a = qv[0] * load8(ks, 0, bf16);
        for (int i = 1; i < nv; i++)
            a += qv[i] * load8(ks, 8 * i, bf16);
        w[s] = hsum8(a);
    }
    float top = -INFINITY;
    for (s = 0; s < n; s++) {
        if (keep && !keep[s])
            w[s] = -INFINITY;
        top = w[s] > top ? w[s] : top;
    }
    /* the weights, eight at a time */
    for (s = n; s & 7; s++)
        w[s] = -INFINITY;
    f8 sums = SPLAT(0.0f);
    for (s = 0; s < n; s += 8) {
        const f8 e = exp8(load8(w, s, 0) - SPLAT(top));
        memcpy(w + s, &e, sizeof e);
        sums += e;
    }
    /* the weighted sum of the values */
    for (int i = 0; i < nv; i++)
        acc[i] = SPLAT(0.0f);
    for (s = 0; s < n; s++) {
        if (w[s] == 0.f)
            continue;
        const char *vs = v + slot(anc, beam, s) * row_bytes;
        const f8 p = SPLAT(w[s]);
        for (int i = 0; i < nv; i++)
            acc[i] += p * load8(vs, 8 * i, bf16);
    }
    const f8 inv = SPLAT(1.f / hsum8(sums));
    for (int i = 0; i < nv; i++) {
        f8 o = acc[i] * inv;
        if (bf16)
            for (int j = 0; j < 8; j++)
                ((uint16_t *)out)[8 * i + j] = to_bf16(o[j]);
        else
            memcpy((float *)out + 8 * i, &o, sizeof o);
    }
}

#define ARGS                                                                                                     \
    const void *q, int64_t q_rs, void *keys, void *values, int64_t slots, const int64_t *live, int per,          \
        const int32_t *anc, int64_t anc_stride, int anc_mult, int beam, const uint8_t *keep, const void *new_k,  \
        const void *new_v, int64_t new_rs, int64_t pos, const int64_t *positions, int rows, int heads, int dh,    \
        int n, float scale, void *out, int threads
#define PASS q, q_rs, keys, values, slots, live, per, anc, anc_stride, anc_mult, beam, keep, new_k, new_v, new_rs, \
             pos, positions, rows, heads, dh, n, scale, out, threads

/* row r, head h */
static inline __attribute__((always_inline)) void step_pair(ARGS, int r, int h, int bf16)
{
    (void)rows, (void)threads;
    const int64_t esz = bf16 ? 2 : 4, row_bytes = dh * esz;
    const int64_t sent = live ? live[r / per] : r / per;
    if (positions) { /* this sentence's own step */
        pos = positions[sent];
        n = (int)pos + 1;
    }
    float w[n + 8];
    char *k = (char *)keys + (sent * heads + h) * slots * row_bytes;
    char *v = (char *)values + (sent * heads + h) * slots * row_bytes;
    if (new_k) {
        const int64_t slot = pos * beam + r % per;
        memcpy(k + slot * row_bytes, (const char *)new_k + (r * new_rs + h * dh) * esz, row_bytes);
        memcpy(v + slot * row_bytes, (const char *)new_v + (r * new_rs + h * dh) * esz, row_bytes);
    }
    const char *qr = (const char *)q + (r * q_rs + h * dh) * esz;
    const int32_t *a = anc ? anc + (int64_t)r * anc_mult * anc_stride : 0;
    const uint8_t *kp = keep ? keep + sent * n : 0;
    char *o = (char *)out + ((int64_t)r * heads + h) * row_bytes;
    if (dh == 64) /* every model of the paper: the sums stay in registers */
        attend_one(qr, k, v, a, beam, kp, n, 8, scale, o, w, bf16);
    else
        attend_one(qr, k, v, a, beam, kp, n, dh / 8, scale, o, w, bf16);
}

/* one function per dtype, each with its own parallel loop, so that the compiler specializes each body (a loop
   in a shared inline function would be outlined once, with the dtype a run-time flag) */
#define DEFINE_STEP_ATTENTION(NAME, BF16)                                                                        \
    void NAME(ARGS)                                                                                              \
    {                                                                                                            \
        _Pragma("omp parallel for collapse(2) schedule(static) num_threads(threads) if (threads > 1)")           \
        for (int r = 0; r < rows; r++)                                                                           \
            for (int h = 0; h < heads; h++)                                                                      \
                step_pair(PASS, r, h, BF16);                                                                     \
    }

DEFINE_STEP_ATTENTION(step_attention_f32, 0)
DEFINE_STEP_ATTENTION(step_attention_bf16, 1)
int step_attention_max_dh(void) { return MAX_DH; }
