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

#include <algorithm>
#include <mutex>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/logging.h"
#include "kernels/gemm/fp8_gemm.cuh"
#include "kernels/gemm/fp8_gemm_cublaslt.h"
#include "ops/linear_cuda.h"
#include "ops/op_cuda_check.h"

namespace nucleus::cuda_ops {

namespace {

constexpr int64_t kSplitPartialFloats = int64_t{8} << 20;  // at most 32 MB of split-K partial sums
constexpr int64_t kMaxPadBytes = int64_t{256} << 20;        // f32 scratch of the padded cuBLASLt path

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

// Where the parts of an Fp8LinearScratch lie in its workspace (byte offsets).
struct ScratchLayout {
  int64_t partial_floats = 0;
  size_t xq_off = 0, xq_bytes = 0, xs_off = 0, xs_bytes = 0, y_off = 0, y_bytes = 0, end = 0;
};

ScratchLayout scratch_layout(int64_t max_m, int64_t n, int64_t k, Fp8Path path) {
  ScratchLayout l;
  if (max_m <= 0) return l;
  if (path != Fp8Path::kCublas)
    l.partial_floats = std::min(kSplitPartialFloats, kernels::fp8_decode_split_partial_floats(max_m, n, k));
  size_t off = align256(static_cast<size_t>(l.partial_floats) * sizeof(float));
  // The cuBLASLt buffers of the largest call run_cublas makes for m <= max_m.
  const int64_t groups = (k + kernels::kFp8Block - 1) / kernels::kFp8Block;
  int64_t xq_rows = 0, y_rows = 0;
  // The largest buffers over m = 1..max_m, found at a few m instead of all
  // (this runs on every step): fp8_cublas_rows takes rows from every m past a
  // threshold (so the four largest m give the largest xq), and pads m < 4 and
  // the m whose padded rows stay within the copy limit, a prefix of m (so the
  // three smallest m and the last three below the limit give the largest y).
  const int64_t pad_limit = std::min(k / 8, kMaxPadBytes / std::max<int64_t>(1, 4 * n)) / 4 * 4;
  for (int64_t m : {int64_t{1}, int64_t{2}, int64_t{3}, max_m - 3, max_m - 2, max_m - 1, max_m, pad_limit - 3,
                    pad_limit - 2, pad_limit - 1}) {
    if (m < 1 || m > max_m) continue;
    const int64_t rows = fp8_cublas_rows(m, n, k, path);
    if (rows == 0) continue;
    const int64_t m_pad = (rows + kFp8CublasRowMultiple - 1) / kFp8CublasRowMultiple * kFp8CublasRowMultiple;
    xq_rows = std::max(xq_rows, m_pad);
    if (m_pad != rows) y_rows = std::max(y_rows, m_pad);
  }
  l.xq_off = off;
  l.xq_bytes = static_cast<size_t>(xq_rows * k);
  off = align256(off + l.xq_bytes);
  l.xs_off = off;
  l.xs_bytes = static_cast<size_t>(xq_rows * groups) * sizeof(float);
  off = align256(off + l.xs_bytes);
  l.y_off = off;
  l.y_bytes = static_cast<size_t>(y_rows * n) * sizeof(float);
  l.end = align256(off + l.y_bytes);
  return l;
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

Status run_own(const kernels::Fp8GemmArgs& a, const Fp8LinearScratch& scratch, cudaStream_t stream) {
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_fp8_gemm(a, scratch.split, stream));
  return ok_status();
}

// Whether `scratch` holds run_cublas's buffers for rows [0, m).
bool cublas_scratch_fits(const Fp8LinearScratch& scratch, int64_t m, int64_t n, int64_t k) {
  const int64_t m_pad = (m + kFp8CublasRowMultiple - 1) / kFp8CublasRowMultiple * kFp8CublasRowMultiple;
  const int64_t groups = (k + kernels::kFp8Block - 1) / kernels::kFp8Block;
  return scratch.xq && scratch.xq_bytes >= static_cast<size_t>(m_pad * k) && scratch.xs &&
         scratch.xs_bytes >= static_cast<size_t>(m_pad * groups) * sizeof(float) &&
         (m_pad == m || (scratch.y && scratch.y_bytes >= static_cast<size_t>(m_pad * n) * sizeof(float)));
}

// cuBLASLt on rows [0, a.m): quantize, then GEMM. With a.m % 4 != 0 the
// GEMM runs at the next multiple of 4 (zero rows) into the f32 scratch, whose
// first a.m rows are then stored. Not OK when cuBLASLt refuses. Requires
// cublas_scratch_fits.
Status run_cublas(const kernels::Fp8GemmArgs& a, const Fp8LinearScratch& scratch, cudaStream_t stream) {
  const int64_t m_pad = (a.m + kFp8CublasRowMultiple - 1) / kFp8CublasRowMultiple * kFp8CublasRowMultiple;
  const bool padded = m_pad != a.m;
  NUCLEUS_OP_CUDA_CHECK(kernels::launch_fp8_act_quant(a.x, a.x_stride, a.m, a.k, scratch.xq, a.k, scratch.xs, 1,
                                                   m_pad, stream, m_pad));
  kernels::Fp8CublasArgs c;
  c.xq = scratch.xq;
  c.x_scale = scratch.xs;
  c.w = a.w;
  c.w_scale = a.scale_inv;
  c.out = padded ? static_cast<void*>(scratch.y) : a.out;
  c.out_stride = padded ? a.n : a.out_stride;
  c.out_dtype = padded ? DType::kF32 : a.out_dtype;
  c.m = m_pad;
  c.n = a.n;
  c.k = a.k;
  c.accumulate = padded ? false : a.accumulate;
  NUCLEUS_RETURN_IF_ERROR(kernels::gemm_fp8_cublaslt(c, stream));
  if (padded)
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_fp8_store_rows(scratch.y, a.m, a.n, a.out, a.out_dtype, a.out_stride,
                                                      a.accumulate, stream));
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

size_t fp8_linear_scratch_bytes(int64_t max_m, int64_t n, int64_t k, Fp8Path path) {
  return scratch_layout(max_m, n, k, path).end;
}

int64_t fp8_linear_scratch_counters(int64_t n) { return kernels::fp8_decode_split_counters(n); }

Fp8LinearScratch fp8_linear_scratch_carve(void* base, size_t bytes, int64_t max_m, int64_t n, int64_t k,
                                          Fp8Path path, int* counters, int64_t num_counters) {
  Fp8LinearScratch s;
  if (base == nullptr) return s;
  const ScratchLayout l = scratch_layout(max_m, n, k, path);
  auto* b = static_cast<uint8_t*>(base);
  const size_t partial_bytes = static_cast<size_t>(l.partial_floats) * sizeof(float);
  if (counters && l.partial_floats > 0) {  // a short workspace takes fewer splits
    s.split.partial = reinterpret_cast<float*>(b);
    s.split.partial_floats = static_cast<int64_t>(std::min(partial_bytes, bytes) / sizeof(float));
    s.split.counters = counters;
    s.split.num_counters = num_counters;
  }
  if (l.xq_bytes > 0 && l.xs_off + l.xs_bytes <= bytes) {
    s.xq = b + l.xq_off;
    s.xq_bytes = l.xq_bytes;
    s.xs = reinterpret_cast<float*>(b + l.xs_off);
    s.xs_bytes = l.xs_bytes;
  }
  if (l.y_bytes > 0 && l.y_off + l.y_bytes <= bytes) {
    s.y = reinterpret_cast<float*>(b + l.y_off);
    s.y_bytes = l.y_bytes;
  }
  return s;
}

Status Fp8LinearScratchOwner::create(int64_t max_m, int64_t n, int64_t k, Fp8Path path, Fp8LinearScratchOwner* owner) {
  const size_t bytes = fp8_linear_scratch_bytes(max_m, n, k, path);
  const int64_t counters = fp8_linear_scratch_counters(n);
  Fp8LinearScratchOwner o;
  if (bytes > 0) {
    NUCLEUS_ASSIGN_OR_RETURN(o.buffer_, try_empty({static_cast<int64_t>(bytes)}, DType::kU8, Device::kCuda,
                                                  "FP8 linear scratch"));
  }
  NUCLEUS_ASSIGN_OR_RETURN(o.counters_, try_empty({counters}, DType::kI32, Device::kCuda, "FP8 linear split counters"));
  NUCLEUS_OP_CUDA_CHECK(cudaMemset(o.counters_.raw(), 0, counters * sizeof(int)));
  o.scratch_ = fp8_linear_scratch_carve(bytes > 0 ? o.buffer_.raw() : nullptr, bytes, max_m, n, k, path,
                                        o.counters_.data<int>(), counters);
  *owner = std::move(o);
  return ok_status();
}

Status fp8_linear_forward(const LinearWeight& w, const void* x, int64_t x_stride, int64_t m, void* out,
                          DType out_dtype, int64_t out_stride, bool accumulate, const Fp8LinearScratch& scratch,
                          Fp8Path path) {
  NUCLEUS_RETURN_IF_ERROR(fp8_linear_supported(w));
  if (m == 0) return ok_status();
  if (path == Fp8Path::kCublas) NUCLEUS_RETURN_IF_ERROR(fp8_cublaslt_layout_supported(w.out_features, w.in_features));
  cudaStream_t stream = cuda::context().stream;
  kernels::Fp8GemmArgs a = gemm_args(w, x, x_stride, m, out, out_dtype, out_stride, accumulate);
  int64_t rows = fp8_cublas_rows(m, w.out_features, w.in_features, path);
  if (rows > 0 && !cublas_scratch_fits(scratch, rows, w.out_features, w.in_features)) {
    if (path == Fp8Path::kCublas)
      return resource_exhausted("FP8 linear: no scratch for cuBLASLt's activations at " + std::to_string(m) +
                                " rows (reserve the step for them)");
    rows = 0;  // kAuto: the own kernels, which need no scratch
  }
  if (rows > 0) {
    kernels::Fp8GemmArgs head = a;
    head.m = rows;
    Status s = run_cublas(head, scratch, stream);
    if (s.ok()) {
      if (rows < m) {  // the tail rows
        kernels::Fp8GemmArgs tail = a;
        tail.m = m - rows;
        tail.x = a.x + rows * a.x_stride;
        tail.out = static_cast<char*>(a.out) + rows * a.out_stride * static_cast<int64_t>(dtype_size(out_dtype));
        return run_own(tail, scratch, stream);
      }
      return ok_status();
    }
    if (path == Fp8Path::kCublas) return s;
    static std::once_flag warned;
    std::call_once(warned, [&] { NUCLEUS_LOG_WARN("{}: FP8 cuBLASLt refused, using the own kernels: {}", w.name,
                                                  s.message()); });
  }
  return run_own(a, scratch, stream);
}

Status linear_cuda_fp8_supports(const LinearOp& op) { return fp8_linear_supported(op.weight()); }

Status linear_cublaslt_fp8_supports(const LinearOp& op) {
  NUCLEUS_RETURN_IF_ERROR(fp8_linear_supported(op.weight()));
  return fp8_cublaslt_layout_supported(op.weight().out_features, op.weight().in_features);
}

StatusOr<Fp8LinearScratch> linear_fp8_op_scratch(LinearOp& op, const OpContext& ctx, Fp8Path path) {
  const LinearWeight& w = op.weight();
  if (op.reserved_rows() == 0 || !op.split_counters().defined())
    return failed_precondition(w.name + ": " + op.backend() +
                               " linear run before its reservation (StepResources::reserve_ops)");
  return fp8_linear_scratch_carve(ctx.workspace.data, ctx.workspace.bytes, op.reserved_rows(), w.out_features,
                                  w.in_features, path, op.split_counters().data<int>(),
                                  op.split_counters().numel());
}

namespace {
void run_linear(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out, Fp8Path path) {
  const LinearWeight& w = op.weight();
  NUCLEUS_CHECK(in[0].dtype() == DType::kBF16, "{}: FP8 linear input dtype {} (needs BF16)", w.name,
                dtype_name(in[0].dtype()));
  StatusOr<Fp8LinearScratch> scratch = linear_fp8_op_scratch(op, ctx, path);
  if (!scratch.ok()) return ctx.fail(scratch.status());
  Status s = fp8_linear_forward(w, in[0].raw(), in[0].row_numel(), in[0].dim(0), out[0].raw(), out[0].dtype(),
                                out[0].row_numel(), op.accumulate(), *scratch, path);
  if (!s.ok()) ctx.fail(s.with_context(w.name));  // cuBLASLt refusing its plan at run time
}
}  // namespace

size_t linear_cuda_fp8_workspace(const LinearOp& op, const StepLimits& limits) {
  return fp8_linear_scratch_bytes(limits.max_tokens, op.weight().out_features, op.weight().in_features,
                                  Fp8Path::kOwn);
}

size_t linear_cublaslt_fp8_workspace(const LinearOp& op, const StepLimits& limits) {
  return fp8_linear_scratch_bytes(limits.max_tokens, op.weight().out_features, op.weight().in_features,
                                  Fp8Path::kAuto);
}

Status linear_fp8_reserve(LinearOp& op, const StepLimits& limits, Device device) {
  const int64_t counters = fp8_linear_scratch_counters(op.weight().out_features);
  if (!op.split_counters().defined() || op.split_counters().numel() < counters) {
    NUCLEUS_ASSIGN_OR_RETURN(op.split_counters(),
                             try_empty({counters}, DType::kI32, device, op.weight().name + " split counters"));
    NUCLEUS_OP_CUDA_CHECK(cudaMemset(op.split_counters().raw(), 0, counters * sizeof(int)));
  }
  op.set_reserved_rows(limits.max_tokens);
  return ok_status();
}

void linear_cuda_fp8(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  run_linear(op, ctx, in, out, Fp8Path::kOwn);
}

void linear_cublaslt_fp8(LinearOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  run_linear(op, ctx, in, out, Fp8Path::kAuto);
}

}  // namespace nucleus::cuda_ops
