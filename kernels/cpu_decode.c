/* Paged decode attention for float32 on the CPU, reading K and V blocks where they lie.

   The torch reference gathers every sequence's blocks into a contiguous buffer and then runs
   SDPA over it: each layer's K/V is read, written and read again. This reads it once. One task
   is one sequence and some of its kv heads: the query heads sharing each kv head (GQA) score
   every cached token, take an exact two-pass softmax (max, then exp and sum) and accumulate the
   values. Every sum runs in float32 in a fixed order per query row, so results do not depend on
   the thread count or on how tasks split the heads. Built and loaded by kernels/native.py,
   which validates the arguments first. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* glibc's vector expf (libmvec), declared as math.h does under -ffast-math: the softmax loop
   then calls it 16 (AVX-512) or 8 (AVX2) lanes at a time, without relaxing any other math. */
__attribute__((__simd__("notinbranch"))) float expf(float);

#define LANES 16

/* Eight floats: one AVX2 register, half an AVX-512 one. Loads and stores go through the
   unaligned variant; head_dim must be a multiple of 8 (kernels/native.py checks). */
typedef float vec __attribute__((vector_size(32)));
typedef float vec_unaligned __attribute__((vector_size(32), aligned(4)));
#define W 8

static inline vec load(const float *p) { return *(const vec_unaligned *)p; }
static inline void store(float *p, vec v) { *(vec_unaligned *)p = v; }
static inline float hsum(vec v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

/* Pairwise, so the compiler reduces with vector shuffles instead of a chain of 16 adds. */
static float lane_sum(float *lanes) {
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
    return lanes[0];
}

static inline float dot(const float *a, const float *b, int64_t dim) {
    vec s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int64_t c = 0;
    for (; c + 4 * W <= dim; c += 4 * W) {
        s0 += load(a + c) * load(b + c);
        s1 += load(a + c + W) * load(b + c + W);
        s2 += load(a + c + 2 * W) * load(b + c + 2 * W);
        s3 += load(a + c + 3 * W) * load(b + c + 3 * W);
    }
    for (; c < dim; c += W) s0 += load(a + c) * load(b + c);
    return hsum((s0 + s1) + (s2 + s3));
}

/* a[0:dim] += sum over n tokens of p[t] * v[t * stride : + dim], the accumulator in registers. */
static inline void accumulate(float *a, const float *p, const float *v, int64_t n, int64_t stride, int64_t dim) {
    int64_t c = 0;
    for (; c + 4 * W <= dim; c += 4 * W) {
        vec s0 = load(a + c), s1 = load(a + c + W), s2 = load(a + c + 2 * W), s3 = load(a + c + 3 * W);
        for (int64_t t = 0; t < n; ++t) {
            const float *row = v + t * stride + c;
            s0 += p[t] * load(row);
            s1 += p[t] * load(row + W);
            s2 += p[t] * load(row + 2 * W);
            s3 += p[t] * load(row + 3 * W);
        }
        store(a + c, s0), store(a + c + W, s1), store(a + c + 2 * W, s2), store(a + c + 3 * W, s3);
    }
    for (; c < dim; c += W) {
        vec s = load(a + c);
        for (int64_t t = 0; t < n; ++t) s += p[t] * load(v + t * stride + c);
        store(a + c, s);
    }
}

/* Asks for the slice [offset, offset + floats) of every row of the block after `index` (if the
   context reaches it), to arrive while this block is computed: blocks lie anywhere in the pool,
   where no hardware prefetcher can guess them. */
static void prefetch_block(const float *cache, const int32_t *table, int64_t index, int64_t len, int64_t block_size,
                           int64_t num_blocks, int64_t token_stride, int64_t offset, int64_t floats) {
    if ((index + 1) * block_size >= len) return;
    const int64_t block = table[index + 1];
    if (block < 0 || block >= num_blocks) return;
    for (int64_t t = 0; t < block_size; ++t) {
        const float *row = cache + (block * block_size + t) * token_stride + offset;
        for (int64_t f = 0; f < floats; f += 16) __builtin_prefetch(row + f, 0, 3);
    }
}

/* One task: `rows` query rows (q, o) over one sequence's first `len` tokens, reading the slice
   [offset, offset + floats) of each token row. Inlined with head_dim 64 and 128 as constants,
   so the inner loops unroll fully for the common sizes. */
static inline __attribute__((always_inline)) void attend(
    const float *q, const float *key_cache, const float *value_cache, const int32_t *table, int64_t len, int64_t rows,
    int64_t group, int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t token_stride, int64_t offset,
    int64_t floats, float scale, float *scores, float *acc, float *o) {
    const int64_t used = (len + block_size - 1) / block_size;
    float *denominators = acc + rows * head_dim;  /* each row's running max first, then its sum */
    for (int64_t r = 0; r < rows; ++r) denominators[r] = -INFINITY;
    for (int64_t b = 0; b < used; ++b) {
        prefetch_block(key_cache, table, b, len, block_size, num_blocks, token_stride, offset, floats);
        const float *k = key_cache + table[b] * block_size * token_stride + offset;
        const int64_t first = b * block_size, n = len - first < block_size ? len - first : block_size;
        for (int64_t r = 0; r < rows; ++r) {
            float top = denominators[r];
            for (int64_t t = 0; t < n; ++t) {
                const float score = dot(q + r * head_dim, k + t * token_stride + (r / group) * head_dim, head_dim) * scale;
                scores[r * len + first + t] = score;
                top = score > top ? score : top;
            }
            denominators[r] = top;
        }
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
        prefetch_block(value_cache, table, b, len, block_size, num_blocks, token_stride, offset, floats);
        const float *v = value_cache + table[b] * block_size * token_stride + offset;
        const int64_t first = b * block_size, n = len - first < block_size ? len - first : block_size;
        for (int64_t r = 0; r < rows; ++r)
            accumulate(acc + r * head_dim, scores + r * len + first, v + (r / group) * head_dim, n, token_stride,
                       head_dim);
    }
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < head_dim; ++d) o[r * head_dim + d] = acc[r * head_dim + d] / denominators[r];
}

/* Returns 0, or -1 when a thread could not allocate its scores, or -2 when a block id the
   context needs is outside [0, num_blocks). `out` is then unspecified. */
int chatcore_paged_decode_f32(const float *query, const float *key_cache, const float *value_cache,
                              const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                              float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t max_context,
                              float scale, int threads) {
    const int64_t group = num_heads / num_kv_heads;
    /* A task reads whole token rows (every kv head: one stream per block) when there are
       sequences enough to keep the threads busy, else one kv head's slice of them. */
    const int64_t span = num_seqs >= 4 * threads ? num_kv_heads : 1;
    const int64_t parts = num_kv_heads / span, tasks = num_seqs * parts, rows = span * group;
    const int64_t token_stride = num_kv_heads * head_dim, floats = span * head_dim;
    int status = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(rows * (max_context > 0 ? max_context : 1)));
        float *acc = malloc(sizeof(float) * (size_t)(rows * (head_dim + 1)));
        if (scores == NULL || acc == NULL) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            if (scores == NULL || acc == NULL) continue;
            const int64_t seq = task / parts, offset = (task % parts) * span * head_dim;
            const int64_t len = context_lens[seq], used = (len + block_size - 1) / block_size;
            const float *q = query + seq * num_heads * head_dim + offset * group;
            float *o = out + seq * num_heads * head_dim + offset * group;
            const int32_t *table = block_tables + seq * table_stride;
            memset(o, 0, sizeof(float) * (size_t)(rows * head_dim));
            if (len <= 0) continue;
            int bad = 0;
            for (int64_t b = 0; b < used && !bad; ++b) bad = table[b] < 0 || table[b] >= num_blocks;
            if (bad) {
#pragma omp atomic write
                status = -2;
                continue;
            }
            if (head_dim == 64)
                attend(q, key_cache, value_cache, table, len, rows, group, 64, block_size, num_blocks, token_stride,
                       offset, floats, scale, scores, acc, o);
            else if (head_dim == 128)
                attend(q, key_cache, value_cache, table, len, rows, group, 128, block_size, num_blocks, token_stride,
                       offset, floats, scale, scores, acc, o);
            else
                attend(q, key_cache, value_cache, table, len, rows, group, head_dim, block_size, num_blocks,
                       token_stride, offset, floats, scale, scores, acc, o);
        }
        free(scores);
        free(acc);
    }
    return status;
}
