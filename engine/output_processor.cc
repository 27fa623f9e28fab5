#include "engine/output_processor.h"

#include <algorithm>
#include <cmath>

namespace qkv {

std::pair<float, float> LogSumExp(const float* x, int n) {
  float m = x[0];
  for (int i = 1; i < n; ++i) m = std::max(m, x[i]);
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(static_cast<double>(x[i] - m));
  return {m, static_cast<float>(std::log(s))};
}

OutputProcessor::OutputProcessor(const Tokenizer& tok, const SamplingParams& sampling, std::span<const int> prompt,
                                 OutputOptions opt)
    : tok_(tok), opt_(std::move(opt)), sampler_(sampling, prompt), text_(opt_.stop, opt_.include_stop_str_in_output) {}

OutputProcessor::Step OutputProcessor::Next(const float* row, int vocab, int context_after) {
  Step out;
  row_.assign(row, row + vocab);
  bool finite = true;
  for (int i = 0; i < vocab; ++i) finite &= std::isfinite(row_[i]);
  if (!finite) {  // this request ends; nothing is sampled from garbage
    out.finish = FinishReason::kError;
    out.error = Internal("the model produced non-finite logits");
    return out;
  }
  const int next = sampler_.Sample(row_.data(), vocab);
  if (opt_.want_logprobs || opt_.logprobs > 0) {
    const auto [m, lse] = LogSumExp(row, vocab);
    TokenLogprob lp;
    lp.token = next;
    lp.logprob = row[next] - m - lse;
    if (opt_.logprobs > 0) {
      idx_.resize(vocab);
      for (int i = 0; i < vocab; ++i) idx_[i] = i;
      const int k = std::min(vocab, opt_.logprobs);
      std::partial_sort(idx_.begin(), idx_.begin() + k, idx_.end(),
                        [&](int a, int b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
      for (int i = 0; i < k; ++i) lp.top.emplace_back(idx_[i], row[idx_[i]] - m - lse);
    }
    out.logprob = std::move(lp);
  }
  sampler_.Accept(next);
  ++n_generated_;
  out.token = next;
  const bool is_stop_token =
      std::find(opt_.stop_token_ids.begin(), opt_.stop_token_ids.end(), next) != opt_.stop_token_ids.end();
  if (!opt_.ignore_eos && tok_.IsEndOfGeneration(next)) {
    out.finish = FinishReason::kStop;
    out.stop_reason = "eos";
  } else if (is_stop_token) {
    out.finish = FinishReason::kStop;
    out.stop_reason = std::to_string(next);
  } else {
    out.text = text_.Push(tok_.TokenBytes(next));
    if (text_.stopped()) {
      out.finish = FinishReason::kStop;
      out.stop_reason = text_.matched_stop();
    } else if (n_generated_ >= opt_.max_tokens || (opt_.max_context > 0 && context_after >= opt_.max_context)) {
      out.finish = FinishReason::kLength;
    }
  }
  return out;
}

}  // namespace qkv
