/* The KV store on the CPU: each new token's key and value rows copied into their cache slots
   (kernels/cpu_store.py's `store_kv`, which checks every argument first, for caches of the rows' own dtype). */

#include <stdint.h>
#include <string.h>

/* Token t's rows, `row_bytes` each, start at key + t * key_stride and value + t * value_stride
   (bytes); slot s of a cache ([num_slots][row_bytes], contiguous) starts at s * row_bytes. A
   negative slot skips its token. Returns 0, or -1 without writing anything when a slot is
   num_slots or more. */
int chatcore_store_kv(const char *key, const char *value, int64_t key_stride, int64_t value_stride,
                      char *key_cache, char *value_cache, const int64_t *slots, int64_t tokens, int64_t row_bytes,
                      int64_t num_slots) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(key_cache + slot * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(value_cache + slot * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}
