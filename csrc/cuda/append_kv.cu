// The in-place append of a KV-cache step (AppendParams, common/append.h) in one launch.
#include <cstdint>

#include "../common/append.h"
#include "api.h"
#include "common/check.h"

namespace flashattn::cuda {
namespace {

// A block per (sequence, new row), its threads along the row's heads and features (k's, then
// v's), in words of the dtype's size: a decode step appends a few KB, so this is one short launch.
// The block's threads check the sequence's pages together. With no new rows, a block per
// sequence checks its rules and writes its seqused only.
template <class Word>
__global__ void append_kernel(const AppendParams p, int64_t rows) {
  const int64_t b = blockIdx.x / rows, t = blockIdx.x % rows;
  const bool lengths_ok = append_lengths_allowed(p, b);
  bool bad_page = false;
  if (p.block_table && lengths_ok) {
    const PageSpan pages = append_pages(p, b);
    for (int64_t page = pages.first + threadIdx.x; page < pages.end; page += blockDim.x)
      bad_page = bad_page || !block_allowed(p, b, page);
  }
  const bool allowed = !__syncthreads_or(!lengths_ok || bad_page);
  if (t == 0 && threadIdx.x == 0) p.seqused[b] = allowed ? int32_t(p.seqlens[b] + p.len_new) : -1;
  if (!allowed || t >= p.len_new) return;
  const int64_t k_words = p.heads_kv * p.head_dim, all_words = k_words + p.heads_kv * p.head_dim_v;
  for (int64_t i = threadIdx.x; i < all_words; i += blockDim.x) {
    const bool is_k = i < k_words;
    const int64_t dim = is_k ? p.head_dim : p.head_dim_v, j = is_k ? i : i - k_words;
    const int64_t h = j / dim, c = j % dim;
    const Strides& from = is_k ? p.k_stride : p.v_stride;
    const Word* src = static_cast<const Word*>(is_k ? p.k : p.v) + b * from.batch + t * from.row + h * from.head;
    Word* dst = static_cast<Word*>(is_k ? p.k_cache : p.v_cache) +
                append_offset(p, is_k ? p.k_cache_stride : p.v_cache_stride, b, t, h);
    dst[c] = src[c];
  }
}

template <class Word>
void append(const AppendParams& p, cudaStream_t stream) {
  const int64_t rows = p.len_new > 0 ? p.len_new : 1;
  if (grid_too_large(p.batch * rows, "append_kernel")) return;
  append_kernel<Word><<<unsigned(p.batch * rows), 128, 0, stream>>>(p, rows);
  check_launch("append_kernel");
}

}  // namespace

std::string run_append(const AppendParams& p, void* stream) {
  take_error();  // a new call: nothing recorded yet
  if (p.batch == 0) return {};
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype_size(p.dtype)) {
    case 8: append<uint64_t>(p, s); break;
    case 4: append<uint32_t>(p, s); break;
    default: append<uint16_t>(p, s); break;
  }
  return take_error();
}

}  // namespace flashattn::cuda
