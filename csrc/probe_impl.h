/* Freivalds check of one float32 tile: probe products in float32, in one fixed order. */
#ifndef TILEHIVE_PROBE_IMPL_H
#define TILEHIVE_PROBE_IMPL_H

#include <stddef.h>

/* Where a check ended up: the worst row and round, or which inputs were not finite. */
typedef struct {
    int ok;            /* 1 iff |R_i^(t)| <= tau_i for every row i and round t */
    int nonfinite;     /* bit 0: a, bit 1: b, bit 2: c held a NaN or infinity, or TH_OVERFLOW
                          alone: the check's float32 sums overflowed (then ok = 0) */
    ptrdiff_t row;     /* row of the largest |R| / tau (first in row, round order); -1: none */
    int round_no;      /* and round */
    double residual;   /* |R_row^(round)| */
    double bound;      /* tau_row */
    double ratio;      /* residual / bound, 0 when the residual is 0 */
} th_verdict;

#define TH_OVERFLOW 8

/*
 * Check C (m x n) against op(A) (m x k) times op(B) (k x n); a, b, c are row-major float32,
 * op(X) is X or, when trans_x, the transpose of X as stored.  bits holds r*n probe bits
 * (little-endian within each byte): bit t*n + j set means x_j^(t) = -1, else +1.
 *
 * Computes in float32 y = op(B) x, w_k = sum_j |op(B)_kj| and Cx, then op(A) y and
 * z_i = sum_k |op(A)_ik| w_k; then, in float64, R = Cx - op(A) y and tau_i = cz * z_i + c0.
 * Every term enters its sum through one fmaf, in this order (docs/validation.md):
 *   over the contiguous index of a row-major operand: 16 partial sums, lane l taking the
 *   terms q = l mod 16 in increasing q from +0.0, combined by halving: lanes l and l+8, then
 *   l and l+4, l and l+2, and the last two;
 *   over the row index (a transposed operand): chunks of 16 rows, each summed in increasing
 *   q from +0.0, the chunk sums added in increasing order to +0.0.
 * Every SIMD variant and the numpy twin in validation/freivalds.py follow it bit for bit.
 * Returns 0, or -1 if memory ran out.  Never touches Python; safe to call from any thread.
 */
int th_freivalds(const float *a, const float *b, const float *c, ptrdiff_t m, ptrdiff_t n,
                 ptrdiff_t k, int trans_a, int trans_b, const unsigned char *bits, int r,
                 double cz, double c0, th_verdict *out);

/* The variant this CPU runs ("avx512", "avx2" or "generic"). */
const char *th_probe_kernel_name(void);

/* Force a variant by name (for tests); returns 0, or -1 if unknown or unsupported here. */
int th_probe_force_kernel(const char *name);

#endif
