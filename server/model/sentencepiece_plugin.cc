// libttt_sentencepiece.so: libsentencepiece behind a C interface (see sentencepiece_plugin.h).
#include "server/model/sentencepiece_plugin.h"

#include <sentencepiece_processor.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

struct TttSpModel {
  sentencepiece::SentencePieceProcessor processor;
  bool adds_dummy_prefix = true;
};

namespace {

void SetError(const std::string& message, char* error, size_t error_size) {
  if (error_size == 0) return;
  const size_t n = std::min(message.size(), error_size - 1);
  std::memcpy(error, message.data(), n);
  error[n] = '\0';
}

template <typename T>
int64_t CopyOut(const T* data, size_t count, T* out, size_t capacity) {
  std::copy(data, data + std::min(count, capacity), out);
  return static_cast<int64_t>(count);
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) TttSpModel* ttt_sp_load(const char* path, char* error,
                                                                size_t error_size) {
  auto* model = new TttSpModel;
  const auto status = model->processor.Load(path);
  if (!status.ok()) {
    SetError(status.ToString(), error, error_size);
    delete model;
    return nullptr;
  }
  // Encoding a lone "a" yields "▁a" exactly when the normalizer adds a dummy prefix.
  std::vector<std::string> pieces;
  if (model->processor.Encode("a", &pieces).ok() && !pieces.empty()) {
    model->adds_dummy_prefix = pieces.front().rfind("\xE2\x96\x81", 0) == 0;
  }
  return model;
}

__attribute__((visibility("default"))) void ttt_sp_free(TttSpModel* model) { delete model; }

__attribute__((visibility("default"))) int32_t ttt_sp_vocab_size(const TttSpModel* model) {
  return model->processor.GetPieceSize();
}

__attribute__((visibility("default"))) int ttt_sp_adds_dummy_prefix(const TttSpModel* model) {
  return model->adds_dummy_prefix ? 1 : 0;
}

__attribute__((visibility("default"))) int64_t ttt_sp_encode(const TttSpModel* model,
                                                             const char* text, size_t length,
                                                             int32_t* ids, size_t capacity,
                                                             char* error, size_t error_size) {
  std::vector<int> out;
  const auto status = model->processor.Encode({text, length}, &out);
  if (!status.ok()) {
    SetError(status.ToString(), error, error_size);
    return -1;
  }
  const std::vector<int32_t> ids32(out.begin(), out.end());
  return CopyOut(ids32.data(), ids32.size(), ids, capacity);
}

__attribute__((visibility("default"))) int64_t ttt_sp_decode(const TttSpModel* model,
                                                             const int32_t* ids, size_t count,
                                                             char* text, size_t capacity) {
  std::string decoded;
  model->processor.Decode(std::vector<int>(ids, ids + count), &decoded);
  return CopyOut(decoded.data(), decoded.size(), text, capacity);
}

__attribute__((visibility("default"))) int64_t ttt_sp_piece_bytes(const TttSpModel* model,
                                                                  int32_t id, char* out,
                                                                  size_t capacity) {
  const sentencepiece::SentencePieceProcessor& p = model->processor;
  std::string bytes;
  if (id < 0 || id >= p.GetPieceSize() || p.IsControl(id)) {
    bytes = "";
  } else if (p.IsUnknown(id)) {
    bytes = " \xE2\x81\x87 ";
  } else if (p.IsByte(id)) {
    unsigned value = 0;
    if (std::sscanf(p.IdToPiece(id).c_str(), "<0x%2X>", &value) == 1)
      bytes = std::string(1, char(value));
  } else {
    const std::string& piece = p.IdToPiece(id);
    for (size_t i = 0; i < piece.size();) {
      if (piece.compare(i, 3, "\xE2\x96\x81") == 0) {
        bytes += ' ';
        i += 3;
      } else {
        bytes += piece[i++];
      }
    }
  }
  return CopyOut(bytes.data(), bytes.size(), out, capacity);
}

}  // extern "C"
