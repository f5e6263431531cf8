// The statistics kernel family of pynorm's CuPy backend: row norms defined by per-row
// statistics (LayerNorm, RMSNorm, and the ops the family issues add). The math of each
// op is defined in pynorm/reference/<op>.py; an op is one choice per variant axis:
//
//   Stat    the per-row statistic and how it centres / scales the row
//             Centered    mean and variance (corrected two-pass)      LayerNorm
//             MeanSquare  mean of squares                             RMSNorm
//   Affine  where the output's scale and shift come from
//             Vector<B>   per-feature weight (+ offset), bias when B
//
// (the input prologue -- plain today, a residual add next -- and the output epilogue --
// plain today, the pre-norm sum or int8 quantization next -- are the two axes the family
// issues add, as template parameters beside these two).
//
// Kernels (templates over T = x/y/dx dtype, W = parameter dtype, and the variant):
//   stats_fwd          forward: y, per-row statistics (mean when the statistic has one, rstd)
//   stats_bwd          fused backward, rows held in registers: dx and per-block partial sums of
//                      the parameter gradients
//   stats_bwd_stats    split backward, step 1 (any H): per-row coefficients
//   stats_bwd_apply    split backward, step 2: dx and per-chunk partial sums
// The partial sums are reduced in a fixed order by reduce.cu: no atomics, so every result
// is bitwise reproducible. Row layout, items and reductions: see common.cuh.
//
// The parameter lists of the four kernels are mirrored field by field by the dataclasses
// of pynorm/backends/cupy/stats.py (tests/test_cupy_kernels.py checks names and types).
#include "common.cuh"

namespace pynorm {

// ---------------------------------------------------------------------------
// the statistic axis

// per-row coefficients of the backward: dx = r * (g - gbar - xhat * coef), xhat = u - cu
template <typename A> struct BwdCoef {
  A cu, gbar, coef;
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
struct Centered {
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
  static __device__ __forceinline__ BwdCoef<A> coef(const A (&S)[kBwdSums], int H, int correction, bool std_mode) {
    BwdCoef<A> o;
    const A n = A(H - correction);
    o.cu = div_row(S[2], A(H));
    o.gbar = div_row(S[0], A(H));
    const A gx = S[1] - o.cu * S[0];
    if (!std_mode) {
      o.coef = div_row(gx, n);
    } else {
      A q = S[3] - o.cu * S[2];
      q = q > A(0) ? q : A(0);
      const A sr = sqrt(div_row(q, n));
      o.coef = sr > A(0) ? div_row(gx, n * sr) : A(0);
    }
    return o;
  }
  template <typename A> static __device__ __forceinline__ A xhat(A u, const BwdCoef<A>& cf) { return u - cf.cu; }
  template <typename A> static __device__ __forceinline__ A dx(A r, A g, A xh, const BwdCoef<A>& cf) {
    return r * (g - cf.gbar - xh * cf.coef);
  }
};

// RMSNorm's statistic. Forward: v = sum(xs^2) / H on the scaled row, the row itself not
// centred. Backward: xhat = x * r, c = sum(g * xhat) / H, dx = r * (g - xhat * c).
struct MeanSquare {
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
    return Row<A>{static_cast<double>(acc[0]) / static_cast<double>(H)};
  }
  template <typename A> static __device__ __forceinline__ A centre(A xs, const Row<A>&) { return xs; }
  template <typename A> static __device__ __forceinline__ A mean(const Row<A>&, int) { return A(0); }

  template <typename A> static __device__ __forceinline__ A u_of(A x, A /*m*/, A r) { return x * r; }
  template <typename A> static __device__ __forceinline__ void accumulate(A (&S)[kBwdSums], A u, A g) {
    S[0] += g * u;
  }
  template <typename A>
  static __device__ __forceinline__ BwdCoef<A> coef(const A (&S)[kBwdSums], int H, int, bool) {
    return BwdCoef<A>{A(0), A(0), S[0] / A(H)};
  }
  template <typename A> static __device__ __forceinline__ A xhat(A u, const BwdCoef<A>&) { return u; }
  template <typename A> static __device__ __forceinline__ A dx(A r, A g, A xh, const BwdCoef<A>& cf) {
    return r * (g - xh * cf.coef);
  }
};

// ---------------------------------------------------------------------------
// the affine axis

// Per-feature weight (w + offset; 1 without a weight) and, when B, a per-feature bias
// (0 without one). The parameter gradients: dweight += dy * xhat, dbias += dy.
template <bool B> struct Vector {
  static constexpr bool kBias = B;
};

// ---------------------------------------------------------------------------
// forward

template <typename T, typename W, class Stat, class Affine>
__global__ void __launch_bounds__(PYNORM_FWD_THREADS, PYNORM_FWD_MIN_BLOCKS)
stats_fwd(const T* __restrict__ x, const W* __restrict__ weight, const W* __restrict__ bias, T* __restrict__ y,
          acc_t<T, W>* __restrict__ mean_out, acc_t<T, W>* __restrict__ rstd_out, long long rows, int hidden,
          double eps, int correction, int std_mode, double weight_offset, int log2g, int vec, int over_smem) {
  using A = acc_t<T, W>;
  constexpr int V = Vec<T>::N;
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
  Vec<T>* over = reinterpret_cast<Vec<T>*>(dyn_smem) + static_cast<size_t>(gi) * nover * G;

  for (long long r0 = static_cast<long long>(blockIdx.x) * gpb; r0 < R;
       r0 += static_cast<long long>(gridDim.x) * gpb) {
    const long long row = r0 + gi;
    const bool valid = row < R;
    const T* xr = x + (valid ? row : 0LL) * H;

    // pass A: load the row once (registers, then shared memory); largest magnitude for the scaling
    Vec<T> xc[K];
    A amax = A(0);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      xc[k] = (valid && k < nk) ? load_item(xr, item_base<T>(t, k, G), H, vm) : zero_item<T>();
      if (needs_scaling<T>::value) {
#pragma unroll
        for (int e = 0; e < V; ++e) amax = fmax(amax, fabs(to_acc<A>(xc[k].v[e])));
      }
    }
    for (int k = K; k < nk; ++k) {
      const Vec<T> it = valid ? load_item(xr, item_base<T>(t, k, G), H, vm) : zero_item<T>();
      if (over_smem) over[(k - K) * G + t] = it;
      if (needs_scaling<T>::value) {
#pragma unroll
        for (int e = 0; e < V; ++e) amax = fmax(amax, fabs(to_acc<A>(it.v[e])));
      }
    }
    auto over_item = [&](int k) -> Vec<T> {
      if (over_smem) return over[(k - K) * G + t];
      return valid ? load_item(xr, item_base<T>(t, k, G), H, vm) : zero_item<T>();
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
        const Vec<T> it = over_item(k);
        const int b = item_base<T>(t, k, G);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          if (b + e < H) fn(to_acc<A>(it.v[e]));
        }
      }
    };

    const int ks = needs_scaling<T>::value ? scale_exponent(group_max(amax, G, red)) : 0;
    const A s = static_cast<A>(ldexp(1.0, ks));
    const typename Stat::template Row<A> st = Stat::stats(each, s, G, red, H, correction);

    double r, rs;
    finalize_rstd(st.v, ks, eps, std_mode != 0, r, rs);
    const A rsa = scaled_factor<A>(r, rs);
    if (valid && t == 0) {
      if (Stat::kMean) mean_out[row] = Stat::mean(st, ks);
      rstd_out[row] = static_cast<A>(r);
    }

    // last pass: y = centre(xs) * rs * (w + offset) + b, rounded once to T
    if (valid) {
      T* yr = y + row * H;
      auto emit = [&](const Vec<T>& it, int k) {
        const int b = item_base<T>(t, k, G);
        Vec<T> o;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const int i = b + e;
          A v = A(0);
          if (i < H) {
            v = Stat::centre(to_acc<A>(it.v[e]) * s, st) * rsa;
            if (weight != nullptr) v = v * eff_weight<A>(weight, i, wo);
            if (Affine::kBias && bias != nullptr) v = v + bias_at<A>(bias, i);
          }
          o.v[e] = Conv<T>::from(v);
        }
        store_item(yr, o, b, H, vm);
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

// the backward's row sums over one item of a row (x and dy elements b .. b + V - 1)
template <class Stat, typename T, typename W, typename A>
__device__ __forceinline__ void accumulate_item(A (&S)[Stat::kBwdSums], const T* __restrict__ xr,
                                                const T* __restrict__ dyr, const W* __restrict__ weight, int b, int H,
                                                bool vm, A m, A r, A wo) {
  constexpr int V = Vec<T>::N;
  const Vec<T> xi = load_item(xr, b, H, vm);
  const Vec<T> di = load_item(dyr, b, H, vm);
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const int i = b + e;
    if (i < H) {
      const A g = to_acc<A>(di.v[e]) * eff_weight<A>(weight, i, wo);
      Stat::accumulate(S, Stat::u_of(to_acc<A>(xi.v[e]), m, r), g);
    }
  }
}

// the backward's row sums of this thread's part of a row: K > 0, at most K items per thread (the
// fused kernel, fully unrolled); K == 0, any number of items, streamed (the split path)
template <class Stat, int K, typename T, typename W, typename A>
__device__ __forceinline__ void bwd_row_sums(A (&S)[Stat::kBwdSums], bool valid, const T* __restrict__ xr,
                                             const T* __restrict__ dyr, const W* __restrict__ weight,
                                             const RowGroup& grp, int H, bool vm, A m, A r, A wo) {
#pragma unroll
  for (int j = 0; j < Stat::kBwdSums; ++j) S[j] = A(0);
  if constexpr (K > 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (valid && k < grp.nk) {
        accumulate_item<Stat>(S, xr, dyr, weight, item_base<T>(grp.t, k, grp.G), H, vm, m, r, wo);
      }
    }
  } else if (valid) {
#pragma unroll 2
    for (int k = 0; k < grp.nk; ++k) {
      accumulate_item<Stat>(S, xr, dyr, weight, item_base<T>(grp.t, k, grp.G), H, vm, m, r, wo);
    }
  }
}

template <typename T, typename W, class Stat, class Affine>
__device__ __forceinline__ void stats_bwd_rows(const T* __restrict__ dy, const T* __restrict__ x,
                                               const W* __restrict__ weight, const acc_t<T, W>* __restrict__ mean,
                                               const acc_t<T, W>* __restrict__ rstd, T* __restrict__ dx,
                                               acc_t<T, W>* __restrict__ part_w, acc_t<T, W>* __restrict__ part_b,
                                               long long R, int H, int correction, int std_mode,
                                               double weight_offset, int log2g, int vec) {
  using A = acc_t<T, W>;
  constexpr int V = Vec<T>::N;
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

    // pass 1: the row sums (x and dy are read again in pass 2, from L1/L2)
    A S[NS];
    bwd_row_sums<Stat, K>(S, valid, x + off, dy + off, weight, grp, H, vm, m, r, wo);
    group_sum(S, G, red);
    const BwdCoef<A> cf = Stat::coef(S, H, correction, std_mode != 0);

    if (valid) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (k < nk) {
          const int b = item_base<T>(t, k, G);
          const Vec<T> xi = load_item(x + off, b, H, vm);
          const Vec<T> di = load_item(dy + off, b, H, vm);
          Vec<T> o;
#pragma unroll
          for (int e = 0; e < V; ++e) {
            const int i = b + e;
            A v = A(0);
            if (i < H) {
              const A dv = to_acc<A>(di.v[e]);
              const A xh = Stat::xhat(Stat::u_of(to_acc<A>(xi.v[e]), m, r), cf);
              v = Stat::dx(r, dv * eff_weight<A>(weight, i, wo), xh, cf);
              aw[k][e] += dv * xh;
              if (Affine::kBias) ab[k][e] += dv;
            }
            o.v[e] = Conv<T>::from(v);
          }
          store_item(dx + off, o, b, H, vm);
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

// fused backward kernel; empty for type pairs without a fused path
// (BwdItems<T, A>::fits is false: the host takes the split path)
template <typename T, typename W, class Stat, class Affine>
__global__ void __launch_bounds__(PYNORM_BWD_THREADS, PYNORM_BWD_MIN_BLOCKS)
stats_bwd(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
          const acc_t<T, W>* __restrict__ mean, const acc_t<T, W>* __restrict__ rstd, T* __restrict__ dx,
          acc_t<T, W>* __restrict__ part_w, acc_t<T, W>* __restrict__ part_b, long long rows, int hidden,
          int correction, int std_mode, double weight_offset, int log2g, int vec) {
  if constexpr (BwdItems<T, acc_t<T, W>>::fits) {
    stats_bwd_rows<T, W, Stat, Affine>(dy, x, weight, mean, rstd, dx, part_w, part_b, rows, hidden, correction,
                                       std_mode, weight_offset, log2g, vec);
  }
}

// split backward, step 1: per-row (cu, gbar, coef) for any H, streaming the row
template <typename T, typename W, class Stat, class Affine>
__global__ void __launch_bounds__(PYNORM_STATS_THREADS)
stats_bwd_stats(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
                const acc_t<T, W>* __restrict__ mean, const acc_t<T, W>* __restrict__ rstd,
                acc_t<T, W>* __restrict__ coefs, long long rows, int hidden, int correction, int std_mode,
                double weight_offset, int log2g, int vec) {
  using A = acc_t<T, W>;
  constexpr int V = Vec<T>::N;
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
    A S[NS];
    bwd_row_sums<Stat, 0>(S, valid, x + off, dy + off, weight, grp, H, vm, m, r, wo);
    group_sum(S, G, red);
    const BwdCoef<A> cf = Stat::coef(S, H, correction, std_mode != 0);
    if (valid && t == 0) {
      coefs[row * 3 + 0] = cf.cu;
      coefs[row * 3 + 1] = cf.gbar;
      coefs[row * 3 + 2] = cf.coef;
    }
  }
}

// split backward, step 2: block (blockIdx.x, blockIdx.y) handles the rows of chunk blockIdx.x
// and item blockIdx.y of each thread (a tile of columns): dx, and the chunk's partial sums for
// those columns.
template <typename T, typename W, class Stat, class Affine>
__global__ void __launch_bounds__(PYNORM_APPLY_THREADS)
stats_bwd_apply(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
                const acc_t<T, W>* __restrict__ mean, const acc_t<T, W>* __restrict__ rstd,
                const acc_t<T, W>* __restrict__ coefs, T* __restrict__ dx, acc_t<T, W>* __restrict__ part_w,
                acc_t<T, W>* __restrict__ part_b, long long rows, int hidden, long long rows_per_chunk,
                double weight_offset, int vec) {
  using A = acc_t<T, W>;
  constexpr int V = Vec<T>::N;
  const long long R = rows;
  const int H = hidden;
  const int G = blockDim.x;
  const int t = threadIdx.x;
  const bool vm = vec != 0;
  const int b = item_base<T>(t, blockIdx.y, G);
  const A wo = static_cast<A>(weight_offset);

  A wv[V], aw[V], ab[V];
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const int i = b + e;
    wv[e] = i < H ? eff_weight<A>(weight, i, wo) : A(0);
    aw[e] = ab[e] = A(0);
  }
  const long long r_begin = static_cast<long long>(blockIdx.x) * rows_per_chunk;
  const long long r_end = r_begin + rows_per_chunk < R ? r_begin + rows_per_chunk : R;
  for (long long row = r_begin; row < r_end; ++row) {
    const long long off = row * H;
    const Vec<T> xi = load_item(x + off, b, H, vm);
    const Vec<T> gi_ = load_item(dy + off, b, H, vm);
    const A m = Stat::kMean ? mean[row] : A(0);
    const A r = rstd[row];
    const BwdCoef<A> cf{coefs[row * 3 + 0], coefs[row * 3 + 1], coefs[row * 3 + 2]};
    Vec<T> o;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int i = b + e;
      A v = A(0);
      if (i < H) {
        const A dv = to_acc<A>(gi_.v[e]);
        const A xh = Stat::xhat(Stat::u_of(to_acc<A>(xi.v[e]), m, r), cf);
        v = Stat::dx(r, dv * wv[e], xh, cf);
        aw[e] += dv * xh;
        if (Affine::kBias) ab[e] += dv;
      }
      o.v[e] = Conv<T>::from(v);
    }
    store_item(dx + off, o, b, H, vm);
  }
  const long long poff = static_cast<long long>(blockIdx.x) * H;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const int i = b + e;
    if (i < H) {
      if (part_w != nullptr) part_w[poff + i] = aw[e];
      if (Affine::kBias && part_b != nullptr) part_b[poff + i] = ab[e];
    }
  }
}

}  // namespace pynorm
