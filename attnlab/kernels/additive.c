/* Fused additive (Bahdanau) attention logits on the CPU, for attnlab.kernels.additive.

   logits[b,h,i,j] = sum_a v[h,a] * tanh(wq[b,h,i,a] + uk[b,h,j,a])

   The keys come transposed, ukT (B*H, A, Lk), so that the inner loop runs over keys j, contiguous in memory: it
   is vectorised by the compiler, tanh included (glibc's libmvec under -ffast-math), and no (.., Lk, A) activation
   is ever written. Work items are the B*H*Lq query rows, split into one contiguous range per thread (run_jobs,
   parallel.h: torch's own OpenMP threads; the library's libgomp.so.1 is the one torch loaded, not a second runtime).

   Backward, with g = dL/dlogits and s = g (1 - t^2), t recomputed (one tanh per element, as in the forward),
   one thread per (b, h) slice (so the key and v sums need no lock and are taken in a fixed order):
     dL/dv[h,a]    = sum_{b,i,j} g t
     dL/dwq[i,a]   = v[a] sum_j s        (the v[a] factor is applied by the caller)
     dL/dukT[a,j]  = v[a] sum_i s
   Nothing beyond the inputs, the (B, H, Lq, Lk) logits or their gradient, and the outputs is allocated. */

#include <stdint.h>
#include <stdlib.h>
#include <math.h>

#include "parallel.h"

typedef struct {
    const void *wq, *ukT, *v, *grad;
    void *out, *gwq, *gukT, *gv;
    int64_t H, Lq, Lk, A, begin, end;
} Job;

#define KERNELS(T, SUF, TANH)                                                                                \
    static void fwd_##SUF(Job *job) {                                                                        \
        const T *wq = job->wq, *ukT = job->ukT, *v = job->v;                                                 \
        T *out = job->out;                                                                                   \
        const int64_t H = job->H, Lq = job->Lq, Lk = job->Lk, A = job->A;                                   \
        for (int64_t item = job->begin; item < job->end; ++item) {                                          \
            const int64_t bh = item / Lq, h = bh % H;                                                        \
            const T *w = wq + item * A, *u0 = ukT + bh * A * Lk, *vh = v + h * A;                           \
            T *o = out + item * Lk;                                                                          \
            for (int64_t j = 0; j < Lk; ++j) o[j] = 0;                                                       \
            for (int64_t a = 0; a < A; ++a) {                                                                \
                const T wa = w[a], va = vh[a];                                                               \
                const T *u = u0 + a * Lk;                                                                    \
                for (int64_t j = 0; j < Lk; ++j) o[j] += va * TANH(wa + u[j]);                               \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
    static void bwd_##SUF(Job *job) {                                                                        \
        const T *wq = job->wq, *ukT = job->ukT, *grad = job->grad;                                           \
        T *gwq = job->gwq, *gukT = job->gukT, *gv = job->gv;                                                 \
        const int64_t Lq = job->Lq, Lk = job->Lk, A = job->A;                                                \
        for (int64_t bh = job->begin; bh < job->end; ++bh) {                                                \
            const T *u0 = ukT + bh * A * Lk;                                                                 \
            T *gu0 = gukT + bh * A * Lk, *gvb = gv + bh * A;                                                 \
            for (int64_t i = 0; i < Lq; ++i) {                                                               \
                const int64_t item = bh * Lq + i;                                                            \
                const T *w = wq + item * A, *g = grad + item * Lk;                                           \
                T *gw = gwq + item * A;                                                                      \
                for (int64_t a = 0; a < A; ++a) {                                                            \
                    const T wa = w[a];                                                                       \
                    const T *u = u0 + a * Lk;                                                                \
                    T *gua = gu0 + a * Lk;                                                                   \
                    T sw = 0, sv = 0;                                                                        \
                    for (int64_t j = 0; j < Lk; ++j) {                                                       \
                        const T t = TANH(wa + u[j]), gj = g[j];                                              \
                        const T s = gj - gj * t * t;                                                         \
                        sv += gj * t;                                                                        \
                        sw += s;                                                                             \
                        gua[j] += s;                                                                         \
                    }                                                                                        \
                    gw[a] = sw;                                                                              \
                    gvb[a] += sv;                                                                            \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
    }

KERNELS(float, f32, tanhf)
KERNELS(double, f64, tanh)

typedef void (*Kernel)(Job *);

/* Runs kernel over items [0, n), one contiguous range per thread; returns 0, or 1 if memory ran out. */
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

/* dtype: 0 float32, 1 float64. All tensors contiguous. wq (BH, Lq, A), ukT (BH, A, Lk), v (H, A),
   out (BH, Lq, Lk). */
int attnlab_additive_forward(int dtype, const void *wq, const void *ukT, const void *v, void *out, int64_t BH,
                             int64_t H, int64_t Lq, int64_t Lk, int64_t A, int threads) {
    Job job = {wq, ukT, v, NULL, out, NULL, NULL, NULL, H, Lq, Lk, A, 0, 0};
    return parallel(dtype == 0 ? fwd_f32 : fwd_f64, job, BH * Lq, threads);
}

/* grad (BH, Lq, Lk) → gwq (BH, Lq, A) (written), gukT (BH, A, Lk) and gv (BH, A) (accumulated: pass zeros).
   Each thread owns whole (b, h) slices, so every sum is taken in one fixed order: the result does not depend on
   scheduling (bitwise the same for any thread count, since a slice is never split). */
int attnlab_additive_backward(int dtype, const void *wq, const void *ukT, const void *grad, void *gwq, void *gukT,
                              void *gv, int64_t BH, int64_t H, int64_t Lq, int64_t Lk, int64_t A, int threads) {
    Job job = {wq, ukT, NULL, grad, NULL, gwq, gukT, gv, H, Lq, Lk, A, 0, 0};
    return parallel(dtype == 0 ? bwd_f32 : bwd_f64, job, BH, threads);
}
