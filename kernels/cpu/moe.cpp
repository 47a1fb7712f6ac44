// Mixture-of-experts expert compute on CPU (float32): the tokens routed to this rank's experts, grouped
// by expert, each expert's rows run as two packed products (gemm.h) with SiLU-and-multiply between, and
// each token's expert outputs combined with its routing weights.
//
//   pairs (token t, slot s) with expert e = topk_ids[t, s] - expert_start in [0, E): counted and
//   sorted per expert by a stable counting sort (rows in token order within an expert);
//   for each expert with rows: gather x's rows, h = x_e . w13[e]^T (gate | up, one product), a =
//   silu(gate) * up, y = a . w2[e]^T (one product), written to the pair's row of a scratch; the
//   products split across threads, or (at least as many experts with rows as threads, each with few
//   rows: decodes) whole experts shared out to the threads;
//   out[t] = sum over s = 0 .. k-1 (in that order, local experts only) of topk_weights[t, s] * y[t, s].
//
// Batch-invariant in every mode: each product's element is one chain over its inputs in order
// (gemm.h), whatever rows the expert has or the threads; the combine walks a token's slots in order.
// So a token's result depends on its own inputs and routing only (what deterministic mode needs).
//
// Weights are packed once (moe_pack_weight): [E, N, K] -> [E, Np / kPanel, K, kPanel], the output
// features padded with zeros to Np, a multiple of the panel width, so any width runs the packed product
// (the padded columns are computed and never read).

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemm.h"
#include "vec.h"

namespace kvserve {
namespace {

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// out [m, d] = silu(c[:, :d]) * c[:, d:2d], c's rows ldc apart
void silu_mul_rows(const float* c, int64_t ldc, int64_t m, int64_t d, float* out) {
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* gate = c + r * ldc;
      const float* up = gate + d;
      float* o = out + r * d;
      int64_t i = 0;
      for (; i + W <= d; i += W) vstore(o + i, vsilu(vload(gate + i)) * vload(up + i));
      for (; i < d; ++i) o[i] = ssilu(gate[i]) * up[i];
    }
  });
}

}  // namespace

// [E, N, K] float32 -> [E, ceil(N / kPanel), K, kPanel]: expert e's weight in column panels (gemm.h),
// output features N..Np-1 zero.
at::Tensor moe_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 3 && weight.scalar_type() == at::kFloat, "moe_pack_weight takes a float32 [E, N, K] weight");
  const at::Tensor w = weight.contiguous();
  const int64_t e = w.size(0), n = w.size(1), k = w.size(2), panels = round_up(n, kPanel) / kPanel;
  at::Tensor out = at::empty({e, panels, k, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, e * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t x = item / panels, p = item % panels;
      const float* we = src + x * n * k;
      float* d = dst + item * k * kPanel;
      for (int64_t i = 0; i < k; ++i)
        for (int j = 0; j < kPanel; ++j) {
          const int64_t col = p * kPanel + j;
          d[i * kPanel + j] = col < n ? we[col * k + i] : 0.0f;
        }
    }
  });
  return out;
}

// x [T, H]; w13 packed from [E, 2I, H] (gate rows then up rows); w2 packed from [E, H, I];
// topk_weights float32 [T, k]; topk_ids int64 [T, k] (global expert ids; those outside [expert_start,
// expert_start + E) are another rank's and add nothing here) -> [T, H].
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                       const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t expert_start,
                       int64_t intermediate) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "moe_experts takes float32 x [tokens, hidden]");
  TORCH_CHECK(w13.dim() == 4 && w2.dim() == 4 && w13.size(3) == kPanel && w2.size(3) == kPanel &&
                  w13.is_contiguous() && w2.is_contiguous() && w13.scalar_type() == at::kFloat &&
                  w2.scalar_type() == at::kFloat,
              "moe_experts takes weights packed by moe_pack_weight");
  const int64_t t = x.size(0), h = x.size(1), num_experts = w13.size(0), inter = intermediate;
  const int64_t n13 = w13.size(1) * kPanel, n2 = w2.size(1) * kPanel;
  TORCH_CHECK(w2.size(0) == num_experts && w13.size(2) == h && w2.size(2) == inter && n13 >= 2 * inter && n2 >= h,
              "moe_experts: w13 ", w13.sizes(), " and w2 ", w2.sizes(), " do not fit hidden ", h, " and intermediate ",
              inter);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == t && topk_ids.scalar_type() == at::kLong &&
                  topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat,
              "moe_experts takes int64 topk_ids and float32 topk_weights, both [tokens, top_k]");
  const int64_t k = topk_ids.size(1);
  const at::Tensor xc = x.contiguous(), ids_c = topk_ids.contiguous(), wts_c = topk_weights.contiguous();
  const float* xp = xc.data_ptr<float>();
  const int64_t* ids = ids_c.data_ptr<int64_t>();
  const float* wts = wts_c.data_ptr<float>();

  // stable counting sort of the local (token, slot) pairs by expert
  std::vector<int64_t> offsets(num_experts + 1, 0);
  for (int64_t p = 0; p < t * k; ++p) {
    const int64_t e = ids[p] - expert_start;
    if (e >= 0 && e < num_experts) ++offsets[e + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  const int64_t total = offsets[num_experts];
  std::vector<int64_t> order(total), row_of(t * k, -1), fill(offsets.begin(), offsets.end() - 1);
  for (int64_t p = 0; p < t * k; ++p) {
    const int64_t e = ids[p] - expert_start;
    if (e >= 0 && e < num_experts) {
      row_of[p] = fill[e];
      order[fill[e]++] = p;
    }
  }
  int64_t most = 0;
  for (int64_t e = 0; e < num_experts; ++e) most = std::max(most, offsets[e + 1] - offsets[e]);

  at::Tensor out = at::empty({t, h}, x.options());
  at::Tensor ys = at::empty({std::max<int64_t>(total, 1), n2}, x.options());  // a pair's expert output, by row
  float* yp = ys.data_ptr<float>();
  const float* w13p = w13.data_ptr<float>();
  const float* w2p = w2.data_ptr<float>();
  // one expert's rows [r0, r0 + m): gather, gate|up, SiLU-and-multiply, down into ys (scratch: its
  // rows, gate|up and activation, each `most` rows); `parallel`: the products split across threads
  const auto run_expert = [&](int64_t e, float* rp, float* gp, float* ap, bool parallel) {
    const int64_t r0 = offsets[e], m = offsets[e + 1] - r0;
    at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(h, 1)), [&](int64_t b, int64_t end) {
      for (int64_t r = b; r < end; ++r) std::copy_n(xp + order[r0 + r] / k * h, h, rp + r * h);
    });
    gemm_packed(rp, h, m, h, w13p + e * w13.size(1) * h * kPanel, n13, nullptr, gp, n13, parallel);
    silu_mul_rows(gp, n13, m, inter, ap);
    gemm_packed(ap, inter, m, inter, w2p + e * w2.size(1) * inter * kPanel, n2, nullptr, yp + r0 * n2, n2, parallel);
  };
  std::vector<int64_t> active;
  for (int64_t e = 0; e < num_experts; ++e)
    if (offsets[e + 1] > offsets[e]) active.push_back(e);
  const int64_t scratch_floats = std::max<int64_t>(most, 1) * (h + n13 + std::max<int64_t>(inter, 1));
  const int64_t threads = at::get_num_threads();
  if (static_cast<int64_t>(active.size()) >= threads && most <= 4 * kTileRows) {
    // few rows per expert (decodes): whole experts per thread, each product on its thread alone (the same
    // chains as split ones: the bits do not change)
    at::Tensor scratch = at::empty({threads, scratch_floats}, x.options());
    at::parallel_for(0, static_cast<int64_t>(active.size()), 1, [&](int64_t b, int64_t end) {
      float* mine = scratch.data_ptr<float>() + std::min<int64_t>(at::get_thread_num(), threads - 1) * scratch_floats;
      const int64_t rows = std::max<int64_t>(most, 1);
      for (int64_t i = b; i < end; ++i) run_expert(active[i], mine, mine + rows * h, mine + rows * (h + n13), false);
    });
  } else {
    at::Tensor scratch = at::empty({scratch_floats}, x.options());
    float* rp = scratch.data_ptr<float>();
    const int64_t rows = std::max<int64_t>(most, 1);
    for (const int64_t e : active) run_expert(e, rp, rp + rows * h, rp + rows * (h + n13), true);
  }
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, std::max<int64_t>(1, 16384 / std::max<int64_t>(h * k, 1)), [&](int64_t b, int64_t end) {
    for (int64_t tok = b; tok < end; ++tok) {
      float* o = op + tok * h;
      std::fill_n(o, h, 0.0f);
      for (int64_t s = 0; s < k; ++s) {
        const int64_t row = row_of[tok * k + s];
        if (row < 0) continue;
        const float w = wts[tok * k + s];
        const float* y = yp + row * n2;
        int64_t i = 0;
        for (; i + W <= h; i += W) vstore(o + i, vload(o + i) + vload(y + i) * w);
        for (; i < h; ++i) o[i] = o[i] + y[i] * w;
      }
    }
  });
  return out;
}

}  // namespace kvserve
