// CPU forward: for each (sequence, head, query tile), stream key/value tiles through a tiled
// online softmax. A task owns one (sequence, kv head) and a share of its query tiles, for every
// query head of the GQA group, so the transposed key tiles it builds serve all of them.
// Extra memory per thread is one tile set and the transposed keys of one head: O(len_k),
// nothing of size len_q x len_k.
#include <cmath>
#include <limits>
#include <vector>

#pragma once
#include "../params.h"
#include "gemm.h"
#include "parallel.h"
#include "scores.h"
#include "softmax.h"
#include "tile_io.h"
#include "tiles.h"

namespace flashattn::cpu::FLASHATTN_CPU_ISA {
namespace {

// One thread's tiles; row-major, padded to the panel width.
template <class A>
struct FwdScratch {
  int64_t ld_qk, ld_v;  // padded head dims of q/k and of v/out
  // Key tiles of the task's (sequence, kv head), transposed (ld_qk x kFwdTileK each): slots
  // for the first `cached` tiles, filled[t] once tile t is in its slot, and one more slot
  // that later tiles are transposed into each time. The cache is capped so that very long
  // keys on many threads do not multiply memory.
  static constexpr int64_t kCacheBytes = int64_t(8) << 20;
  int64_t cached;
  std::vector<char> filled;
  std::vector<A> kt;
  std::vector<A> q, v, s, o, m, l;
  explicit FwdScratch(const FwdParams& p)
      : ld_qk(round_up(p.head_dim, kPanel<A>)),
        ld_v(round_up(p.head_dim_v, kPanel<A>)),
        cached(std::min((p.len_k + kFwdTileK - 1) / kFwdTileK,
                        kCacheBytes / int64_t(sizeof(A) * ld_qk * kFwdTileK))),
        filled(cached),
        kt((cached + 1) * ld_qk * kFwdTileK),
        q(kFwdTileQ * ld_qk),
        v(kFwdTileK * ld_v),
        s(kFwdTileQ * kFwdTileK),
        o(kFwdTileQ * ld_v),
        m(kFwdTileQ),
        l(kFwdTileQ) {}
};

template <class A>
void fwd_tile(const FwdParams& p, FwdScratch<A>& w, const Seq& sq, int64_t h, int64_t row0) {
  const int64_t rows = std::min(kFwdTileQ, sq.len_q - row0);
  const int64_t hk = h / p.group();
  const DType t = p.dtype;
  load_rows<A>(t, row_ptr(p.q, p.q_stride, t, sq.tb, h, sq.q0 + row0), p.q_stride.row, rows, p.head_dim,
               A(p.scale), w.q.data(), w.ld_qk, w.ld_qk);
  std::fill(w.o.begin(), w.o.end(), A(0));
  OnlineSoftmax<A> sm{w.m.data(), w.l.data(), rows};
  sm.reset();

  // The band of visible keys moves right with the row: the tile's first row sees the first
  // key, its last row the last. Key tiles outside [begin, end) are skipped.
  const int64_t begin = sq.key_begin(row0) / kFwdTileK * kFwdTileK;
  const int64_t end = sq.key_end(row0 + rows - 1);
  for (int64_t col0 = begin; col0 < end; col0 += kFwdTileK) {
    const int64_t cols = std::min(kFwdTileK, end - col0);
    const int64_t cols_padded = round_up(cols, kPanel<A>);
    const int64_t tile = col0 / kFwdTileK;
    A* kt = w.kt.data() + std::min(tile, w.cached) * w.ld_qk * kFwdTileK;
    if (tile >= w.cached || !w.filled[tile]) {
      // A tile cut short by the band is transposed whole: later query tiles see more of it.
      const int64_t tile_keys = std::min(kFwdTileK, sq.len_k - col0);
      load_rows_transposed<A>(t, row_ptr(p.k, p.k_stride, t, sq.tb, hk, sq.k0 + col0), p.k_stride.row, tile_keys,
                              p.head_dim, kt, kFwdTileK, round_up(tile_keys, kPanel<A>));
      if (tile < w.cached) w.filled[tile] = 1;
    }
    gemm<A>(rows, cols_padded, p.head_dim, w.q.data(), w.ld_qk, kt, kFwdTileK, w.s.data(), kFwdTileK, false);
    const TilePos pos{sq, h, row0, rows, col0, cols, cols_padded};
    prepare_scores(p, pos, w.s.data(), kFwdTileK);
    sm.update(w.s.data(), kFwdTileK, cols_padded, w.o.data(), w.ld_v);
    if (p.dropout_p > 0.0) {  // l keeps every probability; only P V sees the dropped ones as 0
      A* s = w.s.data();
      for_each_dropout(p, pos, [s](int64_t r, int64_t c, bool keep) {
        if (!keep) s[r * kFwdTileK + c] = A(0);
      });
    }
    load_rows<A>(t, row_ptr(p.v, p.v_stride, t, sq.tb, hk, sq.k0 + col0), p.v_stride.row, cols, p.head_dim_v,
                 A(1), w.v.data(), w.ld_v, w.ld_v);
    gemm<A>(rows, w.ld_v, cols, w.s.data(), kFwdTileK, w.v.data(), w.ld_v, w.o.data(), w.ld_v, true);
  }

  A* lse = static_cast<A*>(p.lse) + sq.row_index(p.heads_q, h, row0);
  for (int64_t r = 0; r < rows; ++r) w.l[r] = sq.row_sum(w.l[r]);  // NaN rows for an invalid sequence
  sm.finish(w.o.data(), w.ld_v, lse, A(1) / A(1 - p.dropout_p));
  store_rows<A>(t, row_ptr(p.out, p.out_stride, t, sq.tb, h, sq.q0 + row0), p.out_stride.row, rows,
                p.head_dim_v, A(1), w.o.data(), w.ld_v);
}

template <class A>
void fwd_impl(const FwdParams& p) {
  const int64_t n_tiles = (p.len_q + kFwdTileQ - 1) / kFwdTileQ;  // of the longest sequence
  const int64_t n_groups = p.batch * p.heads_kv;
  // Share a (sequence, kv head)'s query tiles among as many tasks as it takes to give every
  // thread work; each share interleaves the tiles (s, s + shares, ...) so that causal work,
  // which grows with the tile index, spreads evenly.
  const int64_t threads = torch::stable::get_num_threads();
  const int64_t shares = std::clamp<int64_t>((2 * threads + n_groups - 1) / n_groups, 1, n_tiles);
  run_tasks(n_groups * shares, [&] {
    return [&p, w = FwdScratch<A>(p), shares, n_tiles](int64_t task) mutable {
      const int64_t g = task / shares, share = task % shares;
      const Seq sq = sequence(p, g / p.heads_kv);
      const int64_t hk = g % p.heads_kv;
      std::fill(w.filled.begin(), w.filled.end(), 0);
      for (int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h)
        for (int64_t tile = share; tile < n_tiles && tile * kFwdTileQ < sq.len_q; tile += shares)
          fwd_tile<A>(p, w, sq, h, tile * kFwdTileQ);
    };
  });
}

}  // namespace

void run_fwd(const FwdParams& p) {
  if (p.dtype == DType::kFloat64)
    fwd_impl<double>(p);
  else
    fwd_impl<float>(p);
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
