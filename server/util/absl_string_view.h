// Debian 12's abseil is built with its own absl::string_view, a type distinct from
// std::string_view. The project speaks std::string_view; this converts where abseil needs its own.
#pragma once

#include <string_view>

#include "absl/strings/string_view.h"

namespace ttt {

inline absl::string_view AbslView(std::string_view text) { return {text.data(), text.size()}; }

}  // namespace ttt
