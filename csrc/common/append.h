// The rules of a KV-cache append (AppendParams), shared by the CPU and CUDA backends: whether a
// sequence's values allow its step, and where each of its new rows goes. Values are read here
// only, on the device that holds them: a sequence that breaks a rule writes nothing, so no
// unchecked value addresses memory outside the caches.
#pragma once
#include <cstdint>

#include "../params.h"
#include "hd.h"
#include "rotary.h"

namespace flashattn {

// The rules of sequence b that need no page: 0 <= seqlens[b], seqlens[b] + len_new <= cache_len,
// 0 <= leftpad[b] <= seqlens[b], its cache row in [0, cache_rows) (batch_idx), and with rotary
// tables every position it uses a row of them (common/rotary.h).
FLASHATTN_HD bool append_lengths_allowed(const AppendParams& p, int64_t b) {
  const int64_t start = p.seqlens[b], end = start + p.len_new;
  if (start < 0 || end > p.cache_len || !rotary_positions_allowed(p, b)) return false;
  if (p.leftpad && (p.leftpad[b] < 0 || p.leftpad[b] > start)) return false;
  return !p.batch_idx || (p.batch_idx[b] >= 0 && p.batch_idx[b] < p.cache_rows);
}

// The pages [first, end) that hold keys of sequence b after its append (keys leftpad[b] ..
// seqlens[b] + len_new - 1): the ones whose blocks must be in [0, cache_rows) (paged caches; a
// sequence whose lengths are allowed).
struct PageSpan {
  int64_t first, end;
};
FLASHATTN_HD PageSpan append_pages(const AppendParams& p, int64_t b) {
  const int64_t lo = p.leftpad ? p.leftpad[b] : 0, keys_end = p.seqlens[b] + p.len_new;
  return PageSpan{lo / p.page_size, keys_end > lo ? (keys_end + p.page_size - 1) / p.page_size : lo / p.page_size};
}
FLASHATTN_HD bool block_allowed(const AppendParams& p, int64_t b, int64_t page) {
  const int64_t block = p.block_table[b * p.block_table_stride + page];
  return block >= 0 && block < p.cache_rows;
}

// Element offset, in a cache with strides s, of head h of new row t of sequence b (an allowed one).
FLASHATTN_HD int64_t append_offset(const AppendParams& p, const Strides& s, int64_t b, int64_t t, int64_t h) {
  const int64_t key = p.seqlens[b] + t;
  if (p.block_table) {
    const int64_t page = key / p.page_size;
    return p.block_table[b * p.block_table_stride + page] * s.batch + (key - page * p.page_size) * s.row + h * s.head;
  }
  return (p.batch_idx ? p.batch_idx[b] : b) * s.batch + key * s.row + h * s.head;
}

}  // namespace flashattn
