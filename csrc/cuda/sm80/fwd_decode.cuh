// Tensor-core forward for calls of few query rows per kv head: decode steps (one row against a
// long cache), short speculative / chunked steps, with GQA / MQA groups packed together.
//
// The plain forward gives each query head its own block of 128 query rows (dims <= 128): one
// decode row leaves 127 of them computed for nothing and re-reads K / V once per query head of a
// group. Here a block takes a chunk of 16 or 32 (decode_chunk_rows) of a kv head's "packed" rows (its group's
// query heads x the call's query rows, row r: head hk * group + r / len_q, row r % len_q), so that K and V
// are read once per chunk. With at most 16 rows its 4 warps take 16 keys each of every 64-key tile;
// with more, warps 2 i and 2 i + 1 take rows 16 i .. 16 i + 15, over 32 keys each (two slots of 16).
// Each warp runs the online softmax over its own keys, and at the end the warps' rows merge through smem.
// K / V tiles stream through a ring of buffers (cp.async): DecodeConfig::kStages, or kDeepStages where the call runs
// one block an SM (DecodeGrid::stages; each depth its own kernel). A grid smaller than the GPU cuts each
// walk over the keys into parts, a block each; a part stores its merged rows (fp32) in the
// workspace, and a second kernel (decode_combine.cuh, a dependent launch) adds each row's parts in
// part order. On sm_90 a short step (a cache of few tiles, every walk's parts together fewer blocks than SMs)
// runs each walk's parts as one thread block cluster instead: each part pushes its rows into the shared memory
// of each row's owner (distributed shared memory), which adds them (no workspace, no second kernel: the fixed
// cost of a short step).
// Per-sequence key ranges (seqused_k, leftpad_k: a KV cache's lengths and left padding) are read
// on the device (sequence()): a walk covers its own sequence's keys, while the parts are sized on
// the host from len_k (the cache's length, the longest possible walk), so the grid never depends
// on values the host has not read (CUDA graphs). A part past its sequence's keys is empty (max
// -inf, sum 0) and adds nothing to the merge.
// A step that appends new keys without rotary tables is this kernel's alone (FwdParams::new_k): the blocks whose
// parts hold the new keys write them into the caches first, then read them there with the rest.
// Paged caches (block_table) are read in place: a tile's block looked up once where every tile lies in one
// page, else each row looked up in the table (paged_copy.cuh), one lookup for K and V, so that a tile may span
// pages of any size and start anywhere in a page (DecodeKv).
// fp16 / bf16 calls with no optional feature but the key ranges, at every head-dim tier;
// decode_call says which, decode_launch.cuh plans and launches them.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/sequence.h"
#include "../../params.h"
#include "../common/cluster.cuh"
#include "../common/dependent_launch.cuh"
#include "../common/fast_divide.h"
#include "../common/fragments.cuh"
#include "../common/online_softmax.cuh"
#include "../common/tile_copy.cuh"
#include "fwd_decode_steps.cuh"
#include "paged_copy.cuh"
#include "tile_config.h"

namespace flashattn::cuda::sm80 {

// How K / V are addressed (a template parameter: the lookups' registers would cost the dense kernel occupancy,
// 126 -> 165 registers at dim 64): dense; paged in whole segments of kPageSegment keys (pages of a multiple of it,
// sequences from their cache's first key, so every segment of a tile lies in one page): a table lookup per tile and
// the dense copy where pages hold whole tiles, else a lookup and a copy per segment; paged otherwise (left padding,
// packed sequences): row by row through the table (paged_copy.cuh).
enum class DecodeKv { kDense, kPagedSegments, kPagedRows };
constexpr int kPageSegment = 16;
// The variant that reads a call's K / V.
inline DecodeKv decode_kv(const FwdParams& p, int tile_keys) {
  if (!p.is_paged()) return DecodeKv::kDense;
  const bool segments = p.page_size % kPageSegment == 0 && tile_keys % kPageSegment == 0 && p.leftpad_k == nullptr &&
                        p.cu_seqlens_k == nullptr;
  return segments ? DecodeKv::kPagedSegments : DecodeKv::kPagedRows;
}

// The grid: blocks (batch, kv head, part, chunk) with the chunk fastest, so that the chunks of a GQA
// group's part, which read the same K / V tiles, run side by side and share them through L2; a walk is
// (batch, kv head, chunk). Where parts > 1, `partial`: a slot per walk and part, which decode_combine_kernel
// adds. Clustered (cluster > 1): the blocks (batch, kv head, chunk, part), the part fastest, each walk's parts
// one thread block cluster (no workspace).
struct DecodeGrid {
  int chunks = 1, parts = 1, chunk_rows = kDecodeChunkRows;  // chunk_rows: 16 or 32 (decode_chunk_rows)
  int cluster = 1;                                          // parts per thread block cluster (1: none, else parts)
  int stages = 0;  // the K / V ring's buffers: DecodeConfig::kStages, or its kDeepStages (decode_launch.cuh)
  float* partial = nullptr;
  int combine_rows = 0;  // decode_combine_kernel's rows per walk: the chunk's rows, or fewer where a group has fewer
  // Early: the kernel before this one is the step's append, which writes nothing
  // the prologue reads but the last `added` keys of each sequence and seqused_k: the prologue then plans from
  // lengths[b] + added (the lengths the append read: FwdParams::seqused_before) and issues Q and the first tiles
  // before it waits for them, while they run; Q after the wait where the append writes it (q_late: a rotary step).
  bool early = false, q_late = false;
  const int32_t* lengths = nullptr;  // the prologue's seqused_k[b] is lengths[b] + added (else seqused_k, 0)
  int added = 0;
  // The step's append is this kernel's (FwdParams::new_k): the last `added` keys of each sequence come from new_k /
  // new_v, and each block whose part holds some writes them into the caches before its tile copies.
  bool appends = false;
  // The kernel's divisors (common/fast_divide.h: a short step's prologue is a chain of its divisions): the grid's
  // fastest and next index (above), the kv heads, the query rows and the parts; and paged, a page's keys (the key
  // loop's refills find their page without a division sequence): in segments (kPageSegment) where whole segments are
  // copied, else in rows. Set once the rest is.
  FastDivisor by_fastest, by_next, by_heads_kv, by_len_q, by_parts, by_page;
  void set_divisors(const FwdParams& p, DecodeKv kv) {
    const bool clustered = cluster > 1;
    by_fastest = FastDivisor(unsigned(clustered ? parts : chunks));
    by_next = FastDivisor(unsigned(clustered ? chunks : parts));
    by_heads_kv = FastDivisor(unsigned(p.heads_kv));
    by_len_q = FastDivisor(unsigned(p.len_q));
    by_parts = FastDivisor(unsigned(parts));
    by_page = FastDivisor(unsigned(kv == DecodeKv::kDense        ? 1
                                   : kv == DecodeKv::kPagedSegments ? p.page_size / kPageSegment
                                                                 : p.page_size));
  }
};

// Part `part` of walk `walk`'s rows in the workspace (kFloats floats: O [kRows][kDim], then the rows' max, then
// their sums), which fwd_decode_kernel writes and decode_combine_kernel reads.
template <int kRows, int kDim>
struct DecodeSlot {
  static constexpr int64_t kFloats = int64_t(kRows) * (kDim + 2);
  float* base;
  __device__ __forceinline__ DecodeSlot(const DecodeGrid& grid, int64_t walk, int part)
      : base(grid.partial + (walk * grid.parts + part) * kFloats) {}
  __device__ __forceinline__ float* o(int row) const { return base + row * kDim; }
  __device__ __forceinline__ float* max(int row) const { return base + kRows * kDim + row; }
  __device__ __forceinline__ float* sum(int row) const { return base + kRows * kDim + kRows + row; }
};

// kStages: the K / V ring's buffers, DecodeConfig::kStages or kDeepStages (DecodeGrid::stages), a template argument
// rather than a value the kernel reads: a key loop of run-time waits and buffer indices took 25-30 more instructions
// at dim 128, and the 1k-2k steps 0.1-0.3 µs more. The deep ring's prologue stays a loop: unrolled (six tile
// copies before the wait for the append), its steps with an append were 3-8% slower.
template <class Elem, int kDim, DecodeKv kKv, int kStages>
__global__ void __launch_bounds__(DecodeConfig<Elem, kDim>::kThreads, DecodeConfig<Elem, kDim>::kBlocksPerSm)
    fwd_decode_kernel(const FwdParams p, DecodeGrid grid) {
  using Cfg = DecodeConfig<Elem, kDim>;
  using M = Mma<Elem>;
  using Exp = ExpDomain<float>;
  constexpr int kRows = Cfg::kRows, kBN = Cfg::kBN, kLd = Cfg::kLd;
  constexpr int kThreads = Cfg::kThreads, kDA = kDim / 8;
  constexpr int kWarpRows = Cfg::kWarpRows;  // a warp's rows (one m16 row group)
  constexpr bool kSw = Cfg::kSwizzle;

  // (16 as every kernel declares it: one declaration per file; the window starts 128-byte aligned)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Elem* sQ = reinterpret_cast<Elem*>(smem_raw);
  Elem* sK = sQ + kRows * kLd;          // [kStages] tiles
  Elem* sV = sK + kStages * kBN * kLd;  // [kStages] tiles

  // (a dependent launch: nothing is read before the kernels before it are done, or early (DecodeGrid) only what
  // they leave as it is)
  if (!grid.early) wait_for_prior_grids();
  const bool clustered = grid.cluster > 1;
  // (The prologue's arithmetic in 32 bits, its divisions by the host's magic numbers: heads, packed rows and key
  // tiles stay far below 2^31 (the tensor maps and decode_call bound them), and each division sat on the path
  // to the first copy.)
  const unsigned above = grid.by_fastest.div(blockIdx.x), head = grid.by_next.div(above);  // batch x kv head
  const int inner = int(blockIdx.x - above * grid.by_fastest.d), outer = int(above - head * grid.by_next.d);
  const int chunk = clustered ? outer : inner, part = clustered ? inner : outer;
  const unsigned batch_of_head = grid.by_heads_kv.div(head);
  const int64_t hk = head - batch_of_head * grid.by_heads_kv.d, b = batch_of_head;
  const int64_t walk = int64_t(head) * grid.chunks + chunk;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int E = int(p.head_dim), Ev = int(p.head_dim_v);

  Seq sq = sequence_of_lengths(p, b, grid.lengths, grid.added);
  // Appending: the append's rule leftpad_k <= seqused_k before the new keys too; the first new key, counted from the
  // sequence's first.
  if (grid.appends) sq.valid = sq.valid && grid.lengths[b] >= sq.k0;
  const int64_t new_first = sq.len_k - grid.added;
  const unsigned group = grid.by_heads_kv.div(unsigned(p.heads_q));  // (decode_call: sq.len_q is p.len_q)
  const int64_t r0 = int64_t(chunk) * grid.chunk_rows;  // the chunk's first packed row
  const int rows = int(group * sq.len_q - r0 < grid.chunk_rows ? group * sq.len_q - r0 : grid.chunk_rows);
  // More than one row group: the warps in pairs, a pair's warps on its group's rows over two slots each.
  const bool pairs = rows > kWarpRows;
  const int row_group = pairs ? warp >> 1 : 0, key_slot = pairs ? 2 * (warp & 1) : warp;
  auto head_of = [&](int64_t r) { return hk * group + grid.by_len_q.div(unsigned(r)); };
  auto row_of = [&](int64_t r) { return int64_t(grid.by_len_q.mod(unsigned(r))); };

  // The chunk's keys: from the band of its first row to that of its last (the whole band where
  // the chunk spans heads), in kBN tiles; the part's share of them.
  const int64_t r_last = r0 + rows - 1;
  const bool one_head = grid.by_len_q.div(unsigned(r0)) == grid.by_len_q.div(unsigned(r_last));
  const int64_t m_lo = one_head ? row_of(r0) : 0, m_hi = one_head ? row_of(r_last) : sq.len_q - 1;
  const int64_t n_lo = sq.key_begin(m_lo) / kBN * kBN, n_hi = sq.key_end(m_hi);
  const int64_t walk_tiles = n_hi > n_lo ? (n_hi - n_lo + kBN - 1) / kBN : 0;
  // Tiles [i W / P, (i + 1) W / P) of the walk's W for part i of P: with W = q P + r, i W / P = i q + i r / P.
  const unsigned wq = grid.by_parts.div(unsigned(walk_tiles)), wr = unsigned(walk_tiles) - wq * grid.by_parts.d;
  const int64_t first = part * wq + grid.by_parts.div(part * wr);
  const int64_t last = (part + 1) * wq + grid.by_parts.div((part + 1) * wr);
  const int64_t n_begin = n_lo + first * kBN;
  const int tiles = int(last - first);
  // Tiles every row of the chunk sees whole skip the per-score mask.
  auto all_visible = [&](int64_t n0) { return n0 >= sq.key_begin(m_hi) && n0 + kBN <= sq.key_end(m_lo); };

  // Dense: the sequence's first key row; paged whole tiles: the head's row 0 of block 0.
  const Elem* k = kKv == DecodeKv::kDense ? sq.k_rows<const Elem>(p.k, p.k_stride, hk, 0)
                                          : static_cast<const Elem*>(p.k) + hk * p.k_stride.head;
  const Elem* v = kKv == DecodeKv::kDense ? sq.k_rows<const Elem>(p.v, p.v_stride, hk, 0)
                                          : static_cast<const Elem*>(p.v) + hk * p.v_stride.head;
  bool bad_page = false;  // a page of the part's keys names a block outside the cache (FwdParams::check_pages)
  // The copying threads. At dim 192, whose rows' 24 chunks do not divide the block, those of whole rows (120 of the
  // 128), each a column chunk of every 5th row: the block walking the tile's chunks takes a division, bounds tests
  // and, paged, a table lookup per chunk, and spills there. At dim 96 the whole-row copy was faster dense but slower
  // paged and on short steps (docs/kernels/sm80_decode.md), so every thread walks the chunks.
  constexpr int kRowChunks = kDim / chunk_elems<Elem>();
  constexpr int kCopyThreads = kDim == 192 ? kThreads / kRowChunks * kRowChunks : kThreads;
  constexpr bool kFull = kCopyThreads % kRowChunks == 0;  // whole rows a pass: no per-chunk bounds tests
  const bool copies = kCopyThreads == kThreads || tid < kCopyThreads;
  auto load_kv = [&](int j, int stage) {  // tile j of the part into buffer `stage`
    if (!copies) return;
    const int64_t n0 = n_begin + int64_t(j) * kBN;
    const int rows_k = sq.k_tile_rows(n0, kBN);
    if constexpr (kKv == DecodeKv::kPagedRows) {  // (n0 counted from the sequence's first key, k0 from its cache's)
      copy_paged_kv_async<kBN, kDim, kCopyThreads, kSw>(sK + stage * kBN * kLd, sV + stage * kBN * kLd, kLd, p, b,
                                                        hk, sq.k0 + n0, rows_k, E, Ev, tid, grid.by_page, bad_page);
      return;
    }
    int64_t k_at = n0 * p.k_stride.row, v_at = n0 * p.v_stride.row;
    if constexpr (kKv == DecodeKv::kPagedSegments) {  // (k0 is 0, n0 a multiple of kBN: whole segments)
      constexpr int kSegs = kBN / kPageSegment;
      const unsigned seg = unsigned(uint64_t(n0) / kPageSegment);  // the tile's first segment
      if (grid.by_page.d % kSegs != 0) {  // pages not of whole tiles: the segments' blocks, then their rows
        // The segment's block (a segment past the keys: no lookup, its rows zeros) and its rows' addresses.
        auto segment = [&](int i, const Elem*& k_seg, const Elem*& v_seg) {
          const unsigned page = grid.by_page.div(seg + i);
          const int64_t block = rows_k > i * kPageSegment ? block_of(p, b, page, bad_page) : 0;
          const int64_t row = int64_t(seg + i - page * grid.by_page.d) * kPageSegment;
          k_seg = k + block * p.k_stride.batch + row * p.k_stride.row;
          v_seg = v + block * p.v_stride.batch + row * p.v_stride.row;
        };
        if constexpr (kSegs == kThreads / 32 && 32 % kRowChunks == 0) {
          // Warp i copies segment i (as a 16-row tile of 32 threads): one lookup a thread, not one per segment.
          const Elem *k_seg, *v_seg;
          segment(warp, k_seg, v_seg);
          Elem* const tile_k = sK + stage * kBN * kLd;
          Elem* const tile_v = sV + stage * kBN * kLd;
          const int rows = rows_k - warp * kPageSegment, at = warp * kPageSegment * kLd;
          copy_tile_async<kPageSegment, kDim, 32, true, kSw, true>(tile_k + at, kLd, k_seg, p.k_stride.row, rows, E,
                                                                  lane);
          copy_tile_async<kPageSegment, kDim, 32, true, kSw, true>(tile_v + at, kLd, v_seg, p.v_stride.row, rows, Ev,
                                                                  lane);
        } else {  // (every lookup issued before the first copy)
          const Elem* k_seg[kSegs];
          const Elem* v_seg[kSegs];
#pragma unroll
          for (int i = 0; i < kSegs; ++i) segment(i, k_seg[i], v_seg[i]);
          Elem* const tile_k = sK + stage * kBN * kLd;
          Elem* const tile_v = sV + stage * kBN * kLd;
#pragma unroll
          for (int i = 0; i < kSegs; ++i) {
            const int rows = rows_k - i * kPageSegment, at = i * kPageSegment * kLd;
            copy_tile_async<kPageSegment, kDim, kCopyThreads, kFull, kSw, true>(tile_k + at, kLd, k_seg[i],
                                                                                p.k_stride.row, rows, E, tid);
            copy_tile_async<kPageSegment, kDim, kCopyThreads, kFull, kSw, true>(tile_v + at, kLd, v_seg[i],
                                                                                p.v_stride.row, rows, Ev, tid);
          }
        }
        return;
      }
      const unsigned page = grid.by_page.div(seg);  // the tile in one page: its block, then the dense copy
      const int64_t block = block_of(p, b, page, bad_page), row = int64_t(seg - page * grid.by_page.d) * kPageSegment;
      k_at = block * p.k_stride.batch + row * p.k_stride.row;
      v_at = block * p.v_stride.batch + row * p.v_stride.row;
    }
    // (a whole tile, every tile but a walk's last, where the copying threads cover whole rows: no per-chunk bounds
    // tests, ~3 instructions a chunk against ~14, in a loop whose time in a short step is its instructions' latency)
    copy_tile_async<kBN, kDim, kCopyThreads, kFull, kSw, true>(sK + stage * kBN * kLd, kLd, k + k_at, p.k_stride.row,
                                                               rows_k, E, tid);
    copy_tile_async<kBN, kDim, kCopyThreads, kFull, kSw, true>(sV + stage * kBN * kLd, kLd, v + v_at, p.v_stride.row,
                                                               rows_k, Ev, tid);
  };
  // When a tile's buffer is refilled: dense, right after the tile (a second barrier per tile), so that a block
  // waiting for its next tile has all kStages in flight; paged row by row, at the top of the tile after it, once
  // the wait for that tile is over (one tile fewer in flight). The row copy's table loads then overlap the wait,
  // not the tile's products: refilled early, its MQA steps took up to 1.09x the time, dense ones 0.84-1.02x.
  constexpr bool kRefillEarly = kKv != DecodeKv::kPagedRows;
  constexpr int kAhead = kRefillEarly ? kStages : kStages - 1;  // tiles in flight while a tile is computed
  // Appending: each block whose part holds new keys writes them into the caches before it copies its tiles (the
  // chunks of a walk write the same bytes), once the sequence's rules hold: its lengths (sq.valid) and, paged, every
  // page of its keys in the cache (the parts check only their own pages). A part's tile copies then read them
  // there: no copy of a second form in the key loop (as a patch of the landed tile, its code took 10% more
  // instructions).
  if (grid.appends) {
    const int64_t part_end = n_begin + int64_t(tiles) * kBN < sq.len_k ? n_begin + int64_t(tiles) * kBN : sq.len_k;
    const int64_t from = n_begin > new_first ? n_begin : new_first;
    if (from < part_end) {
      // (new row i of the step is key row new_first + i of the sequence; item i of the part's new rows is chunk
      // i % row_chunks of row i / row_chunks, its key chunks first, then its value chunks)
      auto cache_at = [&](const Elem* base, const Strides& st, int64_t n) {
        Elem* row0 = const_cast<Elem*>(base);  // (the caches are the step's to write)
        if constexpr (kKv == DecodeKv::kDense) {
          return row0 + n * st.row;
        } else {
          const int64_t j = sq.k0 + n, page = page_of(p, j);
          return row0 + block_of(p, b, page) * st.batch + (j - page * p.page_size) * st.row;
        }
      };
      const Elem* new_k = static_cast<const Elem*>(p.new_k) + b * p.new_k_stride.batch + hk * p.new_k_stride.head;
      const Elem* new_v = static_cast<const Elem*>(p.new_v) + b * p.new_v_stride.batch + hk * p.new_v_stride.head;
      constexpr int kChunk = chunk_elems<Elem>();
      const int k_chunks = E / kChunk, row_chunks = k_chunks + Ev / kChunk, items = int(part_end - from) * row_chunks;
      auto item_at = [&](int i, const Elem*& src, Elem*& dst) {
        const int r = i / row_chunks, c = i - r * row_chunks;
        const int64_t n = from + r, t = n - new_first;
        const bool key = c < k_chunks;
        const int col = (key ? c : c - k_chunks) * kChunk;
        src = (key ? new_k + t * p.new_k_stride.row : new_v + t * p.new_v_stride.row) + col;
        dst = (key ? cache_at(k, p.k_stride, n) : cache_at(v, p.v_stride, n)) + col;
      };
      // The thread's first item read (and, paged, its page looked up) beside the page check, not after it: the
      // write then waits for one round of loads, not two. (Indices within the cache and the new rows whatever the
      // lengths: sequence_of_lengths clamps.)
      Elem* first_dst = nullptr;
      uint4 first = {};
      if (tid < items) {
        const Elem* src;
        item_at(tid, src, first_dst);
        first = *reinterpret_cast<const uint4*>(src);
      }
      bool refused = !sq.valid;
      if constexpr (kKv != DecodeKv::kDense) {
        if (sq.valid) {
          const int64_t end_page = page_of(p, sq.k0 + sq.len_k - 1) + 1;
          for (int64_t page = page_of(p, sq.k0) + tid; page < end_page; page += kThreads) block_of(p, b, page, refused);
        }
      }
      if (__syncthreads_or(refused)) {
        sq.valid = false;
      } else {
        if (tid < items) *reinterpret_cast<uint4*>(first_dst) = first;
        for (int i = tid + kThreads; i < items; i += kThreads) {
          const Elem* src;
          Elem* dst;
          item_at(i, src, dst);
          *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        }
        __syncthreads();  // (written before any thread's tile copies read them)
      }
    }
  }
  // Early: the first tiles before the wait where none holds a key the kernel before writes (the last `added`),
  // else the wait first. After it a sequence is valid only where the append wrote the planned length into
  // seqused_k (it writes -1 for those it refuses: their plan's reads stayed in bounds, sequence_of_lengths clamps,
  // and their rows come out NaN).
  const int64_t ahead = tiles < kAhead ? tiles : kAhead;
  const bool issue_early = grid.early && n_begin + ahead * kBN <= sq.len_k - grid.added;
  if (grid.early && !issue_early) wait_for_prior_grids();
  // Q with the first tile (issued after it: the tile comes from DRAM, Q mostly from L2), then the next kAhead - 1
  // tiles, a commit group each. Q written by the kernel before and the tiles issued early: Q after the wait, in a
  // group of its own, waited for with every early tile (issued while the append ran, mostly landed).
  const bool q_after_wait = grid.q_late && issue_early;
  if (tiles > 0) load_kv(0, 0);
  if (!q_after_wait) load_chunk_q<kDim>(sQ, p, sq, r0, rows, E, head_of, row_of, tid);  // past the chunk's rows zeros
  cp_async_commit();
#pragma unroll (kStages == DecodeConfig<Elem, kDim>::kStages ? kStages : 1)  // (the deep ring's a loop: see kStages)
  for (int s = 1; s < kAhead; ++s) {
    if (s < tiles) load_kv(s, s);
    cp_async_commit();
  }
  if (issue_early) wait_for_prior_grids();
  if (q_after_wait) {
    load_chunk_q<kDim>(sQ, p, sq, r0, rows, E, head_of, row_of, tid);
    cp_async_commit();
    cp_async_wait<0>();
  }
  if (grid.early) sq.valid = sq.valid && p.seqused_k[b] == grid.lengths[b] + grid.added;
  const DecodeOperandReads<Cfg, Elem> read(sQ, sK, sV, row_group, key_slot, lane);

  // The lane's rows g and g + 8 of the warp's group: their bands (none past the chunk's rows).
  int64_t lo[2], hi[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = kWarpRows * row_group + g + 8 * r;
    lo[r] = row < rows ? sq.key_begin(row_of(r0 + row)) : 0;
    hi[r] = row < rows ? sq.key_end(row_of(r0 + row)) : 0;
  }
  const float score_scale = Exp::score_scale(p.scale);
  float o[kDA][4], row_max[2] = {neg_inf<float>(), neg_inf<float>()}, row_sum[2] = {0.f, 0.f};
#pragma unroll
  for (int d = 0; d < kDA; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;

  // A step of the loop computes two tiles where a warp takes one slot of each and three stages are in flight
  // (rows <= 16, dims <= 128, K / V refilled early): their scores' products interleaved and one softmax over both,
  // so that a part's tiles cost about half the latency (the loop of a short step is bound by it, one warp per
  // scheduler); else one tile.
  constexpr bool kTwoTileSteps = kRefillEarly && kStages >= 3;
  auto stage_after = [](int st) { return st == kStages - 1 ? 0 : st + 1; };
  int stage = 0;
#pragma unroll 1
  for (int j = 0; j < tiles;) {
    const bool two = kTwoTileSteps && !pairs && j + 1 < tiles;
    // The step's tiles landed for all (the tiles after them may still be in flight).
    if (two) {
      cp_async_wait<(kTwoTileSteps ? kAhead - 2 : 0)>();
    } else {
      cp_async_wait<kAhead - 1>();
    }
    __syncthreads();
    if constexpr (!kRefillEarly) {  // tile j + kAhead into tile j - 1's buffer, which every warp is done with
      if (j + kAhead < tiles) load_kv(j + kAhead, stage == 0 ? kStages - 1 : stage - 1);
      cp_async_commit();
    }
    const int64_t n0 = n_begin + int64_t(j) * kBN;
    const int next_stage = stage_after(stage);

    // S = Q K^T for the warp's 16 keys of a slot; the online softmax over them; O rescaled, then O += P V.
    auto keys_of_slot = [&](int next) {
      float s[1][2][4] = {};
      const int stages[1] = {stage};
      warp_scores<kDim>(s, read, stages, next, n0, all_visible, lo, hi, score_scale, t);
      float alpha[2];
      warp_softmax(s, row_max, row_sum, alpha);
      warp_pv(o, s[0], alpha, read, stage, next);
    };
    if (two) {  // (the warp's slot of tiles j and j + 1)
      float s[2][2][4] = {};
      const int stages[2] = {stage, next_stage};
      warp_scores<kDim>(s, read, stages, 0, n0, all_visible, lo, hi, score_scale, t);
      float alpha[2];
      warp_softmax(s, row_max, row_sum, alpha);
      warp_pv(o, s[0], alpha, read, stage, 0);
      const float kept[2] = {1.f, 1.f};  // (O rescaled once for both)
      warp_pv(o, s[1], kept, read, next_stage, 0);
    } else {
      keys_of_slot(0);
      if (pairs) keys_of_slot(1);
    }
    if constexpr (kRefillEarly) {  // tiles j + kAhead ... into the step's buffers, once every warp is done with them
      __syncthreads();
      if (j + kAhead < tiles) load_kv(j + kAhead, stage);
      cp_async_commit();
      if (two) {
        if (j + 1 + kAhead < tiles) load_kv(j + 1 + kAhead, next_stage);
        cp_async_commit();
      }
    }
    stage = two ? stage_after(next_stage) : next_stage;
    j += two ? 2 : 1;
  }
  cp_async_wait<0>();
  // Every warp done with the K / V buffers, which the merge takes. Pages checked: a part that read a bad block for a
  // key of its sequence gives NaN rows (merge_warps), which the merge of the walk's parts carries to the output
  // (each walk reads all of its sequence's keys: no window, and a step's last query row sees every key).
  if constexpr (kKv == DecodeKv::kDense) {
    __syncthreads();
  } else if (__syncthreads_or(p.check_pages && bad_page)) {
    sq.valid = false;
  }

  // The warps' rows into smem (reusing the K / V buffers).
  float* sO = reinterpret_cast<float*>(sK);
  float* sStats = sO + Cfg::kWarps * kWarpRows * Cfg::kOLd;
  stash_warp_rows<Cfg>(sO, sStats, o, row_max, row_sum, warp, g, t);
  __syncthreads();

  // A thread's share of a row group's 16 rows: row tid / 8 of the group, columns 4 (tid % 8) + 32 c. The row
  // groups in turn (two where the warps pair up), each from its warps (its pair, or all four).
  constexpr int kCols = kDim / 32;
  const int groups = pairs ? 2 : 1, col0 = 4 * (tid % 8);
  float mx, l;
  float4 acc[kCols];
  auto reset = [&] {
    mx = neg_inf<float>();
    l = 0.f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  };
  // Adds rows of max m_i, sum l_i and O o_i (read by `load`) in turn, rescaled to the running max.
  auto add_rows = [&](float m_i, float l_i, auto load) { merge_softmax_state(mx, l, acc, m_i, l_i, load); };
  auto merge_warps = [&](int group_i) {  // the thread's row of row group group_i, from its warps
    reset();
    const int first = pairs ? 2 * group_i : 0, last = pairs ? first + 2 : Cfg::kWarps, r = tid / 8;
    for (int w = first; w < last; ++w) {
      const float* src = sO + (w * kWarpRows + r) * Cfg::kOLd + col0;
      add_rows(sStats[(2 * w) * kWarpRows + r], sStats[(2 * w + 1) * kWarpRows + r],
               [&](int c) { return *reinterpret_cast<const float4*>(src + 32 * c); });
    }
    l = sq.row_sum(l);  // NaN for an invalid sequence or part: stored, pushed or output, it makes the row NaN
  };
  // The output of chunk row `row`: O / l (0 and LSE -inf for a row that sees no key; a NaN sum, an invalid
  // sequence's or part's (merge_warps), propagates).
  auto store_row = [&](int row) {
    const int64_t h = head_of(r0 + row), m = row_of(r0 + row);
    const bool empty = l == 0.f;
    const float inv = empty ? 0.f : 1.f / l;
    Elem* out = sq.q_rows<Elem>(p.out, p.out_stride, h, m);
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = col0 + 32 * c;  // Ev is a multiple of 8: a chunk of 4 is in or out whole
      if (col < Ev)
        *reinterpret_cast<uint2*>(out + col) =
            make_uint2(M::pack(acc[c].x * inv, acc[c].y * inv), M::pack(acc[c].z * inv, acc[c].w * inv));
    }
    if (tid % 8 == 0)
      static_cast<float*>(p.lse)[sq.row_index(p.heads_q, h, m)] = empty ? neg_inf<float>() : Exp::lse(mx, l);
  };

  if (grid.parts == 1) {
    for (int i = 0; i < groups; ++i) {
      merge_warps(i);
      if (kWarpRows * i + tid / 8 < rows) store_row(kWarpRows * i + tid / 8);
    }
    return;
  }
  if (clustered) {
    // Each part pushes its rows into their owners' smem (row `row`'s owner: the cluster's block row % parts), past
    // the owners' warps' rows, in their K / V buffers: only once every part is done with those (barrier 1, its
    // arrival overlapping the first row group's merge). Each owner then adds its rows' parts in part order from
    // its own smem (barrier 2: every push landed). No block reads another's smem: no round trip, and no third
    // barrier to keep a block's smem alive for its readers.
    float* sSlots = sO + Cfg::kMergeBytes / sizeof(float);
    float* sSlotMax = sSlots + Cfg::kClusterSlots * kDim;
    float* sSlotSum = sSlotMax + Cfg::kClusterSlots;
    const int parts = grid.parts;
    cluster_arrive();  // 1: done with the K / V buffers
    for (int i = 0; i < groups; ++i) {
      merge_warps(i);
      if (i == 0) cluster_wait();
      const int row = kWarpRows * i + tid / 8;
      if (row >= rows) continue;
      const int in_owner = int(grid.by_parts.div(row)), owner = row - in_owner * parts;
      const int slot = in_owner * parts + part;
#pragma unroll
      for (int c = 0; c < kCols; ++c)
        store_cluster_f32x4(cluster_smem_address(sSlots + slot * kDim + col0 + 32 * c, owner), acc[c]);
      if (tid % 8 == 0) {
        store_cluster_f32(cluster_smem_address(sSlotMax + slot, owner), mx);
        store_cluster_f32(cluster_smem_address(sSlotSum + slot, owner), l);
      }
    }
    cluster_arrive();  // 2: this part's rows pushed
    cluster_wait();
    for (int i = 0; i < groups; ++i) {
      const int row = kWarpRows * i + tid / 8;
      const int in_owner = int(grid.by_parts.div(row));
      if (row >= rows || row - in_owner * parts != part) continue;
      reset();
      for (int j = 0; j < parts; ++j) {
        const int slot = in_owner * parts + j;
        add_rows(sSlotMax[slot], sSlotSum[slot],
                 [&](int c) { return *reinterpret_cast<const float4*>(sSlots + slot * kDim + col0 + 32 * c); });
      }
      store_row(row);
    }
    return;
  }
  // A part: its rows to its slot, which decode_combine_kernel adds once every part is done (allowed to start
  // now: its blocks wait for this grid, and their launch overlaps the merge and the stores).
  allow_dependent_launch();
  const DecodeSlot<kRows, kDim> dst(grid, walk, part);
  for (int i = 0; i < groups; ++i) {
    merge_warps(i);
    const int row = kWarpRows * i + tid / 8;
    if (row >= rows) break;  // (only the chunk's rows: a decode step of a GQA group of 4 fills 4 of the 32)
#pragma unroll
    for (int c = 0; c < kCols; ++c) __stcg(reinterpret_cast<float4*>(dst.o(row) + col0 + 32 * c), acc[c]);
    if (tid % 8 == 0) {
      __stcg(dst.max(row), mx);
      __stcg(dst.sum(row), l);
    }
  }
}

}  // namespace flashattn::cuda::sm80
