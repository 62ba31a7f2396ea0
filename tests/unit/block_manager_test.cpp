// BlockManager: the chained block hash, prefix-cache hits and misses, the
// eviction order of the free list, reference counts of shared blocks, and a
// randomized run checked against the invariants and a shadow of block contents.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "runtime/block_manager.h"

namespace nucleus {
namespace {

constexpr int64_t kBs = 4;  // block size of most tests

std::vector<int32_t> iota_tokens(int64_t n, int32_t first) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = first + static_cast<int32_t>(i);
  return t;
}

Sequence make_seq(int64_t id, std::vector<int32_t> prompt) {
  Sequence s;
  s.seq_id = id;
  s.prompt_token_ids = std::move(prompt);
  return s;
}

// Admits seq as the scheduler does (prefix hits, then slots for all its
// tokens), marks every token computed and caches its full blocks.
void compute_all(BlockManager& bm, Sequence& seq) {
  const int64_t hit = bm.acquire_cached_prefix(seq);
  ASSERT_TRUE(bm.allocate_slots(seq, seq.num_tokens()));
  bm.record_prefix_lookup(seq.num_tokens(), hit);
  seq.num_computed_tokens = seq.num_tokens();
  bm.cache_full_blocks(seq);
}

std::vector<int32_t> first_blocks(const Sequence& s, size_t n) {
  return {s.block_table.begin(), s.block_table.begin() + static_cast<std::ptrdiff_t>(n)};
}

TEST(BlockManagerTest, HashChain) {
  const std::vector<int32_t> a = {1, 2, 3, 4};
  const std::vector<int32_t> b = {1, 2, 3, 5};
  const std::vector<int32_t> c = {0, 2, 3, 4};
  const uint64_t ha = BlockManager::block_hash(0, a.data(), 4);
  EXPECT_EQ(ha, BlockManager::block_hash(0, a.data(), 4));  // deterministic
  EXPECT_NE(ha, BlockManager::block_hash(0, b.data(), 4));  // last token differs
  EXPECT_NE(ha, BlockManager::block_hash(0, c.data(), 4));  // first token differs
  EXPECT_NE(ha, BlockManager::block_hash(1, a.data(), 4));  // parent differs
  EXPECT_NE(ha, BlockManager::block_hash(0, a.data(), 3));  // count differs

  // Same tokens in block 1 after a different block 0 -> different key.
  auto chain = [](const std::vector<int32_t>& t) {
    std::vector<uint64_t> h;
    uint64_t parent = 0;
    for (size_t i = 0; i + 4 <= t.size(); i += 4) {
      parent = BlockManager::block_hash(parent, t.data() + i, 4);
      h.push_back(parent);
    }
    return h;
  };
  const auto x = chain({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  const auto y = chain({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  const auto z = chain({1, 2, 3, 0, 5, 6, 7, 8, 9, 10, 11, 12});
  const auto w = chain({1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12});
  EXPECT_EQ(x, y);
  ASSERT_EQ(x.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_NE(x[i], z[i]) << i;  // divergence propagates down the chain
  EXPECT_EQ(x[0], w[0]);
  EXPECT_NE(x[1], w[1]);
  EXPECT_NE(x[2], w[2]);
}

TEST(BlockManagerTest, FullPrefixHitReusesSameBlocks) {
  BlockManager bm(16, kBs, true);
  Sequence a = make_seq(1, iota_tokens(10, 100));  // 2 full blocks + 2 tokens
  compute_all(bm, a);
  const std::vector<int32_t> a_blocks = first_blocks(a, 2);
  bm.free(a);
  EXPECT_TRUE(bm.check_invariants({}));
  EXPECT_EQ(bm.num_free_blocks(), 16);

  Sequence b = make_seq(2, iota_tokens(10, 100));
  EXPECT_EQ(bm.acquire_cached_prefix(b), 8);
  bm.record_prefix_lookup(b.num_tokens(), 8);  // the scheduler records an admitted lookup
  EXPECT_EQ(b.num_computed_tokens, 8);
  EXPECT_EQ(b.block_table, a_blocks);
  EXPECT_EQ(b.block_hashes.size(), 2u);
  EXPECT_EQ(bm.num_free_blocks(), 14);
  EXPECT_TRUE(bm.check_invariants({&b}));
  ASSERT_TRUE(bm.allocate_slots(b, b.num_tokens()));
  EXPECT_EQ(b.block_table.size(), 3u);
  EXPECT_EQ(bm.prefix_query_tokens(), 20);
  EXPECT_EQ(bm.prefix_hit_tokens(), 8);

  // Output tokens are part of the cached prefix too.
  Sequence c = make_seq(3, iota_tokens(6, 100));
  c.output_token_ids = {106, 107, 108, 109, 110};
  b.output_token_ids.clear();
  bm.free(b);
  EXPECT_EQ(bm.acquire_cached_prefix(c), 8);
  EXPECT_EQ(c.block_table, a_blocks);
  bm.free(c);
  EXPECT_TRUE(bm.check_invariants({}));
}

TEST(BlockManagerTest, DivergenceInsideBlockTwoHitsOnlyBlockOne) {
  BlockManager bm(16, kBs, true);
  Sequence a = make_seq(1, iota_tokens(12, 100));
  compute_all(bm, a);
  const std::vector<int32_t> a_blocks = a.block_table;
  bm.free(a);

  std::vector<int32_t> p = iota_tokens(12, 100);
  p[6] = 7;  // inside block 1 (0-based)
  Sequence b = make_seq(2, p);
  EXPECT_EQ(bm.acquire_cached_prefix(b), 4);
  EXPECT_EQ(b.block_table, std::vector<int32_t>{a_blocks[0]});

  // Diverging in block 0 hits nothing, even though later blocks match token-wise.
  std::vector<int32_t> q = iota_tokens(12, 100);
  q[0] = 7;
  Sequence c = make_seq(3, q);
  EXPECT_EQ(bm.acquire_cached_prefix(c), 0);
  EXPECT_TRUE(c.block_table.empty());
  EXPECT_TRUE(bm.check_invariants({&b, &c}));
  bm.free(b);
  bm.free(c);
  EXPECT_EQ(bm.num_free_blocks(), 16);
}

TEST(BlockManagerTest, LastTokenIsNeverServedFromCache) {
  BlockManager bm(16, kBs, true);
  Sequence a = make_seq(1, iota_tokens(8, 100));  // exactly 2 full blocks
  compute_all(bm, a);
  bm.free(a);
  Sequence b = make_seq(2, iota_tokens(8, 100));
  EXPECT_EQ(bm.acquire_cached_prefix(b), 4);  // block 1 would cover the last token
  EXPECT_EQ(b.block_table.size(), 1u);
  bm.free(b);

  // A prompt of one more token gets both blocks.
  Sequence c = make_seq(3, iota_tokens(9, 100));
  EXPECT_EQ(bm.acquire_cached_prefix(c), 8);
  bm.free(c);

  // A one-token prompt never hits.
  Sequence d = make_seq(4, iota_tokens(1, 100));
  EXPECT_EQ(bm.acquire_cached_prefix(d), 0);
  EXPECT_TRUE(bm.check_invariants({}));
}

TEST(BlockManagerTest, PrefixCachingDisabledNeverHits) {
  BlockManager bm(16, kBs, false);
  Sequence a = make_seq(1, iota_tokens(12, 100));
  compute_all(bm, a);
  EXPECT_TRUE(a.block_hashes.empty());
  bm.free(a);
  Sequence b = make_seq(2, iota_tokens(12, 100));
  EXPECT_EQ(bm.acquire_cached_prefix(b), 0);
  bm.record_prefix_lookup(b.num_tokens(), 0);
  EXPECT_TRUE(b.block_table.empty());
  EXPECT_EQ(bm.prefix_hit_tokens(), 0);
  EXPECT_EQ(bm.prefix_query_tokens(), 24);
  EXPECT_TRUE(bm.check_invariants({}));
}

TEST(BlockManagerTest, UncomputedBlocksAreNotCached) {
  BlockManager bm(16, kBs, true);
  Sequence a = make_seq(1, iota_tokens(12, 100));
  ASSERT_TRUE(bm.allocate_slots(a, 12));
  a.num_computed_tokens = 7;  // block 0 full, block 1 partly computed
  bm.cache_full_blocks(a);
  EXPECT_EQ(a.block_hashes.size(), 1u);
  bm.free(a);
  Sequence b = make_seq(2, iota_tokens(12, 100));
  EXPECT_EQ(bm.acquire_cached_prefix(b), 4);
  bm.free(b);
}

TEST(BlockManagerTest, EvictionOrder) {
  BlockManager bm(8, kBs, true);
  Sequence a = make_seq(1, iota_tokens(10, 100));  // blocks 0,1 cached, 2 partial
  Sequence b = make_seq(2, iota_tokens(10, 200));  // blocks 3,4 cached, 5 partial
  compute_all(bm, a);
  compute_all(bm, b);
  ASSERT_EQ(a.block_table, (std::vector<int32_t>{0, 1, 2}));
  ASSERT_EQ(b.block_table, (std::vector<int32_t>{3, 4, 5}));
  bm.free(a);  // a freed before b: a's cached blocks are older
  bm.free(b);
  EXPECT_TRUE(bm.check_invariants({}));

  // Unhashed blocks first (the partial tails, most recently freed first, then
  // the never-used blocks); no cached block is touched.
  Sequence c = make_seq(3, iota_tokens(16, 300));
  ASSERT_TRUE(bm.allocate_slots(c, 16));
  EXPECT_EQ(c.block_table, (std::vector<int32_t>{5, 2, 6, 7}));
  {
    // Both prefixes still hit; re-freeing a before b restores the order.
    Sequence pa = make_seq(10, iota_tokens(10, 100));
    Sequence pb = make_seq(11, iota_tokens(10, 200));
    EXPECT_EQ(bm.acquire_cached_prefix(pa), 8);
    EXPECT_EQ(bm.acquire_cached_prefix(pb), 8);
    EXPECT_EQ(bm.num_free_blocks(), 0);
    bm.free(pa);
    bm.free(pb);
  }
  EXPECT_TRUE(bm.check_invariants({&c}));

  // Then cached blocks, least recently freed first; within a sequence the
  // tail block goes before the prefix block.
  Sequence d = make_seq(4, iota_tokens(4, 400));
  ASSERT_TRUE(bm.allocate_slots(d, 4));
  EXPECT_EQ(d.block_table, (std::vector<int32_t>{1}));  // a's block 1 evicted
  {
    Sequence pa = make_seq(12, iota_tokens(10, 100));
    EXPECT_EQ(bm.acquire_cached_prefix(pa), 4);  // only a's block 0 still hits
    EXPECT_EQ(pa.block_table, (std::vector<int32_t>{0}));
    bm.free(pa);  // block 0 becomes the most recently freed
  }
  Sequence e = make_seq(5, iota_tokens(8, 500));
  ASSERT_TRUE(bm.allocate_slots(e, 8));
  EXPECT_EQ(e.block_table, (std::vector<int32_t>{4, 3}));  // b's blocks, tail first
  {
    Sequence pb = make_seq(13, iota_tokens(10, 200));
    EXPECT_EQ(bm.acquire_cached_prefix(pb), 0);  // b evicted entirely
    Sequence pa = make_seq(14, iota_tokens(10, 100));
    EXPECT_EQ(bm.acquire_cached_prefix(pa), 4);  // a's block 0 survived
    bm.free(pa);
  }
  EXPECT_EQ(bm.num_free_blocks(), 1);
  EXPECT_TRUE(bm.check_invariants({&c, &d, &e}));
  bm.free(c);
  bm.free(d);
  bm.free(e);
  EXPECT_EQ(bm.num_free_blocks(), 8);
  EXPECT_TRUE(bm.check_invariants({}));
}

TEST(BlockManagerTest, SharedPrefixReferenceCounts) {
  BlockManager bm(8, kBs, true);
  Sequence a = make_seq(1, iota_tokens(10, 100));
  compute_all(bm, a);  // 3 blocks, 2 cached
  EXPECT_EQ(bm.num_free_blocks(), 5);
  EXPECT_TRUE(bm.check_invariants({&a}));

  Sequence b = make_seq(2, iota_tokens(10, 100));
  EXPECT_EQ(bm.acquire_cached_prefix(b), 8);
  bm.record_prefix_lookup(b.num_tokens(), 8);  // the scheduler records an admitted lookup
  EXPECT_EQ(first_blocks(b, 2), first_blocks(a, 2));
  EXPECT_EQ(bm.num_free_blocks(), 5);  // hits on referenced blocks take nothing from the free list
  ASSERT_TRUE(bm.allocate_slots(b, 10));
  EXPECT_EQ(bm.num_free_blocks(), 4);
  EXPECT_NE(b.block_table[2], a.block_table[2]);
  // Reference counts match exactly the two tables: shared blocks count 2.
  EXPECT_TRUE(bm.check_invariants({&a, &b}));
  EXPECT_FALSE(bm.check_invariants({&a}));
  EXPECT_FALSE(bm.check_invariants({&b}));

  // Freeing a returns only its private tail block.
  bm.free(a);
  EXPECT_EQ(bm.num_free_blocks(), 5);
  EXPECT_TRUE(bm.check_invariants({&b}));

  // Another sharer joins b, then b leaves: the prefix stays referenced.
  Sequence c = make_seq(3, iota_tokens(9, 100));
  EXPECT_EQ(bm.acquire_cached_prefix(c), 8);
  EXPECT_TRUE(bm.check_invariants({&b, &c}));
  bm.free(b);
  EXPECT_EQ(bm.num_free_blocks(), 6);
  EXPECT_TRUE(bm.check_invariants({&c}));
  bm.free(c);
  EXPECT_EQ(bm.num_free_blocks(), 8);
  EXPECT_TRUE(bm.check_invariants({}));
}

TEST(BlockManagerTest, AllocateSlotsFailsAtomically) {
  BlockManager bm(4, kBs, true);
  Sequence a = make_seq(1, iota_tokens(12, 100));
  ASSERT_TRUE(bm.allocate_slots(a, 12));  // 3 blocks
  EXPECT_EQ(bm.num_free_blocks(), 1);

  Sequence b = make_seq(2, iota_tokens(8, 200));
  EXPECT_FALSE(bm.allocate_slots(b, 8));  // needs 2, 1 free
  EXPECT_TRUE(b.block_table.empty());
  EXPECT_EQ(bm.num_free_blocks(), 1);

  EXPECT_FALSE(bm.allocate_slots(a, 20));  // grow by 2, 1 free
  EXPECT_EQ(a.block_table.size(), 3u);
  EXPECT_EQ(bm.num_free_blocks(), 1);
  EXPECT_TRUE(bm.check_invariants({&a, &b}));

  EXPECT_TRUE(bm.allocate_slots(a, 12));  // already held: no-op
  EXPECT_TRUE(bm.allocate_slots(a, 5));   // fewer than held: no-op
  EXPECT_EQ(a.block_table.size(), 3u);
  EXPECT_TRUE(bm.allocate_slots(a, 16));  // exactly the last block
  EXPECT_EQ(bm.num_free_blocks(), 0);
  EXPECT_FALSE(bm.allocate_slots(b, 1));
  EXPECT_TRUE(bm.check_invariants({&a, &b}));
  bm.free(a);
  EXPECT_EQ(bm.num_free_blocks(), 4);
}

// Random operations on a small pool with prefixes that collide often. A
// shadow of every block's contents (written when tokens are "computed")
// checks that a prefix hit only ever serves a block holding exactly the
// requested tokens, and that no block is written while another live sequence
// holds it.
TEST(BlockManagerTest, RandomizedInvariants) {
  constexpr int64_t kBlocks = 48;
  constexpr int64_t kBlockSize = 4;
  constexpr int kOps = 10000;
  BlockManager bm(kBlocks, kBlockSize, true);
  std::mt19937 rng(1234);
  auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };

  // A few shared stems so prompts share prefixes; tails from a 3-token alphabet.
  std::vector<std::vector<int32_t>> stems;
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t> s;
    for (int j = 0; j < 24; ++j) s.push_back(static_cast<int32_t>(uniform(0, 2)));
    stems.push_back(s);
  }

  std::vector<std::vector<int32_t>> shadow(kBlocks, std::vector<int32_t>(kBlockSize, -1));
  std::vector<std::unique_ptr<Sequence>> live;
  int64_t next_id = 1, hits = 0, hit_tokens = 0, alloc_failures = 0;

  auto live_ptrs = [&] {
    std::vector<const Sequence*> v;
    for (const auto& s : live) v.push_back(s.get());
    return v;
  };
  auto held_by_other = [&](int32_t block, const Sequence* self) {
    for (const auto& s : live)
      if (s.get() != self && std::count(s->block_table.begin(), s->block_table.end(), block)) return true;
    return false;
  };
  // Grows seq's table to num_tokens; new blocks get an empty shadow.
  auto allocate = [&](Sequence& s, int64_t num_tokens) {
    const size_t before = s.block_table.size();
    if (!bm.allocate_slots(s, num_tokens)) {
      EXPECT_EQ(s.block_table.size(), before);
      ++alloc_failures;
      return false;
    }
    for (size_t i = before; i < s.block_table.size(); ++i) {
      EXPECT_FALSE(held_by_other(s.block_table[i], &s)) << "block " << s.block_table[i] << " handed out twice";
      std::fill(shadow[s.block_table[i]].begin(), shadow[s.block_table[i]].end(), -1);
    }
    return true;
  };
  // Admits s (prefix hits checked against the shadow) and allocates all its tokens.
  auto admit = [&](Sequence& s) {
    const int64_t hit = bm.acquire_cached_prefix(s);
    EXPECT_EQ(hit % kBlockSize, 0);
    EXPECT_LE(hit, s.num_tokens() - 1);
    EXPECT_EQ(s.num_computed_tokens, hit);
    EXPECT_EQ(static_cast<int64_t>(s.block_table.size()), hit / kBlockSize);
    EXPECT_EQ(s.block_hashes.size(), s.block_table.size());
    for (int64_t t = 0; t < hit; ++t)
      EXPECT_EQ(shadow[s.block_table[t / kBlockSize]][t % kBlockSize], s.token_at(t))
          << "seq " << s.seq_id << " token " << t << " served from block " << s.block_table[t / kBlockSize];
    if (hit > 0) ++hits;
    if (!allocate(s, s.num_tokens())) {
      bm.free(s);  // as the scheduler does on a failed admission (and records nothing)
      return false;
    }
    bm.record_prefix_lookup(s.num_tokens(), hit);
    hit_tokens += hit;
    return true;
  };

  for (int op = 0; op < kOps; ++op) {
    const int64_t kind = live.empty() ? 0 : uniform(0, 9);
    if (kind <= 2) {  // add
      if (live.size() >= 8) continue;
      auto s = std::make_unique<Sequence>();
      s->seq_id = next_id++;
      const auto& stem = stems[static_cast<size_t>(uniform(0, 2))];
      const int64_t keep = uniform(0, 24);
      s->prompt_token_ids.assign(stem.begin(), stem.begin() + keep);
      const int64_t tail = uniform(keep == 0 ? 1 : 0, 8);
      for (int64_t i = 0; i < tail; ++i) s->prompt_token_ids.push_back(static_cast<int32_t>(uniform(0, 2)));
      if (admit(*s)) live.push_back(std::move(s));
    } else {
      Sequence& s = *live[static_cast<size_t>(uniform(0, static_cast<int64_t>(live.size()) - 1))];
      if (kind <= 4) {  // grow: append outputs and make room for them
        const int64_t k = uniform(1, 6);
        const size_t before = s.output_token_ids.size();
        for (int64_t i = 0; i < k; ++i) s.output_token_ids.push_back(static_cast<int32_t>(uniform(0, 2)));
        if (!allocate(s, s.num_tokens())) s.output_token_ids.resize(before);
      } else if (kind <= 7) {  // compute some tokens, cache full blocks
        const int64_t to = std::min(s.num_tokens(), s.num_computed_tokens + uniform(1, 8));
        for (int64_t t = s.num_computed_tokens; t < to; ++t) {
          const int32_t block = s.block_table[t / kBlockSize];
          EXPECT_FALSE(held_by_other(block, &s)) << "writing block " << block << " shared with another sequence";
          shadow[block][t % kBlockSize] = s.token_at(t);
        }
        s.num_computed_tokens = to;
        bm.cache_full_blocks(s);
        EXPECT_EQ(static_cast<int64_t>(s.block_hashes.size()), s.num_computed_tokens / kBlockSize);
      } else if (kind == 8) {  // preempt and readmit (recompute from the cache)
        Sequence* p = &s;
        bm.free(*p);
        EXPECT_TRUE(p->block_table.empty());
        EXPECT_TRUE(bm.check_invariants(live_ptrs())) << "op " << op;
        if (!admit(*p)) {
          auto it = std::find_if(live.begin(), live.end(), [&](const auto& q) { return q.get() == p; });
          live.erase(it);
        }
      } else {  // finish
        Sequence* p = &s;
        bm.free(*p);
        auto it = std::find_if(live.begin(), live.end(), [&](const auto& q) { return q.get() == p; });
        live.erase(it);
      }
    }
    ASSERT_TRUE(bm.check_invariants(live_ptrs())) << "op " << op;
    int64_t held = 0;
    std::vector<bool> seen(kBlocks, false);
    for (const auto& s : live)
      for (int32_t id : s->block_table)
        if (!seen[id]) seen[id] = true, ++held;
    ASSERT_EQ(bm.num_used_blocks(), held) << "op " << op;
  }

  // The run exercised what it is meant to.
  EXPECT_GT(hits, 100);
  EXPECT_GT(alloc_failures, 10);
  EXPECT_EQ(bm.prefix_hit_tokens(), hit_tokens);

  while (!live.empty()) {
    bm.free(*live.back());
    live.pop_back();
    ASSERT_TRUE(bm.check_invariants(live_ptrs()));
  }
  EXPECT_EQ(bm.num_free_blocks(), bm.num_blocks());
}

}  // namespace
}  // namespace nucleus
