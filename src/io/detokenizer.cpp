#include "io/detokenizer.h"

#include <algorithm>
#include <string_view>

namespace nucleus {

namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// The byte length of the UTF-8 sequence `lead` starts, or 0 when it starts
// none (a continuation byte, C0, C1, F5..FF).
size_t sequence_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

// Whether `b` may follow `lead` as the second byte; the narrower ranges
// after E0, ED, F0 and F4 exclude overlong forms, surrogates and code points
// past U+10FFFF.
bool valid_second(unsigned char lead, unsigned char b) {
  switch (lead) {
    case 0xE0: return b >= 0xA0 && b <= 0xBF;
    case 0xED: return b >= 0x80 && b <= 0x9F;
    case 0xF0: return b >= 0x90 && b <= 0xBF;
    case 0xF4: return b >= 0x80 && b <= 0x8F;
    default: return b >= 0x80 && b <= 0xBF;
  }
}

// How many bytes from s[i] form a valid beginning of the sequence that
// s[i] starts (*need bytes long; 0 when s[i] cannot start one). The result
// equals *need for a complete character; less is a maximal invalid
// subpart, or an incomplete sequence when it reaches the end of `s`.
size_t valid_prefix(std::string_view s, size_t i, size_t* need) {
  auto lead = static_cast<unsigned char>(s[i]);
  *need = sequence_length(lead);
  if (*need == 0) return 0;
  size_t k = 1;
  for (; k < *need && i + k < s.size(); ++k) {
    auto b = static_cast<unsigned char>(s[i + k]);
    if (k == 1 ? !valid_second(lead, b) : (b & 0xC0) != 0x80) break;
  }
  return k;
}

}  // namespace

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, std::vector<std::string> stop_strings,
                                               bool skip_special_tokens, bool include_stop_str_in_output)
    : tokenizer_(tokenizer), skip_special_(skip_special_tokens), include_stop_(include_stop_str_in_output) {
  for (auto& s : stop_strings) {
    if (s.empty()) continue;
    max_stop_len_ = std::max(max_stop_len_, s.size());
    stops_.push_back(std::move(s));
  }
}

std::string IncrementalDetokenizer::add(int32_t token_id) {
  if (stopped_ || finished_) return "";
  const bool skip = skip_special_ && tokenizer_.is_special(token_id) &&
                    std::find(keep_special_.begin(), keep_special_.end(), token_id) == keep_special_.end();
  if (!skip) bytes_ += tokenizer_.token_bytes(token_id);
  return advance(false);
}

std::string IncrementalDetokenizer::finish() {
  if (stopped_ || finished_) return "";
  finished_ = true;
  return advance(true);
}

std::string IncrementalDetokenizer::advance(bool final) {
  // Decode: complete characters move to held_; invalid bytes become U+FFFD;
  // an incomplete sequence at the end waits for more bytes unless `final`.
  size_t i = 0;
  while (i < bytes_.size()) {
    size_t need = 0;
    size_t k = valid_prefix(bytes_, i, &need);
    if (need != 0 && k == need) {
      held_.append(bytes_, i, k);
    } else if (need != 0 && i + k == bytes_.size() && !final) {
      break;
    } else {
      held_ += kReplacement;
    }
    i += std::max<size_t>(k, 1);
  }
  bytes_.erase(0, i);

  // The stop string that completes first: the earliest end, then the
  // earliest start. held_ never holds a complete one from an earlier call,
  // and released text never ends with the start of one, so searching held_
  // finds every match.
  size_t best_start = std::string::npos, best_end = std::string::npos;
  const std::string* best = nullptr;
  for (const auto& s : stops_) {
    size_t at = held_.find(s);
    if (at == std::string::npos) continue;
    size_t end = at + s.size();
    if (end < best_end || (end == best_end && at < best_start)) best_start = at, best_end = end, best = &s;
  }
  std::string piece;
  if (best) {
    stopped_ = true;
    stop_string_ = *best;
    piece = held_.substr(0, include_stop_ ? best_end : best_start);
    held_.clear();
    bytes_.clear();
  } else {
    // Keep the longest end of held_ that some stop string starts with.
    size_t keep = 0;
    if (!final) {
      for (const auto& s : stops_) {
        for (size_t k = std::min(s.size() - 1, held_.size()); k > keep; --k) {
          if (held_.compare(held_.size() - k, k, s, 0, k) == 0) {
            keep = k;
            break;
          }
        }
      }
    }
    piece = held_.substr(0, held_.size() - keep);
    held_.erase(0, held_.size() - keep);
  }
  text_ += piece;
  return piece;
}

}  // namespace nucleus
