// Where the backward's atomic dQ accumulator keeps element (row, col). Rows are the stored rows
// of the q-shaped tensors ((batch, head, m) order, a varlen batch one run of total_q rows).
//   RowMajor: rows of `cols` (= head_dim) values, as the SIMT and fp64 kernels add them.
//   Blocked:  the fp32 accumulator of the fp16/bf16 tensor-core kernels, laid out as mma.sync's
//             accumulator atoms hold dQ: 16 rows x 8 columns lie together (512 bytes), lane
//             4 g + t's four values (rows g and g + 8, columns 2t and 2t + 1) in 16 bytes at
//             slot 4 g + t. A warp adds an atom of a 16-row-aligned group with one 4-wide
//             atomic per lane taken straight from its accumulator registers: no shuffles,
//             selects or moves, and one address per atom.
//             Rows are padded to a multiple of 16 and columns to one of 8 (size).
#pragma once
#include <cstdint>
#include <type_traits>

#include "../../common/hd.h"

namespace flashattn::cuda {

struct DqRowMajor {
  static constexpr int kRun = 4;  // adjacent columns that lie together from a multiple of kRun
  int64_t cols;
  FLASHATTN_HD int64_t offset(int64_t row, int col) const { return row * cols + col; }
};

struct DqBlocked {
  int64_t cols_padded;  // head_dim rounded up to 8
  FLASHATTN_HD explicit DqBlocked(int64_t head_dim) : cols_padded((head_dim + 7) / 8 * 8) {}
  FLASHATTN_HD int64_t offset(int64_t row, int col) const {
    const int slot = int(row & 7) * 4 + ((col >> 1) & 3);
    return (row >> 4) * 16 * cols_padded + (col >> 3) * 128 + slot * 4 + int((row >> 3) & 1) * 2 + (col & 1);
  }
  // Elements of a blocked accumulator of `rows` rows.
  FLASHATTN_HD int64_t size(int64_t rows) const { return (rows + 15) / 16 * 16 * cols_padded; }
};

// The layout the tensor-core kernels add into, by accumulator type (fp32: fp16/bf16 inputs).
template <class Acc>
using TensorCoreDqLayout = std::conditional_t<std::is_same_v<Acc, float>, DqBlocked, DqRowMajor>;

}  // namespace flashattn::cuda
