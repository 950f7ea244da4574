/* Deterministic model kernels: one arithmetic (nn_body.h), three instruction sets.
 *
 * The same source is compiled for baseline x86-64 / any CPU ("generic"), AVX2 and AVX-512
 * and chosen at run time like the GEMM's micro-kernels; tests check all three bit for bit
 * against each other and against the numpy twin (kernels/nn_reference.py).  exp, tanh and
 * log are our own fixed sequences of float32 operations, never the C library's, so their
 * bits do not depend on the libm of the machine.  Constants are hex literals so the C
 * compiler and Python read exactly the same float32 values.
 */
#include "nn_impl.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define TH_X86 1
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef double v16d __attribute__((vector_size(128)));

#define SPLAT(c) ((v16f){(c), (c), (c), (c), (c), (c), (c), (c), \
                         (c), (c), (c), (c), (c), (c), (c), (c)})

/* Rows per block of a column sum (a fixed constant: the order depends on the shape only). */
#define COLSUM_BLOCK 32

/* exp: clamp range, 1/ln 2, the round-to-integer constant 1.5 * 2^23, ln 2 in two parts,
 * and Cephes expf's polynomial (rounded to float32). */
#define EXP_LO (-0x1.5d589ep+6f)
#define EXP_HI 0x1.6p+6f
#define LOG2E 0x1.715476p+0f
#define MAGIC 0x1.8p+23f
#define MAGIC_BITS 0x4b400000u
#define LN2_HI 0x1.63p-1f
#define LN2_LO (-0x1.bd0106p-13f)
#define EP0 0x1.a0d2cep-13f
#define EP1 0x1.6e879cp-10f
#define EP2 0x1.11121p-7f
#define EP3 0x1.555382p-5f
#define EP4 0x1.555554p-3f
#define EP5 0x1p-1f
/* tanh: Cephes tanhf's polynomial below 0.625, the clamp above which tanh rounds to 1. */
#define TH0 (-0x1.75e1d4p-8f)
#define TH1 0x1.52269cp-6f
#define TH2 (-0x1.b83c5ap-5f)
#define TH3 0x1.110726p-3f
#define TH4 (-0x1.555532p-2f)
#define TH_SMALL 0x1.4p-1f
#define TH_CLAMP 0x1.2p+3f
/* log: Cephes logf's polynomial and sqrt(1/2). */
#define LP0 0x1.204376p-4f
#define LP1 (-0x1.d7a37p-4f)
#define LP2 0x1.de4a34p-4f
#define LP3 (-0x1.fcba9ep-4f)
#define LP4 0x1.23d37ep-3f
#define LP5 (-0x1.555ca0p-3f)
#define LP6 0x1.999d58p-3f
#define LP7 (-0x1.fffff8p-3f)
#define LP8 0x1.555554p-2f
#define SQRTHF 0x1.6a09e6p-1f
/* GELU's tanh approximation: sqrt(2/pi), 0.044715 and 3 * 0.044715. */
#define GELU_C 0x1.988454p-1f
#define GELU_K 0x1.6e4e26p-5f
#define GELU_K3 0x1.12ba9ep-3f

typedef struct {
    const char *name;
    int (*supported)(void);
    void (*gelu_fwd)(float *, const float *, float *, float *, ptrdiff_t, ptrdiff_t,
                     ptrdiff_t);
    void (*gelu_bwd)(const float *, const float *, const float *, float *, ptrdiff_t,
                     ptrdiff_t, ptrdiff_t);
    void (*layernorm_fwd)(const float *, const float *, const float *, float, float *,
                          float *, float *, ptrdiff_t, ptrdiff_t, ptrdiff_t);
    void (*layernorm_bwd)(const float *, const float *, const float *, const float *,
                          float *, ptrdiff_t, ptrdiff_t, ptrdiff_t);
    void (*colsum)(const float *, const float *, float *, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                   ptrdiff_t);
    void (*add_bias)(float *, const float *, ptrdiff_t, ptrdiff_t, ptrdiff_t);
    void (*softmax_fwd)(const float *, float, int, float *, ptrdiff_t, ptrdiff_t, ptrdiff_t);
    void (*softmax_bwd)(const float *, const float *, float, int, float *, ptrdiff_t,
                        ptrdiff_t, ptrdiff_t);
    void (*cross_entropy)(const float *, const int64_t *, float, float *, float *, ptrdiff_t,
                          ptrdiff_t, ptrdiff_t);
    float (*sum)(const float *, ptrdiff_t);
    double (*sumsq)(const float *, ptrdiff_t);
    void (*adamw)(const float *, const float *, const float *, const float *, float *,
                  float *, float *, ptrdiff_t, ptrdiff_t, const thn_adam *, int);
} thn_impl;

/* ---- the generic copy: baseline instructions, any CPU ---- */
static int supported_generic(void) { return 1; }
#define NN(name) name##_generic
#define NN_NAME "generic"
#include "nn_body.h"
#undef NN
#undef NN_NAME

#ifdef TH_X86

#pragma GCC push_options
#pragma GCC target("avx2")
static int supported_avx2(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}
#define NN(name) name##_avx2
#define NN_NAME "avx2"
#define NN_AVX2 1
#include "nn_body.h"
#undef NN
#undef NN_NAME
#undef NN_AVX2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")
static int supported_avx512(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}
#define NN(name) name##_avx512
#define NN_NAME "avx512"
#define NN_AVX512 1
#include "nn_body.h"
#undef NN
#undef NN_NAME
#undef NN_AVX512
#pragma GCC pop_options

#endif /* TH_X86 */

/* Fastest first: the first supported copy is the default. */
static const thn_impl *const thn_impls[] = {
#ifdef TH_X86
    &impl_avx512,
    &impl_avx2,
#endif
    &impl_generic,
};

#define THN_NIMPLS (sizeof(thn_impls) / sizeof(thn_impls[0]))

/* Set once; a racing first call from two threads stores the same pointer. */
static const thn_impl *thn_active = NULL;

static const thn_impl *active(void)
{
    if (thn_active == NULL) {
        for (size_t i = 0; i < THN_NIMPLS; i++) {
            if (thn_impls[i]->supported()) {
                thn_active = thn_impls[i];
                break;
            }
        }
    }
    return thn_active;
}

const char *thn_kernel_name(void) { return active()->name; }

int thn_force_kernel(const char *name)
{
    for (size_t i = 0; i < THN_NIMPLS; i++) {
        if (strcmp(thn_impls[i]->name, name) == 0) {
            if (!thn_impls[i]->supported())
                return -1;
            thn_active = thn_impls[i];
            return 0;
        }
    }
    return -1;
}

void thn_gelu_fwd(float *x, const float *bias, float *y, float *t, ptrdiff_t r0, ptrdiff_t r1,
                  ptrdiff_t n)
{
    active()->gelu_fwd(x, bias, y, t, r0, r1, n);
}

void thn_gelu_bwd(const float *dy, const float *x, const float *t, float *dx, ptrdiff_t r0,
                  ptrdiff_t r1, ptrdiff_t n)
{
    active()->gelu_bwd(dy, x, t, dx, r0, r1, n);
}

void thn_layernorm_fwd(const float *x, const float *g, const float *b, float eps, float *y,
                       float *xhat, float *inv, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n)
{
    active()->layernorm_fwd(x, g, b, eps, y, xhat, inv, r0, r1, n);
}

void thn_layernorm_bwd(const float *dy, const float *xhat, const float *inv, const float *g,
                       float *dx, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n)
{
    active()->layernorm_bwd(dy, xhat, inv, g, dx, r0, r1, n);
}

void thn_colsum(const float *a, const float *b, float *out, ptrdiff_t rows, ptrdiff_t cols,
                ptrdiff_t c0, ptrdiff_t c1)
{
    active()->colsum(a, b, out, rows, cols, c0, c1);
}

void thn_add_bias(float *x, const float *bias, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n)
{
    active()->add_bias(x, bias, r0, r1, n);
}

void thn_softmax_fwd(const float *s, float scale, int causal, float *p, ptrdiff_t r0,
                     ptrdiff_t r1, ptrdiff_t n)
{
    active()->softmax_fwd(s, scale, causal, p, r0, r1, n);
}

void thn_softmax_bwd(const float *p, const float *dp, float scale, int causal, float *ds,
                     ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n)
{
    active()->softmax_bwd(p, dp, scale, causal, ds, r0, r1, n);
}

void thn_cross_entropy(const float *logits, const int64_t *targets, float count, float *loss,
                       float *dlogits, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n)
{
    active()->cross_entropy(logits, targets, count, loss, dlogits, r0, r1, n);
}

float thn_sum(const float *x, ptrdiff_t n) { return active()->sum(x, n); }

double thn_sumsq(const float *x, ptrdiff_t n) { return active()->sumsq(x, n); }

void thn_adamw(const float *p, const float *g, const float *m, const float *v, float *p_out,
               float *m_out, float *v_out, ptrdiff_t e0, ptrdiff_t e1, const thn_adam *h,
               int decay)
{
    active()->adamw(p, g, m, v, p_out, m_out, v_out, e0, e1, h, decay);
}
