// Mixture-of-experts expert compute on CPU (float32 activations): the tokens routed to this rank's
// experts, grouped by expert, each expert's rows run as two products (gemm.h) with SiLU-and-multiply
// between, and each token's expert outputs combined with its routing weights.
//
//   pairs (token t, slot s) with expert e = topk_ids[t, s] - expert_start in [0, E): counted and
//   sorted per expert by a stable counting sort (rows in token order within an expert);
//   for each expert with rows: gather x's rows, h = x_e . w13[e]^T (gate | up, one product), a =
//   silu(gate) * up, y = a . w2[e]^T (one product), written to the pair's row of a scratch; the
//   products split across threads, or (at least as many experts with rows as threads, each with few
//   rows: decodes) whole experts shared out to the threads;
//   out[t] = sum over s = 0 .. k-1 (in that order, local experts only) of topk_weights[t, s] * y[t, s].
//
// Weights are laid out once, w13 and w2 each in one of two layouts (moe_experts takes either for
// either, and runs each expert's product on the layout's kernel):
// - packed (moe_pack_weight, the default; gemm_packed): [E, N, K] -> [E, Np / kPanel, K, kPanel]
//   float32, the output features padded with zeros to Np, a multiple of the panel width, so any width
//   runs the packed product (the padded columns are computed and never read);
// - split (moe_split_weight, cpu_matmul_precision "high" where the CPU grants AMX tiles; gemm_split):
//   [E, N, K] -> [E, Np / 32, 4, K / 2, 16] int32, each expert's matrix split into bfloat16 hi and lo
//   halves as split_weight splits a linear weight, padded to Np as above; K a multiple of 32 (a width
//   32 does not divide stays packed: workers/layers/moe.py). An expert's product of kAmxMinRows rows
//   and more runs as three bfloat16 products on AMX tiles, of fewer as float32 multiply-adds against
//   the rebuilt weight (gemm_amx.cpp).
//
// Batch-invariant with packed weights in every mode: each product's element is one chain over its
// inputs in order (gemm.h), whatever rows the expert has or the threads; the combine walks a token's
// slots in order. So a token's result depends on its own inputs and routing only (what deterministic
// mode needs, which keeps the packed layout). With split weights each of the two regimes is
// batch- and thread-invariant too, but which one an expert's product takes follows how many rows
// the batch routed to that expert (below kAmxMinRows or not), and the two do not agree bit for bit.

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

// [E, N, K] float32 -> [E, Np / 32, 4, K / 2, 16] int32: expert e's weight split for the bf16x3 product
// exactly as split_weight lays out a linear weight (gemm.h), output features N..Np-1 zero (Np a multiple
// of 32, the panel width where the AMX product runs). K a positive multiple of 32; only where
// amx_usable().
at::Tensor moe_split_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 3 && weight.scalar_type() == at::kFloat, "moe_split_weight takes a float32 [E, N, K] weight");
  const int64_t e = weight.size(0), n = weight.size(1), k = weight.size(2);
  TORCH_CHECK(k > 0 && k % 32 == 0, "moe_split_weight needs a positive multiple of 32 input features, not ", k);
  TORCH_CHECK(amx_usable() && kPanel == 32,
              "the bf16x3 product needs AMX tiles, which this CPU, OS or build does not grant");
  const at::Tensor w = weight.contiguous();
  const int64_t panels = round_up(n, 32) / 32, full = n / 32 * 32, words = 4 * (k / 2) * 16;  // words per panel
  at::Tensor out = at::empty({e, panels, 4, k / 2, 16}, w.options().dtype(at::kInt));
  const float* src = w.data_ptr<float>();
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  std::vector<float> tail(n > full ? 32 * k : 0, 0.0f);  // the last panel's columns, zeros past N
  for (int64_t x = 0; x < e; ++x) {
    const float* we = src + x * n * k;
    uint32_t* de = dst + x * panels * words;
    if (full > 0) split_weight(we, full, k, 1, k, de);
    if (n > full) {
      std::copy_n(we + full * k, (n - full) * k, tail.begin());
      split_weight(tail.data(), 32, k, 1, k, de + full / 32 * words);
    }
  }
  return out;
}

namespace {

// One expert weight of moe_experts: float32 panels packed by moe_pack_weight (gemm_packed) or int32
// words split by moe_split_weight (gemm_split); its n output features (padded) and k inputs.
struct ExpertWeight {
  const float* packed = nullptr;
  const uint32_t* split = nullptr;
  int64_t experts = 0, n = 0, k = 0, per_expert = 0;  // per_expert: floats or words

  // c [m, n] (rows ldc apart) = a [m, k] (rows lda apart) . expert e's weight
  void product(int64_t e, const float* a, int64_t lda, int64_t m, float* c, int64_t ldc, bool parallel) const {
    if (split != nullptr)
      gemm_split(a, lda, m, k, split + e * per_expert, n, nullptr, c, ldc, parallel);
    else
      gemm_packed(a, lda, m, k, packed + e * per_expert, n, nullptr, c, ldc, parallel);
  }
};

ExpertWeight expert_weight(const at::Tensor& w) {
  ExpertWeight out;
  if (w.dim() == 4 && w.size(3) == kPanel && w.is_contiguous() && w.scalar_type() == at::kFloat) {
    out.packed = w.data_ptr<float>();
    out.n = w.size(1) * kPanel;
    out.k = w.size(2);
  } else if (w.dim() == 5 && w.size(2) == 4 && w.size(4) == 16 && w.size(3) > 0 && w.size(3) % 16 == 0 &&
             w.is_contiguous() && w.scalar_type() == at::kInt) {
    out.split = reinterpret_cast<const uint32_t*>(w.data_ptr<int32_t>());
    out.n = w.size(1) * 32;
    out.k = w.size(3) * 2;
  } else {
    TORCH_CHECK(false, "moe_experts takes weights packed by moe_pack_weight or split by moe_split_weight");
  }
  out.experts = w.size(0);
  out.per_expert = out.n * out.k;
  return out;
}

}  // namespace

// x [T, H]; w13 from [E, 2I, H] (gate rows then up rows) and w2 from [E, H, I], each packed
// (moe_pack_weight) or split (moe_split_weight), independently;
// topk_weights float32 [T, k]; topk_ids int64 [T, k] (global expert ids; those outside [expert_start,
// expert_start + E) are another rank's and add nothing here) -> [T, H].
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                       const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t expert_start,
                       int64_t intermediate) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "moe_experts takes float32 x [tokens, hidden]");
  const ExpertWeight up = expert_weight(w13), down = expert_weight(w2);
  const int64_t t = x.size(0), h = x.size(1), num_experts = up.experts, inter = intermediate;
  const int64_t n13 = up.n, n2 = down.n;
  TORCH_CHECK(down.experts == num_experts && up.k == h && down.k == inter && n13 >= 2 * inter && n2 >= h,
              "moe_experts: w13 ", w13.sizes(), " and w2 ", w2.sizes(), " do not fit hidden ", h, " and intermediate ",
              inter);
  TORCH_CHECK((up.split == nullptr && down.split == nullptr) || amx_usable(),
              "moe_experts: a weight split for the bf16x3 product needs a CPU and OS that grant AMX tiles");
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
  // one expert's rows [r0, r0 + m): gather, gate|up, SiLU-and-multiply, down into ys (scratch: its
  // rows, gate|up and activation, each `most` rows); `parallel`: the products split across threads
  const auto run_expert = [&](int64_t e, float* rp, float* gp, float* ap, bool parallel) {
    const int64_t r0 = offsets[e], m = offsets[e + 1] - r0;
    at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(h, 1)), [&](int64_t b, int64_t end) {
      for (int64_t r = b; r < end; ++r) std::copy_n(xp + order[r0 + r] / k * h, h, rp + r * h);
    });
    up.product(e, rp, h, m, gp, n13, parallel);
    silu_mul_rows(gp, n13, m, inter, ap);
    down.product(e, ap, inter, m, yp + r0 * n2, n2, parallel);
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
