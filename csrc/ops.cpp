// The two attention ops, flashattn::fwd and flashattn::bwd: schemas, argument checks,
// allocation, Params fill and dispatch by device. The only file that knows torch types.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#ifdef FLASHATTN_WITH_CUDA
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#endif

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/api.h"
#include "params.h"
#ifdef FLASHATTN_WITH_CUDA
#include "cuda/api.h"
#endif

namespace flashattn {
namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

constexpr int64_t kMaxHeadDim = 256;

// causal argument of the ops: 0 = none, 1 = top-left (SDPA is_causal),
// 2 = bottom-right (flash-attn causal).
constexpr int64_t kCausalNone = 0, kCausalTopLeft = 1, kCausalBottomRight = 2;

std::string shape_str(const Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

const char* dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Double: return "float64";
    case ScalarType::Float: return "float32";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Half: return "float16";
    case ScalarType::Int: return "int32";
    case ScalarType::Long: return "int64";
    case ScalarType::Bool: return "bool";
    default: return "a non-floating or unsupported dtype";
  }
}

DType to_dtype(ScalarType t, const char* name) {
  switch (t) {
    case ScalarType::Double: return DType::kFloat64;
    case ScalarType::Float: return DType::kFloat32;
    case ScalarType::BFloat16: return DType::kBFloat16;
    case ScalarType::Half: return DType::kFloat16;
    default:
      STD_TORCH_CHECK(false, "flashattn: argument '", name, "' has dtype ", dtype_name(t),
                      "; supported dtypes are float64, float32, bfloat16 and float16");
  }
  return DType::kFloat32;
}

// lse is kept in fp64 for fp64 inputs and in fp32 otherwise.
ScalarType lse_type(ScalarType t) { return t == ScalarType::Double ? ScalarType::Double : ScalarType::Float; }

void check_attn_tensor(const Tensor& t, const char* name) {
  STD_TORCH_CHECK(t.dim() == 4, "flashattn: argument '", name,
                  "' must have 4 dimensions (batch, heads, seq_len, head_dim), got shape ", shape_str(t));
  STD_TORCH_CHECK(t.is_cpu() || t.is_cuda(), "flashattn: argument '", name,
                  "' must be on a CPU or CUDA device");
  STD_TORCH_CHECK(t.size(3) <= 1 || t.numel() == 0 || t.stride(3) == 1, "flashattn: argument '", name,
                  "' must have a contiguous last dimension (stride 1), got stride ", t.stride(3),
                  " for shape ", shape_str(t), "; call .contiguous() on it first");
  to_dtype(t.scalar_type(), name);
}

std::string device_str(const Tensor& t) {
  return t.is_cuda() ? "cuda:" + std::to_string(t.get_device_index()) : std::string("cpu");
}

void check_same_device_dtype(const Tensor& ref, const char* ref_name, const Tensor& t, const char* name) {
  STD_TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "flashattn: argument '", name, "' has dtype ",
                  dtype_name(t.scalar_type()), " but '", ref_name, "' has dtype ",
                  dtype_name(ref.scalar_type()), "; they must match");
  STD_TORCH_CHECK(t.is_cuda() == ref.is_cuda() && t.get_device_index() == ref.get_device_index(),
                  "flashattn: argument '", name, "' is on device ", device_str(t), " but '", ref_name, "' is on ",
                  device_str(ref), "; they must be on the same device");
}

void check_size(const Tensor& t, const char* name, int64_t dim, int64_t expected, const char* what) {
  STD_TORCH_CHECK(t.size(dim) == expected, "flashattn: argument '", name, "' has ", what, " ",
                  t.size(dim), " (shape ", shape_str(t), ") but ", expected, " was expected");
}

struct Dims {
  int64_t batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v;
};

Dims check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, int64_t causal) {
  check_attn_tensor(q, "q");
  check_attn_tensor(k, "k");
  check_attn_tensor(v, "v");
  check_same_device_dtype(q, "q", k, "k");
  check_same_device_dtype(q, "q", v, "v");
  Dims d{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  check_size(k, "k", 0, d.batch, "batch size");
  check_size(v, "v", 0, d.batch, "batch size");
  check_size(v, "v", 1, d.heads_kv, "number of heads (must equal k's)");
  check_size(v, "v", 2, d.len_k, "sequence length (must equal k's)");
  check_size(k, "k", 3, d.head_dim, "head_dim (must equal q's)");
  STD_TORCH_CHECK(d.head_dim >= 1 && d.head_dim <= kMaxHeadDim,
                  "flashattn: head_dim of q and k must be between 1 and ", kMaxHeadDim, ", got ", d.head_dim);
  STD_TORCH_CHECK(d.head_dim_v >= 1 && d.head_dim_v <= kMaxHeadDim,
                  "flashattn: head_dim of v must be between 1 and ", kMaxHeadDim, ", got ", d.head_dim_v);
  STD_TORCH_CHECK((d.heads_kv == 0 && d.heads_q == 0) || (d.heads_kv > 0 && d.heads_q % d.heads_kv == 0),
                  "flashattn: the number of query heads (", d.heads_q,
                  ") must be a multiple of the number of key/value heads (", d.heads_kv, ")");
  STD_TORCH_CHECK(causal == kCausalNone || causal == kCausalTopLeft || causal == kCausalBottomRight,
                  "flashattn: argument 'causal' must be 0 (none), 1 (top-left) or 2 (bottom-right), got ",
                  causal);
  return d;
}

Strides strides_of(const Tensor& t) { return Strides{t.stride(0), t.stride(1), t.stride(2)}; }

// New (batch, heads, len, dim) tensor laid out in memory like `like`: (batch, len, heads, dim)
// order when `like` keeps heads inside rows (a transposed flash-attn view), else contiguous.
// The fake kernels in flashattn_ext/ops.py follow the same rule.
Tensor empty_like_layout(const Tensor& like, int64_t heads, int64_t len, int64_t dim, ScalarType dtype) {
  bool heads_inner = like.size(1) > 1 && like.size(2) > 1 && like.stride(1) < like.stride(2);
  std::vector<int64_t> shape = heads_inner ? std::vector<int64_t>{like.size(0), len, heads, dim}
                                           : std::vector<int64_t>{like.size(0), heads, len, dim};
  Tensor t = torch::stable::empty(shape, dtype, std::nullopt, like.device());
  return heads_inner ? torch::stable::transpose(t, 1, 2) : t;
}

void fill_common(FwdParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Dims& d, double scale,
                 int64_t causal) {
  p.dtype = to_dtype(q.scalar_type(), "q");
  p.q = q.const_data_ptr();
  p.k = k.const_data_ptr();
  p.v = v.const_data_ptr();
  p.q_stride = strides_of(q);
  p.k_stride = strides_of(k);
  p.v_stride = strides_of(v);
  p.batch = d.batch;
  p.heads_q = d.heads_q;
  p.heads_kv = d.heads_kv;
  p.len_q = d.len_q;
  p.len_k = d.len_k;
  p.head_dim = d.head_dim;
  p.head_dim_v = d.head_dim_v;
  p.scale = scale;
  p.causal = causal != kCausalNone;
  p.causal_offset = causal == kCausalBottomRight ? d.len_k - d.len_q : 0;
}

#ifdef FLASHATTN_WITH_CUDA
void* current_cuda_stream(const Tensor& t) {
  void* stream = nullptr;
  STD_TORCH_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream) == AOTI_TORCH_SUCCESS,
                  "flashattn: could not get the current CUDA stream of device ", t.get_device_index());
  return stream;
}
#endif

// `deterministic` is kept for the backward (autograd passes it on); the forward has no
// order-dependent reductions.
std::tuple<Tensor, Tensor> fwd(Tensor q, Tensor k, Tensor v, double scale, int64_t causal, bool deterministic) {
  (void)deterministic;
  const Dims d = check_qkv(q, k, v, causal);
  Tensor out = empty_like_layout(q, d.heads_q, d.len_q, d.head_dim_v, q.scalar_type());
  Tensor lse = torch::stable::empty({d.batch, d.heads_q, d.len_q}, lse_type(q.scalar_type()), std::nullopt,
                                    q.device());
  if (out.numel() == 0) return {out, lse};
  if (d.len_k == 0) {  // every row is fully masked
    torch::stable::zero_(out);
    torch::stable::fill_(lse, -std::numeric_limits<double>::infinity());
    return {out, lse};
  }
  FwdParams p;
  fill_common(p, q, k, v, d, scale, causal);
  p.out = out.mutable_data_ptr();
  p.out_stride = strides_of(out);
  p.lse = lse.mutable_data_ptr();
  if (q.is_cpu()) {
    cpu::run_fwd(p);
  } else {
#ifdef FLASHATTN_WITH_CUDA
    torch::stable::accelerator::DeviceGuard guard(q.get_device_index());
    cuda::run_fwd(p, current_cuda_stream(q));
#else
    STD_TORCH_CHECK(false, "flashattn: this build of flashattn_ext has no CUDA kernels; reinstall it with "
                           "nvcc and a CUDA build of torch present");
#endif
  }
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                                       std::optional<Tensor> dlse, double scale, int64_t causal, bool deterministic) {
  const Dims d = check_qkv(q, k, v, causal);
  check_attn_tensor(dout, "dout");
  check_attn_tensor(out, "out");
  check_same_device_dtype(q, "q", dout, "dout");
  check_same_device_dtype(q, "q", out, "out");
  const int64_t out_shape[4] = {d.batch, d.heads_q, d.len_q, d.head_dim_v};
  for (int64_t i = 0; i < 4; ++i) {
    check_size(out, "out", i, out_shape[i], "dimension size");
    check_size(dout, "dout", i, out_shape[i], "dimension size");
  }
  STD_TORCH_CHECK(lse.dim() == 3 && lse.size(0) == d.batch && lse.size(1) == d.heads_q && lse.size(2) == d.len_q,
                  "flashattn: argument 'lse' must have shape [", d.batch, ", ", d.heads_q, ", ", d.len_q,
                  "], got ", shape_str(lse));
  STD_TORCH_CHECK(lse.scalar_type() == lse_type(q.scalar_type()), "flashattn: argument 'lse' must have dtype ",
                  dtype_name(lse_type(q.scalar_type())), ", got ", dtype_name(lse.scalar_type()));
  STD_TORCH_CHECK(lse.is_contiguous(), "flashattn: argument 'lse' must be contiguous");
  STD_TORCH_CHECK(lse.is_cuda() == q.is_cuda() && lse.get_device_index() == q.get_device_index(),
                  "flashattn: argument 'lse' must be on the same device as 'q'");
  if (dlse.has_value()) {
    const Tensor& g = *dlse;
    STD_TORCH_CHECK(g.dim() == 3 && g.size(0) == d.batch && g.size(1) == d.heads_q && g.size(2) == d.len_q &&
                        g.scalar_type() == lse.scalar_type() && g.is_contiguous() && g.is_cuda() == q.is_cuda() &&
                        g.get_device_index() == q.get_device_index(),
                    "flashattn: argument 'dlse' must be a contiguous tensor shaped, typed and placed like 'lse' ",
                    shape_str(lse), ", got shape ", shape_str(g), " and dtype ", dtype_name(g.scalar_type()));
  }

  Tensor dq = empty_like_layout(q, d.heads_q, d.len_q, d.head_dim, q.scalar_type());
  Tensor dk = empty_like_layout(k, d.heads_kv, d.len_k, d.head_dim, q.scalar_type());
  Tensor dv = empty_like_layout(v, d.heads_kv, d.len_k, d.head_dim_v, q.scalar_type());
  if (d.batch * d.heads_q * d.len_q * d.len_k == 0) {  // nothing attends to anything
    torch::stable::zero_(dq);
    torch::stable::zero_(dk);
    torch::stable::zero_(dv);
    return {dq, dk, dv};
  }
  BwdParams p;
  fill_common(p, q, k, v, d, scale, causal);
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
  if (q.is_cpu()) {
    p.workspace_bytes = cpu::bwd_workspace_bytes(p);
    Tensor ws = torch::stable::empty({static_cast<int64_t>(p.workspace_bytes)}, ScalarType::Byte, std::nullopt,
                                     q.device());
    p.workspace = ws.mutable_data_ptr();
    cpu::run_bwd(p);
  } else {
#ifdef FLASHATTN_WITH_CUDA
    torch::stable::accelerator::DeviceGuard guard(q.get_device_index());
    p.workspace_bytes = cuda::bwd_workspace_bytes(p);
    Tensor ws = torch::stable::empty({static_cast<int64_t>(p.workspace_bytes)}, ScalarType::Byte, std::nullopt,
                                     q.device());
    p.workspace = ws.mutable_data_ptr();
    cuda::run_bwd(p, current_cuda_stream(q));
#else
    STD_TORCH_CHECK(false, "flashattn: this build of flashattn_ext has no CUDA kernels; reinstall it with "
                           "nvcc and a CUDA build of torch present");
#endif
  }
  return {dq, dk, dv};
}

}  // namespace
}  // namespace flashattn

STABLE_TORCH_LIBRARY(flashattn, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float scale, int causal, bool deterministic=False) -> "
      "(Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, float scale, "
      "int causal, bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv)");
}

STABLE_TORCH_LIBRARY_IMPL(flashattn, CPU, m) {
  m.impl("fwd", TORCH_BOX(&flashattn::fwd));
  m.impl("bwd", TORCH_BOX(&flashattn::bwd));
}

#ifdef FLASHATTN_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(flashattn, CUDA, m) {
  m.impl("fwd", TORCH_BOX(&flashattn::fwd));
  m.impl("bwd", TORCH_BOX(&flashattn::bwd));
}
#endif
