// A Llama-style decoder stack in one call (one tensor-parallel rank of size 1): per layer
//   residual += h; h = rms_norm(residual)            (the first layer: residual = h, h = rms_norm(h))
//   q, k, v = split(linear(h, Wqkv, bqkv)); [q, k = rms_norm per head (Qwen3's q_norm, k_norm)]; rotary(q, k)
//   h = linear(paged_attention(q, k, v), Wo, bo)      (stores the step's K/V first)
//   residual += h; h = rms_norm(residual)
//   h = linear(silu_and_mul(linear(h, Wgu, bgu)), Wd, bd)
// and the final residual add + norm. A mixture-of-experts layer (moe: top_k > 0 for it; Mixtral, Qwen3-MoE)
// runs its MLP as the Python FusedMoE does:
//   weights, ids = top_k(softmax(linear(h, Wrouter) in float32)) [renormalised over the chosen];
//   h = moe_experts(h, W13, W2, weights, ids, 0, intermediate)
// The same ops in the same order as the Python layers run them
// (workers/models/llama.py with the compiled ops bound), so the result is the same to the bit; what
// goes is the Python and dispatcher work between them: about 100 us per layer per step. Each op
// keeps its profiler scope under its own name, so a profile splits the stack as it splits the layers.
// fixed_order (the engine's deterministic mode): the fixed-order linear and attention orders, as the
// layers bound in that mode run them. kv_format: the pools' format, passed to every layer's attention
// (0: the model's dtype; 1 .. 3: quantized, kv_quant.h).

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/record_function.h>

#include "ops.h"

#include <vector>

namespace kvserve {
namespace {

constexpr int64_t kPerLayer = 10;  // in_norm, Wqkv, bqkv, Wo, bo, post_norm, Wgu, bgu, Wd, bd
// (a mixture-of-experts layer: in_norm, Wqkv, bqkv, Wo, bo, post_norm, Wrouter, -, W13, W2)
constexpr int64_t kMoePerLayer = 3;  // top_k (0: a dense MLP), renormalize, intermediate

// A profiler scope named as the registered op (free when no profiler runs).
#define KVSERVE_SCOPE(op) RECORD_FUNCTION("kvserve_cpu::" op, std::vector<c10::IValue>())

at::Tensor stack_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, bool fixed_order);

c10::optional<at::Tensor> bias_of(const at::Tensor& b) {
  if (!b.defined() || b.numel() == 0) return c10::nullopt;
  return b;
}

}  // namespace

at::Tensor decoder_stack(const at::Tensor& hidden_in, const at::Tensor& positions, at::TensorList weights,
                         at::TensorList k_pools, at::TensorList v_pools, const at::Tensor& cos_sin_cache,
                         const at::Tensor& final_norm, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& kv_starts,
                         const at::Tensor& group_block_tables, const at::Tensor& group_lens,
                         const at::Tensor& group_member_start, const at::Tensor& group_members, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool fixed_order,
                         at::TensorList qk_norms, int64_t kv_format, at::IntArrayRef moe) {
  const int64_t layers = static_cast<int64_t>(k_pools.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer,
              "decoder_stack takes ", kPerLayer, " weight tensors per layer");
  TORCH_CHECK(static_cast<int64_t>(v_pools.size()) == layers, "one K and one V pool per layer");
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers,
              "qk_norms: none, or a q and a k norm weight per layer");
  TORCH_CHECK(moe.empty() || static_cast<int64_t>(moe.size()) == layers * kMoePerLayer,
              "moe: none, or (top_k, renormalize, intermediate) per layer");
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.is_contiguous(), "hidden must be a contiguous [tokens, hidden] tensor");
  const int64_t t = hidden_in.size(0);
  const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  at::Tensor residual = hidden_in;  // the caller's embedding output, updated in place
  at::Tensor h;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kPerLayer;
    if (i == 0) {
      KVSERVE_SCOPE("rms_norm");
      h = kvserve::rms_norm(residual, w[0], eps);
    } else {
      KVSERVE_SCOPE("fused_add_rms_norm");
      kvserve::fused_add_rms_norm(h, residual, w[0], eps);
    }
    const at::Tensor qkv = stack_linear(h, w[1], w[2], fixed_order);
    TORCH_CHECK(qkv.size(1) == q_width + 2 * kv_width, "the qkv projection does not match the head counts");
    at::Tensor q = qkv.narrow(1, 0, q_width);
    at::Tensor k = qkv.narrow(1, q_width, kv_width);
    const at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width);
    if (!qk_norms.empty()) {  // each head normalised over head_dim, into new [t, width] tensors
      KVSERVE_SCOPE("rms_norm");
      q = kvserve::rms_norm(q.view({t, num_heads, head_dim}), qk_norms[2 * i], eps).view({t, q_width});
      k = kvserve::rms_norm(k.view({t, num_kv_heads, head_dim}), qk_norms[2 * i + 1], eps).view({t, kv_width});
    }
    {
      KVSERVE_SCOPE("rotary_embedding");
      kvserve::rotary_embedding(positions, q, k, cos_sin_cache, head_dim);
    }
    at::Tensor attn;
    {
      KVSERVE_SCOPE("paged_attention");
      at::Tensor k_pool = k_pools[i], v_pool = v_pools[i];
      attn = kvserve::paged_attention(
          q.view({t, num_heads, head_dim}), k.view({t, num_kv_heads, head_dim}), v.view({t, num_kv_heads, head_dim}),
          k_pool, v_pool, slot_mapping, block_tables, query_start_loc, seq_lens, kv_starts, group_block_tables,
          group_lens, group_member_start, group_members, scale, fixed_order, 0, 0.0, kv_format);
    }
    h = stack_linear(attn.view({t, q_width}), w[3], w[4], fixed_order);
    {
      KVSERVE_SCOPE("fused_add_rms_norm");
      kvserve::fused_add_rms_norm(h, residual, w[5], eps);
    }
    const int64_t top_k = moe.empty() ? 0 : moe[i * kMoePerLayer];
    if (top_k > 0) {  // kernels/torch_moe.py's select_experts, then the experts (workers/layers/moe.py)
      const at::Tensor probs = at::softmax(stack_linear(h, w[6], w[7], fixed_order).to(at::kFloat), -1);
      auto [topk_weights, topk_ids] = at::topk(probs, top_k, -1);
      if (moe[i * kMoePerLayer + 1]) topk_weights = topk_weights.div(topk_weights.sum(-1, true));
      KVSERVE_SCOPE("moe_experts");
      h = kvserve::moe_experts(h, w[8], w[9], topk_weights, topk_ids, 0, moe[i * kMoePerLayer + 2]);
      continue;
    }
    at::Tensor act = stack_linear(h, w[6], w[7], fixed_order);
    {
      KVSERVE_SCOPE("silu_and_mul");
      act = kvserve::silu_and_mul(act);
    }
    h = stack_linear(act, w[8], w[9], fixed_order);
  }
  KVSERVE_SCOPE("fused_add_rms_norm");
  kvserve::fused_add_rms_norm(h, residual, final_norm, eps);
  return h;
}

namespace {

at::Tensor stack_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, bool fixed_order) {
  KVSERVE_SCOPE("linear");
  return fixed_order ? kvserve::linear_fixed_order(x, weight, bias_of(bias)) : kvserve::linear(x, weight, bias_of(bias));
}

}  // namespace

}  // namespace kvserve
