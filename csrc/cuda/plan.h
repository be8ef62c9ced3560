// The kernel plan: which CUDA kernel serves a call, chosen in one place from the call (Params), the
// GPU's limits and the overrides. Architecture first (sm90 > sm80 > simt), then dtype, head-dim
// tier and shape. Plain C++ (no CUDA header, throws nothing): compiled in every build, so that
// tests/test_plan.py checks the routing on CPU with faked GPUs (flashattn::_kernel_plan).
// dispatch.cu runs what it says; the launchers decide nothing but their grids.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "../params.h"

namespace flashattn::cuda {

// What the plan knows of the GPU and of the build.
struct DeviceInfo {
  int major = 0, minor = 0;  // compute capability
  int sms = 0;               // streaming multiprocessors
  size_t smem_optin = 0;     // shared memory a block may opt into
  // The build holds sm_90a code (the wgmma kernels): known when it is compiled (dispatch.cu).
  bool sm90a_compiled = false;
  // The warp-specialized Hopper kernel the plan chose (forward or backward) can take this call: the
  // driver encodes its TMA maps and its warpgroups' registers fit the block's pool. dispatch.cu asks
  // where the plan chooses one, and plans again without it where the answer is no.
  bool sm90_ws_ready = true;
};

// FLASHATTN_CUDA_KERNELS: which tensor-core kernels may run (tests force a family with it).
enum class KernelsOverride {
  kAuto,   // unset: the plan's choice
  kSimt,   // "simt": the SIMT kernels only (FMA products), every dtype
  kSm80,   // "sm80": no sm90/ kernel
  kWgmma,  // "wgmma": the sm90/ forwards wherever they can run, whatever the shape
};

struct Overrides {
  KernelsOverride kernels = KernelsOverride::kAuto;
  // FLASHATTN_CUDA_SMEM_LIMIT: a cap on the shared memory per block (0: none), to run on one GPU the
  // paths of GPUs with less (101376 on sm_86 / 89 / 120, 166912 on sm_80 / 87).
  int64_t smem_limit = 0;
};

// The overrides of the values FLASHATTN_CUDA_KERNELS / FLASHATTN_CUDA_SMEM_LIMIT would hold (null:
// unset); values they do not name leave the default.
Overrides parse_overrides(const char* kernels, const char* smem_limit);
// The process's overrides, read from its environment once.
const Overrides& env_overrides();

enum class FwdKernel {
  kSm90WgmmaWs,   // sm90/fwd_ws_sm90.cuh: warp-specialized, TMA producer, two 64-row consumers
  kSm90WgmmaWs3,  // ... three 64-row consumers on 96-key tiles (dim 64, rows that see >= 2048 keys)
  kSm80Decode,    // sm80/fwd_decode.cuh: few query rows per kv head
  kSm80Plain,     // sm80/fwd_sm80.cuh without optional features
  kSm80Features,  // sm80/fwd_sm80.cuh's feature variant (any call)
  kSimtWs,        // simt/fwd_simt_ws.cuh: fp32 at dim 128, P V as three TF32 products
  kSimtQres,      // simt/fwd_simt_qres.cuh: Q resident (tf32_keys: P V as three TF32 products)
  kSimt,          // simt/fwd_simt.cuh: every dtype, feature and GPU
};

struct FwdPlan {
  FwdKernel kernel = FwdKernel::kSimt;
  int tier = 0;       // head-dim tier (kSimt: of the value columns, cut into `slices`)
  int slices = 1;     // kSimt: column slices of `tier` value columns, a block each
  int tf32_keys = 0;  // kSimtQres: key tile of the TF32 P V (64, 128), 0 for FMA products
  // A paged call (block_table) that the decode kernel does not take: its pages are gathered into the
  // workspace first (common/pages.h's with_gathered_pages), and the kernel reads that copy.
  bool gather_pages = false;
};

enum class BwdKernel {
  kSm90Wgmma,      // sm90/bwd_sm90.cuh
  kSm80TwoBlocks,  // sm80/bwd_sm80_2d.cuh, two 4-warp blocks per SM (dim 64, short calls, sm_90+)
  kSm80OneSync,    // sm80/bwd_sm80_2d.cuh, one barrier per query tile
  kSm80TwoDim,     // sm80/bwd_sm80_2d.cuh, two barriers per query tile (a band or a bias allowed)
  kSm80Plain,      // sm80/bwd_sm80.cuh (1-D) without optional features
  kSm80Features,   // sm80/bwd_sm80.cuh with a band or a bias
  kSm80General,    // sm80/bwd_sm80.cuh's general per-score step (softcap, ALiBi, dropout, bias gradient)
  kSm80Compact,    // the general step with compact tiles (GPUs of 99 KB per block)
  kSimtKvres,      // simt/bwd_simt_kvres.cuh: K resident
  kSimt,           // simt/bwd_simt.cuh: every dtype, feature and GPU
};

struct BwdPlan {
  BwdKernel kernel = BwdKernel::kSimt;
  int tier = 0;    // head-dim tier (kSimt: of max(E, E_v), cut into `slices`)
  int slices = 1;  // kSimt: column slices
  // The SIMT kernels on the deterministic path: the tier of their dQ kernel (simt/bwd_simt.cuh).
  int dq_tier = 0;
  // dQ accumulators the workspace holds (schedule/key_tile_rounds.h's DqAccum): 1; on the
  // deterministic path one per block of a round where the tensor-core kernels may serve, none where
  // the SIMT kernels would (their dQ kernel writes dQ).
  int dq_accumulators = 1;
  // Keys of the fp32 dK / dV of the walks split in the dK/dV grid's last wave (schedule/tail_split.cuh).
  int64_t tail_rows = 0;
};

FwdPlan choose_fwd(const FwdParams& p, const DeviceInfo& dev, const Overrides& ov);
BwdPlan choose_bwd(const BwdParams& p, const DeviceInfo& dev, const Overrides& ov);

// "family/tier", e.g. "sm90_wgmma_ws/128", "sm80_decode/64", "simt/256x2" (two column slices),
// "sm80_features/128 on gathered pages".
std::string describe(const FwdPlan& plan);
std::string describe(const BwdPlan& plan);

}  // namespace flashattn::cuda
