#include "server/engine/state_codec.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/model/weights.h"
#include "server/util/absl_string_view.h"

namespace ttt {
namespace {

constexpr std::string_view kMagic = "TTTSTATE";
constexpr uint32_t kVersion = 1;

template <typename T>
void Put(std::string* out, T value) {
  out->append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// Reads from the front of a byte string, failing instead of running past its end.
class Reader {
 public:
  explicit Reader(std::string_view bytes) : bytes_(bytes) {}
  template <typename T>
  bool Get(T* value) {
    if (bytes_.size() < sizeof(T)) return false;
    std::memcpy(value, bytes_.data(), sizeof(T));
    bytes_.remove_prefix(sizeof(T));
    return true;
  }
  bool GetBytes(size_t n, std::string_view* out) {
    if (bytes_.size() < n) return false;
    *out = bytes_.substr(0, n);
    bytes_.remove_prefix(n);
    return true;
  }
  size_t remaining() const { return bytes_.size(); }

 private:
  std::string_view bytes_;
};

absl::Status Corrupt(std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("saved state is corrupt: ", AbslView(what)));
}

}  // namespace

std::string EncodeState(const SavedStateIdentity& model, int64_t length,
                        std::span<const float> state) {
  std::string out(kMagic);
  Put(&out, kVersion);
  Put(&out, model.model_fingerprint);
  Put(&out, static_cast<uint32_t>(model.model_name.size()));
  out += model.model_name;
  Put(&out, length);
  Put(&out, static_cast<uint64_t>(state.size()));
  out.append(reinterpret_cast<const char*>(state.data()), state.size_bytes());
  Put(&out, Fnv1a64(std::as_bytes(std::span(out))));
  return out;
}

absl::StatusOr<DecodedState> DecodeState(std::string_view bytes, const SavedStateIdentity& model,
                                         size_t expected_floats) {
  if (bytes.size() < kMagic.size() + sizeof(uint64_t) || !bytes.starts_with(kMagic)) {
    return Corrupt("not a saved TTT state (bad magic)");
  }
  const std::string_view body = bytes.substr(0, bytes.size() - sizeof(uint64_t));
  uint64_t checksum;
  std::memcpy(&checksum, bytes.data() + body.size(), sizeof(checksum));
  if (checksum != Fnv1a64(std::as_bytes(std::span(body)))) return Corrupt("checksum mismatch");

  Reader reader(body.substr(kMagic.size()));
  uint32_t version, name_size;
  uint64_t fingerprint, floats;
  std::string_view name, payload;
  DecodedState decoded;
  if (!reader.Get(&version)) return Corrupt("truncated header");
  if (version != kVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("saved state has format version ", version, "; this server reads ", kVersion));
  }
  if (!reader.Get(&fingerprint) || !reader.Get(&name_size) || !reader.GetBytes(name_size, &name) ||
      !reader.Get(&decoded.length) || !reader.Get(&floats)) {
    return Corrupt("truncated header");
  }
  if (fingerprint != model.model_fingerprint) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "saved state belongs to model '%s' (fingerprint %016x), not to '%s' (fingerprint %016x)",
        name, fingerprint, model.model_name, model.model_fingerprint));
  }
  if (floats != expected_floats || reader.remaining() != floats * sizeof(float)) {
    return Corrupt(absl::StrCat("holds ", reader.remaining(), " state bytes, the model needs ",
                                expected_floats * sizeof(float)));
  }
  if (decoded.length < 0) return Corrupt("negative length");
  reader.GetBytes(floats * sizeof(float), &payload);
  decoded.state.resize(floats);
  std::memcpy(decoded.state.data(), payload.data(), payload.size());
  return decoded;
}

}  // namespace ttt
