/* The cores' flush-to-zero and denormals-are-zero modes (x86 MXCSR FTZ | DAZ; aarch64 FPCR.FZ), for the C kernels of
   attnlab.kernels (denormals.c, tiled.c; the build hashes this header with each kernel's source): get_mode(),
   set_mode(on), HAS_MODE (0 where the platform has no such mode, and the two do nothing). */

#ifndef ATTNLAB_FLUSH_H
#define ATTNLAB_FLUSH_H

#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FLUSH_BITS 0x8040u /* FTZ (bit 15) | DAZ (bit 6) */
static inline int get_mode(void) { return (_mm_getcsr() & FLUSH_BITS) == FLUSH_BITS; }
static inline void set_mode(int on) { _mm_setcsr(on ? (_mm_getcsr() | FLUSH_BITS) : (_mm_getcsr() & ~FLUSH_BITS)); }
#define HAS_MODE 1
#elif defined(__aarch64__)
static inline uint64_t get_fpcr(void) {
    uint64_t r;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(r));
    return r;
}
static inline void put_fpcr(uint64_t r) { __asm__ __volatile__("msr fpcr, %0" : : "r"(r)); }
static inline int get_mode(void) { return (get_fpcr() >> 24) & 1u; }
static inline void set_mode(int on) { put_fpcr(on ? (get_fpcr() | (1ull << 24)) : (get_fpcr() & ~(1ull << 24))); }
#define HAS_MODE 1
#else
#define HAS_MODE 0
static inline int get_mode(void) { return 0; }
static inline void set_mode(int on) { (void)on; }
#endif

#endif
