#include "tensors.h"

#include <algorithm>

#include <torch/csrc/stable/library.h>

namespace flashattn::ops {

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

Error to_dtype(ScalarType t, const char* name, DType& dtype) {
  switch (t) {
    case ScalarType::Double: dtype = DType::kFloat64; return {};
    case ScalarType::Float: dtype = DType::kFloat32; return {};
    case ScalarType::BFloat16: dtype = DType::kBFloat16; return {};
    case ScalarType::Half: dtype = DType::kFloat16; return {};
    default:
      return error_of("RuntimeError", "flashattn: argument '", name, "' has dtype ", dtype_name(t),
                      "; supported dtypes are float64, float32, bfloat16 and float16");
  }
}

Error check_attn_tensor(const Tensor& t, const char* name) {
  FA_CHECK(t.dim() == 4, "flashattn: argument '", name,
           "' must have 4 dimensions (batch, heads, seq_len, head_dim), got shape ", shape_str(t));
  FA_CHECK(t.is_cpu() || t.is_cuda(), "flashattn: argument '", name,
           "' must be on a CPU or CUDA device");
  FA_CHECK(t.size(3) <= 1 || t.numel() == 0 || t.stride(3) == 1, "flashattn: argument '", name,
           "' must have a contiguous last dimension (stride 1), got stride ", t.stride(3),
           " for shape ", shape_str(t), "; call .contiguous() on it first");
  DType dtype;
  return to_dtype(t.scalar_type(), name, dtype);
}

std::string device_str(const Tensor& t) {
  return t.is_cuda() ? "cuda:" + std::to_string(t.get_device_index()) : std::string("cpu");
}

Error check_same_device_dtype(const Tensor& ref, const char* ref_name, const Tensor& t, const char* name) {
  FA_CHECK(t.scalar_type() == ref.scalar_type(), "flashattn: argument '", name, "' has dtype ",
           dtype_name(t.scalar_type()), " but '", ref_name, "' has dtype ",
           dtype_name(ref.scalar_type()), "; they must match");
  FA_CHECK(t.is_cuda() == ref.is_cuda() && t.get_device_index() == ref.get_device_index(),
           "flashattn: argument '", name, "' is on device ", device_str(t), " but '", ref_name, "' is on ",
           device_str(ref), "; they must be on the same device");
  return {};
}

Error check_size(const Tensor& t, const char* name, int64_t dim, int64_t expected, const char* what) {
  FA_CHECK(t.size(dim) == expected, "flashattn: argument '", name, "' has ", what, " ",
           t.size(dim), " (shape ", shape_str(t), ") but ", expected, " was expected");
  return {};
}

Error check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, int64_t causal, Dims& d, bool paged) {
  FA_TRY(check_attn_tensor(q, "q"));
  FA_TRY(check_attn_tensor(k, "k"));
  FA_TRY(check_attn_tensor(v, "v"));
  FA_TRY(check_same_device_dtype(q, "q", k, "k"));
  FA_TRY(check_same_device_dtype(q, "q", v, "v"));
  d = Dims{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  if (paged) {
    FA_TRY(check_size(v, "v", 0, k.size(0), "number of blocks (must equal k's)"));
  } else {
    FA_TRY(check_size(k, "k", 0, d.batch, "batch size"));
    FA_TRY(check_size(v, "v", 0, d.batch, "batch size"));
  }
  FA_TRY(check_size(v, "v", 1, d.heads_kv, "number of heads (must equal k's)"));
  FA_TRY(check_size(v, "v", 2, d.len_k, "sequence length (must equal k's)"));
  FA_TRY(check_size(k, "k", 3, d.head_dim, "head_dim (must equal q's)"));
  FA_CHECK(d.head_dim >= 1 && d.head_dim <= kMaxHeadDim,
           "flashattn: head_dim of q and k must be between 1 and ", kMaxHeadDim, ", got ", d.head_dim);
  FA_CHECK(d.head_dim_v >= 1 && d.head_dim_v <= kMaxHeadDim,
           "flashattn: head_dim of v must be between 1 and ", kMaxHeadDim, ", got ", d.head_dim_v);
  FA_CHECK((d.heads_kv == 0 && d.heads_q == 0) || (d.heads_kv > 0 && d.heads_q % d.heads_kv == 0),
           "flashattn: the number of query heads (", d.heads_q,
           ") must be a multiple of the number of key/value heads (", d.heads_kv, ")");
  FA_CHECK(causal == kCausalNone || causal == kCausalTopLeft || causal == kCausalBottomRight,
           "flashattn: argument 'causal' must be 0 (none), 1 (top-left) or 2 (bottom-right), got ",
           causal);
  return {};
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t d = 0; d < shape.size(); ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

// Row-major strides of a new tensor of `shape`, as torch gives them (a dimension of size 0 counts as 1).
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t stride = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= std::max<int64_t>(shape[d], 1);
  }
  return strides;
}

// A new tensor of `shape` and `strides` on like's device, from the C shim's empty_strided: no
// lookup of the op by name and no boxed call (torch_call_dispatcher("aten::empty") cost the host
// more than the allocation, on every output of every call). Its failure (the only cause once the
// arguments are checked: no memory left) is returned as an OutOfMemoryError naming what was being
// allocated.
Error allocate_strided(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, ScalarType dtype,
                       const Tensor& like, const char* what, Tensor& t) {
  int32_t device_type = 0, device_index = 0;
  AtenTensorHandle handle = nullptr;
  const bool ok =
      aoti_torch_get_device_type(like.get(), &device_type) == AOTI_TORCH_SUCCESS &&
      aoti_torch_get_device_index(like.get(), &device_index) == AOTI_TORCH_SUCCESS &&
      aoti_torch_empty_strided(int64_t(shape.size()), shape.data(), strides.data(),
                               torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype)), device_type,
                               device_index, &handle) == AOTI_TORCH_SUCCESS;
  if (!ok) {
    return error_of("OutOfMemoryError", "flashattn: out of memory allocating ", what, " of shape ", shape_str(shape),
                    " on ", device_str(like));
  }
  t = Tensor(handle);
  return {};
}

Error allocate(const std::vector<int64_t>& shape, ScalarType dtype, const Tensor& like, const char* what, Tensor& t) {
  return allocate_strided(shape, contiguous_strides(shape), dtype, like, what, t);
}

// New (batch, heads, len, dim) tensor laid out in memory like `like`: (batch, len, heads, dim)
// order when `like` keeps heads inside rows (a transposed flash-attn view), else contiguous.
// The fake kernels in flashattn_ext/ops.py follow the same rule.
Error empty_like_layout(const Tensor& like, int64_t heads, int64_t len, int64_t dim, ScalarType dtype,
                        const char* what, Tensor& t) {
  const bool heads_inner = like.size(1) > 1 && like.size(2) > 1 && like.stride(1) < like.stride(2);
  std::vector<int64_t> strides;
  if (heads_inner) {
    const std::vector<int64_t> stored = contiguous_strides({like.size(0), len, heads, dim});
    strides = {stored[0], stored[2], stored[1], stored[3]};
  } else {
    strides = contiguous_strides({like.size(0), heads, len, dim});
  }
  return allocate_strided({like.size(0), heads, len, dim}, strides, dtype, like, what, t);
}

bool same_device(const Tensor& a, const Tensor& b) {
  return (a.is_cpu() && b.is_cpu()) || (a.is_cuda() && b.is_cuda() && a.get_device_index() == b.get_device_index());
}

}  // namespace flashattn::ops
