#include "engine/kernels/ops.h"

#include <algorithm>
#include <cassert>
#include <cmath>

namespace qkv {

float Dot(const float* a, const float* b, int n) {
  constexpr int L = 16;
  float acc[L] = {};
  int i = 0;
  for (; i + L <= n; i += L) {
    for (int l = 0; l < L; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  // Pairwise, fixed order.
  for (int w = L / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

float Sum(const float* x, int n) {
  constexpr int L = 16;
  float acc[L] = {};
  int i = 0;
  for (; i + L <= n; i += L) {
    for (int l = 0; l < L; ++l) acc[l] += x[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) acc[l] += x[i];
  for (int w = L / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

float Max(const float* x, int n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float r = -INFINITY;
  for (float v : lanes) r = std::max(r, v);
  for (; j < n; ++j) r = std::max(r, x[j]);
  return r;
}

void RmsNorm(const float* x, const float* w, float* out, int n, float eps) {
  const float ss = Dot(x, x, n);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

void SiluMul(const float* gate, const float* up, float* out, int n) {
  int i = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = FastExp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + FastExp(-gate[i])) * up[i];
}

void AddInPlace(float* x, const float* y, int n) {
  for (int i = 0; i < n; ++i) x[i] += y[i];
}

RopeTable::RopeTable(int rotary_dim, double theta, int max_positions, const RopeScale& sc)
    : rotary_dim_(rotary_dim), max_positions_(max_positions) {
  const int half = rotary_dim / 2;
  assert(sc.freq_factors.empty() || sc.freq_factors.size() == static_cast<size_t>(half));
  cos_.resize(static_cast<size_t>(max_positions) * half);
  sin_.resize(cos_.size());
  // YaRN's correction range (ggml_rope_yarn_corr_dims): the pair index at which a frequency makes n_rot
  // rotations over the original context, for n_rot = beta_fast (low) and beta_slow (high).
  auto corr = [&](double n_rot) {
    return rotary_dim * std::log(sc.orig_ctx / (n_rot * 2 * M_PI)) / (2 * std::log(theta));
  };
  double low = 0, high = 0;
  if (sc.yarn && rotary_dim > 0 && sc.orig_ctx > 0) {
    low = std::max(0.0, std::floor(corr(sc.beta_fast)));
    high = std::min(rotary_dim - 1.0, std::ceil(corr(sc.beta_slow)));
  }
  for (int p = 0; p < max_positions; ++p) {
    for (int i = 0; i < half; ++i) {
      const double ff = sc.freq_factors.empty() ? 1.0 : sc.freq_factors[static_cast<size_t>(i)];
      const double extrap = p * std::pow(theta, -2.0 * i / rotary_dim) / ff;
      const double interp = sc.freq_scale * extrap;
      double a = interp;
      if (sc.yarn) {
        const double ramp = 1.0 - std::clamp((i - low) / std::max(0.001, high - low), 0.0, 1.0);
        a = interp * (1.0 - ramp) + extrap * ramp;
      }
      cos_[static_cast<size_t>(p) * half + i] = static_cast<float>(std::cos(a) * sc.magnitude);
      sin_[static_cast<size_t>(p) * half + i] = static_cast<float>(std::sin(a) * sc.magnitude);
    }
  }
}

void RopeTable::Apply(float* h, int pos, RopeStyle style) const {
  const int half = rotary_dim_ / 2;
  const float* c = &cos_[static_cast<size_t>(pos) * half];
  const float* s = &sin_[static_cast<size_t>(pos) * half];
  if (style == RopeStyle::kInterleaved) {
    for (int i = 0; i < half; ++i) {
      const float x0 = h[2 * i], x1 = h[2 * i + 1];
      h[2 * i] = x0 * c[i] - x1 * s[i];
      h[2 * i + 1] = x0 * s[i] + x1 * c[i];
    }
  } else {
    for (int i = 0; i < half; ++i) {
      const float x0 = h[i], x1 = h[i + half];
      h[i] = x0 * c[i] - x1 * s[i];
      h[i + half] = x0 * s[i] + x1 * c[i];
    }
  }
}

}  // namespace qkv
