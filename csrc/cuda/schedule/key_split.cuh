// The forward's grids that leave SMs idle, spread over more of them by splitting query tiles' key
// walks. A grid of B blocks whose walks all take T key tiles (plain non-causal calls, or causal
// ones with one query tile per head) runs in waves of S = SMs x blocks per SM; its last R = B % S
// blocks (all B where B < S: a decode step, a short prompt, a small batch) keep R of the S slots
// busy for a whole walk while the others idle. Split, the first B - R blocks take their walks
// whole and each of the last R walks is cut into `parts` runs of key tiles, a block each. A part
// writes its rows' partial state (O unnormalised, row max and sum; fp32) to the workspace, and the
// walk's last part to finish (a counter per walk) merges the walk's parts in part order, so that
// the output does not depend on which part that is, and writes O and the LSE as a whole block
// would. Which kernels carry this (FwdConfig::kKeySplit, kSplitKernel): the plain fp16 / bf16 one
// at dim 128 for any grid; at dims 64 and 256 a second instantiation for grids smaller than the
// GPU only (there the split's code moved the plain kernel's key loop: -1..-2% on whole walks).
// Measured (H200, bf16, forward from CUDA graphs): one query row against 32768 keys at dim 64 488 ->
// 67 us, against 8192 keys at 256 (B = 4, H = 8) 285 -> 76 us; 512 rows against 8192 keys at 64
// 126 -> 65 us; the benchmark grid at dim 128, L = 4096 ... 16384, +1.4..+4.4%.
// (Parts of one walk per block, not an even share of the R x T tiles per block: a block taking
// its share's pieces one after the other put a loop around the key loop, and ptxas then spilled
// 36-104 B in the dim-128 kernel, whose key loop holds 255 registers.)
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/check.h"
#include "../common/online_softmax.cuh"

namespace flashattn::cuda {

// The split of a forward launch (plan_key_split): blocks from `whole` on each take a part of the
// last `walks` walks (those of blocks whole ... whole + walks - 1 of the plain grid, walk_tiles key
// tiles each, cut into `parts` parts). `partial` holds a slot per part (block whole + i: slot i),
// `counters` one per walk, zeroed by the launcher.
struct KeySplit {
  unsigned whole = 0xffffffffu;  // blocks that take a whole walk: all of them without a split
  int walks = 0, parts = 0, walk_tiles = 0;
  float* partial = nullptr;
  unsigned* counters = nullptr;
};

// A block's work: the walk of block `block` of the plain grid and its key tiles [first, first +
// count) (a whole walk: 0, and a count past its end). A part's slot is its block's index past
// KeySplit::whole (settle_piece: taken from blockIdx, not held across the key loop).
struct KeyPiece {
  unsigned block;
  int first, count;
};

// A part takes at least kMinPartTiles key tiles, at most kMaxParts parts a walk (the merge reads
// every part's rows in turn); walks of fewer than kMinSplitWalkTiles stay whole (128 walks of 16
// tiles in 2 parts ran 83 against 76 us whole, timed with the host's time per call in it: to be
// measured again from a CUDA graph, benchmarks/bench_small_grids.py). The model's costs, in key
// tiles: a part's Q and first K / V copies and its rows' store, and the merge's reads per part; a
// whole walk's copies and output. (H200, bf16, dim 128.)
constexpr int64_t kMinPartTiles = 8, kMinSplitWalkTiles = 32, kMaxParts = 16;
constexpr double kPartOverheadTiles = 1.0, kMergeTilesPerPart = 0.35, kWalkOverheadTiles = 1.0;

// The split of a grid of `blocks` walks of `walk_tiles` key tiles each on `per_sm` blocks per SM.
// The number of parts minimises the last wave's estimated time: ceil(R x parts / S) rounds of a
// part and its overhead, then the merge. Taken where that saves at least 1% of the grid's
// estimated time (the benchmark grid at L = 4096: 1.4% by the model, +1.4..+1.9% measured).
// Without pointers: key_split_bytes sizes its workspace.
inline KeySplit plan_key_split(int64_t blocks, int64_t walk_tiles, int per_sm) {
  KeySplit s;
  if (per_sm < 1 || walk_tiles < kMinSplitWalkTiles) return s;
  const int64_t slots = int64_t(device_limits().sms) * per_sm;
  const int64_t walks = blocks % slots;  // blocks < slots: all of them
  if (walks == 0) return s;
  const double walk_time = double(walk_tiles) + kWalkOverheadTiles;
  int64_t best_parts = 1;
  double best_time = walk_time;
  for (int64_t parts = 2; parts <= kMaxParts && walk_tiles / parts >= kMinPartTiles; ++parts) {
    const int64_t rounds = (walks * parts + slots - 1) / slots;
    const double time = double(rounds) * (double((walk_tiles + parts - 1) / parts) + kPartOverheadTiles) +
                        double(parts) * kMergeTilesPerPart;
    if (time < best_time) best_parts = parts, best_time = time;
  }
  const double grid_time = double(blocks / slots) * walk_time + walk_time;
  if (best_parts == 1 || walk_time - best_time < 0.01 * grid_time) return s;
  s.whole = unsigned(blocks - walks);
  s.walks = int(walks);
  s.parts = int(best_parts);
  s.walk_tiles = int(walk_tiles);
  return s;
}

// Workspace of a split whose parts' rows take `slot_floats` floats each (PartialRows): the
// counters, then a slot per part.
inline size_t key_split_counter_bytes(const KeySplit& s) { return (size_t(s.walks) * 4 + 255) / 256 * 256; }
inline size_t key_split_bytes(const KeySplit& s, size_t slot_floats) {
  if (s.walks == 0) return 0;
  return key_split_counter_bytes(s) + size_t(s.walks) * s.parts * slot_floats * sizeof(float);
}

// This block's work: a whole walk (block `plain`, its place in the plain grid's order) or a part.
template <bool kSplit>
__device__ __forceinline__ KeyPiece key_piece(const KeySplit& s, unsigned plain) {
  if (!kSplit || blockIdx.x < s.whole) return KeyPiece{plain, 0, 0x3fffffff};
  const int i = int(blockIdx.x - s.whole), w = i / s.parts, part = i - w * s.parts;
  const int first = int(int64_t(part) * s.walk_tiles / s.parts);
  const int last = int(int64_t(part + 1) * s.walk_tiles / s.parts);
  return KeyPiece{s.whole + unsigned(w), first, last - first};
}

// A part's rows in its slot, laid out by thread so that each thread writes and reads whole
// 16-byte chunks: [kMW][kDA][threads] accumulator quads of O, then [kMW][threads] quads of
// (row max, row max of row + 8, the lane's sums of both rows).
template <int kMW, int kDA>
struct PartialRows {
  static constexpr size_t floats(int threads) { return size_t(kMW) * (kDA + 1) * 4 * threads; }
  float* slot;
  int tid, threads;

  __device__ __forceinline__ float4* o_at(int mw, int d) const {
    return reinterpret_cast<float4*>(slot) + (mw * kDA + d) * threads + tid;
  }
  __device__ __forceinline__ float4* stats_at(int mw) const {
    return reinterpret_cast<float4*>(slot) + (kMW * kDA + mw) * threads + tid;
  }
};

// The end of this block's part (the key loop's rows in o / row_max / row_sum; a lane's rows 16 mw + g and
// 16 mw + g + 8 of its warp, of which the first `rows` are the sequence's): true where the block
// then writes the output rows. The part stores its rows and counts itself in; the walk's last part
// to finish reads every part's rows (its own back too, so that they add in part order whichever
// part merges) into o / row_max / row_sum, rescaled to the largest row max, and returns true; the
// others return false. Every thread gets the answer.
template <int kMW, int kDA>
__device__ __forceinline__ bool settle_piece(const KeySplit& s, int rows, int tid, int threads,
                                             float (&o)[kMW][kDA][4], float (&row_max)[kMW][2],
                                             float (&row_sum)[kMW][2]) {
  using Exp = ExpDomain<float>;
  using Rows = PartialRows<kMW, kDA>;
  const int slot = int(blockIdx.x - s.whole), w = slot / s.parts, g = (tid & 31) >> 2;
  auto rows_of = [&](int slot) { return Rows{s.partial + size_t(slot) * Rows::floats(threads), tid, threads}; };
  auto row_valid = [&](int mw) { return 16 * mw + g < rows; };  // (row g + 8 is past row g)
  const Rows mine = rows_of(slot);
#pragma unroll
  for (int mw = 0; mw < kMW; ++mw) {
    if (!row_valid(mw)) continue;
#pragma unroll
    for (int d = 0; d < kDA; ++d) __stcg(mine.o_at(mw, d), make_float4(o[mw][d][0], o[mw][d][1], o[mw][d][2], o[mw][d][3]));
    __stcg(mine.stats_at(mw), make_float4(row_max[mw][0], row_max[mw][1], row_sum[mw][0], row_sum[mw][1]));
  }
  __threadfence();  // this thread's rows reach L2 before the count that publishes them
  __syncthreads();
  bool last = false;
  if (tid == 0) last = atomicAdd(s.counters + w, 1u) == unsigned(s.parts - 1);
  if (!__syncthreads_or(last)) return false;
  __threadfence();  // the other parts' rows, published before their counts, are seen

  // One pass in part order: the running max, the sums and O rescaled where it grows.
#pragma unroll
  for (int mw = 0; mw < kMW; ++mw) {
    row_max[mw][0] = row_max[mw][1] = neg_inf<float>();
    row_sum[mw][0] = row_sum[mw][1] = 0.f;
#pragma unroll
    for (int d = 0; d < kDA; ++d) o[mw][d][0] = o[mw][d][1] = o[mw][d][2] = o[mw][d][3] = 0.f;
  }
#pragma unroll 1
  for (int i = w * s.parts; i < (w + 1) * s.parts; ++i) {
    const Rows part = rows_of(i);
#pragma unroll
    for (int mw = 0; mw < kMW; ++mw) {
      if (!row_valid(mw)) continue;
      const float4 st = __ldcg(part.stats_at(mw));
      const float m0 = acc_max(row_max[mw][0], st.x), m1 = acc_max(row_max[mw][1], st.y);
      // A row no part has seen a key of keeps max -inf: base 0 then, and every factor 0.
      const float a0 = Exp::exp(row_max[mw][0] - exp_base(m0)), a1 = Exp::exp(row_max[mw][1] - exp_base(m1));
      const float f0 = Exp::exp(st.x - exp_base(m0)), f1 = Exp::exp(st.y - exp_base(m1));
      row_max[mw][0] = m0;
      row_max[mw][1] = m1;
      row_sum[mw][0] = row_sum[mw][0] * a0 + st.z * f0;
      row_sum[mw][1] = row_sum[mw][1] * a1 + st.w * f1;
#pragma unroll
      for (int d = 0; d < kDA; ++d) {
        const float4 v = __ldcg(part.o_at(mw, d));
        o[mw][d][0] = o[mw][d][0] * a0 + v.x * f0;
        o[mw][d][1] = o[mw][d][1] * a0 + v.y * f0;
        o[mw][d][2] = o[mw][d][2] * a1 + v.z * f1;
        o[mw][d][3] = o[mw][d][3] * a1 + v.w * f1;
      }
    }
  }
  return true;
}

}  // namespace flashattn::cuda
