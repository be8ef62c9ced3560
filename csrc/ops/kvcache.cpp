#include "kvcache.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "backend.h"

namespace flashattn::ops {
namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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

}  // namespace flashattn::ops
