// Writes a layer's new keys and values into its paged cache in one call (ops.cpu's `cache_write`).
#include "common.h"
#include "ops.h"

namespace phalanx {

// Writes a layer's new keys and values into its paged cache: for token t < N (= slots.numel(); rows
// of k / v past N are lockstep padding and write nothing), cache[0, h, slot_t] = k[t, h] and
// cache[1, h, slot_t] = v[t, h] (slot = block * BS + offset). One call instead of two index_copy_.
void cache_write(at::Tensor kv_cache, at::Tensor k, at::Tensor v, at::Tensor slots) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "cache_write: kv_cache must be a contiguous [2, KVH, NB, BS, D] tensor");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == kv_cache.size(1) && k.size(2) == kv_cache.size(4),
              "cache_write: k and v must be [T, KVH, D] matching the cache");
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type(),
              "cache_write: k, v and kv_cache dtypes differ");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "cache_write: the last dimension of k and v must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) <= k.size(0),
              "cache_write: slots must be int64 [N] with N <= T");
  slots = slots.contiguous();
  const int64_t N = slots.size(0), KVH = kv_cache.size(1), D = kv_cache.size(4);
  const int64_t cap = kv_cache.size(2) * kv_cache.size(3);  // slots per head
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < cap, "cache_write: slot ", sp[i], " outside the cache's ", cap, " slots");
  const int64_t bytes = D * kv_cache.element_size();
  char* base = static_cast<char*>(kv_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t es = kv_cache.element_size();
  const int64_t plane = KVH * cap * bytes;  // keys, then values
  at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < KVH; ++h) {
        char* dst = base + (h * cap + sp[t]) * bytes;
        std::memcpy(dst, kp + (t * k.stride(0) + h * k.stride(1)) * es, bytes);
        std::memcpy(dst + plane, vp + (t * v.stride(0) + h * v.stride(1)) * es, bytes);
      }
  });
}

}  // namespace phalanx
