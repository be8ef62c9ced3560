// Register-blocked products on smem tiles. Thread (r, c) (see tile_config.cuh) accumulates a
// 4-row block: rows r*4+i of A against B columns chosen by c. A operands are read 16 bytes at
// a time and are the same for the 16 lanes of a row group (broadcast); B operands are spread
// over the lanes of a quarter-warp without bank conflicts.
#pragma once
#include "smem_vec.cuh"

namespace flashattn::cuda::simt {

// acc[i][j] += sum_k A[r*4+i][k] * B[c+16j][k], k < kmax (rounded up to 4; smem is zero there).
// Scores S = Q K^T and dP = dO V^T.
template <int kK, int kTN, class Acc>
__device__ __forceinline__ void gemm_rows_x_rows(Acc (&acc)[4][kTN], const Acc* A, int lda,
                                                 const Acc* B, int ldb, int kmax, int r, int c) {
  const Acc* a0 = A + r * 4 * lda;
  const Acc* b0 = B + c * ldb;
#pragma unroll 2
  for (int k = 0; k < kK; k += 4) {
    if (k < kmax) {
      Acc a[4][4], b[kTN][4];
#pragma unroll
      for (int i = 0; i < 4; ++i) lds(a[i], a0 + i * lda + k);
#pragma unroll
      for (int j = 0; j < kTN; ++j) lds(b[j], b0 + 16 * j * ldb + k);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < kTN; ++j) acc[i][j] = fma(a[i][kk], b[j][kk], acc[i][j]);
    }
  }
}

// acc[i][e] += sum_k At[k][r*4+i] * B[k][c*kVec+e]: A stored transposed (k-major).
// O += P V and dQ += dS K with P/dS kept as [key][query].
template <int kK, int kVec, class Acc>
__device__ __forceinline__ void gemm_cols_x_rows(Acc (&acc)[4][kVec], const Acc* At, int lda,
                                                 const Acc* B, int ldb, int r, int c) {
  const Acc* a0 = At + r * 4;
  const Acc* b0 = B + c * kVec;
#pragma unroll 8
  for (int k = 0; k < kK; ++k) {
    Acc a[4], b[kVec];
    lds(a, a0 + k * lda);
    lds(b, b0 + k * ldb);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[i][e] = fma(a[i], b[e], acc[i][e]);
  }
}

// acc[i][e] += sum_k A[r*4+i][k] * B[k][c*kVec+e]: A row-major.
// dV += P^T dO and dK += dS^T Q with P/dS kept as [key][query].
template <int kK, int kVec, class Acc>
__device__ __forceinline__ void gemm_rows_x_cols(Acc (&acc)[4][kVec], const Acc* A, int lda,
                                                 const Acc* B, int ldb, int r, int c) {
  const Acc* a0 = A + r * 4 * lda;
  const Acc* b0 = B + c * kVec;
#pragma unroll 2
  for (int k = 0; k < kK; k += 4) {
    Acc a[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) lds(a[i], a0 + i * lda + k);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      Acc b[kVec];
      lds(b, b0 + (k + kk) * ldb);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[i][e] = fma(a[i][kk], b[e], acc[i][e]);
    }
  }
}

// The large-tile kernels' variant (fwd_simt_qres, bwd_simt_kvres): a thread's rows are
// interleaved, r + kStepA i, and the depth is the tile's full width kDepth, a compile-time
// constant, so that four steps are scheduled together (fp32 forward +2-10%, backward +2% over a
// run-time depth unrolled by 2; H200).
// acc[i][j] += sum_d A[r + kStepA i][d] * B[c + kStepB j][d] over d < kDepth, for the rows
// kI0 <= i < kI1 only (callers skip rows that see none of B's keys); rows are kLd apart and zero
// past the operands' true width (the copies fill them so). kUnroll: steps of 4 dims unrolled.
// kLdB: B's row pitch where it differs from A's.
template <int kTI, int kTJ, int kLd, int kStepA, int kDepth, int kI0 = 0, int kI1 = kTI, int kStepB = 16, int kUnroll = 4,
          int kLdB = kLd>
__device__ __forceinline__ void gemm_rows_x_rows_interleaved(float (&acc)[kTI][kTJ], const float* A, const float* B,
                                                             int r, int c) {
  const float* a0 = A + r * kLd;
  const float* b0 = B + c * kLdB;
#pragma unroll kUnroll
  for (int d = 0; d < kDepth; d += 4) {
    float a[kTI][4], b[kTJ][4];
#pragma unroll
    for (int i = kI0; i < kI1; ++i) lds(a[i], a0 + kStepA * i * kLd + d);
#pragma unroll
    for (int j = 0; j < kTJ; ++j) lds(b[j], b0 + kStepB * j * kLdB + d);
#pragma unroll
    for (int dd = 0; dd < 4; ++dd)
#pragma unroll
      for (int i = kI0; i < kI1; ++i)
#pragma unroll
        for (int j = 0; j < kTJ; ++j) acc[i][j] = fmaf(a[i][dd], b[j][dd], acc[i][j]);
  }
}

}  // namespace flashattn::cuda::simt
