// The one exception type the core throws. Its kind decides the Python class the
// binding layer raises (see csrc/python/module.cc and aoti_sessions/errors.py).
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
  kRun,              // the compiled model reported a failure while running
  kDevice,           // the device runtime (allocation, copy, CUDA) failed
  kSessionFile,      // a session file that is truncated, corrupted or not one
  kFileNotFound,     // a session file that does not exist
  kModelMismatch,    // a session file saved from another model
  kInternal,         // a broken invariant of this library
};

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
