// Width builds, device-independent: the occupancy arithmetic, the refusal
// rules, the fused -> lean -> plain planner (strict mode, warnings, which
// builds it asks for), the build keys, and the on-disk cache (round trip,
// corrupt entries as misses, atomic writes, directory from the environment).
//
// The planner runs on recorded figures: what ptxas reports for
// src/jit/mla_front_kernel.cuh (nvcc 13.0.88, -arch=sm_90a,
// `nvcc -x cu -cubin -Xptxas -v -DNUCLEUS_WIDTH=W -DNUCLEUS_LEAN=0|1
// [-DNUCLEUS_MAX_REGS=N]`), registers and stack bytes per thread. The
// fused build spills from W = 224; the lean build (two kernels) never does
// without a register cap.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include "jit/kernel_cache.h"
#include "jit/width_build_policy.h"

namespace nucleus::width {
namespace {

constexpr int kSms = 132;

KernelFigures figures(const std::string& name, int regs, int64_t local, int64_t dyn_smem) {
  KernelFigures k;
  k.name = name;
  k.num_regs = regs;
  k.local_bytes = local;
  k.static_smem_bytes = 128;
  k.dynamic_smem_bytes = dyn_smem;
  k.threads_per_block = 256;
  k.blocks_needed = kSms;  // one persistent CTA per SM
  k.persistent = true;
  return k;
}

// ptxas figures of the fused build: width -> (registers, stack bytes).
const std::map<int64_t, std::pair<int, int64_t>> kFusedRecorded = {
    {1, {64, 0}},    {8, {63, 0}},     {32, {168, 0}},   {64, {166, 0}},   {128, {245, 0}},
    {192, {255, 0}}, {224, {255, 416}}, {256, {255, 608}}, {512, {255, 2912}}};

// A builder answering with recorded figures, recording what it was asked.
// fused_cap / lean_cap mimic NUCLEUS_WIDTH_MAXRREGCOUNT{,_LEAN}: figures
// recorded with -DNUCLEUS_MAX_REGS (fused W=32 at 64: 64 regs, 216 B; lean
// W=32 at 32: 32 regs, 40 B and 48 B).
class RecordedBuilder : public WidthBuilder {
 public:
  bool fused_cap64 = false, lean_cap32 = false;
  bool fail_fused = false;
  std::vector<std::pair<int64_t, BuildVariant>> asked;

  StatusOr<WidthBuild> build(int64_t w, BuildVariant v) override {
    asked.emplace_back(w, v);
    WidthBuild b;
    b.key.kernel = "mla_front";
    b.key.width = w;
    b.key.variant = v;
    b.key.arch = "sm_90a";
    b.key.compiler = "nvrtc-13.0";
    b.key.source_hash = 0x1234;
    if (v == BuildVariant::kFused) {
      if (fail_fused) return invalid_argument("nvrtc: error: expected a ';'");
      auto [regs, local] = kFusedRecorded.at(w);
      if (fused_cap64 && w >= 16) regs = 64, local = 216;
      b.kernels.push_back(figures("mla_front_fused", regs, local, w * 256));
    } else {
      const int64_t tile = std::min<int64_t>(w, 8);
      b.kernels.push_back(figures("mla_front_lean_a", lean_cap32 ? 32 : 62, lean_cap32 ? 40 : 0, 0));
      b.kernels.push_back(figures("mla_front_lean_b", lean_cap32 ? 32 : 54, lean_cap32 ? 48 : 0, tile * 256));
    }
    return b;
  }
};

struct Logs {
  std::vector<std::string> warn, info;
  WidthPlanOptions options(bool strict = false) {
    WidthPlanOptions o;
    o.strict = strict;
    o.warn = [this](const std::string& m) { warn.push_back(m); };
    o.info = [this](const std::string& m) { info.push_back(m); };
    return o;
  }
};

TEST(WidthOccupancy, RegisterSharedMemoryAndThreadLimits) {
  DeviceLimits d;
  // 255 registers round to 256 a thread: 8 warps x 8192 = the whole file.
  EXPECT_EQ(max_blocks_per_sm(figures("k", 255, 0, 0), d), 1);
  EXPECT_EQ(max_blocks_per_sm(figures("k", 168, 0, 0), d), 1);  // 5376 a warp -> 43008 a CTA
  EXPECT_EQ(max_blocks_per_sm(figures("k", 128, 0, 0), d), 2);
  EXPECT_EQ(max_blocks_per_sm(figures("k", 64, 0, 0), d), 4);
  EXPECT_EQ(max_blocks_per_sm(figures("k", 32, 0, 0), d), 8);  // threads: 2048 / 256
  KernelFigures tiny = figures("k", 16, 0, 0);
  tiny.threads_per_block = 32;
  EXPECT_EQ(max_blocks_per_sm(tiny, d), 32);  // the CTA-count limit
  // Shared memory: 128 KiB + 128 B + the 1 KiB reservation fits once in 228 KiB.
  EXPECT_EQ(max_blocks_per_sm(figures("k", 64, 0, 128 * 1024), d), 1);
  EXPECT_EQ(max_blocks_per_sm(figures("k", 64, 0, 50 * 1024), d), 4);  // 228 / 51.125
  EXPECT_EQ(max_blocks_per_sm(figures("k", 64, 0, 228 * 1024), d), 0);  // above the 227 KiB a CTA
  // The driver's answer wins when there is one.
  KernelFigures k = figures("k", 64, 0, 0);
  k.driver_max_blocks_per_sm = 3;
  EXPECT_EQ(max_blocks_per_sm(k, d), 3);
}

TEST(WidthOccupancy, RefusalsCarryTheFigures) {
  DeviceLimits d;
  EXPECT_FALSE(refusal_reason(figures("k", 255, 0, 0), d));
  auto spill = refusal_reason(figures("mla_front_fused", 255, 416, 224 * 256), d);
  ASSERT_TRUE(spill);
  EXPECT_NE(spill->find("mla_front_fused: 255 regs, 416 B local"), std::string::npos) << *spill;
  EXPECT_NE(spill->find("register spills"), std::string::npos) << *spill;
  KernelFigures two_per_sm = figures("k", 168, 0, 0);
  two_per_sm.blocks_needed = 2 * kSms;
  auto resident = refusal_reason(two_per_sm, d);
  ASSERT_TRUE(resident);
  EXPECT_NE(resident->find("not co-resident (264 CTAs > 132)"), std::string::npos) << *resident;
  two_per_sm.persistent = false;  // an ordinary kernel may run in waves
  EXPECT_FALSE(refusal_reason(two_per_sm, d));
  auto huge = refusal_reason(figures("k", 64, 0, 300 * 1024), d);
  ASSERT_TRUE(huge);
  EXPECT_NE(huge->find("cannot launch"), std::string::npos) << *huge;
}

TEST(WidthPlan, FusedWhereItFitsLeanWhereItSpillsNeverLeanOtherwise) {
  RecordedBuilder b;
  Logs logs;
  const std::vector<int64_t> widths = {1, 8, 32, 64, 128, 192, 224, 256, 512};
  auto plan = plan_widths(widths, b, logs.options());
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  ASSERT_EQ(plan->size(), widths.size());
  for (const WidthChoice& c : *plan) {
    const bool spills = kFusedRecorded.at(c.width).second > 0;
    EXPECT_EQ(c.served, spills ? BuildVariant::kLean : BuildVariant::kFused) << c.log_line();
    ASSERT_TRUE(c.build);
    EXPECT_EQ(c.build->key.variant, c.served);
    EXPECT_EQ(c.refusals.size(), spills ? 1u : 0u);
  }
  // Asked: every width fused; lean only for the three that spill, right after.
  std::vector<std::pair<int64_t, BuildVariant>> want;
  for (int64_t w : widths) {
    want.emplace_back(w, BuildVariant::kFused);
    if (w >= 224) want.emplace_back(w, BuildVariant::kLean);
  }
  EXPECT_EQ(b.asked, want);
  EXPECT_TRUE(logs.warn.empty());
  ASSERT_EQ(logs.info.size(), widths.size());  // one line per width: which build serves it
  EXPECT_EQ(logs.info[0].rfind("width 1: fused build mla_front-w1-fused-sm_90a-nvrtc-13.0-src", 0), 0u) << logs.info[0];
  EXPECT_NE(logs.info[6].find("width 224: lean build mla_front-w224-lean-"), std::string::npos) << logs.info[6];
  EXPECT_NE(logs.info[6].find("refused: fused mla_front_fused: 255 regs, 416 B local"), std::string::npos)
      << logs.info[6];
}

// NUCLEUS_WIDTH_BUILDS=lean: only the lean build is offered, so every width
// is served lean (the fused refusal recorded with its reason), none compiled fused.
TEST(WidthPlan, LeanOnlyBuilderServesLeanEverywhere) {
  RecordedBuilder b;
  OnlyVariantBuilder lean_only(b, BuildVariant::kLean, "NUCLEUS_WIDTH_BUILDS=lean");
  Logs logs;
  auto plan = plan_widths({1, 64, 256}, lean_only, logs.options());
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  for (const WidthChoice& c : *plan) {
    EXPECT_EQ(c.served, BuildVariant::kLean) << c.log_line();
    ASSERT_EQ(c.refusals.size(), 1u);
    EXPECT_NE(c.refusals[0].find("fused builds not asked for (NUCLEUS_WIDTH_BUILDS=lean)"), std::string::npos)
        << c.refusals[0];
  }
  for (const auto& [w, v] : b.asked) EXPECT_EQ(v, BuildVariant::kLean) << w;
  EXPECT_TRUE(logs.warn.empty());
}

TEST(WidthPlan, DebugRegisterCapForcesTheLeanRebuild) {
  RecordedBuilder b;
  b.fused_cap64 = true;
  Logs logs;
  auto plan = plan_widths({8, 32}, b, logs.options());
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ((*plan)[0].served, BuildVariant::kFused);  // 63 registers: the cap does not bite
  EXPECT_EQ((*plan)[1].served, BuildVariant::kLean);
  EXPECT_TRUE(logs.warn.empty());
}

TEST(WidthPlan, LeanSpillRunsThePlainPathWithAWarning) {
  RecordedBuilder b;
  b.fused_cap64 = b.lean_cap32 = true;
  Logs logs;
  auto plan = plan_widths({8, 32}, b, logs.options());
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ((*plan)[0].served, BuildVariant::kFused);
  const WidthChoice& c = (*plan)[1];
  EXPECT_EQ(c.served, BuildVariant::kPlain);
  EXPECT_FALSE(c.build);
  ASSERT_EQ(c.refusals.size(), 2u);
  EXPECT_NE(c.refusals[0].find("fused mla_front_fused: 64 regs, 216 B local"), std::string::npos) << c.refusals[0];
  EXPECT_NE(c.refusals[1].find("lean mla_front_lean_a: 32 regs, 40 B local"), std::string::npos) << c.refusals[1];
  ASSERT_EQ(logs.warn.size(), 1u);
  EXPECT_EQ(logs.warn[0].rfind("width 32 runs the plain path: fused mla_front_fused: 64 regs, 216 B local", 0), 0u)
      << logs.warn[0];
  EXPECT_NE(logs.warn[0].find("lean mla_front_lean_a: 32 regs, 40 B local"), std::string::npos) << logs.warn[0];
  EXPECT_NE(logs.info[1].find("width 32: plain"), std::string::npos) << logs.info[1];
}

TEST(WidthPlan, StrictModeMakesThePlainPathAnError) {
  RecordedBuilder b;
  b.fused_cap64 = b.lean_cap32 = true;
  Logs logs;
  auto plan = plan_widths({8, 32, 64}, b, logs.options(/*strict=*/true));
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kFailedPrecondition);
  const std::string m = plan.status().message();
  EXPECT_EQ(m.rfind("width 32 has no width build (NUCLEUS_STRICT_WIDTHS=1", 0), 0u) << m;
  EXPECT_NE(m.find("216 B local"), std::string::npos) << m;
  EXPECT_NE(m.find("lean mla_front_lean_a: 32 regs, 40 B local"), std::string::npos) << m;  // the first refused kernel
  // Strict with every width served is no error.
  RecordedBuilder ok_builder;
  EXPECT_TRUE(plan_widths({8, 256}, ok_builder, logs.options(true)).ok());
}

TEST(WidthPlan, AFailedBuildIsARefusal) {
  RecordedBuilder b;
  b.fail_fused = true;
  Logs logs;
  auto plan = plan_widths({8}, b, logs.options());
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ((*plan)[0].served, BuildVariant::kLean);
  EXPECT_NE((*plan)[0].refusals[0].find("fused build failed: nvrtc: error"), std::string::npos);
}

TEST(WidthPlan, StrictFromEnvironment) {
  ::unsetenv("NUCLEUS_STRICT_WIDTHS");
  EXPECT_FALSE(strict_widths_from_env());
  ::setenv("NUCLEUS_STRICT_WIDTHS", "1", 1);
  EXPECT_TRUE(strict_widths_from_env());
  ::setenv("NUCLEUS_STRICT_WIDTHS", "0", 1);
  EXPECT_FALSE(strict_widths_from_env());
  ::unsetenv("NUCLEUS_STRICT_WIDTHS");
}

TEST(WidthPlan, WidthBuildsModeFromEnvironment) {
  ::unsetenv("NUCLEUS_WIDTH_BUILDS");
  EXPECT_EQ(*width_builds_mode_from_env(), WidthBuildsMode::kOff);
  const std::map<std::string, WidthBuildsMode> ok = {
      {"0", WidthBuildsMode::kOff}, {"1", WidthBuildsMode::kOn}, {"lean", WidthBuildsMode::kLeanOnly}};
  for (const auto& [value, mode] : ok) {
    ::setenv("NUCLEUS_WIDTH_BUILDS", value.c_str(), 1);
    auto m = width_builds_mode_from_env();
    ASSERT_TRUE(m.ok()) << value;
    EXPECT_EQ(*m, mode) << value;
    EXPECT_EQ(width_builds_mode_name(mode), value);
  }
  ::setenv("NUCLEUS_WIDTH_BUILDS", "fused", 1);
  auto bad = width_builds_mode_from_env();
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'fused'"), std::string::npos) << bad.status().message();
  ::unsetenv("NUCLEUS_WIDTH_BUILDS");
}

BuildKey key(int64_t w, BuildVariant v) {
  BuildKey k;
  k.kernel = "mla_front";
  k.source_hash = hash_text("source");
  k.width = w;
  k.variant = v;
  k.arch = "sm_90a";
  k.compiler = "nvrtc-13.0";
  k.options_hash = hash_text("");
  return k;
}

TEST(WidthBuildKey, EveryFieldChangesTheKey) {
  const BuildKey base = key(32, BuildVariant::kFused);
  EXPECT_EQ(base.to_string(), key(32, BuildVariant::kFused).to_string());
  EXPECT_NE(base.to_string(), key(32, BuildVariant::kLean).to_string());  // never a lean build for a fused one
  EXPECT_NE(base.to_string(), key(48, BuildVariant::kFused).to_string());
  auto changed = [&](auto edit) {
    BuildKey k = base;
    edit(k);
    return k.to_string() != base.to_string();
  };
  EXPECT_TRUE(changed([](BuildKey& k) { k.source_hash = hash_text("source2"); }));
  EXPECT_TRUE(changed([](BuildKey& k) { k.arch = "sm_100a"; }));
  EXPECT_TRUE(changed([](BuildKey& k) { k.compiler = "nvrtc-13.1"; }));
  EXPECT_TRUE(changed([](BuildKey& k) { k.options_hash = hash_text("-DNUCLEUS_MAX_REGS=64"); }));
  EXPECT_EQ(base.to_string().find('/'), std::string::npos);
  EXPECT_EQ(base.to_string().rfind("mla_front-w32-fused-sm_90a-nvrtc-13.0-src", 0), 0u) << base.to_string();
}

class KernelCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() /
            ("nucleus_kcache_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  CachedBuild entry() {
    CachedBuild b;
    b.kernels = {figures("mla_front_lean_a", 62, 0, 0), figures("mla_front_lean_b", 54, 0, 2048)};
    b.binary = {'\x7f', 'E', 'L', 'F', '\0', '\1', '\2'};
    return b;
  }
  std::string dir_;
};

TEST_F(KernelCacheTest, RoundTripAndNoTemporaryLeft) {
  KernelCache cache(dir_ + "/sub");  // created on first store
  const BuildKey k = key(32, BuildVariant::kLean);
  EXPECT_FALSE(cache.load(k));
  ASSERT_TRUE(cache.store(k, entry()).ok());
  auto got = cache.load(k);
  ASSERT_TRUE(got);
  EXPECT_EQ(got->binary, entry().binary);
  ASSERT_EQ(got->kernels.size(), 2u);
  EXPECT_EQ(got->kernels[1].name, "mla_front_lean_b");
  EXPECT_EQ(got->kernels[1].num_regs, 54);
  EXPECT_EQ(got->kernels[1].dynamic_smem_bytes, 2048);
  EXPECT_TRUE(got->kernels[1].persistent);
  // The fused build of the same width is another entry.
  EXPECT_FALSE(cache.load(key(32, BuildVariant::kFused)));
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_ + "/sub")) {
    ++files;
    EXPECT_EQ(e.path().extension(), ".nwb") << e.path();
  }
  EXPECT_EQ(files, 1);
  // Storing again replaces the entry whole.
  CachedBuild other = entry();
  other.binary.push_back('x');
  ASSERT_TRUE(cache.store(k, other).ok());
  EXPECT_EQ(cache.load(k)->binary, other.binary);
}

TEST_F(KernelCacheTest, CheckWritableBeforeCompiling) {
  EXPECT_TRUE(KernelCache(dir_ + "/new/sub").check_writable().ok());  // created
  EXPECT_TRUE(std::filesystem::is_directory(dir_ + "/new/sub"));
  EXPECT_TRUE(std::filesystem::is_empty(dir_ + "/new/sub")) << "the probe file is left behind";
  std::ofstream(dir_ + "/a_file") << "x";
  Status s = KernelCache(dir_ + "/a_file").check_writable();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(dir_ + "/a_file"), std::string::npos) << s.message();
  EXPECT_FALSE(KernelCache(dir_ + "/a_file/sub").check_writable().ok());
  EXPECT_FALSE(KernelCache("").check_writable().ok());
}

TEST_F(KernelCacheTest, CorruptEntriesAreMisses) {
  KernelCache cache(dir_);
  const BuildKey k = key(8, BuildVariant::kFused);
  ASSERT_TRUE(cache.store(k, entry()).ok());
  const std::string path = cache.path_for(k);
  std::string bytes;
  {
    std::ifstream f(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  auto write = [&](const std::string& p, const std::string& s) {
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f.write(s.data(), static_cast<std::streamsize>(s.size()));
  };
  write(path, bytes.substr(0, bytes.size() - 3));  // truncated
  EXPECT_FALSE(cache.load(k));
  std::string flipped = bytes;
  flipped[bytes.size() / 2] ^= 0x40;  // one bit in the middle
  write(path, flipped);
  EXPECT_FALSE(cache.load(k));
  std::string magic = bytes;
  magic[0] = 'X';
  write(path, magic);
  EXPECT_FALSE(cache.load(k));
  write(path, "");
  EXPECT_FALSE(cache.load(k));
  // A whole entry of another key copied under this key's name.
  write(path, bytes);
  ASSERT_TRUE(cache.load(k));
  const BuildKey lean = key(8, BuildVariant::kLean);
  write(cache.path_for(lean), bytes);
  EXPECT_FALSE(cache.load(lean));
  // A miss is rewritten by the next store.
  ASSERT_TRUE(cache.store(lean, entry()).ok());
  EXPECT_TRUE(cache.load(lean));
}

TEST_F(KernelCacheTest, DisabledAndDirectoryFromEnvironment) {
  KernelCache off("");
  EXPECT_FALSE(off.enabled());
  EXPECT_TRUE(off.store(key(1, BuildVariant::kFused), entry()).ok());
  EXPECT_FALSE(off.load(key(1, BuildVariant::kFused)));
  const char* home = std::getenv("HOME");
  const std::string saved_home = home ? home : "";
  ::setenv("NUCLEUS_KERNEL_CACHE_DIR", "/x/y", 1);
  EXPECT_EQ(KernelCache::dir_from_env(), "/x/y");
  ::setenv("NUCLEUS_KERNEL_CACHE_DIR", "", 1);
  EXPECT_EQ(KernelCache::dir_from_env(), "");  // set and empty: off
  ::unsetenv("NUCLEUS_KERNEL_CACHE_DIR");
  ::setenv("XDG_CACHE_HOME", "/xdg", 1);
  EXPECT_EQ(KernelCache::dir_from_env(), "/xdg/nucleus/kernels");
  ::unsetenv("XDG_CACHE_HOME");
  ::setenv("HOME", "/home/u", 1);
  EXPECT_EQ(KernelCache::dir_from_env(), "/home/u/.cache/nucleus/kernels");
  if (home) ::setenv("HOME", saved_home.c_str(), 1);
}

TEST_F(KernelCacheTest, UnwritableDirectoryIsAnErrorNotACrash) {
  std::filesystem::create_directories(dir_);
  { std::ofstream(dir_ + "/file") << "x"; }
  KernelCache cache(dir_ + "/file/sub");  // a file where a directory should be
  Status s = cache.store(key(1, BuildVariant::kFused), entry());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("NUCLEUS_KERNEL_CACHE_DIR"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace nucleus::width
