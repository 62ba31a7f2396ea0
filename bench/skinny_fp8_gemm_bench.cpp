// NUCLEUS_BENCH_NEEDS_CUDA. Skinny FP8 decode GEMM benchmark: every FP8
// block-scaled decode linear of DeepSeek-V3 and Kimi-K2 (q_a, q_b, kv_a,
// o_proj, the shared experts' gate_up and down, the dense MLP's) at the TP
// shard widths asked for, at m = 1, 2, 4, 8, 16 rows, bf16 out, through
//   cublaslt_fp8  activation quantization + cuBLASLt's block-scaled FP8 GEMM
//                 (Fp8Path::kCublas; m % 4 != 0 padded), "refused" where
//                 cuBLASLt does not take the layout
//   cuda_fp8      the own decode kernel (Fp8Path::kOwn, kernels/gemm/fp8_gemm_decode.cu)
//   before        what the FP8 linear ran before the skinny kernel
//                 (Fp8Path::kAuto: one of the two above by fp8_cublas_rows)
//   skinny_fp8    kernels/gemm/skinny_fp8_gemm.cuh, default slice count
//   skinny_fp8_pdl the same launched with PDL: each GEMM of the graph a
//                 programmatic dependent of the one before (which lets it
//                 start at once), as the engine launches them after a norm
//   skinny_fp8_pipe_pdl  the same, pipelined (SkinnyFp8GemmArgs::pipelined:
//                 the next step's weight loads issued before this step's math)
//   skinny_fp8_stream_pdl  the stream scheme (SkinnyFp8GemmArgs::stream: the
//                 bf16 skinny kernel's 4-row warps and 512-contiguous-byte
//                 loads, f32 FMAs), PDL, its own slice rule; "refused" at m > 2
//   skinny_fp8_sN, skinny_fp8_pipe_sN with N slices (--sweep 1), and
//   skinny_fp8_stream_sN (N <= 8, PDL), for the slice rules
// Method (bench/bench_util.h): CUDA graphs of 20 GEMMs on distinct weight
// copies, enough that a pass reads at least twice the L2; the median per GEMM.
// Bytes = FP8 weights + f32 scales + x + out, each once; % of the one
// roofline (core/roofline.h, 4.58 TB/s); "vs before" = before's time over
// the row's. Prints a markdown table.
//
//   skinny_fp8_gemm_bench [--m 1,2,4,8,16] [--model v3|kimi] [--tp 1,8] [--sweep 0|1]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <tuple>
#include <vector>

#include "bench_util.h"
#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "core/roofline.h"
#include "io/hf_config.h"
#include "kernels/gemm/skinny_fp8_gemm.cuh"
#include "ops/linear_cuda.h"

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
  shapes->push_back({m, "q_a", c.q_lora_rank, H});
  shapes->push_back({m, "q_b", nh * c.qk_head_dim() / tp, c.q_lora_rank});
  shapes->push_back({m, "kv_a", c.kv_lora_rank + c.qk_rope_head_dim, H});
  shapes->push_back({m, "o_proj", H, nh * c.v_head_dim / tp});
  const int64_t shared = c.moe_intermediate_size * c.n_shared_experts;
  shapes->push_back({m, "shared_gate_up", 2 * shared / tp, H});
  shapes->push_back({m, "shared_down", H, shared / tp});
  shapes->push_back({m, "dense_gate_up", 2 * c.intermediate_size / tp, H});
  shapes->push_back({m, "dense_down", H, c.intermediate_size / tp});
}

// Random e4m3 codes (no NaN) on the device: bf16 randoms' low bytes.
Tensor random_fp8(int64_t count) {
  std::vector<uint8_t> host(count);
  uint64_t s = 0x9E3779B97F4A7C15ull;
  for (auto& b : host) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    b = static_cast<uint8_t>(s >> 32);
    if ((b & 0x7f) == 0x7f) b ^= 1;
  }
  Tensor t = Tensor::empty({count}, DType::kF8E4M3, Device::kCuda);
  copy_to_device(t.raw(), host.data(), host.size());
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> ms = {1, 2, 4, 8, 16};
  std::vector<int64_t> tps = {1, 8};
  std::string model_filter;
  bool sweep = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--m")) ms = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--tp")) tps = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--model")) model_filter = argv[i + 1];
    else if (!std::strcmp(argv[i], "--sweep")) sweep = std::strcmp(argv[i + 1], "0") != 0;
  }
  for (int64_t m : ms)
    if (m < 1 || m > kernels::kSkinnyFp8MaxRows) {
      std::fprintf(stderr, "skinny_fp8_gemm_bench: --m values must be in [1, %ld]\n",
                   long(kernels::kSkinnyFp8MaxRows));
      return 2;
    }
  for (int64_t tp : tps)
    if (tp != 1 && tp != 2 && tp != 4 && tp != 8) {
      std::fprintf(stderr, "skinny_fp8_gemm_bench: --tp values must be 1, 2, 4 or 8\n");
      return 2;
    }
  auto ctx = cuda::get_context();
  if (!ctx.ok()) {
    std::fprintf(stderr, "skinny_fp8_gemm_bench: %s\n", ctx.status().to_string().c_str());
    return 1;
  }
  cuda::Context& c = **ctx;
  auto v3 = load_model_config(models_dir() + "/configs/deepseek-v3.config.json");
  if (!v3.ok()) {
    std::fprintf(stderr, "skinny_fp8_gemm_bench: %s\n", v3.status().to_string().c_str());
    return 1;
  }
  ModelConfig kimi = *v3;  // Kimi-K2: DeepSeek-V3's architecture with 64 heads
  kimi.num_attention_heads = 64;
  std::vector<Shape> shapes;
  for (const auto& [key, cfg, label] : {std::tuple{"v3", &*v3, "V3"}, std::tuple{"kimi", &kimi, "Kimi-K2"}}) {
    if (!model_filter.empty() && model_filter != key) continue;
    for (int64_t tp : tps) shapes_of(*cfg, label, static_cast<int>(tp), &shapes);
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  std::printf("# skinny_fp8_gemm_bench %s on %s (%d SMs, L2 %.0f MB); roofline %.2f TB/s\n\n", date, c.name.c_str(),
              c.num_sms, c.l2_bytes / 1e6, roofline::kHbmBytesPerSec / 1e12);
  std::printf("| model | layer | n | k | weight MB | m | variant | slices | us | GB/s | %% of roofline | vs before |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  const int64_t max_m = *std::max_element(ms.begin(), ms.end());
  cudaStream_t stream = c.stream;
  for (const Shape& S : shapes) {
    const int64_t nb = (S.n + 127) / 128, kb = (S.k + 127) / 128;
    const int64_t wbytes = S.n * S.k + nb * kb * 4;
    const int copies =
        static_cast<int>(std::max<int64_t>(2, (2 * static_cast<int64_t>(c.l2_bytes) + wbytes - 1) / wbytes));
    std::vector<LinearWeight> weights(copies);
    {
      Tensor q0 = random_fp8(S.n * S.k);
      std::vector<float> scales(nb * kb);
      for (size_t i = 0; i < scales.size(); ++i) scales[i] = 1e-3f * (0.5f + static_cast<float>(i % 7) / 7.0f);
      for (LinearWeight& w : weights) {
        w.name = S.name;
        w.out_features = S.n;
        w.in_features = S.k;
        w.block_n = w.block_k = 128;
        w.weight = Tensor::empty({S.n, S.k}, DType::kF8E4M3, Device::kCuda);
        NUCLEUS_CUDA_CHECK(cudaMemcpy(w.weight.raw(), q0.raw(), q0.nbytes(), cudaMemcpyDeviceToDevice));
        w.scale_inv = Tensor::empty({nb, kb}, DType::kF32, Device::kCuda);
        copy_to_device(w.scale_inv.raw(), scales.data(), scales.size() * sizeof(float));
      }
    }
    Tensor x = random_bf16(max_m * S.k, 1.0f);
    Tensor out = Tensor::empty({max_m * S.n}, DType::kBF16, Device::kCuda);
    for (int64_t m : ms) {
      double before_us = -1;
      auto row = [&](const std::string& variant, int slices, double us) {
        if (us < 0) {
          std::printf("| %s | %s | %ld | %ld | %.1f | %ld | %s | | refused | | | |\n", S.model.c_str(), S.name.c_str(),
                      long(S.n), long(S.k), wbytes / 1e6, long(m), variant.c_str());
          std::fflush(stdout);
          return;
        }
        const double bytes = static_cast<double>(wbytes + m * S.k * 2 + m * S.n * 2);
        const double gbs = bytes / (us * 1e-6) / 1e9;
        std::printf("| %s | %s | %ld | %ld | %.1f | %ld | %s | %s | %.2f | %.0f | %.1f%% | %s |\n", S.model.c_str(),
                    S.name.c_str(), long(S.n), long(S.k), wbytes / 1e6, long(m), variant.c_str(),
                    slices > 0 ? std::to_string(slices).c_str() : "", us, gbs,
                    100.0 * gbs * 1e9 / roofline::kHbmBytesPerSec,
                    before_us > 0 ? (std::to_string(before_us / us).substr(0, 4) + "x").c_str() : "");
        std::fflush(stdout);
      };
      // Each FP8 path with its scratch, as the step executor reserves it for the op.
      auto fp8_path = [&](cuda_ops::Fp8Path path) {
        cuda_ops::Fp8LinearScratchOwner scratch;
        NUCLEUS_CHECK_OK(cuda_ops::Fp8LinearScratchOwner::create(m, S.n, S.k, path, &scratch));
        return bench::median_us_per_launch(copies, [&](int i) {
          return cuda_ops::fp8_linear_forward(weights[i], x.raw(), S.k, m, out.raw(), DType::kBF16, S.n, false,
                                              scratch.scratch(), path)
              .ok();
        });
      };
      const double before = fp8_path(cuda_ops::Fp8Path::kAuto);
      row("cublaslt_fp8", 0, fp8_path(cuda_ops::Fp8Path::kCublas));
      row("cuda_fp8", 0, fp8_path(cuda_ops::Fp8Path::kOwn));
      row("before", 0, before);
      before_us = before;
      auto skinny = [&](int slices, bool pdl = false, bool pipe = false, bool stream_scheme = false) {
        return bench::median_us_per_launch(copies, [&](int i) {
          kernels::SkinnyFp8GemmArgs a;
          a.x = x.data<__nv_bfloat16>();
          a.x_stride = S.k;
          a.w = weights[i].weight.data<uint8_t>();
          a.scale_inv = weights[i].scale_inv.data<float>();
          a.out = out.raw();
          a.out_stride = S.n;
          a.m = m;
          a.n = S.n;
          a.k = S.k;
          a.slices = slices;
          a.pdl = pdl;
          a.pipelined = pipe;
          a.stream = stream_scheme;
          return kernels::launch_skinny_fp8_gemm(a, stream) == cudaSuccess;
        });
      };
      const int slices = kernels::skinny_fp8_default_slices(S.n, S.k, c.num_sms);
      row("skinny_fp8", slices, skinny(0));
      row("skinny_fp8_pdl", slices, skinny(0, true));
      row("skinny_fp8_pipe_pdl", slices, skinny(0, true, true));
      row("skinny_fp8_stream_pdl", kernels::skinny_fp8_stream_slices(S.n, S.k, c.num_sms),
          skinny(0, true, false, true));
      if (sweep)
        for (int s : {1, 2, 4, 8, 16}) {
          row("skinny_fp8_s" + std::to_string(s), s, skinny(s));
          row("skinny_fp8_pipe_s" + std::to_string(s), s, skinny(s, false, true));
          if (s <= 8) row("skinny_fp8_stream_s" + std::to_string(s), s, skinny(s, true, false, true));
        }
    }
  }
  return 0;
}
