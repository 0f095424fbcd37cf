/* Linear layers on GGUF's own quantized blocks (Q4_0, Q4_1, Q8_0), on the CPU: y = x W^T.

   A GGUF block holds 32 weights of one output row: an fp16 scale d (Q4_1 also an fp16 min m) and
   the quants, 4 bits (Q4: weight j is the low nibble of byte j, weight j + 16 its high nibble) or 8
   bits (Q8_0, signed). The weight is d * q + m (Q4_1), d * (q - 8) (Q4_0) or d * q (Q8_0).

   Layout (kernels/cpu_quant.py `lay_out`, zero rows padding the output to whole groups): groups of
   ROWS output rows; in a group, one stripe per 32-column block, holding the group's ROWS scales
   (fp16), then for Q4_1 its ROWS mins, then its ROWS blocks of quants. A thread walks its groups'
   stripes in storage order: one sequential stream of exactly the file's bytes.

   Few rows: each block is dequantized in registers and never stored. With s_b = sum of the
   activations of block b (computed once per call), a row's output is
       sum_b d_b * (x_b . q_b) + m_b * s_b      (Q4_0: m_b = -8 d_b; Q8_0: m_b = 0)
   in float32: x_b . q_b in vector lanes, d_b folded in by one fused multiply-add per block, the
   lanes summed at the end, then the min terms, block by block. Every order is fixed, so outputs
   depend neither on the thread count nor on which thread took a group.

   Each path (AVX-512F, AVX2 + FMA, and AVX512-BF16, which is the AVX-512F path widening bfloat16
   activations with its own instruction) is compiled for its ISA with `target` attributes, so a
   build for any x86-64 holds them all, and one machine runs every path its CPU supports;
   `chatcore_quant_best_isa` picks at run time. (A function's `target` cannot take away what
   -march=native gives: on an AVX-512 machine the AVX2 path may be encoded with AVX-512's VL forms;
   tests/test_cpu_quant.py builds this file for x86-64-v3 to run the AVX2 path as an AVX2 CPU would.)

   Dequantization (many-row products, and `dequantize`) computes d * q, then + m, rounded once each
   (no fused multiply-add: `fp-contract=off` below), exactly as GGUF's reference does in float32. */

#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bfloat16.h"

#define ROWS 8      /* output rows per group: kernels/cpu_quant.py lays the weight out to match */
#define BLOCK 32    /* weights per block */
#define Q4_0 0      /* qtype codes shared with kernels/cpu_quant.py */
#define Q4_1 1
#define Q8_0 2
#define ISA_AVX2 1  /* isa codes shared with kernels/cpu_quant.py; 0: none of these */
#define ISA_AVX512F 2
#define ISA_AVX512BF16 3
/* How far ahead of its reads a thread asks for its weights (into L2): 16 KiB, as cpu_linear.c. */
#define PREFETCH_BYTES 16384

#define T_AVX2 __attribute__((target("avx2,fma,f16c")))
#define T_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")))
#define T_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

static int64_t quant_bytes(int qtype) { return qtype == Q8_0 ? 32 : 16; }
static int64_t scale_bytes(int qtype) { return qtype == Q4_1 ? 4 : 2; }

/* Bytes of one stripe: ROWS blocks of one block column. */
int64_t chatcore_quant_stripe_bytes(int qtype) { return ROWS * (scale_bytes(qtype) + quant_bytes(qtype)); }

int chatcore_quant_rows_per_group(void) { return ROWS; }

int chatcore_quant_best_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")) return ISA_AVX512BF16;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return ISA_AVX512F;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return ISA_AVX2;
    return 0;
}

/* ---- AVX-512: 16 lanes, a block is two vectors; P rows of x share each dequantized block ---- */

#define P512 2  /* rows of x per pass over a group */

/* The group's ROWS scales of a stripe into d (floats, for broadcasts), and as a vector the lowest
   weights' offsets: Q4_1 its mins, Q4_0 -8 d, Q8_0 zeros. */
#define LOAD_SCALES(stripe, qtype, d, lowest)                                                           \
    do {                                                                                                \
        const __m256 scales = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(stripe)));            \
        _mm256_storeu_ps(d, scales);                                                                    \
        lowest = (qtype) == Q4_1   ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((stripe) + 16))) \
                 : (qtype) == Q4_0 ? _mm256_mul_ps(scales, _mm256_set1_ps(-8.0f))                      \
                                   : _mm256_setzero_ps();                                               \
    } while (0)

T_AVX512 INLINE void block_q4_512(const uint8_t *q, __m512 *lo, __m512 *hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}

T_AVX512 INLINE void block_q8_512(const uint8_t *q, __m512 *lo, __m512 *hi) {
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
}

/* One group's outputs for `pair` (1 or 2, a constant where it is inlined) rows of x: out[p][r] for r < ROWS. */
T_AVX512 INLINE void group_512(const uint8_t *w, int qtype, int64_t blocks, const float *x, const float *sums,
                               int64_t k, int pair, float out[P512][ROWS]) {
    const int64_t stripe = chatcore_quant_stripe_bytes(qtype), qoff = ROWS * scale_bytes(qtype);
    const int64_t qb = quant_bytes(qtype);
    const float *x1 = pair > 1 ? x + k : x;
    __m512 acc[P512][ROWS];
    __m256 mins[P512] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  /* each row's sum of m_b * s_b, ROWS lanes */
    for (int p = 0; p < P512; p++)
        for (int r = 0; r < ROWS; r++) acc[p][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *s = w + b * stripe;
        for (int line = 0; line < stripe; line += 64) _mm_prefetch((const char *)s + PREFETCH_BYTES + line, _MM_HINT_T1);
        float d[ROWS];
        __m256 lowest;
        LOAD_SCALES(s, qtype, d, lowest);
        const __m512 a0 = _mm512_loadu_ps(x + b * BLOCK), a1 = _mm512_loadu_ps(x + b * BLOCK + 16);
        const __m512 c0 = _mm512_loadu_ps(x1 + b * BLOCK), c1 = _mm512_loadu_ps(x1 + b * BLOCK + 16);
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) {
            __m512 lo, hi;
            if (qtype == Q8_0) block_q8_512(s + qoff + r * qb, &lo, &hi);
            else block_q4_512(s + qoff + r * qb, &lo, &hi);
            const __m512 dr = _mm512_set1_ps(d[r]);
            acc[0][r] = _mm512_fmadd_ps(_mm512_fmadd_ps(hi, a1, _mm512_mul_ps(lo, a0)), dr, acc[0][r]);
            if (pair > 1) acc[1][r] = _mm512_fmadd_ps(_mm512_fmadd_ps(hi, c1, _mm512_mul_ps(lo, c0)), dr, acc[1][r]);
        }
        if (qtype != Q8_0)
            for (int p = 0; p < pair; p++)
                mins[p] = _mm256_fmadd_ps(lowest, _mm256_set1_ps(sums[p * (k / BLOCK) + b]), mins[p]);
    }
    for (int p = 0; p < pair; p++) {
        float offsets[ROWS];
        _mm256_storeu_ps(offsets, mins[p]);
        for (int r = 0; r < ROWS; r++) out[p][r] = _mm512_reduce_add_ps(acc[p][r]) + offsets[r];
    }
}

/* ---- AVX2: 8 lanes, a block is four vectors, one row of x per pass ---- */

T_AVX2 INLINE void block_q4_256(const uint8_t *q, __m256 v[4]) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    const __m256i b0 = _mm256_cvtepu8_epi32(bytes), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    const __m256i low = _mm256_set1_epi32(15);
    v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));
    v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));
    v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
}

T_AVX2 INLINE void block_q8_256(const uint8_t *q, __m256 v[4]) {
    for (int i = 0; i < 4; i++)
        v[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i))));
}

T_AVX2 INLINE float sum_256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

T_AVX2 INLINE void group_256(const uint8_t *w, int qtype, int64_t blocks, const float *x, const float *sums,
                             float out[ROWS]) {
    const int64_t stripe = chatcore_quant_stripe_bytes(qtype), qoff = ROWS * scale_bytes(qtype);
    const int64_t qb = quant_bytes(qtype);
    __m256 acc[ROWS], mins = _mm256_setzero_ps();
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *s = w + b * stripe;
        for (int line = 0; line < stripe; line += 64) _mm_prefetch((const char *)s + PREFETCH_BYTES + line, _MM_HINT_T1);
        float d[ROWS];
        __m256 lowest;
        LOAD_SCALES(s, qtype, d, lowest);
        const float *xb = x + b * BLOCK;
        const __m256 a0 = _mm256_loadu_ps(xb), a1 = _mm256_loadu_ps(xb + 8), a2 = _mm256_loadu_ps(xb + 16),
                     a3 = _mm256_loadu_ps(xb + 24);
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) {
            __m256 v[4];
            if (qtype == Q8_0) block_q8_256(s + qoff + r * qb, v);
            else block_q4_256(s + qoff + r * qb, v);
            __m256 dot = _mm256_fmadd_ps(v[1], a1, _mm256_mul_ps(v[0], a0));
            dot = _mm256_fmadd_ps(v[3], a3, _mm256_fmadd_ps(v[2], a2, dot));
            acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d[r]), acc[r]);
        }
        if (qtype != Q8_0) mins = _mm256_fmadd_ps(lowest, _mm256_set1_ps(sums[b]), mins);
    }
    float offsets[ROWS];
    _mm256_storeu_ps(offsets, mins);
    for (int r = 0; r < ROWS; r++) out[r] = sum_256(acc[r]) + offsets[r];
}

/* ---- activations: float32 or bfloat16 rows into float32, and each block's sum ---- */

T_AVX512BF16 static void widen_bf16_512bf16(const uint16_t *x, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(x + i))));
    for (; i < n; i++) out[i] = from_bfloat16(x[i]);
}

/* xf: [m][k] float32 copies of bfloat16 rows; sums: [m][k / 32], each block's sum in a fixed order. */
static void prepare(const void *x, int x_bf16, int isa, int64_t m, int64_t k, float *xf, float *sums) {
    if (!x_bf16) xf = (float *)x;
    else if (isa == ISA_AVX512BF16) widen_bf16_512bf16(x, xf, m * k);
    else
        for (int64_t i = 0; i < m * k; i++) xf[i] = from_bfloat16(((const uint16_t *)x)[i]);
    for (int64_t i = 0; i < m * k / BLOCK; i++) {
        float s = 0.0f;
        for (int j = 0; j < BLOCK; j++) s += xf[i * BLOCK + j];
        sums[i] = s;
    }
}

static void store(void *y, int y_bf16, int64_t at, float value) {
    if (y_bf16) ((uint16_t *)y)[at] = to_bfloat16(value);
    else ((float *)y)[at] = value;
}

T_AVX512 static void rows_512(const uint8_t *w, int qtype, const float *xf, const float *sums, void *y, int y_bf16,
                              int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t groups = (n + ROWS - 1) / ROWS, blocks = k / BLOCK, group_bytes = blocks * chatcore_quant_stripe_bytes(qtype);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t first = g * ROWS, live = n - first < ROWS ? n - first : ROWS;
        for (int64_t row = 0; row < m; row += P512) {
            const int pair = m - row < P512 ? (int)(m - row) : P512;
            float out[P512][ROWS];
            if (pair == P512) group_512(w + g * group_bytes, qtype, blocks, xf + row * k, sums + row * blocks, k, P512, out);
            else group_512(w + g * group_bytes, qtype, blocks, xf + row * k, sums + row * blocks, k, 1, out);
            for (int p = 0; p < pair; p++)
                for (int r = 0; r < live; r++) store(y, y_bf16, (row + p) * n + first + r, out[p][r]);
        }
    }
}

T_AVX2 static void rows_256(const uint8_t *w, int qtype, const float *xf, const float *sums, void *y, int y_bf16,
                            int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t groups = (n + ROWS - 1) / ROWS, blocks = k / BLOCK, group_bytes = blocks * chatcore_quant_stripe_bytes(qtype);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t first = g * ROWS, live = n - first < ROWS ? n - first : ROWS;
        for (int64_t row = 0; row < m; row++) {
            float out[ROWS];
            group_256(w + g * group_bytes, qtype, blocks, xf + row * k, sums + row * blocks, out);
            for (int r = 0; r < live; r++) store(y, y_bf16, row * n + first + r, out[r]);
        }
    }
}

/* y = x W^T for m rows. x: [m][k] float32 or bfloat16 (x_bf16), y: [m][n] in the same dtype; w: the
   laid-out weight, ceil(n / ROWS) groups of k / 32 stripes; k a positive multiple of 32; isa one
   this CPU supports. The caller (kernels/cpu_quant.py) checks every shape. Returns 0, or -1 when
   the scratch for the float32 rows cannot be allocated (nothing written). */
int chatcore_quant_linear(const void *x, const uint8_t *w, void *y, int x_bf16, int qtype, int isa, int64_t m,
                          int64_t n, int64_t k, int threads) {
    float *xf = malloc((size_t)(m * k + m * (k / BLOCK) + 1) * sizeof(float));
    if (!xf) return -1;
    float *sums = xf + m * k;
    prepare(x, x_bf16, isa, m, k, xf, sums);
    const float *rows = x_bf16 ? xf : x;
    if (isa == ISA_AVX2) rows_256(w, qtype, rows, sums, y, x_bf16, m, n, k, threads);
    else rows_512(w, qtype, rows, sums, y, x_bf16, m, n, k, threads);
    free(xf);
    return 0;
}

/* ---- dequantization: rows [first, first + count) of the weight into out ([count][k]) ---- */

static float half_to_float(const uint8_t *p) {  /* exact; no F16C needed (the library builds anywhere) */
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 31u, mantissa = h & 0x3ffu;
    if (exponent == 0) {  /* zero or subnormal: mantissa * 2^-24, exact in float32 */
        const float magnitude = (float)mantissa * (1.0f / 16777216.0f);
        return sign ? -magnitude : magnitude;
    }
    const uint32_t bits = sign | (exponent == 31 ? 0x7f800000u | (mantissa << 13) : ((exponent + 112) << 23) | (mantissa << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void dequantize_group_block(const uint8_t *s, int qtype, int r, float *dst) {
    const float d = half_to_float(s + 2 * r);
    const uint8_t *q = s + ROWS * scale_bytes(qtype) + r * quant_bytes(qtype);
    if (qtype == Q8_0) {
        for (int j = 0; j < BLOCK; j++) dst[j] = d * (float)(int8_t)q[j];
        return;
    }
    const float m = qtype == Q4_1 ? half_to_float(s + 2 * ROWS + 2 * r) : 0.0f;
    const int offset = qtype == Q4_1 ? 0 : 8;
    for (int j = 0; j < BLOCK / 2; j++) {
        dst[j] = d * (float)((q[j] & 15) - offset) + m;
        dst[j + 16] = d * (float)((q[j] >> 4) - offset) + m;
    }
}

/* out: [count][k] float32, or bfloat16 (out_bf16, each weight rounded once from its float32 value). */
void chatcore_quant_dequantize(const uint8_t *w, void *out, int out_bf16, int qtype, int64_t first, int64_t count,
                               int64_t k, int threads) {
    const int64_t blocks = k / BLOCK, stripe = chatcore_quant_stripe_bytes(qtype), group_bytes = blocks * stripe;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < count; i++) {
        const int64_t row = first + i;
        const uint8_t *g = w + (row / ROWS) * group_bytes;
        float buffer[BLOCK];
        for (int64_t b = 0; b < blocks; b++) {
            float *dst = out_bf16 ? buffer : (float *)out + i * k + b * BLOCK;
            dequantize_group_block(g + b * stripe, qtype, (int)(row % ROWS), dst);
            if (out_bf16)
                for (int j = 0; j < BLOCK; j++) ((uint16_t *)out)[i * k + b * BLOCK + j] = to_bfloat16(buffer[j]);
        }
    }
}
