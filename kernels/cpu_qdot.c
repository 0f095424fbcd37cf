/* Integer dot products on GGUF's blocks (Q4_0, Q4_1, Q8_0) for few-row linears: y = x W^T.

   The weight is kernels/cpu_quant.c's layout (groups of ROWS output rows; per 32-column block one
   stripe of the ROWS fp16 scales, Q4_1's ROWS fp16 mins, then the ROWS blocks of quants).

   Each row of x is quantized once per call to 8-bit blocks of 32, as GGUF's Q8_0/Q8_1 do it:
       a = max |x_j| over the block, d_x = a / 127, q_j = round-half-even(x_j * (1 / d_x)) in [-127, 127]
   (d_x = 0 gives q = 0), and s = d_x * sum_j q_j (Q8_1's second field). So |x_j - d_x q_j| <= d_x / 2
   (plus a rounding of x_j / d_x: the tests allow 0.51 d_x). A block's product is then an integer:
       isum = sum_j w_j q_j    (w_j: the 4-bit quants 0..15, or Q8_0's signed bytes)
   and a row's output is sum_b d_w d_x isum_b + m_w s_b in float32 (Q4_1: m_w its min; Q4_0: m_w =
   -8 d_w; Q8_0: no such term). The integer products:
     * AVX512-VNNI (+VL): `vpdpbusd` on 256-bit vectors, one block a vector (unsigned x signed bytes,
       summed in fours into int32 without saturation);
     * AVX2: `vpmaddubsw` (pairs into int16) then `vpmaddwd` by ones (into int32). A pair of 4-bit
       quants times bytes stays below 2 * 15 * 127; Q8_0 takes |w| as the unsigned operand and x's
       byte with w's sign (`vpsignb`), so a pair stays below 2 * 128 * 127 = 32,512 < 32,767: exact.
   Both give the same int32 sums, so the two paths give the same bits. Every float order is fixed:
   outputs depend neither on the thread count nor on which thread took a group.

   The quantization itself uses AVX2 (every integer path has it). Paths are compiled with `target`
   attributes, so a build for any x86-64 holds them; `chatcore_qdot_supported` says at run time
   which this CPU executes (kernels/cpu_quant.py asks, and refuses a path it lacks). */

#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bfloat16.h"

#define ROWS 8     /* as cpu_quant.c */
#define BLOCK 32
#define Q4_0 0     /* qtype codes shared with kernels/cpu_quant.py */
#define Q4_1 1
#define Q8_0 2
#define ISA_AVX2_INT8 4     /* isa codes shared with kernels/cpu_quant.py (1-3 are cpu_quant.c's float paths) */
#define ISA_AVX512VNNI 5
#define PREFETCH_BYTES 16384

#define T_AVX2 __attribute__((target("avx2,fma,f16c")))
#define T_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define INLINE static inline __attribute__((always_inline))

int chatcore_qdot_supported(int isa) {
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == ISA_AVX2_INT8) return avx2;
    if (isa == ISA_AVX512VNNI)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
               && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return 0;
}

static int64_t scale_bytes(int qtype) { return qtype == Q4_1 ? 4 : 2; }
static int64_t quant_bytes(int qtype) { return qtype == Q8_0 ? 32 : 16; }

/* ---- the activations: m rows of k floats into int8 blocks, their scales d and sums s ---- */

T_AVX2 static float max_abs_256(const float *x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 top = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
    for (int i = 8; i < BLOCK; i += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

/* q: [m][k] int8; d, s: [m][k / 32]. NaN in x gives an unspecified block (as a float product would
   give NaN, the output is then meaningless either way). */
T_AVX2 void chatcore_qdot_quantize(const float *x, int64_t m, int64_t k, int8_t *q, float *d, float *s) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < m * k / BLOCK; b++) {
        const float *xb = x + b * BLOCK;
        const float top = max_abs_256(xb), scale = top / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        const __m256 by = _mm256_set1_ps(inverse);
        __m256i v[4];
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), by),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i total = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        /* packs interleave the four vectors' halves per 128-bit lane; the permutation restores order */
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + b * BLOCK), _mm256_permutevar8x32_epi32(bytes, order));
        d[b] = scale;
        s[b] = scale * (float)_mm_cvtsi128_si32(t);
    }
}

/* ---- one block's integer product: 8 int32 partial sums ---- */

T_AVX2 INLINE __m256i nibbles(const uint8_t *w) {  /* 16 bytes -> weights 0..15 (low nibbles), 16..31 (high) */
    const __m128i raw = _mm_loadu_si128((const __m128i *)w);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

T_AVX2 INLINE __m256i dot_avx2(__m256i u, __m256i s) {  /* u unsigned, s signed, pairs below 32,767 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

T_AVX2 INLINE __m256i block_avx2(const uint8_t *w, int qtype, __m256i a) {
    if (qtype != Q8_0) return dot_avx2(nibbles(w), a);
    const __m256i signed_w = _mm256_loadu_si256((const __m256i *)w);
    return dot_avx2(_mm256_sign_epi8(signed_w, signed_w), _mm256_sign_epi8(a, signed_w));
}

T_VNNI INLINE __m256i block_vnni(const uint8_t *w, int qtype, __m256i a) {
    if (qtype != Q8_0) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), nibbles(w), a);
    const __m256i signed_w = _mm256_loadu_si256((const __m256i *)w);
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(signed_w, signed_w),
                               _mm256_sign_epi8(a, signed_w));
}

T_AVX2 INLINE float sum_256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* One group's ROWS outputs for one quantized row (q, d, s of its blocks). `BLOCK_DOT` is the path's
   block product; the rest is shared text, so both paths round identically. */
#define GROUP_BODY(BLOCK_DOT)                                                                              \
    const int64_t stripe = ROWS * (scale_bytes(qtype) + quant_bytes(qtype)), qoff = ROWS * scale_bytes(qtype); \
    const int64_t qb = quant_bytes(qtype);                                                                 \
    __m256 acc[ROWS], mins = _mm256_setzero_ps();                                                          \
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();                                           \
    for (int64_t b = 0; b < blocks; b++) {                                                                 \
        const uint8_t *st = w + b * stripe;                                                                \
        for (int line = 0; line < stripe; line += 64)                                                      \
            _mm_prefetch((const char *)st + PREFETCH_BYTES + line, _MM_HINT_T1);                           \
        const __m256 scales = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)st));                      \
        float dd[ROWS];                                                                                    \
        _mm256_storeu_ps(dd, _mm256_mul_ps(scales, _mm256_set1_ps(d[b])));                                 \
        if (qtype == Q4_1) {                                                                               \
            const __m256 lowest = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + 16)));           \
            mins = _mm256_fmadd_ps(lowest, _mm256_set1_ps(s[b]), mins);                                    \
        } else if (qtype == Q4_0) {                                                                        \
            mins = _mm256_fmadd_ps(_mm256_mul_ps(scales, _mm256_set1_ps(-8.0f)), _mm256_set1_ps(s[b]), mins); \
        }                                                                                                  \
        const __m256i a = _mm256_loadu_si256((const __m256i *)(q + b * BLOCK));                            \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                                           \
            const __m256 isum = _mm256_cvtepi32_ps(BLOCK_DOT(st + qoff + r * qb, qtype, a));               \
            acc[r] = _mm256_fmadd_ps(isum, _mm256_set1_ps(dd[r]), acc[r]);                                 \
        }                                                                                                  \
    }                                                                                                      \
    float offsets[ROWS];                                                                                   \
    _mm256_storeu_ps(offsets, mins);                                                                       \
    for (int r = 0; r < ROWS; r++) out[r] = sum_256(acc[r]) + offsets[r];

T_AVX2 static void group_avx2(const uint8_t *w, int qtype, int64_t blocks, const int8_t *q, const float *d,
                              const float *s, float out[ROWS]) {
    GROUP_BODY(block_avx2)
}

T_VNNI static void group_vnni(const uint8_t *w, int qtype, int64_t blocks, const int8_t *q, const float *d,
                              const float *s, float out[ROWS]) {
    GROUP_BODY(block_vnni)
}

static void products(const uint8_t *w, int qtype, int isa, const int8_t *q, const float *d, const float *s, void *y,
                     int y_bf16, int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t groups = (n + ROWS - 1) / ROWS, blocks = k / BLOCK;
    const int64_t group_bytes = blocks * ROWS * (scale_bytes(qtype) + quant_bytes(qtype));
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t first = g * ROWS, live = n - first < ROWS ? n - first : ROWS;
        for (int64_t row = 0; row < m; row++) {
            float out[ROWS];
            if (isa == ISA_AVX512VNNI)
                group_vnni(w + g * group_bytes, qtype, blocks, q + row * k, d + row * blocks, s + row * blocks, out);
            else
                group_avx2(w + g * group_bytes, qtype, blocks, q + row * k, d + row * blocks, s + row * blocks, out);
            for (int64_t r = 0; r < live; r++) {
                if (y_bf16) ((uint16_t *)y)[row * n + first + r] = to_bfloat16(out[r]);
                else ((float *)y)[row * n + first + r] = out[r];
            }
        }
    }
}

/* y = x W^T for m rows: x [m][k] float32 or bfloat16 (x_bf16), y [m][n] in x's dtype; isa one that
   `chatcore_qdot_supported` accepts; the caller (kernels/cpu_quant.py) checks every shape. Returns
   0, or -1 when the scratch cannot be allocated (nothing written). */
int chatcore_qdot_linear(const void *x, const uint8_t *w, void *y, int x_bf16, int qtype, int isa, int64_t m,
                         int64_t n, int64_t k, int threads) {
    const int64_t blocks = m * k / BLOCK;
    char *scratch = malloc((size_t)(m * k) * (x_bf16 ? 5 : 1) + (size_t)(2 * blocks) * sizeof(float) + 64);
    if (!scratch) return -1;
    float *d = (float *)scratch, *s = d + blocks, *wide = s + blocks;
    int8_t *q = (int8_t *)(x_bf16 ? wide + m * k : wide);
    const float *rows = x;
    if (x_bf16) {
        for (int64_t i = 0; i < m * k; i++) wide[i] = from_bfloat16(((const uint16_t *)x)[i]);
        rows = wide;
    }
    chatcore_qdot_quantize(rows, m, k, q, d, s);
    products(w, qtype, isa, q, d, s, y, x_bf16, m, n, k, threads);
    free(scratch);
    return 0;
}
