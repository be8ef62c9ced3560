// The head-dim tiers of the SIMT kernels (simt/): the output columns a block takes, powers of two from `low`
// to `cap`; wider dims are cut into column slices of the cap. Plain C++ (no CUDA header): the plan
// (../plan.cpp, built in the CPU extension too) chooses a tier through it and dispatch.cu launches that
// tier's kernel through on_simt_tier, so both know the same tiers (scripts/generate_kernels.py instantiates
// them). fp64's kernels run only where the fp64 tensor-core ones decline a call (sm_75, 99 KB GPUs, dims
// above 128, unaligned operands): one tier each way.
#pragma once
#include <cstdint>
#include <type_traits>

namespace flashattn::cuda::simt {

struct Tiers {
  int low, cap;
};
constexpr Tiers fwd_tiers(bool fp64) { return fp64 ? Tiers{128, 128} : Tiers{32, 256}; }
constexpr Tiers bwd_tiers(bool fp64) { return fp64 ? Tiers{64, 64} : Tiers{32, 128}; }

// The smallest tier >= dim, or the cap.
constexpr int tier_of(int64_t dim, Tiers t) {
  int tier = t.low;
  while (tier < dim && tier < t.cap) tier *= 2;
  return tier;
}

// Calls run(std::integral_constant<int, tier>) for a tier from kLow to kCap and returns what it returns;
// false for a tier outside them.
template <int kLow, int kCap, class Run>
bool on_simt_tier(int tier, Run&& run) {
  using std::integral_constant;
  switch (tier) {
    case 32:
      if constexpr (kLow <= 32) return run(integral_constant<int, 32>{});
      return false;
    case 64:
      if constexpr (kLow <= 64 && kCap >= 64) return run(integral_constant<int, 64>{});
      return false;
    case 128:
      if constexpr (kLow <= 128 && kCap >= 128) return run(integral_constant<int, 128>{});
      return false;
    case 256:
      if constexpr (kCap >= 256) return run(integral_constant<int, 256>{});
      return false;
  }
  return false;
}

}  // namespace flashattn::cuda::simt
