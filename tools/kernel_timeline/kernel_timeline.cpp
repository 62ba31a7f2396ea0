// Kernel timeline: a CUPTI injection library that records every kernel a
// program runs, CUDA-graph nodes included, with the GPU's start and end
// timestamps, and writes them as CSV when the program exits. It measures
// what ncu cannot: kernels as they run inside a graph replay, overlapped by
// PDL, at the clocks the GPU chooses, with warm caches.
//
//   CUDA_INJECTION64_PATH=build/lib/libnucleus_kernel_timeline.so
//     KERNEL_TIMELINE_OUT=timeline.csv nucleus bench latency ...   (one command line)
//   python3 tools/kernel_timeline/summarize.py timeline.csv
//
// Columns: start_ns, end_ns (GPU timestamps, ns), graph_id, graph_node_id
// (0 outside graphs), stream, grid (x*y*z CTAs), block (threads), name
// (mangled). CUPTI records a kernel's start when its first CTA starts, so a
// kernel launched as a programmatic dependent (PDL) starts early and waits
// inside; the summary therefore charges each kernel end - previous end.
// Errors (CUPTI calls, the output file) are printed to stderr; the program
// being traced is never stopped.
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr size_t kBufferBytes = 8u << 20;
std::mutex g_mu;
std::vector<std::string> g_rows;  // one CSV line each

void report(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "kernel_timeline: %s failed: %s\n", what, msg ? msg : "unknown CUPTI error");
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::vector<std::string> rows;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && rec->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    char line[160];
    std::snprintf(line, sizeof line, "%llu,%llu,%u,%llu,%u,%lld,%d,", static_cast<unsigned long long>(k->start),
                  static_cast<unsigned long long>(k->end), k->graphId,
                  static_cast<unsigned long long>(k->graphNodeId), k->streamId,
                  static_cast<long long>(k->gridX) * k->gridY * k->gridZ, k->blockX * k->blockY * k->blockZ);
    rows.emplace_back(std::string(line) + (k->name ? k->name : "?"));
  }
  size_t dropped = 0;
  report(cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped), "cuptiActivityGetNumDroppedRecords");
  if (dropped) std::fprintf(stderr, "kernel_timeline: %zu records dropped\n", dropped);
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mu);
  for (auto& r : rows) g_rows.push_back(std::move(r));
}

void write_out() {
  report(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  const char* path = std::getenv("KERNEL_TIMELINE_OUT");
  const std::string out = path && *path ? path : "kernel_timeline.csv";
  std::FILE* f = std::fopen(out.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "kernel_timeline: cannot write %s: %s\n", out.c_str(), std::strerror(errno));
    return;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(f, "start_ns,end_ns,graph_id,graph_node_id,stream,grid,block,name\n");
  for (const auto& r : g_rows) std::fprintf(f, "%s\n", r.c_str());
  std::fclose(f);
  std::fprintf(stderr, "kernel_timeline: %zu kernels written to %s\n", g_rows.size(), out.c_str());
}

}  // namespace

// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library.
extern "C" __attribute__((visibility("default"))) int InitializeInjection() {
  report(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable(CONCURRENT_KERNEL)");
  std::atexit(write_out);
  return 1;
}
