// The layout of a staged bias / mask tile (bias_tile.cuh stages it): its element size, rows and
// pitch, and so the shared memory it takes; and whether a call needs more than the bias step. Host and device: the kernel plan (../plan.cpp) sizes
// the kernels' shared memory with it.
#pragma once
#include "../../common/hd.h"
#include "../../params.h"

namespace flashattn::cuda {

// Bytes of one element of a bias of kind k in dtype t (a bool mask: 1).
FLASHATTN_HOST_DEVICE int bias_elem_bytes(BiasKind k, DType t) {
  if (k == BiasKind::kBool) return 1;
  return t == DType::kFloat64 ? 8 : t == DType::kFloat32 ? 4 : 2;
}

// Softcap or ALiBi on: the mods beyond a bias, which the sm80 kernels apply in their general
// per-score step (a bias alone is one add in their plain step).
FLASHATTN_HOST_DEVICE bool mods_beyond_bias(const FwdParams& p) {
  return p.softcap > 0.0 || p.alibi_slopes != nullptr;
}

// One buffer of kRows x kCols bias elements: `rows` is 1 when the bias is broadcast over the
// query rows (a key padding mask), else kRows; rows are `pitch` bytes apart (16-byte aligned,
// 16 past the data so the 8 rows a fragment touches fall in different banks). All zero when
// the call has no bias.
struct BiasTileLayout {
  int elem_bytes = 0, rows = 0, pitch = 0;

  FLASHATTN_HOST_DEVICE int buffer_bytes() const { return rows * pitch; }
  // Byte offset of row r / element (r, c) in a buffer (r is ignored when the rows are broadcast).
  FLASHATTN_HD int row_offset(int r) const { return rows == 1 ? 0 : r * pitch; }
  FLASHATTN_HD int offset(int r, int c) const { return row_offset(r) + c * elem_bytes; }
};

template <int kRows, int kCols>
FLASHATTN_HOST_DEVICE BiasTileLayout bias_tile_layout(const FwdParams& p) {
  static_assert(kCols % 16 == 0, "a row of bool elements is a whole number of 16-byte chunks");
  BiasTileLayout l;
  if (p.bias_kind == BiasKind::kNone) return l;
  l.elem_bytes = bias_elem_bytes(p.bias_kind, p.bias_dtype);
  l.rows = p.bias_stride[2] == 0 ? 1 : kRows;
  l.pitch = kCols * l.elem_bytes + 16;
  return l;
}

}  // namespace flashattn::cuda
