// A thin wrapper over libsentencepiece. Debian's sentencepiece header declares its own
// absl::string_view, which clashes with abseil's: only sentencepiece_model.cc includes it, and
// this header includes no abseil either.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace ttt {

class SentencePieceModel {
 public:
  // Returns nullptr and sets *error on failure.
  static std::unique_ptr<SentencePieceModel> Load(const std::string& path, std::string* error);
  ~SentencePieceModel();

  int vocab_size() const;
  // Returns false and sets *error on failure.
  bool Encode(std::string_view text, std::vector<int32_t>* ids, std::string* error) const;
  std::string Decode(const std::vector<int32_t>& ids) const;
  // The text bytes piece `id` stands for: '▁' becomes ' ', a byte piece <0xAB> its byte, control
  // pieces nothing; unknown pieces the same " ⁇ " sentencepiece's decoder writes.
  std::string PieceBytes(int32_t id) const;
  // Whether encoding adds a leading space (add_dummy_prefix), which decoding removes again.
  bool adds_dummy_prefix() const { return adds_dummy_prefix_; }

 private:
  explicit SentencePieceModel(std::unique_ptr<sentencepiece::SentencePieceProcessor> processor);

  std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_;
  bool adds_dummy_prefix_ = true;
};

}  // namespace ttt
