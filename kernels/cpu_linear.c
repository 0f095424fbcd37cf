/* A bfloat16 linear layer for the few rows of a decode step: y = x W^T (+ bias), on the CPU.

   With one to four rows a linear is a matrix-vector product: every weight is read once and used
   by a handful of multiply-adds, so its speed is the speed the weights stream from memory.
   oneDNN's bfloat16 GEMM (AMX or AVX512-BF16) is built for many rows and reads the weights of a
   one-row product at under half the bandwidth (kernels/cpu_linear.py has the measurements).

   Here the weight is stored in groups of ROWS output rows, interleaved 32 columns at a time
   ([N / ROWS][K / 32][ROWS][32], laid out by kernels/cpu_linear.py, zero rows padding N): a
   thread walks its groups in storage order, one sequential stream, and AVX512-BF16's
   `vdpbf16ps` multiplies 32 pairs into 16 float32 sums. Each output is its float32 sum (plus
   the bias), rounded to bfloat16 to nearest, ties to even. The order of every sum is fixed, so
   results depend neither on the thread count nor on how the groups are split. */

#include <stdint.h>

#define ROWS 8  /* output rows per group: kernels/cpu_linear.py lays the weight out to match */
#define PAIR 2  /* input rows sharing one pass over a group's weights */
/* How far ahead of its reads a thread asks for its weights (into L2), in 32-column steps of a
   group: 16 KiB. A core alone keeps too few lines in flight to stream at the memory's speed;
   asking this far ahead took one-row products of SmolLM2's shapes from 15-16 to 22-24 GB/s on
   the 2-core AMX Xeon (2 threads), and a 96 MiB one from 21 to 33-36 GB/s. */
#define PREFETCH_STEPS 32

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#include "bfloat16.h"

int chatcore_linear_rows_per_group(void) { return ROWS; }

/* x: [m][k], y: [m][n], w: n_padded / ROWS groups of [k / 32][ROWS][32]; bias: [n] or NULL;
   residual: [m][n] or NULL, added to the rounded product and rounded again, as a decoder layer's
   `residual + linear(x)` rounds twice in bfloat16. k is a multiple of 32; the caller checks every
   shape (kernels/cpu_linear.py). */
void chatcore_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, const uint16_t *residual,
                          uint16_t *y, int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t groups = (n + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *wg = w + g * ROWS * k;
        const int64_t first = g * ROWS;
        const int64_t live = n - first < ROWS ? n - first : ROWS;
        for (int64_t row = 0; row < m; row += PAIR) {
            const int64_t pair = m - row < PAIR ? m - row : PAIR;
            const uint16_t *x0 = x + row * k;
            const uint16_t *x1 = pair > 1 ? x0 + k : x0;
            __m512 sums[PAIR][ROWS];
            for (int p = 0; p < PAIR; p++)
                for (int r = 0; r < ROWS; r++) sums[p][r] = _mm512_setzero_ps();
            for (int64_t col = 0; col < k; col += 32) {
                const __m512bh a0 = (__m512bh)_mm512_loadu_si512(x0 + col);
                const __m512bh a1 = (__m512bh)_mm512_loadu_si512(x1 + col);
                const uint16_t *wk = wg + col * ROWS;
                for (int line = 0; line < ROWS * 32 * 2; line += 64)  /* never faults, even past the end */
                    _mm_prefetch((const char *)(wk + PREFETCH_STEPS * ROWS * 32) + line, _MM_HINT_T1);
#pragma GCC unroll 8
                for (int r = 0; r < ROWS; r++) {
                    const __m512bh b = (__m512bh)_mm512_loadu_si512(wk + r * 32);
                    sums[0][r] = _mm512_dpbf16_ps(sums[0][r], a0, b);
                    sums[1][r] = _mm512_dpbf16_ps(sums[1][r], a1, b);
                }
            }
            for (int p = 0; p < pair; p++)
                for (int r = 0; r < live; r++) {
                    float total = _mm512_reduce_add_ps(sums[p][r]);
                    const int64_t at = (row + p) * n + first + r;
                    if (bias) total += from_bfloat16(bias[first + r]);
                    if (residual) total = rounded(total) + from_bfloat16(residual[at]);
                    y[at] = to_bfloat16(total);
                }
        }
    }
}
#else
int chatcore_linear_rows_per_group(void) { return 0; }  /* no AVX512-BF16: oneDNN serves every row count */
#endif
