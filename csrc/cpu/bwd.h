// CPU backward. A task owns one (sequence, kv head) and a slice of its key tiles; for each key
// tile it walks every query tile of every query head in the GQA group, recomputes
// P = exp(S - lse) and accumulates dK, dV in its tile and dQ in its slice of the workspace.
// Slices are summed in a fixed order, so gradients are bitwise reproducible run to run.
#include <algorithm>
#include <cmath>
#include <vector>

#pragma once
#include "../params.h"
#include "bf16_dot.h"
#include "gemm.h"
#include "parallel.h"
#include "scores.h"
#include "softmax.h"
#include "tile_io.h"
#include "tiles.h"

namespace flashattn::cpu::FLASHATTN_CPU_ISA {
namespace {

int64_t acc_size(const BwdParams& p) { return p.dtype == DType::kFloat64 ? 8 : 4; }

// Workspace layout, in the compute type A, rows as stored (tensor_batches x tensor_rows):
//   dq_acc [slices][batches][heads_q][rows][ld_qk]   per-slice dQ sums (scale not yet applied)
//   delta  [batches][heads_q][rows]                  D = rowsum(dO * O) - dlse
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
  int64_t dq_elems(const BwdParams& p) const { return slices * delta_elems(p) * ld_qk; }
  int64_t delta_elems(const BwdParams& p) const { return tensor_batches(p) * p.heads_q * tensor_rows(p); }
};

template <class A>
struct BwdScratch {
  // bf16 products (bf16_dot.h), as the forward takes them: bf16 calls of even head dims where the CPU has them.
  bool dot;
  int64_t ld_qk, ld_v;
  std::vector<A> k, kt, vt, dk, dv, q, dout, s, dp;
  std::vector<A> tanh;         // tanh(s / softcap) of the tile, for softcap's derivative
  std::vector<uint8_t> keep;   // dropout keep mask of the tile
  // (dot) The operands as pair words: Kᵀ and Vᵀ (pairs along the dims, kTileK a row), K, Q and dO rows interleaved
  // in pairs (ld_qk / ld_v a row), Q and dO rows as they are (half the head dim a row), P and dS rounded to bf16 in
  // row pairs (kTileK a row), dS in pairs along its rows (kTileK / 2 a row); k, kt, vt, q and dout then stay empty.
  std::vector<uint32_t> kt_pairs, vt_pairs, k_rows, q_rows, dout_rows, q_words, dout_words, p_rows, ds_rows, ds_words;
  explicit BwdScratch(const BwdParams& p)
      : dot(std::is_same_v<A, float> && p.dtype == DType::kBFloat16 && p.head_dim % 2 == 0 &&
            p.head_dim_v % 2 == 0 && cpu_has_bf16_dot()),
        ld_qk(round_up(p.head_dim, kPanel<A>)),
        ld_v(round_up(p.head_dim_v, kPanel<A>)),
        k(dot ? 0 : kTileK * ld_qk),
        kt(dot ? 0 : ld_qk * kTileK),
        vt(dot ? 0 : ld_v * kTileK),
        dk(kTileK * ld_qk),
        dv(kTileK * ld_v),
        q(dot ? 0 : kTileQ * ld_qk),
        dout(dot ? 0 : kTileQ * ld_v),
        s(kTileQ * kTileK),
        dp(kTileQ * kTileK),
        tanh(kTileQ * kTileK),
        keep(kTileQ * kTileK),
        kt_pairs(dot ? ld_qk / 2 * kTileK : 0),
        vt_pairs(dot ? ld_v / 2 * kTileK : 0),
        k_rows(dot ? kTileK / 2 * ld_qk : 0),
        q_rows(dot ? kTileQ / 2 * ld_qk : 0),
        dout_rows(dot ? kTileQ / 2 * ld_v : 0),
        q_words(dot ? kTileQ * ld_qk / 2 : 0),
        dout_words(dot ? kTileQ * ld_v / 2 : 0),
        p_rows(dot ? kTileQ / 2 * kTileK : 0),
        ds_rows(dot ? kTileQ / 2 * kTileK : 0),
        ds_words(dot ? kTileQ * kTileK / 2 : 0) {}
};

// D = rowsum(dO * O) - dlse for rows [row0, row0 + rows) of one head. `dout` and `out`
// are scratch tiles of kTileQ x ld_v.
template <class A>
void compute_delta(const BwdParams& p, int64_t ld_v, A* dout, A* out, int64_t b, int64_t h, int64_t row0,
                   A* delta) {
  const A* dlse = p.dlse ? static_cast<const A*>(p.dlse) + (b * p.heads_q + h) * tensor_rows(p) + row0 : nullptr;
  const int64_t rows = std::min(kTileQ, tensor_rows(p) - row0);
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

// dS = P * (dP - D) on a tile, in place of P. Under dropout, P V used the kept
// probabilities scaled by 1 / (1 - p), so dP is masked and scaled the same way first.
template <class A>
void softmax_grad(const BwdParams& p, const BwdScratch<A>& w, A* s, int64_t rows, int64_t cols_padded,
                  const A* delta) {
  const A* dp = w.dp.data();
  const A inv_keep = A(1) / A(1 - p.dropout_p);
  for (int64_t r = 0; r < rows; ++r) {
    A* sr = s + r * kTileK;
    const A* dpr = dp + r * kTileK;
    if (p.dropout_p > 0.0) {
      const uint8_t* kr = w.keep.data() + r * kTileK;
      for (int64_t c = 0; c < cols_padded; ++c) sr[c] = sr[c] * ((kr[c] ? dpr[c] * inv_keep : A(0)) - delta[r]);
    } else {
      for (int64_t c = 0; c < cols_padded; ++c) sr[c] = sr[c] * (dpr[c] - delta[r]);
    }
  }
}

// One key tile of one (sequence, kv head) against every query tile of its group that sees it.
template <class A>
void bwd_key_tile(const BwdParams& p, BwdScratch<A>& w, A* dq_acc, const A* delta_all, const Seq& sq, int64_t hk,
                  int64_t col0) {
  const DType t = p.dtype;
  const int64_t cols = std::min(kTileK, sq.len_k - col0);
  const int64_t cols_padded = round_up(cols, kPanel<A>);
  const int64_t ld_qk = w.ld_qk, ld_v = w.ld_v;
  const char* k_rows = row_ptr(p.k, p.k_stride, t, sq.tb, hk, sq.k0 + col0);
  const char* v_rows = row_ptr(p.v, p.v_stride, t, sq.tb, hk, sq.k0 + col0);
  const int64_t qk_pairs = p.head_dim / 2, v_pairs = p.head_dim_v / 2;
  if (w.dot) {  // (the transposed tiles' padding keys zero, as load_rows_transposed leaves them)
    const char* rows[kTileK];
    strided_rows(k_rows, p.k_stride.row * 2, cols, rows);
    put_row_pairs(rows, cols, p.head_dim, w.k_rows.data(), ld_qk);
    put_pairs_transposed(rows, cols, qk_pairs, w.kt_pairs.data(), kTileK);
    strided_rows(v_rows, p.v_stride.row * 2, cols, rows);
    put_pairs_transposed(rows, cols, v_pairs, w.vt_pairs.data(), kTileK);
    for (int64_t i = 0; i < qk_pairs; ++i) std::fill_n(w.kt_pairs.data() + i * kTileK + cols, cols_padded - cols, 0u);
    for (int64_t i = 0; i < v_pairs; ++i) std::fill_n(w.vt_pairs.data() + i * kTileK + cols, cols_padded - cols, 0u);
  } else {
    load_rows<A>(t, k_rows, p.k_stride.row, cols, p.head_dim, A(1), w.k.data(), ld_qk, ld_qk);
    load_rows_transposed<A>(t, k_rows, p.k_stride.row, cols, p.head_dim, w.kt.data(), kTileK, cols_padded);
    load_rows_transposed<A>(t, v_rows, p.v_stride.row, cols, p.head_dim_v, w.vt.data(), kTileK, cols_padded);
  }
  std::fill(w.dk.begin(), w.dk.end(), A(0));
  std::fill(w.dv.begin(), w.dv.end(), A(0));

  // Query rows that see some key of the tile (the band moves right with the row).
  const int64_t row_begin = sq.row_begin(col0) / kTileQ * kTileQ;
  const int64_t row_end = sq.row_end(col0 + cols - 1);
  const A inv_keep = A(1) / A(1 - p.dropout_p);
  A* s = w.s.data();
  for (int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
    for (int64_t row0 = row_begin; row0 < row_end; row0 += kTileQ) {
      const int64_t rows = std::min(kTileQ, sq.len_q - row0);
      const char* const q_rows = row_ptr(p.q, p.q_stride, t, sq.tb, h, sq.q0 + row0);
      const char* const dout_rows = row_ptr(p.dout, p.dout_stride, t, sq.tb, h, sq.q0 + row0);
      if (w.dot) {  // (Q unscaled: the scale multiplies S, and dK when it is stored)
        const char* rows_at[kTileQ];
        strided_rows(q_rows, p.q_stride.row * 2, rows, rows_at);
        put_row_pairs(rows_at, rows, p.head_dim, w.q_rows.data(), ld_qk);
        for (int64_t r = 0; r < rows; ++r) std::memcpy(w.q_words.data() + r * ld_qk / 2, rows_at[r], qk_pairs * 4);
        strided_rows(dout_rows, p.dout_stride.row * 2, rows, rows_at);
        put_row_pairs(rows_at, rows, p.head_dim_v, w.dout_rows.data(), ld_v);
        for (int64_t r = 0; r < rows; ++r) std::memcpy(w.dout_words.data() + r * ld_v / 2, rows_at[r], v_pairs * 4);
      } else {
        load_rows<A>(t, q_rows, p.q_stride.row, rows, p.head_dim, A(p.scale), w.q.data(), ld_qk, ld_qk);
        load_rows<A>(t, dout_rows, p.dout_stride.row, rows, p.head_dim_v, A(1), w.dout.data(), ld_v, ld_v);
      }
      const int64_t ri = sq.row_index(p.heads_q, h, row0);
      const A* lse = static_cast<const A*>(p.lse) + ri;
      const A* delta = delta_all + ri;

      // P = exp(S - lse), S the scores of the forward
      if constexpr (kBf16DotBuilt && std::is_same_v<A, float>) {
        if (w.dot) {
          gemm_bf16_pairs(rows, cols_padded, qk_pairs, w.q_words.data(), ld_qk / 2, w.kt_pairs.data(), kTileK, s,
                          kTileK, float(p.scale), false);
        }
      }
      if (!w.dot) gemm<A>(rows, cols_padded, p.head_dim, w.q.data(), ld_qk, w.kt.data(), kTileK, s, kTileK, false);
      const TilePos pos{sq, h, row0, rows, col0, cols, cols_padded};
      prepare_scores(p, pos, s, kTileK, p.softcap > 0.0 ? w.tanh.data() : nullptr);
      recompute_probs(s, kTileK, rows, cols_padded, lse);
      // dV += P^T dO, with P as the forward multiplied V by (after dropout)
      const A* pv = s;
      if (p.dropout_p > 0.0) {
        uint8_t* keep = w.keep.data();
        A* pd = w.dp.data();
        for_each_dropout(p, pos, [keep](int64_t r, int64_t c, bool k) { keep[r * kTileK + c] = k; });
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols_padded; ++c)
            pd[r * kTileK + c] = keep[r * kTileK + c] ? s[r * kTileK + c] * inv_keep : A(0);
        pv = pd;
      }
      const int64_t row_pairs = (rows + 1) / 2;
      if constexpr (kBf16DotBuilt && std::is_same_v<A, float>) {
        if (w.dot) {  // (P rounded to bf16 as the forward's P V took it; dP = dO V^T)
          put_rounded_row_pairs(pv, kTileK, rows, cols, w.p_rows.data(), kTileK);
          gemm_bf16_pairs<true>(cols, ld_v, row_pairs, w.p_rows.data(), kTileK, w.dout_rows.data(), ld_v,
                                w.dv.data(), ld_v, 1.f, true);
          gemm_bf16_pairs(rows, cols_padded, v_pairs, w.dout_words.data(), ld_v / 2, w.vt_pairs.data(), kTileK,
                          w.dp.data(), kTileK, 1.f, false);
        }
      }
      if (!w.dot) {
        gemm_tn<A>(cols, ld_v, rows, pv, kTileK, w.dout.data(), ld_v, w.dv.data(), ld_v, true);
        // dS = P * (dO V^T - D): the gradient of the scores that the softmax took
        gemm<A>(rows, cols_padded, p.head_dim_v, w.dout.data(), ld_v, w.vt.data(), kTileK, w.dp.data(), kTileK,
                false);
      }
      softmax_grad(p, w, s, rows, cols_padded, delta);
      if (p.dbias) {  // the bias was added to the scores as they are now
        A* db = static_cast<A*>(p.dbias) + ((sq.b * p.heads_q + h) * p.len_q + row0) * p.len_k + col0;
        for (int64_t r = 0; r < rows; ++r) std::copy(s + r * kTileK, s + r * kTileK + cols, db + r * p.len_k);
      }
      if (p.softcap > 0.0) {  // back through s = softcap * tanh(s / softcap)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            const A th = w.tanh[r * kTileK + c];
            s[r * kTileK + c] *= A(1) - th * th;
          }
      }
      // dK += dS^T (scale Q);  dQ += dS K (scale applied when the slices are summed)
      if constexpr (kBf16DotBuilt && std::is_same_v<A, float>) {
        if (w.dot) {  // (dS rounded to bf16; dK's scale when it is stored)
          put_rounded_row_pairs(s, kTileK, rows, cols, w.ds_rows.data(), kTileK);
          gemm_bf16_pairs<true>(cols, ld_qk, row_pairs, w.ds_rows.data(), kTileK, w.q_rows.data(), ld_qk,
                                w.dk.data(), ld_qk, 1.f, true);
          put_rounded_pairs(s, kTileK, rows, cols_padded, w.ds_words.data(), kTileK / 2);
          gemm_bf16_pairs(rows, ld_qk, (cols + 1) / 2, w.ds_words.data(), kTileK / 2, w.k_rows.data(), ld_qk,
                          dq_acc + ri * ld_qk, ld_qk, 1.f, true);
        }
      }
      if (!w.dot) {
        gemm_tn<A>(cols, ld_qk, rows, s, kTileK, w.q.data(), ld_qk, w.dk.data(), ld_qk, true);
        gemm<A>(rows, ld_qk, cols, s, kTileK, w.k.data(), ld_qk, dq_acc + ri * ld_qk, ld_qk, true);
      }
    }
  }
  store_rows<A>(t, row_ptr(p.dk, p.dk_stride, t, sq.tb, hk, sq.k0 + col0), p.dk_stride.row, cols, p.head_dim,
                A(w.dot ? p.scale : 1), w.dk.data(), ld_qk);
  store_rows<A>(t, row_ptr(p.dv, p.dv_stride, t, sq.tb, hk, sq.k0 + col0), p.dv_stride.row, cols, p.head_dim_v,
                A(1), w.dv.data(), ld_v);
}

template <class A>
void bwd_impl(const BwdParams& p) {
  const BwdLayout lay(p);
  A* dq_acc = static_cast<A*>(p.workspace);
  A* delta = dq_acc + lay.dq_elems(p);
  // Passes 1 and 3 walk the rows as stored (all sequences of a varlen batch are one run).
  const int64_t n_heads = tensor_batches(p) * p.heads_q;
  const int64_t rows_per_head = tensor_rows(p);
  const int64_t n_row_tiles = (rows_per_head + kTileQ - 1) / kTileQ;
  const int64_t slice_elems = n_heads * rows_per_head * lay.ld_qk;

  // Pass 1: D for every row, and zeroed dQ accumulators.
  const int64_t ld_v = round_up(p.head_dim_v, kPanel<A>);
  run_tasks(n_heads * n_row_tiles, [&] {
    return [&, dout = std::vector<A>(kTileQ * ld_v), out = std::vector<A>(kTileQ * ld_v)](int64_t task) mutable {
      const int64_t bh = task / n_row_tiles, row0 = task % n_row_tiles * kTileQ;
      const int64_t rows = std::min(kTileQ, rows_per_head - row0);
      compute_delta(p, ld_v, dout.data(), out.data(), bh / p.heads_q, bh % p.heads_q, row0,
                    delta + bh * rows_per_head + row0);
      for (int64_t s = 0; s < lay.slices; ++s) {
        A* acc = dq_acc + s * slice_elems + (bh * rows_per_head + row0) * lay.ld_qk;
        std::fill(acc, acc + rows * lay.ld_qk, A(0));
      }
    };
  });

  // Pass 2: slice s of a (sequence, kv head) takes key tiles s, s + slices, ... (interleaved
  // so that causal work spreads evenly).
  const int64_t n_groups = p.batch * p.heads_kv;
  run_tasks(n_groups * lay.slices, [&] {
    return [&, w = BwdScratch<A>(p)](int64_t task) mutable {
      const int64_t g = task / lay.slices, s = task % lay.slices;
      const Seq sq = sequence(p, g / p.heads_kv);
      for (int64_t tile = s; tile < lay.n_key_tiles && tile * kTileK < sq.len_k; tile += lay.slices)
        bwd_key_tile<A>(p, w, dq_acc + s * slice_elems, delta, sq, g % p.heads_kv, tile * kTileK);
    };
  });

  // Pass 3: dQ = scale * (sum of the slices), in slice order.
  run_tasks(n_heads * n_row_tiles, [&] {
    return [&](int64_t task) {
      const int64_t bh = task / n_row_tiles, row0 = task % n_row_tiles * kTileQ;
      const int64_t rows = std::min(kTileQ, rows_per_head - row0);
      A* acc = dq_acc + (bh * rows_per_head + row0) * lay.ld_qk;
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
