/* bfloat16 <-> float32 for the CPU kernels: a bfloat16 is the high half of a float32's bits.
   Rounding is to nearest, ties to even, as torch and oneDNN round; a NaN stays a NaN. */
#ifndef CHATCORE_BFLOAT16_H
#define CHATCORE_BFLOAT16_H

#include <stdint.h>

static inline uint16_t to_bfloat16(float value) {
    uint32_t bits;
    __builtin_memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float from_bfloat16(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float out;
    __builtin_memcpy(&out, &bits, sizeof out);
    return out;
}

/* What torch computes for one bfloat16 operation: the float32 result, rounded once. */
static inline float rounded(float value) { return from_bfloat16(to_bfloat16(value)); }

#endif
