#include "server/model/sentencepiece_model.h"

#include <sentencepiece_processor.h>

#include <cstdio>

namespace ttt {

SentencePieceModel::SentencePieceModel(
    std::unique_ptr<sentencepiece::SentencePieceProcessor> processor)
    : processor_(std::move(processor)) {
  // Encoding a lone "a" yields "▁a" exactly when the normalizer adds a dummy prefix.
  std::vector<std::string> pieces;
  if (processor_->Encode("a", &pieces).ok() && !pieces.empty()) {
    adds_dummy_prefix_ = pieces.front().rfind("\xE2\x96\x81", 0) == 0;
  }
}

SentencePieceModel::~SentencePieceModel() = default;

std::unique_ptr<SentencePieceModel> SentencePieceModel::Load(const std::string& path,
                                                             std::string* error) {
  auto processor = std::make_unique<sentencepiece::SentencePieceProcessor>();
  const auto status = processor->Load(path);
  if (!status.ok()) {
    *error = status.ToString();
    return nullptr;
  }
  return std::unique_ptr<SentencePieceModel>(new SentencePieceModel(std::move(processor)));
}

int SentencePieceModel::vocab_size() const { return processor_->GetPieceSize(); }

bool SentencePieceModel::Encode(std::string_view text, std::vector<int32_t>* ids,
                                std::string* error) const {
  std::vector<int> out;
  const auto status = processor_->Encode({text.data(), text.size()}, &out);
  if (!status.ok()) {
    *error = status.ToString();
    return false;
  }
  ids->assign(out.begin(), out.end());
  return true;
}

std::string SentencePieceModel::Decode(const std::vector<int32_t>& ids) const {
  std::string text;
  processor_->Decode(std::vector<int>(ids.begin(), ids.end()), &text);
  return text;
}

std::string SentencePieceModel::PieceBytes(int32_t id) const {
  if (id < 0 || id >= processor_->GetPieceSize() || processor_->IsControl(id)) return "";
  if (processor_->IsUnknown(id)) return " \xE2\x81\x87 ";
  const std::string& piece = processor_->IdToPiece(id);
  if (processor_->IsByte(id)) {
    unsigned value = 0;
    if (std::sscanf(piece.c_str(), "<0x%2X>", &value) == 1) return std::string(1, char(value));
    return "";
  }
  std::string bytes;
  for (size_t i = 0; i < piece.size();) {
    if (piece.compare(i, 3, "\xE2\x96\x81") == 0) {
      bytes += ' ';
      i += 3;
    } else {
      bytes += piece[i++];
    }
  }
  return bytes;
}

}  // namespace ttt
