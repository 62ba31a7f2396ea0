// CUDA kernels against the CPU reference: embedding, RMSNorm (fused residual
// add and in place), SwiGLU, row gather, RoPE + latent cache write, and the
// dense GEMMs (cuBLASLt bf16, the plain kernel with bf16 and FP8 weights),
// over edge shapes (1 row, odd counts, non-multiples of tiles, large batches).
#include <gtest/gtest.h>

#include "core/device.h"
#include "gpu_test_util.h"
#include "kernels/activation/silu_mul.cuh"
#include "kernels/activation/silu_mul_ref.h"
#include "kernels/embedding/embedding.cuh"
#include "kernels/embedding/embedding_ref.h"
#include "kernels/gather/gather_rows.cuh"
#include "kernels/gemm/gemm_cublaslt.h"
#include "kernels/gemm/gemm_naive.cuh"
#include "kernels/gemm/gemm_ref.h"
#include "kernels/rmsnorm/rmsnorm.cuh"
#include "kernels/rmsnorm/rmsnorm_ref.h"
#include "kernels/rope/rope_kv_cache.cuh"
#include "kernels/rope/rope_ref.h"
#include "model/deepseek/kernel_params.h"
#include "io/hf_config.h"
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

class GpuKernels : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device"; }
  cudaStream_t stream() { return nullptr; }  // default stream; each test syncs through host_copy
};

TEST_F(GpuKernels, Embedding) {
  const int64_t V = 1000, H = 264;
  auto table = random_bf16_values(V * H, 1.0f, 1);
  for (int64_t T : {1, 7, 300}) {
    std::vector<int32_t> ids(T);
    for (int64_t t = 0; t < T; ++t) ids[t] = static_cast<int32_t>((t * 7919) % V);
    Tensor d_table = device_copy(to_bf16(table), DType::kBF16), d_ids = device_copy(ids, DType::kI32);
    Tensor d_out = device_poisoned(T * H, DType::kF32);
    ASSERT_EQ(launch_embedding(d_table.data<__nv_bfloat16>(), H, d_ids.data<int32_t>(), T, d_out.data<float>(),
                               stream()), cudaSuccess);
    std::vector<float> want(T * H);
    embedding_ref(table.data(), V, H, ids.data(), T, want.data());
    EXPECT_TRUE(all_close(host_copy<float>(d_out), want, 0, 0, H)) << T;
  }
}

TEST_F(GpuKernels, AddRmsNormAndInPlace) {
  for (int64_t width : {256, 2048, 7168, 333}) {
    for (int64_t rows : {1, 5, 129}) {
      auto residual = random_bf16_values(rows * width, 2.0f, 2);
      auto delta = random_bf16_values(rows * width, 1.0f, 3);
      auto w = random_bf16_values(width, 1.0f, 4);
      Tensor d_res = device_copy(residual, DType::kF32), d_delta = device_copy(to_bf16(delta), DType::kBF16);
      Tensor d_w = device_copy(w, DType::kF32), d_out = device_poisoned(rows * width, DType::kBF16);
      ASSERT_EQ(launch_add_rmsnorm(d_res.data<float>(), d_delta.data<__nv_bfloat16>(), d_w.data<float>(), rows,
                                   width, 1e-6f, d_out.data<__nv_bfloat16>(), stream()), cudaSuccess);
      std::vector<float> res_ref = residual, out_ref(rows * width);
      add_rmsnorm_ref(res_ref.data(), delta.data(), w.data(), rows, width, 1e-6f, out_ref.data());
      EXPECT_TRUE(all_close(host_copy<float>(d_res), res_ref, 1e-6f, 0, width)) << width << "x" << rows;
      // Output rounded to bf16: relative 2^-8.
      EXPECT_TRUE(all_close(from_bf16(host_copy<uint16_t>(d_out)), out_ref, 1e-5f, 8e-3f, width));
      // In place on the first `width - 64` columns of rows of `width` (kv_a's c_kv part).
      const int64_t part = width - 64;
      auto x = random_bf16_values(rows * width, 1.0f, 5);
      Tensor d_x = device_copy(to_bf16(x), DType::kBF16);
      ASSERT_EQ(launch_rmsnorm_inplace(d_x.data<__nv_bfloat16>(), width, d_w.data<float>(), rows, part, 1e-6f,
                                       stream()), cudaSuccess);
      std::vector<float> x_ref = x;
      rmsnorm_ref(x.data(), width, w.data(), rows, part, 1e-6f, x_ref.data(), width);
      EXPECT_TRUE(all_close(from_bf16(host_copy<uint16_t>(d_x)), x_ref, 1e-5f, 8e-3f, width));
    }
  }
}

// Without a delta (the first layer's input norm): the residual is read, not
// written.
TEST_F(GpuKernels, AddRmsNormWithoutDelta) {
  for (int64_t width : {256, 7168, 333}) {
    const int64_t rows = 3;
    auto residual = random_bf16_values(rows * width, 2.0f, 7);
    auto w = random_bf16_values(width, 1.0f, 8);
    Tensor d_res = device_copy(residual, DType::kF32), d_w = device_copy(w, DType::kF32);
    Tensor d_out = device_poisoned(rows * width, DType::kBF16);
    ASSERT_EQ(launch_add_rmsnorm(d_res.data<float>(), nullptr, d_w.data<float>(), rows, width, 1e-6f,
                                 d_out.data<__nv_bfloat16>(), stream()), cudaSuccess);
    std::vector<float> out_ref(rows * width);
    rmsnorm_ref(residual.data(), width, w.data(), rows, width, 1e-6f, out_ref.data(), width);
    EXPECT_EQ(host_copy<float>(d_res), residual) << width;
    EXPECT_TRUE(all_close(from_bf16(host_copy<uint16_t>(d_out)), out_ref, 1e-5f, 8e-3f, width)) << width;
  }
}

TEST_F(GpuKernels, SiluMulAndGather) {
  for (int64_t rows : {1, 33}) {
    const int64_t width = 1408;
    auto gu = random_bf16_values(rows * 2 * width, 3.0f, 6);
    Tensor d_gu = device_copy(to_bf16(gu), DType::kBF16), d_out = device_poisoned(rows * width, DType::kBF16);
    ASSERT_EQ(launch_silu_mul(d_gu.data<__nv_bfloat16>(), rows, width, d_out.data<__nv_bfloat16>(), stream()),
              cudaSuccess);
    std::vector<float> want(rows * width);
    silu_mul_ref(gu.data(), rows, width, want.data());
    EXPECT_TRUE(all_close(from_bf16(host_copy<uint16_t>(d_out)), want, 1e-5f, 8e-3f, width));
  }
  std::vector<float> src = random_bf16_values(10 * 6, 1.0f, 7);
  std::vector<int32_t> idx = {9, 0, 3};
  Tensor d_src = device_copy(src, DType::kF32), d_idx = device_copy(idx, DType::kI32);
  Tensor d_out = device_poisoned(3 * 6, DType::kF32);
  ASSERT_EQ(launch_gather_rows(d_src.raw(), d_idx.data<int32_t>(), 3, 6 * 4, d_out.raw(), stream()), cudaSuccess);
  std::vector<float> want;
  for (int32_t i : idx) want.insert(want.end(), src.begin() + i * 6, src.begin() + i * 6 + 6);
  EXPECT_TRUE(all_close(host_copy<float>(d_out), want, 0, 0));
}

// The MTP module's input rows: bf16 or f32 rows gathered and widened to f32,
// exactly (every bf16 is an f32), against the host gather.
TEST_F(GpuKernels, GatherRowsToF32) {
  const int64_t width = 7168 + 3;  // DeepSeek-V3's hidden size and a ragged tail
  std::vector<float> src = random_bf16_values(5 * width, 4.0f, 11);  // bf16-representable values
  std::vector<int32_t> idx = {4, 0, 4, 2};
  Tensor d_idx = device_copy(idx, DType::kI32);
  std::vector<float> want;
  for (int32_t i : idx) want.insert(want.end(), src.begin() + i * width, src.begin() + (i + 1) * width);
  for (bool bf16 : {true, false}) {
    SCOPED_TRACE(bf16 ? "bf16 rows" : "f32 rows");
    Tensor d_src = bf16 ? device_copy(to_bf16(src), DType::kBF16) : device_copy(src, DType::kF32);
    Tensor d_out = device_poisoned(4 * width, DType::kF32);
    ASSERT_EQ(launch_gather_rows_f32(d_src.raw(), bf16, d_idx.data<int32_t>(), 4, width, d_out.data<float>(),
                                     stream()),
              cudaSuccess);
    EXPECT_TRUE(all_close(host_copy<float>(d_out), want, 0, 0));
  }
  EXPECT_EQ(launch_gather_rows_f32(nullptr, true, nullptr, 1, 0, nullptr, stream()), cudaErrorInvalidValue);
  EXPECT_EQ(launch_gather_rows_f32(nullptr, true, nullptr, -1, 8, nullptr, stream()), cudaErrorInvalidValue);
  EXPECT_EQ(launch_gather_rows_f32(nullptr, true, nullptr, 0, 8, nullptr, stream()), cudaSuccess);
}

TEST_F(GpuKernels, RopeAndKvCacheWrite) {
  auto config = load_model_config(testing::model_path("configs/deepseek-v2-lite.config.json"));
  ASSERT_TRUE(config.ok());
  const int nh = 16, nope = 128, rope = 64, lora = 512, width = lora + rope;
  RopeTable table = make_rope_table(rope_params(*config), 5000);
  const int64_t T = 37, slots = 64;
  auto q = random_bf16_values(T * nh * (nope + rope), 1.0f, 8);
  auto kv_a = random_bf16_values(T * width, 1.0f, 9);
  std::vector<int32_t> pos(T);
  std::vector<int64_t> slot(T);
  for (int64_t t = 0; t < T; ++t) {
    pos[t] = static_cast<int32_t>((t * 131) % 5000);
    slot[t] = t % 5 == 2 ? -1 : (t * 3) % slots;  // some rows write nothing
  }
  std::vector<uint16_t> sentinel(slots * width, f32_to_bf16(12345.0f));
  Tensor d_q = device_copy(to_bf16(q), DType::kBF16), d_kv = device_copy(to_bf16(kv_a), DType::kBF16);
  Tensor d_pos = device_copy(pos, DType::kI32), d_slot = device_copy(slot, DType::kI64);
  Tensor d_inv = device_copy(table.inv_freq, DType::kF32), d_cache = device_copy(sentinel, DType::kBF16);
  RopeKvCacheParams p;
  p.q = d_q.data<__nv_bfloat16>();
  p.q_stride = nh * (nope + rope);
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
  std::vector<float> q_ref = q, cache_ref = from_bf16(sentinel);
  for (int64_t t = 0; t < T; ++t) {
    for (int h = 0; h < nh; ++h) apply_rope_interleaved_ref(table, pos[t], q_ref.data() + t * p.q_stride + h * (nope + rope) + nope);
    if (slot[t] < 0) continue;
    std::vector<float> row(kv_a.begin() + t * width, kv_a.begin() + (t + 1) * width);
    apply_rope_interleaved_ref(table, pos[t], row.data() + lora);
    std::copy(row.begin(), row.end(), cache_ref.begin() + slot[t] * width);
  }
  // Rotation of bf16 values in f32, stored as bf16: error ~ 2^-8 relative.
  EXPECT_TRUE(all_close(from_bf16(host_copy<uint16_t>(d_q)), q_ref, 2e-3f, 8e-3f, p.q_stride));
  // Slots never written keep the sentinel exactly; written ones match.
  EXPECT_TRUE(all_close(from_bf16(host_copy<uint16_t>(d_cache)), cache_ref, 2e-3f, 8e-3f, width));
}

// The fused kv_a_layernorm (RopeKvCacheParams::kv_norm_w): the cache bytes and
// the rotated q equal launch_rmsnorm_inplace on kv_a followed by the plain
// kernel, bit for bit, for bf16, FP8 (per-layer scale) and fp8_ds_mla rows;
// kv_a is left as it was; kv_lora above 1024 is refused.
TEST_F(GpuKernels, RopeKvCacheWriteFusedKvANormEqualsRmsNormThenRope) {
  auto config = load_model_config(testing::model_path("configs/deepseek-v2-lite.config.json"));
  ASSERT_TRUE(config.ok());
  const int nh = 16, nope = 128, rope = 64, lora = 512, width = lora + rope;
  RopeTable table = make_rope_table(rope_params(*config), 5000);
  const int64_t T = 37, slots = 64;
  auto q = random_bf16_values(T * nh * (nope + rope), 1.0f, 18);
  auto kv_a = random_bf16_values(T * width, 3.0f, 19);
  auto w = random_bf16_values(lora, 1.0f, 20);
  std::vector<int32_t> pos(T);
  std::vector<int64_t> slot(T);
  for (int64_t t = 0; t < T; ++t) {
    pos[t] = static_cast<int32_t>((t * 131) % 5000);
    slot[t] = t % 5 == 2 ? -1 : (t * 3) % slots;
  }
  Tensor d_pos = device_copy(pos, DType::kI32), d_slot = device_copy(slot, DType::kI64);
  Tensor d_inv = device_copy(table.inv_freq, DType::kF32), d_w = device_copy(w, DType::kF32);
  for (int kind = 0; kind < 3; ++kind) {  // bf16, fp8 e4m3 (k_scale 0.05), fp8_ds_mla
    const int64_t row_bytes = kind == 0 ? width * 2 : kind == 1 ? width : 656;
    std::vector<uint8_t> results[2][2];  // [fused][cache, q]
    for (int fused : {0, 1}) {
      Tensor d_q = device_copy(to_bf16(q), DType::kBF16), d_kv = device_copy(to_bf16(kv_a), DType::kBF16);
      Tensor d_cache = device_copy(std::vector<uint8_t>(slots * row_bytes, 0x5a), DType::kU8);
      if (!fused) {
        ASSERT_EQ(launch_rmsnorm_inplace(d_kv.data<__nv_bfloat16>(), width, d_w.data<float>(), T, lora, 1e-6f,
                                         stream()),
                  cudaSuccess);
      }
      RopeKvCacheParams p;
      p.q = d_q.data<__nv_bfloat16>();
      p.q_stride = nh * (nope + rope);
      p.kv_a = d_kv.data<__nv_bfloat16>();
      p.kv_stride = width;
      if (fused) {
        p.kv_norm_w = d_w.data<float>();
        p.kv_norm_eps = 1e-6f;
      }
      p.positions = d_pos.data<int32_t>();
      p.slot_mapping = d_slot.data<int64_t>();
      p.inv_freq = d_inv.data<float>();
      p.attention_factor = static_cast<float>(rope_params(*config).attention_factor);
      p.cache = d_cache.raw();
      p.cache_fp8 = kind == 1;
      p.cache_ds_mla = kind == 2;
      p.k_scale = 0.05f;
      p.num_tokens = T;
      p.num_heads = nh;
      p.qk_nope = nope;
      p.qk_rope = rope;
      p.kv_lora = lora;
      ASSERT_EQ(launch_rope_kv_cache_write(p, stream()), cudaSuccess);
      results[fused][0] = host_copy<uint8_t>(d_cache);
      const auto qb = host_copy<uint16_t>(d_q);
      results[fused][1].assign(reinterpret_cast<const uint8_t*>(qb.data()),
                               reinterpret_cast<const uint8_t*>(qb.data() + qb.size()));
      if (fused) {
        EXPECT_EQ(host_copy<uint16_t>(d_kv), to_bf16(kv_a)) << kind << ": the fused kernel wrote kv_a";
        p.kv_lora = 1025;
        p.cache_ds_mla = false;
        EXPECT_EQ(launch_rope_kv_cache_write(p, stream()), cudaErrorInvalidValue) << "kv_lora 1025 with the norm";
      }
    }
    EXPECT_EQ(results[0][0], results[1][0]) << "cache kind " << kind << ": fused norm changed the cache bytes";
    EXPECT_EQ(results[0][1], results[1][1]) << "cache kind " << kind << ": fused norm changed q";
  }
}

struct GemmCase {
  int64_t m, n, k;
};

TEST_F(GpuKernels, GemmBf16CublasLtAndNaive) {
  for (GemmCase c : {GemmCase{1, 576, 2048}, GemmCase{7, 3072, 2048}, GemmCase{64, 2048, 2048},
                     GemmCase{333, 264, 512}, GemmCase{1, 4096, 256}}) {
    auto x = random_bf16_values(c.m * c.k, 1.0f, 10);
    auto w = random_bf16_values(c.n * c.k, 0.05f, 11);
    auto acc0 = random_bf16_values(c.m * c.n, 1.0f, 12);
    std::vector<float> want(c.m * c.n);
    gemm_ref(x.data(), c.k, w.data(), c.m, c.n, c.k, want.data(), c.n, false);
    std::vector<float> want_acc = acc0;
    gemm_ref(x.data(), c.k, w.data(), c.m, c.n, c.k, want_acc.data(), c.n, true);
    Tensor d_x = device_copy(to_bf16(x), DType::kBF16), d_w = device_copy(to_bf16(w), DType::kBF16);
    for (int variant = 0; variant < 2; ++variant) {
      Tensor d_out = device_poisoned(c.m * c.n, DType::kF32);
      Tensor d_acc = device_copy(acc0, DType::kF32);
      if (variant == 0) {
        GemmArgs a;
        a.x = d_x.raw();
        a.x_stride = c.k;
        a.w = d_w.raw();
        a.out = d_out.raw();
        a.out_stride = c.n;
        a.out_dtype = DType::kF32;
        a.m = c.m;
        a.n = c.n;
        a.k = c.k;
        ASSERT_TRUE(gemm_bf16_cublaslt(a, stream()).ok());
        a.out = d_acc.raw();
        a.accumulate = true;
        ASSERT_TRUE(gemm_bf16_cublaslt(a, stream()).ok());
      } else {
        WeightView wv{d_w.raw(), nullptr, c.n, c.k, 0, 0};
        ASSERT_EQ(launch_gemm_naive(d_x.data<__nv_bfloat16>(), c.k, wv, c.m, d_out.raw(), DType::kF32, c.n, false,
                                    stream()), cudaSuccess);
        ASSERT_EQ(launch_gemm_naive(d_x.data<__nv_bfloat16>(), c.k, wv, c.m, d_acc.raw(), DType::kF32, c.n, true,
                                    stream()), cudaSuccess);
      }
      // f32 accumulation of exact bf16 products: only summation order differs.
      const float atol = 1e-4f * std::sqrt(static_cast<float>(c.k));
      EXPECT_TRUE(all_close(host_copy<float>(d_out), want, atol, 1e-4f, c.n)) << variant << " m=" << c.m;
      EXPECT_TRUE(all_close(host_copy<float>(d_acc), want_acc, atol, 1e-4f, c.n)) << variant << " m=" << c.m;
    }
  }
}

TEST_F(GpuKernels, GemmFp8BlockScaledNaive) {
  const int64_t m = 5, n = 300, k = 200, bn = 128, bk = 128;  // partial blocks on both axes
  auto x = random_bf16_values(m * k, 1.0f, 13);
  std::vector<uint8_t> q(n * k);
  auto qf = random_bf16_values(n * k, 300.0f, 14);
  for (int64_t i = 0; i < n * k; ++i) q[i] = f32_to_fp8e4m3(qf[i]);
  const int64_t nb = (n + bn - 1) / bn, kb = (k + bk - 1) / bk;
  std::vector<float> scale(nb * kb);
  for (int64_t i = 0; i < nb * kb; ++i) scale[i] = 1e-3f * static_cast<float>(i + 1);
  std::vector<float> w(n * k);
  dequantize_fp8_block_ref(q.data(), scale.data(), n, k, bn, bk, w.data());
  std::vector<float> want(m * n);
  gemm_ref(x.data(), k, w.data(), m, n, k, want.data(), n, false);
  Tensor d_x = device_copy(to_bf16(x), DType::kBF16), d_q = device_copy(q, DType::kU8);
  Tensor d_s = device_copy(scale, DType::kF32), d_out = device_poisoned(m * n, DType::kBF16);
  WeightView wv{d_q.raw(), d_s.data<float>(), n, k, static_cast<int>(bn), static_cast<int>(bk)};
  ASSERT_EQ(launch_gemm_naive(d_x.data<__nv_bfloat16>(), k, wv, m, d_out.raw(), DType::kBF16, n, false, stream()),
            cudaSuccess);
  EXPECT_TRUE(all_close(from_bf16(host_copy<uint16_t>(d_out)), want, 1e-3f, 8e-3f, n));
}

}  // namespace
}  // namespace nucleus::kernels
