// Picks the CPU kernels for the instruction set of the machine we run on. The environment
// variable FLASHATTN_CPU_ISA=avx2 forces the baseline kernels (to compare, or to test them
// on an AVX-512 machine).
#include <cstdlib>
#include <cstring>

#include "api.h"

namespace flashattn::cpu {

namespace baseline {
void run_fwd(const FwdParams& p);
size_t bwd_workspace_bytes(const BwdParams& p);
void run_bwd(const BwdParams& p);
}  // namespace baseline

// FLASHATTN_HAVE_AVX512 is defined by setup.py when it builds kernels_avx512.cpp.
#ifdef FLASHATTN_HAVE_AVX512
namespace avx512 {
void run_fwd(const FwdParams& p);
size_t bwd_workspace_bytes(const BwdParams& p);
void run_bwd(const BwdParams& p);
}  // namespace avx512
#endif

namespace {
bool use_avx512() {
#ifdef FLASHATTN_HAVE_AVX512
  // Checks the CPUID bits and that the OS saves the 512-bit registers.
  static const bool yes = [] {
    const char* forced = std::getenv("FLASHATTN_CPU_ISA");
    if (forced != nullptr && std::strcmp(forced, "avx2") == 0) return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  }();
  return yes;
#else
  return false;
#endif
}
}  // namespace

#ifdef FLASHATTN_HAVE_AVX512
#define FLASHATTN_DISPATCH(call) return use_avx512() ? avx512::call : baseline::call
#else
#define FLASHATTN_DISPATCH(call) return baseline::call
#endif

// The kernels read a paged k / v in its pages: no workspace.
size_t fwd_workspace_bytes(const FwdParams&) { return 0; }
void run_fwd(const FwdParams& p) { FLASHATTN_DISPATCH(run_fwd(p)); }
size_t bwd_workspace_bytes(const BwdParams& p) { FLASHATTN_DISPATCH(bwd_workspace_bytes(p)); }
void run_bwd(const BwdParams& p) { FLASHATTN_DISPATCH(run_bwd(p)); }

}  // namespace flashattn::cpu
