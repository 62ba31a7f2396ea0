// The host side of the decode program (kernels/mono/mono_program_ref.h):
//  - the CPU reference, run in random orders of the CTAs' queues, gives the
//    plain chain of CPU ops bit for bit (the layer chain at rows 1 ... 8 of
//    widths 1, 4 and 8, tiles that do and do not divide the columns, 1 to 132
//    CTAs), and writes nothing in the pad rows;
//  - the plan deals every job once, each queue in stage order, and balances
//    the weight bytes to within one job (DeepSeek-V2-Lite's chain on 132
//    CTAs);
//  - plan_program refuses what the kernel cannot run, naming the stage and the
//    field, and every missing wait between stages that share memory;
//  - the MoE block (router, route table, shared and routed experts, combine)
//    gives the plain CPU MoE bit for bit, with DeepSeek-V2's greedy softmax
//    routing and V3's noaux_tc (groups, bias, normalised and scaled weights),
//    widths 1, 4 and 8, and its plan refuses too few slots or a routed stage
//    that does not wait for its table;
//  - the reference reports a deadlock instead of hanging.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <random>
#include <set>

#include "core/dtype.h"
#include "kernels/activation/silu_mul_ref.h"
#include "kernels/gemm/gemm_ref.h"
#include "kernels/moe/moe_ref.h"
#include "kernels/mono/mono_program_ref.h"
#include "kernels/rmsnorm/rmsnorm_ref.h"
#include "kernels/rope/rope_ref.h"

namespace nucleus::kernels::mono {
namespace {

constexpr uint16_t kNanBf16 = 0x7fc0;

std::vector<uint16_t> random_bf16(size_t n, float scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(d(rng));
  return v;
}
std::vector<float> random_f32(size_t n, float lo, float hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
std::vector<float> widen(const std::vector<uint16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_f32(v[i]);
  return f;
}
void round_all(std::vector<float>& v) {
  for (float& x : v) x = round_to_bf16(x);
}
// Random float8 e4m3 bytes (no NaN codes) and their 128 x 128 block scales for an [n, k] weight.
struct Fp8Weight {
  std::vector<uint8_t> q;
  std::vector<float> scale;  // [ceil(n / 128), ceil(k / 128)]
  int64_t n = 0, k = 0;
  Fp8Weight() = default;
  Fp8Weight(int64_t n_, int64_t k_, uint64_t seed) : n(n_), k(k_) {
    std::mt19937_64 rng(seed);
    q.resize(static_cast<size_t>(n * k));
    for (auto& b : q) {
      b = static_cast<uint8_t>(rng() & 0xff);
      if ((b & 0x7f) == 0x7f) b ^= 0x01;  // not NaN
    }
    scale = random_f32(static_cast<size_t>((n + 127) / 128 * ((k + 127) / 128)), 0.0005f, 0.004f, seed + 1);
  }
  // dequantize_fp8_block_ref's W, what a CPU linear holds.
  std::vector<float> dequantized() const {
    std::vector<float> w(q.size());
    dequantize_fp8_block_ref(q.data(), scale.data(), n, k, 128, 128, w.data());
    return w;
  }
};

// The chain's buffers on the host, 8 rows of everything.
struct HostChain {
  int64_t hidden, front_n, o_k, inter;
  bool fp8 = false;  // the four weights as e4m3 with block scales (w8_*; w_* unused)
  std::vector<uint16_t> w_front, w_o, w_gate_up, w_down, delta_in;
  Fp8Weight w8_front, w8_o, w8_gate_up, w8_down;
  std::vector<float> input_norm, post_norm, residual_in;
  std::vector<float> residual_mid, residual_out;
  std::vector<uint16_t> front, o, h, delta_out;

  HostChain(int64_t hidden_, int64_t front_n_, int64_t o_k_, int64_t inter_, uint64_t seed, bool fp8_ = false)
      : hidden(hidden_), front_n(front_n_), o_k(o_k_), inter(inter_), fp8(fp8_) {
    w_front = random_bf16(front_n * hidden, 0.2f, seed + 1);
    w_o = random_bf16(hidden * o_k, 0.2f, seed + 2);
    w_gate_up = random_bf16(2 * inter * hidden, 0.2f, seed + 3);
    w_down = random_bf16(hidden * inter, 0.2f, seed + 4);
    if (fp8) {
      w8_front = Fp8Weight(front_n, hidden, seed + 11);
      w8_o = Fp8Weight(hidden, o_k, seed + 12);
      w8_gate_up = Fp8Weight(2 * inter, hidden, seed + 13);
      w8_down = Fp8Weight(hidden, inter, seed + 14);
    }
    delta_in = random_bf16(8 * hidden, 1.0f, seed + 5);
    input_norm = random_f32(hidden, 0.5f, 1.5f, seed + 6);
    post_norm = random_f32(hidden, 0.5f, 1.5f, seed + 7);
    residual_in = random_f32(8 * hidden, -2.0f, 2.0f, seed + 8);
    poison();
  }
  void poison() {
    residual_mid.assign(8 * hidden, NAN);
    residual_out.assign(8 * hidden, NAN);
    front.assign(8 * front_n, kNanBf16);
    o.assign(8 * hidden, kNanBf16);
    h.assign(8 * inter, kNanBf16);
    delta_out.assign(8 * hidden, kNanBf16);
  }
  LayerChain chain() {
    LayerChain c;
    c.hidden = hidden;
    c.front_n = front_n;
    c.o_k = o_k;
    c.inter = inter;
    c.w_front = w_front.data();
    c.w_o = w_o.data();
    c.w_gate_up = w_gate_up.data();
    c.w_down = w_down.data();
    if (fp8) {
      c.w_front = w8_front.q.data();
      c.w_o = w8_o.q.data();
      c.w_gate_up = w8_gate_up.q.data();
      c.w_down = w8_down.q.data();
      c.front_scale = w8_front.scale.data();
      c.o_scale = w8_o.scale.data();
      c.gate_up_scale = w8_gate_up.scale.data();
      c.down_scale = w8_down.scale.data();
    }
    c.input_norm = input_norm.data();
    c.post_norm = post_norm.data();
    c.residual_in = residual_in.data();
    c.delta_in = delta_in.data();
    c.residual_mid = residual_mid.data();
    c.residual_out = residual_out.data();
    c.front = front.data();
    c.o = o.data();
    c.h = h.data();
    c.delta_out = delta_out.data();
    return c;
  }
};

// What the plain chain of CPU ops gives for the first `rows` rows, at the
// decode graph's rounding points (bf16 activations, f32 residual).
struct Plain {
  std::vector<float> residual_mid, residual_out, front, o, h, delta_out;
};
Plain plain_chain(const HostChain& c, int64_t rows) {
  Plain p;
  const int64_t H = c.hidden;
  p.residual_mid.assign(c.residual_in.begin(), c.residual_in.begin() + rows * H);
  const std::vector<float> delta = widen(c.delta_in);
  std::vector<float> x(rows * H);
  add_rmsnorm_ref(p.residual_mid.data(), delta.data(), c.input_norm.data(), rows, H, 1e-6f, x.data());
  round_all(x);
  auto weight = [&](const std::vector<uint16_t>& bf16, const Fp8Weight& w8) {
    return c.fp8 ? w8.dequantized() : widen(bf16);
  };
  p.front.resize(rows * c.front_n);
  gemm_ref(x.data(), H, weight(c.w_front, c.w8_front).data(), rows, c.front_n, H, p.front.data(), c.front_n, false);
  round_all(p.front);
  p.o.resize(rows * H);
  gemm_ref(p.front.data(), c.front_n, weight(c.w_o, c.w8_o).data(), rows, H, c.o_k, p.o.data(), H, false);
  round_all(p.o);
  p.residual_out = p.residual_mid;
  add_rmsnorm_ref(p.residual_out.data(), p.o.data(), c.post_norm.data(), rows, H, 1e-6f, x.data());
  round_all(x);
  std::vector<float> gate_up(rows * 2 * c.inter);
  gemm_ref(x.data(), H, weight(c.w_gate_up, c.w8_gate_up).data(), rows, 2 * c.inter, H, gate_up.data(), 2 * c.inter,
           false);
  round_all(gate_up);
  p.h.resize(rows * c.inter);
  silu_mul_ref(gate_up.data(), rows, c.inter, p.h.data());
  round_all(p.h);
  p.delta_out.resize(rows * H);
  gemm_ref(p.h.data(), c.inter, weight(c.w_down, c.w8_down).data(), rows, H, c.inter, p.delta_out.data(), H, false);
  round_all(p.delta_out);
  return p;
}

// got's first rows * cols values equal want's bit for bit (NaN never equal),
// and the pad rows after them still hold the poison.
template <typename T>
void expect_rows(const std::vector<T>& got, const std::vector<float>& want, int64_t rows, int64_t cols,
                 const char* what) {
  int64_t bad = 0;
  for (int64_t i = 0; i < rows * cols; ++i) {
    float g;
    if constexpr (std::is_same_v<T, uint16_t>)
      g = bf16_to_f32(got[i]);
    else
      g = got[i];
    if (!(g == want[i]) && ++bad <= 3) ADD_FAILURE() << what << "[" << i / cols << ", " << i % cols << "] = " << g
                                                     << ", the plain chain " << want[i];
  }
  EXPECT_EQ(bad, 0) << what;
  for (int64_t i = rows * cols; i < 8 * cols; ++i) {
    bool poisoned;
    if constexpr (std::is_same_v<T, uint16_t>)
      poisoned = got[i] == kNanBf16;
    else
      poisoned = std::isnan(got[i]);
    if (!poisoned) {
      ADD_FAILURE() << what << ": pad row " << i / cols << " was written";
      break;
    }
  }
}

TEST(MonoProgram, ReferenceEqualsThePlainChain) {
  HostChain c(/*hidden=*/64, /*front_n=*/96, /*o_k=*/64, /*inter=*/48, /*seed=*/11);
  struct Case {
    int32_t width, rows, tile, ctas;
  };
  const Case cases[] = {{1, 1, 16, 1},  {1, 1, 7, 132}, {4, 4, 64, 5},  {4, 3, 16, 132},
                        {8, 8, 16, 3},  {8, 1, 32, 7},  {8, 5, 7, 132}, {2, 2, 48, 2}};
  for (const Case& k : cases) {
    const Plain want = plain_chain(c, k.rows);
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      SCOPED_TRACE(testing::Message() << "width " << k.width << ", rows " << k.rows << ", tile " << k.tile << ", "
                                      << k.ctas << " CTAs, order " << seed);
      c.poison();
      auto plan = plan_program(layer_chain_stages(c.chain(), k.tile), k.width, k.ctas);
      ASSERT_TRUE(plan.ok()) << plan.status().message();
      ASSERT_TRUE(run_program_ref(*plan, k.rows, seed).ok());
      expect_rows(c.residual_mid, want.residual_mid, k.rows, c.hidden, "residual_mid");
      expect_rows(c.front, want.front, k.rows, c.front_n, "front");
      expect_rows(c.o, want.o, k.rows, c.hidden, "o");
      expect_rows(c.residual_out, want.residual_out, k.rows, c.hidden, "residual_out");
      expect_rows(c.h, want.h, k.rows, c.inter, "h");
      expect_rows(c.delta_out, want.delta_out, k.rows, c.hidden, "delta_out");
    }
  }
}

// A LayerChain at DeepSeek-V2-Lite's dimensions over distinct fake addresses
// (plan_program never reads the buffers).
// e4m3 weights with 128 x 128 block scales (WeightType::kFp8Block): the
// reference dequantizes as the CPU linear does, so it still equals the plain
// chain bit for bit; the planner refuses what would put one row group of the
// kernel across two scale blocks or read a partial scale block.
TEST(MonoProgram, Fp8BlockScaledWeightsEqualThePlainChain) {
  HostChain c(/*hidden=*/256, /*front_n=*/160, /*o_k=*/128, /*inter=*/192, /*seed=*/23, /*fp8=*/true);
  struct Case {
    int32_t width, rows, tile, ctas;
  };
  const Case cases[] = {{1, 1, 16, 1}, {4, 3, 32, 132}, {8, 8, 64, 5}, {8, 5, 16, 132}};
  for (const Case& k : cases) {
    const Plain want = plain_chain(c, k.rows);
    for (uint64_t seed = 1; seed <= 2; ++seed) {
      SCOPED_TRACE(testing::Message() << "width " << k.width << ", rows " << k.rows << ", tile " << k.tile << ", "
                                      << k.ctas << " CTAs, order " << seed);
      c.poison();
      auto plan = plan_program(layer_chain_stages(c.chain(), k.tile), k.width, k.ctas);
      ASSERT_TRUE(plan.ok()) << plan.status().message();
      EXPECT_EQ(plan->weight_bytes(), (c.front_n + c.o_k + 2 * c.inter) * c.hidden + c.hidden * c.inter)
          << "one byte a weight";
      ASSERT_TRUE(run_program_ref(*plan, k.rows, seed).ok());
      expect_rows(c.front, want.front, k.rows, c.front_n, "front");
      expect_rows(c.o, want.o, k.rows, c.hidden, "o");
      expect_rows(c.h, want.h, k.rows, c.inter, "h");
      expect_rows(c.delta_out, want.delta_out, k.rows, c.hidden, "delta_out");
    }
  }
  // Refusals, each naming the field.
  auto refused = [&](const std::function<void(std::vector<Stage>&)>& edit, const char* needle) {
    std::vector<Stage> st = layer_chain_stages(c.chain(), 16);
    edit(st);
    auto plan = plan_program(st, 8, 4);
    ASSERT_FALSE(plan.ok()) << needle;
    EXPECT_NE(plan.status().message().find(needle), std::string::npos) << plan.status().message();
  };
  refused([](std::vector<Stage>& st) { st[0].tile = 24; }, "tile a multiple of 16");
  refused([](std::vector<Stage>& st) { st[0].w_scale = nullptr; }, "block scales");
  refused([](std::vector<Stage>& st) { st[3].k = 48; st[3].x_stride = 144; }, "k a multiple of 32");
  refused([](std::vector<Stage>& st) { st[2].n = 2 * 136; st[2].out_stride = 136; }, "n / 2 a multiple of 16");
  refused([](std::vector<Stage>& st) { st[1].w_type = static_cast<WeightType>(7); }, "w_type 7");
}

// The build a launch takes (program_build, mono_kernel.cu's kernel_for): the
// GEMV-only builds for unslotted GEMV chains, the FP8 path only for FP8
// weights, the full build whenever Program::lean is false.
TEST(MonoProgram, LeanBuildCoversEveryStage) {
  HostChain bf(/*hidden=*/256, /*front_n=*/160, /*o_k=*/128, /*inter=*/192, /*seed=*/5);
  HostChain f8(/*hidden=*/256, /*front_n=*/160, /*o_k=*/128, /*inter=*/192, /*seed=*/6, /*fp8=*/true);
  auto build = [](const std::vector<Stage>& st, bool lean) {
    Program p;
    for (size_t i = 0; i < st.size(); ++i) p.stages[i] = st[i];
    p.num_stages = static_cast<int32_t>(st.size());
    p.lean = lean;
    return program_build(p);
  };
  std::vector<Stage> chain = layer_chain_stages(bf.chain(), 16);
  ProgramBuild b = build(chain, true);
  EXPECT_FALSE(b.fp8);
  EXPECT_FALSE(b.kinds);
  b = build(layer_chain_stages(f8.chain(), 16), true);
  EXPECT_TRUE(b.fp8);
  EXPECT_FALSE(b.kinds);
  b = build(chain, false);
  EXPECT_TRUE(b.fp8 && b.kinds) << "Program::lean false: the full build";
  // One stage of another kind, or a slotted GEMV, needs the kinds.
  for (int v = 0; v < 3; ++v) {
    std::vector<Stage> st = chain;
    if (v == 0) st.back().kind = Kind::kCombine;
    if (v == 1) st[1].slots = 2;
    if (v == 2) st[2].route = reinterpret_cast<const RouteTable*>(&st);  // never read
    b = build(st, true);
    EXPECT_TRUE(b.kinds) << "variant " << v;
    EXPECT_FALSE(b.fp8) << "variant " << v;
  }
  // FP8 weights in one stage only.
  std::vector<Stage> mixed = chain;
  mixed[1].w_type = WeightType::kFp8Block;
  EXPECT_TRUE(build(mixed, true).fp8);
}

// x past kMaxK: a kLoad stage reads it from global memory (x_from_global;
// o_proj at DeepSeek-V3's 128 heads reads 16,384 values a row), so the plan
// takes it (and never keeps a global x in shared memory for a later stage);
// a norm prologue, whose x the kernel builds in shared memory, is refused.
TEST(MonoProgram, XPastTheSharedMemoryStaysInGlobalMemory) {
  HostChain c(/*hidden=*/64, /*front_n=*/16400, /*o_k=*/16400, /*inter=*/48, /*seed=*/31);
  for (const auto& [width, rows] : {std::pair{1, 1}, std::pair{8, 5}}) {
    const Plain want = plain_chain(c, rows);
    c.poison();
    auto plan = plan_program(layer_chain_stages(c.chain(), 16), width, 9);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    EXPECT_TRUE(x_from_global(plan->stages[1]));
    EXPECT_FALSE(x_from_global(plan->stages[0]));
    for (const Stage& st : plan->stages) EXPECT_EQ(st.x_reuse >> 1 & 1u, 0u) << "nothing kept from a global x";
    ASSERT_TRUE(run_program_ref(*plan, rows, 5).ok());
    expect_rows(c.o, want.o, rows, c.hidden, "o");
    expect_rows(c.delta_out, want.delta_out, rows, c.hidden, "delta_out");
  }
  std::vector<Stage> st = layer_chain_stages(c.chain(), 16);
  st[1].k = kMaxGlobalK + 16;
  auto too_wide = plan_program(st, 8, 4);
  ASSERT_FALSE(too_wide.ok());
  EXPECT_NE(too_wide.status().message().find("from 16 to 32768"), std::string::npos) << too_wide.status().message();
  HostChain wide(/*hidden=*/kMaxK + 16, /*front_n=*/32, /*o_k=*/32, /*inter=*/16, /*seed=*/32);
  auto norm = plan_program(layer_chain_stages(wide.chain(), 16), 8, 4);
  ASSERT_FALSE(norm.ok());
  EXPECT_NE(norm.status().message().find("8192 for a norm prologue"), std::string::npos) << norm.status().message();
}

LayerChain v2_lite_chain_at_fake_addresses() {
  LayerChain c;
  c.hidden = 2048;
  c.front_n = 3072 + 576;
  c.o_k = 2048;
  c.inter = 2 * 1408;
  uintptr_t next = uintptr_t{1} << 32;
  auto take = [&](size_t bytes) {
    const uintptr_t p = next;
    next += (bytes + 4095) / 4096 * 4096;
    return p;
  };
  c.w_front = reinterpret_cast<const uint16_t*>(take(c.front_n * c.hidden * 2));
  c.w_o = reinterpret_cast<const uint16_t*>(take(c.hidden * c.o_k * 2));
  c.w_gate_up = reinterpret_cast<const uint16_t*>(take(2 * c.inter * c.hidden * 2));
  c.w_down = reinterpret_cast<const uint16_t*>(take(c.hidden * c.inter * 2));
  c.input_norm = reinterpret_cast<const float*>(take(c.hidden * 4));
  c.post_norm = reinterpret_cast<const float*>(take(c.hidden * 4));
  c.residual_in = reinterpret_cast<const float*>(take(8 * c.hidden * 4));
  c.delta_in = reinterpret_cast<const uint16_t*>(take(8 * c.hidden * 2));
  c.residual_mid = reinterpret_cast<float*>(take(8 * c.hidden * 4));
  c.residual_out = reinterpret_cast<float*>(take(8 * c.hidden * 4));
  c.front = reinterpret_cast<uint16_t*>(take(8 * c.front_n * 2));
  c.o = reinterpret_cast<uint16_t*>(take(8 * c.hidden * 2));
  c.h = reinterpret_cast<uint16_t*>(take(8 * c.inter * 2));
  c.delta_out = reinterpret_cast<uint16_t*>(take(8 * c.hidden * 2));
  return c;
}

TEST(MonoProgram, PlanDealsEveryJobOnceInStageOrderAndBalancesBytes) {
  const LayerChain c = v2_lite_chain_at_fake_addresses();
  for (int32_t tile : {16, 64}) {
    SCOPED_TRACE(testing::Message() << "tile " << tile);
    const std::vector<Stage> stages = layer_chain_stages(c, tile);
    auto plan = plan_program(stages, 8, 132);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    ASSERT_EQ(plan->num_ctas(), 132);
    std::set<std::pair<int32_t, int32_t>> seen;
    int64_t biggest_job = 0, total = 0;
    for (int32_t cta = 0; cta < 132; ++cta) {
      int32_t stage = 0;
      for (int32_t q = plan->queue_start[cta]; q < plan->queue_start[cta + 1]; ++q) {
        const Job& j = plan->jobs[q];
        EXPECT_GE(j.stage, stage) << "CTA " << cta << "'s queue goes back to an earlier stage";
        stage = j.stage;
        EXPECT_TRUE(seen.insert({j.stage, j.tile}).second) << "job " << j.stage << "/" << j.tile << " dealt twice";
        const JobRows jr = job_rows(stages[j.stage], j.tile);
        biggest_job = std::max<int64_t>(biggest_job, int64_t{jr.count} * (jr.two ? 2 : 1) * stages[j.stage].k * 2);
      }
      total += plan->cta_weight_bytes[cta];
    }
    size_t jobs = 0;
    for (const Stage& s : stages) jobs += stage_jobs(s);
    EXPECT_EQ(seen.size(), jobs);
    EXPECT_EQ(total, plan->weight_bytes());
    EXPECT_EQ(plan->weight_bytes(), (3648 * 2048 + 2048 * 2048 + 5632 * 2048 + 2048 * 2816) * int64_t{2});
    const auto [lo, hi] = std::minmax_element(plan->cta_weight_bytes.begin(), plan->cta_weight_bytes.end());
    EXPECT_LE(*hi - *lo, biggest_job);
  }
}

TEST(MonoProgram, PlanRefusesWhatTheKernelCannotRun) {
  const LayerChain c = v2_lite_chain_at_fake_addresses();
  auto refused = [&](std::vector<Stage> st, const std::string& needle, int32_t width = 8, int32_t ctas = 132) {
    auto plan = plan_program(st, width, ctas);
    if (plan.ok()) return ::testing::AssertionFailure() << "accepted; expected a refusal naming '" << needle << "'";
    if (plan.status().code() != StatusCode::kInvalidArgument || plan.status().message().find(needle) == std::string::npos)
      return ::testing::AssertionFailure() << "refused with: " << plan.status().message();
    return ::testing::AssertionSuccess();
  };
  const std::vector<Stage> ok = layer_chain_stages(c, 16);
  ASSERT_TRUE(plan_program(ok, 8, 132).ok());
  auto with = [&](int stage, auto edit) {
    std::vector<Stage> st = ok;
    edit(st[stage]);
    return st;
  };
  EXPECT_TRUE(refused(with(1, [](Stage& s) { s.k = 2040; }), "stage 1: n = 2048, k = 2040"));
  EXPECT_TRUE(refused(with(0, [](Stage& s) { s.k = 8208; }), "stage 0: n = 3648, k = 8208: need n >= 1 and k a multiple of 16 from 16 to 32768 (8192 for a norm prologue"));
  EXPECT_TRUE(refused(with(1, [](Stage& s) { s.k = 32784; s.x_stride = 32784; }), "k = 32784: need n >= 1 and k a multiple of 16 from 16 to 32768"));
  EXPECT_TRUE(refused(with(2, [](Stage& s) { s.n = 5631; }), "stage 2: n = 5631: a SiLU-and-multiply stage"));
  EXPECT_TRUE(refused(with(0, [](Stage& s) { s.tile = 0; }), "stage 0: tile = 0"));
  EXPECT_TRUE(refused(with(0, [](Stage& s) { s.tile = 65; }), "tile = 65"));
  EXPECT_TRUE(refused(with(1, [](Stage& s) { s.wait_mask = 1u << 1; }), "stage 1: wait_mask names this stage"));
  EXPECT_TRUE(refused(with(0, [](Stage& s) { s.residual_out = const_cast<float*>(s.residual); }),
                      "residual_out is residual"));
  EXPECT_TRUE(refused(with(1, [](Stage& s) { s.out = const_cast<uint16_t*>(s.x) + 8; }), "x overlaps out"));
  EXPECT_TRUE(refused(with(1, [](Stage& s) { s.x_stride = 2047; }), "x_stride = 2047"));
  EXPECT_TRUE(refused(with(3, [](Stage& s) { s.w = reinterpret_cast<const uint16_t*>(reinterpret_cast<uintptr_t>(s.w) + 2); }),
                      "stage 3: w must be a 16-byte aligned"));
  // Stage 1 reads stage 0's output: without the wait it would race.
  EXPECT_TRUE(refused(with(1, [](Stage& s) { s.wait_mask = 0; }),
                      "stage 1: its x overlaps stage 0's out but it does not wait for stage 0"));
  // Stage 3 writes where stage 0 reads (a write after read), waiting only transitively: accepted.
  EXPECT_TRUE(plan_program(with(3, [&](Stage& s) { s.out = const_cast<uint16_t*>(c.delta_in); }), 8, 132).ok());
  // ... but not without the chain of waits.
  EXPECT_TRUE(refused(with(3, [&](Stage& s) {
                        s.out = const_cast<uint16_t*>(c.delta_in);
                        s.wait_mask = 0;
                        s.x = reinterpret_cast<const uint16_t*>(uintptr_t{1} << 40);
                      }),
                      "stage 3: its out overlaps stage 0's delta but it does not wait for stage 0"));
  EXPECT_TRUE(refused(ok, "width 3", /*width=*/3));
  EXPECT_TRUE(refused(ok, "on 0 CTAs", 8, /*ctas=*/0));
  EXPECT_TRUE(refused({}, "0 stages"));
  std::vector<Stage> many(17, ok[1]);
  EXPECT_TRUE(refused(many, "17 stages"));
}

TEST(MonoProgram, ReferenceReportsADeadlock) {
  HostChain c(64, 96, 64, 48, 5);
  auto plan = plan_program(layer_chain_stages(c.chain(), 16), 8, 1);
  ASSERT_TRUE(plan.ok());
  std::reverse(plan->jobs.begin(), plan->jobs.end());  // stage 3 first: it waits for stage 2, behind it
  const Status s = run_program_ref(*plan, 8, 1);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("deadlock"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("CTA 0 at stage 3"), std::string::npos) << s.message();
  EXPECT_EQ(run_program_ref(*plan, 9, 1).code(), StatusCode::kInvalidArgument);  // more rows than the width
}

// The MoE block's buffers on the host, 8 rows of every activation.
struct HostMoe {
  MoeChain c;
  std::vector<uint16_t> w_router, w_gate_up, w_down, w_shared_gate_up, w_shared_down, delta;
  std::vector<float> bias, post_norm, residual;
  std::vector<float> residual_out, logits, y_shared, y;
  std::vector<uint16_t> h_shared, h, delta_out;
  RouteTable table;
  bool tables = false;
  std::vector<uint16_t> gate_up_rev, down_rev;
  std::vector<const void*> gate_up_ptrs, down_ptrs;
  // fp8: the experts' and shared pieces' weights as e4m3 with block scales,
  // one Fp8Weight an expert / piece (the router stays bf16).
  bool fp8 = false;
  std::vector<Fp8Weight> e_gate_up, e_down, s_gate_up, s_down;
  std::vector<uint8_t> q_gate_up, q_down, q_sgu, q_sdn;    // experts / pieces one after another
  std::vector<float> sc_gate_up, sc_down, sc_sgu, sc_sdn;  // their scales, likewise
  std::vector<const float*> gate_up_scale_ptrs, down_scale_ptrs;

  HostMoe(MoeChain shape, uint64_t seed, bool tables_ = false, bool fp8_ = false)
      : c(shape), tables(tables_), fp8(fp8_) {
    const int64_t H = c.hidden, E = c.num_experts;
    w_router = random_bf16(E * H, 0.3f, seed + 1);
    w_gate_up = random_bf16(E * 2 * c.inter * H, 0.2f, seed + 2);
    w_down = random_bf16(E * H * c.inter, 0.2f, seed + 3);
    if (c.shared_inter > 0) {
      w_shared_gate_up = random_bf16(c.shared_pieces * 2 * c.shared_inter * H, 0.2f, seed + 4);
      w_shared_down = random_bf16(c.shared_pieces * H * c.shared_inter, 0.2f, seed + 5);
    }
    if (fp8) {
      auto flat = [](std::vector<Fp8Weight>& ws, int64_t n, int64_t k, int64_t count, uint64_t sd,
                     std::vector<uint8_t>& q, std::vector<float>& sc) {
        for (int64_t e = 0; e < count; ++e) {
          ws.emplace_back(n, k, sd + 100 * static_cast<uint64_t>(e));
          q.insert(q.end(), ws.back().q.begin(), ws.back().q.end());
          sc.insert(sc.end(), ws.back().scale.begin(), ws.back().scale.end());
        }
      };
      flat(e_gate_up, 2 * c.inter, H, E, seed + 20, q_gate_up, sc_gate_up);
      flat(e_down, H, c.inter, E, seed + 21, q_down, sc_down);
      if (c.shared_inter > 0) {
        flat(s_gate_up, 2 * c.shared_inter, H, c.shared_pieces, seed + 22, q_sgu, sc_sgu);
        flat(s_down, H, c.shared_inter, c.shared_pieces, seed + 23, q_sdn, sc_sdn);
      }
    }
    delta = random_bf16(8 * H, 1.0f, seed + 6);
    if (c.method == TopK::kNoauxTc) bias = random_f32(E, -0.1f, 0.1f, seed + 7);
    post_norm = random_f32(H, 0.5f, 1.5f, seed + 8);
    residual = random_f32(8 * H, -2.0f, 2.0f, seed + 9);
    poison();
  }
  void poison() {
    residual_out.assign(8 * c.hidden, NAN);
    logits.assign(8 * c.num_experts, NAN);
    y_shared.assign(c.shared_pieces * 8 * c.hidden, NAN);
    y.assign(static_cast<size_t>(c.slots) * 8 * c.hidden, NAN);
    h_shared.assign(c.shared_pieces * 8 * c.shared_inter, kNanBf16);
    h.assign(static_cast<size_t>(c.slots) * 8 * c.inter, kNanBf16);
    delta_out.assign(8 * c.hidden, kNanBf16);
    table = RouteTable{};
    table.count = -1;
    c.w_router = w_router.data();
    c.w_gate_up = w_gate_up.data();
    c.w_down = w_down.data();
    if (fp8) {
      c.w_gate_up = q_gate_up.data();
      c.w_down = q_down.data();
      c.gate_up_scale = sc_gate_up.data();
      c.down_scale = sc_down.data();
      if (tables) {  // each expert through its own tensors' table entries (weights and scales)
        gate_up_ptrs.clear();
        down_ptrs.clear();
        gate_up_scale_ptrs.clear();
        down_scale_ptrs.clear();
        for (int64_t e = 0; e < c.num_experts; ++e) {
          gate_up_ptrs.push_back(e_gate_up[e].q.data());
          down_ptrs.push_back(e_down[e].q.data());
          gate_up_scale_ptrs.push_back(e_gate_up[e].scale.data());
          down_scale_ptrs.push_back(e_down[e].scale.data());
        }
        c.w_gate_up = c.w_down = nullptr;
        c.gate_up_scale = c.down_scale = nullptr;
        c.gate_up_table = gate_up_ptrs.data();
        c.down_table = down_ptrs.data();
        c.gate_up_scale_table = gate_up_scale_ptrs.data();
        c.down_scale_table = down_scale_ptrs.data();
      }
    } else if (tables) {  // each expert through its table entry, stored in reverse order
      const int64_t E = c.num_experts, gu = 2 * c.inter * c.hidden, dn = c.hidden * c.inter;
      gate_up_rev.resize(w_gate_up.size());
      down_rev.resize(w_down.size());
      gate_up_ptrs.resize(E);
      down_ptrs.resize(E);
      for (int64_t e = 0; e < E; ++e) {
        std::copy(w_gate_up.begin() + e * gu, w_gate_up.begin() + (e + 1) * gu, gate_up_rev.begin() + (E - 1 - e) * gu);
        std::copy(w_down.begin() + e * dn, w_down.begin() + (e + 1) * dn, down_rev.begin() + (E - 1 - e) * dn);
        gate_up_ptrs[e] = gate_up_rev.data() + (E - 1 - e) * gu;
        down_ptrs[e] = down_rev.data() + (E - 1 - e) * dn;
      }
      c.w_gate_up = c.w_down = nullptr;
      c.gate_up_table = gate_up_ptrs.data();
      c.down_table = down_ptrs.data();
    }
    c.w_shared_gate_up = w_shared_gate_up.empty() ? nullptr : w_shared_gate_up.data();
    c.w_shared_down = w_shared_down.empty() ? nullptr : w_shared_down.data();
    if (fp8 && c.shared_inter > 0) {
      c.w_shared_gate_up = q_sgu.data();
      c.w_shared_down = q_sdn.data();
      c.shared_gate_up_scale = sc_sgu.data();
      c.shared_down_scale = sc_sdn.data();
    }
    c.bias = bias.empty() ? nullptr : bias.data();
    c.post_norm = post_norm.data();
    c.residual = residual.data();
    c.delta = delta.data();
    c.residual_out = residual_out.data();
    c.logits = logits.data();
    c.table = &table;
    c.h_shared = h_shared.empty() ? nullptr : h_shared.data();
    c.y_shared = c.shared_inter > 0 ? y_shared.data() : nullptr;
    c.h = h.data();
    c.y = y.data();
    c.delta_out = delta_out.data();
  }
};

MoeRoutingParams routing_of(const MoeChain& c) {
  MoeRoutingParams p;
  p.scoring = c.scoring == Scoring::kSigmoid ? ScoringFunc::kSigmoid : ScoringFunc::kSoftmax;
  p.method = c.method == TopK::kNoauxTc ? TopkMethod::kNoauxTc : TopkMethod::kGreedy;
  p.num_experts = c.num_experts;
  p.top_k = c.top_k;
  p.n_group = c.n_group;
  p.topk_group = c.topk_group;
  p.norm_topk_prob = c.norm_topk_prob;
  p.routed_scaling_factor = c.routed_scaling_factor;
  return p;
}

// The plain CPU MoE block for the first `rows` rows: its routing (ids,
// weights), logits, residual_out and delta_out (bf16 values).
struct PlainMoe {
  std::vector<int32_t> ids;
  std::vector<float> weights, logits, residual_out, delta_out;
};
PlainMoe plain_moe(const HostMoe& m, int64_t rows) {
  const MoeChain& c = m.c;
  const int64_t H = c.hidden, E = c.num_experts;
  PlainMoe p;
  p.residual_out.assign(m.residual.begin(), m.residual.begin() + rows * H);
  std::vector<float> x(rows * H);
  add_rmsnorm_ref(p.residual_out.data(), widen(m.delta).data(), m.post_norm.data(), rows, H, c.eps, x.data());
  round_all(x);
  p.logits.resize(rows * E);
  gemm_ref(x.data(), H, widen(m.w_router).data(), rows, E, H, p.logits.data(), E, false);
  p.ids.resize(rows * c.top_k);
  p.weights.resize(rows * c.top_k);
  moe_route_ref(routing_of(c), p.logits.data(), m.bias.empty() ? nullptr : m.bias.data(), rows, p.ids.data(),
                p.weights.data());
  // One SwiGLU expert on one row, at the decode graph's rounding points.
  auto expert = [&](const float* xr, const std::vector<float>& gate_up, const std::vector<float>& down, int64_t inter) {
    std::vector<float> gu(2 * inter), h(inter), y(H);
    gemm_ref(xr, H, gate_up.data(), 1, 2 * inter, H, gu.data(), 2 * inter, false);
    round_all(gu);
    silu_mul_ref(gu.data(), 1, inter, h.data());
    round_all(h);
    gemm_ref(h.data(), inter, down.data(), 1, H, inter, y.data(), H, false);
    return y;
  };
  // The weights as the CPU linears hold them: bf16 widened, or FP8 dequantized (dequantize_fp8_block_ref).
  auto all = [&](const std::vector<uint16_t>& bf16, const std::vector<Fp8Weight>& w8) {
    if (!m.fp8) return widen(bf16);
    std::vector<float> f;
    for (const Fp8Weight& w : w8) {
      const std::vector<float> d = w.dequantized();
      f.insert(f.end(), d.begin(), d.end());
    }
    return f;
  };
  const std::vector<float> gate_up = all(m.w_gate_up, m.e_gate_up), down = all(m.w_down, m.e_down);
  p.delta_out.assign(rows * H, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<std::pair<int32_t, float>> chosen;
    for (int64_t j = 0; j < c.top_k; ++j) chosen.push_back({p.ids[r * c.top_k + j], p.weights[r * c.top_k + j]});
    std::sort(chosen.begin(), chosen.end());
    std::vector<float> acc(H, 0.0f);
    for (auto [e, w] : chosen) {
      const std::vector<float> ge(gate_up.begin() + e * 2 * c.inter * H, gate_up.begin() + (e + 1) * 2 * c.inter * H);
      const std::vector<float> de(down.begin() + e * H * c.inter, down.begin() + (e + 1) * H * c.inter);
      const std::vector<float> y = expert(x.data() + r * H, ge, de, c.inter);
      for (int64_t i = 0; i < H; ++i) acc[i] += w * y[i];
    }
    if (c.shared_inter > 0) {
      const std::vector<float> sgu = all(m.w_shared_gate_up, m.s_gate_up), sdn = all(m.w_shared_down, m.s_down);
      const int64_t gu = 2 * c.shared_inter * H, dn = H * c.shared_inter;
      for (int32_t piece = 0; piece < c.shared_pieces; ++piece) {
        const std::vector<float> y = expert(x.data() + r * H, {sgu.begin() + piece * gu, sgu.begin() + (piece + 1) * gu},
                                            {sdn.begin() + piece * dn, sdn.begin() + (piece + 1) * dn},
                                            c.shared_inter);
        for (int64_t i = 0; i < H; ++i) acc[i] += y[i];
      }
    }
    for (int64_t i = 0; i < H; ++i) p.delta_out[r * H + i] = round_to_bf16(acc[i]);
  }
  return p;
}

MoeChain v2_lite_like_moe() {  // DeepSeek-V2-Lite's routing, small widths
  MoeChain c;
  c.hidden = 64;
  c.inter = 32;
  c.shared_inter = 48;
  c.num_experts = 64;
  c.top_k = 6;
  return c;
}
MoeChain v3_like_moe() {  // DeepSeek-V3's routing (noaux_tc, 8 groups of 32, 4 kept, top-8), small widths
  MoeChain c;
  c.hidden = 64;
  c.inter = 16;
  c.shared_inter = 0;
  c.num_experts = 256;
  c.top_k = 8;
  c.n_group = 8;
  c.topk_group = 4;
  c.scoring = Scoring::kSigmoid;
  c.method = TopK::kNoauxTc;
  c.norm_topk_prob = true;
  c.routed_scaling_factor = 2.5f;
  return c;
}

MoeChain tiny_like_moe() {  // the shipped tiny model's routing: 8 experts, noaux_tc in 4 groups of 2, top-2
  MoeChain c = v3_like_moe();
  c.num_experts = 8;
  c.top_k = 2;
  c.n_group = 4;
  c.topk_group = 2;
  c.shared_inter = 32;
  c.routed_scaling_factor = 1.0f;
  return c;
}

TEST(MonoProgram, MoeBlockEqualsThePlainMoe) {
  for (const MoeChain& shape : {v2_lite_like_moe(), v3_like_moe(), tiny_like_moe()}) {
    struct Case {
      int32_t width, rows, tile, ctas;
    };
    for (const Case k : {Case{1, 1, 16, 1}, Case{4, 3, 7, 132}, Case{8, 8, 16, 7}, Case{8, 5, 64, 3}}) {
      MoeChain sc = shape;
      sc.slots = std::min(k.width * sc.top_k, sc.num_experts);
      HostMoe m(sc, 31);
      const PlainMoe want = plain_moe(m, k.rows);
      for (uint64_t seed = 1; seed <= 2; ++seed) {
        SCOPED_TRACE(::testing::Message() << sc.num_experts << " experts, width " << k.width << ", rows " << k.rows
                                          << ", tile " << k.tile << ", " << k.ctas << " CTAs, order " << seed);
        m.poison();
        auto plan = plan_program(moe_chain_stages(m.c, k.tile), k.width, k.ctas);
        ASSERT_TRUE(plan.ok()) << plan.status().message();
        ASSERT_TRUE(run_program_ref(*plan, k.rows, seed).ok());
        expect_rows(m.residual_out, want.residual_out, k.rows, sc.hidden, "residual_out");
        expect_rows(m.logits, want.logits, k.rows, sc.num_experts, "logits");
        expect_rows(m.delta_out, want.delta_out, k.rows, sc.hidden, "delta_out");
        // The table: the distinct chosen experts, increasing, and each row's weight for each.
        std::vector<int32_t> distinct(want.ids);
        std::sort(distinct.begin(), distinct.end());
        distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
        ASSERT_EQ(m.table.count, static_cast<int32_t>(distinct.size()));
        for (int32_t u = 0; u < m.table.count; ++u) {
          EXPECT_EQ(m.table.expert[u], distinct[u]);
          for (int32_t r = 0; r < k.rows; ++r) {
            float w = 0.0f;
            for (int32_t j = 0; j < sc.top_k; ++j)
              if (want.ids[r * sc.top_k + j] == distinct[u]) w = want.weights[r * sc.top_k + j];
            EXPECT_EQ(m.table.weight[r][u], w) << "row " << r << ", slot " << u;
          }
        }
      }
    }
  }
}

// A dense MLP as a MoeChain without routed experts (num_experts 0): the MLP
// is the one shared piece, the combine (no route table) its output to bf16
// with the residual copied back; no router or select stage. An intermediate
// past 8192 (DeepSeek-V2-Lite's dense 10944): the down projection reads x
// from global memory in the kernel.
TEST(MonoProgram, DenseMlpAsAChainWithoutRoutedExperts) {
  const int64_t H = 64, inter = 8320;
  const std::vector<uint16_t> w_gu = random_bf16(2 * inter * H, 0.2f, 71), w_dn = random_bf16(H * inter, 0.05f, 72);
  const std::vector<uint16_t> delta = random_bf16(8 * H, 1.0f, 73);
  const std::vector<float> post_norm = random_f32(H, 0.5f, 1.5f, 74), residual = random_f32(8 * H, -2.0f, 2.0f, 75);
  for (const auto& [width, rows] : {std::pair{1, 1}, std::pair{8, 6}}) {
    SCOPED_TRACE(::testing::Message() << "width " << width << ", rows " << rows);
    std::vector<float> residual_out(8 * H, NAN), y_shared(8 * H, NAN), residual_copy(8 * H, NAN);
    std::vector<uint16_t> h_shared(8 * inter, kNanBf16), delta_out(8 * H, kNanBf16);
    MoeChain c;
    c.hidden = H;
    c.shared_inter = inter;
    c.w_shared_gate_up = w_gu.data();
    c.w_shared_down = w_dn.data();
    c.post_norm = post_norm.data();
    c.residual = residual.data();
    c.delta = delta.data();
    c.residual_out = residual_out.data();
    c.h_shared = h_shared.data();
    c.y_shared = y_shared.data();
    c.delta_out = delta_out.data();
    c.residual_copy_to = residual_copy.data();
    const std::vector<Stage> st = moe_chain_stages(c, 16);
    ASSERT_EQ(st.size(), 3u) << "gate_up, down, combine";
    EXPECT_EQ(st[2].kind, Kind::kCombine);
    EXPECT_EQ(st[2].route, nullptr);
    EXPECT_TRUE(x_from_global(st[1]));
    auto plan = plan_program(st, width, 7);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    ASSERT_TRUE(run_program_ref(*plan, rows, 9).ok());
    // The plain MLP: add + norm, gate_up, SiLU * up, down, at the graph's rounding points.
    std::vector<float> res(residual.begin(), residual.begin() + rows * H), x(rows * H), gu(rows * 2 * inter),
        h(rows * inter), y(rows * H);
    add_rmsnorm_ref(res.data(), widen(delta).data(), post_norm.data(), rows, H, 1e-6f, x.data());
    round_all(x);
    gemm_ref(x.data(), H, widen(w_gu).data(), rows, 2 * inter, H, gu.data(), 2 * inter, false);
    round_all(gu);
    silu_mul_ref(gu.data(), rows, inter, h.data());
    round_all(h);
    gemm_ref(h.data(), inter, widen(w_dn).data(), rows, H, inter, y.data(), H, false);
    round_all(y);
    expect_rows(residual_out, res, rows, H, "residual_out");
    expect_rows(residual_copy, res, rows, H, "residual copied back");
    expect_rows(delta_out, y, rows, H, "delta_out");
  }
  // A combine without a route table and without shared outputs sums nothing: refused.
  std::vector<uint16_t> out(8 * H);
  Stage cb;
  cb.kind = Kind::kCombine;
  cb.n = H;
  cb.tile = 16;
  cb.out = out.data();
  cb.out_stride = H;
  auto bad = plan_program({cb}, 8, 2);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("needs shared"), std::string::npos) << bad.status().message();
}

// FP8 e4m3 experts and shared pieces with block scales: contiguous (the
// stage's scale_expert_stride) and through per-expert weight and scale tables
// (the engine's layout), against the plain MoE on the dequantized weights,
// bit for bit.
TEST(MonoProgram, Fp8MoeBlockEqualsThePlainMoe) {
  MoeChain shape = v2_lite_like_moe();
  shape.hidden = 128;
  shape.inter = 64;
  shape.shared_inter = 96;
  shape.shared_pieces = 2;
  shape.num_experts = 16;
  shape.top_k = 4;
  for (bool tables : {false, true})
    for (const auto& [width, rows] : {std::pair{1, 1}, std::pair{8, 6}}) {
      SCOPED_TRACE(::testing::Message() << (tables ? "tables" : "contiguous") << ", width " << width << ", rows "
                                        << rows);
      MoeChain sc = shape;
      sc.slots = std::min(width * sc.top_k, sc.num_experts);
      HostMoe m(sc, 41, tables, /*fp8=*/true);
      const PlainMoe want = plain_moe(m, rows);
      auto plan = plan_program(moe_chain_stages(m.c, 16), width, 5);
      ASSERT_TRUE(plan.ok()) << plan.status().message();
      int fp8_stages = 0;
      for (const Stage& st : plan->stages) fp8_stages += fp8_weights(st) ? 1 : 0;
      EXPECT_EQ(fp8_stages, 4) << "the shared and routed gate_up and down; the router bf16";
      ASSERT_TRUE(run_program_ref(*plan, rows, 3).ok());
      expect_rows(m.residual_out, want.residual_out, rows, sc.hidden, "residual_out");
      expect_rows(m.delta_out, want.delta_out, rows, sc.hidden, "delta_out");
      if (!tables) {  // a scale stride shorter than an expert's scales is refused
        std::vector<Stage> st = moe_chain_stages(m.c, 16);
        for (Stage& s : st)
          if (routed(s)) s.scale_expert_stride -= 1;
        auto bad = plan_program(st, width, 5);
        ASSERT_FALSE(bad.ok());
        EXPECT_NE(bad.status().message().find("scale_expert_stride"), std::string::npos) << bad.status().message();
      }
    }
}

// The engine's layout: each expert in its own tensor (weight tables), two
// shared pieces (DeepSeek-V2-Lite's), and the residual copied back into the
// one residual buffer the graph keeps.
TEST(MonoProgram, MoeBlockWithTablesPiecesAndResidualCopy) {
  MoeChain sc = v2_lite_like_moe();
  sc.shared_pieces = 2;
  sc.shared_inter = 32;
  for (auto [width, rows] : {std::pair{1, 1}, std::pair{8, 7}}) {
    SCOPED_TRACE(::testing::Message() << "width " << width << ", rows " << rows);
    sc.slots = std::min(width * sc.top_k, sc.num_experts);
    HostMoe m(sc, 77, /*tables=*/true);
    const PlainMoe want = plain_moe(m, rows);
    std::vector<float> residual_buffer(8 * sc.hidden, NAN);
    m.c.residual_copy_to = residual_buffer.data();
    auto plan = plan_program(moe_chain_stages(m.c, 16), width, 5);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    EXPECT_EQ(plan->stages[2].slots, 2);
    ASSERT_TRUE(run_program_ref(*plan, rows, 3).ok());
    expect_rows(m.delta_out, want.delta_out, rows, sc.hidden, "delta_out");
    expect_rows(residual_buffer, want.residual_out, rows, sc.hidden, "residual copied back");
    // The copy must wait for every stage that reads the residual: without
    // the combine's waits the plan is refused.
    std::vector<Stage> st = moe_chain_stages(m.c, 16);
    m.c.residual_copy_to = const_cast<float*>(m.c.residual);  // the graph's case: the residual itself
    st = moe_chain_stages(m.c, 16);
    EXPECT_TRUE(plan_program(st, width, 5).ok());
    st.back().wait_mask = (1u << 1) | (1u << 5);  // no wait for the shared experts (stage 3 -> 2 reads residual)
    auto refused = plan_program(st, width, 5);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("residual_copy_to overlaps stage 2's residual"), std::string::npos)
        << refused.status().message();
  }
}

// The block from the attention's output projection: o_proj writes delta,
// which the router and the experts' add + RMSNorm then read.
TEST(MonoProgram, MoeBlockFromTheOutputProjection) {
  MoeChain sc = tiny_like_moe();
  for (auto [width, rows] : {std::pair{1, 1}, std::pair{8, 6}}) {
    SCOPED_TRACE(::testing::Message() << "width " << width << ", rows " << rows);
    sc.slots = std::min(width * sc.top_k, sc.num_experts);
    HostMoe m(sc, 55);
    const int64_t o_k = 48, H = sc.hidden;
    const std::vector<uint16_t> w_o = random_bf16(H * o_k, 0.3f, 91), attn_out = random_bf16(8 * o_k, 1.0f, 92);
    std::vector<float> delta(rows * H);
    gemm_ref(widen(attn_out).data(), o_k, widen(w_o).data(), rows, H, o_k, delta.data(), H, false);
    for (int64_t i = 0; i < rows * H; ++i) m.delta[i] = f32_to_bf16(delta[i]);
    const PlainMoe want = plain_moe(m, rows);  // the chain from that delta
    round_all(delta);
    std::fill(m.delta.begin(), m.delta.end(), kNanBf16);  // the program must write it
    m.c.w_o = w_o.data();
    m.c.attn_out = attn_out.data();
    m.c.o_k = o_k;
    auto plan = plan_program(moe_chain_stages(m.c, 16), width, 7);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    ASSERT_EQ(plan->stages.size(), 8u);  // o_proj, router, select, shared up / down, routed up / down, combine
    ASSERT_TRUE(run_program_ref(*plan, rows, 2).ok());
    expect_rows(m.delta, delta, rows, H, "delta (o_proj)");
    expect_rows(m.residual_out, want.residual_out, rows, H, "residual_out");
    expect_rows(m.delta_out, want.delta_out, rows, H, "delta_out");
    std::vector<Stage> st = moe_chain_stages(m.c, 16);
    st[1].wait_mask = 0;  // the router not waiting for o_proj's delta
    auto refused = plan_program(st, width, 7);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("stage 1: its delta overlaps stage 0's out"), std::string::npos)
        << refused.status().message();
  }
}

// A graph's buffers may hold fewer rows than the program's width (graph
// sizes 1, 2, 4, 5: a 5-row step runs width 8): checked over the step's
// rows, back-to-back buffers do not overlap; over the width they would.
TEST(MonoProgram, CheckedOverTheRowsTheBuffersHold) {
  MoeChain sc = tiny_like_moe();
  sc.slots = 8;
  HostMoe m(sc, 13);
  const int64_t H = sc.hidden;
  // As the graph: the residual's 5 rows, then delta's (the block's input and output), back to back (the
  // arena long enough for 8 rows of delta, so the 8-row check's ranges stay inside it, whatever the heap holds next).
  std::vector<float> arena(5 * H + 8 * H / 2);
  std::copy(m.residual.begin(), m.residual.begin() + 5 * H, arena.begin());
  auto* delta = reinterpret_cast<uint16_t*>(arena.data() + 5 * H);
  std::copy(m.delta.begin(), m.delta.begin() + 5 * H, delta);
  m.c.residual = arena.data();
  m.c.delta = delta;
  m.c.delta_out = delta;
  m.c.residual_copy_to = arena.data();
  const std::vector<Stage> st = moe_chain_stages(m.c, 16);
  const auto over_width = check_program(st, 8);  // over 8 rows the residual copy runs into delta
  ASSERT_FALSE(over_width.ok());
  EXPECT_NE(over_width.status().message().find("residual_copy_to overlaps out"), std::string::npos)
      << over_width.status().message();
  const PlainMoe want = plain_moe(m, 5);         // from m's own residual and delta, before the run
  auto checked = check_program(st, 8, 5);       // over the 5 the buffers hold: no overlap
  ASSERT_TRUE(checked.ok()) << checked.status().message();
  ASSERT_TRUE(run_program_ref(deal_jobs(*checked, 8, 3), 5, 1).ok());
  for (int64_t i = 0; i < 5 * H; ++i) {
    ASSERT_EQ(bf16_to_f32(m.c.delta_out[i]), want.delta_out[i]) << i;
    ASSERT_EQ(arena[i], want.residual_out[i]) << i;
  }
  EXPECT_EQ(check_program(st, 8, 9).status().code(), StatusCode::kInvalidArgument);  // more rows than the width
}

// What decides the stages is the weights given, not the activations: the
// queues a caller deals with placeholder activations (null) hold the jobs of
// the stages it later checks with real ones.
TEST(MonoProgram, StagesDependOnWeightsNotActivations) {
  MoeChain sc = tiny_like_moe();
  sc.slots = 8;
  HostMoe m(sc, 21);
  const std::vector<uint16_t> w_o = random_bf16(sc.hidden * 48, 0.3f, 3);
  MoeChain placeholder = m.c;
  placeholder.w_o = w_o.data();
  placeholder.o_k = 48;
  placeholder.attn_out = nullptr;
  placeholder.residual = nullptr;
  placeholder.delta = nullptr;
  MoeChain real = placeholder;
  const std::vector<uint16_t> attn_out = random_bf16(8 * 48, 1.0f, 4);
  real.attn_out = attn_out.data();
  real.residual = m.c.residual;
  real.delta = m.c.delta;
  const std::vector<Stage> a = moe_chain_stages(placeholder, 16), b = moe_chain_stages(real, 16);
  ASSERT_EQ(a.size(), b.size());
  ASSERT_EQ(a.size(), 8u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(stage_jobs(a[i]), stage_jobs(b[i])) << "stage " << i;
}

// The layer front (add + norm, q_proj and kv_a, RoPE with the latent cache
// write) against the plain chain: add_rmsnorm_ref, gemm_ref, and the RoPE
// table and RMSNorm references, at the decode graph's rounding points (bf16
// GEMM outputs, a bf16 cache row); a row with slot -1 writes no cache row;
// the first layer's front (no delta) writes no residual; with a q LoRA,
// q_a, its RMSNorm (a plain-norm prologue) and q_b.
// The absorption from an FP8 kv_b_proj: W_UK^T transposed with its blocks'
// scales (transpose_w_uk, transpose_w_uk_scale) gives q_full = q_nope . W_UK
// of the dequantized kv_b.
TEST(MonoProgram, AbsorptionFromAnFp8KvB) {
  const int64_t H = 64, heads = 2, nope = 128, rope_dim = 64, v = 128, lora = 256, head = nope + rope_dim,
                width = lora + rope_dim, slots = 16;
  const Fp8Weight kv_b(heads * (nope + v), lora, 61);
  const std::vector<float> w = kv_b.dequantized();
  const std::vector<uint8_t> uk_t = transpose_w_uk(kv_b.q.data(), heads, nope, v, lora);
  const std::vector<float> uk_t_scale = transpose_w_uk_scale(kv_b.scale.data(), heads, nope, v, lora);
  ASSERT_EQ(uk_t_scale.size(), static_cast<size_t>(heads * 2 * 1));
  RopeParams rp;
  rp.rope_dim = rope_dim;
  rp.theta = 10000.0;
  const RopeTable table = make_rope_table(rp, 1 << 12);
  const std::vector<uint16_t> w_q = random_bf16(heads * head * H, 0.3f, 62), w_kva = random_bf16(width * H, 0.3f, 63);
  const std::vector<float> input_norm = random_f32(H, 0.5f, 1.5f, 64), kv_norm = random_f32(lora, 0.5f, 1.5f, 65);
  const std::vector<float> residual = random_f32(8 * H, -2.0f, 2.0f, 66);
  const std::vector<int32_t> positions = {0, 3, 17, 100, 2047, 9, 5, 1};
  const std::vector<int64_t> slot_mapping = {4, 9, -1, 0, 15, 12, 2, 3};
  std::vector<uint16_t> q(8 * heads * head, kNanBf16), kv_a(8 * width, kNanBf16), cache(slots * width, kNanBf16),
      q_full(8 * heads * width, kNanBf16);
  FrontChain c;
  c.hidden = H;
  c.num_heads = static_cast<int32_t>(heads);
  c.qk_nope = static_cast<int32_t>(nope);
  c.qk_rope = static_cast<int32_t>(rope_dim);
  c.kv_lora = static_cast<int32_t>(lora);
  c.w_q = w_q.data();
  c.w_kva = w_kva.data();
  c.input_norm = input_norm.data();
  c.kv_norm = kv_norm.data();
  c.inv_freq = table.inv_freq.data();
  c.residual = residual.data();
  c.q = q.data();
  c.kv_a = kv_a.data();
  c.positions = positions.data();
  c.slot_mapping = slot_mapping.data();
  c.cache = cache.data();
  c.num_slots = slots;
  c.w_uk_t = uk_t.data();
  c.uk_t_scale = uk_t_scale.data();
  c.q_full = q_full.data();
  c.absorb_tile = 64;
  const int rows = 6;
  auto plan = plan_program(front_chain_stages(c, 16), 8, 5);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  ASSERT_TRUE(run_program_ref(*plan, rows, 4).ok());
  for (int r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t cc = 0; cc < lora; ++cc) {
        double acc = 0.0;
        for (int64_t d = 0; d < nope; ++d)
          acc += static_cast<double>(bf16_to_f32(q[(r * heads + h) * head + d])) * w[(h * (nope + v) + d) * lora + cc];
        ASSERT_NEAR(bf16_to_f32(q_full[(r * heads + h) * width + cc]), acc, std::abs(acc) * 0.0079 + 1e-4)
            << "q_full row " << r << " head " << h << " " << cc;
      }
}

TEST(MonoProgram, LayerFrontEqualsThePlainChain) {
  const int64_t H = 64, heads = 2, nope = 16, rope_dim = 16, lora = 32, head = nope + rope_dim, width = lora + rope_dim;
  const int64_t slots = 40;
  RopeParams rp;
  rp.rope_dim = rope_dim;
  rp.theta = 10000.0;
  const RopeTable table = make_rope_table(rp, 1 << 14);
  const std::vector<uint16_t> w_q = random_bf16(heads * head * H, 0.3f, 1), w_kva = random_bf16(width * H, 0.3f, 2);
  const std::vector<float> input_norm = random_f32(H, 0.5f, 1.5f, 3), kv_norm = random_f32(lora, 0.5f, 1.5f, 4);
  const std::vector<float> residual = random_f32(8 * H, -2.0f, 2.0f, 5);
  const std::vector<uint16_t> delta = random_bf16(8 * H, 1.0f, 6);
  const std::vector<int32_t> positions = {0, 3, 17, 100, 2047, 9000, 5, 12000};
  const std::vector<int64_t> slot_mapping = {4, 9, -1, 0, 39, 12, 20, 31};
  const int64_t q_lora = 32;
  const std::vector<uint16_t> w_qa = random_bf16(q_lora * H, 0.3f, 7), w_qb = random_bf16(heads * head * q_lora, 0.3f, 8);
  const std::vector<float> q_a_norm = random_f32(q_lora, 0.5f, 1.5f, 9);
  // The absorption's W_UK^T, [heads, lora, nope].
  const std::vector<uint16_t> w_uk_t = random_bf16(heads * lora * nope, 0.3f, 10);
  // 0: the first layer, 1: a later one, 2: a later one with a q LoRA, 3: with
  // a q LoRA and the absorption, 4: without a LoRA, with the absorption.
  for (int variant = 0; variant < 5; ++variant) {
    const bool first_layer = variant == 0, with_lora = variant == 2 || variant == 3, absorb = variant >= 3;
    for (auto [w, rows] : {std::pair{1, 1}, std::pair{8, 8}, std::pair{8, 6}}) {
      SCOPED_TRACE(::testing::Message() << (first_layer ? "first layer, " : "") << (with_lora ? "q LoRA, " : "")
                                        << (absorb ? "absorbed, " : "") << "width " << w << ", rows " << rows);
      std::vector<uint16_t> q_a(8 * q_lora, kNanBf16), q_full(8 * heads * width, kNanBf16);
      std::vector<float> residual_out(8 * H, NAN), residual_copy(8 * H, NAN);
      std::vector<uint16_t> q(8 * heads * head, kNanBf16), kv_a(8 * width, kNanBf16), cache(slots * width, kNanBf16);
      FrontChain c;
      c.hidden = H;
      c.num_heads = heads;
      c.qk_nope = nope;
      c.qk_rope = rope_dim;
      c.kv_lora = lora;
      c.w_q = w_q.data();
      c.w_kva = w_kva.data();
      if (with_lora) {
        c.q_lora = q_lora;
        c.w_qa = w_qa.data();
        c.w_qb = w_qb.data();
        c.q_a_norm = q_a_norm.data();
        c.q_a = q_a.data();
      }
      c.input_norm = input_norm.data();
      c.kv_norm = kv_norm.data();
      c.inv_freq = table.inv_freq.data();
      c.residual = residual.data();
      c.delta = first_layer ? nullptr : delta.data();
      c.residual_out = first_layer ? nullptr : residual_out.data();
      c.residual_copy_to = residual_copy.data();
      c.q = q.data();
      c.kv_a = kv_a.data();
      c.positions = positions.data();
      c.slot_mapping = slot_mapping.data();
      c.cache = cache.data();
      c.num_slots = slots;
      if (absorb) {
        c.w_uk_t = w_uk_t.data();
        c.q_full = q_full.data();
        c.absorb_tile = 16;
      }
      auto plan = plan_program(front_chain_stages(c, 16), w, 5);
      ASSERT_TRUE(plan.ok()) << plan.status().message();
      ASSERT_TRUE(run_program_ref(*plan, rows, 4).ok());
      // The plain chain.
      std::vector<float> res(residual.begin(), residual.begin() + rows * H), x(rows * H);
      add_rmsnorm_ref(res.data(), first_layer ? nullptr : widen(delta).data(), input_norm.data(), rows, H, 1e-6f,
                      x.data());
      round_all(x);
      std::vector<float> want_q(rows * heads * head), want_kv(rows * width);
      if (with_lora) {
        std::vector<float> qa(rows * q_lora), qn(rows * q_lora);
        gemm_ref(x.data(), H, widen(w_qa).data(), rows, q_lora, H, qa.data(), q_lora, false);
        round_all(qa);
        rmsnorm_ref(qa.data(), q_lora, q_a_norm.data(), rows, q_lora, 1e-6f, qn.data(), q_lora);
        round_all(qn);
        gemm_ref(qn.data(), q_lora, widen(w_qb).data(), rows, heads * head, q_lora, want_q.data(), heads * head, false);
      } else {
        gemm_ref(x.data(), H, widen(w_q).data(), rows, heads * head, H, want_q.data(), heads * head, false);
      }
      gemm_ref(x.data(), H, widen(w_kva).data(), rows, width, H, want_kv.data(), width, false);
      round_all(want_q);
      round_all(want_kv);
      expect_rows(kv_a, want_kv, rows, width, "kv_a");
      if (absorb) {  // q_lat[r, h, c] = sum_d q_nope[r, h, d] W_UK[h][d, c], in f64, against the bf16 result
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t h = 0; h < heads; ++h)
            for (int64_t cc = 0; cc < lora; ++cc) {
              double exact = 0.0;
              for (int64_t d = 0; d < nope; ++d)
                exact += static_cast<double>(want_q[r * heads * head + h * head + d]) *
                         bf16_to_f32(w_uk_t[(h * lora + cc) * nope + d]);
              const float got = bf16_to_f32(q_full[(r * heads + h) * width + cc]);
              ASSERT_NEAR(got, exact, std::abs(exact) * 0.0079 + 1e-5) << "q_lat row " << r << " head " << h << " " << cc;
            }
        for (int64_t i = rows * heads * width; i < 8 * heads * width; ++i)
          ASSERT_EQ(q_full[i], kNanBf16) << "q_full written beyond the rows";
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t h = 0; h < heads; ++h) apply_rope_interleaved_ref(table, positions[r], want_q.data() + r * heads * head + h * head + nope);
        if (slot_mapping[r] < 0) continue;
        std::vector<float> row(width);
        rmsnorm_ref(want_kv.data() + r * width, width, kv_norm.data(), 1, lora, 1e-6f, row.data(), width);
        std::copy(want_kv.begin() + r * width + lora, want_kv.begin() + (r + 1) * width, row.begin() + lora);
        apply_rope_interleaved_ref(table, positions[r], row.data() + lora);
        for (int64_t i = 0; i < width; ++i)
          ASSERT_EQ(bf16_to_f32(cache[slot_mapping[r] * width + i]), round_to_bf16(row[i]))
              << "cache row of row " << r << ", column " << i;
      }
      round_all(want_q);
      expect_rows(q, want_q, rows, heads * head, "q (q_pe rotated)");
      if (absorb) {  // the rotated q_pe, also in the absorbed query
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t h = 0; h < heads; ++h)
            for (int64_t i = 0; i < rope_dim; ++i)
              ASSERT_EQ(q_full[(r * heads + h) * width + lora + i], q[r * heads * head + h * head + nope + i])
                  << "q_full's q_pe, row " << r << " head " << h;
      }
      int64_t written = 0;
      for (uint16_t v : cache) written += v != kNanBf16;
      int64_t want_written = 0;
      for (int64_t r = 0; r < rows; ++r) want_written += slot_mapping[r] >= 0 ? width : 0;
      EXPECT_EQ(written, want_written) << "cache rows written beyond the rows' slots";
      if (first_layer) {
        EXPECT_TRUE(std::isnan(residual_copy[0])) << "the first layer's front writes no residual";
      } else {
        expect_rows(residual_copy, res, rows, H, "residual copied back");
      }
    }
  }
}

// The end of the decode attention (attention_output_stages): the merge of
// the attention's KV splits, each row using the splits its key count gives
// (kernels/mla/mla_split_plan.h: an even share of at least min_split_keys,
// or the device rule), then W_UV per head, against an f64 computation of the
// documented formulas written here; with one split, o_lat passed through.
// W_UV read in place from an FP8 kv_b_proj ([heads * (qk_nope + v_head),
// kv_lora] e4m3 with 128 x 128 blocks: head h's value rows start at scale
// row (h (qk_nope + v_head) + qk_nope) / 128), against o_lat . W_UV on the
// dequantized weight.
TEST(MonoProgram, AttentionOutputReadsAnFp8KvB) {
  const int32_t heads = 3, lora = 256, nope = 128, v = 128;
  const Fp8Weight kv_b(int64_t{heads} * (nope + v), lora, 51);
  const std::vector<float> w = kv_b.dequantized();
  const std::vector<uint16_t> o_lat_in = random_bf16(8 * heads * lora, 1.0f, 52);
  std::vector<int32_t> token_seq(8, 0), query_start = {0, 8}, context = {100};
  std::vector<uint16_t> o_lat(8 * heads * lora, kNanBf16), out(8 * heads * v, kNanBf16);
  AttentionOutputChain c;
  c.num_heads = heads;
  c.kv_lora = lora;
  c.qk_nope = nope;
  c.v_head = v;
  c.kv_b = kv_b.q.data();
  c.kv_b_scale = kv_b.scale.data();
  c.o_lat_in = o_lat_in.data();
  c.splits = 1;
  c.token_seq = token_seq.data();
  c.query_start = query_start.data();
  c.context_lens = context.data();
  c.o_lat = o_lat.data();
  c.attn_out = out.data();
  const std::vector<Stage> st = attention_output_stages(c);
  ASSERT_EQ(st.size(), 2u);
  EXPECT_TRUE(fp8_weights(st[1]));
  const int rows = 5;
  auto plan = plan_program(st, 8, 4);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  ASSERT_TRUE(run_program_ref(*plan, rows, 2).ok());
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h)
      for (int d = 0; d < v; ++d) {
        double acc = 0.0;
        for (int cc = 0; cc < lora; ++cc)
          acc += static_cast<double>(bf16_to_f32(o_lat_in[(r * heads + h) * lora + cc])) *
                 w[(static_cast<int64_t>(h) * (nope + v) + nope + d) * lora + cc];
        ASSERT_NEAR(bf16_to_f32(out[r * heads * v + h * v + d]), acc, std::abs(acc) * 0.0079 + 1e-4)
            << "attn_out row " << r << " head " << h << " " << d;
      }
  for (int64_t i = rows * heads * v; i < 8 * heads * v; ++i) ASSERT_EQ(out[i], kNanBf16) << "pad rows written";
}

TEST(MonoProgram, AttentionOutputMergesTheSplitsAndProjectsValues) {
  const int32_t heads = 4, lora = 32, nope = 16, v = 16, S = 8;
  const std::vector<uint16_t> kv_b = random_bf16(heads * (nope + v) * lora, 0.3f, 21);
  // (89 context keys: 3 splits of a 5-row call under the device rule at 32-key tiles, 2 of an 8-row one.)
  const std::vector<int32_t> context = {0, 89, 100, 300, 1000, 255, 64, 7};
  std::vector<int32_t> token_seq(8), query_start(9);
  for (int i = 0; i < 8; ++i) token_seq[i] = query_start[i] = i;
  query_start[8] = 8;
  const std::vector<float> partials = random_f32(8 * S * heads * lora, -2.0f, 2.0f, 22);
  const std::vector<float> lse = random_f32(8 * S * heads, -6.0f, 6.0f, 23);
  const std::vector<uint16_t> o_lat_in = random_bf16(8 * heads * lora, 1.0f, 24);
  for (auto [w, rows, splits, min_keys, tile] :
       {std::tuple{8, 6, S, 64, 32}, std::tuple{8, 8, S, 0, 32}, std::tuple{1, 1, S, 32, 32}, std::tuple{4, 3, 1, 32, 32},
        std::tuple{8, 5, S, 0, 32}, std::tuple{8, 5, S, 0, 64}, std::tuple{8, 7, S, 32, 64}}) {  // (min_split_keys 32 at 64-key tiles: allowed)
    SCOPED_TRACE(::testing::Message() << "width " << w << ", rows " << rows << ", splits " << splits
                                      << ", min_split_keys " << min_keys << ", key tile " << tile);
    std::vector<uint16_t> o_lat(8 * heads * lora, kNanBf16), out(8 * heads * v, kNanBf16);
    AttentionOutputChain c;
    c.num_heads = heads;
    c.kv_lora = lora;
    c.qk_nope = nope;
    c.v_head = v;
    c.kv_b = kv_b.data();
    c.partials = partials.data();
    c.lse = lse.data();
    c.o_lat_in = o_lat_in.data();
    c.splits = splits;
    c.min_split_keys = min_keys;
    c.key_tile = tile;
    c.token_seq = token_seq.data();
    c.query_start = query_start.data();
    c.context_lens = context.data();
    c.o_lat = o_lat.data();
    c.attn_out = out.data();
    c.width = w;
    auto plan = plan_program(attention_output_stages(c), w, 6);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    ASSERT_TRUE(run_program_ref(*plan, rows, 8).ok());
    for (int r = 0; r < rows; ++r) {
      const int keys = context[r] + 1;
      int ns = 1;
      if (splits > 1) {  // the split plan, as docs of kernels/mla/mla_decode.cuh state it
        int chunk;
        if (min_keys > 0) {
          chunk = std::max((keys + splits - 1) / splits, min_keys);
        } else {
          const int want = static_cast<int>(std::lround(std::sqrt(0.54 * keys / rows)));
          chunk = (keys + std::clamp(want, 1, splits) - 1) / std::clamp(want, 1, splits);
        }
        chunk = (chunk + tile - 1) / tile * tile;
        ns = (keys + chunk - 1) / chunk;
      }
      for (int h = 0; h < heads; ++h) {
        for (int cc = 0; cc < lora; ++cc) {
          const float got = bf16_to_f32(o_lat[(r * heads + h) * lora + cc]);
          if (splits == 1) {
            ASSERT_EQ(o_lat[(r * heads + h) * lora + cc], o_lat_in[(r * heads + h) * lora + cc]);
            continue;
          }
          double mx = -1e30, sum = 0.0, acc = 0.0;
          for (int s = 0; s < ns; ++s) mx = std::max<double>(mx, lse[(r * S + s) * heads + h]);
          for (int s = 0; s < ns; ++s) sum += std::exp2(lse[(r * S + s) * heads + h] - mx);
          for (int s = 0; s < ns; ++s)
            acc += std::exp2(lse[(r * S + s) * heads + h] - mx) / sum * partials[((r * S + s) * heads + h) * lora + cc];
          ASSERT_NEAR(got, acc, std::abs(acc) * 0.0079 + 1e-5) << "o_lat row " << r << " head " << h << " " << cc
                                                               << " (" << ns << " splits)";
        }
        for (int d = 0; d < v; ++d) {
          double acc = 0.0;
          for (int cc = 0; cc < lora; ++cc)
            acc += static_cast<double>(bf16_to_f32(o_lat[(r * heads + h) * lora + cc])) *
                   bf16_to_f32(kv_b[(h * (nope + v) + nope + d) * lora + cc]);
          ASSERT_NEAR(bf16_to_f32(out[r * heads * v + h * v + d]), acc, std::abs(acc) * 0.0079 + 1e-4)
              << "attn_out row " << r << " head " << h << " " << d;
        }
      }
    }
    for (int64_t i = rows * heads * v; i < 8 * heads * v; ++i) ASSERT_EQ(out[i], kNanBf16) << "pad rows written";
  }
  // The merge's splits must be 1 ... 256 and the key tile 32 or 64.
  AttentionOutputChain bad;
  bad.num_heads = heads;
  bad.kv_lora = lora;
  bad.kv_b = kv_b.data();
  bad.partials = partials.data();
  bad.lse = lse.data();
  bad.token_seq = token_seq.data();
  bad.query_start = query_start.data();
  bad.context_lens = context.data();
  std::vector<uint16_t> o_lat(8 * heads * lora), out(8 * heads * v);
  bad.o_lat = o_lat.data();
  bad.attn_out = out.data();
  bad.splits = 300;
  EXPECT_FALSE(plan_program(attention_output_stages(bad), 8, 4).ok());
  bad.splits = 8;
  bad.key_tile = 48;
  EXPECT_FALSE(plan_program(attention_output_stages(bad), 8, 4).ok());
  bad.key_tile = 64;
  bad.min_split_keys = 48;  // not a multiple of 32
  EXPECT_FALSE(plan_program(attention_output_stages(bad), 8, 4).ok());
}

// The whole decode attention as program stages (kAttend, kMerge, W_UV): the
// split-KV partials over a paged cache, merged, projected by W_UV, against an
// f64 softmax attention over the same bf16 rows written here. 20 heads (two
// head groups, the second partial), rows of 1 to 300 keys over random pages
// of 16, the device split rule and a fixed minimum; pad rows untouched.
TEST(MonoProgram, AttentionStagesEqualSoftmaxAttention) {
  const int32_t heads = 20, lora = 64, rope = 16, nope = 16, v = 16, row_w = lora + rope, S = 8, bs = 16;
  const float scale = 0.3f;
  const std::vector<int32_t> context = {0, 89, 150, 299, 40, 7, 64, 200};
  const int32_t max_blocks = 32, num_blocks = 8 * max_blocks;
  std::vector<int32_t> token_seq(8), query_start(9), tables(8 * max_blocks);
  for (int i = 0; i < 8; ++i) token_seq[i] = query_start[i] = i;
  query_start[8] = 8;
  std::vector<int32_t> perm(num_blocks);
  for (int i = 0; i < num_blocks; ++i) perm[i] = (i * 37 + 11) % num_blocks;  // a permutation (37 odd, 256 = 2^8)
  for (int i = 0; i < 8 * max_blocks; ++i) tables[i] = perm[i];
  const std::vector<uint16_t> cache = random_bf16(int64_t{num_blocks} * bs * row_w, 1.0f, 61);
  const std::vector<uint16_t> q_full = random_bf16(8 * heads * row_w, 1.0f, 62);
  const std::vector<uint16_t> kv_b = random_bf16(heads * (nope + v) * lora, 0.3f, 63);
  for (auto [w, rows, min_keys] : {std::tuple{8, 5, 32}, std::tuple{8, 8, 0}, std::tuple{1, 1, 64}}) {
    SCOPED_TRACE(::testing::Message() << "width " << w << ", rows " << rows << ", min_split_keys " << min_keys);
    std::vector<float> part_o(8 * S * heads * lora, NAN), part_lse(8 * S * heads, NAN);
    std::vector<uint16_t> o_lat(8 * heads * lora, kNanBf16), out(8 * heads * v, kNanBf16);
    AttentionOutputChain c;
    c.num_heads = heads;
    c.kv_lora = lora;
    c.qk_nope = nope;
    c.v_head = v;
    c.qk_rope = rope;
    c.kv_b = kv_b.data();
    c.splits = S;
    c.min_split_keys = min_keys;
    c.key_tile = 32;
    c.token_seq = token_seq.data();
    c.query_start = query_start.data();
    c.context_lens = context.data();
    c.o_lat = o_lat.data();
    c.attn_out = out.data();
    c.q_full = q_full.data();
    c.cache = cache.data();
    c.num_slots = int64_t{num_blocks} * bs;
    c.block_tables = tables.data();
    c.max_blocks = max_blocks;
    c.block_size = bs;
    c.scale = scale;
    c.part_o = part_o.data();
    c.part_lse = part_lse.data();
    c.width = w;
    const std::vector<Stage> st = attention_output_stages(c);
    ASSERT_EQ(st.size(), 3u);
    auto plan = plan_program(st, w, 11);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    ASSERT_TRUE(run_program_ref(*plan, rows, 9).ok());
    for (int r = 0; r < rows; ++r) {
      const int keys = context[r] + 1;
      for (int h = 0; h < heads; ++h) {
        std::vector<double> sc(keys), ol(lora, 0.0);
        double mx = -1e300, sum = 0.0;
        for (int k = 0; k < keys; ++k) {
          const int64_t slot = int64_t{tables[r * max_blocks + k / bs]} * bs + k % bs;
          double d = 0.0;
          for (int i = 0; i < row_w; ++i)
            d += static_cast<double>(bf16_to_f32(q_full[(r * heads + h) * row_w + i])) * bf16_to_f32(cache[slot * row_w + i]);
          sc[k] = scale * d;
          mx = std::max(mx, sc[k]);
        }
        for (int k = 0; k < keys; ++k) sum += std::exp(sc[k] - mx);
        for (int k = 0; k < keys; ++k) {
          const int64_t slot = int64_t{tables[r * max_blocks + k / bs]} * bs + k % bs;
          for (int i = 0; i < lora; ++i) ol[i] += std::exp(sc[k] - mx) / sum * bf16_to_f32(cache[slot * row_w + i]);
        }
        for (int i = 0; i < lora; ++i)
          ASSERT_NEAR(bf16_to_f32(o_lat[(r * heads + h) * lora + i]), ol[i], std::abs(ol[i]) * 0.0079 + 2e-4)
              << "o_lat row " << r << " head " << h << " " << i;
        for (int d = 0; d < v; ++d) {
          double acc = 0.0;
          for (int i = 0; i < lora; ++i) acc += ol[i] * bf16_to_f32(kv_b[(h * (nope + v) + nope + d) * lora + i]);
          ASSERT_NEAR(bf16_to_f32(out[r * heads * v + h * v + d]), acc, std::abs(acc) * 0.016 + 2e-3)
              << "attn_out row " << r << " head " << h << " " << d;
        }
      }
    }
    for (int64_t i = rows * heads * v; i < 8 * heads * v; ++i) ASSERT_EQ(out[i], kNanBf16) << "pad rows written";
    // The refusals: no cache; jobs not width * groups * splits; a latent of more than 512 values.
    std::vector<Stage> bad = st;
    bad[0].cache = nullptr;
    EXPECT_FALSE(plan_program(bad, w, 11).ok());
    bad = st;
    bad[0].n += 1;
    EXPECT_FALSE(plan_program(bad, w, 11).ok());
    bad = st;
    bad[0].kv_lora = 528;
    EXPECT_FALSE(check_stage(bad[0], 0, w).ok());
    // One split: a merge of one split copies o_lat and would never read the partials.
    AttentionOutputChain one = c;
    one.splits = 1;
    EXPECT_FALSE(plan_program(attention_output_stages(one), w, 11).ok());
    // The merge must wait for the attention: its partials are the attention's output.
    bad = st;
    bad[1].wait_mask = 0;
    bad[2].wait_mask = 1u << 1;
    EXPECT_FALSE(plan_program(bad, w, 11).ok());
  }
}

// The engine's split of the attention across programs: a front program
// whose last stage is the attention (FrontChain::attend) writes the partials,
// a later program (the MoE program's first stages) merges them and applies
// W_UV with the same split plan (program_attention_splits): the same bits
// as the attention, merge and W_UV in one program; and the split plan's
// bounds (2 ... 256 splits, the partials buffer holding every width's).
TEST(MonoProgram, AttentionInTheFrontMergedByTheNextProgram) {
  for (int32_t ctas : {1, 7, 132, 4096})
    for (int32_t w : {1, 2, 4, 8})
      for (int32_t heads : {4, 16, 20, 64}) {
        const int32_t splits = program_attention_splits(w, heads, ctas);
        EXPECT_GE(splits, 2);
        EXPECT_LE(splits, kMaxMergeSplits);
        EXPECT_LE(int64_t{w} * splits * heads * (512 + 1), program_attention_floats(heads, 512, ctas));
      }
  const int64_t H = 64, heads = 20, nope = 16, rope_dim = 16, lora = 64, head = nope + rope_dim, width = lora + rope_dim;
  const int32_t bs = 16, max_blocks = 4, num_slots = 8 * max_blocks * bs;
  RopeParams rp;
  rp.rope_dim = rope_dim;
  const RopeTable table = make_rope_table(rp, 1 << 12);
  const std::vector<uint16_t> w_q = random_bf16(heads * head * H, 0.3f, 71), w_kva = random_bf16(width * H, 0.3f, 72);
  const std::vector<uint16_t> w_uk_t = random_bf16(heads * lora * nope, 0.3f, 73);
  const std::vector<uint16_t> kv_b = random_bf16(heads * (nope + 16) * lora, 0.3f, 74);
  const std::vector<float> input_norm = random_f32(H, 0.5f, 1.5f, 75), kv_norm = random_f32(lora, 0.5f, 1.5f, 76);
  const std::vector<float> residual = random_f32(8 * H, -2.0f, 2.0f, 77);
  const std::vector<int32_t> context = {5, 40, 0, 63, 17, 2, 30, 50};  // keys before each row's own
  std::vector<int32_t> token_seq(8), query_start(9), tables(8 * max_blocks), positions(8);
  std::vector<int64_t> slot_mapping(8);
  for (int i = 0; i < 8; ++i) {
    token_seq[i] = query_start[i] = i;
    positions[i] = context[i];
    for (int b = 0; b < max_blocks; ++b) tables[i * max_blocks + b] = (i * max_blocks + b) * 5 % (8 * max_blocks);
    slot_mapping[i] = int64_t{tables[i * max_blocks + context[i] / bs]} * bs + context[i] % bs;  // the row's own key
  }
  query_start[8] = 8;
  const std::vector<uint16_t> cache0 = random_bf16(int64_t{num_slots} * width, 1.0f, 78);
  const int32_t w = 8, rows = 6, ctas = 9, splits = program_attention_splits(w, heads, ctas);
  std::vector<uint16_t> out[2];
  for (int split_programs = 0; split_programs < 2; ++split_programs) {
    std::vector<uint16_t> q(8 * heads * head, kNanBf16), kv(8 * width, kNanBf16), q_full(8 * heads * width, kNanBf16);
    std::vector<uint16_t> cache = cache0, o_lat(8 * heads * lora, kNanBf16);
    std::vector<float> partials(program_attention_floats(heads, lora, ctas), NAN);
    out[split_programs].assign(8 * heads * 16, kNanBf16);
    AttentionOutputChain at;
    at.num_heads = heads;
    at.kv_lora = lora;
    at.qk_nope = nope;
    at.v_head = 16;
    at.qk_rope = rope_dim;
    at.kv_b = kv_b.data();
    at.splits = splits;
    at.min_split_keys = kProgramAttentionMinSplitKeys;
    at.key_tile = kProgramAttentionKeyTile;
    at.width = w;
    at.attention = true;
    at.q_full = q_full.data();
    at.cache = cache.data();
    at.num_slots = num_slots;
    at.block_tables = tables.data();
    at.max_blocks = max_blocks;
    at.block_size = bs;
    at.token_seq = token_seq.data();
    at.query_start = query_start.data();
    at.context_lens = context.data();
    at.scale = 0.25f;
    at.part_o = partials.data();
    at.part_lse = partials.data() + int64_t{w} * splits * heads * lora;
    at.o_lat = o_lat.data();
    at.attn_out = out[split_programs].data();
    FrontChain f;
    f.hidden = H;
    f.num_heads = heads;
    f.qk_nope = nope;
    f.qk_rope = rope_dim;
    f.kv_lora = lora;
    f.w_q = w_q.data();
    f.w_kva = w_kva.data();
    f.input_norm = input_norm.data();
    f.kv_norm = kv_norm.data();
    f.inv_freq = table.inv_freq.data();
    f.residual = residual.data();
    f.q = q.data();
    f.kv_a = kv.data();
    f.positions = positions.data();
    f.slot_mapping = slot_mapping.data();
    f.cache = cache.data();
    f.num_slots = num_slots;
    f.w_uk_t = w_uk_t.data();
    f.q_full = q_full.data();
    if (split_programs) {  // the front attends; the merge and W_UV run in the next program
      f.attend = &at;
      const std::vector<Stage> front = front_chain_stages(f, 16);
      ASSERT_EQ(front.back().kind, Kind::kAttend);
      auto p1 = plan_program(front, w, ctas);
      ASSERT_TRUE(p1.ok()) << p1.status().message();
      ASSERT_TRUE(run_program_ref(*p1, rows, 2).ok());
      AttentionOutputChain merge = at;
      merge.attention = false;
      merge.q_full = nullptr;
      merge.partials = at.part_o;
      merge.lse = at.part_lse;
      auto p2 = plan_program(attention_output_stages(merge), w, ctas);
      ASSERT_TRUE(p2.ok()) << p2.status().message();
      ASSERT_TRUE(run_program_ref(*p2, rows, 3).ok());
    } else {  // the front, then attention + merge + W_UV in one program
      auto p1 = plan_program(front_chain_stages(f, 16), w, ctas);
      ASSERT_TRUE(p1.ok()) << p1.status().message();
      ASSERT_TRUE(run_program_ref(*p1, rows, 2).ok());
      auto p2 = plan_program(attention_output_stages(at), w, ctas);
      ASSERT_TRUE(p2.ok()) << p2.status().message();
      ASSERT_TRUE(run_program_ref(*p2, rows, 3).ok());
    }
  }
  EXPECT_EQ(out[0], out[1]);
  EXPECT_NE(out[1][0], kNanBf16) << "attn_out not written";
}

// Jobs that stream no weights (a combine's columns, a RoPE row) are dealt to
// distinct CTAs, not piled on the least loaded one (each still costs a wait,
// barriers and a fence).
TEST(MonoProgram, JobsWithoutWeightsSpreadOverCtas) {
  MoeChain sc = v2_lite_like_moe();
  sc.slots = 48;
  HostMoe m(sc, 3);
  auto plan = plan_program(moe_chain_stages(m.c, 8), 8, 132);  // combine: 64 / 8 = 8 jobs
  ASSERT_TRUE(plan.ok());
  const int32_t combine = static_cast<int32_t>(plan->stages.size()) - 1;
  std::set<int32_t> ctas;
  int32_t jobs = 0;
  for (int32_t c = 0; c < plan->num_ctas(); ++c)
    for (int32_t q = plan->queue_start[c]; q < plan->queue_start[c + 1]; ++q)
      if (plan->jobs[q].stage == combine) {
        ++jobs;
        ctas.insert(c);
      }
  EXPECT_EQ(jobs, 8);
  EXPECT_EQ(ctas.size(), 8u) << "combine jobs share CTAs";
}

// A MoE block and the next layer's front as one program (the front waiting
// for the combine) computes what the two programs compute one after the
// other: the boundary fusion mono_bench measures.
TEST(MonoProgram, MoeBlockAndNextFrontAsOneProgram) {
  MoeChain sc = tiny_like_moe();
  sc.slots = 8;
  const int64_t H = sc.hidden, heads = 2, nope = 16, rope_dim = 16, lora = 32, head = nope + rope_dim;
  const int64_t width = lora + rope_dim, slots = 16;
  RopeParams rp;
  rp.rope_dim = rope_dim;
  const RopeTable table = make_rope_table(rp, 1 << 12);
  const std::vector<uint16_t> w_q = random_bf16(heads * head * H, 0.3f, 1), w_kva = random_bf16(width * H, 0.3f, 2);
  const std::vector<float> input_norm = random_f32(H, 0.5f, 1.5f, 3), kv_norm = random_f32(lora, 0.5f, 1.5f, 4);
  const std::vector<int32_t> positions = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<int64_t> slot_mapping = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<uint16_t> q[2], kv[2], cache[2];
  std::vector<float> res2[2];
  for (int fused = 0; fused < 2; ++fused) {
    HostMoe m(sc, 41);
    q[fused].assign(8 * heads * head, kNanBf16);
    kv[fused].assign(8 * width, kNanBf16);
    cache[fused].assign(slots * width, kNanBf16);
    res2[fused].assign(8 * H, NAN);
    FrontChain f;
    f.hidden = H;
    f.num_heads = heads;
    f.qk_nope = nope;
    f.qk_rope = rope_dim;
    f.kv_lora = lora;
    f.w_q = w_q.data();
    f.w_kva = w_kva.data();
    f.input_norm = input_norm.data();
    f.kv_norm = kv_norm.data();
    f.inv_freq = table.inv_freq.data();
    f.residual = m.c.residual_out;  // the block's new residual and output
    f.delta = m.c.delta_out;
    f.residual_out = res2[fused].data();
    f.q = q[fused].data();
    f.kv_a = kv[fused].data();
    f.positions = positions.data();
    f.slot_mapping = slot_mapping.data();
    f.cache = cache[fused].data();
    f.num_slots = slots;
    const std::vector<Stage> moe = moe_chain_stages(m.c, 16), front = front_chain_stages(f, 16);
    if (fused) {
      std::vector<Stage> both = join_programs(moe, front);
      ASSERT_EQ(both.size(), moe.size() + front.size());
      // The front's first stages wait for the combine only (it waits for every other stage of the block).
      const auto combine = static_cast<uint32_t>(moe.size() - 1);
      EXPECT_EQ(both[moe.size()].wait_mask, 1u << combine);
      EXPECT_EQ(both[moe.size() + 1].wait_mask, 1u << combine);
      EXPECT_EQ(both.back().wait_mask, front.back().wait_mask << moe.size());
      auto plan = plan_program(both, 8, 7);
      ASSERT_TRUE(plan.ok()) << plan.status().message();
      ASSERT_TRUE(run_program_ref(*plan, 6, 3).ok());
      // Without the wait on the combine the front would read delta_out too early: refused.
      both[moe.size()].wait_mask = 0;
      EXPECT_FALSE(plan_program(both, 8, 7).ok());
    } else {
      auto a = plan_program(moe, 8, 7), b = plan_program(front, 8, 7);
      ASSERT_TRUE(a.ok() && b.ok());
      ASSERT_TRUE(run_program_ref(*a, 6, 3).ok());
      ASSERT_TRUE(run_program_ref(*b, 6, 3).ok());
    }
  }
  for (int64_t i = 0; i < 6 * heads * head; ++i) ASSERT_EQ(q[0][i], q[1][i]) << "q " << i;
  for (int64_t i = 0; i < 6 * width; ++i) ASSERT_EQ(kv[0][i], kv[1][i]) << "kv_a " << i;
  EXPECT_EQ(cache[0], cache[1]);
  for (int64_t i = 0; i < 6 * H; ++i) ASSERT_EQ(res2[0][i], res2[1][i]) << "residual " << i;
}

// join_programs moves the second program's waits and route table past the
// first's stages: two MoE blocks one after the other (the second reading the
// first's residual and output) as one program compute what the two compute,
// and more than kMaxStages stages are refused.
TEST(MonoProgram, JoinedProgramsEqualTheTwoInTurn) {
  MoeChain sc = tiny_like_moe();
  sc.slots = 8;
  const int64_t H = sc.hidden;
  std::vector<uint16_t> out[2];
  std::vector<float> res[2];
  for (int joined = 0; joined < 2; ++joined) {
    HostMoe a(sc, 51), b(sc, 52);
    b.c.residual = a.c.residual_out;  // the second block reads the first's residual and output
    b.c.delta = a.c.delta_out;
    const std::vector<Stage> first = moe_chain_stages(a.c, 16), second = moe_chain_stages(b.c, 16);
    if (joined) {
      const std::vector<Stage> both = join_programs(first, second);
      for (size_t i = 0; i < second.size(); ++i) {
        const Stage& st = both[first.size() + i];
        if (second[i].route_stage >= 0) {
          EXPECT_EQ(st.route_stage, second[i].route_stage + static_cast<int32_t>(first.size()));
        }
        if (second[i].wait_mask == 0) {
          EXPECT_EQ(st.wait_mask, 1u << (first.size() - 1)) << "stage " << i;
        }
      }
      auto plan = plan_program(both, 8, 9);
      ASSERT_TRUE(plan.ok()) << plan.status().message();
      ASSERT_TRUE(run_program_ref(*plan, 7, 5).ok());
      // Three blocks are more stages than a program holds.
      EXPECT_FALSE(check_program(join_programs(both, second), 8).ok());
    } else {
      auto p1 = plan_program(first, 8, 9), p2 = plan_program(second, 8, 9);
      ASSERT_TRUE(p1.ok() && p2.ok());
      ASSERT_TRUE(run_program_ref(*p1, 7, 5).ok());
      ASSERT_TRUE(run_program_ref(*p2, 7, 5).ok());
    }
    out[joined].assign(b.c.delta_out, b.c.delta_out + 7 * H);
    res[joined].assign(b.c.residual_out, b.c.residual_out + 7 * H);
  }
  for (int64_t i = 0; i < 7 * H; ++i) ASSERT_EQ(out[0][i], out[1][i]) << "delta " << i;
  for (int64_t i = 0; i < 7 * H; ++i) ASSERT_EQ(res[0][i], res[1][i]) << "residual " << i;
}

// A slotted stage's slots lie one after another or side by side in each
// row, never overlapping: side by side, each slot's columns within its slot
// stride and the last slot within the row (review of session 23: the checker
// had no test refusing overlapping slots).
TEST(MonoProgram, SlotsSideBySideMustNotOverlap) {
  std::vector<uint16_t> w(4 * 64 * 32, 0), x(8 * 4 * 48, 0), out(8 * 4 * 80 + 1024, 0);
  auto check = [&](int64_t out_slot_stride, int64_t out_stride, int64_t x_slot_stride, int64_t x_stride) {
    Stage s;  // 4 slots of 64 columns, k 32
    s.w = w.data();
    s.n = 64;
    s.k = 32;
    s.x = x.data();
    s.x_stride = x_stride;
    s.slots = 4;
    s.expert_stride = 64 * 32;
    s.x_slot_stride = x_slot_stride;
    s.out = out.data();
    s.out_stride = out_stride;
    s.out_slot_stride = out_slot_stride;
    s.tile = 16;
    return check_program({s}, 8).ok();
  };
  EXPECT_TRUE(check(80, 4 * 80, 48, 4 * 48));         // side by side
  EXPECT_TRUE(check(8 * 80, 80, 8 * 48, 48));         // one after another
  EXPECT_FALSE(check(56, 4 * 80, 48, 4 * 48));        // out slots narrower than their 64 columns
  EXPECT_FALSE(check(80, 300, 48, 4 * 48));           // the last out slot past the row (3 * 80 + 64 > 300)
  EXPECT_FALSE(check(80, 4 * 80, 24, 4 * 48));        // x slots narrower than k
  EXPECT_FALSE(check(80, 4 * 80, 48, 3 * 48 + 16));   // the last x slot past the row
}

// The engine's joined program: a MoE block whose combine copies the new
// residual back into the graph's one residual buffer, then the next layer's
// front with a q LoRA and the query absorption, reading and updating that
// buffer in place, as one program computes what the two compute in turn, bit
// for bit (the layout front_program_cuda / moe_program_cuda build).
TEST(MonoProgram, EngineLayoutJoinedWithTheAbsorption) {
  MoeChain sc = tiny_like_moe();
  sc.slots = 8;
  const int64_t H = sc.hidden, heads = 2, nope = 16, rope_dim = 16, lora = 32, head = nope + rope_dim;
  const int64_t width = lora + rope_dim, slots = 16, q_lora = 32;
  RopeParams rp;
  rp.rope_dim = rope_dim;
  const RopeTable table = make_rope_table(rp, 1 << 12);
  const std::vector<uint16_t> w_qa = random_bf16(q_lora * H, 0.3f, 7), w_qb = random_bf16(heads * head * q_lora, 0.3f, 8);
  const std::vector<float> q_a_norm = random_f32(q_lora, 0.5f, 1.5f, 9);
  const std::vector<uint16_t> w_uk_t = random_bf16(heads * lora * nope, 0.3f, 10), w_kva = random_bf16(width * H, 0.3f, 2);
  const std::vector<float> input_norm = random_f32(H, 0.5f, 1.5f, 3), kv_norm = random_f32(lora, 0.5f, 1.5f, 4);
  const std::vector<int32_t> positions = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<int64_t> slot_mapping = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<uint16_t> q[2], q_full[2], kv[2], cache[2], q_a[2];
  std::vector<float> res[2], scratch[2];
  for (int joined = 0; joined < 2; ++joined) {
    HostMoe m(sc, 41);
    m.c.residual_copy_to = m.residual.data();  // the graph's residual, updated in place
    q[joined].assign(8 * heads * head, kNanBf16);
    q_full[joined].assign(8 * heads * width, kNanBf16);
    q_a[joined].assign(8 * q_lora, kNanBf16);
    kv[joined].assign(8 * width, kNanBf16);
    cache[joined].assign(slots * width, kNanBf16);
    scratch[joined].assign(8 * H, NAN);
    FrontChain f;
    f.hidden = H;
    f.num_heads = heads;
    f.qk_nope = nope;
    f.qk_rope = rope_dim;
    f.kv_lora = lora;
    f.q_lora = q_lora;
    f.w_qa = w_qa.data();
    f.w_qb = w_qb.data();
    f.q_a_norm = q_a_norm.data();
    f.q_a = q_a[joined].data();
    f.w_kva = w_kva.data();
    f.input_norm = input_norm.data();
    f.kv_norm = kv_norm.data();
    f.inv_freq = table.inv_freq.data();
    f.residual = m.residual.data();
    f.delta = m.c.delta_out;
    f.residual_out = scratch[joined].data();
    f.residual_copy_to = m.residual.data();
    f.q = q[joined].data();
    f.kv_a = kv[joined].data();
    f.positions = positions.data();
    f.slot_mapping = slot_mapping.data();
    f.cache = cache[joined].data();
    f.num_slots = slots;
    f.w_uk_t = w_uk_t.data();
    f.q_full = q_full[joined].data();
    const std::vector<Stage> moe = moe_chain_stages(m.c, 16), front = front_chain_stages(f, 16);
    if (joined) {
      auto plan = plan_program(join_programs(moe, front), 8, 7);
      ASSERT_TRUE(plan.ok()) << plan.status().message();
      ASSERT_TRUE(run_program_ref(*plan, 6, 3).ok());
    } else {
      auto a = plan_program(moe, 8, 7), b = plan_program(front, 8, 7);
      ASSERT_TRUE(a.ok()) << a.status().message();
      ASSERT_TRUE(b.ok()) << b.status().message();
      ASSERT_TRUE(run_program_ref(*a, 6, 3).ok());
      ASSERT_TRUE(run_program_ref(*b, 6, 3).ok());
    }
    res[joined].assign(m.residual.begin(), m.residual.begin() + 6 * H);
  }
  EXPECT_EQ(q[0], q[1]);
  EXPECT_EQ(q_full[0], q_full[1]);
  EXPECT_NE(q_full[1][0], kNanBf16) << "the absorbed query was not written";
  EXPECT_EQ(kv[0], kv[1]);
  EXPECT_EQ(cache[0], cache[1]);
  for (int64_t i = 0; i < 6 * H; ++i) ASSERT_EQ(res[0][i], res[1][i]) << "residual " << i;
}

TEST(MonoProgram, MoePlanRefusesTooFewSlotsAndUnwaitedTables) {
  MoeChain sc = v2_lite_like_moe();
  sc.slots = 8 * 6;
  HostMoe m(sc, 5);
  const std::vector<Stage> ok = moe_chain_stages(m.c, 16);
  ASSERT_TRUE(plan_program(ok, 8, 132).ok());
  m.c.slots = 47;  // 8 rows of top-6 can choose 48 experts
  auto plan = plan_program(moe_chain_stages(m.c, 16), 8, 132);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("47 slots, but 8 rows of top-6 routing can choose 48"), std::string::npos)
      << plan.status().message();
  EXPECT_TRUE(plan_program(moe_chain_stages(m.c, 16), 4, 132).ok());  // 4 rows choose at most 24
  std::vector<Stage> st = ok;
  st[4].wait_mask = 0;  // routed up: no wait for the table
  plan = plan_program(st, 8, 132);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("stage 4: route_stage = 1: must be an earlier kSelect stage named in "
                                         "wait_mask"),
            std::string::npos)
      << plan.status().message();
  st = ok;
  st[1].num_experts = 400;
  EXPECT_FALSE(plan_program(st, 8, 132).ok());  // above kMaxExperts
  st = ok;
  st[1].top_k = 9;  // 8 rows x 9 > 64 slots of a table
  EXPECT_FALSE(plan_program(st, 8, 132).ok());
}

// Stage::x_reuse: the kernel keeps x from an earlier stage only where the
// planner found the same inputs and no writer of them in between.
TEST(MonoProgram, PlanMarksWhereXMayBeKept) {
  MoeChain sc = v2_lite_like_moe();
  sc.slots = 48;
  HostMoe m(sc, 9);
  auto plan = plan_program(moe_chain_stages(m.c, 16), 8, 132);
  ASSERT_TRUE(plan.ok());
  // router 0, select 1, shared up 2, shared down 3, routed up 4, routed down 5, combine 6
  EXPECT_EQ(plan->stages[2].x_reuse, 1u << 0);               // the router's add + RMSNorm
  EXPECT_EQ(plan->stages[4].x_reuse, (1u << 0) | (1u << 2));  // ... and the shared up's
  EXPECT_EQ(plan->stages[3].x_reuse, 0u);
  EXPECT_EQ(plan->stages[5].x_reuse, 0u);  // routed kLoad: x differs by slot
  // Stage 0 reads A, stage 1 rewrites A, stage 2 reads A again: stage 2 must build its own x.
  std::vector<uint16_t> w(64 * 64, 0x3f80), a(8 * 64, 0x3f80), c(8 * 64, 0x3f80), o0(8 * 64), o2(8 * 64);
  Stage s0;
  s0.w = w.data();
  s0.n = 64;
  s0.k = 64;
  s0.x = a.data();
  s0.x_stride = 64;
  s0.out = o0.data();
  s0.out_stride = 64;
  s0.tile = 16;
  Stage s1 = s0;
  s1.x = c.data();
  s1.out = a.data();
  s1.wait_mask = 1u << 0;
  Stage s2 = s0;
  s2.out = o2.data();
  s2.wait_mask = 1u << 1;
  plan = plan_program({s0, s1, s2}, 8, 2);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_EQ(plan->stages[2].x_reuse, 0u);
  std::vector<uint16_t> o1(8 * 64);
  s1.out = o1.data();  // stage 1 now writes elsewhere: A is unchanged and stage 2 may keep stage 0's x
  plan = plan_program({s0, s1, s2}, 8, 2);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_EQ(plan->stages[2].x_reuse, 1u << 0);
}

}  // namespace
}  // namespace nucleus::kernels::mono
