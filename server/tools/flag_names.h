// Command-line parsing shared by every binary: abseil flags, accepting --flag-name as well as
// abseil's --flag_name.
#pragma once

#include <string>
#include <vector>

#include "absl/flags/parse.h"

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

// Parses the flags (exiting with a message on a bad one) and returns the positional arguments,
// without the program name.
inline std::vector<std::string> ParseFlags(int argc, char** argv) {
  std::vector<std::string> args = UnderscoreFlagNames(argc, argv);
  std::vector<char*> pointers;
  for (std::string& arg : args) pointers.push_back(arg.data());
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(pointers.size()), pointers.data());
  return std::vector<std::string>(positional.begin() + 1, positional.end());
}

}  // namespace ttt
