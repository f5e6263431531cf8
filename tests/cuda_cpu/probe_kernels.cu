// Small kernels that probe the CPU execution harness itself (tests/cuda_cpu/test_harness.py):
// each one exercises one piece of CUDA semantics the harness must model, or breaks one
// rule it must report. They are valid CUDA: NVRTC compiles them too.
#include <cuda_fp16.h>

namespace probe {

// barrier: every thread reads its neighbour's value after the barrier
__global__ void __launch_bounds__(256) rotate(const float* __restrict__ in, float* __restrict__ out) {
  __shared__ float s[256];
  const int t = threadIdx.x;
  s[t] = in[blockIdx.x * blockDim.x + t];
  __syncthreads();
  out[blockIdx.x * blockDim.x + t] = s[(t + 1) % blockDim.x];
}

// the same without the barrier: a race
__global__ void __launch_bounds__(256) rotate_racy(const float* __restrict__ in, float* __restrict__ out) {
  __shared__ float s[256];
  const int t = threadIdx.x;
  s[t] = in[blockIdx.x * blockDim.x + t];
  out[blockIdx.x * blockDim.x + t] = s[(t + 1) % blockDim.x];
}

// shared memory is poisoned (NaN) before each block: a read before any write sees NaN
__global__ void read_uninitialized_shared(float* out) {
  __shared__ float s[64];
  out[threadIdx.x] = s[threadIdx.x];
}

// a barrier inside a branch only part of the block takes
__global__ void partial_barrier(float* out, int n) {
  if (static_cast<int>(threadIdx.x) < n) __syncthreads();
  out[threadIdx.x] = 1.0f;
}

// two different __syncthreads calls met by the two halves of the block
__global__ void divergent_barriers(float* out) {
  if (threadIdx.x % 2 == 0) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

// the four shuffles with a width: out[k * blockDim.x + t] for k = idx, up, down, xor
__global__ void shuffles(const float* __restrict__ in, float* __restrict__ out, int width, int arg) {
  const int t = threadIdx.x;
  const float v = in[t];
  const int n = blockDim.x;
  out[0 * n + t] = __shfl_sync(0xffffffffu, v, arg, width);
  out[1 * n + t] = __shfl_up_sync(0xffffffffu, v, arg, width);
  out[2 * n + t] = __shfl_down_sync(0xffffffffu, v, arg, width);
  out[3 * n + t] = __shfl_xor_sync(0xffffffffu, v, arg, width);
}

// a warp sum by xor butterfly, with one lane skipping the shuffles
__global__ void shuffle_skipped_by_one_lane(const float* __restrict__ in, float* __restrict__ out, int skip) {
  float v = in[threadIdx.x];
  for (int o = 16; o > 0; o >>= 1) {
    if (static_cast<int>(threadIdx.x) != skip) v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  out[threadIdx.x] = v;
}

// half the warp waits at a shuffle, the other half at a barrier: nothing can proceed
__global__ void deadlock(float* out) {
  float v = 1.0f;
  if (threadIdx.x < 16) {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = v;
}

// a mask that names lanes outside a partial warp
__global__ void mask_names_missing_lanes(float* out) {
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

// stores at out[i + offset]: past the end of the buffer for offset > 0
__global__ void store_offset(float* out, int n, int offset) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i + offset] = 2.0f;
}

// writes dynamic shared memory at byte `at` (past the launch's size when at >= shared_mem);
// 256 bytes of static shared memory too (the driver's 48 KiB rule counts both)
__global__ void dynamic_write(float* out, int at) {
  extern __shared__ __align__(16) unsigned char dyn[];
  __shared__ float st[64];
  if (threadIdx.x == 0) dyn[at] = 1;
  if (threadIdx.x < 64) st[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = static_cast<float>(dyn[0]) + st[threadIdx.x % 64];
}

// a 16-byte vector load from an address that is 4-byte aligned only
struct alignas(16) F4 {
  float v[4];
};
__global__ void misaligned_vector_load(const float* in, float* out) {
  const F4 q = *reinterpret_cast<const F4*>(in + 1);
  out[threadIdx.x] = q.v[0];
}

// writes through a const pointer (casting the const away)
__global__ void writes_const_input(const float* in, float* out) {
  const_cast<float*>(in)[threadIdx.x] = 3.0f;
  out[threadIdx.x] = in[threadIdx.x];
}

// never finishes
__global__ void spins(float* out, int n) {
  volatile int k = 0;
  while (k < n) {
    if (n > 0) k = 0;
  }
  out[0] = static_cast<float>(k);
}

// deep recursion: more stack than a thread has
__device__ int deep(int n) {
  volatile char buf[4096];
  buf[n % 4096] = static_cast<char>(n);
  return n <= 0 ? buf[0] : deep(n - 1) + buf[n % 4096];
}
__global__ void overflows_stack(int* out, int n) { out[threadIdx.x] = deep(n); }

// the indices of a 3-D block in a 3-D grid
__global__ void indices(int* out) {
  const int bt = blockDim.x * blockDim.y * blockDim.z;
  const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  int* o = out + 6 * (b * bt + t);
  o[0] = threadIdx.x;
  o[1] = threadIdx.y;
  o[2] = threadIdx.z;
  o[3] = blockIdx.x;
  o[4] = blockIdx.y;
  o[5] = blockIdx.z;
}

// one parameter of each scalar kind the launcher packs
__global__ void scalars(double* out, int i, long long j, float f, double d, unsigned int u) {
  out[0] = i;
  out[1] = static_cast<double>(j);
  out[2] = f;
  out[3] = d;
  out[4] = u;
}

// half conversions in device code (the harness's cuda_fp16.h)
__global__ void half_round_trip(const float* __restrict__ in, __half* __restrict__ h, float* __restrict__ back,
                                int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    h[i] = __float2half_rn(in[i]);
    back[i] = __half2float(h[i]);
  }
}

}  // namespace probe
