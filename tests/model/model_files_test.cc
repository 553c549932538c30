// Loading model directories: every supported layout loads to the same model, and every kind of
// broken file is an error naming the file and the tensor, never a crash or a wrong model.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <Eigen/Core>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "server/engine/cpu_engine.h"
#include "server/model/model.h"
#include "server/model/safetensors.h"
#include "tests/test_support.h"

namespace ttt {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

struct TensorData {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};

template <typename Half>
std::vector<std::byte> ToHalf(std::span<const float> values) {
  std::vector<std::byte> bytes(values.size() * 2);
  for (size_t i = 0; i < values.size(); ++i) {
    const Half h(values[i]);
    std::memcpy(&bytes[2 * i], &h, 2);
  }
  return bytes;
}

// Values as they would be stored with `dtype`.
std::vector<std::byte> StoredBytes(std::span<const float> values, DType dtype) {
  if (dtype == DType::kF16) return ToHalf<Eigen::half>(values);
  if (dtype == DType::kBF16) return ToHalf<Eigen::bfloat16>(values);
  auto raw = std::as_bytes(values);
  return {raw.begin(), raw.end()};
}

// The model's tensors as they would be stored with `dtype`.
std::vector<TensorData> StoredTensors(const ModelConfig& config, const ModelWeights& weights,
                                      DType dtype) {
  std::vector<TensorData> tensors;
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    tensors.push_back({spec.name, dtype, spec.shape, StoredBytes(weights.Get(spec.name), dtype)});
  }
  return tensors;
}

void WriteTensors(const std::string& path, const std::vector<TensorData>& tensors) {
  std::vector<TensorToWrite> to_write;
  for (const TensorData& t : tensors) to_write.push_back({t.name, t.dtype, t.shape, t.bytes});
  ASSERT_TRUE(WriteSafetensors(path, to_write).ok());
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class ModelFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto config = LoadModelConfig(testing::TestDataPath("golden/tiny-linear-m"));
    ASSERT_TRUE(config.ok());
    config_ = *config;  // Untied head, Mamba backbone.
    dir_ = testing::ScratchDir();
    WriteText(dir_ + "/config.json", config_.ToJson());
  }

  // The last-token logits of a fixed prompt on the model in `dir`.
  std::vector<float> Logits(std::shared_ptr<const Model> model) {
    CpuEngine engine(std::move(model));
    const std::vector<int32_t> prompt = {1, 100, 200, 300, 400, 500, 7, 8, 9, 10, 11, 12, 13, 14,
                                         15, 16, 17, 18};
    std::vector<float> logits;
    const SequenceChunk chunk{*engine.CreateSequence(), prompt};
    EXPECT_TRUE(engine.Forward({&chunk, 1}, LogitsFor::kEveryToken, &logits).ok());
    return logits;
  }

  absl::Status LoadError() {
    auto model = LoadModel(dir_);
    return model.ok() ? absl::OkStatus() : model.status();
  }

  ModelConfig config_;
  std::string dir_;
};

// Random weights are drawn in blocks of 2^20 values on every core: they must still depend on the
// seed alone, have their scale, and no block may repeat another's draws.
TEST_F(ModelFilesTest, RandomWeightsDependOnTheSeedAlone) {
  ModelConfig config = config_;
  config.vocab_size = 40000;  // An embedding of 2.6M values: three blocks.
  const ModelWeights weights = ModelWeights::Random(config, 3);
  const ModelWeights again = ModelWeights::Random(config, 3);
  const ModelWeights other = ModelWeights::Random(config, 4);
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    const std::span<const float> values = weights.Get(spec.name);
    EXPECT_TRUE(std::ranges::equal(values, again.Get(spec.name))) << spec.name;
    EXPECT_FALSE(std::ranges::equal(values, other.Get(spec.name))) << spec.name;
  }
  const std::span<const float> embedding = weights.Get("model.embed_tokens.weight");
  ASSERT_EQ(embedding.size(), 40000u * config.hidden_size);
  constexpr size_t kBlock = size_t{1} << 20;
  EXPECT_FALSE(std::ranges::equal(embedding.subspan(0, 1000), embedding.subspan(kBlock, 1000)));
  double sum = 0, sum_of_squares = 0;
  for (const float v : embedding) sum += v, sum_of_squares += double(v) * v;
  const double mean = sum / embedding.size();
  EXPECT_NEAR(mean, 0.0, 0.01);
  EXPECT_NEAR(std::sqrt(sum_of_squares / embedding.size() - mean * mean), 1.0, 0.01);
}

TEST_F(ModelFilesTest, F32FileGivesTheSameModel) {
  const ModelWeights weights = ModelWeights::Random(config_, 3);
  WriteTensors(dir_ + "/model.safetensors", StoredTensors(config_, weights, DType::kF32));
  auto loaded = LoadModel(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(Logits(*loaded), Logits(testing::RandomModel(config_, 3)));
  EXPECT_EQ((*loaded)->weights.fingerprint(), weights.fingerprint());
  EXPECT_EQ((*loaded)->tokenizer, nullptr);
}

TEST_F(ModelFilesTest, HalfPrecisionFilesLoadCloseToF32) {
  const std::vector<float> reference = Logits(testing::RandomModel(config_, 3));
  for (DType dtype : {DType::kF16, DType::kBF16}) {
    WriteTensors(dir_ + "/model.safetensors",
                 StoredTensors(config_, ModelWeights::Random(config_, 3), dtype));
    auto loaded = LoadModel(dir_);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    const std::vector<float> logits = Logits(*loaded);
    double diff = 0, norm = 0;
    for (size_t i = 0; i < logits.size(); ++i) {
      diff += (logits[i] - reference[i]) * (logits[i] - reference[i]);
      norm += reference[i] * reference[i];
    }
    const double relative = std::sqrt(diff / norm);
    EXPECT_GT(relative, 0.0) << DTypeName(dtype) << " was not rounded at all";
    EXPECT_LT(relative, dtype == DType::kF16 ? 1e-2 : 5e-2) << DTypeName(dtype);
  }
}

TEST_F(ModelFilesTest, ShardsWithAnIndexGiveTheSameModel) {
  const std::vector<TensorData> tensors =
      StoredTensors(config_, ModelWeights::Random(config_, 3), DType::kF32);
  const size_t half = tensors.size() / 2;
  WriteTensors(dir_ + "/model-00001-of-00002.safetensors",
               {tensors.begin(), tensors.begin() + half});
  WriteTensors(dir_ + "/model-00002-of-00002.safetensors", {tensors.begin() + half, tensors.end()});
  nlohmann::json index;
  for (size_t i = 0; i < tensors.size(); ++i) {
    index["weight_map"][tensors[i].name] =
        i < half ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  WriteText(dir_ + "/model.safetensors.index.json", index.dump());
  auto loaded = LoadModel(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(Logits(*loaded), Logits(testing::RandomModel(config_, 3)));

  // An index that sends a tensor to a missing shard.
  index["weight_map"][tensors[0].name] = "model-00003-of-00002.safetensors";
  WriteText(dir_ + "/model.safetensors.index.json", index.dump());
  EXPECT_THAT(std::string(LoadError().message()), HasSubstr("model-00003-of-00002.safetensors"));
}

TEST_F(ModelFilesTest, TiedHeadNeedsNoLmHeadButUntiedDoes) {
  std::vector<TensorData> tensors =
      StoredTensors(config_, ModelWeights::Random(config_, 3), DType::kF32);
  std::erase_if(tensors, [](const TensorData& t) { return t.name == "lm_head.weight"; });
  WriteTensors(dir_ + "/model.safetensors", tensors);
  const absl::Status untied = LoadError();
  EXPECT_EQ(untied.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(untied.message()),
              AllOf(HasSubstr("model.safetensors"), HasSubstr("'lm_head.weight'")));

  ModelConfig tied = config_;
  tied.tie_word_embeddings = true;
  WriteText(dir_ + "/config.json", tied.ToJson());
  auto loaded = LoadModel(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->weights.Get("lm_head.weight").data(),
            (*loaded)->weights.Get("model.embed_tokens.weight").data());
}

TEST_F(ModelFilesTest, MissingTensorIsNamed) {
  std::vector<TensorData> tensors =
      StoredTensors(config_, ModelWeights::Random(config_, 3), DType::kF32);
  std::erase_if(tensors, [](const TensorData& t) {
    return t.name == "model.layers.1.seq_modeling_block.learnable_token_idx";
  });
  WriteTensors(dir_ + "/model.safetensors", tensors);
  const absl::Status status = LoadError();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("model.safetensors"),
                    HasSubstr("model.layers.1.seq_modeling_block.learnable_token_idx")));
}

TEST_F(ModelFilesTest, WrongShapeIsNamed) {
  std::vector<TensorData> tensors =
      StoredTensors(config_, ModelWeights::Random(config_, 3), DType::kF32);
  for (TensorData& t : tensors) {
    if (t.name == "model.layers.0.seq_modeling_block.W1") t.shape = {4, 256};  // Same bytes.
  }
  WriteTensors(dir_ + "/model.safetensors", tensors);
  EXPECT_THAT(std::string(LoadError().message()),
              AllOf(HasSubstr("model.layers.0.seq_modeling_block.W1"), HasSubstr("[4, 256]"),
                    HasSubstr("[4, 16, 16]")));
}

TEST_F(ModelFilesTest, NonFiniteWeightsAreNamedWhateverTheDtype) {
  const ModelWeights weights = ModelWeights::Random(config_, 3);
  const std::string name = "model.layers.1.mlp.down_proj.weight";
  for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const float bad : {std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::infinity()}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " ", bad));
      std::vector<float> values(weights.Get(name).begin(), weights.Get(name).end());
      ASSERT_GT(values.size(), 4100u);
      values[4100] = bad;  // In the check's second block.
      std::vector<TensorData> tensors = StoredTensors(config_, weights, dtype);
      for (TensorData& t : tensors) {
        if (t.name == name) t.bytes = StoredBytes(values, dtype);
      }
      WriteTensors(dir_ + "/model.safetensors", tensors);
      const absl::Status status = LoadError();
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(status.message()),
                  AllOf(HasSubstr("model.safetensors"), HasSubstr(name), HasSubstr("element 4100"),
                        HasSubstr(std::isnan(bad) ? "nan" : "-inf")));
    }
  }
}

TEST_F(ModelFilesTest, WrongDtypeIsNamed) {
  std::vector<TensorData> tensors =
      StoredTensors(config_, ModelWeights::Random(config_, 3), DType::kF32);
  for (TensorData& t : tensors) {
    if (t.name == "model.norm.weight") t.dtype = DType::kI32;  // Same size, wrong meaning.
  }
  WriteTensors(dir_ + "/model.safetensors", tensors);
  EXPECT_THAT(std::string(LoadError().message()),
              AllOf(HasSubstr("model.norm.weight"), HasSubstr("I32")));
}

class CorruptFileTest : public ModelFilesTest {
 protected:
  void SetUp() override {
    ModelFilesTest::SetUp();
    WriteTensors(dir_ + "/model.safetensors",
                 StoredTensors(config_, ModelWeights::Random(config_, 3), DType::kF32));
    good_ = ReadText(dir_ + "/model.safetensors");
  }

  // Loads the model with model.safetensors replaced by `bytes`; expects an error naming the file.
  std::string ErrorFor(const std::string& bytes) {
    WriteText(dir_ + "/model.safetensors", bytes);
    const absl::Status status = LoadError();
    EXPECT_FALSE(status.ok());
    EXPECT_THAT(std::string(status.message()), HasSubstr(dir_ + "/model.safetensors"));
    return std::string(status.message());
  }

  uint64_t HeaderSize() const {
    uint64_t n;
    std::memcpy(&n, good_.data(), 8);
    return n;
  }

  std::string good_;
};

TEST_F(CorruptFileTest, TruncatedAnywhere) {
  for (size_t keep : {size_t{0}, size_t{5}, size_t{8}, size_t{40}, size_t(HeaderSize() + 8),
                      good_.size() / 2, good_.size() - 1}) {
    SCOPED_TRACE(keep);
    ErrorFor(good_.substr(0, keep));
  }
  // Cut inside the data, the tensor whose bytes are gone is named.
  EXPECT_THAT(ErrorFor(good_.substr(0, good_.size() - 1)), HasSubstr("tensor '"));
}

TEST_F(CorruptFileTest, HeaderLengthBeyondTheFile) {
  std::string bytes = good_;
  const uint64_t huge = 1ull << 40;
  std::memcpy(bytes.data(), &huge, 8);
  EXPECT_THAT(ErrorFor(bytes), HasSubstr("header"));
}

TEST_F(CorruptFileTest, HeaderIsNotJson) {
  std::string bytes = good_;
  for (size_t i = 8; i < 30; ++i) bytes[i] = '#';
  EXPECT_THAT(ErrorFor(bytes), HasSubstr("JSON"));
}

TEST_F(CorruptFileTest, OffsetsOutsideTheDataOrOverlapping) {
  auto with_header = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json header = nlohmann::json::parse(good_.substr(8, HeaderSize()));
    edit(header);
    const std::string text = header.dump();  // Offsets count from the data start: they stay valid.
    const uint64_t size = text.size();
    std::string length(8, '\0');
    std::memcpy(length.data(), &size, 8);
    return length + text + good_.substr(8 + HeaderSize());
  };
  EXPECT_THAT(ErrorFor(with_header([](nlohmann::json& h) {
                h["model.norm.weight"]["data_offsets"][1] = 1ull << 40;
              })),
              HasSubstr("'model.norm.weight'"));
  EXPECT_THAT(ErrorFor(with_header([](nlohmann::json& h) {
                h["model.norm.weight"]["data_offsets"] =
                    h["model.embed_tokens.weight"]["data_offsets"];
                h["model.norm.weight"]["shape"] = h["model.embed_tokens.weight"]["shape"];
              })),
              HasSubstr("overlap"));
  EXPECT_THAT(
      ErrorFor(with_header([](nlohmann::json& h) { h["model.norm.weight"]["dtype"] = "F8"; })),
      HasSubstr("'model.norm.weight'"));
}

TEST_F(ModelFilesTest, BadConfigValueNamesFileAndField) {
  WriteText(dir_ + "/config.json", R"({"hidden_size": 64, "num_attention_heads": 5})");
  EXPECT_THAT(std::string(LoadError().message()),
              AllOf(HasSubstr("config.json"), HasSubstr("'hidden_size'")));
}

}  // namespace
}  // namespace ttt
