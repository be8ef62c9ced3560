// Division by a divisor fixed for a whole launch, as one multiply-high, an add and a shift: the host computes
// the magic number once, and a kernel's prologue divides without nvcc's 32-bit division sequence (~15
// dependent instructions and a reciprocal each), whose latency sits on the path to a short kernel's first copy.
// q = (umulhi(n, m) + n) >> l with l = ceil(log2 d), m = floor(2^32 (2^l - d) / d) + 1: exact for every
// n < 2^31 (the 33-bit magic number 2^32 + m of Granlund and Montgomery, its top bit added as n).
#pragma once
#include <cstdint>

#include "../../common/hd.h"

namespace flashattn::cuda {

struct FastDivisor {
  uint32_t d = 1, m = 1, l = 0;  // (d = 1: umulhi(n, 1) = 0, the quotient n itself)

  FastDivisor() = default;
  // d >= 1.
  explicit FastDivisor(uint32_t divisor) : d(divisor) {
    while ((uint64_t(1) << l) < d) ++l;
    m = uint32_t((uint64_t(1) << 32) * ((uint64_t(1) << l) - d) / d + 1);
  }
  // n / d and n % d for 0 <= n < 2^31.
  FLASHATTN_HD uint32_t div(uint32_t n) const {
#ifdef __CUDA_ARCH__
    return (__umulhi(n, m) + n) >> l;
#else
    return uint32_t(((uint64_t(n) * m >> 32) + n) >> l);
#endif
  }
  FLASHATTN_HD uint32_t mod(uint32_t n) const { return n - div(n) * d; }
};

}  // namespace flashattn::cuda
