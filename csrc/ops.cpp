// The two attention ops, flashattn::fwd and flashattn::bwd: schemas, argument checks,
// allocation, Params fill and dispatch by device. The only file that knows torch types.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#ifdef FLASHATTN_WITH_CUDA
#include <torch/csrc/stable/accelerator.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/dropout.h"
#include "common/sequence.h"
#include "cpu/api.h"
#include "cuda/plan.h"
#include "params.h"
#ifdef FLASHATTN_WITH_CUDA
#include "cuda/api.h"
#endif

namespace flashattn {
namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

// Nothing in this file throws: on torch 2.11 a C++ exception thrown inside a stable-ABI kernel's
// library kills the process (even one caught there). A check that fails returns an Error, which
// the registered kernels hand to Python as a string ("<Python exception type>|<message>"), and
// flashattn_ext/ops.py raises it.
struct [[nodiscard]] Error {
  std::string message;  // empty: no error
  explicit operator bool() const { return !message.empty(); }
};

// Message pieces as text. Numbers go through std::to_string and snprintf, not iostreams: on
// the torch 2.11 builds whose processes crash on an exception, formatting a number through a
// std::ostream crashed as well.
inline std::string to_text(const char* s) { return s; }
inline std::string to_text(const std::string& s) { return s; }
inline std::string to_text(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", x);
  return text;
}
template <class T, class = std::enable_if_t<std::is_integral_v<T>>>
std::string to_text(T x) {
  return std::to_string(x);
}

template <class... Args>
Error error_of(const char* kind, const Args&... args) {
  std::string message = std::string(kind) + "|";
  ((message += to_text(args)), ...);
  return Error{message};
}

// Returns the error (a RuntimeError in Python) from the enclosing function when cond is false.
#define FA_CHECK(cond, ...)                                       \
  do {                                                            \
    if (!(cond)) return error_of("RuntimeError", __VA_ARGS__);    \
  } while (0)
// Returns from the enclosing function the error of a call that failed.
#define FA_TRY(call)                    \
  do {                                  \
    if (Error e_ = (call)) return e_;   \
  } while (0)

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

// lse is kept in fp64 for fp64 inputs and in fp32 otherwise.
ScalarType lse_type(ScalarType t) { return t == ScalarType::Double ? ScalarType::Double : ScalarType::Float; }

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

struct Dims {
  int64_t batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v;
};

// paged: k and v are (num_blocks, heads_kv, page_size, dim) pages of a block table (checked
// with it), so their first dimension is not the batch; d.len_k is then set from the table.
Error check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, int64_t causal, Dims& d, bool paged = false) {
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

Strides strides_of(const Tensor& t) { return Strides{t.stride(0), t.stride(1), t.stride(2)}; }

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

// p's tensors, sizes, scale and causal alignment (p.dtype set first: it bounds the scale).
Error fill_call(FwdParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Dims& d, double scale,
                int64_t causal) {
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
  // The kernels fold log2(e) into the scale in the accumulation type (fp64 for fp64 inputs,
  // else fp32): a scale that overflows there would turn every score into +-inf or NaN.
  const double largest = p.dtype == DType::kFloat64 ? std::numeric_limits<double>::max()
                                                    : double(std::numeric_limits<float>::max());
  const double max_scale = largest / 1.4426950408889634;
  FA_CHECK(std::isfinite(scale) && std::fabs(scale) <= max_scale, "flashattn: argument 'scale' must be finite "
           "with |scale| <= ", max_scale, " (scale * log2(e) must fit in the accumulation type), got ", scale);
  p.scale = scale;
  p.causal = causal != kCausalNone;
  p.causal_offset = causal == kCausalBottomRight ? d.len_k - d.len_q : 0;
  return {};
}

Error fill_common(FwdParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Dims& d, double scale,
                  int64_t causal) {
  FA_TRY(to_dtype(q.scalar_type(), "q", p.dtype));
  return fill_call(p, q, k, v, d, scale, causal);
}

// The optional features of one call, as the ops receive them (flashattn_ext/ops.py passes
// them by keyword; every default is "off").
struct Features {
  std::optional<Tensor> attn_bias;
  int64_t window_left = -1, window_right = -1;
  std::optional<Tensor> alibi_slopes;
  double softcap = 0.0;
  double dropout_p = 0.0;
  std::optional<Tensor> rng_state;
  std::optional<Tensor> cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  std::optional<Tensor> seqused_k, leftpad_k;
  std::optional<Tensor> block_table;
  const int32_t* seqused_before = nullptr;  // FwdParams::seqused_before, seqused_added, q_from_prior (kvcache_step)
  int64_t seqused_added = 0;
  bool q_from_prior = false;

  bool varlen() const { return cu_seqlens_q.has_value() || cu_seqlens_k.has_value(); }
  bool key_ranges() const { return seqused_k.has_value() || leftpad_k.has_value(); }
};

// Both on the CPU, or both on one CUDA device (a meta tensor is on neither).
bool same_device(const Tensor& a, const Tensor& b) {
  return (a.is_cpu() && b.is_cpu()) || (a.is_cuda() && b.is_cuda() && a.get_device_index() == b.get_device_index());
}

// Checks a cu_seqlens tensor, and, for a CPU one, that its values are offsets into `total` rows
// and that max_seqlen covers its longest sequence. A CUDA one is not read here (no copy to the
// host, so the op can be captured in a CUDA graph): the Python layer checks its values outside
// capture, and the kernels clamp every offset into the tensors (common/sequence.h).
Error check_cu_seqlens(const Tensor& cu, const char* name, const Tensor& q, int64_t batch_plus_one, int64_t total,
                       int64_t max_seqlen, const char* max_name) {
  FA_CHECK(cu.scalar_type() == ScalarType::Int, "flashattn: argument '", name, "' must have dtype int32, got ",
           dtype_name(cu.scalar_type()));
  FA_CHECK(cu.dim() == 1 && cu.size(0) >= 1 && cu.is_contiguous(), "flashattn: argument '", name,
           "' must be a contiguous 1-D tensor of batch + 1 >= 1 offsets, got shape ", shape_str(cu));
  FA_CHECK(cu.size(0) == batch_plus_one, "flashattn: arguments 'cu_seqlens_q' and 'cu_seqlens_k' must have "
           "the same length (batch + 1), got ", batch_plus_one, " and ", cu.size(0));
  FA_CHECK(same_device(cu, q), "flashattn: argument '", name, "' is on device ", device_str(cu),
           " but 'q' is on ", device_str(q), "; they must be on the same device");
  if (!cu.is_cpu()) return {};
  const int32_t* c = static_cast<const int32_t*>(cu.const_data_ptr());
  FA_CHECK(c[0] == 0, "flashattn: argument '", name, "' must start at 0, got ", c[0]);
  int64_t longest = 0;
  for (int64_t i = 0; i + 1 < cu.size(0); ++i) {
    FA_CHECK(c[i + 1] >= c[i], "flashattn: argument '", name, "' must be non-decreasing, got ", c[i],
             " then ", c[i + 1], " at index ", i + 1);
    longest = std::max<int64_t>(longest, c[i + 1] - c[i]);
  }
  FA_CHECK(c[cu.size(0) - 1] == total, "flashattn: argument '", name, "' must end at the total number of rows ",
           total, ", got ", c[cu.size(0) - 1]);
  FA_CHECK(max_seqlen >= longest, "flashattn: argument '", max_name, "' (", max_seqlen,
           ") is smaller than the longest sequence in '", name, "' (", longest, ")");
  return {};
}

// Checks seqused_k or leftpad_k: int32 (batch,) on q's device.
Error check_key_range_tensor(const Tensor& t, const char* name, const Tensor& q, int64_t batch) {
  FA_CHECK(t.scalar_type() == ScalarType::Int, "flashattn: argument '", name, "' must have dtype int32, got ",
           dtype_name(t.scalar_type()));
  FA_CHECK(t.dim() == 1 && t.size(0) == batch && t.is_contiguous(), "flashattn: argument '", name,
           "' must be a contiguous 1-D tensor of shape [", batch, "] (batch), got shape ", shape_str(t));
  FA_CHECK(same_device(t, q), "flashattn: argument '", name, "' is on device ", device_str(t), " but 'q' is on ",
           device_str(q), "; they must be on the same device");
  return {};
}

// Per-sequence key ranges of a padded batch: sequence b's keys are rows [leftpad_k[b], seqused_k[b])
// of k / v. Their values are read only where the kernels read them (sequence()), on every device:
// a CUDA decode step never waits for the device and a CUDA graph can capture it, and a CPU call
// behaves the same. A sequence outside 0 <= leftpad_k[b] <= seqused_k[b] <= len_k reads no key and
// gets NaN out and lse rows (an error the caller sees, never an access outside k / v).
Error check_and_fill_key_ranges(FwdParams& p, const Features& f, const Tensor& q, const Dims& d, int64_t causal) {
  FA_CHECK(f.seqused_k.has_value(), "flashattn: argument 'leftpad_k' needs 'seqused_k' (the end of each "
           "sequence's keys)");
  FA_CHECK(!f.varlen(), "flashattn: 'seqused_k' / 'leftpad_k' describe a padded batch; they cannot be combined "
           "with cu_seqlens (a variable-length batch)");
  FA_CHECK(!f.attn_bias.has_value(), "flashattn: the combination attn_bias + seqused_k (per-sequence key ranges) "
           "is not supported; mask the keys in the bias instead");
  FA_TRY(check_key_range_tensor(*f.seqused_k, "seqused_k", q, d.batch));
  if (f.leftpad_k.has_value()) FA_TRY(check_key_range_tensor(*f.leftpad_k, "leftpad_k", q, d.batch));
  p.seqused_k = static_cast<const int32_t*>(f.seqused_k->const_data_ptr());
  p.leftpad_k = f.leftpad_k.has_value() ? static_cast<const int32_t*>(f.leftpad_k->const_data_ptr()) : nullptr;
  p.causal_bottom_right = causal == kCausalBottomRight;
  return {};
}

// Checks block_table (int32 (batch, pages >= 1), last dimension contiguous, on q's device) against
// the pages k holds (num_blocks >= 1 blocks of page_size >= 1 rows): each sequence then has
// pages x page_size key rows, d.len_k.
Error check_block_table(const Tensor& t, const Tensor& q, const Tensor& k, Dims& d) {
  FA_CHECK(t.scalar_type() == ScalarType::Int, "flashattn: argument 'block_table' must have dtype int32, got ",
           dtype_name(t.scalar_type()));
  FA_CHECK(t.dim() == 2 && t.size(0) == d.batch && t.size(1) >= 1 && t.stride(1) == 1, "flashattn: argument "
           "'block_table' must be a (batch = ", d.batch, ", pages >= 1) tensor with a contiguous last dimension, got "
           "shape ", shape_str(t));
  FA_CHECK(same_device(t, q), "flashattn: argument 'block_table' is on device ", device_str(t), " but 'q' is on ",
           device_str(q), "; they must be on the same device");
  FA_CHECK(k.size(0) >= 1 && k.size(2) >= 1, "flashattn: with a block_table, k and v must be (num_blocks, heads, "
           "page_size, head_dim) pages with at least one block of at least one row, got k of shape ", shape_str(k));
  d.len_k = t.size(1) * k.size(2);
  return {};
}

// Fills the paged fields of p. CPU block numbers are checked for the pages that hold keys of
// their sequence (those within [leftpad_k, seqused_k) when given; the others may hold anything,
// e.g. -1, and so may every page of a sequence whose key range is invalid); CUDA ones are never
// read on the host and are clamped where the kernels read them.
Error fill_pages(FwdParams& p, const Tensor& t, const Tensor& k) {
  p.block_table = static_cast<const int32_t*>(t.const_data_ptr());
  p.block_table_stride = t.stride(0);
  p.num_blocks = k.size(0);
  p.page_size = k.size(2);
  if (!t.is_cpu()) return {};
  for (int64_t b = 0; b < p.batch; ++b) {
    const Seq sq = sequence(p, b);  // an invalid key range reads no page (its rows are NaN)
    const int64_t lo = sq.k0, end = sq.k0 + sq.len_k;  // (an empty range, lo = end, holds no page)
    for (int64_t page = lo / p.page_size; page * p.page_size < end && lo < end; ++page) {
      const int64_t block = p.block_table[b * p.block_table_stride + page];
      FA_CHECK(block >= 0 && block < p.num_blocks, "flashattn: argument 'block_table' has block ", block,
               " at [", b, ", ", page, "], which holds keys of sequence ", b, "; blocks must be in [0, num_blocks = ",
               p.num_blocks, ")");
    }
  }
  return {};
}

// Checks the features against q's shape and device and fills them into p. A variable-length
// batch turns p's batch into the number of sequences and its lengths into the longest ones.
Error check_and_fill_features(FwdParams& p, const Features& f, const Tensor& q, const Dims& d,
                              int64_t causal) {
  FA_CHECK(f.window_left >= -1 && f.window_right >= -1, "flashattn: argument 'window_size' must be (left, "
           "right) with each >= 0, or -1 for unbounded, got (", f.window_left, ", ", f.window_right, ")");
  FA_CHECK(f.softcap >= 0.0, "flashattn: argument 'softcap' must be >= 0 (0 = off), got ", f.softcap);
  FA_CHECK(f.max_seqlen_q >= 0 && f.max_seqlen_k >= 0, "flashattn: arguments 'max_seqlen_q' and 'max_seqlen_k' "
           "must be >= 0, got ", f.max_seqlen_q, " and ", f.max_seqlen_k);
  FA_CHECK(f.dropout_p >= 0.0 && f.dropout_p < 1.0, "flashattn: argument 'dropout_p' must be in [0, 1), got ",
           f.dropout_p);
  // A window reaching past every row and key (wider than len_q + len_k) is unbounded: -1 keeps the
  // band arithmetic (positions +- window) far from int64 overflow.
  const auto bounded = [&](int64_t w) { return w > d.len_q + d.len_k ? -1 : w; };
  p.window_left = bounded(f.window_left);
  p.window_right = bounded(f.window_right);
  // softcap * tanh(s / softcap) equals s in floating point once softcap is this large (and
  // infinity would give inf * tanh(0) = NaN): such a cap is no cap.
  p.softcap = f.softcap > double(std::numeric_limits<float>::max()) ? 0.0 : f.softcap;
  p.dropout_p = f.dropout_p;

  if (f.varlen()) {
    FA_CHECK(f.cu_seqlens_q.has_value() && f.cu_seqlens_k.has_value(),
             "flashattn: 'cu_seqlens_q' and 'cu_seqlens_k' must be given together");
    FA_CHECK(d.batch == 1, "flashattn: with cu_seqlens, q, k and v must be (1, heads, total, head_dim) views "
             "of packed (total, heads, head_dim) tensors, got batch size ", d.batch);
    FA_CHECK(!f.attn_bias.has_value(), "flashattn: the combination attn_bias + cu_seqlens (variable-length "
             "batches) is not supported; give a padded batch to use a mask");
    const int64_t n = f.cu_seqlens_q->dim() == 1 ? f.cu_seqlens_q->size(0) : 0;
    FA_TRY(check_cu_seqlens(*f.cu_seqlens_q, "cu_seqlens_q", q, n, d.len_q, f.max_seqlen_q, "max_seqlen_q"));
    FA_TRY(check_cu_seqlens(*f.cu_seqlens_k, "cu_seqlens_k", q, n, d.len_k, f.max_seqlen_k, "max_seqlen_k"));
    p.cu_seqlens_q = static_cast<const int32_t*>(f.cu_seqlens_q->const_data_ptr());
    p.cu_seqlens_k = static_cast<const int32_t*>(f.cu_seqlens_k->const_data_ptr());
    p.batch = n - 1;
    p.total_q = d.len_q;
    p.total_k = d.len_k;
    // No sequence is longer than all the rows: a larger bound only sizes grids and workspaces.
    p.len_q = std::min(f.max_seqlen_q, d.len_q);
    p.len_k = std::min(f.max_seqlen_k, d.len_k);
    p.causal_bottom_right = causal == kCausalBottomRight;
  }
  if (f.key_ranges()) FA_TRY(check_and_fill_key_ranges(p, f, q, d, causal));

  if (f.alibi_slopes.has_value()) {
    const Tensor& a = *f.alibi_slopes;
    const bool shape_ok = (a.dim() == 1 && a.size(0) == d.heads_q) ||
                          (a.dim() == 2 && a.size(0) == p.batch && a.size(1) == d.heads_q);
    FA_CHECK(shape_ok, "flashattn: argument 'alibi_slopes' must have shape [", d.heads_q, "] (heads) or [",
             p.batch, ", ", d.heads_q, "] (batch, heads), got ", shape_str(a));
    FA_CHECK(a.scalar_type() == ScalarType::Float, "flashattn: argument 'alibi_slopes' must have dtype "
             "float32, got ", dtype_name(a.scalar_type()));
    FA_CHECK(a.numel() == 0 || a.stride(a.dim() - 1) == 1, "flashattn: argument 'alibi_slopes' must have a "
             "contiguous last dimension (stride 1)");
    FA_CHECK(same_device(a, q), "flashattn: argument 'alibi_slopes' is on device ", device_str(a),
             " but 'q' is on ", device_str(q), "; they must be on the same device");
    p.alibi_slopes = static_cast<const float*>(a.const_data_ptr());
    p.alibi_batch_stride = a.dim() == 2 ? a.stride(0) : 0;
  }

  if (f.attn_bias.has_value()) {
    const Tensor& m = *f.attn_bias;
    const int64_t full[4] = {d.batch, d.heads_q, d.len_q, d.len_k};
    bool shape_ok = m.dim() == 4;
    for (int64_t i = 0; shape_ok && i < 4; ++i) shape_ok = m.size(i) == full[i] || m.size(i) == 1;
    FA_CHECK(shape_ok, "flashattn: argument 'attn_bias' must have shape [", d.batch, ", ", d.heads_q, ", ",
             d.len_q, ", ", d.len_k, "] (batch, heads, len_q, len_k), each dimension possibly 1 "
             "(broadcast), got ", shape_str(m));
    const ScalarType t = m.scalar_type();
    FA_CHECK(t == ScalarType::Bool || t == q.scalar_type() || t == ScalarType::Float,
             "flashattn: argument 'attn_bias' has dtype ", dtype_name(t), "; it must be bool (True = take "
             "part), or float in the query's dtype (", dtype_name(q.scalar_type()), ") or float32");
    FA_CHECK(same_device(m, q), "flashattn: argument 'attn_bias' is on device ", device_str(m),
             " but 'q' is on ", device_str(q), "; they must be on the same device");
    p.bias_kind = t == ScalarType::Bool ? BiasKind::kBool : BiasKind::kFloat;
    if (t != ScalarType::Bool) FA_TRY(to_dtype(t, "attn_bias", p.bias_dtype));
    p.bias = m.const_data_ptr();
    for (int64_t i = 0; i < 4; ++i) p.bias_stride[i] = m.size(i) == 1 ? 0 : m.stride(i);
  }

  if (f.dropout_p > 0.0) {
    FA_CHECK(f.rng_state.has_value(), "flashattn: dropout_p > 0 needs argument 'rng_state' (int64 [seed, "
             "offset], on the CPU or on q's device)");
    const Tensor& r = *f.rng_state;
    FA_CHECK((r.is_cpu() || same_device(r, q)) && r.scalar_type() == ScalarType::Long && r.dim() == 1 &&
                 r.size(0) == 2 && r.is_contiguous(),
             "flashattn: argument 'rng_state' must be a contiguous int64 tensor [seed, offset] on the CPU or on "
             "q's device, got shape ", shape_str(r), " and dtype ", dtype_name(r.scalar_type()), " on ",
             device_str(r));
    const int64_t* st = static_cast<const int64_t*>(r.const_data_ptr());
    if (r.is_cpu()) {
      p.dropout_seed = uint64_t(st[0]);
      p.dropout_offset = uint32_t(uint64_t(st[1]));
    } else {
      p.dropout_state = st;
    }
  }
  return {};
}

#ifdef FLASHATTN_WITH_CUDA
Error current_cuda_stream(const Tensor& t, void*& stream) {
  FA_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream) == AOTI_TORCH_SUCCESS,
           "flashattn: could not get the current CUDA stream of device ", t.get_device_index());
  return {};
}
#endif

// The backend of q's device runs p, with the workspace it asks for allocated here: the CPU's sized
// first; the CUDA backend asks for its own once it has planned the call (cuda::AllocateWorkspace).
template <class Params, class CpuBytes, class RunCpu, class RunCuda>
Error run_backend(Params& p, const Tensor& q, CpuBytes cpu_bytes, RunCpu run_cpu, RunCuda run_cuda) {
  struct Workspace {
    const Tensor& like;
    Tensor tensor;  // held until the kernels are queued: the allocator's stream order covers them
    Error error;
  } ws{q, {}, {}};
  // (One capture: std::function keeps it without allocating.)
  const auto allocate_workspace = [&ws](size_t bytes, void*& workspace) {
    workspace = nullptr;
    if (bytes == 0) return true;
    ws.error = allocate({static_cast<int64_t>(bytes)}, ScalarType::Byte, ws.like, "the workspace", ws.tensor);
    if (ws.error) return false;
    workspace = ws.tensor.mutable_data_ptr();
    return true;
  };
  if (q.is_cpu()) {
    p.workspace_bytes = cpu_bytes(p);
    if (!allocate_workspace(p.workspace_bytes, p.workspace)) return ws.error;
    run_cpu(p);
    return {};
  }
#ifdef FLASHATTN_WITH_CUDA
  torch::stable::accelerator::DeviceGuard guard(q.get_device_index());
  void* stream = nullptr;
  FA_TRY(current_cuda_stream(q, stream));
  const std::string failure = run_cuda(p, stream, allocate_workspace);
  FA_TRY(ws.error);
  FA_CHECK(failure.empty(), failure);
  return {};
#else
  (void)run_cuda;
  return error_of("RuntimeError", "flashattn: this build of flashattn_ext has no CUDA kernels; reinstall it with nvcc "
                  "and a CUDA build of torch present");
#endif
}

#ifdef FLASHATTN_WITH_CUDA
#define FLASHATTN_CUDA_FWD cuda::run_fwd
#define FLASHATTN_CUDA_BWD cuda::run_bwd
#else
#define FLASHATTN_CUDA_FWD nullptr
#define FLASHATTN_CUDA_BWD nullptr
#endif

// A forward's out (laid out as q) and lse, pointed to by p; `done` where nothing is left to compute (no
// output; no key: out = 0, lse = -inf).
Error fwd_outputs(FwdParams& p, const Tensor& q, const Dims& d, ScalarType out_type, ScalarType lse_type, Tensor& out,
                  Tensor& lse, bool& done) {
  FA_TRY(empty_like_layout(q, d.heads_q, d.len_q, d.head_dim_v, out_type, "out", out));
  FA_TRY(allocate({d.batch, d.heads_q, d.len_q}, lse_type, q, "lse", lse));
  done = out.numel() == 0 || d.len_k == 0;
  if (out.numel() == 0) return {};
  if (d.len_k == 0) {  // every row is fully masked
    torch::stable::zero_(out);
    torch::stable::fill_(lse, -std::numeric_limits<double>::infinity());
    return {};
  }
  p.out = out.mutable_data_ptr();
  p.out_stride = strides_of(out);
  p.lse = lse.mutable_data_ptr();
  return {};
}

// A forward call's checks and Params, its outputs not yet allocated (fwd_outputs).
Error fwd_params(const Tensor& q, const Tensor& k, const Tensor& v, double scale, int64_t causal, const Features& f,
                 FwdParams& p, Dims& d) {
  FA_TRY(check_qkv(q, k, v, causal, d, f.block_table.has_value()));
  if (f.block_table.has_value()) {
    FA_CHECK(!f.varlen(), "flashattn: a 'block_table' (paged k / v) cannot be combined with cu_seqlens (a "
             "variable-length batch); give per-sequence lengths as seqused_k");
    FA_TRY(check_block_table(*f.block_table, q, k, d));
  }
  FA_TRY(fill_common(p, q, k, v, d, scale, causal));
  FA_TRY(check_and_fill_features(p, f, q, d, causal));
  if (f.block_table.has_value()) FA_TRY(fill_pages(p, *f.block_table, k));
  p.seqused_before = f.seqused_before;
  p.seqused_added = f.seqused_added;
  p.q_from_prior = f.q_from_prior;
  return {};
}

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

// Strides of a gradient or output of `heads` x `len` x `dim` as the ops allocate it beside `like`
// (empty_like_layout): (batch, len, heads, dim) memory order for a transposed flash-attn view.
Strides allocated_strides(const Tensor& like, int64_t heads, int64_t len, int64_t dim) {
  if (like.size(1) > 1 && like.size(2) > 1 && like.stride(1) < like.stride(2))
    return Strides{len * heads * dim, dim, heads * dim};
  return Strides{heads * len * dim, len * dim, dim};
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

// An int32 tensor of `batch` values (a KV-cache step's per-sequence ones), contiguous, on the caches' device.
Error check_per_sequence(const Tensor& t, const char* name, const Tensor& cache, int64_t batch) {
  FA_CHECK(t.scalar_type() == ScalarType::Int, "flashattn: argument '", name, "' must have dtype int32, got ",
           dtype_name(t.scalar_type()));
  FA_CHECK(t.dim() == 1 && t.size(0) == batch && t.is_contiguous(), "flashattn: argument '", name,
           "' must be a contiguous 1-D tensor of shape [", batch, "] (batch), got shape ", shape_str(t));
  FA_CHECK(same_device(t, cache), "flashattn: argument '", name, "' is on device ", device_str(t),
           " but 'k_cache' is on ", device_str(cache), "; they must be on the same device");
  return {};
}

// The rotary arguments of a KV-cache append (AppendParams' rotary fields; p's sizes already set):
// tables (positions >= 1, rotary_dim / 2) in the caches' dtype or float32, and q (batch, len_q,
// heads_q, head_dim) with q_rotated, its output, given together and only with the tables.
Error check_rotary(const Tensor& k_cache, const std::optional<Tensor>& rotary_cos,
                   const std::optional<Tensor>& rotary_sin, bool rotary_interleaved, const std::optional<Tensor>& q,
                   const std::optional<Tensor>& q_rotated, bool q_rows_consecutive, AppendParams& p) {
  FA_CHECK(rotary_cos.has_value() == rotary_sin.has_value(),
           "flashattn: arguments 'rotary_cos' and 'rotary_sin' must be given together");
  FA_CHECK(q.has_value() == q_rotated.has_value(), "flashattn: arguments 'q' and 'q_rotated' must be given together");
  FA_CHECK(!q.has_value() || rotary_cos.has_value(),
           "flashattn: argument 'q' needs 'rotary_cos' and 'rotary_sin' (q is passed to be rotated)");
  if (!rotary_cos.has_value()) return {};
  const std::pair<const Tensor*, const char*> tables[] = {{&*rotary_cos, "rotary_cos"}, {&*rotary_sin, "rotary_sin"}};
  for (const auto& [t, name] : tables) {
    FA_CHECK(t->dim() == 2 && (t->size(1) <= 1 || t->stride(1) == 1), "flashattn: argument '", name,
             "' must have 2 dimensions (positions, rotary_dim / 2) with a contiguous last one (stride 1), got shape ",
             shape_str(*t));
    FA_CHECK(t->scalar_type() == k_cache.scalar_type() || t->scalar_type() == ScalarType::Float,
             "flashattn: argument '", name, "' has dtype ", dtype_name(t->scalar_type()), "; it must be k_cache's (",
             dtype_name(k_cache.scalar_type()), ") or float32");
    FA_CHECK(same_device(*t, k_cache), "flashattn: argument '", name, "' is on device ", device_str(*t),
             " but 'k_cache' is on ", device_str(k_cache), "; they must be on the same device");
  }
  const Tensor& cos = *rotary_cos;
  const Tensor& sin = *rotary_sin;
  FA_CHECK(sin.size(0) == cos.size(0) && sin.size(1) == cos.size(1) && sin.scalar_type() == cos.scalar_type(),
           "flashattn: argument 'rotary_sin' has shape ", shape_str(sin), " and dtype ", dtype_name(sin.scalar_type()),
           " but 'rotary_cos' has ", shape_str(cos), " and ", dtype_name(cos.scalar_type()), "; they must match");
  FA_CHECK(cos.size(0) >= 1 && cos.size(1) >= 1 && 2 * cos.size(1) <= p.head_dim,
           "flashattn: argument 'rotary_cos' must hold at least one position and rotary_dim = 2 * ", cos.size(1),
           " between 2 and head_dim = ", p.head_dim, ", got shape ", shape_str(cos));
  p.rotary_cos = cos.const_data_ptr();
  p.rotary_sin = sin.const_data_ptr();
  p.rotary_cos_stride = cos.stride(0);
  p.rotary_sin_stride = sin.stride(0);
  p.rotary_positions = cos.size(0);
  p.rotary_half = cos.size(1);
  p.rotary_table_f32 = cos.scalar_type() == ScalarType::Float;
  p.rotary_interleaved = rotary_interleaved;
  if (!q.has_value()) return {};
  const std::pair<const Tensor*, const char*> queries[] = {{&*q, "q"}, {&*q_rotated, "q_rotated"}};
  for (const auto& [t, name] : queries) {
    FA_CHECK(t->dim() == 4 && (t->size(3) <= 1 || t->stride(3) == 1), "flashattn: argument '", name,
             "' must have 4 dimensions (batch, len_q, heads_q, head_dim) with a contiguous last one (stride 1), got "
             "shape ", shape_str(*t));
    FA_TRY(check_same_device_dtype(k_cache, "k_cache", *t, name));
    FA_TRY(check_size(*t, name, 0, p.batch, "batch size (must equal k's)"));
    FA_TRY(check_size(*t, name, 3, p.head_dim, "head_dim (must equal k_cache's)"));
  }
  FA_TRY(check_size(*q_rotated, "q_rotated", 1, q->size(1), "number of rows (must equal q's)"));
  FA_TRY(check_size(*q_rotated, "q_rotated", 2, q->size(2), "number of heads (must equal q's)"));
  // (batch, len, heads, dim) tensors: Strides' head and row are their dimensions 2 and 1.
  p.q = q->const_data_ptr();
  p.q_rotated = q_rotated->mutable_data_ptr();
  p.q_stride = Strides{q->stride(0), q->stride(2), q->stride(1)};
  p.q_rotated_stride = Strides{q_rotated->stride(0), q_rotated->stride(2), q_rotated->stride(1)};
  p.len_q = q->size(1);
  p.heads_q = q->size(2);
  p.q_rows_consecutive = q_rows_consecutive;
  return {};
}

// The in-place append of a KV-cache step (flash_attn_with_kvcache's layout): k, v (batch, len_new,
// heads_kv, dim) written into k_cache, v_cache (rows, keys, heads_kv, dim), or into their pages
// (blocks, page_size, heads_kv, dim) through block_table, at keys seqlens[b].. of each sequence
// (common/append.h). seqused gets where each sequence's keys end, -1 where its values (lengths,
// left padding, cache row, the blocks of the pages that hold its keys) allow no step. The values
// are read only where the backends read them (a CUDA step never waits). With rotary tables the new
// keys are written rotated, and q's rows rotated into q_rotated, in the same launch (check_rotary).
// append_params: the argument checks of an append, and its AppendParams but the seqused output's.
Error append_params(const Tensor& k_cache, const Tensor& v_cache, const Tensor& k, const Tensor& v,
                    const Tensor& seqlens, const std::optional<Tensor>& batch_idx,
                    const std::optional<Tensor>& block_table, const std::optional<Tensor>& leftpad,
                    const std::optional<Tensor>& rotary_cos, const std::optional<Tensor>& rotary_sin,
                    bool rotary_interleaved, const std::optional<Tensor>& q, const std::optional<Tensor>& q_rotated,
                    bool q_rows_consecutive, AppendParams& p) {
  const std::pair<const Tensor*, const char*> named[] = {
      {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&k, "k"}, {&v, "v"}};
  for (const auto& [t, name] : named) {
    FA_CHECK(t->dim() == 4 && (t->size(3) <= 1 || t->stride(3) == 1), "flashattn: argument '", name,
             "' must have 4 dimensions with a contiguous last one (stride 1), got shape ", shape_str(*t));
    FA_CHECK(t->is_cpu() || t->is_cuda(), "flashattn: argument '", name, "' must be on a CPU or CUDA device");
  }
  FA_TRY(to_dtype(k_cache.scalar_type(), "k_cache", p.dtype));
  FA_TRY(check_same_device_dtype(k_cache, "k_cache", v_cache, "v_cache"));
  FA_TRY(check_same_device_dtype(k_cache, "k_cache", k, "k"));
  FA_TRY(check_same_device_dtype(k_cache, "k_cache", v, "v"));
  p.batch = k.size(0);
  p.len_new = k.size(1);
  p.heads_kv = k_cache.size(2);
  p.head_dim = k_cache.size(3);
  p.head_dim_v = v_cache.size(3);
  const char* cache_dims[3] = {"number of rows (blocks when paged) (must equal k_cache's)",
                               "number of keys (page size when paged) (must equal k_cache's)",
                               "number of heads (must equal k_cache's)"};
  for (int64_t i = 0; i < 3; ++i) FA_TRY(check_size(v_cache, "v_cache", i, k_cache.size(i), cache_dims[i]));
  const char* new_dims[4] = {"batch size (must equal k's)", "number of new rows (must equal k's)",
                             "number of heads (must equal k_cache's)", "head_dim (must equal its cache's)"};
  const int64_t k_shape[4] = {p.batch, p.len_new, p.heads_kv, p.head_dim};
  const int64_t v_shape[4] = {p.batch, p.len_new, p.heads_kv, p.head_dim_v};
  for (int64_t i = 0; i < 4; ++i) {
    FA_TRY(check_size(k, "k", i, k_shape[i], new_dims[i]));
    FA_TRY(check_size(v, "v", i, v_shape[i], new_dims[i]));
  }
  FA_TRY(check_per_sequence(seqlens, "seqlens", k_cache, p.batch));
  p.cache_rows = k_cache.size(0);
  p.cache_len = k_cache.size(1);
  if (block_table.has_value()) {
    const Tensor& t = *block_table;
    FA_CHECK(!batch_idx.has_value(), "flashattn: arguments 'batch_idx' and 'block_table' cannot be combined");
    FA_CHECK(t.scalar_type() == ScalarType::Int && t.dim() == 2 && t.size(0) == p.batch && t.size(1) >= 1 &&
                 t.stride(1) == 1 && same_device(t, k_cache),
             "flashattn: argument 'block_table' must be an int32 (batch = ", p.batch, ", pages >= 1) tensor with a "
             "contiguous last dimension on k_cache's device, got shape ", shape_str(t));
    FA_CHECK(p.cache_rows >= 1 && p.cache_len >= 1, "flashattn: a paged k_cache needs at least one block of at "
             "least one row, got shape ", shape_str(k_cache));
    p.block_table = static_cast<const int32_t*>(t.const_data_ptr());
    p.block_table_stride = t.stride(0);
    p.page_size = p.cache_len;
    p.cache_len = t.size(1) * p.page_size;
  } else if (batch_idx.has_value()) {
    FA_TRY(check_per_sequence(*batch_idx, "batch_idx", k_cache, p.batch));
    p.batch_idx = static_cast<const int32_t*>(batch_idx->const_data_ptr());
  } else {
    FA_TRY(check_size(k_cache, "k_cache", 0, p.batch, "batch size (one cache row per sequence)"));
  }
  if (leftpad.has_value()) {
    FA_TRY(check_per_sequence(*leftpad, "leftpad", k_cache, p.batch));
    p.leftpad = static_cast<const int32_t*>(leftpad->const_data_ptr());
  }
  FA_TRY(check_rotary(k_cache, rotary_cos, rotary_sin, rotary_interleaved, q, q_rotated, q_rows_consecutive, p));
  p.k_cache = k_cache.mutable_data_ptr();
  p.v_cache = v_cache.mutable_data_ptr();
  // (batch, len, heads, dim) tensors: Strides' head and row are their dimensions 2 and 1.
  const auto strides = [](const Tensor& t) { return Strides{t.stride(0), t.stride(2), t.stride(1)}; };
  p.k_cache_stride = strides(k_cache);
  p.v_cache_stride = strides(v_cache);
  p.k = k.const_data_ptr();
  p.v = v.const_data_ptr();
  p.k_stride = strides(k);
  p.v_stride = strides(v);
  p.seqlens = static_cast<const int32_t*>(seqlens.const_data_ptr());
  return {};
}

Error kvcache_append(Tensor k_cache, Tensor v_cache, Tensor k, Tensor v, Tensor seqlens,
                     const std::optional<Tensor>& batch_idx, const std::optional<Tensor>& block_table,
                     const std::optional<Tensor>& leftpad, const std::optional<Tensor>& rotary_cos,
                     const std::optional<Tensor>& rotary_sin, bool rotary_interleaved, const std::optional<Tensor>& q,
                     const std::optional<Tensor>& q_rotated, bool q_rows_consecutive, Tensor& seqused) {
  AppendParams p;
  FA_TRY(append_params(k_cache, v_cache, k, v, seqlens, batch_idx, block_table, leftpad, rotary_cos, rotary_sin,
                       rotary_interleaved, q, q_rotated, q_rows_consecutive, p));
  FA_TRY(allocate({p.batch}, ScalarType::Int, k_cache, "seqused", seqused));
  p.seqused = static_cast<int32_t*>(seqused.mutable_data_ptr());
  if (k_cache.is_cpu()) {
    cpu::run_append(p);
    return {};
  }
#ifdef FLASHATTN_WITH_CUDA
  torch::stable::accelerator::DeviceGuard guard(k_cache.get_device_index());
  void* stream = nullptr;
  FA_TRY(current_cuda_stream(k_cache, stream));
  const std::string failure = cuda::run_append(p, stream);
  FA_CHECK(failure.empty(), failure);
  return {};
#else
  return error_of("RuntimeError", "flashattn: this build of flashattn_ext has no CUDA kernels");
#endif
}

// t (4-D) with its dimensions 1 and 2 swapped: flash_attn_with_kvcache's (batch, len, heads, dim)
// tensors as the (batch, heads, len, dim) views fwd reads, and fwd's out back. A tensor over t's
// storage made by the C shim, not aten::transpose through the dispatcher: each transpose cost a
// decode step about as much host time as its checks.
Error swap_len_heads(const Tensor& t, const char* what, Tensor& swapped) {
  const int64_t sizes[4] = {t.size(0), t.size(2), t.size(1), t.size(3)};
  const int64_t strides[4] = {t.stride(0), t.stride(2), t.stride(1), t.stride(3)};
  AtenTensorHandle handle = nullptr;
  FA_CHECK(aoti_torch__reinterpret_tensor(t.get(), 4, sizes, strides, 0, &handle) == AOTI_TORCH_SUCCESS,
           "flashattn: could not make the (batch, heads, len, dim) view of ", what);
  swapped = Tensor(handle);
  return {};
}

// A KV-cache step's attention as fwd takes it: q and the caches as (batch, heads, len, dim) views (swap_len_heads),
// and the features of the caches' key ranges (each sequence's end, left padding, pages).
struct StepAttention {
  Tensor q, k, v;
  Features f;
};
Error step_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const std::optional<Tensor>& seqused, const std::optional<Tensor>& leftpad,
                     const std::optional<Tensor>& block_table, StepAttention& a) {
  FA_TRY(swap_len_heads(q, "q", a.q));
  FA_TRY(swap_len_heads(k_cache, "k_cache", a.k));
  FA_TRY(swap_len_heads(v_cache, "v_cache", a.v));
  a.f.seqused_k = seqused;
  a.f.leftpad_k = leftpad;
  a.f.block_table = block_table;
  return {};
}

// The strides torch.empty_like(t) gives a new tensor (t's last dimension contiguous): t's own where t
// is non-overlapping and dense (its elements fill its span once, in any dimension order), else
// contiguous ones. The rotated q of a step is laid out as the step's Python made it.
std::vector<int64_t> empty_like_strides(const Tensor& t) {
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < t.dim(); ++d) dims.push_back(d);
  std::stable_sort(dims.begin(), dims.end(), [&](int64_t a, int64_t b) { return t.stride(a) < t.stride(b); });
  int64_t expected = 1;
  bool dense = true;
  for (const int64_t d : dims) {
    if (t.size(d) == 1) continue;
    dense = dense && t.stride(d) == expected;
    expected *= t.size(d);
  }
  std::vector<int64_t> shape, strides;
  for (int64_t d = 0; d < t.dim(); ++d) {
    shape.push_back(t.size(d));
    strides.push_back(t.stride(d));
  }
  return dense ? strides : contiguous_strides(shape);
}

// Views of no new rows over the caches ((batch, 0, heads_kv, dim)): the append of a step that appends
// nothing, its value rules alone.
Error no_new_rows(const Tensor& k_cache, const Tensor& v_cache, int64_t batch, Tensor& k_new, Tensor& v_new) {
  const int64_t k_sizes[4] = {batch, 0, k_cache.size(2), k_cache.size(3)};
  const int64_t v_sizes[4] = {batch, 0, v_cache.size(2), v_cache.size(3)};
  const int64_t k_strides[4] = {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3)};
  const int64_t v_strides[4] = {v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3)};
  AtenTensorHandle k_handle = nullptr, v_handle = nullptr;
  FA_CHECK(aoti_torch__reinterpret_tensor(k_cache.get(), 4, k_sizes, k_strides, 0, &k_handle) == AOTI_TORCH_SUCCESS &&
               aoti_torch__reinterpret_tensor(v_cache.get(), 4, v_sizes, v_strides, 0, &v_handle) ==
                   AOTI_TORCH_SUCCESS,
           "flashattn: could not make the empty views of the new rows");
  k_new = Tensor(k_handle);
  v_new = Tensor(v_handle);
  return {};
}

#ifdef FLASHATTN_WITH_CUDA
// A CUDA step without rotary tables whose attention the decode kernel serves: that kernel alone, no append launch
// (which costs a step 1-6 µs on an H200). Its sequence() gives a sequence whose lengths or left padding break the
// append's rules (0 <= leftpad <= seqlens, seqlens + the new rows <= the cache's keys) no key and NaN rows, as the
// append's seqused -1 does, and it applies the page rule where it reads the pages (FwdParams::check_pages). New rows
// (k, v) it writes into the caches itself, once their sequence's rules hold (FwdParams::new_k; the append's argument
// checks first, append_params). Where another kernel takes the attention, a read-only step runs the append's launch
// first for the rules (the gather that copies the pages for those kernels checks no block); a step with new rows is
// not taken (taken = false, nothing done), nor is one whose problem is empty or whose new rows do not start on 16
// bytes (the kernel's copies): the append's launch and fwd run it.
Error direct_cuda_step(const Tensor& k_cache, const Tensor& v_cache, const Tensor& q, const std::optional<Tensor>& k,
                       const std::optional<Tensor>& v, const Tensor& seqlens, const std::optional<Tensor>& block_table,
                       const std::optional<Tensor>& leftpad, double scale, bool causal, Tensor& out, Tensor& lse,
                       bool& taken) {
  taken = false;
  AppendParams ap;
  if (k.has_value()) {
    FA_TRY(append_params(k_cache, v_cache, *k, *v, seqlens, std::nullopt, block_table, leftpad, std::nullopt,
                         std::nullopt, true, std::nullopt, std::nullopt, false, ap));
    if (q.size(0) == 0 || q.size(1) == 0 || q.size(2) == 0) return {};
    for (const Tensor* t : {&*k, &*v}) {
      const int64_t bytes = int64_t(dtype_size(ap.dtype));
      if (reinterpret_cast<uintptr_t>(t->const_data_ptr()) % 16 != 0) return {};
      for (int64_t d = 0; d < 3; ++d)
        if (t->size(d) > 1 && t->stride(d) * bytes % 16 != 0) return {};
    }
  } else {  // (named as the append names them, before fwd's checks would call them seqused_k and leftpad_k)
    FA_TRY(check_per_sequence(seqlens, "seqlens", k_cache, q.size(0)));
    if (leftpad.has_value()) FA_TRY(check_per_sequence(*leftpad, "leftpad", k_cache, q.size(0)));
  }
  StepAttention a{q, q, q, {}};
  FA_TRY(step_attention(q, k_cache, v_cache, seqlens, leftpad, block_table, a));
  FwdParams p;
  Dims d;
  FA_TRY(fwd_params(a.q, a.k, a.v, scale, causal ? kCausalBottomRight : kCausalNone, a.f, p, d));
  bool done = false;
  Tensor out_view = q;
  FA_TRY(fwd_outputs(p, a.q, d, q.scalar_type(), lse_type(q.scalar_type()), out_view, lse, done));
  torch::stable::accelerator::DeviceGuard guard(q.get_device_index());  // (the plan is the device's)
  const bool decode = !done && cuda::decode_serves(p);
  if (k.has_value() && !decode) return {};
  taken = true;
  if (!done) {
    Tensor used = seqlens;  // (held until the attention is queued)
    if (decode) {
      p.check_pages = true;
      if (k.has_value()) {
        p.new_k = k->const_data_ptr();
        p.new_v = v->const_data_ptr();
        p.new_k_stride = ap.k_stride;
        p.new_v_stride = ap.v_stride;
        p.new_rows = k->size(1);
      }
    } else {
      Tensor k_new = q, v_new = q;
      FA_TRY(no_new_rows(k_cache, v_cache, q.size(0), k_new, v_new));
      FA_TRY(kvcache_append(k_cache, v_cache, k_new, v_new, seqlens, std::nullopt, block_table, leftpad, std::nullopt,
                            std::nullopt, true, std::nullopt, std::nullopt, false, used));
      p.seqused_k = static_cast<const int32_t*>(used.const_data_ptr());
    }
    FA_TRY(run_backend(p, a.q, cpu::fwd_workspace_bytes, cpu::run_fwd, FLASHATTN_CUDA_FWD));
  }
  return swap_len_heads(out_view, "out", out);
}
#endif

// A common decode step of flash_attn_with_kvcache (flashattn_ext/_kvcache_fast.py, which has
// checked its arguments) in one op call: where there are new rows, rotary tables, pages or left
// padding, kvcache_append (the new keys and values written in place, q rotated into a new tensor,
// the value rules: seqused -1 for a sequence that breaks one), then fwd on the caches themselves
// with each sequence's key range (seqused_k, leftpad_k, the block table); a CUDA step without rotary
// tables whose attention the decode kernel serves is that kernel alone (direct_cuda_step). q, k, v, the
// caches and out in flash_attn_with_kvcache's (batch, len, heads, dim) layout; lse (batch, heads_q,
// len_q). The same two calls as the op-by-op composition, with one dispatch instead of two plus the
// transposes and the zero-row k / v of a read-only step.
Error kvcache_step(Tensor k_cache, Tensor v_cache, Tensor q, const std::optional<Tensor>& k,
                   const std::optional<Tensor>& v, const std::optional<Tensor>& seqlens,
                   const std::optional<Tensor>& block_table, const std::optional<Tensor>& leftpad,
                   const std::optional<Tensor>& rotary_cos, const std::optional<Tensor>& rotary_sin,
                   bool rotary_interleaved, double scale, bool causal, Tensor& out, Tensor& lse) {
  const std::pair<const Tensor*, const char*> named[] = {{&q, "q"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}};
  for (const auto& [t, name] : named) {
    FA_CHECK(t->dim() == 4, "flashattn: argument '", name, "' must have 4 dimensions (batch, len, heads, head_dim), "
             "got shape ", shape_str(*t));
  }
  FA_CHECK(k.has_value() == v.has_value(), "flashattn: arguments 'k' and 'v' must be given together");
  const bool rotary = rotary_cos.has_value();
  std::optional<Tensor> seqused = seqlens;
  bool appended_on_cuda = false;
  Tensor q_attended = q;
  if (k.has_value() || rotary || block_table.has_value() || leftpad.has_value()) {
    FA_CHECK(seqlens.has_value(), "flashattn: argument 'seqlens' is needed with new rows, rotary tables, a "
             "'block_table' or 'leftpad'");
#ifdef FLASHATTN_WITH_CUDA
    if (q.is_cuda() && !rotary) {
      bool taken = false;
      FA_TRY(direct_cuda_step(k_cache, v_cache, q, k, v, *seqlens, block_table, leftpad, scale, causal, out, lse,
                              taken));
      if (taken) return {};
    }
#endif
    Tensor k_new = q, v_new = q;
    if (k.has_value()) {
      k_new = *k;
      v_new = *v;
    } else {
      FA_TRY(no_new_rows(k_cache, v_cache, q.size(0), k_new, v_new));
    }
    std::optional<Tensor> q_rotated;
    if (rotary) {
      Tensor t = q;
      FA_TRY(allocate_strided({q.size(0), q.size(1), q.size(2), q.size(3)}, empty_like_strides(q), q.scalar_type(), q,
                              "q_rotated", t));
      q_rotated = t;
    }
    Tensor used = q;
    FA_TRY(kvcache_append(k_cache, v_cache, k_new, v_new, *seqlens, std::nullopt, block_table, leftpad, rotary_cos,
                          rotary_sin, rotary_interleaved, rotary ? std::optional<Tensor>(q) : std::nullopt, q_rotated,
                          causal, used));
    seqused = used;
    appended_on_cuda = q.is_cuda();
    if (rotary) q_attended = *q_rotated;
  }
  StepAttention a{q, q, q, {}};
  FA_TRY(step_attention(q_attended, k_cache, v_cache, seqused, leftpad, block_table, a));
  Features& f = a.f;
  if (appended_on_cuda) {
    f.seqused_before = static_cast<const int32_t*>(seqlens->const_data_ptr());
    f.seqused_added = k.has_value() ? k->size(1) : 0;
    f.q_from_prior = rotary;  // (q_attended: the append's rotated q)
  }
  Tensor out_view = q;
  FA_TRY(fwd(a.q, a.k, a.v, scale, causal ? kCausalBottomRight : kCausalNone, f, out_view, lse));
  return swap_len_heads(out_view, "out", out);
}

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
