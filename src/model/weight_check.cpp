#include "model/weight_check.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdio>
#include <limits>

#include "core/parallel.h"

namespace nucleus {

namespace {

// Scans p[0, count) for the first x whose flag(x) has its top bit set. Each
// flag is and / add / or arithmetic on the raw bits, so a block of kBlock
// elements is OR-reduced by a branch-free loop the compiler vectorizes; only
// a block that holds a bad element is searched element by element.
template <typename T, typename Flag>
int64_t first_flagged(const void* data, int64_t count, Flag flag) {
  constexpr int64_t kBlock = 4096;
  constexpr T kTop = static_cast<T>(T{1} << (8 * sizeof(T) - 1));
  const T* p = static_cast<const T*>(data);
  std::atomic<int64_t> first{std::numeric_limits<int64_t>::max()};
  parallel_for(count, int64_t{1} << 18, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += kBlock) {
      if (first.load(std::memory_order_relaxed) < b) return;  // an earlier chunk already found one
      const int64_t e = std::min(end, b + kBlock);
      T any = 0;
      for (int64_t i = b; i < e; ++i) any |= flag(p[i]);
      if (!(any & kTop)) continue;
      int64_t i = b;
      while (!(flag(p[i]) & kTop)) ++i;
      int64_t cur = first.load();
      while (i < cur && !first.compare_exchange_weak(cur, i)) {
      }
      return;
    }
  });
  const int64_t f = first.load();
  return f == std::numeric_limits<int64_t>::max() ? -1 : f;
}

}  // namespace

int64_t first_bad_value(const void* data, DType dtype, int64_t count, ValueCheck check) {
  if (count <= 0) return -1;
  // An exponent field of all ones (NaN or Inf) carries into the top bit when
  // its lowest bit is added: ((x & exp) + exp_lsb) & top.
  if (check == ValueCheck::kBlockScale) {
    // > 0 and 448 x scale (the largest e4m3 value dequantized) finite in f32:
    // bits in [1, kMaxScaleBits]; 0 wraps in x - 1, -0 and negatives have the
    // sign bit, anything above kMaxScaleBits (Inf and NaN included) wraps in
    // kMaxScaleBits - x.
    constexpr uint32_t kMaxScaleBits = 0x7b124924u;  // 7.59559e35, the largest s with 448 s < Inf
    static_assert(std::bit_cast<float>(kMaxScaleBits) <= std::numeric_limits<float>::max() / 448.0f &&
                  std::bit_cast<float>(kMaxScaleBits + 1) > std::numeric_limits<float>::max() / 448.0f);
    if (dtype == DType::kF32)
      return first_flagged<uint32_t>(data, count,
                                     [](uint32_t x) -> uint32_t { return x | (x - 1) | (kMaxScaleBits - x); });
    if (dtype == DType::kU8)  // E8M0 NaN: 0xff
      return first_flagged<uint8_t>(data, count, [](uint8_t x) -> uint8_t { return x == 0xff ? 0x80 : 0; });
    return -1;
  }
  switch (dtype) {
    case DType::kF32:
      return first_flagged<uint32_t>(data, count,
                                     [](uint32_t x) -> uint32_t { return (x & 0x7f800000u) + 0x00800000u; });
    case DType::kBF16:
      return first_flagged<uint16_t>(
          data, count, [](uint16_t x) -> uint16_t { return static_cast<uint16_t>((x & 0x7f80u) + 0x0080u); });
    case DType::kF16:
      return first_flagged<uint16_t>(
          data, count, [](uint16_t x) -> uint16_t { return static_cast<uint16_t>((x & 0x7c00u) + 0x0400u); });
    case DType::kF8E4M3:  // e4m3fn: no Inf; 0x7f and 0xff are NaN
      return first_flagged<uint8_t>(data, count,
                                    [](uint8_t x) -> uint8_t { return static_cast<uint8_t>((x & 0x7fu) + 1u); });
    default:
      return -1;
  }
}

std::string describe_value(const void* data, DType dtype, int64_t index) {
  float v = 0.0f;
  switch (dtype) {
    case DType::kF8E4M3:
    case DType::kU8: {
      char buf[8];
      std::snprintf(buf, sizeof buf, "0x%02x", static_cast<const uint8_t*>(data)[index]);
      return buf;
    }
    case DType::kF32: v = static_cast<const float*>(data)[index]; break;
    case DType::kBF16: v = bf16_to_f32(static_cast<const uint16_t*>(data)[index]); break;
    case DType::kF16: v = f16_to_f32(static_cast<const uint16_t*>(data)[index]); break;
    default: return "?";
  }
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
  return buf;
}

std::string index_to_string(const std::vector<int64_t>& shape, int64_t flat) {
  std::vector<int64_t> idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = shape[d] > 0 ? flat % shape[d] : 0;
    flat = shape[d] > 0 ? flat / shape[d] : 0;
  }
  std::string s = "[";
  for (size_t d = 0; d < idx.size(); ++d) s += (d ? ", " : "") + std::to_string(idx[d]);
  if (idx.empty()) s += std::to_string(flat);
  return s + "]";
}

Status check_tensor_values(const std::string& file, const std::string& name, const Tensor& t, ValueCheck check,
                           const std::vector<int64_t>& full_shape, ShardSplit split, int64_t begin) {
  const int64_t i = first_bad_value(t.raw(), t.dtype(), t.numel(), check);
  if (i < 0) return ok_status();
  int64_t full = i;  // the index in the full tensor
  if (split == ShardSplit::kRows) full = begin * full_shape[1] + i;
  if (split == ShardSplit::kCols) full = (i / t.dim(1)) * full_shape[1] + begin + i % t.dim(1);
  const std::string value = describe_value(t.raw(), t.dtype(), i);
  std::string what;
  if (check == ValueCheck::kBlockScale)
    what = (t.dtype() == DType::kU8 ? "the E8M0 NaN byte " + value : value) +
           " (an FP8 block scale must be > 0 with 448 x scale finite)";
  else
    what = t.dtype() == DType::kF8E4M3 ? "the F8_E4M3 NaN byte " + value : value;
  return data_loss(file + ": tensor '" + name + "' holds " + what + " at element " +
                   index_to_string(full_shape, full) +
                   "; the checkpoint is corrupt (--skip-weight-check loads it unchecked)");
}

}  // namespace nucleus
