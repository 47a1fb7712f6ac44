// The shared-prefix (cascade) group pass as matrix products: for one group, one KV head and a tile
// of member query rows (tokens x the query heads of that KV head), every shared key is visible, so
// the scores are Q K^T and the output P V, two single-threaded sgemm calls per chunk of keys with
// an online softmax between chunks. The keys and values of a chunk are gathered out of the pool
// (one copy per chunk for all the tile's rows, not one per sequence), so BLAS runs at its matrix
// speed where the vector kernel of paged_attention.cpp runs at about half of it on large groups.
// float32 only (sgemm), never in fixed order (BLAS's blocking is its own); the caller falls back to
// the vector kernel otherwise.
// A quantized pool (kv_quant.h) keeps BLAS: the gather that copies a chunk's keys and values into the
// scratch dequantizes them instead (code * scale, float32), so the products run on the same values
// the vector kernel reads.

#include "group_attention.h"

#include "kv_quant.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc) __attribute__((weak));
}

namespace kvserve {

bool group_blas_available() { return sgemm_ != nullptr; }

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Row-major C[m x n] = A[m x k] . B[n x k]^T  (column-major: C^T = B . A^T).
void gemm_abt(const float* a, const float* b, float* c, int m, int n, int k, int ldc) {
  const char t = 'T', no = 'N';
  const float one = 1.0f, zero = 0.0f;
  sgemm_(&t, &no, &n, &m, &k, &one, b, &k, a, &k, &zero, c, &ldc);
}

// Row-major C[m x n] += A[m x k] . B[k x n]  (column-major: C^T += B^T . A^T).
void gemm_ab_acc(const float* a, int lda, const float* b, float* c, int m, int n, int k) {
  const char no = 'N';
  const float one = 1.0f;
  sgemm_(&no, &no, &n, &m, &k, &one, b, &n, a, &lda, &one, c, &n);
}

}  // namespace

void attend_group_blas(const GroupAttention& p, int kv_head, const int32_t* tokens, int num_tokens,
                       const int32_t* table, int num_keys, GroupScratch& sc) {
  const int d = p.head_dim, g = p.group_size, rows = num_tokens * g;
  const int chunk = std::min(kGroupKeyChunk, num_keys);
  sc.q.resize(static_cast<size_t>(rows) * d);
  sc.acc.assign(static_cast<size_t>(rows) * d, 0.0f);
  sc.s.resize(static_cast<size_t>(rows) * chunk);
  sc.k.resize(static_cast<size_t>(chunk) * d);
  sc.v.resize(static_cast<size_t>(chunk) * d);
  sc.m.assign(rows, kNegInf);
  sc.l.assign(rows, 0.0f);
  float* q = sc.q.data();
  float* acc = sc.acc.data();
  float* s = sc.s.data();
  for (int r = 0; r < rows; ++r) {
    const float* src = p.query + tokens[r / g] * p.q_tok_stride + (kv_head * g + r % g) * p.q_head_stride;
    for (int k = 0; k < d; ++k) q[r * d + k] = src[k] * p.scale;
  }
  const int64_t head_offset = static_cast<int64_t>(kv_head) * p.row_width;
  for (int c0 = 0; c0 < num_keys; c0 += chunk) {
    const int n = std::min(chunk, num_keys - c0);
    for (int j = 0; j < n; ++j) {
      const int pos = c0 + j;
      const int64_t slot = static_cast<int64_t>(table[pos / p.block_size]) * p.block_stride +
                           static_cast<int64_t>(pos % p.block_size) * p.slot_stride + head_offset;
      if (p.k_codes) {
        dequantize_row(p.k_codes + slot, d, p.kv_format, p.code_table, sc.k.data() + static_cast<size_t>(j) * d);
        dequantize_row(p.v_codes + slot, d, p.kv_format, p.code_table, sc.v.data() + static_cast<size_t>(j) * d);
      } else {
        std::memcpy(sc.k.data() + static_cast<size_t>(j) * d, p.k_pool + slot, sizeof(float) * d);
        std::memcpy(sc.v.data() + static_cast<size_t>(j) * d, p.v_pool + slot, sizeof(float) * d);
      }
    }
    gemm_abt(q, sc.k.data(), s, rows, n, d, chunk);
    for (int r = 0; r < rows; ++r) {
      float* sr = s + static_cast<size_t>(r) * chunk;
      int j = 0;
      vf mv = vsplat(sc.m[r]);
      for (; j + W <= n; j += W) mv = vmax(mv, vload(sr + j));
      float mx = hmax(mv);
      for (; j < n; ++j) mx = std::max(mx, sr[j]);
      vf sum = {};
      float tail = 0.0f;
      const vf mxv = vsplat(mx);
      for (j = 0; j + W <= n; j += W) {
        const vf e = vexp(vload(sr + j) - mxv);
        vstore(sr + j, e);
        sum += e;
      }
      for (; j < n; ++j) {
        sr[j] = sexp(sr[j] - mx);
        tail += sr[j];
      }
      const float alpha = sexp(sc.m[r] - mx);  // 0 for the first chunk (m = -inf)
      sc.l[r] = sc.l[r] * alpha + hsum(sum) + tail;
      sc.m[r] = mx;
      if (c0 > 0) {
        float* ar = acc + static_cast<size_t>(r) * d;
        for (int k = 0; k < d; ++k) ar[k] *= alpha;
      }
    }
    gemm_ab_acc(s, chunk, sc.v.data(), acc, rows, d, n);
  }
  for (int r = 0; r < rows; ++r) {
    const int tok = tokens[r / g], head = kv_head * g + r % g;
    float* o = p.out + tok * p.out_tok_stride + head * d;
    const float inv = 1.0f / sc.l[r];
    for (int k = 0; k < d; ++k) o[k] = acc[static_cast<size_t>(r) * d + k] * inv;
    p.lse[static_cast<int64_t>(tok) * p.num_heads + head] = sc.m[r] + std::log(sc.l[r]);
  }
}

}  // namespace kvserve
