// The decode-program kernel (kernels/mono/mono_kernel.cuh) against the CPU
// reference (run_program_ref), on the layer chain of mono_program_ref.h:
//  - DeepSeek-V2-Lite's shapes at widths 1, 2, 4 and 8, full and partial
//    rows (pad rows must stay untouched), tiles of 16 and 64 columns, one CTA
//    per SM;
//  - a small chain with tiles off the 16-row groups and more CTAs than jobs
//    (empty queues);
//  - launches in a row give the same bits (fixed-order sums; the counters
//    reset themselves), also replayed from a CUDA graph;
//  - launched as a programmatic dependent (PDL) of the kernel that writes its
//    delta over a NaN-poisoned buffer: the compute warps read activations only
//    after that kernel has finished;
//  - x of the widest k (8192);
//  - the MoE block (router, route table, shared and routed experts, combine)
//    at DeepSeek-V2-Lite's shapes and routing, and V3's routing (noaux_tc,
//    256 experts in 8 groups) at smaller widths: the route table equals the
//    reference router's on the kernel's logits, the output is close to the
//    CPU block for that routing; repeated launches give the same bits;
//  - the engine's weight layout: each expert through a table of pointers
//    (stored out of order), two shared pieces, the residual copied back;
//  - a two-layer program whose second layer's x comes from buffers the first
//    rewrites (the x kept in shared memory must not be reused across them);
//  - the layer front (add + norm, q_proj or V3's q LoRA, kv_a, RoPE with the
//    latent cache write, the residual copied back) at V2-Lite's shapes: q, kv_a, the
//    cache rows of the rows' slots (none for slot -1, nothing else written);
//  - the query absorption (W_UK per head, slots side by side in each row),
//    the attention output (the KV-split merge, W_UV per head) and the
//    attention itself over a paged cache (kAttend) before them;
//  - the refusals (width 3, rows above the width, more CTAs than SMs).
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <random>
#include <tuple>

#include "core/cuda/context.h"
#include "core/device.h"
#include "gpu_test_util.h"
#include "kernels/common/device_sms.h"
#include "kernels/mono/mono_kernel.cuh"
#include "kernels/mono/mono_program_ref.h"
#include "kernels/activation/silu_mul_ref.h"
#include "kernels/gemm/gemm_ref.h"
#include "kernels/moe/moe_ref.h"
#include "kernels/rmsnorm/rmsnorm.cuh"
#include "kernels/rmsnorm/rmsnorm_ref.h"
#include "kernels/rope/rope_ref.h"

namespace nucleus::kernels::mono {
namespace {

using testing::all_close;
using testing::device_copy;
using testing::from_bf16;
using testing::host_copy;

class MonoKernelGpu : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device"; }
};

// A device buffer of `count` elements of 0xff bytes: NaN in f32 and bf16.
Tensor nan_filled(int64_t count, DType dtype) {
  Tensor t = Tensor::empty({count}, dtype, Device::kCuda);
  std::vector<uint8_t> bytes(t.nbytes(), 0xff);
  copy_to_device(t.raw(), bytes.data(), bytes.size());
  return t;
}

std::vector<uint16_t> random_bf16(size_t n, float scale, uint64_t seed) {
  return testing::to_bf16(testing::random_bf16_values(n, scale, seed));
}
std::vector<float> random_f32(size_t n, float lo, float hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// One chain on the host (for the reference) and on the device, 8 rows of
// every activation.
// e4m3 codes and 128 x 128 block scales of an [n, k] weight of RMS about
// `rms` (DeepSeek-V3's FP8 layout).
struct Fp8Weight {
  std::vector<uint8_t> q;
  std::vector<float> scale;
  Fp8Weight() = default;
  Fp8Weight(int64_t n, int64_t k, float rms, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const int64_t kb = (k + 127) / 128;
    scale.resize(static_cast<size_t>((n + 127) / 128 * kb));
    for (auto& sc : scale) sc = rms / 160.0f * (1.0f + 0.5f * u(rng));
    q.resize(static_cast<size_t>(n * k));
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c)
        q[r * k + c] = f32_to_fp8e4m3(1.7f * rms * u(rng) / scale[(r / 128) * kb + c / 128]);
  }
};

struct Chain {
  int64_t H, front_n, o_k, inter;
  bool fp8 = false;  // e4m3 weights with block scales (w8_*)
  // Host inputs and reference outputs.
  std::vector<uint16_t> w_front, w_o, w_gate_up, w_down, delta_in;
  Fp8Weight w8_front, w8_o, w8_gate_up, w8_down;
  Tensor d_s_front, d_s_o, d_s_gate_up, d_s_down;  // the device scales (fp8)
  std::vector<float> input_norm, post_norm, residual_in;
  std::vector<float> h_residual_mid, h_residual_out;
  std::vector<uint16_t> h_front, h_o, h_h, h_delta_out;
  // Device copies.
  Tensor d_w_front, d_w_o, d_w_gate_up, d_w_down, d_delta_in, d_input_norm, d_post_norm, d_residual_in;
  Tensor d_residual_mid, d_residual_out, d_front, d_o, d_h, d_delta_out;

  Chain(int64_t hidden, int64_t front_n_, int64_t o_k_, int64_t inter_, uint64_t seed, bool fp8_ = false)
      : H(hidden), front_n(front_n_), o_k(o_k_), inter(inter_), fp8(fp8_) {
    auto scale = [](int64_t k) { return 1.7f / std::sqrt(static_cast<float>(k)); };
    w_front = random_bf16(front_n * H, scale(H), seed + 1);
    w_o = random_bf16(H * o_k, scale(o_k), seed + 2);
    w_gate_up = random_bf16(2 * inter * H, scale(H), seed + 3);
    w_down = random_bf16(H * inter, scale(inter), seed + 4);
    delta_in = random_bf16(8 * H, 1.0f, seed + 5);
    input_norm = random_f32(H, 0.5f, 1.5f, seed + 6);
    post_norm = random_f32(H, 0.5f, 1.5f, seed + 7);
    residual_in = random_f32(8 * H, -2.0f, 2.0f, seed + 8);
    d_w_front = device_copy(w_front, DType::kBF16);
    d_w_o = device_copy(w_o, DType::kBF16);
    d_w_gate_up = device_copy(w_gate_up, DType::kBF16);
    d_w_down = device_copy(w_down, DType::kBF16);
    if (fp8) {
      w8_front = Fp8Weight(front_n, H, scale(H), seed + 11);
      w8_o = Fp8Weight(H, o_k, scale(o_k), seed + 12);
      w8_gate_up = Fp8Weight(2 * inter, H, scale(H), seed + 13);
      w8_down = Fp8Weight(H, inter, scale(inter), seed + 14);
      d_w_front = device_copy(w8_front.q, DType::kF8E4M3);
      d_w_o = device_copy(w8_o.q, DType::kF8E4M3);
      d_w_gate_up = device_copy(w8_gate_up.q, DType::kF8E4M3);
      d_w_down = device_copy(w8_down.q, DType::kF8E4M3);
      d_s_front = device_copy(w8_front.scale, DType::kF32);
      d_s_o = device_copy(w8_o.scale, DType::kF32);
      d_s_gate_up = device_copy(w8_gate_up.scale, DType::kF32);
      d_s_down = device_copy(w8_down.scale, DType::kF32);
    }
    d_delta_in = device_copy(delta_in, DType::kBF16);
    d_input_norm = device_copy(input_norm, DType::kF32);
    d_post_norm = device_copy(post_norm, DType::kF32);
    d_residual_in = device_copy(residual_in, DType::kF32);
    poison();
  }
  // NaN in every output, host and device.
  void poison() {
    h_residual_mid.assign(8 * H, NAN);
    h_residual_out.assign(8 * H, NAN);
    h_front.assign(8 * front_n, 0x7fc0);
    h_o.assign(8 * H, 0x7fc0);
    h_h.assign(8 * inter, 0x7fc0);
    h_delta_out.assign(8 * H, 0x7fc0);
    d_residual_mid = nan_filled(8 * H, DType::kF32);
    d_residual_out = nan_filled(8 * H, DType::kF32);
    d_front = nan_filled(8 * front_n, DType::kBF16);
    d_o = nan_filled(8 * H, DType::kBF16);
    d_h = nan_filled(8 * inter, DType::kBF16);
    d_delta_out = nan_filled(8 * H, DType::kBF16);
  }
  LayerChain host_chain() {
    LayerChain c{H, front_n, o_k, inter};
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
    c.residual_mid = h_residual_mid.data();
    c.residual_out = h_residual_out.data();
    c.front = h_front.data();
    c.o = h_o.data();
    c.h = h_h.data();
    c.delta_out = h_delta_out.data();
    return c;
  }
  LayerChain device_chain() {
    LayerChain c{H, front_n, o_k, inter};
    c.w_front = d_w_front.raw();
    c.w_o = d_w_o.raw();
    c.w_gate_up = d_w_gate_up.raw();
    c.w_down = d_w_down.raw();
    if (fp8) {
      c.front_scale = d_s_front.data<float>();
      c.o_scale = d_s_o.data<float>();
      c.gate_up_scale = d_s_gate_up.data<float>();
      c.down_scale = d_s_down.data<float>();
    }
    c.input_norm = d_input_norm.data<float>();
    c.post_norm = d_post_norm.data<float>();
    c.residual_in = d_residual_in.data<float>();
    c.delta_in = d_delta_in.data<uint16_t>();
    c.residual_mid = d_residual_mid.data<float>();
    c.residual_out = d_residual_out.data<float>();
    c.front = d_front.data<uint16_t>();
    c.o = d_o.data<uint16_t>();
    c.h = d_h.data<uint16_t>();
    c.delta_out = d_delta_out.data<uint16_t>();
    return c;
  }
};

// A plan's queues and counters on the device.
struct DevicePlan {
  ProgramPlan plan;
  Tensor queue_start, jobs, counters;
  explicit DevicePlan(ProgramPlan p) : plan(std::move(p)) {
    queue_start = device_copy(plan.queue_start, DType::kI32);
    std::vector<int32_t> flat;
    for (const Job& j : plan.jobs) flat.insert(flat.end(), {j.stage, j.tile});
    jobs = device_copy(flat, DType::kI32);
    counters = Tensor::empty({kMaxStages + 1}, DType::kI32, Device::kCuda);
    zero_device(counters);
  }
  Program program(int32_t rows) {
    return program_view(plan, rows, queue_start.data<int32_t>(), static_cast<const Job*>(jobs.raw()),
                        counters.data<int32_t>());
  }
};

// The full build (NUCLEUS_DECODE_PROGRAM_LEAN=0) and the fence + atomic
// counters (NUCLEUS_DECODE_PROGRAM_RELEASE=0) give the default's bits `want`
// in `out` (poisoned before each launch) and leave the counters at zero.
void expect_switches_keep_bits(DevicePlan& dp, int32_t rows, const Tensor& out, const std::vector<uint16_t>& want) {
  cudaStream_t stream = cuda::context().stream;
  for (int v = 0; v < 2; ++v) {
    Program other = dp.program(rows);
    (v == 0 ? other.lean : other.release_counters) = false;
    ASSERT_EQ(cudaMemsetAsync(out.raw(), 0xff, out.nbytes(), stream), cudaSuccess);  // NaN
    ASSERT_EQ(launch_mono_program(other, stream, false), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(host_copy<uint16_t>(out), want) << (v == 0 ? "the full build" : "fence counters");
    EXPECT_EQ(host_copy<int32_t>(dp.counters), std::vector<int32_t>(kMaxStages + 1, 0));
  }
}

std::vector<float> widen(const std::vector<float>& v) { return v; }
std::vector<float> widen(const std::vector<uint16_t>& v) { return from_bf16(v); }

// The first rows * cols values of got (device) against want (host), bf16
// tolerance scaled by want's RMS; the pad rows still hold the poison.
template <typename T>
::testing::AssertionResult rows_close(const Tensor& got_t, const std::vector<T>& want_h, int64_t rows, int64_t cols,
                                      const char* what) {
  const std::vector<float> got = widen(host_copy<T>(got_t)), want = widen(want_h);
  double ss = 0;
  for (int64_t i = 0; i < rows * cols; ++i) ss += double{want[i]} * want[i];
  const auto rms = static_cast<float>(std::sqrt(ss / static_cast<double>(rows * cols)));
  auto r = all_close({got.begin(), got.begin() + rows * cols}, {want.begin(), want.begin() + rows * cols},
                     0.03f * rms, 0.02f, cols);
  if (!r) return r << " (" << what << ")";
  for (int64_t i = rows * cols; i < 8 * cols; ++i)
    if (!std::isnan(got[i])) return ::testing::AssertionFailure() << what << ": pad row " << i / cols << " written";
  return ::testing::AssertionSuccess();
}

void expect_chain_matches(Chain& c, int32_t rows, const char* when) {
  SCOPED_TRACE(when);
  EXPECT_TRUE(rows_close(c.d_residual_mid, c.h_residual_mid, rows, c.H, "residual_mid"));
  EXPECT_TRUE(rows_close(c.d_front, c.h_front, rows, c.front_n, "front"));
  EXPECT_TRUE(rows_close(c.d_o, c.h_o, rows, c.H, "o"));
  EXPECT_TRUE(rows_close(c.d_residual_out, c.h_residual_out, rows, c.H, "residual_out"));
  EXPECT_TRUE(rows_close(c.d_h, c.h_h, rows, c.inter, "h"));
  EXPECT_TRUE(rows_close(c.d_delta_out, c.h_delta_out, rows, c.H, "delta_out"));
}

void run_case(Chain& c, int32_t width, int32_t rows, int32_t tile, int32_t ctas) {
  SCOPED_TRACE(::testing::Message() << "width " << width << ", rows " << rows << ", tile " << tile << ", " << ctas
                                  << " CTAs");
  c.poison();
  auto host_plan = plan_program(layer_chain_stages(c.host_chain(), tile), width, ctas);
  ASSERT_TRUE(host_plan.ok()) << host_plan.status().message();
  ASSERT_TRUE(run_program_ref(*host_plan, rows, 7).ok());
  auto plan = plan_program(layer_chain_stages(c.device_chain(), tile), width, ctas);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  DevicePlan dp(std::move(*plan));
  cudaStream_t stream = cuda::context().stream;
  ASSERT_EQ(launch_mono_program(dp.program(rows), stream, false), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  expect_chain_matches(c, rows, "first launch");
  // Again, twice: the counters were left at zero and the sums are in a fixed order.
  const std::vector<uint16_t> first = host_copy<uint16_t>(c.d_delta_out), front = host_copy<uint16_t>(c.d_front);
  ASSERT_EQ(launch_mono_program(dp.program(rows), stream, false), cudaSuccess);
  ASSERT_EQ(launch_mono_program(dp.program(rows), stream, true), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(host_copy<uint16_t>(c.d_delta_out), first);
  EXPECT_EQ(host_copy<uint16_t>(c.d_front), front);
  EXPECT_EQ(host_copy<int32_t>(dp.counters), std::vector<int32_t>(kMaxStages + 1, 0));
}

TEST_F(MonoKernelGpu, V2LiteChainMatchesTheReference) {
  Chain c(2048, 3072 + 576, 2048, 2 * 1408, 101);
  const int32_t sms = current_device_sms();
  struct Case {
    int32_t width, rows;
  };
  for (const Case k : {Case{1, 1}, Case{2, 2}, Case{4, 3}, Case{8, 8}, Case{8, 5}})
    for (int32_t tile : {16, 64}) run_case(c, k.width, k.rows, tile, sms);
}

TEST_F(MonoKernelGpu, SmallChainOffTheGroupsAndIdleCtas) {
  Chain c(64, 96, 64, 48, 202);
  for (int32_t tile : {7, 16, 40}) {
    run_case(c, 8, 8, tile, 5);
    run_case(c, 4, 2, tile, current_device_sms());  // more CTAs than jobs: empty queues
  }
}

// e4m3 weights with 128 x 128 block scales (WeightType::kFp8Block): the
// kernel's in-register conversion, its k order within a step (the same
// permutation on both operands) and its per-block scaling against the
// reference's dequantized weights, at DeepSeek-V3 TP 8-like shapes (hidden
// 7168, a q LoRA-sized front, an expert of 2048) and a small chain whose
// front has a partial scale block of rows and whose down projection a partial
// block of k (192).
TEST_F(MonoKernelGpu, Fp8BlockScaledChainMatchesTheReference) {
  const int32_t sms = current_device_sms();
  Chain big(7168, 1536 + 576, 2048, 2048, 707, /*fp8=*/true);
  for (const auto& [width, rows] : {std::pair{1, 1}, std::pair{4, 3}, std::pair{8, 8}})
    for (int32_t tile : {16, 64}) run_case(big, width, rows, tile, sms);
  Chain small(256, 160, 128, 192, 708, /*fp8=*/true);  // down: k 192, a partial scale block
  run_case(small, 8, 5, 16, 7);
  run_case(small, 2, 2, 32, sms);
}

// x past kMaxK (x_from_global): o_proj reading 16,384 values a row (DeepSeek-V3
// at TP 1) straight from global memory in the MMA loop, bf16 and e4m3, full
// and partial rows (the rows past `rows` are never read there).
TEST_F(MonoKernelGpu, XPastTheSharedMemoryFromGlobal) {
  const int32_t sms = current_device_sms();
  for (bool fp8 : {false, true}) {
    SCOPED_TRACE(fp8 ? "e4m3" : "bf16");
    Chain c(1024, 16384, 16384, 512, fp8 ? 910 : 909, fp8);
    run_case(c, 1, 1, 16, sms);
    run_case(c, 8, 5, 64, sms);
    run_case(c, 4, 4, 16, sms);
  }
}

// The benchmark's diagnostic copy path (MonoProbe::cp_async: 16-byte
// cp.async by every lane of the copy warp), a ring of 2 slots, the fence +
// atomic counters (Program::release_counters false) and the full build
// (Program::lean false, against the bf16 and the FP8 GEMV-only builds) give
// the default path's bits.
TEST_F(MonoKernelGpu, ProbeCopyPathsGiveTheSameBits) {
  Chain c(2048, 3648, 2048, 2816, 919);
  auto plan = plan_program(layer_chain_stages(c.device_chain(), 16), 8, current_device_sms());
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  DevicePlan dp(std::move(*plan));
  cudaStream_t stream = cuda::context().stream;
  ASSERT_EQ(launch_mono_program(dp.program(6), stream, false), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const std::vector<uint16_t> want = host_copy<uint16_t>(c.d_delta_out);
  for (const MonoProbe probe : {MonoProbe{false, true, 0}, MonoProbe{false, false, 2}, MonoProbe{false, true, 3}}) {
    SCOPED_TRACE(::testing::Message() << "cp_async " << probe.cp_async << ", max_slots " << probe.max_slots);
    ASSERT_EQ(cudaMemsetAsync(c.d_delta_out.raw(), 0xff, c.d_delta_out.nbytes(), stream), cudaSuccess);  // NaN
    ASSERT_EQ(launch_mono_program(dp.program(6), stream, false, probe), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(host_copy<uint16_t>(c.d_delta_out), want);
  }
  expect_switches_keep_bits(dp, 6, c.d_delta_out, want);
  // FP8 weights (1,024-byte rows a chunk) through the 16-byte copies, the full build and the fence counters.
  Chain f(2048, 2112, 2048, 2048, 920, /*fp8=*/true);
  auto fplan = plan_program(layer_chain_stages(f.device_chain(), 16), 4, current_device_sms());
  ASSERT_TRUE(fplan.ok()) << fplan.status().message();
  DevicePlan fdp(std::move(*fplan));
  ASSERT_EQ(launch_mono_program(fdp.program(3), stream, false), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const std::vector<uint16_t> fwant = host_copy<uint16_t>(f.d_delta_out);
  ASSERT_EQ(cudaMemsetAsync(f.d_delta_out.raw(), 0xff, f.d_delta_out.nbytes(), stream), cudaSuccess);
  ASSERT_EQ(launch_mono_program(fdp.program(3), stream, false, MonoProbe{false, true, 0}), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(host_copy<uint16_t>(f.d_delta_out), fwant) << "e4m3, cp.async 16 B";
  expect_switches_keep_bits(fdp, 3, f.d_delta_out, fwant);
  // The copy-only layouts refuse to run a program whose sums they would spoil.
  MonoProbe bad;
  bad.contiguous = true;
  EXPECT_EQ(launch_mono_program(dp.program(6), stream, false, bad), cudaErrorInvalidValue);
}

TEST_F(MonoKernelGpu, WidestX) {  // k = 8192: x takes 131 KB of shared memory, 5 ring slots
  Chain c(8192, 256, 256, 512, 606);
  run_case(c, 8, 8, 16, current_device_sms());
  run_case(c, 1, 1, 32, current_device_sms());
}

// Two layers in one program, the second ping-ponging the first's buffers:
// its input is the first's output, and it rewrites the first's inputs and
// intermediates (front, o, h), so x kept in shared memory from the first
// layer (the same pointers) would be stale.
std::vector<Stage> two_layers(LayerChain c, int32_t tile) {
  std::vector<Stage> st = layer_chain_stages(c, tile);
  LayerChain c2 = c;
  c2.residual_in = c.residual_out;
  c2.delta_in = c.delta_out;
  c2.residual_mid = const_cast<float*>(c.residual_in);
  c2.residual_out = c.residual_mid;
  c2.delta_out = const_cast<uint16_t*>(c.delta_in);
  std::vector<Stage> second = layer_chain_stages(c2, tile);
  for (Stage& s : second) s.wait_mask <<= 4;
  second[0].wait_mask |= 1u << 3;  // after the whole first layer (its stage 3 waited for the rest)
  st.insert(st.end(), second.begin(), second.end());
  return st;
}

TEST_F(MonoKernelGpu, TwoLayersPingPong) {
  for (auto [width, rows] : {std::pair{1, 1}, std::pair{8, 8}}) {
    SCOPED_TRACE(::testing::Message() << "width " << width << ", rows " << rows);
    Chain fresh(2048, 3072 + 576, 2048, 2 * 1408, 909);  // inputs are rewritten: start from new buffers
    auto host_plan = plan_program(two_layers(fresh.host_chain(), 16), width, current_device_sms());
    ASSERT_TRUE(host_plan.ok()) << host_plan.status().message();
    EXPECT_EQ(host_plan->stages[5].x_reuse, 0u);  // layer 2's o_proj reads `front` after layer 2 rewrote it
    auto plan = plan_program(two_layers(fresh.device_chain(), 16), width, current_device_sms());
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    ASSERT_TRUE(run_program_ref(*host_plan, rows, 5).ok());
    DevicePlan dp(std::move(*plan));
    cudaStream_t stream = cuda::context().stream;
    ASSERT_EQ(launch_mono_program(dp.program(rows), stream, false), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    // Layer 2's outputs sit in layer 1's input buffers (residual_in, delta_in) and in residual_mid.
    EXPECT_TRUE(rows_close(fresh.d_residual_out, fresh.h_residual_out, rows, 2048, "layer 1 residual_out"));
    EXPECT_TRUE(rows_close(fresh.d_residual_mid, fresh.h_residual_mid, rows, 2048, "layer 2 residual_out"));
    EXPECT_TRUE(rows_close(fresh.d_front, fresh.h_front, rows, 3072 + 576, "layer 2 front"));
    EXPECT_TRUE(rows_close(fresh.d_h, fresh.h_h, rows, 2 * 1408, "layer 2 h"));
    const std::vector<uint16_t> got = host_copy<uint16_t>(fresh.d_delta_in);
    std::vector<float> g(rows * 2048), w(rows * 2048);
    for (int64_t i = 0; i < rows * 2048; ++i) {
      g[i] = bf16_to_f32(got[i]);
      w[i] = bf16_to_f32(fresh.delta_in[i]);
    }
    double ss = 0;
    for (float v : w) ss += double{v} * v;
    EXPECT_TRUE(all_close(g, w, 0.03f * static_cast<float>(std::sqrt(ss / w.size())), 0.02f, 2048))
        << "layer 2 delta_out";
  }
}

TEST_F(MonoKernelGpu, GraphReplayEqualsEager) {
  Chain c(2048, 3072 + 576, 2048, 2 * 1408, 303);
  auto plan = plan_program(layer_chain_stages(c.device_chain(), 16), 4, current_device_sms());
  ASSERT_TRUE(plan.ok());
  DevicePlan dp(std::move(*plan));
  cudaStream_t stream = cuda::context().stream;
  ASSERT_EQ(launch_mono_program(dp.program(4), stream, false), cudaSuccess);
  const std::vector<uint16_t> eager = host_copy<uint16_t>(c.d_delta_out);
  c.poison();
  LayerChain dc = c.device_chain();
  auto replan = plan_program(layer_chain_stages(dc, 16), 4, current_device_sms());
  ASSERT_TRUE(replan.ok());
  DevicePlan dp2(std::move(*replan));
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  ASSERT_EQ(launch_mono_program(dp2.program(4), stream, false), cudaSuccess);
  ASSERT_EQ(launch_mono_program(dp2.program(4), stream, true), cudaSuccess);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(host_copy<uint16_t>(c.d_delta_out), eager);
  EXPECT_EQ(host_copy<int32_t>(dp2.counters), std::vector<int32_t>(kMaxStages + 1, 0));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_F(MonoKernelGpu, ProgrammaticDependentReadsAfterTheWriter) {
  // delta_in is written by an RMSNorm kernel (which lets dependents start at
  // once) over NaN; the program launched as its dependent must see the values.
  Chain c(2048, 3072 + 576, 2048, 2 * 1408, 404);
  const std::vector<float> src = random_f32(8 * 2048, -1.0f, 1.0f, 9);
  std::vector<float> ones(2048, 1.0f);
  // What the norm writes, computed on the GPU first (eagerly) and then used as the reference's delta_in.
  Tensor d_src = device_copy(src, DType::kF32), d_ones = device_copy(ones, DType::kF32);
  cudaStream_t stream = cuda::context().stream;
  Tensor written = nan_filled(8 * 2048, DType::kBF16);
  ASSERT_EQ(launch_rmsnorm_f32_to_bf16(d_src.data<float>(), 2048, d_ones.data<float>(), 8, 2048, 2048, 1e-6f,
                                       written.data<__nv_bfloat16>(), 2048, stream),
            cudaSuccess);
  c.delta_in = host_copy<uint16_t>(written);
  c.d_delta_in = nan_filled(8 * 2048, DType::kBF16);
  auto host_plan = plan_program(layer_chain_stages(c.host_chain(), 16), 8, current_device_sms());
  ASSERT_TRUE(host_plan.ok());
  ASSERT_TRUE(run_program_ref(*host_plan, 8, 3).ok());
  auto plan = plan_program(layer_chain_stages(c.device_chain(), 16), 8, current_device_sms());
  ASSERT_TRUE(plan.ok());
  DevicePlan dp(std::move(*plan));
  ASSERT_EQ(launch_rmsnorm_f32_to_bf16(d_src.data<float>(), 2048, d_ones.data<float>(), 8, 2048, 2048, 1e-6f,
                                       c.d_delta_in.data<__nv_bfloat16>(), 2048, stream),
            cudaSuccess);
  ASSERT_EQ(launch_mono_program(dp.program(8), stream, /*pdl=*/true), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  expect_chain_matches(c, 8, "as a programmatic dependent");
}

TEST_F(MonoKernelGpu, Refusals) {
  Chain c(64, 96, 64, 48, 505);
  auto plan = plan_program(layer_chain_stages(c.device_chain(), 16), 4, 4);
  ASSERT_TRUE(plan.ok());
  DevicePlan dp(std::move(*plan));
  cudaStream_t stream = cuda::context().stream;
  Program p = dp.program(4);
  p.width = 3;
  EXPECT_EQ(launch_mono_program(p, stream, false), cudaErrorInvalidValue);
  p = dp.program(5);  // more rows than the width
  EXPECT_EQ(launch_mono_program(p, stream, false), cudaErrorInvalidValue);
  p = dp.program(4);
  p.num_ctas = current_device_sms() + 1;
  EXPECT_EQ(launch_mono_program(p, stream, false), cudaErrorInvalidValue);
  p = dp.program(4);
  p.counters = nullptr;
  EXPECT_EQ(launch_mono_program(p, stream, false), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// Fast deterministic bf16 fill for the expert weights (hundreds of MB).
std::vector<uint16_t> hashed_bf16(size_t n, float scale, uint64_t seed) {
  std::vector<uint16_t> v(n);
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    z ^= z << 13;
    z ^= z >> 7;
    z ^= z << 17;
    v[i] = f32_to_bf16(scale * (static_cast<float>(z % 20001) / 10000.0f - 1.0f));
  }
  return v;
}

// The MoE block on the host and the device, 8 rows of every activation.
struct Moe {
  MoeChain shape;
  std::vector<uint16_t> w_router, w_gate_up, w_down, w_shared_gate_up, w_shared_down, delta;
  std::vector<float> bias, post_norm, residual;
  // Host outputs (the reference).
  std::vector<float> h_residual_out, h_logits, h_y_shared, h_y;
  std::vector<uint16_t> h_h_shared, h_h, h_delta_out;
  RouteTable h_table;
  // Device copies.
  Tensor d_w_router, d_w_gate_up, d_w_down, d_w_shared_gate_up, d_w_shared_down, d_delta, d_bias, d_post_norm,
      d_residual;
  Tensor d_residual_out, d_logits, d_y_shared, d_y, d_h_shared, d_h, d_delta_out, d_table;

  bool tables = false;
  Tensor d_gu_rev, d_dn_rev, d_gu_table, d_dn_table, d_residual_copy;
  std::vector<float> h_residual_copy;
  // fp8: the experts and shared pieces quantized to e4m3 with 128 x 128 block
  // scales (amax / 448 a block) from the bf16 weights; f_* are the weights
  // the reference multiplies by (widened bf16, or the dequantized e4m3).
  bool fp8 = false;
  std::vector<uint8_t> q_gu, q_dn, q_sgu, q_sdn;
  std::vector<float> s_gu, s_dn, s_sgu, s_sdn, f_gu, f_dn, f_sgu, f_sdn;
  Tensor d_q_gu, d_q_dn, d_q_sgu, d_q_sdn, d_s_gu, d_s_dn, d_s_sgu, d_s_sdn;

  // count [n, k] bf16 weights one after another -> e4m3 codes, their scales and the dequantized values.
  static void quantize(const std::vector<uint16_t>& w, int64_t count, int64_t n, int64_t k, std::vector<uint8_t>& q,
                       std::vector<float>& scale, std::vector<float>& f) {
    const int64_t nb = (n + 127) / 128, kb = (k + 127) / 128;
    q.resize(w.size());
    f.resize(w.size());
    scale.assign(static_cast<size_t>(count * nb * kb), 0.0f);
    for (int64_t e = 0; e < count; ++e) {
      float* sc = scale.data() + e * nb * kb;
      const uint16_t* we = w.data() + e * n * k;
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < k; ++c)
          sc[(r / 128) * kb + c / 128] = std::max(sc[(r / 128) * kb + c / 128], std::fabs(bf16_to_f32(we[r * k + c])));
      for (int64_t b = 0; b < nb * kb; ++b) sc[b] = sc[b] > 0.0f ? sc[b] / 448.0f : 1.0f;
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < k; ++c) {
          const int64_t i = e * n * k + r * k + c;
          const float s = sc[(r / 128) * kb + c / 128];
          q[i] = f32_to_fp8e4m3(bf16_to_f32(w[i]) / s);
          f[i] = fp8e4m3_to_f32(q[i]) * s;
        }
    }
  }

  Moe(MoeChain c, uint64_t seed, bool tables_ = false, bool fp8_ = false) : shape(c), tables(tables_), fp8(fp8_) {
    const int64_t H = c.hidden, E = c.num_experts;
    auto scale = [](int64_t k) { return 1.7f / std::sqrt(static_cast<float>(k)); };
    w_router = hashed_bf16(E * H, 4.0f * scale(H), seed + 1);
    w_gate_up = hashed_bf16(E * 2 * c.inter * H, scale(H), seed + 2);
    w_down = hashed_bf16(E * H * c.inter, scale(c.inter), seed + 3);
    if (c.shared_inter > 0) {
      w_shared_gate_up = hashed_bf16(c.shared_pieces * 2 * c.shared_inter * H, scale(H), seed + 4);
      w_shared_down = hashed_bf16(c.shared_pieces * H * c.shared_inter, scale(c.shared_inter), seed + 5);
    }
    delta = random_bf16(8 * H, 1.0f, seed + 6);
    if (c.method == TopK::kNoauxTc) bias = random_f32(E, -0.1f, 0.1f, seed + 7);
    post_norm = random_f32(H, 0.5f, 1.5f, seed + 8);
    residual = random_f32(8 * H, -2.0f, 2.0f, seed + 9);
    d_w_router = device_copy(w_router, DType::kBF16);
    d_w_gate_up = device_copy(w_gate_up, DType::kBF16);
    d_w_down = device_copy(w_down, DType::kBF16);
    if (tables) {  // the device program reads each expert through a table, stored in reverse order
      const int64_t gu = 2 * c.inter * H, dn = H * c.inter;
      std::vector<uint16_t> gu_rev(w_gate_up.size()), dn_rev(w_down.size());
      for (int64_t e = 0; e < E; ++e) {
        std::copy(w_gate_up.begin() + e * gu, w_gate_up.begin() + (e + 1) * gu, gu_rev.begin() + (E - 1 - e) * gu);
        std::copy(w_down.begin() + e * dn, w_down.begin() + (e + 1) * dn, dn_rev.begin() + (E - 1 - e) * dn);
      }
      d_gu_rev = device_copy(gu_rev, DType::kBF16);
      d_dn_rev = device_copy(dn_rev, DType::kBF16);
      std::vector<uint64_t> gu_ptrs(E), dn_ptrs(E);
      for (int64_t e = 0; e < E; ++e) {
        gu_ptrs[e] = reinterpret_cast<uint64_t>(d_gu_rev.data<uint16_t>() + (E - 1 - e) * gu);
        dn_ptrs[e] = reinterpret_cast<uint64_t>(d_dn_rev.data<uint16_t>() + (E - 1 - e) * dn);
      }
      d_gu_table = device_copy(gu_ptrs, DType::kI64);
      d_dn_table = device_copy(dn_ptrs, DType::kI64);
    }
    if (c.shared_inter > 0) {
      d_w_shared_gate_up = device_copy(w_shared_gate_up, DType::kBF16);
      d_w_shared_down = device_copy(w_shared_down, DType::kBF16);
    }
    f_gu = from_bf16(w_gate_up);
    f_dn = from_bf16(w_down);
    f_sgu = from_bf16(w_shared_gate_up);
    f_sdn = from_bf16(w_shared_down);
    if (fp8) {
      quantize(w_gate_up, E, 2 * c.inter, H, q_gu, s_gu, f_gu);
      quantize(w_down, E, H, c.inter, q_dn, s_dn, f_dn);
      d_q_gu = device_copy(q_gu, DType::kF8E4M3);
      d_q_dn = device_copy(q_dn, DType::kF8E4M3);
      d_s_gu = device_copy(s_gu, DType::kF32);
      d_s_dn = device_copy(s_dn, DType::kF32);
      if (c.shared_inter > 0) {
        quantize(w_shared_gate_up, c.shared_pieces, 2 * c.shared_inter, H, q_sgu, s_sgu, f_sgu);
        quantize(w_shared_down, c.shared_pieces, H, c.shared_inter, q_sdn, s_sdn, f_sdn);
        d_q_sgu = device_copy(q_sgu, DType::kF8E4M3);
        d_q_sdn = device_copy(q_sdn, DType::kF8E4M3);
        d_s_sgu = device_copy(s_sgu, DType::kF32);
        d_s_sdn = device_copy(s_sdn, DType::kF32);
      }
    }
    d_delta = device_copy(delta, DType::kBF16);
    if (!bias.empty()) d_bias = device_copy(bias, DType::kF32);
    d_post_norm = device_copy(post_norm, DType::kF32);
    d_residual = device_copy(residual, DType::kF32);
    poison();
  }
  void poison() {
    const MoeChain& c = shape;
    h_residual_out.assign(8 * c.hidden, NAN);
    h_logits.assign(8 * c.num_experts, NAN);
    h_y_shared.assign(c.shared_pieces * 8 * c.hidden, NAN);
    h_residual_copy.assign(8 * c.hidden, NAN);
    d_residual_copy = nan_filled(8 * c.hidden, DType::kF32);
    h_y.assign(static_cast<size_t>(c.slots) * 8 * c.hidden, NAN);
    h_h_shared.assign(c.shared_pieces * 8 * c.shared_inter, 0x7fc0);
    h_h.assign(static_cast<size_t>(c.slots) * 8 * c.inter, 0x7fc0);
    h_delta_out.assign(8 * c.hidden, 0x7fc0);
    h_table = RouteTable{};
    d_residual_out = nan_filled(8 * c.hidden, DType::kF32);
    d_logits = nan_filled(8 * c.num_experts, DType::kF32);
    d_y_shared = nan_filled(c.shared_pieces * 8 * c.hidden, DType::kF32);
    d_y = nan_filled(int64_t{c.slots} * 8 * c.hidden, DType::kF32);
    d_h_shared = nan_filled(std::max<int64_t>(8, c.shared_pieces * 8 * c.shared_inter), DType::kBF16);
    d_h = nan_filled(int64_t{c.slots} * 8 * c.inter, DType::kBF16);
    d_delta_out = nan_filled(8 * c.hidden, DType::kBF16);
    d_table = nan_filled(static_cast<int64_t>(sizeof(RouteTable) / 4), DType::kI32);
  }
  MoeChain host() {
    MoeChain c = shape;
    c.w_router = w_router.data();
    c.w_gate_up = w_gate_up.data();
    c.w_down = w_down.data();
    c.w_shared_gate_up = w_shared_gate_up.empty() ? nullptr : w_shared_gate_up.data();
    c.w_shared_down = w_shared_down.empty() ? nullptr : w_shared_down.data();
    c.bias = bias.empty() ? nullptr : bias.data();
    c.post_norm = post_norm.data();
    c.residual = residual.data();
    c.delta = delta.data();
    c.residual_out = h_residual_out.data();
    c.logits = h_logits.data();
    c.table = &h_table;
    c.h_shared = c.shared_inter > 0 ? h_h_shared.data() : nullptr;
    c.y_shared = c.shared_inter > 0 ? h_y_shared.data() : nullptr;
    c.h = h_h.data();
    c.y = h_y.data();
    c.delta_out = h_delta_out.data();
    c.residual_copy_to = tables ? h_residual_copy.data() : nullptr;
    if (fp8) {
      c.w_gate_up = q_gu.data();
      c.w_down = q_dn.data();
      c.gate_up_scale = s_gu.data();
      c.down_scale = s_dn.data();
      if (c.shared_inter > 0) {
        c.w_shared_gate_up = q_sgu.data();
        c.w_shared_down = q_sdn.data();
        c.shared_gate_up_scale = s_sgu.data();
        c.shared_down_scale = s_sdn.data();
      }
    }
    return c;
  }
  MoeChain device() {
    MoeChain c = shape;
    c.w_router = d_w_router.data<uint16_t>();
    c.w_gate_up = d_w_gate_up.data<uint16_t>();
    c.w_down = d_w_down.data<uint16_t>();
    c.w_shared_gate_up = c.shared_inter > 0 ? d_w_shared_gate_up.data<uint16_t>() : nullptr;
    c.w_shared_down = c.shared_inter > 0 ? d_w_shared_down.data<uint16_t>() : nullptr;
    c.bias = bias.empty() ? nullptr : d_bias.data<float>();
    c.post_norm = d_post_norm.data<float>();
    c.residual = d_residual.data<float>();
    c.delta = d_delta.data<uint16_t>();
    c.residual_out = d_residual_out.data<float>();
    c.logits = d_logits.data<float>();
    c.table = static_cast<RouteTable*>(d_table.raw());
    c.h_shared = c.shared_inter > 0 ? d_h_shared.data<uint16_t>() : nullptr;
    c.y_shared = c.shared_inter > 0 ? d_y_shared.data<float>() : nullptr;
    c.h = d_h.data<uint16_t>();
    c.y = d_y.data<float>();
    c.delta_out = d_delta_out.data<uint16_t>();
    if (tables) {
      c.w_gate_up = c.w_down = nullptr;
      c.gate_up_table = static_cast<const void* const*>(d_gu_table.raw());
      c.down_table = static_cast<const void* const*>(d_dn_table.raw());
      c.residual_copy_to = d_residual_copy.data<float>();
    }
    if (fp8) {
      c.w_gate_up = d_q_gu.raw();
      c.w_down = d_q_dn.raw();
      c.gate_up_scale = d_s_gu.data<float>();
      c.down_scale = d_s_dn.data<float>();
      if (c.shared_inter > 0) {
        c.w_shared_gate_up = d_q_sgu.raw();
        c.w_shared_down = d_q_sdn.raw();
        c.shared_gate_up_scale = d_s_sgu.data<float>();
        c.shared_down_scale = d_s_sdn.data<float>();
      }
    }
    return c;
  }
};

// The route table moe_route_ref makes of `logits` (the kernel's own logits:
// a near-tie then cannot make the comparison fail for a 1-ulp logit).
RouteTable reference_table(const MoeChain& c, const std::vector<float>& logits, const std::vector<float>& bias,
                           int32_t rows) {
  kernels::MoeRoutingParams p;
  p.scoring = c.scoring == Scoring::kSigmoid ? ScoringFunc::kSigmoid : ScoringFunc::kSoftmax;
  p.method = c.method == TopK::kNoauxTc ? TopkMethod::kNoauxTc : TopkMethod::kGreedy;
  p.num_experts = c.num_experts;
  p.top_k = c.top_k;
  p.n_group = c.n_group;
  p.topk_group = c.topk_group;
  p.norm_topk_prob = c.norm_topk_prob;
  p.routed_scaling_factor = c.routed_scaling_factor;
  std::vector<int32_t> ids(rows * c.top_k);
  std::vector<float> w(ids.size());
  kernels::moe_route_ref(p, logits.data(), bias.empty() ? nullptr : bias.data(), rows, ids.data(), w.data());
  std::vector<int32_t> distinct(ids);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  RouteTable t;
  t.count = static_cast<int32_t>(distinct.size());
  for (int32_t u = 0; u < t.count; ++u) t.expert[u] = distinct[u];
  for (int32_t r = 0; r < rows; ++r)
    for (int32_t j = 0; j < c.top_k; ++j) {
      const auto u = std::lower_bound(distinct.begin(), distinct.end(), ids[r * c.top_k + j]) - distinct.begin();
      t.weight[r][u] = w[r * c.top_k + j];
    }
  return t;
}

// The MoE block's output on the CPU for the routing in `t` (the plain chain's
// rounding points): sum_u weight[r][u] expert_u(x_r) + shared(x_r), to bf16.
std::vector<float> moe_from_table(const Moe& m, const RouteTable& t, int32_t rows) {
  const MoeChain& c = m.shape;
  const int64_t H = c.hidden;
  std::vector<float> res(m.residual.begin(), m.residual.begin() + rows * H), x(rows * H);
  const std::vector<float> delta = from_bf16(m.delta);
  kernels::add_rmsnorm_ref(res.data(), delta.data(), m.post_norm.data(), rows, H, c.eps, x.data());
  for (float& v : x) v = round_to_bf16(v);
  auto expert = [&](const float* xr, const float* gu_f, const float* dn_f, int64_t inter) {
    std::vector<float> gu(2 * inter), h(inter), y(H);
    kernels::gemm_ref(xr, H, gu_f, 1, 2 * inter, H, gu.data(), 2 * inter, false);
    for (float& v : gu) v = round_to_bf16(v);
    kernels::silu_mul_ref(gu.data(), 1, inter, h.data());
    for (float& v : h) v = round_to_bf16(v);
    kernels::gemm_ref(h.data(), inter, dn_f, 1, H, inter, y.data(), H, false);
    return y;
  };
  std::vector<float> out(8 * H, 0.0f);
  for (int32_t r = 0; r < rows; ++r) {
    std::vector<float> acc(H, 0.0f);
    for (int32_t u = 0; u < t.count; ++u) {
      const float w = t.weight[r][u];
      if (w == 0.0f) continue;  // a row's unchosen experts add nothing
      const int64_t e = t.expert[u];
      const std::vector<float> y = expert(x.data() + r * H, m.f_gu.data() + e * 2 * c.inter * H,
                                          m.f_dn.data() + e * H * c.inter, c.inter);
      for (int64_t i = 0; i < H; ++i) acc[i] += w * y[i];
    }
    for (int32_t piece = 0; c.shared_inter > 0 && piece < c.shared_pieces; ++piece) {
      const std::vector<float> y =
          expert(x.data() + r * H, m.f_sgu.data() + piece * 2 * c.shared_inter * H,
                 m.f_sdn.data() + piece * H * c.shared_inter, c.shared_inter);
      for (int64_t i = 0; i < H; ++i) acc[i] += y[i];
    }
    for (int64_t i = 0; i < H; ++i) out[r * H + i] = round_to_bf16(acc[i]);
  }
  return out;
}

void run_moe_case(Moe& m, int32_t width, int32_t rows, int32_t tile) {
  SCOPED_TRACE(::testing::Message() << m.shape.num_experts << " experts, width " << width << ", rows " << rows
                                    << ", tile " << tile);
  m.shape.slots = std::min(width * m.shape.top_k, m.shape.num_experts);
  m.poison();
  auto host_plan = plan_program(moe_chain_stages(m.host(), tile), width, current_device_sms());
  ASSERT_TRUE(host_plan.ok()) << host_plan.status().message();
  ASSERT_TRUE(run_program_ref(*host_plan, rows, 11).ok());
  auto plan = plan_program(moe_chain_stages(m.device(), tile), width, current_device_sms());
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  DevicePlan dp(std::move(*plan));
  cudaStream_t stream = cuda::context().stream;
  ASSERT_EQ(launch_mono_program(dp.program(rows), stream, false), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_TRUE(rows_close(m.d_residual_out, m.h_residual_out, rows, m.shape.hidden, "residual_out"));
  EXPECT_TRUE(rows_close(m.d_logits, m.h_logits, rows, m.shape.num_experts, "logits"));
  if (m.shape.shared_inter > 0) {
    EXPECT_TRUE(rows_close(m.d_h_shared, m.h_h_shared, rows, m.shape.shared_inter, "h_shared"));
  }
  // The route table against the reference router on the kernel's own logits:
  // the same experts in the same order, the weights to f32 rounding.
  RouteTable got;
  ASSERT_EQ(cudaMemcpy(&got, m.d_table.raw(), sizeof(got), cudaMemcpyDeviceToHost), cudaSuccess);
  const RouteTable want = reference_table(m.shape, host_copy<float>(m.d_logits), m.bias, rows);
  ASSERT_EQ(got.count, want.count);
  for (int32_t u = 0; u < got.count; ++u) {
    EXPECT_EQ(got.expert[u], want.expert[u]) << "slot " << u;
    for (int32_t r = 0; r < rows; ++r)
      EXPECT_NEAR(got.weight[r][u], want.weight[r][u], 1e-5f * (1.0f + std::fabs(want.weight[r][u])))
          << "row " << r << ", slot " << u;
  }
  if (got.count != m.h_table.count || !std::equal(got.expert, got.expert + got.count, m.h_table.expert))
    std::printf("(routing differs from the CPU program's at a near-tie; delta_out is checked for the kernel's)\n");
  if (m.tables) {
    EXPECT_TRUE(rows_close(m.d_residual_copy, m.h_residual_copy, rows, m.shape.hidden, "residual copied back"));
  }
  // The output: the CPU block for the kernel's routing.
  // (As bf16 values: rows_close reads the device buffer as the reference's element type.)
  std::vector<uint16_t> want_out;
  for (float v : moe_from_table(m, got, rows)) want_out.push_back(f32_to_bf16(v));
  EXPECT_TRUE(rows_close(m.d_delta_out, want_out, rows, m.shape.hidden, "delta_out"));
  // Twice more, the second as a PDL dependent: the same bits, the counters back at zero.
  const std::vector<uint16_t> first = host_copy<uint16_t>(m.d_delta_out);
  ASSERT_EQ(launch_mono_program(dp.program(rows), stream, false), cudaSuccess);
  ASSERT_EQ(launch_mono_program(dp.program(rows), stream, true), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(host_copy<uint16_t>(m.d_delta_out), first);
  EXPECT_EQ(host_copy<int32_t>(dp.counters), std::vector<int32_t>(kMaxStages + 1, 0));
  // The full build (NUCLEUS_DECODE_PROGRAM_LEAN=0) and the fence + atomic
  // counters (NUCLEUS_DECODE_PROGRAM_RELEASE=0) give the default's bits.
  expect_switches_keep_bits(dp, rows, m.d_delta_out, first);
}

TEST_F(MonoKernelGpu, MoeBlockV2Lite) {  // 64 experts, top-6 softmax, two shared experts (2 x 1408)
  MoeChain c;
  c.hidden = 2048;
  c.inter = 1408;
  c.shared_inter = 2 * 1408;
  c.num_experts = 64;
  c.top_k = 6;
  c.slots = 48;
  Moe m(c, 707);
  for (auto [width, rows] : {std::pair{1, 1}, std::pair{4, 3}, std::pair{8, 8}}) run_moe_case(m, width, rows, 16);
  run_moe_case(m, 2, 2, 64);
}

TEST_F(MonoKernelGpu, MoeBlockV2LiteEngineLayout) {  // experts through weight tables, 2 shared pieces, residual copy
  MoeChain c;
  c.hidden = 2048;
  c.inter = 1408;
  c.shared_inter = 1408;
  c.shared_pieces = 2;
  c.num_experts = 64;
  c.top_k = 6;
  c.slots = 48;
  Moe m(c, 717, /*tables=*/true);
  for (auto [width, rows] : {std::pair{1, 1}, std::pair{8, 5}}) run_moe_case(m, width, rows, 16);
}

TEST_F(MonoKernelGpu, MoeBlockV3Routing) {  // 256 experts, noaux_tc in 8 groups of 32 (4 kept), top-8, scaled
  MoeChain c;
  c.hidden = 1024;
  c.inter = 256;
  c.shared_inter = 256;
  c.num_experts = 256;
  c.top_k = 8;
  c.n_group = 8;
  c.topk_group = 4;
  c.scoring = Scoring::kSigmoid;
  c.method = TopK::kNoauxTc;
  c.norm_topk_prob = true;
  c.routed_scaling_factor = 2.5f;
  c.slots = 64;
  Moe m(c, 808);
  for (auto [width, rows] : {std::pair{1, 1}, std::pair{8, 8}, std::pair{8, 6}}) run_moe_case(m, width, rows, 16);
}

// FP8 e4m3 routed experts and shared expert with 128 x 128 block scales (the
// routed stages find each slot's scales through the route table's expert):
// DeepSeek-V3's routing at a TP 8-like expert width.
TEST_F(MonoKernelGpu, Fp8MoeBlockV3Routing) {
  MoeChain c;
  c.hidden = 1024;
  c.inter = 256;
  c.shared_inter = 256;
  c.num_experts = 32;
  c.top_k = 8;
  c.n_group = 8;
  c.topk_group = 4;
  c.scoring = Scoring::kSigmoid;
  c.method = TopK::kNoauxTc;
  c.norm_topk_prob = true;
  c.routed_scaling_factor = 2.5f;
  c.slots = 32;
  Moe m(c, 818, /*tables=*/false, /*fp8=*/true);
  for (auto [width, rows] : {std::pair{1, 1}, std::pair{8, 8}, std::pair{4, 3}}) run_moe_case(m, width, rows, 16);
  run_moe_case(m, 2, 2, 64);
}

// A dense MLP as a MoeChain without routed experts (DeepSeek-V2-Lite's first
// layer: 10944 intermediate, so the down projection reads x from global
// memory), bf16 and FP8 (the weights quantized to e4m3 with block scales):
// the kernel against the reference program, residual copied back.
TEST_F(MonoKernelGpu, DenseMlpV2Lite) {
  const int64_t H = 2048, inter = 10944;
  auto scale = [](int64_t k) { return 1.7f / std::sqrt(static_cast<float>(k)); };
  const std::vector<uint16_t> w_gu = hashed_bf16(2 * inter * H, scale(H), 91), w_dn = hashed_bf16(H * inter, scale(inter), 92);
  const std::vector<uint16_t> delta = random_bf16(8 * H, 1.0f, 93);
  const std::vector<float> post_norm = random_f32(H, 0.5f, 1.5f, 94), residual = random_f32(8 * H, -2.0f, 2.0f, 95);
  std::vector<uint8_t> q_gu, q_dn;
  std::vector<float> s_gu, s_dn, f_gu, f_dn;
  Moe::quantize(w_gu, 1, 2 * inter, H, q_gu, s_gu, f_gu);
  Moe::quantize(w_dn, 1, H, inter, q_dn, s_dn, f_dn);
  Tensor d_gu = device_copy(w_gu, DType::kBF16), d_dn = device_copy(w_dn, DType::kBF16);
  Tensor d_q_gu = device_copy(q_gu, DType::kF8E4M3), d_q_dn = device_copy(q_dn, DType::kF8E4M3);
  Tensor d_s_gu = device_copy(s_gu, DType::kF32), d_s_dn = device_copy(s_dn, DType::kF32);
  Tensor d_delta = device_copy(delta, DType::kBF16), d_post_norm = device_copy(post_norm, DType::kF32);
  Tensor d_residual = device_copy(residual, DType::kF32);
  const int32_t sms = current_device_sms();
  cudaStream_t stream = cuda::context().stream;
  for (bool fp8 : {false, true})
    for (auto [width, rows] : {std::pair{1, 1}, std::pair{8, 6}}) {
      SCOPED_TRACE(::testing::Message() << (fp8 ? "e4m3" : "bf16") << ", width " << width << ", rows " << rows);
      std::vector<float> h_res_out(8 * H, NAN), h_y(8 * H, NAN), h_copy(8 * H, NAN);
      std::vector<uint16_t> h_h(8 * inter, 0x7fc0), h_out(8 * H, 0x7fc0);
      Tensor d_res_out = nan_filled(8 * H, DType::kF32), d_y = nan_filled(8 * H, DType::kF32),
             d_copy = nan_filled(8 * H, DType::kF32), d_h = nan_filled(8 * inter, DType::kBF16),
             d_out = nan_filled(8 * H, DType::kBF16);
      MoeChain hc;
      hc.hidden = H;
      hc.shared_inter = inter;
      MoeChain dc = hc;
      hc.w_shared_gate_up = fp8 ? static_cast<const void*>(q_gu.data()) : w_gu.data();
      hc.w_shared_down = fp8 ? static_cast<const void*>(q_dn.data()) : w_dn.data();
      hc.shared_gate_up_scale = fp8 ? s_gu.data() : nullptr;
      hc.shared_down_scale = fp8 ? s_dn.data() : nullptr;
      hc.post_norm = post_norm.data();
      hc.residual = residual.data();
      hc.delta = delta.data();
      hc.residual_out = h_res_out.data();
      hc.h_shared = h_h.data();
      hc.y_shared = h_y.data();
      hc.delta_out = h_out.data();
      hc.residual_copy_to = h_copy.data();
      dc.w_shared_gate_up = fp8 ? d_q_gu.raw() : d_gu.raw();
      dc.w_shared_down = fp8 ? d_q_dn.raw() : d_dn.raw();
      dc.shared_gate_up_scale = fp8 ? d_s_gu.data<float>() : nullptr;
      dc.shared_down_scale = fp8 ? d_s_dn.data<float>() : nullptr;
      dc.post_norm = d_post_norm.data<float>();
      dc.residual = d_residual.data<float>();
      dc.delta = d_delta.data<uint16_t>();
      dc.residual_out = d_res_out.data<float>();
      dc.h_shared = d_h.data<uint16_t>();
      dc.y_shared = d_y.data<float>();
      dc.delta_out = d_out.data<uint16_t>();
      dc.residual_copy_to = d_copy.data<float>();
      auto host_plan = plan_program(moe_chain_stages(hc, 16), width, sms);
      ASSERT_TRUE(host_plan.ok()) << host_plan.status().message();
      ASSERT_TRUE(run_program_ref(*host_plan, rows, 5).ok());
      auto plan = plan_program(moe_chain_stages(dc, 16), width, sms);
      ASSERT_TRUE(plan.ok()) << plan.status().message();
      DevicePlan dp(std::move(*plan));
      ASSERT_EQ(launch_mono_program(dp.program(rows), stream, false), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      EXPECT_TRUE(rows_close(d_res_out, h_res_out, rows, H, "residual_out"));
      EXPECT_TRUE(rows_close(d_h, h_h, rows, inter, "h"));
      EXPECT_TRUE(rows_close(d_out, h_out, rows, H, "delta_out"));
      EXPECT_TRUE(rows_close(d_copy, h_copy, rows, H, "residual copied back"));
      EXPECT_EQ(host_copy<int32_t>(dp.counters), std::vector<int32_t>(kMaxStages + 1, 0));
    }
}

TEST_F(MonoKernelGpu, LayerFrontV2Lite) {
  const int64_t H = 2048, heads = 16, head = 192, width = 576, slots = 64;
  RopeParams rp;
  rp.rope_dim = 64;
  rp.theta = 10000.0;
  const RopeTable table = make_rope_table(rp, 1 << 14);
  const std::vector<uint16_t> w_q = random_bf16(heads * head * H, 1.7f / std::sqrt(2048.0f), 1);
  const std::vector<uint16_t> w_kva = random_bf16(width * H, 1.7f / std::sqrt(2048.0f), 2);
  const std::vector<float> input_norm = random_f32(H, 0.5f, 1.5f, 3), kv_norm = random_f32(512, 0.5f, 1.5f, 4);
  const std::vector<float> residual = random_f32(8 * H, -2.0f, 2.0f, 5);
  const std::vector<uint16_t> delta = random_bf16(8 * H, 1.0f, 6);
  const std::vector<int32_t> positions = {0, 3, 17, 100, 2047, 9000, 5, 12000};
  const std::vector<int64_t> slot_mapping = {4, 9, -1, 0, 63, 12, 20, 31};
  Tensor d_w_q = device_copy(w_q, DType::kBF16), d_w_kva = device_copy(w_kva, DType::kBF16);
  Tensor d_in_norm = device_copy(input_norm, DType::kF32), d_kv_norm = device_copy(kv_norm, DType::kF32);
  Tensor d_inv = device_copy(table.inv_freq, DType::kF32), d_res = device_copy(residual, DType::kF32);
  Tensor d_delta = device_copy(delta, DType::kBF16), d_pos = device_copy(positions, DType::kI32);
  Tensor d_slots = device_copy(slot_mapping, DType::kI64);
  // With a q LoRA as DeepSeek-V3's (q_lora 1536) on the same shapes otherwise.
  const int64_t q_lora = 1536;
  const std::vector<uint16_t> w_qa = random_bf16(q_lora * H, 1.7f / std::sqrt(2048.0f), 11);
  const std::vector<uint16_t> w_qb = random_bf16(heads * head * q_lora, 1.7f / std::sqrt(1536.0f), 12);
  const std::vector<float> q_a_norm = random_f32(q_lora, 0.5f, 1.5f, 13);
  Tensor d_w_qa = device_copy(w_qa, DType::kBF16), d_w_qb = device_copy(w_qb, DType::kBF16);
  Tensor d_q_a_norm = device_copy(q_a_norm, DType::kF32);
  // The query absorption (W_UK^T [heads, 512, 128]) at width 8 and with the q LoRA: slotted jobs side by side in q
  // and q_full.
  const std::vector<uint16_t> w_uk_t = random_bf16(heads * 512 * 128, 1.7f / std::sqrt(128.0f), 14);
  Tensor d_w_uk_t = device_copy(w_uk_t, DType::kBF16);
  for (auto [w, rows, lora] : {std::tuple{1, 1, false}, std::tuple{8, 8, false}, std::tuple{8, 5, false},
                               std::tuple{1, 1, true}, std::tuple{8, 7, true}}) {
    const bool absorb = w == 8 || lora;
    SCOPED_TRACE(::testing::Message() << "width " << w << ", rows " << rows << (lora ? ", q LoRA" : "")
                                      << (absorb ? ", absorbed" : ""));
    std::vector<uint16_t> h_q_full(8 * heads * width, 0x7fc0);
    Tensor d_q_full = nan_filled(8 * heads * width, DType::kBF16);
    std::vector<uint16_t> h_q_a(8 * q_lora, 0x7fc0);
    Tensor d_q_a = nan_filled(8 * q_lora, DType::kBF16);
    std::vector<float> h_res_out(8 * H, NAN), h_copy(8 * H, NAN);
    std::vector<uint16_t> h_q(8 * heads * head, 0x7fc0), h_kv(8 * width, 0x7fc0), h_cache(slots * width, 0x7fc0);
    Tensor d_res_out = nan_filled(8 * H, DType::kF32), d_copy = nan_filled(8 * H, DType::kF32);
    Tensor d_q = nan_filled(8 * heads * head, DType::kBF16), d_kv = nan_filled(8 * width, DType::kBF16);
    // The cache with a poisoned guard row before and after it (a write through slot -1 would land before).
    Tensor d_cache_guarded = nan_filled((slots + 2) * width, DType::kBF16);
    uint16_t* d_cache_rows = d_cache_guarded.data<uint16_t>() + width;
    auto chain = [&](bool device) {
      FrontChain c;
      c.hidden = H;
      c.num_heads = heads;
      c.w_q = device ? d_w_q.data<uint16_t>() : w_q.data();
      c.w_kva = device ? d_w_kva.data<uint16_t>() : w_kva.data();
      if (lora) {
        c.q_lora = q_lora;
        c.w_qa = device ? d_w_qa.data<uint16_t>() : w_qa.data();
        c.w_qb = device ? d_w_qb.data<uint16_t>() : w_qb.data();
        c.q_a_norm = device ? d_q_a_norm.data<float>() : q_a_norm.data();
        c.q_a = device ? d_q_a.data<uint16_t>() : h_q_a.data();
      }
      c.input_norm = device ? d_in_norm.data<float>() : input_norm.data();
      c.kv_norm = device ? d_kv_norm.data<float>() : kv_norm.data();
      c.inv_freq = device ? d_inv.data<float>() : table.inv_freq.data();
      c.residual = device ? d_res.data<float>() : residual.data();
      c.delta = device ? d_delta.data<uint16_t>() : delta.data();
      c.residual_out = device ? d_res_out.data<float>() : h_res_out.data();
      c.residual_copy_to = device ? d_copy.data<float>() : h_copy.data();
      c.q = device ? d_q.data<uint16_t>() : h_q.data();
      c.kv_a = device ? d_kv.data<uint16_t>() : h_kv.data();
      c.positions = device ? d_pos.data<int32_t>() : positions.data();
      c.slot_mapping = device ? d_slots.data<int64_t>() : slot_mapping.data();
      c.cache = device ? d_cache_rows : h_cache.data();
      c.num_slots = slots;
      if (absorb) {
        c.w_uk_t = device ? d_w_uk_t.data<uint16_t>() : w_uk_t.data();
        c.q_full = device ? d_q_full.data<uint16_t>() : h_q_full.data();
      }
      return c;
    };
    auto host_plan = plan_program(front_chain_stages(chain(false), 16), w, current_device_sms());
    ASSERT_TRUE(host_plan.ok()) << host_plan.status().message();
    ASSERT_TRUE(run_program_ref(*host_plan, rows, 3).ok());
    auto plan = plan_program(front_chain_stages(chain(true), 16), w, current_device_sms());
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    DevicePlan dp(std::move(*plan));
    cudaStream_t stream = cuda::context().stream;
    ASSERT_EQ(launch_mono_program(dp.program(rows), stream, false), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_TRUE(rows_close(d_kv, h_kv, rows, width, "kv_a"));
    EXPECT_TRUE(rows_close(d_q, h_q, rows, heads * head, "q"));
    if (absorb) {
      EXPECT_TRUE(rows_close(d_q_full, h_q_full, rows, heads * width, "q_full (absorbed query)"));
    }
    EXPECT_TRUE(rows_close(d_copy, h_copy, rows, H, "residual copied back"));
    const std::vector<float> guarded = widen(host_copy<uint16_t>(d_cache_guarded)), want = widen(h_cache);
    for (int64_t i = 0; i < width; ++i) {
      EXPECT_TRUE(std::isnan(guarded[i])) << "the guard row before the cache was written";
      EXPECT_TRUE(std::isnan(guarded[(slots + 1) * width + i])) << "the guard row after the cache was written";
    }
    const std::vector<float> got(guarded.begin() + width, guarded.begin() + (slots + 1) * width);
    for (int64_t slot = 0; slot < slots; ++slot) {
      const bool written = std::isnan(want[slot * width]) == false;
      if (!written) {
        for (int64_t i = 0; i < width; ++i)
          if (!std::isnan(got[slot * width + i])) {
            ADD_FAILURE() << "slot " << slot << " column " << i << " written but no row maps to it";
            break;
          }
        continue;
      }
      EXPECT_TRUE(all_close({got.begin() + slot * width, got.begin() + (slot + 1) * width},
                            {want.begin() + slot * width, want.begin() + (slot + 1) * width}, 0.02f, 0.02f))
          << "cache slot " << slot;
    }
  }
}

// The end of the decode attention at V2-Lite's shapes (16 heads, kv_lora
// 512, W_UV 128 x 512 a head): the merge of 32 KV splits (fixed and device
// split rules, 64-key tiles, rows with keys from 1 to 20k) and W_UV, against
// the CPU reference; one split passes o_lat through.
TEST_F(MonoKernelGpu, AttentionOutputV2Lite) {
  const int32_t heads = 16, lora = 512, S = 32;
  const std::vector<uint16_t> kv_b = random_bf16(heads * 256 * lora, 1.7f / std::sqrt(512.0f), 31);
  const std::vector<int32_t> context = {0, 63, 64, 1000, 4095, 20000, 129, 7};
  std::vector<int32_t> token_seq(8), query_start(9);
  for (int i = 0; i < 8; ++i) token_seq[i] = query_start[i] = i;
  query_start[8] = 8;
  const std::vector<float> partials = random_f32(8 * S * heads * lora, -2.0f, 2.0f, 32);
  const std::vector<float> lse = random_f32(8 * S * heads, -8.0f, 8.0f, 33);
  const std::vector<uint16_t> o_lat_in = random_bf16(8 * heads * lora, 1.0f, 34);
  Tensor d_kv_b = device_copy(kv_b, DType::kBF16), d_part = device_copy(partials, DType::kF32);
  Tensor d_lse = device_copy(lse, DType::kF32), d_o_in = device_copy(o_lat_in, DType::kBF16);
  Tensor d_seq = device_copy(token_seq, DType::kI32), d_qs = device_copy(query_start, DType::kI32);
  Tensor d_ctx = device_copy(context, DType::kI32);
  for (auto [w, rows, splits, min_keys] : {std::tuple{1, 1, S, 0}, std::tuple{8, 8, S, 128}, std::tuple{8, 5, S, 0},
                                           std::tuple{4, 4, S, 64}, std::tuple{2, 2, 1, 64}}) {
    SCOPED_TRACE(::testing::Message() << "width " << w << ", rows " << rows << ", splits " << splits
                                      << ", min_split_keys " << min_keys);
    std::vector<uint16_t> h_o(8 * heads * lora, 0x7fc0), h_out(8 * heads * 128, 0x7fc0);
    Tensor d_o = nan_filled(8 * heads * lora, DType::kBF16), d_out = nan_filled(8 * heads * 128, DType::kBF16);
    auto chain = [&](bool device) {
      AttentionOutputChain c;
      c.num_heads = heads;
      c.kv_b = device ? d_kv_b.data<uint16_t>() : kv_b.data();
      c.partials = device ? d_part.data<float>() : partials.data();
      c.lse = device ? d_lse.data<float>() : lse.data();
      c.o_lat_in = device ? d_o_in.data<uint16_t>() : o_lat_in.data();
      c.splits = splits;
      c.min_split_keys = min_keys;
      c.key_tile = 64;
      c.token_seq = device ? d_seq.data<int32_t>() : token_seq.data();
      c.query_start = device ? d_qs.data<int32_t>() : query_start.data();
      c.context_lens = device ? d_ctx.data<int32_t>() : context.data();
      c.o_lat = device ? d_o.data<uint16_t>() : h_o.data();
      c.attn_out = device ? d_out.data<uint16_t>() : h_out.data();
      c.width = w;
      return c;
    };
    auto host_plan = plan_program(attention_output_stages(chain(false)), w, current_device_sms());
    ASSERT_TRUE(host_plan.ok()) << host_plan.status().message();
    ASSERT_TRUE(run_program_ref(*host_plan, rows, 5).ok());
    auto plan = plan_program(attention_output_stages(chain(true)), w, current_device_sms());
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    DevicePlan dp(std::move(*plan));
    cudaStream_t stream = cuda::context().stream;
    ASSERT_EQ(launch_mono_program(dp.program(rows), stream, false), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_TRUE(rows_close(d_o, h_o, rows, heads * lora, "o_lat (merged)"));
    EXPECT_TRUE(rows_close(d_out, h_out, rows, heads * 128, "attn_out (W_UV)"));
    EXPECT_EQ(host_copy<int32_t>(dp.counters), std::vector<int32_t>(kMaxStages + 1, 0));
  }
}

// The whole decode attention as program stages at V2-Lite's shapes (16
// heads, latent rows of 512 + 64): kAttend over a paged cache (pages of 64
// and 1, contexts of 1 to 5000 keys), the merge and W_UV, against the CPU
// reference (which checks them against an f64 softmax attention:
// mono_program_test AttentionStagesEqualSoftmaxAttention); and 20 heads (two
// head groups).
TEST_F(MonoKernelGpu, AttentionStagesV2Lite) {
  for (auto [heads, bs, lora] : {std::tuple{16, 64, 512}, std::tuple{16, 1, 512}, std::tuple{20, 16, 256}}) {
    const int32_t row_w = lora + 64, S = 32;
    const std::vector<int32_t> context = {0, 4999, 63, 1000, 129, 2047, 7, 300};
    const int32_t max_blocks = (5000 + bs - 1) / bs, num_blocks = 8 * max_blocks;
    std::vector<int32_t> token_seq(8), query_start(9), tables(static_cast<size_t>(8) * max_blocks);
    for (int i = 0; i < 8; ++i) token_seq[i] = query_start[i] = i;
    query_start[8] = 8;
    for (size_t i = 0; i < tables.size(); ++i) tables[i] = static_cast<int32_t>((i * 7919 + 13) % tables.size());
    const std::vector<uint16_t> cache = random_bf16(static_cast<size_t>(num_blocks) * bs * row_w, 1.0f, 41);
    const std::vector<uint16_t> q_full = random_bf16(8 * heads * row_w, 0.2f, 42);
    const std::vector<uint16_t> kv_b = random_bf16(heads * 256 * lora, 1.7f / std::sqrt(512.0f), 43);
    Tensor d_cache = device_copy(cache, DType::kBF16), d_q = device_copy(q_full, DType::kBF16);
    Tensor d_kv_b = device_copy(kv_b, DType::kBF16), d_tables = device_copy(tables, DType::kI32);
    Tensor d_seq = device_copy(token_seq, DType::kI32), d_qs = device_copy(query_start, DType::kI32);
    Tensor d_ctx = device_copy(context, DType::kI32);
    for (auto [w, rows, min_keys] : {std::tuple{1, 1, 0}, std::tuple{8, 8, 64}, std::tuple{8, 6, 0}, std::tuple{4, 4, 32}}) {
      SCOPED_TRACE(::testing::Message() << heads << " heads of kv_lora " << lora << ", pages of " << bs << ", width "
                                        << w << ", rows " << rows << ", min_split_keys " << min_keys);
      std::vector<float> h_po(8 * S * heads * lora, NAN), h_pl(8 * S * heads, NAN);
      std::vector<uint16_t> h_o(8 * heads * lora, 0x7fc0), h_out(8 * heads * 128, 0x7fc0);
      Tensor d_po = nan_filled(8 * S * heads * lora, DType::kF32), d_pl = nan_filled(8 * S * heads, DType::kF32);
      Tensor d_o = nan_filled(8 * heads * lora, DType::kBF16), d_out = nan_filled(8 * heads * 128, DType::kBF16);
      auto chain = [&](bool device) {
        AttentionOutputChain c;
        c.num_heads = heads;
        c.kv_lora = lora;
        c.kv_b = device ? d_kv_b.data<uint16_t>() : kv_b.data();
        c.splits = S;
        c.min_split_keys = min_keys;
        c.key_tile = 32;
        c.token_seq = device ? d_seq.data<int32_t>() : token_seq.data();
        c.query_start = device ? d_qs.data<int32_t>() : query_start.data();
        c.context_lens = device ? d_ctx.data<int32_t>() : context.data();
        c.o_lat = device ? d_o.data<uint16_t>() : h_o.data();
        c.attn_out = device ? d_out.data<uint16_t>() : h_out.data();
        c.q_full = device ? d_q.data<uint16_t>() : q_full.data();
        c.cache = device ? d_cache.data<uint16_t>() : cache.data();
        c.num_slots = static_cast<int64_t>(num_blocks) * bs;
        c.block_tables = device ? d_tables.data<int32_t>() : tables.data();
        c.max_blocks = max_blocks;
        c.block_size = bs;
        c.scale = 0.1352f;
        c.part_o = device ? d_po.data<float>() : h_po.data();
        c.part_lse = device ? d_pl.data<float>() : h_pl.data();
        c.width = w;
        return c;
      };
      auto host_plan = plan_program(attention_output_stages(chain(false)), w, current_device_sms());
      ASSERT_TRUE(host_plan.ok()) << host_plan.status().message();
      ASSERT_TRUE(run_program_ref(*host_plan, rows, 5).ok());
      auto plan = plan_program(attention_output_stages(chain(true)), w, current_device_sms());
      ASSERT_TRUE(plan.ok()) << plan.status().message();
      DevicePlan dp(std::move(*plan));
      cudaStream_t stream = cuda::context().stream;
      ASSERT_EQ(launch_mono_program(dp.program(rows), stream, false), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      // The partials' log-sum-exps themselves (a shift common to a row's splits would cancel in the merge),
      // written for exactly the splits the reference writes.
      const std::vector<float> got_lse = host_copy<float>(d_pl);
      int64_t compared = 0;
      for (size_t i = 0; i < h_pl.size(); ++i) {
        ASSERT_EQ(std::isnan(got_lse[i]), std::isnan(h_pl[i])) << "part_lse " << i << " written on one side only";
        if (std::isnan(h_pl[i])) continue;
        ASSERT_NEAR(got_lse[i], h_pl[i], 1e-3f * (1.0f + std::fabs(h_pl[i]))) << "part_lse " << i;
        ++compared;
      }
      EXPECT_GT(compared, 0);
      EXPECT_TRUE(rows_close(d_o, h_o, rows, heads * lora, "o_lat (attended, merged)"));
      EXPECT_TRUE(rows_close(d_out, h_out, rows, heads * 128, "attn_out (W_UV)"));
      EXPECT_EQ(host_copy<int32_t>(dp.counters), std::vector<int32_t>(kMaxStages + 1, 0));
    }
  }
}

}  // namespace
}  // namespace nucleus::kernels::mono
