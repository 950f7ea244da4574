/* Deterministic blocked sgemm: packing, cache blocking and register-blocked micro-kernels.
 *
 * The order of arithmetic is the contract (docs/kernels.md): each C[i][j] starts at +0.0f and
 * takes one fmaf(opA[i][p], opB[p][j], acc) per p = 0 .. k-1, in increasing p.  Blocking over
 * k (KC) keeps that order because the partial sum is stored as a float32 in C and reloaded
 * unchanged.  SIMD lanes hold different (i, j), never different p, so the vector width, the
 * micro-tile shape, the cache blocks, the thread split and the tile bounds cannot change a bit.
 */
#include "gemm_impl.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define TH_X86 1
#endif

/* Cache blocks: a KC x NR sliver of B stays in L1, an MC x KC block of A in L2, a KC x NC
 * panel of B in L3.  MC is a multiple of every kernel's MR, NC of every NR. */
#ifndef TH_KC
#define TH_KC 384
#endif
#ifndef TH_MC
#define TH_MC 168
#endif
#ifndef TH_NC
#define TH_NC 3072
#endif
#define TH_MAX_MR 14
#define TH_MAX_NR 32

#define TH_CANONICAL_NAN 0x7fc00000u

typedef void (*th_ukernel_fn)(ptrdiff_t kc, const float *Ap, const float *Bp, float *C,
                              ptrdiff_t ldc, int load);

typedef struct {
    const char *name;
    int mr;
    int nr;
    th_ukernel_fn run;
    int (*supported)(void);
} th_kernel;

/* ---- micro-kernels: C[0:MR][0:NR] (+)= Ap (kc x MR, k-major) times Bp (kc x NR) ---- */

#define GENERIC_MR 4
#define GENERIC_NR 8

static void uk_generic(ptrdiff_t kc, const float *restrict Ap, const float *restrict Bp,
                       float *restrict C, ptrdiff_t ldc, int load)
{
    float acc[GENERIC_MR][GENERIC_NR];
    for (int i = 0; i < GENERIC_MR; i++)
        for (int j = 0; j < GENERIC_NR; j++)
            acc[i][j] = load ? C[i * ldc + j] : 0.0f;
    for (ptrdiff_t p = 0; p < kc; p++) {
        const float *a = Ap + p * GENERIC_MR;
        const float *b = Bp + p * GENERIC_NR;
        for (int i = 0; i < GENERIC_MR; i++)
            for (int j = 0; j < GENERIC_NR; j++)
                acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    for (int i = 0; i < GENERIC_MR; i++)
        for (int j = 0; j < GENERIC_NR; j++)
            C[i * ldc + j] = acc[i][j];
}

static int always_supported(void) { return 1; }

#ifdef TH_X86

#define AVX2_MR 6
#define AVX2_NR 16

__attribute__((target("avx2,fma")))
static void uk_avx2(ptrdiff_t kc, const float *restrict Ap, const float *restrict Bp,
                    float *restrict C, ptrdiff_t ldc, int load)
{
    __m256 c0[AVX2_MR], c1[AVX2_MR];
#pragma GCC unroll 16
    for (int i = 0; i < AVX2_MR; i++) {
        c0[i] = load ? _mm256_loadu_ps(C + i * ldc) : _mm256_setzero_ps();
        c1[i] = load ? _mm256_loadu_ps(C + i * ldc + 8) : _mm256_setzero_ps();
    }
    for (ptrdiff_t p = 0; p < kc; p++) {
        const __m256 b0 = _mm256_load_ps(Bp + p * AVX2_NR);
        const __m256 b1 = _mm256_load_ps(Bp + p * AVX2_NR + 8);
#pragma GCC unroll 16
        for (int i = 0; i < AVX2_MR; i++) {
            const __m256 a = _mm256_broadcast_ss(Ap + p * AVX2_MR + i);
            c0[i] = _mm256_fmadd_ps(a, b0, c0[i]);
            c1[i] = _mm256_fmadd_ps(a, b1, c1[i]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < AVX2_MR; i++) {
        _mm256_storeu_ps(C + i * ldc, c0[i]);
        _mm256_storeu_ps(C + i * ldc + 8, c1[i]);
    }
}

__attribute__((target("avx2,fma")))
static int avx2_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

#define AVX512_MR 14
#define AVX512_NR 32

__attribute__((target("avx512f")))
static void uk_avx512(ptrdiff_t kc, const float *restrict Ap, const float *restrict Bp,
                      float *restrict C, ptrdiff_t ldc, int load)
{
    __m512 c0[AVX512_MR], c1[AVX512_MR];
#pragma GCC unroll 16
    for (int i = 0; i < AVX512_MR; i++) {
        c0[i] = load ? _mm512_loadu_ps(C + i * ldc) : _mm512_setzero_ps();
        c1[i] = load ? _mm512_loadu_ps(C + i * ldc + 16) : _mm512_setzero_ps();
    }
    for (ptrdiff_t p = 0; p < kc; p++) {
        const __m512 b0 = _mm512_load_ps(Bp + p * AVX512_NR);
        const __m512 b1 = _mm512_load_ps(Bp + p * AVX512_NR + 16);
#pragma GCC unroll 16
        for (int i = 0; i < AVX512_MR; i++) {
            const __m512 a = _mm512_set1_ps(Ap[p * AVX512_MR + i]);
            c0[i] = _mm512_fmadd_ps(a, b0, c0[i]);
            c1[i] = _mm512_fmadd_ps(a, b1, c1[i]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < AVX512_MR; i++) {
        _mm512_storeu_ps(C + i * ldc, c0[i]);
        _mm512_storeu_ps(C + i * ldc + 16, c1[i]);
    }
}

static int avx512_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

#endif /* TH_X86 */

/* Fastest first: the first supported kernel is the default. */
static const th_kernel th_kernels[] = {
#ifdef TH_X86
    {"avx512", AVX512_MR, AVX512_NR, uk_avx512, avx512_supported},
    {"avx2", AVX2_MR, AVX2_NR, uk_avx2, avx2_supported},
#endif
    {"generic", GENERIC_MR, GENERIC_NR, uk_generic, always_supported},
};

#define TH_NKERNELS (sizeof(th_kernels) / sizeof(th_kernels[0]))

/* Set once; a racing first call from two threads stores the same pointer. */
static const th_kernel *th_active_kernel = NULL;

static const th_kernel *active(void)
{
    if (th_active_kernel == NULL) {
        for (size_t i = 0; i < TH_NKERNELS; i++) {
            if (th_kernels[i].supported()) {
                th_active_kernel = &th_kernels[i];
                break;
            }
        }
    }
    return th_active_kernel;
}

const char *th_kernel_name(void) { return active()->name; }

int th_kernel_mr(void) { return active()->mr; }

int th_force_kernel(const char *name)
{
    for (size_t i = 0; i < TH_NKERNELS; i++) {
        if (strcmp(th_kernels[i].name, name) == 0) {
            if (!th_kernels[i].supported())
                return -1;
            th_active_kernel = &th_kernels[i];
            return 0;
        }
    }
    return -1;
}

/* ---- packing: copy a block of op(A) / op(B) into the layout the micro-kernel streams ---- */

static inline ptrdiff_t min_idx(ptrdiff_t x, ptrdiff_t y) { return x < y ? x : y; }

/* Rows [i0, i0+mc) x cols [p0, p0+kc) of op(A) as ceil(mc/mr) panels of kc x mr, zero-padded.
 * The loop order follows the operand's unit stride so the reads stream. */
static void pack_a(th_operand a, ptrdiff_t i0, ptrdiff_t mc, ptrdiff_t p0, ptrdiff_t kc, int mr,
                   float *restrict Ap)
{
    for (ptrdiff_t ir = 0; ir < mc; ir += mr) {
        const ptrdiff_t rows = min_idx(mr, mc - ir);
        float *dst = Ap + ir * kc;
        const float *src = a.data + (i0 + ir) * a.rs + p0 * a.cs;
        if (a.rs == 1) {
            for (ptrdiff_t p = 0; p < kc; p++) {
                memcpy(dst + p * mr, src + p * a.cs, (size_t)rows * sizeof(float));
                for (ptrdiff_t ii = rows; ii < mr; ii++)
                    dst[p * mr + ii] = 0.0f;
            }
        } else {
            for (ptrdiff_t ii = 0; ii < rows; ii++)
                for (ptrdiff_t p = 0; p < kc; p++)
                    dst[p * mr + ii] = src[ii * a.rs + p * a.cs];
            for (ptrdiff_t ii = rows; ii < mr; ii++)
                for (ptrdiff_t p = 0; p < kc; p++)
                    dst[p * mr + ii] = 0.0f;
        }
    }
}

/* Rows [p0, p0+kc) x cols [j0, j0+nc) of op(B) as ceil(nc/nr) panels of kc x nr, zero-padded. */
static void pack_b(th_operand b, ptrdiff_t p0, ptrdiff_t kc, ptrdiff_t j0, ptrdiff_t nc, int nr,
                   float *restrict Bp)
{
    for (ptrdiff_t jr = 0; jr < nc; jr += nr) {
        const ptrdiff_t cols = min_idx(nr, nc - jr);
        float *dst = Bp + jr * kc;
        if (b.cs == 1) {
            for (ptrdiff_t p = 0; p < kc; p++) {
                const float *src = b.data + (p0 + p) * b.rs + (j0 + jr);
                memcpy(dst + p * nr, src, (size_t)cols * sizeof(float));
                for (ptrdiff_t jj = cols; jj < nr; jj++)
                    dst[p * nr + jj] = 0.0f;
            }
        } else {
            /* A step of k at a time, its nr floats stored side by side, rather than one
             * column at a time with a store every nr-th float (docs/kernels.md). */
            const float *src = b.data + p0 * b.rs + (j0 + jr) * b.cs;
            for (ptrdiff_t p = 0; p < kc; p++) {
                const float *row = src + p * b.rs;
                float *out = dst + p * nr;
                for (ptrdiff_t jj = 0; jj < cols; jj++)
                    out[jj] = row[jj * b.cs];
                for (ptrdiff_t jj = cols; jj < nr; jj++)
                    out[jj] = 0.0f;
            }
        }
    }
}

/* A micro-tile at the edge of C goes through a full-size scratch tile, so the micro-kernel
 * never reads or writes outside C; the padded lanes compute on zeros and are dropped. */
static void edge_tile(const th_kernel *kr, ptrdiff_t kc, const float *Ap, const float *Bp,
                      float *C, ptrdiff_t ldc, ptrdiff_t rows, ptrdiff_t cols, int load)
{
    float tmp[TH_MAX_MR * TH_MAX_NR] __attribute__((aligned(64)));
    memset(tmp, 0, sizeof(tmp));
    if (load)
        for (ptrdiff_t i = 0; i < rows; i++)
            memcpy(tmp + i * kr->nr, C + i * ldc, (size_t)cols * sizeof(float));
    kr->run(kc, Ap, Bp, tmp, kr->nr, load);
    for (ptrdiff_t i = 0; i < rows; i++)
        memcpy(C + i * ldc, tmp + i * kr->nr, (size_t)cols * sizeof(float));
}

/* On the bits, without a branch, so that the compiler vectorizes it: a float compare and
 * a store per NaN was a seventh of a small product's time. A NaN is an all-ones exponent
 * with a nonzero mantissa, whatever its sign. */
typedef uint32_t __attribute__((may_alias)) th_bits;

static void canonicalize_nans(float *c, ptrdiff_t ldc, ptrdiff_t m0, ptrdiff_t m1, ptrdiff_t n)
{
    for (ptrdiff_t i = m0; i < m1; i++) {
        th_bits *row = (th_bits *)(c + i * ldc);
        for (ptrdiff_t j = 0; j < n; j++) {
            const uint32_t v = row[j];
            row[j] = (v & 0x7fffffffu) > 0x7f800000u ? TH_CANONICAL_NAN : v;
        }
    }
}

static ptrdiff_t panel_floats(ptrdiff_t n, int nr)
{
    return min_idx(TH_NC, (n + nr - 1) / nr * nr) * TH_KC;
}

size_t th_workspace_floats(ptrdiff_t n)
{
    ptrdiff_t widest = 0;
    for (size_t i = 0; i < TH_NKERNELS; i++) {
        const ptrdiff_t need = panel_floats(n, th_kernels[i].nr);
        widest = need > widest ? need : widest;
    }
    /* packed A, packed B, and 64 bytes of slack to align each */
    return (size_t)(TH_MC * TH_KC + widest + 32);
}

static float *align64(float *p)
{
    return (float *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
}

int th_sgemm_rows(th_operand a, th_operand b, float *c, ptrdiff_t ldc, ptrdiff_t m0,
                  ptrdiff_t m1, ptrdiff_t n, ptrdiff_t k, float *work, size_t work_floats)
{
    if (m1 <= m0 || n <= 0)
        return 0;
    if (k == 0) {
        for (ptrdiff_t i = m0; i < m1; i++)
            memset(c + i * ldc, 0, (size_t)n * sizeof(float));
        return 0;
    }
    const th_kernel *kr = active();
    const int mr = kr->mr, nr = kr->nr;
    if (work == NULL || work_floats < th_workspace_floats(n))
        return -1;
    float *Ap = align64(work);
    float *Bp = align64(Ap + TH_MC * TH_KC);
    for (ptrdiff_t jc = 0; jc < n; jc += TH_NC) {
        const ptrdiff_t nc = min_idx(TH_NC, n - jc);
        for (ptrdiff_t pc = 0; pc < k; pc += TH_KC) {
            const ptrdiff_t kc = min_idx(TH_KC, k - pc);
            const int load = pc > 0;
            pack_b(b, pc, kc, jc, nc, nr, Bp);
            for (ptrdiff_t ic = m0; ic < m1; ic += TH_MC) {
                const ptrdiff_t mc = min_idx(TH_MC, m1 - ic);
                pack_a(a, ic, mc, pc, kc, mr, Ap);
                for (ptrdiff_t jr = 0; jr < nc; jr += nr) {
                    const ptrdiff_t cols = min_idx(nr, nc - jr);
                    for (ptrdiff_t ir = 0; ir < mc; ir += mr) {
                        const ptrdiff_t rows = min_idx(mr, mc - ir);
                        float *ct = c + (ic + ir) * ldc + jc + jr;
                        if (rows == mr && cols == nr)
                            kr->run(kc, Ap + ir * kc, Bp + jr * kc, ct, ldc, load);
                        else
                            edge_tile(kr, kc, Ap + ir * kc, Bp + jr * kc, ct, ldc, rows, cols,
                                      load);
                    }
                }
            }
        }
    }
    canonicalize_nans(c, ldc, m0, m1, n);
    return 0;
}
