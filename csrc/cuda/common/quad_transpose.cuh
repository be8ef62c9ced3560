// A 4 x 4 transpose of 4-byte words across the four lanes of a quad (lanes 4 g .. 4 g + 3). The tensor cores'
// accumulator layouts give a lane two adjacent columns of every 8; after the transpose a lane holds 8 adjacent
// columns (16 bytes of 16-bit values), which one store or load moves.
#pragma once
#include <cstdint>

namespace flashattn::cuda {

// Before: lane t's w[k] is word (t, k). After: lane t's w[k] is word (k, t), the one lane k held at w[t]. Two
// butterfly steps (bit 1 of the lane swapped with bit 1 of k, then bit 0 with bit 0): a shuffle and two selects per
// word moved. Every lane of the warp takes part.
__device__ __forceinline__ void transpose_quad_words(uint32_t (&w)[4], int lane) {
  const bool hi = (lane & 2) != 0, odd = (lane & 1) != 0;
#pragma unroll
  for (int k0 = 0; k0 < 2; ++k0) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, hi ? w[k0] : w[2 + k0], 2);
    w[k0] = hi ? got : w[k0];
    w[2 + k0] = hi ? w[2 + k0] : got;
  }
#pragma unroll
  for (int k1 = 0; k1 < 2; ++k1) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? w[2 * k1] : w[2 * k1 + 1], 1);
    w[2 * k1] = odd ? got : w[2 * k1];
    w[2 * k1 + 1] = odd ? w[2 * k1 + 1] : got;
  }
}

}  // namespace flashattn::cuda
