#include "server/model/tensor.h"

#include <cstring>

#include <Eigen/Core>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ttt {
namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kF64, "F64", 8}, {DType::kF32, "F32", 4}, {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2}, {DType::kI64, "I64", 8}, {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2}, {DType::kI8, "I8", 1},   {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1},
};

const DTypeInfo& Info(DType dtype) {
  for (const auto& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  return kDTypes[0];  // Unreachable: every enumerator is in the table.
}

template <typename Half>
void ConvertHalf(std::span<const std::byte> bytes, std::span<float> out) {
  for (size_t i = 0; i < out.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, bytes.data() + 2 * i, 2);
    out[i] = static_cast<float>(Eigen::numext::bit_cast<Half>(bits));
  }
}

}  // namespace

const char* DTypeName(DType dtype) { return Info(dtype).name; }
size_t DTypeSize(DType dtype) { return Info(dtype).size; }

std::optional<DType> ParseDTypeName(std::string_view name) {
  for (const auto& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

bool IsFloatingPoint(DType dtype) {
  return dtype == DType::kF64 || dtype == DType::kF32 || dtype == DType::kF16 ||
         dtype == DType::kBF16;
}

int64_t NumElements(std::span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeString(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status ConvertToFloat32(const TensorView& tensor, std::span<float> out) {
  if (static_cast<int64_t>(out.size()) != tensor.num_elements() ||
      tensor.bytes.size() != out.size() * DTypeSize(tensor.dtype)) {
    return absl::InvalidArgumentError("tensor size does not match its shape");
  }
  switch (tensor.dtype) {
    case DType::kF32:
      std::memcpy(out.data(), tensor.bytes.data(), tensor.bytes.size());
      return absl::OkStatus();
    case DType::kF16:
      ConvertHalf<Eigen::half>(tensor.bytes, out);
      return absl::OkStatus();
    case DType::kBF16:
      ConvertHalf<Eigen::bfloat16>(tensor.bytes, out);
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dtype ", DTypeName(tensor.dtype), " is not F32, F16 or BF16"));
  }
}

}  // namespace ttt
