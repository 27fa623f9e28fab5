// Scalar and bulk conversions between f32, bf16 and IEEE f16.
#pragma once

#include <cstdint>
#include <cstring>

namespace qkv {

inline float Bf16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as oneDNN and PyTorch do; NaN stays NaN.
inline uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float F16ToF32(uint16_t h);
uint16_t F32ToF16(float f);

void F32ToBf16Bulk(const float* src, uint16_t* dst, int64_t n);
void Bf16ToF32Bulk(const uint16_t* src, float* dst, int64_t n);

}  // namespace qkv
