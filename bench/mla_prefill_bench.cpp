// NUCLEUS_BENCH_NEEDS_CUDA: MLA prefill attention (expanded form) on the GPU.
//
// For num_seqs sequences of num_tokens new tokens each (no cached prefix)
// and num_heads heads, times:
//  - the attention kernel alone (K/V already expanded): both variants
//    (mma.sync, wgmma) at both query tile heights (64 and 128 rows per CTA;
//    '*' marks the backend's choice, whose TFLOP/s are printed);
//  - the whole "cuda_flash" backend (MlaPrefillAttentionOp, default context
//    chunk 8192): K/V expansion from the paged latent cache + attention;
//  - the "cuda_naive" backend on the small sizes, for comparison.
// FLOPs counted: 2 * (causal query-key pairs) * (192 + 128) * num_heads
// (Q K^T and P V); % of the measured dense bf16 peak, 790 TFLOP/s.
// Median of several runs timed with CUDA events on the engine stream.
//   mla_prefill_bench [--quick]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/knobs.h"
#include "core/roofline.h"
#include "graph/device_inputs.h"
#include "graph/step_resources.h"
#include "kernels/mla/mla_prefill.cuh"
#include "ops/mla_prefill.h"

namespace nucleus {
namespace {

constexpr double kPeakTflops = roofline::kBf16FlopsPerSec / 1e12;
constexpr int kNope = 128, kRope = 64, kV = 128, kLora = 512, kLatent = kLora + kRope, kQk = kNope + kRope;
constexpr int64_t kPool = 1 << 24;  // random bf16 values reused to fill large buffers

struct Pools {
  Tensor unit;   // uniform [-1, 1]
  Tensor small;  // uniform [-0.05, 0.05] (weights)
};

Tensor make_pool(float scale, uint32_t seed) {
  std::vector<uint16_t> h(kPool);
  uint32_t x = seed;
  for (auto& v : h) {
    x = x * 1664525u + 1013904223u;
    v = f32_to_bf16(scale * (static_cast<float>(x >> 8) / 8388608.0f - 1.0f));
  }
  Tensor t = Tensor::empty({kPool}, DType::kBF16, Device::kCuda);
  copy_to_device(t.raw(), h.data(), h.size() * 2);
  return t;
}

// Fills a bf16 device tensor with pool values (starting offsets vary so rows differ).
void fill(Tensor& t, const Tensor& pool) {
  const int64_t n = t.numel();
  auto* dst = static_cast<char*>(t.raw());
  int64_t start = 12345;
  for (int64_t done = 0; done < n;) {
    start = (start * 7919 + 104729) % (kPool / 2);
    const int64_t len = std::min(n - done, kPool - start);
    NUCLEUS_CUDA_CHECK(cudaMemcpyAsync(dst + done * 2, static_cast<const char*>(pool.raw()) + start * 2, len * 2,
                                       cudaMemcpyDeviceToDevice, cuda::context().stream));
    done += len;
  }
}

// Median milliseconds of `fn` (enqueued on the engine stream).
template <typename Fn>
double time_ms(Fn fn) {
  cudaStream_t s = cuda::context().stream;
  cudaEvent_t a, b;
  NUCLEUS_CUDA_CHECK(cudaEventCreate(&a));
  NUCLEUS_CUDA_CHECK(cudaEventCreate(&b));
  auto once = [&] {
    NUCLEUS_CUDA_CHECK(cudaEventRecord(a, s));
    fn();
    NUCLEUS_CUDA_CHECK(cudaEventRecord(b, s));
    NUCLEUS_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    NUCLEUS_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return static_cast<double>(ms);
  };
  once();  // warm-up
  const double first = once();
  const int reps = static_cast<int>(std::clamp(300.0 / std::max(first, 1e-3), 3.0, 30.0));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) t.push_back(once());
  std::sort(t.begin(), t.end());
  NUCLEUS_CUDA_CHECK(cudaEventDestroy(a));
  NUCLEUS_CUDA_CHECK(cudaEventDestroy(b));
  return t[t.size() / 2];
}

struct Row {
  int num_seqs, num_tokens, heads;
  double flops;
  double kernel_ms[4];  // mma.sync bm64, bm128, wgmma bm64, bm128
  int picked;           // index of the backend's choice
  double op_ms, naive_ms;
};

// The attention kernel alone over pre-expanded K/V.
void time_kernel(const Pools& pools, Row* r) {
  const int64_t rows = static_cast<int64_t>(r->num_seqs) * r->num_tokens;
  Tensor q = Tensor::empty({rows, r->heads * kQk}, DType::kBF16, Device::kCuda);
  Tensor k = Tensor::empty({rows, r->heads * kQk}, DType::kBF16, Device::kCuda);
  Tensor v = Tensor::empty({rows, r->heads * kV}, DType::kBF16, Device::kCuda);
  Tensor o = Tensor::empty({rows, r->heads * kV}, DType::kBF16, Device::kCuda);
  fill(q, pools.unit);
  fill(k, pools.unit);
  fill(v, pools.unit);
  std::vector<kernels::MlaPrefillSeq> seqs;
  for (int s = 0; s < r->num_seqs; ++s)
    seqs.push_back({s * r->num_tokens, r->num_tokens, 0, s * r->num_tokens, 0, r->num_tokens});
  const int64_t tiles_128 = static_cast<int64_t>(r->num_seqs) * ((r->num_tokens + 127) / 128);
  const bool wgmma_default = env_flag(Knob::kMlaPrefillWgmma);
  r->picked = (wgmma_default ? 2 : 0) +
              (kernels::mla_prefill_block_m(tiles_128, r->heads, cuda::context().num_sms) == 128 ? 1 : 0);
  for (int variant = 0; variant < 4; ++variant) {
    const int bm = variant % 2 == 0 ? 64 : 128;
    std::vector<kernels::MlaPrefillWork> work;
    for (int s = 0; s < r->num_seqs; ++s)
      for (int t = (r->num_tokens + bm - 1) / bm - 1; t >= 0; --t) work.push_back({s, t});
    Tensor d_seqs = Tensor::empty({static_cast<int64_t>(seqs.size() * sizeof(seqs[0]))}, DType::kU8, Device::kCuda);
    Tensor d_work = Tensor::empty({static_cast<int64_t>(work.size() * sizeof(work[0]))}, DType::kU8, Device::kCuda);
    copy_to_device(d_seqs.raw(), seqs.data(), d_seqs.nbytes());
    copy_to_device(d_work.raw(), work.data(), d_work.nbytes());
    kernels::MlaPrefillParams p;
    p.q = q.data<__nv_bfloat16>();
    p.q_stride = r->heads * kQk;
    p.k = k.data<__nv_bfloat16>();
    p.k_stride = r->heads * kQk;
    p.v = v.data<__nv_bfloat16>();
    p.v_stride = r->heads * kV;
    p.out = o.data<__nv_bfloat16>();
    p.out_stride = r->heads * kV;
    p.seqs = static_cast<const kernels::MlaPrefillSeq*>(d_seqs.raw());
    p.work = static_cast<const kernels::MlaPrefillWork*>(d_work.raw());
    p.num_work = static_cast<int>(work.size());
    p.num_heads = r->heads;
    p.scale = 0.135234f;
    p.block_m = bm;
    p.use_wgmma = variant >= 2;
    r->kernel_ms[variant] =
        time_ms([&] { NUCLEUS_CUDA_CHECK(kernels::launch_mla_prefill(p, cuda::context().stream)); });
  }
}

// A whole backend ("cuda_flash" or "cuda_naive") through MlaPrefillAttentionOp.
double time_op(const Pools& pools, const Row& r, const char* backend) {
  const int block_size = 64;
  const int64_t rows = static_cast<int64_t>(r.num_seqs) * r.num_tokens;
  const int blocks_per_seq = (r.num_tokens + block_size - 1) / block_size;
  const int64_t num_blocks = static_cast<int64_t>(r.num_seqs) * blocks_per_seq;
  KvCache kv;
  kv.data = Tensor::empty({1, num_blocks, block_size, kLatent}, DType::kBF16, Device::kCuda);
  kv.num_layers = 1;
  kv.num_blocks = num_blocks;
  kv.block_size = block_size;
  kv.width = kLatent;
  fill(kv.data, pools.unit);
  LinearWeight w;
  w.name = "kv_b_proj";
  w.out_features = static_cast<int64_t>(r.heads) * (kNope + kV);
  w.in_features = kLora;
  w.weight = Tensor::empty({w.out_features, kLora}, DType::kBF16, Device::kCuda);
  fill(w.weight, pools.small);
  StepInputs si;
  si.max_blocks_per_seq = blocks_per_seq;
  si.query_start = {0};
  for (int s = 0; s < r.num_seqs; ++s) {
    for (int b = 0; b < blocks_per_seq; ++b) si.block_tables.push_back(s * blocks_per_seq + b);
    for (int j = 0; j < r.num_tokens; ++j) {
      si.token_ids.push_back(0);
      si.positions.push_back(j);
      si.slot_mapping.push_back(static_cast<int64_t>(s * blocks_per_seq) * block_size + j);
    }
    si.query_start.push_back(si.query_start.back() + r.num_tokens);
    si.context_lens.push_back(0);
  }
  kernels::MlaDims dims{r.heads, kNope, kRope, kV, kLora, 0.135234f};
  MlaPrefillAttentionOp op(0, &w, dims, AttentionMode::kExpanded, 8192);
  const auto& list = MlaPrefillAttentionOp::backends();
  auto it = std::find_if(list.begin(), list.end(), [&](const auto& b) { return std::strcmp(b.name, backend) == 0; });
  NUCLEUS_CHECK(it != list.end(), "no backend {}", backend);
  NUCLEUS_CHECK_OK(op.use_backend(*it));
  StepResources res;  // the step's workspace and plan, as the engine's
  NUCLEUS_CHECK_OK(res.reserve_ops({&op}, StepLimits{}, Device::kCuda));
  DeviceInputUploader uploader;
  DeviceStepInputs dev = uploader.upload(si);
  OpContext ctx;
  ctx.device = Device::kCuda;
  ctx.stream = cuda::context().stream;
  ctx.inputs = &si;
  ctx.dev = &dev;
  ctx.kv_cache = &kv;
  Tensor q = Tensor::empty({rows, r.heads * kQk}, DType::kBF16, Device::kCuda);
  Tensor o = Tensor::empty({rows, r.heads * kV}, DType::kBF16, Device::kCuda);
  fill(q, pools.unit);
  TensorList in = {q}, out = {o};
  // Planned once, as the engine plans a step once for all its layers: the
  // time is one layer's.
  NUCLEUS_CHECK_OK(res.begin_step(ctx));
  const double ms = time_ms([&] { op.run(ctx, in, out); });
  NUCLEUS_CHECK_OK(ctx.error);
  return ms;
}

}  // namespace
}  // namespace nucleus

int main(int argc, char** argv) {
  using namespace nucleus;
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  auto c = cuda::get_context();
  if (!c.ok()) {
    std::fprintf(stderr, "mla_prefill_bench: %s\n", c.status().to_string().c_str());
    return 1;
  }
  Pools pools{make_pool(1.0f, 1), make_pool(0.05f, 2)};
  std::vector<int> seq_counts = {1, 8, 32}, lengths = {512, 1024, 2048, 4096}, head_counts = {16, 128};
  if (quick) seq_counts = {1, 8}, lengths = {512, 4096};
  std::vector<Row> rows;
  for (int heads : head_counts)
    for (int n : seq_counts)
      for (int len : lengths) {
        Row r{n, len, heads, 0, {0, 0, 0, 0}, 0, 0, -1};
        r.flops = 2.0 * n * (static_cast<double>(len) * (len + 1) / 2) * (kQk + kV) * heads;
        time_kernel(pools, &r);
        r.op_ms = time_op(pools, r, "cuda_flash");
        if (static_cast<int64_t>(n) * len <= 4096 && (heads == 16 || n * len <= 1024))
          r.naive_ms = time_op(pools, r, "cuda_naive");
        std::fprintf(stderr, "done %d x %d h%d\n", n, len, heads);
        rows.push_back(r);
      }
  auto tf = [](double flops, double ms) { return flops / (ms * 1e-3) / 1e12; };
  std::printf("MLA prefill attention on %s (%d SMs); causal, no cached prefix; TFLOP/s = 2*pairs*(192+128)*heads / time\n\n",
              cuda::context().name.c_str(), cuda::context().num_sms);
  std::printf("Resident CTAs per SM: mma.sync bm64 %d, bm128 %d; wgmma bm64 %d, bm128 %d\n\n",
              kernels::mla_prefill_ctas_per_sm(64, false), kernels::mla_prefill_ctas_per_sm(128, false),
              kernels::mla_prefill_ctas_per_sm(64, true), kernels::mla_prefill_ctas_per_sm(128, true));
  std::printf("| seqs | tokens | heads | mma.sync bm64 ms | mma.sync bm128 ms | wgmma bm64 ms | wgmma bm128 ms | "
              "kernel* TFLOP/s | %% of 790 | cuda_flash op ms | op TFLOP/s | op %% of 790 | cuda_naive ms |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& r : rows) {
    const double best = r.kernel_ms[r.picked];
    char naive[32] = "-";
    if (r.naive_ms > 0) std::snprintf(naive, sizeof(naive), "%.3f", r.naive_ms);
    std::printf("| %d | %d | %d |", r.num_seqs, r.num_tokens, r.heads);
    for (int v = 0; v < 4; ++v) std::printf(" %.3f%s |", r.kernel_ms[v], r.picked == v ? "*" : "");
    std::printf(" %.1f | %.1f%% | %.3f | %.1f | %.1f%% | %s |\n", tf(r.flops, best),
                100 * tf(r.flops, best) / kPeakTflops, r.op_ms, tf(r.flops, r.op_ms),
                100 * tf(r.flops, r.op_ms) / kPeakTflops, naive);
  }
  return 0;
}
