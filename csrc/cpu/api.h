// Entry points of the CPU backend.
#pragma once
#include "../params.h"

namespace flashattn::cpu {

void run_fwd(const FwdParams& p);
size_t bwd_workspace_bytes(const BwdParams& p);
void run_bwd(const BwdParams& p);

}  // namespace flashattn::cpu
