/* Freivalds check of a float32 tile: one pass over each operand, float64 sums in a fixed order.
 *
 * A pass over the P x Q matrix op(M) computes, for the probe rounds t < r,
 *     out[p*r + t] = sum_q op(M)[p][q] * x[q*r + t]
 *     sums[p]      = sum_q |op(M)[p][q]| * w[q]        (when sums is not NULL)
 * Every product is exact in float64 (M is float32; x and w carry at most 24 significant bits),
 * so a sum's bits depend on the order of its additions alone, and that order is fixed
 * (probe_impl.h).  SIMD lanes hold different partial sums, never parts of one, so the vector
 * width, the number of rounds per sweep and the machine cannot change a bit.
 */
#include "probe_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define TH_X86 1
#endif

#define TH_LANES 8 /* partial sums over the contiguous index of a row-major operand */
#define TH_RC 8    /* rounds per sweep over a matrix: their sums stay in registers */

/* op(M) is P x Q: M is stored P x Q row-major, or Q x P when trans. */
typedef struct {
    const float *m;
    ptrdiff_t p;
    ptrdiff_t q;
    int trans;
    const float *next; /* the matrix the check reads next (prefetched near the end), or NULL */
    ptrdiff_t next_len; /* its length in floats */
} th_matrix;

/* One pass.  x is Q x r (row q holds round 0..r-1), w has Q entries, out is P x r, sums has P.
 * xt is scratch: TH_RC * ceil8(Q) doubles for the probes, or ceil32(P) * (TH_RC + 1) for sums. */
typedef void (*th_pass_fn)(th_matrix mt, const double *x, int r, const double *w, double *out,
                           double *sums, double *xt);

static inline ptrdiff_t min_idx(ptrdiff_t x, ptrdiff_t y) { return x < y ? x : y; }

static inline ptrdiff_t ceil8(ptrdiff_t x) { return (x + TH_LANES - 1) / TH_LANES * TH_LANES; }

/* ---- generic C: the order spelled out, one sum at a time ---- */

static double combine_lanes(const double *s)
{
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

/* Outputs [p0, p1) of a transposed operand: each (p, t) sums in increasing q. */
static void cols_generic(th_matrix mt, ptrdiff_t p0, ptrdiff_t p1, const double *x, int r,
                         const double *w, double *out, double *sums)
{
    for (ptrdiff_t p = p0; p < p1; p++) {
        for (int t = 0; t < r; t++)
            out[p * r + t] = 0.0;
        if (sums)
            sums[p] = 0.0;
    }
    for (ptrdiff_t q = 0; q < mt.q; q++) {
        const float *row = mt.m + q * mt.p;
        for (ptrdiff_t p = p0; p < p1; p++) {
            const double v = row[p];
            for (int t = 0; t < r; t++)
                out[p * r + t] += v * x[q * r + t];
            if (sums)
                sums[p] += fabs(v) * w[q];
        }
    }
}

static void pass_generic(th_matrix mt, const double *x, int r, const double *w, double *out,
                         double *sums, double *xt)
{
    (void)xt;
    if (mt.trans) {
        cols_generic(mt, 0, mt.p, x, r, w, out, sums);
        return;
    }
    for (ptrdiff_t p = 0; p < mt.p; p++) {
        const float *row = mt.m + p * mt.q;
        for (int t = 0; t < r + (sums != NULL); t++) { /* t == r: the sum of |op(M)| w */
            double lane[TH_LANES] = {0};
            for (ptrdiff_t q = 0; q < mt.q; q++) {
                const double v = row[q];
                lane[q % TH_LANES] += t < r ? v * x[q * r + t] : fabs(v) * w[q];
            }
            if (t < r)
                out[p * r + t] = combine_lanes(lane);
            else
                sums[p] = combine_lanes(lane);
        }
    }
}

static int always_supported(void) { return 1; }

#ifdef TH_X86

/* Rounds [t0, t0+rc) of x (Q x r) regrouped for the SIMD row sweeps: block by block of 8
 * terms, each round's 8 probes contiguous, zero past the end. */
static void pack_probes(const double *x, ptrdiff_t Q, int r, int t0, int rc, double *xt)
{
    for (ptrdiff_t q = 0; q < ceil8(Q); q++)
        for (int t = 0; t < rc; t++)
            xt[(q / TH_LANES * rc + t) * TH_LANES + q % TH_LANES] = q < Q ? x[q * r + t0 + t] : 0.0;
}

/* Software prefetch.  A row sweep reads several rows at once (each 2 KiB at 512 wide), a
 * column sweep strides down the matrix, and the hardware prefetchers, which stop at every
 * 4 KiB page, left a check whose operands were not in cache waiting on memory: twice as slow
 * as with this prefetch at 512^3 (docs/performance.md).  Each sweep prefetches what it will
 * read th_lead(floats) steps later, where a step reads `floats` values: at least
 * TH_PF_FLOATS (8 KiB) ahead; near the end of a matrix, the start of the next one.  Prefetch
 * changes no arithmetic. */
#define TH_PF_FLOATS 2048
#define TH_PF_HINT _MM_HINT_T0

static inline ptrdiff_t th_lead(ptrdiff_t floats)
{
    return floats >= TH_PF_FLOATS || floats <= 0 ? 1 : (TH_PF_FLOATS + floats - 1) / floats;
}

/* Where to prefetch `len` floats from row p of a row sweep: in M, or past its end at the
 * start of the matrix the check reads next; NULL if neither holds them all. */
static inline const float *th_ahead(th_matrix mt, ptrdiff_t p, ptrdiff_t len)
{
    const ptrdiff_t at = p * mt.q, size = mt.p * mt.q;
    if (at + len <= size)
        return mt.m + at;
    if (mt.next != NULL && at >= size && at - size + len <= mt.next_len)
        return mt.next + (at - size);
    return NULL;
}

#define TH_AVX512 __attribute__((target("avx512f")))
#define TH_AVX512_INLINE static inline __attribute__((always_inline, target("avx512f")))

/* The eight lanes of s combined as combine_lanes does. */
TH_AVX512_INLINE double combine512(__m512d s)
{
    const __m256d s4 = _mm256_add_pd(_mm512_castpd512_pd256(s), _mm512_extractf64x4_pd(s, 1));
    const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    return _mm_cvtsd_f64(s2) + _mm_cvtsd_f64(_mm_unpackhi_pd(s2, s2));
}

/* Rows per step of rows512 and 16-lane blocks per step of cols512, for rc rounds: enough
 * independent sums to hide the FMA latency, few enough to stay in the 32 vector registers. */
#define TH_ROWS_FOR(rc) ((rc) <= 4 ? 4 : (rc) <= 6 ? 3 : 2)
#define TH_BLOCKS_FOR(rc) ((rc) <= 3 ? 2 : 1)

/* One block of 8 terms of nr rows: lane l of acc[i][t] is the partial sum S_l of row i.
 * xb holds the block's probes of each round t as 8 doubles at xb + 8t. */
TH_AVX512_INLINE void rows_step512(const __m512d *v, const int nr, const double *xb, const int rc,
                                   const int with_abs, __m512d wv, __m512d acc[][TH_RC],
                                   __m512d *abs_acc)
{
#pragma GCC unroll 8
    for (int t = 0; t < rc; t++) {
        const __m512d xv = _mm512_loadu_pd(xb + TH_LANES * t);
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++)
            acc[i][t] = _mm512_fmadd_pd(v[i], xv, acc[i][t]);
    }
    if (with_abs) {
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++)
            abs_acc[i] = _mm512_fmadd_pd(_mm512_abs_pd(v[i]), wv, abs_acc[i]);
    }
}

/* Rows [p, p+nr) for rounds [t0, t0+rc) over the contiguous index.  xt holds those rounds'
 * probes block by block (8 terms x rc rounds), zero past the end. */
TH_AVX512_INLINE void rows512(th_matrix mt, ptrdiff_t p, const int nr, const double *xt, int r,
                              int t0, const int rc, const double *w, double *out, double *sums,
                              const float *pf)
{
    const ptrdiff_t Q = mt.q, full = Q / TH_LANES * TH_LANES;
    const float *row = mt.m + p * Q;
    __m512d acc[4][TH_RC], abs_acc[4], v[4];
#pragma GCC unroll 4
    for (int i = 0; i < nr; i++) {
        abs_acc[i] = _mm512_setzero_pd();
#pragma GCC unroll 8
        for (int t = 0; t < rc; t++)
            acc[i][t] = _mm512_setzero_pd();
    }
    const double *xb = xt;
    for (ptrdiff_t q = 0; q < full; q += TH_LANES, xb += TH_LANES * rc) {
        if (pf != NULL && (q & 15) == 0) { /* one prefetch per cache line of each row */
#pragma GCC unroll 4
            for (int i = 0; i < nr; i++)
                _mm_prefetch((const char *)(pf + i * Q + q), TH_PF_HINT);
        }
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++)
            v[i] = _mm512_cvtps_pd(_mm256_loadu_ps(row + i * Q + q));
        rows_step512(v, nr, xb, rc, sums != NULL, _mm512_loadu_pd(w + q), acc, abs_acc);
    }
    if (full < Q) { /* masked lanes read 0 and add +0.0, which leaves a sum unchanged */
        const __mmask16 k = (__mmask16)((1u << (Q - full)) - 1);
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++)
            v[i] = _mm512_cvtps_pd(
                _mm512_castps512_ps256(_mm512_maskz_loadu_ps(k, row + i * Q + full)));
        const __m512d wv = _mm512_maskz_loadu_pd((__mmask8)k, w + full);
        rows_step512(v, nr, xb, rc, sums != NULL, wv, acc, abs_acc);
    }
#pragma GCC unroll 4
    for (int i = 0; i < nr; i++) {
#pragma GCC unroll 8
        for (int t = 0; t < rc; t++)
            out[(p + i) * r + t0 + t] = combine512(acc[i][t]);
        if (sums)
            sums[p + i] = combine512(abs_acc[i]);
    }
}

TH_AVX512_INLINE void all_rows512(th_matrix mt, const double *xt, int r, int t0, const int rc,
                                  const double *w, double *out, double *sums)
{
    const int nr = TH_ROWS_FOR(rc); /* rows that share each probe load */
    const ptrdiff_t ahead = nr * th_lead(nr * mt.q);
    ptrdiff_t p = 0;
    for (; p + nr <= mt.p; p += nr)
        rows512(mt, p, nr, xt, r, t0, rc, w, out, sums, th_ahead(mt, p + ahead, nr * mt.q));
    for (; p < mt.p; p++)
        rows512(mt, p, 1, xt, r, t0, rc, w, out, sums, NULL);
}

/* Rows [q0, q1) of M for rounds [t0, t0+rc) over the row index: nb blocks of 16 outputs p
 * (columns of M) from p0, one lane each.  The running sums live in state between chunks of
 * rows (reloaded unchanged, so each lane still sums in increasing q); columns past P are
 * masked off and read as 0. */
TH_AVX512_INLINE void cols512(th_matrix mt, ptrdiff_t p0, const int nb, ptrdiff_t q0,
                              ptrdiff_t q1, const double *x, int r, int t0, const int rc,
                              const int with_abs, const double *w, double *state,
                              ptrdiff_t ahead)
{
    const ptrdiff_t P = mt.p;
    __mmask16 k[2];
    __m512d acc[4][TH_RC], abs_acc[4], v[4];
#pragma GCC unroll 2
    for (int b = 0; b < nb; b++) {
        const ptrdiff_t lanes = min_idx(16, P - p0 - 16 * b);
        k[b] = lanes <= 0 ? 0 : (__mmask16)((1u << lanes) - 1);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 2 * nb; i++) {
        abs_acc[i] = _mm512_loadu_pd(state + (i * (TH_RC + 1) + TH_RC) * 8);
#pragma GCC unroll 8
        for (int t = 0; t < rc; t++)
            acc[i][t] = _mm512_loadu_pd(state + (i * (TH_RC + 1) + t) * 8);
    }
    for (ptrdiff_t q = q0; q < q1; q++) {
        if (q + ahead < mt.q) { /* the same columns of a row of a later chunk */
#pragma GCC unroll 2
            for (int b = 0; b < nb; b++)
                if (k[b])
                    _mm_prefetch((const char *)(mt.m + (q + ahead) * P + p0 + 16 * b),
                                 TH_PF_HINT);
        }
#pragma GCC unroll 2
        for (int b = 0; b < nb; b++) {
            const __m512 f = _mm512_maskz_loadu_ps(k[b], mt.m + q * P + p0 + 16 * b);
            v[2 * b] = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
            v[2 * b + 1] =
                _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
        }
        const double *xq = x + q * r + t0;
#pragma GCC unroll 8
        for (int t = 0; t < rc; t++) {
            const __m512d xs = _mm512_set1_pd(xq[t]);
#pragma GCC unroll 4
            for (int i = 0; i < 2 * nb; i++)
                acc[i][t] = _mm512_fmadd_pd(v[i], xs, acc[i][t]);
        }
        if (with_abs) {
            const __m512d ws = _mm512_set1_pd(w[q]);
#pragma GCC unroll 4
            for (int i = 0; i < 2 * nb; i++)
                abs_acc[i] = _mm512_fmadd_pd(_mm512_abs_pd(v[i]), ws, abs_acc[i]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < 2 * nb; i++) {
        _mm512_storeu_pd(state + (i * (TH_RC + 1) + TH_RC) * 8, abs_acc[i]);
#pragma GCC unroll 8
        for (int t = 0; t < rc; t++)
            _mm512_storeu_pd(state + (i * (TH_RC + 1) + t) * 8, acc[i][t]);
    }
}

/* Chunks of TH_QC rows of M, each swept across all columns: the chunk stays in L2 while its
 * rows are read block by block, instead of striding down the whole matrix per block. */
#define TH_QC 32

TH_AVX512_INLINE void all_cols512(th_matrix mt, const double *x, int r, int t0, const int rc,
                                  const double *w, double *out, double *sums, double *state)
{
    const int nb = TH_BLOCKS_FOR(rc);
    const ptrdiff_t width = 16 * nb, per_block = 2 * nb * (TH_RC + 1) * 8;
    const ptrdiff_t blocks = (mt.p + width - 1) / width;
    const ptrdiff_t ahead = TH_QC * th_lead(TH_QC * mt.p); /* rows: whole chunks ahead */
    memset(state, 0, (size_t)(blocks * per_block) * sizeof(double));
    for (ptrdiff_t q0 = 0; q0 < mt.q; q0 += TH_QC)
        for (ptrdiff_t b = 0; b < blocks; b++)
            cols512(mt, b * width, nb, q0, min_idx(mt.q, q0 + TH_QC), x, r, t0, rc,
                    sums != NULL, w, state + b * per_block, ahead);
    for (ptrdiff_t p = 0; p < mt.p; p++) { /* lane p % 8 of vector p / 8 */
        const double *sp = state + (p / 8) * (TH_RC + 1) * 8 + p % 8;
        for (int t = 0; t < rc; t++)
            out[p * r + t0 + t] = sp[t * 8];
        if (sums)
            sums[p] = sp[TH_RC * 8];
    }
}

/* rc must be a compile-time constant in the sweeps, so that their sums live in registers. */
#define TH_BY_RC(call)                                                                       \
    switch (rc) {                                                                            \
    case 1: call(1); break;                                                                  \
    case 2: call(2); break;                                                                  \
    case 3: call(3); break;                                                                  \
    case 4: call(4); break;                                                                  \
    case 5: call(5); break;                                                                  \
    case 6: call(6); break;                                                                  \
    case 7: call(7); break;                                                                  \
    default: call(8); break;                                                                 \
    }

TH_AVX512 static void pass_avx512(th_matrix mt, const double *x, int r, const double *w,
                                  double *out, double *sums, double *xt)
{
    for (int t0 = 0; t0 < r; t0 += TH_RC) {
        const int rc = r - t0 < TH_RC ? r - t0 : TH_RC;
        double *s = t0 == 0 ? sums : NULL; /* the |op(M)| sums come with the first sweep */
        /* A literal NULL lets the compiler drop the |op(M)| sums from a sweep altogether. */
#define TH_ROWS(n) all_rows512(mt, xt, r, t0, n, w, out, s)
#define TH_ROWS_ONLY(n) all_rows512(mt, xt, r, t0, n, w, out, NULL)
#define TH_COLS(n) all_cols512(mt, x, r, t0, n, w, out, s, xt)
#define TH_COLS_ONLY(n) all_cols512(mt, x, r, t0, n, w, out, NULL, xt)
        if (!mt.trans) {
            pack_probes(x, mt.q, r, t0, rc, xt);
            if (s)
                TH_BY_RC(TH_ROWS)
            else
                TH_BY_RC(TH_ROWS_ONLY)
        } else {
            if (s)
                TH_BY_RC(TH_COLS)
            else
                TH_BY_RC(TH_COLS_ONLY)
        }
#undef TH_ROWS
#undef TH_ROWS_ONLY
#undef TH_COLS
#undef TH_COLS_ONLY
    }
}

static int avx512_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

#define TH_AVX2 __attribute__((target("avx2,fma")))
#define TH_AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma")))
#define TH_RC2 4 /* rounds per sweep with 16 vector registers */

/* The eight lanes held as lo = S0..S3, hi = S4..S7, combined as combine_lanes does. */
TH_AVX2_INLINE double combine256(__m256d lo, __m256d hi)
{
    const __m256d s4 = _mm256_add_pd(lo, hi);
    const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    return _mm_cvtsd_f64(s2) + _mm_cvtsd_f64(_mm_unpackhi_pd(s2, s2));
}

TH_AVX2_INLINE void rows_step256(const float *f, const double *xb, const int rc,
                                 const int with_abs, const double *wq, __m256d acc[][2],
                                 __m256d *abs_acc)
{
    const __m256d absmask = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
    const __m256 v8 = _mm256_loadu_ps(f);
    const __m256d v[2] = {_mm256_cvtps_pd(_mm256_castps256_ps128(v8)),
                          _mm256_cvtps_pd(_mm256_extractf128_ps(v8, 1))};
#pragma GCC unroll 4
    for (int t = 0; t < rc; t++) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256d xv = _mm256_loadu_pd(xb + TH_LANES * t + 4 * h);
            acc[t][h] = _mm256_fmadd_pd(v[h], xv, acc[t][h]);
        }
    }
    if (with_abs) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++)
            abs_acc[h] = _mm256_fmadd_pd(_mm256_and_pd(v[h], absmask),
                                         _mm256_loadu_pd(wq + 4 * h), abs_acc[h]);
    }
}

/* As rows512, one row at a time; the last partial block goes through zeroed buffers. */
TH_AVX2_INLINE void rows256(th_matrix mt, const double *xt, int r, int t0, const int rc,
                            const double *w, double *out, double *sums)
{
    const ptrdiff_t Q = mt.q, full = Q / TH_LANES * TH_LANES, ahead = th_lead(Q);
    for (ptrdiff_t p = 0; p < mt.p; p++) {
        const float *row = mt.m + p * Q;
        const float *pf = p + ahead < mt.p ? row + ahead * Q : NULL;
        __m256d acc[TH_RC2][2], abs_acc[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()};
#pragma GCC unroll 4
        for (int t = 0; t < rc; t++)
            acc[t][0] = acc[t][1] = _mm256_setzero_pd();
        const double *xb = xt;
        for (ptrdiff_t q = 0; q < full; q += TH_LANES, xb += TH_LANES * rc) {
            if (pf != NULL && (q & 15) == 0)
                _mm_prefetch((const char *)(pf + q), TH_PF_HINT);
            rows_step256(row + q, xb, rc, sums != NULL, w + q, acc, abs_acc);
        }
        if (full < Q) {
            float f[TH_LANES] = {0};
            double wq[TH_LANES] = {0};
            memcpy(f, row + full, (size_t)(Q - full) * sizeof(float));
            if (sums)
                memcpy(wq, w + full, (size_t)(Q - full) * sizeof(double));
            rows_step256(f, xb, rc, sums != NULL, wq, acc, abs_acc);
        }
#pragma GCC unroll 4
        for (int t = 0; t < rc; t++)
            out[p * r + t0 + t] = combine256(acc[t][0], acc[t][1]);
        if (sums)
            sums[p] = combine256(abs_acc[0], abs_acc[1]);
    }
}

/* As cols512 with blocks of 8 outputs; the columns past the last full block go to
 * cols_generic, which sums in the same order. */
TH_AVX2_INLINE void cols256(th_matrix mt, const double *x, int r, int t0, const int rc,
                            const double *w, double *out, double *sums)
{
    const ptrdiff_t P = mt.p, Q = mt.q, full = P / 8 * 8;
    const __m256d absmask = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
    for (ptrdiff_t p0 = 0; p0 < full; p0 += 8) {
        __m256d acc[TH_RC2][2], abs_acc[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()};
#pragma GCC unroll 4
        for (int t = 0; t < rc; t++)
            acc[t][0] = acc[t][1] = _mm256_setzero_pd();
        for (ptrdiff_t q = 0; q < Q; q++) {
            const __m256 v8 = _mm256_loadu_ps(mt.m + q * P + p0);
            const __m256d v[2] = {_mm256_cvtps_pd(_mm256_castps256_ps128(v8)),
                                  _mm256_cvtps_pd(_mm256_extractf128_ps(v8, 1))};
#pragma GCC unroll 4
            for (int t = 0; t < rc; t++) {
                const __m256d xs = _mm256_broadcast_sd(x + q * r + t0 + t);
                acc[t][0] = _mm256_fmadd_pd(v[0], xs, acc[t][0]);
                acc[t][1] = _mm256_fmadd_pd(v[1], xs, acc[t][1]);
            }
            if (sums) {
                const __m256d ws = _mm256_broadcast_sd(w + q);
                abs_acc[0] = _mm256_fmadd_pd(_mm256_and_pd(v[0], absmask), ws, abs_acc[0]);
                abs_acc[1] = _mm256_fmadd_pd(_mm256_and_pd(v[1], absmask), ws, abs_acc[1]);
            }
        }
        double tmp[8];
#pragma GCC unroll 4
        for (int t = 0; t < rc; t++) {
            _mm256_storeu_pd(tmp, acc[t][0]);
            _mm256_storeu_pd(tmp + 4, acc[t][1]);
            for (int l = 0; l < 8; l++)
                out[(p0 + l) * r + t0 + t] = tmp[l];
        }
        if (sums) {
            _mm256_storeu_pd(sums + p0, abs_acc[0]);
            _mm256_storeu_pd(sums + p0 + 4, abs_acc[1]);
        }
    }
}

#define TH_BY_RC2(call)                                                                      \
    switch (rc) {                                                                            \
    case 1: call(1); break;                                                                  \
    case 2: call(2); break;                                                                  \
    case 3: call(3); break;                                                                  \
    default: call(4); break;                                                                 \
    }

TH_AVX2 static void pass_avx2(th_matrix mt, const double *x, int r, const double *w, double *out,
                              double *sums, double *xt)
{
    for (int t0 = 0; t0 < r; t0 += TH_RC2) {
        const int rc = r - t0 < TH_RC2 ? r - t0 : TH_RC2;
        double *s = t0 == 0 ? sums : NULL;
#define TH_ROWS(n) rows256(mt, xt, r, t0, n, w, out, s)
#define TH_ROWS_ONLY(n) rows256(mt, xt, r, t0, n, w, out, NULL)
#define TH_COLS(n) cols256(mt, x, r, t0, n, w, out, s)
#define TH_COLS_ONLY(n) cols256(mt, x, r, t0, n, w, out, NULL)
        if (!mt.trans) {
            pack_probes(x, mt.q, r, t0, rc, xt);
            if (s)
                TH_BY_RC2(TH_ROWS)
            else
                TH_BY_RC2(TH_ROWS_ONLY)
        } else {
            if (s)
                TH_BY_RC2(TH_COLS)
            else
                TH_BY_RC2(TH_COLS_ONLY)
        }
#undef TH_ROWS
#undef TH_ROWS_ONLY
#undef TH_COLS
#undef TH_COLS_ONLY
    }
    if (mt.trans && mt.p % 8) /* the last columns, all rounds at once */
        cols_generic(mt, mt.p / 8 * 8, mt.p, x, r, w, out, sums);
}

static int avx2_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

#endif /* TH_X86 */

/* ---- dispatch ---- */

typedef struct {
    const char *name;
    th_pass_fn pass;
    int (*supported)(void);
} th_variant;

/* Fastest first: the first supported variant is the default.  All give the same bits. */
static const th_variant th_variants[] = {
#ifdef TH_X86
    {"avx512", pass_avx512, avx512_supported},
    {"avx2", pass_avx2, avx2_supported},
#endif
    {"generic", pass_generic, always_supported},
};

#define TH_NVARIANTS (sizeof(th_variants) / sizeof(th_variants[0]))

/* Set once; a racing first call from two threads stores the same pointer. */
static const th_variant *th_active = NULL;

static const th_variant *active(void)
{
    if (th_active == NULL) {
        for (size_t i = 0; i < TH_NVARIANTS; i++) {
            if (th_variants[i].supported()) {
                th_active = &th_variants[i];
                break;
            }
        }
    }
    return th_active;
}

const char *th_probe_kernel_name(void) { return active()->name; }

int th_probe_force_kernel(const char *name)
{
    for (size_t i = 0; i < TH_NVARIANTS; i++) {
        if (strcmp(th_variants[i].name, name) == 0) {
            if (!th_variants[i].supported())
                return -1;
            th_active = &th_variants[i];
            return 0;
        }
    }
    return -1;
}

/* ---- the check ---- */

/* y rounded to nearest on 24 significant bits (Veltkamp's split with 2^29 + 1), so that a
 * float32 times it is exact in float64.  No overflow: |y| < 2^170 here. */
static double round24(double y)
{
    const double c = y * 536870913.0;
    return c - (c - y);
}

static int all_finite(const double *v, ptrdiff_t len)
{
    for (ptrdiff_t i = 0; i < len; i++)
        if (!isfinite(v[i]))
            return 0;
    return 1;
}

int th_freivalds(const float *a, const float *b, const float *c, ptrdiff_t m, ptrdiff_t n,
                 ptrdiff_t k, int trans_a, int trans_b, const unsigned char *bits, int r,
                 double cz, double c0, th_verdict *out)
{
    memset(out, 0, sizeof(*out));
    out->row = -1;
    const th_pass_fn pass = active()->pass;
    const ptrdiff_t qmax = n > k ? n : k;
    const ptrdiff_t pmax = m > k ? m : k, scratch_p = (pmax + 31) / 32 * 32 * (TH_RC + 1);
    const ptrdiff_t scratch = TH_RC * ceil8(qmax) > scratch_p ? TH_RC * ceil8(qmax) : scratch_p;
    const size_t doubles = (size_t)(n * r + n + k * r + k + 2 * m * r + m + scratch);
    double *buf = aligned_alloc(64, (doubles * sizeof(double) + 63) / 64 * 64 + 64);
    if (buf == NULL)
        return -1;
    double *x = buf, *ones = x + n * r, *y = ones + n, *w = y + k * r, *cx = w + k;
    double *ay = cx + m * r, *z = ay + m * r, *xt = z + m;

    for (ptrdiff_t j = 0; j < n; j++)
        for (int t = 0; t < r; t++) {
            const size_t bit = (size_t)t * (size_t)n + (size_t)j;
            x[j * r + t] = (bits[bit >> 3] >> (bit & 7)) & 1 ? -1.0 : 1.0;
        }
    for (ptrdiff_t j = 0; j < n; j++)
        ones[j] = 1.0;

    const th_matrix am = {a, m, k, trans_a, NULL, 0}, cm = {c, m, n, 0, a, m * k},
                    bm = {b, k, n, trans_b, c, m * n};
    pass(bm, x, r, ones, y, w, xt); /* y = op(B) x, w = |op(B)| 1 */
    pass(cm, x, r, ones, cx, NULL, xt); /* Cx; |C| is not needed (docs/validation.md) */
    /* A NaN or infinity in B reaches w, in C every round of Cx, in A (once w is finite) z. */
    out->nonfinite = (all_finite(w, k) ? 0 : 2) | (all_finite(cx, m * r) ? 0 : 4);
    if (out->nonfinite == 0) {
        for (ptrdiff_t i = 0; i < k * r; i++)
            y[i] = round24(y[i]);
        for (ptrdiff_t i = 0; i < k; i++)
            w[i] = round24(w[i]);
        pass(am, y, r, w, ay, z, xt); /* op(A) y, z = |op(A)| w */
        out->nonfinite = all_finite(z, m) ? 0 : 1;
    }
    if (out->nonfinite == 0) {
        double worst = -1.0;
        out->ok = 1;
        for (ptrdiff_t i = 0; i < m; i++) {
            const double tau = cz * z[i] + c0;
            for (int t = 0; t < r; t++) {
                const double res = fabs(cx[i * r + t] - ay[i * r + t]);
                const double ratio = res == 0.0 ? 0.0 : res / tau;
                if (!(res <= tau))
                    out->ok = 0;
                if (ratio > worst) {
                    worst = ratio;
                    out->row = i;
                    out->round_no = t;
                    out->residual = res;
                    out->bound = tau;
                    out->ratio = ratio;
                }
            }
        }
    }
    free(buf);
    return 0;
}
