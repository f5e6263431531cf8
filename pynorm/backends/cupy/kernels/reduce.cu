// Second stage of the deterministic parameter-gradient reduction, and the cast
// used when weight and bias arrive in different dtypes.
//
//   reduce_partials<O, A>  out[c] = sum over p of part[p, c] (a (P, H) array of
//                          per-block / per-chunk partial sums in the accumulation
//                          type A), summed in a fixed order and rounded once to O.
//                          P == 0 writes zeros (gradients of an empty batch).
//   cast_params<S, D>      out[i] = D(in[i]) (parameters promoted to the
//                          accumulation type before the main kernels).
#include "common.cuh"

namespace pynorm {

static_assert(PYNORM_REDUCE_THREADS == PYNORM_REDUCE_X * PYNORM_REDUCE_Y, "reduce block shape");

template <typename O, typename A>
__global__ void __launch_bounds__(PYNORM_REDUCE_THREADS)
reduce_partials(const A* __restrict__ part, O* __restrict__ out, long long P, int H) {
  __shared__ A sm[PYNORM_REDUCE_Y][PYNORM_REDUCE_X + 1];
  const int col = blockIdx.x * PYNORM_REDUCE_X + threadIdx.x;
  A s = A(0);
  if (col < H) {
    for (long long p = threadIdx.y; p < P; p += PYNORM_REDUCE_Y) s += part[p * H + col];
  }
  sm[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < H) {
    A tot = sm[0][threadIdx.x];
#pragma unroll
    for (int q = 1; q < PYNORM_REDUCE_Y; ++q) tot += sm[q][threadIdx.x];
    out[col] = Conv<O>::from(tot);
  }
}

template <typename S, typename D>
__global__ void __launch_bounds__(PYNORM_CAST_THREADS) cast_params(const S* __restrict__ in, D* __restrict__ out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = static_cast<D>(Conv<S>::to_float(in[i]));
  }
}

}  // namespace pynorm
