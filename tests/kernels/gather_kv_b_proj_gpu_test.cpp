// gather_kv_b_proj on CUDA: the fused kernel and the unfused path against a
// per-token reference written here (one key at a time: its slot through the
// block table, the decoded row, k_scale on an FP8 cache, dot products in
// double), and against each other; over paged layouts (block sizes 1, 16,
// 64), ragged ranges, chunkings, weight formats, cache dtypes and refusals.
//
// Tolerances, per output element with reference value `want`, term
// magnitude mag = sqrt(sum_i t_i^2) and l1 = sum_i |t_i| (t_i = latent_i * W_i):
//   exact:   |got - want| <= 2^-8 |want| + 2^-12 mag: one bf16 rounding of the
//            output plus f32 accumulation, for inputs that reach the tensor
//            cores unrounded (bf16 / FP8 values, FP8 converted exactly), checked
//            against a reference that makes the same input roundings as the
//            path (the unfused path's bf16 weight from FP8 or F32 and its
//            bf16(latent * k_scale); either path's bf16(f32 cache));
//   rounded: + 2^-8 l1 against the exact reference: what those roundings can
//            add at most (each term's relative error <= 2^-9 + 2^-9);
//   fused vs unfused: the sum of both paths' tolerances.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/cuda/context.h"
#include "core/parallel.h"
#include "gpu_test_util.h"
#include "ops/gather_kv_b_proj.h"

namespace nucleus {
namespace {

using testing::device_copy;
using testing::from_bf16;
using testing::host_copy;

struct Dims {
  int64_t num_heads, qk_nope, qk_rope, v_head, kv_lora;
  int64_t n() const { return num_heads * (qk_nope + v_head); }
  int64_t width() const { return kv_lora + qk_rope; }
  int64_t k_row() const { return qk_nope + qk_rope; }
};
constexpr Dims kV2Lite{16, 128, 64, 128, 512};
constexpr Dims kV3{128, 128, 64, 128, 512};
constexpr Dims kOdd{3, 16, 4, 24, 40};  // rows of 44: no 16-byte chunks


GatherKvBProjSpec spec_of(const Dims& d, KvCacheDtype c = KvCacheDtype::kBF16) {
  GatherKvBProjSpec s;
  s.num_heads = d.num_heads;
  s.qk_nope = d.qk_nope;
  s.qk_rope = d.qk_rope;
  s.v_head = d.v_head;
  s.kv_lora = d.kv_lora;
  s.cache_dtype = c;
  return s;
}

Tensor cpu_tensor(std::vector<int64_t> shape, DType dtype, const void* bytes) {
  Tensor t = Tensor::empty(std::move(shape), dtype);
  std::memcpy(t.raw(), bytes, t.nbytes());
  return t;
}

struct Cache {
  KvCacheDtype dtype;
  Tensor device;
  std::vector<float> values;  // [num_slots, width]: what the stored bytes mean
};

Cache make_cache(KvCacheDtype dtype, int64_t num_slots, int64_t width, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.5f, 1.5f);
  Cache c{dtype, Tensor(), std::vector<float>(num_slots * width)};
  std::vector<uint8_t> bytes;
  if (dtype == KvCacheDtype::kF32) {
    for (auto& x : c.values) x = u(rng);
    c.device = device_copy(c.values, DType::kF32);
  } else if (dtype == KvCacheDtype::kBF16) {
    for (auto& x : c.values) x = round_to_bf16(u(rng));
    c.device = device_copy(testing::to_bf16(c.values), DType::kBF16);
  } else {
    bytes.resize(c.values.size());
    for (size_t i = 0; i < bytes.size(); ++i) {
      bytes[i] = f32_to_fp8e4m3(u(rng));
      c.values[i] = fp8e4m3_to_f32(bytes[i]);
    }
    c.device = device_copy(bytes, DType::kF8E4M3);
  }
  return c;
}

struct Table {
  std::vector<int32_t> host;
  Tensor device;
};

Table make_table(int64_t num_blocks, uint64_t seed) {  // blocks shuffled: a wrong lookup reads other rows
  Table t{std::vector<int32_t>(num_blocks), Tensor()};
  std::iota(t.host.begin(), t.host.end(), 0);
  std::shuffle(t.host.begin(), t.host.end(), std::mt19937_64(seed));
  t.device = device_copy(t.host, DType::kI32);
  return t;
}

enum class WeightKind { kBf16, kF32, kFp8PerRow, kFp8PerRowN1, kFp8Block, kFp8BlockE8m0, kFp8PerRowE8m0 };
const char* kind_name(WeightKind k) {
  static const char* names[] = {"bf16", "f32", "fp8 per-row [n]", "fp8 per-row [n,1]", "fp8 block f32",
                                "fp8 block e8m0", "fp8 per-row e8m0"};
  return names[static_cast<int>(k)];
}

struct Weight {
  LinearWeight lw;       // host tensors (create() uploads them)
  std::vector<float> w;  // [n, k]: W as design.md "FP8 weights" gives it
};

Weight make_weight(WeightKind kind, const Dims& d, uint64_t seed, int64_t bn = 128, int64_t bk = 128) {
  const int64_t n = d.n(), k = d.kv_lora;
  const int64_t nb = (n + bn - 1) / bn, kb = (k + bk - 1) / bk;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Weight out;
  out.w.resize(n * k);
  out.lw.name = "test.kv_b_proj";
  out.lw.out_features = n;
  out.lw.in_features = k;
  if (kind == WeightKind::kBf16 || kind == WeightKind::kF32) {
    for (auto& x : out.w) x = round_to_bf16(0.06f * u(rng));
    const auto h = testing::to_bf16(out.w);
    out.lw.weight = kind == WeightKind::kBf16 ? cpu_tensor({n, k}, DType::kBF16, h.data())
                                              : cpu_tensor({n, k}, DType::kF32, out.w.data());
    return out;
  }
  std::vector<uint8_t> q(n * k);
  for (auto& b : q) b = f32_to_fp8e4m3(300.0f * u(rng));
  out.lw.weight = cpu_tensor({n, k}, DType::kF8E4M3, q.data());
  std::uniform_real_distribution<float> us(1e-4f, 4e-4f);
  std::uniform_int_distribution<int> ue(112, 116);
  const bool per_row = kind == WeightKind::kFp8PerRow || kind == WeightKind::kFp8PerRowN1 ||
                       kind == WeightKind::kFp8PerRowE8m0;
  const bool e8m0 = kind == WeightKind::kFp8BlockE8m0 || kind == WeightKind::kFp8PerRowE8m0;
  const int64_t count = per_row ? n : nb * kb;
  std::vector<float> sf(count), scale(count);
  std::vector<uint8_t> se(count);
  for (int64_t i = 0; i < count; ++i) {
    sf[i] = us(rng);
    se[i] = static_cast<uint8_t>(ue(rng));
    scale[i] = e8m0 ? std::ldexp(1.0f, se[i] - 127) : sf[i];
  }
  std::vector<int64_t> shape = per_row ? (kind == WeightKind::kFp8PerRowN1 ? std::vector<int64_t>{n, 1}
                                                                            : std::vector<int64_t>{n})
                                       : std::vector<int64_t>{nb, kb};
  out.lw.scale_inv = e8m0 ? cpu_tensor(shape, DType::kU8, se.data()) : cpu_tensor(shape, DType::kF32, sf.data());
  if (!per_row) out.lw.block_n = bn, out.lw.block_k = bk;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c)
      out.w[r * k + c] = fp8e4m3_to_f32(q[r * k + c]) * scale[per_row ? r : (r / bn) * kb + c / bk];
  return out;
}

struct Ref {
  std::vector<float> k, v;          // reference values
  std::vector<float> k_mag, v_mag;  // sqrt(sum of squared terms); |value| for k_pe
  std::vector<float> k_l1, v_l1;    // sum of |terms|; |value| for k_pe
};

// What a path rounds to bf16 before its GEMM: the unfused path's weight
// (FP8 dequantized, or F32, once at create()) and latent rows
// (bf16(row * k_scale) for FP8, bf16(row) for f32); the fused path rounds only
// an f32 cache's rows. A reference made with the same roundings checks the
// rest of a path's arithmetic at the exact-input tolerance.
struct Rounding {
  bool weight = false;
  bool latent = false;
};

// The per-token reference (optionally with a path's input roundings).
Ref reference(const Dims& d, const Cache& c, float k_scale, const Table& t, int64_t block_size, int64_t key_begin,
              int64_t num_keys, const Weight& w, Rounding rd = {}) {
  const int64_t kr = d.k_row(), hk = d.qk_nope + d.v_head;
  std::vector<float> w_rounded;
  if (rd.weight) {
    w_rounded.resize(w.w.size());
    for (size_t i = 0; i < w.w.size(); ++i) w_rounded[i] = round_to_bf16(w.w[i]);
  }
  const float* wd = rd.weight ? w_rounded.data() : w.w.data();
  const bool fp8 = c.dtype == KvCacheDtype::kFp8E4M3;
  Ref r;
  r.k.assign(num_keys * d.num_heads * kr, 0);
  r.v.assign(num_keys * d.num_heads * d.v_head, 0);
  r.k_mag = r.k_l1 = r.k;
  r.v_mag = r.v_l1 = r.v;
  parallel_for(num_keys, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t pos = key_begin + j;
      const int64_t slot = t.host[pos / block_size] * block_size + pos % block_size;
      std::vector<double> row(d.width());
      for (int64_t i = 0; i < d.width(); ++i) {
        const float x = c.values[slot * d.width() + i];
        row[i] = rd.latent ? round_to_bf16(fp8 ? x * k_scale : x) : (fp8 ? double{x} * k_scale : double{x});
      }
      for (int64_t h = 0; h < d.num_heads; ++h) {
        const int64_t kh = j * d.num_heads + h;
        for (int64_t o = 0; o < hk; ++o) {
          const float* wr = wd + (h * hk + o) * d.kv_lora;
          double s = 0, s2 = 0, s1 = 0;
          for (int64_t i = 0; i < d.kv_lora; ++i) {
            const double term = row[i] * wr[i];
            s += term;
            s2 += term * term;
            s1 += std::fabs(term);
          }
          const int64_t at = o < d.qk_nope ? kh * kr + o : kh * d.v_head + o - d.qk_nope;
          (o < d.qk_nope ? r.k : r.v)[at] = static_cast<float>(s);
          (o < d.qk_nope ? r.k_mag : r.v_mag)[at] = static_cast<float>(std::sqrt(s2));
          (o < d.qk_nope ? r.k_l1 : r.v_l1)[at] = static_cast<float>(s1);
        }
        for (int64_t i = 0; i < d.qk_rope; ++i) {
          const int64_t at = kh * kr + d.qk_nope + i;
          r.k[at] = static_cast<float>(row[d.kv_lora + i]);
          r.k_mag[at] = r.k_l1[at] = static_cast<float>(std::fabs(row[d.kv_lora + i]));
        }
      }
    }
  });
  return r;
}

struct KvOut {
  std::vector<float> k, v;
};

KvOut run_op(GatherKvBProj& op, const Dims& d, const Cache& c, float k_scale, const Table& t, int64_t block_size,
             int64_t key_begin, int64_t num_keys, const Tensor& workspace = Tensor()) {
  Tensor dk = testing::device_poisoned(std::max<int64_t>(1, num_keys * d.num_heads * d.k_row()), DType::kBF16);
  Tensor dv = testing::device_poisoned(std::max<int64_t>(1, num_keys * d.num_heads * d.v_head), DType::kBF16);
  GatherKvBProjArgs a;
  a.cache = c.device.raw();
  a.k_scale = k_scale;
  a.block_table = t.device.data<int32_t>();
  a.block_size = block_size;
  a.key_begin = key_begin;
  a.num_keys = num_keys;
  a.k = dk.raw();
  a.v = dv.raw();
  a.stream = cuda::context().stream;
  if (workspace.defined()) {
    a.workspace = workspace.raw();
    a.workspace_bytes = workspace.nbytes();
  }
  op.run(a);
  return {from_bf16(host_copy<uint16_t>(dk)), from_bf16(host_copy<uint16_t>(dv))};
}

// Tolerances (see the top of the file): kExact for a path whose inputs reach
// the tensor cores unrounded, checked against a reference with the same
// roundings; kRounded bounds what bf16 inputs can add (each term's relative
// error <= 2^-9 + 2^-9), checked against the exact reference.
enum class Tol { kExact, kRounded };

std::vector<double> tolerance(const std::vector<float>& want, const std::vector<float>& mag,
                              const std::vector<float>& l1, Tol t) {
  std::vector<double> tol(want.size());
  for (size_t i = 0; i < tol.size(); ++i)
    tol[i] = std::ldexp(std::fabs(double{want[i]}), -8) + std::ldexp(double{mag[i]}, -12) +
             (t == Tol::kRounded ? std::ldexp(double{l1[i]}, -8) : 0.0) + 1e-6;
  return tol;
}

// |got - want| <= tol everywhere; names the first failure as [key, head, column].
::testing::AssertionResult within(const std::vector<float>& got, const std::vector<float>& want,
                                  const std::vector<double>& tol, int64_t num_heads, int64_t row) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(double{got[i]} - want[i]);
    worst = std::max(worst, err / tol[i]);
    if (!(err <= tol[i]))
      return ::testing::AssertionFailure()
             << "first mismatch at [key " << i / (num_heads * row) << ", head " << (i / row) % num_heads << ", col "
             << i % row << "]: got " << got[i] << ", want " << want[i] << " (tol " << tol[i] << ")";
  }
  return ::testing::AssertionSuccess() << "worst error / tolerance " << worst;
}

::testing::AssertionResult matches(const KvOut& got, const Ref& r, const Dims& d, Tol t = Tol::kExact) {
  auto k = within(got.k, r.k, tolerance(r.k, r.k_mag, r.k_l1, t), d.num_heads, d.k_row());
  if (!k) return k << " (k)";
  auto v = within(got.v, r.v, tolerance(r.v, r.v_mag, r.v_l1, t), d.num_heads, d.v_head);
  if (!v) return v << " (v)";
  return ::testing::AssertionSuccess();
}

// fused vs unfused: the sum of both paths' tolerances against the exact reference.
::testing::AssertionResult agree(const KvOut& a, const KvOut& b, const Ref& r, const Dims& d, Tol ta, Tol tb) {
  auto sum = [](std::vector<double> x, const std::vector<double>& y) {
    for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
    return x;
  };
  auto k = within(a.k, b.k, sum(tolerance(r.k, r.k_mag, r.k_l1, ta), tolerance(r.k, r.k_mag, r.k_l1, tb)),
                  d.num_heads, d.k_row());
  if (!k) return k << " (k, fused vs unfused)";
  auto v = within(a.v, b.v, sum(tolerance(r.v, r.v_mag, r.v_l1, ta), tolerance(r.v, r.v_mag, r.v_l1, tb)),
                  d.num_heads, d.v_head);
  if (!v) return v << " (v, fused vs unfused)";
  return ::testing::AssertionSuccess();
}

class GatherKvBProjGpu : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device"; }
  static std::unique_ptr<GatherKvBProj> make(const LinearWeight& lw, const GatherKvBProjSpec& s,
                                             const std::string& forced) {
    auto op = GatherKvBProj::create(lw, s, Device::kCuda, forced);
    EXPECT_TRUE(op.ok()) << forced << ": " << op.status().to_string();
    if (op.ok() && !forced.empty()) {
      EXPECT_STREQ((*op)->name(), forced.c_str());
    }
    return op.ok() ? std::move(op).value() : nullptr;
  }
};

struct Range {
  int64_t key_begin, num_keys;
};

TEST_F(GatherKvBProjGpu, PagedRaggedRangesBothPaths) {
  const Dims d = kV2Lite;
  const Weight w = make_weight(WeightKind::kBf16, d, 1);
  auto dflt = make(w.lw, spec_of(d), "");
  ASSERT_TRUE(dflt);
  EXPECT_STREQ(dflt->name(), "unfused");  // measured faster: DefaultIsTheMeasuredFasterPath
  auto fused = make(w.lw, spec_of(d), "fused");
  auto unfused = make(w.lw, spec_of(d), "unfused");
  ASSERT_TRUE(fused && unfused);
  for (int64_t bs : {1, 16, 64}) {
    const int64_t num_blocks = (400 + bs - 1) / bs + 1;
    const Cache c = make_cache(KvCacheDtype::kBF16, num_blocks * bs, d.width(), 2);
    const Table t = make_table(num_blocks, 3 + bs);
    for (Range r : {Range{0, 1}, Range{bs > 1 ? bs / 2 : 7, 1}, Range{5, 37}, Range{bs + 3, 300}, Range{0, 129}}) {
      const Ref ref = reference(d, c, 1.0f, t, bs, r.key_begin, r.num_keys, w);
      const KvOut f = run_op(*fused, d, c, 1.0f, t, bs, r.key_begin, r.num_keys);
      const KvOut u = run_op(*unfused, d, c, 1.0f, t, bs, r.key_begin, r.num_keys);
      EXPECT_TRUE(matches(f, ref, d)) << "fused bs=" << bs << " begin=" << r.key_begin << " keys=" << r.num_keys;
      EXPECT_TRUE(matches(u, ref, d)) << "unfused bs=" << bs << " begin=" << r.key_begin << " keys=" << r.num_keys;
      EXPECT_TRUE(agree(f, u, ref, d, Tol::kExact, Tol::kExact)) << "bs=" << bs << " begin=" << r.key_begin;
    }
  }
}

TEST_F(GatherKvBProjGpu, WeightFormats) {
  const Dims d = kV2Lite;
  const int64_t bs = 16;
  const Cache c = make_cache(KvCacheDtype::kBF16, 16 * bs, d.width(), 7);
  const Table t = make_table(16, 8);
  for (WeightKind kind : {WeightKind::kF32, WeightKind::kFp8PerRow, WeightKind::kFp8PerRowN1, WeightKind::kFp8Block,
                          WeightKind::kFp8BlockE8m0, WeightKind::kFp8PerRowE8m0}) {
    const Weight w = make_weight(kind, d, 9 + static_cast<int>(kind));
    const Ref ref = reference(d, c, 1.0f, t, bs, 3, 200, w);
    auto dflt = make(w.lw, spec_of(d), "");
    ASSERT_TRUE(dflt);
    EXPECT_STREQ(dflt->name(), "unfused") << kind_name(kind);
    auto unfused = make(w.lw, spec_of(d), "unfused");
    ASSERT_TRUE(unfused);
    // The unfused path turns F32 and FP8 weights into bf16 once: rounded inputs.
    const KvOut u = run_op(*unfused, d, c, 1.0f, t, bs, 3, 200);
    EXPECT_TRUE(matches(u, reference(d, c, 1.0f, t, bs, 3, 200, w, Rounding{true, false}), d))
        << "unfused " << kind_name(kind);
    EXPECT_TRUE(matches(u, ref, d, Tol::kRounded)) << "unfused " << kind_name(kind);
    if (kind == WeightKind::kF32) continue;  // the fused kernel refuses F32 weights
    auto fused = make(w.lw, spec_of(d), "fused");
    ASSERT_TRUE(fused);
    const KvOut f = run_op(*fused, d, c, 1.0f, t, bs, 3, 200);
    EXPECT_TRUE(matches(f, ref, d)) << "fused " << kind_name(kind);
    EXPECT_TRUE(agree(f, u, ref, d, Tol::kExact, Tol::kRounded)) << kind_name(kind);
  }
}

TEST_F(GatherKvBProjGpu, DeepSeekV3ShapeFp8BlockDeviceWeights) {
  const Dims d = kV3;  // 128 heads: 256 column tiles, several per CTA
  const int64_t bs = 64;
  Weight w = make_weight(WeightKind::kFp8Block, d, 20);
  w.lw.weight = to_device(w.lw.weight);  // as the model holds them
  w.lw.scale_inv = to_device(w.lw.scale_inv);
  const Cache c = make_cache(KvCacheDtype::kBF16, 5 * bs, d.width(), 21);
  const Table t = make_table(5, 22);
  const Ref ref = reference(d, c, 1.0f, t, bs, 100, 130, w);
  auto fused = make(w.lw, spec_of(d), "fused");
  auto unfused = make(w.lw, spec_of(d), "unfused");
  ASSERT_TRUE(fused && unfused);
  const KvOut f = run_op(*fused, d, c, 1.0f, t, bs, 100, 130);
  const KvOut u = run_op(*unfused, d, c, 1.0f, t, bs, 100, 130);
  EXPECT_TRUE(matches(f, ref, d));
  EXPECT_TRUE(matches(u, reference(d, c, 1.0f, t, bs, 100, 130, w, Rounding{true, false}), d));
  EXPECT_TRUE(matches(u, ref, d, Tol::kRounded));
  EXPECT_TRUE(agree(f, u, ref, d, Tol::kExact, Tol::kRounded));
}

// The dispatch follows docs/perf.md "gather_kv_b_proj (cached-prefix K/V
// expansion)": the unfused path was the faster at every measured shape (16
// and 128 heads, bf16 and FP8 128x128-block weights), so it serves by default
// there; this fails if the order flips back without a new measurement.
TEST_F(GatherKvBProjGpu, DefaultIsTheMeasuredFasterPath) {
  EXPECT_EQ(GatherKvBProj::dispatch_order(Device::kCuda), (std::vector<std::string>{"unfused", "fused"}));
  for (const Dims& d : {kV2Lite, kV3})
    for (WeightKind kind : {WeightKind::kBf16, WeightKind::kFp8Block}) {
      const Weight w = make_weight(kind, d, 40 + static_cast<int>(kind));
      auto dflt = make(w.lw, spec_of(d), "");
      ASSERT_TRUE(dflt);
      EXPECT_STREQ(dflt->name(), "unfused") << d.num_heads << " heads, " << kind_name(kind);
      auto fused = make(w.lw, spec_of(d), "fused");  // still served when forced
      ASSERT_TRUE(fused);
      EXPECT_EQ(fused->workspace_bytes(4096), 0u);
    }
}

// A caller's workspace (the step arena, as mla_prefill's cuda_flash passes
// it) gives the unfused path the same result as its own scratch; its size is
// the two bf16 pieces, 256-byte rounded.
TEST_F(GatherKvBProjGpu, UnfusedRunsInTheCallersWorkspace) {
  const Dims d = kV2Lite;
  const int64_t bs = 16, keys = 700;
  const Weight w = make_weight(WeightKind::kFp8Block, d, 50);
  auto unfused = make(w.lw, spec_of(d), "unfused");
  ASSERT_TRUE(unfused);
  auto up = [](size_t x) { return (x + 255) / 256 * 256; };
  const size_t need = unfused->workspace_bytes(keys);
  EXPECT_EQ(need, up(keys * d.width() * 2) + up(keys * d.n() * 2));
  EXPECT_EQ(unfused->workspace_bytes(1 << 20), up((256 << 20) / (d.n() * 2) * d.width() * 2) + (256u << 20));
  const int64_t num_blocks = (keys + 40 + bs - 1) / bs + 1;
  const Cache c = make_cache(KvCacheDtype::kBF16, num_blocks * bs, d.width(), 51);
  const Table t = make_table(num_blocks, 52);
  const Tensor ws = testing::device_poisoned(static_cast<int64_t>(need), DType::kU8);
  const KvOut own = run_op(*unfused, d, c, 1.0f, t, bs, 40, keys);
  const KvOut given = run_op(*unfused, d, c, 1.0f, t, bs, 40, keys, ws);
  EXPECT_TRUE(matches(given, reference(d, c, 1.0f, t, bs, 40, keys, w, Rounding{true, false}), d));
  EXPECT_EQ(0, std::memcmp(own.k.data(), given.k.data(), own.k.size() * 4));
  EXPECT_EQ(0, std::memcmp(own.v.data(), given.v.data(), own.v.size() * 4));
}

TEST_F(GatherKvBProjGpu, ManyKeysAndChunkSizeInvariance) {
  const Dims d = kV2Lite;
  const int64_t bs = 16, keys = 1500;
  const Weight w = make_weight(WeightKind::kBf16, d, 30);
  auto fused = make(w.lw, spec_of(d), "fused");
  auto unfused = make(w.lw, spec_of(d), "unfused");
  ASSERT_TRUE(fused && unfused);
  const Cache c = make_cache(KvCacheDtype::kBF16, (keys / bs + 2) * bs, d.width(), 31);
  const Table t = make_table(keys / bs + 2, 32);
  const Ref ref = reference(d, c, 1.0f, t, bs, 0, keys, w);
  const KvOut fw = run_op(*fused, d, c, 1.0f, t, bs, 0, keys);
  const KvOut uw = run_op(*unfused, d, c, 1.0f, t, bs, 0, keys);
  EXPECT_TRUE(matches(fw, ref, d));
  EXPECT_TRUE(matches(uw, ref, d));
  for (std::vector<int64_t> cuts : {std::vector<int64_t>{1, 17, 129, 256}, std::vector<int64_t>{700},
                                     std::vector<int64_t>{1499}}) {
    cuts.insert(cuts.begin(), 0);
    cuts.push_back(keys);
    KvOut fp, up;
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      KvOut a = run_op(*fused, d, c, 1.0f, t, bs, cuts[i], cuts[i + 1] - cuts[i]);
      KvOut b = run_op(*unfused, d, c, 1.0f, t, bs, cuts[i], cuts[i + 1] - cuts[i]);
      fp.k.insert(fp.k.end(), a.k.begin(), a.k.end());
      fp.v.insert(fp.v.end(), a.v.begin(), a.v.end());
      up.k.insert(up.k.end(), b.k.begin(), b.k.end());
      up.v.insert(up.v.end(), b.v.begin(), b.v.end());
    }
    // The fused kernel computes each key's row the same way wherever the row
    // sits in a tile: bit-identical. The unfused GEMM may pick another
    // algorithm per row count: within tolerance.
    EXPECT_EQ(0, std::memcmp(fp.k.data(), fw.k.data(), fw.k.size() * 4)) << "fused k, " << cuts.size() - 1 << " pieces";
    EXPECT_EQ(0, std::memcmp(fp.v.data(), fw.v.data(), fw.v.size() * 4)) << "fused v, " << cuts.size() - 1 << " pieces";
    EXPECT_TRUE(matches(up, ref, d)) << "unfused, " << cuts.size() - 1 << " pieces";
  }
}

TEST_F(GatherKvBProjGpu, Bf16AndF32CachesAreNeverScaled) {
  const Dims d = kV2Lite;
  const int64_t bs = 16;
  const Weight w = make_weight(WeightKind::kBf16, d, 40);
  const Table t = make_table(8, 41);
  for (KvCacheDtype cd : {KvCacheDtype::kBF16, KvCacheDtype::kF32}) {
    const Cache c = make_cache(cd, 8 * bs, d.width(), 42);
    const Ref ref = reference(d, c, 1.0f, t, bs, 5, 100, w);  // what an unscaled cache gives
    // Both paths round an f32 cache's rows to bf16.
    const Ref ref_rounded = reference(d, c, 1.0f, t, bs, 5, 100, w, Rounding{false, cd == KvCacheDtype::kF32});
    for (const char* impl : {"fused", "unfused"}) {
      auto op = make(w.lw, spec_of(d, cd), impl);
      ASSERT_TRUE(op);
      const KvOut one = run_op(*op, d, c, 1.0f, t, bs, 5, 100);
      const KvOut two = run_op(*op, d, c, 2.0f, t, bs, 5, 100);  // would double every value if applied
      EXPECT_TRUE(matches(two, ref_rounded, d)) << impl << " cache " << static_cast<int>(cd);
      EXPECT_TRUE(matches(two, ref, d, Tol::kRounded)) << impl << " cache " << static_cast<int>(cd);
      EXPECT_EQ(0, std::memcmp(one.k.data(), two.k.data(), one.k.size() * 4)) << impl;
      EXPECT_EQ(0, std::memcmp(one.v.data(), two.v.data(), one.v.size() * 4)) << impl;
    }
  }
}

TEST_F(GatherKvBProjGpu, Fp8CacheIsScaledByKScale) {
  const Dims d = kV2Lite;
  const int64_t bs = 64;
  const Cache c = make_cache(KvCacheDtype::kFp8E4M3, 4 * bs, d.width(), 50);
  const Table t = make_table(4, 51);
  for (WeightKind kind : {WeightKind::kBf16, WeightKind::kFp8Block}) {
    const Weight w = make_weight(kind, d, 52);
    const Ref ref = reference(d, c, 0.37f, t, bs, 30, 150, w);
    for (const char* impl : {"fused", "unfused"}) {
      auto op = make(w.lw, spec_of(d, KvCacheDtype::kFp8E4M3), impl);
      ASSERT_TRUE(op);
      const KvOut scaled = run_op(*op, d, c, 0.37f, t, bs, 30, 150);
      const KvOut unscaled = run_op(*op, d, c, 1.0f, t, bs, 30, 150);
      // Fused: FP8 rows enter the tensor cores exactly and k_scale multiplies the f32 sums; unfused rounds
      // bf16(latent * k_scale) (and an FP8 weight to bf16).
      const bool fused = std::string(impl) == "fused";
      const Ref& want = fused ? ref : reference(d, c, 0.37f, t, bs, 30, 150, w, Rounding{kind != WeightKind::kBf16, true});
      EXPECT_TRUE(matches(scaled, want, d)) << impl << " " << kind_name(kind);
      EXPECT_TRUE(matches(scaled, ref, d, Tol::kRounded)) << impl << " " << kind_name(kind);
      EXPECT_FALSE(matches(unscaled, ref, d, Tol::kRounded)) << impl << " ignored k_scale";
    }
  }
}

TEST_F(GatherKvBProjGpu, ZeroKeysWritesNothing) {
  const Weight w = make_weight(WeightKind::kBf16, kV2Lite, 60);
  const Cache c = make_cache(KvCacheDtype::kBF16, 16, kV2Lite.width(), 61);
  const Table t = make_table(1, 62);
  for (const char* impl : {"fused", "unfused"}) {
    auto op = make(w.lw, spec_of(kV2Lite), impl);
    ASSERT_TRUE(op);
    const KvOut out = run_op(*op, kV2Lite, c, 1.0f, t, 16, 3, 0);
    const float poison = bf16_to_f32(0x7f7f);
    EXPECT_EQ(out.k, std::vector<float>(1, poison)) << impl;
    EXPECT_EQ(out.v, std::vector<float>(1, poison)) << impl;
  }
}

TEST_F(GatherKvBProjGpu, OddShapesTakeTheUnfusedPath) {
  const Dims d = kOdd;
  const int64_t bs = 16;
  const Weight w = make_weight(WeightKind::kBf16, d, 70);
  auto op = make(w.lw, spec_of(d), "");
  ASSERT_TRUE(op);
  EXPECT_STREQ(op->name(), "unfused");
  const Cache c = make_cache(KvCacheDtype::kBF16, 8 * bs, d.width(), 71);
  const Table t = make_table(8, 72);
  const Ref ref = reference(d, c, 1.0f, t, bs, 7, 90, w);
  EXPECT_TRUE(matches(run_op(*op, d, c, 1.0f, t, bs, 7, 90), ref, d));
  auto forced = GatherKvBProj::create(w.lw, spec_of(d), Device::kCuda, "fused");
  ASSERT_FALSE(forced.ok());
  EXPECT_NE(forced.status().message().find("fused: needs kv_lora % 64 == 0"), std::string::npos)
      << forced.status().message();
}

void expect_refused(const StatusOr<std::unique_ptr<GatherKvBProj>>& r, const std::vector<std::string>& parts) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnsupported) << r.status().to_string();
  for (const auto& p : parts) EXPECT_NE(r.status().message().find(p), std::string::npos) << r.status().message();
}

TEST_F(GatherKvBProjGpu, Refusals) {
  const Dims d = kV2Lite;
  const GatherKvBProjSpec s = spec_of(d);
  auto create = [&](const LinearWeight& lw, const GatherKvBProjSpec& spec, const std::string& forced = "") {
    return GatherKvBProj::create(lw, spec, Device::kCuda, forced);
  };
  // Packed FP4 weight: U8 [n, k/2].
  Weight fp4 = make_weight(WeightKind::kBf16, d, 80);
  std::vector<uint8_t> packed(d.n() * d.kv_lora / 2, 0x22);
  fp4.lw.weight = cpu_tensor({d.n(), d.kv_lora / 2}, DType::kU8, packed.data());
  expect_refused(create(fp4.lw, s), {"no cuda implementation of gather_kv_b_proj reads kv_b_proj 'test.kv_b_proj' "
                                     "(weight U8 [4096, 256], scale_inv none)",
                                     "fused: kv_b_proj 'test.kv_b_proj' weight is U8 [4096, 256] = [n, k/2]: packed FP4",
                                     "unfused: kv_b_proj 'test.kv_b_proj' weight is U8 [4096, 256] = [n, k/2]: packed FP4"});
  // An unknown scale shape.
  Weight odd = make_weight(WeightKind::kFp8Block, d, 81);
  std::vector<float> ones(3 * 5, 1.0f);
  odd.lw.scale_inv = cpu_tensor({3, 5}, DType::kF32, ones.data());
  expect_refused(create(odd.lw, s), {"fused: kv_b_proj 'test.kv_b_proj' scale_inv F32 [3, 5] is neither per-row",
                                     "unfused: kv_b_proj 'test.kv_b_proj' scale_inv F32 [3, 5] is neither per-row"});
  // A shuffled cache.
  GatherKvBProjSpec shuffled = s;
  shuffled.shuffled_cache = true;
  expect_refused(create(make_weight(WeightKind::kBf16, d, 82).lw, shuffled),
                 {"fused: shuffled_cache is set", "unfused: shuffled_cache is set"});
  // Forcing the fused kernel where it refuses: F32 weights, 64x128 block scales.
  expect_refused(create(make_weight(WeightKind::kF32, d, 83).lw, s, "fused"),
                 {"(NUCLEUS_FORCE_KERNEL=gather_kv_b_proj=fused)", "fused: F32 weight",
                  "unfused: not the forced implementation"});
  expect_refused(create(make_weight(WeightKind::kFp8Block, d, 84, 64, 128).lw, s, "fused"),
                 {"fused: 64x128 block scales"});
  // Not forced, the same 64x128 weight is served by the unfused path.
  const Weight w64 = make_weight(WeightKind::kFp8Block, d, 84, 64, 128);
  auto op = make(w64.lw, s, "");
  ASSERT_TRUE(op);
  EXPECT_STREQ(op->name(), "unfused");
  const Cache c = make_cache(KvCacheDtype::kBF16, 64, d.width(), 85);
  const Table t = make_table(4, 86);
  EXPECT_TRUE(matches(run_op(*op, d, c, 1.0f, t, 16, 2, 40), reference(d, c, 1.0f, t, 16, 2, 40, w64, Rounding{true, false}), d));
}

// NUCLEUS_FORCE_KERNEL is read once per process; no other test here reads
// it. It forces the fused kernel, which the dispatch no longer picks first.
TEST_F(GatherKvBProjGpu, EnvironmentForcesFused) {
  setenv("NUCLEUS_FORCE_KERNEL", "gather_kv_b_proj=fused", 1);
  auto op = GatherKvBProj::create(make_weight(WeightKind::kBf16, kV2Lite, 90).lw, spec_of(kV2Lite), Device::kCuda);
  ASSERT_TRUE(op.ok()) << op.status().to_string();
  EXPECT_STREQ((*op)->name(), "fused");
}

}  // namespace
}  // namespace nucleus
