// Helpers for GPU tests: random inputs, bf16 rounding, device round trips,
// and comparisons that report the first mismatching coordinate.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "ops/linear_weight.h"
#include "ops/step_inputs.h"

namespace nucleus::testing {

// Values uniform in [-scale, scale], rounded to bf16 (so the CPU reference
// sees exactly what the GPU sees).
inline std::vector<float> random_bf16_values(size_t n, float scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = round_to_bf16(d(rng));
  return v;
}

inline std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_bf16(v[i]);
  return out;
}

inline std::vector<float> from_bf16(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_f32(v[i]);
  return out;
}

// A device buffer holding a copy of `host`.
template <typename T>
Tensor device_copy(const std::vector<T>& host, DType dtype) {
  Tensor t = Tensor::empty({static_cast<int64_t>(host.size() * sizeof(T) / dtype_size(dtype))}, dtype, Device::kCuda);
  copy_to_device(t.raw(), host.data(), host.size() * sizeof(T));
  return t;
}

// A device buffer of `count` elements filled with a poison byte pattern
// (0x7f bytes: an e4m3 NaN, and a huge finite f32 / bf16 value).
inline Tensor device_poisoned(int64_t count, DType dtype) {
  Tensor t = Tensor::empty({count}, dtype, Device::kCuda);
  std::vector<uint8_t> poison(t.nbytes(), 0x7f);  // NaN in fp8; ~3.39e38 (finite) in f32 and bf16
  copy_to_device(t.raw(), poison.data(), poison.size());
  return t;
}

template <typename T>
std::vector<T> host_copy(const Tensor& t) {
  synchronize_device();
  std::vector<T> out(t.nbytes() / sizeof(T));
  copy_to_host(out.data(), t.raw(), t.nbytes());
  return out;
}

// |got - want| <= atol + rtol * |want| everywhere; reports the first failure.
inline ::testing::AssertionResult all_close(const std::vector<float>& got, const std::vector<float>& want, float atol,
                                            float rtol, int64_t row_width = 0) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float err = std::fabs(got[i] - want[i]);
    worst = std::max<double>(worst, err);
    if (!(err <= atol + rtol * std::fabs(want[i]))) {
      auto f = ::testing::AssertionFailure() << "first mismatch at ";
      if (row_width) f << "[" << i / row_width << ", " << i % row_width << "]";
      else f << i;
      return f << ": got " << got[i] << ", want " << want[i] << " (atol " << atol << ", rtol " << rtol << ")";
    }
  }
  return ::testing::AssertionSuccess() << "max abs error " << worst;
}

// A linear weight [n, k] twice: `host`, f32 on the CPU (what the CPU
// reference backends read), and `device`, on the GPU as the CUDA backends
// read it: bf16, or (fp8) F8E4M3 codes with 128x128 f32 scale_inv blocks
// whose scales vary by a factor 0.5 .. 1.5 (wrong block indexing shows).
// host holds exactly the value device represents (the bf16 value, or code *
// scale). Values about uniform in [-a, a]; the same seed gives the same weight.
struct LinearWeightPair {
  LinearWeight host;
  LinearWeight device;
};

inline LinearWeightPair make_linear_weight_pair(const std::string& name, int64_t n, int64_t k, bool fp8, float a,
                                                uint64_t seed) {
  LinearWeightPair p;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> ref(n * k);
  for (LinearWeight* w : {&p.host, &p.device}) {
    w->name = name;
    w->out_features = n;
    w->in_features = k;
  }
  if (!fp8) {
    std::vector<uint16_t> bits(n * k);
    for (size_t i = 0; i < bits.size(); ++i) {
      bits[i] = f32_to_bf16(a * u(rng));
      ref[i] = bf16_to_f32(bits[i]);
    }
    p.device.weight = device_copy(bits, DType::kBF16).view({n, k});
  } else {
    const int64_t nb = (n + 127) / 128, kb = (k + 127) / 128;
    std::vector<float> scale(nb * kb);
    for (auto& s : scale) s = a / 448.0f * (1.0f + 0.5f * u(rng));
    std::vector<uint8_t> codes(n * k);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c) {
        const int64_t i = r * k + c;
        codes[i] = f32_to_fp8e4m3(448.0f * u(rng));
        ref[i] = fp8e4m3_to_f32(codes[i]) * scale[(r / 128) * kb + c / 128];
      }
    p.device.weight = device_copy(codes, DType::kF8E4M3).view({n, k});
    p.device.scale_inv = device_copy(scale, DType::kF32).view({nb, kb});
    p.device.block_n = p.device.block_k = 128;
  }
  p.host.weight = Tensor::from_f32({n, k}, ref);
  return p;
}

// Activations [m, k] (bf16 values, k > 0) that the per-1x128 FP8 activation
// quantizer (kernels/gemm/fp8_act_quant) represents exactly: every 128-column
// group holds e4m3 values times 2^-8 and reaches its amax, 448 * 2^-8, at its
// first column, so its scale is 2^-8 and each value is an e4m3 code times it.
// A W8A8 GEMM (cuBLASLt FP8) then computes the same products as a W8A16 one
// and the f32 reference: only the summation order differs.
inline std::vector<float> fp8_exact_activations(int64_t m, int64_t k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-448.0f, 448.0f);
  const float unit = 1.0f / 256.0f;
  std::vector<float> x(m * k);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; ++c)
      x[r * k + c] = c % 128 == 0 ? ((r + c / 128) % 2 ? -448.0f : 448.0f) * unit
                                  : fp8e4m3_to_f32(f32_to_fp8e4m3(u(rng))) * unit;
  return x;
}

inline bool have_gpu() { return cuda_available(); }

// A decode step of n sequences with `context` cached tokens each (blocks of
// block_size, `blocks` a sequence): sequence s reads and writes blocks
// 1 + s * blocks ... (block 0 is what graph pad rows read); token ids vary by
// sequence.
inline StepInputs decode_step_after_context(int64_t n, int64_t blocks, int64_t context, int64_t block_size) {
  StepInputs d;
  d.query_start = {0};
  d.max_blocks_per_seq = static_cast<int32_t>(blocks);
  for (int64_t s = 0; s < n; ++s) {
    d.token_ids.push_back(static_cast<int32_t>(3 + (s * 7) % 4000));
    d.positions.push_back(static_cast<int32_t>(context));
    d.slot_mapping.push_back((1 + s * blocks + context / block_size) * block_size + context % block_size);
    d.query_start.push_back(static_cast<int32_t>(s + 1));
    d.context_lens.push_back(static_cast<int32_t>(context));
    d.logit_indices.push_back(static_cast<int32_t>(s));
    for (int64_t b = 0; b < blocks; ++b) d.block_tables.push_back(static_cast<int32_t>(1 + s * blocks + b));
  }
  return d;
}

// Fills a bf16 cache with the same small pseudo-random values every time.
inline void fill_cache_pattern(KvCache& kv) {
  std::vector<uint16_t> v(kv.data.numel());
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = f32_to_bf16(0.01f * static_cast<float>(static_cast<int64_t>(i * 37 % 101) - 50));
  copy_to_device(kv.data.raw(), v.data(), v.size() * 2);
}

}  // namespace nucleus::testing
