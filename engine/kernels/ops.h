// Small element-wise kernels of the forward pass. Each works on one row so that a row's result never
// depends on the other rows of the batch; reductions use a fixed lane order, so results are the same
// for every batch shape.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/model_config.h"

namespace qkv {

// Σ a[i]·b[i] with 16 fixed lanes, reduced in a fixed order.
float Dot(const float* a, const float* b, int n);
// out = x / sqrt(mean(x²) + eps) * w
void RmsNorm(const float* x, const float* w, float* out, int n, float eps);
// out[i] = silu(gate[i]) * up[i]
void SiluMul(const float* gate, const float* up, float* out, int n);
// x[i] += y[i]
void AddInPlace(float* x, const float* y, int n);

// Rotary position embedding over the first rotary_dim dims of a head (see RopeStyle for the pairing).
// The angle of pair i at position p is p · theta^(-2i/rotary_dim), computed in double at start-up.
class RopeTable {
 public:
  RopeTable(int rotary_dim, double theta, int max_positions);
  int max_positions() const { return max_positions_; }
  // Rotates one head vector in place at position pos (pos < max_positions()).
  void Apply(float* head, int pos, RopeStyle style) const;

 private:
  int rotary_dim_;
  int max_positions_;
  std::vector<float> cos_, sin_;  // [pos][rotary_dim/2]
};

}  // namespace qkv
