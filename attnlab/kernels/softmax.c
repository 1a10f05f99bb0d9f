/* Softmax over the rows of attention logits, with optional soft-capping, on the CPU, for attnlab.kernels.softmax.

   forward:  src (B, H, Lq, Lk) holds the logits s; dst (may be src: in place) gets, row by row,
             P = softmax over the allowed keys of s' = cap * tanh(s / cap) (s' = s without a cap), 0 at the other
             keys, and lse (B*H*Lq) the row's log-sum-exp of s' over the allowed keys (0 for a row with none, whose
             P is all 0). lse may be NULL.
   backward: g (B, H, Lq, Lk) holds dP; in place, g <- dS = P (dP - D) (1 - t^2), D = sum_j P_j dP_j, where
             t = tanh(s / cap) = s' / cap is recovered from P as (log P + lse) / cap (where P = 0 the term is 0
             anyway); without a cap the last factor is 1. Masked keys have P = 0, so their gradient is 0.

   The allowed mask is a uint8 tensor (1 = may attend) broadcast over (B, H, Lq, Lk) by its strides (0 where it
   broadcasts); a row of it is read in place when its key stride is 1, else copied.
   -ffast-math assumes no infinities, so hidden keys get weight 0 by a select, never through exp(-inf).
   Work items are the B*H*Lq rows, one contiguous range per thread (run_jobs, parallel.h). */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "fastmath.h"
#include "parallel.h"

typedef struct {
    const void *src;
    void *dst, *lse;
    const void *P;
    const uint8_t *allowed;
    int64_t as[4];
    int64_t H, Lq, Lk;
    double cap;
    int64_t begin, end;
    int failed;
} Job;

static inline const uint8_t *allowed_row(const Job *job, int64_t item, uint8_t *buf) {
    if (!job->allowed) return NULL;
    const int64_t i = item % job->Lq, bh = item / job->Lq, h = bh % job->H, b = bh / job->H;
    const uint8_t *m = job->allowed + b * job->as[0] + h * job->as[1] + i * job->as[2];
    const int64_t aj = job->as[3];
    if (aj == 1) return m;
    for (int64_t j = 0; j < job->Lk; ++j) buf[j] = m[j * aj];
    return buf;
}


#define KERNELS(T_, SUF, EXP, LOG, TANH, LOWEST)                                                               \
    static void fwd_##SUF(Job *job) {                                                                          \
        const int64_t Lk = job->Lk;                                                                            \
        const int capped = job->cap > 0;                                                                       \
        const T_ c = (T_)job->cap, ic = capped ? (T_)1 / (T_)job->cap : (T_)0;                                  \
        uint8_t *buf = NULL;                                                                                   \
        if (job->allowed && job->as[3] != 1 && !(buf = malloc((size_t)(Lk > 0 ? Lk : 1)))) {                   \
            job->failed = 1;                                                                                   \
            return;                                                                                            \
        }                                                                                                      \
        for (int64_t item = job->begin; item < job->end; ++item) {                                            \
            const T_ *x = (const T_ *)job->src + item * Lk;                                                    \
            T_ *s = (T_ *)job->dst + item * Lk;                                                                \
            const uint8_t *m = allowed_row(job, item, buf);                                                    \
            T_ mx = LOWEST;                                                                                    \
            if (capped && !m) { /* the cap and the row's maximum in one pass */                                \
                for (int64_t j = 0; j < Lk; ++j) {                                                             \
                    const T_ v = c * TANH(x[j] * ic);                                                          \
                    s[j] = v;                                                                                  \
                    mx = v > mx ? v : mx;                                                                      \
                }                                                                                              \
            } else if (capped) {                                                                               \
                for (int64_t j = 0; j < Lk; ++j) s[j] = c * TANH(x[j] * ic);                                   \
            } else if (s != x) {                                                                               \
                for (int64_t j = 0; j < Lk; ++j) s[j] = x[j];                                                  \
            }                                                                                                  \
            if (m) {                                                                                           \
                for (int64_t j = 0; j < Lk; ++j) {                                                             \
                    const T_ v = m[j] ? s[j] : LOWEST;                                                         \
                    mx = v > mx ? v : mx;                                                                      \
                }                                                                                              \
            } else if (!capped) {                                                                              \
                for (int64_t j = 0; j < Lk; ++j) mx = s[j] > mx ? s[j] : mx;                                   \
            }                                                                                                  \
            T_ sum = 0;                                                                                        \
            if (m) {                                                                                           \
                for (int64_t j = 0; j < Lk; ++j) {                                                             \
                    const T_ e = m[j] ? EXP(s[j] - mx) : (T_)0;                                                \
                    s[j] = e;                                                                                  \
                    sum += e;                                                                                  \
                }                                                                                              \
            } else {                                                                                           \
                for (int64_t j = 0; j < Lk; ++j) {                                                             \
                    const T_ e = EXP(s[j] - mx);                                                               \
                    s[j] = e;                                                                                  \
                    sum += e;                                                                                  \
                }                                                                                              \
            }                                                                                                  \
            const T_ inv = sum > 0 ? (T_)1 / sum : (T_)0;                                                      \
            for (int64_t j = 0; j < Lk; ++j) s[j] *= inv;                                                      \
            if (job->lse) ((T_ *)job->lse)[item] = sum > 0 ? mx + LOG(sum) : (T_)0;                            \
        }                                                                                                      \
        free(buf);                                                                                             \
    }                                                                                                          \
    static void bwd_##SUF(Job *job) {                                                                          \
        const int64_t Lk = job->Lk;                                                                            \
        const int capped = job->cap > 0;                                                                       \
        const T_ ic = capped ? (T_)1 / (T_)job->cap : (T_)0;                                                   \
        for (int64_t item = job->begin; item < job->end; ++item) {                                            \
            T_ *g = (T_ *)job->dst + item * Lk;                                                                \
            const T_ *p = (const T_ *)job->P + item * Lk;                                                      \
            T_ d = 0;                                                                                          \
            for (int64_t j = 0; j < Lk; ++j) d += p[j] * g[j];                                                 \
            if (capped) {                                                                                      \
                const T_ l = ((const T_ *)job->lse)[item];                                                     \
                for (int64_t j = 0; j < Lk; ++j) {                                                             \
                    const T_ pj = p[j];                                                                        \
                    const T_ t = (LOG(pj > 0 ? pj : (T_)1) + l) * ic;                                          \
                    g[j] = pj * (g[j] - d) * ((T_)1 - t * t);                                                  \
                }                                                                                              \
            } else {                                                                                           \
                for (int64_t j = 0; j < Lk; ++j) g[j] = p[j] * (g[j] - d);                                     \
            }                                                                                                  \
        }                                                                                                      \
    }

KERNELS(float, f32, expf, logf, tanh_f32, -FLT_MAX)
KERNELS(double, f64, exp, log, tanh, -DBL_MAX)

typedef void (*Kernel)(Job *);
/* Runs kernel over rows [0, n) split into `threads` contiguous ranges; 0, or 1 when out of memory. */
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
    int failed = 0;
    for (int t = 0; t < threads; ++t) failed |= jobs[t].failed;
    free(jobs);
    return failed;
}

/* cap <= 0: no soft-capping. allowed may be NULL (every key allowed); lse may be NULL. */
int attnlab_softmax_forward(int dtype, const void *src, void *dst, void *lse, const uint8_t *allowed,
                            const int64_t *allowed_strides, int64_t B, int64_t H, int64_t Lq, int64_t Lk, double cap,
                            int threads) {
    Job job = {0};
    job.src = src, job.dst = dst, job.lse = lse, job.allowed = allowed;
    for (int d = 0; d < 4; ++d) job.as[d] = allowed ? allowed_strides[d] : 0;
    job.H = H, job.Lq = Lq, job.Lk = Lk, job.cap = cap;
    return parallel(dtype == 0 ? fwd_f32 : fwd_f64, job, B * H * Lq, threads);
}

/* g holds dP and gets dS in place; lse is read only when cap > 0. */
int attnlab_softmax_backward(int dtype, void *g, const void *P, const void *lse, int64_t B, int64_t H, int64_t Lq,
                             int64_t Lk, double cap, int threads) {
    Job job = {0};
    job.dst = g, job.P = P, job.lse = (void *)lse;
    job.H = H, job.Lq = Lq, job.Lk = Lk, job.cap = cap;
    return parallel(dtype == 0 ? bwd_f32 : bwd_f64, job, B * H * Lq, threads);
}
