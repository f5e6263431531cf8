// The CPU execution harness's cuda_fp16.h: __half as a storage-only 16-bit type.
//
// Only what a kernel needs to move half values and convert them is provided: the
// conversions of CUDA's intrinsics, correctly rounded (cuda_cpu_convert.h). There is no
// half arithmetic: a kernel that computes in half precision does not compile here,
// which is deliberate (pynorm's kernels compute in float or double).
#pragma once

#include "cuda_cpu_convert.h"

struct __half {
  uint16_t __x;
};

inline float __half2float(__half h) { return pnc_conv::f16_to_f32(h.__x); }
inline __half __float2half_rn(float f) { return __half{pnc_conv::f32_to_f16(f)}; }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline __half __double2half(double d) { return __half{pnc_conv::f64_to_f16(d)}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
