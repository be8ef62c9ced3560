// The ops' view of torch tensors: shape, dtype and device checks, with the messages every entry point shows, and
// the outputs' allocation through the C shim.
#pragma once
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../params.h"
#include "errors.h"

namespace flashattn::ops {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

constexpr int64_t kMaxHeadDim = 256;

// causal argument of the ops: 0 = none, 1 = top-left (SDPA is_causal),
// 2 = bottom-right (flash-attn causal).
constexpr int64_t kCausalNone = 0, kCausalTopLeft = 1, kCausalBottomRight = 2;

struct Dims {
  int64_t batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v;
};

std::string shape_str(const Tensor& t);
std::string shape_str(const std::vector<int64_t>& shape);
const char* dtype_name(ScalarType t);
std::string device_str(const Tensor& t);
// The kernels' dtype of a tensor's, or the error naming the argument.
Error to_dtype(ScalarType t, const char* name, DType& dtype);
// lse is kept in fp64 for fp64 inputs and in fp32 otherwise.
inline ScalarType lse_type(ScalarType t) { return t == ScalarType::Double ? ScalarType::Double : ScalarType::Float; }
// Both on the CPU, or both on one CUDA device (a meta tensor is on neither).
bool same_device(const Tensor& a, const Tensor& b);

Error check_attn_tensor(const Tensor& t, const char* name);
Error check_same_device_dtype(const Tensor& ref, const char* ref_name, const Tensor& t, const char* name);
Error check_size(const Tensor& t, const char* name, int64_t dim, int64_t expected, const char* what);
// q, k, v of a call (d set from them). paged: k and v are (num_blocks, heads_kv, page_size, dim) pages of a block
// table (checked with it), so their first dimension is not the batch; d.len_k is then set from the table.
Error check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, int64_t causal, Dims& d, bool paged = false);

inline Strides strides_of(const Tensor& t) { return Strides{t.stride(0), t.stride(1), t.stride(2)}; }
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape);
Error allocate_strided(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, ScalarType dtype,
                       const Tensor& like, const char* what, Tensor& t);
Error allocate(const std::vector<int64_t>& shape, ScalarType dtype, const Tensor& like, const char* what, Tensor& t);
Error empty_like_layout(const Tensor& like, int64_t heads, int64_t len, int64_t dim, ScalarType dtype,
                        const char* what, Tensor& t);

}  // namespace flashattn::ops
