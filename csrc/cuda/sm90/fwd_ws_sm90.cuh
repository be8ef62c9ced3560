// Warp-specialized forward on wgmma (sm_90a): plain fp16 / bf16 calls at head dim 64. A block
// of three warpgroups: the first copies Q, K and V tiles into smem (cp.async, then each copy's
// landing published through an mbarrier), the other two take 64 query rows each and never wait for
// each other at a block barrier: they take turns at issuing their products (two named barriers), so
// that one's softmax runs while the other's products use the tensor cores (FlashAttention-3's
// ping-pong), each besides overlapping its own softmax of tile i + 1 with its P V of tile i as
// fwd_sm90.cuh does. The producer hands registers to the consumers (setmaxnreg): at the 168 per
// thread that 384 threads get, the consumers' key loop spilled.
#pragma once
#include "fwd_sm90.cuh"
#include "../common/barrier.cuh"

namespace flashattn::cuda::sm90 {

template <class Elem, int kDim>
struct FwdWsConfig {
  static constexpr bool kServed = kFwdWgmmaTier<Elem, kDim> && kDim == 64;
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kBM = 64 * kConsumers, kBN = 128, kStages = 2;
  static constexpr uint32_t kQBytes = kBM * kDim * 2, kKvBytes = kBN * kDim * 2;
  static constexpr uint32_t kBarOffset = kQBytes + 2 * kStages * kKvBytes;
  // Q, the K and V stages, the mbarriers (K / V full and empty per stage), and room to align to 1024.
  static constexpr size_t kSmemBytes = kBarOffset + 4 * kStages * 8 + 1024;
  // Registers per thread after the hand-over: 128 x 64 + 256 x 216 <= 384 x 168, the launch's pool.
  static constexpr int kProducerRegs = 64, kConsumerRegs = 216;
  // Taken where rows see on average at least 4096 keys (H100, bf16, forward, TFLOP/s this kernel /
  // the sm80/ one): non-causal L = 512 236 / 286, 1024 296 / 316, 2048 335 / 338, 8192 375 / 337,
  // 16384 379 / 345; causal L = 2048 282 / 295, 8192 357 / 339, 16384 360 / 343.
  static constexpr int64_t kMinVisibleKeys = 4096;
};

template <class Elem, int kDim>
__global__ void __launch_bounds__(FwdWsConfig<Elem, kDim>::kThreads, 1)
    fwd_ws_kernel(const FwdParams p, int num_m_tiles, sm80::HeavyLast order) {
#ifdef FLASHATTN_WGMMA
  using Cfg = FwdWsConfig<Elem, kDim>;
  using Exp = ExpDomain<float>;
  constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN, kStages = Cfg::kStages;
  using Rows = FwdRows<Elem, kDim, kBN, kBM>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* const tiles = align_1024(smem_raw);
  unsigned char* const sQ = tiles;
  auto sK = [&](int stage) { return tiles + Cfg::kQBytes + stage * Cfg::kKvBytes; };
  auto sV = [&](int stage) { return tiles + Cfg::kQBytes + (kStages + stage) * Cfg::kKvBytes; };
  uint64_t* const bars = reinterpret_cast<uint64_t*>(tiles + Cfg::kBarOffset);
  uint64_t* const k_full = bars;                  // the producer's 128 threads: K i landed (with Q for i = 0)
  uint64_t* const v_full = bars + kStages;        // ... V i landed
  uint64_t* const k_empty = bars + 2 * kStages;   // the consumers' 256 threads: done reading K i
  uint64_t* const v_empty = bars + 3 * kStages;   // ... V i

  const FwdTile<kBM, kBN> tile(p, num_m_tiles, order);
  const Seq& sq = tile.sq;
  const int64_t h = tile.h, hk = tile.hk, m0 = tile.m0, m_last = tile.m_last, n_begin = tile.n_begin;
  const int rows = tile.rows, n_tiles = tile.n_tiles;

  const int tid = threadIdx.x, wg = tid / 128;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(k_full + s, 128);
      mbar_init(v_full + s, 128);
      mbar_init(k_empty + s, 128 * Cfg::kConsumers);
      mbar_init(v_empty + s, 128 * Cfg::kConsumers);
    }
  }
  __syncthreads();

  if (wg == 0) {
    // Producer: copy groups K 0 (with Q), V 0, K 1, V 1, ...; group j's landing is published once
    // group j + 1 is issued (its copies waited for, fenced for the async proxy, then an arrive).
    const Elem* k = sq.k_rows<const Elem>(p.k, p.k_stride, hk, 0);
    const Elem* v = sq.k_rows<const Elem>(p.v, p.v_stride, hk, 0);
    setmaxnreg_dec<Cfg::kProducerRegs>();
    auto publish = [&](int j) {
      fence_proxy_async();
      mbar_arrive(j % 2 == 0 ? k_full + (j / 2) % kStages : v_full + (j / 2) % kStages);
    };
    for (int j = 0; j < 2 * n_tiles; ++j) {
      const int i = j / 2, stage = i % kStages;
      const bool is_k = j % 2 == 0;
      if (i >= kStages) mbar_wait(is_k ? k_empty + stage : v_empty + stage, uint32_t(i / kStages - 1) & 1);
      const int64_t n0 = n_begin + int64_t(i) * kBN;
      const int keys = sq.k_tile_rows(n0, kBN);
      if (is_k) {
        if (j == 0)
          copy_panels<kBM, kDim, 128>(sQ, sq.q_rows<const Elem>(p.q, p.q_stride, h, m0), p.q_stride.row, rows, tid);
        copy_panels<kBN, kDim, 128>(sK(stage), k + n0 * p.k_stride.row, p.k_stride.row, keys, tid);
      } else {
        copy_panels<kBN, kDim, 128>(sV(stage), v + n0 * p.v_stride.row, p.v_stride.row, keys, tid);
      }
      cp_async_commit();
      if (j > 0) {
        cp_async_wait<1>();
        publish(j - 1);
      }
    }
    if (n_tiles > 0) {
      cp_async_wait<0>();
      publish(2 * n_tiles - 1);
    }
    return;
  }

  setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int cwg = wg - 1, lane = tid & 31, warp = (tid / 32) % 4;
  const int g = lane / 4, t = lane % 4;
  const int wrow = cwg * 64 + warp * 16;
  // The consumers' turns at the tensor cores: warpgroup c issues after bar_sync(1 + c), then lets the
  // other one issue (bar_arrive(2 - c)).
  const int my_turn = 1 + cwg, other_turn = 2 - cwg;

  const uint32_t q_at = smem_addr(sQ) + cwg * 64 * 128;  // this warpgroup's Q rows
  auto wait_k = [&](int i) { mbar_wait(k_full + i % kStages, uint32_t(i / kStages) & 1); };
  auto wait_v = [&](int i) { mbar_wait(v_full + i % kStages, uint32_t(i / kStages) & 1); };
  Rows w;
  const float score_scale = Exp::score_scale(p.scale);
  auto issue_scores = [&](typename Rows::Scores& s, int i) { Rows::issue_scores(s, q_at, smem_addr(sK(i % kStages))); };
  auto issue_pv = [&](const typename Rows::Probs& pa, int i) { w.issue_pv(pa, smem_addr(sV(i % kStages))); };
  auto softmax = [&](typename Rows::Scores& s, int i, float (&alpha)[2]) {
    w.softmax(s, sq, m0, m_last, m0 + wrow + g, n_begin + int64_t(i) * kBN, t, score_scale, alpha);
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
    mbar_arrive(k_empty + 0);
    softmax(s, 0, alpha);
    Rows::pack_p(s, pa);
  }
  // The first turn is the first warpgroup's.
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
    // (the second warpgroup's last turn hands over to nobody: the first has no turn after it)
    if (cwg == 0 || i + 2 < n_tiles) bar_arrive(other_turn, 256);
    wgmma_wait<1>();
    pin(s);
    mbar_arrive(k_empty + (i + 1) % kStages);
    softmax(s, i + 1, alpha);
    wgmma_wait<0>();
    pin(w.o);
    pin(pa);
    mbar_arrive(v_empty + i % kStages);
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
  }

  w.store(sQ, p, sq, h, m0, rows, wrow, lane);  // (only this warpgroup's products read its rows of sQ)
#endif
}

}  // namespace flashattn::cuda::sm90
