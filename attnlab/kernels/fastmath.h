/* Fast float32 tanh shared by the C kernels of attnlab.kernels (included by each that needs it; the build hashes
   this header with the kernel's source). */

#ifndef ATTNLAB_FASTMATH_H
#define ATTNLAB_FASTMATH_H

#include <math.h>

/* tanh in float32 as a rational function (the odd degree-13 / even degree-6 minimax fit that Eigen and XLA use for
   float tanh), x clamped at ±7.9053 (tanh rounds to within 3e-7 of ±1 there): no exp, one division, vectorised by
   the compiler. Measured against float64 tanh over [−30, 30]: at most 3.5e-7 absolute, 3.8e-7 relative (3 ulp;
   torch's tanhf: 6e-8); 0.30 ns an element on one core here, against 0.69 ns for 1 − 2 / (e^{2x} + 1). */
static inline float tanh_f32(float x) {
    const float a = fminf(fmaxf(x, -7.90531110763549805f), 7.90531110763549805f), x2 = a * a;
    float p = x2 * -2.76076847742355e-16f + 2.00018790482477e-13f;
    p = p * x2 - 8.60467152213735e-11f;
    p = p * x2 + 5.12229709037114e-08f;
    p = p * x2 + 1.48572235717979e-05f;
    p = p * x2 + 6.37261928875436e-04f;
    p = p * x2 + 4.89352455891786e-03f;
    float q = x2 * 1.19825839466702e-06f + 1.18534705686654e-04f;
    q = q * x2 + 2.26843463243900e-03f;
    q = q * x2 + 4.89352518554385e-03f;
    return a * p / q;
}

#endif
