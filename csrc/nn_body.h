/* The arithmetic of the model kernels, written once over 16-lane GCC vectors.
 *
 * nn_impl.c includes this file once per instruction set, with NN(name) giving each copy its
 * own names and a `#pragma GCC target` around it; the compiler lowers the 16-lane vectors to
 * one AVX-512 register, two AVX2 registers or four SSE registers.  Lanes only ever hold
 * different elements, every operation is a single IEEE float32 (or float64) +, -, *, / or
 * sqrt, and -ffp-contract=off forbids fusing them, so every copy gives the same bits as the
 * others and as kernels/nn_reference.py.  The order of arithmetic is in docs/kernels.md.
 */

#define AI static inline __attribute__((always_inline))

AI v16f NN(load)(const float *p, ptrdiff_t k, float fill)
{
    v16f v;
    if (k >= 16) {
        memcpy(&v, p, sizeof v);
        return v;
    }
    for (int l = 0; l < 16; l++)
        v[l] = l < k ? p[l] : fill;
    return v;
}

AI void NN(store)(float *p, v16f v, ptrdiff_t k)
{
    if (k >= 16) {
        memcpy(p, &v, sizeof v);
        return;
    }
    for (ptrdiff_t l = 0; l < k; l++)
        p[l] = v[l];
}

AI v16f NN(select)(v16i mask, v16f a, v16f b)
{
    return (v16f)(((v16i)a & mask) | ((v16i)b & ~mask));
}

/* Lanes at or past k (the end of a row) hold `fill`, so they add or compare as nothing. */
AI v16f NN(keep)(v16f v, ptrdiff_t k, float fill)
{
    if (k >= 16)
        return v;
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return NN(select)(lane < (int32_t)k, v, SPLAT(fill));
}

/* The fixed combine tree of the 16 lanes: (l, l+8), then (l, l+4), (l, l+2), (l, l+1). */
AI float NN(tree)(v16f a)
{
    float h[8];
    for (int l = 0; l < 8; l++)
        h[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; l++)
        h[l] = h[l] + h[l + 4];
    for (int l = 0; l < 2; l++)
        h[l] = h[l] + h[l + 2];
    return h[0] + h[1];
}

AI float NN(max2)(float a, float b) { return b > a ? b : a; }

AI float NN(tree_max)(v16f a)
{
    float h[8];
    for (int l = 0; l < 8; l++)
        h[l] = NN(max2)(a[l], a[l + 8]);
    for (int l = 0; l < 4; l++)
        h[l] = NN(max2)(h[l], h[l + 4]);
    for (int l = 0; l < 2; l++)
        h[l] = NN(max2)(h[l], h[l + 2]);
    return NN(max2)(h[0], h[1]);
}

AI double NN(tree_d)(v16d a)
{
    double h[8];
    for (int l = 0; l < 8; l++)
        h[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; l++)
        h[l] = h[l] + h[l + 4];
    for (int l = 0; l < 2; l++)
        h[l] = h[l] + h[l + 2];
    return h[0] + h[1];
}

AI v16f NN(sqrt)(v16f v)
{
#if defined(NN_AVX512)
    return (v16f)_mm512_sqrt_ps((__m512)v);
#elif defined(NN_AVX2)
    __m256 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    lo = _mm256_sqrt_ps(lo);
    hi = _mm256_sqrt_ps(hi);
    memcpy(&v, &lo, sizeof lo);
    memcpy((char *)&v + sizeof lo, &hi, sizeof hi);
    return v;
#else
    for (int l = 0; l < 16; l++)
        v[l] = __builtin_sqrtf(v[l]);
    return v;
#endif
}

/* exp(x): clamp, n = round(x / ln 2) by the 1.5 * 2^23 trick, r = x - n ln 2 in two parts
 * (Cody-Waite), a degree-5 polynomial (Cephes expf), times 2^n built from the bits.  Below
 * EXP_LO (where the result would not be a normal float) the result is +0; above EXP_HI it
 * saturates at exp(EXP_HI); a NaN stays NaN. */
AI v16f NN(exp)(v16f x)
{
    v16f xc = NN(select)(x < EXP_LO, SPLAT(EXP_LO), x);
    xc = NN(select)(xc > EXP_HI, SPLAT(EXP_HI), xc);
    v16f t = xc * LOG2E;
    t = t + MAGIC;
    const v16f nf = t - MAGIC;
    v16f r = xc - nf * LN2_HI;
    r = r - nf * LN2_LO;
    v16f p = r * EP0;
    p = p + EP1;
    p = p * r + EP2;
    p = p * r + EP3;
    p = p * r + EP4;
    p = p * r + EP5;
    v16f y = p * (r * r);
    y = y + r;
    y = y + 1.0f;
    const v16u n = (v16u)t - MAGIC_BITS;
    const v16f two_n = (v16f)((n + 127u) << 23);
    y = y * two_n;
    return NN(select)(x < EXP_LO, SPLAT(0.0f), y);
}

/* tanh(z): for |z| < 0.625 an odd polynomial (Cephes tanhf), otherwise 1 - 2 / (exp(2|z|)
 * + 1) with |z| clamped to 9 (where tanh rounds to 1) and z's sign put back. */
AI v16f NN(tanh)(v16f z)
{
    const v16u sign = (v16u)z & 0x80000000u;
    const v16f a = (v16f)((v16u)z & 0x7fffffffu);
    const v16f s = z * z;
    v16f p = s * TH0;
    p = p + TH1;
    p = p * s + TH2;
    p = p * s + TH3;
    p = p * s + TH4;
    v16f small = (p * s) * z;
    small = small + z;
    const v16f ac = NN(select)(a > TH_CLAMP, SPLAT(TH_CLAMP), a);
    const v16f e = NN(exp)(ac + ac);
    v16f big = 2.0f / (e + 1.0f);
    big = 1.0f - big;
    big = (v16f)((v16u)big | sign);
    return NN(select)(a < TH_SMALL, small, big);
}

/* log(x) for a positive normal float (Cephes logf): x = m 2^e with m in [sqrt(1/2),
 * sqrt(2)), a degree-8 polynomial in m - 1, e ln 2 added in two parts. */
AI float NN(log)(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    int e = (int)((bits >> 23) & 0xffu) - 126;
    bits = (bits & 0x007fffffu) | 0x3f000000u;
    float m;
    memcpy(&m, &bits, sizeof m);
    if (m < SQRTHF) {
        e -= 1;
        m = m + m;
        m = m - 1.0f;
    } else {
        m = m - 1.0f;
    }
    const float fe = (float)e;
    const float z = m * m;
    float p = m * LP0;
    p = p + LP1;
    p = p * m + LP2;
    p = p * m + LP3;
    p = p * m + LP4;
    p = p * m + LP5;
    p = p * m + LP6;
    p = p * m + LP7;
    p = p * m + LP8;
    float y = (p * m) * z;
    y = y + fe * LN2_LO;
    y = y - z * 0.5f;
    float r = m + y;
    return r + fe * LN2_HI;
}

/* ---- the kernels ------------------------------------------------------------------------ */

static void NN(gelu_fwd)(float *x, const float *bias, float *y, float *t, ptrdiff_t r0,
                         ptrdiff_t r1, ptrdiff_t n)
{
    for (ptrdiff_t r = r0; r < r1; r++) {
        float *xr = x + r * n, *yr = y + r * n, *tr = t + r * n;
        for (ptrdiff_t j = 0; j < n; j += 16) {
            const ptrdiff_t k = n - j;
            v16f v = NN(load)(xr + j, k, 0.0f);
            if (bias != NULL) {
                v = v + NN(load)(bias + j, k, 0.0f);
                NN(store)(xr + j, v, k);
            }
            v16f inner = (v * v) * v;
            inner = inner * GELU_K;
            inner = v + inner;
            const v16f th = NN(tanh)(inner * GELU_C);
            const v16f out = (v * 0.5f) * (th + 1.0f);
            NN(store)(tr + j, th, k);
            NN(store)(yr + j, out, k);
        }
    }
}

static void NN(gelu_bwd)(const float *dy, const float *x, const float *t, float *dx,
                         ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n)
{
    for (ptrdiff_t e = r0 * n; e < r1 * n; e += 16) {
        const ptrdiff_t k = r1 * n - e;
        const v16f v = NN(load)(x + e, k, 0.0f);
        const v16f th = NN(load)(t + e, k, 0.0f);
        const v16f h = (th + 1.0f) * 0.5f;
        const v16f s = 1.0f - th * th;
        const v16f q = (v * v) * GELU_K3 + 1.0f;
        v16f r = (v * 0.5f) * s;
        r = r * GELU_C;
        r = r * q;
        NN(store)(dx + e, NN(load)(dy + e, k, 0.0f) * (h + r), k);
    }
}

static void NN(layernorm_fwd)(const float *x, const float *g, const float *b, float eps,
                              float *y, float *xhat, float *inv, ptrdiff_t r0, ptrdiff_t r1,
                              ptrdiff_t n)
{
    const float count = (float)n;
    for (ptrdiff_t r = r0; r < r1; r++) {
        const float *xr = x + r * n;
        v16f acc = SPLAT(0.0f);
        for (ptrdiff_t j = 0; j < n; j += 16)
            acc = acc + NN(load)(xr + j, n - j, 0.0f);
        const float mean = NN(tree)(acc) / count;
        acc = SPLAT(0.0f);
        for (ptrdiff_t j = 0; j < n; j += 16) {
            const v16f c = NN(load)(xr + j, n - j, 0.0f) - mean;
            acc = acc + NN(keep)(c * c, n - j, 0.0f);
        }
        const float var = NN(tree)(acc) / count;
        const float iv = 1.0f / __builtin_sqrtf(var + eps);
        inv[r] = iv;
        for (ptrdiff_t j = 0; j < n; j += 16) {
            const ptrdiff_t k = n - j;
            const v16f h = (NN(load)(xr + j, k, 0.0f) - mean) * iv;
            NN(store)(xhat + r * n + j, h, k);
            NN(store)(y + r * n + j, h * NN(load)(g + j, k, 0.0f) + NN(load)(b + j, k, 0.0f),
                      k);
        }
    }
}

static void NN(layernorm_bwd)(const float *dy, const float *xhat, const float *inv,
                              const float *g, float *dx, ptrdiff_t r0, ptrdiff_t r1,
                              ptrdiff_t n)
{
    const float count = (float)n;
    for (ptrdiff_t r = r0; r < r1; r++) {
        const float *dr = dy + r * n, *hr = xhat + r * n;
        v16f acc1 = SPLAT(0.0f), acc2 = SPLAT(0.0f);
        for (ptrdiff_t j = 0; j < n; j += 16) {
            const ptrdiff_t k = n - j;
            const v16f d = NN(load)(dr + j, k, 0.0f) * NN(load)(g + j, k, 0.0f);
            acc1 = acc1 + d;
            acc2 = acc2 + d * NN(load)(hr + j, k, 0.0f);
        }
        const float m1 = NN(tree)(acc1) / count;
        const float m2 = NN(tree)(acc2) / count;
        const float iv = inv[r];
        for (ptrdiff_t j = 0; j < n; j += 16) {
            const ptrdiff_t k = n - j;
            const v16f d = NN(load)(dr + j, k, 0.0f) * NN(load)(g + j, k, 0.0f);
            const v16f h = NN(load)(hr + j, k, 0.0f);
            NN(store)(dx + r * n + j, ((d - m1) - h * m2) * iv, k);
        }
    }
}

/* Column sums: rows in blocks of COLSUM_BLOCK, each block summed top-down from +0, then the
 * block sums added top-down from +0.  Lanes hold 16 neighbouring columns. */
static void NN(colsum)(const float *a, const float *b, float *out, ptrdiff_t rows,
                       ptrdiff_t cols, ptrdiff_t c0, ptrdiff_t c1)
{
    for (ptrdiff_t c = c0; c < c1; c += 16) {
        const ptrdiff_t k = c1 - c;
        v16f total = SPLAT(0.0f);
        for (ptrdiff_t r = 0; r < rows; r += COLSUM_BLOCK) {
            const ptrdiff_t end = r + COLSUM_BLOCK < rows ? r + COLSUM_BLOCK : rows;
            v16f part = SPLAT(0.0f);
            for (ptrdiff_t i = r; i < end; i++) {
                v16f v = NN(load)(a + i * cols + c, k, 0.0f);
                if (b != NULL)
                    v = v * NN(load)(b + i * cols + c, k, 0.0f);
                part = part + v;
            }
            total = total + part;
        }
        NN(store)(out + c, total, k);
    }
}

static void NN(add_bias)(float *x, const float *bias, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n)
{
    for (ptrdiff_t r = r0; r < r1; r++)
        for (ptrdiff_t j = 0; j < n; j += 16) {
            const ptrdiff_t k = n - j;
            NN(store)(x + r * n + j,
                      NN(load)(x + r * n + j, k, 0.0f) + NN(load)(bias + j, k, 0.0f), k);
        }
}

/* One row of a softmax over its first `len` entries, z = s * scale; the rest of the row is
 * written +0.  The max and the sum go through the 16 lanes by column index and the tree. */
AI void NN(softmax_row)(const float *s, float scale, float *p, ptrdiff_t len, ptrdiff_t n)
{
    v16f acc = SPLAT(-INFINITY);
    for (ptrdiff_t j = 0; j < len; j += 16) {
        const v16f z = NN(keep)(NN(load)(s + j, len - j, 0.0f) * scale, len - j, -INFINITY);
        acc = NN(select)(z > acc, z, acc);
    }
    const float mx = NN(tree_max)(acc);
    acc = SPLAT(0.0f);
    for (ptrdiff_t j = 0; j < len; j += 16) {
        const v16f z = NN(load)(s + j, len - j, 0.0f) * scale;
        const v16f e = NN(keep)(NN(exp)(z - mx), len - j, 0.0f);
        NN(store)(p + j, e, len - j);
        acc = acc + e;
    }
    const float total = NN(tree)(acc);
    for (ptrdiff_t j = 0; j < len; j += 16)
        NN(store)(p + j, NN(load)(p + j, len - j, 0.0f) / total, len - j);
    if (len < n)
        memset(p + len, 0, (size_t)(n - len) * sizeof(float));
}

static void NN(softmax_fwd)(const float *s, float scale, int causal, float *p, ptrdiff_t r0,
                            ptrdiff_t r1, ptrdiff_t n)
{
    for (ptrdiff_t r = r0; r < r1; r++) {
        const ptrdiff_t len = causal ? r % n + 1 : n;
        NN(softmax_row)(s + r * n, scale, p + r * n, len, n);
    }
}

static void NN(softmax_bwd)(const float *p, const float *dp, float scale, int causal,
                            float *ds, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t n)
{
    for (ptrdiff_t r = r0; r < r1; r++) {
        const ptrdiff_t len = causal ? r % n + 1 : n;
        const float *pr = p + r * n, *dr = dp + r * n;
        v16f acc = SPLAT(0.0f);
        for (ptrdiff_t j = 0; j < len; j += 16)
            acc = acc + NN(load)(dr + j, len - j, 0.0f) * NN(load)(pr + j, len - j, 0.0f);
        const float dot = NN(tree)(acc);
        for (ptrdiff_t j = 0; j < len; j += 16) {
            const ptrdiff_t k = len - j;
            const v16f d = NN(load)(dr + j, k, 0.0f) - dot;
            NN(store)(ds + r * n + j, (NN(load)(pr + j, k, 0.0f) * d) * scale, k);
        }
        if (len < n)
            memset(ds + r * n + len, 0, (size_t)(n - len) * sizeof(float));
    }
}

static void NN(cross_entropy)(const float *logits, const int64_t *targets, float count,
                              float *loss, float *dlogits, ptrdiff_t r0, ptrdiff_t r1,
                              ptrdiff_t n)
{
    for (ptrdiff_t r = r0; r < r1; r++) {
        const float *lr = logits + r * n;
        float *dr = dlogits + r * n;
        const ptrdiff_t target = (ptrdiff_t)targets[r];
        v16f acc = SPLAT(-INFINITY);
        for (ptrdiff_t j = 0; j < n; j += 16) {
            const v16f z = NN(keep)(NN(load)(lr + j, n - j, 0.0f), n - j, -INFINITY);
            acc = NN(select)(z > acc, z, acc);
        }
        const float mx = NN(tree_max)(acc);
        acc = SPLAT(0.0f);
        for (ptrdiff_t j = 0; j < n; j += 16) {
            const v16f e = NN(keep)(NN(exp)(NN(load)(lr + j, n - j, 0.0f) - mx), n - j, 0.0f);
            NN(store)(dr + j, e, n - j);
            acc = acc + e;
        }
        const float total = NN(tree)(acc);
        loss[r] = NN(log)(total) - (lr[target] - mx);
        const float hit = dr[target];
        for (ptrdiff_t j = 0; j < n; j += 16)
            NN(store)(dr + j, (NN(load)(dr + j, n - j, 0.0f) / total) / count, n - j);
        dr[target] = ((hit / total) - 1.0f) / count;
    }
}

static float NN(sum)(const float *x, ptrdiff_t n)
{
    v16f acc = SPLAT(0.0f);
    for (ptrdiff_t j = 0; j < n; j += 16)
        acc = acc + NN(load)(x + j, n - j, 0.0f);
    return NN(tree)(acc);
}

static double NN(sumsq)(const float *x, ptrdiff_t n)
{
    v16d acc = {0};
    for (ptrdiff_t j = 0; j < n; j += 16) {
        const v16d d = __builtin_convertvector(NN(load)(x + j, n - j, 0.0f), v16d);
        acc = acc + d * d;
    }
    return NN(tree_d)(acc);
}

static void NN(adamw)(const float *p, const float *g, const float *m, const float *v,
                      float *p_out, float *m_out, float *v_out, ptrdiff_t e0, ptrdiff_t e1,
                      const thn_adam *h, int decay)
{
    for (ptrdiff_t e = e0; e < e1; e += 16) {
        const ptrdiff_t k = e1 - e;
        const v16f gs = NN(load)(g + e, k, 0.0f) * h->scale;
        const v16f mn = NN(load)(m + e, k, 0.0f) * h->beta1 + gs * h->one_minus_beta1;
        const v16f vn = NN(load)(v + e, k, 0.0f) * h->beta2 + (gs * h->one_minus_beta2) * gs;
        v16f u = (mn / h->correction1) / (NN(sqrt)(vn / h->correction2) + h->eps);
        const v16f pv = NN(load)(p + e, k, 0.0f);
        if (decay)
            u = u + pv * h->weight_decay;
        NN(store)(p_out + e, pv - u * h->lr, k);
        NN(store)(m_out + e, mn, k);
        NN(store)(v_out + e, vn, k);
    }
}

static const thn_impl NN(impl) = {
    NN_NAME,           NN(supported),     NN(gelu_fwd),      NN(gelu_bwd),
    NN(layernorm_fwd), NN(layernorm_bwd), NN(colsum),        NN(add_bias),
    NN(softmax_fwd),   NN(softmax_bwd),   NN(cross_entropy), NN(sum),
    NN(sumsq),         NN(adamw),
};

#undef AI
