// Row-wise softmax pieces on a tile of scores: the online (running max and sum) update used
// by the forward, and the recomputation of P from the saved LSE used by
// the backward. Rows are padded to the panel width, a multiple of the vector width.
#pragma once
#include <algorithm>
#include <cmath>
#include <limits>

#include "gemm.h"
#include "tiles.h"
#include "vec.h"

namespace flashattn::cpu::FLASHATTN_CPU_ISA {

template <class A>
constexpr A kNegInf = -std::numeric_limits<A>::infinity();

// Horizontal reduction of a vector in log2(width) steps: a lane-by-lane loop chains `width`
// dependent operations on every row of every tile.
template <class A, class Op>
inline A reduce_lanes(vec_t<A> v, Op op) {
  constexpr int W = Vec<A>::width;
  A t[W];
  std::memcpy(t, &v, sizeof(v));
  for (int s = W / 2; s > 0; s /= 2)
    for (int i = 0; i < s; ++i) t[i] = op(t[i], t[i + s]);
  return t[0];
}

// Largest score of a row. NaN scores are not seen here (a plain max is cheaper); they
// reach the output through exp, except in a row with nothing else visible, which
// OnlineSoftmax::update checks for.
template <class A>
A row_max(const A* x, int64_t n) {
  using V = vec_t<A>;
  constexpr int W = Vec<A>::width;
  V m = vbroadcast(kNegInf<A>);
  for (int64_t c = 0; c < n; c += W) {
    const V v = vload(x + c);
    m = v > m ? v : m;
  }
  return reduce_lanes<A>(m, [](A a, A b) { return a > b ? a : b; });
}

template <class A>
bool any_nan(const A* x, int64_t n) {
  bool found = false;
  for (int64_t c = 0; c < n; ++c) found |= x[c] != x[c];
  return found;
}

// x = exp(x - shift) in place; returns the sum.
template <class A>
A exp_shifted(A* x, int64_t n, A shift) {
  using V = vec_t<A>;
  constexpr int W = Vec<A>::width;
  V sum{};
  for (int64_t c = 0; c < n; c += W) {
    const V e = vexp(vload(x + c) - shift);
    vstore(x + c, e);
    sum += e;
  }
  return reduce_lanes<A>(sum, [](A a, A b) { return a + b; });
}

template <class A>
void scale_row(A* x, int64_t n, A factor) {
  for (int64_t c = 0; c < n; ++c) x[c] *= factor;
}

// Running max m and sum l per row; turns each score tile into its probabilities (relative
// to the running max) and rescales the output accumulator when the max grows.
template <class A>
struct OnlineSoftmax {
  A* m;
  A* l;
  int64_t rows;

  void reset() {
    std::fill(m, m + rows, kNegInf<A>);
    std::fill(l, l + rows, A(0));
  }

  void update(A* s, int64_t ld, int64_t cols_padded, A* o, int64_t ld_o) {
    for (int64_t r = 0; r < rows; ++r) {
      A* sr = s + r * ld;
      const A m_new = std::max(m[r], row_max(sr, cols_padded));
      if (m_new == kNegInf<A>) {  // nothing visible yet: this tile adds nothing...
        if (any_nan(sr, cols_padded)) {  // ...unless its scores are NaN: poison the row, as torch
          m[r] = l[r] = std::numeric_limits<A>::quiet_NaN();
          continue;  // the NaN scores stay in sr and reach O through P V
        }
        std::fill(sr, sr + cols_padded, A(0));
        continue;
      }
      const A alpha = std::exp(m[r] - m_new);  // 0 on the first visible tile
      l[r] = l[r] * alpha + exp_shifted(sr, cols_padded, m_new);
      m[r] = m_new;
      if (alpha != A(1)) scale_row(o + r * ld_o, ld_o, alpha);
    }
  }

  // o *= out_scale / l and lse = m + log(l); a row that saw no key gets o = 0 and lse = -inf.
  // (out_scale is 1 / (1 - p) under dropout.)
  void finish(A* o, int64_t ld_o, A* lse, A out_scale) const {
    for (int64_t r = 0; r < rows; ++r) {
      if (l[r] == A(0)) {
        std::fill(o + r * ld_o, o + (r + 1) * ld_o, A(0));
        lse[r] = kNegInf<A>;
      } else {
        scale_row(o + r * ld_o, ld_o, out_scale / l[r]);
        lse[r] = m[r] + std::log(l[r]);
      }
    }
  }
};

// s = exp(s - lse) per row: the probabilities of the forward. A row whose lse is -inf saw no key; its probabilities are 0.
template <class A>
void recompute_probs(A* s, int64_t ld, int64_t rows, int64_t cols_padded, const A* lse) {
  for (int64_t r = 0; r < rows; ++r) {
    const A shift = lse[r] == kNegInf<A> ? std::numeric_limits<A>::infinity() : lse[r];
    exp_shifted(s + r * ld, cols_padded, shift);
  }
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
