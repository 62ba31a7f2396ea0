// The NUCLEUS_* environment switches ("knobs"): one registry (core/knobs.cpp)
// holds each switch's name, type, default, one-line doc and the files that read
// it; `nucleus --help-env` prints it and docs/flags.md follows it.
//
// A switch is read only through its Knob: env_string(Knob::kSplitK),
// env_flag(Knob::kDumpGraph). A name that is not registered has no Knob, so it
// cannot be read through here; foreign_env reads other variables (HOME, ...)
// and refuses NUCLEUS_* names. tests/unit/knobs_test.cpp fails when src/ names
// a NUCLEUS_* variable the registry lacks, reads one with getenv, or when a
// registered switch has no reader.
//
// Each reading site keeps its own validation and error message (several
// switches are refused at start-up with a message naming the value).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace nucleus {

// One value per NUCLEUS_* switch, in the registry's order (kCount last).
enum class Knob {
  kLogLevel,
  kCpuThreads,
  kCudaPoisonAllocs,
  kEnablePrezero,
  kPrezeroIdleBytesPerSm,
  kSplitK,
  kSplitKDeterministic,
  kSkinny,
  kSkinnyFp8,
  kSkinnyFp8Pipeline,
  kSkinnyFp8Stream,
  kPdl,
  kForceKernel,
  kDumpGraph,
  kProfileOps,
  kGraphEagerPad,
  kTokenGraphSizes,
  kTokenGraphEagerPad,
  kMultiTokenDecode,
  kMtpDeviceHidden,
  kMlaPrefillWgmma,
  kMoeChunkTokens,
  kMoeDecode,
  kMoeFp8RegisterDequant,
  kMoeUpSplitK,
  kMoeDeepRing,
  kMoeAlignFree,
  kMoeRouteRegs,
  kMoeCombinePrefetch,
  kMoeFuseShared,
  kMoeCombineNorm,
  kMoeUpStream,
  kMoeWgmma,
  kMoeFp8W8a8,
  kPackedUpload,
  kMlaDecodeSmallGemms,
  kMlaDecodeSplitKeys,
  kMlaDecodeCtasPerSm,
  kMlaDecodeKeyTile,
  kMlaDecodeBulkLoads,
  kMlaDecodeFp8RegisterConvert,
  kMlaDecodeWgmma,
  kFuseKvANorm,
  kDecodePrograms,
  kDecodeProgramJoin,
  kDecodeProgramAbsorb,
  kDecodeProgramAttnOutput,
  kDecodeProgramMaxRows,
  kDecodeProgramAttention,
  kDecodeProgramDense,
  kDecodeProgramLean,
  kDecodeProgramRelease,
  kWidthBuilds,
  kWidthCooperative,
  kStrictWidths,
  kKernelCacheDir,
  kWidthMaxrregcount,
  kWidthMaxrregcountLean,
  kFuseAllreduceNorm,
  kFusedAllreduceMaxBytes,
  kNcclLibrary,
  kFaultInject,
  kCount
};

// How a switch's value is spelled.
enum class KnobType {
  kFlag,    // env_flag rules: 1/true/yes/on (any case) set, anything else not
  kInt,     // an integer (range in KnobInfo::values)
  kString,  // free text (a path, a fault plan)
  kList,    // comma-separated items (form in KnobInfo::values)
  kEnum,    // one of KnobInfo::values
};

// One registry row.
struct KnobInfo {
  Knob knob;
  const char* id;             // the enumerator's name ("kSplitK"), for the source scan
  const char* name;           // "NUCLEUS_SPLITK"
  KnobType type;
  const char* values;         // enum: the accepted values; int: the range; list: the item form; else ""
  const char* default_value;  // the behaviour when unset; flags: "0" or "1"
  const char* doc;            // one line
  const char* readers;        // the src/ files that read it, comma-separated
};

// The registry, in Knob order.
std::span<const KnobInfo> all_knobs();
const KnobInfo& knob_info(Knob k);
// "NUCLEUS_..." of `k`.
const char* knob_name(Knob k);
// "flag", "int", "string", "list", "enum".
const char* knob_type_name(KnobType t);

// The variable's value, or nullopt when unset (set and empty: "").
std::optional<std::string> env_string(Knob k);
// A kFlag switch (a NUCLEUS_CHECK otherwise): unset gives the registry default;
// set, parse_flag of the value (so set and empty is false, even for a default-on flag;
// a value that is no flag spelling is refused at model creation: flag_env_status).
bool env_flag(Knob k);
// A variable that is not a NUCLEUS_* switch (HOME, XDG_CACHE_HOME, ...); a
// NUCLEUS_* name is a NUCLEUS_CHECK failure (read it through its Knob).
std::optional<std::string> foreign_env(const char* name);

// "1", "true", "yes", "on" (any case) are true; everything else ("0", "", "off", "2") false.
bool parse_flag(std::string_view text);
// A three-way switch (kEnum "auto, 0, 1"): unset, "" or "auto" is kAuto;
// "0", "off", "false" kOff; "1", "on", "true" kOn (any case); nullopt for
// any other value (the reader refuses it at start-up).
enum class AutoSwitch { kAuto, kOff, kOn };
std::optional<AutoSwitch> env_auto_switch(Knob k);
// OK when env_auto_switch(k) reads the value; otherwise invalid_argument
// naming it ("NUCLEUS_MOE_DEEP_RING='2' is not auto, 0 (off, false) or 1 (on, true)"),
// for the start-up checks that refuse a malformed three-way switch.
Status auto_switch_env_status(Knob k);

// OK when every kFlag switch that is set holds a flag spelling: "1", "true",
// "yes", "on", "0", "false", "no", "off" (any case) or "" (off). Otherwise
// invalid_argument naming the first that does not (NUCLEUS_DUMP_GRAPH='2', say),
// which env_flag would silently read as off: models refuse to start with one.
Status flag_env_status();
// Whether `text` is a flag value: "1", "true", "yes", "on", "0", "false", "no",
// "off" (any case) or "".
bool flag_value_ok(std::string_view text);
// The whole of `text` as an integer in `base` (strtoll rules: leading blanks and a
// sign are accepted, 0 base takes 0x/0 prefixes); nullopt when empty, when
// anything follows the digits, or when the value is outside int64.
std::optional<int64_t> parse_int(std::string_view text, int base = 10);
// OK when knob k is unset or an integer in [lo, hi] (parse_int in `base`),
// else invalid_argument naming the variable, its value and `expected` (the
// accepted values in words). For integer switches whose readers run late
// (at a kernel's first launch, CUDA only): checked at model creation.
Status int_knob_env_status(Knob k, int64_t lo, int64_t hi, const char* expected, int base = 10);

// The registry as a text table (name, type, default, doc), for `nucleus --help-env`.
std::string knobs_help_text();

// NUCLEUS_* variables set in the environment that are no switch of the
// registry and none of the test harness's (the prefix followed by BIN,
// MODELS_DIR, PY_VENV or LM_EVAL_VENV: read by tests, not by the engine),
// sorted by name, each with the registry name nearest to it when that is at
// most 3 single-character edits away (a likely typo: ..._KV_A_NROM for the
// switch ..._KV_A_NORM), else "". The engine ignores such a variable; the CLI
// warns about each one at start-up (as vLLM does for unknown VLLM_* names).
struct UnknownEnvSwitch {
  std::string name;
  std::string nearest;
};
std::vector<UnknownEnvSwitch> unknown_env_switches();

}  // namespace nucleus
