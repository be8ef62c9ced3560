// The optional per-score features on one tile of scores of one (sequence, head), between
// S = scale Q K^T and the softmax: softcap, ALiBi, the bias / mask tensor, the band of keys
// each row sees (causal, sliding window), and the dropout keep mask. The per-score math is
// that of csrc/common/, shared with the CUDA kernels. A tile with no feature on costs only
// the band masking that the plain causal kernel always did.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../common/dropout.h"
#include "../common/score_mods.h"
#include "../params.h"
#include "softmax.h"
#include "tile_io.h"
#include "tiles.h"
#include "vec.h"

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

// s = softcap * tanh(s / softcap) on the tile (padding included); `tanh_out` (if given)
// receives tanh(s / softcap) for the backward's derivative. float takes the vector tanh.
template <class A>
void apply_softcap(const FwdParams& p, const TilePos& t, A* s, int64_t ld, A* tanh_out) {
  const A cap = A(p.softcap);
  for (int64_t r = 0; r < t.rows; ++r) {
    A* sr = s + r * ld;
    A* tr = tanh_out ? tanh_out + r * ld : nullptr;
    if constexpr (std::is_same_v<A, float>) {
      for (int64_t c = 0; c < t.cols_padded; c += Vec<float>::width) {
        const vec_t<float> th = vtanh(vload(sr + c) / cap);
        if (tr) vstore(tr + c, th);
        vstore(sr + c, th * cap);
      }
    } else {
      for (int64_t c = 0; c < t.cols; ++c) {
        const A th = softcap_tanh(sr[c], cap);
        if (tr) tr[c] = th;
        sr[c] = cap * th;
      }
    }
  }
}

// Turns scale Q K^T into the scores the softmax takes: softcap, ALiBi, bias. Keys outside a
// row's band and the padding past the tile's last key become -inf.
template <class A>
void prepare_scores(const FwdParams& p, const TilePos& t, A* s, int64_t ld, A* tanh_out = nullptr) {
  if (p.softcap > 0.0) apply_softcap(p, t, s, ld, tanh_out);
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

// Philox-4x32-10 (common/philox.h) on a vector of counters at once, one per lane.
struct PhiloxLanes {
  using U32 = vec_t<uint32_t>;
  typedef uint64_t U64 __attribute__((vector_size(2 * kVecBytes)));
  U32 x[4];

  void run(uint32_t key0, uint32_t key1) {
    for (int round = 0; round < 10; ++round) {
      const U64 p0 = __builtin_convertvector(x[0], U64) * uint64_t(0xD2511F53u);
      const U64 p1 = __builtin_convertvector(x[2], U64) * uint64_t(0xCD9E8D57u);
      const U32 hi0 = __builtin_convertvector(p0 >> 32, U32), lo0 = __builtin_convertvector(p0, U32);
      const U32 hi1 = __builtin_convertvector(p1 >> 32, U32), lo1 = __builtin_convertvector(p1, U32);
      x[0] = hi1 ^ x[1] ^ key0;
      x[1] = lo1;
      x[2] = hi0 ^ x[3] ^ key1;
      x[3] = lo0;
      key0 += 0x9E3779B9u;
      key1 += 0xBB67AE85u;
    }
  }
};

// Calls f(r, c, keep) for every score of the tile (c < cols), keep = the dropout decision of
// common/dropout.h. col0 is a multiple of 4 (tiles are), so a lane's Philox call serves four
// columns of one row; a vector of lanes serves 4 * width columns.
template <class F>
void for_each_dropout(const FwdParams& p, const TilePos& t, F&& f) {
  using U32 = vec_t<uint32_t>;
  constexpr int W = Vec<uint32_t>::width;
  const uint32_t threshold = dropout_threshold(p.dropout_p);
  const uint32_t key0 = uint32_t(p.dropout_seed), key1 = uint32_t(p.dropout_seed >> 32);
  const uint32_t bh = uint32_t(t.sq.b * p.heads_q + t.h);
  U32 lane{};
  for (int i = 0; i < W; ++i) lane[i] = uint32_t(i);
  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t c = 0; c < t.cols; c += 4 * W) {
      PhiloxLanes ph{{lane + uint32_t((t.col0 + c) / 4), vbroadcast(uint32_t(t.row0 + r)), vbroadcast(bh),
                      vbroadcast(p.dropout_offset)}};
      ph.run(key0, key1);
      for (int g = 0; g < W; ++g)
        for (int i = 0; i < 4 && c + 4 * g + i < t.cols; ++i) f(r, c + 4 * g + i, ph.x[i][g] >= threshold);
    }
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
