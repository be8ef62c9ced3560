// Entry points of the CUDA backend. Plain C++: included by the ops (csrc/ops/), which know no CUDA types.
#pragma once
#include <cstddef>
#include <functional>
#include <string>

#include "../params.h"
#include "plan.h"

namespace flashattn::cuda {

// Allocates a call's workspace of `bytes` bytes (the ops, through torch; null for none) into
// `workspace`; false where it could not, the failure kept by the caller to raise.
using AllocateWorkspace = std::function<bool(size_t bytes, void*& workspace)>;

// `stream` is a cudaStream_t; kernels run on the caller's current device. A call is planned once:
// the plan's kernel sizes the workspace, `allocate` provides it (run_* set p.workspace and
// p.workspace_bytes), and the kernels are queued. run_* return "" or the first CUDA failure of the
// call (nothing here throws: see common/check.h); "" too where `allocate` failed (its caller raises that).
std::string run_fwd(FwdParams& p, void* stream, const AllocateWorkspace& allocate);
std::string run_bwd(BwdParams& p, void* stream, const AllocateWorkspace& allocate);
// A float8 (e4m3) forward (FwdParams::qk_descale): q, k and v (batch, heads, len, 128) float8, out
// bf16. The workspace holds V transposed for the kernel; p.v is pointed at it. Returns "" once
// queued, a failure, or kFp8Unavailable and why, where the kernel cannot take the call (then
// nothing ran: the caller computes it another way).
inline constexpr const char* kFp8Unavailable = "float8 kernel unavailable: ";
std::string run_fwd_fp8(FwdParams& p, void* stream, const AllocateWorkspace& allocate);
// The in-place append of a KV-cache step and its seqused output (common/append.h), one launch.
std::string run_append(const AppendParams& p, void* stream);

// Whether run_fwd(p) runs the decode kernel (sm80/fwd_decode.cuh) on the current device: its plan, the
// FLASHATTN_CUDA_* overrides included. (A KV-cache step asks: that kernel checks the pages itself, so a read-only
// step it serves needs no append before it: FwdParams::check_pages.)
bool decode_serves(const FwdParams& p);
// The kernels the plan (plan.h) chooses for the call on the current device under `ov`, as describe()
// names them.
std::string planned_fwd(const FwdParams& p, const Overrides& ov);
std::string planned_bwd(const BwdParams& p, const Overrides& ov);

}  // namespace flashattn::cuda
