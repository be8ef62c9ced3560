// Tile shapes of the SIMT kernels.
//
// A block of 4*kBlock threads is seen as kBlock/4 row groups of 16 lanes (one half-warp each):
// thread (r, c) = (tid / 16, tid % 16) owns rows r*4 .. r*4+3 of every output tile, the score
// columns c, c+16, c+32, ... and the output columns c*kVec .. c*kVec+kVec-1 of each column
// chunk of width 16*kVec. Row statistics therefore reduce over one half-warp with shuffles.
//
// Smem rows are padded by 16 bytes so that the 8 lanes of a quarter-warp reading 16 bytes
// each from 8 consecutive rows hit distinct banks.
#pragma once
#include "../common/numeric.cuh"

namespace flashattn::cuda::simt {

template <class Acc> struct SimtTile;
template <> struct SimtTile<float> {
  static constexpr int kBlock = 64;   // query rows and key rows per tile
  static constexpr int kChunkK = 64;  // head-dim chunk of the forward score product
  static constexpr int kVecMax = 4;
};
template <> struct SimtTile<double> {
  static constexpr int kBlock = 32;
  static constexpr int kChunkK = 16;  // (both directions)
  static constexpr int kVecMax = 2;
};

constexpr int cmin(int a, int b) { return a < b ? a : b; }
constexpr int cmax(int a, int b) { return a > b ? a : b; }

// kTier: output columns one block covers (the head dim is cut into ceil(E / kTier) slices).
// kVecCap: narrower output vectors, which shrink the output-column chunk held in smem.
template <class T, int kTier, int kVecCap = 4>
struct SimtTraits {
  using Acc = acc_t<T>;
  using Tile = SimtTile<Acc>;
  static constexpr int kBlock = Tile::kBlock;
  static constexpr int kThreads = 4 * kBlock;
  static constexpr int kTN = kBlock / 16;  // score columns per thread
  static constexpr int kPad = 16 / int(sizeof(Acc));
  static constexpr int kVec = cmin(cmin(Tile::kVecMax, kVecCap), kTier / 16);
  static constexpr int kChunkCols = 16 * kVec;  // output-column chunk
  static constexpr int kNumChunks = kTier / kChunkCols;
  static constexpr int kLdChunk = kChunkCols + kPad;
  static constexpr int kLdP = kBlock + kPad;  // transposed probability tiles [key][query]
  static_assert(kTier % kChunkCols == 0, "tier must be a multiple of the column chunk");
};

}  // namespace flashattn::cuda::simt
