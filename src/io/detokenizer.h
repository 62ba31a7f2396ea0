// Incremental detokenization for streaming: token ids in, text pieces out.
//
// Byte-level BPE tokens carry bytes, not characters, so one character can
// be split across tokens; and a stop string can arrive over several tokens.
// The detokenizer therefore holds back
//   - an incomplete UTF-8 sequence at the end, until its last byte arrives,
//   - text that could be the start of a stop string, until it either
//     completes the stop string or diverges from every one.
// Every piece it releases is valid UTF-8; bytes that cannot become a
// character are released as U+FFFD, one per maximal invalid subsequence
// (Python's bytes.decode(errors="replace")). For valid UTF-8 and no stop
// string, the concatenated pieces equal Tokenizer::decode of the same ids.
//
// When a stop string completes, the text before it is final (the stop string
// itself too with include_stop_str_in_output) and nothing after it is ever
// released. When several could complete, the one that completes first in the
// text wins (ending earliest; of those, the one starting earliest), which is
// what feeding the text one character at a time would give.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/tokenizer.h"

namespace nucleus {

class IncrementalDetokenizer {
 public:
  // `tokenizer` must outlive this object. Empty stop strings are ignored.
  // skip_special_tokens drops tokens the tokenizer marks special (as
  // Tokenizer::decode with skip_special_tokens).
  IncrementalDetokenizer(const Tokenizer& tokenizer, std::vector<std::string> stop_strings,
                         bool skip_special_tokens = true, bool include_stop_str_in_output = false);

  // Feeds one token; returns the newly releasable text (maybe ""). After a
  // stop string matched, returns "" and ignores the token. An id the
  // tokenizer has no token for adds nothing (Tokenizer::token_bytes).
  std::string add(int32_t token_id);

  // At the end of generation: releases everything held back, an incomplete
  // UTF-8 tail as U+FFFD and a partial stop-string prefix as the text it is.
  // Returns "" when a stop string matched. Later add() calls are ignored.
  std::string finish();

  // Tokens to keep in the text even with skip_special_tokens: the markers
  // of the server's tool-call and reasoning parsers, which must see them.
  void keep_special(std::vector<int32_t> ids) { keep_special_ = std::move(ids); }

  // Whether a stop string matched.
  bool stopped() const { return stopped_; }
  // The stop string that matched; "" when none did.
  const std::string& stop_string() const { return stop_string_; }
  // All text released so far (the concatenation of the returned pieces).
  const std::string& text() const { return text_; }

 private:
  // Moves the complete characters of bytes_ into held_ (all of bytes_ when
  // `final`), then stops or releases what can no longer start a stop string.
  std::string advance(bool final);

  const Tokenizer& tokenizer_;
  std::vector<std::string> stops_;
  bool skip_special_;
  std::vector<int32_t> keep_special_;
  bool include_stop_;
  size_t max_stop_len_ = 0;
  std::string bytes_;  // undecoded bytes: an incomplete UTF-8 sequence
  std::string held_;   // decoded text not released: a possible stop-string prefix
  std::string text_;
  std::string stop_string_;
  bool stopped_ = false;
  bool finished_ = false;
};

}  // namespace nucleus
