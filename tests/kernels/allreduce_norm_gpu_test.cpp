// Tensor-parallel collectives on the GPU:
//  - the fused all-reduce + residual add + RMSNorm kernel with 1, 2, 4 and 8
//    ranks simulated on one GPU (each rank its own stream and signal buffer;
//    the kernels of all ranks run at once and wait for each other exactly as
//    across GPUs), against the CPU reference, over edge shapes and repeated
//    calls (the per-CTA flags), with its refusals; f32 deltas (split-K
//    outputs) and the prezero fill on extra CTAs;
//  - NCCL at world size 1 (the single H200): all-reduce, all-gather,
//    broadcast, and AddRmsNormOp through its fused and NCCL backends;
//  - with 2+ GPUs: NCCL across them (one thread per GPU) and the fused kernel
//    over peer-mapped buffers, against the CPU reference. Skipped on one GPU.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <thread>

#include "comm/nccl_communicator.h"
#include "comm/tp_group.h"
#include "core/cuda/context.h"
#include "gpu_test_util.h"
#include "kernels/allreduce/allreduce_rmsnorm.cuh"
#include "kernels/rmsnorm/rmsnorm_ref.h"
#include "ops/basic_ops.h"
#include "test_util.h"

namespace nucleus {
namespace {

using testing::all_close;
using testing::device_copy;
using testing::device_poisoned;
using testing::from_bf16;
using testing::random_bf16_values;
using testing::to_bf16;

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

template <typename T>
std::vector<T> read(const Tensor& t) {
  std::vector<T> out(t.nbytes() / sizeof(T));
  copy_to_host(out.data(), t.raw(), t.nbytes());
  return out;
}

// The CPU reference: residual += sum over ranks (in rank order, f32) of the
// bf16 deltas; out = bf16(rmsnorm(residual) * w).
void reference(const std::vector<std::vector<float>>& deltas, std::vector<float>& residual, const std::vector<float>& w,
               int64_t rows, int64_t width, float eps, std::vector<float>& out) {
  std::vector<float> sum(rows * width, 0.0f);
  for (const auto& d : deltas)
    for (int64_t i = 0; i < rows * width; ++i) sum[i] += d[i];
  out.assign(rows * width, 0.0f);
  kernels::add_rmsnorm_ref(residual.data(), sum.data(), w.data(), rows, width, eps, out.data());
  for (auto& x : out) x = round_to_bf16(x);
}

// One rank's buffers for the fused kernel on one device.
struct RankBuffers {
  Tensor signal, delta, residual, out;
  std::vector<float> delta_host;
};

class AllReduceNormGpu : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device"; }
};

TEST_F(AllReduceNormGpu, FusedKernelWithRanksSimulatedOnOneGpu) {
  const float eps = 1e-6f;
  for (int world : {1, 2, 4, 8}) {
    // Every rank's CTAs must be resident at once on the one GPU.
    const int max_blocks = world <= 2 ? kernels::kArMaxBlocks : 16;
    std::vector<cudaStream_t> streams(world);
    for (auto& s : streams) CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::vector<RankBuffers> ranks(world);
    for (auto& r : ranks) {
      r.signal = Tensor::empty({static_cast<int64_t>(kernels::allreduce_signal_bytes())}, DType::kU8, Device::kCuda);
      zero_device(r.signal);
    }
    for (int64_t width : {256, 2048, 7168}) {
      for (int64_t rows : {1, 3, 64, 65, 130}) {
        SCOPED_TRACE("world " + std::to_string(world) + " width " + std::to_string(width) + " rows " +
                     std::to_string(rows));
        const auto w = random_bf16_values(width, 1.0f, 11);
        Tensor d_w = device_copy(w, DType::kF32);
        std::vector<float> residual = random_bf16_values(rows * width, 2.0f, 12);
        for (auto& r : ranks) r.residual = device_copy(residual, DType::kF32);
        for (int call = 0; call < 3; ++call) {  // the same signal buffers: flags count up
          std::vector<std::vector<float>> deltas;
          for (int q = 0; q < world; ++q) {
            ranks[q].delta_host = random_bf16_values(rows * width, 1.0f, 100 * call + q + 13 * world);
            ranks[q].delta = device_copy(to_bf16(ranks[q].delta_host), DType::kBF16);
            ranks[q].out = device_poisoned(rows * width, DType::kBF16);
            deltas.push_back(ranks[q].delta_host);
          }
          CUDA_OK(cudaDeviceSynchronize());
          for (int q = 0; q < world; ++q) {
            kernels::AllReduceNormParams p;
            for (int s = 0; s < world; ++s) p.signals[s] = ranks[s].signal.raw();
            p.rank = q;
            p.world_size = world;
            p.delta = ranks[q].delta.data<__nv_bfloat16>();
            p.residual = ranks[q].residual.data<float>();
            p.weight = d_w.data<float>();
            p.out = ranks[q].out.data<__nv_bfloat16>();
            p.rows = rows;
            p.width = width;
            p.eps = eps;
            p.max_blocks = max_blocks;
            ASSERT_EQ(kernels::allreduce_add_rmsnorm_unsupported(p), nullptr);
            CUDA_OK(kernels::launch_allreduce_add_rmsnorm(p, streams[q]));
          }
          for (auto s : streams) CUDA_OK(cudaStreamSynchronize(s));
          std::vector<float> want_out;
          reference(deltas, residual, w, rows, width, eps, want_out);
          const auto out0 = read<uint16_t>(ranks[0].out);
          for (int q = 0; q < world; ++q) {
            EXPECT_TRUE(all_close(read<float>(ranks[q].residual), residual, 0, 0, width))
                << "rank " << q << " residual, call " << call;
            const auto out = read<uint16_t>(ranks[q].out);
            EXPECT_TRUE(all_close(from_bf16(out), want_out, 1e-6f, 1.0f / 128, width))
                << "rank " << q << " out, call " << call;
            EXPECT_EQ(out, out0) << "rank " << q << " differs from rank 0";
          }
        }
      }
    }
    for (auto s : streams) CUDA_OK(cudaStreamDestroy(s));
  }
}

// f32 deltas (a split-K GEMM's output) and a prezero donor's fill on extra
// CTAs, ranks simulated on one GPU: the fill CTAs take no part in the
// barriers, so the row CTAs still pair up rank by rank, every rank's fill
// buffer ends zero, and the sums are exact (f32 in rank order).
TEST_F(AllReduceNormGpu, FusedKernelF32DeltaAndPrezeroFill) {
  const float eps = 1e-6f;
  for (int world : {1, 2, 4}) {
    const int max_blocks = world <= 2 ? kernels::kArMaxBlocks : 16;
    std::vector<cudaStream_t> streams(world);
    for (auto& s : streams) CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::vector<RankBuffers> ranks(world);
    for (auto& r : ranks) {
      r.signal = Tensor::empty({static_cast<int64_t>(kernels::allreduce_signal_bytes())}, DType::kU8, Device::kCuda);
      zero_device(r.signal);
    }
    const int64_t width = 2048;
    for (int64_t rows : {1, 5, 70}) {
      for (int64_t fill_count : {int64_t{0}, int64_t{1}, int64_t{4099}, int64_t{1} << 18}) {
        SCOPED_TRACE("world " + std::to_string(world) + " rows " + std::to_string(rows) + " fill " +
                     std::to_string(fill_count));
        const auto w = random_bf16_values(width, 1.0f, 51);
        Tensor d_w = device_copy(w, DType::kF32);
        std::vector<float> residual = random_bf16_values(rows * width, 2.0f, 52);
        for (auto& r : ranks) r.residual = device_copy(residual, DType::kF32);
        std::vector<Tensor> fills(world);
        for (int call = 0; call < 2; ++call) {
          std::vector<std::vector<float>> deltas;
          for (int q = 0; q < world; ++q) {
            ranks[q].delta_host = random_bf16_values(rows * width, 1.0f, 200 * call + q + 7 * world);
            for (auto& x : ranks[q].delta_host) x *= 1.0f + 1.0f / 1024;  // not bf16-representable
            ranks[q].delta = device_copy(ranks[q].delta_host, DType::kF32);
            ranks[q].out = device_poisoned(rows * width, DType::kBF16);
            fills[q] = device_poisoned(std::max<int64_t>(fill_count, 1), DType::kF32);
            deltas.push_back(ranks[q].delta_host);
          }
          CUDA_OK(cudaDeviceSynchronize());
          for (int q = 0; q < world; ++q) {
            kernels::AllReduceNormParams p;
            for (int s = 0; s < world; ++s) p.signals[s] = ranks[s].signal.raw();
            p.rank = q;
            p.world_size = world;
            p.delta = ranks[q].delta.raw();
            p.delta_f32 = true;
            p.residual = ranks[q].residual.data<float>();
            p.weight = d_w.data<float>();
            p.out = ranks[q].out.data<__nv_bfloat16>();
            p.rows = rows;
            p.width = width;
            p.eps = eps;
            p.max_blocks = max_blocks;
            if (fill_count > 0) {
              p.zero_fill = fills[q].data<float>();
              p.zero_fill_count = fill_count;
              p.fill_blocks = 1 + q % 3;  // ranks may differ: the fill CTAs never meet
            }
            ASSERT_EQ(kernels::allreduce_add_rmsnorm_unsupported(p), nullptr);
            CUDA_OK(kernels::launch_allreduce_add_rmsnorm(p, streams[q]));
          }
          for (auto s : streams) CUDA_OK(cudaStreamSynchronize(s));
          std::vector<float> want_out;
          reference(deltas, residual, w, rows, width, eps, want_out);
          for (int q = 0; q < world; ++q) {
            EXPECT_TRUE(all_close(read<float>(ranks[q].residual), residual, 0, 0, width)) << "rank " << q;
            EXPECT_TRUE(all_close(from_bf16(read<uint16_t>(ranks[q].out)), want_out, 1e-6f, 1.0f / 128, width))
                << "rank " << q;
            if (fill_count > 0) {
              EXPECT_EQ(read<float>(fills[q]), std::vector<float>(fill_count, 0.0f)) << "rank " << q << " fill";
            }
          }
        }
      }
    }
    for (auto s : streams) CUDA_OK(cudaStreamDestroy(s));
  }
}

TEST_F(AllReduceNormGpu, FusedKernelRefusals) {
  Tensor buf = Tensor::empty({1 << 16}, DType::kU8, Device::kCuda);
  kernels::AllReduceNormParams p;
  p.signals[0] = p.signals[1] = buf.raw();
  p.world_size = 2;
  p.delta = static_cast<const __nv_bfloat16*>(buf.raw());
  p.residual = static_cast<float*>(buf.raw());
  p.weight = static_cast<const float*>(buf.raw());
  p.out = static_cast<__nv_bfloat16*>(buf.raw());
  p.rows = 1;
  p.width = 256;
  EXPECT_EQ(kernels::allreduce_add_rmsnorm_unsupported(p), nullptr);
  auto refused = [&](auto edit) {
    kernels::AllReduceNormParams q = p;
    edit(q);
    const bool r = kernels::allreduce_add_rmsnorm_unsupported(q) != nullptr;
    return r && kernels::launch_allreduce_add_rmsnorm(q, nullptr) == cudaErrorInvalidValue;
  };
  EXPECT_TRUE(refused([](auto& q) { q.width = 260; }));
  EXPECT_TRUE(refused([](auto& q) { q.width = 8200; }));
  EXPECT_TRUE(refused([](auto& q) { q.world_size = 9; }));
  EXPECT_TRUE(refused([](auto& q) { q.rank = 2; }));
  EXPECT_TRUE(refused([](auto& q) { q.signals[1] = nullptr; }));
  EXPECT_TRUE(refused([](auto& q) { q.max_blocks = 65; }));
  EXPECT_TRUE(refused([&](auto& q) {  // a fill without fill blocks
    q.zero_fill = static_cast<float*>(buf.raw());
    q.zero_fill_count = 16;
    q.fill_blocks = 0;
  }));
  EXPECT_TRUE(refused([&](auto& q) { q.delta = reinterpret_cast<const __nv_bfloat16*>(static_cast<char*>(buf.raw()) + 2); }));
  cudaGetLastError();
}

// The NCCL path at world size 1: loads libnccl.so.2, makes a one-GPU
// communicator and runs every collective. Fails (with the loader's message
// on where it looked) when NCCL is not found.
TEST_F(AllReduceNormGpu, NcclWorldSizeOne) {
  auto desc = nccl_library_description();
  ASSERT_TRUE(desc.ok()) << desc.status().to_string();
  std::printf("NCCL: %s\n", desc->c_str());
  auto comms = make_nccl_communicators({0});
  ASSERT_TRUE(comms.ok()) << comms.status().to_string();
  Communicator& c = *(*comms)[0];
  EXPECT_EQ(c.world_size(), 1);
  EXPECT_STREQ(c.backend(), "nccl");
  cudaStream_t stream = cuda::context().stream;
  const auto x = random_bf16_values(1000, 3.0f, 5);
  Tensor a = device_copy(x, DType::kF32), b = device_poisoned(1000, DType::kF32);
  ASSERT_TRUE(c.all_reduce_sum(a.raw(), b.raw(), 1000, DType::kF32, stream).ok());
  ASSERT_TRUE(c.all_reduce_sum(a.raw(), a.raw(), 1000, DType::kF32, stream).ok());
  Tensor h = device_copy(to_bf16(x), DType::kBF16);
  ASSERT_TRUE(c.all_reduce_sum(h.raw(), h.raw(), 1000, DType::kBF16, stream).ok());
  Tensor g = device_poisoned(1000, DType::kF32);
  ASSERT_TRUE(c.all_gather(a.raw(), g.raw(), 1000, DType::kF32, stream).ok());
  ASSERT_TRUE(c.broadcast(a.raw(), 1000, DType::kF32, 0, stream).ok());
  EXPECT_EQ(c.all_reduce_sum(a.raw(), a.raw(), 1, DType::kI32, stream).code(), StatusCode::kUnsupported);
  CUDA_OK(cudaStreamSynchronize(stream));
  EXPECT_TRUE(all_close(read<float>(b), x, 0, 0));
  EXPECT_TRUE(all_close(read<float>(a), x, 0, 0));
  EXPECT_TRUE(all_close(from_bf16(read<uint16_t>(h)), x, 0, 0));
  EXPECT_TRUE(all_close(read<float>(g), x, 0, 0));
}

// AddRmsNormOp with an all-reduce over a one-GPU NCCL group: the fused
// backend (signal buffer on the same GPU) and the NCCL + add+norm backend
// against the op without an all-reduce: equal bits.
TEST_F(AllReduceNormGpu, AddRmsNormOpBackendsAtWorldSizeOne) {
  auto comms = make_nccl_communicators({0});
  ASSERT_TRUE(comms.ok()) << comms.status().to_string();
  Tensor signal = Tensor::empty({static_cast<int64_t>(kernels::allreduce_signal_bytes())}, DType::kU8, Device::kCuda);
  zero_device(signal);
  const int64_t rows = 37, width = 2048;
  const auto w = random_bf16_values(width, 1.0f, 21), res = random_bf16_values(rows * width, 2.0f, 22),
             delta = random_bf16_values(rows * width, 1.0f, 23);
  Tensor weight = device_copy(w, DType::kF32);
  struct Run {
    std::string backend;
    std::vector<float> residual;
    std::vector<uint16_t> out;
  };
  auto run = [&](const AllReduceSpec* spec) {
    AddRmsNormOp op(weight, 1e-6f, true);
    if (spec) op.set_all_reduce(*spec);
    Status s = op.select_backend(Device::kCuda);
    NUCLEUS_CHECK(s.ok(), "{}", s.to_string());
    Tensor r = device_copy(res, DType::kF32).view({rows, width});
    Tensor d = device_copy(to_bf16(delta), DType::kBF16).view({rows, width});
    Tensor o = device_poisoned(rows * width, DType::kBF16).view({rows, width});
    OpContext ctx;
    ctx.device = Device::kCuda;
    op.run(ctx, {r, d}, {r, o});
    synchronize_device();
    return Run{op.backend(), read<float>(r), read<uint16_t>(o)};
  };
  const Run plain = run(nullptr);
  AllReduceSpec fused{(*comms)[0].get(), {signal.raw()}, true};
  AllReduceSpec unfused{(*comms)[0].get(), {signal.raw()}, false};
  const Run f = run(&fused), u = run(&unfused);
  EXPECT_EQ(plain.backend, "cuda");
  EXPECT_EQ(f.backend, "cuda_allreduce_fused");
  EXPECT_EQ(u.backend, "cuda");
  // One rank: the fused kernel runs the plain kernel's row code (add_rmsnorm_row.cuh), so the same bits.
  EXPECT_EQ(f.residual, plain.residual);
  EXPECT_EQ(f.out, plain.out);
  EXPECT_EQ(u.residual, plain.residual);  // NCCL over one rank is a copy
  EXPECT_EQ(u.out, plain.out);
}

// AddRmsNormOp as a prezero donor that all-reduces an f32 delta (split-K
// o_proj under tensor parallelism), at world size 1: both backends fill the
// buffer's n_total columns of m rows (the gate fills all at 3 rows) and
// match the op without an all-reduce.
TEST_F(AllReduceNormGpu, AllReducingPrezeroDonorWithF32Delta) {
  auto comms = make_nccl_communicators({0});
  ASSERT_TRUE(comms.ok()) << comms.status().to_string();
  Tensor signal = Tensor::empty({static_cast<int64_t>(kernels::allreduce_signal_bytes())}, DType::kU8, Device::kCuda);
  zero_device(signal);
  const int64_t rows = 3, width = 2048, n_total = 3000, n_base = 1000;
  ASSERT_EQ(prezero_fill(rows, n_total, n_base), PrezeroFill::kAll);
  const auto w = random_bf16_values(width, 1.0f, 61), res = random_bf16_values(rows * width, 2.0f, 62),
             delta = random_bf16_values(rows * width, 1.0f, 63);
  Tensor weight = device_copy(w, DType::kF32);
  struct Run {
    std::string backend;
    std::vector<float> residual, fill;
    std::vector<uint16_t> out;
  };
  auto run = [&](const AllReduceSpec* spec) {
    AddRmsNormOp op(weight, 1e-6f, true);
    if (spec) op.set_all_reduce(*spec);
    Status s = op.select_backend(Device::kCuda);
    NUCLEUS_CHECK(s.ok(), "{}", s.to_string());
    op.set_prezero({n_total, n_base, kPrezeroAnyRows});  // as the pass does, after selection
    Tensor r = device_copy(res, DType::kF32).view({rows, width});
    Tensor d = device_copy(delta, DType::kF32).view({rows, width});
    Tensor o = device_poisoned(rows * width, DType::kBF16).view({rows, width});
    Tensor f = device_poisoned(rows * n_total, DType::kF32).view({rows, n_total});
    OpContext ctx;
    ctx.device = Device::kCuda;
    op.run(ctx, {r, d}, {r, o, f});
    synchronize_device();
    return Run{op.backend(), read<float>(r), read<float>(f), read<uint16_t>(o)};
  };
  const Run plain = run(nullptr);
  AllReduceSpec fused{(*comms)[0].get(), {signal.raw()}, true};
  AllReduceSpec unfused{(*comms)[0].get(), {signal.raw()}, false};
  const Run f = run(&fused), u = run(&unfused);
  EXPECT_EQ(f.backend, "cuda_allreduce_fused");
  EXPECT_EQ(u.backend, "cuda");
  const std::vector<float> zeros(rows * n_total, 0.0f);
  for (const Run* r : {&plain, &f, &u}) EXPECT_EQ(r->fill, zeros) << r->backend;
  // One rank: the fused kernel runs the plain kernel's row code (add_rmsnorm_row.cuh), so the same bits.
  EXPECT_EQ(f.residual, plain.residual);
  EXPECT_EQ(f.out, plain.out);
  EXPECT_EQ(u.residual, plain.residual);  // NCCL over one rank is a copy
  EXPECT_EQ(u.out, plain.out);
}

// NCCL across every visible GPU (up to 8), one thread per GPU, and the fused
// kernel over peer-mapped signal buffers. Skipped with one GPU.
TEST_F(AllReduceNormGpu, AcrossGpus) {
  const int n = std::min(cuda::device_count(), TpGroup::kMaxRanks);
  if (n < 2) GTEST_SKIP() << "needs 2+ GPUs (" << n << " visible)";
  auto group = TpGroup::create(n, Device::kCuda);
  ASSERT_TRUE(group.ok()) << group.status().to_string();
  auto signals = (*group)->make_peer_buffers(kernels::allreduce_signal_bytes());
  ASSERT_TRUE(signals.ok()) << signals.status().to_string();
  const int64_t rows = 19, width = 7168;
  const auto w = random_bf16_values(width, 1.0f, 31);
  std::vector<float> residual = random_bf16_values(rows * width, 2.0f, 32);
  std::vector<std::vector<float>> deltas(n);
  for (int r = 0; r < n; ++r) deltas[r] = random_bf16_values(rows * width, 1.0f, 40 + r);
  std::vector<std::vector<float>> got_res(n), got_sum(n), got_gather(n);
  std::vector<std::vector<uint16_t>> got_out(n);
  Status s = (*group)->run([&](int r) -> Status {
    Communicator& c = (*group)->comm(r);
    cudaStream_t stream = cuda::context().stream;
    // NCCL: the sum of the ranks' f32 deltas, and the gather of them.
    Tensor d32 = device_copy(deltas[r], DType::kF32), sum = device_poisoned(rows * width, DType::kF32);
    Tensor gathered = device_poisoned(n * rows * width, DType::kF32);
    NUCLEUS_RETURN_IF_ERROR(c.all_reduce_sum(d32.raw(), sum.raw(), rows * width, DType::kF32, stream));
    NUCLEUS_RETURN_IF_ERROR(c.all_gather(d32.raw(), gathered.raw(), rows * width, DType::kF32, stream));
    // The fused kernel across the GPUs, twice (flags count up).
    Tensor weight = device_copy(w, DType::kF32), res = device_copy(residual, DType::kF32);
    Tensor delta = device_copy(to_bf16(deltas[r]), DType::kBF16), out = device_poisoned(rows * width, DType::kBF16);
    kernels::AllReduceNormParams p;
    for (int q = 0; q < n; ++q) p.signals[q] = (*signals)[q];
    p.rank = r;
    p.world_size = n;
    p.delta = delta.data<__nv_bfloat16>();
    p.residual = res.data<float>();
    p.weight = weight.data<float>();
    p.out = out.data<__nv_bfloat16>();
    p.rows = rows;
    p.width = width;
    for (int call = 0; call < 2; ++call)
      if (cudaError_t e = kernels::launch_allreduce_add_rmsnorm(p, stream); e != cudaSuccess)
        return internal_error(cudaGetErrorString(e));
    if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) return internal_error(cudaGetErrorString(e));
    got_sum[r] = read<float>(sum);
    got_gather[r] = read<float>(gathered);
    got_res[r] = read<float>(res);
    got_out[r] = read<uint16_t>(out);
    return ok_status();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
  std::vector<float> want_sum(rows * width, 0.0f), want_gather;
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < rows * width; ++i) want_sum[i] += deltas[r][i];
    want_gather.insert(want_gather.end(), deltas[r].begin(), deltas[r].end());
  }
  std::vector<float> want_out;
  reference(deltas, residual, w, rows, width, 1e-6f, want_out);  // first call
  reference(deltas, residual, w, rows, width, 1e-6f, want_out);  // second call
  for (int r = 0; r < n; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(n));
    EXPECT_TRUE(all_close(got_sum[r], want_sum, 1e-5f, 1e-5f, width));  // NCCL's own summation order
    EXPECT_TRUE(all_close(got_gather[r], want_gather, 0, 0, width));
    EXPECT_TRUE(all_close(got_res[r], residual, 0, 0, width));
    EXPECT_TRUE(all_close(from_bf16(got_out[r]), want_out, 1e-6f, 1.0f / 128, width));
    EXPECT_EQ(got_out[r], got_out[0]);
  }
}

}  // namespace
}  // namespace nucleus
