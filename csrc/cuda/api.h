// Entry points of the CUDA backend. Plain C++: included by ops.cpp, which knows no CUDA types.
#pragma once
#include <string>

#include "../params.h"
#include "plan.h"

namespace flashattn::cuda {

// `stream` is a cudaStream_t; kernels run on the caller's current device. A call is
// fwd_workspace_bytes then run_fwd (bwd_...: the same); run_* return "" or the first CUDA
// failure of the call (nothing here throws: see common/check.h).
size_t fwd_workspace_bytes(const FwdParams& p);
std::string run_fwd(const FwdParams& p, void* stream);
size_t bwd_workspace_bytes(const BwdParams& p);
std::string run_bwd(const BwdParams& p, void* stream);
// The in-place append of a KV-cache step and its seqused output (common/append.h), one launch.
std::string run_append(const AppendParams& p, void* stream);

// The kernels the plan (plan.h) chooses for the call on the current device under `ov`, as describe()
// names them.
std::string planned_fwd(const FwdParams& p, const Overrides& ov);
std::string planned_bwd(const BwdParams& p, const Overrides& ov);

}  // namespace flashattn::cuda
