// Tile shapes of the SIMT kernels that keep one operand tile resident in shared memory (the
// Q-resident and warp-specialized forwards, the K-resident dK/dV kernel). Plain C++ (no CUDA
// header): the kernel plan (../plan.cpp) reads their shared-memory sizes too.
#pragma once
#include <cstddef>
#include <cstdint>

namespace flashattn::cuda::simt {

template <int kDim, bool kTf32Pv, int kKeys>
struct QresTraits {
  static constexpr int kThreads = 256;
  static constexpr int kRowGroups = kThreads / 16;
  static constexpr int kTM = 8;  // query rows per thread
  static constexpr int kBlockM = kRowGroups * kTM;
  static constexpr int kBlockN = kKeys;
  static constexpr int kTN = kBlockN / 16;  // key columns per thread
  static constexpr int kCG = kDim / 64;     // groups of 4 output columns per thread
  static constexpr int kLd = kDim + 4;      // Q, K, V rows: 16-byte padding, conflict-free
  // P rows: 16 banks of padding so the two row groups' scalar stores use disjoint banks; with
  // kTf32Pv 8, so that a warp's float2 reads of 8 rows x 4 key pairs take the two wavefronts
  // 256 bytes need.
  static constexpr int kLdP = kBlockN + (kTf32Pv ? 8 : 16);
  // kTf32Pv: the low TF32 halves of V (a second V buffer) and a float per row (alpha, then 1 / l).
  static constexpr size_t kSmemBytes =
      size_t((kBlockM + (kTf32Pv ? 3 : 2) * kBlockN) * kLd + kBlockM * kLdP + (kTf32Pv ? kBlockM : 0)) *
      sizeof(float);
  static_assert(kDim % 64 == 0, "output columns come in 64-wide groups");
};

template <int kDim>
struct WsTraits {
  static constexpr int kScoreThreads = 128, kPvThreads = 256, kThreads = kScoreThreads + kPvThreads;
  static constexpr int kBlockM = 128, kBlockN = 64;
  static constexpr int kTM = 8, kTN = 8;  // a score thread's rows and keys
  // Unroll of the score product over dims. 1: 140 bytes of spills (sm_90), the fastest; 2 and 4
  // (172 / 212 bytes) measured 0.1-1% / 4-5% slower on the H200.
  static constexpr int kScoreUnroll = 1;
  static constexpr int kLd = kDim + 4;    // Q, K, V rows: 16-byte padding, conflict-free
  // P rows: 8 banks of padding, so that a score warp's stores (4 rows x 8 keys) and a P V warp's
  // float2 reads (8 rows x 4 key pairs) are conflict-free.
  static constexpr int kLdP = kBlockN + 8;
  // Q, K, two V buffers, P, a float per row (alpha, then 1 / l) and the two mbarriers.
  static constexpr size_t kSmemBytes =
      size_t((kBlockM + 3 * kBlockN) * kLd + kBlockM * kLdP + kBlockM) * sizeof(float) + 2 * sizeof(uint64_t);
  static_assert(kBlockM == 16 * kTM && kBlockN == 8 * kTN && kScoreThreads == 16 * 8, "score thread grid");
};

template <int kDim>
struct KvresTraits {
  static constexpr int kThreads = 256;
  static constexpr int kTK = kDim == 64 ? 8 : 6;  // key rows per thread (registers and smem cap it)
  static constexpr int kBlockN = 16 * kTK;
  static constexpr int kBlockM = 64;
  static constexpr int kTQ = kBlockM / 16;  // query columns (and dQ rows) per thread
  static constexpr int kCG = kDim / 64;     // groups of 4 output columns per thread
  static constexpr int kLd = kDim + 4;      // Q, K, V, dO rows: 16-byte padding, conflict-free
  // P^T / dS^T rows: 16 banks of padding so the two row groups' scalar stores use disjoint banks.
  static constexpr int kLdP = kBlockM + 16;
  // kTf32Dq: dQ += dS K on the tensor cores (sm_80+; every GPU with the smem for this kernel) as
  // three TF32 products (pv_tf32x3.cuh explains the split), K's low halves split once per block
  // into a second buffer. Only at dim 64 (H200: backward +3..+6.5%): at 128 that buffer does not
  // fit beside 96-key tiles, and K split as read measured -1.4..-4.5% against the FMA product.
  // K rows then 8 banks apart, so that the MMA's B reads (4 keys x 8 dims) are conflict-free.
  static constexpr bool kTf32Dq = kDim == 64;
  static constexpr int kLdK = kTf32Dq ? kDim + 8 : kLd;
  static constexpr size_t kSmemBytes =
      size_t((kTf32Dq ? 2 : 1) * kBlockN * kLdK + kBlockN * kLd + 2 * kBlockM * kLd + 2 * kBlockN * kLdP) *
      sizeof(float);
  static_assert(kDim % 64 == 0, "output columns come in 64-wide groups");
};

}  // namespace flashattn::cuda::simt
