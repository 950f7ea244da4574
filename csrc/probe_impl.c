/* Freivalds check of a float32 tile: one pass over each operand, float32 sums in a fixed order.
 *
 * A pass over the P x Q matrix op(M) computes, for the probe rounds t < r,
 *     out[p*r + t] = sum_q op(M)[p][q] * x[q*r + t]
 *     sums[p]      = sum_q |op(M)[p][q]| * w[q]        (when sums is not NULL)
 * each term added with one fused multiply-add (fmaf), in an order fixed by the shape alone
 * (probe_impl.h).  SIMD lanes hold different partial sums, never parts of one, so the vector
 * width, the number of rounds per sweep and the machine cannot change a bit.  The rounding
 * this costs is part of the bound (docs/validation.md); the arithmetic runs at the product's
 * own vector width, with no conversion to float64.
 */
#include "probe_impl.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define TH_X86 1
#endif

#define TH_LANES 16 /* partial sums over the contiguous index of a row-major operand */
#define TH_CHUNK 16 /* rows per partial sum over the row index of a transposed operand */
#define TH_RC 8     /* rounds per sweep over a matrix: their sums stay in registers */

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
 * scratch: TH_RC * ceil16(Q) floats for the probes, or ceil64(P) * (TH_RC + 1) for sums. */
typedef void (*th_pass_fn)(th_matrix mt, const float *x, int r, const float *w, float *out,
                           float *sums, float *scratch);

static inline ptrdiff_t min_idx(ptrdiff_t x, ptrdiff_t y) { return x < y ? x : y; }

static inline ptrdiff_t ceil16(ptrdiff_t x) { return (x + TH_LANES - 1) / TH_LANES * TH_LANES; }

/* ---- generic C: the order spelled out, one sum at a time ---- */

/* The sixteen lane sums halved four times: lanes l and l + 8, then l and l + 4, l + 2, l + 1. */
static float combine_lanes(const float *s)
{
    float h[8];
    for (int l = 0; l < 8; l++)
        h[l] = s[l] + s[l + 8];
    for (int l = 0; l < 4; l++)
        h[l] = h[l] + h[l + 4];
    for (int l = 0; l < 2; l++)
        h[l] = h[l] + h[l + 2];
    return h[0] + h[1];
}

/* Outputs [p0, p1) of a transposed operand: each (p, t) sums chunks of TH_CHUNK rows, each
 * chunk in increasing q from +0.0, and adds the chunk sums in increasing order to +0.0. */
static void cols_generic(th_matrix mt, ptrdiff_t p0, ptrdiff_t p1, const float *x, int r,
                         const float *w, float *out, float *sums)
{
    for (ptrdiff_t p = p0; p < p1; p++) {
        for (int t = 0; t < r + (sums != NULL); t++) { /* t == r: the sum of |op(M)| w */
            float total = 0.0f;
            for (ptrdiff_t q0 = 0; q0 < mt.q; q0 += TH_CHUNK) {
                float part = 0.0f;
                for (ptrdiff_t q = q0; q < min_idx(mt.q, q0 + TH_CHUNK); q++) {
                    const float v = mt.m[q * mt.p + p];
                    part = t < r ? fmaf(v, x[q * r + t], part) : fmaf(fabsf(v), w[q], part);
                }
                total += part;
            }
            if (t < r)
                out[p * r + t] = total;
            else
                sums[p] = total;
        }
    }
}

static void pass_generic(th_matrix mt, const float *x, int r, const float *w, float *out,
                         float *sums, float *scratch)
{
    (void)scratch;
    if (mt.trans) {
        cols_generic(mt, 0, mt.p, x, r, w, out, sums);
        return;
    }
    for (ptrdiff_t p = 0; p < mt.p; p++) {
        const float *row = mt.m + p * mt.q;
        for (int t = 0; t < r + (sums != NULL); t++) {
            float lane[TH_LANES] = {0};
            /* Up to a whole block, the missing terms +0.0 times +0.0 as the SIMD variants
             * read them: that turns a lane that ended at -0.0 into +0.0 there, so here too. */
            for (ptrdiff_t q = 0; q < ceil16(mt.q); q++) {
                const int in = q < mt.q;
                const float v = in ? row[q] : 0.0f;
                float *s = &lane[q % TH_LANES];
                *s = t < r ? fmaf(v, in ? x[q * r + t] : 0.0f, *s)
                           : fmaf(fabsf(v), in ? w[q] : 0.0f, *s);
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

/* Rounds [t0, t0+rc) of x (Q x r) regrouped for the SIMD row sweeps: block by block of 16
 * terms, each round's 16 probes contiguous, zero past the end. */
static void pack_probes(const float *x, ptrdiff_t Q, int r, int t0, int rc, float *xt)
{
    for (ptrdiff_t q = 0; q < ceil16(Q); q++)
        for (int t = 0; t < rc; t++)
            xt[(q / TH_LANES * rc + t) * TH_LANES + q % TH_LANES] =
                q < Q ? x[q * r + t0 + t] : 0.0f;
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

/* The sixteen lanes of s combined as combine_lanes does. */
TH_AVX512_INLINE float combine512(__m512 s)
{
    const __m256 hi8 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1));
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(s), hi8);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* Rows per step of rows512 and 16-lane blocks per step of cols512, for rc rounds: enough
 * independent sums to hide the FMA latency, few enough to stay in the 32 vector registers. */
#define TH_ROWS_FOR(rc) ((rc) <= 4 ? 4 : (rc) <= 6 ? 3 : 2)
#define TH_BLOCKS_FOR(rc) ((rc) <= 2 ? 4 : (rc) <= 4 ? 2 : 1)

/* The sums of nr rows for rc rounds, and of their absolute values, all +0.0. */
TH_AVX512_INLINE void zero_rows512(__m512 acc[][TH_RC], __m512 *abs_acc, const int nr,
                                   const int rc)
{
#pragma GCC unroll 4
    for (int i = 0; i < nr; i++) {
        abs_acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int t = 0; t < rc; t++)
            acc[i][t] = _mm512_setzero_ps();
    }
}

/* Rows [p, p+nr)'s lane sums combined into out (rounds [t0, t0+rc)) and sums. */
TH_AVX512_INLINE void store_rows512(__m512 acc[][TH_RC], __m512 *abs_acc, const int nr,
                                    const int rc, ptrdiff_t p, int r, int t0, float *out,
                                    float *sums)
{
#pragma GCC unroll 4
    for (int i = 0; i < nr; i++) {
#pragma GCC unroll 8
        for (int t = 0; t < rc; t++)
            out[(p + i) * r + t0 + t] = combine512(acc[i][t]);
        if (sums)
            sums[p + i] = combine512(abs_acc[i]);
    }
}

/* One block of 16 terms of nr rows, their q-th to (q+15)-th, read through mask k: lane l of
 * acc[i][t] is the partial sum S_l of row i.  xb holds the block's probes of each round t as
 * 16 floats at xb + 16t.  (Each row's vector is loaded and used in one place, so that the
 * compiler keeps every value of a step in a register.) */
TH_AVX512_INLINE void rows_step512(const float *row, ptrdiff_t Q, ptrdiff_t q, __mmask16 k,
                                   const int nr, const float *xb, const int rc,
                                   const int with_abs, __m512 wv, __m512 acc[][TH_RC],
                                   __m512 *abs_acc)
{
    __m512 xv[TH_RC];
#pragma GCC unroll 8
    for (int t = 0; t < rc; t++)
        xv[t] = _mm512_loadu_ps(xb + TH_LANES * t);
#pragma GCC unroll 4
    for (int i = 0; i < nr; i++) {
        const __m512 v = _mm512_maskz_loadu_ps(k, row + i * Q + q);
#pragma GCC unroll 8
        for (int t = 0; t < rc; t++)
            acc[i][t] = _mm512_fmadd_ps(v, xv[t], acc[i][t]);
        if (with_abs)
            abs_acc[i] = _mm512_fmadd_ps(_mm512_abs_ps(v), wv, abs_acc[i]);
    }
}

/* Rows [p, p+nr) for rounds [t0, t0+rc) over the contiguous index.  xt holds those rounds'
 * probes block by block (16 terms x rc rounds), zero past the end. */
TH_AVX512_INLINE void rows512(th_matrix mt, ptrdiff_t p, const int nr, const float *xt, int r,
                              int t0, const int rc, const float *w, float *out, float *sums,
                              const float *pf)
{
    const ptrdiff_t Q = mt.q, full = Q / TH_LANES * TH_LANES;
    const float *row = mt.m + p * Q;
    __m512 acc[4][TH_RC], abs_acc[4];
    zero_rows512(acc, abs_acc, nr, rc);
    const float *xb = xt;
    for (ptrdiff_t q = 0; q < full; q += TH_LANES, xb += TH_LANES * rc) {
        if (pf != NULL) { /* one prefetch per cache line of each row */
#pragma GCC unroll 4
            for (int i = 0; i < nr; i++)
                _mm_prefetch((const char *)(pf + i * Q + q), TH_PF_HINT);
        }
        rows_step512(row, Q, q, (__mmask16)0xffff, nr, xb, rc, sums != NULL,
                     _mm512_loadu_ps(w + q), acc, abs_acc);
    }
    if (full < Q) { /* masked lanes read 0 and add +0.0 (a -0.0 sum becomes +0.0; all alike) */
        const __mmask16 k = (__mmask16)((1u << (Q - full)) - 1);
        rows_step512(row, Q, full, k, nr, xb, rc, sums != NULL, _mm512_maskz_loadu_ps(k, w + full),
                     acc, abs_acc);
    }
    store_rows512(acc, abs_acc, nr, rc, p, r, t0, out, sums);
}

/* As rows512, for rows of a multiple of 16 floats that start o floats (0 < o < 16) past a
 * 64-byte boundary, as numpy's arrays do (it aligns them to 16 bytes): a plain load of 16
 * floats would straddle two cache lines every time, a third slower.  Each block is instead
 * assembled from the two aligned lines it straddles with one permute; the line read last
 * is the first of the next block.  Masks keep every load inside the rows. */
TH_AVX512_INLINE void rows512_shifted(th_matrix mt, ptrdiff_t p, const int nr, const float *xt,
                                      int r, int t0, const int rc, const float *w, float *out,
                                      float *sums, const float *pf, int o)
{
    const ptrdiff_t Q = mt.q;
    /* 64-byte aligned; through an integer, as it points before the row (before the array
     * when p = 0): only the masked lanes from o on are ever read there. */
    const float *base = (const float *)((uintptr_t)(mt.m + p * Q) - (uintptr_t)o * sizeof(float));
    const __m512i idx = _mm512_add_epi32(
        _mm512_set1_epi32(o), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __mmask16 head = (__mmask16)(0xffffu << o), tail = (__mmask16)((1u << o) - 1);
    __m512 acc[4][TH_RC], abs_acc[4], line[4];
    zero_rows512(acc, abs_acc, nr, rc);
#pragma GCC unroll 4
    for (int i = 0; i < nr; i++)
        line[i] = _mm512_maskz_load_ps(head, base + i * Q);
    const float *xb = xt;
    for (ptrdiff_t q = 0; q < Q; q += TH_LANES, xb += TH_LANES * rc) {
        if (pf != NULL) {
#pragma GCC unroll 4
            for (int i = 0; i < nr; i++)
                _mm_prefetch((const char *)(pf + i * Q + q), TH_PF_HINT);
        }
        const __mmask16 k = q + TH_LANES < Q ? (__mmask16)0xffff : tail;
        __m512 xv[TH_RC];
#pragma GCC unroll 8
        for (int t = 0; t < rc; t++)
            xv[t] = _mm512_loadu_ps(xb + TH_LANES * t);
        const __m512 wv = _mm512_loadu_ps(w + q);
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++) {
            const __m512 next = _mm512_maskz_load_ps(k, base + i * Q + q + TH_LANES);
            const __m512 v = _mm512_permutex2var_ps(line[i], idx, next);
            line[i] = next;
#pragma GCC unroll 8
            for (int t = 0; t < rc; t++)
                acc[i][t] = _mm512_fmadd_ps(v, xv[t], acc[i][t]);
            if (sums != NULL)
                abs_acc[i] = _mm512_fmadd_ps(_mm512_abs_ps(v), wv, abs_acc[i]);
        }
    }
    store_rows512(acc, abs_acc, nr, rc, p, r, t0, out, sums);
}

TH_AVX512_INLINE void all_rows512(th_matrix mt, const float *xt, int r, int t0, const int rc,
                                  const float *w, float *out, float *sums)
{
    const int nr = TH_ROWS_FOR(rc); /* rows that share each probe load */
    const ptrdiff_t ahead = nr * th_lead(nr * mt.q);
    const uintptr_t at = (uintptr_t)mt.m;
    const int o = (int)(at % 64 / sizeof(float));
    const int shifted = o != 0 && at % sizeof(float) == 0 && mt.q > 0 && mt.q % TH_LANES == 0;
    ptrdiff_t p = 0;
    for (; p + nr <= mt.p; p += nr) {
        const float *pf = th_ahead(mt, p + ahead, nr * mt.q);
        if (shifted)
            rows512_shifted(mt, p, nr, xt, r, t0, rc, w, out, sums, pf, o);
        else
            rows512(mt, p, nr, xt, r, t0, rc, w, out, sums, pf);
    }
    for (; p < mt.p; p++)
        rows512(mt, p, 1, xt, r, t0, rc, w, out, sums, NULL);
}

/* One chunk of rows [q0, q1) of M (at most TH_CHUNK) for rounds [t0, t0+rc) over the row
 * index: nb blocks of 16 outputs p (columns of M) from p0, one lane each.  The chunk sums
 * start from +0.0 and are then added to the running totals in state (block b's round t at
 * state + (b * (TH_RC + 1) + t) * 16, its |op(M)| sum at t = TH_RC); columns past P are
 * masked off and read as 0. */
TH_AVX512_INLINE void cols512(th_matrix mt, ptrdiff_t p0, const int nb, ptrdiff_t q0,
                              ptrdiff_t q1, const float *x, int r, int t0, const int rc,
                              const int with_abs, const float *w, float *state,
                              ptrdiff_t ahead)
{
    const ptrdiff_t P = mt.p;
    __mmask16 k[4];
    __m512 acc[4][TH_RC], abs_acc[4];
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) {
        const ptrdiff_t lanes = min_idx(16, P - p0 - 16 * b);
        k[b] = lanes <= 0 ? 0 : (__mmask16)((1u << lanes) - 1);
        abs_acc[b] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int t = 0; t < rc; t++)
            acc[b][t] = _mm512_setzero_ps();
    }
    for (ptrdiff_t q = q0; q < q1; q++) {
        if (q + ahead < mt.q) { /* the same columns of a row of a later chunk */
#pragma GCC unroll 4
            for (int b = 0; b < nb; b++)
                if (k[b])
                    _mm_prefetch((const char *)(mt.m + (q + ahead) * P + p0 + 16 * b),
                                 TH_PF_HINT);
        }
        __m512 v[4];
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++)
            v[b] = _mm512_maskz_loadu_ps(k[b], mt.m + q * P + p0 + 16 * b);
        const float *xq = x + q * r + t0;
#pragma GCC unroll 8
        for (int t = 0; t < rc; t++) {
            const __m512 xs = _mm512_set1_ps(xq[t]);
#pragma GCC unroll 4
            for (int b = 0; b < nb; b++)
                acc[b][t] = _mm512_fmadd_ps(v[b], xs, acc[b][t]);
        }
        if (with_abs) {
            const __m512 ws = _mm512_set1_ps(w[q]);
#pragma GCC unroll 4
            for (int b = 0; b < nb; b++)
                abs_acc[b] = _mm512_fmadd_ps(_mm512_abs_ps(v[b]), ws, abs_acc[b]);
        }
    }
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++) {
        float *s = state + b * (TH_RC + 1) * 16;
        if (with_abs)
            _mm512_storeu_ps(s + TH_RC * 16,
                             _mm512_add_ps(_mm512_loadu_ps(s + TH_RC * 16), abs_acc[b]));
#pragma GCC unroll 8
        for (int t = 0; t < rc; t++)
            _mm512_storeu_ps(s + t * 16, _mm512_add_ps(_mm512_loadu_ps(s + t * 16), acc[b][t]));
    }
}

TH_AVX512_INLINE void all_cols512(th_matrix mt, const float *x, int r, int t0, const int rc,
                                  const float *w, float *out, float *sums, float *state)
{
    const int nb = TH_BLOCKS_FOR(rc);
    const ptrdiff_t width = 16 * nb, per_block = (TH_RC + 1) * 16;
    const ptrdiff_t groups = (mt.p + width - 1) / width;
    const ptrdiff_t ahead = TH_CHUNK * th_lead(TH_CHUNK * mt.p); /* rows: whole chunks ahead */
    memset(state, 0, (size_t)(groups * nb * per_block) * sizeof(float));
    /* Chunk by chunk across all columns: the chunk stays in L1 while its rows are read
     * block by block, instead of striding down the whole matrix per block. */
    for (ptrdiff_t q0 = 0; q0 < mt.q; q0 += TH_CHUNK)
        for (ptrdiff_t g = 0; g < groups; g++)
            cols512(mt, g * width, nb, q0, min_idx(mt.q, q0 + TH_CHUNK), x, r, t0, rc,
                    sums != NULL, w, state + g * nb * per_block, ahead);
    for (ptrdiff_t p = 0; p < mt.p; p++) { /* lane p % 16 of block p / 16 */
        const float *sp = state + (p / 16) * per_block + p % 16;
        for (int t = 0; t < rc; t++)
            out[p * r + t0 + t] = sp[t * 16];
        if (sums)
            sums[p] = sp[TH_RC * 16];
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

TH_AVX512 static void pass_avx512(th_matrix mt, const float *x, int r, const float *w,
                                  float *out, float *sums, float *scratch)
{
    for (int t0 = 0; t0 < r; t0 += TH_RC) {
        const int rc = r - t0 < TH_RC ? r - t0 : TH_RC;
        float *s = t0 == 0 ? sums : NULL; /* the |op(M)| sums come with the first sweep */
        /* A literal NULL lets the compiler drop the |op(M)| sums from a sweep altogether. */
#define TH_ROWS(n) all_rows512(mt, scratch, r, t0, n, w, out, s)
#define TH_ROWS_ONLY(n) all_rows512(mt, scratch, r, t0, n, w, out, NULL)
#define TH_COLS(n) all_cols512(mt, x, r, t0, n, w, out, s, scratch)
#define TH_COLS_ONLY(n) all_cols512(mt, x, r, t0, n, w, out, NULL, scratch)
        if (!mt.trans) {
            pack_probes(x, mt.q, r, t0, rc, scratch);
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

/* The sixteen lanes held as lo = S0..S7, hi = S8..S15, combined as combine_lanes does. */
TH_AVX2_INLINE float combine256(__m256 lo, __m256 hi)
{
    const __m256 s8 = _mm256_add_ps(lo, hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

TH_AVX2_INLINE void rows_step256(const float *f, const float *xb, const int rc,
                                 const int with_abs, const float *wq, __m256 acc[][2],
                                 __m256 *abs_acc)
{
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 v[2] = {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
#pragma GCC unroll 4
    for (int t = 0; t < rc; t++) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256 xv = _mm256_loadu_ps(xb + TH_LANES * t + 8 * h);
            acc[t][h] = _mm256_fmadd_ps(v[h], xv, acc[t][h]);
        }
    }
    if (with_abs) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++)
            abs_acc[h] = _mm256_fmadd_ps(_mm256_and_ps(v[h], absmask),
                                         _mm256_loadu_ps(wq + 8 * h), abs_acc[h]);
    }
}

/* As rows512, one row at a time; the last partial block goes through zeroed buffers. */
TH_AVX2_INLINE void rows256(th_matrix mt, const float *xt, int r, int t0, const int rc,
                            const float *w, float *out, float *sums)
{
    const ptrdiff_t Q = mt.q, full = Q / TH_LANES * TH_LANES, ahead = th_lead(Q);
    for (ptrdiff_t p = 0; p < mt.p; p++) {
        const float *row = mt.m + p * Q;
        const float *pf = p + ahead < mt.p ? row + ahead * Q : NULL;
        __m256 acc[TH_RC2][2], abs_acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
#pragma GCC unroll 4
        for (int t = 0; t < rc; t++)
            acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        const float *xb = xt;
        for (ptrdiff_t q = 0; q < full; q += TH_LANES, xb += TH_LANES * rc) {
            if (pf != NULL)
                _mm_prefetch((const char *)(pf + q), TH_PF_HINT);
            rows_step256(row + q, xb, rc, sums != NULL, w + q, acc, abs_acc);
        }
        if (full < Q) {
            float f[TH_LANES] = {0}, wq[TH_LANES] = {0};
            memcpy(f, row + full, (size_t)(Q - full) * sizeof(float));
            if (sums)
                memcpy(wq, w + full, (size_t)(Q - full) * sizeof(float));
            rows_step256(f, xb, rc, sums != NULL, wq, acc, abs_acc);
        }
#pragma GCC unroll 4
        for (int t = 0; t < rc; t++)
            out[p * r + t0 + t] = combine256(acc[t][0], acc[t][1]);
        if (sums)
            sums[p] = combine256(abs_acc[0], abs_acc[1]);
    }
}

/* As cols512 with blocks of 8 outputs, the running totals in registers; the columns past the
 * last full block go to cols_generic, which sums in the same order. */
TH_AVX2_INLINE void cols256(th_matrix mt, const float *x, int r, int t0, const int rc,
                            const float *w, float *out, float *sums)
{
    const ptrdiff_t P = mt.p, Q = mt.q, full = P / 8 * 8;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (ptrdiff_t p0 = 0; p0 < full; p0 += 8) {
        __m256 total[TH_RC2], abs_total = _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int t = 0; t < rc; t++)
            total[t] = _mm256_setzero_ps();
        for (ptrdiff_t q0 = 0; q0 < Q; q0 += TH_CHUNK) {
            __m256 acc[TH_RC2], abs_acc = _mm256_setzero_ps();
#pragma GCC unroll 4
            for (int t = 0; t < rc; t++)
                acc[t] = _mm256_setzero_ps();
            for (ptrdiff_t q = q0; q < min_idx(Q, q0 + TH_CHUNK); q++) {
                const __m256 v = _mm256_loadu_ps(mt.m + q * P + p0);
#pragma GCC unroll 4
                for (int t = 0; t < rc; t++)
                    acc[t] = _mm256_fmadd_ps(v, _mm256_broadcast_ss(x + q * r + t0 + t), acc[t]);
                if (sums)
                    abs_acc = _mm256_fmadd_ps(_mm256_and_ps(v, absmask),
                                              _mm256_broadcast_ss(w + q), abs_acc);
            }
#pragma GCC unroll 4
            for (int t = 0; t < rc; t++)
                total[t] = _mm256_add_ps(total[t], acc[t]);
            abs_total = _mm256_add_ps(abs_total, abs_acc);
        }
        float tmp[8];
#pragma GCC unroll 4
        for (int t = 0; t < rc; t++) {
            _mm256_storeu_ps(tmp, total[t]);
            for (int l = 0; l < 8; l++)
                out[(p0 + l) * r + t0 + t] = tmp[l];
        }
        if (sums)
            _mm256_storeu_ps(sums + p0, abs_total);
    }
}

#define TH_BY_RC2(call)                                                                      \
    switch (rc) {                                                                            \
    case 1: call(1); break;                                                                  \
    case 2: call(2); break;                                                                  \
    case 3: call(3); break;                                                                  \
    default: call(4); break;                                                                 \
    }

TH_AVX2 static void pass_avx2(th_matrix mt, const float *x, int r, const float *w, float *out,
                              float *sums, float *scratch)
{
    for (int t0 = 0; t0 < r; t0 += TH_RC2) {
        const int rc = r - t0 < TH_RC2 ? r - t0 : TH_RC2;
        float *s = t0 == 0 ? sums : NULL;
#define TH_ROWS(n) rows256(mt, scratch, r, t0, n, w, out, s)
#define TH_ROWS_ONLY(n) rows256(mt, scratch, r, t0, n, w, out, NULL)
#define TH_COLS(n) cols256(mt, x, r, t0, n, w, out, s)
#define TH_COLS_ONLY(n) cols256(mt, x, r, t0, n, w, out, NULL)
        if (!mt.trans) {
            pack_probes(x, mt.q, r, t0, rc, scratch);
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

static int all_finite(const float *v, ptrdiff_t len)
{
    for (ptrdiff_t i = 0; i < len; i++)
        if (!isfinite(v[i]))
            return 0;
    return 1;
}

/* A sum came out infinite or NaN: name the operands that hold a NaN or an infinity, or, if
 * none does, say that the check's own float32 sums overflowed (TH_OVERFLOW). */
static int why_not_finite(const float *a, const float *b, const float *c, ptrdiff_t m,
                          ptrdiff_t n, ptrdiff_t k)
{
    const int found = (all_finite(a, m * k) ? 0 : 1) | (all_finite(b, k * n) ? 0 : 2) |
                      (all_finite(c, m * n) ? 0 : 4);
    return found ? found : TH_OVERFLOW;
}

int th_freivalds(const float *a, const float *b, const float *c, ptrdiff_t m, ptrdiff_t n,
                 ptrdiff_t k, int trans_a, int trans_b, const unsigned char *bits, int r,
                 double cz, double c0, th_verdict *out)
{
    memset(out, 0, sizeof(*out));
    out->row = -1;
    const th_pass_fn pass = active()->pass;
    const ptrdiff_t qmax = n > k ? n : k;
    const ptrdiff_t pmax = m > k ? m : k, scratch_p = (pmax + 63) / 64 * 64 * (TH_RC + 1);
    const ptrdiff_t scratch = TH_RC * ceil16(qmax) > scratch_p ? TH_RC * ceil16(qmax) : scratch_p;
    /* Every vector the sweeps read starts on a 64-byte line: sizes rounded up to 16 floats. */
    const ptrdiff_t sizes[8] = {n * r, n, k * r, k, m * r, m * r, m, scratch};
    size_t floats = 0;
    for (int i = 0; i < 8; i++)
        floats += (size_t)ceil16(sizes[i]);
    float *buf = aligned_alloc(64, floats * sizeof(float) + 64);
    if (buf == NULL)
        return -1;
    float *part[8];
    size_t at = 0;
    for (int i = 0; i < 8; i++) {
        part[i] = buf + at;
        at += (size_t)ceil16(sizes[i]);
    }
    float *x = part[0], *ones = part[1], *y = part[2], *w = part[3], *cx = part[4];
    float *ay = part[5], *z = part[6], *work = part[7];

    for (ptrdiff_t j = 0; j < n; j++)
        for (int t = 0; t < r; t++) {
            const size_t bit = (size_t)t * (size_t)n + (size_t)j;
            x[j * r + t] = (bits[bit >> 3] >> (bit & 7)) & 1 ? -1.0f : 1.0f;
        }
    for (ptrdiff_t j = 0; j < n; j++)
        ones[j] = 1.0f;

    const th_matrix am = {a, m, k, trans_a, NULL, 0}, cm = {c, m, n, 0, a, m * k},
                    bm = {b, k, n, trans_b, c, m * n};
    pass(bm, x, r, ones, y, w, work); /* y = op(B) x, w = |op(B)| 1 */
    pass(cm, x, r, ones, cx, NULL, work); /* Cx; |C| is not needed (docs/validation.md) */
    if (!all_finite(w, k) || !all_finite(cx, m * r)) {
        out->nonfinite = why_not_finite(a, b, c, m, n, k);
    } else {
        pass(am, y, r, w, ay, z, work); /* op(A) y, z = |op(A)| w */
        if (!all_finite(z, m) || !all_finite(ay, m * r))
            out->nonfinite = why_not_finite(a, b, c, m, n, k);
    }
    if (out->nonfinite == 0) {
        double worst = -1.0;
        out->ok = 1;
        for (ptrdiff_t i = 0; i < m; i++) {
            const double tau = cz * (double)z[i] + c0;
            for (int t = 0; t < r; t++) {
                const double res = fabs((double)cx[i * r + t] - (double)ay[i * r + t]);
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
