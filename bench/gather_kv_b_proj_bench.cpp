// NUCLEUS_BENCH_NEEDS_CUDA. gather_kv_b_proj: the fused kernel against the
// unfused path (gather -> bf16 -> cuBLASLt -> split) at DeepSeek-V2-Lite (16
// heads) and V3 (128 heads) kv_b shapes, bf16 and FP8 (128x128 block-scaled)
// weights, 4096 and 32768 cached keys in 64-key blocks, bf16 cache.
// Prints a markdown table: time, GB/s over the bytes that must move (latent
// rows read, weight read once, k and v written), TFLOP/s, and the fraction of
// the roofline (max(bytes / 4.58 TB/s, flops / 790 TFLOP/s), core/roofline.h's H200
// figures) reached.
//   usage: gather_kv_b_proj_bench [iterations]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/roofline.h"
#include "ops/gather_kv_b_proj.h"

using namespace nucleus;

namespace {

constexpr int64_t kNope = 128, kRope = 64, kV = 128, kLora = 512, kBlock = 64;
constexpr double kCopyBytesPerS = roofline::kHbmBytesPerSec, kBf16FlopPerS = roofline::kBf16FlopsPerSec;

// Cheap reproducible noise (values in [-1, 1)).
struct Noise {
  uint64_t s;
  float next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<int64_t>(s >> 40) - (1ll << 23)) / static_cast<float>(1ll << 23);
  }
};

Tensor device_tensor(std::vector<int64_t> shape, DType dtype, const void* host) {
  Tensor t = Tensor::empty(std::move(shape), dtype, Device::kCuda);
  copy_to_device(t.raw(), host, t.nbytes());
  return t;
}

LinearWeight make_weight(int64_t heads, bool fp8, uint64_t seed) {
  const int64_t n = heads * (kNope + kV), k = kLora;
  Noise r{seed};
  LinearWeight w;
  w.name = "bench.kv_b_proj";
  w.out_features = n;
  w.in_features = k;
  if (!fp8) {
    std::vector<uint16_t> h(n * k);
    for (auto& x : h) x = f32_to_bf16(0.05f * r.next());
    w.weight = device_tensor({n, k}, DType::kBF16, h.data());
    return w;
  }
  std::vector<uint8_t> q(n * k);
  for (auto& x : q) x = f32_to_fp8e4m3(400.0f * r.next());
  const int64_t nb = (n + 127) / 128, kb = (k + 127) / 128;
  std::vector<float> s(nb * kb);
  for (auto& x : s) x = 1e-4f * (1.5f + r.next());
  w.weight = device_tensor({n, k}, DType::kF8E4M3, q.data());
  w.scale_inv = device_tensor({nb, kb}, DType::kF32, s.data());
  w.block_n = w.block_k = 128;
  return w;
}

struct Result {
  double ms = 0;
  std::vector<uint16_t> k_sample;  // the first keys' k, to compare the paths
};

Result time_impl(GatherKvBProj& op, const GatherKvBProjArgs& args, int iters, int64_t sample_elems) {
  cudaStream_t stream = static_cast<cudaStream_t>(args.stream);
  op.reserve(args.num_keys);
  for (int i = 0; i < 2; ++i) op.run(args);  // warm-up (cuBLASLt picks its algorithm on first use)
  cudaEvent_t start, stop;
  NUCLEUS_CUDA_CHECK(cudaEventCreate(&start));
  NUCLEUS_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < iters; ++i) {
    NUCLEUS_CUDA_CHECK(cudaEventRecord(start, stream));
    op.run(args);
    NUCLEUS_CUDA_CHECK(cudaEventRecord(stop, stream));
    NUCLEUS_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    NUCLEUS_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  Result r;
  r.ms = times[times.size() / 2];  // median
  r.k_sample.resize(sample_elems);
  copy_to_host(r.k_sample.data(), args.k, sample_elems * 2);
  NUCLEUS_CUDA_CHECK(cudaEventDestroy(start));
  NUCLEUS_CUDA_CHECK(cudaEventDestroy(stop));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::max(1, std::atoi(argv[1])) : 10;
  auto ctx = cuda::get_context();
  if (!ctx.ok()) {
    std::fprintf(stderr, "gather_kv_b_proj_bench: %s\n", ctx.status().to_string().c_str());
    return 1;
  }
  cudaStream_t stream = (*ctx)->stream;
  std::printf("device: %s (%d SMs); median of %d runs; bf16 cache, %lld-key blocks (shuffled)\n\n",
              (*ctx)->name.c_str(), (*ctx)->num_sms, iters, static_cast<long long>(kBlock));
  std::printf("| heads | weight | keys | impl | time (us) | GB/s | TFLOP/s | %% roofline | max |fused-unfused| on k |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (int64_t heads : {16, 128}) {
    for (bool fp8 : {false, true}) {
      const LinearWeight w = make_weight(heads, fp8, 7 + heads + fp8);
      GatherKvBProjSpec spec;
      spec.num_heads = heads;
      spec.qk_nope = kNope;
      spec.qk_rope = kRope;
      spec.v_head = kV;
      spec.kv_lora = kLora;
      for (int64_t keys : {4096, 32768}) {
        const int64_t num_blocks = keys / kBlock + 1, width = kLora + kRope;
        std::vector<uint16_t> cache(num_blocks * kBlock * width);
        Noise r{static_cast<uint64_t>(keys)};
        for (auto& x : cache) x = f32_to_bf16(r.next());
        std::vector<int32_t> table(num_blocks);
        std::iota(table.begin(), table.end(), 0);
        std::shuffle(table.begin(), table.end(), std::mt19937_64(keys));
        Tensor d_cache = device_tensor({num_blocks * kBlock, width}, DType::kBF16, cache.data());
        Tensor d_table = device_tensor({num_blocks}, DType::kI32, table.data());
        Tensor d_k = Tensor::empty({keys, heads, kNope + kRope}, DType::kBF16, Device::kCuda);
        Tensor d_v = Tensor::empty({keys, heads, kV}, DType::kBF16, Device::kCuda);
        GatherKvBProjArgs a;
        a.cache = d_cache.raw();
        a.block_table = d_table.data<int32_t>();
        a.block_size = kBlock;
        a.key_begin = 0;
        a.num_keys = keys;
        a.k = d_k.raw();
        a.v = d_v.raw();
        a.stream = stream;
        const int64_t n = heads * (kNope + kV);
        const double bytes = static_cast<double>(keys) * width * 2 + static_cast<double>(w.weight.nbytes()) +
                             static_cast<double>(d_k.nbytes() + d_v.nbytes());
        const double flops = 2.0 * keys * n * kLora;
        const double floor_s = std::max(bytes / kCopyBytesPerS, flops / kBf16FlopPerS);
        const int64_t sample = std::min<int64_t>(d_k.numel(), 64 * heads * (kNope + kRope));
        std::vector<uint16_t> fused_k;
        for (const char* impl : {"fused", "unfused"}) {
          auto op = GatherKvBProj::create(w, spec, Device::kCuda, impl);
          if (!op.ok()) {
            std::printf("| %lld | %s | %lld | %s | refused: %s |\n", static_cast<long long>(heads),
                        fp8 ? "fp8 128x128" : "bf16", static_cast<long long>(keys), impl,
                        op.status().message().c_str());
            continue;
          }
          const Result res = time_impl(**op, a, iters, sample);
          std::string diff = "";
          if (std::string(impl) == "fused") {
            fused_k = res.k_sample;
          } else if (!fused_k.empty()) {
            float worst = 0;
            for (int64_t i = 0; i < sample; ++i)
              worst = std::max(worst, std::fabs(bf16_to_f32(fused_k[i]) - bf16_to_f32(res.k_sample[i])));
            char buf[32];
            std::snprintf(buf, sizeof buf, "%.3g", worst);
            diff = buf;
          }
          const double s = res.ms * 1e-3;
          std::printf("| %lld | %s | %lld | %s | %.1f | %.0f | %.1f | %.0f%% | %s |\n", static_cast<long long>(heads),
                      fp8 ? "fp8 128x128" : "bf16", static_cast<long long>(keys), impl, res.ms * 1e3,
                      bytes / s / 1e9, flops / s / 1e12, 100.0 * floor_s / s, diff.c_str());
          std::fflush(stdout);
        }
      }
    }
  }
  return 0;
}
