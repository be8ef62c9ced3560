// The same CPU kernels built for AVX-512 (512-bit vectors, 32 registers), in namespace
// flashattn::cpu::avx512; dispatch.cpp calls them only where the CPU has AVX-512.
//
// setup.py compiles this file alone with -mavx512* and links its object last. Inline
// functions from shared headers (the standard library, torch's) that the baseline objects
// also emit are then taken from a baseline object by the linker, so no AVX-512 instruction
// can leak into code that runs on an AVX2-only CPU.
#define FLASHATTN_CPU_ISA avx512
#define FLASHATTN_VEC_BYTES 64
#include "bwd.h"
#include "fwd.h"
