// Small dense products on cache-resident tiles: C (M x N) = or += op(A) (M x K) * B (K x N),
// all row-major with leading dimensions in elements, where op(A) is A (stored M x K) or, for
// gemm_tn, A transposed (stored K x M) -- read in place, since A is only ever broadcast one
// element at a time. N must be a multiple of the panel width (kPanel<A>); the callers pad
// their tiles for that.
#pragma once
#include "vec.h"

namespace flashattn::cpu::FLASHATTN_CPU_ISA {

// A register block is kRows rows of C by two vectors of columns: 12 accumulators, 2 B
// vectors and 1 broadcast fit AVX2's 16 registers; AVX-512's 32 hold 24 (12 rows).
constexpr int kRows = Vec<float>::width == 16 ? 12 : 6;
template <class A>
constexpr int kPanel = 2 * Vec<A>::width;

template <class A, int MR, bool kTransA>
inline void micro_kernel(int64_t K, const A* a, int64_t lda, const A* b, int64_t ldb, A* c, int64_t ldc,
                         bool accumulate) {
  using V = vec_t<A>;
  constexpr int W = Vec<A>::width;
  // The block's sum starts from zero and joins C at the end: long running sums (dK, dV, dQ,
  // O over many tiles) then add one rounded partial sum per tile rather than every term.
  V c0[MR], c1[MR];
  for (int r = 0; r < MR; ++r) c0[r] = c1[r] = V{};
  for (int64_t k = 0; k < K; ++k) {
    const V b0 = vload(b + k * ldb), b1 = vload(b + k * ldb + W);
    for (int r = 0; r < MR; ++r) {
      const V ar = vbroadcast(kTransA ? a[k * lda + r] : a[r * lda + k]);
      c0[r] += ar * b0;
      c1[r] += ar * b1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    vstore(c + r * ldc, accumulate ? vload(c + r * ldc) + c0[r] : c0[r]);
    vstore(c + r * ldc + W, accumulate ? vload(c + r * ldc + W) + c1[r] : c1[r]);
  }
}

// The last M % kRows rows (0 < rows <= MR): one block of that many rows.
template <class A, int MR, bool kTransA>
inline void rest_rows(int rows, int64_t K, const A* a, int64_t lda, const A* b, int64_t ldb, A* c, int64_t ldc,
                      bool accumulate) {
  if constexpr (MR > 1) {
    if (rows < MR) return rest_rows<A, MR - 1, kTransA>(rows, K, a, lda, b, ldb, c, ldc, accumulate);
  }
  micro_kernel<A, MR, kTransA>(K, a, lda, b, ldb, c, ldc, accumulate);
}

template <class A, bool kTransA>
void gemm_any(int64_t M, int64_t N, int64_t K, const A* a, int64_t lda, const A* b, int64_t ldb, A* c, int64_t ldc,
              bool accumulate) {
  constexpr int NR = kPanel<A>;
  for (int64_t j = 0; j < N; j += NR) {
    int64_t i = 0;
    for (; i + kRows <= M; i += kRows)
      micro_kernel<A, kRows, kTransA>(K, kTransA ? a + i : a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc,
                                      accumulate);
    if (i < M) rest_rows<A, kRows - 1, kTransA>(int(M - i), K, kTransA ? a + i : a + i * lda, lda, b + j, ldb,
                                              c + i * ldc + j, ldc, accumulate);
  }
}

// C = or += A B
template <class A>
void gemm(int64_t M, int64_t N, int64_t K, const A* a, int64_t lda, const A* b, int64_t ldb, A* c, int64_t ldc,
          bool accumulate) {
  gemm_any<A, false>(M, N, K, a, lda, b, ldb, c, ldc, accumulate);
}

// C = or += A^T B, with A stored K x M
template <class A>
void gemm_tn(int64_t M, int64_t N, int64_t K, const A* a, int64_t lda, const A* b, int64_t ldb, A* c, int64_t ldc,
             bool accumulate) {
  gemm_any<A, true>(M, N, K, a, lda, b, ldb, c, ldc, accumulate);
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
