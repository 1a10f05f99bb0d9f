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

#include "flush.h"

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
