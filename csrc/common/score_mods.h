// The per-score functions between S = scale * Q K^T and the softmax that every backend
// shares: which keys a query row sees (causal and sliding window), softcap and ALiBi.
#pragma once
#include <cmath>
#include <cstdint>

#include "hd.h"

namespace flashattn {

// Far beyond any length, small enough that row + kUnbounded cannot overflow.
constexpr int64_t kUnbounded = int64_t(1) << 60;

// Query row i sees key j iff i + lo <= j <= i + hi (and 0 <= j < len_k): the intersection
// of the causal limit (j <= i + causal_offset) and the window, aligned bottom-right
// (offset len_k - len_q) as flash-attn's; a window side of -1 is unbounded.
struct Band {
  int64_t lo, hi;

  FLASHATTN_HD bool visible(int64_t row, int64_t key) const { return key >= row + lo && key <= row + hi; }
  FLASHATTN_HD int64_t key_begin(int64_t row, int64_t len_k) const { return clamp(row + lo, len_k); }
  FLASHATTN_HD int64_t key_end(int64_t row, int64_t len_k) const { return clamp(row + hi + 1, len_k); }
  // Query rows [row_begin, row_end) see key `key`.
  FLASHATTN_HD int64_t row_begin(int64_t key, int64_t len_q) const { return clamp(key - hi, len_q); }
  FLASHATTN_HD int64_t row_end(int64_t key, int64_t len_q) const { return clamp(key - lo + 1, len_q); }

 private:
  FLASHATTN_HD static int64_t clamp(int64_t x, int64_t n) { return x < 0 ? 0 : (x > n ? n : x); }
};

FLASHATTN_HD Band make_band(bool causal, int64_t causal_offset, int64_t window_left, int64_t window_right,
                            int64_t len_q, int64_t len_k) {
  const int64_t off = len_k - len_q;
  Band b{window_left >= 0 ? off - window_left : -kUnbounded, window_right >= 0 ? off + window_right : kUnbounded};
  if (causal && causal_offset < b.hi) b.hi = causal_offset;
  return b;
}

// softcap * tanh(s / softcap): bounds the scores smoothly (Gemma 2). Its derivative is
// 1 - tanh^2, which the backward takes from the same tanh.
template <class A>
FLASHATTN_HD A softcap_tanh(A s, A softcap) {
#ifdef __CUDA_ARCH__
  return ::tanh(s / softcap);
#else
  return std::tanh(s / softcap);
#endif
}

// ALiBi bias -slope * |i + len_k - len_q - j| (flash-attn's definition, aligned bottom-right).
template <class A>
FLASHATTN_HD A alibi_bias(A slope, int64_t row, int64_t col, int64_t len_q, int64_t len_k) {
  const int64_t d = row + len_k - len_q - col;
  return -slope * A(d < 0 ? -d : d);
}

}  // namespace flashattn
