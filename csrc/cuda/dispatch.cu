// CUDA backend entry points: ask the kernel plan (plan.h) which kernel serves the call, once per call
// (the Hopper kernels' tensor maps, encoded when the plan asks whether they can take it, are the maps
// their launch passes), size the workspace, have the caller allocate it, and run the kernel sequence on
// the caller's stream.
//
// Backward workspace: [D = rowsum(dO * O): acc, (batch, heads_q, len_q)] padded to 256 bytes,
// then the dQ accumulator [acc, (batch, heads_q, len_q, head_dim)] that the dK/dV kernels add
// into with atomics: row-major, or blocked where the fp16/bf16 tensor-core kernels fill it
// (common/dq_layout.cuh; sized for either), padded to 256 bytes. The deterministic path of the
// tensor-core kernels takes several (schedule/key_tile_rounds.h's DqAccum); that of the SIMT kernels none
// (their dQ kernel writes dQ directly). Then, for plain non-causal fp16/bf16 calls, the fp32 dK / dV
// of the walks split in the dK/dV grid's last wave (schedule/tail_split.cuh), padded to 256 bytes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "../common/pages.h"
#include "../common/sequence.h"
#include "api.h"
#include "common/check.h"
#include "common/dq_layout.cuh"
#include "common/numeric.cuh"
#include "gather_pages.h"
#include "plan.h"
#include "simt/launch.h"
#include "simt/tiers.h"
#include "sm80/launch.h"
#include "sm90/launch.h"
#include "tensor_core_tiers.h"

namespace flashattn::cuda {

namespace {

// Whether the build holds the sm_90a code of the wgmma kernels (setup.py defines FLASHATTN_SM90A
// where its architectures include 9.0): a fact of the build, not asked of the GPU.
#ifdef FLASHATTN_SM90A
constexpr bool kSm90aCompiled = true;
#else
constexpr bool kSm90aCompiled = false;
#endif

size_t acc_size(DType t) { return t == DType::kFloat64 ? 8 : 4; }

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

// Rows of q as stored, over all heads (a variable-length batch has batch 1 of total_q rows).
int64_t stored_rows(const FwdParams& p) { return tensor_batches(p) * p.heads_q * tensor_rows(p); }

// Bytes of the dQ accumulator, room for the row-major and the blocked layout.
size_t dq_accum_bytes(const BwdParams& p) {
  const int64_t rows = stored_rows(p);
  const int64_t row_major = rows * p.head_dim, blocked = DqBlocked(p.head_dim).size(rows);
  return size_t(row_major > blocked ? row_major : blocked) * acc_size(p.dtype);
}

// (the ops check these first: a failure here is a bug between the layers.)
bool check_dims(const FwdParams& p) {
  if (p.head_dim < 1 || p.head_dim > 256 || p.head_dim_v < 1 || p.head_dim_v > 256) {
    fail("head_dim " + std::to_string(p.head_dim) + " / head_dim_v " + std::to_string(p.head_dim_v) +
         " outside the supported 1..256");
    return false;
  }
  if (p.heads_kv < 1 || p.heads_q % p.heads_kv != 0) {
    fail("heads_q " + std::to_string(p.heads_q) + " not a multiple of heads_kv " + std::to_string(p.heads_kv));
    return false;
  }
  return true;
}

// A launcher that launched nothing for the kernel the plan chose (a failure it recorded, or the plan
// and the launcher disagree): the call fails.
template <class Plan>
void check_launched(bool launched, const Plan& plan) {
  if (!launched) fail("the kernel planned for the call (" + describe(plan) + ") did not launch");
}

// Calls run(T{}) with T the element type of `dtype`.
template <class Run>
void on_dtype(DType dtype, Run&& run) {
  switch (dtype) {
    case DType::kFloat64: run(double{}); break;
    case DType::kFloat32: run(float{}); break;
    case DType::kBFloat16: run(__nv_bfloat16{}); break;
    case DType::kFloat16: run(__half{}); break;
  }
}

DeviceInfo device_info() {
  const DeviceLimits lim = device_limits();
  DeviceInfo dev;
  dev.major = lim.major;
  dev.minor = lim.minor;
  dev.sms = lim.sms;
  dev.smem_optin = lim.smem_optin;
  dev.sm90a_compiled = kSm90aCompiled;
  return dev;
}

// The call the planned kernel runs: p, or p reading the copy of its pages gathered into the workspace.
FwdParams planned_call(const FwdParams& p, const FwdPlan& plan) {
  return plan.gather_pages ? with_gathered_pages(p) : p;
}

// A forward call as planned: its kernel and, where that is the Hopper forward, the tensor maps encoded
// when the plan asked it, which its launch passes.
struct FwdCall {
  FwdPlan plan;
  sm90::FwdMaps maps;
};

// Whether the Hopper forward the plan chose (two consumers at tier 64, 128 or 256; three at 64) can take
// `call`, its maps encoded into `maps`.
template <class T>
bool sm90_fwd_ready(const FwdParams& call, const FwdPlan& plan, sm90::FwdMaps& maps) {
  if (plan.kernel == FwdKernel::kSm90WgmmaWs3) return sm90::fwd_ws_ready<T, 64, 3>(call, maps);
  return plan.tier == 64    ? sm90::fwd_ws_ready<T, 64>(call, maps)
         : plan.tier == 96  ? sm90::fwd_ws_ready<T, 96>(call, maps)
         : plan.tier == 128 ? sm90::fwd_ws_ready<T, 128>(call, maps)
                            : sm90::fwd_ws_ready<T, 256>(call, maps);
}

// The plan of a forward call on the current GPU. Where it chooses the warp-specialized Hopper kernel,
// that kernel is asked whether it can take the call (its tensor maps, its register pool), and the call
// planned again without it where it cannot.
template <class T>
FwdCall plan_fwd_typed(const FwdParams& p, const Overrides& ov = env_overrides()) {
  DeviceInfo dev = device_info();
  FwdCall call;
  call.plan = choose_fwd(p, dev, ov);
  if constexpr (sizeof(T) == 2) {
    const bool hopper = call.plan.kernel == FwdKernel::kSm90WgmmaWs || call.plan.kernel == FwdKernel::kSm90WgmmaWs3;
    if (hopper && !sm90_fwd_ready<T>(planned_call(p, call.plan), call.plan, call.maps)) {
      dev.sm90_ws_ready = false;
      call.plan = choose_fwd(p, dev, ov);
    }
  }
  return call;
}

// The forward's workspace: a paged call's gathered copy (when the decode kernel does not take it), then
// the sm80/ kernel's part.
template <class T>
size_t fwd_workspace_bytes(const FwdParams& p, const FwdPlan& plan) {
  size_t bytes = plan.gather_pages ? gathered_bytes(p) : 0;
  if constexpr (sizeof(T) == 2) {
    if (plan.kernel == FwdKernel::kSm80Decode || plan.kernel == FwdKernel::kSm80Plain)
      on_tensor_core_tier<T>(plan.tier, [&](auto tier) {
        bytes += sm80::fwd_workspace_bytes<T, decltype(tier)::value>(planned_call(p, plan), plan.kernel);
        return true;
      });
  }
  return bytes;
}

template <class T>
void fwd_typed(FwdParams& paged_or_not, cudaStream_t stream, const AllocateWorkspace& allocate) {
  FwdCall call = plan_fwd_typed<T>(paged_or_not);
  const FwdPlan& plan = call.plan;
  const size_t bytes = fwd_workspace_bytes<T>(paged_or_not, plan);
  if (failed() || !allocate(bytes, paged_or_not.workspace)) return;
  paged_or_not.workspace_bytes = bytes;
  if (plan.gather_pages) gather_pages(paged_or_not, stream);
  const FwdParams p = planned_call(paged_or_not, plan);
  bool launched = false;
  switch (plan.kernel) {
    case FwdKernel::kSm90WgmmaWs:
      if constexpr (sizeof(T) == 2) {
        // A gathered call's maps were encoded before the workspace held its copy: again, on the copy.
        if (plan.gather_pages && !sm90_fwd_ready<T>(p, plan, call.maps)) break;
        launched = on_tensor_core_tier<T>(plan.tier, [&](auto tier) {
          constexpr int kTier = decltype(tier)::value;
          if constexpr (sm90::kFwdWgmmaTier<T, kTier>) return sm90::fwd_wgmma<T, kTier>(p, call.maps, stream);
          return false;
        });
      }
      break;
    case FwdKernel::kSm90WgmmaWs3:
      if constexpr (sizeof(T) == 2) {
        if (plan.gather_pages && !sm90_fwd_ready<T>(p, plan, call.maps)) break;
        launched = plan.tier == 64 && sm90::fwd_wgmma<T, 64, 3>(p, call.maps, stream);
      }
      break;
    case FwdKernel::kSm80Decode:
    case FwdKernel::kSm80Plain:
    case FwdKernel::kSm80Features:
      if constexpr (!std::is_same_v<T, float>) {
        launched = on_tensor_core_tier<T>(plan.tier, [&](auto tier) {
          return sm80::fwd<T, decltype(tier)::value>(p, plan.kernel, stream);
        });
      }
      break;
    case FwdKernel::kSimtWs:
    case FwdKernel::kSimtQres:
      if constexpr (!std::is_same_v<T, double>) {
        if constexpr (std::is_same_v<T, float>) {  // (fp16 / bf16: at 128 only)
          if (plan.tier == 64) launched = simt::fwd_qres<T, 64>(p, plan.kernel, plan.tf32_keys, stream);
        }
        if (plan.tier == 128) launched = simt::fwd_qres<T, 128>(p, plan.kernel, plan.tf32_keys, stream);
      }
      break;
    case FwdKernel::kSimt: {
      constexpr simt::Tiers kTiers = simt::fwd_tiers(std::is_same_v<T, double>);
      launched = simt::on_simt_tier<kTiers.low, kTiers.cap>(plan.tier, [&](auto tier) {
        simt::fwd<T, decltype(tier)::value>(p, plan.slices, stream);
        return true;
      });
      break;
    }
  }
  check_launched(launched, plan);
}

// A backward call as planned: its kernel and the Hopper kernel's maps, as FwdCall.
struct BwdCall {
  BwdPlan plan;
  sm90::BwdPanelMaps maps;
};

// The backward's plan on the current GPU; where it chooses the Hopper kernel, asked as the forward's.
BwdCall plan_bwd(const BwdParams& p, const Overrides& ov = env_overrides()) {
  DeviceInfo dev = device_info();
  BwdCall call;
  call.plan = choose_bwd(p, dev, ov);
  if (call.plan.kernel == BwdKernel::kSm90Wgmma && !sm90::bwd_ws_ready(p, call.plan.tier, call.maps)) {
    dev.sm90_ws_ready = false;
    call.plan = choose_bwd(p, dev, ov);
  }
  return call;
}

size_t dkdv_tail_bytes(const BwdParams& p, const BwdPlan& plan) {
  return size_t(plan.tail_rows) * size_t(p.head_dim + p.head_dim_v) * sizeof(float);
}

// Where the split walks' dK / dV lie in the workspace: after D and the dQ accumulators.
size_t dkdv_tail_offset(const BwdParams& p, const BwdPlan& plan) {
  return align_up(size_t(stored_rows(p)) * acc_size(p.dtype)) + plan.dq_accumulators * align_up(dq_accum_bytes(p));
}

size_t bwd_workspace_bytes(const BwdParams& p, const BwdPlan& plan) {
  return dkdv_tail_offset(p, plan) + align_up(dkdv_tail_bytes(p, plan));
}

bool is_tensor_core(BwdKernel k) { return k != BwdKernel::kSimt && k != BwdKernel::kSimtKvres; }

template <class T>
void bwd_typed(const BwdParams& p, const BwdCall& call, cudaStream_t stream) {
  const BwdPlan& plan = call.plan;
  char* ws = static_cast<char*>(p.workspace);
  void* dsum = ws;
  const int accumulators = plan.dq_accumulators;
  const size_t accum_bytes = align_up(dq_accum_bytes(p));
  void* dq_accum = accumulators > 0 ? ws + align_up(size_t(stored_rows(p)) * acc_size(p.dtype)) : nullptr;
  // The accumulators (256-byte multiples at 256-byte offsets) start at zero: cleared by the D kernel.
  simt::bwd_dot_do_o<T>(p, dsum, dq_accum, accumulators * accum_bytes, stream);

  const bool tensor_cores = is_tensor_core(plan.kernel);  // dK, dV and dQ (into the accumulators)
  bool dq_blocked = false;                                 // those fill the blocked layout (fp16/bf16)
  const DqAccum accum{dq_accum, p.deterministic ? accumulators : 0, int64_t(accum_bytes / acc_size(p.dtype))};
  const DkDvTail tail{plan.tail_rows > 0 ? reinterpret_cast<float*>(ws + dkdv_tail_offset(p, plan)) : nullptr,
                      plan.tail_rows};
  bool launched = false;
  if (tensor_cores) {
    if constexpr (!std::is_same_v<T, float>) {
      launched = on_tensor_core_tier<T>(plan.tier, [&](auto tier) {
        constexpr int kTier = decltype(tier)::value;
        if constexpr (sm90::BwdWsConfig<T, kTier>::kServed) {
          if (plan.kernel == BwdKernel::kSm90Wgmma)
            return sm90::bwd_wgmma<T, kTier>(p, call.maps, dsum, accum, stream);
        }
        return plan.kernel != BwdKernel::kSm90Wgmma &&
               sm80::bwd_dkdv<T, kTier>(p, plan.kernel, dsum, accum, tail, stream);
      });
      dq_blocked = std::is_same_v<TensorCoreDqLayout<acc_t<T>>, DqBlocked>;
    }
  } else {
    // The SIMT kernels: dQ atomically into the accumulator, or (deterministic) by the dQ kernel.
    void* simt_dq_accum = p.deterministic ? nullptr : dq_accum;
    constexpr simt::Tiers kTiers = simt::bwd_tiers(std::is_same_v<T, double>);
    if (plan.kernel == BwdKernel::kSimtKvres) {
      if constexpr (!std::is_same_v<T, double>) {
        if (plan.tier == 64) launched = simt::bwd_dkdv_kvres<T, 64>(p, dsum, simt_dq_accum, stream);
        if (plan.tier == 128) launched = simt::bwd_dkdv_kvres<T, 128>(p, dsum, simt_dq_accum, stream);
      }
    } else {
      launched = simt::on_simt_tier<kTiers.low, kTiers.cap>(plan.tier, [&](auto tier) {
        simt::bwd_dkdv<T, decltype(tier)::value>(p, dsum, simt_dq_accum, plan.slices, stream);
        return true;
      });
    }
    if (launched && p.deterministic) {
      launched = simt::on_simt_tier<kTiers.low, kTiers.cap>(plan.dq_tier, [&](auto tier) {
        constexpr int kTier = decltype(tier)::value;
        simt::bwd_dq<T, kTier>(p, dsum, int((p.head_dim + kTier - 1) / kTier), stream);
        return true;
      });
    }
  }
  check_launched(launched, plan);
  if (tensor_cores || !p.deterministic)
    simt::bwd_dq_convert<T>(p, dq_accum, dq_blocked, accum.slices > 0 ? accum.slices : 1, accum.slice_elems, stream);
}

}  // namespace

std::string run_fwd(FwdParams& p, void* stream, const AllocateWorkspace& allocate) {
  take_error();  // a new call: nothing recorded yet
  if (!check_dims(p)) return take_error();
  on_dtype(p.dtype, [&](auto elem) { fwd_typed<decltype(elem)>(p, static_cast<cudaStream_t>(stream), allocate); });
  return take_error();
}

std::string run_bwd(BwdParams& p, void* stream, const AllocateWorkspace& allocate) {
  take_error();  // a new call: nothing recorded yet
  if (!check_dims(p)) return take_error();
  const BwdCall call = plan_bwd(p);
  const size_t bytes = bwd_workspace_bytes(p, call.plan);
  if (failed() || !allocate(bytes, p.workspace)) return take_error();
  p.workspace_bytes = bytes;
  on_dtype(p.dtype, [&](auto elem) { bwd_typed<decltype(elem)>(p, call, static_cast<cudaStream_t>(stream)); });
  return take_error();
}

std::string run_fwd_fp8(FwdParams& p, void* stream, const AllocateWorkspace& allocate) {
  take_error();
  using Fp8 = __nv_fp8_e4m3;
  using Cfg = sm90::FwdWsConfig<Fp8, 128>;
  const DeviceLimits lim = device_limits();
  if (failed()) return take_error();
  const char* missing = !kSm90aCompiled                        ? "this build has no sm_90a code"
                        : lim.major != 9 || lim.minor != 0     ? "it runs on sm_90 GPUs only"
                        : p.head_dim != 128 || p.head_dim_v != 128 ? "it serves head_dim 128 only"
                        : p.has_features()                    ? "it takes no feature beyond causal"
                        : Cfg::kSmemBytes > lim.smem_optin     ? "the GPU's shared memory per block is too small"
                        : p.batch > 65535 || p.heads_kv > 65535 ? "batch or heads_kv exceeds 65535"
                                                                : nullptr;
  if (missing != nullptr) return std::string(kFp8Unavailable) + missing;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const size_t bytes = sm90::fwd_fp8_v_bytes(p);
  if (!allocate(bytes, p.workspace)) return take_error();
  p.workspace_bytes = bytes;
  if (!sm90::fwd_fp8_v_transposed(p, p.workspace, s)) return take_error();
  p.v = p.workspace;
  sm90::FwdMaps maps;
  if (!sm90::fwd_ws_ready<Fp8, 128>(p, maps)) {
    if (failed()) return take_error();
    return std::string(kFp8Unavailable) + "the driver refused its tensor maps";
  }
  if (!sm90::fwd_wgmma<Fp8, 128>(p, maps, s)) fail("the float8 forward did not launch");
  return take_error();
}

bool decode_serves(const FwdParams& p) {
  // (run_fwd's own plan. Where it names the decode kernel, that kernel's launch takes the call, or a CUDA query
  // failed, which fails the call on either path of the step.)
  take_error();
  bool decode = false;
  if (check_dims(p)) {
    on_dtype(p.dtype, [&](auto elem) {
      decode = plan_fwd_typed<decltype(elem)>(p).plan.kernel == FwdKernel::kSm80Decode;
    });
  }
  take_error();  // (a failure here is met again by the call itself)
  return decode;
}

std::string planned_fwd(const FwdParams& p, const Overrides& ov) {
  std::string plan;
  on_dtype(p.dtype, [&](auto elem) { plan = describe(plan_fwd_typed<decltype(elem)>(p, ov).plan); });
  return plan;
}

std::string planned_bwd(const BwdParams& p, const Overrides& ov) { return describe(plan_bwd(p, ov).plan); }

}  // namespace flashattn::cuda
