// Entry points of the CPU backend.
#pragma once
#include "../params.h"

namespace flashattn::cpu {

// Queries of at most kDecodeRows rows a sequence are decode steps: fwd.h's decode tile, which reads a paged k / v
// where its pages lie. Other paged calls read a copy gathered into the workspace first (gather_pages.h).
constexpr int64_t kDecodeRows = 8;
inline bool reads_pages(const FwdParams& p) { return p.len_q <= kDecodeRows; }
size_t fwd_workspace_bytes(const FwdParams& p);
void run_fwd(const FwdParams& p);
size_t bwd_workspace_bytes(const BwdParams& p);
void run_bwd(const BwdParams& p);
// The in-place append of a KV-cache step and its seqused output (common/append.h).
void run_append(const AppendParams& p);

}  // namespace flashattn::cpu
