// BlockManager: the paged KV cache's blocks — free list, reference counts and
// the prefix cache.
//
// Prefix cache: a full block (block_size tokens, all computed) is keyed by
// the chained hash h_i = xxh64(h_{i-1} || token ids of block i), h_{-1} = 0,
// so a key identifies the whole prefix up to and including the block. A
// sequence admitted later whose leading blocks hash the same reuses them
// (reference count + 1) instead of recomputing. A block whose reference count
// drops to 0 keeps its contents and key and goes to the tail of the free
// list; allocation takes from the head, so cached blocks are evicted least
// recently freed first. Blocks without a key go to the head (nothing of
// value is lost by reusing them first). A sequence's blocks are freed last
// block first, so a prefix outlives its tails.
#pragma once

#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

#include "runtime/sequence.h"

namespace nucleus {

class BlockManager {
 public:
  // drop_last_hit_block (speculative decoding with MTP): a prefix-cache hit
  // gives back its last matched block, which is recomputed. The MTP cache's
  // row at a block's last position depends on the next block's first token
  // (its input is t_{i+1}), which only the following matched block vouches
  // for (vLLM drops the last hit block for EAGLE / MTP alike).
  BlockManager(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching, bool drop_last_hit_block = false);

  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  // Blocks with reference count 0 (cached or not): what can be allocated.
  int64_t num_free_blocks() const { return static_cast<int64_t>(free_list_.size()); }
  int64_t num_used_blocks() const { return num_blocks() - num_free_blocks(); }
  // Blocks needed to hold `num_tokens` tokens.
  int64_t blocks_for(int64_t num_tokens) const { return (num_tokens + block_size_ - 1) / block_size_; }

  // For a sequence that holds no blocks: takes the longest run of its
  // leading full blocks found in the prefix cache (at most num_tokens - 1
  // tokens, so the last token is always computed and yields logits; while
  // the sequence still computes prompt logprobs, none past those it has:
  // vLLM likewise skips the prefix cache for prompt_logprobs), sets
  // block_table, block_hashes and num_computed_tokens, and returns the
  // number of tokens reused.
  int64_t acquire_cached_prefix(Sequence& seq);

  // Grows seq's block table to hold `num_tokens` tokens. Returns false, and
  // allocates nothing, when too few blocks are free.
  bool allocate_slots(Sequence& seq, int64_t num_tokens);

  // Enters seq's blocks that are now full and computed into the prefix cache.
  void cache_full_blocks(Sequence& seq);

  // Releases every block of seq (last first) and clears its table.
  void free(Sequence& seq);

  // Counts one admission's prefix-cache lookup (query tokens, hit tokens);
  // the scheduler calls it once a sequence is admitted, so retries of an
  // admission that failed for lack of blocks are not counted twice.
  void record_prefix_lookup(int64_t query_tokens, int64_t hit_tokens) {
    prefix_query_tokens_ += query_tokens;
    prefix_hit_tokens_ += hit_tokens;
  }
  // Prefix-cache statistics over admissions.
  int64_t prefix_query_tokens() const { return prefix_query_tokens_; }
  int64_t prefix_hit_tokens() const { return prefix_hit_tokens_; }

  // Checks the invariants (reference counts match the tables of `live`
  // sequences, the free list holds exactly the unreferenced blocks, the hash
  // map points at blocks with that hash). For tests.
  bool check_invariants(const std::vector<const Sequence*>& live) const;

  // Hash of a block of tokens given its parent's hash.
  static uint64_t block_hash(uint64_t parent, const int32_t* tokens, int64_t count);

 private:
  struct Block {
    int32_t ref_count = 0;
    bool has_hash = false;
    uint64_t hash = 0;
    std::list<int32_t>::iterator free_it;
    bool in_free_list = false;
  };

  int32_t pop_free_block();
  void take_from_free_list(int32_t id);

  int64_t block_size_;
  bool enable_prefix_caching_;
  bool drop_last_hit_block_;
  std::vector<Block> blocks_;
  std::list<int32_t> free_list_;  // head: next to allocate
  std::unordered_map<uint64_t, int32_t> cached_;
  int64_t prefix_query_tokens_ = 0;
  int64_t prefix_hit_tokens_ = 0;
};

}  // namespace nucleus
