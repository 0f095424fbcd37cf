/* Paged decode attention on the CPU, reading K and V blocks where they lie.

   The torch reference gathers every sequence's blocks into a contiguous buffer and then runs
   SDPA over it: each layer's K/V is read, written and read again. This reads it once. One task
   is one sequence and some of its kv heads: the query heads sharing each kv head (GQA) score
   every cached token, take an exact two-pass softmax (max, then exp and sum) and accumulate the
   values. Query, output and caches may each be float32, bfloat16 or float16; everything is
   computed in float32 (half-precision blocks are widened into a scratch buffer once, then read
   by every query head of their group) and the output is rounded to the query's dtype (nearest,
   ties to even, as torch rounds). Every sum runs in a fixed order per query row, so results do
   not depend on the thread count or on how tasks split the heads. Built and loaded by
   kernels/native.py, which validates the arguments first. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bfloat16.h"

/* glibc's vector expf (libmvec), declared as math.h does under -ffast-math: the softmax loop
   then calls it 16 (AVX-512) or 8 (AVX2) lanes at a time, without relaxing any other math. */
__attribute__((__simd__("notinbranch"))) float expf(float);

#define LANES 16

/* Eight floats: one AVX2 register, half an AVX-512 one; head_dim must be a multiple of 8
   (kernels/native.py checks). Every load and store of a vector or a row element goes through
   memcpy, which the compiler turns into one unaligned move: torch hands over views at any
   element offset (a bfloat16 cache may start 2 bytes past a 4-byte boundary), so no pointer
   here is assumed aligned beyond its element's bytes. */
typedef float vec __attribute__((vector_size(32)));
typedef uint32_t wide_bits __attribute__((vector_size(32)));
#define W 8

enum kind { F32 = 0, BF16 = 1, F16 = 2 };

#ifdef __FLT16_MAX__
typedef _Float16 f16x8 __attribute__((vector_size(16)));
int chatcore_has_f16(void) { return 1; }
#else
int chatcore_has_f16(void) { return 0; }
#endif

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* Eight float16 elements from p, widened to float. Without _Float16 no float16 call gets here
   (chatcore_paged_decode returns -3 first). */
static inline vec load_f16(const char *p) {
#ifdef __FLT16_MAX__
    f16x8 h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vec);
#else
    (void)p;
    return (vec){0};
#endif
}

static inline size_t element_size(int kind) { return kind == F32 ? 4 : 2; }

static inline float scalar_in(const char *p, int kind) {
    float f = 0;
    if (kind == BF16) {
        uint16_t h;
        memcpy(&h, p, 2);
        f = from_bfloat16(h);
#ifdef __FLT16_MAX__
    } else if (kind == F16) {
        _Float16 h;
        memcpy(&h, p, 2);
        f = (float)h;
#endif
    } else {
        memcpy(&f, p, 4);
    }
    return f;
}

static inline void scalar_out(char *p, float f, int kind) {
    if (kind == BF16) {
        const uint16_t h = to_bfloat16(f);
        memcpy(p, &h, 2);
#ifdef __FLT16_MAX__
    } else if (kind == F16) {
        const _Float16 h = (_Float16)f;
        memcpy(p, &h, 2);
#endif
    } else {
        memcpy(p, &f, 4);
    }
}

/* The sum of a vector's lanes, paired as transpose_sum pairs them, so a token's score does
   not depend on which of the two computed it. */
static inline float hsum(vec v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

/* r[j] = hsum(v[j]) for eight vectors at once: three rounds of shuffles and adds instead of
   eight separate reductions. */
static inline vec transpose_sum(const vec *v) {
    const vec a0 = __builtin_shufflevector(v[0], v[1], 0, 8, 2, 10, 4, 12, 6, 14) +
                   __builtin_shufflevector(v[0], v[1], 1, 9, 3, 11, 5, 13, 7, 15);
    const vec a1 = __builtin_shufflevector(v[2], v[3], 0, 8, 2, 10, 4, 12, 6, 14) +
                   __builtin_shufflevector(v[2], v[3], 1, 9, 3, 11, 5, 13, 7, 15);
    const vec a2 = __builtin_shufflevector(v[4], v[5], 0, 8, 2, 10, 4, 12, 6, 14) +
                   __builtin_shufflevector(v[4], v[5], 1, 9, 3, 11, 5, 13, 7, 15);
    const vec a3 = __builtin_shufflevector(v[6], v[7], 0, 8, 2, 10, 4, 12, 6, 14) +
                   __builtin_shufflevector(v[6], v[7], 1, 9, 3, 11, 5, 13, 7, 15);
    const vec b0 = __builtin_shufflevector(a0, a1, 0, 1, 8, 9, 4, 5, 12, 13) +
                   __builtin_shufflevector(a0, a1, 2, 3, 10, 11, 6, 7, 14, 15);
    const vec b1 = __builtin_shufflevector(a2, a3, 0, 1, 8, 9, 4, 5, 12, 13) +
                   __builtin_shufflevector(a2, a3, 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(b0, b1, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(b0, b1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Pairwise, so the compiler reduces with vector shuffles instead of a chain of 16 adds. */
static float lane_sum(float *lanes) {
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
    return lanes[0];
}

/* Stores eight tokens' scaled scores from their accumulators; returns the lanewise max with best. */
static inline vec store_scores(float *scores, const vec *s, float scale, vec best) {
    const vec sums = transpose_sum(s) * scale;
    store(scores, sums);
    const wide_bits above = (wide_bits)(sums > best);
    return (vec)(((wide_bits)sums & above) | ((wide_bits)best & ~above));
}

/* scores[t] = q . k[t * stride : + dim] * scale for n rows of k; returns max(top, scores).
   Eight tokens at a time: eight independent accumulators keep both FMA units busy, and one
   transposed reduction replaces eight horizontal ones. */
static inline float score_rows(const float *restrict q, const float *restrict k, int64_t n, int64_t stride,
                               int64_t dim, float scale, float *restrict scores, float top) {
    int64_t t = 0;
    vec best = {top, top, top, top, top, top, top, top};
    for (; t + W <= n; t += W) {
        vec s[W] = {{0}};
        for (int64_t c = 0; c < dim; c += W) {
            const vec qc = load(q + c);
            for (int j = 0; j < W; ++j) s[j] += qc * load(k + (t + j) * stride + c);
        }
        best = store_scores(scores + t, s, scale, best);
    }
    for (int j = 0; j < W; ++j) top = best[j] > top ? best[j] : top;
    for (; t < n; ++t) {
        vec s = {0};
        for (int64_t c = 0; c < dim; c += W) s += load(q + c) * load(k + t * stride + c);
        const float score = hsum(s) * scale;
        scores[t] = score;
        top = score > top ? score : top;
    }
    return top;
}

/* a[0:dim] += sum over n tokens of p[t] * v[t * stride : + dim]; up to 128 dims stay in
   registers (eight or sixteen independent chains). */
static inline void accumulate(float *restrict a, const float *restrict p, const float *restrict v, int64_t n,
                              int64_t stride, int64_t dim) {
    for (int64_t c0 = 0; c0 < dim; c0 += 16 * W) {
        const int64_t width = dim - c0 < 16 * W ? dim - c0 : 16 * W;
        vec s[16];
        for (int64_t c = 0; c < width; c += W) s[c / W] = load(a + c0 + c);
        for (int64_t t = 0; t < n; ++t)
            for (int64_t c = 0; c < width; c += W) s[c / W] += p[t] * load(v + t * stride + c0 + c);
        for (int64_t c = 0; c < width; c += W) store(a + c0 + c, s[c / W]);
    }
}

/* bfloat16 rows are read in place as 32-bit words, each holding two neighbours: the even
   element as a float is the word shifted up 16 bits, the odd one the word with its low half
   cleared. Rows are addressed in bfloat16 elements (a word may start at any even byte) and
   eight words are copied out at once (one unaligned 32-byte load). The query is split into its even and odd elements once per task (qe, qo), and the
   value sums are kept the same way (ae, ao), so no row is ever widened into memory. Requires
   head_dim % 16 == 0 (eight words a vector; kernels/native.py checks). */
static inline vec even_of(wide_bits w) { return (vec)(w << 16); }
static inline vec odd_of(wide_bits w) { return (vec)(w & 0xffff0000u); }
static inline wide_bits load_words(const uint16_t *p) {
    wide_bits w;
    memcpy(&w, p, sizeof w);
    return w;
}

static inline float score_rows_bf16(const float *restrict qe, const float *restrict qo, const uint16_t *restrict k,
                                    int64_t n, int64_t stride, int64_t words, float scale, float *restrict scores,
                                    float top) {
    int64_t t = 0;
    vec best = {top, top, top, top, top, top, top, top};
    for (; t + W <= n; t += W) {
        vec s[W] = {{0}};
        for (int64_t c = 0; c < words; c += W) {
            const vec e = load(qe + c), o = load(qo + c);
            for (int j = 0; j < W; ++j) {
                const wide_bits w = load_words(k + (t + j) * stride + 2 * c);
                s[j] += e * even_of(w);
                s[j] += o * odd_of(w);
            }
        }
        best = store_scores(scores + t, s, scale, best);
    }
    for (int j = 0; j < W; ++j) top = best[j] > top ? best[j] : top;
    for (; t < n; ++t) {
        vec s = {0};
        for (int64_t c = 0; c < words; c += W) {
            const wide_bits w = load_words(k + t * stride + 2 * c);
            s += load(qe + c) * even_of(w);
            s += load(qo + c) * odd_of(w);
        }
        const float score = hsum(s) * scale;
        scores[t] = score;
        top = score > top ? score : top;
    }
    return top;
}

static inline void accumulate_bf16(float *restrict ae, float *restrict ao, const float *restrict p,
                                   const uint16_t *restrict v, int64_t n, int64_t stride, int64_t words) {
    for (int64_t c0 = 0; c0 < words; c0 += 8 * W) {
        const int64_t width = words - c0 < 8 * W ? words - c0 : 8 * W;
        vec e[8], o[8];
        for (int64_t c = 0; c < width; c += W) e[c / W] = load(ae + c0 + c), o[c / W] = load(ao + c0 + c);
        for (int64_t t = 0; t < n; ++t)
            for (int64_t c = 0; c < width; c += W) {
                const wide_bits w = load_words(v + t * stride + 2 * (c0 + c));
                e[c / W] += p[t] * even_of(w);
                o[c / W] += p[t] * odd_of(w);
            }
        for (int64_t c = 0; c < width; c += W) store(ae + c0 + c, e[c / W]), store(ao + c0 + c, o[c / W]);
    }
}

/* Asks for the slice [offset, offset + bytes) of every row of the block after `index` (if the
   context reaches it), to arrive while this block is computed: blocks lie anywhere in the pool,
   where no hardware prefetcher can guess them. */
static void prefetch_block(const char *cache, const int32_t *table, int64_t index, int64_t len, int64_t block_size,
                           int64_t num_blocks, size_t row_bytes, size_t offset, size_t bytes) {
    if ((index + 1) * block_size >= len) return;
    const int64_t block = table[index + 1];
    if (block < 0 || block >= num_blocks) return;
    for (int64_t t = 0; t < block_size; ++t) {
        const char *row = cache + (size_t)(block * block_size + t) * row_bytes + offset;
        for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
    }
}

/* The float rows of `n` tokens' slice [offset, offset + floats) of one block: in place for a
   float32 cache (stride token_stride), float16 widened into `wide` (stride floats). bfloat16
   never comes here: it is read in place as words. */
static inline const float *block_rows(const char *cache, int64_t block, int64_t block_size, int64_t token_stride,
                                      int64_t offset, int64_t floats, int64_t n, int kind, float *wide,
                                      int64_t *stride) {
    const size_t size = element_size(kind);
    const char *base = cache + ((size_t)block * block_size * token_stride + offset) * size;
    if (kind == F32) {
        *stride = token_stride;
        return (const float *)base;
    }
    for (int64_t t = 0; t < n; ++t)
        for (int64_t c = 0; c < floats; c += W) store(wide + t * floats + c, load_f16(base + (t * token_stride + c) * size));
    *stride = floats;
    return wide;
}

/* One task: `rows` float query rows (q, o) over one sequence's first `len` tokens, reading the
   slice [offset, offset + floats) of each token row. Inlined with the cache's kind and head_dim
   64 and 128 as constants, so the inner loops unroll fully for the common cases. */
static inline __attribute__((always_inline)) void attend(
    const float *q, const char *key_cache, const char *value_cache, const int32_t *table, int64_t len, int64_t rows,
    int64_t group, int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t token_stride, int64_t offset,
    int64_t floats, int kind, float scale, float *scores, float *acc, float *wide, float *o) {
    const int64_t used = (len + block_size - 1) / block_size, half = head_dim / 2;
    const size_t size = element_size(kind), row_bytes = (size_t)token_stride * size;
    float *denominators = acc + rows * head_dim;  /* each row's running max first, then its sum */
    for (int64_t r = 0; r < rows; ++r) denominators[r] = -INFINITY;
    if (kind == BF16)  /* wide holds each query row's even elements, then its odd ones */
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t i = 0; i < half; ++i)
                wide[r * head_dim + i] = q[r * head_dim + 2 * i], wide[r * head_dim + half + i] = q[r * head_dim + 2 * i + 1];
    for (int64_t b = 0; b < used; ++b) {
        prefetch_block(key_cache, table, b, len, block_size, num_blocks, row_bytes, offset * size, floats * size);
        const int64_t first = b * block_size, n = len - first < block_size ? len - first : block_size;
        if (kind == BF16) {
            const uint16_t *k = (const uint16_t *)key_cache + (size_t)table[b] * block_size * token_stride + offset;
            for (int64_t r = 0; r < rows; ++r)
                denominators[r] = score_rows_bf16(wide + r * head_dim, wide + r * head_dim + half,
                                                  k + (r / group) * head_dim, n, token_stride, half, scale,
                                                  scores + r * len + first, denominators[r]);
            continue;
        }
        int64_t stride;
        const float *k = block_rows(key_cache, table[b], block_size, token_stride, offset, floats, n, kind, wide, &stride);
        for (int64_t r = 0; r < rows; ++r)
            denominators[r] = score_rows(q + r * head_dim, k + (r / group) * head_dim, n, stride, head_dim, scale,
                                         scores + r * len + first, denominators[r]);
    }
    for (int64_t r = 0; r < rows; ++r) {
        float *row = scores + r * len;
        const float top = denominators[r];
        float lanes[LANES] = {0};
        int64_t t = 0;
        for (; t + LANES <= len; t += LANES)
            for (int l = 0; l < LANES; ++l) {
                row[t + l] = expf(row[t + l] - top);
                lanes[l] += row[t + l];
            }
        for (int l = 0; t < len; ++t, ++l) {
            row[t] = expf(row[t] - top);
            lanes[l] += row[t];
        }
        denominators[r] = lane_sum(lanes);
    }
    memset(acc, 0, sizeof(float) * (size_t)(rows * head_dim));
    for (int64_t b = 0; b < used; ++b) {
        prefetch_block(value_cache, table, b, len, block_size, num_blocks, row_bytes, offset * size, floats * size);
        const int64_t first = b * block_size, n = len - first < block_size ? len - first : block_size;
        if (kind == BF16) {
            const uint16_t *v = (const uint16_t *)value_cache + (size_t)table[b] * block_size * token_stride + offset;
            for (int64_t r = 0; r < rows; ++r)
                accumulate_bf16(acc + r * head_dim, acc + r * head_dim + half, scores + r * len + first,
                                v + (r / group) * head_dim, n, token_stride, half);
            continue;
        }
        int64_t stride;
        const float *v = block_rows(value_cache, table[b], block_size, token_stride, offset, floats, n, kind, wide,
                                    &stride);
        for (int64_t r = 0; r < rows; ++r)
            accumulate(acc + r * head_dim, scores + r * len + first, v + (r / group) * head_dim, n, stride, head_dim);
    }
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < head_dim; ++d) {
            const int64_t from = kind == BF16 ? (d % 2) * half + d / 2 : d;  /* bf16: re-interleave */
            o[r * head_dim + d] = acc[r * head_dim + from] / denominators[r];
        }
}

static inline __attribute__((always_inline)) void attend_dim(
    const float *q, const char *key_cache, const char *value_cache, const int32_t *table, int64_t len, int64_t rows,
    int64_t group, int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t token_stride, int64_t offset,
    int64_t floats, int kind, float scale, float *scores, float *acc, float *wide, float *o) {
    if (head_dim == 64)
        attend(q, key_cache, value_cache, table, len, rows, group, 64, block_size, num_blocks, token_stride, offset,
               floats, kind, scale, scores, acc, wide, o);
    else if (head_dim == 128)
        attend(q, key_cache, value_cache, table, len, rows, group, 128, block_size, num_blocks, token_stride, offset,
               floats, kind, scale, scores, acc, wide, o);
    else
        attend(q, key_cache, value_cache, table, len, rows, group, head_dim, block_size, num_blocks, token_stride,
               offset, floats, kind, scale, scores, acc, wide, o);
}

/* Returns 0, or -1 when a thread could not allocate its buffers, or -2 when a block id the
   context needs is outside [0, num_blocks), or -3 for a kind this build cannot read, or -4 when
   a context is longer than `max_context`. `out` (the query's kind) is then unspecified. */
int chatcore_paged_decode(const void *query, const void *key_cache, const void *value_cache,
                          const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens, void *out,
                          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t num_blocks, int64_t max_context, float scale, int query_kind,
                          int cache_kind, int threads) {
    if ((query_kind == F16 || cache_kind == F16) && !chatcore_has_f16()) return -3;
    const int64_t group = num_heads / num_kv_heads;
    /* A task reads whole token rows (every kv head: one stream per block) when there are
       sequences enough to keep the threads busy, else one kv head's slice of them. */
    const int64_t span = num_seqs >= 4 * threads ? num_kv_heads : 1;
    const int64_t parts = num_kv_heads / span, tasks = num_seqs * parts, rows = span * group;
    const int64_t token_stride = num_kv_heads * head_dim, floats = span * head_dim;
    const size_t query_size = element_size(query_kind);
    int status = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(rows * (max_context > 0 ? max_context : 1)));
        float *acc = malloc(sizeof(float) * (size_t)(rows * (head_dim + 1)));
        float *rows_in = malloc(sizeof(float) * (size_t)(2 * rows * head_dim));  /* query in, output out */
        /* f16: one block's widened rows; bf16: the task's query rows split into even and odd */
        const size_t wide_floats = (size_t)(cache_kind == F16 ? block_size * floats : rows * head_dim);
        float *wide = cache_kind == F32 ? NULL : malloc(sizeof(float) * wide_floats);
        const int ready = scores && acc && rows_in && (cache_kind == F32 || wide);
        if (!ready) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            if (!ready) continue;
            const int64_t seq = task / parts, offset = (task % parts) * span * head_dim;
            const int64_t len = context_lens[seq], used = (len + block_size - 1) / block_size;
            const size_t first = (size_t)(seq * num_heads * head_dim + offset * group), count = (size_t)(rows * head_dim);
            const char *q_in = (const char *)query + first * query_size;
            char *o_out = (char *)out + first * query_size;
            const int32_t *table = block_tables + seq * table_stride;
            if (len <= 0) {
                memset(o_out, 0, count * query_size);
                continue;
            }
            if (len > max_context) {  /* the scores were sized for max_context: never write past them */
#pragma omp atomic write
                status = -4;
                continue;
            }
            int bad = 0;
            for (int64_t b = 0; b < used && !bad; ++b) bad = table[b] < 0 || table[b] >= num_blocks;
            if (bad) {
#pragma omp atomic write
                status = -2;
                continue;
            }
            const float *q = (const float *)q_in;
            float *o = (float *)o_out;
            if (query_kind != F32) {
                float *q_wide = rows_in;
                for (size_t i = 0; i < count; ++i) q_wide[i] = scalar_in(q_in + i * query_size, query_kind);
                q = q_wide;
                o = rows_in + count;
            }
            if (cache_kind == BF16)
                attend_dim(q, key_cache, value_cache, table, len, rows, group, head_dim, block_size, num_blocks,
                           token_stride, offset, floats, BF16, scale, scores, acc, wide, o);
            else if (cache_kind == F16)
                attend_dim(q, key_cache, value_cache, table, len, rows, group, head_dim, block_size, num_blocks,
                           token_stride, offset, floats, F16, scale, scores, acc, wide, o);
            else
                attend_dim(q, key_cache, value_cache, table, len, rows, group, head_dim, block_size, num_blocks,
                           token_stride, offset, floats, F32, scale, scores, acc, wide, o);
            if (query_kind != F32)
                for (size_t i = 0; i < count; ++i) scalar_out(o_out + i * query_size, o[i], query_kind);
        }
        free(scores);
        free(acc);
        free(rows_in);
        free(wide);
    }
    return status;
}
