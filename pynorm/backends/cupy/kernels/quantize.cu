// The quantize kernel family of pynorm's CuPy backend: the quantization-friendly LayerNorm
// (quant_layer_norm; math in pynorm/reference/quant_norm.py). One row skeleton with two sources
// and one epilogue:
//
//   quant_int8<W>   int8 x with a per-row scale (parameters W = float or double, cast on the host): the row's exact integer sums S1 = sum x,
//                   S2 = sum x^2 (long long), then the reference's fixed float64 sequence, every
//                   operation written as its correctly rounded intrinsic (__dmul_rn, __dadd_rn,
//                   __ddiv_rn, __dsqrt_rn) so that no multiply-add is contracted: the outputs are
//                   bitwise those of the reference and of the numba backend. Also stores the
//                   row's mean and rstd (float64) for the backward.
//   quant_float<T>  an already normalized float y (the stats family's LayerNorm output).
//
// Epilogue (`mode`, uniform): kQuantFloat stores y rounded once to float32 (int8 source only);
// kQuantAmax stores the row's max |y| (NaN ignored; the first pass of a per-tensor scale);
// kQuantRow quantizes with the row's own scale s = float32(amax / 127) (1 where not positive
// finite), stored per row; kQuantGiven quantizes with the given scale and stores `keep` (false
// where the clip changed the value) when it is not null. q = clip(rint(y / s), -127, 127), 0 for
// NaN; rint rounds half to even.
//
// Backward pieces: quant_dequant<T> (the real input x * x_scale of an int8 x, for the stats family's
// LayerNorm backward) and quant_mask<T> (the straight-through gradient, 0 where a given scale clipped).
//
// One block per row (grid-stride over rows), block sizes a power of two <= PYNORM_QUANT_THREADS;
// the reductions are common.cuh's fixed-order group reductions: results do not depend on the
// launch configuration. The parameter lists are mirrored by pynorm/backends/cupy/_args.py.
#include "common.cuh"

namespace pynorm {

enum QuantMode : int { kQuantFloat = 0, kQuantAmax = 1, kQuantRow = 2, kQuantGiven = 3 };

// y_j of an int8 row: double(H x_j - S1) * k, then * (w_j + offset), + b_j (each when present)
template <typename W> struct Int8Row {
  const signed char* x;
  const W* w;
  const W* b;
  long long s1;
  double k, offset;
  int H;
  __device__ __forceinline__ double operator()(int j) const {
    const long long u = static_cast<long long>(x[j]) * static_cast<long long>(H) - s1;  // exact
    double v = __dmul_rn(__ll2double_rn(u), k);
    if (w != nullptr) v = __dmul_rn(v, __dadd_rn(static_cast<double>(Conv<W>::to_float(w[j])), offset));
    if (b != nullptr) v = __dadd_rn(v, static_cast<double>(Conv<W>::to_float(b[j])));
    return v;
  }
};

// y_j of a float row, exactly
template <typename T> struct FloatRow {
  const T* y;
  __device__ __forceinline__ double operator()(int j) const { return static_cast<double>(Conv<T>::to_float(y[j])); }
};

template <class Row>
__device__ __forceinline__ void quant_epilogue(const Row& row, long long i, int H, int mode, double scale,
                                               signed char* __restrict__ q, float* __restrict__ y,
                                               float* __restrict__ scale_out, double* __restrict__ amax_out,
                                               bool* __restrict__ keep, double* red) {
  const long long off = i * static_cast<long long>(H);
  const int G = static_cast<int>(blockDim.x);
  if (mode == kQuantFloat) {
    for (int j = threadIdx.x; j < H; j += G) y[off + j] = __double2float_rn(row(j));
    return;
  }
  double sd = scale;
  if (mode != kQuantGiven) {
    double a = 0.0;
    for (int j = threadIdx.x; j < H; j += G) {
      const double v = fabs(row(j));
      if (v > a) a = v;  // NaN never compares greater
    }
    a = group_max(a, G, red);
    if (mode == kQuantAmax) {
      if (threadIdx.x == 0) amax_out[i] = a;
      return;
    }
    float s = __double2float_rn(__ddiv_rn(a, 127.0));
    if (!(s > 0.0f) || isinf(s)) s = 1.0f;
    if (threadIdx.x == 0) scale_out[i] = s;
    sd = static_cast<double>(s);
  }
  for (int j = threadIdx.x; j < H; j += G) {
    const double t = rint(__ddiv_rn(row(j), sd));
    signed char c = 0;
    bool kept = true;
    if (isnan(t)) {
      c = 0;
    } else if (t > 127.0) {
      c = 127;
      kept = false;
    } else if (t < -127.0) {
      c = -127;
      kept = false;
    } else {
      c = static_cast<signed char>(static_cast<int>(t));
    }
    q[off + j] = c;
    if (keep != nullptr) keep[off + j] = kept;
  }
}

template <typename W>
__global__ void __launch_bounds__(PYNORM_QUANT_THREADS)
    quant_int8(const signed char* __restrict__ x, const double* __restrict__ x_scale, const W* __restrict__ weight,
               const W* __restrict__ bias, signed char* __restrict__ q, float* __restrict__ y,
               float* __restrict__ scale_out, double* __restrict__ amax_out, bool* __restrict__ keep,
               double* __restrict__ mean_out, double* __restrict__ rstd_out, long long rows, int hidden, double eps,
               int correction, int eps_mode, double offset, int mode, double scale) {
  __shared__ long long red[2 * 32];
  __shared__ double redd[32];
  const int G = static_cast<int>(blockDim.x);
  const double hd = static_cast<double>(hidden);
  const double nn = __dmul_rn(hd, static_cast<double>(hidden - correction));
  for (long long i = blockIdx.x; i < rows; i += gridDim.x) {
    const signed char* xr = x + i * static_cast<long long>(hidden);
    long long v[2] = {0, 0};
    for (int j = threadIdx.x; j < hidden; j += G) {
      const long long a = xr[j];
      v[0] += a;
      v[1] += a * a;
    }
    group_sum(v, G, red);
    const long long s1 = v[0];
    const long long d = static_cast<long long>(hidden) * v[1] - s1 * s1;  // exact: hidden < 2^24
    const double xs = x_scale[i];
    const double u = __ddiv_rn(__ll2double_rn(d), nn);  // the integer row's variance
    const double var = d == 0 ? 0.0 : __dmul_rn(u, __dmul_rn(xs, xs));
    double r = eps_mode == kEpsStd ? __ddiv_rn(1.0, __dadd_rn(__dsqrt_rn(var), eps))
                                   : __ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(var, eps)));
    double k = __ddiv_rn(__dmul_rn(xs, r), hd);
    if (isinf(var)) {  // xs * xs overflowed: the scale from the integer row's own spread
      r = __ddiv_rn(1.0, __dmul_rn(xs, __dsqrt_rn(u)));
      k = __ddiv_rn(1.0, __dmul_rn(hd, __dsqrt_rn(u)));
    }
    if (d == 0 && eps > 0.0) k = 0.0;  // a constant row: yhat = 0 exactly, even where xs * r overflows
    if (threadIdx.x == 0) {
      mean_out[i] = __dmul_rn(__ddiv_rn(__ll2double_rn(s1), hd), xs);
      rstd_out[i] = r;
    }
    const Int8Row<W> row{xr, weight, bias, s1, k, offset, hidden};
    quant_epilogue(row, i, hidden, mode, scale, q, y, scale_out, amax_out, keep, redd);
  }
}

template <typename T>
__global__ void __launch_bounds__(PYNORM_QUANT_THREADS)
    quant_float(const T* __restrict__ y_in, signed char* __restrict__ q, float* __restrict__ scale_out,
                double* __restrict__ amax_out, bool* __restrict__ keep, long long rows, int hidden, int mode,
                double scale) {
  __shared__ double red[32];
  for (long long i = blockIdx.x; i < rows; i += gridDim.x) {
    const FloatRow<T> row{y_in + i * static_cast<long long>(hidden)};
    quant_epilogue(row, i, hidden, mode, scale, q, nullptr, scale_out, amax_out, keep, red);
  }
}

// The backward's element-wise pieces: the real input of an int8 x, out = T(x * x_scale) rounded once
// from double (exact product), and the straight-through gradient, out = keep ? dy : 0.
template <typename T>
__global__ void __launch_bounds__(PYNORM_QUANT_THREADS)
    quant_dequant(const signed char* __restrict__ x, const double* __restrict__ x_scale, T* __restrict__ out,
                  long long rows, int hidden) {
  const long long n = rows * static_cast<long long>(hidden);
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
    out[e] = Conv<T>::from(__dmul_rn(static_cast<double>(x[e]), x_scale[e / hidden]));
  }
}

template <typename T>
__global__ void __launch_bounds__(PYNORM_QUANT_THREADS)
    quant_mask(const T* __restrict__ dy, const bool* __restrict__ keep, T* __restrict__ out, long long n) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
    out[e] = keep[e] ? dy[e] : zero_of<T>();
  }
}

// ---------------------------------------------------------------------------
// FP8 / FP4 outputs (pynorm/reference/fp_quant.py): quant_fp_rows<T> quantizes rows of a float y (read as float32:
// exact for 16-bit types, one rounding for double) block by block -- the block's amax (a fixed-order group
// maximum, exact), its scale, then each element scaled by one correctly rounded float32 operation (__fdiv_rn,
// __fmul_rn; an MX power of two by an exact double product) and encoded by fpq_encode's integer rounding to
// nearest even. Bitwise the reference's and the numba backend's codes and scales. quant_fp_amax<T>: each row's
// largest magnitude (the first pass of a per-tensor scale and of NVFP4's global scale).

enum FpqKind : int { kFpqScaled = 0, kFpqMx = 1, kFpqNvfp4 = 2 };

// the code of the float32 bits b: nearest even in the element format (mbits mantissa bits, least normal exponent
// emin), `over` beyond the largest finite code max_code (max_code itself when saturating), `nan` for NaN
__device__ __forceinline__ unsigned int fpq_encode(unsigned int b, int mbits, int emin, int max_code, int sign_shift,
                                                   int over, int nan) {
  const unsigned int a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<unsigned int>(nan);
  const int biased = static_cast<int>(a >> 23);
  long long code = 0;
  if (biased != 0) {  // (float32 subnormals are below half of every format's least subnormal)
    const int e = biased - 127;
    const long long m = static_cast<long long>((a & 0x7FFFFFu) | 0x800000u);
    const int te = e > emin ? e : emin;
    int shift = 23 - mbits + (te - e);
    if (shift > 26) shift = 26;
    const long long r = (m + (1LL << (shift - 1)) - 1 + ((m >> shift) & 1)) >> shift;
    code = (static_cast<long long>(te - emin) << mbits) + r;
    if (code > max_code) code = over;
  }
  return static_cast<unsigned int>(code) | ((b >> 31) << sign_shift);
}

// the E8M0 code of a block's largest magnitude (bits ab): floor(log2 amax) - emax, +1 with the ceil rule when the
// significand exceeds the format's largest (mantissa bits mt), clamped to [-127, 127]; 0 for 0, 0xFF for inf
__device__ __forceinline__ int fpq_mx_code(unsigned int ab, int emax, unsigned int mt, int ceil_rule) {
  if (ab == 0u) return 0;
  if (ab == 0x7F800000u) return 255;
  const int biased = static_cast<int>(ab >> 23);
  unsigned int m = ab & 0x7FFFFFu;
  int fl = biased - 127;
  if (biased == 0) {  // a subnormal maximum: normalize its mantissa
    int k = 0;
    while ((m & 0x800000u) == 0u) {
      m <<= 1;
      ++k;
    }
    fl = -126 - k;
    m &= 0x7FFFFFu;
  }
  int e = fl - emax;
  if (ceil_rule && m > mt) ++e;
  e = e > 127 ? 127 : (e < -127 ? -127 : e);
  return e + 127;
}

// the float32 value of a non-negative E4M3 code below 0x7F (exact)
__device__ __forceinline__ float fpq_e4m3_value(unsigned int c) {
  const unsigned int ef = c >> 3, mf = c & 7u;
  if (ef == 0u) return __fmul_rn(static_cast<float>(mf), 0.001953125f);  // mf * 2^-9
  return __fmul_rn(static_cast<float>(8u + mf), __uint_as_float((ef - 10u + 127u) << 23));
}

template <typename T> __device__ __forceinline__ float fpq_load(const T* y, long long k) {
  return __double2float_rn(static_cast<double>(Conv<T>::to_float(y[k])));
}

template <typename T>
__device__ __forceinline__ float fpq_block_amax(const T* yr, int j0, int j1, int G, float* red) {
  float a = 0.0f;
  for (int j = j0 + static_cast<int>(threadIdx.x); j < j1; j += G) {
    const float v = fabsf(fpq_load(yr, j));
    if (v > a) a = v;  // NaN never compares greater
  }
  return group_max(a, G, red);
}

template <typename T>
__global__ void __launch_bounds__(PYNORM_QUANT_THREADS)
    quant_fp_rows(const T* __restrict__ y, unsigned char* __restrict__ codes, float* __restrict__ sf,
             unsigned char* __restrict__ sc, long long rows, int hidden, int kind, int mbits, int emin, int max_code,
             int sign_shift, int over, int nan, int emax, int mt, int block, double s_tensor, int ceil_rule,
             double g) {
  __shared__ float red[32];
  const int G = static_cast<int>(blockDim.x);
  const int nb = (hidden + block - 1) / block;
  const float fmax = __uint_as_float((static_cast<unsigned int>(emax + 127) << 23) | static_cast<unsigned int>(mt));
  const float gf = static_cast<float>(g), st = static_cast<float>(s_tensor);
  for (long long i = blockIdx.x; i < rows; i += gridDim.x) {
    const long long off = i * static_cast<long long>(hidden);
    const T* yr = y + off;
    unsigned char* cr = codes + off;
    for (int k = 0; k < nb; ++k) {
      const int j0 = k * block;
      const int j1 = j0 + block < hidden ? j0 + block : hidden;
      const float amax = fpq_block_amax(yr, j0, j1, G, red);
      const long long at = i * nb + k;
      if (kind == kFpqScaled) {
        float s = st;
        if (s == 0.0f) {
          s = __fdiv_rn(amax, fmax);
          if (!(s > 0.0f) || isinf(s)) s = 1.0f;
        }
        if (threadIdx.x == 0) sf[at] = s;
        for (int j = j0 + static_cast<int>(threadIdx.x); j < j1; j += G) {
          const float v = __fdiv_rn(fpq_load(yr, j), s);
          cr[j] = static_cast<unsigned char>(fpq_encode(__float_as_uint(v), mbits, emin, max_code, sign_shift, over, nan));
        }
      } else if (kind == kFpqMx) {
        const int c = fpq_mx_code(__float_as_uint(amax), emax, static_cast<unsigned int>(mt), ceil_rule);
        if (threadIdx.x == 0) sc[at] = static_cast<unsigned char>(c);
        const double mul = __longlong_as_double(static_cast<long long>(127 - c + 1023) << 52);  // 2^-e
        for (int j = j0 + static_cast<int>(threadIdx.x); j < j1; j += G) {
          unsigned int q = 0u;
          if (c != 255) {
            const float v = __double2float_rn(__dmul_rn(static_cast<double>(fpq_load(yr, j)), mul));
            q = fpq_encode(__float_as_uint(v), mbits, emin, max_code, sign_shift, over, nan);
          }
          cr[j] = static_cast<unsigned char>(q);
        }
      } else {
        const float t = __fdiv_rn(__fdiv_rn(amax, 6.0f), gf);
        const unsigned int sb = fpq_encode(__float_as_uint(t), 3, -6, 0x7E, 7, 0x7E, 0x7F);
        if (threadIdx.x == 0) sc[at] = static_cast<unsigned char>(sb);
        const float big = __fmul_rn(fpq_e4m3_value(sb), gf);
        const bool ok = big > 0.0f && !isinf(big);
        for (int j = j0 + static_cast<int>(threadIdx.x); j < j1; j += G) {
          unsigned int q = 0u;
          if (ok) {
            const float v = __fdiv_rn(fpq_load(yr, j), big);
            q = fpq_encode(__float_as_uint(v), mbits, emin, max_code, sign_shift, over, nan);
          }
          cr[j] = static_cast<unsigned char>(q);
        }
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(PYNORM_QUANT_THREADS)
    quant_fp_amax(const T* __restrict__ y, float* __restrict__ amax_out, long long rows, int hidden) {
  __shared__ float red[32];
  const int G = static_cast<int>(blockDim.x);
  for (long long i = blockIdx.x; i < rows; i += gridDim.x) {
    const float a = fpq_block_amax(y + i * static_cast<long long>(hidden), 0, hidden, G, red);
    if (threadIdx.x == 0) amax_out[i] = a;
  }
}

}  // namespace pynorm
