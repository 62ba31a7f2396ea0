#include "server/responses.h"

#include <algorithm>
#include <random>

#include "io/utf8.h"

namespace nucleus::server {

using nlohmann::json;

json usage_json(int64_t prompt_tokens, int64_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

std::string dump_json(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

ResponseBuilder::ResponseBuilder(ResponseHeader header, const GenerationRequest& request, const Tokenizer* tokenizer,
                                 int num_choices)
    : header_(std::move(header)), request_(request), tokenizer_(tokenizer), choices_(num_choices) {
  for (int i = 0; i < num_choices; ++i) {
    choices_[i].text = echo_text(i);
    if (request_.chat)
      choices_[i].logprobs = {{"content", json::array()}};
    else
      choices_[i].logprobs = {{"tokens", json::array()},
                              {"token_logprobs", json::array()},
                              {"top_logprobs", json::array()},
                              {"text_offset", json::array()}};
    if (request_.chat && request_.parsing.any())
      choices_[i].parser = std::make_unique<MessageParser>(request_.parsing, std::random_device{}());
  }
}

MessageDelta ResponseBuilder::parse(ChoiceState& c, const ChoiceDelta& d, std::string& finish_reason) const {
  MessageDelta m = c.parser->add(d.text, !d.finish_reason.empty());
  finish_reason = d.finish_reason;
  // As vLLM: a choice that made tool calls finishes with "tool_calls" (one
  // cut off by max_tokens keeps "length": its last call may be incomplete).
  if (finish_reason == "stop" && c.parser->num_tool_calls() > 0) finish_reason = "tool_calls";
  return m;
}

std::vector<json> ResponseBuilder::chunks(const ChoiceDelta& d) {
  ChoiceState& c = choices_[d.index];
  if (!c.parser) return {chunk(d)};
  std::string finish_reason;
  const MessageDelta m = parse(c, d, finish_reason);
  std::vector<json> deltas;
  json text = json::object();
  if (!m.reasoning.empty()) {
    // "reasoning_content" as DeepSeek's API, SGLang and vLLM before 0.17;
    // "reasoning" as vLLM since.
    text["reasoning_content"] = m.reasoning;
    text["reasoning"] = m.reasoning;
  }
  if (!m.content.empty()) text["content"] = m.content;
  if (!text.empty()) deltas.push_back(std::move(text));
  for (const auto& t : m.tool_calls) {
    json call = {{"index", t.index}};
    if (!t.name.empty()) {
      call["id"] = t.id;
      call["type"] = "function";
      call["function"] = {{"name", t.name}, {"arguments", ""}};
    } else {
      call["function"] = {{"arguments", t.arguments}};
    }
    deltas.push_back({{"tool_calls", json::array({call})}});
  }
  const bool has_logprobs = request_.logprobs && !d.logprobs.empty();
  if (deltas.empty() && (has_logprobs || !finish_reason.empty())) deltas.push_back(json::object());
  std::vector<json> out;
  for (size_t i = 0; i < deltas.size(); ++i) {
    json chunk = base("chat.completion.chunk");
    json lp = i == 0 && request_.logprobs ? logprobs_json(d, c) : json(nullptr);
    json finish = i + 1 == deltas.size() && !finish_reason.empty() ? json(finish_reason) : json(nullptr);
    json choice = {{"index", d.index}, {"delta", std::move(deltas[i])}, {"logprobs", lp}, {"finish_reason", finish}};
    chunk["choices"] = json::array({std::move(choice)});
    if (request_.include_usage) chunk["usage"] = nullptr;
    out.push_back(std::move(chunk));
  }
  return out;
}

std::string ResponseBuilder::echo_text(int index) const {
  if (!request_.echo) return "";
  return request_.prompts[index / request_.n].text;
}

json ResponseBuilder::base(const char* object) const {
  return {{"id", header_.id}, {"object", object}, {"created", header_.created}, {"model", header_.model}};
}

// Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
// with token strings as their decoded bytes and offsets in characters of the
// choice's text (vLLM: the sum of the previous tokens' Python lengths; a
// skipped special token takes none); logprobs below -9999 are reported as
// -9999 (vLLM; JSON has no -inf). With echo, the prompt's tokens come
// first, the first with null logprob and top_logprobs. Chat: {"content":
// [{"token", "logprob", "bytes", "top_logprobs": [...]}]}. The scored token
// is always among the completions' top_logprobs (as vLLM does).
json ResponseBuilder::logprobs_json(const ChoiceDelta& d, ChoiceState& c) const {
  auto bytes_of = [](const std::string& s) {
    json b = json::array();
    for (unsigned char ch : s) b.push_back(static_cast<int>(ch));
    return b;
  };
  if (request_.chat) {
    json content = json::array();
    for (const auto& e : d.logprobs) {
      const std::string t = tokenizer_->token_bytes(e.token);
      json top = json::array();
      for (const auto& [id, lp] : e.top) {
        const std::string s = tokenizer_->token_bytes(id);
        top.push_back({{"token", s}, {"logprob", lp}, {"bytes", bytes_of(s)}});
      }
      content.push_back({{"token", t}, {"logprob", e.logprob}, {"bytes", bytes_of(t)}, {"top_logprobs", top}});
    }
    return {{"content", content}};
  }
  json out = {{"tokens", json::array()},
              {"token_logprobs", json::array()},
              {"top_logprobs", json::array()},
              {"text_offset", json::array()}};
  auto clamp = [](float lp) { return std::max(lp, -9999.0f); };
  // Token texts as Python decodes them (invalid UTF-8 as U+FFFD): two
  // partial-character tokens are then one key of a position's top_logprobs,
  // the scored token's value last (as vLLM's dict), never a duplicate key.
  auto text_of = [&](int32_t id) { return utf8_replace_invalid(tokenizer_->token_bytes(id)); };
  auto push = [&](int32_t token, json logprob, json top) {
    const std::string t = tokenizer_->token_bytes(token);
    out["tokens"].push_back(utf8_replace_invalid(t));
    out["token_logprobs"].push_back(std::move(logprob));
    out["top_logprobs"].push_back(std::move(top));
    out["text_offset"].push_back(c.text_offset);
    // A special token the text skips takes no room in it.
    if (!(request_.skip_special_tokens && tokenizer_->is_special(token))) c.text_offset += utf8_length(t);
  };
  if (echo_logprobs() && !c.echoed) {
    const std::vector<int32_t>& prompt = request_.prompts[d.index / request_.n].token_ids;
    push(prompt[0], nullptr, nullptr);
    for (const auto& e : d.prompt_logprobs) {
      json top = json::object();
      for (size_t k = 0; k < e.top.size() && static_cast<int32_t>(k) < request_.params.logprobs; ++k)
        top[text_of(e.top[k].first)] = clamp(e.top[k].second);
      top[text_of(e.token)] = clamp(e.logprob);
      push(e.token, clamp(e.logprob), std::move(top));
    }
  }
  for (const auto& e : d.logprobs) {
    json top = json::object();
    for (const auto& [id, lp] : e.top) top[text_of(id)] = clamp(lp);
    top[text_of(e.token)] = clamp(e.logprob);
    push(e.token, clamp(e.logprob), std::move(top));
  }
  return out;
}

json ResponseBuilder::prompt_logprobs_json(const std::vector<TokenLogprobs>& entries) const {
  json out = json::array({nullptr});
  for (const auto& e : entries) {
    json position = json::object();
    for (size_t k = 0; k < e.top.size() && static_cast<int32_t>(k) < *request_.prompt_logprobs; ++k)
      position[std::to_string(e.top[k].first)] = {{"logprob", std::max(e.top[k].second, -9999.0f)},
                                                  {"rank", k + 1},
                                                  {"decoded_token", tokenizer_->token_bytes(e.top[k].first)}};
    position[std::to_string(e.token)] = {{"logprob", std::max(e.logprob, -9999.0f)},
                                         {"rank", e.rank},
                                         {"decoded_token", tokenizer_->token_bytes(e.token)}};
    out.push_back(std::move(position));
  }
  return out;
}

std::vector<json> ResponseBuilder::opening_chunks() const {
  std::vector<json> out;
  for (int i = 0; i < static_cast<int>(choices_.size()); ++i) {
    if (request_.chat) {
      json c = base("chat.completion.chunk");
      c["choices"] = json::array({{{"index", i},
                                   {"delta", {{"role", "assistant"}, {"content", ""}}},
                                   {"logprobs", nullptr},
                                   {"finish_reason", nullptr}}});
      out.push_back(std::move(c));
    } else if (request_.echo && !echo_logprobs()) {  // with logprobs, the prompt goes with its logprobs
      json c = base("text_completion");
      c["choices"] =
          json::array({{{"index", i}, {"text", echo_text(i)}, {"logprobs", nullptr}, {"finish_reason", nullptr}}});
      out.push_back(std::move(c));
    }
  }
  if (request_.include_usage)
    for (auto& c : out) c["usage"] = nullptr;
  return out;
}

json ResponseBuilder::chunk(const ChoiceDelta& d) {
  ChoiceState& c = choices_[d.index];
  json lp = request_.logprobs ? logprobs_json(d, c) : json(nullptr);
  json finish = d.finish_reason.empty() ? json(nullptr) : json(d.finish_reason);
  std::string text = d.text;
  if (echo_logprobs() && !c.echoed) text = echo_text(d.index) + text;
  c.echoed = true;
  json out;
  if (request_.chat) {
    out = base("chat.completion.chunk");
    json delta = json::object();
    if (!d.text.empty()) delta["content"] = d.text;
    out["choices"] = json::array({{{"index", d.index}, {"delta", delta}, {"logprobs", lp}, {"finish_reason", finish}}});
  } else {
    out = base("text_completion");
    out["choices"] = json::array({{{"index", d.index}, {"text", text}, {"logprobs", lp}, {"finish_reason", finish}}});
  }
  if (!tokenizer_) out["choices"][0]["token_ids"] = d.token_ids;
  if (request_.include_usage) out["usage"] = nullptr;
  return out;
}

json ResponseBuilder::usage_chunk(int64_t prompt_tokens, int64_t completion_tokens) const {
  json out = base(request_.chat ? "chat.completion.chunk" : "text_completion");
  out["choices"] = json::array();
  out["usage"] = usage_json(prompt_tokens, completion_tokens);
  return out;
}

void ResponseBuilder::add(const ChoiceDelta& d) {
  ChoiceState& c = choices_[d.index];
  if (c.parser) {
    std::string finish_reason;
    MessageDelta m = parse(c, d, finish_reason);
    c.reasoning += m.reasoning;
    c.text += m.content;
    for (auto& t : m.tool_calls) {
      if (!t.name.empty())
        c.tool_calls.push_back(
            {{"id", t.id}, {"type", "function"}, {"function", {{"name", t.name}, {"arguments", ""}}}});
      else
        c.tool_calls[t.index]["function"]["arguments"].get_ref<std::string&>() += t.arguments;
    }
    if (!finish_reason.empty()) c.finish_reason = finish_reason;
  } else {
    c.text += d.text;
  }
  c.token_ids.insert(c.token_ids.end(), d.token_ids.begin(), d.token_ids.end());
  if (!d.finish_reason.empty() && !c.parser) c.finish_reason = d.finish_reason;
  if (request_.prompt_logprobs && c.prompt_logprobs.is_null())
    c.prompt_logprobs = prompt_logprobs_json(d.prompt_logprobs);
  if (!request_.logprobs) return;
  json lp = logprobs_json(d, c);
  c.echoed = true;
  for (auto& [key, values] : lp.items())
    for (auto& v : values) c.logprobs[key].push_back(std::move(v));
}

// A parsed chat message: content null when empty (as vLLM's parsers give
// it), reasoning with the reasoning parser, tool_calls when there are any.
json ResponseBuilder::parsed_message(const ChoiceState& c) const {
  json message = {{"role", "assistant"}, {"content", c.text.empty() ? json(nullptr) : json(c.text)}};
  if (request_.parsing.reasoning) {
    message["reasoning_content"] = c.reasoning.empty() ? json(nullptr) : json(c.reasoning);
    message["reasoning"] = message["reasoning_content"];
  }
  if (!c.tool_calls.empty()) message["tool_calls"] = c.tool_calls;
  return message;
}

json ResponseBuilder::whole(int64_t prompt_tokens, int64_t completion_tokens) const {
  json out = base(request_.chat ? "chat.completion" : "text_completion");
  json choices = json::array();
  for (int i = 0; i < static_cast<int>(choices_.size()); ++i) {
    const ChoiceState& c = choices_[i];
    json choice = {{"index", i}};
    if (request_.chat && c.parser)
      choice["message"] = parsed_message(c);
    else if (request_.chat)
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
    else
      choice["text"] = c.text;
    if (!tokenizer_) choice["token_ids"] = c.token_ids;
    choice["logprobs"] = request_.logprobs ? c.logprobs : json(nullptr);
    if (request_.prompt_logprobs) choice["prompt_logprobs"] = c.prompt_logprobs;
    choice["finish_reason"] = c.finish_reason;
    choices.push_back(std::move(choice));
  }
  out["choices"] = std::move(choices);
  out["usage"] = usage_json(prompt_tokens, completion_tokens);
  return out;
}

}  // namespace nucleus::server
