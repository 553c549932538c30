// Element types and read-only views of tensors stored in checkpoint files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace ttt {

enum class DType { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

// The safetensors name of a dtype ("F32", "BF16", ...).
const char* DTypeName(DType dtype);
std::optional<DType> ParseDTypeName(std::string_view name);
size_t DTypeSize(DType dtype);
bool IsFloatingPoint(DType dtype);

int64_t NumElements(std::span<const int64_t> shape);
// "[2, 37, 512]", for error messages.
std::string ShapeString(std::span<const int64_t> shape);

// A tensor whose bytes live elsewhere (usually a memory-mapped file). Little-endian, row-major.
struct TensorView {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;

  int64_t num_elements() const { return NumElements(shape); }
};

// Converts an F32, F16 or BF16 tensor to float32. `out` must hold num_elements() floats.
absl::Status ConvertToFloat32(const TensorView& tensor, std::span<float> out);

}  // namespace ttt
