// The one exception type the core throws. Its kind decides the Python class the
// binding layer raises: the table is python/aoti_sessions/errors.py (CORE_ERRORS),
// looked up by KindName. The caller of a fallible step chooses the kind, since
// the same step (a container bind, say) is a package fault at load and a run
// fault on the run path.
#pragma once

#include <stdexcept>
#include <string>

namespace aoti_sessions {

enum class ErrorKind {
  kInvalidArgument,  // a wrong value from the caller (Python ValueError)
  kTypeMismatch,     // a wrong type or dtype from the caller (Python TypeError)
  kPackage,          // a model library or package that cannot be loaded
  kCapacity,         // max_sessions / memory budgets would be exceeded
  kSessionClosed,    // the session (or its engine) was closed
  kOtherProcess,     // an engine used in a child process made by fork()
  kRun,              // the compiled model reported a failure while running
  kDevice,           // the device runtime (allocation, copy, CUDA) failed
  kSessionFile,      // a session file that is truncated, corrupted or not one
  kFileNotFound,     // a session file that does not exist
  kModelMismatch,    // a session file saved from another model
  kInternal,         // a broken invariant of this library
};

// Every kind, for tables and tests.
inline constexpr ErrorKind kAllErrorKinds[] = {
    ErrorKind::kInvalidArgument, ErrorKind::kTypeMismatch, ErrorKind::kPackage,
    ErrorKind::kCapacity,        ErrorKind::kSessionClosed, ErrorKind::kOtherProcess,
    ErrorKind::kRun,             ErrorKind::kDevice,        ErrorKind::kSessionFile,
    ErrorKind::kFileNotFound,    ErrorKind::kModelMismatch, ErrorKind::kInternal,
};

// The kind's name in the Python table ("invalid_argument", "package", ...).
inline const char* KindName(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument: return "invalid_argument";
    case ErrorKind::kTypeMismatch: return "type_mismatch";
    case ErrorKind::kPackage: return "package";
    case ErrorKind::kCapacity: return "capacity";
    case ErrorKind::kSessionClosed: return "session_closed";
    case ErrorKind::kOtherProcess: return "other_process";
    case ErrorKind::kRun: return "run";
    case ErrorKind::kDevice: return "device";
    case ErrorKind::kSessionFile: return "session_file";
    case ErrorKind::kFileNotFound: return "file_not_found";
    case ErrorKind::kModelMismatch: return "model_mismatch";
    case ErrorKind::kInternal: return "internal";
  }
  return "internal";
}

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message)
      : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

[[noreturn]] inline void Throw(ErrorKind kind, const std::string& message) {
  throw Error(kind, message);
}

}  // namespace aoti_sessions
