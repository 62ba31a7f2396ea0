// The skinny FP8 block-scaled decode GEMM (kernels/gemm/skinny_fp8_gemm.cuh)
// against the CPU reference, and its linear backend (cuda_skinny_fp8):
//  - every FP8 decode linear of DeepSeek-V3 and Kimi-K2 (TP 1, 4 and 8 shard
//    widths: column-parallel n / tp, row-parallel k / tp, replicated q_a and
//    kv_a; the router and lm_head are bf16 in these checkpoints and run the
//    bf16 skinny kernel), at m = 1 ... 16, bf16 out overwritten and f32 out
//    accumulated onto what it holds, x with a row stride wider than k, the
//    output a column block of a wider buffer whose other columns must stay
//    untouched;
//  - every slice count, shapes off the tiles (n not a multiple of 8, one k
//    block, an odd block count), and a launch bit-identical to the previous
//    one (no atomics);
//  - launched as a programmatic dependent (PDL) of the RMSNorm that writes
//    its x (that kernel lets dependents start at once), eagerly and in a CUDA
//    graph, over an x poisoned with NaN first: it reads x only after the norm
//    has finished;
//  - the refusals, each naming its reason (m = 0 or 17, k % 128, misaligned
//    x, x_stride % 8, slices 3, no scales), and the backend's (not a decode
//    GEMM, bf16 weight, in_features % 128, which then runs elsewhere);
//  - the LinearOp of a decode GEMM picks cuda_skinny_fp8 and gives the
//    reference at m <= 16 and, through the FP8 linear's other paths, above.
//
// Reference (CPU, f32): W[n, k] = q[n, k] * scale_inv[n / 128, k / 128]
// (dequantize_fp8_block_ref's definition), want = dot_ref(x row, W row). The
// kernel is W8A16 like the own FP8 path: e4m3 -> bf16 is exact and bf16 x
// bf16 products are exact in the MMA's f32, so only the f32 summation order
// (MMA-internal, per 128 block, then across blocks and slices) differs:
// |err| <= 2e-3 rms(want) as fp8_gemm_gpu_test's own-kernel bound, plus 2^-8
// |want| for a bf16 output (one rounding) or 1e-5 |want| for f32.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>

#include "core/device.h"
#include "core/dtype.h"
#include "gpu_test_util.h"
#include "io/hf_config.h"
#include "kernels/gemm/gemm_ref.h"
#include "kernels/gemm/skinny_fp8_gemm.cuh"
#include "kernels/rmsnorm/rmsnorm.cuh"
#include "ops/linear_cuda.h"
#include "ops/linear_op.h"
#include "test_util.h"

namespace nucleus::kernels {
namespace {

using testing::all_close;
using testing::device_copy;
using testing::from_bf16;
using testing::host_copy;
using testing::to_bf16;

class SkinnyFp8GemmGpu : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device"; }
};

struct Shape {
  int64_t n, k;
  std::string what;
};

uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Runs f(i) for i in [0, count) on up to 16 threads.
template <typename F>
void parallel_for(int64_t count, F f) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(16, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int64_t i = t; i < count; i += threads) f(i);
    });
  for (auto& th : pool) th.join();
}

// Values on a bf16 grid in [-scale, scale] from a counter hash.
std::vector<float> hashed_bf16_values(size_t count, float scale, uint64_t seed) {
  std::vector<float> v(count);
  parallel_for(static_cast<int64_t>(count), [&](int64_t i) {
    const uint64_t z = mix((seed << 40) + i + 0x9E3779B97F4A7C15ull);
    v[i] = round_to_bf16(scale * (static_cast<float>(z % 20001) / 10000.0f - 1.0f));
  });
  return v;
}

// An FP8 weight [n, k]: every e4m3 code but NaN (subnormals, zeros, +-448
// included), and 128x128 scales varying by a factor 0.5 .. 1.5 (a wrong block
// index shows).
struct Fp8Weight {
  int64_t n = 0, k = 0;
  std::vector<uint8_t> q;
  std::vector<float> scale;  // [ceil(n / 128), k / 128]
  Tensor d_q, d_scale;
};

Fp8Weight make_weight(int64_t n, int64_t k, uint64_t seed) {
  Fp8Weight f;
  f.n = n;
  f.k = k;
  f.q.resize(n * k);
  parallel_for(n, [&](int64_t r) {
    for (int64_t c = 0; c < k; ++c) {
      uint8_t b = static_cast<uint8_t>(mix((seed << 44) + r * k + c) >> 24);
      if ((b & 0x7f) == 0x7f) b ^= 1;  // no NaN
      f.q[r * k + c] = b;
    }
  });
  const int64_t nb = (n + 127) / 128, kb = (k + 127) / 128;
  f.scale.resize(nb * kb);
  for (int64_t i = 0; i < nb * kb; ++i)
    f.scale[i] = 2e-4f * (0.5f + static_cast<float>(mix(seed * 7919 + i) % 1000) / 1000.0f);
  f.d_q = device_copy(f.q, DType::kF8E4M3);
  f.d_scale = device_copy(f.scale, DType::kF32);
  return f;
}

// want[r, c] = sum_k x[r, k] W[c, k] for r < rows, W dequantized row by row.
std::vector<float> reference(const std::vector<float>& x, int64_t x_stride, const Fp8Weight& w, int64_t rows) {
  std::vector<float> want(rows * w.n);
  const int64_t kb = (w.k + 127) / 128;
  parallel_for(w.n, [&](int64_t c) {
    thread_local std::vector<float> wrow;
    wrow.resize(w.k);
    for (int64_t j = 0; j < w.k; ++j) wrow[j] = fp8e4m3_to_f32(w.q[c * w.k + j]) * w.scale[(c / 128) * kb + j / 128];
    for (int64_t r = 0; r < rows; ++r) want[r * w.n + c] = dot_ref(&x[r * x_stride], wrow.data(), w.k);
  });
  return want;
}

float rms(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += double(x) * x;
  return static_cast<float>(std::sqrt(s / std::max<size_t>(1, v.size())));
}

std::string models_dir() {
  if (const char* d = std::getenv("NUCLEUS_MODELS_DIR")) return d;
  return std::string(NUCLEUS_SOURCE_DIR) + "/models";
}

// The FP8 decode linears of `c` sharded over `tp` ranks, deduplicated by (n, k).
void fp8_decode_shapes(const ModelConfig& c, const std::string& model, int tp,
                       std::map<std::pair<int64_t, int64_t>, Shape>* out) {
  const int64_t H = c.hidden_size, nh = c.num_attention_heads;
  const std::string at = model + " TP" + std::to_string(tp) + " ";
  auto add = [&](int64_t n, int64_t k, const std::string& name) {
    out->emplace(std::pair{n, k}, Shape{n, k, at + name});
  };
  add(c.q_lora_rank, H, "q_a");
  add(nh * c.qk_head_dim() / tp, c.q_lora_rank, "q_b");
  add(c.kv_lora_rank + c.qk_rope_head_dim, H, "kv_a");
  add(H, nh * c.v_head_dim / tp, "o_proj");
  const int64_t shared = c.moe_intermediate_size * c.n_shared_experts;
  add(2 * shared / tp, H, "shared gate_up");
  add(H, shared / tp, "shared down");
  add(2 * c.intermediate_size / tp, H, "dense gate_up");
  add(H, c.intermediate_size / tp, "dense down");
}

// What the output holds outside the GEMM's column block (exact in bf16 and f32).
constexpr float kSentinel = 1232.0f;

// Runs m = 1..16 (or `ms`) against the reference of the first 16 rows (a
// row's sums do not depend on the other rows).
void check_shape(const Shape& s, int slices, std::vector<int64_t> ms = {}, bool pipelined = false, bool stream = false) {
  SCOPED_TRACE(s.what + " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k) + " slices=" +
               std::to_string(slices));
  if (ms.empty())
    for (int64_t m = 1; m <= kSkinnyFp8MaxRows; ++m) ms.push_back(m);
  constexpr int64_t kRows = kSkinnyFp8MaxRows;
  const int64_t x_stride = s.k + 24, pad = 12, col = 4, out_stride = s.n + pad;
  const auto x = hashed_bf16_values(kRows * x_stride, 1.0f, 1);
  const Fp8Weight w = make_weight(s.n, s.k, 2);
  const auto want = reference(x, x_stride, w, kRows);
  const auto acc0 = hashed_bf16_values(kRows * s.n, 1.0f, 3);
  Tensor d_x = device_copy(to_bf16(x), DType::kBF16);
  const float atol = 2e-3f * std::max(rms(want), 1e-30f);
  for (int64_t m : ms) {
    for (bool f32_accumulate : {false, true}) {
      SCOPED_TRACE("m=" + std::to_string(m) + (f32_accumulate ? " f32 accumulate" : " bf16"));
      // The output: [m, out_stride], the GEMM writes columns [col, col + n).
      std::vector<float> before(m * out_stride, kSentinel);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < s.n; ++c) before[r * out_stride + col + c] = f32_accumulate ? acc0[r * s.n + c] : -7.0f;
      Tensor out = f32_accumulate ? device_copy(before, DType::kF32) : device_copy(to_bf16(before), DType::kBF16);
      SkinnyFp8GemmArgs a;
      a.x = d_x.data<__nv_bfloat16>();
      a.x_stride = x_stride;
      a.w = w.d_q.data<uint8_t>();
      a.scale_inv = w.d_scale.data<float>();
      a.out = static_cast<char*>(out.raw()) + col * (f32_accumulate ? 4 : 2);
      a.out_stride = out_stride;
      a.out_f32 = f32_accumulate;
      a.accumulate = f32_accumulate;
      a.m = m;
      a.n = s.n;
      a.k = s.k;
      a.slices = slices;
      a.pipelined = pipelined;
      a.stream = stream;
      ASSERT_EQ(launch_skinny_fp8_gemm(a, nullptr), cudaSuccess) << skinny_fp8_gemm_refusal(a);
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
      EXPECT_TRUE(all_close(got, expect, atol, f32_accumulate ? 1e-5f : 1.0f / 256, s.n));
      EXPECT_TRUE(intact) << "wrote outside its column block";
    }
  }
}

TEST_F(SkinnyFp8GemmGpu, MatchesCpuReferenceAtEveryFp8DecodeShape) {
  auto v3 = load_model_config(models_dir() + "/configs/deepseek-v3.config.json");
  ASSERT_TRUE(v3.ok());
  ModelConfig kimi = *v3;  // Kimi-K2: DeepSeek-V3's architecture with 64 heads, 384 experts, 163,840 tokens
  kimi.num_attention_heads = 64;
  kimi.n_routed_experts = 384;
  kimi.vocab_size = 163840;
  std::map<std::pair<int64_t, int64_t>, Shape> shapes;
  for (int tp : {1, 4, 8}) {
    fp8_decode_shapes(*v3, "V3", tp, &shapes);
    fp8_decode_shapes(kimi, "Kimi-K2", tp, &shapes);
  }
  for (const auto& [key, s] : shapes) check_shape(s, 0);
}

TEST_F(SkinnyFp8GemmGpu, EverySliceCountAndShapesOffTheTiles) {
  for (const Shape& s : {Shape{576, 7168, "V3 kv_a"}, Shape{3072, 1536, "V3 TP8 q_b"},
                         Shape{101, 384, "n % 8 = 5, 3 blocks"}, Shape{6, 128, "one block, n < 8"},
                         Shape{130, 1152, "n = 130, 9 blocks"}})
    for (int slices : {1, 2, 4, 8, 16}) check_shape(s, slices, {1, 3, 8, 9, 16});
}

// The pipelined kernel (two steps of weight loads in flight) against the
// reference on the same shapes and slice counts, and bit for bit against the
// unpipelined one (only the order of the loads differs, not the arithmetic).
TEST_F(SkinnyFp8GemmGpu, PipelinedMatchesReferenceAndUnpipelinedBitForBit) {
  for (const Shape& s : {Shape{576, 7168, "V3 kv_a"}, Shape{3072, 1536, "V3 TP8 q_b"},
                         Shape{101, 384, "n % 8 = 5, 3 blocks"}, Shape{6, 128, "one block, n < 8"},
                         Shape{130, 1152, "n = 130, 9 blocks"}, Shape{7168, 2048, "V3 TP8 o_proj"}})
    for (int slices : {0, 1, 4, 16}) check_shape(s, slices, {1, 3, 8, 9, 16}, true);
  // The auto rule (one wave at the pipelined occupancy) on 132 SMs: V3's q_a
  // (192 row groups x 8 slices) fits, q_b (3072 x 1) does not.
  EXPECT_TRUE(skinny_fp8_pipelined_fits(1536, 7168, 0, 132));
  EXPECT_FALSE(skinny_fp8_pipelined_fits(24576, 1536, 0, 132));
  EXPECT_TRUE(skinny_fp8_pipelined_fits(7168, 16384, 0, 132));
  const Fp8Weight w = make_weight(1536, 7168, 91);
  const std::vector<float> x = hashed_bf16_values(16 * 7168, 1.0f, 92);
  const Tensor d_x = device_copy(to_bf16(x), DType::kBF16);
  for (int64_t m : {1, 5, 16})
    for (int slices : {0, 1, 2, 8}) {
      std::vector<uint16_t> got[2];
      for (int pipe = 0; pipe < 2; ++pipe) {
        Tensor out = device_copy(std::vector<uint16_t>(m * 1536, 0), DType::kBF16);
        SkinnyFp8GemmArgs a;
        a.x = d_x.data<__nv_bfloat16>();
        a.x_stride = 7168;
        a.w = w.d_q.data<uint8_t>();
        a.scale_inv = w.d_scale.data<float>();
        a.out = out.raw();
        a.out_stride = 1536;
        a.m = m;
        a.n = 1536;
        a.k = 7168;
        a.slices = slices;
        a.pipelined = pipe == 1;
        ASSERT_EQ(launch_skinny_fp8_gemm(a, nullptr), cudaSuccess);
        got[pipe] = host_copy<uint16_t>(out);
      }
      EXPECT_EQ(got[0], got[1]) << "m " << m << " slices " << slices;
    }
}

// The stream scheme (4-row warps, f32 FMAs on weights converted as value
// times 2^-120, x times 2^60) against the reference at m = 1, 2: the large V3
// shapes, shapes off the tiles (n % 4 != 0, one k block), every slice count,
// subnormal and extreme e4m3 codes (make_weight draws every byte but NaN);
// refusals (m > 2, slices 16, with pipelined).
TEST_F(SkinnyFp8GemmGpu, StreamMatchesReference) {
  check_shape(Shape{7168, 16384, "V3 o_proj"}, 0, {1, 2}, false, true);
  for (const Shape& s : {Shape{576, 7168, "V3 kv_a"}, Shape{101, 384, "n % 8 = 5, 3 blocks"},
                         Shape{6, 128, "one block, n < 8"}, Shape{130, 1152, "n = 130, 9 blocks"},
                         Shape{3072, 1536, "V3 TP8 q_b"}})
    for (int slices : {0, 1, 2, 4, 8}) check_shape(s, slices, {1, 2}, false, true);
  Tensor x = Tensor::empty({4 * 256}, DType::kBF16, Device::kCuda);
  Tensor w = Tensor::empty({64 * 256}, DType::kF8E4M3, Device::kCuda);
  Tensor sc = Tensor::empty({2}, DType::kF32, Device::kCuda);
  Tensor out = Tensor::empty({4 * 64}, DType::kF32, Device::kCuda);
  SkinnyFp8GemmArgs a;
  a.x = x.data<__nv_bfloat16>();
  a.x_stride = 256;
  a.w = w.data<uint8_t>();
  a.scale_inv = sc.data<float>();
  a.out = out.raw();
  a.out_f32 = true;
  a.out_stride = 64;
  a.m = 2;
  a.n = 64;
  a.k = 256;
  a.stream = true;
  EXPECT_EQ(skinny_fp8_gemm_refusal(a), nullptr);
  a.m = 3;
  ASSERT_NE(skinny_fp8_gemm_refusal(a), nullptr);
  EXPECT_NE(std::strstr(skinny_fp8_gemm_refusal(a), "m above 2"), nullptr);
  a.m = 1;
  a.slices = 16;
  ASSERT_NE(skinny_fp8_gemm_refusal(a), nullptr);
  EXPECT_NE(std::strstr(skinny_fp8_gemm_refusal(a), "slices 16"), nullptr);
  a.slices = 0;
  a.pipelined = true;
  ASSERT_NE(skinny_fp8_gemm_refusal(a), nullptr);
  EXPECT_NE(std::strstr(skinny_fp8_gemm_refusal(a), "stream with pipelined"), nullptr);
}

TEST_F(SkinnyFp8GemmGpu, RepeatedLaunchesAreBitIdentical) {
  const int64_t m = 13, n = 2048, k = 7168;
  const auto x = hashed_bf16_values(m * k, 1.0f, 5);
  const Fp8Weight w = make_weight(n, k, 6);
  Tensor d_x = device_copy(to_bf16(x), DType::kBF16);
  std::vector<std::vector<float>> runs;
  for (int run = 0; run < 3; ++run) {
    Tensor out = device_copy(std::vector<float>(m * n, 0.0f), DType::kF32);
    SkinnyFp8GemmArgs a;
    a.x = d_x.data<__nv_bfloat16>();
    a.x_stride = k;
    a.w = w.d_q.data<uint8_t>();
    a.scale_inv = w.d_scale.data<float>();
    a.out = out.raw();
    a.out_stride = n;
    a.out_f32 = true;
    a.m = m;
    a.n = n;
    a.k = k;
    a.slices = 16;
    ASSERT_EQ(launch_skinny_fp8_gemm(a, nullptr), cudaSuccess);
    runs.push_back(host_copy<float>(out));
  }
  EXPECT_EQ(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * 4), 0);
  EXPECT_EQ(std::memcmp(runs[0].data(), runs[2].data(), runs[0].size() * 4), 0);
}

TEST_F(SkinnyFp8GemmGpu, ProgrammaticDependentWaitsForTheKernelWritingX) {
  const int64_t n = 2048, k = 7168;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Fp8Weight w = make_weight(n, k, 11);
  Tensor d_norm_w = device_copy(std::vector<float>(k, 1.0f), DType::kF32);
  for (bool graph : {false, true})
    for (int64_t m : {1, 3, 8, 16}) {
      SCOPED_TRACE(std::string(graph ? "graph" : "eager") + " m=" + std::to_string(m));
      auto src = hashed_bf16_values(m * k, 2.0f, 12 + m);
      Tensor d_src = device_copy(src, DType::kF32);
      Tensor d_x = device_copy(std::vector<uint16_t>(m * k, 0x7fc0), DType::kBF16);  // NaN until the norm writes it
      Tensor d_out = device_copy(std::vector<float>(m * n, 0.0f), DType::kF32);
      SkinnyFp8GemmArgs a;
      a.x = d_x.data<__nv_bfloat16>();
      a.x_stride = k;
      a.w = w.d_q.data<uint8_t>();
      a.scale_inv = w.d_scale.data<float>();
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
        EXPECT_EQ(launch_skinny_fp8_gemm(a, stream), cudaSuccess);
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
      const auto want = reference(x, k, w, m);
      EXPECT_TRUE(all_close(host_copy<float>(d_out), want, 2e-3f * rms(want), 1e-5f, n));
    }
  cudaStreamDestroy(stream);
}

TEST_F(SkinnyFp8GemmGpu, Refusals) {
  Tensor x = Tensor::empty({32 * 256}, DType::kBF16, Device::kCuda);
  Tensor w = Tensor::empty({64 * 256}, DType::kF8E4M3, Device::kCuda);
  Tensor sc = Tensor::empty({2}, DType::kF32, Device::kCuda);
  Tensor out = Tensor::empty({32 * 64}, DType::kF32, Device::kCuda);
  auto args = [&](int64_t m, int64_t k, int64_t x_offset, int slices) {
    SkinnyFp8GemmArgs a;
    a.x = x.data<__nv_bfloat16>() + x_offset;
    a.x_stride = 256;
    a.w = w.data<uint8_t>();
    a.scale_inv = sc.data<float>();
    a.out = out.raw();
    a.out_f32 = true;
    a.out_stride = 64;
    a.m = m;
    a.n = 64;
    a.k = k;
    a.slices = slices;
    return a;
  };
  auto refused = [&](const SkinnyFp8GemmArgs& a, const char* needle) -> ::testing::AssertionResult {
    const char* why = skinny_fp8_gemm_refusal(a);
    if (why == nullptr) return ::testing::AssertionFailure() << "taken";
    if (std::strstr(why, needle) == nullptr) return ::testing::AssertionFailure() << "reason '" << why << "'";
    if (launch_skinny_fp8_gemm(a, nullptr) != cudaErrorInvalidValue)
      return ::testing::AssertionFailure() << "launch did not refuse";
    return ::testing::AssertionSuccess();
  };
  EXPECT_EQ(skinny_fp8_gemm_refusal(args(1, 256, 0, 0)), nullptr);
  EXPECT_EQ(skinny_fp8_gemm_check(args(16, 128, 0, 16)), cudaSuccess);
  EXPECT_TRUE(refused(args(0, 256, 0, 0), "m outside"));
  EXPECT_TRUE(refused(args(17, 256, 0, 0), "m outside"));
  EXPECT_TRUE(refused(args(1, 192, 0, 0), "multiple of 128"));
  EXPECT_TRUE(refused(args(1, 64, 0, 0), "multiple of 128"));
  EXPECT_TRUE(refused(args(1, 256, 4, 0), "x null or not 16-byte aligned"));
  EXPECT_TRUE(refused(args(1, 256, 0, 3), "slices"));
  SkinnyFp8GemmArgs odd_stride = args(2, 128, 0, 0);
  odd_stride.x_stride = 132;
  EXPECT_TRUE(refused(odd_stride, "x_stride"));
  SkinnyFp8GemmArgs no_scale = args(1, 256, 0, 0);
  no_scale.scale_inv = nullptr;
  EXPECT_TRUE(refused(no_scale, "scale_inv"));
  SkinnyFp8GemmArgs no_out = args(1, 256, 0, 0);
  no_out.out = nullptr;
  EXPECT_TRUE(refused(no_out, "no output"));
}

// The backend: its refusals name the reason (and such a weight runs another
// backend); a decode-graph LinearOp of an FP8 weight selects it and matches
// the reference at m = 1, 5, 16, accumulating. (Its rows above 16 run
// fp8_linear_forward, covered by backend_ops_gpu_test's m = 64 and 300.)
TEST_F(SkinnyFp8GemmGpu, LinearBackendSelectionRefusalsAndRun) {
  const int64_t n = 1536, k = 1024;
  const Fp8Weight f = make_weight(n, k, 21);
  LinearWeight lw;
  lw.name = "test.fp8";
  lw.out_features = n;
  lw.in_features = k;
  lw.weight = f.d_q.view({n, k});
  lw.scale_inv = f.d_scale.view({(n + 127) / 128, k / 128});
  lw.block_n = lw.block_k = 128;

  LinearOp prefill(&lw, false);  // not a decode-graph GEMM
  Status s = cuda_ops::linear_skinny_fp8_supports(prefill);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("decode"), std::string::npos) << s.message();

  LinearWeight k192 = lw;  // k = 192: not whole 128 blocks (tiny-dsv3-fp8's shared down_proj)
  k192.in_features = 192;
  k192.weight = f.d_q.slice_flat(0, {n, 192});
  k192.scale_inv = f.d_scale.slice_flat(0, {(n + 127) / 128, 2});
  LinearOp op192(&k192, false);
  op192.set_splitk_allowed(true);
  s = cuda_ops::linear_skinny_fp8_supports(op192);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("multiple of 128"), std::string::npos) << s.message();
  ASSERT_TRUE(op192.select_backend(Device::kCuda).ok());
  EXPECT_NE(op192.backend(), "cuda_skinny_fp8");

  Tensor bf16w = Tensor::empty({n, k}, DType::kBF16, Device::kCuda);
  LinearWeight lb = lw;
  lb.weight = bf16w;
  lb.scale_inv = Tensor();
  LinearOp op_bf16(&lb, false);
  op_bf16.set_splitk_allowed(true);
  s = cuda_ops::linear_skinny_fp8_supports(op_bf16);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("F8_E4M3"), std::string::npos) << s.message();

  for (int64_t m : {1, 5, 16}) {
    SCOPED_TRACE("m=" + std::to_string(m));
    LinearOp op(&lw, true);  // accumulate onto acc0
    op.set_splitk_allowed(true);
    ASSERT_TRUE(op.select_backend(Device::kCuda).ok());
    EXPECT_EQ(op.backend(), "cuda_skinny_fp8");
    const auto x = hashed_bf16_values(m * k, 1.0f, 30 + m);
    const auto acc0 = hashed_bf16_values(m * n, 1.0f, 50 + m);
    Tensor in = device_copy(to_bf16(x), DType::kBF16).view({m, k});
    Tensor out = device_copy(acc0, DType::kF32).view({m, n});
    OpContext ctx;
    ctx.device = Device::kCuda;
    op.run(ctx, {in}, {out});
    auto want = reference(x, k, f, m);
    const float atol = 2e-3f * rms(want);
    for (int64_t i = 0; i < m * n; ++i) want[i] += acc0[i];
    EXPECT_TRUE(all_close(host_copy<float>(out), want, atol, 1e-5f, n));
  }
}

}  // namespace
}  // namespace nucleus::kernels
