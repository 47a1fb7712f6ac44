// Packed float32 matrix products (see gemm.h for the layout and why every element is one chain).
//
// Loop order: a's rows are first copied, depth-interleaved (pack_rows), by all threads. Then the work
// is (row block of at most kRowBlock rows, panel) pairs, row block major, shared out in contiguous ranges
// (few rows: one row block, the panels split; many rows: whole row blocks per thread, each reading
// every panel). A thread runs its pairs kColBlock panels at a time: every depth pass of kDepth over
// those panels, each panel's kDepth x kPanel block (in L1) against every row tile of the block, so
// that the block's accumulators (kRowBlock x 128 floats) stay in L2 between the passes instead of
// going to memory (a row block across all the panels is megabytes). Measured on a Zen 4 core (118
// GFLOP/s FMA peak) with 896 x 4864, 4864 x 896 and 2048 x 5632 weights at 512 and 2048 rows, one
// thread, CPU time: 64-97 GFLOP/s before the column blocks, 88-106 with them. On a Sapphire Rapids
// core (FMA peak about 230 GFLOP/s, `python -m benchmarks.gemm_peak`) the same products ran at 54-72%
// of the peak; fetching the next panel block into L2 ahead of use, unrolling the depth loop by 4 and
// passes of 192 instead of 256 inputs brought them to 64-83%. Written for the vector width of vec.h;
// the accumulator loops are unrolled by pragma so that they live in registers.

#include "gemm.h"

#include <ATen/Parallel.h>

#include "ops.h"

#include <algorithm>
#include <array>
#include <ctime>
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
  // unrolled by 4: the loads of the next inputs' panel rows issue among this input's multiply-adds
  // (rolled, a 12 x 32 tile ran at 78% of the multiply-add peak from L1 on a Sapphire Rapids core,
  // unrolled 85%)
#pragma GCC unroll 4
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

// The row blocks: the row tiles split as evenly as they go into as few blocks of at most kRowBlock
// rows as hold them (so that a thread's share of the work items is its share of the FLOPs: 43 tiles
// are blocks of 15, 14 and 14, not 20, 20 and 3).
int64_t row_blocks(int64_t m) {
  const int64_t tiles = padded_rows(m) / kTileRows, per_block = kRowBlock / kTileRows;
  return (tiles + per_block - 1) / per_block;
}

// Rows [m0, m1) of row block rb of `blocks` (m1 past m for the padded rows of the last tile).
std::pair<int64_t, int64_t> row_block(int64_t m, int64_t blocks, int64_t rb) {
  const int64_t tiles = padded_rows(m) / kTileRows;
  return {tiles * rb / blocks * kTileRows, tiles * (rb + 1) / blocks * kTileRows};
}

// Work items w = rb * num_panels + p in [w0, w1): row block rb (row_block) of panel p.
// Consecutive items of one row block run kColBlock panels at a time, every depth pass over those
// panels before the next ones: their accumulators (kRowBlock x kColBlock panels) stay in L2 between
// passes, a panel's kDepth x kPanel block in L1 while the row tiles pass over it.
void gemm_items(const float* packed_a, int64_t m, int64_t k, const float* panels, int64_t num_panels,
                const float* bias, float* c, int64_t ldc, int64_t w0, int64_t w1) {
  const int64_t mp = padded_rows(m), blocks = row_blocks(m);
  for (int64_t w = w0; w < w1;) {
    const int64_t rb = w / num_panels, p0 = w % num_panels;
    const int64_t p1 = std::min({num_panels, p0 + kColBlock, p0 + (w1 - w)});
    const auto [m0, m1] = row_block(m, blocks, rb);
    for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
      const int64_t kc = std::min(kDepth, k - k0);
      for (int64_t p = p0; p < p1; ++p) {
        const float* bp = panels + p * k * kPanel + k0 * kPanel;
        const float* bias_p = bias ? bias + p * kPanel : nullptr;
        // the panel block after this one (the next panel at this depth, else the first panel at the
        // next depth), fetched into L2 a slice per row tile while this one is in use: a block comes
        // from memory once per row block, and without this its first tile waited for it (the whole
        // product 10-15% slower on a Sapphire Rapids core)
        const bool same_depth = p + 1 < p1;
        const int64_t next_kc = same_depth ? kc : std::max<int64_t>(0, std::min(kDepth, k - k0 - kDepth));
        const char* next = reinterpret_cast<const char*>(
            same_depth ? bp + k * kPanel : next_kc > 0 ? panels + p0 * k * kPanel + (k0 + kDepth) * kPanel : bp);
        const int64_t lines = next_kc * kPanel * static_cast<int64_t>(sizeof(float)) / 64;
        const int64_t tiles = (m1 - m0) / kTileRows;
        for (int64_t r0 = m0, t = 0; r0 < m1; r0 += kTileRows, ++t) {
          for (int64_t line = lines * t / tiles; line < lines * (t + 1) / tiles; ++line)
            __builtin_prefetch(next + 64 * line, 0, 2);  // into L2 (prefetcht1 on x86)
          const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - r0));
          kTiles[rows - 1](packed_a + k0 * mp + r0 * kc, bp, kc, c + r0 * ldc + p * kPanel, ldc, bias_p, k0 > 0);
        }
      }
    }
    w += p1 - p0;
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
  const int64_t items = row_blocks(m) * num_panels;
  if (!parallel) {
    for (int64_t rt = 0; rt < tiles; ++rt) pack_rows(a, lda, m, k, rt, packed_a);
    gemm_items(packed_a, m, k, panels, num_panels, bias, c, ldc, 0, items);
    return;
  }
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t rt = begin; rt < end; ++rt) pack_rows(a, lda, m, k, rt, packed_a);
  });
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    gemm_items(packed_a, m, k, panels, num_panels, bias, c, ldc, begin, end);
  });
}

namespace {

// kFmaChains independent multiply-add chains on vectors of the kernels' width (enough to cover the
// latency of the FMA units times their number), `iterations` times; returns a value of the chains so
// that they are not optimised away.
constexpr int kFmaChains = 16;

float fma_loop(int64_t iterations) {
  vf acc[kFmaChains];
  for (int j = 0; j < kFmaChains; ++j) acc[j] = vsplat(0.001f * static_cast<float>(j));
  vf x = vsplat(0.999999f), y = vsplat(1e-7f);
  asm volatile("" : "+x"(x), "+x"(y));  // unknown to the compiler: the chains cannot be folded
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kFmaChains; ++j) {
#if defined(__AVX512F__)
      acc[j] = reinterpret_cast<vf>(_mm512_fmadd_ps(reinterpret_cast<__m512>(acc[j]), reinterpret_cast<__m512>(x),
                                                    reinterpret_cast<__m512>(y)));
#elif defined(__FMA__)
      acc[j] = reinterpret_cast<vf>(_mm256_fmadd_ps(reinterpret_cast<__m256>(acc[j]), reinterpret_cast<__m256>(x),
                                                    reinterpret_cast<__m256>(y)));
#else
      acc[j] = acc[j] * x + y;
#endif
    }
  }
  vf sum = acc[0];
  for (int j = 1; j < kFmaChains; ++j) sum += acc[j];
  return hsum(sum);
}

}  // namespace

double fma_peak(int64_t iterations, bool parallel) {
  const double flops = 2.0 * W * kFmaChains * static_cast<double>(iterations);
  // GFLOP/s of one run on the calling thread, timed on its own CPU clock
  const auto run = [&] {
    timespec start{}, end{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &start);
    volatile float sink = fma_loop(iterations);
    (void)sink;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &end);
    const double seconds = static_cast<double>(end.tv_sec - start.tv_sec) + 1e-9 * static_cast<double>(end.tv_nsec - start.tv_nsec);
    return flops / std::max(seconds, 1e-9) / 1e9;
  };
  if (!parallel) return run();
  const int64_t threads = at::get_num_threads();
  std::vector<double> rates(threads, 0.0);  // per thread of the region (a thread given two runs counts once)
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    const int64_t id = std::min<int64_t>(at::get_thread_num(), threads - 1);
    for (int64_t t = begin; t < end; ++t) rates[id] = std::max(rates[id], run());
  });
  double total = 0.0;
  for (const double rate : rates) total += rate;
  return total;
}

}  // namespace kvserve
