// The library's ops: their schemas and their CPU kernels, all registered here (the only translation
// unit that includes torch/library.h: see ops.h).

#include <torch/library.h>

#include "ops.h"

namespace kvserve {

TORCH_LIBRARY(kvserve_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) k_pool, Tensor(b!) v_pool, "
      "Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, Tensor kv_starts, "
      "Tensor group_block_tables, Tensor group_lens, Tensor group_member_start, Tensor group_members, "
      "float scale, bool fixed_order=False, int window=0, float softcap=0.0, int kv_format=0) -> Tensor");
  m.def(
      "decoder_stack(Tensor(a!) hidden, Tensor positions, Tensor[] weights, Tensor(b!)[] k_pools, "
      "Tensor(c!)[] v_pools, Tensor cos_sin_cache, Tensor final_norm, Tensor slot_mapping, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, Tensor kv_starts, Tensor group_block_tables, Tensor group_lens, "
      "Tensor group_member_start, Tensor group_members, int num_heads, int num_kv_heads, int head_dim, float eps, "
      "float scale, bool fixed_order, Tensor[] qk_norms, int kv_format=0, int[] moe=[]) -> Tensor");
  m.def("parallel_threads() -> int", &parallel_threads);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cache, int head_dim) -> ()");
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_fixed_order(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("pack_linear_weight(Tensor weight, Tensor(a!) out) -> ()");
  m.def("split_linear_weight(Tensor weight, Tensor(a!) out) -> ()");
  m.def("linear_panel_width() -> int", &linear_panel_width);
  m.def("fma_peak(int iterations, bool parallel=False) -> float", &fma_peak);
  m.def("amx_usable() -> bool", &amx_usable);
  m.def("moe_pack_weight(Tensor weight) -> Tensor");
  m.def("moe_split_weight(Tensor weight) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, int expert_start, "
        "int intermediate) -> Tensor");
  m.def("bind_threads(int[] cores) -> int[]", &bind_threads);
  m.def("thread_cores(int n) -> int[]", &thread_cores);
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("decoder_stack", &decoder_stack);
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("linear", &linear);
  m.impl("linear_fixed_order", &linear_fixed_order);
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("split_linear_weight", &split_linear_weight);
  m.impl("moe_pack_weight", &moe_pack_weight);
  m.impl("moe_split_weight", &moe_split_weight);
  m.impl("moe_experts", &moe_experts);
}

}  // namespace kvserve
