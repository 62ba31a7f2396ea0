#include "ops/skinny.h"

#include <algorithm>
#include <cctype>
#include <string>

#include "core/knobs.h"

namespace nucleus {

namespace {

constexpr int64_t kMaxRows = 8;  // kernels::kSkinnyMaxRows (the kernel header is CUDA-only)

// -1: malformed.
int parse_switch_value(Knob knob) {
  const auto v = env_auto_switch(knob);
  return v ? static_cast<int>(*v) : -1;
}

int parse_fp8_switch() {
  static const int v = parse_switch_value(Knob::kSkinnyFp8);
  return v;
}

// -1: malformed.
int parse_switch() {
  static const int v = parse_switch_value(Knob::kSkinny);
  return v;
}

// -1: malformed.
int parse_pdl() {
  static const int v = [] {
    auto s = env_string(Knob::kPdl);
    if (!s || s->empty() || *s == "1") return 1;
    if (*s == "0") return 0;
    if (*s == "gemms") return 2;
    return -1;
  }();
  return v;
}

int parse_fp8_pipeline() {
  static const int v = parse_switch_value(Knob::kSkinnyFp8Pipeline);
  return v;
}

int parse_fp8_stream() {
  static const int v = parse_switch_value(Knob::kSkinnyFp8Stream);
  return v;
}

}  // namespace

SkinnySwitch skinny_fp8_pipeline_switch() {
  const int v = parse_fp8_pipeline();
  return v < 0 ? SkinnySwitch::kOff : static_cast<SkinnySwitch>(v);
}

SkinnySwitch skinny_fp8_stream_switch() {
  const int v = parse_fp8_stream();
  return v < 0 ? SkinnySwitch::kOff : static_cast<SkinnySwitch>(v);
}

SkinnySwitch skinny_switch() {
  const int v = parse_switch();
  return v < 0 ? SkinnySwitch::kOff : static_cast<SkinnySwitch>(v);
}

Status skinny_env_status() {
  if (parse_switch() < 0)
    return invalid_argument("NUCLEUS_SKINNY='" + *env_string(Knob::kSkinny) + "' is not auto, 0 or 1");
  if (parse_fp8_switch() < 0)
    return invalid_argument("NUCLEUS_SKINNY_FP8='" + *env_string(Knob::kSkinnyFp8) + "' is not auto, 0 or 1");
  if (parse_pdl() < 0) return invalid_argument("NUCLEUS_PDL='" + *env_string(Knob::kPdl) + "' is not 0, 1 or gemms");
  if (parse_fp8_pipeline() < 0)
    return invalid_argument("NUCLEUS_SKINNY_FP8_PIPELINE='" + *env_string(Knob::kSkinnyFp8Pipeline) +
                            "' is not auto, 0 or 1");
  if (parse_fp8_stream() < 0)
    return invalid_argument("NUCLEUS_SKINNY_FP8_STREAM='" + *env_string(Knob::kSkinnyFp8Stream) +
                            "' is not auto, 0 or 1");
  return ok_status();
}

bool skinny_pdl() { return parse_pdl() == 1 || parse_pdl() == 2; }

bool small_ops_pdl() { return parse_pdl() == 1; }

SkinnySwitch skinny_fp8_switch() {
  const int v = parse_fp8_switch();
  return v < 0 ? SkinnySwitch::kOff : static_cast<SkinnySwitch>(v);
}

int64_t skinny_fp8_max_rows(int64_t n, int64_t k) {
  if (n < 1 || k < 128 || k % 128 != 0) return 0;
  switch (skinny_fp8_switch()) {
    case SkinnySwitch::kOff: return 0;
    case SkinnySwitch::kOn: return kSkinnyFp8MaxRows;
    case SkinnySwitch::kAuto: break;
  }
  const int64_t bytes = n * k;  // e4m3: one byte an element (the measurements are in ops/skinny.h)
  if (bytes <= kSkinnyFp8SmallWeightBytes) return kSkinnyFp8MaxRows;
  if (bytes <= kSkinnyFp8MediumWeightBytes) return 8;
  return skinny_fp8_stream_switch() == SkinnySwitch::kOff ? 0 : kSkinnyFp8StreamRows;
}

bool skinny_fp8_stream(int64_t m, int64_t n, int64_t k) {
  switch (skinny_fp8_stream_switch()) {
    case SkinnySwitch::kOff: return false;
    case SkinnySwitch::kOn: return m <= 2;  // kernels::kSkinnyFp8StreamMaxRows
    case SkinnySwitch::kAuto: break;
  }
  return m == 1 && n * k >= kSkinnyFp8StreamMinBytes && skinny_fp8_max_rows(n, k) >= 1;
}

int64_t skinny_max_rows(int64_t n, int64_t k) {
  switch (skinny_switch()) {
    case SkinnySwitch::kOff: return 0;
    case SkinnySwitch::kOn: return kMaxRows;
    case SkinnySwitch::kAuto: break;
  }
  const int64_t bytes = n * k * 2;
  if (n <= 1024) return k <= 2048 ? kMaxRows : 4;                     // kv_a, routers, TP 8 shared gate_up
  if (n <= 2048) return k <= 4096 ? 4 : 2;                             // V2-Lite o_proj, shared down; q_a
  if (n <= 4096) return 2;                                             // V2-Lite q_proj, TP 8 q_b, V3 shared gate_up
  if (bytes >= kSkinnyLargeWeightBytes) return 2;                      // lm_head
  if (n <= 8192 && bytes <= kSkinnyMediumWeightBytes) return 1;        // V3 shared down, TP 8 o_proj
  return 0;
}

}  // namespace nucleus
