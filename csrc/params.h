// Plain description of one attention call, shared by the ops and every backend.
// No torch types here: kernels include this header and nothing from torch.
#pragma once
#include <cstddef>
#include <cstdint>

namespace flashattn {

enum class DType : int { kFloat64 = 0, kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3 };

// What the attention bias tensor is: none, a bool mask (false = the score is masked out), or
// a float tensor added to the scores (SDPA's attn_mask).
enum class BiasKind : int { kNone = 0, kBool = 1, kFloat = 2 };

// Tensors are addressed as [batch][head][row][col] with element strides for the
// first three dimensions; the last dimension (head_dim) is always contiguous.
struct Strides {
  int64_t batch = 0, head = 0, row = 0;
};

struct FwdParams {
  DType dtype = DType::kFloat32;
  // Inputs in `dtype`.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  Strides q_stride, k_stride, v_stride;
  // Output in `dtype`, same addressing scheme.
  void* out = nullptr;
  Strides out_stride;
  // Row log-sum-exp (natural log), contiguous (batch, heads_q, len_q); fp64 for
  // fp64 inputs, fp32 otherwise.
  void* lse = nullptr;

  int64_t batch = 0, heads_q = 0, heads_kv = 0, len_q = 0, len_k = 0;
  int64_t head_dim = 0;    // of q and k
  int64_t head_dim_v = 0;  // of v and out (may differ from head_dim, as SDPA allows)
  double scale = 1.0;

  // Causal masking: query row i may attend to key column j iff j <= i + causal_offset.
  // Top-left alignment (SDPA is_causal) has offset 0, bottom-right alignment
  // (flash-attn causal) has offset len_k - len_q.
  bool causal = false;
  int64_t causal_offset = 0;

  // ---- Optional features, each off at its default. A backend must not be called with a
  // feature it does not implement (the ops refuse such calls); the per-score math they share
  // lives in csrc/common/ so that every backend computes the same scores and dropout masks.
  // Order on each score: s = scale q.k; softcap; + ALiBi; + bias; band and bias masks -> -inf;
  // softmax; dropout of the probabilities.

  // Bias / mask (SDPA attn_mask) broadcast to (batch, heads_q, len_q, len_k) through element
  // strides (0 along broadcast dimensions), read in place. A float bias is in bias_dtype.
  BiasKind bias_kind = BiasKind::kNone;
  DType bias_dtype = DType::kFloat32;
  const void* bias = nullptr;
  int64_t bias_stride[4] = {0, 0, 0, 0};

  // Sliding window, aligned bottom-right as flash-attn's: query row i sees key j only if
  // i + len_k - len_q - window_left <= j <= i + len_k - len_q + window_right; -1 = unbounded.
  int64_t window_left = -1, window_right = -1;

  // ALiBi: -slope * |i + len_k - len_q - j| added to each score, slope (fp32) at
  // alibi_slopes[b * alibi_batch_stride + h] (stride 0: one slope per head for the batch).
  const float* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;

  // Softcap: s = softcap * tanh(s / softcap) on the scaled scores; 0 = off.
  double softcap = 0.0;

  // Dropout of the attention probabilities (kept ones scaled by 1 / (1 - p)); the keep mask is
  // a function of (seed, offset, batch, head, row, column) alone (common/dropout.h). The seed
  // and offset come by value, or, when dropout_state is set, as int64 [seed, offset] in the
  // tensors' device memory (drawn there by torch's generator: a CUDA graph redraws it on every
  // replay); CUDA kernels then read them from there.
  double dropout_p = 0.0;
  uint64_t dropout_seed = 0;
  uint32_t dropout_offset = 0;
  const int64_t* dropout_state = nullptr;

  // Variable-length batch (cu_seqlens_q != null): q, k, v, out are (1, heads, total, dim) and
  // sequence b holds rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q/out and
  // [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k/v (int32, on the tensors' device). `batch` is
  // the number of sequences, len_q / len_k the longest ones, total_q the rows of q; lse is
  // (1, heads_q, total_q). Causal and window offsets are taken per sequence, the causal one
  // bottom-right when causal_bottom_right (else top-left). Offsets are clamped to the tensors'
  // rows (total_q, total_k) and lengths to len_q / len_k where they are read (sequence()), so that
  // offsets that were not checked on the host (CUDA-graph capture) never address memory outside q, k, v.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t total_q = 0, total_k = 0;
  bool causal_bottom_right = false;

  // Per-sequence key ranges of a padded batch (seqused_k != null; int32 (batch,), on the tensors'
  // device), flash-attn's seqused_k / leftpad_k: sequence b's keys are rows
  // [leftpad_k[b], seqused_k[b]) of k / v (from row 0 when leftpad_k is null), so its own key
  // length is seqused_k[b] - leftpad_k[b], and causal (bottom-right when causal_bottom_right),
  // window and ALiBi are aligned against that length. `len_k` stays the rows of k / v (the longest
  // possible sequence, which sizes grids and splits: the values are never read on the host).
  // Clamped where read (sequence()) to 0 <= leftpad_k <= seqused_k <= len_k.
  const int32_t* seqused_k = nullptr;
  const int32_t* leftpad_k = nullptr;
  // Optional (a KV-cache step whose append is the kernel before this call; CUDA): the lengths the append read. It
  // writes seqused_k[b] = seqused_before[b] + seqused_added for every sequence it allows (-1 for the others) and, in
  // the caches, only the rows from seqused_before[b] on: the decode kernel reads the rows below, the lengths and q
  // (unless q_from_prior: a rotary step's q, which the append rotates) before it waits for the append.
  const int32_t* seqused_before = nullptr;
  int64_t seqused_added = 0;
  bool q_from_prior = false;
  // Optional (a KV-cache step that the decode kernel appends itself; CUDA): new_rows rows of new_k / new_v
  // ((batch, new_rows, heads_kv, dim), strides as k's) for each sequence, written into k / v (the caches) at rows
  // seqused_k[b] ... by the kernel, which attends them with the rest: sequence b's keys end at seqused_k[b] +
  // new_rows. The append's rules hold: a sequence whose leftpad_k exceeds seqused_k, whose end passes len_k or one
  // of whose pages names a block outside [0, num_blocks) writes nothing, and its rows are NaN.
  const void* new_k = nullptr;
  const void* new_v = nullptr;
  Strides new_k_stride, new_v_stride;
  int64_t new_rows = 0;

  // Paged k / v (block_table != null: a KV cache in pages). k and v hold num_blocks blocks of
  // page_size rows, addressed [block][head][row] through k_stride / v_stride (the batch stride
  // steps blocks). Key row j of sequence b (counted from the start of its cache, leftpad_k
  // included) is row j % page_size of block block_table[b * block_table_stride + j / page_size]
  // (int32, on the tensors' device); len_k = pages per sequence x page_size. Blocks are clamped
  // into [0, num_blocks) where read (common/pages.h), so unchecked values never address memory
  // outside k / v. Only the decode kernel reads pages in place; for every other kernel the
  // backend first gathers them into the workspace as a padded batch (common/pages.h).
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0, page_size = 0, num_blocks = 0;
  // Optional (a read-only KV-cache step with no append before it; CUDA, the decode kernel): the append's page rule
  // applied where the pages are read. A table entry outside [0, num_blocks) for a key of the sequence's range
  // [leftpad_k, seqused_k) makes its rows NaN, as the append's seqused -1 would; the entries of the other pages
  // are never read, so they may hold anything (-1).
  bool check_pages = false;

  // Scratch of `workspace_bytes` bytes, as the backend sized it for the call's kernels (none: null);
  // its contents on entry are undefined.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  // Float8 (e4m3) calls only (cuda::run_fwd_fp8): q and k hold float8 values, v holds V^T (batch,
  // heads_kv, head_dim, keys rounded up to 16, each 16 keys in the kernel's order: sm90/fwd_rows.cuh)
  // and out is bf16; per (batch, kv head), contiguous float32 (batch, heads_kv): the factor of the
  // scores (q_descale * k_descale, times `scale`) and of the output (v_descale).
  const float* qk_descale = nullptr;
  const float* v_descale = nullptr;

  int64_t group() const { return heads_q / heads_kv; }  // query heads per kv head (GQA)
  bool has_window() const { return window_left >= 0 || window_right >= 0; }
  bool is_varlen() const { return cu_seqlens_q != nullptr; }
  bool has_key_ranges() const { return seqused_k != nullptr; }
  bool is_paged() const { return block_table != nullptr; }
  // The bias is a key vector: one value per key of a batch, broadcast over the query heads and rows
  // (SDPA's key padding mask, (batch or 1, 1, 1, len_k)), which the Hopper kernels take.
  bool key_vector_bias() const { return bias_kind != BiasKind::kNone && bias_stride[1] == 0 && bias_stride[2] == 0; }
  // A bias of rows the Hopper forward copies tile by tile with TMA (BiasForm::kRows): not a key vector,
  // bool or float in the inputs' 16-bit dtype (float32 goes to the sm80/ kernels), a row dimension of its
  // own (row stride not 0: TMA does not repeat a row), keys contiguous, and its base and the strides of the
  // dims it does not broadcast 16-byte aligned (what a tensor map encodes).
  bool tma_row_bias() const {
    if (bias_kind == BiasKind::kNone || key_vector_bias()) return false;
    const bool half = dtype == DType::kFloat16 || dtype == DType::kBFloat16;
    if (bias_kind == BiasKind::kFloat && (bias_dtype != dtype || !half)) return false;
    const int64_t bytes = bias_kind == BiasKind::kBool ? 1 : 2;
    auto aligned = [&](int64_t stride) { return stride * bytes % 16 == 0; };
    return bias_stride[3] == 1 && bias_stride[2] != 0 && reinterpret_cast<uintptr_t>(bias) % 16 == 0 &&
           aligned(bias_stride[2]) && aligned(bias_stride[1]) && aligned(bias_stride[0]);
  }
  // Any optional feature but the per-sequence key ranges (the decode kernel takes those alone).
  bool has_features_beyond_key_ranges() const {
    return bias_kind != BiasKind::kNone || has_window() || alibi_slopes != nullptr || softcap > 0.0 ||
           dropout_p > 0.0 || is_varlen();
  }
  // True when any optional feature is on (backends without them take this as "not mine").
  bool has_features() const { return has_features_beyond_key_ranges() || has_key_ranges(); }
};

// The backends are only called with batch, heads, len_q and len_k all >= 1;
// The ops handle empty problems themselves.
struct BwdParams : FwdParams {
  // Gradient of the lse output, or null when lse was not used: contiguous
  // (batch, heads_q, len_q) in lse's dtype. Since d lse_i / d s_ij = P_ij, it enters the
  // backward only through D_i = rowsum(dO_i * O_i) - dlse_i.
  const void* dlse = nullptr;
  // Gradient of the output, in `dtype`.
  const void* dout = nullptr;
  Strides dout_stride;
  // Gradients of the inputs, in `dtype`.
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  Strides dq_stride, dk_stride, dv_stride;
  // Bitwise-identical gradients run to run (no order-dependent atomics).
  bool deterministic = false;
  // Gradient of a float bias, or null: dL/d(score) per (batch, heads_q, len_q, len_k),
  // contiguous, in lse's dtype. The backend writes the scores it visits; the caller zeroes
  // it first and sums it over the bias's broadcast dimensions afterwards.
  void* dbias = nullptr;
};

// The in-place append of a KV-cache step (flash_attn_with_kvcache's new keys and values): row t
// of sequence b's new k / v goes to key seqlens[b] + t of its cache, where the sequence's values
// allow it (common/append.h). Caches are addressed [row][key][head] through element strides, the
// new rows [batch][t][head]; the last dimension (head_dim) is contiguous everywhere. No new rows
// (len_new = 0): the rules and seqused only.
struct AppendParams {
  DType dtype = DType::kFloat32;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  Strides k_cache_stride, v_cache_stride;  // batch = a cache row (dense) or block (paged)
  const void* k = nullptr;
  const void* v = nullptr;
  Strides k_stride, v_stride;
  int64_t batch = 0, len_new = 0, heads_kv = 0, head_dim = 0, head_dim_v = 0;
  int64_t cache_rows = 0;  // rows of a dense cache, blocks of a paged one
  int64_t cache_len = 0;   // keys each sequence can hold: C (dense), pages x page_size (paged)
  // int32 (batch,) on the caches' device: keys in each sequence's cache before the append.
  const int32_t* seqlens = nullptr;
  // Optional, int32 on the caches' device: the cache row of each sequence (dense), or the block
  // of each of its pages (paged: block_table[b * block_table_stride + page], pages of page_size keys).
  const int32_t* batch_idx = nullptr;
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0, page_size = 0;
  // Optional, int32 (batch,): the first key of each sequence that the attention reads (its left
  // padding); its pages' blocks are checked from there.
  const int32_t* leftpad = nullptr;
  // Optional rotary embedding (common/rotary.h) of the first 2 * rotary_half features of the new
  // keys (row t at position seqlens[b] + t) and of q's rows (row i at seqlens[b] + i when
  // q_rows_consecutive, else at seqlens[b]), written rotated into the cache and into q_rotated.
  // Tables (rotary_positions, rotary_half) with row strides, in `dtype` or float32
  // (rotary_table_f32). A sequence that needs a position past the tables' end breaks a rule.
  const void* rotary_cos = nullptr;
  const void* rotary_sin = nullptr;
  int64_t rotary_cos_stride = 0, rotary_sin_stride = 0, rotary_positions = 0, rotary_half = 0;
  bool rotary_table_f32 = false, rotary_interleaved = true;
  // Optional (with the tables): q (batch, len_q, heads_q, head_dim) in `dtype`, and q_rotated,
  // the same shape, written. A sequence that breaks a rule gets q's rows unrotated.
  const void* q = nullptr;
  void* q_rotated = nullptr;
  Strides q_stride, q_rotated_stride;
  int64_t len_q = 0, heads_q = 0;
  bool q_rows_consecutive = false;
  // Output, int32 (batch,): seqlens[b] + len_new, where sequence b's keys end after the append
  // (the attention's seqused_k), or -1 for a sequence whose values are out of range, which writes
  // nothing (and whose attention rows the -1 turns to NaN).
  int32_t* seqused = nullptr;
};

inline size_t dtype_size(DType t) {
  return t == DType::kFloat64 ? 8 : t == DType::kFloat32 ? 4 : 2;
}

}  // namespace flashattn
