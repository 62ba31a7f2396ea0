// Safetensors checkpoints: one file, or shards listed by
// model.safetensors.index.json ({"weight_map": {tensor: file}}).
// Files are memory-mapped; tensors are views into the mapping.
//
// File format (https://github.com/huggingface/safetensors): 8-byte
// little-endian header length N, N bytes of JSON
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]},
//  "__metadata__": {...}}, then the data; offsets are relative to the byte
// after the header.
//
// Every defect is reported at open time with the file and tensor it concerns:
// a path that is not a regular file (a FIFO, device or directory: refused
// before any read, never blocking), a file shorter than its header, a header
// that is not JSON, an unknown dtype, offsets past the end of the data, a
// byte size that disagrees with dtype x shape, two tensors whose bytes
// overlap, an index naming a missing file or a tensor its shard lacks, a
// tensor in two shards (naming both).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "core/tensor.h"

namespace nucleus {

// One tensor of a checkpoint: metadata and a pointer into the mapped file.
struct TensorEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // into the mapping; valid while the file is open
  size_t nbytes = 0;
  std::string file;  // path of the shard that holds it
};

// One memory-mapped .safetensors file.
class SafetensorsFile {
 public:
  // Maps `path` and validates its header and every tensor's extent.
  static StatusOr<std::shared_ptr<SafetensorsFile>> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorEntry>& tensors() const { return tensors_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  std::map<std::string, TensorEntry> tensors_;
};

// All tensors of a checkpoint directory (sharded or not).
class Checkpoint {
 public:
  // Opens `dir`/model.safetensors.index.json if present, else the one
  // `dir`/*.safetensors file (several without an index is an error).
  static StatusOr<Checkpoint> open(const std::string& dir);

  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  // The entry, or kNotFound naming the tensor and the directory.
  StatusOr<TensorEntry> get(const std::string& name) const;
  const std::map<std::string, TensorEntry>& entries() const { return entries_; }
  const std::string& dir() const { return dir_; }

  // A CPU tensor viewing the mapped bytes (no copy); keeps the file mapped.
  Tensor view(const TensorEntry& entry) const;

 private:
  std::string dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorEntry> entries_;
  std::map<std::string, std::shared_ptr<SafetensorsFile>> owner_;  // file path -> file
};

}  // namespace nucleus
