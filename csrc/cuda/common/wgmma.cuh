// Warpgroup tensor-core products (wgmma, sm_90a only): the four warps of a warpgroup (128
// threads, warps 4i .. 4i + 3) compute one 64 x N x 16 product together, asynchronously: the
// instruction issues, the warps go on, and wgmma_wait() waits for the committed groups. On every
// other target (and sm_90 without the "a" features) the bodies compile to nothing; the kernel plan
// chooses these kernels only on sm_90 where the build holds sm_90a code (setup.py's FLASHATTN_SM90A).
//
// Accumulator layout (m64nN, fp32): warp w of the group holds rows 16w .. 16w + 15; lane (g, t) =
// (lane / 4, lane % 4) holds, for each 8-column atom j, d[j][0..1] at row g, columns 8j + 2t + {0, 1}
// and d[j][2..3] at row g + 8: mma.sync's m16n8 accumulator atoms side by side. An A operand from
// registers is mma.sync's m16n8k16 A fragment of the warp's 16 rows.
//
// Shared-memory operands: tiles of 16-bit elements stored as panels of 64 columns, each row of a
// panel one 128-byte line whose 16-byte chunk c lies at chunk c ^ (row % 8) (the 128-byte swizzle;
// panels 1024-byte aligned). smem_desc() describes one: K-major operands (Q, K: the reduction runs
// along the line) step their start address along the line by 32 bytes per k16 step; the
// MN-major one (V in P V: keys along the rows) steps 16 rows per k16 step.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "mma.cuh"  // smem_addr

namespace flashattn::cuda {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASHATTN_WGMMA 1
#endif

// The first 1024-byte-aligned byte of `smem` (the swizzle's period; the kernels ask for 1024 bytes
// more than their tiles take).
__device__ __forceinline__ unsigned char* align_1024(unsigned char* smem) {
  const uint32_t at = smem_addr(smem);
  return smem + (((at + 1023) & ~1023u) - at);
}

// Descriptor of a 128-byte-swizzled smem operand at smem address `addr`: `lbo` the byte distance
// between 64-column panels along the operand's M / N dimension (MN-major only; K-major operands
// never cross a panel within one k16 step), `sbo` the distance between groups of 8 rows (1024).
// `layout` 2: 64-byte lines, 64-byte swizzle (16-byte chunk c of line r at c ^ (r / 2 % 4); sbo 512).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo, uint64_t layout = 1) {
  return uint64_t((addr & 0x3ffff) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32) |
         (layout << 62);
}

// Descriptor `desc` moved `bytes` (a multiple of 16) further in smem. Only the start address field
// changes (the low word's bits 0-13: addresses >> 4), and every operand ends below 256 KB, so the add
// never carries out of it: one 32-bit add per k step instead of building each step's descriptor.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = uint32_t(desc) + (bytes >> 4), hi = uint32_t(desc >> 32);
  return uint64_t(hi) << 32 | lo;
}
// A K-major operand (its lines run along the reduction: Q, K): `first` describes its first k step; step
// kk lies 32 bytes further along the line, in panel kk / 4 (`lines` lines per panel).
__device__ __forceinline__ uint64_t kmajor_step(uint64_t first, int kk, int lines) {
  return desc_advance(first, (kk / 4) * lines * 128 + (kk % 4) * 32);
}
// (The first step's descriptor passes through an opaque move: where ptxas sees its bit fields it masks
// every step's sum again, one more instruction per product.)
__device__ __forceinline__ uint64_t opaque_desc(uint64_t desc) {
  asm("" : "+l"(desc));
  return desc;
}
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t addr) { return opaque_desc(smem_desc(addr, 16, 1024)); }
// A K-major operand of 64-byte lines (float8's V^T: 64 keys a line): step kk 32 bytes along the line, in
// panel kk / 2 (`lines` lines of 64 bytes per panel).
__device__ __forceinline__ uint64_t kmajor64_desc(uint32_t addr) { return opaque_desc(smem_desc(addr, 16, 512, 2)); }
__device__ __forceinline__ uint64_t kmajor64_step(uint64_t first, int kk, int lines) {
  return desc_advance(first, (kk / 2) * lines * 64 + (kk % 2) * 32);
}
// An MN-major operand (V in P V, keys along the rows; dO / Q in the backward's dV / dK) of `lines` lines a
// panel: `first` its first k step; a k16 step is 16 lines further.
__device__ __forceinline__ uint64_t mnmajor_desc(uint32_t addr, int lines) {
  return opaque_desc(smem_desc(addr, lines * 128, 1024));
}
__device__ __forceinline__ uint64_t mnmajor_step(uint64_t first, int kk) { return desc_advance(first, kk * 16 * 128); }

// Orders this warp's earlier register writes (accumulators, A fragments) before the wgmma that
// follow.
__device__ __forceinline__ void wgmma_fence() {
#ifdef FLASHATTN_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef FLASHATTN_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most kPending committed groups of this warp are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#ifdef FLASHATTN_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
// Keeps the compiler from moving reads or writes of registers a wgmma uses across this point: after
// wgmma_wait(), the reads of its accumulators; before wgmma_fence(), the writes of its inputs (ptxas
// serializes the products where an input is defined after the fence).
template <int kAtoms>
__device__ __forceinline__ void pin(float (&d)[kAtoms][4]) {
#pragma unroll
  for (int j = 0; j < kAtoms; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}
template <int kAtoms>
__device__ __forceinline__ void pin(uint32_t (&a)[kAtoms][4]) {
#pragma unroll
  for (int j = 0; j < kAtoms; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[j][e])::"memory");
}
// Makes this thread's generic-proxy writes to smem (cp.async copies that have landed) visible to
// the async proxy that wgmma reads operands through.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef FLASHATTN_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Moves registers between the warpgroups of a block (every warp of the executing warpgroup runs it;
// the block's pool is what it was launched with): a producer warpgroup gives up registers that the
// consumers' accumulators then take.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
#ifdef FLASHATTN_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
#ifdef FLASHATTN_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

// m64nNk16 with fp32 accumulators (N = 32, 64, 96, 128, 256): ss<kAccumulate, kTransA, kTransB>(d, a, b):
// D = A B (+ D where kAccumulate), A and B from descriptors, K-major (MN-major where kTrans*);
// rs(d, a, b): D += A B, A from registers, B MN-major.
template <class Elem, int N>
struct Wgmma;

// The products as inline PTX, one specialization per element type and width N: TYPE names the PTX
// type; FLASHATTN_WGMMA_R<N> / _C<N> list a lane's N / 2 accumulators as the instruction's operands
// and as asm constraints (each width's lists extend the narrower one's). (The asm only where wgmma exists.)
#ifdef FLASHATTN_WGMMA
#define FLASHATTN_WGMMA_ASM(...) asm volatile(__VA_ARGS__)
#else
#define FLASHATTN_WGMMA_ASM(...) \
  do {                           \
  } while (0)
#endif

#define FLASHATTN_WGMMA_R32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"

#define FLASHATTN_WGMMA_C32                                                                  \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),  \
  "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),  \
  "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])

#define FLASHATTN_WGMMA_R64                                                         \
  FLASHATTN_WGMMA_R32 ", "                                                          \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"

#define FLASHATTN_WGMMA_C64                                                                  \
  FLASHATTN_WGMMA_C32,                                                                       \
  "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]),  \
  "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),  \
  "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])

#define FLASHATTN_WGMMA_R96 FLASHATTN_WGMMA_R64 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"

#define FLASHATTN_WGMMA_C96                                                                        \
  FLASHATTN_WGMMA_C64,                                                                             \
  "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]),        \
  "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),    \
  "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3])

#define FLASHATTN_WGMMA_R128                                                          \
  FLASHATTN_WGMMA_R64 ", "                                                            \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

#define FLASHATTN_WGMMA_C128                                                                       \
  FLASHATTN_WGMMA_C64,                                                                             \
  "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]),        \
  "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),    \
  "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]),  \
  "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),  \
  "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]),  \
  "+f"(d[15][2]), "+f"(d[15][3])

#define FLASHATTN_WGMMA_R192                                                          \
  FLASHATTN_WGMMA_R128 ", "                                                           \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "  \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"

#define FLASHATTN_WGMMA_C192                                                       \
  FLASHATTN_WGMMA_C128,                                                            \
  "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]),  \
  "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]),  \
  "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]),  \
  "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]),  \
  "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]),  \
  "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]),  \
  "+f"(d[23][2]), "+f"(d[23][3])

#define FLASHATTN_WGMMA_R256                                                                        \
  FLASHATTN_WGMMA_R192 ", "                                                                         \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "    \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

#define FLASHATTN_WGMMA_C256                                                       \
  FLASHATTN_WGMMA_C192,                                                            \
  "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]),  \
  "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]),  \
  "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]),  \
  "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]),  \
  "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]),  \
  "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]),  \
  "+f"(d[31][2]), "+f"(d[31][3])

// The A-from-registers product of a Wgmma<ELEM, N> specialization (K: "16" for 16-bit, "32" for 8-bit
// operands; RS its operands after the accumulators), the same text for every element type.
#define FLASHATTN_WGMMA_RS(TYPE, N, K, RS)                                                               \
  static __device__ __forceinline__ void rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b) {  \
    FLASHATTN_WGMMA_ASM("wgmma.mma_async.sync.aligned.m64n" #N "k" K ".f32." TYPE "." TYPE "\n"          \
                        "{" FLASHATTN_WGMMA_R##N "},\n" RS                                               \
                        : FLASHATTN_WGMMA_C##N                                                           \
                        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                           \
  }

#define FLASHATTN_WGMMA_SHAPE(ELEM, TYPE, N, SS, RS)                                                     \
template <>                                                                                              \
struct Wgmma<ELEM, N> {                                                                                  \
  template <int kAccumulate, int kTransA = 0, int kTransB = 0>                                           \
  static __device__ __forceinline__ void ss(float (&d)[N / 8][4], uint64_t a, uint64_t b) {              \
    FLASHATTN_WGMMA_ASM("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE "\n"             \
                        "{" FLASHATTN_WGMMA_R##N "},\n" SS                                               \
                        : FLASHATTN_WGMMA_C##N                                                           \
                        : "l"(a), "l"(b), "n"(kAccumulate), "n"(kTransA), "n"(kTransB));            \
  }                                                                                                      \
  FLASHATTN_WGMMA_RS(TYPE, N, "16", RS)                                                                  \
};

// SS / RS: the operands after the accumulators (descriptors, scale-d, scales, transposes), numbered on.
#define FLASHATTN_WGMMA_SHAPES(ELEM, TYPE)                                                             \
  FLASHATTN_WGMMA_SHAPE(ELEM, TYPE, 32, "%16, %17, %18, 1, 1, %19, %20;\n",                            \
                        "{%16, %17, %18, %19}, %20, 1, 1, 1, 1;\n")                                    \
  FLASHATTN_WGMMA_SHAPE(ELEM, TYPE, 64, "%32, %33, %34, 1, 1, %35, %36;\n",                            \
                        "{%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n")                                    \
  FLASHATTN_WGMMA_SHAPE(ELEM, TYPE, 96, "%48, %49, %50, 1, 1, %51, %52;\n",                            \
                        "{%48, %49, %50, %51}, %52, 1, 1, 1, 1;\n")                                    \
  FLASHATTN_WGMMA_SHAPE(ELEM, TYPE, 128, "%64, %65, %66, 1, 1, %67, %68;\n",                           \
                        "{%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n")                                    \
  FLASHATTN_WGMMA_SHAPE(ELEM, TYPE, 256, "%128, %129, %130, 1, 1, %131, %132;\n",                      \
                        "{%128, %129, %130, %131}, %132, 1, 1, 1, 1;\n")

FLASHATTN_WGMMA_SHAPES(__nv_bfloat16, "bf16")
FLASHATTN_WGMMA_SHAPES(__half, "f16")

// m64nNk32 on float8 e4m3 operands, fp32 accumulators: both operands K-major (8-bit wgmma has no
// transposes), so ss's kTrans* must be 0. An A operand from registers is 4 registers of 4 bytes:
// a[0] row g, k 4t .. 4t + 3 (byte i = k 4t + i); a[1] row g + 8, same k; a[2], a[3] the same at k + 16.
#define FLASHATTN_WGMMA_SHAPE_8BIT(ELEM, TYPE, N, SS, RS)                                                \
template <>                                                                                              \
struct Wgmma<ELEM, N> {                                                                                  \
  template <int kAccumulate, int kTransA = 0, int kTransB = 0>                                           \
  static __device__ __forceinline__ void ss(float (&d)[N / 8][4], uint64_t a, uint64_t b) {              \
    static_assert(kTransA == 0 && kTransB == 0, "8-bit wgmma takes K-major operands only");              \
    FLASHATTN_WGMMA_ASM("wgmma.mma_async.sync.aligned.m64n" #N "k32.f32." TYPE "." TYPE "\n"             \
                        "{" FLASHATTN_WGMMA_R##N "},\n" SS                                               \
                        : FLASHATTN_WGMMA_C##N                                                           \
                        : "l"(a), "l"(b), "n"(kAccumulate));                                             \
  }                                                                                                      \
  FLASHATTN_WGMMA_RS(TYPE, N, "32", RS)                                                                  \
};

FLASHATTN_WGMMA_SHAPE_8BIT(__nv_fp8_e4m3, "e4m3", 128, "%64, %65, %66, 1, 1;\n", "{%64, %65, %66, %67}, %68, 1, 1, 1;\n")
FLASHATTN_WGMMA_SHAPE_8BIT(__nv_fp8_e4m3, "e4m3", 192, "%96, %97, %98, 1, 1;\n", "{%96, %97, %98, %99}, %100, 1, 1, 1;\n")

}  // namespace flashattn::cuda
