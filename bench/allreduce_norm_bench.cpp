// NUCLEUS_BENCH_NEEDS_CUDA: the all-reduce after o_proj / the MoE with the
// residual add and RMSNorm that follow, across the GPUs of this host.
//
// allreduce_norm_bench [--world N] [--tokens 1,2,4,...] [--hidden 2048,7168] [--iters N] [--reps N]
//
// One thread per GPU (TpGroup, as the engine runs tensor parallelism), NCCL
// communicators, peer-mapped signal buffers. Per (hidden, tokens) it times,
// per call, on every rank at once:
//   fused    the one-kernel all-reduce + residual add + RMSNorm
//            (kernels/allreduce: each rank reads every peer's bf16 delta);
//   unfused  ncclAllReduce of the bf16 delta, then the add+RMSNorm kernel
//            (what NUCLEUS_FUSE_ALLREDUCE_NORM=0 runs);
//   nccl     the ncclAllReduce alone;
//   norm     the add+RMSNorm kernel alone (no communication: the floor).
// `iters` calls are captured in one CUDA graph per variant and rank; the
// replays are timed with events; the median over `reps` replays of the
// slowest rank is printed, per call. Bandwidth is nccl-tests' bus bandwidth
// of the all-reduce, 2 (n-1)/n * bytes / time (H200 NVLink: 450 GB/s per
// direction). Before timing, one fused and one unfused call from the same
// state are compared (outputs poisoned first): the max |difference| of the
// normed outputs is printed (bf16 rounding of NCCL's bf16 sum; ~1e-2).
// Default world: every visible GPU (at most 8); world 1 runs on one GPU
// (the fused kernel then only adds and normalises).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "comm/tp_group.h"
#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "graph/cuda_graph.h"
#include "kernels/allreduce/allreduce_rmsnorm.cuh"
#include "kernels/rmsnorm/rmsnorm.cuh"

using namespace nucleus;

namespace {

constexpr double kNvlinkBytesPerSec = 450e9;

std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(std::stoll(item));
  return out;
}

// One rank's buffers at one shape.
struct RankState {
  Tensor delta, sum, residual, residual2, weight, out, out2;
  kernels::AllReduceNormParams fused;
};

std::vector<uint16_t> random_bf16(int64_t n, float scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(d(rng));
  return v;
}

Tensor upload(const void* host, int64_t count, DType dtype) {
  Tensor t = Tensor::empty({count}, dtype, Device::kCuda);
  copy_to_device(t.raw(), host, t.nbytes());
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  int world = 0, iters = 50, reps = 7;
  std::vector<int64_t> tokens = {1, 2, 4, 8, 16, 32, 64, 128}, hiddens = {2048, 7168};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--world") world = std::atoi(next());
    else if (a == "--tokens") tokens = parse_list(next());
    else if (a == "--hidden") hiddens = parse_list(next());
    else if (a == "--iters") iters = std::atoi(next());
    else if (a == "--reps") reps = std::atoi(next());
    else {
      std::fprintf(stderr,
                   "usage: allreduce_norm_bench [--world N] [--tokens 1,2,4,...] [--hidden 2048,7168] [--iters N] "
                   "[--reps N]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  if (!cuda_available()) {
    std::fprintf(stderr, "error: no usable CUDA device\n");
    return 1;
  }
  if (world == 0) world = std::min(cuda::device_count(), TpGroup::kMaxRanks);
  auto group_or = TpGroup::create(world, Device::kCuda);
  if (!group_or.ok()) {
    std::fprintf(stderr, "error: %s\n", group_or.status().to_string().c_str());
    return 1;
  }
  TpGroup& group = **group_or;
  auto signals = group.make_peer_buffers(kernels::allreduce_signal_bytes());
  if (!signals.ok()) {
    std::fprintf(stderr, "error: %s\n", signals.status().to_string().c_str());
    return 1;
  }
  auto check = [](const Status& s) {
    if (!s.ok()) {
      std::fprintf(stderr, "error: %s\n", s.to_string().c_str());
      std::exit(1);
    }
  };
  std::printf("all-reduce + residual add + RMSNorm, %d rank(s) (one thread per GPU, NCCL), %d calls per graph, "
              "median of %d\n", world, iters, reps);
  std::printf("%7s %6s %10s %9s %9s %9s %9s %8s %11s %10s\n", "hidden", "tokens", "bytes/rank", "fused_us",
              "unfused_us", "nccl_us", "norm_us", "speedup", "nccl_busbw", "max|diff|");
  for (int64_t hidden : hiddens) {
    const auto weight_host = random_bf16(hidden, 1.0f, 1);
    std::vector<float> weight_f32(hidden);
    for (int64_t i = 0; i < hidden; ++i) weight_f32[i] = bf16_to_f32(weight_host[i]);
    for (int64_t T : tokens) {
      const int64_t n = T * hidden;
      std::vector<RankState> st(world);
      // Set-up and the correctness check: one fused and one unfused call
      // from the same residual, outputs poisoned first.
      std::vector<float> max_diff(world, 0.0f);
      check(group.run([&](int r) -> Status {
        RankState& s = st[r];
        const auto delta = random_bf16(n, 1.0f, 100 + r);
        std::vector<float> residual(n);
        const auto res_bf16 = random_bf16(n, 2.0f, 7);  // the same on every rank, as in the model
        for (int64_t i = 0; i < n; ++i) residual[i] = bf16_to_f32(res_bf16[i]);
        s.delta = upload(delta.data(), n, DType::kBF16);
        s.sum = Tensor::empty({n}, DType::kBF16, Device::kCuda);
        s.residual = upload(residual.data(), n, DType::kF32);
        s.residual2 = upload(residual.data(), n, DType::kF32);
        s.weight = upload(weight_f32.data(), hidden, DType::kF32);
        const std::vector<uint8_t> poison(n * 2, 0x7f);
        s.out = upload(poison.data(), n, DType::kBF16);
        s.out2 = upload(poison.data(), n, DType::kBF16);
        kernels::AllReduceNormParams& p = s.fused;
        for (int q = 0; q < world; ++q) p.signals[q] = (*signals)[q];
        p.rank = r;
        p.world_size = world;
        p.delta = s.delta.data<__nv_bfloat16>();
        p.residual = s.residual.data<float>();
        p.weight = s.weight.data<float>();
        p.out = s.out.data<__nv_bfloat16>();
        p.rows = T;
        p.width = hidden;
        if (const char* why = kernels::allreduce_add_rmsnorm_unsupported(p)) return unsupported(why);
        cudaStream_t stream = cuda::context().stream;
        NUCLEUS_CUDA_CHECK(kernels::launch_allreduce_add_rmsnorm(p, stream));
        NUCLEUS_RETURN_IF_ERROR(group.comm(r).all_reduce_sum(s.delta.raw(), s.sum.raw(), n, DType::kBF16, stream));
        NUCLEUS_CUDA_CHECK(kernels::launch_add_rmsnorm(s.residual2.data<float>(), s.sum.data<__nv_bfloat16>(),
                                                       s.weight.data<float>(), T, hidden, 1e-6f,
                                                       s.out2.data<__nv_bfloat16>(), stream));
        NUCLEUS_CUDA_CHECK(cudaStreamSynchronize(stream));
        std::vector<uint16_t> a(n), b(n);
        copy_to_host(a.data(), s.out.raw(), n * 2);
        copy_to_host(b.data(), s.out2.raw(), n * 2);
        for (int64_t i = 0; i < n; ++i) max_diff[r] = std::max(max_diff[r], std::fabs(bf16_to_f32(a[i]) - bf16_to_f32(b[i])));
        return ok_status();
      }));
      // Graphs of `iters` calls per variant and rank, then timed replays.
      enum { kFused, kUnfused, kNccl, kNorm, kVariants };
      std::vector<std::vector<double>> per_call_us(kVariants, std::vector<double>(world, 0.0));
      check(group.run([&](int r) -> Status {
        RankState& s = st[r];
        cudaStream_t stream = cuda::context().stream;
        Communicator& comm = group.comm(r);
        auto body = [&](int variant) {
          for (int i = 0; i < iters; ++i) {
            if (variant == kFused) NUCLEUS_CUDA_CHECK(kernels::launch_allreduce_add_rmsnorm(s.fused, stream));
            if (variant == kUnfused || variant == kNccl)
              NUCLEUS_CHECK(comm.all_reduce_sum(s.delta.raw(), s.sum.raw(), n, DType::kBF16, stream).ok(), "nccl");
            if (variant == kUnfused || variant == kNorm)
              NUCLEUS_CUDA_CHECK(kernels::launch_add_rmsnorm(s.residual2.data<float>(), s.sum.data<__nv_bfloat16>(),
                                                             s.weight.data<float>(), T, hidden, 1e-6f,
                                                             s.out2.data<__nv_bfloat16>(), stream));
          }
        };
        cudaEvent_t start, stop;
        NUCLEUS_CUDA_CHECK(cudaEventCreate(&start));
        NUCLEUS_CUDA_CHECK(cudaEventCreate(&stop));
        for (int v = 0; v < kVariants; ++v) {
          NUCLEUS_ASSIGN_OR_RETURN(CudaGraph g, CudaGraph::capture([&] { body(v); return ok_status(); }));
          g.replay();  // warm-up
          std::vector<double> times;
          for (int rep = 0; rep < reps; ++rep) {
            NUCLEUS_CUDA_CHECK(cudaEventRecord(start, stream));
            g.replay();
            NUCLEUS_CUDA_CHECK(cudaEventRecord(stop, stream));
            NUCLEUS_CUDA_CHECK(cudaEventSynchronize(stop));
            float ms = 0;
            NUCLEUS_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
            times.push_back(1000.0 * ms / iters);
          }
          std::sort(times.begin(), times.end());
          per_call_us[v][r] = times[times.size() / 2];
        }
        cudaEventDestroy(start);
        cudaEventDestroy(stop);
        return ok_status();
      }));
      auto slowest = [&](int v) { return *std::max_element(per_call_us[v].begin(), per_call_us[v].end()); };
      const double bytes = static_cast<double>(n) * 2;
      const double busbw = world > 1 ? 2.0 * (world - 1) / world * bytes / (slowest(kNccl) * 1e-6) : 0.0;
      std::printf("%7lld %6lld %10.0f %9.2f %9.2f %9.2f %9.2f %7.2fx %6.1f GB/s %10.3g   (busbw %.0f%% of NVLink)\n",
                  static_cast<long long>(hidden), static_cast<long long>(T), bytes, slowest(kFused),
                  slowest(kUnfused), slowest(kNccl), slowest(kNorm), slowest(kUnfused) / slowest(kFused),
                  busbw / 1e9, *std::max_element(max_diff.begin(), max_diff.end()),
                  100.0 * busbw / kNvlinkBytesPerSec);
    }
  }
  return 0;
}
