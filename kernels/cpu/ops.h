// The compiled ops that other translation units call directly (the decoder stack runs a whole
// Llama-style layer stack through them without going back through the dispatcher per op).
#pragma once

#include <ATen/ATen.h>

namespace kvserve {

// elementwise.cpp
at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& input);
at::Tensor argmax_rows(const at::Tensor& x);
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cache,
                      int64_t head_dim);

// linear.cpp
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor linear_fixed_order(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// paged_attention.cpp
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& k_pool,
                           at::Tensor& v_pool, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& kv_starts,
                           const at::Tensor& group_block_tables, const at::Tensor& group_lens,
                           const at::Tensor& group_member_start, const at::Tensor& group_members, double scale,
                           bool fixed_order = false, int64_t window = 0, double softcap = 0.0);

}  // namespace kvserve
