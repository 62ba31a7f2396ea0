// The host side of a decode program (mono_program.h): checking stages,
// planning the per-CTA job queues, and the CPU reference that runs a plan.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "kernels/mono/mono_program.h"

namespace nucleus::kernels::mono {

// A program's stages with their jobs laid out on num_ctas CTAs (host memory).
// CTA c runs jobs[queue_start[c] .. queue_start[c + 1]) in order; every queue
// is sorted by stage, which with waits on earlier stages only makes the
// program deadlock-free whenever all CTAs are resident at once.
// cta_weight_bytes[c]: the weight bytes CTA c streams.
struct ProgramPlan {
  std::vector<Stage> stages;
  int32_t width = 0;
  std::vector<int32_t> queue_start;
  std::vector<Job> jobs;
  std::vector<int64_t> cta_weight_bytes;

  int32_t num_ctas() const { return static_cast<int32_t>(queue_start.size()) - 1; }
  // Every stage's weight bytes (each weight read once; a routed stage's as if
  // every slot were used).
  int64_t weight_bytes() const;
};

// OK, or invalid_argument naming stage `index` and the field it cannot take
// in a program of `width` rows: a null or misaligned pointer, k not a
// multiple of 16 in 16 ... kMaxK, an odd n for kSiluMulBf16, tile outside
// 1 ... kMaxTile, a wait on a stage that is not earlier, residual_out
// aliasing residual, an output overlapping the stage's inputs (over
// range_rows rows, as check_program).
Status check_stage(const Stage& s, int index, int32_t width, int32_t range_rows = 0);

// Weight bytes job `job` of stage s streams (a routed job: if its slot is used).
int64_t job_weight_bytes(const Stage& s, int32_t job);

// Checks every stage (check_stage), width in {1, 2, 4, 8}, 1 <= stages <=
// kMaxStages, that every pair of stages sharing memory waits in the order
// it must, and that routed stages have the slots their table can fill;
// returns the stages with Stage::x_reuse filled in (what a Program takes).
// range_rows (1 ... width; 0: width): the rows whose memory the hazard
// checks cover, for buffers that hold fewer rows than the width (a launch
// touches rows < its `rows` only).
StatusOr<std::vector<Stage>> check_program(const std::vector<Stage>& stages, int32_t width, int32_t range_rows = 0);
// What a job costs the dealing besides its weight bytes (its wait, barriers
// and fence, ~0.2 us of streaming on one SM).
constexpr int64_t kJobCostBytes = 8192;
// Deals each stage's jobs, in stage order, to the CTA that has the least cost
// so far (weight bytes plus kJobCostBytes a job; ties: the lowest index). The queues depend only on
// the stages' shapes (kind, n, k, tile, slots), not on their pointers, so a
// caller may deal once and check the stages of each launch (check_program).
ProgramPlan deal_jobs(std::vector<Stage> stages, int32_t width, int32_t num_ctas);
// check_program, then deal_jobs on 1 <= num_ctas CTAs.
StatusOr<ProgramPlan> plan_program(const std::vector<Stage>& stages, int32_t width, int32_t num_ctas);

// The Program a launch takes for `plan` running `rows` rows (1 ... width),
// with the queues and counters at the given addresses (device copies of
// plan.queue_start / plan.jobs for the kernel, the plan's own for the CPU).
Program program_view(const ProgramPlan& plan, int32_t rows, const int32_t* queue_start, const Job* jobs,
                     int32_t* counters);

// The CPU reference: runs `plan` on `rows` rows over host buffers (the
// stages' pointers), picking at every step a CTA at random (seed) among those
// whose next job's waits are met, so any order the kernel may take is one
// this can take. Each job computes what mono_program.h says in f32, every dot
// product in dot_ref's order (kernels/gemm/gemm_ref.h). Returns
// failed_precondition naming the stuck CTAs and their stages if no CTA can
// run while jobs remain (a deadlock the kernel would hang on); plan_program
// never makes such a plan.
Status run_program_ref(const ProgramPlan& plan, int32_t rows, uint64_t seed);

// Two programs as one: `second`'s stages follow `first`'s, their waits and
// route_stage moved past first's stages, and every stage of second that
// waits for nothing in second waits for every stage of first (what a kernel
// boundary between the two would order; second's weights still stream while
// first runs) through first's sinks, the stages no other stage of first
// waits for (a MoE block's: its combine). E.g. a MoE block and the next layer's front (one launch a
// layer boundary). The result has first.size() + second.size() stages;
// check_program refuses more than kMaxStages. x_reuse is cleared (check_program sets it).
std::vector<Stage> join_programs(std::vector<Stage> first, const std::vector<Stage>& second);

// The end of an MLA decode attention as a program, up to o_proj's input: the
// split merge of the nucleus decode attention's partials (kernels/mla/
// mla_decode.cuh, launched without its own merge), then the value
// projection of every head (MLA's absorbed form: the output is o_lat . W_UV):
//   merge  o_lat[r, h] = the attention's splits of row r, head h merged (kMerge)  [8, heads, kv_lora] bf16
//   w_uv   attn_out[r, h * v_head + d] = bf16(o_lat[r, h] . W_UV[h][d])          [rows, heads * v_head] bf16
// with W_UV[h] = kv_b_proj's rows h * (qk_nope + v_head) + qk_nope ... + v_head
// ([v_head, kv_lora] bf16; one slot a head, side by side in each row). With
// splits == 1 the attention wrote o_lat itself (o_lat_in [rows, heads,
// kv_lora] bf16). At most kMaxHeadSlots heads. With q_full set, the stages
// start with the attention (kAttend) whose partials the merge reads.
struct AttentionOutputChain {
  int32_t num_heads = 0, kv_lora = 512, qk_nope = 128, v_head = 128;
  // [heads * (qk_nope + v_head), kv_lora] bf16, or e4m3 with kv_b_scale
  // [heads * (qk_nope + v_head) / 128, kv_lora / 128] (qk_nope and v_head multiples of 128)
  const void* kv_b = nullptr;
  const float* kv_b_scale = nullptr;
  const float* partials = nullptr;  // [rows, splits, heads, kv_lora] f32
  const float* lse = nullptr;       // [rows, splits, heads] f32 (log2 domain)
  const uint16_t* o_lat_in = nullptr;
  int32_t splits = 1, min_split_keys = 0, key_tile = 32;  // the attention launch's
  const int32_t *token_seq = nullptr, *query_start = nullptr, *context_lens = nullptr;
  uint16_t* o_lat = nullptr;     // [8, heads, kv_lora] bf16 scratch
  uint16_t* attn_out = nullptr;  // [rows, attn_out_stride] bf16
  int64_t attn_out_stride = 0;   // 0: heads * v_head
  int32_t tile = 16;             // the value projection's job columns
  // Optional: the attention itself first (q_full set; a kAttend stage), its
  // partials into part_o [8, splits, heads, kv_lora] / part_lse [8, splits,
  // heads] f32, which the merge then reads (partials / lse unused): q_full
  // [rows, heads, kv_lora + qk_rope] bf16, the layer's cache [num_slots,
  // kv_lora + qk_rope] bf16, block_tables [seqs, max_blocks], block_size,
  // softmax scale; qk_rope 64.
  const uint16_t* q_full = nullptr;
  const uint16_t* cache = nullptr;
  int64_t num_slots = 0;
  const int32_t* block_tables = nullptr;
  int32_t max_blocks = 0, block_size = 0, qk_rope = 64;
  float scale = 0.0f;
  float *part_o = nullptr, *part_lse = nullptr;
  int32_t width = kMaxWidth;  // the program's width (jobs: the attention's width * head groups * splits, the merge's width * heads)
  bool attention = false;     // the kAttend stage even while q_full is not known (queues dealt from shapes)
};
std::vector<Stage> attention_output_stages(const AttentionOutputChain& c);

// The chains below take each GEMV weight as a pointer and, beside it, its
// FP8 block scales (`*_scale`, [ceil(n / 128), ceil(k / 128)] f32): a weight whose
// scales are set is float8 e4m3 bytes with DeepSeek-V3's 128 x 128 block
// scaling (WeightType::kFp8Block; the stage's tile a multiple of 16), else
// bf16. Tables of per-expert weights come with tables of their scales.

// The attention-free GEMV chain of a DeepSeek decode layer without a q LoRA
// (DeepSeek-V2-Lite's shape: hidden 2048, q_proj + kv_a_proj 3072 + 576
// rows, o_proj 2048 x 2048, shared experts 2 x 1408), as a program for the
// kernel's tests and benchmarks. Stages (all bf16 but residuals f32 [rows,
// hidden] and norm weights f32 [hidden]):
//   0  front = rmsnorm(residual_in + delta_in) * input_norm . w_front^T   [rows, front_n]
//      (residual_mid = residual_in + delta_in)
//   1  o = front[:, :o_k] . w_o^T                   [rows, hidden]  (front stands in for attention)
//   2  h = silu(g) * u, [g | u] = rmsnorm(residual_mid + o) * post_norm . w_gate_up^T
//      (residual_out = residual_mid + o)            [rows, inter]
//   3  delta_out = h . w_down^T                     [rows, hidden]
// Weights: w_front [front_n, hidden], w_o [hidden, o_k], w_gate_up
// [2 inter, hidden] (gate rows, then up rows), w_down [hidden, inter].
struct LayerChain {
  int64_t hidden = 0, front_n = 0, o_k = 0, inter = 0;  // o_k <= front_n
  float eps = 1e-6f;
  const void *w_front = nullptr, *w_o = nullptr, *w_gate_up = nullptr, *w_down = nullptr;
  const float *front_scale = nullptr, *o_scale = nullptr, *gate_up_scale = nullptr, *down_scale = nullptr;
  const float *input_norm = nullptr, *post_norm = nullptr;
  const float* residual_in = nullptr;
  const uint16_t* delta_in = nullptr;
  float *residual_mid = nullptr, *residual_out = nullptr;
  uint16_t *front = nullptr, *o = nullptr, *h = nullptr, *delta_out = nullptr;
};
// The chain's four stages, every one cut into jobs of `tile` columns.
std::vector<Stage> layer_chain_stages(const LayerChain& c, int32_t tile);

// The MoE block of a DeepSeek decode layer (after attention) as a program,
// optionally starting at the attention's output projection (w_o set):
//   o_proj   delta = bf16(attn_out . w_o^T)                             [rows, hidden]
//   router   logits = x . w_router^T (f32), x = rmsnorm(residual + delta) * post_norm
//            (residual_out = residual + delta)                        [rows, E]
//   select   the route table from the logits (greedy softmax top-k, or noaux_tc)
//   shared   h_shared = silu(g) * u of x . w_shared_gate_up^T          [rows, shared_inter]
//            y_shared = h_shared . w_shared_down^T (f32)               [rows, hidden]
//   routed   h[u] = silu(g) * u of x . w_gate_up[e_u]^T                [slots][8, inter]
//            y[u] = h[u] . w_down[e_u]^T (f32)                         [slots][8, hidden]
//   combine  delta_out = bf16(sum_u weight[r][u] * y[u][r] + y_shared[r])  [rows, hidden]
// (x is rebuilt from residual + delta by every stage that reads it). Without
// shared experts (shared_inter 0) the two shared stages and y_shared are
// left out; without w_o, o_proj (delta is then an input). Weights bf16: w_router [E, hidden], w_gate_up [E][2 inter,
// hidden], w_down [E][hidden, inter], w_shared_gate_up [2 shared_inter,
// hidden], w_shared_down [hidden, shared_inter]; bias [E] f32 or null.
struct MoeChain {
  int64_t hidden = 0, inter = 0, shared_inter = 0;
  int32_t slots = 0;  // routed slots: at least min(width * top_k, num_experts)
  int32_t num_experts = 0, top_k = 0, n_group = 1, topk_group = 1;
  Scoring scoring = Scoring::kSoftmax;
  TopK method = TopK::kGreedy;
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f, eps = 1e-6f;
  const uint16_t* w_router = nullptr;  // bf16
  const void *w_gate_up = nullptr, *w_down = nullptr;
  const float *gate_up_scale = nullptr, *down_scale = nullptr;  // FP8: [E][2 inter / 128, hidden / 128], [E][hidden / 128, inter / 128]
  // Optional: the routed experts' weights by expert index ([E] arrays of
  // pointers; w_gate_up / w_down unused then), for checkpoints that keep each
  // expert in its own tensor; FP8: their scales the same way.
  const void* const* gate_up_table = nullptr;
  const void* const* down_table = nullptr;
  const float* const* gate_up_scale_table = nullptr;
  const float* const* down_scale_table = nullptr;
  // shared_pieces shared experts of shared_inter each (DeepSeek-V2-Lite: 2 of
  // 1408), their weights one after another: w_shared_gate_up [pieces][2
  // shared_inter, hidden], w_shared_down [pieces][hidden, shared_inter];
  // h_shared and y_shared hold [pieces][8, ...]. Summed in piece order after
  // the routed experts (the order of the engine's fused shared experts).
  int32_t shared_pieces = 1;
  const void *w_shared_gate_up = nullptr, *w_shared_down = nullptr;
  const float *shared_gate_up_scale = nullptr, *shared_down_scale = nullptr;
  // Optional: the pieces' weights by piece ([pieces] arrays of pointers).
  const void* const* shared_gate_up_table = nullptr;
  const void* const* shared_down_table = nullptr;
  const float* const* shared_gate_up_scale_table = nullptr;
  const float* const* shared_down_scale_table = nullptr;
  // Optional: the combine also copies residual_out here (the graph's one
  // residual buffer, once every stage that reads `residual` has finished).
  float* residual_copy_to = nullptr;
  // Optional o_proj (when w_o is set): w_o [hidden, o_k], attn_out [rows, o_k] bf16 (row stride o_k).
  const void* w_o = nullptr;
  const float* o_scale = nullptr;
  const uint16_t* attn_out = nullptr;
  int64_t o_k = 0;
  const float *bias = nullptr, *post_norm = nullptr, *residual = nullptr;
  const uint16_t* delta = nullptr;
  float* residual_out = nullptr;
  float* logits = nullptr;  // [8, E]
  RouteTable* table = nullptr;
  uint16_t* h_shared = nullptr;  // [pieces][8, shared_inter]
  float* y_shared = nullptr;     // [pieces][8, hidden]
  uint16_t* h = nullptr;         // [slots][8, inter]
  float* y = nullptr;            // [slots][8, hidden]
  uint16_t* delta_out = nullptr; // [8, hidden]
};
// The block's stages (5 without shared experts, else 7; one more with
// o_proj), GEMV jobs of `tile` columns.
std::vector<Stage> moe_chain_stages(const MoeChain& c, int32_t tile);

// The front of an MLA decode layer as a program:
//   q      x . w_q^T, x = rmsnorm(residual + delta) * input_norm   [rows, heads * (qk_nope + qk_rope)]
//          (with a q LoRA, q_lora > 0: q_a = x . w_qa^T [rows, q_lora], then
//          q = bf16(rmsnorm(q_a) * q_a_norm) . w_qb^T)
//          (residual_out = residual + delta; delta null: the first layer, x = rmsnorm(residual) * w)
//   kv_a   x . w_kva^T                                              [rows, kv_lora + qk_rope]
//   absorb (optional, w_uk_t set) q_full[r, h, :kv_lora] = bf16(q_nope[r, h] . W_UK[h])   (one slot a head)
//   rope   q_pe rotated in place (and into q_full[r, h, kv_lora:] with the absorption);
//          cache[slot] = [rmsnorm(c_kv) * kv_norm | rope(k_pe)] (slot -1: none);
//          residual_out copied to residual_copy_to when set
// (kRopeCache: kernels/rope/rope_ref.h's rotation; the decode attention then
// reads q and the cache).
struct FrontChain {
  int64_t hidden = 0;
  int32_t num_heads = 0, qk_nope = 128, qk_rope = 64, kv_lora = 512;
  float eps = 1e-6f, kv_eps = 1e-6f, attention_factor = 1.0f;  // input norm's, kv norm's
  const void *w_q = nullptr, *w_kva = nullptr;
  const float *q_scale = nullptr, *kva_scale = nullptr;
  int64_t q_lora = 0;  // > 0: w_qa [q_lora, hidden], q_a_norm [q_lora] f32, w_qb [heads * head, q_lora], q_a [8, q_lora]
  const void *w_qa = nullptr, *w_qb = nullptr;
  const float *qa_scale = nullptr, *qb_scale = nullptr;
  const float* q_a_norm = nullptr;
  float q_a_eps = 1e-6f;
  uint16_t* q_a = nullptr;
  const float *input_norm = nullptr, *kv_norm = nullptr, *inv_freq = nullptr;
  const float* residual = nullptr;
  const uint16_t* delta = nullptr;
  float* residual_out = nullptr;     // null without a delta
  float* residual_copy_to = nullptr;
  uint16_t *q = nullptr, *kv_a = nullptr;
  const int32_t* positions = nullptr;
  const int64_t* slot_mapping = nullptr;
  uint16_t* cache = nullptr;
  int64_t num_slots = 0;
  // Optional: the MLA absorption of the decode attention's query (MLA's
  // absorbed form, DeepSeek-V2 paper section 2.1.2): w_uk_t [heads, kv_lora,
  // qk_nope] bf16, head h's W_UK transposed (row c holds kv_b_proj[h *
  // (qk_nope + v_head) + d][c] for d < qk_nope); q_full [8, heads, kv_lora +
  // qk_rope] bf16, what the decode attention reads; jobs of absorb_tile
  // columns. At most kMaxHeadSlots heads. FP8 (uk_t_scale set): e4m3 with
  // the transposed blocks' scales [heads][kv_lora / 128, qk_nope / 128].
  const void* w_uk_t = nullptr;
  const float* uk_t_scale = nullptr;
  uint16_t* q_full = nullptr;
  int32_t absorb_tile = 64;
  // Optional: the decode attention after the RoPE stage (a kAttend stage,
  // attention_output_stages' first, on q_full and the cache rows RoPE wrote;
  // its partials go where `attend` says, for a later program's merge).
  const AttentionOutputChain* attend = nullptr;
};
std::vector<Stage> front_chain_stages(const FrontChain& c, int32_t tile);

// FrontChain::w_uk_t from kv_b_proj [heads * (qk_nope + v_head), kv_lora]
// (host memory; T = uint16_t for bf16, uint8_t for e4m3): [heads, kv_lora,
// qk_nope], row c of head h holding kv_b[h * (qk_nope + v_head) + d][c] for
// d < qk_nope.
template <typename T>
std::vector<T> transpose_w_uk(const T* kv_b, int64_t heads, int64_t qk_nope, int64_t v_head, int64_t kv_lora) {
  std::vector<T> t(static_cast<size_t>(heads * kv_lora * qk_nope));
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < qk_nope; ++d)
      for (int64_t c = 0; c < kv_lora; ++c) t[(h * kv_lora + c) * qk_nope + d] = kv_b[(h * (qk_nope + v_head) + d) * kv_lora + c];
  return t;
}
// FrontChain::uk_t_scale for an e4m3 kv_b with 128 x 128 block scales
// ([heads * (qk_nope + v_head) / 128, ceil(kv_lora / 128)] f32): the
// transposed blocks' scales [heads, ceil(kv_lora / 128), qk_nope / 128], the
// same values (block (c / 128, d / 128) of head h's W_UK^T is block (h
// (qk_nope + v_head) / 128 + d / 128, c / 128) of kv_b). qk_nope and v_head
// multiples of 128.
std::vector<float> transpose_w_uk_scale(const float* scale, int64_t heads, int64_t qk_nope, int64_t v_head,
                                        int64_t kv_lora);

// A decode program's own attention (a front's kAttend stage and the merge of
// the next MoE program): its KV splits at `width` rows of `num_heads` heads
// on num_ctas CTAs, so that width * head groups * splits fills the CTAs (2 ...
// kMaxMergeSplits), with splits of at least kProgramAttentionMinSplitKeys keys
// in tiles of kProgramAttentionKeyTile (kernels/mla/mla_split_plan.h).
constexpr int32_t kProgramAttentionMinSplitKeys = 32, kProgramAttentionKeyTile = 32;
int32_t program_attention_splits(int32_t width, int32_t num_heads, int32_t num_ctas);
// Floats of its partials buffer (part_o then part_lse) at any width, for
// num_heads heads of kv_lora and num_ctas CTAs.
int64_t program_attention_floats(int32_t num_heads, int32_t kv_lora, int32_t num_ctas);
// The plan both sides use at `width` rows: the splits and where in `buffer`
// (program_attention_floats f32, or null while dealing queues) part_o
// [width, splits, heads, kv_lora] and part_lse [width, splits, heads] lie.
struct ProgramAttentionPlan {
  int32_t splits = 2;
  float* part_o = nullptr;
  float* part_lse = nullptr;
};
ProgramAttentionPlan program_attention_plan(int32_t width, int32_t num_heads, int32_t kv_lora, int32_t num_ctas,
                                            float* buffer);

}  // namespace nucleus::kernels::mono
