// nucleus bench serve: the serving benchmark, measured as vLLM's
// benchmarks/benchmark_serving.py measures it, against any server with an
// OpenAI /v1/completions endpoint that streams.
//
// Prompts are random token ids (sent as a token-id prompt, so input lengths
// are exact): input length uniform in [I(1-R), I(1+R)], output length
// (max_tokens) uniform in [O(1-R), O(1+R)]. Arrivals: all at once
// (--request-rate inf) or a Poisson process (gamma intervals with
// --burstiness != 1); at most --max-concurrency requests in flight, each on
// its own connection and thread. Per request, timed on the client:
//   TTFT  = first streamed chunk with choices - send time
//   ITL   = gap between consecutive such chunks (every gap is one sample)
//   E2EL  = last such chunk - send time
//   TPOT  = (E2EL - TTFT) / (output tokens - 1), for requests with > 1 token
// Output tokens are the server's usage.completion_tokens
// (stream_options.include_usage). Throughputs divide by the wall time from
// the first send to the last completion. Mean / median / p99 use numpy's
// linear-interpolation percentiles; std is the population std.
#include <fmt/format.h>
#include <httplib.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <csignal>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <fstream>
#include <iostream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "cli/commands.h"
#include "core/logging.h"
#include "io/tokenizer.h"

namespace nucleus::cli {

using nlohmann::json;

namespace {

struct BenchArgs {
  std::string base_url;
  std::string model;
  std::string tokenizer_dir;
  int64_t num_prompts = 1000;
  int64_t max_concurrency = 0;  // 0: unlimited
  int64_t input_len = 1024;
  int64_t output_len = 128;
  double range_ratio = 0.0;
  std::string request_rate = "inf";
  double burstiness = 1.0;
  bool ignore_eos = false;
  uint64_t seed = 0;
  std::string result_json;
  bool disable_progress = false;
};

struct SampleRequest {
  std::vector<int32_t> prompt;
  int64_t output_len = 0;
};

struct RequestResult {
  bool success = false;
  std::string error;
  double ttft = 0.0, latency = 0.0;  // seconds
  std::vector<double> itl;
  int64_t prompt_len = 0;
  int64_t output_tokens = -1;  // -1: the server sent no usage
  int64_t chunks_with_text = 0;
  std::string generated_text;
};

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// scheme://host[:port] and the path prefix of --base-url.
struct Endpoint {
  std::string scheme_host_port;
  std::string prefix;
};

// The longest mean arrival interval --request-rate may ask for (one day).
constexpr double kMaxMeanIntervalSeconds = 86400.0;

StatusOr<Endpoint> parse_base_url(std::string url) {
  while (!url.empty() && url.back() == '/') url.pop_back();
  const size_t scheme = url.find("://");
  if (scheme == std::string::npos || url.size() == scheme + 3)
    return invalid_argument("--base-url '" + url + "' must look like http://HOST:PORT");
  std::string name = url.substr(0, scheme);
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  if (name != "http")  // the HTTP client is built without TLS
    return invalid_argument("--base-url '" + url + "': scheme '" + url.substr(0, scheme) +
                            "' is not supported (http://HOST:PORT)");
  url = "http" + url.substr(scheme);  // the client's parser takes the scheme in lower case only
  const size_t path = url.find('/', std::string("http://").size());
  if (path == std::string::npos) return Endpoint{url, ""};
  return Endpoint{url.substr(0, path), url.substr(path)};
}

std::unique_ptr<httplib::Client> make_client(const Endpoint& ep) {
  auto c = std::make_unique<httplib::Client>(ep.scheme_host_port);
  c->set_connection_timeout(10);
  c->set_read_timeout(3600);  // a queued request may wait long for its first token
  c->set_write_timeout(60);
  return c;
}

// Splits complete server-sent events off `buffer`; calls on_data for each
// "data: ..." payload.
template <typename F>
void drain_events(std::string& buffer, F on_data) {
  size_t end;
  while ((end = buffer.find("\n\n")) != std::string::npos) {
    std::string event = buffer.substr(0, end);
    buffer.erase(0, end + 2);
    size_t pos = 0;
    while (pos < event.size()) {
      size_t nl = event.find('\n', pos);
      if (nl == std::string::npos) nl = event.size();
      std::string line = event.substr(pos, nl - pos);
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.rfind("data:", 0) == 0) {
        std::string payload = line.substr(5);
        if (!payload.empty() && payload[0] == ' ') payload.erase(0, 1);
        on_data(payload);
      }
      pos = nl + 1;
    }
  }
}

// One streamed completion, timed as benchmark_serving's OpenAI backend does.
RequestResult send_request(httplib::Client& client, const Endpoint& ep, const std::string& model,
                           const SampleRequest& r, bool ignore_eos) {
  RequestResult out;
  out.prompt_len = static_cast<int64_t>(r.prompt.size());
  json body = {{"model", model},     {"prompt", r.prompt}, {"max_tokens", r.output_len},
               {"temperature", 0.0}, {"stream", true},     {"stream_options", {{"include_usage", true}}}};
  if (ignore_eos) body["ignore_eos"] = true;
  httplib::Request req;
  req.method = "POST";
  req.path = ep.prefix + "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  std::string buffer, error_body;
  int status = 0;
  bool first = true;
  const double start = now_s();
  double last = start;
  req.response_handler = [&](const httplib::Response& res) {
    status = res.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    if (status != 200) {
      error_body.append(data, len);
      return true;
    }
    buffer.append(data, len);
    drain_events(buffer, [&](const std::string& payload) {
      if (payload == "[DONE]") return;
      json j = json::parse(payload, nullptr, false);
      if (j.is_discarded()) return;
      if (j.contains("error")) {
        out.error = j["error"].dump();
        return;
      }
      const json& choices = j.value("choices", json::array());
      if (!choices.empty()) {
        const double t = now_s();
        if (first) {
          first = false;
          out.ttft = t - start;
        } else {
          out.itl.push_back(t - last);
        }
        last = t;
        const json& text = choices[0].value("text", json(""));
        if (text.is_string()) {
          out.generated_text += text.get<std::string>();
          if (!text.get<std::string>().empty()) ++out.chunks_with_text;
        }
      } else if (j.contains("usage") && j["usage"].is_object()) {
        out.output_tokens = j["usage"].value("completion_tokens", int64_t{-1});
      }
    });
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool sent = client.send(req, res, err);
  if (!sent) {
    out.error = fmt::format("request failed after {:.3f} s: {}", now_s() - start, httplib::to_string(err));
  } else if (status != 200) {
    out.error = "HTTP " + std::to_string(status) + ": " + error_body;
  } else if (first) {
    if (out.error.empty()) out.error = "never received a chunk with choices (no TTFT)";
  } else if (out.error.empty()) {
    out.success = true;
    out.latency = last - start;
    if (out.output_tokens < 0) out.output_tokens = out.chunks_with_text;  // server without usage
  }
  return out;
}

// numpy.percentile(v, p) with linear interpolation; 0 for an empty list.
double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double pos = (static_cast<double>(v.size()) - 1.0) * p / 100.0;
  const size_t lo = static_cast<size_t>(std::floor(pos)), hi = static_cast<size_t>(std::ceil(pos));
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

double mean(const std::vector<double>& v) {
  if (v.empty()) return 0.0;
  double s = 0.0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

double stddev(const std::vector<double>& v) {
  if (v.empty()) return 0.0;
  const double m = mean(v);
  double s = 0.0;
  for (double x : v) s += (x - m) * (x - m);
  return std::sqrt(s / static_cast<double>(v.size()));
}

// tqdm-like progress on stderr, only when it is a terminal.
class Progress {
 public:
  Progress(int64_t total, bool enabled) : total_(total), enabled_(enabled && isatty(STDERR_FILENO)), start_(now_s()) {}
  void tick() {
    std::lock_guard<std::mutex> lock(mu_);
    ++done_;
    if (!enabled_) return;
    const double elapsed = now_s() - start_;
    const double rate = elapsed > 0 ? static_cast<double>(done_) / elapsed : 0.0;
    const double left = rate > 0 ? static_cast<double>(total_ - done_) / rate : 0.0;
    const int width = 30;
    const int filled = static_cast<int>(width * done_ / std::max<int64_t>(total_, 1));
    std::cerr << fmt::format("\r{:3d}%|{}{}| {}/{} [{:.0f}s<{:.0f}s, {:.2f}it/s]",
                             static_cast<int>(100 * done_ / std::max<int64_t>(total_, 1)), std::string(filled, '#'),
                             std::string(width - filled, ' '), done_, total_, elapsed, left, rate)
              << std::flush;
    if (done_ == total_) std::cerr << "\n";
  }

 private:
  std::mutex mu_;
  int64_t total_, done_ = 0;
  bool enabled_;
  double start_;
};

// The model name and the token ids to draw prompts from.
struct ServerInfo {
  std::string model;
  std::vector<int32_t> token_pool;
};

StatusOr<ServerInfo> probe(const BenchArgs& args, const Endpoint& ep) {
  ServerInfo info;
  auto client = make_client(ep);
  auto res = client->Get(ep.prefix + "/v1/models");
  if (!res) return unsupported("cannot reach " + args.base_url + ": " + httplib::to_string(res.error()));
  json models = json::parse(res->body, nullptr, false);
  if (res->status != 200 || models.is_discarded() || !models.contains("data") || models["data"].empty())
    return invalid_argument(args.base_url + "/v1/models answered HTTP " + std::to_string(res->status) +
                            " without a model list");
  const json& m = models["data"][0];
  info.model = args.model.empty() ? m.value("id", "") : args.model;
  if (!args.tokenizer_dir.empty()) {
    NUCLEUS_ASSIGN_OR_RETURN(auto tok, Tokenizer::load(args.tokenizer_dir));
    for (int32_t id = 0; id < tok->vocab_size(); ++id)
      if (!tok->is_special(id) && !tok->id_to_token(id).empty()) info.token_pool.push_back(id);
  } else if (m.contains("vocab_size") && m["vocab_size"].is_number_integer()) {
    const int64_t vocab = m["vocab_size"].get<int64_t>();
    for (int64_t id = 0; id < vocab; ++id) info.token_pool.push_back(static_cast<int32_t>(id));
  } else {
    return invalid_argument("the server does not report vocab_size in /v1/models; pass --tokenizer MODEL_DIR");
  }
  if (info.token_pool.empty()) return invalid_argument("no token ids to draw prompts from");
  return info;
}

std::vector<SampleRequest> make_requests(const BenchArgs& a, const std::vector<int32_t>& pool, std::mt19937_64& rng) {
  auto bounds = [&](int64_t len) {
    const int64_t lo = std::max<int64_t>(1, static_cast<int64_t>(std::floor(len * (1.0 - a.range_ratio))));
    const int64_t hi = std::max<int64_t>(lo, static_cast<int64_t>(std::floor(len * (1.0 + a.range_ratio))));
    return std::uniform_int_distribution<int64_t>(lo, hi);
  };
  auto in_len = bounds(a.input_len), out_len = bounds(a.output_len);
  std::uniform_int_distribution<size_t> pick(0, pool.size() - 1);
  std::vector<SampleRequest> out(a.num_prompts);
  for (auto& r : out) {
    r.prompt.resize(in_len(rng));
    for (auto& t : r.prompt) t = pool[pick(rng)];
    r.output_len = out_len(rng);
  }
  return out;
}

// Sends the requests at their arrival times with at most `workers` in flight.
std::vector<RequestResult> run_all(const BenchArgs& a, const Endpoint& ep, const std::string& model,
                                   const std::vector<SampleRequest>& requests, double rate, std::mt19937_64& rng) {
  const int64_t n = static_cast<int64_t>(requests.size());
  const int64_t workers = a.max_concurrency > 0 ? std::min(a.max_concurrency, n) : n;
  std::vector<RequestResult> results(n);
  std::mutex mu;
  std::condition_variable cv;
  std::deque<int64_t> arrived;
  bool all_arrived = false;
  Progress progress(n, !a.disable_progress);
  std::vector<std::thread> threads;
  for (int64_t w = 0; w < workers; ++w)
    threads.emplace_back([&] {
      auto client = make_client(ep);
      for (;;) {
        int64_t i;
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return !arrived.empty() || all_arrived; });
          if (arrived.empty()) return;
          i = arrived.front();
          arrived.pop_front();
        }
        results[i] = send_request(*client, ep, model, requests[i], a.ignore_eos);
        progress.tick();
      }
    });
  std::gamma_distribution<double> interval(a.burstiness, std::isinf(rate) ? 1.0 : 1.0 / (rate * a.burstiness));
  for (int64_t i = 0; i < n; ++i) {
    {
      std::lock_guard<std::mutex> lock(mu);
      arrived.push_back(i);
    }
    cv.notify_one();
    if (!std::isinf(rate) && i + 1 < n)  // a gamma draw far in the tail is cut at 1,000 mean intervals
      std::this_thread::sleep_for(std::chrono::duration<double>(std::min(interval(rng), 1000 * kMaxMeanIntervalSeconds)));
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    all_arrived = true;
  }
  cv.notify_all();
  for (auto& t : threads) t.join();
  return results;
}

// mean / median / std / p99 of `v` (seconds) in milliseconds, under
// "<stat>_<name>_ms" keys as benchmark_serving's result JSON has them.
void add_stats(json& r, const std::string& name, const std::vector<double>& v) {
  std::vector<double> ms(v.size());
  for (size_t i = 0; i < v.size(); ++i) ms[i] = v[i] * 1000.0;
  r["mean_" + name + "_ms"] = mean(ms);
  r["median_" + name + "_ms"] = percentile(ms, 50.0);
  r["std_" + name + "_ms"] = stddev(ms);
  r["p99_" + name + "_ms"] = percentile(ms, 99.0);
}

// The server's speculative-decoding counters (nucleus_spec_decode_*_total of
// GET /metrics, by name without the prefix); empty when it serves without
// drafts or /metrics cannot be read.
std::map<std::string, double> spec_decode_counters(const Endpoint& ep) {
  std::map<std::string, double> out;
  auto client = make_client(ep);
  auto res = client->Get(ep.prefix + "/metrics");
  if (!res || res->status != 200) return out;
  std::istringstream in(res->body);
  std::string line;
  const std::string prefix = "nucleus_spec_decode_";
  while (std::getline(in, line)) {
    if (line.compare(0, prefix.size(), prefix) != 0) continue;
    const size_t sp = line.rfind(' ');
    if (sp == std::string::npos) continue;
    out[line.substr(prefix.size(), sp - prefix.size())] = std::strtod(line.c_str() + sp + 1, nullptr);
  }
  return out;
}

// The run's share of the counters (after - before), as vLLM's bench prints them.
void print_spec_decode(const std::map<std::string, double>& before, const std::map<std::string, double>& after) {
  if (after.empty()) return;
  auto delta = [&](const std::string& k) {
    auto a = after.find(k);
    auto b = before.find(k);
    return (a == after.end() ? 0.0 : a->second) - (b == before.end() ? 0.0 : b->second);
  };
  const double drafts = delta("num_drafts_total"), draft_tokens = delta("num_draft_tokens_total"),
               accepted = delta("num_accepted_tokens_total");
  std::cout << fmt::format("{:-^50}\n", "Speculative Decoding");
  std::cout << fmt::format("{:<40} {:<10.2f}\n", "Acceptance rate (%):", draft_tokens > 0 ? 100 * accepted / draft_tokens : 0.0);
  std::cout << fmt::format("{:<40} {:<10.2f}\n", "Acceptance length:", drafts > 0 ? 1 + accepted / drafts : 0.0);
  std::cout << fmt::format("{:<40} {:<10.0f}\n", "Drafts:", drafts);
  std::cout << fmt::format("{:<40} {:<10.0f}\n", "Draft tokens:", draft_tokens);
  std::cout << fmt::format("{:<40} {:<10.0f}\n", "Accepted tokens:", accepted);
  for (int pos = 0;; ++pos) {
    const std::string k = "num_accepted_tokens_per_pos_total{position=\"" + std::to_string(pos) + "\"}";
    if (!after.count(k)) break;
    std::cout << fmt::format("{:<40} {:<10.0f}\n", fmt::format("Accepted at position {}:", pos), delta(k));
  }
  std::cout << std::string(50, '=') << "\n" << std::flush;
}

// The numbers of one run, as benchmark_serving's calculate_metrics.
json compute_metrics(const std::vector<RequestResult>& results, double duration_s) {
  int64_t completed = 0, total_input = 0, total_output = 0;
  std::vector<double> ttfts, tpots, itls, e2els;
  json input_lens = json::array(), output_lens = json::array(), ttft_list = json::array(), itl_list = json::array(),
       errors = json::array();
  for (const auto& r : results) {
    input_lens.push_back(r.prompt_len);
    output_lens.push_back(r.success ? r.output_tokens : 0);
    ttft_list.push_back(r.ttft);
    itl_list.push_back(r.itl);
    errors.push_back(r.error);
    if (!r.success) continue;
    ++completed;
    total_input += r.prompt_len;
    total_output += r.output_tokens;
    if (r.output_tokens > 1) tpots.push_back((r.latency - r.ttft) / static_cast<double>(r.output_tokens - 1));
    itls.insert(itls.end(), r.itl.begin(), r.itl.end());
    ttfts.push_back(r.ttft);
    e2els.push_back(r.latency);
  }
  json m;
  m["duration"] = duration_s;
  m["completed"] = completed;
  m["failed"] = static_cast<int64_t>(results.size()) - completed;
  m["total_input_tokens"] = total_input;
  m["total_output_tokens"] = total_output;
  m["request_throughput"] = completed / duration_s;
  m["output_throughput"] = total_output / duration_s;
  m["total_token_throughput"] = (total_input + total_output) / duration_s;
  add_stats(m, "ttft", ttfts);
  add_stats(m, "tpot", tpots);
  add_stats(m, "itl", itls);
  add_stats(m, "e2el", e2els);
  m["input_lens"] = input_lens;
  m["output_lens"] = output_lens;
  m["ttfts"] = ttft_list;
  m["itls"] = itl_list;
  m["errors"] = errors;
  return m;
}

// benchmark_serving's layout: 50-column banners, labels padded to 40.
void print_report(const json& m) {
  auto line = [](const std::string& label, const std::string& value) {
    std::cout << fmt::format("{:<40} {:<10}\n", label, value);
  };
  auto num = [](double v) { return fmt::format("{:.2f}", v); };
  std::cout << fmt::format("{:=^50}\n", " Serving Benchmark Result ");
  line("Successful requests:", std::to_string(m["completed"].get<int64_t>()));
  if (m["failed"].get<int64_t>() > 0) line("Failed requests:", std::to_string(m["failed"].get<int64_t>()));
  line("Benchmark duration (s):", num(m["duration"].get<double>()));
  line("Total input tokens:", std::to_string(m["total_input_tokens"].get<int64_t>()));
  line("Total generated tokens:", std::to_string(m["total_output_tokens"].get<int64_t>()));
  line("Request throughput (req/s):", num(m["request_throughput"].get<double>()));
  line("Output token throughput (tok/s):", num(m["output_throughput"].get<double>()));
  line("Total Token throughput (tok/s):", num(m["total_token_throughput"].get<double>()));
  const struct {
    const char* title;
    const char* key;
    const char* label;
  } sections[] = {{"Time to First Token", "ttft", "TTFT"},
                  {"Time per Output Token (excl. 1st token)", "tpot", "TPOT"},
                  {"Inter-token Latency", "itl", "ITL"},
                  {"End-to-end Latency", "e2el", "E2EL"}};
  for (const auto& s : sections) {
    std::cout << fmt::format("{:-^50}\n", s.title);
    const std::string k = s.key;
    line(fmt::format("Mean {} (ms):", s.label), num(m["mean_" + k + "_ms"].get<double>()));
    line(fmt::format("Median {} (ms):", s.label), num(m["median_" + k + "_ms"].get<double>()));
    line(fmt::format("P99 {} (ms):", s.label), num(m["p99_" + k + "_ms"].get<double>()));
  }
  std::cout << std::string(50, '=') << "\n" << std::flush;
}

// A float as Python prints it (1.0, 2.5, inf), for benchmark_serving's header lines.
std::string python_float(double v) {
  if (std::isinf(v)) return "inf";
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

std::string utc_date() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", std::gmtime(&t));
  return buf;
}

}  // namespace

int run_bench_serve(int argc, char** argv) {
  CLI::App app{"nucleus bench serve: serving benchmark (vLLM benchmark_serving's metrics)", "nucleus bench serve"};
  BenchArgs a;
  app.add_option("--base-url", a.base_url, "Server URL, e.g. http://127.0.0.1:8000")->required();
  app.add_option("--model", a.model, "Model name to request (default: the server's first model)");
  app.add_option("--tokenizer", a.tokenizer_dir,
                 "Model directory whose tokenizer gives the prompt token ids (default: the server's vocab_size)");
  app.add_option("--num-prompts", a.num_prompts, "Requests to send")->check(positive_number())->capture_default_str();
  app.add_option("--max-concurrency", a.max_concurrency, "Requests in flight at most (0: unlimited)")
      ->check(non_negative_number())
      ->capture_default_str();
  app.add_option("--random-input-len", a.input_len, "Prompt tokens per request")
      ->check(positive_number())
      ->capture_default_str();
  app.add_option("--random-output-len", a.output_len, "max_tokens per request")
      ->check(positive_number())
      ->capture_default_str();
  app.add_option("--random-range-ratio", a.range_ratio, "Lengths uniform in [L(1-R), L(1+R)]")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--request-rate", a.request_rate, "Requests per second (inf: all at once; else Poisson arrivals)")
      ->capture_default_str();
  app.add_option("--burstiness", a.burstiness, "Gamma shape of the arrival intervals (1: Poisson)")
      ->check(positive_number())
      ->capture_default_str();
  app.add_flag("--ignore-eos", a.ignore_eos, "Generate max_tokens even past EOS");
  app.add_option("--seed", a.seed, "Seed of the prompts, lengths and arrivals")->capture_default_str();
  app.add_option("--result-json", a.result_json, "Write the results as JSON to this file");
  app.add_flag("--disable-tqdm", a.disable_progress, "No progress bar");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return exit_code_for(app, e);
  }
  init_logging();
  std::signal(SIGPIPE, SIG_IGN);  // a server that closes a connection is a failed request, not a crash
  double rate = 0.0;
  try {
    rate = std::stod(a.request_rate);
  } catch (...) {
    rate = -1.0;
  }
  if (!(rate > 0.0)) {
    std::cerr << "error: --request-rate must be a positive number or inf, got '" << a.request_rate << "'\n";
    return 2;
  }
  // The mean arrival interval 1 / rate must be one a clock can wait (a rate of
  // 1e-300 overflowed the sleep and sent everything at once).
  if (!std::isinf(rate) && !(1.0 / rate <= kMaxMeanIntervalSeconds)) {
    std::cerr << "error: --request-rate " << a.request_rate << " means one request every " << 1.0 / rate
              << " s on average; the longest mean interval is " << kMaxMeanIntervalSeconds << " s\n";
    return 2;
  }
  auto ep = parse_base_url(a.base_url);
  if (!ep.ok()) {
    std::cerr << "error: " << ep.status().message() << "\n";
    return 2;
  }
  auto info = probe(a, *ep);
  if (!info.ok()) {
    std::cerr << "error: " << info.status().message() << "\n";
    return 1;
  }
  std::mt19937_64 rng(a.seed);
  const auto requests = make_requests(a, info->token_pool, rng);

  std::cout << "Starting initial single prompt test run..." << std::endl;
  {
    auto client = make_client(*ep);
    RequestResult test = send_request(*client, *ep, info->model, requests[0], a.ignore_eos);
    if (!test.success) {
      std::cerr << "error: initial test run failed; check the benchmark arguments: " << test.error << "\n";
      return 1;
    }
  }
  std::cout << "Initial test run completed. Starting main benchmark run..." << std::endl;
  std::cout << "Traffic request rate: " << python_float(rate) << "\n";
  std::cout << "Burstiness factor: " << python_float(a.burstiness)
            << (a.burstiness == 1.0 ? " (Poisson process)" : " (Gamma distribution)") << "\n";
  std::cout << "Maximum request concurrency: "
            << (a.max_concurrency > 0 ? std::to_string(a.max_concurrency) : std::string("None")) << std::endl;

  const auto spec_before = spec_decode_counters(*ep);
  const double start = now_s();
  const auto results = run_all(a, *ep, info->model, requests, rate, rng);
  const double duration = now_s() - start;
  json m = compute_metrics(results, duration);
  print_report(m);
  print_spec_decode(spec_before, spec_decode_counters(*ep));
  for (const auto& r : results)
    if (!r.success) {
      std::cerr << "first failure: " << r.error << "\n";
      break;
    }
  if (!a.result_json.empty()) {
    json out = {{"date", utc_date()},
                {"backend", "openai"},
                {"model_id", info->model},
                {"base_url", a.base_url},
                {"num_prompts", a.num_prompts},
                {"request_rate", std::isinf(rate) ? json("inf") : json(rate)},
                {"burstiness", a.burstiness},
                {"max_concurrency", a.max_concurrency > 0 ? json(a.max_concurrency) : json(nullptr)},
                {"random_input_len", a.input_len},
                {"random_output_len", a.output_len},
                {"random_range_ratio", a.range_ratio},
                {"seed", a.seed}};
    out.update(m);
    std::ofstream f(a.result_json);
    if (!f) {
      std::cerr << "error: --result-json: cannot write '" << a.result_json << "'\n";
      return 1;
    }
    f << out.dump(2) << "\n";
  }
  return m["completed"].get<int64_t>() > 0 ? 0 : 1;
}

}  // namespace nucleus::cli
