#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace qkv {

Status SamplingParams::Validate() const {
  if (!(temperature >= 0.0f) || temperature > 100.0f) return InvalidArgument("temperature must be in [0, 100]");
  if (!(top_p > 0.0f && top_p <= 1.0f)) return InvalidArgument("top_p must be in (0, 1]");
  if (top_k < -1) return InvalidArgument("top_k must be -1, 0 (off) or positive");
  if (!(min_p >= 0.0f && min_p <= 1.0f)) return InvalidArgument("min_p must be in [0, 1]");
  if (!(repetition_penalty > 0.0f) || repetition_penalty > 100.0f) {
    return InvalidArgument("repetition_penalty must be in (0, 100]");
  }
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f))
    return InvalidArgument("presence_penalty must be in [-2, 2]");
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f)) {
    return InvalidArgument("frequency_penalty must be in [-2, 2]");
  }
  return {};
}

namespace {
uint64_t SplitMix(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
}  // namespace

Rng::Rng(uint64_t seed) {
  for (auto& s : s_) s = SplitMix(seed);
}

uint64_t Rng::Next() {
  const uint64_t r = Rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = Rotl(s_[3], 45);
  return r;
}

double Rng::Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

int ArgMax(const float* x, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i) {
    if (x[i] > x[best]) best = i;
  }
  return best;
}

Sampler::Sampler(const SamplingParams& p, std::span<const int> prompt)
    : p_(p), rng_(p.seed ? *p.seed : std::random_device{}() * 0x100000001ull ^ std::random_device{}()) {
  for (int t : prompt) {
    if (t >= 0) {
      if (static_cast<size_t>(t) >= seen_.size()) seen_.resize(t + 1, 0);
      seen_[t] = 1;
    }
  }
}

void Sampler::Accept(int token) {
  if (token < 0) return;
  ++output_counts_[token];
  if (static_cast<size_t>(token) >= seen_.size()) seen_.resize(token + 1, 0);
  seen_[token] = 1;
}

int Sampler::Sample(float* logits, int vocab) {
  if (p_.repetition_penalty != 1.0f) {
    const int n = std::min<int>(vocab, static_cast<int>(seen_.size()));
    for (int t = 0; t < n; ++t) {
      if (seen_[t]) logits[t] = logits[t] > 0 ? logits[t] / p_.repetition_penalty : logits[t] * p_.repetition_penalty;
    }
  }
  if (p_.frequency_penalty != 0.0f || p_.presence_penalty != 0.0f) {
    for (const auto& [t, cnt] : output_counts_) {
      if (t < vocab) logits[t] -= p_.frequency_penalty * static_cast<float>(cnt) + p_.presence_penalty;
    }
  }
  if (p_.temperature == 0.0f) return ArgMax(logits, vocab);

  // Candidates sorted by logit (ties: lower id first, so the order is total and reproducible).
  cand_.resize(vocab);
  for (int i = 0; i < vocab; ++i) cand_[i] = {logits[i] / p_.temperature, i};
  int n = vocab;
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  if (p_.top_k > 0 && p_.top_k < n) {
    std::partial_sort(cand_.begin(), cand_.begin() + p_.top_k, cand_.end(), by_logit);
    n = p_.top_k;
  } else {
    std::sort(cand_.begin(), cand_.end(), by_logit);
  }
  probs_.resize(n);
  const float mx = cand_[0].first;
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += probs_[i] = std::exp(cand_[i].first - mx);
  for (int i = 0; i < n; ++i) probs_[i] = static_cast<float>(probs_[i] / sum);
  if (p_.top_p < 1.0f) {  // smallest prefix whose mass reaches top_p (at least one token)
    double cum = 0;
    int keep = 0;
    while (keep < n) {
      cum += probs_[keep++];
      if (cum >= p_.top_p) break;
    }
    n = keep;
  }
  if (p_.min_p > 0.0f) {  // drop tokens below min_p × the top probability
    const float thr = p_.min_p * probs_[0];
    int keep = 1;
    while (keep < n && probs_[keep] >= thr) ++keep;
    n = keep;
  }
  double total = 0;
  for (int i = 0; i < n; ++i) total += probs_[i];
  const double r = rng_.Uniform() * total;
  double cum = 0;
  for (int i = 0; i < n; ++i) {
    cum += probs_[i];
    if (r < cum) return cand_[i].second;
  }
  return cand_[n - 1].second;
}

}  // namespace qkv
