// The walk of the dK/dV kernels (bwd_sm80.cuh, bwd_sm80_2d.cuh): a block owns a key tile and
// visits every query head of its kv head's group and every kBM-row query tile that sees one of
// its keys, the next tiles' operands loading (cp.async, into a ring of 2 or 3 buffers) while this
// one is used.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/sequence.h"
#include "../../params.h"
#include "../common/barrier.cuh"
#include "../common/bias_tile.cuh"
#include "../common/cp_async.cuh"
#include "../common/tile_copy.cuh"
#include "../common/wgmma.cuh"

namespace flashattn::cuda {

// Where the LSE and D of a query tile's row m lie in a kernel's stats area (kBufs buffers of kBM
// LSE and kBM D values), as offsets from its start: RowStats keeps [kBufs][kBM] LSE, then
// [kBufs][kBM] D, in row order (the 1-D kernel reads two adjacent rows at once); the 2-D kernel
// has its own at dim 64 (bwd_sm80_2d.cuh's SlabStats).
template <int kBM, int kBufs = 2>
struct RowStats {
  static __device__ __forceinline__ int lse(int buf, int m) { return buf * kBM + m; }
  static __device__ __forceinline__ int d(int buf, int m) { return kBufs * kBM + buf * kBM + m; }
};

// Starts the copies of query tile (h, m0) into buffer `buf`: with a bias / mask (bias_tile.rows
// > 0; never in the plain variants, whose layout is the empty one) its tile against the block's
// keys [n0, n0 + rows_k) into buffer `buf` of sBias; Q and dO rows (kBM x kDim, pitch kLd, or
// kSwizzle: swizzled as tile_copy.cuh says; rows past len_q zero-filled) and their LSE and D
// into sStats where Stats places them. Rows past len_q get LSE = D = 0: with zero Q and dO they
// add exactly 0 to every gradient (P = 1, dP = D = 0).
template <int kBM, int kBN, int kDim, int kThreads, bool kSwizzle, class Stats, class Elem, class Acc>
__device__ __forceinline__ void load_query_tile(Elem* sQ, Elem* sdO, Acc* sStats, unsigned char* sBias, int kLd,
                                                const BiasTileLayout& bias_tile, bool bias_chunked,
                                                const BwdParams& p, const Seq& sq, const Acc* dsum_g, int64_t h,
                                                int64_t m0, int64_t n0, int rows_k, int buf, int tid) {
  if (bias_tile.rows > 0)
    stage_bias_tile<kBM, kBN, kThreads>(sBias + buf * bias_tile.buffer_bytes(), bias_tile, bias_chunked, p, sq, h,
                                        m0, n0, sq.q_tile_rows(m0, kBM), rows_k, tid);
  const int rows = sq.q_tile_rows(m0, kBM);
  copy_tile_async<kBM, kDim, kThreads, false, kSwizzle>(sQ + buf * kBM * kLd, kLd, sq.q_rows<const Elem>(p.q, p.q_stride, h, m0),
                                       p.q_stride.row, rows, int(p.head_dim), tid);
  copy_tile_async<kBM, kDim, kThreads, false, kSwizzle>(sdO + buf * kBM * kLd, kLd,
                                       sq.q_rows<const Elem>(p.dout, p.dout_stride, h, m0), p.dout_stride.row, rows,
                                       int(p.head_dim_v), tid);
  const int64_t r0 = sq.row_index(p.heads_q, h, m0);
  const Acc* lse_g = static_cast<const Acc*>(p.lse) + r0;
  static_assert(kBM <= kThreads, "one LSE / D element per thread");
  if (tid < kBM) {
    const bool ok = tid < rows;
    cp_async_elem_zfill(sStats + Stats::lse(buf, tid), lse_g + tid, ok);
    cp_async_elem_zfill(sStats + Stats::d(buf, tid), dsum_g + r0 + tid, ok);
  }
}

// How a walk buffers its query tiles (walk_query_tiles).
enum class QueryBuffers {
  kTwo,          // two buffers, a barrier at the top of each iteration
  kRingOfThree,  // three buffers, loaded two tiles ahead; one barrier per tile, in start_next()
  kTwoTracked,   // two buffers whose copies two mbarriers track; one barrier per tile, in the body
};

// Calls body(h, m0, buf, start_next) for every query tile that sees a key of [n0, n0 + rows_k)
// (causal and window bands move right with the row), over the query heads h_first .. h_first +
// group - 1, the tile's operands in buffer `buf`. load(h, m0, buf) starts the copies of a tile;
// the body calls start_next() once per tile, where they should start. The walk goes through the
// rows of one head, then the next: (h, m0) advance by addition (no 64-bit division per tile).
// Copies issued before the call land with the first tile.
//   kTwo: buffers 0 and 1 in turn; the walker waits for the tile and holds a barrier at the top
//     of each iteration, and start_next() loads the next tile into the other buffer (free
//     anywhere in the iteration: its last readers finished before that barrier).
//   kRingOfThree, for a body with one barrier per tile: start_next() IS that barrier. It waits
//     for the next tile (loaded one iteration ahead), holds the barrier (after it every warp has
//     finished the previous iteration, whose buffer the tile after next then takes) and loads
//     the tile after next.
//   kTwoTracked, for a body with one barrier per tile, which it holds itself before calling
//     start_next() (after it every warp has finished the previous iteration, whose buffer the
//     next tile then takes). start_next() loads the next tile and has `landed[buf of it]` (two
//     mbarriers in smem, initialised here) track its copies; the walker waits for them at the top
//     of the iteration instead of holding a barrier.
// With one barrier per tile there is none at the top: before it the body may read only this
// tile's buffer and what the previous barrier published.
// first / count: only the walk's iterations [first, first + count) (count < 0: to its end; a
// part of a split walk, tail_split.cuh: first lies within the walk, whose iterations number fewer
// than 2^31, so the divisions are 32-bit).
// kAsyncProxy (kTwo only): the tiles are read by wgmma (sm90/), through the async proxy: each thread
// fences its landed copies for it before the barrier.
template <int kBM, QueryBuffers kMode = QueryBuffers::kTwo, bool kAsyncProxy = false, class Load, class Body>
__device__ __forceinline__ void walk_query_tiles(const Seq& sq, int64_t n0, int rows_k, int64_t h_first,
                                                 int64_t group, Load&& load, Body&& body,
                                                 uint64_t* landed = nullptr, int first = 0, int count = -1) {
  const int64_t m_begin = sq.row_begin(n0) / kBM * kBM;
  const int64_t m_end = sq.row_end(n0 + rows_k - 1);
  const int64_t m_iters = m_end > m_begin ? (m_end - m_begin + kBM - 1) / kBM : 0;
  int64_t num_iters = m_iters * group;
  int64_t h_start = h_first, m_start = m_begin;  // the walk's tile `first`
  if (count >= 0 && first < num_iters) {
    const int heads = first / int(m_iters), tiles = first - heads * int(m_iters);
    h_start += heads;
    m_start += int64_t(tiles) * kBM;
    num_iters = first + count < num_iters ? count : num_iters - first;
  }
  auto advance = [&](int64_t& h, int64_t& m) {
    m += kBM;
    if (m >= m_end) {
      m = m_begin;
      ++h;
    }
  };
  if (num_iters > 0) load(h_start, m_start, 0);
  cp_async_commit();
  int64_t h = h_start, m0 = m_start;
  if constexpr (kMode == QueryBuffers::kTwo) {
    int buf = 0;
    for (int64_t it = 0; it < num_iters; ++it, buf ^= 1) {
      int64_t h_next = h, m_next = m0;
      advance(h_next, m_next);
      cp_async_wait<0>();
      if constexpr (kAsyncProxy) fence_proxy_async();
      __syncthreads();  // this tile landed for all; every warp is done with the other buffers
      auto start_next = [&] {
        if (it + 1 < num_iters) load(h_next, m_next, buf ^ 1);
        cp_async_commit();
      };
      body(h, m0, buf, start_next);
      h = h_next;
      m0 = m_next;
    }
  } else if constexpr (kMode == QueryBuffers::kRingOfThree) {
    int64_t h_ahead = h, m_ahead = m0;  // the tile after next, once advanced in the loop
    advance(h_ahead, m_ahead);
    if (num_iters > 1) load(h_ahead, m_ahead, 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // the first tile landed for all
    int buf = 0;
    for (int64_t it = 0; it < num_iters; ++it, buf = buf == 2 ? 0 : buf + 1) {
      advance(h_ahead, m_ahead);
      auto start_next = [&] {
        cp_async_wait<0>();
        __syncthreads();  // the next tile landed for all; every warp is done with the previous one
        if (it + 2 < num_iters) load(h_ahead, m_ahead, buf == 0 ? 2 : buf - 1);
        cp_async_commit();
      };
      body(h, m0, buf, start_next);
      advance(h, m0);
    }
  } else {
    if (threadIdx.x == 0) {
      mbar_init(&landed[0], blockDim.x);
      mbar_init(&landed[1], blockDim.x);
    }
    cp_async_wait<0>();
    __syncthreads();  // the first tile landed for all (untracked); the mbarriers are set up
    int buf = 0;
    for (int64_t it = 0; it < num_iters; ++it, buf ^= 1) {
      int64_t h_next = h, m_next = m0;
      advance(h_next, m_next);
      // Tile it >= 1 is the ((it - 1) / 2)-th load into its buffer: that phase of its mbarrier.
      if (it > 0) mbar_wait(&landed[buf], uint32_t((it - 1) >> 1) & 1u);
      auto start_next = [&] {
        if (it + 1 < num_iters) {
          load(h_next, m_next, buf ^ 1);
          cp_async_mbar_arrive(&landed[buf ^ 1]);  // once the copies landed
        }
      };
      body(h, m0, buf, start_next);
      h = h_next;
      m0 = m_next;
    }
  }
}

}  // namespace flashattn::cuda
