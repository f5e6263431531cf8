// Element-wise dtype conversion on the device, rounded once:
//
//   cast_values<S, D>   out[i] = D(in[i]) for i < n
//
// used by the host where an operand arrives in a dtype the kernels are not instantiated for:
// parameters of mixed dtypes promoted to the accumulation type (exact), a residual widened to
// the pre-norm sum's type (exact), a gradient rounded to its input's dtype. The value goes
// through double (exact for every S), then one round-to-nearest-even conversion to D.
#include "common.cuh"

namespace pynorm {

template <typename S, typename D>
__global__ void __launch_bounds__(PYNORM_CAST_THREADS)
cast_values(const S* __restrict__ in, D* __restrict__ out, long long n) {
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    out[i] = Conv<D>::from(to_acc<double>(in[i]));
  }
}

}  // namespace pynorm
