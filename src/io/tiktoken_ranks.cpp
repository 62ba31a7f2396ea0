#include "io/tiktoken_ranks.h"

#include <array>
#include <charconv>
#include <unordered_map>

namespace nucleus {

namespace {

constexpr int64_t kMaxRank = (int64_t{1} << 24) - 1;

// Standard (RFC 4648) base64 with padding, as Python's base64.b64decode
// accepts it by default; false on any other character or a bad length.
constexpr size_t kMaxTiktokenTokenBytes = 4096;

bool base64_decode(std::string_view in, std::string* out) {
  static const std::array<int8_t, 256> table = [] {
    std::array<int8_t, 256> t{};
    t.fill(-1);
    const char* alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 64; ++i) t[static_cast<unsigned char>(alphabet[i])] = static_cast<int8_t>(i);
    return t;
  }();
  if (in.size() % 4 != 0) return false;
  out->clear();
  for (size_t i = 0; i < in.size(); i += 4) {
    int pad = 0;
    uint32_t v = 0;
    for (size_t k = 0; k < 4; ++k) {
      char c = in[i + k];
      int d;
      if (c == '=' && i + 4 == in.size() && k >= 2) {
        ++pad;
        d = 0;
      } else {
        if (pad) return false;  // data after '='
        d = table[static_cast<unsigned char>(c)];
        if (d < 0) return false;
      }
      v = (v << 6) | static_cast<uint32_t>(d);
    }
    out->push_back(static_cast<char>(v >> 16));
    if (pad < 2) out->push_back(static_cast<char>((v >> 8) & 0xFF));
    if (pad < 1) out->push_back(static_cast<char>(v & 0xFF));
  }
  return true;
}

}  // namespace

StatusOr<std::vector<std::string>> parse_tiktoken_ranks(std::string_view text, const std::string& where) {
  std::vector<std::string> by_rank;
  std::vector<uint8_t> seen;
  std::unordered_map<std::string, int64_t> ranks;
  size_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string_view::npos) eol = text.size();
    std::string_view line = text.substr(pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (line.ends_with('\r')) line.remove_suffix(1);
    if (line.empty()) continue;
    const std::string at = where + ":" + std::to_string(line_no);
    size_t sp = line.find(' ');
    if (sp == std::string_view::npos || line.find(' ', sp + 1) != std::string_view::npos)
      return invalid_argument(at + ": expected '<base64 token> <rank>'");
    std::string_view b64 = line.substr(0, sp), rank_text = line.substr(sp + 1);
    std::string token;
    if (b64.empty() || !base64_decode(b64, &token)) return invalid_argument(at + ": token is not valid base64");
    // Real vocabularies' tokens are at most a few hundred bytes; a huge one
    // would make BPE over a long pre-token quadratic at load.
    if (token.size() > kMaxTiktokenTokenBytes)
      return invalid_argument(at + ": token of " + std::to_string(token.size()) + " bytes (at most " +
                              std::to_string(kMaxTiktokenTokenBytes) + ")");
    int64_t rank = -1;
    auto [end, ec] = std::from_chars(rank_text.data(), rank_text.data() + rank_text.size(), rank);
    if (ec != std::errc() || end != rank_text.data() + rank_text.size() || rank < 0 || rank > kMaxRank)
      return invalid_argument(at + ": rank '" + std::string(rank_text) + "' is not an integer in [0, " +
                              std::to_string(kMaxRank) + "]");
    if (static_cast<size_t>(rank) >= by_rank.size()) {
      by_rank.resize(static_cast<size_t>(rank) + 1);
      seen.resize(static_cast<size_t>(rank) + 1, 0);
    }
    if (seen[rank]) return invalid_argument(at + ": rank " + std::to_string(rank) + " repeats");
    auto [it, inserted] = ranks.emplace(token, rank);
    if (!inserted)
      return invalid_argument(at + ": token '" + std::string(b64) + "' repeats (ranks " + std::to_string(it->second) +
                              " and " + std::to_string(rank) + ")");
    seen[rank] = 1;
    by_rank[rank] = std::move(token);
  }
  if (ranks.empty()) return invalid_argument(where + ": no ranks");
  if (ranks.size() != by_rank.size())
    return invalid_argument(where + ": ranks are not 0.." + std::to_string(ranks.size() - 1) + " (the largest is " +
                            std::to_string(by_rank.size() - 1) + ")");
  return by_rank;
}

}  // namespace nucleus
