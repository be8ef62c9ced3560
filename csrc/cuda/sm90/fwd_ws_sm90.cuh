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
  // An item's last P V issued with the next item's S 0 (fwd_ws_kernel's consumers): at dim 128 the two
  // items' state does not fit in 232 registers (412 B of spills, serialized products).
  static constexpr bool kCarryAcrossItems = kDim == 64;
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
  const float score_scale = Exp::score_scale(p.scale);
  // The consumers' turns at the tensor cores over the block's whole stream of issues (every item's,
  // the same for both): warpgroup c issues after bar_sync(1 + c), then lets the other one issue
  // (bar_arrive(2 - c)). The second lends the first its first turn; the first takes the second's last
  // hand-over at the end.
  const int my_turn = 1 + cwg, other_turn = 2 - cwg;
  if (cwg == 1) bar_arrive(other_turn, 256);

  // Where an item's next item has keys, its last P V is issued with the next item's S 0, whose softmax
  // then runs under that P V (the output of the item after it): `started` marks an item whose S 0 is
  // thus already in pa.
  auto k_at = [&](int cc) { return smem_addr(sK(cc % kStages)); };
  auto wait_k = [&](int cc) { mbar_wait(k_full + cc % kStages, uint32_t(cc / kStages) & 1); };
  auto wait_v = [&](int cc) { mbar_wait(v_full + cc % kStages, uint32_t(cc / kStages) & 1); };
  auto release_k = [&](int cc) { mbar_arrive(k_empty + cc % kStages); };
  auto release_v = [&](int cc) { mbar_arrive(v_empty + cc % kStages); };
  auto q_at = [&](unsigned item) { return smem_addr(sQ(item % 2)) + cwg * 64 * 128; };  // this warpgroup's Q rows
  Rows w;
  typename Rows::Probs pa;
  float alpha[2] = {1.f, 1.f};  // rescales O before the next P V
  auto softmax = [&](typename Rows::Scores& s, const Tile& tile, int i) {
    w.softmax(s, tile.sq, tile.m0, tile.m_last, tile.m0 + wrow + g, tile.n_begin + int64_t(i) * kBN, t, score_scale,
              alpha);
  };
  auto store = [&](const Tile& tile, unsigned item) {
    // (only this warpgroup's products read its rows of the Q tile)
    w.store(sQ(item % 2), p, Rows::dest(p, tile), wrow, lane);
    mbar_arrive(q_empty + item % 2);
  };

  // One turn at the tensor cores: S of key tile kc (Q of item q_item) issued with P V of key tile vc;
  // `under` (the softmax of those scores) runs while the P V does.
  auto scores_with_pv = [&](typename Rows::Scores& s, unsigned q_item, int kc, int vc, auto&& under) {
    wait_k(kc);
    bar_sync(my_turn, 256);
    wgmma_fence();
    Rows::issue_scores(s, q_at(q_item), k_at(kc));
    w.rescale_o(alpha);
    pin(w.o);
    wait_v(vc);
    wgmma_fence();
    w.issue_pv(pa, smem_addr(sV(vc % kStages)));
    bar_arrive(other_turn, 256);
    wgmma_wait<1>();
    pin(s);
    release_k(kc);
    under();
    wgmma_wait<0>();
    pin(w.o);
    pin(pa);
    release_v(vc);
  };

  int c = 0;  // the block's key tiles before this item
  unsigned item = 0;
  bool started = false;
  Tile tile(p, num_m_tiles, order, blockIdx.x);
  for (unsigned index = blockIdx.x; index < num_work; index += gridDim.x, ++item) {
    const int n_tiles = tile.n_tiles;
    if (n_tiles > 0 && !started) {
      typename Rows::Scores s;
      wait_k(c);  // Q and K 0
      bar_sync(my_turn, 256);
      wgmma_fence();
      Rows::issue_scores(s, q_at(item), k_at(c));
      bar_arrive(other_turn, 256);
      wgmma_wait<0>();
      pin(s);
      release_k(c);
      softmax(s, tile, 0);
      Rows::pack_p(s, pa);
    }
    for (int i = 0; i + 1 < n_tiles; ++i) {
      typename Rows::Scores s;
      scores_with_pv(s, item, c + i + 1, c + i, [&] { softmax(s, tile, i + 1); });
      Rows::pack_p(s, pa);
    }
    const unsigned next_index = index + gridDim.x;
    const int last = c + n_tiles - 1;
    bool carried = false;  // this item's last P V issued with the next item's S 0, whose softmax runs under it
    if constexpr (Cfg::kCarryAcrossItems) {
      if (n_tiles > 0 && next_index < num_work) {
        const Tile next(p, num_m_tiles, order, next_index);
        if (next.n_tiles > 0) {
          typename Rows::Scores s;
          // The row maxima and sums not in w: this item's while the next item's start afresh in w, then
          // (swapped back for this item's output) the next item's.
          float aside_max[2], aside_sum[2];
          scores_with_pv(s, item + 1, last + 1, last, [&] {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              aside_max[r] = w.row_max[r], aside_sum[r] = w.row_sum[r];
              w.row_max[r] = neg_inf<float>(), w.row_sum[r] = 0.f;
            }
            softmax(s, next, 0);
          });
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float mx = w.row_max[r], sum = w.row_sum[r];
            w.row_max[r] = aside_max[r], w.row_sum[r] = aside_sum[r];
            aside_max[r] = mx, aside_sum[r] = sum;
          }
          store(tile, item);
          w.zero_output();
#pragma unroll
          for (int r = 0; r < 2; ++r) w.row_max[r] = aside_max[r], w.row_sum[r] = aside_sum[r];
          Rows::pack_p(s, pa);
          tile = next;
          carried = true;
        }
      }
    }
    if (!carried) {
      if (n_tiles > 0) {
        bar_sync(my_turn, 256);
        w.rescale_o(alpha);
        pin(w.o);
        wait_v(last);
        wgmma_fence();
        w.issue_pv(pa, smem_addr(sV(last % kStages)));
        bar_arrive(other_turn, 256);
        wgmma_wait<0>();
        pin(w.o);
        release_v(last);
        store(tile, item);
        w = Rows();
      } else {
        store(tile, item);  // no key: zeros, lse -inf
      }
      if (next_index < num_work) tile = Tile(p, num_m_tiles, order, next_index);
    }
    started = carried;
    c += n_tiles;
  }
  if (cwg == 0) bar_sync(my_turn, 256);  // the second warpgroup's last hand-over
#endif
}

}  // namespace flashattn::cuda::sm90
