/* The pointwise parts of a decoder layer's bfloat16 step: RMSNorm, RoPE, and SiLU times the up
   projection (chatcore/models/fused_layer.py calls them through kernels/cpu_pointwise.py). Rows
   are shared among `threads` when a step has values enough (`PARALLEL_VALUES`) to pay for it.

   Each computes what transformers' Llama modules compute in bfloat16, rounding where torch
   rounds: torch runs every bfloat16 operation in float32 and rounds its result to bfloat16, so
   `a * b + c * d` on bfloat16 tensors is three roundings. Only the order of the RMSNorm's sum
   and the last bit of `expf` may differ from torch's, which can change the last bit of an output. */

#include <math.h>
#include <stdint.h>

/* Full-width vectors where the CPU has AVX-512 (gcc's default for it is 256 bits): SiLU * up at
   64 rows of SmolLM2 64 -> 47 us, at 512 rows 527 -> 278 us on the 2-core AMX Xeon. */
#pragma GCC target("prefer-vector-width=512")

#include "bfloat16.h"

/* glibc's vector expf (libmvec), declared as in cpu_decode.c: the SiLU loop vectorizes. */
__attribute__((__simd__("notinbranch"))) float expf(float);

#define PARALLEL_VALUES 16384  /* below this many values a step runs on the calling thread */
#define TEAM(values) num_threads((values) >= PARALLEL_VALUES ? threads : 1)

/* y = weight * bf16(x * rsqrt(mean(x^2) + eps)), per row of `dim`; x, y: [rows][dim]. */
void chatcore_rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *y, int64_t rows, int64_t dim,
                            float eps, int threads) {
#pragma omp parallel for schedule(static) TEAM(rows * dim)
    for (int64_t row = 0; row < rows; row++) {
        const uint16_t *in = x + row * dim;
        uint16_t *out = y + row * dim;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) {
            const float value = from_bfloat16(in[i]);
            sum += value * value;
        }
        const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            out[i] = to_bfloat16(from_bfloat16(weight[i]) * rounded(from_bfloat16(in[i]) * scale));
    }
}

/* RoPE in place on the first `heads` heads of each row (row i starts at x + i * stride):
   v * cos + rotate_half(v) * sin, with cos and sin [rows][head_dim] and rotate_half(v) =
   (-v[half:], v[:half]). head_dim is even and at most 1024. */
void chatcore_rope_bf16(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t rows, int64_t stride,
                        int64_t heads, int64_t head_dim, int threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) TEAM(rows * heads * head_dim)
    for (int64_t row = 0; row < rows; row++) {
        float low[512], high[512];
        const uint16_t *c = cos + row * head_dim;
        const uint16_t *s = sin + row * head_dim;
        for (int64_t head = 0; head < heads; head++) {
            uint16_t *v = x + row * stride + head * head_dim;
            for (int64_t i = 0; i < half; i++) {
                low[i] = from_bfloat16(v[i]);
                high[i] = from_bfloat16(v[half + i]);
            }
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                v[i] = to_bfloat16(rounded(low[i] * from_bfloat16(c[i])) + rounded(-high[i] * from_bfloat16(s[i])));
                v[half + i] = to_bfloat16(rounded(high[i] * from_bfloat16(c[half + i]))
                                          + rounded(low[i] * from_bfloat16(s[half + i])));
            }
        }
    }
}

/* y = bf16(silu(gate)) * up, where each row of gate_up is [gate (inter) | up (inter)]; y: [rows][inter]. */
void chatcore_silu_mul_bf16(const uint16_t *gate_up, uint16_t *y, int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for schedule(static) TEAM(rows * inter)
    for (int64_t row = 0; row < rows; row++) {
        const uint16_t *gate = gate_up + row * 2 * inter;
        const uint16_t *up = gate + inter;
        uint16_t *out = y + row * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float g = from_bfloat16(gate[i]);
            out[i] = to_bfloat16(rounded(g / (1.0f + expf(-g))) * from_bfloat16(up[i]));
        }
    }
}
