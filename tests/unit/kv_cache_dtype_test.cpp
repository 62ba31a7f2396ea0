// The KV-cache dtype setting and the FP8 cache convention on the CPU
// reference (ops/kv_cache_dtype.h: stored = e4m3(value / k_scale), read =
// stored * k_scale; a bf16 or f32 cache is never scaled):
//  - every --kv-cache-dtype spelling maps to one canonical setting, anything
//    else is refused naming the accepted values (the CLI and the model:
//    tests/e2e/kv_cache_fp8_test.cpp);
//  - a k_scale other than 1 changes the stored bytes and is undone on read;
//    values past 448 saturate at k_scale 1 and survive a larger k_scale;
//  - RopeKvCacheWriteOp (cpu_ref) stores exactly those bytes, the same for a
//    token written in a prefill step and in a decode step;
//  - attention over an FP8 cache, absorbed (decode) and expanded with a
//    cached prefix (prefill), against the same over a bf16 cache.
//
// Attention tolerance (FP8 cache vs bf16 cache, relative L2 over the output):
// an e4m3 element carries a relative rounding error of at most 2^-4 (3
// mantissa bits, round to nearest; ~3.6% RMS, 2^-4 / sqrt(3)) against 2^-9
// for bf16 (~0.11% RMS). The output is a softmax-weighted mean of the rows
// through W_UV; the scores (std ~2.3 here, a sharp softmax) move by about the
// element error times their own size, which shifts the weights by a few
// percent. Measured over 160-1000 keys, decode and prefill, k_scale 1 and
// amax / 448: FP8 vs bf16 4.1-5.3%, bf16 vs f32 0.25-0.37%. Bounds: 8% and
// 0.6% (about 1.5x the worst measured; the bf16 bound is 8x below the FP8
// error, so FP8 rounding where bf16 was asked for fails it). A reader that
// skips k_scale is off by ~150-300x the bound (the negative control must fail).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "io/hf_config.h"
#include "kernels/rope/rope_ref.h"
#include "model/deepseek/kernel_params.h"
#include "ops/kv_cache_dtype.h"
#include "ops/mla_decode.h"
#include "ops/mla_prefill.h"
#include "ops/rope_kv_cache_write.h"
#include "test_util.h"

namespace nucleus {
namespace {

// ------------------------------------------------------------ spellings ---

TEST(KvCacheDtype, EverySpellingMapsToOneSetting) {
  auto fp8 = parse_kv_cache_dtype("fp8");
  auto fp8_e4m3 = parse_kv_cache_dtype("fp8_e4m3");
  ASSERT_TRUE(fp8.ok() && fp8_e4m3.ok());
  ASSERT_TRUE(fp8->has_value() && fp8_e4m3->has_value());
  EXPECT_EQ(**fp8, KvCacheDtype::kFp8E4M3);
  EXPECT_EQ(**fp8, **fp8_e4m3);
  auto bf16 = parse_kv_cache_dtype("bf16");
  ASSERT_TRUE(bf16.ok() && bf16->has_value());
  EXPECT_EQ(**bf16, KvCacheDtype::kBF16);
  auto automatic = parse_kv_cache_dtype("auto");
  ASSERT_TRUE(automatic.ok());
  EXPECT_FALSE(automatic->has_value());
  // "auto" resolves per device; an explicit setting is the same on both.
  EXPECT_EQ(*resolve_kv_cache_dtype(std::nullopt, Device::kCpu), KvCacheDtype::kF32);
  EXPECT_EQ(*resolve_kv_cache_dtype(std::nullopt, Device::kCuda), KvCacheDtype::kBF16);
  for (Device d : {Device::kCpu, Device::kCuda}) {
    EXPECT_EQ(*resolve_kv_cache_dtype(**fp8, d), KvCacheDtype::kFp8E4M3);
    EXPECT_EQ(*resolve_kv_cache_dtype(**fp8_e4m3, d), KvCacheDtype::kFp8E4M3);
    EXPECT_EQ(*resolve_kv_cache_dtype(**bf16, d), KvCacheDtype::kBF16);
  }
  EXPECT_FALSE(resolve_kv_cache_dtype(KvCacheDtype::kF32, Device::kCuda).ok());
  EXPECT_STREQ(kv_cache_dtype_name(**fp8), "fp8_e4m3");
  EXPECT_EQ(kv_cache_storage_dtype(**fp8), DType::kF8E4M3);
  EXPECT_EQ(dtype_size(kv_cache_storage_dtype(**fp8)) * 2, dtype_size(kv_cache_storage_dtype(**bf16)));
}

TEST(KvCacheDtype, OtherSpellingsAreRefusedNamingTheAcceptedOnes) {
  for (const char* bad : {"FP8", "fp16", "fp8_e5m2", "float8", "e4m3", "", "bfloat16", "f32", "int8"}) {
    auto r = parse_kv_cache_dtype(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("auto, bf16, fp8, fp8_e4m3"), std::string::npos) << r.status().message();
  }
}

// --------------------------------------------------------- the encoding ---

std::vector<float> normal_values(size_t n, float stddev, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

std::vector<uint8_t> encode_fp8(const std::vector<float>& v, float k_scale) {
  std::vector<uint8_t> out(v.size());
  encode_kv_row(v.data(), static_cast<int64_t>(v.size()), KvCacheDtype::kFp8E4M3, k_scale, out.data());
  return out;
}

std::vector<float> decode_fp8(const std::vector<uint8_t>& b, float k_scale) {
  std::vector<float> out(b.size());
  decode_kv_row(b.data(), static_cast<int64_t>(b.size()), KvCacheDtype::kFp8E4M3, k_scale, out.data());
  return out;
}

TEST(KvCacheFp8, KScaleChangesTheBytesAndIsUndoneOnRead) {
  // Values within e4m3's normal range at every scale used (|v| / k_scale in [2^-6, 448]).
  std::vector<float> v = normal_values(4096, 1.0f, 1);
  for (auto& x : v) x = std::copysign(std::clamp(std::fabs(x), 0.06f, 100.0f), x);
  const std::vector<uint8_t> b1 = encode_fp8(v, 1.0f);
  for (float k : {2.0f, 0.25f}) {  // powers of two: the read values are the same bit for bit
    const std::vector<uint8_t> bk = encode_fp8(v, k);
    size_t differ = 0;
    for (size_t i = 0; i < v.size(); ++i) differ += bk[i] != b1[i];
    EXPECT_EQ(differ, v.size()) << "k_scale " << k << " left bytes unchanged";
    const std::vector<float> r1 = decode_fp8(b1, 1.0f), rk = decode_fp8(bk, k);
    for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(rk[i], r1[i]) << "k_scale " << k << " at " << i;
  }
  for (float k : {0.37f, 3.3f}) {  // any scale: read back within e4m3's half step (2^-4 relative)
    const std::vector<uint8_t> bk = encode_fp8(v, k);
    EXPECT_NE(bk, b1);
    const std::vector<float> rk = decode_fp8(bk, k);
    for (size_t i = 0; i < v.size(); ++i)
      ASSERT_LE(std::fabs(rk[i] - v[i]), std::ldexp(std::fabs(v[i]), -4) * 1.0001f) << "k_scale " << k << " at " << i;
    // Reading with the wrong scale does not undo it.
    const std::vector<float> wrong = decode_fp8(bk, 1.0f);
    EXPECT_GT(std::fabs(wrong[0] - v[0]), 0.2f * std::fabs(v[0]));
  }
}

TEST(KvCacheFp8, LargeValuesSaturateUnlessKScaleMakesRoom) {
  const std::vector<float> v = {1500.0f, -900.0f, 600.0f, 448.0f, -3.0f};
  const std::vector<float> r1 = decode_fp8(encode_fp8(v, 1.0f), 1.0f);
  EXPECT_EQ(r1[0], 448.0f);
  EXPECT_EQ(r1[1], -448.0f);
  EXPECT_EQ(r1[2], 448.0f);
  const std::vector<float> r4 = decode_fp8(encode_fp8(v, 4.0f), 4.0f);
  for (size_t i = 0; i < v.size(); ++i) EXPECT_LE(std::fabs(r4[i] - v[i]), std::ldexp(std::fabs(v[i]), -4)) << i;
}

TEST(KvCacheFp8, KScaleMustBeFiniteAndPositive) {
  EXPECT_TRUE(check_k_scale(0.5f, "x").ok());
  for (float bad : {0.0f, -1.0f, std::nanf(""), INFINITY}) EXPECT_FALSE(check_k_scale(bad, "x").ok()) << bad;
}

// --------------------------------------------------------- cache write ---

constexpr int kNope = 128, kRope = 64, kVHead = 128, kLora = 512, kLatent = kLora + kRope;

ModelConfig v3_config() {
  auto c = load_model_config(testing::model_path("configs/deepseek-v3.config.json"));
  NUCLEUS_CHECK(c.ok(), "{}", c.status().to_string());
  return *c;
}

KvCache cpu_cache(KvCacheDtype d, int64_t num_slots, int64_t block_size, std::vector<float> k_scale) {
  KvCache kv;
  kv.num_layers = static_cast<int64_t>(k_scale.size());
  kv.block_size = block_size;
  kv.num_blocks = num_slots / block_size;
  kv.width = kLatent;
  kv.data = Tensor::zeros({kv.num_layers, kv.num_blocks, block_size, kLatent}, kv_cache_storage_dtype(d));
  kv.k_scale = std::move(k_scale);
  return kv;
}

// Runs the cpu_ref cache write for tokens (positions, slots) of kv_a rows.
void write_rows(RopeKvCacheWriteOp& op, KvCache& kv, const std::vector<float>& kv_a, const std::vector<int32_t>& pos,
                const std::vector<int64_t>& slots, int num_heads) {
  const int64_t T = static_cast<int64_t>(pos.size());
  StepInputs si;
  si.positions = pos;
  si.slot_mapping = slots;
  si.token_ids.assign(T, 0);
  Tensor q = Tensor::zeros({T, num_heads * (kNope + kRope)}, DType::kF32);
  Tensor a = Tensor::from_f32({T, kLatent}, kv_a);
  OpContext ctx;
  ctx.inputs = &si;
  ctx.kv_cache = &kv;
  op.run(ctx, {q, a}, {q});
}

std::vector<uint8_t> slot_bytes(const KvCache& kv, int64_t layer, int64_t slot) {
  const size_t row = static_cast<size_t>(kv.width) * dtype_size(kv.data.dtype());
  const auto* p = static_cast<const uint8_t*>(kv.layer_data(layer)) + slot * row;
  return std::vector<uint8_t>(p, p + row);
}

TEST(KvCacheFp8, CpuWriteStoresScaledE4m3AndPrefillRowEqualsDecodeRow) {
  const ModelConfig config = v3_config();
  const kernels::RopeTable rope = kernels::make_rope_table(rope_params(config), 4096);
  const kernels::MlaDims dims{2, kNope, kRope, kVHead, kLora, 0.1f};
  const int64_t T = 9;
  std::vector<float> kv_a = normal_values(T * kLatent, 1.0f, 7);
  std::vector<int32_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>(100 + 37 * t);
  for (float k_scale : {1.0f, 0.011f}) {
    SCOPED_TRACE("k_scale " + std::to_string(k_scale));
    // Layer 1 of 2; prefill writes the T tokens at slots 0..T-1 in one step.
    KvCache prefill = cpu_cache(KvCacheDtype::kFp8E4M3, 32, 16, {1.0f, k_scale});
    RopeKvCacheWriteOp op(1, &rope, dims, nullptr, 1.0f, KvCacheDtype::kFp8E4M3);
    ASSERT_TRUE(op.select_backend(Device::kCpu).ok());
    std::vector<int64_t> slots(T);
    for (int64_t t = 0; t < T; ++t) slots[t] = t;
    write_rows(op, prefill, kv_a, pos, slots, 2);
    // Decode: each token alone, one step each, at slot 16 + t.
    KvCache decode = cpu_cache(KvCacheDtype::kFp8E4M3, 32, 16, {1.0f, k_scale});
    for (int64_t t = 0; t < T; ++t)
      write_rows(op, decode, std::vector<float>(kv_a.begin() + t * kLatent, kv_a.begin() + (t + 1) * kLatent),
                 {pos[t]}, {16 + t}, 2);
    for (int64_t t = 0; t < T; ++t) {
      const std::vector<uint8_t> row = slot_bytes(prefill, 1, t);
      EXPECT_EQ(row, slot_bytes(decode, 1, 16 + t)) << "token " << t;
      // The bytes are e4m3(value / k_scale) of [c_kv | rope(k_pe)].
      std::vector<float> want(kv_a.begin() + t * kLatent, kv_a.begin() + (t + 1) * kLatent);
      kernels::apply_rope_interleaved_ref(rope, pos[t], want.data() + kLora);
      EXPECT_EQ(row, encode_fp8(want, k_scale)) << "token " << t;
      EXPECT_EQ(slot_bytes(prefill, 0, t), std::vector<uint8_t>(kLatent, 0)) << "layer 0 written";
    }
  }
  // The op refuses to run on a cache of another dtype than it was built for.
  KvCache bf16 = cpu_cache(KvCacheDtype::kBF16, 32, 16, {1.0f, 1.0f});
  RopeKvCacheWriteOp op(1, &rope, dims, nullptr, 1.0f, KvCacheDtype::kFp8E4M3);
  ASSERT_TRUE(op.select_backend(Device::kCpu).ok());
  EXPECT_DEATH(write_rows(op, bf16, kv_a, pos, std::vector<int64_t>(T, 0), 2), "fp8_e4m3 KV cache");
}

// ------------------------------------------------------------ attention ---

// One sequence of `context` cached keys and `num_q` new tokens (their rows in
// the cache too), latent rows ~N(0, 1) (c_kv after RMSNorm, k_pe), written
// into a cache of `d` with per-layer k_scale.
struct AttnProblem {
  kernels::MlaDims dims{4, kNope, kRope, kVHead, kLora, 0.135234f};
  int64_t context = 0, num_q = 0, block_size = 16;
  std::vector<float> latent;  // [context + num_q, 576]
  std::vector<float> q;       // [num_q, heads * 192]
  LinearWeight kv_b;
  StepInputs si;
};

AttnProblem make_attn_problem(int64_t context, int64_t num_q, uint64_t seed) {
  AttnProblem p;
  p.context = context;
  p.num_q = num_q;
  const int64_t keys = context + num_q, H = p.dims.num_heads;
  p.latent = normal_values(keys * kLatent, 1.0f, seed);
  p.q = normal_values(num_q * H * (kNope + kRope), 1.0f, seed + 1);
  // W scaled so that scores have a standard deviation of about 2.
  const int64_t n = H * (kNope + kVHead);
  p.kv_b.name = "kv_b_proj";
  p.kv_b.out_features = n;
  p.kv_b.in_features = kLora;
  p.kv_b.weight = Tensor::from_f32({n, kLora}, normal_values(n * kLora, 0.06f, seed + 2));
  const int64_t num_blocks = (keys + p.block_size - 1) / p.block_size;
  p.si.max_blocks_per_seq = static_cast<int32_t>(num_blocks);
  for (int64_t b = 0; b < num_blocks; ++b) p.si.block_tables.push_back(static_cast<int32_t>(num_blocks - 1 - b));
  p.si.query_start = {0, static_cast<int32_t>(num_q)};
  p.si.context_lens = {static_cast<int32_t>(context)};
  for (int64_t j = context; j < keys; ++j) {
    p.si.token_ids.push_back(0);
    p.si.positions.push_back(static_cast<int32_t>(j));
    p.si.slot_mapping.push_back(-1);
  }
  return p;
}

// Layer 1's rows of the problem stored in a `d` cache (layer 0 holds others).
KvCache store(const AttnProblem& p, KvCacheDtype d, float write_scale, float read_scale) {
  const int64_t keys = p.context + p.num_q;
  const int64_t blocks = p.si.max_blocks_per_seq;
  KvCache kv = cpu_cache(d, blocks * p.block_size, p.block_size, {1.0f, write_scale});
  const size_t elem = dtype_size(kv.data.dtype());
  for (int64_t j = 0; j < keys; ++j) {
    const int64_t slot = int64_t{p.si.block_tables[j / p.block_size]} * p.block_size + j % p.block_size;
    encode_kv_row(p.latent.data() + j * kLatent, kLatent, d, write_scale,
                  static_cast<char*>(kv.layer_data(1)) + slot * kLatent * elem);
  }
  kv.k_scale = {1.0f, read_scale};
  return kv;
}

// The decode (absorbed) or prefill (expanded) cpu_ref op on layer 1 of `kv`.
std::vector<float> attend(const AttnProblem& p, KvCache& kv, bool decode) {
  const int64_t H = p.dims.num_heads, T = p.num_q;
  Tensor q = Tensor::from_f32({T, H * (kNope + kRope)}, p.q);
  Tensor out = Tensor::zeros({T, H * kVHead}, DType::kF32);
  Tensor scratch = Tensor::zeros({8, H * kLora}, DType::kF32);
  OpContext ctx;
  ctx.inputs = &p.si;
  ctx.kv_cache = &kv;
  if (decode) {
    MlaDecodeAttentionOp op(1, &p.kv_b, p.dims, AttentionMode::kAbsorbed, kv.dtype());
    NUCLEUS_CHECK_OK(op.select_backend(Device::kCpu));
    op.run(ctx, {q}, {out, scratch, scratch});
  } else {
    MlaPrefillAttentionOp op(1, &p.kv_b, p.dims, AttentionMode::kExpanded, 8192, kv.dtype());
    NUCLEUS_CHECK_OK(op.select_backend(Device::kCpu));
    op.run(ctx, {q}, {out});
  }
  return std::vector<float>(out.data<float>(), out.data<float>() + out.numel());
}

double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double e = 0, r = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    e += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    r += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(e / std::max(r, 1e-30));
}

constexpr double kFp8VsBf16 = 8e-2;  // see the file comment
constexpr double kBf16VsF32 = 6e-3;

void check_fp8_against_bf16(const std::string& what, const AttnProblem& p, bool decode) {
  float amax = 0;
  for (float x : p.latent) amax = std::max(amax, std::fabs(x));
  KvCache f32 = store(p, KvCacheDtype::kF32, 1.0f, 1.0f);
  KvCache bf16 = store(p, KvCacheDtype::kBF16, 1.0f, 1.0f);
  const std::vector<float> exact = attend(p, f32, decode), with_bf16 = attend(p, bf16, decode);
  const double bf16_err = rel_l2(with_bf16, exact);
  EXPECT_LE(bf16_err, kBf16VsF32) << what;
  for (float k_scale : {1.0f, amax / 448.0f}) {
    KvCache fp8 = store(p, KvCacheDtype::kFp8E4M3, k_scale, k_scale);
    const std::vector<float> with_fp8 = attend(p, fp8, decode);
    const double err = rel_l2(with_fp8, with_bf16);
    std::printf("%s k_scale %.4g: rel L2 fp8 vs bf16 cache %.4f (fp8 vs f32 %.4f, bf16 vs f32 %.5f)\n", what.c_str(),
                k_scale, err, rel_l2(with_fp8, exact), bf16_err);
    EXPECT_LE(err, kFp8VsBf16) << what << " k_scale " << k_scale;
    EXPECT_GT(err, 0.0) << what << ": an FP8 cache cannot be exact";
  }
  // Negative control: rows written with k_scale amax/448 but read as if 1.0
  // (a reader that ignores k_scale) must fail the same bound.
  KvCache unscaled = store(p, KvCacheDtype::kFp8E4M3, amax / 448.0f, 1.0f);
  const double bad = rel_l2(attend(p, unscaled, decode), with_bf16);
  std::printf("%s negative control (k_scale ignored on read): rel L2 %.3f\n", what.c_str(), bad);
  EXPECT_GT(bad, 10 * kFp8VsBf16) << what;
}

TEST(KvCacheFp8, DecodeAttentionAgainstBf16Cache) {
  check_fp8_against_bf16("decode ctx 160", make_attn_problem(159, 1, 11), true);
  check_fp8_against_bf16("decode ctx 1000", make_attn_problem(999, 1, 12), true);
  // Forced-absorbed prefill rows: each row causal over the FP8 rows.
  check_fp8_against_bf16("absorbed 5 rows ctx 300", make_attn_problem(300, 5, 13), true);
}

TEST(KvCacheFp8, CachedPrefixPrefillAgainstBf16Cache) {
  // A prefill chunk of 24 tokens over 400 cached keys (an earlier chunk or a
  // prefix-cache hit), and one without a cached prefix.
  check_fp8_against_bf16("prefill ctx 400 + 24", make_attn_problem(400, 24, 21), false);
  check_fp8_against_bf16("prefill ctx 0 + 40", make_attn_problem(0, 40, 22), false);
}

}  // namespace
}  // namespace nucleus
