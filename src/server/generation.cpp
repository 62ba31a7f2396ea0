#include "server/generation.h"

namespace nucleus::server {

ApiError generation_error(const Status& error) {
  ApiError e;
  const bool unavailable = error.code() == StatusCode::kAborted;
  e.http_status = unavailable ? 503 : 500;
  e.type = unavailable ? "service_unavailable" : "internal_error";
  e.message = "The engine failed this request: " + error.to_string();
  return e;
}

std::string finish_reason_string(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAbort:
      return "abort";
    case FinishReason::kError:
      return "error";
    case FinishReason::kNone:
      break;
  }
  return "";
}

Generation::Generation(AsyncEngine& engine, const Tokenizer* tokenizer, ServerMetrics& metrics, std::string request_id,
                       const GenerationRequest& request, double arrival_time)
    : engine_(engine),
      tokenizer_(tokenizer),
      metrics_(metrics),
      request_id_(std::move(request_id)),
      request_(request),
      arrival_time_(arrival_time) {
  // The output parsers' markers stay in the text whatever skip_special_tokens says.
  const std::vector<int32_t> markers =
      tokenizer_ && request_.parsing.any() ? marker_token_ids(*tokenizer_, request_.parsing) : std::vector<int32_t>{};
  for (size_t p = 0; p < request_.prompts.size(); ++p) {
    prompt_tokens_ += static_cast<int64_t>(request_.prompts[p].token_ids.size());
    for (int i = 0; i < request_.n; ++i) {
      Choice c;
      c.index = static_cast<int>(choices_.size());
      c.prompt = static_cast<int>(p);
      c.engine_id = request_id_ + "-" + std::to_string(c.index);
      if (tokenizer_)
        c.detok = std::make_unique<IncrementalDetokenizer>(*tokenizer_, request_.params.stop,
                                                           request_.skip_special_tokens,
                                                           request_.include_stop_str_in_output);
      if (c.detok && !markers.empty()) c.detok->keep_special(markers);
      c.pending.index = c.index;
      choices_.push_back(std::move(c));
    }
  }
}

Generation::~Generation() {
  const double now = steady_seconds();
  for (auto& c : choices_)
    if (c.admitted && !c.done) {
      engine_.abort(c.engine_id);
      finish(c, "abort", now);
    }
}

Status Generation::start() {
  std::vector<EngineRequest> requests;
  for (const auto& c : choices_) {
    EngineRequest r;
    r.request_id = c.engine_id;
    r.index = c.index;
    r.prompt_token_ids = request_.prompts[c.prompt].token_ids;
    r.params = request_.params;
    const int i = c.index % request_.n;  // the choice's rank within its prompt
    if (r.params.seed) r.params.seed = *r.params.seed + static_cast<uint64_t>(i);
    requests.push_back(std::move(r));
  }
  engine_.submit(std::move(requests), queue_);
  int answered = 0;
  Status error;
  while (answered < num_choices()) {
    for (auto& e : queue_->pop_all()) {
      if (e.kind == OutputEvent::Kind::kAdmitted) {
        choices_[e.index].admitted = true;
        ++answered;
      } else if (e.kind == OutputEvent::Kind::kRejected) {
        ++answered;
        if (error.ok()) error = e.error;
      } else {
        early_.push_back(std::move(e));
      }
    }
  }
  if (error.ok()) return error;
  const double now = steady_seconds();
  for (auto& c : choices_) {
    if (c.admitted) engine_.abort(c.engine_id);
    c.admitted = false;  // nothing for the destructor to do
    finish(c, "error", now);
  }
  return error;
}

std::vector<ChoiceDelta> Generation::next() { return next(-1.0); }

std::vector<ChoiceDelta> Generation::next(double timeout_s) {
  std::vector<ChoiceDelta> out;
  const double deadline = steady_seconds() + timeout_s;
  while (out.empty() && !done()) {
    std::vector<OutputEvent> events;
    events.swap(early_);
    if (events.empty() && timeout_s < 0) {
      events = queue_->pop_all();
    } else if (events.empty()) {
      const double left = deadline - steady_seconds();
      if (left <= 0) break;
      events = queue_->pop_all_for(left);
    }
    for (const auto& e : events) consume(e);
    for (auto& c : choices_) {
      if (c.pending.text.empty() && c.pending.token_ids.empty() && c.pending.finish_reason.empty() &&
          c.pending.prompt_logprobs.empty())
        continue;
      out.push_back(std::move(c.pending));
      c.pending = ChoiceDelta{};
      c.pending.index = c.index;
    }
  }
  return out;
}

int64_t Generation::completion_tokens() const {
  int64_t n = 0;
  for (const auto& c : choices_) n += c.num_tokens;
  return n;
}

void Generation::consume(const OutputEvent& e) {
  if (e.kind != OutputEvent::Kind::kOutput) return;
  Choice& c = choices_[e.index];
  if (c.done) return;  // tokens that raced a stop-string abort
  const RequestOutput& o = e.output;
  if (!o.prompt_logprobs.empty()) c.pending.prompt_logprobs = o.prompt_logprobs;
  // echo with max_tokens 0: the token the engine had to sample is dropped.
  const size_t num_new = request_.echo_only ? 0 : o.new_token_ids.size();
  for (size_t k = 0; k < num_new; ++k) {
    ++c.num_tokens;
    if (c.first_token_time == 0.0)
      c.first_token_time = e.time;
    else
      c.gaps.push_back(e.time - c.last_token_time);
    c.last_token_time = e.time;
    if (c.detok)
      c.pending.text += c.detok->add(o.new_token_ids[k]);
    else
      c.pending.token_ids.push_back(o.new_token_ids[k]);
    if (request_.logprobs && k < o.new_samples.size()) {
      const SampleResult& s = o.new_samples[k];
      c.pending.logprobs.push_back({s.token, s.logprob, s.top_logprobs});
    }
    if (c.detok && c.detok->stopped()) {
      engine_.abort(c.engine_id);
      finish(c, "stop", e.time);
      return;
    }
  }
  if (o.finished) {
    if (o.finish_reason == FinishReason::kError) {
      c.pending.error = o.error.ok() ? internal_error("the engine failed the request") : o.error;
      if (error_.ok()) error_ = c.pending.error;
    }
    if (c.detok) c.pending.text += c.detok->finish();
    finish(c, finish_reason_string(o.finish_reason), e.time);
  }
}

void Generation::finish(Choice& c, const std::string& reason, double time) {
  c.done = true;
  ++num_done_;
  c.pending.finish_reason = reason;
  RequestRecord r;
  r.finish_reason = reason;
  // usage counts a prompt once however many choices it has; so do the metrics.
  if (c.index % request_.n == 0 && reason != "error")
    r.prompt_tokens = static_cast<int64_t>(request_.prompts[c.prompt].token_ids.size());
  r.generation_tokens = c.num_tokens;
  r.arrival_time = arrival_time_;
  r.first_token_time = c.first_token_time;
  r.finish_time = time;
  r.inter_token_gaps = std::move(c.gaps);
  metrics_.record_request(r);
}

}  // namespace nucleus::server
