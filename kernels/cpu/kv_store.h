// The KV store (kv_store.cpp): the step's K/V written into the pool slots of slot_mapping, quantized
// for a quantized pool (kv_quant.h); called by paged_attention.cpp before it attends.
#pragma once

#include <ATen/core/Tensor.h>

namespace kvserve {

// key/value [tokens, kv_heads, head_dim] into k_pool/v_pool [blocks, block_size, kv_heads, width] at the
// slots of slot_mapping (int64, one per token); kv_format 0: the pools in K/V's dtype, 1 .. 3 uint8
// (kv_quant.h). Every argument and slot is checked before any is written: a call that fails leaves the
// pool as it was.
void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_pool, at::Tensor& v_pool,
              const at::Tensor& slot_mapping, int kv_format);

}  // namespace kvserve
