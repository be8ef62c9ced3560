// The decode kernel's entry points (fwd_decode.cuh), instantiated per head-dim tier in fwd_decode_hdim*.cu:
// declared here so that the forward's units (fwd_sm80.cuh) call them without compiling the kernel again, and
// a change to it rebuilds only its own units.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "../../params.h"

namespace flashattn::cuda::sm80 {

// Launches the decode kernel where it serves the call; false (nothing launched) otherwise.
template <class Elem, int kDim>
bool launch_decode(const FwdParams& p, cudaStream_t stream);
// The workspace its launch takes for p (its walks' parts and counters; 0 where it takes none).
template <class Elem, int kDim>
size_t decode_workspace_bytes(const FwdParams& p);

}  // namespace flashattn::cuda::sm80
