// LayerNorm kernels of pynorm's CuPy backend.  They mirror
// pynorm/reference/layer_norm.py function by function; the math (and the
// conventions correction / eps_mode / weight_offset) is defined in that module's
// docstring.  Row layout, items and reductions: see common.cuh.
//
// Kernels (templates over T = x/y/dx dtype and W = weight/bias dtype):
//   layer_norm_fwd            forward: y, per-row mean and rstd
//   layer_norm_bwd            fused backward, rows held in registers: dx and
//                             per-block partial sums of dweight / dbias
//   layer_norm_bwd_stats      split backward, step 1 (any H): per-row coefficients
//   layer_norm_bwd_apply      split backward, step 2: dx and per-chunk partials
// The partial sums are reduced in a fixed order by reduce.cu: no atomics, so
// every result is bitwise reproducible.
#include "common.cuh"

namespace pynorm {

// ---------------------------------------------------------------------------
// forward
//
// Statistics of each row, on x scaled by s = 2^k (exact, see common.cuh):
//   m1 = sum(xs) / H                        first pass
//   S1 = sum(xs - m1), S2 = sum((xs - m1)^2)  second pass (both sums in one reduction)
//   c  = S1 / H                             corrected two-pass mean: mean = m1 + c
//   M2 = S2 - c * S1 = sum((xs - m1 - c)^2) centred sum of squares (the corrected two-pass
//                                           algorithm of Chan, Golub & LeVeque), never E[x^2] - E[x]^2
//   var_s = max(M2, 0) / (H - correction)
// (m1, c) is kept as an unevaluated pair, so rows with a large common offset
// (1e4 + N(0, 1) in float32) keep the accuracy of their deviations.
// Then rstd and rs = rstd / s (finalize_rstd) and
//   y = ((xs - m1) - c) * rs * (w + offset) + b,   rounded once to T.
// The row is read from global memory once: the first FwdItems<T, A> items of
// each thread stay in registers, any further items in dynamic shared memory
// when `over_smem` is set (else they are re-read from global memory / L2).

template <typename T, typename W>
__global__ void __launch_bounds__(PYNORM_FWD_THREADS, PYNORM_FWD_MIN_BLOCKS)
layer_norm_fwd(const T* __restrict__ x, const W* __restrict__ weight, const W* __restrict__ bias,
               T* __restrict__ y, acc_t<T, W>* __restrict__ mean_out, acc_t<T, W>* __restrict__ rstd_out,
               long long R, int H, double eps, int correction, int std_mode, double weight_offset,
               int log2g, int vec, int over_smem) {
  using A = acc_t<T, W>;
  constexpr int V = Vec<T>::N;
  constexpr int K = FwdItems<T, A>::value;
  __shared__ A red[2 * 32];
  extern __shared__ __align__(16) unsigned char dyn_smem[];

  const int G = 1 << log2g;
  const int t = threadIdx.x & (G - 1);
  const int gi = threadIdx.x >> log2g;
  const int gpb = blockDim.x >> log2g;
  const int nk = (H + G * V - 1) / (G * V);
  const int nover = nk > K ? nk - K : 0;
  const bool vm = vec != 0;
  const A wo = static_cast<A>(weight_offset);
  Vec<T>* over = reinterpret_cast<Vec<T>*>(dyn_smem) + static_cast<size_t>(gi) * nover * G;

  for (long long r0 = static_cast<long long>(blockIdx.x) * gpb; r0 < R;
       r0 += static_cast<long long>(gridDim.x) * gpb) {
    const long long row = r0 + gi;
    const bool valid = row < R;
    const T* xr = x + (valid ? row : 0LL) * H;

    // pass A: load the row once; largest magnitude for the scaling
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
    // fn(value, column) for every element of the row this thread owns
    auto each = [&](auto&& fn) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (k < nk) {
          const int b = item_base<T>(t, k, G);
#pragma unroll
          for (int e = 0; e < V; ++e) {
            const int i = b + e;
            if (i < H) fn(to_acc<A>(xc[k].v[e]), i);
          }
        }
      }
      for (int k = K; k < nk; ++k) {
        const Vec<T> it = over_item(k);
        const int b = item_base<T>(t, k, G);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const int i = b + e;
          if (i < H) fn(to_acc<A>(it.v[e]), i);
        }
      }
    };

    const int ks = needs_scaling<T>::value ? scale_exponent(group_max(amax, G, red)) : 0;
    const A s = static_cast<A>(ldexp(1.0, ks));

    A sum[1] = {A(0)};
    each([&](A xv, int) { sum[0] += xv * s; });
    group_sum(sum, G, red);
    const A m1 = sum[0] / A(H);

    // one pass for both sums about m1 (corrected two-pass: Chan, Golub & LeVeque)
    A acc[2] = {A(0), A(0)};
    each([&](A xv, int) {
      const A d = xv * s - m1;
      acc[0] += d;
      acc[1] += d * d;
    });
    group_sum(acc, G, red);
    const A c = acc[0] / A(H);
    const A m2 = acc[1] - c * acc[0];  // sum((xs - m1 - c)^2) = S2 - S1^2 / H
    const double var_s = static_cast<double>(m2 > A(0) ? m2 : A(0)) / static_cast<double>(H - correction);

    double r, rs;
    finalize_rstd(var_s, ks, eps, std_mode != 0, r, rs);
    const A rsa = scaled_factor<A>(r, rs);
    if (valid && t == 0) {
      mean_out[row] = static_cast<A>((static_cast<double>(m1) + static_cast<double>(c)) * ldexp(1.0, -ks));
      rstd_out[row] = static_cast<A>(r);
    }

    // last pass: y = ((xs - m1) - c) * rs * (w + offset) + b
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
            v = ((to_acc<A>(it.v[e]) * s - m1) - c) * rsa;
            if (weight != nullptr) v = v * eff_weight<A>(weight, i, wo);
            if (bias != nullptr) v = v + bias_at<A>(bias, i);
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
//
// With m, r the saved mean and rstd, g = dy * (w + offset) and the row centred
// as u = (x - m) * r (`centred` guards the subtraction against overflow):
//   cu   = sum(u) / H             the rounding error of the saved mean, in units of 1/r
//   xhat = u - cu                 (so xhat keeps full accuracy on large-offset rows)
//   gbar = sum(g) / H
//   gx   = sum(g * xhat) = sum(g*u) - cu * sum(g)
//   "var": coef = gx / n
//   "std": coef = gx / (n * s * r) with s * r = sqrt(sum(xhat^2) / n)
//          = sqrt((sum(u^2) - cu * sum(u)) / n)  (recomputed from x, overflow-free);
//          coef = 0 where s == 0
//   dx   = r * (g - gbar - xhat * coef)
//   dweight += dy * xhat, dbias += dy  (per-thread, then per-block partial rows)

template <typename A> struct LnBwdCoef {
  A cu, gbar, coef;
};

template <typename A>
__device__ __forceinline__ LnBwdCoef<A> ln_bwd_coef(const A (&S)[4], int H, int correction, bool std_mode) {
  LnBwdCoef<A> o;
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

template <typename T, typename W>
__device__ __forceinline__ void
layer_norm_bwd_rows(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
                    const acc_t<T, W>* __restrict__ mean, const acc_t<T, W>* __restrict__ rstd, T* __restrict__ dx,
                    acc_t<T, W>* __restrict__ part_w, acc_t<T, W>* __restrict__ part_b,
                    long long R, int H, int correction, int std_mode, double weight_offset, int log2g, int vec) {
  using A = acc_t<T, W>;
  constexpr int V = Vec<T>::N;
  constexpr int K = BwdItems<T, A>::value;  // the host guarantees nk <= K
  __shared__ A red[4 * 32];

  const int G = 1 << log2g;
  const int t = threadIdx.x & (G - 1);
  const int gi = threadIdx.x >> log2g;
  const int gpb = blockDim.x >> log2g;
  const int nk = (H + G * V - 1) / (G * V);
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
    const A m = valid ? mean[row] : A(0);
    const A r = valid ? rstd[row] : A(0);

    // pass 1: the row sums (x and dy are read again in pass 2, from L1/L2)
    A S[4] = {A(0), A(0), A(0), A(0)};  // sum g, sum g*u, sum u, sum u*u
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (valid && k < nk) {
        const int b = item_base<T>(t, k, G);
        const Vec<T> xi = load_item(x + off, b, H, vm);
        const Vec<T> di = load_item(dy + off, b, H, vm);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const int i = b + e;
          if (i < H) {
            const A u = centred(to_acc<A>(xi.v[e]), m, r);
            const A g = to_acc<A>(di.v[e]) * eff_weight<A>(weight, i, wo);
            S[0] += g;
            S[1] += g * u;
            S[2] += u;
            S[3] += u * u;
          }
        }
      }
    }
    group_sum(S, G, red);
    const LnBwdCoef<A> cf = ln_bwd_coef(S, H, correction, std_mode != 0);

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
              const A xhat = centred(to_acc<A>(xi.v[e]), m, r) - cf.cu;
              const A g = dv * eff_weight<A>(weight, i, wo);
              v = r * (g - cf.gbar - xhat * cf.coef);
              aw[k][e] += dv * xhat;
              ab[k][e] += dv;
            }
            o.v[e] = Conv<T>::from(v);
          }
          store_item(dx + off, o, b, H, vm);
        }
      }
    }
  }

  // per-block partial sums: the groups of this block add their columns in a
  // fixed order (group 0 stores, group 1 adds, ...), one barrier per group
  A* pw = part_w != nullptr ? part_w + static_cast<long long>(blockIdx.x) * H : nullptr;
  A* pb = part_b != nullptr ? part_b + static_cast<long long>(blockIdx.x) * H : nullptr;
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
              if (pb != nullptr) pb[i] = (q == 0 ? A(0) : pb[i]) + ab[k][e];
            }
          }
        }
      }
    }
    __syncthreads();
  }
}

// fused backward kernel; empty for type pairs without a fused path
// (BwdItems<T, A>::fits is false: the host takes the split path)
template <typename T, typename W>
__global__ void __launch_bounds__(PYNORM_BWD_THREADS, PYNORM_BWD_MIN_BLOCKS)
layer_norm_bwd(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
               const acc_t<T, W>* __restrict__ mean, const acc_t<T, W>* __restrict__ rstd, T* __restrict__ dx,
               acc_t<T, W>* __restrict__ part_w, acc_t<T, W>* __restrict__ part_b,
               long long R, int H, int correction, int std_mode, double weight_offset, int log2g, int vec) {
  if constexpr (BwdItems<T, acc_t<T, W>>::fits) {
    layer_norm_bwd_rows<T, W>(dy, x, weight, mean, rstd, dx, part_w, part_b, R, H, correction, std_mode,
                              weight_offset, log2g, vec);
  }
}

// split backward, step 1: per-row (cu, gbar, coef) for any H, streaming the row
template <typename T, typename W>
__global__ void __launch_bounds__(PYNORM_STATS_THREADS)
layer_norm_bwd_stats(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
                     const acc_t<T, W>* __restrict__ mean, const acc_t<T, W>* __restrict__ rstd,
                     acc_t<T, W>* __restrict__ coefs, long long R, int H, int correction, int std_mode,
                     double weight_offset, int log2g, int vec) {
  using A = acc_t<T, W>;
  constexpr int V = Vec<T>::N;
  __shared__ A red[4 * 32];

  const int G = 1 << log2g;
  const int t = threadIdx.x & (G - 1);
  const int gi = threadIdx.x >> log2g;
  const int gpb = blockDim.x >> log2g;
  const int nk = (H + G * V - 1) / (G * V);
  const bool vm = vec != 0;
  const A wo = static_cast<A>(weight_offset);

  for (long long r0 = static_cast<long long>(blockIdx.x) * gpb; r0 < R;
       r0 += static_cast<long long>(gridDim.x) * gpb) {
    const long long row = r0 + gi;
    const bool valid = row < R;
    const long long off = (valid ? row : 0LL) * H;
    const A m = valid ? mean[row] : A(0);
    const A r = valid ? rstd[row] : A(0);
    A S[4] = {A(0), A(0), A(0), A(0)};
    if (valid) {
#pragma unroll 2
      for (int k = 0; k < nk; ++k) {
        const int b = item_base<T>(t, k, G);
        const Vec<T> xi = load_item(x + off, b, H, vm);
        const Vec<T> gi_ = load_item(dy + off, b, H, vm);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const int i = b + e;
          if (i < H) {
            const A u = centred(to_acc<A>(xi.v[e]), m, r);
            const A g = to_acc<A>(gi_.v[e]) * eff_weight<A>(weight, i, wo);
            S[0] += g;
            S[1] += g * u;
            S[2] += u;
            S[3] += u * u;
          }
        }
      }
    }
    group_sum(S, G, red);
    const LnBwdCoef<A> cf = ln_bwd_coef(S, H, correction, std_mode != 0);
    if (valid && t == 0) {
      coefs[row * 3 + 0] = cf.cu;
      coefs[row * 3 + 1] = cf.gbar;
      coefs[row * 3 + 2] = cf.coef;
    }
  }
}

// split backward, step 2: block (blockIdx.x, blockIdx.y) handles the rows of
// chunk blockIdx.x and item blockIdx.y of each thread (a tile of columns):
// dx, and the chunk's partial dweight / dbias for those columns.
template <typename T, typename W>
__global__ void __launch_bounds__(PYNORM_APPLY_THREADS)
layer_norm_bwd_apply(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
                     const acc_t<T, W>* __restrict__ mean, const acc_t<T, W>* __restrict__ rstd,
                     const acc_t<T, W>* __restrict__ coefs, T* __restrict__ dx,
                     acc_t<T, W>* __restrict__ part_w, acc_t<T, W>* __restrict__ part_b,
                     long long R, int H, long long rows_per_chunk, double weight_offset, int vec) {
  using A = acc_t<T, W>;
  constexpr int V = Vec<T>::N;
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
    const A m = mean[row], r = rstd[row];
    const A cu = coefs[row * 3 + 0], gbar = coefs[row * 3 + 1], coef = coefs[row * 3 + 2];
    Vec<T> o;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int i = b + e;
      A v = A(0);
      if (i < H) {
        const A dv = to_acc<A>(gi_.v[e]);
        const A xhat = centred(to_acc<A>(xi.v[e]), m, r) - cu;
        v = r * (dv * wv[e] - gbar - xhat * coef);
        aw[e] += dv * xhat;
        ab[e] += dv;
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
      if (part_b != nullptr) part_b[poff + i] = ab[e];
    }
  }
}

}  // namespace pynorm
