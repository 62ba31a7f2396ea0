// The mla_decode CUDA backends ("nucleus", "flashinfer", "cuda_naive")
// against the CPU reference mla_attention_absorbed_ref on the paged latent
// cache: batches 1..129, contexts 1..70000, 16 and 128 heads (and 4, the tiny
// models), block sizes 1, 16 and 64, random block tables, bf16 and FP8
// kv_b_proj; rows given as a list (mixed prefill/decode steps) must leave the
// other rows untouched; forced-absorbed prefill rows attend causally.
//
// Tolerance: inputs are bf16 and the reference computes in f32 on the same
// bf16 values; the GPU rounds q_lat, the probabilities and o_lat to bf16 and
// the output to bf16, so we require ||got - want|| / ||want|| <= 1e-2 and
// every element within 3e-2 * max|want| (outputs start poisoned with 3.4e38).
// The hand-over to a decode program (the op's splits merged and W_UV applied
// by kernels/mono's attention output stages) is held to the same tolerance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <random>

#include "core/cuda/context.h"
#include "core/device.h"
#include "gpu_test_util.h"
#include "test_util.h"
#include "graph/device_inputs.h"
#include "graph/step_resources.h"
#include "kernels/gemm/gemm_ref.h"
#include "kernels/mla/flashinfer_mla.cuh"
#include "kernels/mla/mla_attention_ref.h"
#include "kernels/common/device_sms.h"
#include "kernels/mono/mono_kernel.cuh"
#include "kernels/mono/mono_program_ref.h"
#include "ops/mla_decode.h"
#include "ops/mla_decode_cuda.h"

namespace nucleus {
namespace {

using testing::device_copy;
using testing::device_poisoned;
using testing::from_bf16;
using testing::host_copy;
using testing::random_bf16_values;
using testing::to_bf16;

constexpr int kNope = 128, kRope = 64, kVHead = 128, kLora = 512, kLatent = 576;
constexpr float kScale = 0.135234f;  // DeepSeek-V3's softmax scale (given, never derived)

struct Case {
  int batch;       // sequences
  int context;     // keys of the last row of each sequence (context + own row)
  int heads;
  int block_size;
  bool fp8 = false;
  int query_len = 1;     // rows per sequence (> 1: prefill rows)
  bool vary = false;     // per-sequence contexts vary in [1, context]
  int prefill_every = 0; // every n-th sequence is a 5-row prefill (auto mode: rows list)
};

std::string name(const Case& c) {
  return "b" + std::to_string(c.batch) + " ctx" + std::to_string(c.context) + " h" + std::to_string(c.heads) +
         " bs" + std::to_string(c.block_size) + (c.fp8 ? " fp8" : "") +
         (c.query_len > 1 ? " q" + std::to_string(c.query_len) : "") + (c.vary ? " vary" : "") +
         (c.prefill_every ? " mixed" : "");
}

// One step's inputs, cache and weights on both sides.
struct Problem {
  kernels::MlaDims dims;
  AttentionMode mode = AttentionMode::kAbsorbed;
  StepInputs si;
  std::vector<int32_t> keys;       // per sequence: keys of its last row
  std::vector<uint16_t> cache_h;   // [slots, 576] bf16
  std::vector<float> q_h;          // [T, H * 192] (bf16 values)
  std::vector<float> w_h;          // kv_b [H * 256, 512] f32 (dequantized)
  LinearWeight w_dev;
  KvCache kv;
  Tensor q_dev;
  int block_size = 0;
};

Problem make_problem(const Case& c, uint64_t seed) {
  Problem p;
  std::mt19937_64 rng(seed);
  p.dims = {c.heads, kNope, kRope, kVHead, kLora, kScale};
  p.block_size = c.block_size;
  const int B = c.batch;
  // Sequence s: query_len rows (5 when a mixed step's prefill), `keys` total keys.
  std::vector<int32_t> qlen(B);
  for (int s = 0; s < B; ++s) {
    qlen[s] = c.prefill_every && s % c.prefill_every == 1 ? 5 : c.query_len;
    int k = c.vary ? 1 + static_cast<int>(rng() % c.context) : c.context;
    p.keys.push_back(std::max(k, qlen[s]));
  }
  if (c.prefill_every) p.mode = AttentionMode::kAuto;
  int max_blocks = 0, total_blocks = 0;
  for (int s = 0; s < B; ++s) {
    const int nb = (p.keys[s] + c.block_size - 1) / c.block_size;
    max_blocks = std::max(max_blocks, nb);
    total_blocks += nb;
  }
  const int num_blocks = total_blocks + 3;  // a few never used
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  StepInputs& si = p.si;
  si.max_blocks_per_seq = max_blocks;
  si.block_tables.assign(static_cast<size_t>(B) * max_blocks, -1);
  si.query_start.push_back(0);
  int next = 0;
  for (int s = 0; s < B; ++s) {
    const int nb = (p.keys[s] + c.block_size - 1) / c.block_size;
    for (int b = 0; b < nb; ++b) si.block_tables[static_cast<size_t>(s) * max_blocks + b] = perm[next++];
    si.context_lens.push_back(p.keys[s] - qlen[s]);
    for (int j = 0; j < qlen[s]; ++j) {
      si.token_ids.push_back(1);
      si.positions.push_back(si.context_lens[s] + j);
      si.slot_mapping.push_back(-1);
    }
    si.query_start.push_back(si.query_start.back() + qlen[s]);
  }
  const int64_t T = si.num_tokens(), H = c.heads;
  // Cache, q and kv_b values (scaled so that the softmax is far from flat).
  const int64_t slots = static_cast<int64_t>(num_blocks) * c.block_size;
  p.cache_h = to_bf16(random_bf16_values(slots * kLatent, 1.0f, seed + 1));
  p.q_h = random_bf16_values(T * H * (kNope + kRope), 2.0f, seed + 2);
  const int64_t wn = H * (kNope + kVHead);
  if (c.fp8) {
    std::vector<uint8_t> q8(wn * kLora);
    auto qf = random_bf16_values(wn * kLora, 400.0f, seed + 3);
    for (size_t i = 0; i < q8.size(); ++i) q8[i] = f32_to_fp8e4m3(qf[i]);
    const int64_t nb = (wn + 127) / 128, kb = kLora / 128;
    std::vector<float> sc(nb * kb);
    for (auto& x : sc) x = 1.5e-4f * (1.0f + static_cast<float>(rng() % 100) / 100.0f);
    p.w_h.resize(wn * kLora);
    kernels::dequantize_fp8_block_ref(q8.data(), sc.data(), wn, kLora, 128, 128, p.w_h.data());
    p.w_dev.weight = device_copy(q8, DType::kF8E4M3);
    p.w_dev.scale_inv = device_copy(sc, DType::kF32);
    p.w_dev.block_n = p.w_dev.block_k = 128;
  } else {
    p.w_h = random_bf16_values(wn * kLora, 0.1f, seed + 3);
    p.w_dev.weight = device_copy(to_bf16(p.w_h), DType::kBF16);
  }
  p.w_dev.out_features = wn;
  p.w_dev.in_features = kLora;
  p.kv.num_layers = 1;
  p.kv.num_blocks = num_blocks;
  p.kv.block_size = c.block_size;
  p.kv.width = kLatent;
  p.kv.data = device_copy(p.cache_h, DType::kBF16);
  p.q_dev = device_copy(to_bf16(p.q_h), DType::kBF16);
  return p;
}

// Reference output [T, H * 128], NaN on the rows the op does not serve.
std::vector<float> reference(const Problem& p) {
  const StepInputs& si = p.si;
  const int64_t H = p.dims.num_heads, T = si.num_tokens(), q_stride = H * (kNope + kRope);
  std::vector<float> out(T * H * kVHead, std::nanf(""));
  std::vector<float> latent;
  for (int64_t s = 0; s < si.num_seqs(); ++s) {
    const int32_t nq = si.query_len(s);
    if (!serves_sequence(p.mode, true, nq)) continue;
    const int64_t n = p.keys[s];
    latent.resize(n * kLatent);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = static_cast<int64_t>(si.block_tables[s * si.max_blocks_per_seq + j / p.block_size]) *
                               p.block_size + j % p.block_size;
      for (int c = 0; c < kLatent; ++c) latent[j * kLatent + c] = bf16_to_f32(p.cache_h[slot * kLatent + c]);
    }
    const int64_t r0 = si.query_start[s];
    kernels::mla_attention_absorbed_ref(p.dims, p.q_h.data() + r0 * q_stride, q_stride, nq, si.context_lens[s],
                                        latent.data(), p.w_h.data(), out.data() + r0 * H * kVHead, H * kVHead,
                                        nullptr);
  }
  return out;
}

const Backend<MlaDecodeAttentionOp>* find_backend(const std::string& name) {
  for (const auto& b : MlaDecodeAttentionOp::backends())
    if (b.device == Device::kCuda && name == b.name) return &b;
  return nullptr;
}

// One step of `op` on `p` as the engine runs it (the step's workspace and
// plans, device inputs), with scratch of `scratch_rows` rows; the output
// starts poisoned.
struct OpStep {
  StepResources res;
  DeviceInputUploader uploader;
  DeviceStepInputs dev;
  OpContext ctx;
  Tensor out, q_lat, o_lat;
  OpStep(MlaDecodeAttentionOp& op, Problem& p, int64_t scratch_rows) {
    NUCLEUS_CHECK_OK(res.reserve_ops({&op}, StepLimits{}, Device::kCuda));
    const int64_t H = p.dims.num_heads, T = p.si.num_tokens();
    out = device_poisoned(T * H * kVHead, DType::kBF16).view({T, H * kVHead});
    q_lat = device_poisoned(scratch_rows * H * kLora, DType::kF32).view({scratch_rows, H * kLora});
    o_lat = device_poisoned(scratch_rows * H * kLora, DType::kF32).view({scratch_rows, H * kLora});
    dev = uploader.upload(p.si);
    ctx.device = Device::kCuda;
    ctx.stream = cuda::context().stream;
    ctx.inputs = &p.si;
    ctx.dev = &dev;
    ctx.kv_cache = &p.kv;
    Tensor q = p.q_dev.view({T, H * (kNope + kRope)});
    NUCLEUS_CHECK_OK(res.begin_step(ctx));  // grows the workspace to this step
    op.run(ctx, {q}, {out, q_lat, o_lat});
    NUCLEUS_CHECK_OK(ctx.error);
  }
};

// Runs backend `name` on `p` (scratch of `scratch_rows` rows); the output
// starts poisoned. Empty when the backend refuses (reason in *why).
std::vector<float> run_backend(const std::string& name, Problem& p, int64_t scratch_rows, std::string* why) {
  const Backend<MlaDecodeAttentionOp>* b = find_backend(name);
  if (!b) {
    *why = "no backend " + name;
    return {};
  }
  MlaDecodeAttentionOp op(0, &p.w_dev, p.dims, p.mode);
  Status s = op.use_backend(*b);
  if (!s.ok()) {
    *why = s.message();
    return {};
  }
  OpStep step(op, p, scratch_rows);
  return from_bf16(host_copy<uint16_t>(step.out));
}

// The nucleus backend with its output left to a decode program
// (MlaDecodeAttentionOp::set_output_in_program_rows, as NUCLEUS_DECODE_PROGRAM_ATTN_OUTPUT
// sets it): the op must leave `out` untouched, and the program's merge and
// W_UV (kernels/mono attention_output_stages), reading the partials where
// mla_decode_nucleus_split_plan says they are, must give the op's output.
std::vector<float> run_handed_over(Problem& p) {
  const Backend<MlaDecodeAttentionOp>* b = find_backend("nucleus");
  NUCLEUS_CHECK(b != nullptr, "no nucleus backend");
  MlaDecodeAttentionOp op(0, &p.w_dev, p.dims, p.mode);
  op.set_output_in_program_rows(kernels::mono::kMaxWidth);
  NUCLEUS_CHECK_OK(op.use_backend(*b));
  const int64_t H = p.dims.num_heads, T = p.si.num_tokens(), W = kernels::mono::kMaxWidth;
  OpStep step(op, p, W);
  const Tensor& out = step.out;
  const Tensor& o_lat = step.o_lat;
  const OpContext& ctx = step.ctx;
  const DeviceStepInputs& dev = step.dev;
  for (float v : from_bf16(host_copy<uint16_t>(out)))
    if (v != bf16_to_f32(0x7f7f)) {
      ADD_FAILURE() << "the op wrote its output although a program takes it over";
      break;
    }
  // The program's part, as moe_program_cuda builds it.
  const cuda_ops::MlaDecodeSplitPlan plan = cuda_ops::mla_decode_nucleus_split_plan(op, T, ctx.workspace.data);
  Tensor merged = device_poisoned(W * H * kLora, DType::kBF16);
  kernels::mono::AttentionOutputChain c;
  c.num_heads = static_cast<int32_t>(H);
  c.kv_b = p.w_dev.weight.data<uint16_t>();
  c.partials = plan.part_o;
  c.lse = plan.part_lse;
  c.o_lat_in = static_cast<const uint16_t*>(o_lat.raw());
  c.splits = plan.num_splits;
  c.min_split_keys = plan.min_split_keys;
  c.key_tile = plan.key_tile;
  c.token_seq = dev.token_seq;
  c.query_start = dev.query_start;
  c.context_lens = dev.context_lens;
  c.o_lat = static_cast<uint16_t*>(merged.raw());
  c.attn_out = static_cast<uint16_t*>(out.raw());
  int32_t width = 1;
  while (width < T) width *= 2;
  c.width = width;
  auto planned = kernels::mono::plan_program(kernels::mono::attention_output_stages(c), width,
                                             kernels::current_device_sms());
  NUCLEUS_CHECK_OK(planned.status());
  std::vector<int32_t> flat;
  for (const kernels::mono::Job& j : planned->jobs) flat.insert(flat.end(), {j.stage, j.tile});
  Tensor queue_start = device_copy(planned->queue_start, DType::kI32), jobs = device_copy(flat, DType::kI32);
  Tensor counters = Tensor::empty({kernels::mono::kMaxStages + 1}, DType::kI32, Device::kCuda);
  zero_device(counters);
  const kernels::mono::Program prog =
      kernels::mono::program_view(*planned, static_cast<int32_t>(T), queue_start.data<int32_t>(),
                                  static_cast<const kernels::mono::Job*>(jobs.raw()), counters.data<int32_t>());
  NUCLEUS_CHECK(kernels::mono::launch_mono_program(prog, cuda::context().stream, false) == cudaSuccess,
                "decode program launch failed");
  NUCLEUS_CHECK(cudaStreamSynchronize(cuda::context().stream) == cudaSuccess, "decode program failed");
  printf("mla_decode hand-over: %ld rows, %ld heads, %d splits (min_split_keys %d, key tile %d)\n", static_cast<long>(T),
         static_cast<long>(H), plan.num_splits, plan.min_split_keys, plan.key_tile);
  return from_bf16(host_copy<uint16_t>(out));
}

::testing::AssertionResult matches(const std::vector<float>& got, const std::vector<float>& want, int64_t width) {
  double err2 = 0, ref2 = 0, max_ref = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (!std::isnan(want[i])) max_ref = std::max(max_ref, std::fabs(static_cast<double>(want[i])));
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) {  // a row the op must not touch: still poisoned
      if (got[i] != bf16_to_f32(0x7f7f))
        return ::testing::AssertionFailure() << "row " << i / width << " col " << i % width
                                             << " should be untouched, got " << got[i];
      continue;
    }
    const double e = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(e <= 3e-2 * max_ref))
      return ::testing::AssertionFailure() << "first mismatch at [" << i / width << ", " << i % width << "]: got "
                                           << got[i] << ", want " << want[i] << " (max|want| " << max_ref << ")";
    err2 += e * e;
    ref2 += static_cast<double>(want[i]) * want[i];
  }
  const double rel = std::sqrt(err2 / std::max(ref2, 1e-30));
  if (!(rel <= 1e-2)) return ::testing::AssertionFailure() << "relative L2 error " << rel;
  return ::testing::AssertionSuccess() << "rel " << rel;
}

class MlaDecodeGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device";
    ASSERT_TRUE(cuda::get_context().ok());
  }
  // Every backend on every case; refusals are printed, not failures, except
  // for "nucleus", which must support every case here.
  void check(const std::vector<Case>& cases, int64_t scratch_rows) {
    uint64_t seed = 100;
    for (const Case& c : cases) {
      Problem p = make_problem(c, seed++);
      const std::vector<float> want = reference(p);
      const int64_t width = c.heads * kVHead;
      for (const char* backend : {"nucleus", "flashinfer", "cuda_naive"}) {
        std::string why;
        const std::vector<float> got = run_backend(backend, p, scratch_rows, &why);
        if (got.empty()) {
          EXPECT_NE(std::string(backend), "nucleus") << name(c) << ": " << why;
          printf("mla_decode %-10s %-28s refused: %s\n", backend, name(c).c_str(), why.c_str());
          continue;
        }
        auto r = matches(got, want, width);
        EXPECT_TRUE(r) << backend << " " << name(c);
        printf("mla_decode %-10s %-28s compared: %s\n", backend, name(c).c_str(), r.message());
      }
    }
  }
};

TEST_F(MlaDecodeGpu, SmallBatchesAndBlockSizes) {
  check({{1, 1, 16, 16},  {1, 17, 16, 1},   {3, 17, 128, 64},  {3, 64, 16, 64},  {3, 64, 128, 1},
         {1, 1000, 16, 64}, {3, 1000, 128, 16}, {1, 5000, 16, 16}, {3, 5000, 128, 64}, {3, 100, 4, 16}},
        64);
}

// Decode programs take the attention's splits over (NUCLEUS_DECODE_PROGRAM_ATTN_OUTPUT):
// the op run with its output left to a program, then the program's merge
// and W_UV, against the reference and against the op's own output. 16 heads
// (the mma.sync kernels, 64-key tiles) and 64 heads (the wgmma kernel), 1 to 8
// rows, the device split rule and fixed minimums (NUCLEUS_MLA_DECODE_SPLIT_KEYS
// 32 at 64-key tiles, and 256), rows of one key tile (4 keys), page sizes 1, 16 and 64.
TEST_F(MlaDecodeGpu, HandsItsSplitsToADecodeProgram) {
  uint64_t seed = 900;
  for (const char* split_keys : {"auto", "32", "256"}) {
    setenv("NUCLEUS_MLA_DECODE_SPLIT_KEYS", split_keys, 1);
    for (const Case& c : std::vector<Case>{{1, 1000, 16, 64}, {8, 5000, 16, 64, false, 1, true}, {5, 300, 16, 1},
                                           {1, 4, 16, 64}, {3, 2000, 64, 64, false, 1, true}, {8, 700, 64, 16}}) {
      SCOPED_TRACE(name(c) + " split_keys " + split_keys);
      Problem p = make_problem(c, seed++);
      const std::vector<float> want = reference(p);
      const std::vector<float> got = run_handed_over(p);
      auto r = matches(got, want, c.heads * kVHead);
      EXPECT_TRUE(r);
      std::string why;
      const std::vector<float> own = run_backend("nucleus", p, 8, &why);
      ASSERT_FALSE(own.empty()) << why;
      // The op's own output: the same merged o_lat bits, W_UV summed in another order.
      EXPECT_TRUE(matches(got, own, c.heads * kVHead)) << "against the op's own output";
    }
  }
  unsetenv("NUCLEUS_MLA_DECODE_SPLIT_KEYS");
}

TEST_F(MlaDecodeGpu, LargeBatches) {
  check({{64, 1000, 16, 64}, {64, 64, 128, 16, true}, {129, 64, 16, 1}, {129, 1000, 128, 64, false, 1, true},
         {64, 5000, 16, 64, false, 1, true}, {129, 17, 128, 16, true}},
        64);
}

TEST_F(MlaDecodeGpu, LongContext) {
  check({{1, 70000, 16, 64}, {1, 70000, 128, 64, true}, {3, 5000, 16, 1, true}}, 64);
}

// A mixed step in auto mode: prefill rows must stay untouched (poisoned),
// decode rows served through the row list, W smaller than the row count.
TEST_F(MlaDecodeGpu, RowListLeavesOtherRowsUntouched) {
  check({{7, 300, 16, 16, false, 1, true, 3}, {40, 1000, 128, 64, true, 1, true, 4}}, 8);
}

// Forced absorbed mode over prefill rows: each row sees keys up to its position.
TEST_F(MlaDecodeGpu, ForcedAbsorbedPrefillRowsAreCausal) {
  check({{3, 200, 16, 16, false, 7}, {2, 1000, 128, 64, true, 33}}, 16);
}

// A CUDA graph captured on one step replays correctly on a step with the
// same rows but other contexts (the split plan is derived on the device).
// Only nucleus serves an op of a captured graph: flashinfer plans on the host
// every step, so it refuses one (the graph's dispatch then picks nucleus).
TEST_F(MlaDecodeGpu, GraphReplayFollowsNewContexts) {
  for (int heads : {16, 128}) {
    Problem p = make_problem({8, 3000, heads, 16, false, 1, true}, 900 + heads);
    const std::vector<float> want = reference(p);
    StepInputs shorter = p.si;  // the captured step: every context shorter
    for (auto& c : shorter.context_lens) c = c / 3;
    MlaDecodeAttentionOp op(0, &p.w_dev, p.dims, p.mode);
    op.set_captured(true);
    if (kernels::flashinfer_mla_available()) {
      const Backend<MlaDecodeAttentionOp>* fi = find_backend("flashinfer");
      ASSERT_NE(fi, nullptr);
      const Status refused = op.use_backend(*fi);
      EXPECT_FALSE(refused.ok()) << "flashinfer accepted an op of a captured graph";
      EXPECT_NE(refused.message().find("CUDA graph replay"), std::string::npos) << refused.message();
    }
    ASSERT_TRUE(op.select_backend(Device::kCuda).ok());
    ASSERT_EQ(op.backend(), "nucleus");
    StepResources res;
    ASSERT_TRUE(res.reserve_ops({&op}, StepLimits{}, Device::kCuda).ok());
    const int64_t H = heads, T = p.si.num_tokens(), W = 8;
    Tensor out = device_poisoned(T * H * kVHead, DType::kBF16).view({T, H * kVHead});
    Tensor q_lat = device_poisoned(W * H * kLora, DType::kF32).view({W, H * kLora});
    Tensor o_lat = device_poisoned(W * H * kLora, DType::kF32).view({W, H * kLora});
    DeviceInputUploader uploader;
    DeviceStepInputs dev = uploader.upload(shorter);
    OpContext ctx;
    ctx.device = Device::kCuda;
    ctx.stream = cuda::context().stream;
    ctx.inputs = &shorter;
    ctx.dev = &dev;
    ctx.kv_cache = &p.kv;
    Tensor q = p.q_dev.view({T, H * (kNope + kRope)});
    auto cs = static_cast<cudaStream_t>(ctx.stream);
    ASSERT_TRUE(res.begin_step(ctx).ok());  // before capture: sizes the workspace for this step
    op.run(ctx, {q}, {out, q_lat, o_lat});  // eager first
    ASSERT_TRUE(ctx.error.ok()) << ctx.error.to_string();
    ASSERT_EQ(cudaStreamSynchronize(cs), cudaSuccess);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    const Status begun = res.begin_step(ctx);  // within the reserved limits: no allocation, no host plan
    op.run(ctx, {q}, {out, q_lat, o_lat});
    ASSERT_EQ(cudaStreamEndCapture(cs, &graph), cudaSuccess);
    ASSERT_TRUE(begun.ok()) << begun.to_string();
    ASSERT_TRUE(ctx.error.ok()) << ctx.error.to_string();
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    const DeviceStepInputs dev2 = uploader.upload(p.si);  // same sizes: same device buffer
    ASSERT_EQ(dev2.context_lens, dev.context_lens);
    ASSERT_EQ(cudaGraphLaunch(exec, cs), cudaSuccess);
    auto r = matches(from_bf16(host_copy<uint16_t>(out)), want, H * kVHead);
    EXPECT_TRUE(r) << "heads " << heads;
    printf("mla_decode nucleus    graph replay h%-3d compared: %s\n", heads, r.message());
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// NUCLEUS_MLA_DECODE_SMALL_GEMMS=1: calls of at most 8 rows run the own
// absorption kernels (kv_b_proj read as stored, the split combine fused into
// the output kernel); 0 runs cuBLASLt's batched GEMMs. Both must match the
// reference. With a bf16 kv_b_proj they differ only in summation order, so
// they agree more tightly than either matches the reference; with FP8 the
// cuBLASLt path reads a bf16 copy of q * scale (one rounding more a weight),
// so the own kernels must be at least as close to the reference. auto runs
// the kernels up to its rule's rows (4, or 8 with FP8 kv_b or 16 heads): bit
// for bit the forced setting there, the cuBLASLt one above. 9 rows: past the
// kernels, every setting runs cuBLASLt.
TEST_F(MlaDecodeGpu, SmallGemmsOnAndOffAgree) {
  struct Env {
    explicit Env(const char* v) {
      if (v) setenv("NUCLEUS_MLA_DECODE_SMALL_GEMMS", v, 1);
    }
    ~Env() { unsetenv("NUCLEUS_MLA_DECODE_SMALL_GEMMS"); }
  };
  auto rel_l2 = [](const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>& want) {
    double d2 = 0, r2 = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      if (std::isnan(want[i])) continue;
      d2 += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
      r2 += static_cast<double>(want[i]) * want[i];
    }
    return std::sqrt(d2 / r2);
  };
  uint64_t seed = 700;
  for (int heads : {16, 128})
    for (bool fp8 : {false, true})
      for (int rows : {1, 2, 5, 8, 9})
        for (int context : {40, 3000}) {
          const Case c{rows, context, heads, 16, fp8, 1, rows > 2};
          Problem p = make_problem(c, seed++);
          const std::vector<float> want = reference(p);
          std::string why;
          std::vector<float> on, off, autov;
          {
            Env e("1");
            on = run_backend("nucleus", p, 64, &why);
          }
          {
            Env e("0");
            off = run_backend("nucleus", p, 64, &why);
          }
          {
            Env e(nullptr);
            autov = run_backend("nucleus", p, 64, &why);
          }
          ASSERT_FALSE(on.empty() || off.empty() || autov.empty()) << name(c) << ": " << why;
          const int64_t width = heads * kVHead;
          EXPECT_TRUE(matches(on, want, width)) << "on " << name(c);
          EXPECT_TRUE(matches(off, want, width)) << "off " << name(c);
          const double err_on = rel_l2(on, want, want), err_off = rel_l2(off, want, want);
          const double diff = rel_l2(on, off, want);
          if (rows > 8)
            EXPECT_EQ(diff, 0.0) << name(c) << ": past 8 rows both settings run cuBLASLt";
          else if (fp8)
            EXPECT_LE(err_on, err_off * 1.05) << name(c) << ": exact FP8 weights, yet farther from the reference";
          else
            EXPECT_LE(diff, 2e-3) << name(c);
          const int64_t auto_rows = mla_decode_small_rows_auto(heads, fp8);
          EXPECT_EQ(autov, rows <= auto_rows ? on : off)
              << name(c) << ": auto runs the kernels at <= " << auto_rows << " rows only";
          printf("mla_decode small GEMMs on/off %-28s diff %.2e, error vs reference on %.2e off %.2e\n",
                 name(c).c_str(), diff, err_on, err_off);
        }
}

// NUCLEUS_MLA_DECODE_SPLIT_KEYS: every minimum split size agrees with the
// reference, through the small output kernel's merge (1-8 rows) and the
// combine kernel (9 rows); 128 is the fixed minimum before the switch, and
// auto equals the setting its rule picks bit for bit.
TEST_F(MlaDecodeGpu, SplitKeysSettingsAgree) {
  struct Env {
    explicit Env(const char* v) {
      if (v) setenv("NUCLEUS_MLA_DECODE_SPLIT_KEYS", v, 1);
    }
    ~Env() { unsetenv("NUCLEUS_MLA_DECODE_SPLIT_KEYS"); }
  };
  uint64_t seed = 900;
  for (int heads : {16, 128})
    for (int rows : {1, 3, 9})
      for (int context : {33, 3000, 9000}) {
        const Case c{rows, context, heads, 64, false, 1, rows > 1};
        Problem p = make_problem(c, seed++);
        const std::vector<float> want = reference(p);
        const int64_t width = heads * kVHead;
        std::vector<float> auto_out;
        {
          Env e(nullptr);
          std::string why;
          auto_out = run_backend("nucleus", p, 64, &why);
          ASSERT_FALSE(auto_out.empty()) << name(c) << ": " << why;
          EXPECT_TRUE(matches(auto_out, want, width)) << "auto " << name(c);
        }
        const std::string auto_keys = std::to_string(mla_decode_min_split_keys_auto(rows, heads));
        for (const char* keys : {"32", "64", "128", "256"}) {
          Env e(keys);
          ASSERT_EQ(mla_decode_min_split_keys(rows, heads), std::atoi(keys));
          std::string why;
          const std::vector<float> got = run_backend("nucleus", p, 64, &why);
          ASSERT_FALSE(got.empty()) << name(c) << ": " << why;
          auto r = matches(got, want, width);
          EXPECT_TRUE(r) << "split keys " << keys << " " << name(c);
          if (auto_keys == keys) {
            EXPECT_EQ(got, auto_out) << name(c) << ": auto is split keys " << keys;
          }
          printf("mla_decode split keys %-4s %-28s %s\n", keys, name(c).c_str(), r.message());
        }
      }
}

// NUCLEUS_MLA_DECODE_CTAS_PER_SM: two CTAs a multiprocessor (a shallower
// ring, a grid sized for twice the CTAs, so other splits) match the reference
// as one does; more than 16 heads always run one, bit for bit the same.
TEST_F(MlaDecodeGpu, TwoCtasPerSmMatchesOne) {
  struct Env {
    explicit Env(const char* v) { setenv("NUCLEUS_MLA_DECODE_CTAS_PER_SM", v, 1); }
    ~Env() { unsetenv("NUCLEUS_MLA_DECODE_CTAS_PER_SM"); }
  };
  uint64_t seed = 1100;
  for (int heads : {16, 4, 128})
    for (int rows : {1, 9, 130})
      for (int context : {33, 3000}) {
        const Case c{rows, context, heads, 16, false, 1, rows > 1};
        Problem p = make_problem(c, seed++);
        const std::vector<float> want = reference(p);
        std::vector<float> one, two;
        std::string why;
        {
          Env e("1");
          ASSERT_EQ(mla_decode_ctas_per_sm(rows, heads), 1);
          one = run_backend("nucleus", p, 256, &why);
        }
        {
          Env e("2");
          ASSERT_EQ(mla_decode_ctas_per_sm(rows, heads), heads <= 16 ? 2 : 1);
          two = run_backend("nucleus", p, 256, &why);
        }
        ASSERT_FALSE(one.empty() || two.empty()) << name(c) << ": " << why;
        EXPECT_TRUE(matches(one, want, heads * kVHead)) << name(c);
        EXPECT_TRUE(matches(two, want, heads * kVHead)) << name(c);
        if (heads > 16) {
          EXPECT_EQ(one, two) << name(c) << ": more than 16 heads run one CTA either way";
        }
      }
}

// NUCLEUS_MLA_DECODE_KEY_TILE: the 64-key kernel (8 keys a warp over all
// dims, one shared softmax a tile) matches the reference as the 32-key kernel
// does: bf16 and FP8 rows, pages of 1, 16 and 64 keys, contexts that end
// inside, at and just past a tile, several query rows a sequence, a mixed
// step, split and unsplit calls (1-130 rows), through the small output
// kernel's merge and the combine kernel; auto equals the tile its rule picks
// bit for bit, and more than 16 heads run the 32-key kernel either way.
TEST_F(MlaDecodeGpu, KeyTilesAgree) {
  struct Env {
    explicit Env(const char* v) {
      if (v) setenv("NUCLEUS_MLA_DECODE_KEY_TILE", v, 1);
    }
    ~Env() { unsetenv("NUCLEUS_MLA_DECODE_KEY_TILE"); }
  };
  std::vector<Case> cases;
  for (int heads : {16, 4, 128})
    for (bool fp8 : {false, true}) {
      cases.push_back({1, 1, heads, 16, fp8});
      cases.push_back({1, 63, heads, 1, fp8});
      cases.push_back({2, 64, heads, 64, fp8});
      cases.push_back({1, 65, heads, 16, fp8});
      cases.push_back({1, 4097, heads, 64, fp8});
      cases.push_back({3, 3000, heads, 16, fp8, 1, true});
      cases.push_back({9, 700, heads, 64, fp8, 1, true});
      cases.push_back({2, 200, heads, 16, fp8, 3});
      cases.push_back({7, 150, heads, 16, fp8, 1, false, 3});
      cases.push_back({130, 300, heads, 1, fp8, 1, true});
    }
  uint64_t seed = 1300;
  for (const Case& c : cases) {
    Problem p = make_problem(c, seed++);
    const std::vector<float> want = reference(p);
    const int64_t rows = p.si.num_tokens();
    std::vector<float> t32, t64, autov;
    std::string why;
    {
      Env e("32");
      ASSERT_EQ(mla_decode_key_tile(rows, c.heads), 32);
      t32 = run_backend("nucleus", p, 256, &why);
    }
    {
      Env e("64");
      ASSERT_EQ(mla_decode_key_tile(rows, c.heads), c.heads <= 16 ? 64 : 32);
      t64 = run_backend("nucleus", p, 256, &why);
    }
    {
      Env e(nullptr);
      autov = run_backend("nucleus", p, 256, &why);
    }
    ASSERT_FALSE(t32.empty() || t64.empty() || autov.empty()) << name(c) << ": " << why;
    const int64_t width = c.heads * kVHead;
    auto r32 = matches(t32, want, width), r64 = matches(t64, want, width);
    EXPECT_TRUE(r32) << "32-key tiles " << name(c);
    EXPECT_TRUE(r64) << "64-key tiles " << name(c);
    EXPECT_EQ(autov, mla_decode_key_tile_auto(rows, c.heads) == 64 && c.heads <= 16 ? t64 : t32) << name(c);
    if (c.heads > 16) {
      EXPECT_EQ(t32, t64) << name(c) << ": more than 16 heads run the 32-key kernel either way";
    }
    printf("mla_decode key tile 32 %-30s %s\nmla_decode key tile 64 %-30s %s\n", name(c).c_str(), r32.message(),
           name(c).c_str(), r64.message());
  }
}

// NUCLEUS_MLA_DECODE_BULK_LOADS: the 64-key kernel with whole rows by bulk
// copies (mbarrier per ring stage, rows past a split's end zeroed by the
// warp) equals its cp.async loader bit for bit (the same bytes reach shared
// memory), and both match the reference: bf16 and FP8 rows, pages of 1, 16
// and 64 keys, contexts ending inside, at and past a tile (partial warps of
// rows), several query rows a sequence, a mixed step, split and unsplit.
TEST_F(MlaDecodeGpu, BulkLoadsAgree) {
  struct Env {
    explicit Env(const char* v) { setenv("NUCLEUS_MLA_DECODE_BULK_LOADS", v, 1); }
    ~Env() { unsetenv("NUCLEUS_MLA_DECODE_BULK_LOADS"); }
  };
  std::vector<Case> cases;
  for (int heads : {16, 4})
    for (bool fp8 : {false, true}) {
      cases.push_back({1, 1, heads, 16, fp8});
      cases.push_back({1, 5, heads, 1, fp8});
      cases.push_back({1, 63, heads, 1, fp8});
      cases.push_back({2, 64, heads, 64, fp8});
      cases.push_back({1, 70, heads, 16, fp8});
      cases.push_back({1, 4097, heads, 64, fp8});
      cases.push_back({3, 3000, heads, 16, fp8, 1, true});
      cases.push_back({2, 200, heads, 16, fp8, 3});
      cases.push_back({7, 150, heads, 16, fp8, 1, false, 3});
      cases.push_back({130, 300, heads, 1, fp8, 1, true});
    }
  uint64_t seed = 1700;
  for (const Case& c : cases) {
    Problem p = make_problem(c, seed++);
    const std::vector<float> want = reference(p);
    const int64_t rows = p.si.num_tokens();
    ASSERT_EQ(mla_decode_key_tile(rows, c.heads), 64) << name(c);
    std::vector<float> bulk, pieces;
    std::string why;
    {
      Env e("1");
      ASSERT_TRUE(mla_decode_bulk_loads(rows, c.heads, KvCacheDtype::kBF16));
      bulk = run_backend("nucleus", p, 256, &why);
    }
    {
      Env e("0");
      ASSERT_FALSE(mla_decode_bulk_loads(rows, c.heads, KvCacheDtype::kBF16));
      pieces = run_backend("nucleus", p, 256, &why);
    }
    ASSERT_FALSE(bulk.empty() || pieces.empty()) << name(c) << ": " << why;
    const auto rb = matches(bulk, want, c.heads * kVHead);
    EXPECT_TRUE(rb) << "bulk loads " << name(c);
    EXPECT_EQ(bulk, pieces) << name(c) << ": the same bytes in shared memory, the same outputs";
    printf("mla_decode bulk loads %-30s %s\n", name(c).c_str(), rb.message());
  }
}

// NUCLEUS_MLA_DECODE_WGMMA: the 64-head wgmma kernel
// (kernels/mla/mla_decode_wgmma.cu) matches the reference as the
// mma.sync kernels (32 heads a CTA) do: 64 and 128 heads (one and two head
// groups), pages of 1, 16 and 64 keys, contexts that end inside, at and just
// past a tile, ragged contexts, several query rows a sequence, a mixed step,
// split and unsplit calls (1-130 rows; through the small output kernel's
// merge and the combine kernel), bf16 and FP8 kv_b weights. Where it does not
// apply (16 heads) the switch changes nothing.
TEST_F(MlaDecodeGpu, WgmmaAgrees) {
  struct Env : testing::ScopedEnvValue {
    explicit Env(const char* v) : testing::ScopedEnvValue("NUCLEUS_MLA_DECODE_WGMMA", v) {}
  };
  std::vector<Case> cases;
  for (int heads : {128, 64}) {
    cases.push_back({1, 1, heads, 16});
    cases.push_back({1, 5, heads, 1});
    cases.push_back({1, 63, heads, 1});
    cases.push_back({2, 64, heads, 64});
    cases.push_back({1, 65, heads, 16});
    cases.push_back({1, 4097, heads, 64});
    cases.push_back({3, 3000, heads, 16, false, 1, true});
    cases.push_back({9, 700, heads, 64, false, 1, true});
    cases.push_back({2, 200, heads, 16, false, 3});
    cases.push_back({7, 150, heads, 16, false, 1, false, 3});
    cases.push_back({130, 300, heads, 1, false, 1, true});
  }
  cases.push_back({3, 500, 16, 16});                // 16 heads: not a multiple of 64
  cases.push_back({3, 500, 128, 16, /*fp8=*/true});  // FP8 kv_b weights (the cache stays bf16: it applies)
  uint64_t seed = 2100;
  for (const Case& c : cases) {
    Problem p = make_problem(c, seed++);
    const std::vector<float> want = reference(p);
    const int64_t rows = p.si.num_tokens();
    // This file's problems keep a bf16 cache (Case::fp8 quantizes kv_b); an
    // FP8 cache never takes the kernel (MlaDecodeRule.WgmmaValues, CPU).
    const KvCacheDtype dtype = KvCacheDtype::kBF16;
    const bool applies = c.heads % 64 == 0;
    std::vector<float> on, off, autov;
    std::string why;
    {
      Env e("1");
      ASSERT_EQ(mla_decode_wgmma(rows, c.heads, dtype), applies) << name(c);
      on = run_backend("nucleus", p, 256, &why);
    }
    {
      Env e("0");
      ASSERT_FALSE(mla_decode_wgmma(rows, c.heads, dtype)) << name(c);
      off = run_backend("nucleus", p, 256, &why);
    }
    {
      Env e("auto");
      autov = run_backend("nucleus", p, 256, &why);
    }
    ASSERT_FALSE(on.empty() || off.empty() || autov.empty()) << name(c) << ": " << why;
    const int64_t width = c.heads * kVHead;
    const auto r_on = matches(on, want, width), r_off = matches(off, want, width);
    EXPECT_TRUE(r_on) << "wgmma " << name(c);
    EXPECT_TRUE(r_off) << "mma.sync " << name(c);
    EXPECT_EQ(autov, mla_decode_wgmma_auto(rows, c.heads, dtype) && applies ? on : off) << name(c);
    if (!applies) {
      EXPECT_EQ(on, off) << name(c) << ": the switch has no effect where the kernel does not apply";
    }
    printf("mla_decode wgmma %-30s %s\nmla_decode mma.sync %-30s %s\n", name(c).c_str(), r_on.message(),
           name(c).c_str(), r_off.message());
  }
}

// The switch's values and the auto rule; a malformed value is refused when
// the model is created.
TEST(MlaDecodeSwitch, ValuesAutoRuleAndMalformedValueRefused) {
  EXPECT_EQ(mla_decode_small_rows_auto(16, false), 8);
  EXPECT_EQ(mla_decode_small_rows_auto(128, true), 8);
  EXPECT_EQ(mla_decode_small_rows_auto(128, false), 4);
  EXPECT_EQ(mla_decode_small_rows_auto(32, false), 4);
  struct Case {
    const char* value;
    int64_t rows;  // at 128 heads, bf16 kv_b
  };
  for (const Case& c : {Case{"auto", 4}, Case{"", 4}, Case{"0", 0}, Case{"off", 0}, Case{"1", 8}, Case{"ON", 8}}) {
    setenv("NUCLEUS_MLA_DECODE_SMALL_GEMMS", c.value, 1);
    EXPECT_EQ(mla_decode_small_rows(128, false), c.rows) << c.value;
    EXPECT_TRUE(mla_decode_env_status().ok()) << c.value;
  }
  setenv("NUCLEUS_MLA_DECODE_SMALL_GEMMS", "yes", 1);
  const Status s = mla_decode_env_status();
  EXPECT_EQ(mla_decode_small_rows(128, false), 4) << "a malformed value reads as auto until refused";
  unsetenv("NUCLEUS_MLA_DECODE_SMALL_GEMMS");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("NUCLEUS_MLA_DECODE_SMALL_GEMMS='yes'"), std::string::npos) << s.message();
  EXPECT_TRUE(mla_decode_env_status().ok());
  EXPECT_EQ(mla_decode_small_rows(16, false), 8);
}

// Shapes the fast backends are not built for are refused with a reason.
TEST_F(MlaDecodeGpu, RefusesOtherWidthsAndF32Weights) {
  LinearWeight w;
  w.weight = Tensor::empty({16 * 256, 256}, DType::kBF16, Device::kCuda);
  w.out_features = 16 * 256;
  w.in_features = 256;
  MlaDecodeAttentionOp narrow(0, &w, {16, kNope, kRope, kVHead, 256, kScale}, AttentionMode::kAuto);
  LinearWeight w32;
  w32.weight = Tensor::empty({16 * 256, kLora}, DType::kF32, Device::kCuda);
  w32.out_features = 16 * 256;
  w32.in_features = kLora;
  MlaDecodeAttentionOp f32(0, &w32, {16, kNope, kRope, kVHead, kLora, kScale}, AttentionMode::kAuto);
  for (const char* backend : {"nucleus", "flashinfer"}) {
    const auto* b = find_backend(backend);
    ASSERT_NE(b, nullptr) << backend;
    Status s = b->supports(narrow);
    EXPECT_FALSE(s.ok()) << backend;
    printf("mla_decode %-10s refuses kv_lora 256: %s\n", backend, s.message().c_str());
    s = b->supports(f32);
    EXPECT_FALSE(s.ok()) << backend;
    printf("mla_decode %-10s refuses F32 kv_b: %s\n", backend, s.message().c_str());
  }
}

}  // namespace
}  // namespace nucleus
