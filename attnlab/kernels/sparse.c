/* Row normalizers on the CPU, for attnlab.kernels.sparse: sparsemax, 1.5-entmax and softpick over the last dimension
   (keys) of (B, H, Lq, Lk) logits, forward and backward, exact (no sorting).

   forward:  W <- N(S) row by row (W may be S: in place). Keys the allowed mask hides get exactly 0; a row that sees
             no key gets all zeros. Each row is first copied to W with hidden keys at a sentinel far below every
             logit (-ffast-math assumes no infinities), so that the later passes read no mask.
   backward: dS <- the logits' gradient from dW (dS may be dW: in place), 0 at hidden keys.

   sparsemax (Martins & Astudillo 2016): w = [z - tau]+, z = s - max s, tau in [-1, 0). Michelot's iteration from
     t = -1: over S = {z > t}, t <- (sum_S z - 1) / |S|; every t is a lower bound of tau, S shrinks at each step and
     stops exactly at the support, where t is tau in closed form. Backward: dz = 1_S (g - mean_S g).
   1.5-entmax (Peters et al. 2019): w = [z - tau]+^2, z = (s - max s) / 2, tau in [-1, 0). Newton from the left on
     sqrt(F(t)) - 1, F(t) = sum [z - t]+^2 (convex and decreasing: every iterate is a lower bound, and one step is
     exact when the support's values are equal); at each iterate the quadratic sum_S (z - x)^2 = 1 over
     S = {z > t} is solved in closed form, and its root is tau when it keeps every element of S (the sort-based
     algorithm's test on a sorted prefix). Backward, with u = sqrt(w): dz = u g - u (sum u g / sum u).
   softpick (Zuhri et al. 2025): with m = max(max s, 0) and e = (e^s - 1) e^-m (0 for a hidden key),
     D = sum |e| + eps e^-m: w = max(e, 0) / D; the state is (m, 1 / D) per row, and R = e / D (signed) when asked
     for (in place, where the logits are lost). Backward, with u = e^(s - m) / D (from R: R + e^-m / D; else from
     the logits): dz = u (g - sum g w) where s > 0, u sum g w where s < 0, 0 where s = 0 and at hidden keys.

   The allowed mask is a uint8 tensor broadcast over (B, H, Lq, Lk) by its strides (0 where it broadcasts); NULL:
   every key visible. Work items are the B*H*Lq rows, one contiguous range per thread (run_jobs, parallel.h). */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "parallel.h"

enum { SPARSEMAX = 0, ENTMAX15 = 1, SOFTPICK = 2 };

typedef struct {
    int kind;
    const void *S; /* forward: logits; backward: dW */
    void *W;       /* forward: weights out; backward: dS out */
    const void *P; /* backward: the weights */
    void *R;       /* softpick: e / D, (rows, Lk) */
    void *rowstate; /* softpick: (m, 1 / D) per row, (rows, 2) */
    const void *L; /* softpick's backward without R: the logits */
    const uint8_t *allowed;
    int64_t as[4];
    int64_t H, Lq, Lk;
    double eps;
    int64_t begin, end;
} Job;

static inline const uint8_t *allowed_row(const Job *job, int64_t item) {
    if (!job->allowed) return NULL;
    const int64_t i = item % job->Lq, bh = item / job->Lq, h = bh % job->H, b = bh / job->H;
    return job->allowed + b * job->as[0] + h * job->as[1] + i * job->as[2];
}

#define MAX_NEWTON 100

#define KERNELS(T_, SUF, EXP, SQRT, LOWEST)                                                                            \
    /* w <- s with hidden keys at LOWEST / 4; returns the number of visible keys, *mx their maximum */                 \
    static int64_t load_##SUF(const Job *job, int64_t item, const T_ *s, T_ *w, T_ *mx) {                              \
        const int64_t Lk = job->Lk;                                                                                    \
        const uint8_t *a = allowed_row(job, item);                                                                     \
        const T_ low = LOWEST / 4;                                                                                     \
        T_ m = low;                                                                                                    \
        int64_t n = Lk;                                                                                                \
        if (!a) {                                                                                                      \
            for (int64_t j = 0; j < Lk; ++j) {                                                                         \
                const T_ v = s[j];                                                                                     \
                w[j] = v;                                                                                              \
                m = v > m ? v : m;                                                                                     \
            }                                                                                                          \
        } else {                                                                                                       \
            const int64_t aj = job->as[3];                                                                             \
            n = 0;                                                                                                     \
            if (aj == 1) {                                                                                             \
                for (int64_t j = 0; j < Lk; ++j) {                                                                     \
                    const T_ v = a[j] ? s[j] : low;                                                                    \
                    w[j] = v;                                                                                          \
                    m = v > m ? v : m;                                                                                 \
                    n += a[j] != 0;                                                                                    \
                }                                                                                                      \
            } else {                                                                                                   \
                for (int64_t j = 0; j < Lk; ++j) {                                                                     \
                    const T_ v = a[j * aj] ? s[j] : low;                                                               \
                    w[j] = v;                                                                                          \
                    m = v > m ? v : m;                                                                                 \
                    n += a[j * aj] != 0;                                                                               \
                }                                                                                                      \
            }                                                                                                          \
        }                                                                                                              \
        *mx = m;                                                                                                       \
        return n;                                                                                                      \
    }                                                                                                                  \
                                                                                                                       \
    static void sparsemax_fwd_##SUF(Job *job) {                                                                        \
        const int64_t Lk = job->Lk;                                                                                    \
        for (int64_t item = job->begin; item < job->end; ++item) {                                                     \
            T_ *w = (T_ *)job->W + item * Lk;                                                                          \
            T_ m;                                                                                                      \
            if (load_##SUF(job, item, (const T_ *)job->S + item * Lk, w, &m) == 0) {                                   \
                for (int64_t j = 0; j < Lk; ++j) w[j] = 0;                                                             \
                continue;                                                                                              \
            }                                                                                                          \
            /* on x = s - m: Michelot from t = -1, a lower bound (the maximum alone sums to 1 there) */                \
            T_ t = -1, prev = (T_)(Lk + 1);                                                                            \
            for (int it = 0; it < Lk + 1; ++it) {                                                                      \
                T_ cnt = 0, sum = 0;                                                                                   \
                for (int64_t j = 0; j < Lk; ++j) {                                                                     \
                    const T_ x = w[j] - m;                                                                             \
                    const int in = x > t;                                                                              \
                    cnt += in ? (T_)1 : (T_)0;                                                                         \
                    sum += in ? x : (T_)0;                                                                             \
                }                                                                                                      \
                const T_ next = (sum - 1) / cnt; /* cnt >= 1: the maximum, x = 0 > t */                                \
                if (cnt >= prev) break;          /* S did not shrink: it is the support, t = tau */                    \
                prev = cnt;                                                                                            \
                t = next > t ? next : t;                                                                               \
            }                                                                                                          \
            for (int64_t j = 0; j < Lk; ++j) {                                                                         \
                const T_ v = (w[j] - m) - t;                                                                           \
                w[j] = v > 0 ? v : (T_)0;                                                                              \
            }                                                                                                          \
        }                                                                                                              \
    }                                                                                                                  \
                                                                                                                       \
    static void entmax15_fwd_##SUF(Job *job) {                                                                         \
        const int64_t Lk = job->Lk;                                                                                    \
        for (int64_t item = job->begin; item < job->end; ++item) {                                                     \
            T_ *w = (T_ *)job->W + item * Lk;                                                                          \
            T_ m;                                                                                                      \
            if (load_##SUF(job, item, (const T_ *)job->S + item * Lk, w, &m) == 0) {                                   \
                for (int64_t j = 0; j < Lk; ++j) w[j] = 0;                                                             \
                continue;                                                                                              \
            }                                                                                                          \
            /* on z = (s - m) / 2: tau in [-1, 0); t a lower bound (F(t) >= 1) throughout */                           \
            T_ t = -1, tau = -1;                                                                                       \
            for (int it = 0; it < MAX_NEWTON; ++it) {                                                                  \
                T_ cnt = 0, s1 = 0, s2 = 0, lo = 2;                                                                    \
                for (int64_t j = 0; j < Lk; ++j) {                                                                     \
                    const T_ d = (w[j] - m) * (T_)0.5 - t;                                                             \
                    const T_ p = d > 0 ? d : (T_)0, q = d > 0 ? d : (T_)2;                                             \
                    cnt += d > 0 ? (T_)1 : (T_)0;                                                                      \
                    s1 += p;                                                                                           \
                    s2 += p * p;                                                                                       \
                    lo = q < lo ? q : lo;                                                                              \
                }                                                                                                      \
                /* sum_S (d - x)^2 = 1: cnt x^2 - 2 s1 x + s2 - 1 = 0, the smaller root x >= 0 (s2 >= 1) */            \
                const T_ disc = s1 * s1 - cnt * (s2 - 1);                                                              \
                if (disc >= 0) {                                                                                       \
                    const T_ x = (s1 - SQRT(disc)) / cnt;                                                              \
                    tau = t + x;                                                                                       \
                    if (x <= lo) break; /* keeps every element of S: F(tau) = 1 exactly */                             \
                }                                                                                                      \
                const T_ r = SQRT(s2); /* Newton on sqrt(F) - 1 */                                                     \
                const T_ step = (r - 1) * r / s1;                                                                      \
                if (!(step > 0)) {                                                                                     \
                    tau = t;                                                                                           \
                    break; /* converged to rounding */                                                                 \
                }                                                                                                      \
                t += step;                                                                                             \
                tau = t;                                                                                               \
            }                                                                                                          \
            for (int64_t j = 0; j < Lk; ++j) {                                                                         \
                const T_ v = (w[j] - m) * (T_)0.5 - tau;                                                               \
                const T_ u = v > 0 ? v : (T_)0;                                                                        \
                w[j] = u * u;                                                                                          \
            }                                                                                                          \
        }                                                                                                              \
    }                                                                                                                  \
                                                                                                                       \
    static void softpick_fwd_##SUF(Job *job) {                                                                         \
        const int64_t Lk = job->Lk;                                                                                    \
        const T_ eps = (T_)job->eps;                                                                                   \
        for (int64_t item = job->begin; item < job->end; ++item) {                                                     \
            T_ *w = (T_ *)job->W + item * Lk, *r = job->R ? (T_ *)job->R + item * Lk : NULL; /* w: e, then w */        \
            T_ mx;                                                                                                     \
            const int64_t n = load_##SUF(job, item, (const T_ *)job->S + item * Lk, w, &mx);                           \
            const T_ m = n == 0 || mx < 0 ? (T_)0 : mx;                                                                \
            const T_ shift = EXP(-m), low = LOWEST / 8;                                                                \
            T_ pos = 0, all = 0;                                                                                       \
            for (int64_t j = 0; j < Lk; ++j) {                                                                         \
                const T_ v = w[j], x = v - m, ex = EXP(x) - shift;                                                     \
                /* the sign of s, whatever the rounding of exp; hidden keys (below low): 0 */                          \
                const T_ ep = ex > 0 ? ex : (T_)0, en = ((v < 0) & (x > low) & (ex < 0)) ? ex : (T_)0;                \
                const T_ e = v > 0 ? ep : en;                                                                          \
                w[j] = e;                                                                                              \
                pos += e > 0 ? e : (T_)0;                                                                              \
                all += e;                                                                                              \
            }                                                                                                          \
            const T_ inv = 1 / (2 * pos - all + eps * shift);                                                          \
            if (job->R) {                                                                                              \
                for (int64_t j = 0; j < Lk; ++j) {                                                                     \
                    const T_ v = w[j] * inv;                                                                           \
                    r[j] = v;                                                                                          \
                    w[j] = v > 0 ? v : (T_)0;                                                                          \
                }                                                                                                      \
            } else {                                                                                                   \
                for (int64_t j = 0; j < Lk; ++j) w[j] = w[j] > 0 ? w[j] * inv : (T_)0;                                 \
            }                                                                                                          \
            T_ *st = (T_ *)job->rowstate + 2 * item;                                                                   \
            st[0] = m, st[1] = inv;                                                                                    \
        }                                                                                                              \
    }                                                                                                                  \
                                                                                                                       \
    static void sparsemax_bwd_##SUF(Job *job) {                                                                        \
        const int64_t Lk = job->Lk;                                                                                    \
        for (int64_t item = job->begin; item < job->end; ++item) {                                                     \
            const T_ *g = (const T_ *)job->S + item * Lk, *p = (const T_ *)job->P + item * Lk;                         \
            T_ *d = (T_ *)job->W + item * Lk;                                                                          \
            T_ cnt = 0, sum = 0;                                                                                       \
            for (int64_t j = 0; j < Lk; ++j) {                                                                         \
                const int in = p[j] > 0;                                                                               \
                cnt += in ? (T_)1 : (T_)0;                                                                             \
                sum += in ? g[j] : (T_)0;                                                                              \
            }                                                                                                          \
            const T_ mean = cnt > 0 ? sum / cnt : (T_)0;                                                               \
            for (int64_t j = 0; j < Lk; ++j) d[j] = p[j] > 0 ? g[j] - mean : (T_)0;                                    \
        }                                                                                                              \
    }                                                                                                                  \
                                                                                                                       \
    static void entmax15_bwd_##SUF(Job *job) {                                                                         \
        const int64_t Lk = job->Lk;                                                                                    \
        for (int64_t item = job->begin; item < job->end; ++item) {                                                     \
            const T_ *g = (const T_ *)job->S + item * Lk, *p = (const T_ *)job->P + item * Lk;                         \
            T_ *d = (T_ *)job->W + item * Lk;                                                                          \
            T_ su = 0, sug = 0;                                                                                        \
            for (int64_t j = 0; j < Lk; ++j) {                                                                         \
                const T_ u = SQRT(p[j]);                                                                               \
                su += u;                                                                                               \
                sug += u * g[j];                                                                                       \
            }                                                                                                          \
            const T_ q = su > 0 ? sug / su : (T_)0;                                                                    \
            for (int64_t j = 0; j < Lk; ++j) d[j] = SQRT(p[j]) * (g[j] - q);                                           \
        }                                                                                                              \
    }                                                                                                                  \
                                                                                                                       \
    static void softpick_bwd_##SUF(Job *job) {                                                                         \
        const int64_t Lk = job->Lk;                                                                                    \
        for (int64_t item = job->begin; item < job->end; ++item) {                                                     \
            const T_ *g = (const T_ *)job->S + item * Lk, *p = (const T_ *)job->P + item * Lk;                         \
            T_ *d = (T_ *)job->W + item * Lk;                                                                          \
            const T_ *st = (const T_ *)job->rowstate + 2 * item;                                                       \
            const T_ m = st[0], inv = st[1];                                                                           \
            T_ gw = 0;                                                                                                 \
            for (int64_t j = 0; j < Lk; ++j) gw += g[j] * p[j];                                                        \
            if (job->R) { /* from R = e / D: u = R + e^-m / D */                                                       \
                const T_ *r = (const T_ *)job->R + item * Lk, cut = EXP(-m) * inv;                                     \
                for (int64_t j = 0; j < Lk; ++j) {                                                                     \
                    const T_ v = r[j], u = v + cut;                                                                    \
                    d[j] = v > 0 ? u * (g[j] - gw) : (v < 0 ? u * gw : (T_)0);                                         \
                }                                                                                                      \
                continue;                                                                                              \
            }                                                                                                          \
            /* from the logits: u = e^(s - m) / D, the sign of e that of s, 0 at hidden keys */                        \
            const T_ *s = (const T_ *)job->L + item * Lk;                                                              \
            const uint8_t *a = allowed_row(job, item);                                                                 \
            const int64_t aj = job->as[3];                                                                             \
            if (!a) {                                                                                                  \
                for (int64_t j = 0; j < Lk; ++j) {                                                                     \
                    const T_ v = s[j], u = EXP(v - m) * inv;                                                           \
                    d[j] = v > 0 ? u * (g[j] - gw) : (v < 0 ? u * gw : (T_)0);                                         \
                }                                                                                                      \
            } else if (aj == 1) {                                                                                      \
                for (int64_t j = 0; j < Lk; ++j) {                                                                     \
                    const T_ v = a[j] ? s[j] : (T_)0, u = EXP(v - m) * inv;                                            \
                    d[j] = v > 0 ? u * (g[j] - gw) : (v < 0 ? u * gw : (T_)0);                                         \
                }                                                                                                      \
            } else {                                                                                                   \
                for (int64_t j = 0; j < Lk; ++j) {                                                                     \
                    const T_ v = a[j * aj] ? s[j] : (T_)0, u = EXP(v - m) * inv;                                       \
                    d[j] = v > 0 ? u * (g[j] - gw) : (v < 0 ? u * gw : (T_)0);                                         \
                }                                                                                                      \
            }                                                                                                          \
        }                                                                                                              \
    }

KERNELS(float, f32, expf, sqrtf, -FLT_MAX)
KERNELS(double, f64, exp, sqrt, -DBL_MAX)

typedef void (*Kernel)(Job *);
static int parallel(Kernel kernel, Job base, int64_t n, int threads) {
    threads = job_threads(n, threads);
    Job *jobs = calloc((size_t)threads, sizeof(Job));
    if (!jobs) return 1;
    for (int t = 0; t < threads; ++t) {
        jobs[t] = base;
        jobs[t].begin = n * t / threads;
        jobs[t].end = n * (t + 1) / threads;
    }
    if (run_jobs((JobKernel)kernel, jobs, sizeof(Job), threads)) {
        free(jobs);
        return 1;
    }
    free(jobs);
    return 0;
}

static const Kernel FORWARD[3][2] = {
    {sparsemax_fwd_f32, sparsemax_fwd_f64}, {entmax15_fwd_f32, entmax15_fwd_f64}, {softpick_fwd_f32, softpick_fwd_f64}};
static const Kernel BACKWARD[3][2] = {
    {sparsemax_bwd_f32, sparsemax_bwd_f64}, {entmax15_bwd_f32, entmax15_bwd_f64}, {softpick_bwd_f32, softpick_bwd_f64}};

/* kind: 0 sparsemax, 1 entmax15, 2 softpick; dtype: 0 float32, 1 float64. S, W: (B, H, Lq, Lk) contiguous (W may
   be S). softpick: rowstate (B, H, Lq, 2) out, and R (B, H, Lq, Lk) out or NULL (then W must not be S: the backward
   pass reads the logits S instead); else both NULL. Returns 0, or 1 when out of memory. */
int attnlab_sparse_forward(int kind, int dtype, const void *S, void *W, void *R, void *rowstate,
                           const uint8_t *allowed, const int64_t *allowed_strides, int64_t B, int64_t H, int64_t Lq,
                           int64_t Lk, double eps, int threads) {
    if (kind < 0 || kind > 2 || dtype < 0 || dtype > 1) return 2;
    Job job = {0};
    job.kind = kind, job.S = S, job.W = W, job.R = R, job.rowstate = rowstate, job.allowed = allowed;
    for (int d = 0; d < 4; ++d) job.as[d] = allowed ? allowed_strides[d] : 0;
    job.H = H, job.Lq = Lq, job.Lk = Lk, job.eps = eps;
    return parallel(FORWARD[kind][dtype], job, B * H * Lq, threads);
}

/* dW, dS: (B, H, Lq, Lk) contiguous (dS may be dW); P: the forward's weights. softpick: its rowstate, and its R or
   (R NULL) the logits L with the forward's allowed mask; else all NULL. */
int attnlab_sparse_backward(int kind, int dtype, const void *dW, void *dS, const void *P, const void *R,
                            const void *rowstate, const void *L, const uint8_t *allowed,
                            const int64_t *allowed_strides, int64_t B, int64_t H, int64_t Lq, int64_t Lk,
                            int threads) {
    if (kind < 0 || kind > 2 || dtype < 0 || dtype > 1) return 2;
    Job job = {0};
    job.kind = kind, job.S = dW, job.W = dS, job.P = P, job.R = (void *)R, job.rowstate = (void *)rowstate;
    job.L = L, job.allowed = allowed;
    for (int d = 0; d < 4; ++d) job.as[d] = allowed ? allowed_strides[d] : 0;
    job.H = H, job.Lq = Lq, job.Lk = Lk;
    return parallel(BACKWARD[kind][dtype], job, B * H * Lq, threads);
}
