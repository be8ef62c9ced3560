// flash_attn_with_kvcache's ops: the in-place append of new keys and values (rotary, pages, left padding, cache row
// indirection) and a whole decode step in one call.
#pragma once
#include <optional>

#include "tensors.h"

namespace flashattn::ops {

Error kvcache_append(Tensor k_cache, Tensor v_cache, Tensor k, Tensor v, Tensor seqlens,
                     const std::optional<Tensor>& batch_idx, const std::optional<Tensor>& block_table,
                     const std::optional<Tensor>& leftpad, const std::optional<Tensor>& rotary_cos,
                     const std::optional<Tensor>& rotary_sin, bool rotary_interleaved, const std::optional<Tensor>& q,
                     const std::optional<Tensor>& q_rotated, bool q_rows_consecutive, Tensor& seqused);
Error kvcache_step(Tensor k_cache, Tensor v_cache, Tensor q, const std::optional<Tensor>& k,
                   const std::optional<Tensor>& v, const std::optional<Tensor>& seqlens,
                   const std::optional<Tensor>& block_table, const std::optional<Tensor>& leftpad,
                   const std::optional<Tensor>& rotary_cos, const std::optional<Tensor>& rotary_sin,
                   bool rotary_interleaved, double scale, bool causal, Tensor& out, Tensor& lse);

}  // namespace flashattn::ops
