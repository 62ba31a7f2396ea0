#include "server/message_parser.h"

namespace nucleus::server {

MessageParser::MessageParser(const OutputParsing& parsing, uint64_t id_seed) {
  if (parsing.reasoning) reasoning_.emplace();
  if (parsing.tool_calls) tools_.emplace(*parsing.tool_calls, id_seed);
  parallel_ = parsing.parallel_tool_calls;
}

void MessageParser::route_content(std::string_view content, bool final, MessageDelta& out) {
  if (!tools_) {
    out.content.append(content);
    return;
  }
  for (ToolParseDelta t : {tools_->add(content), final ? tools_->finish() : ToolParseDelta{}}) {
    out.content += t.content;
    for (auto& c : t.tool_calls) {
      if (!parallel_ && c.index > 0) continue;
      // Argument pieces of one call that arrive together are one piece.
      if (!out.tool_calls.empty() && c.name.empty() && out.tool_calls.back().index == c.index &&
          out.tool_calls.back().name.empty())
        out.tool_calls.back().arguments += c.arguments;
      else
        out.tool_calls.push_back(std::move(c));
    }
  }
}

MessageDelta MessageParser::add(std::string_view text, bool last) {
  MessageDelta out;
  if (!reasoning_) {
    route_content(text, last, out);
    return out;
  }
  ReasoningDelta r = reasoning_->add(text);
  if (last) {
    ReasoningDelta rest = reasoning_->finish();
    r.reasoning += rest.reasoning;
    r.content += rest.content;
  }
  out.reasoning = std::move(r.reasoning);
  route_content(r.content, last, out);
  return out;
}

std::vector<int32_t> marker_token_ids(const Tokenizer& tokenizer, const OutputParsing& parsing) {
  std::vector<std::string> markers;
  if (parsing.reasoning) markers = {std::string(kThinkBegin), std::string(kThinkEnd)};
  if (parsing.tool_calls)
    for (auto& m : tool_call_markers(*parsing.tool_calls)) markers.push_back(std::move(m));
  std::vector<int32_t> ids;
  for (const auto& m : markers)
    if (auto id = tokenizer.token_to_id(m)) ids.push_back(*id);
  return ids;
}

}  // namespace nucleus::server
