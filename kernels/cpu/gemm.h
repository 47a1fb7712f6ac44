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

// Multiply-adds per second (GFLOP/s) on the kernels' vectors, independent chains from registers: the
// calling thread alone, or every thread of torch's pool at once (parallel; the sum of their rates).
// Timed on each thread's own CPU clock, so that time the thread spends descheduled (a busy machine)
// is not counted. The peak the products are measured against (benchmarks/gemm_peak.py).
double fma_peak(int64_t iterations, bool parallel);

}  // namespace kvserve
