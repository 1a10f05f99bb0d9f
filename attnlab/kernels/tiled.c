/* Tiled softmax attention with a score modifier, forward and backward, on the CPU, for attnlab.kernels.tiled.

   The FlashAttention-2 algorithm (Dao 2023, Algorithms 1 and 2) on blocks of BQ query rows and BK keys: the logits
   of one (BQ, BK) tile at a time, an online softmax with the row's running maximum m and sum l, the row's
   log-sum-exp kept for the backward pass, which recomputes each tile's weights from it. No (Lq, Lk) tensor exists.

   The score modifier, in order (attnlab.forms.softmax):
     x_ij = scale q_i . k_j + T[b, h, i][clamp(j - i, clo, chi) - clo]      a bias table read at the offset j - i
            (T5's buckets or ALiBi's slopes x distance over every offset, chi - clo = Lq + Lk - 2; Shaw's q . w^K
            per row, clipped at +-k), its strides 0 where it broadcasts;
     x_ij <- cap tanh(x_ij / cap)                                           soft-capping (Gemma 2), when cap > 0;
     hidden keys: j outside the row's interval [lo_i, hi_i) or keys[b, j] == 0 (key padding);
     w_ij = e^{x_ij} / (e^{sink_h} [+] sum_visible e^{x})                  softmax; softmax1 (sink 0); the learned
                                                                            sink per head (gpt-oss);
     w_ij = sigmoid(x_ij + rb[b, i])                                        sigmoid attention (no row statistics).
   Whole key blocks outside the rows' intervals, or with no real key, are skipped (the mask as structure).

   The block products go through the BLAS sgemm_/dgemm_ whose address the caller passes (PyTorch's own MKL, one
   thread inside our parallel region), or through the plain loops below where none is given (the fully fused form,
   measured against it in docs/performance.md). Forward work items are the (b, h, query block) triples; backward
   items the (b, key/value head) pairs, so that every thread owns the dK, dV and dT it accumulates (grouped query
   heads run one after the other inside their item). -ffast-math assumes no infinities: hidden keys get weight 0 by
   a select, never through exp(-inf), and an empty running maximum is the lowest finite number.

   Each job runs with the core's flush-to-zero and denormals-are-zero modes on (flush.h; put back as they were after
   it): weights below the smallest normal float (1.2e-38) are 0, as they would be a little further out. ALiBi's
   -m |j - i| reaches -256 at L 1024, so a band of keys in every row of its steepest head had weights in that range,
   which the cores (and MKL's products of them) compute in microcode, tens of times slower than normal numbers. */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fastmath.h"
#include "flush.h"
#include "parallel.h"

typedef struct {
    int dtype, normalizer; /* normalizer: 0 softmax (a sink when sink != NULL), 1 sigmoid */
    int64_t B, H, G, Lq, Lk, d, dv, BQ, BK;
    double scale, cap;
    const void *q, *k, *v; /* (B, H, Lq, d), (B, G, Lk, d), (B, G, Lk, dv), contiguous */
    void *z, *lse;         /* (B, H, Lq, dv), (B, H, Lq) */
    const void *table;     /* bias table or NULL */
    int64_t ts[3], clo, chi;
    const void *sink;      /* (H,) sink logits or NULL */
    const void *row_bias;  /* sigmoid: (B or 1, Lq) bias, stride rbs */
    int64_t rbs;
    const int64_t *lo, *hi; /* (Lq,) key interval per row, or NULL (all keys) */
    const uint8_t *keys;    /* (B, Lk) 1 = a real key, or NULL */
    const int64_t *kcount;  /* (B, Lk + 1) running count of real keys (block skipping), with keys */
    const void *dz, *delta; /* backward: (B, H, Lq, dv), (B, H, Lq) */
    void *dq, *dk, *dvv, *dtable;
    int64_t dts[3]; /* dtable strides (b, h, i) */
    void *sgemm, *dgemm;
} Args;

typedef struct {
    const Args *a;
    const Args *a2; /* backward of differential attention: the second map (NULL otherwise) */
    double lam;     /* its lambda */
    int64_t begin, end;
    void *scratch;
} Job;

DEFINE_PARALLEL(Job)

typedef void (*GemmF32)(const char *, const char *, const int *, const int *, const int *, const float *,
                        const float *, const int *, const float *, const int *, const float *, float *, const int *);
typedef void (*GemmF64)(const char *, const char *, const int *, const int *, const int *, const double *,
                        const double *, const int *, const double *, const int *, const double *, double *,
                        const int *);

/* The key interval of query rows [i0, i1) together, clipped to the batch's real keys. */
static void block_keys(const Args *a, int64_t b, int64_t i0, int64_t i1, int64_t *klo, int64_t *khi) {
    int64_t lo = a->Lk, hi = 0;
    if (!a->lo) {
        lo = 0, hi = a->Lk;
    } else {
        for (int64_t i = i0; i < i1; ++i) {
            if (a->lo[i] < a->hi[i]) {
                lo = a->lo[i] < lo ? a->lo[i] : lo;
                hi = a->hi[i] > hi ? a->hi[i] : hi;
            }
        }
    }
    if (a->keys && lo < hi) { /* shrink to the first and last real key in [lo, hi) */
        const int64_t *c = a->kcount + b * (a->Lk + 1);
        if (c[hi] == c[lo]) {
            lo = hi = 0;
        } else {
            while (c[lo + 1] == c[lo]) ++lo;
            while (c[hi - 1] == c[hi]) --hi;
        }
    }
    *klo = lo < hi ? lo : 0;
    *khi = lo < hi ? hi : 0;
}

/* Whether key block [j0, j1) of batch b holds a real key. */
static inline int block_has_keys(const Args *a, int64_t b, int64_t j0, int64_t j1) {
    if (!a->keys) return 1;
    const int64_t *c = a->kcount + b * (a->Lk + 1);
    return c[j1] > c[j0];
}

#define REAL float
#define SUF f32
#define EXP expf
#define LOG logf
#define TANH tanh_f32
#define LOWEST (-FLT_MAX)
#define GEMM_T GemmF32
#define GEMM_PTR sgemm
#include "tiled_body.h"
#undef REAL
#undef SUF
#undef EXP
#undef LOG
#undef TANH
#undef LOWEST
#undef GEMM_T
#undef GEMM_PTR

#define REAL double
#define SUF f64
#define EXP exp
#define LOG log
#define TANH tanh
#define LOWEST (-DBL_MAX)
#define GEMM_T GemmF64
#define GEMM_PTR dgemm
#include "tiled_body.h"

static size_t real_size(const Args *a) { return a->dtype == 0 ? sizeof(float) : sizeof(double); }

/* 0 done, 1 out of memory. */
/* The jobs with the flush modes on (see the top). */
static void fwd_job(Job *job) {
    const int saved = get_mode();
    set_mode(1);
    if (job->a->dtype == 0) fwd_f32(job);
    else fwd_f64(job);
    set_mode(saved);
}

static void bwd_job(Job *job) {
    const int saved = get_mode();
    set_mode(1);
    if (job->a->dtype == 0) bwd_f32(job);
    else bwd_f64(job);
    set_mode(saved);
}

int attnlab_tiled_forward(const Args *a, int threads) {
    Job base = {.a = a};
    const int64_t nqb = (a->Lq + a->BQ - 1) / a->BQ;
    const size_t scratch = real_size(a) * (size_t)(a->BQ * a->BK + 2 * a->BQ + a->BQ * a->dv);
    return parallel(fwd_job, base, a->B * a->H * nqb, threads, scratch);
}

/* dq, dk, dv, dtable zeroed by the caller (dk, dv and dtable are accumulated). */
int attnlab_tiled_backward(const Args *a, int threads) {
    Job base = {.a = a};
    const size_t scratch = real_size(a) * (size_t)(3 * a->BQ * a->BK);
    return parallel(bwd_job, base, a->B * a->G, threads, scratch);
}

/* Differential attention's backward, z = z1 - lam z2: a the first map (its dz the gradient of z, its dvv the values'
   gradient), a2 the second (the same shapes, mask and values; its own q, k, lse, delta = -lam sum dz z2, dq, dk,
   dtable). Zeroed by the caller as above. */
int attnlab_tiled_backward_pair(const Args *a, const Args *a2, double lam, int threads) {
    Job base = {.a = a, .a2 = a2, .lam = lam};
    const size_t scratch = real_size(a) * (size_t)(6 * a->BQ * a->BK);
    return parallel(bwd_job, base, a->B * a->G, threads, scratch);
}

int64_t attnlab_tiled_args_size(void) { return (int64_t)sizeof(Args); }
