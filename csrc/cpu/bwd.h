// CPU backward. A task owns one (batch, kv head) and a slice of its key tiles; for each key
// tile it walks every query tile of every query head in the GQA group, recomputes
// P = exp(S - lse) and accumulates dK, dV in its tile and dQ in its slice of the workspace.
// Slices are summed in a fixed order, so gradients are bitwise reproducible run to run.
#include <algorithm>
#include <cmath>
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

int64_t acc_size(const BwdParams& p) { return p.dtype == DType::kFloat64 ? 8 : 4; }

// Workspace layout, in the compute type A:
//   dq_acc [slices][batch][heads_q][len_q][ld_qk]   per-slice dQ sums (scale not yet applied)
//   delta  [batch][heads_q][len_q]                   D = rowsum(dO * O) - dlse
struct BwdLayout {
  int64_t slices, ld_qk, n_key_tiles;
  explicit BwdLayout(const BwdParams& p) {
    ld_qk = round_up(p.head_dim, p.dtype == DType::kFloat64 ? kPanel<double> : kPanel<float>);
    n_key_tiles = (p.len_k + kTileK - 1) / kTileK;
    // Split key tiles only as far as needed to give every thread a task: each split costs
    // one more dQ-sized accumulator.
    const int64_t groups = p.batch * p.heads_kv;
    const int64_t threads = torch::stable::get_num_threads();
    slices = std::clamp<int64_t>((threads + groups - 1) / groups, 1, n_key_tiles);
  }
  int64_t dq_elems(const BwdParams& p) const { return slices * p.batch * p.heads_q * p.len_q * ld_qk; }
  int64_t delta_elems(const BwdParams& p) const { return p.batch * p.heads_q * p.len_q; }
};

template <class A>
struct BwdScratch {
  int64_t ld_qk, ld_v;
  std::vector<A> k, kt, vt, dk, dv, q, dout, s, dp;
  explicit BwdScratch(const BwdParams& p)
      : ld_qk(round_up(p.head_dim, kPanel<A>)),
        ld_v(round_up(p.head_dim_v, kPanel<A>)),
        k(kTileK * ld_qk),
        kt(ld_qk * kTileK),
        vt(ld_v * kTileK),
        dk(kTileK * ld_qk),
        dv(kTileK * ld_v),
        q(kTileQ * ld_qk),
        dout(kTileQ * ld_v),
        s(kTileQ * kTileK),
        dp(kTileQ * kTileK) {}
};

// D = rowsum(dO * O) - dlse for rows [row0, row0 + rows) of one head. `dout` and `out`
// are scratch tiles of kTileQ x ld_v.
template <class A>
void compute_delta(const BwdParams& p, int64_t ld_v, A* dout, A* out, int64_t b, int64_t h, int64_t row0,
                   A* delta) {
  const A* dlse = p.dlse ? static_cast<const A*>(p.dlse) + (b * p.heads_q + h) * p.len_q + row0 : nullptr;
  const int64_t rows = std::min(kTileQ, p.len_q - row0);
  const DType t = p.dtype;
  load_rows<A>(t, row_ptr(p.dout, p.dout_stride, t, b, h, row0), p.dout_stride.row, rows, p.head_dim_v, A(1), dout,
               ld_v, ld_v);
  load_rows<A>(t, row_ptr(p.out, p.out_stride, t, b, h, row0), p.out_stride.row, rows, p.head_dim_v, A(1), out,
               ld_v, ld_v);
  for (int64_t r = 0; r < rows; ++r) {
    A sum = 0;
    for (int64_t c = 0; c < p.head_dim_v; ++c) sum += dout[r * ld_v + c] * out[r * ld_v + c];
    delta[r] = dlse ? sum - dlse[r] : sum;
  }
}

// One key tile of one (batch, kv head) against every query tile of its group.
template <class A>
void bwd_key_tile(const BwdParams& p, const BwdLayout& lay, BwdScratch<A>& w, A* dq_acc, const A* delta_all,
                  int64_t b, int64_t hk, int64_t col0) {
  const DType t = p.dtype;
  const int64_t cols = std::min(kTileK, p.len_k - col0);
  const int64_t cols_padded = round_up(cols, kPanel<A>);
  const int64_t ld_qk = w.ld_qk, ld_v = w.ld_v;
  const char* k_rows = row_ptr(p.k, p.k_stride, t, b, hk, col0);
  const char* v_rows = row_ptr(p.v, p.v_stride, t, b, hk, col0);
  load_rows<A>(t, k_rows, p.k_stride.row, cols, p.head_dim, A(1), w.k.data(), ld_qk, ld_qk);
  load_rows_transposed<A>(t, k_rows, p.k_stride.row, cols, p.head_dim, w.kt.data(), kTileK, cols_padded);
  load_rows_transposed<A>(t, v_rows, p.v_stride.row, cols, p.head_dim_v, w.vt.data(), kTileK, cols_padded);
  std::fill(w.dk.begin(), w.dk.end(), A(0));
  std::fill(w.dv.begin(), w.dv.end(), A(0));

  const int64_t first_row = first_row_seeing(p, col0) / kTileQ * kTileQ;
  for (int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
    const int64_t bh = b * p.heads_q + h;
    for (int64_t row0 = first_row; row0 < p.len_q; row0 += kTileQ) {
      const int64_t rows = std::min(kTileQ, p.len_q - row0);
      load_rows<A>(t, row_ptr(p.q, p.q_stride, t, b, h, row0), p.q_stride.row, rows, p.head_dim,
                   A(p.scale), w.q.data(), ld_qk, ld_qk);
      load_rows<A>(t, row_ptr(p.dout, p.dout_stride, t, b, h, row0), p.dout_stride.row, rows, p.head_dim_v, A(1),
                   w.dout.data(), ld_v, ld_v);
      const A* lse = static_cast<const A*>(p.lse) + bh * p.len_q + row0;
      const A* delta = delta_all + bh * p.len_q + row0;

      // P = exp(scale Q K^T - lse)
      gemm<A>(rows, cols_padded, p.head_dim, w.q.data(), ld_qk, w.kt.data(), kTileK, w.s.data(), kTileK, false);
      mask_tile(p, w.s.data(), kTileK, row0, rows, col0, cols, cols_padded);
      recompute_probs(w.s.data(), kTileK, rows, cols_padded, lse);
      // dV += P^T dO
      gemm_tn<A>(cols, ld_v, rows, w.s.data(), kTileK, w.dout.data(), ld_v, w.dv.data(), ld_v, true);
      // dS = P * (dO V^T - D)
      gemm<A>(rows, cols_padded, p.head_dim_v, w.dout.data(), ld_v, w.vt.data(), kTileK, w.dp.data(), kTileK,
              false);
      for (int64_t r = 0; r < rows; ++r) {
        A* sr = w.s.data() + r * kTileK;
        const A* dpr = w.dp.data() + r * kTileK;
        for (int64_t c = 0; c < cols_padded; ++c) sr[c] = sr[c] * (dpr[c] - delta[r]);
      }
      // dK += dS^T (scale Q);  dQ += dS K (scale applied when the slices are summed)
      gemm_tn<A>(cols, ld_qk, rows, w.s.data(), kTileK, w.q.data(), ld_qk, w.dk.data(), ld_qk, true);
      gemm<A>(rows, ld_qk, cols, w.s.data(), kTileK, w.k.data(), ld_qk, dq_acc + (bh * p.len_q + row0) * ld_qk,
              ld_qk, true);
    }
  }
  store_rows<A>(t, row_ptr(p.dk, p.dk_stride, t, b, hk, col0), p.dk_stride.row, cols, p.head_dim,
                A(1), w.dk.data(), ld_qk);
  store_rows<A>(t, row_ptr(p.dv, p.dv_stride, t, b, hk, col0), p.dv_stride.row, cols, p.head_dim_v, A(1),
                w.dv.data(), ld_v);
}

template <class A>
void bwd_impl(const BwdParams& p) {
  const BwdLayout lay(p);
  A* dq_acc = static_cast<A*>(p.workspace);
  A* delta = dq_acc + lay.dq_elems(p);
  const int64_t n_heads = p.batch * p.heads_q;
  const int64_t n_row_tiles = (p.len_q + kTileQ - 1) / kTileQ;
  const int64_t slice_elems = n_heads * p.len_q * lay.ld_qk;

  // Pass 1: D for every row, and zeroed dQ accumulators.
  const int64_t ld_v = round_up(p.head_dim_v, kPanel<A>);
  run_tasks(n_heads * n_row_tiles, [&] {
    return [&, dout = std::vector<A>(kTileQ * ld_v), out = std::vector<A>(kTileQ * ld_v)](int64_t task) mutable {
      const int64_t bh = task / n_row_tiles, row0 = task % n_row_tiles * kTileQ;
      const int64_t rows = std::min(kTileQ, p.len_q - row0);
      compute_delta(p, ld_v, dout.data(), out.data(), bh / p.heads_q, bh % p.heads_q, row0,
                    delta + bh * p.len_q + row0);
      for (int64_t s = 0; s < lay.slices; ++s) {
        A* acc = dq_acc + s * slice_elems + (bh * p.len_q + row0) * lay.ld_qk;
        std::fill(acc, acc + rows * lay.ld_qk, A(0));
      }
    };
  });

  // Pass 2: slice s of a (batch, kv head) takes key tiles s, s + slices, ... (interleaved so
  // that causal work spreads evenly).
  const int64_t n_groups = p.batch * p.heads_kv;
  run_tasks(n_groups * lay.slices, [&] {
    return [&, w = BwdScratch<A>(p)](int64_t task) mutable {
      const int64_t g = task / lay.slices, s = task % lay.slices;
      for (int64_t tile = s; tile < lay.n_key_tiles; tile += lay.slices)
        bwd_key_tile<A>(p, lay, w, dq_acc + s * slice_elems, delta, g / p.heads_kv, g % p.heads_kv,
                        tile * kTileK);
    };
  });

  // Pass 3: dQ = scale * (sum of the slices), in slice order.
  run_tasks(n_heads * n_row_tiles, [&] {
    return [&](int64_t task) {
      const int64_t bh = task / n_row_tiles, row0 = task % n_row_tiles * kTileQ;
      const int64_t rows = std::min(kTileQ, p.len_q - row0);
      A* acc = dq_acc + (bh * p.len_q + row0) * lay.ld_qk;
      for (int64_t s = 1; s < lay.slices; ++s) {
        const A* part = acc + s * slice_elems;
        for (int64_t i = 0; i < rows * lay.ld_qk; ++i) acc[i] += part[i];
      }
      store_rows<A>(p.dtype, row_ptr(p.dq, p.dq_stride, p.dtype, bh / p.heads_q, bh % p.heads_q, row0),
                    p.dq_stride.row, rows, p.head_dim, A(p.scale), acc, lay.ld_qk);
    };
  });
}

}  // namespace

size_t bwd_workspace_bytes(const BwdParams& p) {
  const BwdLayout lay(p);
  return size_t(lay.dq_elems(p) + lay.delta_elems(p)) * acc_size(p);
}

void run_bwd(const BwdParams& p) {
  if (p.dtype == DType::kFloat64)
    bwd_impl<double>(p);
  else
    bwd_impl<float>(p);
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
