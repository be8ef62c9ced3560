// The rules of a KV-cache append (AppendParams), shared by the CPU and CUDA backends: whether a
// sequence's values allow its append, and where each of its new rows goes.
#pragma once
#include <cstdint>

#include "../params.h"
#include "hd.h"

namespace flashattn {

// Sequence b may append: 0 <= seqlens[b], seqlens[b] + len_new <= cache_len, its cache row in
// [0, cache_rows) (batch_idx), the blocks of the pages it writes in [0, cache_rows) (paged).
// Values are read here only, on the device that holds them: a sequence that breaks a rule writes
// nothing, so no unchecked value addresses memory outside the caches.
FLASHATTN_HD bool append_allowed(const AppendParams& p, int64_t b) {
  const int64_t start = p.seqlens[b], end = start + p.len_new;
  if (start < 0 || end > p.cache_len) return false;
  if (p.batch_idx) return p.batch_idx[b] >= 0 && p.batch_idx[b] < p.cache_rows;
  if (p.block_table && end > start) {
    for (int64_t page = start / p.page_size; page <= (end - 1) / p.page_size; ++page) {
      const int64_t block = p.block_table[b * p.block_table_stride + page];
      if (block < 0 || block >= p.cache_rows) return false;
    }
  }
  return true;
}

// Element offset, in a cache with strides s, of head h of new row t of sequence b (one that
// append_allowed).
FLASHATTN_HD int64_t append_offset(const AppendParams& p, const Strides& s, int64_t b, int64_t t, int64_t h) {
  const int64_t key = p.seqlens[b] + t;
  if (p.block_table) {
    const int64_t page = key / p.page_size;
    return p.block_table[b * p.block_table_stride + page] * s.batch + (key - page * p.page_size) * s.row + h * s.head;
  }
  return (p.batch_idx ? p.batch_idx[b] : b) * s.batch + key * s.row + h * s.head;
}

}  // namespace flashattn
