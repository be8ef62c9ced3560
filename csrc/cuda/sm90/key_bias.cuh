// A key-vector bias in the Hopper kernels (FwdParams::key_vector_bias: SDPA's key padding mask, one
// value per key of a batch, broadcast over the query heads and rows): the value each key adds to its
// scores, read from global memory (with_key_reader), and its terms in the forward's scores of a key tile
// (KeyTileTerms) and in the backward's exponents of a lane's two keys (KeyPairTerms); NoKeyTerms for the
// plain forward kernels. The terms are added as the sm80/ kernels add a bias: the value times log2(e), onto the
// scaled score before the masks (params.h's order), so the paths agree to fp32 rounding.
#pragma once
#include <cstdint>
#include <cstring>

#include "../../common/sequence.h"
#include "../../params.h"
#include "../common/features.cuh"
#include "../common/numeric.cuh"
#include "../common/online_softmax.cuh"
#include "tile_config.h"

namespace flashattn::cuda::sm90 {

// Calls f with a function (keys, key) of a sequence's key vector (keys: its key 0, bias_element) and a
// key index that returns the key's value in the scores' natural-log domain (a float bias's value, 0 or
// -inf for a bool mask), and 0 past the sequence's keys (whose scores the kernels mask: nothing is read
// there). One dispatch on the bias's dtype around f, so that f's loads carry no branch between them.
template <class Elem, class F>
__device__ __forceinline__ void with_key_reader(const FwdParams& p, F&& f) {
  with_bias_reader<Elem>(p.bias_kind, p.bias_dtype, [&](auto reader) {
    using R = decltype(reader);
    if constexpr (R::kBytes > 0)
      f([&](const unsigned char* keys, int64_t key) {
        return key < p.len_k ? reader.template value<float>(keys + key * p.bias_stride[3] * R::kBytes) : 0.f;
      });
  });
}

// No key-vector bias: the plain kernels' scores (the forward's tiles, the backward's exponents).
struct NoKeyTerms {
  template <int kNA>
  __device__ __forceinline__ void add(float (&)[kNA][4], int) const {}
  __device__ __forceinline__ float of(float x, int /*j*/, int /*c*/, int /*r*/) const { return x; }
};

// The key-vector bias of one key tile (its values in smem, one fp32 per key) added to the scores of a
// wgmma accumulator whose columns are the tile's keys (lane t = lane % 4 holds columns 8 j + 2 t, + 1).
struct KeyTileTerms {
  const float* values;
  template <int kNA>
  __device__ __forceinline__ void add(float (&s)[kNA][4], int t) const {
#pragma unroll
    for (int j = 0; j < kNA; ++j) {
      const float2 v = *reinterpret_cast<const float2*>(values + 8 * j + 2 * t);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        s[j][2 * r] += ExpDomain<float>::score_scale(1.0) * v.x;
        s[j][2 * r + 1] += ExpDomain<float>::score_scale(1.0) * v.y;
      }
    }
  }
};

// The key-vector bias of a backward lane's two keys (a block's key tile is fixed: read once), added to
// the exponent of P^T as the sm80/ backward adds a bias (after the LSE's subtraction).
struct KeyPairTerms {
  float values[2];  // keys key0 and key0 + 8
  __device__ __forceinline__ float of(float x, int /*j*/, int /*c*/, int r) const {
    return x + ExpDomain<float>::score_scale(1.0) * values[r];
  }
};

// The terms of keys `key` and key + 8 of sequence sq in the backward kernel of bias form kBias: none in the bias
// rows' kernel; in the other their key-vector bias, zeros without one (read at run time: one kernel serves
// plain calls and key vectors, at one add per exponent for plain calls).
template <class Elem, BiasForm kBias>
__device__ __forceinline__ auto key_pair_terms(const FwdParams& p, const Seq& sq, int64_t key) {
  if constexpr (kBias == BiasForm::kRows) {
    return NoKeyTerms{};
  } else {
    KeyPairTerms terms{};
    if (p.bias_kind != BiasKind::kNone) {  // (a key vector: the launcher sends bias rows to the kRows kernel)
      const unsigned char* const keys = bias_element(p, sq, 0, 0, 0);
      with_key_reader<Elem>(p, [&](auto key_value) {
        terms.values[0] = key_value(keys, key);
        terms.values[1] = key_value(keys, key + 8);
      });
    }
    return terms;
  }
}

// ---- Bias rows (BiasForm::kRows).

// The forward: a consumer's half of a key tile's bias tile in smem (64 query rows x kBN keys, copied by
// the producer's TMA, fwd_ws_sm90.cuh): panels of kPanel-byte lines (encode_row_bias_map's boxes), each
// line's 16-byte chunks swizzled by its row as TMA writes them (chunk ^= row % 8 for 128-byte lines,
// (row / 2) % 4 for 64-byte ones). The offset of (row, key) for values of kBytes bytes.
template <int kBytes, int kBN>
__device__ __forceinline__ int row_tile_offset(int row, int key) {
  constexpr int kPanel = kBN * kBytes < 128 ? kBN * kBytes : 128, kMask = kPanel / 16 - 1;
  const int byte = key * kBytes, at = row * kPanel + byte % kPanel;
  return byte / kPanel * (64 * kPanel) + (at ^ (((at >> 7) & kMask) << 4));
}

// The terms of the bias rows of one key tile (its consumer's half in smem, `half`; the lane's rows row0 and
// row0 + 8 of the half) added to the scaled scores of a wgmma accumulator whose columns are the tile's
// keys (lane t = lane % 4 holds keys 8 j + 2 t, + 1), as KeyTileTerms adds a key vector's. One aligned 4-byte
// read a row and pair, for bools and 16-bit floats alike (bools: its half that holds the pair), and the
// values selected by dtype: a branch on it around the loads took registers (ptxas at dim 128: 268 B of
// spill stores against 136 B).
template <class Elem>
struct RowTileTerms {
  const unsigned char* half;
  int row0;
  bool bools;
  template <int kNA>
  __device__ __forceinline__ void add(float (&s)[kNA][4], int t) const {
    constexpr int kBN = kNA * 8;
    const float log2e = ExpDomain<float>::score_scale(1.0);
#pragma unroll
    for (int j = 0; j < kNA; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + 8 * r, key = 8 * j + 2 * t;
        const int at = bools ? row_tile_offset<1, kBN>(row, key) : row_tile_offset<2, kBN>(row, key);
        const uint32_t word = *reinterpret_cast<const uint32_t*>(half + (at & ~3));
        const uint32_t two = word >> (8 * (at & 2));  // (bools: the pair's two bytes at the bottom)
        const unsigned short lo = static_cast<unsigned short>(word), hi = static_cast<unsigned short>(word >> 16);
        Elem x, y;
        memcpy(&x, &lo, 2);
        memcpy(&y, &hi, 2);
        const float mask_x = two & 0xffu ? 0.f : neg_inf<float>(), mask_y = two & 0xff00u ? 0.f : neg_inf<float>();
        s[j][2 * r] += bools ? mask_x : log2e * to_acc(x);
        s[j][2 * r + 1] += bools ? mask_y : log2e * to_acc(y);
      }
  }
};

// The backward: global loads guarded by a predicate, with no branch around them (an if around each load
// became a branch per load): x keeps its value where `on` is false. The bias is read-only while the
// kernels run (.nc).
#define FLASHATTN_LOAD_IF(name, type)                                                                  \
  __device__ __forceinline__ void name(uint32_t& x, const void* at, bool on) {                         \
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p ld.global.nc." type " %0, [%1];\n}\n" \
                 : "+r"(x)                                                                             \
                 : "l"(at), "r"(int(on)));                                                             \
  }
FLASHATTN_LOAD_IF(load_u8_if, "u8")
FLASHATTN_LOAD_IF(load_u16_if, "u16")
FLASHATTN_LOAD_IF(load_u32_if, "u32")
#undef FLASHATTN_LOAD_IF

// The value of a word holding one bias element (reader R: a bool in its low byte, a 16-bit float in its
// low half, a float32) in the scores' natural-log domain; a word not read holds the one that adds 0.
template <class R>
__device__ __forceinline__ uint32_t neutral_bias_word() {
  return R::kBytes == 1 ? 1u : 0u;
}
template <class R, class Elem>
__device__ __forceinline__ float bias_word_value(uint32_t w) {
  if constexpr (R::kBytes == 1) {
    return w & 0xffu ? 0.f : neg_inf<float>();
  } else if constexpr (R::kBytes == 2) {
    const unsigned short bits = static_cast<unsigned short>(w);
    Elem x;
    memcpy(&x, &bits, 2);
    return to_acc(x);
  } else {
    return __uint_as_float(w);
  }
}

// The backward's bias values of a consumer lane's fragment of S^T for one query tile: keys key0 and
// key0 + 8 (r) against query rows m0 + 8 j + 2 t + c of head h, one load each (the lane's keys are 8
// apart, its rows 1 apart: no two of its values are adjacent in memory), issued before the S^T product's
// wait so that their latency hides behind it; (key, row) pairs that `read` rejects (not visible, or past
// the sequence) are not read.
template <int kRA>
struct QueryTileWords {
  uint32_t w[kRA][2][2];  // [j][c][r]
  template <class Elem, class Read>
  __device__ __forceinline__ void load(const FwdParams& p, const Seq& sq, int64_t h, int64_t m0, int64_t key0, int t,
                                       const Read& read) {
    with_bias_reader<Elem>(p.bias_kind, p.bias_dtype, [&](auto reader) {
      using R = decltype(reader);
      if constexpr (R::kBytes > 0) {
        const unsigned char* const at = bias_element(p, sq, h, m0, key0);
        const int64_t row_bytes = p.bias_stride[2] * R::kBytes, key_bytes = 8 * p.bias_stride[3] * R::kBytes;
#pragma unroll
        for (int j = 0; j < kRA; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int row = 8 * j + 2 * t + c;
              const unsigned char* const e = at + row * row_bytes + r * key_bytes;
              uint32_t x = neutral_bias_word<R>();
              if constexpr (R::kBytes == 1) load_u8_if(x, e, read(r, row));
              else if constexpr (R::kBytes == 2) load_u16_if(x, e, read(r, row));
              else load_u32_if(x, e, read(r, row));
              w[j][c][r] = x;
            }
      }
    });
  }
};

// The terms of QueryTileWords in bias dtype R (after the product's wait), added to the exponent of P^T as
// KeyPairTerms's are.
template <class Elem, class R, int kRA>
struct QueryTileTerms {
  const QueryTileWords<kRA>& words;
  __device__ __forceinline__ float of(float x, int j, int c, int r) const {
    return x + ExpDomain<float>::score_scale(1.0) * bias_word_value<R, Elem>(words.w[j][c][r]);
  }
};

// Calls f with the terms of a query tile's words in the bias's dtype (one branch, uniform per call).
template <class Elem, int kRA, class F>
__device__ __forceinline__ void with_query_tile_terms(const FwdParams& p, const QueryTileWords<kRA>& words, F&& f) {
  with_bias_reader<Elem>(p.bias_kind, p.bias_dtype, [&](auto reader) {
    using R = decltype(reader);
    if constexpr (R::kBytes > 0) f(QueryTileTerms<Elem, R, kRA>{words});
  });
}

}  // namespace flashattn::cuda::sm90
