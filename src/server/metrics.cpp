#include "server/metrics.h"

#include <fmt/format.h>

#include <algorithm>

namespace nucleus::server {

namespace {

// Prometheus renders floats in Go's shortest form; "{}" gives the shortest
// round-trip representation as well.
std::string num(double v) { return fmt::format("{}", v); }

void header(std::string& out, const std::string& name, const char* type, const char* help) {
  out += "# HELP " + name + " " + help + "\n";
  out += "# TYPE " + name + " " + type + "\n";
}

void sample(std::string& out, const std::string& name, double v) { out += name + " " + num(v) + "\n"; }

// Bucket bounds (seconds). Fine at the low end: the CPU backend's tiny models
// decode in milliseconds, real models in tens of milliseconds.
const std::vector<double> kTtftBounds = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25, 0.5,
                                         0.75,  1.0,   2.5,  5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0};
const std::vector<double> kTpotBounds = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15,
                                         0.2,   0.3,    0.4,   0.5,  0.75,  1.0,  2.5,   5.0, 10.0};
const std::vector<double> kE2eBounds = {0.01, 0.05, 0.1,  0.3,  0.5,  0.8,  1.0,   1.5,   2.0,   2.5,  5.0,
                                        10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0};
const std::vector<double> kTokenBounds = {1,    2,    5,    10,    20,    50,    100,    200,   500,
                                          1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000};

}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size(), 0) {}

void Histogram::observe(double v) {
  auto it = std::lower_bound(bounds_.begin(), bounds_.end(), v);  // first bound >= v
  if (it != bounds_.end()) ++counts_[it - bounds_.begin()];
  ++count_;
  sum_ += v;
}

void Histogram::render(const std::string& name, std::string& out) const {
  int64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += name + "_bucket{le=\"" + num(bounds_[i]) + "\"} " + std::to_string(cumulative) + "\n";
  }
  out += name + "_bucket{le=\"+Inf\"} " + std::to_string(count_) + "\n";
  out += name + "_sum " + num(sum_) + "\n";
  out += name + "_count " + std::to_string(count_) + "\n";
}

ServerMetrics::ServerMetrics()
    : ttft_(kTtftBounds),
      tpot_(kTpotBounds),
      e2e_(kE2eBounds),
      prompt_len_(kTokenBounds),
      generation_len_(kTokenBounds) {
  for (const char* r : {"stop", "length", "abort", "error"}) finished_[r] = 0;
}

void ServerMetrics::record_request(const RequestRecord& r) {
  std::lock_guard<std::mutex> lock(mu_);
  ++finished_[r.finish_reason];
  prompt_tokens_ += r.prompt_tokens;
  generation_tokens_ += r.generation_tokens;
  if (r.finish_reason == "error") return;  // refused: no latency to speak of
  if (r.first_token_time > 0.0) ttft_.observe(r.first_token_time - r.arrival_time);
  for (double g : r.inter_token_gaps) tpot_.observe(g);
  e2e_.observe(r.finish_time - r.arrival_time);
  prompt_len_.observe(static_cast<double>(r.prompt_tokens));
  generation_len_.observe(static_cast<double>(r.generation_tokens));
}

void ServerMetrics::record_http(const std::string& endpoint, int status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++http_[{endpoint, status}];
}

std::string ServerMetrics::render(const EngineStats& s) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  out.reserve(8192);
  header(out, "nucleus_requests_finished_total", "counter",
         "Engine requests (one per choice) finished, by the finish_reason reported to the client.");
  for (const auto& [reason, n] : finished_)
    out += "nucleus_requests_finished_total{finish_reason=\"" + reason + "\"} " + std::to_string(n) + "\n";
  header(out, "nucleus_http_requests_total", "counter", "HTTP responses by endpoint and status code.");
  for (const auto& [key, n] : http_)
    out += "nucleus_http_requests_total{endpoint=\"" + key.first + "\",status=\"" + std::to_string(key.second) +
           "\"} " + std::to_string(n) + "\n";
  header(out, "nucleus_prompt_tokens_total", "counter", "Prompt tokens of finished requests (usage.prompt_tokens).");
  sample(out, "nucleus_prompt_tokens_total", static_cast<double>(prompt_tokens_));
  header(out, "nucleus_generation_tokens_total", "counter",
         "Generated tokens of finished requests (usage.completion_tokens).");
  sample(out, "nucleus_generation_tokens_total", static_cast<double>(generation_tokens_));
  header(out, "nucleus_time_to_first_token_seconds", "histogram",
         "From the HTTP request's arrival to its first generated token.");
  ttft_.render("nucleus_time_to_first_token_seconds", out);
  header(out, "nucleus_time_per_output_token_seconds", "histogram",
         "Gap between consecutive generated tokens of a request (one observation per token after the first).");
  tpot_.render("nucleus_time_per_output_token_seconds", out);
  header(out, "nucleus_e2e_request_latency_seconds", "histogram", "From the HTTP request's arrival to its finish.");
  e2e_.render("nucleus_e2e_request_latency_seconds", out);
  header(out, "nucleus_request_prompt_tokens", "histogram", "Prompt length of finished requests.");
  prompt_len_.render("nucleus_request_prompt_tokens", out);
  header(out, "nucleus_request_generation_tokens", "histogram", "Generated tokens of finished requests.");
  generation_len_.render("nucleus_request_generation_tokens", out);
  header(out, "nucleus_num_requests_running", "gauge", "Requests in the running batch.");
  sample(out, "nucleus_num_requests_running", static_cast<double>(s.num_running));
  header(out, "nucleus_num_requests_waiting", "gauge", "Requests waiting to be scheduled.");
  sample(out, "nucleus_num_requests_waiting", static_cast<double>(s.num_waiting));
  header(out, "nucleus_kv_blocks_used", "gauge", "KV-cache blocks held by requests.");
  sample(out, "nucleus_kv_blocks_used", static_cast<double>(s.kv_blocks_used));
  header(out, "nucleus_kv_blocks_total", "gauge", "KV-cache blocks in the pool.");
  sample(out, "nucleus_kv_blocks_total", static_cast<double>(s.kv_blocks_total));
  header(out, "nucleus_kv_cache_usage_ratio", "gauge", "kv_blocks_used / kv_blocks_total.");
  sample(out, "nucleus_kv_cache_usage_ratio",
         s.kv_blocks_total ? static_cast<double>(s.kv_blocks_used) / static_cast<double>(s.kv_blocks_total) : 0.0);
  header(out, "nucleus_num_preemptions_total", "counter", "Requests preempted (KV blocks reclaimed) so far.");
  sample(out, "nucleus_num_preemptions_total", static_cast<double>(s.num_preemptions));
  header(out, "nucleus_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.");
  sample(out, "nucleus_prefix_cache_queries_total", static_cast<double>(s.prefix_query_tokens));
  header(out, "nucleus_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.");
  sample(out, "nucleus_prefix_cache_hits_total", static_cast<double>(s.prefix_hit_tokens));
  header(out, "nucleus_engine_steps_total", "counter", "Engine steps (forward passes) run.");
  sample(out, "nucleus_engine_steps_total", static_cast<double>(s.steps));
  if (!s.spec.accepted_per_pos.empty()) {  // speculative decoding (vLLM's vllm:spec_decode_* names)
    header(out, "nucleus_spec_decode_num_drafts_total", "counter", "Verify steps of a sequence with draft tokens.");
    sample(out, "nucleus_spec_decode_num_drafts_total", static_cast<double>(s.spec.num_drafts));
    header(out, "nucleus_spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed and verified.");
    sample(out, "nucleus_spec_decode_num_draft_tokens_total", static_cast<double>(s.spec.num_draft_tokens));
    header(out, "nucleus_spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.");
    sample(out, "nucleus_spec_decode_num_accepted_tokens_total", static_cast<double>(s.spec.num_accepted_tokens));
    header(out, "nucleus_spec_decode_num_accepted_tokens_per_pos_total", "counter",
           "Draft tokens accepted, by position in the step's drafts (0: the first).");
    for (size_t j = 0; j < s.spec.accepted_per_pos.size(); ++j)
      sample(out, "nucleus_spec_decode_num_accepted_tokens_per_pos_total{position=\"" + std::to_string(j) + "\"}",
             static_cast<double>(s.spec.accepted_per_pos[j]));
    header(out, "nucleus_spec_decode_mean_acceptance_length", "gauge",
           "Tokens a verify step yields on average: 1 + accepted / drafts.");
    sample(out, "nucleus_spec_decode_mean_acceptance_length", s.spec.mean_acceptance_length());
  }
  return out;
}

}  // namespace nucleus::server
