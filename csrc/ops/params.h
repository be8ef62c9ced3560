// A call's checks and Params: the tensors, sizes and scale of q, k, v, and the optional features.
#pragma once
#include <optional>

#include "../params.h"
#include "tensors.h"

namespace flashattn::ops {

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

// p's tensors, sizes, scale and causal alignment (p.dtype set first: it bounds the scale).
Error fill_call(FwdParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Dims& d, double scale,
                int64_t causal);
// fill_call with p.dtype from q's.
Error fill_common(FwdParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Dims& d, double scale,
                  int64_t causal);
Error check_block_table(const Tensor& t, const Tensor& q, const Tensor& k, Dims& d);
Error fill_pages(FwdParams& p, const Tensor& t, const Tensor& k);
Error check_and_fill_features(FwdParams& p, const Features& f, const Tensor& q, const Dims& d, int64_t causal);
Error fwd_outputs(FwdParams& p, const Tensor& q, const Dims& d, ScalarType out_type, ScalarType lse_type, Tensor& out,
                  Tensor& lse, bool& done);
Error fwd_params(const Tensor& q, const Tensor& k, const Tensor& v, double scale, int64_t causal, const Features& f,
                 FwdParams& p, Dims& d);

}  // namespace flashattn::ops
