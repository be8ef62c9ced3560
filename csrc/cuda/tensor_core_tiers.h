// The head-dim tiers of the tensor-core kernels (sm80/, sm90/): the dims their instantiations take.
// Plain C++ (no CUDA header): the plan (plan.cpp, built in the CPU extension too) chooses a tier
// through it and dispatch.cu launches the kernel of that tier through it, so both know the same tiers.
#pragma once
#include <cstdint>
#include <type_traits>

namespace flashattn::cuda {

// Calls run(std::integral_constant<int, tier>) for a tensor-core tier of element type T (a 2-byte
// type, fp16 / bf16: 32, 64, 96, 128, 192, 256; double: 64, 128) and returns what it returns; a
// value-initialized result (false, an empty optional) for a tier T has not.
template <class T, class Run>
auto on_tensor_core_tier(int tier, Run&& run) -> decltype(run(std::integral_constant<int, 64>{})) {
  using std::integral_constant;
  if constexpr (sizeof(T) == 2) {
    switch (tier) {
      case 32: return run(integral_constant<int, 32>{});
      case 64: return run(integral_constant<int, 64>{});
      case 96: return run(integral_constant<int, 96>{});
      case 128: return run(integral_constant<int, 128>{});
      case 192: return run(integral_constant<int, 192>{});
      case 256: return run(integral_constant<int, 256>{});
    }
  } else if constexpr (std::is_same_v<T, double>) {
    if (tier == 64) return run(integral_constant<int, 64>{});
    if (tier == 128) return run(integral_constant<int, 128>{});
  }
  return {};
}

// The smallest tier of T that holds a head dim of e_max (a dim between two tiers runs the upper one,
// zero-padded); 0 where there is none.
template <class T>
int tensor_core_tier(int64_t e_max) {
  for (int tier : {32, 64, 96, 128, 192, 256})  // every tier of any T, ascending
    if (e_max <= tier && on_tensor_core_tier<T>(tier, [](auto) { return true; })) return tier;
  return 0;
}

}  // namespace flashattn::cuda
