// The checks of paged attention's arguments (attention_checks.cpp): every tensor and index of the step's
// metadata, checked by paged_attention.cpp before the step's K/V are stored or any thread reads the pool.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvserve {

// Everything the attention pass reads through: a call that fails leaves the pool as it was.
void check_attention(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& kv_starts, const at::Tensor& group_block_tables, const at::Tensor& group_lens,
                     const at::Tensor& group_member_start, const at::Tensor& group_members, int64_t kv_format);

}  // namespace kvserve
