#include "runtime/spec_decode.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/device.h"

namespace nucleus {

StatusOr<SpeculativeConfig> parse_speculative_config(const std::string& json_text) {
  nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return invalid_argument("--speculative-config must be a JSON object such as "
                            "'{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 1}', got '" +
                            json_text + "'");
  SpeculativeConfig c;
  for (const auto& [key, value] : j.items()) {
    if (key == "method") {
      if (!value.is_string()) return invalid_argument("--speculative-config: \"method\" must be a string");
      c.method = value.get<std::string>();
    } else if (key == "num_speculative_tokens") {
      if (!value.is_number_integer())
        return invalid_argument("--speculative-config: \"num_speculative_tokens\" must be an integer, got " +
                                value.dump());
      c.num_speculative_tokens = value.get<int64_t>();
    } else {
      return unsupported("--speculative-config: \"" + key +
                         "\" is not supported (supported keys: method, num_speculative_tokens)");
    }
  }
  if (c.method.empty()) return invalid_argument("--speculative-config needs \"method\" (supported: deepseek_mtp)");
  if (c.method == "mtp") c.method = "deepseek_mtp";  // vLLM's newer spelling of the same method
  if (c.method != "deepseek_mtp")
    return unsupported("--speculative-config: method \"" + c.method +
                       "\" is not supported (supported: deepseek_mtp, the checkpoint's own MTP layer)");
  if (!j.contains("num_speculative_tokens"))
    return invalid_argument("--speculative-config needs \"num_speculative_tokens\" (1 to " +
                            std::to_string(kMaxSpeculativeTokens) + ")");
  if (c.num_speculative_tokens < 1 || c.num_speculative_tokens > kMaxSpeculativeTokens)
    return unsupported("--speculative-config: num_speculative_tokens " + std::to_string(c.num_speculative_tokens) +
                       " is not supported (supported: 1 to " + std::to_string(kMaxSpeculativeTokens) + ")");
  return c;
}

std::string spec_decode_summary(const SpecDecodeStats& s) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%lld drafts, %lld draft tokens, %lld accepted (%.3f), mean acceptance length %.3f",
                static_cast<long long>(s.num_drafts), static_cast<long long>(s.num_draft_tokens),
                static_cast<long long>(s.num_accepted_tokens), s.acceptance_rate(), s.mean_acceptance_length());
  std::string out = buf;
  out += ", accepted by position";
  for (size_t j = 0; j < s.accepted_per_pos.size(); ++j)
    out += (j ? "/" : " ") + std::to_string(s.accepted_per_pos[j]);
  return out;
}

namespace {

// Appends one sequence's rows to `in` (tokens, positions, slots, its block
// table widened to in.max_blocks_per_seq).
void add_seq(StepInputs& in, const Sequence& seq, int64_t block_size, int64_t first_position,
             const std::vector<int32_t>& tokens) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int64_t pos = first_position + static_cast<int64_t>(i);
    NUCLEUS_CHECK(pos / block_size < static_cast<int64_t>(seq.block_table.size()),
                  "MTP row at position {} of sequence {} has no KV block", pos, seq.seq_id);
    in.token_ids.push_back(tokens[i]);
    in.positions.push_back(static_cast<int32_t>(pos));
    in.slot_mapping.push_back(static_cast<int64_t>(seq.block_table[pos / block_size]) * block_size + pos % block_size);
  }
  in.query_start.push_back(static_cast<int32_t>(in.token_ids.size()));
  in.context_lens.push_back(static_cast<int32_t>(first_position));
  for (int32_t b = 0; b < in.max_blocks_per_seq; ++b)
    in.block_tables.push_back(b < static_cast<int32_t>(seq.block_table.size()) ? seq.block_table[b] : -1);
}

}  // namespace

StatusOr<std::vector<int32_t>> MtpProposer::argmax_rows(const Tensor& logits, int64_t n) {
  const int64_t V = model_->config().vocab_size;
  std::vector<int32_t> ids(static_cast<size_t>(n));
  if (logits.device() == Device::kCuda) {
    if (!sampler_ || sampler_->max_rows() < n) {
      NUCLEUS_ASSIGN_OR_RETURN(sampler_, DeviceSampler::create(std::max<int64_t>(256, n), V));
    }
    SamplingParams greedy;
    greedy.temperature = 0.0f;
    const std::vector<DeviceSampleRequest> requests(static_cast<size_t>(n),
                                                    make_device_sample_request(greedy, 0, 0));
    const std::vector<SampleResult> r = sampler_->sample(logits.data<float>(), requests);
    for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = r[static_cast<size_t>(i)].token;
    return ids;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float* row = logits.data<float>() + i * V;
    ids[static_cast<size_t>(i)] = static_cast<int32_t>(std::max_element(row, row + V) - row);
  }
  return ids;
}

Status MtpProposer::propose(const std::vector<MtpRows>& rows, BlockManager& blocks) {
  const int64_t bs = cache_.block_size;
  // Drafts each sequence may take; chained drafts need the MTP cache's slots
  // of positions N - 1 .. N + m - 3 (N = num_tokens).
  std::vector<int64_t> num_drafts(rows.size(), 0);
  for (size_t r = 0; r < rows.size(); ++r) {
    const MtpRows& it = rows[r];
    if (!it.draft) continue;
    Sequence& seq = *it.seq;
    const int64_t n = seq.num_tokens();
    NUCLEUS_CHECK(it.first_position + it.num_rows == n - 1, "sequence {}: MTP rows end at {}, {} tokens", seq.seq_id,
                  it.first_position + it.num_rows, n);
    int64_t m = std::min(k_, it.max_drafts);
    if (m >= 2 && static_cast<int64_t>(seq.block_table.size()) * bs < n + m - 2) blocks.allocate_slots(seq, n + m - 2);
    m = std::min(m, static_cast<int64_t>(seq.block_table.size()) * bs - n + 2);
    num_drafts[r] = std::max<int64_t>(m, 0);
  }

  // Pass 1: every newly computed position i, token t_{i+1}, hidden h_i.
  NUCLEUS_ASSIGN_OR_RETURN(Tensor target_hidden, model_->hidden_states());
  StepInputs in;
  in.query_start.push_back(0);
  for (const MtpRows& it : rows)
    in.max_blocks_per_seq = std::max<int32_t>(in.max_blocks_per_seq, static_cast<int32_t>(it.seq->block_table.size()));
  int64_t total = 0;
  for (const MtpRows& it : rows) total += it.num_rows;
  if (total == 0) return ok_status();
  std::vector<int32_t> source_rows;  // the target step's row of each MTP row
  std::vector<size_t> drafting;  // indices into rows, in logit-row order
  int64_t at = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    const MtpRows& it = rows[r];
    if (it.num_rows == 0) continue;
    std::vector<int32_t> next;
    for (int64_t i = 0; i < it.num_rows; ++i) next.push_back(it.seq->token_at(it.first_position + i + 1));
    add_seq(in, *it.seq, bs, it.first_position, next);
    for (int64_t i = 0; i < it.num_rows; ++i) source_rows.push_back(static_cast<int32_t>(it.target_row + i));
    at += it.num_rows;
    if (num_drafts[r] > 0) {
      in.logit_indices.push_back(static_cast<int32_t>(at - 1));
      drafting.push_back(r);
    }
  }
  NUCLEUS_ASSIGN_OR_RETURN(in.mtp_hidden, model_->gather_hidden_rows(target_hidden, source_rows));
  NUCLEUS_ASSIGN_OR_RETURN(Tensor logits, model_->mtp_forward_logits(in, cache_));
  NUCLEUS_ASSIGN_OR_RETURN(std::vector<int32_t> first, argmax_rows(logits, static_cast<int64_t>(drafting.size())));
  std::vector<int64_t> prev_row;  // each drafting sequence's row in the last MTP step
  for (size_t d = 0; d < drafting.size(); ++d) {
    Sequence& seq = *rows[drafting[d]].seq;
    seq.draft_token_ids = {first[d]};
    prev_row.push_back(in.logit_indices[d]);
  }

  // Chained drafts: position N - 2 + j, token d_j, the MTP's own output at the row before.
  for (int64_t j = 1; j < k_; ++j) {
    std::vector<size_t> live;  // indices into drafting
    for (size_t d = 0; d < drafting.size(); ++d)
      if (num_drafts[drafting[d]] > j) live.push_back(d);
    if (live.empty()) break;
    NUCLEUS_ASSIGN_OR_RETURN(Tensor y, model_->mtp_hidden_states());
    StepInputs ci;
    ci.query_start.push_back(0);
    for (size_t d : live)
      ci.max_blocks_per_seq =
          std::max<int32_t>(ci.max_blocks_per_seq, static_cast<int32_t>(rows[drafting[d]].seq->block_table.size()));
    std::vector<int32_t> source;  // the last MTP step's row of each live draft
    for (size_t i = 0; i < live.size(); ++i) {
      Sequence& seq = *rows[drafting[live[i]]].seq;
      add_seq(ci, seq, bs, seq.num_tokens() - 2 + j, {seq.draft_token_ids.back()});
      source.push_back(static_cast<int32_t>(prev_row[live[i]]));
      ci.logit_indices.push_back(static_cast<int32_t>(i));
    }
    NUCLEUS_ASSIGN_OR_RETURN(ci.mtp_hidden, model_->gather_hidden_rows(y, source));
    NUCLEUS_ASSIGN_OR_RETURN(Tensor cl, model_->mtp_forward_logits(ci, cache_));
    NUCLEUS_ASSIGN_OR_RETURN(std::vector<int32_t> next, argmax_rows(cl, static_cast<int64_t>(live.size())));
    for (size_t i = 0; i < live.size(); ++i) {
      rows[drafting[live[i]]].seq->draft_token_ids.push_back(next[i]);
      prev_row[live[i]] = static_cast<int64_t>(i);
    }
  }
  return ok_status();
}

}  // namespace nucleus
