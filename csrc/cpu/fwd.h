// CPU forward: for each (sequence, head, query tile), stream key/value tiles through a tiled
// online softmax. A task owns one (sequence, kv head) and a share of its query tiles, for every
// query head of the GQA group, so the transposed key tiles it builds serve all of them. A sequence
// of at most kDecodeRows query rows (a decode step) takes fwd_rows_tile instead: its group's heads
// packed into one tile, key and value rows read where they lie (in their pages, paged).
// Extra memory per thread is one tile set and the transposed keys of one head: O(len_k),
// nothing of size len_q x len_k.
#include <cmath>
#include <limits>
#include <vector>

#pragma once
#include "../common/pages.h"
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

// One thread's tiles; row-major, padded to the panel width.
template <class A>
struct FwdScratch {
  // bf16 products (bf16_dot.h): the prefill tiles of bf16 calls of even head dims where the CPU has them.
  bool dot;
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
  // (dot: below) Q, the key tiles (transposed, cached as kt is) and V as pair words (ld_qk / 2 and ld_v a row), P
  // rounded to bf16; kt then has only its last slot (the decode rows' tile, fwd_rows_tile, takes it).
  std::vector<uint32_t> qp, ktp, vp, pb;
  // cache_key_tiles: the task computes several query tiles against the same key tiles (else one slot, no cache);
  // rows: the query rows of its tiles (kFwdTileQ, or a decode step's kDecodeRows).
  FwdScratch(const FwdParams& p, bool cache_key_tiles, int64_t rows = kFwdTileQ)
      : dot(rows == kFwdTileQ && std::is_same_v<A, float> && p.dtype == DType::kBFloat16 && p.head_dim % 2 == 0 &&
            p.head_dim_v % 2 == 0 && cpu_has_bf16_dot()),
        ld_qk(round_up(p.head_dim, kPanel<A>)),
        ld_v(round_up(p.head_dim_v, kPanel<A>)),
        cached(cache_key_tiles ? std::min((p.len_k + kFwdTileK - 1) / kFwdTileK,
                                          kCacheBytes / int64_t(sizeof(A) * ld_qk * kFwdTileK))
                               : 0),
        filled(cached),
        kt((dot ? 1 : cached + 1) * ld_qk * kFwdTileK),
        q(rows * ld_qk),
        v(kFwdTileK * ld_v),
        s(rows * kFwdTileK),
        o(rows * ld_v),
        m(rows),
        l(rows),
        qp(dot ? rows * ld_qk / 2 : 0),
        ktp(dot ? (cached + 1) * ld_qk / 2 * kFwdTileK : 0),
        vp(dot ? kFwdTileK / 2 * ld_v : 0),
        pb(dot ? rows * kFwdTileK / 2 : 0) {}
};

// The dropped probabilities of a tile of scores (rows kFwdTileK apart) set to 0: l keeps every probability, only
// P V sees the dropped ones as 0.
template <class A>
void drop_scores(const FwdParams& p, const TilePos& pos, A* s) {
  for_each_dropout(p, pos, [s](int64_t r, int64_t c, bool keep) {
    if (!keep) s[r * kFwdTileK + c] = A(0);
  });
}

// Rows row0 .. row0 + rows - 1 of query head h done: O / l into `out`, LSE; m, l and o (ld_v apart) the rows' own.
template <class A>
void finish_rows(const FwdParams& p, const Seq& sq, int64_t h, int64_t row0, int64_t rows, A* m, A* l, A* o,
                 int64_t ld_v) {
  for (int64_t r = 0; r < rows; ++r) l[r] = sq.row_sum(l[r]);  // NaN rows for an invalid sequence
  const OnlineSoftmax<A> sm{m, l, rows};
  sm.finish(o, ld_v, static_cast<A*>(p.lse) + sq.row_index(p.heads_q, h, row0), A(1) / A(1 - p.dropout_p));
  store_rows<A>(p.dtype, row_ptr(p.out, p.out_stride, p.dtype, sq.tb, h, sq.q0 + row0), p.out_stride.row, rows,
                p.head_dim_v, A(1), o, ld_v);
}

// f(c, run, row) for each run of keys col0 + c .. col0 + c + run - 1 (c < cols) of kv head hk of a paged k- or
// v-shaped operand (base, strides s) that lie in one page: the run's first row (the next ones a row stride apart).
// A tile of kFwdTileK keys crosses pages of fewer keys, or starts mid-page after left padding.
template <class F>
void for_each_page_run(const FwdParams& p, const Seq& sq, const void* base, const Strides& s, int64_t hk,
                       int64_t col0, int64_t cols, F&& f) {
  const int64_t elem = int64_t(dtype_size(p.dtype));
  for (int64_t c = 0; c < cols;) {
    const int64_t j = sq.k0 + col0 + c, page = page_of(p, j), in_page = j - page * p.page_size;
    const int64_t run = std::min(cols - c, p.page_size - in_page), block = block_of(p, sq.tb, page);
    f(c, run, static_cast<const char*>(base) + (block * s.batch + hk * s.head + in_page * s.row) * elem);
    c += run;
  }
}

// Key rows col0 .. col0 + cols - 1 of kv head hk of a k- or v-shaped operand (base, strides s; len elements a row)
// into `tile` (rows ld apart, padded with zeros to ld): from a dense tensor, or a page's run at a time.
template <class A>
void load_key_rows(const FwdParams& p, const Seq& sq, const void* base, const Strides& s, int64_t hk, int64_t col0,
                   int64_t cols, int64_t len, A* tile, int64_t ld) {
  if (!p.is_paged())
    return load_rows<A>(p.dtype, row_ptr(base, s, p.dtype, sq.tb, hk, sq.k0 + col0), s.row, cols, len, A(1), tile, ld,
                        ld);
  for_each_page_run(p, sq, base, s, hk, col0, cols, [&](int64_t c, int64_t run, const char* row) {
    load_rows<A>(p.dtype, row, s.row, run, len, A(1), tile + c * ld, ld, ld);
  });
}

// Each key row's address, for rows col0 .. col0 + cols - 1 of kv head hk of a k- or v-shaped operand (dense, or in
// its pages).
inline void key_row_addresses(const FwdParams& p, const Seq& sq, const void* base, const Strides& s, int64_t hk,
                              int64_t col0, int64_t cols, const char** rows) {
  const int64_t stride_bytes = s.row * int64_t(dtype_size(p.dtype));
  auto run_rows = [&](int64_t c, int64_t run, const char* row) { strided_rows(row, stride_bytes, run, rows + c); };
  if (p.is_paged())
    for_each_page_run(p, sq, base, s, hk, col0, cols, run_rows);
  else
    run_rows(0, cols, row_ptr(base, s, p.dtype, sq.tb, hk, sq.k0 + col0));
}

template <class A>
void fwd_tile(const FwdParams& p, FwdScratch<A>& w, const Seq& sq, int64_t h, int64_t row0) {
  const int64_t rows = std::min(kFwdTileQ, sq.len_q - row0);
  const int64_t hk = h / p.group();
  const DType t = p.dtype;
  const char* const q_rows = row_ptr(p.q, p.q_stride, t, sq.tb, h, sq.q0 + row0);
  const int64_t pairs = p.head_dim / 2;
  if (w.dot) {  // (unscaled: the scale multiplies S)
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(w.qp.data() + r * w.ld_qk / 2, q_rows + r * p.q_stride.row * 2, size_t(pairs) * 4);
  } else {
    load_rows<A>(t, q_rows, p.q_stride.row, rows, p.head_dim, A(p.scale), w.q.data(), w.ld_qk, w.ld_qk);
  }
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
    A* kt = w.kt.data() + (w.dot ? 0 : std::min(tile, w.cached) * w.ld_qk * kFwdTileK);
    uint32_t* ktp = w.ktp.data() + (w.dot ? std::min(tile, w.cached) * w.ld_qk / 2 * kFwdTileK : 0);
    if (tile >= w.cached || !w.filled[tile]) {
      // A tile cut short by the band is transposed whole: later query tiles see more of it.
      const int64_t tile_keys = std::min(kFwdTileK, sq.len_k - col0), padded = round_up(tile_keys, kPanel<A>);
      if (w.dot) {
        const char* key_rows[kFwdTileK];
        key_row_addresses(p, sq, p.k, p.k_stride, hk, col0, tile_keys, key_rows);
        put_pairs_transposed(key_rows, tile_keys, pairs, ktp, kFwdTileK);
        for (int64_t i = 0; i < pairs; ++i)
          std::fill(ktp + i * kFwdTileK + tile_keys, ktp + i * kFwdTileK + padded, 0u);
      } else if (p.is_paged()) {  // (a page's run of rows at a time, the padding after the last)
        for_each_page_run(p, sq, p.k, p.k_stride, hk, col0, tile_keys, [&](int64_t c, int64_t run, const char* row) {
          load_rows_transposed<A>(t, row, p.k_stride.row, run, p.head_dim, kt + c, kFwdTileK, run);
        });
        load_rows_transposed<A>(t, nullptr, 0, 0, p.head_dim, kt + tile_keys, kFwdTileK, padded - tile_keys);
      } else {
        load_rows_transposed<A>(t, row_ptr(p.k, p.k_stride, t, sq.tb, hk, sq.k0 + col0), p.k_stride.row, tile_keys,
                                p.head_dim, kt, kFwdTileK, padded);
      }
      if (tile < w.cached) w.filled[tile] = 1;
    }
    if constexpr (kBf16DotBuilt && std::is_same_v<A, float>) {
      if (w.dot) {
        gemm_bf16_pairs(rows, cols_padded, pairs, w.qp.data(), w.ld_qk / 2, ktp, kFwdTileK, w.s.data(), kFwdTileK,
                        float(p.scale), false);
      }
    }
    if (!w.dot)
      gemm<A>(rows, cols_padded, p.head_dim, w.q.data(), w.ld_qk, kt, kFwdTileK, w.s.data(), kFwdTileK, false);
    const TilePos pos{sq, h, row0, rows, col0, cols, cols_padded};
    prepare_scores(p, pos, w.s.data(), kFwdTileK);
    sm.update(w.s.data(), kFwdTileK, cols_padded, w.o.data(), w.ld_v);
    if (p.dropout_p > 0.0) drop_scores(p, pos, w.s.data());
    if constexpr (kBf16DotBuilt && std::is_same_v<A, float>) {
      if (w.dot) {  // (P rounded to bf16 as the GPU kernels round it; the row sums keep the floats)
        const char* value_rows[kFwdTileK];
        key_row_addresses(p, sq, p.v, p.v_stride, hk, col0, cols, value_rows);
        put_row_pairs(value_rows, cols, p.head_dim_v, w.vp.data(), w.ld_v);
        put_rounded_pairs(w.s.data(), kFwdTileK, rows, cols_padded, w.pb.data(), kFwdTileK / 2);
        gemm_bf16_pairs(rows, w.ld_v, (cols + 1) / 2, w.pb.data(), kFwdTileK / 2, w.vp.data(), w.ld_v, w.o.data(),
                        w.ld_v, 1.f, true);
        continue;
      }
    }
    load_key_rows<A>(p, sq, p.v, p.v_stride, hk, col0, cols, p.head_dim_v, w.v.data(), w.ld_v);
    gemm<A>(rows, w.ld_v, cols, w.s.data(), kFwdTileK, w.v.data(), w.ld_v, w.o.data(), w.ld_v, true);
  }
  finish_rows(p, sq, h, row0, rows, w.m.data(), w.l.data(), w.o.data(), w.ld_v);
}

// Where a tile's key or value rows lie (row c at rows(c)): `ld` apart from `base`, or each at its own address (the
// rows of a paged cache, which a tile may cross from one page to the next). T: the compute type, or bf16 / fp16
// under fp32 (widened in the loads).
template <class T>
struct StridedRows {
  const T* base;
  int64_t ld;
  const T* operator()(int64_t c) const { return base + c * ld; }
};
template <class T>
struct ListedRows {
  const char* const* at;
  const T* operator()(int64_t c) const { return reinterpret_cast<const T*>(at[c]); }
};

// s[r][c] = q[r] . k[c] over len elements (a multiple of half the vector width; q's rows zero past len up to a whole
// vector) for kRows query rows (q and s rows q_ld / s_ld apart) and the cols key rows k(c): each score's sum over its
// vectors in order, then across the lanes, whatever kRows; a last half vector of k loaded as the lower lanes of a
// zeroed one. kRows rows by kKeys keys at a time, so that each vector loaded serves several products and their
// chains overlap. kMasked: k's rows end at `end` < len, their vectors past it loaded masked (vload_first), zeros as
// a copied tile's padding.
template <class A, int kRows, bool kMasked, class Rows>
void dot_block(const A* q, int64_t q_ld, const Rows& k, int64_t len, int64_t end, int64_t cols, A* s, int64_t s_ld) {
  using V = vec_t<A>;
  constexpr int W = Vec<A>::width, kKeys = 4;
  const auto sum = [](V acc) { return reduce_lanes<A>(acc, [](A a, A b) { return a + b; }); };
  const int64_t whole = len / W * W;
  int64_t c = 0;
  for (; c + kKeys <= cols; c += kKeys) {
    V acc[kRows][kKeys] = {};
    decltype(k(0)) kc[kKeys];
#pragma GCC unroll 4
    for (int u = 0; u < kKeys; ++u) kc[u] = k(c + u);
    for (int64_t d = 0; d < whole; d += W) {
#pragma GCC unroll 4
      for (int u = 0; u < kKeys; ++u) {
        const V ku = vload_row<A, kMasked>(kc[u] + d, end - d);
#pragma GCC unroll 2
        for (int r = 0; r < kRows; ++r) acc[r][u] += vload(q + r * q_ld + d) * ku;
      }
    }
    if (whole < len) {
#pragma GCC unroll 4
      for (int u = 0; u < kKeys; ++u) {
        const V ku = vload_row<A, kMasked, true>(kc[u] + whole, end - whole);
#pragma GCC unroll 2
        for (int r = 0; r < kRows; ++r) acc[r][u] += vload(q + r * q_ld + whole) * ku;
      }
    }
#pragma GCC unroll 2
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < kKeys; ++u) s[r * s_ld + c + u] = sum(acc[r][u]);
  }
  for (; c < cols; ++c)
    for (int r = 0; r < kRows; ++r) {
      V acc{};
      for (int64_t d = 0; d < whole; d += W)
        acc += vload(q + r * q_ld + d) * vload_row<A, kMasked>(k(c) + d, end - d);
      if (whole < len)
        acc += vload(q + r * q_ld + whole) * vload_row<A, kMasked, true>(k(c) + whole, end - whole);
      s[r * s_ld + c] = sum(acc);
    }
}

// o[r][d0 ..] += sum over c < cols of p[r][c] v(c)[d0 ..] for kRows rows (p and o rows p_ld / o_ld apart) and kVecs
// vectors from column d0: each vector of o's sum over the keys in order, from zero, joining o at the end (one
// rounded partial sum a tile), whatever kRows or kVecs. kRows rows by kVecs vectors at a time, so that each value
// vector loaded serves kRows products and their chains overlap; kHalf: the last vector is a row's last half (loaded
// as the lower lanes of a zeroed one; o's row has room for the whole vector). add_weighted_cols: the len elements of
// the rows (a multiple of half the vector width). kMasked: v's rows end at `end`, their vectors past it loaded masked.
template <class A, int kRows, int kVecs, bool kHalf, bool kMasked, class Rows>
void add_weighted_block(const A* p, int64_t p_ld, const Rows& v, int64_t d0, int64_t end, int64_t cols, A* o,
                        int64_t o_ld) {
  using V = vec_t<A>;
  constexpr int W = Vec<A>::width;
  V acc[kRows][kVecs] = {};
  for (int64_t c = 0; c < cols; ++c) {
    V pc[kRows];
#pragma GCC unroll 2
    for (int r = 0; r < kRows; ++r) pc[r] = vbroadcast(p[r * p_ld + c]);
    const auto vc = v(c) + d0;
#pragma GCC unroll 8
    for (int u = 0; u < kVecs; ++u) {
      const V vu = kHalf && u == kVecs - 1 ? vload_row<A, kMasked, true>(vc + u * W, end - d0 - u * W)
                                           : vload_row<A, kMasked>(vc + u * W, end - d0 - u * W);
#pragma GCC unroll 2
      for (int r = 0; r < kRows; ++r) acc[r][u] += pc[r] * vu;
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int u = 0; u < kVecs; ++u) {
      A* od = o + r * o_ld + d0 + u * W;
      vstore(od, vload(od) + acc[r][u]);
    }
}
template <class A, int kRows, bool kMasked, class Rows>
void add_weighted_cols(const A* p, int64_t p_ld, const Rows& v, int64_t len, int64_t end, int64_t cols, A* o,
                       int64_t o_ld) {
  constexpr int W = Vec<A>::width, kMost = 8 / kRows;  // (kRows x kMost accumulators)
  const int64_t whole = len / W * W;
  int64_t d = 0;
  for (; d + kMost * W <= whole; d += kMost * W)
    add_weighted_block<A, kRows, kMost, false, kMasked>(p, p_ld, v, d, end, cols, o, o_ld);
  for (; d + 2 * W <= whole; d += 2 * W) add_weighted_block<A, kRows, 2, false, kMasked>(p, p_ld, v, d, end, cols, o, o_ld);
  if (d < whole) add_weighted_block<A, kRows, 1, false, kMasked>(p, p_ld, v, d, end, cols, o, o_ld);
  if (whole < len) add_weighted_block<A, kRows, 1, true, kMasked>(p, p_ld, v, whole, end, cols, o, o_ld);
}

// The above for `rows` rows, two at a time (each row's sums as alone); dot_rows zeroes s[r][cols .. cols_padded).
// end: the rows' length (len rounds it up to half a vector; below len, kMasked).
template <class A, bool kMasked, class Rows>
void dot_rows(const A* q, int64_t q_ld, int64_t rows, const Rows& k, int64_t len, int64_t end, int64_t cols,
              int64_t cols_padded, A* s, int64_t s_ld) {
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) dot_block<A, 2, kMasked>(q + r * q_ld, q_ld, k, len, end, cols, s + r * s_ld, s_ld);
  if (r < rows) dot_block<A, 1, kMasked>(q + r * q_ld, q_ld, k, len, end, cols, s + r * s_ld, s_ld);
  for (r = 0; r < rows; ++r) std::fill(s + r * s_ld + cols, s + r * s_ld + cols_padded, A(0));
}
template <class A, bool kMasked, class Rows>
void add_weighted_rows(const A* p, int64_t p_ld, int64_t rows, const Rows& v, int64_t len, int64_t end, int64_t cols,
                       A* o, int64_t o_ld) {
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2)
    add_weighted_cols<A, 2, kMasked>(p + r * p_ld, p_ld, v, len, end, cols, o + r * o_ld, o_ld);
  if (r < rows) add_weighted_cols<A, 1, kMasked>(p + r * p_ld, p_ld, v, len, end, cols, o + r * o_ld, o_ld);
}

// A decode step's tile (at most kDecodeRows query rows a kv head): consecutive query heads h0 .. h0 + heads - 1 of
// one kv head, the sequence's rows of each, packed head by head (packed row i * rows + r), so that each key and value
// tile is read once for all of them. The key and value rows are read where they lie, paged or not (no
// transposition; copied first only where their dtype or length differs from the tiles'), by vector dot products (S)
// and row updates (O += P V), each row's sums in the same order whatever its pack. Against the prefill tiles (a
// transposed key tile and a value copy per head) this is 6x faster at MHA (docs/kernels/cpu.md). Above 8 rows the
// prefill tiles' products win (16 rows of one head: 2x).
constexpr int64_t kDecodeRows = 8;

template <class A>
void fwd_rows_tile(const FwdParams& p, FwdScratch<A>& w, const Seq& sq, int64_t h0, int64_t heads) {
  const int64_t rows = sq.len_q, packed = heads * rows, hk = h0 / p.group();
  const DType t = p.dtype;
  for (int64_t i = 0; i < heads; ++i)
    load_rows<A>(t, row_ptr(p.q, p.q_stride, t, sq.tb, h0 + i, sq.q0), p.q_stride.row, rows, p.head_dim,
                 A(p.scale), w.q.data() + i * rows * w.ld_qk, w.ld_qk, w.ld_qk);
  std::fill(w.o.begin(), w.o.begin() + packed * w.ld_v, A(0));
  OnlineSoftmax<A> sm{w.m.data(), w.l.data(), packed};
  sm.reset();
  A* const k = w.kt.data() + w.kt.size() - w.ld_qk * kFwdTileK;  // key rows, ld_qk apart (kt's last slot)
  // The products run over whole vectors and a last half (len_qk, len_v: the head dims rounded up to half the vector
  // width; the tiles' padding past them is zero). Key and value rows of the compute type or bf16 / fp16 under fp32
  // (widened in the loads) are read where they lie: rows of whole and half vectors as they are, rows of other
  // lengths with their last vector masked (kMaskedLoads builds; the same sums as a copy's zero padding); elsewhere
  // those are copied into the tiles first.
  constexpr int64_t W = Vec<A>::width;
  const int64_t len_qk = round_up(p.head_dim, W / 2), len_v = round_up(p.head_dim_v, W / 2);
  const bool rows_in_place = kMaskedLoads || (p.head_dim == len_qk && p.head_dim_v == len_v);
  const char* at[kFwdTileK];  // a paged tile's rows
  // f(rows) on the tile's key rows of a k- or v-shaped operand (base, strides st; len elements a row) at column col0:
  // where they lie, or copied into `tile` (rows ld apart).
  const auto with_rows = [&](const void* base, const Strides& st, int64_t len, int64_t col0, int64_t cols, A* tile,
                             int64_t ld, auto&& f) {
    const auto read = [&](auto type_tag) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(type_tag)>>;
      // (rows of lengths in whole and half vectors, or kMaskedLoads' masked last vector)
      const auto call = [&](const auto& rows) {
        if constexpr (kMaskedLoads) {
          if (len != round_up(len, W / 2)) return f(rows, std::true_type{});
        }
        f(rows, std::false_type{});
      };
      if (!p.is_paged())
        return call(StridedRows<T>{reinterpret_cast<const T*>(row_ptr(base, st, t, sq.tb, hk, sq.k0 + col0)), st.row});
      key_row_addresses(p, sq, base, st, hk, col0, cols, at);
      return call(ListedRows<T>{at});
    };
    bool read_in_place = false;
    if (rows_in_place) {
      with_type(t, [&](auto type_tag) {
        if constexpr (kLoadsAs<A, std::remove_const_t<std::remove_pointer_t<decltype(type_tag)>>>) {
          read(type_tag);
          read_in_place = true;
        }
      });
    }
    if (read_in_place) return;
    load_key_rows<A>(p, sq, base, st, hk, col0, cols, len, tile, ld);
    f(StridedRows<A>{tile, ld}, std::false_type{});  // (a copy: its padding is zero)
  };
  const int64_t begin = sq.key_begin(0) / kFwdTileK * kFwdTileK, end = sq.key_end(rows - 1);
  for (int64_t col0 = begin; col0 < end; col0 += kFwdTileK) {
    const int64_t cols = std::min(kFwdTileK, end - col0), cols_padded = round_up(cols, kPanel<A>);
    with_rows(p.k, p.k_stride, p.head_dim, col0, cols, k, w.ld_qk, [&](const auto& kr, auto masked) {
      dot_rows<A, masked()>(w.q.data(), w.ld_qk, packed, kr, len_qk, p.head_dim, cols, cols_padded, w.s.data(),
                            kFwdTileK);
    });
    for (int64_t i = 0; i < heads; ++i)
      prepare_scores(p, TilePos{sq, h0 + i, 0, rows, col0, cols, cols_padded}, w.s.data() + i * rows * kFwdTileK,
                     kFwdTileK);
    sm.update(w.s.data(), kFwdTileK, cols_padded, w.o.data(), w.ld_v);
    for (int64_t i = 0; i < heads && p.dropout_p > 0.0; ++i)
      drop_scores(p, TilePos{sq, h0 + i, 0, rows, col0, cols, cols_padded}, w.s.data() + i * rows * kFwdTileK);
    with_rows(p.v, p.v_stride, p.head_dim_v, col0, cols, w.v.data(), w.ld_v, [&](const auto& vr, auto masked) {
      add_weighted_rows<A, masked()>(w.s.data(), kFwdTileK, packed, vr, len_v, p.head_dim_v, cols, w.o.data(),
                                     w.ld_v);
    });
  }

  for (int64_t i = 0; i < heads; ++i)
    finish_rows(p, sq, h0 + i, 0, rows, w.m.data() + i * rows, w.l.data() + i * rows,
                w.o.data() + i * rows * w.ld_v, w.ld_v);
}

// Query heads hk * group + pack * per_pack ... of a short sequence (at most kDecodeRows rows) by fwd_rows_tile, in
// packs of per_pack heads of at most kDecodeRows rows each.
template <class A>
void fwd_rows_pack(const FwdParams& p, FwdScratch<A>& w, const Seq& sq, int64_t hk, int64_t pack, int64_t per_pack) {
  const int64_t h0 = hk * p.group() + pack * per_pack, heads = std::min(per_pack, (hk + 1) * p.group() - h0);
  if (heads > 0 && sq.len_q > 0) fwd_rows_tile<A>(p, w, sq, h0, heads);
}

template <class A>
void fwd_impl(const FwdParams& p) {
  const int64_t n_tiles = (p.len_q + kFwdTileQ - 1) / kFwdTileQ;  // of the longest sequence
  const int64_t n_groups = p.batch * p.heads_kv;
  const int64_t threads = torch::stable::get_num_threads();
  if (p.len_q <= kDecodeRows) {
    // A decode step: a kv head's query heads in packs of at most kDecodeRows rows, more packs where that gives every
    // thread a task (each pack loads the key and value tiles itself).
    const int64_t most = kDecodeRows / std::max<int64_t>(p.len_q, 1), fewest = (p.group() + most - 1) / most;
    const int64_t packs = std::clamp<int64_t>((threads + n_groups - 1) / n_groups, fewest, p.group());
    const int64_t per_pack = (p.group() + packs - 1) / packs;
    run_tasks(n_groups * packs, [&] {
      return [&p, w = FwdScratch<A>(p, false, kDecodeRows), packs, per_pack](int64_t task) mutable {
        const int64_t g = task / packs;
        fwd_rows_pack<A>(p, w, sequence(p, g / p.heads_kv), g % p.heads_kv, task % packs, per_pack);
      };
    });
    return;
  }
  // Share a (sequence, kv head)'s query tiles among as many tasks as it takes to give every
  // thread work; each share interleaves the tiles (s, s + shares, ...) so that causal work,
  // which grows with the tile index, spreads evenly.
  const int64_t shares = std::clamp<int64_t>((2 * threads + n_groups - 1) / n_groups, 1, n_tiles);
  run_tasks(n_groups * shares, [&] {
    return [&p, w = FwdScratch<A>(p, true), shares, n_tiles](int64_t task) mutable {
      const int64_t g = task / shares, share = task % shares;
      const Seq sq = sequence(p, g / p.heads_kv);
      const int64_t hk = g % p.heads_kv;
      if (sq.len_q <= kDecodeRows) {  // (a short sequence of a varlen call: its rows as in a call of its own)
        const int64_t per_pack = std::max<int64_t>(kDecodeRows / std::max<int64_t>(sq.len_q, 1), 1);
        for (int64_t pack = share; pack * per_pack < p.group(); pack += shares)
          fwd_rows_pack<A>(p, w, sq, hk, pack, per_pack);
        return;
      }
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
