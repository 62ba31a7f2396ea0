#include "kernels/mono/mono_program_ref.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <queue>
#include <random>
#include <string>
#include <utility>

#include "core/dtype.h"
#include "kernels/gemm/gemm_ref.h"
#include "kernels/moe/moe_ref.h"

namespace nucleus::kernels::mono {

namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A byte range [begin, end) of memory a stage reads or writes.
struct Range {
  uintptr_t begin = 0, end = 0;
  bool write = false;
  const char* what = "";
};

template <typename T>
Range range_of(const T* p, int64_t elements, bool write, const char* what) {
  const auto b = reinterpret_cast<uintptr_t>(p);
  return {b, b + static_cast<uintptr_t>(elements) * sizeof(T), write, what};
}

Range bytes_of(const void* p, int64_t bytes, bool write, const char* what) {
  const auto b = reinterpret_cast<uintptr_t>(p);
  return {b, b + static_cast<uintptr_t>(bytes), write, what};
}

// What stage s may touch in a program of `width` rows (the weights are
// read-only for every stage and not listed).
std::vector<Range> ranges(const Stage& s, int32_t width) {
  std::vector<Range> r;
  if (s.kind == Kind::kSelect) {
    r.push_back(range_of(s.logits, int64_t{width} * s.num_experts, false, "logits"));
    if (s.bias) r.push_back(range_of(s.bias, s.num_experts, false, "bias"));
    r.push_back(range_of(s.table, 1, true, "table"));
    return r;
  }
  if (s.kind == Kind::kRopeCache) {
    r.push_back(range_of(s.x, (width - 1) * s.x_stride + s.kv_lora + s.qk_rope, false, "kv_a"));
    r.push_back(range_of(s.q, (width - 1) * s.q_stride + int64_t{s.num_heads} * (s.qk_nope + s.qk_rope), true, "q"));
    if (s.q_pe_out)
      r.push_back(range_of(s.q_pe_out,
                           (width - 1) * s.q_pe_out_stride + int64_t{s.num_heads - 1} * s.q_pe_out_head_stride + s.qk_rope,
                           true, "q_pe_out"));
    r.push_back(range_of(s.positions, width, false, "positions"));
    r.push_back(range_of(s.slot_mapping, width, false, "slot_mapping"));
    r.push_back(range_of(s.cache, s.num_slots * (s.kv_lora + s.qk_rope), true, "cache"));
    if (s.residual_copy_to) {
      r.push_back(range_of(s.residual_out, (width - 1) * s.n_residual + s.n_residual, false, "residual_out"));
      r.push_back(range_of(s.residual_copy_to, (width - 1) * s.n_residual + s.n_residual, true, "residual_copy_to"));
    }
    return r;
  }
  if (s.kind == Kind::kAttend) {
    const int64_t row = s.kv_lora + s.qk_rope, hl = int64_t{s.num_heads} * s.kv_lora;
    r.push_back(range_of(s.x, (width - 1) * s.x_stride + s.num_heads * row, false, "x (q_full)"));
    r.push_back(range_of(s.cache, s.num_slots * row, false, "cache"));
    r.push_back(range_of(s.token_seq, width, false, "token_seq"));
    r.push_back(range_of(s.part_o, width * s.splits * hl, true, "part_o"));
    r.push_back(range_of(s.part_lse, int64_t{width} * s.splits * s.num_heads, true, "part_lse"));
    return r;
  }
  if (s.kind == Kind::kMerge) {
    const int64_t hl = int64_t{s.num_heads} * s.kv_lora;
    if (s.splits > 1) {
      r.push_back(range_of(s.partials, width * s.splits * hl, false, "partials"));
      r.push_back(range_of(s.lse, int64_t{width} * s.splits * s.num_heads, false, "lse"));
    } else {
      r.push_back(range_of(s.x, (width - 1) * s.x_stride + hl, false, "x (o_lat)"));
    }
    r.push_back(range_of(s.token_seq, width, false, "token_seq"));
    r.push_back(bytes_of(s.out, ((width - 1) * s.out_stride + hl) * 2, true, "out"));
    return r;
  }
  if (s.route) r.push_back(range_of(s.route, 1, false, "route"));
  if (s.kind == Kind::kCombine) {
    if (s.route) r.push_back(range_of(s.partials, (s.slots - 1) * s.x_slot_stride + width * s.n, false, "partials"));
    if (s.shared)
      r.push_back(range_of(s.shared, (s.shared_slots - 1) * s.shared_slot_stride + width * s.n, false, "shared"));
    if (s.residual_copy_to) {
      r.push_back(range_of(s.residual_out, width * s.n, false, "residual_out"));
      r.push_back(range_of(s.residual_copy_to, width * s.n, true, "residual_copy_to"));
    }
    r.push_back(bytes_of(s.out, ((width - 1) * s.out_stride + s.n) * 2, true, "out"));
    return r;
  }
  const int64_t slots = slotted(s) ? s.slots : 1;
  if (s.prologue != Prologue::kAddRmsNorm) {
    r.push_back(range_of(s.x, (slots - 1) * s.x_slot_stride + (width - 1) * s.x_stride + s.k, false, "x"));
  } else {
    r.push_back(range_of(s.residual, width * s.k, false, "residual"));
    if (s.delta) r.push_back(range_of(s.delta, width * s.k, false, "delta"));
    if (s.residual_out) r.push_back(range_of(s.residual_out, width * s.k, true, "residual_out"));
  }
  r.push_back(bytes_of(s.out,
                       ((slots - 1) * s.out_slot_stride + (width - 1) * s.out_stride + stage_columns(s)) *
                           out_element_bytes(s),
                       true, "out"));
  return r;
}

bool overlap(const Range& a, const Range& b) { return a.begin < b.end && b.begin < a.end; }

// The ranges stage s builds x from (kGemv).
std::vector<Range> x_inputs(const Stage& s, int32_t width) {
  std::vector<Range> r;
  for (const Range& x : ranges(s, width))
    if (!x.write && std::string(x.what) != "route") r.push_back(x);
  r.push_back(range_of(s.norm_w, s.norm_w ? s.k : 0, false, "norm_w"));
  return r;
}

// Whether stages a and b build the same x from the same inputs.
bool same_x_inputs(const Stage& a, const Stage& b) {
  if (a.kind != Kind::kGemv || b.kind != Kind::kGemv || a.prologue != b.prologue || a.k != b.k) return false;
  if (x_from_global(a) || x_from_global(b)) return false;  // nothing of theirs in shared memory to keep
  if (a.prologue != Prologue::kAddRmsNorm)
    return !slotted(a) && !slotted(b) && a.x == b.x && a.x_stride == b.x_stride &&
           (a.prologue == Prologue::kLoad || (a.norm_w == b.norm_w && a.eps == b.eps));
  return a.residual == b.residual && a.delta == b.delta && a.norm_w == b.norm_w && a.eps == b.eps;
}


float bf16f(uint16_t h) { return bf16_to_f32(h); }

// A kSelect job: the rows' routes by the CPU reference router (moe_ref.h),
// gathered into the table.
void run_select(const Stage& s, int32_t rows) {
  MoeRoutingParams p;
  p.scoring = s.scoring == Scoring::kSigmoid ? ScoringFunc::kSigmoid : ScoringFunc::kSoftmax;
  p.method = s.method == TopK::kNoauxTc ? TopkMethod::kNoauxTc : TopkMethod::kGreedy;
  p.num_experts = s.num_experts;
  p.top_k = s.top_k;
  p.n_group = s.n_group;
  p.topk_group = s.topk_group;
  p.norm_topk_prob = s.norm_topk_prob != 0;
  p.routed_scaling_factor = s.routed_scaling_factor;
  std::vector<int32_t> ids(static_cast<size_t>(rows * s.top_k));
  std::vector<float> weights(ids.size());
  moe_route_ref(p, s.logits, s.bias, rows, ids.data(), weights.data());
  RouteTable t;
  std::vector<int32_t> chosen(ids);
  std::sort(chosen.begin(), chosen.end());
  chosen.erase(std::unique(chosen.begin(), chosen.end()), chosen.end());
  t.count = static_cast<int32_t>(chosen.size());
  for (int32_t u = 0; u < t.count; ++u) t.expert[u] = chosen[u];
  for (int32_t r = 0; r < rows; ++r)
    for (int32_t c = 0; c < s.top_k; ++c) {
      const auto u = std::lower_bound(chosen.begin(), chosen.end(), ids[r * s.top_k + c]) - chosen.begin();
      t.weight[r][u] = weights[r * s.top_k + c];
    }
  *s.table = t;
}

// A kCombine job: columns [first, first + count) of every row.
void run_combine(const Stage& s, int32_t tile, int32_t rows) {
  const int32_t count = s.route ? s.route->count : 0;  // no table: the shared outputs only
  const int64_t first = job_first_column(s, tile);
  for (int32_t r = 0; r < rows; ++r)
    for (int32_t c = 0; c < job_columns(s, tile); ++c) {
      const int64_t i = first + c;
      float acc = 0.0f;
      for (int32_t u = 0; u < count; ++u) acc += s.route->weight[r][u] * s.partials[u * s.x_slot_stride + r * s.n + i];
      if (s.shared)
        for (int32_t u = 0; u < s.shared_slots; ++u) acc += s.shared[u * s.shared_slot_stride + r * s.n + i];
      static_cast<uint16_t*>(s.out)[r * s.out_stride + i] = f32_to_bf16(acc);
      if (s.residual_copy_to) s.residual_copy_to[r * s.n + i] = s.residual_out[r * s.n + i];
    }
}

// A kRopeCache job: row `r`.
void run_rope(const Stage& s, int32_t r, int32_t rows) {
  if (r >= rows) return;
  const uint16_t* kv = s.x + r * s.x_stride;
  const float pos = static_cast<float>(s.positions[r]);
  const int half = s.qk_rope / 2, head = s.qk_nope + s.qk_rope, width = s.kv_lora + s.qk_rope;
  auto rotate = [&](float a, float b, int i, float* y0, float* y1) {  // as kernels/rope/rope_ref.cpp's table
    const float angle = pos * s.inv_freq[i];
    const float c = static_cast<float>(std::cos(static_cast<double>(angle))) * s.attention_factor;
    const float sn = static_cast<float>(std::sin(static_cast<double>(angle))) * s.attention_factor;
    *y0 = a * c - b * sn;
    *y1 = b * c + a * sn;
  };
  for (int h = 0; h < s.num_heads; ++h)
    for (int i = 0; i < half; ++i) {
      uint16_t* x = s.q + r * s.q_stride + h * head + s.qk_nope + 2 * i;
      float y0, y1;
      rotate(bf16f(x[0]), bf16f(x[1]), i, &y0, &y1);
      x[0] = f32_to_bf16(y0);
      x[1] = f32_to_bf16(y1);
      if (s.q_pe_out) {
        uint16_t* o = s.q_pe_out + r * s.q_pe_out_stride + h * s.q_pe_out_head_stride + 2 * i;
        o[0] = x[0];
        o[1] = x[1];
      }
    }
  const int64_t slot = s.slot_mapping[r];
  if (slot >= 0) {
    uint16_t* row = s.cache + slot * width;
    double ss = 0.0;
    for (int i = 0; i < s.kv_lora; ++i) ss += static_cast<double>(bf16f(kv[i])) * bf16f(kv[i]);
    const auto inv = static_cast<float>(1.0 / std::sqrt(ss / s.kv_lora + s.eps));
    for (int i = 0; i < s.kv_lora; ++i) row[i] = f32_to_bf16(bf16f(kv[i]) * inv * s.norm_w[i]);
    for (int i = 0; i < half; ++i) {
      float y0, y1;
      rotate(bf16f(kv[s.kv_lora + 2 * i]), bf16f(kv[s.kv_lora + 2 * i + 1]), i, &y0, &y1);
      row[s.kv_lora + 2 * i] = f32_to_bf16(y0);
      row[s.kv_lora + 2 * i + 1] = f32_to_bf16(y1);
    }
  }
  if (s.residual_copy_to)
    for (int64_t i = 0; i < s.n_residual; ++i)
      s.residual_copy_to[r * s.n_residual + i] = s.residual_out[r * s.n_residual + i];
}

// A kMerge job: row j / num_heads, head j % num_heads.
void run_merge(const Stage& s, int32_t j, int32_t rows) {
  const int32_t r = j / s.num_heads, h = j % s.num_heads;
  if (r >= rows) return;
  uint16_t* out = static_cast<uint16_t*>(s.out) + r * s.out_stride + int64_t{h} * s.kv_lora;
  if (s.splits == 1) {
    const uint16_t* x = s.x + r * s.x_stride + int64_t{h} * s.kv_lora;
    std::copy(x, x + s.kv_lora, out);
    return;
  }
  const int32_t seq = s.token_seq[r];
  const int keys = s.context_lens[seq] + (r - s.query_start[seq]) + 1;
  const int ns = mla_split_count(keys, s.splits, s.min_split_keys, rows, s.key_tile);
  std::vector<float> w(static_cast<size_t>(ns));
  float mx = -INFINITY, sum = 0.0f;
  for (int t = 0; t < ns; ++t) mx = std::max(mx, s.lse[(int64_t{r} * s.splits + t) * s.num_heads + h]);
  for (int t = 0; t < ns; ++t) {
    w[t] = std::exp2(s.lse[(int64_t{r} * s.splits + t) * s.num_heads + h] - mx);
    sum += w[t];
  }
  for (int t = 0; t < ns; ++t) w[t] *= 1.0f / sum;
  for (int32_t c = 0; c < s.kv_lora; ++c) {
    float acc = 0.0f;
    for (int t = 0; t < ns; ++t)
      acc += w[t] * s.partials[((int64_t{r} * s.splits + t) * s.num_heads + h) * s.kv_lora + c];
    out[c] = f32_to_bf16(acc);
  }
}

// A kAttend job (mono_program.h): f32 scores and sums in key order.
void run_attend(const Stage& s, int32_t j, int32_t rows) {
  const int32_t groups = attend_groups(s);
  const int32_t split = j % s.splits, g = (j / s.splits) % groups, r = j / (s.splits * groups);
  if (r >= rows) return;
  const int32_t seq = s.token_seq[r];
  const int keys = s.context_lens[seq] + (r - s.query_start[seq]) + 1;
  const int chunk = mla_split_chunk(keys, s.splits, s.min_split_keys, rows, s.key_tile);
  const int k0 = split * chunk, k1 = std::min(keys, k0 + chunk);
  if (k0 >= k1) return;
  const int64_t row_w = s.kv_lora + s.qk_rope;
  const int h0 = g * kAttendHeads, nh = std::min(kAttendHeads, s.num_heads - h0);
  const float log2e = 1.4426950408889634f;
  for (int h = h0; h < h0 + nh; ++h) {
    const uint16_t* q = s.x + r * s.x_stride + h * row_w;
    std::vector<float> sc(static_cast<size_t>(k1 - k0));
    float m = -INFINITY;
    for (int k = k0; k < k1; ++k) {
      const int64_t slot = int64_t{s.block_tables[int64_t{seq} * s.max_blocks + k / s.block_size]} * s.block_size +
                           k % s.block_size;
      const uint16_t* kr = s.cache + slot * row_w;
      float acc = 0.0f;
      for (int64_t d = 0; d < row_w; ++d) acc += bf16f(q[d]) * bf16f(kr[d]);
      sc[k - k0] = acc * s.scale * log2e;
      m = std::max(m, sc[k - k0]);
    }
    std::vector<float> o(static_cast<size_t>(s.kv_lora), 0.0f);
    float l = 0.0f;
    for (int k = k0; k < k1; ++k) {
      const int64_t slot = int64_t{s.block_tables[int64_t{seq} * s.max_blocks + k / s.block_size]} * s.block_size +
                           k % s.block_size;
      const uint16_t* kr = s.cache + slot * row_w;
      const float p = std::exp2(sc[k - k0] - m);
      l += p;
      for (int32_t c = 0; c < s.kv_lora; ++c) o[c] += p * bf16f(kr[c]);
    }
    const int64_t base = (int64_t{r} * s.splits + split) * s.num_heads + h;
    for (int32_t c = 0; c < s.kv_lora; ++c) s.part_o[base * s.kv_lora + c] = o[c] / l;
    s.part_lse[base] = m + std::log2(l);
  }
}

// One job of the CPU reference.
void run_job(const Stage& s, int32_t tile, int32_t rows) {
  if (s.kind == Kind::kSelect) return run_select(s, rows);
  if (s.kind == Kind::kAttend) return run_attend(s, tile, rows);
  if (s.kind == Kind::kMerge) return run_merge(s, tile, rows);
  if (s.kind == Kind::kRopeCache) return run_rope(s, tile, rows);
  if (s.kind == Kind::kCombine) return run_combine(s, tile, rows);
  const int32_t slot = job_slot(s, tile);
  if (routed(s) && slot >= s.route->count) return;  // an unused slot
  const int64_t k = s.k;
  const int64_t expert = slotted(s) ? (routed(s) ? s.route->expert[slot] : slot) : 0;
  const void* w = expert_weight(s, expert);
  const uint16_t* xin = s.x ? s.x + (slotted(s) ? slot * s.x_slot_stride : 0) : nullptr;
  std::vector<float> x(static_cast<size_t>(rows * k));
  for (int32_t r = 0; r < rows; ++r) {
    float* xr = x.data() + r * k;
    if (s.prologue == Prologue::kLoad) {
      for (int64_t i = 0; i < k; ++i) xr[i] = bf16f(xin[r * s.x_stride + i]);
      continue;
    }
    if (s.prologue == Prologue::kRmsNorm) {  // as rmsnorm_ref on the bf16 row, rounded to bf16
      double ss = 0.0;
      for (int64_t i = 0; i < k; ++i) {
        xr[i] = bf16f(xin[r * s.x_stride + i]);
        ss += static_cast<double>(xr[i]) * xr[i];
      }
      const auto inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(k) + s.eps));
      for (int64_t i = 0; i < k; ++i) xr[i] = round_to_bf16(xr[i] * inv * s.norm_w[i]);
      continue;
    }
    double ss = 0.0;
    for (int64_t i = 0; i < k; ++i) {
      xr[i] = s.residual[r * k + i] + (s.delta ? bf16f(s.delta[r * k + i]) : 0.0f);
      ss += static_cast<double>(xr[i]) * xr[i];
    }
    if (tile == 0 && s.residual_out)
      for (int64_t i = 0; i < k; ++i) s.residual_out[r * k + i] = xr[i];
    const auto inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(k) + s.eps));
    for (int64_t i = 0; i < k; ++i) xr[i] = round_to_bf16(xr[i] * inv * s.norm_w[i]);
  }
  std::vector<float> wrow(static_cast<size_t>(k));
  auto dot = [&](int32_t r, int64_t row) {
    if (fp8_weights(s)) {  // dequantize_fp8_block_ref's W, what the CPU linear holds
      const auto* q = static_cast<const uint8_t*>(w) + row * k;
      const float* srow = expert_scale(s, expert) + (row / kFp8Block) * fp8_scale_columns(k);
      for (int64_t i = 0; i < k; ++i) wrow[i] = fp8e4m3_to_f32(q[i]) * srow[i / kFp8Block];
    } else {
      for (int64_t i = 0; i < k; ++i) wrow[i] = bf16f(static_cast<const uint16_t*>(w)[row * k + i]);
    }
    return dot_ref(x.data() + r * k, wrow.data(), k);  // the CPU GEMM's order (gemm_ref.h)
  };
  const JobRows jr = job_rows(s, tile);
  const int64_t out_base = slotted(s) ? slot * s.out_slot_stride : 0;
  for (int32_t r = 0; r < rows; ++r)
    for (int32_t c = 0; c < jr.count; ++c) {
      const int64_t o = out_base + r * s.out_stride + jr.a0 + c;
      if (s.epilogue == Epilogue::kStoreBf16) {
        static_cast<uint16_t*>(s.out)[o] = f32_to_bf16(dot(r, jr.a0 + c));
      } else if (s.epilogue == Epilogue::kStoreF32) {
        static_cast<float*>(s.out)[o] = dot(r, jr.a0 + c);
      } else {
        const float g = round_to_bf16(dot(r, jr.a0 + c)), u = round_to_bf16(dot(r, jr.b0 + c));
        static_cast<uint16_t*>(s.out)[o] = f32_to_bf16(g / (1.0f + std::exp(-g)) * u);
      }
    }
}

}  // namespace

int64_t job_weight_bytes(const Stage& s, int32_t job) {
  if (s.kind != Kind::kGemv) return 0;
  const JobRows jr = job_rows(s, job);
  return int64_t{jr.count} * (jr.two ? 2 : 1) * s.k * weight_element_bytes(s);
}

int64_t ProgramPlan::weight_bytes() const {
  int64_t b = 0;
  for (const Stage& s : stages)
    if (s.kind == Kind::kGemv) b += (slotted(s) ? s.slots : 1) * s.n * s.k * weight_element_bytes(s);
  return b;
}

Status check_stage(const Stage& s, int index, int32_t width, int32_t range_rows) {
  auto bad = [&](const std::string& why) {
    return invalid_argument(fmt::format("decode program stage {}: {}", index, why));
  };
  if (s.wait_mask >> index != 0) return bad("wait_mask names this stage or a later one (a job can wait only on earlier stages)");
  auto waits_for_route = [&]() -> Status {
    if (!s.route || !aligned16(s.route)) return bad("needs its route table (16-byte aligned)");
    if (s.route_stage < 0 || s.route_stage >= index || !(s.wait_mask >> s.route_stage & 1u))
      return bad(fmt::format("route_stage = {}: must be an earlier kSelect stage named in wait_mask", s.route_stage));
    return ok_status();
  };
  if (s.kind == Kind::kSelect) {
    if (!s.logits || !s.table || !aligned16(s.table)) return bad("a kSelect stage needs logits and a 16-byte aligned table");
    if (s.num_experts < 1 || s.num_experts > kMaxExperts)
      return bad(fmt::format("num_experts = {}: need 1 ... {}", s.num_experts, kMaxExperts));
    if (s.top_k < 1 || s.top_k > s.num_experts || int64_t{width} * s.top_k > kMaxRouteSlots)
      return bad(fmt::format("top_k = {} at width {}: need width * top_k <= {}", s.top_k, width, kMaxRouteSlots));
    if (s.method == TopK::kNoauxTc) {
      if (s.scoring != Scoring::kSigmoid) return bad("noaux_tc routes sigmoid scores");
      if (s.n_group < 1 || s.n_group > kMaxGroups || s.num_experts % s.n_group != 0 || s.topk_group < 1 ||
          s.topk_group > s.n_group)
        return bad(fmt::format("n_group = {}, topk_group = {}: noaux_tc takes 1 ... {} equal groups", s.n_group,
                               s.topk_group, kMaxGroups));
    } else if (s.method != TopK::kGreedy || s.n_group != 1) {
      return bad("routing: greedy (one group) or noaux_tc");
    }
    if (!(s.routed_scaling_factor > 0.0f)) return bad("routed_scaling_factor must be positive");
    return ok_status();
  }
  if (s.kind == Kind::kAttend) {
    const int64_t row_w = int64_t{s.kv_lora} + s.qk_rope;
    if (s.num_heads < 1 || s.kv_lora < 32 || s.kv_lora > 512 || s.kv_lora % 32 != 0 || s.qk_rope < 0 ||
        row_w > kAttendMaxRow || row_w % 8 != 0)
      return bad(fmt::format("heads {}, kv_lora {}, qk_rope {}: need kv_lora a multiple of 32 up to 512 and a latent "
                             "row of at most {} values, a multiple of 8",
                             s.num_heads, s.kv_lora, s.qk_rope, kAttendMaxRow));
    // (At least 2 splits: a kMerge stage of one split reads o_lat, not the partials.)
    if (s.splits < 2 || s.splits > kMaxMergeSplits || (s.key_tile != 32 && s.key_tile != 64) ||
        s.min_split_keys < 0 || s.min_split_keys % 32 != 0)
      return bad(fmt::format("splits {}, key_tile {}, min_split_keys {}: need 2 ... {} splits, a key tile of 32 or 64 "
                             "and min_split_keys 0 or a multiple of 32",
                             s.splits, s.key_tile, s.min_split_keys, kMaxMergeSplits));
    if (s.n != int64_t{width} * attend_groups(s) * s.splits || s.tile != 1)
      return bad("a kAttend stage has one job a row, head group and split: n = width * groups * splits, tile = 1");
    if (!s.x || !aligned16(s.x) || s.x_stride < s.num_heads * row_w || s.x_stride % 8 != 0 || !s.cache ||
        !aligned16(s.cache) || s.num_slots < 1 || !s.block_tables || s.max_blocks < 1 || s.block_size < 1 ||
        !s.token_seq || !s.query_start || !s.context_lens || !s.part_o || !s.part_lse || !(s.scale > 0.0f))
      return bad("a kAttend stage needs q_full as x (16-byte aligned, a row stride that holds the heads), the cache, "
                 "block_tables, block_size, token_seq, query_start, context_lens, part_o, part_lse and a positive "
                 "scale");
    return ok_status();
  }
  if (s.kind == Kind::kMerge) {
    if (s.num_heads < 1 || s.kv_lora < 1 || s.n != int64_t{width} * s.num_heads || s.tile != 1)
      return bad("a kMerge stage has one job a row and head: n = width * num_heads, tile = 1");
    // As the attention launch takes them (kernels/mla/mla_decode.cuh): min_split_keys a multiple of 32
    // whatever the key tile (the split rule rounds each chunk up to the tile).
    if (s.splits < 1 || s.splits > kMaxMergeSplits || (s.key_tile != 32 && s.key_tile != 64) ||
        s.min_split_keys < 0 || s.min_split_keys % 32 != 0)
      return bad(fmt::format("splits {}, key_tile {}, min_split_keys {}: need 1 ... {} splits, a key tile of 32 or 64 "
                             "and min_split_keys 0 or a multiple of 32",
                             s.splits, s.key_tile, s.min_split_keys, kMaxMergeSplits));
    if (s.splits > 1 ? !s.partials || !s.lse || !s.token_seq || !s.query_start || !s.context_lens
                     : !s.x || s.x_stride < int64_t{s.num_heads} * s.kv_lora)
      return bad("a kMerge stage needs the partials, lse, token_seq, query_start and context_lens (or, one split, "
                 "o_lat as x with a row stride >= num_heads * kv_lora)");
    if (!s.out || s.out_stride < int64_t{s.num_heads} * s.kv_lora)
      return bad("a kMerge stage needs out with a row stride >= num_heads * kv_lora");
    return ok_status();
  }
  if (s.kind == Kind::kRopeCache) {
    if (s.n != kMaxWidth || s.tile != 1) return bad("a kRopeCache stage has one job a row: n = kMaxWidth, tile = 1");
    if (!s.q || !s.x || !s.positions || !s.slot_mapping || !s.inv_freq || !s.norm_w || !s.cache || s.num_slots < 1)
      return bad("a kRopeCache stage needs q, x (kv_a), positions, slot_mapping, inv_freq, norm_w and the cache");
    if (s.num_heads < 1 || s.qk_nope < 0 || s.qk_rope < 2 || s.qk_rope % 2 != 0 || s.qk_rope > 128 || s.kv_lora < 1 ||
        s.kv_lora > 1024 || s.q_stride < int64_t{s.num_heads} * (s.qk_nope + s.qk_rope) ||
        s.x_stride < s.kv_lora + s.qk_rope)
      return bad(fmt::format("heads {}, qk_nope {}, qk_rope {}, kv_lora {}: need an even qk_rope up to 128, kv_lora up "
                             "to 1024 and row strides that hold them",
                             s.num_heads, s.qk_nope, s.qk_rope, s.kv_lora));
    if (!(s.eps > 0.0f)) return bad("eps must be positive");
    if (s.residual_copy_to && (!s.residual_out || s.n_residual < 1))
      return bad("residual_copy_to needs residual_out and n_residual");
    if (s.q_pe_out && (s.q_pe_out_head_stride < s.qk_rope ||
                       s.q_pe_out_stride < int64_t{s.num_heads - 1} * s.q_pe_out_head_stride + s.qk_rope))
      return bad(fmt::format("q_pe_out: a head stride >= qk_rope and a row stride that holds the heads (head stride "
                             "{}, row stride {})",
                             s.q_pe_out_head_stride, s.q_pe_out_stride));
  } else if (s.tile < 1 || s.tile > kMaxTile) {
    return bad(fmt::format("tile = {}: need 1 ... {}", s.tile, kMaxTile));
  } else if (s.kind == Kind::kCombine) {
    // Without a route table (a dense MLP: no routed experts) it sums the shared outputs only.
    if (!s.route && !s.shared) return bad("a kCombine stage without a route table sums the shared outputs: needs shared");
    if (s.route) NUCLEUS_RETURN_IF_ERROR(waits_for_route());
    if (s.route && (s.slots < 1 || s.slots > kMaxRouteSlots))
      return bad(fmt::format("slots = {}: need 1 ... {}", s.slots, kMaxRouteSlots));
    if (s.shared && (s.shared_slots < 1 || (s.shared_slots > 1 && s.shared_slot_stride < width * s.n)))
      return bad(fmt::format("shared_slots = {}, shared_slot_stride = {}: need >= 1 slots of >= width * n", s.shared_slots,
                             s.shared_slot_stride));
    if (s.residual_copy_to && !s.residual_out) return bad("residual_copy_to needs residual_out (what to copy)");
    if (s.n < 1 || (s.route && (!s.partials || s.x_slot_stride < width * s.n)) || !s.out || s.out_stride < s.n)
      return bad(fmt::format("a kCombine stage needs partials with a slot stride >= width * n = {} (x_slot_stride "
                             "= {}) and out with a row stride >= n = {}",
                             width * s.n, s.x_slot_stride, s.n));
  } else {
    if (slotted(s) ? !s.w_table && (!s.w || !aligned16(s.w)) : !s.w || !aligned16(s.w))
      return bad("w must be a 16-byte aligned [n, k] weight (or, slotted, a w_table)");
    const int64_t max_k = s.prologue == Prologue::kLoad ? kMaxGlobalK : kMaxK;
    if (s.n < 1 || s.k < 16 || s.k % 16 != 0 || s.k > max_k)
      return bad(fmt::format("n = {}, k = {}: need n >= 1 and k a multiple of 16 from 16 to {} ({} for a norm "
                             "prologue, whose x the kernel builds in shared memory)",
                             s.n, s.k, kMaxGlobalK, kMaxK));
    if (s.epilogue == Epilogue::kSiluMulBf16 && s.n % 2 != 0)
      return bad(fmt::format("n = {}: a SiLU-and-multiply stage needs gate and up halves (even n)", s.n));
    if (s.w_type != WeightType::kBf16 && s.w_type != WeightType::kFp8Block)
      return bad(fmt::format("w_type {}: bf16 or e4m3 with 128 x 128 block scales", static_cast<int>(s.w_type)));
    if (fp8_weights(s)) {
      // One scale a row group of 16 and a compute warp's 128 k: no group crosses a scale block.
      if (s.k % 32 != 0 || s.tile % kGroupRows != 0 ||
          (s.epilogue == Epilogue::kSiluMulBf16 && (s.n / 2) % kGroupRows != 0))
        return bad(fmt::format("e4m3 weights with k = {}, tile = {}, n = {}: need k a multiple of 32, tile a multiple "
                               "of 16 and (SiLU) n / 2 a multiple of 16, so no row group crosses a scale block",
                               s.k, s.tile, s.n));
      if (slotted(s) ? !s.scale_table && !s.w_scale : !s.w_scale)
        return bad("e4m3 weights need their block scales (w_scale, or slotted, a scale_table)");
      if (slotted(s) && !s.scale_table && s.scale_expert_stride < fp8_scale_floats(s.n, s.k))
        return bad(fmt::format("scale_expert_stride = {}: need >= an expert's scales", s.scale_expert_stride));
      if (slotted(s) && !s.w_table && s.expert_stride % 16 != 0)
        return bad(fmt::format("expert_stride = {}: e4m3 experts start on 16-byte boundaries", s.expert_stride));
    }
    const int32_t max_slots = s.route ? kMaxRouteSlots : kMaxHeadSlots;
    if (s.slots < 1 || s.slots > max_slots)
      return bad(fmt::format("slots = {}: need 1 ... {} ({} with a route table)", s.slots, kMaxHeadSlots, kMaxRouteSlots));
    if (slotted(s)) {
      if (s.route) NUCLEUS_RETURN_IF_ERROR(waits_for_route());
      if (!s.w_table && (s.expert_stride < s.n * s.k || s.expert_stride % 8 != 0))
        return bad(fmt::format("expert_stride = {}: need >= n * k and a multiple of 8", s.expert_stride));
      // Slots one after another ([slots][rows, ...]) or side by side in each row ([rows][slots, ...]).
      auto apart = [&](int64_t slot_stride, int64_t row_stride, int64_t cols) {
        return slot_stride >= width * row_stride ||
               (slot_stride >= cols && (s.slots - 1) * slot_stride + cols <= row_stride);
      };
      if ((s.prologue == Prologue::kLoad && (!apart(s.x_slot_stride, s.x_stride, s.k) || s.x_slot_stride % 8 != 0)) ||
          !apart(s.out_slot_stride, s.out_stride, stage_columns(s)) ||
          (s.out_slot_stride * out_element_bytes(s)) % 16 != 0)
        return bad("a slotted stage's slots must not overlap: slot strides >= width * the row stride (one slot after "
                   "another) or >= k / the columns with every slot within the row (side by side); 16-byte multiples");
    }
    if (s.prologue == Prologue::kRmsNorm && (!s.norm_w || !aligned16(s.norm_w) || !(s.eps > 0.0f)))
      return bad("an RMSNorm prologue needs a 16-byte aligned norm_w and a positive eps");
    if (s.prologue != Prologue::kAddRmsNorm) {
      if (!s.x || !aligned16(s.x) || s.x_stride < s.k || s.x_stride % 8 != 0)
        return bad(fmt::format("x must be 16-byte aligned with a row stride >= k and a multiple of 8 (x_stride = {})",
                               s.x_stride));
    } else {
      if (!s.residual || !s.norm_w || !aligned16(s.residual) || (s.delta && !aligned16(s.delta)) ||
          !aligned16(s.norm_w) || (s.residual_out && !aligned16(s.residual_out)))
        return bad("an add + RMSNorm prologue needs 16-byte aligned residual, delta (or none), norm_w and residual_out");
      if (!s.delta && s.residual_out) return bad("residual_out without a delta (nothing to add)");
      if (s.residual_out == s.residual)
        return bad("residual_out is residual: the stage's other jobs still read it while job 0 writes");
      if (!(s.eps > 0.0f)) return bad("eps must be positive");
    }
    if (!s.out || s.out_stride < stage_columns(s))
      return bad(fmt::format("out needs a row stride >= {} columns (out_stride = {})", stage_columns(s), s.out_stride));
  }
  const std::vector<Range> rs = ranges(s, range_rows > 0 ? range_rows : width);
  for (size_t i = 0; i < rs.size(); ++i)
    for (size_t j = i + 1; j < rs.size(); ++j)
      if ((rs[i].write || rs[j].write) && overlap(rs[i], rs[j]))
        return bad(fmt::format("{} overlaps {} (the stage's jobs run at once)", rs[i].what, rs[j].what));
  return ok_status();
}

StatusOr<std::vector<Stage>> check_program(const std::vector<Stage>& stages, int32_t width, int32_t range_rows) {
  if (range_rows < 0 || range_rows > width)
    return invalid_argument(fmt::format("decode program checked over {} rows at width {}", range_rows, width));
  const int32_t span = range_rows > 0 ? range_rows : width;  // the rows whose memory the hazard checks cover
  if (width != 1 && width != 2 && width != 4 && width != 8)
    return invalid_argument(fmt::format("decode program width {}: the kernel is built for 1, 2, 4 or 8 rows", width));
  if (stages.empty() || stages.size() > static_cast<size_t>(kMaxStages))
    return invalid_argument(fmt::format("decode program of {} stages: need 1 ... {}", stages.size(), kMaxStages));
  // Which stages each stage waits for, directly or through the stages it waits for.
  std::vector<uint32_t> closure(stages.size(), 0);
  for (size_t i = 0; i < stages.size(); ++i) {
    NUCLEUS_RETURN_IF_ERROR(check_stage(stages[i], static_cast<int>(i), width, span));
    const Stage& s = stages[i];
    if (s.route) {  // the table its route_stage writes, which must hold every slot the table can fill
      const Stage& sel = stages[static_cast<size_t>(s.route_stage)];
      if (sel.kind != Kind::kSelect || sel.table != s.route)
        return invalid_argument(fmt::format(
            "decode program stage {}: route_stage {} is not the kSelect stage writing its route table", i,
            s.route_stage));
      const int64_t most = std::min<int64_t>(int64_t{width} * sel.top_k, sel.num_experts);
      if (s.slots < most)
        return invalid_argument(fmt::format("decode program stage {}: {} slots, but {} rows of top-{} routing can "
                                            "choose {} distinct experts",
                                            i, s.slots, width, sel.top_k, most));
    }
    for (size_t j = 0; j < i; ++j)
      if (stages[i].wait_mask >> j & 1u) closure[i] |= (1u << j) | closure[j];
    // Every earlier stage that writes what this one touches, or touches what
    // this one writes, must have finished first.
    for (size_t j = 0; j < i; ++j)
      for (const Range& a : ranges(stages[i], span))
        for (const Range& b : ranges(stages[j], span))
          if ((a.write || b.write) && overlap(a, b) && !(closure[i] >> j & 1u))
            return invalid_argument(fmt::format(
                "decode program stage {}: its {} overlaps stage {}'s {} but it does not wait for stage {} "
                "(add bit {} to wait_mask)",
                i, a.what, j, b.what, j, j));
  }
  std::vector<Stage> checked = stages;
  // Where the kernel may keep x from an earlier stage's job (Stage::x_reuse).
  for (size_t i = 0; i < stages.size(); ++i) {
    checked[i].x_reuse = 0;
    for (size_t t = 0; t < i; ++t) {
      if (!same_x_inputs(stages[t], stages[i])) continue;
      bool rewritten = false;
      for (size_t m = t + 1; m < i && !rewritten; ++m)
        for (const Range& w : ranges(stages[m], span))
          for (const Range& in : x_inputs(stages[i], span)) rewritten |= w.write && overlap(w, in);
      if (!rewritten) checked[i].x_reuse |= 1u << t;
    }
  }
  return checked;
}

ProgramPlan deal_jobs(std::vector<Stage> stages, int32_t width, int32_t num_ctas) {
  ProgramPlan plan;
  plan.stages = std::move(stages);
  plan.width = width;
  const std::vector<Stage>& st = plan.stages;
  std::vector<std::vector<Job>> queues(static_cast<size_t>(num_ctas));
  plan.cta_weight_bytes.assign(static_cast<size_t>(num_ctas), 0);
  using Load = std::pair<int64_t, int32_t>;  // (bytes so far, CTA): the smallest on top
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> least;
  for (int32_t c = 0; c < num_ctas; ++c) least.push({0, c});
  for (size_t i = 0; i < st.size(); ++i) {
    const Stage& s = st[i];
    for (int32_t t = 0; t < stage_jobs(s); ++t) {
      const int64_t bytes = job_weight_bytes(s, t);
      auto [load, c] = least.top();
      least.pop();
      queues[static_cast<size_t>(c)].push_back({static_cast<int32_t>(i), t});
      plan.cta_weight_bytes[static_cast<size_t>(c)] += bytes;
      // Every job also costs its wait, barriers and fence: jobs that stream
      // nothing (a combine, a RoPE row) spread over CTAs instead of piling up
      // on the least loaded one.
      least.push({load + bytes + kJobCostBytes, c});
    }
  }
  plan.queue_start.push_back(0);
  for (const auto& q : queues) {
    plan.jobs.insert(plan.jobs.end(), q.begin(), q.end());
    plan.queue_start.push_back(static_cast<int32_t>(plan.jobs.size()));
  }
  return plan;
}

StatusOr<ProgramPlan> plan_program(const std::vector<Stage>& stages, int32_t width, int32_t num_ctas) {
  if (num_ctas < 1) return invalid_argument(fmt::format("decode program on {} CTAs", num_ctas));
  NUCLEUS_ASSIGN_OR_RETURN(std::vector<Stage> checked, check_program(stages, width));
  return deal_jobs(std::move(checked), width, num_ctas);
}

Program program_view(const ProgramPlan& plan, int32_t rows, const int32_t* queue_start, const Job* jobs,
                     int32_t* counters) {
  Program p;
  for (size_t i = 0; i < plan.stages.size(); ++i) p.stages[i] = plan.stages[i];
  p.num_stages = static_cast<int32_t>(plan.stages.size());
  p.width = plan.width;
  p.rows = rows;
  p.num_ctas = plan.num_ctas();
  p.queue_start = queue_start;
  p.jobs = jobs;
  p.counters = counters;
  return p;
}

Status run_program_ref(const ProgramPlan& plan, int32_t rows, uint64_t seed) {
  if (rows < 1 || rows > plan.width)
    return invalid_argument(fmt::format("decode program of width {} run on {} rows", plan.width, rows));
  const int32_t num_ctas = plan.num_ctas();
  std::vector<int32_t> next(plan.queue_start.begin(), plan.queue_start.end() - 1);
  std::vector<int32_t> done(plan.stages.size(), 0);
  auto ready = [&](int32_t c) {
    if (next[c] == plan.queue_start[c + 1]) return false;
    const uint32_t mask = plan.stages[plan.jobs[next[c]].stage].wait_mask;
    for (size_t s = 0; s < plan.stages.size(); ++s)
      if ((mask >> s & 1u) && done[s] < stage_jobs(plan.stages[s])) return false;
    return true;
  };
  std::mt19937_64 rng(seed);
  std::vector<int32_t> runnable;
  for (size_t left = plan.jobs.size(); left > 0; --left) {
    runnable.clear();
    for (int32_t c = 0; c < num_ctas; ++c)
      if (ready(c)) runnable.push_back(c);
    if (runnable.empty()) {
      std::string stuck;
      for (int32_t c = 0; c < num_ctas; ++c)
        if (next[c] < plan.queue_start[c + 1])
          stuck += fmt::format("{}CTA {} at stage {}", stuck.empty() ? "" : ", ", c, plan.jobs[next[c]].stage);
      return failed_precondition(fmt::format("decode program deadlock with {} jobs left: {}", left, stuck));
    }
    const int32_t c = runnable[rng() % runnable.size()];
    const Job& j = plan.jobs[next[c]++];
    run_job(plan.stages[j.stage], j.tile, rows);
    ++done[j.stage];
  }
  return ok_status();
}

namespace {

// A GEMV stage's weight: bf16, or e4m3 when its block scales are given.
void set_weight(Stage& s, const void* w, const float* scale) {
  s.w = w;
  s.w_scale = scale;
  s.w_type = scale ? WeightType::kFp8Block : WeightType::kBf16;
}
void set_weight_table(Stage& s, const void* const* table, const float* const* scale_table) {
  s.w_table = table;
  s.scale_table = scale_table;
  if (scale_table) s.w_type = WeightType::kFp8Block;
}

}  // namespace

std::vector<Stage> layer_chain_stages(const LayerChain& c, int32_t tile) {
  std::vector<Stage> st(4);
  Stage& front = st[0];
  set_weight(front, c.w_front, c.front_scale);
  front.n = c.front_n;
  front.k = c.hidden;
  front.prologue = Prologue::kAddRmsNorm;
  front.residual = c.residual_in;
  front.delta = c.delta_in;
  front.norm_w = c.input_norm;
  front.eps = c.eps;
  front.residual_out = c.residual_mid;
  front.out = c.front;
  front.out_stride = c.front_n;
  Stage& o = st[1];
  set_weight(o, c.w_o, c.o_scale);
  o.n = c.hidden;
  o.k = c.o_k;
  o.x = c.front;
  o.x_stride = c.front_n;
  o.out = c.o;
  o.out_stride = c.hidden;
  o.wait_mask = 1u << 0;
  Stage& up = st[2];
  set_weight(up, c.w_gate_up, c.gate_up_scale);
  up.n = 2 * c.inter;
  up.k = c.hidden;
  up.prologue = Prologue::kAddRmsNorm;
  up.residual = c.residual_mid;
  up.delta = c.o;
  up.norm_w = c.post_norm;
  up.eps = c.eps;
  up.residual_out = c.residual_out;
  up.epilogue = Epilogue::kSiluMulBf16;
  up.out = c.h;
  up.out_stride = c.inter;
  up.wait_mask = 1u << 1;  // stage 1 waited for stage 0, which wrote residual_mid
  Stage& down = st[3];
  set_weight(down, c.w_down, c.down_scale);
  down.n = c.hidden;
  down.k = c.inter;
  down.x = c.h;
  down.x_stride = c.inter;
  down.out = c.delta_out;
  down.out_stride = c.hidden;
  down.wait_mask = 1u << 2;
  for (Stage& s : st) s.tile = tile;
  return st;
}

std::vector<Stage> moe_chain_stages(const MoeChain& c, int32_t tile) {
  std::vector<Stage> st;
  auto norm_prologue = [&](Stage& s) {
    s.prologue = Prologue::kAddRmsNorm;
    s.residual = c.residual;
    s.delta = c.delta;
    s.norm_w = c.post_norm;
    s.eps = c.eps;
  };
  // o_proj first when given: delta = bf16(attn_out . w_o^T); every stage
  // that reads delta then waits for it.
  uint32_t o_done = 0;
  if (c.w_o) {
    Stage o;
    set_weight(o, c.w_o, c.o_scale);
    o.n = c.hidden;
    o.k = c.o_k;
    o.x = c.attn_out;
    o.x_stride = c.o_k;
    o.out = const_cast<uint16_t*>(c.delta);
    o.out_stride = c.hidden;
    o.tile = tile;
    st.push_back(o);
    o_done = 1u << 0;
  }
  // A dense MLP (num_experts 0): no router, select or routed stages; the
  // shared piece is the MLP and the combine sums it alone.
  const bool routed_experts = c.num_experts > 0;
  Stage router;
  router.wait_mask = o_done;
  router.w = c.w_router;
  router.n = c.num_experts;
  router.k = c.hidden;
  norm_prologue(router);
  router.residual_out = c.residual_out;
  router.epilogue = Epilogue::kStoreF32;
  router.out = c.logits;
  router.out_stride = c.num_experts;
  router.tile = tile;
  st.push_back(router);
  Stage select;
  select.kind = Kind::kSelect;
  select.logits = c.logits;
  select.bias = c.bias;
  select.table = c.table;
  select.num_experts = c.num_experts;
  select.top_k = c.top_k;
  select.n_group = c.n_group;
  select.topk_group = c.topk_group;
  select.scoring = c.scoring;
  select.method = c.method;
  select.norm_topk_prob = c.norm_topk_prob ? 1 : 0;
  select.routed_scaling_factor = c.routed_scaling_factor;
  select.wait_mask = 1u << (st.size() - 1);  // the router
  if (routed_experts) {
    st.push_back(select);
  } else {
    st.pop_back();  // no router either
  }
  const int32_t kSelectStage = routed_experts ? static_cast<int32_t>(st.size()) - 1 : -1;
  uint32_t shared_done = 0;
  if (c.shared_inter > 0) {
    Stage up;
    set_weight(up, c.w_shared_gate_up, c.shared_gate_up_scale);
    up.n = 2 * c.shared_inter;
    up.k = c.hidden;
    norm_prologue(up);
    up.epilogue = Epilogue::kSiluMulBf16;
    up.out = c.h_shared;
    up.out_stride = c.shared_inter;
    up.tile = tile;
    up.slots = c.shared_pieces;  // no route table: slot u is piece u
    up.expert_stride = up.n * up.k;
    up.scale_expert_stride = fp8_scale_floats(up.n, up.k);
    set_weight_table(up, c.shared_gate_up_table, c.shared_gate_up_scale_table);
    up.out_slot_stride = kMaxWidth * c.shared_inter;
    up.wait_mask = o_done;
    if (!routed_experts) up.residual_out = c.residual_out;  // (the router's job otherwise)
    st.push_back(up);
    Stage down;
    set_weight(down, c.w_shared_down, c.shared_down_scale);
    down.n = c.hidden;
    down.k = c.shared_inter;
    down.x = c.h_shared;
    down.x_stride = c.shared_inter;
    down.epilogue = Epilogue::kStoreF32;
    down.out = c.y_shared;
    down.out_stride = c.hidden;
    down.wait_mask = 1u << (st.size() - 1);
    down.tile = tile;
    down.slots = c.shared_pieces;
    down.expert_stride = down.n * down.k;
    down.scale_expert_stride = fp8_scale_floats(down.n, down.k);
    set_weight_table(down, c.shared_down_table, c.shared_down_scale_table);
    down.x_slot_stride = kMaxWidth * c.shared_inter;
    down.out_slot_stride = kMaxWidth * c.hidden;
    st.push_back(down);
    shared_done = 1u << (st.size() - 1);
  }
  auto route = [&](Stage& s) {
    s.route = c.table;
    s.route_stage = kSelectStage;
    s.slots = c.slots;
  };
  uint32_t routed_done = 0;
  if (routed_experts) {
    Stage up;
    set_weight(up, c.w_gate_up, c.gate_up_scale);
    up.n = 2 * c.inter;
    up.k = c.hidden;
    norm_prologue(up);
    up.epilogue = Epilogue::kSiluMulBf16;
    up.out = c.h;
    up.out_stride = c.inter;
    up.tile = tile;
    route(up);
    up.expert_stride = up.n * up.k;
    up.scale_expert_stride = fp8_scale_floats(up.n, up.k);
    set_weight_table(up, c.gate_up_table, c.gate_up_scale_table);
    up.out_slot_stride = kMaxWidth * c.inter;
    up.wait_mask = 1u << kSelectStage;
    st.push_back(up);
    Stage down;
    set_weight(down, c.w_down, c.down_scale);
    down.n = c.hidden;
    down.k = c.inter;
    down.x = c.h;
    down.x_stride = c.inter;
    down.epilogue = Epilogue::kStoreF32;
    down.out = c.y;
    down.out_stride = c.hidden;
    down.tile = tile;
    route(down);
    down.expert_stride = down.n * down.k;
    down.scale_expert_stride = fp8_scale_floats(down.n, down.k);
    set_weight_table(down, c.down_table, c.down_scale_table);
    down.x_slot_stride = kMaxWidth * c.inter;
    down.out_slot_stride = kMaxWidth * c.hidden;
    down.wait_mask = (1u << kSelectStage) | (1u << (st.size() - 1));
    st.push_back(down);
    routed_done = (1u << kSelectStage) | (1u << (st.size() - 1));
  }
  Stage combine;
  combine.kind = Kind::kCombine;
  combine.n = c.hidden;
  combine.partials = c.y;
  combine.x_slot_stride = kMaxWidth * c.hidden;
  combine.shared = c.shared_inter > 0 ? c.y_shared : nullptr;
  combine.shared_slots = c.shared_pieces;
  combine.shared_slot_stride = kMaxWidth * c.hidden;
  combine.residual_copy_to = c.residual_copy_to;
  combine.residual_out = c.residual_copy_to ? c.residual_out : nullptr;
  combine.out = c.delta_out;
  combine.out_stride = c.hidden;
  combine.tile = tile;
  if (routed_experts) route(combine);
  combine.wait_mask = routed_done | shared_done;
  st.push_back(combine);
  return st;
}

std::vector<Stage> attention_output_stages(const AttentionOutputChain& c) {
  const int64_t hl = int64_t{c.num_heads} * c.kv_lora;
  Stage merge;
  merge.kind = Kind::kMerge;
  merge.n = int64_t{c.width} * c.num_heads;
  merge.tile = 1;
  merge.num_heads = c.num_heads;
  merge.kv_lora = c.kv_lora;
  merge.partials = c.partials;
  merge.lse = c.lse;
  merge.x = c.o_lat_in;
  merge.x_stride = hl;
  merge.splits = c.splits;
  merge.min_split_keys = c.min_split_keys;
  merge.key_tile = c.key_tile;
  merge.token_seq = c.token_seq;
  merge.query_start = c.query_start;
  merge.context_lens = c.context_lens;
  merge.out = c.o_lat;
  merge.out_stride = hl;
  Stage uv;  // attn_out[r, h * v_head + d] = o_lat[r, h] . W_UV[h][d]: slot h reads head h's o_lat
  // Head h's W_UV: kv_b_proj's rows h * (qk_nope + v_head) + qk_nope ... (e4m3: the scale rows from qk_nope / 128).
  const int64_t eb = c.kv_b_scale ? 1 : 2;
  set_weight(uv, c.kv_b ? static_cast<const uint8_t*>(c.kv_b) + int64_t{c.qk_nope} * c.kv_lora * eb : nullptr,
             c.kv_b_scale ? c.kv_b_scale + c.qk_nope / kFp8Block * fp8_scale_columns(c.kv_lora) : nullptr);
  uv.scale_expert_stride = (c.qk_nope + c.v_head) / kFp8Block * fp8_scale_columns(c.kv_lora);
  uv.n = c.v_head;
  uv.k = c.kv_lora;
  uv.x = c.o_lat;
  uv.x_stride = hl;
  uv.slots = c.num_heads;
  uv.expert_stride = int64_t{c.qk_nope + c.v_head} * c.kv_lora;
  uv.x_slot_stride = c.kv_lora;
  uv.out = c.attn_out;
  uv.out_stride = c.attn_out_stride > 0 ? c.attn_out_stride : int64_t{c.num_heads} * c.v_head;
  uv.out_slot_stride = c.v_head;
  uv.tile = c.tile;
  uv.wait_mask = 1u << 0;
  if (!c.q_full && !c.attention) return {merge, uv};
  Stage at;  // the partials the merge reads
  at.kind = Kind::kAttend;
  at.num_heads = c.num_heads;
  at.kv_lora = c.kv_lora;
  at.qk_rope = c.qk_rope;
  at.n = int64_t{c.width} * attend_groups(at) * c.splits;
  at.tile = 1;
  at.x = c.q_full;
  at.x_stride = int64_t{c.num_heads} * (c.kv_lora + c.qk_rope);
  at.cache = const_cast<uint16_t*>(c.cache);  // read only (a kAttend stage writes part_o and part_lse)
  at.num_slots = c.num_slots;
  at.block_tables = c.block_tables;
  at.max_blocks = c.max_blocks;
  at.block_size = c.block_size;
  at.token_seq = c.token_seq;
  at.query_start = c.query_start;
  at.context_lens = c.context_lens;
  at.splits = c.splits;
  at.min_split_keys = c.min_split_keys;
  at.key_tile = c.key_tile;
  at.scale = c.scale;
  at.part_o = c.part_o;
  at.part_lse = c.part_lse;
  merge.partials = c.part_o;
  merge.lse = c.part_lse;
  merge.wait_mask = 1u << 0;
  uv.wait_mask = 1u << 1;
  return {at, merge, uv};
}

std::vector<Stage> join_programs(std::vector<Stage> first, const std::vector<Stage>& second) {
  const auto n = static_cast<uint32_t>(first.size());
  // first's sinks: the stages no later stage of first waits for, directly or
  // through others. Waiting for them is waiting for all of first, with the
  // fewest counters to poll.
  std::vector<uint32_t> closure(n, 0);
  uint32_t waited = 0;
  for (uint32_t i = 0; i < n && i < 32; ++i) {
    for (uint32_t j = 0; j < i; ++j)
      if (first[i].wait_mask >> j & 1u) closure[i] |= (1u << j) | closure[j];
    waited |= closure[i];
  }
  const uint32_t sinks = (n >= 32 ? ~0u : (1u << n) - 1) & ~waited;
  for (Stage st : second) {
    st.wait_mask = st.wait_mask == 0 ? sinks : (n >= 32 ? 0u : st.wait_mask << n);
    if (st.route_stage >= 0) st.route_stage += static_cast<int32_t>(n);
    st.x_reuse = 0;
    first.push_back(st);
  }
  for (Stage& st : first) st.x_reuse = 0;
  return first;
}

std::vector<Stage> front_chain_stages(const FrontChain& c, int32_t tile) {
  const int64_t head = c.qk_nope + c.qk_rope, width = c.kv_lora + c.qk_rope;
  Stage q;  // q_proj, or with a q LoRA q_a_proj
  set_weight(q, c.q_lora > 0 ? c.w_qa : c.w_q, c.q_lora > 0 ? c.qa_scale : c.q_scale);
  q.n = c.q_lora > 0 ? c.q_lora : c.num_heads * head;
  q.k = c.hidden;
  q.prologue = Prologue::kAddRmsNorm;
  q.residual = c.residual;
  q.delta = c.delta;
  q.norm_w = c.input_norm;
  q.eps = c.eps;
  q.residual_out = c.delta ? c.residual_out : nullptr;
  q.out = c.q_lora > 0 ? c.q_a : c.q;
  q.out_stride = q.n;
  q.tile = tile;
  Stage kv = q;
  set_weight(kv, c.w_kva, c.kva_scale);
  kv.n = width;
  kv.residual_out = nullptr;
  kv.out = c.kv_a;
  kv.out_stride = width;
  std::vector<Stage> st = {q, kv};
  if (c.q_lora > 0) {  // q = rmsnorm(q_a) * q_a_norm . w_qb^T
    Stage qb;
    set_weight(qb, c.w_qb, c.qb_scale);
    qb.n = c.num_heads * head;
    qb.k = c.q_lora;
    qb.prologue = Prologue::kRmsNorm;
    qb.x = c.q_a;
    qb.x_stride = c.q_lora;
    qb.norm_w = c.q_a_norm;
    qb.eps = c.q_a_eps;
    qb.out = c.q;
    qb.out_stride = qb.n;
    qb.tile = tile;
    qb.wait_mask = 1u << 0;
    st.push_back(qb);
  }
  if (c.w_uk_t) {  // q_full[r, h, :kv_lora] = q_nope[r, h] . W_UK[h]: slot h reads head h's columns of q
    Stage ab;
    set_weight(ab, c.w_uk_t, c.uk_t_scale);
    ab.scale_expert_stride = fp8_scale_floats(c.kv_lora, c.qk_nope);
    ab.n = c.kv_lora;
    ab.k = c.qk_nope;
    ab.x = c.q;
    ab.x_stride = c.num_heads * head;
    ab.slots = c.num_heads;
    ab.expert_stride = int64_t{c.kv_lora} * c.qk_nope;
    ab.x_slot_stride = head;
    ab.out = c.q_full;
    ab.out_stride = c.num_heads * width;
    ab.out_slot_stride = width;
    ab.tile = c.absorb_tile;
    ab.wait_mask = c.q_lora > 0 ? 1u << 2 : 1u << 0;  // q_b, or q_proj
    st.push_back(ab);
  }
  Stage rope;
  rope.kind = Kind::kRopeCache;
  rope.n = kMaxWidth;
  rope.tile = 1;
  rope.q = c.q;
  rope.q_stride = c.num_heads * head;
  rope.x = c.kv_a;
  rope.x_stride = width;
  rope.norm_w = c.kv_norm;
  rope.eps = c.kv_eps;
  rope.positions = c.positions;
  rope.slot_mapping = c.slot_mapping;
  rope.inv_freq = c.inv_freq;
  rope.attention_factor = c.attention_factor;
  rope.cache = c.cache;
  rope.num_slots = c.num_slots;
  rope.num_heads = c.num_heads;
  rope.qk_nope = c.qk_nope;
  rope.qk_rope = c.qk_rope;
  rope.kv_lora = c.kv_lora;
  rope.wait_mask = (1u << st.size()) - 1;  // the GEMVs (q_b waited for q_a; the absorption reads q's q_nope)
  if (c.w_uk_t && c.q_full) {  // (q_full is null when only the job counts are asked for)
    rope.q_pe_out = c.q_full + c.kv_lora;
    rope.q_pe_out_stride = c.num_heads * width;
    rope.q_pe_out_head_stride = width;
  }
  if (c.residual_copy_to && c.delta) {
    rope.residual_copy_to = c.residual_copy_to;
    rope.residual_out = c.residual_out;
    rope.n_residual = c.hidden;
  }
  st.push_back(rope);
  if (c.attend) {  // the attention on q_full and the cache rows the RoPE stage wrote
    Stage at = attention_output_stages(*c.attend).front();
    at.wait_mask = 1u << (st.size() - 1);  // RoPE, which waited for the absorption
    st.push_back(at);
  }
  return st;
}

std::vector<float> transpose_w_uk_scale(const float* scale, int64_t heads, int64_t qk_nope, int64_t v_head,
                                        int64_t kv_lora) {
  const int64_t nb = qk_nope / kFp8Block, lb = fp8_scale_columns(kv_lora), hb = (qk_nope + v_head) / kFp8Block;
  std::vector<float> t(static_cast<size_t>(heads * lb * nb));
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t cb = 0; cb < lb; ++cb)
      for (int64_t db = 0; db < nb; ++db) t[(h * lb + cb) * nb + db] = scale[(h * hb + db) * lb + cb];
  return t;
}

int32_t program_attention_splits(int32_t width, int32_t num_heads, int32_t num_ctas) {
  const int32_t groups = (num_heads + kAttendHeads - 1) / kAttendHeads;
  const int32_t s = num_ctas / std::max(1, width * groups);
  return std::clamp(s, 2, kMaxMergeSplits);
}

ProgramAttentionPlan program_attention_plan(int32_t width, int32_t num_heads, int32_t kv_lora, int32_t num_ctas,
                                            float* buffer) {
  ProgramAttentionPlan p;
  p.splits = program_attention_splits(width, num_heads, num_ctas);
  p.part_o = buffer;
  p.part_lse = buffer ? buffer + int64_t{width} * p.splits * num_heads * kv_lora : nullptr;
  return p;
}

int64_t program_attention_floats(int32_t num_heads, int32_t kv_lora, int32_t num_ctas) {
  int64_t most = 0;
  for (int32_t w : {1, 2, 4, 8})
    most = std::max<int64_t>(most, int64_t{w} * program_attention_splits(w, num_heads, num_ctas));
  return most * num_heads * (kv_lora + 1);
}

}  // namespace nucleus::kernels::mono
