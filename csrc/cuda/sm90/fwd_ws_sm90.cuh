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
  using M = sm80::Mma<Elem>;
  using Exp = ExpDomain<float>;
  constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN, kStages = Cfg::kStages;
  constexpr int kNA = kBN / 8, kDA = kDim / 8;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw_at = smem_addr(smem_raw);
  unsigned char* const tiles = smem_raw + (((raw_at + 1023) & ~1023u) - raw_at);
  unsigned char* const sQ = tiles;
  auto sK = [&](int stage) { return tiles + Cfg::kQBytes + stage * Cfg::kKvBytes; };
  auto sV = [&](int stage) { return tiles + Cfg::kQBytes + (kStages + stage) * Cfg::kKvBytes; };
  uint64_t* const bars = reinterpret_cast<uint64_t*>(tiles + Cfg::kBarOffset);
  uint64_t* const k_full = bars;                  // the producer's 128 threads: K i landed (with Q for i = 0)
  uint64_t* const v_full = bars + kStages;        // ... V i landed
  uint64_t* const k_empty = bars + 2 * kStages;   // the consumers' 256 threads: done reading K i
  uint64_t* const v_empty = bars + 3 * kStages;   // ... V i

  const TileBlock blk =
      tile_block(num_m_tiles, 1, p.heads_q, /*heaviest_first=*/true, sm80::ordered_block<true>(order, num_m_tiles));
  const int64_t h = blk.head, b = blk.batch, hk = kv_head(p, h);
  const Seq sq = plain_sequence(p, b);
  const int64_t m0 = int64_t(blk.tile) * kBM;
  const int rows = sq.q_tile_rows(m0, kBM);
  const int64_t m_last = m0 + rows - 1;
  const int64_t n_begin = sq.key_begin(m0) / kBN * kBN, n_end = sq.key_end(m_last);
  const int n_tiles = n_end > n_begin ? int((n_end - n_begin + kBN - 1) / kBN) : 0;

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

  const uint32_t q_at = smem_addr(sQ) + cwg * 64 * 128;
  auto kmajor = [](uint32_t at, int kk, int rows_per_panel) {
    return smem_desc(at + (kk / 4) * rows_per_panel * 128 + (kk % 4) * 32, 16, 1024);
  };
  auto v_desc = [&](int stage, int kk) { return smem_desc(smem_addr(sV(stage)) + kk * 16 * 128, kBN * 128, 1024); };
  auto wait_k = [&](int i) { mbar_wait(k_full + i % kStages, uint32_t(i / kStages) & 1); };
  auto wait_v = [&](int i) { mbar_wait(v_full + i % kStages, uint32_t(i / kStages) & 1); };

  float o[kDA][4];
#pragma unroll
  for (int d = 0; d < kDA; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[d][e] = 0.f;
  float row_max[2] = {neg_inf<float>(), neg_inf<float>()}, row_sum[2] = {0.f, 0.f};
  const float score_scale = Exp::score_scale(p.scale);

  auto issue_scores = [&](float (&s)[kNA][4], int i) {
    const uint32_t k_at = smem_addr(sK(i % kStages));
    Wgmma<Elem, kBN>::template ss<0>(s, kmajor(q_at, 0, kBM), kmajor(k_at, 0, kBN));
#pragma unroll
    for (int kk = 1; kk < kDim / 16; ++kk) Wgmma<Elem, kBN>::template ss<1>(s, kmajor(q_at, kk, kBM), kmajor(k_at, kk, kBN));
    wgmma_commit();
  };
  auto issue_pv = [&](const uint32_t (&pa)[kBN / 16][4], int i) {
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) Wgmma<Elem, kDim>::rs(o, pa[kk], v_desc(i % kStages, kk));
    wgmma_commit();
  };
  auto softmax = [&](float (&s)[kNA][4], int i, float (&alpha)[2]) {
    const int64_t n0 = n_begin + int64_t(i) * kBN;
#pragma unroll
    for (int j = 0; j < kNA; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] *= score_scale;
    if (!(n0 >= sq.key_begin(m_last) && n0 + kBN <= sq.key_end(m0))) {
#pragma unroll
      for (int r = 0; r < 2; ++r) mask_row_band<kBN>(s, r, sq, m0 + wrow + g + 8 * r, n0, t);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx[kNA];
#pragma unroll
      for (int j = 0; j < kNA; ++j) mx[j] = acc_max(s[j][2 * r], s[j][2 * r + 1]);
      const float tile_max = reduce_max_lanes<4>(tree_reduce(mx, [](float a, float c) { return acc_max(a, c); }));
      const float new_max = acc_max(row_max[r], tile_max);
      alpha[r] = Exp::exp(row_max[r] - exp_base(new_max));
      row_max[r] = new_max;
      const float base = exp_base(new_max);
      float sums[kNA];
#pragma unroll
      for (int j = 0; j < kNA; ++j) {
        s[j][2 * r] = Exp::exp(s[j][2 * r] - base);
        s[j][2 * r + 1] = Exp::exp(s[j][2 * r + 1] - base);
        sums[j] = s[j][2 * r] + s[j][2 * r + 1];
      }
      row_sum[r] = row_sum[r] * alpha[r] + tree_reduce(sums, [](float a, float c) { return a + c; });
    }
  };
  auto pack_p = [&](float (&s)[kNA][4], uint32_t (&pa)[kBN / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      typename M::A a;
      M::a_from_acc(a, &s[2 * kk]);
#pragma unroll
      for (int e = 0; e < 4; ++e) pa[kk][e] = a.r[e];
    }
  };
  auto rescale_o = [&](const float (&alpha)[2]) {
#pragma unroll
    for (int d = 0; d < kDA; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[d][e] *= alpha[e / 2];
  };

  uint32_t pa[kBN / 16][4];
  float alpha[2] = {1.f, 1.f};
  if (n_tiles > 0) {
    wait_k(0);  // Q and K 0
    float s[kNA][4];
    wgmma_fence();
    issue_scores(s, 0);
    wgmma_wait<0>();
    pin(s);
    mbar_arrive(k_empty + 0);
    softmax(s, 0, alpha);
    pack_p(s, pa);
  }
  // The first turn is the first warpgroup's.
  if (cwg == 1 && n_tiles > 1) bar_arrive(other_turn, 256);
  for (int i = 0; i + 1 < n_tiles; ++i) {
    float s[kNA][4];
    wait_k(i + 1);
    bar_sync(my_turn, 256);
    wgmma_fence();
    issue_scores(s, i + 1);
    rescale_o(alpha);
    pin(o);
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
    pin(o);
    pin(pa);
    mbar_arrive(v_empty + i % kStages);
    pack_p(s, pa);
  }
  if (n_tiles > 0) {
    wait_v(n_tiles - 1);
    rescale_o(alpha);
    pin(o);
    wgmma_fence();
    issue_pv(pa, n_tiles - 1);
    wgmma_wait<0>();
    pin(o);
  }

  // The output, staged through this warp's own rows of sQ (only its warpgroup's products read them).
  float* lse = static_cast<float*>(p.lse);
  auto staged = [&](int row, int chunk) {
    return sQ + (chunk / 8) * (kBM * 128) + row * 128 + ((chunk % 8) ^ (row % 8)) * 16;
  };
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = reduce_sum_lanes<4>(row_sum[r]);
    const bool empty = l == 0.f;
    const float inv = empty ? 0.f : 1.f / l;
    const int row = wrow + g + 8 * r;
#pragma unroll
    for (int d = 0; d < kDA; ++d)
      *reinterpret_cast<uint32_t*>(staged(row, d) + 4 * t) = M::pack(o[d][2 * r] * inv, o[d][2 * r + 1] * inv);
    const int64_t m = m0 + row;
    if (t == 0 && m < sq.len_q) lse[sq.row_index(p.heads_q, h, m)] = empty ? neg_inf<float>() : Exp::lse(row_max[r], l);
  }
  __syncwarp();
  constexpr int kLanesPerRow = kDim / 8, kRowsPerStep = 32 / kLanesPerRow;
  const int c = lane % kLanesPerRow;
  Elem* out = sq.q_rows<Elem>(p.out, p.out_stride, h, m0);
#pragma unroll
  for (int i = 0; i < 16 / kRowsPerStep; ++i) {
    const int row = wrow + i * kRowsPerStep + lane / kLanesPerRow;
    const uint4 chunk = *reinterpret_cast<const uint4*>(staged(row, c));
    if (row < rows) *reinterpret_cast<uint4*>(out + row * p.out_stride.row + c * 8) = chunk;
  }
#endif
}

}  // namespace flashattn::cuda::sm90
