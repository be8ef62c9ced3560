// Element types and their accumulator: fp32 accumulation for fp32/bf16/fp16, fp64 for fp64.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

namespace flashattn::cuda {

template <class T> struct AccType { using type = float; };
template <> struct AccType<double> { using type = double; };
template <class T> using acc_t = typename AccType<T>::type;

__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_acc(acc_t<T> x);
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Two adjacent accumulator values, for one 8- (16-) byte load.
template <class Acc> struct Vec2Of;
template <> struct Vec2Of<float> { using type = float2; };
template <> struct Vec2Of<double> { using type = double2; };
template <class Acc> __device__ __forceinline__ typename Vec2Of<Acc>::type load_vec2(const Acc* p) {
  return *reinterpret_cast<const typename Vec2Of<Acc>::type*>(p);
}

template <class Acc> __device__ __forceinline__ Acc neg_inf() { return static_cast<Acc>(-INFINITY); }

// fmax drops a NaN operand; callers rely on NaN still reaching the output through exp().
__device__ __forceinline__ float acc_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double acc_max(double a, double b) { return fmax(a, b); }

}  // namespace flashattn::cuda
