// The safetensors checkpoint format: an 8-byte little-endian header length, a JSON header that maps
// tensor names to {dtype, shape, data_offsets}, then the raw tensor bytes.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "server/model/tensor.h"

namespace ttt {

// A memory-mapped safetensors file whose header has been fully validated: every tensor's dtype is
// known, its byte range lies inside the file, matches its shape, and overlaps no other tensor.
class SafetensorsFile {
 public:
  // Errors name the file and, where one is at fault, the tensor.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorView, std::less<>>& tensors() const { return tensors_; }
  const std::map<std::string, std::string, std::less<>>& metadata() const { return metadata_; }
  // nullptr when absent.
  const TensorView* Find(std::string_view name) const;

 private:
  SafetensorsFile(std::string path, const std::byte* mapping, size_t size)
      : path_(std::move(path)), mapping_(mapping), size_(size) {}
  absl::Status ParseHeader();

  std::string path_;
  const std::byte* mapping_;
  size_t size_;
  std::map<std::string, TensorView, std::less<>> tensors_;
  std::map<std::string, std::string, std::less<>> metadata_;
};

struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;
};

// Writes `tensors` as one safetensors file (atomically: a temporary file renamed into place).
absl::Status WriteSafetensors(const std::string& path, std::span<const TensorToWrite> tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace ttt
