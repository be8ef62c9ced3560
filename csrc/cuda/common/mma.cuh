// Warp-level tensor-core instructions (sm_80+) as small inline functions: mma.sync for
// fp16/bf16 (m16n8k16), tf32 (m16n8k8) and fp64 (m8n8k4; m16n8k8 on sm_90+), and ldmatrix. On older archs the
// bodies compile to nothing; dispatch never launches the kernels that use them there.
#pragma once
#include <cstdint>

namespace flashattn::cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define FLASHATTN_MMA_SM80 1
#endif

// D += A B, A 16x16 row-major (4 regs of 2 halves), B 16x8 column-major (2 regs), D 16x8 fp32.
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef FLASHATTN_MMA_SM80
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef FLASHATTN_MMA_SM80
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// D += A B in fp64, A 8x4 (lane: row lane/4, col lane%4), B 4x8 (row lane%4, col lane/4),
// D 8x8 (row lane/4, cols 2*(lane%4) + {0, 1}).
__device__ __forceinline__ void mma_f64(double& d0, double& d1, double a, double b) {
#ifdef FLASHATTN_MMA_SM80
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
               : "+d"(d0), "+d"(d1)
               : "d"(a), "d"(b));
#endif
}

// D += A B in fp64, A 16x8, B 8x8, D 16x8 (sm_90+): lane (g, t) = (lane / 4, lane % 4) holds a0
// (row g, k t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4); b0 (k t, col g), b1 (k t + 4,
// col g); d0, d1 (row g, cols 2t, 2t + 1), d2, d3 (row g + 8): the four m8n8k4 products above in
// one instruction.
__device__ __forceinline__ void mma_f64_16x8x8(double (&d)[4], const double (&a)[4], const double (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm(
      "mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
#endif
}

// D += A B in TF32 (the fp32 operands' top 19 bits), A 16x8, B 8x8, D 16x8 fp32, fragments laid
// out as mma_f64_16x8x8's: a0 (row g, k t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4); b0
// (k t, col g), b1 (k t + 4, col g); d0, d1 (row g, cols 2t, 2t + 1), d2, d3 (row g + 8).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef FLASHATTN_MMA_SM80
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// x rounded to the nearest TF32 value, ties away from zero (fp32 bits with the low 13 mantissa
// bits 0; inf where the rounding overflows): half a TF32 ulp added to the magnitude bits, then
// truncated. For finite x this is cvt.rna.tf32.f32 bit for bit, in 2 integer instructions where
// sm_90 emulates cvt.rna in ~5. Not for inf or NaN (a NaN can come out as 0 or inf): callers
// whose operands may be either guard on x itself.
__device__ __forceinline__ float round_tf32(float x) {
  return __uint_as_float((__float_as_uint(x) + 0x1000u) & 0xffffe000u);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 matrices of 16-bit elements; lane l gives the shared-memory address of row l % 8 of
// matrix l / 8 (as a 32-bit smem address: swizzled tiles form theirs by XOR, tile_copy.cuh).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t row) {
#ifdef FLASHATTN_MMA_SM80
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row));
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t row) {
#ifdef FLASHATTN_MMA_SM80
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row));
#endif
}

// The inverse of ldmatrix_x4 (sm_90+): lane l gives the address of row l % 8 of matrix l / 8, and
// r[i] holds matrix i's two elements of row lane / 4, columns 2 (lane % 4) + {0, 1}: the layout of
// an mma accumulator atom's rows g or g + 8 packed to 16 bits. One instruction for the 16 bytes a
// lane stores, where 32-bit stores take four.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FLASHATTN_STMATRIX 1
#endif
__device__ __forceinline__ void stmatrix_x4(uint32_t row, const uint32_t (&r)[4]) {
#ifdef FLASHATTN_STMATRIX
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(row), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
#endif
}

}  // namespace flashattn::cuda
