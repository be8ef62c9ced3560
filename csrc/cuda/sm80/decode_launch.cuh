// The plan and launch of a decode call (fwd_decode.cuh's kernel, and decode_combine.cuh's where the walks are split
// into parts outside clusters): chunk rows, parts, clusters, the workspace.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../../params.h"
#include "../common/check.h"
#include "../common/cluster.cuh"
#include "../common/dependent_launch.cuh"
#include "decode_combine.cuh"
#include "fwd_decode.cuh"
#include "tile_config.h"

namespace flashattn::cuda::sm80 {

// The plan of a decode call: blocks per SM (smem set, asked once per device), chunks, and parts
// where the walks are fewer than the GPU's slots.
// Parts: enough to fill one wave of the GPU, each of at least kDecodeMinPartTiles key tiles (kDecodeShortPartTiles
// in caches of at most kDecodeShortTiles tiles, whose step is mostly fixed cost: H200, bf16, dim 128, 2k keys, MQA /
// GQA B1 6.8 / 7.8 -> 6.4 / 6.7 µs, MQA B16 12.3 -> 10.7), at most kDecodeMaxParts.
constexpr int64_t kDecodeMinPartTiles = 4, kDecodeShortPartTiles = 2, kDecodeShortTiles = 32, kDecodeMaxParts = 128;
// Steps run as thread block clusters on sm_90 (no workspace, no second kernel): caches of at most
// kDecodeClusterTiles tiles, whose time is mostly fixed cost, and of at most kDecodeShortTiles where only clusters
// of 2 fit (below). From 2k keys parts of 2-4 tiles and the combine kernel were faster where more parts fit.
constexpr int64_t kDecodeClusterTiles = 16;
// sm_90, a kv head's rows one chunk of at most 16 (GQA / MHA) and walks that fill >= 90% of the SMs a block an SM,
// in parts of at least kDecodeDeepPartTiles tiles: one block an SM with the deep ring (DecodeConfig::kDeepStages)
// streams faster than two of three stages (H200, bf16, dim 128, µs: GQA B1 32k 38.9 -> 36.5, B8 8k 67.7 -> 65.7, B16
// 2k 35.8 -> 33.8, MHA B4 2k 35.8 -> 34.6; paged alike). Not with shorter parts (MQA B8 8k, 16 tiles a part: 13.7 ->
// 15.3; a short part is bound by its chain of tile latencies, which two blocks an SM overlap), fewer walks (GQA B12
// 4k, 96 of 132 SMs: 53.1 -> 56.2) or MQA's two chunks a head (B64 8k, 32-row chunks: 71.4 -> 74.9; B8 32k 42.2 ->
// 42.6; paged B1 128k 29.5 -> 31.2, though dense 28.8 -> 26.1).
constexpr int64_t kDecodeDeepPartTiles = 24;

// Rows of a chunk: 32 (warp pairs: each K / V tile read once per 32 rows) where the call reads enough tiles to
// be bound by memory, else 16 (twice the blocks, half the steps per warp, one merge pass; each tile read twice,
// the second time partly from L2). walks16: the walks of 16-row chunks. H200, bf16, dim 128, MQA of 32 query
// heads, time with 32-row / 16-row chunks by walks16 x tiles per SM: <= 31 1.10-1.49x (dense) / 0.97-1.31x
// (paged), 62 0.99-1.31x / 0.84-1.15x, 124 0.92-1.04x / 0.77-0.90x, >= 248 0.82-0.90x / 0.70-0.76x.
constexpr int64_t kDecodePairTilesPerSm = 100;
inline int decode_chunk_rows(int64_t walks16, int64_t tiles, int64_t sms) {
  return walks16 * tiles >= kDecodePairTilesPerSm * sms ? kDecodeChunkRows : kDecodeSmallChunkRows;
}

// f(std::integral_constant<DecodeKv, kv>) for the call's kv: what names each variant's kernel.
template <class F>
auto with_decode_kv(DecodeKv kv, F&& f) {
  switch (kv) {
    case DecodeKv::kDense:
      return f(std::integral_constant<DecodeKv, DecodeKv::kDense>{});
    case DecodeKv::kPagedSegments:
      return f(std::integral_constant<DecodeKv, DecodeKv::kPagedSegments>{});
    default:
      return f(std::integral_constant<DecodeKv, DecodeKv::kPagedRows>{});
  }
}
constexpr const char* decode_kernel_name(DecodeKv kv) {
  return kv == DecodeKv::kDense           ? "sm80::fwd_decode_kernel"
         : kv == DecodeKv::kPagedSegments ? "sm80::fwd_decode_kernel (paged segments)"
                                          : "sm80::fwd_decode_kernel (paged rows)";
}

template <class Elem, int kDim>
struct DecodeLaunch {
  using Cfg = DecodeConfig<Elem, kDim>;
  DecodeGrid grid;
  DecodeKv kv = DecodeKv::kDense;
  int64_t walks = 0;
  bool usable = false;

  explicit DecodeLaunch(const FwdParams& p) {
    if (!Cfg::kServed || !decode_call(p) || !tensor_cores_usable(Cfg::kSmemBytes)) return;
    kv = decode_kv(p, Cfg::kBN);
    const int per_sm = blocks_per_sm_once(kv);
    if (per_sm < 1) return;
    usable = true;
    const int64_t packed = p.len_q * p.group(), tiles = (p.len_k + Cfg::kBN - 1) / Cfg::kBN;
    const int64_t sms = device_limits().sms, slots = sms * per_sm;
    const int64_t walks16 = p.batch * p.heads_kv * ((packed + Cfg::kWarpRows - 1) / Cfg::kWarpRows);
    grid.chunk_rows = decode_chunk_rows(walks16, tiles, sms);
    // sm_90, a short cache whose 16-row walks leave no room for clusters of 2 where 32-row walks do: 32-row
    // chunks, each tile read once, a cluster of 2 a walk (below; H200, bf16, dim 128, MQA B64 2k: 25.5 -> 23.9 µs,
    // cuDNN 24.6).
    const int64_t walks32 = p.batch * p.heads_kv * ((packed + kDecodeChunkRows - 1) / kDecodeChunkRows);
    if (tiles > kDecodeClusterTiles && tiles <= kDecodeShortTiles && packed > kDecodeSmallChunkRows &&
        sms / walks16 < 2 && sms / walks32 >= 2 && walks32 <= clusters_resident_once(kv, 2))
      grid.chunk_rows = kDecodeChunkRows;
    grid.chunks = int((packed + grid.chunk_rows - 1) / grid.chunk_rows);
    walks = p.batch * p.heads_kv * grid.chunks;
    int64_t parts = walks < slots ? slots / walks : 1;
    // A short cache whose walks alone fill >= 90% of the SMs: whole walks, no combine kernel (GQA B16 / MHA B4 2k
    // 37.5 / 37.1 -> 35.9 / 35.8 µs, MQA B64 1k 13.5 -> 13.1; from 4k keys two blocks per SM stream faster than
    // one: a block an SM was 1.5-3% slower at GQA B8 8k, MHA B1 32k).
    if (tiles <= kDecodeShortTiles && walks <= sms && walks * 10 >= sms * 9) parts = 1;
    const int64_t most_parts = tiles / (tiles <= kDecodeShortTiles ? kDecodeShortPartTiles : kDecodeMinPartTiles);
    parts = parts < most_parts ? parts : most_parts;
    parts = parts < kDecodeMaxParts ? parts : kDecodeMaxParts;
    grid.parts = parts > 1 ? int(parts) : 1;
    if (walks * grid.parts > 0x7fffffff) grid.parts = 1;
    // sm_90, a short step (a cache of at most kDecodeClusterTiles tiles, or of kDecodeShortTiles where the walks
    // leave room for clusters of 2: two long parts, merged in the cluster for less than a second kernel costs; H200
    // GQA B8 2k 22.6 -> 21.3 µs): each walk's parts one thread block cluster, parts of >= 2 tiles, at most one
    // block per SM in all, every cluster resident at once.
    int64_t cparts = sms / walks < tiles / 2 ? sms / walks : tiles / 2;
    cparts = cparts < kDecodeMaxClusterParts ? cparts : kDecodeMaxClusterParts;
    const bool cluster_step = tiles <= kDecodeClusterTiles || (tiles <= kDecodeShortTiles && cparts <= 2);
    if (cluster_step && cparts >= 2 && walks <= clusters_resident_once(kv, int(cparts))) {
      grid.parts = grid.cluster = int(cparts);
    }
    grid.stages = Cfg::kStages;
    if (grid.cluster == 1 && packed <= kDecodeSmallChunkRows) deepen(kv, tiles);
    if (grid_too_large(walks, "sm80::fwd_decode_kernel")) usable = false;
  }
  // The deep ring where it streams faster (kDecodeDeepPartTiles): parts of a block an SM.
  void deepen(DecodeKv kv, int64_t tiles) {
    const DeviceLimits lim = device_limits();
    if (Cfg::kDeepStages == Cfg::kStages || lim.major < 9 || env_overrides().kernels == KernelsOverride::kSm80) return;
    int64_t parts = walks < lim.sms ? lim.sms / walks : 1;
    parts = parts < kDecodeMaxParts ? parts : kDecodeMaxParts;
    if (walks * parts > lim.sms || walks * parts * 10 < lim.sms * 9 || tiles < parts * kDecodeDeepPartTiles) return;
    if (!deep_ring_opted_in(kv)) return;
    grid.parts = int(parts);
    grid.stages = Cfg::kDeepStages;
  }
  size_t smem_bytes() const { return Cfg::kQBytes + Cfg::kv_bytes(grid.stages); }
  // The parts' rows in the workspace (none where one block or one cluster takes a walk): a slot per walk and part.
  bool merges_in_workspace() const { return grid.parts > 1 && grid.cluster == 1; }
  size_t workspace_bytes() const {
    return merges_in_workspace() ? size_t(walks * grid.parts * DecodeSlot<Cfg::kRows, kDim>::kFloats) * sizeof(float)
                                 : 0;
  }

  // Blocks per SM of the call's kernel, its smem limit set first: once per device, thread and variant.
  static int blocks_per_sm_once(DecodeKv kv) {
    return with_decode_kv(kv, [](auto k) {
      constexpr DecodeKv kKv = decltype(k)::value;
      return blocks_per_sm_cached<fwd_decode_kernel<Elem, kDim, kKv, Cfg::kStages>>(Cfg::kThreads, Cfg::kSmemBytes,
                                                                                    decode_kernel_name(kKv));
    });
  }
  // Whether the deep ring's kernel may take its smem (opted in; false where the device has less).
  static bool deep_ring_opted_in(DecodeKv kv) {
    if (Cfg::kDeepSmemBytes > device_limits().smem_optin) return false;
    return with_decode_kv(kv, [](auto k) {
      constexpr DecodeKv kKv = decltype(k)::value;
      return set_smem(fwd_decode_kernel<Elem, kDim, kKv, Cfg::kDeepStages>, Cfg::kDeepSmemBytes,
                      decode_kernel_name(kKv));
    });
  }
  // f(kernel, kv name) for the planned call's kernel: its K / V form and its ring.
  template <class F>
  void with_kernel(F&& f) const {
    with_decode_kv(kv, [&](auto k) {
      constexpr DecodeKv kKv = decltype(k)::value;
      if constexpr (Cfg::kDeepStages != Cfg::kStages) {
        if (grid.stages == Cfg::kDeepStages) return f(fwd_decode_kernel<Elem, kDim, kKv, Cfg::kDeepStages>, kKv);
      }
      f(fwd_decode_kernel<Elem, kDim, kKv, Cfg::kStages>, kKv);
    });
  }
  // Clusters of `blocks` blocks of the call's kernel resident at once (0 before sm_90); its smem limit set by
  // blocks_per_sm_once.
  static int clusters_resident_once(DecodeKv kv, int blocks) {
    return with_decode_kv(kv, [&](auto k) {
      constexpr DecodeKv kKv = decltype(k)::value;
      return clusters_resident(fwd_decode_kernel<Elem, kDim, kKv, Cfg::kStages>, blocks, Cfg::kThreads,
                               Cfg::kSmemBytes);
    });
  }
};

// Launches the decode kernel where it serves the call; false (nothing launched) otherwise.
template <class Elem, int kDim>
bool launch_decode(const FwdParams& p, cudaStream_t stream) {
  using Cfg = DecodeConfig<Elem, kDim>;
  if constexpr (!Cfg::kServed) {
    return false;
  } else {
    DecodeLaunch<Elem, kDim> l(p);
    if (!l.usable) return false;
    DecodeGrid grid = l.grid;
    // The workspace the ops allocated from fwd_workspace_bytes (the same plan); whole walks without it.
    const bool combine = l.merges_in_workspace() && p.workspace != nullptr && p.workspace_bytes >= l.workspace_bytes();
    if (combine) {
      grid.partial = static_cast<float*>(p.workspace);
      const int64_t packed = p.len_q * p.group();
      grid.combine_rows = int(packed < grid.chunk_rows ? packed : grid.chunk_rows);
    } else if (l.merges_in_workspace()) {
      grid.parts = 1;
    }
    // After the step's append: its new keys not read early.
    grid.lengths = p.seqused_k;
    if (p.seqused_before != nullptr && p.seqused_k != nullptr) {
      grid.early = true;
      grid.lengths = p.seqused_before;
      grid.added = int(p.seqused_added);
      grid.q_late = p.q_from_prior;
    }
    // The step's append in this kernel: lengths before the new keys.
    if (p.new_k != nullptr) {
      grid.appends = true;
      grid.added = int(p.new_rows);
    }
    grid.set_divisors(p, l.kv);
    l.with_kernel([&](auto kernel, DecodeKv kv) {
      launch_after_prior(kernel, unsigned(l.walks * grid.parts), unsigned(grid.cluster), Cfg::kThreads, l.smem_bytes(),
                         stream, decode_kernel_name(kv), p, grid);
    });
    if (combine) {
      const int64_t rows = l.walks * grid.combine_rows;
      if (grid.parts <= kDecodeFewParts) {
        launch_after_prior(decode_combine_kernel<Elem, kDim, 1>, unsigned((rows + kDecodeCombineWarps - 1) /
                           kDecodeCombineWarps), 1, 32 * kDecodeCombineWarps, 0, stream,
                           "sm80::decode_combine_kernel (a warp a row)", p, grid);
      } else {
        launch_after_prior(decode_combine_kernel<Elem, kDim, kDecodeCombineWarps>, unsigned(rows), 1,
                           32 * kDecodeCombineWarps, 0, stream, "sm80::decode_combine_kernel", p, grid);
      }
    }
    return true;
  }
}

}  // namespace flashattn::cuda::sm80
