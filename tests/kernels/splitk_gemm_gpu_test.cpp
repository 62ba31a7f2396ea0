// The split-K decode GEMM and the prezero donor against the CPU reference:
//  - split-K (atomic and deterministic reductions) vs gemm_ref over edge
//    shapes (m = 1, odd m, 64; n and k not multiples of the tiles; the
//    DeepSeek-V2-Lite and V3 decode shapes), default and forced split counts,
//    zero_init true and false (adding onto what the output holds), writing a
//    column block of a wider buffer whose other columns stay untouched;
//  - the deterministic mode bit-identical across runs, and with zero_init =
//    false onto a zeroed output bit-identical to zero_init = true (what makes
//    prezero ON equal OFF);
//  - refusals (m = 0 or > 64, k % 8, misaligned x);
//  - the donor: fused residual add (bf16 or f32 delta) + RMSNorm that also
//    zero-fills the whole buffer, its prefix, or nothing, leaving the rest
//    of the (poisoned) memory untouched; the f32 -> bf16 RMSNorm with carried
//    columns; RoPE reading an f32 q; SwiGLU reading f32.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "core/device.h"
#include "gpu_test_util.h"
#include "io/hf_config.h"
#include "kernels/activation/silu_mul.cuh"
#include "kernels/activation/silu_mul_ref.h"
#include "kernels/gemm/gemm_ref.h"
#include "kernels/gemm/splitk_gemm.cuh"
#include "kernels/rmsnorm/rmsnorm.cuh"
#include "kernels/rmsnorm/rmsnorm_ref.h"
#include "kernels/rope/rope_kv_cache.cuh"
#include "kernels/rope/rope_ref.h"
#include "model/deepseek/kernel_params.h"
#include "test_util.h"

namespace nucleus::kernels {
namespace {

using testing::all_close;
using testing::device_copy;
using testing::device_poisoned;
using testing::from_bf16;
using testing::host_copy;
using testing::random_bf16_values;
using testing::to_bf16;

class SplitKGpu : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device"; }
  cudaStream_t stream() { return nullptr; }
};

// A workspace for the deterministic mode (freed with the test).
struct Workspace {
  Tensor partial, counters;
  SplitKWorkspace ws;
  explicit Workspace(int64_t floats) {
    partial = Tensor::empty({floats}, DType::kF32, Device::kCuda);
    counters = device_copy(std::vector<int32_t>(4096, 0), DType::kI32);
    ws = {partial.data<float>(), floats, counters.data<int32_t>(), 4096};
  }
};

struct Shape {
  int64_t m, n, k;
  const char* what;
};

const Shape kShapes[] = {
    {1, 576, 2048, "V2-Lite kv_a m=1"},
    {7, 3072, 2048, "V2-Lite q_proj"},
    {64, 2048, 2048, "V2-Lite o_proj m=64"},
    {33, 64, 2048, "V2-Lite gate"},
    {9, 5632, 2048, "V2-Lite shared gate_up"},
    {1, 1536, 7168, "V3 q_a m=1"},
    {64, 576, 7168, "V3 kv_a m=64"},
    {5, 24576, 1536, "V3 q_b"},
    {2, 7168, 16384, "V3 o_proj"},
    {17, 256, 7168, "V3 gate"},
    {3, 100, 200, "n, k off the tiles"},
    {1, 33, 8, "k = 8"},
    {63, 129, 1032, "odd everything"},
};

// A column block [col, col + n) of a [m, n + pad] f32 buffer: the GEMM writes
// it with out_stride = n + pad; the other columns hold a poison pattern.
struct Output {
  int64_t m, n, pad, col;
  Tensor buf;
  std::vector<float> host;  // what buf held before the GEMM
  Output(int64_t m_, int64_t n_, const std::vector<float>& initial) : m(m_), n(n_), pad(40), col(16) {
    host.assign(m * (n + pad), 0.0f);
    uint32_t poison = 0x7fc0dead;
    float pf;
    std::memcpy(&pf, &poison, 4);
    for (auto& v : host) v = pf;
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) host[r * (n + pad) + col + c] = initial[r * n + c];
    buf = device_copy(host, DType::kF32);
  }
  float* ptr() { return buf.data<float>() + col; }
  int64_t stride() const { return n + pad; }
  // The block, and whether every byte outside it is unchanged.
  std::vector<float> block(bool* outside_intact) {
    auto all = host_copy<float>(buf);
    std::vector<float> out(m * n);
    bool intact = true;
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n + pad; ++c) {
        const float v = all[r * (n + pad) + c];
        if (c >= col && c < col + n) out[r * n + c - col] = v;
        else intact &= std::memcmp(&v, &host[r * (n + pad) + c], 4) == 0;
      }
    *outside_intact = intact;
    return out;
  }
};

TEST_F(SplitKGpu, MatchesCpuReferenceOverShapesModesAndSplits) {
  Workspace ws(int64_t{16} << 20);
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(std::string(s.what) + " m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) +
                 " k=" + std::to_string(s.k));
    auto x = random_bf16_values(s.m * s.k, 1.0f, 1);
    auto w = random_bf16_values(s.n * s.k, 0.05f, 2);
    auto acc0 = random_bf16_values(s.m * s.n, 1.0f, 3);
    std::vector<float> want(s.m * s.n), want_acc = acc0;
    gemm_ref(x.data(), s.k, w.data(), s.m, s.n, s.k, want.data(), s.n, false);
    gemm_ref(x.data(), s.k, w.data(), s.m, s.n, s.k, want_acc.data(), s.n, true);
    Tensor d_x = device_copy(to_bf16(x), DType::kBF16), d_w = device_copy(to_bf16(w), DType::kBF16);
    const float atol = 1e-4f * std::sqrt(static_cast<float>(s.k));  // f32 sums of exact products, reordered
    const int64_t k_blocks = (s.k + kSplitKBlockK - 1) / kSplitKBlockK;
    for (SplitKMode mode : {SplitKMode::kAtomic, SplitKMode::kDeterministic}) {
      for (int splits : {0, 1, 3, static_cast<int>(k_blocks)}) {
        for (bool zero_init : {true, false}) {
          SCOPED_TRACE(std::string(mode == SplitKMode::kAtomic ? "atomic" : "deterministic") + " splits=" +
                       std::to_string(splits) + (zero_init ? " zero_init" : " accumulate"));
          // zero_init must not read the output: start it from garbage.
          Output out(s.m, s.n, zero_init ? random_bf16_values(s.m * s.n, 1e6f, 4) : acc0);
          SplitKGemmArgs a;
          a.x = d_x.data<__nv_bfloat16>();
          a.x_stride = s.k;
          a.w = d_w.data<__nv_bfloat16>();
          a.out = out.ptr();
          a.out_stride = out.stride();
          a.m = s.m;
          a.n = s.n;
          a.k = s.k;
          a.zero_init = zero_init;
          a.splits = splits;
          a.mode = mode;
          ASSERT_EQ(launch_splitk_gemm(a, ws.ws, stream()), cudaSuccess);
          bool intact = false;
          EXPECT_TRUE(all_close(out.block(&intact), zero_init ? want : want_acc, atol, 1e-4f, s.n))
              << "effective splits " << splitk_effective_splits(a, ws.ws);
          EXPECT_TRUE(intact) << "wrote outside its column block";
        }
      }
    }
  }
}

TEST_F(SplitKGpu, DeterministicModeIsBitIdenticalAndPrezeroEqualsZeroInit) {
  Workspace ws(int64_t{16} << 20);
  for (const Shape& s : {Shape{1, 576, 2048, ""}, Shape{37, 1536, 7168, ""}, Shape{64, 2048, 2048, ""}}) {
    auto x = random_bf16_values(s.m * s.k, 1.0f, 6);
    auto w = random_bf16_values(s.n * s.k, 0.05f, 7);
    Tensor d_x = device_copy(to_bf16(x), DType::kBF16), d_w = device_copy(to_bf16(w), DType::kBF16);
    SplitKGemmArgs a;
    a.x = d_x.data<__nv_bfloat16>();
    a.x_stride = s.k;
    a.w = d_w.data<__nv_bfloat16>();
    a.out_stride = s.n;
    a.m = s.m;
    a.n = s.n;
    a.k = s.k;
    a.mode = SplitKMode::kDeterministic;
    ASSERT_GT(splitk_effective_splits(a, ws.ws), 1) << "the case must split K";
    std::vector<std::vector<float>> runs;
    for (int run = 0; run < 3; ++run) {
      // Runs 0, 1: zero_init over garbage; run 2: zero_init = false over zeros (prezero'd).
      Tensor out = run < 2 ? device_copy(random_bf16_values(s.m * s.n, 1e6f, 8 + run), DType::kF32)
                           : device_copy(std::vector<float>(s.m * s.n, 0.0f), DType::kF32);
      a.out = out.data<float>();
      a.zero_init = run < 2;
      ASSERT_EQ(launch_splitk_gemm(a, ws.ws, stream()), cudaSuccess);
      runs.push_back(host_copy<float>(out));
    }
    EXPECT_EQ(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * 4), 0) << "m=" << s.m;
    EXPECT_EQ(std::memcmp(runs[0].data(), runs[2].data(), runs[0].size() * 4), 0) << "m=" << s.m;
  }
}

TEST_F(SplitKGpu, Refusals) {
  Tensor x = Tensor::empty({65 * 64}, DType::kBF16, Device::kCuda), w = Tensor::empty({64 * 64}, DType::kBF16, Device::kCuda);
  Tensor out = Tensor::empty({65 * 64}, DType::kF32, Device::kCuda);
  auto args = [&](int64_t m, int64_t k, int64_t x_offset) {
    SplitKGemmArgs a;
    a.x = x.data<__nv_bfloat16>() + x_offset;
    a.x_stride = 64;
    a.w = w.data<__nv_bfloat16>();
    a.out = out.data<float>();
    a.out_stride = 64;
    a.m = m;
    a.n = 64;
    a.k = k;
    return a;
  };
  const SplitKWorkspace none;
  EXPECT_EQ(launch_splitk_gemm(args(64, 64, 0), none, stream()), cudaSuccess);
  EXPECT_EQ(launch_splitk_gemm(args(0, 64, 0), none, stream()), cudaErrorInvalidValue);
  EXPECT_EQ(launch_splitk_gemm(args(65, 64, 0), none, stream()), cudaErrorInvalidValue);
  EXPECT_EQ(launch_splitk_gemm(args(4, 60, 0), none, stream()), cudaErrorInvalidValue);  // k % 8
  EXPECT_EQ(launch_splitk_gemm(args(4, 56, 4), none, stream()), cudaErrorInvalidValue);  // x 8-byte aligned only
  synchronize_device();
}

// The donor: residual add (bf16 or f32 delta) + RMSNorm, zero-filling a
// prefix of a poisoned buffer with `fill_blocks` extra blocks.
TEST_F(SplitKGpu, DonorAddRmsNormZeroFillsWholePrefixOrNothing) {
  const int64_t width = 2048, n_total = 5696, n_base = 3648;  // V2-Lite attention donor
  for (int64_t rows : {1, 7, 64}) {
    for (bool delta_f32 : {false, true}) {
      for (int outcome = 0; outcome < 3; ++outcome) {  // all, base, none
        for (int fill_blocks : {1, 5, 131 - static_cast<int>(rows)}) {
          SCOPED_TRACE("rows " + std::to_string(rows) + (delta_f32 ? " f32" : " bf16") + " delta, outcome " +
                       std::to_string(outcome) + ", fill blocks " + std::to_string(fill_blocks));
          auto residual = random_bf16_values(rows * width, 2.0f, 20);
          auto delta = random_bf16_values(rows * width, 1.0f, 21);
          auto w = random_bf16_values(width, 1.0f, 22);
          Tensor d_res = device_copy(residual, DType::kF32), d_w = device_copy(w, DType::kF32);
          Tensor d_delta = delta_f32 ? device_copy(delta, DType::kF32) : device_copy(to_bf16(delta), DType::kBF16);
          Tensor d_out = device_poisoned(rows * width, DType::kBF16);
          // The buffer, one float misaligned (the scalar path) for odd row counts, poison around it.
          const int64_t lead = rows % 2, count = rows * (outcome == 0 ? n_total : outcome == 1 ? n_base : 0);
          Tensor d_buf = device_poisoned(rows * n_total + 2, DType::kF32);
          AddRmsNormParams p;
          p.residual = d_res.data<float>();
          p.delta = d_delta.raw();
          p.delta_f32 = delta_f32;
          p.w = d_w.data<float>();
          p.rows = rows;
          p.width = width;
          p.eps = 1e-6f;
          p.out = d_out.data<__nv_bfloat16>();
          if (count > 0) {
            p.zero_fill = d_buf.data<float>() + lead;
            p.zero_fill_count = count;
            p.fill_blocks = fill_blocks;
          }
          ASSERT_EQ(launch_add_rmsnorm(p, stream()), cudaSuccess);
          std::vector<float> want_res = residual, want_out(rows * width);
          add_rmsnorm_ref(want_res.data(), delta.data(), w.data(), rows, width, 1e-6f, want_out.data());
          EXPECT_TRUE(all_close(host_copy<float>(d_res), want_res, 0, 0, width));
          EXPECT_TRUE(all_close(from_bf16(host_copy<uint16_t>(d_out)), want_out, 1e-3f, 8e-3f, width));
          const auto buf = host_copy<uint32_t>(d_buf);
          int64_t wrong = 0;
          for (int64_t i = 0; i < static_cast<int64_t>(buf.size()); ++i) {
            const bool filled = i >= lead && i < lead + count;
            wrong += filled ? buf[i] != 0u : buf[i] != 0x7f7f7f7fu;
          }
          EXPECT_EQ(wrong, 0);
        }
      }
    }
  }
}

TEST_F(SplitKGpu, RmsNormF32ToBf16CarriesTrailingColumns) {
  const int64_t lora = 512, row_width = 576;  // kv_a: normalise c_kv, carry k_pe
  for (int64_t rows : {1, 13, 64}) {
    auto x = random_bf16_values(rows * row_width, 3.0f, 30);
    auto w = random_bf16_values(lora, 1.0f, 31);
    Tensor d_x = device_copy(x, DType::kF32), d_w = device_copy(w, DType::kF32);
    Tensor d_out = device_poisoned(rows * row_width, DType::kBF16);
    ASSERT_EQ(launch_rmsnorm_f32_to_bf16(d_x.data<float>(), row_width, d_w.data<float>(), rows, lora, row_width,
                                         1e-6f, d_out.data<__nv_bfloat16>(), row_width, stream()),
              cudaSuccess);
    std::vector<float> want = x;
    rmsnorm_ref(x.data(), row_width, w.data(), rows, lora, 1e-6f, want.data(), row_width);
    EXPECT_TRUE(all_close(from_bf16(host_copy<uint16_t>(d_out)), want, 1e-3f, 8e-3f, row_width)) << rows;
  }
}

// RoPE reading q from f32 equals RoPE in place on the same values in bf16,
// bit for bit (the values are bf16-exact), q_nope included.
TEST_F(SplitKGpu, RopeFromF32QEqualsInPlace) {
  auto config = load_model_config(testing::model_path("configs/deepseek-v2-lite.config.json"));
  ASSERT_TRUE(config.ok());
  const int nh = 16, nope = 128, rope = 64, lora = 512, width = lora + rope;
  RopeTable table = make_rope_table(rope_params(*config), 5000);
  const int64_t T = 19, qw = nh * (nope + rope);
  auto q = random_bf16_values(T * qw, 1.0f, 40);
  auto kv_a = random_bf16_values(T * width, 1.0f, 41);
  std::vector<int32_t> pos(T);
  std::vector<int64_t> slot(T);
  for (int64_t t = 0; t < T; ++t) {
    pos[t] = static_cast<int32_t>((t * 97) % 5000);
    slot[t] = t;
  }
  Tensor d_kv = device_copy(to_bf16(kv_a), DType::kBF16), d_pos = device_copy(pos, DType::kI32);
  Tensor d_slot = device_copy(slot, DType::kI64), d_inv = device_copy(table.inv_freq, DType::kF32);
  std::vector<std::vector<uint16_t>> results;
  for (bool from_f32 : {false, true}) {
    Tensor d_q = from_f32 ? device_poisoned(T * qw, DType::kBF16) : device_copy(to_bf16(q), DType::kBF16);
    Tensor d_qf = device_copy(q, DType::kF32);
    Tensor d_cache = device_poisoned(T * width, DType::kBF16);
    RopeKvCacheParams p;
    p.q = d_q.data<__nv_bfloat16>();
    p.q_stride = qw;
    if (from_f32) {
      p.q_in = d_qf.data<float>();
      p.q_in_stride = qw;
    }
    p.kv_a = d_kv.data<__nv_bfloat16>();
    p.kv_stride = width;
    p.positions = d_pos.data<int32_t>();
    p.slot_mapping = d_slot.data<int64_t>();
    p.inv_freq = d_inv.data<float>();
    p.attention_factor = static_cast<float>(rope_params(*config).attention_factor);
    p.cache = d_cache.data<__nv_bfloat16>();
    p.num_tokens = T;
    p.num_heads = nh;
    p.qk_nope = nope;
    p.qk_rope = rope;
    p.kv_lora = lora;
    ASSERT_EQ(launch_rope_kv_cache_write(p, stream()), cudaSuccess);
    results.push_back(host_copy<uint16_t>(d_q));
  }
  EXPECT_EQ(results[0], results[1]);
}

TEST_F(SplitKGpu, SiluMulReadsF32) {
  const int64_t rows = 9, width = 1408;
  auto gu = random_bf16_values(rows * 2 * width, 4.0f, 50);
  Tensor d_gu = device_copy(gu, DType::kF32), d_out = device_poisoned(rows * width, DType::kBF16);
  ASSERT_EQ(launch_silu_mul(d_gu.data<float>(), rows, width, d_out.data<__nv_bfloat16>(), stream()), cudaSuccess);
  std::vector<float> want(rows * width);
  silu_mul_ref(gu.data(), rows, width, want.data());
  EXPECT_TRUE(all_close(from_bf16(host_copy<uint16_t>(d_out)), want, 1e-3f, 8e-3f, width));
}

}  // namespace
}  // namespace nucleus::kernels
