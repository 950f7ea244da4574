# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""The compiled Freivalds check: a thin shell that hands validated arrays to probe_impl.c."""

cimport numpy as cnp
from libc.stddef cimport ptrdiff_t

cnp.import_array()

cdef extern from "probe_impl.h" nogil:
    ctypedef struct th_verdict:
        int ok
        int nonfinite
        ptrdiff_t row
        int round_no
        double residual
        double bound
        double ratio
    int th_freivalds(const float *a, const float *b, const float *c, ptrdiff_t m, ptrdiff_t n,
                     ptrdiff_t k, int trans_a, int trans_b, const unsigned char *bits, int r,
                     double cz, double c0, th_verdict *out)
    const char *th_probe_kernel_name()
    int th_probe_force_kernel(const char *name)


def freivalds(cnp.ndarray a, cnp.ndarray b, cnp.ndarray c, bint trans_a, bint trans_b,
              bytes bits, int rounds, double cz, double c0):
    """(ok, nonfinite, row, round, residual, bound, ratio) of the check, without the GIL.

    The arguments must already have been checked by validation.freivalds: C-contiguous
    float32 matrices of matching shapes, rounds >= 1, and rounds * n probe bits. (Raw
    pointers rather than memoryviews: this call is on the validator's hot path.)
    """
    cdef ptrdiff_t m = c.shape[0]
    cdef ptrdiff_t n = c.shape[1]
    cdef ptrdiff_t k = a.shape[0] if trans_a else a.shape[1]
    cdef const float *ap = <const float *>cnp.PyArray_DATA(a)
    cdef const float *bp = <const float *>cnp.PyArray_DATA(b)
    cdef const float *cp = <const float *>cnp.PyArray_DATA(c)
    cdef const unsigned char *bitp = bits
    cdef th_verdict v
    cdef int status
    with nogil:
        status = th_freivalds(ap, bp, cp, m, n, k, trans_a, trans_b, bitp, rounds, cz, c0, &v)
    if status != 0:
        raise MemoryError("tilehive freivalds: could not allocate its work space")
    return (bool(v.ok), v.nonfinite, v.row, v.round_no, v.residual, v.bound, v.ratio)


def kernel_name():
    """The variant this CPU runs: "avx512", "avx2" or "generic"."""
    return th_probe_kernel_name().decode()


def force_kernel(str name):
    """Run every later check on the named variant (tests compare them bit for bit)."""
    if th_probe_force_kernel(name.encode()) != 0:
        raise ValueError(f"probe kernel {name!r} is unknown or not supported by this CPU")
