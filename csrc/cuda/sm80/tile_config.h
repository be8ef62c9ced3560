// Tile shapes of the tensor-core kernels: one table per kernel, one row per head-dim tier with the
// reason for its choices; the configs below derive the rest from the row. Plain C++ (no CUDA
// header): the kernel plan (../plan.cpp) reads their shared-memory sizes too. Measurements (H200,
// bf16 unless said) and what was tried instead: docs/kernels/sm80_forward.md, sm80_backward.md,
// sm80_decode.md.
#pragma once
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../../params.h"

namespace flashattn::cuda::sm80 {

// The row of `dim` in a tier table; a value-initialized row (dim 0) where the table has none.
template <class Row, size_t kRows>
constexpr Row tier_row(const Row (&rows)[kRows], int dim) {
  for (const Row& row : rows)
    if (row.dim == dim) return row;
  return Row{};
}

// ---- Forward (fwd_sm80.cuh) ----------------------------------------------------------------------

struct FwdTier {
  int dim = 0;
  int warps = 0, row_groups = 0;       // a block's warps, each with row_groups x 16 query rows
  int keys = 0, feature_keys = 0;      // key tile of the plain and of the feature variant
  bool staggered = false;              // plain: one K and one V buffer loaded in turn (else two each)
  bool full_copies = false;            // plain: whole K / V tiles copied without per-chunk predicates
  bool feature_full_copies = false;    // the same for the feature variant
  bool key_split = false;              // plain: the walks of a grid's last wave split (key_split.cuh)
  bool split_kernel = false;           // plain: a second instantiation with the split, for small grids
  bool swizzle = false;                // Q, K, V swizzled instead of padded rows (tile_copy.cuh)
};

// fp16 / bf16: 4 warps (two blocks per SM); 2 row groups per warp up to dim 128, where B fragments
// serve both. The feature variant keeps 32-key tiles above 64: its per-row feature work spills with 64.
inline constexpr FwdTier kFwdHalfTiers[] = {
    // dim warps rows keys fkeys stagger full   ffull  split  skernel swizzle
    {32,  4,    2,   128, 64,   false,  false, false, false, false,  false},  // 128 keys: half the rescales, +9-10%
    {64,  4,    2,   128, 64,   false,  true,  true,  false, true,   true},   // 128 keys, Q re-read per tile: +5-6%
    {96,  4,    2,   64,  32,   false,  false, false, false, false,  false},  // 64 keys +19-24%; a split spills here
    {128, 4,    2,   64,  32,   false,  true,  false, true,  false,  true},   // 64 keys +5-9%; split +2.4..+5.3%
    {192, 4,    1,   64,  32,   true,   false, false, false, false,  false},  // staggered +19-25%; swizzle -3..+4%
    {256, 4,    1,   64,  32,   true,   false, false, false, true,   true},   // staggered +8-14%; swizzle +10-15%
};

// fp64: 16 rows per warp (fp64 accumulators take twice the registers).
inline constexpr FwdTier kFwdDoubleTiers[] = {
    // dim warps rows keys fkeys
    {64,  4,    1,   32,  32},  // two blocks per SM
    {128, 8,    1,   16,  16},  // one block per SM; 8 warps hide the DMMA latency
};

template <class Elem>
constexpr FwdTier fwd_tier(int dim) {
  if constexpr (std::is_same_v<Elem, double>) return tier_row(kFwdDoubleTiers, dim);
  else return tier_row(kFwdHalfTiers, dim);
}

// kFeatures: the variant with the optional features. One query tile per block (a causal grid's last
// heads in the order of causal_order.cuh).
template <class Elem, int kDim, bool kFeatures = false>
struct FwdConfig {
  static constexpr FwdTier kTier = fwd_tier<Elem>(kDim);
  static constexpr bool kHalf = sizeof(Elem) == 2;
  static constexpr bool kDouble = std::is_same_v<Elem, double>;
  static constexpr int kWarps = kTier.warps;
  static constexpr int kMW = kTier.row_groups;  // 16-row groups per warp
  static constexpr bool kStaggered = !kFeatures && kTier.staggered;
  static constexpr int kBN = kFeatures ? kTier.feature_keys : kTier.keys;
  static constexpr bool kFullTileCopies = kFeatures ? kTier.feature_full_copies : kTier.full_copies;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBM = 16 * kMW * kWarps;
  static constexpr bool kKeySplit = !kFeatures && kTier.key_split;
  // Grids smaller than the GPU (every walk in parts: decode steps, small batches) take this second
  // instantiation, every other grid the plain kernel.
  static constexpr bool kSplitKernel = !kFeatures && kTier.split_kernel;
  static constexpr bool kSwizzle = kTier.swizzle;
  static constexpr int kLd = kSwizzle ? kDim : kDim + 8;  // smem row pitch in elements
  static constexpr size_t kSmemBytes = size_t(kBM + (kStaggered ? 2 : 4) * kBN) * kLd * sizeof(Elem);
  static_assert(kDim % 16 == 0 && kBN % 16 == 0, "products step over pairs of 8-wide atoms");
};

// ---- Backward, 1-D warp layout (bwd_sm80.cuh) ---------------------------------------------------

// Each warp owns 16 keys and all dims of dK / dV, or (pair = 2) two warps share a 16-key group, each
// reducing S^T and dP^T over half the dims and keeping dK / dV of half the columns. The variant with
// the general per-score step (softcap, ALiBi, dropout, bias gradient) needs registers beside dK and
// dV: 32-row query tiles, pairs above 128. Its compact tiles (4 warps) serve GPUs whose blocks get
// 99 KB (sm_86 / 89 / 120), where nothing else fits above dim 96.
struct BwdTier {
  int dim = 0;
  int warps = 0, general_warps = 0;                   // compact: 4
  int rows = 0, general_rows = 0, compact_rows = 0;   // query rows per tile; compact 0: no compact tiles
  int pair = 0, general_pair = 0;                     // warps per 16-key group
  int min_blocks = 0;                                 // plain: blocks per SM its registers leave room for
};

inline constexpr BwdTier kBwdHalfTiers[] = {
    // dim warps gwarps rows grows crows pair gpair blocks
    {32,  8,    8,     32,  32,   0,    1,   1,    2},  // 32-row tiles: within 128 registers, two blocks per SM
    {64,  8,    8,     32,  32,   0,    1,   1,    2},  // the same
    {96,  8,    8,     64,  32,   0,    1,   1,    1},  // 64-row tiles; 99 KB GPUs fit the general tiles
    {128, 8,    8,     64,  32,   32,   1,   1,    1},  // compact: 74 KB
    {192, 8,    8,     32,  32,   16,   1,   2,    1},  // 192 dims in one warp (116 B spills): 1.23-1.39x pairs
    {256, 8,    8,     32,  32,   16,   2,   2,    1},  // dK / dV of 256 dims do not fit one warp; compact: 72 KB
};

inline constexpr BwdTier kBwdDoubleTiers[] = {
    // dim warps gwarps rows grows crows pair gpair blocks
    {64,  8,    4,     16,  16,   0,    1,   1,    1},  // 8 warps for the DMMA latency: +9-11%
    {128, 4,    4,     16,  16,   0,    2,   2,    1},  // 16-row tiles: K, V and two stages of Q, dO fit
};

template <class Elem>
constexpr BwdTier bwd_tier(int dim) {
  if constexpr (std::is_same_v<Elem, double>) return tier_row(kBwdDoubleTiers, dim);
  else return tier_row(kBwdHalfTiers, dim);
}

template <class Elem, int kDim, bool kGeneral = false, bool kCompact = false>
struct BwdConfig {
  static constexpr BwdTier kTier = bwd_tier<Elem>(kDim);
  using Acc = std::conditional_t<std::is_same_v<Elem, double>, double, float>;
  static constexpr bool kHalf = sizeof(Elem) == 2;
  static constexpr bool kDouble = std::is_same_v<Elem, double>;
  static constexpr bool kServed = kTier.dim != 0 && (!kCompact || (kGeneral && kTier.compact_rows > 0));
  static constexpr int kPair = kGeneral ? kTier.general_pair : kTier.pair;
  static constexpr int kDimOut = kDim / kPair;  // dK / dV columns of a warp (and its share of the reduction)
  static constexpr int kWarps = kCompact ? 4 : kGeneral ? kTier.general_warps : kTier.warps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBN = 16 * kWarps / kPair;
  static constexpr int kBM = kCompact ? kTier.compact_rows : kGeneral ? kTier.general_rows : kTier.rows;
  static constexpr int kMinBlocks = kGeneral || kCompact ? 1 : kTier.min_blocks;
  static constexpr int kLd = kDim + 8;   // K, V, Q, dO rows
  static constexpr int kLdS = kBM + 8;   // dS^T rows (one per key)
  // Warp pairs exchange their partial S^T and dP^T: 2 x kBM / 8 accumulator atoms per lane.
  static constexpr size_t kExchangeBytes = kPair > 1 ? size_t(kWarps) * 32 * 2 * (kBM / 8) * 4 * sizeof(Acc) : 0;
  static constexpr size_t kSmemBytes =
      size_t((2 * kBN + 4 * kBM) * kLd + kBN * kLdS) * sizeof(Elem) + 4 * kBM * sizeof(Acc) + kExchangeBytes;
};

// ---- Backward, 2-D warp layout (bwd_sm80_2d.cuh) ------------------------------------------------

// Forms with one barrier per query tile instead of two (kOneSync; plain calls where a block gets the
// 227 KB of sm_90 / sm_100): Q / dO in a ring of three buffers loaded two tiles ahead, or in two
// buffers whose copies mbarriers track.
enum class OneSync { none, ring3, tracked };

// fp16 / bf16 calls without the general per-score step, 8 warps: S and dP on a grid of warps, P and
// dS through smem once per tile, dK / dV on a grid of warps of 32 keys x a share of the dims.
struct Bwd2dTier {
  int dim = 0;
  int keys = 0, rows = 0;             // tile of the 8-warp forms
  OneSync one_sync = OneSync::none;   // the one-barrier form, where there is one
  bool two_blocks = false;            // a form of half the block, two per SM, for short calls (sm_90+)
  bool swizzle = false;               // K, V, Q, dO swizzled instead of padded rows
  bool slab_stats = false;            // LSE and D read as one 16-byte chunk per row group
                                      // (+5-6% at 64, -1% at 128 / 256)
  bool stmatrix = false;              // P and dS stored with stmatrix, sm_90+ (+0.3..+2.4% up to 128, -0.3% at
                                      // 256); the one-barrier forms always (no other store path for their swizzle)
  int fma_exp_every = 0;              // one in this many unmasked exponentials on the FMA pipe, 0: none (64:
                                      // +0..+1.2%, 128: -0.4..-2%): the MUFU shares the MIO queue with ldmatrix
};

inline constexpr Bwd2dTier kBwd2dTiers[] = {
    // 32: none (the 1-D kernel)
    // dim keys rows one_sync          2blocks swizzle slab   stmatrix fma_exp
    {64,  128, 128, OneSync::none,    true,   true,   true,  true,    4},  // 128 rows; no room for the ring
    {96,  128, 64,  OneSync::ring3,   false,  false,  false, true,    0},  // ring +3.6..+5.9%; rows not whole lines
    {128, 128, 64,  OneSync::ring3,   false,  true,   false, true,    0},  // ring +0.8..+3.0% (230912 B)
    // 192: none (64 x 64 tiles measured 3-5% slower than the 1-D kernel)
    {256, 64,  64,  OneSync::tracked, false,  true,   false, false,   0},  // FlashAttention-2's shape; +3.2..+6.4%
};

template <class Elem, int kDim, bool kOneSync = false, bool kTwoBlocks = false>
struct Bwd2dConfig {
  static constexpr Bwd2dTier kTier = tier_row(kBwd2dTiers, kDim);
  static constexpr bool kServed = sizeof(Elem) == 2 && kTier.dim != 0 &&
                                  (!kOneSync || kTier.one_sync != OneSync::none) &&
                                  (!kTwoBlocks || (kTier.two_blocks && !kOneSync));
  static constexpr int64_t kTwoBlocksMaxLen = 1024;  // longer walks pay twice the dQ atomics and Q / dO copies per key
  static constexpr bool kRing3 = kOneSync && kTier.one_sync == OneSync::ring3, kTracked = kOneSync && !kRing3;
  static constexpr int kQBufs = kRing3 ? 3 : 2, kPBufs = kOneSync ? 2 : 1;  // Q / dO and P / dS buffers
  static constexpr int kWarps = kTwoBlocks ? 4 : 8, kThreads = 32 * kWarps;
  static constexpr int kBN = kTwoBlocks ? 64 : kTier.keys, kBM = kTier.rows;
  // Warps across the keys in S / dP and in dK / dV: each takes 32 keys.
  static constexpr int kKeyWarps = kBN / 32;
  // dQ warp grid: kWarps / kDqColWarps x kDqColWarps (rows x dims), 2 x 4 or 4 x 2: the one with
  // fewer fragment loads per product step (a warp loads rows / 16 A and dims / 16 B fragments),
  // where a warp's dims are a whole number of 16-wide atom pairs.
  static constexpr int dq_loads(int col_warps) { return kBM / (kWarps / col_warps) / 16 + kDim / col_warps / 16; }
  static constexpr int kDqColWarps = (kDim / 4) % 16 == 0 && dq_loads(4) < dq_loads(2) ? 4 : 2;
  static constexpr bool kSwizzle = kTier.swizzle;
  static constexpr int kLd = kSwizzle ? kDim : kDim + 8;  // K, V, Q, dO rows
  static constexpr bool kSlabStats = kTier.slab_stats;
  static constexpr bool kSwizzleP = kOneSync || kTwoBlocks;  // P, dS tiles swizzled instead of padded
  static constexpr int kLdP = kSwizzleP ? kBN : kBN + 8;     // P, dS rows (one per query)
  static constexpr int kStatsBufs = kTwoBlocks ? 1 : kQBufs;  // LSE / D buffers
  // The grid's last wave split into parts of walks (tail_split.cuh; plain non-causal calls), and for
  // plain causal calls the last pairs' walks heaviest first (causal_order.cuh). Not in kTwoBlocks: its
  // short walks rarely reach a split, and the split's bounds cost its loop 0.9-1.5%.
  static constexpr bool kTailSplit = !kTwoBlocks;
  static constexpr bool kStmatrixStores = kTier.stmatrix || kOneSync;  // swizzled P / dS: no other store path
  static constexpr int kFmaExpEvery = kTier.fma_exp_every;
  // Where the LSE / D area starts, and the two mbarriers (kTracked) after it.
  static constexpr size_t kStatsOffset = size_t((2 * kBN + 2 * kQBufs * kBM) * kLd + 2 * kPBufs * kBM * kLdP) * sizeof(Elem);
  static constexpr size_t kSmemBytes = kStatsOffset + 2 * kStatsBufs * kBM * sizeof(float) + (kTracked ? 2 * sizeof(uint64_t) : 0);
  static_assert(!((kOneSync || kTwoBlocks) && kServed) || kStmatrixStores, "the swizzled P / dS are stored with stmatrix");
};

// ---- Decode (fwd_decode.cuh) --------------------------------------------------------------------

// Packed query rows of a block: two row groups of 16. A block with more than 16 rows pairs its warps, each
// pair on one row group over half of every tile's keys, so that a GQA / MQA group of up to 32 rows reads
// each K / V tile once (two 16-row blocks read each twice: 1.3x the time of a GQA step of as many bytes).
constexpr int kDecodeChunkRows = 32;
constexpr int kDecodeSmallChunkRows = kDecodeChunkRows / 2;  // one row group: calls of few key tiles

// Decode steps whose walks run as thread block clusters on sm_90 (decode_launch.cuh says which): at most
// kDecodeMaxClusterParts parts (twice the portable cluster size: opted into with
// cudaFuncAttributeNonPortableClusterSizeAllowed; the occupancy calculator says whether a GPU takes it).
constexpr int64_t kDecodeMaxClusterParts = 16;

template <class Elem, int kDim>
struct DecodeConfig {
  static constexpr bool kServed = sizeof(Elem) == 2;
  static constexpr int kWarps = 4, kThreads = 32 * kWarps;
  static constexpr int kRows = kDecodeChunkRows, kWarpRows = 16;  // the block's rows; a warp's (m16)
  static constexpr int kWarpKeys = 16;            // a warp's keys of a tile: one P V k-step
  static constexpr int kBN = kWarps * kWarpKeys;  // keys per tile
  // K / V tiles in flight: three stages where two blocks per SM still fit (dims <= 128), two above.
  static constexpr int kStages = kDim <= 128 ? 3 : 2;
  // The deep ring of a call that runs one block an SM (decode_launch.cuh): six stages at dims 96 / 128 (200 KB of
  // smem at dim 128), where one block alone keeps as many bytes in flight as two of three stages; none elsewhere.
  static constexpr int kDeepStages = kDim > 64 && kDim <= 128 ? 6 : kStages;
  // Blocks per SM the registers are budgeted for (named to ptxas): at dims 128 / 256 those the smem allows on
  // sm_90 (228 KB); three at dims <= 64. Without it ptxas capped dim 128 at 168 registers (three blocks' worth)
  // and spilled.
  static constexpr int kBlocksPerSm = kDim <= 64 ? 3 : kDim <= 128 ? 2 : 1;
  // Swizzled rows at the tiers where the forward's are.
  static constexpr bool kSwizzle = tier_row(kFwdHalfTiers, kDim).swizzle;
  static constexpr int kLd = kSwizzle ? kDim : kDim + 8;
  static constexpr int kOLd = kDim + 8;  // fp32 pitch of the warps' rows in the merge
  static constexpr size_t kQBytes = size_t(kRows) * kLd * sizeof(Elem);
  static constexpr size_t kv_bytes(int stages) { return size_t(2 * stages) * kBN * kLd * sizeof(Elem); }
  static constexpr size_t kKvBytes = kv_bytes(kStages);
  // The merge's rows (O, then max and sum per row) reuse the K / V buffers.
  static constexpr size_t kMergeBytes = size_t(kWarps) * kWarpRows * (kOLd + 2) * sizeof(float);
  static_assert(kMergeBytes <= kKvBytes, "the merge fits in the K / V buffers");
  // A clustered walk's rows as their owners receive them, after the warps' rows: a slot per (owned row, part),
  // slot (row / parts) * parts + part in block row % parts, O [kClusterSlots][kDim], then the slots' max and sum.
  static constexpr int kClusterSlots = kRows + int(kDecodeMaxClusterParts) - 1;
  static constexpr size_t kClusterSlotBytes = size_t(kClusterSlots) * (kDim + 2) * sizeof(float);
  static_assert(kMergeBytes + kClusterSlotBytes <= kKvBytes, "a cluster's slots fit beside the warps' rows");
  static constexpr size_t kSmemBytes = kQBytes + kKvBytes;
  static constexpr size_t kDeepSmemBytes = kQBytes + kv_bytes(kDeepStages);
};

// Calls the decode kernel takes: fp16 / bf16 calls with no optional feature but a KV cache's own
// (per-sequence key ranges, pages) whose query rows are few (a decode or speculative step; the
// plain kernel's 128-row tiles compute 128 rows for each) and whose group packs into at most
// kDecodeMaxChunks chunks of 32 rows.
constexpr int64_t kDecodeMaxLenQ = 16, kDecodeMaxChunks = 2;
inline bool decode_call(const FwdParams& p) {
  return !p.has_features_beyond_key_ranges() && p.len_q <= kDecodeMaxLenQ &&
         p.len_q * p.group() <= kDecodeChunkRows * kDecodeMaxChunks;
}

}  // namespace flashattn::cuda::sm80
