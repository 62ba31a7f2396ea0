// tokenize_json MODEL_DIR TEXTS_JSON: encodes each string of the JSON array
// in TEXTS_JSON with the tokenizer of MODEL_DIR (tokenizer.json, or Kimi-K2's
// tiktoken.model) and prints one JSON object to stdout:
//   {"vocab_size": N, "ids": [[...], ...], "decoded": ["...", ...]}
// ids without BOS/EOS (add_special_tokens false; special tokens written in
// the text are recognised), decoded = decode(ids) with special tokens kept
// (invalid UTF-8 replaced by U+FFFD). For the tokenizer reference tests
// (tests/e2e/tokenizer_reference_test.py). Exit status 1 on a load error.
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "io/tokenizer.h"

int main(int argc, char** argv) {
  using nlohmann::json;
  if (argc != 3) {
    std::cerr << "usage: tokenize_json MODEL_DIR TEXTS_JSON\n";
    return 2;
  }
  auto tokenizer = nucleus::Tokenizer::load(argv[1]);
  if (!tokenizer.ok()) {
    std::cerr << "error: " << tokenizer.status().message() << "\n";
    return 1;
  }
  std::ifstream in(argv[2], std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  json texts = json::parse(buf.str(), nullptr, /*allow_exceptions=*/false);
  if (!in || !texts.is_array()) {
    std::cerr << "error: " << argv[2] << " is not a JSON array of strings\n";
    return 2;
  }
  json out = {{"vocab_size", (*tokenizer)->vocab_size()}, {"ids", json::array()}, {"decoded", json::array()}};
  for (const json& t : texts) {
    std::vector<int32_t> ids = (*tokenizer)->encode(t.get<std::string>(), /*add_special_tokens=*/false);
    out["decoded"].push_back((*tokenizer)->decode(ids));
    out["ids"].push_back(std::move(ids));
  }
  std::cout << out.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
  return 0;
}
