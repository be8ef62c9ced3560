// The attention ops' bodies: forward, float8 forward, backward, and the test helpers (dropout mask, kernel plan).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "params.h"

namespace flashattn::ops {

Error fwd(Tensor q, Tensor k, Tensor v, double scale, int64_t causal, const Features& f, Tensor& out, Tensor& lse);
#ifdef FLASHATTN_WITH_CUDA
Error fwd_fp8(Tensor q, Tensor k, Tensor v, Tensor qk_descale, Tensor v_descale, double scale, int64_t causal,
              Tensor& out, Tensor& lse, bool& unavailable);
#endif
Error bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, std::optional<Tensor> dlse, double scale,
          int64_t causal, bool deterministic, const Features& f, bool bias_requires_grad, Tensor& dq, Tensor& dk,
          Tensor& dv, Tensor* dbias);
Error dropout_mask(Tensor rng_state, int64_t batch, int64_t heads, int64_t len_q, int64_t len_k, double dropout_p,
                   Tensor& mask);
Error kernel_plan(Tensor q, Tensor k, Tensor v, int64_t causal, bool backward, bool deterministic, const Features& f,
                  bool bias_requires_grad, const std::vector<int64_t>& device,
                  const std::optional<std::string>& kernels, const std::optional<std::string>& smem_limit,
                  std::string& plan);

}  // namespace flashattn::ops
