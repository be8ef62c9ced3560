// The CPU kernels built for the baseline instruction set of the build (AVX2 + FMA on x86-64),
// in namespace flashattn::cpu::baseline.
#include "bwd.h"
#include "fwd.h"
