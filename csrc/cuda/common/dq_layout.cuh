// Where the backward's atomic dQ accumulator keeps element (row, col). Rows are the stored rows
// of the q-shaped tensors ((batch, head, m) order, a varlen batch one run of total_q rows).
//   RowMajor: rows of `cols` (= head_dim) values, as the SIMT and fp64 kernels add them.
//   Blocked:  the fp32 accumulator of the fp16/bf16 tensor-core kernels. 8 rows x 16 columns
//             lie together (512 bytes), ordered as one warp's 4-wide atomics hold them: lane
//             4 g + s of an mma accumulator row group adds 4 adjacent columns of row g, s being
//             the column quarter with its two bits swapped (quarters 0, 2, 1, 3 go to lanes
//             s = 0, 1, 2, 3: the quad's even lanes hold the first 8 columns, its odd lanes the
//             last 8, after one shuffle). One atomic instruction then covers 512 contiguous
//             bytes instead of 64-byte pieces of 8 rows: +1-4% on the backward (H200, bf16).
//             Rows are padded to a multiple of 8 and columns to one of 16 (blocked_size).
#pragma once
#include <cstdint>
#include <type_traits>

#include "../../common/hd.h"

namespace flashattn::cuda {

struct DqRowMajor {
  int64_t cols;
  FLASHATTN_HD int64_t offset(int64_t row, int col) const { return row * cols + col; }
  FLASHATTN_HD int64_t eight_rows() const { return 8 * cols; }  // offset(row + 8, c) - offset(row, c)
};

struct DqBlocked {
  int64_t cols_padded;  // head_dim rounded up to 16
  FLASHATTN_HD explicit DqBlocked(int64_t head_dim) : cols_padded((head_dim + 15) / 16 * 16) {}
  FLASHATTN_HD int64_t offset(int64_t row, int col) const {
    const int quarter = (col >> 2) & 3;
    const int slot = int(row & 7) * 4 + ((quarter & 1) << 1) + (quarter >> 1);
    return (row >> 3) * 8 * cols_padded + (col >> 4) * 128 + slot * 4 + (col & 3);
  }
  FLASHATTN_HD int64_t eight_rows() const { return 8 * cols_padded; }  // offset(row + 8, c) - offset(row, c)
  // Elements of a blocked accumulator of `rows` rows.
  FLASHATTN_HD int64_t size(int64_t rows) const { return (rows + 7) / 8 * 8 * cols_padded; }
};

// The layout the tensor-core kernels add into, by accumulator type (fp32: fp16/bf16 inputs).
template <class Acc>
using TensorCoreDqLayout = std::conditional_t<std::is_same_v<Acc, float>, DqBlocked, DqRowMajor>;

}  // namespace flashattn::cuda
