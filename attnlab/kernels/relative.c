/* Softmax attention with a relative-position bias table, on the CPU, for attnlab.kernels.relative.

   The bias of query row i and key j is T[r][c(i, j)]: a small table, T (rows, C), read through a column index
   c(i, j) that is constant along runs of consecutive keys: Shaw et al. (c = clip(j - i, k) + k, one table row per
   query row: q_i . w^K) and T5 (c = bucket(j - i), one table row per head). Each query row i has its runs
   starts[ptr[i] .. ptr[i+1]) with columns cols[...]; a run ends where the next begins (the last at Lk).

   forward:  S (B, H, Lq, Lk) holds scale * q k^T; in place, S <- softmax(S + bias, hidden keys excluded).
   backward: dP (B, H, Lq, Lk) holds dO v^T; in place, dP <- dS = P (dP - D_i), D_i = sum_j dO_ij z_ij given, and
             dT[r][c] += sum of dS over the keys of each run: one contiguous sum per run, no scatter.

   The hidden mask is a uint8 tensor broadcast over (B, H, Lq, Lk) by its strides (0 where it broadcasts).
   -ffast-math assumes no infinities, so hidden keys get weight 0 by a select, never through exp(-inf).
   Work items are the B*H*Lq rows, one contiguous range per thread (run_jobs, parallel.h). In the backward pass a per-head table
   (T5) is accumulated by each thread into its own slice dT[thread] (summed by the caller, in thread order). */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "parallel.h"

typedef struct {
    void *S;
    const void *P, *D, *T;
    void *dT;
    const int64_t *ptr;
    const int32_t *starts, *cols;
    const uint8_t *hidden;
    int64_t hs[4];
    int64_t B, H, Lq, Lk, C, per_row, table_stride; /* dT slice stride for per-head tables */
    int64_t begin, end;
} Job;

static inline int64_t table_row(const Job *job, int64_t item) {
    return job->per_row ? item : (item / job->Lq) % job->H;
}

static inline const uint8_t *hidden_row(const Job *job, int64_t item) {
    if (!job->hidden) return NULL;
    const int64_t i = item % job->Lq, bh = item / job->Lq, h = bh % job->H, b = bh / job->H;
    return job->hidden + b * job->hs[0] + h * job->hs[1] + i * job->hs[2];
}

#define KERNELS(T_, SUF, EXP, LOWEST)                                                                          \
    static void fwd_##SUF(Job *job) {                                                                          \
        const int64_t Lq = job->Lq, Lk = job->Lk, C = job->C, hj = job->hs[3];                                 \
        for (int64_t item = job->begin; item < job->end; ++item) {                                            \
            T_ *s = (T_ *)job->S + item * Lk;                                                                  \
            const T_ *t = (const T_ *)job->T + table_row(job, item) * C;                                       \
            const int64_t i = item % Lq;                                                                       \
            for (int64_t r = job->ptr[i]; r < job->ptr[i + 1]; ++r) {                                          \
                const int64_t lo = job->starts[r], hi = r + 1 < job->ptr[i + 1] ? job->starts[r + 1] : Lk;     \
                const T_ add = t[job->cols[r]];                                                                \
                for (int64_t j = lo; j < hi; ++j) s[j] += add;                                                 \
            }                                                                                                  \
            const uint8_t *m = hidden_row(job, item);                                                          \
            T_ mx = LOWEST;                                                                                    \
            if (m) {                                                                                           \
                for (int64_t j = 0; j < Lk; ++j) mx = m[j * hj] ? mx : (s[j] > mx ? s[j] : mx);               \
            } else {                                                                                           \
                for (int64_t j = 0; j < Lk; ++j) mx = s[j] > mx ? s[j] : mx;                                   \
            }                                                                                                  \
            T_ sum = 0;                                                                                        \
            if (m) {                                                                                           \
                for (int64_t j = 0; j < Lk; ++j) {                                                             \
                    const T_ e = m[j * hj] ? (T_)0 : EXP(s[j] - mx);                                           \
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
        }                                                                                                      \
    }                                                                                                          \
    static void bwd_##SUF(Job *job) {                                                                          \
        const int64_t Lq = job->Lq, Lk = job->Lk, C = job->C;                                                  \
        T_ *dT = (T_ *)job->dT + job->table_stride;                                                            \
        for (int64_t item = job->begin; item < job->end; ++item) {                                            \
            T_ *g = (T_ *)job->S + item * Lk;                                                                  \
            const T_ *p = (const T_ *)job->P + item * Lk;                                                      \
            const T_ d = ((const T_ *)job->D)[item];                                                           \
            for (int64_t j = 0; j < Lk; ++j) g[j] = p[j] * (g[j] - d);                                         \
            T_ *dt = dT + table_row(job, item) * C;                                                            \
            const int64_t i = item % Lq;                                                                       \
            for (int64_t r = job->ptr[i]; r < job->ptr[i + 1]; ++r) {                                          \
                const int64_t lo = job->starts[r], hi = r + 1 < job->ptr[i + 1] ? job->starts[r + 1] : Lk;     \
                T_ acc = 0;                                                                                    \
                for (int64_t j = lo; j < hi; ++j) acc += g[j];                                                 \
                dt[job->cols[r]] += acc;                                                                       \
            }                                                                                                  \
        }                                                                                                      \
    }

KERNELS(float, f32, expf, -FLT_MAX)
KERNELS(double, f64, exp, -DBL_MAX)

typedef void (*Kernel)(Job *);
static int parallel(Kernel kernel, Job base, int64_t n, int threads, int64_t slice) {
    threads = job_threads(n, threads);
    Job *jobs = calloc((size_t)threads, sizeof(Job));
    if (!jobs) return 1;
    for (int t = 0; t < threads; ++t) {
        jobs[t] = base;
        jobs[t].begin = n * t / threads;
        jobs[t].end = n * (t + 1) / threads;
        jobs[t].table_stride = base.per_row ? 0 : slice * t;
    }
    if (run_jobs((JobKernel)kernel, jobs, sizeof(Job), threads)) {
        free(jobs);
        return 1;
    }
    free(jobs);
    return 0;
}

/* The number of threads the backward pass uses for n rows (the caller sizes dT's per-thread slices with it). */
int attnlab_relative_threads(int64_t n, int threads) { return job_threads(n, threads); }

int attnlab_relative_forward(int dtype, void *S, const void *T, const int64_t *ptr, const int32_t *starts,
                             const int32_t *cols, const uint8_t *hidden, const int64_t *hidden_strides, int64_t B,
                             int64_t H, int64_t Lq, int64_t Lk, int64_t C, int per_row, int threads) {
    Job job = {0};
    job.S = S, job.T = T, job.ptr = ptr, job.starts = starts, job.cols = cols, job.hidden = hidden;
    for (int d = 0; d < 4; ++d) job.hs[d] = hidden ? hidden_strides[d] : 0;
    job.B = B, job.H = H, job.Lq = Lq, job.Lk = Lk, job.C = C, job.per_row = per_row;
    return parallel(dtype == 0 ? fwd_f32 : fwd_f64, job, B * H * Lq, threads, 0);
}

/* dT: (B*H*Lq, C) for a per-row table; (threads, H, C) zeros for a per-head one (threads from
   attnlab_relative_threads). */
int attnlab_relative_backward(int dtype, void *dP, const void *P, const void *D, void *dT, const int64_t *ptr,
                              const int32_t *starts, const int32_t *cols, int64_t B, int64_t H, int64_t Lq,
                              int64_t Lk, int64_t C, int per_row, int threads) {
    Job job = {0};
    job.S = dP, job.P = P, job.D = D, job.dT = dT, job.ptr = ptr, job.starts = starts, job.cols = cols;
    job.B = B, job.H = H, job.Lq = Lq, job.Lk = Lk, job.C = C, job.per_row = per_row;
    return parallel(dtype == 0 ? bwd_f32 : bwd_f64, job, B * H * Lq, threads, H * C);
}
