// The tile-scaled FP8 latent cache (--kv-cache-dtype fp8_ds_mla; the row:
// kernels/mla/ds_mla_row.h, 512 e4m3 values with one f32 scale = max|x| / 448
// per 128, then 64 bf16 rope values: 656 bytes) on CUDA, every path against
// the CPU reference of the layout (encode_kv_row / decode_kv_row):
//  - the fused RoPE + cache write: the latent bytes and the four scales are
//    the CPU encoder's exactly (the same bf16 inputs, the same f32 max,
//    division and round-to-nearest-even saturating conversion), including a
//    zero tile, +-inf (saturated) and NaN; the rope part within one bf16 step
//    (GPU sincosf against the CPU's double-precision table); slot -1 writes
//    nothing; a prefill launch and per-token launches write the same bytes;
//  - decode on tile-scaled rows ("nucleus", "cuda_naive") against the CPU
//    reference, adding no error beyond the layout's own; FlashInfer refuses
//    the layout by name and the dispatch picks nucleus;
//  - prefill ("cuda_flash" through the unfused expansion, "cuda_naive") with
//    cached prefixes;
//  - gather_kv_b_proj: the fused kernel refuses the layout by name, the
//    unfused path reads rows the write kernel stored;
//  - the model (tiny-dsv3) builds every attention node for fp8_ds_mla.
//
// Tolerances: against the CPU reference on the decoded rows, the bf16
// kernels' own (decode: relative L2 <= 1e-2 and every element within 3e-2
// max|want|, as mla_decode_gpu_test and kv_cache_fp8_gpu_test; K/V: relative
// L2 <= 1e-2). cuda_naive decodes in f32 like the CPU; the other CUDA readers
// round stored * scale to bf16 once (2^-9 relative per element), and the
// prefill reference rounds the decoded rows the same way (both CUDA prefill
// paths read bf16 rows). The decode rows here spread their tiles over
// 0.01 .. 100, so the scores spread over ~100 logits and the softmax is
// nearly an argmax: the nucleus kernel's bf16 operands (the absorbed query
// and bf16(stored * scale), each 2^-9 relative) move a score by ~0.1 logit
// and flip near-ties, a large output change no kernel with bf16 operands
// avoids (a host emulation of those roundings reproduced the H200's
// mismatches of 2026-12-02 to the printed digit). nucleus is therefore held
// to the same bounds against the CPU reference on its operands (the query
// and the rows rounded to bf16, the rest in double), which any indexing error
// (a wrong tile, scale, rope chunk or ring stage) still breaks. Against the
// bf16 cache: decode adds no error beyond the layout's own (its reference's);
// prefill relative L2 <= 8e-2, the CPU bound for FP8 rows
// (tests/unit/kv_cache_dtype_test.cpp, kv_cache_ds_mla_test.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>

#include "core/cuda/context.h"
#include "core/device.h"
#include "core/parallel.h"
#include "gpu_test_util.h"
#include "graph/device_inputs.h"
#include "graph/step_resources.h"
#include "io/hf_config.h"
#include "kernels/mla/ds_mla_row.h"
#include "kernels/mla/gather_kv_b_proj.cuh"
#include "kernels/mla/gather_kv_b_proj_ref.h"
#include "kernels/mla/mla_attention_ref.h"
#include "kernels/rope/rope_kv_cache.cuh"
#include "kernels/rope/rope_ref.h"
#include "model/deepseek/kernel_params.h"
#include "ops/gather_kv_b_proj.h"
#include "ops/kv_cache_dtype.h"
#include "ops/mla_decode.h"
#include "ops/mla_prefill.h"
#include "ops/rope_kv_cache_write.h"
#include "runtime/model_executor.h"
#include "test_util.h"

namespace nucleus {
namespace {

using testing::device_copy;
using testing::device_poisoned;
using testing::from_bf16;
using testing::host_copy;
using testing::random_bf16_values;
using testing::to_bf16;

constexpr int kNope = 128, kRope = 64, kVHead = 128, kLora = 512, kLatent = 576, kQk = kNope + kRope;
constexpr int kRow = 656;
constexpr float kScale = 0.135234f;

cudaStream_t stream() { return cuda::context().stream; }

class KvCacheDsMlaGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device";
    ASSERT_TRUE(cuda::get_context().ok());
  }
};

double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double e = 0, r = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) continue;
    e += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    r += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(e / std::max(r, 1e-30));
}

// Rows ~N(0, 1) in bf16, latent tile t of row j scaled by 10^(((j + t) % 5) - 2)
// (tiles of 0.01 .. 100: the spread the tile scales are for).
std::vector<float> spread_rows(int64_t rows, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(rows) * kLatent);
  for (int64_t j = 0; j < rows; ++j)
    for (int c = 0; c < kLatent; ++c) {
      const float mag = c < kLora ? std::pow(10.0f, static_cast<float>((j + c / 128) % 5) - 2.0f) : 1.0f;
      v[j * kLatent + c] = round_to_bf16(d(rng) * mag);
    }
  return v;
}

std::vector<uint8_t> encode_rows(const std::vector<float>& rows) {
  const size_t n = rows.size() / kLatent;
  std::vector<uint8_t> out(n * kRow);
  for (size_t j = 0; j < n; ++j)
    encode_kv_row(rows.data() + j * kLatent, kLatent, KvCacheDtype::kFp8DsMla, 1.0f, out.data() + j * kRow);
  return out;
}

std::vector<float> decode_rows(const std::vector<uint8_t>& bytes) {
  const size_t n = bytes.size() / kRow;
  std::vector<float> out(n * kLatent);
  for (size_t j = 0; j < n; ++j)
    decode_kv_row(bytes.data() + j * kRow, kLatent, KvCacheDtype::kFp8DsMla, 1.0f, out.data() + j * kLatent);
  return out;
}

// ------------------------------------------------------------- the write ---

struct RopeSetup {
  kernels::RopeTable table;
  Tensor inv_freq;
  float attention_factor = 1.0f;
  int heads = 16;
};

RopeSetup rope_setup() {
  RopeSetup s;
  auto c = load_model_config(testing::model_path("configs/deepseek-v3.config.json"));
  NUCLEUS_CHECK(c.ok(), "{}", c.status().to_string());
  s.table = kernels::make_rope_table(rope_params(*c), 5000);
  s.inv_freq = device_copy(s.table.inv_freq, DType::kF32);
  s.attention_factor = static_cast<float>(rope_params(*c).attention_factor);
  return s;
}

// Launches the write for tokens (bf16 kv_a rows, positions, slots) into
// `cache` (device, num_slots rows of 656 bytes).
void launch_write(const RopeSetup& s, const std::vector<float>& kv_a, const std::vector<int32_t>& pos,
                  const std::vector<int64_t>& slots, Tensor& cache) {
  const auto T = static_cast<int64_t>(pos.size());
  Tensor d_q = device_copy(to_bf16(random_bf16_values(T * s.heads * kQk, 1.0f, 5)), DType::kBF16);
  Tensor d_kv = device_copy(to_bf16(kv_a), DType::kBF16);
  Tensor d_pos = device_copy(pos, DType::kI32), d_slot = device_copy(slots, DType::kI64);
  kernels::RopeKvCacheParams p;
  p.q = d_q.data<__nv_bfloat16>();
  p.q_stride = s.heads * kQk;
  p.kv_a = d_kv.data<__nv_bfloat16>();
  p.kv_stride = kLatent;
  p.positions = d_pos.data<int32_t>();
  p.slot_mapping = d_slot.data<int64_t>();
  p.inv_freq = s.inv_freq.data<float>();
  p.attention_factor = s.attention_factor;
  p.cache = cache.raw();
  p.cache_ds_mla = true;
  p.num_tokens = T;
  p.num_heads = s.heads;
  p.qk_nope = kNope;
  p.qk_rope = kRope;
  p.kv_lora = kLora;
  ASSERT_EQ(kernels::launch_rope_kv_cache_write(p, stream()), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream()), cudaSuccess);
}

Tensor sentinel_cache(int64_t num_slots, uint8_t byte) {
  return device_copy(std::vector<uint8_t>(static_cast<size_t>(num_slots * kRow), byte), DType::kU8);
}

TEST_F(KvCacheDsMlaGpu, RopeWriteStoresTheCpuBytes) {
  const RopeSetup s = rope_setup();
  const int64_t T = 37, slots = 64;
  std::vector<float> kv_a = spread_rows(T, 9);
  // Token 4: a zero tile (1) and, in tile 2, +inf, -inf and NaN next to finite values.
  for (int c = 128; c < 256; ++c) kv_a[4 * kLatent + c] = 0.0f;
  kv_a[4 * kLatent + 300] = INFINITY;
  kv_a[4 * kLatent + 301] = -INFINITY;
  kv_a[4 * kLatent + 302] = std::nanf("");
  std::vector<int32_t> pos(T);
  std::vector<int64_t> slot(T);
  for (int64_t t = 0; t < T; ++t) {
    pos[t] = static_cast<int32_t>((t * 131) % 5000);
    slot[t] = t % 5 == 2 ? -1 : (t * 3) % slots;  // some rows write nothing
  }
  Tensor cache = sentinel_cache(slots, 0x55);
  launch_write(s, kv_a, pos, slot, cache);
  const std::vector<uint8_t> got = host_copy<uint8_t>(cache);
  std::vector<bool> written(slots, false);
  int64_t rope_exact = 0, rope_total = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (slot[t] < 0) continue;
    written[slot[t]] = true;
    std::vector<float> row(kv_a.begin() + t * kLatent, kv_a.begin() + (t + 1) * kLatent);
    kernels::apply_rope_interleaved_ref(s.table, pos[t], row.data() + kLora);
    std::vector<uint8_t> want(kRow);
    encode_kv_row(row.data(), kLatent, KvCacheDtype::kFp8DsMla, 1.0f, want.data());
    const uint8_t* g = got.data() + slot[t] * kRow;
    for (int b = 0; b < kernels::kDsMlaRopeOffset; ++b) {  // latent bytes and scales: exact
      const bool nan_code = b < kLora && (want[b] & 0x7f) == 0x7f;
      if (nan_code)
        ASSERT_EQ(g[b] & 0x7f, 0x7f) << "token " << t << " byte " << b << ": NaN must stay NaN";
      else
        ASSERT_EQ(g[b], want[b]) << "token " << t << " byte " << b;
    }
    for (int j = 0; j < kRope; ++j) {
      uint16_t gh, wh;
      std::memcpy(&gh, g + kernels::kDsMlaRopeOffset + 2 * j, 2);
      std::memcpy(&wh, want.data() + kernels::kDsMlaRopeOffset + 2 * j, 2);
      ++rope_total;
      rope_exact += gh == wh;
      const float gv = bf16_to_f32(gh), wv = bf16_to_f32(wh);
      ASSERT_LE(std::fabs(gv - wv), std::ldexp(std::max(std::fabs(gv), std::fabs(wv)), -7))
          << "rope more than one bf16 step off: token " << t << " value " << j;
    }
  }
  for (int64_t sl = 0; sl < slots; ++sl) {
    if (written[sl]) continue;
    for (int b = 0; b < kRow; ++b) ASSERT_EQ(got[sl * kRow + b], 0x55) << "slot " << sl << " was written";
  }
  // The special token, decoded: the zero tile reads 0, inf saturates to 448 * scale, NaN reads NaN.
  const std::vector<float> r = decode_rows(std::vector<uint8_t>(got.begin() + slot[4] * kRow,
                                                                got.begin() + (slot[4] + 1) * kRow));
  float scale2;
  std::memcpy(&scale2, got.data() + slot[4] * kRow + 512 + 8, 4);
  for (int c = 128; c < 256; ++c) ASSERT_EQ(r[c], 0.0f);
  EXPECT_EQ(r[300], 448.0f * scale2);
  EXPECT_EQ(r[301], -448.0f * scale2);
  EXPECT_TRUE(std::isnan(r[302]));
  std::printf("rope write fp8_ds_mla: latent bytes and scales exact, rope %lld / %lld bf16 values exact\n",
              static_cast<long long>(rope_exact), static_cast<long long>(rope_total));
  EXPECT_GE(rope_exact, rope_total * 95 / 100);
}

TEST_F(KvCacheDsMlaGpu, PrefillLaunchAndDecodeLaunchesWriteTheSameBytes) {
  const RopeSetup s = rope_setup();
  const int64_t T = 50;
  const std::vector<float> kv_a = spread_rows(T, 19);
  std::vector<int32_t> pos(T);
  std::vector<int64_t> slot(T);
  for (int64_t t = 0; t < T; ++t) {
    pos[t] = static_cast<int32_t>(200 + t);
    slot[t] = t;
  }
  Tensor prefill = sentinel_cache(2 * T, 0), decode = sentinel_cache(2 * T, 0);
  launch_write(s, kv_a, pos, slot, prefill);
  for (int64_t t = 0; t < T; ++t)
    launch_write(s, std::vector<float>(kv_a.begin() + t * kLatent, kv_a.begin() + (t + 1) * kLatent), {pos[t]},
                 {T + t}, decode);
  const std::vector<uint8_t> a = host_copy<uint8_t>(prefill), b = host_copy<uint8_t>(decode);
  for (int64_t t = 0; t < T; ++t)
    ASSERT_TRUE(std::equal(a.begin() + t * kRow, a.begin() + (t + 1) * kRow, b.begin() + (T + t) * kRow))
        << "token " << t << ": prefill and decode rows differ";
}

// ------------------------------------------------------------ decode reads ---

struct DecodeCase {
  int batch, context, heads, block_size;
  int query_len = 1;  // > 1: forced-absorbed prefill rows
  bool vary = false;  // contexts vary in [1, context]
};

std::string name(const DecodeCase& c) {
  return "b" + std::to_string(c.batch) + " ctx" + std::to_string(c.context) + " h" + std::to_string(c.heads) + " bs" +
         std::to_string(c.block_size) + (c.query_len > 1 ? " q" + std::to_string(c.query_len) : "") +
         (c.vary ? " vary" : "");
}

struct DecodeProblem {
  kernels::MlaDims dims;
  StepInputs si;
  std::vector<int32_t> keys;  // per sequence
  std::vector<float> latent;  // [slots, 576] bf16-exact values
  std::vector<uint8_t> ds;    // [slots, 656]
  std::vector<float> q, w;
  LinearWeight w_dev;
  KvCache kv_ds, kv_bf16;
  Tensor q_dev;
};

DecodeProblem make_decode(const DecodeCase& c, uint64_t seed) {
  DecodeProblem p;
  std::mt19937_64 rng(seed);
  p.dims = {c.heads, kNope, kRope, kVHead, kLora, kScale};
  const int B = c.batch;
  int total_blocks = 0, max_blocks = 0;
  for (int s = 0; s < B; ++s) {
    const int k = c.vary ? 1 + static_cast<int>(rng() % c.context) : c.context;
    p.keys.push_back(std::max(k, c.query_len));
    const int nb = (p.keys[s] + c.block_size - 1) / c.block_size;
    total_blocks += nb;
    max_blocks = std::max(max_blocks, nb);
  }
  const int num_blocks = total_blocks + 3;
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  StepInputs& si = p.si;
  si.max_blocks_per_seq = max_blocks;
  si.block_tables.assign(static_cast<size_t>(B) * max_blocks, -1);
  si.query_start.push_back(0);
  int next = 0;
  for (int s = 0; s < B; ++s) {
    const int nb = (p.keys[s] + c.block_size - 1) / c.block_size;
    for (int b = 0; b < nb; ++b) si.block_tables[static_cast<size_t>(s) * max_blocks + b] = perm[next++];
    si.context_lens.push_back(p.keys[s] - c.query_len);
    for (int j = 0; j < c.query_len; ++j) {
      si.token_ids.push_back(1);
      si.positions.push_back(si.context_lens[s] + j);
      si.slot_mapping.push_back(-1);
    }
    si.query_start.push_back(si.query_start.back() + c.query_len);
  }
  const int64_t slots = static_cast<int64_t>(num_blocks) * c.block_size, T = si.num_tokens(), H = c.heads;
  p.latent = spread_rows(slots, seed + 1);
  p.ds = encode_rows(p.latent);
  p.q = random_bf16_values(T * H * kQk, 2.0f, seed + 2);
  const int64_t wn = H * (kNope + kVHead);
  // W undoes the tile magnitudes on average, so every tile matters to the scores.
  p.w = random_bf16_values(wn * kLora, 0.1f, seed + 3);
  p.w_dev.weight = device_copy(to_bf16(p.w), DType::kBF16);
  p.w_dev.out_features = wn;
  p.w_dev.in_features = kLora;
  for (KvCache* kv : {&p.kv_ds, &p.kv_bf16}) {
    kv->num_layers = 1;
    kv->num_blocks = num_blocks;
    kv->block_size = c.block_size;
    kv->width = kLatent;
  }
  p.kv_ds.data = device_copy(p.ds, DType::kU8);
  p.kv_bf16.data = device_copy(to_bf16(p.latent), DType::kBF16);
  p.q_dev = device_copy(to_bf16(p.q), DType::kBF16);
  return p;
}

// The CPU reference (absorbed form) on `rows` ([slots, 576] f32): [T, H * 128].
std::vector<float> decode_reference(const DecodeProblem& p, const std::vector<float>& rows) {
  const StepInputs& si = p.si;
  const int64_t H = p.dims.num_heads, T = si.num_tokens(), q_stride = H * kQk;
  const int64_t bs = p.kv_ds.block_size;
  std::vector<float> out(T * H * kVHead, std::nanf(""));
  std::vector<float> latent;
  for (int64_t s = 0; s < si.num_seqs(); ++s) {
    const int32_t nq = si.query_len(s);
    const int64_t n = p.keys[s];
    latent.resize(n * kLatent);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = static_cast<int64_t>(si.block_tables[s * si.max_blocks_per_seq + j / bs]) * bs + j % bs;
      std::copy_n(rows.begin() + slot * kLatent, kLatent, latent.begin() + j * kLatent);
    }
    const int64_t r0 = si.query_start[s];
    kernels::mla_attention_absorbed_ref(p.dims, p.q.data() + r0 * q_stride, q_stride, nq, si.context_lens[s],
                                        latent.data(), p.w.data(), out.data() + r0 * H * kVHead, H * kVHead, nullptr);
  }
  return out;
}

// The CPU reference (absorbed form) on the nucleus kernel's operands: the
// absorbed query q_lat = q_nope W_UK (f32 sums) rounded to bf16, as the
// absorption GEMM's bf16 output, and the latent part of `rows` ([slots, 576]
// f32, the decoded rows) rounded to bf16, as the kernel's conversion (with
// round_rows; without it, the rows as decoded: the register-conversion path,
// whose f16 MMAs take the e4m3 values exactly and apply the tile scales in
// f32); the scores, the softmax and both products in double, the softmax
// scale p.dims.scale. [T, H * 128].
std::vector<float> decode_reference_bf16_operands(const DecodeProblem& p, const std::vector<float>& rows,
                                                  bool round_rows = true) {
  auto lat = [round_rows](float v) { return round_rows ? round_to_bf16(v) : v; };
  const StepInputs& si = p.si;
  const int64_t H = p.dims.num_heads, T = si.num_tokens(), bs = p.kv_ds.block_size;
  std::vector<float> out(T * H * kVHead, std::nanf(""));
  parallel_for(T * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_lat(kLora);
    std::vector<double> s, o_lat(kLora);
    for (int64_t th = begin; th < end; ++th) {
      const int64_t t = th / H, h = th % H;
      int64_t seq = 0;
      while (si.query_start[seq + 1] <= t) ++seq;
      const int64_t n = si.context_lens[seq] + (t - si.query_start[seq]) + 1;  // keys visible to row t
      const float* q = p.q.data() + (t * H + h) * kQk;
      const float* w_uk = p.w.data() + h * (kNope + kVHead) * kLora;  // [kNope, kLora]
      const float* w_uv = w_uk + kNope * kLora;                         // [kVHead, kLora]
      std::fill(q_lat.begin(), q_lat.end(), 0.0f);
      for (int r = 0; r < kNope; ++r)
        for (int c = 0; c < kLora; ++c) q_lat[c] += q[r] * w_uk[r * kLora + c];
      for (float& x : q_lat) x = round_to_bf16(x);
      auto row = [&](int64_t j) {
        const int64_t slot = static_cast<int64_t>(si.block_tables[seq * si.max_blocks_per_seq + j / bs]) * bs + j % bs;
        return rows.data() + slot * kLatent;
      };
      s.assign(n, 0.0);
      double mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        const float* k = row(j);
        double d = 0;
        for (int c = 0; c < kLora; ++c) d += static_cast<double>(q_lat[c]) * lat(k[c]);
        for (int c = 0; c < kRope; ++c) d += static_cast<double>(q[kNope + c]) * k[kLora + c];
        s[j] = d * p.dims.scale;
        mx = std::max(mx, s[j]);
      }
      double l = 0;
      std::fill(o_lat.begin(), o_lat.end(), 0.0);
      for (int64_t j = 0; j < n; ++j) {
        const double e = std::exp(s[j] - mx);
        l += e;
        const float* k = row(j);
        for (int c = 0; c < kLora; ++c) o_lat[c] += e * lat(k[c]);
      }
      for (int v = 0; v < kVHead; ++v) {
        double a = 0;
        for (int c = 0; c < kLora; ++c) a += o_lat[c] / l * w_uv[v * kLora + c];
        out[(t * H + h) * kVHead + v] = static_cast<float>(a);
      }
    }
  });
  return out;
}

const Backend<MlaDecodeAttentionOp>* decode_backend(const std::string& name) {
  for (const auto& b : MlaDecodeAttentionOp::backends())
    if (b.device == Device::kCuda && name == b.name) return &b;
  return nullptr;
}

std::vector<float> run_decode(const std::string& name, DecodeProblem& p, bool ds, std::string* why,
                              int64_t scratch_rows = 64) {
  const auto* b = decode_backend(name);
  if (!b) {
    *why = "no backend";
    return {};
  }
  MlaDecodeAttentionOp op(0, &p.w_dev, p.dims, AttentionMode::kAbsorbed,
                          ds ? KvCacheDtype::kFp8DsMla : KvCacheDtype::kBF16);
  const Status s = op.use_backend(*b);
  if (!s.ok()) {
    *why = s.message();
    return {};
  }
  StepResources res;
  NUCLEUS_CHECK_OK(res.reserve_ops({&op}, StepLimits{}, Device::kCuda));
  const int64_t H = p.dims.num_heads, T = p.si.num_tokens();
  Tensor out = device_poisoned(T * H * kVHead, DType::kBF16).view({T, H * kVHead});
  Tensor q_lat = device_poisoned(scratch_rows * H * kLora, DType::kF32).view({scratch_rows, H * kLora});
  Tensor o_lat = device_poisoned(scratch_rows * H * kLora, DType::kF32).view({scratch_rows, H * kLora});
  DeviceInputUploader uploader;
  DeviceStepInputs dev = uploader.upload(p.si);
  OpContext ctx;
  ctx.device = Device::kCuda;
  ctx.stream = stream();
  ctx.inputs = &p.si;
  ctx.dev = &dev;
  ctx.kv_cache = ds ? &p.kv_ds : &p.kv_bf16;
  NUCLEUS_CHECK_OK(res.begin_step(ctx));
  op.run(ctx, {p.q_dev.view({T, H * kQk})}, {out, q_lat, o_lat});
  NUCLEUS_CHECK_OK(ctx.error);
  return from_bf16(host_copy<uint16_t>(out));
}

::testing::AssertionResult decode_matches(const std::vector<float>& got, const std::vector<float>& want, int64_t width) {
  double max_ref = 0;
  for (float w : want)
    if (!std::isnan(w)) max_ref = std::max(max_ref, std::fabs(static_cast<double>(w)));
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) continue;
    if (!(std::fabs(static_cast<double>(got[i]) - want[i]) <= 3e-2 * max_ref))
      return ::testing::AssertionFailure() << "first mismatch at [" << i / width << ", " << i % width << "]: got "
                                           << got[i] << ", want " << want[i] << " (max|want| " << max_ref << ")";
  }
  const double rel = rel_l2(got, want);
  if (!(rel <= 1e-2)) return ::testing::AssertionFailure() << "relative L2 error " << rel;
  return ::testing::AssertionSuccess() << "rel " << rel;
}

TEST_F(KvCacheDsMlaGpu, DecodeBackendsReadTileScaledRows) {
  uint64_t seed = 300;
  for (const DecodeCase& c : std::vector<DecodeCase>{{1, 1, 16, 16},
                                                     {1, 17, 16, 1},
                                                     {3, 64, 128, 64},
                                                     {3, 1000, 128, 16},
                                                     {1, 5000, 16, 64},
                                                     {3, 100, 4, 16},
                                                     {64, 1000, 16, 64},
                                                     {129, 64, 16, 1},
                                                     {32, 2000, 128, 64, 1, true},
                                                     {5, 300, 32, 16, 4, true},
                                                     {1, 40000, 16, 64}}) {
    DecodeProblem p = make_decode(c, seed++);
    const std::vector<float> rows = decode_rows(p.ds);
    // The nucleus kernel's operands: bf16 rows, or the rows as decoded where
    // the 64-key kernel converts fragments in registers (the rules' choice).
    const int64_t T = p.si.num_tokens();
    const bool reg = mla_decode_key_tile(T, c.heads) == 64 && mla_decode_fp8_register_convert(T, KvCacheDtype::kFp8DsMla);
    const std::vector<float> exact = decode_reference(p, rows), bf16_ops = decode_reference_bf16_operands(p, rows, !reg);
    std::string why;
    const std::vector<float> bf16 = run_decode("nucleus", p, false, &why);
    ASSERT_FALSE(bf16.empty()) << why;
    for (const char* backend : {"nucleus", "cuda_naive"}) {
      // cuda_naive computes in f32 from the rows as stored; nucleus multiplies
      // bf16 operands (see the file comment).
      const std::vector<float>& want = std::string(backend) == "nucleus" ? bf16_ops : exact;
      const std::vector<float> got = run_decode(backend, p, true, &why);
      ASSERT_FALSE(got.empty()) << backend << " refused an fp8_ds_mla cache: " << why;
      auto r = decode_matches(got, want, c.heads * kVHead);
      EXPECT_TRUE(r) << backend << " " << name(c);
      // The layout's own error against the bf16 cache is the CPU reference's
      // (random rows under a sharp softmax: up to ~0.35 here); the GPU adds
      // nothing beyond it.
      const double vs_bf16 = rel_l2(got, bf16), layout = rel_l2(want, bf16);
      std::printf("mla_decode fp8_ds_mla %-10s %-30s compared: %s; vs bf16 cache rel L2 %.4f (reference %.4f)\n",
                  backend, name(c).c_str(), r.message(), vs_bf16, layout);
      EXPECT_LE(vs_bf16, 1.05 * layout + 1e-2) << backend << " " << name(c);
    }
  }
}

// NUCLEUS_MLA_DECODE_BULK_LOADS on the tile-scaled layout: bulk row copies
// (656-byte rows) and cp.async pieces put the same bytes in shared memory,
// so the outputs are bit-identical.
TEST_F(KvCacheDsMlaGpu, BulkLoadsAgree) {
  uint64_t seed = 950;
  for (const DecodeCase& c :
       std::vector<DecodeCase>{{1, 1, 16, 16}, {1, 70, 16, 1}, {3, 1000, 16, 16}, {64, 1000, 16, 64}, {129, 64, 4, 1}}) {
    DecodeProblem p = make_decode(c, seed++);
    std::string why;
    std::vector<float> got[2];
    for (int bulk : {0, 1}) {
      setenv("NUCLEUS_MLA_DECODE_BULK_LOADS", bulk ? "1" : "0", 1);
      got[bulk] = run_decode("nucleus", p, true, &why);
      unsetenv("NUCLEUS_MLA_DECODE_BULK_LOADS");
      ASSERT_FALSE(got[bulk].empty()) << why;
    }
    EXPECT_EQ(got[0], got[1]) << name(c);
  }
}

// NUCLEUS_MLA_DECODE_FP8_REGISTER_CONVERT on the tile-scaled layout (the
// 64-key kernel): MMA fragments from the raw rows in registers (1: f16 MMAs on
// the e4m3 latent, each tile's scale on its partial scores and, over a power
// of two tracked per warp, on P; bf16 MMAs on the rope) and the bf16
// conversion tile (0) each match the reference on its own operands. Also
// with q times 2^16 and 2^-24 (the softmax scale divided by the same) and with
// every latent value times 2^-30 (tile scales ~1e-12: P times a scale would
// vanish in f16 without the power-of-two normalisation).
TEST_F(KvCacheDsMlaGpu, RegisterConvertAgrees) {
  uint64_t seed = 970;
  for (const DecodeCase& c : std::vector<DecodeCase>{
           {1, 1, 16, 16}, {1, 70, 16, 1}, {3, 1000, 16, 16}, {64, 1000, 16, 64}, {129, 64, 4, 1}, {2, 5000, 16, 64, 1, true}}) {
    for (int variant = 0; variant < 4; ++variant) {
      DecodeProblem p = make_decode(c, seed++);
      const float q_mul = variant == 1 ? 65536.0f : variant == 2 ? 0x1p-24f : 1.0f;
      if (q_mul != 1.0f) {
        for (float& v : p.q) v *= q_mul;
        p.q_dev = device_copy(to_bf16(p.q), DType::kBF16);
        p.dims.scale /= q_mul;
      }
      if (variant == 3) {
        for (float& v : p.latent) v *= 0x1p-30f;
        p.ds = encode_rows(p.latent);
        p.kv_ds.data = device_copy(p.ds, DType::kU8);
      }
      std::string why;
      for (int reg : {0, 1}) {
        // Each path against the reference on its operands (the rows under a
        // sharp softmax: see the file comment): bf16 rows (0), the rows as
        // decoded (1).
        const bool reg_runs = reg == 1 && mla_decode_key_tile(p.si.num_tokens(), c.heads) == 64;
        const std::vector<float> want = decode_reference_bf16_operands(p, decode_rows(p.ds), !reg_runs);
        setenv("NUCLEUS_MLA_DECODE_FP8_REGISTER_CONVERT", reg ? "1" : "0", 1);
        const std::vector<float> got = run_decode("nucleus", p, true, &why);
        unsetenv("NUCLEUS_MLA_DECODE_FP8_REGISTER_CONVERT");
        ASSERT_FALSE(got.empty()) << why;
        auto r = decode_matches(got, want, c.heads * kVHead);
        EXPECT_TRUE(r) << name(c) << " register convert " << reg << " variant " << variant;
        std::printf("mla_decode fp8_ds_mla register convert %d %-30s variant %d: %s\n", reg, name(c).c_str(), variant,
                    r.message());
      }
    }
  }
}

// NUCLEUS_MLA_DECODE_WGMMA on the tile-scaled layout: the 64-head wgmma
// kernel (each latent value read as bf16(stored * its tile's scale) in
// warpgroup 1's registers, the rope part copied) and the mma.sync kernels (0)
// each match the reference on their own operands, at 128 and 64 heads, page
// sizes 1, 16 and 64, one key, ragged and varying contexts, several query
// rows a sequence, 129 rows; also with every latent value times 2^-30 (tile
// scales ~1e-12: the scale is applied after the exact e4m3 conversion, in f32).
TEST_F(KvCacheDsMlaGpu, WgmmaAgrees) {
  std::vector<DecodeCase> cases;
  for (int heads : {128, 64}) {
    cases.push_back({1, 1, heads, 16});
    cases.push_back({1, 70, heads, 1});
    cases.push_back({3, 1000, heads, 16});
    cases.push_back({2, 4097, heads, 64});
    cases.push_back({9, 700, heads, 64, 1, true});
    cases.push_back({5, 300, heads, 16, 4, true});
  }
  cases.push_back({129, 64, 64, 1});
  uint64_t seed = 1300;
  for (const DecodeCase& c : cases) {
    for (int tiny = 0; tiny < 2; ++tiny) {
      DecodeProblem p = make_decode(c, seed++);
      if (tiny) {
        for (float& v : p.latent) v *= 0x1p-30f;
        p.ds = encode_rows(p.latent);
        p.kv_ds.data = device_copy(p.ds, DType::kU8);
      }
      const int64_t T = p.si.num_tokens();
      std::string why;
      for (int wgmma : {1, 0}) {
        testing::ScopedEnvValue e("NUCLEUS_MLA_DECODE_WGMMA", wgmma ? "1" : "0");
        ASSERT_EQ(mla_decode_wgmma(T, c.heads, KvCacheDtype::kFp8DsMla), wgmma == 1);
        // The mma.sync side may take the 64-key kernel's register path (rows as decoded).
        const bool reg = wgmma == 0 && mla_decode_key_tile(T, c.heads) == 64 &&
                         mla_decode_fp8_register_convert(T, KvCacheDtype::kFp8DsMla);
        const std::vector<float> want = decode_reference_bf16_operands(p, decode_rows(p.ds), !reg);
        const std::vector<float> got = run_decode("nucleus", p, true, &why);
        ASSERT_FALSE(got.empty()) << why;
        auto r = decode_matches(got, want, c.heads * kVHead);
        EXPECT_TRUE(r) << name(c) << " wgmma " << wgmma << " tiny " << tiny;
        std::printf("mla_decode fp8_ds_mla wgmma %d %-30s tiny %d: %s\n", wgmma, name(c).c_str(), tiny, r.message());
      }
    }
  }
}

TEST_F(KvCacheDsMlaGpu, ReadersThatCannotReadTheLayoutRefuseItByName) {
  LinearWeight w;
  w.name = "kv_b_proj";
  w.weight = Tensor::empty({16 * 256, kLora}, DType::kBF16, Device::kCuda);
  w.out_features = 16 * 256;
  w.in_features = kLora;
  const kernels::MlaDims dims{16, kNope, kRope, kVHead, kLora, kScale};
  MlaDecodeAttentionOp op(0, &w, dims, AttentionMode::kAuto, KvCacheDtype::kFp8DsMla);
  const auto* fi = decode_backend("flashinfer");
  ASSERT_NE(fi, nullptr);
  const Status s = fi->supports(op);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("fp8_ds_mla"), std::string::npos) << s.message();
  ASSERT_TRUE(op.select_backend(Device::kCuda).ok());
  EXPECT_EQ(op.backend(), "nucleus");
  GatherKvBProjSpec spec;
  spec.num_heads = 16;
  spec.qk_nope = kNope;
  spec.qk_rope = kRope;
  spec.v_head = kVHead;
  spec.kv_lora = kLora;
  spec.cache_dtype = KvCacheDtype::kFp8DsMla;
  auto fused = GatherKvBProj::create(w, spec, Device::kCuda, "fused");
  ASSERT_FALSE(fused.ok());
  EXPECT_NE(fused.status().message().find("fp8_ds_mla"), std::string::npos) << fused.status().message();
  auto any = GatherKvBProj::create(w, spec, Device::kCuda);
  ASSERT_TRUE(any.ok()) << any.status().to_string();
  EXPECT_STREQ((*any)->name(), "unfused");
  RopeKvCacheWriteOp rope(0, nullptr, dims, nullptr, 1.0f, KvCacheDtype::kFp8DsMla);
  EXPECT_TRUE(rope.select_backend(Device::kCuda).ok());
  MlaPrefillAttentionOp prefill(0, &w, dims, AttentionMode::kAuto, 8192, KvCacheDtype::kFp8DsMla);
  ASSERT_TRUE(prefill.select_backend(Device::kCuda).ok());
  EXPECT_EQ(prefill.backend(), "cuda_flash");
}

// ----------------------------------------------------------- prefill reads ---

struct SeqSpec {
  int context, num_q;
  int keys() const { return context + num_q; }
};

struct PrefillProblem {
  kernels::MlaDims dims{16, kNope, kRope, kVHead, kLora, kScale};
  std::vector<SeqSpec> seqs;
  std::vector<std::vector<float>> latent;  // per sequence [keys, 576]
  std::vector<float> q, w;
  int64_t rows() const {
    int64_t n = 0;
    for (const auto& s : seqs) n += s.num_q;
    return n;
  }
};

std::vector<float> run_prefill(const PrefillProblem& p, bool ds, const std::string& backend, int64_t chunk,
                               int block_size) {
  const int heads = static_cast<int>(p.dims.num_heads);
  const auto num_seqs = static_cast<int64_t>(p.seqs.size());
  int max_blocks = 0, num_blocks = 0;
  for (const auto& s : p.seqs) {
    const int b = (s.keys() + block_size - 1) / block_size;
    max_blocks = std::max(max_blocks, b);
    num_blocks += b;
  }
  num_blocks += 2;
  std::vector<int32_t> order(num_blocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(block_size * 7 + heads));
  std::vector<float> rows(static_cast<size_t>(num_blocks) * block_size * kLatent, 0.0f);
  StepInputs si;
  si.max_blocks_per_seq = max_blocks;
  si.block_tables.assign(num_seqs * max_blocks, -1);
  si.query_start = {0};
  int next = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const SeqSpec& sp = p.seqs[s];
    for (int b = 0; b < (sp.keys() + block_size - 1) / block_size; ++b) si.block_tables[s * max_blocks + b] = order[next++];
    for (int j = 0; j < sp.keys(); ++j) {
      const int64_t slot = static_cast<int64_t>(si.block_tables[s * max_blocks + j / block_size]) * block_size +
                           j % block_size;
      std::copy_n(p.latent[s].begin() + j * kLatent, kLatent, rows.begin() + slot * kLatent);
      if (j >= sp.context) {
        si.token_ids.push_back(0);
        si.positions.push_back(j);
        si.slot_mapping.push_back(slot);
      }
    }
    si.query_start.push_back(si.query_start.back() + sp.num_q);
    si.context_lens.push_back(sp.context);
  }
  KvCache kv;
  kv.num_layers = 1;
  kv.num_blocks = num_blocks;
  kv.block_size = block_size;
  kv.width = kLatent;
  kv.data = ds ? device_copy(encode_rows(rows), DType::kU8) : device_copy(to_bf16(rows), DType::kBF16);
  LinearWeight kv_b;
  kv_b.name = "kv_b_proj";
  kv_b.out_features = static_cast<int64_t>(heads) * (kNope + kVHead);
  kv_b.in_features = kLora;
  kv_b.weight = device_copy(to_bf16(p.w), DType::kBF16).view({kv_b.out_features, kLora});
  MlaPrefillAttentionOp op(0, &kv_b, p.dims, AttentionMode::kExpanded, chunk,
                           ds ? KvCacheDtype::kFp8DsMla : KvCacheDtype::kBF16);
  DeviceInputUploader uploader;
  DeviceStepInputs dev = uploader.upload(si);
  OpContext ctx;
  ctx.device = Device::kCuda;
  ctx.stream = stream();
  ctx.inputs = &si;
  ctx.dev = &dev;
  ctx.kv_cache = &kv;
  Tensor q = device_copy(to_bf16(p.q), DType::kBF16).view({p.rows(), heads * kQk});
  Tensor o = device_poisoned(p.rows() * heads * kVHead, DType::kBF16).view({p.rows(), heads * kVHead});
  const Backend<MlaPrefillAttentionOp>* chosen = nullptr;
  for (const auto& b : MlaPrefillAttentionOp::backends())
    if (b.device == Device::kCuda && backend == b.name) chosen = &b;
  NUCLEUS_CHECK(chosen != nullptr, "no mla_prefill backend {}", backend);
  NUCLEUS_CHECK_OK(op.use_backend(*chosen));
  StepResources res;
  NUCLEUS_CHECK_OK(res.reserve_ops({&op}, StepLimits{}, Device::kCuda));
  NUCLEUS_CHECK_OK(res.begin_step(ctx));
  op.run(ctx, {q}, {o});
  NUCLEUS_CHECK_OK(ctx.error);
  return from_bf16(host_copy<uint16_t>(o));
}

TEST_F(KvCacheDsMlaGpu, PrefillBackendsReadTileScaledRowsWithCachedPrefixes) {
  PrefillProblem p;
  p.seqs = {{0, 1}, {5, 30}, {100, 17}, {0, 256}, {2000, 3}};
  for (size_t i = 0; i < p.seqs.size(); ++i) p.latent.push_back(spread_rows(p.seqs[i].keys(), 700 + i));
  // q at 0.3: the rows' tiles span 0.01..100, so the scores still spread
  // over ~10 logits (with q at 3 they spread over ~100: the softmax is an
  // argmax whose near-ties the CUDA paths' bf16 k and v, expanded by a bf16
  // GEMM, flip against the f32 reference; H200, 2026-12-02: cuda_flash and
  // cuda_naive both 35.75 for 30.56 at [13, 515]).
  p.q = random_bf16_values(static_cast<size_t>(p.rows()) * p.dims.num_heads * kQk, 0.3f, 701);
  p.w = random_bf16_values(static_cast<size_t>(p.dims.num_heads) * (kNope + kVHead) * kLora, 0.05f, 702);
  // The reference on the decoded rows, rounded to bf16 as both CUDA paths
  // read them; and on the bf16 rows (what a bf16 cache holds): the layout's
  // own error.
  std::vector<float> want(p.rows() * p.dims.num_heads * kVHead), want_bf16(want.size());
  int64_t r0 = 0;
  for (size_t i = 0; i < p.seqs.size(); ++i) {
    for (bool tiled : {true, false}) {
      std::vector<float> rows = tiled ? decode_rows(encode_rows(p.latent[i])) : p.latent[i];
      for (float& x : rows) x = round_to_bf16(x);
      kernels::mla_attention_expanded_ref(p.dims, p.q.data() + r0 * p.dims.num_heads * kQk, p.dims.num_heads * kQk,
                                          p.seqs[i].num_q, p.seqs[i].context, rows.data(), p.w.data(),
                                          (tiled ? want : want_bf16).data() + r0 * p.dims.num_heads * kVHead,
                                          p.dims.num_heads * kVHead, nullptr);
    }
    r0 += p.seqs[i].num_q;
  }
  const double layout = rel_l2(want, want_bf16);
  for (const char* backend : {"cuda_flash", "cuda_naive"})
    for (int64_t chunk : {int64_t{8192}, int64_t{300}})
      for (int bs : {16, 64}) {
        const std::string tag = std::string(backend) + " chunk " + std::to_string(chunk) + " bs" + std::to_string(bs);
        const std::vector<float> got = run_prefill(p, true, backend, chunk, bs);
        EXPECT_TRUE(decode_matches(got, want, p.dims.num_heads * kVHead)) << tag;
        const double vs_bf16 = rel_l2(got, run_prefill(p, false, backend, chunk, bs));
        std::printf("mla_prefill fp8_ds_mla %s: rel L2 vs reference %.4f, vs bf16 cache %.4f (reference %.4f)\n",
                    tag.c_str(), rel_l2(got, want), vs_bf16, layout);
        // The GPU adds nothing beyond the layout's own error.
        EXPECT_LE(vs_bf16, 1.05 * layout + 1e-2) << tag;
      }
}

// ------------------------------------------------- gather_kv_b_proj reads ---

TEST_F(KvCacheDsMlaGpu, GatherDequantAndUnfusedGatherKvBProjReadRowsTheWriteKernelStored) {
  const RopeSetup s = rope_setup();
  const int64_t keys = 300, bs = 16, blocks = (keys + bs - 1) / bs + 2, heads = 16;
  std::vector<int32_t> table(blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(3));
  const std::vector<float> kv_a = spread_rows(keys, 41);
  std::vector<int32_t> pos(keys);
  std::vector<int64_t> slot(keys);
  for (int64_t j = 0; j < keys; ++j) {
    pos[j] = static_cast<int32_t>(j);
    slot[j] = int64_t{table[j / bs]} * bs + j % bs;
  }
  Tensor cache = sentinel_cache(blocks * bs, 0);
  launch_write(s, kv_a, pos, slot, cache);
  const std::vector<uint8_t> host = host_copy<uint8_t>(cache);
  Tensor d_table = device_copy(table, DType::kI32);
  // The gather: bf16(stored * scale) of the CPU decode, bit for bit.
  {
    Tensor latent = device_poisoned(keys * kLatent, DType::kBF16);
    ASSERT_EQ(kernels::launch_gather_dequant_latent(cache.raw(), DType::kU8, kLatent, 1.0f, d_table.data<int32_t>(),
                                                    static_cast<int>(bs), 0, keys, latent.data<__nv_bfloat16>(),
                                                    stream()),
              cudaSuccess);
    const std::vector<uint16_t> got = host_copy<uint16_t>(latent);
    const std::vector<float> all = decode_rows(host);
    for (int64_t j = 0; j < keys; ++j)
      for (int c = 0; c < kLatent; ++c)
        ASSERT_EQ(got[j * kLatent + c], f32_to_bf16(all[slot[j] * kLatent + c])) << "key " << j << " col " << c;
    EXPECT_EQ(kernels::launch_gather_dequant_latent(cache.raw(), DType::kU8, 512, 1.0f, d_table.data<int32_t>(),
                                                    static_cast<int>(bs), 0, keys, latent.data<__nv_bfloat16>(),
                                                    stream()),
              cudaErrorInvalidValue);
  }
  const std::vector<float> w = random_bf16_values(heads * (kNope + kVHead) * kLora, 0.05f, 42);
  LinearWeight kv_b;
  kv_b.name = "kv_b_proj";
  kv_b.out_features = heads * (kNope + kVHead);
  kv_b.in_features = kLora;
  kv_b.weight = device_copy(to_bf16(w), DType::kBF16).view({kv_b.out_features, kLora});
  GatherKvBProjSpec spec;
  spec.num_heads = heads;
  spec.qk_nope = kNope;
  spec.qk_rope = kRope;
  spec.v_head = kVHead;
  spec.kv_lora = kLora;
  spec.cache_dtype = KvCacheDtype::kFp8DsMla;
  std::vector<float> want_k(keys * heads * kQk), want_v(keys * heads * kVHead);
  {
    kernels::GatherKvBProjRefParams r;
    r.num_heads = heads;
    r.qk_nope = kNope;
    r.qk_rope = kRope;
    r.v_head = kVHead;
    r.kv_lora = kLora;
    r.cache = host.data();
    r.cache_dtype = DType::kU8;
    r.block_table = table.data();
    r.block_size = bs;
    r.num_keys = keys;
    r.weight = w.data();
    r.k = want_k.data();
    r.v = want_v.data();
    kernels::gather_kv_b_proj_ref(r);
  }
  auto op = GatherKvBProj::create(kv_b, spec, Device::kCuda, "unfused");
  ASSERT_TRUE(op.ok()) << op.status().to_string();
  Tensor dk = device_poisoned(keys * heads * kQk, DType::kBF16), dv = device_poisoned(keys * heads * kVHead, DType::kBF16);
  GatherKvBProjArgs a;
  a.cache = cache.raw();
  a.block_table = d_table.data<int32_t>();
  a.block_size = bs;
  a.key_begin = 0;
  a.num_keys = keys;
  a.k = dk.raw();
  a.v = dv.raw();
  a.stream = stream();
  (*op)->run(a);
  const double ek = rel_l2(from_bf16(host_copy<uint16_t>(dk)), want_k);
  const double ev = rel_l2(from_bf16(host_copy<uint16_t>(dv)), want_v);
  std::printf("gather_kv_b_proj unfused on rope-written fp8_ds_mla rows: rel L2 k %.2e v %.2e\n", ek, ev);
  EXPECT_LE(ek, 1e-2);
  EXPECT_LE(ev, 1e-2);
}

// -------------------------------------------------------- model dispatch ---

TEST_F(KvCacheDsMlaGpu, ModelOnATileScaledCacheDispatchesItsReaders) {
  ModelOptions o;
  o.device = Device::kCuda;
  o.kv_cache_dtype = KvCacheDtype::kFp8DsMla;
  auto m = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ((*m)->kv_cache_dtype(), KvCacheDtype::kFp8DsMla);
  EXPECT_EQ((*m)->kv_bytes_per_token(), 4 * kRow);
  const KvCache kv = (*m)->make_kv_cache(4, 16);
  EXPECT_EQ(kv.data.dtype(), DType::kU8);
  EXPECT_EQ(kv.data.nbytes(), 4u * 4u * 16u * kRow);
  EXPECT_EQ(kv.row_bytes(), kRow);
  for (StepKind k : {StepKind::kPrefill, StepKind::kDecode})
    for (const auto& n : (*m)->graph(k).nodes()) {
      const std::string kind = n.op->kind();
      if (kind == "mla_decode") {
        EXPECT_NE(n.op->backend(), "flashinfer") << n.name;
      }
      if (kind == "rope_kv_cache_write" || kind == "mla_decode" || kind == "mla_prefill") {
        EXPECT_NE(n.op->attrs().find("cache=fp8_ds_mla"), std::string::npos) << n.name;
      }
    }
  o.kv_scale = 0.5f;
  auto refused = load_deepseek_model(testing::model_path("tiny-dsv3"), o, {}, false);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("fp8_ds_mla"), std::string::npos) << refused.status().message();
}

}  // namespace
}  // namespace nucleus
