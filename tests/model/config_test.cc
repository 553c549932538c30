#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server/model/config.h"
#include "tests/test_support.h"

namespace ttt {
namespace {

using ::testing::HasSubstr;

TEST(ConfigTest, MissingFieldsTakeTheSpecDefaults) {
  auto config = ParseModelConfig("{}");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->vocab_size, 32000);
  EXPECT_EQ(config->hidden_size, 2048);
  EXPECT_EQ(config->num_attention_heads, 32);
  EXPECT_EQ(config->head_dim(), 64);
  EXPECT_EQ(config->mini_batch_size, 16);
  EXPECT_EQ(config->conv_kernel, 4);
  EXPECT_TRUE(config->tie_word_embeddings);
  EXPECT_FALSE(config->share_qk || config->use_gate || config->pre_conv);
  EXPECT_EQ(config->ttt_layer_type, TttLayerType::kLinear);
  EXPECT_DOUBLE_EQ(config->ttt_base_lr, 1.0);
  EXPECT_FALSE(config->pad_token_id.has_value());
  EXPECT_FALSE(config->byte_token_offset.has_value());
}

TEST(ConfigTest, ReadsAGoldenConfigAndIgnoresUnknownFields) {
  auto config = LoadModelConfig(testing::TestDataPath("golden/tiny-mlp-m"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->hidden_size, 64);
  EXPECT_EQ(config->ttt_layer_type, TttLayerType::kMlp);
  EXPECT_DOUBLE_EQ(config->ttt_base_lr, 0.1);
  EXPECT_TRUE(config->share_qk && config->use_gate && config->pre_conv);
  EXPECT_FALSE(config->tie_word_embeddings);
  EXPECT_EQ(config->inner_width(), 64);
}

TEST(ConfigTest, ByteTokenizerDeclaration) {
  auto config = ParseModelConfig(R"({"vocab_size": 259, "tokenizer_type": "byte"})");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->byte_token_offset, 3);
  config =
      ParseModelConfig(R"({"vocab_size": 300, "tokenizer_type": "byte", "byte_token_offset": 0})");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->byte_token_offset, 0);
}

TEST(ConfigTest, ToJsonRoundTrips) {
  auto config = LoadModelConfig(testing::TestDataPath("golden/tiny-linear-m"));
  ASSERT_TRUE(config.ok());
  auto again = ParseModelConfig(config->ToJson());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->ToJson(), config->ToJson());
}

struct BadConfig {
  std::string json;
  std::string field;  // Must be named in the error.
};

class BadConfigTest : public ::testing::TestWithParam<BadConfig> {};

TEST_P(BadConfigTest, IsRejectedNamingTheField) {
  auto config = ParseModelConfig(GetParam().json);
  ASSERT_FALSE(config.ok()) << GetParam().json;
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("'" + GetParam().field + "'"));
}

INSTANTIATE_TEST_SUITE_P(
    EachField, BadConfigTest,
    ::testing::Values(BadConfig{R"({"num_attention_heads": 0})", "num_attention_heads"},
                      BadConfig{R"({"hidden_size": 100, "num_attention_heads": 3})", "hidden_size"},
                      BadConfig{R"({"hidden_size": 96, "num_attention_heads": 32})",
                                "num_attention_heads"},  // Odd head size: no RoPE pairs.
                      BadConfig{R"({"ttt_layer_type": "transformer"})", "ttt_layer_type"},
                      BadConfig{R"({"vocab_size": -5})", "vocab_size"},
                      BadConfig{R"({"vocab_size": "big"})", "vocab_size"},
                      BadConfig{R"({"num_hidden_layers": 0})", "num_hidden_layers"},
                      BadConfig{R"({"intermediate_size": 0})", "intermediate_size"},
                      BadConfig{R"({"mini_batch_size": 0})", "mini_batch_size"},
                      BadConfig{R"({"conv_kernel": -1})", "conv_kernel"},
                      BadConfig{R"({"rms_norm_eps": 0})", "rms_norm_eps"},
                      BadConfig{R"({"rope_theta": -1.0})", "rope_theta"},
                      BadConfig{R"({"ttt_base_lr": -0.1})", "ttt_base_lr"},
                      BadConfig{R"({"share_qk": "yes"})", "share_qk"},
                      BadConfig{R"({"hidden_act": "relu"})", "hidden_act"},
                      BadConfig{R"({"vocab_size": 100, "eos_token_id": 100})", "eos_token_id"},
                      BadConfig{R"({"tokenizer_type": "wordpiece"})", "tokenizer_type"},
                      BadConfig{R"({"vocab_size": 200, "tokenizer_type": "byte"})",
                                "byte_token_offset"}));

TEST(ConfigTest, NotJsonIsRejected) {
  EXPECT_EQ(ParseModelConfig("{\"vocab_size\": ").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseModelConfig("[1, 2]").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ConfigTest, MissingFileIsNotFound) {
  EXPECT_EQ(LoadModelConfig(testing::ScratchDir()).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace ttt
