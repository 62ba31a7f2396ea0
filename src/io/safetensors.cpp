#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "io/regular_file.h"

namespace nucleus {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

Status parse_entry(const std::string& path, const std::string& name, const json& v, const uint8_t* data,
                   size_t data_bytes, TensorEntry* out) {
  auto bad = [&](const std::string& what) {
    return data_loss(path + ": tensor '" + name + "': " + what);
  };
  if (!v.is_object()) return bad("header entry is not an object");
  if (!v.contains("dtype") || !v["dtype"].is_string()) return bad("missing string field 'dtype'");
  if (!v.contains("shape") || !v["shape"].is_array()) return bad("missing array field 'shape'");
  if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
    return bad("missing field 'data_offsets' [begin, end]");
  auto dtype = parse_safetensors_dtype(v["dtype"].get<std::string>());
  if (!dtype.ok()) return bad(dtype.status().message());
  out->name = name;
  out->dtype = *dtype;
  out->file = path;
  out->shape.clear();
  for (const auto& d : v["shape"]) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0) return bad("shape holds a non-integer or negative dim");
    out->shape.push_back(d.get<int64_t>());
  }
  for (const auto& o : v["data_offsets"])
    if (!o.is_number_unsigned()) return bad("data_offsets must be non-negative integers");
  uint64_t begin = v["data_offsets"][0].get<uint64_t>(), end = v["data_offsets"][1].get<uint64_t>();
  if (begin > end) return bad("data_offsets begin " + std::to_string(begin) + " > end " + std::to_string(end));
  if (end > data_bytes)
    return bad("data_offsets end " + std::to_string(end) + " is past the end of the data (" +
               std::to_string(data_bytes) + " bytes; file truncated?)");
  // dtype x shape in bytes, refusing a shape whose element count or byte size
  // overflows (shape_numel would wrap, and a wrapped size can match the extent).
  const uint64_t max_numel = static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / dtype_size(out->dtype);
  uint64_t numel = 1;
  for (int64_t d : out->shape) {
    if (numel != 0 && static_cast<uint64_t>(d) > max_numel / numel)
      return bad("shape " + shape_to_string(out->shape) + " is too large (its byte size overflows 64 bits)");
    numel *= static_cast<uint64_t>(d);
  }
  uint64_t expect = numel * dtype_size(out->dtype);
  if (end - begin != expect)
    return bad("holds " + std::to_string(end - begin) + " bytes but " + dtype_name(out->dtype) + " x " +
               shape_to_string(out->shape) + " needs " + std::to_string(expect));
  out->data = data + begin;
  out->nbytes = end - begin;
  return ok_status();
}

// Two tensors whose byte ranges overlap would alias each other's data (an
// edit of one, or a writer bug, shows up as garbage in the other).
Status check_no_overlap(const std::string& path, const std::map<std::string, TensorEntry>& tensors) {
  std::vector<const TensorEntry*> by_offset;
  for (const auto& [name, e] : tensors)
    if (e.nbytes > 0) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorEntry* a, const TensorEntry* b) { return a->data < b->data; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorEntry& prev = *by_offset[i - 1];
    const TensorEntry& cur = *by_offset[i];
    if (prev.data + prev.nbytes > cur.data)
      return data_loss(path + ": tensors '" + prev.name + "' and '" + cur.name +
                       "' overlap: their data_offsets share " +
                       std::to_string(std::min(prev.data + prev.nbytes, cur.data + cur.nbytes) - cur.data) +
                       " bytes");
  }
  return ok_status();
}

}  // namespace

StatusOr<std::shared_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  NUCLEUS_ASSIGN_OR_RETURN(int fd, open_regular_file(path));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return data_loss(path + ": cannot stat: " + std::strerror(errno));
  }
  size_t file_bytes = static_cast<size_t>(st.st_size);
  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  if (file_bytes < 8) {
    ::close(fd);
    return data_loss(path + ": file is " + std::to_string(file_bytes) +
                     " bytes, shorter than the 8-byte header length (truncated?)");
  }
  void* m = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) return data_loss(path + ": mmap failed: " + std::strerror(errno));
  f->map_ = m;
  f->map_bytes_ = file_bytes;
  const auto* bytes = static_cast<const uint8_t*>(m);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(bytes[i]) << (8 * i);
  if (header_len > file_bytes - 8)
    return data_loss(path + ": header length " + std::to_string(header_len) + " is past the end of the " +
                     std::to_string(file_bytes) + "-byte file (truncated?)");
  json header = json::parse(bytes + 8, bytes + 8 + header_len, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object())
    return data_loss(path + ": header is not a JSON object");
  const uint8_t* data = bytes + 8 + header_len;
  size_t data_bytes = file_bytes - 8 - header_len;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") continue;
    TensorEntry e;
    NUCLEUS_RETURN_IF_ERROR(parse_entry(path, name, v, data, data_bytes, &e));
    f->tensors_.emplace(name, std::move(e));
  }
  NUCLEUS_RETURN_IF_ERROR(check_no_overlap(path, f->tensors_));
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_bytes_);
}

StatusOr<Checkpoint> Checkpoint::open(const std::string& dir) {
  Checkpoint ck;
  ck.dir_ = dir;
  if (!fs::is_directory(dir)) return not_found("model directory '" + dir + "' does not exist");
  fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  auto add_file = [&](const std::string& file) -> StatusOr<std::shared_ptr<SafetensorsFile>> {
    auto it = ck.owner_.find(file);
    if (it != ck.owner_.end()) return it->second;
    NUCLEUS_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open(file));
    ck.files_.push_back(f);
    ck.owner_[file] = f;
    return f;
  };
  if (fs::exists(index_path)) {
    NUCLEUS_ASSIGN_OR_RETURN(std::string index_text, read_regular_file(index_path.string()));
    json index = json::parse(index_text, nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
        !index["weight_map"].is_object())
      return data_loss(index_path.string() + ": not a JSON object with a 'weight_map' object");
    for (const auto& [name, file_json] : index["weight_map"].items()) {
      if (!file_json.is_string())
        return data_loss(index_path.string() + ": weight_map entry for '" + name + "' is not a file name");
      std::string file = (fs::path(dir) / file_json.get<std::string>()).string();
      if (!fs::exists(file))
        return not_found(index_path.string() + ": tensor '" + name + "' is in shard '" + file +
                         "', which does not exist");
      NUCLEUS_ASSIGN_OR_RETURN(auto f, add_file(file));
      auto t = f->tensors().find(name);
      if (t == f->tensors().end())
        return data_loss(file + ": tensor '" + name + "' is listed in the index but not in this shard");
      ck.entries_[name] = t->second;
    }
    // A tensor present in a shard but not in the index is unexpected; one in
    // two shards is ambiguous (which copy the writer meant is unknowable).
    for (const auto& f : ck.files_)
      for (const auto& [name, e] : f->tensors()) {
        auto listed = ck.entries_.find(name);
        if (listed == ck.entries_.end())
          return data_loss(f->path() + ": tensor '" + name + "' is not listed in " + index_path.string());
        if (listed->second.file != f->path())
          return data_loss("tensor '" + name + "' is in two shards, '" + listed->second.file + "' and '" +
                           f->path() + "' (" + index_path.string() + " lists the first)");
      }
  } else {
    std::vector<std::string> files;
    for (const auto& de : fs::directory_iterator(dir))
      if (de.path().extension() == ".safetensors") files.push_back(de.path().string());
    if (files.empty()) return not_found("model directory '" + dir + "' holds no *.safetensors file");
    if (files.size() > 1)
      return data_loss("model directory '" + dir + "' holds " + std::to_string(files.size()) +
                       " *.safetensors files but no model.safetensors.index.json");
    NUCLEUS_ASSIGN_OR_RETURN(auto f, add_file(files[0]));
    ck.entries_ = f->tensors();
  }
  return ck;
}

StatusOr<TensorEntry> Checkpoint::get(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) return not_found("checkpoint '" + dir_ + "' has no tensor '" + name + "'");
  return it->second;
}

Tensor Checkpoint::view(const TensorEntry& entry) const {
  auto it = owner_.find(entry.file);
  NUCLEUS_CHECK(it != owner_.end(), "tensor {} from unknown file {}", entry.name, entry.file);
  return Tensor::wrap(const_cast<uint8_t*>(entry.data), entry.shape, entry.dtype, Device::kCpu, it->second);
}

}  // namespace nucleus
