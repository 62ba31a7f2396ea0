// Reader of tiktoken's ranks file format (Kimi-K2's tiktoken.model; what
// tiktoken.load.load_tiktoken_bpe reads).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace nucleus {

// Parses a tiktoken ranks file: one "<base64 of the token's bytes> <rank>"
// per line (standard base64 alphabet, padded; '\n' or "\r\n" line ends;
// empty lines skipped). A token's rank is its id and its BPE priority.
// Returns the token bytes indexed by rank. Errors (kInvalidArgument, naming
// `where` and the 1-based line): a line that is not two fields, bad base64,
// a rank that is not an integer in [0, 2^24), a repeated rank or token, or
// ranks that are not exactly 0..n-1 (tiktoken then numbers the special
// tokens from n, so a gap would be ambiguous).
StatusOr<std::vector<std::string>> parse_tiktoken_ranks(std::string_view text, const std::string& where);

}  // namespace nucleus
