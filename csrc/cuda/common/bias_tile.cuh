// The attention bias / mask of a (query tile, key tile) staged in shared memory next to the
// operand tiles and double-buffered like them, so the kernels read it with shared loads (the
// load of the next tile overlapping this one's products) instead of a dependent global load
// per score. Rows are query rows, columns keys, as stored.
#pragma once
#include <cstdint>

#include "../../params.h"
#include "bias_tile_layout.h"
#include "cp_async.cuh"
#include "features.cuh"
#include "numeric.cuh"
#include "online_softmax.cuh"

namespace flashattn::cuda {

// Whether the bias rows can be copied in 16-byte chunks: keys contiguous and every row start
// 16-byte aligned (else the tile is staged element by element).
__host__ __device__ inline bool bias_rows_chunked(const FwdParams& p) {
  const int64_t e = bias_elem_bytes(p.bias_kind, p.bias_dtype);
  return p.bias_stride[3] == 1 && reinterpret_cast<uintptr_t>(p.bias) % 16 == 0 &&
         p.bias_stride[0] * e % 16 == 0 && p.bias_stride[1] * e % 16 == 0 && p.bias_stride[2] * e % 16 == 0;
}

// Stages bias rows [m0, m0 + rows_valid) x keys [n0, n0 + cols_valid) of (sequence, query
// head h) into `dst`; the rest of the buffer is zero (masked out / a 0 bias), so the
// readers need no bounds test. Chunked copies go through cp.async (the caller commits them
// with its tile); the element-wise path stores directly, visible after the caller's next
// __syncthreads as the cp.async data is.
template <int kRows, int kCols, int kThreads>
__device__ __forceinline__ void stage_bias_tile(unsigned char* dst, const BiasTileLayout& l, bool chunked,
                                                const FwdParams& p, const Seq& sq, int64_t h, int64_t m0,
                                                int64_t n0, int rows_valid, int cols_valid, int tid) {
  const unsigned char* src = bias_element(p, sq, h, m0, n0);
  const int64_t row_bytes = p.bias_stride[2] * l.elem_bytes;
  if (chunked) {
    const int chunks_per_row = kCols * l.elem_bytes / 16;
    const int shift = __ffs(chunks_per_row) - 1;  // a power of two
    const int valid_bytes = cols_valid * l.elem_bytes;
    for (int i = tid; i < l.rows * chunks_per_row; i += kThreads) {
      const int r = i >> shift, c = (i & (chunks_per_row - 1)) * 16;
      const int left = valid_bytes - c;
      const int bytes = r >= rows_valid || left <= 0 ? 0 : left > 16 ? 16 : left;
      cp_async_16_part(dst + r * l.pitch + c, bytes > 0 ? src + r * row_bytes + c : src, bytes);
    }
    return;
  }
  const int64_t col_bytes = p.bias_stride[3] * l.elem_bytes;
  for (int i = tid; i < l.rows * kCols; i += kThreads) {
    const int r = i / kCols, c = i % kCols;
    const bool ok = r < rows_valid && c < cols_valid;
    const unsigned char* s = src + r * row_bytes + c * col_bytes;
    unsigned char* d = dst + r * l.pitch + c * l.elem_bytes;
    switch (l.elem_bytes) {
      case 1: *d = ok ? *s : 0; break;
      case 2: *reinterpret_cast<uint16_t*>(d) = ok ? *reinterpret_cast<const uint16_t*>(s) : 0; break;
      case 4: *reinterpret_cast<uint32_t*>(d) = ok ? *reinterpret_cast<const uint32_t*>(s) : 0; break;
      default: *reinterpret_cast<uint64_t*>(d) = ok ? *reinterpret_cast<const uint64_t*>(s) : 0; break;
    }
  }
}

}  // namespace flashattn::cuda
