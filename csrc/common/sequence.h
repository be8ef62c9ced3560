// One sequence of the batch, as every backend sees it: where its rows sit in the tensors, its
// lengths, and the band of keys each of its query rows sees. Padded batches: tensor batch b,
// rows from 0, or with per-sequence key ranges (seqused_k, leftpad_k) keys from leftpad_k[b].
// Variable-length batches: tensor batch 0, rows from the cumulative lengths.
// Positions used for masks, ALiBi and dropout are those within the sequence.
#pragma once
#include <cmath>
#include <cstdint>

#include "../params.h"
#include "hd.h"
#include "score_mods.h"

namespace flashattn {

struct Seq {
  int64_t b;              // sequence index (ALiBi slopes, bias, dropout)
  int64_t tb;             // batch index into q, k, v, out and their gradients
  int64_t q0, k0;         // first row of the sequence in q/out and in k/v
  int64_t len_q, len_k;
  int64_t rows_per_head;  // rows of one head in lse, dlse and the row-indexed workspaces
  Band band;
  // False where the sequence's key range is out of range (seqused_k, leftpad_k not within
  // 0 <= leftpad_k <= seqused_k <= len_k): it reads no key, and its out and lse rows are NaN, so
  // that values nobody checked (CUDA, where the host never reads them) show instead of passing
  // as a result.
  bool valid = true;

  // The row sum l an epilogue divides by (out = o / l, lse = m + log l): NaN for an invalid
  // sequence, which makes its out and lse NaN through the epilogue's own arithmetic.
  template <class A>
  FLASHATTN_HD A row_sum(A l) const { return valid ? l : static_cast<A>(NAN); }

  FLASHATTN_HD int64_t key_begin(int64_t row) const { return band.key_begin(row, len_k); }
  FLASHATTN_HD int64_t key_end(int64_t row) const { return band.key_end(row, len_k); }
  FLASHATTN_HD int64_t row_begin(int64_t key) const { return band.row_begin(key, len_q); }
  FLASHATTN_HD int64_t row_end(int64_t key) const { return band.row_end(key, len_q); }
  // Rows of the sequence in the query tile that starts at row m0 and in the key tile at key n0
  // (tiles of `tile` rows; fewer at the sequence's end).
  FLASHATTN_HD int q_tile_rows(int64_t m0, int tile) const { return int(len_q - m0 < tile ? len_q - m0 : tile); }
  FLASHATTN_HD int k_tile_rows(int64_t n0, int tile) const { return int(len_k - n0 < tile ? len_k - n0 : tile); }
  // Row `m` (counted within the sequence) of head h of a q-shaped operand (q, out, dout, dq),
  // and row `n` of head h of a k-shaped one (k, v, dk, dv), as typed pointers; T carries the
  // const of the operand.
  template <class T, class Base>
  FLASHATTN_HD T* q_rows(Base* base, const Strides& s, int64_t h, int64_t m) const {
    return static_cast<T*>(base) + tb * s.batch + h * s.head + (q0 + m) * s.row;
  }
  template <class T, class Base>
  FLASHATTN_HD T* k_rows(Base* base, const Strides& s, int64_t h, int64_t n) const {
    return static_cast<T*>(base) + tb * s.batch + h * s.head + (k0 + n) * s.row;
  }
  // Index of (head h, row) in lse-shaped (batches, heads_q, rows_per_head) arrays.
  FLASHATTN_HD int64_t row_index(int64_t heads_q, int64_t h, int64_t row) const {
    return (tb * heads_q + h) * rows_per_head + q0 + row;
  }
};

// Batches and rows per head of the q-shaped tensors (lse, dq, the row workspaces) as stored.
FLASHATTN_HD int64_t tensor_batches(const FwdParams& p) { return p.cu_seqlens_q ? 1 : p.batch; }
FLASHATTN_HD int64_t tensor_rows(const FwdParams& p) { return p.cu_seqlens_q ? p.total_q : p.len_q; }

// Sequence b of a padded batch with no window: what sequence() gives then, from fields a
// compiler can fold (kernels without the optional features take this one).
FLASHATTN_HD Seq plain_sequence(const FwdParams& p, int64_t b) {
  return Seq{b, b, 0, 0, p.len_q, p.len_k, p.len_q, make_band(p.causal, p.causal_offset, -1, -1, p.len_q, p.len_k)};
}

FLASHATTN_HD int64_t clamp_to(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

// sequence(p, b) with sequence b's seqused_k read as seqused[b] + added (seqused: seqused_k, or lengths a kernel
// knows before seqused_k is written: FwdParams::seqused_before).
FLASHATTN_HD Seq sequence_of_lengths(const FwdParams& p, int64_t b, const int32_t* seqused, int64_t added) {
  Seq s;
  s.b = b;
  int64_t causal_offset = p.causal_offset;
  if (p.cu_seqlens_q) {
    s.tb = 0;
    s.q0 = clamp_to(p.cu_seqlens_q[b], 0, p.total_q);
    s.k0 = clamp_to(p.cu_seqlens_k[b], 0, p.total_k);
    s.len_q = clamp_to(p.cu_seqlens_q[b + 1], s.q0, p.total_q) - s.q0;
    s.len_k = clamp_to(p.cu_seqlens_k[b + 1], s.k0, p.total_k) - s.k0;
    s.len_q = s.len_q < p.len_q ? s.len_q : p.len_q;
    s.len_k = s.len_k < p.len_k ? s.len_k : p.len_k;
    s.rows_per_head = p.total_q;
    causal_offset = p.causal_bottom_right ? s.len_k - s.len_q : 0;
  } else {
    s.tb = b;
    s.q0 = s.k0 = 0;
    s.len_q = p.len_q;
    s.len_k = p.len_k;
    s.rows_per_head = p.len_q;
    if (p.seqused_k) {
      const int64_t lo = p.leftpad_k ? p.leftpad_k[b] : 0, used = seqused[b] + added;
      s.valid = 0 <= lo && lo <= used && used <= p.len_k;
      s.k0 = s.valid ? lo : 0;
      s.len_k = s.valid ? used - lo : 0;
      causal_offset = p.causal_bottom_right ? s.len_k - s.len_q : 0;
    }
  }
  s.band = make_band(p.causal, causal_offset, p.window_left, p.window_right, s.len_q, s.len_k);
  return s;
}

FLASHATTN_HD Seq sequence(const FwdParams& p, int64_t b) { return sequence_of_lengths(p, b, p.seqused_k, 0); }

}  // namespace flashattn
