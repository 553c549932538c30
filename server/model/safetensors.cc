#include "server/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "server/util/absl_string_view.h"

namespace ttt {
namespace {

using nlohmann::json;

// The format caps the header at 100 MB; anything larger is corrupt.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

absl::Status FileError(const std::string& path, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", AbslView(what)));
}

absl::Status TensorError(const std::string& path, std::string_view name, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": tensor '", AbslView(name), "': ", AbslView(what)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return absl::InternalError(absl::StrCat(path, ": cannot stat: ", std::strerror(err)));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return FileError(path, absl::StrCat("file of ", size, " bytes is too short for a header"));
  }
  void* mapping = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int mmap_errno = errno;
  ::close(fd);  // The mapping keeps the file alive.
  if (mapping == MAP_FAILED) {
    return absl::InternalError(absl::StrCat(path, ": mmap failed: ", std::strerror(mmap_errno)));
  }
  std::unique_ptr<SafetensorsFile> file(
      new SafetensorsFile(path, static_cast<const std::byte*>(mapping), size));
  if (absl::Status status = file->ParseHeader(); !status.ok()) return status;
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  ::munmap(const_cast<std::byte*>(mapping_), size_);
}

const TensorView* SafetensorsFile::Find(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::Status SafetensorsFile::ParseHeader() {
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | uint8_t(mapping_[i]);
  if (header_size > kMaxHeaderBytes || header_size > size_ - 8) {
    return FileError(path_, absl::StrCat("header length ", header_size, " exceeds the file (",
                                         size_, " bytes): truncated or not safetensors"));
  }
  const char* header_begin = reinterpret_cast<const char*>(mapping_ + 8);
  json header = json::parse(header_begin, header_begin + header_size, nullptr,
                            /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return FileError(path_, "header is not a JSON object");
  }
  const std::byte* data = mapping_ + 8 + header_size;
  const uint64_t data_size = size_ - 8 - header_size;

  struct Range {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Range> ranges;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return FileError(path_, "__metadata__ is not an object");
      for (auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          return FileError(path_, absl::StrCat("__metadata__ value '", key, "' is not a string"));
        }
        metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    if (!entry.is_object()) return TensorError(path_, name, "entry is not an object");
    auto dtype_it = entry.find("dtype");
    auto shape_it = entry.find("shape");
    auto offsets_it = entry.find("data_offsets");
    if (dtype_it == entry.end() || !dtype_it->is_string()) {
      return TensorError(path_, name, "missing or non-string 'dtype'");
    }
    std::optional<DType> dtype = ParseDTypeName(dtype_it->get<std::string>());
    if (!dtype) {
      return TensorError(path_, name,
                         absl::StrCat("unknown dtype '", dtype_it->get<std::string>(), "'"));
    }
    if (shape_it == entry.end() || !shape_it->is_array()) {
      return TensorError(path_, name, "missing or non-array 'shape'");
    }
    TensorView view;
    view.dtype = *dtype;
    uint64_t expected_bytes = DTypeSize(*dtype);
    for (const json& dim : *shape_it) {
      if (!dim.is_number_unsigned())
        return TensorError(path_, name, "shape has a negative or non-integer dimension");
      uint64_t d = dim.get<uint64_t>();
      if (d != 0 && expected_bytes > data_size / d) {
        return TensorError(path_, name, "shape is larger than the file");
      }
      expected_bytes *= d;
      view.shape.push_back(static_cast<int64_t>(d));
    }
    if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
        !(*offsets_it)[0].is_number_unsigned() || !(*offsets_it)[1].is_number_unsigned()) {
      return TensorError(path_, name, "'data_offsets' must be two non-negative integers");
    }
    const uint64_t begin = (*offsets_it)[0].get<uint64_t>();
    const uint64_t end = (*offsets_it)[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      return TensorError(path_, name,
                         absl::StrCat("data_offsets [", begin, ", ", end, ") lie outside the ",
                                      data_size, " data bytes: truncated or corrupt file"));
    }
    if (end - begin != expected_bytes) {
      return TensorError(path_, name,
                         absl::StrCat("holds ", end - begin, " bytes but ", DTypeName(*dtype), " ",
                                      ShapeString(view.shape), " needs ", expected_bytes));
    }
    view.bytes = std::span<const std::byte>(data + begin, end - begin);
    auto [it, inserted] = tensors_.emplace(name, std::move(view));
    ranges.push_back({begin, end, &it->first});
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].begin < ranges[i - 1].end) {
      return TensorError(path_, *ranges[i].name,
                         absl::StrCat("bytes overlap tensor '", *ranges[i - 1].name, "'"));
    }
  }
  return absl::OkStatus();
}

absl::Status WriteSafetensors(const std::string& path, std::span<const TensorToWrite> tensors,
                              const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    if (t.bytes.size() != NumElements(t.shape) * DTypeSize(t.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "': byte count does not match its shape"));
    }
    header[t.name] = {{"dtype", DTypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');  // Keeps tensor data 8-byte aligned.

  const std::string temp_path = path + ".tmp";
  {
    std::ofstream out(temp_path, std::ios::binary | std::ios::trunc);
    if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot create"));
    char length[8];
    uint64_t n = header_text.size();
    for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    out.write(length, 8);
    out.write(header_text.data(), header_text.size());
    for (const TensorToWrite& t : tensors) {
      out.write(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
    }
    if (!out.flush()) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  }
  if (std::rename(temp_path.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat(path, ": rename failed: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace ttt
