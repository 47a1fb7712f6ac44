// Packed float32 matrix products (see gemm.h for the layout and why every element is one chain).
//
// Loop order, per thread and its share of the panels: rows in blocks of kRowBlock (their depth-
// interleaved copy stays in L2), the depth in passes of kDepth, then each panel's kDepth x kPanel
// block (in L1) against every row tile of the block. Written for the vector width of vec.h; the
// accumulator loops are unrolled by pragma so that they live in registers.

#include "gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

namespace kvserve {
namespace {

// One float in every lane, loaded straight from memory (vsplat's 0 + x costs an add per broadcast).
inline vf broadcast(const float* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_set1_ps(*p));
#elif defined(__AVX__)
  return reinterpret_cast<vf>(_mm256_broadcast_ss(p));
#else
  return vsplat(*p);
#endif
}

// c[R rows, kPanel] (rows ldc apart) = init + ap . bp over kc inputs: ap holds kTileRows values per
// input (the tile's rows, padded), bp kPanel. init: c itself (accumulate), else bias, else 0.
template <int R>
void tile(const float* __restrict ap, const float* __restrict bp, int64_t kc, float* c, int64_t ldc,
          const float* bias, bool accumulate) {
  vf c0[R], c1[R];
  if (accumulate) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      c0[r] = vload(c + r * ldc);
      c1[r] = vload(c + r * ldc + W);
    }
  } else {
    const vf b0 = bias ? vload(bias) : vf{}, b1 = bias ? vload(bias + W) : vf{};
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      c0[r] = b0;
      c1[r] = b1;
    }
  }
  for (int64_t i = 0; i < kc; ++i) {
    const vf b0 = vload(bp + i * kPanel), b1 = vload(bp + i * kPanel + W);
    const float* ai = ap + i * kTileRows;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vf a = broadcast(ai + r);
      c0[r] += a * b0;
      c1[r] += a * b1;
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    vstore(c + r * ldc, c0[r]);
    vstore(c + r * ldc + W, c1[r]);
  }
}

using TileFn = void (*)(const float*, const float*, int64_t, float*, int64_t, const float*, bool);

template <int... R>
constexpr auto make_tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{&tile<R + 1>...};
}
// kTiles[r - 1]: the tile of r rows
constexpr auto kTiles = make_tiles(std::make_integer_sequence<int, kTileRows>{});

int64_t padded_rows(int64_t m) { return (m + kTileRows - 1) / kTileRows * kTileRows; }

// The depth-interleaved copy of a's row tile rt (rows rt * kTileRows ..), for every depth pass: pass
// [k0, k0 + kc) of tile rt starts at k0 * padded_rows(m) + rt * kTileRows * kc, value (i, r) at
// i * kTileRows + r. Rows past m are zeros.
void pack_rows(const float* a, int64_t lda, int64_t m, int64_t k, int64_t rt, float* dst) {
  const int64_t mp = padded_rows(m), r0 = rt * kTileRows;
  const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - r0));
  for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
    const int64_t kc = std::min(kDepth, k - k0);
    float* out = dst + k0 * mp + r0 * kc;
    for (int r = 0; r < rows; ++r) {
      const float* src = a + (r0 + r) * lda + k0;
      for (int64_t i = 0; i < kc; ++i) out[i * kTileRows + r] = src[i];
    }
    for (int r = rows; r < kTileRows; ++r)
      for (int64_t i = 0; i < kc; ++i) out[i * kTileRows + r] = 0.0f;
  }
}

// Panels [p0, p1) of c, every row.
void gemm_panels(const float* packed_a, int64_t m, int64_t k, const float* panels, const float* bias, float* c,
                 int64_t ldc, int64_t p0, int64_t p1) {
  const int64_t mp = padded_rows(m);
  for (int64_t m0 = 0; m0 < mp; m0 += kRowBlock) {
    const int64_t m1 = std::min(mp, m0 + kRowBlock);
    for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
      const int64_t kc = std::min(kDepth, k - k0);
      for (int64_t p = p0; p < p1; ++p) {
        const float* bp = panels + p * k * kPanel + k0 * kPanel;
        const float* bias_p = bias ? bias + p * kPanel : nullptr;
        for (int64_t r0 = m0; r0 < m1; r0 += kTileRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - r0));
          kTiles[rows - 1](packed_a + k0 * mp + r0 * kc, bp, kc, c + r0 * ldc + p * kPanel, ldc, bias_p, k0 > 0);
        }
      }
    }
  }
}

}  // namespace

void pack_panels(const float* b, int64_t k, int64_t n, int64_t row_stride, int64_t col_stride, float* dst) {
  at::parallel_for(0, n / kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t i = 0; i < k; ++i)
        for (int j = 0; j < kPanel; ++j)
          dst[(p * k + i) * kPanel + j] = b[(p * kPanel + j) * col_stride + i * row_stride];
  });
}

void gemm_packed(const float* a, int64_t lda, int64_t m, int64_t k, const float* panels, int64_t n,
                 const float* bias, float* c, int64_t ldc, bool parallel) {
  if (m == 0 || n == 0) return;
  const int64_t tiles = padded_rows(m) / kTileRows, num_panels = n / kPanel;
  thread_local std::vector<float> scratch;
  if (scratch.size() < static_cast<size_t>(padded_rows(m) * k)) scratch.resize(padded_rows(m) * k);
  float* packed_a = scratch.data();
  if (!parallel) {
    for (int64_t rt = 0; rt < tiles; ++rt) pack_rows(a, lda, m, k, rt, packed_a);
    gemm_panels(packed_a, m, k, panels, bias, c, ldc, 0, num_panels);
    return;
  }
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t rt = begin; rt < end; ++rt) pack_rows(a, lda, m, k, rt, packed_a);
  });
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    gemm_panels(packed_a, m, k, panels, bias, c, ldc, begin, end);
  });
}


}  // namespace kvserve
