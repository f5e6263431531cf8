// The column-statistics kernel family of pynorm's CuPy backend (BatchNorm): statistics per channel over
// the N x S values of an (N, C, S) array, then element-wise passes. The math is defined in
// pynorm/reference/batch_norm.py; the host code is pynorm/backends/cupy/column.py.
//
// Kernels (templates over T = the x / y / dy / dx type and A = the element-wise math type, float or
// double; the reductions are in double for every T):
//
//   col_stats       block (j, c): values j*chunk <= e < (j+1)*chunk of channel c (e = n*S + s, the
//                   channel's values in memory order), a corrected two-pass mean and M2 in double:
//                   m = sum(x) / n_b, then s1 = sum(x - m), s2 = sum((x - m)^2) -> part[c, j] =
//                   (m, s1 / n_b, s2 - s1^2 / n_b). Never E[x^2] - E[x]^2.
//   col_merge       thread c: the channel's partials merged in chunk order by Chan's parallel formula,
//                   the mean kept as a (high, low) pair with an exact two-sum (so a channel with a
//                   large common offset keeps the accuracy of its deviations and of its variance):
//                   mean_hi, mean_lo, the biased variance.
//   col_apply       y = ((x - k_c) - cc_c) * sw_c [+ b_c]
//   col_bwd_sums    block (j, c) as col_stats: (sum dy, sum dy xc, sum xc) in double, xc = x - k_c
//   col_sum_chunks  thread c: the channel's partials added in chunk order
//   col_dx          dx = a_c ((dy - m1_c) - ((x - k_c) - cc_c) q_c)      (training)
//   col_scale       dx = dy a_c                                           (evaluation)
//
// Deterministic: a block's partial comes from a fixed-shape tree in shared memory (blockDim fixed at
// PYNORM_COLUMN_THREADS), the chunks are fixed by the shape (PYNORM_COLUMN_CHUNK values, common.cuh), and
// the partials are merged in chunk order by one thread per channel: no atomics, bitwise reproducible.
// Every element index and count is 64-bit (long long): a channel may have N*S >= 2^31 values and the
// array more than 2^32 elements. The element-wise kernels are grid-stride loops over the flat index.
#include "common.cuh"

namespace pynorm {

// the fixed-order tree sum of the block's v[0..Q) (every thread gets the totals)
template <int Q> __device__ __forceinline__ void block_sum(double (&v)[Q], double (*red)[PYNORM_COLUMN_THREADS]) {
  const int t = threadIdx.x;
#pragma unroll
  for (int q = 0; q < Q; ++q) red[q][t] = v[q];
  __syncthreads();
  for (int w = PYNORM_COLUMN_THREADS / 2; w > 0; w >>= 1) {
    if (t < w) {
#pragma unroll
      for (int q = 0; q < Q; ++q) red[q][t] = red[q][t] + red[q][t + w];
    }
    __syncthreads();
  }
#pragma unroll
  for (int q = 0; q < Q; ++q) v[q] = red[q][0];
  __syncthreads();
}

// The values of channel c visited by one thread, from value e (e = n*S + s) in steps of blockDim: the
// element offset (n*C + c)*S + s, with (n, s) stepped incrementally (one 64-bit division per thread).
struct ColumnWalk {
  long long n, s;    // the current value's sample and position
  long long qn, qs;  // a step of PYNORM_COLUMN_THREADS values as (samples, positions)
  long long S, CS, base;

  __device__ ColumnWalk(long long e, int c, long long C, long long S_) : S(S_), CS(C * S_) {
    n = e / S;
    s = e - n * S;
    qn = PYNORM_COLUMN_THREADS / S;
    qs = PYNORM_COLUMN_THREADS - qn * S;
    base = static_cast<long long>(c) * S;
  }
  __device__ __forceinline__ long long offset() const { return n * CS + base + s; }
  __device__ __forceinline__ void next() {
    n += qn;
    s += qs;
    if (s >= S) {
      s -= S;
      ++n;
    }
  }
};

template <typename T, typename A>
__global__ void __launch_bounds__(PYNORM_COLUMN_THREADS)
col_stats(const T* __restrict__ x, long long C, long long S, long long values, int nchunks, double* __restrict__ part) {
  __shared__ double red[1][PYNORM_COLUMN_THREADS];
  __shared__ double red2[2][PYNORM_COLUMN_THREADS];
  const int c = blockIdx.y;
  const long long e0 = static_cast<long long>(blockIdx.x) * PYNORM_COLUMN_CHUNK;
  const long long e1 = e0 + PYNORM_COLUMN_CHUNK < values ? e0 + PYNORM_COLUMN_CHUNK : values;
  const double cnt = static_cast<double>(e1 - e0);
  double v1[1] = {0.0};
  ColumnWalk w1(e0 + threadIdx.x, c, C, S);
  for (long long e = e0 + threadIdx.x; e < e1; e += PYNORM_COLUMN_THREADS, w1.next()) {
    v1[0] += to_acc<double>(x[w1.offset()]);
  }
  block_sum<1>(v1, red);
  const double m = v1[0] / cnt;
  double v2[2] = {0.0, 0.0};
  ColumnWalk w2(e0 + threadIdx.x, c, C, S);
  for (long long e = e0 + threadIdx.x; e < e1; e += PYNORM_COLUMN_THREADS, w2.next()) {
    const double d = to_acc<double>(x[w2.offset()]) - m;
    v2[0] += d;
    v2[1] = __fma_rn(d, d, v2[1]);
  }
  block_sum<2>(v2, red2);
  if (threadIdx.x == 0) {
    double* p = part + (static_cast<long long>(c) * nchunks + blockIdx.x) * 3;
    const double corr = v2[0] / cnt;
    const double m2 = v2[1] - v2[0] * corr;
    p[0] = m;
    p[1] = corr;
    p[2] = m2 < 0.0 ? 0.0 : m2;  // (an overflowed NaN stays NaN, for the host to see it)
  }
}

// Chan's merge of (bh + bl, bm2) over nb values into (mh + ml, m2) over na; the mean's new high part's
// rounding error goes to its low part exactly (two-sum; the _rn intrinsics are never contracted)
__device__ __forceinline__ void chan_merge(double& mh, double& ml, double& m2, double na, double bh, double bl,
                                           double bm2, double nb) {
  const double w = __ddiv_rn(nb, __dadd_rn(na, nb));
  const double delta = __dadd_rn(__dadd_rn(bh, -mh), __dadd_rn(bl, -ml));
  const double step = __dmul_rn(delta, w);
  const double hi = __dadd_rn(mh, step);
  const double bb = __dadd_rn(hi, -mh);
  const double err = __dadd_rn(__dadd_rn(mh, -__dadd_rn(hi, -bb)), __dadd_rn(step, -bb));
  mh = hi;
  ml = __dadd_rn(ml, err);
  m2 = __dadd_rn(__dadd_rn(m2, bm2), __dmul_rn(__dmul_rn(delta, delta), __dmul_rn(na, w)));
}

template <typename T, typename A>
__global__ void __launch_bounds__(PYNORM_COLUMN_THREADS)
col_merge(const double* __restrict__ part, int C, int nchunks, long long values, double* __restrict__ mean_hi,
          double* __restrict__ mean_lo, double* __restrict__ var) {
  const int c = blockIdx.x * PYNORM_COLUMN_THREADS + threadIdx.x;
  if (c >= C) return;
  const double* p = part + static_cast<long long>(c) * nchunks * 3;
  double cnt = static_cast<double>(values < PYNORM_COLUMN_CHUNK ? values : PYNORM_COLUMN_CHUNK);
  double mh = p[0], ml = p[1], m2 = p[2];
  for (int j = 1; j < nchunks; ++j) {
    const long long e0 = static_cast<long long>(j) * PYNORM_COLUMN_CHUNK;
    const long long e1 = e0 + PYNORM_COLUMN_CHUNK < values ? e0 + PYNORM_COLUMN_CHUNK : values;
    const double nb = static_cast<double>(e1 - e0);
    chan_merge(mh, ml, m2, cnt, p[3 * j], p[3 * j + 1], p[3 * j + 2], nb);
    cnt = __dadd_rn(cnt, nb);
  }
  mean_hi[c] = mh;
  mean_lo[c] = ml;
  var[c] = m2 / cnt;
}

// channel of flat element i of (N, C, S): (i / S) % C, in 32-bit arithmetic when the array allows
__device__ __forceinline__ int channel_of(long long i, long long C, long long S, bool narrow) {
  if (narrow) {
    const unsigned int r = static_cast<unsigned int>(i) / static_cast<unsigned int>(S);
    return static_cast<int>(r % static_cast<unsigned int>(C));
  }
  return static_cast<int>((i / S) % C);
}

template <typename T, typename A>
__global__ void __launch_bounds__(PYNORM_COLUMN_THREADS)
col_apply(const T* __restrict__ x, T* __restrict__ y, const A* __restrict__ k, const A* __restrict__ cc,
          const A* __restrict__ sw, const A* __restrict__ b, long long total, long long C, long long S) {
  const bool narrow = total <= 0xffffffffLL;
  const long long stride = static_cast<long long>(gridDim.x) * PYNORM_COLUMN_THREADS;
  for (long long i = static_cast<long long>(blockIdx.x) * PYNORM_COLUMN_THREADS + threadIdx.x; i < total;
       i += stride) {
    const int c = channel_of(i, C, S, narrow);
    const A v = ((to_acc<A>(x[i]) - k[c]) - cc[c]) * sw[c];
    y[i] = Conv<T>::from(b != nullptr ? v + b[c] : v);
  }
}

template <typename T, typename A>
__global__ void __launch_bounds__(PYNORM_COLUMN_THREADS)
col_bwd_sums(const T* __restrict__ x, const T* __restrict__ dy, const double* __restrict__ k, long long C,
             long long S, long long values, int nchunks, double* __restrict__ part) {
  __shared__ double red[3][PYNORM_COLUMN_THREADS];
  const int c = blockIdx.y;
  const long long e0 = static_cast<long long>(blockIdx.x) * PYNORM_COLUMN_CHUNK;
  const long long e1 = e0 + PYNORM_COLUMN_CHUNK < values ? e0 + PYNORM_COLUMN_CHUNK : values;
  const double kc = k[c];
  double v[3] = {0.0, 0.0, 0.0};
  ColumnWalk wk(e0 + threadIdx.x, c, C, S);
  for (long long e = e0 + threadIdx.x; e < e1; e += PYNORM_COLUMN_THREADS, wk.next()) {
    const long long off = wk.offset();
    const double xc = to_acc<double>(x[off]) - kc;
    const double g = to_acc<double>(dy[off]);
    v[0] += g;
    v[1] = __fma_rn(g, xc, v[1]);
    v[2] += xc;
  }
  block_sum<3>(v, red);
  if (threadIdx.x == 0) {
    double* p = part + (static_cast<long long>(c) * nchunks + blockIdx.x) * 3;
    p[0] = v[0];
    p[1] = v[1];
    p[2] = v[2];
  }
}

template <typename T, typename A>
__global__ void __launch_bounds__(PYNORM_COLUMN_THREADS)
col_sum_chunks(const double* __restrict__ part, int C, int nchunks, double* __restrict__ out) {
  const int c = blockIdx.x * PYNORM_COLUMN_THREADS + threadIdx.x;
  if (c >= C) return;
  const double* p = part + static_cast<long long>(c) * nchunks * 3;
  double s0 = 0.0, s1 = 0.0, s2 = 0.0;
  for (int j = 0; j < nchunks; ++j) {
    s0 += p[3 * j];
    s1 += p[3 * j + 1];
    s2 += p[3 * j + 2];
  }
  out[3 * c] = s0;
  out[3 * c + 1] = s1;
  out[3 * c + 2] = s2;
}

template <typename T, typename A>
__global__ void __launch_bounds__(PYNORM_COLUMN_THREADS)
col_dx(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx, const A* __restrict__ k,
       const A* __restrict__ cc, const A* __restrict__ a, const A* __restrict__ m1, const A* __restrict__ q,
       long long total, long long C, long long S) {
  const bool narrow = total <= 0xffffffffLL;
  const long long stride = static_cast<long long>(gridDim.x) * PYNORM_COLUMN_THREADS;
  for (long long i = static_cast<long long>(blockIdx.x) * PYNORM_COLUMN_THREADS + threadIdx.x; i < total;
       i += stride) {
    const int c = channel_of(i, C, S, narrow);
    const A xc = (to_acc<A>(x[i]) - k[c]) - cc[c];
    dx[i] = Conv<T>::from(a[c] * ((to_acc<A>(dy[i]) - m1[c]) - xc * q[c]));
  }
}

template <typename T, typename A>
__global__ void __launch_bounds__(PYNORM_COLUMN_THREADS)
col_scale(const T* __restrict__ dy, T* __restrict__ dx, const A* __restrict__ a, long long total, long long C,
          long long S) {
  const bool narrow = total <= 0xffffffffLL;
  const long long stride = static_cast<long long>(gridDim.x) * PYNORM_COLUMN_THREADS;
  for (long long i = static_cast<long long>(blockIdx.x) * PYNORM_COLUMN_THREADS + threadIdx.x; i < total;
       i += stride) {
    dx[i] = Conv<T>::from(to_acc<A>(dy[i]) * a[channel_of(i, C, S, narrow)]);
  }
}

}  // namespace pynorm
