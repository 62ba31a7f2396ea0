#include "graph/op_profiler.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <vector>

#include "core/knobs.h"
#include "core/tensor.h"

#ifdef NUCLEUS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/context.h"
#endif

namespace nucleus {

namespace {
struct Entry {
  double ms = 0;
  int64_t calls = 0;
};
struct Profiler {
  std::mutex mu;
  std::map<std::string, Entry> totals;
#ifdef NUCLEUS_HAVE_CUDA
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> events;
  std::vector<std::string> labels;
#endif
  ~Profiler() { op_profile_report(); }
};
// The node in flight is per thread: tensor-parallel ranks run nodes at once
// (their totals add up).
#ifdef NUCLEUS_HAVE_CUDA
thread_local cudaEvent_t t_pending = nullptr;
#endif
thread_local std::chrono::steady_clock::time_point t_cpu_start;
Profiler& profiler() {
  static Profiler p;
  return p;
}
// Device timing applies once the CUDA context exists (a CUDA model is loaded).
bool cuda_ready() { return device_allocator_registered(Device::kCuda); }

// No profiling while a CUDA graph is being captured.
bool capturing() {
#ifdef NUCLEUS_HAVE_CUDA
  if (!cuda_ready()) return false;
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(cuda::context().stream, &st);
  return st != cudaStreamCaptureStatusNone;
#else
  return false;
#endif
}
}  // namespace

bool op_profiling_per_node() {
  static const bool on = [] {
    auto v = env_string(Knob::kProfileOps);
    return v && *v == "node";
  }();
  return on;
}

Status profile_ops_env_status() {
  const std::optional<std::string> v = env_string(Knob::kProfileOps);
  if (!v || *v == "node" || flag_value_ok(*v)) return ok_status();
  return invalid_argument("NUCLEUS_PROFILE_OPS='" + *v + "' is not a flag value (1/true/yes/on, 0/false/no/off) or node");
}

bool op_profiling_enabled() {
  static const bool on = parse_flag(env_string(Knob::kProfileOps).value_or("")) || op_profiling_per_node();
  return on;
}

namespace {
// Set by the model thread before each step's nodes; per thread, since
// tensor-parallel ranks run their steps on their own threads at once.
thread_local std::string t_phase;
}  // namespace

void op_profile_set_phase(const char* phase) { t_phase = phase; }

std::string op_profile_label(const std::string& node_name, const std::string& kind, const std::string& backend) {
  if (!op_profiling_per_node()) return kind + "/" + backend;
  std::string name = node_name;
  if (name.rfind("layers.", 0) == 0) {  // layers.<L>.rest -> layers.*.rest
    const size_t dot = name.find('.', 7);
    if (dot != std::string::npos) name = "layers.*" + name.substr(dot);
  }
  return name + " [" + kind + "/" + backend + "]";
}

void op_profile_begin() {
  if (capturing()) return;
#ifdef NUCLEUS_HAVE_CUDA
  if (cuda_ready()) {
    cudaEventCreate(&t_pending);
    cudaEventRecord(t_pending, cuda::context().stream);
    return;
  }
#endif
  t_cpu_start = std::chrono::steady_clock::now();
}

void op_profile_end(const std::string& node_label) {
  if (capturing()) return;
  Profiler& p = profiler();
  const std::string label = t_phase.empty() ? node_label : t_phase + " " + node_label;
  std::lock_guard<std::mutex> lock(p.mu);
#ifdef NUCLEUS_HAVE_CUDA
  if (cuda_ready()) {
    cudaEvent_t end;
    cudaEventCreate(&end);
    cudaEventRecord(end, cuda::context().stream);
    p.events.emplace_back(t_pending, end);
    p.labels.push_back(label);
    if (p.events.size() >= 4096) {  // drain
      cudaEventSynchronize(end);
      for (size_t i = 0; i < p.events.size(); ++i) {
        float ms = 0;
        cudaEventElapsedTime(&ms, p.events[i].first, p.events[i].second);
        auto& e = p.totals[p.labels[i]];
        e.ms += ms;
        ++e.calls;
        cudaEventDestroy(p.events[i].first);
        cudaEventDestroy(p.events[i].second);
      }
      p.events.clear();
      p.labels.clear();
    }
    return;
  }
#endif
  auto& e = p.totals[label];
  e.ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_cpu_start).count();
  ++e.calls;
}

void op_profile_report() {
  if (!op_profiling_enabled()) return;
  Profiler& p = profiler();
  std::lock_guard<std::mutex> lock(p.mu);
#ifdef NUCLEUS_HAVE_CUDA
  if (!p.events.empty()) {
    cudaEventSynchronize(p.events.back().second);
    for (size_t i = 0; i < p.events.size(); ++i) {
      float ms = 0;
      cudaEventElapsedTime(&ms, p.events[i].first, p.events[i].second);
      auto& e = p.totals[p.labels[i]];
      e.ms += ms;
      ++e.calls;
    }
    p.events.clear();
    p.labels.clear();
  }
#endif
  if (p.totals.empty()) return;
  std::vector<std::pair<std::string, Entry>> rows(p.totals.begin(), p.totals.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  double total = 0;
  for (const auto& r : rows) total += r.second.ms;
  const int width = op_profiling_per_node() ? 78 : 44;
  std::fprintf(stderr, "op profile (NUCLEUS_PROFILE_OPS): %.3f ms in %zu labels\n", total, rows.size());
  std::fprintf(stderr, "%-*s %10s %8s %10s %6s\n", width, "phase op", "total_ms", "calls", "us/call", "%");
  for (const auto& [label, e] : rows)
    std::fprintf(stderr, "%-*s %10.3f %8lld %10.2f %5.1f%%\n", width, label.c_str(), e.ms,
                 static_cast<long long>(e.calls), 1000.0 * e.ms / e.calls, 100.0 * e.ms / total);
  if (op_profiling_per_node()) {
    // Per layer: every layers.* node's time over the layers run (post_attention_layernorm calls: decode
    // graphs may fold a layer's input_layernorm into the MoE op before it).
    std::map<std::string, std::pair<double, int64_t>> layers;  // phase -> (ms, layers run)
    for (const auto& [label, e] : rows) {
      const size_t at = label.find("layers.*.");
      if (at == std::string::npos) continue;
      auto& l = layers[label.substr(0, at)];
      l.first += e.ms;
      if (label.find("layers.*.post_attention_layernorm ") != std::string::npos) l.second += e.calls;
    }
    for (const auto& [phase, l] : layers)
      if (l.second > 0)
        std::fprintf(stderr, "%slayer (all layers.* nodes): %.2f us per layer over %lld layer runs\n", phase.c_str(),
                     1000.0 * l.first / l.second, static_cast<long long>(l.second));
  }
  p.totals.clear();
}

}  // namespace nucleus
