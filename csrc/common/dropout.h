// The dropout keep mask: score (b, h, i, j) of a call is kept iff its 32 random bits are at
// least `threshold`. The bits are word j % 4 of Philox-4x32-10 with key = seed and counter =
// (j / 4, i, b * heads_q + h, offset): positions are those within the sequence (varlen
// included), so the mask depends on nothing but the call's seed, offset and shape, and one
// Philox call serves four neighbouring columns.
#pragma once
#include <cstdint>

#include "hd.h"
#include "philox.h"

namespace flashattn {

// Keep iff bits >= threshold: probability (2^32 - threshold) / 2^32 = 1 - p up to 2^-32.
FLASHATTN_HD uint32_t dropout_threshold(double p) { return uint32_t(p * 4294967296.0); }

// Random words of columns 4 * col_group .. 4 * col_group + 3 of row `row` of head `bh`
// (b * heads_q + h).
FLASHATTN_HD Philox4 dropout_bits(uint64_t seed, uint32_t offset, int64_t bh, int64_t row, int64_t col_group) {
  return philox4x32_10(Philox4{{uint32_t(col_group), uint32_t(row), uint32_t(bh), offset}}, uint32_t(seed),
                       uint32_t(seed >> 32));
}

}  // namespace flashattn
