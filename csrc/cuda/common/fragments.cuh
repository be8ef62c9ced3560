// One warp-level product step per element type, behind one interface, so that the attention
// kernels are written once for fp16, bf16 and fp64.
//
// Every product is built from 16x8 accumulator atoms: lane (g, t) = (lane / 4, lane % 4) holds
// c[0], c[1] at row g, columns 2t, 2t+1 and c[2], c[3] at row g + 8 (the layout of mma.sync's
// fp32 D, and of two fp64 m8n8 D's stacked). A k-step covers kK columns of A (rows of B):
//   fp16/bf16  m16n8k16, kK = 16, operands through ldmatrix;
//   fp64       m16n8k8 on sm_90+, four m8n8k4 DMMAs before; kK = 8.
// For fp64 the lane holding k = t in the instruction's two halves is fed k = 2t and 2t + 1
// of the step instead. Any permutation of k gives the same sum when A and B follow it,
// and this one makes a lane's A operand exactly the pair of accumulator columns it already
// holds (P in P V, dS in dS K) and lets it read both k's of a row with one 16-byte load.
//
// Interface (s points at the step's first element, ld is the smem row pitch in elements; the
// fp16/bf16 loaders also take the lane's smem address instead, for swizzled tiles):
//   load_a(A, s, ld, lane)      A rows 0..15, k 0..kK-1 from row-major smem (s at (row0, k0))
//   load_a_kn(A, s, ld, lane)   the same A from smem stored [k][row] (s at (k0, row0))
//   load_b2_nk(B, s, ld, lane)  two B atoms (n 0..7, 8..15) from smem stored [n][k]
//   load_b2_kn(B, s, ld, lane)  two B atoms from smem stored [k][n]
//   a_from_acc(A, c)            A from accumulator atoms c[0] (and c[1] for fp16/bf16: kK = 16
//                               spans two 8-column atoms)
//   mma(c, A, B)                c += A B
//   store_pair(dst, x, y)       two adjacent elements (global or shared memory)
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "mma.cuh"

namespace flashattn::cuda {

template <class Elem> struct Mma;

// fp16 and bf16 share everything but the instruction and the packing.
template <class Elem, class Elem2>
struct Mma16Bit {
  using Acc = float;
  static constexpr int kK = 16;
  struct A { uint32_t r[4]; };
  struct B { uint32_t r[2]; };

  // Where lane l points in a step's 16 rows x 16 columns: the row and the 16-byte chunk (0 or 1)
  // of its ldmatrix address. Rows-first: rows l % 16, chunk l / 16, matrices (rows 0-7, chunk 0),
  // (rows 8-15, chunk 0), (rows 0-7, chunk 1), (rows 8-15, chunk 1). Chunks-first: rows l % 8
  // (+8 for l >= 16), chunk (l / 8) % 2, matrices (rows 0-7, chunk 0), (rows 0-7, chunk 1), (rows
  // 8-15, chunk 0), (rows 8-15, chunk 1).
  struct LaneSpot { int row, chunk; };
  static __device__ __forceinline__ LaneSpot rows_first(int lane) { return {lane & 15, lane >> 4}; }
  static __device__ __forceinline__ LaneSpot chunks_first(int lane) { return {(lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1}; }

  // Each loader takes s and ld (the lane's spot as above, written out), or the lane's smem
  // address `at` formed by the caller (tile_copy.cuh's SwizzledAddress). A (rows, k) from row-major
  // smem: rows-first.
  static __device__ __forceinline__ void load_a(A& a, uint32_t at) { ldmatrix_x4(a.r, at); }
  static __device__ __forceinline__ void load_a(A& a, const Elem* s, int ld, int lane) {
    load_a(a, smem_addr(s + ((lane & 7) + (lane & 8)) * ld + ((lane >> 4) << 3)));
  }
  // The same A from smem stored [k][row], transposed: chunks-first.
  static __device__ __forceinline__ void load_a_kn(A& a, uint32_t at) { ldmatrix_x4_trans(a.r, at); }
  static __device__ __forceinline__ void load_a_kn(A& a, const Elem* s, int ld, int lane) {
    load_a_kn(a, smem_addr(s + ((lane & 7) + ((lane >> 4) << 3)) * ld + (lane & 8)));
  }
  // Two B atoms (n 0-7, n 8-15) from smem stored [n][k]: chunks-first.
  static __device__ __forceinline__ void load_b2_nk(B (&b)[2], uint32_t at) {
    uint32_t r[4];
    ldmatrix_x4(r, at);
    b[0].r[0] = r[0]; b[0].r[1] = r[1]; b[1].r[0] = r[2]; b[1].r[1] = r[3];
  }
  static __device__ __forceinline__ void load_b2_nk(B (&b)[2], const Elem* s, int ld, int lane) {
    load_b2_nk(b, smem_addr(s + ((lane & 7) + ((lane >> 4) << 3)) * ld + (lane & 8)));
  }
  // Two B atoms from smem stored [k][n], transposed: rows-first (k rows, n chunks).
  static __device__ __forceinline__ void load_b2_kn(B (&b)[2], uint32_t at) {
    uint32_t r[4];
    ldmatrix_x4_trans(r, at);
    b[0].r[0] = r[0]; b[0].r[1] = r[1]; b[1].r[0] = r[2]; b[1].r[1] = r[3];
  }
  static __device__ __forceinline__ void load_b2_kn(B (&b)[2], const Elem* s, int ld, int lane) {
    load_b2_kn(b, smem_addr(s + ((lane & 7) + (lane & 8)) * ld + ((lane >> 4) << 3)));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    Elem2 v;
    if constexpr (std::is_same_v<Elem, __half>) v = __floats2half2_rn(lo, hi);
    else v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ void a_from_acc(A& a, const float (*c)[4]) {
    a.r[0] = pack(c[0][0], c[0][1]);
    a.r[1] = pack(c[0][2], c[0][3]);
    a.r[2] = pack(c[1][0], c[1][1]);
    a.r[3] = pack(c[1][2], c[1][3]);
  }
  static __device__ __forceinline__ void store_pair(Elem* dst, float x, float y) {
    *reinterpret_cast<uint32_t*>(dst) = pack(x, y);
  }
};

template <> struct Mma<__half> : Mma16Bit<__half, __half2> {
  static __device__ __forceinline__ void mma(float (&c)[4], const A& a, const B& b) { mma_f16(c, a.r, b.r); }
};
template <> struct Mma<__nv_bfloat16> : Mma16Bit<__nv_bfloat16, __nv_bfloat162> {
  static __device__ __forceinline__ void mma(float (&c)[4], const A& a, const B& b) { mma_bf16(c, a.r, b.r); }
};

// Slots of A: [0] (g, 2t), [1] (g + 8, 2t), [2] (g, 2t + 1), [3] (g + 8, 2t + 1); of B: [0] (k 2t,
// n g), [1] (k 2t + 1, n g).
template <> struct Mma<double> {
  using Acc = double;
  static constexpr int kK = 8;
  struct A { double v[4]; };
  struct B { double v[2]; };

  static __device__ __forceinline__ void load_a(A& a, const double* s, int ld, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const double2 top = *reinterpret_cast<const double2*>(s + g * ld + 2 * t);
    const double2 bot = *reinterpret_cast<const double2*>(s + (g + 8) * ld + 2 * t);
    a.v[0] = top.x; a.v[1] = bot.x; a.v[2] = top.y; a.v[3] = bot.y;
  }
  static __device__ __forceinline__ void load_a_kn(A& a, const double* s, int ld, int lane) {
    const int g = lane >> 2, t = lane & 3;
    a.v[0] = s[2 * t * ld + g];
    a.v[1] = s[2 * t * ld + g + 8];
    a.v[2] = s[(2 * t + 1) * ld + g];
    a.v[3] = s[(2 * t + 1) * ld + g + 8];
  }
  static __device__ __forceinline__ void load_b2_nk(B (&b)[2], const double* s, int ld, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const double2 v = *reinterpret_cast<const double2*>(s + (8 * i + g) * ld + 2 * t);
      b[i].v[0] = v.x; b[i].v[1] = v.y;
    }
  }
  static __device__ __forceinline__ void load_b2_kn(B (&b)[2], const double* s, int ld, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      b[i].v[0] = s[2 * t * ld + 8 * i + g];
      b[i].v[1] = s[(2 * t + 1) * ld + 8 * i + g];
    }
  }
  static __device__ __forceinline__ void a_from_acc(A& a, const double (*c)[4]) {
    a.v[0] = c[0][0]; a.v[1] = c[0][2]; a.v[2] = c[0][1]; a.v[3] = c[0][3];
  }
  // sm_90 has the m16n8k8 shape, whose fragments are A, B and c as they are here.
  static __device__ __forceinline__ void mma(double (&c)[4], const A& a, const B& b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    mma_f64_16x8x8(c, a.v, b.v);
#else
    mma_f64(c[0], c[1], a.v[0], b.v[0]);
    mma_f64(c[0], c[1], a.v[2], b.v[1]);
    mma_f64(c[2], c[3], a.v[1], b.v[0]);
    mma_f64(c[2], c[3], a.v[3], b.v[1]);
#endif
  }
  static __device__ __forceinline__ void store_pair(double* dst, double x, double y) {
    *reinterpret_cast<double2*>(dst) = make_double2(x, y);
  }
};

}  // namespace flashattn::cuda
