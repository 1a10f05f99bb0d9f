/* Running a kernel's jobs on threads, for the C kernels of attnlab.kernels (included by each; the build hashes this
   header with the kernel's source).

   A kernel splits its rows into one contiguous range per thread (a Job each, its own struct) and calls
   run_jobs(kernel, jobs, sizeof(Job), threads): job t runs on thread t, so the work each thread does, and so the
   bits of the results, do not depend on how the threads are scheduled. */

#ifndef ATTNLAB_PARALLEL_H
#define ATTNLAB_PARALLEL_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

/* A kernel taking a pointer to its own Job struct (called through this type: every Job kernel has this shape). */
typedef void (*JobKernel)(void *job);

/* The threads to use for n rows: at least 1, at most one per row. */
static inline int job_threads(int64_t n, int threads) {
    if (threads < 1) threads = 1;
    if (threads > n) threads = (int)(n > 0 ? n : 1);
    return threads;
}

#ifndef _OPENMP
typedef struct {
    JobKernel kernel;
    void *job;
} JobTask;

static void *job_task_main(void *arg) {
    JobTask *task = arg;
    task->kernel(task->job);
    return NULL;
}
#endif

/* Runs kernel(jobs[t]) for t in [0, threads), the jobs `size` bytes apart; 0, or 1 when out of memory.

   Built with -fopenmp, on the process's OpenMP threads: the library links libgomp.so.1, which torch has loaded
   already, so these are torch's own workers, which spin for a while after each torch operation waiting for work;
   threads of our own would compete with them for the cores (the softmax kernel took 7.1 ms right after a matrix
   product against 3.9 ms alone). Without OpenMP, on pthreads: the calling thread runs job 0 and the share of any
   thread that could not be started. */
static int run_jobs(JobKernel kernel, void *jobs, size_t size, int threads) {
    char *base = jobs;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; ++t) kernel(base + (size_t)t * size);
    return 0;
#else
    JobTask *tasks = calloc((size_t)threads, sizeof(JobTask));
    pthread_t *ids = calloc((size_t)threads, sizeof(pthread_t));
    int *started = calloc((size_t)threads, sizeof(int));
    if (!tasks || !ids || !started) {
        free(tasks), free(ids), free(started);
        return 1;
    }
    for (int t = 1; t < threads; ++t) {
        tasks[t].kernel = kernel;
        tasks[t].job = base + (size_t)t * size;
        started[t] = pthread_create(&ids[t], NULL, job_task_main, &tasks[t]) == 0;
    }
    for (int t = 1; t < threads; ++t)
        if (!started[t]) kernel(base + (size_t)t * size); /* could not start a thread: do its share here */
    kernel(base);
    for (int t = 1; t < threads; ++t)
        if (started[t]) pthread_join(ids[t], NULL);
    free(tasks), free(ids), free(started);
    return 0;
#endif
}

/* DEFINE_PARALLEL(Job) defines, for a kernel whose Job struct has int64_t begin, end and void *scratch,
   static int parallel(void (*kernel)(Job *), Job base, int64_t n, int threads, size_t scratch_bytes): job t gets
   base with the rows [n t / threads, n (t + 1) / threads) and, when scratch_bytes > 0, a scratch buffer of its own,
   64-byte aligned (so that vectorised loops over it split the same way every call: a vector exp and a scalar one
   differ in the last bit, and a backward pass must give the same bits twice); runs them (run_jobs) and frees them.
   Returns 0, or 1 when out of memory. */
#define DEFINE_PARALLEL(JOB)                                                                                           \
    static int parallel(void (*kernel)(JOB *), JOB base, int64_t n, int threads, size_t scratch_bytes) {               \
        threads = job_threads(n, threads);                                                                             \
        JOB *jobs = calloc((size_t)threads, sizeof(JOB));                                                              \
        if (!jobs) return 1;                                                                                           \
        int status = 0;                                                                                                \
        for (int t = 0; t < threads; ++t) {                                                                            \
            jobs[t] = base;                                                                                            \
            jobs[t].begin = n * t / threads;                                                                           \
            jobs[t].end = n * (t + 1) / threads;                                                                       \
            jobs[t].scratch = NULL;                                                                                    \
            if (scratch_bytes && !(jobs[t].scratch = aligned_alloc(64, (scratch_bytes + 63) / 64 * 64))) status = 1;   \
        }                                                                                                              \
        if (!status) status = run_jobs((JobKernel)kernel, jobs, sizeof(JOB), threads);                                 \
        for (int t = 0; t < threads; ++t) free(jobs[t].scratch);                                                       \
        free(jobs);                                                                                                    \
        return status ? 1 : 0;                                                                                         \
    }

#endif
