// bf16 products on AVX512_BF16's dot-product instruction (vdpbf16ps: 32 bf16 products summed into 16 floats, twice
// the multiply-adds of an fp32 FMA), for the prefill forward (fwd.h) and the backward (bwd.h) of bf16 calls where the
// CPU has it. Operands
// are pair words: two bf16 values adjacent along the product's K dimension in one 32-bit word, the lower half the
// even index. Built in the AVX-512 kernels only (the functions carry the instruction set themselves, so that no
// other code of that build may use it); kBf16DotBuilt says whether this build has them.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "gemm.h"

// (the intrinsics came with GCC 10 and Clang 9; older compilers build the fp32 products only)
#if FLASHATTN_VEC_BYTES == 64 && defined(__AVX512F__) && \
    ((defined(__clang__) && __clang_major__ >= 11) || (!defined(__clang__) && __GNUC__ >= 10))
#include <immintrin.h>
#define FLASHATTN_BF16_DOT 1
#define FLASHATTN_BF16_DOT_TARGET __attribute__((target("avx512bf16,avx512f,avx512vl,avx512bw,avx512dq")))
#endif

namespace flashattn::cpu::FLASHATTN_CPU_ISA {

// The operands' layouts (plain code, any build): bf16 rows read as 16-bit words and as pair words.
typedef uint16_t bf16_bits __attribute__((may_alias));
typedef uint32_t bf16_pair __attribute__((may_alias));

// The addresses of `count` rows from `first`, stride_bytes apart.
inline void strided_rows(const char* first, int64_t stride_bytes, int64_t count, const char** rows) {
  for (int64_t i = 0; i < count; ++i) rows[i] = first + i * stride_bytes;
}

// Rows' pair words transposed: tile[i][c] = pair word i of rows[c] (tile rows ld apart), i < pairs, c < count.
inline void put_pairs_transposed(const char* const* rows, int64_t count, int64_t pairs, uint32_t* tile, int64_t ld) {
  for (int64_t c = 0; c < count; ++c) {
    const bf16_pair* words = reinterpret_cast<const bf16_pair*>(rows[c]);
    for (int64_t i = 0; i < pairs; ++i) tile[i * ld + c] = words[i];
  }
}

// Rows 2j and 2j + 1 of `count` bf16 rows interleaved as pair words: tile[j][e] (rows ld apart) for e < len, zeros
// to ld; a last odd row paired with zeros.
inline void put_row_pairs(const char* const* rows, int64_t count, int64_t len, uint32_t* tile, int64_t ld) {
  for (int64_t j = 0; 2 * j < count; ++j) {
    const bf16_bits* lo = reinterpret_cast<const bf16_bits*>(rows[2 * j]);
    uint32_t* out = tile + j * ld;
    if (2 * j + 1 < count) {
      const bf16_bits* hi = reinterpret_cast<const bf16_bits*>(rows[2 * j + 1]);
      for (int64_t e = 0; e < len; ++e) out[e] = uint32_t(lo[e]) | uint32_t(hi[e]) << 16;
    } else {
      for (int64_t e = 0; e < len; ++e) out[e] = uint32_t(lo[e]);
    }
    for (int64_t e = len; e < ld; ++e) out[e] = 0;
  }
}

// A float rounded to bf16 (to nearest even; NaN stays NaN), as its 16 bits.
inline uint32_t bf16_round_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return ((b & 0x7fffffffu) > 0x7f800000u ? b | 0x00400000u : b + 0x7fffu + (b >> 16 & 1u)) >> 16;
}

// Float rows rounded to bf16 and interleaved as put_row_pairs does (P and dS as the B operand of dV and dK): out[j][c] for c < cols (rows ld_out apart) from
// src rows 2j and 2j + 1 (ld_src apart), j < ceil(rows / 2).
inline void put_rounded_row_pairs(const float* src, int64_t ld_src, int64_t rows, int64_t cols, uint32_t* out,
                                  int64_t ld_out) {
  for (int64_t j = 0; 2 * j < rows; ++j) {
    const float* lo = src + 2 * j * ld_src;
    const float* hi = 2 * j + 1 < rows ? lo + ld_src : nullptr;
    uint32_t* o = out + j * ld_out;
    if (hi != nullptr) {
      for (int64_t c = 0; c < cols; ++c) o[c] = bf16_round_bits(lo[c]) | bf16_round_bits(hi[c]) << 16;
    } else {
      for (int64_t c = 0; c < cols; ++c) o[c] = bf16_round_bits(lo[c]);
    }
  }
}

#ifdef FLASHATTN_BF16_DOT
constexpr bool kBf16DotBuilt = true;

// Whether this CPU runs vdpbf16ps (FLASHATTN_CPU_ISA=avx512 turns it off: the fp32 products on bf16 inputs).
inline bool cpu_has_bf16_dot() {
  static const bool yes = [] {
    const char* forced = std::getenv("FLASHATTN_CPU_ISA");
    return !(forced != nullptr && std::strcmp(forced, "avx512") == 0) && __builtin_cpu_supports("avx512bf16");
  }();
  return yes;
}

// kRows rows of C by two vectors of columns, as gemm.h's fp32 block; a[r * lda + k] (kTransA: a[k * lda + r]) and
// b[k * ldb + j] pair words.
template <int MR, bool kTransA>
FLASHATTN_BF16_DOT_TARGET inline void bf16_dot_block(int64_t K, const uint32_t* a, int64_t lda, const uint32_t* b,
                                                     int64_t ldb, float* c, int64_t ldc, float alpha, bool accumulate) {
  __m512 c0[MR], c1[MR];
  for (int r = 0; r < MR; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + k * ldb), b1 = (__m512bh)_mm512_loadu_si512(b + k * ldb + 16);
    for (int r = 0; r < MR; ++r) {
      const __m512bh ar = (__m512bh)_mm512_set1_epi32(int(kTransA ? a[k * lda + r] : a[r * lda + k]));
      c0[r] = _mm512_dpbf16_ps(c0[r], ar, b0);
      c1[r] = _mm512_dpbf16_ps(c1[r], ar, b1);
    }
  }
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    const __m512 s0 = _mm512_mul_ps(c0[r], scale), s1 = _mm512_mul_ps(c1[r], scale);
    _mm512_storeu_ps(cr, accumulate ? _mm512_add_ps(_mm512_loadu_ps(cr), s0) : s0);
    _mm512_storeu_ps(cr + 16, accumulate ? _mm512_add_ps(_mm512_loadu_ps(cr + 16), s1) : s1);
  }
}

template <int MR, bool kTransA>
FLASHATTN_BF16_DOT_TARGET inline void bf16_dot_rest(int rows, int64_t K, const uint32_t* a, int64_t lda,
                                                    const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
                                                    float alpha, bool accumulate) {
  if constexpr (MR > 1) {
    if (rows < MR) return bf16_dot_rest<MR - 1, kTransA>(rows, K, a, lda, b, ldb, c, ldc, alpha, accumulate);
  }
  bf16_dot_block<MR, kTransA>(K, a, lda, b, ldb, c, ldc, alpha, accumulate);
}

// C (M x N floats, ldc) = or += alpha A B over K pair words: A M x K (lda; kTransA: stored K x M), B K x N (ldb); N
// a multiple of 32 (kPanel).
template <bool kTransA = false>
FLASHATTN_BF16_DOT_TARGET inline void gemm_bf16_pairs(int64_t M, int64_t N, int64_t K, const uint32_t* a,
                                                      int64_t lda, const uint32_t* b, int64_t ldb, float* c,
                                                      int64_t ldc, float alpha, bool accumulate) {
  for (int64_t j = 0; j < N; j += 32) {
    int64_t i = 0;
    for (; i + kRows <= M; i += kRows)
      bf16_dot_block<kRows, kTransA>(K, kTransA ? a + i : a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, alpha,
                                     accumulate);
    if (i < M)
      bf16_dot_rest<kRows - 1, kTransA>(int(M - i), K, kTransA ? a + i : a + i * lda, lda, b + j, ldb,
                                        c + i * ldc + j, ldc, alpha, accumulate);
  }
}

// Float rows rounded to bf16 (to nearest even) in pair words along each row (P and dS as the A operand of P V and
// dS K): out[r][c / 2] from src[r][c], src[r][c + 1] (out rows ld_out words apart), r < rows, c < cols (a multiple of
// 16). (vcvtneps2bf16: the plain bf16_round_bits here cost the bf16 forward ~5%.)
FLASHATTN_BF16_DOT_TARGET inline void put_rounded_pairs(const float* src, int64_t ld_src, int64_t rows, int64_t cols,
                                                        uint32_t* out, int64_t ld_out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; c += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + r * ld_src + c));
      std::memcpy(out + r * ld_out + c / 2, &h, sizeof(h));
    }
}
#else
constexpr bool kBf16DotBuilt = false;
inline bool cpu_has_bf16_dot() { return false; }
// (declared for the callers' discarded `if constexpr (kBf16DotBuilt)` branches; never defined or called)
template <bool kTransA = false>
void gemm_bf16_pairs(int64_t M, int64_t N, int64_t K, const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
                     float* c, int64_t ldc, float alpha, bool accumulate);
void put_rounded_pairs(const float* src, int64_t ld_src, int64_t rows, int64_t cols, uint32_t* out, int64_t ld_out);
#endif

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
