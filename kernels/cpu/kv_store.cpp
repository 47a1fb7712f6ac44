// The KV store: the step's K/V copied into the pool slots of slot_mapping (tokens split across threads),
// or each (token, KV head) row quantized into a uint8 pool (kv_quant.h's quantize_row).

#include "kv_store.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "kv_quant.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace kvserve {
namespace {

// Tokens per parallel chunk of a K/V store: chunks of at least `values` values of each pool (kv_heads x d
// per token), so a small store stays on one thread and a prefill's tens of MiB spread over all.
inline int64_t store_grain(int64_t values, int64_t kv_heads, int64_t d) {
  return std::max<int64_t>(1, values / std::max<int64_t>(1, kv_heads * d));
}

// Store the step's K/V (key/value [tokens, kv_heads, head_dim]) into the pool slots of slot_mapping.
template <typename scalar_t>
void store_kv_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_pool, at::Tensor& v_pool,
                   const at::Tensor& slot_mapping) {
  const int64_t tokens = key.size(0), kv_heads = key.size(1), d = key.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const scalar_t* k = key.data_ptr<scalar_t>();
  const scalar_t* v = value.data_ptr<scalar_t>();
  scalar_t* kp = k_pool.data_ptr<scalar_t>();
  scalar_t* vp = v_pool.data_ptr<scalar_t>();
  const int64_t slot_stride = kv_heads * d;
  // tokens split across threads, pieces of at least 8192 values of each pool (a prefill's K/V are tens of
  // MiB: copied on one thread, they took some 5% of a 24 x 520-token prefill's attention on two)
  at::parallel_for(0, tokens, store_grain(8192, kv_heads, d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::memcpy(kp + slots[t] * slot_stride + h * d, k + t * key.stride(0) + h * key.stride(1),
                    d * sizeof(scalar_t));
        std::memcpy(vp + slots[t] * slot_stride + h * d, v + t * value.stride(0) + h * value.stride(1),
                    d * sizeof(scalar_t));
      }
    }
  });
}

// The same into a quantized pool (uint8 [blocks, block_size, kv_heads, head_dim + 2]): each (token, KV
// head) row quantized on its own (kv_quant.h), tokens split across threads (a row's bytes depend on
// that row alone, so the split changes nothing).
template <typename scalar_t>
void store_kv_quantized_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_pool, at::Tensor& v_pool,
                             const at::Tensor& slot_mapping, int fmt) {
  const int64_t tokens = key.size(0), kv_heads = key.size(1);
  const int d = static_cast<int>(key.size(2));
  const int64_t row = d + kKvScaleBytes, slot_stride = kv_heads * row;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const scalar_t* k = key.data_ptr<scalar_t>();
  const scalar_t* v = value.data_ptr<scalar_t>();
  uint8_t* kp = k_pool.data_ptr<uint8_t>();
  uint8_t* vp = v_pool.data_ptr<uint8_t>();
  at::parallel_for(0, tokens, store_grain(4096, kv_heads, d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < kv_heads; ++h) {
        quantize_row(k + t * key.stride(0) + h * key.stride(1), d, fmt, kp + slots[t] * slot_stride + h * row);
        quantize_row(v + t * value.stride(0) + h * value.stride(1), d, fmt, vp + slots[t] * slot_stride + h * row);
      }
  });
}

}  // namespace

void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_pool, at::Tensor& v_pool,
              const at::Tensor& slot_mapping, int kv_format) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key and value need a contiguous last axis");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "the KV pools must be contiguous [blocks, block_size, kv_heads, head_dim]");
  const int64_t width = key.size(2) + (kv_format ? kKvScaleBytes : 0);
  TORCH_CHECK(k_pool.size(2) == key.size(1) && k_pool.size(3) == width, "key does not match the pool");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "slot_mapping must be contiguous int64 with one slot per token");
  if (kv_format) {
    TORCH_CHECK(k_pool.scalar_type() == at::kByte && v_pool.scalar_type() == at::kByte &&
                    value.scalar_type() == key.scalar_type() &&
                    (key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16 ||
                     key.scalar_type() == at::kHalf),
                "a quantized KV pool is uint8 and its K/V float32, bfloat16 or float16 (one dtype)");
  } else {
    TORCH_CHECK(key.scalar_type() == k_pool.scalar_type() && value.scalar_type() == v_pool.scalar_type(),
                "K/V and the pools must share a dtype");
  }
  TORCH_CHECK(v_pool.sizes() == k_pool.sizes(), "the K and V pools must have one shape");
  // every slot checked before any is written: a bad slot fails the call and leaves the pool as it was
  const int64_t num_slots = k_pool.size(0) * k_pool.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < slot_mapping.numel(); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t],
                " is outside the pool's ", num_slots, " slots");
  if (kv_format) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "kvserve_store_kv", [&] {
      store_kv_quantized_impl<scalar_t>(key, value, k_pool, v_pool, slot_mapping, kv_format);
    });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "kvserve_store_kv", [&] {
    store_kv_impl<scalar_t>(key, value, k_pool, v_pool, slot_mapping);
  });
}

}  // namespace kvserve
