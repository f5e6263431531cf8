// The element-wise kernel family of pynorm's CuPy backend: ops that transform each element on
// its own, then apply a per-feature affine,
//
//   y = w * f(x) + b                 (w = 1 without a weight, b = 0 without a bias)
//
// The math of each op is defined in pynorm/reference/<op>.py; an op is one choice of the
// function policy Fn (pynorm.ops.ElementwiseVariant, mapped by _loader.py):
//
//   SignedPower   f(x) = sign(x) |x|^p      the signed-power "PowerNorm" (p: a hyperparameter)
//   Tanh          f(x) = tanh(alpha x)      DyT (alpha: a learnable scalar)
//   Erf           f(x) = erf(alpha x + s)   Derf (alpha, s: learnable scalars)
//
// Kernels (templates over T = x/y/dx dtype, W = parameter dtype, Fn):
//   ew_fwd   y
//   ew_bwd   dx = w * dy * f'(x), and per-chunk partial sums of dweight (dy * f(x)), dbias (dy),
//            dalpha (dy * w * df/dalpha) and dshift (dy * w * df/ds)
// Both run on a (row chunks) x (column tiles) grid: thread t of block (c, j) owns item j of
// thread t (V consecutive columns, as in common.cuh) of every row of chunk c, so its weights are
// loaded once and its column sums stay in registers. The partial sums are reduced in a fixed
// order by reduce.cu: bitwise reproducible results.
//
// The parameter lists are mirrored by the dataclasses of pynorm/backends/cupy/_args.py.
#include "common.cuh"

namespace pynorm {

// the largest finite value of T (the saturation bound of PowerNorm's dx)
template <typename T> struct MaxOf;
template <> struct MaxOf<__half> {
  static constexpr double value = 65504.0;
};
template <> struct MaxOf<__nv_bfloat16> {
  static constexpr double value = 3.38953138925153547590470800371487866880e+38;
};
template <> struct MaxOf<float> {
  static constexpr double value = 3.40282346638528859811704183484516925440e+38;
};
template <> struct MaxOf<double> {
  static constexpr double value = 1.79769313486231570815e+308;
};

template <typename A> __device__ __forceinline__ A clamp_abs(A v, double big) {
  const A b = static_cast<A>(big);
  return v > b ? b : (v < -b ? -b : v);  // NaN stays NaN
}

// ---------------------------------------------------------------------------
// the function axis. value(x, a, s, p) = f(x); grad(x, a, s, p, g, da, ds) = g * df/dx for the upstream
// g = w * dy, with da = g * df/dalpha and ds = g * df/ds (a: the scalar alpha when kAlpha, s: the scalar shift
// when kShift, else 0). M: the type the transcendental functions are evaluated in.

// sign(x) |x|^p. The exponent p is a double: float32 data evaluate |x|^p as exp2(p log2|x|) in
// double (relative error ~ |p log2 x| 2^-53, far below float's; p = pi / 4 is not a float, and the
// error of a float p would grow with |log x|); float16 / bfloat16 data use float pow, far inside
// their precision; float64 data double pow. df/dx = p |x|^(p-1), taken as 0 at x = 0 for p != 1
// (the reference's subgradient choice), and dx saturated at the largest finite T (never inf for
// finite input).
struct SignedPower {
  static constexpr bool kAlpha = false;
  static constexpr bool kShift = false;

  template <typename T, typename A> using Math = typename cond_type<(sizeof(T) >= 4), double, A>::type;

  // |x|^q for |x| = ax >= 0 in the math type of T
  template <typename T, typename M> static __device__ __forceinline__ M power(M ax, double q) {
    if (q == 1.0) return ax;  // exactly the identity (the casting policies' affine: pynorm/composite/casting.py)
    if constexpr (is_double<M>::value && !is_double<T>::value) {
      return q == 0.0 ? M(1) : exp2(q * log2(ax));  // IEEE: 0^q = 0 (q > 0) or inf (q < 0)
    } else {
      return pow(ax, static_cast<M>(q));
    }
  }
  template <typename T, typename A> static __device__ __forceinline__ A value(A x, A, A, double p) {
    using M = Math<T, A>;
    const M ax = fabs(static_cast<M>(x));
    return static_cast<A>(copysign(power<T>(ax, p), static_cast<M>(x)));
  }
  template <typename T, typename A> static __device__ __forceinline__ A grad(A x, A, A, double p, A g, A& da, A& ds) {
    using M = Math<T, A>;
    da = ds = A(0);
    const M ax = fabs(static_cast<M>(x));
    if (ax == M(0)) return p == 1.0 ? g : g * A(0);
    const M v = static_cast<M>(g) * (static_cast<M>(p) * power<T>(ax, p - 1.0));
    if (isfinite(v) || !isfinite(ax) || !isfinite(g)) return clamp_abs(static_cast<A>(v), MaxOf<T>::value);
    if (g == A(0)) return g;  // the derivative alone overflowed: 0 * finite
    // the derivative or the product overflowed M: the magnitude in the log domain, in double
    // (relative error ~ |log2 of it| * 2^-53), then saturated
    const double l = log2(p) + (p - 1.0) * log2(static_cast<double>(ax)) + log2(fabs(static_cast<double>(g)));
    const double mag = l >= 1024.0 ? MaxOf<double>::value : exp2(l);
    return clamp_abs(static_cast<A>(copysign(mag < MaxOf<T>::value ? mag : MaxOf<T>::value, static_cast<double>(g))),
                     MaxOf<T>::value);
  }
};

// tanh(alpha x). df/dx = alpha sech^2(z), df/dalpha = x sech^2(z), z = alpha x, with
// sech^2(z) = 4 s / (1 + s)^2, s = exp(-2|z|): full relative accuracy where tanh saturates
// (1 - tanh^2 would cancel to 0 there). tanh itself as sign(z) (-m) / (2 + m), m = expm1(-2|z|):
// no cancellation anywhere (2 + m is in (1, 2]), within a few ulps, and lighter than tanh in double.
struct Tanh {
  static constexpr bool kAlpha = true;
  static constexpr bool kShift = false;

  template <typename A> static __device__ __forceinline__ A sech2(A z) {
    const A s = exp(A(-2) * fabs(z));
    const A d = A(1) + s;
    return A(4) * s / (d * d);
  }
  template <typename T, typename A> static __device__ __forceinline__ A value(A x, A a, A, double) {
    const A z = a * x;
    const A m = expm1(A(-2) * fabs(z));
    return copysign(-m / (A(2) + m), z);
  }
  template <typename T, typename A> static __device__ __forceinline__ A grad(A x, A a, A, double, A g, A& da, A& ds) {
    const A gs = g * sech2(a * x);
    da = gs * x;
    ds = A(0);
    return a * gs;
  }
};

// erf(alpha x + s). df/dx = alpha e, df/dalpha = x e, df/ds = e, with e = (2 / sqrt(pi)) exp(-z^2), z = alpha x + s
// (an exponential: no cancellation, 0 only where it underflows). CUDA's erff is within 2 ulps of the exact value
// and erf (double) within 2 ulps (CUDA C++ Programming Guide, mathematical functions appendix); expf within 2,
// exp within 1. The CPU harness runs the C++ library's erf/exp instead.
struct Erf {
  static constexpr bool kAlpha = true;
  static constexpr bool kShift = true;

  template <typename A> static __device__ __forceinline__ A slope(A z) {
    return A(1.1283791670955125738961589031215452) * exp(-(z * z));
  }
  template <typename T, typename A> static __device__ __forceinline__ A value(A x, A a, A s, double) {
    return erf(a * x + s);
  }
  template <typename T, typename A> static __device__ __forceinline__ A grad(A x, A a, A s, double, A g, A& da, A& ds) {
    const A ge = g * slope(a * x + s);
    da = ge * x;
    ds = ge;
    return a * ge;
  }
};

// rows [j0, j1) of chunk blockIdx.x: uniform chunks of `rows_per_chunk` rows
__device__ __forceinline__ void chunk_rows(long long R, long long rows_per_chunk, long long& j0, long long& j1) {
  j0 = static_cast<long long>(blockIdx.x) * rows_per_chunk;
  j1 = j0 + rows_per_chunk < R ? j0 + rows_per_chunk : R;
}

template <typename T, typename W, class Fn>
__global__ void __launch_bounds__(PYNORM_APPLY_THREADS, 1)
ew_fwd(const T* __restrict__ x, const W* __restrict__ alpha, const W* __restrict__ shift, const W* __restrict__ weight,
       const W* __restrict__ bias, T* __restrict__ y, long long rows, int hidden, long long rows_per_chunk, double p,
       int vec) {
  using A = acc_t<T, W>;
  constexpr int V = vec_n<T>();
  const int H = hidden;
  const bool vm = vec != 0;
  const int b = item_base<T>(threadIdx.x, blockIdx.y, blockDim.x);
  const A a = Fn::kAlpha ? to_acc<A>(alpha[0]) : A(0);
  const A sh = Fn::kShift ? to_acc<A>(shift[0]) : A(0);
  A wv[V], bv[V];
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const int i = b + e;
    wv[e] = i < H ? eff_weight<A>(weight, i, A(0)) : A(0);
    bv[e] = i < H ? bias_at<A>(bias, i) : A(0);
  }
  long long j0, j1;
  chunk_rows(rows, rows_per_chunk, j0, j1);
  for (long long row = j0; row < j1; ++row) {
    const long long off = row * H;
    const Vec<T> xi = load_item<V>(x + off, b, H, vm);
    Vec<T> o;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      A v = Fn::template value<T>(to_acc<A>(xi.v[e]), a, sh, p);
      if (weight != nullptr) v = v * wv[e];
      if (bias != nullptr) v = v + bv[e];
      o.v[e] = Conv<T>::from(v);
    }
    store_item<V>(y + off, o, b, H, vm);
  }
}

template <typename T, typename W, class Fn>
__global__ void __launch_bounds__(PYNORM_APPLY_THREADS, 1)
ew_bwd(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ alpha, const W* __restrict__ shift,
       const W* __restrict__ weight, T* __restrict__ dx, acc_t<T, W>* __restrict__ part_w,
       acc_t<T, W>* __restrict__ part_b, acc_t<T, W>* __restrict__ part_a, acc_t<T, W>* __restrict__ part_s,
       long long rows, int hidden, long long rows_per_chunk, double p, int vec) {
  using A = acc_t<T, W>;
  constexpr int V = vec_n<T>();
  const int H = hidden;
  const bool vm = vec != 0;
  const int b = item_base<T>(threadIdx.x, blockIdx.y, blockDim.x);
  const A a = Fn::kAlpha ? to_acc<A>(alpha[0]) : A(0);
  const A sh = Fn::kShift ? to_acc<A>(shift[0]) : A(0);
  A wv[V], aw[V], ab[V], aa[V], sa[V];
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const int i = b + e;
    wv[e] = i < H ? eff_weight<A>(weight, i, A(0)) : A(0);
    aw[e] = ab[e] = aa[e] = sa[e] = A(0);
  }
  long long j0, j1;
  chunk_rows(rows, rows_per_chunk, j0, j1);
  for (long long row = j0; row < j1; ++row) {
    const long long off = row * H;
    const Vec<T> xi = load_item<V>(x + off, b, H, vm);
    const Vec<T> di = load_item<V>(dy + off, b, H, vm);
    Vec<T> o;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      A v = A(0);
      if (b + e < H) {
        const A xv = to_acc<A>(xi.v[e]);
        const A dv = to_acc<A>(di.v[e]);
        A da, ds;
        v = Fn::template grad<T>(xv, a, sh, p, dv * wv[e], da, ds);
        if (part_w != nullptr) aw[e] += dv * Fn::template value<T>(xv, a, sh, p);
        ab[e] += dv;
        aa[e] += da;
        sa[e] += ds;
      }
      o.v[e] = Conv<T>::from(v);
    }
    store_item<V>(dx + off, o, b, H, vm);
  }
  store_column_partial(part_w, aw, b, H);
  store_column_partial(part_b, ab, b, H);
  if (Fn::kAlpha) store_column_partial(part_a, aa, b, H);
  if (Fn::kShift) store_column_partial(part_s, sa, b, H);
}

}  // namespace pynorm
