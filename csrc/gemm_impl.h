/* Deterministic blocked sgemm: C[rows] = op(A)[rows, :] @ op(B), one fixed FMA order per element. */
#ifndef TILEHIVE_GEMM_IMPL_H
#define TILEHIVE_GEMM_IMPL_H

#include <stddef.h>

/* A matrix operand in memory: element (r, c) is at data[r * rs + c * cs]. */
typedef struct {
    const float *data;
    ptrdiff_t rs;
    ptrdiff_t cs;
} th_operand;

/*
 * Compute rows [m0, m1) of C = op(A) @ op(B), where op(A) is m x k and op(B) is k x n.
 * C row r starts at c + r * ldc.  Every C[i][j] is acc_0 = +0.0f,
 * acc_{p+1} = fmaf(opA[i][p], opB[p][j], acc_p) for p = 0 .. k-1, and any NaN result is
 * written as the canonical quiet NaN 0x7fc00000.  `work` is scratch for packed panels of at
 * least th_workspace_floats(n) floats, one per concurrent caller.  Returns 0, or -1 if the
 * workspace is too small.  Safe to call from several threads at once on disjoint row ranges
 * with separate workspaces; never touches Python.
 */
int th_sgemm_rows(th_operand a, th_operand b, float *c, ptrdiff_t ldc,
                  ptrdiff_t m0, ptrdiff_t m1, ptrdiff_t n, ptrdiff_t k,
                  float *work, size_t work_floats);

/* Scratch floats th_sgemm_rows needs for an output n columns wide. */
size_t th_workspace_floats(ptrdiff_t n);

/* The name of the micro-kernel this CPU runs ("avx512", "avx2", "generic"). */
const char *th_kernel_name(void);

/* Rows per micro-tile of that kernel: thread row ranges are aligned to it. */
int th_kernel_mr(void);

/* Force a kernel by name (for tests); returns 0, or -1 if unknown or unsupported here. */
int th_force_kernel(const char *name);

#endif
