// POSIX file reads and writes that retry interrupted and short calls: the one
// place the core loops over read(2) / write(2). Failures are reported, not
// thrown, so that each caller chooses the error kind and words its message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace aoti_sessions {

// An open file descriptor, closed when the owner goes.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor();
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Closes now; false (errno set) if close(2) reports an error.
  bool Close();

 private:
  int fd_ = -1;
};

// Reads up to `bytes` at `offset` into `dst`. Returns how many were read
// (fewer only at the end of the file), or -1 with errno set.
int64_t ReadAt(int fd, void* dst, size_t bytes, uint64_t offset);

// Writes all `bytes` at the file position; false with errno set on failure.
bool WriteAll(int fd, const void* data, size_t bytes);

// The text of an errno value.
std::string ErrnoText(int err);

}  // namespace aoti_sessions
