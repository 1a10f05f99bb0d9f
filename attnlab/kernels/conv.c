/* The causal depthwise convolution of attnlab's short convolution and Canon layers, on the CPU, for
   attnlab.kernels.conv. x, y, g, dx (B, L, C) contiguous; wT (k, C) contiguous: tap m of channel c at wT[m*C + c].

   forward:  y_t = r * x_t + sum_{m<k} wT_m * x_{t-k+1+m}     (per channel; x before the start is 0; r = 1 or 0)
   backward: dx_t = r * g_t + sum_{m<k} wT_m * g_{t+k-1-m}    (g after the end is 0)
             dw_m += g_t * x_{t-k+1+m}                          (into each thread's own partial (k, C))

   One pass over the rows each way: the k rows a row reads stay in the cache, so x is read once and y written once
   (the shifted multiply-adds in PyTorch pass over the whole tensor k times). Work items are the B*L rows, one
   contiguous range per thread (run_jobs, parallel.h); the weight gradient is each thread's partial sum over its
   rows, which the caller adds up: the bits do not depend on the scheduling. */

#include <stdint.h>
#include <string.h>

#include "parallel.h"

typedef struct {
    const void *x, *w, *g;
    void *y, *dx, *dw;
    int64_t L, C, k;
    int residual;
    int64_t begin, end;
} Job;

#define FORWARD(T)                                                                                                   \
    static void forward_##T(void *arg) {                                                                             \
        const Job *job = arg;                                                                                        \
        const T *restrict x = job->x, *restrict w = job->w;                                                          \
        T *restrict y = job->y;                                                                                      \
        const int64_t L = job->L, C = job->C, k = job->k;                                                            \
        const T r = job->residual ? (T)1 : (T)0;                                                                     \
        for (int64_t row = job->begin; row < job->end; ++row) {                                                      \
            const int64_t t = row % L;                                                                               \
            T *out = y + row * C;                                                                                    \
            const T *cur = x + row * C, *wl = w + (k - 1) * C;                                                       \
            for (int64_t c = 0; c < C; ++c) out[c] = (r + wl[c]) * cur[c];                                           \
            for (int64_t m = 0; m < k - 1; ++m) {                                                                    \
                const int64_t shift = k - 1 - m;                                                                     \
                if (shift > t) continue;                                                                             \
                const T *src = cur - shift * C, *wm = w + m * C;                                                     \
                for (int64_t c = 0; c < C; ++c) out[c] += wm[c] * src[c];                                            \
            }                                                                                                        \
        }                                                                                                            \
    }

#define BACKWARD(T)                                                                                                  \
    static void backward_##T(void *arg) {                                                                            \
        const Job *job = arg;                                                                                        \
        const T *restrict x = job->x, *restrict w = job->w, *restrict g = job->g;                                    \
        T *restrict dx = job->dx, *restrict dw = job->dw;                                                            \
        const int64_t L = job->L, C = job->C, k = job->k;                                                            \
        const T r = job->residual ? (T)1 : (T)0;                                                                     \
        memset(dw, 0, (size_t)(k * C) * sizeof(T));                                                                  \
        for (int64_t row = job->begin; row < job->end; ++row) {                                                      \
            const int64_t t = row % L;                                                                               \
            const T *gt = g + row * C, *xt = x + row * C, *wl = w + (k - 1) * C;                                     \
            T *out = dx + row * C, *dwl = dw + (k - 1) * C;                                                          \
            for (int64_t c = 0; c < C; ++c) {                                                                        \
                out[c] = (r + wl[c]) * gt[c];                                                                        \
                dwl[c] += gt[c] * xt[c];                                                                             \
            }                                                                                                        \
            for (int64_t m = 0; m < k - 1; ++m) {                                                                    \
                const int64_t shift = k - 1 - m;                                                                     \
                const T *wm = w + m * C;                                                                             \
                if (t + shift < L) { /* dx_t += w_m g_{t+shift} */                                                   \
                    const T *later = gt + shift * C;                                                                 \
                    for (int64_t c = 0; c < C; ++c) out[c] += wm[c] * later[c];                                      \
                }                                                                                                    \
                if (shift <= t) { /* dw_m += g_t x_{t-shift} */                                                      \
                    const T *earlier = xt - shift * C;                                                               \
                    T *dwm = dw + m * C;                                                                             \
                    for (int64_t c = 0; c < C; ++c) dwm[c] += gt[c] * earlier[c];                                    \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
    }

FORWARD(float)
FORWARD(double)
BACKWARD(float)
BACKWARD(double)

static int run(int dtype, int backward, const void *x, const void *w, const void *g, void *y, void *dw, int64_t B,
               int64_t L, int64_t C, int64_t k, int residual, int threads) {
    const int64_t rows = B * L;
    threads = job_threads(rows, threads);
    Job *jobs = calloc((size_t)threads, sizeof(Job));
    if (!jobs) return 1;
    const size_t elem = dtype ? sizeof(double) : sizeof(float);
    for (int t = 0; t < threads; ++t) {
        Job *job = &jobs[t];
        job->x = x, job->w = w, job->g = g, job->y = y, job->dx = y;
        job->dw = dw ? (char *)dw + (size_t)t * (size_t)(k * C) * elem : NULL;
        job->L = L, job->C = C, job->k = k, job->residual = residual;
        job->begin = rows * t / threads, job->end = rows * (t + 1) / threads;
    }
    JobKernel kernel = backward ? (dtype ? backward_double : backward_float) : (dtype ? forward_double : forward_float);
    const int status = run_jobs(kernel, jobs, sizeof(Job), threads);
    free(jobs);
    return status;
}

/* y (B, L, C) <- the convolution of x; 0, or 1 when out of memory. */
int attnlab_conv_forward(int dtype, const void *x, const void *wT, void *y, int64_t B, int64_t L, int64_t C, int64_t k,
                         int residual, int threads) {
    return run(dtype, 0, x, wT, NULL, y, NULL, B, L, C, k, residual, threads);
}

/* dx (B, L, C) <- the input gradient; dw_parts (threads, k, C) <- each thread's partial weight gradient (the
   threads actually used: min(threads, B*L); the rest untouched). */
int attnlab_conv_backward(int dtype, const void *g, const void *x, const void *wT, void *dx, void *dw_parts, int64_t B,
                          int64_t L, int64_t C, int64_t k, int residual, int threads) {
    return run(dtype, 1, x, wT, g, dx, dw_parts, B, L, C, k, residual, threads);
}
