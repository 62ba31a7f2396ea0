// Test helpers for checkpoints: safetensors files written byte by byte
// (well-formed or corrupt on purpose), and copies of the shipped tiny models
// that a test rewrites shard by shard.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "model/weights.h"
#include "test_util.h"

namespace nucleus::testing {

namespace fs = std::filesystem;
using nlohmann::json;

inline std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// Replaces `path` (which may be a read-only copy) with `bytes`.
inline void write_file(const std::string& path, const std::string& bytes) {
  std::error_code ec;
  fs::remove(path, ec);
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// A raw safetensors file: 8-byte LE header length, header text, data.
inline std::string raw_safetensors(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

struct StTensor {
  std::string name;
  std::string dtype;  // safetensors spelling
  std::vector<int64_t> shape;
  std::string bytes;
};

// A well-formed file holding `tensors` back to back, in the given order.
inline std::string safetensors_bytes(const std::vector<StTensor>& tensors) {
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  std::string data;
  for (const auto& t : tensors) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  return raw_safetensors(header.dump(), data);
}

inline std::string f32_bytes(const std::vector<float>& v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), v.data(), s.size());
  return s;
}

inline std::string bf16_bytes(const std::vector<float>& v) {
  std::string s(v.size() * 2, '\0');
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t h = f32_to_bf16(v[i]);
    std::memcpy(s.data() + 2 * i, &h, 2);
  }
  return s;
}

// Passes when `s` is an error whose message holds every one of `parts`.
template <typename S>
::testing::AssertionResult error_mentions(const S& s, std::initializer_list<std::string> parts) {
  if (s.ok()) return ::testing::AssertionFailure() << "expected an error, got OK";
  const std::string m = s.status().message();  // status() returns a copy
  for (const auto& p : parts)
    if (m.find(p) == std::string::npos)
      return ::testing::AssertionFailure() << "message does not mention '" << p << "': " << s.status().to_string();
  return ::testing::AssertionSuccess() << s.status().to_string();
}

// A copy of a shipped tiny model that a test may rewrite shard by shard.
class ModelCopy {
 public:
  explicit ModelCopy(const std::string& model) {
    dir_ = testing::make_temp_dir("nucleus_model_");
    for (const auto& de : fs::directory_iterator(testing::model_path(model)))
      fs::copy_file(de.path(), fs::path(dir_) / de.path().filename());
    std::ifstream in(dir_ + "/model.safetensors.index.json");
    index_ = json::parse(in);
  }
  const std::string& dir() const { return dir_; }
  std::string shard_of(const std::string& tensor) const {
    return dir_ + "/" + index_["weight_map"][tensor].get<std::string>();
  }

  // Reads the shard holding `tensor` with the project's SafetensorsFile,
  // lets `edit` change its tensor list, and writes the shard and the index
  // back (tensors edit adds are listed in the index under this shard;
  // tensors it drops are removed from it).
  void edit_shard_of(const std::string& tensor, const std::function<void(std::vector<StTensor>&)>& edit) {
    const std::string file = index_["weight_map"][tensor].get<std::string>();
    const std::string shard = dir_ + "/" + file;
    std::vector<StTensor> ts;
    {
      auto f = SafetensorsFile::open(shard);
      ASSERT_TRUE(f.ok()) << f.status().to_string();
      for (const auto& [name, e] : (*f)->tensors())
        ts.push_back({name, dtype_name(e.dtype), e.shape, std::string(reinterpret_cast<const char*>(e.data), e.nbytes)});
    }
    edit(ts);
    write_file(shard, safetensors_bytes(ts));
    json& map = index_["weight_map"];
    std::vector<std::string> dropped;
    for (const auto& [name, f] : map.items())
      if (f == file) dropped.push_back(name);
    for (const auto& name : dropped) map.erase(name);
    for (const auto& t : ts) map[t.name] = file;
    write_file(dir_ + "/model.safetensors.index.json", index_.dump(2));
  }

 private:
  std::string dir_;
  json index_;
};

inline StTensor* find(std::vector<StTensor>& ts, const std::string& name) {
  for (auto& t : ts)
    if (t.name == name) return &t;
  ADD_FAILURE() << "no tensor " << name;
  return nullptr;
}

inline void drop(std::vector<StTensor>& ts, const std::string& name) {
  for (size_t i = 0; i < ts.size(); ++i)
    if (ts[i].name == name) {
      ts.erase(ts.begin() + static_cast<std::ptrdiff_t>(i));
      return;
    }
  ADD_FAILURE() << "no tensor " << name;
}

// load_weights on `dir` with the config at `config_path` (default: dir's own).
// check_values: LoadOptions::check_values.
inline StatusOr<ModelWeights> load_dir(const std::string& dir, const std::string& config_path = "",
                                       bool check_values = true) {
  auto config = load_model_config(config_path.empty() ? dir + "/config.json" : config_path);
  if (!config.ok()) return config.status();
  auto ckpt = Checkpoint::open(dir);
  if (!ckpt.ok()) return ckpt.status();
  auto backend = make_cpu_weight_backend();
  LoadOptions options;
  options.show_progress = false;
  options.check_values = check_values;
  return load_weights(*ckpt, *config, *backend, options);
}

}  // namespace nucleus::testing
