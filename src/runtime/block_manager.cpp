#include "runtime/block_manager.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "core/check.h"

namespace nucleus {

BlockManager::BlockManager(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching,
                           bool drop_last_hit_block)
    : block_size_(block_size),
      enable_prefix_caching_(enable_prefix_caching),
      drop_last_hit_block_(drop_last_hit_block),
      blocks_(num_blocks) {
  NUCLEUS_CHECK(num_blocks > 0 && block_size > 0, "num_blocks {} block_size {}", num_blocks, block_size);
  for (int32_t i = 0; i < num_blocks; ++i) {
    free_list_.push_back(i);
    blocks_[i].free_it = std::prev(free_list_.end());
    blocks_[i].in_free_list = true;
  }
}

uint64_t BlockManager::block_hash(uint64_t parent, const int32_t* tokens, int64_t count) {
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  XXH64_update(st, &parent, sizeof(parent));
  XXH64_update(st, tokens, static_cast<size_t>(count) * sizeof(int32_t));
  uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  return h;
}

void BlockManager::take_from_free_list(int32_t id) {
  Block& b = blocks_[id];
  NUCLEUS_CHECK(b.in_free_list, "block {} not free", id);
  free_list_.erase(b.free_it);
  b.in_free_list = false;
}

int32_t BlockManager::pop_free_block() {
  NUCLEUS_CHECK(!free_list_.empty(), "no free block");
  int32_t id = free_list_.front();
  take_from_free_list(id);
  Block& b = blocks_[id];
  if (b.has_hash) {  // evict: its contents are about to be overwritten
    auto it = cached_.find(b.hash);
    if (it != cached_.end() && it->second == id) cached_.erase(it);
    b.has_hash = false;
  }
  b.ref_count = 1;
  return id;
}

int64_t BlockManager::acquire_cached_prefix(Sequence& seq) {
  NUCLEUS_CHECK(seq.block_table.empty(), "sequence {} already holds blocks", seq.seq_id);
  seq.block_hashes.clear();
  seq.num_computed_tokens = 0;
  const int64_t n = seq.num_tokens();
  if (!enable_prefix_caching_) return 0;
  // A hit skips its positions' logits: a sequence still computing prompt
  // logprobs reuses only positions whose logprobs it has (none at first).
  int64_t reusable = n - 1;
  if (seq.needs_prompt_logprobs()) reusable = std::min<int64_t>(reusable, seq.prompt_logprobs.size());
  const int64_t max_blocks = reusable / block_size_;
  std::vector<int32_t> tokens(block_size_);
  uint64_t parent = 0;
  std::vector<std::pair<int32_t, uint64_t>> hits;  // (block, hash)
  for (int64_t b = 0; b < max_blocks; ++b) {
    for (int64_t i = 0; i < block_size_; ++i) tokens[i] = seq.token_at(b * block_size_ + i);
    uint64_t h = block_hash(parent, tokens.data(), block_size_);
    auto it = cached_.find(h);
    if (it == cached_.end()) break;
    hits.emplace_back(it->second, h);
    parent = h;
  }
  if (drop_last_hit_block_ && !hits.empty()) hits.pop_back();
  for (const auto& [id, h] : hits) {
    Block& blk = blocks_[id];
    if (blk.ref_count == 0) take_from_free_list(id);
    ++blk.ref_count;
    seq.block_table.push_back(id);
    seq.block_hashes.push_back(h);
  }
  seq.num_computed_tokens = static_cast<int64_t>(seq.block_table.size()) * block_size_;
  return seq.num_computed_tokens;
}

bool BlockManager::allocate_slots(Sequence& seq, int64_t num_tokens) {
  const int64_t need = blocks_for(num_tokens) - static_cast<int64_t>(seq.block_table.size());
  if (need <= 0) return true;
  if (need > num_free_blocks()) return false;
  for (int64_t i = 0; i < need; ++i) seq.block_table.push_back(pop_free_block());
  return true;
}

void BlockManager::cache_full_blocks(Sequence& seq) {
  if (!enable_prefix_caching_) return;
  const int64_t full = std::min<int64_t>(seq.num_computed_tokens / block_size_, seq.block_table.size());
  std::vector<int32_t> tokens(block_size_);
  for (int64_t b = static_cast<int64_t>(seq.block_hashes.size()); b < full; ++b) {
    for (int64_t i = 0; i < block_size_; ++i) tokens[i] = seq.token_at(b * block_size_ + i);
    uint64_t parent = b == 0 ? 0 : seq.block_hashes[b - 1];
    uint64_t h = block_hash(parent, tokens.data(), block_size_);
    seq.block_hashes.push_back(h);
    Block& blk = blocks_[seq.block_table[b]];
    if (blk.has_hash) continue;      // already cached (a prefix hit)
    if (cached_.count(h)) continue;  // same content cached in another block: keep that one
    blk.has_hash = true;
    blk.hash = h;
    cached_[h] = seq.block_table[b];
  }
}

void BlockManager::free(Sequence& seq) {
  for (auto it = seq.block_table.rbegin(); it != seq.block_table.rend(); ++it) {
    Block& b = blocks_[*it];
    NUCLEUS_CHECK(b.ref_count > 0, "block {} freed with reference count {}", *it, b.ref_count);
    if (--b.ref_count > 0) continue;
    if (b.has_hash) {
      free_list_.push_back(*it);
      b.free_it = std::prev(free_list_.end());
    } else {
      free_list_.push_front(*it);
      b.free_it = free_list_.begin();
    }
    b.in_free_list = true;
  }
  seq.block_table.clear();
  seq.block_hashes.clear();
  seq.num_computed_tokens = 0;
}

bool BlockManager::check_invariants(const std::vector<const Sequence*>& live) const {
  std::vector<int32_t> refs(blocks_.size(), 0);
  for (const Sequence* s : live)
    for (int32_t id : s->block_table) ++refs[id];
  int64_t free_count = 0;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    if (refs[i] != blocks_[i].ref_count) return false;
    if ((blocks_[i].ref_count == 0) != blocks_[i].in_free_list) return false;
    free_count += blocks_[i].in_free_list;
  }
  if (free_count != num_free_blocks()) return false;
  for (const auto& [h, id] : cached_)
    if (!blocks_[id].has_hash || blocks_[id].hash != h) return false;
  return true;
}

}  // namespace nucleus
