// Fused elementwise ops of the decoder layers on CPU, one pass over memory each and one call per
// layer instead of a handful of torch ops (each with its own dispatch, allocation and thread
// start): RMSNorm, residual add + RMSNorm in place, SiLU-and-multiply, and neox rotary in place.
// Statistics and arithmetic in float32 whatever the storage type, as the torch versions do.

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "ops.h"
#include "vec.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace kvserve {
namespace {

template <typename T>
inline float f32(T x) {
  return static_cast<float>(x);
}

// Rows of `hidden` elements in parallel, a grain of rows that keeps tiny batches on one thread.
template <typename F>
void for_rows(int64_t rows, int64_t hidden, const F& f) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(hidden, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) f(r);
  });
}

template <typename scalar_t>
inline void norm_row(scalar_t* out, const scalar_t* x, const scalar_t* w, int64_t n, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = f32(x[i]);
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  // weight * (x * inv) rounded to the storage type first, as the layer's torch version does
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<scalar_t>(f32(w[i]) * f32(static_cast<scalar_t>(f32(x[i]) * inv)));
}

// Index of the largest of x[0, n): the first one among equal maxima, and the first NaN if there is
// one (as torch.argmax). The W lanes each keep their best value and its index, then the lanes meet.
inline int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0;
  int64_t best = 0;
  if (n >= W) {
    vf m = vload(x);
    vi idx = iota();
    vi cur = idx;
    vf nan_seen = vsplat(0.0f);
    for (i = W; i + W <= n; i += W) {
      cur += W;
      const vf v = vload(x + i);
      nan_seen = (v != v) ? vsplat(1.0f) : nan_seen;
      const auto gt = v > m;
      m = gt ? v : m;
      idx = gt ? cur : idx;
    }
    nan_seen = (m != m) ? vsplat(1.0f) : nan_seen;
    bool any_nan = false;
    for (int l = 0; l < W; ++l) any_nan |= nan_seen[l] != 0.0f;
    if (any_nan) {
      for (int64_t j = 0; j < n; ++j)
        if (x[j] != x[j]) return j;
    }
    float bv = m[0];
    best = idx[0];
    for (int l = 1; l < W; ++l)
      if (m[l] > bv || (m[l] == bv && idx[l] < best)) {
        bv = m[l];
        best = idx[l];
      }
    for (; i < n; ++i) {
      if (x[i] != x[i]) return i;
      if (x[i] > bv) {
        bv = x[i];
        best = i;
      }
    }
    return best;
  }
  float bv = x[0];
  for (i = 0; i < n; ++i) {
    if (x[i] != x[i]) return i;
    if (x[i] > bv) {
      bv = x[i];
      best = i;
    }
  }
  return best;
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, hidden] with a contiguous last axis");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  const at::Tensor x = input.reshape({-1, input.size(-1)});
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must hold one value per column, of x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "kvserve_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t n = x.size(1), xs = x.stride(0), os = out.stride(0);
    for_rows(x.size(0), n, [&](int64_t r) { norm_row(op + r * os, xp + r * xs, wp, n, static_cast<float>(eps)); });
  });
  return out.view(input.sizes());
}

// residual += x; x = rms_norm(residual), both in place.
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "x and residual must agree");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must hold one value per column");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "kvserve_fused_add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const int64_t n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
    for_rows(x.size(0), n, [&](int64_t r) {
      scalar_t* xr = xp + r * xs;
      scalar_t* rr = rp + r * rs;
      for (int64_t i = 0; i < n; ++i) rr[i] = static_cast<scalar_t>(f32(xr[i]) + f32(rr[i]));
      norm_row(xr, rr, wp, n, static_cast<float>(eps));
    });
  });
}

// silu rounded to the storage type before the product, as act(gate) * up does in torch
template <typename T>
void silu_row(T* o, const T* gate, const T* up, int64_t d) {
  for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(f32(static_cast<T>(ssilu(f32(gate[i])))) * f32(up[i]));
}
inline void silu_row(float* o, const float* gate, const float* up, int64_t d) {
  int64_t i = 0;
  for (; i + W <= d; i += W) vstore(o + i, vsilu(vload(gate + i)) * vload(up + i));
  for (; i < d; ++i) o[i] = ssilu(gate[i]) * up[i];
}

// cos and sin rounded to the storage type first, as the torch version casts them
template <typename T>
void rotate_neox(T* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float ci = f32(static_cast<T>(c[i])), si = f32(static_cast<T>(s[i]));
    const float x1 = f32(x[i]), x2 = f32(x[i + half]);
    x[i] = static_cast<T>(x1 * ci - x2 * si);
    x[i + half] = static_cast<T>(x2 * ci + x1 * si);
  }
}

// out [rows, d] = silu(x[:, :d]) * x[:, d:] for x [rows, 2d].
at::Tensor silu_and_mul(const at::Tensor& input) {
  const at::Tensor x = input.reshape({-1, input.size(-1)});
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul takes an even width");
  check_rows(x, "x");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "kvserve_silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t d = out.size(1), xs = x.stride(0), os = out.stride(0);
    for_rows(x.size(0), 2 * d, [&](int64_t r) {
      const scalar_t* gate = xp + r * xs;
      const scalar_t* up = gate + d;
      silu_row(op + r * os, gate, up, d);
    });
  });
  auto sizes = input.sizes().vec();
  sizes.back() /= 2;
  return out.view(sizes);
}

// torch.argmax(x, dim=-1) of float32 rows [rows, n] -> int64 [rows], vectorised (the sampler's
// greedy choice: torch's reduction takes ~1.8 ns per element here, this one a tenth of that).
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "argmax_rows takes float32 [rows, n > 0] with a contiguous last axis");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t n = x.size(1), xs = x.stride(0);
  for_rows(x.size(0), n, [&](int64_t r) { op[r] = argmax_row(xp + r * xs, n); });
  return out;
}

// Neox rotary in place over query [tokens, heads * head_dim] and key [tokens, kv_heads * head_dim]
// (rows may be strided views of a fused qkv output). cos_sin_cache [max_positions, rotary_dim] float32
// holds cos in its first half and sin in its second; dimensions past rotary_dim pass through.
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cache,
                      int64_t head_dim) {
  check_rows(query, "query");
  check_rows(key, "key");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == query.size(0),
              "positions must be int64, one per token");
  TORCH_CHECK(cache.scalar_type() == at::kFloat && cache.is_contiguous() && cache.dim() == 2, "cache must be float32");
  TORCH_CHECK(query.size(1) % head_dim == 0 && key.size(1) % head_dim == 0, "head_dim must divide the widths");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "query and key must share a dtype");
  const int64_t rot = cache.size(1), half = rot / 2;
  TORCH_CHECK(rot <= head_dim && rot % 2 == 0, "rotary_dim must be even and at most head_dim");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cs = cache.data_ptr<float>();
  const int64_t max_pos = cache.size(0);
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " is outside the rotary cache");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "kvserve_rotary", [&] {
    scalar_t* qp = query.data_ptr<scalar_t>();
    scalar_t* kp = key.data_ptr<scalar_t>();
    const int64_t qh = query.size(1) / head_dim, kh = key.size(1) / head_dim;
    const int64_t qs = query.stride(0), ks = key.stride(0);
    for_rows(query.size(0), (qh + kh) * head_dim, [&](int64_t t) {
      const float* c = cs + pos[t] * rot;
      const float* s = c + half;
      for (int64_t h = 0; h < qh; ++h) rotate_neox(qp + t * qs + h * head_dim, c, s, half);
      for (int64_t h = 0; h < kh; ++h) rotate_neox(kp + t * ks + h * head_dim, c, s, half);
    });
  });
}

// How many threads a parallel region of these kernels runs (at::parallel_for is inlined here from
// torch's headers): torch.get_num_threads() when the library runs on torch's OpenMP runtime, which is
// what lets torch.set_num_threads reach the kernels (see kernels/cpu/build.py).
int64_t parallel_threads() {
  std::atomic<int64_t> chunks{0};
  at::parallel_for(0, int64_t{1} << 20, 1, [&](int64_t, int64_t) { chunks.fetch_add(1); });
  return chunks.load();
}

}  // namespace kvserve
