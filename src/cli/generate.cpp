// nucleus generate: offline batch generation. Prompts in (--prompt, or
// --prompts FILE.jsonl with {"prompt": "..."} or {"prompt_token_ids": [...]}
// per line), continuations out: text per prompt, or with --json one line per
// prompt in input order:
// {"prompt_token_ids": [...], "token_ids": [...], "text": "...", "finish_reason": "stop" | "length"}
// A prompt the engine refuses gets {"prompt_token_ids": [...], "error": "..."};
// the others still run; the exit status is then 1. Sampling flags (one set for
// all prompts) follow vLLM's parameters: --temperature, --top-k, --top-p,
// --min-p, --presence-penalty, --frequency-penalty, --repetition-penalty,
// --min-tokens, --logit-bias ID:BIAS, --seed, --ignore-eos.
#include <charconv>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/engine_args.h"
#include "core/logging.h"
#include "io/regular_file.h"

namespace nucleus::cli {

using nlohmann::json;

namespace {

struct PromptInput {
  std::string text;
  std::vector<int32_t> ids;
  bool has_ids = false;
};

StatusOr<std::vector<PromptInput>> read_prompts_file(const std::string& path) {
  // A regular file only (a FIFO or /dev/zero would be read forever).
  auto text = read_regular_file(path);
  if (!text.ok()) return Status(text.status().code(), "--prompts: " + text.status().message());
  std::istringstream in(std::move(*text));
  std::vector<PromptInput> out;
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j = json::parse(line, nullptr, false);
    const std::string where = path + ":" + std::to_string(line_no);
    if (j.is_discarded() || !j.is_object()) return invalid_argument(where + ": not a JSON object");
    PromptInput p;
    for (const auto& [key, value] : j.items())
      if (key != "prompt" && key != "prompt_token_ids")
        return invalid_argument(where + ": unknown key \"" + key +
                                "\" (a line holds \"prompt\" or \"prompt_token_ids\"; sampling comes from the flags)");
    if (j.contains("prompt") && j.contains("prompt_token_ids"))
      return invalid_argument(where + ": both \"prompt\" and \"prompt_token_ids\"; give one");
    if (j.contains("prompt_token_ids")) {
      if (!j["prompt_token_ids"].is_array()) return invalid_argument(where + ": prompt_token_ids must be a list");
      for (const auto& t : j["prompt_token_ids"]) {
        if (!t.is_number_integer() || (t.is_number_unsigned() && t.get<uint64_t>() > INT32_MAX) ||
            t.get<int64_t>() < INT32_MIN || t.get<int64_t>() > INT32_MAX)
          return invalid_argument(where + ": prompt_token_ids holds " + t.dump() + ", not a token id");
        p.ids.push_back(t.get<int32_t>());
      }
      p.has_ids = true;
    } else if (j.contains("prompt") && j["prompt"].is_string()) {
      p.text = j["prompt"].get<std::string>();
      if (p.text.empty()) return invalid_argument(where + ": \"prompt\" is empty");
    } else {
      return invalid_argument(where + ": expected {\"prompt\": \"...\"} or {\"prompt_token_ids\": [...]}");
    }
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace

int run_generate(int argc, char** argv) {
  CLI::App app{"nucleus generate: offline batch generation", "nucleus generate"};
  EngineArgs args;
  args.add_to(app);
  std::string prompt, prompts_file;
  SamplingParams sp;
  sp.temperature = 0.0f;
  sp.max_tokens = 64;
  int64_t seed = -1;
  bool as_json = false;
  auto* p1 = app.add_option("--prompt", prompt, "Prompt text (default, without --prompts: \"def fibonacci(n):\\n\")");
  auto* p2 = app.add_option("--prompts", prompts_file, "JSONL file of prompts");
  p1->excludes(p2);
  app.add_option("--max-tokens", sp.max_tokens, "Tokens to generate per prompt")->capture_default_str();
  app.add_option("--temperature", sp.temperature, "Sampling temperature (0: greedy)")->capture_default_str();
  app.add_option("--top-k", sp.top_k, "Sample from the k most likely tokens (0: all)")->capture_default_str();
  app.add_option("--top-p", sp.top_p, "Sample from the smallest set with this mass")->capture_default_str();
  // Checked as text: a value past int64 would otherwise be clamped to its maximum.
  const CLI::Validator seed_range(
      [](std::string& s) -> std::string {
        int64_t v = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (ec != std::errc() || end != s.data() + s.size() || v < 0)
          return "a seed is an integer from 0 to " + std::to_string(std::numeric_limits<int64_t>::max());
        return "";
      },
      "SEED");
  app.add_option("--seed", seed, "Sampling seed (same seed, same output); unseeded when not given")->check(seed_range);
  app.add_option("--min-p", sp.min_p, "Drop tokens less likely than min_p times the most likely one (0: off)")
      ->capture_default_str();
  app.add_option("--presence-penalty", sp.presence_penalty,
                 "Subtracted from the logits of tokens generated so far, in [-2, 2]")
      ->capture_default_str();
  app.add_option("--frequency-penalty", sp.frequency_penalty,
                 "Subtracted per occurrence among the tokens generated so far, in [-2, 2]")
      ->capture_default_str();
  app.add_option("--repetition-penalty", sp.repetition_penalty,
                 "Divides positive (multiplies negative) logits of prompt and generated tokens (1: off)")
      ->capture_default_str();
  app.add_option("--min-tokens", sp.min_tokens, "EOS and stop tokens are masked until this many are generated")
      ->capture_default_str();
  std::vector<std::string> logit_bias;
  app.add_option("--logit-bias", logit_bias, "ID:BIAS added to token ID's logit, bias in [-100, 100] (repeatable)");
  app.add_flag("--ignore-eos", sp.ignore_eos, "Keep generating past EOS");
  app.add_flag("--json", as_json, "One JSON line per prompt");
  app.add_flag("--skip-tokenizer-init", args.skip_tokenizer_init,
               "Load no tokenizer: prompts must be {\"prompt_token_ids\": [...]} lines, output is token ids");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return exit_code_for(app, e);
  }
  init_logging();
  if (seed >= 0) sp.seed = static_cast<uint64_t>(seed);
  for (const std::string& b : logit_bias) {
    const size_t colon = b.find(':');
    int32_t id = 0;
    float bias = 0.0f;
    std::istringstream id_in(b.substr(0, colon)), bias_in(colon == std::string::npos ? "" : b.substr(colon + 1));
    if (colon == std::string::npos || !(id_in >> id) || !id_in.eof() || !(bias_in >> bias) || !bias_in.eof()) {
      std::cerr << "error: --logit-bias '" << b << "' is not ID:BIAS (e.g. 42:-100)\n";
      return 2;
    }
    sp.logit_bias.emplace_back(id, bias);
  }
  if (Status s = sp.validate(); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 2;
  }
  std::vector<PromptInput> prompts;
  if (!prompts_file.empty()) {
    auto r = read_prompts_file(prompts_file);
    if (!r.ok()) {
      std::cerr << "error: " << r.status().message() << "\n";
      return 2;
    }
    prompts = std::move(*r);
  } else {
    PromptInput p;
    p.text = app.count("--prompt") ? prompt : "def fibonacci(n):\n";
    if (p.text.empty()) {
      std::cerr << "error: --prompt is empty\n";
      return 2;
    }
    prompts.push_back(p);
  }
  auto loaded = load_engine(args);
  if (!loaded.ok()) {
    std::cerr << "error: " << loaded.status().message() << "\n";
    return 1;
  }
  LLMEngine& engine = *loaded->engine;
  const Tokenizer* tok = loaded->tokenizer.get();
  if (!tok)
    for (const auto& p : prompts)
      if (!p.has_ids) {
        std::cerr << "error: no tokenizer (--skip-tokenizer-init, or dummy weights from --config): give prompts as "
                     "{\"prompt_token_ids\": [...]} lines\n";
        return 2;
      }

  struct Result {
    std::vector<int32_t> prompt_ids, output_ids;
    std::string error;
    FinishReason reason = FinishReason::kNone;
  };
  std::vector<Result> results(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    Result& r = results[i];
    // A text that cannot fit the context whatever it encodes to is refused
    // before it is encoded (as the server does): every token stands for at
    // most max_token_bytes() bytes, 4x for a normalizer that shortens it.
    const int64_t max_len = engine.config().max_model_len;
    if (!prompts[i].has_ids &&
        static_cast<int64_t>(prompts[i].text.size()) > 4 * max_len * tok->max_token_bytes()) {
      r.error = "the prompt's " + std::to_string(prompts[i].text.size()) + " bytes encode to more than the " +
                std::to_string(max_len) + " tokens of the context";
      continue;
    }
    r.prompt_ids = prompts[i].has_ids ? prompts[i].ids : tok->encode(prompts[i].text);
    Status s = engine.add_request(std::to_string(i), r.prompt_ids, sp);
    if (!s.ok()) r.error = s.message();
  }
  // Timing summary (stderr): time until every request had its first token
  // (prefill), and output tokens per second over the whole run.
  const auto t0 = std::chrono::steady_clock::now();
  double all_first_s = 0;
  size_t with_first = 0, total_out = 0, total_prompt = 0;
  for (const auto& r : results) total_prompt += r.error.empty() ? r.prompt_ids.size() : 0;
  size_t accepted = 0;
  for (const auto& r : results) accepted += r.error.empty();
  while (engine.has_unfinished()) {
    for (const auto& o : engine.step()) {
      Result& r = results[std::stoul(o.request_id)];
      if (r.output_ids.empty() && !o.new_token_ids.empty() && ++with_first == accepted)
        all_first_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      r.output_ids.insert(r.output_ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      total_out += o.new_token_ids.size();
      if (o.finished) r.reason = o.finish_reason;
      if (o.finish_reason == FinishReason::kError) r.error = o.error.message();  // a failed step
    }
  }
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const EngineStats st = engine.stats();
  NUCLEUS_LOG_INFO("generate: {} requests, {} prompt tokens ({} from the prefix cache), {} output tokens in {:.3f} s: "
                   "all prefilled after {:.3f} s, {:.1f} output tokens/s, {} preemptions",
                   accepted, total_prompt, st.prefix_hit_tokens, total_out, elapsed, all_first_s,
                   elapsed > 0 ? total_out / elapsed : 0.0, st.num_preemptions);
  if (engine.config().speculative.enabled())
    NUCLEUS_LOG_INFO("speculative decoding: {}", spec_decode_summary(st.spec));
  int rc = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    if (!r.error.empty()) rc = 1;
    if (as_json) {
      json j;
      j["prompt_token_ids"] = r.prompt_ids;
      if (!r.error.empty()) {
        j["error"] = r.error;
      } else {
        j["token_ids"] = r.output_ids;
        if (tok) j["text"] = tok->decode(r.output_ids, /*skip_special_tokens=*/true);
        j["finish_reason"] = finish_reason_name(r.reason);
      }
      std::cout << j.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
    } else if (!r.error.empty()) {
      std::cerr << "prompt " << i << ": error: " << r.error << "\n";
    } else {
      if (results.size() > 1) std::cout << "=== prompt " << i << " ===\n";
      if (!prompts[i].has_ids) std::cout << prompts[i].text;
      if (tok) std::cout << tok->decode(r.output_ids, /*skip_special_tokens=*/true) << "\n";
      else for (int32_t id : r.output_ids) std::cout << id << (&id == &r.output_ids.back() ? "\n" : " ");
    }
  }
  return rc;
}

}  // namespace nucleus::cli
