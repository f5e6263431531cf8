// LayerNorm / RMSNorm with every operation rounded to x's type T: casting="none" (the sequences of
// pynorm/reference/casting.py, the same operations in the same order; the numba backend's
// _intype_kernels.py mirrors this file).
//
// Each operation is evaluated in double and rounded once to T (rn<T>): for + - * / sqrt of values of T
// the double result rounded again is the correctly rounded result in T (double carries more than
// 2p + 2 bits of every narrower format), so this is arithmetic in float16 / bfloat16 / float32.
// 1/sqrt is one operation (torch.rsqrt): its double value rounded once. Sums accumulate in double and
// are rounded once where the reference rounds them. Products are __dmul_rn: no multiply-add is
// contracted (for T = double, where rn is the identity, too).
//
//   intype_fwd<T>     y, and the row's mean (0 for RMSNorm) and rstd (values of T, stored as double)
//   intype_bwd<T>     dx of each row (its statistics recomputed: bitwise the forward's)
//   intype_params<T>  dweight = sum_rows rnd(dy xhat), dbias = sum_rows dy, one thread per column, rows
//                     in order (double; the host rounds them once to the parameters' dtypes)
//
// `centered` (uniform): LayerNorm (mean, centred variance, `correction`, eps_mode 1 = eps outside the
// root) or RMSNorm (mean square). `we` / `bt` are the weight rnd(w + offset) and bias rnd(b) as double
// values of T (the host prepares them), null where absent. One block per row (grid-stride), block sizes a
// power of two <= PYNORM_QUANT_THREADS; the reductions are common.cuh's fixed-order group reductions:
// results do not depend on the launch configuration. The parameter lists are mirrored by
// pynorm/backends/cupy/_args.py.
#include "common.cuh"

namespace pynorm {

// v rounded once to T, as a double
template <typename T> __device__ __forceinline__ double rn(double v) {
  return static_cast<double>(Conv<T>::to_float(Conv<T>::from(v)));
}

template <typename T> __device__ __forceinline__ double ldd(const T* p, int j) {
  return static_cast<double>(Conv<T>::to_float(p[j]));
}

// (m, v, r) of one row; every thread of the block ends with the same values
template <typename T>
__device__ __forceinline__ void intype_stats(const T* __restrict__ xr, int H, double eps, int centered,
                                             int correction, int eps_mode, double* red, double& m, double& v,
                                             double& r) {
  const int G = static_cast<int>(blockDim.x);
  double acc[1] = {0.0};
  m = 0.0;
  if (centered) {
    for (int j = threadIdx.x; j < H; j += G) acc[0] += ldd(xr, j);
    group_sum(acc, G, red);
    m = rn<T>(acc[0] / static_cast<double>(H));
    acc[0] = 0.0;
    for (int j = threadIdx.x; j < H; j += G) {
      const double d = rn<T>(ldd(xr, j) - m);
      acc[0] += rn<T>(__dmul_rn(d, d));
    }
    group_sum(acc, G, red);
    v = rn<T>(acc[0] / static_cast<double>(H - correction));
  } else {
    for (int j = threadIdx.x; j < H; j += G) {
      const double xv = ldd(xr, j);
      acc[0] += rn<T>(__dmul_rn(xv, xv));
    }
    group_sum(acc, G, red);
    v = rn<T>(acc[0] / static_cast<double>(H));
  }
  if (eps_mode == 1) {
    r = rn<T>(1.0 / rn<T>(rn<T>(sqrt(v)) + eps));
  } else {
    r = rn<T>(1.0 / sqrt(rn<T>(v + eps)));
  }
}

template <typename T> __device__ __forceinline__ double intype_xhat(const T* xr, int j, int centered, double m, double r) {
  double xv = ldd(xr, j);
  if (centered) xv = rn<T>(xv - m);
  return rn<T>(__dmul_rn(xv, r));
}

template <typename T>
__global__ void __launch_bounds__(PYNORM_QUANT_THREADS)
    intype_fwd(const T* __restrict__ x, const double* __restrict__ we, const double* __restrict__ bt,
               T* __restrict__ y, double* __restrict__ mean_out, double* __restrict__ rstd_out, long long rows,
               int hidden, double eps, int centered, int correction, int eps_mode) {
  __shared__ double red[32];
  const int G = static_cast<int>(blockDim.x);
  for (long long i = blockIdx.x; i < rows; i += gridDim.x) {
    const long long off = i * static_cast<long long>(hidden);
    double m, v, r;
    intype_stats<T>(x + off, hidden, eps, centered, correction, eps_mode, red, m, v, r);
    for (int j = threadIdx.x; j < hidden; j += G) {
      double t = intype_xhat(x + off, j, centered, m, r);
      if (we != nullptr) t = rn<T>(__dmul_rn(t, we[j]));
      if (bt != nullptr) t = rn<T>(t + bt[j]);
      y[off + j] = Conv<T>::from(t);  // exact: t is a value of T
    }
    if (threadIdx.x == 0) {
      mean_out[i] = m;
      rstd_out[i] = r;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(PYNORM_QUANT_THREADS)
    intype_bwd(const T* __restrict__ dy, const T* __restrict__ x, const double* __restrict__ we, T* __restrict__ dx,
               long long rows, int hidden, double eps, int centered, int correction, int eps_mode) {
  __shared__ double red[2 * 32];
  const int G = static_cast<int>(blockDim.x);
  for (long long i = blockIdx.x; i < rows; i += gridDim.x) {
    const long long off = i * static_cast<long long>(hidden);
    const T* xr = x + off;
    double m, v, r;
    intype_stats<T>(xr, hidden, eps, centered, correction, eps_mode, red, m, v, r);
    double s[2] = {0.0, 0.0};  // sum g, sum rnd(g xhat)
    for (int j = threadIdx.x; j < hidden; j += G) {
      double g = ldd(dy + off, j);
      if (we != nullptr) g = rn<T>(__dmul_rn(g, we[j]));
      s[0] += g;
      s[1] += rn<T>(__dmul_rn(g, intype_xhat(xr, j, centered, m, r)));
    }
    group_sum(s, G, red);
    const double gbar = rn<T>(s[0] / static_cast<double>(hidden));
    double coef = rn<T>(s[1] / static_cast<double>(centered ? hidden - correction : hidden));
    if (eps_mode == 1) {
      const double sd = rn<T>(sqrt(v));
      coef = sd > 0.0 ? rn<T>(coef / rn<T>(__dmul_rn(sd, r))) : 0.0;
    }
    for (int j = threadIdx.x; j < hidden; j += G) {
      double g = ldd(dy + off, j);
      if (we != nullptr) g = rn<T>(__dmul_rn(g, we[j]));
      const double tx = rn<T>(__dmul_rn(intype_xhat(xr, j, centered, m, r), coef));
      const double t = centered ? rn<T>(__dmul_rn(r, rn<T>(rn<T>(g - gbar) - tx))) : rn<T>(__dmul_rn(r, rn<T>(g - tx)));
      dx[off + j] = Conv<T>::from(t);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(PYNORM_QUANT_THREADS)
    intype_params(const T* __restrict__ dy, const T* __restrict__ x, const double* __restrict__ mean,
                  const double* __restrict__ rstd, double* __restrict__ dweight, double* __restrict__ dbias,
                  long long rows, int hidden, int centered) {
  const int j = static_cast<int>(blockIdx.x) * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
  if (j >= hidden) return;
  double aw = 0.0, ab = 0.0;
  for (long long i = 0; i < rows; ++i) {
    const long long off = i * static_cast<long long>(hidden);
    const double dv = ldd(dy + off, j);
    if (dweight != nullptr) aw += rn<T>(__dmul_rn(dv, intype_xhat(x + off, j, centered, centered ? mean[i] : 0.0, rstd[i])));
    ab += dv;
  }
  if (dweight != nullptr) dweight[j] = aw;
  if (dbias != nullptr) dbias[j] = ab;
}

}  // namespace pynorm
