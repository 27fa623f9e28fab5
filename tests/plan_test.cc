#include <gtest/gtest.h>

#include "engine/capacity_plan.h"

namespace qkv {
namespace {

int64_t PerToken(const std::string& json, const std::string& dtype = "bf16") {
  auto p = PlanCapacity(json, 16ll << 30, 4096, ParseKvElement(dtype).value());
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return p.ok() ? p->kv_bytes_per_token : -1;
}

// Published bf16 figures.
TEST(Plan, DeepSeekLlm67b) {
  EXPECT_EQ(
      PerToken(
          R"({"num_hidden_layers": 95, "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 8192, "head_dim": 128})"),
      389120);
  EXPECT_EQ(PerToken(R"({"num_hidden_layers": 95, "num_attention_heads": 64, "hidden_size": 8192})"),
            3112960);  // as MHA
}

// qkvserve's int8 cache: one byte per value and a 2-byte scale per cached vector (K or V of one kv head per
// token; for MLA the latent and the rope key), as the engine's arena counts them (kv_cache.h).
TEST(Plan, Int8CountsItsScales) {
  const std::string gqa =
      R"({"num_hidden_layers": 95, "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 8192, "head_dim": 128})";
  EXPECT_EQ(PerToken(gqa, "int8"), 95 * 2 * 8 * (128 + 2));
  EXPECT_EQ(PerToken(gqa, "f32"), 2 * PerToken(gqa));
  EXPECT_EQ(
      PerToken(R"({"num_hidden_layers": 60, "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64})",
               "int8"),
      60 * (576 + 4));
}

TEST(Plan, Mla) {
  EXPECT_EQ(
      PerToken(R"({"num_hidden_layers": 60, "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64})"),
      69120);
  EXPECT_EQ(
      PerToken(R"({"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64})"),
      70272);
}

TEST(Plan, HybridOnlyAttentionLayersHoldKv) {
  const std::string base =
      R"("num_hidden_layers": 64, "num_attention_heads": 32, "head_dim": 256, "full_attention_interval": 4)";
  EXPECT_EQ(PerToken("{" + base + R"(, "num_key_value_heads": 4})"), 64 * 1024);
  EXPECT_EQ(PerToken("{" + base + R"(, "num_key_value_heads": 24})"), 384 * 1024);
  EXPECT_EQ(PerToken("{" + base + R"(, "num_key_value_heads": 1})"), 16 * 1024);
  std::string types = "[";
  for (int i = 0; i < 64; ++i)
    types += std::string(i ? "," : "") + ((i % 4 == 3) ? "\"full_attention\"" : "\"linear_attention\"");
  types += "]";
  EXPECT_EQ(
      PerToken(
          R"({"num_hidden_layers": 64, "num_attention_heads": 32, "head_dim": 256, "num_key_value_heads": 4, "layer_types": )" +
          types + "}"),
      64 * 1024);
}

// The reference hybrid shape (Qwen3.5-27B: 48 of 64 layers Gated DeltaNet, 16 key / 48 value heads of 128, a
// conv of 4): the state is counted in f32 whatever the KV dtype, with the conv window and the open chunk, as
// the engine allocates it (LinearAttnConfig::state_bytes): 144 MiB of matrices + 5.6 MiB of windows + 24.1 MiB
// of open chunk per sequence.
TEST(Plan, HybridStateIsF32WithTheConvWindow) {
  const std::string cfg =
      R"({"num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
          "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_num_key_heads": 16,
          "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128})";
  const int64_t per_layer = 4 * (3 * (2 * 16 * 128 + 48 * 128) + 48 * 128 * 128 + 16 * (16 * 128 + 48 * 129));
  for (KvElement e : {KvElement{2, 0}, KvElement{1, 2}, KvElement{4, 0}}) {
    auto p = PlanCapacity(cfg, 64ll << 30, 4096, e);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->linear_layers, 48);
    EXPECT_EQ(p->linear_state_bytes, 48 * per_layer);
    EXPECT_EQ(p->bytes_per_session, p->kv_bytes_per_token * 4096 + 48 * per_layer);
  }
  EXPECT_EQ(48 * per_layer, 182206464);
}

TEST(Plan, SlidingLayersAreCappedAtTheWindow) {
  auto p = PlanCapacity(R"({"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]})",
                        1 << 30, 4096, KvElement{2, 0});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->kv_bytes_per_token, 2 * 2 * 2 * 64 * 2);
  EXPECT_EQ(p->bytes_per_session, 1024 * 4096 + 1024 * 128);
  EXPECT_EQ(p->sessions_fit, (1 << 30) / p->bytes_per_session);
  EXPECT_NE(p->ToJson().find("\"kv_bytes_per_token\":1024"), std::string::npos);
}

TEST(Plan, ErrorsAndSizes) {
  EXPECT_FALSE(PlanCapacity("{}", 1, 1, KvElement{}).ok());
  EXPECT_FALSE(PlanCapacity("not json", 1, 1, KvElement{}).ok());
  EXPECT_FALSE(ParseKvElement("int4").ok());
  EXPECT_EQ(*ParseByteSize("16GiB"), 16ll << 30);
  EXPECT_EQ(*ParseByteSize("512MiB"), 512ll << 20);
  EXPECT_EQ(*ParseByteSize("1000"), 1000);
  EXPECT_FALSE(ParseByteSize("lots").ok());
}

}  // namespace
}  // namespace qkv
