// Shared device code of pynorm's CuPy backend: types, row items, group reductions,
// the row scaling that keeps sums of squares finite, and the rstd finalisation.
//
// The loader (pynorm/backends/cupy/_loader.py) pastes this file in place of
// `#include "common.cuh"` with `#line` directives, so compiler messages name the
// real file and line.  Lines `#define PYNORM_<NAME> <int>` are also read by the
// Python launch-configuration code (pynorm/backends/cupy/_launch.py): they are
// the single source of truth for block sizes and per-thread register caches.
//
// Terminology used by every kernel
// --------------------------------
// * A *group* of G threads (G a power of two, 1..1024) normalizes one row at a
//   time.  G <= 32: several groups share a warp (sub-warp / warp per row);
//   G > 32: the group is the whole block (block per row).
// * A row is cut into *items* of V = 16 / sizeof(T) consecutive elements: item
//   k of thread t of a group holds elements [(t + G*k)*V, (t + G*k)*V + V), and
//   each thread owns nk = ceil(H / (G * V)) items.  Vectorized mode (H % V == 0
//   and every array 16-byte aligned) moves an item with one 16-byte access;
//   scalar mode (any other H) element by element, masking elements >= H.
//   The ownership of a column depends only on (t, k, G), never on the row, so a
//   thread can accumulate per-column sums (dweight, dbias) over many rows.
// * Accumulation type A: float, or double when x or a parameter is double.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define PYNORM_FWD_THREADS 512    // __launch_bounds__ of the forward kernels ...
#define PYNORM_FWD_MIN_BLOCKS 2   // ... with at least 2 resident blocks per SM (<= 64 registers)
#define PYNORM_FWD_ACC_BYTES 64   // forward: row elements a thread keeps in registers, in accumulator bytes
#define PYNORM_BWD_THREADS 1024   // __launch_bounds__ of the fused backward kernels ...
#define PYNORM_BWD_MIN_BLOCKS 1   // ... (1024 threads: <= 64 registers)
#define PYNORM_BWD_RESIDUAL_THREADS 512 // fused backward of the residual ops (h, dh, dres: <= 128 registers)
#define PYNORM_BWD_ACC_BYTES 32   // fused backward: per-thread dweight (and dbias) accumulators, in bytes
#define PYNORM_STATS_THREADS 1024 // __launch_bounds__ of the split-backward row-statistics kernels
#define PYNORM_APPLY_THREADS 256  // __launch_bounds__ of the split-backward apply kernels
#define PYNORM_REDUCE_X 32        // reduce kernel block: 32 columns ...
#define PYNORM_REDUCE_Y 8         // ... times 8 slices of the partial rows
#define PYNORM_REDUCE_THREADS 256 // = PYNORM_REDUCE_X * PYNORM_REDUCE_Y (__launch_bounds__)
#define PYNORM_CAST_THREADS 256   // __launch_bounds__ of cast_values
#define PYNORM_QUANT_THREADS 256  // __launch_bounds__ of the quantize family (one block per row)
#define PYNORM_ITEM_BYTES 16      // bytes per item (one 16-byte vector)
#define PYNORM_COLUMN_THREADS 256 // __launch_bounds__ (and blockDim) of the column family (column.cu) ...
#define PYNORM_COLUMN_CHUNK 16384 // ... whose reductions take this many values of one channel per block

namespace pynorm {

// ---------------------------------------------------------------------------
// types

template <bool C, typename X, typename Y> struct cond_type { using type = X; };
template <typename X, typename Y> struct cond_type<false, X, Y> { using type = Y; };

template <typename T> struct is_double { static constexpr bool value = false; };
template <> struct is_double<double> { static constexpr bool value = true; };

// accumulation type: double when any operand is double, else float
template <typename T, typename W>
using acc_t = typename cond_type<is_double<T>::value || is_double<W>::value, double, float>::type;

// float16 values are bounded by 65504: sums of squares cannot overflow float, so
// rows need no scaling.  bfloat16 / float / double share their accumulator's range.
template <typename T> struct needs_scaling { static constexpr bool value = true; };
template <> struct needs_scaling<__half> { static constexpr bool value = false; };

// conversions: to the accumulator, and back with one round-to-nearest-even
template <typename T> struct Conv;
template <> struct Conv<__half> {
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from(float a) { return __float2half_rn(a); }
  static __device__ __forceinline__ __half from(double a) { return __double2half(a); }
};
template <> struct Conv<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from(float a) { return __float2bfloat16_rn(a); }
  static __device__ __forceinline__ __nv_bfloat16 from(double a) { return __double2bfloat16(a); }
};
template <> struct Conv<float> {
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from(float a) { return a; }
  static __device__ __forceinline__ float from(double a) { return __double2float_rn(a); }
};
template <> struct Conv<double> {
  static __device__ __forceinline__ double to_float(double v) { return v; }
  static __device__ __forceinline__ double from(float a) { return static_cast<double>(a); }
  static __device__ __forceinline__ double from(double a) { return a; }
};

template <typename A, typename T> __device__ __forceinline__ A to_acc(T v) {
  return static_cast<A>(Conv<T>::to_float(v));
}
template <typename T> __device__ __forceinline__ T zero_of() { return Conv<T>::from(0.0f); }

template <typename A> struct Lim;
template <> struct Lim<float> {
  static __device__ __forceinline__ float max_finite() { return 3.40282346638528859812e+38f; }
  static __device__ __forceinline__ float nan() { return __int_as_float(0x7fffffff); }
  static constexpr int min_exp = -126, max_exp = 126;
};
template <> struct Lim<double> {
  static __device__ __forceinline__ double max_finite() { return 1.79769313486231570815e+308; }
  static __device__ __forceinline__ double nan() { return __longlong_as_double(0x7fffffffffffffffLL); }
  static constexpr int min_exp = -1022, max_exp = 1022;
};

// a / b for per-row coefficients.  In double, a * (correctly rounded 1/b):
// within one ulp of a / b, and it avoids the division's slow-path subroutine,
// whose stack frame would otherwise put the fused backward in local memory.
__device__ __forceinline__ float div_row(float a, float b) { return a / b; }
__device__ __forceinline__ double div_row(double a, double b) { return a * __drcp_rn(b); }

// ---------------------------------------------------------------------------
// items

// N consecutive elements of type S: one item of a row.  Every array of a row's elements is cut
// into items of the same N = V = 16 / sizeof(T) elements (T: the op's x / y type), so element i
// of every array belongs to the same thread; an array of a wider type S (a float32 pre-norm sum
// beside float16 x) moves an item as sizeof(S) * V bytes (two or four 16-byte vectors).
// aligned as one vector access moves it: 16 bytes, or the whole pack when it is narrower (a row of
// floats beside double x: 2 floats, 8 bytes, at 8-byte aligned offsets)
template <typename S, int Count> struct alignas(sizeof(S) * Count < 16 ? sizeof(S) * Count : 16) Pack {
  static constexpr int N = Count;
  S v[Count];
};
template <typename T> struct VecOf {
  static constexpr int N = PYNORM_ITEM_BYTES / sizeof(T);
  using type = Pack<T, N>;
};
template <typename T> using Vec = typename VecOf<T>::type;
template <typename T> __host__ __device__ constexpr int vec_n() { return VecOf<T>::N; }

// Register budgets, in items per thread: BYTES / sizeof(A) elements (16 float or
// 8 double for 64 bytes), i.e. BYTES * sizeof(T) / (16 * sizeof(A)) items, at least 1.
//   forward: the items of the row a thread keeps in registers (further items go
//            to dynamic shared memory or are re-read);
//   fused backward: the items a thread owns, whose dweight / dbias sums it keeps
//            in registers across rows (a row longer than that takes the split path).
// `fits` is false when one item already holds more elements than the budget
// (2-byte T with double accumulators in the backward): no fused path then.
template <typename T, typename A, int BYTES> struct ItemsFor {
  static constexpr int elems = BYTES / static_cast<int>(sizeof(A));
  static constexpr bool fits = elems >= vec_n<T>();
  static constexpr int value = fits ? elems / vec_n<T>() : 1;
};
template <typename T, typename A> struct FwdItems : ItemsFor<T, A, PYNORM_FWD_ACC_BYTES> {};
template <typename T, typename A> struct BwdItems : ItemsFor<T, A, PYNORM_BWD_ACC_BYTES> {};

// first element of item k of thread t in a group of G threads: items hold V
// consecutive elements, whether they are moved as one vector or one by one
template <typename T> __device__ __forceinline__ int item_base(int t, int k, int G) {
  return (t + G * k) * vec_n<T>();
}

template <int N, typename S> __device__ __forceinline__ Pack<S, N> zero_item() {
  Pack<S, N> r;
#pragma unroll
  for (int e = 0; e < N; ++e) r.v[e] = zero_of<S>();
  return r;
}

// Elements at or beyond H read as 0 and are never written.  Vector mode moves
// the item with 16-byte accesses (the host guarantees alignment and H % N == 0);
// scalar mode element by element (still coalesced through L1: a warp's accesses
// cover whole cache lines over the N instructions).
template <int N, typename S>
__device__ __forceinline__ Pack<S, N> load_item(const S* __restrict__ row, int base, int H, bool vec) {
  if (vec) {
    if (base < H) return *reinterpret_cast<const Pack<S, N>*>(row + base);
    return zero_item<N, S>();
  }
  Pack<S, N> r;
  const S* p = row + base;
#pragma unroll
  for (int e = 0; e < N; ++e) r.v[e] = base + e < H ? p[e] : zero_of<S>();
  return r;
}

template <int N, typename S>
__device__ __forceinline__ void store_item(S* __restrict__ row, const Pack<S, N>& r, int base, int H, bool vec) {
  if (vec) {
    if (base < H) *reinterpret_cast<Pack<S, N>*>(row + base) = r;
    return;
  }
  S* p = row + base;
#pragma unroll
  for (int e = 0; e < N; ++e) {
    if (base + e < H) p[e] = r.v[e];
  }
}

// a block's partial column sums: this thread's V columns b .. b + V - 1 (those < H) of row
// blockIdx.x of `part` (one row of H per block); nothing for a null `part` (not wanted)
template <int V, typename A>
__device__ __forceinline__ void store_column_partial(A* __restrict__ part, const A (&acc)[V], int b, int H) {
  const long long poff = static_cast<long long>(blockIdx.x) * H;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const int i = b + e;
    if (i < H && part != nullptr) part[poff + i] = acc[e];
  }
}

// row `off` of an optional array (null stays null)
template <typename P> __device__ __forceinline__ P* row_at(P* p, long long off) { return p != nullptr ? p + off : p; }

// effective weight (w + offset) of column i, or 1 without a weight
template <typename A, typename W> __device__ __forceinline__ A eff_weight(const W* __restrict__ w, int i, A offset) {
  return w != nullptr ? to_acc<A>(w[i]) + offset : A(1);
}
template <typename A, typename W> __device__ __forceinline__ A bias_at(const W* __restrict__ b, int i) {
  return b != nullptr ? to_acc<A>(b[i]) : A(0);
}

// The group of G = 2^log2g threads this thread belongs to: its index t in the group, the
// group's index gi in the block, the groups per block (gpb), and the items each thread owns of
// a row of H elements (nk = ceil(H / (G * V))).
struct RowGroup {
  int G, t, gi, gpb, nk;
  __device__ __forceinline__ RowGroup(int log2g, int H, int V)
      : G(1 << log2g),
        t(static_cast<int>(threadIdx.x) & ((1 << log2g) - 1)),
        gi(static_cast<int>(threadIdx.x) >> log2g),
        gpb(static_cast<int>(blockDim.x) >> log2g),
        nk((H + (1 << log2g) * V - 1) / ((1 << log2g) * V)) {}
};

// ---------------------------------------------------------------------------
// group reductions.  Every thread of the group ends with the same, bitwise
// identical value (xor butterflies are symmetric; the cross-warp step sums the
// warp partials in a fixed order), so the results are deterministic.
// `red` is a __shared__ buffer of at least N * 32 values.  G > 32 only when the
// group is the whole block: then all threads of the block must call.

template <int N, typename A> __device__ __forceinline__ void group_sum(A (&v)[N], int G, A* red) {
  const int width = G < 32 ? G : 32;
  for (int o = width >> 1; o > 0; o >>= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
  }
  if (G > 32) {
    const int warp = threadIdx.x >> 5, nw = G >> 5;
    __syncthreads();  // the previous reduction's readers are done with `red`
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
      for (int i = 0; i < N; ++i) red[i * 32 + warp] = v[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; ++i) {
      A s = red[i * 32];
      for (int q = 1; q < nw; ++q) s += red[i * 32 + q];
      v[i] = s;
    }
  }
}

template <typename A> __device__ __forceinline__ A group_max(A v, int G, A* red) {
  const int width = G < 32 ? G : 32;
  for (int o = width >> 1; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (G > 32) {
    const int warp = threadIdx.x >> 5, nw = G >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    v = red[0];
    for (int q = 1; q < nw; ++q) v = fmax(v, red[q]);
  }
  return v;
}

// ---------------------------------------------------------------------------
// row scaling.  A row is multiplied by s = 2^k (exact) chosen from its largest
// magnitude so that the scaled values lie in [0.5, 4): squares and their sums
// then cannot overflow and the statistics keep full precision even for rows
// near the dtype's max or its smallest normals.  k = 0 for rows of zeros,
// infinities or NaNs (they propagate as in the reference).

template <typename A> __device__ __forceinline__ int scale_exponent(A amax) {
  if (!(amax > A(0)) || isinf(amax)) return 0;
  int e;
  frexp(amax, &e);  // amax = m * 2^e, m in [0.5, 1)
  int k = -e;
  if (k < Lim<A>::min_exp) k = Lim<A>::min_exp;
  if (k > Lim<A>::max_exp) k = Lim<A>::max_exp;
  return k;
}

// Where eps enters the per-row factor r (the kernels' `eps_mode` parameter): the r rules of
// pynorm/ops/families.py (R_INSIDE, R_OUTSIDE, R_FLOOR, the same codes; tests/test_families.py checks them),
// which a statistic's record maps its eps_mode option values to
enum EpsMode : int {
  kEpsVar = 0,    // r = 1 / sqrt(v + eps)      (LayerNorm / RMSNorm "var", ScaleNorm "root")
  kEpsStd = 1,    // r = 1 / (sqrt(v) + eps)    (LayerNorm "std")
  kEpsFloor = 2,  // r = 1 / max(sqrt(v), eps)  (ScaleNorm "floor")
};

// v: the variance (LayerNorm), mean square (RMSNorm) or sum of squares (ScaleNorm)
// of the row scaled by s = 2^k (not finite: an inf or NaN in the row, r = rs = NaN).  Computes, in double, the true r of `mode` for the
// unscaled v / s^2 and rs = r / s, the factor applied to the scaled centred values,
// without overflow or underflow of the intermediate terms; returns whether the
// floor was taken (kEpsFloor: sqrt(v / s^2) < eps; never in the other modes).
// v == 0 (constant rows, every row when H = 1): r is 1/sqrt(eps) (1/eps) exactly;
// forming it from eps * s or eps * s^2 would overflow (std mode, 1/(eps s) for
// |x| > ~1e303) or lose precision where those products are subnormal (|x| ~ 1e155).
// For v > 0 the scaled data lies in [0.5, 4), so v is far above any subnormal term
// it is added to.
__device__ __forceinline__ bool finalize_rstd(double v, int k, double eps, int mode, double& r, double& rs) {
  const double s = ldexp(1.0, k), inv_s = ldexp(1.0, -k);
  const bool std_mode = mode == kEpsStd;
  if (!isfinite(v)) {  // an inf or NaN in the row: every element of it is NaN (docs/numerics.md)
    r = rs = Lim<double>::nan();
    return false;
  }
  if (mode == kEpsFloor) {
    // the norm sqrt(v) / s against eps, compared as sqrt(v) < eps * s: exact unless eps * s
    // overflows (tiny rows scaled up: then the floor is taken, rightly) or is subnormal (huge
    // rows scaled down: sqrt(v) >= 0.5 is above it, rightly); eps == 0 never floors (r = inf
    // for a zero row, as in the reference)
    const double n = sqrt(v);
    if (n < eps * s) {
      r = 1.0 / eps;
      rs = r * inv_s;
      return true;
    }
    rs = 1.0 / n;
    r = rs * s;
    return false;
  }
  if (v == 0.0) {
    r = std_mode ? 1.0 / eps : 1.0 / sqrt(eps);  // eps == 0: inf, as in the reference
  } else if (k <= 0) {  // data scaled down (or not at all): eps * s^2 can only underflow
    const double es = eps * s;
    rs = 1.0 / (std_mode ? sqrt(v) + es : sqrt(v + es * s));
    r = rs * s;
    return false;
  } else {  // tiny data scaled up: the unscaled variance cannot overflow
    if (eps == 0.0) {
      rs = 1.0 / sqrt(v);
      r = rs * s;
      return false;
    }
    const double var = v * inv_s * inv_s;
    r = std_mode ? 1.0 / (sqrt(var) + eps) : 1.0 / sqrt(var + eps);
  }
  rs = r * inv_s;
  return false;
}

// rs in the accumulator type; a finite r never gives an infinite factor (the
// centred values are then exactly 0 and must stay 0, not 0 * inf = NaN).
template <typename A> __device__ __forceinline__ A scaled_factor(double r, double rs) {
  A a = static_cast<A>(rs);
  if (isinf(a) && isfinite(r)) a = Lim<A>::max_finite();
  return a;
}

// Centring in backward: u = (x - m) * r.  Where x - m overflows (|x|, |m| near
// the dtype's max with opposite signs) it is taken as (x/2 - m/2) * (2r) instead;
// both halvings are exact there, and the result is the same otherwise.
template <typename A> __device__ __forceinline__ A centred(A x, A m, A r) {
  const A d = x - m;
  return isinf(d) ? (x * A(0.5) - m * A(0.5)) * (r * A(2)) : d * r;
}

}  // namespace pynorm
