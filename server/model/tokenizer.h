// Text ↔ token ids, and incremental detokenization that only ever emits complete UTF-8.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/model/config.h"

namespace ttt {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  virtual std::string_view kind() const = 0;
  virtual absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text) const = 0;
  // The raw bytes token `id` contributes to the text (possibly part of a UTF-8 character; nothing
  // for special tokens and ids outside the vocabulary).
  virtual std::string TokenBytes(int32_t id) const = 0;
  // Whether the text of a sequence drops one leading space (sentencepiece's dummy prefix).
  virtual bool strips_leading_space() const { return false; }
  // The whole text of `ids`; invalid UTF-8 is replaced by U+FFFD.
  std::string Decode(std::span<const int32_t> ids) const;
};

// 256 byte ids starting at `offset`; the ids below it (and above offset + 255) are special.
class ByteTokenizer : public Tokenizer {
 public:
  explicit ByteTokenizer(int32_t offset) : offset_(offset) {}
  std::string_view kind() const override { return "byte"; }
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text) const override;
  std::string TokenBytes(int32_t id) const override;

 private:
  int32_t offset_;
};

// The model's tokenizer: `tokenizer.model` (SentencePiece) when present, else the byte tokenizer
// when config.json declares "tokenizer_type": "byte"; nullptr when the model has neither (it then
// takes token ids only).
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& model_dir,
                                                         const ModelConfig& config);

// Turns a stream of token ids into text pieces as soon as they are whole UTF-8 characters: a
// character split across tokens appears once, complete, with the token that finishes it.
class StreamingDetokenizer {
 public:
  explicit StreamingDetokenizer(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  // The text that token `id` completes (often empty or several characters).
  std::string Push(int32_t id);
  // What is left at the end of the stream: an unfinished character becomes U+FFFD.
  std::string Flush();

 private:
  const Tokenizer& tokenizer_;
  std::string pending_;
  bool at_start_ = true;
};

// Splits off the longest prefix of `*bytes` that is complete UTF-8, replacing invalid bytes by
// U+FFFD; an unfinished character at the end stays in *bytes unless `final`.
std::string TakeCompleteUtf8(std::string* bytes, bool final);

}  // namespace ttt
