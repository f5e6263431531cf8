// The statistics kernel family of pynorm's CuPy backend: row norms defined by per-row
// statistics. The math of each op is defined in pynorm/reference/<op>.py; an op is one choice
// per variant axis (pynorm.ops.StatsVariant; each choice's record in pynorm/ops/families.py names
// its policy here, and says which per-row outputs it fills and which options it takes):
//
//   Stat    the per-row statistic and how it centres / scales the row
//             Centered     mean and variance (corrected two-pass)    LayerNorm
//             MeanSquare   mean of squares                           RMSNorm
//             SumSquare    sum of squares (the squared L2 norm)      ScaleNorm
//   Affine  where the output's scale and shift come from
//             Vector<B>    per-feature weight (+ offset), bias when B
//             Scalar       one scalar weight                         ScaleNorm's g
//             Table<B>     row ids[i] of (M, H) tables               modality norms
//   Pro     what the normalized row is (prologue) and what is stored besides y (epilogue)
//             Plain        x
//             Residual<Hd, Rs>  h = x + alpha * residual, stored     fused add + norm
//
// Kernels (templates over T = x/y/dx dtype, W = parameter dtype, and the three policies):
//   stats_fwd          forward: y (and h), per-row statistics (mean when the statistic has one,
//                      rstd, whether ScaleNorm's floor was taken)
//   stats_bwd          fused backward, rows held in registers: dx (and dresidual) and per-block
//                      partial sums of the parameter gradients
//   stats_bwd_stats    split backward, step 1 (any H): per-row coefficients
//   stats_bwd_apply    split backward, step 2: dx (and dresidual) and per-chunk partial sums
// The partial sums are reduced in a fixed order by reduce.cu: no atomics, so every result
// is bitwise reproducible. Row layout, items and reductions: see common.cuh.
//
// A Stat policy is everything the kernels know of a statistic: its forward sums (`stats`, Row<A>),
// its r (`rstd`: r from the row's variance-like v by the r rule `eps_mode`, so a statistic with
// another r changes no kernel), its centring (`centre`, `mean`, `u_of`) and its backward
// (`accumulate`, `coef`, `xhat`, `dx`). The kernels keep sums of the centred values u = centre * r
// (the backward's sum(u), the parameter-gradient partials) in the accumulation type A: that holds
// for statistics whose r normalizes the row (u = O(1)); the host offers no other
// (pynorm.ops.families.Statistic.normalizes, _loader.supports).
//
// The parameter lists of the four kernels are mirrored field by field by the dataclasses
// of pynorm/backends/cupy/_args.py (tests/test_cupy_kernels.py checks names and types); every
// op of the family passes all of them (null pointers for what it does not have).
#include "common.cuh"

namespace pynorm {

// ---------------------------------------------------------------------------
// the statistic axis

// per-row coefficients of the backward: dx = r * (g - gbar - xhat * coef), xhat = u - cu
template <typename A> struct BwdCoef {
  A cu, gbar, coef;
};

// r of the statistics here (their `rstd`): finalize_rstd (common.cuh) of the scaled row's variance-like
// v, by the r rule eps_mode; returns whether the floor was taken
struct RstdOfV {
  template <class RowT>
  static __device__ __forceinline__ bool rstd(const RowT& st, int ks, double eps, int eps_mode, double& r,
                                              double& rs) {
    return finalize_rstd(st.v, ks, eps, eps_mode, r, rs);
  }
};

// LayerNorm's statistic.
//
// Forward, on x scaled by s = 2^k (exact, see common.cuh):
//   m1 = sum(xs) / H                          first pass
//   S1 = sum(xs - m1), S2 = sum((xs - m1)^2)  second pass (both sums in one reduction)
//   c  = S1 / H                               corrected two-pass mean: mean = m1 + c
//   M2 = S2 - c * S1 = sum((xs - m1 - c)^2)   centred sum of squares (the corrected two-pass
//                                             algorithm of Chan, Golub & LeVeque), never E[x^2] - E[x]^2
//   v  = max(M2, 0) / (H - correction)
// (m1, c) is kept as an unevaluated pair, so rows with a large common offset (1e4 + N(0, 1)
// in float32) keep the accuracy of their deviations; the row is centred as (xs - m1) - c.
//
// Backward, with m, r the saved mean and rstd, g = dy * (w + offset) and the row centred as
// u = (x - m) * r (`centred` guards the subtraction against overflow):
//   cu   = sum(u) / H             the rounding error of the saved mean, in units of 1/r
//   xhat = u - cu                 (so xhat keeps full accuracy on large-offset rows)
//   gbar = sum(g) / H
//   gx   = sum(g * xhat) = sum(g*u) - cu * sum(g)
//   "var": coef = gx / n
//   "std": coef = gx / (n * s * r) with s * r = sqrt(sum(xhat^2) / n)
//          = sqrt((sum(u^2) - cu * sum(u)) / n)  (recomputed from x, overflow-free); 0 where s == 0
struct Centered : RstdOfV {
  static constexpr bool kMean = true;  // saves a per-row mean
  static constexpr int kFwdSums = 2;   // values reduced together in the forward (sizes `red`)
  static constexpr int kBwdSums = 4;   // sum g, sum g*u, sum u, sum u*u

  template <typename A> struct Row {
    A m1, c;  // the row is centred as (xs - m1) - c
    double v;  // variance of the scaled row
  };

  template <typename A, class Each>
  static __device__ __forceinline__ Row<A> stats(Each&& each, A s, int G, A* red, int H, int correction) {
    A sum[1] = {A(0)};
    each([&](A xv) { sum[0] += xv * s; });
    group_sum(sum, G, red);
    Row<A> o;
    o.m1 = sum[0] / A(H);
    // one pass for both sums about m1 (corrected two-pass: Chan, Golub & LeVeque)
    A acc[2] = {A(0), A(0)};
    each([&](A xv) {
      const A d = xv * s - o.m1;
      acc[0] += d;
      acc[1] += d * d;
    });
    group_sum(acc, G, red);
    o.c = acc[0] / A(H);
    const A m2 = acc[1] - o.c * acc[0];  // sum((xs - m1 - c)^2) = S2 - S1^2 / H
    o.v = static_cast<double>(m2 > A(0) ? m2 : A(0)) / static_cast<double>(H - correction);
    return o;
  }
  template <typename A> static __device__ __forceinline__ A centre(A xs, const Row<A>& st) {
    return (xs - st.m1) - st.c;
  }
  template <typename A> static __device__ __forceinline__ A mean(const Row<A>& st, int ks) {
    return static_cast<A>((static_cast<double>(st.m1) + static_cast<double>(st.c)) * ldexp(1.0, -ks));
  }

  template <typename A> static __device__ __forceinline__ A u_of(A x, A m, A r) { return centred(x, m, r); }
  template <typename A> static __device__ __forceinline__ void accumulate(A (&S)[kBwdSums], A u, A g) {
    S[0] += g;
    S[1] += g * u;
    S[2] += u;
    S[3] += u * u;
  }
  template <typename A>
  static __device__ __forceinline__ BwdCoef<A> coef(const A (&S)[kBwdSums], int H, int correction, int eps_mode,
                                                     bool /*floored*/) {
    BwdCoef<A> o;
    const A n = A(H - correction);
    o.cu = div_row(S[2], A(H));
    o.gbar = div_row(S[0], A(H));
    const A gx = S[1] - o.cu * S[0];
    if (eps_mode != kEpsStd) {
      o.coef = div_row(gx, n);
    } else {
      A q = S[3] - o.cu * S[2];
      q = q > A(0) ? q : A(0);
      const A sr = sqrt(div_row(q, n));
      o.coef = sr > A(0) ? div_row(gx, n * sr) : A(0);
    }
    if (!(isfinite(o.gbar) && isfinite(gx))) o.gbar = o.coef = Lim<A>::nan();  // non-finite g: the row's dx is NaN
    return o;
  }
  template <typename A> static __device__ __forceinline__ A xhat(A u, const BwdCoef<A>& cf) { return u - cf.cu; }
  template <typename A> static __device__ __forceinline__ A dx(A r, A g, A xh, const BwdCoef<A>& cf) {
    return r * (g - cf.gbar - xh * cf.coef);
  }
};

// RMSNorm's (PerElement) and ScaleNorm's statistic. Forward: v = sum(xs^2) / H (RMSNorm) or
// sum(xs^2) (ScaleNorm: the squared L2 norm) on the scaled row, the row itself not centred.
// Backward: xhat = x * r, c = sum(g * xhat) / H (RMSNorm) or sum(g * xhat) (ScaleNorm; 0 on rows
// that took the floor, where r = 1/eps does not depend on x), dx = r * (g - xhat * c).
template <bool PerElement> struct Squares : RstdOfV {
  static constexpr bool kMean = false;
  static constexpr int kFwdSums = 1;
  static constexpr int kBwdSums = 1;  // sum g * xhat

  template <typename A> struct Row {
    double v;
  };

  template <typename A, class Each>
  static __device__ __forceinline__ Row<A> stats(Each&& each, A s, int G, A* red, int H, int /*correction*/) {
    A acc[1] = {A(0)};  // masked elements were loaded as 0 and add nothing
    each([&](A xv) {
      const A xs = xv * s;
      acc[0] += xs * xs;
    });
    group_sum(acc, G, red);
    return Row<A>{PerElement ? static_cast<double>(acc[0]) / static_cast<double>(H) : static_cast<double>(acc[0])};
  }
  template <typename A> static __device__ __forceinline__ A centre(A xs, const Row<A>&) { return xs; }
  template <typename A> static __device__ __forceinline__ A mean(const Row<A>&, int) { return A(0); }

  template <typename A> static __device__ __forceinline__ A u_of(A x, A /*m*/, A r) { return x * r; }
  template <typename A> static __device__ __forceinline__ void accumulate(A (&S)[kBwdSums], A u, A g) {
    S[0] += g * u;
  }
  template <typename A>
  static __device__ __forceinline__ BwdCoef<A> coef(const A (&S)[kBwdSums], int H, int, int, bool floored) {
    // a non-finite sum (an inf or NaN in dy or the weight) makes the row's dx NaN (docs/numerics.md)
    const A c = !isfinite(S[0]) ? Lim<A>::nan() : floored ? A(0) : (PerElement ? S[0] / A(H) : S[0]);
    return BwdCoef<A>{A(0), A(0), c};
  }
  template <typename A> static __device__ __forceinline__ A xhat(A u, const BwdCoef<A>&) { return u; }
  template <typename A> static __device__ __forceinline__ A dx(A r, A g, A xh, const BwdCoef<A>& cf) {
    return r * (g - xh * cf.coef);
  }
};
using MeanSquare = Squares<true>;
using SumSquare = Squares<false>;

// ---------------------------------------------------------------------------
// the affine axis: where row `row`'s scale and shift come from (`param_row`) and which element
// of that row serves column i (`col`). The scale is w + offset (1 without a weight), the shift
// b (0 without a bias); the parameter gradients per column: dweight += dy * xhat, dbias += dy.

// per-feature weight and, when B, bias: one (H,) vector for every row
template <bool B> struct Vector {
  static constexpr bool kBias = B;
  static constexpr bool kShared = true;  // every row uses the same parameters
  template <typename W>
  static __device__ __forceinline__ const W* param_row(const W* p, const long long*, long long, int) {
    return p;
  }
  static __device__ __forceinline__ int col(int i) { return i; }
};

// one scalar weight (ScaleNorm's g) for every element; its gradient is the sum of the per-column
// sums, reduced by the host
struct Scalar {
  static constexpr bool kBias = false;
  static constexpr bool kShared = true;
  template <typename W>
  static __device__ __forceinline__ const W* param_row(const W* p, const long long*, long long, int) {
    return p;
  }
  static __device__ __forceinline__ int col(int) { return 0; }
};

// (M, H) tables, row ids[row] serving row `row` (modality norms). The per-column sums of a block
// must not mix modalities: there is no fused backward (rows of any modality share its blocks);
// the split backward's row chunks each hold rows of one modality (the host orders them).
template <bool B> struct Table {
  static constexpr bool kBias = B;
  static constexpr bool kShared = false;
  template <typename W>
  static __device__ __forceinline__ const W* param_row(const W* p, const long long* ids, long long row, int H) {
    return p != nullptr ? p + ids[row] * H : nullptr;
  }
  static __device__ __forceinline__ int col(int i) { return i; }
};

// GroupNorm / InstanceNorm (the channels layout, x as (N, C, S)): row `row` is sample row / G's group
// g = row % G, C/G channels by S positions; element j is scaled by w[g C/G + j / S]. The host gives
// each group's parameters as a row of the (G, H) tables they make (every channel's value repeated
// over its S positions) and ids[row] = g, so the policy is the table's (no fused backward; the split
// backward's row chunks each hold rows of one group, the host orders them); the host sums each
// channel's S columns of the (G, H) gradient tables.
template <bool B> struct Channel : Table<B> {};

// ---------------------------------------------------------------------------
// the prologue / epilogue axis: what the normalized row is

// the row is x itself
struct Plain {
  static constexpr bool kResidual = false;
  static constexpr int kBwdThreads = PYNORM_BWD_THREADS;       // __launch_bounds__ of stats_bwd
  static constexpr int kFwdMinBlocks = PYNORM_FWD_MIN_BLOCKS;  // ... and of stats_fwd
  template <typename T> using Row = T;
  template <typename T> using Res = T;
};

// the row is the pre-norm sum h = x + alpha * residual, computed in double and rounded once to Hd
// (x's type or the accumulation type: a float32 residual stream for float16 x), stored (the
// forward's second output) and normalized as rounded. The residual is read as Rs (Hd, or the
// accumulation type when the host widened it). Backward: the row is the saved h; dh (the gradient
// arriving at h from later layers, Hd, may be null) is added to the norm's gradient g, and
// dx = g, dresidual = alpha * g are each rounded once (to x's type and to Rs).
template <typename Hd, typename Rs> struct Residual {
  static constexpr bool kResidual = true;
  static constexpr int kBwdThreads = PYNORM_BWD_RESIDUAL_THREADS;  // h, dh and dres need more registers
  static constexpr int kFwdMinBlocks = 1;  // h = x + alpha * residual in double: <= 128 registers
  template <typename T> using Row = Hd;
  template <typename T> using Res = Rs;
};

template <class Pro, typename T> using row_t = typename Pro::template Row<T>;
template <class Pro, typename T> using res_t = typename Pro::template Res<T>;

// the accumulation type covers every operand (the host widens W where h or the residual is double)
template <typename T, typename W, class Pro> struct CheckAcc {
  static constexpr bool ok =
      is_double<acc_t<T, W>>::value || !(is_double<row_t<Pro, T>>::value || is_double<res_t<Pro, T>>::value);
  static_assert(ok, "a double pre-norm sum or residual needs double accumulation");
};

// dx of one item from the norm's gradient v (in the accumulation type): plus dh, rounded once to
// T; with a residual also dresidual = alpha * (v + dh) rounded once to Rs
template <class Pro, typename T, typename A, int V>
__device__ __forceinline__ void store_dx(T* __restrict__ dxr, res_t<Pro, T>* __restrict__ dresr,
                                         const row_t<Pro, T>* __restrict__ dhr, A (&v)[V], int b, int H, bool vm,
                                         double alpha) {
  if constexpr (Pro::kResidual) {
    if (dhr != nullptr) {
      const Pack<row_t<Pro, T>, V> d = load_item<V>(dhr, b, H, vm);
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] += to_acc<A>(d.v[e]);
    }
  }
  Vec<T> o;
#pragma unroll
  for (int e = 0; e < V; ++e) o.v[e] = Conv<T>::from(v[e]);
  store_item<V>(dxr, o, b, H, vm);
  if constexpr (Pro::kResidual) {
    if (dresr != nullptr) {
      Pack<res_t<Pro, T>, V> q;
#pragma unroll
      for (int e = 0; e < V; ++e) q.v[e] = Conv<res_t<Pro, T>>::from(alpha * static_cast<double>(v[e]));
      store_item<V>(dresr, q, b, H, vm);
    }
  }
}

// ---------------------------------------------------------------------------
// forward

template <typename T, typename W, class Stat, class Affine, class Pro>
__global__ void __launch_bounds__(PYNORM_FWD_THREADS, Pro::kFwdMinBlocks)
stats_fwd(const T* __restrict__ x, const res_t<Pro, T>* __restrict__ residual, const W* __restrict__ weight,
          const W* __restrict__ bias, const long long* __restrict__ ids, T* __restrict__ y,
          row_t<Pro, T>* __restrict__ h_out, acc_t<T, W>* __restrict__ mean_out, acc_t<T, W>* __restrict__ rstd_out,
          bool* __restrict__ floor_out, long long rows, int hidden, double eps, int correction, int eps_mode,
          double weight_offset, double alpha, int log2g, int vec, int over_smem) {
  using A = acc_t<T, W>;
  using X = row_t<Pro, T>;  // the normalized row's elements: x, or the pre-norm sum h
  static_assert(CheckAcc<T, W, Pro>::ok, "accumulation type");
  constexpr int V = vec_n<T>();
  using Item = Pack<X, V>;
  constexpr int K = FwdItems<T, A>::value;
  __shared__ A red[Stat::kFwdSums * 32];
  extern __shared__ __align__(16) unsigned char dyn_smem[];

  const long long R = rows;
  const int H = hidden;
  const RowGroup grp(log2g, H, V);
  const int G = grp.G, t = grp.t, gi = grp.gi, gpb = grp.gpb, nk = grp.nk;
  const int nover = nk > K ? nk - K : 0;
  const bool vm = vec != 0;
  const A wo = static_cast<A>(weight_offset);
  Item* over = reinterpret_cast<Item*>(dyn_smem) + static_cast<size_t>(gi) * nover * G;

  for (long long r0 = static_cast<long long>(blockIdx.x) * gpb; r0 < R;
       r0 += static_cast<long long>(gridDim.x) * gpb) {
    const long long row = r0 + gi;
    const bool valid = row < R;
    const long long off = (valid ? row : 0LL) * H;

    // item k of the row: x, or h = x + alpha * residual rounded once; read once (h is stored
    // after the loads: storing it inside fetch doubled the register pressure)
    auto fetch = [&](int k) -> Item {
      const int b = item_base<T>(t, k, G);
      if constexpr (Pro::kResidual) {
        const Vec<T> xi = load_item<V>(x + off, b, H, vm);
        const Pack<res_t<Pro, T>, V> ri = load_item<V>(residual + off, b, H, vm);
        Item hi;
#pragma unroll
        for (int e = 0; e < V; ++e) hi.v[e] = Conv<X>::from(fma(alpha, to_acc<double>(ri.v[e]), to_acc<double>(xi.v[e])));
        return hi;
      } else {
        return load_item<V>(x + off, b, H, vm);
      }
    };
    // item k again, after the first pass (h was stored by this very thread)
    auto refetch = [&](int k) -> Item {
      const int b = item_base<T>(t, k, G);
      if constexpr (Pro::kResidual) {
        return load_item<V>(h_out + off, b, H, vm);
      } else {
        return load_item<V>(x + off, b, H, vm);
      }
    };

    // pass A: load the row once (registers, then shared memory); largest magnitude for the scaling
    Item xc[K];
    A amax = A(0);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      xc[k] = (valid && k < nk) ? fetch(k) : zero_item<V, X>();
      if (needs_scaling<X>::value) {
#pragma unroll
        for (int e = 0; e < V; ++e) amax = fmax(amax, fabs(to_acc<A>(xc[k].v[e])));
      }
    }
    if constexpr (Pro::kResidual) {
      if (valid) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
          if (k < nk) store_item<V>(h_out + off, xc[k], item_base<T>(t, k, G), H, vm);
        }
      }
    }
    for (int k = K; k < nk; ++k) {
      const Item it = valid ? fetch(k) : zero_item<V, X>();
      if constexpr (Pro::kResidual) {
        if (valid) store_item<V>(h_out + off, it, item_base<T>(t, k, G), H, vm);
      }
      if (over_smem) over[(k - K) * G + t] = it;
      if (needs_scaling<X>::value) {
#pragma unroll
        for (int e = 0; e < V; ++e) amax = fmax(amax, fabs(to_acc<A>(it.v[e])));
      }
    }
    auto over_item = [&](int k) -> Item {
      if (over_smem) return over[(k - K) * G + t];
      return valid ? refetch(k) : zero_item<V, X>();
    };
    // fn(value) for every element of the row this thread owns
    auto each = [&](auto&& fn) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (k < nk) {
          const int b = item_base<T>(t, k, G);
#pragma unroll
          for (int e = 0; e < V; ++e) {
            if (b + e < H) fn(to_acc<A>(xc[k].v[e]));
          }
        }
      }
      for (int k = K; k < nk; ++k) {
        const Item it = over_item(k);
        const int b = item_base<T>(t, k, G);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          if (b + e < H) fn(to_acc<A>(it.v[e]));
        }
      }
    };

    const int ks = needs_scaling<X>::value ? scale_exponent(group_max(amax, G, red)) : 0;
    const A s = static_cast<A>(ldexp(1.0, ks));
    const typename Stat::template Row<A> st = Stat::stats(each, s, G, red, H, correction);

    double r, rs;
    const bool floored = Stat::rstd(st, ks, eps, eps_mode, r, rs);  // the statistic's r rule
    const A rsa = scaled_factor<A>(r, rs);
    if (valid && t == 0) {
      if (Stat::kMean) mean_out[row] = Stat::mean(st, ks);
      rstd_out[row] = static_cast<A>(r);
      if (floor_out != nullptr) floor_out[row] = floored;
    }

    // last pass: y = centre(xs) * rs * (w + offset) + b, rounded once to T
    if (valid) {
      const W* wr = Affine::param_row(weight, ids, row, H);
      const W* br = Affine::param_row(bias, ids, row, H);
      auto emit = [&](const Item& it, int k) {
        const int b = item_base<T>(t, k, G);
        Vec<T> o;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const int i = b + e;
          A v = A(0);
          if (i < H) {
            v = Stat::centre(to_acc<A>(it.v[e]) * s, st) * rsa;
            if (wr != nullptr) v = v * eff_weight<A>(wr, Affine::col(i), wo);
            if (Affine::kBias && br != nullptr) v = v + bias_at<A>(br, Affine::col(i));
          }
          o.v[e] = Conv<T>::from(v);
        }
        store_item<V>(y + off, o, b, H, vm);
      };
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (k < nk) emit(xc[k], k);
      }
      for (int k = K; k < nk; ++k) emit(over_item(k), k);
    }
  }
}

// ---------------------------------------------------------------------------
// backward

// the groups of a block add their per-column partial sums into the block's partial rows in a
// fixed order (group 0 stores, group 1 adds, ...), one barrier per group; `pw` / `pb` are
// null where the op has no such parameter (uniform across the block)
template <bool Bias, typename T, typename A, int K, int V>
__device__ __forceinline__ void store_partials(A* __restrict__ pw, A* __restrict__ pb, const A (&aw)[K][V],
                                               const A (&ab)[K][V], int t, int G, int gi, int gpb, int nk, int H) {
  for (int q = 0; q < gpb; ++q) {
    if (gi == q) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (k < nk) {
          const int b = item_base<T>(t, k, G);
#pragma unroll
          for (int e = 0; e < V; ++e) {
            const int i = b + e;
            if (i < H) {
              if (pw != nullptr) pw[i] = (q == 0 ? A(0) : pw[i]) + aw[k][e];
              if (Bias && pb != nullptr) pb[i] = (q == 0 ? A(0) : pb[i]) + ab[k][e];
            }
          }
        }
      }
    }
    __syncthreads();
  }
}

// the backward's row sums over one item of a row (row and dy elements b .. b + V - 1); `wr` is
// the row's weights
template <class Stat, class Affine, typename T, typename X, typename W, typename A>
__device__ __forceinline__ void accumulate_item(A (&S)[Stat::kBwdSums], const X* __restrict__ xr,
                                                const T* __restrict__ dyr, const W* __restrict__ wr, int b, int H,
                                                bool vm, A m, A r, A wo) {
  constexpr int V = vec_n<T>();
  const Pack<X, V> xi = load_item<V>(xr, b, H, vm);
  const Vec<T> di = load_item<V>(dyr, b, H, vm);
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const int i = b + e;
    if (i < H) {
      const A g = to_acc<A>(di.v[e]) * eff_weight<A>(wr, Affine::col(i), wo);
      Stat::accumulate(S, Stat::u_of(to_acc<A>(xi.v[e]), m, r), g);
    }
  }
}

// the backward's row sums of this thread's part of a row: K > 0, at most K items per thread (the
// fused kernel, fully unrolled); K == 0, any number of items, streamed (the split path)
template <class Stat, class Affine, int K, typename T, typename X, typename W, typename A>
__device__ __forceinline__ void bwd_row_sums(A (&S)[Stat::kBwdSums], bool valid, const X* __restrict__ xr,
                                             const T* __restrict__ dyr, const W* __restrict__ wr,
                                             const RowGroup& grp, int H, bool vm, A m, A r, A wo) {
#pragma unroll
  for (int j = 0; j < Stat::kBwdSums; ++j) S[j] = A(0);
  if constexpr (K > 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (valid && k < grp.nk) {
        accumulate_item<Stat, Affine>(S, xr, dyr, wr, item_base<T>(grp.t, k, grp.G), H, vm, m, r, wo);
      }
    }
  } else if (valid) {
    // two items in flight where they are narrow; one where 2 x V accumulators would spill
    [[maybe_unused]] constexpr int U = sizeof(A) * vec_n<T>() <= 32 ? 2 : 1;
#pragma unroll U
    for (int k = 0; k < grp.nk; ++k) {
      accumulate_item<Stat, Affine>(S, xr, dyr, wr, item_base<T>(grp.t, k, grp.G), H, vm, m, r, wo);
    }
  }
}

template <typename T, typename W, class Stat, class Affine, class Pro>
__device__ __forceinline__ void stats_bwd_rows(const T* __restrict__ dy, const row_t<Pro, T>* __restrict__ x,
                                               const row_t<Pro, T>* __restrict__ dh, const W* __restrict__ weight,
                                               const acc_t<T, W>* __restrict__ mean,
                                               const acc_t<T, W>* __restrict__ rstd, const bool* __restrict__ floors,
                                               T* __restrict__ dx, res_t<Pro, T>* __restrict__ dres,
                                               acc_t<T, W>* __restrict__ part_w, acc_t<T, W>* __restrict__ part_b,
                                               long long R, int H, int correction, int eps_mode,
                                               double weight_offset, double alpha, int log2g, int vec) {
  using A = acc_t<T, W>;
  using X = row_t<Pro, T>;
  constexpr int V = vec_n<T>();
  constexpr int K = BwdItems<T, A>::value;  // the host guarantees nk <= K
  constexpr int NS = Stat::kBwdSums;
  __shared__ A red[NS * 32];

  const RowGroup grp(log2g, H, V);
  const int G = grp.G, t = grp.t, gi = grp.gi, gpb = grp.gpb, nk = grp.nk;
  const bool vm = vec != 0;
  const A wo = static_cast<A>(weight_offset);

  A aw[K][V], ab[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int e = 0; e < V; ++e) aw[k][e] = ab[k][e] = A(0);
  }

  for (long long r0 = static_cast<long long>(blockIdx.x) * gpb; r0 < R;
       r0 += static_cast<long long>(gridDim.x) * gpb) {
    const long long row = r0 + gi;
    const bool valid = row < R;
    const long long off = (valid ? row : 0LL) * H;
    const A m = Stat::kMean && valid ? mean[row] : A(0);
    const A r = valid ? rstd[row] : A(0);
    const bool floored = valid && floors != nullptr && floors[row];

    // pass 1: the row sums (the row and dy are read again in pass 2, from L1/L2)
    A S[NS];
    bwd_row_sums<Stat, Affine, K>(S, valid, x + off, dy + off, weight, grp, H, vm, m, r, wo);
    group_sum(S, G, red);
    const BwdCoef<A> cf = Stat::coef(S, H, correction, eps_mode, floored);

    if (valid) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (k < nk) {
          const int b = item_base<T>(t, k, G);
          const Pack<X, V> xi = load_item<V>(x + off, b, H, vm);
          const Vec<T> di = load_item<V>(dy + off, b, H, vm);
          A v[V];
#pragma unroll
          for (int e = 0; e < V; ++e) {
            const int i = b + e;
            v[e] = A(0);
            if (i < H) {
              const A dv = to_acc<A>(di.v[e]);
              const A xh = Stat::xhat(Stat::u_of(to_acc<A>(xi.v[e]), m, r), cf);
              v[e] = Stat::dx(r, dv * eff_weight<A>(weight, Affine::col(i), wo), xh, cf);
              aw[k][e] += dv * xh;
              if (Affine::kBias) ab[k][e] += dv;
            }
          }
          store_dx<Pro>(dx + off, row_at(dres, off), row_at(dh, off), v, b, H, vm, alpha);
        }
      }
    }
  }

  // per-block partial sums
  const long long poff = static_cast<long long>(blockIdx.x) * H;
  if (part_w == nullptr && (!Affine::kBias || part_b == nullptr)) return;  // uniform across the block
  store_partials<Affine::kBias, T>(part_w != nullptr ? part_w + poff : nullptr,
                                   Affine::kBias && part_b != nullptr ? part_b + poff : nullptr, aw, ab, t, G, gi,
                                   gpb, nk, H);
}

// fused backward kernel of the ops whose rows share their parameters; empty for type pairs without
// a fused path (BwdItems<T, A>::fits is false) and for parameter tables: the host takes the split
// path there
template <typename T, typename W, class Stat, class Affine, class Pro>
__global__ void __launch_bounds__(Pro::kBwdThreads, PYNORM_BWD_MIN_BLOCKS)
stats_bwd(const T* __restrict__ dy, const row_t<Pro, T>* __restrict__ x, const row_t<Pro, T>* __restrict__ dh,
          const W* __restrict__ weight, const acc_t<T, W>* __restrict__ mean, const acc_t<T, W>* __restrict__ rstd,
          const bool* __restrict__ floors, T* __restrict__ dx, res_t<Pro, T>* __restrict__ dres,
          acc_t<T, W>* __restrict__ part_w, acc_t<T, W>* __restrict__ part_b, long long rows, int hidden,
          int correction, int eps_mode, double weight_offset, double alpha, int log2g, int vec) {
  if constexpr (BwdItems<T, acc_t<T, W>>::fits && Affine::kShared) {
    stats_bwd_rows<T, W, Stat, Affine, Pro>(dy, x, dh, weight, mean, rstd, floors, dx, dres, part_w, part_b, rows,
                                            hidden, correction, eps_mode, weight_offset, alpha, log2g, vec);
  }
}

// split backward, step 1: per-row (cu, gbar, coef) for any H, streaming the row
template <typename T, typename W, class Stat, class Affine, class Pro>
__global__ void __launch_bounds__(PYNORM_STATS_THREADS)
stats_bwd_stats(const T* __restrict__ dy, const row_t<Pro, T>* __restrict__ x, const W* __restrict__ weight,
                const long long* __restrict__ ids, const acc_t<T, W>* __restrict__ mean,
                const acc_t<T, W>* __restrict__ rstd, const bool* __restrict__ floors,
                acc_t<T, W>* __restrict__ coefs, long long rows, int hidden, int correction, int eps_mode,
                double weight_offset, int log2g, int vec) {
  using A = acc_t<T, W>;
  constexpr int V = vec_n<T>();
  constexpr int NS = Stat::kBwdSums;
  __shared__ A red[NS * 32];

  const long long R = rows;
  const int H = hidden;
  const RowGroup grp(log2g, H, V);
  const int G = grp.G, t = grp.t, gi = grp.gi, gpb = grp.gpb;
  const bool vm = vec != 0;
  const A wo = static_cast<A>(weight_offset);

  for (long long r0 = static_cast<long long>(blockIdx.x) * gpb; r0 < R;
       r0 += static_cast<long long>(gridDim.x) * gpb) {
    const long long row = r0 + gi;
    const bool valid = row < R;
    const long long off = (valid ? row : 0LL) * H;
    const A m = Stat::kMean && valid ? mean[row] : A(0);
    const A r = valid ? rstd[row] : A(0);
    const bool floored = valid && floors != nullptr && floors[row];
    const W* wr = valid ? Affine::param_row(weight, ids, row, H) : weight;
    A S[NS];
    bwd_row_sums<Stat, Affine, 0>(S, valid, x + off, dy + off, wr, grp, H, vm, m, r, wo);
    group_sum(S, G, red);
    const BwdCoef<A> cf = Stat::coef(S, H, correction, eps_mode, floored);
    if (valid && t == 0) {
      coefs[row * 3 + 0] = cf.cu;
      coefs[row * 3 + 1] = cf.gbar;
      coefs[row * 3 + 2] = cf.coef;
    }
  }
}

// split backward, step 2: block (blockIdx.x, blockIdx.y) handles the rows of chunk blockIdx.x
// and item blockIdx.y of each thread (a tile of columns): dx, and the chunk's partial sums for
// those columns. Chunk c holds rows order[j] for j in [chunk_rows[c], chunk_rows[c + 1]) --
// with null `order` / `chunk_rows`: rows j in [c * rows_per_chunk, (c + 1) * rows_per_chunk) --
// and every row of a chunk uses the parameters of its first row (one modality per chunk).
template <typename T, typename W, class Stat, class Affine, class Pro>
__global__ void __launch_bounds__(PYNORM_APPLY_THREADS)
stats_bwd_apply(const T* __restrict__ dy, const row_t<Pro, T>* __restrict__ x,
                const row_t<Pro, T>* __restrict__ dh, const W* __restrict__ weight,
                const long long* __restrict__ ids, const acc_t<T, W>* __restrict__ mean,
                const acc_t<T, W>* __restrict__ rstd, const acc_t<T, W>* __restrict__ coefs,
                const long long* __restrict__ order, const long long* __restrict__ chunk_rows, T* __restrict__ dx,
                res_t<Pro, T>* __restrict__ dres, acc_t<T, W>* __restrict__ part_w,
                acc_t<T, W>* __restrict__ part_b, long long rows, int hidden, long long rows_per_chunk,
                double weight_offset, double alpha, int vec) {
  using A = acc_t<T, W>;
  using X = row_t<Pro, T>;
  constexpr int V = vec_n<T>();
  const long long R = rows;
  const int H = hidden;
  const int G = blockDim.x;
  const int t = threadIdx.x;
  const bool vm = vec != 0;
  const int b = item_base<T>(t, blockIdx.y, G);
  const A wo = static_cast<A>(weight_offset);

  long long j_begin, j_end;
  if (chunk_rows != nullptr) {
    j_begin = chunk_rows[blockIdx.x];
    j_end = chunk_rows[blockIdx.x + 1];
  } else {
    j_begin = static_cast<long long>(blockIdx.x) * rows_per_chunk;
    j_end = j_begin + rows_per_chunk < R ? j_begin + rows_per_chunk : R;
  }
  const W* wr = j_begin < j_end ? Affine::param_row(weight, ids, order != nullptr ? order[j_begin] : j_begin, H)
                                : weight;
  A wv[V], aw[V], ab[V];
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const int i = b + e;
    wv[e] = i < H ? eff_weight<A>(wr, Affine::col(i), wo) : A(0);
    aw[e] = ab[e] = A(0);
  }
  for (long long j = j_begin; j < j_end; ++j) {
    const long long row = order != nullptr ? order[j] : j;
    const long long off = row * H;
    const Pack<X, V> xi = load_item<V>(x + off, b, H, vm);
    const Vec<T> gi_ = load_item<V>(dy + off, b, H, vm);
    const A m = Stat::kMean ? mean[row] : A(0);
    const A r = rstd[row];
    const BwdCoef<A> cf{coefs[row * 3 + 0], coefs[row * 3 + 1], coefs[row * 3 + 2]};
    A v[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int i = b + e;
      v[e] = A(0);
      if (i < H) {
        const A dv = to_acc<A>(gi_.v[e]);
        const A xh = Stat::xhat(Stat::u_of(to_acc<A>(xi.v[e]), m, r), cf);
        v[e] = Stat::dx(r, dv * wv[e], xh, cf);
        aw[e] += dv * xh;
        if (Affine::kBias) ab[e] += dv;
      }
    }
    store_dx<Pro>(dx + off, row_at(dres, off), row_at(dh, off), v, b, H, vm, alpha);
  }
  store_column_partial(part_w, aw, b, H);
  if (Affine::kBias) store_column_partial(part_b, ab, b, H);
}

}  // namespace pynorm
