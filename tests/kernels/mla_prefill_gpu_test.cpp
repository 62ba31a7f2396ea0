// The tensor-core MLA prefill attention ("cuda_flash") against the CPU
// reference mla_attention_expanded_ref:
//  - the kernel alone, given K/V expanded on the CPU: single sequences of
//    1..3000 queries, a ragged batch of 5 sequences with cached prefixes, both
//    tile heights, both kernel variants (mma.sync, wgmma), 16 and 128 heads,
//    and a long context split into key pieces merged by log-sum-exp; output
//    and LSE checked;
//  - the whole backend through MlaPrefillAttentionOp over a paged bf16 latent
//    cache: block sizes 1, 16, 64; one batch, several batches and pieces
//    (small --prefill-context-chunk); sequences the op does not serve stay
//    untouched; refusals.
//
// Tolerance (bf16): out |got - want| <= 8e-3 + 2e-2 |want|; LSE <= 1e-2 + 1e-3 |want|.
// Inputs are bf16-exact; the GPU additionally rounds K/V (bf16 scratch), P
// (bf16 operand of P.V) and, across key pieces, the running output (bf16).
// Scores are spread (std ~2 after scaling) so single keys matter.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>

#include "core/cuda/context.h"
#include "core/device.h"
#include "gpu_test_util.h"
#include "graph/device_inputs.h"
#include "graph/step_resources.h"
#include "kernels/gemm/gemm_ref.h"
#include "kernels/mla/mla_attention_ref.h"
#include "kernels/mla/mla_prefill.cuh"
#include "ops/mla_prefill.h"
#include "ops/mla_prefill_cuda.h"

namespace nucleus::kernels {
namespace {

using testing::all_close;
using testing::device_copy;
using testing::device_poisoned;
using testing::from_bf16;
using testing::host_copy;
using testing::random_bf16_values;
using testing::to_bf16;

constexpr float kOutAtol = 8e-3f, kOutRtol = 2e-2f;
constexpr float kLseAtol = 1e-2f, kLseRtol = 1e-3f;
constexpr int kNope = 128, kRope = 64, kVHead = 128, kLora = 512, kLatent = kLora + kRope, kQk = kNope + kRope;

struct SeqSpec {
  int context;
  int num_q;
  int keys() const { return context + num_q; }
};

// A prefill problem with bf16-exact inputs.
struct Problem {
  MlaDims d;
  std::vector<SeqSpec> seqs;
  std::vector<int> q_begin;                // [num_seqs + 1]
  std::vector<float> w;                    // kv_b_proj [heads * 256, 512]
  std::vector<std::vector<float>> latent;  // per sequence [keys, 576]
  std::vector<float> q;                    // [T, heads * 192]
  int64_t rows() const { return q_begin.back(); }
};

Problem make_problem(int heads, std::vector<SeqSpec> seqs, uint64_t seed) {
  Problem p;
  p.d = MlaDims{heads, kNope, kRope, kVHead, kLora, 0.135234f};
  p.seqs = std::move(seqs);
  p.q_begin = {0};
  for (const auto& s : p.seqs) p.q_begin.push_back(p.q_begin.back() + s.num_q);
  p.w = random_bf16_values(static_cast<size_t>(heads) * (kNope + kVHead) * kLora, 0.05f, seed);
  for (size_t i = 0; i < p.seqs.size(); ++i)
    p.latent.push_back(random_bf16_values(static_cast<size_t>(p.seqs[i].keys()) * kLatent, 1.0f, seed + 10 + i));
  p.q = random_bf16_values(static_cast<size_t>(p.rows()) * heads * kQk, 3.0f, seed + 1);
  return p;
}

// The reference output [T, heads * 128] and LSE [T, heads].
void reference(const Problem& p, std::vector<float>* out, std::vector<float>* lse) {
  const int64_t heads = p.d.num_heads;
  out->assign(p.rows() * heads * kVHead, 0.0f);
  lse->assign(p.rows() * heads, 0.0f);
  for (size_t i = 0; i < p.seqs.size(); ++i) {
    const int64_t r0 = p.q_begin[i];
    mla_attention_expanded_ref(p.d, p.q.data() + r0 * heads * kQk, heads * kQk, p.seqs[i].num_q, p.seqs[i].context,
                               p.latent[i].data(), p.w.data(), out->data() + r0 * heads * kVHead, heads * kVHead,
                               lse->data() + r0 * heads);
  }
}

// Compares, prints the case's worst errors (a line the GPU check script shows).
void expect_close(const std::string& name, const std::vector<float>& got, const std::vector<float>& want, float atol,
                  float rtol, int64_t width, const char* what) {
  double worst = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) worst = std::max<double>(worst, std::fabs(got[i] - want[i]));
  std::printf("mla-prefill %s: %s max abs err %.3g (compared %zu)\n", name.c_str(), what, worst, got.size());
  EXPECT_TRUE(all_close(got, want, atol, rtol, width)) << name << " " << what;
}

class MlaPrefill : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(testing::have_gpu()) << "GPU tests need a CUDA device";
    ASSERT_TRUE(cuda::get_context().ok());
  }
};

// ---------------------------------------------------------------- kernel ---

// A key range of one launch: every sequence's keys [begin, end) (end clipped).
struct Piece {
  int begin, end;
};

// Runs the kernel over `pieces` (merged by LSE after the first) with K/V
// expanded on the CPU, and checks output and LSE against the reference.
void check_kernel_variant(const std::string& name, const Problem& p, const std::vector<Piece>& pieces, int block_m,
                          bool use_wgmma, const std::vector<float>& want, const std::vector<float>& want_lse) {
  const int heads = static_cast<int>(p.d.num_heads);
  const int64_t kv_w = static_cast<int64_t>(heads) * (kNope + kVHead);
  // K/V of all sequences' keys, packed: sequence i's key j at row kv_row0[i] + j.
  std::vector<int> kv_row0 = {0};
  for (const auto& s : p.seqs) kv_row0.push_back(kv_row0.back() + s.keys());
  const int64_t total_keys = kv_row0.back();
  std::vector<float> k(total_keys * heads * kQk), v(total_keys * heads * kVHead);
  for (size_t i = 0; i < p.seqs.size(); ++i) {
    const int64_t n = p.seqs[i].keys();
    std::vector<float> kv(n * kv_w);
    gemm_ref(p.latent[i].data(), kLatent, p.w.data(), n, kv_w, kLora, kv.data(), kv_w, false);
    for (int64_t j = 0; j < n; ++j)
      for (int h = 0; h < heads; ++h) {
        float* kr = k.data() + ((kv_row0[i] + j) * heads + h) * kQk;
        float* vr = v.data() + ((kv_row0[i] + j) * heads + h) * kVHead;
        const float* kvr = kv.data() + j * kv_w + h * (kNope + kVHead);
        std::copy(kvr, kvr + kNope, kr);
        std::copy(p.latent[i].data() + j * kLatent + kLora, p.latent[i].data() + (j + 1) * kLatent, kr + kNope);
        std::copy(kvr + kNope, kvr + kNope + kVHead, vr);
      }
  }
  Tensor d_q = device_copy(to_bf16(p.q), DType::kBF16), d_k = device_copy(to_bf16(k), DType::kBF16);
  Tensor d_v = device_copy(to_bf16(v), DType::kBF16);
  Tensor d_out = device_poisoned(p.rows() * heads * kVHead, DType::kBF16);
  Tensor d_lse = device_poisoned(p.rows() * heads, DType::kF32);
  std::vector<Tensor> keep;
  for (size_t pi = 0; pi < pieces.size(); ++pi) {
    std::vector<MlaPrefillSeq> seqs;
    std::vector<MlaPrefillWork> work;
    for (size_t i = 0; i < p.seqs.size(); ++i) {
      const int begin = pieces[pi].begin, end = std::min(pieces[pi].end, p.seqs[i].keys());
      // A piece past a sequence's keys leaves it out (as a host planner would).
      if (begin >= end) continue;
      MlaPrefillSeq s;
      s.q_row0 = p.q_begin[i];
      s.num_q = p.seqs[i].num_q;
      s.q_pos0 = p.seqs[i].context;
      s.kv_row0 = kv_row0[i] + begin;
      s.key_begin = begin;
      s.key_end = end;
      for (int t = (s.num_q + block_m - 1) / block_m - 1; t >= 0; --t)
        if (s.q_pos0 + std::min(s.num_q, (t + 1) * block_m) - 1 >= begin)
          work.push_back({static_cast<int32_t>(seqs.size()), t});
      seqs.push_back(s);
    }
    keep.push_back(device_copy(seqs, DType::kU8));
    keep.push_back(device_copy(work, DType::kU8));
    MlaPrefillParams a;
    a.q = d_q.data<__nv_bfloat16>();
    a.q_stride = heads * kQk;
    a.k = d_k.data<__nv_bfloat16>();
    a.k_stride = heads * kQk;
    a.v = d_v.data<__nv_bfloat16>();
    a.v_stride = heads * kVHead;
    a.out = d_out.data<__nv_bfloat16>();
    a.out_stride = heads * kVHead;
    a.lse = d_lse.data<float>();
    a.merge = pi > 0;
    a.seqs = reinterpret_cast<const MlaPrefillSeq*>(keep[keep.size() - 2].raw());
    a.work = reinterpret_cast<const MlaPrefillWork*>(keep.back().raw());
    a.num_work = static_cast<int>(work.size());
    a.num_heads = heads;
    a.scale = p.d.scale;
    a.block_m = block_m;
    a.use_wgmma = use_wgmma;
    ASSERT_EQ(launch_mla_prefill(a, nullptr), cudaSuccess) << name;
  }
  const std::string tag = name + (use_wgmma ? " wgmma" : " mma.sync");
  expect_close(tag, from_bf16(host_copy<uint16_t>(d_out)), want, kOutAtol, kOutRtol, heads * kVHead, "out");
  expect_close(tag, host_copy<float>(d_lse), want_lse, kLseAtol, kLseRtol, heads, "lse");
}

// check_kernel_variant for both kernel variants, the reference computed once.
void check_kernel(const std::string& name, const Problem& p, const std::vector<Piece>& pieces, int block_m) {
  std::vector<float> want, want_lse;
  reference(p, &want, &want_lse);
  for (bool wgmma : {false, true}) check_kernel_variant(name, p, pieces, block_m, wgmma, want, want_lse);
}

TEST_F(MlaPrefill, KernelSingleSequences) {
  for (int heads : {16, 128}) {
    for (int n : {1, 7, 64, 129, 1000, 3000}) {
      if (heads == 128 && n == 3000) continue;  // CPU reference time; 1000 covers it
      Problem p = make_problem(heads, {{0, n}}, 100 + n);
      for (int bm : {64, 128})
        check_kernel("kernel h" + std::to_string(heads) + " n" + std::to_string(n) + " bm" + std::to_string(bm), p,
                     {{0, 1 << 30}}, bm);
    }
  }
}

const std::vector<SeqSpec> kRagged = {{0, 1}, {5, 30}, {100, 17}, {0, 256}, {2000, 3}};

TEST_F(MlaPrefill, KernelRaggedBatch) {
  for (int heads : {16, 128}) {
    Problem p = make_problem(heads, kRagged, 200 + heads);
    for (int bm : {64, 128})
      check_kernel("kernel ragged h" + std::to_string(heads) + " bm" + std::to_string(bm), p, {{0, 1 << 30}}, bm);
  }
}

TEST_F(MlaPrefill, KernelKeyPiecesMergeByLse) {
  // Pieces cut through the context, the new tokens and a tile's diagonal.
  Problem p = make_problem(16, {{2000, 100}}, 300);
  check_kernel("kernel pieces 3", p, {{0, 700}, {700, 1500}, {1500, 2100}}, 128);
  check_kernel("kernel pieces diag", p, {{0, 2030}, {2030, 2061}, {2061, 2100}}, 64);
  Problem r = make_problem(16, kRagged, 301);  // pieces of 64 over every sequence
  std::vector<Piece> pieces;
  for (int b = 0; b < 2003; b += 64) pieces.push_back({b, b + 64});
  check_kernel("kernel ragged pieces 64", r, pieces, 64);
}

TEST_F(MlaPrefill, KernelRefusesMisalignedInput) {
  MlaPrefillParams a;
  MlaPrefillSeq s;
  MlaPrefillWork w;
  a.seqs = &s;
  a.work = &w;
  a.num_work = 1;
  a.num_heads = 16;
  a.scale = 0.1f;
  a.q_stride = 16 * kQk + 1;  // not a multiple of 8 elements
  EXPECT_EQ(launch_mla_prefill(a, nullptr), cudaErrorInvalidValue);
  a.q_stride = 16 * kQk;
  a.block_m = 96;
  EXPECT_EQ(launch_mla_prefill(a, nullptr), cudaErrorInvalidValue);
}

// --------------------------------------------------------------- backend ---

// Runs MlaPrefillAttentionOp ("cuda_flash") over a paged cache (layer 1 of
// 2; blocks assigned in shuffled order) and checks the served rows; rows of
// unserved sequences must keep their poison.
void check_backend(const std::string& name, const Problem& p, int block_size, int64_t chunk, AttentionMode mode) {
  const int heads = static_cast<int>(p.d.num_heads);
  const int64_t num_seqs = static_cast<int64_t>(p.seqs.size());
  int max_blocks = 0, num_blocks = 0;
  for (const auto& s : p.seqs) {
    const int b = (s.keys() + block_size - 1) / block_size;
    max_blocks = std::max(max_blocks, b);
    num_blocks += b;
  }
  num_blocks += 3;  // spare blocks hold unrelated rows
  std::vector<int32_t> order(num_blocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(block_size * 7 + heads));
  // Both layers random, then layer 1's rows of each sequence written at its slots.
  const int64_t layer_numel = static_cast<int64_t>(num_blocks) * block_size * kLatent;
  std::vector<float> cache = random_bf16_values(2 * layer_numel, 1.0f, 400 + block_size);
  StepInputs si;
  si.max_blocks_per_seq = max_blocks;
  si.block_tables.assign(num_seqs * max_blocks, -1);
  si.query_start = {0};
  int next = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const SeqSpec& sp = p.seqs[s];
    for (int b = 0; b < (sp.keys() + block_size - 1) / block_size; ++b)
      si.block_tables[s * max_blocks + b] = order[next++];
    for (int j = 0; j < sp.keys(); ++j) {
      const int64_t slot = static_cast<int64_t>(si.block_tables[s * max_blocks + j / block_size]) * block_size +
                           j % block_size;
      std::copy(p.latent[s].data() + j * kLatent, p.latent[s].data() + (j + 1) * kLatent,
                cache.data() + layer_numel + slot * kLatent);
      if (j >= sp.context) {
        si.token_ids.push_back(0);
        si.positions.push_back(j);
        si.slot_mapping.push_back(slot);
      }
    }
    si.query_start.push_back(si.query_start.back() + sp.num_q);
    si.context_lens.push_back(sp.context);
  }
  KvCache kv;
  kv.data = device_copy(to_bf16(cache), DType::kBF16).view({2, num_blocks, block_size, kLatent});
  kv.num_layers = 2;
  kv.num_blocks = num_blocks;
  kv.block_size = block_size;
  kv.width = kLatent;
  LinearWeight kv_b;
  kv_b.name = "kv_b_proj";
  kv_b.out_features = static_cast<int64_t>(heads) * (kNope + kVHead);
  kv_b.in_features = kLora;
  kv_b.weight = device_copy(to_bf16(p.w), DType::kBF16).view({kv_b.out_features, kLora});

  MlaPrefillAttentionOp op(1, &kv_b, p.d, mode, chunk);
  ASSERT_TRUE(op.select_backend(Device::kCuda).ok());
  ASSERT_EQ(op.backend(), "cuda_flash");
  StepResources res;  // the step's workspace and plans, as the engine's
  ASSERT_TRUE(res.reserve_ops({&op}, StepLimits{}, Device::kCuda).ok());
  DeviceInputUploader uploader;
  DeviceStepInputs dev = uploader.upload(si);
  OpContext ctx;
  ctx.device = Device::kCuda;
  ctx.stream = cuda::context().stream;
  ctx.inputs = &si;
  ctx.dev = &dev;
  ctx.kv_cache = &kv;
  Tensor q = device_copy(to_bf16(p.q), DType::kBF16).view({p.rows(), heads * kQk});
  Tensor o = device_poisoned(p.rows() * heads * kVHead, DType::kBF16).view({p.rows(), heads * kVHead});
  for (int pass = 0; pass < 2; ++pass) {  // again: reused state, plan and workspace give the same result
    const Status begun = res.begin_step(ctx);
    ASSERT_TRUE(begun.ok()) << name << ": " << begun.to_string();
    op.run(ctx, {q}, {o});
    ASSERT_TRUE(ctx.error.ok()) << name << ": " << ctx.error.to_string();
  }
  std::vector<float> got = from_bf16(host_copy<uint16_t>(o)), want, want_lse;
  reference(p, &want, &want_lse);
  // Unserved rows: the poison pattern must still be there.
  const float poison = bf16_to_f32(0x7f7f);
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (serves_sequence(mode, false, p.seqs[s].num_q)) continue;
    for (int64_t r = p.q_begin[s]; r < p.q_begin[s + 1]; ++r)
      for (int64_t c = 0; c < heads * kVHead; ++c) {
        ASSERT_EQ(got[r * heads * kVHead + c], poison) << name << ": unserved row " << r << " written";
        got[r * heads * kVHead + c] = want[r * heads * kVHead + c];
      }
  }
  expect_close(name, got, want, kOutAtol, kOutRtol, heads * kVHead, "out");
}

TEST_F(MlaPrefill, BackendSingleSequences) {
  for (int n : {1, 7, 64, 129, 1000, 3000}) {
    Problem p = make_problem(16, {{0, n}}, 500 + n);
    check_backend("backend h16 n" + std::to_string(n), p, 16, 8192, AttentionMode::kExpanded);
  }
}

TEST_F(MlaPrefill, BackendRaggedBatchBlockSizesAndChunks) {
  for (int heads : {16, 128}) {
    Problem p = make_problem(heads, kRagged, 600 + heads);
    for (int bs : {1, 16, 64}) {
      if (heads == 128 && bs != 16) continue;
      const std::string tag = "backend ragged h" + std::to_string(heads) + " bs" + std::to_string(bs);
      check_backend(tag + " one batch", p, bs, 8192, AttentionMode::kExpanded);
      check_backend(tag + " chunk 300", p, bs, 300, AttentionMode::kExpanded);  // batches + pieces
      check_backend(tag + " chunk 64", p, bs, 64, AttentionMode::kExpanded);    // pieces everywhere
      check_backend(tag + " auto", p, bs, 8192, AttentionMode::kAuto);          // 1-token sequence not served
    }
  }
}

TEST_F(MlaPrefill, BackendRefusals) {
  MlaDims dims{16, kNope, kRope, kVHead, kLora, 0.1f};
  LinearWeight w;
  w.name = "kv_b_proj";
  w.out_features = 16 * (kNope + kVHead);
  w.in_features = kLora;
  w.weight = Tensor::empty({w.out_features, kLora}, DType::kBF16, Device::kCuda);
  MlaPrefillAttentionOp ok_op(0, &w, dims, AttentionMode::kAuto, 8192);
  EXPECT_TRUE(cuda_ops::mla_prefill_flash_supports(ok_op).ok());
  // Head dims the kernel is not built for: the next backend takes the op.
  MlaDims odd = dims;
  odd.qk_rope = 32;
  MlaPrefillAttentionOp bad(0, &w, odd, AttentionMode::kAuto, 8192);
  Status s = cuda_ops::mla_prefill_flash_supports(bad);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("128/64/128"), std::string::npos) << s.message();
  ASSERT_TRUE(bad.select_backend(Device::kCuda).ok());
  EXPECT_NE(bad.backend(), "cuda_flash");
  // A weight no K/V expansion reads (packed FP4: U8 [n, k/2]).
  LinearWeight fp4 = w;
  fp4.weight = Tensor::empty({w.out_features, kLora / 2}, DType::kU8, Device::kCuda);
  MlaPrefillAttentionOp fp4_op(0, &fp4, dims, AttentionMode::kAuto, 8192);
  s = cuda_ops::mla_prefill_flash_supports(fp4_op);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("FP4"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace nucleus::kernels
