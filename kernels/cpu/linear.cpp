// Linear layers on CPU for decode-sized batches: out = x @ W^T (+ bias), with W stored as the
// transpose of a contiguous [in, out] matrix (see workers/layers/kernels.py). The output columns are
// split into one contiguous block per thread and each thread runs a single-threaded BLAS sgemm on
// its block: for few rows this keeps both cores busy where BLAS's own threading does not (measured
// 1.5x for one thread against 2 at 64 rows). BLAS is the sgemm_ that torch's CPU library carries
// (MKL); where it has none, or for large batches, the op answers false and the caller uses F.linear.
// A weight packed into column panels (pack_linear_weight, a [N / panel, K, panel] tensor) runs the
// packed product of gemm.cpp instead, at any number of rows.

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>

#include "gemm.h"
#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc) __attribute__((weak));
}

namespace kvserve {
namespace {

constexpr int64_t kColumnAlign = 64;    // columns per thread block are a multiple of this
constexpr int64_t kSplitMaxRows = 512;  // above this many rows BLAS's own threading is as good

bool blas_available() { return sgemm_ != nullptr; }

// Columns [n0, n1) of thread t of `threads` (threads <= n / kColumnAlign): the whole
// kColumnAlign-column blocks shared out as evenly as they go, and the last thread also takes the
// n mod kColumnAlign columns past the last whole block, so every column has exactly one owner.
std::pair<int64_t, int64_t> split_columns(int64_t n, int64_t threads, int64_t t) {
  const int64_t blocks = n / kColumnAlign;
  const int64_t n0 = blocks * t / threads * kColumnAlign;
  const int64_t n1 = t + 1 == threads ? n : blocks * (t + 1) / threads * kColumnAlign;
  return {n0, n1};
}

// C[:, n0:n1] = A @ B[:, n0:n1] (+ C when beta = 1), row-major, as a column-major sgemm on transposes.
void gemm_columns(const float* a, int64_t m, int64_t k, const float* b, int64_t n, float* c, int64_t n0, int64_t n1,
                  float beta) {
  const char no = 'N';
  const int mi = static_cast<int>(m), ni = static_cast<int>(n1 - n0), ki = static_cast<int>(k);
  const int lda = static_cast<int>(k), ldb = static_cast<int>(n), ldc = static_cast<int>(n);
  const float alpha = 1.0f;
  sgemm_(&no, &no, &ni, &mi, &ki, &alpha, b + n0, &ldb, a, &lda, &beta, c + n0, &ldc);
}

// out [M, N] = x [M, K] @ weight^T with weight [N, K] laid out as the transpose of contiguous [K, N].
bool linear_split(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  if (!blas_available() || x.scalar_type() != at::kFloat || weight.scalar_type() != at::kFloat) return false;
  if (x.dim() != 2 || !x.is_contiguous() || weight.dim() != 2) return false;
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  if (weight.size(1) != k || weight.stride(0) != 1 || weight.stride(1) != n) return false;
  TORCH_CHECK(out.is_contiguous() && out.size(0) == m && out.size(1) == n && out.scalar_type() == at::kFloat,
              "out must be a contiguous float32 [rows, out_features] tensor");
  const float* a = x.data_ptr<float>();
  const float* b = weight.data_ptr<float>();
  float* c = out.data_ptr<float>();
  float beta = 0.0f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n && bias->is_contiguous() && bias->scalar_type() == at::kFloat, "bad bias");
    const float* bp = bias->data_ptr<float>();
    for (int64_t r = 0; r < m; ++r) std::copy(bp, bp + n, c + r * n);
    beta = 1.0f;
  }
  const int64_t aligned = n / kColumnAlign;  // whole kColumnAlign-column blocks
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), aligned));
  if (threads == 1) {
    gemm_columns(a, m, k, b, n, c, 0, n, beta);
    return true;
  }
  // inside the parallel region BLAS runs on the calling thread only (MKL does not nest its threads)
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto [n0, n1] = split_columns(n, threads, t);
      if (n0 < n1) gemm_columns(a, m, k, b, n, c, n0, n1, beta);
    }
  });
  return true;
}

// Fixed-order product (the engine's deterministic mode). Every output element is one multiply-add
// chain over the input features in order, k = 0 .. K-1, then + bias: its bits depend on its own row
// and column only, never on how many rows the batch has, where the row sits, or how many threads
// run. (BLAS picks its kernel and its K blocking from the shape: with MKL a row's result changes
// between 1 and 2 rows, and again past 16 or 192 rows for some shapes.) A register tile is 4 rows
// x 4W columns; a tail of fewer rows repeats the last row into the tile and keeps only its own
// results, so every row runs the very same code. Columns are split into 4W-wide panels across
// threads; a panel's columns past a multiple of W take a scalar fused multiply-add chain. Each
// panel is run 128 inputs at a time (its weights then stay in L1 while every row tile passes).
constexpr int kFixedRows = 4;
constexpr int64_t kFixedPanel = 4 * W;
constexpr int64_t kFixedDepth = 128;  // inputs per pass over a panel: 128 x 4W weights (at most 32 KiB) stay in L1

// acc (rows x NC vectors of out) continues its chains over the inputs [k0, k1): the accumulators go
// through memory between passes, which leaves each chain's order as it is.
template <int NC>
void fixed_tile(const float* const* xr, const float* w, int64_t ldw, int64_t k0, int64_t k1, const float* bias,
                float* const* outr, int rows) {
  vf a[kFixedRows][NC];
  for (int b = 0; b < kFixedRows; ++b)
    for (int c = 0; c < NC; ++c) a[b][c] = k0 == 0 ? vf{} : vload(outr[b] + c * W);
  for (int64_t i = k0; i < k1; ++i) {
    const float* wi = w + i * ldw;
    vf wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = vload(wi + c * W);
    for (int b = 0; b < kFixedRows; ++b) {
      const float xv = xr[b][i];
      for (int c = 0; c < NC; ++c) a[b][c] += xv * wv[c];
    }
  }
  for (int b = 0; b < rows; ++b)
    for (int c = 0; c < NC; ++c) vstore(outr[b] + c * W, bias ? a[b][c] + vload(bias + c * W) : a[b][c]);
}

// out [M, N] = x [M, K] @ wt [K, N] (+ bias), every element in the fixed order above.
void linear_fixed_impl(const float* x, int64_t m, int64_t k, const float* wt, int64_t ldw, int64_t n, const float* bias,
                       float* out) {
  const int64_t panels = (n + kFixedPanel - 1) / kFixedPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kFixedPanel, width = std::min(kFixedPanel, n - n0);
      const int nc = static_cast<int>(width / W);
      const float* wp = wt + n0;
      for (int64_t k0 = 0; k0 < k || k0 == 0; k0 += kFixedDepth) {
        const int64_t k1 = std::min(k, k0 + kFixedDepth);
        const float* bp = bias && k1 == k ? bias + n0 : nullptr;  // the bias once the chains are complete
        for (int64_t r0 = 0; r0 < m; r0 += kFixedRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kFixedRows, m - r0));
          const float* xr[kFixedRows];
          float* outr[kFixedRows];
          for (int b = 0; b < kFixedRows; ++b) {
            const int64_t r = r0 + std::min(b, rows - 1);
            xr[b] = x + r * k;
            outr[b] = out + r * n + n0;
          }
          switch (nc) {
            case 4: fixed_tile<4>(xr, wp, ldw, k0, k1, bp, outr, rows); break;
            case 3: fixed_tile<3>(xr, wp, ldw, k0, k1, bp, outr, rows); break;
            case 2: fixed_tile<2>(xr, wp, ldw, k0, k1, bp, outr, rows); break;
            case 1: fixed_tile<1>(xr, wp, ldw, k0, k1, bp, outr, rows); break;
            default: break;
          }
        }
        if (k1 >= k) break;
      }
      for (int64_t col = n0 + nc * W; col < n0 + width; ++col)  // the panel's last columns, one chain each
        for (int64_t r = 0; r < m; ++r) {
          const float* xrow = x + r * k;
          float acc = 0.0f;
          for (int64_t i = 0; i < k; ++i) acc = std::fma(xrow[i], wt[i * ldw + col], acc);
          out[r * n + col] = bias ? acc + bias[col] : acc;
        }
    }
  });
}

}  // namespace

namespace {

// The bias' data (float32, n elements, contiguous), or null where there is none.
const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->numel() == n && bias->is_contiguous() && bias->scalar_type() == at::kFloat, "bad bias");
  return bias->data_ptr<float>();
}

// out [rows, n] viewed as x's leading dimensions by n.
at::Tensor shaped_like(const at::Tensor& out, const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return out.view(shape);
}

}  // namespace

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
at::Tensor linear_bf16x3(const at::Tensor& x, const at::Tensor& split, const c10::optional<at::Tensor>& bias);

// F.linear with every output element reduced in one fixed order (see linear_fixed_impl): float32. A
// weight packed in column panels takes the packed product, whose elements are single in-order
// chains too (gemm.h): batch-invariant as well, and 1.5-1.9x faster.
at::Tensor linear_fixed_order(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  if (weight.dim() == 3) return linear_packed(x, weight, bias);
  TORCH_CHECK(weight.dim() != 4, "a weight split for the bf16x3 product has no fixed-order linear (deterministic "
              "mode keeps float32 weights)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "the fixed-order linear takes float32 inputs and weights");
  TORCH_CHECK(weight.dim() == 2 && x.size(-1) == weight.size(1), "x and weight do not match");
  const int64_t k = weight.size(1), n = weight.size(0);
  // the transpose of a contiguous [in, out] matrix (the layout workers/layers/kernels.py gives), else a copy of it
  const at::Tensor wt = weight.stride(0) == 1 && weight.stride(1) == n ? weight.t() : weight.t().contiguous();
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const float* bp = bias_data(bias, n);
  at::Tensor out = at::empty({x2.size(0), n}, x.options());
  linear_fixed_impl(x2.data_ptr<float>(), x2.size(0), k, wt.data_ptr<float>(), n, n, bp, out.data_ptr<float>());
  return shaped_like(out, x, n);
}

// x [.., K] @ packed^T (+ bias) for a weight packed by pack_linear_weight.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "a packed weight is a contiguous [N / ", kPanel, ", K, ", kPanel, "] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "packed weights are float32");
  const int64_t k = packed.size(1), n = packed.size(0) * kPanel;
  TORCH_CHECK(x.size(-1) == k, "x has ", x.size(-1), " features where the packed weight takes ", k);
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const float* bp = bias_data(bias, n);
  at::Tensor out = at::empty({x2.size(0), n}, x.options());
  gemm_packed(x2.data_ptr<float>(), k, x2.size(0), k, packed.data_ptr<float>(), n, bp, out.data_ptr<float>(), n, true);
  return shaped_like(out, x, n);
}

// x [.., K] @ split^T (+ bias) for a weight split by split_linear_weight: three bfloat16 products on
// AMX tiles from kAmxMinRows rows, float32 multiply-adds against the rebuilt weight below (gemm.h).
at::Tensor linear_bf16x3(const at::Tensor& x, const at::Tensor& split, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(split.dim() == 4 && split.size(1) == 4 && split.size(3) == 16 && split.is_contiguous() &&
                  split.scalar_type() == at::kInt,
              "a split weight is a contiguous int32 [N / 32, 4, K / 2, 16] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "the split product takes float32 inputs");
  const int64_t k = x.size(-1), n = split.size(0) * kPanel;
  TORCH_CHECK(k == split.size(2) * 2, "x has ", k, " features where the split weight takes ", split.size(2) * 2);
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const float* bp = bias_data(bias, n);
  at::Tensor out = at::empty({x2.size(0), n}, x.options());
  gemm_split(x2.data_ptr<float>(), k, x2.size(0), k, reinterpret_cast<const uint32_t*>(split.data_ptr<int32_t>()), n,
             bp, out.data_ptr<float>(), n, true);
  return shaped_like(out, x, n);
}

// out [N / 32, 4, K / 2, 16] int32 = weight [N, K] (any strides) split for the bf16x3 product (gemm.h);
// N and K multiples of 32. Only where the AMX product runs (amx_usable).
void split_linear_weight(const at::Tensor& weight, at::Tensor& out) {
  TORCH_CHECK(amx_usable(), "the bf16x3 product needs AMX tiles, which this CPU, OS or build does not grant");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "split_linear_weight takes a float32 [N, K] weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(kPanel == 32 && n % 32 == 0, "a split weight needs a multiple of 32 output features, not ", n);
  TORCH_CHECK(k > 0 && k % 32 == 0, "a split weight needs a positive multiple of 32 input features, not ", k);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kInt && out.dim() == 4 && out.size(0) == n / 32 &&
                  out.size(1) == 4 && out.size(2) == k / 2 && out.size(3) == 16,
              "out must be a contiguous int32 [", n / 32, ", 4, ", k / 2, ", 16] tensor");
  split_weight(weight.data_ptr<float>(), n, k, weight.stride(1), weight.stride(0),
               reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>()));
}

// out [N / panel, K, panel] = weight [N, K] (any strides) in column panels; N a multiple of the panel width.
void pack_linear_weight(const at::Tensor& weight, at::Tensor& out) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_linear_weight takes a float32 [N, K] weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kPanel == 0, "a packed weight needs a multiple of ", kPanel, " output features, not ", n);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.dim() == 3 && out.size(0) == n / kPanel &&
                  out.size(1) == k && out.size(2) == kPanel,
              "out must be a contiguous float32 [N / ", kPanel, ", K, ", kPanel, "] tensor");
  pack_panels(weight.data_ptr<float>(), k, n, weight.stride(1), weight.stride(0), out.data_ptr<float>());
}

int64_t linear_panel_width() { return kPanel; }

// F.linear, through linear_split for float32 batches of up to kSplitMaxRows rows; a packed weight
// through linear_packed, a split one (cpu_matmul_precision "high") through linear_bf16x3.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  if (weight.dim() == 3) return linear_packed(x, weight, bias);
  if (weight.dim() == 4) return linear_bf16x3(x, weight, bias);
  if (x.dim() == 2 && x.size(0) <= kSplitMaxRows && x.scalar_type() == at::kFloat) {
    at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
    if (linear_split(out, x.contiguous(), weight, bias)) return out;
  }
  return at::linear(x, weight, bias);
}

}  // namespace kvserve
