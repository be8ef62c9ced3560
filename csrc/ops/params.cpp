#include "params.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <torch/csrc/stable/ops.h>

#include "../common/sequence.h"

namespace flashattn::ops {
namespace {

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

}  // namespace

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

}  // namespace flashattn::ops
