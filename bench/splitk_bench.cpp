// NUCLEUS_BENCH_NEEDS_CUDA. Split-K decode GEMM benchmark: the decode GEMMs
// that prezero serves (q_a or q_proj, kv_a, q_b, o_proj, the MoE router, the
// shared experts' gate_up; shapes from models/configs/*.json) of
// DeepSeek-V2-Lite and DeepSeek-V3 (as bf16 weights: V3's checkpoint is FP8
// except the router), at m = 1, 4, 8, 16, 32, 64 rows, through
//   cublaslt      cuBLASLt, bf16 out (the engine without split-K)
//   memset        zeroing the [m, n] f32 output alone (what zero_init costs)
//   splitk_zero   split-K, f32 atomics, zero_init = true (memset + kernel)
//   splitk_pre    split-K, f32 atomics, zero_init = false (output prezero'd)
//   splitk_det    split-K, deterministic reduction, zero_init = true
//   splitk_pre_sN split-K prezero'd with N splits (--sweep 1): the best N per shape
// and the prezero donor: the fused residual add + RMSNorm of the hidden state
// alone and with the zero-fill of each donor's [m, n_total] buffer.
//
// Method (as bench/gemm_bench.cpp): CUDA graphs of 20 GEMMs on distinct
// weight copies, enough copies that a pass reads at least twice the L2 (so
// weights come from DRAM); events around each graph replay, the median over
// replays, divided by 20. Bytes = weights + x + out, each once; % of the 4.58
// TB/s read roofline. Prints markdown tables (docs/perf.md "Split-K decode
// GEMMs and prezero").
//
//   splitk_bench [--m 1,4,8,16,32,64] [--model v2lite|v3] [--sweep 0|1]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "core/roofline.h"
#include "io/hf_config.h"
#include "kernels/gemm/gemm_cublaslt.h"
#include "kernels/gemm/splitk_gemm.cuh"
#include "kernels/rmsnorm/rmsnorm.cuh"
#include "ops/basic_ops_cuda.h"
#include "ops/prezero.h"

using namespace nucleus;
using bench::models_dir;
using bench::parse_list;
using bench::random_bf16;

namespace {

constexpr double kRooflineBytesPerSec = roofline::kHbmBytesPerSec;

struct Shape {
  std::string model, name;
  int64_t n, k;
};

struct Donor {
  std::string model, name;
  int64_t width, n_total, n_base;
};

// The prezero consumers' GEMMs and the two donors of one model config.
void shapes_of(const ModelConfig& c, const std::string& model, std::vector<Shape>* shapes,
               std::vector<Donor>* donors) {
  const int64_t H = c.hidden_size, nh = c.num_attention_heads;
  int64_t base = 0;
  if (c.q_lora_rank > 0) {
    shapes->push_back({model, "q_a", c.q_lora_rank, H});
    base += c.q_lora_rank;
  } else {
    shapes->push_back({model, "q_proj", nh * c.qk_head_dim(), H});
    base += nh * c.qk_head_dim();
  }
  shapes->push_back({model, "kv_a", c.kv_lora_rank + c.qk_rope_head_dim, H});
  base += c.kv_lora_rank + c.qk_rope_head_dim;
  if (c.q_lora_rank > 0) {
    shapes->push_back({model, "q_b", nh * c.qk_head_dim(), c.q_lora_rank});
    base += nh * c.qk_head_dim();
  }
  shapes->push_back({model, "o_proj", H, nh * c.v_head_dim});
  donors->push_back({model, "input_layernorm", H, base + H, base});
  // The shared MLP's gate_up as its own GEMM: the decode graph with
  // NUCLEUS_MOE_FUSE_SHARED=0 (by default on CUDA the shared experts run in
  // the routed experts' op, and this shape is not a decode GEMM).
  const int64_t shared = 2 * c.moe_intermediate_size * c.n_shared_experts;
  shapes->push_back({model, "gate", c.n_routed_experts, H});
  if (shared > 0) shapes->push_back({model, "shared_gate_up", shared, H});
  donors->push_back({model, "post_attention_layernorm", H, c.n_routed_experts + shared, c.n_routed_experts + shared});
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> ms = {1, 4, 8, 16, 32, 64};
  std::string model_filter;
  bool sweep = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--m")) ms = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--model")) model_filter = argv[i + 1];
    else if (!std::strcmp(argv[i], "--sweep")) sweep = std::strcmp(argv[i + 1], "0") != 0;
  }
  for (int64_t m : ms)
    if (m < 1 || m > kernels::kSplitKMaxRows) {
      std::fprintf(stderr, "splitk_bench: --m values must be in [1, %ld]\n", long(kernels::kSplitKMaxRows));
      return 2;
    }
  auto ctx = cuda::get_context();
  if (!ctx.ok()) {
    std::fprintf(stderr, "splitk_bench: %s\n", ctx.status().to_string().c_str());
    return 1;
  }
  cuda::Context& c = **ctx;
  std::vector<Shape> shapes;
  std::vector<Donor> donors;
  for (const auto& [key, file, label] : {std::tuple{"v2lite", "deepseek-v2-lite", "V2-Lite"},
                                         std::tuple{"v3", "deepseek-v3", "V3"}}) {
    if (!model_filter.empty() && model_filter != key) continue;
    auto cfg = load_model_config(models_dir() + "/configs/" + file + ".config.json");
    if (!cfg.ok()) {
      std::fprintf(stderr, "splitk_bench: %s\n", cfg.status().to_string().c_str());
      return 1;
    }
    shapes_of(*cfg, label, &shapes, &donors);
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  std::printf("# splitk_bench %s on %s (%d SMs, L2 %.0f MB)\n\n", date, c.name.c_str(), c.num_sms, c.l2_bytes / 1e6);
  std::printf("| model | layer | n | k | m | variant | splits | us | GB/s | %% of 4.58 TB/s |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  const int64_t max_m = *std::max_element(ms.begin(), ms.end());
  cudaStream_t stream = c.stream;

  // The deterministic mode's workspace (64 MB of partials).
  Tensor partial = Tensor::empty({int64_t{16} << 20}, DType::kF32, Device::kCuda);
  Tensor counters = Tensor::empty({4096}, DType::kI32, Device::kCuda);
  NUCLEUS_CUDA_CHECK(cudaMemset(counters.raw(), 0, counters.nbytes()));
  const kernels::SplitKWorkspace det_ws{partial.data<float>(), partial.numel(), counters.data<int32_t>(), 4096};
  const kernels::SplitKWorkspace no_ws;

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
    Tensor out_bf16 = Tensor::empty({max_m * S.n}, DType::kBF16, Device::kCuda);
    Tensor out_f32 = Tensor::empty({max_m * S.n}, DType::kF32, Device::kCuda);
    NUCLEUS_CUDA_CHECK(cudaMemset(out_f32.raw(), 0, out_f32.nbytes()));
    for (int64_t m : ms) {
      auto splitk = [&](int i, bool zero_init, int splits, kernels::SplitKMode mode) {
        kernels::SplitKGemmArgs a;
        a.x = x.data<__nv_bfloat16>();
        a.x_stride = S.k;
        a.w = weights[i].data<__nv_bfloat16>();
        a.out = out_f32.data<float>();
        a.out_stride = S.n;
        a.m = m;
        a.n = S.n;
        a.k = S.k;
        a.zero_init = zero_init;
        a.splits = splits;
        a.mode = mode;
        return a;
      };
      auto row = [&](const char* variant, int splits, double us, int64_t out_bytes_per_elem, bool gemm) {
        if (us < 0) {
          std::printf("| %s | %s | %ld | %ld | %ld | %s | | refused | | |\n", S.model.c_str(), S.name.c_str(),
                      long(S.n), long(S.k), long(m), variant);
          return;
        }
        const double bytes =
            gemm ? static_cast<double>(wbytes + m * S.k * 2 + m * S.n * out_bytes_per_elem) : double(m * S.n * 4);
        const double gbs = bytes / (us * 1e-6) / 1e9;
        std::printf("| %s | %s | %ld | %ld | %ld | %s | %s | %.2f | %.0f | %.0f%% |\n", S.model.c_str(),
                    S.name.c_str(), long(S.n), long(S.k), long(m), variant,
                    splits > 0 ? std::to_string(splits).c_str() : "", us, gbs, 100.0 * gbs * 1e9 / kRooflineBytesPerSec);
        std::fflush(stdout);
      };
      row("cublaslt", 0, bench::median_us_per_launch(copies, [&](int i) {
            kernels::GemmArgs a;
            a.x = x.raw();
            a.x_stride = S.k;
            a.w = weights[i].raw();
            a.out = out_bf16.raw();
            a.out_stride = S.n;
            a.out_dtype = DType::kBF16;
            a.m = m;
            a.n = S.n;
            a.k = S.k;
            return kernels::gemm_bf16_cublaslt(a, stream).ok();
          }), 2, true);
      row("memset", 0, bench::median_us_per_launch(copies, [&](int) {
            return cudaMemsetAsync(out_f32.raw(), 0, static_cast<size_t>(m * S.n) * 4, stream) == cudaSuccess;
          }), 4, false);
      const int auto_splits = kernels::splitk_effective_splits(splitk(0, true, 0, kernels::SplitKMode::kAtomic), no_ws);
      for (const auto& [variant, zero_init, mode] :
           {std::tuple{"splitk_zero", true, kernels::SplitKMode::kAtomic},
            std::tuple{"splitk_pre", false, kernels::SplitKMode::kAtomic},
            std::tuple{"splitk_det", true, kernels::SplitKMode::kDeterministic}}) {
        const auto& ws = mode == kernels::SplitKMode::kDeterministic ? det_ws : no_ws;
        const int splits = kernels::splitk_effective_splits(splitk(0, zero_init, 0, mode), ws);
        row(variant, splits, bench::median_us_per_launch(copies, [&](int i) {
              return kernels::launch_splitk_gemm(splitk(i, zero_init, 0, mode), ws, stream) == cudaSuccess;
            }), 4, true);
      }
      if (!sweep) continue;
      double best_us = 1e30;
      int best = 0;
      const int64_t k_blocks = (S.k + kernels::kSplitKBlockK - 1) / kernels::kSplitKBlockK;
      for (int s = 1; s <= std::min<int64_t>(64, k_blocks); s *= 2) {
        const int eff = kernels::splitk_effective_splits(splitk(0, false, s, kernels::SplitKMode::kAtomic), no_ws);
        if (eff != s) continue;  // rounded to the same count as another
        const double us = bench::median_us_per_launch(copies, [&](int i) {
          return kernels::launch_splitk_gemm(splitk(i, false, s, kernels::SplitKMode::kAtomic), no_ws, stream) ==
                 cudaSuccess;
        });
        const std::string name = "splitk_pre_s" + std::to_string(s);
        row(name.c_str(), s, us, 4, true);
        if (us > 0 && us < best_us) best_us = us, best = s;
      }
      std::printf("| %s | %s | %ld | %ld | %ld | best (auto %d) | %d | %.2f | | |\n", S.model.c_str(), S.name.c_str(),
                  long(S.n), long(S.k), long(m), auto_splits, best, best_us);
    }
  }

  // The donors: add + RMSNorm alone, then with the zero-fill the gate allows.
  std::printf("\n| model | donor | hidden | n_total | n_base | m | gate | norm us | norm+fill us | fill MB |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Donor& D : donors) {
    const int copies = 20;
    std::vector<Tensor> residual, delta, out;
    for (int i = 0; i < copies; ++i) {
      residual.push_back(Tensor::empty({max_m * D.width}, DType::kF32, Device::kCuda));
      NUCLEUS_CUDA_CHECK(cudaMemset(residual.back().raw(), 0, residual.back().nbytes()));
      delta.push_back(random_bf16(max_m * D.width, 1.0f));
      out.push_back(Tensor::empty({max_m * D.width}, DType::kBF16, Device::kCuda));
    }
    Tensor w = Tensor::empty({D.width}, DType::kF32, Device::kCuda);
    NUCLEUS_CUDA_CHECK(cudaMemset(w.raw(), 0, w.nbytes()));
    Tensor buf = Tensor::empty({max_m * D.n_total}, DType::kF32, Device::kCuda);
    for (int64_t m : ms) {
      const PrezeroFill fill = prezero_fill(m, D.n_total, D.n_base);
      const int64_t cols = fill == PrezeroFill::kAll ? D.n_total : fill == PrezeroFill::kBase ? D.n_base : 0;
      auto launch = [&](int i, bool with_fill) {
        kernels::AddRmsNormParams p;
        p.residual = residual[i].data<float>();
        p.delta = delta[i].raw();
        p.w = w.data<float>();
        p.rows = m;
        p.width = D.width;
        p.out = out[i].data<__nv_bfloat16>();
        if (with_fill && cols > 0) {
          p.zero_fill = buf.data<float>();
          p.zero_fill_count = m * cols;
          p.fill_blocks = cuda_ops::prezero_fill_blocks(m, m * cols * 4);
        }
        return kernels::launch_add_rmsnorm(p, stream) == cudaSuccess;
      };
      const double alone = bench::median_us_per_launch(copies, [&](int i) { return launch(i, false); });
      const double filled = bench::median_us_per_launch(copies, [&](int i) { return launch(i, true); });
      std::printf("| %s | %s | %ld | %ld | %ld | %ld | %s | %.2f | %.2f | %.2f |\n", D.model.c_str(), D.name.c_str(),
                  long(D.width), long(D.n_total), long(D.n_base), long(m), prezero_fill_name(fill), alone, filled,
                  m * cols * 4 / 1e6);
      std::fflush(stdout);
    }
  }
  return 0;
}
