// nucleus bench latency: prefill and decode latency of a batch of random
// prompts (the way vLLM's benchmark_latency measures), with decode as a
// fraction of the memory roofline.
//
// Decode bytes per step = dense weights (every weight but the routed experts,
// read once per step) + routed experts activated by a representative step
// (counted from its routing, one extra recorded step) + the KV cache read
// (batch x context x bytes per cached token). Achieved bandwidth = bytes /
// measured step time, against the one roofline (core/roofline.h): 4.58
// TB/s, the read-only stream measured on the H200, and the spec's 4.8 TB/s.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <sstream>
#include <unistd.h>

#include "cli/commands.h"
#include "cli/engine_args.h"
#include "core/device.h"
#include "core/logging.h"
#include "core/roofline.h"
#include "ops/splitk.h"

namespace nucleus::cli {

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

StatusOr<std::vector<int64_t>> parse_sizes(const std::string& s, const char* flag) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      int64_t v = std::stoll(item, &used);
      if (used != item.size() || v < 1) throw std::invalid_argument(item);
      out.push_back(v);
    } catch (...) {
      return invalid_argument(std::string(flag) + ": '" + item + "' is not a positive integer");
    }
  }
  if (out.empty()) return invalid_argument(std::string(flag) + " is empty");
  return out;
}

struct Result {
  int64_t batch = 0, input_len = 0;
  double prefill_s = 0, decode_step_s = 0;
  double decode_bytes = 0;
  int64_t experts_per_step = 0;
  // Tokens the timed decode steps produced, over all sequences (one a
  // sequence a step without speculative decoding).
  int64_t decode_tokens = 0;
  double decode_total_s = 0;  // the timed decode steps' wall time, all runs together
  // Speculative decoding: the timed decode steps' split and their acceptance
  // (SpecDecodeStats of these steps alone).
  double target_step_s = 0, mtp_pass_s = 0;
  int64_t spec_steps = 0;
  SpecDecodeStats spec;
  StepHostProfile host;  // the timed decode steps' host phases (--host-profile), all runs together
};

// `now - before`, phase by phase.
StepHostProfile host_delta(const StepHostProfile& now, const StepHostProfile& before) {
  StepHostProfile d;
  d.steps = now.steps - before.steps;
  d.schedule_s = now.schedule_s - before.schedule_s;
  d.inputs_s = now.inputs_s - before.inputs_s;
  d.forward_s = now.forward_s - before.forward_s;
  d.sample_s = now.sample_s - before.sample_s;
  d.finish_s = now.finish_s - before.finish_s;
  return d;
}

}  // namespace

int run_bench_latency(int argc, char** argv) {
  CLI::App app{"nucleus bench latency: prefill and decode latency at given batch sizes", "nucleus bench latency"};
  EngineArgs args;
  args.add_to(app);
  std::string batch_sizes = "1,8,32,128", input_lens = "1024";
  int64_t output_len = 128, seed = 0, num_iters = 1;
  app.add_option("--batch-sizes", batch_sizes, "Comma-separated batch sizes")->capture_default_str();
  app.add_option("--input-len", input_lens, "Prompt tokens per request; a comma-separated list runs each")
      ->capture_default_str();
  app.add_option("--num-iters", num_iters,
                 "Timed runs per (input length, batch); prefill reports the median, decode the mean")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1000}));
  app.add_option("--output-len", output_len,
                 "Generated tokens per request (>= 2: one from prefill, the rest timed decode); with "
                 "--speculative-config, output-len - 1 timed verify steps, each of up to k + 1 tokens")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 20));
  app.add_option("--seed", seed, "Seed of the random prompts")->capture_default_str();
  bool host_profile = false;
  app.add_flag("--host-profile", host_profile,
               "Also print the timed decode steps' host time by phase (schedule, inputs, forward, sample, finish; "
               "EngineStats::host), not with --speculative-config");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return exit_code_for(app, e);
  }
  init_logging();
  auto sizes = parse_sizes(batch_sizes, "--batch-sizes");
  if (!sizes.ok()) {
    std::fprintf(stderr, "error: %s\n", sizes.status().message().c_str());
    return 2;
  }
  auto lens = parse_sizes(input_lens, "--input-len");
  if (!lens.ok()) {
    std::fprintf(stderr, "error: %s\n", lens.status().message().c_str());
    return 2;
  }
  if (host_profile && !args.speculative_config.empty()) {
    std::fprintf(stderr, "error: --host-profile measures plain decode steps; it does not go with --speculative-config\n");
    return 2;
  }
  const int64_t max_input_len = *std::max_element(lens->begin(), lens->end());
  const int64_t max_batch = *std::max_element(sizes->begin(), sizes->end());
  args.engine.max_num_seqs = std::max(args.engine.max_num_seqs, max_batch);
  auto device = resolve_device(args.device);
  StatusOr<ModelOptions> mo_or = device.ok() ? args.model_options(*device) : StatusOr<ModelOptions>(device.status());
  if (!mo_or.ok()) {
    std::fprintf(stderr, "error: %s\n", mo_or.status().message().c_str());
    return 1;
  }
  ModelOptions mo = *mo_or;
  std::unique_ptr<ModelExecutor> model;
  {
    std::string cfg = args.config_file.empty() ? (std::filesystem::path(args.model) / "config.json").string() : args.config_file;
    auto config = load_model_config(cfg, args.overrides);
    if (!config.ok()) {
      std::fprintf(stderr, "error: %s\n", config.status().message().c_str());
      return 1;
    }
    StatusOr<std::unique_ptr<ModelExecutor>> m = unsupported("unset");
    if (args.load_format == "dummy") {
      m = build_deepseek_model(*config, mo, [&](WeightBackend& backend, const TpShard& shard) {
        return make_dummy_weights(*config, backend, 0, shard, mo.load_mtp);
      });
    } else {
      if (!args.config_file.empty()) {
        std::fprintf(stderr, "error: --config needs --load-format dummy (a checkpoint is read with --model DIR)\n");
        return 2;
      }
      m = load_deepseek_model(args.model, mo, args.overrides);
    }
    if (!m.ok()) {
      std::fprintf(stderr, "error: %s\n", m.status().message().c_str());
      return 1;
    }
    model = std::move(*m);
  }
  const ModelConfig mc = model->config();
  const auto wb = model->weight_bytes();
  EngineConfig ec = args.engine;
  ec.enable_prefix_caching = false;  // random prompts; measure the compute
  ec.speculative = *args.speculative();  // checked by model_options
  // A verify step yields up to k + 1 tokens: room for output_len steps of them.
  const int64_t per_step = 1 + ec.speculative.num_speculative_tokens;
  // Chunked prefill gives the requests whose prompts finish first a head
  // start: they decode while the rest prefill, at most one token a step for
  // as many steps as the batch's prompts take, the steps' decode rows
  // included (batch * input_len tokens at max_num_batched_tokens - batch a
  // step, plus one).
  // At most 2^30 (a batch no cache holds: refused below).
  const auto head_start = [&](int64_t batch, int64_t input_len) -> int64_t {
    const double room = static_cast<double>(std::max<int64_t>(1, ec.max_num_batched_tokens - batch));
    const double steps = std::ceil(static_cast<double>(batch) * static_cast<double>(input_len) / room) + 1;
    return steps < 1073741824.0 ? static_cast<int64_t>(steps) : int64_t{1} << 30;
  };
  int64_t max_head_start = 0;
  for (int64_t input_len : *lens)
    for (int64_t batch : *sizes) max_head_start = std::max(max_head_start, head_start(batch, input_len));
  if (ec.max_model_len == 0)
    ec.max_model_len = std::min<int64_t>(mc.max_position_embeddings,
                                         max_input_len + per_step * (2 * output_len + max_head_start) + 32);
  auto engine = LLMEngine::create(std::move(model), ec);
  if (!engine.ok()) {
    std::fprintf(stderr, "error: %s\n", engine.status().message().c_str());
    return 1;
  }
  LLMEngine& e = **engine;
  const bool tty = isatty(2);
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  std::uniform_int_distribution<int32_t> tok(3, static_cast<int32_t>(mc.vocab_size - 1));
  std::vector<Result> results;
  for (int64_t input_len : *lens) {
    for (int64_t batch : *sizes) {
      SamplingParams sp;
      sp.temperature = 0;
      sp.ignore_eos = true;
      // Room for every request to stay running through the timed decode steps
      // (staggered prefill chunks give some requests a head start), within
      // the context limit.
      const int64_t ahead = head_start(batch, input_len);
      sp.max_tokens = static_cast<int32_t>(std::max<int64_t>(
          output_len, std::min<int64_t>(per_step * (2 * output_len + ahead) + 16, ec.max_model_len - input_len)));
      // Every request must stay running through the timed steps: a batch
      // whose KV rows do not fit the cache would be preempted, and the decode
      // steps would not be of `batch` sequences.
      {
        const int64_t bs = ec.block_size,
                      tokens = input_len + std::min<int64_t>(sp.max_tokens, per_step * (output_len + 1 + ahead));
        const int64_t need = batch * ((tokens + bs - 1) / bs), have = e.stats().kv_blocks_total;
        if (need > have) {
          std::fprintf(stderr,
                       "error: input %lld batch %lld: the KV cache holds %lld blocks of %lld tokens; the batch needs "
                       "%lld (up to %lld tokens a request): lower --batch-sizes or --input-len, or give the cache "
                       "more blocks (--num-kv-blocks, --gpu-memory-utilization)\n",
                       static_cast<long long>(input_len), static_cast<long long>(batch), static_cast<long long>(have),
                       static_cast<long long>(bs), static_cast<long long>(need), static_cast<long long>(tokens));
          return 1;
        }
      }
      std::vector<double> prefill_times;
      double decode_total_s = 0, spec_target_s = 0, spec_mtp_s = 0;
      int64_t spec_steps = 0;
      int64_t decode_total_steps = 0, decode_tokens = 0;
      SpecDecodeStats spec_timed;
      StepHostProfile host_timed;
      StepStats stats;
      // Run 0 warms up (allocations, cuBLASLt plans); runs 1..num_iters are timed.
      for (int64_t run = 0; run <= num_iters; ++run) {
        const bool timed = run > 0;
        std::vector<std::string> ids;
        for (int64_t i = 0; i < batch; ++i) {
          std::vector<int32_t> prompt(input_len);
          for (auto& t : prompt) t = tok(rng);
          ids.push_back("i" + std::to_string(input_len) + "b" + std::to_string(batch) + "r" + std::to_string(run) + "_" +
                        std::to_string(i));
          Status s = e.add_request(ids.back(), prompt, sp);
          if (!s.ok()) {
            std::fprintf(stderr, "error: input %lld batch %lld: %s\n", static_cast<long long>(input_len),
                         static_cast<long long>(batch), s.message().c_str());
            return 1;
          }
        }
        const double t0 = now();
        int64_t first_tokens = 0, decode_steps = 0;
        // A failed step finishes its requests with an error: the run cannot go on.
        auto step = [&]() -> StatusOr<std::vector<RequestOutput>> {
          std::vector<RequestOutput> outs = e.step();
          for (const auto& o : outs)
            if (o.finish_reason == FinishReason::kError) return o.error;
          return outs;
        };
        // Prefill: until every request has its first token.
        while (first_tokens < batch) {
          auto outs = step();
          if (!outs.ok()) {
            std::fprintf(stderr, "error: input %lld batch %lld: %s\n", static_cast<long long>(input_len),
                         static_cast<long long>(batch), outs.status().message().c_str());
            return 1;
          }
          for (const auto& o : *outs) first_tokens += o.num_output_tokens == 1;
          if (tty && timed)
            std::fprintf(stderr, "\rinput %lld batch %lld run %lld: prefill %lld/%lld   ",
                         static_cast<long long>(input_len), static_cast<long long>(batch), static_cast<long long>(run),
                         static_cast<long long>(first_tokens), static_cast<long long>(batch));
        }
        if (timed) prefill_times.push_back(now() - t0);
        // Decode: output_len - 1 steps, every one a pure decode step of `batch`
        // sequences; then one more step with its routing recorded.
        const SpecDecodeStats spec_before = e.stats().spec;
        const StepHostProfile host_before = e.stats().host;
        while (decode_steps < output_len - 1) {
          const double ts = now();
          auto outs = step();
          if (timed) decode_total_s += now() - ts;
          if (!outs.ok()) {
            std::fprintf(stderr, "error: input %lld batch %lld: %s\n", static_cast<long long>(input_len),
                         static_cast<long long>(batch), outs.status().message().c_str());
            return 1;
          }
          if (static_cast<int64_t>(outs->size()) != batch) {
            std::fprintf(stderr,
                         "error: input %lld batch %lld: a decode step served %zu of the %lld sequences (the scheduler "
                         "preempted or held back the rest: --max-num-batched-tokens, --num-kv-blocks)\n",
                         static_cast<long long>(input_len), static_cast<long long>(batch), outs->size(),
                         static_cast<long long>(batch));
            return 1;
          }
          ++decode_steps;
          if (timed)
            for (const auto& o : *outs) decode_tokens += static_cast<int64_t>(o.new_token_ids.size());
          // A request at its max_tokens (the context limit, with speculative
          // decoding's several tokens a step) ends this run's decode steps.
          if (std::any_of(outs->begin(), outs->end(), [](const RequestOutput& o) { return o.finished; })) break;
          if (tty && timed)
            std::fprintf(stderr, "\rinput %lld batch %lld run %lld: decode %lld/%lld   ",
                         static_cast<long long>(input_len), static_cast<long long>(batch), static_cast<long long>(run),
                         static_cast<long long>(decode_steps), static_cast<long long>(output_len - 1));
        }
        if (timed) {
          decode_total_steps += decode_steps;
          const StepHostProfile d = host_delta(e.stats().host, host_before);
          host_timed.steps += d.steps;
          host_timed.schedule_s += d.schedule_s;
          host_timed.inputs_s += d.inputs_s;
          host_timed.forward_s += d.forward_s;
          host_timed.sample_s += d.sample_s;
          host_timed.finish_s += d.finish_s;
        }
        if (timed && ec.speculative.enabled()) {
          const SpecDecodeStats st = e.stats().spec;
          spec_target_s += st.target_seconds - spec_before.target_seconds;
          spec_mtp_s += st.mtp_seconds - spec_before.mtp_seconds;
          spec_steps += st.num_steps - spec_before.num_steps;
          spec_timed.num_drafts += st.num_drafts - spec_before.num_drafts;
          spec_timed.num_draft_tokens += st.num_draft_tokens - spec_before.num_draft_tokens;
          spec_timed.num_accepted_tokens += st.num_accepted_tokens - spec_before.num_accepted_tokens;
        }
        if (run == num_iters) {
          e.set_step_stats(&stats);
          e.step();
          e.set_step_stats(nullptr);
        }
        for (const auto& id : ids) e.abort(id);
      }
      if (tty) std::fprintf(stderr, "\n");
      Result r;
      r.batch = batch;
      r.input_len = input_len;
      std::sort(prefill_times.begin(), prefill_times.end());
      r.prefill_s = prefill_times[prefill_times.size() / 2];
      r.decode_step_s = decode_total_s / static_cast<double>(std::max<int64_t>(decode_total_steps, 1));
      r.experts_per_step = stats.experts_activated;
      r.spec_steps = spec_steps;
      r.spec = spec_timed;
      r.host = host_timed;
      r.decode_tokens = decode_tokens;
      r.decode_total_s = decode_total_s;
      r.target_step_s = spec_steps ? spec_target_s / spec_steps : 0;
      r.mtp_pass_s = spec_steps ? spec_mtp_s / spec_steps : 0;
      const double avg_context = input_len + output_len / 2.0;
      r.decode_bytes = static_cast<double>(wb.dense) + static_cast<double>(stats.experts_activated) * wb.per_expert +
                       batch * avg_context * static_cast<double>(e.model().kv_bytes_per_token());
      results.push_back(r);
    }
  }
  std::printf("nucleus bench latency: %s, %s, output %lld, %lld timed run(s), %s\n", mc.model_type.c_str(),
              device_name(e.model().options().device), static_cast<long long>(output_len),
              static_cast<long long>(num_iters), args.load_format == "dummy" ? "dummy weights" : args.model.c_str());
  std::printf("passes: split-K %s%s, prezero %s (NUCLEUS_SPLITK, NUCLEUS_SPLITK_DETERMINISTIC, NUCLEUS_ENABLE_PREZERO)\n",
              splitk_switch() == SplitKSwitch::kOff ? "off" : splitk_switch() == SplitKSwitch::kOn ? "on" : "auto",
              splitk_deterministic() ? " deterministic" : "", e.model().options().enable_prezero ? "on" : "off");
  std::printf("width builds: %s (NUCLEUS_WIDTH_BUILDS=%s)\n", e.model().width_builds_active() ? "in use" : "not used",
              width::width_builds_mode_name(e.model().options().width_builds));
  std::printf("weights: dense %.2f GB, one routed expert %.2f MB; KV %lld bytes/token\n", wb.dense / 1e9,
              wb.per_expert / 1e6, static_cast<long long>(e.model().kv_bytes_per_token()));
  std::printf("%6s %6s %11s %13s %11s %12s %9s %11s %9s %9s\n", "input", "batch", "prefill_ms", "prefill_tok/s",
              "decode_ms", "decode_tok/s", "experts", "GB/step", "%4.8TB/s", "%4.58TB/s");
  // The roofline columns are the H200's HBM bandwidth: meaningless for the CPU backend.
  const bool h200 = e.model().options().device == Device::kCuda;
  for (const auto& r : results) {
    const double gbps = r.decode_bytes / r.decode_step_s / 1e9;
    std::printf("%6lld %6lld %11.2f %13.0f %11.3f %12.0f %9lld %11.3f ", static_cast<long long>(r.input_len),
                static_cast<long long>(r.batch), r.prefill_s * 1e3, r.batch * r.input_len / r.prefill_s,
                r.decode_step_s * 1e3,
                static_cast<double>(r.decode_tokens) / std::max(r.decode_total_s, 1e-12),
                static_cast<long long>(r.experts_per_step),
                r.decode_bytes / 1e9);
    if (h200)
      std::printf("%8.1f%% %8.1f%%\n", 100.0 * gbps * 1e9 / roofline::kHbmSpecBytesPerSec,
                  100.0 * gbps * 1e9 / roofline::kHbmBytesPerSec);
    else
      std::printf("%9s %9s\n", "-", "-");
  }
  if (!h200) std::printf("(the %% columns are the H200's HBM roofline: not shown for the %s backend)\n",
                         device_name(e.model().options().device));
  if (host_profile && !ec.speculative.enabled()) {
    // Where a decode step's wall time goes on the host (EngineStats::host):
    // on CUDA, forward_us is the time to issue the step (uploads, graph
    // replay) and sample_us includes the wait for the GPU.
    std::printf("host profile of the timed decode steps (us a step):\n");
    std::printf("%6s %6s %11s %11s %11s %11s %11s %11s\n", "input", "batch", "schedule_us", "inputs_us", "forward_us",
                "sample_us", "finish_us", "step_us");
    for (const auto& r : results) {
      const StepHostProfile& h = r.host;
      const double n = static_cast<double>(std::max<int64_t>(h.steps, 1)) / 1e6;
      std::printf("%6lld %6lld %11.1f %11.1f %11.1f %11.1f %11.1f %11.1f\n", static_cast<long long>(r.input_len),
                  static_cast<long long>(r.batch), h.schedule_s / n, h.inputs_s / n, h.forward_s / n,
                  h.sample_s / n, h.finish_s / n,
                  (h.schedule_s + h.inputs_s + h.forward_s + h.sample_s + h.finish_s) / n);
    }
  }
  if (ec.speculative.enabled()) {
    // decode_ms is a verify step (k + 1 rows a sequence, plus the MTP passes);
    // decode_tok/s counts the tokens those steps produced.
    const SpecDecodeStats st = e.stats().spec;
    std::printf("speculative decoding: %s, k %lld: %s (every run, warm-up included)\n", ec.speculative.method.c_str(),
                static_cast<long long>(ec.speculative.num_speculative_tokens), spec_decode_summary(st).c_str());
    std::printf("(decode_ms is one verify step and its MTP passes; decode_tok/s counts the tokens they produced)\n");
    // The timed decode steps split: the target's verify step (k + 1 rows a
    // sequence, acceptance on the host) and the MTP passes that draft; and
    // their acceptance, per row.
    std::printf("%6s %6s %11s %14s %12s %11s %15s\n", "input", "batch", "decode_ms", "verify_step_ms", "mtp_pass_ms",
                "acceptance", "tok/s_per_user");
    for (const auto& r : results) {
      // No drafts in the timed steps (every request at its context limit): no rate to give.
      char acceptance[32];
      if (r.spec.num_draft_tokens > 0)
        std::snprintf(acceptance, sizeof acceptance, "%.1f%%", 100.0 * r.spec.acceptance_rate());
      else
        std::snprintf(acceptance, sizeof acceptance, "n/a");
      std::printf("%6lld %6lld %11.3f %14.3f %12.3f %11s %15.1f\n", static_cast<long long>(r.input_len),
                  static_cast<long long>(r.batch), r.decode_step_s * 1e3, r.target_step_s * 1e3, r.mtp_pass_s * 1e3,
                  acceptance, static_cast<double>(r.decode_tokens) / r.batch / std::max(r.decode_total_s, 1e-12));
    }
  }
  return 0;
}

}  // namespace nucleus::cli
