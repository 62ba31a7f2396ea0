// Checkpoints that used to load and then hang, crash or compute garbage are
// refused at load with an error naming the file and the tensor: overlapping
// tensor bytes, a tensor in two shards, a FIFO or device where a file
// belongs, float dtypes other than config.json's torch_dtype, and values no
// weight may hold (NaN / Inf, FP8 NaN bytes, block scales <= 0), unless the
// value check is skipped.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <future>
#include <limits>

#include "checkpoint_files.h"
#include "io/regular_file.h"
#include "io/tokenizer.h"
#include "model/weight_check.h"

namespace nucleus {
namespace {

using namespace nucleus::testing;  // checkpoint_files.h

// ---------------------------------------------------------------- files

TEST(CheckpointValidationTest, OverlappingTensorsAreRefused) {
  const std::string dir = make_temp_dir("nucleus_overlap_");
  const std::string path = dir + "/model.safetensors";
  // a holds bytes [0, 16), b [8, 24): b's first half is a's second half.
  write_file(path, raw_safetensors(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                                   R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                                   f32_bytes({1, 2, 3, 4, 5, 6})));
  auto f = SafetensorsFile::open(path);
  EXPECT_TRUE(error_mentions(f, {path, "'a'", "'b'", "overlap", "8 bytes"}));
  EXPECT_EQ(f.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(error_mentions(Checkpoint::open(dir), {path, "'a'", "'b'", "overlap"}));
  // Adjacent ranges and empty tensors anywhere are fine.
  write_file(path, raw_safetensors(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                   R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                                   R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                                   f32_bytes({1, 2, 3, 4, 5, 6})));
  auto g = SafetensorsFile::open(path);
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  EXPECT_EQ((*g)->tensors().size(), 3u);
}

TEST(CheckpointValidationTest, TensorInTwoShardsNamesBoth) {
  const std::string dir = make_temp_dir("nucleus_dup_");
  const std::string one = dir + "/model-00001-of-00002.safetensors", two = dir + "/model-00002-of-00002.safetensors";
  write_file(one, safetensors_bytes({{"a", "F32", {1}, f32_bytes({1})}, {"c", "F32", {1}, f32_bytes({2})}}));
  write_file(two, safetensors_bytes({{"b", "F32", {1}, f32_bytes({3})}, {"c", "F32", {1}, f32_bytes({4})}}));
  json index = {{"weight_map",
                 {{"a", "model-00001-of-00002.safetensors"},
                  {"b", "model-00002-of-00002.safetensors"},
                  {"c", "model-00002-of-00002.safetensors"}}}};
  write_file(dir + "/model.safetensors.index.json", index.dump());
  auto ck = Checkpoint::open(dir);
  EXPECT_TRUE(error_mentions(ck, {"'c'", "two shards", one, two}));
  EXPECT_EQ(ck.status().code(), StatusCode::kDataLoss);
}

// Runs `open` on another thread; a call still blocked after 10 s is
// released by opening `fifo` for writing (the reader then sees end of file),
// so the test fails instead of hanging.
template <typename F>
auto without_hanging(const std::string& fifo, F open) {
  auto result = std::async(std::launch::async, open);
  if (result.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "opening " << fifo << " blocked";
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) ::close(fd);
  }
  return result.get();
}

TEST(CheckpointValidationTest, FifoWhereAFileBelongsIsRefusedWithoutBlocking) {
  const auto t0 = std::chrono::steady_clock::now();
  // The shard of a single-file checkpoint.
  const std::string dir = make_temp_dir("nucleus_fifo_");
  ASSERT_EQ(::mkfifo((dir + "/model.safetensors").c_str(), 0600), 0);
  auto ck = without_hanging(dir + "/model.safetensors", [&] { return Checkpoint::open(dir); });
  EXPECT_TRUE(error_mentions(ck, {dir + "/model.safetensors", "a FIFO", "not a regular file"}));
  EXPECT_EQ(ck.status().code(), StatusCode::kInvalidArgument);
  // A shard named by the index.
  const std::string sharded = make_temp_dir("nucleus_fifo_");
  write_file(sharded + "/model-00001-of-00002.safetensors", safetensors_bytes({{"a", "F32", {1}, f32_bytes({1})}}));
  ASSERT_EQ(::mkfifo((sharded + "/model-00002-of-00002.safetensors").c_str(), 0600), 0);
  write_file(sharded + "/model.safetensors.index.json",
             json{{"weight_map",
                   {{"a", "model-00001-of-00002.safetensors"}, {"b", "model-00002-of-00002.safetensors"}}}}
                 .dump());
  auto ck2 = without_hanging(sharded + "/model-00002-of-00002.safetensors", [&] { return Checkpoint::open(sharded); });
  EXPECT_TRUE(error_mentions(ck2, {sharded + "/model-00002-of-00002.safetensors", "a FIFO"}));
  // The index itself.
  ::unlink((sharded + "/model.safetensors.index.json").c_str());
  ASSERT_EQ(::mkfifo((sharded + "/model.safetensors.index.json").c_str(), 0600), 0);
  auto ck3 = without_hanging(sharded + "/model.safetensors.index.json", [&] { return Checkpoint::open(sharded); });
  EXPECT_TRUE(error_mentions(ck3, {sharded + "/model.safetensors.index.json", "a FIFO"}));
  // config.json and tokenizer.json.
  ASSERT_EQ(::mkfifo((dir + "/config.json").c_str(), 0600), 0);
  auto cfg = without_hanging(dir + "/config.json", [&] { return load_model_config(dir + "/config.json"); });
  EXPECT_TRUE(error_mentions(cfg, {dir + "/config.json", "a FIFO"}));
  ASSERT_EQ(::mkfifo((dir + "/tokenizer.json").c_str(), 0600), 0);
  auto tok = without_hanging(dir + "/tokenizer.json", [&] { return Tokenizer::load(dir); });
  EXPECT_TRUE(error_mentions(tok, {dir + "/tokenizer.json", "a FIFO"}));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

TEST(CheckpointValidationTest, DirectoryOrDeviceWhereAFileBelongsIsRefused) {
  const std::string dir = make_temp_dir("nucleus_notfile_");
  fs::create_directory(dir + "/model.safetensors");
  EXPECT_TRUE(error_mentions(Checkpoint::open(dir), {dir + "/model.safetensors", "a directory"}));
  fs::remove(dir + "/model.safetensors");
  fs::create_symlink("/dev/zero", dir + "/model.safetensors");  // stat follows the link
  auto ck = Checkpoint::open(dir);
  EXPECT_TRUE(error_mentions(ck, {dir + "/model.safetensors", "a character device"}));
  EXPECT_EQ(ck.status().code(), StatusCode::kInvalidArgument);
  fs::create_directory(dir + "/config.json");
  EXPECT_TRUE(error_mentions(load_model_config(dir + "/config.json"), {dir + "/config.json", "a directory"}));
  EXPECT_TRUE(error_mentions(read_regular_file(dir + "/absent"), {dir + "/absent", "cannot open"}));
}

// ---------------------------------------------------------------- dtypes against config.json

// Rewrites the BF16 tensor `name` of `m` as `dtype` ("F16" or "F32"), with the same values.
void convert_tensor(ModelCopy& m, const std::string& name, const std::string& dtype) {
  m.edit_shard_of(name, [&](std::vector<StTensor>& ts) {
    StTensor* t = find(ts, name);
    ASSERT_NE(t, nullptr);
    ASSERT_EQ(t->dtype, "BF16");
    std::vector<float> v(t->bytes.size() / 2);
    for (size_t i = 0; i < v.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, t->bytes.data() + 2 * i, 2);
      v[i] = bf16_to_f32(h);
    }
    t->dtype = dtype;
    if (dtype == "F32") {
      t->bytes = f32_bytes(v);
      return;
    }
    for (size_t i = 0; i < v.size(); ++i) {
      const uint16_t h = f32_to_f16(v[i]);
      std::memcpy(t->bytes.data() + 2 * i, &h, 2);
    }
  });
}

TEST(CheckpointValidationTest, FloatDtypeOtherThanTorchDtypeIsRefused) {
  ModelCopy m("tiny-dsv3");
  const std::string name = "model.layers.2.self_attn.q_b_proj.weight";
  convert_tensor(m, name, "F16");
  auto w = load_dir(m.dir());
  EXPECT_TRUE(error_mentions(w, {m.shard_of(name), "'" + name + "'", "dtype F16", "torch_dtype says BF16"}));
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument);
  // F32 is lossless for bf16 values: accepted, and loads the same numbers.
  ModelCopy f32("tiny-dsv3");
  const std::string norm = "model.layers.1.input_layernorm.weight";
  convert_tensor(f32, norm, "F32");
  auto ok = load_dir(f32.dir());
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  auto orig = load_dir(model_path("tiny-dsv3"));
  ASSERT_TRUE(orig.ok());
  const Tensor& a = ok->layers[1].input_layernorm;
  const Tensor& b = orig->layers[1].input_layernorm;
  EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0);
}

// ---------------------------------------------------------------- values

// Sets element `index` of tensor `name` in `m` to the raw bytes `value`.
void poke(ModelCopy& m, const std::string& name, int64_t index, const std::string& value) {
  m.edit_shard_of(name, [&](std::vector<StTensor>& ts) {
    StTensor* t = find(ts, name);
    ASSERT_NE(t, nullptr);
    ASSERT_LE(static_cast<size_t>(index + 1) * value.size(), t->bytes.size());
    t->bytes.replace(static_cast<size_t>(index) * value.size(), value.size(), value);
  });
}

std::string bf16_raw(uint16_t bits) { return std::string(reinterpret_cast<const char*>(&bits), 2); }

struct BadValueCase {
  std::string model;
  std::string tensor;
  int64_t index;       // flat
  std::string bytes;   // the element's new raw bytes
  std::string where;   // its index as the error gives it
  std::string what;    // the value as the error gives it
};

TEST(CheckpointValidationTest, BadValuesAreRefusedNamingTensorAndIndex) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<BadValueCase> cases = {
      {"tiny-dsv3", "model.layers.1.self_attn.o_proj.weight", 3 * 512 + 17, bf16_raw(0x7fc0), "[3, 17]", "nan"},
      {"tiny-dsv3", "model.embed_tokens.weight", 4095 * 256 + 255, bf16_raw(0xff80), "[4095, 255]", "-inf"},
      {"tiny-dsv3", "model.norm.weight", 5, bf16_raw(0x7f80), "[5]", "inf"},
      {"tiny-dsv3", "model.layers.0.self_attn.kv_a_layernorm.weight", 0, bf16_raw(0xffc1), "[0]", "nan"},
      {"tiny-dsv3", "model.layers.2.mlp.gate.e_score_correction_bias", 6, f32_bytes({nan}), "[6]", "nan"},
      {"tiny-dsv3", "model.layers.3.mlp.gate.weight", 7 * 256 + 1, bf16_raw(0x7f80), "[7, 1]", "inf"},
      {"tiny-dsv3", "lm_head.weight", 100, bf16_raw(0x7fc0), "[0, 100]", "nan"},
      {"tiny-dsv3-fp8", "model.layers.0.mlp.down_proj.weight", 200 * 768 + 700, "\xff", "[200, 700]",
       "the F8_E4M3 NaN byte 0xff"},
      {"tiny-dsv3-fp8", "model.layers.3.mlp.experts.5.up_proj.weight", 9, "\x7f", "[0, 9]",
       "the F8_E4M3 NaN byte 0x7f"},
      {"tiny-dsv3-fp8", "model.layers.0.mlp.down_proj.weight_scale_inv", 1 * 6 + 3, f32_bytes({0.0f}), "[1, 3]",
       "0 (an FP8 block scale must be > 0 with 448 x scale finite)"},
      {"tiny-dsv3-fp8", "model.layers.1.self_attn.q_a_proj.weight_scale_inv", 0, f32_bytes({-0.5f}), "[0, 0]",
       "-0.5 (an FP8 block scale"},
      {"tiny-dsv3-fp8", "model.layers.1.self_attn.kv_b_proj.weight_scale_inv", 5, f32_bytes({inf}), "[",
       "inf (an FP8 block scale"},
      // Finite, but 448 x 1e38 is not (it used to load and give NaN logits).
      {"tiny-dsv3-fp8", "model.layers.0.self_attn.q_a_proj.weight_scale_inv", 0, f32_bytes({1e38f}), "[0, 0]",
       "1e+38 (an FP8 block scale must be > 0 with 448 x scale finite)"},
  };
  for (const auto& c : cases) {
    ModelCopy m(c.model);
    poke(m, c.tensor, c.index, c.bytes);
    auto w = load_dir(m.dir());
    EXPECT_TRUE(error_mentions(w, {m.shard_of(c.tensor), "tensor '" + c.tensor + "' holds " + c.what,
                                   "at element " + c.where, "--skip-weight-check"}))
        << c.tensor;
    EXPECT_EQ(w.status().code(), StatusCode::kDataLoss) << c.tensor;
    // Skipping the check loads the same checkpoint.
    auto skipped = load_dir(m.dir(), "", /*check_values=*/false);
    EXPECT_TRUE(skipped.ok()) << c.tensor << ": " << skipped.status().to_string();
  }
}

// A layer index too large for an int64 is an unexpected tensor, not a crash
// (std::stoll threw std::out_of_range past the loader: std::terminate).
TEST(CheckpointValidationTest, LayerIndexPastInt64IsAnUnexpectedTensor) {
  ModelCopy m("tiny-dsv3");
  const std::string name = "model.layers.99999999999999999999999.foo.weight";
  m.edit_shard_of("model.norm.weight",
                  [&](std::vector<StTensor>& ts) { ts.push_back({name, "BF16", {4}, bf16_bytes({1, 2, 3, 4})}); });
  EXPECT_TRUE(error_mentions(load_dir(m.dir()), {"unexpected tensor '" + name + "'", "layer index out of range"}));
}

TEST(CheckpointValidationTest, E8M0NanScaleIsRefused) {
  ModelCopy m("tiny-dsv3-fp8");
  const std::string scale = "model.layers.0.mlp.down_proj.weight_scale_inv";
  m.edit_shard_of(scale, [&](std::vector<StTensor>& ts) {
    StTensor* t = find(ts, scale);
    ASSERT_NE(t, nullptr);
    t->dtype = "U8";
    t->bytes = std::string(12, '\x7f');
    t->bytes[7] = '\xff';
  });
  EXPECT_TRUE(error_mentions(load_dir(m.dir()), {"'" + scale + "'", "the E8M0 NaN byte 0xff", "[1, 1]"}));
}

// Under tensor parallelism a rank checks what it loads, and names the bad
// element by its index in the whole tensor.
TEST(CheckpointValidationTest, RankNamesIndexInTheWholeTensor) {
  ModelCopy m("tiny-dsv3");
  const std::string o_proj = "model.layers.1.self_attn.o_proj.weight";  // [256, 512], columns split
  const std::string q_b = "model.layers.2.self_attn.q_b_proj.weight";   // [768, 128], rows split
  poke(m, o_proj, 3 * 512 + 300, bf16_raw(0x7fc0));
  auto config = load_model_config(m.dir() + "/config.json");
  ASSERT_TRUE(config.ok());
  auto ckpt = Checkpoint::open(m.dir());
  ASSERT_TRUE(ckpt.ok());
  auto backend = make_cpu_weight_backend();
  LoadOptions lo;
  lo.show_progress = false;
  auto rank0 = load_weights(*ckpt, *config, *backend, lo, TpShard{0, 2});
  EXPECT_TRUE(rank0.ok()) << rank0.status().to_string();  // column 300 is rank 1's
  EXPECT_TRUE(error_mentions(load_weights(*ckpt, *config, *backend, lo, TpShard{1, 2}),
                             {"'" + o_proj + "'", "at element [3, 300]"}));
  ModelCopy m2("tiny-dsv3");
  poke(m2, q_b, 500 * 128 + 7, bf16_raw(0x7f80));
  auto ckpt2 = Checkpoint::open(m2.dir());
  ASSERT_TRUE(ckpt2.ok());
  EXPECT_TRUE(error_mentions(load_weights(*ckpt2, *config, *backend, lo, TpShard{1, 2}),
                             {"'" + q_b + "'", "at element [500, 7]"}));
}

TEST(CheckpointValidationTest, FirstBadValueIsTheLowestWhateverTheChunk) {
  std::vector<uint16_t> v(3'000'001, f32_to_bf16(0.5f));
  EXPECT_EQ(first_bad_value(v.data(), DType::kBF16, static_cast<int64_t>(v.size()), ValueCheck::kFinite), -1);
  v[2'900'000] = 0x7f80;
  v[1'200'003] = 0xffc0;
  v[3'000'000] = 0x7fc0;
  EXPECT_EQ(first_bad_value(v.data(), DType::kBF16, static_cast<int64_t>(v.size()), ValueCheck::kFinite), 1'200'003);
  // Large finite values, subnormals and -0 are values a weight may hold.
  const std::vector<float> fine = {3.0e38f, -3.0e38f, 1e-45f, -0.0f};
  EXPECT_EQ(first_bad_value(fine.data(), DType::kF32, 4, ValueCheck::kFinite), -1);
  // As a block scale 3e38 is refused: 448 x 3e38 is not finite.
  EXPECT_EQ(first_bad_value(fine.data(), DType::kF32, 4, ValueCheck::kBlockScale), 0);
  const std::vector<float> scales = {1.0f, 1e-45f, 0.0078125f, 7.5e35f, -0.0f};  // the last: -0
  EXPECT_EQ(first_bad_value(scales.data(), DType::kF32, 5, ValueCheck::kBlockScale), 4);
  const std::vector<float> big = {1.0f, 7.6e35f};  // past the largest scale with 448 x scale < Inf (7.5956e35)
  EXPECT_EQ(first_bad_value(big.data(), DType::kF32, 2, ValueCheck::kBlockScale), 1);
  const std::vector<uint8_t> e4m3 = {0x00, 0x80, 0x7e, 0xfe, 0x7f};  // +-0, +-448, NaN
  EXPECT_EQ(first_bad_value(e4m3.data(), DType::kF8E4M3, 5, ValueCheck::kFinite), 4);
  const std::vector<uint16_t> f16 = {0x7bff, 0xfc00};  // 65504, -inf
  EXPECT_EQ(first_bad_value(f16.data(), DType::kF16, 2, ValueCheck::kFinite), 1);
  const std::vector<int32_t> ints = {-1, 0x7fffffff};  // not a float: nothing to check
  EXPECT_EQ(first_bad_value(ints.data(), DType::kI32, 2, ValueCheck::kFinite), -1);
}

// The shipped checkpoints pass every check; the time it takes is printed.
TEST(CheckpointValidationTest, TinyModelsPassTheChecks) {
  for (const char* name : {"tiny-dsv3", "tiny-dsv3-fp8"}) {
    auto ckpt = Checkpoint::open(model_path(name));
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
    int64_t bytes = 0;
    double seconds = 0;
    for (const auto& [tensor, e] : ckpt->entries()) {
      const ValueCheck check =
          tensor.find("weight_scale_inv") != std::string::npos ? ValueCheck::kBlockScale : ValueCheck::kFinite;
      const auto t0 = std::chrono::steady_clock::now();
      EXPECT_EQ(first_bad_value(e.data, e.dtype, static_cast<int64_t>(shape_numel(e.shape)), check), -1) << tensor;
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      bytes += static_cast<int64_t>(e.nbytes);
    }
    std::printf("%s: %.1f MiB checked in %.2f ms (%.2f GB/s)\n", name, bytes / double(1 << 20), 1e3 * seconds,
                bytes / 1e9 / seconds);
    auto w = load_dir(model_path(name));
    EXPECT_TRUE(w.ok()) << name << ": " << w.status().to_string();
  }
}

}  // namespace
}  // namespace nucleus
