// Paged k / v (FwdParams::block_table): where a key row sits, and the padded copy that kernels
// which do not read pages take instead (the backends gather it into the workspace).
#pragma once
#include <cstddef>
#include <cstdint>

#include "../params.h"
#include "hd.h"
#include "sequence.h"

namespace flashattn {

// The page that holds key row j of a sequence (counted from the start of its cache). A 32-bit
// division where the rows allow (every cache in practice): a 64-bit one is a long instruction
// sequence on the GPU.
FLASHATTN_HD int64_t page_of(const FwdParams& p, int64_t j) {
  return p.len_k <= INT32_MAX ? int64_t(uint32_t(j) / uint32_t(p.page_size)) : j / p.page_size;
}

// The block of sequence b's page `page` (< pages per sequence), clamped into the tensor.
FLASHATTN_HD int64_t block_of(const FwdParams& p, int64_t b, int64_t page) {
  return clamp_to(p.block_table[b * p.block_table_stride + page], 0, p.num_blocks - 1);
}
// The same, out_of_range set where the table's entry lies outside [0, num_blocks) (left as it is otherwise):
// the clamped block is still read, so that the rule costs no branch around the copies (FwdParams::check_pages).
FLASHATTN_HD int64_t block_of(const FwdParams& p, int64_t b, int64_t page, bool& out_of_range) {
  const int64_t block = p.block_table[b * p.block_table_stride + page];
  out_of_range = out_of_range | (block < 0) | (block >= p.num_blocks);
  return clamp_to(block, 0, p.num_blocks - 1);
}

// Element offset of key row j (counted from the start of sequence b's cache) of head h in a
// paged k- or v-shaped operand with strides s.
FLASHATTN_HD int64_t paged_row(const FwdParams& p, const Strides& s, int64_t b, int64_t h, int64_t j) {
  const int64_t page = page_of(p, j);
  return block_of(p, b, page) * s.batch + h * s.head + (j - page * p.page_size) * s.row;
}

// The gathered copy: k then v as contiguous (batch, heads_kv, len_k, dim) tensors, each starting
// on a 256-byte boundary of the workspace.
inline size_t gathered_part_bytes(const FwdParams& p, int64_t dim) {
  return (size_t(p.batch * p.heads_kv * p.len_k * dim) * dtype_size(p.dtype) + 255) / 256 * 256;
}
inline size_t gathered_bytes(const FwdParams& p) {
  return gathered_part_bytes(p, p.head_dim) + gathered_part_bytes(p, p.head_dim_v);
}

// p reading the gathered copy at `ws` (gathered_bytes long) instead of the pages; the rest of
// the workspace (past the copy) is left for the kernels.
inline FwdParams with_gathered_pages(const FwdParams& p) {
  FwdParams g = p;
  char* ws = static_cast<char*>(p.workspace);
  g.k = ws;
  g.v = ws + gathered_part_bytes(p, p.head_dim);
  g.k_stride = Strides{p.heads_kv * p.len_k * p.head_dim, p.len_k * p.head_dim, p.head_dim};
  g.v_stride = Strides{p.heads_kv * p.len_k * p.head_dim_v, p.len_k * p.head_dim_v, p.head_dim_v};
  g.block_table = nullptr;
  g.block_table_stride = g.page_size = g.num_blocks = 0;
  const size_t used = gathered_bytes(p);
  g.workspace = p.workspace_bytes > used ? ws + used : nullptr;
  g.workspace_bytes = p.workspace_bytes > used ? p.workspace_bytes - used : 0;
  return g;
}

}  // namespace flashattn
