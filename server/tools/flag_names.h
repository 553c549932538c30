// Lets every binary accept --flag-name as well as abseil's --flag_name.
#pragma once

#include <string>
#include <vector>

namespace ttt {

// Copies argv with dashes inside "--flag-name" (before any '=') turned into underscores. Arguments
// after a bare "--" are left alone.
inline std::vector<std::string> UnderscoreFlagNames(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& arg = args[i];
    if (arg == "--") break;
    if (arg.size() < 3 || arg[0] != '-' || arg[1] != '-') continue;
    for (size_t c = 2; c < arg.size() && arg[c] != '='; ++c) {
      if (arg[c] == '-') arg[c] = '_';
    }
  }
  return args;
}

}  // namespace ttt
