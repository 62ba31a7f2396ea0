// NUCLEUS_BENCH_NEEDS_CUDA. Skinny decode GEMM benchmark: every bf16 decode
// linear of DeepSeek-V2-Lite (q_proj, kv_a, o_proj, the router, the shared
// experts' gate_up and down, the dense MLP's, lm_head) and, as bf16 shapes,
// DeepSeek-V3's at TP 1 and TP 8, at m = 1, 2, 4, 8 rows, through
//   cublaslt   cuBLASLt, bf16 out (the engine with NUCLEUS_SKINNY=0)
//   skinny     kernels/gemm/skinny_gemm.cuh, bf16 out, default slice count
//   skinny_pdl the same launched with PDL: each GEMM of the graph a
//              programmatic dependent of the one before (which lets it start
//              at once), as the engine launches them after a norm
//   skinny_sN  with N slices (--sweep 1)
// Method (bench/bench_util.h): CUDA graphs of 20 GEMMs on distinct weight
// copies, enough that a pass reads at least twice the L2; the median per GEMM.
// Bytes = weights + x + out, each once; % of the one roofline
// (core/roofline.h, 4.58 TB/s). Prints a markdown table (docs/perf.md
// "Skinny decode GEMMs").
//
//   skinny_gemm_bench [--m 1,2,4,8] [--model v2lite|v3] [--sweep 0|1]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "bench_util.h"
#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "core/roofline.h"
#include "io/hf_config.h"
#include "kernels/gemm/gemm_cublaslt.h"
#include "kernels/gemm/skinny_gemm.cuh"

using namespace nucleus;
using bench::models_dir;
using bench::parse_list;
using bench::random_bf16;

namespace {

struct Shape {
  std::string model, name;
  int64_t n, k;
};

void shapes_of(const ModelConfig& c, const std::string& model, int tp, std::vector<Shape>* shapes) {
  const int64_t H = c.hidden_size, nh = c.num_attention_heads;
  const std::string m = tp == 1 ? model : model + " TP" + std::to_string(tp);
  if (c.q_lora_rank > 0) {
    shapes->push_back({m, "q_a", c.q_lora_rank, H});
    shapes->push_back({m, "q_b", nh * c.qk_head_dim() / tp, c.q_lora_rank});
  } else {
    shapes->push_back({m, "q_proj", nh * c.qk_head_dim() / tp, H});
  }
  shapes->push_back({m, "kv_a", c.kv_lora_rank + c.qk_rope_head_dim, H});
  shapes->push_back({m, "o_proj", H, nh * c.v_head_dim / tp});
  shapes->push_back({m, "router", c.n_routed_experts, H});
  const int64_t shared = c.moe_intermediate_size * c.n_shared_experts;
  if (shared > 0) {
    shapes->push_back({m, "shared_gate_up", 2 * shared / tp, H});
    shapes->push_back({m, "shared_down", H, shared / tp});
  }
  shapes->push_back({m, "dense_gate_up", 2 * c.intermediate_size / tp, H});
  shapes->push_back({m, "dense_down", H, c.intermediate_size / tp});
  shapes->push_back({m, "lm_head", c.vocab_size / tp, H});
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> ms = {1, 2, 4, 8};
  std::string model_filter;
  bool sweep = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--m")) ms = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--model")) model_filter = argv[i + 1];
    else if (!std::strcmp(argv[i], "--sweep")) sweep = std::strcmp(argv[i + 1], "0") != 0;
  }
  for (int64_t m : ms)
    if (m < 1 || m > kernels::kSkinnyMaxRows) {
      std::fprintf(stderr, "skinny_gemm_bench: --m values must be in [1, %ld]\n", long(kernels::kSkinnyMaxRows));
      return 2;
    }
  auto ctx = cuda::get_context();
  if (!ctx.ok()) {
    std::fprintf(stderr, "skinny_gemm_bench: %s\n", ctx.status().to_string().c_str());
    return 1;
  }
  cuda::Context& c = **ctx;
  std::vector<Shape> shapes;
  for (const auto& [key, file, label, tps] :
       {std::tuple{"v2lite", "deepseek-v2-lite", "V2-Lite", std::vector<int>{1}},
        std::tuple{"v3", "deepseek-v3", "V3", std::vector<int>{1, 8}}}) {
    if (!model_filter.empty() && model_filter != key) continue;
    auto cfg = load_model_config(models_dir() + "/configs/" + file + ".config.json");
    if (!cfg.ok()) {
      std::fprintf(stderr, "skinny_gemm_bench: %s\n", cfg.status().to_string().c_str());
      return 1;
    }
    for (int tp : tps) shapes_of(*cfg, label, tp, &shapes);
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  std::printf("# skinny_gemm_bench %s on %s (%d SMs, L2 %.0f MB); roofline %.2f TB/s\n\n", date, c.name.c_str(),
              c.num_sms, c.l2_bytes / 1e6, roofline::kHbmBytesPerSec / 1e12);
  std::printf("| model | layer | n | k | weight MB | m | variant | slices | us | GB/s | %% of roofline | vs cuBLASLt |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  const int64_t max_m = *std::max_element(ms.begin(), ms.end());
  cudaStream_t stream = c.stream;
  for (const Shape& S : shapes) {
    const int64_t wbytes = S.n * S.k * 2;
    const int copies =
        static_cast<int>(std::max<int64_t>(2, (2 * static_cast<int64_t>(c.l2_bytes) + wbytes - 1) / wbytes));
    std::vector<Tensor> weights;
    {
      Tensor w0 = random_bf16(S.n * S.k, 0.05f);
      for (int i = 0; i < copies; ++i) {
        weights.push_back(Tensor::empty({S.n, S.k}, DType::kBF16, Device::kCuda));
        NUCLEUS_CUDA_CHECK(cudaMemcpy(weights.back().raw(), w0.raw(), w0.nbytes(), cudaMemcpyDeviceToDevice));
      }
    }
    Tensor x = random_bf16(max_m * S.k, 1.0f);
    Tensor out = Tensor::empty({max_m * S.n}, DType::kBF16, Device::kCuda);
    for (int64_t m : ms) {
      double base_us = -1;
      auto row = [&](const std::string& variant, int slices, double us) {
        if (us < 0) {
          std::printf("| %s | %s | %ld | %ld | %.1f | %ld | %s | | refused | | | |\n", S.model.c_str(), S.name.c_str(),
                      long(S.n), long(S.k), wbytes / 1e6, long(m), variant.c_str());
          return;
        }
        const double bytes = static_cast<double>(wbytes + m * S.k * 2 + m * S.n * 2);
        const double gbs = bytes / (us * 1e-6) / 1e9;
        std::printf("| %s | %s | %ld | %ld | %.1f | %ld | %s | %s | %.2f | %.0f | %.1f%% | %s |\n", S.model.c_str(),
                    S.name.c_str(), long(S.n), long(S.k), wbytes / 1e6, long(m), variant.c_str(),
                    slices > 0 ? std::to_string(slices).c_str() : "", us, gbs,
                    100.0 * gbs * 1e9 / roofline::kHbmBytesPerSec,
                    base_us > 0 ? (std::to_string(base_us / us).substr(0, 4) + "x").c_str() : "");
        std::fflush(stdout);
      };
      base_us = bench::median_us_per_launch(copies, [&](int i) {
        kernels::GemmArgs a;
        a.x = x.raw();
        a.x_stride = S.k;
        a.w = weights[i].raw();
        a.out = out.raw();
        a.out_stride = S.n;
        a.out_dtype = DType::kBF16;
        a.m = m;
        a.n = S.n;
        a.k = S.k;
        return kernels::gemm_bf16_cublaslt(a, stream).ok();
      });
      const double cublas = base_us;
      base_us = -1;
      row("cublaslt", 0, cublas);
      base_us = cublas;
      auto skinny = [&](int slices, bool pdl = false) {
        return bench::median_us_per_launch(copies, [&](int i) {
          kernels::SkinnyGemmArgs a;
          a.x = x.data<__nv_bfloat16>();
          a.x_stride = S.k;
          a.w = weights[i].data<__nv_bfloat16>();
          a.out = out.raw();
          a.out_stride = S.n;
          a.m = m;
          a.n = S.n;
          a.k = S.k;
          a.slices = slices;
          a.pdl = pdl;
          return kernels::launch_skinny_gemm(a, stream) == cudaSuccess;
        });
      };
      const int slices = kernels::skinny_default_slices(m, S.n, S.k, c.num_sms);
      row("skinny", slices, skinny(0));
      row("skinny_pdl", slices, skinny(0, true));
      if (sweep)
        for (int s : {1, 2, 4, 8}) row("skinny_s" + std::to_string(s), s, skinny(s));
    }
  }
  return 0;
}
