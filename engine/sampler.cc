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
  // vLLM's rule: below 1e-5 the temperature means greedy (logits / T would overflow to infinity).
  if (p_.temperature < kGreedyBelow) return ArgMax(logits, vocab);

  // Candidates in rank order (logit descending, ties: lower id first, so the order is total and
  // reproducible). Only as much of the order as the filters need is computed: top-k sorts k candidates,
  // top-p sorts a growing head until its mass reaches p, min-p keeps the head above a threshold, and with
  // none of them the draw walks the vocabulary in id order (the same distribution; no sort at all).
  const float inv_t = 1.0f / p_.temperature;
  cand_.resize(vocab);
  for (int i = 0; i < vocab; ++i) cand_[i] = {logits[i] * inv_t, i};
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  int n = vocab;
  if (p_.top_k > 0 && p_.top_k < n) {
    std::partial_sort(cand_.begin(), cand_.begin() + p_.top_k, cand_.end(), by_logit);
    n = p_.top_k;
  }
  float mx = cand_[0].first;
  if (n == vocab) {
    for (int i = 1; i < n; ++i) mx = std::max(mx, cand_[i].first);
  }
  // Unnormalized probabilities e_i = exp(l_i - max) of the candidates, in the order of cand_.
  probs_.resize(n);
  double total = 0;
  for (int i = 0; i < n; ++i) total += probs_[i] = std::exp(cand_[i].first - mx);
  bool sorted = n < vocab;  // top-k sorted its k
  int keep = n;
  if (p_.min_p > 0.0f) {  // e_i >= min_p is p_i >= min_p × the top probability
    keep = 0;
    for (int i = 0; i < n; ++i) keep += probs_[i] >= p_.min_p;
    keep = std::max(keep, 1);
  }
  if (p_.top_p < 1.0f || keep < n) {
    // Sort a head of the order that is long enough: the min-p head, or for top-p a head whose mass
    // reaches top_p (at least one token), grown 4x at a time.
    int head = sorted ? n : std::min(n, std::max(keep < n ? keep : 0, 64));
    for (;;) {
      if (!sorted) {
        std::partial_sort(cand_.begin(), cand_.begin() + head, cand_.begin() + n, by_logit);
        for (int i = 0; i < head; ++i) probs_[i] = std::exp(cand_[i].first - mx);
        if (head == n) sorted = true;
      }
      int cut = std::min(keep, head);
      if (p_.top_p < 1.0f) {
        const double target = static_cast<double>(p_.top_p) * total;
        double cum = 0;
        int k = 0;
        while (k < head) {
          cum += probs_[k++];
          if (cum >= target) break;
        }
        if (cum < target && head < n) {  // the head is too short to decide
          head = std::min(n, head * 4);
          sorted = false;
          continue;
        }
        cut = std::min(cut, k);
      }
      n = std::max(cut, 1);
      break;
    }
    total = 0;
    for (int i = 0; i < n; ++i) total += probs_[i];
  }
  const double r = rng_.Uniform() * total;
  double cum = 0;
  for (int i = 0; i < n; ++i) {
    cum += probs_[i];
    if (r < cum) return cand_[i].second;
  }
  return cand_[n - 1].second;
}

}  // namespace qkv
