#include "server/model/tokenizer.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "server/model/sentencepiece_model.h"
#include "server/util/utf8.h"

namespace ttt {
namespace {

constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(std::unique_ptr<SentencePieceModel> model)
      : model_(std::move(model)) {}
  std::string_view kind() const override { return "sentencepiece"; }
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    std::string error;
    if (!model_->Encode(text, &ids, &error)) return absl::InvalidArgumentError(error);
    return ids;
  }
  std::string TokenBytes(int32_t id) const override { return model_->PieceBytes(id); }
  bool strips_leading_space() const override { return model_->adds_dummy_prefix(); }

 private:
  std::unique_ptr<SentencePieceModel> model_;
};

}  // namespace

std::string TakeCompleteUtf8(std::string* bytes, bool final) {
  std::string out;
  size_t i = 0;
  while (i < bytes->size()) {
    const uint8_t lead = (*bytes)[i];
    const int length = Utf8SequenceLength(lead);
    if (length == 0) {
      out += kReplacementCharacter;
      ++i;
      continue;
    }
    int valid = 1;  // Bytes of this sequence seen and valid so far.
    while (valid < length && i + valid < bytes->size() &&
           ValidContinuation(lead, valid, (*bytes)[i + valid])) {
      ++valid;
    }
    if (valid == length) {
      out.append(*bytes, i, length);
      i += length;
    } else if (i + valid == bytes->size() && !final) {
      break;  // Unfinished: wait for the next token.
    } else {
      out += kReplacementCharacter;  // Maximal invalid subpart becomes one U+FFFD.
      i += valid;
    }
  }
  bytes->erase(0, i);
  return out;
}

std::string Tokenizer::Decode(std::span<const int32_t> ids) const {
  StreamingDetokenizer detokenizer(*this);
  std::string text;
  for (int32_t id : ids) text += detokenizer.Push(id);
  return text + detokenizer.Flush();
}

absl::StatusOr<std::vector<int32_t>> ByteTokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (char c : text) ids.push_back(offset_ + static_cast<uint8_t>(c));
  return ids;
}

std::string ByteTokenizer::TokenBytes(int32_t id) const {
  if (id < offset_ || id >= offset_ + 256) return "";
  return std::string(1, static_cast<char>(id - offset_));
}

std::string StreamingDetokenizer::Push(int32_t id) {
  pending_ += tokenizer_.TokenBytes(id);
  if (at_start_ && !pending_.empty()) {
    at_start_ = false;
    if (tokenizer_.strips_leading_space() && pending_.front() == ' ') pending_.erase(0, 1);
  }
  return TakeCompleteUtf8(&pending_, /*final=*/false);
}

std::string StreamingDetokenizer::Flush() { return TakeCompleteUtf8(&pending_, /*final=*/true); }

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& model_dir,
                                                         const ModelConfig& config) {
  const std::string sp_path = model_dir + "/tokenizer.model";
  if (std::ifstream(sp_path).good()) {
    std::string error;
    auto model = SentencePieceModel::Load(sp_path, &error);
    if (model == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(sp_path, ": ", error));
    }
    if (model->vocab_size() > config.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(sp_path, ": ", model->vocab_size(), " pieces exceed vocab_size ",
                       config.vocab_size));
    }
    return std::make_unique<SentencePieceTokenizer>(std::move(model));
  }
  if (config.byte_token_offset) {
    return std::make_unique<ByteTokenizer>(static_cast<int32_t>(*config.byte_token_offset));
  }
  return nullptr;
}

}  // namespace ttt
