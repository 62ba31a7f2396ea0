// The on-disk cache of width builds: one file per BuildKey holding the
// compiled binary (cubin) and the figures of its kernels, so a restart loads
// instead of recompiling. Entries are written atomically (a temporary file in
// the same directory, then rename), and an entry that cannot be read whole (a
// bad header, a truncated file, a checksum or key mismatch) is a miss, never
// an error: the build is compiled again and the entry rewritten.
//
// File layout (little-endian): "NUCWB001" | u64 meta length | meta JSON
// ({"key": ..., "kernels": [{figures}...]}) | u64 binary length | binary |
// u64 XXH64 of everything before it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "jit/width_build_policy.h"

namespace nucleus::width {

struct CachedBuild {
  std::vector<KernelFigures> kernels;  // as stored (driver_max_blocks_per_sm is not stored)
  std::vector<char> binary;            // cubin bytes
};

class KernelCache {
 public:
  // dir empty: caching off (lookups miss, stores do nothing).
  explicit KernelCache(std::string dir) : dir_(std::move(dir)) {}

  // The directory from NUCLEUS_KERNEL_CACHE_DIR (set but empty: caching off),
  // else $XDG_CACHE_HOME/nucleus/kernels, else $HOME/.cache/nucleus/kernels,
  // else off.
  static std::string dir_from_env();

  const std::string& dir() const { return dir_; }
  bool enabled() const { return !dir_.empty(); }
  std::string path_for(const BuildKey& key) const;  // <dir>/<key.to_string()>.nwb

  // The entry for key, or nullopt (absent, unreadable or corrupt; a corrupt
  // entry is logged at debug level).
  std::optional<CachedBuild> load(const BuildKey& key) const;
  // Writes the entry atomically (creating the directory). Errors: the
  // directory or file cannot be written (the caller may log and go on).
  Status store(const BuildKey& key, const CachedBuild& build) const;
  // Creates the directory and writes, renames and removes a probe file in
  // it: whether store() can work, asked before compiling anything. Errors
  // (kInvalidArgument naming the directory): caching off, or the directory
  // cannot be created or written.
  Status check_writable() const;

 private:
  std::string dir_;
};

}  // namespace nucleus::width
