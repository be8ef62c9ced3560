// CPU: a paged k / v (FwdParams::block_table) gathered into the workspace before the forward,
// which then reads it as a padded batch (the CPU kernels address contiguous key rows).
#pragma once
#include <cstddef>

#include "../params.h"

namespace flashattn::cpu {

// Copies every key and value row of p's pages into p.workspace; returns p reading that copy.
FwdParams gather_pages(const FwdParams& p);

}  // namespace flashattn::cpu
