// FP8 block-scaled linear layers on CUDA: the "cublaslt_fp8" and "cuda_fp8"
// backends of LinearOp and the FP8 path of linear_forward.
//
// cuda_fp8: own kernels (W8A16: bf16 activations, exact dequantization in
//   registers): decode kernel for m <= 64, tiled tensor-core kernel otherwise;
//   any n, k.
// cublaslt_fp8: rows quantized per 1x128 group (act_quant) and cuBLASLt's FP8
//   GEMM with VEC128 activation and BLK128x128 weight scales (W8A8, as
//   DeepSeek-V3's reference inference) for the rows fp8_cublas_rows() gives
//   it: none for m <= 8 on small weights (the own kernels are faster there,
//   docs/perf.md). cuBLASLt needs m % 4 == 0: other m run at the next
//   multiple of 4 (zero rows) into an f32 scratch that is then copied out,
//   unless that copy would move more bytes than reading the weight again, in
//   which case the last m % 4 rows go to the own kernels.
#include <cuda_runtime_api.h>

#include <mutex>
#include <vector>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/logging.h"
#include "kernels/gemm/fp8_gemm.cuh"
#include "kernels/gemm/fp8_gemm_cublaslt.h"
#include "ops/linear_cuda.h"
#include "ops/op_cuda_check.h"
#include "ops/split_workspace_cuda.h"

namespace nucleus::cuda_ops {

namespace {

constexpr int64_t kSplitPartialFloats = int64_t{8} << 20;  // 32 MB of split-K partial sums
constexpr int64_t kSplitCounters = 4096;
constexpr int64_t kMaxPadBytes = int64_t{256} << 20;  // f32 scratch of the padded cuBLASLt path

// Device scratch shared by all FP8 linears on the engine stream. Buffers only
// grow, and a replaced buffer stays allocated: a captured CUDA graph may still
// point at it.
struct Fp8Scratch {
  std::mutex mu;
  kernels::Fp8SplitWorkspace split;
  void* xq = nullptr;  // activation bytes for cuBLASLt
  size_t xq_bytes = 0;
  void* xs = nullptr;  // activation scales for cuBLASLt
  size_t xs_bytes = 0;
  void* y = nullptr;  // f32 output of the padded cuBLASLt path
  size_t y_bytes = 0;
  std::vector<void*> retired;
};

Fp8Scratch& scratch() {
  // Never freed: graphs may hold its pointers. One per device (one thread per GPU under tensor parallelism).
  static Fp8Scratch* s[cuda::kMaxDevices] = {};
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  Fp8Scratch*& mine = s[cuda::thread_device()];
  if (!mine) mine = new Fp8Scratch();
  return *mine;
}

void check_not_capturing(cudaStream_t stream, const char* what) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  NUCLEUS_OP_CUDA_CHECK(cudaStreamIsCapturing(stream, &st));
  NUCLEUS_CHECK(st == cudaStreamCaptureStatusNone,
                "FP8 linear: {} must be allocated outside CUDA-graph capture; run this shape eagerly once first",
                what);
}

// `buf` of at least `need` bytes (grown, the old one retired); null when
// cudaMalloc fails (*error then says why; the old buffer is kept).
void* grow(Fp8Scratch& s, void*& buf, size_t& cap, size_t need, cudaStream_t stream, const char* what,
           Status* error) {
  if (need <= cap) return buf;
  check_not_capturing(stream, what);
  size_t bytes = std::max(need, cap * 2);
  bytes = (bytes + 255) / 256 * 256;
  void* p = nullptr;
  if (cudaError_t e = cudaMalloc(&p, bytes); e != cudaSuccess) {
    cudaGetLastError();  // not sticky
    *error = resource_exhausted(std::string("FP8 linear: cudaMalloc of ") + std::to_string(bytes) + " bytes for " +
                                what + " failed: " + cudaGetErrorString(e));
    return nullptr;
  }
  if (buf) s.retired.push_back(buf);
  buf = p;
  cap = bytes;
  return buf;
}

// The split-K workspace, allocated on first use; null when that fails
// (*error then says why).
const kernels::Fp8SplitWorkspace* split_workspace(Fp8Scratch& s, cudaStream_t stream, Status* error) {
  if (s.split.partial == nullptr) {
    *error = allocate_split_workspace(s.split, kSplitPartialFloats, kSplitCounters, stream,
                                      "the FP8 linear's split-K workspace");
    if (!error->ok()) return nullptr;
  }
  return &s.split;
}

kernels::Fp8GemmArgs gemm_args(const LinearWeight& w, const void* x, int64_t x_stride, int64_t m, void* out,
                               DType out_dtype, int64_t out_stride, bool accumulate) {
  kernels::Fp8GemmArgs a;
  a.x = static_cast<const __nv_bfloat16*>(x);
  a.x_stride = x_stride;
  a.w = static_cast<const uint8_t*>(w.weight.raw());
  a.scale_inv = w.scale_inv.data<float>();
  a.out = out;
  a.out_stride = out_stride;
  a.out_dtype = out_dtype;
  a.m = m;
  a.n = w.out_features;
  a.k = w.in_features;
  a.accumulate = accumulate;
  return a;
}

Status run_own(const kernels::Fp8GemmArgs& a, cudaStream_t stream) {
  Fp8Scratch& s = scratch();
  std::lock_guard<std::mutex> lock(s.mu);
  Status error;
  const kernels::Fp8SplitWorkspace* ws = split_workspace(s, stream, &error);
  if (!ws) return error;
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_fp8_gemm(a, *ws, stream));
  return ok_status();
}

// cuBLASLt on rows [0, a.m): quantize, then GEMM. With a.m % 4 != 0 the
// GEMM runs at the next multiple of 4 (zero rows) into the f32 scratch, whose
// first a.m rows are then stored. Not OK when cuBLASLt refuses.
Status run_cublas(const kernels::Fp8GemmArgs& a, cudaStream_t stream) {
  Fp8Scratch& s = scratch();
  std::lock_guard<std::mutex> lock(s.mu);
  const int64_t m_pad = (a.m + kFp8CublasRowMultiple - 1) / kFp8CublasRowMultiple * kFp8CublasRowMultiple;
  const bool padded = m_pad != a.m;
  const int64_t groups = (a.k + kernels::kFp8Block - 1) / kernels::kFp8Block;
  Status error;
  auto* xq = static_cast<uint8_t*>(grow(s, s.xq, s.xq_bytes, static_cast<size_t>(m_pad * a.k), stream,
                                        "the activation buffer", &error));
  if (!xq) return error;
  auto* xs = static_cast<float*>(grow(s, s.xs, s.xs_bytes, static_cast<size_t>(m_pad * groups) * sizeof(float),
                                      stream, "the activation scales", &error));
  if (!xs) return error;
  float* y = padded ? static_cast<float*>(grow(s, s.y, s.y_bytes, static_cast<size_t>(m_pad * a.n) * sizeof(float),
                                               stream, "the padded output", &error))
                    : nullptr;
  if (padded && !y) return error;
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_fp8_act_quant(a.x, a.x_stride, a.m, a.k, xq, a.k, xs, 1, m_pad, stream, m_pad));
  kernels::Fp8CublasArgs c;
  c.xq = xq;
  c.x_scale = xs;
  c.w = a.w;
  c.w_scale = a.scale_inv;
  c.out = padded ? static_cast<void*>(y) : a.out;
  c.out_stride = padded ? a.n : a.out_stride;
  c.out_dtype = padded ? DType::kF32 : a.out_dtype;
  c.m = m_pad;
  c.n = a.n;
  c.k = a.k;
  c.accumulate = padded ? false : a.accumulate;
  NUCLEUS_RETURN_IF_ERROR(kernels::gemm_fp8_cublaslt(c, stream));
  if (padded)
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_fp8_store_rows(y, a.m, a.n, a.out, a.out_dtype, a.out_stride, a.accumulate,
                                                      stream));
  return ok_status();
}

}  // namespace

Status fp8_linear_supported(const LinearWeight& w) {
  if (!w.fp8())
    return unsupported(std::string("weight dtype ") +
                       (w.weight.defined() ? dtype_name(w.weight.dtype()) : "(none)") + " (needs F8_E4M3)");
  if (w.block_n != kernels::kFp8Block || w.block_k != kernels::kFp8Block)
    return unsupported("FP8 block " + std::to_string(w.block_n) + "x" + std::to_string(w.block_k) +
                       " (needs 128x128)");
  if (!w.scale_inv.defined() || w.scale_inv.dtype() != DType::kF32)
    return unsupported("FP8 weight without f32 scale_inv");
  return ok_status();
}

Status fp8_cublaslt_layout_supported(int64_t n, int64_t k) {
  if (k % 16 != 0) return unsupported("k=" + std::to_string(k) + " not a multiple of 16 (FP8 rows 16-byte aligned)");
  if (n % 8 != 0) return unsupported("n=" + std::to_string(n) + " not a multiple of 8 (output alignment)");
  if ((k + 127) / 128 % 4 != 0)
    return unsupported("ceil(k/128)=" + std::to_string((k + 127) / 128) +
                       " not a multiple of 4 (cuBLASLt reads BLK128x128 scale rows padded to 4)");
  return ok_status();
}

int64_t fp8_cublas_rows(int64_t m, int64_t n, int64_t k, Fp8Path path) {
  if (m <= 0 || path == Fp8Path::kOwn || !fp8_cublaslt_layout_supported(n, k).ok()) return 0;
  if (path == Fp8Path::kAuto && m <= kFp8OwnMaxRows && n * k <= kFp8OwnMaxWeightBytes) return 0;
  const int64_t head = m - m % kFp8CublasRowMultiple;
  if (head == m) return m;
  const int64_t m_pad = head + kFp8CublasRowMultiple;
  const int64_t pad_bytes = m_pad * n * static_cast<int64_t>(sizeof(float));
  // Padding costs the f32 scratch's write and read; the tail, a second read
  // of the weight.
  if (head == 0 || (2 * pad_bytes <= n * k && pad_bytes <= kMaxPadBytes)) return m;
  return head;
}

Status fp8_linear_forward(const LinearWeight& w, const void* x, int64_t x_stride, int64_t m, void* out,
                          DType out_dtype, int64_t out_stride, bool accumulate, Fp8Path path) {
  NUCLEUS_RETURN_IF_ERROR(fp8_linear_supported(w));
  if (m == 0) return ok_status();
  if (path == Fp8Path::kCublas) NUCLEUS_RETURN_IF_ERROR(fp8_cublaslt_layout_supported(w.out_features, w.in_features));
  cudaStream_t stream = cuda::context().stream;
  kernels::Fp8GemmArgs a = gemm_args(w, x, x_stride, m, out, out_dtype, out_stride, accumulate);
  const int64_t rows = fp8_cublas_rows(m, w.out_features, w.in_features, path);
  if (rows > 0) {
    kernels::Fp8GemmArgs head = a;
    head.m = rows;
    Status s = run_cublas(head, stream);
    if (s.ok()) {
      if (rows < m) {  // the tail rows
        kernels::Fp8GemmArgs tail = a;
        tail.m = m - rows;
        tail.x = a.x + rows * a.x_stride;
        tail.out = static_cast<char*>(a.out) + rows * a.out_stride * static_cast<int64_t>(dtype_size(out_dtype));
        return run_own(tail, stream);
      }
      return ok_status();
    }
    if (path == Fp8Path::kCublas) return s;
    static std::once_flag warned;
    std::call_once(warned, [&] { NUCLEUS_LOG_WARN("{}: FP8 cuBLASLt refused, using the own kernels: {}", w.name,
                                                  s.message()); });
  }
  return run_own(a, stream);
}

Status linear_cuda_fp8_supports(const LinearOp& op) { return fp8_linear_supported(op.weight()); }

Status linear_cublaslt_fp8_supports(const LinearOp& op) {
  NUCLEUS_RETURN_IF_ERROR(fp8_linear_supported(op.weight()));
  return fp8_cublaslt_layout_supported(op.weight().out_features, op.weight().in_features);
}

namespace {
void run_linear(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out, Fp8Path path) {
  const LinearWeight& w = op.weight();
  NUCLEUS_CHECK(in[0].dtype() == DType::kBF16, "{}: FP8 linear input dtype {} (needs BF16)", w.name,
                dtype_name(in[0].dtype()));
  Status s = fp8_linear_forward(w, in[0].raw(), in[0].row_numel(), in[0].dim(0), out[0].raw(), out[0].dtype(),
                                out[0].row_numel(), op.accumulate(), path);
  if (!s.ok()) ctx.fail(s.with_context(w.name));  // a scratch allocation or cuBLASLt plan failing
}
}  // namespace

void linear_cuda_fp8(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  run_linear(op, ctx, in, out, Fp8Path::kOwn);
}

void linear_cublaslt_fp8(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  run_linear(op, ctx, in, out, Fp8Path::kAuto);
}

}  // namespace nucleus::cuda_ops
