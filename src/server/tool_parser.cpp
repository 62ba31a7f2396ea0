#include "server/tool_parser.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

namespace nucleus::server {

namespace {

// DeepSeek's markers use U+FF5C (fullwidth vertical line) and U+2581 (lower
// one eighth block), as written in its tokenizer's added tokens.
constexpr std::string_view kDsCallsBegin = "<｜tool▁calls▁begin｜>";
constexpr std::string_view kDsCallsEnd = "<｜tool▁calls▁end｜>";
constexpr std::string_view kDsCallBegin = "<｜tool▁call▁begin｜>";
constexpr std::string_view kDsCallEnd = "<｜tool▁call▁end｜>";
constexpr std::string_view kDsSep = "<｜tool▁sep｜>";
constexpr std::string_view kKimiSectionBegin = "<|tool_calls_section_begin|>";
constexpr std::string_view kKimiSectionEnd = "<|tool_calls_section_end|>";
constexpr std::string_view kKimiCallBegin = "<|tool_call_begin|>";
constexpr std::string_view kKimiCallEnd = "<|tool_call_end|>";
constexpr std::string_view kKimiArgBegin = "<|tool_call_argument_begin|>";

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

size_t skip_space(std::string_view s, size_t i) {
  while (i < s.size() && is_space(s[i])) ++i;
  return i;
}

std::string_view trim_right(std::string_view s) {
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

std::string_view trim(std::string_view s) { return trim_right(s.substr(skip_space(s, 0))); }

// V3 arguments: the text after the name's line, inside a ```json fence:
//   ```json\nARGS\n```
// Leading whitespace and the opening fence (with its language tag) are
// skipped, trailing whitespace and the closing fence cut. While the call is
// open (`complete` false) what could still turn out to be the closing fence
// or whitespace before it waits: up to three trailing backticks with the
// whitespace around them. What is released this way is always a prefix of
// what the complete call gives (the held tail is the longest end of that
// shape, and the complete call cuts at most such an end).
std::string v3_arguments(std::string_view after, bool complete) {
  size_t i = skip_space(after, 0);
  if (i == after.size()) return "";
  const std::string_view fence = "```";
  if (after.substr(i, 3) == fence) {
    size_t j = i + 3;
    while (j < after.size() && std::isalnum(static_cast<unsigned char>(after[j]))) ++j;
    if (j == after.size() && !complete) return "";  // the language tag may go on
    i = j;
  } else if (!complete && fence.starts_with(after.substr(i))) {
    return "";  // may become the opening fence
  }
  std::string_view raw = after.substr(skip_space(after, i));
  raw = trim_right(raw);
  if (complete) {
    if (raw.ends_with(fence)) raw = trim_right(raw.substr(0, raw.size() - 3));
  } else {
    for (int k = 0; k < 3 && !raw.empty() && raw.back() == '`'; ++k) raw.remove_suffix(1);
    raw = trim_right(raw);
  }
  return std::string(raw);
}

}  // namespace

std::optional<ToolCallFormat> tool_call_format_from_name(std::string_view name) {
  if (name == "deepseek_v3") return ToolCallFormat::kDeepSeekV3;
  if (name == "deepseek_v31") return ToolCallFormat::kDeepSeekV31;
  if (name == "kimi_k2") return ToolCallFormat::kKimiK2;
  return std::nullopt;
}

const std::vector<std::string>& tool_call_format_names() {
  static const std::vector<std::string> names = {"deepseek_v3", "deepseek_v31", "kimi_k2"};
  return names;
}

std::vector<std::string> tool_call_markers(ToolCallFormat format) {
  if (format == ToolCallFormat::kKimiK2)
    return {std::string(kKimiSectionBegin), std::string(kKimiSectionEnd), std::string(kKimiCallBegin),
            std::string(kKimiCallEnd), std::string(kKimiArgBegin)};
  return {std::string(kDsCallsBegin), std::string(kDsCallsEnd), std::string(kDsCallBegin), std::string(kDsCallEnd),
          std::string(kDsSep)};
}

size_t partial_marker_length(std::string_view text, const std::vector<std::string>& markers) {
  size_t keep = 0;
  for (const auto& m : markers)
    for (size_t k = std::min(m.size() - 1, text.size()); k > keep; --k)
      if (text.substr(text.size() - k) == std::string_view(m).substr(0, k)) {
        keep = k;
        break;
      }
  return keep;
}

ToolCallParser::ToolCallParser(ToolCallFormat format, uint64_t id_seed) : format_(format), rng_(id_seed) {
  const bool kimi = format == ToolCallFormat::kKimiK2;
  section_begin_ = kimi ? kKimiSectionBegin : kDsCallsBegin;
  section_end_ = kimi ? kKimiSectionEnd : kDsCallsEnd;
  call_begin_ = kimi ? kKimiCallBegin : kDsCallBegin;
  call_end_ = kimi ? kKimiCallEnd : kDsCallEnd;
  call_markers_ = {call_end_, std::string(kimi ? kKimiArgBegin : kDsSep)};
}

std::string ToolCallParser::new_call_id() {
  return fmt::format("chatcmpl-tool-{:016x}{:016x}", rng_(), rng_());
}

ToolParseDelta ToolCallParser::add(std::string_view text) {
  ToolParseDelta out;
  if (finished_) return out;
  buf_ += text;
  advance(false, out);
  return out;
}

ToolParseDelta ToolCallParser::finish() {
  ToolParseDelta out;
  if (finished_) return out;
  finished_ = true;
  advance(true, out);
  return out;
}

void ToolCallParser::advance(bool final, ToolParseDelta& out) {
  for (;;) {
    switch (state_) {
      case State::kContent: {
        const size_t at = buf_.find(section_begin_);
        if (at != std::string::npos) {
          out.content.append(buf_, 0, at);
          buf_.erase(0, at + section_begin_.size());
          state_ = State::kSection;
          continue;
        }
        // A partial marker at the end waits; at the end of the output it is text.
        const size_t keep = final ? 0 : partial_marker_length(buf_, {section_begin_});
        out.content.append(buf_, 0, buf_.size() - keep);
        buf_.erase(0, buf_.size() - keep);
        return;
      }
      case State::kSection: {
        // Between calls: anything but the markers (whitespace) is skipped.
        const size_t call = buf_.find(call_begin_), end = buf_.find(section_end_);
        if (end != std::string::npos && (call == std::string::npos || end < call)) {
          state_ = State::kDone;
          continue;
        }
        if (call != std::string::npos) {
          buf_.erase(0, call + call_begin_.size());
          state_ = State::kCall;
          body_.clear();
          call_named_ = false;
          args_sent_ = 0;
          continue;
        }
        buf_.erase(0, buf_.size() - partial_marker_length(buf_, {call_begin_, section_end_}));
        if (final) buf_.clear();
        return;
      }
      case State::kCall: {
        const size_t end = buf_.find(call_end_);
        if (end != std::string::npos) {
          body_.append(buf_, 0, end);
          buf_.erase(0, end + call_end_.size());
          emit_call(true, out);
          state_ = State::kSection;
          continue;
        }
        // A partial marker at the end waits. At the end of the output (a
        // call cut off) it is dropped, and so is what was still waiting in
        // the call: a name without its end, V3's partial closing fence.
        const size_t keep = partial_marker_length(buf_, call_markers_);
        body_.append(buf_, 0, buf_.size() - keep);
        buf_.erase(0, buf_.size() - keep);
        emit_call(false, out);
        if (final) state_ = State::kDone;
        return;
      }
      case State::kDone:
        buf_.clear();
        return;
    }
  }
}

ToolCallParser::CallView ToolCallParser::view_call(std::string_view body, bool complete) const {
  CallView v;
  switch (format_) {
    case ToolCallFormat::kDeepSeekV3: {
      // TYPE<｜tool▁sep｜>NAME\n```json\nARGS\n```
      const size_t sep = body.find(kDsSep);
      if (sep == std::string_view::npos) return v;
      const std::string_view rest = body.substr(sep + kDsSep.size());
      const size_t nl = rest.find('\n');
      if (nl == std::string_view::npos && !complete) return v;  // the name may go on
      v.name = trim(rest.substr(0, nl));
      if (nl != std::string_view::npos) v.arguments = v3_arguments(rest.substr(nl + 1), complete);
      break;
    }
    case ToolCallFormat::kDeepSeekV31: {
      // NAME<｜tool▁sep｜>ARGS (the arguments as written, as vLLM returns them)
      const size_t sep = body.find(kDsSep);
      if (sep == std::string_view::npos) return v;
      v.name = trim(body.substr(0, sep));
      v.arguments = body.substr(sep + kDsSep.size());
      break;
    }
    case ToolCallFormat::kKimiK2: {
      // functions.NAME:IDX<|tool_call_argument_begin|>ARGS; the id is
      // "functions.NAME:IDX", the name what is between the last '.' and ':'.
      const size_t arg = body.find(kKimiArgBegin);
      if (arg == std::string_view::npos) return v;
      const std::string_view id = trim(body.substr(0, arg));
      std::string_view name = id.substr(0, id.find(':'));
      if (const size_t dot = name.rfind('.'); dot != std::string_view::npos) name = name.substr(dot + 1);
      v.id = id;
      v.name = name;
      // Surrounding whitespace is not part of the arguments; while the call
      // is open, trailing whitespace waits.
      v.arguments = trim(body.substr(arg + kKimiArgBegin.size()));
      break;
    }
  }
  v.name_known = !v.name.empty();
  return v;
}

void ToolCallParser::emit_call(bool complete, ToolParseDelta& out) {
  CallView v = view_call(body_, complete);
  if (!v.name_known) return;
  if (!call_named_) {
    call_named_ = true;
    out.tool_calls.push_back({num_calls_, v.id.empty() ? new_call_id() : v.id, v.name, ""});
    ++num_calls_;
  }
  // The released arguments are a prefix of v.arguments (see v3_arguments).
  if (v.arguments.size() <= args_sent_) return;
  std::string piece = v.arguments.substr(args_sent_);
  args_sent_ = v.arguments.size();
  const int index = num_calls_ - 1;
  if (!out.tool_calls.empty() && out.tool_calls.back().index == index && out.tool_calls.back().name.empty())
    out.tool_calls.back().arguments += piece;
  else
    out.tool_calls.push_back({index, "", "", std::move(piece)});
}

}  // namespace nucleus::server
