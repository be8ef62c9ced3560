// Host side of the TMA copies (common/tma.cuh): tensor maps of the 16-bit (or 8-bit) (batch, heads, rows, dim)
// operands, encoded once per call through the driver's cuTensorMapEncodeTiled (when the kernel plan
// asks whether a kernel can take the call) and passed to the kernel's launch.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>

#include <cstdint>

#include "../../params.h"

namespace flashattn::cuda::sm90 {

// The forward's maps of q, k and v: 64-column boxes of kBM query rows, of kBN keys (sm90/tile_config.h).
struct FwdPanelMaps {
  CUtensorMap q, k, v;
};

// The host's maps of a forward call: the panels, and for a bias of rows (BiasForm::kRows) the map of its
// tiles (encode_row_bias_map), which only that variant's kernel takes.
struct FwdMaps : FwdPanelMaps {
  CUtensorMap bias;
};

// The backward's maps of q, dout (kBM-row boxes), k and v (kBN-row boxes).
struct BwdPanelMaps {
  CUtensorMap q, dout, k, v;
};

// The driver's cuTensorMapEncodeTiled, looked up through the runtime (the extension does not link
// libcuda), or null where the driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
               : nullptr;
  }();
  return encoder;
}

// Whether a call's sizes fit the copies' coordinates (32-bit signed: a batch, head or row index beyond them
// cannot be named; such a call goes to another kernel).
inline bool tma_coords_fit(int64_t batch, int64_t heads_q, int64_t len_q, int64_t len_k) {
  constexpr int64_t kMaxCoord = 0x7fffffff;
  return batch <= kMaxCoord && heads_q <= kMaxCoord && len_q <= kMaxCoord && len_k <= kMaxCoord;
}

// A map of the 16-bit (elem_bytes 1: 8-bit) tensor at `base` (batch, heads, rows, dim; element strides
// `s`, the last dimension contiguous, rows 16-byte aligned) whose box is a 128-byte line (64 or 128
// columns) by `box_rows` rows, 128-byte swizzled: a box lands as one panel of common/wgmma.cuh's layout (the
// smem address 1024-byte aligned), rows past the tensor's end as zeros; line_bytes 64: 64-byte lines, 64-byte
// swizzled (kmajor64_desc). False where the driver refuses the map (the caller then leaves the call to
// another kernel).
inline bool encode_panel_map(CUtensorMap* map, const void* base, const Strides& s, int64_t batch, int64_t heads,
                             int64_t rows, int64_t dim, int box_rows, int elem_bytes = 2, int line_bytes = 128) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  // A dimension of size 1 is never stepped along: its stride is given as a dense layout's, whatever
  // the tensor's (torch may report any stride there).
  const int64_t dense_row = dim * elem_bytes, dense_head = rows * dense_row, dense_batch = heads * dense_head;
  const cuuint64_t sizes[4] = {cuuint64_t(dim), cuuint64_t(rows), cuuint64_t(heads), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {cuuint64_t(rows == 1 ? dense_row : s.row * elem_bytes),
                                 cuuint64_t(heads == 1 ? dense_head : s.head * elem_bytes),
                                 cuuint64_t(batch == 1 ? dense_batch : s.batch * elem_bytes)};
  const cuuint32_t box[4] = {cuuint32_t(line_bytes / elem_bytes), cuuint32_t(box_rows), 1, 1};
  const cuuint32_t element_steps[4] = {1, 1, 1, 1};
  return encode(map, elem_bytes == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(base), sizes, strides, box, element_steps,
                CU_TENSOR_MAP_INTERLEAVE_NONE,
                line_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A map of the bias rows (FwdParams::tma_row_bias: bool or 16-bit values, keys contiguous, the base and the
// strides stepped along 16-byte aligned) over its real extents: (keys, query rows, heads, batch), a dim the
// bias broadcasts (stride 0) of size 1 (the copies' coordinate 0 there). Its box: a panel of keys (128 bytes,
// 64 at 64 bool keys; swizzled alike, so that a consumer lane's reads of its rows fall in distinct banks)
// by 64 query rows; rows and keys past the extents land as zeros (masked scores). False where the
// driver refuses the map (the call then goes to the sm80/ kernels).
inline bool encode_row_bias_map(CUtensorMap* map, const FwdParams& p, int tile_keys) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || !p.tma_row_bias()) return false;
  const int64_t eb = p.bias_kind == BiasKind::kBool ? 1 : 2;
  const int64_t panel_bytes = tile_keys * eb < 128 ? tile_keys * eb : 128;
  const bool heads = p.bias_stride[1] != 0, batch = p.bias_stride[0] != 0;
  const int64_t row = p.bias_stride[2] * eb, head = heads ? p.bias_stride[1] * eb : row * p.len_q;
  const cuuint64_t sizes[4] = {cuuint64_t(p.len_k), cuuint64_t(p.len_q), cuuint64_t(heads ? p.heads_q : 1),
                               cuuint64_t(batch ? p.batch : 1)};
  const cuuint64_t strides[3] = {cuuint64_t(row), cuuint64_t(head),
                                 cuuint64_t(batch ? p.bias_stride[0] * eb : head * int64_t(sizes[2]))};
  const cuuint32_t box[4] = {cuuint32_t(panel_bytes / eb), 64, 1, 1};
  const cuuint32_t element_steps[4] = {1, 1, 1, 1};
  return encode(map, eb == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_UINT16, 4,
                const_cast<void*>(p.bias), sizes, strides, box, element_steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
                panel_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace flashattn::cuda::sm90
