// The CPU execution harness's stand-in for what CUDA C++ gives a kernel: qualifiers,
// thread and block indices, barriers, warp shuffles, shared memory and the device math
// intrinsics. The generated source of each kernel module (build.py) includes this
// file first and then the kernel source exactly as NVRTC receives it, unchanged.
//
// * __global__ / __device__ / __host__ vanish; __forceinline__ is always_inline;
//   __launch_bounds__ vanishes here (build.py reads it from the source and the
//   launcher enforces it).
// * threadIdx is the running thread's index (each CUDA thread of a block is a fiber of
//   runtime.cpp); blockIdx, blockDim and gridDim describe the block being run.
// * __shared__ is `thread_local`: every fiber of a block runs on the launching OS
//   thread, so a thread_local variable is exactly one copy per block, which is what
//   shared memory is. Blocks run one after another; the runtime fills the module's
//   whole thread-local block with NaN bytes (0xFF) before each one. `extern __shared__`
//   arrays (dynamic shared memory) are defined by the generated code with the largest
//   size a block may opt into; the bytes past the launch's dynamic size are checked
//   after every block, so a write beyond it is reported.
// * __syncthreads and the *_sync shuffles suspend the calling fiber until the block /
//   the lanes named in the mask arrive: a barrier is a real barrier and a shuffle a
//   real meeting of lanes; a deadlock, a barrier reached by part of the block and a
//   shuffle with missing lanes are errors the launch reports.
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda_cpu_abi.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ thread_local
#define __align__(n) __attribute__((aligned(n)))
#define __constant__ static const
#define __CUDA_CPU_HARNESS__ 1  // (build.py also defines __CUDACC__, __CUDACC_RTC__ and __CUDA_ARCH__)

#define threadIdx (static_cast<const uint3&>(pnc_current->tid))
#define blockIdx (static_cast<const uint3&>(pnc_block_idx))
#define blockDim (static_cast<const dim3&>(pnc_block_dim))
#define gridDim (static_cast<const dim3&>(pnc_grid_dim))

static constexpr int warpSize = 32;

// barriers: the source line identifies the barrier (threads waiting at different
// __syncthreads calls are reported, as CUDA leaves that undefined); a distinct string per
// line also keeps the compiler from merging calls the source keeps apart
#define PNC_STR2(x) #x
#define PNC_STR(x) PNC_STR2(x)
#define __syncthreads() pnc_syncthreads(__FILE__ ":" PNC_STR(__LINE__))
inline void __syncwarp(unsigned int mask = 0xffffffffu) { pnc_syncwarp(mask); }
inline void __threadfence() {}
inline void __threadfence_block() {}

namespace pnc_detail {
template <typename T> inline T shfl(unsigned int mask, T var, int op, int arg, int width) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffles move values of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = pnc_shfl(mask, bits, op, arg, width);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}
}  // namespace pnc_detail

template <typename T> inline T __shfl_sync(unsigned int mask, T var, int src_lane, int width = warpSize) {
  return pnc_detail::shfl(mask, var, PNC_SHFL_IDX, src_lane, width);
}
template <typename T> inline T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize) {
  return pnc_detail::shfl(mask, var, PNC_SHFL_UP, static_cast<int>(delta), width);
}
template <typename T> inline T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize) {
  return pnc_detail::shfl(mask, var, PNC_SHFL_DOWN, static_cast<int>(delta), width);
}
template <typename T> inline T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = warpSize) {
  return pnc_detail::shfl(mask, var, PNC_SHFL_XOR, lane_mask, width);
}

// device math intrinsics with the rounding CUDA documents for them
inline float __double2float_rn(double d) { return static_cast<float>(d); }
inline double __drcp_rn(double d) { return 1.0 / d; }
inline float __frcp_rn(float f) { return 1.0f / f; }
inline double __dsqrt_rn(double d) { return std::sqrt(d); }
inline float __fsqrt_rn(float f) { return std::sqrt(f); }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __ll2double_rn(long long i) { return static_cast<double>(i); }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int i;
  std::memcpy(&i, &f, sizeof i);
  return i;
}
inline float __uint_as_float(unsigned int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}
inline double __longlong_as_double(long long i) {
  double d;
  std::memcpy(&d, &i, sizeof d);
  return d;
}
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __int2float_rn(int i) { return static_cast<float>(i); }
inline double __int2double_rn(int i) { return static_cast<double>(i); }
inline double rsqrt(double d) { return 1.0 / std::sqrt(d); }
inline float rsqrtf(float f) { return 1.0f / std::sqrt(f); }
template <typename T> inline T __ldg(const T* p) { return *p; }
