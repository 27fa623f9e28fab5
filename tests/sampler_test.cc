#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>

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

// A large vocabulary, where the sampler sorts only a head of the order: the support of top-p and min-p is
// exactly the brute-force one, and plain temperature sampling follows the softmax.
TEST(Sampler, PartialSelectionKeepsTheSupportAndTheDistribution) {
  const int V = 5000;
  std::vector<float> base(V);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (auto& x : base) x = nd(rng);
  // Brute force: ids by logit descending, probabilities.
  std::vector<int> order(V);
  for (int i = 0; i < V; ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return base[a] > base[b] || (base[a] == base[b] && a < b); });
  const float mx = base[order[0]];
  double total = 0;
  for (float x : base) total += std::exp(x - mx);
  auto prob = [&](int id) { return std::exp(base[id] - mx) / total; };
  for (float top_p : {0.05f, 0.5f, 0.95f}) {
    size_t keep = 0;
    double cum = 0;
    while (keep < order.size()) {
      cum += prob(order[keep++]);
      if (cum >= top_p) break;
    }
    const std::set<int> support(order.begin(), order.begin() + keep);
    SamplingParams p;
    p.top_p = top_p;
    p.seed = 3;
    Sampler smp(p, {});
    std::set<int> seen;
    for (int i = 0; i < 3000; ++i) {
      auto l = base;
      seen.insert(smp.Sample(l.data(), V));
    }
    for (int id : seen) {
      EXPECT_TRUE(support.count(id)) << "top_p " << top_p << ": id " << id << " outside the support";
    }
    if (keep <= 3) {
      EXPECT_EQ(seen.size(), keep);
    }
  }
  {
    SamplingParams p;
    p.min_p = 0.2f;
    p.seed = 4;
    Sampler smp(p, {});
    for (int i = 0; i < 500; ++i) {
      auto l = base;
      const int id = smp.Sample(l.data(), V);
      EXPECT_GE(prob(id), 0.2 * prob(order[0]) * (1 - 1e-6));
    }
  }
  {
    SamplingParams p;
    p.seed = 5;
    Sampler smp(p, {});
    std::map<int, int> counts;
    const int draws = 20000;
    for (int i = 0; i < draws; ++i) {
      auto l = base;
      ++counts[smp.Sample(l.data(), V)];
    }
    for (int r = 0; r < 3; ++r) {
      const int id = order[r];
      const double want = prob(id), got = static_cast<double>(counts[id]) / draws;
      EXPECT_NEAR(got, want, 4 * std::sqrt(want * (1 - want) / draws) + 1e-3) << "rank " << r;
    }
  }
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
