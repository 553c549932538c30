#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server/model/sentencepiece_model.h"
#include "server/model/tokenizer.h"
#include "server/util/utf8.h"
#include "tests/test_support.h"

namespace ttt {
namespace {

using ::testing::HasSubstr;

constexpr char kMixedText[] = "a naïve café in 東京 🚀 state";

bool IsValidUtf8(const std::string& text) { return FirstInvalidUtf8(text) == std::string::npos; }

// Streams `ids` and returns each token's piece.
std::vector<std::string> StreamPieces(const Tokenizer& tokenizer, const std::vector<int32_t>& ids) {
  StreamingDetokenizer detokenizer(tokenizer);
  std::vector<std::string> pieces;
  for (int32_t id : ids) pieces.push_back(detokenizer.Push(id));
  pieces.push_back(detokenizer.Flush());
  return pieces;
}

TEST(ByteTokenizerTest, EncodesBytesAfterTheSpecialIds) {
  ByteTokenizer tokenizer(3);
  auto ids = tokenizer.Encode("Aé");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, (std::vector<int32_t>{3 + 'A', 3 + 0xC3, 3 + 0xA9}));
  EXPECT_EQ(tokenizer.Decode(*ids), "Aé");
  // Special ids (BOS 1, EOS 2) and ids beyond the bytes contribute nothing.
  EXPECT_EQ(tokenizer.Decode(std::vector<int32_t>{1, 3 + 'h', 3 + 'i', 2, 259, 5000}), "hi");
}

TEST(ByteTokenizerTest, StreamingEmitsWholeCharactersOnly) {
  ByteTokenizer tokenizer(3);
  const std::vector<int32_t> ids = *tokenizer.Encode(kMixedText);
  const std::vector<std::string> pieces = StreamPieces(tokenizer, ids);
  std::string joined;
  int empty_pieces = 0;
  for (const std::string& piece : pieces) {
    EXPECT_TRUE(IsValidUtf8(piece)) << piece;
    empty_pieces += piece.empty();
    joined += piece;
  }
  EXPECT_EQ(joined, kMixedText);
  // ï é: 1 byte held back each; 東 京: 2 each; 🚀: 3; plus the empty final flush.
  EXPECT_EQ(empty_pieces, 1 + 1 + 2 + 2 + 3 + 1);
  // The token that completes 東 emits it whole.
  const size_t at = std::string(kMixedText).find("東");
  EXPECT_EQ(pieces[at + 2], "東");
  EXPECT_EQ(pieces[at], "");
}

TEST(Utf8Test, InvalidBytesBecomeReplacementCharacters) {
  std::string bytes = "ok\xFFgo\xE6\x9D";  // A stray 0xFF, then an unfinished 3-byte character.
  EXPECT_EQ(TakeCompleteUtf8(&bytes, /*final=*/false), "ok\uFFFDgo");
  EXPECT_EQ(bytes, "\xE6\x9D");  // Held back: the next token may finish it.
  EXPECT_EQ(TakeCompleteUtf8(&bytes, /*final=*/true), "\uFFFD");
  std::string broken = "\xE6x";  // A lead byte followed by a non-continuation byte.
  EXPECT_EQ(TakeCompleteUtf8(&broken, /*final=*/false), "\uFFFDx");
  std::string overlong = "\xC0\xAF";
  EXPECT_TRUE(IsValidUtf8(TakeCompleteUtf8(&overlong, true)));
}

class SentencePieceTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::ScratchDir();
    std::filesystem::copy_file(testing::TestDataPath("tokenizer/test-sp.model"),
                               dir_ + "/tokenizer.model");
    config_.vocab_size = 400;
    auto tokenizer = LoadTokenizer(dir_, config_);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    ASSERT_NE(*tokenizer, nullptr);
    tokenizer_ = std::move(*tokenizer);
  }

  std::string dir_;
  ModelConfig config_;
  std::unique_ptr<Tokenizer> tokenizer_;
};

TEST_F(SentencePieceTokenizerTest, RoundTripsAndMatchesSentencePieceDecoding) {
  EXPECT_EQ(tokenizer_->kind(), "sentencepiece");
  auto ids = tokenizer_->Encode(kMixedText);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(tokenizer_->Decode(*ids), kMixedText);
  std::string error;
  auto sp = SentencePieceModel::Load(dir_ + "/tokenizer.model", &error);
  ASSERT_NE(sp, nullptr) << error;
  EXPECT_EQ(tokenizer_->Decode(*ids), sp->Decode(*ids));
}

TEST_F(SentencePieceTokenizerTest, StreamingSplitsNoCharacter) {
  const std::vector<int32_t> ids = *tokenizer_->Encode(kMixedText);
  std::string joined;
  int held_back = 0;
  for (const std::string& piece : StreamPieces(*tokenizer_, ids)) {
    EXPECT_TRUE(IsValidUtf8(piece)) << piece;
    held_back += piece.empty();
    joined += piece;
  }
  EXPECT_EQ(joined, kMixedText);
  EXPECT_GE(held_back, 3);  // Byte-fallback pieces of 東, 京 and 🚀 were held back.
}

TEST_F(SentencePieceTokenizerTest, ModelLargerThanTheVocabularyIsRefused) {
  config_.vocab_size = 100;
  auto tokenizer = LoadTokenizer(dir_, config_);
  EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(tokenizer.status().message()), HasSubstr("tokenizer.model"));
}

TEST_F(SentencePieceTokenizerTest, CorruptModelFileIsAnError) {
  std::ofstream(dir_ + "/tokenizer.model", std::ios::binary | std::ios::trunc) << "not a model";
  auto tokenizer = LoadTokenizer(dir_, config_);
  EXPECT_FALSE(tokenizer.ok());
  EXPECT_THAT(std::string(tokenizer.status().message()), HasSubstr("tokenizer.model"));
}

TEST(LoadTokenizerTest, ByteDeclarationOrNothing) {
  const std::string dir = testing::ScratchDir();
  ModelConfig config;
  config.vocab_size = 259;
  auto none = LoadTokenizer(dir, config);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, nullptr);
  config.byte_token_offset = 3;
  auto bytes = LoadTokenizer(dir, config);
  ASSERT_TRUE(bytes.ok());
  ASSERT_NE(*bytes, nullptr);
  EXPECT_EQ((*bytes)->kind(), "byte");
}

}  // namespace
}  // namespace ttt
