// Where the bundled default model is: installed beside the binaries (../share/ttt-serve/models),
// else in the source tree the binaries were built from.
#pragma once

#include <filesystem>
#include <string>

namespace ttt {

inline constexpr char kBundledModelName[] = "ttt-linear-3m-en";

inline std::string DefaultModelDir() {
  std::error_code error;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) {
    const std::filesystem::path installed =
        exe.parent_path() / ".." / "share" / "ttt-serve" / "models" / kBundledModelName;
    if (std::filesystem::exists(installed / "config.json")) return installed.lexically_normal();
  }
  return std::string(TTT_SOURCE_DIR) + "/models/" + kBundledModelName;
}

}  // namespace ttt
