// The checkpoint loader's errors: malformed safetensors files, sharded
// checkpoints whose index disagrees with its shards, and checkpoints that do
// not match the model config (load_weights). Every error must name the file
// and the tensor (or the problem) it concerns.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "checkpoint_files.h"
#include "model/weights.h"
#include "test_util.h"

namespace nucleus {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace nucleus::testing;  // checkpoint_files.h

// ---------------------------------------------------------------- SafetensorsFile

class SafetensorsFileTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::make_temp_dir("nucleus_st_"); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  // Writes `bytes` to a fresh file and opens it.
  StatusOr<std::shared_ptr<SafetensorsFile>> open_bytes(const std::string& name, const std::string& bytes) {
    write_file(path(name), bytes);
    return SafetensorsFile::open(path(name));
  }
  std::string dir_;
};

TEST_F(SafetensorsFileTest, ValidFileReadsBack) {
  auto f = open_bytes("ok.safetensors", safetensors_bytes({{"a", "F32", {2, 2}, f32_bytes({1.5f, -2.0f, 3.25f, 0.0f})},
                                                           {"b", "BF16", {3}, bf16_bytes({1.0f, -0.5f, 256.0f})},
                                                           {"empty", "F32", {0, 4}, ""}}));
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  const auto& ts = (*f)->tensors();
  ASSERT_EQ(ts.size(), 3u);  // __metadata__ is not a tensor
  const TensorEntry& a = ts.at("a");
  EXPECT_EQ(a.dtype, DType::kF32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(a.nbytes, 16u);
  EXPECT_EQ(a.file, path("ok.safetensors"));
  float av[4];
  std::memcpy(av, a.data, 16);
  EXPECT_EQ(av[0], 1.5f);
  EXPECT_EQ(av[1], -2.0f);
  EXPECT_EQ(av[2], 3.25f);
  EXPECT_EQ(av[3], 0.0f);
  const TensorEntry& b = ts.at("b");
  EXPECT_EQ(b.dtype, DType::kBF16);
  uint16_t bv[3];
  std::memcpy(bv, b.data, 6);
  EXPECT_EQ(bf16_to_f32(bv[0]), 1.0f);
  EXPECT_EQ(bf16_to_f32(bv[1]), -0.5f);
  EXPECT_EQ(bf16_to_f32(bv[2]), 256.0f);
  EXPECT_EQ(ts.at("empty").nbytes, 0u);
}

TEST_F(SafetensorsFileTest, HeaderPaddedWithSpacesIsValid) {
  // The reference writer pads the header with spaces to an 8-byte multiple.
  std::string header = R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  header.append(8 - header.size() % 8, ' ');
  auto f = open_bytes("padded.safetensors", raw_safetensors(header, f32_bytes({7.0f})));
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ((*f)->tensors().count("x"), 1u);
}

TEST_F(SafetensorsFileTest, MissingFile) {
  auto f = SafetensorsFile::open(path("nope.safetensors"));
  EXPECT_TRUE(error_mentions(f, {path("nope.safetensors")}));
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound);
}

TEST_F(SafetensorsFileTest, TruncatedShard) {
  std::string bytes = safetensors_bytes({{"first", "F32", {4}, f32_bytes({1, 2, 3, 4})},
                                         {"last", "F32", {2, 3}, f32_bytes({1, 2, 3, 4, 5, 6})}});
  bytes.resize(bytes.size() - 5);  // data now ends 5 bytes before "last" does
  auto f = open_bytes("trunc.safetensors", bytes);
  EXPECT_TRUE(error_mentions(f, {path("trunc.safetensors"), "'last'", "past the end", "truncated"}));
  EXPECT_EQ(f.status().code(), StatusCode::kDataLoss);
}

TEST_F(SafetensorsFileTest, ShorterThanEightBytes) {
  for (size_t n : {0, 1, 5, 7}) {
    auto f = open_bytes("short.safetensors", std::string(n, '\x01'));
    EXPECT_TRUE(error_mentions(f, {path("short.safetensors"), std::to_string(n) + " bytes", "8-byte"})) << n;
    EXPECT_EQ(f.status().code(), StatusCode::kDataLoss);
  }
}

TEST_F(SafetensorsFileTest, HeaderLengthPastEndOfFile) {
  std::string header = R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  auto f = open_bytes("hlen.safetensors", le64(1000) + header + f32_bytes({1.0f}));
  EXPECT_TRUE(error_mentions(f, {path("hlen.safetensors"), "header length 1000", "past the end"}));
  // A header length whose addition to 8 would overflow 64 bits.
  auto g = open_bytes("hlen2.safetensors", le64(~uint64_t{0}) + header);
  EXPECT_TRUE(error_mentions(g, {path("hlen2.safetensors"), "header length"}));
  // Only the 8 length bytes, claiming a non-empty header.
  auto h = open_bytes("hlen3.safetensors", le64(1));
  EXPECT_TRUE(error_mentions(h, {path("hlen3.safetensors"), "header length 1"}));
}

TEST_F(SafetensorsFileTest, HeaderNotJson) {
  auto f = open_bytes("notjson.safetensors", raw_safetensors("{\"x\": {\"dtype\": ", "abcd"));
  EXPECT_TRUE(error_mentions(f, {path("notjson.safetensors"), "not a JSON object"}));
  EXPECT_EQ(f.status().code(), StatusCode::kDataLoss);
  auto g = open_bytes("array.safetensors", raw_safetensors("[1, 2, 3]", ""));
  EXPECT_TRUE(error_mentions(g, {path("array.safetensors"), "not a JSON object"}));
  auto h = open_bytes("binary.safetensors", raw_safetensors(std::string("\x00\xff\x10garbage", 10), ""));
  EXPECT_TRUE(error_mentions(h, {path("binary.safetensors"), "not a JSON object"}));
}

TEST_F(SafetensorsFileTest, UnknownDtype) {
  auto f = open_bytes("dtype.safetensors",
                      raw_safetensors(R"({"w":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,2]}})", "ab"));
  EXPECT_TRUE(error_mentions(f, {path("dtype.safetensors"), "'w'", "'Q4_K'"}));
}

TEST_F(SafetensorsFileTest, MalformedEntries) {
  struct Case {
    const char* entry;
    const char* expect;
  };
  const Case cases[] = {
      {R"("oops")", "not an object"},
      {R"({"shape":[1],"data_offsets":[0,4]})", "'dtype'"},
      {R"({"dtype":"F32","data_offsets":[0,4]})", "'shape'"},
      {R"({"dtype":"F32","shape":[1]})", "'data_offsets'"},
      {R"({"dtype":"F32","shape":[1],"data_offsets":[0]})", "'data_offsets'"},
      {R"({"dtype":"F32","shape":[-1],"data_offsets":[0,4]})", "negative"},
      {R"({"dtype":"F32","shape":[1.5],"data_offsets":[0,4]})", "non-integer"},
      {R"({"dtype":"F32","shape":[1],"data_offsets":[-4,4]})", "non-negative"},
  };
  for (const auto& c : cases) {
    auto f = open_bytes("entry.safetensors", raw_safetensors(std::string(R"({"t":)") + c.entry + "}", "abcd"));
    EXPECT_TRUE(error_mentions(f, {path("entry.safetensors"), "'t'", c.expect})) << c.entry;
  }
}

TEST_F(SafetensorsFileTest, DataOffsetsPastTheEnd) {
  auto f = open_bytes("past.safetensors",
                      raw_safetensors(R"({"ok":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                      R"("bad":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                                      f32_bytes({1, 2, 3, 4})));
  EXPECT_TRUE(error_mentions(f, {path("past.safetensors"), "'bad'", "end 24", "16 bytes"}));
}

TEST_F(SafetensorsFileTest, DataOffsetsBeginAfterEnd) {
  auto f = open_bytes("order.safetensors",
                      raw_safetensors(R"({"rev":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})",
                                      f32_bytes({1, 2, 3})));
  EXPECT_TRUE(error_mentions(f, {path("order.safetensors"), "'rev'", "begin 8 > end 4"}));
}

TEST_F(SafetensorsFileTest, ByteSizeDisagreesWithDtypeTimesShape) {
  auto f = open_bytes("size.safetensors",
                      raw_safetensors(R"({"m":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})",
                                      std::string(24, '\0')));
  EXPECT_TRUE(error_mentions(f, {path("size.safetensors"), "'m'", "20 bytes", "F32 x [2, 3]", "24"}));
  auto g = open_bytes("size2.safetensors",
                      raw_safetensors(R"({"h":{"dtype":"BF16","shape":[3],"data_offsets":[0,12]}})",
                                      std::string(12, '\0')));
  EXPECT_TRUE(error_mentions(g, {path("size2.safetensors"), "'h'", "12 bytes", "BF16 x [3]", "needs 6"}));
}

TEST_F(SafetensorsFileTest, ShapeWhoseByteSizeOverflows) {
  // 2^32 x 2^32 F32 elements wrap to 0 bytes in 64-bit arithmetic; an empty
  // extent must not pass for it.
  auto f = open_bytes("huge.safetensors",
                      raw_safetensors(R"({"huge":{"dtype":"F32","shape":[4294967296,4294967296],)"
                                      R"("data_offsets":[0,0]}})",
                                      ""));
  EXPECT_TRUE(error_mentions(f, {path("huge.safetensors"), "'huge'", "too large"}));
  auto g = open_bytes("huge2.safetensors",
                      raw_safetensors(R"({"huge":{"dtype":"I64","shape":[2305843009213693952],)"
                                      R"("data_offsets":[0,0]}})",
                                      ""));
  EXPECT_TRUE(error_mentions(g, {path("huge2.safetensors"), "'huge'", "too large"}));
  // A zero dim first makes any later dims harmless: an empty tensor.
  auto h = open_bytes("empty.safetensors",
                      raw_safetensors(R"({"e":{"dtype":"F32","shape":[0,4294967296],"data_offsets":[0,0]}})", ""));
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  EXPECT_EQ((*h)->tensors().at("e").nbytes, 0u);
}

// ---------------------------------------------------------------- Checkpoint (index and shards)

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::make_temp_dir("nucleus_ckpt_"); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  void write_index(const json& weight_map) {
    json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}};
    write_file(path("model.safetensors.index.json"), index.dump(2));
  }
  // Two shards: a and b in shard 1, c in shard 2.
  void write_two_shards() {
    write_file(path("model-00001-of-00002.safetensors"),
               safetensors_bytes({{"a", "F32", {2, 2}, f32_bytes({1.5f, -2.0f, 3.25f, 0.125f})},
                                  {"b", "BF16", {3}, bf16_bytes({1.0f, -0.5f, 256.0f})}}));
    write_file(path("model-00002-of-00002.safetensors"),
               safetensors_bytes({{"c", "F32", {3}, f32_bytes({-7.0f, 0.0f, 1e-3f})}}));
  }
  json two_shard_map() const {
    return {{"a", "model-00001-of-00002.safetensors"},
            {"b", "model-00001-of-00002.safetensors"},
            {"c", "model-00002-of-00002.safetensors"}};
  }
  std::string dir_;
};

TEST_F(CheckpointTest, ValidTwoShardCheckpoint) {
  write_two_shards();
  write_index(two_shard_map());
  auto ck = Checkpoint::open(dir_);
  ASSERT_TRUE(ck.ok()) << ck.status().to_string();
  EXPECT_EQ(ck->entries().size(), 3u);
  EXPECT_TRUE(ck->contains("a"));
  EXPECT_FALSE(ck->contains("d"));
  auto a = ck->get("a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->file, path("model-00001-of-00002.safetensors"));
  Tensor ta = ck->view(*a);
  EXPECT_EQ(ta.shape(), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(ta.dtype(), DType::kF32);
  EXPECT_EQ(ta.data<float>()[0], 1.5f);
  EXPECT_EQ(ta.data<float>()[1], -2.0f);
  EXPECT_EQ(ta.data<float>()[2], 3.25f);
  EXPECT_EQ(ta.data<float>()[3], 0.125f);
  auto b = ck->get("b");
  ASSERT_TRUE(b.ok());
  Tensor tb = ck->view(*b);
  EXPECT_EQ(tb.dtype(), DType::kBF16);
  EXPECT_EQ(bf16_to_f32(tb.data<uint16_t>()[1]), -0.5f);
  EXPECT_EQ(bf16_to_f32(tb.data<uint16_t>()[2]), 256.0f);
  auto c = ck->get("c");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->file, path("model-00002-of-00002.safetensors"));
  Tensor tc = ck->view(*c);
  EXPECT_EQ(tc.data<float>()[0], -7.0f);
  EXPECT_EQ(tc.data<float>()[2], 1e-3f);
  // An absent tensor names itself and the directory.
  EXPECT_TRUE(error_mentions(ck->get("d"), {"'d'", dir_}));
  EXPECT_EQ(ck->get("d").status().code(), StatusCode::kNotFound);
}

TEST_F(CheckpointTest, ViewOutlivesCheckpoint) {
  write_two_shards();
  write_index(two_shard_map());
  Tensor t;
  {
    auto ck = Checkpoint::open(dir_);
    ASSERT_TRUE(ck.ok()) << ck.status().to_string();
    t = ck->view(*ck->get("c"));
  }
  EXPECT_EQ(t.data<float>()[0], -7.0f);  // the view keeps its shard mapped
}

TEST_F(CheckpointTest, IndexNamesMissingShard) {
  write_two_shards();
  json map = two_shard_map();
  map["c"] = "model-00003-of-00002.safetensors";
  write_index(map);
  auto ck = Checkpoint::open(dir_);
  EXPECT_TRUE(error_mentions(ck, {"model.safetensors.index.json", "'c'", "model-00003-of-00002.safetensors",
                                  "does not exist"}));
  EXPECT_EQ(ck.status().code(), StatusCode::kNotFound);
}

TEST_F(CheckpointTest, IndexNamesTensorItsShardLacks) {
  write_two_shards();
  json map = two_shard_map();
  map["d"] = "model-00002-of-00002.safetensors";
  write_index(map);
  auto ck = Checkpoint::open(dir_);
  EXPECT_TRUE(error_mentions(ck, {path("model-00002-of-00002.safetensors"), "'d'", "not in this shard"}));
  // The same when the index points a real tensor at the wrong shard.
  json map2 = two_shard_map();
  map2["a"] = "model-00002-of-00002.safetensors";
  write_index(map2);
  auto ck2 = Checkpoint::open(dir_);
  EXPECT_TRUE(error_mentions(ck2, {path("model-00002-of-00002.safetensors"), "'a'", "not in this shard"}));
}

TEST_F(CheckpointTest, ShardHoldsTensorNotInIndex) {
  write_two_shards();
  json map = two_shard_map();
  map.erase("b");
  write_index(map);
  auto ck = Checkpoint::open(dir_);
  EXPECT_TRUE(error_mentions(ck, {path("model-00001-of-00002.safetensors"), "'b'", "not listed",
                                  "model.safetensors.index.json"}));
}

TEST_F(CheckpointTest, BadShardErrorNamesShard) {
  write_two_shards();
  std::string bad = safetensors_bytes({{"c", "F32", {3}, f32_bytes({-7.0f, 0.0f, 1e-3f})}});
  bad.resize(bad.size() - 1);
  write_file(path("model-00002-of-00002.safetensors"), bad);
  write_index(two_shard_map());
  auto ck = Checkpoint::open(dir_);
  EXPECT_TRUE(error_mentions(ck, {path("model-00002-of-00002.safetensors"), "'c'", "past the end"}));
}

TEST_F(CheckpointTest, IndexNotJson) {
  write_two_shards();
  write_file(path("model.safetensors.index.json"), "{\"weight_map\": ");
  EXPECT_TRUE(error_mentions(Checkpoint::open(dir_), {"model.safetensors.index.json", "weight_map"}));
  write_file(path("model.safetensors.index.json"), R"({"weight_map": {"a": 3}})");
  EXPECT_TRUE(error_mentions(Checkpoint::open(dir_), {"model.safetensors.index.json", "'a'"}));
}

TEST_F(CheckpointTest, SingleFileWithoutIndex) {
  write_file(path("model.safetensors"), safetensors_bytes({{"x", "F32", {1}, f32_bytes({42.0f})}}));
  auto ck = Checkpoint::open(dir_);
  ASSERT_TRUE(ck.ok()) << ck.status().to_string();
  EXPECT_EQ(ck->view(*ck->get("x")).data<float>()[0], 42.0f);
}

TEST_F(CheckpointTest, DirectoryProblems) {
  EXPECT_TRUE(error_mentions(Checkpoint::open(path("absent")), {path("absent"), "does not exist"}));
  EXPECT_TRUE(error_mentions(Checkpoint::open(dir_), {dir_, "no *.safetensors"}));
  write_two_shards();  // two files, no index
  EXPECT_TRUE(error_mentions(Checkpoint::open(dir_), {dir_, "2 *.safetensors", "index"}));
}

// ---------------------------------------------------------------- load_weights on the tiny models

TEST(LoadWeightsTest, CleanLoadOfTinyBf16Model) {
  const std::string dir = testing::model_path("tiny-dsv3");
  auto w = load_dir(dir);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  ASSERT_EQ(w->layers.size(), 4u);
  EXPECT_TRUE(w->layers[0].mlp.has_value());
  EXPECT_FALSE(w->layers[0].moe.has_value());
  for (size_t l = 1; l < 4; ++l) {
    ASSERT_TRUE(w->layers[l].moe.has_value()) << l;
    EXPECT_EQ(w->layers[l].moe->experts.size(), 8u);
    EXPECT_TRUE(w->layers[l].moe->shared.has_value());
    EXPECT_TRUE(w->layers[l].moe->e_score_correction_bias.defined());
  }
  EXPECT_EQ(w->embed_tokens.shape(), (std::vector<int64_t>{4096, 256}));
  EXPECT_EQ(w->embed_tokens.dtype(), DType::kF32);
  EXPECT_EQ(w->lm_head.out_features, 4096);
  EXPECT_EQ(w->lm_head.in_features, 256);

  // Values: the f32 weights are the checkpoint's bf16 values.
  auto ckpt = Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.ok());
  auto check_bf16 = [&](const std::string& name, const Tensor& got, int64_t row_offset = 0) {
    Tensor raw = ckpt->view(*ckpt->get(name));
    ASSERT_EQ(raw.dtype(), DType::kBF16) << name;
    const int64_t n = raw.numel();
    for (int64_t i : {int64_t{0}, int64_t{1}, n / 3, n - 1})
      EXPECT_EQ(got.data<float>()[row_offset * raw.row_numel() + i], bf16_to_f32(raw.data<uint16_t>()[i]))
          << name << " [" << i << "]";
  };
  check_bf16("lm_head.weight", w->lm_head.weight);
  check_bf16("model.embed_tokens.weight", w->embed_tokens);
  check_bf16("model.norm.weight", w->norm);
  check_bf16("model.layers.0.mlp.gate_proj.weight", w->layers[0].mlp->gate_up.weight);
  check_bf16("model.layers.0.mlp.up_proj.weight", w->layers[0].mlp->gate_up.weight, /*row_offset=*/768);
  check_bf16("model.layers.2.self_attn.kv_b_proj.weight", w->layers[2].attn.kv_b_proj.weight);
  Tensor bias = ckpt->view(*ckpt->get("model.layers.3.mlp.gate.e_score_correction_bias"));
  ASSERT_EQ(bias.dtype(), DType::kF32);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(w->layers[3].moe->e_score_correction_bias.data<float>()[i], bias.data<float>()[i]);
}

TEST(LoadWeightsTest, CleanLoadOfTinyFp8Model) {
  const std::string dir = testing::model_path("tiny-dsv3-fp8");
  auto w = load_dir(dir);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  ASSERT_EQ(w->layers.size(), 4u);
  auto ckpt = Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.ok());
  // down_proj: [256, 768] e4m3 with 128x128 blocks -> scale_inv [2, 6].
  Tensor q = ckpt->view(*ckpt->get("model.layers.0.mlp.down_proj.weight"));
  Tensor s = ckpt->view(*ckpt->get("model.layers.0.mlp.down_proj.weight_scale_inv"));
  ASSERT_EQ(q.dtype(), DType::kF8E4M3);
  ASSERT_EQ(s.shape(), (std::vector<int64_t>{2, 6}));
  const Tensor& down = w->layers[0].mlp->down.weight;
  ASSERT_EQ(down.dtype(), DType::kF32);
  for (auto [i, j] : {std::pair<int64_t, int64_t>{0, 0}, {5, 130}, {127, 767}, {128, 0}, {200, 700}, {255, 767}}) {
    const float expect = fp8e4m3_to_f32(q.data<uint8_t>()[i * 768 + j]) * s.data<float>()[(i / 128) * 6 + j / 128];
    EXPECT_EQ(down.data<float>()[i * 768 + j], expect) << "[" << i << ", " << j << "]";
  }
  // up_proj lands in the second half of gate_up.
  Tensor uq = ckpt->view(*ckpt->get("model.layers.0.mlp.up_proj.weight"));
  Tensor us = ckpt->view(*ckpt->get("model.layers.0.mlp.up_proj.weight_scale_inv"));
  ASSERT_EQ(us.shape(), (std::vector<int64_t>{6, 2}));
  const Tensor& gate_up = w->layers[0].mlp->gate_up.weight;
  for (auto [i, j] : {std::pair<int64_t, int64_t>{0, 0}, {300, 200}, {767, 255}}) {
    const float expect = fp8e4m3_to_f32(uq.data<uint8_t>()[i * 256 + j]) * us.data<float>()[(i / 128) * 2 + j / 128];
    EXPECT_EQ(gate_up.data<float>()[(768 + i) * 256 + j], expect) << "[" << i << ", " << j << "]";
  }
}

TEST(LoadWeightsTest, MissingTensor) {
  ModelCopy m("tiny-dsv3");
  const std::string name = "model.layers.2.self_attn.q_a_layernorm.weight";
  m.edit_shard_of(name, [&](std::vector<StTensor>& ts) { drop(ts, name); });
  auto w = load_dir(m.dir());
  EXPECT_TRUE(error_mentions(w, {"'" + name + "'", m.dir()}));
  EXPECT_EQ(w.status().code(), StatusCode::kNotFound);
}

TEST(LoadWeightsTest, UnexpectedExtraTensor) {
  ModelCopy m("tiny-dsv3");
  const std::string name = "model.layers.1.mlp.bogus.weight";
  m.edit_shard_of("model.layers.1.input_layernorm.weight",
                  [&](std::vector<StTensor>& ts) { ts.push_back({name, "F32", {4}, f32_bytes({1, 2, 3, 4})}); });
  auto w = load_dir(m.dir());
  EXPECT_TRUE(error_mentions(w, {"'" + name + "'", m.shard_of(name), "unexpected"}));
}

TEST(LoadWeightsTest, UnexpectedTopLevelTensor) {
  ModelCopy m("tiny-dsv3");
  const std::string name = "model.extra_norm.weight";
  m.edit_shard_of("lm_head.weight",
                  [&](std::vector<StTensor>& ts) { ts.push_back({name, "BF16", {256}, std::string(512, '\0')}); });
  auto w = load_dir(m.dir());
  EXPECT_TRUE(error_mentions(w, {"'" + name + "'", m.shard_of(name), "unexpected"}));
}

TEST(LoadWeightsTest, LayersPastNumHiddenLayersAreAccepted) {
  // DeepSeek-V3 ships its multi-token-prediction layer as model.layers.61.*
  // with num_hidden_layers 61; the tiny model has 4 layers (0..3) and may hold its own MTP layer
  // as model.layers.4.* (tools/train_tiny_mtp.py), so the extra tensors here use layer 5.
  ModelCopy m("tiny-dsv3");
  m.edit_shard_of("model.layers.3.input_layernorm.weight", [&](std::vector<StTensor>& ts) {
    ts.push_back({"model.layers.5.input_layernorm.weight", "BF16", {256}, std::string(512, '\0')});
    ts.push_back({"model.layers.5.eh_proj.weight", "BF16", {256, 512}, std::string(256 * 512 * 2, '\0')});
    ts.push_back({"model.layers.61.shared_head.norm.weight", "BF16", {256}, std::string(512, '\0')});
    ts.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", "F32", {32}, std::string(128, '\0')});
  });
  auto w = load_dir(m.dir());
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  EXPECT_EQ(w->layers.size(), 4u);
}

TEST(LoadWeightsTest, TensorWithWrongShape) {
  ModelCopy m("tiny-dsv3");
  // o_proj is [256, 512]; store the same bytes as [512, 256].
  const std::string name = "model.layers.1.self_attn.o_proj.weight";
  m.edit_shard_of(name, [&](std::vector<StTensor>& ts) {
    StTensor* t = find(ts, name);
    ASSERT_NE(t, nullptr);
    ASSERT_EQ(t->shape, (std::vector<int64_t>{256, 512}));
    t->shape = {512, 256};
  });
  auto w = load_dir(m.dir());
  EXPECT_TRUE(error_mentions(w, {"'" + name + "'", m.shard_of(name), "[512, 256]", "[256, 512]"}));
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument);
}

TEST(LoadWeightsTest, NormWithWrongShape) {
  ModelCopy m("tiny-dsv3");
  const std::string name = "model.layers.0.input_layernorm.weight";
  m.edit_shard_of(name, [&](std::vector<StTensor>& ts) {
    StTensor* t = find(ts, name);
    ASSERT_NE(t, nullptr);
    t->shape = {255};
    t->bytes.resize(510);
  });
  auto w = load_dir(m.dir());
  EXPECT_TRUE(error_mentions(w, {"'" + name + "'", m.shard_of(name), "[255]", "[256]"}));
}

TEST(LoadWeightsTest, TensorWithUnsupportedDtype) {
  ModelCopy m("tiny-dsv3");
  const std::string name = "model.norm.weight";
  m.edit_shard_of(name, [&](std::vector<StTensor>& ts) {
    StTensor* t = find(ts, name);
    ASSERT_NE(t, nullptr);
    t->dtype = "I32";
    t->bytes.resize(256 * 4);
  });
  auto w = load_dir(m.dir());
  EXPECT_TRUE(error_mentions(w, {"'" + name + "'", m.shard_of(name), "I32"}));
}

TEST(LoadWeightsTest, Fp8WeightWithoutScaleInv) {
  ModelCopy m("tiny-dsv3-fp8");
  const std::string weight = "model.layers.0.mlp.down_proj.weight";
  const std::string scale = "model.layers.0.mlp.down_proj.weight_scale_inv";
  m.edit_shard_of(scale, [&](std::vector<StTensor>& ts) { drop(ts, scale); });
  auto w = load_dir(m.dir());
  EXPECT_TRUE(error_mentions(w, {"'" + weight + "'", "'" + scale + "'", m.dir()}));
  EXPECT_EQ(w.status().code(), StatusCode::kNotFound);
}

TEST(LoadWeightsTest, Fp8ScaleInvWithWrongShape) {
  ModelCopy m("tiny-dsv3-fp8");
  const std::string scale = "model.layers.0.mlp.down_proj.weight_scale_inv";
  m.edit_shard_of(scale, [&](std::vector<StTensor>& ts) {
    StTensor* t = find(ts, scale);
    ASSERT_NE(t, nullptr);
    ASSERT_EQ(t->shape, (std::vector<int64_t>{2, 6}));
    t->shape = {6, 2};  // transposed, same byte size
  });
  auto w = load_dir(m.dir());
  EXPECT_TRUE(error_mentions(w, {"'" + scale + "'", m.shard_of(scale), "[6, 2]", "needs [2, 6]", "[256, 768]"}));
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument);
}

TEST(LoadWeightsTest, Fp8ScaleInvAsE8M0Bytes) {
  // U8 scales are E8M0 exponents: 127 -> 1.0, 130 -> 8.0.
  ModelCopy m("tiny-dsv3-fp8");
  const std::string scale = "model.layers.0.mlp.down_proj.weight_scale_inv";
  m.edit_shard_of(scale, [&](std::vector<StTensor>& ts) {
    StTensor* t = find(ts, scale);
    ASSERT_NE(t, nullptr);
    t->dtype = "U8";
    t->bytes = std::string(12, '\x7f');
    t->bytes[5] = '\x82';  // block (0, 5)
  });
  auto w = load_dir(m.dir());
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  auto ckpt = Checkpoint::open(m.dir());
  ASSERT_TRUE(ckpt.ok());
  Tensor q = ckpt->view(*ckpt->get("model.layers.0.mlp.down_proj.weight"));
  const Tensor& down = w->layers[0].mlp->down.weight;
  EXPECT_EQ(down.data<float>()[3 * 768 + 10], fp8e4m3_to_f32(q.data<uint8_t>()[3 * 768 + 10]));
  EXPECT_EQ(down.data<float>()[3 * 768 + 700], 8.0f * fp8e4m3_to_f32(q.data<uint8_t>()[3 * 768 + 700]));
  EXPECT_EQ(down.data<float>()[200 * 768 + 700], fp8e4m3_to_f32(q.data<uint8_t>()[200 * 768 + 700]));
}

TEST(LoadWeightsTest, Fp8ScaleInvWithWrongDtype) {
  ModelCopy m("tiny-dsv3-fp8");
  const std::string scale = "model.layers.0.mlp.down_proj.weight_scale_inv";
  m.edit_shard_of(scale, [&](std::vector<StTensor>& ts) {
    StTensor* t = find(ts, scale);
    ASSERT_NE(t, nullptr);
    t->dtype = "BF16";
    t->bytes.resize(24);
  });
  auto w = load_dir(m.dir());
  EXPECT_TRUE(error_mentions(w, {"'" + scale + "'", m.shard_of(scale), "BF16"}));
}

TEST(LoadWeightsTest, Fp8WeightsWithoutFp8Config) {
  // The FP8 checkpoint with the bf16 model's config.json (no quantization_config).
  auto w = load_dir(testing::model_path("tiny-dsv3-fp8"), testing::model_path("tiny-dsv3/config.json"));
  EXPECT_TRUE(error_mentions(w, {"F8_E4M3", "quantization_config", "tiny-dsv3-fp8"}));
}

TEST(LoadWeightsTest, ScaleInvForNonFp8Weight) {
  ModelCopy m("tiny-dsv3");
  const std::string weight = "model.layers.0.mlp.down_proj.weight";
  const std::string scale = "model.layers.0.mlp.down_proj.weight_scale_inv";
  m.edit_shard_of(weight, [&](std::vector<StTensor>& ts) {
    ts.push_back({scale, "F32", {2, 6}, f32_bytes(std::vector<float>(12, 1.0f))});
  });
  auto w = load_dir(m.dir());
  EXPECT_TRUE(error_mentions(w, {"'" + scale + "'", "'" + weight + "'"}));
}

TEST(LoadWeightsTest, ConfigWithBadField) {
  const std::string dir = testing::make_temp_dir("nucleus_cfg_");
  std::ifstream in(testing::model_path("tiny-dsv3/config.json"));
  const json base = json::parse(in);
  struct Case {
    std::function<void(json&)> edit;
    const char* field;
  };
  const Case cases[] = {
      {[](json& j) { j["num_attention_heads"] = "four"; }, "num_attention_heads"},
      {[](json& j) { j.erase("hidden_size"); }, "hidden_size"},
      {[](json& j) { j["rms_norm_eps"] = "small"; }, "rms_norm_eps"},
      {[](json& j) { j["scoring_func"] = "relu"; }, "scoring_func"},
      {[](json& j) { j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"},
                                                  {"activation_scheme", "dynamic"},
                                                  {"weight_block_size", {0, 128}}}; },
       "weight_block_size"},
      // Neither of these is per-tensor FP8: the message says what the field must be.
      {[](json& j) { j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"},
                                                  {"activation_scheme", "dynamic"},
                                                  {"weight_block_size", {128.0, 128}}}; },
       "weight_block_size must be two integers [n, k], got [128.0,128]"},
      {[](json& j) { j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"},
                                                  {"activation_scheme", "dynamic"},
                                                  {"weight_block_size", {128, 128, 128}}}; },
       "weight_block_size must be two integers [n, k], got [128,128,128]"},
      {[](json& j) { j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"},
                                                  {"activation_scheme", "dynamic"}}; },
       "no weight_block_size (per-tensor FP8 is not supported"},
  };
  for (const auto& c : cases) {
    json j = base;
    c.edit(j);
    const std::string path = dir + "/config.json";
    write_file(path, j.dump(2));
    auto cfg = load_model_config(path);
    EXPECT_TRUE(error_mentions(cfg, {path, c.field})) << c.field;
  }
  write_file(dir + "/broken.json", "{\"hidden_size\": ");
  EXPECT_TRUE(error_mentions(load_model_config(dir + "/broken.json"), {dir + "/broken.json", "JSON"}));
  EXPECT_TRUE(error_mentions(load_model_config(dir + "/absent.json"), {dir + "/absent.json"}));
}

// A host tensor larger than the host's MemAvailable is refused with
// resource_exhausted naming it, before anything is allocated (the CPU
// reference's f32 weights of a model larger than the host aborted in
// Tensor::empty, or woke the OOM killer).
TEST(LoaderTest, HostTensorPastMemAvailableIsRefusedNamingIt) {
  const int64_t available = host_memory_available_bytes();
  if (available <= 0) GTEST_SKIP() << "no MemAvailable in /proc/meminfo";
  auto t = Tensor::try_empty_host({available / 4 + (int64_t{1} << 28)}, DType::kF32, "the test's tensor");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(t.status().message().find("the test's tensor needs"), std::string::npos) << t.status().message();
  EXPECT_NE(t.status().message().find("GiB are available"), std::string::npos) << t.status().message();
  auto small = Tensor::try_empty_host({16}, DType::kF32, "a small one");
  ASSERT_TRUE(small.ok()) << small.status().to_string();
  EXPECT_EQ(small->numel(), 16);
}

}  // namespace
}  // namespace nucleus
