// The engine's random generator (sampling, random models).
#pragma once

#include <cstdint>

namespace qkv {

// A small, portable generator (SplitMix64 seeding xoshiro256**): the same seed gives the same stream on
// every platform, which std::uniform_real_distribution does not promise.
class Rng {
 public:
  explicit Rng(uint64_t seed);
  uint64_t Next();
  double Uniform();  // [0, 1) with 53 random bits

 private:
  uint64_t s_[4];
};

}  // namespace qkv
