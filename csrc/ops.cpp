// The ops' schemas and the kernels registered for them: each unpacks its arguments, runs the body (csrc/ops/) and
// returns its tensors with an error string, which flashattn_ext/ops.py raises. csrc/ops.cpp and csrc/ops/ are the
// only files that know torch types.
#include <torch/csrc/stable/library.h>

#include <exception>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ops/attention.h"
#include "ops/kvcache.h"

namespace flashattn {
namespace {

using namespace ops;

// The kernels registered as flashattn::_fwd, _bwd and _dropout_mask: the tensors and an error
// string, empty on success. With an error, the tensors returned are placeholders (an input).
// The backends throw only on a CUDA runtime failure (common/check.h); where torch carries
// exceptions (2.13 on) that failure comes back as a RuntimeError too.
template <class Body>
std::string guarded(Body&& body) {
  try {
    return body().message;
  } catch (const std::exception& e) {
    return std::string("RuntimeError|") + e.what();
  }
}

std::tuple<Tensor, Tensor, std::string> fwd_op(
    Tensor q, Tensor k, Tensor v, double scale, int64_t causal, bool deterministic, std::optional<Tensor> attn_bias,
    int64_t window_left, int64_t window_right, std::optional<Tensor> alibi_slopes, double softcap, double dropout_p,
    std::optional<Tensor> rng_state, std::optional<Tensor> cu_seqlens_q, std::optional<Tensor> cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, std::optional<Tensor> seqused_k, std::optional<Tensor> leftpad_k,
    std::optional<Tensor> block_table) {
  (void)deterministic;
  const Features f{attn_bias, window_left, window_right, alibi_slopes, softcap, dropout_p, rng_state,
                   cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, leftpad_k, block_table};
  Tensor out = q, lse = q;
  std::string error = guarded([&] { return fwd(q, k, v, scale, causal, f, out, lse); });
  return {out, lse, error};
}

// _fwd of a call without optional features: each argument of a schema costs the dispatcher time on
// every call (parsed from Python, boxed, converted through the stable ABI), more than such a call's
// kernel takes on a GPU.
std::tuple<Tensor, Tensor, std::string> fwd_plain_op(Tensor q, Tensor k, Tensor v, double scale, int64_t causal) {
  Tensor out = q, lse = q;
  std::string error = guarded([&] { return fwd(q, k, v, scale, causal, Features{}, out, lse); });
  return {out, lse, error};
}

#ifdef FLASHATTN_WITH_CUDA
// _fwd_fp8: (out, lse, error); error "Unavailable|..." where the float8 kernel cannot take the call.
std::tuple<Tensor, Tensor, std::string> fwd_fp8_op(Tensor q, Tensor k, Tensor v, Tensor qk_descale, Tensor v_descale,
                                                   double scale, int64_t causal) {
  Tensor out = q, lse = q;
  bool unavailable = false;
  std::string error =
      guarded([&] { return fwd_fp8(q, k, v, qk_descale, v_descale, scale, causal, out, lse, unavailable); });
  if (unavailable) error = "Unavailable|" + error.substr(error.find('|') + 1);
  return {out, lse, error};
}
#endif

std::tuple<Tensor, Tensor, Tensor, Tensor, std::string> bwd_op(
    Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, std::optional<Tensor> dlse, double scale,
    int64_t causal, bool deterministic, std::optional<Tensor> attn_bias, int64_t window_left, int64_t window_right,
    std::optional<Tensor> alibi_slopes, double softcap, double dropout_p, std::optional<Tensor> rng_state,
    std::optional<Tensor> cu_seqlens_q, std::optional<Tensor> cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, std::optional<Tensor> seqused_k, std::optional<Tensor> leftpad_k,
    std::optional<Tensor> block_table, bool bias_requires_grad) {
  const Features f{attn_bias, window_left, window_right, alibi_slopes, softcap, dropout_p, rng_state,
                   cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, leftpad_k, block_table};
  Tensor dq = q, dk = q, dv = q, dbias = q;
  std::string error = guarded([&] {
    return bwd(dout, q, k, v, out, lse, dlse, scale, causal, deterministic, f, bias_requires_grad, dq, dk, dv, &dbias);
  });
  return {dq, dk, dv, dbias, error};
}

// _bwd of a call without optional features (as fwd_plain_op), with no bias gradient to return.
std::tuple<Tensor, Tensor, Tensor, std::string> bwd_plain_op(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                                                            Tensor lse, std::optional<Tensor> dlse, double scale,
                                                            int64_t causal, bool deterministic) {
  Tensor dq = q, dk = q, dv = q;
  std::string error = guarded([&] {
    return bwd(dout, q, k, v, out, lse, dlse, scale, causal, deterministic, Features{}, false, dq, dk, dv, nullptr);
  });
  return {dq, dk, dv, error};
}

std::tuple<std::string, std::string> kernel_plan_op(
    Tensor q, Tensor k, Tensor v, int64_t causal, bool backward, bool deterministic, std::optional<Tensor> attn_bias,
    int64_t window_left, int64_t window_right, std::optional<Tensor> alibi_slopes, double softcap, double dropout_p,
    std::optional<Tensor> rng_state, std::optional<Tensor> cu_seqlens_q, std::optional<Tensor> cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, std::optional<Tensor> seqused_k, std::optional<Tensor> leftpad_k,
    std::optional<Tensor> block_table, bool bias_requires_grad, std::vector<int64_t> device,
    std::optional<std::string> kernels, std::optional<std::string> smem_limit) {
  const Features f{attn_bias, window_left, window_right, alibi_slopes, softcap, dropout_p, rng_state,
                   cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, leftpad_k, block_table};
  std::string plan;
  std::string error = guarded([&] {
    return kernel_plan(q, k, v, causal, backward, deterministic, f, bias_requires_grad, device, kernels, smem_limit,
                       plan);
  });
  return {plan, error};
}

std::tuple<Tensor, std::string> dropout_mask_op(Tensor rng_state, int64_t batch, int64_t heads, int64_t len_q,
                                                int64_t len_k, double dropout_p) {
  Tensor mask = rng_state;
  std::string error = guarded([&] { return dropout_mask(rng_state, batch, heads, len_q, len_k, dropout_p, mask); });
  return {mask, error};
}

std::tuple<Tensor, std::string> kvcache_append_op(Tensor k_cache, Tensor v_cache, Tensor k, Tensor v, Tensor seqlens,
                                                  std::optional<Tensor> batch_idx, std::optional<Tensor> block_table,
                                                  std::optional<Tensor> leftpad, std::optional<Tensor> rotary_cos,
                                                  std::optional<Tensor> rotary_sin, bool rotary_interleaved,
                                                  std::optional<Tensor> q, std::optional<Tensor> q_rotated,
                                                  bool q_rows_consecutive) {
  Tensor seqused = seqlens;
  std::string error = guarded([&] {
    return kvcache_append(k_cache, v_cache, k, v, seqlens, batch_idx, block_table, leftpad, rotary_cos, rotary_sin,
                          rotary_interleaved, q, q_rotated, q_rows_consecutive, seqused);
  });
  return {seqused, error};
}

std::tuple<Tensor, Tensor, std::string> kvcache_step_op(
    Tensor k_cache, Tensor v_cache, Tensor q, std::optional<Tensor> k, std::optional<Tensor> v,
    std::optional<Tensor> seqlens, std::optional<Tensor> block_table, std::optional<Tensor> leftpad,
    std::optional<Tensor> rotary_cos, std::optional<Tensor> rotary_sin, bool rotary_interleaved, double scale,
    bool causal) {
  Tensor out = q, lse = q;
  std::string error = guarded([&] {
    return kvcache_step(k_cache, v_cache, q, k, v, seqlens, block_table, leftpad, rotary_cos, rotary_sin,
                        rotary_interleaved, scale, causal, out, lse);
  });
  return {out, lse, error};
}

}  // namespace
}  // namespace flashattn

#define FLASHATTN_FWD_ARGS                                                                                       \
  "Tensor q, Tensor k, Tensor v, float scale, int causal, bool deterministic=False, Tensor? attn_bias=None, "   \
  "int window_left=-1, int window_right=-1, Tensor? alibi_slopes=None, float softcap=0.0, float dropout_p=0.0, " \
  "Tensor? rng_state=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, int max_seqlen_q=0, "          \
  "int max_seqlen_k=0, Tensor? seqused_k=None, Tensor? leftpad_k=None, Tensor? block_table=None"
#define FLASHATTN_BWD_ARGS                                                                                        \
  "Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, float scale, int causal, "   \
  "bool deterministic, Tensor? attn_bias=None, int window_left=-1, int window_right=-1, "                        \
  "Tensor? alibi_slopes=None, float softcap=0.0, float dropout_p=0.0, Tensor? rng_state=None, "                  \
  "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, int max_seqlen_q=0, int max_seqlen_k=0, "              \
  "Tensor? seqused_k=None, Tensor? leftpad_k=None, Tensor? block_table=None, bool bias_requires_grad=False"

// fwd, bwd and dropout_mask are the public ops; their CPU and CUDA kernels are registered in
// flashattn_ext/ops.py, which calls the underscored kernels below and raises their errors.
STABLE_TORCH_LIBRARY(flashattn, m) {
  // The optional features (defaults: off) are documented in flashattn_ext/ops.py.
  m.def("fwd(" FLASHATTN_FWD_ARGS ") -> (Tensor out, Tensor lse)");
  m.def("bwd(" FLASHATTN_BWD_ARGS ") -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)");
  m.def("dropout_mask(Tensor rng_state, int batch, int heads, int len_q, int len_k, float dropout_p) -> Tensor");
  m.def("_fwd(" FLASHATTN_FWD_ARGS ") -> (Tensor out, Tensor lse, str error)");
  m.def("_bwd(" FLASHATTN_BWD_ARGS ") -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias, str error)");
  // _fwd and _bwd of calls without optional features, with only the arguments those read.
  m.def("_fwd_plain(Tensor q, Tensor k, Tensor v, float scale, int causal) -> (Tensor out, Tensor lse, str error)");
  m.def("_bwd_plain(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, float scale, "
        "int causal, bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv, str error)");
  // A float8 (e4m3) forward on the sm_90 kernel (flashattn_ext/fp8.py): q, k, v as uint8 views,
  // per-(batch, kv head) float32 descales; error "Unavailable|why" where the kernel cannot take the call.
  m.def("_fwd_fp8(Tensor q, Tensor k, Tensor v, Tensor qk_descale, Tensor v_descale, float scale, int causal) -> "
        "(Tensor out, Tensor lse, str error)");
  m.def("_dropout_mask(Tensor rng_state, int batch, int heads, int len_q, int len_k, float dropout_p) -> "
        "(Tensor mask, str error)");
  // The CUDA kernel the plan chooses for a call (flashattn_ext.kernel_plan): "family/tier".
  m.def("_kernel_plan(Tensor q, Tensor k, Tensor v, int causal, bool backward, bool deterministic, "
        "Tensor? attn_bias, int window_left, int window_right, Tensor? alibi_slopes, float softcap, float dropout_p, "
        "Tensor? rng_state, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
        "Tensor? seqused_k, Tensor? leftpad_k, Tensor? block_table, bool bias_requires_grad, int[] device, "
        "str? kernels, str? smem_limit) -> (str plan, str error)");
  // A KV-cache step's in-place append (flashattn_ext/_kvcache_compose.py): seqused = seqlens + new
  // rows, -1 where a sequence's values allow no step; with rotary tables the new keys go in rotated
  // and q's rows are written rotated into q_rotated. Its CPU and CUDA kernels are registered in
  // flashattn_ext/ops.py, as fwd's.
#define FLASHATTN_APPEND_ARGS                                                                                    \
  "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor seqlens, Tensor? batch_idx=None, "        \
  "Tensor? block_table=None, Tensor? leftpad=None, Tensor? rotary_cos=None, Tensor? rotary_sin=None, "          \
  "bool rotary_interleaved=True, Tensor? q=None, Tensor(c!)? q_rotated=None, bool q_rows_consecutive=False"
  m.def("kvcache_append(" FLASHATTN_APPEND_ARGS ") -> Tensor seqused");
  m.def("_kvcache_append(" FLASHATTN_APPEND_ARGS ") -> (Tensor seqused, str error)");
  // A common decode step of flash_attn_with_kvcache in one call (flashattn_ext/_kvcache_fast.py): the
  // append (where there is anything to append or check) and the attention to the caches, q, k, v and
  // out in its (batch, len, heads, dim) layout; causal is bottom-right. Eager CPU/CUDA tensors only.
  m.def("_kvcache_step(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor q, Tensor? k, Tensor? v, Tensor? seqlens, "
        "Tensor? block_table, Tensor? leftpad, Tensor? rotary_cos, Tensor? rotary_sin, bool rotary_interleaved, "
        "float scale, bool causal) -> (Tensor out, Tensor lse, str error)");
}

STABLE_TORCH_LIBRARY_IMPL(flashattn, CPU, m) {
  m.impl("_fwd", TORCH_BOX(&flashattn::fwd_op));
  m.impl("_bwd", TORCH_BOX(&flashattn::bwd_op));
  m.impl("_fwd_plain", TORCH_BOX(&flashattn::fwd_plain_op));
  m.impl("_bwd_plain", TORCH_BOX(&flashattn::bwd_plain_op));
  m.impl("_dropout_mask", TORCH_BOX(&flashattn::dropout_mask_op));
  m.impl("_kernel_plan", TORCH_BOX(&flashattn::kernel_plan_op));
  m.impl("_kvcache_append", TORCH_BOX(&flashattn::kvcache_append_op));
  m.impl("_kvcache_step", TORCH_BOX(&flashattn::kvcache_step_op));
}

#ifdef FLASHATTN_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(flashattn, CUDA, m) {
  m.impl("_fwd", TORCH_BOX(&flashattn::fwd_op));
  m.impl("_bwd", TORCH_BOX(&flashattn::bwd_op));
  m.impl("_fwd_plain", TORCH_BOX(&flashattn::fwd_plain_op));
  m.impl("_bwd_plain", TORCH_BOX(&flashattn::bwd_plain_op));
  m.impl("_fwd_fp8", TORCH_BOX(&flashattn::fwd_fp8_op));
  m.impl("_kernel_plan", TORCH_BOX(&flashattn::kernel_plan_op));
  m.impl("_kvcache_append", TORCH_BOX(&flashattn::kvcache_append_op));
  m.impl("_kvcache_step", TORCH_BOX(&flashattn::kvcache_step_op));
}
#endif
