/* Selective attention's penalty on the CPU, for attnlab.kernels.select (Leviathan et al. 2025, "Selective Attention
   Improves Transformer", sec. 2): from the selecting head's logits e (B, Lq, Lk),

       S_kj = ReLU(e_kj) for a key j the mask shows with 0 < j < k (k the query's token, i + Lk - Lq), else 0;
              a token whose own key the mask hides (a padded one) selects nothing
       bias_ij = -F_ij = -sum_{k < i} S_kj                       (B, Lq, Lk), added to every head's logits

   one pass down the queries, the running sums of a row of keys carried from query to query (a column scan with the
   keys contiguous, so that it vectorises): row i's bias is minus the sum so far, then row i's S is added to it.
   Backward, with G = d bias: d e_kj = -[S_kj > 0] sum_{i > k} G_ij, one pass up the queries.

   The allowed mask is a uint8 tensor broadcast over (B, 1, Lq, Lk) by its strides (0 where it broadcasts); NULL:
   every key visible. Work items are the B batch rows (each a scan over its queries), one range per thread. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"

typedef struct {
    const void *E; /* the selecting head's logits (B, Lq, Lk) */
    const void *G; /* backward: d bias (B, Lq, Lk) */
    void *out;     /* forward: bias; backward: d e */
    const uint8_t *allowed;
    int64_t as[4];
    int64_t Lq, Lk;
    int64_t begin, end;
    void *scratch; /* a row of Lk running sums */
} Job;

static inline int shows(const Job *job, int64_t b, int64_t i, int64_t j) {
    return !job->allowed || job->allowed[b * job->as[0] + i * job->as[2] + j * job->as[3]];
}

#define KERNELS(T_, SUF)                                                                                               \
    static void select_fwd_##SUF(Job *job) {                                                                           \
        const int64_t Lq = job->Lq, Lk = job->Lk, shift = Lk - Lq;                                                     \
        T_ *restrict acc = job->scratch;                                                                                   \
        for (int64_t b = job->begin; b < job->end; ++b) {                                                              \
            memset(acc, 0, sizeof(T_) * (size_t)Lk);                                                                   \
            for (int64_t i = 0; i < Lq; ++i) {                                                                         \
                const T_ *restrict e = (const T_ *)job->E + (b * Lq + i) * Lk;                                         \
                T_ *restrict out = (T_ *)job->out + (b * Lq + i) * Lk;                                                 \
                for (int64_t j = 0; j < Lk; ++j) out[j] = -acc[j];                                                     \
                const int64_t token = i + shift, last = token < Lk ? token : Lk; /* keys 0 < j < token */              \
                if (job->allowed && token < Lk && !shows(job, b, i, token)) continue; /* a padded token */             \
                if (!job->allowed) {                                                                                   \
                    for (int64_t j = 1; j < last; ++j) acc[j] += e[j] > 0 ? e[j] : (T_)0;                              \
                } else {                                                                                               \
                    for (int64_t j = 1; j < last; ++j)                                                                 \
                        if (shows(job, b, i, j)) acc[j] += e[j] > 0 ? e[j] : (T_)0;                                    \
                }                                                                                                      \
            }                                                                                                          \
        }                                                                                                              \
    }                                                                                                                  \
                                                                                                                       \
    static void select_bwd_##SUF(Job *job) {                                                                           \
        const int64_t Lq = job->Lq, Lk = job->Lk, shift = Lk - Lq;                                                     \
        T_ *restrict acc = job->scratch;                                                                                   \
        for (int64_t b = job->begin; b < job->end; ++b) {                                                              \
            memset(acc, 0, sizeof(T_) * (size_t)Lk);                                                                   \
            for (int64_t i = Lq - 1; i >= 0; --i) {                                                                    \
                const T_ *restrict e = (const T_ *)job->E + (b * Lq + i) * Lk;                                         \
                const T_ *restrict g = (const T_ *)job->G + (b * Lq + i) * Lk;                                         \
                T_ *restrict d = (T_ *)job->out + (b * Lq + i) * Lk;                                                   \
                const int64_t token = i + shift;                                                                       \
                const int64_t last = job->allowed && token < Lk && !shows(job, b, i, token) ? 0 /* padded */            \
                                     : (token < Lk ? token : Lk);                                                      \
                for (int64_t j = 0; j < Lk; ++j) {                                                                     \
                    const int keep = j > 0 && j < last && e[j] > 0 && shows(job, b, i, j);                             \
                    d[j] = keep ? -acc[j] : (T_)0; /* acc: the sum of G over the queries after i */                    \
                }                                                                                                      \
                for (int64_t j = 0; j < Lk; ++j) acc[j] += g[j];                                                       \
            }                                                                                                          \
        }                                                                                                              \
    }

KERNELS(float, f32)
KERNELS(double, f64)

DEFINE_PARALLEL(Job)

/* dtype: 0 float32, 1 float64. E, out: (B, Lq, Lk) contiguous. Returns 0, 1 when out of memory, 2 bad argument. */
int attnlab_select_forward(int dtype, const void *E, void *out, const uint8_t *allowed, const int64_t *strides,
                           int64_t B, int64_t Lq, int64_t Lk, int threads) {
    if (dtype < 0 || dtype > 1 || Lk < 1) return 2;
    Job job = {0};
    job.E = E, job.out = out, job.allowed = allowed, job.Lq = Lq, job.Lk = Lk;
    for (int d = 0; d < 4; ++d) job.as[d] = allowed ? strides[d] : 0;
    return parallel(dtype ? select_fwd_f64 : select_fwd_f32, job, B, threads,
                    (size_t)Lk * (dtype ? 8 : 4));
}

/* G (d bias), E, out (d e): (B, Lq, Lk) contiguous; the forward's mask. */
int attnlab_select_backward(int dtype, const void *G, const void *E, void *out, const uint8_t *allowed,
                            const int64_t *strides, int64_t B, int64_t Lq, int64_t Lk, int threads) {
    if (dtype < 0 || dtype > 1 || Lk < 1) return 2;
    Job job = {0};
    job.G = G, job.E = E, job.out = out, job.allowed = allowed, job.Lq = Lq, job.Lk = Lk;
    for (int d = 0; d < 4; ++d) job.as[d] = allowed ? strides[d] : 0;
    return parallel(dtype ? select_bwd_f64 : select_bwd_f32, job, B, threads, (size_t)Lk * (dtype ? 8 : 4));
}
