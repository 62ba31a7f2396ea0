// The skinny decode GEMM (kernels/gemm/skinny_gemm.cuh) against the CPU
// reference:
//  - every decode linear of DeepSeek-V2-Lite (TP 1), DeepSeek-V3 and Kimi-K2
//    (TP 1, 4 and 8 shard widths: column-parallel n / tp, row-parallel
//    k / tp, replicated q_a, kv_a and the router), at m = 1 ... 8, bf16 out
//    overwritten and f32 out accumulated onto what it holds, x with a row
//    stride wider than k, the output a column block of a wider buffer whose
//    other columns must stay untouched;
//  - every slice count gives the reference, and a launch is bit-identical to
//    the previous one (no atomics);
//  - launched as a programmatic dependent (PDL) of the RMSNorm that writes
//    its x (that kernel lets dependents start at once), eagerly and in a
//    CUDA graph, over an x poisoned with NaN first: it reads x only after the
//    norm has finished;
//  - shapes off the tiles (n not a multiple of 4, k not of 256) and the
//    refusals (m = 0 or 9, k % 8, misaligned x, slices 3).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>

#include "core/device.h"
#include "gpu_test_util.h"
#include "io/hf_config.h"
#include "kernels/gemm/gemm_ref.h"
#include "kernels/gemm/skinny_gemm.cuh"
#include "kernels/rmsnorm/rmsnorm.cuh"
#include "test_util.h"

namespace nucleus::kernels {
namespace {

using testing::all_close;
using testing::device_copy;
using testing::from_bf16;
using testing::host_copy;
using testing::to_bf16;

class SkinnyGemmGpu : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device"; }
};

struct Shape {
  int64_t n, k;
  std::string what;
};

// Values on a bf16 grid in [-scale, scale] from a counter hash (fast for the
// ~1e9-element lm_head weights).
std::vector<float> hashed_bf16_values(size_t count, float scale, uint64_t seed) {
  std::vector<float> v(count);
  const unsigned threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (size_t i = t; i < count; i += threads) {
        uint64_t z = (seed << 40) + i + 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        v[i] = round_to_bf16(scale * (static_cast<float>(z % 20001) / 10000.0f - 1.0f));
      }
    });
  for (auto& th : pool) th.join();
  return v;
}

// want[r, c] = sum_k x[r, k] w[c, k] for r < rows, on up to 16 threads.
std::vector<float> reference(const std::vector<float>& x, int64_t x_stride, const std::vector<float>& w, int64_t rows,
                             int64_t n, int64_t k) {
  std::vector<float> want(rows * n);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(16, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int64_t c = t; c < n; c += threads)
        for (int64_t r = 0; r < rows; ++r) want[r * n + c] = dot_ref(&x[r * x_stride], &w[c * k], k);
    });
  for (auto& th : pool) th.join();
  return want;
}

std::string models_dir() {
  if (const char* d = std::getenv("NUCLEUS_MODELS_DIR")) return d;
  return std::string(NUCLEUS_SOURCE_DIR) + "/models";
}

// The decode linears of `c` sharded over `tp` ranks, deduplicated by (n, k).
void decode_shapes(const ModelConfig& c, const std::string& model, int tp, std::map<std::pair<int64_t, int64_t>, Shape>* out) {
  const int64_t H = c.hidden_size, nh = c.num_attention_heads;
  const std::string at = model + " TP" + std::to_string(tp) + " ";
  auto add = [&](int64_t n, int64_t k, const std::string& name) {
    out->emplace(std::pair{n, k}, Shape{n, k, at + name});
  };
  if (c.q_lora_rank > 0) {
    add(c.q_lora_rank, H, "q_a");
    add(nh * c.qk_head_dim() / tp, c.q_lora_rank, "q_b");
  } else {
    add(nh * c.qk_head_dim() / tp, H, "q_proj");
  }
  add(c.kv_lora_rank + c.qk_rope_head_dim, H, "kv_a");
  add(H, nh * c.v_head_dim / tp, "o_proj");
  add(c.n_routed_experts, H, "router");
  const int64_t shared = c.moe_intermediate_size * c.n_shared_experts;
  add(2 * shared / tp, H, "shared gate_up");
  add(H, shared / tp, "shared down");
  add(2 * c.intermediate_size / tp, H, "dense gate_up");
  add(H, c.intermediate_size / tp, "dense down");
  add(c.vocab_size / tp, H, "lm_head");
}

// What the output holds outside the GEMM's column block (exact in bf16 and f32).
constexpr float kSentinel = 1232.0f;

// Runs m = 1..8 against the reference of the first 8 rows (a row's sums do not
// depend on the other rows).
void check_shape(const Shape& s, int slices) {
  SCOPED_TRACE(s.what + " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k) + " slices=" +
               std::to_string(slices));
  constexpr int64_t kRows = kSkinnyMaxRows;
  const int64_t x_stride = s.k + 24, pad = 12, col = 4, out_stride = s.n + pad;
  auto x = hashed_bf16_values(kRows * x_stride, 1.0f, 1);
  auto w = hashed_bf16_values(s.n * s.k, 0.05f, 2);
  const auto want = reference(x, x_stride, w, kRows, s.n, s.k);
  auto acc0 = hashed_bf16_values(kRows * s.n, 1.0f, 3);
  Tensor d_x = device_copy(to_bf16(x), DType::kBF16), d_w = device_copy(to_bf16(w), DType::kBF16);
  const float atol = 1e-4f * std::sqrt(static_cast<float>(s.k));  // f32 sums of exact products, reordered
  for (int64_t m = 1; m <= kRows; ++m) {
    for (bool f32_accumulate : {false, true}) {
      SCOPED_TRACE("m=" + std::to_string(m) + (f32_accumulate ? " f32 accumulate" : " bf16"));
      // The output: [m, out_stride], the GEMM writes columns [col, col + n).
      std::vector<float> before(m * out_stride, kSentinel);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < s.n; ++c) before[r * out_stride + col + c] = f32_accumulate ? acc0[r * s.n + c] : -7.0f;
      Tensor out = f32_accumulate ? device_copy(before, DType::kF32) : device_copy(to_bf16(before), DType::kBF16);
      SkinnyGemmArgs a;
      a.x = d_x.data<__nv_bfloat16>();
      a.x_stride = x_stride;
      a.w = d_w.data<__nv_bfloat16>();
      a.out = static_cast<char*>(out.raw()) + col * (f32_accumulate ? 4 : 2);
      a.out_stride = out_stride;
      a.out_f32 = f32_accumulate;
      a.accumulate = f32_accumulate;
      a.m = m;
      a.n = s.n;
      a.k = s.k;
      a.slices = slices;
      ASSERT_EQ(launch_skinny_gemm(a, nullptr), cudaSuccess);
      const std::vector<float> got_all =
          f32_accumulate ? host_copy<float>(out) : from_bf16(host_copy<uint16_t>(out));
      std::vector<float> got(m * s.n), expect(m * s.n);
      bool intact = true;
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < out_stride; ++c) {
          const float v = got_all[r * out_stride + c];
          if (c >= col && c < col + s.n) {
            got[r * s.n + c - col] = v;
            const float ref = want[r * s.n + c - col];
            expect[r * s.n + c - col] = f32_accumulate ? ref + acc0[r * s.n + c - col] : ref;
          } else {
            intact &= v == kSentinel;
          }
        }
      // bf16 outputs: one rounding of the f32 sum (relative 2^-8).
      EXPECT_TRUE(all_close(got, expect, atol, f32_accumulate ? 1e-5f : 1.0f / 256, s.n));
      EXPECT_TRUE(intact) << "wrote outside its column block";
    }
  }
}

TEST_F(SkinnyGemmGpu, MatchesCpuReferenceAtEveryDecodeShape) {
  auto v2 = load_model_config(models_dir() + "/configs/deepseek-v2-lite.config.json");
  auto v3 = load_model_config(models_dir() + "/configs/deepseek-v3.config.json");
  ASSERT_TRUE(v2.ok() && v3.ok());
  ModelConfig kimi = *v3;  // Kimi-K2: DeepSeek-V3's architecture with 64 heads, 384 experts, 163,840 tokens
  kimi.num_attention_heads = 64;
  kimi.n_routed_experts = 384;
  kimi.vocab_size = 163840;
  std::map<std::pair<int64_t, int64_t>, Shape> shapes;
  decode_shapes(*v2, "V2-Lite", 1, &shapes);
  for (int tp : {1, 4, 8}) {
    decode_shapes(*v3, "V3", tp, &shapes);
    decode_shapes(kimi, "Kimi-K2", tp, &shapes);
  }
  for (const auto& [key, s] : shapes) check_shape(s, 0);
}

TEST_F(SkinnyGemmGpu, EverySliceCountAndShapesOffTheTiles) {
  for (const Shape& s : {Shape{3072, 2048, "V2-Lite q_proj"}, Shape{576, 7168, "V3 kv_a"},
                         Shape{101, 264, "n % 4 = 1, k % 256 = 8"}, Shape{6, 8, "k = 8"},
                         Shape{130, 1032, "odd"}})
    for (int slices : {1, 2, 4, 8}) check_shape(s, slices);
}

TEST_F(SkinnyGemmGpu, RepeatedLaunchesAreBitIdentical) {
  const int64_t m = 5, n = 2048, k = 2048;
  auto x = hashed_bf16_values(m * k, 1.0f, 5);
  auto w = hashed_bf16_values(n * k, 0.05f, 6);
  Tensor d_x = device_copy(to_bf16(x), DType::kBF16), d_w = device_copy(to_bf16(w), DType::kBF16);
  std::vector<std::vector<float>> runs;
  for (int run = 0; run < 3; ++run) {
    Tensor out = device_copy(std::vector<float>(m * n, 0.0f), DType::kF32);
    SkinnyGemmArgs a;
    a.x = d_x.data<__nv_bfloat16>();
    a.x_stride = k;
    a.w = d_w.data<__nv_bfloat16>();
    a.out = out.raw();
    a.out_stride = n;
    a.out_f32 = true;
    a.m = m;
    a.n = n;
    a.k = k;
    a.slices = 8;
    ASSERT_EQ(launch_skinny_gemm(a, nullptr), cudaSuccess);
    runs.push_back(host_copy<float>(out));
  }
  EXPECT_EQ(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * 4), 0);
  EXPECT_EQ(std::memcmp(runs[0].data(), runs[2].data(), runs[0].size() * 4), 0);
}

TEST_F(SkinnyGemmGpu, ProgrammaticDependentWaitsForTheKernelWritingX) {
  const int64_t n = 2048, k = 7168;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto w = hashed_bf16_values(n * k, 0.05f, 11);
  Tensor d_w = device_copy(to_bf16(w), DType::kBF16);
  Tensor d_norm_w = device_copy(std::vector<float>(k, 1.0f), DType::kF32);
  for (bool graph : {false, true})
    for (int64_t m : {1, 3, 8}) {
      SCOPED_TRACE(std::string(graph ? "graph" : "eager") + " m=" + std::to_string(m));
      auto src = hashed_bf16_values(m * k, 2.0f, 12 + m);
      Tensor d_src = device_copy(src, DType::kF32);
      Tensor d_x = device_copy(std::vector<uint16_t>(m * k, 0x7fc0), DType::kBF16);  // NaN until the norm writes it
      Tensor d_out = device_copy(std::vector<float>(m * n, 0.0f), DType::kF32);
      SkinnyGemmArgs a;
      a.x = d_x.data<__nv_bfloat16>();
      a.x_stride = k;
      a.w = d_w.data<__nv_bfloat16>();
      a.out = d_out.raw();
      a.out_stride = n;
      a.out_f32 = true;
      a.m = m;
      a.n = n;
      a.k = k;
      a.pdl = true;
      auto run = [&] {
        EXPECT_EQ(launch_rmsnorm_f32_to_bf16(d_src.data<float>(), k, d_norm_w.data<float>(), m, k, k, 1e-6f,
                                             d_x.data<__nv_bfloat16>(), k, stream),
                  cudaSuccess);
        EXPECT_EQ(launch_skinny_gemm(a, stream), cudaSuccess);
      };
      if (graph) {
        cudaGraph_t g;
        cudaGraphExec_t exec;
        ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
        run();
        ASSERT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess);
        ASSERT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
        ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(g);
      } else {
        run();
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      }
      // The reference from the x the norm wrote (read back after the run).
      const auto x = from_bf16(host_copy<uint16_t>(d_x));
      for (float v : x) ASSERT_TRUE(std::isfinite(v)) << "the norm did not write x";
      const auto want = reference(x, k, w, m, n, k);
      EXPECT_TRUE(all_close(host_copy<float>(d_out), want, 1e-4f * std::sqrt(float(k)), 1e-5f, n));
    }
  cudaStreamDestroy(stream);
}

TEST_F(SkinnyGemmGpu, Refusals) {
  Tensor x = Tensor::empty({16 * 64}, DType::kBF16, Device::kCuda), w = Tensor::empty({64 * 64}, DType::kBF16, Device::kCuda);
  Tensor out = Tensor::empty({16 * 64}, DType::kF32, Device::kCuda);
  auto args = [&](int64_t m, int64_t k, int64_t x_offset, int slices) {
    SkinnyGemmArgs a;
    a.x = x.data<__nv_bfloat16>() + x_offset;
    a.x_stride = 64;
    a.w = w.data<__nv_bfloat16>();
    a.out = out.raw();
    a.out_f32 = true;
    a.out_stride = 64;
    a.m = m;
    a.n = 64;
    a.k = k;
    a.slices = slices;
    return a;
  };
  EXPECT_EQ(skinny_gemm_check(args(1, 64, 0, 0)), cudaSuccess);
  EXPECT_EQ(skinny_gemm_check(args(8, 64, 0, 8)), cudaSuccess);
  EXPECT_EQ(launch_skinny_gemm(args(0, 64, 0, 0), nullptr), cudaErrorInvalidValue) << "m = 0";
  EXPECT_EQ(launch_skinny_gemm(args(9, 64, 0, 0), nullptr), cudaErrorInvalidValue) << "m = 9";
  EXPECT_EQ(launch_skinny_gemm(args(1, 60, 0, 0), nullptr), cudaErrorInvalidValue) << "k % 8";
  EXPECT_EQ(launch_skinny_gemm(args(1, 64, 1, 0), nullptr), cudaErrorInvalidValue) << "misaligned x";
  EXPECT_EQ(launch_skinny_gemm(args(1, 64, 0, 3), nullptr), cudaErrorInvalidValue) << "slices 3";
  SkinnyGemmArgs no_out = args(1, 64, 0, 0);
  no_out.out = nullptr;
  EXPECT_EQ(launch_skinny_gemm(no_out, nullptr), cudaErrorInvalidValue) << "no output";
}

}  // namespace
}  // namespace nucleus::kernels
