// The optional per-score features on one tile of scores of one (sequence, head), between
// S = scale Q K^T and the softmax: softcap, ALiBi, the bias / mask tensor, the band of keys
// each row sees (causal, sliding window), and the dropout keep mask. The per-score math is
// that of csrc/common/, shared with the CUDA kernels. A tile with no feature on costs only
// the band masking that the plain causal kernel always did.
#pragma once
#include <algorithm>
#include <cstdint>

#include "../common/dropout.h"
#include "../common/score_mods.h"
#include "../params.h"
#include "softmax.h"
#include "tile_io.h"
#include "tiles.h"

namespace flashattn::cpu::FLASHATTN_CPU_ISA {

// Where a tile sits: rows [row0, row0 + rows) and keys [col0, col0 + cols) of sequence `sq`,
// head h; its rows are padded with -inf scores up to cols_padded.
struct TilePos {
  const Seq& sq;
  int64_t h, row0, rows, col0, cols, cols_padded;
};

template <class A>
void add_alibi(const FwdParams& p, const TilePos& t, A* s, int64_t ld) {
  const A slope = A(p.alibi_slopes[t.sq.b * p.alibi_batch_stride + t.h]);
  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t c = 0; c < t.cols; ++c)
      s[r * ld + c] += alibi_bias(slope, t.row0 + r, t.col0 + c, t.sq.len_q, t.sq.len_k);
}

// Adds a float bias, or masks out (-inf) the scores a bool mask marks false, read through
// the bias's strides.
template <class A>
void apply_bias(const FwdParams& p, const TilePos& t, A* s, int64_t ld) {
  const int64_t* st = p.bias_stride;
  const int64_t first = t.sq.b * st[0] + t.h * st[1] + t.row0 * st[2] + t.col0 * st[3];
  if (p.bias_kind == BiasKind::kBool) {
    const bool* bias = static_cast<const bool*>(p.bias) + first;
    for (int64_t r = 0; r < t.rows; ++r)
      for (int64_t c = 0; c < t.cols; ++c)
        if (!bias[r * st[2] + c * st[3]]) s[r * ld + c] = kNegInf<A>;
    return;
  }
  with_type(p.bias_dtype, [&](auto type_tag) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(type_tag)>>;
    const T* bias = static_cast<const T*>(p.bias) + first;
    for (int64_t r = 0; r < t.rows; ++r)
      for (int64_t c = 0; c < t.cols; ++c) s[r * ld + c] += static_cast<A>(bias[r * st[2] + c * st[3]]);
  });
}

// Turns scale Q K^T into the scores the softmax takes. With softcap, `tanh_out` (if given)
// receives tanh(s / softcap) for the backward's derivative. Keys outside a row's band and
// the padding past the tile's last key become -inf.
template <class A>
void prepare_scores(const FwdParams& p, const TilePos& t, A* s, int64_t ld, A* tanh_out = nullptr) {
  if (p.softcap > 0.0) {
    const A cap = A(p.softcap);
    for (int64_t r = 0; r < t.rows; ++r)
      for (int64_t c = 0; c < t.cols; ++c) {
        const A th = softcap_tanh(s[r * ld + c], cap);
        if (tanh_out) tanh_out[r * ld + c] = th;
        s[r * ld + c] = cap * th;
      }
  }
  if (p.alibi_slopes) add_alibi(p, t, s, ld);
  if (p.bias_kind != BiasKind::kNone) apply_bias(p, t, s, ld);
  for (int64_t r = 0; r < t.rows; ++r) {
    A* sr = s + r * ld;
    const int64_t begin = std::clamp<int64_t>(t.sq.key_begin(t.row0 + r) - t.col0, 0, t.cols);
    const int64_t end = std::clamp<int64_t>(t.sq.key_end(t.row0 + r) - t.col0, begin, t.cols);
    std::fill(sr, sr + begin, kNegInf<A>);
    std::fill(sr + end, sr + t.cols_padded, kNegInf<A>);
  }
}

// Calls f(r, c, keep) for every score of the tile (c < cols), keep = the dropout decision.
// col0 is a multiple of 4 (tiles are), so each Philox call serves four columns of one row.
template <class F>
void for_each_dropout(const FwdParams& p, const TilePos& t, F&& f) {
  const uint32_t threshold = dropout_threshold(p.dropout_p);
  const int64_t bh = t.sq.b * p.heads_q + t.h;
  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t c = 0; c < t.cols; c += 4) {
      const Philox4 bits = dropout_bits(p.dropout_seed, p.dropout_offset, bh, t.row0 + r, (t.col0 + c) / 4);
      for (int i = 0; i < 4 && c + i < t.cols; ++i) f(r, c + i, bits.x[i] >= threshold);
    }
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
