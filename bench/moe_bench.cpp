// NUCLEUS_BENCH_NEEDS_CUDA: the routed experts of one MoE layer on the GPU.
//
// moe_bench [--reps N] [--decode] [--min-t T] [--max-t T]: MoeExpertsOp (experts only: no router) at
// DeepSeek-V2-Lite (hidden 2048, moe_inter 1408, 64
// experts, top-6, bf16), DeepSeek-V3 (hidden 7168, moe_inter 2048, 256
// experts, top-8) and its TP-8 shard (moe_inter 256), each in bf16 and in FP8
// e4m3 with 128x128 block scales, uniform random routing, T = 1 .. 4096
// tokens (8192, the engine's prefill chunk, with --max-t 8192); cuda_grouped everywhere, cuda_decode (the fused decode kernel) at
// T <= 16 in the same run, cuda_naive at T = 1, 8, 32; FP8 models also with
// NUCLEUS_MOE_FP8_REGISTER_DEQUANT=0 (row "cuda_grouped fp8 via smem") at
// T <= 512, and every model with NUCLEUS_MOE_UP_SPLIT_K=0 (row "cuda_grouped
// up split-K off") and with NUCLEUS_MOE_DEEP_RING=0 (row "cuda_grouped deep
// ring off", the 4-stage ring everywhere) at T <= 16; FP8 models at T = 1
// also with NUCLEUS_MOE_UP_STREAM=0 (row "cuda_grouped up stream off": UP on
// the 16-row MMA tiles); steps of 128-row m-tiles also with NUCLEUS_MOE_WGMMA=0
// and NUCLEUS_MOE_FP8_W8A8=0 (row "cuda_grouped wgmma off": mma.sync 128 x 128
// tiles) and, FP8 models, NUCLEUS_MOE_FP8_W8A8=0 alone (row "cuda_grouped w8a8
// off": bf16 activations on wgmma). Then, at T <= 16, V2-Lite bf16 and V3 FP8 with their
// shared experts as routed ones ("+ 2 shared": 66 experts, top-8; "+ 1
// shared": 257, top-9; every token's last slots on the shared experts), the
// MoE op the engine's decode graphs run. --max-t / --min-t: steps of at most / at least T tokens. --decode: only
// T <= 16 and no cuda_naive (the decode comparison alone).
// Each step is captured in a CUDA graph (which also checks that it can be)
// and the replays are timed with events; the median is printed.
// Bytes: the weights of the experts the step activates (each read once: the
// floor for decode), activations not counted. FLOPs: 6 * T * top_k * hidden
// * inter. Roofline: 4.58 TB/s, 790 TFLOP/s dense bf16 (core/roofline.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <functional>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "core/roofline.h"
#include "graph/step_resources.h"
#include "ops/moe_cuda.h"
#include "kernels/moe/moe_grouped.cuh"
#include "ops/moe_ops.h"

using namespace nucleus;

namespace {

constexpr double kPeakBytesPerSec = roofline::kHbmBytesPerSec;
constexpr double kPeakFlops = roofline::kBf16FlopsPerSec;

struct Model {
  const char* name;
  int64_t hidden, inter, num_experts, top_k;
  bool fp8;
  // The last `shared` experts are shared experts run as routed ones, as the
  // engine's decode graphs do (NUCLEUS_MOE_FUSE_SHARED): every token's last
  // `shared` slots hold them (weight 1 / top_k like the others); its first
  // top_k - shared slots are drawn from the other num_experts - shared.
  int64_t shared = 0;
};

// Random weights at real size: a 64 MiB random pattern on the device, copied
// into every weight at rotating offsets (content does not matter for time;
// values stay finite: valid FP8 codes, small bf16 values).
class WeightFactory {
 public:
  explicit WeightFactory(bool fp8) : fp8_(fp8) {
    const size_t bytes = kPatternBytes;
    std::vector<uint8_t> host(bytes);
    std::mt19937_64 rng(1);
    if (fp8) {
      for (auto& b : host) b = f32_to_fp8e4m3(std::uniform_real_distribution<float>(-448, 448)(rng));
    } else {
      auto* h = reinterpret_cast<uint16_t*>(host.data());
      for (size_t i = 0; i < bytes / 2; ++i) h[i] = f32_to_bf16(std::uniform_real_distribution<float>(-0.05f, 0.05f)(rng));
    }
    pattern_ = Tensor::empty({static_cast<int64_t>(bytes)}, DType::kU8, Device::kCuda);
    copy_to_device(pattern_.raw(), host.data(), bytes);
  }

  LinearWeight make(const std::string& name, int64_t n, int64_t k) {
    LinearWeight w;
    w.name = name;
    w.out_features = n;
    w.in_features = k;
    w.weight = Tensor::empty({n, k}, fp8_ ? DType::kF8E4M3 : DType::kBF16, Device::kCuda);
    fill(w.weight);
    if (fp8_) {
      const int64_t nb = (n + 127) / 128, kb = (k + 127) / 128;
      std::vector<float> s(nb * kb);
      for (size_t i = 0; i < s.size(); ++i) s[i] = (0.5f + 0.001f * static_cast<float>(i % 997)) / 448.0f / 32.0f;
      w.scale_inv = Tensor::empty({nb, kb}, DType::kF32, Device::kCuda);
      copy_to_device(w.scale_inv.raw(), s.data(), s.size() * 4);
      w.block_n = w.block_k = 128;
    }
    return w;
  }

 private:
  static constexpr size_t kPatternBytes = 64ull << 20;
  void fill(Tensor& t) {
    auto* dst = static_cast<char*>(t.raw());
    size_t done = 0;
    while (done < t.nbytes()) {
      const size_t off = (offset_ += 4096 * 37) % (kPatternBytes / 2);
      const size_t n = std::min(t.nbytes() - done, kPatternBytes - off);
      NUCLEUS_CUDA_CHECK(cudaMemcpy(dst + done, static_cast<char*>(pattern_.raw()) + off, n, cudaMemcpyDeviceToDevice));
      done += n;
    }
  }
  bool fp8_;
  Tensor pattern_;
  size_t offset_ = 0;
};

// Median time in microseconds of a CUDA-graph replay of `step`.
double time_us(const std::function<void()>& step, int reps) {
  cudaStream_t stream = cuda::context().stream;
  step();  // first run: state and workspace allocation, kernel attributes
  NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  NUCLEUS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  step();
  NUCLEUS_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  NUCLEUS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) NUCLEUS_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) NUCLEUS_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    NUCLEUS_CUDA_CHECK(cudaEventRecord(ev[2 * i], stream));
    NUCLEUS_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    NUCLEUS_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], stream));
  }
  NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> us(reps);
  for (int i = 0; i < reps; ++i) {
    float ms = 0;
    NUCLEUS_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    us[i] = ms * 1e3;
  }
  for (auto& e : ev) NUCLEUS_CUDA_CHECK(cudaEventDestroy(e));
  NUCLEUS_CUDA_CHECK(cudaGraphExecDestroy(exec));
  NUCLEUS_CUDA_CHECK(cudaGraphDestroy(graph));
  std::sort(us.begin(), us.end());
  return us[reps / 2];
}

const Backend<MoeExpertsOp>& backend_named(const char* name) {
  for (const auto& b : MoeExpertsOp::backends())
    if (b.device == Device::kCuda && std::strcmp(b.name, name) == 0) return b;
  NUCLEUS_CHECK(false, "no moe_experts backend {}", name);
  return MoeExpertsOp::backends().front();
}

void bench_model(const Model& m, int reps, bool decode_only, int64_t min_t, int64_t max_t) {
  WeightFactory factory(m.fp8);
  std::deque<LinearWeight> weights;
  std::vector<ExpertWeights> experts;
  for (int64_t e = 0; e < m.num_experts; ++e) {
    weights.push_back(factory.make("e" + std::to_string(e) + ".gate_up", 2 * m.inter, m.hidden));
    weights.push_back(factory.make("e" + std::to_string(e) + ".down", m.hidden, m.inter));
    experts.push_back({&weights[weights.size() - 2], &weights.back()});
  }
  const double expert_bytes = static_cast<double>(weights[0].weight.nbytes() + weights[1].weight.nbytes() +
                                                  (m.fp8 ? weights[0].scale_inv.nbytes() + weights[1].scale_inv.nbytes()
                                                         : 0));
  MoeExpertsOp grouped(experts, m.inter, m.top_k), decode(experts, m.inter, m.top_k), naive(experts, m.inter, m.top_k);
  NUCLEUS_CHECK_OK(grouped.use_backend(backend_named("cuda_grouped")));
  const Status decode_ok = decode.use_backend(backend_named("cuda_decode"));
  if (!decode_ok.ok()) std::printf("(%s: cuda_decode refuses: %s)\n", m.name, decode_ok.message().c_str());
  StepResources res;  // the ops' workspace, as the engine's; sized for the largest T below
  std::vector<Op*> ops = {&grouped};
  if (decode_ok.ok()) ops.push_back(&decode);
  NUCLEUS_CHECK_OK(res.reserve_ops(ops, StepLimits{.max_tokens = decode_only ? 16 : std::min<int64_t>(max_t, 8192)}, Device::kCuda));
  std::mt19937_64 rng(7);
  for (int64_t T : {1, 2, 4, 8, 16, 32, 128, 512, 4096, 8192}) {
    if ((decode_only && T > 16) || T > max_t) break;
    if (T < min_t) continue;
    std::vector<int32_t> ids(T * m.top_k);
    std::vector<float> w(T * m.top_k);
    std::vector<int32_t> perm(m.num_experts);
    std::set<int32_t> touched;
    const int64_t routed = m.num_experts - m.shared;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < m.num_experts; ++e) perm[e] = static_cast<int32_t>(e);
      for (int64_t k = 0; k < m.top_k; ++k) {
        if (k < m.top_k - m.shared)
          std::swap(perm[k], perm[k + rng() % (routed - k)]);
        else
          perm[k] = static_cast<int32_t>(routed + k - (m.top_k - m.shared));
        ids[t * m.top_k + k] = perm[k];
        touched.insert(perm[k]);
        w[t * m.top_k + k] = 1.0f / static_cast<float>(m.top_k);
      }
    }
    std::vector<uint16_t> x(T * m.hidden);
    for (auto& v : x) v = f32_to_bf16(std::uniform_real_distribution<float>(-1, 1)(rng));
    Tensor d_x = to_device(Tensor::wrap(x.data(), {T, m.hidden}, DType::kBF16, Device::kCpu, nullptr));
    Tensor d_ids = to_device(Tensor::wrap(ids.data(), {T, m.top_k}, DType::kI32, Device::kCpu, nullptr));
    Tensor d_w = to_device(Tensor::wrap(w.data(), {T, m.top_k}, DType::kF32, Device::kCpu, nullptr));
    Tensor out = Tensor::empty({T, m.hidden}, DType::kBF16, Device::kCuda);
    Tensor scratch = Tensor::empty({256, m.top_k * m.inter}, DType::kF32, Device::kCuda);
    NUCLEUS_CUDA_CHECK(cudaDeviceSynchronize());
    OpContext ctx;
    ctx.device = Device::kCuda;
    ctx.stream = cuda::context().stream;
    NUCLEUS_CHECK_OK(res.begin_step(ctx));  // sets ctx.workspace
    const double bytes = static_cast<double>(touched.size()) * expert_bytes;
    const double flops = 6.0 * static_cast<double>(T * m.top_k) * static_cast<double>(m.hidden * m.inter);
    auto report = [&](const char* backend, double us) {
      const double s = us * 1e-6;
      std::printf("| %s | %s | %lld | %zu | %.1f | %.1f | %.0f | %.1f%% | %.1f | %.1f%% |\n", m.name, backend,
                  static_cast<long long>(T), touched.size(), bytes / 1e6, us, bytes / s / 1e9,
                  100.0 * bytes / s / kPeakBytesPerSec, flops / s / 1e12, 100.0 * flops / s / kPeakFlops);
      std::fflush(stdout);
    };
    report("cuda_grouped", time_us([&] { grouped.run(ctx, {d_x, d_ids, d_w}, {out, scratch}); }, reps));
    NUCLEUS_CHECK_OK(ctx.error);
    // The same backend with switches changed (set for the row, then restored).
    auto report_with_all = [&](std::vector<std::pair<const char*, const char*>> knobs, const char* row) {
      std::vector<std::pair<const char*, std::optional<std::string>>> saved;
      for (const auto& [knob, value] : knobs) {
        const char* before = std::getenv(knob);
        saved.emplace_back(knob, before ? std::optional<std::string>(before) : std::nullopt);
        setenv(knob, value, 1);
      }
      report(row, time_us([&] { grouped.run(ctx, {d_x, d_ids, d_w}, {out, scratch}); }, reps));
      for (const auto& [knob, before] : saved) {
        if (before) setenv(knob, before->c_str(), 1);
        else unsetenv(knob);
      }
      NUCLEUS_CHECK_OK(ctx.error);
    };
    auto report_with = [&](const char* knob, const char* value, const char* row) {
      report_with_all({{knob, value}}, row);
    };
    // FP8 weights dequantized through a bf16 shared-memory tile (the path before).
    if (m.fp8 && T <= 512) report_with("NUCLEUS_MOE_FP8_REGISTER_DEQUANT", "0", "cuda_grouped fp8 via smem");
    // The UP GEMM without split-K (the rule splits decode steps of few pairs;
    // FP8 models at T = 1 run UP in the stream scheme, unsplit, in both rows).
    if (T <= 16) report_with("NUCLEUS_MOE_UP_SPLIT_K", "0", "cuda_grouped up split-K off");
    if (T <= 16) report_with("NUCLEUS_MOE_DEEP_RING", "0", "cuda_grouped deep ring off");
    // One-token FP8 steps: the UP GEMM as 16-row MMA tiles instead of the FP8 stream scheme.
    if (m.fp8 && T == 1) report_with("NUCLEUS_MOE_UP_STREAM", "0", "cuda_grouped up stream off");
    // Steps of 128-row m-tiles: the GEMMs on mma.sync 128 x 128 tiles instead of wgmma.
    if (kernels::moe_grouped_pick_bm(T, {m.hidden, m.inter, m.num_experts, m.top_k}) == 128) {
      report_with_all({{"NUCLEUS_MOE_WGMMA", "0"}, {"NUCLEUS_MOE_FP8_W8A8", "0"}}, "cuda_grouped wgmma off");
      // FP8: W8A16 on wgmma (bf16 activations, weights converted to bf16) instead of W8A8.
      if (m.fp8) report_with("NUCLEUS_MOE_FP8_W8A8", "0", "cuda_grouped w8a8 off");
    }
    if (decode_ok.ok() && T <= 16) {
      report("cuda_decode", time_us([&] { decode.run(ctx, {d_x, d_ids, d_w}, {out, scratch}); }, reps));
      NUCLEUS_CHECK_OK(ctx.error);
    }
    if (!decode_only && (T == 1 || T == 8 || T == 32))
      report("cuda_naive", time_us([&] { cuda_ops::moe_experts_naive(naive, ctx, {d_x, d_ids, d_w}, {out, scratch}); },
                                   std::max(3, reps / 4)));
  }
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  bool decode_only = false;
  int64_t min_t = 1, max_t = 4096;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--decode") == 0) {
      decode_only = true;
    } else if (std::strcmp(argv[i], "--max-t") == 0 && i + 1 < argc) {
      max_t = std::clamp(std::atoi(argv[++i]), 1, 8192);
    } else if (std::strcmp(argv[i], "--min-t") == 0 && i + 1 < argc) {
      min_t = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "moe_bench: unknown argument '%s' (usage: moe_bench [--reps N] [--decode] [--min-t T] [--max-t T])\n", argv[i]);
      return 2;
    }
  }
  auto ctx = cuda::get_context();
  if (!ctx.ok()) {
    std::fprintf(stderr, "moe_bench needs a GPU: %s\n", ctx.status().message().c_str());
    return 1;
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  std::printf("MoE experts layer (the experts only, no router), %s, %s, %d SMs; median of %d CUDA-graph replays\n\n", date,
              (*ctx)->name.c_str(), (*ctx)->num_sms, reps);
  std::printf("| model | backend | T | experts touched | weight MB | time us | GB/s | %% of 4.58 TB/s | TFLOP/s | "
              "%% of 790 |\n|---|---|---|---|---|---|---|---|---|---|\n");
  bench_model({"V2-Lite bf16", 2048, 1408, 64, 6, false}, reps, decode_only, min_t, max_t);
  bench_model({"V3 bf16", 7168, 2048, 256, 8, false}, reps, decode_only, min_t, max_t);
  bench_model({"V3 TP8 bf16", 7168, 256, 256, 8, false}, reps, decode_only, min_t, max_t);
  bench_model({"V3 fp8", 7168, 2048, 256, 8, true}, reps, decode_only, min_t, max_t);
  bench_model({"V3 TP8 fp8", 7168, 256, 256, 8, true}, reps, decode_only, min_t, max_t);
  // With the shared experts as routed ones (the engine's decode graphs on CUDA).
  if (min_t <= 16) {
    bench_model({"V2-Lite bf16 + 2 shared", 2048, 1408, 66, 8, false, 2}, reps, decode_only, min_t, std::min<int64_t>(max_t, 16));
    bench_model({"V3 fp8 + 1 shared", 7168, 2048, 257, 9, true, 1}, reps, decode_only, min_t, std::min<int64_t>(max_t, 16));
  }
  return 0;
}
