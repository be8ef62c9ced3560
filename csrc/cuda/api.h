// Entry points of the CUDA backend. Plain C++: included by ops.cpp, which knows no CUDA types.
#pragma once
#include "../params.h"

namespace flashattn::cuda {

// `stream` is a cudaStream_t; kernels run on the caller's current device.
size_t fwd_workspace_bytes(const FwdParams& p);
void run_fwd(const FwdParams& p, void* stream);
size_t bwd_workspace_bytes(const BwdParams& p);
void run_bwd(const BwdParams& p, void* stream);

}  // namespace flashattn::cuda
