// AsyncEngine: a thread-safe front of LLMEngine for the HTTP server.
//
// LLMEngine is not thread-safe, so one loop thread owns it: it takes new
// requests and aborts from a mutex-protected inbox, calls step() while there
// is work, and routes every RequestOutput to the OutputQueue of the HTTP
// request that submitted it. An idle loop sleeps on a condition variable
// until the inbox gets something; handler threads sleep on their queue's
// condition variable. Nothing busy-waits.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "runtime/llm_engine.h"

namespace nucleus::server {

// Seconds on the steady clock (the time base of every event time below).
double steady_seconds();

// One thing that happened to one engine request.
struct OutputEvent {
  enum class Kind {
    kAdmitted,  // add_request succeeded
    kRejected,  // add_request failed: `error` says why; nothing follows
    kOutput,    // tokens and/or the finish (output.finished)
  };
  Kind kind = Kind::kOutput;
  int index = 0;         // the choice index given at submission
  Status error;          // kRejected
  RequestOutput output;  // kOutput
  double time = 0.0;     // steady_seconds() when the loop produced it
};

// The events of one HTTP request (all of its engine requests), in order.
// The loop pushes; the handler thread pops.
class OutputQueue {
 public:
  void push(OutputEvent e);
  // Blocks until at least one event is queued, then takes all of them.
  std::vector<OutputEvent> pop_all();
  // As pop_all(), but returns what is queued (maybe nothing) after at most
  // `timeout_s` seconds.
  std::vector<OutputEvent> pop_all_for(double timeout_s);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<OutputEvent> events_;
};

// One engine request to submit.
struct EngineRequest {
  std::string request_id;  // unique among live requests, e.g. "cmpl-1f-0"
  int index = 0;           // echoed back in every OutputEvent
  std::vector<int32_t> prompt_token_ids;
  SamplingParams params;
};

class AsyncEngine {
 public:
  // Starts the loop thread; the engine is owned by it from now on.
  explicit AsyncEngine(std::unique_ptr<LLMEngine> engine);
  ~AsyncEngine();  // shutdown()
  AsyncEngine(const AsyncEngine&) = delete;
  AsyncEngine& operator=(const AsyncEngine&) = delete;

  // Queues the requests (atomically: the loop admits them in the same pass);
  // each then gets kAdmitted or kRejected, then its outputs, on `queue`.
  // After shutdown() every request is rejected (kAborted).
  void submit(std::vector<EngineRequest> requests, std::shared_ptr<OutputQueue> queue);

  // Aborts a live request: its queue gets a finished output with reason
  // kAbort, and its KV blocks are freed. Unknown or finished ids are ignored.
  void abort(const std::string& request_id);
  // Aborts every live request (shutdown past its grace period).
  void abort_all();

  // Blocks until no request is live or `timeout_s` passed; true if idle.
  bool wait_idle(double timeout_s);

  // The engine's counters after the loop's latest pass.
  EngineStats stats() const;
  // OK, or why the engine failed (LLMEngine::failure(); it then refuses
  // every request with that kAborted status).
  Status failure() const;
  // Calls `fn` once, on the loop thread, when the engine fails (at once, on
  // the caller's thread, when it has failed already): `nucleus serve` shuts
  // down then.
  void on_failure(std::function<void(const Status&)> fn);
  // Set at construction; constant afterwards, so readable from any thread.
  const EngineConfig& config() const { return config_; }
  int64_t vocab_size() const { return vocab_size_; }

  // Aborts what is live, stops and joins the loop. Idempotent.
  void shutdown();

 private:
  struct Pending {
    std::vector<EngineRequest> requests;
    std::shared_ptr<OutputQueue> queue;
  };
  struct Live {
    int index = 0;
    std::shared_ptr<OutputQueue> queue;
  };

  void loop();
  // Loop thread only: admissions and aborts taken from the inbox.
  void admit(Pending& p);
  void do_abort(const std::string& request_id);
  void route(std::vector<RequestOutput>& outputs);

  std::unique_ptr<LLMEngine> engine_;  // loop thread only
  EngineConfig config_;
  int64_t vocab_size_ = 0;

  mutable std::mutex mu_;         // guards the fields below
  std::condition_variable wake_;  // the loop waits on it when idle
  std::condition_variable idle_;  // wait_idle() waits on it
  std::vector<Pending> inbox_;
  std::vector<std::string> aborts_;
  bool abort_all_ = false;
  bool stop_ = false;
  int64_t num_live_ = 0;  // submitted and not yet finished or rejected
  EngineStats stats_;
  Status failure_;
  std::function<void(const Status&)> on_failure_;

  std::unordered_map<std::string, Live> live_;  // loop thread only
  std::thread thread_;
};

}  // namespace nucleus::server
