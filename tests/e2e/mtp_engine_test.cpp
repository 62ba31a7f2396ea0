// Speculative decoding with the MTP module on the CPU reference
// (runtime/spec_decode.h): greedy outputs with MTP on equal MTP off (and the
// Hugging Face reference) for every reference prompt at k = 1, 2, 3, batched,
// chunked, from the prefix cache and under preemption; the same with an
// oracle drafter (the draft hook) that makes the target accept runs of
// drafts and reject others, so acceptance, bonus tokens and the roll-back
// of rejected KV rows are exercised; max_tokens, stop ids and EOS exact;
// logprobs and penalties as without drafts; sampled tokens distributed as
// the target's (total variation against the exact distribution, with a
// check that an always-accept rule fails the same bound); refusals. Tensor
// parallelism (TP = 2 and 4, ranks on threads): the module's draft logits
// within 1e-4 of TP = 1's, greedy outputs with MTP on equal MTP off and the
// reference at k = 1 and 2, with TP = 1's acceptance counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <tuple>
#include <nlohmann/json.hpp>

#include "runtime/llm_engine.h"
#include "runtime/model_executor.h"
#include "runtime/spec_decode.h"
#include "test_util.h"

namespace nucleus {
namespace {

struct RefCase {
  std::vector<int32_t> prompt;
  std::vector<int32_t> greedy;
};

std::vector<RefCase> ref_cases() {
  std::ifstream in(testing::model_path("ref/cases.json"));
  nlohmann::json j = nlohmann::json::parse(in);
  std::vector<RefCase> out;
  for (const auto& c : j["tiny-dsv3"])
    out.push_back({c["prompt_token_ids"].get<std::vector<int32_t>>(), c["greedy_token_ids"].get<std::vector<int32_t>>()});
  return out;
}

// tiny-dsv3 with its MTP layer (the main model is models/tiny-dsv3's), at
// tensor-parallel size `tp`; multi_token_decode: ModelOptions's.
std::unique_ptr<ModelExecutor> load(bool mtp = true, int tp = 1, bool multi_token_decode = true) {
  ModelOptions o;
  o.load_mtp = mtp;
  o.tensor_parallel_size = tp;
  o.multi_token_decode = multi_token_decode;
  auto m = load_deepseek_model(testing::mtp_dir() + "/tiny-dsv3", o, {}, false);
  NUCLEUS_CHECK(m.ok(), "{}", m.status().to_string());
  return std::move(*m);
}

EngineConfig config(int64_t k, int64_t budget = 8192, int64_t blocks = 256) {
  EngineConfig c;
  c.block_size = 16;
  c.num_kv_blocks = blocks;
  c.max_num_batched_tokens = budget;
  if (k > 0) c.speculative = {"deepseek_mtp", k};
  return c;
}

std::unique_ptr<LLMEngine> engine(const EngineConfig& c, int tp = 1, bool multi_token_decode = true) {
  auto e = LLMEngine::create(load(c.speculative.enabled(), tp, multi_token_decode), c);
  NUCLEUS_CHECK(e.ok(), "{}", e.status().to_string());
  return std::move(*e);
}

SamplingParams greedy(int n) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = n;
  p.ignore_eos = true;
  return p;
}

struct Result {
  std::vector<int32_t> tokens;
  std::vector<SampleResult> samples;
  FinishReason reason = FinishReason::kNone;
};

std::map<std::string, Result> run_all(LLMEngine& e, const std::vector<std::vector<int32_t>>& prompts,
                                      const SamplingParams& p, const std::string& tag) {
  for (size_t i = 0; i < prompts.size(); ++i) {
    Status s = e.add_request(tag + std::to_string(i), prompts[i], p);
    NUCLEUS_CHECK(s.ok(), "{}", s.to_string());
  }
  std::map<std::string, Result> out;
  while (e.has_unfinished())
    for (const auto& o : e.step()) {
      Result& r = out[o.request_id];
      r.tokens.insert(r.tokens.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      r.samples.insert(r.samples.end(), o.new_samples.begin(), o.new_samples.end());
      if (o.finished) r.reason = o.finish_reason;
    }
  return out;
}

std::vector<std::vector<int32_t>> prompts_of(const std::vector<RefCase>& cases) {
  std::vector<std::vector<int32_t>> p;
  for (const auto& c : cases) p.push_back(c.prompt);
  return p;
}

void expect_reference(const std::map<std::string, Result>& got, const std::vector<RefCase>& cases,
                      const std::string& tag, size_t n = 32) {
  for (size_t i = 0; i < cases.size(); ++i) {
    auto it = got.find(tag + std::to_string(i));
    ASSERT_NE(it, got.end()) << tag << i;
    EXPECT_EQ(it->second.tokens, std::vector<int32_t>(cases[i].greedy.begin(), cases[i].greedy.begin() + n))
        << tag << i;
  }
}

// The oracle drafter: drafts the reference continuation, except that every
// draft at an output index divisible by 5 is made wrong (so runs of accepted
// drafts end in a rejection, a bonus token follows all-accepted runs).
LLMEngine::DraftHook oracle(const std::vector<RefCase>& cases) {
  return [cases](const Sequence& seq, std::vector<int32_t>& drafts) {
    const RefCase* c = nullptr;
    for (const auto& rc : cases)
      if (rc.prompt == seq.prompt_token_ids) c = &rc;
    NUCLEUS_CHECK(c, "unknown prompt");
    for (size_t j = 0; j < drafts.size(); ++j) {
      const size_t out_index = seq.output_token_ids.size() + j;
      if (out_index >= c->greedy.size()) {
        drafts.resize(j);
        break;
      }
      drafts[j] = out_index % 5 == 0 ? (c->greedy[out_index] + 1) % 4096 : c->greedy[out_index];
    }
  };
}

TEST(MtpEngine, GreedyEqualsMtpOffAtK123) {
  auto cases = ref_cases();
  auto off = engine(config(0));
  auto base = run_all(*off, prompts_of(cases), greedy(32), "r");
  expect_reference(base, cases, "r");
  for (int64_t k = 1; k <= 3; ++k) {
    SCOPED_TRACE("k " + std::to_string(k));
    auto e = engine(config(k));
    expect_reference(run_all(*e, prompts_of(cases), greedy(32), "r"), cases, "r");
    const SpecDecodeStats st = e->stats().spec;
    EXPECT_GT(st.num_drafts, 0);
    EXPECT_GE(st.num_draft_tokens, st.num_drafts);
    std::printf("k=%lld MTP layer: %lld drafts, %lld draft tokens, %lld accepted (%.3f), mean acceptance "
                "length %.3f\n",
                static_cast<long long>(k), static_cast<long long>(st.num_drafts),
                static_cast<long long>(st.num_draft_tokens), static_cast<long long>(st.num_accepted_tokens),
                st.acceptance_rate(), st.mean_acceptance_length());
    // The trained tiny MTP layer (tools/train_tiny_mtp.py) drafts the first
    // token right 59% of the time on these prompts: a drafter fed the wrong
    // hidden state, position or token would fall to ~0.
    if (k == 1) {
      EXPECT_GT(st.acceptance_rate(), 0.4);
    }
  }
}

// Verify steps and MTP passes as decode rows (the default) and on the
// prefill path (NUCLEUS_MULTI_TOKEN_DECODE=0): both give the reference
// outputs; only the first runs multi-token decode steps.
TEST(MtpEngine, MultiTokenDecodeOnAndOffAgree) {
  auto cases = ref_cases();
  for (bool rows : {true, false}) {
    SCOPED_TRACE(rows ? "decode rows" : "prefill path");
    auto e = engine(config(2), /*tp=*/1, rows);
    expect_reference(run_all(*e, prompts_of(cases), greedy(32), "r"), cases, "r");
    const SpecDecodeStats st = e->stats().spec;
    std::printf("k=2, %s: %lld drafts, %lld accepted (%.3f); %lld target steps as decode rows\n",
                rows ? "decode rows" : "prefill path", static_cast<long long>(st.num_drafts),
                static_cast<long long>(st.num_accepted_tokens), st.acceptance_rate(),
                static_cast<long long>(e->model().multi_token_decode_steps()));
    if (rows)
      EXPECT_GT(e->model().multi_token_decode_steps(), 0);
    else
      EXPECT_EQ(e->model().multi_token_decode_steps(), 0);
    EXPECT_GT(st.acceptance_rate(), 0.3);
  }
}

TEST(MtpEngine, OracleDraftsBatchedChunkedCachedPreempted) {
  auto cases = ref_cases();
  for (int64_t k = 1; k <= 3; ++k) {
    SCOPED_TRACE("k " + std::to_string(k));
    auto e = engine(config(k));
    e->set_draft_hook(oracle(cases));
    expect_reference(run_all(*e, prompts_of(cases), greedy(32), "o"), cases, "o");
    const SpecDecodeStats st = e->stats().spec;
    EXPECT_GT(st.num_accepted_tokens, 0);
    EXPECT_LT(st.num_accepted_tokens, st.num_draft_tokens);  // the wrong drafts were rejected
    EXPECT_GT(st.mean_acceptance_length(), 1.0);
    for (int64_t j = 1; j < k; ++j) EXPECT_GT(st.accepted_per_pos[j], 0) << "position " << j;
    // Prefix cache: a second run reuses the first's blocks (all but the last hit block).
    const int64_t hits_before = e->stats().prefix_hit_tokens;
    expect_reference(run_all(*e, prompts_of(cases), greedy(32), "c"), cases, "c");
    EXPECT_GT(e->stats().prefix_hit_tokens, hits_before);
    EXPECT_EQ(e->stats().kv_blocks_used, 0);
  }
  {
    SCOPED_TRACE("chunked: budget 7, k 2");
    auto e = engine(config(2, 7));
    e->set_draft_hook(oracle(cases));
    expect_reference(run_all(*e, prompts_of(cases), greedy(32), "b"), cases, "b");
    EXPECT_GT(e->stats().spec.num_accepted_tokens, 0);
  }
  {
    // 11 blocks of 16 tokens: the longest request needs 10.
    SCOPED_TRACE("preemption, k 3");
    auto e = engine(config(3, 8192, 11));
    e->set_draft_hook(oracle(cases));
    expect_reference(run_all(*e, prompts_of(cases), greedy(32), "p"), cases, "p");
    EXPECT_GT(e->stats().num_preemptions, 0);
    EXPECT_EQ(e->stats().kv_blocks_used, 0);
  }
}

TEST(MtpEngine, MtpDraftsUnderPreemptionAndChunking) {
  auto cases = ref_cases();
  auto e = engine(config(2, 7, 11));
  expect_reference(run_all(*e, prompts_of(cases), greedy(32), "p"), cases, "p");
  EXPECT_GT(e->stats().num_preemptions, 0);
}

TEST(MtpEngine, MaxTokensStopIdsAndEosAreExact) {
  auto cases = ref_cases();
  for (int64_t k : {1, 3}) {
    SCOPED_TRACE("k " + std::to_string(k));
    for (int n : {1, 2, 5}) {  // all-accepted oracle drafts would overshoot
      auto e = engine(config(k));
      e->set_draft_hook(oracle(cases));
      auto got = run_all(*e, {cases[1].prompt}, greedy(n), "m");
      EXPECT_EQ(got["m0"].tokens, std::vector<int32_t>(cases[1].greedy.begin(), cases[1].greedy.begin() + n));
      EXPECT_EQ(got["m0"].reason, FinishReason::kLength);
    }
    for (int at : {1, 3}) {
      auto e = engine(config(k));
      e->set_draft_hook(oracle(cases));
      SamplingParams p = greedy(32);
      p.stop_token_ids = {cases[1].greedy[at]};
      auto got = run_all(*e, {cases[1].prompt}, p, "s");
      const auto first = std::find(cases[1].greedy.begin(), cases[1].greedy.end(), cases[1].greedy[at]);
      EXPECT_EQ(got["s0"].tokens, std::vector<int32_t>(cases[1].greedy.begin(), first + 1));
      EXPECT_EQ(got["s0"].reason, FinishReason::kStop);
      // EOS: the model's EOS set to that token.
      EngineConfig c = config(k);
      c.eos_token_ids = {cases[1].greedy[at]};
      auto eos = engine(c);
      eos->set_draft_hook(oracle(cases));
      SamplingParams q = greedy(32);
      q.ignore_eos = false;
      auto g = run_all(*eos, {cases[1].prompt}, q, "e");
      EXPECT_EQ(g["e0"].tokens, std::vector<int32_t>(cases[1].greedy.begin(), first + 1));
      EXPECT_EQ(g["e0"].reason, FinishReason::kStop);
    }
  }
}

TEST(MtpEngine, LogprobsAndPenaltiesAsWithoutDrafts) {
  auto cases = ref_cases();
  SamplingParams p = greedy(24);
  p.logprobs = 3;
  p.repetition_penalty = 1.3f;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.3f;
  p.min_tokens = 4;
  p.logit_bias = {{7, 1.5f}};
  auto off = engine(config(0));
  auto base = run_all(*off, prompts_of(cases), p, "x");
  // The oracle drafts MTP-off's own outputs (wrong at every 5th index).
  std::vector<RefCase> expected;
  for (size_t i = 0; i < cases.size(); ++i) expected.push_back({cases[i].prompt, base["x" + std::to_string(i)].tokens});
  for (int64_t k : {1, 3}) {
    auto e = engine(config(k));
    e->set_draft_hook(oracle(expected));
    auto got = run_all(*e, prompts_of(cases), p, "x");
    for (size_t i = 0; i < cases.size(); ++i) {
      const std::string id = "x" + std::to_string(i);
      ASSERT_EQ(got[id].tokens, base[id].tokens) << id << " k " << k;
      ASSERT_EQ(got[id].samples.size(), base[id].samples.size());
      for (size_t t = 0; t < got[id].samples.size(); ++t) {
        EXPECT_NEAR(got[id].samples[t].logprob, base[id].samples[t].logprob, 1e-4) << id << " token " << t;
        ASSERT_EQ(got[id].samples[t].top_logprobs.size(), 3u);
        for (size_t j = 0; j < 3; ++j) {
          EXPECT_EQ(got[id].samples[t].top_logprobs[j].first, base[id].samples[t].top_logprobs[j].first);
          EXPECT_NEAR(got[id].samples[t].top_logprobs[j].second, base[id].samples[t].top_logprobs[j].second, 1e-4);
        }
      }
    }
    EXPECT_GT(e->stats().spec.num_accepted_tokens, 0) << "k " << k;
  }
}

// Each row's sample is the draw the request makes without drafts (same seed,
// same output index), so seeded sampling with penalties gives MTP-off's
// tokens exactly, with the trained MTP layer's drafts (accepted and
// rejected) and with the oracle's.
TEST(MtpEngine, SeededSamplingEqualsMtpOff) {
  auto cases = ref_cases();
  SamplingParams p = greedy(24);
  p.temperature = 0.9f;
  p.top_p = 0.95f;
  p.seed = 1234;
  p.presence_penalty = 0.4f;
  p.logprobs = 2;
  auto off = engine(config(0));
  auto base = run_all(*off, prompts_of(cases), p, "s");
  for (int64_t k : {1, 3}) {
    auto e = engine(config(k));
    auto got = run_all(*e, prompts_of(cases), p, "s");
    for (size_t i = 0; i < cases.size(); ++i) {
      const std::string id = "s" + std::to_string(i);
      EXPECT_EQ(got[id].tokens, base[id].tokens) << id << " k " << k;
      ASSERT_EQ(got[id].samples.size(), base[id].samples.size());
      for (size_t t = 0; t < got[id].samples.size(); ++t)
        EXPECT_NEAR(got[id].samples[t].logprob, base[id].samples[t].logprob, 1e-4) << id << " token " << t;
    }
    const SpecDecodeStats st = e->stats().spec;
    EXPECT_GT(st.num_accepted_tokens, 0) << "k " << k;
    EXPECT_LT(st.num_accepted_tokens, st.num_draft_tokens) << "k " << k;  // some drafts rejected
  }
}

// The exact target distribution of the first two sampled tokens under
// top_k 4 at `temperature` (pairs t1 * 4096 + t2), from the target's logits.
std::map<int64_t, double> exact_pairs(ModelExecutor& m, const std::vector<int32_t>& prompt, double temperature) {
  const int64_t V = m.config().vocab_size;
  auto top4 = [&](const float* row) {
    std::vector<int32_t> idx(V);
    for (int32_t i = 0; i < V; ++i) idx[i] = i;
    std::partial_sort(idx.begin(), idx.begin() + 4, idx.end(), [&](int32_t a, int32_t b) {
      return row[a] > row[b] || (row[a] == row[b] && a < b);
    });
    std::vector<std::pair<int32_t, double>> out;
    double z = 0;
    auto w = [&](int j) { return std::exp(static_cast<double>(row[idx[j]] - row[idx[0]]) / temperature); };
    for (int j = 0; j < 4; ++j) z += w(j);
    for (int j = 0; j < 4; ++j) out.emplace_back(idx[j], w(j) / z);
    return out;
  };
  auto logits_after = [&](const std::vector<int32_t>& toks) {
    KvCache kv = m.make_kv_cache(16, 16);
    StepInputs in;
    in.query_start = {0, static_cast<int32_t>(toks.size())};
    in.context_lens = {0};
    in.max_blocks_per_seq = 16;
    for (int32_t b = 0; b < 16; ++b) in.block_tables.push_back(b);
    for (size_t i = 0; i < toks.size(); ++i) {
      in.token_ids.push_back(toks[i]);
      in.positions.push_back(static_cast<int32_t>(i));
      in.slot_mapping.push_back(static_cast<int64_t>(i));
    }
    in.logit_indices = {static_cast<int32_t>(toks.size() - 1)};
    auto l = m.forward(in, kv);
    NUCLEUS_CHECK(l.ok(), "{}", l.status().to_string());
    return *l;
  };
  std::map<int64_t, double> joint;
  Tensor l1 = logits_after(prompt);
  for (auto [t1, p1] : top4(l1.data<float>())) {
    std::vector<int32_t> toks = prompt;
    toks.push_back(t1);
    Tensor l2 = logits_after(toks);
    for (auto [t2, p2] : top4(l2.data<float>())) joint[int64_t{t1} * 4096 + t2] = p1 * p2;
  }
  return joint;
}

double total_variation(const std::map<int64_t, double>& p, const std::map<int64_t, int64_t>& counts, int64_t n) {
  std::map<int64_t, double> all = p;
  for (const auto& [k, c] : counts) all.emplace(k, 0.0);
  double tv = 0;
  for (const auto& [k, pk] : all) {
    auto it = counts.find(k);
    tv += std::fabs(pk - (it == counts.end() ? 0.0 : static_cast<double>(it->second) / n));
  }
  return tv / 2;
}

TEST(MtpEngine, SampledTokensAreDistributedAsTheTarget) {
  auto cases = ref_cases();
  const std::vector<int32_t> prompt = cases[0].prompt;
  constexpr double kTemperature = 2.0;  // the likeliest pair has p 0.35
  auto exact = exact_pairs(*load(false), prompt, kTemperature);
  // The one draft: the second token of the likeliest pair, whatever the
  // first token sampled (so it is right often, wrong often).
  int64_t best = 0;
  for (const auto& [k, p] : exact)
    if (p > exact[best]) best = k;
  const int32_t draft_t2 = static_cast<int32_t>(best % 4096);
  constexpr int64_t kDraws = 1000;
  // Draws of MTP off or on (k); the second map emulates the always-accept
  // rule (a wrong verifier) on the same draws: t2 is the draft whenever one
  // was proposed, i.e. always with MTP on.
  auto draw = [&](int64_t k) {
    auto e = engine(config(k, 8192, 512));
    e->set_draft_hook([&](const Sequence&, std::vector<int32_t>& drafts) {
      if (!drafts.empty()) drafts.assign(1, draft_t2);
    });
    SamplingParams p;
    p.temperature = static_cast<float>(kTemperature);
    p.top_k = 4;
    p.max_tokens = 3;  // one draft after the first token; the first two tokens are compared
    p.ignore_eos = true;
    for (int64_t i = 0; i < kDraws; ++i) {
      p.seed = 1000 + i;
      Status s = e->add_request("d" + std::to_string(i), prompt, p);
      NUCLEUS_CHECK(s.ok(), "{}", s.to_string());
    }
    std::map<std::string, std::vector<int32_t>> out;
    while (e->has_unfinished())
      for (const auto& o : e->step())
        out[o.request_id].insert(out[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
    std::map<int64_t, int64_t> counts, always_accept;
    for (const auto& [id, t] : out) {
      EXPECT_EQ(t.size(), 3u);
      if (t.size() != 3) continue;
      ++counts[int64_t{t[0]} * 4096 + t[1]];
      ++always_accept[int64_t{t[0]} * 4096 + draft_t2];
    }
    return std::make_tuple(counts, always_accept, e->stats().spec);
  };
  auto [off_counts, unused, off_stats] = draw(0);
  const double tv_off = total_variation(exact, off_counts, kDraws);
  {  // max_tokens 3 leaves room for one draft: k = 1 covers every k
    const int64_t k = 1;
    auto [counts, bad, st] = draw(k);
    const double tv = total_variation(exact, counts, kDraws), tv_bad = total_variation(exact, bad, kDraws);
    std::printf("k=%lld: TV(MTP on, exact) %.4f, TV(MTP off, exact) %.4f, TV(always accept, exact) %.4f; "
                "%lld of %lld drafts accepted\n",
                static_cast<long long>(k), tv, tv_off, tv_bad, static_cast<long long>(st.num_accepted_tokens),
                static_cast<long long>(st.num_draft_tokens));
    // 16 outcomes, 1000 draws: sampling noise puts TV near 0.05; 0.1 is a
    // bound the right rule passes and the always-accept rule fails.
    EXPECT_LT(tv, 0.1);
    EXPECT_GT(tv_bad, 0.1);
    EXPECT_GT(st.num_accepted_tokens, 0);
    EXPECT_LT(st.num_accepted_tokens, st.num_draft_tokens);
  }
  EXPECT_LT(tv_off, 0.1);
}

// The module's draft logits (f32 host [n, vocab]) and its pre-norm output
// y (f32 host [n, hidden]) for rows 0..n-1 of `tokens` (teacher-forced: the
// model's hidden states of one prefill, the next tokens).
std::pair<Tensor, Tensor> draft_logits(ModelExecutor& m, const std::vector<int32_t>& tokens, int64_t n) {
  const int64_t L = static_cast<int64_t>(tokens.size()), H = m.config().hidden_size;
  const int64_t nb = (L + 15) / 16;
  KvCache kv = m.make_kv_cache(nb, 16), mkv = m.make_mtp_kv_cache(nb, 16);
  auto seq = [&](const std::vector<int32_t>& t, int64_t rows) { return testing::one_sequence_prefill(t, rows, nb); };
  NUCLEUS_CHECK_OK(m.forward(seq(tokens, L), kv).status());
  auto h = m.hidden_states();
  NUCLEUS_CHECK(h.ok(), "{}", h.status().to_string());
  StepInputs mi = seq(std::vector<int32_t>(tokens.begin() + 1, tokens.end()), n);
  mi.mtp_hidden = Tensor::empty({n, H}, DType::kF32);
  std::copy(h->data<float>(), h->data<float>() + n * H, mi.mtp_hidden.data<float>());
  auto l = m.mtp_forward(mi, mkv);
  NUCLEUS_CHECK(l.ok(), "{}", l.status().to_string());
  auto y = m.mtp_hidden_states();
  NUCLEUS_CHECK(y.ok(), "{}", y.status().to_string());
  return {l->clone(), y->clone()};
}

float max_abs_diff(const Tensor& a, const Tensor& b) {
  NUCLEUS_CHECK(a.numel() == b.numel(), "{} vs {} values", a.numel(), b.numel());
  float d = 0;
  for (int64_t i = 0; i < a.numel(); ++i) d = std::max(d, std::fabs(a.data<float>()[i] - b.data<float>()[i]));
  return d;
}

// TP = 2 and 4 split tiny-dsv3 (check_tp_config: 4 heads, vocab 4096,
// moe_intermediate_size 192); its MTP layer is an MoE layer.
TEST(MtpEngine, TensorParallelDraftLogitsMatchTp1) {
  auto cases = ref_cases();
  std::vector<int32_t> tokens = cases[0].prompt;
  tokens.insert(tokens.end(), cases[0].greedy.begin(), cases[0].greedy.end());
  const int64_t n = static_cast<int64_t>(tokens.size()) - 1;
  auto one = draft_logits(*load(true, 1), tokens, n);
  for (int tp : {2, 4}) {
    auto m = load(true, tp);
    ASSERT_EQ(m->tensor_parallel_size(), tp);
    auto got = draft_logits(*m, tokens, n);
    const float dl = max_abs_diff(one.first, got.first), dy = max_abs_diff(one.second, got.second);
    std::printf("TP=%d MTP module, %lld rows: max |logit - TP 1| %.2e, max |y - TP 1| %.2e\n", tp,
                static_cast<long long>(n), dl, dy);
    // tp_test's bound for the model's logits: the ranks' partial sums add in
    // another order than TP = 1's one sum (f32).
    EXPECT_LE(dl, 1e-4f) << "TP " << tp;
    EXPECT_LE(dy, 1e-4f) << "TP " << tp;
    int64_t argmax_diffs = 0;
    const int64_t V = m->config().vocab_size;
    for (int64_t r = 0; r < n; ++r) {
      const float* a = one.first.data<float>() + r * V;
      const float* b = got.first.data<float>() + r * V;
      argmax_diffs += (std::max_element(a, a + V) - a) != (std::max_element(b, b + V) - b);
    }
    EXPECT_EQ(argmax_diffs, 0) << "TP " << tp;
  }
}

TEST(MtpEngine, TensorParallelGreedyEqualsTp1AndMtpOff) {
  auto cases = ref_cases();
  std::vector<SpecDecodeStats> tp1(3);
  for (int64_t k : {1, 2}) tp1[k] = [&] {
    auto e = engine(config(k));
    run_all(*e, prompts_of(cases), greedy(32), "r");
    return e->stats().spec;
  }();
  for (int tp : {2, 4}) {
    SCOPED_TRACE("TP " + std::to_string(tp));
    expect_reference(run_all(*engine(config(0), tp), prompts_of(cases), greedy(32), "r"), cases, "r");
    for (int64_t k : {1, 2}) {
      SCOPED_TRACE("k " + std::to_string(k));
      auto e = engine(config(k), tp);
      expect_reference(run_all(*e, prompts_of(cases), greedy(32), "r"), cases, "r");
      const SpecDecodeStats st = e->stats().spec;
      std::printf("TP=%d k=%lld: %s\n", tp, static_cast<long long>(k), spec_decode_summary(st).c_str());
      EXPECT_GT(st.num_accepted_tokens, 0);
      // The same drafts as TP = 1's, so the same acceptance, position by position.
      EXPECT_EQ(st.num_drafts, tp1[k].num_drafts);
      EXPECT_EQ(st.num_draft_tokens, tp1[k].num_draft_tokens);
      EXPECT_EQ(st.num_accepted_tokens, tp1[k].num_accepted_tokens);
      EXPECT_EQ(st.accepted_per_pos, tp1[k].accepted_per_pos);
    }
  }
  {
    // Batched, chunked (budget 7) and preempted (11 blocks) at TP 2, k 2.
    auto e = engine(config(2, 7, 11), 2);
    expect_reference(run_all(*e, prompts_of(cases), greedy(32), "p"), cases, "p");
    EXPECT_GT(e->stats().num_preemptions, 0);
    EXPECT_GT(e->stats().spec.num_accepted_tokens, 0);
    EXPECT_EQ(e->stats().kv_blocks_used, 0);
  }
}

TEST(MtpEngine, Refusals) {
  EXPECT_EQ(parse_speculative_config("{\"method\": \"eagle\", \"num_speculative_tokens\": 1}").status().code(),
            StatusCode::kUnsupported);
  auto four = parse_speculative_config("{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 4}");
  ASSERT_FALSE(four.ok());
  EXPECT_NE(four.status().message().find("1 to 3"), std::string::npos) << four.status().message();
  EXPECT_FALSE(parse_speculative_config("{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 0}").ok());
  EXPECT_FALSE(parse_speculative_config("{\"method\": \"deepseek_mtp\"}").ok());
  EXPECT_FALSE(parse_speculative_config("[1]").ok());
  auto key = parse_speculative_config("{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 1, \"model\": \"x\"}");
  ASSERT_FALSE(key.ok());
  EXPECT_NE(key.status().message().find("\"model\""), std::string::npos);
  auto ok = parse_speculative_config("{\"method\": \"mtp\", \"num_speculative_tokens\": 2}");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->method, "deepseek_mtp");
  EXPECT_EQ(ok->num_speculative_tokens, 2);
  // An engine asked for speculative decoding on a model loaded without its MTP module.
  auto e = LLMEngine::create(load(false), config(1));
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("MTP"), std::string::npos) << e.status().message();
}

}  // namespace
}  // namespace nucleus
