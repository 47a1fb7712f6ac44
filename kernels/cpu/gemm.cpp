// Packed float32 matrix products (see gemm.h for the layout and why every element is one chain).
//
// Loop order: the work is (row block, panel) pairs, row block major, shared out in contiguous ranges
// (few rows: one row block, the panels split; many rows: whole row blocks per thread, each reading
// every panel; a single block of 8+ tiles per thread and at most 1024 columns: a block per thread).
// A thread copies each row block it meets once, depth-interleaved (pack_tile: 16 x 16 transposes on
// AVX-512, 8 x 8 on AVX2), then runs its pairs a chunk of panels at a time: for each depth pass (at
// most kDepth inputs, the passes of equal size), each panel's pass block (in L1) against every row
// tile of the block, the partial sums waiting in a contiguous, 64-byte-aligned buffer in L2 between
// passes (c itself, rows up to many KiB apart, is written once, by the last pass; streamed past the
// caches where it is larger than four L2s). A chunk is a column block (512 columns where the L2 holds
// 2 MiB) where the row block's copy is larger than half the L2, so that a pass of the copy serves
// every panel of the chunk from L2; else one panel, the whole copy staying in L2. The next panel
// block is fetched into L2 one line per input of the kernel's loop. A single row tile (decoding)
// runs all of k in one pass, straight down each panel.
//
// Measured on a Zen 4 core (118 GFLOP/s FMA peak) before this blocking: 896 x 4864, 4864 x 896 and
// 2048 x 5632 weights at 512 and 2048 rows, one thread, CPU time, 88-106 GFLOP/s (not measured there
// since). On a Sapphire Rapids core (the FMA loop at 217-236 GFLOP/s as the VM's load varies;
// `python -m benchmarks.gemm_peak --rows 1,16,64,256,512,2048 --threads 1,2`, builds alternating) the
// blocking before (a's rows all copied first, scalar; 240-row blocks of 128 columns, the partial sums
// in c; passes of 192; the next panel block fetched in a burst before each tile) ran the benchmark's
// products at 256-2048 rows at 140-176 GFLOP/s (one thread, CPU clock: 61-79% of its runs' peak,
// median 71%), this one at 159-179 (73-83% of its runs' peak, median 78%); 16 rows 90-115 -> 130-147,
// 64 rows 130-158 -> 164-169, 1 row 11-17 -> 13-22 (docs/benchmarks.md, "The packed matrix product").
// From L1 alone the 12 x 32 tile runs at 85-87% of the peak: its 12 broadcasts and 2 loads per 24
// multiply-adds cost the rest (90-95% without the broadcasts).
// Written for the vector width of vec.h; the accumulator loops are unrolled by pragma so that they
// live in registers.

#include "gemm.h"

#include <ATen/Parallel.h>

#include "ops.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <ctime>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
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
// input (the tile's rows; only the first R are read), bp kPanel. init: the partial sums at cin (rows
// kPanel apart: the chunk's buffer) when accumulating, else the bias, else 0. Input i also fetches
// the line at pf + (i * pf_step >> 16) into L2: the caller's share of the next panel block, spread
// evenly over the tile. stream: c's rows are written past the caches (c 64-byte aligned on AVX-512,
// 32 on AVX2, and ldc a multiple of W).
template <int R>
void tile(const float* __restrict ap, const float* __restrict bp, int64_t kc, const float* cin, float* c,
          int64_t ldc, const float* bias, bool accumulate, const char* pf, int64_t pf_step, bool stream) {
  vf c0[R], c1[R];
  if (accumulate) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      c0[r] = vload(cin + r * kPanel);
      c1[r] = vload(cin + r * kPanel + W);
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
    __builtin_prefetch(pf + ((i * pf_step) >> 16), 0, 2);  // into L2 (prefetcht1 on x86)
    const vf b0 = vload(bp + i * kPanel), b1 = vload(bp + i * kPanel + W);
    const float* ai = ap + i * kTileRows;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vf a = broadcast(ai + r);
      c0[r] += a * b0;
      c1[r] += a * b1;
    }
  }
#if defined(__AVX512F__) || defined(__AVX__)
  if (stream) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#if defined(__AVX512F__)
      _mm512_stream_ps(c + r * ldc, reinterpret_cast<__m512>(c0[r]));
      _mm512_stream_ps(c + r * ldc + W, reinterpret_cast<__m512>(c1[r]));
#else
      _mm256_stream_ps(c + r * ldc, reinterpret_cast<__m256>(c0[r]));
      _mm256_stream_ps(c + r * ldc + W, reinterpret_cast<__m256>(c1[r]));
#endif
    }
    return;
  }
#endif
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    vstore(c + r * ldc, c0[r]);
    vstore(c + r * ldc + W, c1[r]);
  }
}

using TileFn = void (*)(const float*, const float*, int64_t, const float*, float*, int64_t, const float*, bool,
                        const char*, int64_t, bool);

template <int... R>
constexpr auto make_tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{&tile<R + 1>...};
}
// kTiles[r - 1]: the tile of r rows
constexpr auto kTiles = make_tiles(std::make_integer_sequence<int, kTileRows>{});

#if defined(__AVX512F__)
// r[j] <- lane j of r[0], ..., r[15] (a 16 x 16 transpose)
inline void transpose(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(u[8 * i + j], u[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_f32x4(u[8 * i + j], u[8 * i + 4 + j], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
  }
}
using vreg = __m512;
inline vreg load_row(const float* p) { return _mm512_loadu_ps(p); }
inline void store_row(float* p, vreg v) { _mm512_storeu_ps(p, v); }
inline vreg zero_row() { return _mm512_setzero_ps(); }
#define KVSERVE_PACK_TRANSPOSE 1
#elif defined(__AVX__)
// r[j] <- lane j of r[0], ..., r[7] (an 8 x 8 transpose)
inline void transpose(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
  }
}
using vreg = __m256;
inline vreg load_row(const float* p) { return _mm256_loadu_ps(p); }
inline void store_row(float* p, vreg v) { _mm256_storeu_ps(p, v); }
inline vreg zero_row() { return _mm256_setzero_ps(); }
#define KVSERVE_PACK_TRANSPOSE 1
#endif

// Inputs [0, kc) of a's rows [0, rows) (lda apart), depth-interleaved: dst[i * kTileRows + r]; the
// rows past `rows` are not written (a tile of fewer rows reads only its own). A full tile goes W
// inputs at a time through a W x W transpose (its rows, then zeros), each input's W lanes stored at
// once: the kTileRows that belong to it, then W - kTileRows that the next input's store overwrites,
// so the last input writes up to W - kTileRows floats past dst + kc * kTileRows (the caller's slack).
void pack_tile(const float* a, int64_t lda, int rows, int64_t kc, float* dst) {
  int64_t i = 0;
#ifdef KVSERVE_PACK_TRANSPOSE
  if (rows == kTileRows) {
    for (; i + W <= kc; i += W) {
      vreg r[W];
      for (int q = 0; q < kTileRows; ++q) r[q] = load_row(a + q * lda + i);
      for (int q = kTileRows; q < W; ++q) r[q] = zero_row();
      transpose(r);
      for (int j = 0; j < W; ++j) store_row(dst + (i + j) * kTileRows, r[j]);
    }
  }
#endif
  for (; i < kc; ++i)
    for (int r = 0; r < rows; ++r) dst[i * kTileRows + r] = a[r * lda + i];
}

// The blocking, from the size of this core's L2: rows per row block, panels per column block, and
// the most bytes of a row block's copy of a (all of its inputs) for which a panel at a time is run
// (the copy stays in L2 while every panel meets it). Where a column block's partial sums (rows x
// panels x kPanel floats) and a pass of the copy (rows x kDepth) are to stay in L2 beside each other:
// 360 rows x 512 columns (1.1 MiB in all) where it holds 2 MiB (Sapphire Rapids), 240 x 256 (480 KiB)
// at 1 MiB (Zen 4), 120 x 256 below.
struct Blocking {
  int64_t rows, panels, resident_copy, l2;
};

Blocking blocking() {
  static const Blocking b = [] {
    long l2 = 0;
#if defined(__linux__) && defined(_SC_LEVEL2_CACHE_SIZE)
    l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    if (l2 <= 0) l2 = 1 << 20;
    const int64_t rows = l2 >= (3 << 19) ? 360 : l2 >= (1 << 20) ? 240 : 120;
    const int64_t cols = l2 >= (3 << 19) ? 512 : 256;
    return Blocking{rows / kTileRows * kTileRows, cols / kPanel, l2 / 2, l2};
  }();
  return b;
}

int64_t padded_rows(int64_t m) { return (m + kTileRows - 1) / kTileRows * kTileRows; }

// The row blocks: the row tiles split as evenly as they go into as few blocks of at most
// blocking().rows rows as hold them (so that a thread's share of the work items is its share of the
// FLOPs: 43 tiles are blocks of 15, 14 and 14, not 20, 20 and 3). Where that leaves fewer blocks than
// threads, the threads would share a block's panels, each copying the whole block; up to 1024
// columns (the copy a larger share of the work) and from 8 tiles a thread, there is a block per
// thread instead (two threads, 256 rows of 1024 x 512: 854-864 -> 793-801 us, of 1408 x 512
// 1120-1181 -> 1038-1114, of 4864 x 896 6809-6938 -> 6558-6680).
int64_t row_blocks(int64_t m, int64_t num_panels, int64_t threads) {
  const int64_t tiles = padded_rows(m) / kTileRows, per_block = blocking().rows / kTileRows;
  const int64_t blocks = (tiles + per_block - 1) / per_block;
  return blocks < threads && tiles >= 8 * threads && num_panels * kPanel <= 1024 ? threads : blocks;
}

// Rows [m0, m1) of row block rb of `blocks` (m1 past m for the padded rows of the last tile).
std::pair<int64_t, int64_t> row_block(int64_t m, int64_t blocks, int64_t rb) {
  const int64_t tiles = padded_rows(m) / kTileRows;
  return {tiles * rb / blocks * kTileRows, tiles * (rb + 1) / blocks * kTileRows};
}

// c = bias (or 0) where there is nothing to multiply (k = 0).
void fill_bias(int64_t m, int64_t n, const float* bias, float* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = bias ? bias[j] : 0.0f;
}

// Work items w = rb * num_panels + p in [w0, w1): row block rb (row_block) of panel p. A thread
// copies each row block it meets once (pack_tile, all of k, pass by pass), then runs its items a
// chunk of panels at a time: a column block (blocking().panels) where the copy is larger than half
// the L2, else one panel. For each depth pass, each panel's pass block (in L1) meets every row tile;
// the partial sums wait in the chunk's buffer (L2) for the next pass, and the last pass writes c.
// So a pass of the copy is read from L2 by every panel of the chunk (from memory once per chunk),
// and a panel's pass block from memory once per row block. A single row tile (decoding) runs all
// of k in one pass, straight down each panel.
void gemm_items(const float* a, int64_t lda, int64_t m, int64_t k, const float* panels, int64_t num_panels,
                const float* bias, float* c, int64_t ldc, bool stream, int64_t blocks, int64_t w0, int64_t w1) {
  const Blocking blk = blocking();
  // equal passes of at most kDepth inputs (a multiple of 4): 896 inputs are 4 passes of 224, not
  // three of 256 and one of 128
  const int64_t passes = padded_rows(m) <= kTileRows ? 1 : (k + kDepth - 1) / kDepth;
  const int64_t depth = passes == 1 ? k : std::min(kDepth, ((k + passes - 1) / passes + 3) / 4 * 4);
  // this thread's buffers, 64-byte aligned: a chunk's partial sums, then the row block's copy of a
  // (W floats of slack for pack_tile)
  thread_local std::vector<float> scratch;
  const int64_t sums = blk.rows * blk.panels * kPanel, copy = blk.rows * k + W;
  if (scratch.size() < static_cast<size_t>(sums + copy + 16)) scratch.resize(sums + copy + 16);
  float* partial = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  float* copied = partial + sums;
  int64_t copied_rb = -1;
  for (int64_t w = w0; w < w1;) {
    const int64_t rb = w / num_panels, p0 = w % num_panels;
    const auto [m0, m1] = row_block(m, blocks, rb);
    const int64_t tiles = (m1 - m0) / kTileRows;
    const bool resident = (m1 - m0) * k * static_cast<int64_t>(sizeof(float)) <= blk.resident_copy;
    const int64_t p1 = std::min({num_panels, p0 + (resident ? 1 : blk.panels), p0 + (w1 - w)});
    const bool pack = copied_rb != rb;
    copied_rb = rb;
    for (int64_t k0 = 0; k0 < k; k0 += depth) {
      const int64_t kc = std::min(depth, k - k0);
      const bool last = k0 + kc >= k;
      float* packed_a = copied + k0 * (m1 - m0);  // this pass of the copy: tile t at t * kTileRows * kc
      if (pack)
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t r0 = m0 + t * kTileRows;
          pack_tile(a + r0 * lda + k0, lda, static_cast<int>(std::min<int64_t>(kTileRows, m - r0)), kc,
                    packed_a + t * kTileRows * kc);
        }
      for (int64_t p = p0; p < p1; ++p) {
        const float* bp = panels + p * k * kPanel + k0 * kPanel;
        const float* bias_p = bias ? bias + p * kPanel : nullptr;
        // the panel block after this one (the next panel at this depth, else the first panel at the
        // next depth) is fetched into L2 while this one is in use, each row tile its share of the
        // lines, one per input of the tile (at the rate the tile reads this block): a block comes
        // from memory once per row block, and without this its first tile waited for it (the whole
        // product 10-15% slower on a Sapphire Rapids core). Fetched in a burst before each tile
        // instead, the lines held the products of few row tiles back: 64 rows of 4096 x 4096 ran at
        // 141 GFLOP/s that way, 169-174 spread over the inputs; 16 rows of 896 x 4864 1.24 ms, 0.85.
        const bool same_depth = p + 1 < p1;
        const int64_t next_kc = same_depth ? kc : std::max<int64_t>(0, std::min(depth, k - k0 - kc));
        const char* next = reinterpret_cast<const char*>(
            same_depth ? bp + k * kPanel : next_kc > 0 ? panels + p0 * k * kPanel + (k0 + kc) * kPanel : bp);
        const int64_t lines = next_kc * kPanel * static_cast<int64_t>(sizeof(float)) / 64;
        const int64_t pf_step = (lines + tiles - 1) / tiles * 64 * 65536 / kc;  // bytes per input, 16.16
        for (int64_t t = 0; t < tiles; ++t) {
          const char* pf = next + 64 * (lines * t / tiles);
          const int64_t r0 = m0 + t * kTileRows;
          const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - r0));
          float* sum = partial + (t * (p1 - p0) + (p - p0)) * kTileRows * kPanel;
          kTiles[rows - 1](packed_a + t * kTileRows * kc, bp, kc, sum, last ? c + r0 * ldc + p * kPanel : sum,
                           last ? ldc : kPanel, bias_p, k0 > 0, pf, pf_step, last && stream);
        }
      }
    }
    w += p1 - p0;
  }
#if defined(__AVX512F__) || defined(__AVX__)
  if (stream) _mm_sfence();  // the streamed rows reach memory before the caller (or another thread) reads them
#endif
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

void advise_huge_pages(float* c, int64_t m, int64_t n, int64_t ldc) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t huge = uintptr_t{1} << 21, begin = (reinterpret_cast<uintptr_t>(c) + huge - 1) & ~(huge - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(c + (m - 1) * ldc + n) & ~(huge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)c, (void)m, (void)n, (void)ldc;
#endif
}

void gemm_packed(const float* a, int64_t lda, int64_t m, int64_t k, const float* panels, int64_t n,
                 const float* bias, float* c, int64_t ldc, bool parallel) {
  if (m == 0 || n == 0) return;
  if (k == 0) return fill_bias(m, n, bias, c, ldc);
  const int64_t num_panels = n / kPanel, blocks = row_blocks(m, num_panels, parallel ? at::get_num_threads() : 1);
  const int64_t items = blocks * num_panels;
  // c larger than four L2s is written past the caches: it cannot stay in them for the next op, and
  // written through them each line is read from memory first and pushes the copy of a and the panel
  // blocks out of L2 (2048 rows of 512 x 2816: 163 -> 178 GFLOP/s, 172 -> 186 of 512 x 1536)
  const bool stream = m * n * static_cast<int64_t>(sizeof(float)) > 4 * blocking().l2 &&
                      reinterpret_cast<uintptr_t>(c) % (W * sizeof(float)) == 0 && ldc % W == 0;
  if (stream) advise_huge_pages(c, m, n, ldc);
  if (!parallel) return gemm_items(a, lda, m, k, panels, num_panels, bias, c, ldc, stream, blocks, 0, items);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    gemm_items(a, lda, m, k, panels, num_panels, bias, c, ldc, stream, blocks, begin, end);
  });
}

namespace {

// kFmaChains independent multiply-add chains on vectors of the kernels' width (enough to cover the
// latency of the FMA units times their number), `iterations` times; returns a value of the chains so
// that they are not optimised away. 12 where there are 16 vector registers: 16 chains and the two
// operands spilled three chains to the stack on AVX2, which held the loop to 75% of the FMA units'
// rate (90 against 121 GFLOP/s on a Sapphire Rapids core built for x86-64-v3).
constexpr int kFmaChains = kVectorRegisters >= 32 ? 16 : 12;

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
