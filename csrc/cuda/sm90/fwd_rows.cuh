// A warpgroup's 64 query rows in the wgmma forward (fwd_ws_sm90.cuh): their O
// accumulators and online-softmax state, and the steps of the key loop that it runs over
// them (S = Q K^T and O += P V as wgmma products, the softmax, P packed for P V, the output).
// Smem operands are in the panel layout of common/wgmma.cuh.
// The online softmax is the sm80 forward's (scores scaled before the max; exp2 on the MUFU; the
// row max and sum reduced over a quad), so the paths give the same answers to rounding.
#pragma once
#include <cstdint>
#include <type_traits>

#include "../../common/sequence.h"
#include "../../params.h"
#include "../common/band_mask.cuh"
#include "../common/fragments.cuh"
#include "../common/grid.cuh"
#include "../common/numeric.cuh"
#include "../common/online_softmax.cuh"
#include "../common/quad_transpose.cuh"
#include "../common/wgmma.cuh"
#include "../schedule/causal_order.cuh"
#include "key_bias.cuh"

namespace flashattn::cuda::sm90 {

// A consumer's compact view of its work item (FwdTile::keys), for the kernels whose consumers have
// few registers to spare: in 32 bits (the tensor maps limit batch, heads and sequences to 2^31), the
// first key tile and their count, the keys that the lane's two rows see (row r: lo[r] <= key <
// hi[r]) and those that every row of the block's tile sees (all_lo <= key < all_hi), and where the
// output goes (batch b, head h, rows m0 ... m0 + rows - 1).
struct FwdKeys {
  int n_begin, n_tiles;
  int lo[2], hi[2], all_lo, all_hi;
  int b, h, m0, rows;

  // The scores of the kBN-key tile at n0 outside each row's keys -> -inf (tiles every row of the
  // block sees in full are left as they are); t = lane % 4.
  template <int kBN, int kNA>
  __device__ __forceinline__ void mask(float (&s)[kNA][4], int /*row0*/, int n, int t) const {
    if (n >= all_lo && n + kBN <= all_hi) return;
    auto column = [](int x) { return x < 0 ? 0 : x > kBN ? kBN : x; };
#pragma unroll
    for (int r = 0; r < 2; ++r) mask_columns_by_bits<kBN>(s, r, column(lo[r] - n), column(hi[r] - n), t);
  }
};

// The block's query tile of kBM rows (the last tiles first; a causal grid's in FwdOrder's order,
// schedule/causal_order.cuh; paired walks where kPairs) and the key tiles of kBN keys that its rows see.
template <int kBM, int kBN, bool kPairs = false>
struct FwdTile {
  Seq sq;
  int64_t h, hk, m0, m_last, n_begin;
  int rows, n_tiles;

  // Work item `index` of the grid's order (blockIdx.x where a block takes one): the plain grid's block, tile
  // fastest (the heaviest first), then head, then batch, through the order's divisors.
  __device__ __forceinline__ FwdTile(const FwdParams& p, const FwdOrder& order, unsigned index = blockIdx.x) {
    const unsigned ordered = fwd_ordered_block<kPairs>(order, index);
    const unsigned pair = order.tiles.div(ordered), batch = order.heads.div(pair);
    const int tile = int(order.tiles.d - 1 - (ordered - pair * order.tiles.d));
    h = pair - batch * order.heads.d;
    hk = order.group.div(unsigned(h));
    sq = plain_sequence(p, batch);
    m0 = int64_t(tile) * kBM;
    rows = sq.q_tile_rows(m0, kBM);
    m_last = m0 + rows - 1;
    n_begin = sq.key_begin(m0) / kBN * kBN;
    const int64_t n_end = sq.key_end(m_last);
    n_tiles = n_end > n_begin ? int((n_end - n_begin + kBN - 1) / kBN) : 0;
  }
  // The scores of the key tile at n0 outside the rows' keys -> -inf, the lane's rows row0 and
  // row0 + 8 (tiles every row of the block sees in full are left as they are).
  template <int kBNT, int kNA>
  __device__ __forceinline__ void mask(float (&s)[kNA][4], int64_t row0, int64_t n0, int t) const {
    if (n0 >= sq.key_begin(m_last) && n0 + kBNT <= sq.key_end(m0)) return;
    // The row's key bounds as columns of the tile, in 32 bits after the band's clamp (the tensor maps keep
    // sequences below 2^31 keys): 64-bit clamps of both bounds minus n0 cost ~70 instructions a tile.
    auto column = [n = int(n0)](int64_t key) {
      const int x = int(key) - n;
      return x < 0 ? 0 : x > kBNT ? kBNT : x;
    };
#pragma unroll
    for (int r = 0; r < 2; ++r)
      mask_columns_by_bits<kBNT>(s, r, column(sq.key_begin(row0 + 8 * r)), column(sq.key_end(row0 + 8 * r)), t);
  }
  // The compact view of the item for the lane whose rows are row0 and row0 + 8.
  __device__ __forceinline__ FwdKeys keys(int64_t row0) const {
    FwdKeys k{int(n_begin), n_tiles, {}, {}, int(sq.key_begin(m_last)), int(sq.key_end(m0)), int(sq.tb), int(h), int(m0),
              rows};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      k.lo[r] = int(sq.key_begin(row0 + 8 * r));
      k.hi[r] = int(sq.key_end(row0 + 8 * r));
    }
    return k;
  }
};

// kBN keys per tile, kBM rows in the block's Q tile (the panels' line count). Float8 (e4m3) inputs:
// k32 products, the output in bf16, and V given as V^T (K-major, as 8-bit wgmma needs): kDim lines
// of the tile's keys, each 16 keys stored in the order of P's A fragments (pack_p), so that P needs no
// exchange between lanes.
template <class Elem, int kDim, int kBN, int kBM>
struct FwdRows {
  static constexpr bool kFp8 = sizeof(Elem) == 1;
  using Out = std::conditional_t<kFp8, __nv_bfloat16, Elem>;
  using M = Mma<Out>;
  using Exp = ExpDomain<float>;
  static constexpr int kNA = kBN / 8, kDA = kDim / 8;  // accumulator atoms of S and O per thread
  static constexpr int kKStep = 32 / int(sizeof(Elem));  // a product's k: 32 bytes of the operands' lines
  using Scores = float[kNA][4];
  using Probs = uint32_t[kBN / kKStep][4];  // P as the A fragments of P V
  // Float8: P is taken as 2^8 times the probabilities (up to 256), so that fewer of them fall among
  // e4m3's subnormals (below 2^-6) or to zero; O and the row sums scale alike, the LSE takes it out.
  static constexpr float kPLog2Offset = 8.f;

  float o[kDA][4];
  float row_max[2], row_sum[2];

  __device__ __forceinline__ FwdRows() {
    zero_output();
    row_max[0] = row_max[1] = neg_inf<float>();
    row_sum[0] = row_sum[1] = 0.f;
  }
  __device__ __forceinline__ void zero_output() {
#pragma unroll
    for (int d = 0; d < kDA; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[d][e] = 0.f;
  }
  // The row maxima and sums of two items at once (the forward carrying an item's last P V into the
  // next item's first S): these rows' statistics set aside into (mx, sum) and started afresh, swapped
  // with the aside ones, or taken back from them.
  __device__ __forceinline__ void set_aside_stats(float (&mx)[2], float (&sum)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = row_max[r], sum[r] = row_sum[r];
      row_max[r] = neg_inf<float>(), row_sum[r] = 0.f;
    }
  }
  __device__ __forceinline__ void swap_stats(float (&mx)[2], float (&sum)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m = row_max[r], l = row_sum[r];
      row_max[r] = mx[r], row_sum[r] = sum[r];
      mx[r] = m, sum[r] = l;
    }
  }
  __device__ __forceinline__ void take_stats(const float (&mx)[2], const float (&sum)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) row_max[r] = mx[r], row_sum[r] = sum[r];
  }

  // S = Q K^T of the warpgroup's Q rows (q_at) and a K tile (k_at), issued and committed; the caller waits.
  // (Q, K and float8's V^T are K-major: panel kk / 4 of a k step kk, 32 bytes along the line per step.)
  static __device__ __forceinline__ void issue_scores(Scores& s, uint32_t q_at, uint32_t k_at) {
    const uint64_t q = kmajor_desc(q_at), k = kmajor_desc(k_at);
    Wgmma<Elem, kBN>::template ss<0>(s, q, k);
#pragma unroll
    for (int kk = 1; kk < kDim / kKStep; ++kk)
      Wgmma<Elem, kBN>::template ss<1>(s, kmajor_step(q, kk, kBM), kmajor_step(k, kk, kBN));
    wgmma_commit();
  }
  // O += P V of a V tile (v_at; the MN-major B: a k16 step is 16 keys = 16 lines further, its
  // columns cross panels kBN lines apart), issued and committed.
  // Float8: V^T is K-major (panels of kDim 64-byte lines, 64 keys each), stepped along the line as K.
  __device__ __forceinline__ void issue_pv(const Probs& pa, uint32_t v_at) {
    if constexpr (kFp8) {
      const uint64_t v = kmajor64_desc(v_at);
#pragma unroll
      for (int kk = 0; kk < kBN / kKStep; ++kk) Wgmma<Elem, kDim>::rs(o, pa[kk], kmajor64_step(v, kk, kDim));
    } else {
      const uint64_t v = mnmajor_desc(v_at, kBN);
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) Wgmma<Elem, kDim>::rs(o, pa[kk], mnmajor_step(v, kk));
    }
    wgmma_commit();
  }

  // The online softmax of the key tile at n0, in place (scaled, the key-vector bias's terms added,
  // masked outside each row's band, exponentiated); returns through alpha the factor that rescales O.
  // `item` (FwdTile or FwdKeys) is the block's work item, the lane's rows row0 and row0 + 8; t = lane % 4.
  // The scale goes into each exponent's FFMA, 2^(s c - max), with the max of the raw scores times c (the same
  // value as the max of the scaled ones: rounding is monotonic for c > 0), where no bias adds terms to the scaled
  // scores and c > 0; else the scores are scaled first and c = 1. Besides one instruction per score, each
  // exponent is then rounded once, and a row's exponents share one error, the rounding of its max (up to 2^-24
  // of it), which O's normalization and the LSE take out. But a one-hot row's P = 2^error rounds to 1 in P V
  // and not in the row sum, so O = V / 2^error: where some row's |max| reaches 2^10 (an error of 2^-14, under
  // half an fp16 ulp) the warp scales the tile's scores first instead, as the bias form does.
  template <class Item, class Index, class KeyTerms = NoKeyTerms>
  __device__ __forceinline__ void softmax(Scores& s, const Item& item, Index row0, Index n0, int t, float score_scale,
                                          float (&alpha)[2], const KeyTerms& key_terms = {}) {
    auto scale_scores = [&](float c) {
#pragma unroll
      for (int j = 0; j < kNA; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] *= c;
    };
    float c = score_scale;
    if (!std::is_same_v<KeyTerms, NoKeyTerms> || !(c > 0.f)) {
      scale_scores(c);
      c = 1.f;
    }
    key_terms.add(s, t);
    item.template mask<kBN>(s, row0, n0, t);
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx[kNA];
#pragma unroll
      for (int j = 0; j < kNA; ++j) mx[j] = acc_max(s[j][2 * r], s[j][2 * r + 1]);
      const float tile_max =
          reduce_max_lanes<4>(tree_reduce(mx, [](float a, float b) { return acc_max(a, b); })) * c;
      const float new_max = acc_max(row_max[r], tile_max);
      alpha[r] = Exp::exp(row_max[r] - exp_base(new_max));
      row_max[r] = new_max;
      base[r] = exp_base(new_max);
    }
    if (c != 1.f && !__all_sync(0xffffffffu, fabsf(base[0]) < 1024.f && fabsf(base[1]) < 1024.f)) {
      scale_scores(c);
      c = 1.f;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float b = kFp8 ? base[r] - kPLog2Offset : base[r];
      float sums[kNA];
#pragma unroll
      for (int j = 0; j < kNA; ++j) {
        s[j][2 * r] = Exp::exp(fmaf(s[j][2 * r], c, -b));
        s[j][2 * r + 1] = Exp::exp(fmaf(s[j][2 * r + 1], c, -b));
        sums[j] = s[j][2 * r] + s[j][2 * r + 1];
      }
      row_sum[r] = row_sum[r] * alpha[r] + tree_reduce(sums, [](float a, float c) { return a + c; });
    }
  }
  // Float8: the A fragment's register holds k 4t .. 4t + 3 of a row (wgmma.cuh), the lane's scores
  // keys 2t, 2t + 1, 8 + 2t, 9 + 2t of each 16: so the register takes those four, and V^T stores key
  // 16 h + 2t + (i & 1) + 8 (i >> 1) at position 16 h + 4t + i (flashattn_ext/fp8.py writes it so).
  static __device__ __forceinline__ void pack_p(Scores& s, Probs& pa) {
    if constexpr (kFp8) {
      auto pack4 = [](float a, float b, float c, float d) {
        const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
        const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
        return lo | hi << 16;
      };
#pragma unroll
      for (int kk = 0; kk < kBN / kKStep; ++kk) {
        const int j = 4 * kk;
#pragma unroll
        for (int h = 0; h < 2; ++h)  // keys 16 h .. 16 h + 15 of the k32 step: registers 2h (row g), 2h + 1 (g + 8)
#pragma unroll
          for (int r = 0; r < 2; ++r)
            pa[kk][2 * h + r] = pack4(s[j + 2 * h][2 * r], s[j + 2 * h][2 * r + 1], s[j + 2 * h + 1][2 * r],
                                      s[j + 2 * h + 1][2 * r + 1]);
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
        typename M::A a;
        M::a_from_acc(a, &s[2 * kk]);
#pragma unroll
        for (int e = 0; e < 4; ++e) pa[kk][e] = a.r[e];
      }
    }
  }
  // O *= alpha, skipped by a warp whose rows all kept their max (alpha exactly 1: the result is the same
  // bit for bit), which late in a long row is most tiles: kDim / 2 multiplies per lane.
  __device__ __forceinline__ void rescale_o(const float (&alpha)[2]) {
    if (__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) return;
#pragma unroll
    for (int d = 0; d < kDA; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[d][e] *= alpha[e / 2];
  }

  // Each row's 1 / l (0 for a row that sees no key: out = 0) and LSE (-inf there; a NaN l propagates to both), the
  // two rows together and outside any lane-dependent branch, so that their shuffle, reciprocal and log chains
  // interleave. 1 / l from one MUFU.RCP (rcp.approx: about an ulp of fp32, far below Out's rounding): a row that sees a
  // key has l >= 1 (its max contributes 2^0), so the IEEE division's range checks and slow path buy nothing.
  struct RowEnds {
    float inv[2], lse[2];
  };
  __device__ __forceinline__ RowEnds row_ends() const {
    RowEnds e;
    float l[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = reduce_sum_lanes<4>(row_sum[r]);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const bool empty = l[r] == 0.f;
      float inv;
      asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(inv) : "f"(l[r]));
      e.inv[r] = empty ? 0.f : inv;
      const float max = kFp8 ? row_max[r] - kPLog2Offset : row_max[r];
      e.lse[r] = empty ? neg_inf<float>() : Exp::lse(max, l[r]);
    }
    return e;
  }

  // Where a block tile's output goes: its first row of out and of lse, and how many of its rows are
  // the sequence's (a few registers to keep while the next tile's rows are on the way).
  struct Dest {
    Out* out;
    float* lse;
    int rows;
  };
  template <class Tile>
  static __device__ __forceinline__ Dest dest(const FwdParams& p, const Tile& tile) {
    return {tile.sq.template q_rows<Out>(p.out, p.out_stride, tile.h, tile.m0),
            static_cast<float*>(p.lse) + tile.sq.row_index(p.heads_q, tile.h, tile.m0), tile.rows};
  }
  static __device__ __forceinline__ Dest dest(const FwdParams& p, const FwdKeys& k) {
    const Seq sq = plain_sequence(p, k.b);
    return {sq.template q_rows<Out>(p.out, p.out_stride, k.h, k.m0),
            static_cast<float*>(p.lse) + sq.row_index(p.heads_q, k.h, k.m0), k.rows};
  }

  // The output of the warp's 16 rows (from `wrow` in the block's tile) stored from the registers, and the row
  // LSE. For a kernel whose Q buffer may already hold the next item's rows (FwdWsConfig::kEarlyQRelease). A lane
  // holds two columns of each 8; the four lanes of a row swap them (transpose_quad_words) so that each lane stores
  // 16 contiguous bytes: one store writes 64 bytes of each of its 8 rows, a quarter of the store instructions and of
  // the memory requests of 4-byte stores.
  __device__ __forceinline__ void store_direct(const FwdParams& p, const Dest& dst, int wrow, int lane) {
    static_assert(!kFp8, "float8's output is staged in a buffer of its own");
    static_assert(kDA % 4 == 0, "columns in groups of 32");
    const int g = lane / 4, t = lane % 4;
    const RowEnds ends = row_ends();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float inv = ends.inv[r];
      const int row = wrow + g + 8 * r;
      Out* const out = dst.out + row * p.out_stride.row;
#pragma unroll
      for (int d0 = 0; d0 < kDA; d0 += 4) {
        // w[k]: this lane's columns 8 (d0 + k) + 2t, +1. After the transpose w[k] holds lane k's of group
        // d0 + t, i.e. columns 8 (d0 + t) + 2k, +1.
        uint32_t w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = M::pack(o[d0 + k][2 * r] * inv, o[d0 + k][2 * r + 1] * inv);
        transpose_quad_words(w, t);
        if (row < dst.rows) *reinterpret_cast<uint4*>(out + 8 * (d0 + t)) = make_uint4(w[0], w[1], w[2], w[3]);
      }
      if (t == 0 && row < dst.rows) dst.lse[row] = ends.lse[r];
    }
  }

  // The output of the warp's 16 rows (from `wrow` in the block's tile), staged through those rows of
  // the Q tile at sQ (the warpgroup's products are done with them) so that a lane stores 16-byte
  // chunks, a row's bytes by kDim / 8 lanes; and the row LSE. Float8: staged in the output's own buffer
  // (sQ), each value times out_scale (v_descale).
  __device__ __forceinline__ void store(unsigned char* sQ, const FwdParams& p, const Dest& dst, int wrow, int lane,
                                        float out_scale = 1.f) {
    const int g = lane / 4, t = lane % 4;
    // (panel_offset<kBM> written out: through the call ptxas formed the epilogue's addresses
    // differently, a form not yet run on the device)
    auto staged = [&](int row, int chunk) {
      return sQ + (chunk / 8) * (kBM * 128) + row * 128 + ((chunk % 8) ^ (row % 8)) * 16;
    };
    const RowEnds ends = row_ends();
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      inv[r] = kFp8 ? ends.inv[r] * out_scale : ends.inv[r];
      const int row = wrow + g + 8 * r;
      if (t == 0 && row < dst.rows) dst.lse[row] = ends.lse[r];
    }
    // Staged with stmatrix, four 8 x 8 atoms an instruction (rows g and g + 8 of chunks d and d + 1; an atom's lane
    // holds row g, columns 2t, 2t + 1, the accumulator's layout): a quarter of the store instructions of 4-byte
    // stores. Lane i gives the address of row i % 8 of atom i / 8.
    static_assert(kDA % 2 == 0, "chunks in pairs");
    const int atom_row = wrow + lane % 8 + 8 * (lane / 8 % 2), atom_chunk = lane / 16;
#pragma unroll
    for (int d = 0; d < kDA; d += 2) {
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int chunk = d + k / 2, r = k % 2;
        w[k] = M::pack(o[chunk][2 * r] * inv[r], o[chunk][2 * r + 1] * inv[r]);
      }
      stmatrix_x4(smem_addr(staged(atom_row, d + atom_chunk)), w);
    }
    __syncwarp();
    // (dim 96: 12 lanes a row, 2 rows a step, lanes 24-31 idle)
    constexpr int kLanesPerRow = kDim / 8, kRowsPerStep = 32 / kLanesPerRow;
    const int c = lane % kLanesPerRow;
#pragma unroll
    for (int i = 0; i < (16 + kRowsPerStep - 1) / kRowsPerStep; ++i) {
      const int row = wrow + i * kRowsPerStep + lane / kLanesPerRow;
      if (32 % kLanesPerRow != 0 && lane >= kRowsPerStep * kLanesPerRow) continue;
      const uint4 chunk = *reinterpret_cast<const uint4*>(staged(row, c));
      if (row < dst.rows) *reinterpret_cast<uint4*>(dst.out + row * p.out_stride.row + c * 8) = chunk;
    }
  }
};

}  // namespace flashattn::cuda::sm90
