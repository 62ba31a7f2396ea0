#include "io/detokenizer.h"

#include <algorithm>
#include <string_view>

#include "io/utf8.h"

namespace nucleus {

namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

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
    const size_t start = i;
    const Utf8Seq seq = utf8_next(bytes_, i);
    if (seq == Utf8Seq::kValid) {
      held_.append(bytes_, start, i - start);
    } else if (seq == Utf8Seq::kTruncated && !final) {
      i = start;
      break;
    } else {
      held_ += kReplacement;
    }
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
