// NUCLEUS_BENCH_NEEDS_CUDA. The decode-program kernel (kernels/mono/mono_kernel.cuh,
// issue #20) against the plain chain of kernels the decode graph runs, on the
// attention-free GEMV chain of a DeepSeek-V2-Lite layer
// (kernels/mono/mono_program_ref.h LayerChain: add + RMSNorm, q_proj + kv_a
// 3648 x 2048, o_proj 2048 x 2048, add + RMSNorm, shared gate_up 5632 x 2048
// with SiLU-and-multiply, down 2048 x 2816; 57.9 MB of bf16 weights), at
// 1, 2, 4 and 8 rows:
//   plain      add_rmsnorm, skinny, skinny, add_rmsnorm, skinny, silu_mul,
//              skinny: each launched with PDL as in the decode graph
//   program/T  one launch of the program, jobs of T columns, one CTA per SM
// and, per m, q_proj + kv_a alone (14.9 MB) through the skinny kernel and as a
// one-stage program (% of roofline on that GEMV's bytes).
// Second table, the attention front of a V2-Lite layer (FrontChain: add +
// RMSNorm, q_proj, kv_a, RoPE + cache write) against add_rmsnorm, two skinny
// GEMMs and rope_kv_cache_write (bytes: the two weights).
// Third table, the MoE block of a V2-Lite layer (mono_program_ref.h
// MoeChain: post-attention add + RMSNorm, router 64 x 2048, top-6 softmax
// routing, two shared experts, 64 routed experts of 1408, the weighted sum):
//   ops        what the decode graph runs: add_rmsnorm, the skinny router
//              GEMM (f32 logits), MoeRouteOp and MoeExpertsOp (cuda_grouped,
//              the shared experts as routed ones: 66 experts, top-8)
//   program/T  the block as one program
// Then the MoE block followed by the next layer's front, as two programs and
// as one (what a program boundary costs).
// Bytes: the router, the shared experts and the routed experts the step
// activates (from the program's route table), each once (one copy of the
// weights: a step touches 104-560 MB, past the 50 MB L2). The block's delta
// is zero, so the ops' in-place residual add keeps every run's routing.
// Last table: the GEMV chain with FP8 e4m3 block-scaled weights at
// DeepSeek-V3's shapes (74 MB), program against the skinny FP8 kernel's chain.
// Method (bench/bench_util.h): CUDA graphs of 20 chains rotating over 3
// copies of the weights (174 MB, past the L2), the median per chain. Bytes =
// the weights once (activations are < 0.2 MB); % of the one roofline
// (core/roofline.h, 4.58 TB/s). Prints a markdown table.
//
//   mono_bench [--m 1,2,4,8] [--tiles 16,32,64] [--probe]
// --probe prints only the diagnostics (mono_kernel.cuh MonoProbe): the probe
// table of the one-stage GEMV and the chain, and each one's timeline (per CTA
// and per stage: when its jobs' waits ended and they were done, and the
// median job's phases).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <set>
#include <tuple>
#include <cmath>
#include <ctime>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "core/roofline.h"
#include "kernels/activation/silu_mul.cuh"
#include "kernels/gemm/skinny_fp8_gemm.cuh"
#include "kernels/gemm/skinny_gemm.cuh"
#include "kernels/mono/mono_kernel.cuh"
#include "kernels/mono/mono_program_ref.h"
#include "kernels/rmsnorm/rmsnorm.cuh"
#include "kernels/rope/rope_kv_cache.cuh"
#include "graph/step_resources.h"
#include "ops/moe_ops.h"

using namespace nucleus;
using namespace nucleus::kernels;

namespace {

constexpr int64_t kHidden = 2048, kFront = 3072 + 576, kOk = 2048, kInter = 2 * 1408, kRows = 8;

Tensor f32_tensor(int64_t n, float lo, float hi) {
  std::vector<float> v(n);
  for (auto& x : v) x = lo + (hi - lo) * static_cast<float>(bench::next_rand() % 10000) / 10000.0f;
  Tensor t = Tensor::empty({n}, DType::kF32, Device::kCuda);
  copy_to_device(t.raw(), v.data(), v.size() * 4);
  return t;
}

struct Weights {
  Tensor front, o, gate_up, down;
};

template <typename T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.raw());
}

// A plan's queues and counters on the device, and the Program of a launch.
struct DevicePlan {
  mono::ProgramPlan plan;
  Tensor queue_start, jobs, counters;
  explicit DevicePlan(mono::ProgramPlan p) : plan(std::move(p)) {
    queue_start = Tensor::empty({static_cast<int64_t>(plan.queue_start.size())}, DType::kI32, Device::kCuda);
    copy_to_device(queue_start.raw(), plan.queue_start.data(), plan.queue_start.size() * 4);
    jobs = Tensor::empty({static_cast<int64_t>(std::max<size_t>(1, plan.jobs.size()) * 2)}, DType::kI32, Device::kCuda);
    copy_to_device(jobs.raw(), plan.jobs.data(), plan.jobs.size() * sizeof(mono::Job));
    counters = Tensor::empty({mono::kMaxStages + 1}, DType::kI32, Device::kCuda);
    zero_device(counters);
  }
  mono::Program program(int32_t rows) const {
    return mono::program_view(plan, rows, ptr<int32_t>(queue_start), static_cast<const mono::Job*>(jobs.raw()),
                              ptr<int32_t>(counters));
  }
};

std::string fmt_us(double v) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.2f", v);
  return b;
}

// plan_program on the device, or null (the error printed).
std::unique_ptr<DevicePlan> device_plan(const std::vector<mono::Stage>& stages, int64_t width, int num_sms) {
  auto plan = mono::plan_program(stages, static_cast<int32_t>(width), num_sms);
  if (!plan.ok()) {
    std::fprintf(stderr, "mono_bench: %s\n", plan.status().to_string().c_str());
    return nullptr;
  }
  return std::make_unique<DevicePlan>(std::move(*plan));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> ms = {1, 2, 4, 8}, tiles = {16, 32, 64};
  bool probe_only = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--probe")) {
      probe_only = true;
    } else if (i + 1 < argc && !std::strcmp(argv[i], "--m")) {
      ms = bench::parse_list(argv[++i]);
    } else if (i + 1 < argc && !std::strcmp(argv[i], "--tiles")) {
      tiles = bench::parse_list(argv[++i]);
    }
  }
  for (int64_t m : ms)
    if (m != 1 && m != 2 && m != 4 && m != 8) {
      std::fprintf(stderr, "mono_bench: --m values must be 1, 2, 4 or 8\n");
      return 2;
    }
  auto ctx = cuda::get_context();
  if (!ctx.ok()) {
    std::fprintf(stderr, "mono_bench: %s\n", ctx.status().to_string().c_str());
    return 1;
  }
  cuda::Context& c = **ctx;
  cudaStream_t stream = c.stream;
  constexpr int kCopies = 3;
  std::vector<Weights> w(kCopies);
  for (auto& x : w) {
    x.front = bench::random_bf16(kFront * kHidden, 0.04f);
    x.o = bench::random_bf16(kHidden * kOk, 0.04f);
    x.gate_up = bench::random_bf16(2 * kInter * kHidden, 0.04f);
    x.down = bench::random_bf16(kHidden * kInter, 0.03f);
  }
  Tensor input_norm = f32_tensor(kHidden, 0.5f, 1.5f), post_norm = f32_tensor(kHidden, 0.5f, 1.5f);
  Tensor residual = f32_tensor(kRows * kHidden, -1.0f, 1.0f), residual_mid = f32_tensor(kRows * kHidden, 0, 0),
         residual_out = f32_tensor(kRows * kHidden, 0, 0);
  Tensor delta = bench::random_bf16(kRows * kHidden, 0.01f);
  Tensor x_norm = bench::random_bf16(kRows * kHidden, 0), front = bench::random_bf16(kRows * kFront, 0),
         o = bench::random_bf16(kRows * kHidden, 0), gate_up = bench::random_bf16(kRows * 2 * kInter, 0),
         h = bench::random_bf16(kRows * kInter, 0), delta_out = bench::random_bf16(kRows * kHidden, 0);
  // The layer chain over weight copy i and the shared activations.
  auto layer_chain = [&](int i) {
    mono::LayerChain lc;
    lc.hidden = kHidden;
    lc.front_n = kFront;
    lc.o_k = kOk;
    lc.inter = kInter;
    lc.w_front = ptr<uint16_t>(w[i].front);
    lc.w_o = ptr<uint16_t>(w[i].o);
    lc.w_gate_up = ptr<uint16_t>(w[i].gate_up);
    lc.w_down = ptr<uint16_t>(w[i].down);
    lc.input_norm = ptr<float>(input_norm);
    lc.post_norm = ptr<float>(post_norm);
    lc.residual_in = ptr<float>(residual);
    lc.delta_in = ptr<uint16_t>(delta);
    lc.residual_mid = ptr<float>(residual_mid);
    lc.residual_out = ptr<float>(residual_out);
    lc.front = ptr<uint16_t>(front);
    lc.o = ptr<uint16_t>(o);
    lc.h = ptr<uint16_t>(h);
    lc.delta_out = ptr<uint16_t>(delta_out);
    return lc;
  };
  const double weight_bytes = static_cast<double>((kFront * kHidden + kHidden * kOk + 2 * kInter * kHidden +
                                                   kHidden * kInter) *
                                                  2);

  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  std::printf("# mono_bench %s on %s (%d SMs, L2 %.0f MB); roofline %.2f TB/s; weights %.1f MB a chain\n\n", date,
              c.name.c_str(), c.num_sms, c.l2_bytes / 1e6, roofline::kHbmBytesPerSec / 1e12, weight_bytes / 1e6);
  // --probe: what limits the program's streaming (mono_kernel.cuh MonoProbe): the q_proj + kv_a GEMV alone
  // (one stage, 14.9 MB) and the layer chain, with the copy path alone, 16-byte cp.async copies, fewer slots.
  if (probe_only) {
    std::printf("| m | probe | what | ring slots | us | GB/s | %% of roofline |\n|---|---|---|---|---|---|---|\n");
    for (int64_t m : ms)
      for (int what = 0; what < 2; ++what) {
        std::vector<std::unique_ptr<DevicePlan>> plans;
        for (int i = 0; i < kCopies; ++i) {
          std::vector<mono::Stage> st;
          if (what == 0) {
            mono::Stage g;
            g.w = ptr<uint16_t>(w[i].front);
            g.n = kFront;
            g.k = kHidden;
            g.x = ptr<uint16_t>(x_norm);
            g.x_stride = kHidden;
            g.out = ptr<uint16_t>(front);
            g.out_stride = kFront;
            g.tile = 16;
            st = {g};
          } else {
            st = mono::layer_chain_stages(layer_chain(i), 16);
          }
          plans.push_back(device_plan(st, m, c.num_sms));
          if (!plans.back()) return 1;
        }
        const double bytes = what == 0 ? static_cast<double>(kFront * kHidden * 2) : weight_bytes;
        const int32_t rows = static_cast<int32_t>(m);
        struct Variant {
          const char* name;
          mono::MonoProbe probe;
          bool full = false;   // the full build (Program::lean false)
          bool fence = false;  // fence + atomic counters (Program::release_counters false)
        };
        auto pr = [](bool copy_only, bool rotate, bool packed, bool contiguous, bool no_hint) {
          mono::MonoProbe q;
          q.copy_only = copy_only;
          q.rotate = rotate;
          q.packed_rows = packed;
          q.contiguous = contiguous;
          q.no_hint = no_hint;
          return q;
        };
        const Variant variants[] = {{"default", {}},
                                    {"copy only", {true, false, 0}},
                                    {"cp.async 16 B", {false, true, 0}},
                                    {"2 slots", {false, false, 2}},
                                    {"6 slots", {false, false, 6}},
                                    {"fence + atomic counters (before)", {}, false, true},
                                    {"rotated slices", pr(false, true, false, false, false)},
                                    {"copy only, rotated slices", pr(true, true, false, false, false)},
                                    {"copy only, 128-B aligned rows", pr(true, false, true, false, false)},
                                    {"copy only, one 16 KB copy a chunk", pr(true, false, false, true, false)},
                                    {"no L2 hint", pr(false, false, false, false, true)},
                                    {"copy only, no L2 hint", pr(true, false, false, false, true)},
                                    {"full build", {}, true},
                                    {"full build, copy only", {true, false, 0}, true}};
        for (const Variant& v : variants) {
          const double us = bench::median_us_per_launch(kCopies, [&](int i) {
            mono::Program p = plans[i]->program(rows);
            p.lean = !v.full;
            p.release_counters = !v.fence;
            return mono::launch_mono_program(p, stream, true, v.probe) == cudaSuccess;
          });
          const double gbs = bytes / (us * 1e-6) / 1e9;
          std::printf("| %ld | %s | %s | %d | %.2f | %.0f | %.1f%% |\n", long(m), v.name,
                      what == 0 ? "q_proj + kv_a GEMV" : "layer chain",
                      mono::mono_ring_slots(plans[0]->program(rows), v.probe), us, gbs,
                      100.0 * gbs * 1e9 / roofline::kHbmBytesPerSec);
          std::fflush(stdout);
        }
        // Where the time goes (MonoProbe::timeline) in the last of four
        // back-to-back launches, default and copy only: per CTA, us after the
        // earliest CTA's start; min / median / max over the CTAs.
        constexpr int kF = mono::kTimelineFields;
        Tensor tl_buf = Tensor::empty({int64_t{c.num_sms} * kF * 2}, DType::kI32, Device::kCuda);  // [CTA][kF] u64
        for (int copy_only = 0; copy_only < 2; ++copy_only) {
          mono::MonoProbe q;
          q.copy_only = copy_only;
          q.timeline = static_cast<unsigned long long*>(tl_buf.raw());
          zero_device(tl_buf);
          for (int i = 0; i < 4; ++i)
            if (mono::launch_mono_program(plans[i % kCopies]->program(rows), stream, true, q) != cudaSuccess) return 1;
          NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(stream));
          std::vector<unsigned long long> t(static_cast<size_t>(c.num_sms) * kF);
          NUCLEUS_CUDA_CHECK(cudaMemcpy(t.data(), tl_buf.raw(), t.size() * 8, cudaMemcpyDeviceToHost));
          const int ctas = plans[3 % kCopies]->program(rows).num_ctas;
          unsigned long long t0 = ~0ull;
          for (int cta = 0; cta < ctas; ++cta) t0 = std::min(t0, t[cta * kF]);
          std::printf("\ntimeline m=%ld %s%s (us after the first CTA's start; min / median / max over %d CTAs)\n",
                      long(m), what == 0 ? "GEMV" : "chain", copy_only ? ", copy only" : "", ctas);
          const char* names[6] = {"start", "inputs ready", "first chunk landed", "last chunk landed", "compute done",
                                  "copies issued"};
          for (int f = 0; f < 6; ++f) {
            std::vector<double> v;
            for (int cta = 0; cta < ctas; ++cta)
              if (t[cta * kF + f] >= t0) v.push_back(static_cast<double>(t[cta * kF + f] - t0) / 1e3);
            if (v.empty()) continue;
            std::sort(v.begin(), v.end());
            std::printf("  %-20s %7.2f %7.2f %7.2f\n", names[f], v.front(), v[v.size() / 2], v.back());
          }
          // Per stage: when its jobs' waits were done and its jobs counted
          // (min / median / max: the stage is done at the max), and the
          // median job's phases: building x, the chunks (MMAs), storing and
          // counting.
          const mono::ProgramPlan& pl = plans[3 % kCopies]->plan;
          auto mmm = [](std::vector<double> v) {
            std::sort(v.begin(), v.end());
            return v.empty() ? std::string("-") : fmt_us(v.front()) + " " + fmt_us(v[v.size() / 2]) + " " + fmt_us(v.back());
          };
          for (size_t st = 0; st < pl.stages.size(); ++st) {
            std::vector<double> w, d, px, pc, pe;
            for (int cta = 0; cta < ctas; ++cta)
              for (int j = pl.queue_start[cta]; j < pl.queue_start[cta + 1] && j - pl.queue_start[cta] < mono::kTimelineJobs;
                   ++j)
                if (pl.jobs[j].stage == static_cast<int32_t>(st)) {
                  const size_t at = static_cast<size_t>(cta) * kF + 6 + 4 * (j - pl.queue_start[cta]);
                  const auto us = [&](size_t i) { return static_cast<double>(static_cast<long long>(t[i] - t0)) / 1e3; };
                  if (t[at] < t0 || t[at + 3] < t0) continue;
                  w.push_back(us(at));
                  d.push_back(us(at + 3));
                  const double xb = t[at + 1] >= t[at] ? us(at + 1) : us(at);  // x carried: no build
                  if (t[at + 2] >= t[at]) {
                    px.push_back(xb - us(at));
                    pc.push_back(us(at + 2) - xb);
                    pe.push_back(us(at + 3) - us(at + 2));
                  }
                }
            if (w.empty()) continue;
            std::printf("  stage %zu (%zu jobs): waits done %s; counted %s; a job: x %s, chunks %s, store + count %s\n", st,
                        d.size(), mmm(w).c_str(), mmm(d).c_str(), mmm(px).c_str(), mmm(pc).c_str(), mmm(pe).c_str());
          }
        }
        std::printf("\n| m | probe | what | ring slots | us | GB/s | %% of roofline |\n|---|---|---|---|---|---|---|\n");
      }
    return 0;
  }
  std::printf("| m | variant | ring slots | us | GB/s | %% of roofline | vs plain |\n|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);

  for (int64_t m : ms) {
    double plain_us = -1;
    auto row = [&](const std::string& variant, const std::string& slots, double us) {
      if (us < 0) {
        std::printf("| %ld | %s | %s | failed | | | |\n", long(m), variant.c_str(), slots.c_str());
        std::fflush(stdout);
        return;
      }
      const double gbs = weight_bytes / (us * 1e-6) / 1e9;
      std::printf("| %ld | %s | %s | %.2f | %.0f | %.1f%% | %s |\n", long(m), variant.c_str(), slots.c_str(), us, gbs,
                  100.0 * gbs * 1e9 / roofline::kHbmBytesPerSec,
                  plain_us > 0 ? (std::to_string(plain_us / us).substr(0, 4) + "x").c_str() : "");
      std::fflush(stdout);
    };
    // The plain chain, as the decode graph launches it.
    plain_us = bench::median_us_per_launch(kCopies, [&](int i) {
      AddRmsNormParams n1;
      n1.residual = ptr<float>(residual);
      n1.delta = delta.raw();
      n1.w = ptr<float>(input_norm);
      n1.rows = m;
      n1.width = kHidden;
      n1.out = ptr<__nv_bfloat16>(x_norm);
      n1.pdl = true;
      bool ok = launch_add_rmsnorm(n1, stream) == cudaSuccess;
      auto gemm = [&](const Tensor& x, int64_t x_stride, const Tensor& wt, Tensor& out, int64_t n, int64_t k) {
        SkinnyGemmArgs a;
        a.x = ptr<__nv_bfloat16>(x);
        a.x_stride = x_stride;
        a.w = ptr<__nv_bfloat16>(wt);
        a.out = out.raw();
        a.out_stride = n;
        a.m = m;
        a.n = n;
        a.k = k;
        a.pdl = true;
        return launch_skinny_gemm(a, stream) == cudaSuccess;
      };
      ok = ok && gemm(x_norm, kHidden, w[i].front, front, kFront, kHidden);
      ok = ok && gemm(front, kFront, w[i].o, o, kHidden, kOk);
      AddRmsNormParams n2 = n1;
      n2.delta = o.raw();
      n2.w = ptr<float>(post_norm);
      ok = ok && launch_add_rmsnorm(n2, stream) == cudaSuccess;
      ok = ok && gemm(x_norm, kHidden, w[i].gate_up, gate_up, 2 * kInter, kHidden);
      ok = ok && launch_silu_mul(ptr<__nv_bfloat16>(gate_up), m, kInter, ptr<__nv_bfloat16>(h), stream, true) ==
                     cudaSuccess;
      ok = ok && gemm(h, kInter, w[i].down, delta_out, kHidden, kInter);
      return ok;
    });
    const double base = plain_us;
    plain_us = -1;
    row("plain", "", base);
    plain_us = base;
    for (int64_t tile : tiles) {
      // One plan (queues, counters) per weight copy.
      std::vector<std::unique_ptr<DevicePlan>> copies;
      const int width = static_cast<int>(m);
      bool planned = true;
      for (int i = 0; i < kCopies; ++i) {
        copies.push_back(
            device_plan(mono::layer_chain_stages(layer_chain(i), static_cast<int32_t>(tile)), width, c.num_sms));
        if (!copies.back()) {
          planned = false;
          break;
        }
      }
      const std::string name = "program/" + std::to_string(tile);
      if (!planned) {
        row(name, "", -1);
        continue;
      }
      auto program = [&](int i) { return copies[i]->program(width); };
      const double us = bench::median_us_per_launch(
          kCopies, [&](int i) { return mono::launch_mono_program(program(i), stream, true) == cudaSuccess; });
      row(name, std::to_string(mono::mono_ring_slots(program(0))), us);
    }
    // One GEMV alone (q_proj + kv_a, 14.9 MB): how fast the ring streams
    // against the skinny kernel, with no stage boundary to hide.
    const double front_bytes = static_cast<double>(kFront * kHidden * 2);
    auto single = [&](const std::string& variant, const std::string& slots, double us) {
      const double gbs = us > 0 ? front_bytes / (us * 1e-6) / 1e9 : 0;
      std::printf("| %ld | %s | %s | %.2f | %.0f | %.1f%% | |\n", long(m), variant.c_str(), slots.c_str(), us, gbs,
                  100.0 * gbs * 1e9 / roofline::kHbmBytesPerSec);
      std::fflush(stdout);
    };
    single("front GEMV alone: skinny", "", bench::median_us_per_launch(kCopies, [&](int i) {
             SkinnyGemmArgs a;
             a.x = ptr<__nv_bfloat16>(x_norm);
             a.x_stride = kHidden;
             a.w = ptr<__nv_bfloat16>(w[i].front);
             a.out = front.raw();
             a.out_stride = kFront;
             a.m = m;
             a.n = kFront;
             a.k = kHidden;
             a.pdl = true;
             return launch_skinny_gemm(a, stream) == cudaSuccess;
           }));
    {
      std::vector<std::unique_ptr<DevicePlan>> plans;
      for (int i = 0; i < kCopies; ++i) {
        mono::Stage st;
        st.w = ptr<uint16_t>(w[i].front);
        st.n = kFront;
        st.k = kHidden;
        st.x = ptr<uint16_t>(x_norm);
        st.x_stride = kHidden;
        st.out = ptr<uint16_t>(front);
        st.out_stride = kFront;
        st.tile = 16;
        plans.push_back(device_plan({st}, m, c.num_sms));
        if (!plans.back()) return 1;
      }
      auto view = [&](int i) { return plans[i]->program(static_cast<int32_t>(m)); };
      single("front GEMV alone: program/16", std::to_string(mono::mono_ring_slots(view(0))),
             bench::median_us_per_launch(
                 kCopies, [&](int i) { return mono::launch_mono_program(view(i), stream, true) == cudaSuccess; }));
    }
  }
  // The attention front of a V2-Lite layer (FrontChain): input add + RMSNorm, q_proj 3072 x 2048, kv_a 576 x
  // 2048, RoPE + the latent cache write (kv norm fused), against the plain chain the decode graph runs.
  {
    constexpr int64_t kHeads = 16, kQ = 3072, kKv = 576, kSlots = 4096;
    std::vector<float> inv(32);
    for (int i = 0; i < 32; ++i) inv[i] = std::pow(10000.0f, -2.0f * i / 64.0f);
    Tensor d_inv = Tensor::empty({32}, DType::kF32, Device::kCuda);
    copy_to_device(d_inv.raw(), inv.data(), inv.size() * 4);
    Tensor kv_norm = f32_tensor(512, 0.5f, 1.5f), cache = bench::random_bf16(kSlots * kKv, 0);
    std::vector<int32_t> pos_h(kRows);
    std::vector<int64_t> slot_h(kRows);
    for (int64_t r = 0; r < kRows; ++r) {
      pos_h[r] = static_cast<int32_t>(1000 + 37 * r);
      slot_h[r] = 64 * r + 5;
    }
    Tensor pos = Tensor::empty({kRows}, DType::kI32, Device::kCuda), slots = Tensor::empty({kRows}, DType::kI64, Device::kCuda);
    copy_to_device(pos.raw(), pos_h.data(), pos_h.size() * 4);
    copy_to_device(slots.raw(), slot_h.data(), slot_h.size() * 8);
    Tensor q = bench::random_bf16(kRows * kQ, 0), kv = bench::random_bf16(kRows * kKv, 0);
    std::vector<Tensor> wq, wkv;
    for (int i = 0; i < kCopies; ++i) {
      wq.push_back(bench::random_bf16(kQ * kHidden, 0.04f));
      wkv.push_back(bench::random_bf16(kKv * kHidden, 0.04f));
    }
    const double front_bytes = static_cast<double>((kQ + kKv) * kHidden * 2);
    std::printf("\n| m | attention front | us | GB/s | %% of roofline | vs plain |\n|---|---|---|---|---|---|\n");
    for (int64_t m : ms) {
      const double plain = bench::median_us_per_launch(kCopies, [&](int i) {
        AddRmsNormParams n;
        n.residual = ptr<float>(residual);
        n.delta = delta.raw();
        n.w = ptr<float>(input_norm);
        n.rows = m;
        n.width = kHidden;
        n.out = ptr<__nv_bfloat16>(x_norm);
        n.pdl = true;
        bool ok = launch_add_rmsnorm(n, stream) == cudaSuccess;
        for (auto [w, out, nn] : {std::tuple{&wq[i], &q, kQ}, std::tuple{&wkv[i], &kv, kKv}}) {
          SkinnyGemmArgs a;
          a.x = ptr<__nv_bfloat16>(x_norm);
          a.x_stride = kHidden;
          a.w = ptr<__nv_bfloat16>(*w);
          a.out = out->raw();
          a.out_stride = nn;
          a.m = m;
          a.n = nn;
          a.k = kHidden;
          a.pdl = true;
          ok = ok && launch_skinny_gemm(a, stream) == cudaSuccess;
        }
        RopeKvCacheParams r;
        r.q = ptr<__nv_bfloat16>(q);
        r.q_stride = kQ;
        r.kv_a = ptr<__nv_bfloat16>(kv);
        r.kv_stride = kKv;
        r.kv_norm_w = ptr<float>(kv_norm);
        r.kv_norm_eps = 1e-6f;
        r.positions = ptr<int32_t>(pos);
        r.slot_mapping = ptr<int64_t>(slots);
        r.inv_freq = ptr<float>(d_inv);
        r.cache = cache.raw();
        r.num_tokens = m;
        r.num_heads = kHeads;
        r.qk_nope = 128;
        r.qk_rope = 64;
        r.kv_lora = 512;
        r.pdl = true;
        return ok && launch_rope_kv_cache_write(r, stream) == cudaSuccess;
      });
      auto row = [&](const char* what, double us, double base) {
        const double gbs = front_bytes / (us * 1e-6) / 1e9;
        std::printf("| %ld | %s | %.2f | %.0f | %.1f%% | %s |\n", long(m), what, us, gbs,
                    100.0 * gbs * 1e9 / roofline::kHbmBytesPerSec,
                    base > 0 ? (std::to_string(base / us).substr(0, 4) + "x").c_str() : "");
        std::fflush(stdout);
      };
      row("plain", plain, -1);
      std::vector<std::unique_ptr<DevicePlan>> plans;
      for (int i = 0; i < kCopies; ++i) {
        mono::FrontChain fc;
        fc.hidden = kHidden;
        fc.num_heads = kHeads;
        fc.w_q = ptr<uint16_t>(wq[i]);
        fc.w_kva = ptr<uint16_t>(wkv[i]);
        fc.input_norm = ptr<float>(input_norm);
        fc.kv_norm = ptr<float>(kv_norm);
        fc.inv_freq = ptr<float>(d_inv);
        fc.residual = ptr<float>(residual);
        fc.delta = ptr<uint16_t>(delta);
        fc.residual_out = ptr<float>(residual_mid);
        fc.residual_copy_to = ptr<float>(residual_out);
        fc.q = ptr<uint16_t>(q);
        fc.kv_a = ptr<uint16_t>(kv);
        fc.positions = ptr<int32_t>(pos);
        fc.slot_mapping = ptr<int64_t>(slots);
        fc.cache = ptr<uint16_t>(cache);
        fc.num_slots = kSlots;
        plans.push_back(device_plan(mono::front_chain_stages(fc, 16), m, c.num_sms));
        if (!plans.back()) return 1;
      }
      const double prog = bench::median_us_per_launch(kCopies, [&](int i) {
        return mono::launch_mono_program(plans[i]->program(static_cast<int32_t>(m)), stream, true) == cudaSuccess;
      });
      row("program/16", prog, plain);
    }
  }
  // The MoE block.
  {
    constexpr int64_t kE = 64, kTopK = 6, kInter = 1408, kSharedInter = 2 * 1408;
    auto hashed = [&](int64_t n, float scale) { return bench::random_bf16(n, scale); };
    Tensor w_router = hashed(kE * kHidden, 0.15f);
    std::deque<LinearWeight> lw;
    std::vector<ExpertWeights> experts;
    // Routed experts 0 ... 63 then the two shared ones (64, 65), as the engine's fused-shared layout.
    Tensor gate_up_all = hashed((kE + 2) * 2 * kInter * kHidden, 0.04f), down_all = hashed((kE + 2) * kHidden * kInter, 0.03f);
    for (int64_t e = 0; e < kE + 2; ++e) {
      LinearWeight gu, dn;
      gu.out_features = 2 * kInter;
      gu.in_features = kHidden;
      gu.weight = Tensor::wrap(static_cast<uint16_t*>(gate_up_all.raw()) + e * 2 * kInter * kHidden, {2 * kInter, kHidden},
                               DType::kBF16, Device::kCuda, nullptr);
      dn.out_features = kHidden;
      dn.in_features = kInter;
      dn.weight = Tensor::wrap(static_cast<uint16_t*>(down_all.raw()) + e * kHidden * kInter, {kHidden, kInter},
                               DType::kBF16, Device::kCuda, nullptr);
      lw.push_back(gu);
      lw.push_back(dn);
      experts.push_back({&lw[lw.size() - 2], &lw.back()});
    }
    // The program's shared expert: the two shared experts side by side ([gate 2816 | up 2816] x 2048, down 2048 x 2816).
    Tensor shared_gate_up = hashed(2 * kSharedInter * kHidden, 0.04f), shared_down = hashed(kHidden * kSharedInter, 0.03f);
    kernels::MoeRoutingParams rp;
    rp.num_experts = kE;
    rp.top_k = kTopK;
    rp.shared_slots = 2;
    MoeRouteOp route_op(rp, Tensor());
    MoeExpertsOp experts_op(experts, kInter, kTopK + 2);
    for (const auto& b : MoeRouteOp::backends())
      if (b.device == Device::kCuda) NUCLEUS_CHECK_OK(route_op.use_backend(b));
    for (const auto& b : MoeExpertsOp::backends())
      if (b.device == Device::kCuda && std::strcmp(b.name, "cuda_grouped") == 0) NUCLEUS_CHECK_OK(experts_op.use_backend(b));
    StepResources res;
    NUCLEUS_CHECK_OK(res.reserve_ops({&route_op, &experts_op}, StepLimits{.max_tokens = 16}, Device::kCuda));
    Tensor logits = Tensor::empty({kRows, kE}, DType::kF32, Device::kCuda);
    Tensor ids = Tensor::empty({kRows, kTopK + 2}, DType::kI32, Device::kCuda);
    Tensor weights = Tensor::empty({kRows, kTopK + 2}, DType::kF32, Device::kCuda);
    Tensor moe_out = bench::random_bf16(kRows * kHidden, 0), scratch = Tensor::empty({256, (kTopK + 2) * kInter}, DType::kF32, Device::kCuda);
    Tensor table = Tensor::empty({static_cast<int64_t>(sizeof(mono::RouteTable) / 4)}, DType::kI32, Device::kCuda);
    Tensor h_shared = bench::random_bf16(kRows * kSharedInter, 0), y_shared = f32_tensor(kRows * kHidden, 0, 0);
    Tensor h_routed = bench::random_bf16(48 * kRows * kInter, 0), y_routed = f32_tensor(48 * kRows * kHidden, 0, 0);
    // A zero delta: the ops' add_rmsnorm adds it to the residual in place, which then stays put, so every
    // run of either side routes the same rows the same way.
    Tensor zero_delta = bench::random_bf16(kRows * kHidden, 0.0f);
    std::printf("\n| m | MoE block | distinct experts | MB | us | GB/s | %% of roofline | vs ops |\n|---|---|---|---|---|---|---|---|\n");
    for (int64_t m : ms) {
      OpContext ctx;
      ctx.device = Device::kCuda;
      ctx.stream = stream;
      NUCLEUS_CHECK_OK(res.begin_step(ctx));
      auto ops_step = [&] {
        AddRmsNormParams n;
        n.residual = ptr<float>(residual);
        n.delta = zero_delta.raw();
        n.w = ptr<float>(post_norm);
        n.rows = m;
        n.width = kHidden;
        n.out = ptr<__nv_bfloat16>(x_norm);
        n.pdl = true;
        NUCLEUS_CHECK(launch_add_rmsnorm(n, stream) == cudaSuccess, "add_rmsnorm");
        SkinnyGemmArgs a;
        a.x = ptr<__nv_bfloat16>(x_norm);
        a.x_stride = kHidden;
        a.w = ptr<__nv_bfloat16>(w_router);
        a.out = logits.raw();
        a.out_stride = kE;
        a.out_f32 = true;
        a.m = m;
        a.n = kE;
        a.k = kHidden;
        a.pdl = true;
        NUCLEUS_CHECK(launch_skinny_gemm(a, stream) == cudaSuccess, "router");
        const Tensor lg = logits.rows(0, m), id = ids.rows(0, m), wt = weights.rows(0, m);
        route_op.run(ctx, TensorList{lg}, TensorList{id, wt});
        experts_op.run(ctx, TensorList{x_norm.view({kRows, kHidden}).rows(0, m), id, wt},
                       TensorList{moe_out.view({kRows, kHidden}).rows(0, m), scratch});
        return true;
      };
      // The program.
      mono::MoeChain mc;
      mc.hidden = kHidden;
      mc.inter = kInter;
      mc.shared_inter = kSharedInter;
      mc.num_experts = kE;
      mc.top_k = kTopK;
      mc.slots = static_cast<int32_t>(std::min<int64_t>(m * kTopK, kE));
      mc.w_router = ptr<uint16_t>(w_router);
      mc.w_gate_up = ptr<uint16_t>(gate_up_all);
      mc.w_down = ptr<uint16_t>(down_all);
      mc.w_shared_gate_up = ptr<uint16_t>(shared_gate_up);
      mc.w_shared_down = ptr<uint16_t>(shared_down);
      mc.post_norm = ptr<float>(post_norm);
      mc.residual = ptr<float>(residual);
      mc.delta = ptr<uint16_t>(zero_delta);
      mc.residual_out = ptr<float>(residual_out);
      mc.logits = ptr<float>(logits);
      mc.table = static_cast<mono::RouteTable*>(table.raw());
      mc.h_shared = ptr<uint16_t>(h_shared);
      mc.y_shared = ptr<float>(y_shared);
      mc.h = ptr<uint16_t>(h_routed);
      mc.y = ptr<float>(y_routed);
      mc.delta_out = ptr<uint16_t>(delta_out);
      // Bytes: from one run of the program's routing.
      double moe_bytes = static_cast<double>(kE * kHidden * 2 + 3 * kSharedInter * kHidden * 2);
      int distinct = 0;
      double ops_us = -1;
      for (int64_t tile : tiles) {
        const std::unique_ptr<DevicePlan> dp = device_plan(mono::moe_chain_stages(mc, static_cast<int32_t>(tile)), m, c.num_sms);
        if (!dp) return 1;
        const mono::Program prog = dp->program(static_cast<int32_t>(m));
        if (distinct == 0) {
          NUCLEUS_CHECK(mono::launch_mono_program(prog, stream, false) == cudaSuccess, "program");
          NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(stream));
          mono::RouteTable t;
          NUCLEUS_CUDA_CHECK(cudaMemcpy(&t, table.raw(), sizeof(t), cudaMemcpyDeviceToHost));
          distinct = t.count;
          moe_bytes += static_cast<double>(distinct) * 3 * kInter * kHidden * 2;
          ops_us = bench::median_us_per_launch(1, [&](int) { return ops_step(); });
          NUCLEUS_CHECK_OK(ctx.error);
          const double gbs = moe_bytes / (ops_us * 1e-6) / 1e9;
          std::printf("| %ld | ops | %d | %.1f | %.2f | %.0f | %.1f%% | |\n", long(m), distinct, moe_bytes / 1e6, ops_us, gbs,
                      100.0 * gbs * 1e9 / roofline::kHbmBytesPerSec);
        }
        const double us = bench::median_us_per_launch(
            1, [&](int) { return mono::launch_mono_program(prog, stream, true) == cudaSuccess; });
        const double gbs = moe_bytes / (us * 1e-6) / 1e9;
        std::printf("| %ld | program/%ld | %d | %.1f | %.2f | %.0f | %.1f%% | %.2fx |\n", long(m), long(tile), distinct,
                    moe_bytes / 1e6, us, gbs, 100.0 * gbs * 1e9 / roofline::kHbmBytesPerSec, ops_us / us);
        std::fflush(stdout);
      }
      // What a program boundary costs: this MoE block then the next layer's front (add + norm of the block's
      // residual and output, q_proj, kv_a, RoPE + cache write) as two launches, and as one program.
      {
        constexpr int64_t kHeads = 16, kQ = 3072, kKv = 576, kSlots = 4096;
        static Tensor wq = bench::random_bf16(kQ * kHidden, 0.04f), wkv = bench::random_bf16(kKv * kHidden, 0.04f);
        static Tensor kv_norm = f32_tensor(512, 0.5f, 1.5f), cache = bench::random_bf16(kSlots * kKv, 0);
        static Tensor q = bench::random_bf16(kRows * kQ, 0), kv = bench::random_bf16(kRows * kKv, 0);
        static Tensor res2 = f32_tensor(kRows * kHidden, 0, 0), d_inv = [] {
          std::vector<float> inv(32);
          for (int i = 0; i < 32; ++i) inv[i] = std::pow(10000.0f, -2.0f * i / 64.0f);
          Tensor t = Tensor::empty({32}, DType::kF32, Device::kCuda);
          copy_to_device(t.raw(), inv.data(), inv.size() * 4);
          return t;
        }();
        static Tensor pos = [] {
          std::vector<int32_t> h(kRows);
          for (int64_t r = 0; r < kRows; ++r) h[r] = static_cast<int32_t>(1000 + 37 * r);
          Tensor t = Tensor::empty({kRows}, DType::kI32, Device::kCuda);
          copy_to_device(t.raw(), h.data(), h.size() * 4);
          return t;
        }();
        static Tensor slot = [] {
          std::vector<int64_t> h(kRows);
          for (int64_t r = 0; r < kRows; ++r) h[r] = 64 * r + 5;
          Tensor t = Tensor::empty({kRows}, DType::kI64, Device::kCuda);
          copy_to_device(t.raw(), h.data(), h.size() * 8);
          return t;
        }();
        mono::FrontChain fc;
        fc.hidden = kHidden;
        fc.num_heads = kHeads;
        fc.w_q = ptr<uint16_t>(wq);
        fc.w_kva = ptr<uint16_t>(wkv);
        fc.input_norm = ptr<float>(input_norm);
        fc.kv_norm = ptr<float>(kv_norm);
        fc.inv_freq = ptr<float>(d_inv);
        fc.residual = ptr<float>(residual_out);  // the block's new residual
        fc.delta = ptr<uint16_t>(delta_out);     // the block's output
        fc.residual_out = ptr<float>(res2);
        fc.q = ptr<uint16_t>(q);
        fc.kv_a = ptr<uint16_t>(kv);
        fc.positions = ptr<int32_t>(pos);
        fc.slot_mapping = ptr<int64_t>(slot);
        fc.cache = ptr<uint16_t>(cache);
        fc.num_slots = kSlots;
        const std::vector<mono::Stage> moe = mono::moe_chain_stages(mc, 16), front = mono::front_chain_stages(fc, 16);
        const std::vector<mono::Stage> both = mono::join_programs(moe, front);  // the front after the combine
        const auto moe_plan = device_plan(moe, m, c.num_sms), front_plan = device_plan(front, m, c.num_sms),
                   both_plan = device_plan(both, m, c.num_sms);
        if (!moe_plan || !front_plan || !both_plan) return 1;
        const int32_t rows = static_cast<int32_t>(m);
        const double two = bench::median_us_per_launch(1, [&](int) {
          return mono::launch_mono_program(moe_plan->program(rows), stream, true) == cudaSuccess &&
                 mono::launch_mono_program(front_plan->program(rows), stream, true) == cudaSuccess;
        });
        const double one = bench::median_us_per_launch(
            1, [&](int) { return mono::launch_mono_program(both_plan->program(rows), stream, true) == cudaSuccess; });
        std::printf("| %ld | MoE block + next front: two programs | %d | | %.2f | | | |\n", long(m), distinct, two);
        std::printf("| %ld | MoE block + next front: one program | %d | | %.2f | | | %.2fx |\n", long(m), distinct, one,
                    two / one);
        std::fflush(stdout);
      }
    }
  }
  // The GEMV chain with FP8 e4m3 weights and 128 x 128 block scales at DeepSeek-V3's shapes (LayerChain: hidden
  // 7168, q_a + kv_a 2112, o_proj 7168 x 2048 (16 heads: TP 8), an expert of 2048: gate_up 4096 x 7168, down
  // 7168 x 2048; 74 MB), against the plain chain with the skinny FP8 kernel (skinny_fp8_gemm.cuh).
  {
    constexpr int64_t kH8 = 7168, kF8 = 1536 + 576, kO8 = 2048, kI8 = 2048;
    struct Fp8 {
      Tensor q, scale;
    };
    auto fp8_weight = [](int64_t n, int64_t k) {
      std::vector<uint8_t> q(static_cast<size_t>(n * k));
      for (auto& b : q) {
        b = static_cast<uint8_t>(bench::next_rand() & 0x77);  // |value| < 2^-0, no NaN codes
        b |= static_cast<uint8_t>(bench::next_rand() & 0x80);
      }
      std::vector<float> sc(static_cast<size_t>((n + 127) / 128 * ((k + 127) / 128)));
      for (auto& v : sc) v = 0.01f + 0.01f * static_cast<float>(bench::next_rand() % 100) / 100.0f;
      Fp8 w{Tensor::empty({n * k}, DType::kF8E4M3, Device::kCuda), Tensor::empty({static_cast<int64_t>(sc.size())},
                                                                                   DType::kF32, Device::kCuda)};
      copy_to_device(w.q.raw(), q.data(), q.size());
      copy_to_device(w.scale.raw(), sc.data(), sc.size() * 4);
      return w;
    };
    struct Fp8Weights {
      Fp8 front, o, gate_up, down;
    };
    std::vector<Fp8Weights> w8;
    for (int i = 0; i < kCopies; ++i)
      w8.push_back({fp8_weight(kF8, kH8), fp8_weight(kH8, kO8), fp8_weight(2 * kI8, kH8), fp8_weight(kH8, kI8)});
    Tensor n1w = f32_tensor(kH8, 0.5f, 1.5f), n2w = f32_tensor(kH8, 0.5f, 1.5f);
    Tensor res = f32_tensor(kRows * kH8, -1.0f, 1.0f), res_mid = f32_tensor(kRows * kH8, 0, 0),
           res_out = f32_tensor(kRows * kH8, 0, 0);
    Tensor dlt = bench::random_bf16(kRows * kH8, 0.01f), xn = bench::random_bf16(kRows * kH8, 0),
           fr = bench::random_bf16(kRows * kF8, 0), ob = bench::random_bf16(kRows * kH8, 0),
           gu = bench::random_bf16(kRows * 2 * kI8, 0), hb = bench::random_bf16(kRows * kI8, 0),
           dout = bench::random_bf16(kRows * kH8, 0);
    const double bytes8 = static_cast<double>(kF8 * kH8 + kH8 * kO8 + 2 * kI8 * kH8 + kH8 * kI8);
    std::printf("\n| m | FP8 chain (V3 shapes, %.1f MB) | ring slots | us | GB/s | %% of roofline | vs plain |\n"
                "|---|---|---|---|---|---|---|\n",
                bytes8 / 1e6);
    for (int64_t m : ms) {
      auto row8 = [&](const std::string& variant, const std::string& slots, double us, double base) {
        const double gbs = us > 0 ? bytes8 / (us * 1e-6) / 1e9 : 0;
        std::printf("| %ld | %s | %s | %.2f | %.0f | %.1f%% | %s |\n", long(m), variant.c_str(), slots.c_str(), us, gbs,
                    100.0 * gbs * 1e9 / roofline::kHbmBytesPerSec,
                    base > 0 && us > 0 ? (std::to_string(base / us).substr(0, 4) + "x").c_str() : "");
        std::fflush(stdout);
      };
      const double plain8 = bench::median_us_per_launch(kCopies, [&](int i) {
        AddRmsNormParams n;
        n.residual = ptr<float>(res);
        n.delta = dlt.raw();
        n.w = ptr<float>(n1w);
        n.rows = m;
        n.width = kH8;
        n.out = ptr<__nv_bfloat16>(xn);
        n.pdl = true;
        bool ok = launch_add_rmsnorm(n, stream) == cudaSuccess;
        auto gemm = [&](const Tensor& x, int64_t x_stride, const Fp8& wt, Tensor& out, int64_t nn, int64_t k) {
          SkinnyFp8GemmArgs a;
          a.x = ptr<__nv_bfloat16>(x);
          a.x_stride = x_stride;
          a.w = ptr<uint8_t>(wt.q);
          a.scale_inv = ptr<float>(wt.scale);
          a.out = out.raw();
          a.out_stride = nn;
          a.m = m;
          a.n = nn;
          a.k = k;
          a.pdl = true;
          return launch_skinny_fp8_gemm(a, stream) == cudaSuccess;
        };
        ok = ok && gemm(xn, kH8, w8[i].front, fr, kF8, kH8);
        ok = ok && gemm(fr, kF8, w8[i].o, ob, kH8, kO8);
        AddRmsNormParams n2 = n;
        n2.delta = ob.raw();
        n2.w = ptr<float>(n2w);
        ok = ok && launch_add_rmsnorm(n2, stream) == cudaSuccess;
        ok = ok && gemm(xn, kH8, w8[i].gate_up, gu, 2 * kI8, kH8);
        ok = ok && launch_silu_mul(ptr<__nv_bfloat16>(gu), m, kI8, ptr<__nv_bfloat16>(hb), stream, true) == cudaSuccess;
        ok = ok && gemm(hb, kI8, w8[i].down, dout, kH8, kI8);
        return ok;
      });
      row8("plain (skinny FP8)", "", plain8, -1);
      for (int64_t tile : tiles) {
        std::vector<std::unique_ptr<DevicePlan>> copies;
        for (int i = 0; i < kCopies && (copies.empty() || copies.back()); ++i) {
          mono::LayerChain lc;
          lc.hidden = kH8;
          lc.front_n = kF8;
          lc.o_k = kO8;
          lc.inter = kI8;
          lc.w_front = w8[i].front.q.raw();
          lc.w_o = w8[i].o.q.raw();
          lc.w_gate_up = w8[i].gate_up.q.raw();
          lc.w_down = w8[i].down.q.raw();
          lc.front_scale = ptr<float>(w8[i].front.scale);
          lc.o_scale = ptr<float>(w8[i].o.scale);
          lc.gate_up_scale = ptr<float>(w8[i].gate_up.scale);
          lc.down_scale = ptr<float>(w8[i].down.scale);
          lc.input_norm = ptr<float>(n1w);
          lc.post_norm = ptr<float>(n2w);
          lc.residual_in = ptr<float>(res);
          lc.delta_in = ptr<uint16_t>(dlt);
          lc.residual_mid = ptr<float>(res_mid);
          lc.residual_out = ptr<float>(res_out);
          lc.front = ptr<uint16_t>(fr);
          lc.o = ptr<uint16_t>(ob);
          lc.h = ptr<uint16_t>(hb);
          lc.delta_out = ptr<uint16_t>(dout);
          copies.push_back(device_plan(mono::layer_chain_stages(lc, static_cast<int32_t>(tile)), m, c.num_sms));
        }
        const std::string name = "program/" + std::to_string(tile);
        if (!copies.back()) {
          row8(name, "", -1, -1);
          continue;
        }
        const int32_t rows = static_cast<int32_t>(m);
        const double us = bench::median_us_per_launch(kCopies, [&](int i) {
          return mono::launch_mono_program(copies[i]->program(rows), stream, true) == cudaSuccess;
        });
        row8(name, std::to_string(mono::mono_ring_slots(copies[0]->program(rows))), us, plain8);
      }
    }
  }
  return 0;
}
