// Jinja2 chat templates: the real DeepSeek and Kimi templates on whole
// conversations, each language construct on its own, whitespace control and
// errors. Expected strings are what transformers' apply_chat_template
// (Jinja2 3.1, trim_blocks + lstrip_blocks) produces for the same input.
#include "io/chat_template.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "test_util.h"

namespace nucleus {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

// Real templates, quoted from the models' tokenizer_config.json /
// chat_template.jinja (configuration data).

// deepseek-ai/DeepSeek-V3.
const char* const kDeepSeekV3 =
    R"TPL({% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %})TPL";

// deepseek-ai/DeepSeek-R1.
const char* const kDeepSeekR1 =
    R"TPL({% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}{%- if message['content'] is none %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- set ns.is_first = true -%}{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\n'}}{% endif %})TPL";

// deepseek-ai/DeepSeek-V3.1 (chat_template.jinja).
const char* const kDeepSeekV31 = R"TPL({% if not add_generation_prompt is defined -%}
  {%- set add_generation_prompt = false -%}
{%- endif -%}
{%- if not thinking is defined -%}
  {%- if enable_thinking is defined -%}
    {%- set thinking = enable_thinking -%}
    {%- else -%}
    {%- set thinking = false -%}
  {%- endif -%}
{%- endif -%}
{%- set ns = namespace(is_first=false, is_tool=false, system_prompt='', is_first_sp=true, is_last_user=false) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}
    {%- if ns.is_first_sp -%}
      {%- set ns.system_prompt = ns.system_prompt + message['content'] -%}
      {%- set ns.is_first_sp = false -%}
      {%- else -%}
      {%- set ns.system_prompt = ns.system_prompt + '

' + message['content'] -%}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}{{ bos_token }}{{ ns.system_prompt }}
{%- for message in messages -%}
  {%- if message['role'] == 'user' -%}
    {%- set ns.is_tool = false -%}
    {%- set ns.is_first = false -%}
    {%- set ns.is_last_user = true -%}{{'<｜User｜>' + message['content']}}
  {%- endif -%}
  {%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] is not none -%}
    {%- if ns.is_last_user -%}{{'<｜Assistant｜></think>'}}
    {%- endif -%}
    {%- set ns.is_last_user = false -%}
    {%- set ns.is_first = false -%}
    {%- set ns.is_tool = false -%}
    {%- for tool in message['tool_calls'] -%}
      {%- if not ns.is_first -%}
        {%- if message['content'] is none -%}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
          {%- else -%}{{message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
        {%- endif -%}
        {%- set ns.is_first = true -%}
        {%- else -%}{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
      {%- endif -%}
    {%- endfor -%}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}
  {%- endif -%}
  {%- if message['role'] == 'assistant' and (message['tool_calls'] is not defined or message['tool_calls'] is none) -%}
    {%- if ns.is_last_user -%}{{'<｜Assistant｜>'}}
      {%- if message['prefix'] is defined and message['prefix'] and thinking -%}{{'<think>'}}
        {%- else -%}{{'</think>'}}
      {%- endif -%}
    {%- endif -%}
    {%- set ns.is_last_user = false -%}
    {%- if ns.is_tool -%}{{message['content'] + '<｜end▁of▁sentence｜>'}}
      {%- set ns.is_tool = false -%}
      {%- else -%}
      {%- set content = message['content'] -%}
      {%- if '</think>' in content -%}
        {%- set content = content.split('</think>', 1)[1] -%}
      {%- endif -%}{{content + '<｜end▁of▁sentence｜>'}}
    {%- endif -%}
  {%- endif -%}
  {%- if message['role'] == 'tool' -%}
    {%- set ns.is_last_user = false -%}
    {%- set ns.is_tool = true -%}{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.is_last_user and not ns.is_tool -%}{{'<｜Assistant｜>'}}
  {%- if not thinking -%}{{'</think>'}}
    {%- else -%}{{'<think>'}}
  {%- endif -%}
{%- endif %})TPL";

// moonshotai/Kimi-K2-Instruct-0905 (chat_template.jinja).
const char* const kKimiK2 = R"TPL({%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>
  # Tools
  {{ tools | tojson }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
  {%- if loop.first and messages[0]['role'] != 'system' -%}
    <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
  {%- endif -%}

  {%- set role_name =  message.get('name') or  message['role'] -%}
  {%- if message['role'] == 'user' -%}
    <|im_user|>{{role_name}}<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}
    <|im_assistant|>{{role_name}}<|im_middle|>
  {%- else -%}
    <|im_system|>{{role_name}}<|im_middle|>
  {% endif %}

  {%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
    {%- if message['content'] -%}{{ message['content'] }}{%- endif -%}
    <|tool_calls_section_begin|>
    {%- for tool_call in message['tool_calls'] -%}
      {%- set formatted_id = tool_call['id'] -%}
      <|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{% if tool_call['function']['arguments'] is string %}{{ tool_call['function']['arguments'] }}{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>
    {%- endfor -%}
    <|tool_calls_section_end|>
  {%- elif message['role'] == 'tool' -%}
    ## Return of {{ message.tool_call_id }}
    {{ message['content'] }}
  {%- elif message['content'] is string -%}
    {{ message['content'] }}
  {%- elif message['content'] is not none -%}
    {% for content in message['content'] -%}
      {% if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}
        <|media_start|>image<|media_content|><|media_pad|><|media_end|>
      {% else -%}
        {{ content['text'] }}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
{%- endif -%})TPL";

// moonshotai/Kimi-K2-Thinking (chat_template.jinja): macros, range(),
// {% break %}, slices with computed bounds.
const char* const kKimiK2Thinking = R"TPL({%- macro render_content(msg) -%}
    {%- set c = msg.get('content') -%}
    {%- if c is string -%}
      {{ c }}
    {%- elif c is not none -%}
      {% for content in c -%}
        {% if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}
          <|media_start|>image<|media_content|><|media_pad|><|media_end|>
        {% else -%}
          {{ content['text'] }}
        {%- endif -%}
      {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}

{% macro set_roles(message) -%}
  {%- set role_name =  message.get('name') or  message['role'] -%}
  {%- if message['role'] == 'user' -%}
    <|im_user|>{{role_name}}<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}
    <|im_assistant|>{{role_name}}<|im_middle|>
  {%- else -%}
    <|im_system|>{{role_name}}<|im_middle|>
  {%- endif -%}
{%- endmacro -%}


{%- macro render_toolcalls(message) -%}
  <|tool_calls_section_begin|>
  {%- for tool_call in message['tool_calls'] -%}
    {%- set formatted_id = tool_call['id'] -%}
    <|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{% if tool_call['function']['arguments'] is string %}{{ tool_call['function']['arguments'] }}{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>
  {%- endfor -%}
  <|tool_calls_section_end|>
{%- endmacro -%}


{# Find last non-tool-call assisitant message #}
{%- set ns = namespace(last_non_tool_call_assistant_msg=-1) -%}
{%- for idx in range(messages|length-1, -1, -1) -%}
    {%- if messages[idx]['role'] == 'assistant' and not messages[idx].get('tool_calls') -%}
        {%- set ns.last_non_tool_call_assistant_msg = idx -%}
        {%- break -%}
    {%- endif -%}
{%- endfor -%}

{# split all messages into history & suffix, reasoning_content in suffix should be reserved.#}
{%- set hist_msgs = messages[:ns.last_non_tool_call_assistant_msg+1] -%}
{%- set suffix_msgs = messages[ns.last_non_tool_call_assistant_msg+1:] -%}

{%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>{{ tools | tojson() }}<|im_end|>
{%- endif -%}

{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}
  <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
  
{%- for message in hist_msgs -%}
  {{set_roles(message)}}
  {%- if message['role'] == 'assistant' -%}
    <think></think>{{render_content(message)}}
    {%- if message.get('tool_calls') -%}
      {{render_toolcalls(message)}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set tool_call_id = message.tool_call_id -%}
    ## Return of {{ tool_call_id }}
{{render_content(message)}}
  {%- elif message['content'] is not none -%}
    {{render_content(message)}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}

{%- for message in suffix_msgs -%}
  {{set_roles(message)}}
  {%- if message['role'] == 'assistant' -%}
    {%- set rc = message.get('reasoning_content', '') -%}
    <think>{{rc}}</think>{{render_content(message)}}
    {%- if message.get('tool_calls') -%}
     {{render_toolcalls(message)}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set tool_call_id = message.tool_call_id -%}
    ## Return of {{ tool_call_id }}
{{render_content(message)}}
  {%- elif message['content'] is not none -%}
    {{render_content(message)}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}


{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
{%- endif -%}
)TPL";

const char* const kBos = "<｜begin▁of▁sentence｜>";
const char* const kEos = "<｜end▁of▁sentence｜>";

ChatTemplate parse_ok(const std::string& source) {
  auto t = ChatTemplate::parse(source);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  if (!t.ok()) std::abort();
  return std::move(t).value();
}

// Parses and renders `source`; the error's message on failure.
template <typename Json = json>
std::string render(const std::string& source, const Json& context = Json::object()) {
  auto t = ChatTemplate::parse(source);
  if (!t.ok()) return "PARSE ERROR: " + t.status().message();
  auto r = t->render(context);
  if (!r.ok()) return "RENDER ERROR: " + r.status().message();
  return *r;
}

// system + user + assistant + user.
json conversation() {
  return json::array({{{"role", "system"}, {"content", "You are a helpful assistant."}},
                      {{"role", "user"}, {"content", "Hi!"}},
                      {{"role", "assistant"}, {"content", "Hello! How can I help?"}},
                      {{"role", "user"}, {"content", "What is 2+2?"}}});
}

json deepseek_context(json messages, std::optional<bool> add_generation_prompt) {
  json c = {{"messages", std::move(messages)}, {"bos_token", kBos}, {"eos_token", kEos}};
  if (add_generation_prompt) c["add_generation_prompt"] = *add_generation_prompt;
  return c;
}

// ---- Real templates --------------------------------------------------------------

TEST(ChatTemplateTest, TinyModelTemplateFromTokenizerConfig) {
  std::ifstream in(testing::model_path("tiny-dsv3/tokenizer_config.json"));
  json config = json::parse(in);
  ChatTemplate t = parse_ok(config["chat_template"].get<std::string>());
  json messages = json::array({{{"role", "system"}, {"content", "Be terse."}}, {{"role", "user"}, {"content", "Hi"}}});
  auto with_prompt = t.render({{"messages", messages}, {"add_generation_prompt", true}});
  ASSERT_TRUE(with_prompt.ok()) << with_prompt.status().to_string();
  EXPECT_EQ(*with_prompt, "<|system|>Be terse.\n<|user|>Hi\n<|assistant|>");
  auto without = t.render({{"messages", messages}, {"add_generation_prompt", false}});
  ASSERT_TRUE(without.ok());
  EXPECT_EQ(*without, "<|system|>Be terse.\n<|user|>Hi\n");
}

TEST(ChatTemplateTest, DeepSeekV3Conversation) {
  ChatTemplate t = parse_ok(kDeepSeekV3);
  const std::string history =
      "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hi!<｜Assistant｜>Hello! How can I "
      "help?<｜end▁of▁sentence｜><｜User｜>What is 2+2?";
  auto on = t.render(deepseek_context(conversation(), true));
  ASSERT_TRUE(on.ok()) << on.status().to_string();
  EXPECT_EQ(*on, history + "<｜Assistant｜>");
  auto off = t.render(deepseek_context(conversation(), false));
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(*off, history);
  // Not given: the template's `is defined` check sets it false.
  auto unset = t.render(deepseek_context(conversation(), std::nullopt));
  ASSERT_TRUE(unset.ok());
  EXPECT_EQ(*unset, history);
}

TEST(ChatTemplateTest, DeepSeekV3ToolCallsAndOutputs) {
  ChatTemplate t = parse_ok(kDeepSeekV3);
  json call = [](const char* city) {
    return json{{"type", "function"},
                {"function", {{"name", "get_weather"}, {"arguments", std::string("{\"city\": \"") + city + "\"}"}}}};
  }("Paris");
  json call2 = call;
  call2["function"]["arguments"] = "{\"city\": \"Rome\"}";
  json messages = json::array({{{"role", "user"}, {"content", "Weather in Paris and Rome?"}},
                               {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", {call, call2}}},
                               {{"role", "tool"}, {"content", "22C"}},
                               {{"role", "tool"}, {"content", "25C"}},
                               {{"role", "assistant"}, {"content", "Paris 22C, Rome 25C."}}});
  auto r = t.render(deepseek_context(messages, true));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r,
            "<｜begin▁of▁sentence｜><｜User｜>Weather in Paris and Rome?<｜Assistant｜><｜tool▁calls▁begin｜>"
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```"
            "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": "
            "\"Rome\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜>"
            "<｜tool▁output▁begin｜>22C<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>25C<｜tool▁output▁end｜>"
            "<｜tool▁outputs▁end｜>Paris 22C, Rome 25C.<｜end▁of▁sentence｜><｜Assistant｜>");
}

TEST(ChatTemplateTest, DeepSeekR1DropsThinkingFromHistory) {
  json messages = json::array({{{"role", "user"}, {"content", "2+2?"}},
                               {{"role", "assistant"}, {"content", "<think>Easy.</think>4"}},
                               {{"role", "user"}, {"content", "3+3?"}}});
  EXPECT_EQ(render(kDeepSeekR1, deepseek_context(messages, true)),
            "<｜begin▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜>4<｜end▁of▁sentence｜><｜User｜>3+3?"
            "<｜Assistant｜><think>\n");
}

TEST(ChatTemplateTest, DeepSeekV31ThinkingSwitch) {
  const std::string history =
      "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hi!<｜Assistant｜></think>Hello! How can I "
      "help?<｜end▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>";
  json c = deepseek_context(conversation(), true);
  EXPECT_EQ(render(kDeepSeekV31, c), history + "</think>");
  c["thinking"] = true;
  EXPECT_EQ(render(kDeepSeekV31, c), history + "<think>");
}

TEST(ChatTemplateTest, KimiK2ToolsNamesToolCallsAndImages) {
  // ordered_json keeps the tools' keys in request order, as Python does.
  ordered_json c = ordered_json::parse(R"JSON({
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
    "messages": [
      {"role": "user", "content": "Weather in Paris?", "name": "alice"},
      {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "22C"},
      {"role": "assistant", "content": "It is 22C."},
      {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                   {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
    "add_generation_prompt": true})JSON");
  EXPECT_EQ(render(kKimiK2, c),
            "<|im_system|>tool_declare<|im_middle|>\n  # Tools\n  [{\"type\": \"function\", \"function\": {\"name\": "
            "\"get_weather\", \"description\": \"Weather of a city\", \"parameters\": {\"type\": \"object\", "
            "\"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}]<|im_end|>"
            "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
            "<|im_user|>alice<|im_middle|>Weather in Paris?<|im_end|><|im_assistant|>assistant<|im_middle|>"
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            "{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|><|im_system|>tool<|im_middle|>"
            "\n## Return of functions.get_weather:0\n    22C<|im_end|><|im_assistant|>assistant<|im_middle|>It is "
            "22C.<|im_end|><|im_user|>user<|im_middle|>And this?<|media_start|>image<|media_content|><|media_pad|>"
            "<|media_end|>\n<|im_end|><|im_assistant|>assistant<|im_middle|>");
  // A system message replaces the default one; no generation prompt.
  json plain = {{"messages", json::array({conversation()[0], conversation()[1]})}, {"add_generation_prompt", false}};
  EXPECT_EQ(render(kKimiK2, plain),
            "<|im_system|>system<|im_middle|>\nYou are a helpful assistant.<|im_end|><|im_user|>user<|im_middle|>"
            "Hi!<|im_end|>");
}

TEST(ChatTemplateTest, KimiK2ThinkingMacrosAndReasoning) {
  json messages = json::parse(R"JSON([
      {"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "4", "reasoning_content": "simple"},
      {"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": "", "reasoning_content": "need tool", "tool_calls": [{"id":
        "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments":
        "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "22C"}])JSON");
  // History before the last plain assistant reply loses its reasoning; the
  // suffix keeps it.
  EXPECT_EQ(render(kKimiK2Thinking, json{{"messages", messages}, {"add_generation_prompt", true}}),
            "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
            "<|im_user|>user<|im_middle|>2+2?<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>4"
            "<|im_end|><|im_user|>user<|im_middle|>Weather?<|im_end|><|im_assistant|>assistant<|im_middle|>"
            "<think>need tool</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
            "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n22C<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>");
}

// ---- Language constructs ---------------------------------------------------------

TEST(ChatTemplateTest, Loops) {
  json c = {{"xs", {"a", "b", "c"}}};
  EXPECT_EQ(render("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ x }}{{ loop.length }}"
                   "{% if loop.first %}F{% endif %}{% if loop.last %}L{% endif %} {% endfor %}",
                   c),
            "10a3F 21b3 32c3L ");
  EXPECT_EQ(render("{% for x in xs %}{{ loop.revindex }}{{ loop.previtem }}{{ loop.cycle('+', '-') }}{% endfor %}", c),
            "3+2a-1b+");
  EXPECT_EQ(render("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for x in xs if x != 'b' %}{{ x }}{{ loop.index }}/{{ loop.length }} {% endfor %}", c),
            "a1/2 c2/2 ");
  EXPECT_EQ(render("{% for x in xs %}{% if x == 'a' %}{% continue %}{% endif %}{{ x }}{% if x == 'b' %}"
                   "{% break %}{% endif %}{% endfor %}",
                   c),
            "b");
  EXPECT_EQ(render("{% for a in [1, 2] %}{% for b in [3, 4] %}{{ a }}{{ b }}.{{ loop.index }} {% endfor %}"
                   "{{ loop.index }}|{% endfor %}"),
            "13.1 14.2 1|23.1 24.2 2|");
  // Dicts iterate keys (items() for pairs), strings characters.
  EXPECT_EQ(render("{% for k, v in {'b': 1, 'a': 2}.items() %}{{ k }}={{ v }};{% endfor %}"
                   "{% for ch in '世界' %}[{{ ch }}]{% endfor %}"),
            "b=1;a=2;[世][界]");
  EXPECT_EQ(render("{% for i in range(5, 0, -2) %}{{ i }}{% endfor %}{{ range(3) | list }}"), "531[0, 1, 2]");
  // What the body sets stays in the iteration (Jinja2 scoping).
  EXPECT_EQ(render("{% set x = 0 %}{% for i in [1, 2] %}{% set x = x + i %}{{ x }}{% endfor %}{{ x }}"), "120");
}

TEST(ChatTemplateTest, Conditionals) {
  json c = {{"n", nullptr}, {"t", true}, {"s", "text"}, {"e", ""}};
  EXPECT_EQ(render("{% if n is none %}A{% elif t %}B{% else %}C{% endif %}"
                   "{% if not n and t %}D{% endif %}{% if missing %}E{% elif missing is not defined %}F{% endif %}",
                   c),
            "ADF");
  EXPECT_EQ(render("{{ 'yes' if t else 'no' }} {{ 'yes' if n else 'no' }} [{{ 'x' if n }}]", c), "yes no []");
  // and / or give the deciding operand, as in Python.
  EXPECT_EQ(render("{{ n or 'fallback' }} {{ s and 'both' }} {{ e or none }} {{ 0 or '' }}|", c),
            "fallback both None |");
  EXPECT_EQ(render("{{ 1 < 2 < 3 }} {{ 3 < 2 < 4 }} {{ 1 == 1.0 }} {{ true == 1 }} {{ [1, 2] < [1, 3] }}"),
            "True False True True True");
  EXPECT_EQ(render("{{ 'ex' in s }} {{ 'z' not in s }} {{ 2 in [1, 2] }} {{ 't' in {'t': 1} }}", c),
            "True True True True");
  EXPECT_EQ(render("{{ s is string }} {{ 3 is number }} {{ 3 is odd }} {{ 9 is divisibleby 3 }} "
                   "{{ {} is mapping }} {{ t is boolean }} {{ n is not none }} {{ s is eq 'text' }}",
                   c),
            "True True True True True True False True");
}

TEST(ChatTemplateTest, NamespaceSurvivesLoops) {
  EXPECT_EQ(render("{% set ns = namespace(total=0, seen='') %}{% for x in [1, 2, 3] %}{% set ns.total = ns.total + x %}"
                   "{% set ns.seen = ns.seen ~ x %}{% endfor %}{{ ns.total }} {{ ns.seen }} [{{ ns.missing }}]"),
            "6 123 []");
  EXPECT_EQ(render("{% set ns = namespace({'a': 1}) %}{{ ns.a }}"), "1");
  EXPECT_EQ(render("{% set x = 1 %}{% set x.a = 2 %}"),
            "RENDER ERROR: chat template line 1, column 19: cannot assign attribute 'a' of 'x': it is not a "
            "namespace()");
}

TEST(ChatTemplateTest, StringsAndConcatenation) {
  json c = {{"m", {{"role", "user"}, {"content", "Hi"}}}};
  EXPECT_EQ(render("{{ '<|' + m['role'] + '|>' + m.content + '\\n' }}", c), "<|user|>Hi\n");
  EXPECT_EQ(render("{{ 'n=' ~ 3 ~ none ~ true ~ missing ~ 1.5 }}"), "n=3NoneTrue1.5");
  EXPECT_EQ(render(R"({{ 'tab\tq\'\\ \x41\u4e16\U0001F600 "dq"' }} {{ "it's" }} {{ 'a' 'b' }})"),
            "tab\tq'\\ A世😀 \"dq\" it's ab");
  EXPECT_EQ(render("{{ 'ab' * 3 }} {{ [1] + [2] }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 8 }}"),
            "ababab [1, 2] 3 -4 2 3.5 256");
  // Python's str(): None, True, float repr, list / dict repr.
  EXPECT_EQ(render("{{ none }} {{ True }} {{ 1.0 }} {{ 1e16 }} {{ 0.1 + 0.2 }} {{ ['a', 1, none] }} {{ {'k': 'v'} }}"),
            "None True 1.0 1e+16 0.30000000000000004 ['a', 1, None] {'k': 'v'}");
}

TEST(ChatTemplateTest, IndexingAndSlicing) {
  json c = {{"xs", {1, 2, 3, 4}}, {"s", "héllo"}, {"m", {{"role", "user"}}}};
  EXPECT_EQ(render("{{ xs[0] }}{{ xs[-1] }} {{ xs[1:] }} {{ xs[:-2] }} {{ xs[::-1] }} {{ xs[::2] }} [{{ xs[9] }}]", c),
            "14 [2, 3, 4] [1, 2] [4, 3, 2, 1] [1, 3] []");
  EXPECT_EQ(render("{{ s[1] }} {{ s[1:3] }} {{ s[::-1] }} {{ s | length }}", c), "é él olléh 5");
  EXPECT_EQ(render("{{ m.role }} {{ m['role'] }} [{{ m.content }}] [{{ m.content.text }}] {{ m.content is defined }}",
                   c),
            "user user [] [] False");
}

TEST(ChatTemplateTest, Filters) {
  json c = {{"s", "  Hello World  "}, {"xs", {3, 1, 2}}, {"d", {{"b", 1}, {"a", "é"}}}};
  EXPECT_EQ(render("[{{ s | trim }}] {{ s | trim | lower }} {{ s | upper | trim }} {{ s | length }} {{ xs | length }}",
                   c),
            "[Hello World] hello world HELLO WORLD 15 3");
  EXPECT_EQ(render("{{ xs | join(', ') }} {{ xs | first }} {{ xs | last }} {{ xs | sort | list }} "
                   "{{ s | replace('o', '0') | trim }} {{ 5 | string }}{{ none | string }}",
                   c),
            "3, 1, 2 3 2 [1, 2, 3] Hell0 W0rld 5None");
  EXPECT_EQ(render("{{ missing | default('dflt') }} {{ '' | default('dflt') }}|{{ '' | default('dflt', true) }}"),
            "dflt |dflt");
  EXPECT_EQ(render("{% for k, v in d | items %}{{ k }}={{ v }} {% endfor %}", c), "a=é b=1 ");
  // tojson is Python's json.dumps: ", " and ": ", no ASCII escaping.
  EXPECT_EQ(render("{{ d | tojson }} {{ xs | tojson }} {{ 'q\"\\n' | tojson }} {{ none | tojson }}", c),
            "{\"a\": \"é\", \"b\": 1} [3, 1, 2] \"q\\\"\\n\" null");
  EXPECT_EQ(render("{{ d | tojson(indent=2) }}|{{ d | tojson(separators=(',', ':'), ensure_ascii=true) }}", c),
            "{\n  \"a\": \"é\",\n  \"b\": 1\n}|{\"a\":\"\\u00e9\",\"b\":1}");
  json msgs = {{"msgs", json::parse(R"([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])")}};
  EXPECT_EQ(render("{{ msgs | selectattr('role', 'equalto', 'user') | map(attribute='content') | join }} "
                   "{{ msgs | rejectattr('role', '==', 'user') | list | length }} {{ msgs | map(attribute='role') "
                   "| map('upper') | join('+') }}",
                   msgs),
            "U 1 SYSTEM+USER");
}

TEST(ChatTemplateTest, Methods) {
  json c = {{"s", "a<think>b</think>c"}, {"d", {{"k", "v"}}}};
  EXPECT_EQ(render("{{ s.split('</think>')[-1] }} {{ s.split('</think>', 1)[0] }} {{ 'a b  c'.split() }} "
                   "{{ s.startswith('a<') }} {{ s.endswith(('x', 'c')) }}",
                   c),
            "c a<think>b ['a', 'b', 'c'] True True");
  EXPECT_EQ(render("[{{ '  x  '.strip() }}] [{{ 'xxaxx'.strip('x') }}] [{{ '  x'.lstrip() }}] {{ 'Ab'.lower() }} "
                   "{{ 'Ab'.upper() }} {{ 'aXa'.replace('a', 'b') }} {{ '-'.join(['p', 'q']) }}"),
            "[x] [a] [x] ab AB bXb p-q");
  EXPECT_EQ(render("{{ d.get('k') }} {{ d.get('z') }} {{ d.get('z', 'dflt') }} {{ d.keys() | list }} "
                   "{% for k, v in d.items() %}{{ k }}={{ v }}{% endfor %}",
                   c),
            "v None dflt ['k'] k=v");
}

TEST(ChatTemplateTest, Macros) {
  EXPECT_EQ(render("{% macro greet(name, greeting='Hello') %}{{ greeting }}, {{ name }}!{% endmacro %}"
                   "{{ greet('Bob') }} {{ greet('Al', 'Hi') }} {{ greet(greeting='Yo', name='Z') }}"),
            "Hello, Bob! Hi, Al! Yo, Z!");
  // A macro sees the template's top-level variables at call time, not the
  // caller's loop variables.
  EXPECT_EQ(render("{% set g = 'G' %}{% macro m() %}{{ g }}{{ i }}{% endmacro %}{% for i in [1] %}{{ m() }}{% endfor %}"
                   "{% set g = 'H' %}{{ m() }}"),
            "GH");
  EXPECT_EQ(render("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}"),
            "RENDER ERROR: chat template line 1, column 20: macro calls nested too deeply (recursion?)");
}

TEST(ChatTemplateTest, UndefinedValues) {
  json c = {{"m", {{"role", "user"}}}};
  EXPECT_EQ(render("[{{ missing }}][{{ missing.attr.deeper }}][{{ m.nope }}][{{ missing | length }}]"
                   "{{ missing is defined }}{{ m.nope is undefined }}{% for x in missing %}x{% endfor %}",
                   c),
            "[][][][0]FalseTrue");
  EXPECT_EQ(render("{{ missing + 1 }}"), "RENDER ERROR: chat template line 1, column 12: 'missing' is undefined");
  EXPECT_EQ(render("{{ missing() }}"), "RENDER ERROR: chat template line 1, column 11: 'missing' is undefined");
}

TEST(ChatTemplateTest, WhitespaceControl) {
  // {%- / -%} and {{- / -}} strip all whitespace on their side.
  EXPECT_EQ(render("a  {%- if true -%}  b  {%- endif -%}  c {{- ' d ' -}} e"), "abc d e");
  // trim_blocks: the newline after a block tag goes; lstrip_blocks: so do
  // the blanks before a tag alone on its line. Not for {{ }}.
  EXPECT_EQ(render("<\n  {% if true %}\n  x\n  {% endif %}\n  {{ 'y' }}\n>"), "<\n  x\n  y\n>");
  EXPECT_EQ(render("{% for i in [1, 2] %}\n  {{ i }}\n{% endfor %}\nend"), "  1\n  2\nend");
  // {%+ keeps the blanks before, +%} the newline after.
  EXPECT_EQ(render("  {%+ if true +%}\nx{% endif %}"), "  \nx");
  // Comments vanish, with the same rules.
  EXPECT_EQ(render("a{# note #}b\n  {# alone #}\nc {#- trim -#} d"), "ab\ncd");
  // One trailing newline of the template is dropped; \r\n becomes \n.
  EXPECT_EQ(render("x\r\ny\n"), "x\ny");
  EXPECT_EQ(render("{% raw %}{{ kept }}{% endraw %}"), "{{ kept }}");
}

// ---- Errors ------------------------------------------------------------------------

TEST(ChatTemplateTest, ParseErrorsNameLineAndColumn) {
  struct Case {
    const char* source;
    const char* message;
  };
  const Case cases[] = {
      {"line one\n{% if x %}\nno end",
       "chat template line 3, column 7: unexpected end of template: the {% if %} at line 2, column 4 needs "
       "{% endif %}"},
      {"{{ 1 + }}", "chat template line 1, column 8: expected an expression, got '}}'"},
      {"{% for x in xs %}{% endif %}",
       "chat template line 1, column 21: unexpected tag 'endif': the {% for %} at line 1, column 4 needs "
       "{% endfor %}"},
      {"{{ x | nosuch }}", "chat template line 1, column 8: no filter named 'nosuch'"},
      {"{{ x is nosuch }}", "chat template line 1, column 9: no test named 'nosuch'"},
      {"{% include 'other.jinja' %}", "chat template line 1, column 4: the {% include %} tag is not supported"},
      {"{{ 'open }}", "chat template line 1, column 4: unterminated string literal"},
      {"{{ (1 }}", "chat template line 1, column 7: unexpected '}': the '(' at line 1, column 4 is not closed"},
      {"{# no end", "chat template line 1, column 1: unterminated comment: missing '#}'"},
      {"{% break %}", "chat template line 1, column 4: 'break' outside of a for loop"},
  };
  for (const Case& c : cases) {
    auto t = ChatTemplate::parse(c.source);
    ASSERT_FALSE(t.ok()) << c.source;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(t.status().message(), c.message) << c.source;
  }
}

// Nesting is bounded (256 blocks and expressions), so a pathological template
// is a parse error naming the limit instead of a stack overflow at start-up:
// 5,000 nested parentheses and 10,000 nested ifs (both overflowed an 8 MB
// stack before), while 100 of each still parse and render.
TEST(ChatTemplateTest, DeepNestingIsAnErrorNotAStackOverflow) {
  auto parens = [](int n) { return "{{ " + std::string(n, '(') + "1" + std::string(n, ')') + " }}"; };
  auto ifs = [](int n) {
    std::string t;
    for (int i = 0; i < n; ++i) t += "{% if true %}";
    t += "x";
    for (int i = 0; i < n; ++i) t += "{% endif %}";
    return t;
  };
  for (const std::string& source : {parens(5000), ifs(10000)}) {
    auto t = ChatTemplate::parse(source);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find("nest deeper than 256"), std::string::npos) << t.status().message();
  }
  EXPECT_EQ(render(parens(100)), "1");
  EXPECT_EQ(render(ifs(100)), "x");
}

TEST(ChatTemplateTest, RaiseExceptionGivesTheTemplatesMessage) {
  // The pattern many templates use to refuse conversations.
  ChatTemplate t = parse_ok(
      "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
      "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
      "{% endif %}{{ m['content'] }}{% endfor %}");
  auto ok = t.render({{"messages", json::parse(R"([{"role": "user", "content": "a"}])")}});
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, "a");
  auto bad = t.render({{"messages", json::parse(R"([{"role": "assistant", "content": "a"}])")}});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "Conversation roles must alternate user/assistant/user/assistant/...");
}

TEST(ChatTemplateTest, RuntimeErrors) {
  EXPECT_EQ(render("{{ 'a' + 1 }}"),
            "RENDER ERROR: chat template line 1, column 8: unsupported operand type(s) for +: 'str' and 'int'");
  EXPECT_EQ(render("\n{{ 1 // 0 }}"), "RENDER ERROR: chat template line 2, column 6: integer division or modulo by zero");
  EXPECT_EQ(render("{% for x in 3 %}{% endfor %}"),
            "RENDER ERROR: chat template line 1, column 13: 'int' object is not iterable");
  EXPECT_EQ(render("{{ missing | tojson }}"),
            "RENDER ERROR: chat template line 1, column 14: Object of type Undefined is not JSON serializable");
  auto t = parse_ok("x");
  auto r = t.render(json::array());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "chat template context must be a JSON object");
}

TEST(ChatTemplateTest, KeyOrderOfJsonAndOrderedJson) {
  const char* source = "{{ d | tojson }} {% for k in d %}{{ k }}{% endfor %}";
  EXPECT_EQ(render(source, ordered_json::parse(R"({"d": {"z": 1, "a": 2}})")), "{\"z\": 1, \"a\": 2} za");
  EXPECT_EQ(render(source, json::parse(R"({"d": {"z": 1, "a": 2}})")), "{\"a\": 2, \"z\": 1} az");
}

TEST(ChatTemplateTest, RendersConcurrently) {
  ChatTemplate t = parse_ok(kDeepSeekV3);
  json c = deepseek_context(conversation(), true);
  std::vector<std::thread> threads;
  std::vector<std::string> out(8);
  for (size_t i = 0; i < out.size(); ++i)
    threads.emplace_back([&, i] {
      for (int k = 0; k < 50; ++k) out[i] = t.render(c).value();
    });
  for (auto& th : threads) th.join();
  for (const auto& o : out) EXPECT_EQ(o, out[0]);
}

}  // namespace
}  // namespace nucleus

namespace nucleus {
namespace {

// A template is code from the checkpoint run on every chat request: a
// runaway loop or a string doubled in a loop ends with an error, in bounded
// time and memory, never a hang or an exhausted server.
TEST(ChatTemplateTest, RunawayTemplatesStopWithAnError) {
  // A hang would show as ctest's timeout; no wall-clock bound here (the time
  // depends on the machine's load, and timing belongs in benchmarks).
  const std::string loop = render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}hi");
  EXPECT_NE(loop.find("RENDER ERROR"), std::string::npos) << loop;
  EXPECT_NE(loop.find("steps"), std::string::npos) << loop;
  const std::string doubling = render(
      "{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
      "{% endfor %}{{ ns.s|length }}");
  EXPECT_NE(doubling.find("string of more than"), std::string::npos) << doubling;
  const std::string plus = render(
      "{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
      "{% endfor %}{{ ns.s|length }}");
  EXPECT_NE(plus.find("string of more than"), std::string::npos) << plus;
  const std::string output = render("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}");
  EXPECT_NE(output.find("string of more than"), std::string::npos) << output.substr(0, 200);
  // Ordinary loops are far inside the budget.
  EXPECT_EQ(render("{% for i in range(1000) %}{% endfor %}{{ range(3)|list|length }}"), "3");
}

}  // namespace
}  // namespace nucleus
