// The packed product on AMX tiles, in three bfloat16 products (the engine's `cpu_matmul_precision
// = "high"`): each float32 x is split into hi = x with its low 16 bits cleared (exact) and lo = x - hi
// rounded to bfloat16, and a . b is taken as hi_a.hi_b + hi_a.lo_b + lo_a.hi_b, accumulated in
// float32 by TDPBF16PS. What is left out, lo_a.lo_b and lo's rounding, is about 2^-16 of each
// product where float32's own rounding is 2^-24: about 16 bits of every input's mantissa are kept (a
// "bf16x3" product, torch's float32 matmul precision "high"). One TDPBF16PS is 16 x 16 x 32
// multiply-adds, so three of them still run at several times the float32 FMA rate.
//
// The weight is split once, when the model is bound (split_weight: the layout in gemm.h, the same
// bytes as float32). Per product, a's rows are split into a hi and a lo copy in tile blocks (split_rows),
// across threads. Then the work items (a row block of kRowBlock rows, a chunk of panels) are shared
// out; an item runs k in passes of at most kPassDepth inputs, and in each pass every 32-row sub-block
// meets every panel of the chunk: the chunk's pass of B (up to 512 KiB) and the sub-block's pass of a
// (128 KiB) stay in L2. Four accumulator tiles hold a 32 x 32 block of c; two tiles hold a's hi or lo
// rows, two B's hi or lo halves (10 tile loads per 12 TDPBF16PS). Partial sums wait between passes in
// the item's buffer; the last pass adds the bias and writes c's rows. Fewer than kAmxMinRows rows
// (a decode step of few sequences) take float32 multiply-adds against the rebuilt weights hi + lo
// (gemm_split_small): every step sees the split weights, and the regime follows the step's rows.
//
// Every output element is one fixed sequence: per 32 inputs, in order, the three products in the
// order above, the rounding inside TDPBF16PS the hardware's; nothing depends on the rows' number or
// place, the threads or the blocking: from kAmxMinRows rows up the product is batch-invariant, and
// below it too (one chain per element), but the two do not agree bit for bit, which is why the
// engine's deterministic mode keeps float32 weights and never comes here.
//
// Measured on this project's 2-core Sapphire Rapids VM: the block's sequence runs at 2400-2700 bf16
// GFLOP/s from L1/L2 on a quiet host (10-17x the float32 FMA loop's 150-175 GFLOP/s), but the same
// loop read 540-1700 at other times while the FMA loop held steady: the tile unit's rate there
// depends on the host. Through linear, 2048 rows of the small presets' shapes ran at 210-310 GFLOP/s
// (float32 equivalent, one thread) against 150-200 for the float32 product.
//
// The weight's and a's inputs come in whole blocks of 32 (the layers whose input width 32 does not
// divide keep the float32 product), so no pass reads padding.
//
// Non-finite inputs: an infinite x has lo 0, so a product meeting a partner whose own lo is 0 gives
// NaN (0 x inf) where the float32 product gives an infinity.
//
// Built where the compiler targets AMX-BF16 and AVX-512BW (-march=native on Sapphire Rapids and
// later); used where the kernel also finds Linux granting the process the tile data state.

#include "gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__linux__)
#define KVSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvserve {

#if defined(KVSERVE_AMX)
namespace {

constexpr int64_t kRowBlock = 128;    // rows per work item (4 sub-blocks of 32)
constexpr int64_t kPassDepth = 1024;  // most inputs per pass
constexpr int64_t kChunkBytes = 1 << 19;  // a chunk's pass of B, hi and lo
constexpr int64_t kChunkPanels = 16;      // and at most 512 columns (the partial sums: 256 KiB)
static_assert(kPanel == 32, "the AMX product reads panels of 32 columns (an AVX-512 build)");

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 accumulate c (rows 0-15 | 16-31 x columns 0-15 | 16-31), 4-5 hold a's rows, 6-7 B's
// halves: every tile 16 rows of 64 bytes.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

inline __m512i split_hi(__m512 x) { return _mm512_srli_epi32(_mm512_castps_si512(x), 16); }
// lo = x - hi rounded to bfloat16 (nearest, ties to even), in each lane's low 16 bits
// (0 where x is infinite or NaN: hi carries it whole, where x - hi would make an infinity NaN)
inline __m512i split_lo(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x), exponent = _mm512_set1_epi32(0x7F800000);
  const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  const __m512i r = _mm512_castps_si512(_mm512_sub_ps(x, hi));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(r, 16), _mm512_set1_epi32(1));
  const __m512i lo = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(r, _mm512_set1_epi32(0x7FFF)), odd), 16);
  const __mmask16 finite = _mm512_cmpneq_epi32_mask(_mm512_and_si512(bits, exponent), exponent);
  return _mm512_maskz_mov_epi32(finite, lo);
}

// A split weight of k inputs: per panel four streams (hi of columns 0-15, of 16-31, lo of 0-15, of
// 16-31) of k / 2 words of 16 columns (gemm.h).
inline int64_t split_stream(int64_t k) { return k / 2 * 16; }

// Rows [r0, r1) of a (k inputs; rows past m are zeros) -> hi and lo in tile blocks: for each group of 16
// rows g and each 32 inputs j, a contiguous [16][32] block at ((g * k / 32) + j) * 512. A tile is then
// one contiguous KiB, as B's are: the loads stream, where rows k * 2 bytes apart held the tiles back
// (each of 16 lines its own stream for the prefetchers).
void split_rows(const float* a, int64_t lda, int64_t r0, int64_t r1, int64_t m, int64_t k, uint16_t* hi,
                uint16_t* lo) {
  for (int64_t i = r0; i < r1; ++i) {
    const int64_t base = (i / 16) * (k / 32) * 512 + (i % 16) * 32;
    const float* row = a + i * lda;
    for (int64_t j = 0; j < k; j += 16) {
      const __m512 x = i < m ? _mm512_loadu_ps(row + j) : _mm512_setzero_ps();
      const int64_t at = base + (j / 32) * 512 + j % 32;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + at), _mm512_cvtepi32_epi16(split_hi(x)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + at), _mm512_cvtepi32_epi16(split_lo(x)));
    }
  }
}

inline void prefetch_kib(const void* p) {
  const char* c = static_cast<const char*>(p);
#pragma GCC unroll 16
  for (int line = 0; line < 16; ++line) _mm_prefetch(c + 64 * line, _MM_HINT_T0);
}

// The 32 x 32 block at sum (rows ld floats apart) += a's 32-row sub-block (hi and lo: tile blocks from
// ahi / alo, split_rows) . the panel's streams (bp, split_weight), over inputs [k0, k1) (multiples of
// 32); start: the block starts from zero. Per 32 inputs, 10 tile loads (a's hi, B's hi: hi . hi; B's lo:
// hi . lo; a's lo, B's hi again: lo . hi) for 12 products; the 8 KiB of the 32 inputs after the next
// are fetched into L1 among them.
void block(const uint16_t* ahi, const uint16_t* alo, int64_t k, const uint32_t* bp, int64_t stream, int64_t k0,
           int64_t k1, float* sum, int64_t ld, bool start) {
  constexpr int64_t kTile = 64;  // bytes per tile row
  const int64_t group = k / 32 * 512, ldc = ld * 4;  // a's second 16 rows, in uint16
  if (start) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, sum, ldc);
    _tile_loadd(1, sum + 16, ldc);
    _tile_loadd(2, sum + 16 * ld, ldc);
    _tile_loadd(3, sum + 16 * ld + 16, ldc);
  }
  // each load issued a product or two before the products that read it, the others running between
  // (loads right before their products ran at 900 of the tiles' 2400-2700 bf16 GFLOP/s from L1)
  for (int64_t i = k0; i < k1; i += 32) {
    const uint16_t *h = ahi + i / 32 * 512, *l = alo + i / 32 * 512;
    const uint32_t* b = bp + i / 2 * 16;
    // two steps ahead: a's four KiB and B's four, a quarter after each group of products
    const bool ahead = i + 64 < k1;
    _tile_loadd(4, h, kTile);  // a's hi rows 0-15
    _tile_loadd(6, b, kTile);  // B's hi columns 0-15
    _tile_dpbf16ps(0, 4, 6);   // hi . hi
    _tile_loadd(7, b + stream, kTile);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, h + group, kTile);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    if (ahead) {
      prefetch_kib(h + 1024);
      prefetch_kib(h + group + 1024);
    }
    _tile_loadd(6, b + 2 * stream, kTile);  // B's lo columns 0-15
    _tile_dpbf16ps(0, 4, 6);                // hi . lo
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(6, b, kTile);
    _tile_loadd(7, b + 3 * stream, kTile);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
    if (ahead) {
      prefetch_kib(l + 1024);
      prefetch_kib(l + group + 1024);
    }
    _tile_loadd(7, b + stream, kTile);
    _tile_loadd(4, l, kTile);  // a's lo rows 0-15
    _tile_dpbf16ps(0, 4, 6);   // lo . hi
    _tile_dpbf16ps(1, 4, 7);
    if (ahead) {
      prefetch_kib(b + 512);
      prefetch_kib(b + stream + 512);
    }
    _tile_loadd(5, l + group, kTile);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    if (ahead) {
      prefetch_kib(b + 2 * stream + 512);
      prefetch_kib(b + 3 * stream + 512);
    }
  }
  _tile_stored(0, sum, ldc);
  _tile_stored(1, sum + 16, ldc);
  _tile_stored(2, sum + 16 * ld, ldc);
  _tile_stored(3, sum + 16 * ld + 16, ldc);
}

bool os_grants_tiles() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

bool amx_usable() {
  static const bool usable = __builtin_cpu_supports("avx512bw") && os_grants_tiles();
  return usable;
}

namespace {

void gemm_amx(const float* a, int64_t lda, int64_t m, int64_t k, const uint32_t* b, int64_t n, const float* bias,
              float* c, int64_t ldc, bool parallel) {
  const int64_t mp = (m + 31) / 32 * 32, num_panels = n / kPanel, stream = split_stream(k);
  // a's hi / lo copy, kept: 4 bytes per row and input, as a itself; one per process, not per calling
  // thread, as cluster/memory_plan.py counts it (a rank's steps run one at a time, but on two threads
  // under the compiled graph: the actor's calls, the warm-up among them, and the graph's loop; each
  // kept its own copy of the largest step's rows). Products called at once from two threads (two
  // engines in one process) take turns.
  static std::mutex split_mutex;
  static std::vector<uint16_t> a_split;
  const std::lock_guard<std::mutex> hold(split_mutex);
  if (a_split.size() < static_cast<size_t>(2 * mp * k)) a_split.resize(2 * mp * k);
  uint16_t *ahi = a_split.data(), *alo = ahi + mp * k;
  const auto split_a = [&](int64_t b0, int64_t b1) { split_rows(a, lda, b0 * 32, b1 * 32, m, k, ahi, alo); };
  if (parallel)
    at::parallel_for(0, mp / 32, 1, split_a);
  else
    split_a(0, mp / 32);
  const int64_t passes = (k + kPassDepth - 1) / kPassDepth;
  const int64_t depth = (k / 32 + passes - 1) / passes * 32;
  const int64_t chunk = std::max<int64_t>(1, std::min({num_panels, kChunkPanels, kChunkBytes / (depth * 128)}));
  const int64_t row_blocks = (mp + kRowBlock - 1) / kRowBlock, chunks = (num_panels + chunk - 1) / chunk;
  const auto run = [&](int64_t w0, int64_t w1) {
    configure_tiles();
    thread_local std::vector<float> sums;
    const int64_t width = chunk * kPanel;
    if (sums.size() < static_cast<size_t>(kRowBlock * width)) sums.resize(kRowBlock * width);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t rb = w / chunks, q = w % chunks;
      const int64_t r0 = rb * kRowBlock, r1 = std::min(mp, r0 + kRowBlock);
      const int64_t p0 = q * chunk, p1 = std::min(num_panels, p0 + chunk);
      for (int64_t k0 = 0; k0 < k; k0 += depth) {
        const int64_t k1 = std::min(k, k0 + depth);
        for (int64_t r = r0; r < r1; r += 32)
          for (int64_t p = p0; p < p1; ++p)
            block(ahi + r * k, alo + r * k, k, b + p * 4 * stream, stream, k0, k1,
                  sums.data() + (r - r0) * width + (p - p0) * kPanel, width, k0 == 0);
      }
      const int64_t cols = (p1 - p0) * kPanel;
      for (int64_t r = r0; r < std::min(r1, m); ++r) {
        const float* s = sums.data() + (r - r0) * width;
        float* out = c + r * ldc + p0 * kPanel;
        for (int64_t j = 0; j < cols; j += 16) {
          __m512 v = _mm512_loadu_ps(s + j);
          if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + p0 * kPanel + j));
          _mm512_storeu_ps(out + j, v);
        }
      }
    }
    _tile_release();
  };
  const int64_t items = row_blocks * chunks;
  if (!parallel) return run(0, items);
  at::parallel_for(0, items, 1, run);
}

// Few rows: float32 multiply-adds against the split weight, each weight rebuilt as hi + lo (exact in
// float32: ~16 bits of the original's mantissa), so that these rows see the same weights as the
// AMX product's. A tile of up to kSmallRows rows x one panel, per input pair the four 64-byte rows
// of the panel's streams; the pairs in order, each output element one chain.
constexpr int kSmallRows = 8;

template <int R>
void small_tile(const float* a, int64_t lda, int64_t k, const uint32_t* b, int64_t stream, const float* bias,
                float* c, int64_t ldc) {
  __m512 acc0[R], acc1[R];
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps(), b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc0[r] = b0;
    acc1[r] = b1;
  }
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const auto even = [](__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); };
  const auto odd = [&](__m512i w) { return _mm512_castsi512_ps(_mm512_and_si512(w, top)); };
  for (int64_t i = 0; i < k; i += 2) {
    const uint32_t* w = b + i / 2 * 16;
    const __m512i h0 = _mm512_loadu_si512(w), h1 = _mm512_loadu_si512(w + stream);
    const __m512i l0 = _mm512_loadu_si512(w + 2 * stream), l1 = _mm512_loadu_si512(w + 3 * stream);
    const __m512 e0 = _mm512_add_ps(even(h0), even(l0)), e1 = _mm512_add_ps(even(h1), even(l1));
    const __m512 o0 = _mm512_add_ps(odd(h0), odd(l0)), o1 = _mm512_add_ps(odd(h1), odd(l1));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + i]), y = _mm512_set1_ps(a[r * lda + i + 1]);
      acc0[r] = _mm512_fmadd_ps(x, e0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(x, e1, acc1[r]);
      acc0[r] = _mm512_fmadd_ps(y, o0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(y, o1, acc1[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * ldc, acc0[r]);
    _mm512_storeu_ps(c + r * ldc + 16, acc1[r]);
  }
}

using SmallTile = void (*)(const float*, int64_t, int64_t, const uint32_t*, int64_t, const float*, float*, int64_t);
template <int... R>
constexpr auto make_small(std::integer_sequence<int, R...>) {
  return std::array<SmallTile, sizeof...(R)>{&small_tile<R + 1>...};
}
constexpr auto kSmallTiles = make_small(std::make_integer_sequence<int, kSmallRows>{});

void gemm_split_small(const float* a, int64_t lda, int64_t m, int64_t k, const uint32_t* b, int64_t n,
                      const float* bias, float* c, int64_t ldc, bool parallel) {
  const int64_t stream = split_stream(k), num_panels = n / kPanel;
  const int64_t tiles = (m + kSmallRows - 1) / kSmallRows;
  const auto run = [&](int64_t w0, int64_t w1) {  // panel major: a panel is read from memory once
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t p = w / tiles, t = w % tiles, r0 = t * kSmallRows;
      const int rows = static_cast<int>(std::min<int64_t>(kSmallRows, m - r0));
      kSmallTiles[rows - 1](a + r0 * lda, lda, k, b + p * 4 * stream, stream, bias ? bias + p * kPanel : nullptr,
                            c + r0 * ldc + p * kPanel, ldc);
    }
  };
  if (!parallel) return run(0, tiles * num_panels);
  at::parallel_for(0, tiles * num_panels, 1, run);
}

}  // namespace

void gemm_split(const float* a, int64_t lda, int64_t m, int64_t k, const uint32_t* b, int64_t n, const float* bias,
                float* c, int64_t ldc, bool parallel) {
  TORCH_CHECK(amx_usable(), "a weight split for the AMX product needs a CPU and OS that grant AMX tiles");
  TORCH_CHECK(k > 0 && k % 32 == 0, "the split product takes a positive multiple of 32 input features, not ", k);
  if (m == 0 || n == 0) return;
  if (m * n * static_cast<int64_t>(sizeof(float)) > (4 << 20)) advise_huge_pages(c, m, n, ldc);
  if (m >= kAmxMinRows) return gemm_amx(a, lda, m, k, b, n, bias, c, ldc, parallel);
  gemm_split_small(a, lda, m, k, b, n, bias, c, ldc, parallel);
}

// (k a positive multiple of 32 and n of kPanel: split_linear_weight checks them)
void split_weight(const float* w, int64_t n, int64_t k, int64_t row_stride, int64_t col_stride, uint32_t* dst) {
  const int64_t stream = split_stream(k);
  at::parallel_for(0, n / kPanel, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float x[16], y[16];
    for (int64_t p = p0; p < p1; ++p)
      for (int half = 0; half < 2; ++half) {  // columns 0-15, 16-31 of the panel
        const float* col = w + (p * kPanel + half * 16) * col_stride;
        uint32_t* out = dst + p * 4 * stream + half * stream;
        for (int64_t i = 0; i < k; i += 2) {
          for (int j = 0; j < 16; ++j) {
            x[j] = col[j * col_stride + i * row_stride];
            y[j] = col[j * col_stride + (i + 1) * row_stride];
          }
          const __m512 vx = _mm512_load_ps(x), vy = _mm512_load_ps(y);
          const __m512i hi = _mm512_or_si512(split_hi(vx), _mm512_slli_epi32(split_hi(vy), 16));
          const __m512i lo = _mm512_or_si512(split_lo(vx), _mm512_slli_epi32(split_lo(vy), 16));
          _mm512_storeu_si512(out + i / 2 * 16, hi);
          _mm512_storeu_si512(out + 2 * stream + i / 2 * 16, lo);
        }
      }
  });
}

#else

bool amx_usable() { return false; }

void split_weight(const float*, int64_t, int64_t, int64_t, int64_t, uint32_t*) {
  TORCH_CHECK(false, "this build of the kernels has no AMX product");
}

void gemm_split(const float*, int64_t, int64_t, int64_t, const uint32_t*, int64_t, const float*, float*, int64_t,
                bool) {
  TORCH_CHECK(false, "this build of the kernels has no AMX product");
}

#endif

}  // namespace kvserve
