// CPU forward: for each (batch, head, query tile), stream key/value tiles through a tiled
// online softmax. Extra memory is one tile set per thread; nothing of size len_q x len_k.
#include <cmath>
#include <limits>
#include <vector>

#pragma once
#include "../params.h"
#include "gemm.h"
#include "parallel.h"
#include "softmax.h"
#include "tile_io.h"
#include "tiles.h"

namespace flashattn::cpu::FLASHATTN_CPU_ISA {
namespace {

// One thread's tiles; row-major, padded to the panel width.
template <class A>
struct FwdScratch {
  int64_t ld_qk, ld_v;  // padded head dims of q/k and of v/out
  std::vector<A> q, kt, v, s, o, m, l;
  explicit FwdScratch(const FwdParams& p)
      : ld_qk(round_up(p.head_dim, kPanel<A>)),
        ld_v(round_up(p.head_dim_v, kPanel<A>)),
        q(kFwdTileQ * ld_qk),
        kt(ld_qk * kFwdTileK),
        v(kFwdTileK * ld_v),
        s(kFwdTileQ * kFwdTileK),
        o(kFwdTileQ * ld_v),
        m(kFwdTileQ),
        l(kFwdTileQ) {}
};

template <class A>
void fwd_tile(const FwdParams& p, FwdScratch<A>& w, int64_t b, int64_t h, int64_t row0) {
  const int64_t rows = std::min(kFwdTileQ, p.len_q - row0);
  const int64_t hk = h / p.group();
  const DType t = p.dtype;
  load_rows<A>(t, row_ptr(p.q, p.q_stride, t, b, h, row0), p.q_stride.row, rows, p.head_dim,
               A(p.scale), w.q.data(), w.ld_qk, w.ld_qk);
  std::fill(w.o.begin(), w.o.end(), A(0));
  OnlineSoftmax<A> sm{w.m.data(), w.l.data(), rows};
  sm.reset();

  const int64_t keys = visible_keys(p, row0 + rows);
  for (int64_t col0 = 0; col0 < keys; col0 += kFwdTileK) {
    const int64_t cols = std::min(kFwdTileK, keys - col0);
    const int64_t cols_padded = round_up(cols, kPanel<A>);
    load_rows_transposed<A>(t, row_ptr(p.k, p.k_stride, t, b, hk, col0), p.k_stride.row, cols, p.head_dim,
                            w.kt.data(), kFwdTileK, cols_padded);
    gemm<A>(rows, cols_padded, p.head_dim, w.q.data(), w.ld_qk, w.kt.data(), kFwdTileK, w.s.data(), kFwdTileK, false);
    mask_tile(p, w.s.data(), kFwdTileK, row0, rows, col0, cols, cols_padded);
    sm.update(w.s.data(), kFwdTileK, cols_padded, w.o.data(), w.ld_v);
    load_rows<A>(t, row_ptr(p.v, p.v_stride, t, b, hk, col0), p.v_stride.row, cols, p.head_dim_v, A(1),
                 w.v.data(), w.ld_v, w.ld_v);
    gemm<A>(rows, w.ld_v, cols, w.s.data(), kFwdTileK, w.v.data(), w.ld_v, w.o.data(), w.ld_v, true);
  }

  A* lse = static_cast<A*>(p.lse) + (b * p.heads_q + h) * p.len_q + row0;
  sm.finish(w.o.data(), w.ld_v, lse);
  store_rows<A>(t, row_ptr(p.out, p.out_stride, t, b, h, row0), p.out_stride.row, rows, p.head_dim_v, A(1),
                w.o.data(), w.ld_v);
}

template <class A>
void fwd_impl(const FwdParams& p) {
  const int64_t n_tiles = (p.len_q + kFwdTileQ - 1) / kFwdTileQ;
  const int64_t n_heads = p.batch * p.heads_q;
  // Under a causal mask later query tiles cost more: hand them out first.
  run_tasks(n_heads * n_tiles, [&] {
    return [&p, w = FwdScratch<A>(p), n_heads, n_tiles](int64_t task) mutable {
      const int64_t tile = p.causal ? n_tiles - 1 - task / n_heads : task / n_heads;
      const int64_t bh = task % n_heads;
      fwd_tile<A>(p, w, bh / p.heads_q, bh % p.heads_q, tile * kFwdTileQ);
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
