// Paged attention's argument checks: the query and pools' shapes and dtypes, the int32 metadata, and every
// index the step's metadata hands the kernels (query ranges, block ids, group membership).

#include "attention_checks.h"

#include "kv_quant.h"

#include <cstdint>
#include <vector>

namespace kvserve {
namespace {

// Every index the step's metadata hands the kernels, checked before any thread reads or writes
// through it (a bug upstream must fail the call with its reason, never read or write outside the
// pool): the query ranges, the block ids each sequence and group reads (in [0, num_blocks)), the
// rows of the tables, and the groups' membership (a sequence with a shared part is a member of
// exactly one group, whose length is its kv_start; a sequence outside groups starts at 0).
void check_step_metadata(int64_t num_blocks, int block_size, int64_t num_tokens, const at::Tensor& block_tables,
                         const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& kv_starts,
                         const at::Tensor& group_block_tables, const at::Tensor& group_lens,
                         const at::Tensor& group_member_start, const at::Tensor& group_members) {
  const int64_t num_seqs = seq_lens.numel();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[num_seqs] == num_tokens, "query_start_loc must span the ", num_tokens,
              " query tokens");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) >= num_seqs, "block_tables needs a row for each of the ",
              num_seqs, " sequences");
  TORCH_CHECK(kv_starts.numel() == 0 || kv_starts.numel() == num_seqs, "kv_starts needs one entry per sequence");
  const int32_t* starts = kv_starts.numel() ? kv_starts.data_ptr<int32_t>() : nullptr;
  const int64_t table_width = block_tables.size(1);
  const int32_t* tables = num_seqs ? block_tables.data_ptr<int32_t>() : nullptr;
  auto check_blocks = [&](const int32_t* row, int64_t first, int64_t last, const char* what, int64_t index) {
    for (int64_t b = first; b < last; ++b)
      TORCH_CHECK(row[b] >= 0 && row[b] < num_blocks, what, " ", index, ": block ", row[b], " (entry ", b,
                  " of its table) is outside the pool of ", num_blocks, " blocks");
  };
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int q_len = qsl[s + 1] - qsl[s], first_pos = lens[s] - q_len, kv_begin = starts ? starts[s] : 0;
    TORCH_CHECK(q_len >= 1 && first_pos >= 0, "sequence ", s, ": ", q_len, " query tokens do not fit its context of ",
                lens[s]);
    TORCH_CHECK(lens[s] <= table_width * block_size, "sequence ", s, ": its block table is too short for ", lens[s],
                " tokens");
    TORCH_CHECK(kv_begin >= 0 && kv_begin <= first_pos && kv_begin % block_size == 0,
                "sequence ", s, ": a shared prefix must end on a block boundary before its queries");
    check_blocks(tables + s * block_tables.stride(0), kv_begin / block_size, (lens[s] + block_size - 1) / block_size,
                 "sequence", s);
  }
  const int64_t num_groups = group_lens.numel();
  if (num_groups == 0) {
    for (int64_t s = 0; starts && s < num_seqs; ++s)
      TORCH_CHECK(starts[s] == 0, "sequence ", s, " has a shared part of ", starts[s], " tokens but no group");
    return;
  }
  TORCH_CHECK(starts, "shared-prefix groups need kv_starts");
  TORCH_CHECK(group_block_tables.dim() == 2 && group_block_tables.size(0) >= num_groups,
              "group_block_tables needs a row for each of the ", num_groups, " groups");
  TORCH_CHECK(group_member_start.numel() == num_groups + 1, "group_member_start needs num_groups + 1 entries");
  const int32_t* glens = group_lens.data_ptr<int32_t>();
  const int32_t* gstart = group_member_start.data_ptr<int32_t>();
  const int32_t* members = group_members.numel() ? group_members.data_ptr<int32_t>() : nullptr;
  const int32_t* gtables = group_block_tables.data_ptr<int32_t>();
  TORCH_CHECK(gstart[0] == 0 && gstart[num_groups] == group_members.numel(),
              "group_member_start must span group_members");
  for (int64_t gi = 0; gi < num_groups; ++gi)  // every range inside group_members before any member is read
    TORCH_CHECK(gstart[gi] <= gstart[gi + 1], "group_member_start must not decrease");
  std::vector<int64_t> group_of(num_seqs, -1);
  for (int64_t gi = 0; gi < num_groups; ++gi) {
    TORCH_CHECK(glens[gi] > 0 && glens[gi] <= group_block_tables.size(1) * block_size,
                "group ", gi, ": its block table is too short for ", glens[gi], " tokens");
    check_blocks(gtables + gi * group_block_tables.stride(0), 0, (glens[gi] + block_size - 1) / block_size, "group",
                 gi);
    for (int mi = gstart[gi]; mi < gstart[gi + 1]; ++mi) {
      const int s = members[mi];
      TORCH_CHECK(s >= 0 && s < num_seqs && starts[s] == glens[gi],
                  "group ", gi, ": member ", s, " must be a sequence whose kv_start is the group's length");
      TORCH_CHECK(group_of[s] < 0, "sequence ", s, " is a member of groups ", group_of[s], " and ", gi);
      group_of[s] = gi;
    }
  }
  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(starts[s] == 0 || group_of[s] >= 0, "sequence ", s, " has a shared part of ", starts[s],
                " tokens but no group");
}

void check_int32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.numel() == 0 || (t.scalar_type() == at::kInt && t.is_contiguous() && t.device().is_cpu()),
              name, " must be a contiguous int32 CPU tensor");
}

}  // namespace

// Everything the attention pass reads through, checked before the step's K/V are stored: a call that
// fails leaves the pool as it was.
void check_attention(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& kv_starts, const at::Tensor& group_block_tables, const at::Tensor& group_lens,
                     const at::Tensor& group_member_start, const at::Tensor& group_members, int64_t kv_format) {
  TORCH_CHECK(kv_format >= 0 && kv_format < kKvFormats, "kv_format must be 0 (the model's dtype), 1 (fp8_e4m3), ",
              "2 (fp8_e5m2) or 3 (int8), got ", kv_format);
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [tokens, heads, head_dim], last axis contiguous");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() && v_pool.sizes() == k_pool.sizes(),
              "the KV pools must be contiguous [blocks, block_size, kv_heads, head_dim]");
  if (kv_format) {
    TORCH_CHECK(k_pool.scalar_type() == at::kByte && v_pool.scalar_type() == at::kByte &&
                    k_pool.size(3) == query.size(2) + kKvScaleBytes,
                "a quantized KV pool (kv_format ", kv_format, ") must be uint8 [blocks, block_size, kv_heads, ",
                "head_dim + 2] (head_dim ", query.size(2), ": a last dimension of ", query.size(2) + kKvScaleBytes,
                "), got ", k_pool.scalar_type(), " with a last dimension of ", k_pool.size(3));
    TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16 ||
                    query.scalar_type() == at::kHalf,
                "with a quantized KV pool, query must be float32, bfloat16 or float16, got ", query.scalar_type());
  } else {
    TORCH_CHECK(query.scalar_type() == k_pool.scalar_type(), "query and the pools must share a dtype");
    TORCH_CHECK(query.size(2) == k_pool.size(3), "query and pool head_dim differ");
  }
  TORCH_CHECK(query.size(1) % k_pool.size(2) == 0, "query heads must be a multiple of KV heads");
  check_int32(block_tables, "block_tables");
  check_int32(query_start_loc, "query_start_loc");
  check_int32(seq_lens, "seq_lens");
  check_int32(kv_starts, "kv_starts");
  check_int32(group_block_tables, "group_block_tables");
  check_int32(group_lens, "group_lens");
  check_int32(group_member_start, "group_member_start");
  check_int32(group_members, "group_members");
  TORCH_CHECK(query_start_loc.numel() == seq_lens.numel() + 1, "query_start_loc needs num_seqs + 1 entries");
  check_step_metadata(k_pool.size(0), static_cast<int>(k_pool.size(1)), query.size(0), block_tables, query_start_loc,
                      seq_lens, kv_starts, group_block_tables, group_lens, group_member_start, group_members);
}

}  // namespace kvserve
