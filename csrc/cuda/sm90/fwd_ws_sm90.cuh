// Warp-specialized forward on wgmma (sm_90a): plain fp16 / bf16 calls at head dims 64, 96, 128 and 256,
// those with a key-vector bias (FwdWsConfig::kKeyBias: a second producer warp stages its values per key tile,
// key_bias.cuh), those with bias rows at 64, 128 and 256 (FwdWsConfig::kRowBias: a thread of a second producer
// warp copies each key tile's bias tile with TMA), and float8 (e4m3) calls at 128. A block of a producer
// warpgroup and 64-row consumer warpgroups (three at dim 64, else two).
// In the producer one thread copies Q, K and V tiles into smem (TMA, each copy completing an
// mbarrier's phase); the consumers never wait for each other at a block barrier: they take turns at
// issuing their products (a named barrier each), so that one's softmax runs while the others' products
// use the tensor cores (FlashAttention-3's ping-pong), each besides overlapping its own softmax of tile
// i + 1 with its P V of tile i as a single warpgroup would. The producer hands registers to the
// consumers (setmaxnreg): at the launch's even share (168 per thread at 384 threads) their key loop
// spilled.
//
// On grids larger than the GPU the grid is persistent (fwd_sm90.cuh): a block per SM walks several work
// items of 64 rows per consumer, with two Q buffers (one at dim 256), so the producer copies the next
// item's Q and first K / V tiles while the consumers finish this one (its last P V and output). Causal
// items differ in length: a block takes a heavy and a light one in turn (schedule/causal_order.cuh) where
// the configuration gains by it (FwdWsConfig::kPairedMaxTiles), else the grid has a block per item.
#pragma once
#include <cuda_runtime.h>

#include <type_traits>

#include "../common/barrier.cuh"
#include "../common/tma.cuh"
#include "fwd_rows.cuh"
#include "tile_config.h"
#include "tma_map.h"

namespace flashattn::cuda::sm90 {

// The producer's one thread: every copy (TMA, a 64-column panel per box), per item K 0 with Q, V 0,
// K 1, V 1, ...; each copy's bytes complete the phase of its full barrier, and each copy into a stage
// or Q buffer waits for the consumers to have released its previous use.
template <int kDim, class Cfg, class Tile, class QAt, class KAt, class VAt>
__device__ __forceinline__ void fwd_ws_producer(const FwdParams& p, const FwdPanelMaps& maps,
                                                unsigned num_work, const FwdOrder& order, const QAt& sQ,
                                                const KAt& sK, const VAt& sV, uint64_t* const k_full,
                                                uint64_t* const v_full, uint64_t* const k_empty,
                                                uint64_t* const v_empty, uint64_t* const q_empty) {
  constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN, kStages = Cfg::kStages, kQBuffers = Cfg::kQBuffers;
  tma_prefetch_map(&maps.q);
  tma_prefetch_map(&maps.k);
  tma_prefetch_map(&maps.v);
  constexpr int kPanels = Cfg::kPanels;
  int c = 0;
  unsigned item = 0;
  for (unsigned index = blockIdx.x; index < num_work; index += gridDim.x, ++item) {
    const Tile tile(p, order, index);
    const int b = int(tile.sq.tb), hk = int(tile.hk);
    for (int i = 0; i < tile.n_tiles; ++i) {
      const int cc = c + i, stage = cc % kStages;
      const uint32_t empty_parity = uint32_t(cc / kStages - 1) & 1;
      const int n0 = int(tile.n_begin) + i * kBN;
      if (cc >= kStages) mbar_wait(k_empty + stage, empty_parity);
      if (i == 0) {
        if (item >= kQBuffers) mbar_wait(q_empty + item % kQBuffers, uint32_t(item / kQBuffers - 1) & 1);
        mbar_arrive_expect_tx(k_full + stage, Cfg::kQBytes + Cfg::kKvBytes);
#pragma unroll
        for (int pn = 0; pn < kPanels; ++pn)
          tma_load_4d(sQ(item % kQBuffers) + pn * kBM * 128, &maps.q, k_full + stage, Cfg::kPanelCols * pn, int(tile.m0),
                      int(tile.h), b);
      } else {
        mbar_arrive_expect_tx(k_full + stage, Cfg::kKvBytes);
      }
#pragma unroll
      for (int pn = 0; pn < kPanels; ++pn)
        tma_load_4d(sK(stage) + pn * kBN * 128, &maps.k, k_full + stage, Cfg::kPanelCols * pn, n0, hk, b);
      if (cc >= kStages) mbar_wait(v_empty + stage, empty_parity);
      mbar_arrive_expect_tx(v_full + stage, Cfg::kKvBytes);
      if constexpr (Cfg::kFp8) {
        // V^T (batch, heads, dims, keys): boxes of kDim lines of 64 keys (64-byte lines), one per panel.
        constexpr int kPanelKeys = Cfg::kVtPanelKeys;
        static_assert(Cfg::kBN % kPanelKeys == 0, "a float8 V^T tile is whole panels");
#pragma unroll
        for (int pn = 0; pn < kBN / kPanelKeys; ++pn)
          tma_load_4d(sV(stage) + pn * kDim * kPanelKeys, &maps.v, v_full + stage, n0 + kPanelKeys * pn, 0, hk, b);
      } else {
#pragma unroll
        for (int pn = 0; pn < kPanels; ++pn) tma_load_4d(sV(stage) + pn * kBN * 128, &maps.v, v_full + stage, 64 * pn, n0, hk, b);
      }
    }
    c += tile.n_tiles;
  }
}

// The forward's mbarriers: a full and an empty one per K and V stage (the producer's one thread and
// the consumers' threads), an empty one per Q buffer; with a key-vector bias a full one (its producer
// warp's lanes) and an empty one per stage of its ring; with bias rows a full one (the TMA copy) and an
// empty one (that consumer's threads) per stage and consumer half.
template <class Cfg>
__device__ __forceinline__ void fwd_ws_init_barriers(uint64_t* const k_full, uint64_t* const v_full,
                                                     uint64_t* const k_empty, uint64_t* const v_empty,
                                                     uint64_t* const q_empty, uint64_t* const bias_full,
                                                     uint64_t* const bias_empty, uint64_t* const row_bias_bars) {
  for (int s = 0; s < Cfg::kStages; ++s) {
    mbar_init(k_full + s, 1);
    mbar_init(v_full + s, 1);
    mbar_init(k_empty + s, 128 * Cfg::kConsumers);
    mbar_init(v_empty + s, 128 * Cfg::kConsumers);
  }
  for (int b = 0; b < Cfg::kQBuffers; ++b) mbar_init(q_empty + b, 128 * Cfg::kConsumers);
  if constexpr (Cfg::kKeyBias) {
    for (int s = 0; s < Cfg::kBiasStages; ++s) {
      mbar_init(bias_full + s, 32);
      mbar_init(bias_empty + s, 128 * Cfg::kConsumers);
    }
  }
  if constexpr (Cfg::kRowBias) {
    for (int s = 0; s < 2 * Cfg::kRowBiasStages; ++s) {
      mbar_init(row_bias_bars + s, 1);
      mbar_init(row_bias_bars + 2 * Cfg::kRowBiasStages + s, 128);
    }
  }
  fence_mbar_init();
}

// The ring of a key-vector bias (FwdWsConfig::kKeyBias): the block's c-th key tile's kBN values lie in
// stage c % kBiasStages, and the mbarriers' phases follow c / kBiasStages.
template <class Cfg>
struct FwdKeyBiasRing {
  float* values;  // kBiasStages tiles of kBN fp32
  uint64_t *full, *empty;
  __device__ __forceinline__ float* at(int cc) const { return values + (cc % Cfg::kBiasStages) * Cfg::kBN; }
  __device__ __forceinline__ void wait(int cc) const {
    mbar_wait(full + cc % Cfg::kBiasStages, uint32_t(cc / Cfg::kBiasStages) & 1);
  }
  __device__ __forceinline__ void release(int cc) const { mbar_arrive(empty + cc % Cfg::kBiasStages); }
};

// The key-vector bias's producer warp: per key tile, in the order of the K / V stages, the tile's kBN
// values into its stage of the ring (lane l: keys l, l + 32, ...) once the consumers have released the
// stage's previous tile; the lanes' arrivals after their stores complete the stage's full mbarrier. Its
// loads run ahead of the consumers' softmax by up to kBiasStages tiles.
template <class Elem, class Cfg, class Tile>
__device__ __forceinline__ void fwd_ws_key_bias_producer(const FwdParams& p, unsigned num_work,
                                                         const FwdOrder& order, const FwdKeyBiasRing<Cfg>& ring,
                                                         int lane) {
  constexpr int kBN = Cfg::kBN, kStages = Cfg::kBiasStages, kPerLane = kBN / 32;
  with_key_reader<Elem>(p, [&](auto key_value) {
    int c = 0;
    for (unsigned index = blockIdx.x; index < num_work; index += gridDim.x) {
      const Tile tile(p, order, index);
      // (32-bit key indices: the tensor maps limit len_k to 2^31 - 1)
      const int n_tiles = tile.n_tiles, first = int(tile.n_begin) + lane;
      const unsigned char* const keys = bias_element(p, tile.sq, 0, 0, 0);
      for (int i = 0; i < n_tiles; ++i, ++c) {
        if (c >= kStages) mbar_wait(ring.empty + c % kStages, uint32_t(c / kStages - 1) & 1);
        float v[kPerLane];
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) v[k] = key_value(keys, first + i * kBN + 32 * k);
        float* const dst = ring.at(c) + lane;
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) dst[32 * k] = v[k];
        mbar_arrive(ring.full + c % kStages);
      }
    }
  });
}

// Bias rows (FwdWsConfig::kRowBias): the block's c-th key tile's bias tile lies in stage c % kRowBiasStages,
// consumer w's 64 rows in its half w, each half with a full and an empty mbarrier (index 2 * stage + w),
// whose phases follow c / kRowBiasStages.
template <class Cfg>
struct FwdRowBiasRing {
  unsigned char* tiles;
  uint64_t *full, *empty;
  __device__ __forceinline__ unsigned char* half(int cc, int w) const {
    return tiles + (cc % Cfg::kRowBiasStages) * Cfg::kRowBiasTileBytes + w * Cfg::kRowBiasHalfBytes;
  }
  __device__ __forceinline__ int bar(int cc, int w) const { return 2 * (cc % Cfg::kRowBiasStages) + w; }
  __device__ __forceinline__ void wait(int cc, int w) const {
    mbar_wait(full + bar(cc, w), uint32_t(cc / Cfg::kRowBiasStages) & 1);
  }
  __device__ __forceinline__ void release(int cc, int w) const { mbar_arrive(empty + bar(cc, w)); }
};

// The bias rows' producer (one thread of a second producer warp): per key tile, in the order of the K / V
// stages, each consumer half's 64 rows x kBN keys (TMA, panels of encode_row_bias_map's boxes) once that
// consumer has released the stage's previous tile, in the bias's dims (a broadcast one at coordinate 0).
template <class Cfg, class Tile>
__device__ __forceinline__ void fwd_ws_row_bias_producer(const FwdParams& p, const FwdMaps& maps,
                                                         unsigned num_work, const FwdOrder& order,
                                                         const FwdRowBiasRing<Cfg>& ring) {
  constexpr int kBN = Cfg::kBN, kStages = Cfg::kRowBiasStages;
  tma_prefetch_map(&maps.bias);
  const int bytes = p.bias_kind == BiasKind::kBool ? 1 : 2;
  const int panel_keys = kBN * bytes < 128 ? kBN : 128 / bytes, panels = kBN / panel_keys;
  const bool by_head = p.bias_stride[1] != 0, by_batch = p.bias_stride[0] != 0;
  int c = 0;
  for (unsigned index = blockIdx.x; index < num_work; index += gridDim.x) {
    const Tile tile(p, order, index);
    const int b = by_batch ? int(tile.sq.b) : 0, h = by_head ? int(tile.h) : 0;
    for (int i = 0; i < tile.n_tiles; ++i, ++c) {
      const int n0 = int(tile.n_begin) + i * kBN;
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        if (c >= kStages) mbar_wait(ring.empty + ring.bar(c, w), uint32_t(c / kStages - 1) & 1);
        mbar_arrive_expect_tx(ring.full + ring.bar(c, w), uint32_t(64 * kBN * bytes));
        for (int pn = 0; pn < panels; ++pn)
          tma_load_4d(ring.half(c, w) + pn * 64 * panel_keys * bytes, &maps.bias, ring.full + ring.bar(c, w),
                      n0 + pn * panel_keys, int(tile.m0) + 64 * w, h, b);
      }
    }
  }
}

// The consumers' side of the K and V stages: the block's c-th K and V tiles lie in stage c % kStages, and
// the mbarriers' phases follow c / kStages.
template <class Cfg>
struct FwdWsRing {
  unsigned char* kv_tiles;  // kStages K tiles, then kStages V tiles
  uint64_t *k_full, *v_full, *k_empty, *v_empty;
  __device__ __forceinline__ uint32_t k_at(int cc) const {
    return smem_addr(kv_tiles + (cc % Cfg::kStages) * Cfg::kKvBytes);
  }
  __device__ __forceinline__ uint32_t v_at(int cc) const {
    return smem_addr(kv_tiles + (Cfg::kStages + cc % Cfg::kStages) * Cfg::kKvBytes);
  }
  __device__ __forceinline__ void wait_k(int cc) const {
    mbar_wait(k_full + cc % Cfg::kStages, uint32_t(cc / Cfg::kStages) & 1);
  }
  __device__ __forceinline__ void wait_v(int cc) const {
    mbar_wait(v_full + cc % Cfg::kStages, uint32_t(cc / Cfg::kStages) & 1);
  }
  __device__ __forceinline__ void release_k(int cc) const { mbar_arrive(k_empty + cc % Cfg::kStages); }
  __device__ __forceinline__ void release_v(int cc) const { mbar_arrive(v_empty + cc % Cfg::kStages); }
};

// A consumer warpgroup's turn at the tensor cores: after the named barrier `mine`, then handing the
// next turn on (the kernel's comment tells the order).
struct FwdWsTurns {
  int mine, next;
  __device__ __forceinline__ void take() const { bar_sync(mine, 256); }
  __device__ __forceinline__ void pass() const { bar_arrive(next, 256); }
};

// The turn of an item's first S (Q of item q_item, key tile kc, its K landed with the item's Q), with no P V to issue.
template <class Rows, class QAt, class Ring>
__device__ __forceinline__ void fwd_ws_first_scores(typename Rows::Scores& s, const QAt& q_at, unsigned q_item, int kc,
                                                    const FwdWsTurns& turns, const Ring& ring) {
  ring.wait_k(kc);
  turns.take();
  wgmma_fence();
  Rows::issue_scores(s, q_at(q_item), ring.k_at(kc));
  turns.pass();
  wgmma_wait<0>();
  pin(s);
  ring.release_k(kc);
}

// One turn of the key loop: S of key tile kc (Q of item q_item) issued with P V of key tile vc (O rescaled first);
// `under` (the softmax of those scores) runs while the P V does.
template <class Rows, class QAt, class Ring, class Under>
__device__ __forceinline__ void fwd_ws_scores_with_pv(Rows& w, typename Rows::Probs& pa, const float (&alpha)[2],
                                                      typename Rows::Scores& s, const QAt& q_at, unsigned q_item,
                                                      int kc, int vc, const FwdWsTurns& turns, const Ring& ring,
                                                      Under&& under) {
  ring.wait_k(kc);
  turns.take();
  wgmma_fence();
  Rows::issue_scores(s, q_at(q_item), ring.k_at(kc));
  w.rescale_o(alpha);
  pin(w.o);
  ring.wait_v(vc);
  wgmma_fence();
  w.issue_pv(pa, ring.v_at(vc));
  turns.pass();
  wgmma_wait<1>();
  pin(s);
  ring.release_k(kc);
  under();
  wgmma_wait<0>();
  pin(w.o);
  pin(pa);
  ring.release_v(vc);
}

// The turn of an item's last P V (of key tile vc) where no S goes with it.
template <class Rows, class Ring>
__device__ __forceinline__ void fwd_ws_last_pv(Rows& w, const typename Rows::Probs& pa, const float (&alpha)[2], int vc,
                                               const FwdWsTurns& turns, const Ring& ring) {
  turns.take();
  w.rescale_o(alpha);
  pin(w.o);
  ring.wait_v(vc);
  wgmma_fence();
  w.issue_pv(pa, ring.v_at(vc));
  turns.pass();
  wgmma_wait<0>();
  pin(w.o);
  ring.release_v(vc);
}

// The turns of a consumer warpgroup without rows in an item (at a sequence's end), where items are not
// carried: the active ones' first S, n_tiles - 1 turns of S and P V, and the last P V, with no
// product; each tile released once it has landed (so that the arrival cannot count towards the
// stage's previous use), and on_tile(c) run for key tile c in its turn (a key-vector bias: its stage
// of the ring released likewise).
template <class Ring, class OnTile>
__device__ __forceinline__ void fwd_ws_idle_turns(int c0, int n_tiles, const FwdWsTurns& turns, const Ring& ring,
                                                  const OnTile& on_tile) {
  for (int i = 0; i <= n_tiles; ++i) {
    if (i < n_tiles) ring.wait_k(c0 + i);
    turns.take();
    turns.pass();
    if (i < n_tiles) {
      ring.release_k(c0 + i);
      on_tile(c0 + i);
    }
    if (i > 0) {
      ring.wait_v(c0 + i - 1);
      ring.release_v(c0 + i - 1);
    }
  }
}

// A consumer's online softmax of an item's key tile i (its scores in s; the lane's rows g and g + 8 of the
// warp's 16 from wrow in the item's tile): with a key-vector bias plus the values of the bias ring's stage of
// the block's key tile `count`, with bias rows plus its half of that key tile's bias tile (both taken and
// released in the block's key-tile order). (The row and key arguments are written out in each call: taken
// into locals they changed ptxas's allocation of the kernels.)
template <class Cfg, class Elem, class Rows, class Item>
__device__ __forceinline__ void fwd_ws_softmax(Rows& w, typename Rows::Scores& s, const Item& tile, int i,
                                               const FwdParams& p, const FwdKeyBiasRing<Cfg>& bias_ring,
                                               const FwdRowBiasRing<Cfg>& row_ring, int& count, int cwg, int wrow,
                                               int warp, int g, int t, float score_scale, float (&alpha)[2]) {
  if constexpr (Cfg::kKeyBias) {
    bias_ring.wait(count);
    w.softmax(s, tile, tile.m0 + wrow + g, tile.n_begin + decltype(tile.n_begin)(i) * Cfg::kBN, t, score_scale, alpha,
              KeyTileTerms{bias_ring.at(count)});
    bias_ring.release(count++);
  } else if constexpr (Cfg::kRowBias) {
    row_ring.wait(count, cwg);
    w.softmax(s, tile, tile.m0 + wrow + g, tile.n_begin + decltype(tile.n_begin)(i) * Cfg::kBN, t, score_scale, alpha,
              RowTileTerms<Elem>{row_ring.half(count, cwg), warp * 16 + g, p.bias_kind == BiasKind::kBool});
    row_ring.release(count++, cwg);
  } else {
    w.softmax(s, tile, tile.m0 + wrow + g, tile.n_begin + decltype(tile.n_begin)(i) * Cfg::kBN, t, score_scale, alpha);
  }
}

// A consumer's output of an item, its rows of the item's Q buffer then released (only this warpgroup's
// products read them; one with no rows in the item stores none): float8 staged in a buffer of its own; with
// the early Q release from the registers (the buffer released after the item's last S, here only where the
// item has no key tile); else staged through those rows of the Q buffer.
template <class Cfg, class Rows, class Item>
__device__ __forceinline__ void fwd_ws_store(Rows& w, const FwdParams& p, const Item& tile, unsigned item,
                                             unsigned char* tiles, uint64_t* q_empty, int cwg, int wrow, int lane,
                                             float out_scale) {
  constexpr int kQBuffers = Cfg::kQBuffers;
  if constexpr (Cfg::kFp8) {
    __syncwarp();  // the warp's reads of the previous item's staged rows before these writes
    w.store(tiles + Cfg::kOutStageOffset, p, Rows::dest(p, tile), wrow, lane, out_scale);
  } else if constexpr (Cfg::kEarlyQRelease) {
    static_assert(Cfg::kConsumers == 2, "every consumer has rows in each item");
    w.store_direct(p, Rows::dest(p, tile), wrow, lane);
    if (tile.n_tiles == 0) mbar_arrive(q_empty + item % kQBuffers);
    // (a compiler barrier: without it the stores sink into the next item's key loop and take its
    // registers, 4.5 KB of spills)
    asm volatile("" ::: "memory");
    return;
  } else if (Cfg::kConsumers == 2 || cwg * 64 < tile.rows) {
    w.store(tiles + (item % kQBuffers) * Cfg::kQBytes, p, Rows::dest(p, tile), wrow, lane);
  }
  fence_proxy_async();  // the staging's smem writes before the producer's next TMA copy there
  mbar_arrive(q_empty + item % kQBuffers);
}

// The maps a kernel of configuration Cfg takes: the panels, and the bias tiles' map with bias rows.
template <class Cfg>
using FwdKernelMaps = std::conditional_t<Cfg::kRowBias, FwdMaps, FwdPanelMaps>;

template <class Elem, int kDim, class Cfg = FwdWsConfig<Elem, kDim>>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fwd_ws_kernel(const FwdParams p, const __grid_constant__ FwdKernelMaps<Cfg> maps, unsigned num_work,
                  FwdOrder order) {
#ifdef FLASHATTN_WGMMA
  using Exp = ExpDomain<float>;
  constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN, kStages = Cfg::kStages, kQBuffers = Cfg::kQBuffers;
  using Rows = FwdRows<Elem, kDim, kBN, kBM>;
  using Tile = FwdTile<kBM, kBN, (Cfg::kPairedMaxTiles > 0)>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* const tiles = align_1024(smem_raw);
  auto sQ = [&](int buf) { return tiles + buf * Cfg::kQBytes; };
  unsigned char* const kv_tiles = tiles + kQBuffers * Cfg::kQBytes;
  auto sK = [&](int stage) { return kv_tiles + stage * Cfg::kKvBytes; };
  auto sV = [&](int stage) { return kv_tiles + (kStages + stage) * Cfg::kKvBytes; };
  uint64_t* const bars = reinterpret_cast<uint64_t*>(tiles + Cfg::kBarOffset);
  uint64_t* const k_full = bars;                  // the producer's copies: K c landed (with Q at an item's K 0)
  uint64_t* const v_full = bars + kStages;        // ... V c landed
  uint64_t* const k_empty = bars + 2 * kStages;   // the consumers' 256 threads: done reading K c
  uint64_t* const v_empty = bars + 3 * kStages;   // ... V c
  uint64_t* const q_empty = bars + 4 * kStages;   // ... done with Q buffer b (the output staged through it)
  uint64_t* const bias_bars = reinterpret_cast<uint64_t*>(tiles + Cfg::kBiasBarOffset);
  // (a key-vector bias: its producer warp's tile c landed; the consumers are done with it)
  const FwdKeyBiasRing<Cfg> bias_ring{reinterpret_cast<float*>(tiles + Cfg::kBiasOffset), bias_bars,
                                      bias_bars + Cfg::kBiasStages};
  // (bias rows: their tiles after the K / V stages, their full and empty mbarriers after the others)
  uint64_t* const row_bias_bars = bars + 4 * kStages + kQBuffers;
  const FwdRowBiasRing<Cfg> row_ring{tiles + Cfg::kRowBiasOffset, row_bias_bars,
                                     row_bias_bars + 2 * Cfg::kRowBiasStages};

  const int tid = threadIdx.x, wg = tid / 128;
  if (tid == 0)
    fwd_ws_init_barriers<Cfg>(k_full, v_full, k_empty, v_empty, q_empty, bias_ring.full, bias_ring.empty,
                              row_bias_bars);
  __syncthreads();

  // A block takes work items blockIdx.x, + gridDim.x, ... (one where the grid has a block per item);
  // item k of the block uses Q buffer k % kQBuffers. Key tiles count on across the block's items: its c-th
  // K and V tiles take stage c % kStages, and the mbarriers' phases follow c / kStages.
  if (wg == 0) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if constexpr (Cfg::kKeyBias) {
      if (tid / 32 == 1) {
        fwd_ws_key_bias_producer<Elem, Cfg, Tile>(p, num_work, order, bias_ring, tid & 31);
        return;
      }
    }
    if constexpr (Cfg::kRowBias) {
      if (tid == 32) fwd_ws_row_bias_producer<Cfg, Tile>(p, maps, num_work, order, row_ring);
    }
    if (tid != 0) return;
    fwd_ws_producer<kDim, Cfg, Tile>(p, maps, num_work, order, sQ, sK, sV, k_full, v_full, k_empty,
                                     v_empty, q_empty);
    return;
  }

  setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int cwg = wg - 1, lane = tid & 31, warp = (tid / 32) % 4;
  const int g = lane / 4, t = lane % 4;
  const int wrow = cwg * 64 + warp * 16;
  const float score_scale = Exp::score_scale(p.scale);
  // The consumers' turns at the tensor cores over the block's whole stream of issues (every item's,
  // the same for all): warpgroup c issues after bar_sync(1 + c), then lets the next one issue
  // (bar_arrive(1 + (c + 1) % kConsumers)). The last lends the first its first turn; the first takes
  // the last one's final hand-over at the end.
  constexpr int kConsumers = Cfg::kConsumers;
  const FwdWsTurns turns{1 + cwg, kConsumers == 2 ? 2 - cwg : 1 + (cwg + 1) % kConsumers};
  if (cwg == kConsumers - 1) turns.pass();

  // Where an item's next item has keys, its last P V is issued with the next item's S 0, whose softmax
  // then runs under that P V (the output of the item after it): `started` marks an item whose S 0 is
  // thus already in pa.
  const FwdWsRing<Cfg> ring{kv_tiles, k_full, v_full, k_empty, v_empty};
  // This warpgroup's Q rows. (Its index broadcast from lane 0: ptxas then knows that it is the same across
  // the warp and builds the products' smem descriptors in uniform registers, not per lane.)
  const int uniform_cwg = __shfl_sync(0xffffffffu, cwg, 0);
  auto q_at = [&](unsigned item) { return smem_addr(sQ(item % kQBuffers)) + uniform_cwg * 64 * 128; };
  Rows w;
  typename Rows::Probs pa;
  float alpha[2] = {1.f, 1.f};  // rescales O before the next P V
  // The work item's state through the key loop: the whole FwdTile, or where the consumers have few
  // registers to spare (Cfg::kCompactItems) its 32-bit view, FwdKeys.
  using Item = std::conditional_t<Cfg::kCompactItems, FwdKeys, Tile>;
  // Float8: the current item's softmax scale, with its (batch, kv head)'s q_descale * k_descale, and its
  // v_descale (set with each item taken).
  float item_score_scale = score_scale, item_out_scale = 1.f;
  auto item_at = [&](unsigned index) -> Item {
    const Tile tile(p, order, index);
    if constexpr (Cfg::kFp8) {
      const int64_t at = tile.sq.tb * p.heads_kv + tile.hk;
      item_score_scale = Exp::score_scale(p.scale * double(p.qk_descale[at]));
      item_out_scale = p.v_descale[at];
    }
    if constexpr (Cfg::kCompactItems)
      return tile.keys(tile.m0 + wrow + g);
    else
      return tile;
  };
  // With a key-vector bias the softmax reads the stage of the bias ring of the block's key tile bias_count:
  // the consumers take the block's key tiles in order, each once (a consumer without rows in an item
  // releases its tiles in fwd_ws_idle_turns).
  int bias_count = 0;
  auto softmax = [&](typename Rows::Scores& s, const Item& tile, int i) {
    fwd_ws_softmax<Cfg, Elem>(w, s, tile, i, p, bias_ring, row_ring, bias_count, cwg, wrow, warp, g, t,
                              Cfg::kFp8 ? item_score_scale : score_scale, alpha);
  };
  // (the output scale passed: a carried item is stored after the next item's descales were taken)
  auto store = [&](const Item& tile, unsigned item, float out_scale) {
    fwd_ws_store<Cfg>(w, p, tile, item, tiles, q_empty, cwg, wrow, lane, out_scale);
  };

  // (item declared before c: in the other order the compiler numbers the loop's values otherwise and
  // ptxas allocates registers differently from the measured kernels)
  unsigned item = 0;
  int c = 0;  // the block's key tiles before this item
  bool started = false;
  Item tile = item_at(blockIdx.x);
  for (unsigned index = blockIdx.x; index < num_work; index += gridDim.x, ++item) {
    const int n_tiles = tile.n_tiles;
    if constexpr (kConsumers == 3) {
      if (cwg * 64 >= tile.rows) {
        if (n_tiles > 0) fwd_ws_idle_turns(c, n_tiles, turns, ring, [&](int kc) {
          if constexpr (Cfg::kKeyBias) {
            bias_ring.wait(kc);
            bias_ring.release(kc);
            ++bias_count;
          }
        });
        store(tile, item, item_out_scale);
        c += n_tiles;
        if (index + gridDim.x < num_work) tile = item_at(index + gridDim.x);
        continue;
      }
    }
    // (kEarlyQRelease: Q released once the item's last S is done, beside that tile's K)
    auto last_s_done = [&](int i) {
      if constexpr (Cfg::kEarlyQRelease) {
        if (i + 1 == n_tiles) mbar_arrive(q_empty + item % kQBuffers);
      }
    };
    if (n_tiles > 0 && !started) {
      typename Rows::Scores s;
      fwd_ws_first_scores<Rows>(s, q_at, item, c, turns, ring);
      last_s_done(0);
      softmax(s, tile, 0);
      Rows::pack_p(s, pa);
    }
    for (int i = 0; i + 1 < n_tiles; ++i) {
      typename Rows::Scores s;
      fwd_ws_scores_with_pv(w, pa, alpha, s, q_at, item, c + i + 1, c + i, turns, ring, [&] {
        last_s_done(i + 1);
        softmax(s, tile, i + 1);
      });
      Rows::pack_p(s, pa);
    }
    const unsigned next_index = index + gridDim.x;
    const int last = c + n_tiles - 1;
    bool carried = false;  // this item's last P V issued with the next item's S 0, whose softmax runs under it
    const float out_scale = item_out_scale;  // this item's (item_at below takes the next one's)
    if constexpr (Cfg::kCarryAcrossItems) {
      if (n_tiles > 0 && next_index < num_work) {
        const Item next = item_at(next_index);
        if (next.n_tiles > 0) {
          typename Rows::Scores s;
          // The row maxima and sums not in w: this item's while the next item's start afresh in w, then
          // (swapped back for this item's output) the next item's.
          float aside_max[2], aside_sum[2];
          fwd_ws_scores_with_pv(w, pa, alpha, s, q_at, item + 1, last + 1, last, turns, ring, [&] {
            w.set_aside_stats(aside_max, aside_sum);
            softmax(s, next, 0);
          });
          w.swap_stats(aside_max, aside_sum);
          store(tile, item, out_scale);
          w.zero_output();
          w.take_stats(aside_max, aside_sum);
          Rows::pack_p(s, pa);
          tile = next;
          carried = true;
        }
      }
    }
    if (!carried) {
      if (n_tiles > 0) {
        fwd_ws_last_pv(w, pa, alpha, last, turns, ring);
        store(tile, item, out_scale);
        w = Rows();
      } else {
        store(tile, item, out_scale);  // no key: zeros, lse -inf
      }
      if (next_index < num_work) tile = item_at(next_index);
    }
    started = carried;
    c += n_tiles;
  }
  if (cwg == 0) turns.take();  // the last warpgroup's final hand-over
#endif
}

}  // namespace flashattn::cuda::sm90
