// CPU: a paged k / v (FwdParams::block_table) gathered into the workspace before a forward whose
// queries are longer than decode steps (api.h reads_pages), which then reads it as a padded batch
// (the prefill tiles address contiguous key rows). Decode steps read the pages where they lie.
#pragma once
#include <cstddef>

#include "../params.h"

namespace flashattn::cpu {

// Copies every key and value row of p's pages into p.workspace; returns p reading that copy.
FwdParams gather_pages(const FwdParams& p);

}  // namespace flashattn::cpu
