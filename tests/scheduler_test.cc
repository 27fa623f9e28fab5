// The cache stores and the scheduler that owns them, without a model: token blocks, state slots, the
// admission rules that depend on them.
#include "engine/scheduler.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

namespace qkv {
namespace {

CacheLayout SmallLayout(int64_t blocks, int64_t state_bytes, int slots) {
  CacheLayout l;
  l.tokens.n_layers = 2;
  l.tokens.n_kv_heads = 1;
  l.tokens.head_dim = 4;
  l.tokens.block_size = 4;
  l.tokens.n_blocks = blocks;
  l.tokens.dtype = DType::kF32;
  l.state_bytes_per_seq = state_bytes;
  l.state_slots = slots;
  return l;
}

std::unique_ptr<Sequence> Seq(uint64_t id, int n_tokens) {
  auto s = std::make_unique<Sequence>();
  s->id = id;
  for (int i = 0; i < n_tokens; ++i) s->ctx.tokens.push_back(i + 1);
  s->n_prompt = n_tokens;
  s->max_tokens = 4;
  return s;
}

TEST(StateStore, HandsOutZeroedSlotsUntilFull) {
  StateStore st(2, 16);
  EXPECT_EQ(st.bytes(), 32);
  const int a = st.Allocate(), b = st.Allocate();
  EXPECT_GE(a, 0);
  EXPECT_GE(b, 0);
  EXPECT_NE(a, b);
  EXPECT_EQ(st.Allocate(), -1);
  EXPECT_EQ(st.used_slots(), 2);
  std::memset(st.Slot(a), 0x5a, 16);
  st.Release(a);
  st.Release(a);  // a second release of the same slot changes nothing
  EXPECT_EQ(st.free_slots(), 1);
  const int c = st.Allocate();
  EXPECT_EQ(c, a);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(st.Slot(c)[i], 0) << "byte " << i << " of a reused slot";
}

TEST(KvCache, RegionsAreDisjointAndAKvHeadsBlocksAreContiguous) {
  KvCacheShape s;
  s.n_layers = 2;
  s.n_kv_heads = 3;
  s.head_dim = 4;
  s.block_size = 4;
  s.n_blocks = 5;
  s.dtype = DType::kF32;
  auto kv = KvCache::Create(s);
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  KvCache& c = **kv;
  const size_t region = 4 * 4 * sizeof(float);
  auto tag = [](int plane, int l, int b, int h) { return static_cast<uint8_t>(1 + plane * 60 + l * 30 + b * 6 + h); };
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 3; ++h)
      for (int b = 0; b < 5; ++b) {
        // Decode attention streams one kv head of one layer: its consecutive blocks must be adjacent.
        if (b > 0) {
          EXPECT_EQ(c.K(l, b, h), c.K(l, b - 1, h) + region) << "layer " << l << " head " << h;
          EXPECT_EQ(c.V(l, b, h), c.V(l, b - 1, h) + region) << "layer " << l << " head " << h;
        }
        std::memset(c.K(l, b, h), tag(0, l, b, h), region);
        std::memset(c.V(l, b, h), tag(1, l, b, h), region);
      }
  c.CopyBlock(1, 3);
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 3; ++h)
      for (int b = 0; b < 5; ++b) {
        const int from = b == 3 ? 1 : b;  // block 3 now holds block 1's K and V, every layer and head
        for (size_t i = 0; i < region; ++i) {
          ASSERT_EQ(c.K(l, b, h)[i], tag(0, l, from, h)) << "K layer " << l << " block " << b << " head " << h;
          ASSERT_EQ(c.V(l, b, h)[i], tag(1, l, from, h)) << "V layer " << l << " block " << b << " head " << h;
        }
      }
}

TEST(KvBlockPool, ReleasedBlocksComeBackInAscendingOrder) {
  KvBlockPool pool(16, 4);
  SeqKv a, b, c;
  ASSERT_TRUE(ReserveBlocks(a, 20, 4, pool).ok());
  ASSERT_TRUE(ReserveBlocks(b, 12, 4, pool).ok());
  EXPECT_EQ(a.blocks, (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(b.blocks, (std::vector<int>{5, 6, 7}));
  ReleaseBlocks(a, pool);
  ASSERT_TRUE(ReserveBlocks(c, 20, 4, pool).ok());
  EXPECT_EQ(c.blocks, (std::vector<int>{0, 1, 2, 3, 4})) << "a run of consecutive blocks streams in decode attention";
  EXPECT_EQ(pool.CheckInvariants(), "");
}

TEST(CacheStores, SizesFollowTheLayout) {
  const CacheLayout l = SmallLayout(8, 24, 3);
  auto c = CacheStores::Create(l);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ((*c)->tokens().arena_bytes(), l.token_bytes());
  EXPECT_EQ(l.token_bytes(), 8 * 4 * (2 * 2 * 1 * 4 * 4));  // blocks × slots × (layers × K,V × heads × dim × f32)
  EXPECT_EQ((*c)->states().bytes(), 72);
  EXPECT_EQ((*c)->bytes(), l.bytes());
  // A layout that keeps state needs slots.
  EXPECT_EQ(CacheStores::Create(SmallLayout(8, 24, 0)).status().code(), StatusCode::kInvalidArgument);
  // No state: no slots, whatever the count says.
  auto none = CacheStores::Create(SmallLayout(8, 0, 5));
  ASSERT_TRUE(none.ok());
  EXPECT_EQ((*none)->states().n_slots(), 0);
}

TEST(Scheduler, WithoutStateNoSlotIsTaken) {
  auto c = CacheStores::Create(SmallLayout(32, 0, 0));
  ASSERT_TRUE(c.ok());
  Scheduler sch(std::move(*c), {64, 8, true});
  auto a = Seq(1, 6);
  sch.Enqueue(a.get());
  const StepPlan p = sch.PlanStep([] { return false; });
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(a->ctx.kv.state_slot, -1);
  EXPECT_EQ(a->ctx.kv.blocks.size(), 2u);  // 6 tokens in blocks of 4
  EXPECT_EQ(sch.pool().used_blocks(), 2);
  sch.Remove(a.get());
  sch.Release(a->ctx.kv);
  EXPECT_EQ(sch.pool().used_blocks(), 0);
  EXPECT_EQ(sch.pool().CheckInvariants(), "");
}

// A model that keeps per-sequence state: each admitted sequence gets its own slot; when none is free the
// next one waits (after asking the evictor), and gets one when a running sequence gives its back.
TEST(Scheduler, StateSlotsBoundAdmission) {
  auto c = CacheStores::Create(SmallLayout(32, 64, 2));
  ASSERT_TRUE(c.ok());
  Scheduler sch(std::move(*c), {64, 8, true});
  auto a = Seq(1, 5), b = Seq(2, 5), d = Seq(3, 5);
  for (Sequence* s : {a.get(), b.get(), d.get()}) sch.Enqueue(s);
  int evictions_asked = 0;
  StepPlan p = sch.PlanStep([&] {
    ++evictions_asked;
    return false;
  });
  ASSERT_EQ(p.chunks.size(), 2u);
  EXPECT_EQ(sch.n_running(), 2u);
  EXPECT_EQ(sch.n_waiting(), 1u);
  EXPECT_GE(evictions_asked, 1);
  EXPECT_GE(a->ctx.kv.state_slot, 0);
  EXPECT_GE(b->ctx.kv.state_slot, 0);
  EXPECT_NE(a->ctx.kv.state_slot, b->ctx.kv.state_slot);
  EXPECT_EQ(d->ctx.kv.state_slot, -1);
  EXPECT_EQ(sch.cache().states().free_slots(), 0);

  // a finishes: its blocks and slot go back, and d is admitted with that slot.
  const int a_slot = a->ctx.kv.state_slot;
  sch.Remove(a.get());
  sch.Release(a->ctx.kv);
  EXPECT_EQ(a->ctx.kv.state_slot, -1);
  p = sch.PlanStep([] { return false; });
  EXPECT_EQ(d->ctx.kv.state_slot, a_slot);
  EXPECT_EQ(sch.n_waiting(), 0u);
}

// The evictor frees a slot (as dropping an idle session's cache does) and the waiting sequence gets it.
TEST(Scheduler, EvictingIdleStateAdmits) {
  auto c = CacheStores::Create(SmallLayout(32, 64, 1));
  ASSERT_TRUE(c.ok());
  Scheduler sch(std::move(*c), {64, 8, true});
  SeqKv idle;  // an idle session's cache, holding the only slot
  idle.state_slot = sch.cache().states().Allocate();
  ASSERT_EQ(idle.state_slot, 0);
  auto a = Seq(1, 5);
  sch.Enqueue(a.get());
  const StepPlan p = sch.PlanStep([&] {
    if (idle.state_slot < 0) return false;
    sch.Release(idle);
    return true;
  });
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(a->ctx.kv.state_slot, 0);
}

// A fork gets its own slot holding a copy of the parent's state; none left: refused, nothing taken.
TEST(Scheduler, ForkCopiesState) {
  auto c = CacheStores::Create(SmallLayout(32, 8, 2));
  ASSERT_TRUE(c.ok());
  Scheduler sch(std::move(*c), {64, 8, true});
  SeqKv parent, child, third;
  parent.state_slot = sch.cache().states().Allocate();
  std::memcpy(sch.cache().states().Slot(parent.state_slot), "abcdefgh", 8);
  ASSERT_TRUE(sch.CopyState(parent, child));
  ASSERT_GE(child.state_slot, 0);
  EXPECT_NE(child.state_slot, parent.state_slot);
  EXPECT_EQ(std::memcmp(sch.cache().states().Slot(child.state_slot), "abcdefgh", 8), 0);
  EXPECT_FALSE(sch.CopyState(parent, third));
  EXPECT_EQ(third.state_slot, -1);
  SeqKv plain, plain_child;  // no state: nothing to copy
  EXPECT_TRUE(sch.CopyState(plain, plain_child));
  EXPECT_EQ(plain_child.state_slot, -1);
}

// State summarizes every computed token: cutting a context below what it computed drops its cache (it
// recomputes), while cutting only uncomputed tokens keeps it; without state, truncation keeps the blocks
// it can.
TEST(Scheduler, TruncateDropsStateOnlyWhenItMust) {
  auto c = CacheStores::Create(SmallLayout(32, 64, 2));
  ASSERT_TRUE(c.ok());
  Scheduler sch(std::move(*c), {64, 8, true});
  CachedTokens ctx;
  for (int i = 0; i < 10; ++i) ctx.tokens.push_back(i);
  ASSERT_TRUE(ReserveBlocks(ctx.kv, 8, 4, sch.pool()).ok());
  ctx.kv.n_tokens = 8;
  ctx.kv.state_slot = sch.cache().states().Allocate();
  sch.Truncate(ctx, 9);  // only an uncomputed token goes
  EXPECT_EQ(ctx.kv.n_tokens, 8);
  EXPECT_GE(ctx.kv.state_slot, 0);
  sch.Truncate(ctx, 6);
  EXPECT_EQ(ctx.tokens.size(), 6u);
  EXPECT_EQ(ctx.kv.n_tokens, 0);
  EXPECT_EQ(ctx.kv.state_slot, -1);
  EXPECT_TRUE(ctx.kv.blocks.empty());
  EXPECT_EQ(sch.cache().states().free_slots(), 2);
  EXPECT_EQ(sch.pool().used_blocks(), 0);

  auto c2 = CacheStores::Create(SmallLayout(32, 0, 0));
  ASSERT_TRUE(c2.ok());
  Scheduler plain(std::move(*c2), {64, 8, true});
  CachedTokens p2;
  for (int i = 0; i < 10; ++i) p2.tokens.push_back(i);
  ASSERT_TRUE(ReserveBlocks(p2.kv, 8, 4, plain.pool()).ok());
  p2.kv.n_tokens = 8;
  plain.Truncate(p2, 6);
  EXPECT_EQ(p2.kv.n_tokens, 6);
  EXPECT_EQ(p2.kv.blocks.size(), 2u);
}

}  // namespace
}  // namespace qkv
