// "cuda_flash": expanded-form MLA prefill attention on tensor cores (the
// plain-kernel "cuda_naive" is at the end of the file).
//
// Per step (PrefillPlan, shared by the layers), for the sequences the ops serve:
//  1. plan on the host: each sequence needs the K/V of its key positions
//     [0, context_len + query_len); sequences are packed (first-fit,
//     longest first) into batches whose keys fit the K/V scratch
//     (context_chunk keys); a sequence with more keys than that runs alone,
//     in key pieces of context_chunk merged by log-sum-exp;
//  2. one upload of every launch's descriptors (sequences, work list);
// then per call (one layer), the K/V scratch in the step workspace:
//  3. per batch: the K/V of each sequence expanded from the latent cache into
//     the scratch (GatherKvBProj layout: k [keys, heads, 192], v [keys, heads,
//     128]), then ONE attention launch for all of the batch's sequences.
// With the default chunk (8192) a typical prefill step is one batch: one
// attention launch per layer. Every key, the chunk's own included, is read
// back from the latent cache, so an FP8 cache (e4m3 x k_scale, dequantized by
// GatherKvBProj) gives prefill the values decode will read.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "core/cuda/context.h"
#include "core/cuda/cuda_check.h"
#include "core/knobs.h"
#include "kernels/mla/gather_kv_b_proj.cuh"
#include "kernels/mla/mla_attention_naive.cuh"
#include "kernels/mla/mla_prefill.cuh"
#include "ops/gather_kv_b_proj.h"
#include "ops/linear_cuda.h"
#include "ops/mla_attention_cuda.h"
#include "ops/mla_prefill_cuda.h"
#include "ops/op_cuda_check.h"

namespace nucleus::cuda_ops {

namespace {

using kernels::MlaPrefillSeq;
using kernels::MlaPrefillWork;

cudaStream_t engine_stream() { return cuda::context().stream; }

// NUCLEUS_MLA_PREFILL_WGMMA=0 runs the kernel's mma.sync variant instead of
// the wgmma one (A/B runs; both are tested).
bool use_wgmma() {
  static const bool on = env_flag(Knob::kMlaPrefillWgmma);
  return on;
}


GatherKvBProjSpec expansion_spec(const MlaPrefillAttentionOp& op) {
  const auto& d = op.dims();
  GatherKvBProjSpec spec;
  spec.num_heads = d.num_heads;
  spec.qk_nope = d.qk_nope;
  spec.qk_rope = d.qk_rope;
  spec.v_head = d.v_head;
  spec.kv_lora = d.kv_lora;
  spec.cache_dtype = op.cache_dtype();
  return spec;
}

// Per-op state (kept alive by op.state()[0]): the K/V expansion bound to
// this layer's kv_b_proj.
struct FlashState {
  std::unique_ptr<GatherKvBProj> expand;
};

// Made at reservation (mla_prefill_flash_reserve), before the KV pool is
// sized, so what the expansion allocates (the unfused path's bf16 copy of an
// FP8 kv_b_proj) counts against the KV budget; or on first use.
Status make_state(MlaPrefillAttentionOp& op) {
  auto& st = op.state();
  if (!st.empty()) return ok_status();
  NUCLEUS_ASSIGN_OR_RETURN(auto expand, GatherKvBProj::create(op.kv_b(), expansion_spec(op), Device::kCuda));
  auto s = std::make_shared<FlashState>();
  s->expand = std::move(expand);
  st.push_back(Tensor::wrap(s.get(), {1}, DType::kU8, Device::kCpu, s));
  return ok_status();
}

FlashState& state_of(MlaPrefillAttentionOp& op) {
  Status s = make_state(op);
  NUCLEUS_CHECK(s.ok(), "cuda_flash: {}", s.to_string());  // supports() read the format
  return *static_cast<FlashState*>(op.state()[0].raw());
}

// The expansion's own workspace (after the ScratchLayout), 0 before the state is made.
size_t expansion_workspace(const MlaPrefillAttentionOp& op, int64_t keys) {
  const auto& st = op.state();
  return st.empty() ? 0 : static_cast<const FlashState*>(st[0].raw())->expand->workspace_bytes(keys);
}

// One sequence's K/V expansion into the scratch.
struct Expansion {
  int64_t seq;
  int64_t key_begin, num_keys, kv_row0;
};

// One attention launch and the expansions before it.
struct Launch {
  std::vector<Expansion> expansions;
  size_t seq_offset = 0, work_offset = 0;  // bytes into the uploaded descriptors
  int num_work = 0;
  int block_m = 128;
  bool piece = false;  // a long sequence's key piece: rows relative to q_begin, LSE merged
  bool merge = false;
  int64_t q_begin = 0;
  int64_t keys = 0;  // scratch rows used
};

struct Served {
  int64_t seq;
  int32_t q_begin, num_q, context;
  int64_t keys() const { return static_cast<int64_t>(context) + num_q; }
};

// Appends `seqs` and their work list (sequences in order, each sequence's
// tiles last-first: heaviest first) to `host`; fills the launch's offsets.
void add_descriptors(const std::vector<MlaPrefillSeq>& seqs, int num_heads, int num_sms, Launch* l,
                     std::vector<uint8_t>* host) {
  int64_t tiles_128 = 0;
  for (const auto& s : seqs) tiles_128 += (s.num_q + 127) / 128;
  l->block_m = kernels::mla_prefill_block_m(tiles_128, num_heads, num_sms);
  std::vector<MlaPrefillWork> work;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const auto& s = seqs[i];
    for (int32_t t = (s.num_q + l->block_m - 1) / l->block_m - 1; t >= 0; --t) {
      const int32_t last_row = std::min(s.num_q, (t + 1) * l->block_m) - 1;
      if (s.q_pos0 + last_row < s.key_begin) continue;  // sees no key of this piece
      work.push_back({static_cast<int32_t>(i), t});
    }
  }
  auto append = [&](const void* src, size_t bytes) {
    const size_t at = (host->size() + 15) / 16 * 16;
    host->resize(at + bytes);
    if (bytes) std::memcpy(host->data() + at, src, bytes);
    return at;
  };
  l->seq_offset = append(seqs.data(), seqs.size() * sizeof(MlaPrefillSeq));
  l->work_offset = append(work.data(), work.size() * sizeof(MlaPrefillWork));
  l->num_work = static_cast<int>(work.size());
}

// The step's batching (step 1 and 2 above), shared by the prefill ops of one
// head shape, mode and context chunk: every layer runs the same launches.
class PrefillPlan : public StepPlan {
 public:
  PrefillPlan(AttentionMode mode, int num_heads, int64_t capacity) : mode_(mode), num_heads_(num_heads), capacity_(capacity) {}

  Status plan(OpContext& ctx) override;

  std::vector<Launch> launches;
  int64_t need_keys = 0, longest_q = 0;
  Tensor meta;  // device copy of `host`, grown as steps need (kept: read by every layer)
  std::vector<uint8_t> host;

 private:
  AttentionMode mode_;
  int num_heads_;
  int64_t capacity_;
};

Status PrefillPlan::plan(OpContext& ctx) {
  const StepInputs& si = *ctx.inputs;
  launches.clear();
  host.clear();
  need_keys = longest_q = 0;
  std::vector<Served> served;
  for (int64_t s = 0; s < si.num_seqs(); ++s) {
    const int32_t num_q = si.query_len(s);
    if (num_q == 0 || !serves_sequence(mode_, false, num_q)) continue;
    served.push_back({s, si.query_start[s], num_q, si.context_lens[s]});
  }
  if (served.empty()) return ok_status();
  std::stable_sort(served.begin(), served.end(), [](const Served& a, const Served& b) { return a.keys() > b.keys(); });

  const int num_sms = cuda::context().num_sms;
  const int num_heads = num_heads_;
  const int64_t capacity = capacity_;

  // Batches: first-fit decreasing into scratch-sized bins.
  std::vector<std::vector<const Served*>> bins;
  std::vector<int64_t> bin_keys;
  for (const auto& s : served) {
    if (s.keys() > capacity) {  // pieces of `capacity` keys, merged by LSE
      longest_q = std::max<int64_t>(longest_q, s.num_q);
      for (int64_t k0 = 0; k0 < s.keys(); k0 += capacity) {
        Launch l;
        l.piece = true;
        l.merge = k0 > 0;
        l.q_begin = s.q_begin;
        l.keys = std::min(capacity, s.keys() - k0);
        l.expansions.push_back({s.seq, k0, l.keys, 0});
        MlaPrefillSeq desc{0, s.num_q, s.context, 0, static_cast<int32_t>(k0), static_cast<int32_t>(k0 + l.keys)};
        add_descriptors({desc}, num_heads, num_sms, &l, &host);
        launches.push_back(std::move(l));
      }
      continue;
    }
    size_t b = 0;
    while (b < bins.size() && bin_keys[b] + s.keys() > capacity) ++b;
    if (b == bins.size()) {
      bins.emplace_back();
      bin_keys.push_back(0);
    }
    bins[b].push_back(&s);
    bin_keys[b] += s.keys();
  }
  for (const auto& bin : bins) {
    Launch l;
    std::vector<MlaPrefillSeq> descs;
    for (const Served* s : bin) {
      l.expansions.push_back({s->seq, 0, s->keys(), l.keys});
      descs.push_back({s->q_begin, s->num_q, s->context, static_cast<int32_t>(l.keys), 0,
                       static_cast<int32_t>(s->keys())});
      l.keys += s->keys();
    }
    add_descriptors(descs, num_heads, num_sms, &l, &host);
    launches.push_back(std::move(l));
  }
  for (const auto& l : launches) need_keys = std::max(need_keys, l.keys);

  // One upload of every launch's descriptors.
  if (!meta.defined() || meta.nbytes() < host.size()) {
    meta = Tensor();  // the old buffer goes first, so its memory counts toward the new one
    NUCLEUS_ASSIGN_OR_RETURN(meta, try_empty({std::max<int64_t>(static_cast<int64_t>(host.size()), 16)}, DType::kU8,
                                             Device::kCuda, "mla_prefill descriptors"));
  }
  NUCLEUS_OP_CUDA_CHECK(cudaMemcpyAsync(meta.raw(), host.data(), host.size(), cudaMemcpyHostToDevice, engine_stream()));
  return ok_status();
}

// The step workspace's layout: K [keys, heads, qk_head] and V [keys, heads,
// v_head] bf16, then the LSE [rows, heads] f32, each 256-byte aligned.
struct ScratchLayout {
  size_t k = 0, v = 0, lse = 0, end = 0;
};
ScratchLayout scratch_layout(const kernels::MlaDims& d, int64_t keys, int64_t lse_rows) {
  auto up = [](size_t x) { return (x + 255) / 256 * 256; };
  ScratchLayout l;
  l.v = up(static_cast<size_t>(keys * d.num_heads * d.qk_head() * 2));
  l.lse = l.v + up(static_cast<size_t>(keys * d.num_heads * d.v_head * 2));
  l.end = l.lse + up(static_cast<size_t>(lse_rows * d.num_heads * 4));
  return l;
}

}  // namespace

Status mla_prefill_flash_supports(const MlaPrefillAttentionOp& op) {
  const auto& d = op.dims();
  if (op.cache_dtype() != KvCacheDtype::kFp8DsMla)  // fp8_ds_mla: read by the expansion (unfused gather_kv_b_proj)
    NUCLEUS_RETURN_IF_ERROR(cuda_cache_dtype_supported(op.cache_dtype()));
  if (d.qk_nope != 128 || d.qk_rope != 64 || d.v_head != 128)
    return unsupported("head dims nope/rope/v = " + std::to_string(d.qk_nope) + "/" + std::to_string(d.qk_rope) +
                       "/" + std::to_string(d.v_head) + " (the kernel is built for 128/64/128)");
  if (d.num_heads < 1 || d.num_heads > 65535) return unsupported("num_heads " + std::to_string(d.num_heads));
  if (d.kv_lora % 8 != 0) return unsupported("kv_lora " + std::to_string(d.kv_lora) + " is not a multiple of 8");
  if (!(d.scale > 0.0f)) return unsupported("softmax scale is not set");
  auto format = read_kv_b_weight_format(op.kv_b(), expansion_spec(op));
  if (!format.ok()) return unsupported("K/V expansion: " + format.status().message());
  if (op.context_chunk() < 1) return unsupported("context chunk " + std::to_string(op.context_chunk()) + " < 1");
  return ok_status();
}

size_t mla_prefill_flash_workspace(const MlaPrefillAttentionOp& op, const StepLimits& limits) {
  int64_t keys = op.context_chunk();  // a batch's or piece's keys
  if (limits.block_size > 0 && limits.max_blocks_per_seq > 0 && limits.max_seqs > 0)
    keys = std::min(keys, limits.max_seqs * limits.max_blocks_per_seq * limits.block_size);
  return scratch_layout(op.dims(), keys, std::max<int64_t>(limits.max_tokens, 1)).end + expansion_workspace(op, keys);
}

Status mla_prefill_flash_reserve(MlaPrefillAttentionOp& op, const StepLimits&, Device) {
  return make_state(op).with_context("cuda_flash K/V expansion");
}

std::shared_ptr<StepPlan> mla_prefill_flash_plan(const MlaPrefillAttentionOp& op) {
  return std::make_shared<PrefillPlan>(op.mode(), static_cast<int>(op.dims().num_heads), op.context_chunk());
}

void mla_prefill_flash(MlaPrefillAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const StepInputs& si = *ctx.inputs;
  const DeviceStepInputs& dev = *ctx.dev;
  KvCache& kv = *ctx.kv_cache;
  check_cache_dtype(kv, op.cache_dtype(), "mla_prefill cuda_flash");
  const auto& d = op.dims();
  const int num_heads = static_cast<int>(d.num_heads);
  const Tensor& q = in[0];
  const Tensor& o = out[0];
  auto* plan = dynamic_cast<PrefillPlan*>(op.step_plan());
  if (!plan)
    return ctx.fail(failed_precondition("cuda_flash mla_prefill without its step plan (select the backend and begin "
                                        "the step with StepResources)"));
  if (plan->launches.empty()) return;
  if (Status s = make_state(op); !s.ok()) return ctx.fail(s.with_context("cuda_flash K/V expansion"));
  FlashState& state = state_of(op);
  const ScratchLayout lay = scratch_layout(d, plan->need_keys, plan->longest_q);
  const size_t expand_bytes = state.expand->workspace_bytes(plan->need_keys);  // after lay.end
  if (lay.end + expand_bytes > ctx.workspace.bytes)
    return ctx.fail(resource_exhausted("mla_prefill: the step's K/V expansion needs " +
                                       std::to_string(lay.end + expand_bytes) +
                                       " bytes of workspace, the step reserved " +
                                       std::to_string(ctx.workspace.bytes)));
  auto* base = static_cast<uint8_t*>(ctx.workspace.data);
  auto* k_scratch = reinterpret_cast<__nv_bfloat16*>(base + lay.k);
  auto* v_scratch = reinterpret_cast<__nv_bfloat16*>(base + lay.v);
  auto* lse = reinterpret_cast<float*>(base + lay.lse);
  cudaStream_t stream = engine_stream();

  const void* cache = kv.layer_data(op.layer());
  const float k_scale = kv.layer_k_scale(op.layer());
  const auto* meta = static_cast<const uint8_t*>(plan->meta.raw());
  for (const auto& l : plan->launches) {
    for (const auto& e : l.expansions) {
      GatherKvBProjArgs a;
      a.cache = cache;
      a.k_scale = k_scale;
      a.block_table = dev.block_tables + e.seq * si.max_blocks_per_seq;
      a.block_size = kv.block_size;
      a.key_begin = e.key_begin;
      a.num_keys = e.num_keys;
      a.k = k_scratch + e.kv_row0 * d.num_heads * d.qk_head();
      a.v = v_scratch + e.kv_row0 * d.num_heads * d.v_head;
      a.stream = stream;
      a.workspace = expand_bytes ? base + lay.end : nullptr;
      a.workspace_bytes = expand_bytes;
      state.expand->run(a);
    }
    kernels::MlaPrefillParams p;
    p.q = q.data<__nv_bfloat16>() + (l.piece ? l.q_begin * q.row_numel() : 0);
    p.q_stride = q.row_numel();
    p.k = k_scratch;
    p.k_stride = d.num_heads * d.qk_head();
    p.v = v_scratch;
    p.v_stride = d.num_heads * d.v_head;
    p.out = o.data<__nv_bfloat16>() + (l.piece ? l.q_begin * o.row_numel() : 0);
    p.out_stride = o.row_numel();
    p.lse = l.piece ? lse : nullptr;
    p.merge = l.merge;
    p.seqs = reinterpret_cast<const MlaPrefillSeq*>(meta + l.seq_offset);
    p.work = reinterpret_cast<const MlaPrefillWork*>(meta + l.work_offset);
    p.num_work = l.num_work;
    p.num_heads = num_heads;
    p.scale = d.scale;
    p.block_m = l.block_m;
    p.use_wgmma = use_wgmma();
    NUCLEUS_OP_CUDA_CHECK(kernels::launch_mla_prefill(p, stream));
  }
}

// "cuda_naive": expanded-form attention on the plain kernels
// (kernels/mla/mla_attention_naive.cuh).
namespace {

// Grows `t` to `shape`; kResourceExhausted when the device has no room (the
// step fails, the process goes on).
Status ensure(Tensor& t, std::vector<int64_t> shape, DType dtype) {
  if (t.defined() && t.numel() >= shape_numel(shape)) return ok_status();
  t = Tensor();  // the old buffer goes first, so its memory counts toward the new one
  NUCLEUS_ASSIGN_OR_RETURN(t, try_empty(std::move(shape), dtype, Device::kCuda, "mla_prefill cuda_naive scratch"));
  return ok_status();
}

constexpr int64_t kQueryGroup = 512;           // query rows per expanded launch
constexpr int64_t kKvBudgetBytes = 256ll << 20;  // expanded K/V scratch
}  // namespace

Status mla_prefill_naive_supports(const MlaPrefillAttentionOp& op) {
  if (op.cache_dtype() == KvCacheDtype::kFp8DsMla)
    return op.dims().kv_lora == kDsMlaLatent && op.dims().qk_rope == kDsMlaRope
               ? ok_status()
               : unsupported("fp8_ds_mla rows need kv_lora 512 and qk_rope 64");
  return cuda_cache_dtype_supported(op.cache_dtype());
}

void mla_prefill_naive(MlaPrefillAttentionOp& op, OpContext& ctx, const TensorList& in, const TensorList& out) {
  const StepInputs& si = *ctx.inputs;
  const DeviceStepInputs& dev = *ctx.dev;
  KvCache& kv = *ctx.kv_cache;
  check_cache_dtype(kv, op.cache_dtype(), "mla_prefill cuda_naive");
  const kernels::MlaShape s = mla_naive_shape(op.dims());
  const void* cache = kv.layer_data(op.layer());
  const DType cache_dtype = kv.data.dtype();
  const float k_scale = kv.layer_k_scale(op.layer());
  const Tensor& q = in[0];
  const Tensor& o = out[0];
  // state: latent rows, expanded K/V, running output, running LSE, and for
  // an FP8 kv_b the expansion's scratch and its split counters.
  auto& st = op.state();
  st.resize(6);
  const int64_t kv_width = s.num_heads * (s.qk_nope + s.v_head);
  const int64_t chunk = std::max<int64_t>(
      64, std::min<int64_t>(op.context_chunk(), kKvBudgetBytes / (kv_width * 2)));
  Fp8LinearScratch fp8_scratch;
  if (op.kv_b().fp8()) {
    const size_t bytes = fp8_linear_scratch_bytes(chunk, kv_width, s.latent(), Fp8Path::kAuto);
    const int64_t counters = fp8_linear_scratch_counters(kv_width);
    const bool fresh = !st[5].defined() || st[5].numel() < counters;
    for (Status e : {ensure(st[4], {std::max<int64_t>(1, static_cast<int64_t>(bytes))}, DType::kU8),
                     ensure(st[5], {counters}, DType::kI32)})
      if (!e.ok()) return ctx.fail(std::move(e));
    if (fresh) NUCLEUS_OP_CUDA_CHECK(cudaMemsetAsync(st[5].raw(), 0, counters * sizeof(int), engine_stream()));
    fp8_scratch = fp8_linear_scratch_carve(st[4].raw(), bytes, chunk, kv_width, s.latent(), Fp8Path::kAuto,
                                           st[5].data<int>(), counters);
  }
  for (int64_t seq = 0; seq < si.num_seqs(); ++seq) {
    const int32_t num_q = si.query_len(seq);
    if (num_q == 0 || !serves_sequence(op.mode(), false, num_q)) continue;
    const int64_t q_begin = si.query_start[seq], ctx_len = si.context_lens[seq];
    const int32_t* table = dev.block_tables + seq * si.max_blocks_per_seq;
    for (Status e : {ensure(st[0], {chunk, s.latent()}, DType::kBF16), ensure(st[1], {chunk, kv_width}, DType::kBF16),
                     ensure(st[2], {kQueryGroup, s.num_heads, s.v_head}, DType::kF32),
                     ensure(st[3], {kQueryGroup, s.num_heads}, DType::kF32)})
      if (!e.ok()) return ctx.fail(std::move(e));
    for (int64_t i0 = 0; i0 < num_q; i0 += kQueryGroup) {
      const int64_t nq = std::min<int64_t>(kQueryGroup, num_q - i0);
      const int64_t keys = ctx_len + i0 + nq;  // causal: the group's last query sees these
      for (int64_t k0 = 0; k0 < keys; k0 += chunk) {
        const int64_t nk = std::min(chunk, keys - k0);
        // Latent rows as bf16 (an FP8 row times k_scale, an fp8_ds_mla row times its tile scales, rounded once).
        NUCLEUS_OP_CUDA_CHECK(kernels::launch_gather_dequant_latent(cache, cache_dtype, s.latent(), k_scale, table,
                                                                 static_cast<int>(kv.block_size), k0, nk,
                                                                 st[0].data<__nv_bfloat16>(), engine_stream()));
        if (Status ls = linear_forward(op.kv_b(), st[0].raw(), s.latent(), nk, st[1].raw(), DType::kBF16, kv_width,
                                       false, &fp8_scratch);
            !ls.ok())
          return ctx.fail(ls.with_context("mla_prefill kv_b expansion"));
        kernels::MlaExpandedPieceParams p;
        p.s = s;
        p.q = q.data<__nv_bfloat16>() + (q_begin + i0) * q.row_numel();
        p.q_stride = q.row_numel();
        p.num_q = nq;
        p.q_pos0 = ctx_len + i0;
        p.kv = st[1].data<__nv_bfloat16>();
        p.latent = st[0].data<__nv_bfloat16>();
        p.key_begin = k0;
        p.num_keys = nk;
        p.acc = st[2].data<float>();
        p.lse = st[3].data<float>();
        p.first = k0 == 0;
        NUCLEUS_OP_CUDA_CHECK(kernels::launch_mla_expanded_piece_naive(p, engine_stream()));
      }
      NUCLEUS_OP_CUDA_CHECK(kernels::launch_mla_store_output(st[2].data<float>(), nq, s.num_heads, s.v_head,
                                                          o.data<__nv_bfloat16>() + (q_begin + i0) * o.row_numel(),
                                                          o.row_numel(), engine_stream()));
    }
  }
}

}  // namespace nucleus::cuda_ops
