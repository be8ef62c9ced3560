// Tile shapes of the tensor-core kernels per element type and head-dim tier. Plain C++ (no CUDA
// header): the kernel plan (../plan.cpp) reads their shared-memory sizes too.
//
// Shapes (measured on the H200; see docs/kernels/sm80_forward.md and sm80_backward.md):
//   fp16/bf16: 4 warps x 32 query rows (B fragments serve two row groups), 2 blocks per SM;
//              64-key tiles up to dim 128 (with 64 instead of 32 keys the forward measured
//              19-24% faster at dim 96, 5-9% at 128). The feature variant keeps 32-key tiles
//              above dim 64. The plain variant up to dim 64 takes 128-key tiles (than 64: 9-10%
//              faster at dim 32, 5-6% at 64, where Q then comes from smem per tile to stay
//              within 255 registers). 8 warps x 16 rows at 128 registers measured 1-2% slower.
//              Dims 192 and 256: 4 warps x 16 rows, 64-key tiles with one K and one V buffer
//              (kStaggered; than double-buffered 32-key tiles: +19-25% at 192, +8-14% at 256).
//              8 warps x 16 rows with double-buffered 64-key tiles (one block per SM) measured
//              +2-4% non-causal, -3-4% causal at L = 1024, and again later (with causal pairs)
//              -6% non-causal, -0..-12% causal; staggered 32-key tiles at three blocks per SM
//              -12..-18%: not kept (FlashAttention-2 runs our shape here on sm_90).
//   fp64: 16 rows per warp (the fp64 accumulators take twice the registers); dim 64: 4 warps,
//         32-key tiles (2 blocks per SM); dim 128: 8 warps, 16-key tiles (1 block per SM, 8
//         warps to hide the DMMA latency).
#pragma once
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../../params.h"

namespace flashattn::cuda::sm80 {

// kFeatures: the variant with the optional features keeps 32-key tiles above dim 64 (its
// per-row feature work spills with 64: 96 B at dim 96, 180 B at 128).
// One query tile per block (a causal grid's last heads in the order of causal_order.cuh).
template <class Elem, int kDim, bool kFeatures = false>
struct FwdConfig {
  static constexpr bool kHalf = sizeof(Elem) == 2;
  static constexpr bool kDouble = std::is_same_v<Elem, double>;
  static constexpr int kWarps = kDouble && kDim > 64 ? 8 : 4;
  static constexpr int kMW = kHalf && kDim <= 128 ? 2 : 1;  // 16-row groups per warp
  // Above dim 128 the plain variant takes 64-key tiles with one K and one V buffer, loaded in
  // turn (FlashAttention-2's scheme): double-buffered, they would leave one block of 4 warps per SM.
  static constexpr bool kStaggered = kHalf && kDim > 128 && !kFeatures;
  static constexpr int kBN = kDouble ? (kDim > 64 ? 16 : 32) : ((kFeatures && kDim > 64) ? 32 : !kFeatures && kDim <= 64 ? 128 : 64);
  // Full K and V tiles copied without per-chunk predicates (copy_tile_async) at dim 64: +2-3%
  // there; at 96, 128 and 192 measured 1-6% slower with padded tiles, at 256 +-1% (H200, bf16).
  // With swizzled tiles: plain dim 128 +1.2..+3.5%, 256 -2..+2% (not taken); the dim-128 feature
  // variant (32-key tiles) keeps the predicated copies (not measured with these).
  static constexpr bool kFullTileCopies = kHalf && (kDim == 64 || (kDim == 128 && !kFeatures));
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBM = 16 * kMW * kWarps;
  // The plain fp16 / bf16 kernel at dim 128 splits the walks of a grid's last wave (key_split.cuh).
  // At the other dims the split's code moved the key loop's registers (spills at 96): -1..-7% on
  // whole walks (H200, bf16); dim 128's loop measured the same, +2.4 / +5.3% at L = 8192 / 16384.
  static constexpr bool kKeySplit = kHalf && !kFeatures && kDim == 128;
  // At dims 64 and 256 a second instantiation with the split's code serves grids smaller than the
  // GPU (every walk in parts: decode steps, small batches), the plain kernel every other grid. (Dims
  // 32, 96 and 192 split no walk: their decode steps run one block per head.)
  static constexpr bool kSplitKernel = kHalf && !kFeatures && (kDim == 64 || kDim == 256);
  // Q, K and V swizzled instead of padded (tile_copy.cuh) at dims 64, 128 and 256: the copies then
  // read no excess L2 sectors; forward +4-6% at 64 and 128, +10-15% at 256 (H200, bf16). At 192
  // (rows of 24 chunks, copied by a walk over the tile's chunks) it measured -3..+4%: padded.
  static constexpr bool kSwizzle = kHalf && (kDim == 64 || kDim == 128 || kDim == 256);
  static constexpr int kLd = kSwizzle ? kDim : kDim + 8;  // smem row pitch in elements
  static constexpr size_t kSmemBytes = size_t(kBM + (kStaggered ? 2 : 4) * kBN) * kLd * sizeof(Elem);
  static_assert(kDim % 16 == 0 && kBN % 16 == 0, "products step over pairs of 8-wide atoms");
};

// Backward (dK/dV kernel): 16 keys per warp group, query tiles of kBM rows. Where dK and dV of
// the full dim would not fit in one warp's registers (fp16/bf16 above 192, the general variant
// above 128, fp64 above 64), two warps share each 16-key group (kPair = 2): each reduces S^T
// and dP^T over half the dims, the halves are summed through smem, and each keeps dK, dV for
// half the columns. (Before, two blocks split the columns and both computed S and dP in full:
// 1.4x the MMA work.) At dim 192 dK and dV of the full dim take 192 registers and spill 116
// bytes, and measured 1.23-1.39x faster than the column split (H200, bf16).
// The variant with the general feature step (kGeneral: softcap, ALiBi, dropout, bias gradient)
// takes half the query rows per tile and one block per SM where the plain one is at its register
// limit: that step needs registers beside dK and dV (measured: 1116 bytes of spills at dim 128
// with 64-row tiles, 140 with 32).
// kCompact (fp16/bf16 above dim 96, with kGeneral): the last tensor-core variant, for GPUs whose
// blocks get 99 KB of smem (sm_86/89/120), where none of the above fits above dim 96: 4 warps
// and 32-row query tiles (16 above dim 128), 74 / 56 / 72 KB at dims 128 / 192 / 256. The SIMT
// kernel that served those calls before was 11x slower (H100 capped to 99 KB), and its fp32 FMA
// scores differ by a few ulps from the tensor-core forward's that the LSE came from (at logits
// ~1e4 fp16 then missed the accuracy rule).
template <class Elem, int kDim, bool kGeneral = false, bool kCompact = false>
struct BwdConfig {
  using Acc = std::conditional_t<std::is_same_v<Elem, double>, double, float>;
  static constexpr bool kHalf = sizeof(Elem) == 2;
  static constexpr bool kDouble = std::is_same_v<Elem, double>;
  static constexpr bool kServed = !(kDouble && kDim > 128) && (!kCompact || (kHalf && kGeneral && kDim > 96));
  static constexpr int kPair = kDim > 192 || (kGeneral && kDim > 128) || (kDouble && kDim > 64) ? 2 : 1;
  static constexpr int kDimOut = kDim / kPair;  // dK / dV columns of a warp (and its share of the reduction)
  // fp64 at dim 64: 8 warps (128 keys) with 16-row query tiles, one block of 8 warps per SM
  // instead of 4 (the DMMA latency wants more warps): +9-11% measured (H200).
  static constexpr int kWarps = !kCompact && (kHalf || (kDouble && kDim <= 64 && !kGeneral)) ? 8 : 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBN = 16 * kWarps / kPair;
  // fp16/bf16 at dim 64: 32-row query tiles keep a thread within 128 registers, so two
  // blocks (16 warps) share an SM.
  // fp64 at dim 128: 16-row query tiles, so K, V and two stages of Q, dO fit in smem.
  static constexpr int kBM = kDouble ? (kDim > 64 || kGeneral || kWarps == 8 ? 16 : 32)
                                     : kCompact ? (kDim > 128 ? 16 : 32)
                                                : (kDim > 64 && kDim <= 128 && !kGeneral ? 64 : 32);
  static constexpr int kMinBlocks = kHalf && kDim <= 64 && !kGeneral ? 2 : 1;
  static constexpr int kLd = kDim + 8;   // K, V, Q, dO rows
  static constexpr int kLdS = kBM + 8;   // dS^T rows (one per key)
  // Warp pairs exchange their partial S^T and dP^T: 2 x kBM / 8 accumulator atoms per lane.
  static constexpr size_t kExchangeBytes = kPair > 1 ? size_t(kWarps) * 32 * 2 * (kBM / 8) * 4 * sizeof(Acc) : 0;
  static constexpr size_t kSmemBytes =
      size_t((2 * kBN + 4 * kBM) * kLd + kBN * kLdS) * sizeof(Elem) + 4 * kBM * sizeof(Acc) + kExchangeBytes;
};

// Backward with a 2-D warp layout (bwd_sm80_2d.cuh; fp16/bf16 calls without the general
// per-score step; with a bias, its two tiles come on top of kSmemBytes): 8 warps. Up to dim 128:
// 128 keys per block, 64-row query tiles (128 at dim 64, which the first version ran with 64
// rows: 6-11% slower than the 1-D kernel); S and dP on a 2 x 4 warp grid of kBM / 2 rows x 32
// keys, dK/dV on 4 x 2 warps of 32 keys x half the dims. Dim 256 (FlashAttention-2's shape
// there): 64 keys x 64 rows, S and dP on 4 x 2 warps of 16 rows x 32 keys, dK/dV on 2 x 4
// warps of 32 keys x a quarter of the dims (dK and dV then take 128 registers, as at dim 128).
// P and dS go through smem once per tile; dQ on 2 x 4 or 4 x 2 warps (kDqColWarps). Fewer ldmatrix per MMA than BwdConfig's 1-D layout (counted per warp and tile: dim
// 128 152 / 320 against 184 / 320; dim 64 with 128-row tiles 168 / 320 against 56 / 80).
// Measured (H200, bf16): backward +3-12% at dim 64, +7-11% at 128, +15-22% at 256.
// kOneSync: one barrier per query tile instead of two (bwd_sm80_2d.cuh): P / dS in two buffers,
// swizzled (rows of kBN elements), and Q / dO (with their LSE and D) either in a ring of three
// buffers loaded two tiles ahead (kRing3: dims 96, 128) or in two buffers whose copies mbarriers
// track (kTracked: dim 256; the walk waits for a tile's copies instead of holding a barrier for
// them). Plain calls only; all of it fits the 227 KB a block gets on sm_90 / sm_100 (dim 128:
// 230912 bytes; padded P / dS rows would take 235008), and the smem check sends other GPUs to the
// two-barrier kernel. Measured (H200, bf16, backward, L = 1024 ... 16384, causal and not): the
// ring +0.8..+3.0% at 128 and +3.6..+5.9% at 96, tracked +3.2..+6.4% at 256; tracked at 128
// -0.7..-1.1% against the ring, and at 64 (which the ring does not fit with 128-row tiles)
// -1.2..-2.0% against two barriers: 64 keeps them (the ring with 96-row tiles: -4..-15%).
// kTwoBlocks (dim 64, plain calls with at most kTwoBlocksMaxLen query rows, sm_90+: its swizzled
// P / dS are stored with stmatrix): half the block, two
// per SM: 4 warps and 64 keys (S / dP, dK / dV and dQ on 2 x 2 warps), P / dS swizzled, one LSE /
// D buffer (the next tile's load after the P / dS barrier, where no warp reads this one any more):
// 115712 B, half an SM's 228 KB less the 1 KB each block reserves. Each block's barriers then
// stall only its own 4 warps. Measured against the 8-warp kernel (H200, bf16, backward): +5% at
// L = 512, +2.8% at 1024, +-1% at 2048 / 4096, -1.5..-4% at 8192 / 16384, where the long walks
// pay twice the dQ atomics and Q / dO copies per key.
template <class Elem, int kDim, bool kOneSync = false, bool kTwoBlocks = false>
struct Bwd2dConfig {
  // Dim 192 stays on the 1-D kernel: 64 x 64 tiles measured 3-5% slower there (H200, bf16).
  static constexpr bool kServed = sizeof(Elem) == 2 && kDim >= 64 && kDim != 192 && (!kOneSync || kDim != 64) &&
                                  (!kTwoBlocks || (kDim == 64 && !kOneSync));  // tiers 64, 96, 128, 256
  static constexpr int64_t kTwoBlocksMaxLen = 1024;
  static constexpr bool kRing3 = kOneSync && (kDim == 128 || kDim == 96), kTracked = kOneSync && !kRing3;
  static constexpr int kQBufs = kRing3 ? 3 : 2, kPBufs = kOneSync ? 2 : 1;  // Q / dO and P / dS buffers
  static constexpr int kWarps = kTwoBlocks ? 4 : 8, kThreads = 32 * kWarps;
  static constexpr int kBN = kDim <= 128 && !kTwoBlocks ? 128 : 64, kBM = kDim <= 64 ? 128 : 64;
  // Warps across the keys in S / dP and in dK / dV: each takes 32 keys.
  static constexpr int kKeyWarps = kBN / 32;
  // dQ warp grid: kWarps / kDqColWarps x kDqColWarps (rows x dims), 2 x 4 or 4 x 2: the one with
  // fewer fragment loads per product step (a warp loads rows / 16 A and dims / 16 B fragments;
  // dim 64: 4 x 2, 4 loads against 5, and FlashAttention-2's grid there), where a warp's dims are
  // a whole number of 16-wide atom pairs (dim 96: 4 x 2).
  static constexpr int dq_loads(int col_warps) { return kBM / (kWarps / col_warps) / 16 + kDim / col_warps / 16; }
  static constexpr int kDqColWarps = (kDim / 4) % 16 == 0 && dq_loads(4) < dq_loads(2) ? 4 : 2;
  // K, V, Q and dO swizzled instead of padded (tile_copy.cuh) at dims 64, 128 and 256: the
  // copies then read no excess L2 sectors and write no excess smem wavefronts (ncu at dim 64:
  // 8.9 wavefronts per padded copy instruction against 4); backward +2-4% at 128, +2-3% at 256,
  // +3.5-4% at 64 on top of the 4 x 2 dQ grid and SlabStats (H200, bf16; before those, 64
  // measured -1..0%). 96 stays padded: its rows are not whole lines.
  static constexpr bool kSwizzle = kDim == 64 || kDim == 128 || kDim == 256;
  static constexpr int kLd = kSwizzle ? kDim : kDim + 8;  // K, V, Q, dO rows
  // LSE and D read as one 16-byte chunk per row group (bwd_sm80_2d.cuh's SlabStats) at dim 64:
  // with the 4 x 2 dQ grid +5-6% there; at 128 and 256 it measured -1% (H200, bf16), so those
  // read row by row.
  static constexpr bool kSlabStats = kDim == 64;
  static constexpr bool kSwizzleP = kOneSync || kTwoBlocks;  // P, dS tiles swizzled instead of padded
  static constexpr int kLdP = kSwizzleP ? kBN : kBN + 8;     // P, dS rows (one per query)
  static constexpr int kStatsBufs = kTwoBlocks ? 1 : kQBufs;  // LSE / D buffers
  // The grid's last wave split into parts of walks (tail_split.cuh; plain non-causal calls), and
  // for plain causal calls the last pairs' walks heaviest first (causal_order.cuh; the 1-D
  // kernel orders them too). Not in
  // kTwoBlocks: it runs calls of len_q <= 1024, walks of 8 query tiles per head where the split
  // takes 16+ (only GQA groups would reach it), and its loop with the split's bounds measured
  // -0.9..-1.5% where no split was taken (H200, bf16, L = 512 causal / 1024).
  static constexpr bool kTailSplit = !kTwoBlocks;
  // P and dS stored with stmatrix (sm_90+) instead of 32-bit stores: backward +0.8..+2.4% at dims 64
  // and 128 (ncu at 64: MIO-throttle stalls 2.5x FlashAttention-2's), +0.3..+1.7% at 96, -0.3% at 256
  // (H200, bf16).
  // (kOneSync takes them at every dim: its swizzled P / dS have no other store path.)
  static constexpr bool kStmatrixStores = kDim <= 128 || kOneSync;
  // One in kFmaExpEvery of the unmasked tiles' exponentials on the FMA pipe (ExpDomain::exp_fma)
  // rather than the MUFU, whose instructions share the MIO queue with ldmatrix: at dim 64 one in 4
  // measured +0..+1.2% (one in 2: +-0.5%); at 128 both -0.4..-2%, at 256 +-0.5% (H200, bf16).
  static constexpr int kFmaExpEvery = kDim == 64 ? 4 : 0;
  // Where the LSE / D area starts, and the two mbarriers (kTracked) after it.
  static constexpr size_t kStatsOffset = size_t((2 * kBN + 2 * kQBufs * kBM) * kLd + 2 * kPBufs * kBM * kLdP) * sizeof(Elem);
  static constexpr size_t kSmemBytes = kStatsOffset + 2 * kStatsBufs * kBM * sizeof(float) + (kTracked ? 2 * sizeof(uint64_t) : 0);
  static_assert(!((kOneSync || kTwoBlocks) && kServed) || kStmatrixStores, "the swizzled P / dS are stored with stmatrix");
};

constexpr int kDecodeChunkRows = 16;  // packed query rows of a block (one row group)

template <class Elem, int kDim>
struct DecodeConfig {
  static constexpr bool kServed = sizeof(Elem) == 2;
  static constexpr int kWarps = 4, kThreads = 32 * kWarps;
  static constexpr int kRows = kDecodeChunkRows;
  static constexpr int kWarpKeys = 16;            // a warp's keys of a tile: one P V k-step
  static constexpr int kBN = kWarps * kWarpKeys;  // keys per tile
  // K / V tiles in flight: three stages where two blocks per SM still fit (dims <= 128), two above.
  static constexpr int kStages = kDim <= 128 ? 3 : 2;
  // Swizzled rows at the dims whose rows are whole 128-byte lines (as FwdConfig), else padded.
  static constexpr bool kSwizzle = kDim == 64 || kDim == 128 || kDim == 256;
  static constexpr int kLd = kSwizzle ? kDim : kDim + 8;
  static constexpr int kOLd = kDim + 8;  // fp32 pitch of the warps' rows in the merge
  static constexpr size_t kQBytes = size_t(kRows) * kLd * sizeof(Elem);
  static constexpr size_t kKvBytes = size_t(2 * kStages) * kBN * kLd * sizeof(Elem);
  // The merge's rows (O, then max and sum per row) reuse the K / V buffers.
  static constexpr size_t kMergeBytes = size_t(kWarps) * kRows * (kOLd + 2) * sizeof(float);
  static_assert(kMergeBytes <= kKvBytes, "the merge fits in the K / V buffers");
  static constexpr size_t kSmemBytes = kQBytes + kKvBytes;
  // A part's merged rows in the workspace: O [kRows][kDim], then the rows' max and sum.
  static constexpr size_t kSlotFloats = size_t(kRows) * (kDim + 2);
};

// Calls the decode kernel takes: fp16 / bf16 calls with no optional feature but a KV cache's own
// (per-sequence key ranges, pages) whose query rows are few (a decode or speculative step; the
// plain kernel's 128-row tiles compute 128 rows for each) and whose group packs into at most
// kDecodeMaxChunks chunks of 16 rows.
constexpr int64_t kDecodeMaxLenQ = 16, kDecodeMaxChunks = 4;
inline bool decode_call(const FwdParams& p) {
  return !p.has_features_beyond_key_ranges() && p.len_q <= kDecodeMaxLenQ &&
         p.len_q * p.group() <= kDecodeChunkRows * kDecodeMaxChunks;
}

}  // namespace flashattn::cuda::sm80
