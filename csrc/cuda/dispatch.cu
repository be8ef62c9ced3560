// CUDA backend entry points: pick the tensor-core (sm80/) or SIMT kernel by arch, dtype and
// head-dim tier, lay out the backward workspace, and run the kernel sequence on the caller's
// stream.
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
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "../common/pages.h"
#include "../common/sequence.h"
#include "api.h"
#include "common/check.h"
#include "common/dq_layout.cuh"
#include "common/numeric.cuh"
#include "common/operand_alignment.h"
#include "gather_pages.h"
#include "simt/launch.h"
#include "sm80/launch.h"
#include "sm90/launch.h"

namespace flashattn::cuda {

namespace {

// Smallest supported tier >= dim, capped; dims above the cap are cut into ceil(dim / cap)
// column slices handled by separate blocks.
int pick_tier(int64_t dim, int cap) {
  int tier = 32;
  while (tier < dim && tier < cap) tier *= 2;
  return tier;
}

int num_slices(int64_t dim, int tier) { return int((dim + tier - 1) / tier); }

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

// (ops.cpp checks these first: a failure here is a bug between the layers.)
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

// FLASHATTN_CUDA_KERNELS=simt keeps every dtype on the portable kernels, FMA products only (to
// test them on GPUs where the tensor-core ones would be taken).
bool tensor_cores_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("FLASHATTN_CUDA_KERNELS");
    return v == nullptr || std::strcmp(v, "simt") != 0;
  }();
  return enabled;
}

// The tensor-core kernels (sm80/) serve fp16, bf16 and fp64. fp32 stays on the SIMT kernels:
// a 3xTF32 tensor-core forward was measured (H200, commit 933d59f) at 0.87-1.09x SDPA-efficient
// but with 5x torch's fp32 error on large logits (scores ~1e4: tf32 pairs keep ~22 bits). Its
// Q-resident forward forms P V (not the scores) on the tensor cores (simt/pv_tf32x3.cuh).
template <class T>
bool tensor_core_kernels_allowed() {
  return !std::is_same_v<T, float> && tensor_cores_enabled();
}

// The dQ accumulators of a backward call: on the deterministic path where the tensor-core
// kernels may serve it, one per block of a (batch, kv head) in each round of key tiles
// (schedule/key_tile_rounds.h's for_key_tile_rounds): enough for about one block per SM, at most 16 (each
// takes the size of dQ in fp32 / fp64); none where the SIMT kernels would (their dQ kernel
// writes dQ); else one. (Tensor-core kernels that decline the call leave the accumulators to the
// SIMT kernels, which then use one or none.)
int dq_accumulators(const BwdParams& p) {
  if (!p.deterministic) return 1;
  bool tensor_cores = false;
  switch (p.dtype) {
    case DType::kFloat64: tensor_cores = tensor_core_kernels_allowed<double>(); break;
    case DType::kBFloat16: tensor_cores = tensor_core_kernels_allowed<__nv_bfloat16>(); break;
    case DType::kFloat16: tensor_cores = tensor_core_kernels_allowed<__half>(); break;
    default: break;
  }
  const DeviceLimits lim = device_limits();
  if (!tensor_cores || lim.major < 8) return 0;
  const int64_t per_head = lim.sms / (p.batch * p.heads_kv);
  return int(per_head < 1 ? 1 : per_head > 16 ? 16 : per_head);
}

// Keys of the fp32 dK / dV of the split walks of a dK/dV grid's last wave (schedule/tail_split.cuh)
// that the workspace holds: fp16 / bf16 calls the split serves, on sm_80+; else none.
int64_t dkdv_tail_rows(const BwdParams& p) {
  const bool half = p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16;
  if (!half || !tensor_cores_enabled() || !tail_split_serves(p)) return 0;
  const DeviceLimits lim = device_limits();
  return lim.major < 8 ? 0 : tail_split_rows(p, lim.sms);
}
size_t dkdv_tail_bytes(const BwdParams& p) {
  return size_t(dkdv_tail_rows(p)) * size_t(p.head_dim + p.head_dim_v) * sizeof(float);
}

// The tensor-core kernels' head-dim tier for e_max (fp16/bf16: 32, 64, 96, 128, 192, 256; fp64:
// 64, 128), handed to `run` as a std::integral_constant. Returns what `run` returns (false when
// that kernel declines the call), false above the last tier. One list for the forward and the
// dK/dV dispatch.
template <class T, class Run>
bool on_sm80_tier(int64_t e_max, Run&& run) {
  using std::integral_constant;
  if constexpr (sizeof(T) == 2) {
    if (e_max <= 32) return run(integral_constant<int, 32>{});
    if (e_max <= 64) return run(integral_constant<int, 64>{});
    if (e_max <= 96) return run(integral_constant<int, 96>{});
    if (e_max <= 128) return run(integral_constant<int, 128>{});
    if (e_max <= 192) return run(integral_constant<int, 192>{});
    if (e_max <= 256) return run(integral_constant<int, 256>{});
  } else {
    if (e_max <= 64) return run(integral_constant<int, 64>{});
    if (e_max <= 128) return run(integral_constant<int, 128>{});
  }
  return false;
}

// The tensor-core forwards of tier kTier, in turn: the decode kernel, on sm_90 the wgmma kernels,
// then the sm80/ plain or feature kernel. False where none serves the call.
template <class T, int kTier>
bool fwd_tensor_cores(const FwdParams& p, cudaStream_t stream) {
  if constexpr (sizeof(T) == 2) {
    if (sm80::fwd_decode<T, kTier>(p, stream)) return true;
  }
  if constexpr (sm90::kFwdWgmmaTier<T, kTier>) {
    if (!p.is_paged() && fwd_operands_aligned(p) && sm90::fwd_wgmma<T, kTier>(p, stream)) return true;
  }
  return sm80::fwd<T, kTier>(p, stream);
}

// The tensor-core dK/dV kernels of tier kTier: on sm_90 the wgmma kernel, then the sm80/ ones.
template <class T, int kTier>
bool bwd_tensor_cores(const BwdParams& p, const void* dsum, const DqAccum& accum, const DkDvTail& tail,
                      cudaStream_t stream) {
  if constexpr (sizeof(T) == 2 && (kTier == 64 || kTier == 128)) {
    if (bwd_operands_aligned(p) && sm90::bwd_wgmma<T, kTier>(p, dsum, accum, stream)) return true;
  }
  return sm80::bwd_dkdv<T, kTier>(p, dsum, accum, tail, stream);
}

template <class T>
void fwd_typed(const FwdParams& p, cudaStream_t stream) {
  const int64_t e_max = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  if constexpr (!std::is_same_v<T, float>) {
    if (tensor_core_kernels_allowed<T>()) {
      const bool done = on_sm80_tier<T>(e_max, [&](auto tier) {
        return fwd_tensor_cores<T, decltype(tier)::value>(p, stream);
      });
      if (done) return;
    }
  }
  if constexpr (!std::is_same_v<T, double>) {
    if (e_max <= 64 && simt::fwd_qres<T, 64>(p, tensor_cores_enabled(), stream)) return;
    if (e_max > 64 && e_max <= 128 && simt::fwd_qres<T, 128>(p, tensor_cores_enabled(), stream)) return;
  }
  constexpr int kCap = std::is_same_v<T, double> ? 128 : 256;
  const int tier = pick_tier(p.head_dim_v, kCap);
  const int splits = num_slices(p.head_dim_v, tier);
  switch (tier) {
    case 32: simt::fwd<T, 32>(p, splits, stream); break;
    case 64: simt::fwd<T, 64>(p, splits, stream); break;
    case 128: simt::fwd<T, 128>(p, splits, stream); break;
    default:
      if constexpr (kCap >= 256) simt::fwd<T, 256>(p, splits, stream);
      break;
  }
}

// Where the split walks' dK / dV lie in the workspace: after D and the dQ accumulators.
size_t dkdv_tail_offset(const BwdParams& p) {
  return align_up(size_t(stored_rows(p)) * acc_size(p.dtype)) + dq_accumulators(p) * align_up(dq_accum_bytes(p));
}

template <class T>
void bwd_typed(const BwdParams& p, cudaStream_t stream) {
  constexpr int kCap = std::is_same_v<T, double> ? 64 : 128;
  const int64_t e_max = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  const int tier = pick_tier(e_max, kCap);
  const int splits = num_slices(e_max, tier);

  char* ws = static_cast<char*>(p.workspace);
  void* dsum = ws;
  const int accumulators = dq_accumulators(p);
  const size_t accum_bytes = align_up(dq_accum_bytes(p));
  void* dq_accum = accumulators > 0 ? ws + align_up(size_t(stored_rows(p)) * acc_size(p.dtype)) : nullptr;
  if (accumulators > 0)
    check_cuda(cudaMemsetAsync(dq_accum, 0, accumulators * accum_bytes, stream), "cudaMemsetAsync(dq accumulator)");
  simt::bwd_dot_do_o<T>(p, dsum, stream);

  bool tensor_cores_done = false;  // dK, dV and dQ (into the accumulators) by the tensor-core kernels
  bool dq_blocked = false;         // those fill the blocked layout (fp16/bf16)
  const DqAccum accum{dq_accum, p.deterministic ? accumulators : 0,
                            int64_t(accum_bytes / acc_size(p.dtype))};
  const int64_t tail_rows = dkdv_tail_rows(p);
  const DkDvTail tail{tail_rows > 0 ? reinterpret_cast<float*>(ws + dkdv_tail_offset(p)) : nullptr, tail_rows};
  if constexpr (!std::is_same_v<T, float>) {
    if (tensor_core_kernels_allowed<T>() && dq_accum != nullptr) {
      on_sm80_tier<T>(e_max, [&](auto tier) {
        tensor_cores_done = bwd_tensor_cores<T, decltype(tier)::value>(p, dsum, accum, tail, stream);
        dq_blocked = tensor_cores_done && std::is_same_v<TensorCoreDqLayout<acc_t<T>>, DqBlocked>;
        return tensor_cores_done;
      });
    }
  }
  if (!tensor_cores_done) {
    // The SIMT kernels: dQ atomically into the accumulator, or (deterministic) by the dQ kernel.
    void* simt_dq_accum = p.deterministic ? nullptr : dq_accum;
    bool dkdv_done = false;
    if constexpr (!std::is_same_v<T, double>) {
      if (e_max <= 64) dkdv_done = simt::bwd_dkdv_kvres<T, 64>(p, dsum, simt_dq_accum, stream);
      else if (e_max <= 128) dkdv_done = simt::bwd_dkdv_kvres<T, 128>(p, dsum, simt_dq_accum, stream);
    }
    auto run_tier = [&](auto tier_tag) {
      constexpr int kTier = decltype(tier_tag)::value;
      if (!dkdv_done) simt::bwd_dkdv<T, kTier>(p, dsum, simt_dq_accum, splits, stream);
      if (p.deterministic) simt::bwd_dq<T, kTier>(p, dsum, num_slices(p.head_dim, kTier), stream);
    };
    switch (tier) {
      case 32: run_tier(std::integral_constant<int, 32>{}); break;
      case 64: run_tier(std::integral_constant<int, 64>{}); break;
      default:
        if constexpr (kCap >= 128) run_tier(std::integral_constant<int, 128>{});
        break;
    }
  }
  if (tensor_cores_done || !p.deterministic)
    simt::bwd_dq_convert<T>(p, dq_accum, dq_blocked, accum.slices > 0 ? accum.slices : 1, accum.slice_elems, stream);
}

// The tensor-core kernels' workspace for p; for a paged p, sm80::kPagesNotRead unless the decode
// kernel reads its pages in place.
size_t sm80_fwd_workspace_bytes(const FwdParams& p) {
  const int64_t e_max = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  size_t bytes = p.is_paged() ? sm80::kPagesNotRead : 0;
  auto sm80_bytes = [&](auto elem) {
    using T = decltype(elem);
    if (!tensor_core_kernels_allowed<T>()) return;
    on_sm80_tier<T>(e_max, [&](auto tier) {
      constexpr int kTier = decltype(tier)::value;
      if (sm80::fwd_decode_workspace_bytes<T, kTier>(p, bytes)) return true;
      if constexpr (sm90::kFwdWgmmaTier<T, kTier>) {
        if (!p.is_paged() && sm90::fwd_wgmma_serves<T, kTier>(p)) return true;  // no workspace
      }
      bytes = sm80::fwd_workspace_bytes<T, kTier>(p);
      return true;
    });
  };
  if (p.dtype == DType::kBFloat16) sm80_bytes(__nv_bfloat16{});
  if (p.dtype == DType::kFloat16) sm80_bytes(__half{});
  return bytes;
}

// A paged call whose pages no kernel reads in place: they are gathered into the workspace first.
bool gathers_pages(const FwdParams& p) {
  return p.is_paged() && sm80_fwd_workspace_bytes(p) == sm80::kPagesNotRead;
}

}  // namespace

size_t fwd_workspace_bytes(const FwdParams& p) {
  take_error();  // a new call: nothing recorded yet
  if (!check_dims(p)) return 0;
  if (!gathers_pages(p)) return sm80_fwd_workspace_bytes(p);
  FwdParams padded = p;  // the call on the gathered copy (only its shape counts here)
  padded.block_table = nullptr;
  return gathered_bytes(p) + sm80_fwd_workspace_bytes(padded);
}

std::string run_fwd(const FwdParams& p, void* stream) {
  if (failed() || !check_dims(p)) return take_error();
  auto s = static_cast<cudaStream_t>(stream);
  if (gathers_pages(p)) {
    gather_pages(p, s);
    return run_fwd(with_gathered_pages(p), stream);  // (returns a failure of the gather first)
  }
  switch (p.dtype) {
    case DType::kFloat64: fwd_typed<double>(p, s); break;
    case DType::kFloat32: fwd_typed<float>(p, s); break;
    case DType::kBFloat16: fwd_typed<__nv_bfloat16>(p, s); break;
    case DType::kFloat16: fwd_typed<__half>(p, s); break;
  }
  return take_error();
}

size_t bwd_workspace_bytes(const BwdParams& p) {
  take_error();  // a new call: nothing recorded yet
  return dkdv_tail_offset(p) + align_up(dkdv_tail_bytes(p));
}

std::string run_bwd(const BwdParams& p, void* stream) {
  if (failed() || !check_dims(p)) return take_error();
  if (p.workspace_bytes < bwd_workspace_bytes(p) || p.workspace == nullptr) {
    fail("backward workspace of " + std::to_string(p.workspace_bytes) + " bytes, needs " +
         std::to_string(bwd_workspace_bytes(p)));
    return take_error();
  }
  auto s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kFloat64: bwd_typed<double>(p, s); break;
    case DType::kFloat32: bwd_typed<float>(p, s); break;
    case DType::kBFloat16: bwd_typed<__nv_bfloat16>(p, s); break;
    case DType::kFloat16: bwd_typed<__half>(p, s); break;
  }
  return take_error();
}

}  // namespace flashattn::cuda
