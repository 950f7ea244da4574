/* Deterministic float32 model kernels of tiny-gpt (everything but the GEMM).
 *
 * Every function works on a range of rows [r0, r1) (or elements [e0, e1), or columns
 * [c0, c1) for the column sums) of C-contiguous float32 arrays, so the caller can split the
 * work across threads: a row, element or column is always computed by one call, in an order
 * of arithmetic fixed by the shapes alone (docs/kernels.md, "Model kernels").
 */
#ifndef TILEHIVE_NN_IMPL_H
#define TILEHIVE_NN_IMPL_H

#include <stddef.h>
#include <stdint.h>

/* AdamW's scalars for one step, all float32 as the update uses them. */
typedef struct {
    float scale; /* gradient clipping factor, 1 when not clipping */
    float beta1, one_minus_beta1;
    float beta2, one_minus_beta2;
    float correction1, correction2;
    float eps, lr, weight_decay;
} thn_adam;

/* x (rows x n) += bias (may be NULL); y = gelu(x); t = tanh(c (x + k x^3)) for backward. */
void thn_gelu_fwd(float *x, const float *bias, float *y, float *t, ptrdiff_t r0, ptrdiff_t r1,
                  ptrdiff_t n);
/* dx = dy * gelu'(x), from the x and t of the forward pass. */
void thn_gelu_bwd(const float *dy, const float *x, const float *t, float *dx, ptrdiff_t r0,
                  ptrdiff_t r1, ptrdiff_t n);

/* y = xhat * g + b with xhat = (x - mean) / sqrt(var + eps), per row; keeps xhat and inv. */
void thn_layernorm_fwd(const float *x, const float *g, const float *b, float eps, float *y,
                       float *xhat, float *inv, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n);
/* dx of layernorm per row, from dy and the forward pass's xhat and inv. */
void thn_layernorm_bwd(const float *dy, const float *xhat, const float *inv, const float *g,
                       float *dx, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n);

/* out[c] = sum over rows of a[r][c] (times b[r][c] when b is not NULL), c in [c0, c1). */
void thn_colsum(const float *a, const float *b, float *out, ptrdiff_t rows, ptrdiff_t cols,
                ptrdiff_t c0, ptrdiff_t c1);

/* x (rows x n) += bias, in place. */
void thn_add_bias(float *x, const float *bias, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n);

/* p = softmax(s * scale) per row of n; causal: row r sees columns 0 .. r mod n only. */
void thn_softmax_fwd(const float *s, float scale, int causal, float *p, ptrdiff_t r0,
                     ptrdiff_t r1, ptrdiff_t n);
/* ds = p * (dp - sum(dp * p)) * scale per row (the gradient of thn_softmax_fwd). */
void thn_softmax_bwd(const float *p, const float *dp, float scale, int causal, float *ds,
                     ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n);

/* Per row: loss[r] = -log softmax(logits)[target], dlogits = (softmax - onehot) / count. */
void thn_cross_entropy(const float *logits, const int64_t *targets, float count, float *loss,
                       float *dlogits, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n);

/* The row sum of x[0 .. n) in the lane order of every row reduction. */
float thn_sum(const float *x, ptrdiff_t n);
/* sum of x[i]^2 over [0, n), in float64 lanes (squares of float32 are exact in float64). */
double thn_sumsq(const float *x, ptrdiff_t n);

/* One AdamW update of elements [e0, e1): new p, m, v from the old ones and the gradient. */
void thn_adamw(const float *p, const float *g, const float *m, const float *v, float *p_out,
               float *m_out, float *v_out, ptrdiff_t e0, ptrdiff_t e1, const thn_adam *h,
               int decay);

const char *thn_kernel_name(void);
int thn_force_kernel(const char *name);

#endif
