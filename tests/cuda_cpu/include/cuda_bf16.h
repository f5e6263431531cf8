// The CPU execution harness's cuda_bf16.h: __nv_bfloat16 as a storage-only 16-bit type
// (see cuda_fp16.h): conversions only, correctly rounded, no arithmetic.
#pragma once

#include "cuda_cpu_convert.h"

struct __nv_bfloat16 {
  uint16_t __x;
};

inline float __bfloat162float(__nv_bfloat16 b) { return pnc_conv::bf16_to_f32(b.__x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{pnc_conv::f32_to_bf16(f)}; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16{pnc_conv::f64_to_bf16(d)}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16{u}; }
