// Where a call runs: the backend of q's device, with the workspace it asks for.
#pragma once
#ifdef FLASHATTN_WITH_CUDA
#include <torch/csrc/stable/accelerator.h>
#endif

#include <string>

#include "../cpu/api.h"
#include "tensors.h"
#ifdef FLASHATTN_WITH_CUDA
#include "../cuda/api.h"
#endif

namespace flashattn::ops {

#ifdef FLASHATTN_WITH_CUDA
inline Error current_cuda_stream(const Tensor& t, void*& stream) {
  FA_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream) == AOTI_TORCH_SUCCESS,
           "flashattn: could not get the current CUDA stream of device ", t.get_device_index());
  return {};
}
#endif

// The backend of q's device runs p, with the workspace it asks for allocated here: the CPU's sized
// first; the CUDA backend asks for its own once it has planned the call (cuda::AllocateWorkspace).
template <class Params, class CpuBytes, class RunCpu, class RunCuda>
Error run_backend(Params& p, const Tensor& q, CpuBytes cpu_bytes, RunCpu run_cpu, RunCuda run_cuda) {
  struct Workspace {
    const Tensor& like;
    Tensor tensor;  // held until the kernels are queued: the allocator's stream order covers them
    Error error;
  } ws{q, {}, {}};
  // (One capture: std::function keeps it without allocating.)
  const auto allocate_workspace = [&ws](size_t bytes, void*& workspace) {
    workspace = nullptr;
    if (bytes == 0) return true;
    ws.error = allocate({static_cast<int64_t>(bytes)}, ScalarType::Byte, ws.like, "the workspace", ws.tensor);
    if (ws.error) return false;
    workspace = ws.tensor.mutable_data_ptr();
    return true;
  };
  if (q.is_cpu()) {
    p.workspace_bytes = cpu_bytes(p);
    if (!allocate_workspace(p.workspace_bytes, p.workspace)) return ws.error;
    run_cpu(p);
    return {};
  }
#ifdef FLASHATTN_WITH_CUDA
  torch::stable::accelerator::DeviceGuard guard(q.get_device_index());
  void* stream = nullptr;
  FA_TRY(current_cuda_stream(q, stream));
  const std::string failure = run_cuda(p, stream, allocate_workspace);
  FA_TRY(ws.error);
  FA_CHECK(failure.empty(), failure);
  return {};
#else
  (void)run_cuda;
  return error_of("RuntimeError", "flashattn: this build of flashattn_ext has no CUDA kernels; reinstall it with nvcc "
                  "and a CUDA build of torch present");
#endif
}

}  // namespace flashattn::ops

#ifdef FLASHATTN_WITH_CUDA
#define FLASHATTN_CUDA_FWD cuda::run_fwd
#define FLASHATTN_CUDA_BWD cuda::run_bwd
#else
#define FLASHATTN_CUDA_FWD nullptr
#define FLASHATTN_CUDA_BWD nullptr
#endif
