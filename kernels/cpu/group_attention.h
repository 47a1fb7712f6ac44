// The shared-prefix group pass through BLAS (group_attention.cpp), called by paged_attention.cpp for
// float32 groups with enough query rows.
#pragma once

#include <cstdint>
#include <vector>

namespace kvserve {

constexpr int kGroupKeyChunk = 512;   // keys per online-softmax update (bounds the scores buffer)
constexpr int kGroupTileRows = 256;   // query rows per work item, at most
constexpr int kGroupMinRows = 64;     // a group with fewer rows per KV head takes the vector kernel

struct GroupAttention {
  const float* query;
  int64_t q_tok_stride, q_head_stride;
  const float* k_pool;  // float32 pools (format 0), else null
  const float* v_pool;
  const uint8_t* k_codes;   // quantized pools (kv_quant.h), else null
  const uint8_t* v_codes;
  const float* code_table;  // the quantized format's value of each code
  int kv_format;            // 1 .. 3 with k_codes (kv_quant.h), else 0
  int row_width;            // pool elements per (token, KV head) row: head_dim, or head_dim + 2 bytes
  int64_t block_stride, slot_stride;
  int block_size, group_size, head_dim, num_heads;
  float* out;
  int64_t out_tok_stride;
  float* lse;  // [tokens, heads]
  float scale;
};

// Per-thread buffers, grown once and reused.
struct GroupScratch {
  std::vector<float> q, acc, s, k, v, m, l;
};

// True where torch's CPU library carries an sgemm (MKL or OpenBLAS).
bool group_blas_available();

// Rows = num_tokens x group_size (token-major) of KV head `kv_head` against the keys [0, num_keys)
// of block table `table`, all visible: writes the normalised output and its log-sum-exp.
void attend_group_blas(const GroupAttention& p, int kv_head, const int32_t* tokens, int num_tokens,
                       const int32_t* table, int num_keys, GroupScratch& sc);

}  // namespace kvserve
