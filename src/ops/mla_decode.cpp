#include "ops/mla_decode.h"

#include <algorithm>
#include <cctype>
#include <optional>
#include <string>
#include <vector>

#include "core/knobs.h"

#ifdef NUCLEUS_HAVE_CUDA
#include "ops/mla_decode_cuda.h"
#endif

namespace nucleus {

namespace {

constexpr int64_t kSmallRowsMax = 8;  // kernels::kMlaDecodeSmallRows (the kernel header is CUDA-only)
constexpr int64_t kSplitKeysTile = 32;   // kernels::kMlaDecodeTileKeys
constexpr int64_t kWgmmaHeads = 64;      // kernels::kMlaDecodeWgmmaHeads
constexpr int64_t kSplitsOnDevice = 0;     // kernels::kMlaDecodeSplitsAuto
constexpr int64_t kSplitKeysMost = 1024;

// NUCLEUS_MLA_DECODE_SPLIT_KEYS: 0 for auto (unset, empty, "auto"), N for a
// valid count, -1 for anything else.
int64_t split_keys_switch() {
  const std::optional<std::string> s = env_string(Knob::kMlaDecodeSplitKeys);
  if (!s || s->empty() || *s == "auto" || *s == "AUTO") return 0;
  if (s->size() > 4 || s->find_first_not_of("0123456789") != std::string::npos) return -1;
  const int64_t n = std::stoll(*s);
  return n >= kSplitKeysTile && n <= kSplitKeysMost && n % kSplitKeysTile == 0 ? n : -1;
}

}  // namespace

int64_t mla_decode_small_rows_auto(int64_t num_heads, bool fp8_kv_b) {
  return fp8_kv_b || num_heads <= 16 ? kSmallRowsMax : 4;
}

int64_t mla_decode_small_rows(int64_t num_heads, bool fp8_kv_b) {
  switch (env_auto_switch(Knob::kMlaDecodeSmallGemms).value_or(AutoSwitch::kAuto)) {
    case AutoSwitch::kOff: return 0;
    case AutoSwitch::kOn: return kSmallRowsMax;
    case AutoSwitch::kAuto: break;
  }
  return mla_decode_small_rows_auto(num_heads, fp8_kv_b);
}

int64_t mla_decode_min_split_keys_auto(int64_t /*num_rows*/, int64_t /*num_heads*/) { return kSplitsOnDevice; }

int64_t mla_decode_min_split_keys(int64_t num_rows, int64_t num_heads) {
  const int64_t n = split_keys_switch();
  return n > 0 ? n : mla_decode_min_split_keys_auto(num_rows, num_heads);
}

namespace {

// A switch that takes auto or one of two numbers: 0 for auto (unset, empty,
// "auto" in any case), the number when it is `a` or `b`, -1 for anything else.
int two_value_switch(Knob knob, int a, int b) {
  std::optional<std::string> s = env_string(knob);
  if (s) std::transform(s->begin(), s->end(), s->begin(), [](unsigned char c) { return std::tolower(c); });
  if (!s || s->empty() || *s == "auto") return 0;
  if (*s == std::to_string(a)) return a;
  if (*s == std::to_string(b)) return b;
  return -1;
}

// NUCLEUS_MLA_DECODE_CTAS_PER_SM: 0 for auto, 1 or 2, -1 for anything else.
int ctas_per_sm_switch() { return two_value_switch(Knob::kMlaDecodeCtasPerSm, 1, 2); }

// NUCLEUS_MLA_DECODE_KEY_TILE: 0 for auto, 32 or 64, -1 for anything else.
int key_tile_switch() { return two_value_switch(Knob::kMlaDecodeKeyTile, 32, 64); }

}  // namespace

int mla_decode_ctas_per_sm_auto(int64_t /*num_rows*/, int64_t /*num_heads*/) { return 1; }

int mla_decode_ctas_per_sm(int64_t num_rows, int64_t num_heads) {
  if (num_heads > 16) return 1;
  const int n = ctas_per_sm_switch();
  return n > 0 ? n : mla_decode_ctas_per_sm_auto(num_rows, num_heads);
}

int mla_decode_key_tile_auto(int64_t /*num_rows*/, int64_t num_heads) { return num_heads <= 16 ? 64 : 32; }

int mla_decode_key_tile(int64_t num_rows, int64_t num_heads) {
  if (num_heads > 16 || mla_decode_ctas_per_sm(num_rows, num_heads) != 1) return 32;
  const int n = key_tile_switch();
  return n > 0 ? n : mla_decode_key_tile_auto(num_rows, num_heads);
}

bool mla_decode_bulk_loads_auto(int64_t num_rows, int64_t /*num_heads*/, KvCacheDtype cache) {
  return cache != KvCacheDtype::kFp8E4M3 || num_rows >= kMlaDecodeBulkLoadsE4m3MinRows;
}

bool mla_decode_bulk_loads(int64_t num_rows, int64_t num_heads, KvCacheDtype cache) {
  switch (env_auto_switch(Knob::kMlaDecodeBulkLoads).value_or(AutoSwitch::kAuto)) {
    case AutoSwitch::kOff: return false;
    case AutoSwitch::kOn: return true;
    case AutoSwitch::kAuto: break;
  }
  return mla_decode_bulk_loads_auto(num_rows, num_heads, cache);
}

bool mla_decode_fp8_register_convert_auto(int64_t num_rows, KvCacheDtype cache) {
  return cache == KvCacheDtype::kFp8E4M3 || (cache == KvCacheDtype::kFp8DsMla && num_rows >= 64);
}

bool mla_decode_fp8_register_convert(int64_t num_rows, KvCacheDtype cache) {
  if (cache != KvCacheDtype::kFp8E4M3 && cache != KvCacheDtype::kFp8DsMla) return false;
  switch (env_auto_switch(Knob::kMlaDecodeFp8RegisterConvert).value_or(AutoSwitch::kAuto)) {
    case AutoSwitch::kOff: return false;
    case AutoSwitch::kOn: return true;
    case AutoSwitch::kAuto: break;
  }
  return mla_decode_fp8_register_convert_auto(num_rows, cache);
}

bool mla_decode_wgmma_applies(int64_t num_heads, KvCacheDtype cache) {
  return num_heads > 0 && num_heads % kWgmmaHeads == 0 &&
         (cache == KvCacheDtype::kBF16 || cache == KvCacheDtype::kFp8E4M3 || cache == KvCacheDtype::kFp8DsMla);
}

bool mla_decode_wgmma_auto(int64_t /*num_rows*/, int64_t num_heads, KvCacheDtype cache) {
  return mla_decode_wgmma_applies(num_heads, cache);
}

bool mla_decode_wgmma(int64_t num_rows, int64_t num_heads, KvCacheDtype cache) {
  if (!mla_decode_wgmma_applies(num_heads, cache)) return false;
  switch (env_auto_switch(Knob::kMlaDecodeWgmma).value_or(AutoSwitch::kAuto)) {
    case AutoSwitch::kOff: return false;
    case AutoSwitch::kOn: return true;
    case AutoSwitch::kAuto: break;
  }
  return mla_decode_wgmma_auto(num_rows, num_heads, cache);
}

Status mla_decode_env_status() {
  if (!env_auto_switch(Knob::kMlaDecodeSmallGemms))
    return invalid_argument("NUCLEUS_MLA_DECODE_SMALL_GEMMS='" + *env_string(Knob::kMlaDecodeSmallGemms) +
                            "' is not auto, 0 or 1");
  if (split_keys_switch() < 0)
    return invalid_argument("NUCLEUS_MLA_DECODE_SPLIT_KEYS='" + *env_string(Knob::kMlaDecodeSplitKeys) +
                            "' is not auto or a multiple of 32 from 32 to 1024");
  if (ctas_per_sm_switch() < 0)
    return invalid_argument("NUCLEUS_MLA_DECODE_CTAS_PER_SM='" + *env_string(Knob::kMlaDecodeCtasPerSm) +
                            "' is not auto, 1 or 2");
  if (key_tile_switch() < 0)
    return invalid_argument("NUCLEUS_MLA_DECODE_KEY_TILE='" + *env_string(Knob::kMlaDecodeKeyTile) +
                            "' is not auto, 32 or 64");
  NUCLEUS_RETURN_IF_ERROR(auto_switch_env_status(Knob::kMlaDecodeBulkLoads));
  NUCLEUS_RETURN_IF_ERROR(auto_switch_env_status(Knob::kMlaDecodeFp8RegisterConvert));
  NUCLEUS_RETURN_IF_ERROR(auto_switch_env_status(Knob::kMlaDecodeWgmma));
  return ok_status();
}

std::string MlaDecodeAttentionOp::attrs() const {
  return "layer=" + std::to_string(layer()) + " heads=" + std::to_string(dims().num_heads) +
         " mode=" + attention_mode_name(mode()) + " cache=" + kv_cache_dtype_name(cache_dtype());
}

const std::vector<Backend<MlaDecodeAttentionOp>>& MlaDecodeAttentionOp::backends() {
  static const std::vector<Backend<MlaDecodeAttentionOp>> list = {
      {"cpu_ref", Device::kCpu, [](const MlaDecodeAttentionOp& op) { return cpu_kv_b_supported(op); },
       [](MlaDecodeAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
         run_mla_reference(op, true, ctx, in[0], out[0], kernels::mla_attention_absorbed_ref);
       }},
#ifdef NUCLEUS_HAVE_CUDA
      // nucleus first although FlashInfer is faster at most shapes (docs/perf.md,
      // "MLA decode attention"): FlashInfer plans on the host, so it refuses
      // a captured graph, and a graph replay (nucleus) would then differ from
      // an eager step (the graphs must be bit-identical to eager runs).
      {"nucleus", Device::kCuda, cuda_ops::mla_decode_nucleus_supports, cuda_ops::mla_decode_nucleus,
       cuda_ops::mla_decode_nucleus_workspace},
      {"flashinfer", Device::kCuda, cuda_ops::mla_decode_flashinfer_supports, cuda_ops::mla_decode_flashinfer,
       cuda_ops::mla_decode_flashinfer_workspace, nullptr, cuda_ops::mla_decode_flashinfer_plan},
      {"cuda_naive", Device::kCuda, cuda_ops::mla_decode_naive_supports, cuda_ops::mla_decode_naive},
#endif
  };
  return list;
}

}  // namespace nucleus
