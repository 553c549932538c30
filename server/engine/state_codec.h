// The byte format of a saved sequence state, the same for every backend:
//
//   "TTTSTATE"  magic (8 bytes)
//   u32         format version (1)
//   u64         model fingerprint (ModelWeights::fingerprint)
//   u32 + bytes model name, for error messages
//   i64         tokens absorbed
//   u64         float count, then that many float32 (StateLayout order)
//   u64         FNV-1a checksum of everything before it
//
// All integers little-endian. A state only restores into the model it was saved from.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace ttt {

struct SavedStateIdentity {
  uint64_t model_fingerprint = 0;
  std::string model_name;
};

std::string EncodeState(const SavedStateIdentity& model, int64_t length,
                        std::span<const float> state);

struct DecodedState {
  int64_t length = 0;
  std::vector<float> state;
};

// Checks magic, version, checksum, model and size: corrupt bytes and another model's states are
// InvalidArgument / FailedPrecondition errors, never a wrong state.
absl::StatusOr<DecodedState> DecodeState(std::string_view bytes, const SavedStateIdentity& model,
                                         size_t expected_floats);

}  // namespace ttt
