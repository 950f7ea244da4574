# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""The compiled model kernels: a thin shell that hands checked arrays to nn_impl.c.

Every function takes a range of rows (or elements, or columns) so kernels.nn can split a call
across threads; the GIL is released while the C runs. Arguments must already have been
checked by kernels.nn (float32, C-contiguous, matching shapes, non-empty ranges).
"""

from libc.stddef cimport ptrdiff_t
from libc.stdint cimport int64_t

cdef extern from "nn_impl.h" nogil:
    ctypedef struct thn_adam:
        float scale
        float beta1
        float one_minus_beta1
        float beta2
        float one_minus_beta2
        float correction1
        float correction2
        float eps
        float lr
        float weight_decay
    void thn_gelu_fwd(float *x, const float *bias, float *y, float *t, ptrdiff_t r0,
                      ptrdiff_t r1, ptrdiff_t n)
    void thn_gelu_bwd(const float *dy, const float *x, const float *t, float *dx,
                      ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n)
    void thn_layernorm_fwd(const float *x, const float *g, const float *b, float eps,
                           float *y, float *xhat, float *inv, ptrdiff_t r0, ptrdiff_t r1,
                           ptrdiff_t n)
    void thn_layernorm_bwd(const float *dy, const float *xhat, const float *inv,
                           const float *g, float *dx, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n)
    void thn_colsum(const float *a, const float *b, float *out, ptrdiff_t rows,
                    ptrdiff_t cols, ptrdiff_t c0, ptrdiff_t c1)
    void thn_add_bias(float *x, const float *bias, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n)
    void thn_softmax_fwd(const float *s, float scale, int causal, float *p, ptrdiff_t r0,
                         ptrdiff_t r1, ptrdiff_t n)
    void thn_softmax_bwd(const float *p, const float *dp, float scale, int causal, float *ds,
                         ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n)
    void thn_cross_entropy(const float *logits, const int64_t *targets, float count,
                           float *loss, float *dlogits, ptrdiff_t r0, ptrdiff_t r1,
                           ptrdiff_t n)
    float thn_sum(const float *x, ptrdiff_t n)
    double thn_sumsq(const float *x, ptrdiff_t n)
    void thn_adamw(const float *p, const float *g, const float *m, const float *v,
                   float *p_out, float *m_out, float *v_out, ptrdiff_t e0, ptrdiff_t e1,
                   const thn_adam *h, int decay)
    const char *thn_kernel_name()
    int thn_force_kernel(const char *name)


cdef inline float *wptr(x) except NULL:
    cdef float[::1] v = x.reshape(-1)
    return &v[0]


cdef inline const float *rptr(x) except NULL:
    cdef const float[::1] v = x.reshape(-1)
    return &v[0]


def gelu_fwd(x, bias, y, t, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t n):
    cdef float *xp = wptr(x)
    cdef const float *bp = NULL if bias is None else rptr(bias)
    cdef float *yp = wptr(y)
    cdef float *tp = wptr(t)
    with nogil:
        thn_gelu_fwd(xp, bp, yp, tp, r0, r1, n)


def gelu_bwd(dy, x, t, dx, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t n):
    cdef const float *dyp = rptr(dy)
    cdef const float *xp = rptr(x)
    cdef const float *tp = rptr(t)
    cdef float *dxp = wptr(dx)
    with nogil:
        thn_gelu_bwd(dyp, xp, tp, dxp, r0, r1, n)


def layernorm_fwd(x, g, b, float eps, y, xhat, inv, Py_ssize_t r0, Py_ssize_t r1,
                  Py_ssize_t n):
    cdef const float *xp = rptr(x)
    cdef const float *gp = rptr(g)
    cdef const float *bp = rptr(b)
    cdef float *yp = wptr(y)
    cdef float *hp = wptr(xhat)
    cdef float *ip = wptr(inv)
    with nogil:
        thn_layernorm_fwd(xp, gp, bp, eps, yp, hp, ip, r0, r1, n)


def layernorm_bwd(dy, xhat, inv, g, dx, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t n):
    cdef const float *dyp = rptr(dy)
    cdef const float *hp = rptr(xhat)
    cdef const float *ip = rptr(inv)
    cdef const float *gp = rptr(g)
    cdef float *dxp = wptr(dx)
    with nogil:
        thn_layernorm_bwd(dyp, hp, ip, gp, dxp, r0, r1, n)


def colsum(a, b, out, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t c0, Py_ssize_t c1):
    cdef const float *ap = rptr(a)
    cdef const float *bp = NULL if b is None else rptr(b)
    cdef float *op = wptr(out)
    with nogil:
        thn_colsum(ap, bp, op, rows, cols, c0, c1)


def add_bias(x, bias, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t n):
    cdef float *xp = wptr(x)
    cdef const float *bp = rptr(bias)
    with nogil:
        thn_add_bias(xp, bp, r0, r1, n)


def softmax_fwd(s, float scale, bint causal, p, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t n):
    cdef const float *sp = rptr(s)
    cdef float *pp = wptr(p)
    with nogil:
        thn_softmax_fwd(sp, scale, causal, pp, r0, r1, n)


def softmax_bwd(p, dp, float scale, bint causal, ds, Py_ssize_t r0, Py_ssize_t r1,
                Py_ssize_t n):
    cdef const float *pp = rptr(p)
    cdef const float *dpp = rptr(dp)
    cdef float *dsp = wptr(ds)
    with nogil:
        thn_softmax_bwd(pp, dpp, scale, causal, dsp, r0, r1, n)


def cross_entropy(logits, targets, float count, loss, dlogits, Py_ssize_t r0, Py_ssize_t r1,
                  Py_ssize_t n):
    cdef const float *lp = rptr(logits)
    cdef const int64_t[::1] tv = targets
    cdef const int64_t *tp = &tv[0]
    cdef float *lossp = wptr(loss)
    cdef float *dp = wptr(dlogits)
    with nogil:
        thn_cross_entropy(lp, tp, count, lossp, dp, r0, r1, n)


def total(x):
    """The lane-ordered sum of a non-empty float32 array (as a float32 value)."""
    cdef const float *xp = rptr(x)
    cdef ptrdiff_t n = x.size
    cdef float s
    with nogil:
        s = thn_sum(xp, n)
    return s


def sumsq(x):
    """sum(x**2) of a non-empty float32 array, in float64 lanes."""
    cdef const float *xp = rptr(x)
    cdef ptrdiff_t n = x.size
    cdef double s
    with nogil:
        s = thn_sumsq(xp, n)
    return s


def adamw(p, g, m, v, p_out, m_out, v_out, Py_ssize_t e0, Py_ssize_t e1, tuple h,
          bint decay):
    """h: (scale, beta1, 1 - beta1, beta2, 1 - beta2, correction1, correction2, eps, lr, wd)."""
    cdef thn_adam c
    (c.scale, c.beta1, c.one_minus_beta1, c.beta2, c.one_minus_beta2, c.correction1,
     c.correction2, c.eps, c.lr, c.weight_decay) = h
    cdef const float *pp = rptr(p)
    cdef const float *gp = rptr(g)
    cdef const float *mp = rptr(m)
    cdef const float *vp = rptr(v)
    cdef float *po = wptr(p_out)
    cdef float *mo = wptr(m_out)
    cdef float *vo = wptr(v_out)
    with nogil:
        thn_adamw(pp, gp, mp, vp, po, mo, vo, e0, e1, &c, decay)


def kernel_name():
    """The copy of the model kernels this CPU runs: "avx512", "avx2" or "generic"."""
    return thn_kernel_name().decode()


def force_kernel(str name):
    """Run every later model kernel on the named copy (tests compare them bit for bit)."""
    if thn_force_kernel(name.encode()) != 0:
        raise ValueError(f"model kernel {name!r} is unknown or not supported by this CPU")
