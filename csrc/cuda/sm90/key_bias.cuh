// A key-vector bias in the Hopper kernels (FwdParams::key_vector_bias: SDPA's key padding mask, one
// value per key of a batch, broadcast over the query heads and rows): the value each key adds to its
// scores, read from global memory (with_key_reader), and its terms in the forward's scores of a key tile
// (KeyTileTerms) and in the backward's exponents of a lane's two keys (KeyPairTerms); NoKeyTerms for the
// plain kernels. The terms are added as the sm80/ kernels add a bias: the value times log2(e), onto the
// scaled score before the masks (params.h's order), so the paths agree to fp32 rounding.
#pragma once
#include <cstdint>

#include "../../common/sequence.h"
#include "../../params.h"
#include "../common/features.cuh"
#include "../common/online_softmax.cuh"

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
  __device__ __forceinline__ float of(float x, int) const { return x; }
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
  __device__ __forceinline__ float of(float x, int r) const {
    return x + ExpDomain<float>::score_scale(1.0) * values[r];
  }
};

// The terms of keys `key` and key + 8 of sequence sq: KeyPairTerms with a key-vector bias, else none.
template <class Elem, bool kKeyBias>
__device__ __forceinline__ auto key_pair_terms(const FwdParams& p, const Seq& sq, int64_t key) {
  if constexpr (kKeyBias) {
    KeyPairTerms terms{};
    const unsigned char* const keys = bias_element(p, sq, 0, 0, 0);
    with_key_reader<Elem>(p, [&](auto key_value) {
      terms.values[0] = key_value(keys, key);
      terms.values[1] = key_value(keys, key + 8);
    });
    return terms;
  } else {
    return NoKeyTerms{};
  }
}

}  // namespace flashattn::cuda::sm90
