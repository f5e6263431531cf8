// Second stage of the deterministic parameter-gradient reduction.
//
//   reduce_partials<O, A>  out[m, c] = sum over p in segment m of part[p, c] (a (P, H)
//                          array of per-block / per-chunk partial sums in the
//                          accumulation type A), summed in a fixed order and rounded
//                          once to O. Segment m = blockIdx.y is rows [segs[m], segs[m+1])
//                          (a parameter table's modality m), or all P rows when segs is
//                          null. An empty segment writes zeros (an unused modality, an
//                          empty batch).
#include "common.cuh"

namespace pynorm {

static_assert(PYNORM_REDUCE_THREADS == PYNORM_REDUCE_X * PYNORM_REDUCE_Y, "reduce block shape");

template <typename O, typename A>
__global__ void __launch_bounds__(PYNORM_REDUCE_THREADS)
reduce_partials(const A* __restrict__ part, O* __restrict__ out, const long long* __restrict__ segs, long long P,
                int H) {
  __shared__ A sm[PYNORM_REDUCE_Y][PYNORM_REDUCE_X + 1];
  const int col = blockIdx.x * PYNORM_REDUCE_X + threadIdx.x;
  const long long p0 = segs != nullptr ? segs[blockIdx.y] : 0;
  const long long p1 = segs != nullptr ? segs[blockIdx.y + 1] : P;
  const A* seg = part + p0 * H;
  const long long n = p1 - p0;
  out += static_cast<long long>(blockIdx.y) * H;
  A s = A(0);
  if (col < H) {
    for (long long p = threadIdx.y; p < n; p += PYNORM_REDUCE_Y) s += seg[p * H + col];
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

}  // namespace pynorm
