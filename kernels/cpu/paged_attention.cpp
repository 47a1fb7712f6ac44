// Paged attention on CPU, reading K/V in place from the block-addressed pool.
//
// Pools (one pair per layer): [num_blocks, block_size, kv_heads, head_dim]. Sequence s owns the query
// tokens [query_start_loc[s], query_start_loc[s + 1]) of the step; its keys are the positions
// [0, seq_lens[s]) addressed through block_tables[s]; its i-th query token sits at position
// seq_lens[s] - q_len + i and sees the keys up to and including that position (causal).
//
// Shared-prefix (cascade) attention: group g names member sequences that share their first
// group_lens[g] key positions (the same physical blocks, group_block_tables[g]). The group pass
// attends every member's query rows to the shared keys at once (each key tile is loaded once for
// all members), writing the normalised output and its log-sum-exp. The suffix pass then starts each
// member's online softmax from that state (m = lse, l = 1, acc = out) and continues over the keys
// from kv_starts[s] = group_lens[g]: the result equals attention over the whole context.
//
// Work is split into items (sequence or group) x KV head x tile of query tokens; all query heads of
// one KV head form the rows of a tile, so K/V are never repeated for grouped-query attention. Items
// are handed out dynamically to torch's intra-op threads, biggest first, one sequence and KV head's
// items after another (order_items), the same queries' items of a sequence's next KV heads in one run
// (run_pass).
//
// Rows of an item: decode-sized items (fewer than W/2 rows) take the few-rows path, vectorised over
// head_dim; prefill chunks the row-vectorised path, W query rows per vector, whose two products per
// 32-key tile (the scores, then the values weighted by the probabilities) are register-blocked
// micro-kernels (score_tile, accumulate_rows) over the queries transposed once per item.
//
// Fixed order (the engine's deterministic mode): every row takes the few-rows path (vectorised over
// head_dim), whatever the number of rows in its item. A row's arithmetic then depends on nothing but
// its own query and keys: each score is the same lanes' chains reduced by the same tree, each 32-key
// tile (from position 0) is reduced in the same lanes, and a tile's keys beyond the row's limit (or
// before its window) add exact zeros. So a token gets the same bits in a decode step and in a prefill chunk of any size,
// beside any other sequences. (The row-vectorised path would do too, but pads a decode's few rows
// to W lanes: the few-rows path keeps decodes at their usual cost and slows prefill chunks instead.)
//
// Sliding window (window > 0, a layer of Gemma 2/3): the query at position p sees the keys at positions
// (p - window, p] only, transformers' mask for these models. Each row has a lower bound beside its
// limit; an item starts at the 32-key tile holding its rows' lowest bound (the tiles skipped before it
// would add exact zeros), and keys below a row's bound are masked like those past its limit. Blocks
// wholly below the item's lowest bound are not read at all (their keys and values count as zeros,
// masked): a hybrid KV layout's window table may name a stale page there, holding anything (NaN
// times a zero weight would still be NaN). In the
// group pass a member's row may see none of the shared keys (its window lies in its own suffix): the
// pass then leaves out = 0 and lse = -inf, which the suffix pass's merge weighs as nothing.
// Soft-capping (softcap > 0, Gemma 2): every score s (already scaled) becomes softcap * tanh(s / softcap)
// before the mask and the softmax. Groups whose rows do not all see every shared key, and any group
// under soft-capping, take the vector kernel rather than BLAS (group_attention.cpp has neither).
//
// Quantized pools (kv_format 1 .. 3, kv_quant.h; kernels/kv_quant.py is the format): the pools are uint8
// [blocks, block_size, kv_heads, head_dim + 2] and query/key/value float32, bfloat16 or float16. The
// store (kv_store.cpp) quantizes each (token, KV head) row on its own (kv_quant.h's quantize_row: the bytes of
// kv_quant.quantize). Every key and value the attention reads, the step's own tokens included (read
// back from the pool after the store, as always), is dequantized to float32 (code * scale) where the
// half types convert theirs today: the vector kernel dequantizes each 32-key tile of the KV head into
// its per-thread scratch (Scratch::kv), except that on the few-rows path (decodes, and fixed-order items
// of at most kFusedRows rows) of an x86 build with AVX-512, or AVX2 and F16C (KVSERVE_KV_VECTORS), each
// key row is converted into registers where the scores use it, once for the item's query rows
// (kv_quant.h's KvRowReader; the same values and products in the same order, so the same bits, as
// through the scratch, and no scratch row written and read back), the scalar kernel one key row at a time, the BLAS group pass
// each chunk of keys as it gathers it; the float math after that is the one of format 0, on the same
// paths (decode and prefill rows, fixed order, window, soft-cap, groups and the suffix merge). So the
// output is that of format 0 over the dequantized pool in float32, to the bit for a float32 query.
// Format 0 takes the same code as before (the pool read in place), behind one branch per key row.
//
// The store of the step's K/V is kv_store.cpp's store_kv; the checks of the arguments and the step's
// metadata, run before it, are attention_checks.cpp's check_attention.

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "attention_checks.h"
#include "group_attention.h"
#include "kv_store.h"
#include "kv_quant.h"
#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

namespace kvserve {
namespace {

constexpr int kKeyTile = 32;  // keys per online-softmax update
constexpr int kFusedRows = 8;  // the most query rows of an item whose quantized key rows are converted in registers
constexpr int kMaxRows = 64;  // query rows (tokens x heads of one KV head) per work item
// The vector kernel keeps a row's accumulator in registers or on the stack, head_dim / W vectors of
// it: head sizes above kMaxVectors * W (512 with AVX2's 8 lanes) take the scalar kernel instead.
constexpr int kMaxVectors = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename scalar_t>
struct Problem {
  const scalar_t* query;
  int64_t q_tok_stride, q_head_stride;
  const scalar_t* k_pool;  // format 0 (null for a quantized pool)
  const scalar_t* v_pool;
  const uint8_t* k_codes;  // a quantized pool (kv_format > 0; else null): rows of row_width bytes
  const uint8_t* v_codes;
  const float* code_table;  // the format's value of each code (kv_code_table)
  int kv_format;            // 0: the pool holds scalar_t; 1 .. 3: kv_quant.h
  int row_width;            // pool elements per (token, KV head) row: head_dim, or head_dim + 2 bytes
  int64_t block_stride, slot_stride;  // pool strides: per block, per slot (kv_heads * row_width)
  int block_size, num_kv_heads, group_size, head_dim, num_heads;
  int64_t num_tokens;
  scalar_t* out;
  int64_t out_tok_stride;
  float* lse;  // [tokens, heads], written by the group pass, read by the suffix pass
  float scale;
  bool fixed_order;  // every row on the few-rows path (see the top of this file)
  int window;        // > 0: the sliding window (keys at positions > position - window are visible)
  float softcap;     // > 0: scores soft-capped to (-softcap, softcap)
};

// The lowest key position the query at `position` sees.
inline int window_lower(int window, int position) { return window > 0 ? std::max(0, position + 1 - window) : 0; }

// s[i] = cap * tanh(s[i] / cap) for i < n (n a multiple of W).
inline void soft_cap(float* s, int n, float cap) {
  const float inv = 1.0f / cap;
  for (int i = 0; i < n; i += W) vstore(s + i, cap * vtanh(vload(s + i) * inv));
}

// Cache-line aligned storage for the scratch: a vector load or store of a row that straddles two lines
// costs two L1 accesses, and the kernels' loops are bound by those (a 16-byte aligned heap block made
// every AVX-512 access of q, acc and the scores a split one: about 25% slower row-vectorised loops).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* ptr, size_t) { ::operator delete(ptr, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
template <typename T>
using aligned_vector = std::vector<T, LineAligned<T>>;

// Per-thread scratch, grown once and reused across calls.
struct Scratch {
  aligned_vector<float> q;    // [rows][head_dim], scaled queries (the few-rows path)
  aligned_vector<float> qt;   // [head_dim][padded rows], transposed scaled queries (the row-vectorised path)
  aligned_vector<float> s;    // scores, then probabilities
  aligned_vector<float> acc;  // [rows][head_dim]
  aligned_vector<float> kv;   // [2][kKeyTile][head_dim]: a key/value tile converted to float (half types)
  aligned_vector<float> zeros;  // [head_dim]: the key and value of a position in a block below every row's window
  aligned_vector<float> m, l, alpha;
  std::vector<int32_t> limit;  // per row: keys at positions < limit are visible
  std::vector<int32_t> lower;  // per row: and at positions >= lower

  void reserve(int rows_padded, int head_dim) {
    const size_t rd = static_cast<size_t>(rows_padded) * head_dim;
    if (q.size() < rd) {
      q.resize(rd);
      qt.resize(rd);
      acc.resize(rd);
    }
    const size_t sr = static_cast<size_t>(kKeyTile) * rows_padded;
    if (s.size() < sr) s.resize(sr);
    if (kv.size() < static_cast<size_t>(2 * kKeyTile * head_dim)) kv.resize(2 * kKeyTile * head_dim);
    if (zeros.size() < static_cast<size_t>(head_dim)) zeros.resize(head_dim, 0.0f);
    if (m.size() < static_cast<size_t>(rows_padded)) {
      m.resize(rows_padded);
      l.resize(rows_padded);
      alpha.resize(rows_padded);
      limit.resize(rows_padded);
      lower.resize(rows_padded);
    }
  }
};

// Pool offsets of KV head `head_offset`'s rows for the keys [start, start + n), walking the block table.
template <typename scalar_t>
inline void tile_slots(const Problem<scalar_t>& p, const int32_t* table, int start, int n, int64_t head_offset,
                       int64_t* slots) {
  int block = start / p.block_size, offset = start % p.block_size;
  for (int j = 0; j < n; ++j) {
    slots[j] = static_cast<int64_t>(table[block]) * p.block_stride + static_cast<int64_t>(offset) * p.slot_stride +
               head_offset;
    if (++offset == p.block_size) {
      offset = 0;
      ++block;
    }
  }
}

// acc[r] = alpha[r] * acc[r] + sum_j p(r, j) v_j for rows [0, rows), with p(r, j) = prob[r * sr + j * sj].
// RB rows at a time keep their accumulators in registers while the value rows stream past.
template <int DV, int RB>
void accumulate_values(float* acc, int rows, int dv, const float* alpha, const float* prob, int sr, int sj,
                       const float* const* v, int n) {
  const int nv = DV > 0 ? DV : dv;
  const int d = nv * W;
  int r = 0;
  for (; r + RB <= rows; r += RB) {
    vf a[RB][DV > 0 ? DV : kMaxVectors];
    for (int b = 0; b < RB; ++b)
      for (int c = 0; c < nv; ++c) a[b][c] = vload(acc + (r + b) * d + c * W) * alpha[r + b];
    for (int j = 0; j < n; ++j) {
      const float* vj = v[j];
      for (int c = 0; c < nv; ++c) {
        const vf x = vload(vj + c * W);
        for (int b = 0; b < RB; ++b) a[b][c] += prob[(r + b) * sr + j * sj] * x;
      }
    }
    for (int b = 0; b < RB; ++b)
      for (int c = 0; c < nv; ++c) vstore(acc + (r + b) * d + c * W, a[b][c]);
  }
  for (; r < rows; ++r) {
    vf a[DV > 0 ? DV : kMaxVectors];
    for (int c = 0; c < nv; ++c) a[c] = vload(acc + r * d + c * W) * alpha[r];
    for (int j = 0; j < n; ++j) {
      const float pj = prob[r * sr + j * sj];
      for (int c = 0; c < nv; ++c) a[c] += pj * vload(v[j] + c * W);
    }
    for (int c = 0; c < nv; ++c) vstore(acc + r * d + c * W, a[c]);
  }
}

// The row-vectorised path (prefill chunks): a tile's scores and its update of the accumulators are two
// small matrix products, S = Q K^T (rows x keys, over head_dim) and acc += P V (rows x head_dim, over
// the tile's keys). Each keeps a block of outputs in registers, sized so that the block's vector FMAs
// outnumber its loads and fill both FMA ports (each FMA waits 4 cycles for its accumulator's last one:
// 8 independent accumulators at the least, 16 to 24 with room for the loads to run ahead).

// Row vectors x keys of a block of scores: 4W rows x 6 keys with AVX-512's 32 registers (24
// accumulators; per head_dim element 4 query vectors and 6 key broadcasts), 2W x 4 with 16 registers.
// Blocks of fewer rows (the last ones of a tile, few-row items) take 8 keys; a tile's last keys take
// blocks of 4, 2 and 1.
constexpr int kScoreRowVectors = kVectorRegisters >= 32 ? 4 : 2;
constexpr int kScoreKeys = kVectorRegisters >= 32 ? 6 : 4;
constexpr int kScoreKeysNarrow = 8;

// s[(j + b) * rp + c + v * W ...] = q . k_{j + b} for RV row vectors from row c and KB keys from j, with
// qt the scaled queries transposed ([head_dim][rp]).
// (The blocks are inlined into each caller, where the head size is a constant: always_inline, since the
// compiler's budget for this file, with its 21 instantiations of attend, otherwise leaves them calls.)
#define KVSERVE_INLINE __attribute__((always_inline)) inline

template <int RV, int KB>
KVSERVE_INLINE void score_block(const float* __restrict__ qt, int rp, int c, const float* const* kf, int j, int d,
                                float* __restrict__ s) {
  vf a[RV][KB];
  for (int v = 0; v < RV; ++v)
    for (int b = 0; b < KB; ++b) a[v][b] = vf{};
  const float* kb[KB];
  for (int b = 0; b < KB; ++b) kb[b] = kf[j + b];
  const float* qc = qt + c;
  for (int k = 0; k < d; ++k) {
    vf x[RV];
    for (int v = 0; v < RV; ++v) x[v] = vload(qc + k * rp + v * W);
    for (int b = 0; b < KB; ++b) {
      const float e = kb[b][k];
      for (int v = 0; v < RV; ++v) a[v][b] += x[v] * e;
    }
  }
  for (int b = 0; b < KB; ++b)
    for (int v = 0; v < RV; ++v) vstore(s + (j + b) * rp + c + v * W, a[v][b]);
}

// The next tile's key and value rows, asked for (into L2) a few rows before each block of keys of this
// tile's scores (the row-vectorised path), or after each key's products (the few-rows path),
// instead of all at once: a burst of a tile's 512 prefetches of rows in L3 or DRAM holds the L1's fill
// buffers for thousands of cycles and stalls the demand loads behind them.
struct TilePrefetch {
  const char* rows[2 * kKeyTile];
  int count = 0, bytes = 0, done = 0;
  void issue(int upto) {
    for (upto = std::min(upto, count); done < upto; ++done)
      for (int line = 0; line < bytes; line += 64) __builtin_prefetch(rows[done] + line, 0, 2);
  }
};

template <int RV, int KB>
KVSERVE_INLINE void score_rows(const float* qt, int rp, int c, const float* const* kf, int n, int d, float* s,
                               TilePrefetch* pf) {
  const int blocks = n / KB;
  int j = 0;
  for (int b = 1; j + KB <= n; j += KB, ++b) {
    if (pf) pf->issue((b * pf->count + blocks - 1) / blocks);
    score_block<RV, KB>(qt, rp, c, kf, j, d, s);
  }
  if (pf) pf->issue(pf->count);
  if constexpr (KB > 4) {
    if (j + 4 <= n) {
      score_block<RV, 4>(qt, rp, c, kf, j, d, s);
      j += 4;
    }
  }
  if constexpr (KB > 2) {
    if (j + 2 <= n) {
      score_block<RV, 2>(qt, rp, c, kf, j, d, s);
      j += 2;
    }
  }
  if (j < n) score_block<RV, 1>(qt, rp, c, kf, j, d, s);
}

// s[j * rp + r] = q_r . k_j for the rp (padded) rows and the n keys of a tile; pf's rows asked for along
// the first block of rows.
inline void score_tile(const float* qt, int rp, const float* const* kf, int n, int d, float* s, TilePrefetch& pf) {
  int c = 0;
  for (; c + kScoreRowVectors * W <= rp; c += kScoreRowVectors * W)
    score_rows<kScoreRowVectors, kScoreKeys>(qt, rp, c, kf, n, d, s, c == 0 ? &pf : nullptr);
  if constexpr (kScoreRowVectors > 2) {
    for (; c + 2 * W <= rp; c += 2 * W)
      score_rows<2, kScoreKeysNarrow>(qt, rp, c, kf, n, d, s, c == 0 ? &pf : nullptr);
  }
  for (; c < rp; c += W) score_rows<1, kScoreKeysNarrow>(qt, rp, c, kf, n, d, s, c == 0 ? &pf : nullptr);
}

// Rows x vectors of head_dim of a block of accumulators: 6 x 4 with 32 registers (24 accumulators; per
// key 4 value vectors and 6 probability broadcasts), 4 x 2 with 16.
constexpr int kValueRows = kVectorRegisters >= 32 ? 6 : 4;
constexpr int kValueVectors = kVectorRegisters >= 32 ? 4 : 2;

// acc[r + b][c0 ...] = alpha[r + b] * acc[r + b][c0 ...] + sum_j p(r + b, j) v_j[c0 ...] for RB rows from r
// and CB vectors from element c0, with p(r, j) = prob[j * rp + r].
template <int RB, int CB>
KVSERVE_INLINE void value_block(float* __restrict__ acc, int r, int c0, int d, const float* __restrict__ alpha,
                                const float* __restrict__ prob, int rp, const float* const* v, int n) {
  vf a[RB][CB];
  for (int b = 0; b < RB; ++b) {
    const float al = alpha[r + b];
    for (int c = 0; c < CB; ++c) a[b][c] = vload(acc + (r + b) * d + c0 + c * W) * al;
  }
  for (int j = 0; j < n; ++j) {
    const float* vj = v[j] + c0;
    const float* pj = prob + j * rp + r;
    vf x[CB];
    for (int c = 0; c < CB; ++c) x[c] = vload(vj + c * W);
    for (int b = 0; b < RB; ++b) {
      const float e = pj[b];
      for (int c = 0; c < CB; ++c) a[b][c] += e * x[c];
    }
  }
  for (int b = 0; b < RB; ++b)
    for (int c = 0; c < CB; ++c) vstore(acc + (r + b) * d + c0 + c * W, a[b][c]);
}

// value_block over all rows for the CB vectors from c0: blocks of kValueRows, then 4, 2 and 1 rows.
template <int CB>
KVSERVE_INLINE void value_rows(float* acc, int rows, int c0, int d, const float* alpha, const float* prob, int rp,
                               const float* const* v, int n) {
  int r = 0;
  for (; r + kValueRows <= rows; r += kValueRows)
    value_block<kValueRows, CB>(acc, r, c0, d, alpha, prob, rp, v, n);
  if constexpr (kValueRows > 4) {
    if (r + 4 <= rows) {
      value_block<4, CB>(acc, r, c0, d, alpha, prob, rp, v, n);
      r += 4;
    }
  }
  if (r + 2 <= rows) {
    value_block<2, CB>(acc, r, c0, d, alpha, prob, rp, v, n);
    r += 2;
  }
  if (r < rows) value_block<1, CB>(acc, r, c0, d, alpha, prob, rp, v, n);
}

// acc[r] = alpha[r] * acc[r] + sum_j p(r, j) v_j for rows [0, rows), with p(r, j) = prob[j * rp + r]: the
// head dimension in slices of kValueVectors vectors (then 2 and 1), each slice over all rows while that
// slice of the tile's value rows stays in L1. Each element of acc takes its products in key order, one
// FMA each, as accumulate_values does.
template <int DV>
void accumulate_rows(float* acc, int rows, int dv, const float* alpha, const float* prob, int rp,
                     const float* const* v, int n) {
  const int nv = DV > 0 ? DV : dv;
  const int d = nv * W;
  int c = 0;
  for (; c + kValueVectors <= nv; c += kValueVectors)
    value_rows<kValueVectors>(acc, rows, c * W, d, alpha, prob, rp, v, n);
  if constexpr (kValueVectors > 2) {
    if (c + 2 <= nv) {
      value_rows<2>(acc, rows, c * W, d, alpha, prob, rp, v, n);
      c += 2;
    }
  }
  if (c < nv) value_rows<1>(acc, rows, c * W, d, alpha, prob, rp, v, n);
}

// W values of x as floats.
template <typename scalar_t>
inline vf load_floats(const scalar_t* x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return vload(x);
  } else {
    vf v;
    for (int i = 0; i < W; ++i) v[i] = to_float(x[i]);
    return v;
  }
}

// Lanes [0, W/2) of a and b interleaved (a0 b0 a1 b1 ...), and lanes [W/2, W).
#if defined(__AVX512F__)
inline vf interleave_lo(vf a, vf b) {
  return KVSERVE_SHUFFLE(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
}
inline vf interleave_hi(vf a, vf b) {
  return KVSERVE_SHUFFLE(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
}
#else
inline vf interleave_lo(vf a, vf b) { return KVSERVE_SHUFFLE(a, b, 0, 8, 1, 9, 2, 10, 3, 11); }
inline vf interleave_hi(vf a, vf b) { return KVSERVE_SHUFFLE(a, b, 4, 12, 5, 13, 6, 14, 7, 15); }
#endif

// A W x W block in W vectors transposed in registers: log2(W) rounds, each interleaving vector i with
// vector i + W/2 (read an element's vector and lane indices as one number of 2 log2(W) bits: a round
// rotates it by one bit, so log2(W) rounds swap the two halves).
inline void transpose(vf* t) {
  for (int round = 1; round < W; round *= 2) {
    vf u[W];
    for (int i = 0; i < W / 2; ++i) {
      u[2 * i] = interleave_lo(t[i], t[i + W / 2]);
      u[2 * i + 1] = interleave_hi(t[i], t[i + W / 2]);
    }
    for (int i = 0; i < W; ++i) t[i] = u[i];
  }
}

#ifdef KVSERVE_KV_VECTORS
// The few-rows path's scores against a tile of a quantized pool's keys: s[r * kKeyTile + j] = q_r . k_j
// for rows <= kFusedRows query rows (q: [rows][nv * W] floats) and the n keys at kc (a null row: a key
// below every row's window, zeros), each key row converted into registers once (KvRowReader) and its
// products vectorised over head_dim, then 16 keys' partial sums reduced into one vector of scores: the
// products and sums of the scratch path, in its order. pf's next rows are asked for after each key.
// One instance per head size (not per query type: the queries are floats here), and not inlined into
// attend's 21 instances, whose compile time it would otherwise double.
template <int DV>
__attribute__((noinline)) void fused_key_scores(const float* __restrict__ q, int rows, int nv,
                                                const uint8_t* const* kc, int n, int fmt, float* __restrict__ s,
                                                TilePrefetch& pf) {
  if constexpr (DV > 0) nv = DV;
  const int d = nv * W;
  for (int j0 = 0; j0 < n; j0 += W) {
    const int nj = std::min(W, n - j0);
    vf part[kFusedRows][W];
    for (int j = 0; j < nj; ++j) {
      vf kv[DV > 0 ? DV : kMaxVectors];
      if (kc[j0 + j] == nullptr) {
        for (int c = 0; c < nv; ++c) kv[c] = vf{};
      } else {
        const KvRowReader reader(kc[j0 + j], d, fmt);
        for (int c = 0; c < nv; ++c) kv[c] = reader.at(c);
      }
      for (int r = 0; r < rows; ++r) {
        const float* qr = q + r * d;
        vf t = vload(qr) * kv[0];
        for (int c = 1; c < nv; ++c) t += vload(qr + c * W) * kv[c];
        part[r][j] = t;
      }
      pf.issue(2 * (j0 + j + 1));
    }
    for (int r = 0; r < rows; ++r) {
      for (int j = nj; j < W; ++j) part[r][j] = vf{};
      vstore(s + r * kKeyTile + j0, transpose_sum(part[r]));
    }
  }
}
#endif

// The per-lane products of query row qr and key row kj over nv vectors, summed in the one order every
// score path of a float32 (or converted) key row uses: the few-rows path (float_key_scores, one key at
// a time) and the many-rows path of attend run it, and the two-keys loop sums in the same order.
inline vf key_products(const float* qr, const float* kj, int nv) {
  vf t = vload(qr) * vload(kj);
  for (int c = 1; c < nv; ++c) t += vload(qr + c * W) * vload(kj + c * W);
  return t;
}

// The few-rows path's scores against a tile of float key rows: s[r * kKeyTile + j] = q_r . k_j for
// rows <= kFusedRows query rows and the n key rows at kf (a float32 pool's, read in place; a half type's,
// or a quantized pool's where its rows are not converted in registers, in the scratch). Two keys at a
// time where both fit in the vector registers beside their sums (KP = 2), each key row loaded once for
// all rows and each query vector once for both keys; then 16 keys' partial sums reduced into one vector
// of scores. Every (row, key) product is summed in the order of the scratch path, so the scores are the
// same bits. pf's next rows are asked for after each pair of keys.
template <int DV>
__attribute__((noinline)) void float_key_scores(const float* __restrict__ q, int rows, int nv,
                                                const float* const* kf, int n, float* __restrict__ s,
                                                TilePrefetch& pf) {
  constexpr int KP = DV > 0 && 2 * DV + 4 <= kVectorRegisters ? 2 : 1;
  if constexpr (DV > 0) nv = DV;
  const int d = nv * W;
  for (int j0 = 0; j0 < n; j0 += W) {
    const int nj = std::min(W, n - j0);
    vf part[kFusedRows][W];
    int j = 0;
    if constexpr (KP == 2) {
      for (; j + 2 <= nj; j += 2) {
        const float* ka = kf[j0 + j];
        const float* kb = kf[j0 + j + 1];
        vf a[DV], b[DV];
        for (int c = 0; c < DV; ++c) {
          a[c] = vload(ka + c * W);
          b[c] = vload(kb + c * W);
        }
        for (int r = 0; r < rows; ++r) {
          const float* qr = q + r * d;
          const vf q0 = vload(qr);
          vf ta = q0 * a[0], tb = q0 * b[0];
          for (int c = 1; c < DV; ++c) {
            const vf qc = vload(qr + c * W);
            ta += qc * a[c];
            tb += qc * b[c];
          }
          part[r][j] = ta;
          part[r][j + 1] = tb;
        }
        pf.issue(2 * (j0 + j + 2));
      }
    }
    for (; j < nj; ++j) {
      const float* kj = kf[j0 + j];
      for (int r = 0; r < rows; ++r) part[r][j] = key_products(q + r * d, kj, nv);
      pf.issue(2 * (j0 + j + 1));
    }
    for (int r = 0; r < rows; ++r) {
      for (int jj = nj; jj < W; ++jj) part[r][jj] = vf{};
      vstore(s + r * kKeyTile + j0, transpose_sum(part[r]));
    }
  }
}

// One work item: `num_tokens` query tokens (flat indices `tokens`, key limits `limits`, window
// bounds `lowers`) and the query heads of KV head `kv_head` against keys [kv_begin, max limit) of
// block table `table`.
// merge: start from out/lse of an earlier pass. write_lse: record the log-sum-exp.
// DV: head_dim / W when fixed at compile time, else 0 (head_dim a multiple of W either way, and at
// most kMaxVectors * W).
template <typename scalar_t, int DV>
void attend(const Problem<scalar_t>& p, int kv_head, const int32_t* tokens, const int32_t* limits,
            const int32_t* lowers, int num_tokens, const int32_t* table, int kv_begin, bool merge, bool write_lse,
            Scratch& sc) {
  // row blocks whose accumulators (RB x DV vectors) fill at most half the vector registers
  constexpr int RB = DV == 0 ? 1 : std::max(1, std::min(4, kVectorRegisters / 2 / DV));
  const int nv = DV > 0 ? DV : p.head_dim / W;
  const int d = nv * W;
  const int g = p.group_size;
  const int rows = num_tokens * g;
  const int rows_padded = (rows + W - 1) / W * W;
  sc.reserve(rows_padded, d);
  float* __restrict__ q = sc.q.data();
  float* __restrict__ qt = sc.qt.data();
  float* __restrict__ s = sc.s.data();
  float* __restrict__ acc = sc.acc.data();
  float* __restrict__ m = sc.m.data();
  float* __restrict__ l = sc.l.data();
  float* __restrict__ alpha = sc.alpha.data();
  int32_t* __restrict__ limit = sc.limit.data();
  int32_t* __restrict__ lower = sc.lower.data();

  int kv_end = 0, min_limit = std::numeric_limits<int>::max(), min_lower = min_limit, max_lower = 0;
  for (int i = 0; i < num_tokens; ++i) {
    kv_end = std::max(kv_end, limits[i]);
    min_limit = std::min(min_limit, limits[i]);
    min_lower = std::min(min_lower, lowers[i]);
    max_lower = std::max(max_lower, lowers[i]);
  }
  // start at the 32-key tile (counted from position 0) of the lowest visible key
  kv_begin = std::max(kv_begin, min_lower / kKeyTile * kKeyTile);
  // keys before the block of the lowest bound are not read (see the top of this file)
  const int kv_read = min_lower / p.block_size * p.block_size;
  // scores vectorised over rows; else over head_dim (decode-sized items, and every item in fixed order)
  const bool by_rows = !p.fixed_order && rows >= W / 2;
  // row r of the item (query head kv_head * g + r % g of token tokens[r / g]): its query and output rows
  const auto query_row = [&](int r) {
    return p.query + tokens[r / g] * p.q_tok_stride + (kv_head * g + r % g) * p.q_head_stride;
  };
  const auto out_row = [&](int r) { return p.out + tokens[r / g] * p.out_tok_stride + (kv_head * g + r % g) * d; };

  // A prefill item's query rows (a few KiB apart, out of the cache since the projection wrote them) all
  // asked for at once rather than W at a time by the transposition, and its output rows made writable
  // while the item runs rather than by the stores at its end.
  if (by_rows) {
    const int64_t row_bytes = static_cast<int64_t>(d) * sizeof(scalar_t);
    for (int r = 0; r < rows; ++r) {
      const char* src = reinterpret_cast<const char*>(query_row(r));
      const char* o = reinterpret_cast<const char*>(out_row(r));
      for (int64_t line = 0; line < row_bytes; line += 64) {
        __builtin_prefetch(src + line);
        __builtin_prefetch(o + line, 1);
      }
    }
  }

  for (int r = 0; r < rows; ++r) {
    const int tok = tokens[r / g];
    const int head = kv_head * g + r % g;
    if (!by_rows) {
      const scalar_t* src = query_row(r);
      float* dst = q + r * d;
      for (int k = 0; k < d; ++k) dst[k] = to_float(src[k]) * p.scale;
    }
    limit[r] = limits[r / g];
    lower[r] = lowers[r / g];
    float* a = acc + r * d;
    if (merge) {
      const scalar_t* o = out_row(r);
      for (int k = 0; k < d; ++k) a[k] = to_float(o[k]);
      m[r] = p.lse[static_cast<int64_t>(tok) * p.num_heads + head];
      l[r] = 1.0f;
    } else {
      for (int k = 0; k < d; ++k) a[k] = 0.0f;
      m[r] = kNegInf;
      l[r] = 0.0f;
    }
  }
  for (int r = rows; r < rows_padded; ++r) {
    limit[r] = 0;
    lower[r] = 0;
    m[r] = kNegInf;
    l[r] = 0.0f;
  }
  if (by_rows) {  // qt[k][r] = q_r[k] * scale (padding rows 0), W x W blocks transposed in registers
    for (int r0 = 0; r0 < rows_padded; r0 += W) {
      const scalar_t* src[W];
      for (int i = 0; i < W; ++i) {
        const int r = r0 + i;
        src[i] = r < rows ? query_row(r) : nullptr;
      }
      for (int k0 = 0; k0 < d; k0 += W) {
        vf t[W];
        for (int i = 0; i < W; ++i) t[i] = src[i] ? load_floats(src[i] + k0) * p.scale : vf{};
        transpose(t);
        for (int i = 0; i < W; ++i) vstore(qt + (k0 + i) * rows_padded + r0, t[i]);
      }
    }
  }

  const float* kf[kKeyTile];
  const float* vf_[kKeyTile];
  // items of a quantized pool with at most kFusedRows query rows (decodes): each key row converted into
  // registers where the scores use it (fused_key_scores, no scratch row); null: a key below every row's
  // window (zeros)
  const uint8_t* kc[kKeyTile];
  const int64_t head_offset = static_cast<int64_t>(kv_head) * p.row_width;
  const bool quantized = p.kv_format != 0;
  const int64_t row_bytes = quantized ? d + kKvScaleBytes : static_cast<int64_t>(d) * sizeof(scalar_t);
  const char* k_base = quantized ? reinterpret_cast<const char*>(p.k_codes) : reinterpret_cast<const char*>(p.k_pool);
  const char* v_base = quantized ? reinterpret_cast<const char*>(p.v_codes) : reinterpret_cast<const char*>(p.v_pool);
  const int64_t elem_bytes = quantized ? 1 : sizeof(scalar_t);
#ifdef KVSERVE_KV_VECTORS
  // (an item of more rows, a fixed-order prefill chunk, would convert each key row once per kFusedRows
  // rows: it reads the scratch row instead)
  const bool fused_keys = quantized && !by_rows && rows <= kFusedRows;
#else
  constexpr bool fused_keys = false;
#endif
  int64_t slots_a[kKeyTile], slots_b[kKeyTile];
  int64_t* slots = slots_a;  // this tile's
  int64_t* next_slots = slots_b;  // the next tile's, found while this one is computed
  tile_slots(p, table, kv_begin, std::min(kKeyTile, kv_end - kv_begin), head_offset, slots);
  for (int start = kv_begin; start < kv_end; start += kKeyTile) {
    const int n = std::min(kKeyTile, kv_end - start);
    // A block of one layer's K (or V) is a few KiB somewhere in the pool: the hardware prefetchers do
    // not follow a block table, so the next tile's rows are asked for while this one is computed.
    const int next_n = std::min(kKeyTile, kv_end - start - kKeyTile);
    tile_slots(p, table, start + kKeyTile, next_n, head_offset, next_slots);
    // Spread over the tile's scores, into L2 (the row-vectorised path a few rows before each block of
    // keys, the few-rows path a key's K and V rows after each key's products): a burst held the L1's
    // fill buffers while the tile's conversions waited (int8 decodes at 64 x 2k keys: 14-16 against
    // 11-12 ms a layer), and float32 decodes, whose rows stream from memory, read 8.3 GB/s on one thread
    // with the whole next tile asked for into L1 at once against 11.7-11.9 spread into L2 (`python -m
    // benchmarks.attention_op` on the AMD EPYC VM: 36.3 against 25.3-25.8 ms on one thread, 18.6-18.8
    // against 14.2-14.5 on two; in an ad hoc copy of that step, one tile further ahead 27.4 / 15.6 against
    // 25.8-26.0 / 13.8-15.2). Decodes of a bfloat16 or float16 pool take the same spread, not measured.
    TilePrefetch pf;
    pf.bytes = static_cast<int>(row_bytes);
    for (int j = 0; j < next_n; ++j) {
      pf.rows[pf.count++] = k_base + next_slots[j] * elem_bytes;
      pf.rows[pf.count++] = v_base + next_slots[j] * elem_bytes;
    }
    for (int j = 0; j < n; ++j) {
      const int64_t slot = slots[j];
      if (start + j < kv_read) {
        kf[j] = vf_[j] = sc.zeros.data();
        kc[j] = nullptr;
        continue;
      }
      if (quantized) {  // the tile's rows of this KV head, dequantized into the scratch
        float* kd = sc.kv.data() + j * d;
        float* vd = sc.kv.data() + (kKeyTile + j) * d;
        if (fused_keys)
          kc[j] = p.k_codes + slot;
        else
          dequantize_row(p.k_codes + slot, d, p.kv_format, p.code_table, kd);
        dequantize_row(p.v_codes + slot, d, p.kv_format, p.code_table, vd);
        kf[j] = kd;
        vf_[j] = vd;
      } else if constexpr (std::is_same_v<scalar_t, float>) {
        kf[j] = p.k_pool + slot;
        vf_[j] = p.v_pool + slot;
      } else {
        float* kd = sc.kv.data() + j * d;
        float* vd = sc.kv.data() + (kKeyTile + j) * d;
        for (int k = 0; k < d; ++k) {
          kd[k] = to_float(p.k_pool[slot + k]);
          vd[k] = to_float(p.v_pool[slot + k]);
        }
        kf[j] = kd;
        vf_[j] = vd;
      }
    }
    std::swap(slots, next_slots);
    const bool masked = start + n > min_limit || start < max_lower;
    if (by_rows) {
      // s[j * rows_padded + r] = q_r . k_j, W rows per vector (score_tile)
      score_tile(qt, rows_padded, kf, n, d, s, pf);
      if (p.softcap > 0.0f) soft_cap(s, n * rows_padded, p.softcap);
      if (masked) {  // W rows at a time (the padding rows, limit 0, are masked too)
        for (int j = 0; j < n; ++j) {
          const vi pos = vi{} + (start + j);
          float* sj = s + j * rows_padded;
          for (int c = 0; c < rows_padded; c += W) {
            vi lim, low;
            __builtin_memcpy(&lim, limit + c, sizeof(lim));
            __builtin_memcpy(&low, lower + c, sizeof(low));
            vstore(sj + c, (pos >= lim) | (pos < low) ? vsplat(kNegInf) : vload(sj + c));
          }
        }
      }
      for (int c = 0; c < rows_padded; c += W) {
        const vf m_old = vload(m + c);
        vf mx = m_old;
        for (int j = 0; j < n; ++j) mx = vmax(mx, vload(s + j * rows_padded + c));
        const vf safe = mx == vsplat(kNegInf) ? vsplat(0.0f) : mx;
        vf sum = {};
        for (int j = 0; j < n; ++j) {
          const vf e = vexp(vload(s + j * rows_padded + c) - safe);
          vstore(s + j * rows_padded + c, e);
          sum += e;
        }
        const vf al = vexp(m_old - safe);
        vstore(alpha + c, al);
        vstore(l + c, vload(l + c) * al + sum);
        vstore(m + c, mx);
      }
      accumulate_rows<DV>(acc, rows, nv, alpha, s, rows_padded, vf_, n);
    } else {
      // s[r * kKeyTile + j] = q_r . k_j: products vectorised over head_dim, then 16 keys' partial
      // sums reduced together into one vector of scores
#ifdef KVSERVE_KV_VECTORS
      if (fused_keys) {  // the same products in the same order, each key row converted once (rows <= kFusedRows)
        fused_key_scores<DV>(q, rows, nv, kc, n, p.kv_format, s, pf);
      } else
#endif
      if (!fused_keys && rows <= kFusedRows) {  // float32 rows read in place (kf), or converted to the scratch
        float_key_scores<DV>(q, rows, nv, kf, n, s, pf);
      } else
      for (int j0 = 0; j0 < n; j0 += W) {
        const int nj = std::min(W, n - j0);
        for (int r = 0; r < rows; ++r) {
          const float* qr = q + r * d;
          vf part[W];
          for (int j = 0; j < nj; ++j) {
            part[j] = key_products(qr, kf[j0 + j], nv);
            if (r == 0) pf.issue(2 * (j0 + j + 1));
          }
          for (int j = nj; j < W; ++j) part[j] = vf{};
          vstore(s + r * kKeyTile + j0, transpose_sum(part));
        }
      }
      if (p.softcap > 0.0f) soft_cap(s, rows * kKeyTile, p.softcap);
      for (int r = 0; r < rows; ++r) {
        float* sr = s + r * kKeyTile;
        for (int j = n; j < kKeyTile; ++j) sr[j] = kNegInf;
        if (masked)
          for (int j = 0; j < n; ++j)
            if (start + j >= limit[r] || start + j < lower[r]) sr[j] = kNegInf;
        vf mv = vsplat(m[r]);
        for (int c = 0; c < kKeyTile; c += W) mv = vmax(mv, vload(sr + c));
        const float mx = hmax(mv);
        const float safe = mx == kNegInf ? 0.0f : mx;
        vf sum = {};
        for (int c = 0; c < kKeyTile; c += W) {
          const vf e = vexp(vload(sr + c) - safe);
          vstore(sr + c, e);
          sum += e;
        }
        alpha[r] = sexp(m[r] - safe);
        l[r] = l[r] * alpha[r] + hsum(sum);
        m[r] = mx;
      }
      pf.issue(pf.count);
      accumulate_values<DV, RB>(acc, rows, nv, alpha, s, kKeyTile, 1, vf_, n);
    }
  }

  for (int r = 0; r < rows; ++r) {
    const int tok = tokens[r / g];
    const int head = kv_head * g + r % g;
    scalar_t* o = out_row(r);
    const float* ar = acc + r * d;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int k = 0; k < d; ++k) o[k] = static_cast<scalar_t>(ar[k] * inv);
    if (write_lse) p.lse[static_cast<int64_t>(tok) * p.num_heads + head] = m[r] + std::log(l[r]);
  }
}

// Any head_dim: plain loops, one row and one key at a time (head sizes that are not a multiple of W).
template <typename scalar_t>
void attend_scalar(const Problem<scalar_t>& p, int kv_head, const int32_t* tokens, const int32_t* limits,
                   const int32_t* lowers, int num_tokens, const int32_t* table, int kv_begin, bool merge,
                   bool write_lse) {
  const int d = p.head_dim, g = p.group_size;
  std::vector<float> q(d), acc(d);
  std::vector<float> kq(p.kv_format ? d : 0), vq(p.kv_format ? d : 0);  // a quantized key and value row
  for (int i = 0; i < num_tokens; ++i) {
    const int tok = tokens[i];
    for (int h = kv_head * g; h < (kv_head + 1) * g; ++h) {
      const scalar_t* src = p.query + tok * p.q_tok_stride + h * p.q_head_stride;
      scalar_t* o = p.out + tok * p.out_tok_stride + h * d;
      for (int k = 0; k < d; ++k) q[k] = to_float(src[k]) * p.scale;
      float m = kNegInf, l = 0.0f;
      if (merge) {
        for (int k = 0; k < d; ++k) acc[k] = to_float(o[k]);
        m = p.lse[static_cast<int64_t>(tok) * p.num_heads + h];
        l = 1.0f;
      } else {
        std::fill(acc.begin(), acc.end(), 0.0f);
      }
      // one key: its score and the online-softmax update, the key and value rows read through kr, vr
      auto step = [&](auto kr, auto vr) {
        float score = 0.0f;
        for (int k = 0; k < d; ++k) score += q[k] * to_float(kr[k]);
        if (p.softcap > 0.0f) score = p.softcap * std::tanh(score / p.softcap);
        const float mx = std::max(m, score);
        const float alpha = std::exp(m - mx), e = std::exp(score - mx);
        l = l * alpha + e;
        for (int k = 0; k < d; ++k) acc[k] = acc[k] * alpha + e * to_float(vr[k]);
        m = mx;
      };
      for (int pos = std::max(kv_begin, lowers[i]); pos < limits[i]; ++pos) {
        const int64_t slot = static_cast<int64_t>(table[pos / p.block_size]) * p.block_stride +
                             static_cast<int64_t>(pos % p.block_size) * p.slot_stride +
                             static_cast<int64_t>(kv_head) * p.row_width;
        if (p.kv_format) {
          dequantize_row(p.k_codes + slot, d, p.kv_format, p.code_table, kq.data());
          dequantize_row(p.v_codes + slot, d, p.kv_format, p.code_table, vq.data());
          step(static_cast<const float*>(kq.data()), static_cast<const float*>(vq.data()));
        } else {
          step(p.k_pool + slot, p.v_pool + slot);
        }
      }
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;  // a row that saw no key (a window past a group's keys)
      for (int k = 0; k < d; ++k) o[k] = static_cast<scalar_t>(acc[k] * inv);
      if (write_lse) p.lse[static_cast<int64_t>(tok) * p.num_heads + h] = m + std::log(l);
    }
  }
}

struct Item {
  int32_t token_begin;  // into the pass's token list
  int32_t num_tokens;
  int32_t kv_head;
  int32_t table;        // which block-table row
  int32_t kv_begin;
  bool merge;
  int64_t cost;         // for ordering: bigger items go first
};

// The order items are handed out in: biggest first, and the items of one stream (block table and KV
// head: the tiles of one sequence's prefill, which read the same keys and values) one after another,
// streams ordered by their biggest item. A prefill's next item then finds its keys and values in the
// cache the previous one left them in; ordered by cost alone, the same-sized items of every sequence
// and KV head came in turn and each read its keys from L3 or memory. The tail is the smallest items
// of the last stream (or the decodes), as in plain biggest-first order. The passes build each
// stream's items consecutively.
void order_items(std::vector<Item>& items) {
  struct Key {
    int64_t stream_cost, cost;
    int32_t stream;
    Item item;
  };
  std::vector<Key> keys;
  keys.reserve(items.size());
  for (size_t i = 0; i < items.size();) {
    size_t j = i;
    int64_t biggest = 0;
    for (; j < items.size() && items[j].table == items[i].table && items[j].kv_head == items[i].kv_head; ++j)
      biggest = std::max(biggest, items[j].cost);
    for (size_t k = i; k < j; ++k)
      keys.push_back({biggest, items[k].cost, static_cast<int32_t>(i), items[k]});
    i = j;
  }
  std::stable_sort(keys.begin(), keys.end(), [](const Key& a, const Key& b) {
    if (a.stream_cost != b.stream_cost) return a.stream_cost > b.stream_cost;
    if (a.stream != b.stream) return a.stream < b.stream;
    return a.cost > b.cost;
  });
  for (size_t i = 0; i < items.size(); ++i) items[i] = keys[i].item;
}

template <typename scalar_t, int DV>
void run_pass(const Problem<scalar_t>& p, std::vector<Item>& items, const std::vector<int32_t>& tokens,
              const std::vector<int32_t>& limits, const std::vector<int32_t>& lowers, const int32_t* tables,
              int64_t table_stride, bool write_lse) {
  const int64_t n = static_cast<int64_t>(items.size());
  if (n == 0) return;
  order_items(items);
  // Handed out in runs: the same queries against the next KV heads of the same block table (a decode's
  // KV heads; a short prompt's) go to one thread, up to a run of n / (4 x threads) items, so that each
  // thread still gets four runs or more. A block's rows interleave its KV heads (130-byte rows of an
  // int8 pool, two heads to four cache lines): the first head's reads bring most of the next one's
  // lines into this core's L2, where another thread's would fetch them again (64 decodes x 2 KV
  // heads at 2k keys, 2 threads, builds alternating four rounds: int8 9.0 -> 8.4 ms a layer on
  // average, float32 16.6 -> 15.8, neither slower in any round). Each item's arithmetic is its own,
  // whichever thread runs it: the bits do not change.
  const int64_t threads = at::get_num_threads();
  const int64_t most = std::max<int64_t>(1, n / (4 * threads));
  std::vector<int64_t> runs{0};
  for (int64_t i = 1; i < n; ++i) {
    const Item &a = items[i - 1], &b = items[i];
    const bool same = a.table == b.table && a.token_begin == b.token_begin && a.num_tokens == b.num_tokens &&
                      a.kv_begin == b.kv_begin && a.merge == b.merge;
    if (!same || i - runs.back() >= most) runs.push_back(i);
  }
  runs.push_back(n);
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, num_runs);
  const bool vector_path = p.head_dim % W == 0 && p.head_dim / W <= kMaxVectors;
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    thread_local Scratch scratch;
    for (int64_t r = next.fetch_add(1); r < num_runs; r = next.fetch_add(1))
    for (int64_t i = runs[r]; i < runs[r + 1]; ++i) {
      const Item& it = items[i];
      const int32_t* toks = tokens.data() + it.token_begin;
      const int32_t* lims = limits.data() + it.token_begin;
      const int32_t* lows = lowers.data() + it.token_begin;
      const int32_t* table = tables + it.table * table_stride;
      if (vector_path)
        attend<scalar_t, DV>(p, it.kv_head, toks, lims, lows, it.num_tokens, table, it.kv_begin, it.merge,
                             write_lse, scratch);
      else
        attend_scalar<scalar_t>(p, it.kv_head, toks, lims, lows, it.num_tokens, table, it.kv_begin, it.merge,
                                write_lse);
    }
  });
}

// Group-pass items through BLAS (group_attention.cpp): float32 only, handed out one at a time, biggest first.
template <typename scalar_t>
void run_group_blas(const Problem<scalar_t>& p, std::vector<Item>& items, const std::vector<int32_t>& tokens,
                    const std::vector<int32_t>& limits, const int32_t* tables, int64_t table_stride) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    const int64_t n = static_cast<int64_t>(items.size());
    if (n == 0) return;
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
    const GroupAttention gp{p.query, p.q_tok_stride, p.q_head_stride, p.k_pool, p.v_pool, p.k_codes, p.v_codes,
                            p.code_table, p.kv_format, p.row_width, p.block_stride, p.slot_stride, p.block_size, p.group_size,
                            p.head_dim, p.num_heads, p.out, p.out_tok_stride, p.lse, p.scale};
    std::atomic<int64_t> next{0};
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
    // inside the parallel region BLAS runs on the calling thread only (MKL does not nest its threads)
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      thread_local GroupScratch scratch;
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
        const Item& it = items[i];
        attend_group_blas(gp, it.kv_head, tokens.data() + it.token_begin, it.num_tokens,
                          tables + it.table * table_stride, limits[it.token_begin], scratch);
      }
    });
  }
}

template <typename scalar_t, int DV>
void paged_attention_impl(const Problem<scalar_t>& p, const at::Tensor& block_tables,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                          const at::Tensor& kv_starts, const at::Tensor& group_block_tables,
                          const at::Tensor& group_lens, const at::Tensor& group_member_start,
                          const at::Tensor& group_members) {
  const int num_seqs = static_cast<int>(seq_lens.size(0));
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = kv_starts.numel() ? kv_starts.data_ptr<int32_t>() : nullptr;
  const int g = p.group_size;
  const int tokens_per_item = std::max(1, kMaxRows / g);

  // group pass: every member's query tokens against the shared keys, all visible
  const int num_groups = static_cast<int>(group_lens.numel());
  if (num_groups) {
    const int32_t* glens = group_lens.data_ptr<int32_t>();
    const int32_t* gstart = group_member_start.data_ptr<int32_t>();
    const int32_t* members = group_members.data_ptr<int32_t>();
    std::vector<int32_t> tokens, limits, lowers;
    std::vector<Item> items, blas_items;
    // large groups (every key visible to every row: two matrix products) through BLAS; not with
    // soft-capped scores, nor for a group some of whose rows' windows leave out shared keys
    const bool blas = std::is_same_v<scalar_t, float> && !p.fixed_order && p.softcap <= 0.0f &&
                      group_blas_available();
    for (int gi = 0; gi < num_groups; ++gi) {
      const int begin = static_cast<int>(tokens.size());
      int highest_lower = 0;
      for (int mi = gstart[gi]; mi < gstart[gi + 1]; ++mi) {
        const int s = members[mi];
        const int first_pos = lens[s] - (qsl[s + 1] - qsl[s]);
        for (int t = qsl[s]; t < qsl[s + 1]; ++t) {
          tokens.push_back(t);
          limits.push_back(glens[gi]);
          lowers.push_back(std::min(window_lower(p.window, first_pos + t - qsl[s]), glens[gi]));
          highest_lower = std::max(highest_lower, lowers.back());
        }
      }
      const int end = static_cast<int>(tokens.size());
      const int rows = (end - begin) * g;
      const bool by_blas = blas && highest_lower == 0 && rows >= kGroupMinRows;
      // tiles of up to kGroupTileRows rows, split further while the KV heads alone leave threads idle
      const int parts = std::max(1, (static_cast<int>(at::get_num_threads()) + p.num_kv_heads - 1) / p.num_kv_heads);
      const int tile = std::clamp((rows + parts - 1) / parts, kGroupMinRows, kGroupTileRows);
      const int per_item = by_blas ? std::max(1, tile / g) : tokens_per_item;
      for (int h = 0; h < p.num_kv_heads; ++h)
        for (int t = begin; t < end; t += per_item) {
          const int nt = std::min(per_item, end - t);
          (by_blas ? blas_items : items).push_back({t, nt, h, gi, 0, false, static_cast<int64_t>(nt) * glens[gi]});
        }
    }
    run_group_blas<scalar_t>(p, blas_items, tokens, limits, group_block_tables.data_ptr<int32_t>(),
                             group_block_tables.stride(0));
    run_pass<scalar_t, DV>(p, items, tokens, limits, lowers, group_block_tables.data_ptr<int32_t>(),
                          group_block_tables.stride(0), true);
  }

  // per-sequence pass (the suffix after a shared prefix, or the whole context), causal
  std::vector<int32_t> tokens, limits, lowers;
  std::vector<Item> items;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_begin = qsl[s], q_len = qsl[s + 1] - qsl[s];
    const int first_pos = lens[s] - q_len;
    const int kv_begin = starts ? starts[s] : 0;

    const int begin = static_cast<int>(tokens.size());
    for (int i = 0; i < q_len; ++i) {
      tokens.push_back(q_begin + i);
      limits.push_back(first_pos + i + 1);
      lowers.push_back(window_lower(p.window, first_pos + i));
    }
    for (int h = 0; h < p.num_kv_heads; ++h)
      for (int i = 0; i < q_len; i += tokens_per_item) {
        const int nt = std::min(tokens_per_item, q_len - i);
        const int from = std::max(kv_begin, lowers[begin + i]);  // the item's lowest visible key
        items.push_back({begin + i, nt, h, s, kv_begin, kv_begin > 0,
                         static_cast<int64_t>(nt) * (first_pos + i + nt - from)});
      }
  }
  run_pass<scalar_t, DV>(p, items, tokens, limits, lowers, block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                        false);
}

// Attention of `query` over the pool into `out` (its inputs passed check_attention).
void paged_attention_out(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool,
                         const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         const at::Tensor& kv_starts, const at::Tensor& group_block_tables,
                         const at::Tensor& group_lens, const at::Tensor& group_member_start,
                         const at::Tensor& group_members, double scale, bool fixed_order, int64_t window,
                         double softcap, int64_t kv_format) {
  TORCH_CHECK(window >= 0 && window <= std::numeric_limits<int32_t>::max(), "window must be >= 0, got ", window);
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), "softcap must be finite and >= 0, got ", softcap);
  const int64_t tokens = query.size(0), heads = query.size(1);
  at::Tensor lse;
  if (group_lens.numel()) lse = at::empty({tokens, heads}, query.options().dtype(at::kFloat));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "kvserve_paged_attention", [&] {
    Problem<scalar_t> p;
    p.query = query.data_ptr<scalar_t>();
    p.q_tok_stride = query.stride(0);
    p.q_head_stride = query.stride(1);
    p.kv_format = static_cast<int>(kv_format);
    const bool quantized = kv_format != 0;
    p.k_pool = quantized ? nullptr : k_pool.data_ptr<scalar_t>();
    p.v_pool = quantized ? nullptr : v_pool.data_ptr<scalar_t>();
    p.k_codes = quantized ? k_pool.data_ptr<uint8_t>() : nullptr;
    p.v_codes = quantized ? v_pool.data_ptr<uint8_t>() : nullptr;
    p.code_table = quantized ? kv_code_table(p.kv_format) : nullptr;
    p.block_size = static_cast<int>(k_pool.size(1));
    p.num_kv_heads = static_cast<int>(k_pool.size(2));
    p.head_dim = static_cast<int>(query.size(2));
    p.row_width = static_cast<int>(k_pool.size(3));
    p.block_stride = k_pool.stride(0);
    p.slot_stride = k_pool.stride(1);
    p.num_heads = static_cast<int>(heads);
    p.num_tokens = tokens;
    p.group_size = static_cast<int>(heads / p.num_kv_heads);
    p.out = out.data_ptr<scalar_t>();
    p.out_tok_stride = out.stride(0);
    p.lse = lse.defined() ? lse.data_ptr<float>() : nullptr;
    p.scale = static_cast<float>(scale);
    p.fixed_order = fixed_order;
    p.window = static_cast<int>(window);
    p.softcap = static_cast<float>(softcap);
    auto run = [&](auto dim) {
      paged_attention_impl<scalar_t, decltype(dim)::value>(p, block_tables, query_start_loc, seq_lens, kv_starts,
                                                           group_block_tables, group_lens, group_member_start,
                                                           group_members);
    };
    switch (p.head_dim) {
      case 32: run(std::integral_constant<int, 32 / W>{}); break;
      case 64: run(std::integral_constant<int, 64 / W>{}); break;
      case 80: run(std::integral_constant<int, 80 / W>{}); break;
      case 96: run(std::integral_constant<int, 96 / W>{}); break;
      case 128: run(std::integral_constant<int, 128 / W>{}); break;
      case 256: run(std::integral_constant<int, 256 / W>{}); break;
      default: run(std::integral_constant<int, 0>{}); break;
    }
  });
}

}  // namespace

// The layer's whole attention in one call: store the step's K/V, then attend -> [tokens, heads, head_dim].
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& k_pool,
                           at::Tensor& v_pool, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& kv_starts,
                           const at::Tensor& group_block_tables, const at::Tensor& group_lens,
                           const at::Tensor& group_member_start, const at::Tensor& group_members, double scale,
                           bool fixed_order, int64_t window, double softcap, int64_t kv_format) {
  check_attention(query, k_pool, v_pool, block_tables, query_start_loc, seq_lens, kv_starts, group_block_tables,
                  group_lens, group_member_start, group_members, kv_format);
  store_kv(key, value, k_pool, v_pool, slot_mapping, static_cast<int>(kv_format));
  at::Tensor out = at::empty(query.sizes(), query.options());
  paged_attention_out(out, query, k_pool, v_pool, block_tables, query_start_loc, seq_lens, kv_starts,
                      group_block_tables, group_lens, group_member_start, group_members, scale, fixed_order, window,
                      softcap, kv_format);
  return out;
}

}  // namespace kvserve
