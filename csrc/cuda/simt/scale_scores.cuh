// The fp32 forward kernels' score step: a thread's scores s[i][j] (query row m0 + r + kStepI i,
// key n0 + c + kStepJ j) times the score scale, or -inf where the key is not visible.
#pragma once
#include <cstdint>
#include <type_traits>

#include "../../common/sequence.h"
#include "../common/numeric.cuh"

namespace flashattn::cuda::simt {

// A key tile of kKeys keys that every row of the block (rows from m0 on) sees in full (most tiles)
// takes a copy of the loop without the per-element mask: as one loop with a run-time test, ptxas
// branched around every element's compares.
template <int kStepI, int kStepJ, int kKeys, int kTI, int kTJ>
__device__ __forceinline__ void scale_scores(float (&s)[kTI][kTJ], float score_scale, const FwdParams& p,
                                             const Seq& sq, int64_t m0, int64_t n0, int r, int c) {
  auto scale = [&](auto masked) {
#pragma unroll
    for (int i = 0; i < kTI; ++i)
#pragma unroll
      for (int j = 0; j < kTJ; ++j) {
        bool vis = true;
        if constexpr (decltype(masked)::value) {
          const int64_t m = m0 + r + kStepI * i, n = n0 + c + kStepJ * j;
          vis = n < p.len_k && sq.band.visible(m, n);
        }
        s[i][j] = vis ? s[i][j] * score_scale : neg_inf<float>();
      }
  };
  if (n0 + kKeys <= sq.key_end(m0)) scale(std::false_type{}); else scale(std::true_type{});
}

}  // namespace flashattn::cuda::simt
