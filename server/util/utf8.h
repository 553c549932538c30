// UTF-8 as RFC 3629 defines it, which proto3's string fields must hold: the detokenizer's
// streamed text, and the C++ client's check of what it sends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace ttt {

// Length of the UTF-8 sequence led by `lead`, or 0 if it cannot lead one.
inline int Utf8SequenceLength(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

// Whether `byte` may be the continuation byte at `index` (1..3) after `lead` (RFC 3629 table).
inline bool ValidContinuation(uint8_t lead, int index, uint8_t byte) {
  if (index == 1) {
    if (lead == 0xE0) return byte >= 0xA0 && byte <= 0xBF;
    if (lead == 0xED) return byte >= 0x80 && byte <= 0x9F;
    if (lead == 0xF0) return byte >= 0x90 && byte <= 0xBF;
    if (lead == 0xF4) return byte >= 0x80 && byte <= 0x8F;
  }
  return byte >= 0x80 && byte <= 0xBF;
}

// The offset of the first sequence in `text` that is not valid UTF-8, or npos if there is none.
inline size_t FirstInvalidUtf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const uint8_t lead = text[i];
    const int length = Utf8SequenceLength(lead);
    if (length == 0 || i + length > text.size()) return i;
    for (int k = 1; k < length; ++k) {
      if (!ValidContinuation(lead, k, text[i + k])) return i;
    }
    i += length;
  }
  return std::string_view::npos;
}

}  // namespace ttt
