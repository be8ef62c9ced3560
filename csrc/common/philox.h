// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011):
// a counter-based generator, four 32-bit random words from a 128-bit counter and a 64-bit key
// with no state, so any element's random bits can be recomputed anywhere (the backward
// regenerates the forward's dropout mask) and on any backend.
#pragma once
#include <cstdint>

#include "hd.h"

namespace flashattn {

struct Philox4 {
  uint32_t x[4];
};

FLASHATTN_HD Philox4 philox4x32_10(Philox4 ctr, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(kMul0) * ctr.x[0];
    const uint64_t p1 = uint64_t(kMul1) * ctr.x[2];
    ctr = Philox4{{uint32_t(p1 >> 32) ^ ctr.x[1] ^ key0, uint32_t(p1), uint32_t(p0 >> 32) ^ ctr.x[3] ^ key1,
                   uint32_t(p0)}};
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return ctr;
}

}  // namespace flashattn
