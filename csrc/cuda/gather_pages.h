// CUDA: a paged k / v (FwdParams::block_table) gathered into the workspace for the kernels that
// address contiguous key rows (every one but the decode kernel, which reads pages in place).
#pragma once
#include <cuda_runtime.h>

#include "../params.h"

namespace flashattn::cuda {

// Copies every key and value row of p's pages to the copy that with_gathered_pages(p)
// (common/pages.h) reads, on `stream`.
void gather_pages(const FwdParams& p, cudaStream_t stream);

}  // namespace flashattn::cuda
