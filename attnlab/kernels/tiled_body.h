/* The body of tiled.c for one real type, included once per type with REAL, SUF, EXP, LOG, TANH, LOWEST, GEMM_T and
   GEMM_PTR defined (float: sgemm_, double: dgemm_). Not a header of its own: only tiled.c includes it. */

#ifndef TILED_NAME
#define TILED_CAT_(a, b) a##_##b
#define TILED_CAT(a, b) TILED_CAT_(a, b)
#define TILED_NAME(name) TILED_CAT(name, SUF)
#endif

/* C (m, n) = alpha op(A) op(B) + beta C, column-major as BLAS (op 'T' on A only with 'N' on B). */
static void TILED_NAME(gemm)(const Args *a, char ta, char tb, int m, int n, int k, REAL alpha, const REAL *A, int lda,
                             const REAL *Bm, int ldb, REAL beta, REAL *C, int ldc) {
    if (m <= 0 || n <= 0) return;
    if (a->GEMM_PTR && k > 0) {
        ((GEMM_T)a->GEMM_PTR)(&ta, &tb, &m, &n, &k, &alpha, A, &lda, Bm, &ldb, &beta, C, &ldc);
        return;
    }
    for (int j = 0; j < n; ++j) {
        REAL *c = C + (int64_t)j * ldc;
        if (beta == 0) {
            for (int i = 0; i < m; ++i) c[i] = 0;
        } else if (beta != 1) {
            for (int i = 0; i < m; ++i) c[i] *= beta;
        }
        if (ta == 'N') {
            for (int l = 0; l < k; ++l) {
                const REAL bl = alpha * (tb == 'N' ? Bm[l + (int64_t)j * ldb] : Bm[j + (int64_t)l * ldb]);
                const REAL *al = A + (int64_t)l * lda;
                for (int i = 0; i < m; ++i) c[i] += bl * al[i];
            }
        } else { /* A^T B, B 'N': a dot product per entry */
            const REAL *bj = Bm + (int64_t)j * ldb;
            for (int i = 0; i < m; ++i) {
                const REAL *ai = A + (int64_t)i * lda;
                REAL acc = 0;
                for (int l = 0; l < k; ++l) acc += ai[l] * bj[l];
                c[i] += alpha * acc;
            }
        }
    }
}

/* x[j - j0] += T[clamp(j - i, clo, chi) - clo] for the keys j in [a0, a1). */
static inline void TILED_NAME(add_bias)(REAL *x, const REAL *t, int64_t i, int64_t j0, int64_t a0, int64_t a1,
                                        int64_t clo, int64_t chi) {
    const int64_t ja = i + clo, jb = i + chi + 1; /* offsets below clo: [.., ja); above chi: [jb, ..) */
    const int64_t e1 = a1 < ja ? a1 : ja;
    for (int64_t j = a0; j < e1; ++j) x[j - j0] += t[0];
    const int64_t s2 = a0 > ja ? a0 : ja, e2 = a1 < jb ? a1 : jb;
    const int64_t shift = i + clo; /* T's column of key j: j - shift */
    for (int64_t j = s2; j < e2; ++j) x[j - j0] += t[j - shift];
    const int64_t s3 = a0 > jb ? a0 : jb;
    for (int64_t j = s3; j < a1; ++j) x[j - j0] += t[chi - clo];
}

/* dT[clamp(j - i, clo, chi) - clo] += g[j - j0] for the keys j in [a0, a1). */
static inline void TILED_NAME(add_bias_grad)(REAL *dt, const REAL *g, int64_t i, int64_t j0, int64_t a0, int64_t a1,
                                             int64_t clo, int64_t chi) {
    const int64_t ja = i + clo, jb = i + chi + 1;
    const int64_t e1 = a1 < ja ? a1 : ja;
    REAL acc = 0;
    for (int64_t j = a0; j < e1; ++j) acc += g[j - j0];
    dt[0] += acc;
    const int64_t s2 = a0 > ja ? a0 : ja, e2 = a1 < jb ? a1 : jb;
    const int64_t shift = i + clo;
    for (int64_t j = s2; j < e2; ++j) dt[j - shift] += g[j - j0];
    const int64_t s3 = a0 > jb ? a0 : jb;
    acc = 0;
    for (int64_t j = s3; j < a1; ++j) acc += g[j - j0];
    dt[chi - clo] += acc;
}

/* σ(y) = e^{min(y, 0)} / (1 + e^{−|y|}): e^{−|y|} lies in (0, 1], so nothing overflows for any finite y (the plain
   1 / (1 + e^{−y}) overflows e^{−y} to inf below y ≈ −88 in float32, and -ffast-math's reciprocal of inf is NaN).
   Branch-free: two selects, one exp, one division, vectorised as the plain form was. */
static inline REAL TILED_NAME(sigmoid)(REAL y) {
    const REAL e = EXP(y > 0 ? -y : y);
    return (y > 0 ? (REAL)1 : e) / ((REAL)1 + e);
}

/* The modified logits of row i over its visible part [a0, a1) of the block [j0, j0 + nk): the bias, the cap (cf,
   when not NULL, gets 1 - tanh^2, the cap's derivative); 0 outside [a0, a1). Returns the row's visible range
   through a0, a1 (a0 >= a1: none). */
static inline void TILED_NAME(modify)(const Args *a, REAL *x, REAL *cf, int64_t b, int64_t h, int64_t i, int64_t j0,
                                      int64_t nk, int64_t *pa0, int64_t *pa1) {
    int64_t a0 = j0, a1 = j0 + nk;
    if (a->lo) {
        a0 = a->lo[i] > a0 ? a->lo[i] : a0;
        a1 = a->hi[i] < a1 ? a->hi[i] : a1;
    }
    if (a0 >= a1) a0 = a1 = j0;
    for (int64_t j = j0; j < a0; ++j) x[j - j0] = 0;
    for (int64_t j = a1; j < j0 + nk; ++j) x[j - j0] = 0;
    if (cf) { /* (the hidden keys' factor multiplies a zero gradient: keep it finite) */
        for (int64_t j = j0; j < a0; ++j) cf[j - j0] = 0;
        for (int64_t j = a1; j < j0 + nk; ++j) cf[j - j0] = 0;
    }
    if (a->table) {
        const REAL *t = (const REAL *)a->table + b * a->ts[0] + h * a->ts[1] + i * a->ts[2];
        TILED_NAME(add_bias)(x, t, i, j0, a0, a1, a->clo, a->chi);
    }
    if (a->cap > 0) {
        const REAL c = (REAL)a->cap, ic = (REAL)1 / c;
        if (cf) {
            for (int64_t j = a0; j < a1; ++j) {
                const REAL t = TANH(x[j - j0] * ic);
                x[j - j0] = c * t;
                cf[j - j0] = (REAL)1 - t * t;
            }
        } else {
            for (int64_t j = a0; j < a1; ++j) x[j - j0] = c * TANH(x[j - j0] * ic);
        }
    }
    *pa0 = a0, *pa1 = a1;
}

static void TILED_NAME(fwd)(Job *job) {
    const Args *a = job->a;
    const int64_t H = a->H, Lq = a->Lq, Lk = a->Lk, d = a->d, dv = a->dv, BQ = a->BQ, BK = a->BK;
    const int64_t nqb = (Lq + BQ - 1) / BQ, group = H / a->G;
    REAL *S = job->scratch, *m = S + BQ * BK, *l = m + BQ;
    for (int64_t item = job->begin; item < job->end; ++item) {
        const int64_t qb = item % nqb, bh = item / nqb, h = bh % H, b = bh / H, g = h / group;
        const int64_t i0 = qb * BQ, nq = Lq - i0 < BQ ? Lq - i0 : BQ;
        const REAL *Q = (const REAL *)a->q + (bh * Lq + i0) * d;
        const REAL *K = (const REAL *)a->k + (b * a->G + g) * Lk * d;
        const REAL *V = (const REAL *)a->v + (b * a->G + g) * Lk * dv;
        REAL *O = (REAL *)a->z + (bh * Lq + i0) * dv;
        REAL *lse = (REAL *)a->lse + bh * Lq + i0;
        const uint8_t *kr = a->keys ? a->keys + b * Lk : NULL;
        const REAL sink = a->sink ? ((const REAL *)a->sink)[h] : LOWEST;
        const REAL *rb = a->row_bias ? (const REAL *)a->row_bias + b * a->rbs : NULL;
        for (int64_t r = 0; r < nq; ++r) m[r] = sink, l[r] = a->sink ? 1 : 0;
        memset(O, 0, sizeof(REAL) * (size_t)(nq * dv));
        int64_t klo, khi;
        block_keys(a, b, i0, i0 + nq, &klo, &khi);
        for (int64_t j0 = klo; j0 < khi; j0 += BK) {
            const int64_t nk = khi - j0 < BK ? khi - j0 : BK;
            if (!block_has_keys(a, b, j0, j0 + nk)) continue;
            TILED_NAME(gemm)(a, 'T', 'N', (int)nk, (int)nq, (int)d, (REAL)a->scale, K + j0 * d, (int)d, Q, (int)d, 0, S,
                             (int)nk);
            for (int64_t r = 0; r < nq; ++r) {
                const int64_t i = i0 + r;
                REAL *x = S + r * nk;
                int64_t a0, a1;
                TILED_NAME(modify)(a, x, NULL, b, h, i, j0, nk, &a0, &a1);
                if (a->normalizer == 1) { /* sigmoid: no row statistics */
                    const REAL bias = rb[i];
                    if (kr) {
                        for (int64_t j = a0; j < a1; ++j)
                            x[j - j0] = kr[j] ? TILED_NAME(sigmoid)(x[j - j0] + bias) : (REAL)0;
                    } else {
                        for (int64_t j = a0; j < a1; ++j) x[j - j0] = TILED_NAME(sigmoid)(x[j - j0] + bias);
                    }
                    continue;
                }
                REAL mx = LOWEST;
                if (kr) {
                    for (int64_t j = a0; j < a1; ++j) mx = kr[j] && x[j - j0] > mx ? x[j - j0] : mx;
                } else {
                    for (int64_t j = a0; j < a1; ++j) mx = x[j - j0] > mx ? x[j - j0] : mx;
                }
                if (mx == LOWEST) { /* no visible key here */
                    for (int64_t j = a0; j < a1; ++j) x[j - j0] = 0;
                    continue;
                }
                const REAL mnew = mx > m[r] ? mx : m[r];
                const REAL alpha = m[r] == LOWEST ? (REAL)0 : EXP(m[r] - mnew);
                REAL sum = 0;
                if (kr) {
                    for (int64_t j = a0; j < a1; ++j) {
                        const REAL e = kr[j] ? EXP(x[j - j0] - mnew) : (REAL)0;
                        x[j - j0] = e;
                        sum += e;
                    }
                } else {
                    for (int64_t j = a0; j < a1; ++j) {
                        const REAL e = EXP(x[j - j0] - mnew);
                        x[j - j0] = e;
                        sum += e;
                    }
                }
                l[r] = l[r] * alpha + sum;
                m[r] = mnew;
                if (alpha != (REAL)1) {
                    REAL *o = O + r * dv;
                    for (int64_t c = 0; c < dv; ++c) o[c] *= alpha;
                }
            }
            TILED_NAME(gemm)(a, 'N', 'N', (int)dv, (int)nq, (int)nk, 1, V + j0 * dv, (int)dv, S, (int)nk, 1, O, (int)dv);
        }
        for (int64_t r = 0; r < nq; ++r) {
            if (a->normalizer == 1) {
                lse[r] = 0;
                continue;
            }
            const REAL inv = l[r] > 0 ? (REAL)1 / l[r] : (REAL)0;
            REAL *o = O + r * dv;
            for (int64_t c = 0; c < dv; ++c) o[c] *= inv;
            lse[r] = l[r] > 0 ? m[r] + LOG(l[r]) : (REAL)0;
        }
    }
}

/* The tile's weights P (nq, nk), recomputed from the rows' log-sum-exp (softmax) or their bias (sigmoid): 0 for
   hidden keys; cf (or NULL) gets the cap's factor. Q is the block's first query row, K the keys' first row. */
static void TILED_NAME(weights)(const Args *a, REAL *P, REAL *cf, const REAL *Q, const REAL *K, const REAL *lse,
                                int64_t b, int64_t h, int64_t i0, int64_t nq, int64_t j0, int64_t nk) {
    const uint8_t *kr = a->keys ? a->keys + b * a->Lk : NULL;
    const REAL *rb = a->row_bias ? (const REAL *)a->row_bias + b * a->rbs : NULL;
    TILED_NAME(gemm)(a, 'T', 'N', (int)nk, (int)nq, (int)a->d, (REAL)a->scale, K + j0 * a->d, (int)a->d, Q, (int)a->d,
                     0, P, (int)nk);
    for (int64_t r = 0; r < nq; ++r) {
        const int64_t i = i0 + r;
        REAL *x = P + r * nk;
        int64_t a0, a1;
        TILED_NAME(modify)(a, x, cf ? cf + r * nk : NULL, b, h, i, j0, nk, &a0, &a1);
        if (a->normalizer == 1) {
            const REAL bias = rb[i];
            if (kr) { /* (two loops, as in the forward pass: one condition more and it is no longer vectorised) */
                for (int64_t j = a0; j < a1; ++j) x[j - j0] = kr[j] ? TILED_NAME(sigmoid)(x[j - j0] + bias) : (REAL)0;
            } else {
                for (int64_t j = a0; j < a1; ++j) x[j - j0] = TILED_NAME(sigmoid)(x[j - j0] + bias);
            }
        } else {
            const REAL s = lse[r];
            for (int64_t j = a0; j < a1; ++j) {
                const REAL p = EXP(x[j - j0] - s);
                x[j - j0] = !kr || kr[j] ? p : (REAL)0;
            }
        }
    }
}

/* The tile's score gradient dS into out (which may be P or dP itself), from the weights P and dP = dZ V^T scaled by
   c (a map's share of the output: 1, or -lambda for differential attention's second map): p (c dP - D_i) for a
   softmax, c dP p (1 - p) for sigmoid, times the cap's factor cf (or NULL); the bias table's gradient added to dt
   (or NULL). */
static void TILED_NAME(dscores)(const Args *a, REAL *out, const REAL *P, const REAL *dP, REAL c, const REAL *cf,
                                const REAL *D, REAL *dt, int64_t i0, int64_t nq, int64_t j0, int64_t nk) {
    for (int64_t r = 0; r < nq; ++r) {
        const int64_t i = i0 + r;
        const REAL *p = P + r * nk, *g = dP + r * nk;
        REAL *gr = out + r * nk;
        if (a->normalizer == 1) {
            for (int64_t j = 0; j < nk; ++j) gr[j] = c * g[j] * p[j] * ((REAL)1 - p[j]);
        } else {
            const REAL di = D[r];
            for (int64_t j = 0; j < nk; ++j) gr[j] = p[j] * (c * g[j] - di);
        }
        if (cf) {
            const REAL *cr = cf + r * nk;
            for (int64_t j = 0; j < nk; ++j) gr[j] *= cr[j];
        }
        if (dt) {
            int64_t a0 = j0, a1 = j0 + nk;
            if (a->lo) {
                a0 = a->lo[i] > a0 ? a->lo[i] : a0;
                a1 = a->hi[i] < a1 ? a->hi[i] : a1;
            }
            if (a0 < a1) TILED_NAME(add_bias_grad)(dt + i * a->dts[2], gr, i, j0, a0, a1, a->clo, a->chi);
        }
    }
}

/* dQ += scale dS K; dK += scale dS^T Q for one tile. */
static inline void TILED_NAME(dqdk)(const Args *a, const REAL *dS, const REAL *Q, const REAL *K, REAL *dQ, REAL *dK,
                                    int64_t nq, int64_t j0, int64_t nk) {
    const int d = (int)a->d;
    TILED_NAME(gemm)(a, 'N', 'N', d, (int)nq, (int)nk, (REAL)a->scale, K + j0 * d, d, dS, (int)nk, 1, dQ, d);
    TILED_NAME(gemm)(a, 'N', 'T', d, (int)nk, (int)nq, (REAL)a->scale, Q, d, dS, (int)nk, 1, dK + j0 * d, d);
}

/* The backward pass over the items (b, key/value head). With job->a2 (differential attention, Ye et al. 2024), a is
   the first map and a2 the second, z = z1 - lambda z2 over the same values: both maps' weights are recomputed, and
   the two products with the values are shared, dV += (P1 - lambda P2)^T dZ and dP = dZ V^T (each map's dP is its
   share of it), 8 block products instead of two passes' 10. */
static void TILED_NAME(bwd)(Job *job) {
    const Args *a = job->a, *a2 = job->a2;
    const int64_t H = a->H, G = a->G, Lq = a->Lq, Lk = a->Lk, d = a->d, dv = a->dv, BQ = a->BQ, BK = a->BK;
    const int64_t group = H / G, tile = BQ * BK;
    const REAL lam = (REAL)job->lam;
    const int capped = a->cap > 0;
    REAL *P = job->scratch, *dP = P + tile, *cf = capped ? dP + tile : NULL;
    REAL *P2 = dP + 2 * tile, *cf2 = capped ? P2 + tile : NULL, *Pc = P2 + 2 * tile; /* (a2 only) */
    for (int64_t item = job->begin; item < job->end; ++item) {
        const int64_t g = item % G, b = item / G, kvo = (b * G + g) * Lk;
        const REAL *K = (const REAL *)a->k + kvo * d, *V = (const REAL *)a->v + kvo * dv;
        REAL *dK = (REAL *)a->dk + kvo * d, *dV = (REAL *)a->dvv + kvo * dv;
        const REAL *K2 = a2 ? (const REAL *)a2->k + kvo * d : NULL;
        REAL *dK2 = a2 ? (REAL *)a2->dk + kvo * d : NULL;
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            const int64_t bh = b * H + h;
            REAL *dt = a->dtable ? (REAL *)a->dtable + b * a->dts[0] + h * a->dts[1] : NULL;
            REAL *dt2 = a2 && a2->dtable ? (REAL *)a2->dtable + b * a2->dts[0] + h * a2->dts[1] : NULL;
            for (int64_t i0 = 0; i0 < Lq; i0 += BQ) {
                const int64_t nq = Lq - i0 < BQ ? Lq - i0 : BQ, qo = bh * Lq + i0;
                const REAL *Q = (const REAL *)a->q + qo * d, *lse = (const REAL *)a->lse + qo;
                const REAL *dZ = (const REAL *)a->dz + qo * dv, *D = (const REAL *)a->delta + qo;
                REAL *dQ = (REAL *)a->dq + qo * d;
                int64_t klo, khi;
                block_keys(a, b, i0, i0 + nq, &klo, &khi);
                for (int64_t j0 = klo; j0 < khi; j0 += BK) {
                    const int64_t nk = khi - j0 < BK ? khi - j0 : BK;
                    if (!block_has_keys(a, b, j0, j0 + nk)) continue;
                    TILED_NAME(weights)(a, P, cf, Q, K, lse, b, h, i0, nq, j0, nk);
                    const REAL *W = P;
                    if (a2) { /* the second map's weights, and the combined ones the values see */
                        TILED_NAME(weights)(a2, P2, cf2, (const REAL *)a2->q + qo * d, K2, (const REAL *)a2->lse + qo,
                                            b, h, i0, nq, j0, nk);
                        for (int64_t e = 0; e < nq * nk; ++e) Pc[e] = P[e] - lam * P2[e];
                        W = Pc;
                    }
                    /* dV += W^T dZ; dP = dZ V^T */
                    TILED_NAME(gemm)(a, 'N', 'T', (int)dv, (int)nk, (int)nq, 1, dZ, (int)dv, W, (int)nk, 1, dV + j0 * dv,
                                     (int)dv);
                    TILED_NAME(gemm)(a, 'T', 'N', (int)nk, (int)nq, (int)dv, 1, V + j0 * dv, (int)dv, dZ, (int)dv, 0, dP,
                                     (int)nk);
                    if (!a2) {
                        TILED_NAME(dscores)(a, dP, P, dP, 1, cf, D, dt, i0, nq, j0, nk);
                        TILED_NAME(dqdk)(a, dP, Q, K, dQ, dK, nq, j0, nk);
                        continue;
                    }
                    TILED_NAME(dscores)(a, P, P, dP, 1, cf, D, dt, i0, nq, j0, nk);
                    TILED_NAME(dscores)(a2, P2, P2, dP, -lam, cf2, (const REAL *)a2->delta + qo, dt2, i0, nq, j0, nk);
                    TILED_NAME(dqdk)(a, P, Q, K, dQ, dK, nq, j0, nk);
                    TILED_NAME(dqdk)(a2, P2, (const REAL *)a2->q + qo * d, K2, (REAL *)a2->dq + qo * d, dK2, nq, j0,
                                     nk);
                }
            }
        }
    }
}
