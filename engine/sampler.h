// Token sampling with vLLM's semantics and order:
//   repetition penalty (prompt and output tokens: positive logits ÷ p, negative × p)
//   → frequency and presence penalties (output tokens: − f·count − p·[count > 0])
//   → temperature (0 means greedy) → top-k → top-p → min-p → draw from the request's own generator.
// Each request owns its generator, seeded from its seed, so the same seed gives the same tokens whatever
// else runs in the batch.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/rng.h"
#include "engine/status.h"

namespace qkv {

// Temperatures below this are greedy.
inline constexpr float kGreedyBelow = 1e-5f;

struct SamplingParams {
  float temperature = 1.0f;  // < kGreedyBelow: greedy
  float top_p = 1.0f;
  int top_k = 0;  // 0 or -1: off
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  std::optional<uint64_t> seed;  // absent: a random seed
  Status Validate() const;       // messages name the field
};

class Sampler {
 public:
  Sampler(const SamplingParams& p, std::span<const int> prompt);
  // Samples the next token from one row of logits (vocab values); `logits` is used as scratch.
  int Sample(float* logits, int vocab);
  // Records a generated token (for the penalties).
  void Accept(int token);
  const SamplingParams& params() const { return p_; }

 private:
  SamplingParams p_;
  Rng rng_;
  std::unordered_map<int, int> output_counts_;
  std::vector<char> seen_;  // prompt or output token, for the repetition penalty
  std::vector<std::pair<float, int>> cand_;
  std::vector<float> probs_;
};

// Index of the largest value (the lowest index wins ties).
int ArgMax(const float* x, int n);

}  // namespace qkv
