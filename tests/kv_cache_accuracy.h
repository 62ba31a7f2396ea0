// The FP8 KV-cache layouts' accuracy against the bf16 cache on a tiny model
// over the reference prompts (models/ref/cases.json), shared by the CPU test
// (tests/e2e/kv_cache_accuracy_test.cpp) and the GPU one
// (tests/e2e_gpu/gpu_kv_cache_accuracy_test.cpp).
//
// Per prompt: the bf16-cache greedy generation of `tokens` tokens is the
// sequence; each FP8 layout is fed that same sequence teacher-forced, one
// decode step a token (rows written by decode, as in generation), so every
// layout is compared on the same contexts. Per 100-token window (steps
// 0-99, 100-199, ...; pooled over the prompts):
//   err   = sqrt(sum_steps ||l_fp8 - l_bf16||^2 / sum_steps ||l_bf16||^2)
//           (the relative L2 logit error, l = the step's logits over the vocabulary)
//   agree = share of steps whose FP8 top-1 is the bf16 greedy token.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/check.h"
#include "ops/kv_cache_dtype.h"
#include "runtime/model_executor.h"
#include "test_util.h"

namespace nucleus::testing {

struct AccuracyWindow {
  size_t begin = 0, end = 0;  // steps [begin, end)
  double err = 0, agree = 0;
  double e2 = 0, r2 = 0, agreed = 0, steps = 0;  // the sums behind err and agree
};

struct LayoutAccuracy {
  KvCacheDtype dtype;
  std::vector<AccuracyWindow> windows;
  AccuracyWindow all;  // every step of every prompt
};

inline std::vector<std::vector<int32_t>> reference_prompts(const std::string& model) {
  std::ifstream in(model_path("ref/cases.json"));
  const nlohmann::json cases = nlohmann::json::parse(in);
  std::vector<std::vector<int32_t>> out;
  for (const auto& c : cases[model]) out.push_back(c["prompt_token_ids"].get<std::vector<int32_t>>());
  return out;
}

inline std::unique_ptr<ModelExecutor> load_with_cache(const std::string& model, Device device, KvCacheDtype dtype) {
  ModelOptions o;
  o.device = device;
  o.kv_cache_dtype = dtype;
  auto m = load_deepseek_model(model_path(model), o, {}, false);
  NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
  return std::move(*m);
}

// One sequence through ModelExecutor::forward with its own cache (block size 16).
class AccuracySeq {
 public:
  AccuracySeq(ModelExecutor* m, int64_t max_tokens) : m_(m) {
    kv_ = m->make_kv_cache((max_tokens + 15) / 16, 16);
    for (int32_t b = 0; b < kv_.num_blocks; ++b) table_.push_back(b);
  }
  // Runs `tokens` (positions len_.. on) as one step; the last token's logits.
  std::vector<float> step(const std::vector<int32_t>& tokens) {
    StepInputs si;
    const auto n = static_cast<int32_t>(tokens.size());
    si.token_ids = tokens;
    for (int32_t i = 0; i < n; ++i) {
      si.positions.push_back(len_ + i);
      si.slot_mapping.push_back(len_ + i);
    }
    si.query_start = {0, n};
    si.context_lens = {len_};
    si.block_tables = table_;
    si.max_blocks_per_seq = static_cast<int32_t>(table_.size());
    si.logit_indices = {n - 1};
    auto logits = m_->forward(si, kv_);
    NUCLEUS_CHECK(logits.ok(), "{}", logits.status().to_string());
    len_ += n;
    return std::vector<float>(logits->data<float>(), logits->data<float>() + logits->numel());
  }

 private:
  ModelExecutor* m_;
  KvCache kv_;
  std::vector<int32_t> table_;
  int32_t len_ = 0;
};

inline int32_t accuracy_argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// The measurement above for `layouts` on `model` (a key of cases.json and a
// directory of models/) on `device`, `tokens` steps a prompt.
inline std::vector<LayoutAccuracy> measure_kv_cache_accuracy(const std::string& model, Device device,
                                                             const std::vector<KvCacheDtype>& layouts, int tokens) {
  const std::vector<std::vector<int32_t>> prompts = reference_prompts(model);
  auto bf16 = load_with_cache(model, device, KvCacheDtype::kBF16);
  std::vector<std::unique_ptr<ModelExecutor>> fp8;
  std::vector<LayoutAccuracy> out;
  for (KvCacheDtype d : layouts) {
    fp8.push_back(load_with_cache(model, device, d));
    out.push_back({d, {}, {}});
    for (int b = 0; b < tokens; b += 100)
      out.back().windows.push_back({static_cast<size_t>(b), static_cast<size_t>(std::min(tokens, b + 100))});
  }
  for (const auto& prompt : prompts) {
    const int64_t max_tokens = static_cast<int64_t>(prompt.size()) + tokens;
    std::vector<int32_t> seq;
    std::vector<std::vector<float>> ref;
    {
      AccuracySeq r(bf16.get(), max_tokens);
      std::vector<float> logits = r.step(prompt);
      for (int i = 0; i < tokens; ++i) {
        ref.push_back(logits);
        seq.push_back(accuracy_argmax(logits));
        if (i + 1 < tokens) logits = r.step({seq.back()});
      }
    }
    for (size_t k = 0; k < layouts.size(); ++k) {
      AccuracySeq r(fp8[k].get(), max_tokens);
      std::vector<float> logits = r.step(prompt);
      for (int i = 0; i < tokens; ++i) {
        double e2 = 0, r2 = 0;
        for (size_t v = 0; v < logits.size(); ++v) {
          const double d = static_cast<double>(logits[v]) - ref[i][v];
          e2 += d * d;
          r2 += static_cast<double>(ref[i][v]) * ref[i][v];
        }
        const double agreed = accuracy_argmax(logits) == seq[i] ? 1.0 : 0.0;
        for (AccuracyWindow* w : {&out[k].windows[static_cast<size_t>(i / 100)], &out[k].all}) {
          w->e2 += e2;
          w->r2 += r2;
          w->agreed += agreed;
          w->steps += 1;
        }
        if (i + 1 < tokens) logits = r.step({seq[i]});
      }
    }
  }
  auto finish = [](AccuracyWindow& x) {
    x.err = std::sqrt(x.e2 / std::max(x.r2, 1e-30));
    x.agree = x.agreed / std::max(x.steps, 1.0);
  };
  for (LayoutAccuracy& l : out) {
    l.all.end = static_cast<size_t>(tokens);
    for (AccuracyWindow& w : l.windows) finish(w);
    finish(l.all);
  }
  return out;
}

// Prints the measurement as a markdown table: one row per window, a column
// pair (err, agree) per layout.
inline void print_kv_cache_accuracy(const std::string& title, const std::vector<LayoutAccuracy>& r) {
  std::printf("\n%s\n\n| tokens |", title.c_str());
  for (const auto& l : r) std::printf(" %s rel. logit error | %s top-1 agreement |", kv_cache_dtype_name(l.dtype),
                                      kv_cache_dtype_name(l.dtype));
  std::printf("\n|---|");
  for (size_t k = 0; k < r.size(); ++k) std::printf("---|---|");
  std::printf("\n");
  for (size_t w = 0; w <= r[0].windows.size(); ++w) {
    const bool all = w == r[0].windows.size();
    const AccuracyWindow& x0 = all ? r[0].all : r[0].windows[w];
    if (all)
      std::printf("| all |");
    else
      std::printf("| %zu-%zu |", x0.begin, x0.end - 1);
    for (const auto& l : r) {
      const AccuracyWindow& x = all ? l.all : l.windows[w];
      std::printf(" %.4f | %.3f |", x.err, x.agree);
    }
    std::printf("\n");
  }
  std::fflush(stdout);
}

}  // namespace nucleus::testing
