// Plain description of one attention call, shared by ops.cpp and every backend.
// No torch types here: kernels include this header and nothing from torch.
#pragma once
#include <cstddef>
#include <cstdint>

namespace flashattn {

enum class DType : int { kFloat64 = 0, kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3 };

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

  int64_t group() const { return heads_q / heads_kv; }  // query heads per kv head (GQA)
};

// The backends are only called with batch, heads, len_q and len_k all >= 1;
// ops.cpp handles empty problems itself.
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
  // Scratch of `workspace_bytes` bytes, as the backend's bwd_workspace_bytes asked
  // for; its contents on entry are undefined.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // Bitwise-identical gradients run to run (no order-dependent atomics).
  bool deterministic = false;
};

inline size_t dtype_size(DType t) {
  return t == DType::kFloat64 ? 8 : t == DType::kFloat32 ? 4 : 2;
}

}  // namespace flashattn
