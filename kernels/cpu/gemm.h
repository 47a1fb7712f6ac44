// Packed float32 matrix products: c[M, N] = a[M, K] . B (+ bias), B pre-packed into column panels.
//
// Layout of a packed B (a linear layer's weight is packed once, when the model is bound): panel p
// holds columns [p * kPanel, (p + 1) * kPanel) as a contiguous [K][kPanel] block, so the kernel
// reads each panel front to back. A register tile is kTileRows rows x kPanel columns (two vectors
// per row: 6 x 16 on AVX2, 12 x 32 on AVX-512), fed by a copy of a's rows interleaved by depth.
//
// Every output element is one multiply-add chain over k = 0 .. K-1 in order, starting from the bias
// (or 0): blocks of inputs (depth passes) pass through memory between passes, which leaves the chain
// as it is, and a tile of fewer rows runs the same chains. So a row's result does not depend on how
// many rows the product has, where the row sits, how many threads run or how the work is blocked
// (the pass width, the row and column blocks): the product is batch-invariant.

#pragma once

#include <cstdint>

#include "vec.h"

namespace kvserve {

constexpr int kPanel = 2 * W;                // columns per packed panel
constexpr int kTileRows = W == 16 ? 12 : 6;  // rows per register tile (2 x kTileRows accumulators)
constexpr int64_t kDepth = 256;              // most inputs per pass (K is cut into equal passes of at most
                                             // this): a panel's pass block (32 KiB on AVX-512) stays in L1
                                             // beside a row tile's copy (12 KiB)

// dst [n / kPanel][k][kPanel] from B, whose element (row i < k, column j < n) is b[j * col_stride +
// i * row_stride]; n must be a multiple of kPanel. A linear weight [N, K] is B's transpose:
// col_stride = weight.stride(0), row_stride = weight.stride(1).
void pack_panels(const float* b, int64_t k, int64_t n, int64_t row_stride, int64_t col_stride, float* dst);

// c[m, n] (rows ldc apart) = a[m, k] (rows lda apart) . B (packed by pack_panels) + bias[n] (none when
// null). parallel: the (row block, panel) pairs are split across torch's threads (few rows: the
// panels; many: whole row blocks); else the calling thread does all (inside a parallel region of its own).
void gemm_packed(const float* a, int64_t lda, int64_t m, int64_t k, const float* panels, int64_t n,
                 const float* bias, float* c, int64_t ldc, bool parallel);

// The product in three bfloat16 products (gemm_amx.cpp: ~16 bits of each input's mantissa, float32
// sums), against a weight split once by split_weight: per panel of kPanel (32) columns, four streams
// (hi of columns 0-15, hi of 16-31, lo of 0-15, lo of 16-31), each k / 2 rows of 16 uint32 (the
// inputs i, i + 1 of a column: i's half in the low 16 bits), k a multiple of 32: [n / 32][4][k / 2][16]
// uint32. From kAmxMinRows rows on AMX tiles, fewer rows by float32
// multiply-adds against the rebuilt weights (hi + lo). Only where amx_usable(): the build targets
// AMX-BF16 and the OS grants the process the tile state.
bool amx_usable();
constexpr int64_t kAmxMinRows = 64;
void split_weight(const float* w, int64_t n, int64_t k, int64_t row_stride, int64_t col_stride, uint32_t* dst);
void gemm_split(const float* a, int64_t lda, int64_t m, int64_t k, const uint32_t* b, int64_t n, const float* bias,
                float* c, int64_t ldc, bool parallel);

// A large output c[m, n] (rows ldc apart) is mostly freshly allocated (linear's at::empty, mapped anew
// for every call), and its first touch faulted in one 4 KiB page at a time: the 2 MiB pages wholly
// inside it may be huge pages instead (where transparent huge pages are on madvise; a hint, nothing
// else changes). 2048 rows of 896 x 4864 (a 40 MB output): 140 -> 160 GFLOP/s through linear, 172
// into a reused output; of 2048 x 5632 160 -> 167.
void advise_huge_pages(float* c, int64_t m, int64_t n, int64_t ldc);

// Multiply-adds per second (GFLOP/s) on the kernels' vectors, independent chains from registers: the
// calling thread alone, or every thread of torch's pool at once (parallel; the sum of their rates).
// Timed on each thread's own CPU clock, so that time the thread spends descheduled (a busy machine)
// is not counted. The peak the products are measured against (benchmarks/gemm_peak.py).
double fma_peak(int64_t iterations, bool parallel);

}  // namespace kvserve
