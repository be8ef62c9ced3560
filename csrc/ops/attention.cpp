#include "attention.h"

#include <cstdint>
#include <limits>
#include <utility>

#include <torch/csrc/stable/ops.h>

#include "../common/dropout.h"
#include "../cuda/plan.h"
#include "backend.h"

namespace flashattn::ops {
namespace {

// Strides of a gradient or output of `heads` x `len` x `dim` as the ops allocate it beside `like`
// (empty_like_layout): (batch, len, heads, dim) memory order for a transposed flash-attn view.
Strides allocated_strides(const Tensor& like, int64_t heads, int64_t len, int64_t dim) {
  if (like.size(1) > 1 && like.size(2) > 1 && like.stride(1) < like.stride(2))
    return Strides{len * heads * dim, dim, heads * dim};
  return Strides{heads * len * dim, len * dim, dim};
}

}  // namespace

// `deterministic` is kept for the backward (autograd passes it on); the forward has no
// order-dependent reductions.
Error fwd(Tensor q, Tensor k, Tensor v, double scale, int64_t causal, const Features& f, Tensor& out, Tensor& lse) {
  FwdParams p;
  Dims d;
  FA_TRY(fwd_params(q, k, v, scale, causal, f, p, d));
  bool done = false;
  FA_TRY(fwd_outputs(p, q, d, q.scalar_type(), lse_type(q.scalar_type()), out, lse, done));
  if (done) return {};
  return run_backend(p, q, cpu::fwd_workspace_bytes, cpu::run_fwd, FLASHATTN_CUDA_FWD);
}

#ifdef FLASHATTN_WITH_CUDA
// A float8 (e4m3) forward on the sm_90 kernel: q, k, v (batch, heads, len, 128) as uint8 views of
// e4m3 tensors (flashattn_ext/fp8.py), qk_descale / v_descale contiguous float32 (batch, heads_kv);
// out bf16 (laid out as q), lse float32. `unavailable`: set where the kernel cannot take the call (then
// out and lse are not computed).
Error fwd_fp8(Tensor q, Tensor k, Tensor v, Tensor qk_descale, Tensor v_descale, double scale, int64_t causal,
              Tensor& out, Tensor& lse, bool& unavailable) {
  unavailable = false;
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{q, "q"}, {k, "k"}, {v, "v"}}) {
    FA_CHECK(t.dim() == 4 && t.is_cuda() && t.scalar_type() == ScalarType::Byte && (t.numel() == 0 || t.stride(3) == 1),
             "flashattn: float8 argument '", name, "' must be a CUDA uint8 view of a float8_e4m3fn (batch, heads, "
             "len, head_dim) tensor with a contiguous last dimension, got shape ", shape_str(t));
    FA_CHECK(same_device(t, q), "flashattn: argument '", name, "' is on device ", device_str(t), " but 'q' is on ",
             device_str(q), "; they must be on the same device");
  }
  const Dims d{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  FA_TRY(check_size(k, "k", 0, d.batch, "batch size"));
  FA_TRY(check_size(v, "v", 0, d.batch, "batch size"));
  FA_TRY(check_size(v, "v", 1, d.heads_kv, "number of heads (must equal k's)"));
  FA_TRY(check_size(v, "v", 2, d.len_k, "sequence length (must equal k's)"));
  FA_TRY(check_size(k, "k", 3, d.head_dim, "head_dim (must equal q's)"));
  FA_CHECK(d.head_dim == 128 && d.head_dim_v == 128, "flashattn: the float8 kernel takes head_dim 128 (q, k and v), "
           "got ", d.head_dim, " and ", d.head_dim_v);
  FA_CHECK(d.heads_kv > 0 && d.heads_q % d.heads_kv == 0, "flashattn: the number of query heads (", d.heads_q,
           ") must be a multiple of the number of key/value heads (", d.heads_kv, ")");
  FA_CHECK(causal == kCausalNone || causal == kCausalTopLeft || causal == kCausalBottomRight,
           "flashattn: argument 'causal' must be 0 (none), 1 (top-left) or 2 (bottom-right), got ", causal);
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{qk_descale, "qk_descale"},
                                {v_descale, "v_descale"}}) {
    FA_CHECK(t.dim() == 2 && t.size(0) == d.batch && t.size(1) == d.heads_kv && t.scalar_type() == ScalarType::Float &&
                 t.is_contiguous() && same_device(t, q),
             "flashattn: argument '", name, "' must be a contiguous float32 (batch, heads_kv) = (", d.batch, ", ",
             d.heads_kv, ") tensor on q's device, got shape ", shape_str(t));
  }
  FwdParams p;
  p.dtype = DType::kBFloat16;  // (the output's; q, k and v are float8)
  FA_TRY(fill_call(p, q, k, v, d, scale, causal));
  p.qk_descale = static_cast<const float*>(qk_descale.const_data_ptr());
  p.v_descale = static_cast<const float*>(v_descale.const_data_ptr());
  bool done = false;
  FA_TRY(fwd_outputs(p, q, d, ScalarType::BFloat16, ScalarType::Float, out, lse, done));
  if (done) return {};
  std::string why;
  FA_TRY(run_backend(
      p, q, [](const FwdParams&) { return size_t(0); }, [](FwdParams&) {},
      [&](FwdParams& params, void* stream, const cuda::AllocateWorkspace& allocate) {
        std::string failure = cuda::run_fwd_fp8(params, stream, allocate);
        if (failure.rfind(cuda::kFp8Unavailable, 0) == 0) why = std::exchange(failure, std::string());
        return failure;
      }));
  if (!why.empty()) {
    unavailable = true;
    return error_of("RuntimeError", "flashattn: ", why);
  }
  return {};
}
#endif

// dq, dk, dv and, where `dbias` is given, the gradient of a float attn_bias: (batch, heads_q, len_q,
// len_k) in lse's dtype when bias_requires_grad (the caller sums it over the bias's broadcast
// dimensions), else an empty tensor. (Without `dbias`, bias_requires_grad must be false.)
Error bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, std::optional<Tensor> dlse, double scale,
          int64_t causal, bool deterministic, const Features& f, bool bias_requires_grad, Tensor& dq, Tensor& dk,
          Tensor& dv, Tensor* dbias) {
  FA_CHECK(!f.block_table.has_value(), "flashattn: the backward of a call with a 'block_table' (paged k / v) is not "
           "supported: such calls are forward only (decode steps)");
  Dims d;
  FA_TRY(check_qkv(q, k, v, causal, d));
  BwdParams p;
  FA_TRY(fill_common(p, q, k, v, d, scale, causal));
  FA_TRY(check_and_fill_features(p, f, q, d, causal));
  FA_CHECK(!bias_requires_grad || p.bias_kind == BiasKind::kFloat, "flashattn: bias_requires_grad needs a "
           "float 'attn_bias'");
  FA_CHECK(!p.has_key_ranges(), "flashattn: the backward of a call with 'seqused_k' / 'leftpad_k' (per-sequence "
           "key ranges) is not supported: such calls are forward only (decode steps)");
  FA_TRY(check_attn_tensor(dout, "dout"));
  FA_TRY(check_attn_tensor(out, "out"));
  FA_TRY(check_same_device_dtype(q, "q", dout, "dout"));
  FA_TRY(check_same_device_dtype(q, "q", out, "out"));
  const int64_t out_shape[4] = {d.batch, d.heads_q, d.len_q, d.head_dim_v};
  for (int64_t i = 0; i < 4; ++i) {
    FA_TRY(check_size(out, "out", i, out_shape[i], "dimension size"));
    FA_TRY(check_size(dout, "dout", i, out_shape[i], "dimension size"));
  }
  FA_CHECK(lse.dim() == 3 && lse.size(0) == d.batch && lse.size(1) == d.heads_q && lse.size(2) == d.len_q,
           "flashattn: argument 'lse' must have shape [", d.batch, ", ", d.heads_q, ", ", d.len_q, "], got ",
           shape_str(lse));
  FA_CHECK(lse.scalar_type() == lse_type(q.scalar_type()), "flashattn: argument 'lse' must have dtype ",
           dtype_name(lse_type(q.scalar_type())), ", got ", dtype_name(lse.scalar_type()));
  FA_CHECK(lse.is_contiguous(), "flashattn: argument 'lse' must be contiguous");
  FA_CHECK(same_device(lse, q), "flashattn: argument 'lse' must be on the same device as 'q'");
  if (dlse.has_value()) {
    const Tensor& g = *dlse;
    FA_CHECK(g.dim() == 3 && g.size(0) == d.batch && g.size(1) == d.heads_q && g.size(2) == d.len_q &&
                 g.scalar_type() == lse.scalar_type() && g.is_contiguous() && same_device(g, q),
             "flashattn: argument 'dlse' must be a contiguous tensor shaped, typed and placed like 'lse' ",
             shape_str(lse), ", got shape ", shape_str(g), " and dtype ", dtype_name(g.scalar_type()));
  }

  FA_TRY(empty_like_layout(q, d.heads_q, d.len_q, d.head_dim, q.scalar_type(), "dq", dq));
  FA_TRY(empty_like_layout(k, d.heads_kv, d.len_k, d.head_dim, q.scalar_type(), "dk", dk));
  FA_TRY(empty_like_layout(v, d.heads_kv, d.len_k, d.head_dim_v, q.scalar_type(), "dv", dv));
  if (dbias != nullptr) {
    FA_TRY(allocate({bias_requires_grad ? d.batch : 0, d.heads_q, d.len_q, d.len_k}, lse_type(q.scalar_type()), q,
                    "the attn_bias gradient", *dbias));
    if (bias_requires_grad) torch::stable::zero_(*dbias);  // the backend writes only the scores it visits
  }
  if (d.batch * d.heads_q * d.len_q * d.len_k == 0) {  // nothing attends to anything
    torch::stable::zero_(dq);
    torch::stable::zero_(dk);
    torch::stable::zero_(dv);
    return {};
  }
  p.dbias = bias_requires_grad ? dbias->mutable_data_ptr() : nullptr;
  p.out = const_cast<void*>(out.const_data_ptr());
  p.out_stride = strides_of(out);
  p.lse = const_cast<void*>(lse.const_data_ptr());
  p.dlse = dlse.has_value() ? dlse->const_data_ptr() : nullptr;
  p.dout = dout.const_data_ptr();
  p.dout_stride = strides_of(dout);
  p.dq = dq.mutable_data_ptr();
  p.dk = dk.mutable_data_ptr();
  p.dv = dv.mutable_data_ptr();
  p.dq_stride = strides_of(dq);
  p.dk_stride = strides_of(dk);
  p.dv_stride = strides_of(dv);
  // fp64 is the dtype of checking (gradcheck runs the backward twice and compares): keep it
  // bitwise reproducible whatever the caller asked.
  p.deterministic = deterministic || p.dtype == DType::kFloat64;
  return run_backend(p, q, cpu::bwd_workspace_bytes, cpu::run_bwd, FLASHATTN_CUDA_BWD);
}

// Test helper: the dropout keep mask (true = kept) that fwd and bwd apply to a padded batch
// of this shape, (batch, heads, len_q, len_k) bool on the CPU; sequence b of a variable-length
// batch uses [b, :, :len_q_b, :len_k_b] of it.
Error dropout_mask(Tensor rng_state, int64_t batch, int64_t heads, int64_t len_q, int64_t len_k, double dropout_p,
                   Tensor& mask) {
  FA_CHECK(batch >= 0 && heads >= 0 && len_q >= 0 && len_k >= 0 &&
               double(batch) * double(heads) * double(len_q) * double(len_k) <= double(1 << 28),
           "flashattn: dropout_mask is a test helper for small shapes; got ", batch, " x ", heads, " x ", len_q,
           " x ", len_k);
  FA_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "flashattn: argument 'dropout_p' must be in [0, 1), got ", dropout_p);
  FA_CHECK(rng_state.is_cpu() && rng_state.scalar_type() == ScalarType::Long && rng_state.dim() == 1 &&
               rng_state.size(0) == 2 && rng_state.is_contiguous(),
           "flashattn: argument 'rng_state' must be a contiguous int64 CPU tensor [seed, offset], got shape ",
           shape_str(rng_state), " and dtype ", dtype_name(rng_state.scalar_type()));
  const int64_t* st = static_cast<const int64_t*>(rng_state.const_data_ptr());
  const uint64_t seed = uint64_t(st[0]);
  const uint32_t offset = uint32_t(uint64_t(st[1]));
  const uint32_t threshold = dropout_threshold(dropout_p);
  FA_TRY(allocate({batch, heads, len_q, len_k}, ScalarType::Bool, rng_state, "the dropout mask", mask));
  bool* m = static_cast<bool*>(mask.mutable_data_ptr());
  for (int64_t bh = 0; bh < batch * heads; ++bh)
    for (int64_t i = 0; i < len_q; ++i)
      for (int64_t j = 0; j < len_k; ++j)
        *m++ = dropout_bits(seed, offset, bh, i, j / 4).x[j % 4] >= threshold;
  return {};
}

// The CUDA kernel the plan (csrc/cuda/plan.h) chooses for a forward or (`backward`) backward call, as
// "family/tier". `device` fakes the GPU ([major, minor, SMs, shared memory per block, sm_90a code
// built]); empty, the tensors' own CUDA device. `kernels` / `smem_limit`: the values of
// FLASHATTN_CUDA_KERNELS / FLASHATTN_CUDA_SMEM_LIMIT to plan with (null: unset). The backward's
// outputs are taken as the ops allocate them (aligned, in q's, k's, v's layout).
Error kernel_plan(Tensor q, Tensor k, Tensor v, int64_t causal, bool backward, bool deterministic, const Features& f,
                  bool bias_requires_grad, const std::vector<int64_t>& device,
                  const std::optional<std::string>& kernels, const std::optional<std::string>& smem_limit,
                  std::string& plan) {
  Dims d;
  FA_TRY(check_qkv(q, k, v, causal, d, f.block_table.has_value()));
  if (f.block_table.has_value()) {  // as fwd
    FA_CHECK(!backward, "flashattn: the backward of a call with a 'block_table' (paged k / v) is not supported");
    FA_CHECK(!f.varlen(), "flashattn: a 'block_table' (paged k / v) cannot be combined with cu_seqlens (a "
             "variable-length batch); give per-sequence lengths as seqused_k");
    FA_TRY(check_block_table(*f.block_table, q, k, d));
  }
  BwdParams p;
  FA_TRY(fill_common(p, q, k, v, d, 1.0, causal));
  FA_TRY(check_and_fill_features(p, f, q, d, causal));
  if (f.block_table.has_value()) FA_TRY(fill_pages(p, *f.block_table, k));
  FA_CHECK(device.empty() || device.size() == 5, "flashattn: argument 'device' must be [major, minor, SMs, shared "
           "memory per block, sm_90a built] or empty, got ", device.size(), " values");
  FA_CHECK(!bias_requires_grad || p.bias_kind == BiasKind::kFloat, "flashattn: bias_requires_grad needs a "
           "float 'attn_bias'");
  FA_CHECK(d.batch * d.heads_q * d.len_q * d.len_k > 0, "flashattn: kernel_plan of an empty problem (batch ",
           d.batch, ", heads ", d.heads_q, ", len_q ", d.len_q, ", len_k ", d.len_k, "): no kernel runs");
  void* const aligned = reinterpret_cast<void*>(uintptr_t(256));  // where the ops' allocations start
  p.out = aligned;
  p.out_stride = allocated_strides(q, d.heads_q, d.len_q, d.head_dim_v);
  if (backward) {
    p.dout = aligned;
    p.dout_stride = p.out_stride;
    p.dq = p.dk = p.dv = aligned;
    p.dq_stride = allocated_strides(q, d.heads_q, d.len_q, d.head_dim);
    p.dk_stride = allocated_strides(k, d.heads_kv, d.len_k, d.head_dim);
    p.dv_stride = allocated_strides(v, d.heads_kv, d.len_k, d.head_dim_v);
    p.dbias = bias_requires_grad ? aligned : nullptr;
    p.deterministic = deterministic || p.dtype == DType::kFloat64;  // as bwd
  }
  const cuda::Overrides ov =
      cuda::parse_overrides(kernels ? kernels->c_str() : nullptr, smem_limit ? smem_limit->c_str() : nullptr);
  if (!device.empty()) {
    FA_CHECK(device[0] >= 1 && device[1] >= 0 && device[2] >= 1 && device[3] >= 0 && device[4] >= 0 && device[4] <= 1,
             "flashattn: argument 'device' needs major >= 1, minor >= 0, SMs >= 1, shared memory >= 0 and sm_90a "
             "0 or 1");
    cuda::DeviceInfo dev;
    dev.major = int(device[0]);
    dev.minor = int(device[1]);
    dev.sms = int(device[2]);
    dev.smem_optin = size_t(device[3]);
    dev.sm90a_compiled = device[4] != 0;
    plan = backward ? cuda::describe(cuda::choose_bwd(p, dev, ov)) : cuda::describe(cuda::choose_fwd(p, dev, ov));
    return {};
  }
  FA_CHECK(q.is_cuda(), "flashattn: kernel_plan of tensors on ", device_str(q), " needs argument 'device' (the GPU "
           "to plan for)");
#ifdef FLASHATTN_WITH_CUDA
  torch::stable::accelerator::DeviceGuard guard(q.get_device_index());
  plan = backward ? cuda::planned_bwd(p, ov) : cuda::planned_fwd(p, ov);
  return {};
#else
  return error_of("RuntimeError", "flashattn: this build of flashattn_ext has no CUDA kernels");
#endif
}

}  // namespace flashattn::ops
