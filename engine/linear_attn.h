// The shape of a Gated DeltaNet (linear attention) layer and the size of the state it keeps per sequence. In
// the base layer so that the capacity planner (which the client links alone) and the engine count the same bytes.
#pragma once

#include <cstdint>

namespace qkv {

// Gated DeltaNet layers (linear attention) of a hybrid model (qwen35), as llama.cpp reads them: ssm.conv_kernel,
// ssm.group_count (key heads), ssm.time_step_rank (value heads), ssm.state_size (key head width) and
// ssm.inner_size (value heads × value head width). Per sequence and layer such a layer keeps, in f32: the
// causal conv's window (the last conv_kernel - 1 inputs of every channel), the recurrent matrix S (d_k × d_v per
// value head) as of the last multiple of kDeltaNetChunk tokens, and what the tokens since then contribute
// (their normalized key, corrected value and cumulative log decay), from which every token's output is computed
// with one formula whether it arrived in a prefill or a decode (layers/gated_deltanet.cc).
inline constexpr int kDeltaNetChunk = 16;
struct LinearAttnConfig {
  int conv_kernel = 0;
  int n_k_heads = 0, n_v_heads = 0;
  int k_dim = 0, v_dim = 0;
  int conv_channels() const { return 2 * n_k_heads * k_dim + n_v_heads * v_dim; }
  int64_t window_floats() const { return int64_t{conv_kernel - 1} * conv_channels(); }
  int64_t matrix_floats() const { return int64_t{n_v_heads} * k_dim * v_dim; }
  // Per token since the last commit: a key per key head, a corrected value and a log decay per value head.
  int64_t pending_floats_per_token() const { return int64_t{n_k_heads} * k_dim + int64_t{n_v_heads} * (v_dim + 1); }
  int64_t pending_floats() const { return kDeltaNetChunk * pending_floats_per_token(); }
  // One layer's share of a sequence's state slot, in bytes (f32).
  int64_t state_bytes() const { return 4 * (window_floats() + matrix_floats() + pending_floats()); }
};

}  // namespace qkv
