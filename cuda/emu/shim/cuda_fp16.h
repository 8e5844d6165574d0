// Host stand-in for CUDA's cuda_fp16.h (the emulator only): __half with
// round-to-nearest-even conversions through GCC's _Float16.
#pragma once
struct __half { _Float16 v; };
inline float __half2float(__half h) { return (float)h.v; }
inline __half __float2half_rn(float f) { return __half{(_Float16)f}; }
