// RMSNorm kernels of pynorm's CuPy backend.  They mirror
// pynorm/reference/rms_norm.py function by function (math in that module's
// docstring); row layout, items and reductions: see common.cuh.
//
// Kernels (templates over T = x/y/dx dtype and W = weight dtype):
//   rms_norm_fwd          forward: y and per-row rstd
//   rms_norm_bwd          fused backward (rows in registers): dx, per-block dweight partials
//   rms_norm_bwd_stats    split backward, step 1 (any H): per-row c = sum(g * xhat) / H
//   rms_norm_bwd_apply    split backward, step 2: dx and per-chunk dweight partials
#include "common.cuh"

namespace pynorm {

// forward: on x scaled by s = 2^k (exact), ms_s = sum(xs^2) / H, then
// rstd = 1/sqrt(ms + eps) and rs = rstd / s (finalize_rstd), y = xs * rs * (w + offset).
template <typename T, typename W>
__global__ void __launch_bounds__(PYNORM_FWD_THREADS, PYNORM_FWD_MIN_BLOCKS)
rms_norm_fwd(const T* __restrict__ x, const W* __restrict__ weight, T* __restrict__ y,
             acc_t<T, W>* __restrict__ rstd_out, long long R, int H, double eps, double weight_offset,
             int log2g, int vec, int over_smem) {
  using A = acc_t<T, W>;
  constexpr int V = Vec<T>::N;
  constexpr int K = FwdItems<T, A>::value;
  __shared__ A red[32];
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

    const int ks = needs_scaling<T>::value ? scale_exponent(group_max(amax, G, red)) : 0;
    const A s = static_cast<A>(ldexp(1.0, ks));

    // masked elements were loaded as 0 and add nothing to the sum of squares
    A acc[1];
    acc[0] = A(0);
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const A xs = to_acc<A>(xc[k].v[e]) * s;
        acc[0] += xs * xs;
      }
    }
    for (int k = K; k < nk; ++k) {
      const Vec<T> it = over_item(k);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const A xs = to_acc<A>(it.v[e]) * s;
        acc[0] += xs * xs;
      }
    }
    group_sum(acc, G, red);
    const double ms_s = static_cast<double>(acc[0]) / static_cast<double>(H);

    double r, rs;
    finalize_rstd(ms_s, ks, eps, false, r, rs);
    const A rsa = scaled_factor<A>(r, rs);
    if (valid && t == 0) rstd_out[row] = static_cast<A>(r);

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
            v = (to_acc<A>(it.v[e]) * s) * rsa;
            if (weight != nullptr) v = v * eff_weight<A>(weight, i, wo);
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

// backward: xhat = x * r, g = dy * (w + offset), c = sum(g * xhat) / H,
// dx = r * (g - xhat * c), dweight += dy * xhat.
template <typename T, typename W>
__device__ __forceinline__ void
rms_norm_bwd_rows(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
                  const acc_t<T, W>* __restrict__ rstd, T* __restrict__ dx, acc_t<T, W>* __restrict__ part_w,
                  long long R, int H, double weight_offset, int log2g, int vec) {
  using A = acc_t<T, W>;
  constexpr int V = Vec<T>::N;
  constexpr int K = BwdItems<T, A>::value;  // the host guarantees nk <= K
  __shared__ A red[32];

  const int G = 1 << log2g;
  const int t = threadIdx.x & (G - 1);
  const int gi = threadIdx.x >> log2g;
  const int gpb = blockDim.x >> log2g;
  const int nk = (H + G * V - 1) / (G * V);
  const bool vm = vec != 0;
  const A wo = static_cast<A>(weight_offset);

  A aw[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int e = 0; e < V; ++e) aw[k][e] = A(0);
  }

  for (long long r0 = static_cast<long long>(blockIdx.x) * gpb; r0 < R;
       r0 += static_cast<long long>(gridDim.x) * gpb) {
    const long long row = r0 + gi;
    const bool valid = row < R;
    const long long off = (valid ? row : 0LL) * H;
    const A r = valid ? rstd[row] : A(0);

    // pass 1: c (x and dy are read again in pass 2, from L1/L2)
    A S[1] = {A(0)};
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (valid && k < nk) {
        const int b = item_base<T>(t, k, G);
        const Vec<T> xi = load_item(x + off, b, H, vm);
        const Vec<T> di = load_item(dy + off, b, H, vm);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const int i = b + e;
          if (i < H) S[0] += to_acc<A>(di.v[e]) * eff_weight<A>(weight, i, wo) * (to_acc<A>(xi.v[e]) * r);
        }
      }
    }
    group_sum(S, G, red);
    const A c = S[0] / A(H);

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
              const A xhat = to_acc<A>(xi.v[e]) * r;
              v = r * (dv * eff_weight<A>(weight, i, wo) - xhat * c);
              aw[k][e] += dv * xhat;
            }
            o.v[e] = Conv<T>::from(v);
          }
          store_item(dx + off, o, b, H, vm);
        }
      }
    }
  }

  if (part_w == nullptr) return;  // uniform across the block
  A* pw = part_w + static_cast<long long>(blockIdx.x) * H;
  for (int q = 0; q < gpb; ++q) {
    if (gi == q) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (k < nk) {
          const int b = item_base<T>(t, k, G);
#pragma unroll
          for (int e = 0; e < V; ++e) {
            const int i = b + e;
            if (i < H) pw[i] = (q == 0 ? A(0) : pw[i]) + aw[k][e];
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
rms_norm_bwd(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
             const acc_t<T, W>* __restrict__ rstd, T* __restrict__ dx, acc_t<T, W>* __restrict__ part_w,
             long long R, int H, double weight_offset, int log2g, int vec) {
  if constexpr (BwdItems<T, acc_t<T, W>>::fits) {
    rms_norm_bwd_rows<T, W>(dy, x, weight, rstd, dx, part_w, R, H, weight_offset, log2g, vec);
  }
}

// split backward, step 1: per-row c = sum(g * xhat) / H, streaming the row (any H)
template <typename T, typename W>
__global__ void __launch_bounds__(PYNORM_STATS_THREADS)
rms_norm_bwd_stats(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
                   const acc_t<T, W>* __restrict__ rstd, acc_t<T, W>* __restrict__ coefs, long long R, int H,
                   double weight_offset, int log2g, int vec) {
  using A = acc_t<T, W>;
  constexpr int V = Vec<T>::N;
  __shared__ A red[32];

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
    const A r = valid ? rstd[row] : A(0);
    A S[1] = {A(0)};
    if (valid) {
#pragma unroll 2
      for (int k = 0; k < nk; ++k) {
        const int b = item_base<T>(t, k, G);
        const Vec<T> xi = load_item(x + off, b, H, vm);
        const Vec<T> gi_ = load_item(dy + off, b, H, vm);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const int i = b + e;
          if (i < H) S[0] += to_acc<A>(gi_.v[e]) * eff_weight<A>(weight, i, wo) * (to_acc<A>(xi.v[e]) * r);
        }
      }
    }
    group_sum(S, G, red);
    if (valid && t == 0) coefs[row] = S[0] / A(H);
  }
}

// split backward, step 2 (see layer_norm_bwd_apply)
template <typename T, typename W>
__global__ void __launch_bounds__(PYNORM_APPLY_THREADS)
rms_norm_bwd_apply(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
                   const acc_t<T, W>* __restrict__ rstd, const acc_t<T, W>* __restrict__ coefs,
                   T* __restrict__ dx, acc_t<T, W>* __restrict__ part_w, long long R, int H,
                   long long rows_per_chunk, double weight_offset, int vec) {
  using A = acc_t<T, W>;
  constexpr int V = Vec<T>::N;
  const int G = blockDim.x;
  const int t = threadIdx.x;
  const bool vm = vec != 0;
  const int b = item_base<T>(t, blockIdx.y, G);
  const A wo = static_cast<A>(weight_offset);

  A wv[V], aw[V];
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const int i = b + e;
    wv[e] = i < H ? eff_weight<A>(weight, i, wo) : A(0);
    aw[e] = A(0);
  }
  const long long r_begin = static_cast<long long>(blockIdx.x) * rows_per_chunk;
  const long long r_end = r_begin + rows_per_chunk < R ? r_begin + rows_per_chunk : R;
  for (long long row = r_begin; row < r_end; ++row) {
    const long long off = row * H;
    const Vec<T> xi = load_item(x + off, b, H, vm);
    const Vec<T> gi_ = load_item(dy + off, b, H, vm);
    const A r = rstd[row], c = coefs[row];
    Vec<T> o;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int i = b + e;
      A v = A(0);
      if (i < H) {
        const A dv = to_acc<A>(gi_.v[e]);
        const A xhat = to_acc<A>(xi.v[e]) * r;
        v = r * (dv * wv[e] - xhat * c);
        aw[e] += dv * xhat;
      }
      o.v[e] = Conv<T>::from(v);
    }
    store_item(dx + off, o, b, H, vm);
  }
  if (part_w == nullptr) return;
  const long long poff = static_cast<long long>(blockIdx.x) * H;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const int i = b + e;
    if (i < H) part_w[poff + i] = aw[e];
  }
}

}  // namespace pynorm
