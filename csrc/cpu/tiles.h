// Tile sizes of the CPU kernels, and the geometry of one sequence of the batch that they
// share: where its rows sit in the tensors, and which keys each of its query rows sees.
#pragma once
#include <algorithm>
#include <cstdint>

#include "../common/score_mods.h"
#include "../params.h"

namespace flashattn::cpu::FLASHATTN_CPU_ISA {

// Query rows and key columns per tile; multiples of the panel width of every type. The
// forward takes larger tiles (measured: 256 x 128 is 25% faster than 64 x 64 on Zen 4): each
// key tile is transposed once per query tile, and the per-row softmax bookkeeping (row max,
// rescaling O) is amortized over more columns. The backward is indifferent to its tile
// shape (64 to 128 measured the same). Working sets stay inside a 1 MiB L2.
constexpr int64_t kFwdTileQ = 256;
constexpr int64_t kFwdTileK = 128;
constexpr int64_t kTileQ = 64;
constexpr int64_t kTileK = 64;

// Sequence b of the batch. Padded batches: tensor batch b, rows from 0. Variable-length
// batches: tensor batch 0, rows from the cumulative lengths. Row and key positions used by
// the kernels are within the sequence; the offsets q0 / k0 place them in the tensors.
struct Seq {
  int64_t b;            // sequence index (ALiBi slopes, bias, dropout)
  int64_t tb;           // batch index into q, k, v, out and their gradients
  int64_t q0, k0;       // first row of the sequence in q/out and in k/v
  int64_t len_q, len_k;
  int64_t rows_per_head;  // rows of one head in lse, dlse and the row-indexed workspaces
  Band band;

  int64_t key_begin(int64_t row) const { return band.key_begin(row, len_k); }
  int64_t key_end(int64_t row) const { return band.key_end(row, len_k); }
  // Index of (head h, row) in lse-shaped (batch, heads_q, rows_per_head) arrays.
  int64_t row_index(const FwdParams& p, int64_t h, int64_t row) const {
    return (tb * p.heads_q + h) * rows_per_head + q0 + row;
  }
};

inline Seq sequence(const FwdParams& p, int64_t b) {
  Seq s;
  s.b = b;
  int64_t causal_offset = p.causal_offset;
  if (p.is_varlen()) {
    s.tb = 0;
    s.q0 = p.cu_seqlens_q[b];
    s.k0 = p.cu_seqlens_k[b];
    s.len_q = p.cu_seqlens_q[b + 1] - s.q0;
    s.len_k = p.cu_seqlens_k[b + 1] - s.k0;
    s.rows_per_head = p.total_q;
    causal_offset = p.causal_bottom_right ? s.len_k - s.len_q : 0;
  } else {
    s.tb = b;
    s.q0 = s.k0 = 0;
    s.len_q = p.len_q;
    s.len_k = p.len_k;
    s.rows_per_head = p.len_q;
  }
  s.band = make_band(p.causal, causal_offset, p.window_left, p.window_right, s.len_q, s.len_k);
  return s;
}

// Batches and rows per head of the q-shaped tensors (lse, dq, the workspaces) as stored.
inline int64_t tensor_batches(const FwdParams& p) { return p.is_varlen() ? 1 : p.batch; }
inline int64_t tensor_rows(const FwdParams& p) { return p.is_varlen() ? p.total_q : p.len_q; }

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
