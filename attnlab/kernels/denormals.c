/* Flushing denormal floats to zero on torch's threads, for attnlab.kernels.denormals.

   A float below the smallest normal (1.2e-38 in float32) is computed by x86 and ARM cores in microcode, tens of times
   slower than a normal one. An attention whose logits span a wide, smooth range (forgetting attention's bias folded
   into q and k: -c_j grows by |log f| per key) makes SDPA's flash kernel produce exp() values in that range for a
   band of keys in every row, and its backward pass ran 3-4x slower for it. Setting the cores' flush-to-zero and
   denormals-are-zero modes (x86 MXCSR FTZ | DAZ; aarch64 FPCR.FZ) makes those values 0, as they would be a little
   further out, which changes no result beyond the 1e-38 of a float32's smallest normal.

   attnlab_denormals(mode, threads): mode 1 sets the modes, 0 clears them, on the calling thread and on each of the
   `threads` OpenMP threads (torch's own pool: this library links the libgomp that torch has loaded); returns the
   previous state of the calling thread (1: set), or -1 where the platform has no such mode (then nothing is done). */

#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FLUSH_BITS 0x8040u /* FTZ (bit 15) | DAZ (bit 6) */
static int get_mode(void) { return (_mm_getcsr() & FLUSH_BITS) == FLUSH_BITS; }
static void set_mode(int on) { _mm_setcsr(on ? (_mm_getcsr() | FLUSH_BITS) : (_mm_getcsr() & ~FLUSH_BITS)); }
#define HAS_MODE 1
#elif defined(__aarch64__)
static inline uint64_t get_fpcr(void) {
    uint64_t r;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(r));
    return r;
}
static inline void put_fpcr(uint64_t r) { __asm__ __volatile__("msr fpcr, %0" : : "r"(r)); }
static int get_mode(void) { return (get_fpcr() >> 24) & 1u; }
static void set_mode(int on) { put_fpcr(on ? (get_fpcr() | (1ull << 24)) : (get_fpcr() & ~(1ull << 24))); }
#define HAS_MODE 1
#else
#define HAS_MODE 0
#endif

int attnlab_denormals(int mode, int threads) {
#if HAS_MODE
    const int previous = get_mode();
    if (threads < 1) threads = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    set_mode(mode);
#endif
    set_mode(mode);
    return previous;
#else
    (void)mode, (void)threads;
    return -1;
#endif
}
