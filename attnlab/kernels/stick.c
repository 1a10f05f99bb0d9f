/* Stick-breaking attention's weights on the CPU, for attnlab.kernels.stick (Tan et al. 2025, "Scaling
   Stick-Breaking Attention: An Efficient Implementation and In-depth Study", eq. 3), forward and backward, one pass
   over a row each way, in log space:

       beta_ij = sigmoid(z_ij),   w_ij = beta_ij * prod_{k in K(i), k > j} (1 - beta_ik)

   over the keys K(i) the row sees (the allowed mask, and not the query's own key i + Lk - Lq unless attend_current),
   the nearest key first: log w_j = log sigmoid(z_j) + sum_{k > j} log sigmoid(-z_k), the sum carried from the last
   key down, so no product underflows before its exponent and every partial sum is as short as it can be.
   log sigmoid(x) = -softplus(-x), softplus(x) = max(x, 0) + log1p(exp(-|x|)).

   forward:  W <- weights (W must not be S: the backward pass reads the logits). Hidden keys get exactly 0.
   backward: with g_j = dW_j w_j, dz_j = g_j (1 - beta_j) - beta_j sum_{k < j, k in K(i)} g_k (the key's own
             factor, and its (1 - beta) in the weights of every earlier key), carried from the first key up;
             dS <- dz (dS may be dW), 0 at hidden keys.

   The allowed mask is a uint8 tensor broadcast over (B, H, Lq, Lk) by its strides (0 where it broadcasts); NULL:
   every key visible. Work items are the B*H*Lq rows, one contiguous range per thread (run_jobs, parallel.h). */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "parallel.h"

typedef struct {
    const void *S;  /* forward: logits; backward: dW */
    void *W;        /* forward: weights out; backward: dS out */
    const void *P;  /* backward: the weights */
    const void *L;  /* backward: the logits */
    const uint8_t *allowed;
    int64_t as[4];
    int64_t H, Lq, Lk;
    int attend_current;
    int64_t begin, end;
    void *scratch; /* backward: two rows of Lk per thread */
} Job;

static inline const uint8_t *allowed_row(const Job *job, int64_t item) {
    if (!job->allowed) return NULL;
    const int64_t i = item % job->Lq, bh = item / job->Lq, h = bh % job->H, b = bh / job->H;
    return job->allowed + b * job->as[0] + h * job->as[1] + i * job->as[2];
}

/* whether key j is in the row's K(i): allowed, and not the query's own key unless attend_current */
static inline int sees(const Job *job, const uint8_t *a, int64_t own, int64_t j) {
    if (a && !a[j * job->as[3]]) return 0;
    return job->attend_current || j != own;
}

#define SENTINEL_LOG (-1e30) /* a hidden key's log-weight: exp gives 0 (-ffast-math assumes no infinities) */

/* Three passes a row, the first and last without a carried dependency, so that the compiler vectorises them (exp and
   log1p through libmvec): (1) L_j = log1p(exp(-|z_j|)), shared by softplus(z) = max(z, 0) + L and
   softplus(-z) = max(-z, 0) + L; (2) the scan from the last key down, log w_j = -softplus(-z_j) + rest,
   rest += -softplus(z_j), over the keys the row sees; (3) w_j = exp(log w_j). The backward pass: (1) g_j = dW_j w_j;
   (2) the scan up, I_j = sum_{k <= j} g_k (into a row of scratch); (3) dz_j = g_j - beta_j I_j
   (= g_j (1 - beta_j) - beta_j sum_{k < j} g_k), beta_j = sigmoid(z_j) without overflow. A weight below the
   smallest normal float (exp(x), x < log FLT_MIN) is written as 0, and so is a gradient below it: a far key's weight
   decays smoothly through the denormal range, and the matrix products that read the weights ran 3x slower on them. */
#define KERNELS(T_, SUF, EXP, LOG1P, LOG_MIN, TINY)                                                                                   \
    static void stick_fwd_##SUF(Job *job) {                                                                            \
        const int64_t Lk = job->Lk;                                                                                    \
        for (int64_t item = job->begin; item < job->end; ++item) {                                                     \
            const T_ *s = (const T_ *)job->S + item * Lk;                                                              \
            T_ *restrict w = (T_ *)job->W + item * Lk;                                                                 \
            const uint8_t *a = allowed_row(job, item);                                                                 \
            const int64_t own = item % job->Lq + (Lk - job->Lq);                                                       \
            for (int64_t j = 0; j < Lk; ++j) {                                                                         \
                const T_ z = s[j];                                                                                     \
                w[j] = LOG1P(EXP(-(z > 0 ? z : -z)));                                                                  \
            }                                                                                                          \
            T_ rest = 0; /* sum of log(1 - beta_k) over the keys after j */                                            \
            for (int64_t j = Lk - 1; j >= 0; --j) {                                                                    \
                if (!sees(job, a, own, j)) {                                                                           \
                    w[j] = (T_)SENTINEL_LOG;                                                                           \
                    continue;                                                                                          \
                }                                                                                                      \
                const T_ z = s[j], l = w[j];                                                                           \
                w[j] = rest - ((z < 0 ? -z : (T_)0) + l); /* + log sigmoid(z) */                                       \
                rest -= (z > 0 ? z : (T_)0) + l;          /* + log sigmoid(-z) = log(1 - beta) */                      \
            }                                                                                                          \
            for (int64_t j = 0; j < Lk; ++j) {                                                                         \
                const T_ x = w[j];                                                                                     \
                w[j] = x < LOG_MIN ? (T_)0 : EXP(x); /* never denormal: BLAS then reads them at full speed */           \
            }                                                                                                          \
        }                                                                                                              \
    }                                                                                                                  \
                                                                                                                       \
    static void stick_bwd_##SUF(Job *job) {                                                                            \
        const int64_t Lk = job->Lk;                                                                                    \
        T_ *scan = job->scratch;                                                                                       \
        for (int64_t item = job->begin; item < job->end; ++item) {                                                     \
            const T_ *g = (const T_ *)job->S + item * Lk;                                                              \
            T_ *d = (T_ *)job->W + item * Lk;                                                                          \
            const T_ *restrict w = (const T_ *)job->P + item * Lk;                                                     \
            const T_ *restrict z = (const T_ *)job->L + item * Lk;                                                     \
            const uint8_t *a = allowed_row(job, item);                                                                 \
            const int64_t own = item % job->Lq + (Lk - job->Lq);                                                       \
            T_ *restrict gw = scan + Lk;                                                                               \
            for (int64_t j = 0; j < Lk; ++j) gw[j] = g[j] * w[j];                                                      \
            T_ total = 0;                                                                                              \
            for (int64_t j = 0; j < Lk; ++j) {                                                                         \
                if (sees(job, a, own, j)) total += gw[j];                                                              \
                scan[j] = total;                                                                                       \
            }                                                                                                          \
            for (int64_t j = 0; j < Lk; ++j) {                                                                         \
                const T_ x = z[j], e = EXP(-(x > 0 ? x : -x)); /* sigmoid without overflow */                          \
                const T_ beta = x > 0 ? (T_)1 / ((T_)1 + e) : e / ((T_)1 + e);                                         \
                const T_ dz = gw[j] - beta * scan[j];                                                                  \
                d[j] = (dz < 0 ? -dz : dz) < TINY ? (T_)0 : dz; /* no denormal either */                               \
            }                                                                                                          \
            for (int64_t j = 0; j < Lk; ++j)                                                                           \
                if (!sees(job, a, own, j)) d[j] = 0;                                                                   \
        }                                                                                                              \
    }

KERNELS(float, f32, expf, log1pf, -87.3f, FLT_MIN)
KERNELS(double, f64, exp, log1p, -708.3, DBL_MIN)

typedef void (*Kernel)(Job *);
DEFINE_PARALLEL(Job)

static const Kernel FORWARD[2] = {stick_fwd_f32, stick_fwd_f64};
static const Kernel BACKWARD[2] = {stick_bwd_f32, stick_bwd_f64};

/* dtype: 0 float32, 1 float64. S (logits), W (weights out): (B, H, Lq, Lk) contiguous, W not S. Returns 0, or 1
   when out of memory, 2 for a bad argument. */
int attnlab_stick_forward(int dtype, const void *S, void *W, const uint8_t *allowed, const int64_t *allowed_strides,
                          int64_t B, int64_t H, int64_t Lq, int64_t Lk, int attend_current, int threads) {
    if (dtype < 0 || dtype > 1 || S == W) return 2;
    Job job = {0};
    job.S = S, job.W = W, job.allowed = allowed, job.attend_current = attend_current;
    for (int d = 0; d < 4; ++d) job.as[d] = allowed ? allowed_strides[d] : 0;
    job.H = H, job.Lq = Lq, job.Lk = Lk;
    return parallel(FORWARD[dtype], job, B * H * Lq, threads, 0);
}

/* dW, dS: (B, H, Lq, Lk) contiguous (dS may be dW); P: the forward's weights; L: its logits; the same mask. */
int attnlab_stick_backward(int dtype, const void *dW, void *dS, const void *P, const void *L, const uint8_t *allowed,
                           const int64_t *allowed_strides, int64_t B, int64_t H, int64_t Lq, int64_t Lk,
                           int attend_current, int threads) {
    if (dtype < 0 || dtype > 1) return 2;
    Job job = {0};
    job.S = dW, job.W = dS, job.P = P, job.L = L, job.allowed = allowed, job.attend_current = attend_current;
    for (int d = 0; d < 4; ++d) job.as[d] = allowed ? allowed_strides[d] : 0;
    job.H = H, job.Lq = Lq, job.Lk = Lk;
    return parallel(BACKWARD[dtype], job, B * H * Lq, threads, (size_t)(2 * Lk) * (dtype ? 8 : 4));
}
