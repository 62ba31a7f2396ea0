// Generation: one HTTP request's choices in flight. It submits one engine
// request per choice (ids "<request id>-<index>", seeds seed + i for the i-th
// choice of a prompt), turns their token events into text with an
// IncrementalDetokenizer per choice (stop strings: when one completes, the
// engine request is aborted and the choice finishes with "stop"), and
// reports each finished choice to the metrics. Streaming and non-streaming
// responses both consume it, so their text is the same by construction.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "io/detokenizer.h"
#include "server/async_engine.h"
#include "server/metrics.h"
#include "server/protocol.h"

namespace nucleus::server {

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;  // by decreasing logprob
};

// What one choice produced since the last call of Generation::next().
struct ChoiceDelta {
  int index = 0;
  std::string text;
  std::vector<int32_t> token_ids;      // the new tokens; filled only without a tokenizer (--skip-tokenizer-init)
  std::vector<TokenLogprob> logprobs;  // the tokens consumed for `text` (when requested)
  // params.prompt_logprobs: entry p scores prompt token p + 1; in the
  // choice's first delta.
  std::vector<TokenLogprobs> prompt_logprobs;
  std::string finish_reason;           // set in the choice's last delta: "stop", "length", "abort", "error"
  Status error;                        // with finish_reason "error": why the engine failed the choice
};

class Generation {
 public:
  // `arrival_time`: steady_seconds() when the HTTP request came in.
  // `tokenizer` null: no detokenization; deltas carry token_ids and no text.
  Generation(AsyncEngine& engine, const Tokenizer* tokenizer, ServerMetrics& metrics, std::string request_id,
             const GenerationRequest& request, double arrival_time);
  // Aborts the choices still running (a client that went away) and records
  // them as "abort".
  ~Generation();
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  // Submits every choice and waits until the engine admitted or refused each.
  // A refusal aborts the admitted ones and returns the engine's error.
  Status start();

  // Blocks until some choice made progress; returns a delta per choice that
  // has new text or finished (in choice order). Call until done().
  std::vector<ChoiceDelta> next();
  // As next(), but returns after at most about `timeout_s` seconds, maybe
  // with nothing (so the caller can check on its client meanwhile).
  std::vector<ChoiceDelta> next(double timeout_s);
  bool done() const { return num_done_ == static_cast<int>(choices_.size()); }

  int num_choices() const { return static_cast<int>(choices_.size()); }
  // usage: prompt tokens once per prompt, completion tokens of every choice
  // (tokens the detokenizer consumed, up to the one completing a stop string).
  int64_t prompt_tokens() const { return prompt_tokens_; }
  int64_t completion_tokens() const;
  // OK, or the error of the first choice the engine finished with "error"
  // (a failed step: RequestOutput::error).
  const Status& error() const { return error_; }

 private:
  struct Choice {
    int index = 0;
    int prompt = 0;  // index into request_.prompts
    std::string engine_id;
    std::unique_ptr<IncrementalDetokenizer> detok;
    bool admitted = false, done = false;
    int64_t num_tokens = 0;
    double first_token_time = 0.0, last_token_time = 0.0;
    std::vector<double> gaps;
    ChoiceDelta pending;  // not yet returned by next(): text held until non-empty
  };

  // Consumes one event into its choice's pending delta.
  void consume(const OutputEvent& e);
  void finish(Choice& c, const std::string& reason, double time);

  AsyncEngine& engine_;
  const Tokenizer* tokenizer_;
  ServerMetrics& metrics_;
  std::string request_id_;
  const GenerationRequest& request_;
  double arrival_time_;
  std::shared_ptr<OutputQueue> queue_ = std::make_shared<OutputQueue>();
  std::vector<Choice> choices_;
  std::vector<OutputEvent> early_;  // outputs that came while start() waited
  int num_done_ = 0;
  int64_t prompt_tokens_ = 0;
  Status error_;
};

// "stop", "length", "abort", "error".
std::string finish_reason_string(FinishReason r);

// The client's error for a choice the engine failed (Generation::error()):
// 503 service_unavailable when the engine failed as a whole (kAborted: it
// serves nothing more), else 500 internal_error; the message is the
// engine's, naming the op that failed. The body of a non-streaming
// response, and an error event of a stream.
ApiError generation_error(const Status& error);

}  // namespace nucleus::server
