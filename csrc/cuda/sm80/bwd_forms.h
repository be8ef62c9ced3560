// Which forms of the sm80/ dK/dV kernels a plain fp16 / bf16 call (no optional feature) can get, per
// head-dim tier. The plan (../plan.cpp) gives such a call the first form whose shared memory fits the
// block: the 2-D kernel's one-barrier form (sm_90+), its two-barrier form, the 1-D kernel, the 1-D
// kernel's general variant. A later form runs only on a GPU whose blocks have room for it and not for
// the earlier ones; a form no GPU of kGpuBlockSmem is like that for is not compiled, and the plan
// passes over it (under a FLASHATTN_CUDA_SMEM_LIMIT between two GPUs' sizes the call takes the next
// form that fits). Plain C++: the plan reads these too.
#pragma once
#include <cstddef>

#include "tile_config.h"

namespace flashattn::cuda::sm80 {

// The shared memory a block may opt into, by compute capability major, on the GPUs the build targets.
struct GpuBlockSmem {
  int major;
  size_t bytes;
};
inline constexpr GpuBlockSmem kGpuBlockSmem[] = {
    {8, 166912},   // sm_80, sm_87
    {8, 101376},   // sm_86, sm_89
    {9, 232448},   // sm_90
    {10, 232448},  // sm_100
    {12, 101376},  // sm_120
};

// `bytes` of shared memory fit a block of `gpu` (a function: nvcc warns on comparing a constant 0).
constexpr bool fits(size_t bytes, const GpuBlockSmem& gpu) { return bytes <= gpu.bytes; }

// The 2-D kernel's one-barrier form takes a plain call on `gpu` (its swizzled P / dS: sm_90+).
template <class Elem, int kDim>
constexpr bool one_sync_fits(const GpuBlockSmem& gpu) {
  using OneSync = Bwd2dConfig<Elem, kDim, /*kOneSync=*/true>;
  return OneSync::kServed && gpu.major >= 9 && fits(OneSync::kSmemBytes, gpu);
}

// The 2-D kernel's two-barrier form without features: where a GPU fits it and not the one-barrier form
// (at dim 256 none: sm_8x blocks are too small for its 211 KB, sm_90+ take the one-barrier form).
template <class Elem, int kDim>
constexpr bool bwd_2d_plain_compiled() {
  using TwoDim = Bwd2dConfig<Elem, kDim>;
  bool runs = false;
  for (const GpuBlockSmem& gpu : kGpuBlockSmem)
    runs = runs || (TwoDim::kServed && fits(TwoDim::kSmemBytes, gpu) && !one_sync_fits<Elem, kDim>(gpu));
  return runs;
}

// The 1-D kernel without features: at the tiers the 2-D kernel lacks, and where a GPU fits it and no 2-D
// form (dim 64 on 99 KB GPUs; not at 96 / 128 / 256, where a GPU that fits it fits a 2-D form).
template <class Elem, int kDim>
constexpr bool bwd_1d_plain_compiled() {
  using TwoDim = Bwd2dConfig<Elem, kDim>;
  constexpr bool kTwoDimPlain = bwd_2d_plain_compiled<Elem, kDim>();
  bool runs = !TwoDim::kServed;
  for (const GpuBlockSmem& gpu : kGpuBlockSmem)
    runs = runs || (fits(BwdConfig<Elem, kDim>::kSmemBytes, gpu) && !(kTwoDimPlain && fits(TwoDim::kSmemBytes, gpu)) &&
                    !one_sync_fits<Elem, kDim>(gpu));
  return BwdConfig<Elem, kDim>::kServed && runs;
}

}  // namespace flashattn::cuda::sm80
