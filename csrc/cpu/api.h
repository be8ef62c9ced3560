// Entry points of the CPU backend.
#pragma once
#include "../params.h"

namespace flashattn::cpu {

// No workspace: the kernels read a paged k / v (p.block_table) in its pages.
size_t fwd_workspace_bytes(const FwdParams& p);
void run_fwd(const FwdParams& p);
size_t bwd_workspace_bytes(const BwdParams& p);
void run_bwd(const BwdParams& p);
// The in-place append of a KV-cache step and its seqused output (common/append.h).
void run_append(const AppendParams& p);

}  // namespace flashattn::cpu
