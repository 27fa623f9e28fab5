#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <map>

namespace qkv {
namespace {

std::vector<float> Logits() { return {1.0f, 3.0f, 2.0f, -1.0f, 2.9f}; }

int SampleOnce(const SamplingParams& p, std::vector<int> prompt = {}, std::vector<int> out = {}) {
  Sampler s(p, prompt);
  for (int t : out) s.Accept(t);
  auto l = Logits();
  return s.Sample(l.data(), static_cast<int>(l.size()));
}

TEST(Sampler, GreedyIsArgmax) {
  SamplingParams p;
  p.temperature = 0;
  EXPECT_EQ(SampleOnce(p), 1);
}

TEST(Sampler, TopKOneIsGreedy) {
  SamplingParams p;
  p.top_k = 1;
  p.seed = 5;
  for (int i = 0; i < 20; ++i) {
    p.seed = i;
    EXPECT_EQ(SampleOnce(p), 1);
  }
}

TEST(Sampler, SameSeedSameTokensDifferentSeedsDiffer) {
  SamplingParams p;
  p.temperature = 2.0f;
  std::vector<int> a, b, c;
  for (auto* v : {&a, &b, &c}) {
    p.seed = v == &c ? 99 : 7;
    Sampler s(p, {});
    for (int i = 0; i < 50; ++i) {
      auto l = Logits();
      v->push_back(s.Sample(l.data(), 5));
    }
  }
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST(Sampler, TopPAndMinPRestrictTheSupport) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 0.5f;  // token 1 alone holds ~0.39 of the mass, tokens 1+4 ~0.74
  std::map<int, int> seen;
  for (int i = 0; i < 300; ++i) {
    p.seed = i;
    ++seen[SampleOnce(p)];
  }
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen.count(1) && seen.count(4));
  SamplingParams q;
  q.min_p = 0.3f;  // keeps tokens with p >= 0.3 * p(token 1): tokens 1, 4, 2
  std::map<int, int> seen2;
  for (int i = 0; i < 300; ++i) {
    q.seed = i;
    ++seen2[SampleOnce(q)];
  }
  EXPECT_EQ(seen2.size(), 3u);
  EXPECT_FALSE(seen2.count(0) || seen2.count(3));
}

TEST(Sampler, PenaltiesFollowVllm) {
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 2.0f;  // token 1: 3.0 / 2 = 1.5 < 2.9
  EXPECT_EQ(SampleOnce(p, {1}), 4);
  SamplingParams f;
  f.temperature = 0;
  f.frequency_penalty = 0.1f;  // token 1 generated twice: 3.0 - 0.2 = 2.8 < 2.9
  EXPECT_EQ(SampleOnce(f, {}, {1, 1}), 4);
  EXPECT_EQ(SampleOnce(f, {1, 1}, {}), 1);  // frequency counts output tokens only
  SamplingParams pr;
  pr.temperature = 0;
  pr.presence_penalty = 0.15f;
  EXPECT_EQ(SampleOnce(pr, {}, {1}), 4);
}

TEST(Sampler, ValidationNamesTheField) {
  SamplingParams p;
  p.top_p = 0;
  EXPECT_NE(p.Validate().message().find("top_p"), std::string::npos);
  p = {};
  p.temperature = -1;
  EXPECT_NE(p.Validate().message().find("temperature"), std::string::npos);
  p = {};
  p.min_p = 2;
  EXPECT_NE(p.Validate().message().find("min_p"), std::string::npos);
  p = {};
  EXPECT_TRUE(p.Validate().ok());
}

TEST(Rng, IsReproducibleAndUniform) {
  Rng a(1), b(1);
  double sum = 0;
  for (int i = 0; i < 10000; ++i) {
    const double u = a.Uniform();
    ASSERT_EQ(u, b.Uniform());
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
  }
  EXPECT_NEAR(sum / 10000, 0.5, 0.02);
}

}  // namespace
}  // namespace qkv
