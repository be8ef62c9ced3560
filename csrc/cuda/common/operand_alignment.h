// Host checks of the operand addresses the tensor-core kernels rely on: rows copied in 16-byte
// chunks, outputs written two adjacent elements at a time. Plain C++ (no CUDA header), so that
// the dispatch and the kernel plan ask the same question.
#pragma once
#include <cstddef>
#include <cstdint>

#include "../../params.h"

namespace flashattn::cuda {

// Every address the copies form is 16-byte aligned.
inline bool rows_aligned_16(const void* base, int64_t s0, int64_t s1, int64_t s2, int64_t cols, size_t elem_bytes) {
  const int64_t chunk = 16 / int64_t(elem_bytes);
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && s0 % chunk == 0 && s1 % chunk == 0 && s2 % chunk == 0 &&
         cols % chunk == 0;
}

// Outputs are written two adjacent elements at a time.
inline bool pairs_aligned(const void* base, const Strides& s, size_t elem_bytes) {
  return reinterpret_cast<uintptr_t>(base) % (2 * elem_bytes) == 0 && s.batch % 2 == 0 && s.head % 2 == 0 &&
         s.row % 2 == 0;
}

// The forward's q, k, v read and out written in 16-byte chunks.
inline bool fwd_operands_aligned(const FwdParams& p) {
  const size_t e = dtype_size(p.dtype);
  return rows_aligned_16(p.q, p.q_stride.batch, p.q_stride.head, p.q_stride.row, p.head_dim, e) &&
         rows_aligned_16(p.k, p.k_stride.batch, p.k_stride.head, p.k_stride.row, p.head_dim, e) &&
         rows_aligned_16(p.v, p.v_stride.batch, p.v_stride.head, p.v_stride.row, p.head_dim_v, e) &&
         rows_aligned_16(p.out, p.out_stride.batch, p.out_stride.head, p.out_stride.row, p.head_dim_v, e);
}

// The backward's q, k, v, dO read in 16-byte chunks, dk, dv written in pairs, and dq written 16 bytes
// at a time from the accumulator the tensor-core kernels fill (simt/bwd_simt_prepost.cu compiles no
// element-wise conversion of their fp16 / bf16 layout).
inline bool bwd_operands_aligned(const BwdParams& p) {
  const size_t e = dtype_size(p.dtype);
  return rows_aligned_16(p.q, p.q_stride.batch, p.q_stride.head, p.q_stride.row, p.head_dim, e) &&
         rows_aligned_16(p.k, p.k_stride.batch, p.k_stride.head, p.k_stride.row, p.head_dim, e) &&
         rows_aligned_16(p.v, p.v_stride.batch, p.v_stride.head, p.v_stride.row, p.head_dim_v, e) &&
         rows_aligned_16(p.dout, p.dout_stride.batch, p.dout_stride.head, p.dout_stride.row, p.head_dim_v, e) &&
         rows_aligned_16(p.dq, p.dq_stride.batch, p.dq_stride.head, p.dq_stride.row, p.head_dim, e) &&
         pairs_aligned(p.dk, p.dk_stride, e) && pairs_aligned(p.dv, p.dv_stride, e);
}

// The Hopper dK/dV kernel's dk and dv written 16 bytes at a time (sm90/bwd_sm90.cuh: bwd_ws_store_dkdv).
inline bool bwd_dkdv_rows_aligned_16(const BwdParams& p) {
  const size_t e = dtype_size(p.dtype);
  return rows_aligned_16(p.dk, p.dk_stride.batch, p.dk_stride.head, p.dk_stride.row, p.head_dim, e) &&
         rows_aligned_16(p.dv, p.dv_stride.batch, p.dv_stride.head, p.dv_stride.row, p.head_dim_v, e);
}

}  // namespace flashattn::cuda
