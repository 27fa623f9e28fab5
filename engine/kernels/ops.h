// Small element-wise kernels of the forward pass. Each works on one row so that a row's result never
// depends on the other rows of the batch; reductions use a fixed lane order, so results are the same
// for every batch shape.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace qkv {

// e^x for x in [-87, 88] (clamped outside), ~1 ulp (Cephes' expf polynomial). Pure arithmetic, so loops
// over it vectorize (with -fno-trapping-math, set for the engine) and give the same bits everywhere;
// std::exp does neither.
inline float FastExp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, 4);
  return p * scale;
}

// FastExp on 8 lanes (AVX2 + FMA, the engine's baseline).
inline __m256 FastExp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Σ a[i]·b[i] with 16 fixed lanes, reduced in a fixed order.
float Dot(const float* a, const float* b, int n);
// out = x / sqrt(mean(x²) + eps) * w
void RmsNorm(const float* x, const float* w, float* out, int n, float eps);
// out[i] = silu(gate[i]) * up[i]
void SiluMul(const float* gate, const float* up, float* out, int n);
// Σ x[i] with 16 fixed lanes, reduced in a fixed order.
float Sum(const float* x, int n);
// max x[i] (-inf for n = 0), 8 lanes at a time (a maximum is exact, so any order gives the same value).
float Max(const float* x, int n);
// x[i] += y[i]
void AddInPlace(float* x, const float* y, int n);

// How RoPE pairs the dimensions of a head (which one an architecture uses is the model's business).
enum class RopeStyle {
  kInterleaved,  // pairs (2i, 2i+1): llama (its converters permute Q/K so this equals HF's rotate_half)
  kHalves,       // pairs (i, i + rotary_dim/2): qwen2, qwen3 ("neox" in llama.cpp)
};

// Frequency scaling of RoPE (the model config computes it the way llama.cpp does): linear divides every
// frequency by 1 / freq_scale; YaRN mixes, per pair i, the interpolated angle (× freq_scale) and the original
// one by a ramp that is 1 (original) below the correction dim of beta_fast rotations over orig_ctx and 0
// (interpolated) above that of beta_slow, as ggml's rope_yarn; cos and sin are multiplied by magnitude.
struct RopeScale {
  double freq_scale = 1.0;
  bool yarn = false;
  int orig_ctx = 0;
  double beta_fast = 32.0, beta_slow = 1.0;
  double magnitude = 1.0;
  std::vector<float> freq_factors;  // [rotary_dim / 2]: pair i's angle is divided by it first (ggml's freq_factors)
};

// Rotary position embedding over the first rotary_dim dims of a head (see RopeStyle for the pairing).
// The angle of pair i at position p is p · theta^(-2i/rotary_dim) (scaled as RopeScale says), computed in
// double at start-up.
class RopeTable {
 public:
  RopeTable(int rotary_dim, double theta, int max_positions, const RopeScale& scale = {});
  int max_positions() const { return max_positions_; }
  // Rotates one head vector in place at position pos (pos < max_positions()).
  void Apply(float* head, int pos, RopeStyle style) const;

 private:
  int rotary_dim_;
  int max_positions_;
  std::vector<float> cos_, sin_;  // [pos][rotary_dim/2]
};

}  // namespace qkv
