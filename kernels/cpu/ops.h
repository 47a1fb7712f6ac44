// Every op the library registers (registration.cpp defines their schemas and binds them), and the ones
// other translation units call directly (the decoder stack runs a whole Llama-style layer stack
// through them without going back through the dispatcher per op). Only registration.cpp includes
// torch/library.h, and no translation unit includes ATen/ATen.h: those headers are most of a build's
// time (about 12 s of compiler per file).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ATen_fwd.h>

#include <cstdint>
#include <vector>

namespace kvserve {

// elementwise.cpp
int64_t parallel_threads();
at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& input);
at::Tensor argmax_rows(const at::Tensor& x);
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cache,
                      int64_t head_dim);

// linear.cpp
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor linear_fixed_order(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
void pack_linear_weight(const at::Tensor& weight, at::Tensor& out);
void split_linear_weight(const at::Tensor& weight, at::Tensor& out);
int64_t linear_panel_width();

// gemm.cpp: GFLOP/s of multiply-adds on the kernels' vectors: the calling thread alone, or (parallel)
// every thread of torch's pool at once (their total)
double fma_peak(int64_t iterations, bool parallel);
// gemm_amx.cpp: whether the AMX product can run here
bool amx_usable();

// moe.cpp
at::Tensor moe_pack_weight(const at::Tensor& weight);
at::Tensor moe_split_weight(const at::Tensor& weight);
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
                       const at::Tensor& topk_ids, int64_t expert_start, int64_t intermediate);

// threads.cpp
std::vector<int64_t> bind_threads(std::vector<int64_t> cores);
std::vector<int64_t> thread_cores(int64_t n);

// paged_attention.cpp (kv_format: 0, the pools in the model's dtype; 1 .. 3, quantized: kv_quant.h)
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& k_pool,
                           at::Tensor& v_pool, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& kv_starts,
                           const at::Tensor& group_block_tables, const at::Tensor& group_lens,
                           const at::Tensor& group_member_start, const at::Tensor& group_members, double scale,
                           bool fixed_order = false, int64_t window = 0, double softcap = 0.0,
                           int64_t kv_format = 0);

// decoder_stack.cpp
at::Tensor decoder_stack(const at::Tensor& hidden_in, const at::Tensor& positions, at::TensorList weights,
                         at::TensorList k_pools, at::TensorList v_pools, const at::Tensor& cos_sin_cache,
                         const at::Tensor& final_norm, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& kv_starts,
                         const at::Tensor& group_block_tables, const at::Tensor& group_lens,
                         const at::Tensor& group_member_start, const at::Tensor& group_members, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool fixed_order,
                         at::TensorList qk_norms, int64_t kv_format = 0, at::IntArrayRef moe = {});

}  // namespace kvserve
