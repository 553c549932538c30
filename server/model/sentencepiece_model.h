// A SentencePiece model, through the plugin that keeps libsentencepiece (and the protobuf copy
// inside it) out of the process's global symbols: see sentencepiece_plugin.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

struct TttSpModel;

namespace ttt {

class SentencePieceModel {
 public:
  // Returns nullptr and sets *error on failure.
  static std::unique_ptr<SentencePieceModel> Load(const std::string& path, std::string* error);
  ~SentencePieceModel();

  int vocab_size() const { return vocab_size_; }
  // Returns false and sets *error on failure.
  bool Encode(std::string_view text, std::vector<int32_t>* ids, std::string* error) const;
  std::string Decode(const std::vector<int32_t>& ids) const;
  // The text bytes piece `id` stands for: '▁' becomes ' ', a byte piece <0xAB> its byte, control
  // pieces nothing; unknown pieces the same " ⁇ " sentencepiece's decoder writes.
  std::string PieceBytes(int32_t id) const;
  // Whether encoding adds a leading space (add_dummy_prefix), which decoding removes again.
  bool adds_dummy_prefix() const { return adds_dummy_prefix_; }

 private:
  SentencePieceModel() = default;

  TttSpModel* model_ = nullptr;
  int vocab_size_ = 0;
  bool adds_dummy_prefix_ = true;
  std::vector<std::string> piece_bytes_;  // By id.
};

}  // namespace ttt
