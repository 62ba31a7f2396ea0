#include "server/responses.h"

#include <algorithm>

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
    choices_[i].text_offset = static_cast<int64_t>(choices_[i].text.size());
    if (request_.chat)
      choices_[i].logprobs = {{"content", json::array()}};
    else
      choices_[i].logprobs = {{"tokens", json::array()},
                              {"token_logprobs", json::array()},
                              {"top_logprobs", json::array()},
                              {"text_offset", json::array()}};
  }
}

std::string ResponseBuilder::echo_text(int index) const {
  if (!request_.echo) return "";
  return request_.prompts[index / request_.n].text;
}

json ResponseBuilder::base(const char* object) const {
  return {{"id", header_.id}, {"object", object}, {"created", header_.created}, {"model", header_.model}};
}

// Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
// with token strings as their decoded bytes and offsets in bytes of the
// choice's text. Chat: {"content": [{"token", "logprob", "bytes",
// "top_logprobs": [...]}]}. The sampled token is always among the
// completions' top_logprobs (as vLLM does). A token a grammar masked
// (structured output) has log-probability -inf, written as -9999.0 as vLLM
// does (JSON has no infinity).
json ResponseBuilder::logprobs_json(const std::vector<TokenLogprob>& entries, ChoiceState& c) const {
  auto finite = [](float lp) { return std::max(lp, -9999.0f); };
  auto bytes_of = [](const std::string& s) {
    json b = json::array();
    for (unsigned char ch : s) b.push_back(static_cast<int>(ch));
    return b;
  };
  if (request_.chat) {
    json content = json::array();
    for (const auto& e : entries) {
      const std::string t = tokenizer_->token_bytes(e.token);
      json top = json::array();
      for (const auto& [id, lp] : e.top) {
        const std::string s = tokenizer_->token_bytes(id);
        top.push_back({{"token", s}, {"logprob", finite(lp)}, {"bytes", bytes_of(s)}});
      }
      content.push_back({{"token", t}, {"logprob", finite(e.logprob)}, {"bytes", bytes_of(t)}, {"top_logprobs", top}});
    }
    return {{"content", content}};
  }
  json out = {{"tokens", json::array()},
              {"token_logprobs", json::array()},
              {"top_logprobs", json::array()},
              {"text_offset", json::array()}};
  for (const auto& e : entries) {
    const std::string t = tokenizer_->token_bytes(e.token);
    json top = json::object();
    for (const auto& [id, lp] : e.top) top[tokenizer_->token_bytes(id)] = finite(lp);
    top[t] = finite(e.logprob);
    out["tokens"].push_back(t);
    out["token_logprobs"].push_back(finite(e.logprob));
    out["top_logprobs"].push_back(top);
    out["text_offset"].push_back(c.text_offset);
    // A special token the text skips takes no room in it.
    if (!(request_.skip_special_tokens && tokenizer_->is_special(e.token))) c.text_offset += static_cast<int64_t>(t.size());
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
    } else if (request_.echo) {
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
  json lp = request_.logprobs ? logprobs_json(d.logprobs, c) : json(nullptr);
  json finish = d.finish_reason.empty() ? json(nullptr) : json(d.finish_reason);
  json out;
  if (request_.chat) {
    out = base("chat.completion.chunk");
    json delta = json::object();
    if (!d.text.empty()) delta["content"] = d.text;
    out["choices"] = json::array({{{"index", d.index}, {"delta", delta}, {"logprobs", lp}, {"finish_reason", finish}}});
  } else {
    out = base("text_completion");
    out["choices"] = json::array({{{"index", d.index}, {"text", d.text}, {"logprobs", lp}, {"finish_reason", finish}}});
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
  c.text += d.text;
  c.token_ids.insert(c.token_ids.end(), d.token_ids.begin(), d.token_ids.end());
  if (!d.finish_reason.empty()) c.finish_reason = d.finish_reason;
  if (!request_.logprobs) return;
  json lp = logprobs_json(d.logprobs, c);
  for (auto& [key, values] : lp.items())
    for (auto& v : values) c.logprobs[key].push_back(std::move(v));
}

json ResponseBuilder::whole(int64_t prompt_tokens, int64_t completion_tokens) const {
  json out = base(request_.chat ? "chat.completion" : "text_completion");
  json choices = json::array();
  for (int i = 0; i < static_cast<int>(choices_.size()); ++i) {
    const ChoiceState& c = choices_[i];
    json choice = {{"index", i}};
    if (request_.chat)
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
    else
      choice["text"] = c.text;
    if (!tokenizer_) choice["token_ids"] = c.token_ids;
    choice["logprobs"] = request_.logprobs ? c.logprobs : json(nullptr);
    choice["finish_reason"] = c.finish_reason;
    choices.push_back(std::move(choice));
  }
  out["choices"] = std::move(choices);
  out["usage"] = usage_json(prompt_tokens, completion_tokens);
  return out;
}

}  // namespace nucleus::server
