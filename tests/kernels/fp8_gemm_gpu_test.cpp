// FP8 block-scaled linears against the CPU reference: the per-1x128
// activation quantizer (bit-exact), the own kernels (backend "cuda_fp8":
// decode and tiled), cuBLASLt's block-scaled FP8 GEMM (backend
// "cublaslt_fp8"), the LinearOp dispatch and its refusals, over m = 1, 3, 64,
// 129, 1000, 4096, DeepSeek-V3's shapes and partial blocks (n=300, k=200).
//
// References (CPU, f32): W = dequantize_fp8_block_ref(q, scale_inv);
//  - own kernels (W8A16): gemm_ref(x, W). Exact products, so only the f32
//    summation order differs: |err| <= 2e-3 * rms(ref) (+ 2^-8 relative for
//    bf16 outputs).
//  - cuBLASLt (W8A8): gemm_ref(xq * s, W) with xq, s from the CPU quantizer,
//    i.e. the same quantized activations; FP8 tensor-core accumulation and
//    order differ: |err| <= 1e-2 * rms(ref) (+ 2^-8 relative for bf16).
// Large problems compare sampled rows (all columns; first, last, tile edges).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>

#include "core/cuda/context.h"
#include "core/device.h"
#include "gpu_test_util.h"
#include "kernels/gemm/fp8_gemm.cuh"
#include "kernels/gemm/fp8_gemm_cublaslt.h"
#include "kernels/gemm/gemm_ref.h"
#include "graph/step_resources.h"
#include "ops/linear_cuda.h"
#include "ops/linear_op.h"

namespace nucleus::kernels {
namespace {

using testing::from_bf16;
using testing::random_bf16_values;
using testing::to_bf16;

cudaStream_t engine_stream() { return cuda::context().stream; }

// CPU reference of launch_fp8_act_quant (row-major scales [m, ceil(k/128)]).
void act_quant_ref(const std::vector<float>& x, int64_t m, int64_t k, std::vector<uint8_t>& xq,
                   std::vector<float>& scales) {
  const int64_t groups = (k + 127) / 128;
  xq.assign(m * k, 0);
  scales.assign(m * groups, 0.0f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * 128, c1 = std::min(k, c0 + 128);
      float amax = 0.0f;
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[r * k + c]));
      const float s = amax / 448.0f;
      scales[r * groups + g] = s;
      for (int64_t c = c0; c < c1; ++c) xq[r * k + c] = s > 0.0f ? f32_to_fp8e4m3(x[r * k + c] / s) : 0;
    }
}

// Fast deterministic bytes (weights are large).
struct XorShift {
  uint64_t s;
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
};

// An FP8 weight [n, k] with 128x128 scales, on the host (with its f32
// dequantization) and on the device.
struct Fp8Weight {
  int64_t n = 0, k = 0;
  std::vector<uint8_t> q;
  std::vector<float> scale;
  std::vector<float> w;  // dequantized [n, k]
  LinearWeight dev;
};

Fp8Weight make_weight(int64_t n, int64_t k, uint64_t seed) {
  Fp8Weight f;
  f.n = n;
  f.k = k;
  f.q.resize(n * k);
  XorShift rng{seed * 0x9E3779B97F4A7C15ull + 1};
  for (auto& b : f.q) {
    uint8_t v = static_cast<uint8_t>(rng.next() >> 32);
    if ((v & 0x7f) == 0x7f) v ^= 1;  // no NaN
    b = v;
  }
  const int64_t nb = (n + 127) / 128, kb = (k + 127) / 128;
  f.scale.resize(nb * kb);
  for (auto& s : f.scale) s = 1e-3f * (0.5f + static_cast<float>(rng.next() % 1000) / 1000.0f);
  f.w.resize(n * k);
  dequantize_fp8_block_ref(f.q.data(), f.scale.data(), n, k, 128, 128, f.w.data());
  f.dev.name = "test.fp8";
  f.dev.out_features = n;
  f.dev.in_features = k;
  f.dev.weight = Tensor::empty({n, k}, DType::kF8E4M3, Device::kCuda);
  copy_to_device(f.dev.weight.raw(), f.q.data(), f.q.size());
  f.dev.scale_inv = Tensor::empty({nb, kb}, DType::kF32, Device::kCuda);
  copy_to_device(f.dev.scale_inv.raw(), f.scale.data(), f.scale.size() * sizeof(float));
  f.dev.block_n = 128;
  f.dev.block_k = 128;
  return f;
}

// Rows compared against the reference: all for small problems, else a sample
// that includes the first and last rows and tile edges.
std::vector<int64_t> checked_rows(int64_t m, int64_t n, int64_t k) {
  std::vector<int64_t> rows;
  if (m * n * k <= (int64_t{1} << 31) || m <= 8) {
    for (int64_t r = 0; r < m; ++r) rows.push_back(r);
    return rows;
  }
  for (int64_t r : {int64_t{0}, int64_t{1}, int64_t{63}, int64_t{64}, int64_t{127}, int64_t{128}, m / 2, m - 1})
    if (r < m && std::find(rows.begin(), rows.end(), r) == rows.end()) rows.push_back(r);
  return rows;
}

float rms(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += double(x) * x;
  return static_cast<float>(std::sqrt(s / std::max<size_t>(1, v.size())));
}

// Device output rows `rows` of an [m, n] tensor (row stride `stride`) as f32.
std::vector<float> read_rows(const Tensor& t, int64_t n, int64_t stride, const std::vector<int64_t>& rows) {
  synchronize_device();
  const size_t es = dtype_size(t.dtype());
  std::vector<float> out;
  std::vector<uint8_t> buf(n * es);
  for (int64_t r : rows) {
    copy_to_host(buf.data(), static_cast<const char*>(t.raw()) + r * stride * es, buf.size());
    for (int64_t c = 0; c < n; ++c) {
      if (t.dtype() == DType::kF32) {
        float v;
        std::memcpy(&v, buf.data() + c * 4, 4);
        out.push_back(v);
      } else {
        uint16_t h;
        std::memcpy(&h, buf.data() + c * 2, 2);
        out.push_back(bf16_to_f32(h));
      }
    }
  }
  return out;
}

// |got - want| <= atol + rtol |want| with atol = rel_scale * rms(want).
::testing::AssertionResult close_to(const std::vector<float>& got, const std::vector<float>& want, float rel_scale,
                                    float rtol, int64_t n) {
  const float atol = rel_scale * std::max(rms(want), 1e-30f);
  return testing::all_close(got, want, atol, rtol, n);
}

class Fp8Gemm : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device";
  }
};

TEST_F(Fp8Gemm, ActQuantMatchesReferenceBitExact) {
  struct Case {
    int64_t m, k, x_stride;
  };
  for (Case c : {Case{1, 128, 128}, Case{5, 200, 200}, Case{3, 7168, 7168}, Case{64, 1536, 1536},
                 Case{7, 300, 301} /* odd stride: element path */}) {
    auto x = random_bf16_values(c.m * c.x_stride, 2.0f, 100 + c.k);
    // Edge values: an all-zero group, -0, an outlier, tiny values.
    for (int64_t col = 0; col < std::min<int64_t>(128, c.k); ++col) x[col] = 0.0f;
    if (c.m > 1) {
      x[c.x_stride] = -0.0f;
      x[c.x_stride + 1] = round_to_bf16(3.0e4f);
      x[c.x_stride + 2] = round_to_bf16(1e-30f);
    }
    std::vector<float> packed(c.m * c.k);
    for (int64_t r = 0; r < c.m; ++r)
      for (int64_t col = 0; col < c.k; ++col) packed[r * c.k + col] = x[r * c.x_stride + col];
    std::vector<uint8_t> want_q;
    std::vector<float> want_s;
    act_quant_ref(packed, c.m, c.k, want_q, want_s);
    const int64_t groups = (c.k + 127) / 128;
    Tensor d_x = testing::device_copy(to_bf16(x), DType::kBF16);
    for (int layout = 0; layout < 2; ++layout) {  // row-major scales, then cuBLASLt's [groups, m]
      Tensor d_q = testing::device_poisoned(c.m * c.k, DType::kU8);
      Tensor d_s = testing::device_poisoned(c.m * groups, DType::kF32);
      ASSERT_EQ(launch_fp8_act_quant(d_x.data<__nv_bfloat16>(), c.x_stride, c.m, c.k, d_q.data<uint8_t>(), c.k,
                                     d_s.data<float>(), layout == 0 ? groups : 1, layout == 0 ? 1 : c.m,
                                     engine_stream()),
                cudaSuccess);
      auto got_q = testing::host_copy<uint8_t>(d_q);
      auto got_s = testing::host_copy<float>(d_s);
      for (int64_t i = 0; i < c.m * c.k; ++i)
        ASSERT_EQ(got_q[i], want_q[i]) << "xq[" << i / c.k << ", " << i % c.k << "] m=" << c.m << " k=" << c.k
                                       << " x=" << packed[i];
      for (int64_t r = 0; r < c.m; ++r)
        for (int64_t g = 0; g < groups; ++g) {
          const float got = layout == 0 ? got_s[r * groups + g] : got_s[g * c.m + r];
          ASSERT_EQ(got, want_s[r * groups + g]) << "scale[" << r << ", " << g << "] layout " << layout;
        }
    }
  }
}

struct Shape {
  const char* name;
  int64_t n, k;
};
// DeepSeek-V3's FP8 linears, and partial blocks on both axes.
const Shape kShapes[] = {{"q_a", 1536, 7168},       {"q_b", 24576, 1536},  {"o_proj", 7168, 16384},
                         {"kv_a", 576, 7168},       {"gate_up", 36864, 7168}, {"down", 7168, 18432},
                         {"odd", 300, 200}};
const int64_t kRows[] = {1, 3, 64, 129, 1000, 4096};

// One (shape, m) problem: inputs and both references on the checked rows.
struct Problem {
  int64_t m = 0;
  std::vector<float> x;               // [m, k] (bf16 values)
  std::vector<int64_t> rows;          // checked rows
  std::vector<float> ref_w8a16;       // [rows, n]
  std::vector<float> ref_w8a8;        // [rows, n]
  std::vector<float> acc0;            // [m, n] initial output for accumulate (bf16 values)
  std::vector<float> acc0_rows;       // [rows, n]
  Tensor d_x;
};

Problem make_problem(const Fp8Weight& w, int64_t m, uint64_t seed) {
  Problem p;
  p.m = m;
  p.x = random_bf16_values(m * w.k, 1.0f, seed);
  p.rows = checked_rows(m, w.n, w.k);
  const int64_t nr = static_cast<int64_t>(p.rows.size());
  std::vector<float> xs(nr * w.k);
  for (int64_t i = 0; i < nr; ++i) std::copy_n(p.x.begin() + p.rows[i] * w.k, w.k, xs.begin() + i * w.k);
  p.ref_w8a16.resize(nr * w.n);
  gemm_ref(xs.data(), w.k, w.w.data(), nr, w.n, w.k, p.ref_w8a16.data(), w.n, false);
  std::vector<uint8_t> xq;
  std::vector<float> sc;
  act_quant_ref(xs, nr, w.k, xq, sc);
  const int64_t groups = (w.k + 127) / 128;
  std::vector<float> xdq(nr * w.k);
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t c = 0; c < w.k; ++c) xdq[r * w.k + c] = fp8e4m3_to_f32(xq[r * w.k + c]) * sc[r * groups + c / 128];
  p.ref_w8a8.resize(nr * w.n);
  gemm_ref(xdq.data(), w.k, w.w.data(), nr, w.n, w.k, p.ref_w8a8.data(), w.n, false);
  p.acc0 = random_bf16_values(m * w.n, 1.0f, seed + 7);
  for (int64_t r : p.rows) p.acc0_rows.insert(p.acc0_rows.end(), p.acc0.begin() + r * w.n, p.acc0.begin() + (r + 1) * w.n);
  p.d_x = testing::device_copy(to_bf16(p.x), DType::kBF16);
  return p;
}

// Whether row r of an m-row call on `path` went through cuBLASLt (W8A8).
bool row_on_cublas(cuda_ops::Fp8Path path, bool cublas_accepts, int64_t m, int64_t n, int64_t k, int64_t r) {
  return cublas_accepts && r < cuda_ops::fp8_cublas_rows(m, n, k, path);
}

// Scratch for fp8_linear_forward calls of up to m rows, as the step executor
// reserves it for the linear op (kept alive by the caller while its kernels run).
cuda_ops::Fp8LinearScratchOwner scratch_for(int64_t m, int64_t n, int64_t k, cuda_ops::Fp8Path path) {
  cuda_ops::Fp8LinearScratchOwner o;
  Status s = cuda_ops::Fp8LinearScratchOwner::create(m, n, k, path, &o);
  NUCLEUS_CHECK(s.ok(), "FP8 scratch: {}", s.to_string());
  return o;
}

// Runs `path` with accumulate off (poisoned output) and on; checks the rows
// against the reference of the numerics each row got.

void check_path(const Fp8Weight& w, const Problem& p, cuda_ops::Fp8Path path, bool cublas_accepts, DType out_dtype,
                const std::string& what) {
  const float rtol = out_dtype == DType::kBF16 ? 8e-3f : 1e-5f;
  std::vector<float> ref(p.rows.size() * w.n);
  bool any_w8a8 = false;
  for (size_t i = 0; i < p.rows.size(); ++i) {
    const bool w8a8 = row_on_cublas(path, cublas_accepts, p.m, w.n, w.k, p.rows[i]);
    any_w8a8 |= w8a8;
    std::copy_n((w8a8 ? p.ref_w8a8 : p.ref_w8a16).begin() + i * w.n, w.n, ref.begin() + i * w.n);
  }
  const float rel_scale = any_w8a8 ? 1e-2f : 2e-3f;
  for (bool accumulate : {false, true}) {
    Tensor out;
    if (accumulate) {
      out = out_dtype == DType::kF32 ? testing::device_copy(p.acc0, DType::kF32)
                                     : testing::device_copy(to_bf16(p.acc0), DType::kBF16);
    } else {
      out = testing::device_poisoned(p.m * w.n, out_dtype);
    }
    const auto scratch = scratch_for(p.m, w.n, w.k, path);
    Status s = cuda_ops::fp8_linear_forward(w.dev, p.d_x.raw(), w.k, p.m, out.raw(), out_dtype, w.n, accumulate,
                                            scratch.scratch(), path);
    ASSERT_TRUE(s.ok()) << what << ": " << s.to_string();
    auto got = read_rows(out, w.n, w.n, p.rows);
    std::vector<float> want = ref;
    if (accumulate)
      for (size_t i = 0; i < want.size(); ++i) want[i] += p.acc0_rows[i];
    EXPECT_TRUE(close_to(got, want, rel_scale, rtol, w.n)) << what << (accumulate ? " accumulate" : "");
    if (!accumulate && p.m * w.n <= (int64_t{1} << 26)) {  // every element written (poison is NaN)
      std::vector<int64_t> all(p.m);
      for (int64_t r = 0; r < p.m; ++r) all[r] = r;
      auto full = read_rows(out, w.n, w.n, all);
      for (size_t i = 0; i < full.size(); ++i)
        ASSERT_TRUE(std::isfinite(full[i])) << what << ": out[" << i / w.n << ", " << i % w.n << "] not written";
    }
  }
}

// Own kernels (cuda_fp8) and cuBLASLt (where it accepts the layout) for every
// shape and m; f32 output for half the cases, bf16 for the others.
TEST_F(Fp8Gemm, BackendsMatchReference) {
  uint64_t seed = 1;
  for (const Shape& sh : kShapes) {
    Fp8Weight w = make_weight(sh.n, sh.k, seed++);
    const bool cublas_layout = cuda_ops::fp8_cublaslt_layout_supported(sh.n, sh.k).ok();
    for (int64_t m : kRows) {
      Problem p = make_problem(w, m, seed++);
      const DType out_dtype = (m + sh.n) % 2 == 0 ? DType::kF32 : DType::kBF16;
      const std::string what = std::string(sh.name) + " m=" + std::to_string(m) + " out=" + dtype_name(out_dtype);
      check_path(w, p, cuda_ops::Fp8Path::kOwn, false, out_dtype, "cuda_fp8 " + what);
      bool accepts = false;
      if (cublas_layout) {
        // Direct cuBLASLt (reports, rather than hides, a refusal).
        Tensor probe = testing::device_poisoned(m * sh.n, out_dtype);
        const auto scratch = scratch_for(m, sh.n, sh.k, cuda_ops::Fp8Path::kCublas);
        Status s = cuda_ops::fp8_linear_forward(w.dev, p.d_x.raw(), sh.k, m, probe.raw(), out_dtype, sh.n, false,
                                                scratch.scratch(), cuda_ops::Fp8Path::kCublas);
        accepts = s.ok();
        if (accepts) check_path(w, p, cuda_ops::Fp8Path::kCublas, true, out_dtype, "cublaslt_fp8 " + what);
        else std::printf("cublaslt-refused %s: %s\n", what.c_str(), s.message().c_str());
      }
      check_path(w, p, cuda_ops::Fp8Path::kAuto, accepts, out_dtype, "auto " + what);
      std::printf("fp8-gemm %s compared %zu rows\n", what.c_str(), p.rows.size());
    }
  }
}

// cuBLASLt rows when m % 4 != 0: padded to a multiple of 4 (f32 scratch,
// copied out) while that copy moves fewer bytes than the weight (m_pad <= k/8),
// else the last m % 4 rows on the own kernels.
TEST_F(Fp8Gemm, CublasPaddedAndTailRows) {
  Fp8Weight w = make_weight(512, 1024, 55);
  for (int64_t m : {1, 2, 5, 62, 130, 201}) {
    Problem p = make_problem(w, m, 56 + m);
    const int64_t rows = cuda_ops::fp8_cublas_rows(m, w.n, w.k, cuda_ops::Fp8Path::kCublas);
    EXPECT_EQ(rows, m % 4 == 0 || (m + 3) / 4 * 4 <= w.k / 8 || m < 4 ? m : m - m % 4) << m;
    for (DType dt : {DType::kBF16, DType::kF32})
      check_path(w, p, cuda_ops::Fp8Path::kCublas, true, dt, "cublaslt_fp8 m=" + std::to_string(m));
  }
}

// The caller's scratch decides what runs, never the result: without split
// partials the decode kernel runs unsplit, a short partial buffer takes fewer
// splits, and without room for cuBLASLt's activations Fp8Path::kAuto runs
// the own kernels (W8A16) while Fp8Path::kCublas refuses by name.
TEST_F(Fp8Gemm, ScratchMissingOrShort) {
  Fp8Weight w = make_weight(1536, 7168, 61);
  for (int64_t m : {1, 8, 64}) {
    Problem p = make_problem(w, m, 62 + m);
    const auto full = scratch_for(m, w.n, w.k, cuda_ops::Fp8Path::kOwn);
    cuda_ops::Fp8LinearScratch shortened = full.scratch();
    shortened.split.partial_floats = m * w.n * 2;  // two splits at most
    for (const auto& [name, scratch] : {std::pair<const char*, cuda_ops::Fp8LinearScratch>{"none", {}},
                                        {"short", shortened}, {"full", full.scratch()}})
      for (cuda_ops::Fp8Path path : {cuda_ops::Fp8Path::kOwn, cuda_ops::Fp8Path::kAuto}) {
        if (path == cuda_ops::Fp8Path::kAuto && std::string(name) == "full") continue;  // checked elsewhere
        Tensor out = testing::device_poisoned(m * w.n, DType::kF32);
        ASSERT_TRUE(cuda_ops::fp8_linear_forward(w.dev, p.d_x.raw(), w.k, m, out.raw(), DType::kF32, w.n, false,
                                                 scratch, path)
                        .ok());
        EXPECT_TRUE(close_to(read_rows(out, w.n, w.n, p.rows), p.ref_w8a16, 2e-3f, 1e-5f, w.n))
            << "m=" << m << " scratch " << name << " path " << static_cast<int>(path);
      }
  }
  Problem p = make_problem(w, 64, 70);
  Tensor out = testing::device_poisoned(64 * w.n, DType::kF32);
  Status s = cuda_ops::fp8_linear_forward(w.dev, p.d_x.raw(), w.k, 64, out.raw(), DType::kF32, w.n, false, {},
                                          cuda_ops::Fp8Path::kCublas);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.to_string();
  EXPECT_NE(s.message().find("scratch"), std::string::npos) << s.message();
  // The sizes: an own-kernel-only scratch holds no cuBLASLt buffers; kAuto's
  // grows with the rows cuBLASLt takes.
  EXPECT_EQ(cuda_ops::fp8_linear_scratch_bytes(0, w.n, w.k, cuda_ops::Fp8Path::kAuto), 0u);
  EXPECT_LT(cuda_ops::fp8_linear_scratch_bytes(4096, w.n, w.k, cuda_ops::Fp8Path::kOwn),
            cuda_ops::fp8_linear_scratch_bytes(4096, w.n, w.k, cuda_ops::Fp8Path::kAuto));
}

// Batch invariance of the own kernels: a row's result does not depend on m.
TEST_F(Fp8Gemm, OwnKernelsRowsIndependentOfBatch) {
  Fp8Weight w = make_weight(1536, 7168, 77);
  Problem big = make_problem(w, 64, 78);
  Tensor out64 = testing::device_poisoned(64 * w.n, DType::kF32);
  const auto scratch = scratch_for(64, w.n, w.k, cuda_ops::Fp8Path::kOwn);
  ASSERT_TRUE(cuda_ops::fp8_linear_forward(w.dev, big.d_x.raw(), w.k, 64, out64.raw(), DType::kF32, w.n, false,
                                           scratch.scratch(), cuda_ops::Fp8Path::kOwn).ok());
  for (int64_t m : {1, 5, 17, 33}) {
    Tensor out = testing::device_poisoned(m * w.n, DType::kF32);
    ASSERT_TRUE(cuda_ops::fp8_linear_forward(w.dev, big.d_x.raw(), w.k, m, out.raw(), DType::kF32, w.n, false,
                                             scratch.scratch(), cuda_ops::Fp8Path::kOwn).ok());
    std::vector<int64_t> rows(m);
    for (int64_t r = 0; r < m; ++r) rows[r] = r;
    EXPECT_EQ(read_rows(out, w.n, w.n, rows), read_rows(out64, w.n, w.n, rows)) << "m=" << m;
  }
}

// The own kernels with strided input and output rows (a slice of wider
// buffers) and an unaligned input stride (element-copy path).
TEST_F(Fp8Gemm, OwnKernelsStridedRows) {
  Fp8Weight w = make_weight(384, 512, 91);
  for (int64_t m : {3, 200}) {
    for (int64_t x_stride : {int64_t{512 + 64}, int64_t{512 + 3}}) {
      auto x = random_bf16_values(m * x_stride, 1.0f, 92);
      std::vector<float> xs(m * w.k);
      for (int64_t r = 0; r < m; ++r) std::copy_n(x.begin() + r * x_stride, w.k, xs.begin() + r * w.k);
      std::vector<float> want(m * w.n);
      gemm_ref(xs.data(), w.k, w.w.data(), m, w.n, w.k, want.data(), w.n, false);
      const int64_t out_stride = w.n + 40;
      Tensor d_x = testing::device_copy(to_bf16(x), DType::kBF16);
      Tensor out = testing::device_poisoned(m * out_stride, DType::kF32);
      const auto scratch = scratch_for(m, w.n, w.k, cuda_ops::Fp8Path::kOwn);
      ASSERT_TRUE(cuda_ops::fp8_linear_forward(w.dev, d_x.raw(), x_stride, m, out.raw(), DType::kF32, out_stride, false,
                                               scratch.scratch(), cuda_ops::Fp8Path::kOwn).ok());
      std::vector<int64_t> rows(m);
      for (int64_t r = 0; r < m; ++r) rows[r] = r;
      auto got = read_rows(out, w.n, out_stride, rows);
      EXPECT_TRUE(close_to(got, want, 2e-3f, 1e-5f, w.n)) << "m=" << m << " x_stride=" << x_stride;
    }
  }
}

// Decode-kernel edge cases: an odd number of k blocks (a split ending in half
// a ring stage), a partial last k block (k % 128 == 16), rows that fill part
// of a warp (n = 200), several splits.
TEST_F(Fp8Gemm, OwnKernelsPartialBlocks) {
  for (auto [n, k] : {std::pair<int64_t, int64_t>{384, 640}, {200, 656}, {136, 1168}}) {
    Fp8Weight w = make_weight(n, k, 300 + n);
    for (int64_t m : {1, 7, 33, 64}) {
      Problem p = make_problem(w, m, 400 + m);
      for (DType dt : {DType::kF32, DType::kBF16})
        check_path(w, p, cuda_ops::Fp8Path::kOwn, false, dt,
                   "cuda_fp8 n=" + std::to_string(n) + " k=" + std::to_string(k) + " m=" + std::to_string(m));
    }
  }
}

// LinearOp: which backend serves which weight, its refusals, and a run
// through the op (the backend's own branch on m included).
TEST_F(Fp8Gemm, LinearOpDispatchAndRefusals) {
  Fp8Weight aligned = make_weight(1536, 7168, 5);
  Fp8Weight odd = make_weight(300, 200, 6);
  LinearOp op_aligned(&aligned.dev, false), op_odd(&odd.dev, false);
  EXPECT_TRUE(cuda_ops::linear_cublaslt_fp8_supports(op_aligned).ok());
  Status refused = cuda_ops::linear_cublaslt_fp8_supports(op_odd);
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("k=200"), std::string::npos) << refused.message();
  // n % 8, ceil(k/128) % 4.
  EXPECT_FALSE(cuda_ops::fp8_cublaslt_layout_supported(300, 512).ok());
  EXPECT_FALSE(cuda_ops::fp8_cublaslt_layout_supported(512, 640).ok());
  EXPECT_TRUE(cuda_ops::fp8_cublaslt_layout_supported(576, 7168).ok());
  // Other block sizes are the plain kernel's.
  LinearWeight blk64 = aligned.dev;
  blk64.block_n = blk64.block_k = 64;
  LinearOp op_blk64(&blk64, false);
  EXPECT_FALSE(cuda_ops::linear_cublaslt_fp8_supports(op_blk64).ok());
  EXPECT_FALSE(cuda_ops::linear_cuda_fp8_supports(op_blk64).ok());

  ASSERT_TRUE(op_aligned.select_backend(Device::kCuda).ok());
  EXPECT_EQ(op_aligned.backend(), "cublaslt_fp8");
  ASSERT_TRUE(op_odd.select_backend(Device::kCuda).ok());
  EXPECT_EQ(op_odd.backend(), "cuda_fp8");
  ASSERT_TRUE(op_blk64.select_backend(Device::kCuda).ok());
  EXPECT_EQ(op_blk64.backend(), "cuda_naive");

  for (int64_t m : {2, 300}) {
    for (auto* c : {&aligned, &odd}) {
      LinearOp op(&c->dev, true);
      ASSERT_TRUE(op.select_backend(Device::kCuda).ok());
      Problem p = make_problem(*c, m, 40 + m);
      Tensor in = p.d_x.view({m, c->k});
      Tensor out = testing::device_copy(p.acc0, DType::kF32).view({m, c->n});
      OpContext ctx;
      ctx.device = Device::kCuda;
      // Unreserved, the op refuses to run (its scratch is the step's).
      op.run(ctx, {in}, {out});
      EXPECT_EQ(ctx.error.code(), StatusCode::kFailedPrecondition) << ctx.error.to_string();
      ctx.error = ok_status();
      // Reserved and begun as the engine does.
      StepInputs si;
      si.token_ids.assign(m, 1);
      StepLimits limits;
      limits.max_tokens = m;
      limits.max_seqs = 1;
      limits.max_logits = 1;
      StepResources res;
      ASSERT_TRUE(res.reserve_ops({&op}, limits, Device::kCuda).ok());
      ctx.inputs = &si;
      ASSERT_TRUE(res.begin_step(ctx).ok());
      op.run(ctx, {in}, {out});
      ASSERT_TRUE(ctx.error.ok()) << ctx.error.to_string();
      auto got = read_rows(out, c->n, c->n, p.rows);
      const auto path = op.backend() == "cublaslt_fp8" ? cuda_ops::Fp8Path::kAuto : cuda_ops::Fp8Path::kOwn;
      std::vector<float> want(p.rows.size() * c->n);
      bool any_w8a8 = false;
      for (size_t i = 0; i < p.rows.size(); ++i) {
        const bool w8a8 = row_on_cublas(path, true, m, c->n, c->k, p.rows[i]);
        any_w8a8 |= w8a8;
        for (int64_t col = 0; col < c->n; ++col)
          want[i * c->n + col] = (w8a8 ? p.ref_w8a8 : p.ref_w8a16)[i * c->n + col] + p.acc0_rows[i * c->n + col];
      }
      EXPECT_TRUE(close_to(got, want, any_w8a8 ? 1e-2f : 2e-3f, 1e-5f, c->n)) << op.backend() << " m=" << m;
    }
  }
}

// What cuBLASLt accepts, for the supports() rules: m (row counts), the layout
// of the activation scales (leading dimension m or padded), weight scale rows
// (ceil(k/128) % 4), accumulate and output types. Prints one line per probe;
// fails only when cuBLASLt accepts a call and computes a wrong result under
// the layout this engine uses.
TEST_F(Fp8Gemm, CublasLtProbe) {
  auto probe = [&](int64_t m, int64_t n, int64_t k, int64_t scale_ld, bool pad_w_scales, DType out_dtype,
                   bool accumulate, bool engine_layout) {
    Fp8Weight w = make_weight(n, k, 1000 + m + n + k);
    Problem p = make_problem(w, m, 2000 + m);
    const int64_t groups = (k + 127) / 128, nb = (n + 127) / 128;
    Tensor xq = Tensor::empty({m * k}, DType::kU8, Device::kCuda);
    Tensor xs = testing::device_poisoned(groups * scale_ld + 64, DType::kF32);
    ASSERT_EQ(launch_fp8_act_quant(p.d_x.data<__nv_bfloat16>(), k, m, k, xq.data<uint8_t>(), k, xs.data<float>(), 1,
                                   scale_ld, engine_stream()),
              cudaSuccess);
    Tensor ws = w.dev.scale_inv;
    if (pad_w_scales) {
      const int64_t ld = (groups + 3) / 4 * 4;
      std::vector<float> padded(nb * ld, 0.0f);
      for (int64_t r = 0; r < nb; ++r) std::copy_n(w.scale.begin() + r * groups, groups, padded.begin() + r * ld);
      ws = testing::device_copy(padded, DType::kF32);
    }
    Tensor out = accumulate ? (out_dtype == DType::kF32 ? testing::device_copy(p.acc0, DType::kF32)
                                                        : testing::device_copy(to_bf16(p.acc0), DType::kBF16))
                            : testing::device_poisoned(m * n, out_dtype);
    Fp8CublasArgs a;
    a.xq = xq.data<uint8_t>();
    a.x_scale = xs.data<float>();
    a.w = static_cast<const uint8_t*>(w.dev.weight.raw());
    a.w_scale = ws.data<float>();
    a.out = out.raw();
    a.out_stride = n;
    a.out_dtype = out_dtype;
    a.m = m;
    a.n = n;
    a.k = k;
    a.accumulate = accumulate;
    Status s = gemm_fp8_cublaslt(a, engine_stream());
    std::string verdict;
    if (!s.ok()) {
      verdict = "refused: " + s.message();
    } else {
      auto got = read_rows(out, n, n, p.rows);
      std::vector<float> want = p.ref_w8a8;
      if (accumulate)
        for (size_t i = 0; i < want.size(); ++i) want[i] += p.acc0_rows[i];
      auto r = close_to(got, want, 1e-2f, out_dtype == DType::kBF16 ? 8e-3f : 1e-5f, n);
      verdict = r ? "ok" : std::string("WRONG ") + r.message();
      if (engine_layout) {
        EXPECT_TRUE(r) << "cuBLASLt accepted and miscomputed m=" << m << " n=" << n << " k=" << k;
      }
    }
    std::printf("cublaslt-probe m=%ld n=%ld k=%ld scale_ld=%ld w_scales=%s out=%s acc=%d: %s\n", long(m), long(n),
                long(k), long(scale_ld), pad_w_scales ? "padded" : "dense", dtype_name(out_dtype), int(accumulate),
                verdict.substr(0, 300).c_str());
  };
  // Row counts, with the engine's scale layout (leading dimension m).
  for (int64_t m : {1, 3, 8, 12, 16, 64, 129, 130, 132, 136, 1000})
    probe(m, 512, 1024, m, false, DType::kBF16, false, true);
  // Padded leading dimensions for the activation scales.
  for (int64_t m : {129, 130, 132}) {
    probe(m, 512, 1024, (m + 3) / 4 * 4, false, DType::kBF16, false, false);
    probe(m, 512, 1024, (m + 7) / 8 * 8, false, DType::kBF16, false, false);
  }
  // Weight scale rows: ceil(k/128) = 5 dense vs padded to 8; k = 200 (partial block).
  probe(256, 512, 640, 256, false, DType::kBF16, false, false);
  probe(256, 512, 640, 256, true, DType::kBF16, false, false);
  probe(256, 512, 208, 256, false, DType::kBF16, false, false);
  probe(256, 512, 208, 256, true, DType::kBF16, false, false);
  // n not a multiple of 128 / of 8.
  probe(256, 336, 1024, 256, false, DType::kBF16, false, false);
  probe(256, 300, 1024, 256, false, DType::kBF16, false, false);
  // Accumulate and f32 output.
  for (DType dt : {DType::kBF16, DType::kF32})
    for (bool acc : {false, true}) probe(256, 512, 1024, 256, false, dt, acc, true);
}

}  // namespace
}  // namespace nucleus::kernels
