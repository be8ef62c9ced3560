// Vector loads/stores of N accumulator values from/to shared memory (16-byte pieces where the
// size allows; callers guarantee alignment through the padded layouts of tile_config.cuh).
#pragma once

namespace flashattn::cuda::simt {

template <int N>
__device__ __forceinline__ void lds(float (&r)[N], const float* p) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int v = 0; v < N / 4; ++v) {
      const float4 t = reinterpret_cast<const float4*>(p)[v];
      r[4 * v] = t.x; r[4 * v + 1] = t.y; r[4 * v + 2] = t.z; r[4 * v + 3] = t.w;
    }
  } else if constexpr (N == 2) {
    const float2 t = *reinterpret_cast<const float2*>(p);
    r[0] = t.x; r[1] = t.y;
  } else {
#pragma unroll
    for (int v = 0; v < N; ++v) r[v] = p[v];
  }
}

template <int N>
__device__ __forceinline__ void lds(double (&r)[N], const double* p) {
  if constexpr (N % 2 == 0) {
#pragma unroll
    for (int v = 0; v < N / 2; ++v) {
      const double2 t = reinterpret_cast<const double2*>(p)[v];
      r[2 * v] = t.x; r[2 * v + 1] = t.y;
    }
  } else {
#pragma unroll
    for (int v = 0; v < N; ++v) r[v] = p[v];
  }
}

__device__ __forceinline__ void sts4(float* p, float a, float b, float c, float d) {
  *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
}
__device__ __forceinline__ void sts4(double* p, double a, double b, double c, double d) {
  reinterpret_cast<double2*>(p)[0] = make_double2(a, b);
  reinterpret_cast<double2*>(p)[1] = make_double2(c, d);
}

}  // namespace flashattn::cuda::simt
