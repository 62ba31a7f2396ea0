#include "model/tp_shard.h"

#include <cstring>
#include <vector>

#include "core/check.h"

namespace nucleus {

namespace {

// Sizes in [1, 8] (the GPUs of a host) for which `ok(n)` holds, as "1, 2, 4".
template <typename F>
std::string sizes_where(F ok) {
  std::string s;
  for (int n = 1; n <= 8; ++n)
    if (ok(n)) s += (s.empty() ? "" : ", ") + std::to_string(n);
  return s;
}

}  // namespace

StatusOr<std::pair<int64_t, int64_t>> shard_range(int64_t size, const TpShard& shard, const std::string& what) {
  NUCLEUS_CHECK(shard.world_size >= 1 && shard.rank >= 0 && shard.rank < shard.world_size, "bad shard {}/{}",
                shard.rank, shard.world_size);
  if (size % shard.world_size != 0)
    return invalid_argument(what + ": " + std::to_string(size) + " is not divisible by --tensor-parallel-size " +
                            std::to_string(shard.world_size));
  const int64_t part = size / shard.world_size;
  return std::make_pair(shard.rank * part, (shard.rank + 1) * part);
}

Tensor slice_host(const Tensor& t, ShardSplit split, int64_t begin, int64_t end) {
  if (split == ShardSplit::kReplicated) return t;
  NUCLEUS_CHECK(t.device() == Device::kCpu && t.rank() == 2, "slice_host of a {}-D {} tensor", t.rank(),
                device_name(t.device()));
  const int64_t rows = t.dim(0), cols = t.dim(1);
  const size_t elem = dtype_size(t.dtype());
  const auto* src = static_cast<const char*>(t.raw());
  if (split == ShardSplit::kRows) {
    NUCLEUS_CHECK(0 <= begin && begin <= end && end <= rows, "rows [{}, {}) of {}", begin, end, rows);
    Tensor out = Tensor::empty({end - begin, cols}, t.dtype());
    if (out.nbytes()) std::memcpy(out.raw(), src + begin * cols * elem, out.nbytes());
    return out;
  }
  NUCLEUS_CHECK(0 <= begin && begin <= end && end <= cols, "cols [{}, {}) of {}", begin, end, cols);
  const int64_t width = end - begin;
  Tensor out = Tensor::empty({rows, width}, t.dtype());
  auto* dst = static_cast<char*>(out.raw());
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(dst + r * width * elem, src + (r * cols + begin) * elem, width * elem);
  return out;
}

StatusOr<Tensor> slice_block_scale(const Tensor& scale, ShardSplit split, int64_t begin, int64_t end, int64_t size,
                                   int64_t block, int world_size, const std::string& name) {
  if (split == ShardSplit::kReplicated) return scale;
  NUCLEUS_CHECK(block > 0, "{}: block size {}", name, block);
  for (int64_t boundary : {begin, end}) {
    if (boundary % block == 0 || boundary == size) continue;
    const char* what = split == ShardSplit::kRows ? "rows" : "columns";
    return invalid_argument(
        name + ": --tensor-parallel-size " + std::to_string(world_size) + " splits its " + std::to_string(size) +
        " " + what + " at " + std::to_string(boundary) + ", inside a " + std::to_string(block) +
        "-wide block of its FP8 weight_scale_inv; FP8 block-scaled weights split only on block boundaries "
        "(tensor-parallel sizes whose shards are whole blocks here: " +
        sizes_where([&](int n) { return n == 1 || (size % n == 0 && (size / n) % block == 0); }) + ")");
  }
  const int64_t block_begin = begin / block, block_end = (end + block - 1) / block;
  return slice_host(scale, split, block_begin, block_end);
}

Status check_tp_config(const ModelConfig& c, int world_size) {
  if (world_size < 1) return invalid_argument("--tensor-parallel-size must be >= 1");
  struct Dim {
    const char* field;
    int64_t size;
  };
  std::vector<Dim> dims = {{"num_attention_heads", c.num_attention_heads}, {"vocab_size", c.vocab_size}};
  bool has_dense_layer = false;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) has_dense_layer |= !c.is_moe_layer(l);
  if (has_dense_layer) dims.push_back({"intermediate_size", c.intermediate_size});
  if (c.n_routed_experts > 0) {
    dims.push_back({"moe_intermediate_size", c.moe_intermediate_size});
    if (c.n_shared_experts > 0)
      dims.push_back({"moe_intermediate_size * n_shared_experts", c.moe_intermediate_size * c.n_shared_experts});
  }
  for (const Dim& d : dims) {
    if (d.size % world_size == 0) continue;
    const std::string ok = sizes_where([&](int n) {
      for (const Dim& e : dims)
        if (e.size % n != 0) return false;
      return true;
    });
    return invalid_argument(std::string(d.field) + " " + std::to_string(d.size) +
                            " is not divisible by --tensor-parallel-size " + std::to_string(world_size) +
                            " (sizes that divide every split dimension of this model: " + ok + ")");
  }
  return ok_status();
}

}  // namespace nucleus
