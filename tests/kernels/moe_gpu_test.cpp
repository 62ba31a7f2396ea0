// MoE on the GPU against the CPU reference (moe_ref.h):
//  - routing (launch_moe_route) vs moe_route_ref: V3 sigmoid + bias with
//    grouped noaux_tc, V2 softmax greedy and group-limited greedy, the
//    shared experts' slots (MoeRoutingParams::shared_slots); the register
//    path bit-identical to the shared-memory kernel wherever it serves;
//  - the cuda_grouped experts backend (through MoeExpertsOp) vs
//    moe_experts_ref on f32 copies of the same bf16 / FP8-dequantized
//    weights: tiny, tiny with FP8 down, V2-Lite (bf16) and a reduced V3-like
//    FP8 shape; T = 1, 3, 64, 300, 2048; random, skewed (every token on the
//    same experts) routing and experts with no tokens; chunked steps; every
//    GEMM variant; CUDA-graph replay bit-identical to eager; refusals;
//  - the cuda_decode experts backend (moe_decode.cuh) vs moe_experts_ref at
//    the decode shapes of DeepSeek-V2-Lite (bf16), V3 (bf16 and FP8) and
//    Kimi-K2 (FP8), V3 / Kimi at the TP 1, 4 and 8 shards of the expert
//    intermediate, bf16 gate_up with FP8 down, T = 1..16: random
//    routing (experts with no tokens), every token on the same experts,
//    ragged T, a token choosing one expert twice, ids out of range, every K
//    slice count, PDL on and off bit-identical, runs and graph replays
//    bit-identical; the fall-back to cuda_grouped above 16 tokens; refusals.
#include <cuda.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iterator>
#include <numeric>
#include <random>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "core/parallel.h"
#include "gpu_test_util.h"
#include "graph/step_resources.h"
#include "kernels/gemm/skinny_gemm.cuh"
#include "kernels/moe/moe_decode.cuh"
#include "kernels/moe/moe_grouped.cuh"
#include "kernels/moe/moe_naive.cuh"
#include "kernels/rmsnorm/rmsnorm.cuh"
#include "ops/prezero.h"
#include "kernels/moe/moe_ref.h"
#include "ops/linear_cuda.h"
#include "ops/moe_cuda.h"
#include "ops/moe_decode.h"
#include "ops/moe_ops.h"

namespace nucleus::kernels {
namespace {

using testing::all_close;
using testing::device_copy;
using testing::device_poisoned;
using testing::from_bf16;
using testing::host_copy;
using testing::random_bf16_values;
using testing::to_bf16;

class MoeGpu : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device"; }
};

// ---------------------------------------------------------------- routing

// The reference's choice score of every expert of one token (softmax or
// sigmoid, plus bias), to tell a near-tie from a real mismatch.
std::vector<float> choice_scores(const MoeRoutingParams& p, const float* l, const float* bias) {
  std::vector<float> s(p.num_experts);
  if (p.scoring == ScoringFunc::kSigmoid) {
    for (int64_t e = 0; e < p.num_experts; ++e) s[e] = 1.0f / (1.0f + std::exp(-l[e]));
  } else {
    const float mx = *std::max_element(l, l + p.num_experts);
    double sum = 0;
    for (int64_t e = 0; e < p.num_experts; ++e) sum += s[e] = std::exp(l[e] - mx);
    for (auto& v : s) v = static_cast<float>(v / sum);
  }
  if (bias)
    for (int64_t e = 0; e < p.num_experts; ++e) s[e] += bias[e];
  return s;
}

void check_routing(const MoeRoutingParams& p, bool with_bias, int64_t T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t E = p.num_experts;
  // Logits: a shuffled grid (no exact ties) plus a little noise.
  std::vector<float> logits(T * E), bias;
  std::vector<int> perm(E);
  std::uniform_real_distribution<float> noise(-0.01f, 0.01f);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t e = 0; e < E; ++e) logits[t * E + e] = (perm[e] - E / 2) * 6.0f / E + noise(rng);
  }
  if (with_bias) {
    std::uniform_real_distribution<float> b(-0.05f, 0.05f);
    bias.resize(E);
    for (auto& v : bias) v = b(rng);
  }
  Tensor d_logits = device_copy(logits, DType::kF32);
  Tensor d_bias = with_bias ? device_copy(bias, DType::kF32) : Tensor();
  const int64_t S = p.slots();  // the top_k chosen, then the shared slots
  // Both kernels (NUCLEUS_MOE_ROUTE_REGS): the register path where it serves
  // p, bit-identical to the shared-memory kernel, which is checked against
  // the reference below.
  auto run = [&](MoeRouteKernel kernel, std::vector<int32_t>& ids, std::vector<float>& w) {
    Tensor d_ids = device_poisoned(T * S, DType::kI32), d_w = device_poisoned(T * S, DType::kF32);
    ASSERT_EQ(launch_moe_route(p, d_logits.data<float>(), with_bias ? d_bias.data<float>() : nullptr, T,
                               d_ids.data<int32_t>(), d_w.data<float>(), nullptr, false, kernel),
              cudaSuccess);
    ids = host_copy<int32_t>(d_ids);
    w = host_copy<float>(d_w);
  };
  std::vector<int32_t> got_ids, reg_ids;
  std::vector<float> got_w, reg_w;
  run(MoeRouteKernel::kSharedMemory, got_ids, got_w);
  if (moe_route_regs_supported(p)) {
    run(MoeRouteKernel::kRegisters, reg_ids, reg_w);
    EXPECT_EQ(reg_ids, got_ids) << "register path: ids";
    EXPECT_EQ(std::memcmp(reg_w.data(), got_w.data(), got_w.size() * sizeof(float)), 0) << "register path: weights";
  }
  std::vector<int32_t> want_ids(T * S);
  std::vector<float> want_w(T * S);
  moe_route_ref(p, logits.data(), with_bias ? bias.data() : nullptr, T, want_ids.data(), want_w.data());
  int near_ties = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t s = p.top_k; s < S; ++s) {  // shared slot s: expert E + s - top_k, weight 1
      EXPECT_EQ(got_ids[t * S + s], E + s - p.top_k) << "token " << t << " slot " << s;
      EXPECT_EQ(got_w[t * S + s], 1.0f) << "token " << t << " slot " << s;
      EXPECT_EQ(want_ids[t * S + s], E + s - p.top_k) << "reference, token " << t << " slot " << s;
      EXPECT_EQ(want_w[t * S + s], 1.0f) << "reference, token " << t << " slot " << s;
    }
    bool same = true;
    for (int64_t k = 0; k < p.top_k; ++k) same &= got_ids[t * S + k] == want_ids[t * S + k];
    if (!same) {
      // Allowed only where the swapped experts' choice scores tie to rounding.
      auto c = choice_scores(p, logits.data() + t * E, with_bias ? bias.data() : nullptr);
      for (int64_t k = 0; k < p.top_k; ++k) {
        const int32_t a = got_ids[t * S + k], b = want_ids[t * S + k];
        ASSERT_TRUE(a >= 0 && a < E) << "token " << t << " k " << k << " id " << a;
        EXPECT_LE(std::fabs(c[a] - c[b]), 1e-5f) << "token " << t << " k " << k << ": " << a << " vs " << b;
      }
      ++near_ties;
      continue;
    }
    for (int64_t k = 0; k < p.top_k; ++k) {
      const float g = got_w[t * S + k], w = want_w[t * S + k];
      EXPECT_NEAR(g, w, 1e-5f + 1e-5f * std::fabs(w)) << "token " << t << " k " << k;
    }
  }
  EXPECT_LE(near_ties, 1) << "tokens decided by near-ties";
}

// Routing params field by field, in the order of the config keys
// (scoring_func, topk_method, n_routed_experts, num_experts_per_tok, n_group,
// topk_group, norm_topk_prob, routed_scaling_factor), and the shipped shapes.
MoeRoutingParams routing(ScoringFunc scoring, TopkMethod method, int64_t experts, int64_t top_k, int64_t n_group = 1,
                         int64_t topk_group = 1, bool norm = false, float scale = 1.0f) {
  MoeRoutingParams p;
  p.scoring = scoring;
  p.method = method;
  p.num_experts = experts;
  p.top_k = top_k;
  p.n_group = n_group;
  p.topk_group = topk_group;
  p.norm_topk_prob = norm;
  p.routed_scaling_factor = scale;
  return p;
}
constexpr ScoringFunc kSoftmax = ScoringFunc::kSoftmax, kSigmoid = ScoringFunc::kSigmoid;
const MoeRoutingParams kV3Routing = routing(kSigmoid, TopkMethod::kNoauxTc, 256, 8, 8, 4, true, 2.5f);
const MoeRoutingParams kV2LiteRouting = routing(kSoftmax, TopkMethod::kGreedy, 64, 6);
const MoeRoutingParams kV2Routing = routing(kSoftmax, TopkMethod::kGroupLimitedGreedy, 160, 6, 8, 3, false, 16.0f);
const MoeRoutingParams kKimiK2Routing = routing(kSigmoid, TopkMethod::kNoauxTc, 384, 8, 1, 1, true, 2.827f);

TEST_F(MoeGpu, RoutingV3SigmoidGroupedNoauxTc) {
  for (int64_t T : {1, 7, 300}) check_routing(kV3Routing, true, T, 100 + T);
}

TEST_F(MoeGpu, RoutingV2SoftmaxGreedy) {
  MoeRoutingParams p = kV2LiteRouting;
  for (int64_t T : {1, 7, 300}) check_routing(p, false, T, 200 + T);
  p.norm_topk_prob = true;  // and the normalising variant
  check_routing(p, false, 33, 250);
}

// Shared experts run as routed ones (NUCLEUS_MOE_FUSE_SHARED): the slots
// after the top_k hold ids E, E + 1, ... with weight 1 (V2-Lite: 2, V3: 1).
TEST_F(MoeGpu, RoutingWritesTheSharedSlots) {
  MoeRoutingParams p = kV2LiteRouting;
  p.shared_slots = 2;
  for (int64_t T : {1, 7, 300}) check_routing(p, false, T, 500 + T);
  MoeRoutingParams q = kV3Routing;
  q.shared_slots = 1;
  for (int64_t T : {1, 33}) check_routing(q, true, T, 600 + T);
}

// Which params the register path serves: the shipped shapes except
// DeepSeek-V2's groups of 20 (those stay on the shared-memory kernel), and a
// forced register launch where it does not serve is refused.
TEST_F(MoeGpu, RoutingRegisterPathCoverage) {
  EXPECT_TRUE(moe_route_regs_supported(kV2LiteRouting));
  EXPECT_TRUE(moe_route_regs_supported(kV3Routing));
  EXPECT_TRUE(moe_route_regs_supported(kKimiK2Routing));
  EXPECT_FALSE(moe_route_regs_supported(kV2Routing));
  EXPECT_FALSE(moe_route_regs_supported(routing(kSoftmax, TopkMethod::kGreedy, 512, 6)));
  Tensor logits = device_copy(std::vector<float>(160, 0.0f), DType::kF32);
  Tensor ids = device_poisoned(6, DType::kI32), w = device_poisoned(6, DType::kF32);
  EXPECT_EQ(launch_moe_route(kV2Routing, logits.data<float>(), nullptr, 1, ids.data<int32_t>(), w.data<float>(),
                             nullptr, false, MoeRouteKernel::kRegisters),
            cudaErrorInvalidValue);
}

// The register path's other instances and branches: 96 experts (4 slots a
// lane), 72 (padding slots), group-limited greedy with groups of 32, noaux_tc
// with groups of 64 (2 slots a group); each bit-identical to the
// shared-memory kernel and within the reference (check_routing). Top-k above
// the expert count is refused.
TEST_F(MoeGpu, RoutingRegisterPathShapes) {
  const MoeRoutingParams shapes[] = {
      routing(kSoftmax, TopkMethod::kGreedy, 96, 6, 1, 1, true),
      routing(kSoftmax, TopkMethod::kGreedy, 72, 6, 1, 1, true),
      routing(kSoftmax, TopkMethod::kGroupLimitedGreedy, 256, 8, 8, 3, false, 16.0f),
      routing(kSigmoid, TopkMethod::kNoauxTc, 128, 4, 2, 1, true, 2.5f),
  };
  for (size_t i = 0; i < std::size(shapes); ++i) {
    ASSERT_TRUE(moe_route_regs_supported(shapes[i])) << i;
    const bool bias = shapes[i].scoring == kSigmoid;
    for (int64_t T : {1, 9}) check_routing(shapes[i], bias, T, 700 + 10 * i + T);
  }
  Tensor logits = device_copy(std::vector<float>(4, 0.0f), DType::kF32);
  Tensor ids = device_poisoned(6, DType::kI32), w = device_poisoned(6, DType::kF32);
  EXPECT_EQ(launch_moe_route(routing(kSoftmax, TopkMethod::kGreedy, 4, 6), logits.data<float>(), nullptr, 1,
                             ids.data<int32_t>(), w.data<float>(), nullptr),
            cudaErrorInvalidValue);
}

TEST_F(MoeGpu, RoutingV2SoftmaxGroupLimited) {
  for (int64_t T : {1, 7, 300}) check_routing(kV2Routing, false, T, 300 + T);
}

TEST_F(MoeGpu, RoutingKimiK2ShapeAndExactTies) {
  for (int64_t T : {1, 7, 300}) check_routing(kKimiK2Routing, true, T, 400 + T);
  // Exact ties (constant logits) go to the lowest expert ids, in order, as in
  // the reference; groups tie too and the lowest groups are kept.
  for (TopkMethod m : {TopkMethod::kGreedy, TopkMethod::kGroupLimitedGreedy}) {
    const MoeRoutingParams q =
        routing(kSoftmax, m, 64, 6, m == TopkMethod::kGreedy ? 1 : 8, m == TopkMethod::kGreedy ? 1 : 2);
    const int64_t T = 5;
    Tensor d_logits = device_copy(std::vector<float>(T * 64, 0.25f), DType::kF32);
    std::vector<int32_t> want(T * 6);
    std::vector<float> want_w(T * 6);
    const std::vector<float> logits(T * 64, 0.25f);
    moe_route_ref(q, logits.data(), nullptr, T, want.data(), want_w.data());
    for (int k = 0; k < 6; ++k) EXPECT_EQ(want[k], k);
    for (MoeRouteKernel kernel : {MoeRouteKernel::kSharedMemory, MoeRouteKernel::kRegisters}) {
      if (kernel == MoeRouteKernel::kRegisters && !moe_route_regs_supported(q)) continue;
      Tensor d_ids = device_poisoned(T * 6, DType::kI32), d_w = device_poisoned(T * 6, DType::kF32);
      ASSERT_EQ(launch_moe_route(q, d_logits.data<float>(), nullptr, T, d_ids.data<int32_t>(), d_w.data<float>(),
                                 nullptr, false, kernel),
                cudaSuccess);
      EXPECT_EQ(host_copy<int32_t>(d_ids), want) << (kernel == MoeRouteKernel::kRegisters ? "registers" : "smem");
      const std::vector<float> got_w = host_copy<float>(d_w);
      for (size_t i = 0; i < want_w.size(); ++i)
        EXPECT_NEAR(got_w[i], want_w[i], 1e-6f) << (kernel == MoeRouteKernel::kRegisters ? "registers" : "smem") << " " << i;
    }
  }
}

// ---------------------------------------------------------------- experts

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A weight [n, k] on the device (bf16, or FP8 with random 128x128 block
// scales) with values about uniform in [-a, a], and its exact f32 value.
struct TestWeight {
  LinearWeight device;
  std::vector<float> ref;
};

TestWeight make_weight(const std::string& name, int64_t n, int64_t k, bool fp8, float a, uint64_t seed) {
  TestWeight w;
  w.ref.resize(n * k);
  LinearWeight& lw = w.device;
  lw.name = name;
  lw.out_features = n;
  lw.in_features = k;
  if (!fp8) {
    std::vector<uint16_t> bits(n * k);
    parallel_for(n, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * k; i < r1 * k; ++i) {
        const float u = static_cast<float>(splitmix64(seed * 0x1000000007ull + i) >> 40) / 16777216.0f;
        bits[i] = f32_to_bf16((2 * u - 1) * a);
        w.ref[i] = bf16_to_f32(bits[i]);
      }
    });
    lw.weight = Tensor::empty({n, k}, DType::kBF16, Device::kCuda);
    copy_to_device(lw.weight.raw(), bits.data(), bits.size() * 2);
    return w;
  }
  static const auto lut = [] {  // 4096 codes, uniform in [-448, 448]
    std::vector<uint8_t> v(4096);
    for (int i = 0; i < 4096; ++i) v[i] = f32_to_fp8e4m3(-448.0f + 896.0f * (i + 0.5f) / 4096.0f);
    return v;
  }();
  const int64_t bn = 128, bk = 128, nb = (n + bn - 1) / bn, kb = (k + bk - 1) / bk;
  std::vector<float> scale(nb * kb);
  for (int64_t i = 0; i < nb * kb; ++i)  // factor 0.5 .. 1.5 per block: wrong block indexing shows
    scale[i] = a / 448.0f * (0.5f + static_cast<float>(splitmix64(seed ^ (0xabcdull + i)) >> 40) / 16777216.0f);
  std::vector<uint8_t> q(n * k);
  parallel_for(n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < k; ++c) {
        const int64_t i = r * k + c;
        q[i] = lut[splitmix64(seed * 0x1000000007ull + i) >> 52];
        w.ref[i] = fp8e4m3_to_f32(q[i]) * scale[(r / bn) * kb + c / bk];
      }
  });
  lw.weight = Tensor::empty({n, k}, DType::kF8E4M3, Device::kCuda);
  copy_to_device(lw.weight.raw(), q.data(), q.size());
  lw.scale_inv = device_copy(scale, DType::kF32).view({nb, kb});
  lw.block_n = bn;
  lw.block_k = bk;
  return w;
}

struct MoeShape {
  const char* name;
  int64_t hidden, inter, num_experts, top_k;
  bool gate_up_fp8, down_fp8;
  int64_t max_ref_tokens;  // reference rows checked per case (evenly spaced)
  int64_t distinct = 0;    // distinct weight sets (expert e uses set e % distinct); 0: one per expert
};

// Experts of one shape on the device and as f32 for the reference.
struct ExpertSet {
  MoeShape shape;
  std::deque<TestWeight> weights;  // gate_up, down per expert (stable addresses)
  std::vector<ExpertWeights> op_experts;
  std::vector<ExpertWeightsRef> ref;

  explicit ExpertSet(const MoeShape& s) : shape(s) {
    const float a_up = 3.0f / std::sqrt(static_cast<float>(s.hidden)), a_down = 3.0f / std::sqrt(static_cast<float>(s.inter));
    const int64_t sets = s.distinct > 0 ? std::min(s.distinct, s.num_experts) : s.num_experts;
    for (int64_t e = 0; e < sets; ++e) {
      const std::string name = std::string("e").append(std::to_string(e));
      weights.push_back(make_weight(name + ".gate_up", 2 * s.inter, s.hidden, s.gate_up_fp8, a_up, 1000 + 2 * e));
      weights.push_back(make_weight(name + ".down", s.hidden, s.inter, s.down_fp8, a_down, 1001 + 2 * e));
    }
    for (int64_t e = 0; e < s.num_experts; ++e) {
      const int64_t w = e % sets;
      op_experts.push_back({&weights[2 * w].device, &weights[2 * w + 1].device});
      ref.push_back({weights[2 * w].ref.data(), weights[2 * w + 1].ref.data()});
    }
    synchronize_device();
  }
};

// top_k distinct experts per token: uniform, or every token on experts
// top_k-1 .. 0 (skewed: those experts get every token, the rest none).
struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};
Routing make_routing(int64_t T, int64_t E, int64_t K, bool skewed, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Routing r;
  r.ids.resize(T * K);
  r.weights.resize(T * K);
  std::vector<int32_t> perm(E);
  std::uniform_real_distribution<float> w(0.05f, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t k = 0; k < K; ++k) {
      if (skewed) {
        r.ids[t * K + k] = static_cast<int32_t>(K - 1 - k);
      } else {
        std::swap(perm[k], perm[k + rng() % (E - k)]);
        r.ids[t * K + k] = perm[k];
      }
      r.weights[t * K + k] = w(rng);
    }
  }
  return r;
}

// The experts' device views, as the kernels take them: ExpertView [num_experts].
Tensor device_views(const ExpertSet& set) {
  std::vector<ExpertView> views;
  for (const auto& e : set.op_experts) views.push_back({cuda_ops::weight_view(*e.gate_up), cuda_ops::weight_view(*e.down)});
  return device_copy(views, DType::kU8);
}

// A grouped-path workspace for `pairs` (token, expert) pairs, poisoned; ws
// points into mem.
struct GroupedWorkspace {
  Tensor mem;
  MoeGroupedWorkspace ws;
};
GroupedWorkspace grouped_workspace(const MoeGroupedShape& gs, int64_t pairs) {
  GroupedWorkspace w;
  w.mem = device_poisoned(static_cast<int64_t>(moe_grouped_workspace_bytes(gs, pairs)), DType::kU8);
  w.ws = moe_grouped_workspace_carve(w.mem.raw(), gs, pairs);
  return w;
}

// Output rows of the reference for tokens `rows` of the step.
std::vector<float> reference_rows(const ExpertSet& set, const std::vector<float>& x, const Routing& r,
                                  const std::vector<int64_t>& rows) {
  const MoeShape& s = set.shape;
  const int64_t n = static_cast<int64_t>(rows.size());
  std::vector<float> xs(n * s.hidden), ws(n * s.top_k), out(n * s.hidden);
  std::vector<int32_t> ids(n * s.top_k);
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(x.begin() + rows[i] * s.hidden, s.hidden, xs.begin() + i * s.hidden);
    std::copy_n(r.ids.begin() + rows[i] * s.top_k, s.top_k, ids.begin() + i * s.top_k);
    std::copy_n(r.weights.begin() + rows[i] * s.top_k, s.top_k, ws.begin() + i * s.top_k);
  }
  moe_experts_ref(xs.data(), n, s.hidden, s.inter, ids.data(), ws.data(), s.top_k, set.ref.data(), out.data(), false);
  return out;
}

std::vector<int64_t> all_rows(int64_t T) {
  std::vector<int64_t> rows(T);
  std::iota(rows.begin(), rows.end(), 0);
  return rows;
}

std::vector<int64_t> sample_rows(int64_t T, int64_t max_rows) {
  std::vector<int64_t> rows;
  const int64_t n = std::min(T, max_rows);
  for (int64_t i = 0; i < n; ++i) rows.push_back(n == 1 ? 0 : i * (T - 1) / (n - 1));
  return rows;
}

// Tolerance (bf16 activations, h and y rounded to bf16, FP8 weights
// dequantized to bf16, f32 accumulation): every element within 3% of the
// reference's RMS plus 2% of its own size; relative L2 error below 1%.
// (The decode kernel's tighter tolerance: kDecodeTol below.)
struct CloseTol {
  float atol_rms = 0.03f;      // times the reference's RMS
  float rtol = 0.02f;          // times |want|
  double max_rel_l2 = 1e-2;    // ||got - want|| / ||want||
};
// Returns the relative L2 error.
double expect_close(const std::vector<float>& got_all, const std::vector<float>& want, const std::vector<int64_t>& rows,
                    int64_t hidden, const std::string& what, const CloseTol& tol = {}) {
  int64_t not_finite = 0;
  for (float v : got_all) not_finite += !std::isfinite(v);
  EXPECT_EQ(not_finite, 0) << what << ": output elements not written (poison) or not finite";
  std::vector<float> got(want.size());
  for (size_t i = 0; i < rows.size(); ++i)
    std::copy_n(got_all.begin() + rows[i] * hidden, hidden, got.begin() + i * hidden);
  double ss = 0, se = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    ss += double(want[i]) * want[i];
    se += double(got[i] - want[i]) * (got[i] - want[i]);
  }
  const float rms = static_cast<float>(std::sqrt(ss / want.size()));
  float worst = 0;
  for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
  std::printf("%s: compared %zu rows, max abs err %.3g (ref rms %.3g), rel l2 err %.3g\n", what.c_str(), rows.size(),
              worst, rms, std::sqrt(se / std::max(ss, 1e-30)));
  EXPECT_TRUE(all_close(got, want, tol.atol_rms * rms, tol.rtol, hidden))
      << what << " (rows sampled: " << rows.size() << ")";
  EXPECT_LT(std::sqrt(se / std::max(ss, 1e-30)), tol.max_rel_l2) << what;
  return std::sqrt(se / std::max(ss, 1e-30));
}

struct Step {
  Tensor x, ids, weights, out, scratch;
  std::vector<float> x_host;
  Routing routing;
};

Step make_step(const MoeShape& s, int64_t T, bool skewed, uint64_t seed) {
  Step st;
  st.x_host = random_bf16_values(T * s.hidden, 1.0f, seed);
  st.routing = make_routing(T, s.num_experts, s.top_k, skewed, seed + 1);
  st.x = device_copy(to_bf16(st.x_host), DType::kBF16).view({T, s.hidden});
  st.ids = device_copy(st.routing.ids, DType::kI32).view({T, s.top_k});
  st.weights = device_copy(st.routing.weights, DType::kF32).view({T, s.top_k});
  st.out = device_poisoned(T * s.hidden, DType::kBF16).view({T, s.hidden});
  st.scratch = device_poisoned(256 * s.top_k * s.inter, DType::kF32).view({256, s.top_k * s.inter});
  NUCLEUS_CUDA_CHECK(cudaDeviceSynchronize());  // uploads done before the engine stream reads them
  return st;
}

// Runs `op` (reserved in `res`, as the engine's ops) on `st`.
void run_op(MoeExpertsOp& op, StepResources& res, Step& st) {
  OpContext ctx;
  ctx.device = Device::kCuda;
  ctx.stream = cuda::context().stream;
  const Status begun = res.begin_step(ctx);  // sets ctx.workspace (no step inputs: the reserved limits)
  ASSERT_TRUE(begun.ok()) << begun.to_string();
  op.run(ctx, {st.x, st.ids, st.weights}, {st.out, st.scratch});
  ASSERT_TRUE(ctx.error.ok()) << ctx.error.to_string();
}

// The moe_experts backend called `name`.
const Backend<MoeExpertsOp>& experts_backend(const std::string& name) {
  for (const auto& b : MoeExpertsOp::backends())
    if (b.device == Device::kCuda && name == b.name) return b;
  NUCLEUS_CHECK(false, "no CUDA moe_experts backend {}", name);
  return MoeExpertsOp::backends().front();
}

// One row quantized per 1 x 128 block as launch_fp8_act_quant does
// (s = amax / 448, q = e4m3(v / s)), returned dequantized (q * s).
std::vector<float> act_quant_dequant_row(const float* v, int64_t k) {
  std::vector<float> out(k, 0.0f);
  for (int64_t c0 = 0; c0 < k; c0 += 128) {
    const int64_t c1 = std::min(k, c0 + 128);
    float amax = 0.0f;
    for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(v[c]));
    const float sc = amax / 448.0f;
    for (int64_t c = c0; c < c1; ++c) out[c] = sc > 0.0f ? fp8e4m3_to_f32(f32_to_fp8e4m3(v[c] / sc)) * sc : 0.0f;
  }
  return out;
}

// The W8A8 MoE step on the host for tokens `rows`: x quantized per 1 x 128
// block, h = bf16(silu(gate) * up) quantized the same way, y = bf16(h . down),
// out = sum_k w_k y_k in k order (what kernels::moe_grouped_w8a8 computes, up
// to f32 summation order).
std::vector<float> w8a8_reference_rows(const ExpertSet& set, const std::vector<float>& x, const Routing& r,
                                       const std::vector<int64_t>& rows) {
  const MoeShape& s = set.shape;
  std::vector<float> out(rows.size() * s.hidden, 0.0f);
  parallel_for(static_cast<int64_t>(rows.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = rows[i];
      const std::vector<float> xq = act_quant_dequant_row(x.data() + t * s.hidden, s.hidden);
      std::vector<float> h(s.inter), acc(s.hidden, 0.0f);
      for (int64_t k = 0; k < s.top_k; ++k) {
        const ExpertWeightsRef& e = set.ref[r.ids[t * s.top_k + k]];
        for (int64_t j = 0; j < s.inter; ++j) {
          double g = 0, u = 0;
          for (int64_t c = 0; c < s.hidden; ++c) {
            g += double(xq[c]) * e.gate_up[j * s.hidden + c];
            u += double(xq[c]) * e.gate_up[(s.inter + j) * s.hidden + c];
          }
          const float gf = static_cast<float>(g), uf = static_cast<float>(u);
          h[j] = bf16_to_f32(f32_to_bf16(gf / (1.0f + std::exp(-gf)) * uf));
        }
        const std::vector<float> hq = act_quant_dequant_row(h.data(), s.inter);
        for (int64_t n = 0; n < s.hidden; ++n) {
          double y = 0;
          for (int64_t j = 0; j < s.inter; ++j) y += double(hq[j]) * e.down[n * s.inter + j];
          acc[n] += r.weights[t * s.top_k + k] * bf16_to_f32(f32_to_bf16(static_cast<float>(y)));
        }
      }
      for (int64_t n = 0; n < s.hidden; ++n) out[i * s.hidden + n] = bf16_to_f32(f32_to_bf16(acc[n]));
    }
  });
  return out;
}

// W8A8 against its host emulation: the f32 sums differ in order, so h's
// bf16 rounding, and then its e4m3 code (6% apart), can differ in places.
const CloseTol kW8a8Tol{.atol_rms = 0.06f, .rtol = 0.03f, .max_rel_l2 = 1e-2};

void check_shape(const MoeShape& s) {
  ExpertSet set(s);
  MoeExpertsOp op(set.op_experts, s.inter, s.top_k);
  const Status used = op.use_backend(experts_backend("cuda_grouped"));
  ASSERT_TRUE(used.ok()) << s.name << ": " << used.to_string();
  StepResources res;
  ASSERT_TRUE(res.reserve_ops({&op}, StepLimits{.max_tokens = 2048}, Device::kCuda).ok());  // the largest T below
  for (bool skewed : {false, true}) {
    for (int64_t T : {1, 3, 64, 300, 2048}) {
      if (skewed && T == 1) continue;
      const std::string what = std::string(s.name) + (skewed ? " skewed" : " random") + " T=" + std::to_string(T) +
                               " bm=" + std::to_string(moe_grouped_pick_bm(T, {s.hidden, s.inter, s.num_experts,
                                                                                s.top_k}));
      Step st = make_step(s, T, skewed, 7 * T + skewed);
      run_op(op, res, st);
      const auto got = from_bf16(host_copy<uint16_t>(st.out));
      const auto rows = sample_rows(T, s.max_ref_tokens);
      // FP8 experts at prefill-sized steps run W8A8 by the engine's switches
      // (NUCLEUS_MOE_FP8_W8A8, NUCLEUS_MOE_WGMMA): compared with its emulation.
      MoeGroupedOptions engine;
      engine.fp8_w8a8 = moe_fp8_w8a8_switch();
      engine.wgmma = moe_wgmma_switch();
      const MoeGroupedShape blocks{s.hidden, s.inter, s.num_experts, s.top_k, s.gate_up_fp8 ? 128 : 0,
                                   s.down_fp8 ? 128 : 0};
      if (moe_grouped_w8a8(blocks, moe_grouped_pick_bm(T, blocks), s.gate_up_fp8, s.down_fp8, engine))
        expect_close(got, w8a8_reference_rows(set, st.x_host, st.routing, rows), rows, s.hidden, what + " W8A8",
                     kW8a8Tol);
      else
        expect_close(got, reference_rows(set, st.x_host, st.routing, rows), rows, s.hidden, what);
      if (T == 300 && !skewed) {
        // Deterministic, and a CUDA-graph replay is bit-identical to eager.
        cudaStream_t stream = cuda::context().stream;
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        run_op(op, res, st);
        ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
        ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
        NUCLEUS_CUDA_CHECK(cudaMemsetAsync(st.out.raw(), 0x7f, st.out.nbytes(), stream));
        ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
        const auto replay = from_bf16(host_copy<uint16_t>(st.out));
        EXPECT_EQ(0, std::memcmp(replay.data(), got.data(), got.size() * 4)) << what << ": graph replay differs";
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      }
    }
  }
}

// max_ref_tokens bounds the CPU reference's work (V3-like: 88 MFLOP a pair).
TEST_F(MoeGpu, ExpertsTinyBf16) { check_shape({"tiny", 256, 192, 8, 2, false, false, 4096}); }
TEST_F(MoeGpu, ExpertsTinyFp8Down) { check_shape({"tiny-fp8-down", 256, 192, 8, 2, false, true, 4096}); }
TEST_F(MoeGpu, ExpertsV2LiteBf16) { check_shape({"v2-lite", 2048, 1408, 64, 6, false, false, 256}); }
TEST_F(MoeGpu, ExpertsV3LikeFp8) { check_shape({"v3-like-fp8", 7168, 2048, 32, 8, true, true, 48}); }

// Every GEMM variant (tile height 16, 32, 64, 128) on one step, through the
// kernel interface. FP8 tiles of 16 and 32 rows run both dequantizations
// (NUCLEUS_MOE_FP8_REGISTER_DEQUANT on and off): each within the tolerance of
// the reference, and the register path, whose weights are exact, no less
// accurate than the shared-memory path's q * scale rounded to bf16.
TEST_F(MoeGpu, ExpertsEveryVariant) {
  for (const MoeShape& s : {MoeShape{"tiny-fp8-down", 256, 192, 8, 2, false, true, 4096},
                            MoeShape{"v2-lite", 2048, 1408, 64, 6, false, false, 128},
                            MoeShape{"v3-like-fp8", 7168, 2048, 32, 8, true, true, 32}}) {
    ExpertSet set(s);
    Tensor d_views = device_views(set);
    const MoeGroupedShape gs{s.hidden, s.inter, s.num_experts, s.top_k};
    const int64_t T = 100;
    const GroupedWorkspace workspace = grouped_workspace(gs, T * s.top_k);
    const MoeGroupedWorkspace& ws = workspace.ws;
    Step st = make_step(s, T, false, 4242);
    const auto rows = sample_rows(T, s.max_ref_tokens);
    const auto want = reference_rows(set, st.x_host, st.routing, rows);
    for (int bm : {16, 32, 64, 128}) {
      double err[2] = {0, 0};  // [shared, registers]
      for (bool regs : {false, true}) {
        NUCLEUS_CUDA_CHECK(cudaMemset(st.out.raw(), 0x7f, st.out.nbytes()));
        ASSERT_EQ(launch_moe_grouped(st.x.data<__nv_bfloat16>(), T, st.ids.data<int32_t>(), st.weights.data<float>(),
                                     gs, d_views.data<ExpertView>(), s.gate_up_fp8, s.down_fp8, ws,
                                     st.out.data<__nv_bfloat16>(), nullptr,
                                     MoeGroupedOptions{.force_bm = bm, .fp8_register_dequant = regs, .up_splits = 1}),
                  cudaSuccess);
        NUCLEUS_CUDA_CHECK(cudaDeviceSynchronize());
        err[regs] = expect_close(from_bf16(host_copy<uint16_t>(st.out)), want, rows, s.hidden,
                                 std::string(s.name) + " bm=" + std::to_string(bm) +
                                     (regs ? " fp8 in registers" : " fp8 through shared memory"));
      }
      if (bm <= 32 && (s.gate_up_fp8 || s.down_fp8))
        EXPECT_LE(err[1], err[0] * 1.02) << s.name << " bm=" << bm << ": register dequantization less accurate";
      else
        EXPECT_EQ(err[1], err[0]) << s.name << " bm=" << bm << ": the switch changed a path it does not cover";
    }
  }
}

// UP split-K at decode steps: every forced split count (1, 2, 4, 8) within
// the tolerance of the reference, bit-identical repeats (the splits are added
// in order), rows of out-of-range expert ids contributing nothing; and the
// rule's counts on the DeepSeek shapes, by hand: splits double while the
// step's expert column tiles times the splits leave SMs idle (132 SMs), and
// bf16 grids of the deep ring's one to one and a half waves split in two.
TEST_F(MoeGpu, ExpertsUpSplitK) {
  const int sms = 132;
  EXPECT_EQ(moe_grouped_up_splits(1, {7168, 256, 256, 8}, 16, sms), 8);   // V3 TP 8: 8 x 4 tiles = 32
  EXPECT_EQ(moe_grouped_up_splits(2, {7168, 256, 256, 8}, 16, sms), 4);   // 16 x 4 = 64
  EXPECT_EQ(moe_grouped_up_splits(4, {7168, 256, 256, 8}, 16, sms), 2);   // 32 x 4 = 128
  EXPECT_EQ(moe_grouped_up_splits(8, {7168, 256, 256, 8}, 16, sms), 1);   // 64 x 4 = 256
  EXPECT_EQ(moe_grouped_up_splits(1, {7168, 2048, 256, 8}, 16, sms), 1);  // V3: 8 x 32 = 256
  EXPECT_EQ(moe_grouped_up_splits(1, {2048, 1408, 64, 6}, 16, sms), 1);   // V2-Lite: 6 x 22 = 132
  EXPECT_EQ(moe_grouped_up_splits(1, {2048, 704, 64, 6}, 16, sms), 2);    // V2-Lite at TP 2: 6 x 11 = 66
  EXPECT_EQ(moe_grouped_up_splits(1, {256, 192, 8, 2}, 16, sms), 1);      // K of 2 k-tiles: no split
  EXPECT_EQ(moe_grouped_up_splits(1, {7168, 256, 256, 8}, 32, sms), 1);   // 32-row tiles: none
  EXPECT_EQ(moe_grouped_up_splits(40, {7168, 256, 256, 8}, 16, sms), 1);  // 320 pairs: 2 x 320 > 512 rows
  // bf16: the deep ring's second wave. V2-Lite with its 2 shared slots, 8 x
  // 22 = 176 CTAs at one an SM: 2 splits (352 CTAs of 16 k-tiles on the
  // 4-stage ring); not for FP8 weights (no deep ring), not for 6 slots (132:
  // one wave), not for V3's bf16 9 x 32 = 288 (the halves would keep the deep
  // ring, and 576 > 3 x 132), not at two tokens (16 x 22 = 352 > 1.5 waves).
  EXPECT_EQ(moe_grouped_up_splits(1, {2048, 1408, 66, 8}, 16, sms, true), 2);
  EXPECT_EQ(moe_grouped_up_splits(1, {2048, 1408, 66, 8}, 16, sms, false), 1);
  EXPECT_EQ(moe_grouped_up_splits(1, {2048, 1408, 64, 6}, 16, sms, true), 1);
  EXPECT_EQ(moe_grouped_up_splits(1, {7168, 2048, 257, 9}, 16, sms, true), 1);
  EXPECT_EQ(moe_grouped_up_splits(2, {2048, 1408, 66, 8}, 16, sms, true), 1);

  for (const MoeShape& s : {MoeShape{"v2-lite", 2048, 1408, 64, 6, false, false, 8},
                            MoeShape{"v3-fp8-tp8", 7168, 256, 256, 8, true, true, 8, 12},
                            MoeShape{"v3-like-fp8", 7168, 2048, 32, 8, true, true, 8}}) {
    ExpertSet set(s);
    Tensor d_views = device_views(set);
    const MoeGroupedShape gs{s.hidden, s.inter, s.num_experts, s.top_k};
    for (int64_t T : {1, 3, 8}) {
      const GroupedWorkspace workspace = grouped_workspace(gs, T * s.top_k);
      const MoeGroupedWorkspace& ws = workspace.ws;
      Step st = make_step(s, T, false, 77 + T);
      if (T == 3) {  // one pair with an id out of range: its row is not sorted, contributes nothing
        st.routing.ids[1] = -1;
        NUCLEUS_CUDA_CHECK(cudaMemcpy(st.ids.raw(), st.routing.ids.data(), st.routing.ids.size() * 4,
                                      cudaMemcpyHostToDevice));
      }
      const auto rows = sample_rows(T, T);
      Routing ref_routing = st.routing;  // the reference has no out-of-range ids: a weight of 0 instead
      if (T == 3) {
        ref_routing.ids[1] = 0;
        ref_routing.weights[1] = 0.0f;
      }
      const auto want = reference_rows(set, st.x_host, ref_routing, rows);
      for (int splits : {1, 2, 4, 8}) {
        std::vector<float> runs[2];
        for (auto& got : runs) {
          NUCLEUS_CUDA_CHECK(cudaMemset(st.out.raw(), 0x7f, st.out.nbytes()));
          ASSERT_EQ(launch_moe_grouped(st.x.data<__nv_bfloat16>(), T, st.ids.data<int32_t>(),
                                       st.weights.data<float>(), gs, d_views.data<ExpertView>(), s.gate_up_fp8,
                                       s.down_fp8, ws, st.out.data<__nv_bfloat16>(), nullptr,
                                       MoeGroupedOptions{.force_bm = 16, .up_splits = splits}),
                    cudaSuccess);
          NUCLEUS_CUDA_CHECK(cudaDeviceSynchronize());
          got = from_bf16(host_copy<uint16_t>(st.out));
        }
        const std::string what = std::string(s.name) + " T=" + std::to_string(T) + " up splits " + std::to_string(splits);
        expect_close(runs[0], want, rows, s.hidden, what);
        EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * 4)) << what << ": repeat differs";
      }
    }
  }
}

// The deep ring of 16-row bf16 tiles (NUCLEUS_MOE_DEEP_RING): 8 cp.async
// stages instead of 4 change no arithmetic, so forced on and forced off give
// the same bytes, close to the reference; the rule's choices on the DeepSeek
// shapes by hand (132 SMs: at most 528 CTAs, at least 20 k-tiles of 64).
TEST_F(MoeGpu, ExpertsDeepRing) {
  EXPECT_TRUE(moe_grouped_deep_ring(132, 32, 132));    // V2-Lite T = 1, UP: 6 experts x 22 tiles, K 2048
  EXPECT_TRUE(moe_grouped_deep_ring(192, 22, 132));    // V2-Lite T = 1, DOWN: 6 x 32 tiles, K 1408
  EXPECT_FALSE(moe_grouped_deep_ring(800, 22, 132));   // V2-Lite T = 4, DOWN: 25 tiles (the bound for 24 pairs) x 32
  EXPECT_FALSE(moe_grouped_deep_ring(1056, 32, 132));  // V2-Lite T = 8, UP
  EXPECT_FALSE(moe_grouped_deep_ring(256, 14, 132));   // V3 TP 8 T = 1, UP split 8 ways: 14 k-tiles a CTA
  EXPECT_FALSE(moe_grouped_deep_ring(100, 4, 132));    // V3 TP 8 DOWN: K 256
  for (const MoeShape& s : {MoeShape{"v2-lite", 2048, 1408, 64, 6, false, false, 8},
                            MoeShape{"v3-like-bf16", 7168, 2048, 32, 8, false, false, 8}}) {
    ExpertSet set(s);
    Tensor d_views = device_views(set);
    const MoeGroupedShape gs{s.hidden, s.inter, s.num_experts, s.top_k};
    for (int64_t T : {1, 3, 8}) {
      const GroupedWorkspace workspace = grouped_workspace(gs, T * s.top_k);
      const MoeGroupedWorkspace& ws = workspace.ws;
      Step st = make_step(s, T, false, 900 + T);
      std::vector<float> got[2];
      for (int deep : {0, 1}) {
        NUCLEUS_CUDA_CHECK(cudaMemset(st.out.raw(), 0x7f, st.out.nbytes()));
        ASSERT_EQ(launch_moe_grouped(st.x.data<__nv_bfloat16>(), T, st.ids.data<int32_t>(), st.weights.data<float>(),
                                     gs, d_views.data<ExpertView>(), s.gate_up_fp8, s.down_fp8, ws,
                                     st.out.data<__nv_bfloat16>(), nullptr,
                                     MoeGroupedOptions{.force_bm = 16, .deep_ring = deep}),
                  cudaSuccess);
        NUCLEUS_CUDA_CHECK(cudaDeviceSynchronize());
        got[deep] = from_bf16(host_copy<uint16_t>(st.out));
      }
      const auto rows = sample_rows(T, T);
      const std::string what = std::string(s.name) + " T=" + std::to_string(T);
      expect_close(got[1], reference_rows(set, st.x_host, st.routing, rows), rows, s.hidden, what + " deep ring");
      EXPECT_EQ(0, std::memcmp(got[0].data(), got[1].data(), got[0].size() * 4)) << what << ": deep ring differs";
    }
  }
}

// Runs `launch` (returns a cudaError_t) on `stream` eagerly, or captured
// into a CUDA graph that is replayed three times; then waits for the stream.
template <typename Launch>
void run_eager_or_graph(cudaStream_t stream, bool graph, Launch launch) {
  if (!graph) {
    EXPECT_EQ(launch(), cudaSuccess);
  } else {
    cudaGraph_t g;
    cudaGraphExec_t exec;
    EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    EXPECT_EQ(launch(), cudaSuccess);
    EXPECT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
    for (int rep = 0; rep < 3; ++rep) EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
  }
  NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

// Align-free one-token steps (NUCLEUS_MOE_ALIGN_FREE, MoeGroupedOptions::
// align_free, the default): pair k is m-tile k of expert topk_ids[k] and the
// align launch is skipped. The same tiles are computed in another order and
// the combine sums in k order either way, so the output equals the aligned
// path's bit for bit: bf16 and FP8 weights, the UP split-K (V3 TP 8 at T = 1
// splits 8 ways), PDL launches eager and in a CUDA graph, and ids out of range
// (skipped by both). Close to the reference.
TEST_F(MoeGpu, ExpertsAlignFreeOneTokenEqualsAligned) {
  for (const MoeShape& s : {MoeShape{"v2-lite", 2048, 1408, 64, 6, false, false, 8},
                            MoeShape{"v3-fp8-tp8", 7168, 256, 256, 8, true, true, 8, 12},
                            MoeShape{"v3-like-bf16", 7168, 2048, 32, 8, false, false, 8}}) {
    ExpertSet set(s);
    Tensor d_views = device_views(set);
    const MoeGroupedShape gs{s.hidden, s.inter, s.num_experts, s.top_k};
    const int64_t T = 1;
    const GroupedWorkspace workspace = grouped_workspace(gs, T * s.top_k);
    const MoeGroupedWorkspace& ws = workspace.ws;
    Step st = make_step(s, T, false, 1300);
    cudaStream_t stream = cuda::context().stream;
    auto run = [&](bool align_free, bool pdl, bool graph) {
      MoeGroupedOptions opt;
      opt.align_free = align_free;
      opt.pdl = pdl;
      auto launch = [&] {
        return launch_moe_grouped(st.x.data<__nv_bfloat16>(), T, st.ids.data<int32_t>(), st.weights.data<float>(), gs,
                                  d_views.data<ExpertView>(), s.gate_up_fp8, s.down_fp8, ws,
                                  st.out.data<__nv_bfloat16>(), stream, opt);
      };
      NUCLEUS_CUDA_CHECK(cudaMemsetAsync(st.out.raw(), 0x7f, st.out.nbytes(), stream));
      run_eager_or_graph(stream, graph, launch);
      return from_bf16(host_copy<uint16_t>(st.out));
    };
    const auto aligned = run(false, false, false);
    const auto rows = sample_rows(T, T);
    expect_close(aligned, reference_rows(set, st.x_host, st.routing, rows), rows, s.hidden,
                 std::string(s.name) + " aligned");
    for (bool pdl : {false, true})
      for (bool graph : {false, true}) {
        const auto got = run(true, pdl, graph);
        EXPECT_EQ(0, std::memcmp(got.data(), aligned.data(), got.size() * 4))
            << s.name << (pdl ? " pdl" : "") << (graph ? " graph" : " eager") << ": align-free differs from aligned";
      }
    // Two ids out of range (one negative, one past the experts): both paths skip those pairs.
    std::vector<int32_t> ids = host_copy<int32_t>(st.ids);
    ids[1] = -1;
    ids[2] = static_cast<int32_t>(s.num_experts + 3);
    NUCLEUS_CUDA_CHECK(cudaMemcpy(st.ids.raw(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    const auto skipped = run(false, true, false);
    const auto skipped_free = run(true, true, true);
    EXPECT_EQ(0, std::memcmp(skipped.data(), skipped_free.data(), skipped.size() * 4))
        << s.name << ": with ids out of range, align-free differs from aligned";
    EXPECT_NE(0, std::memcmp(skipped.data(), aligned.data(), skipped.size() * 4))
        << s.name << ": skipping two pairs changed nothing (the test would not see a wrong skip)";
  }
}

// The names of the kernels `launch` enqueues: captured into a CUDA graph
// (not run), each kernel node's function named by the driver
// (cuFuncGetName / cuKernelGetName, mangled; through the runtime's driver
// entry points: the kernels live in nucleus_lib's own runtime registration,
// so cudaGraphKernelNodeGetParams cannot map them back to host stubs here).
template <typename Launch>
std::vector<std::string> captured_kernel_names(cudaStream_t stream, Launch launch) {
  using GetParams = CUresult (*)(CUgraphNode, CUDA_KERNEL_NODE_PARAMS*);
  using FuncName = CUresult (*)(const char**, CUfunction);
  using KernelName = CUresult (*)(const char**, CUkernel);
  auto entry = [](const char* name, int version) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    EXPECT_EQ(cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &q), cudaSuccess) << name;
    EXPECT_EQ(q, cudaDriverEntryPointSuccess) << name;
    return p;
  };
  const auto get_params = reinterpret_cast<GetParams>(entry("cuGraphKernelNodeGetParams", 12000));
  const auto func_name = reinterpret_cast<FuncName>(entry("cuFuncGetName", 12030));
  const auto kernel_name = reinterpret_cast<KernelName>(entry("cuKernelGetName", 12030));
  std::vector<std::string> names;
  if (!get_params || !func_name || !kernel_name) return names;
  cudaGraph_t g;
  EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(launch(), cudaSuccess);
  EXPECT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess);
  size_t count = 0;
  EXPECT_EQ(cudaGraphGetNodes(g, nullptr, &count), cudaSuccess);
  std::vector<cudaGraphNode_t> nodes(count);
  EXPECT_EQ(cudaGraphGetNodes(g, nodes.data(), &count), cudaSuccess);
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    EXPECT_EQ(cudaGraphNodeGetType(node, &type), cudaSuccess);
    if (type != cudaGraphNodeTypeKernel) continue;
    CUDA_KERNEL_NODE_PARAMS params{};
    EXPECT_EQ(get_params(reinterpret_cast<CUgraphNode>(node), &params), CUDA_SUCCESS);
    const char* name = nullptr;
    if (params.func != nullptr)
      EXPECT_EQ(func_name(&name, params.func), CUDA_SUCCESS);
    else
      EXPECT_EQ(kernel_name(&name, params.kern), CUDA_SUCCESS);
    names.push_back(name ? name : "?");
  }
  cudaGraphDestroy(g);
  EXPECT_FALSE(names.empty()) << "no kernel node captured";
  return names;
}

bool any_contains(const std::vector<std::string>& names, const std::string& part) {
  return std::any_of(names.begin(), names.end(), [&](const std::string& n) { return n.find(part) != std::string::npos; });
}

// The UP GEMM of one-token FP8 steps in the FP8 stream scheme
// (NUCLEUS_MOE_UP_STREAM, MoeGroupedOptions::up_stream): the rule's choices
// by hand; the kernels a step launches (captured: moe_up_stream_kernel and no
// MMA UP with the switch on, the reverse off); on and off both close to the
// reference on V3 / Kimi-K2's TP 1 shape, V3's TP 8 shard, FP8 gate_up with a
// bf16 down, and a tiny shape (K of 16 chunks: lanes without a chunk; 384
// gate_up rows: the up rows' first scale row is mid-block); PDL in a graph
// replayed three times equals eager, bit-identical repeats; ids out of range
// contribute nothing. The workspace's h and y are poisoned before every run.
TEST_F(MoeGpu, ExpertsUpStreamOneToken) {
  const MoeGroupedShape v3{7168, 2048, 256, 8, 128};
  auto opts = [](int up_stream, bool align_free) {
    MoeGroupedOptions o;
    o.up_stream = up_stream;
    o.align_free = align_free;
    return o;
  };
  EXPECT_TRUE(moe_grouped_up_stream(1, v3, 16, true, opts(-1, true)));
  EXPECT_TRUE(moe_grouped_up_stream(1, v3, 16, true, opts(1, true)));
  EXPECT_FALSE(moe_grouped_up_stream(1, v3, 16, true, opts(0, true)));       // switched off
  EXPECT_FALSE(moe_grouped_up_stream(1, v3, 16, true, opts(1, false)));      // aligned steps
  EXPECT_FALSE(moe_grouped_up_stream(2, v3, 16, true, opts(1, true)));       // two tokens
  EXPECT_FALSE(moe_grouped_up_stream(1, v3, 32, true, opts(1, true)));       // 32-row tiles
  EXPECT_FALSE(moe_grouped_up_stream(1, v3, 16, false, opts(1, true)));      // bf16 gate_up
  EXPECT_FALSE(moe_grouped_up_stream(1, {7168, 2048, 256, 8}, 16, true, opts(1, true)));      // blocks not given
  EXPECT_FALSE(moe_grouped_up_stream(1, {7168, 2048, 256, 8, 64}, 16, true, opts(1, true)));  // 64-wide blocks
  // Slices by hand (skinny_default_slices over pairs x 2 x inter rows of k / 2
  // bf16-sized chunks: the S in 1, 2, 4, 8 whose 4-row groups x S is nearest
  // 1,540 warps on 132 SMs, each slice >= 32 chunks): V3 with the shared
  // slot, 9216 groups -> 1; V3 TP 8, 1024 groups -> 2 (gap 508 against 516);
  // the tiny shape, 16 chunks -> 1.
  EXPECT_EQ(moe_grouped::up_stream_slices(9, 2048, 7168, 132), 1);
  EXPECT_EQ(moe_grouped::up_stream_slices(8, 256, 7168, 132), 2);
  EXPECT_EQ(moe_grouped::up_stream_slices(2, 192, 256, 132), 1);

  for (const MoeShape& s : {MoeShape{"v3-like-fp8", 7168, 2048, 32, 8, true, true, 8},
                            MoeShape{"v3-fp8-tp8", 7168, 256, 256, 8, true, true, 8, 12},
                            MoeShape{"fp8-up-bf16-down", 2048, 1408, 16, 6, true, false, 8},
                            MoeShape{"tiny-fp8", 256, 192, 8, 2, true, true, 8}}) {
    ExpertSet set(s);
    Tensor d_views = device_views(set);
    const MoeGroupedShape gs{s.hidden, s.inter, s.num_experts, s.top_k, 128};
    const int64_t T = 1;
    const GroupedWorkspace workspace = grouped_workspace(gs, T * s.top_k);
    Step st = make_step(s, T, false, 1700);
    cudaStream_t stream = cuda::context().stream;
    auto launcher = [&](int up_stream, bool pdl) {
      MoeGroupedOptions opt;
      opt.up_stream = up_stream;
      opt.pdl = pdl;
      return [&, opt] {
        return launch_moe_grouped(st.x.data<__nv_bfloat16>(), T, st.ids.data<int32_t>(), st.weights.data<float>(), gs,
                                  d_views.data<ExpertView>(), s.gate_up_fp8, s.down_fp8, workspace.ws,
                                  st.out.data<__nv_bfloat16>(), stream, opt);
      };
    };
    // h and y poisoned (bf16 NaN) before every run: a stream kernel that left
    // h unwritten would otherwise read an earlier run's h and pass.
    auto run = [&](int up_stream, bool pdl, bool graph) {
      auto launch = launcher(up_stream, pdl);
      NUCLEUS_CUDA_CHECK(cudaMemsetAsync(st.out.raw(), 0x7f, st.out.nbytes(), stream));
      NUCLEUS_CUDA_CHECK(cudaMemsetAsync(workspace.ws.h, 0xff, T * s.top_k * s.inter * 2, stream));
      NUCLEUS_CUDA_CHECK(cudaMemsetAsync(workspace.ws.y, 0xff, T * s.top_k * s.hidden * 2, stream));
      run_eager_or_graph(stream, graph, launch);
      return from_bf16(host_copy<uint16_t>(st.out));
    };
    for (int up_stream : {0, 1}) {
      const std::vector<std::string> names = captured_kernel_names(stream, launcher(up_stream, true));
      EXPECT_EQ(any_contains(names, "moe_up_stream_kernel"), up_stream == 1) << s.name << " up_stream " << up_stream;
      // The MMA UP: grouped_gemm_kernel<16, 128, ..., kUp = true, ...> (its 7th template argument).
      const bool mma_up = std::any_of(names.begin(), names.end(), [](const std::string& n) {
        return n.find("grouped_gemm_kernel") != std::string::npos && n.find("ILi16ELi128E") != std::string::npos;
      });
      EXPECT_EQ(mma_up, up_stream == 0) << s.name << " up_stream " << up_stream;
    }
    const auto rows = sample_rows(T, T);
    const auto want = reference_rows(set, st.x_host, st.routing, rows);
    const auto on = run(1, false, false);
    const auto off = run(0, false, false);
    expect_close(off, want, rows, s.hidden, std::string(s.name) + " up stream off");
    expect_close(on, want, rows, s.hidden, std::string(s.name) + " up stream on");
    int64_t differ = 0;
    for (size_t i = 0; i < on.size(); ++i) differ += on[i] != off[i];
    std::printf("%s: %lld of %zu outputs differ between up stream on and off\n", s.name,
                static_cast<long long>(differ), on.size());
    for (bool pdl : {false, true}) {
      const auto again = run(1, pdl, pdl);
      EXPECT_EQ(0, std::memcmp(again.data(), on.data(), on.size() * 4))
          << s.name << (pdl ? " pdl, graph" : " eager") << ": a repeat of the stream path differs";
    }
    // Two ids out of range (one negative, one past the experts): their pairs contribute nothing.
    Routing ref_routing = st.routing;
    std::vector<int32_t> ids = st.routing.ids;
    ids[0] = -1;
    ids[1] = static_cast<int32_t>(s.num_experts + 3);
    ref_routing.ids[0] = ref_routing.ids[1] = 0;
    ref_routing.weights[0] = ref_routing.weights[1] = 0.0f;
    NUCLEUS_CUDA_CHECK(cudaMemcpy(st.ids.raw(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    expect_close(run(1, true, false), reference_rows(set, st.x_host, ref_routing, rows), rows, s.hidden,
                 std::string(s.name) + " up stream, ids out of range");
  }
}

// The prefill-sized grouped GEMMs on wgmma (NUCLEUS_MOE_WGMMA,
// MoeGroupedOptions::wgmma): where the rule applies, by hand; the kernels a
// step launches (captured: grouped_wgmma_kernel and no 128-row mma.sync
// GEMM with the switch on, the reverse off); on and off each close to the
// reference and to each other (the same products, summed in another order)
// on V2-Lite (bf16), a V3-like FP8 shape, V3's TP 8 shard with FP8 gate_up
// and bf16 down, with uniform routing (ragged last tiles) and skewed routing
// (a few experts with 3 tiles, the rest with none); a graph replay equals
// eager bit for bit. out, h and y are poisoned before every run.
TEST_F(MoeGpu, ExpertsWgmmaEqualsMma) {
  auto opts = [](int wgmma) {
    MoeGroupedOptions o;
    o.force_bm = 128;
    o.up_splits = 1;
    o.wgmma = wgmma;
    return o;
  };
  EXPECT_TRUE(moe_grouped_wgmma({2048, 1408, 64, 6}, 128, opts(-1)));   // V2-Lite
  EXPECT_TRUE(moe_grouped_wgmma({7168, 2048, 256, 8}, 128, opts(-1)));  // V3
  EXPECT_TRUE(moe_grouped_wgmma({7168, 256, 256, 8}, 128, opts(1)));    // V3 TP 8
  EXPECT_FALSE(moe_grouped_wgmma({2048, 1408, 64, 6}, 128, opts(0)));   // switched off
  EXPECT_FALSE(moe_grouped_wgmma({2048, 1408, 64, 6}, 64, opts(1)));    // 64-row tiles
  EXPECT_FALSE(moe_grouped_wgmma({256, 192, 8, 2}, 128, opts(1)));      // inter 192: not 128-wide tiles
  EXPECT_FALSE(moe_grouped_wgmma({1152, 1408, 64, 6}, 128, opts(1)));   // hidden 1152: not 256-wide tiles

  for (const MoeShape& s : {MoeShape{"v2-lite", 2048, 1408, 64, 6, false, false, 24},
                            MoeShape{"v3-like-fp8", 7168, 2048, 32, 8, true, true, 12, 8},
                            MoeShape{"v3-tp8-fp8-up-bf16-down", 7168, 256, 64, 8, true, false, 16, 8}}) {
    ExpertSet set(s);
    Tensor d_views = device_views(set);
    const MoeGroupedShape gs{s.hidden, s.inter, s.num_experts, s.top_k};
    for (bool skewed : {false, true}) {
      const int64_t T = skewed ? 300 : 700;
      const std::string what = std::string(s.name) + (skewed ? " skewed" : " random") + " T=" + std::to_string(T);
      const GroupedWorkspace workspace = grouped_workspace(gs, T * s.top_k);
      Step st = make_step(s, T, skewed, 2100 + T);
      cudaStream_t stream = cuda::context().stream;
      auto launcher = [&](int wgmma) {
        return [&, wgmma] {
          return launch_moe_grouped(st.x.data<__nv_bfloat16>(), T, st.ids.data<int32_t>(), st.weights.data<float>(),
                                    gs, d_views.data<ExpertView>(), s.gate_up_fp8, s.down_fp8, workspace.ws,
                                    st.out.data<__nv_bfloat16>(), stream, opts(wgmma));
        };
      };
      auto run = [&](int wgmma, bool graph) {
        NUCLEUS_CUDA_CHECK(cudaMemsetAsync(st.out.raw(), 0xff, st.out.nbytes(), stream));
        NUCLEUS_CUDA_CHECK(cudaMemsetAsync(workspace.ws.h, 0xff, T * s.top_k * s.inter * 2, stream));
        NUCLEUS_CUDA_CHECK(cudaMemsetAsync(workspace.ws.y, 0xff, T * s.top_k * s.hidden * 2, stream));
        run_eager_or_graph(stream, graph, launcher(wgmma));
        return from_bf16(host_copy<uint16_t>(st.out));
      };
      for (int wgmma : {0, 1}) {
        const std::vector<std::string> names = captured_kernel_names(stream, launcher(wgmma));
        EXPECT_EQ(any_contains(names, "grouped_wgmma_kernel"), wgmma == 1) << what << " wgmma " << wgmma;
        // The mma.sync GEMMs of 128-row tiles: grouped_gemm_kernel<128, 128, ...>.
        EXPECT_EQ(any_contains(names, "grouped_gemm_kernelILi128ELi128E"), wgmma == 0) << what << " wgmma " << wgmma;
      }
      const auto rows = sample_rows(T, s.max_ref_tokens);
      const auto want = reference_rows(set, st.x_host, st.routing, rows);
      const auto on = run(1, false);
      const auto off = run(0, false);
      expect_close(off, want, rows, s.hidden, what + " mma.sync");
      expect_close(on, want, rows, s.hidden, what + " wgmma");
      // On against off over every row: the same products in another f32 order,
      // so h and y may round to the neighbouring bf16 in a few places.
      expect_close(on, off, all_rows(T), s.hidden, what + " wgmma against mma.sync",
                   CloseTol{.atol_rms = 0.01f, .rtol = 0.01f, .max_rel_l2 = 3e-3});
      const auto replay = run(1, true);
      EXPECT_EQ(0, std::memcmp(replay.data(), on.data(), on.size() * 4)) << what << ": graph replay differs from eager";
    }
  }
}

// W8A8 prefill steps (NUCLEUS_MOE_FP8_W8A8, MoeGroupedOptions::fp8_w8a8):
// where the rule applies, by hand; the kernels a step launches (captured:
// x's and h's quantization and grouped_wgmma_w8a8_kernel when on, neither
// when off); on, close to the host emulation of W8A8 (x and h quantized per
// 1 x 128 block) on a V3-like shape and V3's TP-8 shard, uniform (ragged last
// tiles) and skewed routing (empty experts); off, close to the unquantized
// reference as before; on within a few percent of off (the activations'
// rounding to e4m3); a graph replay equals eager bit for bit. out, h and y
// are poisoned before every run.
TEST_F(MoeGpu, ExpertsFp8W8a8) {
  auto opts = [](int w8a8) {
    MoeGroupedOptions o;
    o.force_bm = 128;
    o.up_splits = 1;
    o.fp8_w8a8 = w8a8;
    return o;
  };
  const MoeGroupedShape v3{7168, 2048, 256, 8, 128, 128};
  EXPECT_TRUE(moe_grouped_w8a8(v3, 128, true, true, opts(-1)));
  EXPECT_TRUE(moe_grouped_w8a8({7168, 256, 256, 8, 128, 128}, 128, true, true, opts(1)));  // V3 TP 8
  EXPECT_FALSE(moe_grouped_w8a8(v3, 128, true, true, opts(0)));                              // switched off
  EXPECT_FALSE(moe_grouped_w8a8(v3, 64, true, true, opts(1)));                               // 64-row tiles
  EXPECT_FALSE(moe_grouped_w8a8(v3, 128, true, false, opts(1)));                             // bf16 down
  EXPECT_FALSE(moe_grouped_w8a8({7168, 2048, 256, 8, 128, 0}, 128, true, true, opts(1)));    // down blocks not given
  EXPECT_FALSE(moe_grouped_w8a8({7168, 2048, 256, 8, 64, 64}, 128, true, true, opts(1)));    // 64-wide blocks
  EXPECT_FALSE(moe_grouped_w8a8({256, 192, 8, 2, 128, 128}, 128, true, true, opts(1)));      // inter 192
  MoeGroupedOptions no_wgmma = opts(1);
  no_wgmma.wgmma = 0;
  EXPECT_FALSE(moe_grouped_w8a8(v3, 128, true, true, no_wgmma));                             // wgmma switched off

  for (const MoeShape& s : {MoeShape{"v3-like-fp8", 7168, 2048, 32, 8, true, true, 16, 8},
                            MoeShape{"v3-tp8-fp8", 7168, 256, 64, 8, true, true, 32, 8}}) {
    ExpertSet set(s);
    Tensor d_views = device_views(set);
    const MoeGroupedShape gs{s.hidden, s.inter, s.num_experts, s.top_k, 128, 128};
    for (bool skewed : {false, true}) {
      const int64_t T = skewed ? 300 : 700;
      const std::string what = std::string(s.name) + (skewed ? " skewed" : " random") + " T=" + std::to_string(T);
      const GroupedWorkspace workspace = grouped_workspace(gs, T * s.top_k);
      ASSERT_NE(workspace.ws.x_fp8, nullptr) << what << ": the workspace carved no W8A8 buffers";
      Step st = make_step(s, T, skewed, 3100 + T);
      cudaStream_t stream = cuda::context().stream;
      auto launcher = [&](int w8a8) {
        return [&, w8a8] {
          return launch_moe_grouped(st.x.data<__nv_bfloat16>(), T, st.ids.data<int32_t>(), st.weights.data<float>(),
                                    gs, d_views.data<ExpertView>(), s.gate_up_fp8, s.down_fp8, workspace.ws,
                                    st.out.data<__nv_bfloat16>(), stream, opts(w8a8));
        };
      };
      auto run = [&](int w8a8, bool graph) {
        NUCLEUS_CUDA_CHECK(cudaMemsetAsync(st.out.raw(), 0xff, st.out.nbytes(), stream));
        NUCLEUS_CUDA_CHECK(cudaMemsetAsync(workspace.ws.h, 0xff, T * s.top_k * s.inter * 2, stream));
        NUCLEUS_CUDA_CHECK(cudaMemsetAsync(workspace.ws.y, 0xff, T * s.top_k * s.hidden * 2, stream));
        // The quantized activations too: a replay whose quantization wrote nothing must not pass.
        NUCLEUS_CUDA_CHECK(cudaMemsetAsync(workspace.ws.x_fp8, 0xff, T * s.hidden, stream));
        NUCLEUS_CUDA_CHECK(cudaMemsetAsync(workspace.ws.x_scale, 0xff, T * (s.hidden / 128) * 4, stream));
        NUCLEUS_CUDA_CHECK(cudaMemsetAsync(workspace.ws.h_fp8, 0xff, T * s.top_k * s.inter, stream));
        NUCLEUS_CUDA_CHECK(cudaMemsetAsync(workspace.ws.h_scale, 0xff, T * s.top_k * (s.inter / 128) * 4, stream));
        run_eager_or_graph(stream, graph, launcher(w8a8));
        return from_bf16(host_copy<uint16_t>(st.out));
      };
      for (int w8a8 : {0, 1}) {
        const std::vector<std::string> names = captured_kernel_names(stream, launcher(w8a8));
        EXPECT_EQ(any_contains(names, "grouped_wgmma_w8a8_kernel"), w8a8 == 1) << what << " w8a8 " << w8a8;
        EXPECT_EQ(any_contains(names, "fp8_act_quant_kernel"), w8a8 == 1) << what << " w8a8 " << w8a8;
      }
      const auto rows = sample_rows(T, s.max_ref_tokens);
      const auto on = run(1, false);
      const auto off = run(0, false);
      expect_close(off, reference_rows(set, st.x_host, st.routing, rows), rows, s.hidden, what + " W8A16");
      expect_close(on, w8a8_reference_rows(set, st.x_host, st.routing, rows), rows, s.hidden,
                   what + " W8A8 against its emulation", kW8a8Tol);
      const double apart = expect_close(on, off, all_rows(T), s.hidden, what + " W8A8 against W8A16",
                                        CloseTol{.atol_rms = 0.5f, .rtol = 0.25f, .max_rel_l2 = 0.08});
      EXPECT_GT(apart, 1e-3) << what << ": W8A8 equals W8A16 (the activations were not quantized?)";
      const auto replay = run(1, true);
      EXPECT_EQ(0, std::memcmp(replay.data(), on.data(), on.size() * 4)) << what << ": graph replay differs from eager";
    }
  }
}

// The combine with its loads batched (NUCLEUS_MOE_COMBINE_PREFETCH,
// MoeGroupedOptions::combine_prefetch, the default) equals the pair-by-pair
// loop bit for bit: one chunk of 8 pairs (V2-Lite, top-6) and two (top-10),
// one token (align-free: ids) and several (aligned: pair positions), and
// ids out of range (skipped by both).
TEST_F(MoeGpu, ExpertsCombinePrefetchEqualsPlain) {
  for (const MoeShape& s : {MoeShape{"v2-lite", 2048, 1408, 64, 6, false, false, 8},
                            MoeShape{"top-10", 512, 256, 32, 10, false, false, 8}}) {
    ExpertSet set(s);
    Tensor d_views = device_views(set);
    const MoeGroupedShape gs{s.hidden, s.inter, s.num_experts, s.top_k};
    for (int64_t T : {1, 3, 64}) {
      const GroupedWorkspace workspace = grouped_workspace(gs, T * s.top_k);
      Step st = make_step(s, T, false, 1400 + T);
      auto run = [&](bool prefetch) {
        MoeGroupedOptions opt;
        opt.combine_prefetch = prefetch;
        EXPECT_EQ(launch_moe_grouped(st.x.data<__nv_bfloat16>(), T, st.ids.data<int32_t>(), st.weights.data<float>(),
                                     gs, d_views.data<ExpertView>(), s.gate_up_fp8, s.down_fp8, workspace.ws,
                                     st.out.data<__nv_bfloat16>(), cuda::context().stream, opt),
                  cudaSuccess);
        NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(cuda::context().stream));
        return host_copy<uint16_t>(st.out);
      };
      const auto plain = run(false);
      EXPECT_EQ(run(true), plain) << s.name << " T " << T;
      std::vector<int32_t> ids = host_copy<int32_t>(st.ids);  // two pairs out of range
      ids[1] = -1;
      ids[ids.size() - 1] = static_cast<int32_t>(s.num_experts + 3);
      NUCLEUS_CUDA_CHECK(cudaMemcpy(st.ids.raw(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
      const auto skipped = run(false);
      EXPECT_EQ(run(true), skipped) << s.name << " T " << T << ", ids out of range";
      EXPECT_NE(skipped, plain) << s.name << " T " << T << ": skipping two pairs changed nothing";
    }
  }
}

// The add + RMSNorm in the combine's launch (MoeCombineNorm,
// NUCLEUS_MOE_COMBINE_NORM): out, residual and normed equal the combine
// followed by launch_add_rmsnorm bit for bit, with and without the prefetch,
// at one token (align-free) and several (pair positions), V2-Lite's and V3's
// widths, normed written over x (as the decode graph does), eagerly and in a
// CUDA graph with PDL; a prezero fill in the same launch zeroes its buffer;
// a width past 8192 and a fill without blocks are refused.
TEST_F(MoeGpu, ExpertsCombineNormEqualsCombineThenNorm) {
  for (const MoeShape& s : {MoeShape{"v2-lite", 2048, 1408, 64, 8, false, false, 8},
                            MoeShape{"v3-fp8-tp8", 7168, 256, 256, 9, true, true, 8, 12}}) {
    ExpertSet set(s);
    Tensor d_views = device_views(set);
    const MoeGroupedShape gs{s.hidden, s.inter, s.num_experts, s.top_k};
    const std::vector<float> norm_w = random_bf16_values(s.hidden, 2.0f, 77);
    Tensor d_norm_w = device_copy(norm_w, DType::kF32);
    for (int64_t T : {1, 5, 64}) {
      const GroupedWorkspace workspace = grouped_workspace(gs, T * s.top_k);
      Step st = make_step(s, T, false, 2600 + T);
      const std::vector<float> residual0 = random_bf16_values(T * s.hidden, 3.0f, 2700 + T);
      Tensor residual = device_copy(residual0, DType::kF32);
      Tensor normed = Tensor::empty({T, s.hidden}, DType::kBF16, Device::kCuda);
      const std::vector<uint16_t> x0 = host_copy<uint16_t>(st.x);
      cudaStream_t stream = cuda::context().stream;
      struct Result {
        std::vector<uint16_t> out, normed;
        std::vector<float> residual;
        bool operator==(const Result& o) const {
          return out == o.out && normed == o.normed &&
                 0 == std::memcmp(residual.data(), o.residual.data(), residual.size() * 4);
        }
      };
      // fused: the norm in the combine; else the combine, then the norm
      // kernel. in_place: normed written over x.
      auto run = [&](bool fused, bool prefetch, bool in_place, bool graph, Tensor* fill) {
        copy_to_device(residual.raw(), residual0.data(), residual0.size() * 4);
        copy_to_device(st.x.raw(), x0.data(), x0.size() * 2);
        __nv_bfloat16* normed_ptr = in_place ? st.x.data<__nv_bfloat16>() : normed.data<__nv_bfloat16>();
        MoeGroupedOptions opt;
        opt.combine_prefetch = prefetch;
        opt.pdl = graph;
        MoeCombineNorm norm;
        if (fused) {
          norm.residual = residual.data<float>();
          norm.w = d_norm_w.data<float>();
          norm.eps = 1e-6f;
          norm.normed = normed_ptr;
          if (fill) {
            norm.zero_fill = fill->data<float>();
            norm.zero_fill_count = fill->numel();
            norm.fill_blocks = 3;
          }
        }
        auto launch = [&] {
          EXPECT_EQ(launch_moe_grouped(st.x.data<__nv_bfloat16>(), T, st.ids.data<int32_t>(), st.weights.data<float>(),
                                       gs, d_views.data<ExpertView>(), s.gate_up_fp8, s.down_fp8, workspace.ws,
                                       st.out.data<__nv_bfloat16>(), stream, opt, norm),
                    cudaSuccess);
          if (!fused) {
            EXPECT_EQ(launch_add_rmsnorm(residual.data<float>(), st.out.data<__nv_bfloat16>(), d_norm_w.data<float>(),
                                         T, s.hidden, 1e-6f, normed_ptr, stream),
                      cudaSuccess);
          }
        };
        if (!graph) {
          launch();
        } else {  // one replay: the residual is read-modify-write
          cudaGraph_t g;
          cudaGraphExec_t exec;
          EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
          launch();
          EXPECT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess);
          EXPECT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
          EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
          cudaGraphExecDestroy(exec);
          cudaGraphDestroy(g);
        }
        NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(stream));
        return Result{host_copy<uint16_t>(st.out), host_copy<uint16_t>(in_place ? st.x : normed),
                      host_copy<float>(residual)};
      };
      const Result want = run(false, true, false, false, nullptr);
      EXPECT_NE(0, std::memcmp(want.residual.data(), residual0.data(), residual0.size() * 4)) << "the add did nothing";
      for (bool prefetch : {true, false}) {
        SCOPED_TRACE(std::string(s.name) + " T " + std::to_string(T) + (prefetch ? " prefetch" : " plain"));
        EXPECT_TRUE(run(true, prefetch, false, false, nullptr) == want);
        EXPECT_TRUE(run(true, prefetch, true, false, nullptr) == want) << "normed over x";
        EXPECT_TRUE(run(true, prefetch, true, true, nullptr) == want) << "graph, PDL";
      }
      Tensor fill = device_poisoned(T * 1000 + 3, DType::kF32);
      EXPECT_TRUE(run(true, true, true, true, &fill) == want) << s.name << " T " << T << " with a fill";
      for (float v : host_copy<float>(fill)) ASSERT_EQ(v, 0.0f) << s.name << " T " << T << ": the fill left a value";
    }
  }
  // Refusals: a row past add_norm_row's 8192 columns, a fill without blocks.
  const MoeShape wide{"wide", 8320, 256, 16, 2, false, false, 8, 1};
  ExpertSet set(wide);
  Tensor d_views = device_views(set);
  const MoeGroupedShape gs{wide.hidden, wide.inter, wide.num_experts, wide.top_k};
  const GroupedWorkspace workspace = grouped_workspace(gs, 2);
  Step st = make_step(wide, 1, false, 2900);
  Tensor residual = Tensor::empty({1, wide.hidden}, DType::kF32, Device::kCuda);
  Tensor w = Tensor::empty({wide.hidden}, DType::kF32, Device::kCuda);
  MoeCombineNorm norm;
  norm.residual = residual.data<float>();
  norm.w = w.data<float>();
  norm.normed = st.x.data<__nv_bfloat16>();
  EXPECT_EQ(launch_moe_grouped(st.x.data<__nv_bfloat16>(), 1, st.ids.data<int32_t>(), st.weights.data<float>(), gs,
                               d_views.data<ExpertView>(), false, false, workspace.ws, st.out.data<__nv_bfloat16>(),
                               cuda::context().stream, {}, norm),
            cudaErrorInvalidValue);
  const MoeShape v2{"v2-lite", 2048, 1408, 64, 6, false, false, 8, 1};
  ExpertSet set2(v2);
  Tensor views2 = device_views(set2);
  const MoeGroupedShape gs2{v2.hidden, v2.inter, v2.num_experts, v2.top_k};
  const GroupedWorkspace ws2 = grouped_workspace(gs2, 6);
  Step st2 = make_step(v2, 1, false, 2901);
  norm.zero_fill = residual.data<float>();
  norm.zero_fill_count = 4;
  norm.fill_blocks = 0;
  EXPECT_EQ(launch_moe_grouped(st2.x.data<__nv_bfloat16>(), 1, st2.ids.data<int32_t>(), st2.weights.data<float>(),
                               gs2, views2.data<ExpertView>(), false, false, ws2.ws, st2.out.data<__nv_bfloat16>(),
                               cuda::context().stream, {}, norm),
            cudaErrorInvalidValue);
}

// PDL (the op's default under NUCLEUS_PDL=1): every launch a programmatic
// dependent of the one before, DOWN streaming its first weights before it
// waits for h. Eager and inside a CUDA graph, the output equals the plain
// launches' bit for bit (the kernels are deterministic), with split-K (V3
// TP 8 at T = 1) and without, at decode and prefill tile heights.
TEST_F(MoeGpu, ExpertsPdlEqualsPlainLaunches) {
  for (const MoeShape& s : {MoeShape{"v2-lite", 2048, 1408, 64, 6, false, false, 8},
                            MoeShape{"v3-fp8-tp8", 7168, 256, 256, 8, true, true, 8, 12}}) {
    ExpertSet set(s);
    Tensor d_views = device_views(set);
    const MoeGroupedShape gs{s.hidden, s.inter, s.num_experts, s.top_k};
    for (int64_t T : {1, 8, 300}) {
      const GroupedWorkspace workspace = grouped_workspace(gs, T * s.top_k);
      const MoeGroupedWorkspace& ws = workspace.ws;
      Step st = make_step(s, T, false, 500 + T);
      cudaStream_t stream = cuda::context().stream;
      auto launch = [&](bool pdl) {
        MoeGroupedOptions opt;
        opt.pdl = pdl;
        return launch_moe_grouped(st.x.data<__nv_bfloat16>(), T, st.ids.data<int32_t>(), st.weights.data<float>(), gs,
                                  d_views.data<ExpertView>(), s.gate_up_fp8, s.down_fp8, ws,
                                  st.out.data<__nv_bfloat16>(), stream, opt);
      };
      auto run = [&](bool pdl, bool graph) {
        NUCLEUS_CUDA_CHECK(cudaMemsetAsync(st.out.raw(), 0x7f, st.out.nbytes(), stream));
        run_eager_or_graph(stream, graph, [&] { return launch(pdl); });
        return from_bf16(host_copy<uint16_t>(st.out));
      };
      const auto plain = run(false, false);
      const auto rows = sample_rows(T, s.max_ref_tokens);
      expect_close(plain, reference_rows(set, st.x_host, st.routing, rows), rows, s.hidden,
                   std::string(s.name) + " T=" + std::to_string(T) + " plain launches");
      for (bool graph : {false, true}) {
        const auto got = run(true, graph);
        EXPECT_EQ(0, std::memcmp(got.data(), plain.data(), got.size() * 4))
            << s.name << " T=" << T << (graph ? " graph" : " eager") << ": PDL launches differ from plain ones";
      }
      if (T == 8) {  // every id out of range: no m-tile at all; the output is zero
        std::vector<int32_t> none(static_cast<size_t>(T * s.top_k), -1);
        NUCLEUS_CUDA_CHECK(cudaMemcpy(st.ids.raw(), none.data(), none.size() * 4, cudaMemcpyHostToDevice));
        for (bool graph : {false, true}) {
          const auto got = run(true, graph);
          EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float v) { return v == 0.0f; }))
              << s.name << (graph ? " graph" : " eager") << ": ids all out of range, output not zero";
        }
      }
    }
  }
}

// A step larger than the op's capacity runs in chunks (here 100 tokens).
TEST_F(MoeGpu, ExpertsChunked) {
  const MoeShape s{"tiny-chunked", 256, 192, 8, 2, false, false, 4096};
  ExpertSet set(s);
  setenv("NUCLEUS_MOE_CHUNK_TOKENS", "100", 1);
  MoeExpertsOp op(set.op_experts, s.inter, s.top_k);
  ASSERT_TRUE(op.select_backend(Device::kCuda).ok());
  StepResources res;
  ASSERT_TRUE(res.reserve_ops({&op}, StepLimits{.max_tokens = 50}, Device::kCuda).ok());  // capacity from the variable: 100
  unsetenv("NUCLEUS_MOE_CHUNK_TOKENS");
  Step st = make_step(s, 50, false, 99);
  run_op(op, res, st);
  Step big = make_step(s, 333, false, 98);
  run_op(op, res, big);
  const auto rows = sample_rows(333, 4096);
  expect_close(from_bf16(host_copy<uint16_t>(big.out)), reference_rows(set, big.x_host, big.routing, rows), rows,
               s.hidden, "chunked T=333");
}

// The op with the add + norm after it folded in (MoeExpertsOp::fuse_add_rmsnorm,
// NUCLEUS_MOE_COMBINE_NORM) equals the op followed by the add + norm kernel,
// bit for bit, on each CUDA backend: cuda_grouped in chunks of 100 tokens
// (333 tokens: the norm in each chunk's combine) and at one token,
// cuda_decode (the decode kernel, then the norm kernel; NUCLEUS_MOE_DECODE=16
// as ctest sets it) and cuda_naive. As a prezero donor it zeroes its fill
// buffer's first m * n_total values where the gate fills (m = 1, 5) and
// leaves it alone where it does not (m = 333).
TEST_F(MoeGpu, ExpertsOpFoldedNormEqualsTheNormAfterIt) {
  struct Case {
    const char* backend;
    MoeShape shape;
    std::vector<int64_t> tokens;
  };
  const std::vector<Case> cases = {
      {"cuda_grouped", MoeShape{"tiny-chunked", 256, 192, 8, 2, false, false, 4096}, {333, 1}},
      {"cuda_decode", MoeShape{"v2-lite", 2048, 1408, 64, 6, false, false, 8, 4}, {5, 1}},
      {"cuda_naive", MoeShape{"tiny", 256, 192, 8, 2, false, false, 4096}, {5}},
  };
  constexpr int64_t kFillCols = 64;
  for (const Case& c : cases) {
    const MoeShape& s = c.shape;
    ExpertSet set(s);
    const std::vector<float> norm_w_host = random_bf16_values(s.hidden, 2.0f, 31);
    Tensor norm_w = device_copy(norm_w_host, DType::kF32);
    setenv("NUCLEUS_MOE_CHUNK_TOKENS", "100", 1);
    MoeExpertsOp plain(set.op_experts, s.inter, s.top_k), folded(set.op_experts, s.inter, s.top_k);
    folded.fuse_add_rmsnorm(norm_w, 1e-6f);
    folded.set_prezero({kFillCols, kFillCols, kPrezeroAnyRows});
    StepResources res;
    for (MoeExpertsOp* op : {&plain, &folded}) {
      const Status used = op->use_backend(experts_backend(c.backend));
      ASSERT_TRUE(used.ok()) << c.backend << ": " << used.to_string();
    }
    ASSERT_TRUE(res.reserve_ops({&plain, &folded}, StepLimits{.max_tokens = 50}, Device::kCuda).ok());
    unsetenv("NUCLEUS_MOE_CHUNK_TOKENS");
    for (int64_t T : c.tokens) {
      SCOPED_TRACE(std::string(c.backend) + " T " + std::to_string(T));
      Step st = make_step(s, T, false, 3100 + T);
      const std::vector<float> residual0 = random_bf16_values(T * s.hidden, 3.0f, 3200 + T);
      Tensor residual = device_copy(residual0, DType::kF32).view({T, s.hidden});
      Tensor normed = device_poisoned(T * s.hidden, DType::kBF16).view({T, s.hidden});
      Tensor fill = device_poisoned(T * kFillCols, DType::kF32).view({T, kFillCols});
      OpContext ctx;
      ctx.device = Device::kCuda;
      ctx.stream = cuda::context().stream;
      ASSERT_TRUE(res.begin_step(ctx).ok());
      plain.run(ctx, {st.x, st.ids, st.weights}, {st.out, st.scratch});
      ASSERT_TRUE(ctx.error.ok()) << ctx.error.to_string();
      ASSERT_EQ(launch_add_rmsnorm(residual.data<float>(), st.out.data<__nv_bfloat16>(), norm_w.data<float>(), T,
                                   s.hidden, 1e-6f, normed.data<__nv_bfloat16>(), cuda::context().stream),
                cudaSuccess);
      const auto want_out = host_copy<uint16_t>(st.out), want_normed = host_copy<uint16_t>(normed);
      const auto want_res = host_copy<float>(residual);
      copy_to_device(residual.raw(), residual0.data(), residual0.size() * 4);
      NUCLEUS_CUDA_CHECK(cudaMemset(st.out.raw(), 0x7f, st.out.nbytes()));
      NUCLEUS_CUDA_CHECK(cudaMemset(normed.raw(), 0x7f, normed.nbytes()));
      folded.run(ctx, {st.x, st.ids, st.weights, residual}, {st.out, st.scratch, residual, normed, fill});
      ASSERT_TRUE(ctx.error.ok()) << ctx.error.to_string();
      EXPECT_EQ(host_copy<uint16_t>(st.out), want_out);
      EXPECT_EQ(host_copy<uint16_t>(normed), want_normed);
      const auto got_res = host_copy<float>(residual);
      EXPECT_EQ(0, std::memcmp(got_res.data(), want_res.data(), got_res.size() * 4));
      const int64_t zeroed = prezero_fill_count(folded.prezero(), T);
      EXPECT_EQ(zeroed == 0, T == 333) << "the gate at " << T << " rows";
      const auto f = host_copy<uint32_t>(fill);
      for (int64_t i = 0; i < T * kFillCols; ++i)
        ASSERT_EQ(f[i], i < zeroed ? 0u : 0x7f7f7f7fu) << "fill element " << i << " of " << zeroed << " zeroed";
    }
  }
}

// Shapes the kernels cannot take fall back to cuda_naive, with the reason.
TEST_F(MoeGpu, ExpertsRefusals) {
  const MoeShape odd{"odd-hidden", 192, 64, 4, 2, false, false, 64};  // hidden % 128 != 0
  ExpertSet set(odd);
  MoeExpertsOp op(set.op_experts, odd.inter, odd.top_k);
  const Status why = cuda_ops::moe_experts_grouped_supports(op);
  EXPECT_FALSE(why.ok());
  EXPECT_NE(why.message().find("hidden_size"), std::string::npos) << why.message();
  ASSERT_TRUE(op.select_backend(Device::kCuda).ok());
  EXPECT_EQ(op.backend(), "cuda_naive");
}


// ---------------------------------------------------------------- decode kernel

// The decode kernel keeps h in f32, so beyond the order of f32 sums its only
// rounding is the output's bf16 (half an ulp: 2^-9 of |want|): every element
// within 1% of the reference's RMS plus 0.4% of its own size, relative L2
// error below 3e-3 (the bf16 output alone gives ~1.1e-3).
constexpr CloseTol kDecodeTol{0.01f, 0.004f, 3e-3};

// The routing the reference can take: ids out of range contribute nothing in
// the kernels, so they become expert 0 with weight 0 here.
Routing referenceable(Routing r, int64_t num_experts) {
  for (size_t i = 0; i < r.ids.size(); ++i)
    if (r.ids[i] < 0 || r.ids[i] >= num_experts) r.ids[i] = 0, r.weights[i] = 0.0f;
  return r;
}

// Through the op, as the engine runs it: the dispatch picks cuda_decode for
// these bf16 experts, steps of T tokens run the decode kernels; random
// routing at every T of `Ts`, every token on the same top_k experts at
// `skewed_Ts`.
void check_decode_shape(const MoeShape& s, const std::vector<int64_t>& Ts, const std::vector<int64_t>& skewed_Ts) {
  ExpertSet set(s);
  MoeExpertsOp op(set.op_experts, s.inter, s.top_k);
  ASSERT_TRUE(op.select_backend(Device::kCuda).ok());
  ASSERT_EQ(op.backend(), "cuda_decode") << s.name;
  StepResources res;
  ASSERT_TRUE(res.reserve_ops({&op}, StepLimits{.max_tokens = kMoeDecodeMaxTokens}, Device::kCuda).ok());
  for (bool skewed : {false, true}) {
    for (int64_t T : skewed ? skewed_Ts : Ts) {
      const std::string what = std::string(s.name) + " decode" + (skewed ? " skewed" : " random") +
                               " T=" + std::to_string(T);
      Step st = make_step(s, T, skewed, 31 * T + skewed + s.inter);
      run_op(op, res, st);
      const auto rows = all_rows(T);
      expect_close(from_bf16(host_copy<uint16_t>(st.out)), reference_rows(set, st.x_host, st.routing, rows), rows,
                   s.hidden, what, kDecodeTol);
    }
  }
}

const std::vector<int64_t> kEveryT = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
const std::vector<int64_t> kSomeT = {1, 2, 3, 5, 8, 13, 16};

// V2-Lite: hidden 2048, moe_intermediate 1408, 64 experts, top-6 (every expert
// its own weights).
TEST_F(MoeGpu, DecodeV2Lite) { check_decode_shape({"v2-lite", 2048, 1408, 64, 6, false, false, 16}, kEveryT, {2, 16}); }

// V3: hidden 7168, moe_intermediate 2048 sharded over TP 1, 4, 8; 256 experts,
// top-8; bf16 and FP8 (e4m3, 128x128 block scales varying 0.5..1.5 per
// block). Kimi-K2: the same expert shape, 384 experts, FP8 (its checkpoint's
// type). The expert ids span the whole range; 12 distinct weight sets stand in
// for the experts (expert e uses set e % 12) to bound the memory. The FP8
// reference multiplies by the exact dequantized weights (code * scale), so the
// tolerance stays kDecodeTol.
TEST_F(MoeGpu, DecodeV3Shards) {
  for (bool fp8 : {false, true})
    for (int64_t tp : {1, 4, 8})
      check_decode_shape({fp8 ? (tp == 1 ? "v3-fp8-tp1" : tp == 4 ? "v3-fp8-tp4" : "v3-fp8-tp8")
                              : (tp == 1 ? "v3-tp1" : tp == 4 ? "v3-tp4" : "v3-tp8"),
                          7168, 2048 / tp, 256, 8, fp8, fp8, 16, 12},
                         kSomeT, {16});
}
TEST_F(MoeGpu, DecodeKimiK2Shards) {
  for (int64_t tp : {1, 4, 8})
    check_decode_shape({tp == 1 ? "kimi-k2-fp8-tp1" : tp == 4 ? "kimi-k2-fp8-tp4" : "kimi-k2-fp8-tp8", 7168, 2048 / tp,
                        384, 8, true, true, 16, 12},
                       kSomeT, {7});
}
// bf16 gate_up with FP8 down (the two kernels' types are independent).
TEST_F(MoeGpu, DecodeMixedTypes) {
  check_decode_shape({"tiny-fp8-down", 256, 192, 8, 2, false, true, 16}, kEveryT, {16});
}

// Through the kernel interface: every K slice count of the up kernel, PDL on
// and off; a token choosing one expert twice (two passes of the expert's
// pairs at MR = T), ids out of range (-1, num_experts) and a token with no
// valid expert (its row is 0); the largest pair count (T 16 x top_k 16).
TEST_F(MoeGpu, DecodeKernelEdgeCases) {
  for (const MoeShape& s : {MoeShape{"v2-lite", 2048, 1408, 64, 6, false, false, 16},
                            MoeShape{"v3-tp8", 7168, 256, 256, 8, false, false, 16, 12},
                            MoeShape{"v3-fp8-tp8", 7168, 256, 256, 8, true, true, 16, 12},
                            MoeShape{"top16", 256, 192, 64, 16, false, false, 16}}) {
    ExpertSet set(s);
    Tensor d_views = device_views(set);
    for (int64_t T : {1, 3, 16}) {
      Step st = make_step(s, T, false, 500 + T);
      const int64_t K = s.top_k;
      st.routing.ids[1] = st.routing.ids[0];  // token 0: one expert twice (at T = 1: two passes of MR = 1)
      if (T >= 3) {
        st.routing.ids[K] = -1;  // token 1: two ids out of range
        st.routing.ids[K + 1] = static_cast<int32_t>(s.num_experts);
        for (int64_t k = 0; k < K; ++k) st.routing.ids[2 * K + k] = -5;  // token 2: none valid
      }
      st.ids = device_copy(st.routing.ids, DType::kI32).view({T, K});
      const auto rows = all_rows(T);
      const auto want = reference_rows(set, st.x_host, referenceable(st.routing, s.num_experts), rows);
      Tensor h = device_poisoned(T * s.top_k * s.inter, DType::kF32);
      MoeDecodeArgs a;
      a.x = st.x.data<__nv_bfloat16>();
      a.topk_ids = st.ids.data<int32_t>();
      a.topk_weights = st.weights.data<float>();
      a.num_tokens = T;
      a.hidden = s.hidden;
      a.inter = s.inter;
      a.num_experts = s.num_experts;
      a.top_k = s.top_k;
      a.gate_up_fp8 = s.gate_up_fp8;
      a.down_fp8 = s.down_fp8;
      a.experts = d_views.data<ExpertView>();
      a.h = h.data<float>();
      a.out = st.out.data<__nv_bfloat16>();
      for (int slices : {0, 1, 2, 4, 8}) {
        std::vector<float> first;
        for (bool pdl : {false, true, true}) {
          a.up_slices = slices;
          a.pdl = pdl;
          NUCLEUS_CUDA_CHECK(cudaMemsetAsync(st.out.raw(), 0x7f, st.out.nbytes(), cuda::context().stream));
          ASSERT_EQ(launch_moe_decode(a, cuda::context().stream), cudaSuccess);
          NUCLEUS_CUDA_CHECK(cudaDeviceSynchronize());
          const auto got = from_bf16(host_copy<uint16_t>(st.out));
          const std::string what = std::string(s.name) + " T=" + std::to_string(T) + " slices=" +
                                   std::to_string(slices) + (pdl ? " pdl" : "");
          if (first.empty()) {
            first = got;
            expect_close(got, want, rows, s.hidden, what, kDecodeTol);
            if (T >= 3) {
              for (int64_t c = 0; c < s.hidden; ++c) ASSERT_EQ(got[2 * s.hidden + c], 0.0f) << what << " column " << c;
            }
          } else {
            EXPECT_EQ(0, std::memcmp(got.data(), first.data(), got.size() * 4)) << what << ": not bit-identical";
          }
        }
      }
    }
  }
}

// Through the op under CUDA-graph capture (PDL edges as the engine's decode
// graphs have them): a replay is bit-identical to the eager run; a step of 40
// tokens falls back to cuda_grouped in the same backend.
TEST_F(MoeGpu, DecodeGraphReplayAndFallback) {
  const MoeShape s{"v2-lite", 2048, 1408, 64, 6, false, false, 40};
  ExpertSet set(s);
  MoeExpertsOp op(set.op_experts, s.inter, s.top_k);
  ASSERT_TRUE(op.select_backend(Device::kCuda).ok());
  ASSERT_EQ(op.backend(), "cuda_decode");
  StepResources res;
  ASSERT_TRUE(res.reserve_ops({&op}, StepLimits{.max_tokens = 64}, Device::kCuda).ok());
  Step st = make_step(s, 8, false, 77);
  run_op(op, res, st);
  const auto eager = from_bf16(host_copy<uint16_t>(st.out));
  expect_close(eager, reference_rows(set, st.x_host, st.routing, all_rows(8)), all_rows(8), s.hidden, "eager T=8",
               kDecodeTol);
  cudaStream_t stream = cuda::context().stream;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  run_op(op, res, st);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    NUCLEUS_CUDA_CHECK(cudaMemsetAsync(st.out.raw(), 0x7f, st.out.nbytes(), stream));
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    const auto got = from_bf16(host_copy<uint16_t>(st.out));
    EXPECT_EQ(0, std::memcmp(got.data(), eager.data(), got.size() * 4)) << "graph replay " << replay << " differs";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  Step big = make_step(s, 40, false, 78);
  run_op(op, res, big);
  expect_close(from_bf16(host_copy<uint16_t>(big.out)), reference_rows(set, big.x_host, big.routing, all_rows(40)),
               all_rows(40), s.hidden, "T=40 (cuda_grouped inside cuda_decode)");
}

// What the decode kernels refuse: top_k above 16 (the op then dispatches to
// cuda_grouped), rows that are not 16-byte multiples, FP8 scale blocks that
// split a 16-byte chunk, more than 16 tokens or 256 pairs, a misaligned x, a
// bad slice count.
TEST_F(MoeGpu, DecodeRefusals) {
  const MoeShape top17{"top17", 256, 192, 32, 17, false, false, 16};
  ExpertSet set(top17);
  MoeExpertsOp op(set.op_experts, top17.inter, top17.top_k);
  const Status why = cuda_ops::moe_experts_decode_supports(op);
  EXPECT_FALSE(why.ok());
  EXPECT_NE(why.message().find("num_experts_per_tok"), std::string::npos) << why.message();
  ASSERT_TRUE(cuda_ops::moe_experts_grouped_supports(op).ok());
  ASSERT_TRUE(op.select_backend(Device::kCuda).ok());
  EXPECT_EQ(op.backend(), "cuda_grouped");

  WeightView gu{reinterpret_cast<const void*>(256), nullptr, 2 * 196, 256, 0, 0};
  WeightView dn{reinterpret_cast<const void*>(512), nullptr, 256, 196, 0, 0};
  const char* r = moe_decode_unsupported(256, 196, 8, 2, gu, dn);
  ASSERT_NE(r, nullptr);
  EXPECT_NE(std::string(r).find("moe_intermediate_size"), std::string::npos) << r;
  gu.n = 2 * 192, dn.k = 192;
  EXPECT_EQ(moe_decode_unsupported(256, 192, 8, 2, gu, dn), nullptr);
  EXPECT_NE(moe_decode_unsupported(256, 192, 8, 17, gu, dn), nullptr) << "top_k 17";
  EXPECT_NE(moe_decode_unsupported(256, 192, 1025, 2, gu, dn), nullptr) << "1025 experts";
  EXPECT_NE(moe_decode_unsupported(256, 192, 8, 2, gu, WeightView{dn.data, nullptr, 256, 200, 0, 0}), nullptr)
      << "down shape";
  const float scale = 1.0f;
  WeightView fp8_down{dn.data, &scale, 256, 192, 128, 128};
  EXPECT_EQ(moe_decode_unsupported(256, 192, 8, 2, gu, fp8_down), nullptr) << "FP8 down, 128x128 blocks";
  fp8_down.block_k = 8;
  EXPECT_NE(moe_decode_unsupported(256, 192, 8, 2, gu, fp8_down), nullptr) << "FP8 block_k 8";
  fp8_down.block_k = 128;
  WeightView fp8_down_200{dn.data, &scale, 256, 200, 128, 128};
  EXPECT_NE(moe_decode_unsupported(256, 200, 8, 2, WeightView{gu.data, nullptr, 400, 256, 0, 0}, fp8_down_200),
            nullptr)
      << "FP8 down with inter 200 (not a multiple of 16)";

  Tensor buf = Tensor::empty({1 << 20}, DType::kU8, Device::kCuda);
  MoeDecodeArgs a;
  a.x = buf.data<__nv_bfloat16>();
  a.topk_ids = buf.data<int32_t>();
  a.topk_weights = buf.data<float>();
  a.experts = buf.data<ExpertView>();
  a.h = buf.data<float>();
  a.out = buf.data<__nv_bfloat16>();
  a.num_tokens = 16, a.hidden = 256, a.inter = 192, a.num_experts = 64, a.top_k = 16;
  EXPECT_EQ(moe_decode_check(a), cudaSuccess) << "16 tokens x top 16 = 256 pairs";
  MoeDecodeArgs b = a;
  b.num_tokens = 17, b.top_k = 2;
  EXPECT_EQ(moe_decode_check(b), cudaErrorInvalidValue) << "17 tokens";
  b = a, b.num_tokens = 0;
  EXPECT_EQ(moe_decode_check(b), cudaErrorInvalidValue) << "0 tokens";
  b = a, b.top_k = 17, b.num_tokens = 1;
  EXPECT_EQ(moe_decode_check(b), cudaErrorInvalidValue) << "top_k 17";
  b = a, b.hidden = 260;
  EXPECT_EQ(moe_decode_check(b), cudaErrorInvalidValue) << "hidden 260";
  b = a, b.x = a.x + 1;
  EXPECT_EQ(moe_decode_check(b), cudaErrorInvalidValue) << "misaligned x";
  b = a, b.down_fp8 = true, b.inter = 200;
  EXPECT_EQ(moe_decode_check(b), cudaErrorInvalidValue) << "FP8 down, inter 200";
  b = a, b.up_slices = 3;
  EXPECT_EQ(moe_decode_check(b), cudaErrorInvalidValue) << "3 slices";
  b = a, b.out = nullptr;
  EXPECT_EQ(moe_decode_check(b), cudaErrorInvalidValue) << "null out";
  EXPECT_EQ(launch_moe_decode(b, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace nucleus::kernels
