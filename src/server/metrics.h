// Server metrics in the Prometheus text exposition format (version 0.0.4),
// served at GET /metrics. Names and meanings are listed in docs/server.md.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/llm_engine.h"

namespace nucleus::server {

// A cumulative histogram: bucket i counts observations <= bounds[i];
// +Inf (the total count) is implicit.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  // Appends the _bucket / _sum / _count lines of metric `name`.
  void render(const std::string& name, std::string& out) const;

 private:
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;  // per bucket, not cumulative
  int64_t count_ = 0;
  double sum_ = 0.0;
};

// What the client was told about one engine request (one choice), with its
// timing on the steady clock (seconds).
struct RequestRecord {
  std::string finish_reason;  // "stop", "length", "abort", "error"
  int64_t prompt_tokens = 0;
  int64_t generation_tokens = 0;
  double arrival_time = 0.0;      // when the HTTP request was accepted
  double first_token_time = 0.0;  // 0: no token was produced
  double finish_time = 0.0;
  std::vector<double> inter_token_gaps;  // seconds between consecutive tokens
};

// Thread-safe: HTTP handler threads record, /metrics renders.
class ServerMetrics {
 public:
  ServerMetrics();
  void record_request(const RequestRecord& r);
  // One HTTP response: `endpoint` is the route ("other" for unknown paths).
  void record_http(const std::string& endpoint, int status);
  // The exposition text; gauges come from `stats`.
  std::string render(const EngineStats& stats) const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, int64_t> finished_;  // by finish reason
  std::map<std::pair<std::string, int>, int64_t> http_;
  int64_t prompt_tokens_ = 0, generation_tokens_ = 0;
  Histogram ttft_, tpot_, e2e_, prompt_len_, generation_len_;
};

}  // namespace nucleus::server
