// NUCLEUS_BENCH_NEEDS_CUDA
// Absorbed MLA decode attention (the mla_decode op: q absorption, attention
// over the paged latent cache, output projection) per backend and cache
// dtype (bf16, FP8 e4m3 with k_scale), on decode steps of `batch` sequences
// of `context` keys each, page 64, random block tables. Each call uses
// another layer of a cache larger than L2 (rotation), and another layer's
// kv_b_proj (distinct copies rotated past 256 MB where the cache rotation
// allows, as a model's layers read them from HBM), calls are captured in
// a CUDA graph and timed with events: median of the replays. Bytes moved =
// KV rows read (batch * context * 576 * 2 B bf16, * 1 B FP8) + q read +
// output written + kv_b_proj as stored (bf16 or FP8: 256 B or 128 B a head
// and latent column). Rows: each backend at its defaults, "nucleus_blas" =
// nucleus with NUCLEUS_MLA_DECODE_SMALL_GEMMS=0 (cuBLASLt absorption GEMMs at
// every row count, the previous version) and "nucleus_small" = 1 (the own
// absorption kernels up to 8 rows; printed where auto does not take them),
// "nucleus_skN" = nucleus with NUCLEUS_MLA_DECODE_SPLIT_KEYS=N (KV splits of
// at least N keys; --split-keys N,M,... adds these rows at batch <= 8),
// "nucleus_2cta" = nucleus with NUCLEUS_MLA_DECODE_CTAS_PER_SM=2 (16 heads;
// --ctas adds these rows) and "nucleus_1cta" = 1, "nucleus_t32" = nucleus
// with NUCLEUS_MLA_DECODE_KEY_TILE=32 (the 32-key kernel, the version before
// the 64-key one; at 16 heads, where auto picks 64), "nucleus_cpasync" /
// "nucleus_bulk" = nucleus with NUCLEUS_MLA_DECODE_BULK_LOADS=0 / 1 (the
// 64-key kernel's cp.async loader, the version before bulk row loads, or bulk
// row copies; whichever auto does not pick for the cache), "nucleus_smemconv" /
// "nucleus_regconv" = nucleus with NUCLEUS_MLA_DECODE_FP8_REGISTER_CONVERT=0 /
// 1 (fp8_e4m3 rows converted to bf16 through shared memory, the version
// before, or MMA fragments converted in registers; the one auto does not
// pick), "nucleus_mma" / "nucleus_wgmma" = nucleus with
// NUCLEUS_MLA_DECODE_WGMMA=0 / 1 (the mma.sync kernels, 32 heads a CTA, the
// version before, or the 64-head wgmma kernel; where the wgmma kernel
// applies, the one auto does not pick). --shape B,CTX runs one
// shape (16 and 128 heads unless --heads N; 64 only when asked).
// Prints time, GB/s, % of the spec 4.8 TB/s and of 4.58 TB/s
// (core/roofline.h: the measured read-stream ceiling), TFLOP/s of the attention proper, and the tokens one
// GB of cache holds per layer and for DeepSeek-V3's 61 layers.
//   mla_decode_bench [--quick | --small] [--kv-cache-dtype bf16|fp8|fp8_e4m3|fp8_ds_mla|both|all]
//                    [--kv-b bf16|fp8|both] [--split-keys N,M,...] [--ctas]
//                    [--shape BATCH,CONTEXT] [--heads N]
//   (cache default both: bf16 and fp8_e4m3; all adds fp8_ds_mla. kv_b_proj
//   default bf16; fp8: e4m3 in 128 x 128 blocks, as DeepSeek-V3's checkpoint.
//   --small: batches 1, 2, 4, 8 at contexts 1k, 4k, 32k.)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/roofline.h"
#include "graph/device_inputs.h"
#include "graph/step_resources.h"
#include "kernels/mla/flashinfer_mla.cuh"
#include "ops/mla_decode.h"

using namespace nucleus;

namespace {

constexpr int kNope = 128, kRope = 64, kVHead = 128, kLora = 512, kLatent = 576, kBlock = 64;
constexpr double kL2RotateBytes = 256e6;  // cache bytes touched before a layer repeats

// Random latent rows stored as e4m3(value / k_scale) bytes.
// (A pool of at most 5M values, repeated, as device_random_bf16.)
Tensor device_random_fp8(int64_t n, float scale, float k_scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  const int64_t pool = std::min<int64_t>(n, (int64_t{5} << 20) + 7);
  std::vector<uint8_t> h(pool);
  for (auto& x : h) x = f32_to_fp8e4m3(d(rng) / k_scale);
  Tensor t = Tensor::empty({n}, DType::kF8E4M3, Device::kCuda);
  for (int64_t i = 0; i < n; i += pool)
    copy_to_device(static_cast<uint8_t*>(t.raw()) + i, h.data(), static_cast<size_t>(std::min(pool, n - i)));
  return t;
}

// n_rows random latent rows in the fp8_ds_mla layout (656 bytes each): 1024
// distinct encoded rows, repeated.
Tensor device_random_ds_mla(int64_t n_rows, float scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  constexpr int64_t kDistinct = 1024;
  std::vector<uint8_t> rows(static_cast<size_t>(kDistinct * kDsMlaRowBytes));
  std::vector<float> v(kLatent);
  for (int64_t r = 0; r < kDistinct; ++r) {
    for (auto& x : v) x = d(rng);
    encode_kv_row(v.data(), kLatent, KvCacheDtype::kFp8DsMla, 1.0f, rows.data() + r * kDsMlaRowBytes);
  }
  std::vector<uint8_t> h(static_cast<size_t>(n_rows * kDsMlaRowBytes));
  for (int64_t r = 0; r < n_rows; ++r)
    std::copy_n(rows.data() + (r % kDistinct) * kDsMlaRowBytes, kDsMlaRowBytes, h.data() + r * kDsMlaRowBytes);
  Tensor t = Tensor::empty({static_cast<int64_t>(h.size())}, DType::kU8, Device::kCuda);
  copy_to_device(t.raw(), h.data(), h.size());
  return t;
}

// n random bf16 values: a pool of at most 4M (5M: not a multiple of a row or
// a page) repeated, so that large caches fill in a second.
Tensor device_random_bf16(int64_t n, float scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  const int64_t pool = std::min<int64_t>(n, (int64_t{5} << 20) + 7);
  std::vector<uint16_t> h(pool);
  for (auto& x : h) x = f32_to_bf16(d(rng));
  Tensor t = Tensor::empty({n}, DType::kBF16, Device::kCuda);
  for (int64_t i = 0; i < n; i += pool)
    copy_to_device(static_cast<uint16_t*>(t.raw()) + i, h.data(), static_cast<size_t>(std::min(pool, n - i)) * 2);
  return t;
}

// kv_b_proj [wn, 512]: bf16 values in [-0.1, 0.1], or e4m3 values with
// 128 x 128 block scales of about the same magnitude.
LinearWeight random_kv_b(int64_t wn, bool fp8, uint64_t seed) {
  LinearWeight w;
  w.out_features = wn;
  w.in_features = kLora;
  if (!fp8) {
    w.weight = device_random_bf16(wn * kLora, 0.1f, seed).view({wn, kLora});
    return w;
  }
  w.weight = device_random_fp8(wn * kLora, 400.0f, 1.0f, seed).view({wn, kLora});
  std::vector<float> sc(static_cast<size_t>((wn + 127) / 128 * (kLora / 128)), 2.5e-4f);
  w.scale_inv = Tensor::empty({(wn + 127) / 128, kLora / 128}, DType::kF32, Device::kCuda);
  copy_to_device(w.scale_inv.raw(), sc.data(), sc.size() * 4);
  w.block_n = w.block_k = 128;
  return w;
}

struct Result {
  double us = 0;
  bool ok = false;
  std::string why;
};

struct Setup {
  int batch, context, heads, layers;
  KvCacheDtype cache_dtype;
  bool fp8_kv_b = false;
  StepInputs si;
  KvCache kv;
  std::vector<LinearWeight> w;  // rotated with the layers
  Tensor q, out, q_lat, o_lat;
};

std::unique_ptr<Setup> make_setup(int batch, int context, int heads, KvCacheDtype cache_dtype, bool fp8_kv_b) {
  auto s = std::make_unique<Setup>();
  s->batch = batch;
  s->context = context;
  s->heads = heads;
  s->cache_dtype = cache_dtype;
  s->fp8_kv_b = fp8_kv_b;
  const bool fp8 = cache_dtype == KvCacheDtype::kFp8E4M3, ds = cache_dtype == KvCacheDtype::kFp8DsMla;
  const int nb = (context + kBlock - 1) / kBlock, blocks = batch * nb;
  const double layer_bytes = static_cast<double>(blocks) * kBlock * kv_cache_row_bytes(cache_dtype, kLatent);
  s->layers = std::clamp(static_cast<int>(kL2RotateBytes / layer_bytes) + 1, 1, 256);
  std::mt19937_64 rng(7);
  std::vector<int32_t> perm(blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  StepInputs& si = s->si;
  si.max_blocks_per_seq = nb;
  si.query_start.push_back(0);
  for (int b = 0; b < batch; ++b) {
    for (int j = 0; j < nb; ++j) si.block_tables.push_back(perm[b * nb + j]);
    si.context_lens.push_back(context - 1);
    si.token_ids.push_back(1);
    si.positions.push_back(context - 1);
    si.slot_mapping.push_back(-1);
    si.query_start.push_back(b + 1);
  }
  s->kv.num_layers = s->layers;
  s->kv.num_blocks = blocks;
  s->kv.block_size = kBlock;
  s->kv.width = kLatent;
  const int64_t cache_numel = static_cast<int64_t>(s->layers) * blocks * kBlock * kLatent;
  constexpr float kKScale = 1.0f / 448.0f;  // values in [-1, 1] use e4m3's whole range
  if (ds)
    s->kv.data = device_random_ds_mla(static_cast<int64_t>(s->layers) * blocks * kBlock, 1.0f, 1)
                     .view({s->layers, blocks, kBlock, kDsMlaRowBytes});
  else
    s->kv.data = (fp8 ? device_random_fp8(cache_numel, 1.0f, kKScale, 1) : device_random_bf16(cache_numel, 1.0f, 1))
                     .view({s->layers, blocks, kBlock, kLatent});
  if (fp8) s->kv.k_scale.assign(static_cast<size_t>(s->layers), kKScale);
  const int64_t wn = static_cast<int64_t>(heads) * (kNope + kVHead);
  const double w_bytes = static_cast<double>(wn) * kLora * (fp8_kv_b ? 1 : 2);
  const int num_w = std::clamp(static_cast<int>(kL2RotateBytes / w_bytes) + 1, 1, s->layers);
  s->w.push_back(random_kv_b(wn, fp8_kv_b, 2));
  for (int l = 1; l < num_w; ++l) {  // copies at other addresses
    LinearWeight c = s->w[0];
    c.weight = Tensor::empty(s->w[0].weight.shape(), s->w[0].weight.dtype(), Device::kCuda);
    NUCLEUS_CUDA_CHECK(cudaMemcpy(c.weight.raw(), s->w[0].weight.raw(), s->w[0].weight.nbytes(), cudaMemcpyDeviceToDevice));
    s->w.push_back(std::move(c));
  }
  s->q = device_random_bf16(static_cast<int64_t>(batch) * heads * (kNope + kRope), 2.0f, 3)
             .view({batch, heads * (kNope + kRope)});
  s->out = Tensor::empty({batch, heads * kVHead}, DType::kBF16, Device::kCuda);
  const int64_t W = std::max(batch, 1);
  s->q_lat = Tensor::empty({W, heads * kLora}, DType::kF32, Device::kCuda);
  s->o_lat = Tensor::empty({W, heads * kLora}, DType::kF32, Device::kCuda);
  return s;
}

Result time_backend(Setup& s, const std::string& name, const DeviceStepInputs& dev) {
  Result r;
  // Rows that are the nucleus backend under one switch, set for this call:
  // nucleus_blas / nucleus_small: NUCLEUS_MLA_DECODE_SMALL_GEMMS=0 / 1 (the
  // cuBLASLt absorption GEMMs / the own kernels at every row count they take);
  // nucleus_skN: NUCLEUS_MLA_DECODE_SPLIT_KEYS=N; nucleus_1cta / nucleus_2cta:
  // NUCLEUS_MLA_DECODE_CTAS_PER_SM=1 / 2; nucleus_t32: NUCLEUS_MLA_DECODE_KEY_TILE=32;
  // nucleus_cpasync: NUCLEUS_MLA_DECODE_BULK_LOADS=0, nucleus_bulk: =1;
  // nucleus_smemconv / nucleus_regconv: NUCLEUS_MLA_DECODE_FP8_REGISTER_CONVERT=0 / 1;
  // nucleus_mma / nucleus_wgmma: NUCLEUS_MLA_DECODE_WGMMA=0 / 1.
  struct ScopedSwitch {
    ScopedSwitch(const char* var, std::string v) : var_(var), set_(!v.empty()) {
      if (set_) setenv(var_, v.c_str(), 1);
    }
    ~ScopedSwitch() {
      if (set_) unsetenv(var_);
    }
    const char* var_;
    bool set_;
  };
  const bool sk = name.rfind("nucleus_sk", 0) == 0;
  const bool ctas = name == "nucleus_1cta" || name == "nucleus_2cta";
  const ScopedSwitch small_gemms("NUCLEUS_MLA_DECODE_SMALL_GEMMS",
                                 name == "nucleus_blas" ? "0" : name == "nucleus_small" ? "1" : "");
  const ScopedSwitch split_keys("NUCLEUS_MLA_DECODE_SPLIT_KEYS", sk ? name.substr(10) : "");
  const ScopedSwitch ctas_per_sm("NUCLEUS_MLA_DECODE_CTAS_PER_SM", ctas ? name.substr(8, 1) : "");
  const ScopedSwitch key_tile("NUCLEUS_MLA_DECODE_KEY_TILE", name == "nucleus_t32" ? "32" : "");
  const ScopedSwitch bulk_loads("NUCLEUS_MLA_DECODE_BULK_LOADS",
                                name == "nucleus_cpasync" ? "0" : name == "nucleus_bulk" ? "1" : "");
  const ScopedSwitch fp8_register_convert("NUCLEUS_MLA_DECODE_FP8_REGISTER_CONVERT",
                                          name == "nucleus_smemconv" ? "0" : name == "nucleus_regconv" ? "1" : "");
  const ScopedSwitch wgmma("NUCLEUS_MLA_DECODE_WGMMA", name == "nucleus_mma" ? "0" : name == "nucleus_wgmma" ? "1" : "");
  const std::string backend = name == "nucleus_blas" || name == "nucleus_small" || sk || ctas ||
                                      name == "nucleus_t32" || name == "nucleus_cpasync" || name == "nucleus_bulk" ||
                                      name == "nucleus_smemconv" || name == "nucleus_regconv" ||
                                      name == "nucleus_mma" || name == "nucleus_wgmma"
                                  ? "nucleus"
                                  : name;
  const Backend<MlaDecodeAttentionOp>* b = nullptr;
  for (const auto& e : MlaDecodeAttentionOp::backends())
    if (e.device == Device::kCuda && backend == e.name) b = &e;
  if (!b) {
    r.why = "not built";
    return r;
  }
  kernels::MlaDims dims{s.heads, kNope, kRope, kVHead, kLora, 0.135234f};
  std::vector<std::unique_ptr<MlaDecodeAttentionOp>> ops;
  for (int l = 0; l < s.layers; ++l)
    ops.push_back(std::make_unique<MlaDecodeAttentionOp>(l, &s.w[l % s.w.size()], dims, AttentionMode::kAuto,
                                                         s.cache_dtype));
  std::vector<Op*> reserved;
  for (auto& op : ops) {
    const Status st = op->use_backend(*b);
    if (!st.ok()) {
      r.why = st.message();
      return r;
    }
    reserved.push_back(op.get());
  }
  StepResources res;  // the layers' workspace and plans, as the engine's
  NUCLEUS_CHECK_OK(res.reserve_ops(reserved, StepLimits{}, Device::kCuda));
  cudaStream_t stream = cuda::context().stream;
  OpContext ctx;
  ctx.device = Device::kCuda;
  ctx.stream = stream;
  ctx.inputs = &s.si;
  ctx.dev = &dev;
  ctx.kv_cache = &s.kv;
  // Every call (and replay) here is the one step: planned once, before the
  // warm-up, which makes flashinfer's per-batch plans outside the capture.
  NUCLEUS_CHECK_OK(res.begin_step(ctx));
  auto call = [&](int l) { ops[l % s.layers]->run(ctx, {s.q}, {s.out, s.q_lat, s.o_lat}); };
  // Warm-up: states, plans, cuBLASLt heuristics; estimate one call's time.
  for (int l = 0; l < s.layers; ++l) call(l);
  if (!ctx.error.ok()) {
    r.why = ctx.error.message();
    return r;
  }
  cudaEvent_t e0, e1;
  NUCLEUS_CUDA_CHECK(cudaEventCreate(&e0));
  NUCLEUS_CUDA_CHECK(cudaEventCreate(&e1));
  NUCLEUS_CUDA_CHECK(cudaEventRecord(e0, stream));
  for (int l = 0; l < s.layers; ++l) call(l);
  NUCLEUS_CUDA_CHECK(cudaEventRecord(e1, stream));
  NUCLEUS_CUDA_CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  NUCLEUS_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  const double est_us = 1e3 * ms / s.layers;
  // Calls per graph: about 2 ms of work, at least the rotation, at most 2000.
  const int calls = std::clamp(static_cast<int>(2000.0 / std::max(est_us, 1.0)), std::min(s.layers, 200), 2000);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  NUCLEUS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) call(i);
  const cudaError_t cap = cudaStreamEndCapture(stream, &graph);
  std::vector<float> samples;
  const int reps = est_us > 20000 ? 3 : 11;
  if (cap == cudaSuccess && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
    NUCLEUS_CUDA_CHECK(cudaGraphLaunch(exec, stream));  // warm
    for (int rep = 0; rep < reps; ++rep) {
      NUCLEUS_CUDA_CHECK(cudaEventRecord(e0, stream));
      NUCLEUS_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      NUCLEUS_CUDA_CHECK(cudaEventRecord(e1, stream));
      NUCLEUS_CUDA_CHECK(cudaEventSynchronize(e1));
      NUCLEUS_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      samples.push_back(1e3f * ms / calls);
    }
    cudaGraphExecDestroy(exec);
  } else {  // not capturable: time eager calls
    cudaGetLastError();
    r.why = "eager (capture failed)";
    for (int rep = 0; rep < reps; ++rep) {
      NUCLEUS_CUDA_CHECK(cudaEventRecord(e0, stream));
      for (int i = 0; i < calls; ++i) call(i);
      NUCLEUS_CUDA_CHECK(cudaEventRecord(e1, stream));
      NUCLEUS_CUDA_CHECK(cudaEventSynchronize(e1));
      NUCLEUS_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      samples.push_back(1e3f * ms / calls);
    }
  }
  if (graph) cudaGraphDestroy(graph);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(samples.begin(), samples.end());
  r.us = samples[samples.size() / 2];
  r.ok = true;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, small = false;
  std::vector<std::string> split_keys;  // --split-keys: extra nucleus_skN rows
  bool ctas_rows = false;               // --ctas: nucleus_1cta / nucleus_2cta rows at 16 heads
  int shape_batch = 0, shape_context = 0, only_heads = 0;
  std::vector<bool> kv_b_fp8 = {false};
  std::vector<KvCacheDtype> cache_dtypes = {KvCacheDtype::kBF16, KvCacheDtype::kFp8E4M3};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a == "--small") {
      small = true;
    } else if (a == "--ctas") {
      ctas_rows = true;
    } else if (a == "--shape" && i + 1 < argc) {
      if (std::sscanf(argv[++i], "%d,%d", &shape_batch, &shape_context) != 2 || shape_batch < 1 ||
          shape_context < 1) {
        std::fprintf(stderr, "mla_decode_bench: --shape BATCH,CONTEXT (positive)\n");
        return 2;
      }
    } else if (a == "--heads" && i + 1 < argc) {
      only_heads = std::atoi(argv[++i]);
      if (only_heads != 16 && only_heads != 64 && only_heads != 128) {
        std::fprintf(stderr, "mla_decode_bench: --heads 16, 64 or 128\n");
        return 2;
      }
    } else if (a == "--split-keys" && i + 1 < argc) {
      const std::string v = argv[++i];
      size_t at = 0;
      while (at <= v.size()) {
        const size_t comma = std::min(v.find(',', at), v.size());
        const std::string n = v.substr(at, comma - at);
        if (n.empty() || n.size() > 4 || n.find_first_not_of("0123456789") != std::string::npos ||
            std::stoi(n) < 32 || std::stoi(n) > 1024 || std::stoi(n) % 32 != 0) {
          std::fprintf(stderr, "mla_decode_bench: --split-keys takes multiples of 32 from 32 to 1024, e.g. 32,64,128\n");
          return 2;
        }
        split_keys.push_back("nucleus_sk" + n);
        at = comma + 1;
      }
    } else if (a == "--kv-b" && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v == "bf16") {
        kv_b_fp8 = {false};
      } else if (v == "fp8") {
        kv_b_fp8 = {true};
      } else if (v == "both") {
        kv_b_fp8 = {false, true};
      } else {
        std::fprintf(stderr, "mla_decode_bench: --kv-b bf16, fp8 or both\n");
        return 2;
      }
    } else if (a == "--kv-cache-dtype" && i + 1 < argc && std::string(argv[i + 1]) == "both") {
      ++i;
    } else if (a == "--kv-cache-dtype" && i + 1 < argc && std::string(argv[i + 1]) == "all") {
      ++i;
      cache_dtypes = {KvCacheDtype::kBF16, KvCacheDtype::kFp8E4M3, KvCacheDtype::kFp8DsMla};
    } else if (a == "--kv-cache-dtype" && i + 1 < argc) {
      auto d = parse_kv_cache_dtype(argv[++i]);
      if (!d.ok() || !d->has_value()) {
        std::fprintf(stderr, "mla_decode_bench: %s\n",
                     d.ok() ? "--kv-cache-dtype: bf16, fp8, fp8_e4m3, fp8_ds_mla, both or all"
                          : d.status().message().c_str());
        return 2;
      }
      cache_dtypes = {**d};
    } else {
      std::fprintf(stderr,
                   "usage: mla_decode_bench [--quick | --small] [--kv-cache-dtype "
                   "bf16|fp8|fp8_e4m3|fp8_ds_mla|both|all] [--kv-b bf16|fp8|both] [--split-keys N,M,...] [--ctas] [--shape B,CTX] [--heads N]\n");
      return 2;
    }
  }
  auto c = cuda::get_context();
  if (!c.ok()) {
    std::fprintf(stderr, "mla_decode_bench: %s\n", c.status().to_string().c_str());
    return 1;
  }
  std::printf("# mla_decode_bench on %s (%d SMs), page %d\n", (*c)->name.c_str(), (*c)->num_sms, kBlock);
  for (KvCacheDtype d : cache_dtypes) {
    const double row = static_cast<double>(kv_cache_row_bytes(d, kLatent));
    std::printf("# %s cache: %.0f B per token and layer: %.0f tokens/GB per layer, %.0f tokens/GB at 61 layers "
                "(DeepSeek-V3)\n",
                kv_cache_dtype_name(d), row, 1e9 / row, 1e9 / (61 * row));
  }
  std::printf("%-6s %-7s %-5s %-9s %-5s %-12s %10s %9s %8s %7s %7s %8s\n", "batch", "context", "heads", "cache",
              "kv_b", "backend", "us/call", "MB", "GB/s", "%4.8T", "%4.58T", "TFLOP/s");
  struct Shape {
    int batch, context;
  };
  std::vector<Shape> shapes = {{64, 4096}, {128, 4096}, {1, 1024}, {8, 1024}, {32, 1024},
                               {1, 4096},  {8, 4096},   {32, 4096}};
  if (quick) shapes = {{64, 4096}, {1, 1024}};
  if (small) {
    shapes.clear();
    for (int context : {1024, 4096, 32768})
      for (int batch : {1, 2, 4, 8}) shapes.push_back({batch, context});
  }
  if (shape_batch > 0) shapes = {{shape_batch, shape_context}};
  for (const Shape& sh : shapes) {
    for (int heads : {16, 64, 128}) {
      if (only_heads ? heads != only_heads : heads == 64) continue;  // 64 (TP 2 of V3) only when asked
      for (KvCacheDtype d : cache_dtypes) {
       for (bool wfp8 : kv_b_fp8) {
        auto s = make_setup(sh.batch, sh.context, heads, d, wfp8);
        DeviceInputUploader uploader;
        const DeviceStepInputs dev = uploader.upload(s->si);
        const double row = static_cast<double>(kv_cache_row_bytes(d, kLatent));
        const double bytes = static_cast<double>(sh.batch) * sh.context * row +
                             static_cast<double>(sh.batch) * heads * (kNope + kRope + kVHead) * 2 +
                             static_cast<double>(heads) * (kNope + kVHead) * kLora * (wfp8 ? 1 : 2);
        // Attention FLOPs: scores (576) and output (512) per head and key.
        const double flops = 2.0 * sh.batch * heads * static_cast<double>(sh.context) * (kLatent + kLora);
        std::vector<std::string> backends = {"nucleus", "nucleus_blas", "nucleus_small"};
        if (sh.batch <= 8) backends.insert(backends.end(), split_keys.begin(), split_keys.end());
        if (heads <= 16) {
          backends.push_back("nucleus_t32");
          // The row whose loader auto does not take (the other is "nucleus").
          backends.push_back(mla_decode_bulk_loads_auto(sh.batch, heads, d) ? "nucleus_cpasync" : "nucleus_bulk");
          // e4m3 rows: the fragment path auto does not take.
          if (d == KvCacheDtype::kFp8E4M3 || d == KvCacheDtype::kFp8DsMla)
            backends.push_back(mla_decode_fp8_register_convert_auto(sh.batch, d) ? "nucleus_smemconv" : "nucleus_regconv");
        }
        // Where the wgmma kernel applies: the kernel auto does not take.
        if (mla_decode_wgmma_applies(heads, d))
          backends.push_back(mla_decode_wgmma_auto(sh.batch, heads, d) ? "nucleus_mma" : "nucleus_wgmma");
        if (ctas_rows && heads <= 16) {
          backends.push_back("nucleus_1cta");
          backends.push_back("nucleus_2cta");
        }
        backends.push_back("flashinfer");
        backends.push_back("cuda_naive");
        for (const std::string& bname : backends) {
          const char* backend = bname.c_str();
          if (std::strcmp(backend, "nucleus_small") == 0 &&
              (sh.batch <= mla_decode_small_rows_auto(heads, wfp8) || sh.batch > 8))
            continue;  // the default (auto) there, or past 8 rows nucleus_blas
          if (std::strcmp(backend, "cuda_naive") == 0 &&
              (small || static_cast<double>(sh.batch) * heads * sh.context > 3e7))
            continue;  // minutes per call set; its order of magnitude shows on the smaller shapes
          Result r = time_backend(*s, backend, dev);
          const char* wname = wfp8 ? "fp8" : "bf16";
          if (!r.ok) {
            std::printf("%-6d %-7d %-5d %-9s %-5s %-12s refused: %s\n", sh.batch, sh.context, heads,
                        kv_cache_dtype_name(d), wname, backend, r.why.c_str());
            continue;
          }
          const double gbs = bytes / (r.us * 1e-6) / 1e9;
          std::printf("%-6d %-7d %-5d %-9s %-5s %-12s %10.2f %9.2f %8.0f %6.1f%% %6.1f%% %8.1f %s\n", sh.batch,
                      sh.context, heads, kv_cache_dtype_name(d), wname, backend, r.us, bytes / 1e6, gbs,
                      100.0 * gbs * 1e9 / roofline::kHbmSpecBytesPerSec, 100.0 * gbs * 1e9 / roofline::kHbmBytesPerSec,
                      flops / (r.us * 1e-6) / 1e12, r.why.c_str());
          std::fflush(stdout);
        }
       }
      }
    }
  }
  return 0;
}
