// Early-return helpers for absl::Status / absl::StatusOr (abseil 20220623 ships none).
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TTT_RETURN_IF_ERROR(expr)                        \
  do {                                                   \
    if (absl::Status _ttt_status = (expr); !_ttt_status.ok()) { \
      return _ttt_status;                                \
    }                                                    \
  } while (0)

#define TTT_STATUS_CONCAT_INNER(a, b) a##b
#define TTT_STATUS_CONCAT(a, b) TTT_STATUS_CONCAT_INNER(a, b)

// TTT_ASSIGN_OR_RETURN(auto x, MaybeX()); declares x from a StatusOr or returns its error.
#define TTT_ASSIGN_OR_RETURN(lhs, expr) \
  TTT_ASSIGN_OR_RETURN_IMPL(TTT_STATUS_CONCAT(_ttt_statusor_, __LINE__), lhs, expr)
#define TTT_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                              \
  if (!statusor.ok()) return statusor.status();        \
  lhs = std::move(statusor).value()
