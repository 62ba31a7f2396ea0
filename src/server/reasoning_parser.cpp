#include "server/reasoning_parser.h"

#include "server/tool_parser.h"

namespace nucleus::server {

bool is_reasoning_parser_name(std::string_view name) { return name == "deepseek_r1"; }

ReasoningDelta ReasoningParser::add(std::string_view text) {
  ReasoningDelta out;
  if (finished_) return out;
  buf_ += text;
  advance(false, out);
  return out;
}

ReasoningDelta ReasoningParser::finish() {
  ReasoningDelta out;
  if (finished_) return out;
  finished_ = true;
  advance(true, out);
  return out;
}

void ReasoningParser::advance(bool final, ReasoningDelta& out) {
  if (state_ == State::kStart) {
    // Until the output is known not to start with "<think>", it waits.
    if (!final && buf_.size() < kThinkBegin.size() && kThinkBegin.starts_with(buf_)) return;
    if (buf_.starts_with(kThinkBegin)) buf_.erase(0, kThinkBegin.size());
    state_ = State::kReasoning;
  }
  if (state_ == State::kReasoning) {
    const size_t end = buf_.find(kThinkEnd);
    if (end == std::string::npos) {
      const size_t keep = final ? 0 : partial_marker_length(buf_, {std::string(kThinkEnd)});
      out.reasoning.append(buf_, 0, buf_.size() - keep);
      buf_.erase(0, buf_.size() - keep);
      return;
    }
    out.reasoning.append(buf_, 0, end);
    buf_.erase(0, end + kThinkEnd.size());
    state_ = State::kContent;
  }
  out.content += buf_;
  buf_.clear();
}

}  // namespace nucleus::server
