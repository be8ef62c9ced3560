// Tile shapes of the Hopper kernels per element type and head-dim tier, and the shortest walks each
// is taken for. Plain C++ (no CUDA header): the kernel plan (../plan.cpp) reads the sizes too.
#pragma once
#include <cstddef>
#include <cstdint>

namespace flashattn::cuda::sm90 {

// The head-dim tiers the wgmma forward has (fp16 / bf16 at 64, 96, 128 and 256).
template <class Elem, int kDim>
constexpr bool kFwdWgmmaTier = sizeof(Elem) == 2 && (kDim == 64 || kDim == 96 || kDim == 128 || kDim == 256);

// The float8 (e4m3) forward's tier: dim 128, V given transposed (fwd_ws_sm90.cuh).
template <class Elem, int kDim>
constexpr bool kFwdFp8Tier = sizeof(Elem) == 1 && kDim == 128;

// The bias a variant of the Hopper kernels adds: none, a key vector (FwdParams::key_vector_bias), or rows
// of a bias over (query, key) pairs (forward: tiles copied by TMA, FwdParams::tma_row_bias; backward: values
// loaded into registers per query tile).
enum class BiasForm : int { kNone, kKeyVector, kRows };

// Where the row form runs (the dims where it measured faster than the sm80/ kernels; the forward's two
// stages of bias tiles fit beside two consumers' tiles); other dims send such a bias to sm80/.
template <class Elem, int kDim, int kConsumers = 2>
constexpr bool kFwdRowBiasTier = sizeof(Elem) == 2 && kConsumers == 2 && (kDim == 64 || kDim == 128 || kDim == 256);
template <int kDim>
constexpr bool kBwdRowBiasTier = kDim == 128 || kDim == 256;

template <class Elem, int kDim, int kConsumersT = 2, BiasForm kBiasT = BiasForm::kNone>
struct FwdWsConfig {
  // Consumers of 64 rows each: two, or three at dim 64 (where one 128 x 128 tile's exponentials take
  // as long as its products, so that a consumer's softmax runs under two others' products). At 128
  // and 256 O alone takes 64 / 128 registers of a consumer thread, more than three consumers' share of
  // the pool leaves for S and P.
  static constexpr int kConsumers = kConsumersT;
  static constexpr bool kFp8 = sizeof(Elem) == 1;
  static constexpr bool kServed =
      (kFwdWgmmaTier<Elem, kDim> && (kConsumers == 2 || kDim == 64)) || (kFwdFp8Tier<Elem, kDim> && kConsumers == 2);
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // Dim 256: 64-key tiles (O takes 128 registers of a consumer thread, S 32) and one Q buffer (a 64 KB
  // tile, released early: kEarlyQRelease). Three consumers: 128-key tiles (S, P and O fit their 160 registers
  // in the key loop; 68 B of spills at the item's end), 96-key tiles with a key-vector bias (440 B at 128).
  // Float8: 192-key tiles (fewer row reductions, rescales and turns per key: its softmax, not its products,
  // bounds it; S, P and O take 96 + 24 + 64 registers).
  static constexpr int kBM = 64 * kConsumers, kStages = 2;
  static constexpr int kBN = kFp8 ? 192 : kDim == 256 ? 64 : kConsumers == 3 && kBiasT != BiasForm::kNone ? 96 : 128;
  // Bias rows (BiasForm::kRows): one Q buffer at 128 too, so that two stages of bias tiles fit.
  static constexpr bool kRowBias = kBiasT == BiasForm::kRows;
  static_assert(!kRowBias || kFwdRowBiasTier<Elem, kDim, kConsumersT>, "the row form runs at dims 64, 128, 256");
  static constexpr int kQBuffers = kDim == 256 || (kRowBias && kDim == 128) ? 1 : 2;
  // One Q buffer: the consumers release it once the item's last S is done and write the output from
  // their registers (no staging through Q), so the next item's Q and first K tile load under this item's
  // last P V and its stores instead of after them (the gap that each item otherwise waits out).
  static constexpr bool kEarlyQRelease = kQBuffers == 1;
  // The tiles' dims in smem: panels of 128-byte lines, 64 16-bit or 128 8-bit columns (dim 96: two, the
  // second half zero-filled by TMA). Float8: V^T tiles of kDim lines of kBN keys, as many bytes, in panels of
  // 64-byte lines (64 keys, 64-byte swizzle: kVtPanelKeys).
  static constexpr int kVtPanelKeys = 64;
  static constexpr int kPanelCols = 128 / int(sizeof(Elem));
  static constexpr int kPanels = (kDim + kPanelCols - 1) / kPanelCols, kDimPad = kPanelCols * kPanels;
  static constexpr uint32_t kQBytes = kBM * kDimPad * sizeof(Elem), kKvBytes = kBN * kDimPad * sizeof(Elem);
  // Float8: the bf16 output is staged in its own buffer (two 64-column panels of kBM lines), not in the
  // Q tile's (half its size).
  static constexpr uint32_t kOutStageOffset = kQBuffers * kQBytes + 2 * kStages * kKvBytes;
  // Bias rows: kRowBiasStages tiles of kBM rows x kBN keys after the K / V stages, each as two halves of 64
  // rows (a consumer's), in room for 16-bit values (bools take half): the TMA boxes' panels of 128-byte
  // lines (64-byte at 64 bool keys), swizzled as the maps say (key_bias.cuh: row_tile_offset).
  static constexpr int kRowBiasStages = 2;
  static constexpr uint32_t kRowBiasHalfBytes = 64 * kBN * 2, kRowBiasTileBytes = 2 * kRowBiasHalfBytes;
  static constexpr uint32_t kRowBiasOffset = kOutStageOffset;
  static constexpr uint32_t kBarOffset =
      kOutStageOffset + (kFp8 ? kBM * kDim * 2 : 0) + (kRowBias ? kRowBiasStages * kRowBiasTileBytes : 0);
  // A key-vector bias (FwdParams::key_vector_bias; fp16 / bf16): a ring of kBiasStages tiles of kBN fp32
  // values beside the mbarriers, filled by a producer warp of its own (its full and empty mbarriers after
  // the tiles), so that it runs ahead of the K / V stages by the ring's extra stages.
  static constexpr bool kKeyBias = kBiasT == BiasForm::kKeyVector;
  static constexpr int kBiasStages = 4;
  // (bias rows: a full and an empty mbarrier per stage and half after the others)
  static constexpr uint32_t kBarBytes = (4 * kStages + kQBuffers + (kRowBias ? 4 * kRowBiasStages : 0)) * 8;
  static constexpr uint32_t kBiasOffset = (kBarOffset + kBarBytes + 15) / 16 * 16;
  static constexpr uint32_t kBiasBarOffset = kBiasOffset + kBiasStages * kBN * 4;
  // The Q buffers, the K and V stages, (float8) the output's staging, the mbarriers (K / V full and empty
  // per stage, Q empty per buffer), (key-vector bias) its ring, and room to align to 1024: 97 KB at dim 64
  // (three consumers: 113 KB), 193 KB at 128 and 256, 129 KB for float8; the bias ring adds 1.1 KB (dim
  // 256) to 2.1 KB; bias rows: 161 KB of Q and K / V and 64 KB of bias tiles at 128 and 256, 225 KB in all
  // (at 64: 97 KB and 64 KB).
  static constexpr size_t kSmemBytes =
      (kKeyBias ? kBiasBarOffset + 2 * kBiasStages * 8 : kBarOffset + kBarBytes) + 1024;
  // Registers per thread after the hand-over (128 x producer + 128 x kConsumers x consumer <= 65536, the
  // launch's pool; the consumers need ~230 at dim 128).
  static constexpr int kProducerRegs = 24, kConsumerRegs = kConsumers == 3 ? 160 : 240;
  // An item's last P V issued with the next item's S 0 (fwd_ws_kernel's consumers): at dim 128 the two
  // items' state does not fit in 240 registers (376 B of spills); three consumers: slower (fewer
  // registers), and without it a consumer with no rows in an item (at a sequence's end) skips its products.
  static constexpr bool kCarryAcrossItems = (kDim == 64 && kConsumers == 2) || kFp8;
  // The consumers keep their work item in 32-bit fields (FwdKeys) where that measured faster: three
  // consumers (the full item spills in their 160 registers: -5..-8% at L >= 4096) and dim 256 (+2..6%);
  // at 128 the full one (the compact one measured -10..-13% at L <= 1024); bias rows at 128 the compact one
  // (ptxas: 268 B of spill stores against 308 B).
  static constexpr bool kCompactItems = kConsumers == 3 || kDim == 256 || kRowBias;
  // Taken where rows see at least kMinKeys keys, on causal grids kMinCausalKeys on average: below, the
  // block's first S and last P V, which nothing overlaps, cost more than the products gain against the
  // sm80/ kernels (measurements: docs/kernels/sm90_forward_ws.md).
  static constexpr int64_t kMinKeys = 512;
  static constexpr int64_t kMinCausalKeys = kDim == 64 || kDim == 256 ? 256 : 0;
  // Causal grids larger than the GPU whose heads have at most this many query tiles run persistent, each
  // block taking a heavy and a light tile in turn (schedule/causal_order.cuh: fwd_paired_block), where
  // that measured faster than a block per tile: with two Q buffers (the next item's Q and first K / V
  // tiles load under this item), most at dim 64, whose items also carry into each other. H100, bf16,
  // causal, B.L = 16k, H.E = 2048: dim 128 L = 512 / 1024 +12..16% / +5..8%, 2048 even, 4096 -4%;
  // dim 64 (two consumers) L = 2048 +7% over the sm80/ kernel that took it; dim 256 (one Q buffer)
  // and three consumers lost (-3..-11%). Configurations with 0 compile without the walk (FwdTile's kPairs).
  static constexpr int64_t kPairedMaxTiles = kConsumers == 3 || kQBuffers == 1 ? 0 : kCarryAcrossItems ? 16 : 8;
  // Dim 64: three consumers where rows see at least this many keys (on average, causal); two below, where
  // 192-row items leave more of the last item of each head idle and the block's first and last products
  // weigh more.
  static constexpr int64_t kThreeConsumerKeys = 2048;
};

// The warp-specialized dK/dV kernel (bwd_sm90.cuh): key blocks walking query tiles, a producer warpgroup
// beside two consumers.
template <class Elem, int kDim>
struct BwdWsConfig {
  static constexpr bool kServed = sizeof(Elem) == 2 && (kDim == 64 || kDim == 96 || kDim == 128 || kDim == 256);
  static constexpr int kConsumers = 2;
  // The tiles' dims in smem: panels of 64 (dim 96: two, the second half zero-filled by TMA).
  static constexpr int kPanels = (kDim + 63) / 64, kDimPad = 64 * kPanels;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // At 64 and 128 each consumer owns 64 keys of a 128-key block and all their dims. At 256 dK and dV of
  // 64 keys take 128 registers of a consumer thread each, so the consumers split the dims of a 64-key
  // block instead: consumer 0 computes S^T, consumer 1 dP^T, and each hands its P^T / dS^T to the other
  // through smem.
  static constexpr bool kSplitDims = kDim == 256;
  // Query tiles of 128 rows at dim 64 (S^T / dP^T at m64n128 per consumer: fewer, fuller products per
  // exponential), 64 at 96, 128 and 256 (dK and dV take 96 / 128 registers there).
  static constexpr int kBN = kSplitDims ? 64 : 128, kBM = kDim == 64 ? 128 : 64;
  static constexpr uint32_t kKvBytes = kBN * kDimPad * 2, kQBytes = kBM * kDimPad * 2, kDsBytes = kBN * kBM * 2;
  // K, V, two stages of Q and dO, two dS^T buffers, (split dims) two P^T buffers, (else) one fp32 dQ
  // tile, LSE / D of two stages, the mbarriers, and room to align to 1024 bytes: 194 KB at 64 and 128,
  // 186 KB at 96, 226 KB at 256, where dQ has no room and goes out with the consumers' atomics.
  static constexpr uint32_t kDsOffset = 2 * kKvBytes + 4 * kQBytes;
  static constexpr uint32_t kPOffset = kDsOffset + 2 * kDsBytes;
  static constexpr uint32_t kDqOffset = kPOffset + (kSplitDims ? 2 * kDsBytes : 0);
  static constexpr uint32_t kStatsOffset = kDqOffset + (kSplitDims ? 0 : kBM * kDim * 4);
  static constexpr uint32_t kBarOffset = kStatsOffset + 2 * 2 * kBM * sizeof(float);
  static constexpr size_t kSmemBytes = kBarOffset + 8 * 8 + 1024;
  // Registers per thread after the hand-over (128 x 24 + 256 x 240 <= 384 x 168, the launch's pool).
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
};

}  // namespace flashattn::cuda::sm90
