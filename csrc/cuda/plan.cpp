// The kernel plan (plan.h): the routing of every CUDA call, from the tile configurations' shared
// memory sizes (constexpr, host-visible headers) and the call's shape, dtype and features.
#include "plan.h"

#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>

#include "../common/pages.h"
#include "common/bias_tile_layout.h"
#include "common/operand_alignment.h"
#include "simt/resident_config.h"
#include "simt/tiers.h"
#include "sm80/bwd_forms.h"
#include "sm80/tile_config.h"
#include "sm90/tile_config.h"
#include "tensor_core_tiers.h"

namespace flashattn::cuda {

Overrides parse_overrides(const char* kernels, const char* smem_limit) {
  Overrides ov;
  if (kernels != nullptr) {
    if (std::strcmp(kernels, "simt") == 0) ov.kernels = KernelsOverride::kSimt;
    if (std::strcmp(kernels, "sm80") == 0) ov.kernels = KernelsOverride::kSm80;
    if (std::strcmp(kernels, "wgmma") == 0) ov.kernels = KernelsOverride::kWgmma;
  }
  if (smem_limit != nullptr) {
    const long long v = std::strtoll(smem_limit, nullptr, 10);
    ov.smem_limit = v > 0 ? int64_t(v) : 0;
  }
  return ov;
}

const Overrides& env_overrides() {
  static const Overrides ov =
      parse_overrides(std::getenv("FLASHATTN_CUDA_KERNELS"), std::getenv("FLASHATTN_CUDA_SMEM_LIMIT"));
  return ov;
}

namespace {

// Stands for __half / __nv_bfloat16 in the tile configurations, which read only its size.
struct Half {
  uint16_t bits;
};

bool is_half(DType t) { return t == DType::kBFloat16 || t == DType::kFloat16; }

int64_t max_dim(const FwdParams& p) { return p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v; }

// The tensor-core kernels' head-dim tier for e_max (tensor_core_tiers.h), 0 where there is none.
int tensor_core_tier(DType t, int64_t e_max) {
  if (is_half(t)) return cuda::tensor_core_tier<Half>(e_max);
  if (t == DType::kFloat64) return cuda::tensor_core_tier<double>(e_max);
  return 0;
}

// Column slices of `tier` columns covering `dim` (a SIMT kernel cuts dims above its tier: simt/tiers.h).
int slices_of(int64_t dim, int tier) { return int((dim + tier - 1) / tier); }

// What the call may take on this GPU: the shared memory per block (capped by the override), the
// architecture, whether the tensor-core kernels may run at all.
struct Limits {
  const DeviceInfo& dev;
  const Overrides& ov;
  size_t smem;

  Limits(const DeviceInfo& d, const Overrides& o)
      : dev(d), ov(o), smem(o.smem_limit > 0 && size_t(o.smem_limit) < d.smem_optin ? size_t(o.smem_limit)
                                                                                  : d.smem_optin) {}
  bool tensor_cores() const { return ov.kernels != KernelsOverride::kSimt; }
  // A tensor-core kernel of `bytes` of shared memory runs: sm_80+ and the bytes available.
  bool sm80_fits(size_t bytes) const { return dev.major >= 8 && bytes <= smem; }
  bool sm90() const { return dev.major == 9 && dev.sm90a_compiled && ov.kernels != KernelsOverride::kSm80; }
};

// The shared memory of tensor-core config Cfg with the call's bias tiles (two buffers) beside it.
template <class Cfg>
size_t with_bias_tiles(const FwdParams& p) {
  return Cfg::kSmemBytes + 2 * size_t(bias_tile_layout<Cfg::kBM, Cfg::kBN>(p).buffer_bytes());
}

// The keys a query row sees on average (causal: the mean of its band over the rows).
int64_t mean_visible_keys(const FwdParams& p) {
  if (!p.causal) return p.len_k;
  const int64_t mean = p.causal_offset + (p.len_q + 1) / 2;
  return mean < 0 ? 0 : mean > p.len_k ? p.len_k : mean;
}

// The optional features the Hopper kernels of tier kDim (kConsumers consumers in the forward) take: none,
// or a bias and nothing else: a key vector (FwdParams::key_vector_bias) at every tier; any other bias at the
// row form's tiers (sm90/tile_config.h: kFwdRowBiasTier, kBwdRowBiasTier), in the forward only bias rows
// its tensor map encodes (FwdParams::tma_row_bias: bool or 16-bit, aligned; float32 and the rest go to the
// sm80/ kernels). The backward's bias gradient goes to the general step before these kernels are asked.
template <class Elem, int kDim, int kConsumers = 2>
bool sm90_takes_features(const FwdParams& p, bool forward) {
  if (!p.has_features()) return true;
  FwdParams rest = p;
  rest.bias_kind = BiasKind::kNone;
  if (rest.has_features()) return false;
  if (p.key_vector_bias()) return true;
  return forward ? sm90::kFwdRowBiasTier<Elem, kDim, kConsumers> && p.tma_row_bias()
                 : sm90::kBwdRowBiasTier<kDim>;
}

// The shared memory of the Hopper forward with kConsumers consumers for the call: with a bias, its form's
// configuration's (a key vector's ring beside the stages; bias rows: one Q buffer, two stages of tiles).
template <class Elem, int kDim, int kConsumers>
size_t sm90_fwd_smem(const FwdParams& p) {
  using sm90::BiasForm;
  if (p.key_vector_bias()) return sm90::FwdWsConfig<Elem, kDim, kConsumers, BiasForm::kKeyVector>::kSmemBytes;
  if (p.bias_kind != BiasKind::kNone) {
    if constexpr (sm90::kFwdRowBiasTier<Elem, kDim, kConsumers>)
      return sm90::FwdWsConfig<Elem, kDim, kConsumers, BiasForm::kRows>::kSmemBytes;
    return SIZE_MAX;
  }
  return sm90::FwdWsConfig<Elem, kDim, kConsumers>::kSmemBytes;
}

// The Hopper forward of an fp16 / bf16 call that is plain or has a bias it takes, with head_dim ==
// head_dim_v == kDim: rows that see the kernel's minimum of keys, on grids of at least a block per SM
// (smaller grids go to the sm80/ kernels, which split walks over keys where the GPU has room);
// FLASHATTN_CUDA_KERNELS=wgmma drops both.
template <class Elem, int kDim>
std::optional<FwdKernel> sm90_fwd(const FwdParams& p, const Limits& lim) {
  using Ws = sm90::FwdWsConfig<Elem, kDim>;
  if (!sm90::kFwdWgmmaTier<Elem, kDim> || p.head_dim != kDim || p.head_dim_v != kDim || !lim.sm90())
    return std::nullopt;
  const bool forced = lim.ov.kernels == KernelsOverride::kWgmma;
  const int64_t keys = mean_visible_keys(p);
  auto fills_gpu = [&](int rows_per_block) {
    return (p.len_q + rows_per_block - 1) / rows_per_block * p.heads_q * p.batch >= lim.dev.sms;
  };
  if constexpr (Ws::kServed) {
    using Ws3 = sm90::FwdWsConfig<Elem, kDim, 3>;
    if constexpr (Ws3::kServed) {
      if (sm90_takes_features<Elem, kDim, 3>(p, /*forward=*/true) && keys >= Ws::kThreeConsumerKeys &&
          sm90_fwd_smem<Elem, kDim, 3>(p) <= lim.smem && lim.dev.sm90_ws_ready &&
          (forced || fills_gpu(Ws3::kBM)))
        return FwdKernel::kSm90WgmmaWs3;
    }
    const int64_t min_keys = p.causal ? Ws::kMinCausalKeys : Ws::kMinKeys;
    if (sm90_takes_features<Elem, kDim>(p, /*forward=*/true) && sm90_fwd_smem<Elem, kDim, 2>(p) <= lim.smem &&
        lim.dev.sm90_ws_ready &&
        (forced || (keys >= min_keys && fills_gpu(Ws::kBM))))
      return FwdKernel::kSm90WgmmaWs;
  }
  return std::nullopt;
}

// The tensor-core forwards of tier kDim (operands aligned): the decode kernel (few query rows per kv
// head, a KV cache's key ranges and pages allowed); the Hopper kernels (plain calls, a bias they take);
// for plain calls the plain sm80/ kernel; then the feature variant (smaller tiles), which serves any
// call its tiles fit. None for a paged call the decode kernel does not take (choose_fwd plans it on its
// gathered pages).
template <class Elem, int kDim>
std::optional<FwdKernel> tensor_core_fwd(const FwdParams& p, const Limits& lim) {
  if constexpr (sm80::DecodeConfig<Elem, kDim>::kServed) {
    if (sm80::decode_call(p) && lim.sm80_fits(sm80::DecodeConfig<Elem, kDim>::kSmemBytes))
      return FwdKernel::kSm80Decode;
  }
  if (p.is_paged()) return std::nullopt;
  if (const auto hopper = sm90_fwd<Elem, kDim>(p, lim)) return hopper;
  if (!p.has_features() && lim.sm80_fits(with_bias_tiles<sm80::FwdConfig<Elem, kDim, false>>(p)))
    return FwdKernel::kSm80Plain;
  if (lim.sm80_fits(with_bias_tiles<sm80::FwdConfig<Elem, kDim, true>>(p))) return FwdKernel::kSm80Features;
  return std::nullopt;
}

// The backward's general per-score step (more than a band and a bias).
bool needs_general_step(const BwdParams& p) { return mods_beyond_bias(p) || p.dropout_p > 0.0 || p.dbias != nullptr; }

// The tensor-core dK/dV kernels of tier kDim. Plain calls and those with a key-vector bias at dims 64 /
// 96 / 128 / 256, and those with another bias at 128 / 256 (sm90_takes_features), take the Hopper kernel on
// sm_90; calls without the general step the 2-D kernel (in its
// two-block, one-barrier or two-barrier form by shared memory and length) where it has the tier, then the
// 1-D kernel (plain calls: the forms sm80/bwd_forms.h compiles); calls with it, or that none of those
// fits, the general variant, then its compact tiles.
template <class Elem, int kDim>
std::optional<BwdKernel> tensor_core_bwd(const BwdParams& p, const Limits& lim) {
  if constexpr (!sm80::BwdConfig<Elem, kDim>::kServed) {
    return std::nullopt;
  } else {
    const bool aligned = bwd_operands_aligned(p);
    auto fits_1d = [&](auto config) { return aligned && lim.sm80_fits(with_bias_tiles<decltype(config)>(p)); };
    auto general = [&]() -> std::optional<BwdKernel> {
      if (fits_1d(sm80::BwdConfig<Elem, kDim, true>{})) return BwdKernel::kSm80General;
      if constexpr (sm80::BwdConfig<Elem, kDim, true, true>::kServed) {
        if (fits_1d(sm80::BwdConfig<Elem, kDim, true, true>{})) return BwdKernel::kSm80Compact;
      }
      return std::nullopt;
    };
    if (needs_general_step(p)) return general();
    if constexpr (sm90::BwdWsConfig<Elem, kDim>::kServed) {
      if (aligned && bwd_dkdv_rows_aligned_16(p) && lim.sm90() && lim.dev.sm90_ws_ready &&
          sm90_takes_features<Elem, kDim>(p, /*forward=*/false) &&
          p.head_dim == kDim &&
          p.head_dim_v == kDim && sm90::BwdWsConfig<Elem, kDim>::kSmemBytes <= lim.smem)
        return BwdKernel::kSm90Wgmma;
    }
    using TwoDim = sm80::Bwd2dConfig<Elem, kDim>;
    using OneSync = sm80::Bwd2dConfig<Elem, kDim, /*kOneSync=*/true>;
    using TwoBlocks = sm80::Bwd2dConfig<Elem, kDim, /*kOneSync=*/false, /*kTwoBlocks=*/true>;
    if constexpr (TwoDim::kServed) {
      if (aligned) {
        // Swizzled P / dS (one barrier, two blocks) are stored with stmatrix, their only store path: sm_90+.
        auto plain_fits = [&](auto config) {
          using C = decltype(config);
          return lim.sm80_fits(C::kSmemBytes) && (!C::kSwizzleP || lim.dev.major >= 9);
        };
        if constexpr (TwoBlocks::kServed) {
          if (!p.has_features() && p.len_q <= TwoBlocks::kTwoBlocksMaxLen && plain_fits(TwoBlocks{}))
            return BwdKernel::kSm80TwoBlocks;
        }
        if constexpr (OneSync::kServed) {
          if (!p.has_features() && plain_fits(OneSync{})) return BwdKernel::kSm80OneSync;
        }
        // (Plain calls only where that form is compiled: sm80/bwd_forms.h.)
        const bool compiled = p.has_features() || sm80::bwd_2d_plain_compiled<Elem, kDim>();
        if (compiled && lim.sm80_fits(with_bias_tiles<TwoDim>(p))) return BwdKernel::kSm80TwoDim;
      }
    }
    if (fits_1d(sm80::BwdConfig<Elem, kDim>{})) {
      if (p.has_features()) return BwdKernel::kSm80Features;
      if constexpr (sm80::bwd_1d_plain_compiled<Elem, kDim>()) return BwdKernel::kSm80Plain;
    }
    return general();
  }
}

// The dQ accumulators (BwdPlan::dq_accumulators): on the deterministic path where the tensor-core
// kernels may serve, enough for about one block per SM, at most 16 (each takes the size of dQ in fp32 /
// fp64); none where the SIMT kernels would; else one. (Tensor-core kernels that decline the call leave
// the accumulators to the SIMT kernels, which then use one or none.)
int dq_accumulators(const BwdParams& p, const Limits& lim) {
  if (!p.deterministic) return 1;
  if (p.dtype == DType::kFloat32 || !lim.tensor_cores() || lim.dev.major < 8) return 0;
  const int64_t per_head = lim.dev.sms / (p.batch * p.heads_kv);
  return int(per_head < 1 ? 1 : per_head > 16 ? 16 : per_head);
}

// Keys of dK / dV the tail split may hold (schedule/tail_split.cuh): fp16 / bf16 calls whose walks all
// take the same time (plain non-causal calls off the deterministic path, whose rounds keep their own
// order) on sm_80+: one wave of blocks of at most 128 keys per SM (kBN * blocks per SM <= 128 for every
// 2-D config), never more than the call has.
int64_t tail_rows(const BwdParams& p, const Limits& lim) {
  if (!is_half(p.dtype) || !lim.tensor_cores() || p.deterministic || p.causal || p.has_features() ||
      lim.dev.major < 8)
    return 0;
  const int64_t keys = p.batch * p.heads_kv * ((p.len_k + 127) / 128 * 128);
  return keys < int64_t(lim.dev.sms) * 128 ? keys : int64_t(lim.dev.sms) * 128;
}

}  // namespace

namespace {

// The forward's kernel for p as it lies in memory (a paged p: the decode kernel, or SIMT as a
// placeholder that choose_fwd replaces).
FwdPlan choose_fwd_in_place(const FwdParams& p, const DeviceInfo& dev, const Overrides& ov) {
  const Limits lim(dev, ov);
  const int64_t e_max = max_dim(p);
  FwdPlan plan;
  // The tensor-core kernels serve fp16, bf16 and fp64. fp32 stays on the SIMT kernels: a 3xTF32
  // tensor-core forward measured 0.87-1.09x SDPA-efficient with 5x torch's fp32 error on large logits
  // (scores ~1e4: tf32 pairs keep ~22 bits).
  const int tier = p.dtype == DType::kFloat32 || !lim.tensor_cores() ? 0 : tensor_core_tier(p.dtype, e_max);
  if (tier > 0 && fwd_operands_aligned(p)) {
    auto on_elem = [&](auto elem) {  // the tier's kernel for element type T (fp64 or a 2-byte one)
      using T = decltype(elem);
      return on_tensor_core_tier<T>(tier, [&](auto t) { return tensor_core_fwd<T, decltype(t)::value>(p, lim); });
    };
    const auto kernel = p.dtype == DType::kFloat64 ? on_elem(double{}) : on_elem(Half{});
    if (kernel) {
      plan.kernel = *kernel;
      plan.tier = tier;
      return plan;
    }
  }
  // The SIMT kernels: without optional features the Q-resident ones at E <= 64 / 128 where their
  // shared memory fits (fp32 on sm_80+: P V as three TF32 products, at 128 in the warp-specialized
  // kernel; fp16 / bf16 at 128 only: the general kernel measured faster at 64), else the general one.
  const int dim = e_max <= 64 ? 64 : 128;
  if (!p.has_features() && e_max <= 128 && (p.dtype == DType::kFloat32 || (is_half(p.dtype) && dim == 128))) {
    if (p.dtype == DType::kFloat32 && lim.tensor_cores() && dev.major >= 8) {
      if (dim == 128 && simt::WsTraits<128>::kSmemBytes <= lim.smem) {
        plan.kernel = FwdKernel::kSimtWs;
        plan.tier = 128;
        return plan;
      }
      if (dim == 64) {
        for (int keys : {128, 64}) {
          const size_t bytes = keys == 128 ? simt::QresTraits<64, true, 128>::kSmemBytes
                                           : simt::QresTraits<64, true, 64>::kSmemBytes;
          if (bytes <= lim.smem) {
            plan.kernel = FwdKernel::kSimtQres;
            plan.tier = 64;
            plan.tf32_keys = keys;
            return plan;
          }
        }
      }
    }
    const size_t fma_bytes =
        dim == 64 ? simt::QresTraits<64, false, 64>::kSmemBytes : simt::QresTraits<128, false, 64>::kSmemBytes;
    if (fma_bytes <= lim.smem) {
      plan.kernel = FwdKernel::kSimtQres;
      plan.tier = dim;
      return plan;
    }
  }
  plan.kernel = FwdKernel::kSimt;
  plan.tier = simt::tier_of(p.head_dim_v, simt::fwd_tiers(p.dtype == DType::kFloat64));
  plan.slices = slices_of(p.head_dim_v, plan.tier);
  return plan;
}

}  // namespace

FwdPlan choose_fwd(const FwdParams& p, const DeviceInfo& dev, const Overrides& ov) {
  FwdPlan plan = choose_fwd_in_place(p, dev, ov);
  if (!p.is_paged() || plan.kernel == FwdKernel::kSm80Decode) return plan;
  // Only the decode kernel reads pages in place; the others read a copy gathered into the workspace.
  plan = choose_fwd_in_place(with_gathered_pages(p), dev, ov);
  plan.gather_pages = true;
  return plan;
}

BwdPlan choose_bwd(const BwdParams& p, const DeviceInfo& dev, const Overrides& ov) {
  const Limits lim(dev, ov);
  const int64_t e_max = max_dim(p);
  BwdPlan plan;
  plan.dq_accumulators = dq_accumulators(p, lim);
  plan.tail_rows = tail_rows(p, lim);
  const int tier = p.dtype == DType::kFloat32 || !lim.tensor_cores() || plan.dq_accumulators == 0
                       ? 0
                       : tensor_core_tier(p.dtype, e_max);
  if (tier > 0) {
    auto on_elem = [&](auto elem) {  // the tier's kernel for element type T (fp64 or a 2-byte one)
      using T = decltype(elem);
      return on_tensor_core_tier<T>(tier, [&](auto t) { return tensor_core_bwd<T, decltype(t)::value>(p, lim); });
    };
    const auto kernel = p.dtype == DType::kFloat64 ? on_elem(double{}) : on_elem(Half{});
    if (kernel) {
      plan.kernel = *kernel;
      plan.tier = tier;
      return plan;
    }
  }
  // The SIMT kernels: the K-resident one at E <= 64 / 128 without features where its shared memory
  // fits, else the general one (cutting dims above its tier into column slices).
  const int simt = simt::tier_of(e_max, simt::bwd_tiers(p.dtype == DType::kFloat64));
  plan.dq_tier = simt;
  if (p.dtype != DType::kFloat64 && !p.has_features() && e_max <= 128) {
    const int dim = e_max <= 64 ? 64 : 128;
    const size_t bytes = dim == 64 ? simt::KvresTraits<64>::kSmemBytes : simt::KvresTraits<128>::kSmemBytes;
    if (bytes <= lim.smem) {
      plan.kernel = BwdKernel::kSimtKvres;
      plan.tier = dim;
      return plan;
    }
  }
  plan.kernel = BwdKernel::kSimt;
  plan.tier = simt;
  plan.slices = slices_of(e_max, plan.tier);
  return plan;
}

namespace {

const char* name_of(FwdKernel k) {
  switch (k) {
    case FwdKernel::kSm90WgmmaWs: return "sm90_wgmma_ws";
    case FwdKernel::kSm90WgmmaWs3: return "sm90_wgmma_ws3";
    case FwdKernel::kSm80Decode: return "sm80_decode";
    case FwdKernel::kSm80Plain: return "sm80_plain";
    case FwdKernel::kSm80Features: return "sm80_features";
    case FwdKernel::kSimtWs: return "simt_ws";
    case FwdKernel::kSimtQres: return "simt_qres";
    case FwdKernel::kSimt: return "simt";
  }
  return "?";
}

const char* name_of(BwdKernel k) {
  switch (k) {
    case BwdKernel::kSm90Wgmma: return "sm90_wgmma";
    case BwdKernel::kSm80TwoBlocks: return "sm80_2d_two_blocks";
    case BwdKernel::kSm80OneSync: return "sm80_2d_one_sync";
    case BwdKernel::kSm80TwoDim: return "sm80_2d";
    case BwdKernel::kSm80Plain: return "sm80_plain";
    case BwdKernel::kSm80Features: return "sm80_features";
    case BwdKernel::kSm80General: return "sm80_general";
    case BwdKernel::kSm80Compact: return "sm80_compact";
    case BwdKernel::kSimtKvres: return "simt_kvres";
    case BwdKernel::kSimt: return "simt";
  }
  return "?";
}

std::string with_tier(const char* name, int tier, int slices) {
  std::string s = std::string(name) + "/" + std::to_string(tier);
  return slices > 1 ? s + "x" + std::to_string(slices) : s;
}

}  // namespace

std::string describe(const FwdPlan& plan) {
  std::string s = with_tier(name_of(plan.kernel), plan.tier, plan.slices);
  if (plan.tf32_keys > 0) s += " tf32x" + std::to_string(plan.tf32_keys);
  return plan.gather_pages ? s + " on gathered pages" : s;
}

std::string describe(const BwdPlan& plan) { return with_tier(name_of(plan.kernel), plan.tier, plan.slices); }

}  // namespace flashattn::cuda
