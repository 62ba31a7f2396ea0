// NUCLEUS_BENCH_NEEDS_CUDA. Dense GEMM benchmark: DeepSeek-V2-Lite's bf16
// linears (cuBLASLt) and DeepSeek-V3's FP8 block-scaled linears (own kernels
// "cuda_fp8", cuBLASLt "cublaslt_fp8" with its activation quantization, and
// the plain "cuda_naive" for small m), at m = 1 .. 4096 rows.
//
// Method (docs/gpu.md, docs/perf.md): each timing replays CUDA graphs of 20
// GEMMs on distinct weight copies, enough copies that one pass reads at least
// twice the L2 (weights come from DRAM, as in a real step); events around each
// graph replay, the median over replays, divided by 20. Bytes = weights (+
// scales) + x + out, each once; % of the 4.58 TB/s read roofline; TFLOP/s =
// 2mnk / time. Prints a markdown table.
//
//   gemm_bench [--m 1,4,8] [--model v2lite|v3] [--max-naive-m 8]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "core/roofline.h"
#include "kernels/gemm/gemm_cublaslt.h"
#include "kernels/gemm/gemm_naive.cuh"
#include "ops/linear_cuda.h"

using namespace nucleus;

namespace {

constexpr double kRooflineBytesPerSec = roofline::kHbmBytesPerSec;

struct Layer {
  const char* model;
  const char* name;
  int64_t n, k;
  bool fp8;
};

const Layer kLayers[] = {
    {"V2-Lite", "kv_a", 576, 2048, false},       {"V2-Lite", "q_proj", 3072, 2048, false},
    {"V2-Lite", "o_proj", 2048, 2048, false},    {"V2-Lite", "kv_b", 4096, 512, false},
    {"V3", "q_a", 1536, 7168, true},             {"V3", "q_b", 24576, 1536, true},
    {"V3", "o_proj", 7168, 16384, true},         {"V3", "kv_a", 576, 7168, true},
    {"V3", "gate_up", 36864, 7168, true},        {"V3", "down", 7168, 18432, true},
};

// Device buffer with random content: bf16 values in [-1, 1), e4m3 bytes
// (no NaN), or f32 scales ~1e-3.
Tensor random_device(int64_t count, DType dtype) {
  Tensor t = Tensor::empty({count}, dtype, Device::kCuda);
  std::vector<uint8_t> host(t.nbytes());
  if (dtype == DType::kF8E4M3) {
    for (auto& b : host) {
      b = static_cast<uint8_t>(bench::next_rand() >> 40);
      if ((b & 0x7f) == 0x7f) b ^= 1;
    }
  } else if (dtype == DType::kBF16) {
    auto* h = reinterpret_cast<uint16_t*>(host.data());
    for (int64_t i = 0; i < count; ++i) h[i] = f32_to_bf16(static_cast<float>(bench::next_rand() % 2000) / 1000.0f - 1.0f);
  } else {
    auto* f = reinterpret_cast<float*>(host.data());
    for (int64_t i = 0; i < count; ++i) f[i] = 1e-3f * (0.5f + static_cast<float>(bench::next_rand() % 1000) / 1000.0f);
  }
  copy_to_device(t.raw(), host.data(), host.size());
  return t;
}

// Median microseconds per GEMM over graphs of 20 (bench/bench_util.h);
// negative when the eager call fails.
double time_per_gemm(int copies, const std::function<Status(int)>& launch) {
  return bench::median_us_per_launch(copies, [&](int i) { return launch(i).ok(); });
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> ms = {1, 4, 8, 16, 32, 64, 128, 1024, 4096};
  std::string model_filter;
  int64_t max_naive_m = 8;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--m")) ms = bench::parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--model")) model_filter = argv[i + 1];
    else if (!std::strcmp(argv[i], "--max-naive-m")) max_naive_m = std::strtoll(argv[i + 1], nullptr, 10);
  }
  auto ctx = cuda::get_context();
  if (!ctx.ok()) {
    std::fprintf(stderr, "gemm_bench: %s\n", ctx.status().to_string().c_str());
    return 1;
  }
  cuda::Context& c = **ctx;
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  std::printf("# gemm_bench %s on %s (%d SMs, L2 %.0f MB)\n", date, c.name.c_str(), c.num_sms, c.l2_bytes / 1e6);
  std::printf("| model | layer | n | k | m | backend | us | GB/s | %% of 4.58 TB/s | TFLOP/s |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  const int64_t max_m = *std::max_element(ms.begin(), ms.end());

  for (const Layer& L : kLayers) {
    if (!model_filter.empty() && model_filter != (L.fp8 ? "v3" : "v2lite")) continue;
    const int64_t wbytes = L.n * L.k * (L.fp8 ? 1 : 2);
    const int64_t sbytes = L.fp8 ? ((L.n + 127) / 128) * ((L.k + 127) / 128) * 4 : 0;
    const int copies = static_cast<int>(std::max<int64_t>(2, (2 * static_cast<int64_t>(c.l2_bytes) + wbytes - 1) / wbytes));
    std::vector<LinearWeight> weights(copies);
    {
      Tensor w0 = random_device(L.n * L.k, L.fp8 ? DType::kF8E4M3 : DType::kBF16);
      Tensor s0 = L.fp8 ? random_device(sbytes / 4, DType::kF32) : Tensor();
      for (int i = 0; i < copies; ++i) {
        LinearWeight& w = weights[i];
        w.name = std::string(L.model) + "." + L.name;
        w.out_features = L.n;
        w.in_features = L.k;
        w.weight = Tensor::empty({L.n, L.k}, L.fp8 ? DType::kF8E4M3 : DType::kBF16, Device::kCuda);
        NUCLEUS_CUDA_CHECK(cudaMemcpy(w.weight.raw(), w0.raw(), w0.nbytes(), cudaMemcpyDeviceToDevice));
        if (L.fp8) {
          w.scale_inv = Tensor::empty({(L.n + 127) / 128, (L.k + 127) / 128}, DType::kF32, Device::kCuda);
          NUCLEUS_CUDA_CHECK(cudaMemcpy(w.scale_inv.raw(), s0.raw(), s0.nbytes(), cudaMemcpyDeviceToDevice));
          w.block_n = w.block_k = 128;
        }
      }
    }
    Tensor x = random_device(max_m * L.k, DType::kBF16);
    Tensor out = Tensor::empty({max_m * L.n}, DType::kBF16, Device::kCuda);

    for (int64_t m : ms) {
      struct Variant {
        const char* name;
        std::function<Status(int)> launch;
      };
      std::vector<Variant> variants;
      // The FP8 paths' scratch, as the step executor reserves it for the op.
      cuda_ops::Fp8LinearScratchOwner own_scratch, cublas_scratch;
      if (L.fp8) {
        NUCLEUS_CHECK_OK(cuda_ops::Fp8LinearScratchOwner::create(m, L.n, L.k, cuda_ops::Fp8Path::kOwn, &own_scratch));
        NUCLEUS_CHECK_OK(
            cuda_ops::Fp8LinearScratchOwner::create(m, L.n, L.k, cuda_ops::Fp8Path::kCublas, &cublas_scratch));
        variants.push_back({"cuda_fp8", [&](int i) {
                              return cuda_ops::fp8_linear_forward(weights[i], x.raw(), L.k, m, out.raw(), DType::kBF16,
                                                                  L.n, false, own_scratch.scratch(),
                                                                  cuda_ops::Fp8Path::kOwn);
                            }});
        if (cuda_ops::fp8_cublaslt_layout_supported(L.n, L.k).ok())
          variants.push_back({"cublaslt_fp8", [&](int i) {
                                return cuda_ops::fp8_linear_forward(weights[i], x.raw(), L.k, m, out.raw(),
                                                                    DType::kBF16, L.n, false, cublas_scratch.scratch(),
                                                                    cuda_ops::Fp8Path::kCublas);
                              }});
      } else {
        variants.push_back({"cublaslt", [&](int i) {
                              kernels::GemmArgs a;
                              a.x = x.raw();
                              a.x_stride = L.k;
                              a.w = weights[i].weight.raw();
                              a.out = out.raw();
                              a.out_stride = L.n;
                              a.out_dtype = DType::kBF16;
                              a.m = m;
                              a.n = L.n;
                              a.k = L.k;
                              return kernels::gemm_bf16_cublaslt(a, cuda::context().stream);
                            }});
      }
      if (m <= max_naive_m)
        variants.push_back({"cuda_naive", [&](int i) {
                              cudaError_t e = kernels::launch_gemm_naive(
                                  x.data<__nv_bfloat16>(), L.k, cuda_ops::weight_view(weights[i]), m, out.raw(),
                                  DType::kBF16, L.n, false, cuda::context().stream);
                              return e == cudaSuccess ? ok_status() : internal_error(cudaGetErrorString(e));
                            }});
      for (const Variant& v : variants) {
        const double us = time_per_gemm(copies, v.launch);
        if (us < 0) {
          std::printf("| %s | %s | %ld | %ld | %ld | %s | refused | | | |\n", L.model, L.name, long(L.n), long(L.k),
                      long(m), v.name);
          continue;
        }
        const double bytes = static_cast<double>(wbytes + sbytes + m * L.k * 2 + m * L.n * 2);
        const double gbs = bytes / (us * 1e-6) / 1e9;
        const double tflops = 2.0 * m * L.n * L.k / (us * 1e-6) / 1e12;
        std::printf("| %s | %s | %ld | %ld | %ld | %s | %.1f | %.0f | %.0f%% | %.1f |\n", L.model, L.name, long(L.n),
                    long(L.k), long(m), v.name, us, gbs, 100.0 * gbs * 1e9 / kRooflineBytesPerSec, tflops);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
