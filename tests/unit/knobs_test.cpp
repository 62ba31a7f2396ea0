// The NUCLEUS_* switch registry (core/knobs.h): its typed parsing, and a scan of
// the source tree (NUCLEUS_SOURCE_DIR, from CMake) that fails when src/ names a
// switch the registry lacks, reads one with getenv, or when a registered switch
// has no reader or other readers than its row lists; docs/flags.md's table must
// name exactly the registered switches.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/knobs.h"
#include "test_util.h"

#ifndef NUCLEUS_SOURCE_DIR
#error "NUCLEUS_SOURCE_DIR (the source tree, a compile definition of nucleus_lib) must be defined"
#endif

namespace nucleus {
namespace {

namespace fs = std::filesystem;

const fs::path kRoot = NUCLEUS_SOURCE_DIR;

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool is_word(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// One NUCLEUS_[A-Z0-9_]+ token of a text, with its offset.
struct Token {
  std::string name;
  size_t pos;
};

std::vector<Token> nucleus_tokens(const std::string& text) {
  static const std::string kPrefix = "NUCLEUS_";
  std::vector<Token> out;
  for (size_t i = text.find(kPrefix); i != std::string::npos; i = text.find(kPrefix, i + 1)) {
    if (i > 0 && is_word(text[i - 1])) continue;
    size_t j = i + kPrefix.size();
    while (j < text.size() && (std::isupper(static_cast<unsigned char>(text[j])) ||
                               std::isdigit(static_cast<unsigned char>(text[j])) || text[j] == '_'))
      ++j;
    if (j == i + kPrefix.size() || (j < text.size() && is_word(text[j]))) continue;  // "NUCLEUS_*", "NUCLEUS_x"
    out.push_back({text.substr(i, j - i), i});
  }
  return out;
}

int line_of(const std::string& text, size_t pos) {
  return 1 + static_cast<int>(std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(pos), '\n'));
}

// The line containing `pos`, without leading blanks.
std::string line_at(const std::string& text, size_t pos) {
  const size_t b = text.rfind('\n', pos) == std::string::npos ? 0 : text.rfind('\n', pos) + 1;
  const size_t e = text.find('\n', pos);
  std::string line = text.substr(b, e == std::string::npos ? std::string::npos : e - b);
  return line.substr(std::min(line.find_first_not_of(" \t"), line.size()));
}

std::vector<fs::path> files_under(const fs::path& dir, const std::set<std::string>& exts) {
  std::vector<fs::path> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file() && exts.count(e.path().extension().string())) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<fs::path> source_files() { return files_under(kRoot / "src", {".h", ".cpp", ".cu", ".cuh"}); }

std::vector<fs::path> cmake_files() {
  std::vector<fs::path> out = {kRoot / "CMakeLists.txt"};
  for (const char* dir : {"cmake", "src", "tests", "bench"})
    if (fs::exists(kRoot / dir))
      for (const auto& e : fs::recursive_directory_iterator(kRoot / dir))
        if (e.is_regular_file() &&
            (e.path().filename() == "CMakeLists.txt" || e.path().extension() == ".cmake"))
          out.push_back(e.path());
  return out;
}

// NUCLEUS_* names that are build-time names, not environment switches: macros
// (#define), compile definitions tested by the preprocessor or passed as -D
// (NVRTC options included), CMake options, cache variables and compile definitions.
std::set<std::string> build_time_names() {
  std::set<std::string> out;
  for (const fs::path& p : source_files()) {
    const std::string text = read_text(p);
    for (const Token& t : nucleus_tokens(text)) {
      const std::string line = line_at(text, t.pos);
      const bool directive = !line.empty() && line[0] == '#' && line.find("#include") != 0;
      if (directive || (t.pos >= 2 && text.compare(t.pos - 2, 2, "-D") == 0)) out.insert(t.name);
    }
  }
  for (const fs::path& p : cmake_files()) {
    const std::string text = read_text(p);
    // Spans of target_compile_definitions(...) and add_compile_definitions(...).
    std::vector<std::pair<size_t, size_t>> defs;
    for (const char* call : {"target_compile_definitions(", "add_compile_definitions("})
      for (size_t i = text.find(call); i != std::string::npos; i = text.find(call, i + 1)) {
        int depth = 0;
        size_t j = i + std::string(call).size() - 1;
        for (; j < text.size(); ++j) {
          if (text[j] == '(') ++depth;
          if (text[j] == ')' && --depth == 0) break;
        }
        defs.push_back({i, j});
      }
    for (const Token& t : nucleus_tokens(text)) {
      const size_t open = text.rfind('(', t.pos);
      const std::string before = open == std::string::npos ? "" : text.substr(0, open);
      const bool declared = open != std::string::npos && text.find_first_not_of(" \t", open + 1) == t.pos &&
                            (before.ends_with("option") || before.ends_with("set"));
      bool in_defs = false;
      for (auto [b, e] : defs) in_defs |= t.pos > b && t.pos < e;
      if (declared || in_defs || (t.pos >= 2 && text.compare(t.pos - 2, 2, "-D") == 0)) out.insert(t.name);
    }
  }
  return out;
}

std::set<std::string> registered_names() {
  std::set<std::string> out;
  for (const KnobInfo& k : all_knobs()) out.insert(k.name);
  return out;
}

std::string source_relative(const fs::path& p) { return fs::relative(p, kRoot).generic_string(); }

std::set<std::string> split_readers(const std::string& s) {
  std::set<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item.erase(0, item.find_first_not_of(' '));
    if (!item.empty()) out.insert(item);
  }
  return out;
}

// Sets a variable for one scope, restoring what was there.
using ScopedEnv = testing::ScopedEnvValue;

TEST(KnobsTest, RegistryRowsAreComplete) {
  std::set<std::string> names;
  for (const KnobInfo& k : all_knobs()) {
    SCOPED_TRACE(k.name);
    EXPECT_TRUE(std::string(k.name).starts_with("NUCLEUS_"));
    EXPECT_TRUE(names.insert(k.name).second) << "registered twice";
    EXPECT_STREQ(knob_name(k.knob), k.name);
    EXPECT_EQ(&knob_info(k.knob), &k);
    EXPECT_NE(*k.doc, '\0');
    EXPECT_NE(*k.default_value, '\0');
    EXPECT_NE(*k.readers, '\0');
    if (k.type == KnobType::kEnum || k.type == KnobType::kInt || k.type == KnobType::kList) {
      EXPECT_NE(*k.values, '\0') << "an enum, int or list switch names its values";
    }
    if (k.type == KnobType::kFlag) {
      EXPECT_STREQ(k.values, "") << "a flag's values are the flag spellings";
    }
  }
  EXPECT_EQ(all_knobs().size(), static_cast<size_t>(Knob::kCount));
}

TEST(KnobsTest, ParseFlagSpellings) {
  for (const char* s : {"1", "true", "TRUE", "True", "yes", "YES", "on", "On"}) EXPECT_TRUE(parse_flag(s)) << s;
  for (const char* s : {"0", "false", "no", "off", "", "2", "enable", " 1", "1 ", "y"}) EXPECT_FALSE(parse_flag(s)) << s;
}

TEST(KnobsTest, ParseIntWholeStringOnly) {
  EXPECT_EQ(parse_int("42"), 42);
  EXPECT_EQ(parse_int("-3"), -3);
  EXPECT_EQ(parse_int("+7"), 7);
  EXPECT_EQ(parse_int("65536"), 65536);
  EXPECT_EQ(parse_int("0x7e", 0), 0x7e);
  EXPECT_EQ(parse_int("0x7e"), std::nullopt);  // base 10: "0" then "x7e"
  EXPECT_EQ(parse_int("010", 0), 8);
  EXPECT_EQ(parse_int("010"), 10);
  EXPECT_EQ(parse_int(""), std::nullopt);
  EXPECT_EQ(parse_int("12a"), std::nullopt);
  EXPECT_EQ(parse_int("1.5"), std::nullopt);
  EXPECT_EQ(parse_int("abc"), std::nullopt);
  EXPECT_EQ(parse_int("7 "), std::nullopt);
  EXPECT_EQ(parse_int(" 7"), 7);  // strtoll skips leading blanks, as the sites did
}

TEST(KnobsTest, EnvFlagDefaultsAndSpellings) {
  {
    ScopedEnv e("NUCLEUS_DUMP_GRAPH", nullptr);
    EXPECT_FALSE(env_flag(Knob::kDumpGraph));
  }
  {
    ScopedEnv e("NUCLEUS_DUMP_GRAPH", "Yes");
    EXPECT_TRUE(env_flag(Knob::kDumpGraph));
  }
  {
    ScopedEnv e("NUCLEUS_DUMP_GRAPH", "2");
    EXPECT_FALSE(env_flag(Knob::kDumpGraph));
  }
  // Default-on flags: unset is on; set, only the true spellings are on.
  for (Knob k : {Knob::kFuseAllreduceNorm, Knob::kMlaPrefillWgmma}) {
    SCOPED_TRACE(knob_name(k));
    {
      ScopedEnv e(knob_name(k), nullptr);
      EXPECT_TRUE(env_flag(k));
    }
    for (const char* off : {"0", "", "off", "false"}) {
      ScopedEnv e(knob_name(k), off);
      EXPECT_FALSE(env_flag(k)) << "'" << off << "'";
    }
    {
      ScopedEnv e(knob_name(k), "ON");
      EXPECT_TRUE(env_flag(k));
    }
  }
}

// A set flag must hold a flag spelling; anything else (which env_flag reads
// as off, even for a default-on flag) is refused, naming the switch.
TEST(KnobsTest, FlagEnvStatusRefusesNonFlagValues) {
  {
    ScopedEnv e("NUCLEUS_MOE_FP8_REGISTER_DEQUANT", nullptr);
    EXPECT_TRUE(flag_env_status().ok());
  }
  for (const char* ok : {"1", "0", "", "On", "OFF", "yes", "No", "true", "False"}) {
    ScopedEnv e("NUCLEUS_MOE_FP8_REGISTER_DEQUANT", ok);
    EXPECT_TRUE(flag_env_status().ok()) << "'" << ok << "'";
  }
  for (const char* bad : {"2", "enable", " 1"}) {
    ScopedEnv e("NUCLEUS_MOE_FP8_REGISTER_DEQUANT", bad);
    const Status s = flag_env_status();
    EXPECT_FALSE(s.ok()) << "'" << bad << "'";
    EXPECT_NE(s.message().find(std::string("NUCLEUS_MOE_FP8_REGISTER_DEQUANT='") + bad + "'"), std::string::npos)
        << s.message();
  }
}

TEST(KnobsTest, EnvAutoSwitchSpellings) {
  const Knob k = Knob::kMlaDecodeSmallGemms;
  {
    ScopedEnv e(knob_name(k), nullptr);
    EXPECT_EQ(env_auto_switch(k), AutoSwitch::kAuto);
  }
  for (const char* v : {"", "auto", "AUTO"}) {
    ScopedEnv e(knob_name(k), v);
    EXPECT_EQ(env_auto_switch(k), AutoSwitch::kAuto) << "'" << v << "'";
  }
  for (const char* v : {"0", "off", "False"}) {
    ScopedEnv e(knob_name(k), v);
    EXPECT_EQ(env_auto_switch(k), AutoSwitch::kOff) << "'" << v << "'";
  }
  for (const char* v : {"1", "ON", "true"}) {
    ScopedEnv e(knob_name(k), v);
    EXPECT_EQ(env_auto_switch(k), AutoSwitch::kOn) << "'" << v << "'";
  }
  for (const char* v : {"2", "yes", " 1"}) {
    ScopedEnv e(knob_name(k), v);
    EXPECT_EQ(env_auto_switch(k), std::nullopt) << "'" << v << "'";
  }
}

TEST(KnobsTest, EnvStringSetEmptyAndUnset) {
  {
    ScopedEnv e("NUCLEUS_KERNEL_CACHE_DIR", nullptr);
    EXPECT_EQ(env_string(Knob::kKernelCacheDir), std::nullopt);
  }
  {
    ScopedEnv e("NUCLEUS_KERNEL_CACHE_DIR", "");
    EXPECT_EQ(env_string(Knob::kKernelCacheDir), std::string());
  }
  {
    ScopedEnv e("NUCLEUS_KERNEL_CACHE_DIR", "/x/y");
    EXPECT_EQ(env_string(Knob::kKernelCacheDir), std::string("/x/y"));
  }
  ScopedEnv e("XDG_CACHE_HOME", "/xdg");
  EXPECT_EQ(foreign_env("XDG_CACHE_HOME"), std::string("/xdg"));
}

TEST(KnobsDeathTest, MisusesStop) {
  EXPECT_DEATH(env_flag(Knob::kSplitK), "NUCLEUS_SPLITK is a enum, not a flag");
  EXPECT_DEATH(foreign_env("NUCLEUS_SPLITK"), "register it in core/knobs.cpp");
}

TEST(KnobsTest, HelpTextListsEverySwitch) {
  const std::string help = knobs_help_text();
  // The header says what flag_env_status does with a value that is no flag spelling.
  EXPECT_NE(help.find("any other value is refused at start-up"), std::string::npos) << help.substr(0, 200);
  for (const KnobInfo& k : all_knobs()) {
    SCOPED_TRACE(k.name);
    const size_t at = help.find(std::string(k.name) + "  ");
    ASSERT_NE(at, std::string::npos);
    const std::string line = help.substr(at, help.find('\n', at) - at);
    EXPECT_NE(line.find(std::string("  ") + knob_type_name(k.type)), std::string::npos) << line;
    EXPECT_NE(line.find(std::string("default: ") + k.default_value), std::string::npos) << line;
    EXPECT_NE(help.find(k.doc), std::string::npos);
  }
}

// Every NUCLEUS_* name in src/ is a registered switch or a build-time name.
TEST(KnobsTest, EveryNameInSrcIsRegistered) {
  const std::set<std::string> registered = registered_names();
  const std::set<std::string> build = build_time_names();
  ASSERT_TRUE(build.count("NUCLEUS_HAVE_CUDA")) << "the scan of build-time names found nothing";
  std::map<std::string, std::string> unregistered;  // name -> first file:line
  for (const fs::path& p : source_files()) {
    const std::string text = read_text(p);
    for (const Token& t : nucleus_tokens(text))
      if (!registered.count(t.name) && !build.count(t.name) && !unregistered.count(t.name))
        unregistered[t.name] = source_relative(p) + ":" + std::to_string(line_of(text, t.pos));
  }
  for (const auto& [name, where] : unregistered)
    ADD_FAILURE() << name << " (" << where
                  << ") is named in src/ but is not a registered switch: add a row to core/knobs.cpp "
                     "and read it through its Knob";
  for (const std::string& name : registered)
    EXPECT_FALSE(build.count(name)) << name << " is registered and also a build-time name";
}

// Switches are read through their Knob only; getenv of a NUCLEUS_* name is refused.
TEST(KnobsTest, NoDirectGetenvOfSwitches) {
  for (const fs::path& p : source_files()) {
    if (source_relative(p) == "src/core/knobs.cpp") continue;
    const std::string text = read_text(p);
    for (const char* call : {"getenv(\"NUCLEUS_", "secure_getenv(\"NUCLEUS_"}) {
      const size_t at = text.find(call);
      EXPECT_EQ(at, std::string::npos) << source_relative(p) << ":" << line_of(text, at) << " reads a switch with getenv; use "
                                       << "env_string / env_flag of its Knob";
    }
  }
}

// Each registered switch is read, by exactly the files its row lists.
TEST(KnobsTest, EverySwitchHasItsListedReaders) {
  std::vector<std::pair<std::string, std::string>> texts;
  for (const fs::path& p : source_files()) {
    const std::string rel = source_relative(p);
    if (rel != "src/core/knobs.h" && rel != "src/core/knobs.cpp") texts.push_back({rel, read_text(p)});
  }
  for (const KnobInfo& k : all_knobs()) {
    SCOPED_TRACE(k.name);
    const std::string use = std::string("Knob::") + k.id;
    std::set<std::string> readers;
    for (const auto& [rel, text] : texts)
      for (size_t i = text.find(use); i != std::string::npos; i = text.find(use, i + 1))
        if (i + use.size() >= text.size() || !is_word(text[i + use.size()])) readers.insert(rel);
    EXPECT_FALSE(readers.empty()) << k.name << " is registered but nothing in src/ reads " << use
                                  << ": remove its row";
    EXPECT_EQ(readers, split_readers(k.readers)) << "the readers column of " << k.name << " in core/knobs.cpp";
    if (k.type == KnobType::kFlag) continue;
    for (const auto& [rel, text] : texts)  // env_flag stops (NUCLEUS_CHECK) on a switch that is not a flag
      EXPECT_EQ(text.find("env_flag(" + use + ")"), std::string::npos)
          << rel << " reads " << k.name << " (" << knob_type_name(k.type) << ") as a flag";
  }
}

// docs/flags.md's switch table names exactly the registered switches.
TEST(KnobsTest, FlagsDocMatchesRegistry) {
  const std::string doc = read_text(kRoot / "docs" / "flags.md");
  ASSERT_FALSE(doc.empty());
  std::set<std::string> documented;
  std::stringstream ss(doc);
  std::string line;
  while (std::getline(ss, line))
    if (line.starts_with("| `NUCLEUS_")) {
      const auto toks = nucleus_tokens(line);
      ASSERT_FALSE(toks.empty()) << line;
      documented.insert(toks.front().name);
    }
  EXPECT_EQ(documented, registered_names());
  EXPECT_NE(doc.find("nucleus --help-env"), std::string::npos);
}

// An unknown NUCLEUS_* variable is listed (the CLI warns about it), with the
// registry name a typo of it is nearest to; registry names and the test
// harness's variables are not listed.
TEST(KnobsTest, UnknownEnvSwitchesNameTheNearestSwitch) {
  ScopedEnv typo("NUCLEUS_FUSE_KV_A_NROM", "0");
  ScopedEnv far("NUCLEUS_NO_SUCH_THING_AT_ALL", "1");
  ScopedEnv known("NUCLEUS_MOE_DEEP_RING", "0");
  ScopedEnv harness("NUCLEUS_MODELS_DIR", "/tmp");
  const std::vector<UnknownEnvSwitch> u = unknown_env_switches();
  std::map<std::string, std::string> got;
  for (const UnknownEnvSwitch& s : u) got[s.name] = s.nearest;
  ASSERT_EQ(got.count("NUCLEUS_FUSE_KV_A_NROM"), 1u);
  EXPECT_EQ(got["NUCLEUS_FUSE_KV_A_NROM"], "NUCLEUS_FUSE_KV_A_NORM");
  ASSERT_EQ(got.count("NUCLEUS_NO_SUCH_THING_AT_ALL"), 1u);
  EXPECT_EQ(got["NUCLEUS_NO_SUCH_THING_AT_ALL"], "") << "nothing within 3 edits";
  EXPECT_EQ(got.count("NUCLEUS_MOE_DEEP_RING"), 0u);
  EXPECT_EQ(got.count("NUCLEUS_MODELS_DIR"), 0u);
  EXPECT_TRUE(std::is_sorted(u.begin(), u.end(), [](const auto& a, const auto& b) { return a.name < b.name; }));
}

}  // namespace
}  // namespace nucleus
