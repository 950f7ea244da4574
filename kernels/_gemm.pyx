# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""The compiled deterministic sgemm: a thin shell that hands validated arrays to gemm_impl.c."""

import threading

import numpy as np

# Packing scratch per thread, kept between calls: a fresh multi-megabyte buffer per call
# costs page faults that show up in small products.
_scratch = threading.local()


cdef float[::1] workspace(ptrdiff_t n):
    cdef size_t need = th_workspace_floats(n)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.shape[0] < need:
        buf = np.empty(need, dtype=np.float32)
        _scratch.buf = buf
    return buf

from libc.stddef cimport ptrdiff_t

cdef extern from "gemm_impl.h" nogil:
    ctypedef struct th_operand:
        const float *data
        ptrdiff_t rs
        ptrdiff_t cs
    int th_sgemm_rows(th_operand a, th_operand b, float *c, ptrdiff_t ldc,
                      ptrdiff_t m0, ptrdiff_t m1, ptrdiff_t n, ptrdiff_t k,
                      float *work, size_t work_floats)
    size_t th_workspace_floats(ptrdiff_t n)
    const char *th_kernel_name()
    int th_kernel_mr()
    int th_force_kernel(const char *name)


def sgemm_rows(a, b, out, bint trans_a, bint trans_b, Py_ssize_t m0, Py_ssize_t m1):
    """Rows [m0, m1) of out = op(a) @ op(b), without the GIL.

    The arguments must already have been checked by kernels.checks.check_gemm_args:
    float32, C-contiguous operands, an out whose rows are contiguous, matching shapes.
    """
    cdef const float[:, ::1] av = a
    cdef const float[:, ::1] bv = b
    cdef float[:, :] cv = out
    cdef ptrdiff_t m = cv.shape[0]
    cdef ptrdiff_t n = cv.shape[1]
    cdef ptrdiff_t k = av.shape[0] if trans_a else av.shape[1]
    cdef th_operand opa
    cdef th_operand opb
    cdef int status
    cdef float[::1] work
    if m1 <= m0 or n == 0:
        return
    opa.data = &av[0, 0] if k > 0 else NULL
    opb.data = &bv[0, 0] if k > 0 else NULL
    if trans_a:
        opa.rs, opa.cs = 1, m
    else:
        opa.rs, opa.cs = k, 1
    if trans_b:
        opb.rs, opb.cs = 1, k
    else:
        opb.rs, opb.cs = n, 1
    cdef ptrdiff_t ldc = cv.strides[0] // sizeof(float)
    work = workspace(n)
    with nogil:
        status = th_sgemm_rows(opa, opb, &cv[0, 0], ldc, m0, m1, n, k,
                               &work[0], work.shape[0])
    if status != 0:
        raise RuntimeError("tilehive gemm: packing workspace too small (a bug)")


def kernel_name():
    """The micro-kernel this CPU runs: "avx512", "avx2" or "generic"."""
    return th_kernel_name().decode()


def kernel_mr():
    """Rows per micro-tile of the active kernel; thread row splits align to it."""
    return th_kernel_mr()


def force_kernel(str name):
    """Run every later product on the named micro-kernel (tests compare them bit for bit)."""
    if th_force_kernel(name.encode()) != 0:
        raise ValueError(f"kernel {name!r} is unknown or not supported by this CPU")


def sgemm_batch(a, b, out, bint trans_a, bint trans_b, Py_ssize_t g0, Py_ssize_t g1):
    """out[g] = op(a[g]) @ op(b[g]) for g in [g0, g1), without the GIL.

    Each product is exactly sgemm_rows over all its rows, so a batch has the bits of the
    same products made one at a time. The arguments must already have been checked by
    kernels.gemm.batched_gemm: C-contiguous float32 3-D arrays of matching shapes.
    """
    cdef const float[:, :, ::1] av = a
    cdef const float[:, :, ::1] bv = b
    cdef float[:, :, ::1] cv = out
    cdef ptrdiff_t m = cv.shape[1]
    cdef ptrdiff_t n = cv.shape[2]
    cdef ptrdiff_t k = av.shape[1] if trans_a else av.shape[2]
    cdef th_operand opa
    cdef th_operand opb
    cdef int status = 0
    cdef ptrdiff_t g
    cdef float[::1] work
    if g1 <= g0 or m == 0 or n == 0:
        return
    if trans_a:
        opa.rs, opa.cs = 1, m
    else:
        opa.rs, opa.cs = k, 1
    if trans_b:
        opb.rs, opb.cs = 1, k
    else:
        opb.rs, opb.cs = n, 1
    work = workspace(n)
    with nogil:
        for g in range(g0, g1):
            opa.data = &av[g, 0, 0] if k > 0 else NULL
            opb.data = &bv[g, 0, 0] if k > 0 else NULL
            status = th_sgemm_rows(opa, opb, &cv[g, 0, 0], n, 0, m, n, k,
                                   &work[0], work.shape[0])
            if status != 0:
                break
    if status != 0:
        raise RuntimeError("tilehive gemm: packing workspace too small (a bug)")
