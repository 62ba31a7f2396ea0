#include "jit/kernel_cache.h"

#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "core/knobs.h"
#include "core/logging.h"

namespace nucleus::width {
namespace {

constexpr char kMagic[8] = {'N', 'U', 'C', 'W', 'B', '0', '0', '1'};

void put_u64(std::string& s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

bool get_u64(const std::string& s, size_t& pos, uint64_t& v) {
  if (pos + 8 > s.size()) return false;
  v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(s[pos + i])) << (8 * i);
  pos += 8;
  return true;
}

nlohmann::json figures_json(const KernelFigures& k) {
  return {{"name", k.name},
          {"num_regs", k.num_regs},
          {"local_bytes", k.local_bytes},
          {"static_smem_bytes", k.static_smem_bytes},
          {"dynamic_smem_bytes", k.dynamic_smem_bytes},
          {"threads_per_block", k.threads_per_block},
          {"blocks_needed", k.blocks_needed},
          {"persistent", k.persistent}};
}

KernelFigures figures_from_json(const nlohmann::json& j) {
  KernelFigures k;
  k.name = j.at("name").get<std::string>();
  k.num_regs = j.at("num_regs").get<int>();
  k.local_bytes = j.at("local_bytes").get<int64_t>();
  k.static_smem_bytes = j.at("static_smem_bytes").get<int64_t>();
  k.dynamic_smem_bytes = j.at("dynamic_smem_bytes").get<int64_t>();
  k.threads_per_block = j.at("threads_per_block").get<int>();
  k.blocks_needed = j.at("blocks_needed").get<int64_t>();
  k.persistent = j.at("persistent").get<bool>();
  return k;
}

}  // namespace

std::string KernelCache::dir_from_env() {
  if (auto d = env_string(Knob::kKernelCacheDir)) return *d;
  if (auto x = foreign_env("XDG_CACHE_HOME"); x && !x->empty()) return *x + "/nucleus/kernels";
  if (auto h = foreign_env("HOME"); h && !h->empty()) return *h + "/.cache/nucleus/kernels";
  return "";
}

std::string KernelCache::path_for(const BuildKey& key) const { return dir_ + "/" + key.to_string() + ".nwb"; }

std::optional<CachedBuild> KernelCache::load(const BuildKey& key) const {
  if (!enabled()) return std::nullopt;
  const std::string path = path_for(key);
  std::ifstream f(path, std::ios::binary);
  if (!f) return std::nullopt;
  const std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto corrupt = [&](const char* why) -> std::optional<CachedBuild> {
    NUCLEUS_LOG_DEBUG("width build cache: {} is corrupt ({}), treated as a miss", path, why);
    return std::nullopt;
  };
  if (s.size() < 8 + 8 + 8 + 8 || std::memcmp(s.data(), kMagic, 8) != 0) return corrupt("bad header");
  const size_t body = s.size() - 8;
  size_t tail = body;
  uint64_t sum = 0;
  get_u64(s, tail, sum);
  if (XXH64(s.data(), body, 0) != sum) return corrupt("checksum mismatch");
  size_t pos = 8;
  uint64_t meta_len = 0, bin_len = 0;
  if (!get_u64(s, pos, meta_len) || meta_len > body - pos) return corrupt("truncated metadata");
  const std::string meta = s.substr(pos, meta_len);
  pos += meta_len;
  if (!get_u64(s, pos, bin_len) || bin_len != body - pos) return corrupt("truncated binary");
  CachedBuild out;
  try {
    const nlohmann::json j = nlohmann::json::parse(meta);
    if (j.at("key").get<std::string>() != key.to_string()) return corrupt("key mismatch");
    for (const auto& k : j.at("kernels")) out.kernels.push_back(figures_from_json(k));
  } catch (const std::exception& e) {
    return corrupt("bad metadata");
  }
  if (out.kernels.empty() || bin_len == 0) return corrupt("empty entry");
  out.binary.assign(s.begin() + static_cast<std::ptrdiff_t>(pos), s.begin() + static_cast<std::ptrdiff_t>(body));
  return out;
}

Status KernelCache::store(const BuildKey& key, const CachedBuild& build) const {
  if (!enabled()) return ok_status();
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) return invalid_argument("width build cache: cannot create " + dir_ + ": " + ec.message() +
                                  " (set NUCLEUS_KERNEL_CACHE_DIR to a writable directory, or empty to disable)");
  nlohmann::json j;
  j["key"] = key.to_string();
  j["kernels"] = nlohmann::json::array();
  for (const KernelFigures& k : build.kernels) j["kernels"].push_back(figures_json(k));
  const std::string meta = j.dump();
  std::string s(kMagic, 8);
  put_u64(s, meta.size());
  s += meta;
  put_u64(s, build.binary.size());
  s.append(build.binary.data(), build.binary.size());
  put_u64(s, XXH64(s.data(), s.size(), 0));
  // A temporary name unique to this process and call, then an atomic rename:
  // a reader sees the old entry, no entry, or the whole new one.
  static std::atomic<uint64_t> counter{0};
  const std::string final_path = path_for(key);
  const std::string tmp = final_path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(s.data(), static_cast<std::streamsize>(s.size()));
    f.flush();
    if (!f) {
      fs::remove(tmp, ec);
      return invalid_argument("width build cache: cannot write " + tmp);
    }
  }
  fs::rename(tmp, final_path, ec);
  if (ec) {
    const std::string why = ec.message();
    fs::remove(tmp, ec);
    return invalid_argument("width build cache: cannot rename into " + final_path + ": " + why);
  }
  return ok_status();
}

Status KernelCache::check_writable() const {
  namespace fs = std::filesystem;
  if (dir_.empty()) return invalid_argument("width build cache: no directory (caching is off)");
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec || !fs::is_directory(dir_))
    return invalid_argument("width build cache: cannot create the directory " + dir_ +
                            (ec ? ": " + ec.message() : std::string(": not a directory")));
  const std::string probe = dir_ + "/.probe." + std::to_string(::getpid());
  {
    std::ofstream f(probe, std::ios::binary | std::ios::trunc);
    f << "probe";
    if (!f) {
      fs::remove(probe, ec);
      return invalid_argument("width build cache: cannot write in " + dir_);
    }
  }
  fs::rename(probe, probe + ".renamed", ec);
  const bool renamed = !ec;
  fs::remove(probe, ec);
  fs::remove(probe + ".renamed", ec);
  if (!renamed) return invalid_argument("width build cache: cannot rename files in " + dir_);
  return ok_status();
}

}  // namespace nucleus::width
