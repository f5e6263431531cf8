// Correctly rounded conversions between float/double and the 16-bit storage types,
// bit by bit, for the harness's cuda_fp16.h and cuda_bf16.h.
//
// * 16-bit -> float is exact.
// * float -> 16-bit rounds to nearest, ties to even (CUDA's *_rn intrinsics).
// * double -> 16-bit rounds once, correctly: first to float *to odd* (exact-correct for a
//   second rounding to a format of at most 22 significand bits), then as above.
// NaN stays NaN (quiet, sign kept); overflow goes to infinity as IEEE says.
// tests/cuda_cpu/test_harness.py checks every 16-bit value and every float32 against
// NumPy / ml_dtypes, and double inputs around every rounding boundary.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

namespace pnc_conv {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float -> IEEE binary16 bits, round to nearest even
inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) {  // inf or NaN
    if (a == 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u);
    return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  }
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: rounds to inf
  if (a >= 0x38800000u) {                                            // normal half (>= 2^-14)
    const uint32_t mant = a + 0x0fffu + ((a >> 13) & 1u);            // round to nearest even at bit 13
    return static_cast<uint16_t>(sign | ((mant - 0x38000000u) >> 13));
  }
  // subnormal half (or zero): value = a_float; half ulp here is 2^-24
  if (a < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25: rounds to 0 (2^-25 itself ties to 0)
  const int e = static_cast<int>(a >> 23);                  // biased exponent, 102..112
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;            // 24-bit significand
  const int shift = 126 - e;                                 // so that result = m >> shift in units of 2^-24
  const uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  uint32_t r = q;
  if (rem > half || (rem == half && (q & 1u))) r += 1;
  return static_cast<uint16_t>(sign | r);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0x1f) return bits_f32(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u));
  if (e != 0) return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
  if (m == 0) return bits_f32(sign);
  // subnormal: m * 2^-24, exact in float
  const float v = static_cast<float>(m) * 5.9604644775390625e-08f;
  return sign ? -v : v;
}

// float -> bfloat16 bits, round to nearest even
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN, quieted
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_to_f32(uint16_t b) { return bits_f32(static_cast<uint32_t>(b) << 16); }

// double -> float rounded to odd: the float nearest toward zero, with its last bit set when inexact
inline float f64_to_f32_odd(double d) {
  float f = static_cast<float>(d);
  if (!std::isfinite(d)) return f;
  const double back = static_cast<double>(f);
  if (back == d) return f;
  uint32_t u = f32_bits(f);
  if (std::fabs(back) > std::fabs(d)) u -= 1;  // one step toward zero (|f| > 0 here; inf -> FLT_MAX)
  return bits_f32(u | 1u);
}

inline uint16_t f64_to_f16(double d) {
  if (std::isnan(d)) return f32_to_f16(static_cast<float>(d));
  return f32_to_f16(f64_to_f32_odd(d));
}
inline uint16_t f64_to_bf16(double d) {
  if (std::isnan(d)) return f32_to_bf16(static_cast<float>(d));
  return f32_to_bf16(f64_to_f32_odd(d));
}

}  // namespace pnc_conv

extern "C" {
// exported for the exhaustive conversion tests (tests/cuda_cpu/test_harness.py)
void pnc_f32_to_f16(const float* in, uint16_t* out, size_t n);
void pnc_f16_to_f32(const uint16_t* in, float* out, size_t n);
void pnc_f32_to_bf16(const float* in, uint16_t* out, size_t n);
void pnc_bf16_to_f32(const uint16_t* in, float* out, size_t n);
void pnc_f64_to_f16(const double* in, uint16_t* out, size_t n);
void pnc_f64_to_bf16(const double* in, uint16_t* out, size_t n);
}
