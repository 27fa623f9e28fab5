// What happens to one sequence's logits after a forward pass, in vLLM's order: sample the next token with
// the request's own generator; its logprob and top alternatives (raw log-softmax, before penalties and
// temperature) when asked; then the end checks: EOS (unless ignored) → a stop token id → a stop string
// (text that could begin one is held back) → the token limit or the context. The engine runs one per
// request; qkv-run runs one for its single sequence, so both end generations the same way.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/request.h"
#include "engine/sampler.h"
#include "engine/text_stream.h"
#include "engine/tokenizer.h"

namespace qkv {

struct OutputOptions {
  std::vector<std::string> stop;
  bool include_stop_str_in_output = false;
  std::vector<int> stop_token_ids;
  bool ignore_eos = false;
  int max_tokens = 1;          // tokens to generate at most
  int max_context = 0;         // the context ends generation too (0: no limit)
  int logprobs = 0;            // top alternatives per token
  bool want_logprobs = false;  // the chosen token's logprob (implied by logprobs > 0)
};

class OutputProcessor {
 public:
  // tok must outlive the processor; prompt is the whole context so far (for the repetition penalty).
  OutputProcessor(const Tokenizer& tok, const SamplingParams& sampling, std::span<const int> prompt, OutputOptions opt);

  struct Step {
    int token = -1;
    std::string text;                     // the delta that became safe to show
    std::optional<TokenLogprob> logprob;  // when asked
    FinishReason finish = FinishReason::kNone;
    std::string stop_reason;  // "eos", the stop token id, or the stop string
    Status error;             // non-finite logits: finish is kError
  };
  // One row of vocab logits (not modified). context_after: tokens in the context once this one is added.
  Step Next(const float* row, int vocab, int context_after);
  // Text still held back when generation ends (not after a stop string: that text is never shown).
  std::string Finish() { return text_.Finish(); }
  int n_generated() const { return n_generated_; }

 private:
  const Tokenizer& tok_;
  OutputOptions opt_;
  Sampler sampler_;
  TextStream text_;
  int n_generated_ = 0;
  std::vector<float> row_;  // scratch: the sampler works on a copy
  std::vector<int> idx_;    // scratch: top-logprob selection
};

// log-softmax of one logits row: its max and log Σ exp(x - max), summed in a fixed order.
std::pair<float, float> LogSumExp(const float* x, int n);

}  // namespace qkv
