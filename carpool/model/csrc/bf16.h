// bf16 <-> float as torch (c10) converts them: widening is a shift, narrowing
// rounds to nearest even (a NaN becomes 0x7FC0). In integer ops, which a
// function compiled without -ffast-math can inline (GCC leaves c10's
// conversions there as calls; see decode_block.cpp), and which work on
// bf16 bits where no at::BFloat16 is at hand (elementwise.cpp's argmax).
#pragma once

#include <cstdint>
#include <cstring>

namespace carpool {

inline float bf16_float(uint16_t b) {
  const uint32_t wide = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

inline uint16_t float_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t rounded = static_cast<uint16_t>((u + (((u >> 16) & 1u) + 0x7fffu)) >> 16);
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : rounded;  // a select, no branch
}

}  // namespace carpool
