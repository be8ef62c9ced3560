// Warp-specialized forward on wgmma (sm_90a): plain fp16 / bf16 calls at head dims 64 and 128. A
// block of three warpgroups: the first copies Q, K and V tiles into smem (cp.async, then each copy's
// landing published through an mbarrier), the other two take 64 query rows each and never wait for
// each other at a block barrier: they take turns at issuing their products (two named barriers), so
// that one's softmax runs while the other's products use the tensor cores (FlashAttention-3's
// ping-pong), each besides overlapping its own softmax of tile i + 1 with its P V of tile i as
// fwd_sm90.cuh does. The producer hands registers to the consumers (setmaxnreg): at the 168 per
// thread that 384 threads get, the consumers' key loop spilled.
//
// On non-causal grids larger than the GPU the grid is persistent (fwd_sm90.cu): a block per SM walks
// several 128-row work items, with two Q buffers, so the producer copies the next item's Q and first
// K / V tiles while the consumers finish this one (its last P V and output); a block per item
// otherwise (causal items differ in length, which fixed shares per block would leave unbalanced).
#pragma once
#include "fwd_sm90.cuh"
#include "../common/barrier.cuh"

namespace flashattn::cuda::sm90 {

template <class Elem, int kDim>
struct FwdWsConfig {
  static constexpr bool kServed = kFwdWgmmaTier<Elem, kDim> && (kDim == 64 || kDim == 128);
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kBM = 64 * kConsumers, kBN = 128, kStages = 2;
  static constexpr uint32_t kQBytes = kBM * kDim * 2, kKvBytes = kBN * kDim * 2;
  static constexpr uint32_t kBarOffset = 2 * kQBytes + 2 * kStages * kKvBytes;
  // Two Q buffers, the K and V stages, the mbarriers (K / V full and empty per stage, Q empty per
  // buffer), and room to align to 1024: 97 KB at dim 64, 193 KB at 128.
  static constexpr size_t kSmemBytes = kBarOffset + (4 * kStages + 2) * 8 + 1024;
  // Registers per thread after the hand-over (128 x producer + 256 x consumer <= 384 x 168, the
  // launch's pool). Dim 128: the consumers need ~230; the producer then copies in a rolled loop (at
  // 24 its unrolled copies spilled 452 B).
  static constexpr int kProducerRegs = kDim == 64 ? 64 : 40, kConsumerRegs = kDim == 64 ? 216 : 232;
  static constexpr bool kRolledCopies = kDim != 64;
  // Taken (fwd_sm90.cu) non-causal where rows see at least kMinKeys keys; causal at dim 64 where they
  // see on average kMinCausalKeys (dim 128's causal calls take fwd_sm90.cuh's kernel). H100, bf16,
  // forward TFLOP/s, three interleaved rounds (benchmarks/NOTES_sm90.md Version 4), non-causal, this
  // kernel / fwd_sm90.cuh's / the sm80/ one / SDPA-flash: dim 128 L = 512 355 / 333 / 312 / 284,
  // 1024 391 / 383 / 336 / 324, 2048 418 / 412 / 351 / 324; dim 64 (this / sm80/ / flash) L = 512
  // 256 / 267 / 250, 1024 309 / 294 / 275, 8192 351 / 330 / 300. Causal, one block per item (the
  // 2-warpgroup kernel / the sm80/ one): dim 64 L = 2048 282 / 295, 8192 357 / 339, 16384 360 / 343;
  // dim 128 (this / fwd_sm90.cuh's or sm80/'s) L = 512 159 / 196, 1024 249 / 294, 2048 367 / 373.
  static constexpr int64_t kMinKeys = kDim == 64 ? 1024 : 512;
  static constexpr int64_t kMinCausalKeys = kDim == 64 ? 4096 : -1;  // -1: never
};

template <class Elem, int kDim>
__global__ void __launch_bounds__(FwdWsConfig<Elem, kDim>::kThreads, 1)
    fwd_ws_kernel(const FwdParams p, int num_m_tiles, unsigned num_work, sm80::HeavyLast order) {
#ifdef FLASHATTN_WGMMA
  using Cfg = FwdWsConfig<Elem, kDim>;
  using Exp = ExpDomain<float>;
  constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN, kStages = Cfg::kStages;
  using Rows = FwdRows<Elem, kDim, kBN, kBM>;
  using Tile = FwdTile<kBM, kBN>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* const tiles = align_1024(smem_raw);
  auto sQ = [&](int buf) { return tiles + buf * Cfg::kQBytes; };
  unsigned char* const kv_tiles = tiles + 2 * Cfg::kQBytes;
  auto sK = [&](int stage) { return kv_tiles + stage * Cfg::kKvBytes; };
  auto sV = [&](int stage) { return kv_tiles + (kStages + stage) * Cfg::kKvBytes; };
  uint64_t* const bars = reinterpret_cast<uint64_t*>(tiles + Cfg::kBarOffset);
  uint64_t* const k_full = bars;                  // the producer's 128 threads: K c landed (with Q at an item's K 0)
  uint64_t* const v_full = bars + kStages;        // ... V c landed
  uint64_t* const k_empty = bars + 2 * kStages;   // the consumers' 256 threads: done reading K c
  uint64_t* const v_empty = bars + 3 * kStages;   // ... V c
  uint64_t* const q_empty = bars + 4 * kStages;   // ... done with Q buffer b (the output staged through it)

  const int tid = threadIdx.x, wg = tid / 128;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(k_full + s, 128);
      mbar_init(v_full + s, 128);
      mbar_init(k_empty + s, 128 * Cfg::kConsumers);
      mbar_init(v_empty + s, 128 * Cfg::kConsumers);
    }
    for (int b = 0; b < 2; ++b) mbar_init(q_empty + b, 128 * Cfg::kConsumers);
  }
  __syncthreads();

  // A block takes work items blockIdx.x, + gridDim.x, ... (one where the grid has a block per item);
  // item k of the block uses Q buffer k % 2. Key tiles count on across the block's items: its c-th
  // K and V tiles take stage c % kStages, and the mbarriers' phases follow c / kStages.
  if (wg == 0) {
    // Producer: per item, copy groups K 0 (with Q), V 0, K 1, V 1, ...; a group's landing is
    // published once the next group is issued (its copies waited for, fenced for the async proxy,
    // then an arrive), the block's last group at the end.
    setmaxnreg_dec<Cfg::kProducerRegs>();
    uint64_t* pending = nullptr;  // the full barrier of the last group issued, not yet published
    int c = 0;
    unsigned item = 0;
    for (unsigned index = blockIdx.x; index < num_work; index += gridDim.x, ++item) {
      const Tile tile(p, num_m_tiles, order, index);
      const Seq& sq = tile.sq;
      const Elem* k = sq.k_rows<const Elem>(p.k, p.k_stride, tile.hk, 0);
      const Elem* v = sq.k_rows<const Elem>(p.v, p.v_stride, tile.hk, 0);
      for (int j = 0; j < 2 * tile.n_tiles; ++j) {
        const int i = j / 2, cc = c + i, stage = cc % kStages;
        const bool is_k = j % 2 == 0;
        if (cc >= kStages) mbar_wait(is_k ? k_empty + stage : v_empty + stage, uint32_t(cc / kStages - 1) & 1);
        const int64_t n0 = tile.n_begin + int64_t(i) * kBN;
        const int keys = sq.k_tile_rows(n0, kBN);
        if (is_k) {
          if (j == 0) {
            if (item >= 2) mbar_wait(q_empty + item % 2, uint32_t(item / 2 - 1) & 1);
            copy_panels<kBM, kDim, 128, Elem, Cfg::kRolledCopies>(sQ(item % 2), sq.q_rows<const Elem>(p.q, p.q_stride, tile.h, tile.m0),
                                        p.q_stride.row, tile.rows, tid);
          }
          copy_panels<kBN, kDim, 128, Elem, Cfg::kRolledCopies>(sK(stage), k + n0 * p.k_stride.row, p.k_stride.row, keys, tid);
        } else {
          copy_panels<kBN, kDim, 128, Elem, Cfg::kRolledCopies>(sV(stage), v + n0 * p.v_stride.row, p.v_stride.row, keys, tid);
        }
        cp_async_commit();
        if (pending != nullptr) {
          cp_async_wait<1>();
          fence_proxy_async();
          mbar_arrive(pending);
        }
        pending = is_k ? k_full + stage : v_full + stage;
      }
      c += tile.n_tiles;
    }
    if (pending != nullptr) {
      cp_async_wait<0>();
      fence_proxy_async();
      mbar_arrive(pending);
    }
    return;
  }

  setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int cwg = wg - 1, lane = tid & 31, warp = (tid / 32) % 4;
  const int g = lane / 4, t = lane % 4;
  const int wrow = cwg * 64 + warp * 16;
  // The consumers' turns at the tensor cores: warpgroup c issues after bar_sync(1 + c), then lets the
  // other one issue (bar_arrive(2 - c)); every item's turns alternate from the first warpgroup's.
  const int my_turn = 1 + cwg, other_turn = 2 - cwg;
  const float score_scale = Exp::score_scale(p.scale);

  int c = 0;
  unsigned item = 0;
  for (unsigned index = blockIdx.x; index < num_work; index += gridDim.x, ++item) {
    const Tile tile(p, num_m_tiles, order, index);
    const Seq& sq = tile.sq;
    const int64_t m0 = tile.m0;
    const int n_tiles = tile.n_tiles;
    unsigned char* const q_tile = sQ(item % 2);
    const uint32_t q_at = smem_addr(q_tile) + cwg * 64 * 128;  // this warpgroup's Q rows
    auto wait_k = [&](int i) { mbar_wait(k_full + (c + i) % kStages, uint32_t((c + i) / kStages) & 1); };
    auto wait_v = [&](int i) { mbar_wait(v_full + (c + i) % kStages, uint32_t((c + i) / kStages) & 1); };
    auto release_k = [&](int i) { mbar_arrive(k_empty + (c + i) % kStages); };
    auto release_v = [&](int i) { mbar_arrive(v_empty + (c + i) % kStages); };
    Rows w;
    auto issue_scores = [&](typename Rows::Scores& s, int i) {
      Rows::issue_scores(s, q_at, smem_addr(sK((c + i) % kStages)));
    };
    auto issue_pv = [&](const typename Rows::Probs& pa, int i) { w.issue_pv(pa, smem_addr(sV((c + i) % kStages))); };
    auto softmax = [&](typename Rows::Scores& s, int i, float (&alpha)[2]) {
      w.softmax(s, sq, m0, tile.m_last, m0 + wrow + g, tile.n_begin + int64_t(i) * kBN, t, score_scale, alpha);
    };

    typename Rows::Probs pa;
    float alpha[2] = {1.f, 1.f};  // rescales O before the next P V
    if (n_tiles > 0) {
      wait_k(0);  // Q and K 0
      typename Rows::Scores s;
      wgmma_fence();
      issue_scores(s, 0);
      wgmma_wait<0>();
      pin(s);
      release_k(0);
      softmax(s, 0, alpha);
      Rows::pack_p(s, pa);
    }
    if (cwg == 1 && n_tiles > 1) bar_arrive(other_turn, 256);
    for (int i = 0; i + 1 < n_tiles; ++i) {
      typename Rows::Scores s;
      wait_k(i + 1);
      bar_sync(my_turn, 256);
      wgmma_fence();
      issue_scores(s, i + 1);
      w.rescale_o(alpha);
      pin(w.o);
      wait_v(i);
      wgmma_fence();
      issue_pv(pa, i);
      // (the second warpgroup's last turn of an item hands over to nobody: the first has no turn after it)
      if (cwg == 0 || i + 2 < n_tiles) bar_arrive(other_turn, 256);
      wgmma_wait<1>();
      pin(s);
      release_k(i + 1);
      softmax(s, i + 1, alpha);
      wgmma_wait<0>();
      pin(w.o);
      pin(pa);
      release_v(i);
      Rows::pack_p(s, pa);
    }
    if (n_tiles > 0) {
      wait_v(n_tiles - 1);
      w.rescale_o(alpha);
      pin(w.o);
      wgmma_fence();
      issue_pv(pa, n_tiles - 1);
      wgmma_wait<0>();
      pin(w.o);
      release_v(n_tiles - 1);
    }
    // (only this warpgroup's products read its rows of the Q tile)
    w.store(q_tile, p, sq, tile.h, m0, tile.rows, wrow, lane);
    mbar_arrive(q_empty + item % 2);
    c += n_tiles;
  }
#endif
}

}  // namespace flashattn::cuda::sm90
