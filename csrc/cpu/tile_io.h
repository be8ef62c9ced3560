// Moving rows of one (batch, head) matrix between the caller's tensors (any dtype, any row
// stride) and dense compute-type tiles. The dtype switch runs once per tile, not per element.
#pragma once
#include <cstdint>
#include <type_traits>
#include <utility>

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include "../params.h"
#include "vec.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace flashattn::cpu::FLASHATTN_CPU_ISA {

using bf16_t = torch::headeronly::BFloat16;
using fp16_t = torch::headeronly::Half;

template <class F>
inline void with_type(DType t, F&& f) {
  switch (t) {
    case DType::kFloat64: f(static_cast<const double*>(nullptr)); break;
    case DType::kFloat32: f(static_cast<const float*>(nullptr)); break;
    case DType::kBFloat16: f(static_cast<const bf16_t*>(nullptr)); break;
    case DType::kFloat16: f(static_cast<const fp16_t*>(nullptr)); break;
  }
}

// Address of element (b, h, row, 0) of a strided tensor.
inline const char* row_ptr(const void* base, const Strides& s, DType t, int64_t b, int64_t h, int64_t row) {
  return static_cast<const char*>(base) + (b * s.batch + h * s.head + row * s.row) * int64_t(dtype_size(t));
}
inline char* row_ptr(void* base, const Strides& s, DType t, int64_t b, int64_t h, int64_t row) {
  return const_cast<char*>(row_ptr(static_cast<const void*>(base), s, t, b, h, row));
}

// Whether fp16 rows widen in vector loads: F16C's / AVX-512's vcvtph2ps (the vector extension's conversion goes a
// lane at a time).
#if (FLASHATTN_VEC_BYTES == 64 && defined(__AVX512F__)) || (FLASHATTN_VEC_BYTES == 32 && defined(__F16C__))
constexpr bool kWidensFp16 = true;
#else
constexpr bool kWidensFp16 = false;
#endif

// The vector of the W / 2 lanes `lo` and W / 2 zeros above them: a half-width load widened by a shuffle (a memcpy
// into a zeroed vector, a wide load after a narrow store, stalled: E = 40 decode 1.2x the copied tiles' time; it
// stays for compilers without the shuffle builtin, GCC before 12, with the same values).
template <class Half, size_t... I>
inline auto with_zero_half(Half lo, std::index_sequence<I...>) {
  typedef std::remove_reference_t<decltype(lo[0])> Elem;
  typedef Elem Whole __attribute__((vector_size(2 * sizeof(Half))));
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
  const Whole v = __builtin_shufflevector(lo, Half{}, int(I)...);
#else
  Whole v{};
  std::memcpy(&v, &lo, sizeof(lo));
#endif
  return v;
}

// A vector of the compute type A from a row of the cache's type T: as it is, or bf16 / fp16 widened to float (exact;
// bf16's bits are the float's upper half). kHalf: only W / 2 elements from p, the upper lanes zero (a row's last
// half vector, read where it lies without reading past it).
template <class A, bool kHalf = false, class T>
inline vec_t<A> vload_from(const T* p) {
  constexpr int W = Vec<A>::width;
  const auto widened = [](auto loaded) {
    vec_t<A> v;
    if constexpr (kHalf) {
      const auto whole = with_zero_half(loaded, std::make_index_sequence<W>{});
      std::memcpy(&v, &whole, sizeof(v));
    } else {
      std::memcpy(&v, &loaded, sizeof(v));
    }
    return v;
  };
  if constexpr (std::is_same_v<T, A> && !kHalf) {
    return vload(p);
  } else if constexpr (std::is_same_v<T, A>) {
    typedef A Half __attribute__((vector_size(kVecBytes / 2)));  // (vector sizes that depend on kHalf are ignored)
    Half lo;
    std::memcpy(&lo, p, sizeof(lo));
    return widened(lo);
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    static_assert(std::is_same_v<A, float>, "bf16 rows widen to float only");
    typedef uint16_t Halves __attribute__((vector_size(kVecBytes / 2)));
    typedef uint16_t Quarters __attribute__((vector_size(kVecBytes / 4)));
    typedef uint32_t Bits __attribute__((vector_size(kVecBytes)));
    typedef uint32_t HalfBits __attribute__((vector_size(kVecBytes / 2)));
    std::conditional_t<kHalf, Quarters, Halves> h;
    using Widened = std::conditional_t<kHalf, HalfBits, Bits>;
    std::memcpy(&h, p, sizeof(h));
    return widened(Widened(__builtin_convertvector(h, Widened) << 16));
  } else {
    static_assert(std::is_same_v<A, float> && std::is_same_v<T, fp16_t> && kWidensFp16,
                  "fp16 rows widen to float only, with F16C or AVX-512");
    vec_t<float> v;
#if FLASHATTN_VEC_BYTES == 64 && defined(__AVX512F__)
    // (maskz: the unmasked form warns in GCC 12)
    const __m512 x = kHalf ? _mm512_maskz_cvtph_ps(__mmask16(0x00ff), _mm256_zextsi128_si256(_mm_loadu_si128(
                                 reinterpret_cast<const __m128i*>(p))))
                           : _mm512_maskz_cvtph_ps(__mmask16(0xffff), _mm256_loadu_si256(
                                 reinterpret_cast<const __m256i*>(p)));
    std::memcpy(&v, &x, sizeof(v));
#elif FLASHATTN_VEC_BYTES == 32 && defined(__F16C__)
    const __m256 x = _mm256_cvtph_ps(kHalf ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))
                                           : _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    std::memcpy(&v, &x, sizeof(v));
#endif
    return v;
  }
}

// Whether rows of T load as vectors of A (vload_from): T is A, or bf16 / fp16 (with kWidensFp16) widened to float.
template <class A, class T>
constexpr bool kLoadsAs =
    std::is_same_v<T, A> ||
    (std::is_same_v<A, float> && (std::is_same_v<T, bf16_t> || (std::is_same_v<T, fp16_t> && kWidensFp16)));

// Whether this build loads a row's first n < W elements alone (vload_first): AVX-512's masked loads, which read
// nothing past them. Then rows of any length are read where they lie; else rows end in whole or half vectors.
#if FLASHATTN_VEC_BYTES == 64 && defined(__AVX512F__)
constexpr bool kMaskedLoads = true;
#else
constexpr bool kMaskedLoads = false;
#endif

// The vector of a row's elements p[0 .. n) of the cache's type T as A (widened as vload_from does), zeros above;
// n >= W: a whole vector. (kMaskedLoads builds only.)
template <class A, class T>
inline vec_t<A> vload_first(const T* p, int64_t n) {
  constexpr int W = Vec<A>::width;
  if (n >= W) return vload_from<A>(p);
  vec_t<A> v{};
#if FLASHATTN_VEC_BYTES == 64 && defined(__AVX512F__)
  const uint32_t mask = n > 0 ? (1u << n) - 1u : 0u;
  if constexpr (std::is_same_v<T, float> && std::is_same_v<A, float>) {
    const __m512 x = _mm512_maskz_loadu_ps(__mmask16(mask), p);
    std::memcpy(&v, &x, sizeof(v));
  } else if constexpr (std::is_same_v<T, double>) {
    const __m512d x = _mm512_maskz_loadu_pd(__mmask8(mask), p);
    std::memcpy(&v, &x, sizeof(v));
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    const __m512i x = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(__mmask16(mask), p)), 16);
    std::memcpy(&v, &x, sizeof(v));
  } else {
    static_assert(std::is_same_v<T, fp16_t>, "rows of float, double, bf16 or fp16");
    const __m512 x = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(__mmask16(mask), p));
    std::memcpy(&v, &x, sizeof(v));
  }
#else
  static_assert(kMaskedLoads || sizeof(T) == 0, "masked loads need AVX-512");
#endif
  return v;
}

// A row's vector at p (kHalf: its last half vector) where n of its elements remain: as it is, or kMasked, its
// first n elements alone (vload_first).
template <class A, bool kMasked, bool kHalf = false, class T>
inline vec_t<A> vload_row(const T* p, [[maybe_unused]] int64_t n) {
  if constexpr (kMasked)
    return vload_first<A>(p, n);
  else
    return vload_from<A, kHalf>(p);
}

// dst[r][c] = mult * src[r][c] for r < rows, c < cols; dst[r][cols..padded_cols) = 0. Whole vectors through
// vload_from where T loads as A (torch's fp16 conversion is a scalar routine), the rest element by element; the
// same values either way.
template <class A>
void load_rows(DType t, const char* src, int64_t row_stride, int64_t rows, int64_t cols, A mult, A* dst,
               int64_t ld, int64_t padded_cols) {
  with_type(t, [&](auto type_tag) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(type_tag)>>;
    constexpr int64_t W = Vec<A>::width;
    const int64_t stride_bytes = row_stride * int64_t(sizeof(T)), whole = kLoadsAs<A, T> ? cols / W * W : 0;
    for (int64_t r = 0; r < rows; ++r) {
      const T* s = reinterpret_cast<const T*>(src + r * stride_bytes);
      A* d = dst + r * ld;
      if constexpr (kLoadsAs<A, T>) {
        for (int64_t c = 0; c < whole; c += W) vstore(d + c, vload_from<A>(s + c) * mult);
      }
      for (int64_t c = whole; c < cols; ++c) d[c] = mult * static_cast<A>(s[c]);
      for (int64_t c = cols; c < padded_cols; ++c) d[c] = A(0);
    }
  });
}

// dst[c][r] = src[r][c] for r < rows, c < cols; dst[c][rows..padded_rows) = 0 (widened as load_rows does).
template <class A>
void load_rows_transposed(DType t, const char* src, int64_t row_stride, int64_t rows, int64_t cols, A* dst,
                          int64_t ld, int64_t padded_rows) {
  with_type(t, [&](auto type_tag) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(type_tag)>>;
    constexpr int64_t W = Vec<A>::width;
    const int64_t stride_bytes = row_stride * int64_t(sizeof(T)), whole = kLoadsAs<A, T> ? cols / W * W : 0;
    for (int64_t r = 0; r < rows; ++r) {
      const T* s = reinterpret_cast<const T*>(src + r * stride_bytes);
      if constexpr (kLoadsAs<A, T>) {
        for (int64_t c = 0; c < whole; c += W) {
          A lanes[W];
          vstore(lanes, vload_from<A>(s + c));
          for (int64_t i = 0; i < W; ++i) dst[(c + i) * ld + r] = lanes[i];
        }
      }
      for (int64_t c = whole; c < cols; ++c) dst[c * ld + r] = static_cast<A>(s[c]);
    }
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t r = rows; r < padded_rows; ++r) dst[c * ld + r] = A(0);
  });
}

// dst[r][c] = mult * src[r][c] converted to the tensor's dtype, for r < rows, c < cols.
template <class A>
void store_rows(DType t, char* dst, int64_t row_stride, int64_t rows, int64_t cols, A mult, const A* src,
                int64_t ld) {
  with_type(t, [&](auto type_tag) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(type_tag)>>;
    const int64_t stride_bytes = row_stride * int64_t(sizeof(T));
    for (int64_t r = 0; r < rows; ++r) {
      T* d = reinterpret_cast<T*>(dst + r * stride_bytes);
      const A* s = src + r * ld;
      for (int64_t c = 0; c < cols; ++c) d[c] = static_cast<T>(mult * s[c]);
    }
  });
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
