/*
 * e^x for the C kernels (kernels/_fused.c, kernels/_paged_attn.c), vectorizable: Cephes' expf
 * polynomial after x = n ln2 + r, |r| <= ln2 / 2 (relative error ~2e-7). The caller clamps x to
 * [-87, 88] first, so 2^n is a normal float and the result never overflows nor goes denormal.
 */
#ifndef HALFMOON_EXPF_H
#define HALFMOON_EXPF_H

#include <math.h>
#include <stdint.h>

static inline __attribute__((always_inline)) float hm_exp_in_range(float c) {
    const float n = floorf(c * 1.44269504088896341f + 0.5f);
    const float r = c - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return y * scale.f;
}

#endif
